// Pieces LeRobot's policies share here: their input / output features read from config.json, the check of a batch
// as LeRobot's policy.forward receives it, and the checkpoint entries of a policy's buffers.
#pragma once
#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <map>
#include <string>
#include <vector>

#include "loongforge/core/json.h"
#include "loongforge/models/batch.h"
#include "loongforge/models/model.h"
#include "loongforge/models/policy_io.h"
#include "loongforge/models/whole_model.h"

namespace lf::models::policy {

std::string shape_str(at::IntArrayRef s);

// The features of input_features / output_features: observation.state (STATE), observation.environment_state (ENV),
// the cameras (every VISUAL input, in the config's order; all [3, H, W] of one shape) and action. `policy` names
// the policy in errors.
struct PolicyFeatures {
  int64_t state_dim = 0, env_dim = 0, action_dim = 0;  // 0: the feature is absent
  std::vector<std::string> cameras;
  std::vector<int64_t> image_shape;  // [C, H, W] of the cameras
  static PolicyFeatures read(const JsonReader& r, const std::string& policy);
};

// Checks a dump batch's tensors (names, dtypes, shapes; errors name `file` and the tensor) and collects them cast to
// the model's floating dtype (integers to int64).
class BatchChecker {
 public:
  enum Kind { kFloat, kBool, kInteger };
  BatchChecker(const std::map<std::string, at::Tensor>& batch, std::string file, at::ScalarType dtype)
      : batch_(batch), file_(std::move(file)), dtype_(dtype) {}
  // `want`: the shape, -1 for any size; want[0] < -1 is the batch size B (the first tensor taken fixes it), other
  // dims given as they must be. Returns whether the tensor is present.
  bool take(const std::string& name, std::vector<int64_t> want, bool required, Kind kind = kFloat);
  // The tensor `name` as given (unchecked), undefined when absent.
  at::Tensor raw(const std::string& name) const;
  static constexpr int64_t kB = -2;  // the batch-size placeholder in `want`
  Batch out;
  int64_t batch_size() const { return B_; }
  const std::string& file() const { return file_; }

 private:
  const std::map<std::string, at::Tensor>& batch_;
  std::string file_;
  at::ScalarType dtype_;
  int64_t B_ = -1;
};

// What every LeRobot policy here shares on the model contract (and its policy side, models/policy_io.h): family
// "policy", LeRobot's config.json (no dtype field), one loss term per row (unless the policy says otherwise), its buffers (frozen or running batch-norm statistics, fixed grids) in the checkpoint
// under their module paths as LeRobot's state_dict has them.
class PolicyModel : public WholeModel, public Policy {
 public:
  explicit PolicyModel(nlohmann::json config) : config_json_(std::move(config)) {}
  std::string family() const override { return "policy"; }
  const nlohmann::json& config_json() const override { return config_json_; }
  int64_t loss_terms(const Batch& b) const override { return b.num_rows(); }
  // ATen's CPU convolutions give wrong weight gradients when several threads run backward at once
  bool thread_split_safe() const override { return false; }
  std::vector<CheckpointTensor> checkpoint_tensors() const override;
  bool config_records_dtype() const override { return false; }

 private:
  nlohmann::json config_json_;
};

// `info`'s parameter counts: {child: {parameters: n}} over the module's children; their sum in `total`.
nlohmann::json component_parameters(const torch::nn::Module& m, int64_t* total);

}  // namespace lf::models::policy
