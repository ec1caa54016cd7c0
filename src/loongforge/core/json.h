// Reading JSON files with errors that name the file (and, for typed look-ups, the field).
#pragma once
#include <nlohmann/json_fwd.hpp>
#include <string>

namespace lf {

// Parses a JSON file; a missing file or a syntax error is an lf::Error naming the file.
nlohmann::json read_json_file(const std::string& path);

// Reads a whole file into a string; an lf::Error naming the file if it cannot be read.
std::string read_text_file(const std::string& path);

// Writes a file atomically: a temporary file in the same folder, fsync, then rename over PATH.
void write_file_atomic(const std::string& path, const std::string& bytes);

}  // namespace lf
