#include "loongforge/data/tokenizer/tokenizer.h"

#include <filesystem>

#include "loongforge/core/error.h"
#include "loongforge/data/tokenizer/loaders.h"

namespace lf::data {

std::unique_ptr<Tokenizer> Tokenizer::load(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::path p(path);
  if (fs::is_directory(p, ec)) {
    if (fs::exists(p / "tokenizer.json", ec)) return tok::load_hf_tokenizer((p / "tokenizer.json").string());
    if (fs::exists(p / "tokenizer.model", ec)) return tok::load_sentencepiece((p / "tokenizer.model").string());
    throw Error(path + ": no tokenizer.json or tokenizer.model in this folder");
  }
  if (!fs::exists(p, ec))
    throw Error(path + ": no such file or folder (expected a folder with tokenizer.json or tokenizer.model, or "
                       "either file)");
  if (p.extension() == ".json") return tok::load_hf_tokenizer(path);
  return tok::load_sentencepiece(path);
}

}  // namespace lf::data
