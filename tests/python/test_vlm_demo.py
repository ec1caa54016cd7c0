"""The vision-language demo's pieces, shortened for CI: `data synth --task shapes` writes images, LLaVA-format data, a
tokenizer and an image processor config; the demo recipe (configs/quickstart/vlm-shapes.yaml, fewer steps) trains
the demo model from scratch; the checkpoint, asked about held-out images with `generate --image`, names their colours
(the full demo, scripts/vlm_demo.sh, also learns the shapes: 18/20 in bench/results/vlm_demo.md)."""
import json

import pytest

import yaml

from conftest import ROOT, run_lf


@pytest.mark.slow  # 30-60 s of training on 2 cores: outside the CI set's budget (LF_SLOW=1 runs it)
def test_demo_learns_colours_quickly(tmp_path):
    data = tmp_path / "data"
    run_lf("data", "synth", "--task", "shapes", "--docs", 2000, "--seed", 3, "--out", data)
    train = json.loads((data / "train.json").read_text())
    assert len(train) == 2000 and (data / "images" / "02019.png").exists()
    assert train[0]["conversations"][0]["value"].startswith("<image>\n")
    recipe = yaml.safe_load((ROOT / "configs" / "quickstart" / "vlm-shapes.yaml").read_text())
    recipe["output_dir"] = str(tmp_path / "run")
    recipe["model"]["config"] = str(ROOT / "configs" / "quickstart" / "vlm-model.json")
    recipe["model"]["tokenizer"] = str(data)
    recipe["data"]["train"] = [{"path": str(data / "train.json")}]
    recipe["train"]["steps"] = 300
    recipe["log"] = {"progress": "off", "plot": False, "tensorboard": False}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    run_lf("train", tmp_path / "r.yaml")
    m = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert m[0]["loss"] > 3.0 and max(x["loss"] for x in m[-20:]) < 0.3
    ck = tmp_path / "run" / "checkpoints" / (tmp_path / "run" / "checkpoints" / "latest").read_text().strip()
    assert (ck / "preprocessor_config.json").exists()
    prompt = "<|im_start|>user\n<image>\nwhat shape and colour?<|im_end|>\n<|im_start|>assistant\n"
    colours = 0
    for line in (data / "test.tsv").read_text().splitlines():
        image, answer = line.split("\t")
        out = run_lf("generate", "--model", ck, "--image", data / image, "--prompt", prompt, "--max-new-tokens", 20)
        said = out.stdout.rstrip("\n").splitlines()[-1]
        colours += said.split(" ")[1:2] == answer.split(" ")[1:2]
    assert colours >= 16, colours  # chance: 5 of 20
