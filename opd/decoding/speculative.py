"""Batched, lossless speculative decoding with any drafter family (DFlash, EAGLE-3), recording what Draft-OPD
trains on.

One step per batch: the drafter drafts K−1 tokens after each row's anchor from its cached target context, the
target verifies the K-token block [anchor, drafts] in one forward, `verify` decides how many drafts each row
keeps, and both caches advance. Drafts are the drafter's argmax or, with `Sampling.sample_drafts` (T > 0),
samples from its q, which verification then needs too. Rows accept different amounts, so each row's kept slots
are packed to the left of both caches after every step (`compaction.py`): prompts are right-padded, row b uses
its first used[b] columns (prompt + committed tokens, the pending anchor excepted) and its free columns are
masked (the target gets a 2-D attention mask and explicit position ids; the drafter cache has a `valid` flag).
The caches are as long as the longest row's text, not K columns per step. A row's output depends only on its
own tokens and its own keyed random numbers, never on its neighbours' acceptance.

`static_cache=True` is EXPERIMENTAL and off by default: it keeps one shape for the whole batch, which CUDA graphs
and torch.compile(mode="reduce-overhead") would need, but nothing here compiles or captures a graph, so today
it only costs memory. The target KV cache is an HF `StaticCache` and the drafter cache is preallocated, both
sized prompt width + K x (max_new_tokens - 1) (prefill commits one token and every step at least one more, so
no row needs more than max_new_tokens - 1 steps); the block's rejected slots stay as masked holes, the 2-D
attention mask spans that whole length (unwritten slots are zeros), and finished rows stay in the batch, their
outputs ignored. Each step writes the same K slots of every row: the cache's own write counter advances by K,
which is the `cache_position` that transformers 5 no longer takes as an argument.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import AbstractContextManager, nullcontext

import torch
from transformers.cache_utils import StaticCache

from opd.decoding.batch import right_pad
from opd.decoding.compaction import compact, crop, row_mask
from opd.decoding.record import SequenceRecord
from opd.decoding.recurrent import RecurrentRollback, select_rows
from opd.decoding.sampling import Sampling
from opd.decoding.verify import DraftQ, next_token, sample_chained_draft, sample_draft, verify, verify_sampled
from opd.errors import OpdError
from opd.models.deltanet import linear_layers
from opd.models.family import Drafter, chains
from opd.models.target import Target


class SpeculativeDecoder:
    """Owns a target and a drafter; the drafter's weights can be swapped between calls (`load_drafter`)."""

    def __init__(self, target: Target, drafter: Drafter, *, eos_id: int, draft_version: int = 0,
                 static_cache: bool = False) -> None:
        if static_cache and target.windowed:
            raise OpdError("rollout.static_cache: not with a target that has sliding-window layers (a static "
                           "cache's sliding layers count the window in slots, and the rejected slots stay as holes); "
                           "expected static_cache: false")
        if static_cache and linear_layers(target.model):
            raise OpdError("rollout.static_cache: not with a target that has linear-attention layers (their "
                           "recurrent states are rolled back per row in a growing cache); expected static_cache: false")
        self.target, self.drafter, self.eos_id = target, drafter, eos_id
        self.rollback = RecurrentRollback(target.model) if linear_layers(target.model) else None
        self.draft_version, self.static_cache = draft_version, static_cache
        self.timings: dict[str, float] = defaultdict(float)  # seconds per phase, accumulated over calls

    def load_drafter(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Adopt new draft weights in place (all tensors are copied before the version changes)."""
        self.drafter.load_state_dict(state_dict)
        self.draft_version = version

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling: Sampling, *, max_new_tokens: int, seed: int = 0,
                 keys: list[int] | None = None) -> list[SequenceRecord]:
        """Decode every prompt to eos or `max_new_tokens`; one record per prompt, in order."""
        keys = list(keys) if keys is not None else list(range(len(prompts)))
        records = [SequenceRecord(key=k, prompt_ids=list(p), draft_version=self.draft_version)
                   for k, p in zip(keys, prompts)]
        state = self._prefill(prompts, keys, sampling, seed, max_new_tokens)
        for rec, token in zip(records, state.anchor.tolist()):
            rec.response_ids.append(token)
        self._drop_finished(state, records, max_new_tokens)
        while bool(state.live.any()):
            self._step(state, records, sampling, seed, max_new_tokens)
        for rec in records:
            _finish(rec, self.eos_id, max_new_tokens)
        return records

    # -- phases ------------------------------------------------------------------------------------------------

    def _prefill(self, prompts: list[list[int]], keys: list[int], sampling: Sampling, seed: int,
                 max_new_tokens: int) -> _State:
        t0 = time.perf_counter()
        device = self.target.device
        ids, mask = right_pad(prompts, pad_id=self.eos_id, device=device)
        used = mask.sum(-1)
        positions = (mask.cumsum(-1) - 1).clamp_min(0)
        capacity = ids.shape[1] + self.drafter.block_size * (max_new_tokens - 1) if self.static_cache else None
        target_cache, full_mask = None, mask
        if capacity is not None:
            target_cache = StaticCache(config=self.target.config, max_cache_len=capacity)
            full_mask = torch.cat([mask, mask.new_zeros(len(prompts), capacity - ids.shape[1])], 1)
        prefill = nullcontext()
        if self.rollback is not None:
            target_cache = self.rollback.new_cache()
            prefill = self.rollback.prefill(target_cache, used, ids.shape[1])
        with prefill:
            out = self.target(ids, attention_mask=full_mask, position_ids=positions, past_key_values=target_cache,
                              use_cache=True)
        keys_t = torch.tensor(keys, device=device)
        last = out.logits[torch.arange(len(prompts), device=device), used - 1]
        first = next_token(last, sampling, seed=seed, keys=keys_t, positions=torch.zeros_like(keys_t))
        draft_cache = self.drafter.new_cache(len(prompts), capacity)
        next_ids = torch.cat([ids[:, 1:], ids[:, :1]], 1).scatter_(1, (used - 1)[:, None], first[:, None])
        self.drafter.extend_cache(draft_cache, out.features, positions, mask.bool(), next_ids)
        self.timings["verify"] += time.perf_counter() - t0
        return _State(rows=torch.arange(len(prompts), device=device), keys=keys_t,
                      target_cache=out.past_key_values, target_mask=full_mask if self.static_cache else None,
                      filled=ids.shape[1], used=used,
                      draft_cache=draft_cache, anchor=first, anchor_pos=used.clone(),
                      response_len=torch.ones(len(prompts), dtype=torch.long, device=device),
                      live=torch.ones(len(prompts), dtype=torch.bool, device=device))

    def _step(self, s: _State, records: list[SequenceRecord], sampling: Sampling, seed: int,
              max_new_tokens: int) -> None:
        clock = [time.perf_counter()]
        drafts, draft_q = self._draft(s, sampling, seed)
        clock.append(time.perf_counter())
        k = drafts.shape[1] + 1
        block = torch.cat([s.anchor[:, None], drafts], 1)
        block_pos = s.anchor_pos[:, None] + torch.arange(k, device=block.device)
        with self._recording():
            out = self.target(block, attention_mask=self._block_mask(s, k), position_ids=block_pos,
                              past_key_values=s.target_cache, use_cache=True)
        clock.append(time.perf_counter())
        # The response index decided by drafted slot 0 is the anchor's index + 1 = current response length.
        if draft_q is None:
            verdict = verify(drafts, out.logits, sampling, seed=seed, keys=s.keys, start=s.response_len)
        else:
            verdict = verify_sampled(drafts, draft_q.probs, out.logits, sampling, seed=seed, keys=s.keys,
                                     start=s.response_len, draft_ids=draft_q.ids)
        kept = torch.arange(k, device=block.device)[None, :] <= verdict.accepted[:, None]  # anchor + accepted
        if self.rollback is not None:
            self.rollback.keep(out.past_key_values, verdict.accepted + 1)
        clock.append(time.perf_counter())
        # The token after slot j is draft j+1 for the kept drafts and the bonus after the last kept slot.
        next_ids = torch.cat([drafts, verdict.bonus[:, None]], 1).scatter_(1, verdict.accepted[:, None],
                                                                           verdict.bonus[:, None])
        self.drafter.extend_cache(s.draft_cache, out.features, block_pos, kept, next_ids)
        clock.append(time.perf_counter())
        s.target_cache = out.past_key_values
        self._keep_slots(s, kept, verdict.accepted + 1)
        self._record(s, records, drafts, verdict.accepted, verdict.bonus)
        s.anchor, s.anchor_pos = verdict.bonus, s.anchor_pos + verdict.accepted + 1
        s.response_len = s.response_len + verdict.accepted + 1
        self._drop_finished(s, records, max_new_tokens)
        clock.append(time.perf_counter())
        # "draft" and "verify" are the two models' forwards; everything else is bookkeeping.
        self.timings["draft"] += (clock[1] - clock[0]) + (clock[4] - clock[3])
        self.timings["verify"] += clock[2] - clock[1]
        self.timings["bookkeeping"] += (clock[3] - clock[2]) + (clock[5] - clock[4])
        self.timings["steps"] += 1

    def _recording(self) -> AbstractContextManager:
        """Where the target has linear-attention layers, a forward that keeps their per-position states."""
        return nullcontext() if self.rollback is None else self.rollback.recording()

    def _draft(self, s: _State, sampling: Sampling, seed: int) -> tuple[torch.Tensor, DraftQ | None]:
        """This step's drafts [B, K−1] and, when they were sampled, the q they were sampled from (None for the
        argmax drafts, whose logits verification does not need)."""
        sampled = sampling.sample_drafts and not sampling.greedy
        # The response index decided by drafted slot 0 is the anchor's index + 1 = current response length.
        if sampled and chains(self.drafter):
            return sample_chained_draft(self.drafter, s.draft_cache, s.anchor, s.anchor_pos, sampling, seed=seed,
                                        keys=s.keys, start=s.response_len)
        drafts, logits = self.drafter.draft(s.draft_cache, s.anchor, s.anchor_pos)
        if not sampled:
            return drafts, None
        drafts, q = sample_draft(logits, sampling, seed=seed, keys=s.keys, start=s.response_len)
        return drafts, DraftQ(q)

    def _block_mask(self, s: _State, k: int) -> torch.Tensor:
        """The target's 2-D mask for verifying a K-token block: every row's used columns plus the block itself
        (appended after the cache's last column)."""
        if not self.static_cache:
            used = row_mask(s.used, s.target_cache.get_seq_length())
            return torch.cat([used, used.new_ones(len(s.rows), k)], 1)
        s.target_mask[:, s.filled : s.filled + k] = 1
        return s.target_mask

    def _keep_slots(self, s: _State, kept: torch.Tensor, count: torch.Tensor) -> None:
        """Keep each row's anchor and accepted drafts (`kept` [B, K], `count` of them per row): packed to the
        left of both caches, or, in a static cache, left in place with the rejected slots as masked holes."""
        if self.static_cache:
            s.target_mask[:, s.filled : s.filled + len(kept[0])] = kept.long()
            s.filled += len(kept[0])
            return
        s.used = compact(s.target_cache, s.draft_cache, s.used, count, len(kept[0]))

    def _record(self, s: _State, records: list[SequenceRecord], drafts: torch.Tensor, accepted: torch.Tensor,
                bonus: torch.Tensor) -> None:
        """Append this step's facts; the committed tokens are the accepted drafts followed by the bonus.

        Finished rows that stay in a static batch are skipped: their tokens are meaningless."""
        for row, live, anchor_idx, block, r, b in zip(s.rows.tolist(), s.live.tolist(),
                                                       (s.response_len - 1).tolist(), drafts.tolist(),
                                                       accepted.tolist(), bonus.tolist()):
            if not live:
                continue
            rec = records[row]
            rec.anchors.append(anchor_idx)
            rec.drafts.append(block)
            rec.accepted.append(r)
            rec.response_ids.extend(block[:r] + [b])

    def _drop_finished(self, s: _State, records: list[SequenceRecord], max_new_tokens: int) -> None:
        """Rows that emitted eos or hit the length limit leave the batch, so they cost no more compute; with a
        static cache they stay (shapes must not change) and are only marked finished."""
        done = [i for i, row in enumerate(s.rows.tolist())
                if self.eos_id in records[row].response_ids or len(records[row].response_ids) >= max_new_tokens]
        if not done:
            return
        if self.static_cache:
            s.live[done] = False
            return
        keep = torch.tensor(sorted(set(range(len(s.rows))) - set(done)), dtype=torch.long, device=s.rows.device)
        s.select(keep)
        if len(keep):
            crop(s.target_cache, s.draft_cache, s.used)


def _finish(rec: SequenceRecord, eos_id: int, max_new_tokens: int) -> None:
    """Cut a response at the length limit and after its first eos, say why it stopped, and count only the
    accepted drafts inside the response (the last block may have committed past either point)."""
    rec.response_ids = rec.response_ids[:max_new_tokens]
    if eos_id in rec.response_ids:
        rec.response_ids = rec.response_ids[: rec.response_ids.index(eos_id) + 1]
        rec.finish_reason = "eos"
    else:
        rec.finish_reason = "length"
    rec.clip_to_response()


class _State:
    """Per-batch tensors of the rows in the batch; `rows` maps them back to the caller's prompt order, `live`
    says which still decode (all of them unless a static cache keeps finished rows), `used` counts each row's
    packed cache columns (growing caches), `filled` the slots written and `target_mask` the mask (static)."""

    def __init__(self, *, rows, keys, target_cache, target_mask, filled, used, draft_cache, anchor, anchor_pos,
                 response_len, live) -> None:
        self.rows, self.keys, self.live = rows, keys, live
        self.target_cache, self.target_mask, self.filled, self.used = target_cache, target_mask, filled, used
        self.draft_cache = draft_cache
        self.anchor, self.anchor_pos, self.response_len = anchor, anchor_pos, response_len

    def select(self, keep: torch.Tensor) -> None:
        for name in ("rows", "keys", "live", "used", "anchor", "anchor_pos", "response_len"):
            setattr(self, name, getattr(self, name)[keep])
        if len(keep):
            select_rows(self.target_cache, keep)
            self.draft_cache.select(keep)
