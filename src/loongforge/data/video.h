// Video input/output through FFmpeg's libraries (libavformat, libavcodec, libswscale), for diffusion training data
// and video samples. Frames are uint8 tensors [F, H, W, 3] (RGB), as data/image/ gives images [H, W, 3].
// Decoding converts each frame to RGB with swscale as PyAV's `frame.to_ndarray(format="rgb24")` does (SWS_BILINEAR,
// the frame's own colour space and range; BT.601 limited range when the stream does not say). FFmpeg's own log is
// silenced: its last error is part of our one-line lf::Error. A build without FFmpeg (CMake found no libavformat)
// still has these functions: each throws one line saying so (video_available() tells which).
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace lf::data {

// Whether this build has FFmpeg (LF_HAVE_FFMPEG), and what it is ("FFmpeg 5.1.6 (libavformat 59.27.100), MP4
// encoder libx264", or "none: this build has no FFmpeg ..."), for `loongforge env`.
bool video_available();
std::string video_backend_description();

// The first video stream of a file, without decoding its frames.
struct VideoInfo {
  int64_t width = 0, height = 0;
  double fps = 0;          // the stream's average frame rate (its r_frame_rate when the container has none)
  int64_t num_frames = 0;  // frames recorded by the container; when it records none, counted by decoding
};
VideoInfo probe_video(const std::string& path);

// Which frames decode_video keeps: every frame (num_frames = 0), or num_frames frames start, start + stride, ...
// (counted in decoding order of presentation: frame i is the i-th frame the decoder gives).
struct DecodeOptions {
  int64_t num_frames = 0;
  int64_t stride = 1;
  int64_t start = 0;
  int threads = 1;  // decoder threads (0: FFmpeg's choice); the frames do not depend on it
};

struct DecodedVideo {
  at::Tensor frames;       // uint8 [F, H, W, 3]
  double fps = 0;          // as VideoInfo::fps
  int64_t num_frames = 0;  // the clip's frame count (as VideoInfo::num_frames)
};

// Decodes PATH's first video stream. Errors (one-line lf::Error naming PATH): a missing, unreadable or non-video
// file; options out of range; a clip with fewer frames than the selection needs ("asked for N frames ..., the clip
// has M").
DecodedVideo decode_video(const std::string& path, const DecodeOptions& options = {});

// Writes FRAMES (uint8 [F, H, W, 3], F >= 1, even H and W: yuv420p halves the chroma) as an MP4 at FPS frames per
// second: H.264 through libx264 when this FFmpeg has it (CRF 18), else FFmpeg's MPEG-4 part 2 encoder (high quality
// fixed quantiser); pixels yuv420p, BT.601 limited range (tagged so). Atomic: written to a temporary file in the same
// folder, renamed onto PATH at the end. Returns the encoder's name ("libx264" / "mpeg4").
std::string encode_video(const std::string& path, const at::Tensor& frames, double fps);

// Random access by time (robot datasets read a camera's frames at given timestamps): a file's frame timeline, read
// by demuxing its packets (no decoding), and a decoder of one GOP (a keyframe and the frames up to the next one)
// at a time. Times are the frames' pts in seconds (pts * the stream's time base), as PyAV's frame.pts * time_base.
struct VideoTimeline {
  std::string path;
  std::string codec;             // the decoder's name ("libdav1d", "h264", ...)
  int64_t width = 0, height = 0;
  std::vector<int64_t> pts;      // every frame's pts (stream time base), ascending (presentation order)
  std::vector<double> times;     // the same in seconds
  // GOP g holds the frames [gop_starts[g], gop_starts[g + 1]) (indices into pts); num_gops() + 1 entries.
  std::vector<int64_t> gop_starts;
  std::vector<int64_t> gop_key_pts, gop_key_dts;  // per GOP: its keyframe's pts and dts (where decoding starts)
  int64_t num_gops() const { return static_cast<int64_t>(gop_starts.size()) - 1; }
  // The GOP holding frame I.
  int64_t gop_of(int64_t frame) const;
};
// Errors (one-line lf::Error naming PATH): missing, unreadable or truncated file, no video stream, no frames.
VideoTimeline read_video_timeline(const std::string& path);

// What a GopDecoder gives per frame: RGB (uint8 [H, W, 3], as decode_video converts), or 12-bit grey codes as
// PyAV's to_ndarray(format="gray12le") (int16 [H, W, 1], 0..4095): LeRobot's depth videos (HEVC, gray12le).
enum class FramePixels { rgb24, gray12 };

// One open decoder of one video file (not thread-safe: use one per thread).
class GopDecoder {
 public:
  explicit GopDecoder(std::shared_ptr<const VideoTimeline> timeline, FramePixels pixels = FramePixels::rgb24);
  ~GopDecoder();
  GopDecoder(const GopDecoder&) = delete;
  GopDecoder& operator=(const GopDecoder&) = delete;
  // GOP G's frames, uint8 [gop_starts[G + 1] - gop_starts[G], H, W, 3], RGB as decode_video converts (gray12:
  // int16 [..., H, W, 1]): seeks to the keyframe and decodes forward until every frame of the GOP is out.
  at::Tensor decode(int64_t gop);
  // Frames the decoder gave so far (all calls): a GOP's own frames when the seek lands on its keyframe.
  int64_t frames_decoded() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace lf::data
