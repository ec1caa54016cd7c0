// Pipeline parallelism. Layouts and schedules run in one process (the schedules of all ranks are played against each
// other with asynchronous sends and blocking receives: every rank must finish). The pipeline itself runs as a hook in
// several processes (tests/python/test_dist_pp.py sets LF_PP_HOOK and the layout variables): every rank also builds
// the whole model with the same seed and computes the single-process reference (loss, every owned gradient, 10
// AdamW steps with clipping) to compare with.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/module.h>

#include <cmath>
#include <cstdlib>
#include <deque>
#include <map>
#include <set>
#include <sstream>

#include "loongforge/core/error.h"
#include "loongforge/models/llama/model.h"
#include "loongforge/nn/loss.h"
#include "loongforge/optim/adamw.h"
#include "loongforge/parallel/comm.h"
#include "loongforge/parallel/pipeline.h"

using namespace lf::parallel;
using lf::models::llama::CausalLM;
using lf::models::llama::DecoderConfig;

namespace {

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const lf::Error& e) {
    return e.what();
  }
  return "";
}

// Plays every rank's schedule: a forward of virtual stage s > 0 waits for the activation of stage s - 1, a backward
// of stage s < last waits for the gradient of stage s + 1; sends never wait. Returns false on a deadlock (no rank
// can move). Also checks that each (micro, chunk) runs forward then backward exactly once on its rank.
bool ops_complete(const std::vector<std::vector<PipelineOp>>& ops, int pp, int vpp, int64_t micros, std::string* why) {
  const int64_t S = int64_t{pp} * vpp;
  std::set<std::tuple<int64_t, int64_t, bool>> produced;  // (micro, virtual stage, forward) done
  std::vector<size_t> pc(static_cast<size_t>(pp), 0);
  for (int r = 0; r < pp; ++r) {
    if (ops[r].size() != static_cast<size_t>(2 * micros * vpp)) {
      *why = "rank " + std::to_string(r) + " has " + std::to_string(ops[r].size()) + " steps";
      return false;
    }
  }
  for (;;) {
    bool moved = false, all_done = true;
    for (int r = 0; r < pp; ++r) {
      while (pc[r] < ops[r].size()) {
        all_done = false;
        const auto& op = ops[r][pc[r]];
        int64_t s = int64_t{op.chunk} * pp + r;
        bool ready = op.forward ? (s == 0 || produced.count({op.micro, s - 1, true}))
                                : (produced.count({op.micro, s, true}) &&
                                   (s == S - 1 || produced.count({op.micro, s + 1, false})));
        if (!ready) break;
        if (!produced.insert({op.micro, s, op.forward}).second) {
          *why = "a step runs twice";
          return false;
        }
        ++pc[r];
        moved = true;
      }
      if (pc[r] < ops[r].size()) all_done = false;
    }
    if (all_done) break;
    if (!moved) {
      std::ostringstream ss;
      ss << "deadlock at steps";
      for (int r = 0; r < pp; ++r) ss << " " << pc[r];
      *why = ss.str();
      return false;
    }
  }
  return produced.size() == static_cast<size_t>(2 * micros * S);
}

bool schedules_complete(int pp, int vpp, int64_t micros, std::string* why) {
  std::vector<std::vector<PipelineOp>> ops;
  for (int r = 0; r < pp; ++r) ops.push_back(pipeline_schedule(pp, vpp, micros, r));
  return ops_complete(ops, pp, vpp, micros, why);
}

using Plan = std::vector<std::vector<PipelineTransfer>>;

// Plays every rank's point-to-point batches under NCCL's rules: a rank posts its next batch only when its previous one
// has finished (the pipeline waits for each); a batch finishes when each of its operations is matched; the k-th send
// from rank a to rank b matches the k-th receive on b from a whatever its tag, and must be the same message. Every
// send must be received. Returns "" or what went wrong.
std::string play_nccl(const std::vector<Plan>& plans) {
  const int P = static_cast<int>(plans.size());
  struct Posted {
    PipelineMessage m;
    int rank;
  };
  std::map<std::pair<int, int>, std::deque<Posted>> sends, recvs;  // (from, to)
  std::vector<size_t> at(static_cast<size_t>(P), 0);
  std::vector<int> unmatched(static_cast<size_t>(P), -1);  // -1: the current batch is not posted yet
  auto str = [](const PipelineMessage& m) {
    return "(kind " + std::to_string(m.kind) + ", micro " + std::to_string(m.micro) + ", stage " + std::to_string(m.stage) + ")";
  };
  for (;;) {
    bool moved = false;
    for (int r = 0; r < P; ++r) {
      if (at[r] >= plans[r].size() || unmatched[r] >= 0) continue;
      const auto& batch = plans[r][at[r]];
      for (const auto& t : batch) {
        if (t.peer == r || t.peer < 0 || t.peer >= P) return "rank " + std::to_string(r) + " addresses rank " + std::to_string(t.peer);
        if (t.send) sends[{r, t.peer}].push_back({t.message, r});
        else recvs[{t.peer, r}].push_back({t.message, r});
      }
      unmatched[r] = static_cast<int>(batch.size());
      moved = true;
    }
    for (auto& [pair, q] : sends) {
      auto& rq = recvs[pair];
      while (!q.empty() && !rq.empty()) {
        if (!(q.front().m == rq.front().m))
          return "rank " + std::to_string(pair.first) + " sends " + str(q.front().m) + " where rank " +
                 std::to_string(pair.second) + " receives " + str(rq.front().m);
        --unmatched[pair.first];
        --unmatched[pair.second];
        q.pop_front();
        rq.pop_front();
        moved = true;
      }
    }
    for (int r = 0; r < P; ++r)
      if (unmatched[r] == 0) {
        unmatched[r] = -1;
        ++at[r];
        moved = true;
      }
    bool done = true;
    for (int r = 0; r < P; ++r) done = done && at[r] == plans[r].size();
    if (done) break;
    if (!moved) {
      std::string w = "deadlock at batches";
      for (int r = 0; r < P; ++r) w += " " + std::to_string(at[r]);
      return w;
    }
  }
  for (auto& [pair, q] : sends)
    if (!q.empty()) return "rank " + std::to_string(pair.first) + "'s " + str(q.front().m) + " is never received";
  for (auto& [pair, q] : recvs)
    if (!q.empty()) return "rank " + std::to_string(pair.second) + " waits for " + str(q.front().m) + " forever";
  return "";
}

// Every rank's batches, one line each ("S>1:0(m0,s1)": send to rank 1 of message kind 0, micro 0, stage 1).
std::string describe(const std::vector<Plan>& plans) {
  std::string out;
  for (size_t r = 0; r < plans.size(); ++r) {
    out += "rank " + std::to_string(r) + ":";
    for (const auto& b : plans[r]) {
      out += " [";
      for (const auto& t : b)
        out += std::string(" ") + (t.send ? "S>" : "R<") + std::to_string(t.peer) + ":" + std::to_string(t.message.kind) +
               "(m" + std::to_string(t.message.micro) + ",s" + std::to_string(t.message.stage) + ")";
      out += " ]";
    }
    out += "\n";
  }
  return out;
}

std::vector<Plan> plans_of(int pp, int vpp, int64_t micros, bool carry, bool forward_only) {
  std::vector<Plan> out;
  for (int r = 0; r < pp; ++r) out.push_back(pipeline_comm_plan(pp, vpp, micros, r, carry, forward_only));
  return out;
}

}  // namespace

TEST(Pipeline, LayerCounts) {
  EXPECT_EQ(pipeline_layer_counts(4, 2, 1, {}), (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(pipeline_layer_counts(8, 2, 2, {}), (std::vector<int64_t>{2, 2, 2, 2}));
  EXPECT_EQ(pipeline_layer_counts(4, 2, 1, {1, 3}), (std::vector<int64_t>{1, 3}));
  EXPECT_EQ(pipeline_layer_counts(5, 2, 2, {1, 2, 1, 1}), (std::vector<int64_t>{1, 2, 1, 1}));
  std::string e = error_of([] { pipeline_layer_counts(4, 2, 1, {1, 2}); });
  EXPECT_NE(e.find("pp_layout: "), std::string::npos) << e;
  EXPECT_NE(e.find("sums to 3"), std::string::npos) << e;
  e = error_of([] { pipeline_layer_counts(4, 2, 1, {0, 4}); });
  EXPECT_NE(e.find("pp_layout: "), std::string::npos) << e;
  EXPECT_NE(e.find("at least one layer"), std::string::npos) << e;
  e = error_of([] { pipeline_layer_counts(4, 2, 2, {2, 2}); });
  EXPECT_NE(e.find("pp_layout: "), std::string::npos) << e;
  e = error_of([] { pipeline_layer_counts(6, 4, 1, {}); });
  EXPECT_NE(e.find("pp: "), std::string::npos) << e;
  EXPECT_EQ(e.find('\n'), std::string::npos);
  e = error_of([] { pipeline_layer_counts(4, 0, 1, {}); });
  EXPECT_NE(e.find("pp: "), std::string::npos) << e;
}

TEST(Pipeline, OneF1BOrder) {
  // pp 4, 6 micro-batches: rank r warms up with pp - r - 1 forwards.
  auto ops = pipeline_schedule(4, 1, 6, 1);
  std::vector<PipelineOp> want = {{true, 0, 0},  {true, 1, 0},  {true, 2, 0}, {false, 0, 0}, {true, 3, 0},
                                  {false, 1, 0}, {true, 4, 0},  {false, 2, 0}, {true, 5, 0}, {false, 3, 0},
                                  {false, 4, 0}, {false, 5, 0}};
  EXPECT_EQ(ops, want);
  auto last = pipeline_schedule(4, 1, 6, 3);
  for (size_t i = 0; i < last.size(); ++i) EXPECT_EQ(last[i].forward, i % 2 == 0);  // strictly 1F1B
  std::string e = error_of([] { pipeline_schedule(4, 2, 6, 0); });
  EXPECT_NE(e.find("pp: "), std::string::npos) << e;
  EXPECT_NE(e.find("multiple of pp"), std::string::npos) << e;
}

TEST(Pipeline, SchedulesCannotDeadlock) {
  std::string why;
  // the checker sees a deadlock: rank 0 waits for a gradient that rank 1 sends only after a forward rank 0 has not sent
  std::vector<std::vector<PipelineOp>> bad = {{{true, 0, 0}, {false, 0, 0}, {true, 1, 0}, {false, 1, 0}},
                                              {{true, 0, 0}, {true, 1, 0}, {false, 0, 0}, {false, 1, 0}}};
  EXPECT_FALSE(ops_complete(bad, 2, 1, 2, &why));
  EXPECT_NE(why.find("deadlock"), std::string::npos) << why;
  EXPECT_TRUE(schedules_complete(4, 2, 8, &why)) << why;  // the case the issue names
  for (int pp : {1, 2, 3, 4, 8})
    for (int vpp : {1, 2, 3})
      for (int64_t m : {1, 2, 3, 4, 5, 8, 12, 16}) {
        if (vpp > 1 && m % pp != 0) continue;
        EXPECT_TRUE(schedules_complete(pp, vpp, m, &why)) << "pp " << pp << " vpp " << vpp << " m " << m << ": " << why;
      }
  // in-flight forwards of 1F1B on rank r never exceed pp - r (the memory bound)
  for (int r = 0; r < 4; ++r) {
    int inflight = 0, peak = 0;
    for (auto& op : pipeline_schedule(4, 1, 8, r)) {
      inflight += op.forward ? 1 : -1;
      peak = std::max(peak, inflight);
    }
    EXPECT_EQ(peak, 4 - r);
  }
}


TEST(Pipeline, CommPlanRunsUnderNcclRules) {
  // Every layout's batches complete when each wait blocks, sends wait for their receives and messages between two
  // ranks match in posting order (NCCL), with and without carries, forward-backward and forward-only.
  for (int pp : {2, 3, 4, 8})
    for (int vpp : {1, 2, 3, 4})
      for (int64_t m : {1, 2, 3, 4, 6, 8, 16})
        for (bool carry : {false, true})
          for (bool fwd_only : {false, true}) {
            if (vpp > 1 && m % pp != 0 && !fwd_only) continue;
            const auto plans = plans_of(pp, vpp, m, carry, fwd_only);
            EXPECT_EQ(play_nccl(plans), "") << "pp " << pp << " vpp " << vpp << " m " << m << " carry " << carry
                                            << " forward-only " << fwd_only << "\n" << describe(plans);
          }
  // 1F1B, pp 2, two micro-batches: rank 0 warms up with one forward; the steady pair (forward 1, backward 0) starts by
  // sending forward 0's activation with backward 0's gradient receive, the cool-down backward likewise
  using M = PipelineMessage;
  auto p0 = pipeline_comm_plan(2, 1, 2, 0, false, false);
  ASSERT_EQ(p0.size(), 2u) << describe({p0});
  EXPECT_EQ(p0[0], (std::vector<PipelineTransfer>{{true, 1, {M::Activation, 0, 1}}, {false, 1, {M::Gradient, 0, 0}}}));
  EXPECT_EQ(p0[1], (std::vector<PipelineTransfer>{{true, 1, {M::Activation, 1, 1}}, {false, 1, {M::Gradient, 1, 0}}}));
  EXPECT_TRUE(pipeline_comm_plan(1, 2, 2, 0, true, false).empty());  // one rank: nothing goes over the wire

  // The player catches what NCCL would: each message posted alone as the schedule makes it (the Gloo way: rank 0 sends
  // both activations, then waits for gradients) deadlocks, rank 1's first gradient waiting behind rank 0's second send...
  using T = PipelineTransfer;
  std::vector<Plan> eager = {
      {{T{true, 1, {M::Activation, 0, 1}}}, {T{true, 1, {M::Activation, 1, 1}}}, {T{false, 1, {M::Gradient, 0, 0}}},
       {T{false, 1, {M::Gradient, 1, 0}}}},
      {{T{false, 0, {M::Activation, 0, 1}}}, {T{true, 0, {M::Gradient, 0, 0}}}, {T{false, 0, {M::Activation, 1, 1}}},
       {T{true, 0, {M::Gradient, 1, 0}}}}};
  EXPECT_NE(play_nccl(eager).find("deadlock"), std::string::npos) << play_nccl(eager);
  // ... and a carry sent before its activation is received as the activation.
  auto swapped = plans_of(3, 1, 2, true, false);
  bool swapped_one = false;
  for (auto& b : swapped[0])
    for (size_t i = 0; i + 1 < b.size() && !swapped_one; ++i)
      if (b[i].send && b[i].message.kind == M::Activation && b[i + 1].message.kind == M::CarryForward) {
        std::swap(b[i], b[i + 1]);
        swapped_one = true;
      }
  ASSERT_TRUE(swapped_one);
  EXPECT_NE(play_nccl(swapped).find("where rank 1 receives"), std::string::npos) << play_nccl(swapped);
}

// ---------------------------------------------------------------------------------------------------------------
// The multi-process hook.

namespace {

int env_int(const char* k, int d) {
  const char* v = std::getenv(k);
  return v && *v ? std::atoi(v) : d;
}

std::vector<int64_t> env_list(const char* k) {
  std::vector<int64_t> out;
  const char* v = std::getenv(k);
  if (!v) return out;
  std::stringstream ss(v);
  std::string item;
  while (std::getline(ss, item, ','))
    if (!item.empty()) out.push_back(std::stoll(item));
  return out;
}

CausalLM tiny_llama(int64_t layers, bool tied) {
  nlohmann::json j = {{"model_type", "llama"}, {"vocab_size", 128}, {"hidden_size", 32}, {"intermediate_size", 64},
                      {"num_hidden_layers", layers}, {"num_attention_heads", 4}, {"num_key_value_heads", 2},
                      {"max_position_embeddings", 64}, {"rms_norm_eps", 1e-6}, {"tie_word_embeddings", tied}};
  torch::manual_seed(1234);
  CausalLM m(DecoderConfig::from_json(j));
  {  // non-trivial norms, so their gradients are checked too
    at::NoGradGuard g;
    for (auto& p : m->named_parameters())
      if (p.key().find("norm") != std::string::npos) p.value().uniform_(0.5, 1.5);
    m->model->embed_tokens->weight.normal_(0, 0.1);  // a tied head with unit-variance rows would be ill-conditioned
  }
  return m;
}

double rel(double a, double b) { return std::abs(a - b) / std::max(std::abs(b), 1e-12); }

}  // namespace

TEST(PipelineHook, MatchesOneProcess) {
  if (!std::getenv("LF_PP_HOOK")) GTEST_SKIP() << "run by tests/python/test_dist_pp.py";
  Comm::Options copts;
  copts.timeout = std::chrono::seconds(60);  // a schedule that deadlocks fails within a minute
  auto comm = Comm::init(detect_launch(), copts);
  const Group& pp = comm->world_group();
  const int layers = env_int("LF_PP_LAYERS", 4), vpp = env_int("LF_PP_VPP", 1);
  const int micros = env_int("LF_PP_MICROS", 4), steps = env_int("LF_PP_STEPS", 10);
  const bool tied = env_int("LF_PP_TIED", 0) != 0;
  const int64_t B = 2, T = 16, H = 32, V = 128;

  CausalLM ref = tiny_llama(layers, tied);
  CausalLM mod = tiny_llama(layers, tied);
  Pipeline pipe(*mod, pp, vpp, pipeline_layer_counts(layers, pp.size(), vpp, env_list("LF_PP_LAYOUT")));
  EXPECT_EQ(pipe.is_first(), pp.rank() == 0);
  EXPECT_EQ(pipe.is_last(), pp.rank() == pp.size() - 1);

  // Released parameters are empty and frozen; every parameter is owned by exactly one rank (a tied copy once).
  auto named = mod->named_parameters(true);
  auto owned = pipe.owned_parameter_names();
  std::set<std::string> owned_set(owned.begin(), owned.end());
  for (auto& p : named) {
    if (owned_set.count(p.key())) {
      EXPECT_TRUE(p.value().requires_grad()) << p.key();
      EXPECT_GT(p.value().numel(), 0) << p.key();
    } else {
      EXPECT_EQ(p.value().numel(), 0) << p.key();
      EXPECT_FALSE(p.value().requires_grad()) << p.key();
    }
  }
  {
    auto norm_names = pipe.norm_parameter_names();
    std::set<std::string> ns(norm_names.begin(), norm_names.end());
    at::Tensor count = at::zeros({static_cast<int64_t>(named.size())}, at::kFloat);
    int64_t i = 0;
    for (auto& p : named) count[i++] = ns.count(p.key()) ? 1.0 : 0.0;
    pp.all_reduce(count);
    EXPECT_TRUE(at::equal(count, at::ones_like(count))) << count;
  }
  if (pp.size() > 1) EXPECT_LT(owned.size(), named.size());

  auto make_batches = [&](int step) {
    torch::manual_seed(100 + step);
    std::vector<MicroBatch> mbs;
    for (int m = 0; m < micros; ++m) mbs.push_back(MicroBatch{{"input_ids", at::randint(V, {B, T}, at::kLong)}});
    return mbs;
  };
  const double scale = static_cast<double>(micros * B * (T - 1));  // every token counted
  auto loss_fn_of = [&](const std::vector<MicroBatch>& mbs, CausalLM& m) {
    return [&mbs, &m](const at::Tensor& hidden, size_t i) {
      return lf::nn::causal_lm_loss_sum(m->logits(hidden), mbs[i].at("input_ids")).first;
    };
  };
  auto act_shape = [&](size_t) { return std::vector<int64_t>{B, T, H}; };
  auto ref_forward_backward = [&](const std::vector<MicroBatch>& mbs) {
    double total = 0;
    for (auto& mb : mbs) {
      at::Tensor l = lf::nn::causal_lm_loss_sum(ref->logits(ref->hidden_states(mb.at("input_ids"))), mb.at("input_ids")).first;
      total += l.item<double>();
      (l / scale).backward();
    }
    return total;
  };

  // 1. One forward/backward: the summed loss and every owned gradient.
  double first_norm = 0;
  {
    auto mbs = make_batches(0);
    double want = ref_forward_backward(mbs);
    double got = pipe.forward_backward(mbs, loss_fn_of(mbs, mod), scale, act_shape);
    pipe.sync_tied_grads();
    EXPECT_LT(rel(got, want), 1e-5) << got << " vs " << want;
    auto ref_named = ref->named_parameters(true);
    for (auto& n : owned) {
      at::Tensor g = named[n].grad(), w = ref_named[n].grad();
      ASSERT_TRUE(g.defined()) << n;
      double err = (g - w).abs().max().item<double>(), mag = w.abs().max().item<double>();
      EXPECT_LE(err, 1e-5 * mag + 1e-8) << n << ": max error " << err << " (max |grad| " << mag << ")";
    }
    first_norm = lf::optim::clip_grad_norm(ref->parameters(), 0.0);
    EXPECT_LT(rel(pipe.grad_norm(), first_norm), 1e-5) << pipe.grad_norm() << " vs " << first_norm;
    at::NoGradGuard ng;
    for (auto& p : ref->parameters()) p.mutable_grad() = at::Tensor();
    for (auto& p : pipe.owned_parameters()) p.mutable_grad() = at::Tensor();
  }

  // 2. AdamW steps with clipping (the norm over the pp group): per-step losses and norms.
  lf::optim::AdamWOptions o;
  o.lr = 1e-2;
  lf::optim::AdamW ref_opt(ref->parameters(), o), opt(pipe.owned_parameters(), o);
  const double max_norm = 0.97 * first_norm;  // clipping is active in some of the steps
  int clipped = 0;
  for (int s = 0; s < steps; ++s) {
    auto mbs = make_batches(1 + s);
    ref_opt.zero_grad();
    opt.zero_grad();
    double want = ref_forward_backward(mbs);
    double want_norm = lf::optim::clip_grad_norm(ref->parameters(), max_norm);
    ref_opt.step();
    double got = pipe.forward_backward(mbs, loss_fn_of(mbs, mod), scale, act_shape);
    pipe.sync_tied_grads();
    double norm = pipe.grad_norm();
    {
      at::NoGradGuard ng;
      double coef = std::min(1.0, max_norm / (norm + 1e-6));
      if (coef < 1.0) ++clipped;
      for (auto& p : pipe.owned_parameters())
        if (p.grad().defined()) p.mutable_grad().mul_(coef);
    }
    opt.step();
    EXPECT_LT(rel(got, want), 1e-5) << "step " << s << ": loss " << got << " vs " << want;
    if (std::getenv("LF_PP_VERBOSE")) std::printf("step %d loss %.6f norm %.6f rel loss %.2e rel norm %.2e\n", s, got / scale, norm, rel(got, want), rel(norm, want_norm));
    EXPECT_LT(rel(norm, want_norm), 1e-5) << "step " << s << ": grad norm " << norm << " vs " << want_norm;
  }
  if (steps > 0) EXPECT_GT(clipped, 0) << "clipping never active: the test would not check it";
  // the parameters after the steps
  auto ref_named = ref->named_parameters(true);
  for (auto& n : owned) {
    double err = (named[n] - ref_named[n]).abs().max().item<double>();
    EXPECT_LE(err, 1e-4) << n;
  }
}
