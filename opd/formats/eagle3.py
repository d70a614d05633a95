"""The public EAGLE-3 checkpoint format: `config.json` <-> `Eagle3Config`, `model.safetensors` checks, draft vocab.

A drafter directory holds config.json (a one-layer Llama config plus `draft_vocab_size`, `target_hidden_size` and
`eagle_config`) and model.safetensors with SpecForge's tensor names (`fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`,
`t2d`; no `model.` prefix, no embedding: it is the target's). It is the layout SpecForge exports as
`LlamaForCausalLMEagle3`, which vLLM (`method: eagle3`) and SGLang (`EAGLE3`) load, so drafters trained here serve
there and public drafters load here. EAGLE 3.1's norms (`EAGLE31_FLAGS`) are read and written as speculators
reads them; options this drafter does not implement are refused with a one-line OpdError.

Layer ids. `aux_layer_ids` use the engines' convention: id i is the residual stream *entering* target layer i
(default [2, L//2, L-3]). vLLM passes explicit ids through unchanged; SGLang adds 1 to explicit ids, and since
PR #25454 only when the first id is 1, because SpecForge writes "output of layer" ids [1, L//2-1, L-4]. So we write
entering ids (first id 2 by default), which name the same tensors in vLLM and in SGLang >= that PR, and read a
list starting at 1 as SpecForge's and add 1. A first entering id of 1 cannot be written unambiguously: refused.
vLLM captures each target layer once, in layer order, so only ascending ids without repeats serve there.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import Field, model_validator

from opd.errors import OpdError
from opd.formats.checkpoint import (
    CONFIG_FILE,
    NO_ROPE_BASE,
    WEIGHTS_FILE,
    TargetShape,
    int_field,
    load_weights,
    save_weights,
)
from opd.formats.section import DrafterSection, drafter_section, spec_issues
from opd.formats.speculators import (
    MODEL_TYPE,
    VERSION,
    is_speculators,
    layer_fields,
    model_type,
    proposed_tokens,
    speculators_config,
)
from opd.model_dir import ModelDir

if TYPE_CHECKING:  # torch loads inside the functions that handle tensors (see opd/formats/dflash.py)
    import torch

ARCHITECTURE = "LlamaForCausalLMEagle3"
# SpecForge's name, and vLLM's registry names for the same one-layer Llama drafter.
ARCHITECTURES = frozenset({ARCHITECTURE, "Eagle3LlamaForCausalLM", "Eagle3Qwen3ForCausalLM"})
AUX_IDS_FIELD = "eagle_config.eagle_aux_hidden_state_layer_ids"
# Variants that change the forward (an extra norm, scaled RoPE, biases); refused when set truthy.
UNSUPPORTED_OPTIONS = ("norm_before_residual", "rope_scaling", "attention_bias")
# EAGLE 3.1's norms, as speculators' Eagle3SpeculatorConfig and converter read them (top level, or eagle_config):
# fc_norm, one RMSNorm per fused target state before `fc` (tensors fc_norm.{0,1,2}); norm_before_fc, one RMSNorm
# over their concatenation (input_norm); norm_output, the post-norm state feeds the next step and the head.
EAGLE31_FLAGS = ("fc_norm", "norm_before_fc", "norm_output")
SHARED_EMBEDDING = "embed_tokens.weight"  # the target's frozen embedding, which some exports carry


def default_aux_layer_ids(num_target_layers: int) -> list[int]:
    """EAGLE-3's default capture (EAGLE, vLLM, SGLang): entering layers 2, L//2, L-3; repeats on tiny targets."""
    return [2, num_target_layers // 2, num_target_layers - 3]


@drafter_section
class Eagle3Spec(DrafterSection):
    """kind eagle3: one layer drafting a chain of K-1 argmax steps over its own draft vocabulary (EAGLE-3, the
    public SpecForge format); must match a warm drafter's checkpoint when one is given."""

    kind: Literal["eagle3"] = "eagle3"
    num_layers: int = Field(1, ge=1, description="EAGLE-3 drafts with one layer")
    draft_vocab_size: int | None = Field(None, ge=1, description="None = min(32000, the target's vocabulary)")
    tree_topk: int = Field(1, ge=1, description=(
        "Draft tree width (SGLang's --speculative-eagle-topk). Only 1, a chain, drafts point masses, which lossless "
        "rebuild and replay need."))

    style: ClassVar[str] = "EAGLE"
    # Its chain is fed its argmax (no realized q to sample), and its training reads every slot's full teacher at
    # the anchors decoding chose.
    samples_from_q: ClassVar[bool] = False
    random_anchors: ClassVar[bool] = False
    topk_teacher: ClassVar[bool] = False

    @model_validator(mode="after")
    def _check(self) -> Eagle3Spec:
        wrong = []
        if self.num_layers != 1:
            wrong.append(f"num_layers: {self.num_layers} on an eagle3 drafter (EAGLE-3 drafts with one layer; "
                         "expected 1 or unset)")
        if self.tree_topk > 1:
            wrong.append(f"tree_topk: {self.tree_topk} is a draft tree (expected 1: only chains draft point "
                         "masses, which rebuild and replay need)")
        spec_issues(wrong)
        return self

    @classmethod
    def detects(cls, config: dict[str, Any]) -> bool:
        return "eagle3" in " ".join(config.get("architectures") or []).lower() or model_type(config) == "eagle3"

    def default_layer_ids(self, target_num_layers: int) -> list[int]:
        """The engines' capture (`default_aux_layer_ids`) as this project's ids: the output of decoder layer i is
        what enters layer i+1."""
        return [i - 1 for i in default_aux_layer_ids(target_num_layers)]

    def layer_id_issues(self, ids: list[int], origin: str) -> list[str]:
        if len(ids) != 3:
            return [f"target_layer_ids: {ids} (expected 3 ids: EAGLE-3's fc fuses three target layers)"]
        return []

    def checkpoint_fields(self, config: dict[str, Any], layer_ids: list[int] | None) -> dict[str, tuple[Any, Any]]:
        public = eagle3_public(config) if is_speculators(config) else config
        return {"block_size": (self.block_size, public.get("block_size")),
                "draft_vocab_size": (self.draft_vocab_size, public.get("draft_vocab_size")),
                "target_layer_ids": (layer_ids, speculators_layer_ids(config))}


@dataclass
class Eagle3Config:
    """Drafter hyper-parameters; `to_hf_dict`/`from_hf_dict` speak SpecForge's config.json layout."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: list[int]  # entering convention (see the module docstring)
    num_target_layers: int
    block_size: int  # K: anchor + K-1 chain drafts (engines take num_speculative_tokens = K-1)
    attention_bias: bool = False
    fc_norm: bool = False  # EAGLE 3.1 (EAGLE31_FLAGS)
    norm_before_fc: bool = False
    norm_output: bool = False

    @property
    def target_layer_ids(self) -> list[int]:
        """This project's `Target` convention: the output of decoder layer i is the stream entering layer i+1."""
        return [i - 1 for i in self.aux_layer_ids]

    @classmethod
    def for_target(cls, target_hf_config: Any, *, draft_vocab_size: int, block_size: int,
                   aux_layer_ids: list[int] | None = None, rope_theta: float | None = None) -> Eagle3Config:
        """A drafter as wide as the target: its layer shapes, RoPE base (`rope_theta` where the target has none)
        and norm epsilon."""
        hf = target_hf_config.to_dict()
        params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        if hf.get("rope_theta") is None and params.get("rope_theta") is None:
            if rope_theta is None:
                raise OpdError(NO_ROPE_BASE)
            hf["rope_theta"] = rope_theta
        num_layers = int(hf["num_hidden_layers"])
        ids = default_aux_layer_ids(num_layers) if aux_layer_ids is None else [int(i) for i in aux_layer_ids]
        if ids[:1] == [1]:
            raise OpdError(f"{AUX_IDS_FIELD} {ids} start at 1, which engines read as SpecForge's output-of-layer ids "
                           "(expected a first entering-layer id of at least 2)")
        config = cls(**_layer_shape(hf), draft_vocab_size=int(draft_vocab_size),
                     target_hidden_size=int(hf["hidden_size"]), aux_layer_ids=ids, num_target_layers=num_layers,
                     block_size=int(block_size))
        _check(config)
        return config

    def to_hf_dict(self) -> dict[str, Any]:
        """SpecForge's config.json plus our `block_size` (engines ignore unknown keys); dtype is added on write."""
        fields = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                  "rms_norm_eps", "rope_theta", "max_position_embeddings", "vocab_size", "draft_vocab_size",
                  "target_hidden_size", "block_size")
        return {
            "architectures": [ARCHITECTURE], "model_type": "llama", "num_hidden_layers": 1, "hidden_act": "silu",
            "attention_bias": False, "tie_word_embeddings": False, "rope_scaling": None,
            **{name: getattr(self, name) for name in fields},
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids),
                             "use_aux_hidden_state": True},
            **{name: True for name in EAGLE31_FLAGS if getattr(self, name)},  # absent unless set, as before
        }

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], *, num_target_layers: int, block_size: int) -> Eagle3Config:
        """Read an EAGLE-3 config.json (ours, SpecForge's or vLLM's names, or speculators' layout); a bad field
        raises OpdError naming it."""
        if is_speculators(d):
            d = eagle3_public(d) | {"architectures": [ARCHITECTURE]}
        archs = d.get("architectures")
        if not isinstance(archs, list) or not set(archs) & ARCHITECTURES:
            raise OpdError(f"config field 'architectures' is {archs!r}; expected one of {sorted(ARCHITECTURES)}")
        if d.get("num_hidden_layers") != 1:
            raise OpdError(f"config field 'num_hidden_layers' is {d.get('num_hidden_layers')!r}; only one-layer "
                           "EAGLE-3 drafters are supported (expected 1)")
        eagle = d.get("eagle_config") or {}
        if not isinstance(eagle, dict):
            raise OpdError("config field 'eagle_config' must be an object")
        for name in UNSUPPORTED_OPTIONS:
            if value := d.get(name) or eagle.get(name):
                raise OpdError(f"config field '{name}' is {value!r}; this EAGLE-3 drafter does not implement it "
                               "(expected false, null or absent)")
        if eagle.get("use_aux_hidden_state", True) is not True:
            raise OpdError("config field 'eagle_config.use_aux_hidden_state' must be true or absent")
        if d.get("hidden_act", "silu") != "silu":
            raise OpdError(f"config field 'hidden_act' is {d['hidden_act']!r}; the EAGLE-3 drafter uses 'silu'")
        if d.get("draft_vocab_size") is None:
            raise OpdError("config field 'draft_vocab_size' is missing (expected the draft vocabulary size)")
        ids = eagle.get("eagle_aux_hidden_state_layer_ids", d.get("eagle_aux_hidden_state_layer_ids"))
        if ids is None:
            ids = default_aux_layer_ids(num_target_layers)
        elif not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise OpdError(f"config field '{AUX_IDS_FIELD}' must be a list of integers, got {ids!r}")
        elif ids and ids[0] == 1:
            ids = [i + 1 for i in ids]  # SpecForge's "output of layer" ids
        shape = _layer_shape(d)
        config = cls(**shape, draft_vocab_size=int_field(d, "draft_vocab_size"),
                     target_hidden_size=int(d.get("target_hidden_size") or shape["hidden_size"]),
                     aux_layer_ids=list(ids), num_target_layers=int(num_target_layers),
                     block_size=int(d.get("block_size", block_size)), **_eagle31_flags(d, eagle))
        _check(config)
        return config


def _eagle31_flags(d: dict[str, Any], eagle: dict[str, Any]) -> dict[str, bool]:
    """EAGLE 3.1's flags, from the top level or eagle_config; fc_norm and norm_before_fc exclude each other."""
    flags = {name: d.get(name, eagle.get(name)) for name in EAGLE31_FLAGS}
    for name, value in flags.items():
        if value not in (None, True, False):
            raise OpdError(f"config field '{name}' must be true, false or null, got {value!r}")
    if flags["fc_norm"] and flags["norm_before_fc"]:
        raise OpdError("config fields 'fc_norm' and 'norm_before_fc' are both true (expected at most one: per-state "
                       "norms or one norm over their concatenation)")
    return {name: bool(value) for name, value in flags.items()}


def _layer_shape(hf: dict[str, Any]) -> dict[str, Any]:
    """The Llama/Qwen3 layer fields shared by a target's config and a drafter's (which copies the target's)."""
    hidden_size, num_heads = int_field(hf, "hidden_size"), int_field(hf, "num_attention_heads")
    return dict(hidden_size=hidden_size, intermediate_size=int_field(hf, "intermediate_size"),
                num_attention_heads=num_heads, num_key_value_heads=int(hf.get("num_key_value_heads") or num_heads),
                head_dim=int(hf.get("head_dim") or hidden_size // num_heads),
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)), rope_theta=_rope_theta(hf),
                max_position_embeddings=int_field(hf, "max_position_embeddings"),
                vocab_size=int_field(hf, "vocab_size"))


def _check(config: Eagle3Config) -> None:
    """Checks of a config on its own; read_config adds those against the target."""
    if not 1 <= config.draft_vocab_size <= config.vocab_size:
        raise OpdError(f"config field 'draft_vocab_size' is {config.draft_vocab_size}; expected 1..{config.vocab_size}"
                       " (a draft vocabulary larger than the target's cannot map into it)")
    ids, last = config.aux_layer_ids, config.num_target_layers - 1
    if len(ids) != 3:
        raise OpdError(f"config field '{AUX_IDS_FIELD}' is {ids}; expected exactly 3 target layer ids")
    if not all(1 <= i <= last for i in ids):
        raise OpdError(f"config field '{AUX_IDS_FIELD}' reads as entering-layer ids {ids}; expected ids in 1..{last}"
                       " (layer ids beyond the target cannot be captured)")
    if ids != sorted(ids):
        raise OpdError(f"config field '{AUX_IDS_FIELD}' is {ids}; expected ascending ids (engines concatenate the "
                       "captured states in layer order)")
    if config.block_size < 2:
        raise OpdError(f"config field 'block_size' is {config.block_size}; expected >= 2 (anchor plus drafts)")


def expected_shapes(config: Eagle3Config) -> dict[str, tuple[int, ...]]:
    """Every tensor of a checkpoint, with SpecForge's names (the embedding, when present, is dropped on read)."""
    h, i, hd = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    layer = {"hidden_norm": (h,), "input_layernorm": (h,), "post_attention_layernorm": (h,),
             "self_attn.q_proj": (q, 2 * h), "self_attn.k_proj": (kv, 2 * h), "self_attn.v_proj": (kv, 2 * h),
             "self_attn.o_proj": (h, q), "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h), "mlp.down_proj": (h, i)}
    t = config.target_hidden_size
    norms = {f"fc_norm.{i}.weight": (t,) for i in range(3)} if config.fc_norm else {}
    if config.norm_before_fc:
        norms["input_norm.weight"] = (3 * t,)
    return {"fc.weight": (h, 3 * t), **norms,
            **{f"midlayer.{name}.weight": shape for name, shape in layer.items()},
            "norm.weight": (h,), "lm_head.weight": (config.draft_vocab_size, h),
            "d2t": (config.draft_vocab_size,), "t2d": (config.vocab_size,)}


def read_config(directory: ModelDir, target: TargetShape, block_size: int) -> Eagle3Config:
    """Parse a drafter directory's config.json and check it describes a drafter for this very target, before any
    tensor loads."""
    path = directory.path / CONFIG_FILE
    try:
        config = Eagle3Config.from_hf_dict(directory.config, num_target_layers=target.num_layers,
                                           block_size=block_size)
    except OpdError as exc:
        raise OpdError(f"{path}: {exc}") from exc
    check_fits_target(path, config, target, "the target's embedding width, which is shared")
    return config


def check_fits_target(path: Path, config: Any, target: TargetShape, hidden_why: str) -> None:
    """An EAGLE-3-fed drafter's config.json (`path`) describes a drafter for this very target: its vocabulary,
    its width (`hidden_why` says why it must match) and the width of the states it fuses."""
    for name, value, why in (("vocab_size", target.vocab_size, "the target's vocabulary"),
                             ("hidden_size", target.hidden_size, hidden_why),
                             ("target_hidden_size", target.hidden_size, "the target's hidden size")):
        if getattr(config, name) != value:
            raise OpdError(f"{path}: config field '{name}' is {getattr(config, name)}; expected {value}, {why}")


def check_distinct_layers(ids: list[int]) -> None:
    """vLLM captures each layer once, so a repeated id would leave the drafter's fc short of a state."""
    if len(set(ids)) != len(ids):
        raise OpdError(f"{AUX_IDS_FIELD} {ids} repeat a layer, which vLLM captures once, so "
                       f"its fc would get {len(set(ids))} states for 3 (expected distinct ids)")


def read_tensors(path: Path, config: Eagle3Config) -> dict[str, torch.Tensor]:
    """Load model.safetensors, drop a shared embedding, check names, shapes and the vocabulary mapping."""
    tensors = {eagle3_tensor_name(name): t for name, t in load_weights(path).items()}
    tensors.pop(SHARED_EMBEDDING, None)
    for name, what in (("d2t", "draft-to-target vocabulary offsets"), ("t2d", "target-to-draft vocabulary mask")):
        if name not in tensors:
            raise OpdError(f"{path}: missing {name} (expected the {what})")
    shapes = expected_shapes(config)
    for label, names in (("missing", shapes.keys() - tensors.keys()), ("unexpected", tensors.keys() - shapes.keys())):
        if names:
            listed = sorted(names)
            raise OpdError(f"{path}: {label} tensor(s) {', '.join(listed[:5])}" + (" ..." if len(listed) > 5 else ""))
    for name, shape in shapes.items():
        if tuple(tensors[name].shape) != shape:
            raise OpdError(f"{path}: tensor {name} has shape {list(tensors[name].shape)}, expected {list(shape)}")
    check_mapping(path, tensors["d2t"], tensors["t2d"], config.vocab_size)
    return tensors


def check_mapping(path: Path, d2t: torch.Tensor, t2d: torch.Tensor, vocab_size: int) -> None:
    """d2t and t2d must describe the same ascending set of target ids, as SpecForge and the engines assume."""
    import torch

    if d2t.is_floating_point() or d2t.dtype == torch.bool or t2d.dtype != torch.bool:
        raise OpdError(f"{path}: d2t is {d2t.dtype} and t2d {t2d.dtype}; expected integer offsets and a bool mask")
    ids = torch.arange(d2t.numel()) + d2t.long()
    if int(t2d.sum()) != d2t.numel():
        raise OpdError(f"{path}: t2d marks {int(t2d.sum())} target ids but d2t has {d2t.numel()} draft ids")
    if (ids[1:] <= ids[:-1]).any() or ids[0] < 0 or ids[-1] >= vocab_size:
        raise OpdError(f"{path}: d2t gives target ids (arange + d2t) that are not strictly increasing in "
                       f"[0, {vocab_size})")
    if not t2d[ids].all():
        raise OpdError(f"{path}: t2d is not true at exactly the target ids arange + d2t")


def write_checkpoint(directory: str | Path, config: Eagle3Config, state: dict[str, torch.Tensor],
                     dtype: torch.dtype) -> None:
    """Write config.json + model.safetensors; weights in `dtype`, d2t int64 and t2d bool, any embedding left out."""
    write_layout_of(directory, config.to_hf_dict(), _checked(config, state), dtype)


def write_speculators(directory: str | Path, config: Eagle3Config, state: dict[str, torch.Tensor],
                      dtype: torch.dtype, verifier: str | None, verifier_architectures: list[str]) -> None:
    """Write the checkpoint in vLLM's `speculators` layout (opd/formats/speculators.py), naming `verifier`:
    speculators' converter drops EAGLE 3.1's norm tensors, so a drafter with them is exported this way."""
    hf = eagle3_speculators(config.to_hf_dict(), verifier, verifier_architectures)
    write_layout_of(directory, hf, speculators_tensor_names(_checked(config, state)), dtype)


def _checked(config: Eagle3Config, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict less any embedding, checked against the layout's names and shapes."""
    shapes = expected_shapes(config)
    state = {name: t for name, t in state.items() if name != SHARED_EMBEDDING}
    bad = {name: tuple(t.shape) for name, t in state.items() if shapes.get(name) != tuple(t.shape)}
    if bad or state.keys() != shapes.keys():
        raise ValueError(f"state does not match the EAGLE-3 layout: {bad or sorted(shapes.keys() ^ state.keys())}")
    return state


def write_layout_of(directory: str | Path, hf: dict[str, Any], state: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    """config.json `hf` (with `dtype`) and `state` as model.safetensors: weights in `dtype`, d2t int64, t2d bool."""
    import torch
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    hf["torch_dtype"] = str(dtype).removeprefix("torch.")
    (directory / CONFIG_FILE).write_text(json.dumps(hf, indent=2) + "\n")
    cast = {"d2t": torch.int64, "t2d": torch.bool}
    tensors = {name: t.detach().to("cpu", cast.get(name, dtype)).contiguous() for name, t in state.items()}
    save_weights(tensors, directory / WEIGHTS_FILE)


def draft_vocab(token_counts: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t int64 [size], t2d bool [V]) for the `size` most frequent target ids (ties and zero counts by lower id),
    sorted ascending as SpecForge and EAGLE do, so that target id = draft id + d2t[draft id]."""
    import torch

    counts = token_counts.flatten()
    if not 1 <= size <= counts.numel():
        raise OpdError(f"draft vocabulary size {size} must be in 1..{counts.numel()} (the target's vocabulary)")
    order = torch.sort(counts, descending=True, stable=True).indices  # stable: equal counts keep lower ids first
    ids = order[:size].sort().values
    t2d = torch.zeros(counts.numel(), dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(size), t2d


def _rope_theta(hf: dict[str, Any]) -> float:
    """RoPE base from either config generation, for a drafter that implements plain (unscaled) RoPE only
    (EAGLE-3's)."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise OpdError(f"config field 'rope_parameters.rope_type' is {rope_type!r}; only 'default' is supported")
    theta = params.get("rope_theta", hf.get("rope_theta"))
    if theta is None:
        raise OpdError("config field 'rope_theta' is missing")
    return float(theta)


# EAGLE-3 options of speculators' layout, carried to the top level where the EAGLE-3 reader refuses the ones it does
# not implement
EAGLE3_OPTIONS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")


def eagle3_public(hf: dict[str, Any]) -> dict[str, Any]:
    """SpecForge's EAGLE-3 config.json (less `architectures`, which the reader names) of a speculators one."""
    if model_type(hf) != "eagle3":
        raise OpdError(f"config field '{MODEL_TYPE}' is {model_type(hf)!r} (expected 'eagle3')")
    layer = layer_fields(hf.get("transformer_layer_config"))
    ids = hf.get("eagle_aux_hidden_state_layer_ids")
    if isinstance(ids, list) and ids[:1] == [1]:  # the public layout reads a first id of 1 as SpecForge's
        raise OpdError(f"config field 'eagle_aux_hidden_state_layer_ids' is {ids}: an entering id of 1 cannot be "
                       "told from SpecForge's output-of-layer ids in the public layout (expected a first id >= 2)")
    tokens = proposed_tokens(hf)  # the chain's length, which our export writes there (K - 1)
    chain = {"block_size": tokens + 1} if isinstance(tokens, int) and not isinstance(tokens, bool) else {}
    return ({k: v for k, v in layer.items() if k not in ("architectures", "dtype")}
            | {"draft_vocab_size": hf.get("draft_vocab_size"), "target_hidden_size": hf.get("target_hidden_size"),
               "eagle_config": {} if ids is None else {"eagle_aux_hidden_state_layer_ids": ids}}
            | {name: hf[name] for name in EAGLE3_OPTIONS if name in hf} | chain)


def eagle3_tensor_name(name: str) -> str:
    """SpecForge's name of a speculators EAGLE-3 tensor (its one layer is `layers.0`, SpecForge's `midlayer`)."""
    return "midlayer." + name.removeprefix("layers.0.") if name.startswith("layers.0.") else name


def eagle3_speculators(public: dict[str, Any], verifier: str | None,
                       verifier_architectures: list[str]) -> dict[str, Any]:
    """speculators' EAGLE-3 config.json for SpecForge's (as `Eagle3Config.to_hf_dict` writes it): what speculators'
    converter writes, with the layer ids, EAGLE 3.1's flags and the chain's length carried over."""
    eagle = public.get("eagle_config", {})
    skip = ("architectures", "eagle_config", "draft_vocab_size", "target_hidden_size", "block_size", "dtype",
            "torch_dtype", *EAGLE3_OPTIONS)
    layer = {k: v for k, v in public.items() if k not in skip} | {"model_type": "llama"}
    return {MODEL_TYPE: "eagle3", "speculators_version": VERSION, "architectures": ["Eagle3DraftModel"],
            "transformer_layer_config": layer, "draft_vocab_size": public["draft_vocab_size"],
            "target_hidden_size": public.get("target_hidden_size"),
            "eagle_aux_hidden_state_layer_ids": eagle.get("eagle_aux_hidden_state_layer_ids"),
            **{name: bool(public.get(name, False)) for name in EAGLE3_OPTIONS},
            "embed_requires_grad": False, "tie_word_embeddings": False,
            "speculators_config": speculators_config("eagle3", public["block_size"] - 1, verifier,
                                                     verifier_architectures)}


def speculators_tensor_names(tensors: dict[str, Any]) -> dict[str, Any]:
    """An EAGLE-3 state dict under speculators' names (SpecForge's `midlayer` is its `layers.0`)."""
    return {("layers.0." + name.removeprefix("midlayer.") if name.startswith("midlayer.") else name): t
            for name, t in tensors.items()}


def speculators_layer_ids(config: dict[str, Any]) -> list[int] | None:
    """This project's target layer ids of a speculators EAGLE-family config (its ids enter layer i, ours are the
    output of layer i - 1), None for SpecForge's layout, whose first id cannot be told apart (`eagle3_public`)."""
    ids = config.get("eagle_aux_hidden_state_layer_ids") if is_speculators(config) else None
    return [i - 1 for i in ids] if isinstance(ids, list) and all(isinstance(i, int) for i in ids) else None
