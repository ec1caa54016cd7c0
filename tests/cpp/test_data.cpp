// Token shards (writer/reader, validation) and the pretraining dataset (shuffle, blend, resume, epochs, split).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "loongforge/core/error.h"
#include "loongforge/core/fs.h"
#include "loongforge/data/pretrain_dataset.h"
#include "loongforge/data/token_shards.h"
#include "test_util.h"

namespace fs = std::filesystem;
using namespace lf::data;

namespace {

using lf::test::temp_dir;
using lf::test::read_bytes;
using lf::test::write_bytes;




void write_shard(const std::string& prefix, const std::vector<std::vector<int64_t>>& docs, TokenDType dtype) {
  TokenShardWriter w(prefix, dtype);
  for (const auto& d : docs) w.add_doc(d);
  w.finish();
}

// Documents whose tokens say where they come from: token = doc * 1000 + position + 1.
std::vector<std::vector<int64_t>> tagged_docs(int n, uint64_t seed, int max_len = 40) {
  std::vector<std::vector<int64_t>> docs;
  uint64_t x = seed;
  for (int d = 0; d < n; ++d) {
    x = x * 6364136223846793005ULL + 1442695040888963407ULL;
    int len = 1 + static_cast<int>((x >> 33) % static_cast<uint64_t>(max_len));
    std::vector<int64_t> doc;
    for (int p = 0; p < len; ++p) doc.push_back(int64_t{d} * 1000 + p + 1);
    docs.push_back(doc);
  }
  return docs;
}
int64_t doc_of(int64_t token) { return (token - 1) / 1000; }
int64_t pos_of(int64_t token) { return (token - 1) % 1000; }

// Expects F to throw an lf::Error whose one-line message contains every string of PARTS.
template <class F>
void expect_error(F&& f, std::vector<std::string> parts) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one with " << parts[0];
  } catch (const lf::Error& e) {
    std::string msg = e.what();
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    for (const auto& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' not in: " << msg;
  }
}

// Every sample's tokens run consecutively inside a document, and doc_starts are exactly the positions of first
// tokens of documents.
void check_sample(const Sample& s, int64_t seq_len) {
  ASSERT_EQ(static_cast<int64_t>(s.tokens.size()), seq_len + 1);
  std::vector<int32_t> starts;
  for (size_t i = 0; i < s.tokens.size(); ++i) {
    if (pos_of(s.tokens[i]) == 0) starts.push_back(static_cast<int32_t>(i));
    if (i > 0 && pos_of(s.tokens[i]) != 0) {
      EXPECT_EQ(s.tokens[i], s.tokens[i - 1] + 1) << "at " << i;
    }
  }
  EXPECT_EQ(s.doc_starts, starts);
}

}  // namespace

// ------------------------------------------------------------------------------------------------ shards

TEST(TokenShard, RoundTripUInt16) {
  auto dir = temp_dir();
  std::string prefix = (dir / "s16").string();
  std::vector<std::vector<int64_t>> docs = {{1, 2, 3}, {}, {65535, 0}, {7}};
  write_shard(prefix, docs, TokenDType::UInt16);
  EXPECT_EQ(fs::file_size(prefix + ".bin"), 6u * 2);
  EXPECT_EQ(fs::file_size(prefix + ".idx"), 32u + 8 * 5);
  TokenShard sh(prefix);
  EXPECT_EQ(sh.dtype(), TokenDType::UInt16);
  ASSERT_EQ(sh.num_docs(), 4u);
  EXPECT_EQ(sh.num_tokens(), 6u);
  for (size_t i = 0; i < docs.size(); ++i) EXPECT_EQ(sh.doc(i), docs[i]);
  EXPECT_EQ(sh.tokens(2, 3), (std::vector<int64_t>{3, 65535, 0}));
  EXPECT_EQ(sh.doc_offset(4), 6u);
  EXPECT_THROW(sh.doc(4), lf::Error);
  EXPECT_THROW(sh.tokens(5, 2), lf::Error);
  TokenShardWriter w((dir / "bad").string(), TokenDType::UInt16);
  expect_error([&] { w.add_doc(std::vector<int64_t>{65536}); }, {"bad.bin", "dtype", "65536"});
}

TEST(TokenShard, RoundTripUInt32) {
  auto dir = temp_dir();
  std::string prefix = (dir / "s32").string();
  std::vector<std::vector<int64_t>> docs = {{100000, 4294967295LL}, {0, 1, 65536}};
  write_shard(prefix, docs, TokenDType::UInt32);
  EXPECT_EQ(fs::file_size(prefix + ".bin"), 5u * 4);
  TokenShard sh(prefix);
  EXPECT_EQ(sh.dtype(), TokenDType::UInt32);
  EXPECT_EQ(sh.doc(0), docs[0]);
  EXPECT_EQ(sh.doc(1), docs[1]);
  EXPECT_EQ(dtype_for_vocab(65536), TokenDType::UInt16);
  EXPECT_EQ(dtype_for_vocab(65537), TokenDType::UInt32);
}

TEST(TokenShard, EmptyShard) {
  auto dir = temp_dir();
  std::string prefix = (dir / "empty").string();
  write_shard(prefix, {}, TokenDType::UInt16);
  TokenShard sh(prefix);
  EXPECT_EQ(sh.num_docs(), 0u);
  EXPECT_EQ(sh.num_tokens(), 0u);
}

TEST(TokenShard, FailedWriteKeepsTheExistingShard) {
  auto dir = temp_dir();
  std::string prefix = (dir / "keep").string();
  write_shard(prefix, {{1, 2, 3}}, TokenDType::UInt16);
  std::string bin = read_bytes(prefix + ".bin"), idx = read_bytes(prefix + ".idx");
  {
    TokenShardWriter w(prefix, TokenDType::UInt16);
    w.add_doc(std::vector<int64_t>{9, 9, 9, 9});
  }  // destroyed without finish()
  EXPECT_EQ(read_bytes(prefix + ".bin"), bin);
  EXPECT_EQ(read_bytes(prefix + ".idx"), idx);
  EXPECT_EQ(std::distance(fs::directory_iterator(dir), fs::directory_iterator()), 2);  // no temporary files left
}

TEST(TokenShard, CorruptOrTruncatedShardsAreOneLineErrors) {
  auto dir = temp_dir();
  std::string prefix = (dir / "c").string(), idx = prefix + ".idx", bin = prefix + ".bin";
  write_shard(prefix, {{1, 2}, {3, 4, 5}, {6}}, TokenDType::UInt16);
  const std::string good_idx = read_bytes(idx), good_bin = read_bytes(bin);
  auto with_idx = [&](std::string bytes, std::vector<std::string> parts) {
    write_bytes(idx, bytes);
    write_bytes(bin, good_bin);
    expect_error([&] { TokenShard s(prefix); }, parts);
  };
  auto patch = [&](size_t at, const void* v, size_t n) {
    std::string b = good_idx;
    std::memcpy(&b[at], v, n);
    return b;
  };
  uint32_t u32 = 0;
  uint64_t u64 = 0;
  with_idx(good_idx.substr(0, 10), {"c.idx", "header", "truncated"});
  with_idx(patch(0, "LFIDY", 5), {"c.idx", "magic"});
  u32 = 7;
  with_idx(patch(8, &u32, 4), {"c.idx", "version", "7"});
  u32 = 3;
  with_idx(patch(12, &u32, 4), {"c.idx", "dtype", "3"});
  with_idx(good_idx.substr(0, good_idx.size() - 8), {"c.idx", "num_docs"});
  u64 = 1ULL << 62;
  with_idx(patch(16, &u64, 8), {"c.idx", "num_docs"});
  u64 = 7;
  with_idx(patch(24, &u64, 8), {"c.idx", "num_tokens"});
  u64 = 1;  // offsets = {0, 2, 1, 6}
  with_idx(patch(32 + 16, &u64, 8), {"c.idx", "offsets[2]"});
  u64 = 1;
  with_idx(patch(32, &u64, 8), {"c.idx", "offsets[0]"});

  write_bytes(idx, good_idx);
  write_bytes(bin, good_bin.substr(0, good_bin.size() - 2));
  expect_error([&] { TokenShard s(prefix); }, {"c.bin", "num_tokens", "truncated"});
  write_bytes(bin, good_bin + "xx");
  expect_error([&] { TokenShard s(prefix); }, {"c.bin", "num_tokens"});
  fs::remove(bin);
  expect_error([&] { TokenShard s(prefix); }, {"c.bin", "cannot open"});
  expect_error([&] { TokenShard s((dir / "nope").string()); }, {"nope.idx", "cannot open"});
}

// ------------------------------------------------------------------------------------------------ dataset

class PretrainTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = temp_dir();
    a_ = (dir_ / "a").string();
    b_ = (dir_ / "b").string();
    auto docs = tagged_docs(200, 1);
    docs.insert(docs.begin() + 5, std::vector<int64_t>{});  // an empty document is skipped
    write_shard(a_, docs, TokenDType::UInt32);
    write_shard(b_, tagged_docs(50, 2), TokenDType::UInt32);
  }
  PretrainOptions opts(std::vector<BlendSource> sources, int64_t seq_len = 16, uint64_t seed = 7) {
    PretrainOptions o;
    o.sources = std::move(sources);
    o.seq_len = seq_len;
    o.seed = seed;
    return o;
  }
  fs::path dir_;
  std::string a_, b_;
};

TEST_F(PretrainTest, SamplesAreContiguousDocumentRunsWithBoundaries) {
  PretrainDataset ds(opts({{a_, 1.0}}));
  for (const Sample& s : ds.next_batch(100)) {
    check_sample(s, 16);
    EXPECT_EQ(s.source, 0u);
  }
}

TEST_F(PretrainTest, DeterministicBySeed) {
  PretrainDataset x(opts({{a_, 1.0}, {b_, 1.0}})), y(opts({{a_, 1.0}, {b_, 1.0}}));
  PretrainDataset z(opts({{a_, 1.0}, {b_, 1.0}}, 16, 8));
  auto bx = x.next_batch(40), by = y.next_batch(40), bz = z.next_batch(40);
  EXPECT_EQ(bx, by);
  EXPECT_NE(bx, bz);
}

TEST_F(PretrainTest, BlendFollowsWeightsExactly) {
  PretrainDataset ds(opts({{a_, 2.0}, {b_, 1.0}}, 4));
  std::vector<uint32_t> first;
  for (const Sample& s : ds.next_batch(6)) first.push_back(s.source);
  EXPECT_EQ(first, (std::vector<uint32_t>{0, 1, 0, 0, 1, 0}));

  PretrainDataset big(opts({{a_, 0.7}, {b_, 0.3}}, 4));
  uint64_t count[2] = {0, 0};
  for (int t = 1; t <= 3000; ++t) {
    ++count[big.next().source];
    ASSERT_LE(std::abs(static_cast<double>(count[0]) - 0.7 * t), 1.0) << "at " << t;
  }
  EXPECT_EQ(big.state().source_samples, (std::vector<uint64_t>{count[0], count[1]}));
  EXPECT_NEAR(static_cast<double>(count[0]), 2100.0, 1.0);  // over several epochs of b
  EXPECT_GT(big.epoch(1), 1u);
}

TEST_F(PretrainTest, EpochCoversEveryTokenAndRollsOverInANewOrder) {
  PretrainDataset ds(opts({{b_, 1.0}}, 8));
  const uint64_t n = ds.samples_per_epoch(0), total = ds.split_tokens(0);
  EXPECT_EQ(n, (total - 1) / 8);
  TokenShard sh(b_);
  std::multiset<int64_t> all;
  for (int64_t t : sh.tokens(0, sh.num_tokens())) all.insert(t);
  std::vector<std::vector<Sample>> epochs;
  for (int e = 0; e < 2; ++e) {
    EXPECT_EQ(ds.epoch(0), static_cast<uint64_t>(e));
    epochs.push_back(ds.next_batch(n));
    std::multiset<int64_t> seen;
    for (const Sample& s : epochs.back()) {
      check_sample(s, 8);
      seen.insert(s.tokens.begin(), s.tokens.end() - 1);  // the inputs of the epoch's samples
    }
    // The inputs cover the stream but its last (total - 8n) tokens, each once.
    EXPECT_EQ(seen.size(), 8 * n);
    EXPECT_TRUE(std::includes(all.begin(), all.end(), seen.begin(), seen.end()));
    EXPECT_LE(total - seen.size(), 8u);
  }
  EXPECT_EQ(ds.epoch(0), 2u);
  EXPECT_NE(epochs[0], epochs[1]);
}

TEST_F(PretrainTest, ResumeMidEpochGivesTheSameContinuation) {
  auto o = opts({{a_, 3.0}, {b_, 1.0}}, 32);
  PretrainDataset run(o);
  std::vector<std::vector<Sample>> batches;
  nlohmann::json saved;
  for (int step = 0; step < 40; ++step) {  // b gets 40 samples: more than one epoch of it
    if (step == 11) saved = nlohmann::json::parse(run.state().to_json().dump());
    batches.push_back(run.next_batch(4));
  }
  EXPECT_EQ(saved["samples_consumed"], 44);
  EXPECT_GT(run.epoch(1), 0u);
  PretrainDataset resumed(o);
  resumed.restore(PretrainState::from_json(saved, "ckpt/data.json"));
  for (int step = 11; step < 40; ++step) ASSERT_EQ(resumed.next_batch(4), batches[step]) << "step " << step;
  EXPECT_EQ(resumed.state().to_json(), run.state().to_json());

  // A state from other options, or a malformed one, is refused with a one-line error naming the field.
  PretrainDataset other(opts({{a_, 3.0}, {b_, 1.0}}, 32, 99));
  expect_error([&] { other.restore(PretrainState::from_json(saved)); }, {"seed", "99"});
  PretrainDataset one(opts({{a_, 1.0}}, 32));
  expect_error([&] { one.restore(PretrainState::from_json(saved)); }, {"source_samples"});
  auto bad = saved;
  bad["samples_consumed"] = -1;
  expect_error([&] { PretrainState::from_json(bad, "ckpt/data.json"); }, {"ckpt/data.json", "samples_consumed"});
  bad = saved;
  bad.erase("split");
  expect_error([&] { PretrainState::from_json(bad, "ckpt/data.json"); }, {"ckpt/data.json", "split", "missing"});
}

TEST_F(PretrainTest, ValidationSplitHoldsOutDisjointDocuments) {
  auto o = opts({{a_, 1.0}}, 8);
  o.valid_fraction = 0.2;
  PretrainDataset train(o);
  o.split = Split::Valid;
  PretrainDataset valid(o);
  o.seed = 12345;  // the split does not depend on the shuffle seed
  PretrainDataset valid2(o);
  EXPECT_EQ(valid.split_docs(0), valid2.split_docs(0));
  EXPECT_EQ(train.split_docs(0) + valid.split_docs(0), 200u);  // the empty document is in neither
  EXPECT_GT(valid.split_docs(0), 20u);
  EXPECT_LT(valid.split_docs(0), 60u);

  auto docs_of = [](PretrainDataset& ds, uint64_t epochs) {
    std::set<int64_t> docs;
    for (const Sample& s : ds.next_batch(ds.samples_per_epoch(0) * epochs))
      for (int64_t t : s.tokens) docs.insert(doc_of(t));
    return docs;
  };
  auto t = docs_of(train, 1), v = docs_of(valid, 2), v2 = docs_of(valid2, 2);
  std::vector<int64_t> common;
  std::set_intersection(t.begin(), t.end(), v.begin(), v.end(), std::back_inserter(common));
  EXPECT_TRUE(common.empty());
  EXPECT_EQ(v, v2);
  // Shard a's documents 0..4 are tagged 0..4, its empty document is 5, then tags continue 5..199 (tag = index - 1).
  for (int64_t d : v) EXPECT_TRUE(PretrainDataset::is_valid_doc(0, 0.2, d < 5 ? d : d + 1)) << d;
}

TEST_F(PretrainTest, BadOptionsAreOneLineErrors) {
  expect_error([&] { PretrainDataset ds(opts({{b_, 1.0}}, 100000)); }, {"b.idx", "num_tokens", "100001"});
  expect_error([&] { PretrainDataset ds(opts({{a_, 1.0}, {b_, 0.0}})); }, {"sources[1].weight"});
  expect_error([&] { PretrainDataset ds(opts({})); }, {"sources"});
  expect_error([&] { PretrainDataset ds(opts({{a_, 1.0}}, 0)); }, {"seq_len"});
  auto o = opts({{a_, 1.0}});
  o.split = Split::Valid;
  expect_error([&] { PretrainDataset ds(o); }, {"valid_fraction"});
  expect_error([&] { PretrainDataset ds(opts({{(dir_ / "missing").string(), 1.0}})); }, {"missing.idx"});
}
