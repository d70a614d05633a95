"""Quantized published targets load: gpt-oss's MXFP4 experts and DeepSeek-V3's block-scaled FP8 Linears.

Each miniature target is written as its published checkpoint is (`quantize_state_dict`: the names, dtypes and
layouts of openai/gpt-oss-20b and deepseek-ai/DeepSeek-V3), then loaded through `load_target` on this CPU, where
transformers dequantizes while loading. Its weights must be transformers' own dequantization of what was written
(a float checkpoint of those values loads to the same model, and the same logits, bit for bit), and within the
format's error of the float weights it was written from:
- MXFP4: each value is at most one scale unit (2^exponent of its block of 32) from the original; the scale is the
  smallest power of two that fits the block's largest value in ±6, so a unit is at most a third of that value.
- FP8 e4m3: each value is within 2^-4 of its own magnitude plus half e4m3's smallest subnormal step (2^-10) times
  its block's scale; at most a sixteenth of the block's largest value.
The packers are checked against transformers' dequantizers on weights they can represent exactly, so a wrong nibble
order, blocked dimension or transpose fails.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, GptOssConfig, GptOssForCausalLM
from transformers.integrations.finegrained_fp8 import Fp8Dequantize
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from opd.errors import OpdError
from opd.models.quantization import (
    FP8_MAX,
    Quantization,
    fp8_block_pack,
    mxfp4_pack,
    quantize_state_dict,
)
from opd.models.target import Target, load_target

GPT_OSS_QUANTIZATION = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
DEEPSEEK_QUANTIZATION = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                         "weight_block_size": [128, 128]}
WEIGHTS = "model.safetensors"


def _gpt_oss() -> GptOssForCausalLM:
    torch.manual_seed(0)
    return GptOssForCausalLM(GptOssConfig(
        vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
    )).requires_grad_(False)


def _deepseek(intermediate: int = 256) -> DeepseekV3ForCausalLM:
    """Layer 0 dense (its MLP two FP8 blocks tall or wide), layer 1 MoE with a shared expert."""
    torch.manual_seed(0)
    return DeepseekV3ForCausalLM(DeepseekV3Config(
        vocab_size=96, hidden_size=64, intermediate_size=intermediate, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=16, n_group=1, topk_group=1)).requires_grad_(False)


def _publish(model: Any, quantization: dict[str, Any], path: Path) -> dict[str, torch.Tensor]:
    """Write `model` as its published quantized checkpoint; returns the tensors written."""
    model.save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = quantization
    written = quantize_state_dict(load_file(path / WEIGHTS), config)
    save_file(written, path / WEIGHTS, metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config))
    return written


def _dequantized_checkpoint(written: dict[str, torch.Tensor], source: Path, path: Path) -> None:
    """A float checkpoint of transformers' own dequantization of `written`, with no quantization_config."""
    fp8 = Fp8Dequantize(None)
    floats: dict[str, torch.Tensor] = {}
    for name, tensor in written.items():
        if name.endswith("_blocks"):
            proj = name.removesuffix("_blocks")
            floats[proj] = convert_moe_packed_tensors(tensor, written[f"{proj}_scales"], dtype=torch.float32)
        elif name.endswith(".weight") and f"{name}_scale_inv" in written:
            floats[name] = fp8._dequantize_one(tensor, written[f"{name}_scale_inv"], torch.float32)
        elif not name.endswith(("_scales", "_scale_inv")):
            floats[name] = tensor
    path.mkdir()
    save_file(floats, path / WEIGHTS, metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    del config["quantization_config"]
    (path / "config.json").write_text(json.dumps(config))


def _same_model(loaded: Target, reference: Target) -> None:
    """Every parameter equal, and the same logits and features, bit for bit."""
    expected = dict(reference.model.named_parameters())
    for name, parameter in loaded.model.named_parameters():
        assert parameter.dtype == torch.float32, name
        assert torch.equal(parameter, expected[name]), name
    ids = torch.randint(0, loaded.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    ours, theirs = loaded(ids), reference(ids)
    assert torch.equal(ours.logits, theirs.logits) and torch.equal(ours.features, theirs.features)


def _largest_error(loaded: Target, original: Any) -> dict[str, float]:
    """max |loaded − original| per parameter the checkpoint quantized (the others must be equal)."""
    floats = dict(original.named_parameters())
    errors = {name: float((p - floats[name]).abs().max()) for name, p in loaded.model.named_parameters()}
    return {name: error for name, error in errors.items() if error > 0}


# -- the packers against transformers' dequantizers ------------------------------------------------------------


def test_mxfp4_pack_inverts_transformers_dequantization():
    """Random codes (no −0) and exponents, each block holding a ±6 so its exponent is the one we would choose:
    packing transformers' dequantization gives back the very bytes."""
    generator = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 15, (3, 8, 4, 32), generator=generator, dtype=torch.uint8)
    codes[codes >= 8] += 1  # skip code 8 (−0.0), which packs as +0
    codes[..., 5] = torch.tensor(7, dtype=torch.uint8) | (codes[..., 5] & 8)  # ±6 in every block
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    scales = torch.randint(120, 134, (3, 8, 4), generator=generator, dtype=torch.uint8)
    weight = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    assert weight.shape == (3, 128, 8)  # [E, in, out]: the input dim is the blocked one
    packed_blocks, packed_scales = mxfp4_pack(weight)
    assert torch.equal(packed_blocks, blocks) and torch.equal(packed_scales, scales)


def test_mxfp4_pack_error_is_one_scale_unit():
    weight = torch.randn(2, 64, 48, generator=torch.Generator().manual_seed(0))
    blocks, scales = mxfp4_pack(weight)
    error = (convert_moe_packed_tensors(blocks, scales, dtype=torch.float32) - weight).abs()
    unit = torch.exp2(scales.float() - 127).repeat_interleave(32, dim=-1).reshape(2, 48, 64).transpose(1, 2)
    assert (error <= unit).all()
    assert (unit <= weight.abs().reshape(2, 2, 32, 48).amax(2).repeat_interleave(32, 1) / 3).all()


def test_fp8_block_pack_inverts_transformers_dequantization():
    """Power-of-two block scales (448 × scale is exact) and a ±448 in every block: packing transformers'
    dequantization gives back the very fp8 values and scales; blocks tile both dims."""
    generator = torch.Generator().manual_seed(0)
    quantized = (torch.rand(256, 384, generator=generator) * 2 - 1) * FP8_MAX
    quantized[::128, ::128] = FP8_MAX
    quantized = quantized.to(torch.float8_e4m3fn)
    scale_inv = torch.exp2(torch.randint(-12, -4, (2, 3), generator=generator).float())
    weight = Fp8Dequantize(None)._dequantize_one(quantized, scale_inv, torch.float32)
    packed, packed_scale_inv = fp8_block_pack(weight)
    assert torch.equal(packed.view(torch.uint8), quantized.view(torch.uint8))
    assert torch.equal(packed_scale_inv, scale_inv)


def test_fp8_block_pack_error_is_e4m3_rounding():
    weight = torch.randn(256, 128, generator=torch.Generator().manual_seed(0)) * 0.05
    quantized, scale_inv = fp8_block_pack(weight)
    assert quantized.dtype == torch.float8_e4m3fn and scale_inv.shape == (2, 1)
    error = (Fp8Dequantize(None)._dequantize_one(quantized, scale_inv, torch.float32) - weight).abs()
    scale = scale_inv.repeat_interleave(128, dim=0)
    assert (error <= weight.abs() / 16 + scale * 2**-10).all()


# -- the published checkpoints load ----------------------------------------------------------------------------


def test_gpt_oss_mxfp4_checkpoint_loads_dequantized(tmp_path):
    original = _gpt_oss()
    written = _publish(original, GPT_OSS_QUANTIZATION, tmp_path / "gpt-oss")
    experts = "model.layers.0.mlp.experts"
    assert written[f"{experts}.gate_up_proj_blocks"].shape == (4, 128, 2, 16)  # [E, out, in/32, 16] as published
    assert written[f"{experts}.down_proj_scales"].dtype == torch.uint8
    assert f"{experts}.gate_up_proj" not in written and f"{experts}.gate_up_proj_bias" in written

    loaded = load_target(str(tmp_path / "gpt-oss"), dtype=torch.float32, layer_ids=[0, 1])
    _dequantized_checkpoint(written, tmp_path / "gpt-oss", tmp_path / "reference")
    _same_model(loaded, load_target(str(tmp_path / "reference"), dtype=torch.float32, layer_ids=[0, 1]))

    errors = _largest_error(loaded, original)
    assert set(errors) == {f"model.layers.{i}.mlp.experts.{p}" for i in (0, 1) for p in ("gate_up_proj", "down_proj")}
    largest = max(float(p.abs().max()) for n, p in original.named_parameters() if n in errors)
    assert max(errors.values()) <= largest / 3


def test_deepseek_fp8_checkpoint_loads_dequantized(tmp_path):
    original = _deepseek()
    written = _publish(original, DEEPSEEK_QUANTIZATION, tmp_path / "deepseek")
    scaled = {name.removesuffix("_scale_inv") for name in written if name.endswith("weight_scale_inv")}
    assert "model.layers.1.mlp.experts.3.gate_proj.weight" in scaled  # per expert, as published
    assert "model.layers.0.self_attn.kv_a_proj_with_mqa.weight" in scaled
    assert not scaled & {"lm_head.weight", "model.embed_tokens.weight", "model.layers.1.mlp.gate.weight"}
    assert written["model.layers.0.mlp.gate_proj.weight_scale_inv"].shape == (2, 1)

    loaded = load_target(str(tmp_path / "deepseek"), dtype=torch.float32, layer_ids=[0, 1])
    _dequantized_checkpoint(written, tmp_path / "deepseek", tmp_path / "reference")
    _same_model(loaded, load_target(str(tmp_path / "reference"), dtype=torch.float32, layer_ids=[0, 1]))

    errors = _largest_error(loaded, original)
    assert "model.layers.1.mlp.experts.gate_up_proj" in errors and "lm_head.weight" not in errors
    largest = max(float(p.abs().max()) for p in original.parameters())
    assert max(errors.values()) <= largest / 16


def test_fp8_partial_blocks_are_refused_in_one_line_off_the_kernel(tmp_path):
    """transformers 5.24 dequantizes an FP8 weight of partial blocks with blocks of rows // scale rows (160 rows:
    blocks of 80, wrong values; DeepSeek-V3's 576 rows: a traceback), so the dequantizing path refuses it, naming
    the weight and the kernel path that reads it as published."""
    original = _deepseek(intermediate=160)  # gate_proj: 160 rows, one block of 128 and one of 32
    _publish(original, DEEPSEEK_QUANTIZATION, tmp_path / "deepseek")
    with pytest.raises(OpdError, match=r"FP8 weight model\.layers\.0\.mlp\.\w+_proj\.weight is \d+ x \d+, in partial "
                                       r"128 x 128 blocks.*compute capability 8\.9") as info:
        load_target(str(tmp_path / "deepseek"), dtype=torch.float32, layer_ids=[0, 1])
    assert "\n" not in str(info.value)


def test_quantize_state_dict_honors_modules_to_not_convert():
    state = {name: tensor for name, tensor in _deepseek().state_dict().items() if "layers.0" in name}
    written = quantize_state_dict(state, {**_deepseek().config.to_dict(), "quantization_config": {
        **DEEPSEEK_QUANTIZATION, "modules_to_not_convert": ["model.layers.0.self_attn"]}})
    scaled = [name for name in written if name.endswith("weight_scale_inv")]
    assert scaled and not [name for name in scaled if "self_attn" in name]


# -- what the loader is asked for ------------------------------------------------------------------------------


def test_load_kwargs_dequantize_on_cpu():
    mxfp4 = Quantization.of({"quantization_config": GPT_OSS_QUANTIZATION})
    config = mxfp4.load_kwargs("cpu", torch.bfloat16)["quantization_config"]
    assert type(config).__name__ == "Mxfp4Config" and config.dequantize
    assert config.modules_to_not_convert == GPT_OSS_QUANTIZATION["modules_to_not_convert"]
    assert mxfp4.path("cpu", torch.bfloat16) == "mxfp4 dequantized to bfloat16" and mxfp4.bits == 4.25

    fp8 = Quantization.of({"text_config": {"quantization_config": DEEPSEEK_QUANTIZATION}})  # nested: multimodal
    config = fp8.load_kwargs("cpu", torch.float32)["quantization_config"]
    assert type(config).__name__ == "FineGrainedFP8Config" and config.dequantize
    assert list(config.weight_block_size) == [128, 128] and fp8.bytes_per_parameter == (8 + 32 / 128**2) / 8

    plain = Quantization.of({"model_type": "qwen3"})
    assert plain.method is None and plain.load_kwargs("cpu", torch.float32) == {} and plain.path("cpu", torch.float32) == "float"


def test_unknown_method_is_refused_in_one_line(tmp_path):
    model = _deepseek()
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(OpdError) as refused:
        load_target(str(tmp_path), dtype=torch.float32, layer_ids=[0])
    message = str(refused.value)
    assert "\n" not in message and "quantization_config.quant_method 'gptq'" in message
    assert "mxfp4, fp8" in message and str(tmp_path) in message
