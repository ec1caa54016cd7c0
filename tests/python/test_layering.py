"""Lower layers never include higher ones (docs/architecture.md)."""
import re

from conftest import ROOT

ORDER = ["core", "kernels", "nn", "models", "parallel", "optim", "data", "io", "train", "serve", "cli", "capi"]


def test_includes_respect_layers():
    src = ROOT / "src" / "loongforge"
    bad = []
    for f in src.rglob("*"):
        if f.suffix not in (".h", ".cpp", ".cu", ".cuh"):
            continue
        layer = f.relative_to(src).parts[0]
        assert layer in ORDER, f"{f}: unknown layer folder '{layer}'"
        for inc in re.findall(r'#include\s+"loongforge/([a-z_]+)/', f.read_text()):
            if ORDER.index(inc) > ORDER.index(layer):
                bad.append(f"{f.relative_to(ROOT)} includes loongforge/{inc}")
    assert not bad, bad


def test_nothing_above_models_names_a_family():
    """train/, parallel/, io/, optim/, serve/, cli/ and capi/ see the model contract (models/model.h) and the registry only."""
    src = ROOT / "src" / "loongforge"
    bad = []
    for layer in ["train", "parallel", "io", "optim", "serve", "cli", "capi"]:
        for f in (src / layer).rglob("*"):
            if f.suffix in (".h", ".cpp", ".cu", ".cuh") and "models/llama" in f.read_text():
                bad.append(str(f.relative_to(ROOT)))
    assert not bad, bad
