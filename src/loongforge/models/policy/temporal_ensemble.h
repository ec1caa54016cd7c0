// ACT's temporal ensembling at inference (LeRobot's ACTTemporalEnsembler; Algorithm 2 of the ACT paper): the policy
// predicts a whole chunk every step (n_action_steps 1) and the action executed at step t is the weighted average of
// every chunk's prediction for t, w_i = exp(-coeff * i) with i = 0 the oldest prediction (coeff > 0 favours older
// ones, 0 weighs all alike, < 0 favours newer ones). Online, as LeRobot computes it: each pending step keeps the
// running average and how many predictions it holds (up to chunk_size); a new chunk updates
//   avg <- (avg * W[n - 1] + a * w[n]) / W[n]   (W the cumulative sums of w, n the predictions held so far)
// for the steps already pending, appends its last step, and the first pending step is returned and dropped. The
// weights are float32 as LeRobot's; the running average keeps the chunks' dtype.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>

namespace lf::models::policy {

class TemporalEnsembler {
 public:
  TemporalEnsembler(double coeff, int64_t chunk_size);
  // Feeds the chunk predicted at this step, actions [B, chunk_size, A] (every call the same B and A), and returns the
  // action to execute now [B, A]. lf::Error on a wrong shape.
  at::Tensor update(const at::Tensor& actions);
  // Forgets the pending steps (a new episode).
  void reset();
  // Steps with a running average (0 after reset, chunk_size - 1 after any update).
  int64_t pending() const { return avg_.defined() ? avg_.size(1) : 0; }
  int64_t chunk_size() const { return chunk_; }

 private:
  int64_t chunk_;
  at::Tensor weights_, cumsum_;  // float32 [chunk_size]: w_i and its cumulative sums
  at::Tensor avg_;               // [B, pending, A]
  at::Tensor count_;             // int64 [pending]: predictions averaged into each pending step
};

}  // namespace lf::models::policy
