#include "loongforge/data/sft_dataset.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <numeric>

#include "loongforge/core/error.h"

namespace lf::data {

namespace {

using ojson = nlohmann::ordered_json;

uint64_t mix(uint64_t x) {  // splitmix64: the same order with every standard library
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

uint64_t below(uint64_t& state, uint64_t n) {  // uniform in [0, n), Lemire's method
  auto draw = [&] { return static_cast<unsigned __int128>(state = mix(state)) * n; };
  unsigned __int128 m = draw();
  if (static_cast<uint64_t>(m) < n) {
    const uint64_t t = (0 - n) % n;
    while (static_cast<uint64_t>(m) < t) m = draw();
  }
  return static_cast<uint64_t>(m >> 64);
}

std::string one_line(std::string s) {
  std::replace(s.begin(), s.end(), '\n', ' ');
  std::replace(s.begin(), s.end(), '\r', ' ');
  return s;
}

const std::string& str_field(const nlohmann::json& obj, const std::string& key, const std::string& where,
                             const std::string& field) {
  auto it = obj.find(key);
  if (it == obj.end()) throw file_error(where, field, "missing");
  if (!it->is_string()) throw file_error(where, field, "expected a string, got " + std::string(it->type_name()));
  return it->get_ref<const std::string&>();
}

struct Parsed {
  std::vector<SftDataset::Message> msgs;
  std::vector<std::string> images;  // as written (relative paths resolved by the caller)
  std::vector<std::string> image_fields;  // the field each image came from ("images[1]", "messages[0].content[2].image")
};

// An OpenAI content list -> template parts ({"type": "text", "text"} / {"type": "image"}), images appended in order.
nlohmann::json content_parts(const nlohmann::json& a, const std::string& where, const std::string& f,
                             Parsed& out) {
  nlohmann::json parts = nlohmann::json::array();
  for (size_t i = 0; i < a.size(); ++i) {
    const std::string fi = f + "[" + std::to_string(i) + "]";
    if (!a[i].is_object()) throw file_error(where, fi, "expected an object");
    const std::string& type = str_field(a[i], "type", where, fi + ".type");
    if (type == "text") {
      parts.push_back({{"type", "text"}, {"text", str_field(a[i], "text", where, fi + ".text")}});
    } else if (type == "image" || type == "image_url") {
      const nlohmann::json& v = a[i].contains(type) ? a[i][type] : a[i].contains("path") ? a[i]["path"] : a[i]["url"];
      std::string path;
      if (v.is_string()) path = v.get<std::string>();
      else if (v.is_object() && v.contains("url") && v["url"].is_string()) path = v["url"].get<std::string>();
      else throw file_error(where, fi + "." + type, "expected an image path (or {\"url\": PATH})");
      if (path.rfind("file://", 0) == 0) path = path.substr(7);
      if (path.rfind("http://", 0) == 0 || path.rfind("https://", 0) == 0 || path.rfind("data:", 0) == 0)
        throw file_error(where, fi + "." + type, "only local image files are read ('" + path.substr(0, 40) + "')");
      out.images.push_back(path);
      out.image_fields.push_back(fi + "." + type);
      parts.push_back({{"type", "image"}});
    } else {
      throw file_error(where, fi + ".type", "unknown content part '" + type + "' (expected text, image or image_url)");
    }
  }
  return parts;
}

// One line of the data file -> messages (alpaca / sharegpt / openai) and the images they refer to.
Parsed parse_conversation(const nlohmann::json& j, const std::string& where) {
  if (!j.is_object()) throw file_error(where, "", "expected a JSON object, got " + std::string(j.type_name()));
  Parsed out;
  std::vector<SftDataset::Message>& msgs = out.msgs;
  auto system = [&] {  // alpaca / sharegpt: an optional top-level system prompt
    if (j.contains("system") && !j["system"].is_null()) {
      const std::string& s = str_field(j, "system", where, "system");
      if (!s.empty()) msgs.push_back({"system", s});
    }
  };
  auto list = [&](const char* key) -> const nlohmann::json& {
    const auto& a = j[key];
    if (!a.is_array()) throw file_error(where, key, "expected a list, got " + std::string(a.type_name()));
    if (a.empty()) throw file_error(where, key, "empty");
    return a;
  };
  if (j.contains("messages")) {
    const auto& a = list("messages");
    for (size_t i = 0; i < a.size(); ++i) {
      const std::string f = "messages[" + std::to_string(i) + "]";
      if (!a[i].is_object()) throw file_error(where, f, "expected an object");
      const std::string& role = str_field(a[i], "role", where, f + ".role");
      if (role != "system" && role != "user" && role != "assistant")
        throw file_error(where, f + ".role", "unknown role '" + role + "' (expected system, user or assistant)");
      if (a[i].contains("content") && a[i]["content"].is_array())
        msgs.push_back({role, content_parts(a[i]["content"], where, f + ".content", out)});
      else
        msgs.push_back({role, str_field(a[i], "content", where, f + ".content")});
    }
  } else if (j.contains("conversations")) {
    system();
    const auto& a = list("conversations");
    for (size_t i = 0; i < a.size(); ++i) {
      const std::string f = "conversations[" + std::to_string(i) + "]";
      if (!a[i].is_object()) throw file_error(where, f, "expected an object");
      const std::string& from = str_field(a[i], "from", where, f + ".from");
      std::string role = from == "human" || from == "user"      ? "user"
                         : from == "gpt" || from == "assistant" ? "assistant"
                         : from == "system"                     ? "system"
                                                                : "";
      if (role.empty()) throw file_error(where, f + ".from", "unknown role '" + from + "' (expected human, gpt or system)");
      msgs.push_back({role, str_field(a[i], "value", where, f + ".value")});
    }
  } else if (j.contains("instruction")) {
    system();
    std::string user = str_field(j, "instruction", where, "instruction");
    if (j.contains("input") && !j["input"].is_null()) {
      const std::string& in = str_field(j, "input", where, "input");
      if (!in.empty()) user += "\n\n" + in;
    }
    msgs.push_back({"user", user});
    msgs.push_back({"assistant", str_field(j, "output", where, "output")});
  } else {
    throw file_error(where, "", "unknown format: expected alpaca {\"instruction\", \"output\"}, sharegpt "
                                "{\"conversations\"} or OpenAI {\"messages\"}");
  }
  if (std::none_of(msgs.begin(), msgs.end(), [](const auto& m) { return m.role == "assistant"; }))
    throw file_error(where, j.contains("messages") ? "messages" : "conversations", "no assistant message");
  for (const char* key : {"image", "images"}) {  // LLaVA / ShareGPT: top-level paths, "<image>" markers in the text
    if (!j.contains(key) || j[key].is_null()) continue;
    const nlohmann::json& v = j[key];
    if (!out.images.empty()) throw file_error(where, key, "images given twice (top level and in the content)");
    if (v.is_string()) {
      out.images.push_back(v.get<std::string>());
      out.image_fields.push_back(key);
    } else if (v.is_array()) {
      for (size_t i = 0; i < v.size(); ++i) {
        const std::string fi = std::string(key) + "[" + std::to_string(i) + "]";
        if (!v[i].is_string()) throw file_error(where, fi, "expected a path");
        out.images.push_back(v[i].get<std::string>());
        out.image_fields.push_back(fi);
      }
    } else {
      throw file_error(where, key, "expected a path or a list of paths");
    }
  }
  return out;
}

size_t count_markers(const std::string& s) {
  size_t n = 0;
  for (size_t p = s.find("<image>"); p != std::string::npos; p = s.find("<image>", p + 7)) ++n;
  return n;
}

std::string replace_markers(std::string s, const std::string& with) {
  if (with == "<image>") return s;
  for (size_t p = s.find("<image>"); p != std::string::npos; p = s.find("<image>", p + with.size())) s.replace(p, 7, with);
  return s;
}

bool is_space_token(const Tokenizer& tok, int64_t id) {
  std::string s = tok.decode({id}, false);
  return !s.empty() && s.find_first_not_of(" \t\r\n") == std::string::npos;
}

bool is_special_token(const Tokenizer& tok, int64_t id) {
  return tok.decode({id}, true).empty() && !tok.decode({id}, false).empty();
}

}  // namespace

SftDataset::SftDataset(SftOptions opts, const Tokenizer& tok)
    : opts_(std::move(opts)), tmpl_(opts_.chat_template, opts_.template_origin), tok_(&tok) {
  if (opts_.seq_len < 1) throw file_error("sft options", "seq_len", "must be >= 1");
  if (opts_.files.empty()) throw file_error("sft options", "files", "no data files");
  pad_id_ = opts_.pad_id >= 0 ? opts_.pad_id : 0;
  if (opts_.pad_id < 0 && !opts_.eos_token.empty())
    if (auto id = tok.token_to_id(opts_.eos_token)) pad_id_ = *id;
  // A bad conversation is the error, or with skip_bad counted and left out (a function called from a handler).
  auto bad = [&](const Error& e) {
    if (!opts_.skip_bad) throw;
    if (skipped_++ == 0) first_skipped_ = one_line(e.what());
  };
  for (const auto& file : opts_.files) {
    std::ifstream in(file, std::ios::binary);
    if (!in) throw file_error(file, "", "cannot open");
    const std::filesystem::path root = opts_.image_root.empty() ? std::filesystem::path(file).parent_path()
                                                                 : std::filesystem::path(opts_.image_root);
    if (file.ends_with(".json")) {  // LLaVA's format: one list
      std::stringstream ss;
      ss << in.rdbuf();
      nlohmann::json all;
      try {
        all = nlohmann::json::parse(ss.str());
      } catch (const nlohmann::json::exception& e) {
        throw Error(file + ": invalid JSON: " + one_line(e.what()));
      }
      if (!all.is_array()) throw file_error(file, "", "expected a list of conversations");
      for (size_t i = 0; i < all.size(); ++i) {
        ++read_;
        try {
          add_conversation(all[i], file + ":[" + std::to_string(i) + "]", root.string());
        } catch (const Error& e) {
          bad(e);
        }
      }
      continue;
    }
    std::string line;
    for (size_t n = 1; std::getline(in, line); ++n) {
      if (line.find_first_not_of(" \t\r\n") == std::string::npos) continue;
      const std::string where = file + ":" + std::to_string(n);
      ++read_;
      try {
        nlohmann::json j;
        try {
          j = nlohmann::json::parse(line);
        } catch (const nlohmann::json::exception& e) {
          throw Error(where + ": invalid JSON: " + one_line(e.what()));
        }
        add_conversation(j, where, root.string());
      } catch (const Error& e) {
        bad(e);
      }
    }
  }
  if (convs_.empty()) {
    std::string why = "no conversations in the data files";
    if (skipped_)
      why += " (all " + std::to_string(skipped_) + " were bad and skipped; the first: " + first_skipped_ + ")";
    throw file_error(opts_.files.front(), "", why);
  }
  if (convs_.size() > UINT32_MAX) throw file_error("sft options", "files", "too many conversations");
  if (truncated_)
    std::cerr << "warning: sft data: " << truncated_ << " of " << convs_.size() << " conversations have more than "
              << "seq_len + 1 = " << opts_.seq_len + 1 << " tokens and are truncated\n";
}

void SftDataset::add_conversation(const nlohmann::json& j, const std::string& where, const std::string& root) {
  Parsed p = parse_conversation(j, where);
  Conv c{where, std::move(p.msgs), std::move(p.images), std::move(p.image_fields), {}, {}};
  if (!c.images.empty() && opts_.image_token_id < 0) throw file_error(where, "image", "this model takes no images");
  for (auto& path : c.images)
    if (std::filesystem::path(path).is_relative()) path = (std::filesystem::path(root) / path).string();
  if (!c.images.empty()) {  // "<image>" markers: count them, put them in when missing, turn them into the placeholder
    const std::string key = c.image_fields.front().substr(0, c.image_fields.front().find('['));
    size_t markers = 0;
    bool parts = false;
    for (const auto& m : c.messages) {
      if (m.content.is_string()) markers += count_markers(m.content.get_ref<const std::string&>());
      else parts = true;
    }
    if (!parts && markers == 0) {
      auto first_user = std::find_if(c.messages.begin(), c.messages.end(), [](const auto& m) { return m.role == "user"; });
      if (first_user == c.messages.end()) throw file_error(where, key, "no user message to put the images in");
      std::string prefix;
      for (size_t i = 0; i < c.images.size(); ++i) prefix += "<image>\n";
      first_user->content = prefix + first_user->content.get<std::string>();
      markers = c.images.size();
    }
    if (!parts && markers != c.images.size())
      throw file_error(where, key, std::to_string(c.images.size()) + " images but " + std::to_string(markers) +
                                       " <image> markers in the text");
    for (auto& m : c.messages)
      if (m.content.is_string()) m.content = replace_markers(m.content.get<std::string>(), opts_.image_placeholder);
  }
  convs_.push_back(std::move(c));
  try {  // rendered, tokenized, images checked and expanded
    const size_t max_tokens = static_cast<size_t>(opts_.seq_len) + 1;
    Conv& last = convs_.back();
    Encoded e = encode_conversation(convs_.size() - 1);
    if (e.ids.empty()) throw Error(where + ": the conversation renders to no tokens");
    if (!last.images.empty()) expand_images(last, e);
    if (e.ids.size() > max_tokens) {
      if (!last.images.empty())
        throw Error(where + ": " + std::to_string(e.ids.size()) + " tokens with its images, more than "
                    "seq_len + 1 = " + std::to_string(max_tokens) + " (a cut image cannot be trained on)");
      ++truncated_;
      e.ids.resize(max_tokens);
      e.assistant_mask.resize(max_tokens);
    }
    last.ids = std::move(e.ids);
    last.mask = std::move(e.assistant_mask);
  } catch (...) {
    convs_.pop_back();
    throw;
  }
}

void SftDataset::expand_images(Conv& c, Encoded& e) const {
  const int64_t id = opts_.image_token_id;
  const auto found = std::count(e.ids.begin(), e.ids.end(), id);
  if (static_cast<size_t>(found) != c.images.size())
    throw file_error(c.where, "image", std::to_string(c.images.size()) + " images but the rendered conversation has " +
                                           std::to_string(found) + " image tokens (id " + std::to_string(id) + ")");
  std::vector<int64_t> ids;
  std::vector<uint8_t> mask;
  size_t k = 0;
  for (size_t t = 0; t < e.ids.size(); ++t) {
    if (e.ids[t] != id) {
      ids.push_back(e.ids[t]);
      mask.push_back(e.assistant_mask[t]);
      continue;
    }
    int64_t n = 0;
    try {
      n = opts_.image_tokens(c.images[k]);
    } catch (const Error& err) {
      throw file_error(c.where, c.image_fields[k], one_line(err.what()));
    }
    ++k;
    c.image_tokens.push_back(n);
    ids.insert(ids.end(), n, id);
    mask.insert(mask.end(), n, 0);
  }
  e.ids = std::move(ids);
  e.assistant_mask = std::move(mask);
}

SftDataset::Encoded SftDataset::encode_conversation(size_t i) const {
  if (i >= convs_.size()) throw Error("sft data: conversation " + std::to_string(i) + " out of range");
  const Conv& c = convs_.at(i);
  const Tokenizer& tok = *tok_;
  auto render = [&](size_t n, bool gen) {
    ojson msgs = ojson::array();
    for (size_t k = 0; k < n; ++k) msgs.push_back({{"role", c.messages[k].role}, {"content", ojson(c.messages[k].content)}});
    ojson ctx = {{"messages", std::move(msgs)},      {"tools", nullptr},
                 {"add_generation_prompt", gen},     {"bos_token", opts_.bos_token},
                 {"eos_token", opts_.eos_token}};
    try {
      return tmpl_.render_ordered(ctx);
    } catch (const Error& e) {
      throw Error(c.where + ": chat template: " + one_line(e.what()));
    }
  };
  auto encode = [&](std::string_view s) {
    try {
      return tok.encode(s, false);
    } catch (const Error& e) {
      throw Error(c.where + ": " + one_line(e.what()));
    }
  };
  Encoded e;
  e.text = render(c.messages.size(), false);
  if (!opts_.assistant_only_loss) {
    e.ids = encode(e.text);
    e.assistant_mask.assign(e.ids.size(), 1);
    return e;
  }
  // Character spans of the assistant replies.
  std::vector<std::pair<size_t, size_t>> spans;
  for (size_t k = 0; k < c.messages.size(); ++k) {
    if (c.messages[k].role != "assistant") continue;
    const std::string before = render(k, true), through = render(k + 1, false);
    const size_t prev = spans.empty() ? 0 : spans.back().second;
    if (!e.text.starts_with(before) || !e.text.starts_with(through) || through.size() < before.size() ||
        before.size() < prev)
      throw Error(c.where + ": chat template " + tmpl_.origin() + " is not prefix-stable: rendering the first " +
                  std::to_string(k) + " or " + std::to_string(k + 1) +
                  " messages does not give a prefix of the whole conversation, so the assistant tokens cannot be "
                  "found (use assistant_only_loss=false or another template)");
    spans.emplace_back(before.size(), through.size());
  }
  // Character boundaries -> token boundaries. Fast path: the segments between the boundaries, encoded separately,
  // concatenate to the encoding of the whole text (boundaries at special tokens).
  std::vector<size_t> cuts{0};
  for (auto [a, b] : spans) cuts.insert(cuts.end(), {a, b});
  cuts.push_back(e.text.size());
  cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
  e.ids = encode(e.text);
  std::vector<int64_t> joined;
  std::vector<size_t> tok_at{0};  // token index of each cut
  for (size_t s = 0; s + 1 < cuts.size(); ++s) {
    auto part = encode(std::string_view(e.text).substr(cuts[s], cuts[s + 1] - cuts[s]));
    joined.insert(joined.end(), part.begin(), part.end());
    tok_at.push_back(joined.size());
  }
  const bool fast = joined == e.ids;
  // Otherwise per boundary P: the encoding of text[:P] when it is a prefix of the ids; else the first J whose decoded
  // ids[:J] reach P (exact when they spell text[:P]); a token straddling P counts as assistant (it overlaps the span,
  // as transformers' offsets-based mask has it).
  auto token_of = [&](size_t p, bool start) -> size_t {
    if (fast) return tok_at[std::lower_bound(cuts.begin(), cuts.end(), p) - cuts.begin()];
    if (p == 0 || p == e.text.size()) return p == 0 ? 0 : e.ids.size();
    auto pre = encode(std::string_view(e.text).substr(0, p));
    if (pre.size() <= e.ids.size() && std::equal(pre.begin(), pre.end(), e.ids.begin())) return pre.size();
    auto decoded = [&](size_t j) { return tok.decode(std::vector<int64_t>(e.ids.begin(), e.ids.begin() + j), false); };
    size_t lo = 0, hi = e.ids.size();
    while (lo < hi) {
      const size_t mid = (lo + hi) / 2;
      if (decoded(mid).size() >= p)
        hi = mid;
      else
        lo = mid + 1;
    }
    if (decoded(lo) == std::string_view(e.text).substr(0, p)) return lo;
    return start && lo > 0 ? lo - 1 : lo;
  };
  e.assistant_mask.assign(e.ids.size(), 0);
  for (auto [a, b] : spans) {
    size_t ta = token_of(a, true), tb = std::max(ta, token_of(b, false)), j = tb;
    // Whitespace the template writes after the end-of-turn special token is not predicted.
    while (j > ta && is_space_token(tok, e.ids[j - 1])) --j;
    if (j < tb && j > ta && is_special_token(tok, e.ids[j - 1])) tb = j;
    std::fill(e.assistant_mask.begin() + ta, e.assistant_mask.begin() + tb, 1);
  }
  return e;
}

size_t SftDataset::conv_at(uint64_t k) {
  const uint64_t n = convs_.size(), epoch = k / n;
  if (perm_epoch_ != epoch) {
    perm_.resize(n);
    std::iota(perm_.begin(), perm_.end(), 0u);
    uint64_t state = mix(mix(opts_.seed) ^ epoch);
    for (size_t i = n; i > 1; --i) std::swap(perm_[i - 1], perm_[below(state, i)]);
    perm_epoch_ = epoch;
  }
  return perm_[k % n];
}

SftSample SftDataset::next() {
  const size_t L = static_cast<size_t>(opts_.seq_len);
  SftSample s;
  for (auto* v : {&s.input_ids, &s.labels, &s.position_ids, &s.segment_ids}) v->reserve(L);
  int64_t seg = 0;
  while (s.input_ids.size() < L) {
    const Conv& c = convs_[conv_at(consumed_)];
    const size_t n = std::min(c.ids.size(), L);
    if (s.input_ids.size() + n > L) break;
    s.images.insert(s.images.end(), c.images.begin(), c.images.end());
    s.image_tokens.insert(s.image_tokens.end(), c.image_tokens.begin(), c.image_tokens.end());
    s.documents.push_back(static_cast<int64_t>(n));
    for (size_t i = 0; i < n; ++i) {
      s.input_ids.push_back(c.ids[i]);
      s.labels.push_back(i + 1 < c.ids.size() && c.mask[i + 1] ? c.ids[i + 1] : -100);
      s.position_ids.push_back(static_cast<int64_t>(i));
      s.segment_ids.push_back(seg);
    }
    ++seg;
    ++consumed_;
    if (!opts_.packing) break;
  }
  for (int64_t p = 0; s.input_ids.size() < L; ++p) {
    s.input_ids.push_back(pad_id_);
    s.labels.push_back(-100);
    s.position_ids.push_back(p);
    s.segment_ids.push_back(seg);
  }
  ++samples_;
  return s;
}

nlohmann::json SftDataset::state() const {
  return {{"conversations_consumed", consumed_}, {"samples", samples_},          {"seed", opts_.seed},
          {"seq_len", opts_.seq_len},            {"packing", opts_.packing},     {"num_conversations", convs_.size()}};
}

void SftDataset::restore(const nlohmann::json& st, const std::string& where) {
  if (!st.is_object()) throw file_error(where, "", "expected a JSON object");
  auto get = [&](const char* key, auto expected_type) {
    using T = decltype(expected_type);
    auto it = st.find(key);
    if (it == st.end()) throw file_error(where, key, "missing");
    try {
      return it->template get<T>();
    } catch (const nlohmann::json::exception&) {
      throw file_error(where, key, "has the wrong type (" + std::string(it->type_name()) + ")");
    }
  };
  auto same = [&](const char* key, auto mine) {
    auto theirs = get(key, mine);
    if (theirs != mine)
      throw file_error(where, key, "is " + nlohmann::json(theirs).dump() + " but this dataset has " +
                                       nlohmann::json(mine).dump());
  };
  same("seed", opts_.seed);
  same("seq_len", opts_.seq_len);
  same("packing", opts_.packing);
  same("num_conversations", static_cast<uint64_t>(convs_.size()));
  consumed_ = get("conversations_consumed", uint64_t{});
  samples_ = get("samples", uint64_t{});
}

}  // namespace lf::data
