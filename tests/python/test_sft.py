"""lf::data::SftDataset against transformers' apply_chat_template.

A byte-level BPE tokenizer is trained here with `tokenizers` (special tokens <|endoftext|>, <|im_start|>, <|im_end|>
and the Llama-3 ones) and wrapped as a transformers PreTrainedTokenizerFast. For alpaca / sharegpt / OpenAI lines the
C++ dataset (driven through the gtest hook SftOracle.Cases: env LF_SFT_CASES -> LF_SFT_OUT) must render the same text
and ids as `apply_chat_template(messages)` with a ChatML and a Llama-3 template, and its assistant mask must equal
transformers' `return_assistant_tokens_mask=True` on variants of those templates whose {% generation %} block holds
the reply and its end-of-turn token (<|im_end|> / <|eot_id|>).

Intended difference: with the usual `{% generation %}{{ content }}{% endgeneration %}` placement transformers leaves
the end-of-turn token out of the mask; we include it (the model must learn to stop), and like transformers we leave
out the "\\n" ChatML writes after <|im_end|> (generation stops at <|im_end|>, so that newline is never predicted).
`test_generation_marker_around_content_only` pins that exact difference.

Packing is checked against a re-implementation here: labels[i] = ids[i+1] where token i+1 is assistant else -100,
the last token of a conversation -100, positions restart per conversation, padding its own segment.
"""
import json
import pathlib
import tempfile

import pytest

from conftest import run_gtest_hook

ROOT = pathlib.Path(__file__).resolve().parents[2]
tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>'"
          " + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
CHATML_GEN = ("{% for message in messages %}{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}"
              "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
              "{% else %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
              "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
CHATML_GEN_CONTENT_ONLY = CHATML_GEN.replace(
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}",
    "{% generation %}{{ message['content'] }}{% endgeneration %}{{ '<|im_end|>\\n' }}")
# Meta-Llama-3-8B-Instruct's template, and a {% generation %} variant that renders the same text.
LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
          "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 "
          "%}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
LLAMA3_GEN = ("{% for message in messages %}{% if loop.index0 == 0 %}{{ bos_token }}{% endif %}"
              "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
              "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] | trim + '<|eot_id|>' }}"
              "{% endgeneration %}{% else %}{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}{% endfor %}"
              "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>"]

# The same data in the three formats (converted to messages by `to_messages` below, as the C++ reader must).
LINES = [
    {"instruction": "Translate to French", "input": "Good morning, my friend.", "output": "Bonjour, mon ami."},
    {"instruction": "Say hi", "output": "Hi there!"},
    {"instruction": "Summarise", "input": "", "output": "Nothing to summarise.", "system": "Be brief."},
    {"conversations": [{"from": "system", "value": "You are helpful."}, {"from": "human", "value": "What is 2+2?"},
                       {"from": "gpt", "value": "4"}, {"from": "human", "value": "And 3+3?"},
                       {"from": "gpt", "value": "6, of course."}]},
    {"conversations": [{"from": "human", "value": "Write two lines."},
                       {"from": "gpt", "value": "\n\nfirst line\nsecond line\n"}]},  # boundary inside "\n\n\n"
    {"messages": [{"role": "user", "content": "héllo wörld — 你好 🙂"},
                  {"role": "assistant", "content": "  spaced   reply  "}]},
    {"messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "q1"},
                  {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"},
                  {"role": "assistant", "content": "a2 with <|im_end|> inside? no: plain text"}]},
]


def to_messages(line):
    if "messages" in line:
        return [dict(m) for m in line["messages"]]
    if "conversations" in line:
        roles = {"human": "user", "gpt": "assistant", "system": "system"}
        return [{"role": roles[t["from"]], "content": t["value"]} for t in line["conversations"]]
    user = line["instruction"] + ("\n\n" + line["input"] if line.get("input") else "")
    system = [{"role": "system", "content": line["system"]}] if line.get("system") else []
    return system + [{"role": "user", "content": user}, {"role": "assistant", "content": line["output"]}]


# ------------------------------------------------------------------------------------------------------ fixtures

@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = []
    for line in LINES:
        corpus += [m["content"] for m in to_messages(line)]
    corpus += ["user\nassistant\nsystem\n\n\n\n", "The quick brown fox jumps over the lazy dog.\n\n"] * 20
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    d = tmp_path_factory.mktemp("sft_tok")
    tok.save(str(d / "tokenizer.json"))
    return d


def hf_tokenizer(tok_dir, template, bos=None, eos=None):
    from transformers import PreTrainedTokenizerFast
    t = PreTrainedTokenizerFast(tokenizer_file=str(tok_dir / "tokenizer.json"), bos_token=bos, eos_token=eos)
    t.chat_template = template
    return t


def hf_ids(t, messages):
    out = t.apply_chat_template(messages, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def hf_mask(t, messages, template):
    out = t.apply_chat_template(messages, chat_template=template, tokenize=True, return_dict=True,
                                return_assistant_tokens_mask=True)
    return list(out["input_ids"]), list(out["assistant_masks"])


def run_cpp(cases):
    """cases: list of dicts for SftOracle.Cases; "lines" (list of dicts or raw strings) become a .jsonl file."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        for i, c in enumerate(cases):
            if "lines" in c:
                f = tmp / f"data{i}.jsonl"
                f.write_text("".join((l if isinstance(l, str) else json.dumps(l, ensure_ascii=False)) + "\n"
                                     for l in c.pop("lines")), encoding="utf-8")
                c["files"] = [str(f)]
            c["tokenizer_dir"] = str(c["tokenizer_dir"])
        (tmp / "cases.json").write_text(json.dumps(cases, ensure_ascii=False), encoding="utf-8")
        proc = run_gtest_hook("SftOracle.Cases",
                              {"LF_SFT_CASES": str(tmp / "cases.json"), "LF_SFT_OUT": str(tmp / "out.json")})
        return json.loads((tmp / "out.json").read_text(encoding="utf-8")), proc.stderr


def expected_labels(ids, mask):
    return [ids[i + 1] if i + 1 < len(ids) and mask[i + 1] else -100 for i in range(len(ids))]


# ------------------------------------------------------------------------------------------------------ tests

TEMPLATES = {  # name: (template, its {% generation %} variant, bos, eos)
    "chatml": (CHATML, CHATML_GEN, None, "<|im_end|>"),
    "llama3": (LLAMA3, LLAMA3_GEN, "<|begin_of_text|>", "<|eot_id|>"),
}


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_text_ids_and_mask_match_transformers(tok_dir, name):
    template, gen, bos, eos = TEMPLATES[name]
    t = hf_tokenizer(tok_dir, template, bos, eos)
    cases = [{"tokenizer_dir": tok_dir, "template": tpl, "bos_token": bos or "", "eos_token": eos,
              "lines": LINES, "seq_len": 4096} for tpl in (template, gen)]
    out, _ = run_cpp(cases)
    for res in out:
        assert "error" not in res, res
        assert res["num_truncated"] == 0
        for line, conv in zip(LINES, res["conversations"]):
            messages = to_messages(line)
            assert conv["text"] == t.apply_chat_template(messages, tokenize=False), line
            ids = hf_ids(t, messages)
            assert conv["ids"] == ids, line
            gen_ids, gen_mask = hf_mask(t, messages, gen)
            assert gen_ids == ids  # the variant renders the same text
            assert conv["mask"] == gen_mask, (line, conv["mask"], gen_mask)
            assert sum(gen_mask) > 0


def test_generation_marker_around_content_only(tok_dir):
    """The documented difference: transformers' content-only mask + the end-of-turn token = ours."""
    t = hf_tokenizer(tok_dir, CHATML, None, "<|im_end|>")
    im_end = t.convert_tokens_to_ids("<|im_end|>")
    out, _ = run_cpp([{"tokenizer_dir": tok_dir, "template": CHATML, "eos_token": "<|im_end|>", "lines": LINES,
                       "seq_len": 4096}])
    for line, conv in zip(LINES, out[0]["conversations"]):
        ids, theirs = hf_mask(t, to_messages(line), CHATML_GEN_CONTENT_ONLY)
        diff = [i for i, (a, b) in enumerate(zip(conv["mask"], theirs)) if a != b]
        n_assistant = sum(m["role"] == "assistant" for m in to_messages(line))
        assert len(diff) == n_assistant, line
        for i in diff:
            assert ids[i] == im_end and conv["mask"][i] == 1 and theirs[i - 1] == 1


def test_packing_against_reference(tok_dir):
    t = hf_tokenizer(tok_dir, CHATML_GEN, None, "<|im_end|>")
    convs = [hf_mask(t, to_messages(l), CHATML_GEN) for l in LINES]
    lens = sorted(len(ids) for ids, _ in convs)
    seq_len = lens[-1] + lens[0] + 3  # the longest and the shortest fit together
    n_samples = 12
    out, _ = run_cpp([{"tokenizer_dir": tok_dir, "template": CHATML, "eos_token": "<|im_end|>", "lines": LINES,
                       "seq_len": seq_len, "samples": n_samples, "packing": True, "seed": 7}])
    res = out[0]
    pad = t.convert_tokens_to_ids("<|im_end|>")
    assert res["pad_id"] == pad
    # Which conversation is each segment (matched by ids)?
    order = []
    for s in res["samples"]:
        assert all(len(s[k]) == seq_len for k in s)
        segs = {}
        for i, g in enumerate(s["segment_ids"]):
            segs.setdefault(g, []).append(i)
        assert sorted(segs) == list(range(len(segs))) and all(p == list(range(p[0], p[-1] + 1)) for p in segs.values())
        for g in sorted(segs):
            ids = [s["input_ids"][i] for i in segs[g]]
            match = [k for k, (c, _) in enumerate(convs) if c == ids]
            if match:
                order.append(match[0])
            else:  # padding: the last segment
                assert g == max(segs) and set(ids) == {pad}, ids
    n = len(LINES)
    for e in range(len(order) // n):  # every full epoch is a permutation
        assert sorted(order[e * n:(e + 1) * n]) == list(range(n))
    assert order[:n] != list(range(n)) or order[n:2 * n] != list(range(n))
    # Rebuild the samples with greedy packing in that order.
    expect, k = [], 0
    while len(expect) < n_samples:
        inp, lab, pos, seg = [], [], [], []
        while k < len(order) and len(inp) + len(convs[order[k]][0]) <= seq_len:
            ids, mask = convs[order[k]]
            inp += ids
            lab += expected_labels(ids, mask)
            pos += list(range(len(ids)))
            seg += [seg[-1] + 1 if seg else 0] * len(ids)
            k += 1
        rest = seq_len - len(inp)
        nseg = seg[-1] + 1 if seg else 0
        expect.append({"input_ids": inp + [pad] * rest, "labels": lab + [-100] * rest,
                       "position_ids": pos + list(range(rest)), "segment_ids": seg + [nseg] * rest})
    assert k == len(order)
    assert res["samples"] == expect
    assert res["state"]["samples"] == n_samples


def test_hand_computed_packing(tok_dir):
    """Two identical conversations (order-independent) packed into one sequence, spelled out token by token."""
    t = hf_tokenizer(tok_dir, CHATML, None, "<|im_end|>")
    enc = lambda s: t.encode(s, add_special_tokens=False)  # noqa: E731
    S, E = t.convert_tokens_to_ids("<|im_start|>"), t.convert_tokens_to_ids("<|im_end|>")
    NL = enc("\n")
    user, reply = [S] + enc("user\nSay hi") + [E] + NL, [S] + enc("assistant\n")
    answer = enc("Hi there!") + [E]
    conv = user + reply + answer + NL
    line = {"instruction": "Say hi", "output": "Hi there!"}
    assert hf_ids(t, to_messages(line)) == conv
    n = len(conv)
    # position i predicts token i+1 when that is part of the answer (its text and <|im_end|>, not the final "\n")
    first = len(user) + len(reply)
    labels = [-100] * (first - 1) + answer + [-100, -100]
    assert len(labels) == n
    seq_len = 2 * n + 3
    out, _ = run_cpp([{"tokenizer_dir": tok_dir, "template": CHATML, "eos_token": "<|im_end|>",
                       "lines": [line, line], "seq_len": seq_len, "samples": 2},
                      {"tokenizer_dir": tok_dir, "template": CHATML, "eos_token": "<|im_end|>", "pad_id": 0,
                       "lines": [line, line], "seq_len": n + 1, "samples": 1, "packing": False,
                       "assistant_only_loss": False}])
    for s in out[0]["samples"]:
        assert s == {"input_ids": conv + conv + [E] * 3, "labels": labels + labels + [-100] * 3,
                     "position_ids": list(range(n)) * 2 + [0, 1, 2], "segment_ids": [0] * n + [1] * n + [2] * 3}
    assert out[1]["samples"] == [{"input_ids": conv + [0], "labels": conv[1:] + [-100, -100],
                                  "position_ids": list(range(n)) + [0], "segment_ids": [0] * n + [1]}]


def test_truncation(tok_dir):
    t = hf_tokenizer(tok_dir, CHATML, None, "<|im_end|>")
    ids, mask = hf_mask(t, to_messages(LINES[3]), CHATML_GEN)
    seq_len = len(ids) - 5
    out, err = run_cpp([{"tokenizer_dir": tok_dir, "template": CHATML, "eos_token": "<|im_end|>",
                         "lines": [LINES[3]], "seq_len": seq_len, "samples": 2}])
    res = out[0]
    assert res["num_truncated"] == 1
    assert err.count("truncated") == 1
    keep = ids[:seq_len + 1]
    for s in res["samples"]:
        assert s["input_ids"] == keep[:seq_len]
        assert s["labels"] == expected_labels(keep, mask[:seq_len + 1])[:seq_len]
        assert s["position_ids"] == list(range(seq_len)) and s["segment_ids"] == [0] * seq_len


def test_errors_are_one_line(tok_dir):
    bad = [['{"instruction": "a", "output": "b"}', '{"messages": ['], ['{"foo": 1}'],
           ['{"messages": [{"role": "robot", "content": "x"}]}']]
    out, _ = run_cpp([{"tokenizer_dir": tok_dir, "template": CHATML, "lines": b, "seq_len": 64} for b in bad])
    errs = [r["error"] for r in out]
    assert all("\n" not in e for e in errs)
    assert "data0.jsonl:2: invalid JSON" in errs[0]
    assert "data1.jsonl:1: unknown format" in errs[1]
    assert "data2.jsonl:1: field 'messages[0].role': unknown role 'robot'" in errs[2]
