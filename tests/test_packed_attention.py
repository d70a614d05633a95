"""Block-sparse packed attention equals the dense-mask path it replaced (float64 micro models).

The dense references are the replaced code kept as the naive definition: the teacher's [L, L] packed replay mask and
the student's [M*K, C+M*K] block mask (opd/distill/dense_reference.py, which bench/scale_attention.py measures
too).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from opd.decoding.record import SequenceRecord
from opd.distill.dense_reference import dense_block_mask, dense_teacher_masks
from opd.distill.replay import CommittedView, block_inputs, packed_inputs
from opd.errors import OpdError
from opd.memory import peak_cpu_bytes
from opd.models.packed_attention import PackedRow, PackedRows, as_shipped, grouped_sdpa
from opd.tiny.micro import micro_drafter, micro_target

EXACT = 1e-10
EAGER = 1e-6  # HF's eager attention takes its softmax in float32 even for float64 models
K, VOCAB = 5, 40


# ------------------------------------------------------------------------------------------------ references


def dense_student_hidden(drafter, context, context_valid, block_ids, anchors) -> torch.Tensor:
    """`forward_blocks` as it was: every block row against the whole context and every block, one dense mask."""
    batch, num_blocks, block_size = block_ids.shape
    block_positions = (anchors[:, :, None] + torch.arange(block_size)).reshape(batch, -1)
    context_positions = torch.arange(context.shape[1]).expand(batch, -1)
    hidden = drafter._run_blocks(block_ids.reshape(batch, -1), block_positions,
                                 drafter.context_keys_values(context, context_positions),
                                 [dense_block_mask(context_valid, anchors, block_size)] * len(drafter.layers))
    return hidden.view(batch, num_blocks, block_size, -1)


# ------------------------------------------------------------------------------------------------ records


def record(seed: int, prompt_len: int, length: int, block_size: int = K) -> SequenceRecord:
    """A consistent rollout record with random acceptance (0..K-1)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (prompt_len + length,), generator=gen).tolist()
    anchors, drafts, accepted, a = [], [], [], 0
    while a < length - 1:
        r = min(int(torch.randint(0, block_size, (1,), generator=gen)), length - 1 - a)
        tail = torch.randint(0, VOCAB, (block_size - 1 - r,), generator=gen).tolist()
        anchors.append(a), drafts.append(tokens[prompt_len + a + 1 : prompt_len + a + 1 + r] + tail)
        accepted.append(r)
        a += r + 1
    return SequenceRecord(key=seed, prompt_ids=tokens[:prompt_len], response_ids=tokens[prompt_len:],
                          anchors=anchors, drafts=drafts, accepted=accepted, finish_reason="length")


def blockless(seed: int) -> SequenceRecord:
    """eos first: one committed token, no drafted block."""
    return SequenceRecord(key=seed, prompt_ids=[1, 2, 3], response_ids=[4], finish_reason="eos")


BATCHES = {
    "one": [record(0, 4, 17)],
    "two_lengths": [record(1, 3, 9), record(2, 6, 23)],
    "with_blockless": [record(3, 5, 12), blockless(4), record(5, 2, 6)],
    "blockless_only": [blockless(6)],
}


def target_for(heads: int, kv_heads: int, implementation: str = "sdpa"):
    target = micro_target(seed=0, vocab_size=VOCAB, num_heads=heads, num_kv_heads=kv_heads, layer_ids=[0, 3])
    target.model.set_attn_implementation(implementation)
    return target


def assert_teacher_equal(target, records, mode, chunk_rows, tol=EXACT):
    packed, ids, positions, layout = packed_inputs(records, K, mode, chunk_rows)
    dense = dense_teacher_masks(packed, K, ids.shape[1])
    got_hidden, got_features = target.hidden_states(ids, attention_mask=layout, position_ids=positions)
    ref_hidden, ref_features = target.hidden_states(ids, attention_mask=dense, position_ids=positions)
    for b, p in enumerate(packed):  # padding rows are never read
        n = len(p.ids)
        assert (got_hidden[b, :n] - ref_hidden[b, :n]).abs().max() < tol
        assert (got_features[b, :n] - ref_features[b, :n]).abs().max() < tol
    return got_hidden, ref_hidden


# ------------------------------------------------------------------------------------------------ teacher


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("mode", ["draft_opd", "naive"])
@pytest.mark.parametrize("chunk_rows", [1, 2 * (K - 2) + 1, 10_000])  # one block per chunk, ragged, one chunk
def test_packed_teacher_equals_dense_mask(batch, mode, chunk_rows):
    assert_teacher_equal(target_for(4, 2), BATCHES[batch], mode, chunk_rows)


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 1)])
@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_packed_teacher_equals_dense_mask_per_head_layout_and_implementation(heads, kv_heads, implementation):
    assert_teacher_equal(target_for(heads, kv_heads, implementation), BATCHES["two_lengths"], "draft_opd", 7,
                         EXACT if implementation == "sdpa" else EAGER)


@pytest.mark.parametrize("batch", ["two_lengths", "with_blockless"])
@pytest.mark.parametrize("chunk_rows", [1, 10_000])
@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_blocks_over_the_texts_cached_keys_equal_the_dense_packed_row(batch, chunk_rows, implementation):
    """The scorer's shared forward (`CommittedView` with keys and values, then the block rows alone with
    `PackedRows.cached`) gives every block slot the state the dense packed mask gives it."""
    target, records = target_for(4, 2, implementation), BATCHES[batch]
    packed, ids, positions, _ = packed_inputs(records, K, "draft_opd")
    ref = target.hidden_states(ids, attention_mask=dense_teacher_masks(packed, K, ids.shape[1]),
                               position_ids=positions)[0]
    view = CommittedView.of(target, records, K, keep_kv=True)
    got = view.states(target, packed, "draft_opd", K)[0]  # [B, T + Lb, H]: the text, then the block rows
    text = view.hidden.shape[1]
    tol = EXACT if implementation == "sdpa" else EAGER
    for b, p in enumerate(packed):
        blocks = len(p.ids) - p.prefix_len
        assert (got[b, :p.prefix_len] - ref[b, :p.prefix_len]).abs().max() < tol
        if blocks:
            assert (got[b, text : text + blocks] - ref[b, p.prefix_len : len(p.ids)]).abs().max() < tol


def test_cached_rows_need_the_keys_they_were_laid_out_for():
    target = target_for(4, 2)
    packed, ids, positions, _ = packed_inputs(BATCHES["one"], K, "draft_opd")
    view = CommittedView.of(target, BATCHES["one"], K, keep_kv=True)
    block_ids, block_positions, layout = block_inputs(packed, K, view.hidden.shape[1])
    short = PackedRows(layout.rows, layout.length, layout.cached + 1)
    with pytest.raises(OpdError, match=f"expected {layout.cached + 1} cached"):
        target.hidden_states(block_ids, attention_mask=short, position_ids=block_positions, prefix=view.kv)
    with pytest.raises(OpdError, match="longer than the 2 cached positions"):
        PackedRows(layout.rows, layout.length, 2)


def test_packed_layout_is_not_ignored():
    """Guard: a layout whose anchors are shifted by one changes the blocks' states."""
    target = target_for(4, 2)
    packed, ids, positions, layout = packed_inputs(BATCHES["one"], K, "draft_opd")
    p = packed[0]
    shifted = PackedRows((PackedRow.of(p.prefix_len, [a - 1 if a else 1 for a in p.anchors], K - 2),), layout.length)
    good = target.hidden_states(ids, attention_mask=layout, position_ids=positions)[0]
    bad = target.hidden_states(ids, attention_mask=shifted, position_ids=positions)[0]
    assert torch.equal(good[0, : p.prefix_len], bad[0, : p.prefix_len])
    assert (good[0, p.prefix_len :] - bad[0, p.prefix_len :]).abs().max() > 1e-3


def test_flash_labelled_target_replays_packed_rows_without_touching_its_config(monkeypatch):
    """The config says flash_attention_2 (no flash-attn on a CPU, so any call that reached it would fail); a packed
    replay runs anyway, equals the dense sdpa path, and nothing assigns `_attn_implementation` meanwhile."""
    target = target_for(4, 2)
    packed, ids, positions, layout = packed_inputs(BATCHES["two_lengths"], K, "draft_opd", 3)
    expected = target.hidden_states(ids, attention_mask=dense_teacher_masks(packed, K, ids.shape[1]),
                                    position_ids=positions)[0]
    target.model.config._attn_implementation = "flash_attention_2"
    writes = []
    prop = type(target.config)._attn_implementation
    monkeypatch.setattr(type(target.config), "_attn_implementation",
                        property(prop.fget, lambda self, value: (writes.append(value), prop.fset(self, value))))
    got = target.hidden_states(ids, attention_mask=layout, position_ids=positions)[0]
    logits = target(ids, attention_mask=layout, position_ids=positions).logits
    assert writes == [] and target.config._attn_implementation == "flash_attention_2"
    for b, p in enumerate(packed):
        assert (got[b, : len(p.ids)] - expected[b, : len(p.ids)]).abs().max() < EXACT
    assert torch.equal(logits, target.lm_head(got))
    with pytest.raises(OpdError, match="dense 4-D mask needs sdpa or eager"):
        target(ids, attention_mask=dense_teacher_masks(packed, K, ids.shape[1]), position_ids=positions)


@pytest.mark.parametrize("mask_kind", ["none", "padding"])
def test_ordinary_target_calls_run_the_original_attention(monkeypatch, mask_kind):
    """Non-packed masks go to HF's own function (masked CPU calls to its equal without key copies,
    opd/models/cpu_gqa.py): outputs are bit-identical with the wrappers removed."""
    target = target_for(4, 2)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    mask = None if mask_kind == "none" else torch.tensor([[1] * 9, [0] * 3 + [1] * 6])
    wrapped = target(ids, attention_mask=mask)
    assert AttentionInterface._global_mapping["sdpa"].packed_original.original is sdpa_attention_forward
    monkeypatch.setitem(AttentionInterface._global_mapping, "sdpa", sdpa_attention_forward)
    plain = target(ids, attention_mask=mask)
    assert torch.equal(wrapped.logits, plain.logits) and torch.equal(wrapped.features, plain.features)


def test_as_shipped_restores_transformers_functions_and_then_the_wrappers():
    mapping = AttentionInterface._global_mapping
    wrapped = dict(mapping)
    with as_shipped():
        assert mapping["sdpa"] is sdpa_attention_forward
        assert not any(hasattr(f, "packed_original") for f in mapping.values())
    assert mapping == wrapped


def test_packed_row_rejects_anchors_outside_its_prefix():
    with pytest.raises(OpdError, match="anchors must lie in the prefix"):
        PackedRow.of(4, [1, 4], 3)
    with pytest.raises(OpdError, match="the batch is 5 long"):
        PackedRows((PackedRow.of(4, [1, 2], 3),), 5)


def test_packed_teacher_memory_is_linear_in_the_packed_length():
    """Doubling the response (L ≈ 1,000 -> 2,000) at most ~doubles the forward's peak; the dense path's [L, L]
    mask and scores made it 3.3x (measured)."""
    target = target_for(4, 2)
    peaks, lengths = [], []
    for response in (490, 980):
        _, ids, positions, layout = packed_inputs([record(7, 40, response)], K, "draft_opd", 64)
        lengths.append(ids.shape[1])
        peaks.append(peak_cpu_bytes(lambda: target.hidden_states(ids, attention_mask=layout,
                                                                 position_ids=positions)))
    assert lengths[1] > 1.9 * lengths[0]
    assert peaks[1] < 2.3 * peaks[0]


# ------------------------------------------------------------------------------------------------ student


def student_case(kv_heads: int):
    target = target_for(4, kv_heads)
    drafter = micro_drafter(target, seed=1, num_layers=2, block_size=K, mask_token_id=VOCAB - 1)
    gen = torch.Generator().manual_seed(4)
    features = torch.randn(2, 14, 2 * target.hidden_size, generator=gen, dtype=torch.float64)
    valid = torch.ones(2, 14, dtype=torch.bool)
    valid[1, 10:], valid[1, 4] = False, False  # a shorter row with a hole
    anchors = torch.tensor([[1, 3, 6, 9, 12], [2, 5, 7, 0, 0]])  # row 1: two padding blocks (anchor 0)
    block_ids = torch.full((2, 5, K), VOCAB - 1)
    block_ids[:, :, 0] = torch.randint(0, VOCAB - 1, (2, 5), generator=gen)
    return drafter, features, valid, block_ids, anchors


@pytest.mark.parametrize("kv_heads", [2, 4])
@pytest.mark.parametrize("chunk_rows", [1, 2 * K + 1, 10_000])
def test_student_blocks_equal_dense_block_mask_with_gradients(kv_heads, chunk_rows):
    drafter, features, valid, block_ids, anchors = student_case(kv_heads)

    def run(fn):
        hidden = fn(drafter.project_context(features), valid, block_ids, anchors)
        hidden.pow(2).sum().backward()
        grads = {n: p.grad.clone() for n, p in drafter.named_parameters()}
        drafter.zero_grad(set_to_none=True)
        return hidden.detach(), grads

    got, got_grads = run(lambda *a: drafter.forward_blocks(*a, chunk_rows=chunk_rows))
    ref, ref_grads = run(lambda *a: dense_student_hidden(drafter, *a))
    assert (got - ref).abs().max() < EXACT
    for name, grad in ref_grads.items():
        assert (got_grads[name] - grad).abs().max() < 1e-8, name


def test_student_memory_is_linear_in_the_number_of_blocks():
    """Context and blocks both doubled (750 -> 1,500 positions, an anchor every 3): the forward's peak at most
    ~doubles; the dense [M*K, C+M*K] mask and scores made it 3.8x (measured)."""
    drafter, *_ = student_case(2)
    peaks = []
    for context_len in (750, 1500):
        blocks = context_len // 4
        context = torch.randn(1, context_len, drafter.config.hidden_size, dtype=torch.float64)
        anchors = torch.arange(blocks)[None] * 3 + context_len // 4
        block_ids = torch.full((1, blocks, K), VOCAB - 1)
        valid = torch.ones(1, context_len, dtype=torch.bool)
        with torch.no_grad():
            peaks.append(peak_cpu_bytes(lambda: drafter.forward_blocks(context, valid, block_ids, anchors,
                                                                       chunk_rows=100)))
    assert peaks[1] < 2.3 * peaks[0]


def test_packed_rows_take_values_narrower_than_their_queries():
    """Latent attention (DeepSeek-V3, Kimi Linear) attends with queries and keys wider than its values: the packed
    output is as wide as the values and equals SDPA under the dense packed mask."""
    records = BATCHES["two_lengths"]
    packed, ids, _, layout = packed_inputs(records, K, "draft_opd")
    mask = dense_teacher_masks(packed, K, ids.shape[1])
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(len(records), 2, ids.shape[1], 16, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(len(records), 2, ids.shape[1], 8, generator=gen, dtype=torch.float64)
    got = layout.attend(q, k, v, None).transpose(1, 2)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    for b, p in enumerate(packed):
        assert (got[b, :, : len(p.ids)] - ref[b, :, : len(p.ids)]).abs().max() < EXACT


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_sinks_without_a_mask_attend_to_every_key(kv_heads):
    """`grouped_sdpa`'s mask None means every key, sinks or not (with sinks it raised: the sink key was added to a
    mask that was not there)."""
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 3, 6), torch.randn(1, kv_heads, 5, 6), torch.randn(1, kv_heads, 5, 6)
    sinks = torch.randn(4)
    every_key = torch.ones(1, 1, 3, 5, dtype=torch.bool)
    assert torch.allclose(grouped_sdpa(q, k, v, None, None, sinks), grouped_sdpa(q, k, v, every_key, None, sinks))
