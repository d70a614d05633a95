"""The rollout worker: target samples of the prompt pool, emitting `AnchorBatch`es.

Where the samples come from is `rollout.source`:
- `speculative` (the paper's path): target-assisted speculative decoding with a drafter copy that adopts every
  broadcast; the records carry the blocks it drafted, stamped with its version;
- `target`: any lossless sampler of the target (opd/sources/samplers.py); the records carry the text only
  (`draft_version` -1) and the scorer rebuilds the blocks with the newest drafter (opd/sources/rebuild.py);
- `samples`: the same, read from a stored sample file (opd/sources/store.py); no model is needed here.

The data cursor is just the rollout batch index: batch i always holds the same prompts (epochs are reshuffled
with a seeded permutation), so a resumed run or a restarted actor re-produces exactly what it would have.
"""

from __future__ import annotations

import torch

from opd.data.prompts import Prompt, prompt_key
from opd.decoding.record import UNDRAFTED, SequenceRecord
from opd.decoding.sampling import Sampling
from opd.decoding.speculative import SpeculativeDecoder
from opd.distill.anchors import redraft_at_random_anchors
from opd.models.flops import DrafterParams, FlopCounter, TargetParams, decode_flops, drafted_text_flops
from opd.models.protocol import Drafter
from opd.models.target import Target
from opd.sources.samplers import build_sampler
from opd.sources.store import GEN_CHUNK, SampleStore, Wanted, rollout_draw, wanted
from opd.spec import ExperimentSpec
from opd.train.messages import AnchorBatch


def rollout_sampling(spec: ExperimentSpec, index: int) -> Sampling:
    """How batch `index` is decoded: the rollout's own setting (the serving setting, with its draft mode, when the
    spec names one), or in turn each of `rollout.mix` (point-mass drafts)."""
    settings = spec.rollout.settings
    own = index % len(settings) == 0
    return Sampling.of(settings[index % len(settings)],
                       sample_drafts=own and spec.serving is not None and spec.serving.draft == "sample")


class RolloutWorker:
    """`target` and `drafter` are None unless `rollout.holds_target`; with `rollout.source: target` the
    drafter is the sampler's, never updated."""

    def __init__(self, spec: ExperimentSpec, target: Target | None, drafter: Drafter | None, eos_id: int,
                 prompts: list[Prompt], draft_version: int = 0) -> None:
        self.spec, self.prompts, self.eos_id = spec, prompts, eos_id
        source = spec.rollout.source
        self.decoder = self.sampler = self.draw = self.samples = None
        if source == "speculative":
            assert target is not None and drafter is not None  # `rollout.holds_target`
            self.decoder = SpeculativeDecoder(target, drafter, eos_id=eos_id, draft_version=draft_version,
                                              static_cache=spec.rollout.static_cache,
                                              compiled=spec.rollout.compile)
            self._target_params, self._drafter_params = TargetParams.of(target.model), DrafterParams.of(drafter)
        if source == "target":
            self.sampler = build_sampler(spec, spec.rollout.sampler, target, drafter, eos_id)
            self.draw = rollout_draw(spec, self.sampler)
        if spec.rollout.samples_path is not None:  # read (samples), or a shared cache drawn into (target)
            self.samples = SampleStore.for_rollout(spec, prompts)
        self._perms: dict[int, list[int]] = {}

    @property
    def draft_version(self) -> int:
        """The weights this worker drafts with (UNDRAFTED when the scorer rebuilds the blocks)."""
        return self.decoder.draft_version if self.decoder else UNDRAFTED

    def load_drafter(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Adopt broadcast weights; a worker that only samples the target ignores them."""
        if self.decoder:
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
        prompts, keys = [p.ids for p, _ in chosen], [prompt_key(p.id, e) for p, e in chosen]
        if self.decoder is None:
            responses, costs = self._target_samples(chosen, index)
            records = [SequenceRecord.from_text(key, prompt, response, self.eos_id)
                       for key, prompt, response in zip(keys, prompts, responses)]
            return AnchorBatch(index, UNDRAFTED, records, sum(costs, FlopCounter()))
        records = self.decoder.generate(prompts, rollout_sampling(self.spec, index),
                                        max_new_tokens=self.spec.rollout.max_new_tokens,
                                        seed=self.spec.seed * 7919 + index, keys=keys)
        flops = decode_flops(records, self._target_params, self._drafter_params)
        if self.spec.replay.anchors == "random":
            records = self._redraft(records, index, flops)
        return AnchorBatch(index, self.draft_version, records, flops)

    def _target_samples(self, chosen: list[tuple[Prompt, int]],
                        index: int) -> tuple[list[list[int]], list[FlopCounter]]:
        """Batch `index`'s target samples and what drawing each cost (charged whoever drew it, so matched-FLOP
        comparisons do not depend on sharing): from the sample file, drawn into it where it lacks one, or drawn."""
        setting = index % len(self.spec.rollout.settings)
        jobs = [wanted(self.spec, prompt, setting, epoch) for prompt, epoch in chosen]
        if self.samples is None:
            assert self.draw is not None  # source target without a sample file: drawn
            return self.draw(jobs)
        if self.draw is not None and self.samples.missing(jobs):
            # Drawing into a shared file: the batches after this one at its setting come along, GEN_CHUNK samples
            # in one sampler call, which costs less per sample than a batch's (bench/sample_batching.py measures it).
            # Samples are keyed, so who draws them, and with whom, changes nothing.
            self.samples.fetch(jobs + self._ahead(index, GEN_CHUNK - len(jobs)), self.draw)
        stored = self.samples.fetch(jobs, self.draw)
        return [s.response for s in stored], [s.flops for s in stored]

    def _ahead(self, index: int, count: int) -> list[Wanted]:
        """The wanted samples of the batches after `index` at its setting, at least `count` of them."""
        settings = len(self.spec.rollout.settings)
        out: list[Wanted] = []
        while len(out) < count:
            index += settings
            out += [wanted(self.spec, prompt, index % settings, epoch) for prompt, epoch in self.prompts_for(index)]
        return out

    def _redraft(self, records: list[SequenceRecord], index: int, flops: FlopCounter) -> list[SequenceRecord]:
        gen = torch.Generator().manual_seed(self.spec.seed * 104_729 + index)
        per_seq = self.spec.replay.random_anchors_per_seq
        assert self.decoder is not None  # random anchors redraft speculative rollouts
        target, drafter = self.decoder.target, self.decoder.drafter
        out = [redraft_at_random_anchors(target, drafter, rec, per_seq or len(rec.anchors), gen) for rec in records]
        for rec in (new for new, old in zip(out, records) if new is not old):  # kept records cost nothing
            flops += drafted_text_flops(len(rec.prompt_ids) + len(rec.response_ids), len(rec.anchors),
                                        self._target_params, self._drafter_params)
        return out
