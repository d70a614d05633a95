"""FLOP accounting, so arms (Draft-OPD, continued SFT, ablations) are compared at matched training compute.

The matched-compute baselines are budgeted from these totals, so they count every token each model actually
processes, with the weights that token actually passes through. The convention:

- A forward costs 2 x (weights a token passes through) per token; a training forward + backward costs 6x for
  trainable weights (activation and weight gradients) and 4x for the frozen shared LM head (activation gradient
  only). Embedding lookups and attention's sequence-length term are left out: small at these lengths, and alike
  for every arm. A mixture-of-experts target counts the experts a token passes through (`num_experts_per_tok`
  of them), not all of them. A layer kind adds what no weight counts (`LayerKind.state_flops`: a Gated DeltaNet
  layer's recurrent state update per token, opd/models/kinds/gated_deltanet.py); its conv weights count as weights.
- Only real tokens count, not padding: a batch's padding is an artefact of how it was batched (micro-batch size,
  the longest row), not of the method.
- Target (`TargetParams`): every token its decoder runs passes through the body (decoder layers); only the
  positions whose logits are formed pass through the LM head.
  - rollout: prefill and every verification block (K tokens), logits at all of them;
  - teacher replay: the packed sequence, i.e. the committed prefix plus every drafted block's K-2 appended tokens
    (`len(opd.distill.replay.pack(record, K, mode).ids)`), decoder only; the LM head at every scored slot (N x (K-1)),
    whether the scorer (top-k) or the learner (full vocabulary) forms those logits; with a rebuilt source the
    rebuild's forward over the text is the teacher's too, charged once, with the rebuild (except a hybrid target's
    drafted blocks, whose packed forward runs the text again: `CommittedView`); a recurrent kind also advances
    each drafted block's state to its anchor (`LayerKind.block_flops`, `TargetParams.replay`);
  - SFT and random-anchor redrafting: the sequence through the decoder only (features, no logits).
- Drafter (`DrafterParams`, from the family's `modules_by_role`): every context position passes through `fc` and
  each layer's K and V projections (EAGLE-3: its whole layer); every block token (DFlash: K per block, anchor
  included; EAGLE-3: its K-2 chain steps) through the decoder layers; every drafted slot whose logits are formed
  (K-1 per block, or the loss's slots in training) through the head (EAGLE-3's own head is trained: 6x, not 4x).
  A DFlash variant's sliding window and causal layers narrow only attention's length term, left out above, and
  its embedding scale and logit transform are elementwise: it counts what the plain drafter of its shape counts.
  DFlash 2 adds work no weight matrix accounts for (`extra_flops`): its convolutions' taps per block token and
  its candidate selector per drafted slot (the selector's codebooks are looked up, not multiplied through).
- Every composite formula (a decoder's, a sampler's, the rebuild's) is a function below; callers only count tokens.
- Monitoring is not training compute: held-out evaluation and the scorer's expected-acceptance diagnostic are
  not counted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Protocol

from torch import nn

from opd.models.layer_kind import layer_kinds

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from opd.models.protocol import Drafter


def _numel(modules: list[nn.Module]) -> int:
    return sum(p.numel() for m in modules for p in m.parameters())


@dataclass(frozen=True)
class TargetParams:
    """The target's weights per token: `body` for every token the decoder runs, `head` per formed logit row."""

    body: int
    head: int
    state: int = 0  # FLOPs per token its layer kinds add beyond the weights (`LayerKind.state_flops`)
    block: int = 0  # FLOPs per drafted block packed replay adds beyond the forward (`LayerKind.block_flops`)

    @classmethod
    def of(cls, model: PreTrainedModel) -> TargetParams:
        """Everything but the input embedding and the LM head is body, the routed experts at the share a token
        passes through; the head counts even when tied."""
        embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
        experts, (per_token, total) = _expert_params(model), _experts_per_token(model.config)
        body = sum(p.numel() for p in model.parameters()
                   if p is not embed and p is not head and id(p) not in experts)
        kinds = layer_kinds(model)
        return cls(body + sum(p.numel() for p in experts.values()) * per_token // total, head.numel(),
                   kinds.state_flops(), kinds.block_flops())

    def forward(self, tokens: int, logits: int = 0) -> float:
        """FLOPs of a forward over `tokens` tokens forming `logits` rows of logits."""
        return 2.0 * (self.body * tokens + self.head * logits) + float(self.state * tokens)

    def replay(self, tokens: int, blocks: int, logits: int = 0) -> float:
        """FLOPs of packed replay over `tokens` rows holding `blocks` drafted blocks: the forward, plus what each
        block adds (a recurrent kind's advance of its state to the anchor)."""
        return self.forward(tokens, logits) + float(self.block * blocks)


def _experts_per_token(config) -> tuple[int, int]:
    """(experts a token is routed to, experts per layer) of a mixture-of-experts config; (1, 1) for a dense one."""
    text = config.get_text_config(decoder=True)
    total = getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None)
    per_token = getattr(text, "num_experts_per_tok", None)
    return (int(per_token), int(total)) if total and per_token else (1, 1)


def _expert_params(model: nn.Module) -> dict[int, nn.Parameter]:
    """The routed experts' weights, by id: transformers names the module that holds all of a layer's experts
    `experts` (a shared expert, which every token passes through, is named otherwise)."""
    return {id(p): p for name, module in model.named_modules() if name.rsplit(".", 1)[-1] == "experts"
            for p in module.parameters()}


@dataclass(frozen=True)
class DrafterParams:
    """The drafter's weights per token: `context` per context position (DFlash: fc and every layer's K/V
    projections; EAGLE-3: fc and its layer), `block` per block token (the decoder layers), `head` per drafted slot
    (DFlash: the shared frozen LM head; EAGLE-3: its own trainable draft-vocabulary head)."""

    context: int
    block: int
    head: int
    block_size: int  # K: the anchor and K-1 drafts, the tokens the target verifies per step
    block_tokens: int  # tokens per block through the layers (`tokens_per_block`: DSpark K-1, EAGLE-3 K-2)
    head_trainable: bool = False
    token_extra: int = 0  # FLOPs per block token beyond its weights (DFlash 2's convolution taps)
    slot_extra: int = 0  # FLOPs per drafted slot beyond the head (DFlash 2's candidate selector)

    @classmethod
    def of(cls, drafter: Drafter) -> DrafterParams:
        assert isinstance(drafter, nn.Module)  # every family is one
        context, block, head = drafter.modules_by_role()
        token_extra, slot_extra = drafter.extra_flops()
        return cls(context=_numel(context), block=_numel(block), head=head.weight.numel(),
                   block_size=drafter.block_size, block_tokens=drafter.tokens_per_block,
                   head_trainable=any(head is m for m in drafter.modules()),  # its own, not the target's
                   token_extra=token_extra, slot_extra=slot_extra)

    def forward(self, *, context: int, blocks: int, slots: int) -> float:
        """FLOPs of a forward over `context` context positions, `blocks` blocks (`block_tokens` each), `slots` logit
        rows."""
        return 2.0 * (self._trainable(context, blocks) + self.head * slots) + self._extra(blocks, slots)

    def train(self, *, context: int, blocks: int, slots: int) -> float:
        """The same forward plus its backward: 6x the trainable weights, 4x a frozen LM head (no weight grad); the
        elementwise work 3x (its backward forms the input's and the taps' gradients)."""
        return (6.0 * self._trainable(context, blocks) + (6.0 if self.head_trainable else 4.0) * self.head * slots
                + 3.0 * self._extra(blocks, slots))

    def selector_train(self, slots: int) -> float:
        """DFlash 2's selector term over `slots` slots (opd/distill/selector_loss.py): the head once more, without
        gradient (its top-k candidates), and the selector's forward and backward."""
        return float(slots) * (2.0 * self.head + 3.0 * self.slot_extra)

    def _extra(self, blocks: int, slots: int) -> float:
        return float(self.token_extra * blocks * self.block_tokens + self.slot_extra * slots)

    def _trainable(self, context: int, blocks: int) -> int:
        return self.context * context + self.block * blocks * self.block_tokens


@dataclass
class FlopCounter:
    """FLOPs spent so far, by model and role; callers add `TargetParams`/`DrafterParams` costs to a field."""

    target_forward: float = 0.0  # rollout prefill/verification, teacher replay (its LM head included), SFT features
    drafter_forward: float = 0.0  # drafting in rollout (and random-anchor redrafting)
    drafter_train: float = 0.0  # student forward + backward in the learner (or SFT)

    @property
    def total(self) -> float:
        return self.target_forward + self.drafter_forward + self.drafter_train

    def __add__(self, other: FlopCounter) -> FlopCounter:
        return FlopCounter(self.target_forward + other.target_forward, self.drafter_forward + other.drafter_forward,
                           self.drafter_train + other.drafter_train)

    def __iadd__(self, other: FlopCounter) -> FlopCounter:
        self.target_forward += other.target_forward
        self.drafter_forward += other.drafter_forward
        self.drafter_train += other.drafter_train
        return self

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "total": self.total}


class Decoded(Protocol):
    """What a formula reads of a `SequenceRecord` (opd/decoding/record.py sits above models)."""

    prompt_ids: list[int]
    response_ids: list[int]

    @property
    def num_steps(self) -> int: ...  # read-only: SequenceRecord computes it


def decode_flops(records: Sequence[Decoded], target: TargetParams, drafter: DrafterParams) -> FlopCounter:
    """Speculative decoding: logits at every prefill and verified position (K per step); the drafter's cache takes
    them all, and each step drafts K−1 slots."""
    flops, k = FlopCounter(), drafter.block_size
    for rec in records:
        seen = len(rec.prompt_ids) + k * rec.num_steps
        flops.target_forward += target.forward(seen, logits=seen)
        flops.drafter_forward += drafter.forward(context=seen, blocks=rec.num_steps, slots=(k - 1) * rec.num_steps)
    return flops


def sample_flops(target: TargetParams, prompt: int, response: int, *, prefill_logits: bool) -> FlopCounter:
    """Plain sampling of one response: the decoder over prompt and response; logits at every position when the
    engine forms them at the prefill too (HF), else at the sampled positions only (vLLM)."""
    seen = prompt + response
    return FlopCounter(target_forward=target.forward(seen, logits=seen if prefill_logits else response))


def drafted_text_flops(text: int, blocks: int, target: TargetParams, drafter: DrafterParams) -> FlopCounter:
    """Drafting `blocks` blocks over a known text (the rebuild, random-anchor redrafting): the target's decoder over
    the text (features only), the drafter's context over it once, and K−1 LM-head slots per block."""
    return FlopCounter(target_forward=target.forward(text),
                       drafter_forward=drafter.forward(context=text, blocks=blocks,
                                                       slots=blocks * (drafter.block_size - 1)))


def rebuild_flops(records: Sequence[Decoded], target: TargetParams, drafter: DrafterParams) -> FlopCounter:
    """What rebuilding `records` from their text costs (opd/sources/rebuild.py): one drafted block per walked anchor."""
    total = FlopCounter()
    for rec in records:
        total += drafted_text_flops(len(rec.prompt_ids) + len(rec.response_ids), rec.num_steps, target, drafter)
    return total
