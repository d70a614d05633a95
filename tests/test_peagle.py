"""P-EAGLE (opd/models/peagle.py): an EAGLE-3 drafter whose chain's later slots read the pard token and a learned
`mask_hidden`, so the whole chain is drafted in one pass.

Micro models in float64 (no argmax ties), as tests/test_eagle3.py: the packed training forward gives each block
what a dense causal pass over that block alone gives, offline τ equals decoded τ, and its checkpoint is
speculators' layout, whose fields it reads or refuses in one line. What every family keeps (lossless decoding,
replay, the rebuild, the checkpoint round trip, a learner step) is tests/test_family_contract.py's.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from opd.data.prompts import Prompt
from opd.errors import OpdError
from opd.eval.online import evaluate
from opd.formats.peagle import PEagleConfig
from opd.model_dir import ModelDir
from opd.models.build import Models
from opd.models.peagle import PEagleDrafter
from opd.models.registry import family
from opd.tiny.micro import micro_target
from tests.helpers.decoding import EOS, MASK
from tests.helpers.offline import MAX_NEW, SEED, SETTINGS, draw_samples, offline
from tests.helpers.peagle import trained_like


@pytest.fixture(scope="module")
def target():
    # Six layers: fc fuses the states entering layers 2, 3, 4 (this project's ids 1, 2, 3), as for EAGLE-3.
    return micro_target(seed=0, vocab_size=8, num_layers=6, layer_ids=[1, 2, 3])


@pytest.fixture(scope="module")
def drafter(target):
    return trained_like(target)


def dense_block(drafter: PEagleDrafter, features: torch.Tensor, ids: torch.Tensor, anchor: int) -> torch.Tensor:
    """The definition, for one block: the columns 0..a-1 (feature at p, the token after p) followed by the K-2 mask
    slots at positions a..a+K-3 (pard token, mask_hidden), all through one plainly causal attention; the logits [K-1,
    Vd] at column a-1 and at the slots."""
    slots = drafter.block_size - 2
    mask_features = drafter.mask_hidden[0].expand(slots, -1)
    inputs = torch.cat([features[0, :anchor], mask_features])[None]
    tokens = torch.cat([ids[0, 1:anchor + 1], torch.full((slots,), drafter.config.mask_token_id)])[None]
    q, k, v, state = drafter._columns(inputs, tokens, torch.arange(anchor + slots)[None])
    groups = q.shape[1] // k.shape[1]
    attended = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), is_causal=True)
    out = drafter._finish(state, attended)[0, anchor - 1:]
    return drafter.logits(drafter._head(out))


def test_the_packed_student_equals_the_dense_definition_per_block(target, drafter):
    """`block_hidden` (every block of a sequence in one pass) equals, in float64, each block as a causal pass over
    its columns and mask slots alone, and `draft` from a cache gives the same logits."""
    ids = torch.tensor([[1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 0, 1]])
    _, features = target.hidden_states(ids)
    anchors = [2, 5, 6, 9]
    inputs = torch.stack([ids[0, a:a + drafter.block_size - 1] for a in anchors])[None]
    packed = drafter.logits(drafter.block_hidden(features, ids, torch.ones_like(ids).bool(), torch.tensor([anchors]),
                                                 inputs))[0]
    for m, a in enumerate(anchors):
        torch.testing.assert_close(packed[m], dense_block(drafter, features, ids, a), rtol=1e-12, atol=1e-12)
        cache = drafter.new_cache(1)
        drafter.extend_cache(cache, features[:, :a], torch.arange(a)[None], torch.ones(1, a, dtype=torch.bool),
                             ids[:, 1:a + 1])
        _, logits = drafter.draft(cache, ids[:, a], torch.tensor([a]))
        torch.testing.assert_close(logits[0][:, drafter.vocab_ids], packed[m], rtol=1e-12, atol=1e-12)


def test_mask_slots_read_the_pard_token_and_mask_hidden_not_the_drafts(target, drafter):
    ids = torch.tensor([[1, 2, 3, 4, 5, 1]])
    _, features = target.hidden_states(ids)
    args = features, ids, torch.ones_like(ids).bool(), torch.tensor([[3]])
    fed = [drafter.block_hidden(*args, torch.tensor([[[4, t, t]]])) for t in (0, 5)]
    assert torch.equal(fed[0], fed[1])
    moved = trained_like(target)
    with torch.no_grad():
        moved.mask_hidden.add_(1.0)
    changed = moved.block_hidden(*args, torch.tensor([[[4, 0, 0]]]))
    assert torch.equal(changed[:, :, 0], fed[0][:, :, 0]) and not torch.allclose(changed[:, :, 1:], fed[0][:, :, 1:])


def test_offline_tau_equals_decoded(target, drafter, tmp_path):
    """τ rebuilt from stored samples equals τ decoded, at greedy and at a sampled setting."""
    gen = torch.Generator().manual_seed(0)
    prompts = [Prompt(f"p{i}", "", torch.randint(0, 6, (int(torch.randint(1, 6, (1,), generator=gen)),),
                                                   generator=gen).tolist()) for i in range(40)]
    s = SimpleNamespace(target=target, tokenizer=SimpleNamespace(eos_token_id=EOS), prompts=prompts,
                        path=tmp_path / "samples.jsonl")
    draw_samples(target, drafter, prompts, s.path, SETTINGS)
    rows = evaluate(Models(target, drafter, s.tokenizer), prompts, SETTINGS, max_new_tokens=MAX_NEW, batch_size=32,
                    seed=SEED, baseline=False)
    off = offline(s, drafter)
    for row in rows:
        assert off[row.sampling].tau == pytest.approx(row.tau, abs=1e-12), row.sampling
    assert rows[0].tau > 1  # some drafts accepted, so the comparison reads blocks


def test_its_checkpoint_is_speculators_layout_served_as_parallel_eagle3(drafter, tmp_path):
    """`save_pretrained` writes speculators' P-EAGLE layout (the pard token, K-1 proposed tokens, the drafter's own
    embedding and mask_hidden), which vLLM serves as EAGLE-3 drafting in one pass."""
    drafter.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["speculators_model_type"], config["mask_token_id"]) == ("peagle", MASK)
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == drafter.block_size - 1
    assert {"mask_hidden", "embed_tokens.weight", "layers.0.self_attn.q_proj.weight", "d2t", "t2d"} <= set(
        load_file(str(tmp_path / "model.safetensors")))
    assert family("peagle").vllm_config(ModelDir.read(tmp_path, "drafter"), drafter.block_size) == {
        "method": "eagle3", "model": str(tmp_path), "num_speculative_tokens": drafter.block_size - 1,
        "parallel_drafting": True}


@pytest.mark.parametrize(("change", "message"), [
    ({"mask_token_id": None}, "'mask_token_id' is None"),
    ({"mask_token_id": 8}, "'mask_token_id' is 8"),
    ({"speculators_model_type": "eagle3"}, "'speculators_model_type' is 'eagle3'"),
    ({"speculators_config": {}}, "speculative_tokens' is None"),
    ({"norm_before_residual": True}, "'norm_before_residual' is True"),
])
def test_what_it_cannot_read_is_one_line(drafter, change, message):
    with pytest.raises(OpdError, match=message):
        PEagleConfig.from_speculators(drafter.config.to_speculators_dict() | change, 6)


def test_more_than_one_layer_is_refused_in_one_line(drafter):
    """speculators allows deeper P-EAGLE drafters; this family implements one layer, as the EAGLE-3 one does."""
    config = drafter.config.to_speculators_dict()
    config["transformer_layer_config"] |= {"num_hidden_layers": 2}
    with pytest.raises(OpdError, match="'num_hidden_layers' is 2"):
        PEagleConfig.from_speculators(config, 6)


def test_a_frozen_embedding_is_read_from_embed_requires_grad(target, drafter):
    """speculators trains P-EAGLE's embedding unless `embed_requires_grad` is false; the drafter follows the file."""
    config = PEagleConfig.from_speculators(drafter.config.to_speculators_dict() | {"embed_requires_grad": False}, 6)
    frozen = PEagleDrafter(config, target.embed_tokens, target.lm_head)
    assert not frozen.embedding.weight.requires_grad and drafter.embedding.weight.requires_grad
    assert torch.equal(frozen.embedding.weight, target.embed_tokens.weight)  # a copy of the target's, not it
    assert frozen.embedding.weight.data_ptr() != target.embed_tokens.weight.data_ptr()
