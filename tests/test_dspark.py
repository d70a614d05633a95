"""DSpark (opd/models/dspark.py): a DFlash backbone over K-1 drafting slots whose Markov head chains the drafts.

Micro models in float64, as tests/test_dflash2.py: greedy drafts are the Markov head's argmax path, the packed
training forward gives each block the logits its own draft gives it, its checkpoint is speculators' layout, and its
training, `sft.init_from` and refusals go through the CLI. The Markov head is scaled up so that its bias changes
the drafts. What every family keeps (lossless decoding, replay, the rebuild, the checkpoint round trip, a learner
step) is tests/test_family_contract.py's.
"""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from opd.cli import main
from opd.errors import OpdError
from opd.formats.dflash import DFlashConfig
from opd.formats.dspark import DSparkConfig
from opd.model_dir import ModelDir
from opd.models.build import build_models
from opd.models.dflash import DFlashDrafter
from opd.models.dspark import DSparkDrafter
from opd.models.registry import family
from opd.models.target import load_target
from opd.spec import SpecError, load_spec
from opd.tiny.micro import micro_target
from opd.train.sft import init_from
from tests.helpers.dspark import dspark_drafter


@pytest.fixture(scope="module")
def target():
    return micro_target(seed=0, vocab_size=8, layer_ids=[0, 2, 3])


@pytest.fixture(scope="module")
def drafter(target):
    return dspark_drafter(target)


def _cache(drafter, features, a):
    cache = drafter.new_cache(1)
    drafter.extend_cache(cache, features[:, :a], torch.arange(a)[None], torch.ones(1, a, dtype=torch.bool))
    return cache


def test_greedy_drafts_are_the_markov_heads_argmax_path(target, drafter):
    ids = torch.tensor([[1, 2, 3, 4, 5, 1, 2]])
    features = target(ids).features
    cache = _cache(drafter, features, 6)
    drafts, logits = drafter.draft(cache, ids[:, 6], torch.tensor([6]))
    hidden, base = drafter.drafted_slots(cache, ids[:, 6], torch.tensor([6]))
    previous, walked = ids[0, 6], []
    for slot in range(drafter.block_size - 1):
        row = drafter.lm_head(hidden[0, slot]) + drafter.markov_head.markov_w2(drafter.markov(previous))
        assert torch.allclose(row, logits[0, slot])
        walked.append(int(row.argmax()))
        previous = torch.tensor(walked[-1])
    assert drafts[0].tolist() == walked
    assert walked != base[0].argmax(-1).tolist()  # the bias changes the path


def test_training_layout_gives_each_block_its_drafted_logits(target, drafter):
    """The packed forward (`block_hidden`, many blocks per sequence) through the student head equals, in float64,
    each block drafted alone with its own cache, given the drafts as the block's inputs."""
    ids = torch.tensor([[1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 0, 1]])
    features = target(ids).features
    anchors = [2, 5, 6, 9]
    drafted = [drafter.draft(_cache(drafter, features, a), ids[:, a], torch.tensor([a])) for a in anchors]
    inputs = torch.stack([torch.cat([ids[0, a:a + 1], d[0][0, :-1]]) for a, d in zip(anchors, drafted)])[None]
    hidden = drafter.block_hidden(features, ids, torch.ones_like(ids).bool(), torch.tensor([anchors]), inputs)
    assert hidden.shape == (1, 4, drafter.block_size - 1, drafter.config.hidden_size + drafter.config.markov_rank)
    for m, (_, logits) in enumerate(drafted):
        torch.testing.assert_close(drafter.student_head(hidden[:, m]), logits, rtol=1e-12, atol=1e-12)


def test_its_checkpoint_is_speculators_layout_served_as_dspark(drafter, tmp_path):
    """`save_pretrained` writes speculators' DSpark layout (its block of K-1 drafting slots, the slot at the anchor
    drafting, the Markov and confidence heads), which vLLM serves with its `dspark` method."""
    drafter.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["speculators_model_type"], config["block_size"], config["sample_from_anchor"]) == (
        "dspark", drafter.block_size - 1, True)
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == drafter.block_size - 1
    assert {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.weight",
            "confidence_head.proj.bias"} <= set(load_file(str(tmp_path / "model.safetensors")))
    assert family("dspark").vllm_config(ModelDir.read(tmp_path, "drafter"), drafter.block_size) == {
        "method": "dspark", "model": str(tmp_path), "num_speculative_tokens": drafter.block_size - 1}


@pytest.mark.parametrize(("change", "message"), [
    ({"sample_from_anchor": False}, "'sample_from_anchor' is false"),
    ({"markov_head_type": "gated"}, "'markov_head_type' is 'gated'"),
    ({"markov_rank": 0}, "'markov_rank' is 0"),
])
def test_variants_not_built_are_refused_in_one_line(drafter, change, message):
    with pytest.raises(OpdError, match=message):
        DSparkConfig.from_hf_dict(drafter.config.to_speculators_dict() | change, 4)


@pytest.fixture
def micro_dspark(micro_assets, tmp_path):
    """A DSpark drafter on the micro assets' drafter, saved."""
    target = load_target(micro_assets["target"], dtype=torch.float32, layer_ids=[1, 2])
    base = DFlashDrafter.from_pretrained(micro_assets["drafter"], target)
    config = DSparkConfig(**{f.name: getattr(base.config, f.name) for f in fields(DFlashConfig)}, markov_rank=4)
    drafter = DSparkDrafter(config, target.embed_tokens, target.lm_head)
    drafter.load_state_dict(base.state_dict(), strict=False)
    drafter.save_pretrained(tmp_path / "dspark")
    return str(tmp_path / "dspark")


SERVED = ["--set", "serving={draft: sample, temperature: 1.0, top_p: 0.95, top_k: 40}", "--set",
          "replay.teacher=served", "--set", "loss.objective=one_minus_alpha"]


TRAINS_CONFIDENCE = {"run-confidence": ["--set", "models.drafter.confidence_weight=1"],
                     "sft-dspark": ["--set", "models.drafter.sft_objective=dspark"]}


# make test runs each command once (the plain `run` and `sft` under make test-all)
@pytest.mark.parametrize("command", [pytest.param("run", marks=pytest.mark.slow), "run-sampled", "run-confidence",
                                     pytest.param("sft", marks=pytest.mark.slow), "sft-dspark"])
def test_training_commands_train_a_dspark_drafter(micro_spec_file, micro_dspark, command, tmp_path, capsys):
    """`opd run` (Draft-OPD's loss on DSpark's q, the Markov bias included; or, with drafts sampled from q at the
    serving setting, the acceptance objective on that q) and `opd sft` (cross-entropy on it) train the backbone and
    the Markov head and save speculators' layout; the confidence head trains under `models.drafter.confidence_weight` and
    DSpark's published SFT objective, and is left as it is otherwise. The published objective's run starts a fresh
    drafter from the warm one's tensors (`sft.init_from`), which the command must carry in before training."""
    run_dir = tmp_path / "run"
    args = [command.split("-")[0], str(micro_spec_file), "--set", f"models.drafter_path={micro_dspark}",
            *(SERVED if command == "run-sampled" else []), *TRAINS_CONFIDENCE.get(command, [])]
    if command == "sft-dspark":  # a fresh drafter that `sft.init_from` starts from the same checkpoint
        args += ["--set", "models.drafter_path=", "--set", "models.drafter.kind=dspark", "--set",
                 "models.drafter.markov_rank=4", "--set", f"sft.init_from={micro_dspark}"]
    if command.startswith("run"):
        args += ["--set", f"tracking.run_dir={run_dir}", "--set", "steps=2", "--set", "eval.every=0"]
    else:
        args += ["--out", str(run_dir / "sft"), "--set", "sft.epochs=1", "--set", "sft.batch_size=20", "--set",
                 "sft.anchors_per_seq=2", "--set", "sft.response_max_new_tokens=6", "--set", "rollout.temperature=0"]
    assert main(args) == 0, capsys.readouterr().err
    if command == "sft-dspark":
        assert f"sft.init_from: 18 tensors from {micro_dspark}; random: none" in capsys.readouterr().out
    saved = sorted(p.parent for p in run_dir.rglob("config.json") if "dspark" in p.read_text())[-1]
    before = load_file(str(Path(micro_dspark) / "model.safetensors"))
    after = load_file(str(saved / "model.safetensors"))
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    assert {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "fc.weight"} <= changed
    confidence = {"confidence_head.proj.weight", "confidence_head.proj.bias"}
    assert (confidence <= changed) if command in TRAINS_CONFIDENCE else not changed & confidence


FRESH_DSPARK = ["models.drafter_path=", "models.drafter.kind=dspark", "models.drafter.markov_rank=4"]
HEADS = {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.weight",
         "confidence_head.proj.bias"}


def test_init_from_carries_a_dflash_backbone_into_a_fresh_dspark_drafter(micro_spec_file, micro_assets):
    """`sft.init_from`: every tensor of the DFlash checkpoint lands unchanged, the Markov and confidence heads keep
    their random initialisation, and DSpark's backbone computes exactly what the DFlash drafter computes on DSpark's
    block. That is all the mapping guarantees: DSpark's slot j sits at a+j and predicts a+j+1, where DFlash runs a
    mask at a+j+1 for it, so no DSpark slot equals a DFlash draft and SFT learns that shift."""
    spec = load_spec(micro_spec_file, [*FRESH_DSPARK, f"sft.init_from={micro_assets['drafter']}", "seed=3"])
    models = build_models(spec)  # seed 3: a random backbone other than the checkpoint's
    fresh = {name: tensor.clone() for name, tensor in models.drafter.state_dict().items()}
    init_from(spec, models)
    source = DFlashDrafter.from_pretrained(micro_assets["drafter"], models.target)
    carried = models.drafter.state_dict()
    assert set(carried) - set(source.state_dict()) == HEADS
    assert all(torch.equal(carried[name], tensor) for name, tensor in source.state_dict().items())
    assert all(torch.equal(carried[name], fresh[name]) for name in HEADS)
    assert not torch.equal(carried["fc.weight"], fresh["fc.weight"])
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14]])
    valid, anchors = torch.ones_like(ids, dtype=torch.bool), torch.tensor([[1, 4, 6]])
    inputs = ids[0, anchors[0, :, None] + torch.arange(models.drafter.block_size - 1)][None]
    with torch.no_grad():
        features = models.target(ids).features
        ours = models.drafter.block_hidden(features, ids, valid, anchors, inputs)[..., : source.config.hidden_size]
        block = inputs.new_full(inputs.shape, source.mask_token_id)
        block[..., 0] = inputs[..., 0]
        theirs = source.forward_blocks(source.project_context(features), valid, block, anchors)
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize(("sets", "message"), [
    ([*FRESH_DSPARK, "models.drafter.num_layers=2"],
     r"has layer_types \['full_attention'\] but the fresh dspark drafter \['full_attention', 'full_attention'\] "
     r"\(expected them to agree"),
    (["models.drafter_path="], "holds markov_head.markov_w1.weight, which the dflash drafter lacks"),
])
def test_init_from_a_checkpoint_that_does_not_map_is_one_line(micro_spec_file, micro_dspark, sets, message):
    spec = load_spec(micro_spec_file, [*sets, f"sft.init_from={micro_dspark}"])
    with pytest.raises(OpdError, match=message):
        init_from(spec, build_models(spec))


def test_init_from_a_warm_drafter_is_refused_in_one_line(micro_spec_file, micro_assets):
    with pytest.raises(SpecError) as info:
        load_spec(micro_spec_file, [f"sft.init_from={micro_assets['drafter']}"])
    assert info.value.messages == [
        f"sft.init_from: {micro_assets['drafter']} with models.drafter_path {micro_assets['drafter']} (it starts a "
        "fresh drafter; expected models.drafter_path empty, or sft.init_from: null)"]
