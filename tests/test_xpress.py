"""XPress (opd/models/xpress.py): a DFlash backbone whose causal refiner head biases the block's logits, resolved by
K Jacobi passes.

Micro models in float64, as tests/test_dspark.py: the drafts are the argmax after K passes of the refiner written
out here (and, with as many passes as drafted slots, the serial left-to-right walk the causal mixer converges
to), the packed training forward gives each block the logits its own draft gives it, the token before the anchor
comes from the committed text, its checkpoint is speculators' layout, sampled serving is refused in one line, and
decoding on two more target families (Llama, Qwen3-MoE) is lossless with exact replay and rebuild. The refiner is
scaled up so that its bias changes the drafts. What every family keeps on the micro Qwen3 target is
tests/test_family_contract.py's; the interop with speculators' `XPressDraftModel` is tests/test_xpress_interop.py's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from opd.cli import main
from opd.decoding.autoregressive import generate_autoregressive
from opd.decoding.sampling import Sampling
from opd.decoding.speculative import SpeculativeDecoder
from opd.distill.replay import score, student_hidden
from opd.errors import OpdError
from opd.formats.xpress import XPressConfig
from opd.model_dir import ModelDir
from opd.models.registry import family
from opd.models.target import Target
from opd.spec import SpecError, load_spec
from opd.tiny.micro import micro_target
from tests.helpers.decoding import EOS, MIXED_PROMPTS, assert_rebuild_recovers, drafted_alone, fresh_cache
from tests.helpers.lossless import assert_lossless
from tests.helpers.target_families import LAYER_IDS, family_model
from tests.helpers.xpress import xpress_drafter

TEXT = torch.tensor([[1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 0, 1]])


@pytest.fixture(scope="module")
def target():
    return micro_target(seed=0, vocab_size=8, layer_ids=[0, 2, 3])


@pytest.fixture(scope="module")
def drafter(target):
    return xpress_drafter(target)


def _bias(drafter, hidden: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
    """speculators' `XPressRefinerHead.block_bias`, written out: hidden [K,H] of one block, previous [K]."""
    head = drafter.refiner_head
    g = hidden.mean(0, keepdim=True).expand_as(hidden)
    a = torch.cat([hidden @ head.down_h.weight.T, g @ head.down_g.weight.T, head.token_embed.weight[previous]], -1)
    a = a @ head.in_proj.weight.T
    mixer = head.mix_l * torch.tril(torch.ones_like(head.mix_l[0]))  # [r, K, K]
    c = a + torch.stack([(mixer[:, k, :] * a.T).sum(-1) for k in range(len(a))])
    c = c + (F.silu(c @ head.mlp_gate.weight.T) * (c @ head.mlp_up.weight.T)) @ head.mlp_down.weight.T
    return c @ head.readout.weight.T


def _reference(drafter, hidden, before: int, anchor: int, passes: int | None) -> tuple[list[int], torch.Tensor]:
    """(drafts, logits [K-1,V]) of one block's hidden [K,H]: `passes` Jacobi passes from the LM head's argmax,
    or (None) the serial walk, slot k's draft chosen given the drafts before it."""
    base = drafter.lm_head(hidden[1:])
    drafts = base.argmax(-1).tolist()
    if passes is None:
        for k in range(len(drafts)):
            row = base[k] + _bias(drafter, hidden, torch.tensor([before, anchor, *drafts[:-1]]))[k + 1]
            drafts[k] = int(row.argmax())
        return drafts, base + _bias(drafter, hidden, torch.tensor([before, anchor, *drafts[:-1]]))[1:]
    for _ in range(passes):
        logits = base + _bias(drafter, hidden, torch.tensor([before, anchor, *drafts[:-1]]))[1:]
        drafts = logits.argmax(-1).tolist()
    return drafts, logits


@pytest.mark.parametrize("passes", [1, 2, 3])
def test_drafts_are_the_argmax_after_k_jacobi_passes(target, passes):
    """Each pass feeds the refiner the previous pass's argmax; with as many passes as drafted slots (3) the causal
    mixer has converged to the serial walk. The refiner's bias changes the drafts, and so does the pass count."""
    drafter = xpress_drafter(target, passes=passes)
    features, a = target(TEXT).features, 8
    cache = fresh_cache(drafter, features, TEXT, a)
    drafts, logits = drafter.draft(cache, TEXT[:, a], torch.tensor([a]))
    hidden = drafter.cached_blocks(fresh_cache(drafter, features, TEXT, a), drafter._block(TEXT[:, a]),
                                    torch.tensor([a]))[0]
    walked, reference = _reference(drafter, hidden, int(TEXT[0, a - 1]), int(TEXT[0, a]), passes)
    assert drafts[0].tolist() == walked
    torch.testing.assert_close(logits[0], reference, rtol=1e-12, atol=1e-12)
    assert walked != drafter.lm_head(hidden[1:]).argmax(-1).tolist()  # the bias changes the drafts
    if passes == 3:
        assert walked == _reference(drafter, hidden, int(TEXT[0, a - 1]), int(TEXT[0, a]), None)[0]
    if passes == 1:  # one pass more changes a draft: the passes are run, not one
        assert walked != _reference(drafter, hidden, int(TEXT[0, a - 1]), int(TEXT[0, a]), 2)[0]


def test_the_passes_stop_at_a_fixed_point_and_draft_the_same(target):
    """A pass fed its own output is a fixed point: the passes stop there, with every pass's drafts and logits. The
    causal mixer settles slot k by pass k+1, so 3 drafted slots need at most 4 of the 6 passes (and the last)."""
    drafter, calls = xpress_drafter(target, passes=6), []
    mixed = drafter.refiner_head.mixed
    drafter.refiner_head.mixed = lambda *args: calls.append(1) or mixed(*args)
    features, a = target(TEXT).features, 8
    drafts, logits = drafter.draft(fresh_cache(drafter, features, TEXT, a), TEXT[:, a], torch.tensor([a]))
    hidden = drafter.cached_blocks(fresh_cache(drafter, features, TEXT, a), drafter._block(TEXT[:, a]),
                                    torch.tensor([a]))[0]
    walked, reference = _reference(drafter, hidden, int(TEXT[0, a - 1]), int(TEXT[0, a]), 6)
    assert drafts[0].tolist() == walked
    torch.testing.assert_close(logits[0], reference, rtol=1e-12, atol=1e-12)
    assert len(calls) <= 5


def test_training_layout_gives_each_block_its_drafted_logits(target, drafter):
    """The packed forward (`block_hidden`, many blocks per sequence, the passes run on the committed text) through
    the student head equals, in float64, each block drafted alone with its own cache; an anchor at position 1 has
    no entry before it and reads itself as the token before it, in both."""
    features = target(TEXT).features
    anchors = [1, 2, 5, 6, 9]
    drafted = [drafter.draft(fresh_cache(drafter, features, TEXT, a), TEXT[:, a], torch.tensor([a])) for a in anchors]
    inputs = torch.stack([TEXT[0, a:a + drafter.block_size - 1] for a in anchors])[None]
    rows = drafter.block_hidden(features, TEXT, torch.ones_like(TEXT).bool(), torch.tensor([anchors]), inputs)
    assert rows.shape == (1, 5, drafter.block_size - 1, drafter.config.hidden_size + drafter.config.xpress_rank)
    for m, (drafts, logits) in enumerate(drafted):
        ours = drafter.student_head(rows[:, m])
        torch.testing.assert_close(ours, logits, rtol=1e-12, atol=1e-12)
        assert torch.equal(ours.argmax(-1), drafts)


def test_the_token_before_the_anchor_is_the_committed_texts(target, drafter):
    """A block reads the token before its anchor from the cache (the next token of the entry at a-2): another
    token there changes the drafts as the reference's does, whatever the features."""
    features, a = target(TEXT).features, 8
    drafts = []
    for before in range(target.vocab_size):
        ids = TEXT.clone()
        ids[0, a - 1] = before  # only the next-token column changes: the features stay TEXT's
        cache = fresh_cache(drafter, features, ids, a)
        assert int(drafter.token_before(cache, TEXT[:, a], torch.tensor([a]))) == before
        drafted = drafter.draft(cache, TEXT[:, a], torch.tensor([a]))[0][0].tolist()
        hidden = drafter.cached_blocks(fresh_cache(drafter, features, ids, a), drafter._block(TEXT[:, a]),
                                        torch.tensor([a]))[0]
        assert drafted == _reference(drafter, hidden, before, int(TEXT[0, a]), drafter.passes)[0]
        drafts.append(drafted)
    assert len({tuple(d) for d in drafts}) > 1


def test_its_checkpoint_is_speculators_layout_served_as_xpress(drafter, tmp_path):
    """`save_pretrained` writes speculators' XPress layout (the fill-in block of K slots, the refiner's fields and
    tensors), which vLLM's `xpress` method serves with K-1 drafts per step."""
    drafter.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["speculators_model_type"], config["block_size"], config["sample_from_anchor"]) == (
        "xpress", drafter.block_size, False)
    assert (config["xpress_rank"], config["xpress_mlp_ratio"], config["num_jacobi_passes"]) == (4, 2, 2)
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == drafter.block_size - 1
    refiner = {f"refiner_head.{n}" for n in ("token_embed.weight", "down_h.weight", "down_g.weight",
                                             "in_proj.weight", "mix_l", "mlp_gate.weight", "mlp_up.weight",
                                             "mlp_down.weight", "readout.weight")}
    assert refiner <= set(load_file(str(tmp_path / "model.safetensors")))
    assert family("xpress").vllm_config(ModelDir.read(tmp_path, "drafter"), drafter.block_size) == {
        "method": "xpress", "model": str(tmp_path), "num_speculative_tokens": drafter.block_size - 1}


@pytest.mark.parametrize(("change", "message"), [
    ({"sample_from_anchor": True}, "'sample_from_anchor' is true"),
    ({"xpress_rank": 0}, "'xpress_rank' is 0"),
    ({"num_jacobi_passes": 0}, "'num_jacobi_passes' is 0"),
    ({"speculators_model_type": "dspark"}, "'speculators_model_type' is 'dspark'"),
])
def test_variants_not_built_are_refused_in_one_line(drafter, change, message):
    with pytest.raises(OpdError, match=message) as info:
        XPressConfig.from_hf_dict(drafter.config.to_speculators_dict() | change, 4)
    assert "\n" not in str(info.value)


FRESH = ["models.drafter_path=", "models.drafter.kind=xpress", "models.drafter.xpress_rank=4",
         "models.drafter.jacobi_passes=2"]


def test_sampled_serving_is_refused_in_one_line(micro_spec_file):
    with pytest.raises(SpecError) as info:
        load_spec(micro_spec_file, [*FRESH, "serving={draft: sample, temperature: 1.0}", "replay.teacher=served",
                                    "loss.objective=one_minus_alpha"])
    assert ("serving.draft: sample with an xpress drafter (its chain is fed its argmax, so its sampled drafts have "
            "no realized q to train; expected argmax)") in info.value.messages


def test_a_warm_drafter_brings_its_own_refiner(micro_spec_file):
    with pytest.raises(SpecError) as info:
        load_spec(micro_spec_file, ["models.drafter.kind=xpress", "models.drafter.xpress_rank=4"])
    assert "models.drafter.xpress_rank: set, but a warm XPress drafter brings its own (expected it unset)" in (
        info.value.messages)


# -- two more target families ----------------------------------------------------------------------------------------

TARGET_FAMILIES = ("llama", "qwen3_moe")


@pytest.fixture(scope="module", params=TARGET_FAMILIES)
def other(request):
    """(target, XPress drafter) of another target family."""
    target = Target(family_model(request.param), LAYER_IDS)
    return target, xpress_drafter(target)


def test_greedy_decoding_is_the_targets_argmax_on_other_target_families(other):
    target, drafter = other
    records = SpeculativeDecoder(target, drafter, eos_id=EOS).generate(MIXED_PROMPTS, Sampling(), max_new_tokens=16)
    assert [r.response_ids for r in records] == generate_autoregressive(
        target, MIXED_PROMPTS, Sampling(), max_new_tokens=16, eos_id=EOS, seed=0, keys=list(range(len(MIXED_PROMPTS))))


def test_decoding_is_lossless_on_other_target_families(other):
    """The joint law of the first three emitted tokens at T=1 equals the target's own (chi-square, 4k samples)."""
    assert_lossless(*other, Sampling(temperature=1.0), 4_000)


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(temperature=1.0)], ids=["greedy", "T1"])
def test_replay_and_rebuild_are_exact_on_other_target_families(other, sampling):
    """Replay gives every decoded block its drafts and logits (float64, 1e-12), and the rebuild recovers every
    block from the text alone: the drafts are point masses given (context, anchor, the token before it)."""
    target, drafter = other
    records = SpeculativeDecoder(target, drafter, eos_id=EOS).generate(MIXED_PROMPTS, sampling, max_new_tokens=16,
                                                                       seed=3)
    batch = score(target, records, block_size=drafter.block_size, mode="draft_opd")
    with torch.no_grad():
        logits = drafter.student_head(student_hidden(drafter, batch))
        row = 0
        for record in records:
            ids = torch.tensor([record.prompt_ids + record.response_ids])
            features = target(ids).features
            for anchor, recorded in zip(record.anchors, record.drafts):
                drafts, alone = drafted_alone(drafter, features, ids, len(record.prompt_ids) + anchor)
                assert drafts.tolist() == recorded == logits[row].argmax(-1).tolist()
                torch.testing.assert_close(logits[row], alone, rtol=1e-12, atol=1e-12)
                row += 1
    assert_rebuild_recovers(target, drafter, records, batch_size=3)
    assert any(a > 0 for r in records for a in r.accepted)


# -- training through the CLI ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["sft", pytest.param("run", marks=pytest.mark.slow)])
def test_training_commands_train_an_xpress_drafter(micro_spec_file, command, tmp_path, capsys):
    """`opd sft` trains a fresh XPress drafter (cross-entropy on the logits after its passes) and `opd run` then
    trains it with Draft-OPD: the backbone and the refiner move, and the result is speculators' layout."""
    sft_dir = tmp_path / "sft"
    assert main(["sft", str(micro_spec_file), *[a for s in FRESH for a in ("--set", s)], "--out", str(sft_dir),
                 "--set", "sft.epochs=1", "--set", "sft.batch_size=20", "--set", "sft.anchors_per_seq=2", "--set",
                 "sft.response_max_new_tokens=6", "--set", "rollout.temperature=0"]) == 0, capsys.readouterr().err
    start = sorted(p.parent for p in sft_dir.rglob("config.json") if "xpress" in p.read_text())[-1]
    before, saved = None, start
    if command == "run":
        run_dir = tmp_path / "run"
        assert main(["run", str(micro_spec_file), "--set", f"models.drafter_path={start}", "--set",
                     "models.drafter.kind=xpress", "--set", f"tracking.run_dir={run_dir}", "--set", "steps=2",
                     "--set", "eval.every=0"]) == 0, capsys.readouterr().err
        before = load_file(str(Path(start) / "model.safetensors"))
        saved = sorted(p.parent for p in run_dir.rglob("config.json") if "xpress" in p.read_text())[-1]
    after = load_file(str(saved / "model.safetensors"))
    assert json.loads((saved / "config.json").read_text())["speculators_model_type"] == "xpress"
    if before is not None:
        changed = {name for name in before if not torch.equal(before[name], after[name])}
        assert {"refiner_head.readout.weight", "refiner_head.in_proj.weight", "fc.weight"} <= changed
