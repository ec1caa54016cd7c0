// loongforge tokenize: encode text to ids / decode ids to text with a tokenizer.json or tokenizer.model.
#include <cstdio>
#include <iostream>
#include <iterator>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "loongforge/cli/commands.h"
#include "loongforge/core/error.h"
#include "loongforge/data/tokenizer/tokenizer.h"

namespace lf::cli {

namespace {

struct TokenizeOptions {
  std::string tokenizer, text, decode;
  bool no_add_special = false, keep_special = false, decode_stdin = false;
};

std::vector<int64_t> parse_ids(const std::string& list) {
  std::vector<int64_t> ids;
  size_t pos = 0;
  while (pos <= list.size()) {
    size_t comma = list.find(',', pos);
    if (comma == std::string::npos) comma = list.size();
    std::string item = list.substr(pos, comma - pos);
    size_t a = item.find_first_not_of(" \t"), b = item.find_last_not_of(" \t");
    item = a == std::string::npos ? "" : item.substr(a, b - a + 1);
    if (!item.empty() || comma < list.size()) {
      size_t used = 0;
      int64_t v = 0;
      try {
        v = std::stoll(item, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      if (item.empty() || used != item.size()) throw Error("--decode: '" + item + "' is not an integer id");
      ids.push_back(v);
    }
    pos = comma + 1;
  }
  return ids;
}

void print_line(const std::string& s) {
  std::fwrite(s.data(), 1, s.size(), stdout);
  std::fputc('\n', stdout);
}

nlohmann::json read_stdin_array(const char* what) {
  std::string input((std::istreambuf_iterator<char>(std::cin)), std::istreambuf_iterator<char>());
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(input);
  } catch (const nlohmann::json::exception& e) {
    throw Error(std::string("stdin: invalid JSON: ") + e.what());
  }
  if (!j.is_array()) throw Error(std::string("stdin: expected a JSON array of ") + what);
  return j;
}

void run(const TokenizeOptions& o, bool has_text, bool has_decode) {
  if (int(has_text) + int(has_decode) + int(o.decode_stdin) > 1)
    throw Error("tokenize: give at most one of --text, --decode, --decode-stdin");
  auto tok = data::Tokenizer::load(o.tokenizer);
  if (has_decode) {
    print_line(tok->decode(parse_ids(o.decode), !o.keep_special));
  } else if (has_text) {
    print_line(nlohmann::json(tok->encode(o.text, !o.no_add_special)).dump());
  } else if (o.decode_stdin) {
    nlohmann::json lists = read_stdin_array("id arrays"), out = nlohmann::json::array();
    for (size_t i = 0; i < lists.size(); ++i) {
      std::vector<int64_t> ids;
      try {
        ids = lists[i].get<std::vector<int64_t>>();
      } catch (const nlohmann::json::exception&) {
        throw Error("stdin: item " + std::to_string(i) + ": expected an array of integer ids");
      }
      out.push_back(tok->decode(ids, !o.keep_special));
    }
    print_line(out.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
  } else {
    nlohmann::json texts = read_stdin_array("strings");
    nlohmann::json out = nlohmann::json::array();
    for (size_t i = 0; i < texts.size(); ++i) {
      if (!texts[i].is_string()) throw Error("stdin: item " + std::to_string(i) + ": expected a string");
      out.push_back(tok->encode(texts[i].get_ref<const std::string&>(), !o.no_add_special));
    }
    print_line(out.dump());
  }
  std::fflush(stdout);
}

}  // namespace

void add_tokenize(CLI::App& app) {
  auto* sub = app.add_subcommand("tokenize", "Encode text to token ids, or decode ids to text, with a tokenizer");
  auto o = std::make_shared<TokenizeOptions>();
  sub->add_option("--tokenizer", o->tokenizer,
                  "A folder with tokenizer.json (preferred), tokenizer.model or spiece.model, or either file")
      ->required();
  auto* text = sub->add_option("--text", o->text, "Text to encode; prints a JSON array of ids");
  auto* decode = sub->add_option("--decode", o->decode, "Comma-separated ids to decode (e.g. 1,2,3); prints the text");
  text->excludes(decode);
  sub->add_flag("--no-add-special-tokens", o->no_add_special,
                "Encode without the post-processor's special tokens (e.g. no BOS)");
  sub->add_flag("--decode-stdin", o->decode_stdin,
                "Read a JSON array of id arrays on stdin; print a JSON array of decoded strings");
  sub->add_flag("--keep-special-tokens", o->keep_special, "Decode special tokens instead of skipping them");
  sub->footer(
      "With neither --text nor --decode, reads a JSON array of strings on stdin and prints a JSON array of id arrays.\n"
      "Ids and text equal Hugging Face tokenizers' encode(text).ids / decode(ids) for tokenizer.json, and\n"
      "sentencepiece's encode/decode for tokenizer.model. A tokenizer.json with a Unigram model (T5's) runs on the\n"
      "sentencepiece model beside it (spiece.model / tokenizer.model) with the json's post-processor (T5's </s>);\n"
      "a T5 folder with spiece.model alone (tokenizer_config.json's tokenizer_class) appends </s> too.\n"
      "Examples:\n"
      "  loongforge tokenize --tokenizer path/to/llama3 --text 'Hello world'\n"
      "  loongforge tokenize --tokenizer path/to/llama3/tokenizer.json --decode 128000,9906,1917\n"
      "  echo '[\"a\", \"b c\"]' | loongforge tokenize --tokenizer path/to/llama3");
  sub->callback([o, text, decode] { run(*o, text->count() > 0, decode->count() > 0); });
}

}  // namespace lf::cli
