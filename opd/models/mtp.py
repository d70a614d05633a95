"""The MTP drafter: a target's own multi-token-prediction head, chained K-1 times as vLLM's MTP method runs it.

How it drafts (vLLM's `deepseek_mtp`, `qwen3_next_mtp`, `mimo_mtp` and speculators' `MTPDraftModel`; layouts and
their differences in opd/formats/mtp.py):

* Columns. Position p of the text is one column: the target's last hidden state h_p (after its final norm: the
  last id in `target_layer_ids`, captured from the norm by opd/models/target.py) paired with the token after p,
  x_{p+1}. The layer's input is fc(concat(norm_e(embed(x_{p+1})), norm_h(h_p))) at RoPE position p, and the layer
  attends causally over the columns. Its output o_p predicts x_{p+2} through the final norm and the target's LM head.
* Chain. From anchor a the first draft is read from column a-1's output; step k >= 1 feeds the drafted token d_k
  with the previous step's output in place of h (normed or not, as the layout's forward returns it), at position
  a-1+k, attending the columns before the anchor and the chain's own steps. Each draft is an argmax (point masses:
  the rebuild of opd/sources/rebuild.py holds).
* The decoder layer is transformers' own class for the target (its full-attention layer on a hybrid target, an
  MoE layer where the target's deep layers are MoE, DeepSeek's latent attention), built from the target's config,
  as speculators builds its MTP layer. The layer is given its masks and a `_Keys` in place of transformers' cache:
  whatever the attention caches (keys and values, or DeepSeek's compressed latents) is kept by `DrafterCache` and
  handed back, so cached columns are never recomputed.

The embedding and the LM head are the target's, by reference (`_shared`: not parameters, not saved); a nextn
checkpoint's `shared_head.head`, where it differs from the target's head, is used in its place.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from opd.errors import OpdError
from opd.formats.checkpoint import TargetShape
from opd.formats.experts import fuse_experts, split_shapes, stores_per_expert
from opd.formats.mtp import (
    LAYOUTS,
    SPECULATORS,
    SPECULATORS_MODEL_TYPES,
    MTPConfig,
    MTPLayout,
    MTPSpec,
    fresh_layout,
    from_layout,
    head_layout,
    to_layout,
    write_into_target,
    write_speculators,
)
from opd.model_dir import ModelDir
from opd.models.drafter_cache import DrafterCache
from opd.models.family import DrafterFamily, Shapes, drafter_family
from opd.models.packed_attention import CHUNK_ROWS
from opd.models.shared_head import SharedHead, skeleton
from opd.models.target import Target


class _Keys:
    """Stands in for transformers' cache for one layer call: the attention's `update` gets back the cached entries
    (`before`) followed by its own, which are kept (`new`) for the caller to cache."""

    def __init__(self, before: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.before = before
        self.new: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(self, keys: torch.Tensor, values: torch.Tensor, *args: Any, **kwargs: Any):
        self.new = (keys, values)
        if self.before[0].shape[2] == 0:
            return keys, values
        return torch.cat([self.before[0], keys], dim=2), torch.cat([self.before[1], values], dim=2)


def _with_attention(config: Any, attn: str) -> Any:
    """A copy of the target's text config that builds its decoder layer with explicit masks (`attn`: sdpa or
    eager, whose masks are additive either way)."""
    built = copy.deepcopy(config)
    built._attn_implementation = attn
    return built


def mtp_layer_index(config: Any) -> int:
    """The index the head's layer is built at: the last full-attention layer of a hybrid (as speculators builds
    it), else the position after the last layer (DeepSeek's and GLM's, which makes it an MoE layer there)."""
    types = getattr(config, "layer_types", None)
    if types and "full_attention" in types:
        return max(i for i, t in enumerate(types) if t == "full_attention")
    return int(config.num_hidden_layers)


def _layer_and_norms(decoder: Any, hf_config: Any) -> tuple[Any, list[nn.Module]]:
    """The head's decoder layer (the target's own class, at `mtp_layer_index`) and its three norms (the layer's
    norm class), on the current device."""
    layer = type(decoder.layers[0])(hf_config, mtp_layer_index(hf_config))
    norm = type(layer.input_layernorm)
    width, eps = int(hf_config.hidden_size), float(hf_config.rms_norm_eps)
    return layer, [norm(width, eps=eps) for _ in range(3)]


def head_shapes(hf_config: Any) -> dict[str, tuple[int, ...]]:
    """The shapes of the head's tensors (the project's names) for a target of `hf_config`, built on the meta
    device: what a checkpoint of its head must hold, known before any weights are read."""
    model = skeleton(hf_config)
    with torch.device("meta"):
        layer, norms = _layer_and_norms(model.model if hasattr(model, "model") else model, hf_config)
    width = int(hf_config.hidden_size)
    shapes = {f"layer.{n}": tuple(t.shape) for n, t in layer.state_dict().items()} | {"fc.weight": (width, 2 * width)}
    for part, norm in zip(("token_norm", "hidden_norm", "final_norm"), norms):
        shapes |= {f"{part}.{n}": tuple(t.shape) for n, t in norm.state_dict().items()}
    return shapes


class MTPDrafter(nn.Module):
    """One MTP head on the target's embedding and LM head (by reference)."""

    kind = "mtp"
    sft_target = "data"  # speculators' and FastMTP's recipe: cross-entropy on the data's tokens
    chains_q = False  # sampled drafts come from the logits `draft` returns (the chain is fed its argmax)
    reads_next_ids = True  # a column pairs each position's hidden state with the token after it

    def __init__(self, config: MTPConfig, embed_tokens: nn.Embedding, lm_head: nn.Linear, hf_config: Any) -> None:
        super().__init__()
        self.config = config
        # a tuple, not parameters, not in state_dict; with the layer's config, so a clone is built the same way
        self._shared = (embed_tokens, lm_head, hf_config)
        self.hidden_size = int(hf_config.hidden_size)
        model = skeleton(hf_config)  # on the meta device: the classes and the init of the target's own code
        decoder = model.model if hasattr(model, "model") else model
        self.layer, norms = _layer_and_norms(decoder, hf_config)
        self.fc = nn.Linear(2 * self.hidden_size, self.hidden_size, bias=False)
        self.token_norm, self.hidden_norm, self.final_norm = norms
        self.rotary = type(decoder.rotary_emb)(config=hf_config)
        for module in self.modules():
            if module is not self and module is not self.rotary:
                model._init_weights(module)
        nn.init.normal_(self.fc.weight, std=float(getattr(hf_config, "initializer_range", 0.02)))
        self.to(device=embed_tokens.weight.device, dtype=embed_tokens.weight.dtype)
        self.rotary.to(device=embed_tokens.weight.device)
        self._kv = self._entry_shapes()

    # -- what the rest of the project reads --------------------------------------------------------------------

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self._shared[0]

    @property
    def form(self) -> MTPLayout:
        return self.config.form

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def tokens_per_block(self) -> int:
        """Tokens a block runs through the layer: the K-2 chain steps (step 0 is column a-1, counted as context)."""
        return self.block_size - 2

    @property
    def student_head(self) -> nn.Module:
        """Hidden -> logits: the target's (frozen) LM head, which the head shares."""
        return self._shared[1]

    @property
    def teacher_head(self) -> nn.Module:
        return self._shared[1]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._shared[1](hidden)

    def trainable_slots(self, teacher: torch.Tensor) -> torch.Tensor:
        """Every slot: the head drafts over the whole vocabulary."""
        return torch.ones(teacher.shape[:-1], dtype=torch.bool, device=teacher.device)

    def extra_flops(self) -> tuple[int, int]:
        """No work beyond its weights' (FLOP counting counts every weight of the layer: an MoE head's total, not the
        share a token runs through; bench/mtp_scale.py counts the active share)."""
        return 0, 0

    def modules_by_role(self) -> tuple[list[nn.Module], list[nn.Module], nn.Linear]:
        """(run per context column, run per chain step, the head per drafted slot), for FLOP counting."""
        return [self.fc, self.layer], [self.fc, self.layer, self.final_norm], self._shared[1]

    # -- one layer call ------------------------------------------------------------------------------------------

    def _entry_shapes(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """(heads, width) of what the attention caches per token for keys and values, from one token's call:
        keys and values, or DeepSeek's latent and rotary key."""
        weight = self.fc.weight
        probe = weight.new_zeros(1, 1, self.hidden_size)
        with torch.no_grad():
            _, (k, v) = self._run(probe, torch.zeros(1, 1, dtype=torch.long, device=weight.device),
                                  self._empty(1, ((0, 0), (0, 0))), torch.ones(1, 1, 1, dtype=torch.bool,
                                                                                device=weight.device))
        return (k.shape[1], k.shape[3]), (v.shape[1], v.shape[3])

    def _empty(self, batch: int, shapes: tuple | None = None, length: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        (kh, kd), (vh, vd) = shapes or self._kv
        w = self.fc.weight
        return w.new_zeros(batch, kh, length, kd), w.new_zeros(batch, vh, length, vd)

    def _inputs(self, ids: torch.Tensor, state: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The layer's input from tokens [B,T], hidden states [B,T,H] and positions [B,T], as the layout's forward
        forms it."""
        embedded = self.embed_tokens(ids).to(self.fc.weight.dtype)
        if self.form.zero_first_embedding:
            embedded = embedded.masked_fill((positions == 0)[..., None], 0.0)
        parts = [self.token_norm(embedded), self.hidden_norm(state.to(self.fc.weight.dtype))]
        return self.fc(torch.cat(parts[::-1] if self.form.hidden_first else parts, dim=-1))

    def _run(self, x: torch.Tensor, positions: torch.Tensor, before: tuple[torch.Tensor, torch.Tensor],
             sees: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """The layer's output [B,T,H] for inputs x at `positions`, attending the entries `before` followed by its
        own as `sees` [B,T,len(before)+T] says; and its own entries, to cache."""
        keys = _Keys(before)
        mask = torch.zeros(sees.shape, dtype=x.dtype, device=x.device).masked_fill(~sees, torch.finfo(x.dtype).min)
        out = self.layer(x, attention_mask=mask[:, None], position_ids=positions,
                         position_embeddings=self.rotary(x, positions), cache=keys)
        out = out[0] if isinstance(out, tuple) else out
        assert keys.new is not None  # every attention kind here caches what it attends to
        return out, keys.new

    def _fed(self, out: torch.Tensor) -> torch.Tensor:
        """What the next step is fed: the normed output where the layout's forward returns it normed."""
        return self.final_norm(out) if self.form.feeds_normed else out

    def _head_in(self, state: torch.Tensor) -> torch.Tensor:
        return state if self.form.feeds_normed else self.final_norm(state)

    def _columns(self, x: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor, before, before_positions,
                 before_valid, chunk_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Columns x [B,T,H] at `positions`, each attending causally to the valid entries before it (cached ones
        `before` and the earlier new ones) and to itself, a chunk of queries at a time. Returns their outputs and
        their own keys and values."""
        outs, keys, values = [], [before[0]], [before[1]]
        key_pos, key_ok = before_positions, before_valid.bool()
        for start in range(0, max(positions.shape[1], 1), chunk_rows):
            part = slice(start, start + chunk_rows)
            pos, ok = torch.cat([key_pos, positions[:, part]], 1), torch.cat([key_ok, valid[:, part].bool()], 1)
            sees = ok[:, None, :] & (pos[:, None, :] <= positions[:, part, None])
            own = key_pos.shape[1] + torch.arange(positions[:, part].shape[1], device=x.device)
            sees = sees | (torch.arange(pos.shape[1], device=x.device) == own[:, None])
            out, (k, v) = self._run(x[:, part], positions[:, part], (torch.cat(keys, 2), torch.cat(values, 2)), sees)
            outs.append(out)
            keys.append(k)
            values.append(v)
            key_pos, key_ok = pos, ok
        return torch.cat(outs, 1), torch.cat(keys[1:], 2), torch.cat(values[1:], 2)

    # -- inference ---------------------------------------------------------------------------------------------

    def new_cache(self, batch_size: int, capacity: int | None = None) -> DrafterCache:
        keys, values = self._empty(batch_size, length=capacity or 0)
        device = self.fc.weight.device
        length = capacity or 0
        return DrafterCache(keys=[keys], values=[values],
                            positions=torch.zeros(batch_size, length, dtype=torch.long, device=device),
                            valid=torch.zeros(batch_size, length, dtype=torch.bool, device=device),
                            filled=None if capacity is None else 0,
                            states=self.fc.weight.new_zeros(batch_size, length, self.hidden_size))

    @torch.no_grad()
    def extend_cache(self, cache: DrafterCache, target_features: torch.Tensor, positions: torch.Tensor,
                     valid: torch.Tensor, next_ids: torch.Tensor | None = None) -> None:
        """Write the verified columns at `positions` [B,T]: the target's last hidden state (the last H of
        features [B,T,n*H]) and the token after each position `next_ids` [B,T]; invalid ones are written but never
        attended."""
        if next_ids is None:
            raise ValueError("an MTP column pairs each position with the token after it: pass next_ids")
        x = self._inputs(next_ids, target_features[..., -self.hidden_size:], positions)
        out, k, v = self._columns(x, positions, valid, (cache.keys[0], cache.values[0]), cache.positions,
                                  cache.valid, CHUNK_ROWS)
        cache.append([(k, v)], positions, valid, self._fed(out))

    def defer_context(self, cache: DrafterCache, target_features: torch.Tensor, positions: torch.Tensor,
                      valid: torch.Tensor, next_ids: torch.Tensor | None = None) -> None:
        """Extends the cache now: the chain's first step reads the anchor's column output (as EAGLE-3's)."""
        self.extend_cache(cache, target_features, positions, valid, next_ids)

    def commit_context(self, cache: DrafterCache) -> None:
        """Nothing is ever left pending (`defer_context`)."""

    @torch.no_grad()
    def draft(self, cache: DrafterCache, anchor_ids: torch.Tensor,
              anchor_positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy K-1 chain drafts [B,K-1] and their logits [B,K-1,V]; the anchor is read through column a-1."""
        before = anchor_positions - 1
        assert cache.states is not None  # this drafter's caches carry states (new_cache)
        column = ((cache.positions == before[:, None]) & cache.valid).long().argmax(1)
        state = cache.states[torch.arange(len(column), device=column.device), column][:, None]
        sees_context = cache.visible_before(anchor_positions)[:, None, :]
        keys, values = [cache.keys[0]], [cache.values[0]]
        drafts: list[torch.Tensor] = []
        logits = []
        for step in range(self.block_size - 1):
            if step:
                positions = (before + step)[:, None]
                x = self._inputs(drafts[-1][:, None], state, positions)
                sees = torch.cat([sees_context, sees_context.new_ones(len(state), 1, step)], dim=-1)
                out, (k, v) = self._run(x, positions, (torch.cat(keys, 2), torch.cat(values, 2)), sees)
                keys.append(k)
                values.append(v)
                state = self._fed(out)
            step_logits = self.logits(self._head_in(state))[:, 0]
            drafts.append(step_logits.argmax(-1))
            logits.append(step_logits)
        return torch.stack(drafts, 1), torch.stack(logits, 1)

    # -- training ------------------------------------------------------------------------------------------------

    def block_hidden(self, features: torch.Tensor, context_ids: torch.Tensor, context_valid: torch.Tensor,
                     anchor_positions: torch.Tensor, block_inputs: torch.Tensor,
                     chunk_rows: int = CHUNK_ROWS) -> torch.Tensor:
        """Head inputs [B,M,K-1,H] at every block's K-1 drafted slots, as `draft` computes them: the committed
        columns in one causal pass, then K-2 chain steps for every block at once, each block's step attending the
        columns before its anchor and its own earlier steps. block_inputs[b,m,1:] feed the chain (the rollout's
        drafts, or the data in SFT)."""
        batch, length = context_ids.shape
        positions = torch.arange(length, device=context_ids.device).expand(batch, -1)
        next_ids = torch.cat([context_ids[:, 1:], context_ids[:, -1:]], dim=1)
        has_next = torch.cat([context_valid[:, 1:], context_valid.new_zeros(batch, 1)], dim=1) & context_valid
        x = self._inputs(next_ids, features[..., -self.hidden_size:], positions)
        empty = positions[:, :0]
        out, k, v = self._columns(x, positions, has_next, self._empty(batch), empty, empty.bool(), chunk_rows)
        columns = self._fed(out)
        visible = has_next[:, None, :] & (positions[:, None, :] < anchor_positions[:, :, None])
        rows = torch.arange(batch, device=columns.device)[:, None]
        step = columns[rows, (anchor_positions - 1).clamp_min(0)]  # o_{a-1}, [B,M,H]
        blocks = anchor_positions.shape[1]
        out_steps = [self._head_in(step)]
        keys, values = [k], [v]
        for s in range(1, self.block_size - 1):
            step_positions = anchor_positions - 1 + s
            chain = torch.arange(blocks * s, device=columns.device) % blocks == torch.arange(
                blocks, device=columns.device)[:, None]
            sees = torch.cat([visible, chain.expand(batch, -1, -1)], dim=2)
            out, (sk, sv) = self._run(self._inputs(block_inputs[..., s], step, step_positions), step_positions,
                                      (torch.cat(keys, 2), torch.cat(values, 2)), sees)
            keys.append(sk)
            values.append(sv)
            step = self._fed(out)
            out_steps.append(self._head_in(step))
        return torch.stack(out_steps, 2)

    forward = block_hidden

    # -- checkpoints -------------------------------------------------------------------------------------------

    def save_pretrained(self, directory: str | Path, verifier: str | None = None) -> None:
        """speculators' MTP layout (config.json + model.safetensors; no embedding or head: they are the target's)."""
        write_speculators(directory, self.config, self.state_dict(), self.fc.weight.dtype, verifier, [])


def _hf_config(base: Target | SharedHead, layer_config: dict[str, Any] | None = None) -> Any:
    """The config the head's layer is built from: the target's (or the one a speculators file carries), with the
    target's attention and experts implementations."""
    from transformers import AutoConfig

    config = base.config
    if layer_config is not None and layer_config != json_config(config):
        fields = dict(layer_config)
        config = AutoConfig.for_model(fields.pop("model_type"), **fields)
        for name in ("_experts_implementation",):
            if hasattr(base.config, name):
                setattr(config, name, getattr(base.config, name))
    attn = base.config._attn_implementation
    return _with_attention(config, attn if attn in ("eager", "sdpa") else "sdpa")


def json_config(config: Any) -> dict[str, Any]:
    """The target's text config as the file-format's dict (what `MTPConfig.layer_config` holds)."""
    return json.loads(config.to_json_string(use_diff=False))


def _target_dir(base: TargetShape) -> ModelDir | None:
    path = getattr(base.config, "_name_or_path", "")
    return ModelDir.find(path, "target model") if path else None


def own_head_or_refusal(directory: ModelDir, num_layers: int) -> tuple[MTPLayout, dict[str, str]]:
    """`own_head`, or one line when the target holds none (asked by the preflight too, before any actor)."""
    found = own_head(directory, num_layers)
    if found is None:
        prefixes = ", ".join(sorted({form.prefix for form in LAYOUTS.values() if form.name != SPECULATORS}))
        raise OpdError(f"models.drafter.kind: mtp but target {directory.path} holds no MTP layers (expected "
                       f"tensors under {prefixes}; give models.drafter_path, or models.drafter.from_target: false "
                       "for a fresh head)")
    return found


def own_head(directory: ModelDir, num_layers: int) -> tuple[MTPLayout, dict[str, str]] | None:
    """The MTP head a target checkpoint holds: its layout and {the project's name: the checkpoint's}."""
    names = list(directory.tensor_shapes())
    layout = head_layout(names, num_layers)
    return None if layout is None else (layout, from_layout(names, layout, num_layers))


def _read(directory: ModelDir, names: dict[str, str]) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    files = directory.tensor_files()
    out = {}
    for ours, theirs in names.items():
        with safe_open(str(files[theirs]), framework="pt") as f:
            out[ours] = f.get_tensor(theirs)
    return out


def _load_state(drafter: MTPDrafter, state: dict[str, torch.Tensor], where: str) -> MTPDrafter:
    """Load `state` (the project's names; MoE experts fused or one tensor per expert, as checkpoints store them)
    into `drafter`, every tensor present and of its shape, or one line."""
    state = fuse_experts(state, f"MTP head in {where}")
    expected = {name: tuple(t.shape) for name, t in drafter.state_dict().items()}
    got = {name: tuple(t.shape) for name, t in state.items()}
    missing, extra = sorted(expected.keys() - got.keys()), sorted(got.keys() - expected.keys())
    wrong = sorted(n for n in expected.keys() & got.keys() if expected[n] != got[n])
    if missing or extra or wrong:
        what = (f"missing {missing[0]}" if missing else f"unexpected {extra[0]}" if extra
                else f"{wrong[0]} is {got[wrong[0]]}, expected {expected[wrong[0]]}")
        raise OpdError(f"MTP head in {where}: {what} (expected the head of a layer of the target's own kind)")
    weight = drafter.fc.weight
    drafter.load_state_dict({n: t.to(weight.device, drafter.state_dict()[n].dtype) for n, t in state.items()})
    return drafter


def from_target(directory: ModelDir, base: Target | SharedHead, block_size: int) -> MTPDrafter:
    """The target's own MTP head (the warm start that ships with it), or one line when it has none."""
    layout, names = own_head_or_refusal(directory, base.num_layers)
    config = MTPConfig(block_size, layout.name, json_config(base.config))
    head = _nextn_head(directory, layout, base)
    drafter = MTPDrafter(config, base.embed_tokens, head, _hf_config(base))
    return _load_state(drafter, _read(directory, names), str(directory.path))


def _nextn_head(directory: ModelDir, layout: MTPLayout, base: Target | SharedHead) -> nn.Linear:
    """The LM head the head's logits use: a nextn checkpoint's `shared_head.head` where it differs from the
    target's, else the target's."""
    name = layout.prefix_for(base.num_layers) + "shared_head.head.weight"
    if name not in directory.tensor_shapes():
        return base.lm_head
    weight = _read(directory, {"w": name})["w"].to(base.lm_head.weight.device, base.lm_head.weight.dtype)
    if torch.equal(weight, base.lm_head.weight):
        return base.lm_head
    head = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
    head.weight = nn.Parameter(weight, requires_grad=False)
    return head


@drafter_family
class MTPFamily(DrafterFamily):
    """MTP heads (vLLM's `method: mtp`): the target's own, read from its checkpoint, or a fresh one of its kind."""

    section = MTPSpec
    public_layout = "speculators"

    def initial(self, section: MTPSpec, base: Target | SharedHead, tokenizer: Any) -> MTPDrafter:
        """With no drafter path: the target's own head (`from_target`), else a fresh one in its family's layout."""
        directory = _target_dir(base)
        if section.from_target and directory is not None:
            return from_target(directory, base, section.block_size)
        if section.from_target:
            raise OpdError("models.drafter.kind: mtp with from_target but the target's directory is unknown "
                           "(expected a target loaded from its directory, or models.drafter.from_target: false)")
        layout = fresh_layout(str(getattr(base.config, "model_type", "")))
        config = MTPConfig(section.block_size, layout.name, json_config(base.config))
        return MTPDrafter(config, base.embed_tokens, base.lm_head, _hf_config(base))

    def load(self, directory: ModelDir, base: Target | SharedHead, section: MTPSpec) -> MTPDrafter:
        """A head in speculators' layout (the project's export, or `MTPConverter`'s)."""
        config = MTPConfig.from_speculators(directory.config, section.block_size)
        _check_target(directory, config, base)
        drafter = MTPDrafter(config, base.embed_tokens, base.lm_head, _hf_config(base, config.layer_config))
        names = from_layout(list(directory.tensor_shapes()), LAYOUTS[SPECULATORS], config.num_layers)
        return _load_state(drafter, _read(directory, names), str(directory.path))

    def target_layer_ids(self, directory: ModelDir, num_target_layers: int) -> list[int]:
        return [num_target_layers - 1]

    def check_initial(self, section: MTPSpec, tokenizer: Any, target: TargetShape) -> None:
        """A head read from the target: the target holds one (its tensor names, no weights read)."""
        directory = _target_dir(target)
        if section.from_target and directory is not None:
            own_head_or_refusal(directory, target.num_layers)

    def expected_shapes(self, directory: ModelDir, target: TargetShape, section: MTPSpec) -> Shapes:
        """The head of a layer of the kind its config names, checked to be the target's width, depth and vocabulary,
        built on the meta device (`head_shapes`) and in speculators' names; experts one tensor per expert where the
        file stores them so. Copies of the target's embedding or head beside it are the target's."""
        from transformers import AutoConfig

        config = MTPConfig.from_speculators(directory.config, section.block_size)
        _check_target(directory, config, target)
        fields = dict(config.layer_config)
        hf_config = _with_attention(AutoConfig.for_model(fields.pop("model_type"), **fields), "sdpa")
        shapes = to_layout(head_shapes(hf_config), LAYOUTS[SPECULATORS], config.num_layers)
        if stores_per_expert(directory.tensor_shapes()):
            shapes = split_shapes(shapes)
        prefix = LAYOUTS[SPECULATORS].prefix_for(config.num_layers)
        return shapes, lambda name: not name.startswith(prefix)

    def served_block_size(self, directory: ModelDir, target: TargetShape | None, section: MTPSpec) -> int:
        """A head in speculators' layout: its config's K; a target directory holding its own head (`opd export --to
        target`, or a target that ships one): the spec's K."""
        if directory.kind.layout == "target":
            _served_target(directory, target)
            return section.block_size
        config = MTPConfig.from_speculators(directory.config, section.block_size)
        if target is not None:
            _check_target(directory, config, target)
        return config.block_size

    def vllm_config(self, directory: ModelDir, block_size: int) -> dict[str, Any]:
        """vLLM's MTP method (`mtp`, which its per-model names such as `deepseek_mtp` and `qwen3_next_mtp` now
        resolve to): the head is chained for every token past its one layer. A head in its target's own layout
        (`opd export --to target`) is served from the model directory itself, so names no drafter model."""
        config: dict[str, Any] = {"method": "mtp", "num_speculative_tokens": block_size - 1}
        return config if directory.kind.layout == "target" else config | {"model": str(directory.path)}

    def unloadable(self, layout: str, target: ModelDir) -> str | None:
        """speculators' `MTPDraftModel` builds heads of a few target types only (`SPECULATORS_MODEL_TYPES`)."""
        model_type = str(target.text_config.get("model_type", ""))
        if layout != SPECULATORS or model_type in SPECULATORS_MODEL_TYPES:
            return None
        return (f"speculators' MTPDraftModel cannot load a head of a {model_type!r} target (it builds "
                f"{', '.join(SPECULATORS_MODEL_TYPES)})")

    def save_speculators(self, drafter: Any, directory: str | Path, verifier: str | None) -> None:
        architectures = [] if verifier is None else ModelDir.read(verifier, "target").architectures
        write_speculators(directory, drafter.config, drafter.state_dict(), drafter.fc.weight.dtype, verifier,
                          architectures)

    def save_into_target(self, drafter: Any, target_dir: str | Path, directory: str | Path) -> Path:
        """The head in the target's own layout, in a new directory that links the target's files (vLLM's
        `method: mtp` serves it with `--model` that directory); the layout must run the head's own forward."""
        target = ModelDir.read(target_dir, "target model").expect("target", "target")
        layout = fresh_layout(str(target.text_config.get("model_type", "")))
        if drafter.form.name in LAYOUTS and drafter.form.count_field:
            layout = drafter.form
        if _forward(layout) != _forward(drafter.form):
            raise OpdError(f"target {target.path}: its MTP layout {layout.name} runs another forward than the head's "
                           f"({drafter.form.name}; expected a head of this target's family)")
        return write_into_target(drafter.state_dict(), layout, target, directory, drafter.fc.weight.dtype)


def _served_target(directory: ModelDir, target: TargetShape | None) -> None:
    """A target directory served with its own head: it holds one, and is the spec's target's shape."""
    num_layers = directory.int_field("num_hidden_layers")
    if own_head(directory, num_layers) is None:
        raise OpdError("a target model holding no MTP layers (expected a drafter's directory, "
                       "or a target with its MTP head: opd export --to target)")
    width = directory.int_field("hidden_size")
    if target is not None and (num_layers, width) != (target.num_layers, target.hidden_size):
        raise OpdError(f"a {num_layers}-layer target of width {width} but models.target_path has "
                       f"{target.num_layers} layers of width {target.hidden_size} (expected the same target)")


def _forward(layout: MTPLayout) -> tuple[bool, bool, bool]:
    """What a layout's forward decides: the fed state normed, position 0 zeroed, the concatenation order."""
    return layout.feeds_normed, layout.zero_first_embedding, layout.hidden_first


def _check_target(directory: ModelDir, config: MTPConfig, target: TargetShape) -> None:
    width = int(config.layer_config.get("hidden_size", -1))
    vocab = int(config.layer_config.get("vocab_size", -1))
    if vocab != target.vocab_size:
        raise OpdError(f"drafter {directory.path}: an MTP head for a vocabulary of {vocab} but the target's is "
                       f"{target.vocab_size} (expected the head of this target)")
    if width != target.hidden_size or config.num_layers != target.num_layers:
        raise OpdError(f"drafter {directory.path}: an MTP head for a {config.num_layers}-layer target of width {width} "
                       f"but the target has {target.num_layers} layers of width {target.hidden_size} (expected the "
                       "head of this target)")
