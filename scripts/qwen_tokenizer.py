"""Writes a small Qwen-VL-like processor folder: tokenizer.json (byte-level BPE trained with the `tokenizers` library
on the given texts, Qwen's special tokens first: <|im_start|> 0, <|im_end|> 1, <|vision_start|> 2, <|vision_end|> 3,
<|image_pad|> 4, <|video_pad|> 5, <|endoftext|> 6), tokenizer_config.json with a Qwen-VL ChatML chat template, and
preprocessor_config.json (Qwen2VLImageProcessor: 32-pixel patches, 2 frames per temporal patch, merged 2 x 2).
LeRobot's GR00T processor (transformers' AutoProcessor) and LoongForge's `data.robot.tokenizer` both load it in place
of nvidia/Cosmos-Reason2-2B's. Used by scripts/groot_demo.sh (configs/quickstart/groot-model/backbone's token ids
are the ones above).

usage: python scripts/qwen_tokenizer.py OUT_DIR VOCAB_SIZE TEXT [TEXT ...]
(tests/python/test_groot_train.py imports SPECIAL and TEMPLATE from here)"""
import json
import sys

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>",
           "<|endoftext|>"]
# image parts as the vision markers around one pad token (the processor repeats it per merged patch), then the text
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
            "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for part in m['content'] %}"
            "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
            "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def main():
    out, vocab, texts = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((texts + ["user", "assistant", "system"]) * 20, trainer)
    assert [tok.token_to_id(t) for t in SPECIAL] == list(range(len(SPECIAL)))
    assert tok.get_vocab_size() <= vocab
    tok.save(out + "/tokenizer.json")
    json.dump({"tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
               "chat_template": TEMPLATE}, open(out + "/tokenizer_config.json", "w"), indent=1)
    json.dump({"image_processor_type": "Qwen2VLImageProcessor", "patch_size": 32, "temporal_patch_size": 2, "merge_size": 2,
               "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
               "size": {"longest_edge": 16777216, "shortest_edge": 65536}}, open(out + "/preprocessor_config.json", "w"),
              indent=1)


if __name__ == "__main__":
    main()
