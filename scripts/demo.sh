#!/usr/bin/env bash
# A short tour until the trainer lands: parity with transformers on the shipped checkpoint, tokenization, generation.
set -euo pipefail
cd "$(dirname "$0")/.."
LF=build/loongforge
FX=tests/fixtures
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
.venv/bin/python - "$FX" "$tmp" <<'PY'
import sys
from safetensors.torch import load_file, save_file
ref = load_file(f"{sys.argv[1]}/hf_llama/reference.safetensors")
save_file({"input_ids": ref["input_ids"]}, f"{sys.argv[2]}/batch.safetensors")
PY
$LF dump --model $FX/hf_llama --batch "$tmp/batch.safetensors" --out "$tmp/out.safetensors" \
  --adamw lr=1e-3,beta1=0.9,beta2=0.95,eps=1e-8,weight_decay=0.1
.venv/bin/python - "$FX" "$tmp" <<'PY'
import sys
from safetensors.torch import load_file
ref = load_file(f"{sys.argv[1]}/hf_llama/reference.safetensors")
out = load_file(f"{sys.argv[2]}/out.safetensors")
rel = lambda a, b: ((a - b).abs().max() / b.abs().max()).item()
print(f"dump vs transformers: loss {out['loss'].item():.6f} vs {ref['loss'].item():.6f}, "
      f"logits rel err {rel(out['logits'], ref['logits']):.1e}, "
      f"worst grad rel err {max(rel(out[k], ref[k]) for k in ref if k.startswith('grad.')):.1e}")
PY
echo -n "tokenize 'Hello world, 你好 👋': "
$LF tokenize --tokenizer $FX/tok_bytelevel_gpt2 --text "Hello world, 你好 👋"
echo -n "generate (random weights, greedy ids): "
$LF generate --model $FX/hf_llama --prompt-ids 1,42,7 --max-new-tokens 8 --ids
