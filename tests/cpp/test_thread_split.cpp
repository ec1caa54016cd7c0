// Data parallelism over CPU threads (parallel/thread_split.h): the library's parallel loops really use several
// threads, work nested in a part stays on its thread, split gradients equal one batch's (fp32), autocast reaches
// the threads, and errors come back to the caller.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/autocast_mode.h>
#include <gtest/gtest.h>

#include <mutex>
#include <set>
#include <stdexcept>
#include <thread>

#include "loongforge/models/llama/model.h"
#include "loongforge/nn/loss.h"
#include "loongforge/parallel/thread_split.h"

using namespace lf;
using models::llama::CausalLM;
using models::llama::DecoderConfig;

namespace {

// Sets ATen's intra-op thread count for one test (other tests keep theirs).
struct Threads {
  explicit Threads(int n) : before(at::get_num_threads()) { at::set_num_threads(n); }
  ~Threads() { at::set_num_threads(before); }
  int before;
};

CausalLM tiny(bool tied) {
  nlohmann::json j = {{"model_type", "llama"}, {"vocab_size", 61}, {"hidden_size", 32}, {"intermediate_size", 48},
                      {"num_hidden_layers", 2}, {"num_attention_heads", 4}, {"num_key_value_heads", 2},
                      {"max_position_embeddings", 64}, {"rms_norm_eps", 1e-6}, {"tie_word_embeddings", tied}};
  at::manual_seed(3);
  return CausalLM(DecoderConfig::from_json(j));
}

// Summed token loss of rows [lo, hi) (targets -100 are not counted).
at::Tensor rows_loss(CausalLM& m, const at::Tensor& ids, const at::Tensor& tgt, const at::Tensor& seg, int64_t lo, int64_t hi) {
  at::Tensor s = seg.defined() ? seg.slice(0, lo, hi) : seg;
  at::Tensor logits = m->logits(m->hidden_states(ids.slice(0, lo, hi), {}, nullptr, s));
  return at::cross_entropy_loss(logits.to(at::kFloat).reshape({-1, logits.size(-1)}), tgt.slice(0, lo, hi).reshape({-1}), {},
                                at::Reduction::Sum, nn::kIgnoreIndex);
}

}  // namespace

TEST(ThreadSplit, LibraryLoopsUseSeveralThreads) {
  // at::parallel_for in a translation unit built without OpenMP runs serially: this fails if the library is.
  Threads t(2);
  std::mutex mu;
  std::set<std::thread::id> ids;
  bool all_in_region = true;
  parallel::on_threads(2, [&](int64_t) {
    std::lock_guard<std::mutex> lock(mu);
    ids.insert(std::this_thread::get_id());
    all_in_region = all_in_region && at::in_parallel_region();
  });
  EXPECT_EQ(ids.size(), 2u);
  EXPECT_TRUE(all_in_region);
}

TEST(ThreadSplit, NestedWorkStaysOnItsThread) {
  Threads t(2);
  std::mutex mu;
  bool same = true;
  int64_t parts = 0;
  parallel::on_threads(2, [&](int64_t) {
    const auto me = std::this_thread::get_id();
    at::parallel_for(0, 64, 1, [&](int64_t, int64_t) {
      std::lock_guard<std::mutex> lock(mu);
      same = same && std::this_thread::get_id() == me;
    });
    // an ATen op inside a part runs too (and on this thread)
    at::Tensor x = at::randn({256, 64});
    EXPECT_TRUE(at::allclose(at::mm(x, x.t()), at::mm(x, x.t())));
    std::lock_guard<std::mutex> lock(mu);
    ++parts;
  });
  EXPECT_TRUE(same);
  EXPECT_EQ(parts, 2);
}

TEST(ThreadSplit, ErrorsReachTheCaller) {
  Threads t(2);
  EXPECT_THROW(parallel::on_threads(2, [](int64_t i) { if (i == 1) throw std::runtime_error("part 1"); }), std::runtime_error);
  std::vector<at::Tensor> params{at::ones({2}, at::requires_grad(false))};
  EXPECT_THROW(parallel::split_backward(2, params, [&](int64_t) { return params[0].sum(); }), std::exception);
}

class ThreadSplitGrads : public ::testing::TestWithParam<std::tuple<bool, int, int>> {};

TEST_P(ThreadSplitGrads, EqualOneBatch) {
  const auto [tied, parts, threads] = GetParam();
  Threads t(threads);
  CausalLM m = tiny(tied);
  const int64_t rows = 5, seq = 12;
  at::Tensor ids = at::randint(0, 61, {rows, seq}, at::kLong);
  at::Tensor tgt = at::randint(0, 61, {rows, seq}, at::kLong);
  tgt.index_put_({at::indexing::Slice(), at::indexing::Slice(0, 3)}, -100);  // some positions not counted
  at::Tensor seg = at::cat({at::zeros({rows, 5}, at::kLong), at::ones({rows, seq - 5}, at::kLong)}, 1);  // packed documents
  const double counted = static_cast<double>((tgt != -100).sum().item<int64_t>());
  std::vector<at::Tensor> params = m->parameters();

  // reference: one batch on this thread, float64 accumulation target
  for (auto& p : params) p.mutable_grad() = at::Tensor();
  (rows_loss(m, ids, tgt, seg, 0, rows) / counted).backward();
  std::vector<at::Tensor> ref;
  for (auto& p : params) ref.push_back(p.grad().clone());

  // split twice: gradients accumulate into .grad
  for (auto& p : params) p.mutable_grad() = at::Tensor();
  for (int rep = 0; rep < 2; ++rep)
    parallel::split_backward(parts, params, [&](int64_t i) {
      return rows_loss(m, ids, tgt, seg, rows * i / parts, rows * (i + 1) / parts) / counted;
    });
  for (size_t k = 0; k < params.size(); ++k) {
    const double scale = ref[k].abs().max().item<double>();
    ASSERT_GT(scale, 0.0) << k;
    // float32 sums of differently split rows (the BLAS blocks each product by its own shape): a few ulps of the
    // largest gradient
    EXPECT_LE((params[k].grad() - 2 * ref[k]).abs().max().item<double>(), 4e-6 * scale) << k;
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, ThreadSplitGrads,
                         ::testing::Values(std::make_tuple(false, 2, 2), std::make_tuple(true, 2, 2),
                                           std::make_tuple(false, 3, 2), std::make_tuple(true, 5, 1)));

TEST(ThreadSplit, AutocastReachesTheThreads) {
  Threads t(2);
  CausalLM m = tiny(false);
  at::Tensor ids = at::randint(0, 61, {2, 16}, at::kLong), tgt = at::randint(0, 61, {2, 16}, at::kLong);
  auto half_losses = [&](bool threads) {
    std::vector<double> out(2);
    auto one = [&](int64_t i) { out[static_cast<size_t>(i)] = rows_loss(m, ids, tgt, {}, i, i + 1).item<double>(); };
    if (threads) parallel::on_threads(2, one);
    else for (int64_t i = 0; i < 2; ++i) one(i);
    return out;
  };
  const auto fp32 = half_losses(false);
  at::autocast::set_autocast_enabled(at::kCPU, true);
  at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
  const auto bf16_here = half_losses(false), bf16_threads = half_losses(true);
  at::autocast::set_autocast_enabled(at::kCPU, false);
  at::autocast::clear_cache();
  const auto fp32_again = half_losses(true);  // the threads' autocast state was restored
  for (size_t i = 0; i < 2; ++i) {
    const double bf16_err = std::abs(bf16_here[i] - fp32[i]);
    EXPECT_GT(bf16_err, 1e-5 * std::abs(fp32[i])) << i;  // bf16 visibly differs from fp32 ...
    EXPECT_LE(std::abs(bf16_threads[i] - bf16_here[i]), 0.05 * bf16_err) << i;  // ... and the threads ran bf16
    EXPECT_LE(std::abs(fp32_again[i] - fp32[i]), 1e-6 * std::abs(fp32[i])) << i;
  }
}
