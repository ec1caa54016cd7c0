#include "loongforge/parallel/pipeline.h"

#include <algorithm>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
// comm.h declares Pending (inline defaulted move) over an incomplete c10d::Work: code that moves a Pending needs it.
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <cmath>
#include <map>
#include <set>

#include "loongforge/core/error.h"

namespace lf::parallel {

namespace {

OptionError option_error(const std::string& option, const std::string& what) { return OptionError(option, what); }

std::string join(const std::vector<int64_t>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? "," : "") + std::to_string(v[i]);
  return s;
}

// "<blocks>.12.mlp.up_proj.weight" -> 12; -1 for other names.
int64_t layer_of(const std::string& name, const std::string& prefix) {
  if (name.rfind(prefix, 0) != 0) return -1;
  size_t end = name.find('.', prefix.size());
  return std::stoll(name.substr(prefix.size(), end - prefix.size()));
}

bool starts_with(const std::string& s, const std::string& p) { return s.rfind(p, 0) == 0; }

// Whether `name` is a parameter of module `m` or below it.
bool under(const std::string& name, const std::string& m) { return starts_with(name, m + "."); }

}  // namespace

std::vector<int64_t> pipeline_layer_counts(int64_t layers, int pp, int vpp, const std::vector<int64_t>& explicit_counts) {
  if (pp < 1) throw option_error("pp", std::to_string(pp) + " must be >= 1");
  if (vpp < 1) throw option_error("vpp", std::to_string(vpp) + " must be >= 1");
  const int64_t stages = int64_t{pp} * vpp;
  if (explicit_counts.empty()) {
    if (layers % stages != 0)
      throw option_error("pp", "pp * vpp = " + std::to_string(stages) + " does not divide num_hidden_layers " +
                                            std::to_string(layers) + " (give parallel.pp_layout for an uneven split)");
    return std::vector<int64_t>(static_cast<size_t>(stages), layers / stages);
  }
  if (static_cast<int64_t>(explicit_counts.size()) != stages)
    throw option_error("pp_layout", "has " + std::to_string(explicit_counts.size()) +
                                                 " entries, expected pp * vpp = " + std::to_string(stages));
  int64_t sum = 0;
  for (size_t i = 0; i < explicit_counts.size(); ++i) {
    if (explicit_counts[i] < 1)
      throw option_error("pp_layout", "entry " + std::to_string(i) + " is " + std::to_string(explicit_counts[i]) +
                                                   ": every stage needs at least one layer");
    sum += explicit_counts[i];
  }
  if (sum != layers)
    throw option_error("pp_layout", "[" + join(explicit_counts) + "] sums to " + std::to_string(sum) +
                                                 ", expected num_hidden_layers " + std::to_string(layers));
  return explicit_counts;
}

namespace {

// Forwards before the first backward on `rank` (1F1B: pp - rank - 1; interleaved: Megatron's count).
int64_t warmup_steps(int pp, int vpp, int64_t micros, int rank) {
  const int64_t w = vpp == 1 ? pp - rank - 1 : int64_t{pp - rank - 1} * 2 + int64_t{vpp - 1} * pp;
  return std::min(w, micros * vpp);
}

}  // namespace

std::vector<PipelineOp> pipeline_schedule(int pp, int vpp, int64_t micros, int rank) {
  if (pp < 1 || vpp < 1 || rank < 0 || rank >= pp) throw Error("pipeline_schedule: bad pp/vpp/rank");
  if (micros < 1) throw option_error("pp", "needs at least one micro-batch");
  if (vpp > 1 && micros % pp != 0)
    throw option_error("pp", "the interleaved schedule (vpp " + std::to_string(vpp) +
                                          ") needs the number of micro-batches (" + std::to_string(micros) +
                                          ") to be a multiple of pp (" + std::to_string(pp) + ")");
  const int64_t total = micros * vpp, group = int64_t{pp} * vpp;
  const int64_t warmup = warmup_steps(pp, vpp, micros, rank);
  // Megatron's numbering of virtual steps: groups of pp micro-batches go through chunk 0, then chunk 1, ...
  auto micro_of = [&](int64_t k) { return (k / group) * pp + k % pp; };
  auto chunk_of = [&](int64_t k, bool forward) {
    int c = static_cast<int>((k % group) / pp);
    return forward ? c : vpp - 1 - c;
  };
  std::vector<PipelineOp> ops;
  ops.reserve(static_cast<size_t>(2 * total));
  for (int64_t k = 0; k < warmup; ++k) ops.push_back({true, micro_of(k), chunk_of(k, true)});
  for (int64_t k = 0; k < total - warmup; ++k) {
    ops.push_back({true, micro_of(warmup + k), chunk_of(warmup + k, true)});
    ops.push_back({false, micro_of(k), chunk_of(k, false)});
  }
  for (int64_t k = total - warmup; k < total; ++k) ops.push_back({false, micro_of(k), chunk_of(k, false)});
  return ops;
}

namespace {

// The steps forward_backward (forward_only: every (micro, chunk) forward in order) runs on `rank`.
std::vector<PipelineOp> pipeline_steps(int pp, int vpp, int64_t micros, int rank, bool forward_only) {
  if (!forward_only) return pipeline_schedule(pp, vpp, micros, rank);
  std::vector<PipelineOp> ops;
  for (int64_t m = 0; m < micros; ++m)
    for (int c = 0; c < vpp; ++c) ops.push_back({true, m, c});
  return ops;
}

// The steps in communication segments [first, second): each steady-state pair (the forward of micro-batch k + warmup
// and the backward of k) is one segment, every warm-up and cool-down step one of its own. Before each segment a rank
// posts, in one batch, the sends of the previous segment and every receive of this one (Megatron's
// send_forward_backward_recv_forward_backward). forward_only: one segment per step.
std::vector<std::pair<size_t, size_t>> pipeline_segments(int pp, int vpp, int64_t micros, int rank, bool forward_only) {
  const size_t n = static_cast<size_t>(micros * vpp) * (forward_only ? 1 : 2);
  const size_t warmup = forward_only ? n : static_cast<size_t>(warmup_steps(pp, vpp, micros, rank));
  const size_t steady_end = forward_only ? n : n - warmup;  // warm-up forwards + 2 x steady pairs
  std::vector<std::pair<size_t, size_t>> segs;
  for (size_t i = 0; i < n;) {
    const size_t len = i >= warmup && i < steady_end ? 2 : 1;
    segs.emplace_back(i, i + len);
    i += len;
  }
  return segs;
}

// What step `op` of `rank` receives and sends over the wire, each in the order the step uses or makes them (an
// activation before its carry; a backward takes the carry's total before the gradient, and passes them on in that
// order). Messages to itself (pp == 1) are left out.
struct StepMessages {
  std::vector<PipelineTransfer> recvs, sends;
};
StepMessages step_messages(int pp, int vpp, int rank, const PipelineOp& op, bool carry) {
  using M = PipelineMessage;
  const int64_t S = int64_t{pp} * vpp, s = int64_t{op.chunk} * pp + rank;
  const int prev = (rank - 1 + pp) % pp, next = (rank + 1) % pp;
  StepMessages out;
  if (pp == 1) return out;
  if (op.forward) {
    if (s > 0) {
      out.recvs.push_back({false, prev, {M::Activation, op.micro, s}});
      if (carry) out.recvs.push_back({false, prev, {M::CarryForward, op.micro, s}});
    }
    if (s < S - 1) {
      out.sends.push_back({true, next, {M::Activation, op.micro, s + 1}});
      if (carry) out.sends.push_back({true, next, {M::CarryForward, op.micro, s + 1}});
    }
  } else {
    if (s < S - 1) {
      if (carry) out.recvs.push_back({false, next, {M::CarryBackward, op.micro, s}});
      out.recvs.push_back({false, next, {M::Gradient, op.micro, s}});
    }
    if (s > 0) {
      if (carry) out.sends.push_back({true, prev, {M::CarryBackward, op.micro, s - 1}});
      out.sends.push_back({true, prev, {M::Gradient, op.micro, s - 1}});
    }
  }
  return out;
}

// A rank's point-to-point traffic, segment by segment (pipeline_segments): begin() posts the sends queued since the
// previous segment and every receive of the new one in one batch and waits for it; take() hands out what arrived;
// finish() posts the last sends. Every batch is logged in pipeline_comm_plan's form.
class SegmentComm {
 public:
  SegmentComm(const Group& pp, std::vector<std::vector<PipelineTransfer>>& log) : pp_(pp), log_(log) { log_.clear(); }
  // recvs: the segment's receives, with the tensor each fills
  void begin(const std::vector<std::pair<PipelineTransfer, at::Tensor>>& recvs,
             const std::function<int(const PipelineMessage&)>& tag) {
    for (const auto& [t, buf] : recvs) {
      ops_.push_back({false, buf, t.peer, tag(t.message)});
      entries_.push_back(t);
      inbox_.emplace_back(t.message, buf);
    }
    post();
  }
  void send(const at::Tensor& t, int dst, int tag, const PipelineMessage& m) {
    ops_.push_back({true, t.detach().contiguous(), dst, tag});
    entries_.push_back({true, dst, m});
  }
  at::Tensor take(const PipelineMessage& m) {
    for (auto it = inbox_.begin(); it != inbox_.end(); ++it)
      if (it->first == m) {
        at::Tensor t = it->second;
        inbox_.erase(it);
        return t;
      }
    throw Error("pipeline: message (kind " + std::to_string(m.kind) + ", micro " + std::to_string(m.micro) +
                ", stage " + std::to_string(m.stage) + ") was never received (schedule bug)");
  }
  void finish() { post(); }

 private:
  void post() {
    if (ops_.empty()) return;
    Pending p = pp_.batch_p2p(ops_);
    ops_.clear();
    log_.push_back(std::move(entries_));
    entries_.clear();
    p.wait();
  }
  const Group& pp_;
  std::vector<std::vector<PipelineTransfer>>& log_;
  std::vector<P2POp> ops_;
  std::vector<PipelineTransfer> entries_;
  std::vector<std::pair<PipelineMessage, at::Tensor>> inbox_;
};

}  // namespace

std::vector<std::vector<PipelineTransfer>> pipeline_comm_plan(int pp, int vpp, int64_t micros, int rank, bool carry,
                                                              bool forward_only) {
  carry = carry && !forward_only;
  std::vector<std::vector<PipelineTransfer>> batches;
  std::vector<PipelineTransfer> outbox;  // the sends since the last batch
  const auto ops = pipeline_steps(pp, vpp, micros, rank, forward_only);
  const auto segs = pipeline_segments(pp, vpp, micros, rank, forward_only);
  for (size_t g = 0; g <= segs.size(); ++g) {
    // before segment g (and after the last): the sends so far and every receive of the segment, in one batch
    std::vector<PipelineTransfer> batch = std::move(outbox);
    outbox.clear();
    if (g < segs.size())
      for (size_t i = segs[g].first; i < segs[g].second; ++i)
        for (const auto& t : step_messages(pp, vpp, rank, ops[i], carry).recvs) batch.push_back(t);
    if (!batch.empty()) batches.push_back(std::move(batch));
    if (g == segs.size()) break;
    for (size_t i = segs[g].first; i < segs[g].second; ++i)
      for (const auto& t : step_messages(pp, vpp, rank, ops[i], carry).sends) outbox.push_back(t);
  }
  return batches;
}

Pipeline::Pipeline(models::Model& model, const Group& pp, int vpp, std::vector<int64_t> layer_counts)
    : model_(model), pp_(pp), vpp_(vpp), counts_(std::move(layer_counts)) {
  const models::Split split = model.split();
  const int P = pp.size(), r = pp.rank();
  counts_ = pipeline_layer_counts(model.num_blocks(), P, vpp, counts_);  // validates
  std::vector<int64_t> starts(counts_.size() + 1, 0);
  for (size_t i = 0; i < counts_.size(); ++i) starts[i + 1] = starts[i] + counts_[i];
  std::set<int64_t> my_layers;
  for (int c = 0; c < vpp; ++c) {
    size_t s = static_cast<size_t>(c) * P + r;
    ranges_.emplace_back(starts[s], starts[s + 1]);
    for (int64_t l = starts[s]; l < starts[s + 1]; ++l) my_layers.insert(l);
  }
  tied_names_ = split.tied;
  tied_ = !tied_names_.empty() && P > 1;
  for (const auto& item : model.named_parameters(true))
    if (!split.pre.empty() && under(item.key(), split.pre.front())) {
      act_param_ = item.value();
      break;
    }
  if (!act_param_.defined()) throw Error("pipeline: the model's first piece (" + (split.pre.empty() ? std::string("none") : split.pre.front()) + ") has no parameters");

  bool first = is_first(), last = is_last();
  // Every pp rank meets here once: under NCCL this creates the group's communicator, which the first and last stages'
  // exchange below would otherwise create without the middle ones (comm.h, batch_p2p).
  if (P > 1) pp.barrier();
  at::NoGradGuard ng;
  for (auto& item : model.named_parameters(true)) {
    const std::string& name = item.key();
    at::Tensor p = item.value();
    bool keep;
    int64_t l = layer_of(name, split.blocks + ".");
    const bool tied = std::find(split.tied.begin(), split.tied.end(), name) != split.tied.end();
    const bool pre = std::any_of(split.pre.begin(), split.pre.end(), [&](const std::string& m) { return under(name, m); });
    const bool post = std::any_of(split.post.begin(), split.post.end(), [&](const std::string& m) { return under(name, m); });
    if (l >= 0) keep = my_layers.count(l) > 0;
    else if (pre) keep = first || (last && tied);
    else if (post) keep = last;
    else keep = true;  // parameters of no piece stay everywhere
    if (keep) {
      owned_.push_back(name);
    } else {
      p.set_data(at::empty({0}, p.options()));
      p.set_requires_grad(false);
      p.mutable_grad() = at::Tensor();
    }
  }
  if (tied_ && (first || last)) {  // the last stage's copies start as the first stage's weights
    auto named = model.named_parameters(true);
    for (const auto& n : tied_names_) {
      at::Tensor w = named[n];
      at::Tensor buf = w.detach().contiguous();
      if (first) pp.isend(buf, P - 1, 0).wait();
      else {
        pp.irecv(buf, 0, 0).wait();
        if (!buf.is_same(w)) w.copy_(buf);
      }
    }
  }
}

std::vector<at::Tensor> Pipeline::owned_parameters() const {
  auto named = model_.named_parameters(true);
  std::vector<at::Tensor> out;
  for (auto& n : owned_) out.push_back(named[n]);
  return out;
}

std::vector<std::string> Pipeline::norm_parameter_names() const {
  std::vector<std::string> out;
  for (auto& n : owned_)
    if (!(tied_ && is_last() && !is_first() &&
          std::find(tied_names_.begin(), tied_names_.end(), n) != tied_names_.end()))
      out.push_back(n);
  return out;
}

double Pipeline::grad_norm() const {
  auto named = model_.named_parameters(true);
  at::Tensor sq = at::zeros({}, at::kDouble);
  for (auto& n : norm_parameter_names()) {
    at::Tensor g = named[n].grad();
    if (g.defined()) sq += g.detach().to(at::kDouble).pow(2).sum().cpu();
  }
  if (act_opts().device().is_cuda()) sq = sq.to(act_opts().device());
  pp_.all_reduce(sq);
  return std::sqrt(sq.item<double>());
}

void Pipeline::sync_tied_grads() {
  if (!tied_ || !(is_first() || is_last())) return;
  auto named = model_.named_parameters(true);
  for (const auto& n : tied_names_) sync_tied_grad(named[n]);
}

void Pipeline::sync_tied_grad(at::Tensor w) {
  at::Tensor g = w.grad();
  if (!g.defined()) g = at::zeros_like(w);
  at::Tensor mine = g.detach().contiguous().clone();
  at::Tensor other = at::empty_like(mine);
  int peer = is_first() ? pp_.size() - 1 : 0;
  // one batch: under NCCL the two sends would otherwise each wait for the other side's receive
  pp_.batch_p2p({P2POp{true, mine, peer, 1}, P2POp{false, other, peer, 1}}).wait();
  at::NoGradGuard ng;
  // a + b on both sides (IEEE addition is commutative: the two copies get identical sums)
  at::Tensor sum = mine + other;
  if (w.grad().defined()) w.mutable_grad().copy_(sum);
  else w.mutable_grad() = sum;
}

double Pipeline::forward_backward(const std::vector<MicroBatch>& mbs,
                                  const std::function<at::Tensor(const at::Tensor&, size_t)>& loss_fn, double loss_scale,
                                  const std::function<std::vector<int64_t>(size_t)>& act_shape,
                                  const ChunkLossFn& chunk_loss_fn, int64_t carry_size) {
  const int P = pp_.size(), r = pp_.rank();
  const int64_t M = static_cast<int64_t>(mbs.size());
  const int64_t S = int64_t{P} * vpp_;  // virtual stages
  const bool carry = carry_size > 0;
  if (carry && !chunk_loss_fn)
    throw Error("pipeline: a carry of " + std::to_string(carry_size) + " elements without a chunk_loss_fn");
  const auto ops = pipeline_schedule(P, vpp_, M, r);
  const auto segs = pipeline_segments(P, vpp_, M, r, /*forward_only=*/false);
  using Msg = PipelineMessage;
  // tag of the message that enters virtual stage `s` (forward) or leaves it backwards (backward); a ChunkLoss's
  // carry travels under the same tag plus kCarryTag (below forward_only's tags). Gloo matches them; NCCL ignores them.
  auto tag = [&](int64_t micro, int64_t s, bool forward) { return static_cast<int>(2 * (micro * S + s) + (forward ? 0 : 1)); };
  constexpr int kCarryTag = 1 << 28;
  auto tag_of = [&](const Msg& m) {
    const bool fwd = m.kind == Msg::Activation || m.kind == Msg::CarryForward;
    return tag(m.micro, m.stage, fwd) + (m.kind == Msg::CarryForward || m.kind == Msg::CarryBackward ? kCarryTag : 0);
  };
  struct Slot {
    at::Tensor input, output;  // input: the received leaf (stages > 0); output: the sent tensor or the scaled loss
    at::Tensor extra;          // the chunk's own scaled loss (chunk_loss_fn) or undefined
    at::Tensor carry;          // the carry summed up to and including this chunk (the total on the last stage)
    std::function<std::pair<at::Tensor, double>(const at::Tensor&)> finish;
  };
  std::map<std::pair<int64_t, int>, Slot> slots;
  SegmentComm comm(pp_, comm_log_);
  std::map<int, at::Tensor> local;  // messages to this rank itself (pp == 1 with vpp > 1)
  double loss_sum = 0.0, extra_sum = 0.0;
  const at::ScalarType act_dtype = act_opts().dtype().toScalarType();

  auto send = [&](const at::Tensor& t, int dst_rank, const Msg& m) {
    if (dst_rank == r) local[tag_of(m)] = t.detach().contiguous();
    else comm.send(t, dst_rank, tag_of(m), m);
  };
  auto recv = [&](int src_rank, const Msg& m) {
    if (src_rank != r) return comm.take(m);
    auto it = local.find(tag_of(m));
    TORCH_CHECK(it != local.end(), "pipeline: local message missing (schedule bug)");
    at::Tensor t = it->second;
    local.erase(it);
    return t;
  };
  // backward of a chunk's output (with gradient g, or the loss itself when g is undefined) and its own loss
  auto backward = [](const at::Tensor& out, const at::Tensor& g, const at::Tensor& extra) {
    if (!extra.defined() || !extra.requires_grad()) {
      if (g.defined()) out.backward(g);
      else out.backward();
      return;
    }
    at::Tensor go = g.defined() ? g : at::ones_like(out);
    torch::autograd::backward({out, extra}, {go, at::ones_like(extra)});
  };

  for (const auto& [seg_begin, seg_end] : segs) {
    // the previous segment's sends and this one's receives, in one batch
    std::vector<std::pair<PipelineTransfer, at::Tensor>> incoming;
    for (size_t i = seg_begin; i < seg_end; ++i)
      for (const auto& t : step_messages(P, vpp_, r, ops[i], carry).recvs) {
        const bool act = t.message.kind == Msg::Activation || t.message.kind == Msg::Gradient;
        const auto shape = act ? act_shape(static_cast<size_t>(t.message.micro)) : std::vector<int64_t>{carry_size};
        incoming.emplace_back(t, at::empty(shape, act_opts().dtype(act ? act_dtype : at::kDouble)));
      }
    comm.begin(incoming, tag_of);

    for (size_t oi = seg_begin; oi < seg_end; ++oi) {
      const auto& op = ops[oi];
      const int64_t s = int64_t{op.chunk} * P + r;
      const auto [begin, end] = ranges_.at(static_cast<size_t>(op.chunk));
      const size_t mi = static_cast<size_t>(op.micro);
      const MicroBatch& mb = mbs[mi];
      const int prev = (r - 1 + P) % P, next = (r + 1) % P;
      if (op.forward) {
        Slot slot;
        at::Tensor h;
        if (s == 0) {
          h = model_.embed(mb);
        } else {
          slot.input = recv(prev, {Msg::Activation, op.micro, s}).requires_grad_(true);
          h = slot.input;
        }
        h = run_chunk(mb, h, begin, end);
        if (chunk_loss_fn) {
          ChunkLoss cl = chunk_loss_fn(mi, begin, end);
          extra_sum += cl.value;
          if (cl.loss.defined()) slot.extra = cl.loss / loss_scale;
          if (cl.carry.defined() != carry || (carry && cl.carry.numel() != carry_size))
            throw Error("pipeline: a chunk's carry has " + std::to_string(cl.carry.defined() ? cl.carry.numel() : 0) +
                        " elements, forward_backward was told " + std::to_string(carry_size));
          if (carry) {  // add the earlier stages' sum
            slot.carry = cl.carry.to(act_opts().device(), at::kDouble);
            if (s > 0) slot.carry = slot.carry + recv(prev, {Msg::CarryForward, op.micro, s});
          }
          slot.finish = std::move(cl.finish);
        }
        if (s == S - 1) {
          at::Tensor loss = loss_fn(model_.post_blocks(h), mi);
          loss_sum += loss.detach().to(at::kDouble).item<double>();
          slot.output = loss / loss_scale;
        } else {
          send(h, next, {Msg::Activation, op.micro, s + 1});
          if (carry) send(slot.carry, next, {Msg::CarryForward, op.micro, s + 1});
          slot.output = h;
        }
        slots[{op.micro, op.chunk}] = std::move(slot);
      } else {
        auto it = slots.find({op.micro, op.chunk});
        TORCH_CHECK(it != slots.end(), "pipeline: backward before forward (schedule bug)");
        Slot slot = std::move(it->second);
        slots.erase(it);
        at::Tensor total;  // the carry's total over every stage: from the next stage, or this one's sum if last
        if (slot.carry.defined()) {
          total = s == S - 1 ? slot.carry : recv(next, {Msg::CarryBackward, op.micro, s});
          if (s > 0) send(total, prev, {Msg::CarryBackward, op.micro, s - 1});
        }
        at::Tensor g;
        if (s < S - 1) g = recv(next, {Msg::Gradient, op.micro, s});
        if (slot.finish) {
          auto [extra, value] = slot.finish(total);
          extra_sum += value;
          if (extra.defined()) slot.extra = slot.extra.defined() ? slot.extra + extra / loss_scale : extra / loss_scale;
        }
        backward(slot.output, g, slot.extra);
        if (s > 0) {
          at::Tensor gi = slot.input.grad();
          if (!gi.defined()) gi = at::zeros_like(slot.input);
          send(gi, prev, {Msg::Gradient, op.micro, s - 1});
        }
      }
    }
  }
  comm.finish();
  if (comm_log_ != pipeline_comm_plan(P, vpp_, M, r, carry, false))
    throw Error("pipeline: rank " + std::to_string(r) + " posted its messages out of pipeline_comm_plan's order (bug)");
  // the loss is known on the last stage only: share it with the pp group
  // (and the chunks' own losses are known where they were made)
  if (P > 1) {
    at::Tensor l = at::full({}, (is_last() ? loss_sum : 0.0) + extra_sum, act_opts().dtype(at::kDouble));
    pp_.all_reduce(l);
    return l.item<double>();
  }
  return loss_sum + extra_sum;
}

at::Tensor Pipeline::run_chunk(const MicroBatch& mb, const at::Tensor& h, int64_t begin, int64_t end) {
  return model_.run_blocks(model_.block_inputs(mb, h.scalar_type()), h, begin, end);
}

double Pipeline::forward_only(const std::vector<MicroBatch>& mbs,
                              const std::function<at::Tensor(const at::Tensor&, size_t)>& loss_fn,
                              const std::function<std::vector<int64_t>(size_t)>& act_shape) {
  const int P = pp_.size(), r = pp_.rank();
  const int64_t S = int64_t{P} * vpp_;
  const int64_t M = static_cast<int64_t>(mbs.size());
  using Msg = PipelineMessage;
  // Tags far above forward_backward's (2 * (micro * S + s) + direction), so the two never match each other's messages.
  auto tag_of = [&](const Msg& m) { return static_cast<int>((int64_t{1} << 29) + m.micro * S + m.stage); };
  SegmentComm comm(pp_, comm_log_);
  std::map<int, at::Tensor> local;  // messages to this rank itself (pp == 1 with vpp > 1)
  double loss_sum = 0.0;
  for (const auto& op : pipeline_steps(P, vpp_, M, r, /*forward_only=*/true)) {
    std::vector<std::pair<PipelineTransfer, at::Tensor>> incoming;
    for (const auto& t : step_messages(P, vpp_, r, op, false).recvs)
      incoming.emplace_back(t, at::empty(act_shape(static_cast<size_t>(op.micro)), act_opts()));
    comm.begin(incoming, tag_of);
    const size_t mi = static_cast<size_t>(op.micro);
    const MicroBatch& mb = mbs[mi];
    const int64_t s = int64_t{op.chunk} * P + r;
    const auto [begin, end] = ranges_.at(static_cast<size_t>(op.chunk));
    at::Tensor h;
    if (s == 0) {
      h = model_.embed(mb);
    } else if (P > 1) {
      h = comm.take({Msg::Activation, op.micro, s});
    } else {
      auto it = local.find(tag_of({Msg::Activation, op.micro, s}));
      TORCH_CHECK(it != local.end(), "pipeline: local message missing (schedule bug)");
      h = it->second;
      local.erase(it);
    }
    h = run_chunk(mb, h, begin, end);
    if (s == S - 1) {
      loss_sum += loss_fn(model_.post_blocks(h), mi).detach().to(at::kDouble).item<double>();
    } else {
      const Msg m{Msg::Activation, op.micro, s + 1};
      if (P > 1) comm.send(h, (r + 1) % P, tag_of(m), m);
      else local[tag_of(m)] = h.detach().contiguous();
    }
  }
  comm.finish();
  if (comm_log_ != pipeline_comm_plan(P, vpp_, M, r, false, true))
    throw Error("pipeline: rank " + std::to_string(r) + " posted its messages out of pipeline_comm_plan's order (bug)");
  if (P > 1) {
    at::Tensor l = at::full({}, is_last() ? loss_sum : 0.0, act_opts().dtype(at::kDouble));
    pp_.all_reduce(l);
    loss_sum = l.item<double>();
  }
  return loss_sum;
}

}  // namespace lf::parallel
