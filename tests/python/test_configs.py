"""Every shipped recipe parses against the schema, and every shipped model config against the model family."""
import pytest
import transformers

from conftest import ROOT, run_lf

RECIPES = sorted((ROOT / "configs").rglob("*.yaml"))
MODELS = sorted((ROOT / "configs" / "models").glob("*.json"))


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: str(p.relative_to(ROOT / "configs")))
def test_recipe_resolves(recipe):
    out = run_lf("train", recipe, "--show").stdout
    assert "output_dir" in out


@pytest.mark.parametrize("config", MODELS, ids=lambda p: p.name)
def test_model_config_parses_like_transformers(config, tmp_path):
    import json
    import torch
    cfg = transformers.AutoConfig.from_pretrained(config)
    with torch.device("meta"):
        if cfg.model_type == "mistral4":  # not in AutoModelForCausalLM's mapping
            model = transformers.Mistral4ForCausalLM._from_config(cfg)
        elif hasattr(cfg, "vision_config"):  # a vision-language model (AutoModelForCausalLM would give its LM alone)
            model = transformers.AutoModelForImageTextToText.from_config(cfg)
        else:
            model = transformers.AutoModelForCausalLM.from_config(cfg)
    info = json.loads(run_lf("info", config).stdout)
    assert info["parameters"] == sum(p.numel() for p in model.parameters())
    assert info["model_type"] == cfg.model_type
