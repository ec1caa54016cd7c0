// File-system helpers. Do not call std::filesystem::remove_all in LoongForge: libtorch.so exports its own copy of
// that function (from an older libstdc++), which crashes on non-empty folders in any program linked with LibTorch.
#pragma once
#include <string>

namespace lf {

// Removes PATH and everything below it (no error if it does not exist); lf::Error naming the path on failure.
void remove_tree(const std::string& path);

}  // namespace lf
