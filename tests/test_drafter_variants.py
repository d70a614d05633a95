"""z-lab's DFlash drafter variants through every path the plain drafter takes: how their config is read, the
checkpoint round trip, the packed training forward against a dense per-block definition, drafting, lossless
decoding, the rebuild and offline τ, replay, the FLOP counters, and SFT and Draft-OPD through the CLI.

Micro models in float64 (no argmax ties), as tests/test_decoding.py. The variants' meaning is z-lab's
`DFlashDraftModel` (dflash 0.1.0); tests/test_zlab_interop.py runs them in z-lab's own code.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from opd.cli import main
from opd.decoding.autoregressive import generate_autoregressive
from opd.decoding.sampling import Sampling
from opd.decoding.speculative import SpeculativeDecoder
from opd.distill.replay import score, student_hidden
from opd.eval.acceptance import AcceptanceStats
from opd.formats.dflash import DFlashConfig
from opd.models.dflash import DFlashDrafter
from opd.models.flops import DrafterParams
from opd.models.target import load_target
from opd.sources.rebuild import rebuild_records
from opd.spec import SpecError, validate_spec
from opd.tiny.micro import micro_drafter, micro_target
from tests.helpers.decoding import EOS, MASK, PROMPT
from tests.helpers.drafter_math import _rms, _rope
from tests.helpers.drafter_variants import BLOCK, FULL, SLIDING, VARIANTS, with_change
from tests.helpers.local_runs import losses, spec_for
from tests.helpers.lossless import chi_square, exact_joint, sampled_joint
from tests.helpers.specs import MINIMAL, make_model_dir

PROMPTS = [[1, 2, 3], [4, 5], [1, 1, 1, 1, 2], [3], [2, 2], [0, 1, 2, 3, 4, 5], [5, 4], [1]]


def variant_drafter(target, name: str | None, seed: int = 1, scale: float | None = None) -> DFlashDrafter:
    """A random two-layer drafter with the variant's config (None: the plain drafter); with `scale`, weights
    N(0, scale²) and norm gains 1 + N(0, scale²), large enough that a wrong mask shows."""
    base = micro_drafter(target, seed=seed, num_layers=2, block_size=BLOCK, mask_token_id=MASK)
    config = DFlashConfig.from_hf_dict(with_change(base.config.to_hf_dict(), VARIANTS.get(name, {})))
    drafter = DFlashDrafter(config, target.embed_tokens, target.lm_head)
    drafter.load_state_dict(base.state_dict())
    if scale is not None:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in drafter.parameters():
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * scale + (1.0 if p.dim() == 1 else 0.0))
    return drafter


@pytest.fixture(scope="module")
def target():
    return micro_target(seed=0, vocab_size=8, layer_ids=[0, 2, 3])


# ------------------------------------------------------------------------------------------------ config


@pytest.mark.parametrize(("change", "rules"), [
    ({}, [(False, None), (False, None)]),
    ({"layer_types": [SLIDING, FULL], "use_sliding_window": True, "sliding_window": 7}, [(True, 7), (False, None)]),
    ({"layer_types": [SLIDING, FULL], "use_sliding_window": True, "sliding_window": 7, "is_causal": False},
     [(False, 7), (False, None)]),
    ({"is_causal": True}, [(True, None), (True, None)]),
    ({"layer_types": None, "use_sliding_window": True, "sliding_window": 7, "max_window_layers": 1},
     [(False, None), (True, 7)]),
    ({"use_sliding_window": False, "sliding_window": 7}, [(False, None), (False, None)]),
    ({"layer_types": [FULL, SLIDING], "use_sliding_window": True}, [(False, None), (True, 4096)]),
], ids=["plain", "sliding", "sliding-non-causal", "all-causal", "max-window-layers", "window-off", "default-window"])
def test_layer_rules_are_read_as_zlab_reads_them(target, change, rules):
    """Per layer (causal, window): a sliding layer is causal unless `is_causal` says otherwise, and without
    `layer_types` layers from `max_window_layers` on slide when `use_sliding_window` is on."""
    hf = with_change(micro_drafter(target, num_layers=2, block_size=BLOCK).config.to_hf_dict(), change)
    config = DFlashConfig.from_hf_dict({k: v for k, v in hf.items() if v is not None})
    got = [config.layer_attention(i) for i in range(2)]
    assert [(a.causal, a.window) for a in got] == rules


def test_scalars_are_read_from_dflash_config_first_then_the_top_level(target):
    hf = micro_drafter(target, num_layers=2, block_size=BLOCK).config.to_hf_dict()
    hf |= {"input_embedding_scale": 2.0, "output_multiplier": 3.0, "final_logit_softcapping": 4.0, "block_size": 9,
           "mask_token_id": 1}
    hf["dflash_config"] = {"target_layer_ids": [0, 2, 3], "output_multiplier": 0.5, "block_size": 6,
                           "num_target_layers": 4}
    config = DFlashConfig.from_hf_dict(hf)
    assert (config.input_embedding_scale, config.output_multiplier, config.final_logit_softcapping) == (2.0, 0.5, 4.0)
    assert (config.block_size, config.mask_token_id, config.num_target_layers) == (6, 1, 4)


@pytest.mark.parametrize("name", VARIANTS)
def test_save_load_round_trip_is_bit_exact(target, name, tmp_path):
    drafter = variant_drafter(target, name)
    drafter.save_pretrained(tmp_path)
    loaded = DFlashDrafter.from_pretrained(tmp_path, target)
    assert loaded.config == drafter.config and DFlashConfig.from_hf_dict(drafter.config.to_hf_dict()) == drafter.config
    assert [loaded.config.layer_attention(i) for i in range(2)] == drafter.attention
    saved, restored = drafter.state_dict(), loaded.state_dict()
    assert saved.keys() == restored.keys() and all(torch.equal(saved[k], restored[k]) for k in saved)


def test_the_spec_reads_a_warm_drafters_block_size_where_zlab_does(tmp_path):
    """`dflash_config.block_size` wins over the top level, as in z-lab's code (and `DFlashConfig`)."""
    drafter = make_model_dir(tmp_path / "drafter", {"block_size": 8, "num_hidden_layers": 2,
                                                    "dflash_config": {"block_size": 16, "target_layer_ids": [1, 3]}})
    models = {"target_path": "t", "target_num_layers": 6, "drafter_path": drafter,
              "drafter": {"block_size": 16, "num_layers": 2}}
    validate_spec({**MINIMAL, "models": models}, check_paths=False)
    models["drafter"] = {"block_size": 8, "num_layers": 2}
    with pytest.raises(SpecError, match=r"^models.drafter.block_size: 8 disagrees with the warm drafter's 16"):
        validate_spec({**MINIMAL, "models": models}, check_paths=False)


def test_a_plain_drafters_config_json_is_unchanged(target, tmp_path):
    """Variant fields are written only when set: a plain drafter's config.json keeps the public layout."""
    micro_drafter(target, num_layers=2, block_size=BLOCK).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert not {"is_causal", "use_sliding_window", "sliding_window"} & set(config)
    assert set(config["dflash_config"]) == {"mask_token_id", "target_layer_ids"}


# ------------------------------------------------------------------------------------------------ the forward


def _rule(hf: dict, layer: int) -> tuple[bool, int | None]:
    """(causal, window) of a layer straight from z-lab's reading of config.json."""
    sliding = hf["layer_types"][layer] == SLIDING
    causal = sliding if hf.get("is_causal") is None else hf["is_causal"]
    window = hf.get("sliding_window") if sliding and hf.get("use_sliding_window") else None
    return causal, window


def _visible(query: torch.Tensor, keys: torch.Tensor, causal: bool, window: int | None) -> torch.Tensor:
    """Dense bool [len(query), len(keys)] from positions: causal k <= p; window p - k < w and, not causal, k - p < w."""
    p, k = query[:, None], keys[None, :]
    ok = torch.ones(len(query), len(keys), dtype=torch.bool)
    if causal:
        ok &= k <= p
    if window is not None:
        ok &= (p - k < window) & (causal | (k - p < window))
    return ok


def _reference_block(drafter, hf, features, context_positions, block_ids, anchor) -> torch.Tensor:
    """One block from the definition: loops, explicit softmax over a dense mask built from positions."""
    cfg = drafter.config
    eps, heads, kv_heads, d = cfg.rms_norm_eps, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    context = _rms(features @ drafter.fc.weight.T, drafter.hidden_norm.weight, eps)
    block_positions = anchor + torch.arange(len(block_ids))
    all_positions = torch.cat([context_positions, block_positions])
    h = drafter.embed_tokens.weight[block_ids] * (cfg.input_embedding_scale or 1.0)
    for i, layer in enumerate(drafter.layers):
        attn = layer.self_attn
        visible = _visible(block_positions, all_positions, *_rule(hf, i))
        x = _rms(h, layer.input_layernorm.weight, eps)
        kv_input = torch.cat([context, x])
        q = _rope(_rms((x @ attn.q_proj.weight.T).view(-1, heads, d), attn.q_norm.weight, eps), block_positions,
                  cfg.rope_theta)
        k = _rope(_rms((kv_input @ attn.k_proj.weight.T).view(-1, kv_heads, d), attn.k_norm.weight, eps),
                  all_positions, cfg.rope_theta)
        v = (kv_input @ attn.v_proj.weight.T).view(-1, kv_heads, d)
        out = torch.empty(len(block_ids), heads, d, dtype=h.dtype)
        for head in range(heads):
            group = head // (heads // kv_heads)
            scores = (q[:, head] @ k[:, group].T / math.sqrt(d)).masked_fill(~visible, -math.inf)
            out[:, head] = torch.softmax(scores, dim=-1) @ v[:, group]
        h = h + out.reshape(len(block_ids), -1) @ attn.o_proj.weight.T
        y = _rms(h, layer.post_attention_layernorm.weight, eps)
        mlp = layer.mlp
        h = h + (F.silu(y @ mlp.gate_proj.weight.T) * (y @ mlp.up_proj.weight.T)) @ mlp.down_proj.weight.T
    return _rms(h, drafter.norm.weight, eps)


ANCHORS = torch.tensor([[2, 5, 9, 11], [1, 4, 7, 8]])


@pytest.mark.parametrize("name", VARIANTS)
def test_packed_blocks_and_drafts_equal_the_dense_definition(target, name):
    """fp64: the packed training forward (two blocks per chunk, so windowed chunks skip early context keys) equals
    the dense per-block definition, and one `draft` call per block (the decoding mask) equals both."""
    drafter = variant_drafter(target, name, scale=0.3)
    hf = with_change(micro_drafter(target, num_layers=2, block_size=BLOCK).config.to_hf_dict(), VARIANTS[name])
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(0, 8, (2, 12), generator=gen)
    features = target(ids).features
    valid = torch.ones(2, 12, dtype=torch.bool)
    valid[1, 9:], valid[1, 3] = False, False
    block_ids = torch.full((2, 4, BLOCK), MASK, dtype=torch.long)
    block_ids[:, :, 0] = ids.gather(1, ANCHORS)
    cache = drafter.new_cache(2)
    drafter.extend_cache(cache, features, torch.arange(12).expand(2, -1), valid)
    with torch.no_grad():
        hidden = drafter.forward_blocks(drafter.project_context(features), valid, block_ids, ANCHORS,
                                        chunk_rows=2 * BLOCK)
        for b in range(2):
            for m in range(4):
                anchor = int(ANCHORS[b, m])
                seen = torch.nonzero(valid[b] & (torch.arange(12) < anchor))[:, 0]
                want = _reference_block(drafter, hf, features[b, seen], seen, block_ids[b, m], anchor)
                assert (hidden[b, m] - want).abs().max() < 1e-9, (b, m)
        for m in range(4):
            tokens, logits = drafter.draft(cache, block_ids[:, m, 0], ANCHORS[:, m])
            assert (logits - drafter.logits(hidden[:, m, 1:])).abs().max() < 1e-9
            assert torch.equal(tokens, logits.argmax(-1))


def _dense_masks(hf: dict, valid: torch.Tensor, anchors: torch.Tensor) -> list[torch.Tensor]:
    """Per layer, bool [B,1,M*K,C+M*K] over [context; all blocks] from positions: block m sees valid context
    before its anchor and its own block, both under the layer's rule."""
    batch, context = valid.shape
    positions = (anchors[:, :, None] + torch.arange(BLOCK)).reshape(batch, -1)
    block = torch.arange(positions.shape[1]) // BLOCK
    masks = []
    for layer in range(len(hf["layer_types"])):
        rows = []
        for b in range(batch):
            ctx = valid[b][None, :] & (torch.arange(context)[None, :] < anchors[b][block][:, None])
            own = block[:, None] == block[None, :]
            rule = _visible(positions[b], torch.cat([torch.arange(context), positions[b]]), *_rule(hf, layer))
            rows.append(torch.cat([ctx, own], dim=1) & rule)
        masks.append(torch.stack(rows)[:, None])
    return masks


@pytest.mark.parametrize("name", VARIANTS)
def test_packed_gradients_equal_the_dense_masks(target, name):
    """With autograd (checkpointed chunks of one block, each cut to the context its window reaches): hidden
    states and every gradient equal one forward over dense per-layer masks."""
    drafter = variant_drafter(target, name, scale=0.3)
    hf = with_change(micro_drafter(target, num_layers=2, block_size=BLOCK).config.to_hf_dict(), VARIANTS[name])
    ids = torch.randint(0, 8, (2, 12), generator=torch.Generator().manual_seed(5))
    features = target(ids).features
    valid = torch.ones(2, 12, dtype=torch.bool)
    valid[1, 9:], valid[1, 3] = False, False
    block_ids = torch.full((2, 4, BLOCK), MASK, dtype=torch.long)
    block_ids[:, :, 0] = ids.gather(1, ANCHORS)
    positions = (ANCHORS[:, :, None] + torch.arange(BLOCK)).reshape(2, -1)

    def run(forward):
        hidden = forward(drafter.project_context(features))
        hidden.pow(2).sum().backward()
        grads = {n: p.grad.clone() for n, p in drafter.named_parameters()}
        drafter.zero_grad(set_to_none=True)
        return hidden.detach().reshape(2, -1, target.hidden_size), grads

    got, got_grads = run(lambda c: drafter.forward_blocks(c, valid, block_ids, ANCHORS, chunk_rows=BLOCK))
    want, want_grads = run(lambda c: drafter._run_blocks(block_ids.reshape(2, -1), positions,
                                                         drafter.context_keys_values(c, torch.arange(12).expand(2, -1)),
                                                         _dense_masks(hf, valid, ANCHORS)))
    assert (got - want).abs().max() < 1e-9
    assert all((got_grads[n] - want_grads[n]).abs().max() < 1e-9 for n in want_grads)


def test_the_rules_change_the_forward(target):
    """The definition's masks are not vacuous here: every attention variant drafts other hidden states than the
    plain drafter with the same weights."""
    plain = variant_drafter(target, None, scale=0.3)
    ids = torch.randint(0, 8, (1, 12), generator=torch.Generator().manual_seed(3))
    features = target(ids).features
    valid = torch.ones(1, 12, dtype=torch.bool)
    block_ids = torch.full((1, 1, BLOCK), MASK, dtype=torch.long)
    anchors = torch.tensor([[10]])
    with torch.no_grad():
        base = plain.forward_blocks(plain.project_context(features), valid, block_ids, anchors)
        for name in ("sliding-causal", "sliding-bidirectional", "causal", "scaled"):
            drafter = variant_drafter(target, name, scale=0.3)
            got = drafter.forward_blocks(drafter.project_context(features), valid, block_ids, anchors)
            assert not torch.allclose(got, base), name


def test_the_logit_transform_is_the_drafters_q(target):
    """multiplier, then cap · tanh(· / cap), in drafts and in `student_head` (what the losses apply); a negative
    multiplier shows the drafts are the transformed argmax, not the LM head's."""
    drafter = variant_drafter(target, "scaled", scale=0.3)
    hidden = torch.randn(5, target.hidden_size, dtype=torch.float64)
    raw = target.lm_head(hidden)
    want = 0.5 * torch.tanh(raw * 0.7 / 0.5)
    assert torch.equal(drafter.student_head(hidden), want) and torch.equal(drafter.logits(hidden), want)
    assert drafter.teacher_head is target.lm_head and drafter.student_head.weight is target.lm_head.weight
    assert "lm_head.weight" not in drafter.state_dict()
    hf = with_change(drafter.config.to_hf_dict(), {"dflash_config": {"output_multiplier": -1.0}})
    flipped = DFlashDrafter(DFlashConfig.from_hf_dict(hf), target.embed_tokens, target.lm_head)
    flipped.load_state_dict(drafter.state_dict())
    cache = flipped.new_cache(1)
    ids = torch.tensor([[1, 2, 3, 4]])
    flipped.extend_cache(cache, target(ids).features, torch.arange(4)[None], torch.ones(1, 4, dtype=torch.bool))
    tokens, _ = flipped.draft(cache, torch.tensor([5]), torch.tensor([4]))
    with torch.no_grad():
        context = flipped.project_context(target(ids).features)
        hidden = flipped.forward_blocks(context, torch.ones(1, 4, dtype=torch.bool),
                                        torch.tensor([[[5, MASK, MASK, MASK]]]), torch.tensor([[4]]))
    assert torch.equal(tokens[0], target.lm_head(hidden[0, 0, 1:]).argmin(-1))


def test_flop_counters_count_the_same_weights(target):
    """The window and the logit transform add no weights, and attention's length term is not counted (flops.py):
    a variant costs what the plain drafter of its shape costs."""
    plain = DrafterParams.of(micro_drafter(target, num_layers=2, block_size=BLOCK, mask_token_id=MASK))
    for name in VARIANTS:
        assert DrafterParams.of(variant_drafter(target, name)) == plain, name


# ------------------------------------------------------------------------------------------------ decoding


@pytest.mark.parametrize("name", VARIANTS)
def test_greedy_is_lossless_and_the_rebuild_and_replay_recover_every_block(target, name):
    """Greedy decoding emits the target's own text; the rebuild from that text finds every block decoding
    recorded (so offline τ is the decoded τ), and replay's student drafts them again at T=1 too."""
    drafter = variant_drafter(target, name, scale=0.3)
    reference = generate_autoregressive(target, PROMPTS, Sampling(), max_new_tokens=24, eos_id=EOS, seed=0,
                                        keys=list(range(len(PROMPTS))))
    for sampling in (Sampling(), Sampling(temperature=1.0)):
        decoded = SpeculativeDecoder(target, drafter, eos_id=EOS).generate(PROMPTS, sampling, max_new_tokens=24,
                                                                           seed=5)
        if sampling.greedy:
            assert [r.response_ids for r in decoded] == reference
        samples = [type(r).from_text(r.key, r.prompt_ids, r.response_ids, EOS) for r in decoded]
        rebuilt = rebuild_records(target, drafter, samples, batch_size=3)
        assert [(r.anchors, r.accepted, r.drafts) for r in rebuilt] == [(r.anchors, r.accepted, r.drafts)
                                                                          for r in decoded]
        assert AcceptanceStats.from_records(rebuilt, BLOCK).tau == AcceptanceStats.from_records(decoded, BLOCK).tau
        batch = score(target, decoded, block_size=BLOCK, mode="draft_opd")
        drafts = drafter.logits(student_hidden(drafter, batch)).argmax(-1)
        assert torch.equal(drafts, torch.tensor([d for r in decoded for d in r.drafts]))
    assert sum(sum(r.accepted) for r in decoded) > 0


# A variant changes only what is drafted; verification, whose chi-square make test runs with a random DFlash drafter
# (test_decoding.py), decides what is emitted. The greedy test above runs every variant: make test-all.
@pytest.mark.slow
def test_sampling_is_lossless(target):
    """T=1: the joint law of the first three emitted tokens equals the target's own (chi-square, 10k samples)."""
    sampling, n = Sampling(temperature=1.0), 10_000
    counts = sampled_joint(target, variant_drafter(target, "dflash2-shaped", scale=0.3), PROMPT, sampling, n, length=3)
    stat, critical = chi_square(counts, exact_joint(target, PROMPT, sampling, 3, EOS), n)
    assert stat < critical, f"chi2 {stat:.1f} >= {critical:.1f}"


# ------------------------------------------------------------------------------------------------ training


def _save_variant(micro_assets, directory, name: str) -> str:
    """The micro spec's drafter (target layers [1, 2], K=4) saved as a variant (its layer lists cut to one)."""
    target = load_target(micro_assets["target"], dtype=torch.float32, layer_ids=[1, 2])
    base = DFlashDrafter.from_pretrained(micro_assets["drafter"], target)
    change = {k: (v[:1] if isinstance(v, list) else v) for k, v in VARIANTS[name].items()}
    drafter = DFlashDrafter(DFlashConfig.from_hf_dict(with_change(base.config.to_hf_dict(), change)),
                            target.embed_tokens, target.lm_head)
    drafter.load_state_dict(base.state_dict())
    drafter.save_pretrained(directory)
    return str(directory)


@pytest.mark.parametrize("name", ["sliding-bidirectional", "scaled"])
def test_draft_opd_rollouts_train_identically_from_every_source(micro_spec_file, micro_assets, tmp_path, name):
    """Draft-OPD steps run with a variant, and greedy rollouts decoded with it, or sampled from the target and
    rebuilt by the scorer, take the same steps at a learning rate that changes the drafts."""
    path = _save_variant(micro_assets, tmp_path / "variant", name)
    greedy = [f"models.drafter_path={path}", "rollout.temperature=0", "optim.lr=0.03", "steps=3",
              "models.dtype=float64"]
    reference = losses(spec_for(micro_spec_file, tmp_path, "speculative", *greedy))
    assert len(reference) == 3 and all(math.isfinite(x) for x in reference)
    assert losses(spec_for(micro_spec_file, tmp_path, "target", *greedy, "rollout.source=target")) == pytest.approx(
        reference, rel=1e-9)


def test_sft_trains_a_variant_and_saves_it_as_one(micro_spec_file, micro_assets, tmp_path, capsys):
    path = _save_variant(micro_assets, tmp_path / "variant", "dflash2-shaped")
    out = tmp_path / "sft"
    args = ["sft", str(micro_spec_file), "--out", str(out)]
    for s in [f"models.drafter_path={path}", "sft.epochs=1", "sft.batch_size=8", "sft.micro_batch_size=4",
              "sft.response_max_new_tokens=12", "sft.anchors_per_seq=8"]:
        args += ["--set", s]
    assert main(args) == 0, capsys.readouterr().err
    target = load_target(micro_assets["target"], dtype=torch.float32, layer_ids=[1, 2])
    before, after = DFlashDrafter.from_pretrained(path, target), DFlashDrafter.from_pretrained(out, target)
    assert after.config == before.config
    assert any(not torch.equal(a, b) for a, b in zip(before.state_dict().values(), after.state_dict().values()))
