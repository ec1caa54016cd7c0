#!/usr/bin/env bash
# The diffusion demo: draw 16 x 16 images of coloured shapes into colour class folders (`data synth --task
# shape_classes`), train a tiny class-conditional DiT from scratch on the CPU by flow matching
# (configs/quickstart/dit-shapes.yaml, a few minutes on 2 cores), then sample 4 images of each colour with
# `loongforge sample` (30 Euler steps, classifier-free guidance 3) into a PNG grid, and check that each sample's
# shape has the colour that was asked for. Extra arguments go to `loongforge train`.
set -euo pipefail
cd "$(dirname "$0")/.."
LF=build/loongforge
DATA=runs/dit-data
OUT=runs/dit-demo
[ -d $DATA/red ] || $LF data synth --task shape_classes --docs 4000 --seed 0 --out $DATA
$LF train configs/quickstart/dit-shapes.yaml "$@"
CKPT=$OUT/checkpoints/$(cat $OUT/checkpoints/latest)
# 16 samples: classes 0-3 (blue, green, red, yellow: the folders in sorted order) four times each, fixed noise
.venv/bin/python - "$OUT/sample_batch.safetensors" <<'PY'
import sys, torch
from safetensors.torch import save_file
g = torch.Generator().manual_seed(123)
save_file({"noise": torch.randn(16, 3, 16, 16, generator=g), "class_labels": torch.arange(4).repeat_interleave(4)},
          sys.argv[1])
PY
$LF sample --model "$CKPT" --batch $OUT/sample_batch.safetensors --steps 30 --guidance 3 --images $OUT/samples
echo "sample grid: $OUT/samples/grid.png (rows: blue, green, red, yellow)   checkpoint (a diffusers folder): $CKPT"
# the check: the mean colour of each sample's bright pixels is nearest to the colour asked for
.venv/bin/python - "$OUT/samples" <<'PY'
import sys
import numpy as np
from PIL import Image
colours = {"blue": (50, 90, 235), "green": (40, 200, 60), "red": (220, 40, 40), "yellow": (230, 210, 40)}
names = list(colours)
right = 0
for i in range(16):
    img = np.asarray(Image.open(f"{sys.argv[1]}/sample_{i:02d}.png")).reshape(-1, 3).astype(float)
    bright = img[img.max(1) > 110]
    mean = bright.mean(0) if len(bright) else img.mean(0)
    got = min(names, key=lambda n: ((mean - np.array(colours[n])) ** 2).sum())
    want = names[i // 4]
    right += got == want
    print(f"  sample {i:2d}: asked {want:6s} drew {got:6s} {'right' if got == want else 'wrong'}")
print(f"the model drew {right}/16 samples in the colour asked for")
sys.exit(0 if right >= 13 else 1)
PY
