"""The expected-acceptance diagnostic predicts what speculative decoding accepts, from p and q alone.

Greedy: the prediction is exact, block by block. Sampled: each block's realised acceptance is one draw of the
verification coins whose mean is the prediction, so over many blocks the two agree within sampling error.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from opd.data.prompts import Prompt, load_prompts
from opd.decoding.sampling import Sampling, target_probs
from opd.decoding.speculative import SpeculativeDecoder
from opd.distill.losses import teacher_distribution
from opd.distill.replay import score
from opd.eval.acceptance_diagnostic import Diagnosis
from opd.eval.expected import ExpectedAcceptance, record_drafts, slot_acceptance, teacher_acceptance
from opd.eval.online import evaluate
from opd.models.build import Models, build_models
from opd.spec import SamplingSpec, load_spec
from opd.tiny.micro import micro_drafter, micro_target

ROOT = Path(__file__).resolve().parents[1]
EOS, MASK = 6, 7
SAMPLED = SamplingSpec(name="sampled", temperature=0.6, top_p=0.95, top_k=5)
GREEDY = SamplingSpec(name="greedy")


@pytest.fixture(scope="module")
def rows():
    """Both settings decoded on 96 prompts by a random micro drafter of an 8-token target (acceptance ~0.3-0.6
    per slot, so neither rule is trivially 0 or 1), diagnosed against both rules."""
    target = micro_target(seed=0, vocab_size=8, layer_ids=[0, 2, 3])
    drafter = micro_drafter(target, seed=1, block_size=4, mask_token_id=MASK)
    gen = torch.Generator().manual_seed(0)
    prompts = [Prompt(f"p{i}", "", torch.randint(0, 6, (int(torch.randint(1, 6, (1,), generator=gen)),),
                                                   generator=gen).tolist()) for i in range(96)]
    models = Models(target, drafter, SimpleNamespace(eos_token_id=EOS))
    return {r.sampling: r for r in evaluate(models, prompts, [GREEDY, SAMPLED], max_new_tokens=24, batch_size=32,
                                            baseline=False, diagnose=True)}


def test_greedy_prediction_is_exact(rows):
    row = rows["greedy"]
    predicted = row.expected["greedy"]
    assert predicted.tau == pytest.approx(row.tau, abs=1e-9)
    assert predicted.tau_token_weighted == pytest.approx(row.tau_token_weighted, abs=1e-9)
    assert predicted.survival == pytest.approx(row.survival, abs=1e-9)


def test_sampled_prediction_matches_realised_acceptance(rows):
    row = rows["sampled"]
    predicted = row.expected["sampled"]
    n = predicted.blocks
    assert n > 500
    # Each block accepts at most K-1 = 3 drafts, so the realised mean is within 4 standard errors (sd <= 1.5).
    tolerance = 4 * 1.5 / math.sqrt(n)
    assert abs(predicted.tau_token_weighted - row.tau_token_weighted) < tolerance
    for k, (p, s) in enumerate(zip(predicted.survival, row.survival), start=1):
        assert abs(p - s) < 4 * 0.5 / math.sqrt(n), f"P(accepted >= {k}): predicted {p:.3f}, realised {s:.3f}"
    assert 0.05 < predicted.slot[0] < 0.95  # a real test, not one decided by a degenerate drafter


def _tiny(config: str, drafter: str, prompts: int) -> tuple[Models, list[Prompt]]:
    """The shipped tiny target with one of its drafters (opd/assets/tiny/<drafter>) and the first held-out prompts."""
    assets = ROOT / "opd/assets/tiny"
    spec = load_spec(ROOT / "configs" / config, [
        f"models.target_path={assets}/target", f"models.tokenizer_path={assets}/target",
        f"models.drafter_path={assets}/{drafter}", f"data.train_prompts={assets}/prompts/train.jsonl",
        f"data.eval_prompts={assets}/prompts/heldout.jsonl", "models.device=cpu"])
    models = build_models(spec)
    return models, load_prompts(spec.data.eval_prompts, models.tokenizer, max_prompt_tokens=256, limit=prompts).prompts


@pytest.fixture(scope="module")
def tiny_sampled():
    """The shipped tiny target and warm drafter decoding 64 held-out prompts at Qwen3's serving setting:
    realistic acceptance (a block accepts 0-7 drafts), so the prediction is tested where it is informative."""
    models, prompts = _tiny("tiny.yaml", "drafter", 64)
    decoder = SpeculativeDecoder(models.target, models.drafter, eos_id=models.eos_id)
    records = decoder.generate([p.ids for p in prompts], SERVING, max_new_tokens=64, seed=3,
                               keys=list(range(len(prompts))))
    teacher = score(models.target, records, block_size=models.drafter.block_size).teacher
    return models, records, teacher


SERVING = Sampling(0.6, top_k=20, top_p=0.95)


def _block_gap(tiny_sampled, rule: Sampling) -> tuple[float, float]:
    """Mean of (realised - predicted accepted drafts) over blocks, and its standard error."""
    models, records, teacher = tiny_sampled
    drafts, _ = record_drafts(records)
    a = teacher_acceptance(drafts, teacher, models.target.lm_head, {"rule": rule})["rule"].double()
    gap = torch.tensor([r for rec in records for r in rec.accepted], dtype=torch.float64) - a.cumprod(-1).sum(-1)
    return float(gap.mean()), float(gap.std() / math.sqrt(len(gap)))


def test_prediction_matches_decoding_per_block_on_the_tiny_models(tiny_sampled):
    """Blockwise, realised minus predicted accepted length has mean zero (a martingale difference: given the
    state, the prediction is the coins' expectation); under the unprocessed p (T=1, no top-k/top-p) it does not, so
    the test has the power to see a mistake of that size."""
    mean, se = _block_gap(tiny_sampled, SERVING)
    assert abs(mean) < 4 * se, f"realised - predicted = {mean:.3f} ± {se:.3f}"
    wrong, wrong_se = _block_gap(tiny_sampled, Sampling(1.0))
    assert abs(wrong) > 4 * wrong_se, f"a wrong rule went unnoticed: {wrong:.3f} ± {wrong_se:.3f}"


def test_the_rules_differ_on_the_same_states(rows):
    """Greedy-visited states judged by the sampled rule (and vice versa) give a different τ: the diagnostic
    separates 'which states' from 'which rule' (issue 17's question)."""
    greedy_states = rows["greedy"].expected
    assert greedy_states["sampled"].tau_token_weighted != pytest.approx(greedy_states["greedy"].tau_token_weighted)
    assert set(rows["sampled"].expected) == {"greedy", "sampled"}


def test_processing_decides_acceptance():
    """Top-k removes a token's chance entirely; temperature reshapes it; greedy is agreement with the argmax."""
    logits = torch.tensor([[[3.0, 2.0, 1.0, 0.0]]])
    drafts = torch.tensor([[2]])
    assert slot_acceptance(drafts, logits, Sampling(1.0)).item() == pytest.approx(
        math.exp(1) / sum(math.exp(x) for x in (3, 2, 1, 0)))
    assert slot_acceptance(drafts, logits, Sampling(1.0, top_k=2)).item() == 0.0
    assert slot_acceptance(torch.tensor([[0]]), logits, Sampling(0.0)).item() == 1.0
    assert slot_acceptance(drafts, logits, Sampling(0.0)).item() == 0.0


@pytest.mark.parametrize("sampling", [Sampling(0.6, top_k=20, top_p=0.95), Sampling(1.3, top_k=5),
                                      Sampling(0.6, top_p=0.9), Sampling(0.6, top_k=64, top_p=0.5)])
def test_acceptance_is_the_processed_target_probability_of_the_draft(sampling):
    """The top-k shortcut (softmax and top-p over the k largest logits only) equals gathering the draft's
    probability from the full processed distribution that verification samples from."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(40, 3, 64, generator=gen, dtype=torch.float64) * 3
    drafts = torch.where(torch.rand(40, 3, generator=gen) < 0.5, logits.argmax(-1),
                         torch.randint(0, 64, (40, 3), generator=gen))
    reference = target_probs(logits, sampling).gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    assert slot_acceptance(drafts, logits, sampling) == pytest.approx(reference, abs=1e-6)  # fp32 sums
    assert (reference > 0).any() and (reference == 0).any()


@pytest.mark.parametrize("sampling", [Sampling(0.0), Sampling(0.6, top_k=4), Sampling(0.6, top_p=0.9)])
def test_teacher_hidden_states_and_top_k_teacher_agree(sampling):
    """The scorer's two teacher forms (hidden states + LM head; top-k log-probs at the teacher temperature) give
    the same acceptance whenever the setting's top-k fits in the teacher's; chunking changes nothing."""
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 12, bias=False).double()
    hidden = torch.randn(300, 3, 16, dtype=torch.float64)  # 900 slots: several chunks
    drafts = torch.randint(0, 12, (300, 3))
    logits = head(hidden).detach()
    reference = slot_acceptance(drafts, logits, sampling)
    via_hidden = teacher_acceptance(drafts, hidden, head, {"s": sampling})["s"]
    topk = teacher_distribution(logits, temperature=0.7, topk=12)
    via_topk = teacher_acceptance(drafts, topk, head, {"s": sampling}, teacher_temperature=0.7)["s"]
    assert via_hidden == pytest.approx(reference.float(), abs=1e-6)
    assert via_topk == pytest.approx(reference.float(), abs=1e-5)
    assert reference.sum() > 0


def test_summary_by_hand():
    a = torch.tensor([[1.0, 0.5, 1.0], [0.0, 1.0, 1.0], [0.5, 0.5, 0.5]])
    e = ExpectedAcceptance.of(a, [[9, 9], [9]])  # rooms past K-1: no block is cut by its response's end
    expected_accepted = [1 + 0.5 + 0.5, 0.0, 0.5 + 0.25 + 0.125]
    assert e.tau_token_weighted == pytest.approx(1 + sum(expected_accepted) / 3)
    assert e.tau == pytest.approx(((3.0 + 1.0) / 2 + 1.875) / 2)  # per response, then over responses
    assert e.slot == pytest.approx([0.5, 2 / 3, 2.5 / 3])
    assert e.survival == pytest.approx([1.5 / 3, 0.75 / 3, 0.625 / 3])


# ------------------------------------------------------------------------------------- drafts sampled from q


@pytest.fixture(scope="module")
def tiny_sampled_q():
    """The shipped tiny target and DFlash 2 drafter decoding 48 held-out prompts with drafts sampled from the
    selector's q at Qwen3's serving setting, replayed: the records, the diagnostic's (α, survival) on them, and the
    point-mass rule's acceptance of the same drafts (a wrong rule for these drafts)."""
    models, prompts = _tiny("tiny-dflash2.yaml", "dflash2", 48)
    sampling = Sampling(0.6, top_k=20, top_p=0.95, sample_drafts=True)
    records = SpeculativeDecoder(models.target, models.drafter, eos_id=models.eos_id).generate(
        [p.ids for p in prompts], sampling, max_new_tokens=64, seed=3, keys=list(range(len(prompts))))
    diagnosis = Diagnosis(models, {"q": sampling})
    diagnosis.add(records)
    drafts, _ = record_drafts(records)
    teacher = score(models.target, records, block_size=models.drafter.block_size).teacher
    point_mass = teacher_acceptance(drafts, teacher, models.target.lm_head, {"rule": sampling})["rule"]
    return records, torch.cat(diagnosis.acceptance["q"]), torch.cat(diagnosis.survival["q"]), point_mass


def test_q_sampled_prediction_matches_decoding_per_block(tiny_sampled_q):
    """Blockwise, realised minus predicted accepted length, Σ_k P(accepted >= k | the sampled drafts), has mean zero;
    the point-mass rule p_T(d) on the same drafts is off by more than sampling error, so the test has the power to see
    that mistake. (The product of the α_k, which the `expected_length` objective trains, is near it here.)"""
    records, alpha, survival, point_mass = tiny_sampled_q
    realised = torch.tensor([r for rec in records for r in rec.accepted], dtype=torch.float64)
    assert len(realised) > 300 and 0.3 < float(alpha[:, 0].mean()) < 0.99

    def gap(predicted: torch.Tensor) -> tuple[float, float]:
        diff = realised - predicted.double().sum(-1)
        return float(diff.mean()), float(diff.std() / math.sqrt(len(diff)))

    mean, se = gap(survival)
    assert abs(mean) < 4 * se, f"realised - predicted = {mean:.3f} ± {se:.3f}"
    off, off_se = gap(point_mass.cumprod(-1))
    assert abs(off) > 4 * off_se, f"a wrong rule went unnoticed: {off:.3f} ± {off_se:.3f}"


def test_q_sampled_slot_acceptance_is_one_minus_total_variation(tiny_sampled_q):
    """The diagnostic's a_k for q-sampled drafts is α_k = Σ min(p_T, q): at the first slot, whose state every block
    reaches, its mean predicts how often the first draft was accepted."""
    records, alpha, _, _ = tiny_sampled_q
    first = torch.tensor([min(r, 1) for rec in records for r in rec.accepted], dtype=torch.float64)
    assert abs(float(first.mean() - alpha[:, 0].double().mean())) < 4 * 0.5 / math.sqrt(len(first))


def test_a_teacher_of_logits_needs_no_head():
    """head None: the teacher's rows already are logits (`apply_head`'s convention), which the hidden-state path
    read a missing head's device for and raised."""
    torch.manual_seed(0)
    logits, drafts = torch.randn(5, 3, 12), torch.randint(0, 12, (5, 3))
    sampling = Sampling(0.8, top_k=4)
    got = teacher_acceptance(drafts, logits, None, {"s": sampling})["s"]
    assert got == pytest.approx(slot_acceptance(drafts, logits, sampling).float(), abs=1e-6)
