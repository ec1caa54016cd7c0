// The two kinds of tokenizer behind Tokenizer::load.
#pragma once
#include <memory>
#include <string>

#include "loongforge/data/tokenizer/tokenizer.h"

namespace lf::data::tok {

std::unique_ptr<Tokenizer> load_hf_tokenizer(const std::string& json_path);   // tokenizer.json
std::unique_ptr<Tokenizer> load_sentencepiece(const std::string& model_path);  // tokenizer.model

}  // namespace lf::data::tok
