// loongforge data encode: image folders (class folders) -> latent shards (io/latent_shards.h) with a VAE, resumable,
// with a progress line; `data.format: latents` trains on them.
#include <ATen/ATen.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>

#include "loongforge/cli/commands.h"
#include "loongforge/core/error.h"
#include "loongforge/core/json.h"
#include "loongforge/data/image/decode.h"
#include "loongforge/data/image_folder.h"
#include "loongforge/io/hf_model.h"
#include "loongforge/io/latent_shards.h"
#include "loongforge/io/safetensors.h"

namespace lf::cli {
namespace {
namespace fs = std::filesystem;
using nlohmann::json;

struct EncodeArgs {
  std::string images, vae, out;
  int64_t resolution = 256, shard_size = 256, batch = 8;
  bool flip = false;
};

bool is_image(const fs::path& p) {
  std::string e = p.extension().string();
  std::transform(e.begin(), e.end(), e.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return e == ".png" || e == ".jpg" || e == ".jpeg";
}

struct Item {
  std::string path;
  int64_t label = -1;
};

// ROOT/<class>/<image>, classes numbered in sorted order of their folder names (as data/image_folder.h).
std::vector<Item> list_class_folders(const std::string& root) {
  if (!fs::is_directory(root)) throw Error(root + ": not a folder");
  std::vector<std::string> classes;
  for (const auto& e : fs::directory_iterator(root))
    if (e.is_directory()) classes.push_back(e.path().filename().string());
  std::sort(classes.begin(), classes.end());
  std::vector<Item> items;
  for (size_t c = 0; c < classes.size(); ++c) {
    std::vector<std::string> files;
    for (const auto& e : fs::directory_iterator(fs::path(root) / classes[c]))
      if (e.is_regular_file() && is_image(e.path())) files.push_back(e.path().string());
    std::sort(files.begin(), files.end());
    for (auto& f : files) items.push_back({f, static_cast<int64_t>(c)});
  }
  if (items.empty()) throw Error(root + ": no images (expected ROOT/<class>/<image>.png|jpg)");
  return items;
}

// The progress of the encoding on stdout: a line redrawn on a terminal, a line per shard otherwise.
void report(int64_t done, int64_t total, double seconds, bool tty) {
  const double rate = seconds > 0 ? static_cast<double>(done) / seconds : 0;
  const double eta = rate > 0 ? static_cast<double>(total - done) / rate : 0;
  const int width = 30, filled = static_cast<int>(width * done / std::max<int64_t>(1, total));
  std::string bar(static_cast<size_t>(filled), '#');
  bar.resize(width, '.');
  std::printf("%sencode [%s] %lld/%lld %.1f items/s ETA %.0fs%s", tty ? "\r" : "", bar.c_str(),
               static_cast<long long>(done), static_cast<long long>(total), rate, eta, tty ? "   " : "\n");
  std::fflush(stdout);
}

void run_encode(const EncodeArgs& a) {
  if (a.images.empty()) throw Error("data encode: give --images DIR");
  if (a.resolution <= 0) throw Error("--resolution: must be positive");
  const std::vector<Item> items = list_class_folders(a.images);
  for (const Item& it : items) data::image::check_image_file(it.path);  // a file that is no image: before any work
  auto vae = io::load_model(a.vae, at::kFloat);
  vae->eval();
  models::LatentCodec* codec = vae->latent_codec();
  if (!codec) throw Error("--vae: " + a.vae + " is not an autoencoder (" + vae->model_type() + ")");
  if (a.resolution % codec->spatial_factor() != 0)
    throw Error("--resolution: " + std::to_string(a.resolution) + " is not a multiple of the VAE's downsampling " +
                std::to_string(codec->spatial_factor()));
  const auto n = static_cast<int64_t>(items.size());
  json index = {{"format", "loongforge-latents"},
                {"version", 1},
                {"vae", fs::absolute(a.vae).lexically_normal().string()},
                {"vae_class", vae->model_type()},
                {"latent_channels", codec->latent_channels()},
                {"spatial_factor", codec->spatial_factor()},
                {"temporal_factor", codec->temporal_factor()},
                {"input", fs::absolute(a.images).lexically_normal().string()},
                {"conditions", "class_labels"},
                {"resolution", a.resolution},
                {"flip", a.flip},
                {"items", n},
                {"shard_rows", a.shard_size},
                {"shards", json::array()},
                {"complete", false}};
  const std::string idx_path = (fs::path(a.out) / io::kLatentIndex).string();
  int64_t first_shard = 0;
  if (fs::exists(idx_path)) {  // resume: the same arguments continue after the last finished shard
    const json prev = read_json_file(idx_path);
    for (auto it = index.begin(); it != index.end(); ++it) {
      if (it.key() == "shards" || it.key() == "complete") continue;
      if (!prev.contains(it.key()) || prev[it.key()] != it.value())
        throw file_error(idx_path, it.key(), "made with " + (prev.contains(it.key()) ? prev[it.key()].dump() : "none") +
                                                 ", this run has " + it.value().dump() +
                                                 " (encode into another folder, or remove this one)");
    }
    index["shards"] = prev.at("shards");
    first_shard = static_cast<int64_t>(index["shards"].size());
  } else if (fs::exists(a.out) && !fs::is_empty(a.out)) {
    throw Error(a.out + ": not empty and holds no " + io::kLatentIndex + " (nothing is overwritten: give a new folder)");
  }
  fs::create_directories(a.out);
  const int64_t shards = (n + a.shard_size - 1) / a.shard_size;
  const bool tty = ::isatty(STDOUT_FILENO);
  const auto t0 = std::chrono::steady_clock::now();
  int64_t done_now = 0;
  at::NoGradGuard no_grad;
  for (int64_t s = first_shard; s < shards; ++s) {
    const int64_t begin = s * a.shard_size, end = std::min(n, begin + a.shard_size);
    std::vector<at::Tensor> lat, lat_flip;
    std::vector<int64_t> labels;
    for (int64_t b = begin; b < end; b += a.batch) {
      std::vector<at::Tensor> px;
      for (int64_t i = b; i < std::min(end, b + a.batch); ++i) {
        const Item& it = items[static_cast<size_t>(i)];
        const at::Tensor img = data::center_crop_arr(data::image::read_image(it.path), a.resolution);
        px.push_back(img.permute({2, 0, 1}).to(at::kFloat).div(127.5).sub(1.0));
        labels.push_back(it.label);
      }
      const at::Tensor x = at::stack(px);
      lat.push_back(codec->normalize_latents(codec->encode_latents(x).first).contiguous());
      if (a.flip) lat_flip.push_back(codec->normalize_latents(codec->encode_latents(x.flip({3})).first).contiguous());
    }
    io::NamedTensors t{{"latents", at::cat(lat)}, {"class_labels", at::tensor(labels, at::kLong)}};
    if (a.flip) t.emplace_back("latents_flip", at::cat(lat_flip));
    const std::string name = io::latent_shard_name(s), path = (fs::path(a.out) / name).string();
    io::save_file(path + ".tmp", t, {{"first_item", std::to_string(begin)}});
    fs::rename(path + ".tmp", path);
    index["shards"].push_back(name);
    write_file_atomic(idx_path, index.dump(2) + "\n");
    done_now += end - begin;
    report(end, n, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() *
                       static_cast<double>(end) / static_cast<double>(std::max<int64_t>(1, done_now)),
           tty);
  }
  index["complete"] = true;
  write_file_atomic(idx_path, index.dump(2) + "\n");
  if (tty) std::printf("\n");
  std::printf("%s: %lld latents [%lld channels] in %lld shards\n", a.out.c_str(), static_cast<long long>(n),
              static_cast<long long>(codec->latent_channels()), static_cast<long long>(shards));
}

}  // namespace

void add_data_encode(CLI::App& data) {
  auto args = std::make_shared<EncodeArgs>();
  auto* sub = data.add_subcommand("encode", "Encode an image folder into latent shards with a VAE (resumable)");
  sub->add_option("--images", args->images, "ROOT/<class>/<image> (PNG / JPEG): class-conditional rows");
  sub->add_option("--vae", args->vae, "the autoencoder folder (AutoencoderKL, AutoencoderKLWan)")->required();
  sub->add_option("--out", args->out, "the shards' folder (a rerun with the same arguments continues)")->required();
  sub->add_option("--resolution", args->resolution, "square side the images are resized and center-cropped to (as "
                                                    "DiT's center_crop_arr)")->capture_default_str();
  sub->add_option("--shard-size", args->shard_size, "rows per shard")->check(CLI::PositiveNumber)->capture_default_str();
  sub->add_option("--batch", args->batch, "images per VAE call")->check(CLI::PositiveNumber)->capture_default_str();
  sub->add_flag("--flip", args->flip, "also encode each image mirrored (latents_flip, for data.random_flip)");
  sub->callback([args] { run_encode(*args); });
}

}  // namespace lf::cli
