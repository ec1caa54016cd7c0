#include "loongforge/train/sft_source.h"

#include <ATen/ATen.h>

#include <filesystem>

#include "loongforge/core/error.h"
#include "loongforge/core/json.h"

namespace lf::train {

SftSource::SftSource(std::vector<std::string> files, const std::string& tokenizer_dir, const std::string& template_name,
                     int64_t seq_len, bool assistant_only_loss, bool packing, uint64_t seed) {
  if (tokenizer_dir.empty()) throw Error("recipe: field 'model.tokenizer': SFT needs a tokenizer (or model.path)");
  tok_ = data::Tokenizer::load(tokenizer_dir);
  data::SftOptions o;
  o.files = std::move(files);
  o.seq_len = seq_len;
  o.assistant_only_loss = assistant_only_loss;
  o.packing = packing;
  o.seed = seed;
  // bos/eos strings come from the tokenizer folder's tokenizer_config.json when it has one
  std::string folder = std::filesystem::is_directory(tokenizer_dir) ? tokenizer_dir
                                                                     : std::filesystem::path(tokenizer_dir).parent_path().string();
  if (template_name.empty()) {
    auto loaded = data::ChatTemplate::load_from_folder(folder);
    o.chat_template = loaded.source;
    o.template_origin = loaded.origin;
    o.bos_token = loaded.bos_token;
    o.eos_token = loaded.eos_token;
  } else {
    if (std::filesystem::exists(template_name)) {
      o.chat_template = read_text_file(template_name);
      o.template_origin = template_name;
    } else {
      o.chat_template = data::ChatTemplate::builtin(template_name);
      o.template_origin = "builtin:" + template_name;
    }
    try {
      auto loaded = data::ChatTemplate::load_from_folder(folder);
      o.bos_token = loaded.bos_token;
      o.eos_token = loaded.eos_token;
    } catch (const Error&) {  // no template in the folder: fine, we have one
    }
  }
  ds_ = std::make_unique<data::SftDataset>(o, *tok_);
}

Batch SftSource::next(int64_t b) { return next_rows(b, 0, b); }

Batch SftSource::next_rows(int64_t global_rows, int64_t first, int64_t b) {
  if (first < 0 || b < 1 || first + b > global_rows)
    throw Error("batch rows [" + std::to_string(first) + ", " + std::to_string(first + b) + ") outside a batch of " +
                std::to_string(global_rows) + " rows");
  for (int64_t i = 0; i < first; ++i) ds_->next();
  const int64_t t = ds_->options().seq_len;
  at::Tensor ids = at::empty({b, t}, at::kLong), tgt = at::empty({b, t}, at::kLong);
  at::Tensor pos = at::empty({b, t}, at::kLong), seg = at::empty({b, t}, at::kLong);
  for (int64_t i = 0; i < b; ++i) {
    data::SftSample s = ds_->next();
    std::copy(s.input_ids.begin(), s.input_ids.end(), ids[i].data_ptr<int64_t>());
    std::copy(s.labels.begin(), s.labels.end(), tgt[i].data_ptr<int64_t>());
    std::copy(s.position_ids.begin(), s.position_ids.end(), pos[i].data_ptr<int64_t>());
    std::copy(s.segment_ids.begin(), s.segment_ids.end(), seg[i].data_ptr<int64_t>());
  }
  for (int64_t i = first + b; i < global_rows; ++i) ds_->next();
  return token_batch(ids, tgt, pos, seg);
}

nlohmann::json SftSource::state() const { return ds_->state(); }

void SftSource::restore(const nlohmann::json& s) { ds_->restore(s, "trainer_state.json data"); }

}  // namespace lf::train
