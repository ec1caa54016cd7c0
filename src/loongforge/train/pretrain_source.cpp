#include "loongforge/train/pretrain_source.h"

#include <ATen/ATen.h>

#include "loongforge/core/error.h"
#include "loongforge/io/safetensors.h"
#include "loongforge/nn/loss.h"

namespace lf::train {

PretrainSource::PretrainSource(data::PretrainOptions opts, bool per_document, int64_t vocab)
    : ds_(std::move(opts)), per_document_(per_document), vocab_(vocab) {}

namespace {
void check_rows(int64_t global_rows, int64_t first, int64_t n) {
  if (first < 0 || n < 1 || first + n > global_rows)
    throw Error("batch rows [" + std::to_string(first) + ", " + std::to_string(first + n) + ") outside a batch of " +
                std::to_string(global_rows) + " rows");
}
}  // namespace

Batch IndexedSource::next(int64_t b) {
  Batch out = rows(rows_, b);
  rows_ += b;
  return out;
}

Batch IndexedSource::next_rows(int64_t global_rows, int64_t first, int64_t n) {
  if (first < 0 || n < 1 || first + n > global_rows)
    throw Error("batch rows [" + std::to_string(first) + ", " + std::to_string(first + n) + ") outside a batch of " +
                std::to_string(global_rows) + " rows");
  Batch out = rows(rows_ + first, n);
  rows_ += global_rows;
  return out;
}

Batch BatchSource::next_rows(int64_t global_rows, int64_t first, int64_t n) {
  check_rows(global_rows, first, n);
  return next(global_rows).rows(first, n);
}

std::vector<data::RowShape> BatchSource::draw(int64_t global_rows) {
  if (global_rows < 1) throw Error("a batch of " + std::to_string(global_rows) + " rows");
  drawn_ = next(global_rows);
  const int64_t n = drawn_.num_rows();
  std::vector<data::RowShape> shapes(static_cast<size_t>(n));
  const at::Tensor seg = drawn_.get("segment_ids");
  const at::Tensor ids = drawn_.get("input_ids");
  for (int64_t r = 0; r < n; ++r) {
    auto& docs = shapes[static_cast<size_t>(r)].documents;
    if (!seg.defined()) {
      if (ids.defined() && ids.dim() >= 2) docs.push_back(ids.size(1));
      continue;
    }
    const at::Tensor row = seg[r].to(at::kLong).contiguous();
    const int64_t* p = row.data_ptr<int64_t>();
    for (int64_t i = 0, len = row.numel(); i < len;) {
      int64_t j = i;
      while (j < len && p[j] == p[i]) ++j;
      docs.push_back(j - i);
      i = j;
    }
  }
  return shapes;
}

Batch BatchSource::take(const std::vector<int64_t>& which) {
  const int64_t n = drawn_.num_rows();
  std::vector<Batch> parts;  // runs of consecutive rows
  for (size_t i = 0; i < which.size();) {
    if (which[i] < 0 || which[i] >= n)
      throw Error("row " + std::to_string(which[i]) + " of a draw of " + std::to_string(n) + " rows");
    size_t j = i + 1;
    while (j < which.size() && which[j] == which[j - 1] + 1 && which[j] < n) ++j;
    parts.push_back(drawn_.rows(which[i], static_cast<int64_t>(j - i)));
    i = j;
  }
  if (parts.empty()) throw Error("take: no rows");
  return parts.size() == 1 ? parts.front() : Batch::concat(parts);
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
    if (vocab_ > 0)
      for (int64_t id : s)
        if (id < 0 || id >= vocab_) {
          const auto& src = ds_.options().sources.at(samples[i].source);
          throw Error(src.prefix + ".bin: token id " + std::to_string(id) + " is outside the model's vocabulary of " +
                      std::to_string(vocab_) + " (data tokenized for another model?)");
        }
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

BatchFileSource::BatchFileSource(const std::string& path) : path_(path) {
  auto f = io::SafetensorsFile::open(path);
  const bool tokens = f->contains("input_ids");
  rows_ = -1;
  if (tokens) {
    const at::Tensor ids = f->tensor("input_ids").clone();
    if (ids.scalar_type() != at::kLong || ids.dim() != 2 || ids.size(0) == 0)
      throw file_error(path, "input_ids", "expected int64 [B,T] with B > 0");
    at::Tensor labels = f->contains("labels") ? f->tensor("labels") : ids;
    if (labels.sizes() != ids.sizes() || labels.scalar_type() != at::kLong)
      throw file_error(path, "labels", "expected int64 with the shape of input_ids");
    rows_ = ids.size(0);
    // transformers' convention: labels align with inputs and shift inside; targets are the shifted labels
    all_ = token_batch(ids, nn::next_token_targets(labels));
  } else {
    // a batch of the model's own named tensors (a diffusion model's hidden_states, timestep, ...): the rows are the
    // first per-row tensor's
    for (const auto& e : f->entries())
      if (!Batch::is_item_index(e.name) && !f->contains(e.name + ".row") && e.name.rfind("negative_", 0) != 0 &&
          rows_ < 0) {
        if (e.shape.empty() || e.shape[0] == 0) throw file_error(path, e.name, "expected [B, ...] with B > 0");
        rows_ = e.shape[0];
      }
    if (rows_ < 0) throw file_error(path, "", "no per-row tensor (expected input_ids, or the model's batch tensors)");
  }
  // Other tensors the model's schema may read (pixel_values, image_grid_thw, ...): per row, or per item with
  // <name>.row saying each item's row (non-decreasing).
  for (const auto& e : f->entries()) {
    const std::string& n = e.name;
    if ((tokens && (n == "input_ids" || n == "labels")) || Batch::is_item_index(n)) continue;
    const at::Tensor t = f->tensor(n).clone();
    if (n.rfind("negative_", 0) == 0) {  // a condition's "no condition" value, one row (null_conditions)
      if (t.dim() == 0 || t.size(0) != 1) throw file_error(path, n, "expected one row [1, ...]");
      null_[n.substr(9)] = t;
      continue;
    }
    if (f->contains(n + ".row")) {
      const at::Tensor r = f->tensor(n + ".row").clone();
      if (r.scalar_type() != at::kLong || r.dim() != 1 || r.size(0) != t.size(0) ||
          (r.numel() && (r.min().item<int64_t>() < 0 || r.max().item<int64_t>() >= rows_ ||
                         (r.numel() > 1 && (r.diff() < 0).any().item<bool>()))))
        throw file_error(path, n + ".row", "expected int64 [" + std::to_string(t.size(0)) +
                                               "] of non-decreasing rows in [0, " + std::to_string(rows_) + ")");
      all_.set_items(n, t, r);
    } else {
      if (t.dim() == 0 || t.size(0) != rows_)
        throw file_error(path, n, "expected " + std::to_string(rows_) + " rows (or a " + n + ".row tensor)");
      all_.set(n, t);
    }
  }
}

Batch BatchFileSource::next(int64_t b) {
  std::vector<Batch> parts;  // the rows from row_ on, wrapping around
  for (int64_t need = b; need > 0;) {
    const int64_t n = std::min(need, rows_ - row_);
    parts.push_back(all_.rows(row_, n));
    row_ = (row_ + n) % rows_;
    need -= n;
  }
  return Batch::concat(parts);
}

}  // namespace lf::train
