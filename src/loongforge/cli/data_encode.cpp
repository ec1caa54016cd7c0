// loongforge data encode: image folders (class folders, or captioned with metadata.jsonl) and video folders ->
// latent shards (io/latent_shards.h) with a VAE, captions -> text states with a T5 / UMT5 encoder as the Wan pipeline
// makes them; resumable, with a progress line; `data.format: latents` trains on them.
#include <ATen/ATen.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>

#include "loongforge/cli/commands.h"
#include "loongforge/core/error.h"
#include "loongforge/core/json.h"
#include "loongforge/data/captions.h"
#include "loongforge/data/image/decode.h"
#include "loongforge/data/image_folder.h"
#include "loongforge/data/tokenizer/tokenizer.h"
#include "loongforge/data/video_folder.h"
#include "loongforge/io/hf_model.h"
#include "loongforge/io/latent_shards.h"
#include "loongforge/io/safetensors.h"

namespace lf::cli {
namespace {
namespace fs = std::filesystem;
using nlohmann::json;

struct EncodeArgs {
  std::string images, videos, vae, text_encoder, out;
  int64_t resolution = 256, shard_size = 256, batch = 8, frames = 0, stride = 1, max_text_len = 512;
  bool flip = false;
};

struct Item {
  std::string path;
  int64_t label = -1;    // class folders
  std::string caption;   // captioned folders
  int64_t video = -1;    // index into the video folder's items
};

// The Wan pipeline's text states of captions (WanPipeline._get_t5_prompt_embeds): whitespace collapsed, tokenized
// with the eos token, cut to max_len tokens (the eos kept last), padded with the pad id 0; the encoder's
// last_hidden_state with every position past a caption's tokens zeroed. [n, max_len, d_model].
at::Tensor text_states(models::Model& encoder, const data::Tokenizer& tok, const std::vector<std::string>& captions,
                       int64_t max_len) {
  const auto n = static_cast<int64_t>(captions.size());
  at::Tensor ids = at::zeros({n, max_len}, at::kLong), mask = at::zeros({n, max_len}, at::kLong);
  std::vector<int64_t> lens;
  for (int64_t i = 0; i < n; ++i) {
    std::string clean;  // " ".join(text.split())
    bool space = false;
    for (char c : captions[static_cast<size_t>(i)]) {
      if (c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v') {
        space = !clean.empty();
        continue;
      }
      if (space) clean += ' ';
      space = false;
      clean += c;
    }
    std::vector<int64_t> t = tok.encode(clean, /*add_special_tokens=*/true);
    if (static_cast<int64_t>(t.size()) > max_len) {
      const int64_t eos = t.back();
      t.resize(static_cast<size_t>(max_len));
      t.back() = eos;
    }
    for (size_t j = 0; j < t.size(); ++j) {
      ids[i][static_cast<int64_t>(j)] = t[j];
      mask[i][static_cast<int64_t>(j)] = 1;
    }
    lens.push_back(static_cast<int64_t>(t.size()));
  }
  at::Tensor h = encoder.embed(models::Batch{{"input_ids", ids}, {"attention_mask", mask}}).to(at::kFloat);
  for (int64_t i = 0; i < n; ++i)
    if (lens[static_cast<size_t>(i)] < max_len) h[i].narrow(0, lens[static_cast<size_t>(i)], max_len - lens[static_cast<size_t>(i)]).zero_();
  return h.contiguous();
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
  if (a.images.empty() == a.videos.empty()) throw Error("data encode: give --images DIR or --videos DIR");
  if (a.resolution <= 0) throw Error("--resolution: must be positive");
  auto vae = io::load_model(a.vae, at::kFloat);
  vae->eval();
  models::LatentCodec* codec = vae->latent_codec();
  if (!codec) throw Error("--vae: " + a.vae + " is not an autoencoder (" + vae->model_type() + ")");
  if (a.resolution % codec->spatial_factor() != 0)
    throw Error("--resolution: " + std::to_string(a.resolution) + " is not a multiple of the VAE's downsampling " +
                std::to_string(codec->spatial_factor()));
  std::vector<Item> items;
  std::unique_ptr<data::VideoFolderDataset> videos;
  bool captioned = false;
  if (!a.images.empty()) {
    if (a.frames > 0) throw Error("--frames: clips come from --videos folders");
    data::ImageFolderOptions io_;
    io_.roots = {a.images};
    io_.resolution = a.resolution;
    const data::ImageFolderDataset ds(io_);  // lists the folder and checks every image decodes, before any work
    captioned = ds.has_captions();
    for (size_t i = 0; i < ds.files().size(); ++i)
      items.push_back({ds.files()[i].first, captioned ? -1 : ds.files()[i].second, captioned ? ds.captions()[i] : "", -1});
  } else {
    if (!codec->video()) throw Error("--vae: " + a.vae + " encodes images, not clips (a video VAE: AutoencoderKLWan)");
    if (a.frames <= 0 || (a.frames - 1) % codec->temporal_factor() != 0)
      throw Error("--frames: " + std::to_string(a.frames) + " frames; the VAE takes 1 + " +
                  std::to_string(codec->temporal_factor()) + " k");
    data::VideoFolderOptions vo;
    vo.roots = {a.videos};
    vo.num_frames = a.frames;
    vo.stride = a.stride;
    vo.height = vo.width = a.resolution;
    vo.images = a.frames == 1;  // a shard's rows share one shape: images join clips of one frame only
    videos = std::make_unique<data::VideoFolderDataset>(vo);  // probes every clip, captions checked
    captioned = true;
    for (int64_t i = 0; i < videos->size(); ++i) items.push_back({videos->items()[static_cast<size_t>(i)].path, -1,
                                                                 videos->items()[static_cast<size_t>(i)].caption, i});
  }
  std::shared_ptr<models::Model> text;
  std::unique_ptr<data::Tokenizer> tok;
  if (captioned) {
    if (a.text_encoder.empty())
      throw Error("--text-encoder: the folder's captions (" + std::string(data::kCaptionFile) +
                  ") need a text encoder folder (T5 / UMT5 encoder with its tokenizer)");
    if (a.max_text_len <= 0) throw Error("--max-text-len: must be positive");
    text = io::load_model(a.text_encoder, at::kFloat);
    text->eval();
    tok = data::Tokenizer::load(a.text_encoder);
  } else if (!a.text_encoder.empty()) {
    throw Error("--text-encoder: " + a.images + " has class folders, no captions (" + data::kCaptionFile + ")");
  }
  const auto n = static_cast<int64_t>(items.size());
  json index = {{"format", "loongforge-latents"},
                {"version", 1},
                {"vae", fs::absolute(a.vae).lexically_normal().string()},
                {"vae_class", vae->model_type()},
                {"latent_channels", codec->latent_channels()},
                {"spatial_factor", codec->spatial_factor()},
                {"temporal_factor", codec->temporal_factor()},
                {"input", fs::absolute(a.images.empty() ? a.videos : a.images).lexically_normal().string()},
                {"conditions", captioned ? "encoder_hidden_states" : "class_labels"},
                {"text_encoder", captioned ? fs::absolute(a.text_encoder).lexically_normal().string() : ""},
                {"max_text_len", captioned ? a.max_text_len : 0},
                {"resolution", a.resolution},
                {"frames", a.frames},
                {"stride", a.stride},
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
  if (captioned && first_shard == 0) {  // the empty prompt's states: "no caption" for dropout and guidance
    at::NoGradGuard no_grad;
    io::save_file((fs::path(a.out) / io::kNullConditions).string(),
                  {{"encoder_hidden_states", text_states(*text, *tok, {""}, a.max_text_len)}});
  }
  const int64_t shards = (n + a.shard_size - 1) / a.shard_size;
  const bool tty = ::isatty(STDOUT_FILENO);
  const auto t0 = std::chrono::steady_clock::now();
  int64_t done_now = 0;
  at::NoGradGuard no_grad;
  for (int64_t s = first_shard; s < shards; ++s) {
    const int64_t begin = s * a.shard_size, end = std::min(n, begin + a.shard_size);
    std::vector<at::Tensor> lat, lat_flip, states;
    std::vector<int64_t> labels;
    for (int64_t b = begin; b < end; b += a.batch) {
      std::vector<at::Tensor> px;
      std::vector<std::string> caps;
      for (int64_t i = b; i < std::min(end, b + a.batch); ++i) {
        const Item& it = items[static_cast<size_t>(i)];
        if (videos) {
          px.push_back(videos->clip(it.video));
        } else {
          const at::Tensor img = data::center_crop_arr(data::image::read_image(it.path), a.resolution);
          px.push_back(img.permute({2, 0, 1}).to(at::kFloat).div(127.5).sub(1.0));
        }
        labels.push_back(it.label);
        caps.push_back(it.caption);
      }
      at::Tensor x = at::stack(px);
      if (codec->video() && x.dim() == 4) x = x.unsqueeze(2);  // images as 1-frame clips
      lat.push_back(codec->normalize_latents(codec->encode_latents(x).first).contiguous());
      if (a.flip) lat_flip.push_back(codec->normalize_latents(codec->encode_latents(x.flip({-1})).first).contiguous());
      if (captioned) states.push_back(text_states(*text, *tok, caps, a.max_text_len));
    }
    io::NamedTensors t{{"latents", at::cat(lat)}};
    if (captioned) t.emplace_back("encoder_hidden_states", at::cat(states));
    else t.emplace_back("class_labels", at::tensor(labels, at::kLong));
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
  auto* sub = data.add_subcommand("encode", "Encode an image or video folder into latent shards with a VAE (and its "
                                            "captions with a text encoder); resumable");
  sub->add_option("--images", args->images, "ROOT/<class>/<image> (PNG / JPEG): class-conditional rows; or ROOT with "
                                            "metadata.jsonl captions (file_name, text): text-conditioned rows");
  sub->add_option("--videos", args->videos, "ROOT with videos and metadata.jsonl captions: text-conditioned clips "
                                            "(a video VAE; the folder's images join as 1-frame clips with --frames 1)");
  sub->add_option("--text-encoder", args->text_encoder, "a T5 / UMT5 encoder folder with its tokenizer (spiece.model / "
                                                        "tokenizer.json), for captions");
  sub->add_option("--max-text-len", args->max_text_len, "text positions per caption (padded with zeros, as the Wan "
                                                        "pipeline)")->capture_default_str();
  sub->add_option("--frames", args->frames, "frames per clip from each video's start (1 + 4k for Wan's VAE)");
  sub->add_option("--stride", args->stride, "take every stride-th frame")->check(CLI::PositiveNumber)->capture_default_str();
  sub->add_option("--vae", args->vae, "the autoencoder folder (AutoencoderKL, AutoencoderKLWan)")->required();
  sub->add_option("--out", args->out, "the shards' folder (a rerun with the same arguments continues)")->required();
  sub->add_option("--resolution", args->resolution, "square side the images / frames are resized and center-cropped "
                                                    "to (as DiT's center_crop_arr)")->capture_default_str();
  sub->add_option("--shard-size", args->shard_size, "rows per shard")->check(CLI::PositiveNumber)->capture_default_str();
  sub->add_option("--batch", args->batch, "images per VAE call")->check(CLI::PositiveNumber)->capture_default_str();
  sub->add_flag("--flip", args->flip, "also encode each image / clip mirrored (latents_flip, for data.random_flip)");
  sub->callback([args] { run_encode(*args); });
}

}  // namespace lf::cli
