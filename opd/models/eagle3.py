"""The EAGLE-3 drafter: one decoder layer that drafts a chain of tokens, one argmax step at a time.

How it works (EAGLE-3, arXiv 2503.01840; the layout of SpecForge's `LlamaForCausalLMEagle3`, which vLLM and SGLang
load; facts in ../shared/EAGLE3.md):

* Columns. Position p of the text is one column: the target's states entering three of its layers at p,
  concatenated [3H] and fused by `fc`, paired with the token *after* p, x_{p+1}. The layer's input is
  [input_layernorm(embed(x_{p+1})); hidden_norm(g_p)] (2H wide), its residual g_p, and it attends causally over the
  columns (RoPE position p). Its output o_p predicts x_{p+2}.
* Chain. From anchor a (the committed token x_a) the first draft is read from column a−1's output o_{a−1}, which
  already paired g_{a−1} with x_a. Step k ≥ 1 feeds the drafted token d_k with the previous step's pre-norm output
  in place of the target's fused state, at RoPE position a−1+k, attending the columns before the anchor and the
  chain's own steps. K−1 steps give K−1 drafts, each an argmax over the draft vocabulary mapped to target ids
  (`d2t`), so chains are point masses and the rebuild of opd/sources/rebuild.py holds.
* EAGLE 3.1 (flags in its config): RMSNorms on the fused states before `fc` (`fc_norm`, per state, or
  `norm_before_fc`, over their concatenation), and `norm_output`, the step's normed output fed to the next step
  and the head alike (speculators' `Eagle3DraftModel`).
* Vocabulary. `lm_head` is the drafter's own, over a draft vocabulary of `draft_vocab_size` frequent target ids;
  the embedding is the target's, frozen and borrowed by reference (not a parameter, not saved).

The cache keeps each column's K/V and its output o_p (`DrafterCache.states`), so a draft reads o_{a−1} instead of
recomputing it; columns are written when the target verifies them, as vLLM's first proposer pass does.
`block_hidden` is the same computation for training: one causal pass over the committed columns, then K−2 chain
steps for every block at once (EAGLE-3's training-time test, with the chain fed the rollout's drafts or the data).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from opd.errors import OpdError
from opd.formats.checkpoint import TargetShape
from opd.formats.eagle3 import (
    SHARED_EMBEDDING,
    WEIGHTS_FILE,
    Eagle3Config,
    Eagle3Spec,
    check_distinct_layers,
    draft_vocab,
    expected_shapes,
    read_config,
    read_tensors,
    speculators_tensor_names,
    write_checkpoint,
    write_speculators,
)
from opd.formats.speculators import is_speculators
from opd.model_dir import ModelDir
from opd.models.chain_attention import chain_attention, row_chunks
from opd.models.drafter_cache import DrafterCache
from opd.models.family import DrafterFamily, PublicLayout, Shapes, drafter_family
from opd.models.layers import GatedMLP, RMSNorm, apply_rope, rope_cos_sin
from opd.models.lm_head import SLOTS_PER_CHUNK, argmax
from opd.models.packed_attention import CHUNK_ROWS, grouped_sdpa
from opd.models.shared_head import SharedHead
from opd.models.target import Target


class Eagle3Attention(nn.Module):
    """Llama attention whose queries, keys and values read the 2H-wide [token; state] input."""

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (config.num_attention_heads, config.num_key_value_heads,
                                                             config.head_dim)
        width = 2 * config.hidden_size
        self.q_proj = nn.Linear(width, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(width, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(width, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def _heads(self, x: torch.Tensor, num_heads: int) -> torch.Tensor:
        return x.view(*x.shape[:2], num_heads, self.head_dim).transpose(1, 2)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Rotated queries [B,heads,T,d], keys and values [B,kv_heads,T,d]."""
        q = apply_rope(self._heads(self.q_proj(x), self.num_heads), cos, sin)
        k = apply_rope(self._heads(self.k_proj(x), self.num_kv_heads), cos, sin)
        return q, k, self._heads(self.v_proj(x), self.num_kv_heads)

    def out(self, attended: torch.Tensor) -> torch.Tensor:
        """[B,heads,T,d] -> [B,T,H]."""
        return self.o_proj(attended.transpose(1, 2).reshape(attended.shape[0], attended.shape[2], -1))


class Eagle3Layer(nn.Module):
    """SpecForge's `midlayer`: the residual is the un-normed state, the input both normed halves."""

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        self.self_attn = Eagle3Attention(config)
        self.mlp = GatedMLP(config)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def inputs(self, embedded: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.input_layernorm(embedded), self.hidden_norm(state)], dim=-1)

    def finish(self, state: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """Residual, MLP and residual after attention: the layer's pre-norm output."""
        h = state + self.self_attn.out(attended)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Drafter(nn.Module):
    """EAGLE-3 chain drafter on the target's embedding (by reference), with its own draft-vocabulary head."""

    kind = "eagle3"

    d2t: torch.Tensor  # buffers (register_buffer): draft id -> target id offset [Vd], target id in draft vocab [V]
    t2d: torch.Tensor

    def __init__(self, config: Eagle3Config, embed_tokens: nn.Embedding, target_head: nn.Linear) -> None:
        super().__init__()
        if embed_tokens.weight.shape != (config.vocab_size, config.target_hidden_size):
            raise ValueError(f"embed_tokens {tuple(embed_tokens.weight.shape)} does not fit the drafter config")
        self.config = config
        self._shared = (embed_tokens, target_head)  # a tuple: not parameters, not in state_dict
        self.midlayer = Eagle3Layer(config)
        self.fc = nn.Linear(3 * config.target_hidden_size, config.hidden_size, bias=False)
        t, eps = config.target_hidden_size, config.rms_norm_eps
        self.fc_norm = nn.ModuleList(RMSNorm(t, eps) for _ in range(3)) if config.fc_norm else None  # EAGLE 3.1
        self.input_norm = RMSNorm(3 * t, eps) if config.norm_before_fc else None
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.arange(config.draft_vocab_size) * 0)
        self.register_buffer("t2d", torch.arange(config.vocab_size) < config.draft_vocab_size)
        self._teacher: tuple = ()  # (d2t it was taken for, the target head's draft-vocabulary rows)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
        self.to(device=embed_tokens.weight.device, dtype=embed_tokens.weight.dtype)

    # -- what the rest of the project reads --------------------------------------------------------------------

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self._shared[0]

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def vocab_ids(self) -> torch.Tensor:
        """Target id of every draft-vocabulary entry [Vd] (`d2t` holds offsets)."""
        return torch.arange(len(self.d2t), device=self.d2t.device) + self.d2t

    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """Adopt a draft vocabulary (opd/formats/eagle3.py `draft_vocab`)."""
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    sft_target = "target"  # SFT learns the target's distribution over the draft vocabulary (SpecForge's recipe)
    chains_q = False  # sampled drafts come from the logits `draft` returns (the chain is fed its argmax)
    reads_next_ids = True  # a column pairs each position's features with the token after it

    def extra_flops(self) -> tuple[int, int]:
        """No work beyond its weights' (FLOP counting)."""
        return 0, 0

    @property
    def student_head(self) -> nn.Linear:
        """Hidden -> the drafter's logits (draft vocabulary): the loss's student side, trainable."""
        return self.lm_head

    @property
    def teacher_head(self) -> nn.Module:
        """Target final-norm hidden -> the target's logits restricted to the draft vocabulary."""
        if not self._teacher or not torch.equal(self._teacher[0], self.d2t):  # a load may change the vocabulary
            self._teacher = (self.d2t.clone(), DraftVocabHead(self._shared[1], self.vocab_ids))
        return self._teacher[1]

    def trainable_slots(self, teacher: torch.Tensor) -> torch.Tensor:
        """Bool [N, K-1]: slots whose target argmax (over the whole vocabulary, from final-norm hidden `teacher`
        [N, K-1, H]) lies in the draft vocabulary. The drafter can never propose the others, so they carry no
        signal it can act on; the loss drops them, as SpecForge and the paper's EAGLE-3 path do."""
        return self.t2d[argmax(self._shared[1], teacher, SLOTS_PER_CHUNK)]

    @property
    def tokens_per_block(self) -> int:
        """Tokens a block runs through the layer: the K-2 chain steps (step 0 is column a-1, counted as context)."""
        return self.block_size - 2

    def modules_by_role(self) -> tuple[list[nn.Module], list[nn.Module], nn.Linear]:
        """(run per context column, run per chain step, the head per drafted slot), for FLOP counting."""
        return [self.fc, self.midlayer], [self.midlayer, self.norm], self.lm_head

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    # -- columns ------------------------------------------------------------------------------------------------

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, self.fc.weight.dtype)

    def _columns(self, features: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor):
        """Queries, keys, values and residual of columns (g_p, x_{p+1}) at `positions`."""
        state = self._fuse(features.to(self.fc.weight.dtype))
        x = self.midlayer.inputs(self.embed_tokens(next_ids), state)
        return (*self.midlayer.self_attn.project(x, *self._rope(positions)), state)

    def _step(self, tokens: torch.Tensor, state: torch.Tensor, positions: torch.Tensor):
        """Queries, keys, values of chain steps feeding `tokens` [B,S] with the previous step's output `state`."""
        x = self.midlayer.inputs(self.embed_tokens(tokens), state)
        return self.midlayer.self_attn.project(x, *self._rope(positions))

    def _fuse(self, features: torch.Tensor) -> torch.Tensor:
        """`fc` of the three target states [.., 3H], after EAGLE 3.1's norms when the config has them."""
        if self.fc_norm is not None:
            features = torch.cat([norm(part) for norm, part in zip(self.fc_norm, features.chunk(3, dim=-1))], -1)
        if self.input_norm is not None:
            features = self.input_norm(features)
        return self.fc(features)

    def _finish(self, state: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The layer's output as the next step reads it: normed under EAGLE 3.1's `norm_output`."""
        out = self.midlayer.finish(state, attended)
        return self.norm(out) if self.config.norm_output else out

    def _head(self, state: torch.Tensor) -> torch.Tensor:
        """The head's input: the normed output (already normed under `norm_output`)."""
        return state if self.config.norm_output else self.norm(state)

    # -- inference ---------------------------------------------------------------------------------------------

    def new_cache(self, batch_size: int, capacity: int | None = None) -> DrafterCache:
        c = self.config
        return DrafterCache.empty(self.fc.weight, layers=1, batch_size=batch_size, kv_heads=c.num_key_value_heads,
                                  head_dim=c.head_dim, capacity=capacity, state_size=c.hidden_size)

    @torch.no_grad()
    def extend_cache(self, cache: DrafterCache, target_features: torch.Tensor, positions: torch.Tensor,
                     valid: torch.Tensor, next_ids: torch.Tensor | None = None) -> None:
        """Write the verified columns at `positions` [B,T]: features [B,T,3H] and the token after each position
        `next_ids` [B,T]. Each column attends causally to the cache's valid columns and the new ones, a chunk of
        queries at a time; invalid ones (padding, rejected slots) are written but never attended."""
        if next_ids is None:
            raise ValueError("an EAGLE-3 column pairs each position with the token after it: pass next_ids")
        q, k, v, state = self._columns(target_features, next_ids, positions)
        keys = torch.cat([cache.keys[0], k], dim=2)
        values = torch.cat([cache.values[0], v], dim=2)
        key_pos = torch.cat([cache.positions, positions], dim=1)
        key_ok = torch.cat([cache.valid, valid.bool()], dim=1)
        new = torch.arange(positions.shape[1], device=positions.device)
        self_key = cache.positions.shape[1] + new  # the query's own column: attended even when invalid (no NaN)
        out = []
        for part in row_chunks(positions.shape[1], CHUNK_ROWS):
            sees = key_ok[:, None, :] & (key_pos[:, None, :] <= positions[:, part, None])
            sees = sees | (torch.arange(keys.shape[2], device=keys.device) == self_key[part, None])
            out.append(grouped_sdpa(q[:, :, part], keys, values, sees[:, None], self.config.head_dim**-0.5))
        states = self._finish(state, torch.cat(out, dim=2))
        cache.append([(k, v)], positions, valid, states)

    def defer_context(self, cache: DrafterCache, target_features: torch.Tensor, positions: torch.Tensor,
                      valid: torch.Tensor, next_ids: torch.Tensor | None = None) -> None:
        """Extends the cache now: a chain's first step reads the cached state of the anchor's column, written by
        this extension's own attention, so there is no separate context pass to fold into the draft."""
        self.extend_cache(cache, target_features, positions, valid, next_ids)

    def commit_context(self, cache: DrafterCache) -> None:
        """Nothing is ever left pending (`defer_context`)."""

    @torch.no_grad()
    def draft(self, cache: DrafterCache, anchor_ids: torch.Tensor,
              anchor_positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy K−1 chain drafts [B,K−1] (target ids) and their logits [B,K−1,V] over the target vocabulary
        (−inf outside the draft vocabulary, as vLLM scatters them). `anchor_ids` is read through column a−1."""
        before = anchor_positions - 1
        state = self._column_output(cache, anchor_positions)
        sees_context = cache.visible_before(anchor_positions)[:, None, None, :]
        drafts: list[torch.Tensor] = []
        chain_k, chain_v, logits = [], [], []
        for step in range(self.block_size - 1):
            if step:
                q, k, v = self._step(drafts[-1][:, None], state, (before + step)[:, None])
                chain_k.append(k)
                chain_v.append(v)
                keys = torch.cat([cache.keys[0], *chain_k], dim=2)
                values = torch.cat([cache.values[0], *chain_v], dim=2)
                mask = torch.cat([sees_context, sees_context.new_ones(len(state), 1, 1, step)], dim=-1)
                state = self._finish(state, grouped_sdpa(q, keys, values, mask, self.config.head_dim**-0.5))
            step_logits = self.logits(self._head(state))[:, 0]
            drafts.append(self.to_target_ids(step_logits.argmax(-1)))
            logits.append(step_logits)
        return torch.stack(drafts, 1), self._full_vocab(torch.stack(logits, 1))

    def _column_output(self, cache: DrafterCache, anchor_positions: torch.Tensor) -> torch.Tensor:
        """o_{a-1} [B,1,H]: the cached output of the column before each anchor, which drafts its first token."""
        column = ((cache.positions == (anchor_positions - 1)[:, None]) & cache.valid).long().argmax(1)
        assert cache.states is not None  # this drafter's caches are made with its state_size (new_cache)
        return cache.states[torch.arange(len(column), device=column.device), column][:, None]

    def _full_vocab(self, draft_logits: torch.Tensor) -> torch.Tensor:
        full = draft_logits.new_full((*draft_logits.shape[:-1], self.config.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.vocab_ids, draft_logits)

    # -- training ------------------------------------------------------------------------------------------------

    def _context(self, features: torch.Tensor, context_ids: torch.Tensor, context_valid: torch.Tensor,
                 anchor_positions: torch.Tensor, chunk_rows: int) -> tuple[torch.Tensor, ...]:
        """The committed columns in one causal pass: their keys and values [B,kv,T,d], outputs o_p [B,T,H], and
        which columns each block's chain sees [B,M,T] (the valid ones before its anchor)."""
        batch, length = context_ids.shape
        positions = torch.arange(length, device=context_ids.device).expand(batch, -1)
        next_ids = torch.cat([context_ids[:, 1:], context_ids[:, -1:]], dim=1)
        has_next = torch.cat([context_valid[:, 1:], context_valid.new_zeros(batch, 1)], dim=1) & context_valid
        q, k, v, state = self._columns(features, next_ids, positions)
        attended = _causal_attention(q, k, v, has_next, self.config.head_dim**-0.5, chunk_rows)
        visible = has_next[:, None, :] & (positions[:, None, :] < anchor_positions[:, :, None])
        return k, v, self._finish(state, attended), visible

    def block_hidden(self, features: torch.Tensor, context_ids: torch.Tensor, context_valid: torch.Tensor,
                     anchor_positions: torch.Tensor, block_inputs: torch.Tensor,
                     chunk_rows: int = CHUNK_ROWS) -> torch.Tensor:
        """Final normed hidden [B,M,K−1,H] at every block's K−1 drafted slots, as `draft` computes them.

        features [B,T,3H] and context_ids [B,T] are the committed text (index == position), context_valid [B,T];
        block m starts at anchor_positions[b,m] and its chain is fed block_inputs[b,m,1:] (the rollout's drafts, or
        the data in SFT); block_inputs[...,0] is the anchor, which column a−1 already reads from context_ids."""
        k, v, columns, visible = self._context(features, context_ids, context_valid, anchor_positions, chunk_rows)
        rows = torch.arange(len(columns), device=columns.device)[:, None]
        step = columns[rows, (anchor_positions - 1).clamp_min(0)]  # o_{a-1}, [B,M,H]
        out = [self._head(step)]
        chain_k, chain_v = [], []
        for s in range(1, self.block_size - 1):
            sq, sk, sv = self._step(block_inputs[..., s], step, anchor_positions - 1 + s)
            chain_k.append(sk)
            chain_v.append(sv)
            attended = chain_attention(sq, k, v, torch.stack(chain_k, 3), torch.stack(chain_v, 3), visible,
                                        self.config.head_dim**-0.5, chunk_rows)
            step = self._finish(step, attended)
            out.append(self._head(step))
        return torch.stack(out, 2)

    forward = block_hidden

    # -- checkpoints -------------------------------------------------------------------------------------------

    def save_pretrained(self, directory: str | Path) -> None:
        """config.json + model.safetensors in SpecForge's layout (no embedding: it is the target's)."""
        write_checkpoint(directory, self.config, self.state_dict(), self.fc.weight.dtype)

    @classmethod
    def from_pretrained(cls, directory: str | Path | ModelDir, target: Target | SharedHead,
                        block_size: int = 8) -> Eagle3Drafter:
        """Load a public EAGLE-3 checkpoint for `target` (a path, or the directory already read); any mismatch raises
        a one-line OpdError. `block_size` applies when the file has none (SpecForge's have none: the chain length is
        a serving choice; 8 is its training unroll of 7 steps plus the anchor)."""
        model_dir = directory if isinstance(directory, ModelDir) else ModelDir.read(directory, "drafter")
        config = read_config(model_dir, target, block_size)
        drafter = cls(config, target.embed_tokens, target.lm_head)
        drafter.load_state_dict(read_tensors(model_dir.path / WEIGHTS_FILE, config))
        return drafter


class DraftVocabHead(nn.Module):
    """The target's LM head over the draft vocabulary only: its rows `vocab_ids`, taken once."""

    def __init__(self, head: nn.Linear, vocab_ids: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(head.weight.detach()[vocab_ids], requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.weight.T


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_ok: torch.Tensor, scale: float,
                      chunk_rows: int) -> torch.Tensor:
    """Causal attention of columns [B,heads,T,d] over the valid ones (`key_ok` [B,T]) and themselves, a chunk of
    queries at a time against the keys up to the chunk's end (checkpointed in training)."""
    outs = []
    for part in row_chunks(q.shape[2], chunk_rows):
        end = min(part.stop, q.shape[2])
        args = (q[:, :, part], k[:, :, :end], v[:, :, :end], key_ok[:, :end], part.start, scale)
        outs.append(checkpoint(_causal_chunk, *args, use_reentrant=False) if torch.is_grad_enabled()
                    else _causal_chunk(*args))
    return torch.cat(outs, dim=2)


def _causal_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_ok: torch.Tensor, first: int,
                  scale: float) -> torch.Tensor:
    rows = torch.arange(first, first + q.shape[2], device=q.device)[:, None]
    keys = torch.arange(k.shape[2], device=q.device)
    mask = (key_ok[:, None, :] & (keys <= rows)) | (keys == rows)
    return grouped_sdpa(q, k, v, mask[:, None], scale)


@drafter_family
class Eagle3Family(DrafterFamily):
    """EAGLE-3 (SpecForge's format; vLLM's and SGLang's `method: eagle3`): a chain over its own draft vocabulary."""

    section = Eagle3Spec
    public_layout: ClassVar[PublicLayout] = "specforge"

    def initial(self, section: Eagle3Spec, base: Target | SharedHead, tokenizer: Any) -> Eagle3Drafter:
        """The identity draft vocabulary until SFT fits one to its data (`fit_to_data`)."""
        return Eagle3Drafter(self.fresh_config(section, base), base.embed_tokens, base.lm_head).to(base.device)

    def fresh_config(self, section: Eagle3Spec, base: Target | SharedHead) -> Eagle3Config:
        """A fresh chain drafter's shape for `base` (what P-EAGLE's family builds its own on)."""
        return Eagle3Config.for_target(base.config, draft_vocab_size=draft_vocab_size(section, base.vocab_size),
                                       rope_theta=section.rope_theta, block_size=section.block_size,
                                       aux_layer_ids=[i + 1 for i in base.layer_ids])

    def load(self, directory: ModelDir, base: Target | SharedHead, section: Eagle3Spec) -> Eagle3Drafter:
        drafter = Eagle3Drafter.from_pretrained(directory, base, section.block_size).to(base.device)
        check_fused_layers(directory, drafter.config, base.layer_ids)
        return drafter

    def target_layer_ids(self, directory: ModelDir, num_target_layers: int) -> list[int]:
        block_size = self.section.model_validate({}).block_size  # read from the file where it has one
        return Eagle3Config.from_hf_dict(directory.config, num_target_layers=num_target_layers,
                                         block_size=block_size).target_layer_ids

    def check_initial(self, section: Eagle3Spec, tokenizer: Any, target: TargetShape) -> None:
        draft_vocab_size(section, target.vocab_size)

    def expected_shapes(self, directory: ModelDir, target: TargetShape, section: Eagle3Spec) -> Shapes:
        """Its fused layers must be the ones the spec captures, as loading demands later. Named as the file names
        them: vLLM's `speculators` layout calls SpecForge's `midlayer` `layers.0`."""
        config = read_config(directory, target, section.block_size)
        check_fused_layers(directory, config, target.layer_ids)
        shapes = expected_shapes(config)
        if is_speculators(directory.config):
            shapes = speculators_tensor_names(shapes)
        return shapes, lambda name: name == SHARED_EMBEDDING

    def served_block_size(self, directory: ModelDir, target: TargetShape | None, section: Eagle3Spec) -> int:
        """vLLM captures each layer once, so a repeated id would leave its fc short of a state. K is the file's
        `block_size`, else the spec's (SpecForge's files have none: the chain length is a serving choice)."""
        if target is None:
            raise OpdError("an EAGLE-3 drafter is checked against its target, whose config.json was not found")
        config = read_config(directory, target, section.block_size)
        check_distinct_layers(config.aux_layer_ids)
        return config.block_size

    def vllm_config(self, directory: ModelDir, block_size: int) -> dict[str, Any]:
        return {"method": "eagle3", "model": str(directory.path), "num_speculative_tokens": block_size - 1}

    def save_speculators(self, drafter: Any, directory: str | Path, verifier: str | None) -> None:
        architectures = [] if verifier is None else ModelDir.read(verifier, "target").architectures
        write_speculators(directory, drafter.config, drafter.state_dict(), drafter.fc.weight.dtype, verifier,
                          architectures)

    def fit_to_data(self, drafter: Any, token_counts: torch.Tensor) -> None:
        """The draft vocabulary: the data's most frequent response tokens (SpecForge's and EAGLE's rule)."""
        drafter.set_vocab(*draft_vocab(token_counts, drafter.config.draft_vocab_size))


def draft_vocab_size(section: Eagle3Spec, vocab_size: int) -> int:
    """`models.drafter.draft_vocab_size`, default the public Qwen3 drafters' 32,000 (or the whole vocabulary)."""
    size = section.draft_vocab_size or min(32000, vocab_size)
    if size > vocab_size:
        raise OpdError(f"models.drafter.draft_vocab_size: {size} is larger than the target's vocabulary "
                       f"{vocab_size} (expected at most {vocab_size})")
    return size


def check_fused_layers(directory: ModelDir, config: Eagle3Config, layer_ids: list[int]) -> None:
    """A loaded chain drafter (EAGLE-3's, P-EAGLE's) fuses the target layers the spec resolves, or one line."""
    if config.target_layer_ids != layer_ids:
        raise OpdError(f"drafter {directory.path}: fuses target layers {config.target_layer_ids} but "
                       f"models.drafter.target_layer_ids resolves to {layer_ids} (the family's default rule where "
                       f"unset; expected models.drafter.target_layer_ids={config.target_layer_ids}, the drafter's)")
