#include "loongforge/train/pretrain_source.h"

#include <ATen/ATen.h>

#include "loongforge/core/error.h"
#include "loongforge/io/safetensors.h"
#include "loongforge/nn/loss.h"

namespace lf::train {

PretrainSource::PretrainSource(data::PretrainOptions opts, bool per_document)
    : ds_(std::move(opts)), per_document_(per_document) {}

namespace {
void check_rows(int64_t global_rows, int64_t first, int64_t n) {
  if (first < 0 || n < 1 || first + n > global_rows)
    throw Error("batch rows [" + std::to_string(first) + ", " + std::to_string(first + n) + ") outside a batch of " +
                std::to_string(global_rows) + " rows");
}
}  // namespace

Batch BatchSource::next_rows(int64_t global_rows, int64_t first, int64_t n) {
  check_rows(global_rows, first, n);
  return next(global_rows).rows(first, n);
}

Batch PretrainSource::next(int64_t b) { return build(ds_.next_batch(static_cast<size_t>(b))); }

Batch PretrainSource::next_rows(int64_t global_rows, int64_t first, int64_t n) {
  check_rows(global_rows, first, n);
  ds_.skip(static_cast<uint64_t>(first));
  Batch out = build(ds_.next_batch(static_cast<size_t>(n)));
  ds_.skip(static_cast<uint64_t>(global_rows - first - n));
  return out;
}

Batch PretrainSource::build(const std::vector<data::Sample>& samples) const {
  const int64_t t = ds_.options().seq_len, b = static_cast<int64_t>(samples.size());
  at::Tensor ids = at::empty({b, t}, at::kLong), tgt = at::empty({b, t}, at::kLong);
  at::Tensor pos, seg;
  if (per_document_) {
    pos = at::empty({b, t}, at::kLong);
    seg = at::empty({b, t}, at::kLong);
  }
  for (int64_t i = 0; i < b; ++i) {
    const auto& s = samples[i].tokens;
    std::copy(s.begin(), s.begin() + t, ids[i].data_ptr<int64_t>());
    std::copy(s.begin() + 1, s.begin() + t + 1, tgt[i].data_ptr<int64_t>());
    if (per_document_) {
      int64_t* p = pos[i].data_ptr<int64_t>();
      int64_t* g = seg[i].data_ptr<int64_t>();
      int64_t start = 0, segment = 0;
      size_t next = 0;
      const auto& starts = samples[i].doc_starts;
      for (int64_t j = 0; j < t; ++j) {
        while (next < starts.size() && starts[next] <= j) {
          if (starts[next] == j && j > 0) start = j, ++segment;
          ++next;
        }
        p[j] = j - start;
        g[j] = segment;
      }
    }
  }
  return token_batch(ids, tgt, pos, seg);
}

nlohmann::json PretrainSource::state() const { return ds_.state().to_json(); }

void PretrainSource::restore(const nlohmann::json& s) { ds_.restore(data::PretrainState::from_json(s, "trainer_state.json data")); }

BatchFileSource::BatchFileSource(const std::string& path) {
  auto f = io::SafetensorsFile::open(path);
  if (!f->contains("input_ids")) throw file_error(path, "input_ids", "missing");
  ids_ = f->tensor("input_ids");
  if (ids_.scalar_type() != at::kLong || ids_.dim() != 2 || ids_.size(0) == 0)
    throw file_error(path, "input_ids", "expected int64 [B,T] with B > 0");
  at::Tensor labels = f->contains("labels") ? f->tensor("labels") : ids_;
  if (labels.sizes() != ids_.sizes() || labels.scalar_type() != at::kLong)
    throw file_error(path, "labels", "expected int64 with the shape of input_ids");
  // transformers' convention: labels align with inputs and shift inside; targets are the shifted labels
  targets_ = nn::next_token_targets(labels);
}

Batch BatchFileSource::next(int64_t b) {
  std::vector<int64_t> rows;
  for (int64_t i = 0; i < b; ++i) rows.push_back((row_ + i) % ids_.size(0));
  row_ = (row_ + b) % ids_.size(0);
  at::Tensor idx = at::tensor(rows, at::kLong);
  return token_batch(ids_.index_select(0, idx), targets_.index_select(0, idx));
}

}  // namespace lf::train
