// Robot sampling (data/robot/sampler.h) and the threaded loader (data/robot/loader.h) on an in-memory dataset whose
// values and pixels encode (episode, frame), so every window can be checked against its definition. The windows and
// pad masks are also checked against LeRobot itself in tests/python/test_robot_loader.py.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>

#include "loongforge/core/error.h"
#include "loongforge/data/robot/loader.h"
#include "loongforge/data/robot/sampler.h"
#include "test_util.h"

using namespace lf::data::robot;
using lf::test::error_of;

namespace {

// Episodes of the given lengths with episode_index 100, 102, ... (not their positions). observation.state [2] =
// (episode_index * 1000 + frame, frame / 2), action [3] = (episode_index, frame, -frame), index / frame_index /
// episode_index int64 scalars, timestamp float32; camera "observation.images.top" (video, [4, 6, 3]): pixel (h, w) =
// (episode_index, frame % 256, frame / 256 + h + w). Camera reads of episode FAIL_EPISODE (a position) throw.
class FakeRobot : public RobotDataset {
 public:
  explicit FakeRobot(std::vector<int64_t> lengths, double fps = 10, int64_t fail_episode = -1)
      : fps_(fps), fail_(fail_episode) {
    int64_t from = 0;
    for (size_t i = 0; i < lengths.size(); ++i) {
      episodes_.push_back({static_cast<int64_t>(100 + 2 * i), lengths[i], from, {"pick"}});
      from += lengths[i];
    }
    features_ = {{"observation.state", FeatureKind::numeric, "float32", {2}, {}},
                 {"action", FeatureKind::numeric, "float32", {3}, {}},
                 {"timestamp", FeatureKind::numeric, "float32", {}, {}},
                 {"frame_index", FeatureKind::numeric, "int64", {}, {}},
                 {"episode_index", FeatureKind::numeric, "int64", {}, {}},
                 {"index", FeatureKind::numeric, "int64", {}, {}},
                 {"observation.images.top", FeatureKind::video, "video", {4, 6, 3}, {}},
                 {"task", FeatureKind::text, "string", {1}, {}}};
    tasks_ = {"pick"};
  }
  std::string format() const override { return "fake"; }
  const std::string& root() const override { return root_; }
  double fps() const override { return fps_; }
  const std::vector<Feature>& features() const override { return features_; }
  const std::vector<Episode>& episodes() const override { return episodes_; }
  const std::vector<std::string>& tasks() const override { return tasks_; }
  const Stats& stats() const override { return stats_; }

  std::vector<at::Tensor> read_numeric(const std::vector<std::string>& names, int64_t episode, int64_t begin,
                                       int64_t end) const override {
    const auto& ep = episodes_.at(static_cast<size_t>(episode));
    EXPECT_TRUE(0 <= begin && begin <= end && end <= ep.length);
    std::vector<at::Tensor> out;
    for (const auto& n : names) {
      const int64_t rows = end - begin;
      at::Tensor t;
      if (n == "observation.state") {
        t = at::empty({rows, 2}, at::kFloat);
        for (int64_t r = 0; r < rows; ++r) {
          t[r][0] = static_cast<float>(ep.index * 1000 + begin + r);
          t[r][1] = static_cast<float>(begin + r) / 2;
        }
      } else if (n == "action") {
        t = at::empty({rows, 3}, at::kFloat);
        for (int64_t r = 0; r < rows; ++r) {
          t[r][0] = static_cast<float>(ep.index);
          t[r][1] = static_cast<float>(begin + r);
          t[r][2] = -static_cast<float>(begin + r);
        }
      } else if (n == "timestamp") {
        t = (at::arange(begin, end, at::kFloat) / static_cast<float>(fps_)).contiguous();
      } else if (n == "frame_index") {
        t = at::arange(begin, end, at::kLong);
      } else if (n == "episode_index") {
        t = at::full({rows}, ep.index, at::kLong);
      } else if (n == "index") {
        t = at::arange(ep.from + begin, ep.from + end, at::kLong);
      } else {
        ADD_FAILURE() << "unexpected numeric read of " << n;
      }
      out.push_back(t);
    }
    numeric_calls_++;
    return out;
  }

  at::Tensor read_camera(const std::string& camera, int64_t episode, const std::vector<int64_t>& frames,
                         double) const override {
    EXPECT_EQ(camera, "observation.images.top");
    {
      std::lock_guard<std::mutex> lk(m_);
      camera_calls_.push_back({episode, frames});
    }
    if (episode == fail_)
      throw lf::file_error("fake/videos/top.mp4", camera, "episode " + std::to_string(episodes_.at(static_cast<size_t>(episode)).index) +
                                                              ": truncated video");
    return pixels(episodes_.at(static_cast<size_t>(episode)).index, frames);
  }

  static at::Tensor pixels(int64_t episode_index, const std::vector<int64_t>& frames) {
    auto t = at::empty({static_cast<int64_t>(frames.size()), 4, 6, 3}, at::kByte);
    auto a = t.accessor<uint8_t, 4>();
    for (size_t i = 0; i < frames.size(); ++i)
      for (int h = 0; h < 4; ++h)
        for (int w = 0; w < 6; ++w) {
          a[i][h][w][0] = static_cast<uint8_t>(episode_index);
          a[i][h][w][1] = static_cast<uint8_t>(frames[i] % 256);
          a[i][h][w][2] = static_cast<uint8_t>(frames[i] / 256 + h + w);
        }
    return t;
  }

  std::vector<std::pair<int64_t, std::vector<int64_t>>> camera_calls() const {
    std::lock_guard<std::mutex> lk(m_);
    return camera_calls_;
  }

 private:
  std::string root_ = "fake";
  double fps_;
  int64_t fail_;
  std::vector<Episode> episodes_;
  std::vector<Feature> features_;
  std::vector<std::string> tasks_;
  Stats stats_;
  mutable std::mutex m_;
  mutable std::vector<std::pair<int64_t, std::vector<int64_t>>> camera_calls_;
  mutable std::atomic<int64_t> numeric_calls_{0};
};

bool equal(const RobotBatch& a, const RobotBatch& b) {
  if (a.size() != b.size()) return false;
  for (const auto& [k, v] : a) {
    auto it = b.find(k);
    if (it == b.end() || !v.sizes().equals(it->second.sizes()) || v.scalar_type() != it->second.scalar_type() ||
        !at::equal(v, it->second))
      return false;
  }
  return true;
}

DeltaTimestamps act_windows() {
  // 10 fps: state at -0.2 s, -0.1 s, now; camera -0.1 s and now; an action chunk of 4 frames
  return {{"observation.state", {-0.2, -0.1, 0.0}},
          {"observation.images.top", {-0.1, 0.0}},
          {"action", {0.0, 0.1, 0.2, 0.3}}};
}

}  // namespace

TEST(RobotSampler, DeltaWindowsRoundToFramesAndCheckTheGrid) {
  auto w = delta_windows({{"action", {0.0, 0.1, 0.2, 1.0}}, {"observation.state", {-0.1, 0.0}}}, 10, 1e-4, "ds");
  ASSERT_EQ(w.size(), 2u);
  EXPECT_EQ(w[0].feature, "action");
  EXPECT_EQ(w[0].offsets, (std::vector<int64_t>{0, 1, 2, 10}));
  EXPECT_EQ(w[1].offsets, (std::vector<int64_t>{-1, 0}));
  // 1/30 s steps written as decimals are on the grid within the tolerance
  auto w30 = delta_windows({{"action", {0.0333333, -0.0666667}}}, 30, 1e-4, "ds");
  EXPECT_EQ(w30[0].offsets, (std::vector<int64_t>{1, -2}));
  // off the grid: one line naming the dataset, the feature and the offset
  auto msg = error_of([] { delta_windows({{"action", {0.0, 0.15}}}, 10, 1e-4, "ds"); });
  EXPECT_NE(msg.find("ds: field 'delta_timestamps.action'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("0.15"), std::string::npos) << msg;
  EXPECT_EQ(msg.find('\n'), std::string::npos);
  // a wide tolerance lets half frames through; they round as Python's round(): ties to even
  auto wide = delta_windows({{"a", {0.25, 0.15, -0.05}}}, 10, 0.06, "ds");
  EXPECT_EQ(wide[0].offsets, (std::vector<int64_t>{2, 2, 0}));
  EXPECT_NE(error_of([] { delta_windows({{"a", {0.0}}, {"a", {0.1}}}, 10, 1e-4, "ds"); }).find("given twice"),
            std::string::npos);
  EXPECT_NE(error_of([] { delta_windows({{"a", {NAN}}}, 10, 1e-4, "ds"); }).find("delta_timestamps.a"),
            std::string::npos);
}

TEST(RobotSampler, WindowQueryClampsIntoTheEpisodeAndFlagsPadding) {
  const std::vector<int64_t> off = {-2, 0, 3};
  const int64_t L = 5;
  for (int64_t f = 0; f < L; ++f) {
    int64_t frames[3];
    bool pad[3];
    window_query(off, L, f, frames, pad);
    for (int i = 0; i < 3; ++i) {
      const int64_t q = f + off[static_cast<size_t>(i)];
      EXPECT_EQ(pad[i], q < 0 || q >= L) << f << " " << i;
      EXPECT_EQ(frames[i], q < 0 ? 0 : (q >= L ? L - 1 : q)) << f << " " << i;
    }
  }
}

TEST(RobotSampler, EpisodeSubsetsAndHeldOutEpisodes) {
  FakeRobot ds({3, 4, 5, 6, 7, 8, 9, 10});  // episode_index 100, 102, ..., 114
  auto all = split_episodes(ds, {});
  EXPECT_EQ(all.train, (std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6, 7}));
  EXPECT_TRUE(all.val.empty());
  // a count: spread evenly over the subset, the same every time
  auto two = split_episodes(ds, {{}, 2, {}});
  EXPECT_EQ(two.val, (std::vector<int64_t>{2, 6}));
  EXPECT_EQ(two.train, (std::vector<int64_t>{0, 1, 3, 4, 5, 7}));
  auto sub = split_episodes(ds, {{114, 100, 104, 106}, 1, {}});  // positions 0, 2, 3, 7
  EXPECT_EQ(sub.val, (std::vector<int64_t>{3}));
  EXPECT_EQ(sub.train, (std::vector<int64_t>{0, 2, 7}));
  // an explicit list
  auto listed = split_episodes(ds, {{}, 0, {102, 112}});
  EXPECT_EQ(listed.val, (std::vector<int64_t>{1, 6}));
  EXPECT_EQ(listed.train.size(), 6u);
  // errors name the dataset and the option
  EXPECT_NE(error_of([&] { split_episodes(ds, {{101}, 0, {}}); }).find("no episode 101"), std::string::npos);
  EXPECT_NE(error_of([&] { split_episodes(ds, {{100, 100}, 0, {}}); }).find("given twice"), std::string::npos);
  EXPECT_NE(error_of([&] { split_episodes(ds, {{100, 102}, 0, {104}}); }).find("fake: field 'val_episodes'"),
            std::string::npos);
  EXPECT_NE(error_of([&] { split_episodes(ds, {{100, 102}, 2, {}}); }).find("none to train on"), std::string::npos);
  EXPECT_NE(error_of([&] { split_episodes(ds, {{}, 1, {100}}); }).find("not both"), std::string::npos);
}

TEST(RobotSampler, ShuffleIsSeededPerEpochAndResumesExactly) {
  FakeRobot ds({5, 3, 7});  // 15 frames
  FrameSampler plain(ds, {0, 1, 2}, false, 0);
  EXPECT_EQ(plain.frames_per_epoch(), 15);
  for (int64_t k = 0; k < 15; ++k) {
    auto f = plain.next();
    EXPECT_EQ(f, plain.at(k));
    int64_t e = k < 5 ? 0 : (k < 8 ? 1 : 2);
    EXPECT_EQ(f, (FrameRef{e, k - (e == 0 ? 0 : (e == 1 ? 5 : 8))}));
  }
  EXPECT_EQ(plain.next(), (FrameRef{0, 0}));  // the next epoch
  EXPECT_EQ(plain.state().epoch, 1);

  auto epoch_of = [&](FrameSampler& s) {
    std::vector<FrameRef> out = s.next_batch(15);
    return out;
  };
  FrameSampler a(ds, {0, 1, 2}, true, 7), b(ds, {0, 1, 2}, true, 7), c(ds, {0, 1, 2}, true, 8);
  auto a0 = epoch_of(a), a1 = epoch_of(a), b0 = epoch_of(b), c0 = epoch_of(c);
  EXPECT_EQ(a0, b0);
  EXPECT_NE(a0, a1);
  EXPECT_NE(a0, c0);
  for (const auto& ep : {a0, a1}) {  // each epoch visits every frame once
    std::set<std::pair<int64_t, int64_t>> seen;
    for (const auto& f : ep) seen.insert({f.episode, f.frame});
    EXPECT_EQ(seen.size(), 15u);
  }

  // resume: stop mid-epoch 1, save the state as JSON, continue in a fresh sampler
  FrameSampler run(ds, {0, 1, 2}, true, 7);
  run.next_batch(22);
  const auto saved = SamplerState::from_json(nlohmann::json::parse(run.state().to_json().dump()), "state.json");
  EXPECT_EQ(saved, run.state());
  auto rest = run.next_batch(20);
  FrameSampler resumed(ds, {0, 1, 2}, true, 7);
  resumed.restore(saved);
  EXPECT_EQ(resumed.next_batch(20), rest);
  // a state of other episodes, another seed or shuffle setting is refused
  FrameSampler other(ds, {0, 2}, true, 7);
  EXPECT_NE(error_of([&] { other.restore(saved); }).find("other episodes"), std::string::npos);
  FrameSampler seed9(ds, {0, 1, 2}, true, 9);
  EXPECT_NE(error_of([&] { seed9.restore(saved); }).find("seed"), std::string::npos);
  EXPECT_NE(error_of([] { SamplerState::from_json(nlohmann::json{{"seed", 1}}, "s.json"); }).find("s.json: field"),
            std::string::npos);
}

TEST(RobotSampler, DropLastLeavesOutEachEpisodesLastFramesAsLeRobot) {
  // LeRobot's EpisodeAwareSampler(drop_n_last_frames=4): episodes of 5, 3, 7 frames keep 1, 0 (skipped), 3
  FakeRobot ds({5, 3, 7});
  FrameSampler s(ds, {0, 1, 2}, false, 0, 1, 4);
  EXPECT_EQ(s.frames_per_epoch(), 4);
  EXPECT_EQ(s.episode_positions(), (std::vector<int64_t>{0, 2}));
  EXPECT_EQ(s.next_batch(5), (std::vector<FrameRef>{{0, 0}, {2, 0}, {2, 1}, {2, 2}, {0, 0}}));
  FrameSampler shuffled(ds, {0, 1, 2}, true, 3, 1, 4);
  std::set<std::pair<int64_t, int64_t>> seen;
  for (const auto& f : shuffled.next_batch(4)) seen.insert({f.episode, f.frame});
  EXPECT_EQ(seen, (std::set<std::pair<int64_t, int64_t>>{{0, 0}, {2, 0}, {2, 1}, {2, 2}}));
  // a state saved without the drop belongs to other frames; every frame dropped is one line naming the option
  FrameSampler all(ds, {0, 1, 2}, true, 3);
  EXPECT_NE(error_of([&] { shuffled.restore(all.state()); }).find("other episodes"), std::string::npos);
  EXPECT_NE(error_of([&] { FrameSampler(ds, {1}, true, 3, 1, 3); }).find("drop_n_last_frames"), std::string::npos);
  EXPECT_NE(error_of([&] { FrameSampler(ds, {0}, true, 3, 1, -1); }).find("fake: field 'drop_n_last_frames'"),
            std::string::npos);
}

TEST(RobotLoader, BatchesHoldTheWindowsPadMasksAndFrames) {
  auto ds = std::make_shared<FakeRobot>(std::vector<int64_t>{6, 2, 9});
  LoaderOptions o;
  o.delta_timestamps = act_windows();
  o.batch_size = 4;
  o.threads = 2;
  FrameSampler sampler(*ds, {0, 1, 2}, true, 3);
  FrameSampler order(*ds, {0, 1, 2}, true, 3);  // the same order, to know which frames the batches hold
  RobotLoader loader(ds, std::move(sampler), o);
  EXPECT_EQ(loader.features(), (std::vector<std::string>{"observation.state", "action", "timestamp", "frame_index",
                                                         "episode_index", "index", "observation.images.top"}));
  const std::vector<int64_t> st = {-2, -1, 0}, cam = {-1, 0}, act = {0, 1, 2, 3};
  for (int step = 0; step < 6; ++step) {  // 24 frames: into the second epoch
    auto batch = loader.next();
    ASSERT_EQ(batch.size(), 10u);
    EXPECT_EQ(batch.at("observation.state").sizes(), (at::IntArrayRef{4, 3, 2}));
    EXPECT_EQ(batch.at("action").sizes(), (at::IntArrayRef{4, 4, 3}));
    EXPECT_EQ(batch.at("observation.images.top").sizes(), (at::IntArrayRef{4, 2, 4, 6, 3}));
    EXPECT_EQ(batch.at("observation.images.top").scalar_type(), at::kByte);
    EXPECT_EQ(batch.at("index").sizes(), (at::IntArrayRef{4}));
    EXPECT_EQ(batch.at("action_is_pad").scalar_type(), at::kBool);
    for (int64_t b = 0; b < 4; ++b) {
      const FrameRef fr = order.next();
      const auto& ep = ds->episodes()[static_cast<size_t>(fr.episode)];
      auto check = [&](const std::vector<int64_t>& off, const std::string& name, auto&& expect_row) {
        for (size_t w = 0; w < off.size(); ++w) {
          const int64_t q = fr.frame + off[w];
          const int64_t c = std::clamp<int64_t>(q, 0, ep.length - 1);
          EXPECT_EQ(batch.at(name + "_is_pad")[b][static_cast<int64_t>(w)].item<bool>(), q < 0 || q >= ep.length);
          expect_row(batch.at(name)[b][static_cast<int64_t>(w)], c);
        }
      };
      check(st, "observation.state", [&](at::Tensor row, int64_t c) {
        EXPECT_EQ(row[0].item<float>(), static_cast<float>(ep.index * 1000 + c));
        EXPECT_EQ(row[1].item<float>(), static_cast<float>(c) / 2);
      });
      check(act, "action", [&](at::Tensor row, int64_t c) {
        EXPECT_TRUE(at::equal(row, at::tensor({static_cast<float>(ep.index), static_cast<float>(c),
                                               -static_cast<float>(c)})));
      });
      check(cam, "observation.images.top",
            [&](at::Tensor img, int64_t c) { EXPECT_TRUE(at::equal(img, FakeRobot::pixels(ep.index, {c})[0])); });
      // features without a window hold the frame itself
      EXPECT_EQ(batch.at("index")[b].item<int64_t>(), ep.from + fr.frame);
      EXPECT_EQ(batch.at("episode_index")[b].item<int64_t>(), ep.index);
      EXPECT_EQ(batch.at("frame_index")[b].item<int64_t>(), fr.frame);
    }
  }
  // floats for the step: LeRobot's [C, H, W] in [0, 1]
  auto f = camera_to_float(loader.next().at("observation.images.top"));
  EXPECT_EQ(f.sizes(), (at::IntArrayRef{4, 2, 3, 4, 6}));
  EXPECT_LE(f.max().item<float>(), 1.0f);
}

TEST(RobotLoader, SameBatchesWhateverTheThreadCountAndVideoReadsAreSequential) {
  auto ds = std::make_shared<FakeRobot>(std::vector<int64_t>{11, 4, 13, 7});
  auto batches = [&](int threads, bool shuffle, int prefetch) {
    LoaderOptions o;
    o.delta_timestamps = act_windows();
    o.batch_size = 5;
    o.threads = threads;
    o.prefetch = prefetch;
    RobotLoader loader(ds, FrameSampler(*ds, {0, 1, 2, 3}, shuffle, 11), o);
    std::vector<RobotBatch> out;
    for (int i = 0; i < 9; ++i) out.push_back(loader.next());
    return out;
  };
  for (bool shuffle : {false, true}) {
    auto ref = batches(0, shuffle, 0);
    for (auto [threads, prefetch] : {std::pair{1, 0}, std::pair{3, 0}, std::pair{4, 1}, std::pair{2, 7}}) {
      auto got = batches(threads, shuffle, prefetch);
      for (size_t i = 0; i < ref.size(); ++i) EXPECT_TRUE(equal(ref[i], got[i])) << threads << " batch " << i;
    }
  }
  // every read_camera call asked for ascending, distinct frames of one episode
  auto calls = ds->camera_calls();
  ASSERT_FALSE(calls.empty());
  for (const auto& [episode, frames] : calls) {
    EXPECT_TRUE(std::is_sorted(frames.begin(), frames.end()));
    EXPECT_EQ(std::adjacent_find(frames.begin(), frames.end()), frames.end());
  }
}

TEST(RobotLoader, ResumesFromItsStateWithTheSameRemainingBatches) {
  auto ds = std::make_shared<FakeRobot>(std::vector<int64_t>{9, 5, 8});
  LoaderOptions o;
  o.delta_timestamps = act_windows();
  o.batch_size = 3;
  o.threads = 2;
  std::vector<RobotBatch> whole;
  {
    RobotLoader loader(ds, FrameSampler(*ds, {0, 1, 2}, true, 5), o);
    for (int i = 0; i < 14; ++i) whole.push_back(loader.next());
  }
  SamplerState saved;
  {
    RobotLoader loader(ds, FrameSampler(*ds, {0, 1, 2}, true, 5), o);
    EXPECT_EQ(loader.state().position, 0);
    for (int i = 0; i < 6; ++i) loader.next();  // stopped here with batches prefetched beyond
    saved = SamplerState::from_json(nlohmann::json::parse(loader.state().to_json().dump()), "state.json");
  }
  EXPECT_EQ(saved.position, 18);
  FrameSampler resumed(*ds, {0, 1, 2}, true, 5);
  resumed.restore(saved);
  RobotLoader loader(ds, std::move(resumed), o);
  for (int i = 6; i < 14; ++i) EXPECT_TRUE(equal(loader.next(), whole[static_cast<size_t>(i)])) << i;
}

TEST(RobotLoader, AReadErrorReachesTheConsumerAtItsBatch) {
  // episode position 1 (episode_index 102) cannot be decoded; no shuffle: batches 0-1 hold episode 100's frames
  auto ds = std::make_shared<FakeRobot>(std::vector<int64_t>{8, 4, 8}, 10, 1);
  for (int threads : {0, 3}) {
    LoaderOptions o;
    o.delta_timestamps = act_windows();
    o.batch_size = 4;
    o.threads = threads;
    RobotLoader loader(ds, FrameSampler(*ds, {0, 1, 2}, false, 0), o);
    EXPECT_NO_THROW(loader.next());
    EXPECT_NO_THROW(loader.next());
    auto msg = error_of([&] { loader.next(); });
    EXPECT_EQ(msg, "fake/videos/top.mp4: field 'observation.images.top': episode 102: truncated video") << threads;
    EXPECT_NO_THROW(loader.next());  // the next batch (episode 104) reads again
  }
  // the loader is destroyed with batches in flight and failing: a clean shutdown
  {
    LoaderOptions o;
    o.delta_timestamps = act_windows();
    o.batch_size = 2;
    o.threads = 4;
    o.prefetch = 8;
    RobotLoader loader(ds, FrameSampler(*ds, {0, 1, 2}, true, 1), o);
  }
}

TEST(RobotLoader, OptionErrorsNameTheDatasetAndTheFeature) {
  auto ds = std::make_shared<FakeRobot>(std::vector<int64_t>{4, 4});
  auto make = [&](LoaderOptions o) { RobotLoader loader(ds, FrameSampler(*ds, {0, 1}, false, 0), o); };
  LoaderOptions off;
  off.delta_timestamps = {{"action", {0.0, 0.05}}};
  EXPECT_NE(error_of([&] { make(off); }).find("fake: field 'delta_timestamps.action': offset 0.05"),
            std::string::npos);
  LoaderOptions unknown;
  unknown.delta_timestamps = {{"observation.effort", {0.0}}};
  EXPECT_NE(error_of([&] { make(unknown); }).find("observation.effort"), std::string::npos);
  LoaderOptions text;
  text.features = {"action", "task"};
  EXPECT_NE(error_of([&] { make(text); }).find("fake: field 'task': a text feature"), std::string::npos);
  LoaderOptions not_read;
  not_read.features = {"action"};
  not_read.delta_timestamps = {{"observation.state", {0.0}}};
  EXPECT_NE(error_of([&] { make(not_read); }).find("not among the features read"), std::string::npos);
  LoaderOptions zero;
  zero.batch_size = 0;
  EXPECT_NE(error_of([&] { make(zero); }).find("batch_size"), std::string::npos);
}
