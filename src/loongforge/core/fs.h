// File-system helpers. Do not call std::filesystem::remove_all in LoongForge: libtorch.so exports its own copy of
// that function (from an older libstdc++), which crashes on non-empty folders in any program linked with LibTorch.
#pragma once
#include <string>

namespace lf {

// Removes PATH and everything below it (no error if it does not exist); lf::Error naming the path on failure.
void remove_tree(const std::string& path);

// Whether NAME is one plain entry of a folder: not empty, no '/' or '\\', not "." or "..", no NUL. Files that
// name other files (a checkpoint root's `latest`, a safetensors index's shards) are untrusted: only such names are
// followed, so they never reach outside their folder.
bool is_plain_name(const std::string& name);

}  // namespace lf
