#include "loongforge/train/trainer.h"

#include <ATen/ATen.h>
#include <malloc.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <vector>

#include "loongforge/core/error.h"
#include "loongforge/core/json.h"
#include "loongforge/data/balance.h"
#include "loongforge/io/hf_model.h"
#include "loongforge/io/peft.h"
#include "loongforge/io/plot.h"
#include "loongforge/io/tensorboard.h"
#include "loongforge/kernels/cuda_ops.h"
#include "loongforge/models/policy_io.h"
#include "loongforge/optim/schedule.h"
#include "loongforge/train/builders.h"
#include "loongforge/train/checkpoint.h"
#include "loongforge/train/engine.h"
#include "loongforge/train/policy_eval.h"
#include "loongforge/train/progress.h"
#include "loongforge/train/recipe.h"
#include "loongforge/train/diffusion_source.h"
#include "loongforge/train/sample_grid.h"
#include "loongforge/train/single_engine.h"

namespace lf::train {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

double validation_loss(Engine& engine, BatchSource& src, int64_t batches, int64_t mb) {
  double sum = 0;
  int64_t count = 0;
  for (int64_t i = 0; i < batches; ++i) {
    auto [first, n] = engine.local_rows(mb);
    Batch b = src.next_rows(mb * engine.data_parallel(), first, n);
    auto [l, c] = engine.eval_loss(b);
    sum += l;
    count += c;
  }
  return count ? sum / static_cast<double>(count) : std::nan("");
}

}  // namespace

namespace {
TrainOutcome train_run(const json& r, bool resume);
double evaluate_run(const json& r, const std::string& model_dir, int64_t batches);
}  // namespace

TrainOutcome train(const json& r, bool resume) {
  return with_recipe_keys([&] { return train_run(r, resume); });
}

double evaluate(const json& r, const std::string& model_dir, int64_t batches) {
  return with_recipe_keys([&] { return evaluate_run(r, model_dir, batches); });
}

namespace {

TrainOutcome train_run(const json& r, bool resume) {
  // Training allocates and frees the same large activation buffers every step. glibc would hand buffers above
  // its mmap threshold back to the kernel on free and fault them in again (zeroed) on the next step; keep them.
  ::mallopt(M_MMAP_THRESHOLD, 1 << 30);
  ::mallopt(M_TRIM_THRESHOLD, 1 << 30);
  const RunOptions ro = run_options(r);
  if (ro.threads > 0) at::set_num_threads(ro.threads);
  at::manual_seed(ro.seed);
  const std::string& out = ro.output_dir;
  fs::create_directories(out);
  const std::string ckpt_root = (fs::path(out) / "checkpoints").string();

  ModelBundle b = build_model(r);
  std::string tokenizer = b.tokenizer;
  const std::shared_ptr<models::Model> model = b.model;  // (the engine holds it too)
  const at::Device device = choose_device(r, ro.distributed);
  if (ro.fp8) use_fp8_linears(*b.model, ro.fp8_blockwise);
  const EngineOptions eo = engine_options(r);
  std::unique_ptr<Engine> engine = ro.distributed ? make_distributed_engine(eo, std::move(b), device)
                                               : make_single_engine(eo, std::move(b), device);
  const bool main_rank = engine->is_main();
  const int64_t dp = engine->data_parallel();
  const optim::Schedule& sched = ro.schedule;
  const int64_t steps = ro.steps;

  auto data = build_data(r, data::Split::Train, tokenizer, model.get());
  // Files the data gives a model folder (a policy's processors with the statistics of this run's normalisation):
  // every checkpoint copies them, as tokenizer files.
  if (std::string d = data->write_model_files((fs::path(out) / "model_files").string()); !d.empty()) tokenizer = d;
  std::unique_ptr<BatchSource> valid;
  if (ro.validate) valid = build_data(r, data::Split::Valid, tokenizer, model.get());
  // Every evaluation uses the same first eval.batches validation batches, so values compare across steps and
  // with `loongforge eval`.
  const json valid_start = valid ? valid->state() : json();
  // Diffusion runs: the validation loss per timestep bucket (eval.timestep_buckets) and sample grids (eval.samples).
  const int64_t buckets = r["eval"]["timestep_buckets"];
  DiffusionObjectiveSource* bucketed = nullptr;
  if (buckets < 0) throw Error("recipe: field 'eval.timestep_buckets': must be >= 0");
  if (buckets > 0) {
    bucketed = dynamic_cast<DiffusionObjectiveSource*>(valid.get());
    if (!bucketed)
      throw Error("recipe: field 'eval.timestep_buckets': needs a diffusion run (diffusion.objective) with validation "
                  "data (data.valid_fraction)");
  }
  std::unique_ptr<SampleGrid> grid;
  if (r["eval"]["samples"].get<int64_t>() < 0) throw Error("recipe: field 'eval.samples': must be >= 0");
  if (r["eval"]["samples"].get<int64_t>() > 0) {
    auto fresh = build_data(r, data::Split::Train, tokenizer, model.get());
    grid = std::make_unique<SampleGrid>(r, *fresh);
  }
  bool grid_said = false;
  // Robot policies with held-out episodes: open-loop action errors and plots at every evaluation (train/policy_eval.h).
  const bool open_loop = ro.validate && r["data"]["format"] == "robot" && models::as_policy(*model);
  // data.skip_bad_samples: the bad samples left out, said once here and in this run's first metrics line.
  const std::optional<BatchSource::Skipped> skipped = data->skipped_samples();
  if (main_rank && skipped && skipped->skipped > 0)
    std::fprintf(stderr, "data: skipped %lld bad samples of %lld (first: %s)\n",
                 static_cast<long long>(skipped->skipped), static_cast<long long>(skipped->read),
                 skipped->first.c_str());

  int64_t step = 0, tokens_seen = 0, state_nonfinite = 0;
  if (resume) {
    auto dir = latest_checkpoint(ckpt_root);
    if (!dir) throw Error(ckpt_root + ": --resume given but there is no checkpoint (no 'latest')");
    json st = engine->load(*dir);
    step = st.at("step");
    tokens_seen = st.at("tokens");
    state_nonfinite = st.value("nonfinite_steps", int64_t(0));
    data->restore(st.at("data"));
    if (main_rank) std::printf("resumed from %s at step %lld\n", dir->c_str(), static_cast<long long>(step));
  }

  const int64_t mb = eo.micro_batch_size, accum = eo.grad_accum;
  const bool bf16 = eo.precision == "bf16" || eo.precision == "fp8";  // fp8: bf16 autocast around the FP8 GEMMs
  const double seq = static_cast<double>(eo.seq_len);
  const double flops_per_token = model->train_flops_per_sample(eo.seq_len) / seq;
  const double peak = peak_flops(ro.peak_tflops, device);

  // Data-parallel placement of the step's rows (data/balance.h): by cost with data.balance: cost, else today's
  // contiguous slices; with dp > 1 both report the ranks' cost imbalance before and after. Costs are in units of
  // one language-model token's linear work, the other terms scaled by the model's FLOPs ratios.
  const bool place_by_cost = ro.balance || dp > 1;
  data::CostModel cost_model;
  {
    const models::Model::TrainWork w = model->train_work();
    const double unit = w.per_token > 0 ? w.per_token : 1.0;
    cost_model.token_pair = w.per_token_pair / unit;
    cost_model.patch = w.per_patch / unit;
    cost_model.patch_pair = w.per_patch_pair / unit;
    cost_model.patches_per_image_token = w.patches_per_image_token;
    cost_model.fixed_image_patches = w.fixed_image_patches;
  }

  const std::string metrics_path = (fs::path(out) / "metrics.jsonl").string();
  if (main_rank && resume && fs::exists(metrics_path)) {  // drop lines of steps after the checkpoint (they will be redone)
    std::ifstream in(metrics_path);
    std::string l, kept;
    while (std::getline(in, l)) {
      json j = json::parse(l, nullptr, false);
      if (!j.is_discarded() && j.value("step", int64_t(0)) <= step) kept += l + "\n";
    }
    write_file_atomic(metrics_path, kept);
  }
  std::ofstream metrics;
  std::unique_ptr<io::TensorBoardWriter> tb;
  if (main_rank) {  // rank 0 writes the logs
    write_file_atomic((fs::path(out) / "recipe.yaml").string(), recipe_to_yaml(r));
    metrics.open(metrics_path, resume ? std::ios::app : std::ios::trunc);
    if (!metrics) throw Error((fs::path(out) / "metrics.jsonl").string() + ": cannot write");
    if (ro.tensorboard) tb = std::make_unique<io::TensorBoardWriter>((fs::path(out) / "tensorboard").string());
  }
  Progress progress(main_rank ? ro.progress : "off", steps);

  int64_t nonfinite_steps = state_nonfinite;  // steps skipped for a NaN / inf loss or gradient (resumed runs: so far)
  auto state_json = [&]() {
    json st = {{"step", step}, {"tokens", tokens_seen}, {"data", data->state()}, {"recipe", r},
               {"nonfinite_steps", nonfinite_steps}};
    return st;
  };
  TrainOutcome outcome;
  auto t_start = std::chrono::steady_clock::now();
  int64_t start_step = step;
  const int64_t stop_at = ro.stop_at_step;  // leave early (with a checkpoint), e.g. before a preemption
  while (step < steps && !(stop_at > 0 && step >= stop_at)) {
    auto t0 = std::chrono::steady_clock::now();
    std::vector<Batch> micro;
    int64_t counted = 0;
    json balance_metrics = json::object();
    json loss_parts = json::object();
    double loss = 0;
    try {
      if (place_by_cost) {
        // The step's rows (the same rows as below, in one draw): every rank computes their costs and the same
        // placement, then converts only its own slots' rows.
        const std::vector<data::RowShape> shapes = data->draw(accum * mb * dp);
        std::vector<double> costs;
        for (const auto& s : shapes) costs.push_back(data::row_cost(s, cost_model));
        const data::Placement before = data::contiguous_placement(dp, accum, mb);
        const data::Placement placed = ro.balance && dp > 1 ? data::balanced_placement(costs, dp, accum, mb) : before;
        balance_metrics = {{"dp_cost_imbalance_before", data::imbalance(costs, before)},
                           {"dp_cost_imbalance_after", data::imbalance(costs, placed)}};
        for (const auto& slot : placed[static_cast<size_t>(engine->data_parallel_rank())]) {
          micro.push_back(data->take(slot));
          counted += model->loss_terms(micro.back());
        }
      } else {
        const auto [first_row, rows] = engine->local_rows(mb);  // this rank reads only its rows
        for (int64_t i = 0; i < accum; ++i) {
          micro.push_back(data->next_rows(mb * dp, first_row, rows));
          counted += model->loss_terms(micro.back());
        }
      }
      counted = engine->global_counted(counted);
      // The loss of the step averages over every counted token of all its micro-batches (and ranks).
      loss = engine->forward_backward(micro, counted, bf16) / static_cast<double>(std::max<int64_t>(1, counted));
      // extra loss parts (the multi-token prediction loss), per counted token as the loss
      for (const auto& [name, sum] : engine->loss_parts()) loss_parts[name] = sum / static_cast<double>(std::max<int64_t>(1, counted));
    } catch (const Error& e) {
      // A model's error on the contents of a batch ("batch: ...") names the file the batch came from.
      const std::string what = e.what();
      if (!data->origin().empty() && what.rfind("batch: ", 0) == 0)
        throw Error(data->origin() + ": step " + std::to_string(step + 1) + ": " + what);
      throw;
    }
    double gnorm = engine->clip_grad_norm(ro.clip);
    double lr = sched.at(step);
    // A NaN / inf loss or gradient (the same on every rank: both are global) never reaches the weights: the run
    // stops before the update (train.on_nonfinite: stop; the last checkpoint stays the newest), or drops the step's
    // gradients and moves on (skip: no weight, moment or optimizer-step change; counted in the metrics).
    const bool nonfinite = !std::isfinite(loss) || !std::isfinite(gnorm);
    auto text = [](double x) { return std::isnan(x) ? std::string("NaN") : std::isinf(x) ? (x > 0 ? "inf" : "-inf") : std::to_string(x); };
    if (nonfinite && !ro.skip_nonfinite) {
      engine->barrier();
      throw Error("step " + std::to_string(step + 1) + ": the " + (std::isfinite(loss) ? "gradient norm" : "loss") +
                  " is " + text(std::isfinite(loss) ? gnorm : loss) +
                  "; stopped before the update (train.on_nonfinite: stop" +
                  (outcome.last_checkpoint.empty() ? std::string(")") : "; the last checkpoint is " + outcome.last_checkpoint + ")") +
                  "; set train.on_nonfinite=skip to drop such steps");
    }
    if (nonfinite) {
      ++nonfinite_steps;
    } else {
      engine->step(lr);
    }
    engine->zero_grad();
    ++step;
    int64_t step_tokens = accum * mb * dp * static_cast<int64_t>(seq);
    tokens_seen += step_tokens;
    double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    double tps = step_tokens / std::max(dt, 1e-9);
    double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
    double eta = elapsed / static_cast<double>(step - start_step) * static_cast<double>(steps - step);
    json line = {{"step", step}, {"loss", loss}, {"grad_norm", gnorm}, {"lr", lr}, {"tokens", tokens_seen},
                 {"tokens_per_s", tps}, {"mfu", flops_per_token * tps / peak}, {"step_time_s", dt}};
    if (nonfinite) {  // JSON has no NaN: the values as text, the step marked skipped
      line["loss"] = text(loss);
      line["grad_norm"] = text(gnorm);
      line["skipped_nonfinite"] = true;
    }
    if (nonfinite_steps > 0) line["nonfinite_steps"] = nonfinite_steps;
    if (skipped && step == start_step + 1) {
      line["data_skipped_samples"] = skipped->skipped;
      line["data_samples_read"] = skipped->read;
    }
    if (device.is_cuda()) line["max_memory_allocated"] = kernels::cuda::max_memory_allocated();
    for (auto it = balance_metrics.begin(); it != balance_metrics.end(); ++it) line[it.key()] = it.value();
    for (auto it = loss_parts.begin(); it != loss_parts.end(); ++it) line[it.key()] = it.value();
    const json extra = engine->step_metrics();
    for (auto it = extra.begin(); it != extra.end(); ++it) line[it.key()] = it.value();
    if (valid && ro.eval_every > 0 && (step % ro.eval_every == 0 || step == steps)) {
      valid->restore(valid_start);
      double vl = validation_loss(*engine, *valid, ro.eval_batches, mb);
      line["valid_loss"] = vl;
      if (tb) tb->add_scalar("valid/loss", vl, step);
      progress.note("step " + std::to_string(step) + " valid loss " + std::to_string(vl));
      if (bucketed) {
        json by_t = json::array();
        for (int64_t k = 0; k < buckets; ++k) {
          valid->restore(valid_start);
          bucketed->set_timestep_bucket(k, buckets);
          const double v = validation_loss(*engine, *valid, ro.eval_batches, mb);
          by_t.push_back(v);
          if (tb) tb->add_scalar("valid/loss_timestep_bucket_" + std::to_string(k), v, step);
        }
        bucketed->set_timestep_bucket(0, 0);
        line["valid_loss_by_timestep"] = by_t;
      }
    }
    if (open_loop && ro.eval_every > 0 && (step % ro.eval_every == 0 || step == steps)) {
      OpenLoopReport rep;
      const std::string dir = (fs::path(out) / "open_loop" / checkpoint_name(step)).string();
      const bool done = engine->with_whole_model(/*average=*/false, [&](models::Model& m) { rep = open_loop_eval(r, m, dir); });
      if (done && main_rank) {
        line["open_loop_mse"] = rep.mse;
        line["open_loop_mae"] = rep.mae;
        if (tb) tb->add_scalar("valid/open_loop_mse", rep.mse, step);
        progress.note("step " + std::to_string(step) + " open-loop action MSE " + std::to_string(rep.mse) + " (" + dir + ")");
      }
    }
    if (grid && ro.eval_every > 0 && (step % ro.eval_every == 0 || step == steps)) {
      std::string path;
      const bool done = engine->with_whole_model(/*average=*/true, [&](models::Model& m) {
        path = grid->write(m, step, (fs::path(out) / "samples").string());
      });
      if (done && main_rank) {
        line["samples"] = path;
        progress.note("step " + std::to_string(step) + " samples " + path);
      } else if (!done && main_rank && !grid_said) {
        std::fprintf(stderr, "eval.samples: this layout keeps no whole model on rank 0 (tp, pp, cp, ep, FSDP): no "
                             "sample grids\n");
        grid_said = true;
      }
    }
    if (main_rank) {
      metrics << line.dump() << "\n";
      metrics.flush();
    }
    if (tb) {
      tb->add_scalar("train/loss", loss, step);
      tb->add_scalar("train/grad_norm", gnorm, step);
      tb->add_scalar("train/lr", lr, step);
      tb->add_scalar("train/tokens_per_s", tps, step);
    }
    progress.update(step, loss, lr, tps, eta, step % ro.log_every == 0 || step == steps);
    outcome.last_loss = loss;
    if ((ro.checkpoint_every > 0 && step % ro.checkpoint_every == 0) || step == steps || step == stop_at) {
      outcome.last_checkpoint = engine->save(ckpt_root, step, state_json(), tokenizer, ro.keep);
      if (ro.checkpoint_every > 0 && step != steps) progress.note("saved " + outcome.last_checkpoint);
    }
  }
  progress.done();
  if (tb) tb->flush();
  if (main_rank && ro.plot) {
    // The whole run's curve, resumed runs included: read metrics.jsonl back.
    io::Series train_s{"train loss", {}, {}, 0x1f77b4}, valid_s{"valid loss", {}, {}, 0xd62728};
    std::ifstream in((fs::path(out) / "metrics.jsonl").string());
    std::string l;
    while (std::getline(in, l)) {
      json j = json::parse(l, nullptr, false);
      if (j.is_discarded()) continue;
      if (!j["loss"].is_number()) continue;  // a skipped non-finite step
      train_s.x.push_back(j["step"].get<double>());
      train_s.y.push_back(j["loss"].get<double>());
      if (j.contains("valid_loss")) {
        valid_s.x.push_back(j["step"].get<double>());
        valid_s.y.push_back(j["valid_loss"].get<double>());
      }
    }
    std::vector<io::Series> series{train_s};
    if (!valid_s.x.empty()) series.push_back(valid_s);
    io::write_line_plot((fs::path(out) / "loss.png").string(), "loss", series);
  }
  outcome.steps = step;
  engine->barrier();  // nobody leaves (and takes the rendezvous store down) before everyone is done
  return outcome;
}

double evaluate_run(const json& r, const std::string& model_dir, int64_t batches) {
  const RunOptions ro = run_options(r);
  std::shared_ptr<models::Model> model;
  if (fs::exists(fs::path(model_dir) / "adapter_config.json")) {  // a LoRA checkpoint: base from the recipe
    model = io::load_model(ro.model_path, at::kFloat, ro.model_family);
    io::load_peft_adapter(model_dir, *model);
  } else {
    model = io::load_model(model_dir, at::kFloat, ro.model_family);
  }
  const std::string& tok = ro.tokenizer;
  auto src = build_data(r, ro.validate ? data::Split::Valid : data::Split::Train, tok, model.get());
  ModelBundle b;
  b.model = model;
  b.tokenizer = tok;
  b.trainable.params = {model->parameters().front()};
  b.trainable.names = {"unused"};
  EngineOptions eo = engine_options(r);
  eo.cuda_graphs = false;  // evaluation: no training step to capture
  auto engine = make_single_engine(eo, std::move(b), choose_device(r, /*distributed=*/false));
  return validation_loss(*engine, *src, batches, eo.micro_batch_size);
}

}  // namespace

}  // namespace lf::train
