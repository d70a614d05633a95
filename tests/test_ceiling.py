"""The ceiling: the argmax oracle's τ on stored samples, checked three ways (opd/eval/ceiling.py).

An 8-token micro target, random micro drafters, 96 prompts; samples drawn greedy and at T=0.6 by the speculative
decoder, as `opd gen-samples --eval` draws them.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from opd.data.prompts import Prompt
from opd.eval.acceptance import AcceptanceStats
from opd.eval.ceiling import beats_oracle, full_acceptance, oracle_records
from opd.eval.offline import OfflineEval
from opd.eval.online import evaluate
from opd.models.build import Models
from opd.spec import SamplingSpec
from opd.tiny.micro import micro_drafter, micro_target
from tests.helpers.decoding import EOS, MASK
from tests.helpers.offline import MADE, draw_samples

SETTINGS = [SamplingSpec(name="greedy"), SamplingSpec(name="sampled", temperature=0.6, top_p=0.95, top_k=5)]
K = 4


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    target = micro_target(seed=0, vocab_size=8, layer_ids=[0, 2, 3])
    drafters = [micro_drafter(target, seed=s, block_size=K, mask_token_id=MASK) for s in (1, 2)]
    gen = torch.Generator().manual_seed(1)
    prompts = [Prompt(f"p{i}", "", torch.randint(0, 6, (int(torch.randint(1, 6, (1,), generator=gen)),),
                                                   generator=gen).tolist()) for i in range(96)]
    path = tmp_path_factory.mktemp("ceiling") / "samples.jsonl"
    draw_samples(target, drafters[0], prompts, path, SETTINGS)
    offline = OfflineEval(Models(target, drafters[0], SimpleNamespace(eos_token_id=EOS)), path, prompts, SETTINGS, MADE)
    return SimpleNamespace(target=target, drafters=drafters, offline=offline, prompts=prompts)


def test_at_greedy_the_oracle_accepts_everything_but_at_each_sequences_end(setup):
    greedy = setup.offline.views[0]
    records = oracle_records(greedy.samples, greedy.argmax, K)
    blocks = 0
    for rec in records:
        last = len(rec.response_ids) - 1
        assert rec.accepted == [min(K - 1, last - a) for a in rec.anchors]
        assert all(r == K - 1 for r in rec.accepted[:-1])
        blocks += len(rec.accepted)
    assert blocks > 200


def plain_walk(target, prompt_ids: list[int], response: list[int]) -> tuple[list[int], list[int]]:
    """The reference: the target's full logits over the unpadded text, then a per-position argmax walk."""
    ids = torch.tensor([prompt_ids + response])
    predicted = target.model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1].argmax(-1).tolist()
    anchors, accepted, a = [], [], 0
    while a < len(response) - 1:
        r = 0
        while r < K - 1 and a + r + 1 < len(response) and response[a + r + 1] == predicted[a + r + 1]:
            r += 1
        anchors.append(a)
        accepted.append(r)
        a += r + 1
    return anchors, accepted


@pytest.mark.parametrize("setting", [0, 1])
def test_the_ceiling_is_a_plain_walk_of_per_position_argmax_matches(setup, setting):
    view = setup.offline.views[setting]
    records = oracle_records(view.samples, view.argmax, K)
    with torch.no_grad():
        expected = [plain_walk(setup.target, r.prompt_ids, r.response_ids) for r in view.samples]
    assert [(r.anchors, r.accepted) for r in records] == expected
    if setting == 1:  # sampled text leaves the argmax: the oracle is rejected somewhere
        assert any(r < K - 1 for rec in records for r in rec.accepted[:-1])


def test_at_greedy_no_drafter_exceeds_the_ceiling_and_at_t_above_0_wins_are_counted(setup):
    offline = setup.offline
    for drafter in setup.drafters:
        rows = {r.sampling: r for r in offline.evaluate(drafter)}
        greedy = rows["greedy"]
        assert greedy.tau <= greedy.ceiling and greedy.tau < K - 0.5
        assert offline.ceiling(offline.views[0], K).tau_token_weighted >= greedy.tau_token_weighted
        view = offline.views[0]
        assert beats_oracle(offline.records(view, drafter), view.argmax, K) == 0
        view = offline.views[1]
        share = beats_oracle(offline.records(view, drafter), view.argmax, K)
        assert 0 <= share < 0.5


def test_sampled_drafts_are_measured_against_full_acceptance_on_their_own_text(setup):
    """q = p accepts every sampled draft: K−1 per block but at a response's end, whatever the target's argmax."""
    sampled = setup.offline.views[1]
    for rec in full_acceptance(sampled.samples, K):
        last = len(rec.response_ids) - 1
        assert rec.accepted == [min(K - 1, last - a) for a in rec.anchors]
    settings = [SamplingSpec(name="greedy"),
                SamplingSpec(name="sampled-q", temperature=0.6, top_p=0.95, top_k=5, draft="sample")]
    models = Models(setup.target, setup.drafters[0], SimpleNamespace(eos_token_id=EOS))
    greedy, sampled_q = evaluate(models, setup.prompts[:32], settings, max_new_tokens=24, batch_size=16,
                                 baseline=False)
    assert greedy.ceiling is None  # a point-mass setting's ceiling needs stored samples and the target's argmax
    assert sampled_q.tau < sampled_q.ceiling <= K
    stats = AcceptanceStats.from_records(full_acceptance(sampled.samples, K), K)
    assert stats.tau > AcceptanceStats.from_records(oracle_records(sampled.samples, sampled.argmax, K), K).tau
