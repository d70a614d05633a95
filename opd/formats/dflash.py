"""The public DFlash checkpoint format: `config.json` <-> `DFlashConfig`, and `model.safetensors` checks.

A drafter directory holds config.json (Qwen3 fields plus `block_size`, `num_target_layers` and `dflash_config`)
and model.safetensors (tensor names without a `model.` prefix, no embedding and no LM head: those are the
target's). It is the layout of the public DFlash drafters (z-lab/dflash), so drafters trained here load in
vLLM/SGLang (`method: dflash`) and z-lab's `DFlashDraftModel`, and public drafters load here.

Every variant z-lab's `DFlashDraftModel` (dflash 0.1.0) runs is read with its meaning there: per-layer
`sliding_attention` with `sliding_window` (Qwen3Config keeps the window only under `use_sliding_window`), the
top-level `is_causal`, and the scalars `input_embedding_scale`, `output_multiplier` and `final_logit_softcapping`;
like z-lab's `_draft_value`, a DFlash value is read from `dflash_config` first, then the top level. RoPE is read as
transformers 5 configs carry it (`rope_parameters`, or the older `rope_scaling` and `rope_theta`): any type whose
frequencies are fixed when the model is built (default, linear, YaRN, llama3, proportional), flat or per layer type,
and the drafter takes its tables from transformers' own RoPE initialisation (opd/models/dflash.py). Anything else
(other `dflash_config` keys, DFlash 2's among them, RoPE that rescales with the sequence length) is refused with a
one-line OpdError naming the field: loading it would draft wrongly, silently. The variants with a format of their
own build on this one: DFlash 2 (opd/formats/dflash2.py) and DSpark (opd/formats/dspark.py).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import Field

from opd.errors import OpdError
from opd.formats.checkpoint import (
    CONFIG_FILE,
    NO_ROPE_BASE,
    TargetShape,
    int_field,
    load_weights,
    missing_fresh_fields,
    write_layout,
)
from opd.formats.layer_attention import LayerAttention
from opd.formats.section import DrafterSection, drafter_section
from opd.formats.speculators import MODEL_TYPE, backbone_public, dflash_speculators, is_speculators, model_type
from opd.model_dir import ModelDir

if TYPE_CHECKING:  # torch and safetensors load inside the functions that read or write tensors, so validating
    import torch  # a spec (which reads the sections here) stays light

ARCHITECTURE = "DFlashDraftModel"
KIND = "dflash"
FULL, SLIDING = "full_attention", "sliding_attention"
# Tensors a checkpoint may carry but that we always take from the target.
SHARED_TENSOR_SUFFIXES = ("embed_tokens.weight", "lm_head.weight")
# DFlash 2's codebooks as z-lab's `save_pretrained` names them (its nn.Embedding's) -> as published and saved here
CODEBOOK_NAMES = {f"candidate_selector.{book}_codebook.weight": f"candidate_selector.{book}_codebook"
                  for book in ("predecessor", "successor")}


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """DFlash's default feature layers: spread from layer 1 to L-3 (n = 1: the middle), as public drafters use.

    Python's round (half to even) on purpose: the public code does the same, so ids match bit for bit.
    """
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


# ---------------------------------------------------------------------------------------------------------------
# Spec sections (`models.drafter`)
# ---------------------------------------------------------------------------------------------------------------


@drafter_section
class DFlashSpec(DrafterSection):
    """kind dflash: a block of K-1 drafts per forward (DFlash, z-lab's `DFlashDraftModel`); must match a warm
    drafter's checkpoint when one is given."""

    kind: Literal["dflash"] = "dflash"
    num_layers: int = Field(5, ge=1, description="decoder layers (the paper's 5)")
    mask_token_id: int | None = Field(None, ge=0, description="None = the tokenizer's mask token")

    style: ClassVar[str] = "DFlash"

    @classmethod
    def detects(cls, config: dict[str, Any]) -> bool:
        return ("DFlash" in " ".join(config.get("architectures") or []) or "dflash_config" in config
                or model_type(config) == KIND)

    def default_layer_ids(self, target_num_layers: int) -> list[int]:
        return default_target_layer_ids(target_num_layers, self.num_layers)

    def checkpoint_fields(self, config: dict[str, Any], layer_ids: list[int] | None) -> dict[str, tuple[Any, Any]]:
        if is_speculators(config):
            config = dflash_public(config, None)
        dflash = config.get("dflash_config") or {}  # read first, then the top level, as z-lab's code does
        return {"block_size": (self.block_size, dflash.get("block_size", config.get("block_size"))),
                "num_layers": (self.num_layers, config.get("num_hidden_layers")),
                "target_layer_ids": (layer_ids, dflash.get("target_layer_ids", config.get("target_layer_ids"))),
                "mask_token_id": (self.mask_token_id, dflash.get("mask_token_id", config.get("mask_token_id")))}


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
    rope_parameters: dict[str, Any]  # flat (every layer), or per drafter layer type: {layer_type: parameters}
    vocab_size: int
    max_position_embeddings: int
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    num_target_layers: int
    attention_bias: bool = False
    layer_types: list[str] = field(default_factory=list)  # empty: every layer full attention
    sliding_window: int | None = None  # in force (None unless the config's use_sliding_window)
    is_causal: bool | None = None  # top-level: every layer's causality; None: sliding layers causal, others not
    input_embedding_scale: float | None = None  # on the block tokens' embeddings
    output_multiplier: float | None = None  # on the drafter's logits, then
    final_logit_softcapping: float | None = None  # cap · tanh(logits / cap) when > 0

    def __post_init__(self) -> None:
        if not self.layer_types:
            self.layer_types = [FULL] * self.num_hidden_layers

    @property
    def rope_theta(self) -> float:
        """The RoPE base of a flat configuration (what a plain Qwen3 rotary table needs)."""
        return float(self.rope_parameters["rope_theta"])

    def rope_of(self, layer: int) -> dict[str, Any]:
        """Layer `layer`'s RoPE parameters (its type's entry when they are given per layer type)."""
        kind = self.layer_types[layer]
        return self.rope_parameters[kind] if kind in self.rope_parameters else self.rope_parameters

    def layer_attention(self, layer: int) -> LayerAttention:
        """Layer `layer`'s rule, as z-lab's `Qwen3DFlashAttention` derives it."""
        sliding = self.layer_types[layer] == SLIDING
        causal = sliding if self.is_causal is None else self.is_causal
        return LayerAttention(causal=causal, window=self.sliding_window if sliding else None)

    @classmethod
    def for_target(
        cls,
        target_hf_config: Any,
        num_layers: int,
        block_size: int,
        mask_token_id: int,
        target_layer_ids: list[int] | None = None,
        input_embedding_scale: float | None = None,
        rope_theta: float | None = None,
        max_position_embeddings: int | None = None,
        intermediate_size: int | None = None,
    ) -> DFlashConfig:
        """A drafter as wide as the target (DFlash copies the target's attention and MLP shapes), carrying what the
        public drafters of the target's family carry: the target's RoPE (its full-attention entry when the target
        gives RoPE per layer type), its final-logit softcapping and, as `input_embedding_scale`, the factor its own
        embedding scales rows by (`shared_head.embedding_scale`; Gemma's sqrt(hidden)). The drafter's MLP is
        SwiGLU whatever the target's activation, as in z-lab's drafters for Gemma."""
        text = target_hf_config.get_text_config(decoder=True) if hasattr(target_hf_config, "get_text_config") \
            else target_hf_config
        hf = text.to_dict()
        rope, positions, width = _fresh_fields(hf, rope_theta, max_position_embeddings, intermediate_size)
        num_target_layers = int_field(hf, "num_hidden_layers")
        if target_layer_ids is None:
            target_layer_ids = default_target_layer_ids(num_target_layers, num_layers)
        return cls(
            hidden_size=int_field(hf, "hidden_size"),
            intermediate_size=width,
            num_hidden_layers=int(num_layers),
            num_attention_heads=int(hf["num_attention_heads"]),
            num_key_value_heads=int(hf.get("num_key_value_heads") or hf["num_attention_heads"]),
            head_dim=int(hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]),
            rms_norm_eps=float(hf["rms_norm_eps"]),
            rope_parameters=rope,
            vocab_size=int(hf["vocab_size"]),
            max_position_embeddings=positions,
            block_size=int(block_size),
            mask_token_id=int(mask_token_id),
            target_layer_ids=[int(i) for i in target_layer_ids],
            num_target_layers=num_target_layers,
            attention_bias=bool(hf.get("attention_bias", False)),
            input_embedding_scale=input_embedding_scale,
            final_logit_softcapping=_scalar(hf, "final_logit_softcapping", ""),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """The public config.json: Qwen3 fields plus `block_size`, `num_target_layers` and `dflash_config`.

        RoPE is written the transformers-5 way (`rope_parameters`) and, when flat, also the transformers-4 way
        (`rope_theta`, with `rope_scaling` for a scaled type) so either generation of loaders reads it.
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
            "layer_types": list(self.layer_types),
            "max_position_embeddings": self.max_position_embeddings,
            "num_attention_heads": self.num_attention_heads,
            "num_hidden_layers": self.num_hidden_layers,
            "num_key_value_heads": self.num_key_value_heads,
            "num_target_layers": self.num_target_layers,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": json.loads(json.dumps(self.rope_parameters)),  # a deep copy: loaders fill it in
            "tie_word_embeddings": False,
            "vocab_size": self.vocab_size,
        } | self._rope_v4_fields() | self._variant_fields()

    def _rope_v4_fields(self) -> dict[str, Any]:
        """Flat RoPE as transformers 4 reads it; per-layer-type RoPE has no transformers-4 form."""
        if "rope_type" not in self.rope_parameters:
            return {}
        scaled = self.rope_parameters["rope_type"] != "default"
        return {"rope_theta": self.rope_theta} | ({"rope_scaling": dict(self.rope_parameters)} if scaled else {})

    def _variant_fields(self) -> dict[str, Any]:
        """The variant's fields, only where set, so a plain drafter's config.json is unchanged: the window with
        `use_sliding_window` (Qwen3Config drops it otherwise), `is_causal` at the top level (where z-lab reads
        it) and the scalars inside `dflash_config` (where z-lab looks first)."""
        out: dict[str, Any] = {}
        if self.sliding_window is not None:
            out |= {"use_sliding_window": True, "sliding_window": self.sliding_window}
        if self.is_causal is not None:
            out["is_causal"] = self.is_causal
        scalars = {name: getattr(self, name) for name in SCALAR_KEYS if getattr(self, name) is not None}
        if scalars:
            out["dflash_config"] = {"mask_token_id": self.mask_token_id,
                                    "target_layer_ids": list(self.target_layer_ids)} | scalars
        return out

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], num_target_layers: int | None = None) -> DFlashConfig:
        """Read a public DFlash config.json, or speculators' layout of one (for a target of `num_target_layers`,
        which that layout does not record); a missing or malformed field raises OpdError naming it.

        `block_size` may sit at the top level (Qwen3 DFlash checkpoints) or in `dflash_config` (newer ones);
        without `dflash_config.target_layer_ids` the public default rule applies, as in the public code.
        """
        if is_speculators(hf):
            hf = dflash_public(hf, num_target_layers)
        _check_architecture(hf)
        _check_activation(hf)
        dflash = hf.get("dflash_config") or {}
        if not isinstance(dflash, dict):
            raise OpdError("config field 'dflash_config' must be an object")
        _check_variant(hf, dflash)
        num_hidden_layers = int_field(hf, "num_hidden_layers")
        num_target_layers = int_field(*draft_value(hf, dflash, "num_target_layers"))
        block_size = int_field(*draft_value(hf, dflash, "block_size"))
        layer_ids = draft_value(hf, dflash, "target_layer_ids")[0].get("target_layer_ids")
        if layer_ids is None:
            layer_ids = default_target_layer_ids(num_target_layers, num_hidden_layers)
        if not isinstance(layer_ids, list) or not all(isinstance(i, int) for i in layer_ids):
            raise OpdError("config field 'dflash_config.target_layer_ids' must be a list of integers")
        num_heads = int_field(hf, "num_attention_heads")
        hidden_size = int_field(hf, "hidden_size")
        attention = _attention_fields(hf, num_hidden_layers)
        return cls(
            hidden_size=hidden_size,
            intermediate_size=int_field(hf, "intermediate_size"),
            num_hidden_layers=num_hidden_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(hf.get("head_dim") or hidden_size // num_heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_parameters=_rope_parameters(hf, attention["layer_types"]),
            vocab_size=int_field(hf, "vocab_size"),
            max_position_embeddings=int_field(hf, "max_position_embeddings"),
            block_size=block_size,
            mask_token_id=int_field(*draft_value(hf, dflash, "mask_token_id")),
            target_layer_ids=list(layer_ids),
            num_target_layers=num_target_layers,
            attention_bias=bool(hf.get("attention_bias", False)),
            **attention,
            **_scalars(hf, dflash),
        )

    def to_speculators_dict(self, verifier: str | None, verifier_architectures: list[str]) -> dict[str, Any]:
        """speculators' DFlash config.json (opd/formats/speculators.py), naming the verifier."""
        return dflash_speculators(self.to_hf_dict(), verifier, verifier_architectures, KIND)


# `dflash_config` keys z-lab's DFlashDraftModel and DFlash2DraftModel read (and `causal`, which they ignore:
# refused unless false); any other key changes the forward in a way not implemented here.
SCALAR_KEYS = ("input_embedding_scale", "output_multiplier", "final_logit_softcapping")
DFLASH_KEYS = frozenset({"block_size", "mask_token_id", "target_layer_ids", "num_target_layers", "causal",
                         *SCALAR_KEYS})
DFLASH_HOME = frozenset({"mask_token_id", "target_layer_ids", *SCALAR_KEYS})  # where exports write
QWEN3_MAX_WINDOW_LAYERS = 28  # Qwen3Config's default, used when a config enables sliding windows without it
QWEN3_SLIDING_WINDOW = 4096  # Qwen3Config's default window, in force when use_sliding_window comes without one


def draft_value(hf: dict[str, Any], dflash: dict[str, Any], name: str,
                home: frozenset[str] | set[str] = DFLASH_HOME) -> tuple[dict[str, Any], str, str]:
    """(the dict holding `name`, name, its field prefix): `dflash_config` first, then the top level, as z-lab's
    `_draft_value` reads; when neither has it, where the public exports put it (`home`: the keys written into
    `dflash_config`), so a missing field is named there."""
    if name in dflash or (name not in hf and name in home):
        return dflash, name, "dflash_config."
    return hf, name, ""


def _check_architecture(hf: dict[str, Any]) -> None:
    """Another drafter model's architecture is another family's format, which this reader would misread."""
    other = [a for a in hf.get("architectures") or [] if a.endswith("DraftModel") and a != ARCHITECTURE]
    if other:
        raise OpdError(f"config field 'architectures' names {other[0]}, another drafter family's model (expected "
                       f"{ARCHITECTURE}; load the directory as its own family)")


def _check_variant(hf: dict[str, Any], dflash: dict[str, Any]) -> None:
    """Refuse DFlash variants this drafter does not implement; loading them would draft wrongly, silently."""
    unknown = sorted(set(dflash) - DFLASH_KEYS)
    if unknown:
        raise OpdError(f"config field 'dflash_config.{unknown[0]}' belongs to a DFlash variant this drafter does not "
                       f"implement (supported keys: {', '.join(sorted(DFLASH_KEYS))})")
    if dflash.get("causal"):
        raise OpdError(f"config field 'dflash_config.causal' is {dflash['causal']!r}, which z-lab's DFlashDraftModel "
                       "does not read (expected false or absent; the top-level 'is_causal' sets causal layers)")
    if hf.get("is_causal") is not None and not isinstance(hf["is_causal"], bool):
        raise OpdError(f"config field 'is_causal' must be true, false or null, got {hf['is_causal']!r}")


def _attention_fields(hf: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """layer_types, the window in force and is_causal, as transformers' Qwen3Config resolves them for z-lab:
    the window only under `use_sliding_window` (4096 when unstated); without `layer_types`, layers from
    `max_window_layers` on slide. A sliding layer without a window is refused: z-lab's cache cannot hold it."""
    window = hf.get("sliding_window", QWEN3_SLIDING_WINDOW) if hf.get("use_sliding_window") else None
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise OpdError(f"config field 'sliding_window' must be a positive integer, got {window!r}")
    types = hf.get("layer_types")
    if types is None:
        first = hf.get("max_window_layers", QWEN3_MAX_WINDOW_LAYERS)
        types = [SLIDING if window is not None and i >= first else FULL for i in range(num_layers)]
    if not isinstance(types, list) or len(types) != num_layers:
        raise OpdError(f"config field 'layer_types' must list {num_layers} layer types, got {types!r}")
    bad = [(i, t) for i, t in enumerate(types) if t not in (FULL, SLIDING)]
    if bad:
        raise OpdError(f"config field 'layer_types' makes layer {bad[0][0]} {bad[0][1]!r}; DFlash drafters take "
                       f"'{FULL}' or '{SLIDING}'")
    if window is None and SLIDING in types:  # z-lab's sliding-window cache cannot be built without one
        raise OpdError(f"config field 'layer_types' makes layer {types.index(SLIDING)} '{SLIDING}' but no window "
                       "is in force (expected use_sliding_window true and a positive sliding_window)")
    return {"layer_types": list(types), "sliding_window": window, "is_causal": hf.get("is_causal")}


def _scalars(hf: dict[str, Any], dflash: dict[str, Any]) -> dict[str, Any]:
    """The `SCALAR_KEYS` fields, each None or a finite float (Any: spread over DFlashConfig's fields)."""
    return {name: _scalar(*draft_value(hf, dflash, name)) for name in SCALAR_KEYS}


def _scalar(d: dict[str, Any], name: str, prefix: str) -> float | None:
    value = d.get(name)
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise OpdError(f"config field '{prefix}{name}' must be a finite number, got {value!r}")
    return float(value)


def check_vllm_capturable(config: DFlashConfig) -> None:
    """vLLM's DFlash path captures layer i's output as the input of layer i + 1, so it cannot capture the
    target's last layer; such a drafter trains and drafts here (we read the final norm) but not in vLLM."""
    last = config.num_target_layers - 1
    if last in config.target_layer_ids:
        raise OpdError(f"dflash_config.target_layer_ids {config.target_layer_ids} include {last}, the target's last "
                       f"layer, which vLLM's DFlash path cannot capture (expected ids below {last})")


# RoPE types whose frequencies transformers fixes when the model is built; `dynamic` and `longrope` rescale them
# with the sequence length in the rotary forward, which a drafter drafting one block at a time does not reproduce.
ROPE_TYPES = ("default", "linear", "yarn", "llama3", "proportional")
MROPE_KEYS = ("mrope_section", "mrope_interleaved")  # a multimodal target's position sections: not a drafter's


def _rope_parameters(hf: dict[str, Any], layer_types: list[str]) -> dict[str, Any]:
    """A drafter config's RoPE: `rope_parameters` (else `rope_scaling`) with `rope_theta` filled in, flat or one
    entry per drafter layer type, every type one that transformers fixes at build time."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise OpdError(f"config field 'rope_parameters' must be an object, got {params!r}")
    if not _per_layer_type(params):
        return _flat_rope(params, hf.get("rope_theta"), "rope_parameters")
    missing = sorted(set(layer_types) - params.keys())
    if missing:
        raise OpdError(f"config field 'rope_parameters' gives RoPE per layer type but not for '{missing[0]}'")
    return {kind: _flat_rope(params[kind], hf.get("rope_theta"), f"rope_parameters.{kind}")
            for kind in sorted(set(layer_types))}


def _per_layer_type(params: dict[str, Any]) -> bool:
    """Whether RoPE parameters are given per layer type ({layer_type: parameters}) rather than flat."""
    return bool(params) and all(isinstance(value, dict) for value in params.values())


def _flat_rope(params: Any, theta: Any, name: str) -> dict[str, Any]:
    if not isinstance(params, dict):
        raise OpdError(f"config field '{name}' must be an object, got {params!r}")
    out = {k: v for k, v in params.items() if k != "type"}
    out["rope_type"] = params.get("rope_type", params.get("type", "default"))
    if out["rope_type"] not in ROPE_TYPES:
        raise OpdError(f"config field '{name}.rope_type' is {out['rope_type']!r}; supported: {', '.join(ROPE_TYPES)} "
                       "(RoPE fixed when the model is built)")
    out.setdefault("rope_theta", theta)
    if not isinstance(out["rope_theta"], (int, float)) or isinstance(out["rope_theta"], bool):
        raise OpdError("config field 'rope_theta' is missing" if out["rope_theta"] is None else
                       f"config field '{name}.rope_theta' must be a number, got {out['rope_theta']!r}")
    out["rope_theta"] = float(out["rope_theta"])
    return out


def _fresh_fields(hf: dict[str, Any], rope_theta: float | None, max_positions: int | None,
                  width: int | None) -> tuple[dict[str, Any], int, int]:
    """The RoPE, context length and MLP width a fresh drafter takes from its target, the spec's where the target
    has none; every one missing from both refused at once (`missing_fresh_fields`)."""
    missing, rope = [], {}
    try:
        rope = _target_rope(hf, rope_theta)
    except OpdError as exc:
        if str(exc) != NO_ROPE_BASE:
            raise
        missing.append("rope_theta")
    found = {"max_position_embeddings": hf.get("max_position_embeddings") or max_positions,
             "intermediate_size": hf.get("intermediate_size") or width}
    missing += [name for name, value in found.items() if value is None]
    if missing:
        raise missing_fresh_fields(missing)
    return rope, int(found["max_position_embeddings"] or 0), int(found["intermediate_size"] or 0)


def _target_rope(hf: dict[str, Any], rope_theta: float | None = None) -> dict[str, Any]:
    """The RoPE a drafter for this target takes: the target's, or its full-attention entry when the target gives
    RoPE per layer type (a drafter's layers are full attention), less what rotates only part of a head or only a
    multimodal section (z-lab's drafter rotates whole heads); a proportional RoPE keeps its factor, which shapes
    its frequencies over the whole head."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if isinstance(params, dict) and _per_layer_type(params):
        if FULL not in params:
            raise OpdError(f"target config 'rope_parameters' gives RoPE per layer type ({', '.join(params)}) but "
                           f"none for '{FULL}', the drafter's layers")
        params = params[FULL]
    theta = hf.get("rope_theta") if hf.get("rope_theta") is not None else rope_theta
    if theta is None and (not isinstance(params, dict) or params.get("rope_theta") is None):
        raise OpdError(NO_ROPE_BASE)
    rope = _flat_rope(params, theta, "rope_parameters")
    drop = MROPE_KEYS + (() if rope["rope_type"] == "proportional" else ("partial_rotary_factor",))
    return {k: v for k, v in rope.items() if k not in drop}


def _check_activation(hf: dict[str, Any]) -> None:
    if hf.get("hidden_act", "silu") != "silu":
        raise OpdError(f"config field 'hidden_act' is {hf['hidden_act']!r}; the DFlash drafter uses 'silu'")



# ---------------------------------------------------------------------------------------------------------------
# Reading and writing a checkpoint directory
# ---------------------------------------------------------------------------------------------------------------


def write_checkpoint(directory: str | Path, config: DFlashConfig, tensors: dict[str, torch.Tensor],
                     dtype: torch.dtype) -> None:
    """Write config.json (with `dtype`) + model.safetensors in the public layout; `tensors` is a state dict."""
    write_layout(directory, config.to_hf_dict(), tensors, dtype)


def write_speculators(directory: str | Path, config: DFlashConfig, tensors: dict[str, torch.Tensor],
                      dtype: torch.dtype, verifier: str | None, verifier_architectures: list[str]) -> None:
    """Write the checkpoint in vLLM's `speculators` layout (opd/formats/speculators.py): the same tensors, its
    config.json naming `verifier`, the target speculators reloads the embedding and LM head from."""
    write_layout(directory, config.to_speculators_dict(verifier, verifier_architectures), tensors, dtype)


def read_config(directory: ModelDir, target: TargetShape, config_class: type[DFlashConfig] = DFlashConfig
                ) -> DFlashConfig:
    """Parse a drafter directory's config.json (as `config_class`, a DFlash family's) and check it describes a
    drafter for this very target."""
    path = directory.path / CONFIG_FILE
    try:
        config = config_class.from_hf_dict(directory.config, target.num_layers)
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


def read_tensors(path: Path, expected: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Load model.safetensors, drop shared embedding/LM-head tensors, and check names and shapes exactly."""
    loaded = load_weights(path)
    tensors = {CODEBOOK_NAMES.get(name, name): t for name, t in loaded.items()
               if not name.endswith(SHARED_TENSOR_SUFFIXES)}
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


def dflash_public(hf: dict[str, Any], num_target_layers: int | None) -> dict[str, Any]:
    """The public DFlash config.json of a speculators DFlash checkpoint (`num_target_layers` is the target's depth,
    which speculators does not record; None leaves it out)."""
    if model_type(hf) != KIND:
        raise OpdError(f"config field '{MODEL_TYPE}' is {model_type(hf)!r} (expected '{KIND}')")
    if hf.get("sample_from_anchor"):
        raise OpdError("config field 'sample_from_anchor' is true, an anchor slot that drafts (expected false: the "
                       "anchor is the bonus token, as in z-lab's DFlash)")
    return backbone_public(hf, hf.get("block_size"), num_target_layers)
