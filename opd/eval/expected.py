"""Expected acceptance: what speculative decoding would accept, computed exactly from p and q without decoding.

Drafts sampled from q (`draft: sample`) are verified by min(1, p_T/q) instead: `sampled_acceptance` gives slot k's
α_k = Σ min(p_T,k, q_k) and the exact expected accepted length given the drafts decoding sampled.

The drafter proposes point-mass drafts d = argmax q (DFlash's reference code and the serving engines do), and
verification (opd/decoding/verify.py) accepts d at a slot with probability p_T(d), where p is the target's
distribution at that slot given the drafted prefix, processed by the setting's temperature, top-k and top-p.
So a drafted slot's exact acceptance probability is

    a_k = 1[d_k = argmax p_k]   greedy,      a_k = p_T,k(d_k)   sampled,

and a block's expected accepted length is sum_k prod_{j<=k} a_j. These need only the target's view of the
drafted blocks, which teacher replay computes anyway, so the diagnostic sees, during training, the acceptance
every serving setting would get on the same states: on the training rollouts (the scorer, every step) and on
held-out states that each eval setting's own decoding visits (`opd eval`, periodic evals).

It is a prediction of the empirical τ, not an estimate from few samples: on the states that decoding under a
setting visited, its mean equals the mean acceptance that decoding realised (tests/test_expected_acceptance.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch

from opd.decoding.record import SequenceRecord
from opd.decoding.sampling import Sampling, target_probs
from opd.decoding.verify import DraftQ, prob_of
from opd.distill.acceptance_loss import served_acceptance
from opd.distill.losses import TopKTeacher
from opd.eval.acceptance import survival_curve
from opd.models.lm_head import SLOTS_PER_CHUNK, apply_head


def slot_acceptance(drafts: torch.Tensor, logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """a_k [..., K-1] for drafts [..., K-1] and the target's logits [..., K-1, V] at those slots."""
    if sampling.greedy:
        return (drafts == logits.argmax(-1)).to(torch.float32)
    if 0 < sampling.top_k < logits.shape[-1]:
        # Top-k gives every other token probability 0, so the top-k logits decide p_T(d): no [slots, V] softmax
        # and sort for top-p, which held most of the diagnostic's memory and time at Qwen3's vocabulary for 256 slots
        # (measured with bench/scale.py in commit f0b86f8; bench/results/scale.md holds only the shortcut's figures).
        top, ids = logits.topk(sampling.top_k, dim=-1)
        probs = target_probs(top, Sampling(sampling.temperature, 0, sampling.top_p))
        return (probs * (ids == drafts.unsqueeze(-1))).sum(-1)
    return target_probs(logits, sampling).gather(-1, drafts.unsqueeze(-1)).squeeze(-1)


def teacher_acceptance(drafts: torch.Tensor, teacher: torch.Tensor | TopKTeacher, head: torch.nn.Module | None,
                       samplings: dict[str, Sampling], *, teacher_temperature: float = 1.0) -> dict[str, torch.Tensor]:
    """a_k [N, K-1] per named setting, from replay's teacher: final-norm hidden states [N, K-1, H] and the LM
    head (exact), or top-k log-probs (exact for greedy and for settings whose top_k is at most the teacher's k;
    tokens outside the teacher's top-k count as probability 0). Computed `SLOTS_PER_CHUNK` slots at a time."""
    n, k1 = drafts.shape
    out = {name: torch.zeros(n, k1) for name in samplings}
    rows = max(1, SLOTS_PER_CHUNK // k1)
    for start in range(0, n, rows):
        part = slice(start, start + rows)
        logits = _teacher_logits(teacher, head, part, teacher_temperature)
        for name, sampling in samplings.items():
            out[name][part] = slot_acceptance(drafts[part].to(logits.device), logits, sampling).float().cpu()
    return out


@torch.no_grad()
def _teacher_logits(teacher: torch.Tensor | TopKTeacher, head: torch.nn.Module | None, part: slice,
                    temperature: float) -> torch.Tensor:
    """Target logits (up to a per-slot constant, which no setting's processing sees) of blocks `part`."""
    if isinstance(teacher, TopKTeacher):
        ids, logprobs = teacher.ids[part], teacher.logprobs[part].float() * temperature
        vocab = cast(torch.Tensor, head.weight).shape[0] if head is not None else int(ids.max()) + 1
        return torch.full((*ids.shape[:2], vocab), float("-inf"), device=ids.device).scatter(-1, ids, logprobs)
    if head is None:  # the teacher's rows already are logits
        return teacher[part]
    return apply_head(head, teacher[part].to(cast(torch.Tensor, head.weight).device))


@dataclass
class ExpectedAcceptance:
    """One setting's expected acceptance over a set of drafted blocks."""

    tau: float  # mean over responses of expected written tokens per block (as AcceptanceStats.tau)
    tau_token_weighted: float  # mean expected written tokens over all blocks
    slot: list[float]  # mean a_k at k = 1..K-1: agreement given the drafted prefix, whatever came before
    survival: list[float]  # expected P(accepted >= k), comparable with AcceptanceStats.survival
    blocks: int

    @classmethod
    def of(cls, acceptance: torch.Tensor, rooms: Sequence[Sequence[int]],
           survival: torch.Tensor | None = None) -> ExpectedAcceptance:
        """From a_k [N, K-1] of N blocks, stacked response by response, and each response's `SequenceRecord.rooms`
        (N in all), counted as `AcceptanceStats` counts realised blocks: a block writes min(accepted + 1, room)
        tokens, whose expectation is 1 + sum of P(accepted >= k) over k < room, and the survival curve is
        censored at the response end (opd/eval/acceptance.py). `survival` [N, K-1]: P(accepted >= k) when it is
        not the product of the a_k (drafts sampled from q: `sampled_acceptance`)."""
        survival = acceptance.double().cumprod(-1) if survival is None else survival.double()
        room = torch.tensor([r for part in rooms for r in part], dtype=torch.long)
        expected = (survival * (torch.arange(1, survival.shape[1] + 1) < room[:, None])).sum(-1) + 1
        per_response = [part.mean().item() for part in expected.split([len(p) for p in rooms]) if len(part)]
        blocks = max(1, len(acceptance))
        return cls(tau=sum(per_response) / max(1, len(per_response)),
                   tau_token_weighted=float(expected.sum()) / blocks,
                   slot=(acceptance.double().sum(0) / blocks).tolist(),
                   survival=survival_curve(survival, room)[1:], blocks=len(acceptance))

    def metrics(self, prefix: str) -> dict[str, float]:
        """MLflow metrics: `{prefix}tau` (token-weighted, like `rollout_tau`) and a_k as `{prefix}slot_{k}`."""
        out = {f"{prefix}tau": self.tau_token_weighted}
        out.update({f"{prefix}slot_{k}": v for k, v in enumerate(self.slot, start=1)})
        return out


def sampled_acceptance(drafts: torch.Tensor, teacher_logprobs: torch.Tensor, q: DraftQ
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(α_k, P(accepted >= k)) [N, K-1] of blocks whose drafts [N, K-1] were sampled from q (over the vocabulary or
    its ids) and verified against p̃ (log-probs [N, K-1, V], the setting's processing).

    α_k = Σ min(p̃_k, q_k) is slot k's acceptance before its draft is drawn, given the drafts before it. Given the
    recorded drafts, slot j is accepted with min(1, p̃_j(d_j) / q_j(d_j)) (the coins integrated), so
    P(accepted >= k | drafts) = Π_{j<k} min(1, p̃_j(d_j) / q_j(d_j)) · α_k, the last slot's draft integrated too:
    an exact expectation of the realised count on the states decoding visited, not the product of the α_k (a
    draft that was accepted is not distributed as q)."""
    alpha = served_acceptance(teacher_logprobs, q)
    p_draft = teacher_logprobs.gather(-1, drafts[..., None])[..., 0].exp()
    kept = torch.minimum(torch.ones_like(p_draft), p_draft / prob_of(q, drafts).to(p_draft.dtype).clamp_min(1e-30))
    before = torch.cat([torch.ones_like(kept[:, :1]), kept[:, :-1].cumprod(-1)], 1)
    return alpha, before * alpha


def record_drafts(records: Sequence[SequenceRecord]) -> tuple[torch.Tensor, list[int]]:
    """Every drafted block of the records as [N, K-1] (replay's block order) and the blocks per record."""
    blocks = [d for r in records for d in r.drafts]
    width = len(blocks[0]) if blocks else 0
    return torch.tensor(blocks, dtype=torch.long).reshape(len(blocks), width), [len(r.drafts) for r in records]


def point_mass_settings(samplings: Sequence) -> dict[str, Sampling]:
    """The named eval settings (`SamplingSpec`s) this diagnostic describes on any setting's states: those that
    draft point masses (a q-sampled setting is diagnosed on its own states only, `Diagnosis`)."""
    return {s.name: Sampling.of(s) for s in samplings if s.draft == "argmax"}
