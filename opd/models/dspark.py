"""The DSpark drafter (arXiv 2607.05147; speculators' `DSparkDraftModel`, 0.9.0): a DFlash backbone whose Markov
head chains the block's drafts, and a confidence head.

Why a subclass of `DFlashDrafter`: DSpark keeps DFlash's context injection, layers, cache and block attention, and
adds two heads after them (as DFlash 2 adds its selector). So it plugs into the one family interface
(opd/models/protocol.py) as a DFlash drafter whose block and head differ:

* Block. The anchor's own slot drafts (DeepSpec's `sample_from_anchor`): the block [anchor, MASK x (K-2)] at
  positions anchor..anchor+K-2 runs K-1 tokens through the layers, and slot j's hidden gives draft j+1.
* Markov head. Slot j's logits are lm_head(h_j) + markov_w2(markov_w1[x_j]), x_j the token before its prediction:
  the anchor for slot 0, draft j for the others. Greedy drafts are the argmax path left to right; sampled drafts
  (`draft: sample`) draw slot j from softmax(logits_j / T) given the draft drawn before it (`draft_path`, verified
  by opd/decoding/verify.py's `sample_chained_draft` with min(1, p/q) over the full vocabulary). Both are a point
  mass per block given (context, anchor) when greedy, which the rebuild and offline τ rely on.
* Confidence head. sigmoid(proj([h_j; markov_w1[x_j]])), the slot's predicted acceptance, for variable-length
  verification; it is loaded, saved, computed (`confidence`) and trained (`confidence_logits`, read by
  opd/distill/confidence_loss.py: SFT's published objective and Draft-OPD's `models.drafter.confidence_weight`), but
  decoding verifies whole blocks: no variable-length verification is built.

Training: `block_hidden` returns each slot's hidden with its Markov embedding appended ([h_j; markov_w1[x_j]], x_j
from the block's inputs: the rollout's drafts or the data), and `student_head` adds the Markov bias to the LM head's
logits, so Draft-OPD's losses and SFT's cross-entropy read DSpark's own q at every slot and train both heads' Markov
parts with the backbone. There is no separately trained selector (`selector` is empty).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from opd.errors import OpdError
from opd.formats.dflash import DFlashConfig, DFlashSpec, write_speculators
from opd.formats.dspark import DEFAULT_RANK, DSparkConfig, DSparkSpec
from opd.model_dir import ModelDir
from opd.models.biased_logits import BiasedLogits
from opd.models.dflash import DFlashDrafter, DFlashFamily
from opd.models.drafter_cache import DrafterCache
from opd.models.family import drafter_family
from opd.models.packed_attention import CHUNK_ROWS
from opd.models.shared_head import SharedHead
from opd.models.target import Target

Pick = Callable[[int, torch.Tensor], torch.Tensor]  # (slot, scores [B,V]) -> token [B]


class MarkovHead(nn.Module):
    """The low-rank bias markov_w2(markov_w1[x]) of a slot's logits given the token x before it (speculators'
    vanilla `MarkovHead`: its tensor names and its initialisation of markov_w1)."""

    def __init__(self, config: DSparkConfig) -> None:
        super().__init__()
        self.markov_w1 = nn.Embedding(config.vocab_size, config.markov_rank)
        self.markov_w2 = nn.Linear(config.markov_rank, config.vocab_size, bias=False)
        nn.init.normal_(self.markov_w1.weight, std=0.01)
        nn.init.normal_(self.markov_w2.weight, std=0.02)


class ConfidenceHead(nn.Module):
    """A slot's acceptance logit from [h; markov_w1[x]] (speculators' `ConfidenceHead`)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, 1)


class ConfidenceLogits(nn.Module):
    """The confidence head on training rows: [h; e] (`block_hidden`'s) -> the slot's acceptance logit, reading e
    only when the head does (`confidence_with_markov`)."""

    def __init__(self, head: ConfidenceHead, hidden_size: int, with_markov: bool) -> None:
        super().__init__()
        self._head = (head,)  # not a submodule: the drafter owns it
        self.width = None if with_markov else hidden_size

    def parameters(self, recurse: bool = True):  # type: ignore[override]
        """The head's projection (trained by the confidence loss)."""
        return self._head[0].parameters(recurse)

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        proj = self._head[0].proj
        return proj(rows[..., : self.width].to(proj.weight.dtype))[..., 0]


class DSparkDrafter(DFlashDrafter):
    """DSpark: DFlash layers over K-1 drafting slots, drafts chained by the Markov head."""

    kind = "dspark"

    config_class = DSparkConfig
    chains_q = True  # slot j's logits depend on the draft at slot j-1

    def __init__(self, config: DFlashConfig, embed_tokens: nn.Embedding, lm_head: nn.Linear,
                 teacher: nn.Module | None = None) -> None:
        super().__init__(config, embed_tokens, lm_head, teacher)
        config = cast(DSparkConfig, config)
        self.markov_head = MarkovHead(config)
        self.confidence_head = ConfidenceHead(config.confidence_width) if config.confidence_head else None
        self._base_head = self._student_head  # the LM head (with a variant's transform), before the Markov bias
        self._student_head: tuple[nn.Module] = (BiasedLogits(self._base_head[0], self.markov_head.markov_w2,
                                                             config.hidden_size),)
        self._no_selector = (nn.Module(),)
        self.to(device=embed_tokens.weight.device, dtype=embed_tokens.weight.dtype)

    @property
    def tokens_per_block(self) -> int:
        """Tokens a block runs through the layers: the anchor and K-2 masks (the anchor's slot drafts)."""
        return self.block_size - 1

    @property
    def selector(self) -> nn.Module:
        """No module of its own loss: the Markov head is part of q, trained by the main loss."""
        return self._no_selector[0]

    def draft_law(self, hidden: torch.Tensor, logits: torch.Tensor, predecessors: torch.Tensor,
                  temperature: float) -> tuple[torch.Tensor, None]:
        """softmax(logits / T) over the whole vocabulary: the logits already read the draft before the slot."""
        dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
        return torch.softmax(logits.to(dtype) / temperature, dim=-1), None

    def extra_flops(self) -> tuple[int, int]:
        """(FLOPs per block token, per drafted slot): markov_w2 per slot (markov_w1 is a lookup)."""
        c = cast(DSparkConfig, self.config)
        return 0, 2 * c.markov_rank * c.vocab_size

    def markov(self, previous: torch.Tensor) -> torch.Tensor:
        """markov_w1 [..., r] of the tokens before the slots' predictions."""
        return self.markov_head.markov_w1(previous)

    @property
    def confidence_logits(self) -> ConfidenceLogits:
        """[h; markov_w1[x]] rows (`block_hidden`'s) -> the confidence head's acceptance logits."""
        if self.confidence_head is None:
            raise OpdError("models.drafter_path: this DSpark drafter has no confidence head (its config.json has "
                           "enable_confidence_head: false; expected true to train it)")
        config = cast(DSparkConfig, self.config)
        return ConfidenceLogits(self.confidence_head, config.hidden_size, config.confidence_with_markov)

    def confidence(self, hidden: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        """The confidence head's acceptance probability [...] of slots with final hidden [..., H]."""
        rows = torch.cat([hidden, self.markov(previous).to(hidden.dtype)], dim=-1)
        return torch.sigmoid(self.confidence_logits(rows))

    def _block(self, anchor_ids: torch.Tensor) -> torch.Tensor:
        """[anchor, MASK x (K-2)] per row of anchor_ids [...]."""
        block = anchor_ids.new_full((*anchor_ids.shape, self.tokens_per_block), self.mask_token_id)
        block[..., 0] = anchor_ids
        return block

    # -- training ----------------------------------------------------------------------------------------------

    def block_hidden(self, features: torch.Tensor, context_ids: torch.Tensor, context_valid: torch.Tensor,
                     anchor_positions: torch.Tensor, block_inputs: torch.Tensor,
                     chunk_rows: int = CHUNK_ROWS) -> torch.Tensor:
        """[h_j; markov_w1[x_j]] [B,M,K-1,H+r] at every drafted slot: the backbone's final hidden of the K-1-token
        block, with the Markov embedding of the block's input before each prediction (block_inputs [B,M,K-1]: the
        anchor, then the drafts or the data)."""
        context = self.project_context(features.to(self.fc.weight.dtype))
        hidden = self.forward_blocks(context, context_valid, self._block(block_inputs[..., 0]), anchor_positions,
                                     chunk_rows)
        return torch.cat([hidden, self.markov(block_inputs).to(hidden.dtype)], dim=-1)

    # -- inference ---------------------------------------------------------------------------------------------

    @torch.no_grad()
    def drafted_slots(self, cache: DrafterCache, anchor_ids: torch.Tensor, anchor_positions: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """Final hidden [B,K-1,H] and the LM head's logits [B,K-1,V] (before the Markov bias) of one block's
        drafting slots per sequence, the anchor's included."""
        hidden = self.cached_blocks(cache, self._block(anchor_ids), anchor_positions)
        return hidden, self._base_head[0](hidden)

    @torch.no_grad()
    def draft(self, cache: DrafterCache, anchor_ids: torch.Tensor, anchor_positions: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """The Markov head's greedy path [B,K-1] and the logits [B,K-1,V] of each slot given the draft before it."""
        logits: list[torch.Tensor] = []

        def pick(slot: int, scores: torch.Tensor) -> torch.Tensor:
            logits.append(scores)
            return scores.argmax(-1)

        drafts, _ = self.draft_path(cache, anchor_ids, anchor_positions, pick)
        return drafts, torch.stack(logits, dim=1)

    @torch.no_grad()
    def draft_path(self, cache: DrafterCache, anchor_ids: torch.Tensor, anchor_positions: torch.Tensor,
                   pick: Pick) -> tuple[torch.Tensor, None]:
        """(drafts [B,K-1], None: each slot's q is over the whole vocabulary): slot by slot, `pick(slot, logits
        [B,V])` chooses the token given the one chosen before it (the anchor first)."""
        _, base = self.drafted_slots(cache, anchor_ids, anchor_positions)
        markov_w2, previous, drafts = self.markov_head.markov_w2, anchor_ids, []
        for slot in range(base.shape[1]):
            bias = markov_w2(self.markov(previous).to(markov_w2.weight.dtype)).to(base.dtype)
            drafts.append(pick(slot, base[:, slot] + bias))
            previous = drafts[-1]
        return torch.stack(drafts, dim=1), None

    # -- checkpoints -----------------------------------------------------------------------------------------------

    def save_pretrained(self, directory: str | Path, verifier: str | None = None,
                        verifier_architectures: list[str] | None = None) -> None:
        """config.json and model.safetensors in speculators' DSpark layout (no embedding, no LM head)."""
        write_speculators(directory, self.config, self.state_dict(), self.fc.weight.dtype, verifier,
                          verifier_architectures or [])


@drafter_family
class DSparkFamily(DFlashFamily):
    """DSpark (speculators' `DSparkDraftModel`): vLLM's `method: dspark`."""

    section = DSparkSpec
    public_layout = "speculators"
    drafter_class = DSparkDrafter

    def config(self, section: DFlashSpec, base: Target | SharedHead, tokenizer: Any) -> DFlashConfig:
        backbone = super().config(section, base, tokenizer)
        rank = cast(DSparkSpec, section).markov_rank or DEFAULT_RANK
        return DSparkConfig(**{f.name: getattr(backbone, f.name) for f in fields(DFlashConfig)}, markov_rank=rank)

    def vllm_config(self, directory: ModelDir, block_size: int) -> dict[str, Any]:
        return {"method": "dspark", "model": str(directory.path), "num_speculative_tokens": block_size - 1}
