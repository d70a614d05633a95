"""What a learner needs of the target: its embedding, its LM head and a few config facts, never its decoder.

The drafter borrows the target's embedding (for block tokens) and LM head (for drafted logits and the teacher's
exact distribution from shipped hidden states); everything else of the target lives in the rollout and scorer
actors. Loading the whole target into the learner would cost its full size in GPU memory for nothing: ~8 GB at
Qwen3-4B, ~61 GB at Qwen3-30B-A3B. `load_shared_head` reads exactly those two tensors from the target's
safetensors files (one file, or shards listed in model.safetensors.index.json); with `tie_word_embeddings` the
LM head is the embedding itself. A family that scales its embedding's rows (Gemma, by sqrt(hidden)) does it in its
embedding module; the plain copy here keeps that factor as the module's `scalar_embed_scale`, as transformers' own
scaled embeddings name it, so `embedding_scale` reads the same from a `SharedHead` as from a `Target`. A
`SharedHead` stands in for a `Target` wherever a drafter is built (`DFlashDrafter.from_pretrained`, `read_config`,
`DFlashConfig.for_target`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from opd.errors import OpdError
from opd.model_dir import TARGET_FIELD, TEXT_PREFIXES, WEIGHTS_FILE, WEIGHTS_INDEX, ModelDir

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class SharedHead:
    """The target's frozen embedding and LM head, with the facts a drafter is checked against."""

    def __init__(self, config: Any, embed_tokens: nn.Embedding, lm_head: nn.Linear, layer_ids: list[int]) -> None:
        self.config = config
        self.embed_tokens, self.lm_head = embed_tokens.requires_grad_(False), lm_head.requires_grad_(False)
        self.layer_ids = [int(i) for i in layer_ids]
        self.num_layers = int(config.num_hidden_layers)
        self.hidden_size = int(config.hidden_size)
        self.vocab_size = int(config.vocab_size)
        _check_layer_ids(self.layer_ids, self.num_layers)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device


def embedding_scale(embed: nn.Module) -> float | None:
    """The factor a target's embedding multiplies its rows by (transformers' scaled embeddings keep it as
    `scalar_embed_scale`); None for a plain embedding. A drafter built for the target takes it as its
    `input_embedding_scale`, as the public drafters for such families do."""
    scale = getattr(embed, "scalar_embed_scale", None)
    return None if scale is None or float(scale) == 1.0 else float(scale)


def skeleton(config: Any) -> PreTrainedModel:
    """The causal LM of `config` on the meta device: its module tree and parameter names, no memory, no weights."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def load_shared_head(path: str, *, dtype: torch.dtype, layer_ids: list[int], device: str = "cpu") -> SharedHead:
    """Read the embedding and LM head of the HF causal LM directory `path`, and nothing else of its weights (a
    multimodal checkpoint's language model under its published prefix; the vision tower is never read)."""
    config = target_config(path)
    _check_layer_ids(layer_ids, int(config.num_hidden_layers))  # before reading any weights
    model = skeleton(config)
    embed_names, head_names, head_bias = _parameter_names(model)
    stored = _stored_tensors(Path(path))
    embed_weight = _read(stored, embed_names, path, "input embedding")
    embed = nn.Embedding(embed_weight.shape[0], embed_weight.shape[1], device="meta")
    embed.weight = nn.Parameter(embed_weight.to(device=device, dtype=dtype), requires_grad=False)
    scale = embedding_scale(model.get_input_embeddings())
    if scale is not None:
        embed.scalar_embed_scale = scale  # type: ignore[assignment]  # Module.__setattr__ is typed for tensors/modules
    tied = bool(getattr(config, "tie_word_embeddings", False))
    head_weight = embed.weight if tied else nn.Parameter(
        _read(stored, head_names, path, "LM head").to(device=device, dtype=dtype), requires_grad=False)
    head = nn.Linear(head_weight.shape[1], head_weight.shape[0], bias=head_bias, device="meta")
    head.weight = head_weight
    if head_bias:
        bias = _read(stored, [n.removesuffix("weight") + "bias" for n in head_names], path, "LM head bias")
        head.bias = nn.Parameter(bias.to(device=device, dtype=dtype), requires_grad=False)
    return SharedHead(config, embed, head, layer_ids)


def _check_layer_ids(layer_ids: list[int], num_layers: int) -> None:
    if not layer_ids or any(not 0 <= i < num_layers for i in layer_ids):
        raise OpdError(f"target layer_ids {layer_ids}: expected non-empty ids in [0, {num_layers})")


def target_config(path: str) -> Any:
    """The target's language model's transformers config, from its config.json alone: a multimodal checkpoint's
    `text_config`, as every role loads it (`load_target`). A one-line OpdError when unreadable, or when the
    directory is a drafter's."""
    from transformers import AutoConfig

    ModelDir.read(path, "target model").expect("target", TARGET_FIELD)
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True).get_text_config(decoder=True)
    except (OSError, ValueError) as exc:
        raise OpdError(f"target model {path}: {str(exc).strip().splitlines()[0]}") from exc


def _parameter_names(model: PreTrainedModel) -> tuple[list[str], list[str], bool]:
    """The checkpoint names of the embedding and LM head weights (every alias a tied model has), and whether the
    head has a bias, from the model class's `skeleton` (any HF architecture)."""
    named = list(model.named_parameters(remove_duplicate=False))
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    embed_names = [n for n, p in named if p is embed.weight]
    head_names = [n for n, p in named if p is head.weight]
    return embed_names, head_names, getattr(head, "bias", None) is not None


def _stored_tensors(directory: Path) -> dict[str, tuple[Path, str]]:
    """Text-only tensor name -> (the safetensors file holding it, the name it is stored under there)."""
    model_dir = ModelDir.read(directory, "target model")
    files = model_dir.tensor_files()
    if not files:
        raise OpdError(f"target model {directory}: neither {WEIGHTS_FILE} nor {WEIGHTS_INDEX} found")
    return {name: (files[stored], stored) for name, stored in model_dir.text_names().items()}


def _read(stored: dict[str, tuple[Path, str]], names: list[str], path: str, what: str) -> torch.Tensor:
    """The first of `names` the checkpoint holds, read alone from its file (memory-mapped, no other tensor)."""
    name = next((n for n in names if n in stored), None)
    if name is None:
        raise OpdError(f"target model {path}: no {what} tensor (expected one of {', '.join(names)}, or the same "
                       f"under a published prefix: {', '.join(TEXT_PREFIXES)})")
    file, stored_name = stored[name]
    with _open(file) as f:
        return f.get_tensor(stored_name)


def _open(file: Path):
    try:
        return safe_open(str(file), framework="pt")
    except (SafetensorError, OSError) as exc:
        raise OpdError(f"{file}: unreadable safetensors file ({exc})") from exc
