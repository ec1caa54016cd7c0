// The "shapes" synthetic task of the vision-language demo (data/synthetic.h).
#include <ATen/ATen.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "loongforge/core/error.h"
#include "loongforge/core/json.h"
#include "loongforge/data/image/decode.h"
#include "loongforge/data/synthetic.h"

namespace lf::data {

namespace {

constexpr int kSize = 56;
struct Colour {
  const char* name;
  uint8_t r, g, b;
};
constexpr Colour kColours[] = {{"red", 220, 40, 40}, {"green", 40, 200, 60}, {"blue", 50, 90, 235}, {"yellow", 230, 210, 40}};
constexpr const char* kShapes[] = {"circle", "square", "triangle"};

// One image: the shape's colour and kind drawn at a random place and size on a noisy dark background.
at::Tensor draw(std::mt19937_64& rng, int colour, int shape) {
  std::uniform_int_distribution<int> bg(15, 70), noise(-12, 12), centre(25, 31), radius(13, 18);
  at::Tensor img = at::empty({kSize, kSize, 3}, at::kByte);
  uint8_t* p = img.mutable_data_ptr<uint8_t>();
  const int base[3] = {bg(rng), bg(rng), bg(rng)};
  const int cx = centre(rng), cy = centre(rng), r = radius(rng);
  const Colour& c = kColours[colour];
  for (int y = 0; y < kSize; ++y) {
    for (int x = 0; x < kSize; ++x) {
      const double dx = x - cx, dy = y - cy;
      bool in = false;
      if (shape == 0) in = dx * dx + dy * dy <= r * r;
      else if (shape == 1) in = std::abs(dx) <= 0.8 * r && std::abs(dy) <= 0.8 * r;
      else in = dy >= -r && dy <= 0.8 * r && std::abs(dx) <= 0.62 * (dy + r);  // apex up
      const uint8_t shade[3] = {c.r, c.g, c.b};
      for (int k = 0; k < 3; ++k) {
        const int v = (in ? shade[k] : base[k]) + noise(rng);
        p[(y * kSize + x) * 3 + k] = static_cast<uint8_t>(std::clamp(v, 0, 255));
      }
    }
  }
  return img;
}

}  // namespace

void write_shapes_task(const std::string& out_dir, int64_t docs, uint64_t seed) {
  namespace fs = std::filesystem;
  fs::create_directories(fs::path(out_dir) / "images");
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> pick_colour(0, 3), pick_shape(0, 2), pick_question(0, 9);
  nlohmann::json train = nlohmann::json::array();
  std::ostringstream test;
  for (int64_t i = 0; i < docs + 20; ++i) {
    const int c = pick_colour(rng), s = pick_shape(rng);
    char name[32];
    std::snprintf(name, sizeof name, "images/%05lld.png", static_cast<long long>(i));
    image::write_png((fs::path(out_dir) / name).string(), draw(rng, c, s));
    const std::string answer = std::string("a ") + kColours[c].name + " " + kShapes[s];
    if (i >= docs) {  // held out: the demo asks the full question
      test << name << "\t" << answer << "\n";
      continue;
    }
    // mostly the full question, sometimes colour or shape alone
    const int q = pick_question(rng);
    std::string question = "what shape and colour?", reply = answer;
    if (q == 8) question = "what colour?", reply = kColours[c].name;
    if (q == 9) question = "what shape?", reply = kShapes[s];
    train.push_back({{"id", i},
                     {"image", name},
                     {"conversations",
                      {{{"from", "human"}, {"value", "<image>\n" + question}}, {{"from", "gpt"}, {"value", reply}}}}});
  }
  write_file_atomic((fs::path(out_dir) / "train.json").string(), train.dump() + "\n");
  write_file_atomic((fs::path(out_dir) / "test.tsv").string(), test.str());
  write_file_atomic((fs::path(out_dir) / "tokenizer.json").string(),
                    char_tokenizer_json("abcdefghijklmnopqrstuvwxyz ?.\n",
                                        {"<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<image>"}));
  const nlohmann::json tok_cfg = {
      {"bos_token", nullptr}, {"eos_token", "<|im_end|>"}, {"pad_token", "<pad>"},
      {"model_max_length", 1024}, {"tokenizer_class", "PreTrainedTokenizerFast"},
      {"chat_template", "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"}};
  write_file_atomic((fs::path(out_dir) / "tokenizer_config.json").string(), tok_cfg.dump(2) + "\n");
  const nlohmann::json proc = {{"image_processor_type", "CLIPImageProcessor"},
                               {"do_resize", true},
                               {"size", {{"shortest_edge", 56}}},
                               {"resample", 3},
                               {"do_center_crop", true},
                               {"crop_size", {{"height", 56}, {"width", 56}}},
                               {"do_rescale", true},
                               {"rescale_factor", 1.0 / 255},
                               {"do_normalize", true},
                               {"image_mean", {0.48145466, 0.4578275, 0.40821073}},
                               {"image_std", {0.26862954, 0.26130258, 0.27577711}},
                               {"do_convert_rgb", true}};
  write_file_atomic((fs::path(out_dir) / "preprocessor_config.json").string(), proc.dump(2) + "\n");
}

void write_shape_classes_task(const std::string& out_dir, int64_t docs, uint64_t seed) {
  namespace fs = std::filesystem;
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> pick_colour(0, 3), pick_shape(0, 2);
  for (const Colour& c : kColours) fs::create_directories(fs::path(out_dir) / c.name);
  for (int64_t i = 0; i < docs; ++i) {
    const int c = pick_colour(rng), s = pick_shape(rng);
    char name[32];
    std::snprintf(name, sizeof name, "%05lld.png", static_cast<long long>(i));
    image::write_png((fs::path(out_dir) / kColours[c].name / name).string(), draw(rng, c, s));
  }
}

std::vector<std::pair<std::string, std::array<int, 3>>> shape_colours() {
  std::vector<std::pair<std::string, std::array<int, 3>>> out;
  for (const Colour& c : kColours) out.push_back({c.name, {c.r, c.g, c.b}});
  return out;
}

}  // namespace lf::data
