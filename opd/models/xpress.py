"""The XPress drafter (arXiv 2608.02438; speculators' `XPressDraftModel`, 0.9.0): a DFlash backbone whose causal
refiner head adds a bias to the block's logits, resolved by K Jacobi passes.

Why a subclass of `DFlashDrafter`: XPress keeps DFlash's context injection, layers, fill-in block [anchor, MASK x
(K-1)] and cache, and adds one head after them (as DSpark adds its Markov head). So it plugs into the one family
interface (opd/models/protocol.py) as a DFlash drafter whose drafts go through the refiner:

* Refiner (`RefinerHead`, speculators' tensor names). Slot k of a block reads its final hidden h_k, the block's
  mean hidden g and the embedding of the token before its prediction (slot 0: the token before the anchor; slot
  1: the anchor; slot k: slot k-1's draft), fuses them in rank r (`in_proj([down_h h_k; down_g g; token_embed
  x_k])`), mixes the block causally (slot k adds sum_{j<=k} L[:, k, j] * slot j, L lower-triangular per rank
  channel), adds a SwiGLU MLP, and `readout` gives the bias on the LM head's logits.
* Jacobi passes. The seed is the LM head's argmax at every slot; each of the K passes feeds the refiner the previous
  pass's argmax as the tokens before the slots, and the drafts are the argmax after pass K. The drafts are a point
  mass per block given (context, anchor, the token before it), so the rebuild and replay hold; no sampled law is
  defined, so `serving.draft: sample` is refused (opd/formats/xpress.py).
* The token before the anchor is the committed text's. Decoding keeps each cache entry's next token
  (`reads_next_ids`; the cache's `states`), so a block anchored at a reads it from the entry at a-2; an anchor at
  position 0 or 1 has none there, and there (as speculators does where the anchor starts its document) the anchor
  stands in for it, in decoding and training alike.

Training: `block_hidden` runs the block and the same K passes on the committed text (the passes before the last
without gradient, as speculators' consistency rounds stop it), and returns each drafted slot's hidden with its
last pass's refiner output appended ([h_k; x_k]); `student_head` is lm_head(h) + readout(x). So Draft-OPD's loss
and SFT's cross-entropy read the logits the drafts are the argmax of (the draft law), and train the backbone and
the refiner together. There is no separately trained selector and no term of the family's own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from opd.formats.dflash import DFlashConfig, DFlashSpec, write_speculators
from opd.formats.xpress import DEFAULTS, XPressConfig, XPressSpec
from opd.model_dir import ModelDir
from opd.models.biased_logits import BiasedLogits
from opd.models.dflash import DFlashDrafter, DFlashFamily
from opd.models.drafter_cache import DrafterCache
from opd.models.family import drafter_family
from opd.models.lm_head import SLOTS_PER_CHUNK
from opd.models.packed_attention import CHUNK_ROWS
from opd.models.shared_head import SharedHead
from opd.models.target import Target


class RefinerHead(nn.Module):
    """speculators' `XPressRefinerHead`: its tensor names and its initialisation (normal(0, 0.02) weights, the
    mixer at zero, so a fresh head adds only its readout of the fused inputs)."""

    causal: torch.Tensor

    def __init__(self, config: XPressConfig) -> None:
        super().__init__()
        r, hidden, block = config.xpress_rank, config.hidden_size, config.block_size
        self.token_embed = nn.Embedding(config.vocab_size, r)
        self.down_h = nn.Linear(hidden, r, bias=False)
        self.down_g = nn.Linear(hidden, r, bias=False)
        self.in_proj = nn.Linear(3 * r, r, bias=False)
        self.mix_l = nn.Parameter(torch.zeros(r, block, block))
        self.mlp_gate = nn.Linear(r, r * config.xpress_mlp_ratio, bias=False)
        self.mlp_up = nn.Linear(r, r * config.xpress_mlp_ratio, bias=False)
        self.mlp_down = nn.Linear(r * config.xpress_mlp_ratio, r, bias=False)
        self.readout = nn.Linear(r, config.vocab_size, bias=False)
        self.register_buffer("causal", torch.tril(torch.ones(block, block)), persistent=False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)

    def summary(self, hidden: torch.Tensor) -> torch.Tensor:
        """[down_h h_k; down_g g] [..., K, 2r] of a block's hidden [..., K, H]: the same in every pass."""
        hidden = hidden.to(self.down_h.weight.dtype)
        mean = hidden.mean(dim=-2, keepdim=True).expand_as(hidden)
        return torch.cat([self.down_h(hidden), self.down_g(mean)], dim=-1)

    def mixed(self, summary: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        """The refiner's output [..., K, r] given the tokens before each slot's prediction `previous` [..., K]."""
        x = self.in_proj(torch.cat([summary, self.token_embed(previous).to(summary.dtype)], dim=-1))
        x = x + torch.einsum("ckj,...jc->...kc", self.mix_l * self.causal.to(self.mix_l.dtype), x)
        return x + self.mlp_down(F.silu(self.mlp_gate(x)) * self.mlp_up(x))

    def flops(self, hidden_size: int, block_size: int, passes: int) -> tuple[int, int]:
        """(per block token, per drafted slot) multiply-adds x 2: the summary once; each pass's fusion, mixer and
        MLP per token and its readout per drafted slot."""
        r, wide = self.in_proj.weight.shape[0], self.mlp_down.weight.shape[1]
        per_pass = 2 * 3 * r * r + 2 * r * block_size + 2 * 3 * r * wide
        return 2 * 2 * hidden_size * r + passes * per_pass, passes * 2 * r * self.readout.weight.shape[0]


class XPressDrafter(DFlashDrafter):
    """XPress: DFlash layers over the fill-in block, its drafts the argmax after K refiner passes."""

    kind = "xpress"

    config_class = XPressConfig
    chains_q = False  # no sampled law: the drafts are the argmax of the logits `draft` returns
    reads_next_ids = True  # the cache keeps each entry's next token: the token before an anchor

    def __init__(self, config: DFlashConfig, embed_tokens: nn.Embedding, lm_head: nn.Linear,
                 teacher: nn.Module | None = None) -> None:
        super().__init__(config, embed_tokens, lm_head, teacher)
        self.refiner_head = RefinerHead(cast(XPressConfig, config))
        self._base_head = self._student_head  # the LM head (with a variant's transform), before the refiner's bias
        self._student_head: tuple[nn.Module] = (BiasedLogits(self._base_head[0], self.refiner_head.readout,
                                                              config.hidden_size),)
        self.to(device=embed_tokens.weight.device, dtype=embed_tokens.weight.dtype)

    @property
    def passes(self) -> int:
        return cast(XPressConfig, self.config).jacobi_passes

    def extra_flops(self) -> tuple[int, int]:
        """The refiner's (`RefinerHead.flops`); the LM head's logits are formed once, the seed's."""
        return self.refiner_head.flops(self.config.hidden_size, self.block_size, self.passes)

    # -- the refiner's passes ----------------------------------------------------------------------------------

    def refine(self, hidden: torch.Tensor, before: torch.Tensor, anchors: torch.Tensor,
               base: torch.Tensor | None = None) -> torch.Tensor:
        """The last pass's refiner output [..., K, r] for blocks of final hidden [..., K, H], the token before each
        anchor `before` [...] and the anchors [...]: K passes from the LM head's argmax, each fed the previous
        pass's argmax (no gradient flows between passes). `base`: the drafted slots' LM-head logits [..., K-1, V]
        where they are at hand (decoding); else they are formed a chunk of blocks at a time (training: no
        [slots, V] tensor of every block is kept), once per block as in decoding."""
        summary = self.refiner_head.summary(hidden)
        with torch.no_grad():
            if base is not None:
                drafts = self._drafts_before_last(summary, before, anchors, base)
            else:
                drafts = self._chunked_drafts(hidden, summary, before, anchors)
        return self.refiner_head.mixed(summary, self._previous(before, anchors, drafts))

    def _drafts_before_last(self, summary: torch.Tensor, before: torch.Tensor, anchors: torch.Tensor,
                            base: torch.Tensor) -> torch.Tensor:
        """The argmax [..., K-1] after K-1 passes: what the last pass is fed. A pass that gives back the tokens it
        was fed is a fixed point (every later pass is fed the same tokens), so the passes stop there, exactly."""
        drafts = base.argmax(-1)
        for _ in range(self.passes - 1):
            refined = self.refiner_head.mixed(summary, self._previous(before, anchors, drafts))
            fed, drafts = drafts, self.biased(base, refined[..., 1:, :]).argmax(-1)
            if torch.equal(fed, drafts):
                break
        return drafts

    def _chunked_drafts(self, hidden: torch.Tensor, summary: torch.Tensor, before: torch.Tensor,
                        anchors: torch.Tensor) -> torch.Tensor:
        """`_drafts_before_last` over blocks [..., K, H] a chunk of blocks at a time, each chunk's LM-head logits
        formed once."""
        k, lead = self.block_size, hidden.shape[:-2]
        hidden, summary = hidden.reshape(-1, k, hidden.shape[-1]), summary.reshape(-1, k, summary.shape[-1])
        before, anchors = before.reshape(-1), anchors.reshape(-1)
        step, head = max(1, SLOTS_PER_CHUNK // (k - 1)), self._base_head[0]
        out = [self._drafts_before_last(summary[i : i + step], before[i : i + step], anchors[i : i + step],
                                        head(hidden[i : i + step, 1:]))
               for i in range(0, len(hidden), step)]
        return torch.cat(out).reshape(*lead, k - 1)

    def biased(self, base: torch.Tensor, refined: torch.Tensor) -> torch.Tensor:
        """LM-head logits [..., V] plus the readout of the refiner's output [..., r]: what `student_head` forms."""
        readout = self.refiner_head.readout
        return base + readout(refined.to(readout.weight.dtype)).to(base.dtype)

    @staticmethod
    def _previous(before: torch.Tensor, anchors: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
        """The token before each slot's prediction [..., K]: the one before the anchor, the anchor, the drafts."""
        return torch.cat([before[..., None], anchors[..., None], drafts[..., :-1]], dim=-1)

    @staticmethod
    def _rows(hidden: torch.Tensor, refined: torch.Tensor) -> torch.Tensor:
        """[h; x] rows, what the student head reads."""
        return torch.cat([hidden, refined.to(hidden.dtype)], dim=-1)

    def _block(self, anchors: torch.Tensor) -> torch.Tensor:
        """[anchor, MASK x (K-1)] per anchor [...]."""
        block = anchors.new_full((*anchors.shape, self.block_size), self.mask_token_id)
        block[..., 0] = anchors
        return block

    # -- training ----------------------------------------------------------------------------------------------

    def block_hidden(self, features: torch.Tensor, context_ids: torch.Tensor, context_valid: torch.Tensor,
                     anchor_positions: torch.Tensor, block_inputs: torch.Tensor,
                     chunk_rows: int = CHUNK_ROWS) -> torch.Tensor:
        """[h_k; x_k] [B,M,K-1,H+r] at every drafted slot of blocks anchored at anchor_positions [B,M]: the
        backbone's final hidden and the last Jacobi pass's refiner output, the passes run as decoding runs them on
        the committed text context_ids [B,T] (which gives the token before each anchor)."""
        anchors = block_inputs[..., 0]
        context = self.project_context(features.to(self.fc.weight.dtype))
        hidden = self.forward_blocks(context, context_valid, self._block(anchors), anchor_positions, chunk_rows)
        before_pos = (anchor_positions - 1).clamp(min=0)
        known = (anchor_positions >= 2) & context_valid.gather(1, before_pos)
        before = torch.where(known, context_ids.gather(1, before_pos), anchors)
        refined = self.refine(hidden, before, anchors)
        return self._rows(hidden[:, :, 1:], refined[:, :, 1:])

    # -- inference ---------------------------------------------------------------------------------------------

    def new_cache(self, batch_size: int, capacity: int | None = None) -> DrafterCache:
        """DFlash's cache, whose `states` [B,L,1] keep each entry's next token."""
        cache = super().new_cache(batch_size, capacity)
        cache.states = cache.positions.new_zeros(batch_size, capacity or 0, 1)
        return cache

    @torch.no_grad()
    def extend_cache(self, cache: DrafterCache, target_features: torch.Tensor, positions: torch.Tensor,
                     valid: torch.Tensor, next_ids: torch.Tensor | None = None) -> None:
        """DFlash's context K/V, and each entry's next token (`next_ids` [B,T], which XPress needs)."""
        if next_ids is None:
            raise ValueError("an XPress block reads the token before its anchor: pass next_ids")
        cache.append(self.context_keys_values(self.project_context(target_features), positions), positions, valid,
                     next_ids[..., None].to(torch.long))

    def defer_context(self, cache: DrafterCache, target_features: torch.Tensor, positions: torch.Tensor,
                      valid: torch.Tensor, next_ids: torch.Tensor | None = None) -> None:
        """Extended now: a pending context keeps no next tokens (`DrafterCache.defer`)."""
        self.extend_cache(cache, target_features, positions, valid, next_ids)

    def token_before(self, cache: DrafterCache, anchor_ids: torch.Tensor, anchor_positions: torch.Tensor
                     ) -> torch.Tensor:
        """The committed token before each anchor [B]: the next token of the valid entry at anchor - 2 (the
        anchor where there is none)."""
        assert cache.states is not None  # `new_cache` made it
        width = cache.length
        hit = cache.valid[:, :width] & (cache.positions[:, :width] == anchor_positions[:, None] - 2)
        found = cache.states[:, :width, 0].gather(1, hit.to(torch.uint8).argmax(1, keepdim=True))[:, 0]
        return torch.where(hit.any(1), found, anchor_ids)

    @torch.no_grad()
    def draft(self, cache: DrafterCache, anchor_ids: torch.Tensor, anchor_positions: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """The argmax after K passes [B,K-1] and the last pass's logits [B,K-1,V]."""
        hidden = self.cached_blocks(cache, self._block(anchor_ids), anchor_positions)
        base = self._base_head[0](hidden[:, 1:])
        refined = self.refine(hidden, self.token_before(cache, anchor_ids, anchor_positions), anchor_ids, base)
        logits = self.biased(base, refined[:, 1:])
        return logits.argmax(-1), logits

    def drafted_slots(self, cache: DrafterCache, anchor_ids: torch.Tensor, anchor_positions: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """The backbone's final hidden [B,K-1,H] and the LM head's logits [B,K-1,V] (the Jacobi seed's)."""
        hidden = self.cached_blocks(cache, self._block(anchor_ids), anchor_positions)[:, 1:]
        return hidden, self._base_head[0](hidden)

    # -- checkpoints -----------------------------------------------------------------------------------------------

    def save_pretrained(self, directory: str | Path, verifier: str | None = None,
                        verifier_architectures: list[str] | None = None) -> None:
        """config.json and model.safetensors in speculators' XPress layout (no embedding, no LM head)."""
        write_speculators(directory, self.config, self.state_dict(), self.fc.weight.dtype, verifier,
                          verifier_architectures or [])


@drafter_family
class XPressFamily(DFlashFamily):
    """XPress (speculators' `XPressDraftModel`): vLLM's `method: xpress` (an open pull request, vllm#54448)."""

    section = XPressSpec
    public_layout = "speculators"
    drafter_class = XPressDrafter

    def config(self, section: DFlashSpec, base: Target | SharedHead, tokenizer: Any) -> DFlashConfig:
        own = cast(XPressSpec, section)
        return XPressConfig.of(super().config(section, base, tokenizer),
                               xpress_rank=own.xpress_rank or DEFAULTS["xpress_rank"],
                               xpress_mlp_ratio=own.xpress_mlp_ratio or DEFAULTS["xpress_mlp_ratio"],
                               jacobi_passes=own.jacobi_passes or DEFAULTS["num_jacobi_passes"])

    def vllm_config(self, directory: ModelDir, block_size: int) -> dict[str, Any]:
        """The block's K - 1 drafts; the Jacobi passes are the checkpoint's `num_jacobi_passes`, which the engine
        reads with the rest of its config."""
        return {"method": "xpress", "model": str(directory.path), "num_speculative_tokens": block_size - 1}
