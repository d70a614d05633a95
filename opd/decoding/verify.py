"""The lossless acceptance rules for a DFlash draft: point-mass (argmax) drafts, or drafts sampled from q.

The Leviathan/Chen rule is "accept d with min(1, p(d)/q(d)), else sample norm(max(0, p−q))". For a point-mass
draft it becomes: accept d with probability p(d); on rejection sample from p with d removed. With
`Sampling.sample_drafts` each drafted slot k is instead sampled from q_k, the drafter's logits shaped like the
target's (`sample_draft`), and verified with the full rule (`verify_sampled`). DFlash drafts all slots in
parallel from [anchor, MASK...], so q_k does not depend on d_<k; the rule needs only that d_k ~ q_k
independently of the coins. Either way every emitted token is distributed exactly as the target's p. Greedy
decoding is the T → 0 limit: accept while d equals the target's argmax (drafts stay argmax; `sample_drafts` is
ignored).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from opd.decoding.sampling import Sampling, keyed_uniform, sample_from, target_probs

# Keyed random streams (see sampling.py): accept/reject coins, the token the target emits at a position, and the
# token a sampled draft proposes for it.
STREAM_ACCEPT, STREAM_TOKEN, STREAM_DRAFT = 1, 2, 3


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
    keys, positions = _keyed_positions(draft_logits.shape[0], draft_logits.shape[1], keys, start,
                                       draft_logits.device)
    return sample_from(q, keyed_uniform(seed, keys[:, None], positions, STREAM_DRAFT)), q


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
                   seed: int = 0, keys: torch.Tensor | None = None, start: torch.Tensor | None = None) -> Verdict:
    """Verify drafts [B, K−1] sampled from q = `draft_probs` [B, K−1, V] (`sample_draft`, so T > 0) with the full
    rule; everything else as `verify`."""
    return _verify(draft, draft_probs, logits, sampling, seed, keys, start)


def next_token(logits: torch.Tensor, sampling: Sampling, *, seed: int = 0, keys: torch.Tensor | None = None,
               positions: torch.Tensor | None = None) -> torch.Tensor:
    """One target token per row from logits [B, V]: the autoregressive baseline's rule, and the first token."""
    if sampling.greedy:
        return logits.argmax(-1)
    b = logits.shape[0]
    keys = torch.arange(b, device=logits.device) if keys is None else keys
    positions = torch.zeros(b, dtype=torch.long, device=logits.device) if positions is None else positions
    return sample_from(target_probs(logits, sampling), keyed_uniform(seed, keys, positions, STREAM_TOKEN))


def _verify(draft: torch.Tensor, draft_probs: torch.Tensor | None, logits: torch.Tensor, sampling: Sampling,
            seed: int, keys: torch.Tensor | None, start: torch.Tensor | None) -> Verdict:
    """The sampled (T > 0) rule; q = `draft_probs`, or a point mass on each draft when None."""
    b, k1 = draft.shape
    keys, positions = _keyed_positions(b, k1 + 1, keys, start, draft.device)  # response index decided by each slot
    probs = target_probs(logits, sampling)  # [B, K, V]
    p_draft = probs[:, :-1].gather(-1, draft[..., None])[..., 0]
    coins = keyed_uniform(seed, keys[:, None], positions[:, :-1], STREAM_ACCEPT)
    if draft_probs is None:
        accepted = _leading_true(coins < p_draft)
    else:  # u < min(1, p/q), written without the division: q(d) > 0 for a token drawn from q
        accepted = _leading_true(coins * draft_probs.gather(-1, draft[..., None])[..., 0] < p_draft)
    # The bonus comes from the residual at the first rejected slot, or from p after the last slot when everything
    # was accepted. Only the one row it needs is formed, so no [B, K−1, V] residual is ever held.
    rows, slot = torch.arange(b, device=draft.device), accepted.clamp_max(k1 - 1)
    p_bonus = probs[rows, accepted]
    if draft_probs is None:
        residual = p_bonus.scatter(-1, draft[rows, slot][:, None], 0.0)  # p with the rejected token removed
    else:
        residual = _residual(p_bonus, draft_probs[rows, slot])
    p_bonus = torch.where((accepted < k1)[:, None], residual, p_bonus)
    u = keyed_uniform(seed, keys, positions.gather(1, accepted[:, None])[:, 0], STREAM_TOKEN)
    return Verdict(accepted, sample_from(p_bonus, u))


def _keyed_positions(b: int, width: int, keys: torch.Tensor | None, start: torch.Tensor | None,
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence keys [B] (default 0..B−1) and the response indices [B, width] from `start` (default 0) on."""
    keys = torch.arange(b, device=device) if keys is None else keys
    start = torch.zeros(b, dtype=torch.long, device=device) if start is None else start
    return keys, start[:, None] + torch.arange(width, device=device)


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """max(0, p − q) (sample_from normalises): the law of the token emitted on rejecting a draft sampled from q.

    It has no mass only when p and q agree up to rounding, where a rejection is itself a rounding artefact; p is
    then the right law, and sampling an all-zero row would pick an arbitrary token.
    """
    residual = (p - q).clamp_min(0.0)
    return torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)


def _leading_true(mask: torch.Tensor) -> torch.Tensor:
    """Length of the all-True prefix of each row."""
    return mask.long().cumprod(-1).sum(-1)
