"""`loongforge tokenize` against the Hugging Face `tokenizers` library and `sentencepiece`.

Tokenizers are trained here, at test time, on a small generated corpus (nothing is downloaded); each is saved to a
temp dir and our binary must give the same ids and decoded text for a list of hard cases. Encoding runs all texts
through one process (stdin JSON-array mode).
"""
import json
import random
import subprocess

import pytest
from conftest import LF_BIN, run_lf

tokenizers = pytest.importorskip("tokenizers")
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

# ------------------------------------------------------------------------------------------------ corpus and cases

WORDS = {
    "latin": "the quick brown fox jumps over the lazy dog while tokenizers merge frequent pairs of symbols "
             "café naïve résumé Ångström Grüße aus München".split(),
    "cyrillic": "Привет мир как дела это простой тест для токенизатора".split(),
    "greek": "Καλημέρα κόσμε αυτό είναι ένα τεστ".split(),
    "cjk": "你好 世界 这是 一个 测试 日本語 の テキスト 한국어 문장".split(),
    "arabic": "مرحبا بالعالم هذا اختبار".split(),
    "devanagari": "नमस्ते दुनिया यह एक परीक्षण है".split(),
    "emoji": ["😀", "😃😄", "👍", "👍🏽", "👨‍👩‍👧‍👦", "🏳️‍🌈", "🐉", "❤️"],
    "code": ["def", "f(x):", "return", "x**2", "{", "}", "c[i]", "=", "'d';", "&&", "#", "//", "->", "::"],
    "digits": ["1234567890", "3.14159", "1,000,000", "2024", "42", "007"],
}
UNSEEN = "龘 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ꙮ ᚠᛇᚻ 🦑"  # never in the corpus: byte fallback / unk


def make_corpus(n=400):
    rng = random.Random(1234)
    groups = list(WORDS.values())
    seps = [" ", " ", " ", "  ", "\t", "\n", "   ", "\n\n", " \t "]
    lines = []
    for i in range(n):
        k = rng.randint(3, 14)
        parts = []
        for _ in range(k):
            parts.append(rng.choice(rng.choice(groups)))
            parts.append(rng.choice(seps))
        line = "".join(parts)
        if i % 7 == 0:
            line = "    " + line  # indentation
        if i % 11 == 0:
            line = "I'm don't we'll they've she'd " + line
        lines.append(line)
    return lines


CORPUS = make_corpus()

CASES = [
    "", " ", "   ", "\n", "\n\n\n", "\t\tindented\ttabs", "Hello world", "  leading and trailing  ",
    "multiple     spaces", "line1\nline2\r\nline3\n\n", "Привет, мир! Как дела?", "Καλημέρα κόσμε",
    "你好，世界！这是一个测试。", "日本語のテキスト", "مرحبا بالعالم", "नमस्ते दुनिया", "😀😃😄 emoji",
    "👨‍👩‍👧‍👦 family ZWJ", "🏳️‍🌈 flag", "👍🏽 skin tone", "1234567890 3.14159 1,000,000",
    "def f(x):\n    return x**2  # comment\n", "if (a && b) { c[i] = 'd'; }", "I'm don't we'll they've she'd",
    "CAPS lowercase MiXeD I'M DON'T", "ｆｕｌｌｗｉｄｔｈ ｔｅｘｔ ①②③ ﬁ", "café naïve résumé Ångström",
    "e\u0301 combining", "unseen: " + UNSEEN, "tabs\tand\vvertical\fform feed",
    "\u00a0nbsp\u2003emspace\u3000ideographic", "x" * 300, "ab" * 200 + " " + "1" * 50,
]


def special_cases(specials):
    """Cases with the special tokens inside text, next to spaces and words."""
    a, b = specials[0], specials[-1]
    return [a, f"{a}Hello{b}", f"{a} Hello {b} world", f"text{a}{b}text", f"  {a}  spaced  {b}  ",
            f"{a}\n{b}\n", f"no{a}space 你好{b}😀"]


def decode_exact(path, ids, *extra):
    """`--decode` output as exact text (run_lf's text mode would turn \\r\\n into \\n)."""
    proc = subprocess.run([str(LF_BIN), "tokenize", "--tokenizer", str(path), "--decode", ",".join(map(str, ids)),
                           *extra], capture_output=True)
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stdout.endswith(b"\n")
    return proc.stdout[:-1].decode("utf-8")


def encode_all(path, texts):
    out = run_lf("tokenize", "--tokenizer", path, input=json.dumps(texts)).stdout
    assert out.endswith("\n") and out.count("\n") == 1
    got = json.loads(out)
    assert len(got) == len(texts)
    return got


def decode_all(path, id_lists):
    out = run_lf("tokenize", "--tokenizer", path, "--decode-stdin", input=json.dumps(id_lists)).stdout
    return json.loads(out)


def check(tok, tmp_path, cases, name="tokenizer.json"):
    """Saves TOK, then compares our encode and decode (one process each) with tokenizers."""
    path = tmp_path / name
    tok.save(str(path))
    got = encode_all(tmp_path, cases)
    for text, ids in zip(cases, got):
        assert ids == tok.encode(text).ids, f"encode {text!r}"
    for text, ids, dec in zip(cases, got, decode_all(path, got)):
        assert dec == tok.decode(ids), f"decode {text!r}"
    # the single --decode mode, exact bytes (case 9 has \r\n)
    assert decode_exact(path, got[9]) == tok.decode(got[9]), f"--decode {cases[9]!r}"


def byte_fallback_vocab(tok):
    """The trained tokenizer.json with <0x00>..<0xFF> appended to the BPE vocab (as Llama-2 has them)."""
    j = json.loads(tok.to_str())
    vocab = j["model"]["vocab"]
    n = max(max(vocab.values()), max((t["id"] for t in j["added_tokens"]), default=-1)) + 1
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", n + b)
    return Tokenizer.from_str(json.dumps(j))


# ------------------------------------------------------------------------------------------------ the fixture


def test_fixture_bytelevel_gpt2(fixtures_dir):
    d = fixtures_dir / "tok_bytelevel_gpt2"
    cases = json.loads((d / "cases.json").read_text())
    got = json.loads(run_lf("tokenize", "--tokenizer", d, input=json.dumps([c["text"] for c in cases])).stdout)
    assert got == [c["ids"] for c in cases]
    decoded = decode_all(d / "tokenizer.json", [c["ids"] for c in cases])
    for c, dec in zip(cases, decoded):
        assert dec == c.get("decoded", dec), c["text"]
    for c in cases[:3]:  # the single --decode mode
        assert decode_exact(d / "tokenizer.json", c["ids"]) == c["decoded"], c["text"]
    # --text prints one compact JSON line
    first = cases[0]
    assert run_lf("tokenize", "--tokenizer", d, "--text", first["text"]).stdout == json.dumps(
        first["ids"], separators=(",", ":")) + "\n"


# ------------------------------------------------------------------------------------------------ trained tokenizers


def test_bytelevel_gpt2_regex(tmp_path):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=True)
    trainer = trainers.BpeTrainer(vocab_size=1000, special_tokens=["<|endoftext|>", "<|pad|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_tokens([AddedToken("<mask>", lstrip=True, rstrip=True), AddedToken("hello world", normalized=True)])
    cases = CASES + special_cases(["<|endoftext|>", "<|pad|>"]) + ["a  <mask>  b", "say hello world!"]
    check(tok, tmp_path, cases)


def test_bytelevel_prefix_space(tmp_path):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    check(tok, tmp_path, CASES + special_cases(["<s>"]))


LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def test_llama3_split_regex_with_bos(tmp_path):
    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
    trainer = trainers.BpeTrainer(vocab_size=1200, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A $B:1",
                                      special_tokens=[("<|begin_of_text|>", bos)]),
    ])
    check(tok, tmp_path, CASES + special_cases(specials))
    # without the BOS
    ids = json.loads(run_lf("tokenize", "--tokenizer", tmp_path, "--text", "Hello world",
                            "--no-add-special-tokens").stdout)
    assert ids == tok.encode("Hello world", add_special_tokens=False).ids
    # keeping special tokens when decoding
    full = tok.encode("Hello world").ids
    assert decode_exact(tmp_path, full, "--keep-special-tokens") == tok.decode(full, skip_special_tokens=False)


LLAMA2_DECODER = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]


def train_sp_style_bpe(normalizer, pre_tokenizer, vocab_size=800):
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"], limit_alphabet=300,
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return byte_fallback_vocab(tok)


def test_llama2_style_prepend_replace_byte_fallback(tmp_path):
    tok = train_sp_style_bpe(normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]), None)
    tok.decoder = decoders.Sequence(LLAMA2_DECODER)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    check(tok, tmp_path, CASES + special_cases(["<s>", "</s>"]))


def test_metaspace_nfkc_byte_fallback(tmp_path):
    tok = train_sp_style_bpe(normalizers.NFKC(), pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first"))
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace(prepend_scheme="first")])
    check(tok, tmp_path, CASES + special_cases(["<s>", "</s>"]))


def test_metaspace_always_no_split_regex_replace(tmp_path):
    norm = normalizers.Sequence([normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "), normalizers.Strip()])
    tok = train_sp_style_bpe(norm, pre_tokenizers.Metaspace(prepend_scheme="always", split=False), 600)
    tok.decoder = decoders.Sequence(LLAMA2_DECODER)
    check(tok, tmp_path, CASES + special_cases(["<s>", "</s>"]))


def test_digits_and_split_behaviours(tmp_path):
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(" ", behavior="removed"),
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.Split(Regex(r"[\p{P}]"), behavior="isolated"),
        pre_tokenizers.Split(Regex(r"\s+"), behavior="merged_with_previous"),
    ])
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=["[UNK]", "[SEP]"], show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    check(tok, tmp_path, CASES + special_cases(["[SEP]"]))


def test_split_contiguous_invert_merged_with_next(tmp_path):
    tok = Tokenizer(models.BPE(unk_token="[UNK]", fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\p{L}+"), behavior="contiguous", invert=True),
        pre_tokenizers.Digits(individual_digits=False),
        pre_tokenizers.Split("-", behavior="merged_with_next"),
        pre_tokenizers.Split(Regex(r"\s"), behavior="removed", invert=True),
    ])
    tok.decoder = decoders.Fuse()
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=["[UNK]"], show_progress=False)
    tok.train_from_iterator(CORPUS + ["a-b-c well-known x--y"] * 5, trainer)
    check(tok, tmp_path, CASES + ["a-b-c well-known x--y -lead trail-"])


# ------------------------------------------------------------------------------------------------ sentencepiece


@pytest.mark.parametrize("model_type", ["bpe", "unigram"])
def test_sentencepiece_model(tmp_path, model_type):
    spm = pytest.importorskip("sentencepiece")
    prefix = tmp_path / "sp"
    spm.SentencePieceTrainer.train(sentence_iterator=iter(CORPUS), model_prefix=str(prefix), model_type=model_type,
                                   vocab_size=700, byte_fallback=True, character_coverage=0.9995,
                                   hard_vocab_limit=False, minloglevel=2)
    model = tmp_path / "tokenizer.model"
    (tmp_path / "sp.model").rename(model)
    sp = spm.SentencePieceProcessor(model_file=str(model))
    cases = CASES + ["<s> not special </s>"]
    got = encode_all(tmp_path, cases)
    for text, ids in zip(cases, got):
        assert ids == sp.encode(text), f"encode {text!r}"
    for text, ids, dec in zip(cases, got, decode_all(model, got)):
        assert dec == sp.decode(ids), f"decode {text!r}"
    ids = sp.encode("Привет мир 你好")
    assert decode_exact(model, ids) == sp.decode(ids)


# ------------------------------------------------------------------------------------------------ errors

MINIMAL = {"version": "1.0", "added_tokens": [], "normalizer": None, "pre_tokenizer": None, "post_processor": None,
           "decoder": None, "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": ["a b"]}}


def broken(**changes):
    j = json.loads(json.dumps(MINIMAL))
    for k, v in changes.items():
        if v is None:
            del j[k]
        else:
            j[k] = v
    return json.dumps(j)


@pytest.mark.parametrize("content,field", [
    ("{\"model\": {", "invalid JSON"),
    (broken(model=None), "'model'"),
    (broken(pre_tokenizer={"type": "NoSuchPreTokenizer"}), "'pre_tokenizer.type'"),
    (broken(model={"type": "BPE", "vocab": [1, 2], "merges": []}), "'model.vocab'"),
    (broken(model={"type": "BPE", "vocab": {"a": 0}, "merges": ["a b"]}), "'model.merges[0]'"),
    (broken(decoder={"type": "Sequence", "decoders": [{"type": "Nope"}]}), "'decoder.decoders[0].type'"),
    (broken(model={"type": "Unigram", "vocab": []}), "'model.type'"),
])
def test_malformed_tokenizer_json(tmp_path, content, field):
    path = tmp_path / "tokenizer.json"
    path.write_text(content)
    proc = run_lf("tokenize", "--tokenizer", tmp_path, "--text", "ab", check=False)
    assert proc.returncode == 1, proc.stderr
    err = proc.stderr.strip()
    assert "\n" not in err and str(path) in err and field in err, err


def test_minimal_tokenizer_and_bad_ids(tmp_path):
    (tmp_path / "tokenizer.json").write_text(json.dumps(MINIMAL))
    assert run_lf("tokenize", "--tokenizer", tmp_path, "--text", "abba").stdout == "[2,1,0]\n"
    proc = run_lf("tokenize", "--tokenizer", tmp_path, "--decode", "0,99", check=False)
    assert proc.returncode == 1 and "99" in proc.stderr and "\n" not in proc.stderr.strip()
    proc = run_lf("tokenize", "--tokenizer", tmp_path, "--decode", "0,x", check=False)
    assert proc.returncode == 1 and "--decode" in proc.stderr


@pytest.mark.parametrize("pattern,text", [
    ("(a+)+$", "a" * 40 + "b"),  # exponential backtracking: PCRE2's match limit
    (r"(\w+\s?)+$", "ab " * 30 + "!"),
    ("(a|aa)+$", "a" * 60 + "!"),
])
def test_pathological_regex_is_an_error_not_a_hang(tmp_path, pattern, text):
    """A tokenizer.json pattern is untrusted: catastrophic backtracking ends in one line naming the file and the
    field (PCRE2 match limits, a time bound per text), not a hang."""
    import time
    tok = json.loads(json.dumps(MINIMAL))
    tok["pre_tokenizer"] = {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False}
    (tmp_path / "tokenizer.json").write_text(json.dumps(tok))
    t0 = time.monotonic()
    proc = run_lf("tokenize", "--tokenizer", tmp_path, "--text", text, check=False)
    assert time.monotonic() - t0 < 30
    err = proc.stderr.strip()
    assert proc.returncode == 1 and "\n" not in err, (proc.returncode, err)
    assert "tokenizer.json: field 'pre_tokenizer.pattern.Regex'" in err and "backtracking" in err, err


def test_missing_tokenizer_path(tmp_path):
    missing = tmp_path / "nope"
    proc = run_lf("tokenize", "--tokenizer", missing, "--text", "hi", check=False)
    assert proc.returncode == 1
    err = proc.stderr.strip()
    assert "\n" not in err and str(missing) in err, err
    proc = run_lf("tokenize", "--tokenizer", tmp_path, "--text", "hi", check=False)  # folder without a tokenizer
    assert proc.returncode == 1 and "tokenizer.json" in proc.stderr


def test_subword_prefix_suffix_whitespace_and_added_token_flags(tmp_path):
    tok = Tokenizer(models.BPE(unk_token="[UNK]", continuing_subword_prefix="##", end_of_word_suffix="</w>"))
    tok.normalizer = normalizers.Sequence([normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
                                           normalizers.Strip()])
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(), pre_tokenizers.Punctuation()])
    tok.decoder = decoders.BPEDecoder(suffix="</w>")
    trainer = trainers.BpeTrainer(vocab_size=800, special_tokens=["[UNK]", "[CLS]", "[SEP]"],
                                  continuing_subword_prefix="##", end_of_word_suffix="</w>", show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_tokens([AddedToken("<mask>", lstrip=True, normalized=False), AddedToken("word_tok", single_word=True),
                    AddedToken("HELLO", normalized=True)])
    tok.post_processor = processors.BertProcessing(("[SEP]", tok.token_to_id("[SEP]")),
                                                   ("[CLS]", tok.token_to_id("[CLS]")))
    check(tok, tmp_path, CASES + ["a <mask> b", "x<mask>y", "  <mask>  ", "Hello HELLO world",
                                  "word_tok here word_tok", "aword_tok word_tok_"])
