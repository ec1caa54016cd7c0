// The single-process engine: no layout; the model, AdamW and checkpoints as model folders, on the CPU (rows split
// over the CPU threads: train.cpu_split) or one GPU (pinned copies, bf16/fp8 autocast, packed-document flash attention,
// CUDA graphs: train.cuda_graphs).
#pragma once
#include <nlohmann/json.hpp>

#include <memory>

#include "loongforge/train/engine.h"

namespace lf::train {

std::unique_ptr<Engine> make_single_engine(const EngineOptions& options, ModelBundle bundle,
                                           at::Device device = at::Device(at::kCPU));

}  // namespace lf::train
