// Data parallelism for one rank: gradient reduction over data-parallel ranks, with flat parameter buffers split
// in shards for ZeRO.
//
// Two groups describe the data-parallel ranks: `shard` (the ranks that split the optimizer state / parameters
// between them) and `replicate` (the ranks that hold identical shards). DDP: replicate = the dp group, shard = a
// group of one. ZeRO-1 / FSDP: shard = the dp group, replicate = a group of one. HSDP: both. Either group may be
// a combined group (dp x cp). Gradients are SUMMED over all of them (never averaged): the trainer divides each
// micro-batch loss by the global number of counted tokens.
//
// Every engine exposes its parameters as flat shards (FlatShard): per flat buffer, this rank's slice of the
// parameters and of the reduced gradients. optim::DataParallelOptimizer steps on those slices.
#pragma once
#include <ATen/core/Tensor.h>

#include <deque>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "loongforge/parallel/comm.h"

namespace lf::parallel {

// This rank's share of one flat buffer: the parameters params[i] lie at offsets[i] of a flat vector of
// shard_size * param.numel() elements (zero padded); this rank owns [shard_rank * k, (shard_rank + 1) * k).
struct FlatShard {
  at::Tensor param;  // [k] this rank's parameter elements (the optimizer updates them in place)
  at::Tensor grad;   // [k] their gradients summed over every data-parallel rank (valid after finish_backward)
  std::vector<size_t> params;    // indices into the engine's names()
  std::vector<int64_t> offsets;  // flat offset of each
  std::vector<int64_t> numels;   // element count of each
  // The part of parameter `param` (index into names()) that this rank owns: shard[shard_offset, +length) =
  // param.flatten()[param_offset, +length).
  struct Piece {
    size_t param;
    int64_t shard_offset, param_offset, length;
  };
  std::vector<Piece> pieces() const;
  int shard_rank = 0, shard_size = 1;
};

// The interface DataParallelOptimizer drives (DDP/ZeRO-1: BucketedDataParallel; ZeRO-3/HSDP: FullyShardedModel).
class GradSync {
 public:
  virtual ~GradSync() = default;
  const std::vector<std::string>& names() const { return names_; }
  const std::vector<std::vector<int64_t>>& shapes() const { return shapes_; }
  std::vector<FlatShard>& shards() { return shards_; }
  const std::vector<FlatShard>& shards() const { return shards_; }
  const Group& shard_group() const { return *shard_; }
  const Group& replicate_group() const { return *replicate_; }

  // Whether the coming backward is the last micro-batch of the step (reduce during it) or not (accumulate
  // locally). Default: true.
  virtual void set_sync(bool last_micro_batch) { sync_ = last_micro_batch; }
  bool sync() const { return sync_; }
  // Call after each backward(): finishes the reductions started during it (idempotent).
  virtual void finish_backward() = 0;
  virtual void zero_grad() = 0;
  // After the optimizer updated the shards: makes the model's parameters current again.
  virtual void after_step() = 0;

 protected:
  std::vector<std::string> names_;
  std::vector<std::vector<int64_t>> shapes_;
  std::vector<FlatShard> shards_;
  const Group* shard_ = nullptr;
  const Group* replicate_ = nullptr;
  bool sync_ = true;
};

// DDP (shard group of one) and ZeRO-1 (shard group > 1). The parameters are copied into flat buckets of at most
// bucket_bytes (in reverse order, as backward produces them) and become views of them; their .grad are views of
// flat gradient buffers, so backward accumulates into the buckets. When the last parameter of a bucket has its
// gradient (post-accumulate hook), the bucket's reduction starts asynchronously (all-reduce over `replicate` for
// DDP; reduce-scatter over `shard` then all-reduce over `replicate` for ZeRO-1) while backward goes on. Buckets
// always start in bucket order, so every rank issues the same collectives in the same order.
// ZeRO-1: after_step() all-gathers the updated shards into the parameters.
class BucketedDataParallel : public GradSync {
 public:
  BucketedDataParallel(std::vector<std::string> names, std::vector<at::Tensor> params, const Group& replicate,
                       const Group& shard, int64_t bucket_bytes = 25 << 20);
  ~BucketedDataParallel() override;
  BucketedDataParallel(const BucketedDataParallel&) = delete;
  BucketedDataParallel& operator=(const BucketedDataParallel&) = delete;

  void set_sync(bool last_micro_batch) override;
  void finish_backward() override;
  void zero_grad() override;
  void after_step() override;
  size_t num_buckets() const { return buckets_.size(); }
  // Buckets whose reduction started from a gradient hook, i.e. during backward (overlap), since construction.
  int64_t started_in_backward() const { return started_in_backward_; }
  // Called by the gradient hooks.
  void grad_ready(size_t param);

 private:
  struct Bucket {
    at::Tensor param_flat, grad_flat;  // [S*k]
    int64_t pending = 0;               // parameters without a gradient yet in this backward
    bool launched = false;
    Pending work;
  };
  void launch(size_t b);
  void launch_ready();
  void reset_counts();
  std::vector<at::Tensor> params_;
  std::vector<size_t> bucket_of_;
  std::vector<at::Tensor> grad_views_;
  std::vector<Bucket> buckets_;
  size_t next_launch_ = 0;
  int64_t started_in_backward_ = 0;
  bool reduced_ = false;  // the synced reduction of the current gradients is done
};

}  // namespace lf::parallel
