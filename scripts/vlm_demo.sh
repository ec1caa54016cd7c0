#!/usr/bin/env bash
# The vision-language demo: draw images of coloured shapes with questions about them (`data synth --task shapes`),
# train a tiny LLaVA from scratch on the CPU (configs/quickstart/vlm-shapes.yaml, a few minutes on 2 cores), then
# ask it about 20 images it has not seen with `generate --image`. Extra arguments go to `loongforge train`.
set -euo pipefail
cd "$(dirname "$0")/.."
LF=build/loongforge
DATA=runs/vlm-data
$LF data synth --task shapes --docs 20000 --seed 0 --out $DATA
$LF train configs/quickstart/vlm-shapes.yaml "$@"
CKPT=runs/vlm-demo/checkpoints/$(cat runs/vlm-demo/checkpoints/latest)
echo "loss curve: runs/vlm-demo/loss.png   checkpoint (a HF folder transformers loads): $CKPT"
right=0
total=0
while IFS=$'\t' read -r image answer; do
  out=$($LF generate --model "$CKPT" --image "$DATA/$image" --max-new-tokens 24 \
        --prompt $'<|im_start|>user\n<image>\nwhat shape and colour?<|im_end|>\n<|im_start|>assistant\n')
  said=$(printf '%s' "$out" | tail -n 1)
  mark="wrong"; [ "$said" = "$answer" ] && { mark="right"; right=$((right + 1)); }
  total=$((total + 1))
  printf '  %-26s %-22s (%s: %s)\n' "$image" "$said" "$mark" "$answer"
done < $DATA/test.tsv
echo "the model described $right/$total unseen images right"
