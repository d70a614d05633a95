"""The project's drafters in vLLM's `speculators` (0.9.0), the format library of vLLM's training and serving: its
model classes load what this project exports, with no missing or unexpected tensor, and compute the same logits on
the same blocks; what speculators saves loads here as the same drafter.

DFlash goes through speculators' own path for a public checkpoint (`from_pretrained` converts z-lab's layout);
DFlash 2, which that converter cannot read, is exported in speculators' layout (`save_speculators`); EAGLE-3 goes
through speculators' EAGLE-3 converter (SpecForge's layout), given the layer ids, which it does not read from
`eagle_config`; EAGLE 3.1 (`fc_norm`, `norm_before_fc`, `norm_output`), whose norm tensors that converter drops, is
exported in speculators' layout. The target is
the shipped tiny one (its path is the verifier speculators reloads the embedding and LM head from); the drafters
are the shipped tiny drafter and a DFlash 2 drafter on its weights with random convolutions and selector, so no
weight is downloaded. speculators runs each family's training forward on the compared blocks
(tests/helpers/speculators.py says how), in float32 with eager attention (its flex attention compiles a kernel), so
logits agree to float32 rounding and their argmax exactly; EAGLE-3's chain is compared step by step.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from opd.formats.dflash import DFlashConfig
from opd.formats.dflash2 import DFlash2Config
from opd.formats.dspark import DSparkConfig
from opd.formats.eagle3 import Eagle3Spec, draft_vocab
from opd.model_dir import ModelDir
from opd.models.dflash import DFlashDrafter
from opd.models.dflash2 import DFlash2Drafter
from opd.models.dspark import DSparkDrafter
from opd.models.lm_head import teacher_head
from opd.models.registry import detect, family, load_drafter
from opd.models.target import load_target
from tests.helpers.speculators import (
    dflash_blocks,
    dspark_slots,
    eagle3_chain,
    entrypoints,
    peagle_core,
    peagle_slots,
    quiet,  # noqa: F401 (a fixture)
    speculators,
    speculators_model,
)

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"),  # speculators' default-layer-id notices
              pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")]  # its Llama calls

TARGET, DRAFTER = "opd/assets/tiny/target", "opd/assets/tiny/drafter"
ANCHORS = [3, 10, 17, 25]
LENGTH = 40
DFLASH2 = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 4}


@pytest.fixture(scope="module")
def target():
    return load_target(TARGET, dtype=torch.float32, layer_ids=[1, 3])


@pytest.fixture(scope="module")
def drafters(target):
    """{kind: a drafter of that family on the tiny target}."""
    shipped = DFlashDrafter.from_pretrained(DRAFTER, target)
    config = DFlash2Config.of(shipped.config, DFLASH2)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        dflash2 = DFlash2Drafter(config, target.embed_tokens, target.lm_head, teacher_head(target))
        dflash2.load_state_dict(shipped.state_dict(), strict=False)
        with torch.no_grad():
            for layer in dflash2.layers:
                for conv in (layer.attention_conv, layer.mlp_conv):
                    conv.base_kernel.add_(0.3 * torch.randn_like(conv.base_kernel))
            dflash2.candidate_selector.predecessor_codebook.mul_(40.0)
            dflash2.candidate_selector.successor_codebook.mul_(40.0)
    return {"dflash": shipped, "dflash2": dflash2}


@pytest.fixture(scope="module")
def text(target):
    """A token sequence, the target's final hidden states and its features there."""
    ids = torch.randint(0, target.config.vocab_size, (1, LENGTH), generator=torch.Generator().manual_seed(0))
    last, features = target.hidden_states(ids)
    return ids, last, features


def export(kind: str, drafter, directory: Path) -> Path:
    """The project's export as speculators reads it: z-lab's layout through speculators' converter (DFlash), or
    speculators' own layout (DFlash 2)."""
    if kind == "dflash":
        drafter.save_pretrained(directory / "public")
        return Path(entrypoints.maybe_convert_external_checkpoint(str(directory / "public"), verifier=TARGET,
                                                                  output_path=str(directory / "converted")))
    family(kind).save_speculators(drafter, directory / "speculators", TARGET)
    return directory / "speculators"


def our_blocks(drafter, text) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden [M,K,H], logits [M,K,V]) of our drafter's blocks at ANCHORS."""
    ids, _, features = text
    anchors = torch.tensor([ANCHORS])
    block = torch.full((1, len(ANCHORS), drafter.block_size), drafter.mask_token_id)
    block[0, :, 0] = ids[0, anchors[0]]
    with torch.no_grad():
        context = drafter.project_context(features)
        hidden = drafter.forward_blocks(context, torch.ones(1, LENGTH, dtype=torch.bool), block, anchors)[0]
    return hidden, drafter.logits(hidden)


def assert_close(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """Equal to float32 rounding, with the same argmax everywhere."""
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-4)
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_speculators_loads_our_export_whole_and_computes_the_same_logits(drafters, text, kind, tmp_path):
    drafter = drafters[kind]
    directory = export(kind, drafter, tmp_path)
    model = speculators_model(directory)
    assert type(model).__name__ == {"dflash": "DFlashDraftModel", "dflash2": "DFlash2DraftModel"}[kind]
    saved = set(load_file(str(directory / "model.safetensors")))
    ignored = set(model._keys_to_ignore_on_load_missing)
    assert saved == set(model.state_dict()) - ignored  # no tensor missing, none unexpected
    assert model.config.aux_hidden_state_layer_ids == [i + 1 for i in drafter.config.target_layer_ids]
    assert (model.block_size, model.mask_token_id) == (drafter.block_size, drafter.mask_token_id)
    ours, theirs = our_blocks(drafter, text), dflash_blocks(model, text, ANCHORS)
    assert_close(ours[1], theirs[1])
    if kind == "dflash2":  # the selector's scores of each slot's top-k after the text's own previous token
        ids = text[0][0]
        previous = torch.stack([ids[a:a + drafter.block_size] for a in ANCHORS])
        previous = torch.cat([previous[:, :1], previous[:, :-1]], dim=1)
        candidates, scores = model.candidate_selector.select(theirs[1], theirs[0], previous)
        selector = drafter.candidate_selector
        gate = selector.hidden_projection(ours[0])
        unary = ours[1].gather(-1, candidates)
        mine = torch.stack([selector.scores(gate[:, k], previous[:, k], unary[:, k], candidates[:, k])
                            for k in range(drafter.block_size)], dim=1)
        assert torch.equal(candidates, ours[1].topk(DFLASH2["selector_top_k"], dim=-1).indices)
        assert_close(mine.detach(), scores.detach())


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_what_speculators_saves_loads_here_as_the_same_drafter(drafters, target, kind, tmp_path):
    drafter = drafters[kind]
    speculators_model(export(kind, drafter, tmp_path)).save_pretrained(tmp_path / "saved")
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert config["speculators_model_type"] == kind
    directory = ModelDir.read(tmp_path / "saved", "drafter")
    assert detect(directory).kind == kind
    loaded = load_drafter(tmp_path / "saved", target)
    assert type(loaded) is type(drafter) and loaded.config == drafter.config
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), drafter.state_dict().values()))


def test_speculators_layout_names_what_it_cannot_say(drafters):
    from opd.errors import OpdError
    from opd.formats.dflash import dflash_public
    from opd.formats.eagle3 import eagle3_public
    from opd.formats.speculators import dflash_speculators

    public = drafters["dflash"].config.to_hf_dict()
    layout = dflash_speculators(public, TARGET, ["Qwen3ForCausalLM"], "dflash")
    with pytest.raises(OpdError, match="'sample_from_anchor' is true"):
        dflash_public(layout | {"sample_from_anchor": True}, 6)
    with pytest.raises(OpdError, match="'draft_vocab_size' is 32"):
        dflash_public(layout | {"draft_vocab_size": 32}, 6)
    scaled = public | {"dflash_config": public["dflash_config"] | {"output_multiplier": 0.5}}
    with pytest.raises(OpdError, match="'dflash_config.output_multiplier' has no counterpart"):
        dflash_speculators(scaled, TARGET, [], "dflash")
    assert DFlashConfig.from_hf_dict(layout, 6) == drafters["dflash"].config
    with pytest.raises(OpdError, match="an entering id of 1"):
        eagle3_public({"speculators_model_type": "eagle3", "transformer_layer_config": {"model_type": "llama"},
                       "eagle_aux_hidden_state_layer_ids": [1, 3, 4]})


EAGLE31 = {"eagle3": {}, "fc_norm": {"fc_norm": True}, "norm_before_fc": {"norm_before_fc": True},
           "fc_norm+norm_output": {"fc_norm": True, "norm_output": True}}


@pytest.fixture(scope="module")
def eagle3_target():
    """The tiny target reading the three layers EAGLE-3 fuses."""
    return load_target(TARGET, dtype=torch.float32, layer_ids=[1, 2, 3])


@pytest.fixture(params=list(EAGLE31))
def eagle3(request, eagle3_target):
    """(target, an EAGLE-3 drafter on it with a fitted draft vocabulary, and EAGLE 3.1's flags as named, their
    norms' weights random)."""
    target = eagle3_target
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        random = family("eagle3").initial(Eagle3Spec(draft_vocab_size=512, block_size=4), target, None)
        drafter = type(random)(dataclasses.replace(random.config, **EAGLE31[request.param]), target.embed_tokens,
                               target.lm_head)
        drafter.load_state_dict(random.state_dict(), strict=False)
        drafter.set_vocab(*draft_vocab(torch.rand(target.config.vocab_size), 512))
        with torch.no_grad():
            for name, weight in drafter.named_parameters():
                if "norm" in name:
                    weight.uniform_(0.5, 1.5)
    return target, drafter


def eagle3_export(drafter, directory: Path):
    """Our export as speculators' EAGLE-3 class loads it: SpecForge's layout through speculators' converter, or,
    with EAGLE 3.1's norms (whose tensors that converter drops), speculators' own layout (`save_speculators`)."""
    if any(getattr(drafter.config, flag) for flag in ("fc_norm", "norm_before_fc", "norm_output")):
        family("eagle3").save_speculators(drafter, directory / "converted", TARGET)
    else:
        drafter.save_pretrained(directory / "public")
        entrypoints.convert_model(str(directory / "public"), TARGET, "eagle3",
                                  output_path=str(directory / "converted"),
                                  eagle_aux_hidden_state_layer_ids=drafter.config.aux_layer_ids)
    return speculators_model(directory / "converted"), directory / "converted"


def test_speculators_loads_our_eagle3_export_whole_and_computes_the_same_chain(eagle3, tmp_path):
    target, drafter = eagle3
    model, directory = eagle3_export(drafter, tmp_path)
    assert type(model).__name__ == "Eagle3DraftModel"
    saved = set(load_file(str(directory / "model.safetensors")))
    wanted = set(model.state_dict())  # speculators may leave d2t, t2d and input_norm out; ours carries them
    assert wanted - set(model._keys_to_ignore_on_load_missing) <= saved <= wanted
    assert model.config.eagle_aux_hidden_state_layer_ids == drafter.config.aux_layer_ids
    ids = torch.randint(0, target.config.vocab_size, (1, 30), generator=torch.Generator().manual_seed(1))
    last, features = target.hidden_states(ids)
    anchors = [5, 12, 20]
    theirs = eagle3_chain(model, (ids, last, features), anchors, drafter.block_size - 1)
    with torch.no_grad():
        inputs = torch.stack([ids[0, a:a + drafter.block_size] for a in anchors])[None]
        ours = drafter.logits(drafter.block_hidden(features, ids, torch.ones(1, 30, dtype=torch.bool),
                                                   torch.tensor([anchors]), inputs))[0]
    assert_close(ours, theirs)


def test_what_speculators_saves_for_eagle3_loads_here_as_the_same_drafter(eagle3, tmp_path):
    target, drafter = eagle3
    model, _ = eagle3_export(drafter, tmp_path)
    model.save_pretrained(tmp_path / "saved")
    assert json.loads((tmp_path / "saved" / "config.json").read_text())["speculators_model_type"] == "eagle3"
    loaded = family("eagle3").load(ModelDir.read(tmp_path / "saved", "drafter"), target,
                                   Eagle3Spec(block_size=drafter.block_size))
    assert loaded.config == drafter.config
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), drafter.state_dict().values()))


SERVED_AS = {"dflash": "dflash", "dflash2": "dflash", "dspark": "dspark"}


@pytest.mark.parametrize("kind", SERVED_AS)
def test_serve_bench_speculative_config_drafts_what_speculators_writes(drafters, dspark, kind, tmp_path):
    """vLLM reads a speculators checkpoint's method from its algorithm and its draft count from its proposal;
    `opd serve-bench` passes both explicitly (DFlash 2's z-lab layout goes to vLLM's `dflash` method, while
    speculators names the algorithm `dflash2`)."""
    drafter = dspark if kind == "dspark" else drafters[kind]
    directory = export(kind, drafter, tmp_path)
    written = json.loads((directory / "config.json").read_text())["speculators_config"]
    ours = family(kind).vllm_config(ModelDir.read(directory, "drafter"), drafter.block_size)
    assert ours["num_speculative_tokens"] == written["proposal_methods"][0]["speculative_tokens"]
    assert (written["algorithm"], ours["method"]) == (kind, SERVED_AS[kind])


@pytest.fixture(scope="module")
def dspark(target):
    """A DSpark drafter on the shipped drafter's weights (K = 8: speculators' block of 7 drafting slots), with
    random Markov and confidence heads."""
    shipped = DFlashDrafter.from_pretrained(DRAFTER, target)
    config = DSparkConfig(**dataclasses.asdict(shipped.config), markov_rank=16)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        drafter = DSparkDrafter(config, target.embed_tokens, target.lm_head, teacher_head(target))
        drafter.load_state_dict(shipped.state_dict(), strict=False)
        with torch.no_grad():
            drafter.markov_head.markov_w1.weight.mul_(30.0)
    return drafter


def test_speculators_loads_our_dspark_export_whole_and_computes_the_same_logits(dspark, text, tmp_path):
    family("dspark").save_speculators(dspark, tmp_path, TARGET)
    model = speculators_model(tmp_path)
    assert type(model).__name__ == "DSparkDraftModel" and model.block_size == dspark.block_size - 1
    saved = set(load_file(str(tmp_path / "model.safetensors")))
    assert saved == set(model.state_dict()) - set(model._keys_to_ignore_on_load_missing)
    ids, last, features = text
    theirs, their_confidence = dspark_slots(model, text, ANCHORS)
    with torch.no_grad():
        inputs = torch.stack([ids[0, a:a + model.block_size] for a in ANCHORS])[None]  # the text fed as the drafts
        rows = dspark.block_hidden(features, ids, torch.ones(1, LENGTH, dtype=torch.bool), torch.tensor([ANCHORS]),
                                   inputs)[0]
        ours = dspark.student_head(rows)
        confidence = dspark.confidence(rows[..., :dspark.config.hidden_size], inputs[0])
    assert_close(ours, theirs)
    torch.testing.assert_close(confidence, torch.sigmoid(their_confidence), rtol=1e-5, atol=1e-6)


def test_what_speculators_saves_for_dspark_loads_here_as_the_same_drafter(dspark, target, tmp_path):
    family("dspark").save_speculators(dspark, tmp_path / "ours", TARGET)
    speculators_model(tmp_path / "ours").save_pretrained(tmp_path / "saved")
    loaded = load_drafter(tmp_path / "saved", target)
    assert type(loaded) is DSparkDrafter and loaded.config == dspark.config
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), dspark.state_dict().values()))


# --- P-EAGLE --------------------------------------------------------------------------------------------------------
# Our export in speculators' layout loads into its `PEagleDraftModel`, which gives the same logits at column a-1 and
# at every mask slot of its training forward, with its random COD sampling replaced by the blocks compared here.


@pytest.fixture(scope="module", params=[512, 2048], ids=["draft-vocab", "whole-vocab"])
def peagle(request, eagle3_target):
    """A P-EAGLE drafter (K = 5) on the tiny target with a fitted draft vocabulary (reduced, or the whole one, for
    which speculators keeps no d2t and t2d), its norms' weights random."""
    from opd.formats.peagle import PEagleSpec

    size = request.param
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        drafter = family("peagle").initial(PEagleSpec(draft_vocab_size=size, block_size=5, mask_token_id=2),
                                          eagle3_target, None)
        drafter.set_vocab(*draft_vocab(torch.rand(eagle3_target.config.vocab_size), size))
        with torch.no_grad():
            for name, weight in drafter.named_parameters():
                if "norm" in name:
                    weight.uniform_(0.5, 1.5)
    return drafter


def test_speculators_loads_our_peagle_export_whole_and_computes_the_same_logits(peagle, eagle3_target, tmp_path):
    family("peagle").save_speculators(peagle, tmp_path, TARGET)
    model = speculators_model(tmp_path)
    assert type(model).__name__ == "PEagleDraftModel" and model.mask_token_id == peagle.config.mask_token_id
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert set(saved) == set(model.state_dict()) - set(model._keys_to_ignore_on_save)  # none missing, none unexpected
    assert all(torch.equal(model.state_dict()[name], tensor.float()) for name, tensor in saved.items())
    ids = torch.randint(0, eagle3_target.config.vocab_size, (1, 30), generator=torch.Generator().manual_seed(1))
    last, features = eagle3_target.hidden_states(ids)
    anchors = [5, 12, 20]
    theirs = peagle_slots(model, (ids, last, features), anchors, peagle.block_size)
    with torch.no_grad():
        inputs = torch.stack([ids[0, a:a + peagle.block_size - 1] for a in anchors])[None]
        ours = peagle.logits(peagle.block_hidden(features, ids, torch.ones(1, 30, dtype=torch.bool),
                                                 torch.tensor([anchors]), inputs))[0]
    assert_close(ours, theirs)


def test_what_speculators_saves_for_peagle_loads_here_and_serves_as_vllm_reads_it(peagle, eagle3_target, tmp_path):
    """speculators' save loads here as the same drafter; `opd serve-bench` asks vLLM for what vLLM makes of that
    file (its speculators reader: algorithm peagle -> method eagle3 with parallel_drafting, the proposal's tokens,
    the pard token from mask_token_id)."""
    family("peagle").save_speculators(peagle, tmp_path / "ours", TARGET)
    speculators_model(tmp_path / "ours").save_pretrained(tmp_path / "saved")
    loaded = load_drafter(tmp_path / "saved", eagle3_target)
    assert type(loaded) is type(peagle) and loaded.config == peagle.config
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), peagle.state_dict().values()))
    written = json.loads((tmp_path / "saved" / "config.json").read_text())
    ours = family("peagle").vllm_config(ModelDir.read(tmp_path / "saved", "drafter"), loaded.block_size)
    assert (written["speculators_config"]["algorithm"], ours["method"], ours["parallel_drafting"]) == (
        "peagle", "eagle3", True)
    assert ours["num_speculative_tokens"] == written["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    assert written["mask_token_id"] == peagle.config.mask_token_id


def test_a_peagle_drafter_speculators_made_loads_here_with_the_same_logits(eagle3_target, tmp_path):
    """A P-EAGLE drafter built and saved by speculators alone (its own config class, random weights, the verifier's
    embedding) loads here and gives the logits its forward gives."""
    from transformers import AutoConfig

    from opd.models.peagle import PEagleDrafter

    verifier = AutoConfig.from_pretrained(TARGET)
    layer = {name: getattr(verifier, name) for name in ("vocab_size", "hidden_size", "num_attention_heads",
                                                        "num_key_value_heads", "head_dim", "rms_norm_eps",
                                                        "max_position_embeddings")}
    config = peagle_core.PEagleSpeculatorConfig(
        transformer_layer_config=AutoConfig.for_model("llama", **layer, intermediate_size=384, num_hidden_layers=1,
                                                      rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
        draft_vocab_size=verifier.vocab_size, eagle_aux_hidden_state_layer_ids=[2, 3, 4], mask_token_id=5,
        speculators_config=speculators.SpeculatorsConfig(  # type: ignore[attr-defined]
            algorithm="peagle", default_proposal_method="greedy",
            proposal_methods=[speculators.proposals.GreedyTokenProposalConfig(speculative_tokens=4)],
            verifier=speculators.VerifierConfig(name_or_path=TARGET, architectures=verifier.architectures)))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = peagle_core.PEagleDraftModel(config)
        model.load_verifier_weights()
        with torch.no_grad():
            model.embed_tokens.weight.add_(0.1 * torch.randn_like(model.embed_tokens.weight))  # trained, not the target's
    model.save_pretrained(tmp_path)
    drafter = family("peagle").load(ModelDir.read(tmp_path, "drafter"), eagle3_target,
                                    family("peagle").section.model_validate({}))
    assert type(drafter) is PEagleDrafter and drafter.block_size == 5 and drafter.config.mask_token_id == 5
    model = speculators_model(tmp_path)
    ids = torch.randint(0, verifier.vocab_size, (1, 30), generator=torch.Generator().manual_seed(2))
    last, features = eagle3_target.hidden_states(ids)
    anchors = [7, 16]
    theirs = peagle_slots(model, (ids, last, features), anchors, drafter.block_size)
    with torch.no_grad():
        inputs = torch.stack([ids[0, a:a + 4] for a in anchors])[None]
        ours = drafter.logits(drafter.block_hidden(features, ids, torch.ones(1, 30, dtype=torch.bool),
                                                   torch.tensor([anchors]), inputs))[0]
    assert_close(ours, theirs)
