#include "loongforge/io/tensorboard.h"

#include <unistd.h>

#include <array>
#include <bit>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>

#include "loongforge/core/error.h"

namespace lf::io {
namespace tfrecord {
namespace {

constexpr std::array<uint32_t, 256> make_crc_table() {
  std::array<uint32_t, 256> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;  // reflected Castagnoli polynomial
    t[i] = c;
  }
  return t;
}
constexpr auto kCrcTable = make_crc_table();

template <class T>
void put_le(std::string& out, T v) {  // little-endian bytes of an unsigned integer
  for (size_t i = 0; i < sizeof(T); ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
}
void put_tag(std::string& out, uint32_t field, uint32_t wire_type) { put_varint(out, (field << 3) | wire_type); }
void put_bytes(std::string& out, uint32_t field, std::string_view s) {  // wire type 2: length-delimited
  put_tag(out, field, 2);
  put_varint(out, s.size());
  out.append(s);
}
void put_double(std::string& out, uint32_t field, double v) {  // wire type 1: 64-bit
  put_tag(out, field, 1);
  put_le(out, std::bit_cast<uint64_t>(v));
}

}  // namespace

uint32_t crc32c(std::string_view data, uint32_t crc) {
  crc = ~crc;
  for (unsigned char b : data) crc = kCrcTable[(crc ^ b) & 0xFF] ^ (crc >> 8);
  return ~crc;
}

uint32_t masked_crc32c(std::string_view data) {
  uint32_t crc = crc32c(data);
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7F) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}

std::string frame(std::string_view payload) {
  std::string out, len;
  put_le(len, static_cast<uint64_t>(payload.size()));
  out.reserve(payload.size() + 16);
  out += len;
  put_le(out, masked_crc32c(len));
  out.append(payload);
  put_le(out, masked_crc32c(payload));
  return out;
}

std::string file_version_event(double wall_time, std::string_view version) {
  std::string ev;
  put_double(ev, 1, wall_time);
  put_bytes(ev, 3, version);
  return ev;
}

std::string scalar_event(double wall_time, int64_t step, std::string_view tag, float value) {
  std::string val;  // Summary.Value
  put_bytes(val, 1, tag);
  put_tag(val, 2, 5);  // simple_value: wire type 5, 32-bit
  put_le(val, std::bit_cast<uint32_t>(value));
  std::string summary;
  put_bytes(summary, 1, val);
  std::string ev;
  put_double(ev, 1, wall_time);
  if (step != 0) {  // proto3 default omitted, as TensorFlow does
    put_tag(ev, 2, 0);
    put_varint(ev, static_cast<uint64_t>(step));
  }
  put_bytes(ev, 5, summary);
  return ev;
}

}  // namespace tfrecord

namespace {

double now_seconds() {
  using namespace std::chrono;
  return duration_cast<microseconds>(system_clock::now().time_since_epoch()).count() / 1e6;
}

std::string host_name() {
  char buf[256] = {};
  if (gethostname(buf, sizeof(buf) - 1) != 0 || buf[0] == '\0') return "localhost";
  return buf;
}

}  // namespace

TensorBoardWriter::TensorBoardWriter(const std::string& log_dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(log_dir, ec);
  if (ec) throw file_error(log_dir, "", "cannot create log directory: " + ec.message());
  double now = now_seconds();
  std::string base = (fs::path(log_dir) / ("events.out.tfevents." + std::to_string(static_cast<int64_t>(now)) + "." +
                                           host_name() + "." + std::to_string(getpid())))
                         .string();
  for (int n = 0; !file_; ++n) {
    path_ = n == 0 ? base : base + "." + std::to_string(n);
    errno = 0;
    file_.reset(std::fopen(path_.c_str(), "wbx"));  // exclusive: never clobber another writer's file
    if (!file_ && (errno != EEXIST || n >= 1000))
      throw file_error(path_, "", std::string("cannot create event file: ") + std::strerror(errno));
  }
  write_record(tfrecord::file_version_event(now));
  flush();
}

TensorBoardWriter::~TensorBoardWriter() {
  try {
    flush();
  } catch (...) {
  }
}

void TensorBoardWriter::add_scalar(const std::string& tag, double value, int64_t step, double wall_time) {
  std::string ev = tfrecord::scalar_event(wall_time < 0 ? now_seconds() : wall_time, step, tag,
                                          static_cast<float>(value));
  std::lock_guard lock(mu_);
  write_record(ev);
}

void TensorBoardWriter::flush() {
  std::lock_guard lock(mu_);
  if (std::fflush(file_.get()) != 0)
    throw file_error(path_, "", std::string("cannot write event file: ") + std::strerror(errno));
}

void TensorBoardWriter::write_record(std::string_view payload) {
  std::string rec = tfrecord::frame(payload);
  if (std::fwrite(rec.data(), 1, rec.size(), file_.get()) != rec.size())
    throw file_error(path_, "", std::string("cannot write event file: ") + std::strerror(errno));
}

}  // namespace lf::io
