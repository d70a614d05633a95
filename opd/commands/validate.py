"""The spec as a run will use it: what `opd validate` prints.

Several fields default to None meaning "derive it" (the tokenizer is the target's, the feature layers are the
DFlash default for the target's depth, a DFlash mask token is the tokenizer's, the run dir takes the run's name, the
MLflow store follows the run dir). Printing those as `null` hides exactly what a user validates a spec to see,
so they are filled in here. Fields whose None means "off" (teacher_topk, max_flops, keep_last, ...) or that
depend on the data (random_anchors_per_seq) stay null. The printed YAML is itself a valid spec that resolves to
the same values; `rollout.static_cache` carries a comment saying what it is for. Only JSON files are read,
so `opd validate` still imports neither torch nor transformers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from opd.spec import ExperimentSpec

STATIC_CACHE_NOTE = ("fixed shapes for rollout.compile: the same tokens, caches of prompt + max_new_tokens + 2K "
                     "columns per row; it pays only when the step is compiled")


def resolved_yaml(spec: ExperimentSpec) -> str:
    """`spec` as YAML with its derived fields filled in."""
    data = spec.model_dump(mode="json")
    models, drafter = data["models"], data["models"]["drafter"]
    models["tokenizer_path"] = spec.models.tokenizer
    drafter["target_layer_ids"] = spec.models.layer_ids
    if "mask_token_id" in drafter and drafter["mask_token_id"] is None:  # a family with a mask token
        drafter["mask_token_id"] = tokenizer_mask_id(Path(spec.models.tokenizer))
    data["tracking"]["run_dir"] = str(spec.run_dir)
    data["tracking"]["uri"] = spec.tracking_uri
    text = yaml.safe_dump(data, sort_keys=False)
    flag = f"  static_cache: {str(spec.rollout.static_cache).lower()}\n"
    return text.replace(flag, flag[:-1] + f"  # {STATIC_CACHE_NOTE}\n", 1)


def run_length(spec: ExperimentSpec) -> str:
    """The run's length in every unit a reader compares with a paper: updates, rollout batches, sequences, epochs;
    as YAML comments, so the printed spec stays loadable."""
    steps = spec.total_steps
    batches = steps * spec.batches_per_step
    sequences = batches * spec.rollout.batch_size
    pool = spec.data.train_pool_size
    epochs = f", {sequences / pool:.2f} epochs over {pool:,} prompts" if pool else ""
    return (f"# run length: {steps:,} optimizer updates (steps) x {spec.batches_per_step} rollout batches of "
            f"{spec.rollout.batch_size} prompts = {batches:,} rollout batches, {sequences:,} sequences{epochs}\n")


def tokenizer_mask_id(directory: Path) -> int | None:
    """The id of the tokenizer's mask token, read from its JSON files; None when they do not say."""
    config = _json(directory / "tokenizer_config.json")
    mask = config.get("mask_token")
    content = mask.get("content") if isinstance(mask, dict) else mask
    if not isinstance(content, str):
        return None
    ids = {entry.get("content"): int(i) for i, entry in (config.get("added_tokens_decoder") or {}).items()}
    tokenizer = _json(directory / "tokenizer.json")
    ids |= {entry.get("content"): entry.get("id") for entry in tokenizer.get("added_tokens") or []}
    vocab = (tokenizer.get("model") or {}).get("vocab")
    found = ids.get(content, vocab.get(content) if isinstance(vocab, dict) else None)
    return found if isinstance(found, int) else None


def _json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
