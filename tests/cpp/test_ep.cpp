// Expert parallelism (parallel/expert_parallel.h). EP.* run in one process (a group of one, errors); EPHook.* do
// nothing (GTEST_SKIP) unless LF_EP_HOOK is set: tests/python/test_dist_ep.py launches them as 2 and 4 ranks. Every
// rank builds the same tiny qwen3_moe model (same seed), computes the one-process reference itself on the GLOBAL
// batch (every rank's rows), then applies EP and runs only its own rows.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <cstdlib>
#include <nlohmann/json.hpp>
#include <string>

#include "loongforge/core/error.h"
#include "loongforge/models/llama/model.h"
#include "loongforge/nn/loss.h"
#include "loongforge/parallel/comm.h"
#include "loongforge/parallel/expert_parallel.h"
#include "loongforge/parallel/layout.h"

namespace {

using lf::models::llama::CausalLM;
using lf::models::llama::DecoderConfig;
using lf::parallel::Group;
namespace par = lf::parallel;

double rel_diff(const at::Tensor& a, const at::Tensor& b) {
  double den = b.abs().max().item<double>();
  double num = (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
  return den == 0 ? num : num / den;
}

nlohmann::json moe_json() {
  return {{"model_type", "qwen3_moe"}, {"vocab_size", 96}, {"hidden_size", 32}, {"intermediate_size", 48},
          {"moe_intermediate_size", 24}, {"num_experts", 8}, {"num_experts_per_tok", 2}, {"norm_topk_prob", true},
          {"num_hidden_layers", 2}, {"num_attention_heads", 4}, {"num_key_value_heads", 2}, {"head_dim", 8},
          {"max_position_embeddings", 64}, {"rms_norm_eps", 1e-6}, {"tie_word_embeddings", false},
          {"router_aux_loss_coef", 0.0}};
}

// The tiny model with random weights (seeded; the same on every rank) and the given capacity factor.
CausalLM tiny_moe(double capacity_factor) {
  at::manual_seed(0);
  CausalLM m(DecoderConfig::from_json(moe_json()));
  at::NoGradGuard ng;
  for (auto& p : m->parameters())
    if (p.dim() >= 2) p.normal_(0.0, 0.2);
  for (auto* b : m->moe_blocks()) b->options.capacity_factor = capacity_factor;
  return m;
}

at::Tensor batch(int64_t rows) {
  at::manual_seed(11);
  return at::randint(0, 96, {rows, 12}, at::kLong);
}

at::Tensor loss_sum(CausalLM& m, const at::Tensor& ids) { return lf::nn::causal_lm_loss_sum(m->forward(ids), ids).first; }

// Reference gradients and loss sum: the global batch in one forward (per_rank_rows = 0), or (capacity per rank)
// each rank's rows through the one-process model separately, losses and gradients summed.
double reference(CausalLM& ref, const at::Tensor& ids, int64_t per_rank_rows) {
  double total = 0;
  if (per_rank_rows == 0) {
    at::Tensor l = loss_sum(ref, ids);
    l.backward();
    return l.item<double>();
  }
  for (int64_t r = 0; r * per_rank_rows < ids.size(0); ++r) {
    at::Tensor l = loss_sum(ref, ids.narrow(0, r * per_rank_rows, per_rank_rows));
    l.backward();
    total += l.item<double>();
  }
  return total;
}

// EP run of this rank's rows vs the reference: loss sums over ranks, every gradient (non-expert ones summed over
// ranks, expert ones as the local slice of the reference's), and the gathered expert weights.
void check_ep(const Group& g, double capacity_factor, int guest_slots = 0) {
  const int64_t rows = 2, P = g.size();
  at::Tensor ids = batch(rows * P);
  CausalLM ref = tiny_moe(capacity_factor);
  const double want = reference(ref, ids, capacity_factor > 0 ? rows : 0);

  CausalLM m = tiny_moe(capacity_factor);
  par::moe::GuestOptions guests = par::guest_free();
  guests.guest_slots = guest_slots;
  par::ExpertParallelPlan plan = par::apply_expert_parallel(*m, g, guests);
  EXPECT_EQ(plan.local_experts, 8 / P);
  EXPECT_EQ(plan.expert_params.size(), 4u);  // 2 layers x {gate_up_proj, down_proj}
  at::Tensor l = loss_sum(m, ids.narrow(0, rows * g.rank(), rows));
  l.backward();
  at::Tensor got = l.detach().clone();
  g.all_reduce(got);
  EXPECT_NEAR(got.item<double>(), want, 1e-5 * std::abs(want)) << "loss, capacity " << capacity_factor;
  if (guest_slots > 0 && P > 1) {
    EXPECT_EQ(plan.stats->plans, 2);
    EXPECT_LE(plan.stats->overload, plan.stats->home_overload + 1e-12);
    // dropless, this batch's loads are unbalanced (1.06 / 1.23 at ep2): the replicas must compute tokens, or the
    // test would not check replica gradients (with capacity the loads can already be as even as integers allow)
    if (capacity_factor == 0) {
      EXPECT_GT(plan.stats->replica_tokens, 0) << "overload " << plan.stats->overload << " home "
                                               << plan.stats->home_overload;
    }
  }

  par::sync_non_expert_grads(*m, plan, g);
  auto rp = ref->named_parameters(true);
  for (const auto& item : m->named_parameters(true)) {
    const std::string& name = item.key();
    at::Tensor rg = rp[name].grad();
    ASSERT_TRUE(item.value().grad().defined()) << name;
    if (plan.is_expert_param(name)) {
      EXPECT_EQ(item.value().size(0), plan.local_experts) << name;
      rg = rg.narrow(0, plan.first_expert, plan.local_experts);
    }
    EXPECT_LT(rel_diff(item.value().grad(), rg), 1e-5) << name << ", capacity " << capacity_factor << ", guest slots "
                                                       << guest_slots;
  }
  auto full = par::gather_expert_params(*m, plan, g);
  for (const auto& [name, t] : full) {
    EXPECT_TRUE(at::equal(t, rp[name])) << name;
    EXPECT_TRUE(at::equal(par::expert_shard_of(t, g), m->named_parameters(true)[name])) << name;
  }
}

// --- one process -------------------------------------------------------------------------------------------------

TEST(EP, GroupOfOneMatchesPlainModel) {
  Group one;
  check_ep(one, 0.0);
}

// The trainer's layout (parallel/layout.h): ep ranks are data-parallel ranks, ep divides dp, DDP or ZeRO-1.
TEST(EP, LayoutPutsEpRanksInsideDataParallel) {
  CausalLM c(DecoderConfig::from_json(moe_json()));
  par::Layout l;
  l.dp = 4;
  l.ep = 2;
  EXPECT_EQ(l.world(), 4);
  EXPECT_EQ(l.describe(), "dp4 ep2");
  std::vector<std::pair<std::string, int>> want{{"pp", 1}, {"dp_rep", 2}, {"ep", 2}, {"dp_shard", 1}, {"cp", 1}, {"tp", 1}};
  EXPECT_EQ(l.mesh_dims(), want);
  EXPECT_NO_THROW(par::validate(l, *c, 16, 1, false));
  auto error_of = [&](par::Layout b, bool lora = false) -> std::string {
    try {
      par::validate(b, *c, 16, 1, lora);
    } catch (const lf::Error& e) {
      return e.what();
    }
    return "no error";
  };
  par::Layout b = l;
  b.ep = 3;
  EXPECT_EQ(error_of(b), "ep: 3 does not divide parallel.dp 4 (the expert-parallel ranks are "
                         "data-parallel ranks)");
  b = l;
  b.zero = 1;  // ZeRO-1 over the dp / ep ranks of each expert group
  EXPECT_EQ(error_of(b), "no error");
  EXPECT_EQ(b.dp_shard() * b.dp_rep() * b.ep, b.dp);
  b = l;
  b.zero = 3;
  EXPECT_NE(error_of(b).find("ep: 2: expert parallelism runs with parallel.zero 0 (DDP) or 1"), std::string::npos);
  EXPECT_EQ(error_of(l, true), "no error");  // LoRA adapters over frozen, expert-parallel experts
  b = l;
  b.tp = 2;  // ep x tp is a layout (experts split along their ffn over tp)
  EXPECT_EQ(error_of(b), "no error");
  b.tp = 3;
  EXPECT_NE(error_of(b).find("tp: 3 does not divide"), std::string::npos);
  b = l;
  b.cp = 2;  // ep x cp: the ep ranks of one cp coordinate exchange their sequence chunks' tokens
  EXPECT_EQ(error_of(b), "no error");
  b.cp = 3;
  EXPECT_NE(error_of(b).find("cp: "), std::string::npos);
}

TEST(EP, BadLayoutsAreClearErrors) {
  Group one;
  try {
    par::check_expert_parallel(8, 3);
    FAIL() << "no error";
  } catch (const lf::Error& e) {
    EXPECT_EQ(std::string(e.what()), "ep: 3 does not divide num_experts 8");
  }
  nlohmann::json dense = moe_json();
  dense["model_type"] = "llama";
  CausalLM d(DecoderConfig::from_json(dense));
  try {
    par::apply_expert_parallel(*d, one);
    FAIL() << "no error";
  } catch (const lf::Error& e) {
    EXPECT_NE(std::string(e.what()).find("ep: "), std::string::npos) << e.what();
  }
  CausalLM m = tiny_moe(0.0);
  par::apply_expert_parallel(*m, one);
  EXPECT_THROW(par::apply_expert_parallel(*m, one), lf::Error);  // twice
}

// --- several ranks (tests/python/test_dist_ep.py) ------------------------------------------------------------------

TEST(EPHook, LossAndGradientsMatchOneProcess) {
  if (!std::getenv("LF_EP_HOOK")) GTEST_SKIP() << "run by tests/python/test_dist_ep.py";
  auto comm = par::Comm::init();
  par::Mesh mesh(comm, {{"ep", comm->world()}});
  const Group& g = mesh.group("ep");
  check_ep(g, 0.0);  // dropless: equals the global batch in one process
  // capacity per rank: equals each rank's rows through the one-process model; make sure tokens are dropped
  {
    CausalLM a = tiny_moe(0.0), b = tiny_moe(0.5);
    at::Tensor rows = batch(2 * g.size()).narrow(0, 0, 2);
    EXPECT_GT(std::abs(loss_sum(a, rows).item<double>() - loss_sum(b, rows).item<double>()), 1e-4);
  }
  check_ep(g, 0.5);
  // hot-expert replication: replicas (weights copied from the home rank) compute some tokens, their gradients are
  // summed into the home expert's: the same loss and gradients
  check_ep(g, 0.0, 2);
  check_ep(g, 0.5, 1);
}

}  // namespace
