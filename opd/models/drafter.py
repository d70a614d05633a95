"""The DFlash drafter: a few Qwen3-style decoder layers that draft a whole block of tokens in one forward.

How it works (DFlash, arXiv 2602.06036; public code z-lab/dflash):

* Context. The target's hidden states at `target_layer_ids` are concatenated ([T, n*H]), fused by
  `fc: Linear(n*H -> H)` and `hidden_norm`, and injected into *every* drafter layer as extra keys/values.
  Context positions get no query, no output projection, no MLP and no residual: they are only attended to.
* Block. `[anchor, MASK x (K-1)]` at positions anchor..anchor+K-1 is embedded with the target's embedding,
  attends bidirectionally to itself and to every context position strictly before the anchor, and the final
  hidden states at block positions 1..K-1 go through the target's LM head: K-1 draft tokens per forward.
* The drafter owns no embedding and no LM head; it borrows the target's (frozen) ones by reference, so they are
  neither parameters nor checkpoint tensors of the drafter.

The checkpoint layout (config.json + model.safetensors, tensor names without a `model.` prefix) is the public
one, so drafters trained here load in vLLM/SGLang (`method: dflash`) and public drafters load here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from opd.errors import OpdError
from opd.models.target import Target
from opd.spec import default_target_layer_ids

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
ARCHITECTURE = "DFlashDraftModel"
# Tensors a checkpoint may carry but that we always take from the target.
SHARED_TENSOR_SUFFIXES = ("embed_tokens.weight", "lm_head.weight")


# ---------------------------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class DFlashConfig:
    """Drafter hyper-parameters; `to_hf_dict`/`from_hf_dict` speak the public DFlash config.json layout."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int
    max_position_embeddings: int
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    num_target_layers: int
    attention_bias: bool = False

    @classmethod
    def for_target(
        cls,
        target_hf_config: Any,
        num_layers: int,
        block_size: int,
        mask_token_id: int,
        target_layer_ids: list[int] | None = None,
    ) -> DFlashConfig:
        """A drafter as wide as the target (DFlash copies the target's attention and MLP shapes)."""
        hf = target_hf_config.to_dict()
        _check_activation(hf)
        num_target_layers = int(hf["num_hidden_layers"])
        if target_layer_ids is None:
            target_layer_ids = default_target_layer_ids(num_target_layers, num_layers)
        return cls(
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_hidden_layers=int(num_layers),
            num_attention_heads=int(hf["num_attention_heads"]),
            num_key_value_heads=int(hf.get("num_key_value_heads") or hf["num_attention_heads"]),
            head_dim=int(hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]),
            rms_norm_eps=float(hf["rms_norm_eps"]),
            rope_theta=_rope_theta(hf),
            vocab_size=int(hf["vocab_size"]),
            max_position_embeddings=int(hf["max_position_embeddings"]),
            block_size=int(block_size),
            mask_token_id=int(mask_token_id),
            target_layer_ids=[int(i) for i in target_layer_ids],
            num_target_layers=num_target_layers,
            attention_bias=bool(hf.get("attention_bias", False)),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """The public config.json: Qwen3 fields plus `block_size`, `num_target_layers` and `dflash_config`.

        RoPE is written both the transformers-4 way (`rope_theta`) and the transformers-5 way
        (`rope_parameters`) so either generation of loaders reads it.
        """
        return {
            "architectures": [ARCHITECTURE],
            "model_type": "qwen3",
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "block_size": self.block_size,
            "dflash_config": {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)},
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "layer_types": ["full_attention"] * self.num_hidden_layers,
            "max_position_embeddings": self.max_position_embeddings,
            "num_attention_heads": self.num_attention_heads,
            "num_hidden_layers": self.num_hidden_layers,
            "num_key_value_heads": self.num_key_value_heads,
            "num_target_layers": self.num_target_layers,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": False,
            "vocab_size": self.vocab_size,
        }

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> DFlashConfig:
        """Read a public DFlash config.json; a missing or malformed field raises OpdError naming it.

        `block_size` may sit at the top level (Qwen3 DFlash checkpoints) or in `dflash_config` (newer ones);
        without `dflash_config.target_layer_ids` the public default rule applies, as in the public code.
        """
        _check_activation(hf)
        dflash = hf.get("dflash_config") or {}
        if not isinstance(dflash, dict):
            raise OpdError("config field 'dflash_config' must be an object")
        _check_variant(hf, dflash)
        num_hidden_layers = _int_field(hf, "num_hidden_layers")
        _check_full_attention(hf, num_hidden_layers)
        num_target_layers = _int_field(hf if "num_target_layers" in hf else dflash, "num_target_layers")
        block_size = hf.get("block_size", dflash.get("block_size"))
        if block_size is None:
            raise OpdError("config field 'block_size' is missing")
        layer_ids = dflash.get("target_layer_ids")
        if layer_ids is None:
            layer_ids = default_target_layer_ids(num_target_layers, num_hidden_layers)
        if not isinstance(layer_ids, list) or not all(isinstance(i, int) for i in layer_ids):
            raise OpdError("config field 'dflash_config.target_layer_ids' must be a list of integers")
        num_heads = _int_field(hf, "num_attention_heads")
        hidden_size = _int_field(hf, "hidden_size")
        return cls(
            hidden_size=hidden_size,
            intermediate_size=_int_field(hf, "intermediate_size"),
            num_hidden_layers=num_hidden_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(hf.get("head_dim") or hidden_size // num_heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(hf),
            vocab_size=_int_field(hf, "vocab_size"),
            max_position_embeddings=_int_field(hf, "max_position_embeddings"),
            block_size=int(block_size),
            mask_token_id=_int_field(dflash, "mask_token_id", prefix="dflash_config."),
            target_layer_ids=list(layer_ids),
            num_target_layers=num_target_layers,
            attention_bias=bool(hf.get("attention_bias", False)),
        )


# `dflash_config` keys of the model implemented here; others (selector_*, conv_*, projector_type,
# final_logit_softcapping, input_embedding_scale, ...) belong to other DFlash variants and change the forward.
DFLASH_KEYS = frozenset({"block_size", "mask_token_id", "target_layer_ids", "num_target_layers", "causal"})
QWEN3_MAX_WINDOW_LAYERS = 28  # Qwen3Config's default, used when a config enables sliding windows without it


def _check_variant(hf: dict[str, Any], dflash: dict[str, Any]) -> None:
    """Refuse DFlash variants this drafter does not implement; loading them would draft wrongly, silently."""
    unknown = sorted(set(dflash) - DFLASH_KEYS)
    if unknown:
        raise OpdError(f"config field 'dflash_config.{unknown[0]}' belongs to a DFlash variant this drafter does not "
                       f"implement (supported keys: {', '.join(sorted(DFLASH_KEYS))})")
    for name, value in (("is_causal", hf.get("is_causal")), ("dflash_config.causal", dflash.get("causal"))):
        if value:
            raise OpdError(f"config field '{name}' is {value!r}; only block-bidirectional DFlash drafters are "
                           "supported (expected false or absent)")


def _check_full_attention(hf: dict[str, Any], num_layers: int) -> None:
    """Every layer must be full attention: a sliding layer runs causal with a window in the public code, which
    the block mask here does not do. Layer types are read as transformers derives them for Qwen3."""
    types = hf.get("layer_types")
    if types is None:
        window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
        first = hf.get("max_window_layers", QWEN3_MAX_WINDOW_LAYERS)
        types = ["sliding_attention" if window is not None and i >= first else "full_attention"
                 for i in range(num_layers)]
        field = f"use_sliding_window (sliding_window {window}, max_window_layers {first})"
    else:
        field = "layer_types"
    if not isinstance(types, list) or len(types) != num_layers:
        raise OpdError(f"config field 'layer_types' must list {num_layers} layer types, got {types!r}")
    bad = [(i, t) for i, t in enumerate(types) if t != "full_attention"]
    if bad:
        raise OpdError(f"config field '{field}' makes layer {bad[0][0]} {bad[0][1]!r}; only 'full_attention' "
                       "DFlash drafters are supported (sliding-window layers would run without their causal window)")


def check_vllm_capturable(config: DFlashConfig) -> None:
    """vLLM's DFlash path captures layer i's output as the input of layer i + 1, so it cannot capture the
    target's last layer; such a drafter trains and drafts here (we read the final norm) but not in vLLM."""
    last = config.num_target_layers - 1
    if last in config.target_layer_ids:
        raise OpdError(f"dflash_config.target_layer_ids {config.target_layer_ids} include {last}, the target's last "
                       f"layer, which vLLM's DFlash path cannot capture (expected ids below {last})")


def _int_field(d: dict[str, Any], name: str, prefix: str = "") -> int:
    value = d.get(name)
    if not isinstance(value, int) or isinstance(value, bool):
        raise OpdError(f"config field '{prefix}{name}' must be an integer, got {value!r}")
    return value


def _rope_theta(hf: dict[str, Any]) -> float:
    """RoPE base from either config generation; only plain (unscaled) RoPE is implemented."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise OpdError(f"config field 'rope_parameters.rope_type' is {rope_type!r}; only 'default' is supported")
    theta = params.get("rope_theta", hf.get("rope_theta"))
    if theta is None:
        raise OpdError("config field 'rope_theta' is missing")
    return float(theta)


def _check_activation(hf: dict[str, Any]) -> None:
    if hf.get("hidden_act", "silu") != "silu":
        raise OpdError(f"config field 'hidden_act' is {hf['hidden_act']!r}; the DFlash drafter uses 'silu'")


# ---------------------------------------------------------------------------------------------------------------
# Building blocks (Qwen3 layout, so tensor names match the public checkpoints)
# ---------------------------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """Qwen3 RMSNorm; computed in at least float32 (float64 stays float64 so tests can be exact)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.to(torch.promote_types(x.dtype, torch.float32))
        wide = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * wide.to(x.dtype)


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [B,T,head_dim] for integer positions [B,T] (computed in float32, like HF, or float64)."""
    compute = torch.promote_types(dtype, torch.float32)
    exponents = torch.arange(0, head_dim, 2, device=positions.device).to(compute) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    angles = positions.to(compute)[..., None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B,heads,T,d] by the half-split (NeoX) convention Qwen3 uses."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


class DFlashMLP(nn.Module):
    """SwiGLU feed-forward, as in Qwen3."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashAttention(nn.Module):
    """Qwen3 attention whose keys/values are [context; block] and whose queries are the block only."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def _heads(self, x: torch.Tensor, num_heads: int) -> torch.Tensor:
        """[B,T,heads*d] -> [B,heads,T,d]."""
        return x.view(*x.shape[:2], num_heads, self.head_dim).transpose(1, 2)

    def project_kv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated keys and values [B,kv_heads,T,d]; the same projection serves context and block."""
        k = apply_rope(self.k_norm(self._heads(self.k_proj(x), self.num_kv_heads)), cos, sin)
        return k, self._heads(self.v_proj(x), self.num_kv_heads)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        context_kv: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """x: block hidden [B,S,H]; mask: bool [B,1,S,C+S] over keys [context (C); block (S)]."""
        q = apply_rope(self.q_norm(self._heads(self.q_proj(x), self.num_heads)), cos, sin)
        k, v = self.project_kv(x, cos, sin)
        k = torch.cat([context_kv[0], k], dim=2)
        v = torch.cat([context_kv[1], v], dim=2)
        groups = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.head_dim**-0.5)
        return self.o_proj(out.transpose(1, 2).reshape(*x.shape[:2], self.num_heads * self.head_dim))


class DFlashDecoderLayer(nn.Module):
    """Pre-norm Qwen3 decoder layer; only block positions flow through it, context is just attended to."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(config)
        self.mlp = DFlashMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        context_kv: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor,
    ) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, context_kv, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


# ---------------------------------------------------------------------------------------------------------------
# Inference-time context cache
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class DrafterCache:
    """Projected context K/V per drafter layer ([B,kv_heads,L,d]) with each entry's position and validity.

    Rows of a batch advance at different speeds (ragged acceptance), so entries carry their own position and a
    `valid` flag instead of assuming a dense prefix: a hole is simply an entry nobody can attend to.
    Block K/V are never stored; only target-verified context is.

    `filled` is None for a cache that grows by concatenation. A preallocated cache (`new_cache(capacity=...)`)
    has fixed-shape tensors and `filled` counts the entries written; the rest are invalid, so attending over the
    whole capacity equals attending over the written prefix, and every draft sees the same tensor shapes (what
    CUDA graphs and torch.compile need).
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    positions: torch.Tensor
    valid: torch.Tensor
    filled: int | None = None

    @property
    def length(self) -> int:
        return self.positions.shape[1] if self.filled is None else self.filled

    def crop(self, length: int) -> None:
        """Drop every entry at index >= length (e.g. context that the next verification replaces)."""
        if self.filled is not None:  # keep the shapes: forgetting the entries is enough
            self.valid[:, length:] = False
            self.filled = min(self.filled, length)
            return
        self.keys = [k[:, :, :length] for k in self.keys]
        self.values = [v[:, :, :length] for v in self.values]
        self.positions = self.positions[:, :length]
        self.valid = self.valid[:, :length]

    def select(self, rows: torch.Tensor) -> None:
        """Keep only these batch rows (finished sequences leave the batch)."""
        self.keys = [k[rows] for k in self.keys]
        self.values = [v[rows] for v in self.values]
        self.positions = self.positions[rows]
        self.valid = self.valid[rows]


# ---------------------------------------------------------------------------------------------------------------
# The drafter
# ---------------------------------------------------------------------------------------------------------------


class DFlashDrafter(nn.Module):
    """DFlash block drafter sharing the target's embedding and LM head (by reference, not as submodules)."""

    def __init__(self, config: DFlashConfig, embed_tokens: nn.Embedding, lm_head: nn.Linear) -> None:
        super().__init__()
        if embed_tokens.weight.shape != (config.vocab_size, config.hidden_size):
            raise ValueError(f"embed_tokens {tuple(embed_tokens.weight.shape)} does not fit the drafter config")
        self.config = config
        # A tuple is not registered by nn.Module: the shared modules stay out of parameters() and state_dict().
        self._shared = (embed_tokens, lm_head)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.fc = nn.Linear(len(config.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self._init_weights()
        self.to(device=embed_tokens.weight.device, dtype=embed_tokens.weight.dtype)

    def _init_weights(self, std: float = 0.02) -> None:
        """HF's Qwen3 initialisation (normal(0, 0.02) weights, zero biases), so fresh drafters train alike."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self._shared[0]

    @property
    def lm_head(self) -> nn.Linear:
        return self._shared[1]

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    # -- shared pieces -----------------------------------------------------------------------------------------

    def project_context(self, target_features: torch.Tensor) -> torch.Tensor:
        """Fuse concatenated target features [B,T,n*H] into one context stream [B,T,H]."""
        return self.hidden_norm(self.fc(target_features))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Token logits from final (already normed) drafter hidden states."""
        return self.lm_head(hidden)

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, self.fc.weight.dtype)

    def _context_kv(self, context: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's own K/V projection of the one shared context stream."""
        cos, sin = self._rope(positions)
        return [layer.self_attn.project_kv(context, cos, sin) for layer in self.layers]

    def _run_blocks(
        self,
        block_ids: torch.Tensor,
        block_positions: torch.Tensor,
        context_kv: list[tuple[torch.Tensor, torch.Tensor]],
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """Block tokens [B,S] -> final normed hidden [B,S,H] through all layers."""
        cos, sin = self._rope(block_positions)
        h = self.embed_tokens(block_ids)
        for layer, kv in zip(self.layers, context_kv):
            h = layer(h, cos, sin, kv, mask)
        return self.norm(h)

    # -- training path: many blocks of one sequence in one forward -----------------------------------------------

    def forward_blocks(
        self,
        context: torch.Tensor,
        context_valid: torch.Tensor,
        block_ids: torch.Tensor,
        anchor_positions: torch.Tensor,
    ) -> torch.Tensor:
        """All M blocks per sequence in one forward; returns final normed hidden [B,M,K,H].

        context [B,T,H] is `project_context(features)` with context index == sequence position; block m
        (block_ids[b,m] = [anchor, MASK, ...]) sits at positions anchor_positions[b,m] + 0..K-1 and sees context
        positions p < anchor_positions[b,m] where context_valid, plus its own K positions. Blocks never see each
        other, so this equals M separate `draft` calls.
        """
        batch, num_blocks, block_size = block_ids.shape
        offsets = torch.arange(block_size, device=block_ids.device)
        block_positions = (anchor_positions[:, :, None] + offsets).reshape(batch, -1)
        context_positions = torch.arange(context.shape[1], device=context.device).expand(batch, -1)
        mask = _block_mask(context_positions, context_valid, anchor_positions, block_size)
        hidden = self._run_blocks(
            block_ids.reshape(batch, -1), block_positions, self._context_kv(context, context_positions), mask
        )
        return hidden.view(batch, num_blocks, block_size, hidden.shape[-1])

    # The training path is what DDP/DeepSpeed wrappers call.
    forward = forward_blocks

    # -- inference path: cached context, one block per sequence --------------------------------------------------

    def new_cache(self, batch_size: int, capacity: int | None = None) -> DrafterCache:
        """An empty context cache on the drafter's device and dtype; with `capacity`, preallocated to that many
        entries (fixed shapes), else growing."""
        weight = self.fc.weight
        length = capacity or 0
        shape = (batch_size, self.config.num_key_value_heads, length, self.config.head_dim)
        return DrafterCache(
            keys=[weight.new_zeros(shape) for _ in self.layers],
            values=[weight.new_zeros(shape) for _ in self.layers],
            positions=torch.zeros(batch_size, length, dtype=torch.long, device=weight.device),
            valid=torch.zeros(batch_size, length, dtype=torch.bool, device=weight.device),
            filled=None if capacity is None else 0,
        )

    @torch.no_grad()
    def extend_cache(
        self, cache: DrafterCache, target_features: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor
    ) -> None:
        """Append projected context K/V for new target features [B,T,n*H] at `positions` [B,T] (in place).

        Entries with valid=False (padding, holes from ragged acceptance) stay masked out forever.
        """
        context_kv = self._context_kv(self.project_context(target_features), positions)
        if cache.filled is not None:
            _write(cache, context_kv, positions, valid)
            return
        cache.keys = [torch.cat([old, k], dim=2) for old, (k, _) in zip(cache.keys, context_kv)]
        cache.values = [torch.cat([old, v], dim=2) for old, (_, v) in zip(cache.values, context_kv)]
        cache.positions = torch.cat([cache.positions, positions], dim=1)
        cache.valid = torch.cat([cache.valid, valid.to(torch.bool)], dim=1)

    @torch.no_grad()
    def draft(
        self, cache: DrafterCache, anchor_ids: torch.Tensor, anchor_positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy K-1 draft tokens [B,K-1] and their logits [B,K-1,V] for one block per sequence.

        The block [anchor, MASK x (K-1)] at anchor_pos..anchor_pos+K-1 sees every valid cached entry with
        position < anchor_pos and itself; its own K/V are not added to the cache.
        """
        block_size = self.config.block_size
        offsets = torch.arange(block_size, device=anchor_ids.device)
        block_ids = torch.full(
            (anchor_ids.shape[0], block_size), self.config.mask_token_id, dtype=torch.long, device=anchor_ids.device
        )
        block_ids[:, 0] = anchor_ids
        block_positions = anchor_positions[:, None] + offsets
        mask = _block_mask(cache.positions, cache.valid, anchor_positions[:, None], block_size)
        hidden = self._run_blocks(block_ids, block_positions, list(zip(cache.keys, cache.values)), mask)
        logits = self.logits(hidden[:, 1:])
        return logits.argmax(dim=-1), logits

    # -- checkpoints ---------------------------------------------------------------------------------------------

    def save_pretrained(self, directory: str | Path) -> None:
        """Write config.json + model.safetensors in the public DFlash layout (no embedding, no LM head)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        hf = self.config.to_hf_dict()
        hf["dtype"] = str(self.fc.weight.dtype).removeprefix("torch.")
        (directory / CONFIG_FILE).write_text(json.dumps(hf, indent=2) + "\n")
        tensors = {name: t.detach().contiguous().cpu() for name, t in self.state_dict().items()}
        save_file(tensors, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})

    @classmethod
    def from_pretrained(cls, directory: str | Path, target: Target) -> DFlashDrafter:
        """Load a public-layout DFlash checkpoint for `target`; any mismatch raises a one-line OpdError."""
        directory = Path(directory)
        config = _read_config(directory / CONFIG_FILE, target)
        drafter = cls(config, target.embed_tokens, target.lm_head)
        tensors = _read_tensors(directory / WEIGHTS_FILE, drafter.state_dict())
        drafter.load_state_dict(tensors)
        return drafter


def _write(cache: DrafterCache, context_kv: list[tuple[torch.Tensor, torch.Tensor]], positions: torch.Tensor,
           valid: torch.Tensor) -> None:
    """Write new entries in place after the filled ones of a preallocated cache (its shapes never change)."""
    start, end = cache.filled, cache.filled + positions.shape[1]
    if end > cache.positions.shape[1]:
        raise ValueError(f"drafter cache capacity {cache.positions.shape[1]} exceeded ({end} entries)")
    for old_k, old_v, (k, v) in zip(cache.keys, cache.values, context_kv):
        old_k[:, :, start:end] = k
        old_v[:, :, start:end] = v
    cache.positions[:, start:end] = positions
    cache.valid[:, start:end] = valid.to(torch.bool)
    cache.filled = end


def _block_mask(
    context_positions: torch.Tensor, context_valid: torch.Tensor, anchor_positions: torch.Tensor, block_size: int
) -> torch.Tensor:
    """Bool mask [B,1,M*K,C+M*K]: block m sees valid context before its anchor and all of its own block.

    context_positions/valid: [B,C]; anchor_positions: [B,M].
    """
    batch, num_blocks = anchor_positions.shape
    sees_context = context_valid.bool()[:, None, :] & (context_positions[:, None, :] < anchor_positions[:, :, None])
    sees_context = sees_context.repeat_interleave(block_size, dim=1)
    block_of = torch.arange(num_blocks * block_size, device=anchor_positions.device) // block_size
    sees_block = (block_of[:, None] == block_of[None, :]).expand(batch, -1, -1)
    return torch.cat([sees_context, sees_block], dim=-1)[:, None]


def _read_config(path: Path, target: Target) -> DFlashConfig:
    """Parse config.json and check it describes a drafter for this very target."""
    if not path.is_file():
        raise OpdError(f"{path}: drafter config not found")
    try:
        config = DFlashConfig.from_hf_dict(json.loads(path.read_text()))
    except json.JSONDecodeError as exc:
        raise OpdError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from exc
    except OpdError as exc:
        raise OpdError(f"{path}: {exc}") from exc
    expected = {
        "hidden_size": target.hidden_size,
        "vocab_size": target.vocab_size,
        "num_target_layers": target.num_layers,
    }
    for name, value in expected.items():
        if getattr(config, name) != value:
            raise OpdError(f"{path}: {name} is {getattr(config, name)} but the target has {value}")
    bad = [i for i in config.target_layer_ids if not 0 <= i < config.num_target_layers]
    if bad or not config.target_layer_ids:
        raise OpdError(
            f"{path}: dflash_config.target_layer_ids {config.target_layer_ids} must be non-empty ids in "
            f"[0, {config.num_target_layers})"
        )
    if config.target_layer_ids != target.layer_ids:
        raise OpdError(
            f"{path}: dflash_config.target_layer_ids {config.target_layer_ids} differ from the target's layer_ids "
            f"{target.layer_ids}; load the target with the checkpoint's ids"
        )
    if config.block_size < 2:
        raise OpdError(f"{path}: block_size must be >= 2, got {config.block_size}")
    if not 0 <= config.mask_token_id < config.vocab_size:
        raise OpdError(f"{path}: dflash_config.mask_token_id {config.mask_token_id} is outside the vocabulary")
    return config


def _read_tensors(path: Path, expected: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Load model.safetensors, drop shared embedding/LM-head tensors, and check names and shapes exactly."""
    if not path.is_file():
        raise OpdError(f"{path}: drafter weights not found")
    try:
        loaded = load_file(str(path))
    except (SafetensorError, OSError) as exc:
        raise OpdError(f"{path}: unreadable safetensors file ({exc})") from exc
    tensors = {name: t for name, t in loaded.items() if not name.endswith(SHARED_TENSOR_SUFFIXES)}
    missing = sorted(expected.keys() - tensors.keys())
    if missing:
        raise OpdError(f"{path}: missing tensor(s) {', '.join(missing[:5])}" + (" ..." if len(missing) > 5 else ""))
    unexpected = sorted(tensors.keys() - expected.keys())
    if unexpected:
        raise OpdError(
            f"{path}: unexpected tensor(s) {', '.join(unexpected[:5])}" + (" ..." if len(unexpected) > 5 else "")
        )
    for name, want in expected.items():
        if tuple(tensors[name].shape) != tuple(want.shape):
            raise OpdError(
                f"{path}: tensor {name} has shape {list(tensors[name].shape)}, expected {list(want.shape)}"
            )
    return {name: t.to(dtype=expected[name].dtype) for name, t in tensors.items()}
