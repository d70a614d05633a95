"""Builders: turn a validated spec into loaded models (torchtune-style functions, no registry)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from opd.data import load_tokenizer, mask_token_id
from opd.errors import OpdError
from opd.models.drafter import DFlashConfig, DFlashDrafter
from opd.models.target import Target, load_target
from opd.spec import ExperimentSpec

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


@dataclass
class Models:
    target: Target
    drafter: DFlashDrafter
    tokenizer: object

    @property
    def eos_id(self) -> int:
        return self.tokenizer.eos_token_id


def resolve_device(device: str) -> str:
    """`auto` is CUDA when this process sees a GPU: inside an actor Ray sets CUDA_VISIBLE_DEVICES to its own."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise OpdError("models.device: cuda but this process sees no GPU (expected auto or cpu here)")
    return device


def build_target(spec: ExperimentSpec) -> Target:
    """The frozen target alone (what a replay scorer needs)."""
    m = spec.models
    return load_target(m.target_path, dtype=DTYPES[m.dtype], attn_implementation=m.attn_implementation,
                       layer_ids=m.layer_ids or [], device=resolve_device(m.device))


def build_models(spec: ExperimentSpec, drafter_path: str | None = None, *, seed: int | None = None) -> Models:
    """The frozen target, its tokenizer and a drafter: loaded from `drafter_path` (default: the spec's warm
    drafter) or, when the path is "random" or no drafter is configured, freshly initialised from `seed`."""
    m = spec.models
    path = drafter_path or m.drafter_path
    if path not in (None, "random") and not (Path(path) / "config.json").is_file():
        raise OpdError(f"drafter: {path}/config.json not found (expected a DFlash drafter directory or 'random')")
    tokenizer = load_tokenizer(m.tokenizer)
    target = build_target(spec)
    if len(tokenizer) > target.vocab_size:
        raise OpdError(f"tokenizer {m.tokenizer}: {len(tokenizer)} tokens but the target's vocabulary has "
                       f"{target.vocab_size} (expected a tokenizer that fits the target)")
    if path is None or path == "random":
        return Models(target, random_drafter(spec, target, tokenizer, spec.seed if seed is None else seed), tokenizer)
    drafter = DFlashDrafter.from_pretrained(path, target).to(target.device)
    if drafter.block_size != m.drafter.block_size:
        raise OpdError(f"drafter {path}: block_size {drafter.block_size} but models.drafter.block_size is "
                       f"{m.drafter.block_size} (expected them to agree)")
    return Models(target, drafter, tokenizer)


def random_drafter(spec: ExperimentSpec, target: Target, tokenizer, seed: int) -> DFlashDrafter:
    config = DFlashConfig.for_target(target.config, num_layers=spec.models.drafter.num_layers,
                                     block_size=spec.models.drafter.block_size,
                                     mask_token_id=mask_token_id(tokenizer, spec.models.drafter.mask_token_id),
                                     target_layer_ids=target.layer_ids)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return DFlashDrafter(config, target.embed_tokens, target.lm_head).to(target.device)
