"""The P-EAGLE drafter (arXiv 2602.01469; speculators' `PEagleDraftModel`, 0.9.0): an EAGLE-3 drafter that drafts
its whole chain in one pass.

Why a subclass of `Eagle3Drafter`: P-EAGLE keeps EAGLE-3's columns, layer, cache, draft vocabulary and heads (see
opd/models/eagle3.py). Only the chain differs:

* Slot 0 is EAGLE-3's: column a−1 (the target's fused state at a−1 paired with the anchor) drafts x_{a+1}.
* Slot s ≥ 1 is a column of its own at RoPE position a−1+s whose token is the pard token (`mask_token_id`) and whose
  fused state is fc(`mask_hidden`), a learned [3H] stand-in for the target's states. It attends the columns before
  the anchor and the slots 1..s of its own chain (speculators' `create_peagle_mask_mod`), never a draft, so the
  K−2 slots run in one pass.

So drafts are a function of (context, anchor): the greedy chain is each slot's argmax, a point mass, and the rebuild
and offline τ hold. At T>0 each slot's q is softmax(logits / T) of that slot alone; sampling every slot from its own
q, independently, and verifying with min(1, p/q) and the residual is lossless (slot k's draft is distributed as
q_k whatever the drafts before it were), though slot k's q is not conditioned on the drafts before it, as a chain's
is. This is how opd/decoding samples a DFlash block's drafts, so P-EAGLE needs no chained path (`chains_q` False).

The embedding is the drafter's own (speculators trains it: `embed_requires_grad`), a copy of the target's for a
random drafter; the LM head over the draft vocabulary is its own as in EAGLE-3. Training (`block_hidden`) is one
causal pass over the committed columns, then every block's K−2 mask slots; the block's drafts, which the slots never
read, are not inputs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from opd.data.prompts import mask_token_id
from opd.errors import OpdError
from opd.formats.checkpoint import WEIGHTS_FILE, TargetShape
from opd.formats.eagle3 import SHARED_EMBEDDING, Eagle3Spec, check_distinct_layers
from opd.formats.peagle import (
    OWN_EMBEDDING,
    PEagleConfig,
    PEagleSpec,
    file_shapes,
    read_config,
    read_tensors,
    write_checkpoint,
)
from opd.model_dir import ModelDir
from opd.models.chain_attention import chain_attention
from opd.models.drafter_cache import DrafterCache
from opd.models.eagle3 import Eagle3Drafter, Eagle3Family, check_fused_layers
from opd.models.family import Shapes, drafter_family
from opd.models.packed_attention import CHUNK_ROWS, grouped_sdpa
from opd.models.shared_head import SharedHead
from opd.models.target import Target


class PEagleDrafter(Eagle3Drafter):
    """P-EAGLE: EAGLE-3's columns, its chain drafted in one pass from the pard token and `mask_hidden`."""

    kind = "peagle"

    def __init__(self, config: PEagleConfig, embed_tokens: nn.Embedding, target_head: nn.Linear) -> None:
        super().__init__(config, embed_tokens, target_head)
        self.config: PEagleConfig = config
        self.embedding = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embedding.weight.data.copy_(embed_tokens.weight.detach())
        self.embedding.weight.requires_grad_(config.embed_requires_grad)
        self.mask_hidden = nn.Parameter(torch.randn(1, 1, 3 * config.target_hidden_size))
        self.to(device=embed_tokens.weight.device, dtype=embed_tokens.weight.dtype)

    @property
    def embed_tokens(self) -> nn.Embedding:
        """Its own embedding (the target's, copied, for a random drafter)."""
        return self.embedding

    def modules_by_role(self) -> tuple[list[nn.Module], list[nn.Module], nn.Linear]:
        """(run per context column, run per mask slot, the head per drafted slot), for FLOP counting: a mask slot is
        a column of its own, fc(mask_hidden) included."""
        return [self.fc, self.midlayer], [self.fc, self.midlayer, self.norm], self.lm_head

    def _mask_slots(self, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Queries, keys, values and residual of mask slots at `positions` [B,N]: the pard token and mask_hidden."""
        features = self.mask_hidden.expand(*positions.shape, -1)
        return self._columns(features, torch.full_like(positions, self.config.mask_token_id), positions)

    # -- inference ---------------------------------------------------------------------------------------------

    @torch.no_grad()
    def draft(self, cache: DrafterCache, anchor_ids: torch.Tensor,
              anchor_positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy K−1 drafts [B,K−1] (target ids) and their logits [B,K−1,V] over the target vocabulary (−inf outside
        the draft vocabulary): slot 0 from column a−1 (which reads `anchor_ids`), the K−2 mask slots in one pass."""
        heads = [self._head(self._column_output(cache, anchor_positions))]
        slots = self.block_size - 2
        if slots:
            positions = (anchor_positions - 1)[:, None] + torch.arange(1, slots + 1, device=anchor_positions.device)
            q, k, v, state = self._mask_slots(positions)
            keys, values = torch.cat([cache.keys[0], k], dim=2), torch.cat([cache.values[0], v], dim=2)
            sees = cache.visible_before(anchor_positions)[:, None, None, :].expand(-1, 1, slots, -1)
            causal = torch.ones(slots, slots, dtype=torch.bool, device=sees.device).tril()
            mask = torch.cat([sees, causal.expand(len(sees), 1, -1, -1)], dim=-1)
            attended = grouped_sdpa(q, keys, values, mask, self.config.head_dim**-0.5)
            heads.append(self._head(self._finish(state, attended)))
        logits = self.logits(torch.cat(heads, dim=1))
        return self.to_target_ids(logits.argmax(-1)), self._full_vocab(logits)

    # -- training ------------------------------------------------------------------------------------------------

    def block_hidden(self, features: torch.Tensor, context_ids: torch.Tensor, context_valid: torch.Tensor,
                     anchor_positions: torch.Tensor, block_inputs: torch.Tensor,
                     chunk_rows: int = CHUNK_ROWS) -> torch.Tensor:
        """Final normed hidden [B,M,K−1,H] at every block's K−1 drafted slots, as `draft` computes them.

        features [B,T,3H] and context_ids [B,T] are the committed text (index == position), context_valid [B,T];
        block m starts at anchor_positions[b,m]. Its anchor is read through column a−1 from context_ids, and its
        mask slots read no token of the block, so `block_inputs` (the drafts, or the data in SFT) is not read."""
        k, v, columns, visible = self._context(features, context_ids, context_valid, anchor_positions, chunk_rows)
        rows = torch.arange(len(columns), device=columns.device)[:, None]
        out = [self._head(columns[rows, (anchor_positions - 1).clamp_min(0)])]  # slot 0: o_{a-1}, [B,M,H]
        slots = self.block_size - 2
        if slots:
            blocks = anchor_positions.shape[1]
            steps = torch.arange(1, slots + 1, device=anchor_positions.device)
            q, sk, sv, state = self._mask_slots(((anchor_positions - 1)[..., None] + steps).flatten(1))
            q, sk, sv = (t.unflatten(2, (blocks, slots)) for t in (q, sk, sv))  # [B,heads,M,S,d]
            state = state.unflatten(1, (blocks, slots))
            for s in range(slots):
                attended = chain_attention(q[:, :, :, s], k, v, sk[:, :, :, : s + 1], sv[:, :, :, : s + 1], visible,
                                            self.config.head_dim**-0.5, chunk_rows)
                out.append(self._head(self._finish(state[:, :, s], attended)))
        return torch.stack(out, 2)

    forward = block_hidden

    # -- checkpoints -------------------------------------------------------------------------------------------

    def save_pretrained(self, directory: str | Path, verifier: str | None = None,
                        verifier_architectures: list[str] | None = None) -> None:
        """config.json + model.safetensors in speculators' layout (its own embedding included), naming `verifier`."""
        write_checkpoint(directory, self.config, self.state_dict(), self.fc.weight.dtype, verifier,
                         verifier_architectures)

    @classmethod
    def from_pretrained(cls, directory: str | Path | ModelDir,  # type: ignore[override]  # its chain's length is
                        target: Target | SharedHead) -> PEagleDrafter:  # the file's, not a caller's block_size
        """Load a speculators P-EAGLE checkpoint for `target`; one without `embed_tokens.weight` takes the target's.
        A mismatch is a one-line OpdError."""
        model_dir = directory if isinstance(directory, ModelDir) else ModelDir.read(directory, "drafter")
        config = read_config(model_dir, target)
        drafter = cls(config, target.embed_tokens, target.lm_head)
        tensors = read_tensors(model_dir.path / WEIGHTS_FILE, config)
        tensors.setdefault(OWN_EMBEDDING, target.embed_tokens.weight.detach())
        drafter.load_state_dict(tensors)
        return drafter


@drafter_family
class PEagleFamily(Eagle3Family):
    """P-EAGLE (speculators' layout; vLLM's `method: eagle3` with `parallel_drafting`): an EAGLE-3 drafter whose
    chain is drafted in one pass. What it shares with EAGLE-3's family (the fused-layer check, the draft
    vocabulary fitted to the data) it inherits."""

    section = PEagleSpec
    public_layout = "speculators"

    def initial(self, section: Eagle3Spec, base: Target | SharedHead, tokenizer: Any) -> PEagleDrafter:
        """EAGLE-3's fresh shape with the pard token: the spec's, or the tokenizer's mask token."""
        pard = mask_token_id(tokenizer, cast(PEagleSpec, section).mask_token_id)
        config = PEagleConfig.of(self.fresh_config(section, base), pard)
        return PEagleDrafter(config, base.embed_tokens, base.lm_head).to(base.device)

    def load(self, directory: ModelDir, base: Target | SharedHead, section: Eagle3Spec) -> PEagleDrafter:
        drafter = PEagleDrafter.from_pretrained(directory, base).to(base.device)
        check_fused_layers(directory, drafter.config, base.layer_ids)
        return drafter

    def target_layer_ids(self, directory: ModelDir, num_target_layers: int) -> list[int]:
        return PEagleConfig.from_speculators(directory.config, num_target_layers).target_layer_ids

    def check_initial(self, section: Eagle3Spec, tokenizer: Any, target: TargetShape) -> None:
        super().check_initial(section, tokenizer, target)
        mask_token_id(tokenizer, cast(PEagleSpec, section).mask_token_id)

    def expected_shapes(self, directory: ModelDir, target: TargetShape, section: Eagle3Spec) -> Shapes:
        """Its fused layers must be the ones the spec captures, as loading demands later. The names are
        speculators'; its own embedding, which a checkpoint may leave to the target's, is checked on load."""
        config = read_config(directory, target)
        check_fused_layers(directory, config, target.layer_ids)
        return file_shapes(config), lambda name: name == SHARED_EMBEDDING

    def served_block_size(self, directory: ModelDir, target: TargetShape | None, section: Eagle3Spec) -> int:
        """vLLM captures each layer once, so a repeated id would leave its fc short of a state; K is the file's."""
        if target is None:
            raise OpdError("a P-EAGLE drafter is checked against its target, whose config.json was not found")
        config = read_config(directory, target)
        check_distinct_layers(config.aux_layer_ids)
        return config.block_size

    def vllm_config(self, directory: ModelDir, block_size: int) -> dict[str, Any]:
        """vLLM serves P-EAGLE as EAGLE-3 drafting its chain in one pass (it reads the pard token from the file)."""
        return super().vllm_config(directory, block_size) | {"parallel_drafting": True}

    def save_speculators(self, drafter: Any, directory: str | Path, verifier: str | None) -> None:
        architectures = [] if verifier is None else ModelDir.read(verifier, "target").architectures
        drafter.save_pretrained(directory, verifier, architectures)
