// Context parallelism (parallel/context_parallel.h). The CP.* tests run in one process (layout, the blockwise ring
// math on a group of one, errors); the CPHook.* tests do nothing (GTEST_SKIP) unless LF_CP_HOOK is set:
// tests/python/test_dist_cp.py launches them as 2 or 4 ranks. Every rank computes the single-process reference
// itself (same seed, full sequence, nn::causal_attention / the plain model) and compares with its context-parallel
// result.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <functional>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "loongforge/core/error.h"
#include "loongforge/models/llama/model.h"
#include "loongforge/nn/attention.h"
#include "loongforge/nn/loss.h"
#include "loongforge/optim/adamw.h"
#include "loongforge/parallel/comm.h"
#include "loongforge/parallel/context_parallel.h"

namespace {

using lf::models::llama::CausalLM;
using lf::models::llama::DecoderConfig;
using lf::parallel::Group;
namespace par = lf::parallel;

// max |a-b| / max |b| (0 when both are zero).
double rel_diff(const at::Tensor& a, const at::Tensor& b) {
  double den = b.abs().max().item<double>();
  double num = (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
  return den == 0 ? num : num / den;
}

// Segment ids [B,T] of packed documents: row r holds documents of the given lengths; positions restart at 0 in each.
std::pair<at::Tensor, at::Tensor> packed(const std::vector<std::vector<int64_t>>& docs) {
  std::vector<at::Tensor> segs, poss;
  for (const auto& row : docs) {
    std::vector<at::Tensor> s, p;
    for (size_t d = 0; d < row.size(); ++d) {
      s.push_back(at::full({row[d]}, static_cast<int64_t>(d), at::kLong));
      p.push_back(at::arange(row[d], at::kLong));
    }
    segs.push_back(at::cat(s));
    poss.push_back(at::cat(p));
  }
  return {at::stack(segs), at::stack(poss)};
}

const std::vector<std::vector<int64_t>> kDocs32 = {{5, 11, 3, 13}, {20, 12}};

struct AttnCase {
  at::Tensor q, k, v, w, seg;
};

AttnCase attn_case(int64_t B, int64_t H, int64_t Hkv, int64_t T, int64_t D, bool with_seg) {
  at::manual_seed(7);
  AttnCase c;
  auto o = at::TensorOptions().dtype(at::kDouble);
  c.q = at::randn({B, H, T, D}, o);
  c.k = at::randn({B, Hkv, T, D}, o);
  c.v = at::randn({B, Hkv, T, D}, o);
  c.w = at::randn({B, H, T, D}, o);
  if (with_seg) c.seg = packed(kDocs32).first.narrow(0, 0, B).narrow(1, 0, T).contiguous();
  return c;
}

// Compares `fn` (ring or a2a attention over g) on this rank's shard with nn::causal_attention on the full
// sequence: output and the gradients of q, k, v (float64). causal = false: bidirectional, against
// nn::full_attention, on the contiguous parts par::cp_cut gives (the layout of models that cut their own sequence).
using AttnFn = std::function<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                                        const at::Tensor&, const Group&, bool)>;
void check_attention(const AttnCase& c, const Group& g, const AttnFn& fn, const std::string& what, bool causal = true) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.q.size(3)));
  at::Tensor q = c.q.clone().requires_grad_(), k = c.k.clone().requires_grad_(), v = c.v.clone().requires_grad_();
  at::Tensor ref = causal ? lf::nn::causal_attention(q, k, v, 0, 0, scale, c.seg)
                          : lf::nn::full_attention(q, k, v, scale, c.seg);
  (ref * c.w).sum().backward();

  auto part = [&](const at::Tensor& x, int64_t dim) {
    return causal ? par::cp_shard(x, g, dim) : par::cp_cut(x, g, dim).contiguous();
  };
  at::Tensor lq = part(c.q, 2).requires_grad_(), lk = part(c.k, 2).requires_grad_(), lv = part(c.v, 2).requires_grad_();
  at::Tensor lseg = c.seg.defined() ? part(c.seg, 1) : at::Tensor();
  at::Tensor out = fn(lq, lk, lv, scale, lseg, g, causal);
  (out * part(c.w, 2)).sum().backward();
  EXPECT_LT(rel_diff(out, part(ref, 2)), 1e-12) << what << " output";
  EXPECT_LT(rel_diff(lq.grad(), part(q.grad(), 2)), 1e-12) << what << " dq";
  EXPECT_LT(rel_diff(lk.grad(), part(k.grad(), 2)), 1e-12) << what << " dk";
  EXPECT_LT(rel_diff(lv.grad(), part(v.grad(), 2)), 1e-12) << what << " dv";
  // the context-parallel output gathered back is the full output
  at::Tensor whole = causal ? par::cp_unshard(out.detach(), g, 2)
                            : (g.size() == 1 ? out.detach() : g.all_gather(out.detach().contiguous(), 2));
  EXPECT_LT(rel_diff(whole, ref), 1e-12) << what << " unshard";
}

nlohmann::json tiny_json() {
  return {{"model_type", "llama"}, {"vocab_size", 128}, {"hidden_size", 64}, {"intermediate_size", 96},
          {"num_hidden_layers", 2}, {"num_attention_heads", 4}, {"num_key_value_heads", 2},
          {"max_position_embeddings", 64}, {"rms_norm_eps", 1e-6}, {"tie_word_embeddings", false}};
}

CausalLM tiny_model() {
  torch::manual_seed(0);
  return CausalLM(DecoderConfig::from_json(tiny_json()));
}

void copy_params(CausalLM& dst, CausalLM& src) {
  at::NoGradGuard ng;
  auto d = dst->named_parameters(), s = src->named_parameters();
  for (auto& kv : s) d[kv.key()].copy_(kv.value());
}

// --- one process -----------------------------------------------------------------------------------------------

TEST(CP, LoadBalancedLayout) {
  at::Tensor x = at::arange(16, at::kLong).view({1, 16});
  EXPECT_TRUE(at::equal(par::cp_shard(x, 2, 0), at::tensor({0, 1, 2, 3, 12, 13, 14, 15}, at::kLong).view({1, 8})));
  EXPECT_TRUE(at::equal(par::cp_shard(x, 2, 1), at::tensor({4, 5, 6, 7, 8, 9, 10, 11}, at::kLong).view({1, 8})));
  EXPECT_TRUE(at::equal(par::cp_shard(x, 4, 3), at::tensor({6, 7, 8, 9}, at::kLong).view({1, 4})));
  // the layout positions are the shards of 0..T-1 in rank order
  for (int n : {1, 2, 4}) {
    std::vector<at::Tensor> parts;
    for (int r = 0; r < n; ++r) parts.push_back(par::cp_shard(x, n, r).view({-1}));
    EXPECT_TRUE(at::equal(at::cat(parts), par::cp_layout_positions(16, n)));
  }
  EXPECT_THROW(par::cp_shard(at::zeros({2, 12}), 4, 0), lf::Error);  // 2*cp = 8 does not divide 12
  Group one;
  EXPECT_TRUE(at::equal(par::cp_unshard(par::cp_shard(x, one), one), x));
}

TEST(CP, RingAttentionOneRankMatchesReference) {
  Group one;  // a group of one: the two local chunks still go through the blockwise path and its skipping
  for (bool seg : {false, true}) {
    check_attention(attn_case(2, 4, 2, 32, 8, seg), one, par::ring_attention, seg ? "ring seg" : "ring");
    check_attention(attn_case(2, 4, 2, 32, 8, seg), one, par::a2a_attention, seg ? "a2a seg" : "a2a");
    check_attention(attn_case(2, 4, 2, 32, 8, seg), one, par::ring_attention, seg ? "full ring seg" : "full ring",
                    false);
  }
  // float32 inputs come back as float32
  AttnCase c = attn_case(1, 2, 1, 8, 4, false);
  at::Tensor o = par::ring_attention(c.q.to(at::kFloat), c.k.to(at::kFloat), c.v.to(at::kFloat), 0.5, {}, one);
  EXPECT_EQ(o.scalar_type(), at::kFloat);
  EXPECT_LT(rel_diff(o, lf::nn::causal_attention(c.q, c.k, c.v, 0, 0, 0.5)), 1e-6);
}

TEST(CP, TargetsAndLossMatchCausalLmLoss) {
  at::manual_seed(3);
  at::Tensor logits = at::randn({2, 16, 11});
  at::Tensor labels = at::randint(0, 11, {2, 16}, at::kLong);
  labels[0][5] = lf::nn::kIgnoreIndex;
  auto [ref, ref_n] = lf::nn::causal_lm_loss_sum(logits, labels);
  at::Tensor tgt = par::next_token_targets(labels);
  double sum = 0;
  int64_t n = 0;
  for (int r = 0; r < 4; ++r) {
    auto [l, c] = par::token_loss_sum(par::cp_shard(logits, 4, r), par::cp_shard(tgt, 4, r));
    sum += l.item<double>();
    n += c;
  }
  EXPECT_EQ(n, ref_n);
  EXPECT_NEAR(sum, ref.item<double>(), 1e-5 * std::abs(ref.item<double>()));
}

TEST(CP, BadLayoutsAreClearErrors) {
  Group one;
  auto m = tiny_model();
  try {
    par::apply_context_parallel(*m, one, "zigzag");
    FAIL() << "no error";
  } catch (const lf::Error& e) {
    EXPECT_NE(std::string(e.what()).find("cp_mode: "), std::string::npos) << e.what();
  }
  (*m->model->layers)[1]->as<lf::models::llama::DecoderLayerImpl>()->self_attn->window = 8;
  try {
    par::apply_context_parallel(*m, one, "ring");
    FAIL() << "no error";
  } catch (const lf::Error& e) {
    EXPECT_NE(std::string(e.what()).find("sliding-window"), std::string::npos) << e.what();
  }
  // nothing was installed by the failed calls
  EXPECT_FALSE((*m->model->layers)[0]->as<lf::models::llama::DecoderLayerImpl>()->self_attn->attention_fn);
}

// --- several ranks (tests/python/test_dist_cp.py) ---------------------------------------------------------------

const char* hook() { return std::getenv("LF_CP_HOOK"); }

TEST(CPHook, Attention) {
  if (!hook()) GTEST_SKIP() << "run by tests/python/test_dist_cp.py";
  auto comm = par::Comm::init();
  par::Mesh mesh(comm, {{"cp", comm->world()}});
  const Group& g = mesh.group("cp");
  for (bool seg : {false, true}) {
    // 8 heads / 4 kv heads: GQA, and divisible by cp = 2 or 4 for the all-to-all
    check_attention(attn_case(2, 8, 4, 32, 8, seg), g, par::ring_attention, seg ? "ring seg" : "ring");
    check_attention(attn_case(2, 8, 4, 32, 8, seg), g, par::a2a_attention, seg ? "a2a seg" : "a2a");
    // bidirectional (diffusion transformers), contiguous parts of 8 / cp tokens
    check_attention(attn_case(2, 8, 4, 32, 8, seg), g, par::ring_attention, seg ? "full ring seg" : "full ring", false);
    check_attention(attn_case(2, 8, 4, 32, 8, seg), g, par::a2a_attention, seg ? "full a2a seg" : "full a2a", false);
  }
  // a2a with kv heads not divisible by cp
  if (g.size() > 2) {
    AttnCase c = attn_case(1, 4, 2, 16, 4, false);
    EXPECT_THROW(par::a2a_attention(par::cp_shard(c.q, g, 2), par::cp_shard(c.k, g, 2), par::cp_shard(c.v, g, 2),
                                    0.5, {}, g),
                 lf::Error);
  }
}

struct Batch {
  at::Tensor ids, pos, seg;
};

Batch make_batch(int step, bool with_docs) {
  at::manual_seed(100 + step);
  Batch b;
  b.ids = at::randint(0, 128, {2, 32}, at::kLong);
  if (with_docs) {
    std::tie(b.seg, b.pos) = packed(kDocs32);
  } else {
    b.pos = at::arange(32, at::kLong).unsqueeze(0).expand({2, 32}).contiguous();
  }
  return b;
}

// Reference (one process): mean loss over the batch's tokens, gradients.
double ref_step(CausalLM& m, const Batch& b) {
  auto [sum, n] = lf::nn::causal_lm_loss_sum(m->logits(m->hidden_states(b.ids, b.pos, nullptr, b.seg)), b.ids);
  at::Tensor loss = sum / static_cast<double>(n);
  loss.backward();
  return loss.item<double>();
}

// Context parallel: this rank's tokens; loss / global count; gradients and loss summed over cp.
double cp_step(CausalLM& m, const Batch& b, const Group& g) {
  at::Tensor ids = par::cp_shard(b.ids, g), pos = par::cp_shard(b.pos, g);
  at::Tensor seg = b.seg.defined() ? par::cp_shard(b.seg, g) : at::Tensor();
  at::Tensor tgt = par::cp_shard(par::next_token_targets(b.ids), g);
  auto [sum, n] = par::token_loss_sum(m->logits(m->hidden_states(ids, pos, nullptr, seg)), tgt);
  at::Tensor count = at::tensor({static_cast<double>(n)}, at::kDouble);
  g.all_reduce(count);
  at::Tensor loss = sum / count.item<double>();
  loss.backward();
  for (auto& p : m->parameters())
    if (p.grad().defined()) g.all_reduce(p.mutable_grad());
  at::Tensor total = loss.detach().clone();
  g.all_reduce(total);
  return total.item<double>();
}

TEST(CPHook, LlamaLossGradsAndTraining) {
  if (!hook()) GTEST_SKIP() << "run by tests/python/test_dist_cp.py";
  const std::string mode = std::getenv("LF_CP_MODE") ? std::getenv("LF_CP_MODE") : "ring";
  auto comm = par::Comm::init();
  par::Mesh mesh(comm, {{"cp", comm->world()}});
  const Group& g = mesh.group("cp");

  if (g.size() == 4) {  // 2 kv heads cannot be split over 4 ranks
    auto bad = tiny_model();
    try {
      par::apply_context_parallel(*bad, g, "a2a");
      FAIL() << "no error";
    } catch (const lf::Error& e) {
      EXPECT_NE(std::string(e.what()).find("does not divide num_key_value_heads 2"), std::string::npos) << e.what();
    }
  }

  for (bool docs : {false, true}) {
    SCOPED_TRACE(docs ? "packed documents" : "plain");
    auto ref = tiny_model();
    auto cpm = tiny_model();
    copy_params(cpm, ref);
    par::apply_context_parallel(*cpm, g, mode);

    // one forward/backward: summed loss and gradients
    Batch b = make_batch(0, docs);
    double lr = ref_step(ref, b), lc = cp_step(cpm, b, g);
    EXPECT_LT(std::abs(lc - lr), 1e-5 * std::abs(lr)) << "loss " << lc << " vs " << lr;
    auto rp = ref->named_parameters();
    for (auto& kv : cpm->named_parameters()) {
      ASSERT_TRUE(kv.value().grad().defined()) << kv.key();
      EXPECT_LT(rel_diff(kv.value().grad(), rp[kv.key()].grad()), 1e-5) << kv.key();
    }

    // 10 AdamW steps with clipping
    for (auto* m : {&ref, &cpm})
      for (auto& p : (*m)->parameters()) p.mutable_grad() = at::Tensor();
    lf::optim::AdamWOptions o;
    o.lr = 1e-2;
    lf::optim::AdamW opt_ref(ref->parameters(), o), opt_cp(cpm->parameters(), o);
    for (int step = 0; step < 10; ++step) {
      Batch bs = make_batch(step + 1, docs);
      opt_ref.zero_grad();
      opt_cp.zero_grad();
      double l_ref = ref_step(ref, bs), l_cp = cp_step(cpm, bs, g);
      double n_ref = lf::optim::clip_grad_norm(ref->parameters(), 0.5);
      double n_cp = lf::optim::clip_grad_norm(cpm->parameters(), 0.5);
      opt_ref.step();
      opt_cp.step();
      EXPECT_LT(std::abs(l_cp - l_ref), 1e-5 * std::abs(l_ref)) << "step " << step << " loss " << l_cp << " vs " << l_ref;
      EXPECT_LT(std::abs(n_cp - n_ref), 1e-5 * std::abs(n_ref)) << "step " << step << " norm " << n_cp << " vs " << n_ref;
      if (g.rank() == 0)
        std::printf("cp%d %s %s step %d loss %.8f/%.8f norm %.8f/%.8f\n", g.size(), mode.c_str(),
                    docs ? "docs" : "plain", step, l_cp, l_ref, n_cp, n_ref);
    }
  }
}

// Linear attention in float64: the recurrent state and the convolution's past passed between the ranks' parts
// (nn/sequence_parts.h) give the loss and every gradient of one process. 280 tokens: at cp2 each part holds 70 (two
// delta-rule chunks of 64).
void linear_attention_float64(const nlohmann::json& j) {
  const std::string mode = std::getenv("LF_CP_MODE") ? std::getenv("LF_CP_MODE") : "ring";
  auto comm = par::Comm::init();
  par::Mesh mesh(comm, {{"cp", comm->world()}});
  const Group& g = mesh.group("cp");
  auto make = [&] {
    torch::manual_seed(0);
    CausalLM m(DecoderConfig::from_json(j));
    m->to(at::kDouble);
    return m;
  };
  auto ref = make();
  auto cpm = make();
  par::apply_context_parallel(*cpm, g, mode);
  at::manual_seed(7);
  Batch b;
  const int64_t t = 280 * g.size() / 2;
  b.ids = at::randint(0, 128, {2, t}, at::kLong);
  b.pos = at::arange(t, at::kLong).unsqueeze(0).expand({2, t}).contiguous();
  // the token losses in float64 (ref_step / cp_step's loss helpers sum in float32)
  auto loss_sum = [](CausalLM& m, const at::Tensor& ids, const at::Tensor& pos, const at::Tensor& targets) {
    at::Tensor logits = m->logits(m->hidden_states(ids, pos, nullptr, {}));
    return at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}), {}, at::Reduction::Sum, -100);
  };
  at::Tensor targets = par::next_token_targets(b.ids);
  const double count = static_cast<double>((targets != -100).sum().item<int64_t>());
  at::Tensor lr = loss_sum(ref, b.ids, b.pos, targets) / count;
  lr.backward();
  at::Tensor lc = loss_sum(cpm, par::cp_shard(b.ids, g), par::cp_shard(b.pos, g), par::cp_shard(targets, g)) / count;
  lc.backward();
  at::Tensor total = lc.detach().clone();
  g.all_reduce(total);
  EXPECT_LT(std::abs(total.item<double>() - lr.item<double>()), 1e-12 * std::abs(lr.item<double>()))
      << "loss " << total.item<double>() << " vs " << lr.item<double>();
  auto rp = ref->named_parameters();
  double worst = 0;
  for (auto& kv : cpm->named_parameters()) {
    ASSERT_TRUE(kv.value().grad().defined()) << kv.key();
    ASSERT_EQ(kv.value().grad().scalar_type(), at::kDouble) << kv.key();
    g.all_reduce(kv.value().mutable_grad());
    const double e = rel_diff(kv.value().grad(), rp[kv.key()].grad());
    worst = std::max(worst, e);
    EXPECT_LT(e, 1e-10) << kv.key();
  }
  if (g.rank() == 0)
    std::printf("cp%d %s %s loss rel diff %.2e worst grad rel diff %.2e\n", g.size(), mode.c_str(),
                j["model_type"].get<std::string>().c_str(),
                std::abs(total.item<double>() - lr.item<double>()) / std::abs(lr.item<double>()), worst);
}

// Gated DeltaNet of a tiny Qwen3.5 text decoder (linear and full attention layers).
TEST(CPHook, LinearAttentionFloat64) {
  if (!hook()) GTEST_SKIP() << "run by tests/python/test_dist_cp.py";
  linear_attention_float64({{"model_type", "qwen3_5_text"}, {"vocab_size", 128}, {"hidden_size", 32},
                            {"intermediate_size", 48}, {"num_hidden_layers", 2}, {"num_attention_heads", 4},
                            {"num_key_value_heads", 2}, {"head_dim", 8}, {"max_position_embeddings", 512},
                            {"rms_norm_eps", 1e-6}, {"linear_conv_kernel_dim", 4}, {"linear_key_head_dim", 8},
                            {"linear_value_head_dim", 6}, {"linear_num_key_heads", 2}, {"linear_num_value_heads", 4},
                            {"layer_types", {"linear_attention", "full_attention"}}});
}

// KDA of a tiny Kimi Linear (per-channel decay, q/k/v convolutions; latent attention without rotary in the other
// layer, dense MLPs).
TEST(CPHook, KdaFloat64) {
  if (!hook()) GTEST_SKIP() << "run by tests/python/test_dist_cp.py";
  linear_attention_float64({{"model_type", "kimi_linear"}, {"vocab_size", 128}, {"hidden_size", 32},
                            {"intermediate_size", 48}, {"num_hidden_layers", 2}, {"num_attention_heads", 4},
                            {"num_key_value_heads", 4}, {"kv_lora_rank", 16}, {"qk_rope_head_dim", 8},
                            {"qk_nope_head_dim", 16}, {"v_head_dim", 12}, {"rms_norm_eps", 1e-6},
                            {"linear_attn_config", {{"head_dim", 8}, {"num_heads", 4}, {"short_conv_kernel_size", 4}}},
                            {"mlp_layer_types", {"dense", "dense"}},
                            {"layer_types", {"linear_attention", "full_attention"}}});
}

}  // namespace
