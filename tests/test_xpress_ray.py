"""`opd run` on Ray with `kind: xpress` on two target families besides the tiny Qwen3 (the targets of
tests/helpers/mtp.py, without their MTP heads): a hybrid Qwen3.5 and a DeepSeek-V3 (latent attention, MoE), each
with a fresh XPress drafter. One rollout actor, no policy lag: the Ray run takes the single-process run's steps.
Slow (make test-all): two whole runs per family."""

from __future__ import annotations

import pytest

from actors.driver import run_ray
from tests.helpers import mtp as helper
from tests.helpers.ray_runs import local_losses, ray_cluster, ray_spec  # noqa: F401 (a fixture)

pytestmark = pytest.mark.slow
STEPS = 3
XPRESS = ["models.drafter_path=", "models.drafter.kind=xpress", "models.drafter.num_layers=1",
          "models.drafter.block_size=4", "models.drafter.xpress_rank=4", "models.drafter.jacobi_passes=2"]


@pytest.mark.parametrize("name", ["qwen3_5", "deepseek_v3"])
def test_an_xpress_run_on_ray_takes_the_local_runs_steps(name, ray_cluster, micro_assets, micro_spec_file, tmp_path):
    path = helper.spec_file(name, "xpress", micro_assets, micro_spec_file, tmp_path)
    local = local_losses(path, tmp_path, steps=STEPS, sets=XPRESS)
    spec = ray_spec(path, tmp_path, *XPRESS, steps=STEPS)
    assert spec.models.drafter.kind == "xpress" and not spec.models.drafter_path
    result = run_ray(spec, track=False)
    assert result.steps == STEPS and len(local) == STEPS
    assert result.losses == pytest.approx(local, rel=1e-5, abs=1e-7)
