"""Writes a small Gemma-like tokenizer folder (tokenizer.json + tokenizer_config.json, GemmaTokenizer's conventions:
BPE with byte fallback, spaces as '▁', "<bos> $A", pad 0 / eos 1 / bos 2 / unk 3) trained with the `tokenizers`
library on the given texts: what LeRobot's π0 / π0.5 processors (transformers' AutoTokenizer) and LoongForge's
`data.robot.tokenizer` both load in place of PaliGemma's. Used by scripts/pi0_demo.sh and the π0 training tests.

usage: python scripts/gemma_tokenizer.py OUT_DIR VOCAB_SIZE TEXT [TEXT ...]"""
import json
import sys

from tokenizers import Tokenizer, decoders, models, normalizers, processors, trainers

out, vocab, texts = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
tok.normalizer = normalizers.Replace(" ", "\u2581")
tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
special = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{i:02X}>" for i in range(256)]
trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=special, show_progress=False,
                              initial_alphabet=list("abcdefghijklmnopqrstuvwxyz0123456789:;,.-\u2581\n"))
tok.train_from_iterator(texts * 20, trainer)
tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A <bos> $B",
                                                   special_tokens=[("<bos>", 2)])
tok.save(out + "/tokenizer.json")
json.dump({"tokenizer_class": "GemmaTokenizer", "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
           "unk_token": "<unk>", "add_bos_token": True, "add_eos_token": False}, open(out + "/tokenizer_config.json", "w"))
assert tok.get_vocab_size() <= vocab
