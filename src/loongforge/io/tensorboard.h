// TensorBoard event files written directly (no TensorFlow or protobuf library): TFRecord framing around hand-encoded
// `Event` protos, enough for scalar summaries that TensorBoard's event readers load.
#pragma once
#include <cstdint>
#include <cstdio>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>

namespace lf::io {

// Appends scalar summaries to log_dir/events.out.tfevents.<unix seconds>.<hostname>.<pid> (a ".<n>" suffix is added
// when that name already exists). Thread-safe. Failures to create or write the file raise lf::Error naming the path.
class TensorBoardWriter {
 public:
  explicit TensorBoardWriter(const std::string& log_dir);  // creates log_dir; writes the "brain.Event:2" event
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;
  ~TensorBoardWriter();  // flushes; errors are swallowed (call flush() to see them)

  // wall_time in seconds since the Unix epoch; negative means now. The value is stored as float32 (simple_value).
  void add_scalar(const std::string& tag, double value, int64_t step, double wall_time = -1);
  void flush();
  const std::string& path() const { return path_; }

 private:
  void write_record(std::string_view payload);
  struct Closer {
    void operator()(std::FILE* f) const { std::fclose(f); }
  };
  std::string path_;
  std::unique_ptr<std::FILE, Closer> file_;
  std::mutex mu_;
};

// Building blocks, exposed for the tests.
namespace tfrecord {
uint32_t crc32c(std::string_view data, uint32_t crc = 0);  // CRC-32C (Castagnoli); crc chains a previous result
uint32_t masked_crc32c(std::string_view data);            // ((crc >> 15) | (crc << 17)) + 0xa282ead8
void put_varint(std::string& out, uint64_t v);            // protobuf base-128 varint
std::string frame(std::string_view payload);              // u64 len, masked crc(len), payload, masked crc(payload)
// Serialized Event protos: {wall_time, file_version} and {wall_time, step, summary{value{tag, simple_value}}}.
std::string file_version_event(double wall_time, std::string_view version = "brain.Event:2");
std::string scalar_event(double wall_time, int64_t step, std::string_view tag, float value);
}  // namespace tfrecord

}  // namespace lf::io
