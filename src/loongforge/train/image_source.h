// Batches of class-labelled images for diffusion training (data/image_folder.h): `latents` float32 [B, 3, R, R]
// (pixel space, in [-1, 1]) and `class_labels` int64 [B], row i of the stream being the folder stream's index i.
#pragma once
#include "loongforge/data/image_folder.h"
#include "loongforge/train/batch.h"

namespace lf::train {

class ImageFolderSource : public BatchSource {
 public:
  explicit ImageFolderSource(data::ImageFolderOptions o) : ds_(std::move(o)) {}
  Batch next(int64_t micro_batch_size) override;
  Batch next_rows(int64_t global_rows, int64_t first, int64_t n) override;  // decodes only rows [first, first + n)
  nlohmann::json state() const override { return {{"rows", rows_}}; }
  void restore(const nlohmann::json& state) override { rows_ = state.at("rows").get<int64_t>(); }
  const data::ImageFolderDataset& dataset() const { return ds_; }

 private:
  Batch rows(int64_t first, int64_t n) const;
  data::ImageFolderDataset ds_;
  int64_t rows_ = 0;
};

}  // namespace lf::train
