"""Offline τ: a drafter's blocks rebuilt on stored target samples give what decoding gives.

An 8-token micro target with random micro drafters (acceptance ~0.3-0.6 per slot, so τ is informative), 64
prompts (two batches of 32), greedy and a sampled setting. D draws the samples; D' is evaluated on them.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import opd.eval.offline as offline_eval
from opd.data.prompts import Prompt, prompt_key
from opd.eval.offline import OfflineEval, target_identity
from opd.eval.online import evaluate
from opd.models.build import Models
from opd.sources.provenance import Provenance
from opd.sources.rebuild import rebuild_records
from opd.sources.samplers import build_sampler
from opd.sources.store import SampleStore, Wanted, sampler_draw
from opd.spec import SamplingSpec
from opd.tiny.micro import micro_drafter, micro_target
from tests.helpers.decoding import EOS, MASK
from tests.helpers.offline import MADE, MAX_NEW, SEED, SETTINGS, draw_samples, offline


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    target = micro_target(seed=0, vocab_size=8, layer_ids=[0, 2, 3])
    d = micro_drafter(target, seed=1, block_size=4, mask_token_id=MASK)
    d2 = micro_drafter(target, seed=2, block_size=4, mask_token_id=MASK)
    gen = torch.Generator().manual_seed(0)
    prompts = [Prompt(f"p{i}", "", torch.randint(0, 6, (int(torch.randint(1, 6, (1,), generator=gen)),),
                                                   generator=gen).tolist()) for i in range(64)]
    tokenizer = SimpleNamespace(eos_token_id=EOS)
    path = tmp_path_factory.mktemp("offline") / "eval_samples.jsonl"
    draw_samples(target, d, prompts, path, SETTINGS)
    return SimpleNamespace(target=target, d=d, d2=d2, prompts=prompts, path=path, tokenizer=tokenizer)


def decoded(s, drafter) -> dict:
    rows = evaluate(Models(s.target, drafter, s.tokenizer), s.prompts, SETTINGS, max_new_tokens=MAX_NEW,
                    batch_size=32, seed=SEED, baseline=False)
    return {r.sampling: r for r in rows}


def test_the_drafter_that_drew_the_samples_gets_its_decoded_tau_block_by_block(setup):
    s = setup
    dec, off = decoded(s, s.d), offline(s, s.d)
    for name in ("greedy", "sampled"):
        assert off[name].offline and not dec[name].offline
        for field in ("tau", "tau_token_weighted", "survival", "first_rejection", "tau_ci"):
            assert getattr(off[name], field) == pytest.approx(getattr(dec[name], field), abs=1e-12), (name, field)
    view = OfflineEval(Models(s.target, s.d, s.tokenizer), s.path, s.prompts, SETTINGS, MADE).views[1]
    rebuilt = rebuild_records(s.target, s.d, view.samples, features=view.features)
    from opd.decoding.sampling import Sampling
    from opd.decoding.speculative import SpeculativeDecoder

    records = SpeculativeDecoder(s.target, s.d, eos_id=EOS).generate(
        [p.ids for p in s.prompts], Sampling.of(SETTINGS[1]), max_new_tokens=MAX_NEW, seed=SEED,
        keys=[prompt_key(p.id) for p in s.prompts])
    assert [(r.anchors, r.drafts, r.accepted) for r in rebuilt] == [(r.anchors, r.drafts, r.accepted)
                                                                    for r in records]


def _agree(a, b) -> bool:
    """Two τ estimates over the same prompts agree within 4 standard errors of their difference (CIs are 1.96)."""
    return abs(a.tau - b.tau) < 4 / 1.96 * math.hypot(a.tau_ci, b.tau_ci)


def test_another_drafter_on_greedy_samples_gets_its_decoded_tau_exactly(setup):
    s = setup
    assert offline(s, s.d2)["greedy"].tau == pytest.approx(decoded(s, s.d2)["greedy"].tau, abs=1e-12)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The shipped tiny target and warm drafter (τ ~4 at Qwen3's serving setting, so a wrong sample distribution
    moves it visibly), 64 held-out prompts of 48 tokens (enough that samples drawn at the wrong temperature fall
    well outside the agreement band); samples drawn by plain autoregressive sampling, so the drafter evaluated did
    not draw them."""
    from opd.data.prompts import load_prompts
    from opd.models.build import build_models
    from opd.spec import load_spec

    root = Path(__file__).resolve().parents[1]
    spec = load_spec(root / "configs/tiny.yaml", ["models.device=cpu"])
    models = build_models(spec)
    prompts = load_prompts(spec.data.eval_prompts, models.tokenizer, max_prompt_tokens=256, limit=64).prompts
    sampler = build_sampler(spec, "autoregressive", models.target, None, models.eos_id)
    paths = {}
    for name, drawn_at in (("right", TINY), ("wrong", [TINY[0], SamplingSpec(name="sampled", temperature=1.2)])):
        paths[name] = tmp_path_factory.mktemp("tiny") / f"{name}.jsonl"
        SampleStore.of(spec, paths[name], TINY, prompts, TINY_NEW).fetch(
            [Wanted(p, i, 0) for i in range(2) for p in prompts], sampler_draw(sampler, drawn_at, TINY_NEW, SEED))
    decoded_rows = evaluate(models, prompts, TINY, max_new_tokens=TINY_NEW, batch_size=32, seed=SEED, baseline=False)
    return SimpleNamespace(models=models, prompts=prompts, paths=paths, decoded={r.sampling: r for r in decoded_rows},
                           made=Provenance.of(spec, TINY_NEW))


TINY_NEW = 48
TINY = [SamplingSpec(name="greedy"), SamplingSpec(name="sampled", temperature=0.6, top_p=0.95, top_k=20)]


def test_offline_tau_on_another_samplers_samples_agrees_with_decoding(tiny):
    rows = OfflineEval(tiny.models, tiny.paths["right"], tiny.prompts, TINY, tiny.made, batch_size=32).evaluate(
        tiny.models.drafter)
    off, dec = {r.sampling: r for r in rows}, tiny.decoded
    assert off["greedy"].tau == pytest.approx(dec["greedy"].tau, abs=1e-9)  # the same greedy text
    assert _agree(off["sampled"], dec["sampled"]), (off["sampled"].tau, dec["sampled"].tau)
    assert off["sampled"].tau != dec["sampled"].tau and off["sampled"].tau_ci < 0.1 * off["sampled"].tau


def test_samples_drawn_at_the_wrong_temperature_are_seen(tiny):
    """The agreement test has the power to see a plausible mistake: samples drawn at T=1.2 but labelled 0.6."""
    rows = OfflineEval(tiny.models, tiny.paths["wrong"], tiny.prompts, TINY, tiny.made, batch_size=32).evaluate(
        tiny.models.drafter)
    off, dec = {r.sampling: r for r in rows}, tiny.decoded
    assert not _agree(off["sampled"], dec["sampled"]), (off["sampled"].tau, dec["sampled"].tau)


def test_the_target_view_is_cached_and_invalidated_by_new_samples_or_another_target(setup, tmp_path, monkeypatch,
                                                                                     micro_assets):
    s = setup
    made = []
    original = offline_eval.text_view
    monkeypatch.setattr(offline_eval, "text_view", lambda *a, **k: made.append(1) or original(*a, **k))
    models = Models(s.target, s.d, s.tokenizer)
    OfflineEval(models, s.path, s.prompts, SETTINGS, MADE)
    OfflineEval(models, s.path, s.prompts, SETTINGS, MADE)  # cached: nothing computed
    copy = tmp_path / "copy.jsonl"
    copy.write_bytes(s.path.read_bytes())
    OfflineEval(models, copy, s.prompts, SETTINGS, MADE)  # same content under another name: still cached
    assert len(made) <= 2
    before = len(made)
    lines = s.path.read_text().splitlines()
    copy.write_text("\n".join(lines[1:] + lines[:1]) + "\n")  # other bytes: a new view
    OfflineEval(models, copy, s.prompts, SETTINGS, MADE)
    assert len(made) == before + 2
    OfflineEval(models, s.path, s.prompts[:10], SETTINGS, MADE)  # fewer prompts of the same file: their own view
    assert len(made) == before + 4
    before += 2
    other = micro_target(seed=5, vocab_size=8, layer_ids=[0, 2, 3])
    OfflineEval(Models(other, s.d, s.tokenizer), s.path, s.prompts, SETTINGS, MADE)  # another target: a new view
    assert len(made) == before + 4
    # a target loaded from files is named by them: rewriting its weights changes its identity
    from opd.models.target import load_target

    loaded = load_target(micro_assets["target"], dtype=torch.float32, layer_ids=[1, 2])
    identity = target_identity(loaded)
    weights = next(p for p in os.scandir(micro_assets["target"]) if p.name.endswith(".safetensors"))
    os.utime(weights.path, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 1))
    assert target_identity(loaded) != identity and identity[0] != "object"
    # the same files capturing other layers (an EAGLE-3 drafter's three beside a DFlash drafter's two) are another view
    assert target_identity(load_target(micro_assets["target"], dtype=torch.float32, layer_ids=[1, 1, 2])) != \
        target_identity(loaded)
