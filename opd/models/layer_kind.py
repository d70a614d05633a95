"""Target layer kinds as registered classes: the one seam a target family's layers pass through.

A target is a stack of decoder layers of a few kinds (transformers' layer types: `full_attention`,
`sliding_attention`, `linear_attention`, ...). Each kind is one class in `opd/models/kinds/`, registered under its
layer type, and answers for its layers everything the project adds to transformers' own model code:

- which keys a query sees beyond causality, by position (`sees`, `lowest_key`): the decoder's masks
  (`kind_masks`) and packed replay's (`packed_attention`) both read it;
- how its cache follows the decoder's per-row acceptance: an attention kind's cache holds one key and value per
  token, which the decoder packs per row (`columns`, opd/decoding/compaction.py); a recurrent kind rolls its state
  back itself (`rollback`);
- how packed replay runs a drafted block from its anchor: an attention kind through the mask alone; a recurrent
  kind from its state at the anchor (`replay`);
- what it costs beyond its weights (`state_flops` per token, `block_flops` per replayed block);
- what it cannot run exactly (`check`, `static_cache_problem`), refused in one line.

The target maps each layer to its kind once (`layer_kinds`); every other module asks that map. Kinds that share a
layer type (transformers types Gated DeltaNet and Kimi Delta Attention layers alike `linear_attention`) tell their
configs apart (`fits`). A layer type no registered kind fits is refused in one line naming it and its layers
(docs/guides/target-layer-kind.md).
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any, ClassVar

import torch
from torch import nn

from opd.errors import OpdError

_KINDS: dict[str, list[type[LayerKind]]] = {}


class LayerKind:
    """One kind of target layer, over the layers `layers` of a model whose text config is `config`. The defaults
    are those of plain full attention: no narrowing, a cache of per-token columns, nothing beyond the weights."""

    name: ClassVar[str]  # transformers' layer type
    label: ClassVar[str]  # how a one-line message names its layers ("sliding-window")
    columns: ClassVar[bool] = True  # its cache holds a key and value per token (packed per row by the decoder)
    # whether `sees` depends on the distance q − p alone: a block's mask is then one template slid along the cache
    by_distance: ClassVar[bool] = True

    def __init__(self, config: Any, layers: tuple[int, ...]) -> None:
        self.config, self.layers = config, layers

    @classmethod
    def fits(cls, config: Any) -> bool:
        """Whether this kind runs the layers of its type in a model of this text config (where kinds share a type)."""
        return True

    @property
    def narrows(self) -> bool:
        """Whether its keys are narrowed beyond causality (a mask of its own, counted in positions)."""
        return False

    def sees(self, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor | None:
        """Bool, broadcast of query positions against key positions: which causally earlier keys a query sees;
        None where it sees them all."""
        return None

    def lowest_key(self, position: int) -> int:
        """The lowest key position a query at `position` can see (keys before it need no compute)."""
        return 0

    def check(self, model: nn.Module) -> None:
        """Refuse, in one line, a model whose layers of this kind nothing here runs exactly."""
        config: Any = model.config
        if self.narrows and config._attn_implementation == "flash_attention_2":
            raise OpdError(f"target {type(model).__name__}: its {self.label} layers need attn_implementation sdpa "
                           "or eager (flash-attn counts their window in cache columns, which the decoder's per-row "
                           "packing moves)")

    def static_cache_problem(self) -> str | None:
        """Why `rollout.static_cache` cannot hold these layers ("a target that has ... layers (why)"), or None."""
        if self.narrows:
            return (f"a target that has {self.label} layers (a static cache's {self.label} layers count their "
                    "keys in cache columns, which per-row packing moves)")
        return None

    def rollback(self, model: nn.Module) -> Any:
        """What rolls these layers' caches back per row after a verification beyond packing their columns (a
        `RecurrentRollback`), or None: an attention kind's columns are packed per row by the decoder."""
        return None

    def replay(self, model: nn.Module) -> Any:
        """What runs these layers' drafted blocks from their anchors in a packed forward (a `LinearReplay`), or
        None: an attention kind reads the packed layout from its mask."""
        return None

    def select_rows(self, layer: Any, keep: torch.Tensor) -> None:
        """Keep only the batch rows `keep` of one of its cache layers."""
        layer.batch_select_indices(keep)

    def state_flops(self) -> int:
        """FLOPs per token over all its layers that no weight counts (a recurrent state's update)."""
        return 0

    def block_flops(self) -> int:
        """FLOPs per drafted block in packed replay beyond the forward over its rows (advancing a state)."""
        return 0


def register(kind: type[LayerKind]) -> type[LayerKind]:
    """Class decorator: `kind` answers for transformers' layer type `kind.name` in the configs it `fits`."""
    _KINDS.setdefault(kind.name, []).append(kind)
    return kind


def _registered() -> dict[str, list[type[LayerKind]]]:
    """Every kind in `opd/models/kinds/`, imported once: a new kind is a new file there, listed nowhere else."""
    from opd.models import kinds

    for module in pkgutil.iter_modules(kinds.__path__):
        importlib.import_module(f"{kinds.__name__}.{module.name}")
    return _KINDS


class TargetKinds:
    """A target's layers mapped to their kinds: `of_layer[i]` is decoder layer i's kind, one object per kind."""

    def __init__(self, model_name: str, by_name: dict[str, LayerKind], of_layer: tuple[LayerKind, ...]) -> None:
        self.model_name, self.by_name, self.of_layer = model_name, by_name, of_layer

    @property
    def narrowed(self) -> bool:
        """Whether some attention kind narrows its keys (then every kind gets its own mask, by position)."""
        return any(kind.narrows for kind in self.by_name.values())

    @property
    def attention(self) -> dict[str, LayerKind]:
        """The kinds whose layers read a mask, by layer type (the keys a mask dict is looked up by)."""
        return {name: kind for name, kind in self.by_name.items() if kind.columns}

    def check(self, model: nn.Module) -> None:
        for kind in self.by_name.values():
            kind.check(model)

    def static_cache_problem(self) -> str | None:
        """Why a static cache cannot hold this target (the first kind's reason), or None."""
        return next(filter(None, (kind.static_cache_problem() for kind in self.by_name.values())), None)

    def rollback(self, model: nn.Module) -> Any:
        """The rollback of the target's one recurrent kind (None without one)."""
        return self._one_of(model, "rollback")

    def replay(self, model: nn.Module) -> Any:
        """The packed replay of the target's one recurrent kind (None without one)."""
        return self._one_of(model, "replay")

    def column_layers(self, cache: Any) -> list[Any]:
        """The cache layers holding per-token columns: a cache's layer i belongs to decoder layer i (layers that
        keep no cache of their own, Gemma 4's KV-sharing ones, come last and are absent from a cache built lazily)."""
        return [layer for layer, kind in zip(cache.layers, self.of_layer) if kind.columns]

    def select_rows(self, cache: Any, keep: torch.Tensor) -> None:
        """Keep only the batch rows `keep` of every cache layer, as its kind selects them."""
        for layer, kind in zip(cache.layers, self.of_layer):
            kind.select_rows(layer, keep)

    def state_flops(self) -> int:
        return sum(kind.state_flops() for kind in self.by_name.values())

    def block_flops(self) -> int:
        return sum(kind.block_flops() for kind in self.by_name.values())

    def _one_of(self, model: nn.Module, what: str) -> Any:
        found = [x for kind in self.by_name.values() if (x := getattr(kind, what)(model)) is not None]
        if len(found) > 1:
            raise OpdError(f"target {self.model_name}: more than one recurrent layer kind "
                           f"({', '.join(self.by_name)}); the decoder rolls back one")
        return found[0] if found else None


def layer_types(config: Any) -> list[str]:
    """Each decoder layer's type as its forward reads its mask: the config's `layer_types`, else as transformers'
    caches infer them (`get_layer_types_and_kwargs`: `sliding_window`, `attention_chunk_size`)."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    return list(getattr(config, "layer_types", None) or get_layer_types_and_kwargs(config)[0])


def layer_kinds(model: nn.Module) -> TargetKinds:
    """Map every decoder layer of `model` to its registered kind; a layer type nothing registers, or a layout a kind
    cannot run exactly (`LayerKind.check`), is refused in one line naming it."""
    model_config: Any = model.config
    config = model_config.get_text_config(decoder=True)
    types, name = layer_types(config), type(model).__name__
    found = {t: next((k for k in _registered().get(t, []) if k.fits(config)), None) for t in types}
    unknown = {t: [i for i, u in enumerate(types) if u == t] for t, kind in found.items() if kind is None}
    if unknown:
        problems = "; ".join(f"layers {layers} are '{t}'" for t, layers in unknown.items())
        raise OpdError(f"target {name}: {problems}; no registered layer kind runs it (known: "
                       f"{', '.join(sorted(_KINDS))}; docs/guides/target-layer-kind.md)")
    by_name = {t: kind(config, tuple(i for i, u in enumerate(types) if u == t))
               for t, kind in found.items() if kind is not None}
    kinds = TargetKinds(name, by_name, tuple(by_name[t] for t in types))
    kinds.check(model)
    return kinds
