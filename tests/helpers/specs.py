"""The smallest spec mapping that validates, and a model directory holding only a config.json."""

from __future__ import annotations

import json
from pathlib import Path

MINIMAL = {"steps": 10, "models": {"target_path": "t"}, "data": {"train_prompts": "a", "eval_prompts": "b"}}


def make_model_dir(path: Path, config: dict) -> str:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    return str(path)
