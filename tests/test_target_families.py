"""Target families other than Qwen3 work end to end, exactly, through transformers' own model classes and caches:
full attention (Llama, Qwen3-MoE), sliding-window and global layers (Gemma 4), sliding-window and full layers with
attention sinks (gpt-oss), Gated DeltaNet and full layers (Qwen3.5: every drafted block replayed from the linear
layers' state at its anchor), chunked and full layers (Llama 4), Kimi Delta Attention and latent attention (Kimi
Linear, replayed as Qwen3.5).

Each target is built here from transformers' config classes: 6 layers, GQA, float64 (no argmax ties) with an
8-token vocabulary for the exactness tests, float32 with the micro tokenizer's vocabulary for `opd run`. The
sliding windows (`WINDOWS`) and Llama 4's attention chunk (`CHUNK`) are smaller than a block and than every sequence
decoded or replayed here, so they bite.
Each family's drafters are built for its target as the public drafters of the family are (`DFlashConfig.for_target`:
gpt-oss's YaRN, Gemma 4's full-attention RoPE, embedding scale and softcapping), so every check runs them too.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest
import torch
import yaml
from transformers import (
    Qwen3Config,
)

from opd.cli import main
from opd.data.prompts import Prompt
from opd.decoding.batch import right_pad
from opd.decoding.record import SequenceRecord
from opd.decoding.sampling import Sampling
from opd.decoding.speculative import SpeculativeDecoder
from opd.distill.dense_reference import dense_teacher_masks, per_block_states
from opd.distill.replay import CommittedView, packed_inputs, score
from opd.errors import OpdError
from opd.models import linear_replay
from opd.models.flops import TargetParams
from opd.models.layer_kind import layer_kinds
from opd.models.linear_replay import GROUP_BYTES, SEGMENT
from opd.models.target import Target, load_target
from opd.sources.rebuild import rebuild_records
from opd.tiny.micro import micro_drafter
from tests.helpers.decoding import EOS, MASK, MIXED_PROMPTS, PROMPT, constant_drafter
from tests.helpers.lossless import assert_lossless
from tests.helpers.offline import MAX_NEW, SEED, SETTINGS, draw_samples, offline
from tests.helpers.target_families import (
    EXPERTS,
    HIDDEN,
    LAYER_IDS,
    LAYERS,
    PER_TOKEN,
    family_model,
)

FAMILIES = ("qwen3", "llama", "qwen3_moe", "gemma4", "gpt_oss", "qwen3_5", "llama4", "kimi_linear")
NARROWED = {"gemma4": "sliding-window", "gpt_oss": "sliding-window", "llama4": "chunked-attention"}
# random weights whose greedy text repeats a token, so blocks are accepted whole
SEEDS = {"gemma4": 1, "gpt_oss": 1, "qwen3_5": 1, "llama4": 4, "kimi_linear": 3}
EXACT = 1e-10
LINEAR = {"qwen3_5", "kimi_linear"}  # families with linear-attention layers
# transformers' Gated DeltaNet and KDA kernels, and Llama 4's router (its sigmoid), compute in float32 whatever the
# model's dtype
TOLERANCE = {"qwen3_5": 1e-5, "kimi_linear": 1e-5, "llama4": 1e-6}
# transformers' Kimi Linear config keeps no RoPE and names max_position_embeddings otherwise in `to_dict`, both of
# which a random DFlash drafter is built from (`DFlashConfig.for_target`): its drafters are built for a Qwen3 config
# of the same shapes
DRAFTER_SHAPES = {"kimi_linear"}


@contextmanager
def drafter_shapes(family_name: str) -> Iterator[None]:
    """Within it, drafters built for a `DRAFTER_SHAPES` family's target read a Qwen3 config of its shapes."""
    if family_name not in DRAFTER_SHAPES:
        yield
        return
    shapes = Qwen3Config(vocab_size=8, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=4, head_dim=HIDDEN // 4)
    with mock.patch.object(Target, "config", property(lambda _target: shapes)):
        yield


@pytest.fixture(scope="module", params=FAMILIES)
def family(request) -> SimpleNamespace:
    target = Target(family_model(request.param, seed=SEEDS.get(request.param, 0)), LAYER_IDS)
    with drafter_shapes(request.param):
        return SimpleNamespace(name=request.param, target=target,
                               drafter=micro_drafter(target, seed=1, block_size=4, mask_token_id=MASK),
                               other=micro_drafter(target, seed=2, block_size=4, mask_token_id=MASK))


# ------------------------------------------------------------------------------------------------ decoding


def test_greedy_speculative_decode_equals_generate(family):
    """The target's own `generate()` (HF's loop and cache), one prompt at a time, is the reference. Drafting the
    token it emits most, rows of one batch accept every length from none to all, so the cache is rolled back by
    different amounts per row."""
    expected = [family.target.model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=16,
                                              eos_token_id=EOS, pad_token_id=EOS)[0, len(prompt) :].tolist()
                for prompt in MIXED_PROMPTS]
    mode = Counter(token for response in expected for token in response).most_common(1)[0][0]
    with drafter_shapes(family.name):
        drafter = constant_drafter(family.target, mode)
    records = SpeculativeDecoder(family.target, drafter, eos_id=EOS).generate(
        MIXED_PROMPTS, Sampling(), max_new_tokens=16)
    assert [r.response_ids for r in records] == expected
    assert {0, 3} <= {r for rec in records for r in rec.accepted}


@torch.no_grad()
def test_a_ready_block_verifies_as_the_models_own_masks(family):
    """`Target.ready_block` (a mask template slid along the cache, the rotary embeddings sliced from a table) gives
    the logits, features and cache of the masks the target builds per forward (transformers' causal mask, or the
    narrowing kinds' from a 2-D mask), bit for bit: two rows of one length, blocks kept in part, and a text that
    outgrows the first template and table. Families whose masks it has no form for get None (the decoder then
    verifies as before)."""
    target, k = family.target, 4
    ready = target.ready_block(5, k)
    if family.name in LINEAR or family.name == "llama4":  # masks read as 2-D; chunks at fixed positions
        assert ready is None
        return
    assert ready is not None
    ids = torch.randint(0, 8, (2, 300), generator=torch.Generator().manual_seed(0))

    def forward(start: int, end: int, mask: Any, cache: Any) -> Any:
        return target(ids[:, start:end], attention_mask=mask, position_ids=torch.arange(start, end).expand(2, -1),
                      past_key_values=cache, use_cache=True)

    def plain(end: int) -> torch.Tensor:
        return torch.ones(2, end, dtype=torch.long)

    caches, length = [forward(0, 5, plain(5), None).past_key_values for _ in range(2)], 5
    for step, keep in enumerate([4, 1, 3, 0, 2, 4]):
        if step == 3:  # the text outgrows the first template and table
            caches = [forward(length, 280, plain(280), cache).past_key_values for cache in caches]
            length = 280
        outs = [forward(length, length + k, mask, cache)
                for mask, cache in zip((plain(length + k), target.ready_block(length, k)), caches)]
        assert torch.equal(outs[0].logits, outs[1].logits) and torch.equal(outs[0].features, outs[1].features)
        caches = [out.past_key_values for out in outs]
        length += keep
        for layer in (layer for cache in caches for layer in target.kinds.column_layers(cache)):
            layer.keys, layer.values = layer.keys[:, :, :length], layer.values[:, :, :length]
    assert target._rope is None or target._rope.tables


@torch.no_grad()
def test_kernel_wrappers_apply_to_their_own_thread_only():
    """The decoder's recording and packed replay run their code around the Gated DeltaNet kernels on their own
    thread: another thread's forward on the same model, meanwhile, runs the kernels as they are."""
    import threading

    model = family_model("qwen3_5", seed=1)
    kernels, calls, inside, done = (layer_kinds(model).by_name["linear_attention"].kernels(model), Counter(),
                                    threading.Event(), threading.Event())

    def counting(kernel, _recurrent):
        def run(*args, **kwargs):
            calls[threading.get_ident()] += 1
            return kernel(*args, **kwargs)

        return run

    def wrapped_thread():
        with kernels.wrapped(counting):
            inside.set()
            done.wait(30)
            model(torch.tensor([PROMPT]))

    worker = threading.Thread(target=wrapped_thread)
    worker.start()
    inside.wait(30)
    model(torch.tensor([PROMPT]))  # while the worker's wrap is active
    assert not calls
    done.set()
    worker.join(30)
    assert calls == {worker.ident: len(kernels.layers)}


@torch.no_grad()
@pytest.mark.parametrize("family_name", sorted(LINEAR))
def test_linear_attention_states_are_each_rows_own(family_name):
    """After a right-padded prefill and a verified block of which rows keep different counts, every row's conv and
    recurrent states equal those of a forward over that row's kept tokens alone (padding and rejected tokens
    leave no trace), where transformers' own cache would decay through the padding and keep the rejected tokens."""
    model = family_model(family_name, seed=1)
    rollback, k = layer_kinds(model).rollback(model), 4
    ids, mask = right_pad(MIXED_PROMPTS, pad_id=EOS, device="cpu")
    used = mask.sum(-1)
    cache = rollback.new_cache()
    with rollback.prefill(cache, used, ids.shape[1]):
        model(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp_min(0), cache=cache, use_cache=True)
    block = torch.randint(0, 6, (len(ids), k), generator=torch.Generator().manual_seed(0))
    kept = torch.tensor([1, 4, 2, 3, 1, 4, 2, 3])
    with rollback.recording():
        model(block, attention_mask=torch.cat([mask, torch.ones_like(block)], 1),
              position_ids=used[:, None] + torch.arange(k), cache=cache, use_cache=True)
    rollback.keep(cache, kept)
    for b, prompt in enumerate(MIXED_PROMPTS):
        alone = model(torch.tensor([prompt + block[b, : kept[b]].tolist()]), use_cache=True).past_key_values
        for index in rollback.layers:
            got, ref = cache.layers[index], alone.layers[index]
            assert (got.recurrent_states[0][b] - ref.recurrent_states[0][0]).abs().max() < TOLERANCE[family_name]
            assert (got.conv_states[0][b] - ref.conv_states[0][0]).abs().max() < TOLERANCE[family_name]


def test_autoregressive_baseline_equals_generate(family):
    """The target-sampling rollout source decodes a left-padded batch: padding must leave every row's states as
    its own, a linear-attention layer's recurrent state included."""
    from opd.decoding.autoregressive import generate_autoregressive

    expected = [family.target.model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=8,
                                              eos_token_id=EOS, pad_token_id=EOS)[0, len(prompt) :].tolist()
                for prompt in MIXED_PROMPTS]
    got = generate_autoregressive(family.target, MIXED_PROMPTS, Sampling(), max_new_tokens=8, eos_id=EOS)
    assert got == expected and len({len(p) for p in MIXED_PROMPTS}) > 1


# Kimi Linear's chi-square runs KDA's chunked torch kernel over 4k rows, the slowest test of the suite: make test-all.
# Its rollback and replay around the kernel are Qwen3.5's (opd/models/deltanet.py), whose chi-square stays in make
# test, and the greedy, rebuild and replay tests below check its own kernel exactly.
@pytest.mark.parametrize("family", [pytest.param(f, marks=pytest.mark.slow) if f == "kimi_linear" else f
                                    for f in FAMILIES], indirect=True)
def test_sampling_is_lossless(family):
    """The joint law of the first three emitted tokens at T=1 equals the target's own (chi-square, 4k samples)."""
    sampling, n = Sampling(temperature=1.0), 4_000
    assert_lossless(family.target, family.drafter, sampling, n)


def test_rebuild_from_text_equals_decoded_blocks(family):
    accepted = 0
    for sampling in (Sampling(), Sampling(temperature=1.0)):
        decoded = SpeculativeDecoder(family.target, family.drafter, eos_id=EOS).generate(
            MIXED_PROMPTS, sampling, max_new_tokens=16, seed=3)
        samples = [SequenceRecord.from_text(r.key, r.prompt_ids, r.response_ids, EOS) for r in decoded]
        rebuilt = rebuild_records(family.target, family.drafter, samples, batch_size=3)
        assert [(r.anchors, r.drafts, r.accepted) for r in rebuilt] == [(r.anchors, r.drafts, r.accepted)
                                                                        for r in decoded]
        accepted += sum(sum(r.accepted) for r in decoded)
    assert accepted > 0  # some drafts were accepted, so the walk took steps longer than one


# Offline τ is the rebuilt blocks (checked exactly on every family above) scored by the teacher (checked on every
# family below): on full attention and on linear attention here, on the other families in make test-all.
@pytest.mark.parametrize("family", [f if f in ("qwen3", "qwen3_5") else pytest.param(f, marks=pytest.mark.slow)
                                    for f in FAMILIES], indirect=True)
def test_offline_tau_equals_decoded_tau(family, tmp_path):
    """Samples drawn by one drafter; the drafter that drew them gets its decoded τ at every setting, another
    drafter gets its own decoded τ on the greedy samples (offline evaluation: opd/eval/offline.py)."""
    from opd.eval.online import evaluate
    from opd.models.build import Models

    gen = torch.Generator().manual_seed(0)
    prompts = [Prompt(f"p{i}", "", torch.randint(0, 6, (int(torch.randint(1, 6, (1,), generator=gen)),),
                                                   generator=gen).tolist()) for i in range(12)]
    s = SimpleNamespace(target=family.target, prompts=prompts, path=tmp_path / "samples.jsonl",
                        tokenizer=SimpleNamespace(eos_token_id=EOS))
    draw_samples(family.target, family.drafter, prompts, s.path, SETTINGS)  # greedy and sampled

    def decoded_tau(drafter) -> dict[str, float]:
        rows = evaluate(Models(family.target, drafter, s.tokenizer), prompts, SETTINGS, max_new_tokens=MAX_NEW,
                        batch_size=12, seed=SEED, baseline=False)
        return {r.sampling: r.tau for r in rows}

    drew, other = decoded_tau(family.drafter), decoded_tau(family.other)
    assert {k: r.tau for k, r in offline(s, family.drafter).items()} == pytest.approx(drew, abs=1e-12)
    assert offline(s, family.other)["greedy"].tau == pytest.approx(other["greedy"], abs=1e-12)


# ------------------------------------------------------------------------------------------------ replay


@pytest.fixture(scope="module")
def records(family) -> list[SequenceRecord]:
    decoder = SpeculativeDecoder(family.target, family.drafter, eos_id=EOS)
    return decoder.generate(MIXED_PROMPTS[:4], Sampling(temperature=1.0), max_new_tokens=16, seed=4)


def test_packed_replay_equals_the_dense_reference(family, records):
    """Every packed row (prefix and drafted blocks, in one forward and over the text's cached keys) equals the
    forward under the dense [L, L] packed mask of opd/distill/dense_reference.py; where linear-attention layers
    read no mask, one forward per block of its own text (`per_block_states`), the definition the mask encodes."""
    target, k = family.target, family.drafter.block_size
    packed, ids, positions, layout = packed_inputs(records, k, "draft_opd", chunk_rows=5)
    if family.name in LINEAR:
        ref = per_block_states(target, packed, k, ids.shape[1])
    else:
        ref = target.hidden_states(ids, attention_mask=dense_teacher_masks(packed, k, ids.shape[1]),
                                   position_ids=positions)[0]
    got = target.hidden_states(ids, attention_mask=layout, position_ids=positions)[0]
    view = CommittedView.of(target, records, k, keep_kv=True)
    from_view = view.states(target, packed, "draft_opd", k)[0]  # the text, then the block rows alone over its keys
    text, tolerance = view.hidden.shape[1], TOLERANCE.get(family.name, EXACT)
    for b, p in enumerate(packed):
        n, blocks = len(p.ids), len(p.ids) - p.prefix_len
        assert (got[b, :n] - ref[b, :n]).abs().max() < tolerance
        if family.name in LINEAR:  # no keys kept: the view runs the packed rows whole
            assert (from_view[b, :n] - ref[b, :n]).abs().max() < tolerance
            continue
        assert (from_view[b, : p.prefix_len] - ref[b, : p.prefix_len]).abs().max() < EXACT
        if blocks:
            assert (from_view[b, text : text + blocks] - ref[b, p.prefix_len : n]).abs().max() < EXACT
    assert sum(len(p.ids) - p.prefix_len for p in packed) > 0


def long_records(vocab: int, block_size: int, lengths: list[int], seed: int = 0) -> list[SequenceRecord]:
    """Records of long texts (past several of linear replay's segments) with blocks of every acceptance: drafts
    agree with the text for `accepted` tokens, then are random."""
    g = torch.Generator().manual_seed(seed)
    records = []
    for key, n in enumerate(lengths):
        prompt, response = torch.randint(vocab, (3,), generator=g).tolist(), torch.randint(vocab, (n,), generator=g)
        rec, anchor = SequenceRecord(key, prompt, response.tolist()), 0
        while anchor < n - 1:
            accepted = min(int(torch.randint(block_size, (), generator=g)), n - 1 - anchor)
            draft = torch.randint(vocab, (block_size - 1,), generator=g)
            draft[:accepted] = response[anchor + 1 : anchor + 1 + accepted]
            rec.anchors.append(anchor), rec.drafts.append(draft.tolist()), rec.accepted.append(accepted)
            anchor += accepted + 1
        rec.clip_to_response()
        records.append(rec)
    return records


@pytest.mark.parametrize("family_name", sorted(LINEAR))
def test_linear_attention_replay_starts_each_block_from_its_anchors_state(family_name, monkeypatch):
    """Texts of 150-200 tokens cross linear replay's segments (`SEGMENT` positions; the state at each anchor is a
    segment's state advanced to it), with blocks grouped across rows (all in one call, or 5 per call): every
    drafted slot's teacher equals one forward per block, in one packed forward and from a view of the text."""
    target, k = Target(family_model(family_name, seed=1), LAYER_IDS), 6
    records = long_records(8, k, [150, 2 * SEGMENT + 9, 200])
    packed, ids, positions, layout = packed_inputs(records, k, "draft_opd")
    assert max(a for p in packed for a in p.anchors) > 2 * SEGMENT
    ref = per_block_states(target, packed, k, ids.shape[1])
    for group_bytes in (GROUP_BYTES, 600_000):
        monkeypatch.setattr(linear_replay, "GROUP_BYTES", group_bytes)
        got = target.hidden_states(ids, attention_mask=layout, position_ids=positions)[0]
        from_view = CommittedView.of(target, records, k, keep_kv=True).states(target, packed, "draft_opd", k)[0]
        for b, p in enumerate(packed):
            n = len(p.ids)
            assert (got[b, :n] - ref[b, :n]).abs().max() < TOLERANCE[family_name], group_bytes
            assert (from_view[b, :n] - ref[b, :n]).abs().max() < TOLERANCE[family_name], group_bytes


def test_scored_teacher_equals_one_forward_per_block(family, records):
    """What the learner reads: the teacher at every drafted slot equals a plain causal forward of that block's
    own text (the committed prefix to its anchor, then its drafts), with the shared text forward or without."""
    target, k = family.target, family.drafter.block_size
    plain = score(target, records, block_size=k).teacher
    shared = score(target, records, block_size=k, view=CommittedView.of(target, records, k, keep_kv=True)).teacher
    i = 0
    for rec in records:
        committed = rec.prompt_ids + rec.response_ids
        for anchor, draft in zip(rec.anchors, rec.drafts):
            a = len(rec.prompt_ids) + anchor
            alone = target.hidden_states(torch.tensor([committed[: a + 1] + draft[: k - 2]]))[0][0, a:]
            tolerance = TOLERANCE.get(family.name, EXACT)
            assert (plain[i] - alone).abs().max() < tolerance and (shared[i] - alone).abs().max() < tolerance
            i += 1
    assert i == len(plain) > 0


def test_committed_replay_equals_one_forward_per_text(family, records):
    """The first-rejection presets' teacher (layout committed): slot j of a block is the target's state at
    anchor + j of the committed text, here from the batch's one padded forward, there from each text alone."""
    target, k = family.target, family.drafter.block_size
    teacher = score(target, records, block_size=k, mode="committed").teacher
    i = 0
    for rec in records:
        committed = rec.prompt_ids + rec.response_ids
        alone = target.hidden_states(torch.tensor([committed]))[0][0]
        for anchor in rec.anchors:
            a = len(rec.prompt_ids) + anchor
            n = min(k - 1, len(committed) - a)
            assert (teacher[i, :n] - alone[a : a + n]).abs().max() < TOLERANCE.get(family.name, EXACT)
            i += 1
    assert i == len(teacher) > 0


def test_a_float64_moe_target_loads_with_experts_it_can_run(tmp_path):
    """The exactness checks run targets in float64, which transformers' default experts kernel refuses."""
    family_model("qwen3_moe", dtype=torch.float32).save_pretrained(tmp_path)
    target = load_target(str(tmp_path), dtype=torch.float64, layer_ids=LAYER_IDS)
    assert target(torch.tensor([[1, 2, 3]])).logits.dtype == torch.float64


# ------------------------------------------------------------------------------------------------ FLOPs


def test_moe_flops_count_the_experts_each_token_passes_through():
    """A Qwen3-MoE token passes through the router and `num_experts_per_tok` of `num_experts` experts."""
    model = family_model("qwen3_moe")
    params = TargetParams.of(model)
    experts = sum(p.numel() for name, p in model.named_parameters() if ".mlp.experts." in name)
    others = sum(p.numel() for name, p in model.named_parameters()
                 if ".mlp.experts." not in name and not name.endswith(("embed_tokens.weight", "lm_head.weight")))
    assert experts > 0 and params.body == others + experts * PER_TOKEN // EXPERTS
    dense = family_model("qwen3")
    assert TargetParams.of(dense).body == sum(p.numel() for p in dense.model.layers.parameters()) + HIDDEN


def test_linear_attention_flops_count_the_state_updates():
    """A Qwen3.5 token updates each Gated DeltaNet layer's value-head states (4 heads of 8 x 8 here, 5 layers), 7
    FLOPs an element, on top of 2 x the weights it passes through; attention-only targets add nothing."""
    params = TargetParams.of(family_model("qwen3_5"))
    assert params.state == 7 * 5 * 4 * 8 * 8 and params.block == params.state * SEGMENT
    assert params.forward(3, logits=1) == 2 * (3 * params.body + params.head) + 3 * params.state
    assert TargetParams.of(family_model("kimi_linear")).state == 7 * 5 * 2 * 8 * 8  # KDA: 2 heads of 8 x 8
    assert TargetParams.of(family_model("qwen3")).state == 0


# ------------------------------------------------------------------------------------------------ refusals


@pytest.mark.parametrize("family_name", sorted(NARROWED))
def test_narrowing_targets_refuse_what_counts_the_window_in_columns(family_name):
    """flash-attn and a static cache count a sliding window (or an attention chunk) in cache columns, which the
    decoder's per-row packing (or a static cache's holes) moves: refused in one line, when the target loads and
    when the decoder is built."""
    target, label = Target(family_model(family_name, dtype=torch.float32), LAYER_IDS), NARROWED[family_name]
    with pytest.raises(OpdError, match=f"rollout.static_cache: not with a target that has {label}") as error:
        SpeculativeDecoder(target, micro_drafter(target, mask_token_id=MASK), eos_id=EOS,
                           static_cache=True)
    target.model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(OpdError, match=f"{label} layers need attn_implementation sdpa or eager") as other:
        Target(target.model, LAYER_IDS)
    assert "\n" not in str(error.value) + str(other.value)


def test_llama4_layers_that_scale_queries_by_cache_column_are_refused():
    """Llama 4's temperature tuning scales a layer's queries by cache column, not position, which per-row packing
    and packed replay move: refused in one line naming the layers (the family above runs with it off)."""
    model = family_model("llama4", dtype=torch.float32)
    model.config.attn_temperature_tuning = True
    with pytest.raises(OpdError, match=r"layers \[3\] scale their queries by cache column") as e:
        Target(model, LAYER_IDS)
    assert "\n" not in str(e.value)


def test_linear_attention_layers_refuse_a_static_cache():
    target = Target(family_model("qwen3_5", dtype=torch.float32), LAYER_IDS)
    with pytest.raises(OpdError, match="rollout.static_cache: not with a target that has linear-attention") as e:
        SpeculativeDecoder(target, micro_drafter(target, mask_token_id=MASK), eos_id=EOS, static_cache=True)
    assert "\n" not in str(e.value)


# ------------------------------------------------------------------------------------------------ opd run


@pytest.fixture(scope="module")
def family_run_assets(family, micro_assets, tmp_path_factory) -> dict[str, str]:
    """The family's target in float32 over the micro tokenizer's vocabulary, saved with that tokenizer."""
    from transformers import AutoTokenizer

    if family.name in DRAFTER_SHAPES:
        pytest.skip("opd run builds a random DFlash drafter from the target's config.json, which Kimi Linear's cannot "
                    "give (no RoPE, no max_position_embeddings in its to_dict): DFlashConfig.for_target")

    tokenizer = AutoTokenizer.from_pretrained(micro_assets["target"])
    model = family_model(family.name, vocab_size=len(tokenizer), dtype=torch.float32)
    model.config.eos_token_id = tokenizer.eos_token_id
    root = tmp_path_factory.mktemp(family.name)
    model.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    return {**micro_assets, "target": str(root / "target"), "drafter": None}


@pytest.fixture(scope="module")
def tracking_uri(tmp_path_factory) -> str:
    """One MLflow store for every run here: creating a store (its schema migrations) costs more than a run."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


# The rebuilt source's run on every family is make test-all's: each family's rebuild is checked exactly above
# (test_rebuild_from_text_equals_decoded_blocks), and this run on Qwen3 stays in make test.
@pytest.mark.parametrize(("family", "source"), [
    (f, s) if s == "speculative" or f == "qwen3" else pytest.param(f, s, marks=pytest.mark.slow)
    for f in FAMILIES for s in ("speculative", "target")], indirect=["family"])
def test_opd_run_two_steps(family_run_assets, tracking_uri, source, tmp_path, capsys):
    assets = family_run_assets
    spec = {
        "name": "family", "seed": 0, "engine": "local", "steps": 2,
        "models": {"target_path": assets["target"], "dtype": "float32", "drafter_path": assets["drafter"],
                   "drafter": {"num_layers": 1, "block_size": 4, "target_layer_ids": LAYER_IDS}},
        "data": {"train_prompts": assets["train"], "eval_prompts": assets["heldout"], "max_prompt_tokens": 200},
        "rollout": {"batch_size": 2, "max_new_tokens": 8, "temperature": 1.0, "source": source},
        "optim": {"lr": 1e-3, "batch_size": 2, "micro_batch_size": 2, "warmup_ratio": 0.0},
        "tracking": {"run_dir": str(tmp_path / "run"), "uri": tracking_uri, "checkpoint_every": 2},
        "eval": {"every": 0, "num_prompts": 2, "max_new_tokens": 4, "batch_size": 2,
                 "diagnostic": True,  # the expected-acceptance diagnostic replays drafted blocks
                 "sampling": [{"name": "greedy", "temperature": 0.0}]},
    }
    path = tmp_path / "family.yaml"
    path.write_text(yaml.safe_dump(spec))
    assert main(["run", str(path)]) == 0, capsys.readouterr().err
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["checkpoint"].endswith("step-0000002")  # both updates trained
    assert [r["sampling"] for r in summary["before"] + summary["after"]] == ["greedy", "greedy"]
