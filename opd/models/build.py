"""Builders: turn a validated spec into loaded models (torchtune-style functions; the drafter's family does its
own part, opd/models/registry.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from opd.data.prompts import load_tokenizer
from opd.errors import OpdError
from opd.model_dir import DRAFTER_FIELD, ModelDir
from opd.models.protocol import Drafter
from opd.models.registry import detect, family
from opd.models.shared_head import SharedHead, load_shared_head
from opd.models.target import Target, load_target
from opd.spec import ExperimentSpec, ModelsSpec

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


@dataclass
class Models:
    target: Target
    drafter: Drafter
    tokenizer: PreTrainedTokenizerBase

    @property
    def eos_id(self) -> int:
        return self.tokenizer.eos_token_id


@dataclass
class LearnerModels:
    """What a learner holds: the trainable drafter on the target's shared embedding and LM head (`head`: a
    `SharedHead` read from the target's files, or the `Target` itself where one process holds both)."""

    head: SharedHead | Target
    drafter: Drafter
    tokenizer: PreTrainedTokenizerBase


def resolve_device(device: str) -> str:
    """`auto` is CUDA when this process sees a GPU: inside an actor Ray sets CUDA_VISIBLE_DEVICES to its own."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise OpdError("models.device: cuda but this process sees no GPU (expected auto or cpu here)")
    return device


def build_target(m: ModelsSpec) -> Target:
    """The frozen target alone (what a replay scorer needs)."""
    return load_target(m.target_path, dtype=DTYPES[m.dtype], attn_implementation=m.attn_implementation,
                       layer_ids=m.layer_ids or [], device=resolve_device(m.device))


def build_shared_head(m: ModelsSpec) -> SharedHead:
    """The target's embedding and LM head alone (what a learner needs), read from its files."""
    return load_shared_head(m.target_path, dtype=DTYPES[m.dtype], layer_ids=m.layer_ids or [],
                            device=resolve_device(m.device))


def build_models(spec: ExperimentSpec, drafter_path: str | None = None, *, seed: int | None = None) -> Models:
    """The frozen target, its tokenizer and a drafter: loaded from `drafter_path` (default: the spec's warm
    drafter) or, when the path is "random" or no drafter is configured, freshly initialised from `seed`."""
    _check_drafter_path(spec, drafter_path)
    tokenizer = load_tokenizer(spec.models.tokenizer)
    target = build_target(spec.models)
    return Models(target, build_drafter(spec, target, tokenizer, drafter_path, seed=seed), tokenizer)


def build_learner_models(spec: ExperimentSpec) -> LearnerModels:
    """The spec's warm (or random) drafter on the target's embedding and LM head, without the target."""
    _check_drafter_path(spec, None)
    tokenizer = load_tokenizer(spec.models.tokenizer)
    head = build_shared_head(spec.models)
    return LearnerModels(head, build_drafter(spec, head, tokenizer), tokenizer)


def build_drafter(spec: ExperimentSpec, base: Target | SharedHead, tokenizer, drafter_path: str | None = None, *,
                  seed: int | None = None) -> Drafter:
    """A drafter on `base`'s embedding (and DFlash: its LM head): from `drafter_path` (default: the spec's warm
    drafter; a checkpoint is of the family its config.json says, the spec's own resolved to agree), or of the
    spec's family, random from `seed`, when the path is "random" or no drafter is configured."""
    m = spec.models
    path = drafter_path or m.drafter_path
    if len(tokenizer) > base.vocab_size:
        raise OpdError(f"tokenizer {m.tokenizer}: {len(tokenizer)} tokens but the target's vocabulary has "
                       f"{base.vocab_size} (expected a tokenizer that fits the target)")
    if path is None or path == "random":
        return initial_drafter(m, base, tokenizer, spec.seed if seed is None else seed)
    directory = ModelDir.read(path, "drafter").expect("drafter", "drafter" if drafter_path else DRAFTER_FIELD)
    found = detect(directory)  # a checkpoint named apart from the spec's (`opd eval --draft`) is of its own family
    section = (m.drafter if found.kind == m.drafter.kind
               else found.section.model_validate({"block_size": m.drafter.block_size}))
    drafter = found.load(directory, base, section)
    if drafter.block_size != m.drafter.block_size:
        raise OpdError(f"drafter {path}: block_size {drafter.block_size} but models.drafter.block_size is "
                       f"{m.drafter.block_size} (expected them to agree)")
    return drafter


def _check_drafter_path(spec: ExperimentSpec, drafter_path: str | None) -> None:
    """Before any weights load: a named drafter directory (`opd eval --draft`, else the spec's) must exist and be
    a drafter's."""
    path = drafter_path or spec.models.drafter_path
    if path not in (None, "random"):
        directory = ModelDir.read(path, "drafter", expected="a drafter directory or 'random'")
        directory.expect("drafter", "--draft" if drafter_path else DRAFTER_FIELD)


def initial_drafter(m: ModelsSpec, target: Target | SharedHead, tokenizer, seed: int) -> Drafter:
    """A freshly initialised drafter of the spec's family, from `seed`."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return family(m.drafter.kind).initial(m.drafter, target, tokenizer)
