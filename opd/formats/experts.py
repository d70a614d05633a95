"""MoE experts in the two layouts they are stored in: one tensor per expert and projection, as public checkpoints
(Qwen3-Next, Qwen3.5-MoE, DeepSeek-V3, GLM-4.5) and vLLM's loaders keep them (`...experts.{N}.gate_proj.weight`,
`up_proj`, `down_proj`), and the fused tensors transformers 5's MoE layers hold (`...experts.gate_up_proj`
[E, 2I, H], gate rows before up rows, and `...experts.down_proj` [E, H, I]), which transformers' conversion mapping
and speculators' `MTPConverter` build the same way. Tensors not of an expert pass through both ways unchanged.
"""

from __future__ import annotations

import re
from typing import Any

from opd.errors import OpdError

PER_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
FUSED = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)$")
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def stores_per_expert(names: Any) -> bool:
    """Whether a checkpoint's tensor names keep experts one tensor per expert."""
    return any(PER_EXPERT.match(name) for name in names)


def fuse_experts(state: dict[str, Any], where: str) -> dict[str, Any]:
    """`state` with every per-expert group fused into transformers' tensors; a group missing an expert or a
    projection is a one-line OpdError naming `where`."""
    import torch

    groups: dict[str, dict[int, dict[str, Any]]] = {}
    out = {}
    for name, tensor in state.items():
        match = PER_EXPERT.match(name)
        if match is None:
            out[name] = tensor
        else:
            groups.setdefault(match[1], {}).setdefault(int(match[2]), {})[match[3]] = tensor
    for prefix, experts in groups.items():
        count = max(experts) + 1
        gaps = [f"{prefix}.{i}.{p}.weight" for i in range(count) for p in PROJECTIONS if p not in experts.get(i, {})]
        if gaps:
            raise OpdError(f"{where}: missing {gaps[0]} (expected every expert 0..{count - 1} with "
                           f"{', '.join(PROJECTIONS)})")
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([experts[i]["gate_proj"], experts[i]["up_proj"]], dim=0) for i in range(count)])
        out[f"{prefix}.down_proj"] = torch.stack([experts[i]["down_proj"] for i in range(count)])
    return out


def split_experts(state: dict[str, Any]) -> dict[str, Any]:
    """`state` with transformers' fused expert tensors written one tensor per expert and projection (the inverse
    of `fuse_experts`)."""
    out = {}
    for name, tensor in state.items():
        match = FUSED.match(name)
        if match is None:
            out[name] = tensor
        elif match[2] == "down_proj":
            out |= {f"{match[1]}.{i}.down_proj.weight": t for i, t in enumerate(tensor.unbind(0))}
        else:
            for i, both in enumerate(tensor.unbind(0)):
                gate, up = both.chunk(2, dim=0)
                out |= {f"{match[1]}.{i}.gate_proj.weight": gate, f"{match[1]}.{i}.up_proj.weight": up}
    return out


def split_shapes(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The shapes `split_experts` writes for tensors of `shapes` (split on the meta device: nothing allocated)."""
    import torch

    meta = {name: torch.empty(shape, device="meta") for name, shape in shapes.items()}
    return {name: tuple(t.shape) for name, t in split_experts(meta).items()}
