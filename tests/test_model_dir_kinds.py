"""What kind of model directory a path names (`ModelDir.kind`, issue 64 item 3): a target, a drafter of a registered
family in its public layout or speculators', or neither; the kind is read from config.json and the family registry,
never from a list of families written here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from opd.formats import KINDS
from opd.model_dir import DirKind, ModelDir

TINY = Path(__file__).resolve().parents[1] / "opd" / "assets" / "tiny"


def _model_dir(directory: Path, config: dict, weights: bool = True) -> ModelDir:
    """A directory holding `config` as its config.json and, with `weights`, a weights file (classification reads
    its name, never its tensors)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    if weights:
        (directory / "model.safetensors").write_bytes(b"")
    return ModelDir.read(directory)


@pytest.mark.parametrize("name, kind", [("target", "a target model (Qwen3ForCausalLM)"),
                                        ("drafter", "a DFlash-style drafter (dflash)"),
                                        ("dflash2", "a DFlash-style drafter (dflash2)"),
                                        ("dspark", "a speculators drafter (dspark)"),
                                        ("eagle3", "an EAGLE-style drafter (eagle3)")])
def test_each_shipped_directory_is_told_apart(name: str, kind: str) -> None:
    assert str(ModelDir.read(TINY / name).kind) == kind


@pytest.mark.parametrize("kind", KINDS)
def test_every_registered_family_in_speculators_layout_is_a_speculators_drafter(tmp_path: Path, kind: str) -> None:
    assert _model_dir(tmp_path, {"speculators_model_type": kind}).kind == DirKind("speculators", kind)


def test_a_target_is_a_causal_lm_with_weights_and_nothing_else_is(tmp_path: Path) -> None:
    multimodal = _model_dir(tmp_path / "mm", {"architectures": ["Gemma3ForConditionalGeneration"]})
    assert multimodal.kind == DirKind("target", "Gemma3ForConditionalGeneration")
    assert _model_dir(tmp_path / "bare", {"architectures": ["Qwen3ForCausalLM"]}, weights=False).kind.layout == "neither"
    assert _model_dir(tmp_path / "vision", {"architectures": ["ViTModel"]}).kind.layout == "neither"
    # vLLM's EAGLE-3 names read as causal LMs; the family registry is asked first
    assert str(_model_dir(tmp_path / "vllm", {"architectures": ["Eagle3LlamaForCausalLM"]}).kind) == \
        "an EAGLE-style drafter (eagle3)"
    assert str(_model_dir(tmp_path / "other", {"speculators_model_type": "mtp"}).kind) == "a speculators drafter (mtp)"
    assert str(_model_dir(tmp_path / "empty", {}).kind) == "neither a target model nor a drafter"
