// The output side of a tokenizer.json: post-processors (special tokens around the ids) and decoders (tokens back to
// text).
#include "loongforge/data/tokenizer/components.h"

#include <algorithm>

#include "loongforge/core/error.h"

namespace lf::data::tok {

// ---------------------------------------------------------------------------------------------- decoders

namespace {

struct ByteLevelDec : Decoder {
  void decode_chain(std::vector<std::string>& tokens) const override {
    std::string bytes;
    for (const auto& t : tokens) {
      std::string mapped;
      bool ok = true;
      for (size_t i = 0; i < t.size() && ok;) {
        auto b = char_to_byte(next_codepoint(t, i));
        if (b) mapped += static_cast<char>(*b);
        else ok = false;
      }
      bytes += ok ? mapped : t;
    }
    tokens.assign(1, utf8_lossy(bytes));
  }
};

struct MetaspaceDec : Decoder {
  uint32_t rep;
  Prepend3 scheme;
  void decode_chain(std::vector<std::string>& tokens) const override {
    for (size_t i = 0; i < tokens.size(); ++i) {
      std::string out;
      const std::string& t = tokens[i];
      for (size_t k = 0; k < t.size();) {
        uint32_t cp = next_codepoint(t, k);
        if (cp != rep) append_utf8(out, cp);
        else if (!(i == 0 && scheme != Prepend3::Never)) out += ' ';
      }
      tokens[i] = std::move(out);
    }
  }
};

int hex_digit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

struct ByteFallbackDec : Decoder {
  void decode_chain(std::vector<std::string>& tokens) const override {
    std::vector<std::string> out;
    std::string pending;
    auto flush = [&] {
      if (pending.empty()) return;
      if (valid_utf8(pending)) out.push_back(pending);
      else
        for (size_t i = 0; i < pending.size(); ++i) out.push_back("\xEF\xBF\xBD");
      pending.clear();
    };
    for (auto& t : tokens) {
      int hi = -1, lo = -1;
      if (t.size() == 6 && t.compare(0, 3, "<0x") == 0 && t[5] == '>') hi = hex_digit(t[3]), lo = hex_digit(t[4]);
      if (hi >= 0 && lo >= 0) {
        pending += static_cast<char>(hi * 16 + lo);
      } else {
        flush();
        out.push_back(std::move(t));
      }
    }
    flush();
    tokens = std::move(out);
  }
};

struct FuseDec : Decoder {
  void decode_chain(std::vector<std::string>& tokens) const override {
    std::string all;
    for (const auto& t : tokens) all += t;
    tokens.assign(1, std::move(all));
  }
};

struct StripDec : Decoder {
  uint32_t content;
  size_t start, stop;
  void decode_chain(std::vector<std::string>& tokens) const override {
    for (auto& t : tokens) {
      auto cps = codepoints(t);
      size_t a = 0, b = cps.size();
      while (a < start && a < cps.size() && cps[a] == content) ++a;
      for (size_t i = 0; i < stop && b > 0 && cps[b - 1] == content; ++i) --b;
      std::string out;
      for (size_t i = a; i < b; ++i) append_utf8(out, cps[i]);
      t = std::move(out);
    }
  }
};

struct ReplaceDec : Decoder {
  Pattern pattern;
  std::string content;
  void decode_chain(std::vector<std::string>& tokens) const override {
    for (auto& t : tokens) t = pattern.replace_all(t, content);
  }
};

struct BPEDec : Decoder {
  Pattern suffix;
  void decode_chain(std::vector<std::string>& tokens) const override {
    for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = suffix.replace_all(tokens[i], i + 1 == tokens.size() ? "" : " ");
  }
};

struct DecoderSequence : Decoder {
  std::vector<std::unique_ptr<Decoder>> items;
  void decode_chain(std::vector<std::string>& tokens) const override {
    for (const auto& d : items) d->decode_chain(tokens);
  }
};

}  // namespace

std::unique_ptr<Decoder> make_decoder(const json& j, const Ctx& ctx, const std::string& field) {
  if (j.is_null()) return nullptr;
  std::string t = ctx.type(j, field);
  if (t == "ByteLevel") return std::make_unique<ByteLevelDec>();
  if (t == "ByteFallback") return std::make_unique<ByteFallbackDec>();
  if (t == "Fuse") return std::make_unique<FuseDec>();
  if (t == "Metaspace") {
    auto d = std::make_unique<MetaspaceDec>();
    d->rep = single_char(ctx, j, "replacement", field);
    d->scheme = parse_prepend_scheme(j, ctx, field);
    return d;
  }
  if (t == "Strip") {
    auto d = std::make_unique<StripDec>();
    d->content = single_char(ctx, j, "content", field);
    d->start = static_cast<size_t>(std::max<int64_t>(0, ctx.integer_or(j, "start", field, 0)));
    d->stop = static_cast<size_t>(std::max<int64_t>(0, ctx.integer_or(j, "stop", field, 0)));
    return d;
  }
  if (t == "Replace") {
    auto d = std::make_unique<ReplaceDec>();
    d->pattern = parse_pattern(ctx.get(j, "pattern", field), ctx, field + ".pattern");
    d->content = ctx.str(j, "content", field);
    return d;
  }
  if (t == "BPEDecoder") {
    auto d = std::make_unique<BPEDec>();
    d->suffix.literal = ctx.str_or(j, "suffix", field, "</w>");
    return d;
  }
  if (t == "Sequence") {
    auto d = std::make_unique<DecoderSequence>();
    for_each_item(ctx, j, "decoders", field, [&](const json& item, const std::string& f) {
      if (auto c = make_decoder(item, ctx, f)) d->items.push_back(std::move(c));
    });
    return d;
  }
  ctx.fail(field + ".type", "unsupported '" + t + "'");
}

// ---------------------------------------------------------------------------------------------- post-processors

namespace {

struct Template : PostProcessor {
  struct Item {
    bool is_sequence;
    std::vector<int64_t> ids;
  };
  std::vector<Item> single;
  void process(std::vector<int64_t>& ids) const override {
    std::vector<int64_t> out;
    out.reserve(ids.size() + 4);
    for (const auto& it : single) {
      if (it.is_sequence) out.insert(out.end(), ids.begin(), ids.end());
      else out.insert(out.end(), it.ids.begin(), it.ids.end());
    }
    ids = std::move(out);
  }
};

struct Wrap : PostProcessor {  // BertProcessing / RobertaProcessing: CLS A SEP
  int64_t cls, sep;
  void process(std::vector<int64_t>& ids) const override {
    ids.insert(ids.begin(), cls);
    ids.push_back(sep);
  }
};

struct NoOp : PostProcessor {
  void process(std::vector<int64_t>&) const override {}
};

struct PostSequence : PostProcessor {
  std::vector<std::unique_ptr<PostProcessor>> items;
  void process(std::vector<int64_t>& ids) const override {
    for (const auto& p : items) p->process(ids);
  }
};

int64_t pair_id(const Ctx& ctx, const json& j, const std::string& key, const std::string& field) {
  const json& v = ctx.get(j, key, field);
  if (!v.is_array() || v.size() != 2 || !v[1].is_number_integer()) ctx.fail(field + "." + key, "expected [token, id]");
  return v[1].get<int64_t>();
}

}  // namespace

std::unique_ptr<PostProcessor> make_post_processor(const json& j, const Ctx& ctx, const std::string& field) {
  if (j.is_null()) return nullptr;
  std::string t = ctx.type(j, field);
  if (t == "ByteLevel") return std::make_unique<NoOp>();
  if (t == "BertProcessing" || t == "RobertaProcessing") {
    auto p = std::make_unique<Wrap>();
    p->cls = pair_id(ctx, j, "cls", field);
    p->sep = pair_id(ctx, j, "sep", field);
    return p;
  }
  if (t == "TemplateProcessing") {
    auto p = std::make_unique<Template>();
    const json& specials = ctx.get(j, "special_tokens", field);
    for_each_item(ctx, j, "single", field, [&](const json& item, const std::string& f) {
      std::string name;
      bool seq;
      if (item.is_object() && item.contains("Sequence")) {
        seq = true;
      } else if (item.is_object() && item.contains("SpecialToken")) {
        seq = false;
        name = ctx.str(item["SpecialToken"], "id", f + ".SpecialToken");
      } else if (item.is_string()) {
        name = item.get<std::string>();
        seq = !name.empty() && name[0] == '$';
      } else {
        ctx.fail(f, "expected a Sequence or a SpecialToken");
      }
      Template::Item it{seq, {}};
      if (!seq) {
        if (!specials.is_object() || !specials.contains(name))
          ctx.fail(field + ".special_tokens", "no entry for '" + name + "'");
        const json& ids = ctx.get(specials[name], "ids", field + ".special_tokens." + name);
        if (!ids.is_array()) ctx.fail(field + ".special_tokens." + name + ".ids", "expected an array");
        for (const auto& id : ids) {
          if (!id.is_number_integer()) ctx.fail(field + ".special_tokens." + name + ".ids", "expected integers");
          it.ids.push_back(id.get<int64_t>());
        }
      }
      p->single.push_back(std::move(it));
    });
    return p;
  }
  if (t == "Sequence") {
    auto p = std::make_unique<PostSequence>();
    for_each_item(ctx, j, "processors", field, [&](const json& item, const std::string& f) {
      if (auto c = make_post_processor(item, ctx, f)) p->items.push_back(std::move(c));
    });
    return p;
  }
  ctx.fail(field + ".type", "unsupported '" + t + "'");
}

}  // namespace lf::data::tok
