"""The target-only baseline: batched autoregressive decoding with a KV cache.

It shares the sampling rule and the keyed random numbers with speculative decoding, so the two are compared on
equal terms (speedup) and, greedily, must emit identical tokens.
"""

from __future__ import annotations

import torch

from opd.decoding.batch import left_pad
from opd.decoding.sampling import Sampling
from opd.decoding.verify import next_token
from opd.models.target import Target


@torch.no_grad()
def generate_autoregressive(target: Target, prompts: list[list[int]], sampling: Sampling, *, max_new_tokens: int,
                            eos_id: int, seed: int = 0, keys: list[int] | None = None) -> list[list[int]]:
    """Response token ids per prompt (eos included when it was emitted)."""
    device = target.device
    ids, mask = left_pad(prompts, pad_id=eos_id, device=device)
    keys_t = torch.tensor(keys if keys is not None else range(len(prompts)), device=device)
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    out = target(ids, attention_mask=mask, position_ids=positions, use_cache=True)
    cache, next_pos = out.past_key_values, positions[:, -1] + 1
    logits = out.logits[:, -1]
    responses = torch.empty(len(prompts), 0, dtype=torch.long, device=device)
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    for step in range(max_new_tokens):
        token = next_token(logits, sampling, seed=seed, keys=keys_t, positions=torch.full_like(keys_t, step))
        token = torch.where(done, eos_id, token)
        responses = torch.cat([responses, token[:, None]], 1)
        done |= token == eos_id
        if bool(done.all()) or step + 1 == max_new_tokens:
            break
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
        out = target(token[:, None], attention_mask=mask, position_ids=next_pos[:, None], past_key_values=cache,
                     use_cache=True)
        cache, next_pos, logits = out.past_key_values, next_pos + 1, out.logits[:, -1]
    return [_cut_at_eos(row, eos_id) for row in responses.tolist()]


def _cut_at_eos(row: list[int], eos_id: int) -> list[int]:
    return row[: row.index(eos_id) + 1] if eos_id in row else row
