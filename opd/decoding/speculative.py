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

`static_cache=True` is off by default: it keeps one shape for the whole batch, which torch.compile and CUDA
graphs need. The target KV cache is an HF `StaticCache` and the drafter cache is preallocated, both sized prompt
width + max_new_tokens + 2K; each step writes the same K slots of every row after the longest row, then packs
each row's kept slots in place (`compact_static`) and rewinds both write counters, so a row's text stays packed
as in the growing caches. The 2-D attention mask spans the whole capacity (free columns are zeros), and
finished rows stay in the batch, their outputs ignored and their caches no longer growing.

`compiled=True` (off by default; needs `static_cache`) runs the verify forward and the draft forward through
`torch.compile`: both then see one shape per batch size and cache capacity, so each compiles once. The capacity
is rounded up to a multiple of `CAPACITY_STEP` so that batches whose prompts differ a little in length share
the compiled code. Prefill, verification's rule and the bookkeeping stay eager (prefill's shape changes with
every batch). Drafts sampled along a chain (DFlash 2's `sample_chained_draft`) are drafted eagerly.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from transformers.cache_utils import StaticCache

from opd.decoding.batch import right_pad
from opd.decoding.compaction import compact, compact_static, crop, row_mask
from opd.decoding.record import SequenceRecord
from opd.decoding.sampling import Sampling
from opd.decoding.verify import DraftQ, next_token, sample_chained_draft, sample_draft, verify, verify_sampled
from opd.errors import OpdError
from opd.models.drafter_cache import DrafterCache
from opd.models.layer_kind import TargetKinds
from opd.models.protocol import Drafter, chains
from opd.models.target import ReadyBlock, Target

CAPACITY_STEP = 256  # a compiled decoder's cache capacities are multiples of this, so batches share compiled code


class SpeculativeDecoder:
    """Owns a target and a drafter; the drafter's weights can be swapped between calls (`load_drafter`)."""

    def __init__(self, target: Target, drafter: Drafter, *, eos_id: int, draft_version: int = 0,
                 static_cache: bool = False, compiled: bool | str = False) -> None:
        """`compiled`: False (eager), True (torch.compile with inductor) or the name of a torch.compile backend."""
        if compiled and not static_cache:
            raise OpdError("compiled decoding needs static_cache=True (torch.compile needs one shape per batch); "
                           "expected static_cache=True or compiled=False")
        problem = target.kinds.static_cache_problem() if static_cache else None
        if problem:
            raise OpdError(f"rollout.static_cache: not with {problem}; expected static_cache: false")
        self.target, self.drafter, self.eos_id = target, drafter, eos_id
        self.rollback = target.kinds.rollback(target.model)  # a recurrent kind's per-row rollback, or None
        self.draft_version, self.static_cache, self.compiled = draft_version, static_cache, compiled
        self.timings: dict[str, float] = defaultdict(float)  # seconds per phase, accumulated over calls
        self._verify_forward, self._draft_forward = self._target_forward, self._drafter_forward
        if compiled:
            backend = "inductor" if compiled is True else compiled
            self._verify_forward = torch.compile(self._target_forward, backend=backend, dynamic=False)
            self._draft_forward = torch.compile(self._drafter_forward, backend=backend, dynamic=False)

    def _target_forward(self, block: torch.Tensor, mask: torch.Tensor | ReadyBlock | None, positions: torch.Tensor,
                        cache: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The verify forward (logits [B,K,V], features [B,K,n*H]); the cache is updated in place."""
        out = self.target(block, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True)
        return out.logits, out.features

    def _drafter_forward(self, cache: DrafterCache, anchor: torch.Tensor, anchor_pos: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft forward: (drafts [B,K−1], logits [B,K−1,V])."""
        return self.drafter.draft(cache, anchor, anchor_pos)

    def load_drafter(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Adopt new draft weights in place (all tensors are copied before the version changes)."""
        self.drafter.load_state_dict(state_dict)
        self.draft_version = version

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], sampling: Sampling, *, max_new_tokens: int, seed: int = 0,
                 keys: list[int] | None = None) -> list[SequenceRecord]:
        """Decode every prompt to eos or `max_new_tokens`; one record per prompt, in order.

        Inference mode, not only no_grad: no tensor made here is ever seen by autograd (the records hold plain
        ints), and skipping its version counters and view tracking trims every op of a step's forwards."""
        keys = list(keys) if keys is not None else list(range(len(prompts)))
        records = [SequenceRecord(key=k, prompt_ids=list(p), draft_version=self.draft_version)
                   for k, p in zip(keys, prompts)]
        state = self._prefill(prompts, keys, sampling, seed, max_new_tokens)
        for rec, token in zip(records, state.anchor.tolist()):
            rec.response_ids.append(token)
        self._drop([i for i, rec in enumerate(records) if _done(rec, self.eos_id, max_new_tokens)], state)
        while any(state.live):
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
        used = [len(p) for p in prompts]
        positions = (mask.cumsum(-1) - 1).clamp_min(0)
        # A live row holds < prompt + max_new_tokens columns, a finishing step adds up to K, the next block K more.
        capacity = ids.shape[1] + max_new_tokens + 2 * self.drafter.block_size if self.static_cache else None
        if capacity is not None and self.compiled:
            capacity = -(-capacity // CAPACITY_STEP) * CAPACITY_STEP
        target_cache, full_mask = None, mask
        if capacity is not None:
            target_cache = StaticCache(config=self.target.config, max_cache_len=capacity)
            full_mask = torch.cat([mask, mask.new_zeros(len(prompts), capacity - ids.shape[1])], 1)
        prefill = nullcontext()
        if self.rollback is not None:
            target_cache = self.rollback.new_cache()
            prefill = self.rollback.prefill(target_cache, mask.sum(-1), ids.shape[1])
        last = mask.sum(-1) - 1
        with prefill:  # logits only at each prompt's last token, as HF's `generate` and z-lab's prefill form them
            out = self.target(ids, attention_mask=full_mask, position_ids=positions, past_key_values=target_cache,
                              use_cache=True, logits_to_keep=last[:, None])
        keys_t = torch.tensor(keys, device=device)
        first = next_token(out.logits[:, 0], sampling, seed=seed, keys=keys_t, positions=torch.zeros_like(keys_t))
        draft_cache = self.drafter.new_cache(len(prompts), capacity)
        next_ids = torch.cat([ids[:, 1:], ids[:, :1]], 1).scatter_(1, last[:, None], first[:, None])
        self.drafter.extend_cache(draft_cache, out.features, positions, mask.bool(), next_ids)
        draft_cache.dense = capacity is None and min(used) == max(used)
        self.timings["verify"] += time.perf_counter() - t0
        return _State(rows=list(range(len(prompts))), keys=keys_t,
                      target_cache=out.past_key_values, target_mask=full_mask if self.static_cache else None,
                      filled=ids.shape[1], used=used,
                      draft_cache=draft_cache, anchor=first, anchor_pos=last + 1,
                      response_len=torch.ones(len(prompts), dtype=torch.long, device=device),
                      live=[True] * len(prompts))

    def _step(self, s: _State, records: list[SequenceRecord], sampling: Sampling, seed: int,
              max_new_tokens: int) -> None:
        clock = [time.perf_counter()]
        drafts, draft_q = self._draft(s, sampling, seed)
        clock.append(time.perf_counter())
        k = drafts.shape[1] + 1
        offsets = torch.arange(k, device=drafts.device)
        block = torch.cat([s.anchor[:, None], drafts], 1)
        block_pos = s.anchor_pos[:, None] + offsets
        with self._recording():
            logits, features = self._verify_forward(block, self._block_mask(s, k), block_pos, s.target_cache)
        clock.append(time.perf_counter())
        # The response index decided by drafted slot 0 is the anchor's index + 1 = current response length.
        if draft_q is None:
            verdict = verify(drafts, logits, sampling, seed=seed, keys=s.keys, start=s.response_len)
        else:
            verdict = verify_sampled(drafts, draft_q.probs, logits, sampling, seed=seed, keys=s.keys,
                                     start=s.response_len, draft_ids=draft_q.ids)
        # The one host transfer of a step: per row, accepted, bonus and the drafts, for the records and the caches.
        facts = torch.cat([verdict.accepted[:, None], verdict.bonus[:, None], drafts], 1).tolist()
        accepted = [row[0] for row in facts]
        # Slots past every row's kept ones are rejected everywhere: the drafter's context never needs them (a static
        # cache writes all K, so that its shapes never change).
        width = k if self.static_cache else max(accepted) + 1
        if width == min(accepted) + 1:  # every row keeps all `width` (always at batch 1): no comparison to make
            kept = torch.ones(len(accepted), width, dtype=torch.bool, device=drafts.device)
        else:
            kept = offsets[None, :width] <= verdict.accepted[:, None]  # anchor + accepted
        if self.rollback is not None:
            self.rollback.keep(s.target_cache, verdict.accepted + 1)
        clock.append(time.perf_counter())
        # The token after slot j is draft j+1 for the kept drafts and the bonus after the last kept slot.
        next_ids = None
        if self.drafter.reads_next_ids:
            next_ids = torch.cat([drafts, verdict.bonus[:, None]], 1).scatter_(1, verdict.accepted[:, None],
                                                                               verdict.bonus[:, None])[:, :width]
        # Deferred: the next draft projects this context in its own forward. A compiled draft keeps one graph per
        # shape, so there the context is projected now, outside it.
        extend = self.drafter.extend_cache if self.compiled else self.drafter.defer_context
        extend(s.draft_cache, features[:, :width], block_pos[:, :width], kept, next_ids)
        clock.append(time.perf_counter())
        self._keep_slots(s, kept, accepted, k)
        done = self._record(s, records, facts, max_new_tokens)
        committed = verdict.accepted + 1
        s.anchor, s.anchor_pos, s.response_len = verdict.bonus, s.anchor_pos + committed, s.response_len + committed
        self._drop(done, s)
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
        drafts, logits = self._draft_forward(s.draft_cache, s.anchor, s.anchor_pos)
        if not sampled:
            return drafts, None
        drafts, q = sample_draft(logits, sampling, seed=seed, keys=s.keys, start=s.response_len)
        return drafts, DraftQ(q)

    def _block_mask(self, s: _State, k: int) -> torch.Tensor | ReadyBlock | None:
        """The target's mask for verifying a K-token block. Where every row uses every column (always at batch 1):
        its ready block (`Target.ready_block`: the model's own causal mask, or its kinds' narrowed ones, and the
        rotary embeddings, without rebuilding them every step), else None where no kind narrows its keys (the
        model's own causal mask is then the same, and it is how z-lab's decoder calls the target). Otherwise the
        2-D mask of every row's used columns plus the block itself (appended after the cache's last column), from
        which `kind_masks` narrows a narrowing kind's."""
        if not self.static_cache:
            if min(s.used) == max(s.used):
                ready = self.target.ready_block(s.used[0], k)
                if ready is not None or not self.target.narrowed:
                    return ready
            used = row_mask(s.used, s.target_cache.get_seq_length(), s.anchor.device)
            return torch.cat([used, used.new_ones(len(s.rows), k)], 1)
        assert s.target_mask is not None  # a static cache's state always has its mask (_State's construction)
        s.target_mask[:, s.filled : s.filled + k] = 1
        return s.target_mask

    def _keep_slots(self, s: _State, kept: torch.Tensor, accepted: list[int], k: int) -> None:
        """Keep each row's anchor and accepted drafts (`kept` [B, ≤K], accepted[b] + 1 of them per row), packed to
        the left of both caches (a static batch's finished rows keep nothing more)."""
        counts = [r + 1 if live else 0 for r, live in zip(accepted, s.live)]
        if not self.static_cache:
            s.used = compact(self.target.kinds, s.target_cache, s.draft_cache, s.used, counts, k, kept.shape[1])
            return
        s.used = compact_static(s.target_cache, s.draft_cache, s.used, counts, k)
        s.filled = max(s.used)
        assert s.target_mask is not None  # a static cache's state always has its mask (_State's construction)
        s.target_mask = row_mask(s.used, s.target_mask.shape[1], s.target_mask.device)

    def _record(self, s: _State, records: list[SequenceRecord], facts: list[list[int]],
                max_new_tokens: int) -> list[int]:
        """Append this step's facts (per row: accepted, bonus, drafts); the committed tokens are the accepted drafts
        followed by the bonus. Returns the batch indices of the rows that are now done.

        Finished rows that stay in a static batch are skipped: their tokens are meaningless."""
        done = []
        for i, (row, live, (r, b, *block)) in enumerate(zip(s.rows, s.live, facts)):
            if not live:
                continue
            rec = records[row]
            rec.anchors.append(len(rec.response_ids) - 1)
            rec.drafts.append(block)
            rec.accepted.append(r)
            new = block[:r] + [b]
            rec.response_ids.extend(new)
            if self.eos_id in new or len(rec.response_ids) >= max_new_tokens:
                done.append(i)
        return done

    def _drop(self, done: list[int], s: _State) -> None:
        """Rows that emitted eos or hit the length limit (batch indices `done`) leave the batch, so they cost no
        more compute; with a static cache they stay (shapes must not change) and are only marked finished."""
        if not done:
            return
        if self.static_cache:
            for i in done:
                s.live[i] = False
            return
        leaving = set(done)  # a set: a list would make this quadratic in the batch
        keep = [i for i in range(len(s.rows)) if i not in leaving]
        if keep:  # the context verified with the leaving rows is projected with them, as when it was not deferred
            self.drafter.commit_context(s.draft_cache)
        s.select(keep, self.target.kinds)
        if keep:
            crop(self.target.kinds, s.target_cache, s.draft_cache, max(s.used))
            s.draft_cache.dense = min(s.used) == max(s.used)


def _done(rec: SequenceRecord, eos_id: int, max_new_tokens: int) -> bool:
    return eos_id in rec.response_ids or len(rec.response_ids) >= max_new_tokens


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
    """Per-batch values of the rows in the batch; `rows` maps them back to the caller's prompt order, `live`
    says which still decode (all of them unless a static cache keeps finished rows), `used` counts each row's
    packed cache columns, `filled` the longest row's (where a static cache writes the next block) and `target_mask`
    the static path's mask.
    `rows`, `live` and `used` are host lists: the bookkeeping reads them every step without a device sync."""

    def __init__(self, *, rows: list[int], keys: torch.Tensor, target_cache, target_mask: torch.Tensor | None,
                 filled: int, used: list[int], draft_cache, anchor: torch.Tensor, anchor_pos: torch.Tensor,
                 response_len: torch.Tensor, live: list[bool]) -> None:
        self.rows, self.keys, self.live = rows, keys, live
        self.target_cache, self.target_mask, self.filled, self.used = target_cache, target_mask, filled, used
        self.draft_cache = draft_cache
        self.anchor, self.anchor_pos, self.response_len = anchor, anchor_pos, response_len

    def select(self, keep: list[int], kinds: TargetKinds) -> None:
        """Keep only these batch rows (the target's cache layers as their kinds select rows)."""
        for name in ("rows", "live", "used"):
            setattr(self, name, [getattr(self, name)[i] for i in keep])
        if not keep:
            return
        index = torch.tensor(keep, dtype=torch.long, device=self.anchor.device)
        for name in ("keys", "anchor", "anchor_pos", "response_len"):
            setattr(self, name, getattr(self, name)[index])
        kinds.select_rows(self.target_cache, index)
        self.draft_cache.select(index)
