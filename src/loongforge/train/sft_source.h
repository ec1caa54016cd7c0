// Batches for supervised fine-tuning from chat jsonl (data/sft_dataset.h), rendered with the model's chat template.
#pragma once
#include <memory>

#include "loongforge/data/image/processor.h"
#include "loongforge/data/sft_dataset.h"
#include "loongforge/train/batch.h"

namespace lf::train {

// Images of a vision-language model's conversations (data/sft_dataset.h): its image token, the tokens per image
// (0: the processor's patch grid), the folder whose preprocessor_config.json says how to preprocess them. Every image
// is read and decoded once when the source is made (data::image::check_image_file), so a bad one is found before
// the first step.
struct SftImages {
  int64_t token_id = -1;  // < 0: text only
  int64_t per_image = 0;
  int64_t start_id = -1, end_id = -1;  // the model's tokens around an image (Qwen's vision start/end; -1: none)
  std::string processor_dir, backend = "pil", image_root;
};

class SftSource : public BatchSource {
 public:
  // template_name: "" (the tokenizer folder's chat_template), a built-in name (chatml, llama3, mistral), or a file.
  // With images, batches carry pixel_values (and image_grid_thw for patch processors) as item fields of their rows.
  SftSource(std::vector<std::string> files, const std::string& tokenizer_dir, const std::string& template_name,
            int64_t seq_len, bool assistant_only_loss, bool packing, uint64_t seed, const SftImages& images = {},
            bool skip_bad_samples = false, int64_t vocab = 0);
  Batch next(int64_t micro_batch_size) override;
  // Converts only rows [first, first + n) to tensors; the others are drawn (packing decides where each sample ends)
  // and dropped.
  Batch next_rows(int64_t global_rows, int64_t first, int64_t n) override;
  // Keeps the drawn samples; take() converts (and preprocesses the images of) only the rows it is given.
  std::vector<data::RowShape> draw(int64_t global_rows) override;
  Batch take(const std::vector<int64_t>& which) override;
  nlohmann::json state() const override;
  void restore(const nlohmann::json& state) override;
  std::optional<Skipped> skipped_samples() const override;

 private:
  Batch to_batch(const std::vector<const data::SftSample*>& rows) const;

  std::vector<data::SftSample> drawn_;
  std::unique_ptr<data::Tokenizer> tok_;
  std::unique_ptr<data::SftDataset> ds_;
  std::unique_ptr<data::image::ImageProcessor> proc_;  // with images
  std::string tokenizer_dir_;
  int64_t vocab_ = 0;  // > 0: token ids at or past it (a tokenizer of another model) are a one-line error
};

// Decodes and preprocesses `paths` (the images of a batch's rows, image_row[i] the row of image i) into item fields of
// `batch`: pixel_values (per image, or per patch with image_grid_thw per image).
void add_images(Batch& batch, const data::image::ImageProcessor& proc, const std::vector<std::string>& paths,
                const std::vector<int64_t>& image_row);

}  // namespace lf::train
