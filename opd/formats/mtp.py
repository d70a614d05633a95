"""MTP heads: the layouts their tensors take in a target's own checkpoint and in vLLM's `speculators`, and the
`models.drafter` section of `kind: mtp`.

A multi-token-prediction head is one decoder layer of the target's own kind behind an input projection:
`fc(concat(norm_e(embed(x_{p+1})), norm_h(h_p)))` at position p, where h_p is the target's last hidden state after
its final norm, then the layer, then a final norm and the target's LM head. Every public layout holds the same five
parts under other names, so the layouts are data (`LAYOUTS`), one row each, read from vLLM's own models:

- `qwen3_next` (vLLM `qwen3_next_mtp`, `qwen3_5_mtp`): `mtp.fc`, `mtp.pre_fc_norm_embedding`,
  `mtp.pre_fc_norm_hidden`, `mtp.layers.0.*`, `mtp.norm`; the normed output is fed to the next step;
- `nextn` (vLLM `deepseek_mtp`, `glm4_moe_mtp`: DeepSeek-V3/R1, GLM-4.5): `model.layers.{N}.{enorm,hnorm,eh_proj}`,
  the layer's own tensors directly under the same prefix, `shared_head.norm`; the embedding at position 0 is
  zeroed and the un-normed output is fed to the next step (`shared_head.norm` is applied for the logits only);
- `mimo` (vLLM `mimo_mtp`): `model.mtp_layers.0.{token_layernorm,hidden_layernorm,input_proj,final_layernorm}`,
  its concatenation is [hidden; embedding], position 0 zeroed, the normed output returned;
- `speculators` (`MTPDraftModel` and `MTPConverter`, 0.9.0): `mtp_layers.0.{token_layernorm,hidden_layernorm,
  input_proj,final_layernorm}` and the layer's tensors under `mtp_layers.0.`, the normed output fed on.

The project's own names are the left column of every row (`fc`, `token_norm`, `hidden_norm`, `final_norm`,
`layer.*`); translation is `to_layout`/`from_layout` and nothing else names a layout's tensors.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field

from opd.errors import OpdError
from opd.formats.checkpoint import CONFIG_FILE, WEIGHTS_FILE, save_weights
from opd.formats.experts import split_experts, stores_per_expert
from opd.formats.section import DrafterSection, drafter_section
from opd.formats.speculators import MODEL_TYPE, VERSION, model_type, proposed_tokens, speculators_config
from opd.model_dir import WEIGHTS_INDEX, ModelDir

ARCHITECTURE = "MTPDraftModel"
# the target model types speculators' MTPDraftModel builds a layer for (0.9.0, `mtp_model_classes`); it refuses
# any other with "Unsupported MTP model type", so those heads are served from the target's own layout
SPECULATORS_MODEL_TYPES = ("qwen3", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
HEAD_SHARD = "mtp-head.safetensors"  # the trained head, in an export into the target's own layout
PARTS = ("fc", "token_norm", "hidden_norm", "final_norm")  # the head's own modules besides its decoder layer


@dataclass(frozen=True)
class MTPLayout:
    """Where one public layout keeps an MTP head (`prefix`, with `{n}` the target's num_hidden_layers) and how its
    forward differs: its names for `PARTS`, where the decoder layer's tensors sit below the prefix, whether the
    next chain step is fed the normed output, whether position 0's embedding is zeroed, the concatenation order,
    and names under the prefix that are copies of the target's own embedding or head (left where they are)."""

    name: str
    prefix: str
    parts: dict[str, str]
    layer: str
    feeds_normed: bool
    zero_first_embedding: bool
    hidden_first: bool = False
    shared: tuple[str, ...] = ()
    model_types: tuple[str, ...] = field(default=())
    count_field: str = ""  # the target config's field saying how many MTP layers its checkpoint holds

    def prefix_for(self, num_layers: int) -> str:
        return self.prefix.format(n=num_layers)


_SPECULATORS_PARTS = {"fc": "input_proj", "token_norm": "token_layernorm", "hidden_norm": "hidden_layernorm",
                      "final_norm": "final_layernorm"}
LAYOUTS: dict[str, MTPLayout] = {layout.name: layout for layout in (
    MTPLayout("qwen3_next", "mtp.", {"fc": "fc", "token_norm": "pre_fc_norm_embedding",
                                     "hidden_norm": "pre_fc_norm_hidden", "final_norm": "norm"}, "layers.0.",
              feeds_normed=True, zero_first_embedding=False,
              model_types=("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"), count_field="mtp_num_hidden_layers"),
    MTPLayout("nextn", "model.layers.{n}.", {"fc": "eh_proj", "token_norm": "enorm", "hidden_norm": "hnorm",
                                             "final_norm": "shared_head.norm"}, "",
              feeds_normed=False, zero_first_embedding=True, shared=("embed_tokens.weight", "shared_head.head.weight"),
              model_types=("deepseek_v3", "deepseek_v32", "glm4_moe", "glm4_moe_lite"),
              count_field="num_nextn_predict_layers"),
    MTPLayout("mimo", "model.mtp_layers.0.", _SPECULATORS_PARTS, "", feeds_normed=True, zero_first_embedding=True,
              hidden_first=True, model_types=("mimo",), count_field="num_nextn_predict_layers"),
    MTPLayout("speculators", "mtp_layers.0.", _SPECULATORS_PARTS, "", feeds_normed=True, zero_first_embedding=False),
)}
SPECULATORS = "speculators"


def to_layout(state: dict[str, Any], layout: MTPLayout, num_layers: int) -> dict[str, Any]:
    """The head's state dict (the project's names) under `layout`'s names."""
    prefix = layout.prefix_for(num_layers)
    out = {}
    for name, tensor in state.items():
        part, _, rest = name.partition(".")
        if part == "layer":
            out[prefix + layout.layer + rest] = tensor
        else:
            out[prefix + layout.parts[part] + "." + rest] = tensor
    return out


def from_layout(names: list[str], layout: MTPLayout, num_layers: int) -> dict[str, str]:
    """{the project's name: the checkpoint's} for the head's tensors among `names` (the target's own and its
    copies under the prefix left out)."""
    prefix = layout.prefix_for(num_layers)
    ours = {f"{layout.parts[part]}.": f"{part}." for part in PARTS}
    shared = {prefix + name for name in layout.shared}
    found = {}
    for name in names:
        if not name.startswith(prefix) or name in shared:
            continue
        rest = name[len(prefix):]
        own = next((ours[p] + rest[len(p):] for p in ours if rest.startswith(p)), None)
        if own is None and rest.startswith(layout.layer):
            own = "layer." + rest[len(layout.layer):]
        if own is not None:
            found[own] = name
    return found


def head_layout(names: list[str], num_layers: int) -> MTPLayout | None:
    """The layout whose fc a target checkpoint holds (its MTP head), None when it holds none."""
    present = set(names)
    for layout in LAYOUTS.values():
        if layout.name != SPECULATORS and layout.prefix_for(num_layers) + layout.parts["fc"] + ".weight" in present:
            return layout
    return None


def fresh_layout(model_type_name: str) -> MTPLayout:
    """The layout a fresh head for a target of this model_type is written in: its family's, else speculators'."""
    return next((layout for layout in LAYOUTS.values() if model_type_name in layout.model_types), LAYOUTS[SPECULATORS])


@dataclass
class MTPConfig:
    """An MTP head's hyper-parameters: its K, the public layout whose forward it follows, and the target's text
    config (a JSON dict) whose decoder layer class, norm class and rotary embedding it is built from."""

    block_size: int
    layout: str
    layer_config: dict[str, Any]

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise OpdError(f"MTP layout {self.layout!r} unknown (expected one of {', '.join(LAYOUTS)})")
        self.layer_config = json.loads(json.dumps(self.layer_config))  # what a file gives back: lists, str keys

    @property
    def form(self) -> MTPLayout:
        return LAYOUTS[self.layout]

    @property
    def num_layers(self) -> int:
        return int(self.layer_config["num_hidden_layers"])

    def to_speculators(self, verifier: str | None, architectures: list[str]) -> dict[str, Any]:
        """speculators' config.json (`MTPSpeculatorConfig`): the layer config, one MTP layer, K-1 greedy tokens;
        the forward's layout is kept in `opd_mtp_layout` (speculators reads its own fields only)."""
        return {MODEL_TYPE: "mtp", "speculators_version": VERSION, "architectures": [ARCHITECTURE],
                "transformer_layer_config": self.layer_config, "num_nextn_predict_layers": 1,
                "opd_mtp_layout": self.layout,
                "speculators_config": speculators_config("mtp", self.block_size - 1, verifier, architectures)}

    @classmethod
    def from_speculators(cls, hf: dict[str, Any], default_block_size: int) -> MTPConfig:
        layer = hf.get("transformer_layer_config")
        if not isinstance(layer, dict) or "model_type" not in layer:
            raise OpdError("config field 'transformer_layer_config' is missing or has no model_type "
                           "(expected the target's text config, as speculators' MTPSpeculatorConfig writes it)")
        if hf.get("num_nextn_predict_layers", 1) != 1:
            raise OpdError(f"config field 'num_nextn_predict_layers' is {hf['num_nextn_predict_layers']} "
                           "(expected 1: the head is chained for every step, as vLLM does)")
        tokens = proposed_tokens(hf)
        block_size = default_block_size if not isinstance(tokens, int) else tokens + 1
        return cls(block_size, str(hf.get("opd_mtp_layout", SPECULATORS)), full_layer_config(layer))


def full_layer_config(layer: dict[str, Any]) -> dict[str, Any]:
    """Every field of a text config that speculators wrote as a diff against its class's defaults (transformers,
    imported here only: the config's class owns the defaults)."""
    from transformers import AutoConfig

    fields = dict(layer)
    try:
        config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    except (ValueError, KeyError) as exc:
        raise OpdError(f"config field 'transformer_layer_config': {str(exc).splitlines()[0]}") from None
    return dict(json.loads(config.to_json_string(use_diff=False)))


def write_speculators(directory: str | Path, config: MTPConfig, state: dict[str, Any], dtype: Any,
                      verifier: str | None, architectures: list[str]) -> None:
    """config.json and model.safetensors in speculators' MTP layout (the embedding and LM head are the target's)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    hf = config.to_speculators(verifier, architectures) | {"torch_dtype": str(dtype).removeprefix("torch.")}
    (directory / CONFIG_FILE).write_text(json.dumps(hf, indent=2) + "\n")
    tensors = to_layout(state, LAYOUTS[SPECULATORS], config.num_layers)
    save_weights({n: t.detach().to("cpu", dtype).contiguous() for n, t in tensors.items()}, directory / WEIGHTS_FILE)


def write_into_target(state: dict[str, Any], layout: MTPLayout, target: ModelDir, directory: str | Path,
                      dtype: Any) -> Path:
    """A directory vLLM serves with its MTP method: the target's own layout, its files linked (a 397B target is
    never copied), the head's tensors in a new shard (`HEAD_SHARD`) and a weight index that names it for them and
    the target's shards for the rest; config.json says the checkpoint holds one MTP layer. MoE experts are written
    as the target's shards store them (one tensor per expert where they do).

    vLLM reads every tensor of every shard the index names, not only the names the index maps to it, so a linked
    shard holding the target's old head and tensors the index still maps to it (nextn's embedding copy, a shard
    shared with the body) would load the old head too, and which copy wins would be file order. The
    shards that hold a tensor the new head replaces are therefore rewritten without it (only those are copied;
    one left empty is dropped): every name lives in exactly one file. Returns the directory."""
    if not layout.count_field:
        raise OpdError(f"target {target.path}: vLLM serves no MTP head of model_type "
                       f"{target.text_config.get('model_type')!r} in the target's own layout (expected a Qwen3.5, "
                       "Qwen3-Next, DeepSeek-V3, GLM-4.5 or MiMo target; export it in speculators' layout instead)")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tensors = to_layout(state, layout, int(target.int_field("num_hidden_layers")))
    weight_map = {name: file.name for name, file in target.tensor_files().items()}
    if stores_per_expert(weight_map):  # the target's own MoE naming, which vLLM's loader reads
        tensors = split_experts(tensors)
    replaced = {weight_map[n] for n in tensors if n in weight_map}
    for entry in target.path.iterdir():
        if entry.name in replaced:
            _write_without(entry, out / entry.name, set(tensors))
        elif entry.name not in (WEIGHTS_INDEX, CONFIG_FILE, HEAD_SHARD) and not (out / entry.name).exists():
            (out / entry.name).symlink_to(entry.resolve())
    save_weights({n: t.detach().to("cpu", dtype).contiguous() for n, t in tensors.items()}, out / HEAD_SHARD)
    weight_map |= dict.fromkeys(tensors, HEAD_SHARD)
    (out / WEIGHTS_INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2) + "\n")
    config = json.loads(json.dumps(target.config))
    text = config["text_config"] if isinstance(config.get("text_config"), dict) else config
    text[layout.count_field] = max(1, int(text.get(layout.count_field) or 0))
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return out


def _write_without(shard: Path, copy: Path, names: set[str]) -> None:
    """`shard`'s tensors but `names`, written to `copy` (nothing when none are left). A link left by an earlier
    export is removed first, so the write never goes through it into the target's own file."""
    from safetensors import safe_open
    copy.unlink(missing_ok=True)
    with safe_open(str(shard), framework="pt") as f:
        kept = {n: f.get_tensor(n) for n in f.keys() if n not in names}
    if kept:
        save_weights(kept, copy)


@drafter_section
class MTPSpec(DrafterSection):
    """kind mtp: the target's own multi-token-prediction head (or a fresh one), one decoder layer of the target's
    kind chained K-1 times, fed its own output, as vLLM's MTP method runs it."""

    kind: Literal["mtp"] = "mtp"
    num_layers: int = Field(1, ge=1, le=1, description="an MTP head is one layer, chained for every drafted token")
    block_size: int = Field(4, ge=2, description="K tokens per block, anchor included; the head is chained K-1 times")
    from_target: bool = Field(True, description=(
        "With no models.drafter_path: start from the MTP head in the target's own checkpoint (refused in one line "
        "when it has none); false = a fresh random head of the target's layer kind, for SFT"))

    style: ClassVar[str] = "MTP"
    samples_from_q: ClassVar[bool] = False  # its chain is fed its argmax (point masses), as EAGLE-3's
    random_anchors: ClassVar[bool] = False
    topk_teacher: ClassVar[bool] = False

    @classmethod
    def detects(cls, config: dict[str, Any]) -> bool:
        return model_type(config) == "mtp"

    def default_layer_ids(self, target_num_layers: int) -> list[int]:
        """The target's last layer: its hidden state after the final norm (opd/models/target.py captures that id
        from the norm), which vLLM and speculators feed their MTP heads."""
        return [target_num_layers - 1]

    def layer_id_issues(self, ids: list[int], origin: str) -> list[str]:
        if len(ids) != 1:
            return [f"target_layer_ids: {ids}{origin} (expected one id, the target's last layer: an MTP head reads "
                    "the target's final hidden state)"]
        return []

    def checkpoint_fields(self, config: dict[str, Any], layer_ids: list[int] | None) -> dict[str, tuple[Any, Any]]:
        tokens = proposed_tokens(config)
        return {"block_size": (self.block_size, tokens + 1 if isinstance(tokens, int) else None)}
