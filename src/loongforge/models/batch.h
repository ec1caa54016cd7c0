// A batch as every family and engine sees it: named tensors whose first dimension is the row (sample). Which names a
// family reads is its schema (Model::batch_schema); engines split rows (data parallelism, micro-batches, CPU thread
// splits), cut the sequence dimension of the schema's `sequence` fields (context parallelism) and move tensors to
// the device without knowing what the tensors mean.
#pragma once
#include <ATen/core/Tensor.h>

#include <functional>
#include <initializer_list>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace lf::models {

class Batch {
 public:
  Batch() = default;
  // Undefined tensors are left out (an optional field that is absent).
  Batch(std::initializer_list<std::pair<const std::string, at::Tensor>> fields);

  bool has(const std::string& name) const { return t_.count(name) > 0; }
  // The tensor `name`; lf::Error naming it when the batch has none.
  const at::Tensor& at(const std::string& name) const;
  // The tensor `name`, or an undefined tensor.
  at::Tensor get(const std::string& name) const;
  // Sets `name` (an undefined tensor removes it).
  void set(const std::string& name, at::Tensor t);
  bool empty() const { return t_.empty(); }
  // Rows of the batch: dim 0 of its row tensors (0 when there are none).
  int64_t num_rows() const;
  // Item fields: a tensor whose dim 0 runs over items of the rows (images of the samples, patches) rather than over
  // rows, with `<name>.row` [items] (int64, non-decreasing) saying which row each item belongs to. Engines treat
  // them like the rest; rows() keeps the items of the rows it keeps.
  void set_items(const std::string& name, at::Tensor items, at::Tensor row_of_item);
  static bool is_item_index(const std::string& name) { return name.ends_with(".row"); }
  bool is_item_field(const std::string& name) const { return t_.count(name + ".row") > 0; }
  // Rows [first, first + n) of every tensor (views; item fields: their items of those rows, renumbered from 0).
  Batch rows(int64_t first, int64_t n) const;
  // Batches one after another (rows of the second after those of the first; item fields renumbered). Every batch
  // must have the same fields.
  static Batch concat(const std::vector<Batch>& parts);
  // Every tensor through f (name, tensor) -> tensor.
  Batch map(const std::function<at::Tensor(const std::string&, const at::Tensor&)>& f) const;
  const std::map<std::string, at::Tensor>& tensors() const { return t_; }

 private:
  std::map<std::string, at::Tensor> t_;
};

// One field of a family's batch schema.
struct BatchField {
  std::string name;
  at::ScalarType dtype = at::kLong;
  int64_t dims = 2;        // rank of the tensor ([B,T] = 2)
  bool required = true;
  bool sequence = false;   // dim 1 is the sequence: context parallelism gives each rank its part
  bool positions = false;  // positions along the sequence; absent: 0..T-1 (context parallelism fills it in first)
  std::string doc;
};
using BatchSchema = std::vector<BatchField>;
// A required field that is not a sequence (a diffusion model's latents, timesteps, conditions).
inline BatchField required_field(std::string name, at::ScalarType dtype, int64_t dims, std::string doc) {
  BatchField f;
  f.name = std::move(name);
  f.dtype = dtype;
  f.dims = dims;
  f.doc = std::move(doc);
  return f;
}
// An optional field (images and the like: item fields, not sequences).
inline BatchField optional_field(std::string name, at::ScalarType dtype, int64_t dims, std::string doc) {
  BatchField f;
  f.name = std::move(name);
  f.dtype = dtype;
  f.dims = dims;
  f.required = false;
  f.doc = std::move(doc);
  return f;
}

}  // namespace lf::models
