"""`opd run` on Ray with `kind: mtp` on two target families besides the tiny Qwen3 (tests/helpers/mtp.py): a hybrid
Qwen3.5 (the head's layer its full-attention layer) and a DeepSeek-V3 (latent attention, an MoE head stored one
tensor per expert), each carrying its own head, which is the warm start (no drafter path). One rollout actor, no
policy lag: the Ray run takes the single-process run's steps. Slow (make test-all): two whole runs per family."""

from __future__ import annotations

import pytest

from actors.driver import run_ray
from tests.helpers import mtp as helper
from tests.helpers.ray_runs import local_losses, ray_cluster, ray_spec  # noqa: F401 (a fixture)

pytestmark = pytest.mark.slow
STEPS = 3


@pytest.mark.parametrize("name", ["qwen3_5", "deepseek_v3"])
def test_an_mtp_run_on_ray_takes_the_local_runs_steps(name, ray_cluster, micro_assets, micro_spec_file, tmp_path):
    path = helper.spec_file(name, "mtp", micro_assets, micro_spec_file, tmp_path)
    local = local_losses(path, tmp_path, steps=STEPS)
    result = run_ray(ray_spec(path, tmp_path, steps=STEPS), track=False)
    assert result.steps == STEPS and len(local) == STEPS
    assert result.losses == pytest.approx(local, rel=1e-5, abs=1e-7)
