"""A model directory is read once (`ModelDir`), its problems are one line naming the file or field, and a drafter
directory's family comes from its config.json through the one registry (`opd.models.registry`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import GptOssConfig, GptOssForCausalLM

from opd.errors import OpdError
from opd.formats import DRAFTER_SECTIONS, detect_section
from opd.model_dir import ModelDir
from opd.models.registry import FAMILIES, detect, family
from opd.models.target import load_target
from opd.spec import validate_spec

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "opd" / "assets" / "tiny"
MINIMAL = {"steps": 1, "data": {"train_prompts": "a", "eval_prompts": "b"}}


def _write(directory: Path, config: object) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_problems_are_one_line_naming_the_file_or_field(tmp_path: Path) -> None:
    with pytest.raises(OpdError, match=r"^target model: .*/absent/config.json not found") as missing:
        ModelDir.read(tmp_path / "absent", "target model")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{")
    with pytest.raises(OpdError, match=r"bad/config.json: not valid JSON") as bad:
        ModelDir.read(tmp_path / "bad")
    with pytest.raises(OpdError, match=r"holds a list \(expected a JSON object\)"):
        ModelDir.read(_write(tmp_path / "list", [1, 2]))
    with pytest.raises(OpdError, match=r"config.json: field 'hidden_size' missing or not an integer") as field:
        ModelDir.read(_write(tmp_path / "shallow", {"hidden_size": "wide"}), "target model").int_field("hidden_size")
    assert all("\n" not in str(e.value) for e in (missing, bad, field))
    assert ModelDir.find(tmp_path / "absent") is None and ModelDir.find("random") is None


def test_a_multimodal_config_answers_from_its_text_config(tmp_path: Path) -> None:
    directory = ModelDir.read(_write(tmp_path, {"text_config": {"num_hidden_layers": 12, "vocab_size": 99},
                                                "vocab_size": 100}))
    assert directory.num_layers == 12 and directory.int_field("vocab_size") == 99
    assert directory.int_or_none("vocab_size") == 100  # a top-level field first, as transformers' configs read


def test_weight_headers_are_read_once_and_a_broken_checkpoint_is_named(tmp_path: Path) -> None:
    directory = _write(tmp_path / "m", {})
    save_file({"a.weight": torch.zeros(2, 3)}, str(directory / "model-1.safetensors"))
    index = {"weight_map": {"a.weight": "model-1.safetensors", "b.weight": "model-2.safetensors"}}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(OpdError, match=r"model-2.safetensors: weights file not found"):
        ModelDir.read(directory).tensor_shapes()
    index["weight_map"]["b.weight"] = "model-1.safetensors"
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    read = ModelDir.read(directory)
    assert read.tensor_shapes() == {"a.weight": (2, 3)}
    (directory / "model-1.safetensors").write_bytes((directory / "model-1.safetensors").read_bytes()[:-4])
    assert read.tensor_shapes() == {"a.weight": (2, 3)}  # the value read the headers once
    with pytest.raises(OpdError, match=r"model-1.safetensors: unreadable safetensors file"):
        ModelDir.read(directory).tensor_shapes()


def test_every_family_has_a_section_and_each_shipped_drafter_is_told_apart() -> None:
    kinds = [str(section.model_fields["kind"].default) for section in DRAFTER_SECTIONS]
    assert sorted(kinds) == sorted(FAMILIES) and all(family(kind).kind == kind for kind in kinds)
    found = {name: detect(ModelDir.read(TINY / name)).kind for name in ("drafter", "dflash2", "eagle3", "dspark",
                                                                           "peagle", "xpress", "mtp")}
    assert found == {"drafter": "dflash", "dflash2": "dflash2", "eagle3": "eagle3", "dspark": "dspark",
                     "peagle": "peagle", "xpress": "xpress",
                     "mtp": "mtp"}  # a shipped tiny drafter of every family
    assert detect_section({"architectures": ["LlamaForCausalLM"]}) is None
    with pytest.raises(OpdError, match=r"of no drafter family here \(expected one of dflash, dflash2, dspark, eagle3"):
        detect(ModelDir(Path("/x"), {"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(OpdError, match=rf"models.drafter.kind: 'medusa' \(expected one of {', '.join(sorted(kinds))}\)"):
        family("medusa")


def test_a_warm_drafters_kind_comes_from_its_config_and_a_contradiction_is_one_line() -> None:
    models = {"target_path": str(TINY / "target"), "drafter_path": str(TINY / "dflash2"),
              "drafter": {"block_size": 8, "num_layers": 2}}
    spec = validate_spec({**MINIMAL, "models": models}, check_paths=False)
    assert spec.models.drafter.kind == "dflash2" and spec.models.drafter.has_selector
    models["drafter"] = {**models["drafter"], "kind": "dflash"}
    with pytest.raises(OpdError, match=r"^models.drafter.kind: dflash but .*dflash2/config.json is a dflash2 drafter "
                                       r"\(expected kind: dflash2\)$"):
        validate_spec({**MINIMAL, "models": models}, check_paths=False)


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory) -> Path:
    """A tiny gpt-oss target: transformers gives it no sdpa path (its sinks enter the softmax in eager)."""
    config = GptOssConfig(vocab_size=16, hidden_size=16, intermediate_size=16, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_local_experts=2,
                          num_experts_per_tok=1, layer_types=["sliding_attention", "full_attention"], sliding_window=4)
    directory = tmp_path_factory.mktemp("gpt-oss")
    GptOssForCausalLM(config).save_pretrained(directory)
    return directory


def test_the_attention_implementation_defaults_to_transformers_pick(gpt_oss_dir: Path) -> None:
    target = load_target(str(gpt_oss_dir), dtype=torch.float32, layer_ids=[0])
    assert target.model.config._attn_implementation == "eager"
    with pytest.raises(OpdError, match=r"^target model .*: .*") as chosen:
        load_target(str(gpt_oss_dir), dtype=torch.float32, attn_implementation="sdpa", layer_ids=[0])
    assert "\n" not in str(chosen.value)
