// Hugging Face chat templates: a Jinja2 subset, rendered the way transformers renders them (trim_blocks,
// lstrip_blocks, loop controls, its tojson / raise_exception / strftime_now / namespace / dict globals).
// Supported: the statements if/elif/else, for (loop.*, else, `if` filter, tuple unpacking), set (incl. block set,
// namespace attributes), macro, break/continue, generation; expressions with literals, lists, dicts, attribute,
// subscript and slice access, calls, filters, tests, arithmetic, comparison, logic, ~ and inline if.
// Unsupported tags (include, extends, block, call, ...) are parse errors. No torch: plain C++20 + nlohmann-json.
#pragma once
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

namespace lf::data {

namespace jinja {
struct Program;  // the parsed template (chat_template.cpp)
}

class ChatTemplate {
 public:
  // Parses the template. A syntax error or unsupported construct is an lf::Error with one line
  // "ORIGIN:LINE: what".
  ChatTemplate(const std::string& source, const std::string& origin = "chat_template");
  // Renders with a JSON context ({"messages": [...], "add_generation_prompt": bool, "bos_token": .., "eos_token": ..,
  // "tools": null|[...], ...}). Errors (raise_exception, bad operations) are lf::Error "ORIGIN:LINE: what".
  // Note nlohmann::json sorts object keys; use render_ordered to keep the caller's key order (it shows in tojson
  // output and in `items` iteration, as with Python dicts).
  std::string render(const nlohmann::json& context) const;
  std::string render_ordered(const nlohmann::ordered_json& context) const;
  const std::string& origin() const { return origin_; }

  // From a model folder (or its tokenizer_config.json): the config's "chat_template" (a string, or a list of
  // {name, template}: "default" is taken), else a chat_template.jinja (or chat_template.json) beside it; the
  // bos/eos token strings of tokenizer_config.json (strings or {"content": ..} objects, "" when absent).
  struct Loaded {
    std::string source, origin, bos_token, eos_token;
  };
  static Loaded load_from_folder(const std::string& dir);  // lf::Error naming the file if none is found
  // Built-in templates: "chatml" (Qwen-style <|im_start|>role\n...<|im_end|>\n), "llama3" (Llama-3 Instruct),
  // "mistral" (Mistral Instruct v0.3 without tools). Unknown name: lf::Error listing the valid names.
  static std::string builtin(const std::string& name);

 private:
  std::string origin_;
  std::shared_ptr<const jinja::Program> program_;
};

}  // namespace lf::data
