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

Batch LatentShardSource::next(int64_t b) {
  Batch out = rows(rows_, b);
  rows_ += b;
  return out;
}

Batch LatentShardSource::next_rows(int64_t global_rows, int64_t first, int64_t n) {
  if (first < 0 || n < 1 || first + n > global_rows)
    throw Error("batch rows [" + std::to_string(first) + ", " + std::to_string(first + n) + ") outside a batch of " +
                std::to_string(global_rows) + " rows");
  Batch out = rows(rows_ + first, n);
  rows_ += global_rows;
  return out;
}

}  // namespace lf::train
