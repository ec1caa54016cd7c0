#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include "loongforge/core/error.h"
#include "loongforge/data/tokenizer/components.h"
#include "loongforge/data/tokenizer/tokenizer.h"
#include "loongforge/data/tokenizer/unicode.h"

namespace tok = lf::data::tok;

namespace {
std::string write_temp(const std::string& name, const std::string& text) {
  auto dir = std::filesystem::temp_directory_path() / ("lf_tok_test_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  auto path = (dir / name).string();
  std::ofstream(path) << text;
  return path;
}

std::vector<std::string> texts(const std::vector<tok::Piece>& pieces) {
  std::vector<std::string> out;
  for (const auto& p : pieces) out.push_back(p.text);
  return out;
}
}  // namespace

TEST(Tokenizer, ByteLevelAlphabet) {
  EXPECT_EQ(tok::byte_to_char()[' '], "\xC4\xA0");   // Ġ
  EXPECT_EQ(tok::byte_to_char()['\n'], "\xC4\x8A");  // Ċ
  EXPECT_EQ(tok::byte_to_char()['A'], "A");
  for (int b = 0; b < 256; ++b) {
    size_t i = 0;
    uint32_t cp = tok::next_codepoint(tok::byte_to_char()[b], i);
    ASSERT_EQ(tok::char_to_byte(cp), std::optional<uint8_t>(static_cast<uint8_t>(b)));
  }
}

TEST(Tokenizer, SplitBehaviours) {
  tok::Piece p{"a-b--c", true};
  tok::Pattern dash{"-", nullptr};
  auto m = dash.find_all(p.text);
  using V = std::vector<std::string>;
  EXPECT_EQ(texts(tok::split_with(p, m, tok::SplitBehavior::Removed)), (V{"a", "b", "c"}));
  EXPECT_EQ(texts(tok::split_with(p, m, tok::SplitBehavior::Isolated)), (V{"a", "-", "b", "-", "-", "c"}));
  EXPECT_EQ(texts(tok::split_with(p, m, tok::SplitBehavior::MergedWithPrevious)), (V{"a-", "b-", "-", "c"}));
  EXPECT_EQ(texts(tok::split_with(p, m, tok::SplitBehavior::MergedWithNext)), (V{"a", "-b", "-", "-c"}));
  EXPECT_EQ(texts(tok::split_with(p, m, tok::SplitBehavior::Contiguous)), (V{"a", "-", "b", "--", "c"}));
  EXPECT_EQ(texts(tok::split_with(p, m, tok::SplitBehavior::Removed, /*invert=*/true)), (V{"-", "-", "-"}));
}

TEST(Tokenizer, UnicodeNormalizationAndLossyUtf8) {
  EXPECT_EQ(tok::unicode_normalize("\xEF\xAC\x81\xE2\x91\xA0", tok::NormForm::NFKC), "fi1");  // ﬁ①
  EXPECT_EQ(tok::unicode_normalize("e\xCC\x81", tok::NormForm::NFC), "\xC3\xA9");             // é
  EXPECT_EQ(tok::utf8_lossy("\xF0\x9F\x98" "a"), "\xEF\xBF\xBD" "a");
  EXPECT_EQ(tok::utf8_lossy("\xC3\x28"), "\xEF\xBF\xBD(");
  EXPECT_FALSE(tok::valid_utf8("\xED\xA0\x80"));  // a surrogate
}

TEST(Tokenizer, FixtureGpt2) {
  auto t = lf::data::Tokenizer::load(std::string(LF_SOURCE_DIR) + "/tests/fixtures/tok_bytelevel_gpt2");
  std::vector<int64_t> ids = t->encode("Hello world");
  EXPECT_EQ(ids, (std::vector<int64_t>{42, 1644, 338, 1287, 551}));
  EXPECT_EQ(t->decode(ids), "Hello world");
  EXPECT_EQ(t->token_to_id("<|endoftext|>"), std::optional<int64_t>(0));
  EXPECT_EQ(t->id_to_token(0), "<|endoftext|>");
  EXPECT_THROW(t->decode({1, 1 << 30}), lf::Error);
}

TEST(Tokenizer, BpeByteFallbackUnkAndPairMerges) {
  std::string path = write_temp("bpe.json", R"({
    "added_tokens": [{"id": 5, "content": "<s>", "special": true, "lstrip": false, "rstrip": true,
                      "single_word": false, "normalized": false}],
    "model": {"type": "BPE", "unk_token": "<unk>", "fuse_unk": true, "byte_fallback": true,
              "vocab": {"a": 0, "b": 1, "ab": 2, "<unk>": 3, "<0x63>": 4, "<s>": 5, "abab": 6},
              "merges": [["a", "b"], "ab ab"]},
    "decoder": {"type": "Sequence", "decoders": [{"type": "ByteFallback"}, {"type": "Fuse"}]}})");
  auto t = lf::data::Tokenizer::load(path);
  EXPECT_EQ(t->encode("ababcdd<s>  ab"), (std::vector<int64_t>{6, 4, 3, 5, 2}));
  EXPECT_EQ(t->decode({6, 4, 5, 2}), "ababcab");
  EXPECT_EQ(t->decode({6, 4, 5, 2}, false), "ababc<s>ab");
  EXPECT_EQ(t->vocab_size(), 7);
}

TEST(Tokenizer, UnsupportedComponentNamesFileAndField) {
  std::string path = write_temp("bad.json", R"({"model": {"type": "BPE", "vocab": {}, "merges": []},
                                                 "pre_tokenizer": {"type": "Bogus"}})");
  try {
    lf::data::Tokenizer::load(path);
    FAIL() << "expected lf::Error";
  } catch (const lf::Error& e) {
    EXPECT_EQ(std::string(e.what()), path + ": field 'pre_tokenizer.type': unsupported 'Bogus'");
  }
}
