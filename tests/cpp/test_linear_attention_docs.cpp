// Packed documents through linear-attention layers: Gated DeltaNet (models/llama/gated_deltanet.h; a tiny Qwen3.5
// text decoder, linear and full attention layers) and KDA (models/llama/kimi_delta.h; a tiny Kimi Linear, KDA and
// latent attention layers). On rows holding several documents (segment_ids, positions restarting) each gives,
// for every document, the logits and the input-embedding gradients of that document run alone (float64): the
// recurrent state and the short convolution restart at each document. The unpacked path is transformers' (tests/
// python/test_qwen3_next_parity.py). A cache or context parallelism with packed documents is an error.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <vector>

#include "loongforge/core/error.h"
#include "loongforge/models/llama/model.h"
#include "loongforge/nn/attention.h"

namespace {

using lf::models::llama::CausalLM;
using lf::models::llama::DecoderConfig;

CausalLM tiny(bool kda = false) {
  nlohmann::json j = {{"model_type", "qwen3_5_text"}, {"vocab_size", 64}, {"hidden_size", 32},
                      {"intermediate_size", 48}, {"num_hidden_layers", 3}, {"num_attention_heads", 4},
                      {"num_key_value_heads", 2}, {"head_dim", 8}, {"max_position_embeddings", 256},
                      {"rms_norm_eps", 1e-6}, {"linear_conv_kernel_dim", 4}, {"linear_key_head_dim", 8},
                      {"linear_value_head_dim", 6}, {"linear_num_key_heads", 2}, {"linear_num_value_heads", 4},
                      {"layer_types", {"linear_attention", "full_attention", "linear_attention"}}};
  if (kda)  // per-channel decay, q/k/v convolutions, dense MLPs
    j = {{"model_type", "kimi_linear"}, {"vocab_size", 64}, {"hidden_size", 32}, {"intermediate_size", 48},
         {"num_hidden_layers", 3}, {"num_attention_heads", 4}, {"num_key_value_heads", 4}, {"kv_lora_rank", 16},
         {"qk_rope_head_dim", 8}, {"qk_nope_head_dim", 16}, {"v_head_dim", 12}, {"rms_norm_eps", 1e-6},
         {"linear_attn_config", {{"head_dim", 8}, {"num_heads", 4}, {"short_conv_kernel_size", 4}}},
         {"mlp_layer_types", {"dense", "dense", "dense"}},
         {"layer_types", {"linear_attention", "full_attention", "linear_attention"}}};
  torch::manual_seed(0);
  CausalLM m(DecoderConfig::from_json(j));
  m->to(at::kDouble);
  return m;
}

void each_document_as_if_alone(CausalLM m) {
  at::manual_seed(1);
  // row 0: documents of 3, 70 (two 64-token chunks) and 7 tokens; row 1: one document of 80
  const std::vector<std::vector<int64_t>> lens{{3, 70, 7}, {80}};
  const int64_t t = 80;
  at::Tensor ids = at::randint(0, 64, {2, t}, at::kLong);
  at::Tensor seg = at::zeros({2, t}, at::kLong), pos = at::zeros({2, t}, at::kLong);
  for (int64_t r = 0; r < 2; ++r) {
    int64_t at_ = 0, d = 0;
    for (int64_t n : lens[static_cast<size_t>(r)]) {
      seg[r].narrow(0, at_, n).fill_(d++);
      pos[r].narrow(0, at_, n).copy_(at::arange(n, at::kLong));
      at_ += n;
    }
  }
  at::Tensor packed = m->logits(m->hidden_states(ids, pos, nullptr, seg));
  for (int64_t r = 0; r < 2; ++r) {
    int64_t at_ = 0;
    for (int64_t n : lens[static_cast<size_t>(r)]) {
      at::Tensor alone_ids = ids[r].narrow(0, at_, n).unsqueeze(0);
      at::Tensor alone = m->logits(m->hidden_states(alone_ids, at::arange(n, at::kLong).unsqueeze(0), nullptr, {}));
      at::Tensor mine = packed[r].narrow(0, at_, n).unsqueeze(0);
      EXPECT_LT((mine - alone).abs().max().item<double>(), 1e-10) << "row " << r << " document at " << at_;
      at_ += n;
    }
  }
  // gradients: the packed loss's gradient equals the sum of the documents' own
  m->zero_grad();
  (packed * packed).sum().backward();
  std::vector<at::Tensor> g_packed;
  for (auto& p : m->parameters()) g_packed.push_back(p.grad().clone());
  m->zero_grad();
  for (int64_t r = 0; r < 2; ++r) {
    int64_t at_ = 0;
    for (int64_t n : lens[static_cast<size_t>(r)]) {
      at::Tensor alone = m->logits(m->hidden_states(ids[r].narrow(0, at_, n).unsqueeze(0),
                                                    at::arange(n, at::kLong).unsqueeze(0), nullptr, {}));
      (alone * alone).sum().backward();
      at_ += n;
    }
  }
  size_t i = 0;
  for (auto& p : m->parameters()) {
    const at::Tensor& want = p.grad();
    EXPECT_LT((g_packed[i] - want).abs().max().item<double>(), 1e-9 * (1 + want.abs().max().item<double>())) << i;
    ++i;
  }
}

TEST(LinearAttentionDocs, EachDocumentAsIfAlone) { each_document_as_if_alone(tiny()); }

TEST(LinearAttentionDocs, KdaEachDocumentAsIfAlone) { each_document_as_if_alone(tiny(/*kda=*/true)); }

TEST(LinearAttentionDocs, CacheWithDocumentsIsAnError) {
  for (bool kda : {false, true}) {
    auto m = tiny(kda);
    at::Tensor ids = at::randint(0, 64, {1, 8}, at::kLong);
    at::Tensor seg = at::tensor({0, 0, 0, 1, 1, 1, 1, 1}, at::kLong).view({1, 8});
    at::Tensor pos = at::tensor({0, 1, 2, 0, 1, 2, 3, 4}, at::kLong).view({1, 8});
    lf::nn::KVCache cache(3);
    EXPECT_THROW(m->hidden_states(ids, pos, &cache, seg), lf::Error) << kda;
  }
}

}  // namespace
