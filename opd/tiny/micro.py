"""Seeded random micro models for tests: a Qwen3 target and a DFlash or EAGLE-3 drafter, built in milliseconds.

Float64 by default so equivalence tests (packed vs separate forwards, cache vs recompute) can demand ~1e-12
agreement instead of hiding bugs behind float32 tolerances.
"""

from __future__ import annotations

import torch

from opd.formats.dflash import default_target_layer_ids
from opd.formats.eagle3 import Eagle3Config, draft_vocab
from opd.models.dflash import DFlashConfig, DFlashDrafter
from opd.models.eagle3 import Eagle3Drafter
from opd.models.lm_head import teacher_head
from opd.models.shared_head import embedding_scale
from opd.models.target import Target


def micro_target(
    seed: int = 0,
    vocab_size: int = 64,
    hidden_size: int = 32,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    dtype: torch.dtype = torch.float64,
    layer_ids: list[int] | None = None,
) -> Target:
    """A random Qwen3ForCausalLM wrapped as a Target; layer_ids default to the one-draft-layer DFlash rule."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config).to(dtype)
    return Target(model, layer_ids if layer_ids is not None else default_target_layer_ids(num_layers, 1))


def micro_drafter(
    target: Target,
    seed: int = 0,
    num_layers: int = 1,
    block_size: int = 4,
    mask_token_id: int | None = None,
) -> DFlashDrafter:
    """A random DFlash drafter for `target` (same dtype, same layer_ids); mask token defaults to vocab_size-1."""
    config = DFlashConfig.for_target(
        target.config,
        num_layers=num_layers,
        block_size=block_size,
        mask_token_id=target.vocab_size - 1 if mask_token_id is None else mask_token_id,
        target_layer_ids=target.layer_ids,
        input_embedding_scale=embedding_scale(target.embed_tokens),
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        drafter = DFlashDrafter(config, target.embed_tokens, target.lm_head, teacher_head(target))
    return drafter


def micro_eagle3(target: Target, seed: int = 0, block_size: int = 4, draft_vocab_size: int | None = None,
                 vocab_seed: int | None = None) -> Eagle3Drafter:
    """A random EAGLE-3 drafter for `target` (same dtype; its three layer_ids fused). With `draft_vocab_size`
    below the target's, the draft vocabulary is a random subset of ids drawn from `vocab_seed` (default `seed`)."""
    size = draft_vocab_size or target.vocab_size
    config = Eagle3Config.for_target(target.config, draft_vocab_size=size, block_size=block_size,
                                     aux_layer_ids=[i + 1 for i in target.layer_ids])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        drafter = Eagle3Drafter(config, target.embed_tokens, target.lm_head)
        torch.manual_seed(seed if vocab_seed is None else vocab_seed)
        counts = torch.rand(target.vocab_size)
    drafter.set_vocab(*draft_vocab(counts, size))
    return drafter
