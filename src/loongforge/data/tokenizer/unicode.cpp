#include "loongforge/data/tokenizer/unicode.h"

#include "loongforge/core/error.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <utf8proc.h>

#include <chrono>
#include <cstdlib>
#include <stdexcept>

namespace lf::data::tok {

namespace {
// Length of the valid UTF-8 sequence at S[I], or 0 with *BAD set to the length of its maximal invalid subpart.
size_t valid_seq_len(std::string_view s, size_t i, size_t* bad) {
  auto b = static_cast<unsigned char>(s[i]);
  if (b < 0x80) return 1;
  size_t n;
  unsigned char lo = 0x80, hi = 0xBF;
  if (b >= 0xC2 && b <= 0xDF) n = 2;
  else if (b >= 0xE0 && b <= 0xEF) { n = 3; if (b == 0xE0) lo = 0xA0; if (b == 0xED) hi = 0x9F; }
  else if (b >= 0xF0 && b <= 0xF4) { n = 4; if (b == 0xF0) lo = 0x90; if (b == 0xF4) hi = 0x8F; }
  else { *bad = 1; return 0; }
  for (size_t k = 1; k < n; ++k) {
    if (i + k >= s.size()) { *bad = k; return 0; }
    auto c = static_cast<unsigned char>(s[i + k]);
    unsigned char l = k == 1 ? lo : 0x80, h = k == 1 ? hi : 0xBF;
    if (c < l || c > h) { *bad = k; return 0; }
  }
  return n;
}
}  // namespace

bool valid_utf8(std::string_view s) {
  size_t bad = 0;
  for (size_t i = 0; i < s.size();) {
    size_t n = valid_seq_len(s, i, &bad);
    if (n == 0) return false;
    i += n;
  }
  return true;
}

std::string utf8_lossy(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    size_t bad = 0, n = valid_seq_len(s, i, &bad);
    if (n) { out.append(s.substr(i, n)); i += n; }
    else { out += "\xEF\xBF\xBD"; i += bad; }
  }
  return out;
}

size_t utf8_char_len(unsigned char b) {
  if (b < 0x80) return 1;
  if ((b & 0xE0) == 0xC0) return 2;
  if ((b & 0xF0) == 0xE0) return 3;
  if ((b & 0xF8) == 0xF0) return 4;
  return 1;
}

uint32_t next_codepoint(std::string_view s, size_t& i) {
  auto b = static_cast<unsigned char>(s[i]);
  size_t n = std::min(utf8_char_len(b), s.size() - i);
  uint32_t cp = n == 1 ? b : b & (0x7F >> n);
  for (size_t k = 1; k < n; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
  i += n;
  return cp;
}

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) out += char(cp);
  else if (cp < 0x800) { out += char(0xC0 | (cp >> 6)); out += char(0x80 | (cp & 0x3F)); }
  else if (cp < 0x10000) {
    out += char(0xE0 | (cp >> 12)); out += char(0x80 | ((cp >> 6) & 0x3F)); out += char(0x80 | (cp & 0x3F));
  } else {
    out += char(0xF0 | (cp >> 18)); out += char(0x80 | ((cp >> 12) & 0x3F));
    out += char(0x80 | ((cp >> 6) & 0x3F)); out += char(0x80 | (cp & 0x3F));
  }
}

std::vector<uint32_t> codepoints(std::string_view s) {
  std::vector<uint32_t> cps;
  for (size_t i = 0; i < s.size();) cps.push_back(next_codepoint(s, i));
  return cps;
}

bool is_whitespace(uint32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

bool is_numeric(uint32_t c) {
  auto cat = utf8proc_category(static_cast<utf8proc_int32_t>(c));
  return cat == UTF8PROC_CATEGORY_ND || cat == UTF8PROC_CATEGORY_NL || cat == UTF8PROC_CATEGORY_NO;
}

bool is_word_char(uint32_t c) {
  if (c == '_' || c == 0x200C || c == 0x200D) return true;
  auto cat = utf8proc_category(static_cast<utf8proc_int32_t>(c));
  return (cat >= UTF8PROC_CATEGORY_LU && cat <= UTF8PROC_CATEGORY_LO) ||
         (cat >= UTF8PROC_CATEGORY_MN && cat <= UTF8PROC_CATEGORY_ME) || cat == UTF8PROC_CATEGORY_ND ||
         cat == UTF8PROC_CATEGORY_NL || cat == UTF8PROC_CATEGORY_PC;
}

std::string unicode_normalize(std::string_view s, NormForm form) {
  if (s.empty()) return {};
  int opts = UTF8PROC_STABLE;
  switch (form) {
    case NormForm::NFC: opts |= UTF8PROC_COMPOSE; break;
    case NormForm::NFD: opts |= UTF8PROC_DECOMPOSE; break;
    case NormForm::NFKC: opts |= UTF8PROC_COMPOSE | UTF8PROC_COMPAT; break;
    case NormForm::NFKD: opts |= UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT; break;
  }
  utf8proc_uint8_t* dst = nullptr;
  auto n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(s.data()), static_cast<utf8proc_ssize_t>(s.size()),
                        &dst, static_cast<utf8proc_option_t>(opts));
  if (n < 0) throw std::runtime_error(std::string("unicode normalization failed: ") + utf8proc_errmsg(n));
  std::string out(reinterpret_cast<char*>(dst), static_cast<size_t>(n));
  std::free(dst);
  return out;
}

std::string unicode_lowercase(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    uint32_t cp = next_codepoint(s, i);
    if (cp == 0x130) { out += "i\xCC\x87"; continue; }  // the one multi-character lowercase mapping
    append_utf8(out, static_cast<uint32_t>(utf8proc_tolower(static_cast<utf8proc_int32_t>(cp))));
  }
  return out;
}

namespace {
struct ByteLevelTables {
  std::array<std::string, 256> to_char;
  std::array<int, 324> to_byte{};  // code points 0..323
  ByteLevelTables() {
    to_byte.fill(-1);
    uint32_t extra = 256;
    for (int b = 0; b < 256; ++b) {
      bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
      uint32_t cp = printable ? static_cast<uint32_t>(b) : extra++;
      append_utf8(to_char[b], cp);
      to_byte[cp] = b;
    }
  }
};
const ByteLevelTables& tables() {
  static const ByteLevelTables t;
  return t;
}
}  // namespace

const std::array<std::string, 256>& byte_to_char() { return tables().to_char; }

std::optional<uint8_t> char_to_byte(uint32_t cp) {
  if (cp >= tables().to_byte.size() || tables().to_byte[cp] < 0) return std::nullopt;
  return static_cast<uint8_t>(tables().to_byte[cp]);
}

std::string bytes_to_byte_level(std::string_view bytes) {
  const auto& t = byte_to_char();
  std::string out;
  out.reserve(bytes.size() * 2);
  for (unsigned char b : bytes) out += t[b];
  return out;
}

Regex::Regex(const std::string& pattern, std::string origin) : origin_(std::move(origin)) {
  int err = 0;
  PCRE2_SIZE off = 0;
  auto* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), PCRE2_UTF | PCRE2_UCP,
                             &err, &off, nullptr);
  if (!code) {
    PCRE2_UCHAR buf[256];
    pcre2_get_error_message(err, buf, sizeof buf);
    throw std::runtime_error("invalid regex at offset " + std::to_string(off) + ": " +
                             reinterpret_cast<const char*>(buf));
  }
  pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);  // falls back to the interpreter when JIT is unavailable
  code_ = code;
}

Regex::~Regex() { pcre2_code_free(static_cast<pcre2_code*>(code_)); }

std::vector<Regex::Match> Regex::find_all(std::string_view s) const {
  auto* code = static_cast<pcre2_code*>(code_);
  // One match block per thread and pattern would be faster; one per call keeps this simple and thread-safe.
  std::unique_ptr<pcre2_match_data, decltype(&pcre2_match_data_free)> md(
      pcre2_match_data_create_from_pattern(code, nullptr), &pcre2_match_data_free);
  std::unique_ptr<pcre2_match_context, decltype(&pcre2_match_context_free)> mc(pcre2_match_context_create(nullptr),
                                                                                 &pcre2_match_context_free);
  pcre2_set_match_limit(mc.get(), kMatchLimit);
  pcre2_set_depth_limit(mc.get(), kDepthLimitKiB);  // with JIT this does not apply; the match limit does
  auto start = std::chrono::steady_clock::now();
  std::vector<Match> out;
  size_t pos = 0;
  while (pos <= s.size()) {
    int rc = pcre2_match(code, reinterpret_cast<PCRE2_SPTR>(s.data()), s.size(), pos, PCRE2_NO_UTF_CHECK, md.get(),
                         mc.get());
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) {
      PCRE2_UCHAR buf[256];
      pcre2_get_error_message(rc, buf, sizeof buf);
      std::string why = reinterpret_cast<const char*>(buf);
      if (rc == PCRE2_ERROR_MATCHLIMIT || rc == PCRE2_ERROR_DEPTHLIMIT || rc == PCRE2_ERROR_HEAPLIMIT)
        why += " (catastrophic backtracking?)";
      throw lf::Error(origin_ + ": the pattern failed on a " + std::to_string(s.size()) + "-byte text: " + why);
    }
    if (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() > kSecondsLimit)
      throw lf::Error(origin_ + ": the pattern took more than " + std::to_string(int(kSecondsLimit)) + " s on a " +
                      std::to_string(s.size()) + "-byte text (catastrophic backtracking?)");
    PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md.get());
    Match m{ov[0], ov[1]};
    out.push_back(m);
    if (m.end > m.start) pos = m.end;
    else if (m.end >= s.size()) break;
    else pos = m.end + utf8_char_len(static_cast<unsigned char>(s[m.end]));
  }
  return out;
}

}  // namespace lf::data::tok
