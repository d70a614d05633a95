"""`rollout.compile` reaches every speculative decoder a run builds (the rollout's, the target sampler's), and is
refused without the static cache it needs; that a compiled step writes the eager tokens is
tests/test_compiled_decoding.py's."""

from __future__ import annotations

import pytest

from opd.sources.samplers import build_sampler
from opd.spec import SpecError, validate_spec
from opd.tiny.micro import micro_drafter, micro_target
from opd.train.rollout import RolloutWorker

MINIMAL = {"steps": 1, "models": {"target_path": "t", "target_num_layers": 36},
           "data": {"train_prompts": "a", "eval_prompts": "b"}}


def _spec(**rollout):
    return validate_spec({**MINIMAL, "rollout": rollout}, check_paths=False)


def test_compile_without_the_static_cache_is_one_line() -> None:
    with pytest.raises(SpecError, match=r"^rollout.compile: true without static_cache .*expected static_cache: "
                                        r"true\)$"):
        _spec(compile=True)


@pytest.mark.parametrize("compile_", [False, True])
def test_the_setting_reaches_the_rollouts_and_the_samplers_decoder(compile_: bool) -> None:
    target = micro_target()
    drafter = micro_drafter(target)
    spec = _spec(static_cache=True, compile=compile_)
    worker = RolloutWorker(spec, target, drafter, eos_id=0, prompts=[])
    sampler = build_sampler(spec, "speculative", target, drafter, eos_id=0)
    assert worker.decoder.compiled is compile_ and sampler.decoder.compiled is compile_
    assert worker.decoder.static_cache and sampler.decoder.static_cache
