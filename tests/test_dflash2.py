"""DFlash 2 drafters (opd/models/dflash2.py): z-lab's checkpoint layout, the block convolutions and the candidate
selector against naive references, lossless point-mass decoding (chi-square), FLOPs, the selector's loss terms,
training and evaluating through the CLI, and the one-line refusals. Drafts sampled from the selector's q:
tests/test_dflash2_sampled.py. What every family keeps (the checkpoint round trip, greedy decoding, replay against
decoding, the rebuild, a learner step) is tests/test_family_contract.py's.

Micro models in float64; a random DFlash 2 drafter whose base kernels and codebooks are scaled up, so the
convolutions and the selector change the drafts (a test that ignored them would fail).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from opd.cli import main
from opd.decoding.sampling import Sampling
from opd.decoding.speculative import SpeculativeDecoder
from opd.distill.losses import StepNorm, slot_weights
from opd.distill.replay import score, student_hidden
from opd.distill.selector_loss import selector_loss, sft_selector_loss
from opd.errors import OpdError
from opd.formats.dflash2 import DFlash2Config
from opd.models.dflash2 import DFlash2Drafter
from opd.models.flops import DrafterParams
from opd.spec import LossSpec
from opd.tiny.micro import micro_drafter, micro_target
from tests.helpers.decoding import EOS, MASK
from tests.helpers.dflash2 import DFLASH2, dflash2_drafter
from tests.helpers.lossless import assert_lossless

PROMPTS = [[1, 2, 3], [4, 5], [1, 1, 1, 1, 2], [3], [2, 2], [0, 1, 2, 3, 4, 5]]


@pytest.fixture(scope="module")
def target():
    return micro_target(seed=0, vocab_size=8, layer_ids=[0, 2, 3])


@pytest.fixture(scope="module")
def drafter(target):
    return dflash2_drafter(target)


def test_its_checkpoint_is_zlabs_layout(drafter, tmp_path):
    """`save_pretrained` writes z-lab's DFlash 2 layout: its architecture, the four `dflash_config` fields, the
    selector's codebooks stored without `.weight`, and each convolution's base kernel and kernel projection."""
    drafter.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"]
    assert {k: config["dflash_config"][k] for k in DFLASH2} == DFLASH2
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    h, v, k = drafter.config.hidden_size, drafter.config.vocab_size, DFLASH2["conv_kernel_size"]
    assert shapes["candidate_selector.predecessor_codebook"] == (v, 4)  # stored without `.weight`
    assert shapes["candidate_selector.successor_codebook"] == (v, 4)
    assert shapes["candidate_selector.hidden_projection.weight"] == (4, h)
    assert shapes["layers.0.attention_conv.base_kernel"] == shapes["layers.0.mlp_conv.base_kernel"] == (2, k, h)
    assert shapes["layers.0.mlp_conv.kernel_projection.weight"] == (2 * k * h // 4, h)


@pytest.mark.parametrize(("change", "message"), [
    ({"conv_group_size": 5}, r"'dflash_config\.conv_group_size' is 5, which does not divide hidden_size 32"),
    ({"selector_top_k": 0}, r"'dflash_config\.selector_top_k' must be a positive integer, got 0"),
    ({"selector_top_k": 9}, r"'dflash_config\.selector_top_k' is 9, more than the vocabulary's 8 tokens"),
])
def test_bad_dflash2_configs_are_refused_in_one_line(drafter, change, message):
    hf = drafter.config.to_hf_dict()
    hf["dflash_config"] |= change
    with pytest.raises(OpdError, match=message) as info:
        DFlash2Config.from_hf_dict(hf)
    assert "\n" not in str(info.value)


def naive_convolution(x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor, block: int,
                      group: int) -> torch.Tensor:
    """out[t, c] = sum_j (base[j, c] + dynamic[t, j, c // group]) x[t - j, c], t - j in t's block: loop form."""
    out = torch.zeros_like(x)
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            for j in range(base.shape[0]):
                if (t - j) // block == t // block and t - j >= 0:
                    taps = base[j] + dynamic[b, t, j].repeat_interleave(group)
                    out[b, t] += taps * x[b, t - j]
    return out


@pytest.mark.parametrize("kernel", [2, 3, 6])  # 6 > K=4: taps past the block read nothing
def test_convolution_is_causal_within_each_block(target, kernel):
    conv = dflash2_drafter(target, conv_kernel_size=kernel).layers[0].attention_conv
    x = torch.randn(2, 3 * 4, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0))  # 3 blocks
    out, second = conv.prepare(x)
    dynamic = conv.kernel_projection(x).view(2, 12, 2, kernel, 8)
    assert torch.allclose(out, naive_convolution(x, dynamic[:, :, 0], conv.base_kernel[0], 4, 4))
    y = torch.randn_like(x)
    assert torch.allclose(conv.finish(y, second), naive_convolution(y, dynamic[:, :, 1], conv.base_kernel[1], 4, 4))


@torch.no_grad()
def test_selector_takes_the_best_path_left_to_right(drafter):
    """Each slot's draft maximises logit + interaction with the draft before it (the anchor first), over the slot's
    top-k; the path differs from the logits' own argmax, so the interaction matters."""
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(5, 3, 32, dtype=torch.float64, generator=gen)
    logits = torch.randn(5, 3, 8, dtype=torch.float64, generator=gen)
    anchors = torch.randint(0, 8, (5,), generator=gen)
    s = drafter.candidate_selector
    path = s.argmax_path(hidden, logits, anchors)
    for b in range(5):
        previous = int(anchors[b])
        for slot in range(3):
            gate = s.hidden_projection.weight @ hidden[b, slot]
            allowed = set(logits[b, slot].topk(4).indices.tolist())
            score = {c: float(logits[b, slot, c] + (s.predecessor_codebook[previous] * gate
                                                     * s.successor_codebook[c]).sum()) for c in allowed}
            assert int(path[b, slot]) == max(score, key=score.get)
            previous = int(path[b, slot])
    assert not torch.equal(path, logits.argmax(-1))


@torch.no_grad()
def test_path_walks_as_scores_slot_by_slot(drafter):
    """`path` forms every (predecessor, candidate) score up front; a walk through `scores` one slot at a time (the
    selector loss's call) hands `pick` the same scores and, greedy or not, draws the same path."""
    gen = torch.Generator().manual_seed(4)
    s = drafter.candidate_selector
    hidden = torch.randn(6, 5, 32, dtype=torch.float64, generator=gen)
    logits = torch.randn(6, 5, 8, dtype=torch.float64, generator=gen)
    anchors = torch.randint(0, 8, (6,), generator=gen)
    choices = torch.randint(0, 4, (6, 5), generator=gen)
    for pick in (lambda slot, scores: scores.argmax(-1), lambda slot, scores: choices[:, slot]):
        seen = []
        path, candidates = s.path(hidden, logits, anchors, lambda slot, scores: pick(slot, seen.append(scores)
                                                                                       or scores))
        unary, top = logits.topk(s.top_k, dim=-1)
        gates, previous = s.hidden_projection(hidden), anchors
        for slot in range(5):
            scores = s.scores(gates[:, slot], previous, unary[:, slot], top[:, slot])
            assert torch.allclose(seen[slot], scores, rtol=0, atol=1e-12)
            previous = top[:, slot].gather(-1, pick(slot, scores)[:, None])[:, 0]
            assert torch.equal(path[:, slot], previous)
        assert torch.equal(candidates, top)


def test_point_mass_decoding_at_temperature_is_lossless(target, drafter):
    """The selector's argmax path served as a point mass: the first three tokens follow the target's own law."""
    sampling, n = Sampling(temperature=1.0), 10_000
    assert_lossless(target, drafter, sampling, n)


def test_flops_count_the_convolutions_and_the_selector(target, drafter):
    plain = micro_drafter(target, seed=1, block_size=4, mask_token_id=MASK)
    ours, theirs = DrafterParams.of(drafter), DrafterParams.of(plain)
    h, k, groups, rank, top_k, layers = 32, 3, 8, 4, 4, 1
    projections = 2 * (2 * k * groups * h)  # per layer: the two convolutions' kernel projections
    taps = 2 * 2 * 2 * (2 * k * h)  # two convolutions x two passes x (base + dynamic) multiply-adds
    selector = 2 * rank * h + rank + top_k * (2 * rank + 1)
    context, blocks, slots = 50, 7, 21
    per_token = 2 * projections * layers + taps * layers
    assert ours.forward(context=context, blocks=blocks, slots=slots) - theirs.forward(
        context=context, blocks=blocks, slots=slots) == per_token * blocks * 4 + selector * slots


# make test takes each command and each selector weight once; make test-all the other two pairs
@pytest.mark.parametrize(("command", "selector_weight"), [
    ("run", 1.0), ("sft", 0.0), pytest.param("run", 0.0, marks=pytest.mark.slow),
    pytest.param("sft", 1.0, marks=pytest.mark.slow)])
def test_training_commands_train_a_dflash2_drafter(micro_spec_file, micro_dflash2, command, selector_weight,
                                                   tmp_path, capsys):
    """`opd run` (Draft-OPD: the paper's loss on the drafter's logits, the selector term on its q) and `opd sft`
    train a DFlash 2 drafter's layers and convolutions and save it in z-lab's format; its selector trains through
    its own term, and with `loss.selector_weight: 0` it is frozen and saved as loaded."""
    run_dir = tmp_path / "run"
    args = [command, str(micro_spec_file), "--set", f"models.drafter_path={micro_dflash2}",
            "--set", f"loss.selector_weight={selector_weight}"]
    if command == "run":
        args += ["--set", f"tracking.run_dir={run_dir}", "--set", "steps=2", "--set", "eval.every=0"]
    else:
        args += ["--out", str(run_dir / "sft"), "--set", "sft.epochs=1", "--set", "sft.batch_size=20", "--set",
                 "sft.anchors_per_seq=2", "--set", "sft.response_max_new_tokens=6", "--set", "rollout.temperature=0"]
    assert main(args) == 0, capsys.readouterr().err
    saved = sorted(p.parent for p in run_dir.rglob("config.json") if "dflash_config" in p.read_text())[-1]
    assert json.loads((saved / "config.json").read_text())["architectures"] == ["DFlash2DraftModel"]
    with safe_open(str(saved / "model.safetensors"), "pt") as after, \
            safe_open(str(Path(micro_dflash2) / "model.safetensors"), "pt") as before:
        for name in before.keys():
            same = torch.equal(after.get_tensor(name), before.get_tensor(name))
            assert same == (name.startswith("candidate_selector.") and not selector_weight), name


def test_a_top_k_teacher_with_the_selector_term_is_refused_before_any_compute(micro_spec_file, micro_dflash2,
                                                                               capsys):
    use = ["--set", f"models.drafter_path={micro_dflash2}", "--set", "replay.teacher_topk=4"]
    assert main(["validate", str(micro_spec_file), *use]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "with a dflash2 drafter and replay.teacher_topk 4 (the selector's term reads the full" in err
    assert main(["validate", str(micro_spec_file), *use, "--set", "loss.selector_weight=0"]) == 0


RANDOM_DFLASH2 = {"conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 4, "selector_top_k": 4}


def test_a_random_dflash2_drafter_comes_from_the_spec(micro_spec_file, micro_assets, capsys):
    """The four DFlash 2 fields under models.drafter make a random DFlash 2 drafter; a partial set, a group that
    does not divide the width, or the fields beside a warm drafter are one line each, before any compute."""
    from opd.models.build import build_models
    from opd.spec import load_spec

    sets = ["models.drafter.kind=dflash2", *(f"models.drafter.{k}={v}" for k, v in RANDOM_DFLASH2.items())]
    spec = load_spec(str(micro_spec_file), ["models.drafter_path=", *sets])
    drafter = build_models(spec).drafter
    assert isinstance(drafter, DFlash2Drafter) and drafter.config.selector_top_k == 4
    random = ["--set", "models.drafter_path="]
    cases = [([sets[0], *sets[2:]], "drafter.conv_kernel_size: missing"),
             ([*sets[:2], "models.drafter.conv_group_size=7", *sets[3:]], "models.drafter.conv_group_size is 7"),
             (sets, None)]
    for values, message in cases:
        args = ["validate", str(micro_spec_file), *(random if message else []),
                *(x for v in values for x in ("--set", v))]
        assert main(args) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and (message or "a warm DFlash 2 drafter brings its own") in err, err


@torch.no_grad()
def naive_selector_kl(drafter, hidden: torch.Tensor, predecessor: int, target_logprobs: torch.Tensor) -> float:
    """KL(p̃ || q) at one slot, written out: the top-k of the drafter's logits, each scored as its logit plus
    <P[predecessor] * (W h), S[candidate]>, and the target's probabilities over them renormalised."""
    selector = drafter.candidate_selector
    logits = drafter.logits(hidden[None])[0].double()
    unary, candidates = logits.topk(selector.top_k)
    query = selector.predecessor_codebook[predecessor].double() * (selector.hidden_projection.weight.double()
                                                                    @ hidden.double())
    q = torch.softmax(unary + selector.successor_codebook[candidates].double() @ query, -1)
    p = target_logprobs.double().exp()[candidates]
    p = p / p.sum()
    return float(torch.where(p > 0, p * (p / q).log(), 0.0).sum())


def test_the_selector_term_equals_one_slot_at_a_time(target, drafter):
    """Over decoded blocks replayed as training sees them, the chunked term equals the sum over weighted slots of
    the per-slot KL written out, with the predecessor the rollout scored each slot after; its gradient reaches the
    selector and, through its gate, the drafter, and never the logits it reads."""
    records = SpeculativeDecoder(target, drafter, eos_id=EOS).generate(PROMPTS, Sampling(temperature=1.0),
                                                                       max_new_tokens=12, seed=3)
    batch = score(target, records, block_size=drafter.block_size)
    cfg = LossSpec(lambda_rej=0.5)
    norm = StepNorm.of([(batch.accepted, batch.position_mask)], cfg)
    hidden = student_hidden(drafter, batch)
    predecessors = batch.block_ids[batch.block_valid]
    drafter.zero_grad(set_to_none=True)
    got = selector_loss(drafter.selector, drafter.student_head, drafter.teacher_head, hidden, batch.teacher,
                        predecessors, batch.accepted, batch.position_mask, cfg, norm, chunk_size=3)
    w = slot_weights(batch.accepted, batch.position_mask, cfg, norm)
    k1 = hidden.shape[1]
    expected = sum(float(c) * naive_selector_kl(drafter, hidden.flatten(0, 1)[r].detach(),
                                                int(predecessors.flatten()[r]),
                                                torch.log_softmax(drafter.teacher_head(batch.teacher.flatten(0, 1)[r]),
                                                                  -1))
                   for r, c in zip(w.rows.tolist(), w.coef.tolist()))
    assert len(w.rows) > 2 * k1 and float(got.detach()) == pytest.approx(expected, rel=1e-9)
    got.backward()
    selector = drafter.candidate_selector
    for grad in (selector.hidden_projection.weight.grad, selector.predecessor_codebook.grad,
                 selector.successor_codebook.grad, drafter.fc.weight.grad):
        assert grad is not None and grad.abs().sum() > 0
    drafter.zero_grad(set_to_none=True)


def test_the_sft_selector_term_is_the_labels_cross_entropy_under_q(target, drafter):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(5, 3, target.hidden_size, generator=g, dtype=torch.float64).to(target.dtype)
    labels, before = torch.randint(8, (5, 3), generator=g), torch.randint(8, (5, 3), generator=g)
    mask = torch.rand(5, 3, generator=g) > 0.2
    got = sft_selector_loss(drafter.selector, drafter.student_head, hidden, labels, before, mask, gamma=2.0,
                            log_weight_sum=0.0, chunk_size=4)
    expected, hits = 0.0, 0
    for n, k in mask.nonzero().tolist():
        one_hot = torch.full((8,), -torch.inf)
        one_hot[labels[n, k]] = 0.0
        logits = drafter.logits(hidden[n, k][None])[0]
        if labels[n, k] in logits.topk(drafter.selector.top_k).indices:
            expected += math.exp(-k / 2.0) * naive_selector_kl(drafter, hidden[n, k], int(before[n, k]), one_hot)
            hits += 1
    assert 0 < hits < int(mask.sum()) and float(got.detach()) == pytest.approx(expected, rel=1e-9)


def test_opd_eval_decodes_a_dflash2_drafter(micro_spec_file, micro_dflash2, tmp_path):
    out = tmp_path / "eval.json"
    assert main(["eval", str(micro_spec_file), "--draft", micro_dflash2, "--json", str(out)]) == 0
    assert json.loads(out.read_text())["rows"][0]["tau"] >= 1.0


def test_offline_tau_equals_decoded_tau_and_opd_gap_reads_it(micro_spec_file, micro_dflash2, tmp_path):
    """Held-out samples drawn by the DFlash 2 drafter itself: `opd eval` offline on them gives the τ it decodes, and
    `opd gap` diagnoses it."""
    spec, use = str(micro_spec_file), ["--set", f"models.drafter_path={micro_dflash2}"]
    samples, offline, decoded, gap = (str(tmp_path / name) for name in ("s.jsonl", "off.json", "on.json", "gap.json"))
    assert main(["gen-samples", spec, "--eval", "--engine", "speculative", "--out", samples, *use]) == 0
    assert main(["eval", spec, "--samples", samples, "--json", offline, *use]) == 0
    assert main(["eval", spec, "--json", decoded, *use]) == 0
    rows = [json.loads(open(path).read())["rows"][0] for path in (offline, decoded)]
    assert rows[0]["offline"] and not rows[1]["offline"]
    assert rows[0]["tau"] == pytest.approx(rows[1]["tau"])
    assert main(["gap", spec, "--samples", samples, "--draft", f"d2={micro_dflash2}", "--json", gap, *use]) == 0
    assert json.loads(open(gap).read())[0]["tau"] == pytest.approx(rows[0]["tau"])
