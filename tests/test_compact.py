"""The shipped tiny drafters stored in bf16 (opd/tiny/compact.py): a drafter of every family, so stored, loads into
its target's dtype as its own weights rounded to bf16 once, its draft-vocabulary mappings exact, and records the
dtype its export writes; the shipped drafters are stored so, which keeps the assets every clone carries small."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from opd.models.registry import FAMILIES, load_drafter
from opd.tiny.compact import DTYPE_FIELDS, STORED, store_compact
from opd.tiny.micro import micro_target
from tests.helpers.tiny_families import draw

ASSETS = Path(__file__).resolve().parents[1] / "opd" / "assets"
SHIPPED = sorted(p.parent for p in (ASSETS / "tiny").glob("*/model.safetensors"))  # the drafters (the target: shards)
BUDGET = 50 * 10**6  # bytes: what every clone may pay for opd/assets (issue 72)


@pytest.fixture(scope="module")
def target():
    return micro_target(seed=0, vocab_size=8, num_layers=6, layer_ids=[1, 2, 3])


@pytest.mark.parametrize("kind", FAMILIES)
def test_a_compact_drafter_loads_as_its_weights_rounded_to_bf16(kind, target, tmp_path):
    drafter = draw(kind, target)
    drafter.save_pretrained(tmp_path)
    store_compact(tmp_path)
    loaded = load_drafter(tmp_path, target).state_dict()
    for name, tensor in drafter.state_dict().items():
        expected = tensor.to(STORED).to(tensor.dtype) if tensor.is_floating_point() else tensor
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], expected), name
    config = json.loads((tmp_path / "config.json").read_text())
    assert [config[field] for field in DTYPE_FIELDS if field in config] == ["bfloat16"]


@pytest.mark.parametrize("directory", SHIPPED, ids=[d.name for d in SHIPPED])
def test_every_shipped_drafter_is_stored_in_bf16(directory):
    with safe_open(str(directory / "model.safetensors"), framework="pt") as f:
        floats = {f.get_slice(name).get_dtype() for name in f.keys()} - {"I64", "BOOL"}
    config = json.loads((directory / "config.json").read_text())
    assert floats == {"BF16"}, f"{directory}: store it with python -m opd.tiny.compact {directory}"
    assert [config[field] for field in DTYPE_FIELDS if field in config] == ["bfloat16"]


def test_the_shipped_assets_stay_under_budget():
    size = sum(p.stat().st_size for p in ASSETS.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    assert size < BUDGET, f"opd/assets holds {size / 10**6:.1f} MB (budget {BUDGET / 10**6:.0f} MB)"
