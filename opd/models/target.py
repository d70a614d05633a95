"""The frozen target model: a Hugging Face causal LM whose layers are of registered kinds (opd/models/layer_kind.py,
docs/guides/target-layer-kind.md), plus the hidden-state features a DFlash drafter reads.

A DFlash drafter is conditioned on the outputs of a few target decoder layers (`layer_ids`). We capture exactly
those with forward hooks instead of `output_hidden_states=True`, so a long replay sequence never keeps every
layer's states alive at once.
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
from collections.abc import Iterable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from opd.errors import OpdError
from opd.model_dir import TARGET_FIELD, ModelDir
from opd.models.kind_masks import kind_masks
from opd.models.layer_kind import TargetKinds, layer_kinds
from opd.models.packed_attention import PackedRows
from opd.models.quantization import Quantization
from opd.models.rope_table import RopeTable

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclass
class TargetOutput:
    """One target forward: logits [B,T,V], concatenated features [B,T,n*H] and the (updated) KV cache."""

    logits: torch.Tensor
    features: torch.Tensor
    past_key_values: Any = None


@dataclass(frozen=True)
class ReadyBlock:
    """A verified block's mask already in the form the target's layers read (`Target.ready_block`): one tensor,
    or {layer type: mask} where its kinds are mixed. It reaches the model as is, so transformers builds no mask of
    its own; and the block's positions, `length` .. `length` + `block` − 1 in every row, whose rotary embeddings
    are sliced from a table (opd/models/rope_table.py)."""

    mask: torch.Tensor | dict[str, torch.Tensor]
    length: int
    block: int


@dataclass(frozen=True)
class _BlockTemplate:
    """`Target.ready_block`'s template: the ready mask of a `block`-token block after `capacity` columns."""

    capacity: int
    block: int
    device: torch.device
    mask: torch.Tensor | dict[str, torch.Tensor]


BLOCK_TEMPLATE_STEP = 256  # a block mask template's capacity is a multiple of this, at least twice the text's


@dataclass(frozen=True)
class KVPrefix:
    """The target's keys and values over a batch of right-padded texts, per layer ([B, kv, T, d] each): a later
    forward whose rows attend to those texts (packed replay's blocks, `PackedRows.cached`) does not recompute them.
    About 2·layers·kv·d values per token (147 KB in bf16 at Qwen3-8B), so it lives only as long as one batch."""

    layers: tuple[tuple[torch.Tensor, torch.Tensor], ...]

    def cache(self) -> Any:
        """A fresh HF cache holding these tensors: a forward appends to the cache, never to them, so the prefix
        can serve again."""
        from transformers import DynamicCache

        return DynamicCache(ddp_cache_data=self.layers)


class Target(nn.Module):
    """A frozen HF causal LM that also returns the features of the decoder layers in `layer_ids`.

    Each layer is mapped once to its registered kind (`kinds`, opd/models/layer_kind.py), which everything else
    asks: its mask, its rollback after verification, its packed replay, its FLOPs. A layer type of no registered
    kind is refused here, before any compute. A target whose kinds narrow their keys (sliding-window, chunked) keeps
    every key in plain cache layers and gets its masks per layer kind from `kind_masks`, counted in positions (why:
    opd/models/kind_masks.py).

    The feature of layer id `i` is the output of decoder layer `i`, i.e. HF `hidden_states[i + 1]`. For the last
    layer HF reports the output *after* the final norm, so that id is captured from the final norm to stay
    identical to what the public DFlash code feeds its drafters.
    """

    def __init__(self, model: PreTrainedModel, layer_ids: list[int]) -> None:
        super().__init__()
        self.model: PreTrainedModel = model
        self.layer_ids = [int(i) for i in layer_ids]
        self.model.eval()
        self.model.requires_grad_(False)
        config = model.config
        self.num_layers = int(config.num_hidden_layers)
        self.hidden_size = int(config.hidden_size)
        self.vocab_size = int(config.vocab_size)
        self._check_layer_ids()
        self.kinds: TargetKinds = layer_kinds(model)
        self._linear = self.kinds.replay(model)
        self._cache_arg = _cache_argument_name(model)
        self._captured: dict[int, torch.Tensor] | None = None
        self._template: _BlockTemplate | None = None
        self._rope = RopeTable.of(self.decoder)
        self._register_feature_hooks()
        self.unread: tuple[str, ...] = ()  # checkpoint tensors no module of the text model holds (`load_target`)

    @property
    def linear(self) -> bool:
        """Whether some layers are linear-attention ones (a packed forward runs them from each anchor's state;
        they keep no keys for a later forward, so `text_states` cannot serve drafted blocks)."""
        return self._linear is not None

    @property
    def narrowed(self) -> bool:
        """Whether some layers' kinds narrow their keys (sliding-window, chunked: masks from `kind_masks`)."""
        return self.kinds.narrowed

    # -- what the drafter shares -------------------------------------------------------------------------------

    @property
    def config(self) -> Any:
        """The HF config of the wrapped model."""
        return self.model.config

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.model.get_input_embeddings()

    @property
    def decoder(self) -> nn.Module:
        """The decoder stack without the LM head. transformers' `get_decoder` looks for the attribute its
        `base_model_prefix` names, which Llama 4's text-only model (`language_model`, held as `model`) lacks, and
        then returns the whole model."""
        decoder = self.model.get_decoder()
        return self.model.model if decoder is self.model and hasattr(self.model, "model") else decoder

    @property
    def lm_head(self) -> nn.Linear:
        return self.model.get_output_embeddings()

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    # -- forward -----------------------------------------------------------------------------------------------

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        attention_mask: torch.Tensor | PackedRows | ReadyBlock | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: Any = None,
        use_cache: bool = False,
        logits_to_keep: torch.Tensor | None = None,
    ) -> TargetOutput:
        """Run the target; `attention_mask` is a 2-D padding mask, a 4-D custom mask [B,1,T,S] (sdpa, eager), or
        the `PackedRows` layout of packed replay (any implementation, no [T,T] mask formed).

        A 4-D mask may be bool (True = attend) or additive float. It reaches the attention kernel unchanged
        (sdpa) or as an additive mask (eager). A target whose kinds narrow their keys takes a 2-D mask, or a bool
        4-D one without a cache, and narrows it per layer kind by position (`kind_masks`); its caches keep every key.

        A `ReadyBlock` (`ready_block`) reaches the layers unchanged.

        `logits_to_keep` [B, n]: the positions of each row whose logits are formed (transformers' own argument; the
        features cover every position), so a prefill runs the LM head on each prompt's last token alone.
        """
        keep = {} if logits_to_keep is None else {"logits_to_keep": logits_to_keep}
        out, features = self._run(self.model, input_ids, attention_mask, position_ids,
                                  use_cache=use_cache, **{self._cache_arg: past_key_values}, **keep)
        return TargetOutput(logits=out.logits, features=features, past_key_values=getattr(out, self._cache_arg))

    @torch.no_grad()
    def hidden_states(self, input_ids: torch.Tensor, *, attention_mask: torch.Tensor | PackedRows | None = None,
                      position_ids: torch.Tensor | None = None,
                      prefix: KVPrefix | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(final-norm hidden states [B,T,H], features [B,T,n*H]) from the decoder alone, without the LM head:
        replay needs the target's distribution only at drafted slots, and `lm_head` of these states gives it
        exactly, so no [B,T,V] logits are made for the prefix. `prefix`: keys and values that come before these
        rows (`text_states`), for a `PackedRows` layout with `cached` set to its length."""
        cache = {"use_cache": False} if prefix is None else {"use_cache": True, self._cache_arg: prefix.cache()}
        out, features = self._run(self.decoder, input_ids, attention_mask, position_ids, **cache)
        return out.last_hidden_state, features

    @torch.no_grad()
    def text_states(self, input_ids: torch.Tensor, *, attention_mask: PackedRows,
                    position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, KVPrefix]:
        """`hidden_states`, plus the keys and values of every layer over these rows, for a later forward of rows
        that attend to them."""
        out, features = self._run(self.decoder, input_ids, attention_mask, position_ids, use_cache=True)
        cache = getattr(out, self._cache_arg)
        return out.last_hidden_state, features, KVPrefix(tuple((layer.keys, layer.values) for layer in cache.layers))

    def ready_block(self, length: int, block: int) -> ReadyBlock | None:
        """A `block`-token block verified after `length` cache columns that every row fills (no padding: each
        key's column is its position, and the block's positions are length, length + 1, ...): its mask in the form
        the layers read it, and its positions for the rotary table (opd/models/rope_table.py); None where the
        target's masks have no such form, and the caller passes the 2-D mask or none.

        Why: transformers builds its causal mask again at every forward, and sdpa turns a bool mask into an additive
        one again in every layer, in small operations that a batch-1 verify step, bound by per-operation overhead,
        pays for in full. Where every attention kind sees a key by its distance from the query alone
        (`LayerKind.by_distance`), that mask is one template slid along the cache: built once (`kind_masks`, on
        positions, in the form each kernel uses as it is: `_ready_form`), each step takes its last length + block
        columns, a view with the values the model's own builder and the kernel would give. Not served:
        linear-attention layers (they read the 2-D mask), flash-attn and flex (no dense mask), chunked layers
        (their bounds are fixed positions)."""
        implementation = self.model.config._attn_implementation
        kinds = self.kinds.attention
        if (self._linear or implementation not in ("sdpa", "eager") or not all(k.by_distance for k in kinds.values())
                or (len(kinds) > 1 and not self.narrowed)):
            return None
        template = self._template
        if (template is None or template.block != block or template.capacity < length
                or template.device != self.device):
            template = self._template = self._block_template(max(length, 1), block, implementation)
        start = template.capacity - length
        if isinstance(template.mask, dict):
            return ReadyBlock({name: mask[..., start:] for name, mask in template.mask.items()}, length, block)
        return ReadyBlock(template.mask[..., start:], length, block)

    def _block_template(self, length: int, block: int, implementation: str) -> _BlockTemplate:
        """A template for texts up to twice `length` (so that it is rebuilt a logarithmic number of times)."""
        capacity = -(-2 * length // BLOCK_TEMPLATE_STEP) * BLOCK_TEMPLATE_STEP
        every = torch.ones(1, capacity + block, dtype=torch.long, device=self.device)
        positions = torch.arange(capacity, capacity + block, device=self.device)[None]
        masks = {kind: self._ready_form(m, implementation)
                 for kind, m in kind_masks(self.kinds.attention, every, positions).items()}
        return _BlockTemplate(capacity, block, self.device,
                              masks if len(masks) > 1 else next(iter(masks.values())))

    def _run(self, module: nn.Module, input_ids: torch.Tensor,
             attention_mask: torch.Tensor | PackedRows | ReadyBlock | None,
             position_ids: torch.Tensor | None, **kwargs: Any) -> tuple[Any, torch.Tensor]:
        """`module`'s output and the features its hooks captured."""
        mask = self._prepare_mask(attention_mask, position_ids)
        if self.narrowed and kwargs.get("use_cache") and kwargs.get(self._cache_arg) is None:
            from transformers import DynamicCache

            kwargs[self._cache_arg] = DynamicCache()  # plain layers: HF's sliding layers would drop keys by column
        blocks = isinstance(attention_mask, PackedRows) and any(len(row.anchors) for row in attention_mask.rows)
        ready = attention_mask if isinstance(attention_mask, ReadyBlock) and self._rope else None
        self._captured = {}
        try:
            with (self._linear.packed(attention_mask) if self._linear and blocks else nullcontext(),
                  self._rope.given(ready.length, ready.block) if self._rope and ready else nullcontext()):
                out = module(input_ids=input_ids, attention_mask=mask, position_ids=position_ids, **kwargs)
            features = torch.cat([self._captured[i] for i in self.layer_ids], dim=-1)
        finally:
            self._captured = None
        return out, features

    # -- internals ---------------------------------------------------------------------------------------------

    def _check_layer_ids(self) -> None:
        if not self.layer_ids:
            raise OpdError("target layer_ids: at least one layer id is needed")
        bad = [i for i in self.layer_ids if not 0 <= i < self.num_layers]
        if bad:
            raise OpdError(f"target layer_ids {bad} out of range: the target has {self.num_layers} layers")

    def _register_feature_hooks(self) -> None:
        """Hook each needed module once; hooks only record while `forward` runs, so plain model calls are free."""
        decoder = self.decoder
        layers = getattr(decoder, "layers", None)
        if layers is None:
            raise OpdError(f"target {type(self.model).__name__}: no decoder `layers` list to read features from")
        for layer_id in sorted(set(self.layer_ids)):
            module = layers[layer_id]
            if layer_id == self.num_layers - 1:
                module = getattr(decoder, "norm", None)
                if module is None:
                    raise OpdError("target layer_ids: the last layer needs a final `norm` module on the decoder")
            module.register_forward_hook(self._make_hook(layer_id))

    def _make_hook(self, layer_id: int):
        def hook(_module: nn.Module, _inputs: Any, output: Any) -> None:
            if self._captured is not None:
                self._captured[layer_id] = output[0] if isinstance(output, tuple) else output

        return hook

    def _prepare_mask(self, mask: torch.Tensor | PackedRows | ReadyBlock | None,
                      position_ids: torch.Tensor | None) -> Any:
        """A `PackedRows` goes to every layer as a `PackedMask`, a prepared 4-D mask carrying each layer's kind,
        which every HF decoder forwards unchanged to the attention functions `opd.models.packed_attention` wraps
        (they apply each layer's kind and sinks). A target whose kinds narrow their keys gets one mask per layer
        kind (`kind_masks`): a dict {kind: mask} where its kinds are mixed, the form such models' forwards take.
        Otherwise a dense 4-D mask reaches sdpa as is and eager as an additive mask; flash-attn has no custom
        masks."""
        if isinstance(mask, ReadyBlock):
            return mask.mask
        if isinstance(mask, PackedRows):
            if self._linear and mask.cached:
                raise OpdError(f"target {type(self.model).__name__}: its 'linear_attention' layers keep no keys "
                               "for drafted blocks to attend to; expected the text and its blocks in one PackedRows")
            return mask.as_mask(self.device, self.kinds.of_layer)
        if self._linear and mask is not None and mask.dim() == 4:
            raise OpdError(f"target {type(self.model).__name__}: its 'linear_attention' layers read no 4-D mask "
                           "(they run every row causally); expected a 2-D padding mask or a committed PackedRows")
        if mask is None or (mask.dim() != 4 and not self.narrowed):
            return mask
        implementation = self.model.config._attn_implementation
        if implementation == "flash_attention_2":
            raise OpdError("target attention_mask: a dense 4-D mask needs sdpa or eager; packed replay passes a "
                           "PackedRows layout, which every implementation runs")
        if not self.narrowed:
            return self._for_kernel(mask, implementation)
        masks = {kind: self._for_kernel(m, implementation)
                 for kind, m in kind_masks(self.kinds.attention, mask, position_ids).items()}
        return masks if len(masks) > 1 else next(iter(masks.values()))

    def _ready_form(self, mask: torch.Tensor, implementation: str) -> torch.Tensor:
        """A bool mask as a ready block hands it to the kernel: eager's additive mask, and for sdpa the additive
        mask sdpa itself would make of a bool one (0 and −inf in the queries' dtype) at every layer, in a few
        kernels of its own, before it attends."""
        if implementation != "sdpa":
            return self._for_kernel(mask, implementation)
        additive = torch.zeros(mask.shape, dtype=self.dtype, device=mask.device)
        return additive.masked_fill_(~mask, float("-inf"))

    def _for_kernel(self, mask: torch.Tensor, implementation: str) -> torch.Tensor:
        """Eager adds its mask to the scores, so a bool mask becomes additive there."""
        if implementation == "eager" and mask.dtype == torch.bool:
            additive = torch.zeros(mask.shape, dtype=self.dtype, device=mask.device)
            return additive.masked_fill_(~mask, torch.finfo(self.dtype).min)
        return mask


def _cache_argument_name(model: nn.Module) -> str:
    """transformers 5 renamed `past_key_values` to `cache`; use whichever this version's forward takes."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def load_target(
    path: str,
    *,
    dtype: torch.dtype,
    attn_implementation: str | None = None,
    layer_ids: list[int],
    device: str = "cpu",
    field: str = TARGET_FIELD,
) -> Target:
    """Load a local HF causal LM directory as a frozen `Target` (no hub access) onto `device`; `field` names the
    path in the refusal of a drafter's directory."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a per-tensor loading bar is noise next to our own progress bars

    if attn_implementation == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        raise OpdError("attn_implementation 'flash_attention_2' needs flash-attn: pip install -e .[gpu]")
    model_dir = ModelDir.read(path, "target model").expect("target", field)
    # transformers' default experts kernel (grouped_mm) takes no float64; its eager loop does, and a dense model
    # ignores the setting
    experts = {"experts_implementation": "eager"} if dtype == torch.float64 else {}
    chosen = {} if attn_implementation is None else {"attn_implementation": attn_implementation}  # else HF's pick
    quantization = Quantization.of(model_dir.config, f"{path}/config.json")
    quantization.check_dequantizable(model_dir.tensor_shapes(), device, f"target model {path}")
    quantized = quantization.load_kwargs(device, dtype)
    if quantization.method is not None:  # which path the published weights take here, once per load
        print(f"target model {path}: {quantization.path(device, dtype)}", file=sys.stderr)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its load report lists every vision-tower tensor left unread, as a warning
    try:
        model, loading = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, local_files_only=True, output_loading_info=True, **_language_model(model_dir),
            **experts, **chosen, **quantized)
    except (OSError, ValueError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise OpdError(f"target model {path}: {first_line}") from exc
    finally:
        hf_logging.set_verbosity(verbosity)
    _refuse_missing_weights(path, type(model).__name__, loading["missing_keys"])
    target = Target(model.to(device), layer_ids)
    target.unread = unread_tensors(model, model_dir.text_names())
    return target


def missing_tensors(model: nn.Module, names: Iterable[str]) -> list[str]:
    """The parameters of `model` (a skeleton will do) that no checkpoint tensor in `names` (text-only names) feeds:
    neither its own name, nor (for one transformers builds on load) MXFP4's `<name>_blocks`, nor numbered children
    of its module (per-expert weights it fuses). Tied parameters count once."""
    present = set(names)
    quantized = {n.rsplit("_", 1)[0] for n in present if n.endswith(("_blocks", "_scales"))}
    split = [n.split(".") for n in present]
    numbered = {".".join(parts[:i]) for parts in split for i, part in enumerate(parts) if part.isdigit()}
    return [name for name, _ in model.named_parameters()
            if name not in present and name not in quantized and name.rsplit(".", 1)[0] not in numbered]


def unread_tensors(model: nn.Module, names: Iterable[str]) -> tuple[str, ...]:
    """The checkpoint tensors no part of the loaded text model reads (a vision tower, an MTP head), told apart by
    their first two name parts: a tensor transformers fuses, splits or dequantizes on load (per-expert weights,
    MXFP4 blocks) still sits under one of the model's own top modules."""
    held = {name for name, _ in model.named_modules()} | set(model.state_dict())
    return tuple(sorted(n for n in names if ".".join(n.split(".")[:2]) not in held))


def _language_model(model_dir: ModelDir) -> dict[str, Any]:
    """`from_pretrained` arguments that load a multimodal checkpoint as its language model alone: the text config
    (carrying the published quantization) and the renaming of its published prefix. transformers would build the
    whole `...ForConditionalGeneration` for some families (Gemma 4), vision tower included."""
    if not isinstance(model_dir.config.get("text_config"), dict):
        return {}
    from opd.models.shared_head import target_config

    text = target_config(str(model_dir.path))
    if "quantization_config" in model_dir.config and not hasattr(text, "quantization_config"):
        text.quantization_config = model_dir.config["quantization_config"]
    return {"config": text, "key_mapping": model_dir.text_key_mapping()}


def _refuse_missing_weights(path: str, architecture: str, missing: list[str]) -> None:
    """transformers fills a tensor its checkpoint lacks with random values and only logs it; a target with a random
    embedding, head or layer would draw every sample, and score every draft, from noise. Refused here, before any
    forward."""
    if missing:
        names = sorted(missing)
        more = f" and {len(names) - 3} more" if len(names) > 3 else ""
        raise OpdError(f"target model {path}: its weights lack {', '.join(names[:3])}{more} (expected every tensor "
                       f"of {architecture}; transformers would fill them with random values)")
