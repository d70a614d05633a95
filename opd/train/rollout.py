"""The rollout worker: target-assisted speculative decoding over the prompt pool, emitting `AnchorBatch`es.

The data cursor is just the rollout batch index: batch i always holds the same prompts (epochs are reshuffled
with a seeded permutation), so a resumed run or a restarted actor re-produces exactly what it would have.
"""

from __future__ import annotations

import torch

from opd.anchors import redraft_at_random_anchors
from opd.data import Prompt, prompt_key
from opd.decoding.record import SequenceRecord
from opd.decoding.sampling import Sampling
from opd.decoding.speculative import SpeculativeDecoder
from opd.models.drafter import DFlashDrafter
from opd.models.target import Target
from opd.spec import ExperimentSpec
from opd.train.flops import DrafterParams, FlopCounter, TargetParams
from opd.train.messages import AnchorBatch


def required_version(index: int, spec: ExperimentSpec) -> int:
    """The oldest published version batch `index` may be drafted with: rollout never runs further ahead of the
    learner than `max_policy_lag` allows, so (absent failures) the learner never has to discard a batch.
    Versions are published every `broadcast_every` steps, so the requirement is rounded up to the next of them
    (published by step `step` because the spec keeps max_policy_lag >= broadcast_every - 1)."""
    r = spec.resources
    step = index // spec.batches_per_step
    return max(0, -(-(step - r.max_policy_lag) // r.broadcast_every) * r.broadcast_every)


def rollout_sampling(spec: ExperimentSpec, index: int) -> Sampling:
    """How batch `index` is decoded: the rollout's own setting, or in turn each of `rollout.mix`."""
    settings = [spec.rollout, *spec.rollout.mix]
    s = settings[index % len(settings)]
    return Sampling.of(s)


class RolloutWorker:
    def __init__(self, spec: ExperimentSpec, target: Target, drafter: DFlashDrafter, eos_id: int,
                 prompts: list[Prompt], draft_version: int = 0) -> None:
        self.spec, self.prompts = spec, prompts
        self.decoder = SpeculativeDecoder(target, drafter, eos_id=eos_id, draft_version=draft_version,
                                          static_cache=spec.rollout.static_cache)
        self._target_params, self._drafter_params = TargetParams.of(target.model), DrafterParams.of(drafter)
        self._perms: dict[int, list[int]] = {}

    @property
    def draft_version(self) -> int:
        return self.decoder.draft_version

    def load_drafter(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        self.decoder.load_drafter(state_dict, version)

    def prompts_for(self, index: int) -> list[tuple[Prompt, int]]:
        """The (prompt, epoch) pairs of rollout batch `index`."""
        size, n = self.spec.rollout.batch_size, len(self.prompts)
        out = []
        for g in range(index * size, (index + 1) * size):
            epoch = g // n
            if epoch not in self._perms:
                gen = torch.Generator().manual_seed(self.spec.seed * 1_000_003 + epoch)
                self._perms[epoch] = torch.randperm(n, generator=gen).tolist()
            out.append((self.prompts[self._perms[epoch][g % n]], epoch))
        return out

    def run(self, index: int) -> AnchorBatch:
        chosen = self.prompts_for(index)
        records = self.decoder.generate(
            [p.ids for p, _ in chosen], rollout_sampling(self.spec, index),
            max_new_tokens=self.spec.rollout.max_new_tokens, seed=self.spec.seed * 7919 + index,
            keys=[prompt_key(p.id, e) for p, e in chosen])
        flops = self._decode_flops(records)
        if self.spec.replay.anchors == "random":
            records = self._redraft(records, index, flops)
        return AnchorBatch(index, self.draft_version, records, flops)

    def _redraft(self, records: list[SequenceRecord], index: int, flops: FlopCounter) -> list[SequenceRecord]:
        gen = torch.Generator().manual_seed(self.spec.seed * 104_729 + index)
        per_seq = self.spec.replay.random_anchors_per_seq
        target, drafter = self.decoder.target, self.decoder.drafter
        out = [redraft_at_random_anchors(target, drafter, rec, per_seq or len(rec.anchors), gen) for rec in records]
        for rec in (new for new, old in zip(out, records) if new is not old):  # kept records cost nothing
            # the target's decoder over the committed text (features only), one drafter block per anchor
            committed = len(rec.prompt_ids) + len(rec.response_ids)
            flops.target_forward += self._target_params.forward(committed)
            flops.drafter_forward += self._drafter_params.forward(
                context=committed, blocks=len(rec.anchors), slots=len(rec.anchors) * (drafter.block_size - 1))
        return out

    def _decode_flops(self, records: list[SequenceRecord]) -> FlopCounter:
        flops, k = FlopCounter(), self.decoder.drafter.block_size
        for rec in records:  # logits at every prefill and verified position; the drafter's cache takes them all
            seen = len(rec.prompt_ids) + k * rec.num_steps
            flops.target_forward += self._target_params.forward(seen, logits=seen)
            flops.drafter_forward += self._drafter_params.forward(context=seen, blocks=rec.num_steps,
                                                                  slots=(k - 1) * rec.num_steps)
        return flops
