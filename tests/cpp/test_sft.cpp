// The SFT dataset: formats, assistant masks, exact packing / labels / positions / segments, truncation, resume,
// one-line errors. A hook (SftOracle.Cases) serves tests/python/test_sft.py.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "loongforge/core/error.h"
#include "loongforge/core/fs.h"
#include "loongforge/data/chat_template.h"
#include "loongforge/data/sft_dataset.h"
#include "test_util.h"

namespace fs = std::filesystem;
using namespace lf::data;
using V = std::vector<int64_t>;

namespace {

struct TempDir {  // removed at the end of the test
  fs::path path;
  ~TempDir() { lf::remove_tree(path.string()); }
  operator const fs::path&() const { return path; }
  fs::path operator/(const std::string& name) const { return path / name; }
  std::string string() const { return path.string(); }
};

TempDir temp_dir() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  fs::path dir = fs::temp_directory_path() /
                 ("lf_sft_" + std::to_string(::getpid()) + "_" + info->test_suite_name() + "_" + info->name());
  lf::remove_tree(dir.string());
  fs::create_directories(dir);
  return TempDir{dir};
}

std::string write(const fs::path& p, const std::string& text) {
  std::ofstream(p, std::ios::binary) << text;
  return p.string();
}

// One token per character: <pad>=0 <|system|>=1 <|user|>=2 <|assistant|>=3 <|end|>=4, a..z=5..30, ' '=31, '\n'=32,
// and one merge "x y" -> "xy"=33 (to test boundaries inside a token).
std::unique_ptr<Tokenizer> char_tokenizer(const fs::path& dir) {
  nlohmann::json vocab = nlohmann::json::object(), added = nlohmann::json::array();
  const char* specials[] = {"<pad>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"};
  for (int i = 0; i < 5; ++i) {
    vocab[specials[i]] = i;
    added.push_back({{"id", i}, {"content", specials[i]}, {"special", true}, {"lstrip", false}, {"rstrip", false},
                     {"single_word", false}, {"normalized", false}});
  }
  for (int c = 0; c < 26; ++c) vocab[std::string(1, static_cast<char>('a' + c))] = 5 + c;
  vocab[" "] = 31;
  vocab["\n"] = 32;
  vocab["xy"] = 33;
  nlohmann::json t = {{"added_tokens", added},
                      {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", {"x y"}}}},
                      {"decoder", {{"type", "Fuse"}}}};
  return Tokenizer::load(write(dir / "tokenizer.json", t.dump()));
}

// ChatML-like: "<|role|>content<|end|>\n" per message; the generation prompt is "<|assistant|>".
const char* kTemplate =
    "{% for m in messages %}{{ '<|' + m.role + '|>' + m.content + '<|end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}";

SftOptions options(const std::vector<std::string>& files, int64_t seq_len, bool packing = true) {
  SftOptions o;
  o.files = files;
  o.chat_template = kTemplate;
  o.eos_token = "<|end|>";
  o.seq_len = seq_len;
  o.packing = packing;
  return o;
}

// c0 = user "ab" / assistant "cd":  <|user|> a b <|end|> \n <|assistant|> c d <|end|> \n
const V kC0 = {2, 5, 6, 4, 32, 3, 7, 8, 4, 32};
const V kC0Labels = {-100, -100, -100, -100, -100, 7, 8, 4, -100, -100};  // predict c, d, <|end|> (not the "\n")
// c1 = alpaca instruction "x" / output "y":  <|user|> x <|end|> \n <|assistant|> y <|end|> \n
const V kC1 = {2, 28, 4, 32, 3, 29, 4, 32};
const V kC1Labels = {-100, -100, -100, -100, 29, 4, -100, -100};
const char* kTwo =
    "{\"messages\": [{\"role\": \"user\", \"content\": \"ab\"}, {\"role\": \"assistant\", \"content\": \"cd\"}]}\n"
    "\n"
    "{\"instruction\": \"x\", \"output\": \"y\"}\n";

V iota_v(size_t n) {
  V v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<int64_t>(i);
  return v;
}
V cat(std::initializer_list<V> parts) {
  V out;
  for (const auto& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}

using lf::test::error_of;

}  // namespace

TEST(Sft, EncodeAndAssistantMask) {
  auto dir = temp_dir();
  auto tok = char_tokenizer(dir);
  SftDataset ds(options({write(dir / "d.jsonl", kTwo)}, 64), *tok);
  ASSERT_EQ(ds.num_conversations(), 2u);
  auto e0 = ds.encode_conversation(0);
  EXPECT_EQ(e0.text, "<|user|>ab<|end|>\n<|assistant|>cd<|end|>\n");
  EXPECT_EQ(e0.ids, kC0);
  EXPECT_EQ(e0.assistant_mask, (std::vector<uint8_t>{0, 0, 0, 0, 0, 0, 1, 1, 1, 0}));
  EXPECT_EQ(ds.encode_conversation(1).ids, kC1);
  EXPECT_EQ(ds.pad_id(), 4);  // eos_token

  // sharegpt, multi-turn, with a system prompt: both replies and their end tokens.
  auto f = write(dir / "s.jsonl",
                 R"({"system": "s", "conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"},)"
                 R"( {"from": "human", "value": "c"}, {"from": "gpt", "value": "d"}]})");
  SftDataset s(options({f}, 64), *tok);
  auto e = s.encode_conversation(0);
  EXPECT_EQ(e.ids, (V{1, 23, 4, 32, 2, 5, 4, 32, 3, 6, 4, 32, 2, 7, 4, 32, 3, 8, 4, 32}));
  EXPECT_EQ(e.assistant_mask,
            (std::vector<uint8_t>{0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 0}));

  // A boundary inside a token ("x|y" -> "xy"): the prefix fallback gives the straddling token to the reply.
  auto opts = options({write(dir / "m.jsonl", R"({"messages": [{"role": "user", "content": "ax"}, )"
                                              R"({"role": "assistant", "content": "yb"}]})")},
                      64);
  opts.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}";
  SftDataset m(opts, *tok);
  EXPECT_EQ(m.encode_conversation(0).ids, (V{5, 33, 6}));
  EXPECT_EQ(m.encode_conversation(0).assistant_mask, (std::vector<uint8_t>{0, 1, 1}));
}

TEST(Sft, PackingLabelsPositionsSegments) {
  auto dir = temp_dir();
  auto tok = char_tokenizer(dir);
  SftDataset ds(options({write(dir / "d.jsonl", kTwo)}, 20), *tok);
  for (int epoch = 0; epoch < 3; ++epoch) {
    SftSample s = ds.next();  // both conversations (10 + 8 positions) and 2 of padding
    const bool c0_first = s.input_ids[0] == kC0[0] && s.input_ids[1] == kC0[1];
    const V& a = c0_first ? kC0 : kC1;
    const V& b = c0_first ? kC1 : kC0;
    const V& la = c0_first ? kC0Labels : kC1Labels;
    const V& lb = c0_first ? kC1Labels : kC0Labels;
    EXPECT_EQ(s.input_ids, cat({a, b, {4, 4}}));
    EXPECT_EQ(s.labels, cat({la, lb, {-100, -100}}));
    EXPECT_EQ(s.position_ids, cat({iota_v(a.size()), iota_v(b.size()), {0, 1}}));
    EXPECT_EQ(s.segment_ids, cat({V(a.size(), 0), V(b.size(), 1), {2, 2}}));
    EXPECT_EQ(s.documents, (V{static_cast<int64_t>(a.size()), static_cast<int64_t>(b.size())}));  // padding left out
    EXPECT_EQ(ds.epoch(), static_cast<uint64_t>(epoch + 1));
  }
  // seq_len 17: only one fits per sequence.
  SftDataset one(options({write(dir / "d2.jsonl", kTwo)}, 17), *tok);
  SftSample s = one.next();
  const V& a = s.input_ids[1] == 5 ? kC0 : kC1;
  EXPECT_EQ(s.segment_ids, cat({V(a.size(), 0), V(17 - a.size(), 1)}));
  EXPECT_EQ(s.position_ids, cat({iota_v(a.size()), iota_v(17 - a.size())}));

  // No packing, pad_id 0, loss on every token.
  auto o = options({write(dir / "d3.jsonl", kTwo)}, 12, false);
  o.pad_id = 0;
  o.assistant_only_loss = false;
  SftDataset np(o, *tok);
  for (int i = 0; i < 2; ++i) {
    s = np.next();
    const V& c = s.input_ids[1] == 5 ? kC0 : kC1;
    V labels(c.begin() + 1, c.end());
    labels.resize(12, -100);
    EXPECT_EQ(s.input_ids, cat({c, V(12 - c.size(), 0)}));
    EXPECT_EQ(s.labels, labels);
    EXPECT_EQ(s.segment_ids, cat({V(c.size(), 0), V(12 - c.size(), 1)}));
  }
}

TEST(Sft, TruncationKeepsSeqLenPlusOneTokens) {
  auto dir = temp_dir();
  auto tok = char_tokenizer(dir);
  ::testing::internal::CaptureStderr();
  SftDataset ds(options({write(dir / "d.jsonl", kTwo)}, 6, false), *tok);
  std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(ds.num_truncated(), 2u);
  EXPECT_NE(err.find("2 of 2 conversations"), std::string::npos) << err;
  EXPECT_EQ(std::count(err.begin(), err.end(), '\n'), 1);
  for (int i = 0; i < 2; ++i) {
    SftSample s = ds.next();
    if (s.input_ids[1] == 5) {  // c0 cut to 7 tokens: the 7th (c) is only a label
      EXPECT_EQ(s.input_ids, (V{2, 5, 6, 4, 32, 3}));
      EXPECT_EQ(s.labels, (V{-100, -100, -100, -100, -100, 7}));
    } else {
      EXPECT_EQ(s.input_ids, (V{2, 28, 4, 32, 3, 29}));
      EXPECT_EQ(s.labels, (V{-100, -100, -100, -100, 29, 4}));
    }
    EXPECT_EQ(s.position_ids, iota_v(6));
    EXPECT_EQ(s.segment_ids, V(6, 0));
  }
  // seq_len 9: c1 (8 tokens) fits; c0 (10 = seq_len + 1) is not truncated and loses no prediction.
  SftDataset nine(options({write(dir / "d9.jsonl", kTwo)}, 9, false), *tok);
  EXPECT_EQ(nine.num_truncated(), 0u);
  for (int i = 0; i < 2; ++i) {
    SftSample s = nine.next();
    if (s.input_ids[1] == 5) {
      EXPECT_EQ(s.input_ids, V(kC0.begin(), kC0.end() - 1));
      EXPECT_EQ(s.labels, V(kC0Labels.begin(), kC0Labels.end() - 1));
    }
  }
}

TEST(Sft, ShuffleAndExactResume) {
  auto dir = temp_dir();
  auto tok = char_tokenizer(dir);
  std::string text;
  for (int i = 0; i < 7; ++i) {
    std::string q(1 + i % 3, static_cast<char>('a' + i)), r(1 + i, static_cast<char>('m' + i));
    text += R"({"instruction": ")" + q + R"(", "output": ")" + r + "\"}\n";
  }
  auto f = write(dir / "d.jsonl", text);
  auto o = options({f}, 24);
  SftDataset a(o, *tok);
  std::vector<SftSample> all;
  for (int i = 0; i < 30; ++i) all.push_back(a.next());
  EXPECT_EQ(a.state()["samples"], 30);

  SftDataset b(o, *tok);
  for (int i = 0; i < 11; ++i) EXPECT_EQ(b.next(), all[i]);
  nlohmann::json st = nlohmann::json::parse(b.state().dump());
  SftDataset c(o, *tok);
  c.restore(st);
  for (int i = 11; i < 30; ++i) EXPECT_EQ(c.next(), all[i]) << i;

  // Without packing, each epoch is a permutation; another seed gives another order.
  auto np = options({f}, 24, false);
  SftDataset e(np, *tok);
  np.seed = 99;
  SftDataset g(np, *tok);
  std::vector<V> epoch0, other;
  bool differs = false;
  for (int i = 0; i < 14; ++i) {
    V x = e.next().input_ids, y = g.next().input_ids;
    differs |= x != y;
    if (i < 7) epoch0.push_back(x);
  }
  EXPECT_TRUE(differs);
  std::vector<V> expected;
  for (size_t i = 0; i < 7; ++i) {
    V ids = e.encode_conversation(i).ids;
    ids.resize(24, 4);
    expected.push_back(ids);
  }
  std::sort(epoch0.begin(), epoch0.end());
  std::sort(expected.begin(), expected.end());
  EXPECT_EQ(epoch0, expected);

  std::string err = error_of([&] { g.restore(st); });
  EXPECT_NE(err.find("sft data state: field 'seed'"), std::string::npos) << err;
  st.erase("conversations_consumed");
  err = error_of([&] { c.restore(st); });
  EXPECT_EQ(err, "sft data state: field 'conversations_consumed': missing");
}

TEST(Sft, MalformedLinesAreOneLineErrors) {
  auto dir = temp_dir();
  auto tok = char_tokenizer(dir);
  auto check = [&](const std::string& line, const std::string& expected_prefix, const std::string& also = "") {
    auto f = write(dir / "bad.jsonl", "{\"instruction\": \"a\", \"output\": \"b\"}\n\n" + line + "\n");
    std::string err = error_of([&] { SftDataset(options({f}, 16), *tok); });
    EXPECT_EQ(err.rfind(f + ":3: " + expected_prefix, 0), 0u) << err;
    EXPECT_NE(err.find(also), std::string::npos) << err;
    EXPECT_EQ(err.find('\n'), std::string::npos) << err;
  };
  check(R"({"messages": [)", "invalid JSON");
  check(R"({"foo": 1})", "unknown format");
  check(R"([1, 2])", "expected a JSON object");
  check(R"({"messages": [{"role": "bot", "content": "x"}]})", "field 'messages[0].role': unknown role 'bot'");
  check(R"({"messages": [{"role": "user", "content": 5}]})", "field 'messages[0].content': expected a string");
  check(R"({"messages": [{"role": "user", "content": "x"}]})", "field 'messages': no assistant message");
  check(R"({"messages": []})", "field 'messages': empty");
  check(R"({"conversations": [{"from": "human", "value": "a"}, {"from": "bot", "value": "b"}]})",
        "field 'conversations[1].from': unknown role 'bot'");
  check(R"({"conversations": [{"from": "gpt"}]})", "field 'conversations[0].value': missing");
  check(R"({"instruction": "a"})", "field 'output': missing");
  check(R"({"instruction": "a", "input": 3, "output": "b"})", "field 'input': expected a string");

  // Templates: not prefix-stable; raise_exception; the data line is named.
  auto f = write(dir / "ok.jsonl", kTwo);
  auto o = options({f}, 16);
  o.chat_template = "{{ messages | length }}" + std::string(kTemplate);
  o.template_origin = "tpl.jinja";
  std::string err = error_of([&] { SftDataset(o, *tok); });
  EXPECT_NE(err.find(f + ":1: chat template tpl.jinja is not prefix-stable"), std::string::npos) << err;
  o.assistant_only_loss = false;  // no spans needed: fine
  EXPECT_NO_THROW(SftDataset(o, *tok));
  o.chat_template = "{% if messages[0].role == 'user' %}{{ raise_exception('no users') }}{% endif %}";
  err = error_of([&] { SftDataset(o, *tok); });
  EXPECT_NE(err.find(f + ":1: chat template: tpl.jinja:1: "), std::string::npos) << err;
  EXPECT_NE(err.find("no users"), std::string::npos) << err;

  err = error_of([&] { SftDataset(options({(dir / "missing.jsonl").string()}, 16), *tok); });
  EXPECT_EQ(err, (dir / "missing.jsonl").string() + ": cannot open");
  err = error_of([&] { SftDataset(options({f}, 0), *tok); });
  EXPECT_EQ(err, "sft options: field 'seq_len': must be >= 1");
}

// Hook for tests/python/test_sft.py. LF_SFT_CASES: a JSON list of {"tokenizer_dir", "template" | "builtin",
// "bos_token", "eos_token", "files", "seq_len", "packing", "assistant_only_loss", "seed", "samples": N}; writes to
// LF_SFT_OUT a list of {"conversations": [{"text", "ids", "mask"}], "samples": [{input_ids, labels, position_ids,
// segment_ids}], "num_truncated", "pad_id"} or {"error": message}.
TEST(SftOracle, Cases) {
  const char* in = std::getenv("LF_SFT_CASES");
  const char* out = std::getenv("LF_SFT_OUT");
  if (!in || !out) GTEST_SKIP() << "LF_SFT_CASES / LF_SFT_OUT not set";
  std::ifstream f(in);
  ASSERT_TRUE(f) << in;
  nlohmann::json cases = nlohmann::json::parse(f), results = nlohmann::json::array();
  for (const auto& c : cases) {
    try {
      auto tok = Tokenizer::load(c["tokenizer_dir"].get<std::string>());
      SftOptions o;
      o.files = c["files"].get<std::vector<std::string>>();
      o.chat_template = c.contains("builtin") ? ChatTemplate::builtin(c["builtin"].get<std::string>())
                                              : c["template"].get<std::string>();
      o.bos_token = c.value("bos_token", "");
      o.eos_token = c.value("eos_token", "");
      o.seq_len = c.value("seq_len", int64_t{2048});
      o.packing = c.value("packing", true);
      o.assistant_only_loss = c.value("assistant_only_loss", true);
      o.seed = c.value("seed", uint64_t{1234});
      o.pad_id = c.value("pad_id", int64_t{-1});
      SftDataset ds(o, *tok);
      nlohmann::json convs = nlohmann::json::array(), samples = nlohmann::json::array();
      for (size_t i = 0; i < ds.num_conversations(); ++i) {
        auto e = ds.encode_conversation(i);
        convs.push_back({{"text", e.text}, {"ids", e.ids}, {"mask", e.assistant_mask}});
      }
      for (int i = 0; i < c.value("samples", 0); ++i) {
        SftSample s = ds.next();
        samples.push_back({{"input_ids", s.input_ids}, {"labels", s.labels}, {"position_ids", s.position_ids},
                           {"segment_ids", s.segment_ids}});
      }
      results.push_back({{"conversations", convs}, {"samples", samples}, {"num_truncated", ds.num_truncated()},
                         {"pad_id", ds.pad_id()}, {"state", ds.state()}});
    } catch (const lf::Error& e) {
      results.push_back({{"error", e.what()}});
    }
  }
  std::ofstream(out) << results.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

TEST(Sft, SkipBadLeavesBadConversationsOutAndCountsThem) {
  auto dir = temp_dir();
  auto tok = char_tokenizer(dir);
  const std::string good1 = R"({"instruction": "ab", "output": "cd"})", good2 = R"({"instruction": "e", "output": "f"})";
  auto f = write(dir / "d.jsonl", good1 + "\n{\"messages\": [\n" +
                                      R"({"messages": [{"role": "user", "content": "x"}]})" + "\n" + good2 + "\n");
  std::string err = error_of([&] { SftDataset(options({f}, 16), *tok); });
  EXPECT_EQ(err.rfind(f + ":2: invalid JSON", 0), 0u) << err;
  auto o = options({f}, 16);
  o.skip_bad = true;
  SftDataset ds(o, *tok);
  EXPECT_EQ(ds.num_conversations(), 2u);
  EXPECT_EQ(ds.num_read(), 4u);
  EXPECT_EQ(ds.num_skipped(), 2u);
  EXPECT_EQ(ds.first_skipped().rfind(f + ":2: invalid JSON", 0), 0u) << ds.first_skipped();
  SftDataset clean(options({write(dir / "c.jsonl", good1 + "\n" + good2 + "\n")}, 16), *tok);
  EXPECT_EQ(clean.num_skipped(), 0u);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(ds.next(), clean.next()) << i;

  // An image image_tokens cannot read: the error names the field it came from; skipped with skip_bad.
  auto img = write(dir / "i.jsonl", good1 + "\n" +
                                        R"({"images": ["a.png", "b.png"], "conversations": [{"from": "human", )"
                                        R"("value": "<image><image>ab"}, {"from": "gpt", "value": "cd"}]})" "\n");
  auto oi = options({img}, 32);
  oi.image_token_id = 1;  // <|system|> stands for the image token here
  oi.image_placeholder = "<|system|>";
  oi.image_tokens = [](const std::string& p) -> int64_t {
    if (p.ends_with("b.png")) throw lf::Error(p + ": not a JPEG or PNG image");
    return 2;
  };
  err = error_of([&] { SftDataset(oi, *tok); });
  EXPECT_EQ(err, img + ":2: field 'images[1]': " + (dir / "b.png").string() + ": not a JPEG or PNG image");
  oi.skip_bad = true;
  SftDataset with_images(oi, *tok);
  EXPECT_EQ(with_images.num_conversations(), 1u);
  EXPECT_EQ(with_images.num_skipped(), 1u);

  // Nothing good left: still an error, with the first bad one.
  o.files = {write(dir / "b.jsonl", "[1]\n")};
  err = error_of([&] { SftDataset(o, *tok); });
  EXPECT_NE(err.find("no conversations"), std::string::npos) << err;
  EXPECT_NE(err.find("b.jsonl:1: expected a JSON object"), std::string::npos) << err;
}
