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

}  // namespace lf::train
