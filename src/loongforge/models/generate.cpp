#include "loongforge/models/generate.h"

#include "loongforge/core/error.h"
#include "loongforge/models/llama/model.h"
#include "loongforge/models/llama/mtp.h"
#include "loongforge/models/vlm/base.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <type_traits>

namespace lf::models {

int64_t sample_token(const at::Tensor& logits, double temperature, double top_p, at::Generator& gen) {
  at::Tensor l = logits.to(at::kFloat);
  if (temperature <= 0) return l.argmax().item<int64_t>();
  l = l / temperature;
  if (top_p < 1.0) {
    // Sort ascending; drop the tokens whose cumulative probability stays within 1 - top_p (keep at least one).
    auto [sorted, idx] = l.sort(/*dim=*/-1, /*descending=*/false);
    at::Tensor cum = sorted.softmax(-1).cumsum(-1);
    at::Tensor remove = cum <= (1 - top_p);
    remove.index_put_({-1}, false);
    at::Tensor mask = at::zeros_like(remove).scatter(-1, idx, remove);
    l = l.masked_fill(mask, -std::numeric_limits<float>::infinity());
  }
  at::Tensor probs = l.softmax(-1);
  return at::multinomial(probs, 1, false, gen).item<int64_t>();
}

namespace {
// The decoder LM behind `any` (const or not), or one line naming the family that cannot generate.
template <class M>
auto& lm_of(M& any) {
  using LM = std::conditional_t<std::is_const_v<M>, const llama::CausalLMImpl, llama::CausalLMImpl>;
  using VLM = std::conditional_t<std::is_const_v<M>, const vlm::VisionLanguageModel, vlm::VisionLanguageModel>;
  auto* lm = dynamic_cast<LM*>(&any);
  if (auto* v = dynamic_cast<VLM*>(&any)) lm = v->language_model.get();
  if (!lm) throw Error("generate: the " + any.family() + " family (" + any.model_type() + ") does not generate text");
  return *lm;
}
}  // namespace

std::vector<int64_t> expand_image_tokens(const Model& model, const std::vector<int64_t>& prompt,
                                         const std::vector<int64_t>& run) {
  const auto it = model.image_tokens();  // the contract's image token and markers
  if (!it) throw Error("generate: the " + model.family() + " family (" + model.model_type() + ") takes no images");
  const int64_t id = it->token_id, images = static_cast<int64_t>(run.size());
  int64_t total = 0;
  for (int64_t n : run) total += n;
  const int64_t found = std::count(prompt.begin(), prompt.end(), id);
  if (found == total) return prompt;
  std::vector<int64_t> out;
  if (found == 0) {
    for (int64_t n : run) {
      if (it->start_id >= 0) out.push_back(it->start_id);
      out.insert(out.end(), n, id);
      if (it->end_id >= 0) out.push_back(it->end_id);
    }
  } else if (found != images) {
    throw Error("generate: the prompt has " + std::to_string(found) + " image tokens (id " + std::to_string(id) +
                ") for " + std::to_string(images) + " images: give one per image, the full runs (" +
                std::to_string(total) + " in all), or none");
  }
  size_t image = 0;
  for (int64_t t : prompt) {
    if (t == id) out.insert(out.end(), run[image++], id);
    else out.push_back(t);
  }
  return out;
}

int64_t vocab_size(const Model& model) { return lm_of(model).config().vocab_size; }
std::vector<int64_t> eos_token_ids(const Model& model) { return lm_of(model).config().eos_token_ids; }

std::vector<int64_t> generate(Model& any, const std::vector<int64_t>& prompt, const GenerateOptions& opts,
                              const std::function<void(int64_t)>& on_token) {
  llama::CausalLMImpl& model = lm_of(any);
  at::NoGradGuard no_grad;
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(opts.seed);
  nn::KVCache cache = model.new_cache();
  std::vector<int64_t> out;
  auto device = model.output_weight().device();
  at::Tensor ids = at::tensor(prompt, at::TensorOptions().dtype(at::kLong)).unsqueeze(0).to(device);
  auto* vlm = dynamic_cast<vlm::VisionLanguageModel*>(&any);
  if (!opts.images.empty() && !vlm)
    throw Error("generate: the " + any.family() + " family (" + any.model_type() + ") takes no images");
  if (opts.mtp) {  // speculative decoding with the multi-token prediction layers (llama/mtp.h)
    if (vlm) throw Error("generate --mtp: the " + any.model_type() + " model has no multi-token prediction layers");
    return llama::generate_with_mtp(model, prompt, opts, on_token);
  }
  int64_t next_position = 0, planes = 0;  // a VLM's positions go on from its prompt's (multimodal RoPE)
  for (int64_t i = 0; i < opts.max_new_tokens; ++i) {
    at::Tensor h;
    if (i == 0 && vlm) {  // the prompt: image features in its image tokens, the model's positions
      Batch prompt_batch = opts.images.map([&](const std::string&, const at::Tensor& t) { return t.to(device); });
      prompt_batch.set("input_ids", ids);
      auto pf = vlm->prefill(prompt_batch, cache);
      h = pf.hidden;
      next_position = pf.next_position;
      planes = pf.planes;
    } else if (vlm) {
      at::Tensor pos = at::full(planes ? std::vector<int64_t>{planes, 1, 1} : std::vector<int64_t>{1, 1},
                                next_position++, ids.options());
      h = model.hidden_states(ids, pos, &cache);
    } else {
      h = model.hidden_states(ids, {}, &cache);
    }
    at::Tensor logits = model.logits(h.select(1, h.size(1) - 1)).squeeze(0).to(at::kCPU);
    int64_t next = sample_token(logits, opts.temperature, opts.top_p, gen);
    out.push_back(next);
    if (on_token) on_token(next);
    if (std::find(opts.stop_ids.begin(), opts.stop_ids.end(), next) != opts.stop_ids.end()) break;
    ids = at::full({1, 1}, next, at::TensorOptions().dtype(at::kLong).device(device));
  }
  return out;
}

}  // namespace lf::models
