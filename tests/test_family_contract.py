"""The contract every drafter family keeps, run over the registry (`opd.models.registry.FAMILIES`): a family
registered tomorrow is under it without an edit here, and fails it until tests/helpers/tiny_families.py says how
small a drafter of it can be.

Per family, on a tiny drafter of it drawn by the family itself: random initialisation (seeded, on the target's
frozen modules), its public export and `speculators` export loading back as the same drafter of the same family
(names, shapes, weights, the K a serving engine runs), greedy decoding equal to the target's argmax, decoding at
T>0 lossless (chi-square), replay giving every recorded block the logits and drafts decoding gave it, the rebuild
recovering every block from the text alone, and one learner step that trains it. What only one family does (its
numerics, its layout's fields, its own messages, interop with z-lab and speculators) stays in that family's module.

Micro models in float64 (no argmax ties), as tests/test_decoding.py.
"""

from __future__ import annotations

import math
from dataclasses import fields

import pytest
import torch

from opd.commands.preflight import check_drafter
from opd.decoding.autoregressive import generate_autoregressive
from opd.decoding.sampling import Sampling
from opd.decoding.speculative import SpeculativeDecoder
from opd.distill.replay import replay_mode, score, student_hidden
from opd.errors import OpdError
from opd.formats import DRAFTER_SECTIONS, KINDS
from opd.formats.speculators import is_speculators
from opd.model_dir import ModelDir
from opd.models.family import DrafterFamily
from opd.models.protocol import chains, clone_drafter
from opd.models.registry import FAMILIES, detect, family, load_drafter
from opd.tiny.micro import micro_target
from opd.train.learner import Learner
from tests.helpers.decoding import EOS, MIXED_PROMPTS, assert_rebuild_recovers, drafted_alone
from tests.helpers.lossless import assert_lossless
from tests.helpers.tiny_families import HERE, TINY, draw, spec_of, tiny

PROMPTS = MIXED_PROMPTS
MAX_NEW = 24

# What a family serves at T>0, as make test checks it: the drafts it samples from its q where its section says it
# can (`samples_from_q`), at two settings. Its point mass is verified as every family's is (test_decoding.py's
# chi-square), so that case runs under make test-all; a family that serves only point masses has it at two.
POINT_MASS = {"T1-point-mass": Sampling(temperature=1.0), "T1-topp0.8-point-mass": Sampling(temperature=1.0, top_p=0.8)}
SAMPLED = {"T1-sampled": Sampling(temperature=1.0, sample_drafts=True),
           "T0.7-topk3-topp0.9-sampled": Sampling(temperature=0.7, top_k=3, top_p=0.9, sample_drafts=True)}
SETTINGS = POINT_MASS | SAMPLED


def lossless_cases() -> list:
    cases = []
    for kind, found in FAMILIES.items():
        if found.section.samples_from_q:
            cases.append(pytest.param(kind, "T1-point-mass", marks=pytest.mark.slow, id=f"{kind}-T1-point-mass"))
            cases += [pytest.param(kind, name, id=f"{kind}-{name}") for name in SAMPLED]
        else:
            cases += [pytest.param(kind, name, id=f"{kind}-{name}") for name in POINT_MASS]
    return cases


@pytest.fixture(scope="module")
def target():
    # Six layers: EAGLE-3's fc fuses the states entering layers 2, 3, 4 (this project's ids 1, 2, 3); every family
    # reads those three.
    return micro_target(seed=0, vocab_size=8, num_layers=6, layer_ids=[1, 2, 3])


@pytest.fixture(scope="module")
def drafters(target):
    """kind -> the family's tiny drafter, drawn on first use and shared by the module (tests that change weights
    train a clone)."""
    drawn: dict[str, object] = {}

    def of(kind: str):
        if kind not in drawn:
            drawn[kind] = draw(kind, target)
        return drawn[kind]

    return of


def state(module) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in module.state_dict().items()}


def assert_same_drafter(got, want) -> None:
    """The same family's class and config, and the same tensors: names, shapes, dtypes and values."""
    assert type(got) is type(want) and got.config == want.config
    ours, theirs = got.state_dict(), want.state_dict()
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert ours[name].shape == tensor.shape and ours[name].dtype == tensor.dtype, name
        assert torch.equal(ours[name], tensor), name


# -- the registry ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", FAMILIES)
def test_every_registered_family_has_a_tiny_configuration(kind):
    """The family is registered under its section's kind, and tests/helpers/tiny_families.py says how to make a
    tiny drafter of it (else: the message saying what to add)."""
    assert family(kind).kind == kind and family(kind).section in DRAFTER_SECTIONS
    tiny(kind)


def test_a_family_without_a_tiny_configuration_is_told_what_to_add():
    assert "unlisted" not in TINY
    with pytest.raises(pytest.fail.Exception) as info:
        tiny("unlisted")
    message = str(info.value)
    assert "drafter family 'unlisted' is registered" in message and "add TINY['unlisted'] = Tiny(section=" in message
    assert HERE in message and "\n" not in message


def test_every_tiny_configuration_is_of_a_registered_family():
    assert list(FAMILIES) == list(KINDS) and set(TINY) <= set(FAMILIES), sorted(set(TINY) - set(FAMILIES))


# -- random initialisation, export and import ---------------------------------------------------------------------


@pytest.mark.parametrize("kind", FAMILIES)
def test_random_init_is_the_familys_seeded_and_off_the_target(kind, target):
    """The family accepts its tiny section for a random drafter (`check_initial`), draws a drafter of its kind and K
    that the same seed draws again and another seed does not, and whose parameters are none of the target's."""
    section = spec_of(kind).models.drafter
    family(kind).check_initial(section, None, target)
    drafter = draw(kind, target)
    assert drafter.kind == kind and drafter.block_size == section.block_size
    assert_same_drafter(draw(kind, target), drafter)
    other = draw(kind, target, seed=2).state_dict()
    assert any(not torch.equal(other[name], tensor) for name, tensor in drafter.state_dict().items())
    assert {id(p) for p in drafter.parameters()}.isdisjoint(id(p) for p in target.parameters())


@pytest.mark.parametrize("kind", FAMILIES)
def test_the_public_export_loads_back_as_the_same_drafter(kind, target, drafters, tmp_path):
    """`save_pretrained` writes the family's public layout: detected as this family, its tensors the names and
    shapes the preflight expects, served at the drafter's K, and loaded back as the same drafter."""
    drafter, section = drafters(kind), spec_of(kind).models.drafter
    drafter.save_pretrained(tmp_path)
    directory = ModelDir.read(tmp_path, "drafter")
    assert detect(directory).kind == kind
    check_drafter(str(tmp_path), target, section)
    assert family(kind).served_block_size(directory, target, section) == drafter.block_size
    assert_same_drafter(load_drafter(tmp_path, target), drafter)


@pytest.mark.parametrize("kind", FAMILIES)
def test_the_speculators_export_loads_back_as_the_same_drafter(kind, target, drafters, tmp_path):
    """`save_speculators` writes vLLM's speculators layout, which is detected as this family, holds the tensors the
    preflight expects, and loads back as the same drafter; a family that has no such export says so in one line."""
    drafter, found = drafters(kind), family(kind)
    if type(found).save_speculators is DrafterFamily.save_speculators:
        with pytest.raises(OpdError, match=f"models.drafter.kind: {kind} has no speculators export") as info:
            found.save_speculators(drafter, tmp_path, None)
        assert "\n" not in str(info.value)
        return
    found.save_speculators(drafter, tmp_path, None)
    directory = ModelDir.read(tmp_path, "drafter")
    assert is_speculators(directory.config) and detect(directory).kind == kind
    check_drafter(str(tmp_path), target, spec_of(kind).models.drafter)
    loaded = load_drafter(tmp_path, target)
    assert type(loaded) is type(drafter)
    assert all(torch.equal(loaded.state_dict()[name], t) for name, t in drafter.state_dict().items())
    lost = {f.name for f in fields(drafter.config) if getattr(loaded.config, f.name) != getattr(drafter.config, f.name)}
    assert not lost, f"config fields lost through speculators' layout: {sorted(lost)}"


def test_a_family_without_a_speculators_export_says_so_in_one_line(target, drafters, tmp_path):
    """The default every family inherits until it writes speculators' layout itself (a family of no registry:
    `DrafterFamily` subclassed without `@drafter_family`)."""
    kind = next(iter(FAMILIES))

    class Unexported(DrafterFamily):
        section = family(kind).section

    with pytest.raises(OpdError, match=f"models.drafter.kind: {kind} has no speculators export") as info:
        Unexported().save_speculators(drafters(kind), tmp_path, None)
    assert "\n" not in str(info.value) and not any(tmp_path.iterdir())


# -- decoding ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", FAMILIES)
def test_greedy_decoding_is_the_targets_argmax(kind, target, drafters):
    records = SpeculativeDecoder(target, drafters(kind), eos_id=EOS).generate(PROMPTS, Sampling(),
                                                                              max_new_tokens=MAX_NEW)
    reference = generate_autoregressive(target, PROMPTS, Sampling(), max_new_tokens=MAX_NEW, eos_id=EOS, seed=0,
                                        keys=list(range(len(PROMPTS))))
    assert [r.response_ids for r in records] == reference
    assert sum(sum(r.accepted) for r in records) >= 5, "the tiny drafter should get some drafts accepted"


@pytest.mark.parametrize(("kind", "setting"), lossless_cases())
def test_decoding_is_lossless(kind, setting, target, drafters):
    """The joint law of the first three emitted tokens equals the target's own (chi-square, 10k sequences)."""
    assert_lossless(target, drafters(kind), SETTINGS[setting], 10_000)


# -- replay and the rebuild --------------------------------------------------------------------------------------


def replayed_drafts(drafter, hidden: torch.Tensor, logits: torch.Tensor, predecessors: torch.Tensor,
                    vocab: torch.Tensor) -> torch.Tensor:
    """The point-mass drafts [N, K-1] that replay's rows give: the mode of the law a chaining drafter draws each
    slot from given the draft before it, else the argmax of the logits (`vocab`: their columns' target ids)."""
    if chains(drafter):
        probs, ids = drafter.draft_law(hidden, logits, predecessors, 1.0)
        best = probs.argmax(-1)
        return best if ids is None else ids.gather(-1, best[..., None])[..., 0]
    return vocab[logits.argmax(-1)]


@pytest.mark.parametrize("static_cache", [False, True])
@pytest.mark.parametrize("sampling", [Sampling(), Sampling(temperature=1.0)], ids=["greedy", "T1"])
@pytest.mark.parametrize("kind", FAMILIES)
def test_replay_gives_every_block_what_decoding_drafted(kind, sampling, static_cache, target, drafters):
    """The scorer's replay of decoded records (`student_hidden`: every block of a sequence in one forward, fed its
    recorded drafts) gives each block the logits its draft gives it alone, over the drafter's vocabulary (the
    columns its draft logits leave finite), and the drafts decoding recorded, through the decoder's cache or not."""
    drafter = drafters(kind)
    decoder = SpeculativeDecoder(target, drafter, eos_id=EOS, static_cache=static_cache)
    records = decoder.generate(PROMPTS, sampling, max_new_tokens=MAX_NEW, seed=3)
    batch = score(target, records, block_size=drafter.block_size, mode="draft_opd")
    with torch.no_grad():
        hidden = student_hidden(drafter, batch)
        logits = drafter.student_head(hidden)
        row, vocab = 0, None
        for record in records:
            ids = torch.tensor([record.prompt_ids + record.response_ids])
            features = target(ids).features
            for anchor, recorded in zip(record.anchors, record.drafts):
                drafts, alone = drafted_alone(drafter, features, ids, len(record.prompt_ids) + anchor)
                vocab = alone[0].isfinite().nonzero()[:, 0]
                assert drafts.tolist() == recorded
                torch.testing.assert_close(logits[row], alone[:, vocab], rtol=1e-12, atol=1e-12)
                row += 1
        assert row == len(hidden) > len(records) and vocab is not None
        replayed = replayed_drafts(drafter, hidden, logits, batch.block_ids[batch.block_valid], vocab)
    assert torch.equal(replayed, torch.tensor([d for r in records for d in r.drafts]))


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(temperature=1.0), Sampling(temperature=0.8, top_k=3)],
                         ids=["greedy", "T1", "T0.8-top3"])
@pytest.mark.parametrize("kind", FAMILIES)
def test_the_rebuild_recovers_every_block(kind, sampling, target, drafters):
    """Every family drafts point masses given the committed text, so the rebuild of opd/sources/rebuild.py gives
    the decoder's records back from the text alone (and with them its τ)."""
    drafter = drafters(kind)
    decoded = SpeculativeDecoder(target, drafter, eos_id=EOS).generate(PROMPTS * 3, sampling, max_new_tokens=MAX_NEW,
                                                                       seed=5)
    assert_rebuild_recovers(target, drafter, decoded, batch_size=4)
    assert any(a > 0 for r in decoded for a in r.accepted)


# -- training ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", FAMILIES)
def test_one_learner_step_trains_the_drafter(kind, target, drafters):
    """`Learner.train_step` on a scored batch of the drafter's own rollouts (the spec's defaults, the family's own
    terms included): a finite loss, a step taken, every parameter that got a gradient moved, and neither a frozen
    part of the drafter nor the target touched."""
    spec = spec_of(kind)
    drafter = clone_drafter(drafters(kind))
    records = SpeculativeDecoder(target, drafter, eos_id=EOS).generate(PROMPTS, Sampling(temperature=1.0),
                                                                       max_new_tokens=MAX_NEW, seed=7)
    batch = score(target, records, block_size=drafter.block_size, mode=replay_mode(spec))
    learner = Learner(spec, drafter)
    before, target_before = state(drafter), state(target)
    metrics = learner.train_step([batch])
    assert math.isfinite(metrics.loss) and metrics.loss > 0 and not metrics.skipped
    assert metrics.num_acc > 0 and metrics.num_rej > 0
    graded = {name for name, p in drafter.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    frozen = {name for name, p in drafter.named_parameters() if not p.requires_grad}
    moved = {name for name, tensor in drafter.state_dict().items() if not torch.equal(tensor, before[name])}
    assert graded and graded <= moved and not frozen & moved, (sorted(graded - moved), sorted(frozen & moved))
    assert all(torch.equal(tensor, target_before[name]) for name, tensor in target.state_dict().items())
