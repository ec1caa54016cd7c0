#include "loongforge/models/policy/common.h"

#include "loongforge/core/error.h"

namespace lf::models::policy {

std::string shape_str(at::IntArrayRef s) {
  std::string out;
  for (int64_t d : s) out += (out.empty() ? "" : ", ") + std::to_string(d);
  return "[" + out + "]";
}

PolicyFeatures PolicyFeatures::read(const JsonReader& r, const std::string& policy) {
  PolicyFeatures c;
  const JsonReader in = r.object("input_features"), out = r.object("output_features");
  for (const auto& [name, feat] : in.json().items()) {
    const JsonReader f = in.object(name);
    const std::string type = f.string("type");
    const std::vector<int64_t> shape = f.int_list("shape");
    if (type == "VISUAL") {  // LeRobot's image_features: every VISUAL input, in the config's order
      if (shape.size() != 3) f.fail("shape", "expected [channels, height, width]");
      if (!c.image_shape.empty() && c.image_shape != shape)
        f.fail("shape", "every camera needs the same shape (" + policy + "), got " + shape_str(shape) + " and " + shape_str(c.image_shape));
      if (shape[0] != 3) f.fail("shape", "expected 3 (RGB) channels, got " + std::to_string(shape[0]));
      c.image_shape = shape;
      c.cameras.push_back(name);
    } else if (type == "STATE" && name == "observation.state") {
      if (shape.size() != 1) f.fail("shape", "expected [state_dim]");
      c.state_dim = shape[0];
    } else if (type == "ENV") {  // the policy reads it as observation.environment_state
      if (name != "observation.environment_state") in.fail(name, policy + " reads its ENV feature as observation.environment_state");
      if (shape.size() != 1) f.fail("shape", "expected [env_dim]");
      c.env_dim = shape[0];
    }
  }
  const JsonReader a = out.object("action");
  const std::vector<int64_t> shape = a.int_list("shape");
  if (shape.size() != 1 || shape[0] < 1) a.fail("shape", "expected [action_dim]");
  c.action_dim = shape[0];
  if (c.cameras.empty() && c.env_dim == 0)
    r.fail("input_features", policy + " needs at least one observation.images.* camera or observation.environment_state");
  return c;
}

at::Tensor BatchChecker::raw(const std::string& name) const {
  auto it = batch_.find(name);
  return it == batch_.end() ? at::Tensor() : it->second;
}

bool BatchChecker::take(const std::string& name, std::vector<int64_t> want, bool required, Kind kind) {
  auto it = batch_.find(name);
  auto shown = [&] {
    std::vector<int64_t> s = want;
    for (auto& d : s) d = d == kB ? (B_ < 0 ? -1 : B_) : d;
    return shape_str(s);
  };
  if (it == batch_.end()) {
    if (required) throw file_error(file_, name, "missing (expected " + shown() + " with B the batch, -1: any)");
    return false;
  }
  const at::Tensor& t = it->second;
  const bool ok_type = kind == kBool ? t.scalar_type() == at::kBool
                       : kind == kInteger ? at::isIntegralType(t.scalar_type(), false)
                                          : at::isFloatingType(t.scalar_type());
  if (!ok_type)
    throw file_error(file_, name, std::string("expected a ") + (kind == kBool ? "bool" : kind == kInteger ? "integer" : "floating-point") +
                                      " tensor, got " + c10::toString(t.scalar_type()));
  bool ok = t.dim() == static_cast<int64_t>(want.size());
  for (size_t i = 0; ok && i < want.size(); ++i) {
    if (want[i] == kB && B_ < 0) B_ = t.size(i);
    const int64_t w = want[i] == kB ? B_ : want[i];
    ok = w < 0 || t.size(i) == w;
  }
  if (!ok || t.numel() == 0) throw file_error(file_, name, "expected " + shown() + " (-1: any), got " + shape_str(t.sizes()));
  out.set(name, kind == kBool ? t : kind == kInteger ? t.to(at::kLong) : t.to(dtype_));
  return true;
}

std::vector<CheckpointTensor> PolicyModel::checkpoint_tensors() const {
  std::vector<CheckpointTensor> entries = Model::checkpoint_tensors();
  for (const auto& item : named_buffers()) {
    CheckpointTensor e{item.key(), item.key()};
    e.buffer = true;
    entries.push_back(e);
  }
  return entries;
}

nlohmann::json component_parameters(const torch::nn::Module& m, int64_t* total) {
  nlohmann::json comps = nlohmann::json::object();
  *total = 0;
  for (const auto& item : m.named_children()) {
    int64_t n = 0;
    for (const auto& t : item.value()->parameters()) n += t.numel();
    *total += n;
    comps[item.key()] = {{"parameters", n}};
  }
  return comps;
}

}  // namespace lf::models::policy
