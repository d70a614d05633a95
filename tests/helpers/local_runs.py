"""Short local-engine runs of the micro spec (tests/conftest.py's `micro_spec_file`): a spec under its own run
directory, its training losses, and a stored sample file drawn for it."""

from __future__ import annotations

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
