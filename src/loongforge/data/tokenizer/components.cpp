// The input side of a tokenizer.json: the config helpers, patterns and splitting, normalizers and pre-tokenizers
// (post-processors and decoders: decoders.cpp).
#include "loongforge/data/tokenizer/components.h"

#include <utf8proc.h>

#include <algorithm>
#include <stdexcept>

#include "loongforge/core/error.h"
#include "loongforge/core/json.h"

namespace lf::data::tok {

// ---------------------------------------------------------------------------------------------- config helpers

namespace {

// Ctx's messages name the field, not its value.
JsonReader reader(const Ctx& ctx, const json& obj, const std::string& field) {
  JsonReader r(obj, ctx.file, field);
  r.quote_values(false);
  return r;
}

}  // namespace

void Ctx::fail(const std::string& field, const std::string& what) const { throw file_error(file, field, what); }

const json& Ctx::get(const json& obj, const std::string& key, const std::string& field) const {
  return reader(*this, obj, field).get(key);
}

std::string Ctx::str(const json& obj, const std::string& key, const std::string& field) const {
  return reader(*this, obj, field).string(key);
}

std::string Ctx::str_or(const json& obj, const std::string& key, const std::string& field,
                        const std::string& dflt) const {
  return reader(*this, obj, field).string(key, dflt);
}

bool Ctx::boolean_or(const json& obj, const std::string& key, const std::string& field, bool dflt) const {
  return reader(*this, obj, field).boolean(key, dflt);
}

int64_t Ctx::integer_or(const json& obj, const std::string& key, const std::string& field, int64_t dflt) const {
  return reader(*this, obj, field).integer(key, dflt);
}

std::string Ctx::type(const json& obj, const std::string& field) const { return str(obj, "type", field); }

uint32_t single_char(const Ctx& ctx, const json& obj, const std::string& key, const std::string& field) {
  std::string s = ctx.str(obj, key, field);
  auto cps = codepoints(s);
  if (cps.size() != 1) ctx.fail(field + "." + key, "expected a single character");
  return cps[0];
}

Prepend3 parse_prepend_scheme(const json& j, const Ctx& ctx, const std::string& field) {
  if (j.contains("prepend_scheme")) {
    std::string s = ctx.str(j, "prepend_scheme", field);
    if (s == "always") return Prepend3::Always;
    if (s == "first") return Prepend3::First;
    if (s == "never") return Prepend3::Never;
    ctx.fail(field + ".prepend_scheme", "unsupported '" + s + "'");
  }
  return ctx.boolean_or(j, "add_prefix_space", field, true) ? Prepend3::Always : Prepend3::Never;
}

namespace {

std::vector<Regex::Match> char_matches(std::string_view s, bool (*pred)(uint32_t)) {
  std::vector<Regex::Match> out;
  for (size_t i = 0; i < s.size();) {
    size_t start = i;
    if (pred(next_codepoint(s, i))) out.push_back({start, i});
  }
  return out;
}

bool is_punctuation(uint32_t c) {
  if (c < 0x80) return (c >= 33 && c <= 47) || (c >= 58 && c <= 64) || (c >= 91 && c <= 96) || (c >= 123 && c <= 126);
  auto cat = utf8proc_category(static_cast<utf8proc_int32_t>(c));
  return cat >= UTF8PROC_CATEGORY_PC && cat <= UTF8PROC_CATEGORY_PO;
}

SplitBehavior parse_behavior(const Ctx& ctx, const json& obj, const std::string& field) {
  std::string b = ctx.str(obj, "behavior", field);
  if (b == "Removed") return SplitBehavior::Removed;
  if (b == "Isolated") return SplitBehavior::Isolated;
  if (b == "MergedWithPrevious") return SplitBehavior::MergedWithPrevious;
  if (b == "MergedWithNext") return SplitBehavior::MergedWithNext;
  if (b == "Contiguous") return SplitBehavior::Contiguous;
  ctx.fail(field + ".behavior", "unsupported '" + b + "'");
}

}  // namespace

// ---------------------------------------------------------------------------------------------- patterns, splitting

Pattern parse_pattern(const json& j, const Ctx& ctx, const std::string& field) {
  Pattern p;
  if (!j.is_object() || j.size() != 1) ctx.fail(field, "expected {\"String\": ...} or {\"Regex\": ...}");
  if (j.contains("String")) {
    p.literal = ctx.str(j, "String", field);
  } else if (j.contains("Regex")) {
    try {
      p.regex = std::make_shared<Regex>(ctx.str(j, "Regex", field), ctx.file + ": field '" + field + ".Regex'");
    } catch (const std::runtime_error& e) {
      if (dynamic_cast<const lf::Error*>(&e)) throw;
      ctx.fail(field + ".Regex", e.what());
    }
  } else {
    ctx.fail(field, "expected {\"String\": ...} or {\"Regex\": ...}");
  }
  return p;
}

std::vector<Regex::Match> Pattern::find_all(std::string_view s) const {
  if (regex) return regex->find_all(s);
  std::vector<Regex::Match> out;
  if (literal.empty()) return out;
  for (size_t pos = s.find(literal); pos != std::string_view::npos; pos = s.find(literal, pos + literal.size()))
    out.push_back({pos, pos + literal.size()});
  return out;
}

std::string Pattern::replace_all(std::string_view s, const std::string& content) const {
  std::string out;
  size_t prev = 0;
  for (auto m : find_all(s)) {
    out.append(s.substr(prev, m.start - prev));
    out += content;
    prev = m.end;
  }
  out.append(s.substr(prev));
  return out;
}

std::vector<Piece> split_with(const Piece& p, const std::vector<Regex::Match>& matches, SplitBehavior behavior,
                              bool invert) {
  struct Seg {
    size_t a, b;
    bool flag;  // is a match, then: is removed
  };
  const std::string& s = p.text;
  std::vector<Seg> segs;
  size_t prev = 0;
  for (auto m : matches) {
    if (prev != m.start) segs.push_back({prev, m.start, false});
    segs.push_back({m.start, m.end, true});
    prev = m.end;
  }
  if (prev != s.size() || segs.empty()) segs.push_back({prev, s.size(), false});
  if (invert)
    for (auto& g : segs) g.flag = !g.flag;

  std::vector<Seg> out;
  bool prev_match = false;
  switch (behavior) {
    case SplitBehavior::Removed: out = segs; break;
    case SplitBehavior::Isolated:
      for (auto g : segs) out.push_back({g.a, g.b, false});
      break;
    case SplitBehavior::MergedWithPrevious:
      for (auto g : segs) {
        if (g.flag && !prev_match && !out.empty()) out.back().b = g.b;
        else out.push_back({g.a, g.b, false});
        prev_match = g.flag;
      }
      break;
    case SplitBehavior::MergedWithNext:
      for (auto it = segs.rbegin(); it != segs.rend(); ++it) {
        if (it->flag && !prev_match && !out.empty()) out.back().a = it->a;
        else out.push_back({it->a, it->b, false});
        prev_match = it->flag;
      }
      std::reverse(out.begin(), out.end());
      break;
    case SplitBehavior::Contiguous:
      for (auto g : segs) {
        if (g.flag == prev_match && !out.empty()) out.back().b = g.b;
        else out.push_back({g.a, g.b, false});
        prev_match = g.flag;
      }
      break;
  }
  std::vector<Piece> pieces;
  for (auto g : out)
    if (!g.flag && g.b > g.a) pieces.push_back({s.substr(g.a, g.b - g.a), p.at_origin && g.a == 0});
  return pieces;
}

// ---------------------------------------------------------------------------------------------- normalizers

namespace {

struct NormalizeForm : Normalizer {
  NormForm form;
  explicit NormalizeForm(NormForm f) : form(f) {}
  std::string normalize(std::string s) const override { return unicode_normalize(s, form); }
};

struct Lowercase : Normalizer {
  std::string normalize(std::string s) const override { return unicode_lowercase(s); }
};

struct StripAccents : Normalizer {  // drops combining marks (Mn, Mc, Me)
  std::string normalize(std::string s) const override {
    std::string out;
    for (size_t i = 0; i < s.size();) {
      uint32_t cp = next_codepoint(s, i);
      auto cat = utf8proc_category(static_cast<utf8proc_int32_t>(cp));
      if (cat < UTF8PROC_CATEGORY_MN || cat > UTF8PROC_CATEGORY_ME) append_utf8(out, cp);
    }
    return out;
  }
};

struct Strip : Normalizer {
  bool left, right;
  Strip(bool l, bool r) : left(l), right(r) {}
  std::string normalize(std::string s) const override {
    size_t a = 0, b = s.size();
    if (left)
      while (a < b) {
        size_t i = a;
        if (!is_whitespace(next_codepoint(s, i))) break;
        a = i;
      }
    if (right)
      while (b > a) {
        size_t j = b - 1;
        while (j > a && (static_cast<unsigned char>(s[j]) & 0xC0) == 0x80) --j;
        size_t i = j;
        if (!is_whitespace(next_codepoint(s, i))) break;
        b = j;
      }
    return s.substr(a, b - a);
  }
};

struct Prepend : Normalizer {
  std::string prefix;
  std::string normalize(std::string s) const override { return s.empty() ? s : prefix + s; }
};

struct Replace : Normalizer {
  Pattern pattern;
  std::string content;
  std::string normalize(std::string s) const override { return pattern.replace_all(s, content); }
};

struct ByteLevelNormalizer : Normalizer {
  std::string normalize(std::string s) const override { return bytes_to_byte_level(s); }
};

struct NormalizerSequence : Normalizer {
  std::vector<std::unique_ptr<Normalizer>> items;
  std::string normalize(std::string s) const override {
    for (const auto& n : items) s = n->normalize(std::move(s));
    return s;
  }
};

}  // namespace

std::unique_ptr<Normalizer> make_normalizer(const json& j, const Ctx& ctx, const std::string& field) {
  if (j.is_null()) return nullptr;
  std::string t = ctx.type(j, field);
  if (t == "NFC") return std::make_unique<NormalizeForm>(NormForm::NFC);
  if (t == "NFD") return std::make_unique<NormalizeForm>(NormForm::NFD);
  if (t == "NFKC") return std::make_unique<NormalizeForm>(NormForm::NFKC);
  if (t == "NFKD") return std::make_unique<NormalizeForm>(NormForm::NFKD);
  if (t == "Lowercase") return std::make_unique<Lowercase>();
  if (t == "StripAccents") return std::make_unique<StripAccents>();
  if (t == "ByteLevel") return std::make_unique<ByteLevelNormalizer>();
  if (t == "Strip")
    return std::make_unique<Strip>(ctx.boolean_or(j, "strip_left", field, true),
                                   ctx.boolean_or(j, "strip_right", field, true));
  if (t == "Prepend") {
    auto n = std::make_unique<Prepend>();
    n->prefix = ctx.str(j, "prepend", field);
    return n;
  }
  if (t == "Replace") {
    auto n = std::make_unique<Replace>();
    n->pattern = parse_pattern(ctx.get(j, "pattern", field), ctx, field + ".pattern");
    n->content = ctx.str(j, "content", field);
    return n;
  }
  if (t == "Sequence") {
    auto n = std::make_unique<NormalizerSequence>();
    for_each_item(ctx, j, "normalizers", field, [&](const json& item, const std::string& f) {
      if (auto c = make_normalizer(item, ctx, f)) n->items.push_back(std::move(c));
    });
    return n;
  }
  ctx.fail(field + ".type", "unsupported '" + t + "'");
}

// ---------------------------------------------------------------------------------------------- pre-tokenizers

namespace {

const Regex& gpt2_regex() {
  static const Regex re(R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)");
  return re;
}

// Applies F (Piece -> pieces) to every piece.
template <class F>
void split_each(std::vector<Piece>& pieces, F&& f) {
  std::vector<Piece> out;
  out.reserve(pieces.size());
  for (const auto& p : pieces)
    for (auto& q : f(p)) out.push_back(std::move(q));
  pieces = std::move(out);
}

struct ByteLevelPre : PreTokenizer {
  bool add_prefix_space, use_regex;
  void apply(std::vector<Piece>& pieces) const override {
    split_each(pieces, [&](const Piece& p) {
      Piece q = p;
      if (add_prefix_space && !q.text.empty() && q.text[0] != ' ') q.text.insert(0, 1, ' ');
      if (!use_regex) return std::vector<Piece>{q};
      return split_with(q, gpt2_regex().find_all(q.text), SplitBehavior::Isolated);
    });
    for (auto& p : pieces) p.text = bytes_to_byte_level(p.text);
  }
};

struct SplitPre : PreTokenizer {
  Pattern pattern;
  SplitBehavior behavior;
  bool invert;
  void apply(std::vector<Piece>& pieces) const override {
    split_each(pieces, [&](const Piece& p) { return split_with(p, pattern.find_all(p.text), behavior, invert); });
  }
};

struct CharSplitPre : PreTokenizer {  // Digits, Punctuation, WhitespaceSplit: a character class, one match a char
  bool (*pred)(uint32_t);
  SplitBehavior behavior;
  void apply(std::vector<Piece>& pieces) const override {
    split_each(pieces, [&](const Piece& p) { return split_with(p, char_matches(p.text, pred), behavior); });
  }
};

struct MetaspacePre : PreTokenizer {
  std::string rep;
  Prepend3 scheme;
  bool split;
  void apply(std::vector<Piece>& pieces) const override {
    Pattern space{" ", nullptr}, r{rep, nullptr};
    split_each(pieces, [&](const Piece& p) {
      Piece q{space.replace_all(p.text, rep), p.at_origin};
      bool starts = q.text.compare(0, rep.size(), rep) == 0;
      if (!q.text.empty() && !starts && (scheme == Prepend3::Always || (scheme == Prepend3::First && q.at_origin)))
        q.text.insert(0, rep);
      if (!split) return std::vector<Piece>{q};
      return split_with(q, r.find_all(q.text), SplitBehavior::MergedWithNext);
    });
  }
};

struct PreSequence : PreTokenizer {
  std::vector<std::unique_ptr<PreTokenizer>> items;
  void apply(std::vector<Piece>& pieces) const override {
    for (const auto& p : items) p->apply(pieces);
  }
};

}  // namespace

std::unique_ptr<PreTokenizer> make_pre_tokenizer(const json& j, const Ctx& ctx, const std::string& field) {
  if (j.is_null()) return nullptr;
  std::string t = ctx.type(j, field);
  if (t == "ByteLevel") {
    auto p = std::make_unique<ByteLevelPre>();
    p->add_prefix_space = ctx.boolean_or(j, "add_prefix_space", field, true);
    p->use_regex = ctx.boolean_or(j, "use_regex", field, true);
    return p;
  }
  if (t == "Split") {
    auto p = std::make_unique<SplitPre>();
    p->pattern = parse_pattern(ctx.get(j, "pattern", field), ctx, field + ".pattern");
    p->behavior = parse_behavior(ctx, j, field);
    p->invert = ctx.boolean_or(j, "invert", field, false);
    return p;
  }
  if (t == "Whitespace") {  // \w+|[^\w\s]+, keeping the matches; \w as Oniguruma's (letters, marks, digits,
                            // connector punctuation, ZWNJ/ZWJ)
    auto p = std::make_unique<SplitPre>();
    p->pattern.regex = std::make_shared<Regex>(
        R"([\p{L}\p{Nl}\p{M}\p{Nd}\p{Pc}\x{200C}\x{200D}]+|[^\p{L}\p{Nl}\p{M}\p{Nd}\p{Pc}\x{200C}\x{200D}\s]+)");
    p->behavior = SplitBehavior::Removed;
    p->invert = true;
    return p;
  }
  if (t == "Metaspace") {
    auto p = std::make_unique<MetaspacePre>();
    append_utf8(p->rep, single_char(ctx, j, "replacement", field));
    p->scheme = parse_prepend_scheme(j, ctx, field);
    p->split = ctx.boolean_or(j, "split", field, true);
    return p;
  }
  if (t == "Digits") {
    auto p = std::make_unique<CharSplitPre>();
    p->pred = is_numeric;
    p->behavior = ctx.boolean_or(j, "individual_digits", field, false) ? SplitBehavior::Isolated
                                                                        : SplitBehavior::Contiguous;
    return p;
  }
  if (t == "Punctuation") {
    auto p = std::make_unique<CharSplitPre>();
    p->pred = is_punctuation;
    p->behavior = j.contains("behavior") ? parse_behavior(ctx, j, field) : SplitBehavior::Isolated;
    return p;
  }
  if (t == "WhitespaceSplit") {
    auto p = std::make_unique<CharSplitPre>();
    p->pred = is_whitespace;
    p->behavior = SplitBehavior::Removed;
    return p;
  }
  if (t == "Sequence") {
    auto p = std::make_unique<PreSequence>();
    for_each_item(ctx, j, "pretokenizers", field, [&](const json& item, const std::string& f) {
      if (auto c = make_pre_tokenizer(item, ctx, f)) p->items.push_back(std::move(c));
    });
    return p;
  }
  ctx.fail(field + ".type", "unsupported '" + t + "'");
}

}  // namespace lf::data::tok
