// Helpers shared by the C++ tests.
#pragma once
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "loongforge/core/fs.h"

namespace lf::test {

// A fresh, empty folder named after the running test (and TAG), under the system temp folder.
inline std::filesystem::path temp_dir(const std::string& tag = "") {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::string name = "lf_" + std::to_string(::getpid()) + "_" + info->test_suite_name() + "_" + info->name();
  if (!tag.empty()) name += "_" + tag;
  std::filesystem::path dir = std::filesystem::temp_directory_path() / name;
  lf::remove_tree(dir.string());
  std::filesystem::create_directories(dir);
  return dir;
}

inline std::string read_bytes(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

inline void write_bytes(const std::filesystem::path& p, const std::string& bytes) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out << bytes;
}

}  // namespace lf::test
