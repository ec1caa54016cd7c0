#include "loongforge/train/sft_source.h"

#include <ATen/ATen.h>

#include <filesystem>
#include <unordered_map>

#include "loongforge/core/error.h"
#include "loongforge/core/json.h"
#include "loongforge/data/image/decode.h"

namespace lf::train {

SftSource::SftSource(std::vector<std::string> files, const std::string& tokenizer_dir, const std::string& template_name,
                     int64_t seq_len, bool assistant_only_loss, bool packing, uint64_t seed,
                     const SftImages& images, bool skip_bad_samples, int64_t vocab)
    : tokenizer_dir_(tokenizer_dir), vocab_(vocab) {
  if (tokenizer_dir.empty()) throw Error("recipe: field 'model.tokenizer': SFT needs a tokenizer (or model.path)");
  tok_ = data::Tokenizer::load(tokenizer_dir);
  data::SftOptions o;
  o.files = std::move(files);
  o.seq_len = seq_len;
  o.assistant_only_loss = assistant_only_loss;
  o.packing = packing;
  o.seed = seed;
  o.skip_bad = skip_bad_samples;
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
  if (images.token_id >= 0) {
    proc_ = std::make_unique<data::image::ImageProcessor>(data::image::ImageProcessor::from_pretrained(
        images.processor_dir, data::image::backend_from_name(images.backend)));
    o.image_token_id = images.token_id;
    // what "<image>" markers become: the image token, between the model's start / end tokens when it has them
    // (Qwen's <|vision_start|><|image_pad|><|vision_end|>, as its chat template writes an image part)
    o.image_placeholder = tok_->id_to_token(images.token_id);
    if (images.start_id >= 0) o.image_placeholder = tok_->id_to_token(images.start_id) + o.image_placeholder;
    if (images.end_id >= 0) o.image_placeholder += tok_->id_to_token(images.end_id);
    o.image_root = images.image_root;
    const data::image::ImageProcessor* proc = proc_.get();
    const int64_t fixed = images.per_image;
    if (fixed <= 0 && !proc->config().patches())
      throw Error(images.processor_dir + ": the model takes a patch grid's tokens per image, but " +
                  proc->config().class_name + " makes no patches");
    // Each image is decoded once here (without keeping its pixels): one that cannot be read fails before step 1.
    auto known = std::make_shared<std::unordered_map<std::string, data::image::ImageDims>>();
    o.image_tokens = [proc, fixed, known](const std::string& path) -> int64_t {
      auto it = known->find(path);
      if (it == known->end()) it = known->emplace(path, data::image::check_image_file(path)).first;
      if (fixed > 0) return fixed;
      auto [gh, gw] = proc->patch_grid(it->second.height, it->second.width);
      const int64_t m = proc->config().merge_size;
      return gh * gw / (m * m);
    };
  }
  ds_ = std::make_unique<data::SftDataset>(o, *tok_);
}

Batch SftSource::next(int64_t b) { return next_rows(b, 0, b); }

Batch SftSource::next_rows(int64_t global_rows, int64_t first, int64_t b) {
  if (first < 0 || b < 1 || first + b > global_rows)
    throw Error("batch rows [" + std::to_string(first) + ", " + std::to_string(first + b) + ") outside a batch of " +
                std::to_string(global_rows) + " rows");
  for (int64_t i = 0; i < first; ++i) ds_->next();
  std::vector<data::SftSample> samples;
  for (int64_t i = 0; i < b; ++i) samples.push_back(ds_->next());
  for (int64_t i = first + b; i < global_rows; ++i) ds_->next();
  std::vector<const data::SftSample*> rows;
  for (const auto& s : samples) rows.push_back(&s);
  return to_batch(rows);
}

std::vector<data::RowShape> SftSource::draw(int64_t global_rows) {
  if (global_rows < 1) throw Error("a batch of " + std::to_string(global_rows) + " rows");
  drawn_.clear();
  std::vector<data::RowShape> shapes;
  for (int64_t i = 0; i < global_rows; ++i) {
    drawn_.push_back(ds_->next());
    shapes.push_back({drawn_.back().documents, drawn_.back().image_tokens});
  }
  return shapes;
}

Batch SftSource::take(const std::vector<int64_t>& which) {
  std::vector<const data::SftSample*> rows;
  for (int64_t i : which) {
    if (i < 0 || i >= static_cast<int64_t>(drawn_.size()))
      throw Error("row " + std::to_string(i) + " of a draw of " + std::to_string(drawn_.size()) + " rows");
    rows.push_back(&drawn_[static_cast<size_t>(i)]);
  }
  if (rows.empty()) throw Error("take: no rows");
  return to_batch(rows);
}

Batch SftSource::to_batch(const std::vector<const data::SftSample*>& samples) const {
  const int64_t b = static_cast<int64_t>(samples.size());
  const int64_t t = ds_->options().seq_len;
  at::Tensor ids = at::empty({b, t}, at::kLong), tgt = at::empty({b, t}, at::kLong);
  at::Tensor pos = at::empty({b, t}, at::kLong), seg = at::empty({b, t}, at::kLong);
  std::vector<std::string> paths;
  std::vector<int64_t> image_row;
  for (int64_t i = 0; i < b; ++i) {
    const data::SftSample& s = *samples[static_cast<size_t>(i)];
    if (vocab_ > 0)
      for (int64_t id : s.input_ids)
        if (id < 0 || id >= vocab_)
          throw Error(tokenizer_dir_ + ": token id " + std::to_string(id) + " is outside the model's vocabulary of " +
                      std::to_string(vocab_) + " (a tokenizer of another model?)");
    paths.insert(paths.end(), s.images.begin(), s.images.end());
    image_row.insert(image_row.end(), s.images.size(), i);
    std::copy(s.input_ids.begin(), s.input_ids.end(), ids[i].data_ptr<int64_t>());
    std::copy(s.labels.begin(), s.labels.end(), tgt[i].data_ptr<int64_t>());
    std::copy(s.position_ids.begin(), s.position_ids.end(), pos[i].data_ptr<int64_t>());
    std::copy(s.segment_ids.begin(), s.segment_ids.end(), seg[i].data_ptr<int64_t>());
  }
  Batch out = token_batch(ids, tgt, pos, seg);
  if (proc_) add_images(out, *proc_, paths, image_row);
  return out;
}

void add_images(Batch& batch, const data::image::ImageProcessor& proc, const std::vector<std::string>& paths,
                const std::vector<int64_t>& image_row) {
  const at::Tensor rows = at::tensor(image_row, at::kLong);
  if (paths.empty()) {  // no images in these rows: empty item fields keep the schema
    const auto& c = proc.config();
    if (c.patches()) {
      batch.set_items("pixel_values", at::empty({0, 3 * c.temporal_patch_size * c.patch_size * c.patch_size}), rows);
      batch.set_items("image_grid_thw", at::empty({0, 3}, at::kLong), rows);
    }
    return;
  }
  data::image::ProcessedImages px = proc.preprocess_files(paths);
  if (!px.image_grid_thw.defined()) {
    batch.set_items("pixel_values", px.pixel_values, rows);
    return;
  }
  // patches: each patch's row from its image's grid
  const at::Tensor per_image = px.image_grid_thw.prod(1);
  batch.set_items("pixel_values", px.pixel_values, rows.repeat_interleave(per_image));
  batch.set_items("image_grid_thw", px.image_grid_thw, rows);
}

nlohmann::json SftSource::state() const { return ds_->state(); }

void SftSource::restore(const nlohmann::json& s) { ds_->restore(s, "trainer_state.json data"); }

std::optional<BatchSource::Skipped> SftSource::skipped_samples() const {
  if (!ds_->options().skip_bad) return std::nullopt;
  return Skipped{static_cast<int64_t>(ds_->num_skipped()), static_cast<int64_t>(ds_->num_read()), ds_->first_skipped()};
}

}  // namespace lf::train
