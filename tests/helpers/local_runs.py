"""Short local-engine runs of the micro spec (tests/conftest.py's `micro_spec_file`): a spec under its own run
directory, its training losses, a stored sample file drawn for it, and the check that every rollout source trains
alike."""

from __future__ import annotations

import pytest
import torch

from opd.commands.gen_samples import run_gen_samples
from opd.spec import load_spec
from opd.train.local import LocalTrainer


def spec_for(micro_spec_file, tmp_path, name: str, *sets: str):
    return load_spec(micro_spec_file, ["steps=3", "eval.every=0", f"tracking.run_dir={tmp_path / name}", *sets])


def losses(spec) -> list[float]:
    return LocalTrainer(spec, track=False).run().losses


def sample_file(micro_spec_file, tmp_path, *sets: str, count: int = 1, engine: str | None = None) -> str:
    path = tmp_path / "samples.jsonl"
    spec = spec_for(micro_spec_file, tmp_path, "gen", *sets)
    assert run_gen_samples(spec, engine, count, str(path)) == 0
    return str(path)


def assert_every_source_trains_alike(micro_spec_file, tmp_path, greedy: list[str], *, autoregressive: bool = False
                                     ) -> None:
    """Greedy rollouts (`greedy`: sets with rollout.temperature 0) decoded by the drafter, sampled from the target
    and rebuilt by the scorer (also by the plain autoregressive sampler with `autoregressive`), or read from a sample
    file: every source takes the speculative rollout's steps, to 1e-9."""
    reference = losses(spec_for(micro_spec_file, tmp_path, "speculative", *greedy))
    assert all(torch.isfinite(torch.tensor(reference)))
    path = sample_file(micro_spec_file, tmp_path, *greedy, engine="autoregressive")
    sources = {"target": ["rollout.source=target"],
               "samples": ["rollout.source=samples", f"rollout.samples_path={path}"]}
    if autoregressive:
        sources["target-autoregressive"] = ["rollout.source=target", "rollout.sampler=autoregressive"]
    for name, sets in sources.items():
        assert losses(spec_for(micro_spec_file, tmp_path, name, *greedy, *sets)) == pytest.approx(
            reference, rel=1e-9), name
