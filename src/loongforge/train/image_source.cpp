#include "loongforge/train/image_source.h"

#include <ATen/ATen.h>

#include "loongforge/core/error.h"

namespace lf::train {

Batch ImageFolderSource::rows(int64_t first, int64_t n) const {
  std::vector<at::Tensor> imgs;
  std::vector<int64_t> labels;
  for (int64_t k = first; k < first + n; ++k) {
    auto [img, label] = ds_.get(k);
    imgs.push_back(img);
    labels.push_back(label);
  }
  return Batch{{"latents", at::stack(imgs)}, {"class_labels", at::tensor(labels, at::kLong)}};
}

Batch ImageFolderSource::next(int64_t b) {
  Batch out = rows(rows_, b);
  rows_ += b;
  return out;
}

Batch ImageFolderSource::next_rows(int64_t global_rows, int64_t first, int64_t n) {
  if (first < 0 || n < 1 || first + n > global_rows)
    throw Error("batch rows [" + std::to_string(first) + ", " + std::to_string(first + n) + ") outside a batch of " +
                std::to_string(global_rows) + " rows");
  Batch out = rows(rows_ + first, n);
  rows_ += global_rows;
  return out;
}

}  // namespace lf::train
