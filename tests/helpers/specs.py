"""The smallest spec mapping that validates, a model directory holding only a config.json, and what `opd validate`
says of a spec it refuses."""

from __future__ import annotations

import json
from pathlib import Path

from opd.cli import main

MINIMAL = {"steps": 10, "models": {"target_path": "t"}, "data": {"train_prompts": "a", "eval_prompts": "b"}}


def make_model_dir(path: Path, config: dict) -> str:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def validate_errors(spec_file: Path, sets: list[str], capsys) -> str:
    """`opd validate SPEC --set ...` refusing it: exit code 2, no traceback, one `error: ` line per problem; the
    lines, for the caller to find its message in."""
    args = ["validate", str(spec_file)] + [arg for s in sets for arg in ("--set", s)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert all(line.startswith("error: ") for line in err.strip().splitlines()), err  # one line per problem
    return err
