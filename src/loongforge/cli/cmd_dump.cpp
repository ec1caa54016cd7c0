// loongforge dump: logits, loss, gradients and optimizer steps of a Hugging Face checkpoint on one batch, written
// to a safetensors file, so users (and our tests) can check parity with transformers tensor by tensor.
#include <ATen/ATen.h>

#include <map>

#include "loongforge/cli/commands.h"
#include "loongforge/core/error.h"
#include "loongforge/io/hf_model.h"
#include "loongforge/io/peft.h"
#include "loongforge/io/safetensors.h"
#include "loongforge/optim/adamw.h"

namespace lf::cli {
namespace {

struct DumpArgs {
  std::string model, batch, out, adamw, lora;
  int64_t steps = 0;
  double clip = 0.0, indexer_loss_coef = 0.0, mtp_loss_weight = 0.0;
  bool indexer_dense_warmup = false;
  std::string dtype = "fp32";
};

void run_dump(const DumpArgs& a) {
  at::ScalarType dtype = a.dtype == "fp64" ? at::kDouble : at::kFloat;
  auto model = io::load_model(a.model, dtype);
  if (const std::string why = model->set_mtp_loss_weight(a.mtp_loss_weight); !why.empty())
    throw Error("dump: --mtp-loss-weight: " + why);
  if (const std::string why = model->set_indexer_training(a.indexer_loss_coef, a.indexer_dense_warmup); !why.empty())
    throw Error(std::string("dump: ") + (a.indexer_dense_warmup && a.indexer_loss_coef == 0 ? "--indexer-dense-warmup" : "--indexer-loss-coef") + ": " + why);
  std::map<std::string, at::Tensor> batch;
  {
    auto f = io::SafetensorsFile::open(a.batch);
    for (const auto& e : f->entries()) batch[e.name] = f->tensor(e.name).clone();
  }

  std::vector<at::Tensor> params;
  std::vector<std::string> names;
  if (a.lora.empty()) {
    // grad.<name> / after_step.<name> under the reference library's parameter names (Model::reference_name); a
    // parameter no single checkpoint tensor names (stacked experts) by reference_name of its module path
    std::map<std::string, std::string> ref;
    for (const auto& e : model->checkpoint_tensors())
      if (e.index < 0 && !e.buffer) ref[e.param] = model->reference_name(e.name);
    for (auto& item : model->named_parameters()) {
      auto it = ref.find(item.key());
      names.push_back(it != ref.end() ? it->second : model->reference_name(item.key()));
      params.push_back(item.value());
    }
  } else {  // only the adapter trains; outputs are deterministic, so adapter dropout is off (eval mode)
    for (auto& p : model->parameters()) p.set_requires_grad(false);
    for (auto& [name, p] : io::load_peft_adapter(a.lora, *model)) {
      p.set_requires_grad(true);
      names.push_back(io::peft_name(name));
      params.push_back(p);
    }
    model->eval();
  }
  io::NamedTensors out;
  // Parameters the loss does not reach (a vision tower's layers past the feature layer) get a zero gradient in the
  // output but, as torch.optim skips parameters without a gradient, no optimizer step (no weight decay).
  std::vector<at::Tensor> reached;
  auto forward_backward = [&]() {
    models::Model::ReferenceOutput r = model->reference_forward(batch, a.batch);
    if (!r.loss.defined())  // denoisers give a loss only against a target
      throw file_error(a.batch, "target", "missing (dump computes the loss and its gradients)");
    r.loss.backward();
    const bool first_call = reached.empty();
    for (auto& p : params) {
      if (p.grad().defined()) {
        if (first_call) reached.push_back(p);
      } else {
        p.mutable_grad() = at::zeros_like(p);
      }
    }
    return r;
  };
  auto first = forward_backward();
  at::Tensor loss = first.loss;
  for (const auto& [n, t] : first.outputs) out.emplace_back(n, t.detach().to(at::kFloat).contiguous());
  out.emplace_back("loss", loss.detach().to(at::kFloat).reshape({1}));
  for (size_t i = 0; i < params.size(); ++i) out.emplace_back("grad." + names[i], params[i].grad().to(at::kFloat).contiguous());

  if (!a.adamw.empty() || a.steps > 0) {
    optim::AdamW opt(reached, a.adamw.empty() ? optim::AdamWOptions{} : optim::AdamWOptions::parse(a.adamw));
    int64_t steps = std::max<int64_t>(a.steps, 1);
    at::Tensor losses = at::empty({steps}, at::kFloat), norms = at::empty({steps}, at::kFloat);
    for (int64_t s = 0; s < steps; ++s) {
      if (s > 0) {
        opt.zero_grad();
        loss = forward_backward().loss;
      }
      losses[s] = loss.item<double>();
      norms[s] = optim::clip_grad_norm(reached, a.steps > 0 ? a.clip : 0.0);
      opt.step();
    }
    for (size_t i = 0; i < params.size(); ++i)
      out.emplace_back("after_step." + names[i], params[i].detach().to(at::kFloat).contiguous());
    if (a.steps > 0) {
      out.emplace_back("losses", losses);
      out.emplace_back("grad_norms", norms);
    }
  }
  io::save_file(a.out, out);
}

}  // namespace

void add_dump(CLI::App& app) {
  auto args = std::make_shared<DumpArgs>();
  auto* sub = app.add_subcommand("dump", "Logits, loss, gradients and AdamW steps of a HF checkpoint on one batch");
  sub->add_option("--model", args->model, "Hugging Face model folder (config.json + safetensors)")->required();
  sub->add_option("--batch", args->batch, "safetensors with input_ids int64 [B,T] and optional labels (-100 ignored)")->required();
  sub->add_option("--out", args->out, "output safetensors: logits, loss, grad.<name>, after_step.<name>, losses, grad_norms")->required();
  sub->add_option("--adamw", args->adamw, "one AdamW step: lr=1e-3,beta1=0.9,beta2=0.95,eps=1e-8,weight_decay=0.1 "
                                          "(weight decay on every parameter; torch's defaults for keys left out)");
  sub->add_option("--steps", args->steps, "N AdamW steps on the same batch (writes losses [N], grad_norms [N])")->check(CLI::NonNegativeNumber);
  sub->add_option("--clip", args->clip, "global gradient-norm clipping before each of the --steps (0: none)")->check(CLI::NonNegativeNumber);
  sub->add_option("--lora", args->lora, "PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors): the base "
                                        "is frozen, grad./after_step. cover the adapter only, named as in adapter_model.safetensors; "
                                        "adapter dropout is disabled so the outputs are deterministic");
  sub->add_option("--mtp-loss-weight", args->mtp_loss_weight, "train the multi-token prediction layers: w / K x their "
                  "depths' losses join the loss (0: as transformers, the main loss alone)")->check(CLI::NonNegativeNumber);
  sub->add_option("--indexer-loss-coef", args->indexer_loss_coef, "train the sparse-attention indexers (DeepSeek-V3.2): "
                  "their KL loss with this weight joins the loss (0: frozen, as transformers)")->check(CLI::NonNegativeNumber);
  sub->add_flag("--indexer-dense-warmup", args->indexer_dense_warmup, "the indexers' warm-up stage: dense attention, only "
                "the indexers trained (needs --indexer-loss-coef)");
  sub->add_option("--dtype", args->dtype, "compute precision on the CPU")->check(CLI::IsMember({"fp32", "fp64"}))->capture_default_str();
  sub->callback([args] { run_dump(*args); });
}

}  // namespace lf::cli
