#include "loongforge/nn/lora.h"

#include <ATen/ATen.h>

#include <cmath>
#include <regex>
#include <set>

#include "loongforge/core/error.h"

namespace lf::nn {

double LoraConfig::scaling() const {
  return use_rslora ? alpha / std::sqrt(static_cast<double>(r)) : alpha / static_cast<double>(r);
}

bool LoraConfig::matches(const std::string& name) const {
  for (const auto& t : target_modules) {
    if (t.rfind("re:", 0) == 0) {
      if (std::regex_match(name, std::regex(t.substr(3), std::regex::ECMAScript))) return true;
    } else if (name == t || (name.size() > t.size() && name.compare(name.size() - t.size(), t.size(), t) == 0 &&
                             name[name.size() - t.size() - 1] == '.')) {
      return true;
    }
  }
  return false;
}

at::Tensor LoraAdapter::forward(const at::Tensor& x) {
  at::Tensor h = dropout > 0 && A->is_training() ? at::dropout(x, dropout, /*train=*/true) : x;
  return at::linear(at::linear(h, A->weight), B->weight) * scaling;
}

at::Tensor LoraAdapter::delta_weight() const { return at::matmul(B->weight, A->weight) * scaling; }

namespace {
std::shared_ptr<LoraAdapter> adapter_of(LinearImpl& l) { return std::dynamic_pointer_cast<LoraAdapter>(l.adapter); }

std::string patterns(const LoraConfig& cfg) {
  std::string s;
  for (const auto& t : cfg.target_modules) s += (s.empty() ? "'" : ", '") + t + "'";
  return s.empty() ? "(none)" : s;
}
}  // namespace

std::vector<std::pair<std::string, at::Tensor>> apply_lora(torch::nn::Module& root, const LoraConfig& cfg) {
  if (cfg.r < 1) throw Error("LoRA: r must be >= 1, got " + std::to_string(cfg.r));
  if (cfg.dropout < 0 || cfg.dropout >= 1) throw Error("LoRA: dropout must lie in [0, 1)");
  std::vector<std::pair<std::string, LinearImpl*>> targets;  // collected first: we add Linear children below
  try {
    for (auto& item : root.named_modules("", /*include_self=*/false)) {
      auto* lin = item.value()->as<LinearImpl>();
      if (lin && cfg.matches(item.key())) targets.emplace_back(item.key(), lin);
    }
  } catch (const std::regex_error& e) {
    throw Error("LoRA: target_modules " + patterns(cfg) + ": invalid regular expression (" + e.what() + ")");
  }
  if (targets.empty()) throw Error("LoRA: target_modules " + patterns(cfg) + " match no linear layer of the model");
  for (auto& [name, lin] : targets)  // checked before anything changes
    if (lin->adapter) throw Error("LoRA: module '" + name + "' already has an adapter");
  for (auto& [name, lin] : targets) {
    Linear a(lin->in_features, cfg.r, false), b(cfg.r, lin->out_features, false);
    a->to(lin->weight.device(), lin->weight.scalar_type());  // LinearImpl's init is PEFT's kaiming-uniform(a=sqrt(5))
    b->to(lin->weight.device(), lin->weight.scalar_type());
    {
      at::NoGradGuard g;
      b->weight.zero_();
    }
    if (!lin->is_training()) {
      a->eval();
      b->eval();
    }
    lin->register_module("lora_A", a);
    lin->register_module("lora_B", b);
    lin->adapter = std::make_shared<LoraAdapter>(a, b, cfg.scaling(), cfg.dropout);
  }
  return lora_parameters(root);
}

std::vector<std::string> lora_modules(torch::nn::Module& root) {
  std::vector<std::string> out;
  for (auto& item : root.named_modules("", /*include_self=*/false)) {
    auto* lin = item.value()->as<LinearImpl>();
    if (lin && adapter_of(*lin)) out.push_back(item.key());
  }
  return out;
}

std::vector<std::pair<std::string, at::Tensor>> lora_parameters(torch::nn::Module& root) {
  std::set<std::string> names;
  for (const auto& m : lora_modules(root)) {
    names.insert(m + ".lora_A.weight");
    names.insert(m + ".lora_B.weight");
  }
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (auto& item : root.named_parameters())
    if (names.count(item.key())) out.emplace_back(item.key(), item.value());
  return out;
}

void merge_lora(torch::nn::Module& root) {
  at::NoGradGuard g;
  for (auto& item : root.named_modules("", /*include_self=*/false)) {
    auto* lin = item.value()->as<LinearImpl>();
    if (!lin) continue;
    auto ad = adapter_of(*lin);
    if (!ad) continue;
    lin->weight.add_(ad->delta_weight().to(lin->weight.scalar_type()));
    lin->adapter.reset();
    lin->unregister_module("lora_A");
    lin->unregister_module("lora_B");
  }
}

}  // namespace lf::nn
