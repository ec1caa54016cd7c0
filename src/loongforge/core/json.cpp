#include "loongforge/core/json.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "loongforge/core/error.h"

namespace lf {

std::string read_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(path + ": cannot open: " + std::strerror(errno));
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

nlohmann::json read_json_file(const std::string& path) {
  std::string text = read_text_file(path);
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::parse_error& e) {
    std::string what = e.what();
    auto pos = what.find("parse error");
    throw Error(path + ": invalid JSON: " + (pos == std::string::npos ? what : what.substr(pos)));
  } catch (const nlohmann::json::exception& e) {  // e.g. out_of_range 406: a number too large for a double
    std::string what = e.what();
    auto pos = what.find("] ");
    throw Error(path + ": invalid JSON: " + (pos == std::string::npos ? what : what.substr(pos + 2)));
  }
}

JsonReader::JsonReader(const nlohmann::json& obj, std::string file, std::string path)
    : obj_(&obj), file_(std::move(file)), path_(std::move(path)) {}

std::string JsonReader::field(const std::string& key) const { return path_.empty() ? key : path_ + "." + key; }

void JsonReader::fail(const std::string& key, const std::string& why) const {
  throw file_error(file_, key.empty() ? path_ : field(key), why);
}

void JsonReader::expected(const std::string& key, const std::string& what) const {
  fail(key, "expected " + what + (quote_ ? ", got " + obj_->at(key).dump() : ""));
}

bool JsonReader::has(const std::string& key) const { return obj_->contains(key) && !obj_->at(key).is_null(); }

const nlohmann::json& JsonReader::get(const std::string& key) const {
  if (!obj_->is_object()) fail("", "expected an object");
  auto it = obj_->find(key);
  if (it == obj_->end()) fail(key, "missing");
  return *it;
}

const nlohmann::json& JsonReader::required(const std::string& key) const {
  if (!obj_->is_object()) fail("", "expected an object");
  if (!has(key)) fail(key, "missing");
  return obj_->at(key);
}

JsonReader JsonReader::object(const std::string& key) const {
  const nlohmann::json& v = required(key);
  if (!v.is_object()) fail(key, "expected an object");
  JsonReader r(v, file_, field(key));
  r.quote_ = quote_;
  return r;
}

int64_t JsonReader::integer(const std::string& key, std::optional<int64_t> dflt) const {
  if (dflt && !has(key)) return *dflt;
  const nlohmann::json& v = required(key);
  if (!v.is_number_integer()) expected(key, "an integer");
  return v.get<int64_t>();
}

double JsonReader::number(const std::string& key, std::optional<double> dflt) const {
  if (dflt && !has(key)) return *dflt;
  const nlohmann::json& v = required(key);
  if (!v.is_number()) expected(key, "a number");
  return v.get<double>();
}

std::optional<double> JsonReader::opt_number(const std::string& key) const {
  if (!has(key)) return std::nullopt;
  return number(key);
}

bool JsonReader::boolean(const std::string& key, std::optional<bool> dflt) const {
  if (dflt && !has(key)) return *dflt;
  const nlohmann::json& v = required(key);
  if (!v.is_boolean()) expected(key, "true or false");
  return v.get<bool>();
}

std::string JsonReader::string(const std::string& key, std::optional<std::string> dflt) const {
  if (dflt && !has(key)) return *dflt;
  const nlohmann::json& v = required(key);
  if (!v.is_string()) expected(key, "a string");
  return v.get<std::string>();
}

std::vector<int64_t> JsonReader::int_list(const std::string& key) const {
  std::vector<int64_t> out;
  if (!has(key)) return out;
  const nlohmann::json& v = obj_->at(key);
  if (v.is_number_integer()) return {v.get<int64_t>()};
  if (!v.is_array()) fail(key, "expected an integer or a list of integers");
  for (const nlohmann::json& e : v) {
    if (!e.is_number_integer()) fail(key, "expected a list of integers");
    out.push_back(e.get<int64_t>());
  }
  return out;
}

void write_file_atomic(const std::string& path, const std::string& bytes) {
  std::string tmp = path + ".tmp." + std::to_string(::getpid());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) throw Error(path + ": cannot write: " + std::strerror(errno));
  size_t off = 0;
  while (off < bytes.size()) {
    ssize_t n = ::write(fd, bytes.data() + off, bytes.size() - off);
    if (n < 0) {
      if (errno == EINTR) continue;
      int err = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      throw Error(path + ": write failed: " + std::strerror(err));
    }
    off += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    ::unlink(tmp.c_str());
    throw Error(path + ": write failed: " + std::strerror(errno));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    int err = errno;
    ::unlink(tmp.c_str());
    throw Error(path + ": rename failed: " + std::strerror(err));
  }
}

}  // namespace lf
