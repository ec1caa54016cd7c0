// The prompt side of a robot policy's processor (models/policy_io.h): policies that read the task as tokens
// (PolicySpec::language: LeRobot's TokenizerProcessorStep) or as a vision-language chat prompt
// (PolicySpec::vlm_prompt: GR00T's Qwen3-VL prompt with the cameras as images). Shared by the training batch source
// (train/robot_source.h: the dataset's task texts) and deployment (train/policy_runner.h: the request's prompt).
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "loongforge/data/chat_template.h"
#include "loongforge/data/image/processor.h"
#include "loongforge/data/tokenizer/tokenizer.h"
#include "loongforge/models/policy_io.h"
#include "loongforge/train/batch.h"

namespace lf::train {

// The folder of a language policy's tokenizer: CONFIGURED (data.robot.tokenizer) when given, else POLICY_DIR when it
// holds tokenizer.json / tokenizer.model. Errors name the recipe key.
std::string prompt_tokenizer_folder(const std::string& configured, const std::string& policy_dir,
                                    const std::string& model_type);

class PromptEncoder {
 public:
  // For a policy whose spec has `language` or `vlm_prompt` (errors otherwise, and for a folder without what the
  // prompt needs: tokenizer, pad token, chat template, Qwen2VL image processor).
  PromptEncoder(const models::Policy& policy, const models::PolicySpec& spec, const std::string& folder,
                const std::string& model_type);
  ~PromptEncoder();
  static bool needed(const models::PolicySpec& spec) { return spec.language || spec.vlm_prompt.enabled; }
  // Whether training rows crop their frames at a drawn position (GR00T N1.7's albumentations path with a crop).
  static bool draws_crop(const models::PolicySpec& spec) {
    const auto& v = spec.vlm_prompt;
    return v.enabled && v.opencv_area && v.target_height > 0 && v.crop_fraction > 0 && v.crop_fraction < 1;
  }

  // Adds the prompt's tensors for each row's task text to OUT (which holds the rows' normalised features, cameras as
  // float [B, C, H, W] in [0, 1]): observation.language.tokens / .attention_mask, or input_ids, attention_mask,
  // pixel_values and image_grid_thw (the cameras leave the batch: they are in the prompt). CROP [B, 2] (float64, the
  // window's (y, x) position in [0, 1] per row; draws_crop policies' training rows): where each row's frames are
  // cropped; undefined: centred.
  void add(Batch& out, const std::vector<std::string>& tasks, const at::Tensor& crop = {}) const;
  const std::string& folder() const { return folder_; }

 private:
  void add_language(Batch& out, const std::vector<std::string>& prompts) const;
  void add_vlm_prompt(Batch& out, const std::vector<std::string>& prompts, const at::Tensor& crop) const;
  const models::Policy& policy_;
  models::PolicySpec spec_;
  std::string folder_;
  std::shared_ptr<const data::Tokenizer> tokenizer_;
  int64_t pad_id_ = 0;
  std::unique_ptr<data::ChatTemplate> chat_template_;
  data::ChatTemplate::Loaded chat_loaded_;
  std::unique_ptr<data::image::ImageProcessor> image_processor_;
};

}  // namespace lf::train
