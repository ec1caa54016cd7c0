// The dense decoder-LM family ("Llama-style"): Llama 1/2/3/3.x, Mistral, Qwen2/2.5 and Qwen3, defined from a Hugging
// Face config.json. The differences between them are fields here (biases, q/k norms, sliding windows, rope), not
// separate model classes.
#pragma once
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

namespace lf::models::llama {

struct RopeConfig {
  std::string type = "default";  // default | linear | dynamic | llama3 | yarn
  double theta = 10000.0;
  double factor = 1.0;
  // llama3
  double low_freq_factor = 1.0, high_freq_factor = 4.0;
  // llama3, yarn: the pre-scaling context length
  int64_t original_max_position_embeddings = 0;
  // yarn
  std::optional<double> attention_factor, mscale, mscale_all_dim;
  double beta_fast = 32.0, beta_slow = 1.0;
  bool truncate = true;
};

struct DecoderConfig {
  std::string model_type;  // llama | mistral | qwen2 | qwen3
  int64_t vocab_size = 0, hidden_size = 0, intermediate_size = 0, num_hidden_layers = 0;
  int64_t num_attention_heads = 0, num_key_value_heads = 0, head_dim = 0;
  int64_t max_position_embeddings = 2048;
  double rms_norm_eps = 1e-6;
  std::string hidden_act = "silu";
  bool q_bias = false, k_bias = false, v_bias = false, o_bias = false, mlp_bias = false;
  bool qk_norm = false;  // Qwen3: RMSNorm over head_dim on q and k before RoPE
  bool tie_word_embeddings = false;
  std::optional<int64_t> pad_token_id;  // nn.Embedding padding_idx: that row gets no gradient
  std::vector<int64_t> bos_token_ids, eos_token_ids;
  std::vector<int64_t> layer_window;    // per layer: sliding window size, 0 = full causal attention
  RopeConfig rope;
  nlohmann::json raw;                   // the config.json as read, written back on export

  // Parses config.json's JSON; `file` names the file in errors. Fields that change the math and are not supported
  // are errors naming them.
  static DecoderConfig from_json(const nlohmann::json& j, const std::string& file = "config.json");
  static DecoderConfig from_file(const std::string& path);
  int64_t num_parameters() const;
};

}  // namespace lf::models::llama
