"""What kind of model directory a path names (`ModelDir.kind`, issue 64 item 3): a target, a drafter of a registered
family in its public layout or speculators', or neither; the kind is read from config.json and the family registry,
never from a list of families written here."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from opd.cli import main
from opd.commands.preflight import check_drafter, check_target, target_shape
from opd.errors import OpdError
from opd.formats import DRAFTER_SECTIONS, KINDS
from opd.formats.dflash import DFlashSpec
from opd.model_dir import TARGET_FIELD, DirKind, ModelDir
from opd.models.registry import load_drafter
from opd.models.target import Target, load_target

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


@pytest.mark.parametrize("section", DRAFTER_SECTIONS, ids=KINDS)
def test_every_registered_family_is_a_drafter_and_names_its_style(tmp_path: Path, section) -> None:
    kind = section.model_fields["kind"].default
    assert _model_dir(tmp_path, {"speculators_model_type": kind}).kind == DirKind("speculators", kind)
    assert section.style  # how its public layout is named (opd/formats/section.py); a new family says it too


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


# --- a directory of the wrong kind is refused in one line, before anything is read from it ----------------------

DRAFTERS = {"drafter": "a DFlash-style drafter (dflash)", "dspark": "a speculators drafter (dspark)",
            "eagle3": "an EAGLE-style drafter (eagle3)"}


def one_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "Traceback" not in err[0], err
    return err[0].removeprefix("error: ")


def as_target(name: str) -> str:
    return (f"models.target_path: {TINY / name} is {DRAFTERS[name]}, not a target model (expected the target's "
            "directory; a drafter goes in models.drafter_path)")


def as_drafter(field: str, path: str) -> str:
    return (f"{field}: {path} is a target model (Qwen3ForCausalLM), not a drafter (expected a drafter's directory; "
            "the target goes in models.target_path)")


@pytest.mark.parametrize("command", ["validate", "run"])
@pytest.mark.parametrize("name", DRAFTERS)
def test_a_drafter_as_the_target_is_refused_in_one_line(micro_spec_file, capsys, command: str, name: str) -> None:
    assert main([command, str(micro_spec_file), "--set", f"models.target_path={TINY / name}"]) == 2
    assert one_error(capsys) == as_target(name)


@pytest.mark.parametrize("command", ["validate", "run"])
def test_the_target_as_the_drafter_is_refused_in_one_line(micro_spec_file, micro_assets, capsys, command) -> None:
    assert main([command, str(micro_spec_file), "--set", f"models.drafter_path={micro_assets['target']}"]) == 2
    assert one_error(capsys) == as_drafter("models.drafter_path", micro_assets["target"])


def test_the_target_as_a_draft_flag_is_refused_in_one_line(micro_spec_file, micro_assets, capsys) -> None:
    target = micro_assets["target"]
    assert main(["eval", str(micro_spec_file), "--draft", target]) == 2
    assert one_error(capsys) == as_drafter("--draft", target)
    assert main(["gap", str(micro_spec_file), "--draft", f"mine={target}"]) == 2
    assert one_error(capsys) == as_drafter("--draft mine", target)


@pytest.mark.parametrize("name", DRAFTERS)
def test_the_preflight_and_the_loaders_refuse_a_drafter_as_the_target(name: str) -> None:
    """What reads a target outside the spec's resolution (a resolved spec handed on, an export's target) refuses
    a drafter the same way, before transformers reads it."""
    for read in (lambda: check_target(ModelDir.read(TINY / name).expect("target", TARGET_FIELD), [1]),  # preflight
                 lambda: load_target(str(TINY / name), dtype=torch.float32, layer_ids=[1])):
        with pytest.raises(OpdError) as refused:
            read()
        assert str(refused.value) == as_target(name)


def test_the_preflight_and_the_loader_refuse_the_target_as_a_drafter(micro_assets) -> None:
    target = micro_assets["target"]
    with pytest.raises(OpdError) as refused:
        check_drafter(target, target_shape(ModelDir.read(target), [1, 2]), DFlashSpec())
    assert str(refused.value) == as_drafter("models.drafter_path", target)
    with pytest.raises(OpdError) as refused:
        load_drafter(target, SimpleNamespace())
    assert str(refused.value) == as_drafter("drafter", target)


# --- a target whose checkpoint lacks tensors is refused before any forward ----------------------------------------


def test_a_target_without_its_embedding_is_refused_before_compute(micro_spec_file, micro_assets, tmp_path, capsys,
                                                                  monkeypatch) -> None:
    broken = tmp_path / "no-embedding"
    shutil.copytree(micro_assets["target"], broken)
    weights = load_file(broken / "model.safetensors")
    save_file({k: v for k, v in weights.items() if k != "model.embed_tokens.weight"}, broken / "model.safetensors",
              metadata={"format": "pt"})
    monkeypatch.setattr(Target, "forward", lambda *a, **k: pytest.fail("the target ran with a random embedding"))
    assert main(["eval", str(micro_spec_file), "--set", f"models.target_path={broken}"]) == 2
    assert one_error(capsys) == (f"target model {broken}: its weights lack model.embed_tokens.weight (expected every "
                                 "tensor of Qwen3ForCausalLM; transformers would fill them with random values)")
