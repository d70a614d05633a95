"""The lossless acceptance rules for a DFlash draft: point-mass (argmax) drafts, or drafts sampled from q.

The Leviathan/Chen rule is "accept d with min(1, p(d)/q(d)), else sample norm(max(0, p−q))". For a point-mass
draft it becomes: accept d with probability p(d); on rejection sample from p with d removed. With
`Sampling.sample_drafts` each drafted slot k is instead sampled from q_k, the drafter's logits shaped like the
target's (`sample_draft`), and verified with the full rule (`verify_sampled`). DFlash drafts all slots in
parallel from [anchor, MASK...], so q_k does not depend on d_<k; the rule needs only that d_k ~ q_k given the
drafts before it, independently of the coins. DFlash 2's selector chains its slots (`sample_chained_draft`): q_k
is the softmax at temperature T of slot k's candidate scores given the sampled d_{k-1}, so it is zero outside the
k candidates and kept sparse ([B, K−1, k] with the candidates' ids); the residual max(0, p − q) is then p outside
the candidates, over the full vocabulary (z-lab's `_rejection_sample` with `draft_indices`). Either way every
emitted token is distributed exactly as the target's p. Greedy decoding is the T → 0 limit: accept while d equals
the target's argmax (drafts stay argmax; `sample_drafts` is ignored).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from opd.decoding.sampling import Sampling, keyed_uniform, sample_from, target_probs
from opd.models.drafter_cache import DrafterCache
from opd.models.protocol import ChainedDrafter

# Keyed random streams (see sampling.py): accept/reject coins, the token the target emits at a position, and the
# token a sampled draft proposes for it.
STREAM_ACCEPT, STREAM_TOKEN, STREAM_DRAFT = 1, 2, 3


@dataclass
class DraftQ:
    """The law each drafted slot was sampled from: probs [B, K−1, C] over `ids` [B, K−1, C] (a drafter's
    candidates), or over the whole vocabulary in order (C = V) when ids is None."""

    probs: torch.Tensor
    ids: torch.Tensor | None = None


@dataclass
class Verdict:
    accepted: torch.Tensor  # [B] drafted tokens kept, 0..K−1
    bonus: torch.Tensor  # [B] the target's own token after the accepted prefix (the next anchor)


def sample_draft(draft_logits: torch.Tensor, sampling: Sampling, *, seed: int = 0,
                 keys: torch.Tensor | None = None, start: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafts [B, K−1] sampled from q = the drafter's logits [B, K−1, V] processed like the target's, and q.

    `verify_sampled` needs q for min(1, p/q). The random numbers are keyed like verify's (slot k draws at
    response index start + k), so a sequence's drafts do not depend on the batch it is drafted in.
    """
    if sampling.greedy:
        raise ValueError("sampled drafts need temperature > 0; greedy decoding drafts the argmax")
    q = target_probs(draft_logits, sampling)
    return sample_from(q, _draft_uniforms(draft_logits.shape[:2], seed, keys, start, draft_logits.device)), q


def sample_chained_draft(drafter: ChainedDrafter, cache: DrafterCache, anchor_ids: torch.Tensor,
                         anchor_positions: torch.Tensor, sampling: Sampling, *, seed: int = 0,
                         keys: torch.Tensor | None = None, start: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, DraftQ]:
    """Drafts [B, K−1] of a drafter that `chains_q` (DFlash 2), sampled slot by slot from q_k = softmax(scores /
    T) over slot k's candidates given the draft sampled at slot k−1, and those q_k (sparse, over the candidates).

    Only the temperature shapes q (as z-lab's `select`): top-k/top-p shape p, and any q is lossless. Keyed as
    `sample_draft`."""
    if sampling.greedy:
        raise ValueError("sampled drafts need temperature > 0; greedy decoding drafts the argmax")
    shape = (len(anchor_ids), drafter.block_size - 1)
    u, rows = _draft_uniforms(shape, seed, keys, start, anchor_ids.device), []

    def pick(slot: int, scores: torch.Tensor) -> torch.Tensor:
        rows.append(torch.softmax(scores.float() / sampling.temperature, dim=-1))
        return sample_from(rows[-1], u[:, slot])

    drafts, candidates = drafter.draft_path(cache, anchor_ids, anchor_positions, pick)
    return drafts, DraftQ(torch.stack(rows, dim=1), candidates)


def verify(draft: torch.Tensor, logits: torch.Tensor, sampling: Sampling, *, seed: int = 0,
           keys: torch.Tensor | None = None, start: torch.Tensor | None = None) -> Verdict:
    """Verify point-mass drafts [B, K−1] against target logits [B, K, V] (logits[:, i] predicts the token after
    block slot i).

    `keys` identify the sequences and `start` is the response index of the first drafted token, so that the
    random numbers used for a sequence do not depend on the batch it is verified in.
    """
    if sampling.greedy:
        posterior = logits.argmax(-1)
        accepted = _leading_true(draft == posterior[:, :-1])
        return Verdict(accepted, posterior.gather(1, accepted[:, None])[:, 0])
    return _verify(draft, None, logits, sampling, seed, keys, start)


def verify_sampled(draft: torch.Tensor, draft_probs: torch.Tensor, logits: torch.Tensor, sampling: Sampling, *,
                   seed: int = 0, keys: torch.Tensor | None = None, start: torch.Tensor | None = None,
                   draft_ids: torch.Tensor | None = None) -> Verdict:
    """Verify drafts [B, K−1] sampled from q = `draft_probs` [B, K−1, V] (`sample_draft`, so T > 0), or
    [B, K−1, k] over the token ids `draft_ids` [B, K−1, k] (`sample_chained_draft`), with the full rule;
    everything else as `verify`."""
    return _verify(draft, DraftQ(draft_probs, draft_ids), logits, sampling, seed, keys, start)


def next_token(logits: torch.Tensor, sampling: Sampling, *, seed: int = 0, keys: torch.Tensor | None = None,
               positions: torch.Tensor | None = None) -> torch.Tensor:
    """One target token per row from logits [B, V]: the autoregressive baseline's rule, and the first token."""
    if sampling.greedy:
        return logits.argmax(-1)
    b = logits.shape[0]
    keys = torch.arange(b, device=logits.device) if keys is None else keys
    positions = torch.zeros(b, dtype=torch.long, device=logits.device) if positions is None else positions
    return sample_from(target_probs(logits, sampling), keyed_uniform(seed, keys, positions, STREAM_TOKEN))


def _verify(draft: torch.Tensor, q: DraftQ | None, logits: torch.Tensor, sampling: Sampling,
            seed: int, keys: torch.Tensor | None, start: torch.Tensor | None) -> Verdict:
    """The sampled (T > 0) rule; q as sampled, or a point mass on each draft when None."""
    b, k1 = draft.shape
    keys, positions = _keyed_positions(b, k1 + 1, keys, start, draft.device)  # response index decided by each slot
    probs = target_probs(logits, sampling)  # [B, K, V]
    p_draft = probs[:, :-1].gather(-1, draft[..., None])[..., 0]
    coins = keyed_uniform(seed, keys[:, None], positions[:, :-1], STREAM_ACCEPT)
    if q is None:
        accepted = _leading_true(coins < p_draft)
    else:  # u < min(1, p/q), written without the division: q(d) > 0 for a token drawn from q
        accepted = _leading_true(coins * prob_of(q, draft) < p_draft)
    # The bonus comes from the residual at the first rejected slot, or from p after the last slot when everything
    # was accepted. Only the one row it needs is formed, so no [B, K−1, V] residual is ever held.
    rows, slot = torch.arange(b, device=draft.device), accepted.clamp_max(k1 - 1)
    p_bonus = probs[rows, accepted]
    if q is None:
        residual = p_bonus.scatter(-1, draft[rows, slot][:, None], 0.0)  # p with the rejected token removed
    else:
        residual = _residual(p_bonus, q.probs[rows, slot], None if q.ids is None else q.ids[rows, slot])
    p_bonus = torch.where((accepted < k1)[:, None], residual, p_bonus)
    u = keyed_uniform(seed, keys, positions.gather(1, accepted[:, None])[:, 0], STREAM_TOKEN)
    return Verdict(accepted, sample_from(p_bonus, u))


def _draft_uniforms(shape: tuple[int, ...], seed: int, keys: torch.Tensor | None, start: torch.Tensor | None,
                    device: torch.device) -> torch.Tensor:
    """The uniforms [B, K−1] a block's sampled drafts are drawn with: slot k draws at response index start + k."""
    keys, positions = _keyed_positions(shape[0], shape[1], keys, start, device)
    return keyed_uniform(seed, keys[:, None], positions, STREAM_DRAFT)


def prob_of(q: DraftQ, tokens: torch.Tensor) -> torch.Tensor:
    """q(token) [...] of tokens [...] (zero for a token outside a sparse q's candidates); differentiable, so the
    acceptance objectives' score-function term reads it too."""
    if q.ids is None:
        return q.probs.gather(-1, tokens[..., None])[..., 0]
    return (q.probs * (q.ids == tokens[..., None])).sum(-1)


def _keyed_positions(b: int, width: int, keys: torch.Tensor | None, start: torch.Tensor | None,
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence keys [B] (default 0..B−1) and the response indices [B, width] from `start` (default 0) on."""
    keys = torch.arange(b, device=device) if keys is None else keys
    start = torch.zeros(b, dtype=torch.long, device=device) if start is None else start
    return keys, start[:, None] + torch.arange(width, device=device)


def _residual(p: torch.Tensor, q: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
    """max(0, p − q) (sample_from normalises): the law of the token emitted on rejecting a draft sampled from q,
    rows [B, V] of p and q, or q [B, k] over the token ids `ids` [B, k] (then p itself outside them).

    It has no mass only when p and q agree up to rounding, where a rejection is itself a rounding artefact; p is
    then the right law, and sampling an all-zero row would pick an arbitrary token.
    """
    residual = (p - q if ids is None else p.scatter_add(-1, ids, -q.to(p.dtype))).clamp_min(0.0)
    return torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)


def _leading_true(mask: torch.Tensor) -> torch.Tensor:
    """Length of the all-True prefix of each row."""
    return mask.long().cumprod(-1).sum(-1)
