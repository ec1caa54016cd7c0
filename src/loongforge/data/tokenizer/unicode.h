// UTF-8 helpers, Unicode normalization (utf8proc), the GPT-2 byte-level alphabet and a PCRE2 regex wrapper, as
// used by the tokenizer components.
#pragma once
#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace lf::data::tok {

bool valid_utf8(std::string_view s);
// Bytes to text as Rust's String::from_utf8_lossy: each maximal invalid subpart becomes U+FFFD.
std::string utf8_lossy(std::string_view bytes);
// Length in bytes of the UTF-8 character starting with LEAD (1 for a stray byte).
size_t utf8_char_len(unsigned char lead);
// Decodes the character at S[I] (valid UTF-8 assumed) and advances I.
uint32_t next_codepoint(std::string_view s, size_t& i);
void append_utf8(std::string& out, uint32_t cp);
std::vector<uint32_t> codepoints(std::string_view s);

bool is_whitespace(uint32_t cp);  // Unicode White_Space (Rust char::is_whitespace)
bool is_word_char(uint32_t cp);   // alphanumeric or '_'
bool is_numeric(uint32_t cp);     // Nd, Nl, No (Rust char::is_numeric)

enum class NormForm { NFC, NFD, NFKC, NFKD };
std::string unicode_normalize(std::string_view s, NormForm form);
std::string unicode_lowercase(std::string_view s);

// GPT-2 byte-level alphabet: byte -> a printable character (as UTF-8), and back.
const std::array<std::string, 256>& byte_to_char();
std::optional<uint8_t> char_to_byte(uint32_t cp);
std::string bytes_to_byte_level(std::string_view bytes);

// A PCRE2 pattern compiled in UTF + UCP mode (Unicode \s, \w, \d and properties), JIT-compiled when possible.
class Regex {
 public:
  // Throws std::runtime_error with PCRE2's message. ORIGIN names the pattern for match-time errors
  // ("tokenizer.json: field 'pre_tokenizer.pattern.Regex'").
  explicit Regex(const std::string& pattern, std::string origin = "regex");
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;
  struct Match {
    size_t start, end;
  };
  // All non-overlapping matches, left to right; after an empty match the search resumes one character later.
  // Patterns come from files: one match attempt is bounded by PCRE2's match and depth limits (kMatchLimit,
  // kDepthLimitKiB) and a whole call by kSecondsLimit, so catastrophic backtracking ends in an lf::Error naming
  // ORIGIN, never a hang.
  std::vector<Match> find_all(std::string_view s) const;

  static constexpr uint32_t kMatchLimit = 1'000'000;
  static constexpr uint32_t kDepthLimitKiB = 64 * 1024;
  static constexpr double kSecondsLimit = 5.0;

 private:
  void* code_;  // pcre2_code_8*
  std::string origin_;
};

}  // namespace lf::data::tok
