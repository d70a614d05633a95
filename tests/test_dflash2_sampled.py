"""DFlash 2 drafts sampled from the selector's q (`draft: sample`, opd/decoding/verify.py `sample_chained_draft`):
q is the selector's softmax at temperature T over each slot's candidates given the draft sampled before it, and
verification with that sparse q (its residual over the full vocabulary) is lossless.

Micro models in float64; keyed random numbers make every statistical test deterministic. Losslessness is the
chi-square test of tests/test_decoding.py (joint law of the first three emitted tokens, 10k sequences, 0.1%
critical value), so a correct rule fails it with probability 0.001 and the broken rules below fail it by far.
"""

from __future__ import annotations

import json

import pytest
import torch
import yaml

import opd.decoding.speculative as speculative
import opd.decoding.verify as verify
from opd.cli import main
from opd.decoding.sampling import Sampling, target_probs
from opd.decoding.speculative import SpeculativeDecoder
from opd.decoding.verify import DraftQ, sample_chained_draft
from opd.models.dflash2 import DFlash2Drafter
from opd.models.lm_head import teacher_head
from opd.tiny.micro import micro_target
from tests.helpers.decoding import EOS, MIXED_PROMPTS, PROMPT
from tests.helpers.dflash2 import dflash2_drafter
from tests.helpers.lossless import cases, chi_square, exact_joint, sampled_joint

# Slot k's logits are FIXED_LOGITS rolled by k (as tests/test_sampled_drafts.py): far from the near-uniform micro
# target's p, with a top-4 that leaves tokens out, so a residual kept inside the candidates is caught.
FIXED_LOGITS = torch.tensor([2.0, 1.5, -1.0, 0.5, -0.5, 1.0, 0.0, -2.0], dtype=torch.float64)


class FixedDFlash2(DFlash2Drafter):
    """Fixed slot logits and hidden whatever the context: a legitimate DFlash 2 drafter whose q still depends on the
    anchor and on each sampled draft through its (scaled-up) selector."""

    def drafted_slots(self, cache, anchor_ids, anchor_positions):
        gen = torch.Generator().manual_seed(4)
        hidden = 30 * torch.randn(self.block_size - 1, self.config.hidden_size, dtype=torch.float64, generator=gen)
        logits = torch.stack([FIXED_LOGITS.roll(k) for k in range(self.block_size - 1)])
        return hidden.expand(len(anchor_ids), -1, -1), logits.expand(len(anchor_ids), -1, -1)


@pytest.fixture(scope="module")
def target():
    return micro_target(seed=0, vocab_size=8, layer_ids=[0, 2, 3])


def make_drafter(target, kind: str) -> DFlash2Drafter:
    random = dflash2_drafter(target)
    if kind == "random":
        return random
    fixed = FixedDFlash2(random.config, target.embed_tokens, target.lm_head, teacher_head(target))
    fixed.load_state_dict(random.state_dict())
    return fixed


LOSSLESS_CASES = {
    "T1-random-drafter": (Sampling(temperature=1.0, sample_drafts=True), "random"),
    "T1-fixed-logits": (Sampling(temperature=1.0, sample_drafts=True), "fixed"),
    "T0.7-topk3-topp0.9-fixed-logits": (Sampling(temperature=0.7, top_k=3, top_p=0.9, sample_drafts=True), "fixed"),
}


@pytest.mark.parametrize("case", cases(LOSSLESS_CASES, slow={"T1-fixed-logits"}))
def test_sampled_selector_drafts_are_lossless(target, case):
    """The joint law of the first three emitted tokens equals the target's own, top-k/top-p on p included."""
    sampling, kind = LOSSLESS_CASES[case]
    n = 10_000
    counts = sampled_joint(target, make_drafter(target, kind), PROMPT, sampling, n, length=3)
    stat, critical = chi_square(counts, exact_joint(target, PROMPT, sampling, 3, EOS), n)
    assert stat < critical, f"chi2 {stat:.1f} >= {critical:.1f}"


def _block(target, drafter, prompts: list[list[int]]):
    """A drafter cache holding each prompt but its last token, and that token as the anchor (prompts of one
    length)."""
    ids = torch.tensor(prompts)
    features = target(ids).features
    length = ids.shape[1] - 1
    cache = drafter.new_cache(len(prompts))
    drafter.extend_cache(cache, features[:, :length], torch.arange(length).expand(len(prompts), -1),
                         torch.ones(len(prompts), length, dtype=torch.bool))
    return cache, ids[:, -1], torch.full((len(prompts),), length)


def reference_q(drafter: DFlash2Drafter, hidden, logits, predecessor: int, temperature: float) -> dict[int, float]:
    """The selector's q at one slot by brute force: candidate c of the top-k scores logit(c) + sum over the rank of
    P[predecessor] * (W h) * S[c]; softmax of the scores / T."""
    s = drafter.candidate_selector
    gate = s.hidden_projection.weight @ hidden
    candidates = logits.topk(s.top_k).indices.tolist()
    scores = torch.stack([logits[c] + (s.predecessor_codebook[predecessor] * gate * s.successor_codebook[c]).sum()
                          for c in candidates])
    return dict(zip(candidates, torch.softmax(scores / temperature, 0).tolist()))


@torch.no_grad()
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_q_is_the_selector_given_the_sampled_predecessors(target, temperature):
    """Each slot's q equals a brute-force selector given the draft sampled at the slot before (the anchor first),
    the draft is one of its candidates, and the sampled path leaves the argmax path, so the predecessors matter."""
    drafter = make_drafter(target, "random")
    prompts = [[b % 6, (b * 5) % 6, (b * 3 + 1) % 6, b % 5] for b in range(64)]
    cache, anchors, positions = _block(target, drafter, prompts)
    drafts, q = sample_chained_draft(drafter, cache, anchors, positions, Sampling(temperature, sample_drafts=True),
                                     seed=9, keys=torch.arange(64), start=torch.zeros(64, dtype=torch.long))
    hidden, logits = drafter.drafted_slots(cache, anchors, positions)
    for b in range(64):
        predecessor = int(anchors[b])
        for slot in range(drafts.shape[1]):
            ours = dict(zip(q.ids[b, slot].tolist(), q.probs[b, slot].tolist()))
            expected = reference_q(drafter, hidden[b, slot], logits[b, slot], predecessor, temperature)
            assert ours.keys() == expected.keys()
            assert all(ours[c] == pytest.approx(expected[c], abs=1e-6) for c in ours)
            assert int(drafts[b, slot]) in ours
            predecessor = int(drafts[b, slot])
    assert not torch.equal(drafts, drafter.draft(cache, anchors, positions)[0])


def _q_over_the_full_vocabulary(drafter, cache, anchor_ids, anchor_positions, sampling, **kw):
    """Broken: samples the selector's path but verifies it against the drafter's logits' softmax over the whole
    vocabulary (DFlash 1's q), which is not the law the drafts were drawn from."""
    drafts, _ = sample_chained_draft(drafter, cache, anchor_ids, anchor_positions, sampling, **kw)
    return drafts, DraftQ(target_probs(drafter.drafted_slots(cache, anchor_ids, anchor_positions)[1], sampling))


def _q_given_the_argmax_path(drafter, cache, anchor_ids, anchor_positions, sampling, **kw):
    """Broken: samples the selector's path but hands verification each slot's q scored given the argmax path's
    predecessor instead of the draft actually sampled before it."""
    drafts, q = sample_chained_draft(drafter, cache, anchor_ids, anchor_positions, sampling, **kw)
    rows = []

    def argmax(slot, scores):
        rows.append(torch.softmax(scores.float() / sampling.temperature, dim=-1))
        return scores.argmax(-1)

    drafter.draft_path(cache, anchor_ids, anchor_positions, argmax)
    return drafts, DraftQ(torch.stack(rows, 1), q.ids)


def _residual_inside_the_candidates(p, q, ids=None):
    """Broken: takes max(0, p − q) over the candidates only, as if q's support bounded the target's."""
    inside = torch.zeros_like(p).scatter(-1, ids, 1.0)
    residual = p.scatter_add(-1, ids, -q.to(p.dtype)).clamp_min(0.0) * inside
    return torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)


BROKEN = {"q-over-the-full-vocabulary": (speculative, "sample_chained_draft", _q_over_the_full_vocabulary),
          "q-given-the-argmax-path": (speculative, "sample_chained_draft", _q_given_the_argmax_path),
          "residual-inside-the-candidates": (verify, "_residual", _residual_inside_the_candidates)}


# The broken-rule tests show the chi-square has teeth (each mistake fails it); they test the test, not the decoder,
# so they run under make test-all.
@pytest.mark.slow
@pytest.mark.parametrize("broken", BROKEN)
def test_broken_selector_rules_are_caught(target, monkeypatch, broken):
    """The lossless test has teeth: each plausible mistake in the selector's sampled rule fails it by far."""
    monkeypatch.setattr(*BROKEN[broken])
    sampling, n = LOSSLESS_CASES["T1-fixed-logits"][0], 10_000
    counts = sampled_joint(target, make_drafter(target, "fixed"), PROMPT, sampling, n, length=3)
    try:
        stat, critical = chi_square(counts, exact_joint(target, PROMPT, sampling, 3, EOS), n)
    except AssertionError:
        return  # it even emitted a sequence the target cannot produce
    assert stat > 3 * critical


@pytest.mark.parametrize("sampling", [Sampling(temperature=1.0, sample_drafts=True),
                                      Sampling(temperature=0.8, top_k=3, top_p=0.9, sample_drafts=True)])
def test_sampled_batched_equals_per_sequence(target, sampling):
    """The selector's draws are keyed by (seed, key, response index) too, so a sequence ignores its batch."""
    decoder = SpeculativeDecoder(target, make_drafter(target, "random"), eos_id=EOS)
    keys = list(range(100, 100 + len(MIXED_PROMPTS)))
    batched = decoder.generate(MIXED_PROMPTS, sampling, max_new_tokens=20, seed=3, keys=keys)
    assert any(r > 0 for rec in batched for r in rec.accepted)
    for prompt, key, rec in zip(MIXED_PROMPTS, keys, batched):
        alone = decoder.generate([prompt], sampling, max_new_tokens=20, seed=3, keys=[key])[0]
        assert (alone.response_ids, alone.drafts, alone.accepted, alone.anchors) == \
            (rec.response_ids, rec.drafts, rec.accepted, rec.anchors)


def test_opd_eval_decodes_a_draft_sample_setting_with_a_dflash2_drafter(micro_spec_file, micro_dflash2, tmp_path):
    """`opd eval` takes a `draft: sample` setting for a DFlash 2 checkpoint end to end (it was refused)."""
    spec = yaml.safe_load(micro_spec_file.read_text())
    spec["eval"]["sampling"] = [{"name": "sampled-q", "temperature": 1.0, "draft": "sample"}]
    micro_spec_file.write_text(yaml.safe_dump(spec))
    out = tmp_path / "eval.json"
    assert main(["eval", str(micro_spec_file), "--draft", micro_dflash2, "--json", str(out)]) == 0
    row = json.loads(out.read_text())["rows"][0]
    assert row["sampling"] == "sampled-q" and row["tau"] >= 1.0



@torch.no_grad()
def test_q_is_zlabs_selector_q_along_its_sampled_path(target, tmp_path):
    """z-lab's `CandidateSelector.select` at T > 0 samples a path and returns each slot's q over its candidates;
    our selector, walked along that same path, gives the same q (candidates matched by id: z-lab's top-k is
    unsorted)."""
    zlab = pytest.importorskip("dflash.model", reason="z-lab's dflash package is not installed")
    drafter = make_drafter(target, "random")
    drafter.save_pretrained(tmp_path)
    model = zlab.DFlash2DraftModel.from_pretrained(tmp_path, dtype=torch.float64).eval()
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(64, 3, drafter.config.hidden_size, dtype=torch.float64, generator=gen)
    anchors = torch.randint(0, 8, (64,), generator=gen)
    torch.manual_seed(0)
    path, zlab_candidates, zlab_q = model.propose(hidden, anchors, target.lm_head, 0.7)
    logits = drafter.logits(hidden)
    candidates, rows = logits.topk(drafter.candidate_selector.top_k, dim=-1).indices, []

    def follow(slot, scores):  # z-lab's draft at this slot, and the q our selector gives it
        rows.append(torch.softmax(scores.float() / 0.7, dim=-1))
        return (candidates[:, slot] == path[:, slot, None]).long().argmax(-1)

    assert torch.equal(drafter.candidate_selector.path(hidden, logits, anchors, follow)[0], path)
    ours = torch.zeros(*path.shape, 8).scatter(-1, candidates, torch.stack(rows, 1))
    theirs = torch.zeros(*path.shape, 8).scatter(-1, zlab_candidates, zlab_q)
    assert torch.allclose(ours, theirs, atol=1e-6)
    assert not torch.equal(path, drafter.candidate_selector.argmax_path(hidden, logits, anchors))
