"""The DFlash drafter: a few Qwen3-style decoder layers that draft a whole block of tokens in one forward.

How it works (DFlash, arXiv 2602.06036; public code z-lab/dflash):

* Context. The target's hidden states at `target_layer_ids` are concatenated ([T, n*H]), fused by
  `fc: Linear(n*H -> H)` and `hidden_norm`, and injected into *every* drafter layer as extra keys/values.
  Context positions get no query, no output projection, no MLP and no residual: they are only attended to.
* Block. `[anchor, MASK x (K-1)]` at positions anchor..anchor+K-1 is embedded with the target's embedding,
  attends bidirectionally to itself and to every context position strictly before the anchor, and the final
  hidden states at block positions 1..K-1 go through the target's LM head: K-1 draft tokens per forward.
* The drafter owns no embedding and no LM head; it borrows the target's (frozen) ones by reference, so they are
  neither parameters nor checkpoint tensors of the drafter.
* Variants (z-lab's `DFlashDraftModel`): a layer may be causal and/or windowed (`LayerAttention`, per layer, on
  top of the block rule above, in decoding and training alike), the block's embeddings may be scaled
  (`input_embedding_scale`) and the logits scaled and soft-capped (`DraftHead`), which is the drafter's q wherever
  it is formed: drafts, the losses, SFT.

The checkpoint layout (config.json + model.safetensors) is the public one, so drafters trained here load in
vLLM/SGLang (`method: dflash`) and public drafters load here; `opd/formats/dflash.py` reads and writes it,
`DFlashConfig` included.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, cast

import torch
import torch.nn.functional as F
from torch import nn

from opd.data.prompts import mask_token_id
from opd.errors import OpdError
from opd.formats.checkpoint import WEIGHTS_FILE, TargetShape
from opd.formats.dflash import (
    SHARED_TENSOR_SUFFIXES,
    DFlashConfig,
    DFlashSpec,
    check_vllm_capturable,
    read_config,
    read_tensors,
    write_checkpoint,
    write_speculators,
)
from opd.formats.layer_attention import LayerAttention
from opd.model_dir import ModelDir
from opd.models.drafter_cache import DrafterCache, PendingContext
from opd.models.family import DrafterFamily, PublicLayout, Shapes, drafter_family
from opd.models.layers import GatedMLP, RMSNorm, apply_rope, rope_cos_sin, scaled_cos_sin
from opd.models.lm_head import softcap, teacher_head
from opd.models.packed_attention import CHUNK_ROWS, BlockChunks, grouped_sdpa
from opd.models.row_product import per_row
from opd.models.shared_head import SharedHead, embedding_scale
from opd.models.target import Target

# ---------------------------------------------------------------------------------------------------------------
# Building blocks (Qwen3 layout, so tensor names match the public checkpoints)
# ---------------------------------------------------------------------------------------------------------------


def rope_frequencies(config: DFlashConfig, rope: dict) -> tuple[torch.Tensor, float] | None:
    """(inverse frequencies [head_dim/2], attention scaling) of the RoPE `rope` (one of `config`'s), from
    transformers' own RoPE initialisation (`ROPE_INIT_FUNCTIONS`, on the Qwen3 config z-lab's drafter is built
    from), so YaRN, llama3 and the other scaled types rotate exactly as in z-lab's `Qwen3RotaryEmbedding`. None
    for plain RoPE, which stays `rope_cos_sin`'s (float64 when the drafter is: the tests' exact references)."""
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope["rope_type"] == "default":
        return None
    hf = Qwen3Config(**{**config.to_hf_dict(), "rope_parameters": dict(rope), "rope_scaling": None})
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf, None)
    if inv_freq.numel() != config.head_dim // 2:
        raise OpdError(f"config field 'rope_parameters' rotates {2 * inv_freq.numel()} of {config.head_dim} head "
                       "dims (a partial_rotary_factor); the DFlash drafter rotates whole heads")
    return inv_freq, float(scaling)


class DFlashAttention(nn.Module):
    """Qwen3 attention whose keys/values are [context; block] and whose queries are the block only."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def _heads(self, x: torch.Tensor, num_heads: int) -> torch.Tensor:
        """[B,T,heads*d] -> [B,heads,T,d]."""
        return x.view(*x.shape[:2], num_heads, self.head_dim).transpose(1, 2)

    def project_kv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated keys and values [B,kv_heads,T,d]; the same projection serves context and block."""
        k = apply_rope(self.k_norm(self._heads(self.k_proj(x), self.num_kv_heads)), cos, sin)
        return k, self._heads(self.v_proj(x), self.num_kv_heads)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        context_kv: tuple[torch.Tensor, torch.Tensor] | NewContext,
        mask: torch.Tensor | BlockChunks | None,
    ) -> torch.Tensor:
        """x: block hidden [B,S,H]; mask: bool [B,1,S,C+S] over keys [context (C); block (S)] (one block per row,
        decoding; None: every key), or the `BlockChunks` of many blocks per row (training: no [S, C+S] mask is
        formed). `context_kv`: the cached context's K/V, or a `NewContext` still to be projected with the block."""
        q = apply_rope(self.q_norm(self._heads(self.q_proj(x), self.num_heads)), cos, sin)
        scale = self.head_dim**-0.5
        if isinstance(context_kv, NewContext):
            out = grouped_sdpa(q, *context_kv.keys_values(self, x), cast(torch.Tensor | None, mask), scale)
            return self.o_proj(out.transpose(1, 2).reshape(*x.shape[:2], self.num_heads * self.head_dim))
        k, v = self.project_kv(x, cos, sin)
        if isinstance(mask, BlockChunks):
            out = mask.attend(q, k, v, context_kv, scale)
        else:
            keys, values = torch.cat([context_kv[0], k], dim=2), torch.cat([context_kv[1], v], dim=2)
            out = grouped_sdpa(q, keys, values, mask, scale)
        return self.o_proj(out.transpose(1, 2).reshape(*x.shape[:2], self.num_heads * self.head_dim))


@dataclass
class NewContext:
    """One layer's view of context that a draft projects together with its block, as z-lab's drafter does: the
    context stream [B,T,H], the RoPE tables [B,1,T+S,d] of its positions and the block's, and the cache and the
    pending entries the projection is written to. K-norm and RoPE then run once over context and block."""

    context: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    cache: DrafterCache
    pending: PendingContext
    layer: int

    def keys_values(self, attention: DFlashAttention, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values the block x [B,S,H] attends to: the cache's (the context written into it first),
        then the block's own. Each linear runs on context and block apart, so every entry's K/V is what a separate
        projection of it gives."""
        heads = attention.num_kv_heads
        k = torch.cat([attention.k_proj(self.context), attention.k_proj(x)], dim=1)
        v = torch.cat([attention.v_proj(self.context), attention.v_proj(x)], dim=1)
        k = apply_rope(attention.k_norm(attention._heads(k, heads)), self.cos, self.sin)
        return self.cache.fold(self.pending, self.layer, k, attention._heads(v, heads))


class DFlashDecoderLayer(nn.Module):
    """Pre-norm Qwen3 decoder layer; only block positions flow through it, context is just attended to."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(config)
        self.mlp = GatedMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        context_kv: tuple[torch.Tensor, torch.Tensor] | NewContext,
        mask: torch.Tensor | BlockChunks | None,
    ) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, context_kv, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class DraftHead(nn.Module):
    """The target's LM head followed by a variant's logit transform: × `multiplier`, then `cap` · tanh(· / cap),
    in the logits' dtype and in z-lab's order (`compute_logits`), so argmax drafts match z-lab's bit for bit."""

    def __init__(self, lm_head: nn.Linear, multiplier: float | None, cap: float | None) -> None:
        super().__init__()
        self.lm_head, self.multiplier, self.cap = lm_head, multiplier, cap

    @property
    def weight(self) -> torch.Tensor:
        """The head's weight (callers cast hidden rows to its dtype)."""
        return self.lm_head.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.multiplier is not None:
            logits = logits * self.multiplier
        if self.cap is not None and self.cap > 0:
            logits = softcap(logits, self.cap)
        return logits


# ---------------------------------------------------------------------------------------------------------------
# The drafter
# ---------------------------------------------------------------------------------------------------------------


class DFlashDrafter(nn.Module):
    """DFlash block drafter sharing the target's embedding and LM head (by reference, not as submodules)."""

    kind = "dflash"

    layer_class: type[DFlashDecoderLayer] = DFlashDecoderLayer  # DFlash 2 (opd/models/dflash2.py) adds its convolutions
    config_class: type[DFlashConfig] = DFlashConfig  # what its config.json reads as (DSpark's has its heads)

    def __init__(self, config: DFlashConfig, embed_tokens: nn.Embedding, lm_head: nn.Linear,
                 teacher: nn.Module | None = None) -> None:
        """`teacher`: the target's head as its forward forms logits (`lm_head.teacher_head`: soft-capped where the
        target caps), default `lm_head`."""
        super().__init__()
        if embed_tokens.weight.shape != (config.vocab_size, config.hidden_size):
            raise ValueError(f"embed_tokens {tuple(embed_tokens.weight.shape)} does not fit the drafter config")
        self.config = config
        # A tuple is not registered by nn.Module: the shared modules stay out of parameters() and state_dict().
        self._shared = (embed_tokens, lm_head)
        head: nn.Module = lm_head
        if config.output_multiplier is not None or config.final_logit_softcapping is not None:
            head = DraftHead(lm_head, config.output_multiplier, config.final_logit_softcapping)
        self._student_head: tuple[nn.Module] = (head,)
        self._teacher_head = (teacher if teacher is not None else lm_head,)
        self.attention = [config.layer_attention(i) for i in range(config.num_hidden_layers)]
        ropes = [config.rope_of(i) for i in range(config.num_hidden_layers)]
        self._ropes = [rope for i, rope in enumerate(ropes) if rope not in ropes[:i]]  # the distinct ones
        self._rope_index = [self._ropes.index(rope) for rope in ropes]
        self._rope_frequencies = [rope_frequencies(config, rope) for rope in self._ropes]
        self.layers = nn.ModuleList(self.layer_class(config) for _ in range(config.num_hidden_layers))
        self.fc = nn.Linear(len(config.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self._init_weights()
        self.to(device=embed_tokens.weight.device, dtype=embed_tokens.weight.dtype)

    def _init_weights(self, std: float = 0.02) -> None:
        """HF's Qwen3 initialisation (normal(0, 0.02) weights, zero biases), so fresh drafters train alike."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self._shared[0]

    @property
    def lm_head(self) -> nn.Linear:
        return self._shared[1]

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    sft_target = "data"  # SFT learns the data tokens (DFlash's recipe)
    chains_q = False  # q_k is the logits' own (`draft`), whatever was drafted at the slots before
    reads_next_ids = False  # a block reads the context alone

    def extra_flops(self) -> tuple[int, int]:
        """(FLOPs per block token, per drafted slot) beyond its weights': none (opd/models/flops.py)."""
        return 0, 0

    @property
    def student_head(self) -> nn.Module:
        """Hidden -> the drafter's logits (its q): the target's frozen LM head, with a variant's logit transform
        (`DraftHead`); the loss applies it chunk by chunk."""
        return self._student_head[0]

    @property
    def teacher_head(self) -> nn.Module:
        """Target final-norm hidden -> the teacher's logits in the drafter's vocabulary: the target's head, with the
        target's own softcapping."""
        return self._teacher_head[0]

    def trainable_slots(self, teacher: torch.Tensor) -> torch.Tensor | None:
        """Which slots of a teacher [N, K-1, H] the drafter can learn: all (it drafts the whole vocabulary)."""
        return None

    @property
    def tokens_per_block(self) -> int:
        """Tokens a block runs through the decoder layers: all K (anchor and masks)."""
        return self.block_size

    def modules_by_role(self) -> tuple[list[nn.Module], list[nn.Module], nn.Linear]:
        """(run per context position, run per block token, the head per drafted slot), for FLOP counting."""
        kv = [m for layer in self._layers() for m in (layer.self_attn.k_proj, layer.self_attn.v_proj)]
        return [self.fc, self.hidden_norm, *kv], [*self.layers, self.norm], self.lm_head

    def _layers(self) -> Iterable[DFlashDecoderLayer]:
        """The decoder layers, typed: a ModuleList yields nn.Module, and these are all `layer_class`'s."""
        return cast(Iterable[DFlashDecoderLayer], self.layers)

    # -- shared pieces -----------------------------------------------------------------------------------------

    def project_context(self, target_features: torch.Tensor) -> torch.Tensor:
        """Fuse concatenated target features [B,T,n*H] into one context stream [B,T,H]."""
        return self.hidden_norm(self.fc(target_features))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Token logits from final (already normed) drafter hidden states."""
        return self.student_head(hidden)

    def _rope(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's cos/sin tables at `positions`, formed once per distinct RoPE."""
        return self._per_layer(self._rope_tables(positions))

    def _rope_tables(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The cos/sin tables of each distinct RoPE at `positions`."""
        dtype = self.fc.weight.dtype
        return [rope_cos_sin(positions, self.config.head_dim, rope["rope_theta"], dtype) if scaled is None else
                scaled_cos_sin(positions, *scaled, dtype)
                for rope, scaled in zip(self._ropes, self._rope_frequencies)]

    def _per_layer(self, tables: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's tables, from the distinct RoPEs' (`_rope_tables`)."""
        return [tables[i] for i in self._rope_index]

    def context_keys_values(self, context: torch.Tensor,
                            positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's own K/V projection of the one shared context stream: the hook a family on DFlash's backbone
        (DSpark, XPress) fills its drafter cache with."""
        return [layer.self_attn.project_kv(context, cos, sin)
                for layer, (cos, sin) in zip(self._layers(), self._rope(positions))]

    def _run_blocks(
        self,
        block_ids: torch.Tensor,
        block_positions: torch.Tensor,
        context_kv: list[tuple[torch.Tensor, torch.Tensor]] | list[NewContext],
        masks: list[torch.Tensor | None] | list[BlockChunks],
        rope: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> torch.Tensor:
        """Block tokens [B,S] -> final normed hidden [B,S,H] through all layers (`masks`: one per layer; `rope`:
        each layer's tables at block_positions, formed here when None)."""
        rope = self._rope(block_positions) if rope is None else rope
        # the embedding's rows as stored, scaled by the drafter's own factor (z-lab's `_raw_input_embeddings`): a
        # target embedding that scales its rows itself (Gemma's) and the learner's plain copy of it then agree
        h = F.embedding(block_ids, self.embed_tokens.weight)
        if self.config.input_embedding_scale is not None:
            h = h * self.config.input_embedding_scale
        for layer, kv, mask, (cos, sin) in zip(self.layers, context_kv, masks, rope):
            h = layer(h, cos, sin, kv, mask)
        return self.norm(h)

    # -- training path: many blocks of one sequence in one forward -----------------------------------------------

    def forward_blocks(
        self,
        context: torch.Tensor,
        context_valid: torch.Tensor,
        block_ids: torch.Tensor,
        anchor_positions: torch.Tensor,
        chunk_rows: int = CHUNK_ROWS,
    ) -> torch.Tensor:
        """All M blocks per sequence in one forward; returns final normed hidden [B,M,K,H].

        context [B,T,H] is `project_context(features)` with context index == sequence position; block m
        (block_ids[b,m] = [anchor, MASK, ...]) sits at positions anchor_positions[b,m] + 0..K-1 and sees context
        positions p < anchor_positions[b,m] where context_valid, plus its own K positions. Blocks never see each
        other, so this equals M separate `draft` calls. Attention runs `chunk_rows` block rows at a time against
        the context they can see (`BlockChunks`), so no [M*K, T+M*K] mask is formed.
        """
        batch, num_blocks, block_size = block_ids.shape
        offsets = torch.arange(block_size, device=block_ids.device)
        block_positions = (anchor_positions[:, :, None] + offsets).reshape(batch, -1)
        context_positions = torch.arange(context.shape[1], device=context.device).expand(batch, -1)
        chunks = BlockChunks.of(context_valid, anchor_positions, block_size, chunk_rows)
        hidden = self._run_blocks(block_ids.reshape(batch, -1), block_positions,
                                  self.context_keys_values(context, context_positions),
                                  [chunks.for_layer(attention) for attention in self.attention])
        return hidden.view(batch, num_blocks, block_size, hidden.shape[-1])

    def block_hidden(self, features: torch.Tensor, context_ids: torch.Tensor, context_valid: torch.Tensor,
                     anchor_positions: torch.Tensor, block_inputs: torch.Tensor,
                     chunk_rows: int = CHUNK_ROWS) -> torch.Tensor:
        """The drafter family's training call: final normed hidden [B,M,K-1,H] at the drafted slots of blocks
        anchored at anchor_positions [B,M], given the committed text's target features [B,T,n*H]. A DFlash block
        reads only its anchor (block_inputs[..., 0]) and the context, never the text's tokens or the drafts."""
        block_ids = torch.full((*anchor_positions.shape, self.block_size), self.mask_token_id, dtype=torch.long,
                               device=anchor_positions.device)
        block_ids[..., 0] = block_inputs[..., 0]
        context = self.project_context(features.to(self.fc.weight.dtype))
        return self.forward_blocks(context, context_valid, block_ids, anchor_positions, chunk_rows)[:, :, 1:]

    forward = forward_blocks

    # -- inference path: cached context, one block per sequence --------------------------------------------------

    def new_cache(self, batch_size: int, capacity: int | None = None) -> DrafterCache:
        """An empty context cache on the drafter's device and dtype; with `capacity`, preallocated to that many
        entries (fixed shapes), else growing."""
        c = self.config
        return DrafterCache.empty(self.fc.weight, layers=len(self.layers), batch_size=batch_size,
                                  kv_heads=c.num_key_value_heads, head_dim=c.head_dim, capacity=capacity)

    @torch.no_grad()
    def extend_cache(self, cache: DrafterCache, target_features: torch.Tensor, positions: torch.Tensor,
                     valid: torch.Tensor, next_ids: torch.Tensor | None = None) -> None:
        """Append projected context K/V for new target features [B,T,n*H] at `positions` [B,T] (in place).

        Entries with valid=False (padding, holes from ragged acceptance) stay masked out forever. `next_ids` (the
        token after each position) is what a chain drafter pairs with the features; a DFlash block reads the
        context alone."""
        self.commit_context(cache)
        cache.append(self.context_keys_values(self.project_context(target_features), positions), positions, valid)

    def defer_context(self, cache: DrafterCache, target_features: torch.Tensor, positions: torch.Tensor,
                      valid: torch.Tensor, next_ids: torch.Tensor | None = None) -> None:
        """`extend_cache`, with the projection left to the next draft (`DrafterCache.defer`), which runs it in the
        same forward as its block: one drafter forward per decoding step, as z-lab's, and the same cache."""
        self.commit_context(cache)
        cache.defer(target_features, positions, valid)

    @torch.no_grad()
    def commit_context(self, cache: DrafterCache) -> None:
        """Project and write any context still pending (none: nothing to do), for a cache no draft will fold."""
        pending = cache.take_pending()
        if pending is None:
            return
        context_kv = self.context_keys_values(per_row(self.project_context, pending.features), pending.positions)
        for layer, (k, v) in enumerate(context_kv):
            cache.write(pending, layer, k, v)

    @torch.no_grad()
    def draft(
        self, cache: DrafterCache, anchor_ids: torch.Tensor, anchor_positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy K-1 draft tokens [B,K-1] and their logits [B,K-1,V] for one block per sequence."""
        hidden, logits = self.drafted_slots(cache, anchor_ids, anchor_positions)
        return self.choose(hidden, logits, anchor_ids), logits

    @torch.no_grad()
    def drafted_slots(
        self, cache: DrafterCache, anchor_ids: torch.Tensor, anchor_positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Final hidden [B,K-1,H] and logits [B,K-1,V] of one block's drafted slots per sequence.

        The block [anchor, MASK x (K-1)] at anchor_pos..anchor_pos+K-1 sees every valid cached entry with
        position < anchor_pos and itself; its own K/V are not added to the cache.
        """
        block_size = self.config.block_size
        block_ids = torch.full(
            (anchor_ids.shape[0], block_size), self.config.mask_token_id, dtype=torch.long, device=anchor_ids.device
        )
        block_ids[:, 0] = anchor_ids
        hidden = self.cached_blocks(cache, block_ids, anchor_positions)[:, 1:]
        return hidden, per_row(self.logits, hidden)

    def cached_blocks(self, cache: DrafterCache, block_ids: torch.Tensor, anchor_positions: torch.Tensor
                      ) -> torch.Tensor:
        """The hook a family on DFlash's backbone drafts through (DSpark, XPress): the final normed hidden [B,S,H] of one block [B,S] per row at anchor_positions.., attending to the cache;
        pending context is projected in the same forward (`NewContext`) and written to the cache."""
        block_positions = anchor_positions[:, None] + torch.arange(block_ids.shape[1], device=block_ids.device)
        pending = cache.take_pending()
        masks = _block_masks(cache, anchor_positions, block_ids.shape[1], self.attention)
        if pending is None:  # tables [B,1,S,d]: one broadcast for every layer
            return self._run_blocks(block_ids, block_positions, list(zip(cache.keys, cache.values)), masks,
                                    self._per_layer(self._rope_tables(block_positions[:, None])))
        # One table over [context; block], as z-lab's drafter forms it, and the block's is its tail: each element of
        # cos and sin is a function of its own angle alone (tests/test_deferred_context.py holds every draft and
        # cache entry to the eager extension's, whose context and block tables are formed apart).
        tables = self._rope_tables(torch.cat([pending.positions, block_positions], 1)[:, None])
        block_tables = [(cos[:, :, pending.width :], sin[:, :, pending.width :]) for cos, sin in tables]
        context = per_row(self.project_context, pending.features)
        layers = [NewContext(context, cos, sin, cache, pending, i)
                  for i, (cos, sin) in enumerate(self._per_layer(tables))]
        return self._run_blocks(block_ids, block_positions, layers, masks, self._per_layer(block_tables))

    def choose(self, hidden: torch.Tensor, logits: torch.Tensor, anchor_ids: torch.Tensor) -> torch.Tensor:
        """The point-mass drafts [B,K-1] of a block from its slots' hidden and logits: DFlash drafts every slot's
        argmax independently (DFlash 2's selector chains them)."""
        return logits.argmax(dim=-1)

    # -- checkpoints ---------------------------------------------------------------------------------------------

    def save_pretrained(self, directory: str | Path) -> None:
        """Write config.json + model.safetensors in the public DFlash layout (no embedding, no LM head)."""
        write_checkpoint(directory, self.config, self.state_dict(), self.fc.weight.dtype)

    @classmethod
    def from_pretrained(cls, directory: str | Path | ModelDir, target: Target | SharedHead) -> DFlashDrafter:
        """Load a public-layout DFlash checkpoint for `target` (a path, or the directory already read); any mismatch
        raises a one-line OpdError."""
        model_dir = directory if isinstance(directory, ModelDir) else ModelDir.read(directory, "drafter")
        drafter = cls(read_config(model_dir, target, cls.config_class), target.embed_tokens, target.lm_head,
                      teacher_head(target))
        drafter.load_state_dict(read_tensors(model_dir.path / WEIGHTS_FILE, drafter.state_dict()))
        return drafter


def _block_masks(cache: DrafterCache, anchor_positions: torch.Tensor, block_size: int,
                 attention: list[LayerAttention]) -> list[torch.Tensor | None]:
    """Bool masks [B,1,K,C+K] for one block per row (decoding), one per layer: the block sees the cached context
    it may (`DrafterCache.visible_before`) and all of itself, narrowed by each layer's rule (built once per rule).
    Where every layer is plain and the cache `dense`, a block sees every key: no masks (None), as z-lab runs it."""
    if cache.dense and all(rule.plain for rule in attention):
        return [None] * len(attention)
    sees_context = cache.visible_before(anchor_positions)[:, None, :].expand(-1, block_size, -1)
    base = torch.cat([sees_context, sees_context.new_ones(len(sees_context), block_size, block_size)], dim=-1)
    query = anchor_positions[:, None] + torch.arange(block_size, device=anchor_positions.device)  # [B,K]
    keys = torch.cat([cache.positions, query], dim=1)  # [B,C+K]
    masks: dict[LayerAttention, torch.Tensor] = {}
    for rule in attention:
        if rule not in masks:
            masks[rule] = base if rule.plain else base & rule.sees(query[:, :, None], keys[:, None, :])
    return [masks[rule][:, None] for rule in attention]


@drafter_family
class DFlashFamily(DrafterFamily):
    """DFlash (z-lab's `DFlashDraftModel`): the public DFlash format, vLLM's and SGLang's `method: dflash`."""

    section = DFlashSpec
    public_layout: ClassVar[PublicLayout] = "zlab"
    drafter_class: type[DFlashDrafter] = DFlashDrafter

    def config(self, section: DFlashSpec, base: Target | SharedHead, tokenizer: Any) -> DFlashConfig:
        """A random drafter's config: the target's shape, the section's depth and block, the tokenizer's mask."""
        return DFlashConfig.for_target(base.config, num_layers=section.num_layers, block_size=section.block_size,
                                       mask_token_id=mask_token_id(tokenizer, section.mask_token_id),
                                       target_layer_ids=base.layer_ids,
                                       input_embedding_scale=embedding_scale(base.embed_tokens),
                                       rope_theta=section.rope_theta,
                                       max_position_embeddings=section.max_position_embeddings,
                                       intermediate_size=section.intermediate_size)

    def initial(self, section: DFlashSpec, base: Target | SharedHead, tokenizer: Any) -> DFlashDrafter:
        config = self.config(section, base, tokenizer)
        return self.drafter_class(config, base.embed_tokens, base.lm_head, teacher_head(base)).to(base.device)

    def load(self, directory: ModelDir, base: Target | SharedHead, section: DFlashSpec) -> DFlashDrafter:
        return self.drafter_class.from_pretrained(directory, base).to(base.device)

    def target_layer_ids(self, directory: ModelDir, num_target_layers: int) -> list[int]:
        return self.drafter_class.config_class.from_hf_dict(directory.config, num_target_layers).target_layer_ids

    def check_initial(self, section: DFlashSpec, tokenizer: Any, target: TargetShape) -> None:
        """The mask token, and every target field the fresh drafter copies (named at once where missing)."""
        mask = mask_token_id(tokenizer, section.mask_token_id)
        DFlashConfig.for_target(target.config, num_layers=section.num_layers or 1, block_size=section.block_size,
                                mask_token_id=mask, target_layer_ids=target.layer_ids or None,
                                rope_theta=section.rope_theta, max_position_embeddings=section.max_position_embeddings,
                                intermediate_size=section.intermediate_size)

    def expected_shapes(self, directory: ModelDir, target: TargetShape, section: DFlashSpec) -> Shapes:
        """A drafter built on the meta device gives the shapes without allocating them."""
        config = read_config(directory, target, self.drafter_class.config_class)
        with torch.device("meta"):
            shared = nn.Embedding(config.vocab_size, config.hidden_size), nn.Linear(config.hidden_size,
                                                                                     config.vocab_size, bias=False)
            drafter = self.drafter_class(config, *shared)
        return {k: tuple(v.shape) for k, v in drafter.state_dict().items()}, (
            lambda name: name.endswith(SHARED_TENSOR_SUFFIXES))

    def served_block_size(self, directory: ModelDir, target: TargetShape | None, section: DFlashSpec) -> int:
        """The engines capture the target layers the config names and run its layers as z-lab's code does."""
        config = self.drafter_class.config_class.from_hf_dict(directory.config,
                                                              None if target is None else target.num_layers)
        check_vllm_capturable(config)
        if target is not None and (config.hidden_size, config.num_target_layers) != (target.hidden_size,
                                                                                     target.num_layers):
            raise OpdError(f"drafts for a target of hidden size {config.hidden_size} with {config.num_target_layers} "
                           f"layers, but the target has hidden size {target.hidden_size} with {target.num_layers} "
                           "layers")
        return config.block_size

    def vllm_config(self, directory: ModelDir, block_size: int) -> dict[str, Any]:
        return {"method": "dflash", "model": str(directory.path), "num_speculative_tokens": block_size - 1}

    def save_speculators(self, drafter: Any, directory: str | Path, verifier: str | None) -> None:
        """The same tensors under speculators' config.json: its converter reads z-lab's DFlash layout but not
        DFlash 2's, so the DFlash families write speculators' own."""
        architectures = [] if verifier is None else ModelDir.read(verifier, "target").architectures
        write_speculators(directory, drafter.config, drafter.state_dict(), drafter.fc.weight.dtype, verifier,
                          architectures)
