"""Builders: turn a validated spec into loaded models (torchtune-style functions, no registry)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from opd.data.prompts import load_tokenizer, mask_token_id
from opd.errors import OpdError
from opd.models.dflash2 import dflash_class, load_dflash_drafter
from opd.models.dflash_format import check_dflash2_fields
from opd.models.drafter import DFlashConfig
from opd.models.eagle3 import Eagle3Drafter
from opd.models.eagle3_format import Eagle3Config
from opd.models.family import Drafter, checkpoint_kind
from opd.models.lm_head import teacher_head
from opd.models.shared_head import SharedHead, embedding_scale, load_shared_head
from opd.models.target import Target, load_target
from opd.spec import DrafterSpec, ExperimentSpec

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


@dataclass
class Models:
    target: Target
    drafter: Drafter
    tokenizer: object

    @property
    def eos_id(self) -> int:
        return self.tokenizer.eos_token_id


@dataclass
class LearnerModels:
    """What a learner holds: the trainable drafter on the target's shared embedding and LM head (`head`: a
    `SharedHead` read from the target's files, or the `Target` itself where one process holds both)."""

    head: SharedHead | Target
    drafter: Drafter
    tokenizer: object


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


def build_shared_head(spec: ExperimentSpec) -> SharedHead:
    """The target's embedding and LM head alone (what a learner needs), read from its files."""
    m = spec.models
    return load_shared_head(m.target_path, dtype=DTYPES[m.dtype], layer_ids=m.layer_ids or [],
                            device=resolve_device(m.device))


def build_models(spec: ExperimentSpec, drafter_path: str | None = None, *, seed: int | None = None) -> Models:
    """The frozen target, its tokenizer and a drafter: loaded from `drafter_path` (default: the spec's warm
    drafter) or, when the path is "random" or no drafter is configured, freshly initialised from `seed`."""
    _check_drafter_path(spec, drafter_path)
    tokenizer = load_tokenizer(spec.models.tokenizer)
    target = build_target(spec)
    return Models(target, build_drafter(spec, target, tokenizer, drafter_path, seed=seed), tokenizer)


def build_learner_models(spec: ExperimentSpec) -> LearnerModels:
    """The spec's warm (or random) drafter on the target's embedding and LM head, without the target."""
    _check_drafter_path(spec, None)
    tokenizer = load_tokenizer(spec.models.tokenizer)
    head = build_shared_head(spec)
    return LearnerModels(head, build_drafter(spec, head, tokenizer), tokenizer)


def build_drafter(spec: ExperimentSpec, base: Target | SharedHead, tokenizer, drafter_path: str | None = None, *,
                  seed: int | None = None) -> Drafter:
    """A drafter of `models.drafter.kind` on `base`'s embedding (and DFlash: its LM head): from `drafter_path`
    (default: the spec's warm drafter), or random from `seed` when the path is "random" or no drafter is
    configured."""
    m = spec.models
    path = drafter_path or m.drafter_path
    if len(tokenizer) > base.vocab_size:
        raise OpdError(f"tokenizer {m.tokenizer}: {len(tokenizer)} tokens but the target's vocabulary has "
                       f"{base.vocab_size} (expected a tokenizer that fits the target)")
    if path is None or path == "random":
        return random_drafter(spec, base, tokenizer, spec.seed if seed is None else seed)
    kind = checkpoint_kind(path)
    if kind != m.drafter.kind:
        raise OpdError(f"drafter {path}: a {kind or 'unknown'} checkpoint but models.drafter.kind is "
                       f"{m.drafter.kind} (expected them to agree)")
    if kind == "eagle3":
        drafter = Eagle3Drafter.from_pretrained(path, base, m.drafter.block_size).to(base.device)
        if drafter.config.target_layer_ids != base.layer_ids:
            raise OpdError(f"drafter {path}: fuses target layers {drafter.config.target_layer_ids} but "
                           f"models.drafter.target_layer_ids resolves to {base.layer_ids} (expected them to agree)")
    else:
        drafter = load_dflash_drafter(path, base).to(base.device)
    if drafter.block_size != m.drafter.block_size:
        raise OpdError(f"drafter {path}: block_size {drafter.block_size} but models.drafter.block_size is "
                       f"{m.drafter.block_size} (expected them to agree)")
    return drafter


def _check_drafter_path(spec: ExperimentSpec, drafter_path: str | None) -> None:
    """Before any weights load: a named drafter directory must exist."""
    path = drafter_path or spec.models.drafter_path
    if path not in (None, "random") and not (Path(path) / "config.json").is_file():
        raise OpdError(f"drafter: {path}/config.json not found (expected a drafter directory or 'random')")


def random_drafter(spec: ExperimentSpec, target: Target | SharedHead, tokenizer, seed: int) -> Drafter:
    """A freshly initialised drafter of the spec's kind (EAGLE-3: the identity draft vocabulary until SFT sets one
    from its data)."""
    d = spec.models.drafter
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if d.kind == "eagle3":
            config = Eagle3Config.for_target(target.config, draft_vocab_size=draft_vocab_size(d, target.vocab_size),
                                             block_size=d.block_size,
                                             aux_layer_ids=[i + 1 for i in target.layer_ids])
            return Eagle3Drafter(config, target.embed_tokens, target.lm_head).to(target.device)
        config = DFlashConfig.for_target(target.config, num_layers=d.num_layers, block_size=d.block_size,
                                         mask_token_id=mask_token_id(tokenizer, d.mask_token_id),
                                         target_layer_ids=target.layer_ids,
                                         input_embedding_scale=embedding_scale(target.embed_tokens))
        if d.dflash2:
            check_dflash2_fields(d.dflash2, config.hidden_size, config.vocab_size, "models.drafter.{}")
            config = replace(config, **d.dflash2)
        return dflash_class(config)(config, target.embed_tokens, target.lm_head,
                                    teacher_head(target)).to(target.device)


def draft_vocab_size(drafter: DrafterSpec, vocab_size: int) -> int:
    """`models.drafter.draft_vocab_size`, default the public Qwen3 drafters' 32,000 (or the whole vocabulary)."""
    size = drafter.draft_vocab_size or min(32000, vocab_size)
    if size > vocab_size:
        raise OpdError(f"models.drafter.draft_vocab_size: {size} is larger than the target's vocabulary "
                       f"{vocab_size} (expected at most {vocab_size})")
    return size
