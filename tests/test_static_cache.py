"""The opt-in static-shape decode path emits exactly what the dynamic path does, with shapes that never change.

Same float64 micro models and prompts as tests/test_decoding.py; the rows of MIXED_PROMPTS finish at different
steps (eos and length mixed), so finished rows really do stay in the static batch.
"""

from __future__ import annotations

import pytest
from transformers.cache_utils import StaticCache

from opd.decoding.autoregressive import generate_autoregressive
from opd.decoding.sampling import Sampling
from opd.decoding.speculative import SpeculativeDecoder
from opd.tiny.micro import micro_drafter
from tests.helpers.decoding import EOS, MASK, MIXED_PROMPTS, constant_drafter, target  # noqa: F401 (a fixture)
from tests.helpers.static_cache import KEYS, facts


def both_paths(target, drafter, sampling: Sampling, max_new_tokens: int = 24) -> tuple[list, list]:
    runs = [SpeculativeDecoder(target, drafter, eos_id=EOS, static_cache=static).generate(
        MIXED_PROMPTS, sampling, max_new_tokens=max_new_tokens, seed=3, keys=KEYS) for static in (False, True)]
    return runs[0], runs[1]


@pytest.mark.parametrize("drafter_name", ["random", "constant5"])
def test_static_greedy_equals_autoregressive_and_dynamic(target, drafter_name):
    drafter = {"random": micro_drafter(target, seed=1, block_size=4, mask_token_id=MASK),
               "constant5": constant_drafter(target, 5)}[drafter_name]
    dynamic, static = both_paths(target, drafter, Sampling())
    baseline = generate_autoregressive(target, MIXED_PROMPTS, Sampling(), max_new_tokens=24, eos_id=EOS, keys=KEYS)
    assert [r.response_ids for r in static] == baseline
    assert facts(static) == facts(dynamic)
    assert len({len(r.accepted) for r in static}) > 2  # rows finish at different steps
    assert {r.finish_reason for r in static} == {"eos", "length"}


@pytest.mark.parametrize("sampling", [Sampling(temperature=1.0), Sampling(temperature=0.8, top_k=3),
                                      Sampling(temperature=1.0, top_p=0.8)], ids=["T1", "topk3", "topp0.8"])
def test_static_sampled_equals_dynamic(target, sampling):
    for drafter in (micro_drafter(target, seed=1, block_size=4, mask_token_id=MASK), constant_drafter(target, 5)):
        dynamic, static = both_paths(target, drafter, sampling)
        assert facts(static) == facts(dynamic)
        assert len({len(r.accepted) for r in static}) > 2


def test_every_step_has_the_same_shapes(target, monkeypatch):
    """The property CUDA graphs need: after prefill, each target call sees identical shapes and one StaticCache,
    and the drafter's cache tensors neither grow nor move."""
    drafter = micro_drafter(target, seed=1, block_size=4, mask_token_id=MASK)
    calls, draft_shapes = [], set()
    target_forward, draft = type(target).forward, type(drafter).draft

    def spy_target(self, ids, **kw):
        calls.append((tuple(ids.shape), tuple(kw["attention_mask"].shape), kw["past_key_values"]))
        return target_forward(self, ids, **kw)

    def spy_draft(self, cache, anchor_ids, anchor_positions):
        draft_shapes.add((tuple(anchor_ids.shape), tuple(cache.valid.shape),
                          tuple((k.shape, k.data_ptr()) for k in cache.keys)))
        return draft(self, cache, anchor_ids, anchor_positions)

    monkeypatch.setattr(type(target), "forward", spy_target)
    monkeypatch.setattr(type(drafter), "draft", spy_draft)
    records = SpeculativeDecoder(target, drafter, eos_id=EOS, static_cache=True).generate(
        MIXED_PROMPTS, Sampling(), max_new_tokens=24)
    steps = calls[1:]
    assert len(steps) == max(len(r.accepted) for r in records) > 1
    assert len({(ids, mask) for ids, mask, _ in steps}) == 1 and steps[0][0] == (len(MIXED_PROMPTS), 4)
    assert isinstance(calls[0][2], StaticCache) and all(cache is calls[0][2] for _, _, cache in steps)
    assert len(draft_shapes) == 1


def test_capacity_is_enough(target):
    """A row whose drafts are all rejected commits one token per step and runs max_new_tokens - 1 steps; the
    packed static caches (prompt + max_new_tokens + 2K columns) hold it, as they hold ragged rows that finish."""
    prompt = [MIXED_PROMPTS[2]]  # greedy never emits eos within 24 tokens, so eos drafts are always rejected
    decoder = SpeculativeDecoder(target, constant_drafter(target, EOS), eos_id=EOS, static_cache=True)
    rec = decoder.generate(prompt, Sampling(), max_new_tokens=24)[0]
    assert rec.accepted == [0] * 23 and rec.finish_reason == "length"
    assert rec.response_ids == generate_autoregressive(target, prompt, Sampling(), max_new_tokens=24, eos_id=EOS)[0]


def test_the_static_caches_stay_packed(target, monkeypatch):
    """Before each verification the static cache's write counter is the longest row's prompt + committed tokens
    (the pending anchor excepted; a finished row's stop growing): rejected slots are overwritten, not kept as
    holes. Two rows that accept differently, one finishing first, so blocks really move."""
    prompts, counters, target_forward = [MIXED_PROMPTS[2], MIXED_PROMPTS[5]], [], type(target).forward

    def spy_target(self, ids, **kw):
        counters.append(int(kw["past_key_values"].get_seq_length()))
        return target_forward(self, ids, **kw)

    monkeypatch.setattr(type(target), "forward", spy_target)
    records = SpeculativeDecoder(target, constant_drafter(target, 5), eos_id=EOS, static_cache=True).generate(
        prompts, Sampling(), max_new_tokens=24)
    used = [[len(p) + sum(r + 1 for r in rec.accepted[:step]) for step in range(len(counters) - 1)]
            for p, rec in zip(prompts, records)]
    assert counters[1:] == [max(row) for row in zip(*used)]
    assert records[0].accepted != records[1].accepted and len(records[0].accepted) != len(records[1].accepted)
    assert 0 < max(records[1].accepted) < 3  # some drafted slots kept, some overwritten


def test_training_with_the_static_cache_takes_the_same_steps(micro_spec_file, tmp_path):
    """End to end through rollout, replay and the learner: the fixed-shape path changes nothing trained."""
    from opd.spec import load_spec
    from opd.train.local import LocalTrainer

    def losses(static: bool) -> list[float]:
        spec = load_spec(micro_spec_file, ["steps=2", "eval.every=0", f"rollout.static_cache={str(static).lower()}",
                                           f"tracking.run_dir={tmp_path / str(static)}"])
        return LocalTrainer(spec, track=False).run().losses

    assert losses(True) == losses(False)
