"""XPress checkpoints (arXiv 2608.02438) in vLLM's `speculators` layout: `config.json` <-> `XPressConfig`, and the
`models.drafter` section of kind `xpress`.

XPress is a DFlash backbone with a causal refiner head (speculators' `XPressDraftModel`, 0.9.0; the model is
opd/models/xpress.py). Its published form keeps DFlash's fill-in block (`sample_from_anchor: false`): slot 0 holds
the anchor and slots 1..K-1 draft, so its `block_size` is K counted with the anchor, as here, and vLLM's
`num_speculative_tokens` is K - 1.

The checkpoint is speculators' layout (opd/formats/speculators.py) with the DFlash backbone's tensors and the
refiner's under `refiner_head.`: `token_embed.weight` [V, r], `down_h.weight` and `down_g.weight` [r, H],
`in_proj.weight` [r, 3r], `mix_l` [r, K, K], `mlp_gate.weight` and `mlp_up.weight` [r*ratio, r],
`mlp_down.weight` [r, r*ratio] and `readout.weight` [V, r]. The config adds `xpress_rank` (r), `xpress_mlp_ratio`
and `num_jacobi_passes` (the passes a block is resolved with, which the engine reads from the checkpoint).
Refused, in one line naming the field: the DeepSeek/DSpark convention (`sample_from_anchor: true`), a rank, ratio
or pass count below 1, and what the DFlash backbone refuses.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar, Literal

from pydantic import Field

from opd.errors import OpdError
from opd.formats.dflash import DFlashConfig, DFlashSpec
from opd.formats.section import drafter_section
from opd.formats.speculators import backbone_public, dflash_speculators, model_type

KIND = "xpress"
ARCHITECTURE = "XPressSpeculator"  # XPressSpeculatorConfig's default `architectures`
DEFAULTS = {"xpress_rank": 256, "xpress_mlp_ratio": 2, "num_jacobi_passes": 6}  # XPressSpeculatorConfig's


def is_xpress(config: dict[str, Any]) -> bool:
    """Whether a drafter's config.json describes an XPress drafter."""
    return model_type(config) == KIND or ARCHITECTURE in (config.get("architectures") or [])


@drafter_section
class XPressSpec(DFlashSpec):
    """kind xpress: a DFlash drafter whose causal refiner head adds a bias to the block's logits, resolved by K
    Jacobi passes (speculators' `XPressDraftModel`, opd/models/xpress.py). A random one takes the refiner's
    fields; a warm one brings its own."""

    kind: Literal["xpress"] = "xpress"  # type: ignore[assignment]  # the union's tag: each family its own
    xpress_rank: int | None = Field(None, ge=1, description="the refiner's rank r; None = speculators' 256")
    xpress_mlp_ratio: int | None = Field(None, ge=1, description="the refiner MLP's width r x ratio; None = 2")
    jacobi_passes: int | None = Field(None, ge=1, description=(
        "K: Jacobi passes a block is resolved with, each re-fed the previous pass's argmax; None = speculators' 6"))

    # Drafts are the argmax after K passes, each pass fed the previous pass's argmax: no law a sampled draft is
    # drawn from is defined, so `serving.draft: sample` is refused (opd/spec/rules.py).
    samples_from_q: ClassVar[bool] = False

    @classmethod
    def detects(cls, config: dict[str, Any]) -> bool:
        return is_xpress(config)

    def init_issues(self, warm: bool) -> list[str]:
        given = [name for name in ("xpress_rank", "xpress_mlp_ratio", "jacobi_passes") if getattr(self, name)]
        return [f"{name}: set, but a warm XPress drafter brings its own (expected it unset)"
                for name in given] if warm else []

    def checkpoint_fields(self, config: dict[str, Any], layer_ids: list[int] | None) -> dict[str, tuple[Any, Any]]:
        return super().checkpoint_fields(xpress_public(config, None), layer_ids)


@dataclass
class XPressConfig(DFlashConfig):
    """A DFlash backbone of K slots (the anchor's included) and the refiner's fields."""

    xpress_rank: int = DEFAULTS["xpress_rank"]
    xpress_mlp_ratio: int = DEFAULTS["xpress_mlp_ratio"]
    jacobi_passes: int = DEFAULTS["num_jacobi_passes"]

    @classmethod
    def of(cls, backbone: DFlashConfig, xpress_rank: int, xpress_mlp_ratio: int, jacobi_passes: int
           ) -> XPressConfig:
        """The backbone's fields and the refiner's."""
        config = cls(**{f.name: getattr(backbone, f.name) for f in fields(DFlashConfig)})
        config.xpress_rank, config.xpress_mlp_ratio, config.jacobi_passes = xpress_rank, xpress_mlp_ratio, jacobi_passes
        return config

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], num_target_layers: int | None = None) -> XPressConfig:
        """Read speculators' XPress config.json for a target of `num_target_layers` (which it does not record)."""
        backbone = DFlashConfig.from_hf_dict(xpress_public(hf, num_target_layers))
        values = {name: hf.get(name, default) for name, default in DEFAULTS.items()}
        for name, value in values.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise OpdError(f"config field '{name}' is {value!r} (expected a positive integer)")
        return cls.of(backbone, xpress_rank=values["xpress_rank"], xpress_mlp_ratio=values["xpress_mlp_ratio"],
                      jacobi_passes=values["num_jacobi_passes"])

    def to_speculators_dict(self, verifier: str | None = None,
                            verifier_architectures: list[str] | None = None) -> dict[str, Any]:
        """speculators' XPress config.json: the backbone's, with the refiner's fields."""
        out = dflash_speculators(self.to_hf_dict(), verifier, verifier_architectures or [], KIND)
        return out | {"architectures": [ARCHITECTURE], "sample_from_anchor": False, "xpress_rank": self.xpress_rank,
                      "xpress_mlp_ratio": self.xpress_mlp_ratio, "num_jacobi_passes": self.jacobi_passes}


def xpress_public(hf: dict[str, Any], num_target_layers: int | None) -> dict[str, Any]:
    """The public DFlash config.json of an XPress config's backbone."""
    if model_type(hf) != KIND:
        raise OpdError(f"config field 'speculators_model_type' is {model_type(hf)!r} (expected '{KIND}': XPress "
                       "drafters are read in speculators' layout)")
    if hf.get("sample_from_anchor"):
        raise OpdError("config field 'sample_from_anchor' is true (expected false: XPress's fill-in block, slot 0 "
                       "the anchor, as its released checkpoints use)")
    return backbone_public(hf, hf.get("block_size"), num_target_layers)
