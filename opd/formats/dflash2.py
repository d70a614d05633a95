"""DFlash 2 checkpoints (z-lab's `DFlash2DraftModel`): `config.json` <-> `DFlash2Config`, both of its layouts, and
the `models.drafter` section of kind `dflash2`.

DFlash 2 is the DFlash format (opd/formats/dflash.py) with four `dflash_config` keys (`conv_kernel_size`,
`conv_group_size`, `selector_rank`, `selector_top_k`: all four, as z-lab's code reads them) and
`architectures: [DFlash2DraftModel]`. Its selector's codebooks are stored without a `.weight` suffix, as in z-lab's
published checkpoints; a file that z-lab's `save_pretrained` wrote with the suffix is read too
(opd/formats/dflash.py `read_tensors`). In vLLM's `speculators` layout (`speculators_model_type: dflash2`) the four
keys sit at the top level, with `DFlash2SpeculatorConfig`'s defaults where a config leaves one out, and every layer
sees its whole block unless `sliding_window_non_causal` says otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar, Literal

from pydantic import Field

from opd.errors import OpdError
from opd.formats.checkpoint import int_field
from opd.formats.dflash import ARCHITECTURE as DFLASH_ARCHITECTURE
from opd.formats.dflash import DFLASH_HOME, DFlashConfig, DFlashSpec, draft_value
from opd.formats.section import drafter_section
from opd.formats.speculators import backbone_public, dflash_speculators, is_speculators, model_type

KIND = "dflash2"
ARCHITECTURE = "DFlash2DraftModel"
FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
SPECULATORS_DEFAULTS = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16}


def is_dflash2(config: dict[str, Any]) -> bool:
    """Whether a config.json describes a DFlash 2 drafter (its architecture, or any of its dflash_config keys)."""
    dflash = config.get("dflash_config")
    keys = set(dflash) if isinstance(dflash, dict) else set()
    return ARCHITECTURE in (config.get("architectures") or []) or bool(keys & set(FIELDS)) or model_type(config) == KIND


@drafter_section
class DFlash2Spec(DFlashSpec):
    """kind dflash2: a DFlash drafter whose candidate selector chains the block's drafts (z-lab's
    `DFlash2DraftModel`, opd/models/dflash2.py). A random one takes its four fields (dflash_config's names); a warm
    one brings its own, and they must then be unset."""

    kind: Literal["dflash2"] = "dflash2"  # type: ignore[assignment]  # the union's tag: each family its own
    conv_kernel_size: int | None = Field(None, ge=1)
    conv_group_size: int | None = Field(None, ge=1)
    selector_rank: int | None = Field(None, ge=1)
    selector_top_k: int | None = Field(None, ge=1)

    has_selector: ClassVar[bool] = True

    @classmethod
    def detects(cls, config: dict[str, Any]) -> bool:
        return is_dflash2(config)

    @property
    def fields(self) -> dict[str, int]:
        """The four DFlash 2 fields given here (all four for a random drafter, none for a warm one)."""
        return {name: value for name in FIELDS if (value := getattr(self, name)) is not None}

    def init_issues(self, warm: bool) -> list[str]:
        given = self.fields
        if warm and given:
            return [f"{next(iter(given))}: set, but a warm DFlash 2 drafter brings its own (expected the four "
                    "DFlash 2 fields unset)"]
        missing = [name for name in FIELDS if name not in given]
        if not warm and missing:
            return [f"{missing[0]}: missing (a random DFlash 2 drafter takes all of {', '.join(FIELDS)})"]
        return []


@dataclass
class DFlash2Config(DFlashConfig):
    """A DFlash config with each layer's causal convolutions and the candidate selector (0: unset, never valid)."""

    conv_kernel_size: int = 0  # taps along the block, the current position's included
    conv_group_size: int = 0  # channels sharing one dynamic tap
    selector_rank: int = 0  # the codebooks' rank
    selector_top_k: int = 0  # candidates per slot

    @classmethod
    def of(cls, backbone: DFlashConfig, own: dict[str, int]) -> DFlash2Config:
        """`backbone` with DFlash 2's four fields `own`, checked against its width and vocabulary."""
        check_dflash2_fields(own, backbone.hidden_size, backbone.vocab_size, "models.drafter.{}")
        return cls._with(backbone, own)

    @classmethod
    def _with(cls, backbone: DFlashConfig, own: dict[str, int]) -> DFlash2Config:
        values: dict[str, Any] = {f.name: getattr(backbone, f.name) for f in fields(DFlashConfig)} | own
        return cls(**values)

    @property
    def own(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in FIELDS}

    def to_hf_dict(self) -> dict[str, Any]:
        """The public DFlash config.json with DFlash 2's architecture and its four keys in `dflash_config`."""
        out = super().to_hf_dict()
        out["dflash_config"] = out["dflash_config"] | self.own
        return out | {"architectures": [ARCHITECTURE]}

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], num_target_layers: int | None = None) -> DFlash2Config:
        """Read z-lab's DFlash 2 config.json, or speculators' layout of one (for a target of `num_target_layers`,
        which that layout does not record); a missing or malformed field raises OpdError naming it."""
        if is_speculators(hf):
            hf = dflash2_public(hf, num_target_layers)
        found = hf.get("dflash_config")
        dflash: dict[str, Any] = found if isinstance(found, dict) else {}
        own = {name: int_field(*draft_value(hf, dflash, name, DFLASH_HOME | set(FIELDS))) for name in FIELDS}
        for name, value in own.items():
            if value < 1:
                raise OpdError(f"config field 'dflash_config.{name}' must be a positive integer, got {value}")
        backbone = {k: v for k, v in hf.items() if k not in FIELDS} | {"architectures": [DFLASH_ARCHITECTURE]}
        if dflash:
            backbone["dflash_config"] = {k: v for k, v in dflash.items() if k not in FIELDS}
        base = DFlashConfig.from_hf_dict(backbone, num_target_layers)
        check_dflash2_fields(own, base.hidden_size, base.vocab_size, "config field 'dflash_config.{}'")
        return cls._with(base, own)

    def to_speculators_dict(self, verifier: str | None, verifier_architectures: list[str]) -> dict[str, Any]:
        """speculators' DFlash 2 config.json: the backbone's, its four fields at the top level."""
        out = dflash_speculators(super().to_hf_dict(), verifier, verifier_architectures, KIND)
        return out | {"architectures": [ARCHITECTURE]} | self.own


def check_dflash2_fields(own: dict[str, int], hidden_size: int, vocab_size: int, where: str) -> None:
    """DFlash 2's fields fit the drafter's width and vocabulary; `where` names a field, formatted with its name."""
    if hidden_size % own["conv_group_size"]:
        raise OpdError(f"{where.format('conv_group_size')} is {own['conv_group_size']}, which does not divide "
                       f"hidden_size {hidden_size} (expected a divisor)")
    if own["selector_top_k"] > vocab_size:
        raise OpdError(f"{where.format('selector_top_k')} is {own['selector_top_k']}, more than the "
                       f"vocabulary's {vocab_size} tokens")


def dflash2_public(hf: dict[str, Any], num_target_layers: int | None) -> dict[str, Any]:
    """z-lab's DFlash 2 config.json of a speculators one (`num_target_layers`: the target's depth, which
    speculators does not record; None leaves it out)."""
    if model_type(hf) != KIND:
        raise OpdError(f"config field 'speculators_model_type' is {model_type(hf)!r} (expected '{KIND}')")
    if hf.get("sample_from_anchor"):
        raise OpdError("config field 'sample_from_anchor' is true, an anchor slot that drafts (expected false: the "
                       "anchor is the bonus token, as in z-lab's DFlash)")
    public = backbone_public(hf, hf.get("block_size"), num_target_layers, non_causal=True)
    public["dflash_config"] |= {name: hf.get(name, default) for name, default in SPECULATORS_DEFAULTS.items()}
    return public | {"architectures": [ARCHITECTURE]}
