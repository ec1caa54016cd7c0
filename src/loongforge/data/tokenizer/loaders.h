// The two kinds of tokenizer behind Tokenizer::load.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "loongforge/data/tokenizer/tokenizer.h"

namespace lf::data::tok {

std::unique_ptr<Tokenizer> load_hf_tokenizer(const std::string& json_path);   // tokenizer.json
// tokenizer.model; encode(text, true) puts PREFIX before the pieces' ids and SUFFIX after them.
std::unique_ptr<Tokenizer> load_sentencepiece(const std::string& model_path, std::vector<int64_t> prefix = {},
                                              std::vector<int64_t> suffix = {});

}  // namespace lf::data::tok
