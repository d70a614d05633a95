"""What every drafter family's checkpoint directory shares: its two files, the target facts a checkpoint is
checked against, writing a config.json with its weights, reading the weights back, and an integer field of a
config.json read with a one-line error. The families' formats (opd/formats/dflash.py, eagle3.py, ...) build on
these; none of them imports another's private helpers."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from opd.errors import OpdError
from opd.model_dir import CONFIG_FILE, WEIGHTS_FILE

if TYPE_CHECKING:  # torch and safetensors load inside the functions that read or write tensors
    import torch

__all__ = ["CONFIG_FILE", "FRESH_FIELDS", "NO_ROPE_BASE", "missing_fresh_fields", "save_weights", "WEIGHTS_FILE", "TargetShape", "int_field", "load_weights", "write_layout"]

# A fresh drafter copies these from its target's config; a target whose config lacks one (Kimi Linear's MLA layers
# carry no RoPE and state no context length) needs the spec to give it: the field to set, and what to set it to.
FRESH_FIELDS = {
    "rope_theta": "its target family's usual RoPE base: 10000 for Llama 2, 1000000 for Qwen3",
    "max_position_embeddings": "the target's context length, e.g. 131072",
    "intermediate_size": "the drafter's MLP width; an MoE target states only its experts' (moe_intermediate_size), "
                         "and a drafter as wide as a dense layer of its size takes e.g. 4x hidden_size",
}
NO_ROPE_BASE = ("the target's config has no RoPE base (rope_theta; its attention carries no RoPE, as Kimi Linear's "
                "MLA layers): set models.drafter.rope_theta, the fresh drafter's (its target family's usual base)")


def missing_fresh_fields(names: list[str]) -> OpdError:
    """One error naming every target field a fresh drafter lacks, each with the spec field that gives it and what
    to set there, so a user does not learn them one run at a time."""
    wanted = "; ".join(f"{name}: set models.drafter.{name} ({FRESH_FIELDS[name]})" for name in names)
    return OpdError(f"the target's config lacks what a fresh drafter copies from it: {wanted}")


class TargetShape(Protocol):
    """The target facts a drafter checkpoint is checked against: a loaded `Target`, the learner's `SharedHead`
    (opd/models/shared_head.py) or the preflight's reading of config.json all have them."""

    hidden_size: int
    vocab_size: int
    num_layers: int
    layer_ids: list[int]

    @property
    def config(self) -> Any:
        """The language model's transformers config (`get_text_config`): what a fresh drafter copies."""


def int_field(d: dict[str, Any], name: str, prefix: str = "") -> int:
    value = d.get(name)
    if value is None:
        raise OpdError(f"config field '{prefix}{name}' is missing")
    if not isinstance(value, int) or isinstance(value, bool):
        raise OpdError(f"config field '{prefix}{name}' must be an integer, got {value!r}")
    return value


def write_layout(directory: str | Path, hf: dict[str, Any], tensors: dict[str, torch.Tensor],
                 dtype: torch.dtype) -> None:
    """Write config.json `hf` (with `dtype`) and the state dict `tensors` as model.safetensors."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    hf["dtype"] = str(dtype).removeprefix("torch.")
    (directory / CONFIG_FILE).write_text(json.dumps(hf, indent=2) + "\n")
    save_weights({name: t.detach().contiguous().cpu() for name, t in tensors.items()}, directory / WEIGHTS_FILE)


def save_weights(tensors: dict[str, torch.Tensor], path: str | Path) -> None:
    """A safetensors file readable as the user's umask says, like the config.json beside it: safetensors writes
    mode 0600, which a vLLM server running as another user cannot read."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata={"format": "pt"})
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


def load_weights(path: Path) -> dict[str, torch.Tensor]:
    """A drafter's model.safetensors, or a one-line OpdError when it is missing or unreadable."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not path.is_file():
        raise OpdError(f"{path}: drafter weights not found")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as exc:
        raise OpdError(f"{path}: unreadable safetensors file ({exc})") from exc
