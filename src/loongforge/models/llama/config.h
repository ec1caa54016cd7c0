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
  // Qwen2-VL / 2.5-VL multimodal RoPE: the temporal / height / width sections of the head_dim / 2 frequencies
  // (rope_parameters.mrope_section; empty: plain 1D positions)
  std::vector<int64_t> mrope_section;
  bool mrope_interleaved = false;  // Qwen3-VL's interleaved sections (nn::RopeSpec)
  // partial_rotary_factor as the file gives it (rope block first, then top level; unset: the family's default)
  std::optional<double> partial_rotary_factor;
  std::string partial_rotary_field;  // where it was read, for errors
};

struct DecoderConfig {
  std::string model_type;  // llama | mistral | qwen2 | qwen3 | deepseek_v3 | glm4_moe | minimax_m2 | mistral4 | ...
  int64_t vocab_size = 0, hidden_size = 0, intermediate_size = 0, num_hidden_layers = 0;
  int64_t num_attention_heads = 0, num_key_value_heads = 0, head_dim = 0;
  // Partial rotary: the first rotary_dim features of each q / k head rotate, the rest pass (int(head_dim x
  // partial_rotary_factor), as transformers; = head_dim without one).
  int64_t rotary_dim = 0;
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
  // DeepSeek-V3 multi-head latent attention (models/llama/mla.h); biases: q_bias = q_a_proj, k_bias =
  // kv_a_proj_with_mqa, o_bias = o_proj (attention_bias). head_dim = qk_rope_head_dim (the rotary width).
  bool mla = false;
  int64_t q_lora_rank = 0;  // 0: a plain q_proj (config null)
  int64_t kv_lora_rank = 0, qk_nope_head_dim = 0, qk_rope_head_dim = 0, v_head_dim = 0;
  bool rope_interleave = true;
  double attention_scale = 0;  // softmax scale when > 0 (else 1/sqrt(head_dim)); MLA: with yarn's mscale_all_dim
  // DeepSeek sparse attention (deepseek_v32, glm_moe_dsa; models/llama/dsa.h): each MLA layer's indexer keeps the
  // index_topk best keys per query. layer_indexer[i]: 1 = layer i runs its own indexer, 0 = it reuses the selection
  // of the last such layer before it (GLM-5's "shared" indexer_types).
  bool dsa = false, index_rope_interleave = false;
  int64_t index_topk = 0, index_head_dim = 0, index_n_heads = 0;
  std::vector<int64_t> layer_indexer;
  // Mixture of experts (qwen3_moe, mixtral; nn/moe.h). layer_moe[i]: layer i's MLP is an nn::MoE registered as
  // moe_module_name ("mlp": transformers 5's in-memory name for all three families); checkpoints name it
  // moe_checkpoint_name ("mlp"; Mixtral: "block_sparse_moe"). Dense layers keep the MLP of width intermediate_size.
  // Mixtral: expert width = intermediate_size (moe_intermediate_size set to it).
  std::vector<int64_t> layer_moe;  // per layer: 1 = MoE, 0 = dense (empty: all dense)
  std::string moe_module_name = "mlp", moe_checkpoint_name = "mlp";
  int64_t num_experts = 0, num_experts_per_tok = 0, moe_intermediate_size = 0;
  bool norm_topk_prob = true;
  std::string moe_scoring = "softmax";  // softmax | sigmoid
  int64_t moe_n_group = 1, moe_topk_group = 1, n_shared_experts = 0;
  bool moe_score_correction_bias = false;
  double routed_scaling_factor = 1.0;
  double router_aux_loss_coef = 0.0;  // transformers' load-balancing coefficient (used by training only)
  // GLM-4-MoE, MiniMax-M2, Mistral 4 (parse_glm4_moe / parse_minimax_m2 / parse_mistral4 in config.cpp):
  bool qk_norm_whole = false;      // MiniMax-M2: q_norm / k_norm over the whole projection (heads x head_dim)
  bool moe_bias_on_block = false;  // MiniMax-M2: the correction bias is the block's (<block>.e_score_correction_bias)
  bool moe_stacked_checkpoint = false;  // Mistral 4: experts stored stacked (experts.gate_up_proj / down_proj)
  bool lb_softmax_topk = false;    // MiniMax-M2: load balancing on softmax(logits) and its own top-k (transformers)
  // Mistral 4 (rope_parameters.llama_4_scaling_beta): queries times 1 + beta * log(1 + floor(pos / original_max))
  double llama4_scaling_beta = 0.0;
  int64_t llama4_scaling_original = 0;
  bool is_moe_layer(int64_t i) const { return i < static_cast<int64_t>(layer_moe.size()) && layer_moe[i] != 0; }
  // Qwen3-Next / Qwen3.5 text decoders (gated_deltanet_family(); models/llama/gated_deltanet.h): per layer_types a
  // layer mixes tokens by Gated DeltaNet linear attention ("linear_attn") or by full attention whose q_proj also gives
  // a sigmoid gate of its output (attn_output_gate); every RMSNorm outside the linear attention scales by
  // (1 + weight) (zero_centered_norm); MoE layers add a shared expert of shared_expert_intermediate_size behind a
  // sigmoid gate ("shared_expert", "shared_expert_gate"). Qwen3.5 projects q/k/v, z, b and a separately
  // (linear_split_projections) where Qwen3-Next packs them per key head (in_proj_qkvz, in_proj_ba).
  std::vector<int64_t> layer_linear;  // per layer: 1 = linear attention, 0 = full attention (empty: none)
  int64_t linear_conv_kernel_dim = 0, linear_key_head_dim = 0, linear_value_head_dim = 0;
  int64_t linear_num_key_heads = 0, linear_num_value_heads = 0;
  bool linear_split_projections = false, zero_centered_norm = false, attn_output_gate = false;
  int64_t shared_expert_intermediate_size = 0;
  bool is_linear_layer(int64_t i) const { return i < static_cast<int64_t>(layer_linear.size()) && layer_linear[i] != 0; }
  static bool gated_deltanet_family(const std::string& model_type) {
    return model_type == "qwen3_next" || model_type == "qwen3_5_text" || model_type == "qwen3_5_moe_text";
  }
  // Kimi Linear (kda_family(); models/llama/kimi_delta.h): per layer_types a layer mixes tokens by Kimi Delta
  // Attention (a gated delta rule with a per-key-channel decay; linear_num_key_heads = linear_num_value_heads,
  // linear_key_head_dim = linear_value_head_dim) or by latent attention without rotary embeddings (mla_rope false);
  // DeepSeek-style routed experts. Its checkpoints store every layer's MLP block, dense or MoE, as block_sparse_moe
  // (moe_checkpoint_all_mlps).
  bool mla_rope = true;
  bool moe_checkpoint_all_mlps = false;
  static bool kda_family(const std::string& model_type) { return model_type == "kimi_linear"; }
  // DeepSeek-V4 (deepseek_v4; models/llama/deepseek_v4.h): v4_attn[i] 0 = sliding window only, 1 = compressed sparse
  // attention (CSA), 2 = heavily compressed attention (HCA); v4_hash[i] 1 = hash-routed MoE (tid2eid); the window is
  // layer_window's, the main rotary rope's, the compressed layers' compress_rope.
  bool deepseek_v4 = false;
  std::vector<int64_t> v4_attn, v4_hash;
  int64_t v4_csa_rate = 4, v4_hca_rate = 128, hc_mult = 4, hc_sinkhorn_iters = 20, o_groups = 8, o_lora_rank = 1024;
  double hc_eps = 1e-6, swiglu_limit = 10.0;
  RopeConfig compress_rope;
  nlohmann::json raw;                   // the config.json as read, written back on export

  // Parses config.json's JSON; `file` names the file in errors. Fields that change the math and are not supported
  // are errors naming them.
  static DecoderConfig from_json(const nlohmann::json& j, const std::string& file = "config.json");
  static DecoderConfig from_file(const std::string& path);
  int64_t num_parameters() const;
  // Parameters one token goes through: num_parameters() with each MoE layer's routed experts counted top_k times
  // instead of num_experts times (the basis of training FLOPs per token, 6 x this, and MFU).
  int64_t num_active_parameters() const;
};

// A rotary block of config.json j (rope_scaling or rope_parameters, with rope_theta / partial_rotary_factor).
RopeConfig parse_rope(const nlohmann::json& j, const std::string& file, int64_t max_pos);

}  // namespace lf::models::llama
