"""A target that spans the ranks of one replica: transformers' tensor-parallel plan (and expert-parallel plan, for
MoE targets) over one `torch.distributed` group, nccl between GPUs and gloo on CPU.

Every rank holds a `Target` over its shard and runs the same calls in the same order (SPMD): a forward is a
sequence of collectives (the row-parallel projections sum their partial outputs; the LM head gathers its vocabulary
columns), so a rank that skipped one would hang the others. What each rank gets back is the whole result: the
hidden states between layers, the features the hooks capture, the final norm's output and the logits are
replicated, never a shard. So the project's code runs unchanged on top: decoding, replay, the rebuild and the
chunked LM head. The drafter and the teacher's LM head read the target's embedding and head weights directly
(`F.embedding(ids, embed_tokens.weight)`), which a shard cannot serve, so `ShardedTarget` hands them whole copies,
gathered once at load: one more embedding and head per rank (2 GB in bf16 at a 248K vocabulary and width 4096).
Inside a layer the attention functions see the rank's heads only; `packed_attention`'s wrappers take the head
count from the tensors they are given, and a layer's sinks are checked here to be sharded like its heads.

The degree must divide the heads and the experts, and divide or be a multiple of the key/value heads (past them,
each rank holds the attention whole: `distributed_config`): `opd.spec` checks it from the target's config before
anything runs (`shard_degree_issues`), and a loading error of transformers becomes one line here.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from opd.errors import OpdError
from opd.models.shared_head import skeleton
from opd.models.target import Target, load_target

# A rank waits in a collective while another still loads its shard (minutes at hundreds of GB) or runs a call.
TIMEOUT = timedelta(hours=2)


@dataclass(frozen=True)
class ShardGroup:
    """This process's place among a replica's ranks (the group is torch.distributed's default one)."""

    rank: int = 0
    world: int = 1


def join_group(address: str, rank: int, world: int, device: str, timeout: timedelta = TIMEOUT) -> ShardGroup:
    """Join the replica's process group at `address` (rank 0's host:port); blocks until all `world` ranks joined.

    transformers places each rank's shard on the accelerator numbered LOCAL_RANK; a Ray actor sees only its own
    GPU, so that index is 0 wherever a rank sees one device. Every collective fails after `timeout`, so the peers
    of a rank that stopped do not wait forever."""
    if world > 1 and not dist.is_initialized():
        cuda = torch.device(device).type == "cuda"
        os.environ["LOCAL_RANK"] = str(0 if not cuda or torch.cuda.device_count() == 1 else rank)
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://{address}", rank=rank,
                                world_size=world, timeout=timeout)
    return ShardGroup(rank, world)


def own_rank() -> int:
    """This process's rank in its replica's group (0 outside one)."""
    return dist.get_rank() if dist.is_initialized() else 0


def load_sharded_target(path: str, *, dtype: torch.dtype, attn_implementation: str | None, layer_ids: list[int],
                        device: str, world: int) -> Target:
    """The target at `path` sharded over the `world` ranks of the current process group (`join_group`), or
    loaded whole by `load_target` when `world` is 1."""
    if world == 1:
        return load_target(path, dtype=dtype, attn_implementation=attn_implementation, layer_ids=layer_ids,
                           device=device)
    if not dist.is_initialized() or dist.get_world_size() != world:
        raise OpdError(f"target model {path}: sharding over {world} ranks needs their process group (join_group)")
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation,
                                                     local_files_only=True,
                                                     distributed_config=distributed_config(path, world, dtype))
    except (OSError, ValueError, RuntimeError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise OpdError(f"target model {path} over {world} ranks: {first_line}") from exc
    check_sinks(model)
    _watch_collectives(model)
    return ShardedTarget(model, layer_ids)


_ENTERED: list[str] = []  # the sharded module this process's target entered last (a process holds one target)


def _watch_collectives(model: nn.Module) -> None:
    """Record which sharded module a forward entered last, so that a collective that fails or times out (a peer
    died or stopped) is named by where the model was, not only by the transport's operation (gloo's `recv`). The
    hook runs before the tensor-parallel plan's own input hook, whose redistribution may be the collective."""
    for name, module in model.named_modules():
        if (where := _sharding(module)) is not None:
            module.register_forward_pre_hook(partial(_enter, f"{name}, its {where}"), prepend=True)
    model.register_forward_hook(lambda *_: _ENTERED.clear())  # a forward that finished was in no collective


def _sharding(module: nn.Module) -> str | None:
    """How `module`'s own weight is split over the ranks ("weight sharded on dim 1"), None when it is not."""
    for param in module.parameters(recurse=False):
        dims = [p.dim for p in getattr(param, "placements", ()) if hasattr(p, "dim")]
        if dims:
            return f"{'weight' if param is getattr(module, 'weight', None) else 'parameter'} sharded on dim {dims[0]}"
    return None


def _enter(where: str, module: nn.Module, args: Any) -> None:
    _ENTERED[:] = [where]


def in_collective(exc: BaseException) -> BaseException:
    """`exc` with where this rank's sharded forward was when it raised (a collective's peer gone), so the line that reports a hung or dead rank names the collective's module; `exc` itself when no sharded
    forward ran here or it is not a runtime error (what collectives raise)."""
    if not _ENTERED or not isinstance(exc, RuntimeError):
        return exc
    first = (str(exc).strip().splitlines() or [""])[0]
    return RuntimeError(f"{first} (in the collective of {_ENTERED[0]})")


class ShardedTarget(Target):
    """A `Target` over this rank's shard whose `embed_tokens` and `lm_head` are whole, plain copies (the model's
    own forward still runs its sharded ones): what the drafter shares and the teacher's LM head reads."""

    def __init__(self, model: Any, layer_ids: list[int]) -> None:
        super().__init__(model, layer_ids)
        gathered: dict[int, torch.Tensor] = {}  # tied embedding and head: gathered once, still tied
        self._whole = nn.ModuleDict({"embed": _replicated(model.get_input_embeddings(), gathered),
                                     "head": _replicated(model.get_output_embeddings(), gathered)})

    @property
    def embed_tokens(self) -> nn.Embedding:
        return cast(nn.Embedding, self._whole["embed"])

    @property
    def lm_head(self) -> nn.Linear:
        return cast(nn.Linear, self._whole["head"])


def _replicated(module: nn.Module, gathered: dict[int, torch.Tensor]) -> nn.Module:
    """`module` with whole, frozen tensors and none of the hooks tensor parallelism put on it (they would gather
    or shard its input and output again)."""
    plain = copy.copy(module)
    for name in [n for n in vars(module) if "hooks" in n]:
        setattr(plain, name, type(getattr(module, name))())
    plain._parameters = {name: nn.Parameter(_whole(p, gathered), requires_grad=False)
                         for name, p in module._parameters.items() if p is not None}
    plain._buffers = {name: _whole(b, gathered) for name, b in module._buffers.items() if b is not None}
    return plain


def _whole(tensor: torch.Tensor, gathered: dict[int, torch.Tensor]) -> torch.Tensor:
    """A DTensor's full value (a collective: every rank calls it, in the same order), a plain tensor as is."""
    if id(tensor) not in gathered:
        gathered[id(tensor)] = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor.detach()
    return gathered[id(tensor)]


def distributed_config(path: str, world: int, dtype: torch.dtype) -> Any:
    """transformers' plan for `world` ranks: tensor parallel over them, and expert parallel over the same ranks
    where the model has an expert plan (each rank then holds 1/world of the experts, and their outputs are summed
    with the attention's). Where `world` does not divide the key/value heads (Qwen3.5's 2 at 4 or 8 ranks), the
    attention stays whole on every rank, its keys and values with it, as vLLM replicates key/value heads past
    their count: the plan's head split would give a rank a fraction of a key/value head."""
    from transformers import AutoConfig
    from transformers.distributed import DistributedConfig

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    experts = _expert_count(config)
    extra = {"ep_size": world} if experts else {}
    # an empty override would drop every rule; a plan without attention rules (gpt-oss's) stays as it is
    whole = {} if attention_splits(config.get_text_config(decoder=True), world) else _whole_attention(config)
    return DistributedConfig(tp_plan=whole or "auto", tp_size=world, **extra)


def attention_splits(text_config: Any, world: int) -> bool:
    """Whether `world` ranks split the attention by heads (else each holds it whole)."""
    return int(getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads) % world == 0


def _whole_attention(config: Any) -> dict[str, str]:
    """The model's plan with every attention rule (`self_attn.`) turned into "replicate": those modules load whole
    and run on every rank as in one process. The plan's full names come from the model built on the meta device."""
    return {name: "replicate" for name in skeleton(config).tp_plan if ".self_attn." in name}


def _expert_count(config: Any) -> int:
    text = config.get_text_config(decoder=True)
    return int(getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None) or 0)


def check_sinks(model: Any) -> None:
    """A layer's sinks (`s_aux`, one logit per head) must be split like its query heads, or each rank's softmax
    would take another rank's sinks: refused in one line, naming the layer."""
    config = model.config.get_text_config(decoder=True)
    heads, head_dim = int(config.num_attention_heads), getattr(config, "head_dim", None)
    for name, module in model.named_modules():
        sinks = getattr(module, "sinks", None)
        q_proj = getattr(module, "q_proj", None)
        if sinks is None or q_proj is None:
            continue
        local_heads = _local(q_proj.weight).shape[0] // int(head_dim or q_proj.weight.shape[0] // heads)
        if _local(sinks).numel() != local_heads:
            raise OpdError(f"target {type(model).__name__}: {name}.sinks holds {_local(sinks).numel()} of "
                           f"{heads} heads' sinks but the rank runs {local_heads} heads (expected them sharded alike)")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter (a DTensor's local shard; a plain tensor is all of it)."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def build_sharded_target(spec: Any, world: int) -> Target:
    """The spec's target over this replica's `world` ranks (`build_target` when `world` is 1)."""
    from opd.models.build import DTYPES, resolve_device

    m = spec.models
    return load_sharded_target(m.target_path, dtype=DTYPES[m.dtype], attn_implementation=m.attn_implementation,
                               layer_ids=m.layer_ids or [], device=resolve_device(m.device), world=world)
