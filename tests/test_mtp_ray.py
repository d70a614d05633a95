"""`opd run` on Ray with `kind: mtp` on two target families besides the tiny Qwen3 (tests/helpers/mtp.py): a hybrid
Qwen3.5 (the head's layer its full-attention layer) and a DeepSeek-V3 (latent attention, an MoE head stored one
tensor per expert), each carrying its own head, which is the warm start (no drafter path). One rollout actor, no
policy lag: the Ray run takes the single-process run's steps. Slow (make test-all): two whole runs per family."""

from __future__ import annotations

import json

import pytest
import yaml
from transformers import AutoTokenizer

from actors.driver import run_ray
from tests.helpers import mtp as helper
from tests.helpers.ray_runs import local_losses, ray_cluster, ray_spec  # noqa: F401 (a fixture)

pytestmark = pytest.mark.slow
STEPS = 3


def mtp_spec_file(name: str, micro_assets, micro_spec_file, tmp_path):
    """The micro spec on a target of family `name` sized to the micro tokenizer, its own head the drafter."""
    tokenizer = AutoTokenizer.from_pretrained(micro_assets["target"])
    directory = helper.target_dir(name, tmp_path / name, vocab_size=len(tokenizer))
    tokenizer.save_pretrained(directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(config | {"eos_token_id": tokenizer.eos_token_id}))
    spec = yaml.safe_load(micro_spec_file.read_text())
    spec["models"] = {"target_path": str(directory), "dtype": "float32", "drafter": {"kind": "mtp", "block_size": 4}}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.mark.parametrize("name", ["qwen3_5", "deepseek_v3"])
def test_an_mtp_run_on_ray_takes_the_local_runs_steps(name, ray_cluster, micro_assets, micro_spec_file, tmp_path):
    path = mtp_spec_file(name, micro_assets, micro_spec_file, tmp_path)
    local = local_losses(path, tmp_path, steps=STEPS)
    result = run_ray(ray_spec(path, tmp_path, steps=STEPS), track=False)
    assert result.steps == STEPS and len(local) == STEPS
    assert result.losses == pytest.approx(local, rel=1e-5, abs=1e-7)
