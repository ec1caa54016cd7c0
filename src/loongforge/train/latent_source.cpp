#include "loongforge/train/latent_source.h"

#include <ATen/ATen.h>

#include "loongforge/core/error.h"

namespace lf::train {

Batch LatentShardSource::rows(int64_t first, int64_t n) const {
  std::map<std::string, std::vector<at::Tensor>> cols;
  for (int64_t k = first; k < first + n; ++k)
    for (auto& [name, t] : ds_.get(k)) cols[name].push_back(t);
  Batch out;
  for (auto& [name, ts] : cols) {
    if (static_cast<int64_t>(ts.size()) != n)
      throw file_error(ds_.last_file(), name, "held by some rows only (shards of different kinds mixed)");
    out.set(name, at::stack(ts));
  }
  return out;
}

}  // namespace lf::train
