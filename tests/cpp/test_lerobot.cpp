// The GOP cache of robot video cameras (data/robot/video_frames.h) and the LeRobot reader under threads, as a hook
// of tests/python/test_lerobot_dataset.py, which writes the dataset with lerobot (LF_TEST_LEROBOT_VIDEO: an AV1 or
// H.264 mp4 of several episodes with 2-frame GOPs; LF_TEST_LEROBOT_DATASET: its v3.0 folder). The frames themselves are
// compared with lerobot's there; here: how often GOPs are decoded, and that threads agree. Also: info.json's path
// templates cannot name files outside the dataset folder.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <array>
#include <cstdlib>
#include <fstream>
#include <random>
#include <thread>
#include <vector>

#include "loongforge/core/error.h"
#include "loongforge/data/robot/dataset.h"
#include "loongforge/data/robot/video_frames.h"
#include "loongforge/data/video.h"
#include "test_util.h"

namespace robot = lf::data::robot;

TEST(RobotLeRobot, GopCacheHook) {
  const char* video = std::getenv("LF_TEST_LEROBOT_VIDEO");
  const char* folder = std::getenv("LF_TEST_LEROBOT_DATASET");
  if (!video || !folder) GTEST_SKIP() << "run by tests/python/test_lerobot_dataset.py";

  const lf::data::VideoTimeline tl = lf::data::read_video_timeline(video);
  const int64_t n = static_cast<int64_t>(tl.times.size());
  ASSERT_GT(tl.num_gops(), 4);
  ASSERT_EQ(tl.gop_starts.back(), n);

  // Sequential reads, one frame per call as a loader asks: each GOP decoded once, every other call a cache hit.
  robot::VideoFrameCache seq;
  std::vector<at::Tensor> frames;
  for (int64_t i = 0; i < n; ++i) frames.push_back(seq.frames_at(video, {tl.times[i]}, 1e-4, "test")[0]);
  auto c = seq.counters();
  EXPECT_EQ(c.gop_decodes, tl.num_gops());
  EXPECT_EQ(c.gop_hits, n - tl.num_gops());
  EXPECT_EQ(c.evictions, 0);
  EXPECT_EQ(c.frames_decoded, n);  // every seek landed on its GOP's keyframe: no frame decoded twice
  // The whole clip at once equals decode_video's frames (the same conversion), and the per-frame reads.
  const at::Tensor all = lf::data::decode_video(video).frames;
  ASSERT_EQ(all.size(0), n);
  EXPECT_TRUE(at::equal(at::stack(frames), all));
  // Nearest frame: a time a bit off a frame's (within tolerance) gives that frame.
  EXPECT_TRUE(at::equal(seq.frames_at(video, {tl.times[3] + 4e-5, tl.times[5] - 4e-5}, 1e-4, "test"),
                        at::stack({all[3], all[5]})));
  EXPECT_THROW(seq.frames_at(video, {tl.times[3] + 0.02}, 1e-4, "test"), lf::Error);

  // Threads asking for the same frames in different orders: the same frames, each GOP decoded once overall.
  robot::VideoFrameCache shared;
  const int threads = 6;
  std::vector<at::Tensor> got(threads);
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      std::vector<int64_t> order(n);
      for (int64_t i = 0; i < n; ++i) order[i] = i;
      std::shuffle(order.begin(), order.end(), std::mt19937(t));
      at::Tensor out = at::empty_like(all);
      for (int64_t i : order) out[i].copy_(shared.frames_at(video, {tl.times[i]}, 1e-4, "test")[0]);
      got[t] = out;
    });
  for (auto& th : pool) th.join();
  for (int t = 0; t < threads; ++t) EXPECT_TRUE(at::equal(got[t], all)) << "thread " << t;
  c = shared.counters();
  EXPECT_EQ(c.gop_decodes, tl.num_gops());
  EXPECT_EQ(c.gop_decodes + c.gop_hits, threads * n);
  EXPECT_EQ(c.frames_decoded, n);

  // A budget of one GOP: evictions, the same frames.
  robot::VideoFrameCache small(all[0].nbytes() * 2);
  std::vector<int64_t> many;
  for (int64_t i = n - 1; i >= 0; i -= 3) many.push_back(i);
  std::vector<double> times;
  for (int64_t i : many) times.push_back(tl.times[i]);
  const at::Tensor back = small.frames_at(video, times, 1e-4, "test");
  for (size_t k = 0; k < many.size(); ++k) EXPECT_TRUE(at::equal(back[k], all[many[k]]));
  EXPECT_GT(small.counters().evictions, 0);
  EXPECT_LE(small.counters().bytes, all[0].nbytes() * 2);

  // The dataset: read_camera of every episode from several threads equals the single-threaded read.
  const auto ds = robot::open_lerobot_dataset(folder);
  const std::string cam = "observation.images.top";
  std::vector<at::Tensor> ref;
  for (size_t e = 0; e < ds->episodes().size(); ++e) {
    std::vector<int64_t> idx(ds->episodes()[e].length);
    for (size_t i = 0; i < idx.size(); ++i) idx[i] = static_cast<int64_t>(i);
    ref.push_back(ds->read_camera(cam, static_cast<int64_t>(e), idx));
  }
  EXPECT_TRUE(at::equal(at::cat(ref), all));  // the episodes end to end are the video
  const auto ds2 = robot::open_lerobot_dataset(folder);
  std::vector<int> ok(threads, 0);
  pool.clear();
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      bool same = true;
      for (size_t k = 0; k < ds2->episodes().size(); ++k) {
        const size_t e = (k + t) % ds2->episodes().size();
        std::vector<int64_t> idx(ds2->episodes()[e].length);
        for (size_t i = 0; i < idx.size(); ++i) idx[i] = static_cast<int64_t>(idx.size() - 1 - i);
        const at::Tensor x = ds2->read_camera(cam, static_cast<int64_t>(e), idx).flip(0);
        const auto num = ds2->read_numeric({"index", "observation.state"}, static_cast<int64_t>(e), 0,
                                           ds2->episodes()[e].length);
        same = same && at::equal(x, ref[e]) && num[0].size(0) == ds2->episodes()[e].length;
      }
      ok[t] = same;
    });
  for (auto& th : pool) th.join();
  for (int t = 0; t < threads; ++t) EXPECT_TRUE(ok[t]) << "thread " << t;
}

// info.json's path templates, and the feature names video_path formats, are the dataset's: a file they name outside
// the dataset folder (through "..", or an absolute path) is one line naming info.json and the field, before anything
// is read.
TEST(RobotLeRobot, PathsStayInsideTheDataset) {
  const std::filesystem::path d = lf::test::temp_dir();
  std::filesystem::create_directories(d / "ds" / "meta");
  {
    std::ofstream(d / "ds" / "meta" / "episodes.jsonl") << R"({"episode_index": 0, "tasks": [], "length": 3})" << "\n";
  }
  auto open_with = [&](const std::string& data_path, const std::string& video_path, const std::string& camera) {
    std::string features = R"({"action": {"dtype": "float32", "shape": [2]})";
    if (!camera.empty()) features += R"(, ")" + camera + R"(": {"dtype": "video", "shape": [4, 4, 3]})";
    std::ofstream(d / "ds" / "meta" / "info.json")
        << R"({"codebase_version": "v2.1", "fps": 10, "data_path": ")" << data_path << R"(", "video_path": ")"
        << video_path << R"(", "features": )" << features << "}}";
    return lf::test::error_of([&] { robot::open_lerobot_dataset((d / "ds").string()); });
  };
  const std::string info = (d / "ds" / "meta" / "info.json").string();
  const std::string data = "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet";
  const std::string video = "videos/chunk-{episode_chunk:03d}/{video_key}/episode_{episode_index:06d}.mp4";
  for (const auto& [data_path, video_path, camera, field] :
       std::vector<std::array<std::string, 4>>{{"../outside/episode_{episode_index:06d}.parquet", video, "", "data_path"},
                                               {"data/../../episode.parquet", video, "", "data_path"},
                                               {"/tmp/episode_{episode_index:06d}.parquet", video, "", "data_path"},
                                               {data, "../{video_key}.mp4", "observation.images.top", "video_path"},
                                               {data, video, "../../../x", "video_path"}}) {
    const std::string e = open_with(data_path, video_path, camera);
    EXPECT_NE(e.find(info), std::string::npos) << e;
    EXPECT_NE(e.find(field), std::string::npos) << e;
    EXPECT_NE(e.find("outside the dataset folder"), std::string::npos) << e;
    EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  }
  // ".." inside a name is not a parent folder
  const std::string e = open_with("data/episode..{episode_index}.parquet", video, "");
  EXPECT_EQ(e.find("outside the dataset folder"), std::string::npos) << e;
  EXPECT_NE(e.find("episode..0.parquet"), std::string::npos) << e;
}
