"""Offline τ on the 8-token micro target: what `opd gen-samples --eval` writes (drawn by the speculative decoder
with a given drafter) and the offline evaluation of a drafter on those samples, at two settings."""

from __future__ import annotations

from types import SimpleNamespace

from opd.eval.offline import OfflineEval
from opd.models.build import Models
from opd.sources.provenance import Provenance
from opd.sources.samplers import build_sampler
from opd.sources.store import SampleStore, Wanted, sampler_draw
from opd.spec import SamplingSpec
from tests.helpers.decoding import EOS

MAX_NEW, SEED = 24, 0
SETTINGS = [SamplingSpec(name="greedy"), SamplingSpec(name="sampled", temperature=0.6, top_p=0.95, top_k=5)]
MADE = Provenance("micro-target", "micro-tokenizer", "raw", None, MAX_NEW)  # the micro models have no files


def draw_samples(target, drafter, prompts, path, settings, drawn_at=None):
    """What `opd gen-samples --eval` writes: one sample per prompt and setting, drawn by the speculative decoder
    with `drafter`, keyed as held-out evaluation keys its decodes. `drawn_at`: sample at these settings instead,
    but label the rows with `settings` (a plausible mistake the tests must see)."""
    spec = SimpleNamespace(rollout=SimpleNamespace(static_cache=False, compile=False))
    sampler = build_sampler(spec, "speculative", target, drafter, EOS)
    store = SampleStore(path, settings, prompts, MADE)
    store.fetch([Wanted(p, s, 0) for s in range(len(settings)) for p in prompts],
                sampler_draw(sampler, drawn_at or settings, MAX_NEW, SEED))


def offline(s, drafter, path=None) -> dict:
    """`drafter`'s offline rows per setting on `s` (target, tokenizer, prompts, and the samples at `s.path`)."""
    rows = OfflineEval(Models(s.target, drafter, s.tokenizer), path or s.path, s.prompts, SETTINGS, MADE,
                       batch_size=32).evaluate(drafter)
    return {r.sampling: r for r in rows}
