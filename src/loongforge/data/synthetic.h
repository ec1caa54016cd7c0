// Synthetic tasks the project generates itself, for the quickstart and for tests: small enough to learn on a CPU in
// minutes, with an exact answer to check what a model learned.
#pragma once
#include <array>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace lf::data {

// "addition": documents "A+B=C" with A, B in [0, 10^digits). Writes OUT_DIR/train.jsonl ({"text": ...} per line)
// and a character-level tokenizer OUT_DIR/tokenizer.json (+ tokenizer_config.json) that transformers and
// LoongForge both load. Deterministic in seed.
// "shapes" (the vision-language demo): OUT_DIR/images/NNNNN.png (56x56: a red, green, blue or yellow circle, square
// or triangle of random size and place on a noisy dark background), OUT_DIR/train.json (LLaVA's format: "<image>\n"
// + one of three questions, answered "a red circle", "red" or "circle"), OUT_DIR/test.tsv (held-out images and
// their "a COLOUR SHAPE" answers), a character tokenizer with ChatML's <|im_start|> / <|im_end|> and <image>
// (ids 3, 4, 5) and its chat template, and a CLIP preprocessor_config.json (28x28 crops).
void write_synthetic_task(const std::string& task, const std::string& out_dir, int64_t docs, int digits, uint64_t seed);

// The "shapes" task (above); `docs` training images, 20 held out.
void write_shapes_task(const std::string& out_dir, int64_t docs, uint64_t seed);
// "shape_classes" (the diffusion demo): `docs` images as above in class folders OUT_DIR/<colour>/NNNNN.png (blue,
// green, red, yellow: classes 0-3 in sorted order), for `data.format: images`.
void write_shape_classes_task(const std::string& out_dir, int64_t docs, uint64_t seed);
// The colours of the shapes, by name.
std::vector<std::pair<std::string, std::array<int, 3>>> shape_colours();
// A character-level tokenizer.json: `specials` (ids 0..), then one token per character of `chars`.
std::string char_tokenizer_json(const std::string& chars, const std::vector<std::string>& specials);

}  // namespace lf::data
