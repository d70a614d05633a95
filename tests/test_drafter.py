"""DFlash drafter: the block mask, the context cache, HF/Qwen3 conventions and the public checkpoint format."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from opd.errors import OpdError
from opd.models.dflash import DFlashConfig, DFlashDrafter
from opd.tiny.micro import micro_drafter, micro_target
from tests.helpers.drafter_math import _rms, _rope

EXACT = 1e-9
BLOCK = 4
T = 12  # context length used throughout


def _public_names(num_layers: int) -> set[str]:
    """Tensor names of a public Qwen3 DFlash checkpoint (z-lab/dflash tests/fixtures/*-safetensors-header.json)."""
    per_layer = [
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
        "self_attn.q_norm.weight",
        "self_attn.k_norm.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
    ]
    names = {f"layers.{i}.{n}" for i in range(num_layers) for n in per_layer}
    return names | {"fc.weight", "hidden_norm.weight", "norm.weight"}


def _randomize(module: torch.nn.Module, seed: int) -> None:
    """Large random weights (norm gains included) so that any wrong mask or missing norm shows up clearly."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.3 + (1.0 if p.dim() == 1 else 0.0))


@pytest.fixture(scope="module")
def setup():
    target = micro_target(layer_ids=[0, 2, 3])
    drafter = micro_drafter(target, num_layers=2, block_size=BLOCK)
    _randomize(drafter, seed=7)
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(0, 63, (2, T), generator=gen)
    features = target(ids).features
    # Row 0: all 12 context entries valid. Row 1: 9 entries, with a hole at position 3.
    valid = torch.ones(2, T, dtype=torch.bool)
    valid[1, 9:] = False
    valid[1, 3] = False
    return target, drafter, ids, features, valid


def _blocks(ids: torch.Tensor, anchors: torch.Tensor, mask_token_id: int) -> torch.Tensor:
    """[anchor token, MASK x (K-1)] for every anchor: [B,M,K]."""
    block_ids = torch.full((*anchors.shape, BLOCK), mask_token_id, dtype=torch.long)
    block_ids[:, :, 0] = ids.gather(1, anchors)
    return block_ids


ANCHORS = torch.tensor([[2, 5, 9, 11], [1, 4, 7, 8]])  # different positions per block and per row


# --- training path vs inference path vs the definition -----------------------------------------------------------


def test_forward_blocks_equals_separate_draft_calls(setup):
    target, drafter, ids, features, valid = setup
    block_ids = _blocks(ids, ANCHORS, drafter.mask_token_id)
    hidden = drafter.forward_blocks(drafter.project_context(features), valid, block_ids, ANCHORS)
    assert hidden.shape == (2, ANCHORS.shape[1], BLOCK, target.hidden_size)
    packed_logits = drafter.logits(hidden[:, :, 1:])

    cache = drafter.new_cache(2)
    drafter.extend_cache(cache, features, torch.arange(T).expand(2, -1), valid)
    for m in range(ANCHORS.shape[1]):
        tokens, logits = drafter.draft(cache, ids.gather(1, ANCHORS[:, m : m + 1])[:, 0], ANCHORS[:, m])
        assert tokens.shape == (2, BLOCK - 1) and logits.shape == (2, BLOCK - 1, target.vocab_size)
        assert (logits - packed_logits[:, m]).abs().max() < EXACT
        assert torch.equal(tokens, logits.argmax(-1))


def _reference_block(drafter, features, context_positions, block_ids, anchor) -> torch.Tensor:
    """One block straight from the DFlash definition: loops and explicit softmax, no shared helpers."""
    cfg = drafter.config
    eps, heads, kv_heads, d = cfg.rms_norm_eps, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    context = _rms(features @ drafter.fc.weight.T, drafter.hidden_norm.weight, eps)
    block_positions = anchor + torch.arange(len(block_ids))
    all_positions = torch.cat([context_positions, block_positions])
    h = drafter.embed_tokens.weight[block_ids]
    for layer in drafter.layers:
        attn = layer.self_attn
        x = _rms(h, layer.input_layernorm.weight, eps)
        kv_input = torch.cat([context, x])  # same projections for context and block
        q = _rms((x @ attn.q_proj.weight.T).view(-1, heads, d), attn.q_norm.weight, eps)
        q = _rope(q, block_positions, cfg.rope_theta)
        k = _rms((kv_input @ attn.k_proj.weight.T).view(-1, kv_heads, d), attn.k_norm.weight, eps)
        k = _rope(k, all_positions, cfg.rope_theta)
        v = (kv_input @ attn.v_proj.weight.T).view(-1, kv_heads, d)
        out = torch.empty(len(block_ids), heads, d, dtype=h.dtype)
        for head in range(heads):
            group = head // (heads // kv_heads)
            probs = torch.softmax(q[:, head] @ k[:, group].T / math.sqrt(d), dim=-1)  # no mask: all visible
            out[:, head] = probs @ v[:, group]
        h = h + out.reshape(len(block_ids), -1) @ attn.o_proj.weight.T
        y = _rms(h, layer.post_attention_layernorm.weight, eps)
        mlp = layer.mlp
        h = h + (F.silu(y @ mlp.gate_proj.weight.T) * (y @ mlp.up_proj.weight.T)) @ mlp.down_proj.weight.T
    return _rms(h, drafter.norm.weight, eps)


def test_forward_blocks_equals_reference_definition(setup):
    _, drafter, ids, features, valid = setup
    block_ids = _blocks(ids, ANCHORS, drafter.mask_token_id)
    with torch.no_grad():
        hidden = drafter.forward_blocks(drafter.project_context(features), valid, block_ids, ANCHORS)
        for b in range(2):
            for m in range(ANCHORS.shape[1]):
                anchor = int(ANCHORS[b, m])
                seen = torch.nonzero(valid[b] & (torch.arange(T) < anchor))[:, 0]
                want = _reference_block(drafter, features[b, seen], seen, block_ids[b, m], anchor)
                assert (hidden[b, m] - want).abs().max() < EXACT, (b, m)


def test_block_sees_only_context_before_its_anchor_and_no_other_block(setup):
    _, drafter, ids, features, valid = setup
    anchors = torch.tensor([[3, 8], [3, 8]])
    block_ids = _blocks(ids, anchors, drafter.mask_token_id)
    context = drafter.project_context(features)
    with torch.no_grad():
        base = drafter.forward_blocks(context, valid, block_ids, anchors)
        later = context.clone()
        later[:, 3:] += 1.0  # context at/after the first anchor
        changed_block = block_ids.clone()
        changed_block[:, 1, 1:] = 5  # tokens of the second block
        hole = context.clone()
        hole[1, 3] += 1.0  # the invalid entry of row 1
        assert torch.equal(drafter.forward_blocks(later, valid, block_ids, anchors)[:, 0], base[:, 0])
        assert not torch.allclose(drafter.forward_blocks(later, valid, block_ids, anchors)[:, 1], base[:, 1])
        assert torch.equal(drafter.forward_blocks(context, valid, changed_block, anchors)[:, 0], base[:, 0])
        assert torch.equal(drafter.forward_blocks(hole, valid, block_ids, anchors)[1], base[1])


def test_decoder_layer_matches_hf_qwen3_layer_without_context():
    """Same weights, no context, causal mask: our layer must be an HF Qwen3 decoder layer (public conventions)."""
    target = micro_target(layer_ids=[1])
    _randomize(target.model.model.layers[0], seed=3)
    drafter = micro_drafter(target)
    drafter.layers[0].load_state_dict(target.model.model.layers[0].state_dict())
    ids = torch.randint(0, 64, (1, 7), generator=torch.Generator().manual_seed(4))
    want = target.model(ids, output_hidden_states=True).hidden_states[1]
    h = target.embed_tokens(ids)
    positions = torch.arange(7)[None]
    cos, sin = drafter._rope(positions)[0]
    empty = h.new_zeros(1, drafter.config.num_key_value_heads, 0, drafter.config.head_dim)
    causal = torch.ones(7, 7, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        got = drafter.layers[0](h, cos, sin, (empty, empty), causal)
    assert (got - want).abs().max() < 1e-5  # HF computes RMSNorm/RoPE in float32


# --- the inference cache ------------------------------------------------------------------------------------------


def _draft_all(drafter, cache, ids, anchors):
    """Draft logits for each column of anchors [B,M]."""
    anchor_ids = ids.gather(1, anchors)
    return [drafter.draft(cache, anchor_ids[:, m], anchors[:, m])[1] for m in range(anchors.shape[1])]


def test_incremental_cache_with_holes_equals_one_extend(setup):
    _, drafter, ids, features, valid = setup
    full = drafter.new_cache(2)
    drafter.extend_cache(full, features, torch.arange(T).expand(2, -1), valid)

    # Ragged arrival: row 1 gets junk entries (invalid) and re-sends positions later, rows have different chunks.
    chunked = drafter.new_cache(2)
    junk = torch.randn(features.shape, generator=torch.Generator().manual_seed(9), dtype=features.dtype)
    chunks = [
        (torch.tensor([[0, 1, 2], [0, 1, 2]]), torch.tensor([[True] * 3, [True, True, False]])),
        (torch.tensor([[3, 4, 5, 6], [3, 4, 5, 6]]), torch.tensor([[True] * 4, [False, True, True, True]])),
        (torch.tensor([[7, 8, 9, 10, 11], [2, 7, 8, 0, 0]]), torch.tensor([[True] * 5, [True] * 3 + [False] * 2])),
    ]
    for positions, ok in chunks:
        real = features.gather(1, positions[..., None].expand(-1, -1, features.shape[-1]))
        chunk = torch.where(ok[..., None], real, junk[:, : positions.shape[1]])
        drafter.extend_cache(chunked, chunk, positions, ok)
    assert chunked.length == 12
    for got, want in zip(_draft_all(drafter, chunked, ids, ANCHORS), _draft_all(drafter, full, ids, ANCHORS)):
        assert (got - want).abs().max() < EXACT


# --- sharing and gradients ----------------------------------------------------------------------------------------


def test_drafter_owns_no_embedding_or_lm_head(setup):
    target, drafter, *_ = setup
    own = {id(p) for p in drafter.parameters()}
    assert id(target.embed_tokens.weight) not in own and id(target.lm_head.weight) not in own
    assert set(drafter.state_dict()) == _public_names(2)
    assert drafter.embed_tokens is target.embed_tokens and drafter.lm_head is target.lm_head


def test_backward_reaches_drafter_only():
    target = micro_target(layer_ids=[0, 2, 3])
    drafter = micro_drafter(target, num_layers=2, block_size=BLOCK)
    ids = torch.randint(0, 63, (1, 8), generator=torch.Generator().manual_seed(1))
    features = target(ids).features
    anchors = torch.tensor([[2, 5]])
    context_valid = torch.ones(1, 8, dtype=torch.bool)
    block_ids = _blocks(ids, anchors, drafter.mask_token_id)
    hidden = drafter(drafter.project_context(features), context_valid, block_ids, anchors)  # nn.Module call path
    drafter.logits(hidden).logsumexp(-1).sum().backward()
    assert all(p.grad is None for p in target.parameters())
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in drafter.parameters())


# --- checkpoints --------------------------------------------------------------------------------------------------


def test_save_load_round_trip_is_bit_exact(setup, tmp_path):
    target, drafter, *_ = setup
    drafter.save_pretrained(tmp_path)
    assert set(load_file(str(tmp_path / "model.safetensors"))) == _public_names(2)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["block_size"] == BLOCK and config["num_target_layers"] == 4
    assert config["dflash_config"] == {"mask_token_id": 63, "target_layer_ids": [0, 2, 3]}
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    loaded = DFlashDrafter.from_pretrained(tmp_path, target)
    assert loaded.config == drafter.config
    assert loaded.embed_tokens is target.embed_tokens
    saved, restored = drafter.state_dict(), loaded.state_dict()
    assert saved.keys() == restored.keys()
    assert all(torch.equal(saved[k], restored[k]) and restored[k].dtype == torch.float64 for k in saved)


def test_config_hf_dict_round_trip(setup):
    _, drafter, *_ = setup
    assert DFlashConfig.from_hf_dict(drafter.config.to_hf_dict()) == drafter.config


def _hand_written_checkpoint(directory, *, hidden_size=32, layer_ids=(0, 2, 3), drop=None, reshape=None):
    """A checkpoint in the public layout written without save_pretrained (shapes of a 2-layer micro drafter)."""
    h, heads, kv_heads, d, inter = hidden_size, 4, 2, 8, 64
    config = {
        "architectures": ["DFlashDraftModel"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "block_size": BLOCK,
        "dflash_config": {"mask_token_id": 63, "target_layer_ids": list(layer_ids)},
        "dtype": "float32",
        "head_dim": d,
        "hidden_act": "silu",
        "hidden_size": h,
        "intermediate_size": inter,
        "layer_types": ["full_attention", "full_attention"],
        "max_position_embeddings": 512,
        "model_type": "qwen3",
        "num_attention_heads": heads,
        "num_hidden_layers": 2,
        "num_key_value_heads": kv_heads,
        "num_target_layers": 4,
        "rms_norm_eps": 1e-6,
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "vocab_size": 64,
    }
    shapes = {"fc.weight": (h, len(layer_ids) * h), "hidden_norm.weight": (h,), "norm.weight": (h,)}
    for i in range(2):
        shapes |= {
            f"layers.{i}.input_layernorm.weight": (h,),
            f"layers.{i}.post_attention_layernorm.weight": (h,),
            f"layers.{i}.self_attn.q_proj.weight": (heads * d, h),
            f"layers.{i}.self_attn.k_proj.weight": (kv_heads * d, h),
            f"layers.{i}.self_attn.v_proj.weight": (kv_heads * d, h),
            f"layers.{i}.self_attn.o_proj.weight": (h, heads * d),
            f"layers.{i}.self_attn.q_norm.weight": (d,),
            f"layers.{i}.self_attn.k_norm.weight": (d,),
            f"layers.{i}.mlp.gate_proj.weight": (inter, h),
            f"layers.{i}.mlp.up_proj.weight": (inter, h),
            f"layers.{i}.mlp.down_proj.weight": (h, inter),
        }
    gen = torch.Generator().manual_seed(0)
    tensors = {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}
    tensors["lm_head.weight"] = torch.randn(64, h, generator=gen)  # some exports carry these; we ignore them
    tensors["embed_tokens.weight"] = torch.randn(64, h, generator=gen)
    if drop:
        del tensors[drop]
    if reshape:
        tensors[reshape] = tensors[reshape].T.contiguous()
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(directory / "model.safetensors"))
    return tensors


def test_hand_written_public_checkpoint_loads(setup, tmp_path):
    target, *_ = setup
    tensors = _hand_written_checkpoint(tmp_path)
    drafter = DFlashDrafter.from_pretrained(tmp_path, target)
    assert drafter.config.target_layer_ids == [0, 2, 3] and drafter.config.block_size == BLOCK
    assert drafter.fc.weight.dtype == torch.float64  # dtype follows the target
    for name, value in drafter.state_dict().items():
        assert torch.equal(value, tensors[name].double()), name
    assert drafter.lm_head is target.lm_head


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"reshape": "fc.weight"}, r"fc\.weight has shape \[96, 32\], expected \[32, 96\]"),
        ({"layer_ids": (0, 2, 7)}, r"target_layer_ids \[0, 2, 7\].*\[0, 4\)"),
        ({"hidden_size": 48}, r"hidden_size is 48 but the target has 32"),
        ({"drop": "layers.1.self_attn.k_norm.weight"}, r"missing tensor\(s\) layers\.1\.self_attn\.k_norm\.weight"),
        ({"layer_ids": (0, 1, 3)}, r"differ from the target's layer_ids \[0, 2, 3\]"),
    ],
)
def test_mismatched_checkpoint_raises_one_line_opd_error(setup, tmp_path, kwargs, message):
    target, *_ = setup
    _hand_written_checkpoint(tmp_path, **kwargs)
    with pytest.raises(OpdError, match=message) as info:
        DFlashDrafter.from_pretrained(tmp_path, target)
    assert "\n" not in str(info.value)


def test_unexpected_tensor_and_missing_files_raise(setup, tmp_path):
    target, drafter, *_ = setup
    with pytest.raises(OpdError, match="config.json not found"):
        DFlashDrafter.from_pretrained(tmp_path / "absent", target)
    drafter.save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    save_file(tensors | {"layers.2.mlp.up_proj.weight": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(OpdError, match=r"unexpected tensor\(s\) layers\.2\.mlp\.up_proj\.weight"):
        DFlashDrafter.from_pretrained(tmp_path, target)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(OpdError, match="model.safetensors: drafter weights not found"):
        DFlashDrafter.from_pretrained(tmp_path, target)


# What z-lab's DFlashDraftModel does not run (an incomplete DFlash 2 config, unknown keys and layer types, a
# `dflash_config.causal` it never reads) must be refused in one line, not loaded to draft wrongly; its variants load
# (tests/test_drafter_variants.py).
@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"layer_types": ["chunked_attention", "full_attention"]},
         r"'layer_types' makes layer 0 'chunked_attention'; DFlash drafters take 'full_attention' or"),
        ({"layer_types": ["full_attention"]}, r"'layer_types' must list 2 layer types"),
        ({"use_sliding_window": True, "sliding_window": 0}, r"'sliding_window' must be a positive integer, got 0"),
        ({"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 8},
         r"'layer_types' makes layer 1 'sliding_attention' but no window is in force"),
        ({"is_causal": "yes"}, r"'is_causal' must be true, false or null, got 'yes'"),
        ({"dflash_config": {"mask_token_id": 63, "target_layer_ids": [0, 2, 3], "causal": True}},
         r"'dflash_config\.causal' is True, which z-lab's DFlashDraftModel does not read"),
        ({"dflash_config": {"mask_token_id": 63, "target_layer_ids": [0, 2, 3], "selector_rank": 256}},
             r"'dflash_config\.selector_rank' belongs to a DFlash variant this drafter does not implement"),
            ({"architectures": ["DFlash2DraftModel"]}, r"'architectures' names DFlash2DraftModel, another drafter "
                                                       r"family's model"),
        ({"dflash_config": {"mask_token_id": 63, "target_layer_ids": [0, 2, 3], "attention_sink_bias": True}},
         r"'dflash_config\.attention_sink_bias' belongs to a DFlash variant"),
        ({"dflash_config": {"mask_token_id": 63, "target_layer_ids": [0, 2, 3], "output_multiplier": "2"}},
         r"'dflash_config\.output_multiplier' must be a finite number, got '2'"),
        ({"final_logit_softcapping": True}, r"'final_logit_softcapping' must be a finite number, got True"),
        ({"dflash_config": {"target_layer_ids": [0, 2, 3]}}, r"'dflash_config\.mask_token_id' is missing"),
    ],
    ids=["unknown-layer-type", "layer-count", "zero-window", "window-off", "is-causal-not-bool", "dflash-causal",
         "dflash2-selector", "dflash2-architecture", "unknown-key", "multiplier-not-number", "softcap-bool",
         "no-mask-token"],
)
def test_unsupported_dflash_variants_are_refused_in_one_line(setup, tmp_path, change, message):
    target, *_ = setup
    _hand_written_checkpoint(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(change)
    config = {k: v for k, v in config.items() if v is not None}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(OpdError, match=message) as info:
        DFlashDrafter.from_pretrained(tmp_path, target)
    assert "\n" not in str(info.value) and str(info.value).startswith(str(tmp_path / "config.json"))


def test_supported_variant_flags_still_load(setup, tmp_path):
    """Flags that say 'the plain DFlash model' load: full-attention layer types, a window that is switched off,
    explicit non-causal flags, and block_size / num_target_layers inside dflash_config (newer exports)."""
    target, *_ = setup
    _hand_written_checkpoint(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config |= {"is_causal": False, "use_sliding_window": False, "sliding_window": 4096}
    config["dflash_config"] |= {"causal": False, "block_size": config.pop("block_size"),
                                "num_target_layers": config.pop("num_target_layers")}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert DFlashDrafter.from_pretrained(tmp_path, target).config.block_size == BLOCK


def test_serving_refuses_the_targets_last_layer_that_vllm_cannot_capture(tmp_path):
    """Training may use the last layer (it is read at the final norm); `opd serve-bench` refuses it up front.
    The shipped tiny drafter (ids [1, 3] of 6) and the Qwen3 configs' default ids never use it."""
    from types import SimpleNamespace

    from opd.commands.serve_bench import drafter_block_size
    from opd.formats.dflash import DFlashSpec

    spec = SimpleNamespace(models=SimpleNamespace(target_path=str(tmp_path / "no-target"), drafter=DFlashSpec()))
    _hand_written_checkpoint(tmp_path / "last", layer_ids=(0, 2, 3))
    with pytest.raises(OpdError, match=r"include 3, the target's last layer, which vLLM's DFlash path cannot") as info:
        drafter_block_size(str(tmp_path / "last"), spec)
    assert "\n" not in str(info.value)
    _hand_written_checkpoint(tmp_path / "inner", layer_ids=(0, 1, 2))
    assert drafter_block_size(str(tmp_path / "inner"), spec) == BLOCK
    assert drafter_block_size("opd/assets/tiny/drafter", spec) == 8


def test_a_fresh_drafter_for_a_target_without_rope_takes_the_spec_s_base():
    """Kimi Linear's MLA layers carry no rope_theta: a fresh drafter is refused naming models.drafter.rope_theta, and
    takes that base when it is set (DFlash's families and EAGLE-3's alike)."""
    from transformers import AutoConfig

    from opd.errors import OpdError
    from opd.formats.eagle3 import Eagle3Config

    target = AutoConfig.from_pretrained("opd/assets/tiny/target")
    target.rope_theta = None
    target.rope_parameters = {"rope_type": "default"}
    for build in (lambda **kw: DFlashConfig.for_target(target, num_layers=1, block_size=4, mask_token_id=3, **kw),
                  lambda **kw: Eagle3Config.for_target(target, draft_vocab_size=64, block_size=4, **kw)):
        with pytest.raises(OpdError, match=r"rope_theta.*set models\.drafter\.rope_theta"):
            build()
        config = build(rope_theta=12345.0)
        assert (config.rope_parameters["rope_theta"] if hasattr(config, "rope_parameters") else config.rope_theta) \
            == 12345.0


def test_every_target_field_a_fresh_drafter_lacks_is_named_at_once():
    """A target stating neither a RoPE base nor a context length (Kimi Linear): one error names both spec fields,
    each with what to set; with both set, the drafter takes them."""
    import re
    from types import SimpleNamespace

    from transformers import AutoConfig

    from opd.errors import OpdError

    fields = AutoConfig.from_pretrained("opd/assets/tiny/target").to_dict()
    fields |= {"rope_theta": None, "rope_parameters": {"rope_type": "default"}, "max_position_embeddings": None}
    target = SimpleNamespace(to_dict=lambda: fields)  # a config as Kimi Linear's states it
    with pytest.raises(OpdError) as info:
        DFlashConfig.for_target(target, num_layers=1, block_size=4, mask_token_id=3)
    assert "\n" not in str(info.value)
    assert re.search(r"rope_theta: set models\.drafter\.rope_theta \(.*\); max_position_embeddings: set "
                     r"models\.drafter\.max_position_embeddings \(.*131072\)$", str(info.value))
    config = DFlashConfig.for_target(target, num_layers=1, block_size=4, mask_token_id=3, rope_theta=5e5,
                                     max_position_embeddings=4096)
    assert (config.rope_parameters["rope_theta"], config.max_position_embeddings) == (5e5, 4096)
