#include "loongforge/train/router_losses.h"

#include <ATen/ATen.h>

namespace lf::train {

int64_t lb_experts(const models::Model& model) {
  int64_t e = 0;
  for (auto* blk : model.moe_blocks())
    if (blk->options.aux_loss_coef > 0) e = blk->options.num_experts;
  return e;
}

parallel::Pipeline::ChunkLossFn pipeline_router_losses(models::Model* m, Reduce reduce, std::vector<double> weight,
                                                       int tp, double scale, int64_t lb_experts) {
  return [m, reduce, weight, tp, scale, lb_experts](size_t i, int64_t begin, int64_t end) {
    parallel::Pipeline::ChunkLoss out;
    auto& model = *m;
    const auto st = model.aux_stats(reduce, begin, end);
    const double w = weight[i];
    if (at::Tensor a = model.aux_share(st, begin, end, /*with_lb=*/false); a.defined())
      out.value = a.item<double>() * w;  // every layer's (recomputed ones: made without a graph)
    at::Tensor now, p_graph;  // shares and probability sums of the layers with a graph
    bool recomputed = false;
    for (int64_t k = begin; k < end; ++k) {
      if (model.recomputed(k)) {
        recomputed = true;
        continue;
      }
      if (at::Tensor a = model.aux_share(st, k, k + 1, /*with_lb=*/false); a.defined())
        now = now.defined() ? now + a : a;
      if (at::Tensor p = lb_experts > 0 ? model.lb_prob_sum(k, k + 1) : at::Tensor(); p.defined())
        p_graph = p_graph.defined() ? p_graph + p : p;
    }
    if (now.defined()) out.loss = now * (w / tp);
    const int64_t e = lb_experts;
    at::Tensor p_all;
    if (e > 0) {
      out.carry = at::zeros({e + 1}, at::kDouble);  // expert counts, rows
      if (st.any && st.rows > 0) {
        out.carry.narrow(0, 0, e).copy_(st.counts);
        out.carry[e] = st.rows;
      }
      p_all = model.lb_prob_sum(begin, end);
    }
    if (e == 0 && !recomputed) return out;
    const double w_recomputed = w / tp / scale;  // layer_loss_fn's losses come scaled
    out.finish = [m, tp, st, p_graph, p_all, w, w_recomputed, e, recomputed](const at::Tensor& total) {
      auto& model = *m;
      auto full = st;  // with the counts and rows of every stage
      std::pair<at::Tensor, double> res{at::Tensor(), 0.0};
      if (total.defined()) {
        const at::Tensor t = total.cpu();
        full.counts = t.narrow(0, 0, e).clone();
        full.rows = t[e].item<double>();
        if (p_all.defined()) res.second = model.lb_share(p_all, full.counts, full.rows).item<double>() * w;
        if (p_graph.defined()) res.first = model.lb_share(p_graph, full.counts, full.rows) * (w / tp);
      }
      model.layer_loss_fn = nullptr;
      if (recomputed && full.any)
        model.layer_loss_fn = [m, full, w_recomputed, lb = total.defined()](int64_t k) {
          at::Tensor a = m->aux_share(full, k, k + 1, lb);
          return a.defined() ? a * w_recomputed : a;
        };
      return res;
    };
    return out;
  };
}

double add_router_losses(models::Model& model, const Reduce& reduce, double weight, int tp, double scale,
                         at::Tensor& loss, std::function<at::Tensor(size_t)>* fsdp_layer_loss_fn) {
  auto st = model.aux_stats(reduce);
  if (fsdp_layer_loss_fn) {
    if (!st.any) return 0;
    const double w = weight / scale;
    *fsdp_layer_loss_fn = [m = &model, st, w](size_t block) {
      at::Tensor a = m->aux_share(st, static_cast<int64_t>(block), static_cast<int64_t>(block) + 1);
      return a.defined() ? a * w : a;
    };
    return model.aux_share(st).item<double>() * weight;
  }
  at::Tensor a = model.aux_share(st);
  if (!a.defined()) return 0;
  loss = loss + a * (weight / tp);
  if (model.recomputed(0)) {  // recomputed blocks: their shares go back in their recomputation
    const double w = weight / tp / scale;
    model.layer_loss_fn = [m = &model, st, w](int64_t k) {
      at::Tensor s = m->aux_share(st, k, k + 1);
      return s.defined() ? s * w : s;
    };
  }
  return a.item<double>() * weight;
}

}  // namespace lf::train
