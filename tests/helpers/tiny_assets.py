"""The shipped tiny target (opd/assets/tiny) and its held-out prompts, as the z-lab interop tests decode them."""

from __future__ import annotations

import json

import torch

from opd.models.target import load_target

TARGET, DRAFTER, PROMPTS = "opd/assets/tiny/target", "opd/assets/tiny/drafter", "opd/assets/tiny/prompts/heldout.jsonl"


def tiny_target_and_prompts(count: int) -> tuple:
    """The shipped tiny target (float32, the shipped drafter's layers) and the token ids of `count` held-out
    prompts: what every z-lab interop test decodes."""
    from transformers import AutoTokenizer

    target = load_target(TARGET, dtype=torch.float32, layer_ids=[1, 3])
    tokenizer = AutoTokenizer.from_pretrained(TARGET)
    lines = open(PROMPTS, encoding="utf-8").read().splitlines()[:count]
    return target, [tokenizer(json.loads(line)["prompt"])["input_ids"] for line in lines]
