"""What a new user meets around a run: a tiny `epochs` still trains at least one update and its printed spec loads
again; a refusal's advice about stale eval samples works when followed; a run that lost batches says so."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from opd.cli import main
from opd.spec import load_spec

TINY = "configs/tiny.yaml"


def test_a_tiny_epochs_rounds_up_to_one_update_and_its_printed_spec_loads(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """0.0001 epochs over 4,000 prompts is 0.4 sequences: rounded up to whole updates, that is one update."""
    sets = ["steps=null", "epochs=0.0001", "data.train_pool_size=4000"]
    assert main(["validate", TINY, "--no-path-check", *[a for s in sets for a in ("--set", s)]]) == 0
    out = capsys.readouterr().out
    assert yaml.safe_load(out)["steps"] == 1 and "# run length: 1 optimizer updates" in out
    (tmp_path / "printed.yaml").write_text(out)
    assert main(["validate", str(tmp_path / "printed.yaml"), "--no-path-check"]) == 0
    assert capsys.readouterr().out == out


def test_epochs_round_up_to_whole_updates_not_to_whole_sequences(micro_spec_file: Path) -> None:
    """40 prompts, 4 sequences an update: 0.51 epochs is 20.4 sequences, which 5 updates (20) would not cover."""
    assert load_spec(micro_spec_file, ["steps=null", "epochs=0.51"]).steps == 6
    assert load_spec(micro_spec_file, ["steps=null", "epochs=0.5"]).steps == 5  # exactly 20 sequences
