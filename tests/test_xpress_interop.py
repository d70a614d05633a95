"""XPress in vLLM's `speculators` 0.9.0 (`XPressDraftModel`): our export loads there whole and, for fixed blocks,
its Jacobi passes give our drafts and logits (float32, 1e-5); what it saves loads here as the same drafter.

speculators resolves a block's passes in its training forward: its consistency rounds start from the backbone's
argmax and feed each round the previous round's argmax, the recurrence of inference-time Jacobi decoding, so its
last round's logits are the logits whose argmax a served block drafts (tests/helpers/speculators.py,
`xpress_rounds`, captures them). The blocks' anchors are past position 1, where the token before the anchor is the
text's for both. speculators' `from_pretrained` leaves the refiner's causal mask uninitialised memory; the helper's
`speculators_model` builds it again (its docstring says why).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from opd.formats.dflash import DFlashConfig
from opd.formats.xpress import XPressConfig
from opd.model_dir import ModelDir
from opd.models.dflash import DFlashDrafter
from opd.models.lm_head import teacher_head
from opd.models.registry import detect, family, load_drafter
from opd.models.target import load_target
from opd.models.xpress import XPressDrafter
from tests.helpers.decoding import drafted_alone
from tests.helpers.speculators import quiet, speculators_model, xpress_rounds  # noqa: F401 (quiet: a fixture)

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning")]

TARGET, DRAFTER = "opd/assets/tiny/target", "opd/assets/tiny/drafter"
ANCHORS = [3, 10, 17, 25]
LENGTH = 40
PASSES = 3


@pytest.fixture(scope="module")
def target():
    return load_target(TARGET, dtype=torch.float32, layer_ids=[1, 3])


@pytest.fixture(scope="module")
def xpress(target):
    """An XPress drafter on the shipped drafter's weights (K = 8), its refiner random and scaled up so that its
    bias and its passes change the drafts."""
    shipped = DFlashDrafter.from_pretrained(DRAFTER, target)
    config = XPressConfig.of(DFlashConfig(**{k: getattr(shipped.config, k) for k in
                                             DFlashConfig.__dataclass_fields__}),
                             xpress_rank=16, xpress_mlp_ratio=2, jacobi_passes=PASSES)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        drafter = XPressDrafter(config, target.embed_tokens, target.lm_head, teacher_head(target))
        drafter.load_state_dict(shipped.state_dict(), strict=False)
        with torch.no_grad():
            drafter.refiner_head.mix_l.normal_(std=0.5)
            drafter.refiner_head.token_embed.weight.mul_(100.0)
            drafter.refiner_head.readout.weight.mul_(50.0)
    return drafter


@pytest.fixture(scope="module")
def text(target):
    ids = torch.randint(0, target.config.vocab_size, (1, LENGTH), generator=torch.Generator().manual_seed(0))
    last, features = target.hidden_states(ids)
    return ids, last, features


def test_speculators_runs_our_export_with_its_jacobi_passes_to_our_drafts_and_logits(xpress, text, tmp_path):
    family("xpress").save_speculators(xpress, tmp_path, TARGET)
    model = speculators_model(tmp_path)
    assert type(model).__name__ == "XPressDraftModel" and model.block_size == xpress.block_size
    assert json.loads((tmp_path / "config.json").read_text())["num_jacobi_passes"] == PASSES
    saved = set(load_file(str(tmp_path / "model.safetensors")))
    assert saved == set(model.state_dict()) - set(model._keys_to_ignore_on_load_missing)
    ids, _, features = text
    base, rounds = xpress_rounds(model, text, ANCHORS, PASSES)
    with torch.no_grad():
        inputs = torch.stack([ids[0, a:a + xpress.block_size - 1] for a in ANCHORS])[None]
        rows = xpress.block_hidden(features, ids, torch.ones(1, LENGTH, dtype=torch.bool), torch.tensor([ANCHORS]),
                                   inputs)[0]
        ours = xpress.student_head(rows)
    theirs = rounds[-1][:, 1:]
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
    # the refiner and its passes decide drafts here: neither the backbone's argmax nor the first round's is it
    assert not torch.equal(ours.argmax(-1), base[:, 1:].argmax(-1))
    assert not torch.equal(ours.argmax(-1), rounds[0][:, 1:].argmax(-1))


def test_decoding_drafts_what_speculators_passes_give(xpress, target, text, tmp_path):
    """Each block drafted alone from a decoding cache of the text before it gives speculators' last round."""
    family("xpress").save_speculators(xpress, tmp_path, TARGET)
    _, rounds = xpress_rounds(speculators_model(tmp_path), text, ANCHORS, PASSES)
    ids, _, features = text
    for m, a in enumerate(ANCHORS):
        drafts, logits = drafted_alone(xpress, features, ids, a)
        torch.testing.assert_close(logits, rounds[-1][m, 1:], rtol=1e-5, atol=1e-5)
        assert torch.equal(drafts, rounds[-1][m, 1:].argmax(-1))


def test_what_speculators_saves_for_xpress_loads_here_as_the_same_drafter(xpress, target, tmp_path):
    family("xpress").save_speculators(xpress, tmp_path / "ours", TARGET)
    speculators_model(tmp_path / "ours").save_pretrained(tmp_path / "saved")
    loaded = load_drafter(tmp_path / "saved", target)
    assert type(loaded) is XPressDrafter and loaded.config == xpress.config
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), xpress.state_dict().values()))


def test_serve_bench_speculative_config_drafts_what_speculators_writes(xpress, tmp_path):
    """vLLM's `xpress` method, K-1 drafts per step: the count speculators' proposal records."""
    family("xpress").save_speculators(xpress, tmp_path, TARGET)
    written = json.loads((tmp_path / "config.json").read_text())["speculators_config"]
    exported = ModelDir.read(tmp_path)
    ours = detect(exported).vllm_config(exported, xpress.block_size)  # what `opd serve-bench` hands vLLM
    assert ours["num_speculative_tokens"] == written["proposal_methods"][0]["speculative_tokens"]
    assert ours == {"method": "xpress", "model": str(tmp_path), "num_speculative_tokens": xpress.block_size - 1}
    assert written["algorithm"] == "xpress"
