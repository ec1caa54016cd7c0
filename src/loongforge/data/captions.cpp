#include "loongforge/data/captions.h"

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "loongforge/core/error.h"
#include "loongforge/core/json.h"

namespace lf::data {
namespace fs = std::filesystem;

std::string normalize_caption_path(const std::string& relative) {
  if (relative.empty()) return "";
  const fs::path p = fs::path(relative).lexically_normal();
  if (p.is_absolute() || p.empty()) return "";
  std::string s = p.generic_string();
  if (s == "." || s == ".." || s.rfind("../", 0) == 0) return "";
  return s;
}

namespace {

// The string field under the first of KEYS that R has (null counts as absent); "missing" naming the keys tried.
std::string string_field(const JsonReader& r, const std::vector<const char*>& keys, std::string* key_used) {
  for (const char* k : keys) {
    if (!r.has(k)) continue;
    *key_used = k;
    return r.string(k);  // "FILE:N: field 'K': expected a string, got 3"
  }
  std::string names;
  for (size_t i = 0; i < keys.size(); ++i) names += (i ? "' or '" : "") + std::string(keys[i]);
  throw file_error(r.file(), names, "missing");
}

}  // namespace

std::vector<CaptionEntry> read_captions(const std::string& jsonl_path) {
  std::ifstream in(jsonl_path, std::ios::binary);
  if (!in) throw Error(jsonl_path + ": cannot open: " + std::strerror(errno));
  std::vector<CaptionEntry> out;
  std::map<std::string, int64_t> seen;
  std::string line;
  int64_t n = 0;
  while (std::getline(in, line)) {
    ++n;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.find_first_not_of(" \t\f\v") == std::string::npos) continue;
    const std::string at = jsonl_path + ":" + std::to_string(n);
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      std::string what = e.what();
      const auto pos = what.find("parse error");
      throw Error(at + ": invalid JSON: " + (pos == std::string::npos ? what : what.substr(pos)));
    }
    if (!j.is_object()) throw Error(at + ": the line is not a JSON object");
    const JsonReader r(j, at);
    std::string file_key, text_key;
    const std::string file = string_field(r, {"file_name", "file"}, &file_key);
    std::string text = string_field(r, {"text", "caption"}, &text_key);
    const std::string norm = normalize_caption_path(file);
    if (norm.empty())
      throw file_error(at, file_key, "'" + file + "' is not a file inside the folder (empty, absolute or ../)");
    auto [it, fresh] = seen.emplace(norm, n);
    if (!fresh)
      throw file_error(at, file_key, "'" + file + "' is listed twice (first on line " + std::to_string(it->second) + ")");
    out.push_back({norm, std::move(text), n, file_key});
  }
  if (in.bad()) throw Error(jsonl_path + ": read failed");
  return out;
}

bool has_captions(const std::string& folder) { return fs::is_regular_file(fs::path(folder) / kCaptionFile); }

std::map<std::string, std::string> folder_captions(const std::string& folder, const std::vector<std::string>& media) {
  const std::string jsonl = (fs::path(folder) / kCaptionFile).string();
  const std::vector<CaptionEntry> entries = read_captions(jsonl);
  std::map<std::string, std::string> by_file;
  for (const auto& e : entries) {
    if (!fs::is_regular_file(fs::path(folder) / e.file))
      throw file_error(jsonl + ":" + std::to_string(e.line), e.file_key, e.file + " does not exist in " + folder);
    by_file.emplace(e.file, e.text);
  }
  std::map<std::string, std::string> out;
  for (const auto& m : media) {
    const std::string norm = normalize_caption_path(m);
    auto it = by_file.find(norm);
    if (it == by_file.end()) throw Error(jsonl + ": no caption for " + m + " (no line with \"file_name\": \"" + m + "\")");
    out.emplace(norm, it->second);
  }
  return out;
}

}  // namespace lf::data
