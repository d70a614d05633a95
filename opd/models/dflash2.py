"""The DFlash 2 drafter (z-lab's `DFlash2DraftModel`, dflash 0.1.0): DFlash with causal convolutions along each
block and a candidate selector that chains the block's drafts.

Why a subclass of `DFlashDrafter` rather than a third family: DFlash 2 keeps DFlash's context injection, block
layout, cache, checkpoint format and training call (`block_hidden`) unchanged, and adds two things inside them. So
it plugs into the one family interface (opd/models/protocol.py) as a DFlash drafter whose layers are
`DFlash2DecoderLayer` and whose `choose` is the selector's path; nothing of DFlash's model code is repeated.

* Convolutions (`BlockConvolution`). Each layer convolves its normed input before attention and before the MLP,
  causally along the block's own positions (a block never sees another block, in decoding as in training):
  out[t] = sum over taps j of (base[j] + dynamic[t, j, group]) * x[t - j], where the dynamic tap of each channel
  group is projected from the current position's input. The same projection also gives the taps of a second pass,
  applied to the attention's (or MLP's) output with the second base kernel.
* Selector (`CandidateSelector`). Slot s keeps the top-k of its logits as candidates; candidate c scores
  logit(c) + <P[prev] * W h_s, S[c]>, with `prev` the draft of slot s-1 (the anchor for slot 1), P and S the
  predecessor and successor codebooks over the vocabulary and W h_s the slot's hidden projected to their rank.
  Greedy drafts are the argmax path left to right, so each draft depends on the one before it. They are still a
  point mass per block given (context, anchor), which is what lossless point-mass verification, the rebuild and
  offline τ rely on (opd/sources/rebuild.py). Sampled drafts (`draft: sample`, z-lab's `select` at T > 0) walk
  the same path with a different `pick`: slot s draws from q_s = softmax(scores / T) over its candidates given the
  draft drawn at slot s-1 (opd/decoding/verify.py, `sample_chained_draft`).

Training: Draft-OPD and SFT train a DFlash 2 drafter as they train DFlash, with the paper's loss (Eqs. 10-13) or
SFT's cross-entropy on the drafter's logits, through the same `block_hidden` (the drafter's layers and convolutions
see the block's mask tokens, not its drafts, so a slot's student logits are the drafter's distribution there given
the context and anchor, as for DFlash). The rollout's blocks, acceptance and rejected stream are the selector's
path, so γ and the rejected-stream terms mean what they mean for DFlash. The selector's q lives on k candidates,
where a full-vocabulary KL is infinite, so it has a term of its own (opd/distill/selector_loss.py,
`loss.selector_weight`; 0 freezes it: the family's terms' `prepare`, opd/distill/family_terms.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from opd.formats.checkpoint import TargetShape
from opd.formats.dflash import DFlashConfig, DFlashSpec
from opd.formats.dflash2 import DFlash2Config, DFlash2Spec, check_dflash2_fields
from opd.models.dflash import DFlashDecoderLayer, DFlashDrafter, DFlashFamily, NewContext
from opd.models.drafter_cache import DrafterCache
from opd.models.family import drafter_family
from opd.models.packed_attention import BlockChunks
from opd.models.shared_head import SharedHead
from opd.models.target import Target

PASSES = 2  # the convolution before a sublayer and the one after it

Pick = Callable[[int, torch.Tensor], torch.Tensor]  # (slot, candidate scores [B,k]) -> candidate index [B]


class BlockConvolution(nn.Module):
    """A grouped dynamic causal convolution along each block of `block_size` positions (tensor names as z-lab's
    `GroupedDynamicCausalConv`: `base_kernel` [2, taps, H], `kernel_projection` H -> 2 * taps * groups)."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        own = cast(DFlash2Config, config)  # the layer class of DFlash 2 drafters alone
        self.taps, self.group_size, self.block_size = own.conv_kernel_size, own.conv_group_size, config.block_size
        groups = config.hidden_size // self.group_size
        # Starts as the identity (tap 0 is 1): a fresh DFlash 2 layer is a DFlash layer plus the dynamic taps.
        base = torch.zeros(PASSES, self.taps, config.hidden_size)
        base[:, 0] = 1.0
        self.base_kernel = nn.Parameter(base)
        self.kernel_projection = nn.Linear(config.hidden_size, PASSES * self.taps * groups, bias=False)

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x convolved by the first pass, the second pass's dynamic taps); x [B,S,H] holds whole blocks."""
        dynamic = self.kernel_projection(x).unflatten(-1, (PASSES, self.taps, -1))  # [B,S,2,taps,groups]
        return self._convolve(x, dynamic[..., 0, :, :], 0), dynamic[..., 1, :, :]

    def finish(self, x: torch.Tensor, dynamic: torch.Tensor) -> torch.Tensor:
        """The second pass over a sublayer's output x [B,S,H] with the taps `prepare` projected."""
        return self._convolve(x, dynamic, 1)

    def _convolve(self, x: torch.Tensor, dynamic: torch.Tensor, pass_index: int) -> torch.Tensor:
        """out[t] = sum_j (base[j] + dynamic[t, j]) * x[t - j], within each block (positions before its start are
        zero). Accumulated tap by tap, base term then dynamic term, as z-lab sums them, so greedy drafts agree bit
        for bit; each shifted tap reads a zero-padded copy of the block (z-lab's own form), so every tap is three
        whole-tensor operations and a draft's eight convolutions stay a few dozen dispatches."""
        batch, length, hidden = x.shape
        shape = (batch, length // self.block_size, self.block_size, hidden // self.group_size, self.group_size)
        blocks = x.view(shape)
        taps = dynamic.reshape(*shape[:3], self.taps, shape[3], 1).unbind(3)
        base = self.base_kernel[pass_index].view(self.taps, *shape[3:])
        bases = (base if base.dtype == x.dtype else base.to(x.dtype)).unbind(0)
        out = torch.addcmul(bases[0] * blocks, taps[0], blocks)
        for j in range(1, min(self.taps, self.block_size)):  # a tap past the block's length reads only zeros
            shifted = F.pad(blocks[:, :, :-j], (0, 0, 0, 0, j, 0))
            out = torch.addcmul(out + bases[j] * shifted, taps[j], shifted)
        return out.view_as(x)


class DFlash2DecoderLayer(DFlashDecoderLayer):
    """A DFlash layer with a convolution around attention and around the MLP (z-lab's `Qwen3DFlashDecoderLayer`
    with `attention_conv` and `mlp_conv`)."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__(config)
        self.attention_conv = BlockConvolution(config)
        self.mlp_conv = BlockConvolution(config)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                context_kv: tuple[torch.Tensor, torch.Tensor] | NewContext,
                mask: torch.Tensor | BlockChunks | None) -> torch.Tensor:
        x, taps = self.attention_conv.prepare(self.input_layernorm(h))
        h = h + self.attention_conv.finish(self.self_attn(x, cos, sin, context_kv, mask), taps)
        x, taps = self.mlp_conv.prepare(self.post_attention_layernorm(h))
        return h + self.mlp_conv.finish(self.mlp(x), taps)


class CandidateSelector(nn.Module):
    """The top-k candidates of each slot, scored against the draft before it through low-rank codebooks gated by
    the slot's hidden. The codebooks are plain parameters, so they save without a `.weight` suffix, as z-lab's
    published checkpoints store them."""

    def __init__(self, config: DFlash2Config, std: float = 0.02) -> None:
        super().__init__()
        rank, self.top_k = config.selector_rank, config.selector_top_k
        self.hidden_projection = nn.Linear(config.hidden_size, rank, bias=False)
        self.predecessor_codebook = nn.Parameter(torch.randn(config.vocab_size, rank) * std)
        self.successor_codebook = nn.Parameter(torch.randn(config.vocab_size, rank) * std)
        nn.init.normal_(self.hidden_projection.weight, std=std)

    def scores(self, gate: torch.Tensor, predecessor: torch.Tensor, unary: torch.Tensor,
               candidates: torch.Tensor) -> torch.Tensor:
        """One slot's candidate scores [B,k]: logits `unary` [B,k] of `candidates` [B,k] plus their interaction
        with `predecessor` [B] through the gate [B,rank]."""
        query = self.predecessor_codebook[predecessor] * gate  # [B,rank]
        return unary + (self.successor_codebook[candidates] @ query[:, :, None])[..., 0]

    def argmax_path(self, hidden: torch.Tensor, logits: torch.Tensor, anchor_ids: torch.Tensor) -> torch.Tensor:
        """Greedy drafts [B,S] for slots' hidden [B,S,H] and logits [B,S,V]: slot by slot, the best-scoring
        candidate given the draft chosen before it (the anchor first). The best candidate after every possible
        predecessor is one argmax over the score table (`pair_scores`), so the walk is only index lookups."""
        pairs, candidates = self.pair_scores(hidden, logits, anchor_ids)
        best = pairs.argmax(-1)  # [B,S,k]: per slot, the best candidate after each of the predecessors
        picks = [best[:, 0, :1]]  # slot 0's predecessor is the anchor (row 0)
        for slot in range(1, hidden.shape[1]):
            picks.append(best[:, slot].gather(1, picks[-1]))
        return candidates.gather(-1, torch.cat(picks, dim=1)[..., None])[..., 0]

    def pair_scores(self, hidden: torch.Tensor, logits: torch.Tensor, anchor_ids: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(scores [B,S,k,k], candidates [B,S,k]): every score a walk can ask for, formed in one batched matmul.
        A slot's predecessor is the anchor (slot 0) or one of the previous slot's k candidates, so scores[b, s, i, j]
        is candidate j of slot s after candidate i of slot s-1; slot 0's k rows all score after the anchor."""
        # Sorted: an unsorted top-k orders a row's candidates by the shape of the whole tensor, and a sampled draft's
        # token is the candidate its keyed uniform falls on, so it would depend on the batch.
        unary, candidates = logits.topk(self.top_k, dim=-1)
        gates = self.hidden_projection(hidden.to(self.hidden_projection.weight.dtype))  # [B,S,rank]
        before = torch.cat([anchor_ids[:, None, None].expand(-1, 1, self.top_k), candidates[:, :-1]], dim=1)
        queries = F.embedding(before, self.predecessor_codebook) * gates[:, :, None, :]  # [B,S,k,rank]
        successors = F.embedding(candidates, self.successor_codebook).transpose(-1, -2)  # [B,S,rank,k]
        return unary[:, :, None, :] + queries @ successors, candidates

    def path(self, hidden: torch.Tensor, logits: torch.Tensor, anchor_ids: torch.Tensor, pick: Pick
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """(drafts [B,S], candidates [B,S,k]): slot by slot, `pick(slot, scores [B,k])` chooses a candidate index
        [B] given the draft chosen before it (the anchor first), and that draft is the next slot's predecessor.
        The scores come from `pair_scores`, so the walk is a row lookup and a pick per slot."""
        pairs, candidates = self.pair_scores(hidden, logits, anchor_ids)
        index, picks = torch.zeros_like(anchor_ids)[:, None, None].expand(-1, 1, self.top_k), []
        for slot in range(hidden.shape[1]):
            picks.append(pick(slot, pairs[:, slot].gather(1, index)[:, 0]))
            index = picks[-1][:, None, None].expand(-1, 1, self.top_k)
        return candidates.gather(-1, torch.stack(picks, dim=1)[..., None])[..., 0], candidates

    def flops_per_slot(self) -> int:
        """One slot's selector work: the hidden projection (2·rank·H), the gate (rank) and k candidate dot
        products plus their logits (k·(2·rank + 1)); top-k and codebook lookups are not multiply-adds."""
        rank, hidden = self.hidden_projection.weight.shape
        return 2 * rank * hidden + rank + self.top_k * (2 * rank + 1)


class DFlash2Drafter(DFlashDrafter):
    """DFlash 2: DFlash layers with block convolutions, drafts chained by the candidate selector."""

    kind = "dflash2"

    layer_class = DFlash2DecoderLayer
    config_class = DFlash2Config
    chains_q = True  # the selector scores slot s's candidates given the draft at slot s-1

    def __init__(self, config: DFlashConfig, embed_tokens: nn.Embedding, lm_head: nn.Linear,
                 teacher: nn.Module | None = None) -> None:
        super().__init__(config, embed_tokens, lm_head, teacher)
        self.candidate_selector = CandidateSelector(cast(DFlash2Config, config))
        self.to(device=embed_tokens.weight.device, dtype=embed_tokens.weight.dtype)

    @property
    def selector(self) -> CandidateSelector:
        return self.candidate_selector

    def draft_law(self, hidden: torch.Tensor, logits: torch.Tensor, predecessors: torch.Tensor,
                  temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        """softmax(scores / T) over the slot's top-k candidates, scored given the draft before it (what
        `sample_chained_draft` draws from)."""
        selector = self.candidate_selector
        unary, ids = logits.topk(selector.top_k, dim=-1)
        gate = selector.hidden_projection(hidden.to(selector.hidden_projection.weight.dtype))
        scores = selector.scores(gate.flatten(0, -2), predecessors.flatten(), unary.flatten(0, -2).to(gate.dtype),
                                 ids.flatten(0, -2))
        dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
        return torch.softmax(scores.to(dtype) / temperature, dim=-1).view_as(unary), ids

    def choose(self, hidden: torch.Tensor, logits: torch.Tensor, anchor_ids: torch.Tensor) -> torch.Tensor:
        """The selector's argmax path."""
        return self.candidate_selector.argmax_path(hidden, logits, anchor_ids)

    @torch.no_grad()
    def draft_path(self, cache: DrafterCache, anchor_ids: torch.Tensor, anchor_positions: torch.Tensor,
                   pick: Pick) -> tuple[torch.Tensor, torch.Tensor]:
        """(drafts [B,K-1], candidates [B,K-1,k]) of one block per sequence, each slot's candidate chosen by
        `pick` given the draft before it (`CandidateSelector.path`)."""
        hidden, logits = self.drafted_slots(cache, anchor_ids, anchor_positions)
        return self.candidate_selector.path(hidden, logits, anchor_ids, pick)

    def modules_by_role(self) -> tuple[list[nn.Module], list[nn.Module], nn.Linear]:
        """DFlash's roles, the convolutions' projections with the layers; their base kernels are elementwise taps,
        counted in `extra_flops`, and the selector per slot there too (its codebooks are lookups, not weights a
        token passes through)."""
        context, _, head = super().modules_by_role()
        layers = cast(Iterable[DFlash2DecoderLayer], self._layers())  # this family's layer_class
        block = [m for layer in layers for m in (layer.self_attn, layer.mlp, layer.input_layernorm,
                                                  layer.post_attention_layernorm,
                                                  layer.attention_conv.kernel_projection,
                                                  layer.mlp_conv.kernel_projection)]
        return context, [*block, self.norm], head

    def extra_flops(self) -> tuple[int, int]:
        """(FLOPs per block token, per drafted slot) that no weight matrix accounts for: each convolution's two
        passes multiply-add a base and a dynamic tap per channel and tap (2 · 2 · 2 · taps · H per convolution,
        two per layer), and the selector."""
        c = cast(DFlash2Config, self.config)
        per_token = len(self.layers) * 2 * PASSES * 2 * 2 * c.conv_kernel_size * c.hidden_size
        return per_token, self.candidate_selector.flops_per_slot()


@drafter_family
class DFlash2Family(DFlashFamily):
    """DFlash 2 (z-lab's `DFlash2DraftModel`): the DFlash format with its four `dflash_config` fields."""

    section = DFlash2Spec
    drafter_class = DFlash2Drafter

    def config(self, section: DFlashSpec, base: Target | SharedHead, tokenizer: Any) -> DFlashConfig:
        return DFlash2Config.of(super().config(section, base, tokenizer), cast(DFlash2Spec, section).fields)

    def check_initial(self, section: DFlashSpec, tokenizer: Any, target: TargetShape) -> None:
        super().check_initial(section, tokenizer, target)
        check_dflash2_fields(cast(DFlash2Spec, section).fields, target.hidden_size, target.vocab_size,
                             "models.drafter.{}")
