"""DFlash 2 drafters in z-lab's own code (`dflash` 0.1.0's `DFlash2DraftModel`): it loads what we save whole, we
load what it saves, its convolution and selector modules compute what ours do on random inputs, and its greedy
`dflash_generate` writes the same responses with the same tokens per verification as our decoder, on the shipped
tiny target, with a DFlash 2 drafter built on the shipped tiny drafter's weights (so drafts are accepted often) and
with the shipped tiny DFlash 2 drafter.

z-lab shortens the last block to the tokens left in the budget (README: "Using drafters from z-lab's dflash");
the blocks it drafts whole are compared verification by verification, the response always in full.
"""

from __future__ import annotations

import time

import pytest
import torch

from opd.decoding.sampling import Sampling
from opd.decoding.speculative import SpeculativeDecoder
from opd.models.dflash import DFlashDrafter
from opd.models.dflash2 import DFlash2Drafter
from opd.models.registry import load_drafter
from tests.helpers.dflash2 import dflash2_drafter
from tests.helpers.tiny_assets import tiny_target_and_prompts

pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")  # z-lab's calls
zlab = pytest.importorskip("dflash.model", reason="z-lab's dflash package is not installed (pip install .[interop])")

DRAFTER, SHIPPED = "opd/assets/tiny/drafter", "opd/assets/tiny/dflash2"
MAX_NEW, NUM_PROMPTS = 48, 3
FIELDS = {"conv_kernel_size": 3, "conv_group_size": 32, "selector_rank": 16, "selector_top_k": 8}


@pytest.fixture(scope="module")
def tiny():
    return tiny_target_and_prompts(NUM_PROMPTS)


@pytest.fixture(scope="module", params=["built", "shipped"])
def saved(request, tiny, tmp_path_factory):
    """(our DFlash 2 drafter, its directory): one built on the shipped DFlash drafter's weights with random
    convolutions and selector, saved here, or the shipped tiny DFlash 2 drafter (trained, opd/assets/tiny/dflash2)."""
    target = tiny[0]
    if request.param == "shipped":
        return load_drafter(SHIPPED, target), SHIPPED
    drafter = dflash2_drafter(target, seed=0, base=DFlashDrafter.from_pretrained(DRAFTER, target),
                              codebook_scale=20.0, kernel_noise=0.02, **FIELDS)
    directory = tmp_path_factory.mktemp("dflash2")
    drafter.save_pretrained(directory)
    return drafter, str(directory)


def zlab_load(directory):
    model, info = zlab.DFlash2DraftModel.from_pretrained(directory, output_loading_info=True, dtype=torch.float32)
    return model.eval(), info


def test_zlab_loads_our_drafter_whole(saved):
    drafter, directory = saved
    model, info = zlab_load(directory)
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]), info
    theirs = model.state_dict()
    for name, tensor in drafter.state_dict().items():
        key = name + ".weight" if name.endswith("_codebook") else name  # z-lab's nn.Embedding
        assert torch.equal(theirs[key], tensor), name
    assert (model.block_size, model.candidate_selector.top_k) == (drafter.block_size, drafter.config.selector_top_k)


@torch.no_grad()
def test_the_convolutions_compute_what_zlabs_do(saved):
    drafter, directory = saved
    model, _ = zlab_load(directory)
    gen = torch.Generator().manual_seed(0)
    for ours, theirs in ((drafter.layers[1].attention_conv, model.layers[1].attention_conv),
                         (drafter.layers[0].mlp_conv, model.layers[0].mlp_conv)):
        x, y = torch.randn(2, 2, 8, 256, generator=gen).unbind(0)  # [B=2, one block of K=8, H]
        ours_out, ours_taps = ours.prepare(x)
        theirs_out, theirs_taps = theirs.prepare(x)
        assert torch.allclose(ours_out, theirs_out, atol=1e-6)
        assert torch.allclose(ours.finish(y, ours_taps), theirs.finish(y, theirs_taps), atol=1e-6)


@torch.no_grad()
def test_the_selector_chooses_zlabs_greedy_path(saved, tiny):
    drafter, directory = saved
    model, _ = zlab_load(directory)
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(16, 7, 256, generator=gen)
    anchors = torch.randint(0, 2048, (16,), generator=gen)
    path, _, _ = model.propose(hidden, anchors, tiny[0].lm_head, 0.0)
    ours = drafter.choose(hidden, drafter.logits(hidden), anchors)
    assert torch.equal(ours, path)
    assert not torch.equal(ours, drafter.logits(hidden).argmax(-1))  # the selector changed drafts


@pytest.mark.parametrize("how", ["loaded", "built"])
def test_a_checkpoint_zlab_saves_loads_here(saved, tiny, tmp_path, how):
    """A model z-lab loaded saves its codebooks as published (no `.weight`); one it built (trained from scratch with
    its code) saves its nn.Embedding's names (`.weight`): both load here."""
    drafter, directory = saved
    model = zlab_load(directory)[0]
    if how == "built":
        from transformers import Qwen3Config

        state = model.state_dict()
        model = zlab.DFlash2DraftModel(Qwen3Config.from_pretrained(directory))
        model.load_state_dict(state)
    model.save_pretrained(tmp_path)
    loaded = load_drafter(tmp_path, tiny[0])
    assert type(loaded) is DFlash2Drafter and loaded.config == drafter.config
    assert all(torch.equal(loaded.state_dict()[n], t) for n, t in drafter.state_dict().items())


def test_zlab_greedy_decoding_matches_ours_verification_by_verification(saved, tiny, monkeypatch):
    monkeypatch.setattr(zlab, "_cuda_time", time.perf_counter)  # z-lab's clock synchronises CUDA
    target, prompts = tiny
    drafter, directory = saved
    model, _ = zlab_load(directory)
    eos = target.config.eos_token_id
    ours = SpeculativeDecoder(target, drafter, eos_id=eos).generate(prompts, Sampling(), max_new_tokens=MAX_NEW)
    for prompt, record in zip(prompts, ours):
        theirs = zlab.dflash_generate(model, target.model, torch.tensor([prompt]), MAX_NEW, [eos], return_stats=True)
        assert theirs.output_ids[0, len(prompt):].tolist() == record.response_ids
        whole = [i for i in range(len(record.written)) if MAX_NEW - sum(record.written[:i]) >= drafter.block_size]
        assert [theirs.acceptance_lengths[i] for i in whole] == [record.written[i] for i in whole]
    assert sum(r for record in ours for r in record.accepted) > len(prompts) * 4
