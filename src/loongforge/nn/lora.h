// LoRA (https://arxiv.org/abs/2106.09685) on nn::Linear layers, with PEFT's arithmetic and parameter layout:
// y = x W^T + b + scaling * B(A(dropout(x))), A [r, in] and B [out, r] registered as children "lora_A" / "lora_B"
// of the adapted Linear (so "model.layers.0.self_attn.q_proj.lora_A.weight"). PEFT files: io/peft.h.
#pragma once
#include <torch/nn/module.h>

#include <string>
#include <utility>
#include <vector>

#include "loongforge/nn/linear.h"

namespace lf::nn {

struct LoraConfig {
  int64_t r = 8;
  double alpha = 16;
  double dropout = 0;
  // A module matches when its full name equals an entry or ends with "." + entry (PEFT's list rule: "q_proj",
  // "self_attn.q_proj"); an entry "re:PATTERN" matches when PATTERN (ECMAScript) matches the whole module name.
  std::vector<std::string> target_modules;
  bool use_rslora = false;  // scaling alpha / sqrt(r) instead of alpha / r

  double scaling() const;
  bool matches(const std::string& module_name) const;
};

// The adapter a LoRA'd Linear carries; its A and B are also registered on the Linear.
class LoraAdapter : public LinearAdapter {
 public:
  LoraAdapter(Linear a, Linear b, double scaling, double dropout) : A(std::move(a)), B(std::move(b)), scaling(scaling), dropout(dropout) {}
  at::Tensor forward(const at::Tensor& x) override;  // dropout only while the module is training
  at::Tensor delta_weight() const;                    // scaling * B A, [out, in]

  Linear A, B;
  double scaling, dropout;
};

// Attaches an adapter to every nn::Linear submodule of `root` that matches (A kaiming-uniform a=sqrt(5) like PEFT,
// B zeros, in the base weight's dtype and device). Returns the adapter parameters (name, tensor) in root's parameter
// order. lf::Error when nothing matches (naming the patterns), when r < 1, or when a match already has an adapter.
std::vector<std::pair<std::string, at::Tensor>> apply_lora(torch::nn::Module& root, const LoraConfig& cfg);

// The adapter parameters currently attached under `root`, in root's parameter order.
std::vector<std::pair<std::string, at::Tensor>> lora_parameters(torch::nn::Module& root);

// The names (in `root`) of the modules that carry a LoRA adapter.
std::vector<std::string> lora_modules(torch::nn::Module& root);

// Folds every adapter into its base weight (W += scaling * B A) and removes the adapters and their parameters.
void merge_lora(torch::nn::Module& root);

}  // namespace lf::nn
