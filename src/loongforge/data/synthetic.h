// Synthetic tasks the project generates itself, for the quickstart and for tests: small enough to learn on a CPU in
// minutes, with an exact answer to check what a model learned.
#pragma once
#include <cstdint>
#include <string>

namespace lf::data {

// "addition": documents "A+B=C" with A, B in [0, 10^digits). Writes OUT_DIR/train.jsonl ({"text": ...} per line)
// and a character-level tokenizer OUT_DIR/tokenizer.json (+ tokenizer_config.json) that transformers and
// LoongForge both load. Deterministic in seed.
void write_synthetic_task(const std::string& task, const std::string& out_dir, int64_t docs, int digits, uint64_t seed);

}  // namespace lf::data
