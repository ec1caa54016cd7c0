// DeepSeek-V4 (models/llama/deepseek_v4.h): the generation cache. Decoding through it (a prompt, then chunks and
// single tokens) gives the full-sequence forward's hidden states, while what it holds per layer stays bounded: the
// last sliding_window - 1 keys, the compressed entries of the complete windows and the rows of the incomplete one.
// Parity with transformers (its cached greedy decoding): tests/python/test_deepseek_v4_parity.py. Packed documents
// (segment_ids, positions restarting per document) give each document's own hidden states and gradients. The
// hyper-connections stay float32 under bf16 autocast.
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <nlohmann/json.hpp>

#include "loongforge/models/llama/deepseek_v4.h"
#include "loongforge/models/llama/model.h"

namespace {

using lf::models::llama::CausalLM;
using lf::models::llama::DecoderConfig;

// 4 layers: sliding only, CSA (every 4 tokens, its indexer keeps 3), HCA (every 8), CSA; windows of 8 keys; the
// first layer's MoE hash-routed. 8 indexer heads: with few, relu often zeroes every head's score of several entries,
// and top-k among such ties may pick differently over a different number of entries (the full sequence's).
nlohmann::json tiny() {
  return {{"model_type", "deepseek_v4"}, {"vocab_size", 64}, {"hidden_size", 32}, {"moe_intermediate_size", 16},
          {"num_hidden_layers", 4}, {"num_attention_heads", 4}, {"num_key_value_heads", 1}, {"head_dim", 16},
          {"q_lora_rank", 24}, {"qk_rope_head_dim", 8}, {"num_experts_per_tok", 2}, {"n_routed_experts", 4},
          {"layer_types", {"sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                           "compressed_sparse_attention"}},
          {"mlp_layer_types", {"hash_moe", "moe", "moe", "moe"}},
          {"compress_rates", {{"compressed_sparse_attention", 4}, {"heavily_compressed_attention", 8}}},
          {"hc_mult", 2}, {"hc_sinkhorn_iters", 3}, {"sliding_window", 8}, {"o_groups", 2}, {"o_lora_rank", 8},
          {"index_n_heads", 8}, {"index_head_dim", 8}, {"index_topk", 3}, {"max_position_embeddings", 256}};
}

TEST(DeepseekV4Cache, IncrementalDecodingEqualsTheFullForward) {
  at::manual_seed(0);
  CausalLM m(DecoderConfig::from_json(tiny(), "config.json"));
  m->init_weights(0.02);
  {
    at::NoGradGuard ng;
    for (auto& p : m->parameters()) p.add_(at::randn_like(p) * 0.3);  // every weight matters
    for (auto& item : m->named_buffers())
      if (item.key().ends_with("tid2eid")) item.value().copy_(at::randint(0, 4, item.value().sizes(), at::kLong));
  }
  m->eval();
  at::NoGradGuard ng;
  const int64_t t = 30;
  const at::Tensor ids = at::randint(2, 64, {2, t}, at::kLong);
  const at::Tensor full = m->hidden_states(ids);
  lf::nn::KVCache cache = m->new_cache();
  std::vector<at::Tensor> parts;
  int64_t begin = 0;
  for (int64_t len : {7, 1, 1, 3, 1, 5, 1, 1, 1, 9}) {  // 30 tokens: chunks across window boundaries, single tokens
    parts.push_back(m->hidden_states(ids.narrow(1, begin, len), {}, &cache));
    begin += len;
    EXPECT_EQ(cache.length(), begin);
    for (int64_t l = 0; l < 4; ++l)  // the sliding window's keys only
      EXPECT_EQ(lf::models::llama::v4_cache_keys(cache, l).size(2), std::min<int64_t>(7, begin)) << l;
    for (int64_t l : {1, 3}) {  // CSA: entries of complete windows of 4 (compressor and indexer), the rest pending
      for (bool indexer : {false, true}) {
        auto st = lf::models::llama::v4_cache_state(cache, l, indexer);
        EXPECT_EQ(st.entries->size(1), begin / 4);
        EXPECT_EQ(st.pending_kv->size(1), begin % 4);
      }
    }
    auto hca = lf::models::llama::v4_cache_state(cache, 2, false);
    EXPECT_EQ(hca.entries->size(1), begin / 8);
    EXPECT_EQ(hca.pending_kv->size(1), begin % 8);
  }
  ASSERT_EQ(begin, t);
  const at::Tensor got = at::cat(parts, 1);
  EXPECT_LE((got - full).abs().max().item<double>(), 1e-5 * full.abs().max().item<double>());
}

// Two rows of 30 tokens, one holding documents of 13 and 17 (its window, compressed entries and indexer restart at
// the second), one a single document: the hidden states are each document's own, and so are the gradients of the
// summed outputs.
TEST(DeepseekV4Packed, DocumentsEqualSeparateSequences) {
  at::manual_seed(1);
  CausalLM m(DecoderConfig::from_json(tiny(), "config.json"));
  m->init_weights(0.02);
  {
    at::NoGradGuard ng;
    for (auto& p : m->parameters()) p.add_(at::randn_like(p) * 0.3);
    for (auto& item : m->named_buffers())
      if (item.key().ends_with("tid2eid")) item.value().copy_(at::randint(0, 4, item.value().sizes(), at::kLong));
  }
  const at::Tensor ids = at::randint(2, 64, {2, 30}, at::kLong);
  const at::Tensor seg = at::cat({at::cat({at::zeros({1, 13}, at::kLong), at::ones({1, 17}, at::kLong)}, 1),
                                  at::zeros({1, 30}, at::kLong)}, 0);
  const at::Tensor pos = at::cat({at::cat({at::arange(13), at::arange(17)}).unsqueeze(0), at::arange(30).unsqueeze(0)}, 0);
  const at::Tensor packed = m->hidden_states(ids, pos, nullptr, seg);
  packed.sum().backward();
  std::map<std::string, at::Tensor> g1;
  for (auto& item : m->named_parameters())  // (the indexers get none)
    if (item.value().grad().defined()) g1[item.key()] = item.value().grad().clone();
  m->zero_grad();
  const at::Tensor a = m->hidden_states(ids.narrow(0, 0, 1).narrow(1, 0, 13));
  const at::Tensor b = m->hidden_states(ids.narrow(0, 0, 1).narrow(1, 13, 17));
  const at::Tensor c = m->hidden_states(ids.narrow(0, 1, 1));
  const at::Tensor separate = at::cat({at::cat({a, b}, 1), c}, 0);
  (a.sum() + b.sum() + c.sum()).backward();
  EXPECT_LT((packed - separate).abs().max().item<double>(), 1e-5);
  EXPECT_GT((packed.narrow(0, 0, 1) - m->hidden_states(ids.narrow(0, 0, 1))).abs().max().item<double>(), 1e-3);
  for (auto& item : m->named_parameters()) {
    const at::Tensor& g = item.value().grad();
    ASSERT_EQ(g.defined(), g1.count(item.key()) > 0) << item.key();
    if (!g.defined()) continue;
    EXPECT_LT((g1[item.key()] - g).abs().max().item<double>(), 1e-4 * std::max(1.0, g.abs().max().item<double>()))
        << item.key();
  }
}

}  // namespace

// transformers keeps the hyper-connections (attn_hc, ffn_hc, hc_head) in float32 when the model runs in bf16: under
// bf16 autocast (precision: bf16) their mixing weights come out as without it, where the autocast's bf16 linear would
// round them (~1e-2 relative), and gradients reach their parameters in float32.
TEST(DeepseekV4Precision, HyperConnectionsStayFloat32UnderAutocast) {
  at::manual_seed(2);
  auto cfg = DecoderConfig::from_json(tiny(), "config.json");
  lf::models::llama::V4HyperConnection hc(cfg, false), head(cfg, true);
  {
    at::NoGradGuard ng;
    for (auto* m : {&hc, &head})
      for (auto& p : (*m)->parameters()) p.normal_(0.0, 0.5);
  }
  const at::Tensor h = at::randn({2, 5, 2, 32});
  auto run = [&](bool autocast) {
    at::autocast::set_autocast_enabled(at::kCPU, autocast);
    at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
    auto [post, comb, collapsed] = hc->forward(h);
    const at::Tensor out = head->collapse(h);
    at::autocast::set_autocast_enabled(at::kCPU, false);
    at::autocast::clear_cache();
    (post.sum() + comb.sum() * 0.5 + (collapsed * collapsed).sum() + (out * out).sum()).backward();
    std::vector<at::Tensor> r{post, comb, collapsed, out, hc->fn.grad().clone(), head->fn.grad().clone()};
    hc->fn.mutable_grad().zero_();
    head->fn.mutable_grad().zero_();
    return r;
  };
  const auto plain = run(false), mixed = run(true);
  for (size_t i = 0; i < plain.size(); ++i) {
    EXPECT_EQ(mixed[i].scalar_type(), at::kFloat) << i;
    EXPECT_TRUE(at::equal(mixed[i], plain[i])) << i << " max diff " << (mixed[i] - plain[i]).abs().max().item<double>();
  }
}
