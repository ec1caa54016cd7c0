// Reading JSON files with errors that name the file (and, for typed look-ups, the field).
#pragma once
#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <vector>

namespace lf {

// Parses a JSON file; a missing file or a syntax error is an lf::Error naming the file.
nlohmann::json read_json_file(const std::string& path);

// Reads a whole file into a string; an lf::Error naming the file if it cannot be read.
std::string read_text_file(const std::string& path);

// Writes a file atomically: a temporary file in the same folder, fsync, then rename over PATH.
void write_file_atomic(const std::string& path, const std::string& bytes);

// Typed fields of one JSON object of FILE; every failure is lf::file_error(FILE, "PATH.key", why) (the key alone at
// the top level, PATH itself for the object). Null counts as absent: an optional field that is null takes its
// default, a required one is "missing". Type errors read "expected an integer, got 2.5" (quote_values(false): without
// the value). The object is not copied: it must outlive the reader.
class JsonReader {
 public:
  JsonReader(const nlohmann::json& obj, std::string file, std::string path = "");

  const nlohmann::json& json() const { return *obj_; }
  const std::string& file() const { return file_; }
  const std::string& path() const { return path_; }
  std::string field(const std::string& key) const;  // "PATH.key", or "key" when PATH is empty
  JsonReader& quote_values(bool on) {
    quote_ = on;
    return *this;
  }

  [[noreturn]] void fail(const std::string& key, const std::string& why) const;  // names field(key); "" names PATH
  // "expected WHAT, got VALUE" about KEY's value.
  [[noreturn]] void expected(const std::string& key, const std::string& what) const;

  bool has(const std::string& key) const;  // present and not null
  // KEY's value, null included; "expected an object" when this is not an object, "missing" when KEY is absent.
  const nlohmann::json& get(const std::string& key) const;
  const nlohmann::json& required(const std::string& key) const;  // present and not null (else "missing"), as get
  // The object KEY (required), read with this reader's file and settings.
  JsonReader object(const std::string& key) const;

  // Without a default the field is required (as `required`).
  int64_t integer(const std::string& key, std::optional<int64_t> dflt = std::nullopt) const;
  double number(const std::string& key, std::optional<double> dflt = std::nullopt) const;  // any JSON number
  std::optional<double> opt_number(const std::string& key) const;
  bool boolean(const std::string& key, std::optional<bool> dflt = std::nullopt) const;
  std::string string(const std::string& key, std::optional<std::string> dflt = std::nullopt) const;
  std::vector<int64_t> int_list(const std::string& key) const;  // an integer, a list of integers, or absent (empty)

 private:
  const nlohmann::json* obj_;
  std::string file_, path_;
  bool quote_ = true;
};

}  // namespace lf
