#include "loongforge/train/prompt_encoder.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <optional>

#include "loongforge/core/error.h"
#include "loongforge/core/json.h"
#include "loongforge/data/image/resize.h"

namespace lf::train {

namespace fs = std::filesystem;

namespace {

// The pad token's id: tokenizer_config.json's (or special_tokens_map.json's) pad_token, else "<pad>".
int64_t pad_token_id(const data::Tokenizer& tok, const std::string& dir) {
  std::string name = "<pad>", where = dir;
  for (const char* f : {"tokenizer_config.json", "special_tokens_map.json"}) {
    const fs::path p = fs::path(dir) / f;
    if (!fs::is_directory(dir) || !fs::exists(p)) continue;
    const nlohmann::json j = read_json_file(p.string());
    if (!j.contains("pad_token") || j["pad_token"].is_null()) continue;
    const nlohmann::json& v = j["pad_token"];
    if (v.is_string()) name = v.get<std::string>();
    else if (v.is_object() && v.contains("content") && v["content"].is_string()) name = v["content"].get<std::string>();
    else throw file_error(p.string(), "pad_token", "expected a token (a string or {content})");
    where = p.string();
    break;
  }
  const std::optional<int64_t> id = tok.token_to_id(name);
  if (!id) throw file_error(where, "pad_token", "'" + name + "' is not in the tokenizer's vocabulary");
  return *id;
}

}  // namespace

std::string prompt_tokenizer_folder(const std::string& configured, const std::string& policy_dir,
                                    const std::string& model_type) {
  const std::string key = "recipe: field 'data.robot.tokenizer': ";
  if (!configured.empty()) {
    if (!fs::exists(configured)) throw Error(key + configured + " does not exist (a folder with tokenizer.json)");
    return fs::absolute(configured).lexically_normal().string();
  }
  for (const char* f : {"tokenizer.json", "tokenizer.model"})
    if (!policy_dir.empty() && fs::exists(fs::path(policy_dir) / f))
      return fs::absolute(policy_dir).lexically_normal().string();
  throw Error(key + "the " + model_type + " policy reads the task through a tokenizer; give the folder of its " +
              "tokenizer (tokenizer.json) or processor: the policy folder has none");
}

PromptEncoder::PromptEncoder(const models::Policy& policy, const models::PolicySpec& spec, const std::string& folder,
                             const std::string& model_type)
    : policy_(policy), spec_(spec), folder_(folder) {
  if (!needed(spec_)) throw Error("robot data: the " + model_type + " policy reads no prompt");
  if (spec_.language && spec_.vlm_prompt.enabled)
    throw Error("robot data: a policy reads either prompt tokens or a vision-language prompt");
  tokenizer_ = data::Tokenizer::load(folder_);
  pad_id_ = pad_token_id(*tokenizer_, folder_);
  if (spec_.vlm_prompt.enabled) {
    chat_loaded_ = data::ChatTemplate::load_from_folder(folder_);
    chat_template_ = std::make_unique<data::ChatTemplate>(chat_loaded_.source, chat_loaded_.origin);
    image_processor_ = std::make_unique<data::image::ImageProcessor>(
        data::image::ImageProcessor::from_pretrained(folder_, data::image::Backend::torchvision));
    if (!image_processor_->config().patches())
      throw Error("recipe: field 'data.robot.tokenizer': " + folder_ + "'s image processor is " +
                  image_processor_->config().class_name + "; the " + model_type +
                  " policy reads Qwen2VLImageProcessor's patches");
  }
}

PromptEncoder::~PromptEncoder() = default;

void PromptEncoder::add(Batch& out, const std::vector<std::string>& tasks, const at::Tensor& crop) const {
  const std::vector<std::string> prompts = policy_.prompts(tasks, out);
  if (spec_.language) add_language(out, prompts);
  else add_vlm_prompt(out, prompts, crop);
}

namespace {

// A frame (uint8 [H, W, C]) through the policy's image geometry (models/policy_io.h: VlmPrompt). POS: the crop
// window's (y, x) position in [0, 1], or negative: centred.
at::Tensor frame_geometry(at::Tensor x, const models::PolicySpec::VlmPrompt& v, double pos_y, double pos_x) {
  namespace img = data::image;
  if (v.target_height <= 0) return x;
  if (v.letterbox && x.size(0) != x.size(1)) {  // zero padding to a square, the odd pixel after
    const int64_t e = std::max(x.size(0), x.size(1)), ph = e - x.size(0), pw = e - x.size(1);
    x = at::constant_pad_nd(x, {0, 0, pw / 2, pw - pw / 2, ph / 2, ph - ph / 2}, 0).contiguous();
  }
  const int64_t edge = v.resize_edge > 0 ? v.resize_edge : v.target_height;
  const bool crop = v.crop_fraction > 0 && v.crop_fraction < 1;
  if (v.opencv_area) {  // GR00T N1.7's albumentations path (LeRobot's cv2 transform)
    auto shortest = [&](const at::Tensor& f) {
      const int64_t h = f.size(0), w = f.size(1), s = std::min(h, w);
      if (s == edge) return f;
      const double scale = static_cast<double>(edge) / static_cast<double>(s);  // Python's round: ties to even
      return img::resize_opencv_area(f, std::max<int64_t>(1, static_cast<int64_t>(std::nearbyint(static_cast<double>(h) * scale))),
                                     std::max<int64_t>(1, static_cast<int64_t>(std::nearbyint(static_cast<double>(w) * scale))));
    };
    x = shortest(x);
    if (crop) {
      const int64_t h = x.size(0), w = x.size(1);
      const int64_t ch = std::max<int64_t>(1, static_cast<int64_t>(static_cast<double>(h) * v.crop_fraction));
      const int64_t cw = std::max<int64_t>(1, static_cast<int64_t>(static_cast<double>(w) * v.crop_fraction));
      auto offset = [](int64_t room, double p) {
        return p < 0 ? std::max<int64_t>(0, room / 2)
                     : static_cast<int64_t>(std::nearbyint(static_cast<double>(room) * std::clamp(p, 0.0, 1.0)));
      };
      x = x.narrow(0, offset(h - ch, pos_y), ch).narrow(1, offset(w - cw, pos_x), cw).contiguous();
    }
    return shortest(x);
  }
  x = img::resize_torchvision(x, edge, edge, img::Filter::bicubic);
  if (crop) {
    const int64_t ch = std::max<int64_t>(1, std::llround(static_cast<double>(x.size(0)) * v.crop_fraction));
    const int64_t cw = std::max<int64_t>(1, std::llround(static_cast<double>(x.size(1)) * v.crop_fraction));
    x = x.narrow(0, std::max<int64_t>(0, (x.size(0) - ch) / 2), ch)
            .narrow(1, std::max<int64_t>(0, (x.size(1) - cw) / 2), cw)
            .contiguous();
  }
  return img::resize_torchvision(x, v.target_height, v.target_width, img::Filter::bicubic);
}

}  // namespace

void PromptEncoder::add_vlm_prompt(Batch& out, const std::vector<std::string>& prompts, const at::Tensor& crop) const {
  const models::PolicySpec::VlmPrompt& v = spec_.vlm_prompt;
  const int64_t B = static_cast<int64_t>(prompts.size());
  std::vector<std::string> cameras, all;
  for (const auto& f : spec_.inputs)
    if (f.type == "VISUAL") all.push_back(f.name);
  std::sort(all.begin(), all.end());
  cameras = v.cameras.empty() ? all : v.cameras;
  namespace img = data::image;
  // each frame as uint8 [H, W, C] through the policy's geometry (one crop position per row, for all its cameras)
  const at::Tensor pos = crop.defined() ? crop.to(at::kDouble).contiguous() : at::Tensor();
  std::vector<at::Tensor> images;
  for (int64_t r = 0; r < B; ++r)
    for (const auto& cam : cameras) {
      const at::Tensor x = (out.at(cam)[r].to(at::kFloat).clamp(0, 1) * 255).to(at::kByte).permute({1, 2, 0}).contiguous();
      const double py = pos.defined() ? pos[r][0].item<double>() : -1, px = pos.defined() ? pos[r][1].item<double>() : -1;
      images.push_back(frame_geometry(x, v, py, px));
    }
  for (const auto& cam : all) out.set(cam, at::Tensor());
  const img::ProcessedImages px = image_processor_->preprocess(images);
  const int64_t merge = image_processor_->config().merge_size;
  const at::Tensor grid = px.image_grid_thw.to(at::kLong).contiguous();
  // one user message: the images, then the text; each image token expanded to its merged grid
  std::vector<std::vector<int64_t>> rows;
  size_t longest = 0;
  for (int64_t r = 0; r < B; ++r) {
    nlohmann::ordered_json content = nlohmann::ordered_json::array();
    for (size_t k = 0; k < cameras.size(); ++k) content.push_back({{"type", "image"}});
    content.push_back({{"type", "text"}, {"text", prompts[static_cast<size_t>(r)]}});
    nlohmann::ordered_json ctx = {{"messages", {{{"role", "user"}, {"content", content}}}},
                                  {"tools", nullptr},
                                  {"add_generation_prompt", false},
                                  {"bos_token", chat_loaded_.bos_token},
                                  {"eos_token", chat_loaded_.eos_token}};
    const std::vector<int64_t> ids = tokenizer_->encode(chat_template_->render_ordered(ctx), true);
    std::vector<int64_t> row;
    size_t k = 0;
    for (int64_t id : ids) {
      if (id != v.image_token_id) {
        row.push_back(id);
        continue;
      }
      if (k >= cameras.size())
        throw Error("recipe: field 'data.robot.tokenizer': " + chat_loaded_.origin + " writes more image tokens than the " +
                    std::to_string(cameras.size()) + " cameras");
      const int64_t g = r * static_cast<int64_t>(cameras.size()) + static_cast<int64_t>(k++);
      const int64_t n = grid[g][0].item<int64_t>() * grid[g][1].item<int64_t>() * grid[g][2].item<int64_t>() / (merge * merge);
      row.insert(row.end(), static_cast<size_t>(n), id);
    }
    if (k != cameras.size())
      throw Error("recipe: field 'data.robot.tokenizer': " + chat_loaded_.origin + " wrote " + std::to_string(k) +
                  " image tokens (id " + std::to_string(v.image_token_id) + ") for " + std::to_string(cameras.size()) + " cameras");
    longest = std::max(longest, row.size());
    rows.push_back(std::move(row));
  }
  const int64_t L = static_cast<int64_t>(longest);
  at::Tensor ids = at::full({B, L}, pad_id_, at::kLong), mask = at::zeros({B, L}, at::kLong);
  for (int64_t r = 0; r < B; ++r) {
    const auto& row = rows[static_cast<size_t>(r)];
    const int64_t n = static_cast<int64_t>(row.size());
    const int64_t at0 = v.padding_side == "left" ? L - n : 0;
    ids[r].narrow(0, at0, n).copy_(at::tensor(row, at::kLong));
    mask[r].narrow(0, at0, n).fill_(1);
  }
  out.set("input_ids", ids);
  out.set("attention_mask", mask);
  // item fields: the patches and the images of each row
  const int64_t per_row = static_cast<int64_t>(cameras.size());
  const at::Tensor image_row = at::arange(B, at::kLong).repeat_interleave(per_row);
  const at::Tensor patches = (grid.select(1, 0) * grid.select(1, 1) * grid.select(1, 2)).contiguous();
  out.set_items("pixel_values", px.pixel_values.contiguous(), image_row.repeat_interleave(patches));
  out.set_items("image_grid_thw", grid, image_row);
}

void PromptEncoder::add_language(Batch& out, const std::vector<std::string>& prompts) const {
  const int64_t L = spec_.tokenizer_max_length, B = static_cast<int64_t>(prompts.size());
  at::Tensor ids = at::full({B, L}, pad_id_, at::kLong), mask = at::zeros({B, L}, at::kBool);
  for (int64_t r = 0; r < B; ++r) {
    const std::string& text = prompts[static_cast<size_t>(r)];
    std::vector<int64_t> t = tokenizer_->encode(text, true);
    if (static_cast<int64_t>(t.size()) > L) {  // the text's tokens cut on the right, the special tokens around kept
      const std::vector<int64_t> plain = tokenizer_->encode(text, false);
      const size_t extra = t.size() - plain.size();
      size_t p = 0;
      while (p < extra && !std::equal(plain.begin(), plain.end(), t.begin() + static_cast<std::ptrdiff_t>(p))) ++p;
      const size_t keep = static_cast<size_t>(std::max<int64_t>(0, L - static_cast<int64_t>(extra)));
      std::vector<int64_t> cut(t.begin(), t.begin() + static_cast<std::ptrdiff_t>(p));
      cut.insert(cut.end(), plain.begin(), plain.begin() + static_cast<std::ptrdiff_t>(std::min(keep, plain.size())));
      cut.insert(cut.end(), t.begin() + static_cast<std::ptrdiff_t>(p + plain.size()), t.end());
      cut.resize(std::min(cut.size(), static_cast<size_t>(L)));
      t = std::move(cut);
    }
    const int64_t n = static_cast<int64_t>(t.size());
    const int64_t at0 = spec_.padding_side == "left" ? L - n : 0;
    ids[r].narrow(0, at0, n).copy_(at::tensor(t, at::kLong));
    mask[r].narrow(0, at0, n).fill_(true);
  }
  out.set("observation.language.tokens", ids);
  out.set("observation.language.attention_mask", mask);
}

}  // namespace lf::train
