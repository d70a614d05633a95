"""The lossless acceptance rule for a greedy (point-mass) DFlash draft.

For a point-mass draft d, the Leviathan/Chen rule "accept with min(1, p(d)/q(d)), else sample norm(max(0, p−q))"
becomes: accept d with probability p(d); on rejection sample from p with d removed. Whatever the drafter
proposes, every emitted token is then distributed exactly as the target's p. Greedy decoding is the T → 0 limit:
accept while d equals the target's argmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from opd.decoding.sampling import Sampling, keyed_uniform, sample_from, target_probs

# Keyed random streams (see sampling.py): one for accept/reject coins, one for the token emitted at a position.
STREAM_ACCEPT, STREAM_TOKEN = 1, 2


@dataclass
class Verdict:
    accepted: torch.Tensor  # [B] drafted tokens kept, 0..K−1
    bonus: torch.Tensor  # [B] the target's own token after the accepted prefix (the next anchor)


def verify(draft: torch.Tensor, logits: torch.Tensor, sampling: Sampling, *, seed: int = 0,
           keys: torch.Tensor | None = None, start: torch.Tensor | None = None) -> Verdict:
    """Verify drafts [B, K−1] against target logits [B, K, V] (logits[:, i] predicts the token after block slot i).

    `keys` identify the sequences and `start` is the response index of the first drafted token, so that the
    random numbers used for a sequence do not depend on the batch it is verified in.
    """
    if sampling.greedy:
        posterior = logits.argmax(-1)
        accepted = _leading_true(draft == posterior[:, :-1])
        return Verdict(accepted, posterior.gather(1, accepted[:, None])[:, 0])
    b, k1 = draft.shape
    keys = torch.arange(b, device=draft.device) if keys is None else keys
    start = torch.zeros(b, dtype=torch.long, device=draft.device) if start is None else start
    positions = start[:, None] + torch.arange(k1 + 1, device=draft.device)  # response index decided by each slot
    probs = target_probs(logits, sampling)  # [B, K, V]
    p_draft = probs[:, :-1].gather(-1, draft[..., None])[..., 0]
    coins = keyed_uniform(seed, keys[:, None], positions[:, :-1], STREAM_ACCEPT)
    accepted = _leading_true(coins < p_draft)
    # The bonus comes from p at the first rejected slot with the rejected token removed, or from p after the
    # last slot when everything was accepted.
    p_bonus = probs[torch.arange(b), accepted]
    rejected = accepted < k1
    removed = draft.gather(1, accepted.clamp_max(k1 - 1)[:, None])[:, 0]
    p_bonus = torch.where(rejected[:, None], p_bonus.scatter(-1, removed[:, None], 0.0), p_bonus)
    u = keyed_uniform(seed, keys, positions.gather(1, accepted[:, None])[:, 0], STREAM_TOKEN)
    return Verdict(accepted, sample_from(p_bonus, u))


def next_token(logits: torch.Tensor, sampling: Sampling, *, seed: int = 0, keys: torch.Tensor | None = None,
               positions: torch.Tensor | None = None) -> torch.Tensor:
    """One target token per row from logits [B, V]: the autoregressive baseline's rule, and the first token."""
    if sampling.greedy:
        return logits.argmax(-1)
    b = logits.shape[0]
    keys = torch.arange(b, device=logits.device) if keys is None else keys
    positions = torch.zeros(b, dtype=torch.long, device=logits.device) if positions is None else positions
    return sample_from(target_probs(logits, sampling), keyed_uniform(seed, keys, positions, STREAM_TOKEN))


def _leading_true(mask: torch.Tensor) -> torch.Tensor:
    """Length of the all-True prefix of each row."""
    return mask.long().cumprod(-1).sum(-1)
