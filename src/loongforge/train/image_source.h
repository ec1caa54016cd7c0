// Batches of class-labelled images for diffusion training (data/image_folder.h): `latents` float32 [B, 3, R, R]
// (pixel space, in [-1, 1]) and `class_labels` int64 [B], row i of the stream being the folder stream's index i.
#pragma once
#include "loongforge/data/image_folder.h"
#include "loongforge/train/batch.h"

namespace lf::train {

class ImageFolderSource : public IndexedSource {
 public:
  explicit ImageFolderSource(data::ImageFolderOptions o) : ds_(std::move(o)) {}
  const data::ImageFolderDataset& dataset() const { return ds_; }

 protected:
  Batch rows(int64_t first, int64_t n) const override;  // decodes only these rows

 private:
  data::ImageFolderDataset ds_;
};

}  // namespace lf::train
