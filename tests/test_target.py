"""Target wrapper: layer-id rule, hooked features vs HF hidden states, custom masks, loading and freezing."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from opd.errors import OpdError
from opd.formats.dflash import default_target_layer_ids
from opd.models.packed_attention import PackedRow, PackedRows
from opd.models.target import Target, load_target
from opd.tiny.micro import micro_target

TOL = 1e-6  # HF Qwen3 computes RMSNorm and RoPE in float32 even for float64 models.


@pytest.mark.parametrize(
    ("num_target_layers", "num_draft_layers", "expected"),
    [
        (36, 5, [1, 9, 17, 25, 33]),  # Qwen3-4B/8B DFlash (public z-lab checkpoints)
        (36, 1, [18]),
        (64, 5, [1, 16, 31, 46, 61]),  # a public 64-layer-target DFlash config
        (52, 5, [1, 13, 25, 37, 49]),  # z-lab/dflash tests/fixtures/dflash2-config.json
        (48, 8, [1, 7, 14, 20, 26, 32, 39, 45]),  # a public 48-layer-target DFlash config
        (4, 1, [2]),
    ],
)
def test_default_layer_ids_match_public_rule(num_target_layers, num_draft_layers, expected):
    assert default_target_layer_ids(num_target_layers, num_draft_layers) == expected


def test_features_equal_hf_hidden_states_at_chosen_layers():
    target = micro_target(layer_ids=[0, 2, 3])  # 3 = last layer: HF reports it after the final norm
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    out = target(ids)
    reference = target.model(ids, output_hidden_states=True)
    expected = torch.cat([reference.hidden_states[i + 1] for i in target.layer_ids], dim=-1)
    assert out.features.shape == (2, 9, 3 * target.hidden_size)
    assert torch.equal(out.features, expected)
    assert torch.equal(out.logits, reference.logits)


def test_features_are_only_recorded_inside_forward():
    target = micro_target()
    target.model(torch.zeros(1, 3, dtype=torch.long))
    assert target._captured is None


def _replay_inputs(prefix: torch.Tensor, block: torch.Tensor, anchor: int):
    """Packed-replay layout: the prefix, then a block continuing after prefix[anchor].

    The block sits at positions anchor+1.. and sees prefix[:anchor+1] and itself causally; a bool mask
    [1,1,T,T] says so. Returns ids, mask, positions and the equivalent plain sequence.
    """
    n_prefix, n_block = len(prefix), len(block)
    total = n_prefix + n_block
    mask = torch.zeros(total, total, dtype=torch.bool)
    mask[:n_prefix, :n_prefix] = torch.ones(n_prefix, n_prefix).tril().bool()
    mask[n_prefix:, : anchor + 1] = True
    mask[n_prefix:, n_prefix:] = torch.ones(n_block, n_block).tril().bool()
    positions = torch.cat([torch.arange(n_prefix), anchor + 1 + torch.arange(n_block)])
    plain = torch.cat([prefix[: anchor + 1], block])
    return torch.cat([prefix, block])[None], mask[None, None], positions[None], plain[None]


def _replay_case():
    gen = torch.Generator().manual_seed(2)
    return torch.randint(0, 64, (7,), generator=gen), torch.randint(0, 64, (3,), generator=gen), 3


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("mask_kind", ["bool", "additive"])
def test_4d_custom_mask_equals_separate_forwards(attn_implementation, mask_kind):
    target = micro_target(layer_ids=[1, 3])
    target.model.set_attn_implementation(attn_implementation)
    prefix, block, anchor = _replay_case()
    ids, mask, positions, plain = _replay_inputs(prefix, block, anchor)
    if mask_kind == "additive":
        mask = torch.zeros(mask.shape, dtype=torch.float64).masked_fill(~mask, torch.finfo(torch.float64).min)
    packed = target(ids, attention_mask=mask, position_ids=positions)
    separate_prefix, separate_block = target(prefix[None]), target(plain)
    n_prefix, n_block = len(prefix), len(block)
    for name in ("logits", "features"):
        got = getattr(packed, name)[0]
        assert (got[:n_prefix] - getattr(separate_prefix, name)[0]).abs().max() < TOL, name
        assert (got[n_prefix:] - getattr(separate_block, name)[0, -n_block:]).abs().max() < TOL, name


def test_a_flash_attention_target_replays_packed_rows_and_refuses_dense_4d_masks():
    """flash-attn has no custom masks: packed replay passes a `PackedRows` layout, which the registered attention
    wrappers run themselves, so the config stays flash_attention_2 throughout (labelled by hand: no flash-attn on
    a CPU, so any call that reached it would fail). A dense 4-D mask under flash is one error line."""
    target = micro_target(layer_ids=[1, 3])
    prefix, block, anchor = _replay_case()
    ids, mask, positions, _ = _replay_inputs(prefix, block, anchor)
    expected = target(ids, attention_mask=mask, position_ids=positions).logits
    layout = PackedRows((PackedRow.of(len(prefix), [anchor], len(block)),), ids.shape[1])
    target.model.config._attn_implementation = "flash_attention_2"
    got = target(ids, attention_mask=layout, position_ids=positions).logits
    assert (got - expected).abs().max() < TOL
    assert target.model.config._attn_implementation == "flash_attention_2"
    with pytest.raises(OpdError, match="dense 4-D mask needs sdpa or eager"):
        target(ids, attention_mask=mask, position_ids=positions)


def test_4d_mask_is_not_ignored():
    """Guard for the test above: without the mask the block would see the whole prefix."""
    target = micro_target()
    prefix, block, anchor = _replay_case()
    ids, _, positions, plain = _replay_inputs(prefix, block, anchor)
    unmasked = target(ids, position_ids=positions)
    assert (unmasked.logits[0, len(prefix) :] - target(plain).logits[0, -len(block) :]).abs().max() > 1e-3


def test_2d_padding_mask_equals_separate_forward():
    target = micro_target(layer_ids=[1, 2])
    gen = torch.Generator().manual_seed(3)
    long_seq, short_seq = torch.randint(0, 64, (7,), generator=gen), torch.randint(0, 64, (4,), generator=gen)
    pad = 7 - 4
    ids = torch.stack([long_seq, torch.cat([torch.zeros(pad, dtype=torch.long), short_seq])])
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, :pad] = 0
    positions = torch.stack([torch.arange(7), (torch.arange(7) - pad).clamp(min=0)])
    out = target(ids, attention_mask=mask, position_ids=positions)
    assert (out.logits[1, pad:] - target(short_seq[None]).logits[0]).abs().max() < TOL
    assert (out.features[1, pad:] - target(short_seq[None]).features[0]).abs().max() < TOL
    assert (out.logits[0] - target(long_seq[None]).logits[0]).abs().max() < TOL


def test_incremental_forward_with_cache_matches_full_forward():
    target = micro_target(layer_ids=[0, 3])
    ids = torch.randint(0, 64, (1, 10), generator=torch.Generator().manual_seed(4))
    full = target(ids)
    first = target(ids[:, :6], use_cache=True)
    second = target(ids[:, 6:], past_key_values=first.past_key_values, use_cache=True)
    assert first.past_key_values is not None
    assert (second.features - full.features[:, 6:]).abs().max() < TOL
    assert (second.logits - full.logits[:, 6:]).abs().max() < TOL


TINY_TARGET = Path(__file__).resolve().parents[1] / "opd/assets/tiny/target"


@torch.inference_mode()
@pytest.mark.parametrize(("dtype", "block"), [(torch.float32, 16), (torch.float32, 3), (torch.bfloat16, 5)])
def test_rope_table_equals_the_rotary_module_at_every_position(dtype, block):
    """The shipped tiny target's rotary table (head_dim 64; blocks of 16 as decoded, odd ones too) gives, at
    every position, what its rotary module forms for the block alone, bit for bit: an element's cos must not
    depend on where it falls in the tensor."""
    target = load_target(str(TINY_TARGET), dtype=dtype, layer_ids=[1])
    rope, x = target._rope, torch.zeros(1, block, target.hidden_size, dtype=dtype)
    assert rope is not None
    for length in range(0, 600, 7):
        positions = torch.arange(length, length + block)[None]
        with rope.given(length, block):
            sliced = target.decoder.rotary_emb(x, positions)
        assert all(torch.equal(a, b) for a, b in zip(sliced, rope.inner(x, positions), strict=True))
    assert [capacity for capacity, _ in rope.tables.values()] == [768]  # 256 first, then grown once


@torch.inference_mode()
def test_rope_table_slices_on_its_own_thread_only():
    """While one thread runs a given block, another thread's forward on the same model gets the rotary module's
    own output (an actor decodes on one thread and evaluates on another)."""
    import threading

    target = load_target(str(TINY_TARGET), dtype=torch.float32, layer_ids=[1])
    rope, x, positions = target._rope, torch.zeros(1, 4, target.hidden_size), torch.arange(100, 104)[None]
    assert rope is not None
    inside, done = threading.Event(), threading.Event()

    def given_elsewhere():
        with rope.given(0, 4):  # a slice here would be positions 0..3
            inside.set()
            done.wait(30)

    worker = threading.Thread(target=given_elsewhere)
    worker.start()
    try:
        inside.wait(30)
        got = target.decoder.rotary_emb(x, positions)
    finally:
        done.set()
        worker.join(30)
    assert all(torch.equal(a, b) for a, b in zip(got, rope.inner(x, positions), strict=True)) and not rope.tables


@torch.no_grad()
@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_a_ready_block_equals_the_causal_mask_on_the_tiny_target(attn_implementation):
    """A verify forward at the decoder's shape (a 16-token block after the text) with `Target.ready_block` equals
    transformers' own causal mask, bit for bit (the families' test does the rest)."""
    target = load_target(str(TINY_TARGET), dtype=torch.float32, attn_implementation=attn_implementation,
                         layer_ids=[1, 3])
    ids = torch.randint(0, target.vocab_size, (1, 80), generator=torch.Generator().manual_seed(0))
    prefill = [target(ids[:, :40], use_cache=True).past_key_values for _ in range(2)]
    outs = [target(ids[:, 40:56], attention_mask=mask, position_ids=torch.arange(40, 56)[None], use_cache=True,
                   past_key_values=cache) for mask, cache in zip((None, target.ready_block(40, 16)), prefill)]
    assert torch.equal(outs[0].logits, outs[1].logits) and torch.equal(outs[0].features, outs[1].features)


def test_target_is_frozen_and_exposes_shared_modules():
    target = micro_target()
    assert all(not p.requires_grad for p in target.parameters())
    assert not target.model.training
    assert target.embed_tokens is target.model.model.embed_tokens
    assert target.lm_head is target.model.lm_head
    assert (target.num_layers, target.hidden_size, target.vocab_size) == (4, 32, 64)
    out = target(torch.zeros(1, 3, dtype=torch.long))
    assert not out.features.requires_grad and not out.logits.requires_grad


def test_layer_ids_out_of_range_raise():
    with pytest.raises(OpdError, match="out of range"):
        micro_target(layer_ids=[1, 4])


def test_load_target_from_local_dir(tmp_path):
    reference = micro_target(seed=5)
    reference.model.save_pretrained(tmp_path)
    loaded = load_target(str(tmp_path), dtype=torch.float64, layer_ids=[0, 2])
    assert isinstance(loaded, Target) and loaded.dtype == torch.float64
    ids = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(5))
    assert torch.equal(loaded(ids).logits, reference(ids).logits)
    assert all(not p.requires_grad for p in loaded.parameters())


def test_load_target_missing_dir_raises(tmp_path):
    with pytest.raises(OpdError, match="config.json not found"):
        load_target(str(tmp_path / "nope"), dtype=torch.float32, layer_ids=[0])


def test_flash_attention_without_flash_attn_raises(tmp_path, monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "flash_attn" else real_find_spec(name, *a)
    )
    micro_target().model.save_pretrained(tmp_path)
    with pytest.raises(OpdError, match=r"pip install -e \.\[gpu\]"):
        load_target(str(tmp_path), dtype=torch.bfloat16, attn_implementation="flash_attention_2", layer_ids=[1])
