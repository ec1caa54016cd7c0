// video.h through FFmpeg's C API (the one file that includes FFmpeg's headers; LF_HAVE_FFMPEG comes from CMake).
#include "loongforge/data/video.h"

#include <ATen/ATen.h>

#include "loongforge/core/error.h"

#ifdef LF_HAVE_FFMPEG

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <mutex>

extern "C" {
#include <libavcodec/avcodec.h>
#include <libavformat/avformat.h>
#include <libavutil/imgutils.h>
#include <libavutil/opt.h>
#include <libavutil/pixdesc.h>
#include <libswscale/swscale.h>
}

namespace lf::data {

bool video_available() { return true; }

std::string video_backend_description() {
  const unsigned v = avformat_version();
  const AVCodec* enc = avcodec_find_encoder_by_name("libx264");
  if (!enc) enc = avcodec_find_encoder(AV_CODEC_ID_MPEG4);
  return std::string("FFmpeg ") + av_version_info() + " (libavformat " + std::to_string(AV_VERSION_MAJOR(v)) + "." +
         std::to_string(AV_VERSION_MINOR(v)) + "." + std::to_string(AV_VERSION_MICRO(v)) + "), MP4 encoder " +
         (enc ? enc->name : "none");
}

namespace {

// FFmpeg's log: nothing is printed; the last error-level line of this thread goes into our error messages.
thread_local std::string t_last_log;

void log_callback(void* avcl, int level, const char* fmt, va_list vl) {
  if (level > AV_LOG_ERROR) return;
  char line[1024];
  int prefix = 0;  // without the "[context @ address]" prefix
  av_log_format_line2(avcl, level, fmt, vl, line, sizeof line, &prefix);
  std::string s(line);
  while (!s.empty() && (s.back() == '\n' || s.back() == '\r' || s.back() == ' ')) s.pop_back();
  for (char& c : s)
    if (c == '\n' || c == '\r') c = ' ';
  t_last_log = s;
}

void init_ffmpeg() {
  static std::once_flag once;
  std::call_once(once, [] { av_log_set_callback(log_callback); });
  t_last_log.clear();
}

std::string av_error(int err) {
  char buf[AV_ERROR_MAX_STRING_SIZE] = {0};
  av_strerror(err, buf, sizeof buf);
  std::string s(buf);
  if (!t_last_log.empty() && t_last_log.find(s) == std::string::npos) s += " (" + t_last_log + ")";
  return s;
}

[[noreturn]] void fail(const std::string& path, const std::string& what, int err) {
  throw Error(path + ": " + what + ": " + av_error(err));
}

struct FormatInput {
  AVFormatContext* p = nullptr;
  ~FormatInput() { avformat_close_input(&p); }
};
struct CodecContext {
  AVCodecContext* p = nullptr;
  ~CodecContext() { avcodec_free_context(&p); }
};
struct Packet {
  AVPacket* p = av_packet_alloc();
  ~Packet() { av_packet_free(&p); }
};
struct Frame {
  AVFrame* p = av_frame_alloc();
  ~Frame() { av_frame_free(&p); }
};
struct Sws {
  SwsContext* p = nullptr;
  ~Sws() { sws_freeContext(p); }
};

double rate_of(const AVStream* st) {
  AVRational r = st->avg_frame_rate;
  if (r.num <= 0 || r.den <= 0) r = st->r_frame_rate;
  return r.num > 0 && r.den > 0 ? av_q2d(r) : 0.0;
}

// An open decoder of a file's first (best) video stream.
struct Reader {
  std::string path;
  FormatInput fmt;
  CodecContext dec;
  int stream = -1;
  Packet pkt;
  Frame frame;
  bool flushed = false, done = false;
  int64_t first_dts = AV_NOPTS_VALUE;  // the dts of the first packet fed since opening / the last seek

  Reader(const std::string& p, int threads) : path(p) {
    init_ffmpeg();
    std::error_code ec;
    if (!std::filesystem::exists(path, ec)) throw Error(path + ": no such file");
    int err = avformat_open_input(&fmt.p, path.c_str(), nullptr, nullptr);
    if (err < 0) fail(path, "cannot open as a video", err);
    if ((err = avformat_find_stream_info(fmt.p, nullptr)) < 0) fail(path, "cannot read the stream info", err);
    stream = av_find_best_stream(fmt.p, AVMEDIA_TYPE_VIDEO, -1, -1, nullptr, 0);
    if (stream == AVERROR_STREAM_NOT_FOUND) throw Error(path + ": not a video (no video stream)");
    if (stream < 0) throw Error(path + ": no decodable video stream");
    const AVCodecParameters* par = fmt.p->streams[stream]->codecpar;
    const AVCodec* codec = avcodec_find_decoder(par->codec_id);
    if (!codec) {
      char tag[AV_FOURCC_MAX_STRING_SIZE] = {0};
      av_fourcc_make_string(tag, par->codec_tag);
      throw Error(path + ": this FFmpeg has no decoder for its video codec '" + avcodec_get_name(par->codec_id) +
                  "' (tag " + tag + ")");
    }
    dec.p = avcodec_alloc_context3(codec);
    if (!dec.p) throw Error(path + ": out of memory");
    if ((err = avcodec_parameters_to_context(dec.p, fmt.p->streams[stream]->codecpar)) < 0)
      fail(path, "cannot set up the decoder", err);
    dec.p->thread_count = threads;
    if ((err = avcodec_open2(dec.p, codec, nullptr)) < 0) fail(path, "cannot open the decoder", err);
  }

  const AVStream* st() const { return fmt.p->streams[stream]; }

  // The next decoded frame (in `frame`), or false at the end of the stream.
  bool next() {
    while (!done) {
      int err = avcodec_receive_frame(dec.p, frame.p);
      if (err == 0) return true;
      if (err == AVERROR_EOF) {
        done = true;
        break;
      }
      if (err != AVERROR(EAGAIN)) fail(path, "cannot decode", err);
      if (flushed) {
        done = true;
        break;
      }
      // feed the decoder one packet of our stream (or the end)
      for (;;) {
        err = av_read_frame(fmt.p, pkt.p);
        if (err == AVERROR_EOF) {
          avcodec_send_packet(dec.p, nullptr);
          flushed = true;
          break;
        }
        if (err < 0) fail(path, "cannot read", err);
        if (pkt.p->stream_index != stream) {
          av_packet_unref(pkt.p);
          continue;
        }
        if (first_dts == AV_NOPTS_VALUE) first_dts = pkt.p->dts;
        err = avcodec_send_packet(dec.p, pkt.p);
        av_packet_unref(pkt.p);
        if (err < 0 && err != AVERROR(EAGAIN)) fail(path, "cannot decode", err);
        break;
      }
    }
    return false;
  }

  // Repositions at the keyframe at or before DTS (stream time base) and resets the decoder.
  void seek(int64_t dts) {
    int err = av_seek_frame(fmt.p, stream, dts, AVSEEK_FLAG_BACKWARD);
    if (err < 0) fail(path, "cannot seek to dts " + std::to_string(dts), err);
    avcodec_flush_buffers(dec.p);
    flushed = done = false;
    first_dts = AV_NOPTS_VALUE;
  }
};

// swscale's colour space number of a frame's AVColorSpace (the same numbers for those swscale knows).
int sws_colorspace(AVColorSpace cs) {
  switch (cs) {
    case AVCOL_SPC_BT709: return SWS_CS_ITU709;
    case AVCOL_SPC_FCC: return SWS_CS_FCC;
    case AVCOL_SPC_BT470BG: return SWS_CS_ITU601;
    case AVCOL_SPC_SMPTE170M: return SWS_CS_SMPTE170M;
    case AVCOL_SPC_SMPTE240M: return SWS_CS_SMPTE240M;
    case AVCOL_SPC_BT2020_NCL:
    case AVCOL_SPC_BT2020_CL: return SWS_CS_BT2020;
    default: return SWS_CS_DEFAULT;
  }
}

std::string pix_fmt_name(AVPixelFormat f) {
  const char* n = av_get_pix_fmt_name(f);
  return n ? n : "unknown";
}

bool full_range_format(AVPixelFormat f) {
  return f == AV_PIX_FMT_YUVJ420P || f == AV_PIX_FMT_YUVJ422P || f == AV_PIX_FMT_YUVJ444P ||
         f == AV_PIX_FMT_YUVJ440P || f == AV_PIX_FMT_YUVJ411P;
}

// Frame -> DST pixels as PyAV's to_ndarray(format=DST): a frame already in DST as it is, any other through swscale
// (SWS_BILINEAR); to RGB24 with the frame's colour space (BT.601 when unspecified) and range (limited when
// unspecified, full for the yuvj formats). Into OUT: H rows of W * BYTES bytes.
class FrameConverter {
 public:
  FrameConverter(AVPixelFormat dst, int bytes) : dst_(dst), bytes_(bytes) {}

  void convert(const std::string& path, const AVFrame* f, uint8_t* out) {
    const auto fmt = static_cast<AVPixelFormat>(f->format);
    const size_t row = static_cast<size_t>(f->width) * bytes_;
    if (fmt == dst_ && dst_ != AV_PIX_FMT_RGB24) {  // (RGB24 keeps the swscale path it always took)
      for (int y = 0; y < f->height; ++y)
        std::memcpy(out + y * row, f->data[0] + static_cast<ptrdiff_t>(y) * f->linesize[0], row);
      return;
    }
    if (!sws_.p || fmt != fmt_ || f->width != w_ || f->height != h_ || f->colorspace != cs_ ||
        f->color_range != range_) {
      sws_freeContext(sws_.p);
      sws_.p = sws_getContext(f->width, f->height, fmt, f->width, f->height, dst_, SWS_BILINEAR, nullptr, nullptr,
                              nullptr);
      if (!sws_.p)
        throw Error(path + ": cannot convert its pixel format " + pix_fmt_name(fmt) + " to " + pix_fmt_name(dst_));
      const AVPixFmtDescriptor* d = av_pix_fmt_desc_get(fmt);
      if (dst_ == AV_PIX_FMT_RGB24 && d && !(d->flags & AV_PIX_FMT_FLAG_RGB) && d->nb_components >= 3) {
        const int src_full = f->color_range == AVCOL_RANGE_JPEG || full_range_format(fmt);
        sws_setColorspaceDetails(sws_.p, sws_getCoefficients(sws_colorspace(f->colorspace)), src_full,
                                 sws_getCoefficients(SWS_CS_DEFAULT), 1, 0, 1 << 16, 1 << 16);
      }
      fmt_ = fmt, w_ = f->width, h_ = f->height, cs_ = f->colorspace, range_ = f->color_range;
      buf_.reset();
      // an aligned buffer (swscale's SIMD code may write past the end of a row)
      int err = av_image_alloc(line_data_, linesize_, w_, h_, dst_, 64);
      if (err < 0) fail(path, "cannot allocate a frame", err);
      buf_.reset(line_data_[0]);
    }
    sws_scale(sws_.p, f->data, f->linesize, 0, h_, line_data_, linesize_);
    for (int y = 0; y < h_; ++y)
      std::memcpy(out + y * row, line_data_[0] + static_cast<size_t>(y) * linesize_[0], row);
  }

 private:
  struct AvFree {
    void operator()(uint8_t* p) const { av_free(p); }
  };
  const AVPixelFormat dst_;
  const int bytes_;
  Sws sws_;
  AVPixelFormat fmt_ = AV_PIX_FMT_NONE;
  int w_ = 0, h_ = 0;
  AVColorSpace cs_ = AVCOL_SPC_UNSPECIFIED;
  AVColorRange range_ = AVCOL_RANGE_UNSPECIFIED;
  uint8_t* line_data_[4] = {nullptr};
  int linesize_[4] = {0};
  std::unique_ptr<uint8_t, AvFree> buf_;
};

// What decode_video and the RGB GopDecoder give (PyAV's to_ndarray("rgb24")), and LeRobot's depth frames
// (to_ndarray("gray12le"): 12-bit codes in 16 bits).
struct RgbConverter : FrameConverter {
  RgbConverter() : FrameConverter(AV_PIX_FMT_RGB24, 3) {}
};
struct Gray12Converter : FrameConverter {
  Gray12Converter() : FrameConverter(AV_PIX_FMT_GRAY12LE, 2) {}
};

}  // namespace

VideoInfo probe_video(const std::string& path) {
  Reader r(path, 1);
  VideoInfo info;
  info.width = r.st()->codecpar->width;
  info.height = r.st()->codecpar->height;
  info.fps = rate_of(r.st());
  info.num_frames = r.st()->nb_frames;
  if (info.num_frames <= 0) {  // the container does not say: count by decoding
    info.num_frames = 0;
    while (r.next()) ++info.num_frames;
  }
  return info;
}

DecodedVideo decode_video(const std::string& path, const DecodeOptions& o) {
  if (o.num_frames < 0) throw Error(path + ": num_frames " + std::to_string(o.num_frames) + " is negative");
  if (o.stride < 1) throw Error(path + ": stride " + std::to_string(o.stride) + " must be at least 1");
  if (o.start < 0) throw Error(path + ": start " + std::to_string(o.start) + " is negative");
  Reader r(path, o.threads);
  DecodedVideo out;
  out.fps = rate_of(r.st());
  const int64_t recorded = r.st()->nb_frames;
  const bool all = o.num_frames == 0;
  const int64_t last = all ? -1 : o.start + (o.num_frames - 1) * o.stride;  // the last frame the selection needs
  std::vector<at::Tensor> kept;
  RgbConverter rgb;
  int64_t i = 0, height = -1, width = -1;
  for (; r.next(); ++i) {
    const AVFrame* f = r.frame.p;
    if (!all && i > last) {
      if (recorded > 0) break;  // the container knows the count: no need to decode the rest
      continue;                 // else count the frames to the end
    }
    const bool keep = all || (i >= o.start && (i - o.start) % o.stride == 0);
    if (!keep) continue;
    if (height < 0) height = f->height, width = f->width;
    if (f->height != height || f->width != width)
      throw Error(path + ": frame " + std::to_string(i) + " is " + std::to_string(f->width) + "x" +
                  std::to_string(f->height) + ", frame 0 of the selection " + std::to_string(width) + "x" +
                  std::to_string(height) + " (the size changes within the clip)");
    at::Tensor t = at::empty({height, width, 3}, at::kByte);
    rgb.convert(path, f, t.data_ptr<uint8_t>());
    kept.push_back(t);
  }
  const int64_t counted = i;
  out.num_frames = recorded > 0 ? recorded : counted;
  if (!all && static_cast<int64_t>(kept.size()) < o.num_frames) {
    throw Error(path + ": asked for " + std::to_string(o.num_frames) + " frames (every " + std::to_string(o.stride) +
                " from frame " + std::to_string(o.start) + ", up to frame " + std::to_string(last) +
                "), the clip has " + std::to_string(counted) + " frames");
  }
  if (kept.empty()) throw Error(path + ": the video has no frames");
  out.frames = at::stack(kept);
  return out;
}


int64_t VideoTimeline::gop_of(int64_t frame) const {
  auto it = std::upper_bound(gop_starts.begin(), gop_starts.end() - 1, frame);
  return std::max<int64_t>(0, (it - gop_starts.begin()) - 1);
}

VideoTimeline read_video_timeline(const std::string& path) {
  Reader r(path, 1);
  VideoTimeline t;
  t.path = path;
  t.codec = r.dec.p->codec ? r.dec.p->codec->name : "unknown";
  t.width = r.st()->codecpar->width;
  t.height = r.st()->codecpar->height;
  const AVRational tb = r.st()->time_base;
  std::vector<std::pair<int64_t, int64_t>> keys;  // (pts, dts) of the keyframes, in decoding order
  int64_t packets = 0;
  for (;;) {
    int err = av_read_frame(r.fmt.p, r.pkt.p);
    if (err == AVERROR_EOF) break;
    if (err < 0) fail(path, "cannot read (truncated or corrupt?)", err);
    const AVPacket* p = r.pkt.p;
    if (p->stream_index == r.stream) {
      ++packets;
      const int64_t pts = p->pts != AV_NOPTS_VALUE ? p->pts : p->dts;
      if (pts == AV_NOPTS_VALUE) {
        av_packet_unref(r.pkt.p);
        throw Error(path + ": packet " + std::to_string(packets - 1) + " has no timestamp");
      }
      if (p->flags & AV_PKT_FLAG_KEY) keys.emplace_back(pts, p->dts != AV_NOPTS_VALUE ? p->dts : pts);
      if (!(p->flags & AV_PKT_FLAG_DISCARD)) t.pts.push_back(pts);  // the decoder drops discarded frames
    }
    av_packet_unref(r.pkt.p);
  }
  const int64_t recorded = r.st()->nb_frames;
  if (recorded > 0 && packets < recorded)
    throw Error(path + ": truncated: the container lists " + std::to_string(recorded) + " frames, " +
                std::to_string(packets) + " can be read");
  if (t.pts.empty()) throw Error(path + ": the video has no frames");
  if (keys.empty()) throw Error(path + ": the video has no keyframe");
  std::sort(t.pts.begin(), t.pts.end());
  t.pts.erase(std::unique(t.pts.begin(), t.pts.end()), t.pts.end());
  t.times.reserve(t.pts.size());
  for (int64_t p : t.pts) t.times.push_back(static_cast<double>(p) * av_q2d(tb));
  // GOP g: the frames from keyframe g's pts up to the next keyframe's (keyframes whose pts do not increase, or
  // that start no frame, are merged into the GOP before)
  int64_t last_pts = INT64_MIN;
  for (const auto& [kpts, kdts] : keys) {
    if (kpts <= last_pts) continue;
    const int64_t start = std::lower_bound(t.pts.begin(), t.pts.end(), kpts) - t.pts.begin();
    if (start >= static_cast<int64_t>(t.pts.size())) break;
    if (t.gop_starts.empty()) {
      t.gop_starts.push_back(0);  // frames before the first keyframe (if any) decode with its GOP
    } else if (start == t.gop_starts.back()) {
      continue;
    } else {
      t.gop_starts.push_back(start);
    }
    t.gop_key_pts.push_back(kpts);
    t.gop_key_dts.push_back(kdts);
    last_pts = kpts;
  }
  t.gop_starts.push_back(static_cast<int64_t>(t.pts.size()));
  return t;
}

struct GopDecoder::Impl {
  std::shared_ptr<const VideoTimeline> t;
  Reader r;
  FramePixels pixels;
  RgbConverter rgb;
  Gray12Converter gray;
  int64_t decoded = 0;
  Impl(std::shared_ptr<const VideoTimeline> tl, FramePixels p) : t(std::move(tl)), r(t->path, 1), pixels(p) {}
};

GopDecoder::GopDecoder(std::shared_ptr<const VideoTimeline> timeline, FramePixels pixels)
    : impl_(std::make_unique<Impl>(std::move(timeline), pixels)) {}
GopDecoder::~GopDecoder() = default;
int64_t GopDecoder::frames_decoded() const { return impl_->decoded; }

at::Tensor GopDecoder::decode(int64_t g) {
  const VideoTimeline& t = *impl_->t;
  Reader& r = impl_->r;
  init_ffmpeg();
  if (g < 0 || g >= t.num_gops())
    throw Error(t.path + ": GOP " + std::to_string(g) + " out of range (the video has " +
                std::to_string(t.num_gops()) + ")");
  const int64_t first = t.gop_starts[g], last = t.gop_starts[g + 1], n = last - first;
  const bool gray = impl_->pixels == FramePixels::gray12;
  at::Tensor out = gray ? at::empty({n, t.height, t.width, 1}, at::kShort)
                        : at::empty({n, t.height, t.width, 3}, at::kByte);
  std::vector<char> got(n, 0);
  int64_t remaining = n;
  r.seek(t.gop_key_pts[g]);  // as PyAV's container.seek(..., backward=True): the keyframe at or before
  bool checked = false;
  while (remaining > 0 && r.next()) {
    if (!checked) {
      checked = true;
      if (r.first_dts != AV_NOPTS_VALUE && r.first_dts > t.gop_key_dts[g]) {
        r.seek(t.gop_key_pts[0]);  // the seek went past the keyframe: decode from the start instead
        continue;
      }
    }
    ++impl_->decoded;
    const AVFrame* f = r.frame.p;
    const int64_t pts = f->pts != AV_NOPTS_VALUE ? f->pts : f->best_effort_timestamp;
    const int64_t i = std::lower_bound(t.pts.begin(), t.pts.end(), pts) - t.pts.begin();
    if (i >= last + 8) break;  // past the GOP (decoders give frames in presentation order)
    if (i < first || i >= last || t.pts[i] != pts || got[i - first]) continue;
    if (f->width != t.width || f->height != t.height)
      throw Error(t.path + ": the frame at pts " + std::to_string(pts) + " is " + std::to_string(f->width) + "x" +
                  std::to_string(f->height) + ", the stream " + std::to_string(t.width) + "x" +
                  std::to_string(t.height));
    if (gray)
      impl_->gray.convert(t.path, f, static_cast<uint8_t*>(out.data_ptr()) + (i - first) * t.height * t.width * 2);
    else
      impl_->rgb.convert(t.path, f, out.data_ptr<uint8_t>() + (i - first) * t.height * t.width * 3);
    got[i - first] = 1;
    --remaining;
  }
  if (remaining > 0) {
    int64_t miss = 0;
    while (got[miss]) ++miss;
    throw Error(t.path + ": cannot decode the frame at " + std::to_string(t.times[first + miss]) +
                " s (GOP " + std::to_string(g) + ": " + std::to_string(remaining) + " of its " + std::to_string(n) +
                " frames did not come out of the decoder; truncated or corrupt?)");
  }
  return out;
}

namespace {

struct FormatOutput {
  AVFormatContext* p = nullptr;
  ~FormatOutput() {
    if (p) {
      if (p->pb) avio_closep(&p->pb);
      avformat_free_context(p);
    }
  }
};

}  // namespace

std::string encode_video(const std::string& path, const at::Tensor& frames_in, double fps) {
  init_ffmpeg();
  if (frames_in.dim() != 4 || frames_in.size(3) != 3 || frames_in.scalar_type() != at::kByte) {
    std::string shape = "[";
    for (int64_t d = 0; d < frames_in.dim(); ++d) shape += (d ? ", " : "") + std::to_string(frames_in.size(d));
    throw Error(path + ": the frames must be uint8 [F, H, W, 3], got " + std::string(c10::toString(frames_in.scalar_type())) +
                " " + shape + "]");
  }
  const int64_t n = frames_in.size(0), h = frames_in.size(1), w = frames_in.size(2);
  if (n < 1 || h < 1 || w < 1) throw Error(path + ": no frames to write (the frames are empty)");
  if (h % 2 || w % 2)
    throw Error(path + ": the frames are " + std::to_string(w) + "x" + std::to_string(h) +
                ": yuv420p video needs an even width and height");
  if (!(fps > 0) || !std::isfinite(fps)) throw Error(path + ": fps " + std::to_string(fps) + " must be positive");
  const at::Tensor frames = frames_in.to(at::kCPU).contiguous();

  const AVCodec* codec = avcodec_find_encoder_by_name("libx264");
  if (!codec) codec = avcodec_find_encoder(AV_CODEC_ID_MPEG4);
  if (!codec) throw Error(path + ": this FFmpeg has neither the libx264 nor the mpeg4 encoder");
  const bool x264 = std::strcmp(codec->name, "libx264") == 0;

  const std::filesystem::path target(path);
  std::string tmp_name = target.filename().string();  // ".NAME.tmp.PID.mp4" beside PATH
  tmp_name.insert(0, 1, '.');
  tmp_name.append(".tmp.").append(std::to_string(::getpid())).append(".mp4");
  const std::string tmp = (target.parent_path() / tmp_name).string();
  struct Unlink {
    std::string f;
    bool keep = false;
    ~Unlink() {
      if (!keep) ::unlink(f.c_str());
    }
  } cleanup{tmp};

  FormatOutput oc;
  int err = avformat_alloc_output_context2(&oc.p, nullptr, "mp4", tmp.c_str());
  if (err < 0 || !oc.p) fail(path, "cannot set up the MP4 writer", err);
  AVStream* st = avformat_new_stream(oc.p, nullptr);
  if (!st) throw Error(path + ": cannot add a video stream");
  CodecContext cc;
  cc.p = avcodec_alloc_context3(codec);
  if (!cc.p) throw Error(path + ": out of memory");
  const AVRational rate = av_d2q(fps, 65535);
  cc.p->width = static_cast<int>(w);
  cc.p->height = static_cast<int>(h);
  cc.p->pix_fmt = AV_PIX_FMT_YUV420P;
  cc.p->time_base = av_inv_q(rate);
  cc.p->framerate = rate;
  cc.p->color_range = AVCOL_RANGE_MPEG;
  cc.p->colorspace = AVCOL_SPC_SMPTE170M;
  if (oc.p->oformat->flags & AVFMT_GLOBALHEADER) cc.p->flags |= AV_CODEC_FLAG_GLOBAL_HEADER;
  if (x264) {
    av_opt_set(cc.p->priv_data, "crf", "18", 0);
    av_opt_set(cc.p->priv_data, "preset", "medium", 0);
  } else {
    cc.p->flags |= AV_CODEC_FLAG_QSCALE;
    cc.p->global_quality = FF_QP2LAMBDA * 2;
    cc.p->gop_size = 12;
  }
  if ((err = avcodec_open2(cc.p, codec, nullptr)) < 0) fail(path, std::string("cannot open the ") + codec->name + " encoder", err);
  if ((err = avcodec_parameters_from_context(st->codecpar, cc.p)) < 0) fail(path, "cannot set up the stream", err);
  st->time_base = cc.p->time_base;
  st->avg_frame_rate = rate;
  if ((err = avio_open(&oc.p->pb, tmp.c_str(), AVIO_FLAG_WRITE)) < 0) fail(path, "cannot write", err);
  if ((err = avformat_write_header(oc.p, nullptr)) < 0) fail(path, "cannot write the MP4 header", err);

  Frame yuv;
  yuv.p->format = AV_PIX_FMT_YUV420P;
  yuv.p->width = static_cast<int>(w);
  yuv.p->height = static_cast<int>(h);
  yuv.p->color_range = AVCOL_RANGE_MPEG;
  yuv.p->colorspace = AVCOL_SPC_SMPTE170M;
  if ((err = av_frame_get_buffer(yuv.p, 0)) < 0) fail(path, "cannot allocate a frame", err);
  Sws sws;
  sws.p = sws_getContext(static_cast<int>(w), static_cast<int>(h), AV_PIX_FMT_RGB24, static_cast<int>(w),
                         static_cast<int>(h), AV_PIX_FMT_YUV420P, SWS_BICUBIC | SWS_ACCURATE_RND, nullptr, nullptr,
                         nullptr);
  if (!sws.p) throw Error(path + ": cannot set up the RGB to YUV conversion");
  sws_setColorspaceDetails(sws.p, sws_getCoefficients(SWS_CS_DEFAULT), 1, sws_getCoefficients(SWS_CS_ITU601), 0, 0,
                           1 << 16, 1 << 16);

  Packet pkt;
  auto drain = [&] {
    for (;;) {
      int e = avcodec_receive_packet(cc.p, pkt.p);
      if (e == AVERROR(EAGAIN) || e == AVERROR_EOF) return;
      if (e < 0) fail(path, "cannot encode", e);
      av_packet_rescale_ts(pkt.p, cc.p->time_base, st->time_base);
      pkt.p->stream_index = st->index;
      e = av_interleaved_write_frame(oc.p, pkt.p);
      if (e < 0) fail(path, "cannot write", e);
    }
  };
  const uint8_t* base = frames.data_ptr<uint8_t>();
  const int src_stride = static_cast<int>(w * 3);
  for (int64_t i = 0; i < n; ++i) {
    if ((err = av_frame_make_writable(yuv.p)) < 0) fail(path, "cannot allocate a frame", err);
    const uint8_t* src[4] = {base + i * h * w * 3, nullptr, nullptr, nullptr};
    const int src_lines[4] = {src_stride, 0, 0, 0};
    sws_scale(sws.p, src, src_lines, 0, static_cast<int>(h), yuv.p->data, yuv.p->linesize);
    yuv.p->pts = i;
    if ((err = avcodec_send_frame(cc.p, yuv.p)) < 0) fail(path, "cannot encode", err);
    drain();
  }
  if ((err = avcodec_send_frame(cc.p, nullptr)) < 0) fail(path, "cannot encode", err);
  drain();
  if ((err = av_write_trailer(oc.p)) < 0) fail(path, "cannot finish the MP4", err);
  if ((err = avio_closep(&oc.p->pb)) < 0) fail(path, "cannot write", err);
  std::error_code ec;
  std::filesystem::rename(tmp, target, ec);
  if (ec) throw Error(path + ": cannot rename the temporary file onto it: " + ec.message());
  cleanup.keep = true;
  return codec->name;
}

}  // namespace lf::data

#else  // no FFmpeg in this build

namespace lf::data {

namespace {
[[noreturn]] void no_ffmpeg(const std::string& path) {
  throw Error(path + ": this build has no FFmpeg (install libavformat-dev libavcodec-dev libavutil-dev "
                     "libswscale-dev and rebuild)");
}
}  // namespace

bool video_available() { return false; }
std::string video_backend_description() {
  return "none: this build has no FFmpeg (install libavformat-dev libavcodec-dev libavutil-dev libswscale-dev and "
         "rebuild)";
}
VideoInfo probe_video(const std::string& path) { no_ffmpeg(path); }
DecodedVideo decode_video(const std::string& path, const DecodeOptions&) { no_ffmpeg(path); }
std::string encode_video(const std::string& path, const at::Tensor&, double) { no_ffmpeg(path); }
int64_t VideoTimeline::gop_of(int64_t) const { return 0; }
VideoTimeline read_video_timeline(const std::string& path) { no_ffmpeg(path); }
struct GopDecoder::Impl {};
GopDecoder::GopDecoder(std::shared_ptr<const VideoTimeline> t, FramePixels) { no_ffmpeg(t->path); }
GopDecoder::~GopDecoder() = default;
at::Tensor GopDecoder::decode(int64_t) { return {}; }
int64_t GopDecoder::frames_decoded() const { return 0; }

}  // namespace lf::data

#endif
