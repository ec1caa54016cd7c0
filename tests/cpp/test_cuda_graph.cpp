// Whole training steps on the GPU: CUDA graphs (kernels/cuda_graph.h, train.cuda_graphs: a captured piece of work
// replays on new inputs, and a run whose steps replay a captured forward + backward gives the eager run's losses and
// gradient norms), the model on the GPU against the CPU, and the distributed engine on the GPU (NCCL, one rank)
// against the single-process engine. Skipped without a CUDA device (CI); run on the GPU machine by
// bench/gpu_check.sh.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "loongforge/io/safetensors.h"
#include "loongforge/kernels/cuda_graph.h"
#include "loongforge/kernels/cuda_ops.h"
#include "loongforge/models/generate.h"
#include "loongforge/models/llama/model.h"
#include "loongforge/train/recipe.h"
#include "loongforge/train/trainer.h"
#include "test_util.h"

namespace cu = lf::kernels::cuda;

#define SKIP_WITHOUT_CUDA() \
  if (!cu::available()) GTEST_SKIP() << "no CUDA device (LoongForge CUDA kernels compiled: " << cu::compiled() << ")"

TEST(CudaKernels, GraphReplaysCapturedWorkOnNewInputs) {
  SKIP_WITHOUT_CUDA();
  cu::StreamScope scope;
  at::Tensor x = at::randn({1000}, at::kCUDA), w = at::randn({1000}, at::kCUDA), y;
  cu::Graph g;
  EXPECT_FALSE(g.captured());
  g.capture([&] { y = (x * w).cumsum(0) + 1; });
  ASSERT_TRUE(g.captured());
  for (int i = 0; i < 3; ++i) {
    at::Tensor fresh = at::randn({1000});
    x.copy_(fresh.pin_memory(), /*non_blocking=*/true);
    g.replay();
    at::Tensor want = (fresh * w.cpu()).cumsum(0) + 1;
    EXPECT_TRUE(at::allclose(y.cpu(), want, 1e-4, 1e-4)) << i;
  }
}

namespace {

// A tiny Llama (llama3 rope scaling when `scaled`) on the CPU and its copy on GPU 0.
std::pair<lf::models::llama::CausalLM, lf::models::llama::CausalLM> cpu_and_gpu_llama(bool scaled, uint64_t seed) {
  nlohmann::json j = {{"model_type", "llama"}, {"vocab_size", 300}, {"hidden_size", 64}, {"intermediate_size", 96},
                      {"num_hidden_layers", 2}, {"num_attention_heads", 4}, {"num_key_value_heads", 2},
                      {"max_position_embeddings", 64}, {"rms_norm_eps", 1e-6}};
  if (scaled)
    j["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 8.0}, {"low_freq_factor", 1.0}, {"high_freq_factor", 4.0},
                         {"original_max_position_embeddings", 16}};
  torch::manual_seed(seed);
  lf::models::llama::CausalLM cpu(lf::models::llama::DecoderConfig::from_json(j));
  lf::models::llama::CausalLM gpu(lf::models::llama::DecoderConfig::from_json(j));
  torch::NoGradGuard no_grad;
  for (auto& item : gpu->named_parameters()) item.value().copy_(cpu->named_parameters()[item.key()]);
  gpu->to(at::Device(at::kCUDA, 0));
  return {cpu, gpu};
}

}  // namespace

// A model moved to the GPU takes its rotary frequencies along (a forward copies nothing from the host, which a
// graph could not capture) and computes what it computes on the CPU.
TEST(CudaKernels, CausalLMOnCudaMatchesCpu) {
  SKIP_WITHOUT_CUDA();
  auto [cpu, gpu] = cpu_and_gpu_llama(/*scaled=*/true, 2);
  torch::NoGradGuard no_grad;
  at::Tensor ids = at::randint(0, 300, {2, 40}, at::kLong);
  auto [c, s] = gpu->rotary(at::arange(40, at::kLong).unsqueeze(0).to(at::kCUDA), at::kFloat);
  EXPECT_TRUE(c.is_cuda() && s.is_cuda());
  at::Tensor want = cpu->forward(ids), got = gpu->forward(ids.to(at::kCUDA));
  EXPECT_TRUE(at::allclose(got.cpu(), want, 1e-4, 1e-4)) << (got.cpu() - want).abs().max().item<double>();
}

// Generation with the key/value cache on the GPU continues a prompt as on the CPU (greedy; the logits come to the
// host for sampling either way).
TEST(CudaKernels, CausalLMGeneratesOnCudaAsOnCpu) {
  SKIP_WITHOUT_CUDA();
  auto [cpu, gpu] = cpu_and_gpu_llama(/*scaled=*/false, 4);
  cpu->eval();
  gpu->eval();
  lf::models::GenerateOptions o;
  o.max_new_tokens = 12;
  const std::vector<int64_t> prompt = {3, 17, 42, 5, 99};
  const auto want = lf::models::generate(*cpu, prompt, o), got = lf::models::generate(*gpu, prompt, o);
  EXPECT_EQ(got, want);
  EXPECT_EQ(want.size(), 12u);
}

namespace {

// metrics.jsonl of a short run of a tiny Llama on one batch file: {loss, grad_norm} per step.
std::vector<std::pair<double, double>> run(const std::filesystem::path& dir, const std::string& tag,
                                           const std::vector<std::string>& sets) {
  std::vector<std::string> o = {"output_dir=" + (dir / tag).string(), "device=cuda", "seed=3",
                                "model.config=" + (dir / "config.json").string(), "data.format=batch",
                                "data.train=[{path: " + (dir / "batch.safetensors").string() + "}]", "data.seq_len=64",
                                "train.steps=6", "train.micro_batch_size=2", "train.grad_accum=2", "optim.lr=1e-3",
                                "schedule.kind=constant", "checkpoint.every=0", "log.progress=off",
                                "log.tensorboard=false", "log.plot=false"};
  o.insert(o.end(), sets.begin(), sets.end());
  lf::train::train(lf::train::load_recipe("", o), false);
  std::vector<std::pair<double, double>> out;
  std::ifstream in(dir / tag / "metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    auto j = nlohmann::json::parse(line);
    out.emplace_back(j["loss"].get<double>(), j["grad_norm"].get<double>());
  }
  return out;
}

}  // namespace

namespace {
// A tiny Llama and a batch file with ~20 % of the labels ignored (so steps count different numbers of tokens).
void write_inputs(const std::filesystem::path& dir) {
  nlohmann::json cfg = {{"model_type", "llama"}, {"vocab_size", 8192}, {"hidden_size", 128},
                        {"intermediate_size", 256}, {"num_hidden_layers", 2}, {"num_attention_heads", 4},
                        {"num_key_value_heads", 2}, {"max_position_embeddings", 128}, {"rms_norm_eps", 1e-6},
                        {"tie_word_embeddings", false}};
  std::ofstream(dir / "config.json") << cfg.dump();
  at::manual_seed(5);
  at::Tensor ids = at::randint(0, 8192, {8, 64}, at::kLong);
  at::Tensor labels = ids.clone().masked_fill_(at::rand({8, 64}) < 0.2, -100);
  lf::io::save_file((dir / "batch.safetensors").string(), {{"input_ids", ids}, {"labels", labels}});
}
}  // namespace

// The distributed engine on the GPU with ZeRO-1 at world size 1 (NCCL; flat gradient buckets, AdamW over the
// shard, the parameters gathered back) trains as the single-process GPU engine: same losses and grad norms (fp32).
// On the CPU the same pair of runs agrees to 1e-6 (losses) and 5e-5 (grad norms).
TEST(CudaKernels, DataParallelZero1OnGpuMatchesSingle) {
  SKIP_WITHOUT_CUDA();
  const auto dir = lf::test::temp_dir();
  write_inputs(dir);
  ::setenv("MASTER_PORT", "29657", 1);  // the one-rank NCCL group's rendezvous store
  auto single = run(dir, "single", {});
  auto zero1 = run(dir, "zero1", {"parallel.zero=1"});
  ASSERT_EQ(single.size(), 6u);
  ASSERT_EQ(zero1.size(), 6u);
  for (size_t i = 0; i < single.size(); ++i) {
    EXPECT_NEAR(zero1[i].first, single[i].first, 1e-5 * std::abs(single[i].first)) << "step " << i + 1;
    // (the single engine sums the squares in float32 with the multi-tensor kernel, ZeRO-1 in float64)
    EXPECT_NEAR(zero1[i].second, single[i].second, 1e-4 * std::abs(single[i].second)) << "step " << i + 1;
  }
}

// train.cuda_graphs: steps 1-2 eager, then every micro-batch (two per step) replays the captured step; the labels
// drop ~20 % of the tokens, so each step divides by a different count (read by the graph from its address). fp32
// and bf16 (flash attention), with the fused linear + cross-entropy (2 x 64 x 8192 logits).
TEST(CudaKernels, GraphedTrainingMatchesEager) {
  SKIP_WITHOUT_CUDA();
  const auto dir = lf::test::temp_dir();
  write_inputs(dir);
  for (const std::string prec : {"fp32", "bf16"}) {
    auto eager = run(dir, prec + "_eager", {"precision=" + prec});
    auto graphed = run(dir, prec + "_graphs", {"precision=" + prec, "train.cuda_graphs=true"});
    ASSERT_EQ(eager.size(), 6u) << prec;
    ASSERT_EQ(graphed.size(), 6u) << prec;
    for (size_t i = 0; i < eager.size(); ++i) {
      // The same kernels on the same inputs; only flash attention's backward may add in another order.
      EXPECT_NEAR(graphed[i].first, eager[i].first, 1e-5 * std::abs(eager[i].first)) << prec << " step " << i + 1;
      EXPECT_NEAR(graphed[i].second, eager[i].second, 1e-4 * std::abs(eager[i].second)) << prec << " step " << i + 1;
    }
    EXPECT_LT(eager[4].first, eager[0].first) << prec;  // it trains (steps 1, 3, 5 see the same rows)
  }
}
