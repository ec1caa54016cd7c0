// Data parallelism (DDP, ZeRO-1, FSDP/ZeRO-3, HSDP, gradient accumulation) against the same tiny Llama trained in
// one process: each rank computes the single-process reference itself and compares its distributed run with it.
// Single-process tests use groups of one; the multi-rank ones are the DistHook.DataParallel hook, started by
// tests/python/test_dist_dp.py with LF_DP_HOOK="zero,shard,replicate,micro_batches".
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/module.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>

#include "loongforge/core/error.h"
#include "loongforge/models/llama/model.h"
#include "loongforge/nn/loss.h"
#include "loongforge/optim/adamw.h"
#include "loongforge/optim/distributed.h"
#include "loongforge/parallel/comm.h"
#include "loongforge/parallel/fsdp.h"
#include "loongforge/data/token_shards.h"
#include "loongforge/train/pretrain_source.h"
#include "loongforge/train/sft_source.h"
#include "test_util.h"

using namespace lf;
using models::llama::CausalLM;
using models::llama::DecoderConfig;

namespace {

constexpr int kSteps = 10, kBatch = 24, kSeq = 16, kVocab = 128;
constexpr double kLr = 1e-2, kMaxNorm = 0.6;   // some steps clip (untied), all clip (tied)

CausalLM tiny_model(bool tied) {
  nlohmann::json j = {{"model_type", "llama"}, {"vocab_size", kVocab}, {"hidden_size", 32}, {"intermediate_size", 64},
                      {"num_hidden_layers", 3}, {"num_attention_heads", 4}, {"num_key_value_heads", 2},
                      {"max_position_embeddings", 64}, {"rms_norm_eps", 1e-6}, {"tie_word_embeddings", tied}};
  torch::manual_seed(7);
  return CausalLM(DecoderConfig::from_json(j));
}

// The global batch of a step (identical on every rank): learnable sequences (each token determines the next)
// from random starts; about 20% of the labels are ignored so that ranks count different numbers of tokens.
std::pair<at::Tensor, at::Tensor> global_batch(int step) {
  at::manual_seed(100 + step);
  at::Tensor ids = at::empty({kBatch, kSeq}, at::kLong);
  ids.select(1, 0).copy_(at::randint(0, kVocab, {kBatch}, at::kLong));
  for (int t = 1; t < kSeq; ++t) ids.select(1, t).copy_((ids.select(1, t - 1) * 5 + 3).remainder(kVocab));
  at::Tensor labels = ids.clone();
  labels.masked_fill_(at::rand({kBatch, kSeq}) < 0.2, nn::kIgnoreIndex);
  return {ids, labels};
}

int64_t counted_tokens(const at::Tensor& labels) {
  return (labels.narrow(1, 1, labels.size(1) - 1) != nn::kIgnoreIndex).sum().item<int64_t>();
}

double decay_of(const std::string& name) { return name.find("norm") != std::string::npos ? 0.0 : 0.1; }

optim::AdamWOptions adam_opts() {
  optim::AdamWOptions o;
  o.lr = kLr;
  o.beta2 = 0.95;
  return o;
}

struct Trace {
  std::vector<double> loss, norm;
  std::map<std::string, at::Tensor> params, exp_avg, exp_avg_sq;
};

Trace reference(bool tied) {
  auto m = tiny_model(tied);
  std::vector<at::Tensor> params;
  std::vector<double> wd;
  for (auto& it : m->named_parameters()) {
    params.push_back(it.value());
    wd.push_back(decay_of(it.key()));
  }
  optim::AdamW opt(params, adam_opts(), wd);
  Trace t;
  for (int s = 0; s < kSteps; ++s) {
    auto [ids, labels] = global_batch(s);
    auto [sum, n] = nn::causal_lm_loss_sum(m->forward(ids), labels);
    EXPECT_EQ(n, counted_tokens(labels));
    at::Tensor loss = sum / static_cast<double>(n);
    loss.backward();
    t.loss.push_back(loss.item<double>());
    t.norm.push_back(optim::clip_grad_norm(params, kMaxNorm));
    opt.step(kLr);
    opt.zero_grad();
  }
  size_t i = 0;
  for (auto& it : m->named_parameters()) {
    t.params[it.key()] = it.value().detach().clone();
    t.exp_avg[it.key()] = opt.exp_avg()[i].clone();
    t.exp_avg_sq[it.key()] = opt.exp_avg_sq()[i++].clone();
  }
  return t;
}

struct Layout {
  int zero = 0, shard = 1, replicate = 1, micro = 1;
  bool tied = false;
};

Trace distributed(const std::shared_ptr<parallel::Comm>& comm, const Layout& lay) {
  parallel::Mesh mesh(comm, {{"replicate", lay.replicate}, {"shard", lay.shard}});
  const parallel::Group& shard = mesh.group("shard");
  const parallel::Group& rep = mesh.group("replicate");
  const int D = comm->world(), d = comm->rank();  // data-parallel index: any bijection of the ranks
  auto m = tiny_model(lay.tied);
  std::shared_ptr<parallel::FullyShardedModel> fsdp;
  std::unique_ptr<optim::DataParallelOptimizer> opt;
  if (lay.zero == 3) {
    fsdp = parallel::fully_shard(*m, shard, rep);
    // Only this rank's shard is kept: the layers' parameters are empty until gathered.
    EXPECT_EQ(m->model->layers[0]->parameters()[0].numel(), 0);
    std::vector<double> wd;
    for (const auto& n : fsdp->names()) wd.push_back(decay_of(n));
    opt = std::make_unique<optim::DataParallelOptimizer>(fsdp, wd, adam_opts());
  } else {
    std::vector<std::string> names;
    std::vector<at::Tensor> params;
    std::vector<double> wd;
    for (auto& it : m->named_parameters()) {
      names.push_back(it.key());
      params.push_back(it.value());
      wd.push_back(decay_of(it.key()));
    }
    optim::DataParallelOptions dp;
    dp.zero = lay.zero;
    dp.bucket_bytes = 16 << 10;  // several buckets
    opt = std::make_unique<optim::DataParallelOptimizer>(names, params, wd, adam_opts(), rep, shard, dp);
  }
  Trace t;
  EXPECT_EQ(kBatch % (D * lay.micro), 0);
  const int64_t rows = kBatch / D / lay.micro;
  for (int s = 0; s < kSteps; ++s) {
    auto [ids, labels] = global_batch(s);
    const double n = static_cast<double>(counted_tokens(labels));  // the trainer all-reduces this count
    at::Tensor local = at::zeros({1}, at::kDouble);
    for (int mb = 0; mb < lay.micro; ++mb) {
      const int64_t r0 = (d * lay.micro + mb) * rows;
      at::Tensor x = ids.narrow(0, r0, rows), y = labels.narrow(0, r0, rows);
      opt->set_sync(mb == lay.micro - 1);
      at::Tensor logits = fsdp ? m->logits(fsdp->forward_hidden(lf::models::Batch{{"input_ids", x}})) : m->forward(x);
      auto [sum, cnt] = nn::causal_lm_loss_sum(logits, y);
      (sum / n).backward();
      opt->finish_backward();
      local += sum.item<double>() / n;
      if (fsdp) EXPECT_EQ(m->model->layers[1]->parameters()[0].numel(), 0) << "layers are freed after backward";
    }
    comm->world_group().all_reduce(local);
    t.loss.push_back(local.item<double>());
    t.norm.push_back(opt->clip_grad_norm(kMaxNorm));
    opt->step(kLr);
    opt->zero_grad();
  }
  if (auto* ddp = dynamic_cast<parallel::BucketedDataParallel*>(&opt->engine()))
    if (D > 1) EXPECT_GT(ddp->started_in_backward(), 0) << "bucket reductions should overlap backward";
  if (fsdp) {
    t.params = fsdp->full_parameters();
    auto master = opt->full_state("param");
    for (auto& [k, v] : t.params) EXPECT_TRUE(at::equal(v, master.at(k))) << k;
  } else {
    for (auto& it : m->named_parameters()) t.params[it.key()] = it.value().detach().clone();
  }
  t.exp_avg = opt->full_state("exp_avg");
  t.exp_avg_sq = opt->full_state("exp_avg_sq");
  // Loading the full state back leaves it unchanged.
  opt->load_full_state("exp_avg", t.exp_avg);
  auto again = opt->full_state("exp_avg");
  for (auto& [k, v] : t.exp_avg) EXPECT_TRUE(at::equal(v, again.at(k))) << k;
  return t;
}

double rel(double a, double b) { return std::abs(a - b) / std::max(std::abs(b), 1e-12); }

// max |a - b| relative to max |b|, per tensor.
double tensor_rel(const at::Tensor& a, const at::Tensor& b) {
  double scale = b.abs().max().item<double>();
  return (a - b).abs().max().item<double>() / std::max(scale, 1e-12);
}

void compare(const Trace& got, const Trace& ref, double tol) {
  ASSERT_EQ(got.loss.size(), ref.loss.size());
  int clipped = 0;
  double worst_loss = 0, worst_norm = 0, worst_param = 0;
  for (size_t s = 0; s < ref.loss.size(); ++s) {
    worst_loss = std::max(worst_loss, rel(got.loss[s], ref.loss[s]));
    worst_norm = std::max(worst_norm, rel(got.norm[s], ref.norm[s]));
    EXPECT_LE(rel(got.loss[s], ref.loss[s]), tol) << "step " << s << " loss " << got.loss[s] << " vs " << ref.loss[s];
    EXPECT_LE(rel(got.norm[s], ref.norm[s]), tol) << "step " << s << " norm " << got.norm[s] << " vs " << ref.norm[s];
    clipped += ref.norm[s] > kMaxNorm;
  }
  EXPECT_GT(clipped, 0) << "the test should exercise clipping";
  EXPECT_LT(ref.loss.back(), ref.loss.front()) << "the reference should learn";
  ASSERT_EQ(got.params.size(), ref.params.size());
  for (auto& [k, v] : ref.params)
    if (got.params.count(k)) worst_param = std::max(worst_param, tensor_rel(got.params.at(k), v));
  std::cout << "loss " << ref.loss.front() << " -> " << ref.loss.back() << ", norm " << ref.norm.front() << " -> "
            << ref.norm.back() << ", clipped " << clipped << "/" << ref.loss.size() << "; worst relative errors: loss "
            << worst_loss << ", norm " << worst_norm << ", params " << worst_param << "\n";
  for (auto& [k, v] : ref.params) {
    ASSERT_TRUE(got.params.count(k)) << k;
    EXPECT_LE(tensor_rel(got.params.at(k), v), tol) << k;
    EXPECT_LE(tensor_rel(got.exp_avg.at(k), ref.exp_avg.at(k)), 100 * tol) << k;
    EXPECT_LE(tensor_rel(got.exp_avg_sq.at(k), ref.exp_avg_sq.at(k)), 100 * tol) << k;
  }
}

std::shared_ptr<parallel::Comm> single() { return parallel::Comm::init(parallel::detect_launch({{"HOME", "/"}}), {}); }

}  // namespace

TEST(DataParallel, OneRankDdpAndZero1MatchAdamW) {
  auto ref = reference(false);
  compare(distributed(single(), {0, 1, 1, 1}), ref, 1e-6);
  compare(distributed(single(), {1, 1, 1, 1}), ref, 1e-6);
}

TEST(DataParallel, OneRankAccumulationMatches) {
  auto ref = reference(false);
  compare(distributed(single(), {0, 1, 1, 2}), ref, 1e-5);
}

TEST(Fsdp, OneRankMatchesIncludingTiedEmbeddings) {
  compare(distributed(single(), {3, 1, 1, 1}), reference(false), 1e-6);
  Layout tied{3, 1, 1, 2};
  tied.tied = true;
  compare(distributed(single(), tied), reference(true), 1e-5);
}

TEST(DataParallel, BadZeroIsAnError) {
  auto comm = single();
  auto m = tiny_model(false);
  std::vector<std::string> names;
  std::vector<at::Tensor> params;
  for (auto& it : m->named_parameters()) {
    names.push_back(it.key());
    params.push_back(it.value());
  }
  optim::DataParallelOptions dp;
  dp.zero = 2;
  const auto& g = comm->world_group();
  try {
    optim::DataParallelOptimizer opt(names, params, {}, adam_opts(), g, g, dp);
    FAIL() << "zero=2 accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("zero: "), std::string::npos) << e.what();
  }
}

TEST(DataParallel, BucketsAndFlatShardPieces) {
  auto comm = single();
  auto m = tiny_model(false);
  std::vector<std::string> names;
  std::vector<at::Tensor> params;
  for (auto& it : m->named_parameters()) {
    names.push_back(it.key());
    params.push_back(it.value());
  }
  at::Tensor before = params[0].detach().clone();
  parallel::BucketedDataParallel ddp(names, params, comm->world_group(), comm->world_group(), 16 << 10);
  EXPECT_GT(ddp.num_buckets(), 2u);
  EXPECT_TRUE(at::equal(params[0], before));  // the parameters are views of the buckets with the same values
  int64_t covered = 0;
  for (auto& s : ddp.shards())
    for (auto& p : s.pieces()) covered += p.length;
  int64_t total = 0;
  for (auto& p : params) total += p.numel();
  EXPECT_EQ(covered, total);
  parallel::FlatShard fs;  // 3 ranks over a flat vector of 10 (+2 padding): rank 1 owns [4, 8)
  fs.param = at::zeros({4});
  fs.params = {0, 1};
  fs.offsets = {0, 6};
  fs.numels = {6, 4};
  fs.shard_rank = 1;
  fs.shard_size = 3;
  auto pc = fs.pieces();
  ASSERT_EQ(pc.size(), 2u);
  EXPECT_EQ(pc[0].shard_offset, 0);
  EXPECT_EQ(pc[0].param_offset, 4);
  EXPECT_EQ(pc[0].length, 2);
  EXPECT_EQ(pc[1].shard_offset, 2);
  EXPECT_EQ(pc[1].param_offset, 0);
  EXPECT_EQ(pc[1].length, 2);
}

TEST(DistHook, DataParallel) {
  const char* spec = std::getenv("LF_DP_HOOK");
  if (!spec) GTEST_SKIP() << "run by tests/python/test_dist_dp.py";
  Layout lay;
  char comma;
  int tied = 0;
  std::stringstream ss(spec);
  ss >> lay.zero >> comma >> lay.shard >> comma >> lay.replicate >> comma >> lay.micro;
  if (ss >> comma >> tied) lay.tied = tied != 0;
  auto comm = parallel::Comm::init();
  ASSERT_EQ(comm->world(), lay.shard * lay.replicate);
  auto got = distributed(comm, lay);
  compare(got, reference(lay.tied), 1e-5);
}

// ---- Each data-parallel rank reads only its rows: BatchSource::next_rows against the whole draw ----

namespace {

void expect_same_rows(const lf::train::Batch& got, const lf::train::Batch& whole, int64_t first, int64_t n) {
  auto eq = [&](const at::Tensor& a, const at::Tensor& w, const char* what) {
    ASSERT_EQ(a.defined(), w.defined()) << what;
    if (!a.defined()) return;
    EXPECT_TRUE(at::equal(a, w.narrow(0, first, n))) << what << " rows [" << first << ", " << first + n << ")";
  };
  for (const char* f : {"input_ids", "targets", "position_ids", "segment_ids"}) eq(got.get(f), whole.get(f), f);
}

// For each split of a global batch into rows [first, first + n): a source drawing only those rows gives the rows of
// the whole draw and ends at the same position (state()) after every batch.
template <class Make>
void check_rows_equal_whole_draw(Make make, int64_t global) {
  const std::vector<std::pair<int64_t, int64_t>> splits = {{0, 2}, {2, 2}, {4, 2}, {1, 3}, {0, global}, {global - 1, 1}};
  for (auto [first, n] : splits) {
    auto whole = make(), mine = make();
    for (int step = 0; step < 4; ++step) {
      lf::train::Batch w = whole->next(global);
      lf::train::Batch m = mine->next_rows(global, first, n);
      expect_same_rows(m, w, first, n);
      EXPECT_EQ(mine->state().dump(), whole->state().dump()) << "after batch " << step;
    }
    // and a resumed source (state of the rows-only one) continues like the whole draw
    auto resumed = make();
    resumed->restore(mine->state());
    expect_same_rows(resumed->next_rows(global, first, n), whole->next(global), first, n);
  }
  auto s = make();
  EXPECT_THROW(s->next_rows(global, global - 1, 2), lf::Error);
}

}  // namespace

TEST(BatchRows, PretrainRowsEqualSliceOfWholeDraw) {
  auto dir = lf::test::temp_dir();
  at::manual_seed(5);
  for (const char* name : {"a", "b"}) {
    lf::data::TokenShardWriter w((dir / name).string(), lf::data::TokenDType::UInt16);
    for (int d = 0; d < 40; ++d) {
      at::Tensor t = at::randint(3, 500, {at::randint(3, 30, {1}).item<int64_t>()}, at::kLong);
      w.add_doc(std::span<const int64_t>(t.data_ptr<int64_t>(), static_cast<size_t>(t.numel())));
    }
    w.finish();
  }
  for (bool per_document : {false, true}) {
    auto make = [&] {
      lf::data::PretrainOptions o;
      o.sources = {{(dir / "a").string(), 1.0}, {(dir / "b").string(), 2.0}};
      o.seq_len = 12;
      o.seed = 9;
      return std::make_unique<lf::train::PretrainSource>(o, per_document);
    };
    check_rows_equal_whole_draw(make, 6);
  }
}

TEST(BatchRows, SftRowsEqualSliceOfWholeDraw) {
  auto dir = lf::test::temp_dir();
  std::ofstream f(dir / "d.jsonl");
  for (int i = 0; i < 23; ++i)
    f << R"({"instruction": "add )" << i << " and " << 3 * i << R"(", "output": ")" << 4 * i << std::string(i % 5, 'x') << "\"}\n";
  f.close();
  const std::string tok = std::string(LF_SOURCE_DIR) + "/tests/fixtures/tok_bytelevel_gpt2";
  for (bool packing : {false, true}) {
    auto make = [&] {
      return std::make_unique<lf::train::SftSource>(std::vector<std::string>{(dir / "d.jsonl").string()}, tok, "chatml",
                                                    64, true, packing, 3);
    };
    check_rows_equal_whole_draw(make, 6);
  }
}
