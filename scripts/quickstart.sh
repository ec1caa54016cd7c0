#!/usr/bin/env bash
# The quickstart: generate a synthetic task (2-digit addition), tokenize it, train a small Llama from scratch on
# the CPU (configs/quickstart/addition.yaml, a few minutes on 2 cores), then ask the model some sums.
# Extra arguments go to `loongforge train` (e.g. --set train.steps=300).
set -euo pipefail
cd "$(dirname "$0")/.."
LF=build/loongforge
DATA=runs/quickstart-data
$LF data synth --task addition --docs 20000 --digits 2 --seed 0 --out $DATA
$LF data tokenize --tokenizer $DATA --input $DATA/train.jsonl --out $DATA/train
$LF train configs/quickstart/addition.yaml "$@"
CKPT=runs/quickstart/checkpoints/$(cat runs/quickstart/checkpoints/latest)
echo "loss curve: runs/quickstart/loss.png   metrics: runs/quickstart/metrics.jsonl   checkpoint (a HF folder): $CKPT"
right=0
for i in $(seq 1 10); do
  a=$(( (i * 37 + 11) % 100 )); b=$(( (i * 53 + 29) % 100 ))
  out=$($LF generate --model "$CKPT" --prompt "$a+$b=" --max-new-tokens 4)
  mark="wrong"; [ "$out" = "$a+$b=$((a + b))" ] && { mark="right"; right=$((right + 1)); }
  printf '  %-12s %s\n' "$out" "$mark"
done
echo "the model got $right/10 sums right"
