// MoE router losses of a step under the distributed engine's layouts: each rank adds its share of the losses of
// the whole global micro-batch, so they equal one process's on that micro-batch (models::Model::aux_stats /
// aux_share: expert counts, rows, tokens and sequences summed over the data and context ranks by `reduce`), weighted
// by the micro-batch's global loss terms (the single-process weighting). Every tp rank computes the same share on
// the same whole tokens and backpropagates 1/tp of it.
#pragma once
#include <ATen/core/Tensor.h>

#include <functional>
#include <vector>

#include "loongforge/models/model.h"
#include "loongforge/parallel/pipeline.h"

namespace lf::train {

using Reduce = std::function<void(at::Tensor&)>;

// The expert count of the pooled load-balancing loss (0: no block has it on).
int64_t lb_experts(const models::Model& model);

// Under pipeline parallelism, the losses of each chunk's blocks (Pipeline's chunk_loss_fn). The sequence-level and
// z-losses of blocks with a graph go back with the chunk; the pooled load-balancing loss once every stage's expert
// counts and rows are summed (they travel with the activations as the chunk's carry, the total comes back with the
// gradients: finish). Recomputed blocks have no graph in the forward: finish hands their shares (with the total
// counts) to their recomputation (Model::layer_loss_fn), which runs within the chunk's backward.
// weight[i]: micro-batch i's global loss terms; scale: the step's loss terms.
parallel::Pipeline::ChunkLossFn pipeline_router_losses(models::Model* m, Reduce reduce, std::vector<double> weight,
                                                       int tp, double scale, int64_t lb_experts);

// Without pipeline parallelism: this rank's share of one micro-batch's router losses, weighted by `weight`, added
// to `loss` (backpropagated with it, 1/tp) and returned as a value. fsdp_layer_loss_fn (FSDP: the blocks ran without
// a graph) receives each block's share for its recomputation instead; recomputed blocks get theirs through
// Model::layer_loss_fn.
double add_router_losses(models::Model& model, const Reduce& reduce, double weight, int tp, double scale,
                         at::Tensor& loss, std::function<at::Tensor(size_t)>* fsdp_layer_loss_fn);

}  // namespace lf::train
