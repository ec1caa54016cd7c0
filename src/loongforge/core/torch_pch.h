// The precompiled header: the narrow set of LibTorch headers the library uses (never torch/torch.h).
#pragma once
#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>
#include <memory>
#include <optional>
