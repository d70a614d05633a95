"""P-EAGLE checkpoints (arXiv 2602.01469) in vLLM's `speculators` layout: `config.json` <-> `PEagleConfig`, the
tensors, and the `models.drafter` section of kind `peagle`.

P-EAGLE is an EAGLE-3 drafter that drafts the whole chain in one pass (speculators' `PEagleDraftModel`, 0.9.0):
the chain's later slots are not fed the drafts before them but the pard token (`mask_token_id`) and a learned
state `mask_hidden` [1, 1, 3H] in place of the target's three fused states. So its config is speculators' EAGLE-3
one with `speculators_model_type: peagle`, `mask_token_id` and `embed_requires_grad` (P-EAGLE trains its own copy of
the embedding, which the checkpoint carries as `embed_tokens.weight`), and its tensors are EAGLE-3's (`layers.0.*`
for SpecForge's `midlayer.*`) plus `mask_hidden` and `embed_tokens.weight`. The chain's length is the proposal's
`speculative_tokens` (speculators' `num_depths`), K - 1 here. vLLM reads this layout as `method: eagle3` with
`parallel_drafting: true`, the mask token as its `pard_token`.

What the EAGLE-3 reader refuses (more than one layer, `norm_before_residual`, ...) is refused here too, in one line
naming the field.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import Field

from opd.errors import OpdError
from opd.formats.checkpoint import CONFIG_FILE, TargetShape, load_weights
from opd.formats.eagle3 import (
    SHARED_EMBEDDING,
    Eagle3Config,
    Eagle3Spec,
    check_fits_target,
    check_mapping,
    eagle3_speculators,
    eagle3_tensor_name,
    speculators_layer_ids,
    speculators_tensor_names,
    write_layout_of,
)
from opd.formats.eagle3 import expected_shapes as eagle3_shapes
from opd.formats.section import drafter_section
from opd.formats.speculators import MODEL_TYPE, model_type, proposed_tokens, speculators_config
from opd.model_dir import ModelDir

if TYPE_CHECKING:
    import torch

KIND = "peagle"
ARCHITECTURE = "PEagleSpeculator"  # PEagleSpeculatorConfig's default architectures
MASK_HIDDEN = "mask_hidden"
OWN_EMBEDDING = "embedding.weight"  # the drafter's own embedding, speculators' `embed_tokens.weight`


@drafter_section
class PEagleSpec(Eagle3Spec):
    """kind peagle: an EAGLE-3 drafter whose chain is drafted in one pass from the pard token and a learned
    `mask_hidden` (P-EAGLE, speculators' `PEagleDraftModel`, opd/models/peagle.py); must match a warm drafter's
    checkpoint when one is given."""

    kind: Literal["peagle"] = "peagle"  # type: ignore[assignment]  # the union's tag: each family its own
    mask_token_id: int | None = Field(None, ge=0, description="the pard token; None = the tokenizer's mask token")

    # Its slots do not read the drafts before them, so each slot's softmax(logits / T) is the q its draft is
    # sampled from, independently of the others.
    samples_from_q: ClassVar[bool] = True

    @classmethod
    def detects(cls, config: dict[str, Any]) -> bool:
        return model_type(config) == KIND

    def checkpoint_fields(self, config: dict[str, Any], layer_ids: list[int] | None) -> dict[str, tuple[Any, Any]]:
        return {"block_size": (self.block_size, _speculative_tokens(config) + 1),
                "draft_vocab_size": (self.draft_vocab_size, config.get("draft_vocab_size")),
                "mask_token_id": (self.mask_token_id, config.get("mask_token_id")),
                "target_layer_ids": (layer_ids, speculators_layer_ids(config))}


@dataclass
class PEagleConfig(Eagle3Config):
    """An EAGLE-3 drafter's hyper-parameters, its pard token and whether its own embedding trains."""

    mask_token_id: int = field(kw_only=True)
    embed_requires_grad: bool = field(default=True, kw_only=True)  # PEagleSpeculatorConfig's default

    @classmethod
    def of(cls, base: Eagle3Config, mask_token_id: int, embed_requires_grad: bool = True) -> PEagleConfig:
        """The P-EAGLE drafter on EAGLE-3 hyper-parameters `base`; a pard token outside the vocabulary is refused."""
        if not 0 <= mask_token_id < base.vocab_size:
            raise OpdError(f"config field 'mask_token_id' is {mask_token_id}; expected a token id in "
                           f"0..{base.vocab_size - 1} (the pard token is embedded)")
        return cls(**asdict(base), mask_token_id=mask_token_id, embed_requires_grad=embed_requires_grad)

    @classmethod
    def from_speculators(cls, hf: dict[str, Any], num_target_layers: int) -> PEagleConfig:
        """Read speculators' P-EAGLE config.json for a target of `num_target_layers`."""
        if model_type(hf) != KIND:
            raise OpdError(f"config field '{MODEL_TYPE}' is {model_type(hf)!r} (expected '{KIND}': P-EAGLE drafters "
                           "are read in speculators' layout)")
        mask = hf.get("mask_token_id")
        if not isinstance(mask, int) or isinstance(mask, bool):
            raise OpdError(f"config field 'mask_token_id' is {mask!r} (expected the pard token's id, which vLLM "
                           "requires)")
        grad = hf.get("embed_requires_grad", True)
        if not isinstance(grad, bool):
            raise OpdError(f"config field 'embed_requires_grad' must be true or false, got {grad!r}")
        base = Eagle3Config.from_hf_dict(hf | {MODEL_TYPE: "eagle3"}, num_target_layers=num_target_layers,
                                         block_size=_speculative_tokens(hf) + 1)
        return cls.of(base, mask, grad)

    def to_speculators_dict(self, verifier: str | None = None,
                            verifier_architectures: list[str] | None = None) -> dict[str, Any]:
        """speculators' P-EAGLE config.json: its EAGLE-3 one, renamed, with the pard token and the chain's length."""
        out = eagle3_speculators(self.to_hf_dict(), verifier, verifier_architectures or [])
        return out | {MODEL_TYPE: KIND, "architectures": [ARCHITECTURE], "mask_token_id": self.mask_token_id,
                      "embed_requires_grad": self.embed_requires_grad,
                      "speculators_config": speculators_config(KIND, self.block_size - 1, verifier,
                                                               verifier_architectures or [])}


def _speculative_tokens(hf: dict[str, Any]) -> int:
    """The chain's length a speculators config proposes (its first proposal's `speculative_tokens`)."""
    count = proposed_tokens(hf)
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise OpdError(f"config field 'speculators_config.proposal_methods[0].speculative_tokens' is {count!r} "
                       "(expected a positive integer: the tokens P-EAGLE drafts per pass)")
    return count


def read_config(directory: ModelDir, target: TargetShape) -> PEagleConfig:
    """Parse a P-EAGLE directory's config.json and check it describes a drafter for this very target, before any
    tensor loads."""
    path = directory.path / CONFIG_FILE
    try:
        config = PEagleConfig.from_speculators(directory.config, target.num_layers)
    except OpdError as exc:
        raise OpdError(f"{path}: {exc}") from exc
    check_fits_target(path, config, target, "the target's hidden size")
    return config


def expected_shapes(config: PEagleConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a checkpoint, with SpecForge's names for EAGLE-3's and the drafter's own embedding's."""
    return eagle3_shapes(config) | {MASK_HIDDEN: (1, 1, 3 * config.target_hidden_size),
                                    OWN_EMBEDDING: (config.vocab_size, config.hidden_size)}


def file_shapes(config: PEagleConfig) -> dict[str, tuple[int, ...]]:
    """The tensors of a checkpoint under speculators' names, less `embed_tokens.weight`, which may be absent
    (speculators then reloads the verifier's)."""
    shapes = expected_shapes(config)
    shapes.pop(OWN_EMBEDDING)
    return speculators_tensor_names({k: v for k, v in shapes.items() if k not in _absent_maps(config)})


def _absent_maps(config: PEagleConfig) -> tuple[str, ...]:
    """The vocabulary maps a checkpoint leaves out: both when the draft vocabulary is the whole one (speculators
    then has no `d2t` and `t2d`, whose only value is the identity)."""
    return ("d2t", "t2d") if config.draft_vocab_size == config.vocab_size else ()


def _identity_maps(vocab_size: int) -> dict[str, torch.Tensor]:
    import torch

    return {"d2t": torch.zeros(vocab_size, dtype=torch.long), "t2d": torch.ones(vocab_size, dtype=torch.bool)}


def read_tensors(path: Path, config: PEagleConfig) -> dict[str, torch.Tensor]:
    """Load model.safetensors under the drafter's names and check names, shapes and the vocabulary mapping (the
    identity where the draft vocabulary is the whole one and the file has none); an absent `embed_tokens.weight`
    (speculators reloads it from the verifier) is left to the caller."""
    tensors = {eagle3_tensor_name(name): t for name, t in load_weights(path).items()}
    if SHARED_EMBEDDING in tensors:
        tensors[OWN_EMBEDDING] = tensors.pop(SHARED_EMBEDDING)
    if _absent_maps(config) and "d2t" not in tensors and "t2d" not in tensors:
        tensors |= _identity_maps(config.vocab_size)
    shapes = expected_shapes(config)
    for label, names in (("missing", shapes.keys() - tensors.keys() - {OWN_EMBEDDING}),
                         ("unexpected", tensors.keys() - shapes.keys())):
        if names:
            listed = sorted(names)
            raise OpdError(f"{path}: {label} tensor(s) {', '.join(listed[:5])}" + (" ..." if len(listed) > 5 else ""))
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != shapes[name]:
            shown = SHARED_EMBEDDING if name == OWN_EMBEDDING else name
            raise OpdError(f"{path}: tensor {shown} has shape {list(tensor.shape)}, expected {list(shapes[name])}")
    check_mapping(path, tensors["d2t"], tensors["t2d"], config.vocab_size)
    return tensors


def write_checkpoint(directory: str | Path, config: PEagleConfig, state: dict[str, torch.Tensor],
                     dtype: torch.dtype, verifier: str | None = None,
                     verifier_architectures: list[str] | None = None) -> None:
    """Write config.json and model.safetensors in speculators' layout, naming `verifier` (None: none); the
    vocabulary maps only where the draft vocabulary is reduced, as speculators saves them."""
    shapes = expected_shapes(config)
    bad = {name: tuple(t.shape) for name, t in state.items() if shapes.get(name) != tuple(t.shape)}
    if bad or state.keys() != shapes.keys():
        raise ValueError(f"state does not match the P-EAGLE layout: {bad or sorted(shapes.keys() ^ state.keys())}")
    named = {(SHARED_EMBEDDING if name == OWN_EMBEDDING else name): t for name, t in state.items()
             if name not in _absent_maps(config)}
    write_layout_of(directory, config.to_speculators_dict(verifier, verifier_architectures), speculators_tensor_names(named),
           dtype)
