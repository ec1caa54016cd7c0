#include "loongforge/data/tokenizer/bpe.h"

#include <cstdio>
#include <queue>

namespace lf::data::tok {

namespace {
uint64_t pair_key(int64_t a, int64_t b) { return (static_cast<uint64_t>(a) << 32) | static_cast<uint32_t>(b); }
}  // namespace

BPE::BPE(const json& m, const Ctx& ctx, const std::string& field) {
  std::string type = m.is_object() && m.contains("type") ? ctx.str(m, "type", field) : "BPE";
  if (type != "BPE") ctx.fail(field + ".type", "unsupported '" + type + "'");
  const json& vocab = ctx.get(m, "vocab", field);
  if (!vocab.is_object()) ctx.fail(field + ".vocab", "expected an object of token: id");
  vocab_.reserve(vocab.size());
  for (auto it = vocab.begin(); it != vocab.end(); ++it) {
    if (!it.value().is_number_integer() || it.value().get<int64_t>() < 0 ||
        it.value().get<int64_t>() > INT32_MAX)
      ctx.fail(field + ".vocab." + it.key(), "expected a non-negative integer id");
    int64_t id = it.value().get<int64_t>();
    vocab_[it.key()] = id;
    vocab_r_[id] = it.key();
  }
  auto dropout = m.find("dropout");
  if (dropout != m.end() && !dropout->is_null() && !(dropout->is_number() && dropout->get<double>() == 0.0))
    ctx.fail(field + ".dropout", "unsupported (BPE dropout is not deterministic)");
  std::string unk = ctx.str_or(m, "unk_token", field, "");
  if (m.contains("unk_token") && !m["unk_token"].is_null()) {
    auto it = vocab_.find(unk);
    if (it == vocab_.end()) ctx.fail(field + ".unk_token", "'" + unk + "' is not in the vocab");
    unk_id_ = it->second;
  }
  prefix_ = ctx.str_or(m, "continuing_subword_prefix", field, "");
  suffix_ = ctx.str_or(m, "end_of_word_suffix", field, "");
  fuse_unk_ = ctx.boolean_or(m, "fuse_unk", field, false);
  byte_fallback_ = ctx.boolean_or(m, "byte_fallback", field, false);
  ignore_merges_ = ctx.boolean_or(m, "ignore_merges", field, false);
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof name, "<0x%02X>", b);
    auto it = vocab_.find(name);
    byte_ids_[b] = it == vocab_.end() ? -1 : it->second;
  }

  const json& merges = m.contains("merges") ? m["merges"] : json::array();
  if (!merges.is_array()) ctx.fail(field + ".merges", "expected an array");
  merges_.reserve(merges.size());
  for (size_t i = 0; i < merges.size(); ++i) {
    std::string f = field + ".merges[" + std::to_string(i) + "]";
    const json& e = merges[i];
    std::string a, b;
    if (e.is_string()) {
      const std::string& s = e.get_ref<const std::string&>();
      size_t sp = s.find(' ');
      if (sp == std::string::npos) ctx.fail(f, "expected \"left right\"");
      a = s.substr(0, sp), b = s.substr(sp + 1);
    } else if (e.is_array() && e.size() == 2 && e[0].is_string() && e[1].is_string()) {
      a = e[0].get<std::string>(), b = e[1].get<std::string>();
    } else {
      ctx.fail(f, "expected \"left right\" or [left, right]");
    }
    auto ia = vocab_.find(a), ib = vocab_.find(b);
    if (ia == vocab_.end()) ctx.fail(f, "token '" + a + "' is not in the vocab");
    if (ib == vocab_.end()) ctx.fail(f, "token '" + b + "' is not in the vocab");
    std::string merged = a + b.substr(std::min(prefix_.size(), b.size()));
    auto in = vocab_.find(merged);
    if (in == vocab_.end()) ctx.fail(f, "merged token '" + merged + "' is not in the vocab");
    merges_[pair_key(ia->second, ib->second)] = Merge{static_cast<int32_t>(i), in->second};
  }
}

std::optional<int64_t> BPE::token_to_id(const std::string& token) const {
  auto it = vocab_.find(token);
  if (it == vocab_.end()) return std::nullopt;
  return it->second;
}

const std::string* BPE::id_to_token(int64_t id) const {
  auto it = vocab_r_.find(id);
  return it == vocab_r_.end() ? nullptr : &it->second;
}

void BPE::tokenize(std::string_view word, std::vector<int64_t>& out) const {
  if (word.empty()) return;
  if (ignore_merges_) {
    auto it = vocab_.find(std::string(word));
    if (it != vocab_.end()) {
      out.push_back(it->second);
      return;
    }
  }
  bool cacheable = word.size() < kCacheMaxWord;
  std::string key;
  if (cacheable) {
    key.assign(word);
    std::lock_guard<std::mutex> lock(cache_mu_);
    auto it = cache_.find(key);
    if (it != cache_.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  std::vector<int64_t> ids = merge_word(word);
  out.insert(out.end(), ids.begin(), ids.end());
  if (cacheable) {
    std::lock_guard<std::mutex> lock(cache_mu_);
    if (cache_.size() >= kCacheCapacity) cache_.clear();
    cache_.emplace(std::move(key), std::move(ids));
  }
}

std::vector<int64_t> BPE::merge_word(std::string_view w) const {
  // Initial symbols: one per character (with prefix/suffix), else its <0xNN> bytes, else (fused) unk.
  std::vector<int64_t> syms;
  int64_t pending_unk = -1;  // an unk not yet emitted (fuse_unk grows it)
  std::string s;
  for (size_t i = 0; i < w.size();) {
    size_t n = std::min(utf8_char_len(static_cast<unsigned char>(w[i])), w.size() - i);
    bool first = i == 0, last = i + n == w.size();
    s.assign(first ? "" : prefix_).append(w.substr(i, n)).append(last ? suffix_ : "");
    i += n;
    if (auto it = vocab_.find(s); it != vocab_.end()) {
      if (pending_unk >= 0) syms.push_back(pending_unk), pending_unk = -1;
      syms.push_back(it->second);
      continue;
    }
    if (byte_fallback_) {
      bool all = true;
      for (unsigned char c : s) all = all && byte_ids_[c] >= 0;
      if (all) {
        // tokenizers does not flush a pending unk here; the byte tokens go first.
        for (unsigned char c : s) syms.push_back(byte_ids_[c]);
        continue;
      }
    }
    if (unk_id_) {
      if (pending_unk >= 0 && !fuse_unk_) syms.push_back(pending_unk);
      pending_unk = *unk_id_;
    }
  }
  if (pending_unk >= 0) syms.push_back(pending_unk);

  // Merge: lowest rank first, leftmost among equal ranks; stale queue entries are skipped.
  struct Sym {
    int64_t id;
    int prev, next;
    bool alive;
  };
  std::vector<Sym> sy(syms.size());
  for (size_t i = 0; i < syms.size(); ++i) sy[i] = {syms[i], int(i) - 1, i + 1 < syms.size() ? int(i + 1) : -1, true};
  struct Cand {
    int32_t rank;
    int pos;
    int64_t new_id;
    bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::priority_queue<Cand, std::vector<Cand>, std::greater<Cand>> q;
  auto push = [&](int pos) {
    int nx = sy[pos].next;
    if (nx < 0) return;
    auto it = merges_.find(pair_key(sy[pos].id, sy[nx].id));
    if (it != merges_.end()) q.push({it->second.rank, pos, it->second.new_id});
  };
  for (size_t i = 0; i + 1 < sy.size(); ++i) push(int(i));
  while (!q.empty()) {
    Cand c = q.top();
    q.pop();
    Sym& cur = sy[c.pos];
    if (!cur.alive || cur.next < 0) continue;
    auto it = merges_.find(pair_key(cur.id, sy[cur.next].id));
    if (it == merges_.end() || it->second.new_id != c.new_id) continue;
    Sym& right = sy[cur.next];
    right.alive = false;
    cur.id = c.new_id;
    cur.next = right.next;
    if (cur.next >= 0) sy[cur.next].prev = c.pos;
    if (cur.prev >= 0) push(cur.prev);
    push(c.pos);
  }
  std::vector<int64_t> ids;
  for (int i = sy.empty() ? -1 : 0; i >= 0; i = sy[i].next) ids.push_back(sy[i].id);
  return ids;
}

}  // namespace lf::data::tok
