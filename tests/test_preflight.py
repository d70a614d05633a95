"""Bad data and models are one line before any actor starts, and a failed actor is reported by its root cause with
advice to rerun only when a rerun can fix it (issue 16, item 1)."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import ray
import torch

from opd.cli import main
from opd.errors import OpdError


@pytest.fixture
def no_ray(monkeypatch):
    """Starting Ray would mean the bad input got past the driver's checks: fail fast instead."""
    import actors.driver

    def refuse(spec):
        raise AssertionError("Ray started before the inputs were checked")

    monkeypatch.setattr(actors.driver, "init_ray", refuse)


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def malformed_prompts(micro_assets, tmp_path):
    path = tmp_path / "malformed.jsonl"
    lines = open(micro_assets["train"]).read().splitlines()[:4] + ["this is not json"]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("engine", ["ray", "local"])
def test_a_malformed_prompt_line_is_one_line_before_any_actor(micro_spec_file, micro_assets, tmp_path, capsys, no_ray,
                                                             engine):
    path = malformed_prompts(micro_assets, tmp_path)
    sets = [f"engine={engine}", f"data.train_prompts={path}"]
    assert main(["train", str(micro_spec_file), *[a for s in sets for a in ("--set", s)]]) == 2
    line = one_error_line(capsys)
    assert f"{path}:5: not JSON" in line and "resume" not in line
    assert main(["validate", str(micro_spec_file), *[a for s in sets for a in ("--set", s)]]) == 2
    assert f"{path}:5: not JSON" in one_error_line(capsys)


@pytest.mark.parametrize("which", ["drafter", "target"])
def test_a_truncated_safetensors_file_is_one_line_under_opd_train(micro_spec_file, micro_assets, tmp_path, capsys,
                                                                  no_ray, which):
    copy = tmp_path / which
    shutil.copytree(micro_assets[which], copy)
    weights = copy / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    sets = ["engine=ray", f"models.{which}_path={copy}"]
    assert main(["train", str(micro_spec_file), *[a for s in sets for a in ("--set", s)]]) == 2
    line = one_error_line(capsys)
    assert f"{weights}: unreadable safetensors file" in line and "resume" not in line


def test_a_drafter_for_another_target_is_refused_up_front(micro_spec_file, micro_assets, tmp_path, capsys, no_ray):
    from safetensors.torch import load_file, save_file

    copy = tmp_path / "drafter"
    shutil.copytree(micro_assets["drafter"], copy)
    tensors = load_file(copy / "model.safetensors")
    name = sorted(tensors)[0]
    tensors[name] = tensors[name][..., :1].contiguous()
    save_file(tensors, copy / "model.safetensors")
    assert main(["train", str(micro_spec_file), "--set", "engine=ray", "--set", f"models.drafter_path={copy}"]) == 2
    assert f"tensor {name} has shape" in one_error_line(capsys)


def test_cuda_for_a_role_without_gpus_is_refused_up_front(micro_spec_file, capsys, no_ray):
    assert main(["train", str(micro_spec_file), "--set", "engine=ray", "--set", "models.device=cuda"]) == 2
    assert one_error_line(capsys) == ("error: models.device: cuda but resources.learner.num_gpus is 0, so that actor "
                                      "sees no GPU (expected auto, or GPUs for every role)")


def _constructor_failed(last_line: str) -> ray.exceptions.ActorDiedError:
    """What `ray.get` raises for an actor whose constructor raised: Ray keeps only the traceback text."""
    traceback = f"Traceback (most recent call last):\n  File \"actors/rollout.py\", line 27, in __init__\n{last_line}"
    return ray.exceptions.ActorDiedError(ray.exceptions.RayTaskError("RolloutActor.__init__", traceback, None))


def test_a_failed_actor_is_reported_by_its_root_cause():
    from actors.errors import failure

    bad = "/data/p.jsonl:5: not JSON (Expecting value) (set data.skip_bad_lines: true to skip such lines)"
    assert str(failure("rollout-0", _constructor_failed(f"opd.errors.OpdError: {bad}"))) == bad
    raised = ray.exceptions.RayTaskError("LearnerActor.train", "Traceback ...", OpdError("held-out τ collapsed"))
    assert str(failure("the learner", raised)) == "held-out τ collapsed"
    # a bug in a constructor or a loop: named, but a rerun would fail the same way
    bug = str(failure("scorer-0", _constructor_failed("ValueError: bad shape")))
    assert bug == "scorer-0 failed (ActorDiedError: ValueError: bad shape)"
    bug = str(failure("rollout-0", ray.exceptions.RayTaskError("run", "Traceback ...", KeyError("x"))))
    assert bug.startswith("rollout-0 failed (KeyError: ") and "resume" not in bug
    # a process that died (killed, out of memory, node lost): a rerun resumes from the last checkpoint
    died = str(failure("the learner", ray.exceptions.ActorDiedError()))
    assert died.startswith("the learner failed (ActorDiedError: ") and died.endswith(
        "; run the same command again to resume from the last checkpoint")


# ------------------------------------------------------------------------------------------ an EAGLE-3 warm drafter


@pytest.fixture
def eagle3_spec(micro_spec_file, micro_assets, tmp_path):
    """(spec file, drafter dir): the micro spec with a random EAGLE-3 warm drafter fusing target layers [1, 2, 2]
    (entering 2, 3, 3: the 4-layer micro target has no three distinct ones to offer)."""
    import yaml
    from torch import nn
    from transformers import AutoConfig

    from opd.formats.eagle3 import Eagle3Config
    from opd.models.eagle3 import Eagle3Drafter

    config = Eagle3Config.for_target(AutoConfig.from_pretrained(micro_assets["target"]), draft_vocab_size=32,
                                     block_size=4, aux_layer_ids=[2, 3, 3])
    shared = nn.Embedding(config.vocab_size, config.hidden_size), nn.Linear(config.hidden_size, config.vocab_size)
    Eagle3Drafter(config, *shared).save_pretrained(tmp_path / "e3")
    spec = yaml.safe_load(micro_spec_file.read_text())
    spec["models"] |= {"drafter_path": str(tmp_path / "e3"),
                       "drafter": {"kind": "eagle3", "block_size": 4, "target_layer_ids": [1, 2, 2]}}
    micro_spec_file.write_text(yaml.safe_dump(spec))
    return micro_spec_file, tmp_path / "e3"


def test_an_eagle3_warm_drafter_passes_and_may_carry_the_targets_embedding(eagle3_spec, capsys):
    from safetensors.torch import load_file, save_file

    spec_file, drafter = eagle3_spec
    assert main(["validate", str(spec_file)]) == 0
    tensors = load_file(drafter / "model.safetensors")
    tensors["embed_tokens.weight"] = torch.zeros(tensors["t2d"].shape[0], tensors["norm.weight"].shape[0])
    save_file(tensors, drafter / "model.safetensors")
    assert main(["validate", str(spec_file)]) == 0


def test_an_eagle3_warm_drafter_in_speculators_layout_passes(eagle3_spec, micro_assets, tmp_path):
    """vLLM's `speculators` layout (what `opd export` writes for EAGLE 3.1) names the layer `layers.0.*`, SpecForge's
    `midlayer.*`: the preflight reads its names as loading does."""
    import yaml
    from safetensors.torch import load_file

    from opd.formats.eagle3 import Eagle3Config, write_speculators

    spec_file, drafter = eagle3_spec
    config = Eagle3Config.from_hf_dict(json.loads((drafter / "config.json").read_text()), num_target_layers=4,
                                       block_size=4)
    write_speculators(tmp_path / "spec", config, load_file(drafter / "model.safetensors"), torch.float32,
                      micro_assets["target"], ["Qwen3ForCausalLM"])
    assert any(name.startswith("layers.0.") for name in load_file(tmp_path / "spec" / "model.safetensors"))
    spec = yaml.safe_load(spec_file.read_text())
    spec["models"]["drafter_path"] = str(tmp_path / "spec")
    spec_file.write_text(yaml.safe_dump(spec))
    assert main(["validate", str(spec_file)]) == 0


def _edit_tensors(drafter, edit) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(drafter / "model.safetensors")
    edit(tensors)
    save_file(tensors, drafter / "model.safetensors")


def _edit_config(drafter, edit) -> None:
    config = json.loads((drafter / "config.json").read_text())
    edit(config)
    (drafter / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(("edit", "message"), [
    (lambda d: _edit_tensors(d, lambda t: t.update({"fc.weight": t["fc.weight"][:, :1].contiguous()})),
     r"model\.safetensors: tensor fc\.weight has shape \[32, 1\], expected \[32, 96\]"),
    (lambda d: _edit_tensors(d, lambda t: t.pop("d2t")), r"model\.safetensors: missing tensor\(s\) d2t"),
    (lambda d: _edit_tensors(d, lambda t: t.update({"model.embed_tokens.weight": t["norm.weight"].clone()})),
     r"model\.safetensors: unexpected tensor\(s\) model\.embed_tokens\.weight"),
    (lambda d: os.remove(d / "model.safetensors"), r"model\.safetensors: drafter weights not found"),
    (lambda d: _edit_config(d, lambda c: c.update(hidden_size=64)),
     r"config\.json: config field 'hidden_size' is 64; expected 32"),
    (lambda d: _edit_config(d, lambda c: c.update(draft_vocab_size=10**6)),
     r"config\.json: config field 'draft_vocab_size' is 1000000; expected 1\.\.\d+"),
    (lambda d: _edit_config(d, lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[2, 2, 3])),
     r"fuses target layers \[1, 1, 2\] but models\.drafter\.target_layer_ids resolves to \[1, 2, 2\] \(the family"),
    (lambda d: (d / "config.json").write_text("{"), r"config\.json: not valid JSON"),
])
def test_an_unusable_eagle3_warm_drafter_is_one_line_before_any_actor(eagle3_spec, capsys, no_ray, edit, message):
    spec_file, drafter = eagle3_spec
    edit(drafter)
    assert main(["train", str(spec_file), "--set", "engine=ray"]) == 2
    line = one_error_line(capsys)
    assert re.search(message, line) and str(drafter) in line, line
