"""The project's drafters in z-lab's own code (the `dflash` package, 0.1.0: what a user checks a drafter with), on
the shipped tiny target: z-lab's `DFlashDraftModel` loads every saved drafter whole, reads each variant's layers
as we do, and its greedy `dflash_generate` writes the same responses with the same tokens per verification as
this project's decoder; a checkpoint z-lab saves loads here and drafts identically.

The drafters are the shipped tiny drafter and, for each variant of tests/test_drafter_variants.py, its weights
under that variant's config (windows sized to the tiny prompts), so drafts are accepted often enough that the
per-verification counts say something. z-lab's `_cuda_time` synchronises CUDA; the test swaps it for a CPU clock.
"""

from __future__ import annotations

import time

import pytest
import torch

from opd.decoding.sampling import Sampling
from opd.decoding.speculative import SpeculativeDecoder
from opd.formats.dflash import DFlashConfig
from opd.models.dflash import DFlashDrafter
from tests.helpers.drafter_variants import FULL, SLIDING, VARIANTS, with_change
from tests.helpers.tiny_assets import DRAFTER, tiny_target_and_prompts

pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")  # z-lab's calls
zlab = pytest.importorskip("dflash.model", reason="z-lab's dflash package is not installed (pip install .[interop])")

MAX_NEW, NUM_PROMPTS = 48, 2

# The variants of tests/test_drafter_variants.py on the tiny drafter (two layers, K=8, 40-90-token contexts).
TINY_VARIANTS = {
    "sliding-causal": {"layer_types": [SLIDING, FULL], "use_sliding_window": True, "sliding_window": 24},
    "sliding-bidirectional": {"layer_types": [SLIDING, SLIDING], "use_sliding_window": True, "sliding_window": 6,
                              "is_causal": False},
    "causal": {"is_causal": True},
    "scaled": {"input_embedding_scale": 1.25, "output_multiplier": 0.7,
               "dflash_config": {"final_logit_softcapping": 5.0}},
    "dflash2-shaped": {"layer_types": [SLIDING, SLIDING], "use_sliding_window": True, "sliding_window": 32,
                       "is_causal": False,
                       "dflash_config": {"output_multiplier": 0.196, "final_logit_softcapping": 20.0, "block_size": 8}},
}
# Scaled RoPE as public drafters carry it (gpt-oss's: YaRN; Llama 3.1's: llama3), with the original context short
# enough that the scaling changes the tiny prompts' rotations, and two RoPEs by layer type (Gemma's form).
ROPE_VARIANTS = {
    "yarn": {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0,
                                 "beta_slow": 1.0, "original_max_position_embeddings": 32}},
    "llama3": {"rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 32}},
}
DRAFTERS = ["shipped", *TINY_VARIANTS, *ROPE_VARIANTS]


def test_every_variant_is_checked_here():
    assert set(TINY_VARIANTS) == set(VARIANTS)


@pytest.fixture(scope="module")
def tiny():
    return tiny_target_and_prompts(NUM_PROMPTS)


@pytest.fixture(scope="module")
def saved(tiny, tmp_path_factory):
    """Each drafter saved by this project: {name: (drafter, directory)}."""
    target, _ = tiny
    shipped = DFlashDrafter.from_pretrained(DRAFTER, target)
    out = {"shipped": (shipped, DRAFTER)}
    for name, change in {**TINY_VARIANTS, **ROPE_VARIANTS}.items():
        config = DFlashConfig.from_hf_dict(with_change(shipped.config.to_hf_dict(), change))
        drafter = DFlashDrafter(config, target.embed_tokens, target.lm_head)
        drafter.load_state_dict(shipped.state_dict())
        directory = tmp_path_factory.mktemp(name)
        drafter.save_pretrained(directory)
        out[name] = (drafter, str(directory))
    return out


def zlab_load(directory):
    model, info = zlab.DFlashDraftModel.from_pretrained(directory, output_loading_info=True, dtype=torch.float32)
    return model.eval(), info


@pytest.mark.parametrize("name", DRAFTERS)
def test_zlab_loads_the_drafter_whole_and_reads_its_layers_and_logits_as_we_do(saved, tiny, name):
    drafter, directory = saved[name]
    model, info = zlab_load(directory)
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]), info
    assert [(layer.self_attn.is_causal, layer.self_attn.sliding_window) for layer in model.layers] == [
        (rule.causal, rule.window) for rule in drafter.attention]
    assert (model.block_size, model.mask_token_id, model.target_layer_ids) == (
        drafter.block_size, drafter.mask_token_id, drafter.config.target_layer_ids)
    hidden = torch.randn(3, drafter.config.hidden_size, generator=torch.Generator().manual_seed(0))
    assert torch.equal(model.compute_logits(hidden, tiny[0].lm_head), drafter.logits(hidden))


@pytest.mark.parametrize("name", DRAFTERS)
def test_zlab_greedy_decoding_matches_ours_verification_by_verification(saved, tiny, name, monkeypatch):
    monkeypatch.setattr(zlab, "_cuda_time", time.perf_counter)  # z-lab's clock synchronises CUDA
    target, prompts = tiny
    drafter, directory = saved[name]
    model, _ = zlab_load(directory)
    eos = target.config.eos_token_id
    ours = SpeculativeDecoder(target, drafter, eos_id=eos).generate(prompts, Sampling(), max_new_tokens=MAX_NEW)
    for prompt, record in zip(prompts, ours):
        theirs = zlab.dflash_generate(model, target.model, torch.tensor([prompt]), MAX_NEW, [eos], return_stats=True)
        assert theirs.output_ids[0, len(prompt):].tolist() == record.response_ids
        assert theirs.acceptance_lengths == record.written  # the tokens each verification wrote: z-lab's count
    assert any(r > 0 for record in ours for r in record.accepted)


@pytest.mark.parametrize("name", DRAFTERS)
def test_a_checkpoint_zlab_saves_loads_here_and_drafts_identically(saved, tiny, name, tmp_path):
    target, prompts = tiny
    drafter, directory = saved[name]
    zlab_load(directory)[0].save_pretrained(tmp_path)
    loaded = DFlashDrafter.from_pretrained(tmp_path, target)
    assert loaded.config == drafter.config
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), drafter.state_dict().values()))
    ids = torch.tensor([prompts[0]])
    features, positions, valid = target(ids).features, torch.arange(ids.shape[1])[None], torch.ones_like(ids).bool()
    drafts = []
    for model in (drafter, loaded):
        cache = model.new_cache(1)
        model.extend_cache(cache, features, positions, valid)
        drafts.append(model.draft(cache, ids[:, -1], torch.tensor([ids.shape[1]])))
    assert torch.equal(drafts[0][0], drafts[1][0]) and torch.equal(drafts[0][1], drafts[1][1])
