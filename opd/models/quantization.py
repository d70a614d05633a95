"""How a target checkpoint's published quantization is loaded.

Large published targets ship quantized: gpt-oss stores its MoE experts in MXFP4, DeepSeek-V3, Kimi K2 and GLM
store their Linear weights in block-scaled FP8. transformers reads both. On a device with the hardware kernel it
keeps the weights quantized; elsewhere (this CPU, an older GPU) we ask it to dequantize while loading, to the
compute dtype, so the target runs the same code as a float checkpoint.

The writers below (`mxfp4_pack`, `fp8_block_pack`, `quantize_state_dict`) write a float state dict as the
published checkpoints lay it out, so tests can build a miniature quantized target and check that loading it gives
transformers' own dequantization of what was written.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from opd.errors import OpdError

MXFP4 = "mxfp4"
FP8 = "fp8"
METHODS = (MXFP4, FP8)

MXFP4_BLOCK = 32  # values sharing one E8M0 scale
E8M0_BIAS = 127
FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # the magnitudes of codes 0..7; code | 8 is the negative
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
DEFAULT_FP8_BLOCK = (128, 128)
GPT_OSS_EXPERTS = ("gate_up_proj", "down_proj")


@dataclass(frozen=True)
class Quantization:
    """A checkpoint's published quantization: its method (None for a float checkpoint) and published fields."""

    method: str | None
    fields: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, config: dict[str, Any], where: str = "config.json") -> Quantization:
        """Read from a config.json dict; `quantization_config` sits at the top or, in a multimodal checkpoint,
        under `text_config`. An unknown method is refused here, before transformers' longer error."""
        nested = config.get("text_config")
        fields = config.get("quantization_config") or (nested or {}).get("quantization_config")
        if not fields:
            return cls(None)
        method = fields.get("quant_method")
        if method not in METHODS:
            raise OpdError(f"{where} quantization_config.quant_method {method!r}: expected one of "
                           f"{', '.join(METHODS)} (or no quantization_config)")
        return cls(method, {k: v for k, v in fields.items() if k != "quant_method"})

    @property
    def block(self) -> tuple[int, int]:
        """FP8's weight block [rows, cols]; DeepSeek-V3's default where a checkpoint names none."""
        block = self.fields.get("weight_block_size") or DEFAULT_FP8_BLOCK
        return int(block[0]), int(block[1])

    @property
    def bits(self) -> float:
        """Published bits per quantized weight, scales included (a memory projection counts these): MXFP4 is
        4 bits plus one 8-bit scale per 32 values; FP8 is 8 bits plus one float32 scale per block."""
        if self.method == MXFP4:
            return 4 + 8 / MXFP4_BLOCK
        if self.method == FP8:
            rows, cols = self.block
            return 8 + 32 / (rows * cols)
        return 0.0

    @property
    def bytes_per_parameter(self) -> float:
        """`bits` in bytes: 0.53125 for MXFP4, just over 1 for FP8; 0.0 for a float checkpoint."""
        return self.bits / 8

    def kernel(self, device: str) -> bool:
        """Whether transformers would run the quantized weights on `device` with its kernel: MXFP4 on CUDA of
        compute capability >= 7.5 with triton >= 3.4 and the `kernels` package; FP8 on CUDA of capability >= 8.9.
        Everywhere else it dequantizes (and warns); we ask for that outright, in the compute dtype."""
        if self.method is None or torch.device(device).type != "cuda" or not torch.cuda.is_available():
            return False
        capability = torch.cuda.get_device_capability()
        if self.method == FP8:
            return capability >= (8, 9)
        from transformers.utils import is_kernels_available, is_triton_available

        return capability >= (7, 5) and is_triton_available("3.4.0") and is_kernels_available()

    def path(self, device: str, dtype: torch.dtype) -> str:
        """How the weights run, for docs and the log line: "float", "<method> kernel" or "<method> dequantized to
        <dtype>"."""
        if self.method is None:
            return "float"
        if self.kernel(device):
            return f"{self.method} kernel"
        return f"{self.method} dequantized to {str(dtype).removeprefix('torch.')}"

    def check_dequantizable(self, shapes: dict[str, tuple[int, ...]], device: str, where: str) -> None:
        """Refuse, before loading, an FP8 weight transformers (5.24) would dequantize wrongly: its `Fp8Dequantize`
        takes a block's height as rows // scale rows, not the published block, so a weight of more than one block
        whose rows or columns are no multiple of it (DeepSeek-V3's and Kimi K2's 576-row `kv_a_proj_with_mqa`)
        comes out wrong or fails with a traceback. The kernel path reads the blocks as published."""
        if self.method != FP8 or self.kernel(device):
            return
        rows, cols = self.block
        for name in shapes:
            if name.endswith(".weight_scale_inv"):
                weight = shapes.get(name[: -len("_scale_inv")], ())
                if len(weight) == 2 and any(d > b and d % b for d, b in zip(weight, (rows, cols), strict=True)):
                    raise OpdError(f"{where}: FP8 weight {name[: -len('_scale_inv')]} is {weight[0]} x {weight[1]}, "
                                   f"in partial {rows} x {cols} blocks, which transformers dequantizes wrongly "
                                   "off the FP8 kernel (expected a GPU of compute capability 8.9 or more, e.g. an H200)")

    def load_kwargs(self, device: str, dtype: torch.dtype) -> dict[str, Any]:
        """The extra `from_pretrained` kwargs: none where the kernel runs (or for a float checkpoint); else the
        published config with `dequantize=True`, so the weights load in `dtype` (the parameters' dtype)."""
        if self.method is None or self.kernel(device):
            return {}
        from transformers import FineGrainedFP8Config, Mxfp4Config

        config_class = Mxfp4Config if self.method == MXFP4 else FineGrainedFP8Config
        return {"quantization_config": config_class.from_dict({**self.fields, "dequantize": True})}


# -- writers (as published) ------------------------------------------------------------------------------------


def mxfp4_pack(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A gpt-oss expert weight in transformers' layout [E, in, out] as published: (blocks [E, out, in/32, 16]
    uint8, two FP4 e2m1 codes per byte, the even value in the low nibble; scales [E, out, in/32] uint8, E8M0
    exponents biased by 127). Each block's exponent is the smallest that fits its largest value in ±6 (nothing
    clips); each value rounds to the nearest FP4 value, so the error is at most one scale unit (half the 4..6 gap)."""
    rows = weight.transpose(1, 2).float()
    *prefix, width = rows.shape
    if width % MXFP4_BLOCK:
        raise OpdError(f"mxfp4 weight of shape {list(weight.shape)}: its input dim must be a multiple of 32")
    blocked = rows.reshape(*prefix, width // MXFP4_BLOCK, MXFP4_BLOCK)
    largest = blocked.abs().amax(-1)
    exponent = torch.ceil(torch.log2(largest / FP4_E2M1[-1])).clamp(-E8M0_BIAS, E8M0_BIAS)
    exponent = torch.where(largest > 0, exponent, torch.full_like(exponent, -E8M0_BIAS))
    scaled = blocked / torch.exp2(exponent)[..., None]
    magnitudes = torch.tensor(FP4_E2M1)
    codes = (scaled.abs()[..., None] - magnitudes).abs().argmin(-1).to(torch.uint8)
    codes |= (scaled < 0).to(torch.uint8) << 3
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponent + E8M0_BIAS).to(torch.uint8)


def fp8_block_pack(weight: torch.Tensor,
                   block: tuple[int, int] = DEFAULT_FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """A Linear weight [out, in] as DeepSeek-V3 publishes it: (weight in float8_e4m3fn, weight_scale_inv float32
    [ceil(out/rows), ceil(in/cols)]), each block scaled so its largest value is 448; a value is weight × its
    block's weight_scale_inv, within e4m3's rounding (3 mantissa bits: a relative error of at most 2^-4)."""
    out_dim, in_dim = weight.shape
    rows, cols = block
    grid = (math.ceil(out_dim / rows), math.ceil(in_dim / cols))
    padded = torch.zeros(grid[0] * rows, grid[1] * cols)
    padded[:out_dim, :in_dim] = weight.float()
    tiles = padded.reshape(grid[0], rows, grid[1], cols)
    largest = tiles.abs().amax(dim=(1, 3))
    scale_inv = torch.where(largest > 0, largest / FP8_MAX, torch.ones_like(largest))
    quantized = (tiles / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return quantized.reshape(padded.shape)[:out_dim, :in_dim].contiguous(), scale_inv


def quantize_state_dict(state_dict: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A float state dict in checkpoint names (what `save_pretrained` writes) renamed and quantized as the
    published checkpoint of `config`'s quantization stores it; other tensors pass through unchanged."""
    quantization = Quantization.of(config)
    if quantization.method == MXFP4:
        return _mxfp4_state_dict(state_dict, quantization.fields.get("modules_to_not_convert"))
    if quantization.method == FP8:
        return _fp8_state_dict(state_dict, config, quantization)
    return dict(state_dict)


def _mxfp4_state_dict(state_dict: dict[str, torch.Tensor], skip: list[str] | None) -> dict[str, torch.Tensor]:
    """gpt-oss: each `*.mlp.experts.{gate_up_proj,down_proj}` that transformers would convert becomes
    `*_blocks` and `*_scales`; its bias stays as is."""
    from transformers.quantizers.quantizers_utils import should_convert_module

    written: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        module, _, leaf = name.rpartition(".")
        if leaf in GPT_OSS_EXPERTS and module.endswith(".experts") and should_convert_module(module, skip):
            written[f"{name}_blocks"], written[f"{name}_scales"] = mxfp4_pack(tensor)
        else:
            written[name] = tensor
    return written


def _fp8_state_dict(state_dict: dict[str, torch.Tensor], config: dict[str, Any],
                    quantization: Quantization) -> dict[str, torch.Tensor]:
    """Every `*.weight` of a module transformers' FP8 integration converts (a plain Linear or an `*.experts`
    module, less the skipped ones) becomes `weight` + `weight_scale_inv`. A per-expert checkpoint name
    (`experts.3.gate_proj`) belongs to the deepest module the model has (`experts`)."""
    converted = _fp8_converted_modules(config, quantization.fields.get("modules_to_not_convert"))
    written: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        module = name.removesuffix(".weight")
        owner = next((m for m in _ancestors(module) if m in converted), None) if name.endswith(".weight") else None
        if owner is None or tensor.dim() != 2:
            written[name] = tensor
            continue
        written[name], written[f"{module}.weight_scale_inv"] = fp8_block_pack(tensor, quantization.block)
    return written


def _ancestors(module: str) -> list[str]:
    """`a.b.c`, `a.b`, `a`: the module and the modules holding it, deepest first."""
    parts = module.split(".")
    return [".".join(parts[:n]) for n in range(len(parts), 0, -1)]


def _fp8_converted_modules(config: dict[str, Any], skip: list[str] | None) -> set[str]:
    """The modules `replace_with_fp8_linear` would swap for FP8 ones in this config's model, on the meta device
    (no weights made): transformers' own skip rules, with lm_head and tied modules skipped when no list is given."""
    from torch import nn
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.quantizers.base import HfQuantizer
    from transformers.quantizers.quantizers_utils import should_convert_module

    fields = {k: v for k, v in config.items() if k not in ("quantization_config", "model_type")}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(config["model_type"], **fields))
    skipped = HfQuantizer.get_modules_to_not_convert(model, skip, model._keep_in_fp32_modules)
    return {name for name, module in model.named_modules()
            if should_convert_module(name, skipped) and (type(module) is nn.Linear or name.endswith(".experts"))}
