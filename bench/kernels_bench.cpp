// Our fused CPU kernels against their composite ATen versions (Google Benchmark). Run with
//   OMP_NUM_THREADS=2 build/loongforge_bench_kernels
#include <ATen/ATen.h>
#include <cmath>
#include <limits>
#include <benchmark/benchmark.h>
#include <torch/csrc/autograd/autograd.h>

#include "loongforge/kernels/attention.h"
#include "loongforge/kernels/linear.h"
#include "loongforge/kernels/linear_ce.h"
#include "loongforge/kernels/rms_norm.h"
#include "loongforge/kernels/rope.h"
#include "loongforge/kernels/swiglu.h"
#include "loongforge/kernels/causal_conv.h"
#include "loongforge/kernels/sparse_attention.h"
#include "loongforge/models/llama/model.h"
#include "loongforge/nn/gated_delta.h"
#include "loongforge/parallel/thread_split.h"

namespace {

template <bool Fused>
void BM_RMSNorm(benchmark::State& st) {
  at::Tensor x = at::randn({st.range(0), st.range(1)}).requires_grad_(), w = at::ones({st.range(1)}).requires_grad_();
  at::Tensor dy = at::randn({st.range(0), st.range(1)});
  for (auto _ : st) {
    at::Tensor y = Fused ? lf::kernels::rms_norm(x, w, 1e-6) : lf::kernels::rms_norm_reference(x, w, 1e-6);
    auto g = torch::autograd::grad({y}, {x, w}, {dy});
    benchmark::DoNotOptimize(g[0].data_ptr());
  }
}
BENCHMARK_TEMPLATE(BM_RMSNorm, true)->Args({2048, 512})->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK_TEMPLATE(BM_RMSNorm, false)->Args({2048, 512})->Unit(benchmark::kMicrosecond)->UseRealTime();

// SwiGLU on [rows, ffn] (the MLP of the small bench shape: 2048 tokens x 688; the larger: 2048 x 1376).
template <bool Fused>
void BM_SwiGLU(benchmark::State& st) {
  at::Tensor g = at::randn({st.range(0), st.range(1)}).requires_grad_(), u = at::randn({st.range(0), st.range(1)}).requires_grad_();
  at::Tensor dy = at::randn({st.range(0), st.range(1)});
  for (auto _ : st) {
    at::Tensor y = Fused ? lf::kernels::swiglu(g, u) : lf::kernels::swiglu_reference(g, u);
    auto gr = torch::autograd::grad({y}, {g, u}, {dy});
    benchmark::DoNotOptimize(gr[0].data_ptr());
  }
}
BENCHMARK_TEMPLATE(BM_SwiGLU, true)->Args({2048, 688})->Args({2048, 1376})->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK_TEMPLATE(BM_SwiGLU, false)->Args({2048, 688})->Args({2048, 1376})->Unit(benchmark::kMicrosecond)->UseRealTime();

// GeGLU with the tanh GELU (Gemma's MLP in π0) on [rows, ffn]: π0 small's PaliGemma MLP (640 prefix tokens x 2048).
template <bool Fused>
void BM_GeGLU(benchmark::State& st) {
  at::Tensor g = at::randn({st.range(0), st.range(1)}).requires_grad_(), u = at::randn({st.range(0), st.range(1)}).requires_grad_();
  at::Tensor dy = at::randn({st.range(0), st.range(1)});
  for (auto _ : st) {
    at::Tensor y = Fused ? lf::kernels::geglu_tanh(g, u) : lf::kernels::geglu_tanh_reference(g, u);
    auto gr = torch::autograd::grad({y}, {g, u}, {dy});
    benchmark::DoNotOptimize(gr[0].data_ptr());
  }
}
BENCHMARK_TEMPLATE(BM_GeGLU, true)->Args({640, 2048})->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK_TEMPLATE(BM_GeGLU, false)->Args({640, 2048})->Unit(benchmark::kMicrosecond)->UseRealTime();

// GELU (tanh form) alone on [rows, ffn]: DiT-B/2's feed-forward (256 tokens x 8 rows, 3072) and a SigLIP MLP.
template <bool Fused>
void BM_GeluTanh(benchmark::State& st) {
  at::Tensor x = at::randn({st.range(0), st.range(1)}).requires_grad_(), dy = at::randn({st.range(0), st.range(1)});
  for (auto _ : st) {
    at::Tensor y = Fused ? lf::kernels::gelu_tanh(x) : at::gelu(x, "tanh");
    auto gr = torch::autograd::grad({y}, {x}, {dy});
    benchmark::DoNotOptimize(gr[0].data_ptr());
  }
}
BENCHMARK_TEMPLATE(BM_GeluTanh, true)->Args({2048, 3072})->Args({512, 1024})->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK_TEMPLATE(BM_GeluTanh, false)->Args({2048, 3072})->Args({512, 1024})->Unit(benchmark::kMicrosecond)->UseRealTime();

// π0's joint attention, forward + backward at π0 small's training shape: 8 rows, 8 heads over 1 key/value head, D 64,
// an 80-token prefix (its last 4 + row tokens padded), a state token and a 50-step action chunk (the block mask):
// the masked kernel vs LeRobot's eager attention (keys repeated to the heads, an additive mask, softmax, two matmuls).
template <bool Fused>
static void BM_MaskedAttention(benchmark::State& state) {
  const int64_t B = 8, H = 8, D = 64, P = 80, C = 50, T = P + 1 + C;
  at::manual_seed(0);
  at::Tensor q = at::randn({B, T, H, D}).transpose(1, 2).requires_grad_(), k = at::randn({B, T, 1, D}).transpose(1, 2).requires_grad_();
  at::Tensor v = at::randn({B, T, 1, D}).transpose(1, 2).requires_grad_(), dy = at::randn({B, H, T, D});
  at::Tensor valid = at::ones({B, T}, at::kBool);
  for (int64_t b = 0; b < B; ++b) valid[b].narrow(0, P - 4 - b % 4, 4 + b % 4).fill_(false);
  at::Tensor starts = at::zeros({T}, at::kLong);
  starts[P] = 1;
  starts[P + 1] = 1;
  at::Tensor cum = starts.cumsum(0);
  at::Tensor allowed = (cum.unsqueeze(0) <= cum.unsqueeze(1)).unsqueeze(0).logical_and(valid.unsqueeze(1)).logical_and(valid.unsqueeze(2));
  at::Tensor additive = at::zeros({B, 1, T, T}).masked_fill(allowed.logical_not().unsqueeze(1), -2.3819763e38);
  const double scale = 0.125;
  for (auto _ : state) {
    at::Tensor y;
    if (Fused) {
      y = lf::kernels::masked_attention(q, k, v, scale, allowed);
    } else {
      at::Tensor kk = k.expand({B, H, T, D}), vv = v.expand({B, H, T, D});
      at::Tensor w = at::matmul(q, kk.transpose(2, 3)) * scale + additive;
      y = at::matmul(at::softmax(w, -1, at::kFloat), vv);
    }
    y.backward(dy);
    benchmark::DoNotOptimize(q.grad().data_ptr());
  }
}
BENCHMARK_TEMPLATE(BM_MaskedAttention, true)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_TEMPLATE(BM_MaskedAttention, false)->Unit(benchmark::kMillisecond)->UseRealTime();

// Gated DeltaNet's short convolution: x [B, T, C], kernel K = 4, forward + backward (fused vs K shifted
// multiply-adds + at::silu).
template <bool Fused>
static void BM_CausalConv(benchmark::State& state) {
  at::Tensor x = at::randn({state.range(0), state.range(1), state.range(2)}).requires_grad_();
  at::Tensor w = at::randn({state.range(2), 1, 4}).requires_grad_();
  at::Tensor dy = at::randn({state.range(0), state.range(1), state.range(2)});
  for (auto _ : state) {
    at::Tensor y = Fused ? lf::kernels::causal_conv1d_silu(x, w, true) : lf::kernels::causal_conv1d_silu_reference(x, w, true);
    y.backward(dy);
    benchmark::DoNotOptimize(x.grad().data_ptr());
  }
}
BENCHMARK_TEMPLATE(BM_CausalConv, true)->Args({2, 512, 1024})->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK_TEMPLATE(BM_CausalConv, false)->Args({2, 512, 1024})->Unit(benchmark::kMicrosecond)->UseRealTime();

// DeepSeek sparse attention, forward + backward: B = 1, 16 heads, queries = keys = T, head dims 192 / 128 (MLA's), each
// query attending to K keys picked at random among those before it (fewer while it sees fewer). Fused top-k kernel vs
// the dense scores with the unpicked keys masked (what transformers' eager path and the composite version compute).
template <bool Fused>
static void BM_SparseAttention(benchmark::State& state) {
  const int64_t t = state.range(0), k = state.range(1), h = 16;
  at::manual_seed(0);
  at::Tensor q = at::randn({1, h, t, 192}).requires_grad_(), kk = at::randn({1, h, t, 192}).requires_grad_();
  at::Tensor v = at::randn({1, h, t, 128}).requires_grad_(), dy = at::randn({1, h, t, 128});
  at::Tensor r = at::rand({1, t, t}).masked_fill(at::ones({t, t}, at::kBool).triu(1), -1.0);
  auto [val, idx] = r.topk(k, -1);
  idx = at::where(val >= 0, idx, at::full_like(idx, -1));
  const at::Tensor slot = at::where(idx >= 0, idx, at::full_like(idx, t));
  const at::Tensor keep = at::zeros({1, t, t + 1}, at::kBool).scatter_(-1, slot, true).narrow(-1, 0, t);
  const double scale = 1.0 / std::sqrt(192.0);
  for (auto _ : state) {
    at::Tensor y;
    if (Fused) {
      y = lf::kernels::sparse_attention(q, kk, v, lf::kernels::keep_to_index(keep), scale);
    } else {
      at::Tensor s = at::matmul(q, kk.transpose(-1, -2)) * scale;
      s = s.masked_fill(keep.logical_not().unsqueeze(1), -std::numeric_limits<double>::infinity());
      y = at::matmul(at::softmax(s, -1), v);
    }
    y.backward(dy);
    benchmark::DoNotOptimize(q.grad().data_ptr());
  }
}
BENCHMARK_TEMPLATE(BM_SparseAttention, true)->Args({1024, 64})->Args({2048, 128})->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_TEMPLATE(BM_SparseAttention, false)->Args({1024, 64})->Args({2048, 128})->Unit(benchmark::kMillisecond)->UseRealTime();

// The gated delta rule (Gated DeltaNet) forward + backward at the Qwen3-Next bench's dense shape: B = 2, T = 512, 8
// value heads (4 key heads), Dk = Dv = 64, chunks of 64: the fused CPU kernel vs the chunk-wise composite.
template <bool Fused>
static void BM_GatedDelta(benchmark::State& state) {
  at::manual_seed(0);
  const int64_t b = 2, t = state.range(0), hv = 8, hk = 4, d = 64;
  at::Tensor q = at::randn({b, t, hk, d}).requires_grad_(), k = at::randn({b, t, hk, d}).requires_grad_();
  at::Tensor v = at::randn({b, t, hv, d}).requires_grad_();
  at::Tensor g = (-at::rand({b, t, hv}) * 0.5).requires_grad_(), beta = at::rand({b, t, hv}).requires_grad_();
  at::Tensor qn = lf::nn::l2_normalize(q.detach(), 1e-6).requires_grad_(), kn = lf::nn::l2_normalize(k.detach(), 1e-6).requires_grad_();
  at::Tensor dy = at::randn({b, t, hv, d});
  for (auto _ : state) {
    at::Tensor y = Fused ? lf::nn::chunk_gated_delta_rule(qn, kn, v, g, beta, {}, 64, false).first
                         : lf::nn::chunk_gated_delta_rule_reference(qn, kn, v, g, beta, {}, 64, false).first;
    y.backward(dy);
    benchmark::DoNotOptimize(v.grad().data_ptr());
  }
}
BENCHMARK_TEMPLATE(BM_GatedDelta, true)->Arg(512)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_TEMPLATE(BM_GatedDelta, false)->Arg(512)->Unit(benchmark::kMillisecond)->UseRealTime();

// Linear + cross-entropy, forward + backward: N tokens, hidden H, vocabulary V; range(3) = chunk rows (0: default).
// The composite version is what the trainer did before: logits = x W^T, cross_entropy_loss(sum).
template <bool Fused>
void BM_LinearCE(benchmark::State& st) {
  const int64_t n = st.range(0), h = st.range(1), v = st.range(2);
  at::Tensor x = at::randn({n, h}).requires_grad_(), w = (at::randn({v, h}) * 0.05).requires_grad_();
  at::Tensor t = at::randint(0, v, {n}, at::kLong);
  for (auto _ : st) {
    at::Tensor loss = Fused ? std::get<0>(lf::kernels::linear_cross_entropy(x, w, t, -100, st.range(3)))
                            : std::get<0>(lf::kernels::linear_cross_entropy_reference(x, w, t));
    auto gr = torch::autograd::grad({loss}, {x, w});
    benchmark::DoNotOptimize(gr[0].data_ptr());
  }
}
// 1024 rows: what each of 2 training threads runs (train.cpu_split); compare chunk sizes with OMP_NUM_THREADS=1 and
// two copies at once (kernels/cpu/linear_ce.cpp's default chunk was chosen so).
BENCHMARK_TEMPLATE(BM_LinearCE, true)
    ->Args({2048, 256, 8192, 0})->Args({2048, 512, 16384, 0})
    ->Args({1024, 256, 8192, 128})->Args({1024, 256, 8192, 256})->Args({1024, 256, 8192, 512})->Args({1024, 256, 8192, 1024})
    ->Args({1024, 512, 16384, 128})->Args({1024, 512, 16384, 256})->Args({1024, 512, 16384, 512})
    ->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_TEMPLATE(BM_LinearCE, false)
    ->Args({2048, 256, 8192, 0})->Args({2048, 512, 16384, 0})->Unit(benchmark::kMillisecond)->UseRealTime();

// RoPE forward + backward on q as the attention passes it: [B,T,H,D] memory viewed as [B,H,T,D] (small bench shape:
// 8 x 256 tokens, 8 heads of 32; the larger: 4 x 512, 8 heads of 64).
template <bool Fused>
void BM_Rope(benchmark::State& st) {
  const int64_t b = st.range(0), t = st.range(1), h = st.range(2), d = st.range(3);
  at::Tensor x = at::randn({b, t, h, d}).transpose(1, 2).requires_grad_();
  at::Tensor ang = at::arange(t, at::kFloat).unsqueeze(-1) * at::rand({d});
  at::Tensor cos = ang.cos().unsqueeze(0), sin = ang.sin().unsqueeze(0);
  at::Tensor dy = at::randn({b, h, t, d});
  for (auto _ : st) {
    at::Tensor y = Fused ? lf::kernels::apply_rope(x, cos, sin) : lf::kernels::apply_rope_reference(x, cos, sin);
    auto g = torch::autograd::grad({y}, {x}, {dy});
    benchmark::DoNotOptimize(g[0].data_ptr());
  }
}
BENCHMARK_TEMPLATE(BM_Rope, true)->Args({8, 256, 8, 32})->Args({4, 512, 8, 64})->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK_TEMPLATE(BM_Rope, false)->Args({8, 256, 8, 32})->Args({4, 512, 8, 64})->Unit(benchmark::kMicrosecond)->UseRealTime();

// Linear y = x W^T forward + backward (dx, dW): N rows, in, out. Split: one single-threaded GEMM per thread on its
// own rows (kernels/linear.h); mode 0 = at::linear (MKL's own threading). The shapes of the two bench models.
template <int Mode>
void BM_Linear(benchmark::State& st) {
  const int saved = lf::kernels::linear_split_mode();
  lf::kernels::set_linear_split_mode(Mode);
  at::Tensor x = at::randn({st.range(0), st.range(1)}).requires_grad_();
  at::Tensor w = (at::randn({st.range(2), st.range(1)}) * 0.05).requires_grad_();
  at::Tensor dy = at::randn({st.range(0), st.range(2)});
  for (auto _ : st) {
    at::Tensor y = lf::kernels::linear(x, w, at::Tensor());
    auto gr = torch::autograd::grad({y}, {x, w}, {dy});
    benchmark::DoNotOptimize(gr[0].data_ptr());
  }
  st.counters["GFLOP/s"] = benchmark::Counter(6.0 * st.range(0) * st.range(1) * st.range(2) * st.iterations() / 1e9,
                                              benchmark::Counter::kIsRate);
  lf::kernels::set_linear_split_mode(saved);
}
#define LF_LINEAR_SHAPES ->Args({2048, 256, 256})->Args({2048, 256, 128})->Args({2048, 256, 688})->Args({2048, 688, 256}) \
    ->Args({2048, 512, 512})->Args({2048, 512, 1376})->Args({2048, 1376, 512})->Unit(benchmark::kMicrosecond)->UseRealTime()
BENCHMARK_TEMPLATE(BM_Linear, 2) LF_LINEAR_SHAPES;
BENCHMARK_TEMPLATE(BM_Linear, 0) LF_LINEAR_SHAPES;

// Causal attention forward + backward, q/k/v as the model passes them (views of [B,T,H,D] memory): ours
// (kernels/attention.h; range(5) = query rows per block, 0 = default) against ATen's scaled_dot_product_attention
// with is_causal (its CPU flash attention, what PyTorch runs). Args: B, T, H, Hkv, D, block rows. Split: the batch
// rows over the threads, each part single-threaded, as train.cpu_split runs it.
template <bool Ours, bool Split>
void BM_Attention(benchmark::State& st) {
  const int64_t B = st.range(0), T = st.range(1), H = st.range(2), Hkv = st.range(3), D = st.range(4);
  at::Tensor q = at::randn({B, T, H, D}).transpose(1, 2).requires_grad_();
  at::Tensor k = at::randn({B, T, Hkv, D}).transpose(1, 2).requires_grad_();
  at::Tensor v = at::randn({B, T, Hkv, D}).transpose(1, 2).requires_grad_();
  at::Tensor dy = at::randn({B, T, H, D}).transpose(1, 2);
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  auto run = [&](int64_t lo, int64_t hi) {
    at::Tensor qs = q.slice(0, lo, hi), ks = k.slice(0, lo, hi), vs = v.slice(0, lo, hi);
    if (Ours) {
      auto [o, lse] = lf::kernels::causal_attention_forward_cpu(qs, ks, vs, scale, 0, {}, st.range(5));
      auto g = lf::kernels::causal_attention_backward_cpu(dy.slice(0, lo, hi), qs, ks, vs, o, lse, scale, 0, {},
                                                           st.range(5));
      benchmark::DoNotOptimize(std::get<0>(g).data_ptr());
    } else {
      at::Tensor o = at::scaled_dot_product_attention(qs, ks, vs, {}, 0.0, true, scale, H != Hkv);
      auto g = torch::autograd::grad({o}, {qs, ks, vs}, {dy.slice(0, lo, hi)});
      benchmark::DoNotOptimize(g[0].data_ptr());
    }
  };
  const int64_t parts = Split ? at::get_num_threads() : 1;
  for (auto _ : st) {
    if (parts > 1) {
      at::parallel_for(0, parts, 1, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) run(B * i / parts, B * (i + 1) / parts);
      });
    } else {
      run(0, B);
    }
  }
}
#define LF_ATTN_SHAPES ->Args({8, 256, 8, 4, 32, 0})->Args({4, 512, 8, 8, 64, 0})->Unit(benchmark::kMillisecond)->UseRealTime()
BENCHMARK_TEMPLATE(BM_Attention, true, false) LF_ATTN_SHAPES->Args({8, 256, 8, 4, 32, 128})->Args({4, 512, 8, 8, 64, 128});
BENCHMARK_TEMPLATE(BM_Attention, false, false) LF_ATTN_SHAPES;
BENCHMARK_TEMPLATE(BM_Attention, true, true) LF_ATTN_SHAPES->Args({8, 256, 8, 4, 32, 128})->Args({4, 512, 8, 8, 64, 128});
BENCHMARK_TEMPLATE(BM_Attention, false, true) LF_ATTN_SHAPES;

}  // namespace

// Forward + backward of the small bench/cpu_train.py shape (d256 L4 h8 kv4 ffn688 V8192, 8 x 256 tokens), range(0):
// the rows split over the threads (parallel/thread_split.h) or not. Interleave the runs, the machine is noisy:
//   --benchmark_filter=TrainStep --benchmark_enable_random_interleaving=true --benchmark_repetitions=12
void BM_TrainStep(benchmark::State& st) {
  nlohmann::json j = {{"model_type", "llama"}, {"vocab_size", 8192}, {"hidden_size", 256}, {"intermediate_size", 688},
                      {"num_hidden_layers", 4}, {"num_attention_heads", 8}, {"num_key_value_heads", 4},
                      {"max_position_embeddings", 512}, {"rms_norm_eps", 1e-6}, {"tie_word_embeddings", false}};
  lf::models::llama::CausalLM m(lf::models::llama::DecoderConfig::from_json(j));
  const int64_t rows = 8, seq = 256;
  at::Tensor ids = at::randint(0, 8192, {rows, seq}, at::kLong), tgt = at::randint(0, 8192, {rows, seq}, at::kLong);
  std::vector<at::Tensor> params = m->parameters();
  auto loss = [&](int64_t lo, int64_t hi) {
    at::Tensor h = m->hidden_states(ids.slice(0, lo, hi));
    return std::get<0>(lf::kernels::linear_cross_entropy(h, m->output_weight(), tgt.slice(0, lo, hi), -100)) /
           static_cast<double>(rows * seq);
  };
  const int64_t parts = st.range(0) ? at::get_num_threads() : 1;
  for (auto _ : st) {
    for (auto& p : params) p.mutable_grad() = at::Tensor();
    if (parts > 1)
      lf::parallel::split_backward(parts, params, [&](int64_t i) { return loss(rows * i / parts, rows * (i + 1) / parts); });
    else
      loss(0, rows).backward();
    benchmark::DoNotOptimize(params[0].grad().data_ptr());
  }
}
BENCHMARK(BM_TrainStep)->Arg(1)->Arg(0)->Unit(benchmark::kMillisecond)->UseRealTime();

BENCHMARK_MAIN();
