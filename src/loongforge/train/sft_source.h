// Batches for supervised fine-tuning from chat jsonl (data/sft_dataset.h), rendered with the model's chat template.
#pragma once
#include <memory>

#include "loongforge/data/sft_dataset.h"
#include "loongforge/train/batch.h"

namespace lf::train {

class SftSource : public BatchSource {
 public:
  // template_name: "" (the tokenizer folder's chat_template), a built-in name (chatml, llama3, mistral), or a file.
  SftSource(std::vector<std::string> files, const std::string& tokenizer_dir, const std::string& template_name,
            int64_t seq_len, bool assistant_only_loss, bool packing, uint64_t seed);
  Batch next(int64_t micro_batch_size) override;
  // Converts only rows [first, first + n) to tensors; the others are drawn (packing decides where each sample ends)
  // and dropped.
  Batch next_rows(int64_t global_rows, int64_t first, int64_t n) override;
  nlohmann::json state() const override;
  void restore(const nlohmann::json& state) override;

 private:
  std::unique_ptr<data::Tokenizer> tok_;
  std::unique_ptr<data::SftDataset> ds_;
};

}  // namespace lf::train
