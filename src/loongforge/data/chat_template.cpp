#include "loongforge/data/chat_template.h"

#include <filesystem>
#include <fstream>
#include <sstream>

#include "loongforge/core/error.h"
#include "loongforge/data/jinja/interp.h"
#include "loongforge/data/jinja/parser.h"

namespace lf::data {

namespace fs = std::filesystem;
using jinja::Value;

namespace {

template <class J>
Value from_json(const J& j) {
  switch (j.type()) {
    case nlohmann::json::value_t::null: return Value::none();
    case nlohmann::json::value_t::boolean: return Value::boolean(j.template get<bool>());
    case nlohmann::json::value_t::number_integer: return Value::integer(j.template get<int64_t>());
    case nlohmann::json::value_t::number_unsigned: return Value::integer(int64_t(j.template get<uint64_t>()));
    case nlohmann::json::value_t::number_float: return Value::real(j.template get<double>());
    case nlohmann::json::value_t::string: return Value::str(j.template get<std::string>());
    case nlohmann::json::value_t::array: {
      jinja::List l;
      for (const auto& x : j) l.push_back(from_json(x));
      return Value::list(std::move(l));
    }
    case nlohmann::json::value_t::object: {
      jinja::Dict d;
      for (auto it = j.begin(); it != j.end(); ++it) d.emplace_back(it.key(), from_json(it.value()));
      return Value::dict(std::move(d));
    }
    default: return Value::none();
  }
}

template <class J>
std::string render_json(const jinja::Program& prog, const J& context) {
  if (!context.is_object()) throw lf::Error(prog.origin + ": the render context must be a JSON object");
  Value ctx = from_json(context);
  return jinja::render(prog, *ctx.d);
}

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  if (!in) throw lf::Error(p.string() + ": cannot open file");
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

nlohmann::json parse_json_file(const fs::path& p) {
  try {
    return nlohmann::json::parse(read_file(p));
  } catch (const nlohmann::json::exception& e) {
    throw lf::Error(p.string() + ": invalid JSON: " + e.what());
  }
}

std::string token_string(const nlohmann::json& cfg, const char* key, const fs::path& file) {
  if (!cfg.contains(key) || cfg[key].is_null()) return "";
  const auto& t = cfg[key];
  if (t.is_string()) return t.get<std::string>();
  if (t.is_object() && t.contains("content") && t["content"].is_string()) return t["content"].get<std::string>();
  throw lf::file_error(file.string(), key, "expected a string or an object with a string 'content'");
}

// `chat_template` of a config: a string, or a list of {name, template} from which "default" is taken.
bool template_field(const nlohmann::json& cfg, const fs::path& file, std::string& out) {
  if (!cfg.is_object() || !cfg.contains("chat_template") || cfg["chat_template"].is_null()) return false;
  const auto& t = cfg["chat_template"];
  if (t.is_string()) {
    out = t.get<std::string>();
    return true;
  }
  if (t.is_array()) {
    std::string names;
    for (const auto& e : t) {
      if (!e.is_object() || !e.contains("name") || !e.contains("template") || !e["name"].is_string() || !e["template"].is_string())
        throw lf::file_error(file.string(), "chat_template", "list entries must be {\"name\": str, \"template\": str}");
      if (e["name"] == "default") {
        out = e["template"].get<std::string>();
        return true;
      }
      names += (names.empty() ? "" : ", ") + e["name"].get<std::string>();
    }
    throw lf::file_error(file.string(), "chat_template", "no template named 'default' (have: " + names + ")");
  }
  throw lf::file_error(file.string(), "chat_template", "expected a string or a list of {name, template}");
}

const char* kChatml = R"J({%- for message in messages %}
    {{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
)J";

const char* kLlama3 = R"J({%- for message in messages %}
    {%- if loop.first %}
        {{- bos_token }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
)J";

const char* kMistral = R"J({%- if messages and messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('After the optional system message, conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- if loop.last and system_message is defined %}
            {{- '[INST] ' + system_message + '\n\n' + message['content'] + '[/INST]' }}
        {%- else %}
            {{- '[INST] ' + message['content'] + '[/INST]' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'] | trim + eos_token }}
    {%- else %}
        {{- raise_exception('Only user and assistant roles are supported, with the exception of an initial optional system message!') }}
    {%- endif %}
{%- endfor %}
)J";

}  // namespace

ChatTemplate::ChatTemplate(const std::string& source, const std::string& origin)
    : origin_(origin), program_(jinja::parse(source, origin)) {}

std::string ChatTemplate::render(const nlohmann::json& context) const { return render_json(*program_, context); }

std::string ChatTemplate::render_ordered(const nlohmann::ordered_json& context) const {
  return render_json(*program_, context);
}

ChatTemplate::Loaded ChatTemplate::load_from_folder(const std::string& dir) {
  fs::path base(dir), cfg_path;
  if (fs::is_regular_file(base)) {
    cfg_path = base;
    base = base.parent_path();
  } else {
    if (!fs::is_directory(base)) throw lf::Error(dir + ": no such model folder or tokenizer_config.json");
    cfg_path = base / "tokenizer_config.json";
  }
  Loaded out;
  nlohmann::json cfg = nlohmann::json::object();
  if (fs::is_regular_file(cfg_path)) {
    cfg = parse_json_file(cfg_path);
    if (!cfg.is_object()) throw lf::Error(cfg_path.string() + ": expected a JSON object");
    out.bos_token = token_string(cfg, "bos_token", cfg_path);
    out.eos_token = token_string(cfg, "eos_token", cfg_path);
    if (template_field(cfg, cfg_path, out.source)) {
      out.origin = cfg_path.string();
      return out;
    }
  }
  if (fs::path j = base / "chat_template.jinja"; fs::is_regular_file(j)) {
    out.source = read_file(j);
    out.origin = j.string();
    return out;
  }
  if (fs::path j = base / "chat_template.json"; fs::is_regular_file(j)) {
    if (template_field(parse_json_file(j), j, out.source)) {
      out.origin = j.string();
      return out;
    }
  }
  throw lf::Error(cfg_path.string() + ": no chat template (no 'chat_template' field, and no chat_template.jinja in " +
                  base.string() + ")");
}

std::string ChatTemplate::builtin(const std::string& name) {
  if (name == "chatml") return kChatml;
  if (name == "llama3") return kLlama3;
  if (name == "mistral") return kMistral;
  throw lf::Error("chat template: unknown built-in '" + name + "' (valid: chatml, llama3, mistral)");
}

}  // namespace lf::data
