"""Each role's GPU memory at Qwen3 shapes, projected: the target shapes, the shipped configs' sizes and the byte
formulas that turn bench/scale.py's CPU measurements into GPU bytes per role.

A module of its own because more than one script reads it: bench/scale.py projects every shipped config from its
measurements (`project`, and `budget_projection` for `--budget-only`), and bench/gpu_first_light.py holds a GPU's
measured peaks against the same `scorer_role` and `learner_role`. Importing it loads no model and starts nothing.

Each role's GPU memory is projected for the shipped configs (configs/qwen3-4b.yaml, qwen3-8b.yaml,
qwen3-30b-a3b.yaml: their prompt cap, batch sizes, loss chunk, eval lengths and drafter layers; the targets' shapes
from Qwen3's public configs) at 2048 and 4096-token responses and τ 6, 3 and 1.5 (`project`): the learner, the
scorer, a rollout actor and the evaluator, each part marked measured (per row or slot, from bench/scale.py's runs)
or formula. Also the hybrid configs/qwen3.5-9b.yaml (Gated DeltaNet and full attention, shapes from transformers'
Qwen3.5 config): its linear layers' per-sequence states and the decoder's rollback record instead of their keys and
values, and in replay each linear layer's record of the text (`Qwen3Shape.linear_replay_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

from opd.distill.replay import replay_mode
from opd.eval.expected import point_mass_settings
from opd.models.linear_replay import GROUP_BYTES, SEGMENT
from opd.spec import EvalSpec, load_spec

VOCAB, GPU_BYTES, GB = 151_936, 141e9, 1e9  # Qwen3's vocabulary, one H200's bytes, bytes per GB


@dataclass(frozen=True)
class Qwen3Shape:
    """A Qwen3 target's shape, from its public config.json (hidden_size, intermediate_size, num_hidden_layers,
    num_attention_heads, num_key_value_heads, head_dim, tie_word_embeddings; for the MoE num_experts,
    num_experts_per_tok, moe_intermediate_size, every layer sparse). The DFlash drafter takes the target's width,
    heads and dense intermediate size (the MoE's unused `intermediate_size`), so one shape sizes both.

    A hybrid (Qwen3.5) also has `linear_layers` Gated DeltaNet layers among its `layers`: each holds a conv state
    and a recurrent state per sequence and no per-token keys and values, so only the others grow a KV cache. Its
    full-attention layers project a sigmoid output gate beside each query (`gated_query`), which the drafter's
    Qwen3-style attention does not."""

    hidden: int
    intermediate: int
    layers: int
    kv_heads: int = 8
    tied: bool = False
    experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0
    heads: int = 32
    head_dim: int = 128
    vocab: int = VOCAB
    gated_query: bool = False
    linear_layers: int = 0
    linear_k_heads: int = 0
    linear_v_heads: int = 0
    linear_dk: int = 128
    linear_dv: int = 128
    conv_kernel: int = 4

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def attention_params(self) -> int:
        return 2 * self.hidden * (self.q_dim + self.kv_dim) + 2 * self.head_dim  # q, k, v, o and the q/k norms

    @property
    def conv_dim(self) -> int:
        """A linear layer's conv channels: its q and k (key heads) and v (value heads)."""
        return 2 * self.linear_k_heads * self.linear_dk + self.linear_v_heads * self.linear_dv

    def linear_params(self) -> int:
        """One Gated DeltaNet layer: the qkv, output-gate (z), β and decay (a) projections, the depthwise conv, the
        per-head decay parameters, the gated norm and the output projection."""
        h, value_dim, v_heads = self.hidden, self.linear_v_heads * self.linear_dv, self.linear_v_heads
        return h * (self.conv_dim + value_dim + 2 * v_heads) + self.conv_dim * self.conv_kernel + 2 * v_heads + \
            self.linear_dv + value_dim * h

    def target_params(self) -> int:
        h = self.hidden
        mlp = self.experts * (3 * h * self.expert_intermediate + h) if self.experts else 3 * h * self.intermediate
        full = self.attention_params() + (h * self.q_dim if self.gated_query else 0)
        mixers = (self.layers - self.linear_layers) * full + self.linear_layers * self.linear_params()
        return mixers + self.layers * (mlp + 2 * h) + self.vocab * h * (1 if self.tied else 2) + h

    def drafter_params(self, layers: int, features: int) -> int:
        """Decoder layers (dense MLP), the fc over `features` concatenated target features, two norms."""
        h = self.hidden
        return layers * (self.attention_params() + 3 * h * self.intermediate + 2 * h) + features * h * h + 2 * h

    def head_bytes(self) -> int:
        """The learner's embedding + LM head in bf16 (one tensor when tied)."""
        return self.vocab * self.hidden * 2 * (1 if self.tied else 2)

    def kv_bytes_per_token(self) -> int:
        return 2 * (self.layers - self.linear_layers) * self.kv_dim * 2

    def linear_state_bytes(self) -> int:
        """What the linear layers hold per sequence, whatever its length: the conv state (the last `conv_kernel`
        inputs, bf16) and the recurrent state (value heads × dk × dv, fp32 as the gated delta rule keeps it)."""
        recurrent = self.linear_v_heads * self.linear_dk * self.linear_dv * 4
        return self.linear_layers * (self.conv_dim * self.conv_kernel * 2 + recurrent)

    def rollback_bytes(self, block: int) -> int:
        """What the decoder's exact rollback keeps per sequence during one verification (opd/models/recurrent_rollback.py):
        each linear layer's kernel inputs over the block (q and k repeated to the value heads, v, the decay and β:
        heads·(2·dk + dv + 2) values a token, bf16), its conv inputs (bf16) and a copy of its starting recurrent
        state (fp32)."""
        inputs = self.linear_v_heads * (2 * self.linear_dk + self.linear_dv + 2) * 2 + self.conv_dim * 2
        return self.linear_layers * (block * inputs + self.linear_v_heads * self.linear_dk * self.linear_dv * 4)

    def linear_replay_bytes(self, text: float) -> float:
        """Packed replay's transient in one linear layer over a `text`-token prefix (opd/models/linear_replay.py):
        the text's kernel inputs (bf16 q, k, v and β, fp32 decay), its conv inputs (bf16) and the fp32 recurrent
        state at every `SEGMENT` positions; a group of blocks' advance (`GROUP_BYTES`) comes on top, once."""
        inputs = 2 * (2 * self.linear_k_heads * self.linear_dk + self.linear_v_heads * (self.linear_dv + 1)) + \
            4 * self.linear_v_heads + 2 * self.conv_dim
        return text * (inputs + self.linear_v_heads * self.linear_dk * self.linear_dv * 4 / SEGMENT)

    def linear_row_bytes(self, chunk: int = 64) -> int:
        """A linear layer's no-grad transient per token, transformers' torch chunked kernel (an upper bound on the
        fused one): the bf16 qkv, conv, z, β and decay projections, and the kernel's fp32 working set per value
        head: q, k, v and their chunk-padded copies, k·β, v·β, the corrected values, the output, and three
        chunk × chunk intra-chunk matrices."""
        value_dim = self.linear_v_heads * self.linear_dv
        projections = 2 * (2 * self.conv_dim + value_dim + 2 * self.linear_v_heads)
        per_head = 2 * (2 * self.linear_dk + self.linear_dv) + self.linear_dk + 3 * self.linear_dv + 3 * chunk
        return projections + self.linear_v_heads * per_head * 4

    def mlp_row_bytes(self) -> int:
        """A no-grad MLP's bf16 transient per token: gate, up and their product (MoE: for each of the token's
        experts, an upper bound, plus the fp32 router logits and softmax)."""
        if self.experts:
            return self.experts_per_token * 3 * self.expert_intermediate * 2 + 2 * self.experts * 4
        return 3 * self.intermediate * 2

    def scorer_row_bytes(self, features: int) -> int:
        """One packed row of the scorer's no-grad forward, beside the measured attention: residual, normed input and
        layer output, the q/k/v projections (a hybrid: or its linear layer's, whichever is larger), the MLP, and the
        feature hooks' copies, bf16."""
        mixer = 2 * (self.q_dim * (2 if self.gated_query else 1) + 2 * self.kv_dim)
        if self.linear_layers:
            mixer = max(mixer, self.linear_row_bytes())  # one layer at a time: the larger of the two kinds
        return 2 * (3 * self.hidden + features * self.hidden) + mixer + self.mlp_row_bytes()

    def student_row_bytes(self) -> int:
        """What autograd keeps per student row in one drafter layer beside the measured attention, bf16: two RMSNorms
        (input, fp32 intermediate), the shared q/k/v input, q/k norms, v, o_proj's input, the MLP's input, gate,
        up, SiLU and product."""
        return 2 * (8 * self.hidden + 4 * self.q_dim + 4 * self.kv_dim + 4 * self.intermediate)

    def context_row_bytes(self) -> int:
        """Per context token per drafter layer, with grad: the projected context and its norm, k (projection, norm,
        rotation) and v, bf16."""
        return 2 * (2 * self.hidden + 5 * self.kv_dim)


# Qwen3.5-9B: transformers' Qwen3_5TextConfig defaults (its "Qwen3.5-9B style" configuration): hidden 4096, MLP
# 12288, 32 layers of which every fourth is full attention (16 query heads, 4 key-value heads of 256, gated
# queries), Gated DeltaNet with 16 key / 32 value heads of 128 and a 4-wide conv, 248,320 vocabulary, untied.
# The text model only: the vision tower is not loaded as a target.
TARGETS = {"Qwen3-4B": Qwen3Shape(hidden=2560, intermediate=9728, layers=36, tied=True),
           "Qwen3-8B": Qwen3Shape(hidden=4096, intermediate=12288, layers=36),
           "Qwen3-30B-A3B": Qwen3Shape(hidden=2048, intermediate=6144, layers=48, kv_heads=4, experts=128,
                                       experts_per_token=8, expert_intermediate=768),
           "Qwen3.5-9B": Qwen3Shape(hidden=4096, intermediate=12288, layers=32, kv_heads=4, heads=16, head_dim=256,
                                    vocab=248_320, gated_query=True, linear_layers=24, linear_k_heads=16,
                                    linear_v_heads=32)}
DIAGNOSTIC_BYTES_PER_SLOT = 4 * len(point_mass_settings(EvalSpec().sampling))  # fp32 a_k per default setting


CONFIGS = {"Qwen3-4B": ("configs/qwen3-4b.yaml", ()), "Qwen3-8B": ("configs/qwen3-8b.yaml", ()),
           "Qwen3-30B-A3B": ("configs/qwen3-30b-a3b.yaml", ()), "Qwen3.5-9B": ("configs/qwen3.5-9b.yaml", ())}
POINTS = [(tokens, tau) for tokens in (2048, 4096) for tau in (6, 3, 1.5)]


def fit(rows: list[dict], key: str, per: str) -> tuple[float, float]:
    """Least-squares (intercept, slope) of rows[key] against rows[per] (two or more measured lengths)."""
    pts = [(r[per], r[key]) for r in rows if key in r]
    n = len(pts)
    mx, my = sum(x for x, _ in pts) / n, sum(y for _, y in pts) / n
    slope = sum((x - mx) * (y - my) for x, y in pts) / max(1e-12, sum((x - mx) ** 2 for x, _ in pts))
    return my - slope * mx, slope


def config_fields(path: str, overrides: tuple[str, ...] = ()) -> dict:
    """The shipped config's sizes the projection uses (the spec's defaults where the config leaves a field out)."""
    s = load_spec(path, overrides, check_paths=False)
    return {"prompt": s.data.max_prompt_tokens, "rollout_rows": s.rollout.batch_size, "micro": s.optim.micro_batch_size,
            "step_sequences": s.optim.batch_size, "learner_budget": s.optim.micro_batch_tokens,
            "scorer_budget": s.replay.micro_batch_tokens, "chunk": s.optim.loss_chunk_size, "eval_rows": s.eval.batch_size,
            "eval_tokens": s.eval.max_new_tokens, "drafter_layers": s.models.drafter.num_layers,
            "features": len(s.models.drafter.target_layer_ids or range(s.models.drafter.num_layers)),
            "block": s.models.drafter.block_size, "layout": replay_mode(s)}


def learner_role(q: Qwen3Shape, c: dict, tokens: int, tau: float, student: tuple[float, float], chunk_bytes: float,
                 seq_bytes: float) -> dict:
    """The learner's GPU bytes at the step's peak, by part. Measured: the student's attention per row (real lengths)
    and the loss chunk per slot; the rest by formula."""
    blocks, layers = tokens / tau, c["drafter_layers"]
    rows, context = blocks * c["block"], c["prompt"] + tokens
    attention = student[0] + student[1] * rows  # one layer, fp32 on the CPU, with grad
    per_layer = attention + rows * q.student_row_bytes() + context * q.context_row_bytes()
    return {"drafter_state": q.drafter_params(layers, c["features"]) * 20, "head": q.head_bytes(),
            "scored": c["micro"] * seq_bytes, "activations": c["micro"] * layers * per_layer,
            "loss_chunk": chunk_bytes * q.vocab / VOCAB * c["chunk"]}  # measured at Qwen3's vocabulary


def scorer_role(q: Qwen3Shape, c: dict, tokens: int, tau: float, teacher: tuple[float, float], diagnostic: float,
                seq_bytes: float) -> dict:
    """The scorer's GPU bytes: bf16 target weights, one packed sequence's no-grad forward (attention measured per
    row, the layer's projections, MLP, residual and feature hooks by formula), the diagnostic's LM-head chunk
    (measured) and the rollout batch's scored tensors it holds until shipped."""
    length = packed_length(c, tokens, tau)
    forward = teacher[0] + teacher[1] * length + length * q.scorer_row_bytes(c["features"])
    parts = {"weights": q.target_params() * 2, "forward": c["micro"] * forward}
    if c["layout"] == "draft_opd":  # only drafted blocks give the diagnostic the target's view of each slot
        parts["diagnostic"] = diagnostic * q.vocab / VOCAB
    if c["layout"] == "draft_opd" and q.linear_layers:  # one layer at a time
        parts["linear_replay"] = c["micro"] * q.linear_replay_bytes(c["prompt"] + tokens) + GROUP_BYTES
    return parts | {"shipped": c["rollout_rows"] * seq_bytes}


def decoder_role(q: Qwen3Shape, c: dict, rows: int, tokens: int) -> dict:
    """A rollout or evaluator actor: bf16 target + drafter copy, the compacted caches (prompt + committed tokens,
    plus one block's verify slots in the target's) and the prefill's transient (bf16 logits at every prompt token,
    the feature hooks, the MLP). All by formula."""
    layers, prompt = c["drafter_layers"], c["prompt"]
    prefill_row = q.vocab * 2 + c["features"] * q.hidden * 2 + q.mlp_row_bytes()
    parts = {"weights": (q.target_params() + q.drafter_params(layers, c["features"])) * 2,
             "target_kv": rows * (prompt + tokens + c["block"]) * q.kv_bytes_per_token(),
             "drafter_kv": rows * (prompt + tokens) * layers * 2 * q.kv_dim * 2}
    if q.linear_layers:
        parts |= {"linear_state": rows * q.linear_state_bytes(), "rollback": rows * q.rollback_bytes(c["block"])}
        prefill_row += q.linear_row_bytes()
    return parts | {"prefill": rows * prompt * prefill_row}


def packed_length(c: dict, tokens: int, tau: float) -> float:
    """Replay's packed row: prompt + response, plus (layout draft_opd) K-2 extra slots per drafted block (τ tokens
    per block); the committed layout reads every slot on the text itself."""
    return c["prompt"] + tokens + (tokens / tau * (c["block"] - 2) if c["layout"] == "draft_opd" else 0)


def sequence_bytes(q: Qwen3Shape, c: dict, tokens: int, tau: float) -> float:
    """What the scorer ships per sequence: bf16 final-norm hidden at the drafted slots, bf16 prefix features, the
    diagnostic's fp32 results per slot (layout draft_opd only)."""
    slots = tokens / tau * (c["block"] - 1)
    diagnostic = DIAGNOSTIC_BYTES_PER_SLOT if c["layout"] == "draft_opd" else 0
    return slots * q.hidden * 2 + (c["prompt"] + tokens) * c["features"] * q.hidden * 2 + slots * diagnostic


def previous_learner(measured: dict[int, list[dict]], q: Qwen3Shape, c: dict, tokens: int, tau: float,
                     chunk_bytes: float, seq_bytes: float) -> float:
    """The projection this replaces, for comparison: 12 bytes per drafter parameter (bf16 weights and grads, fp32
    AdamW, no masters), an untied embedding + head, activations from the linear fit at ≤ 512 tokens."""
    first = next(iter(measured))
    rows, scale = (measured[q.hidden], 1.0) if q.hidden in measured else (measured[first], q.hidden / first)
    _, block_bytes = fit(rows, "learner_peak_new", "blocks")
    layers = c["drafter_layers"]
    old_params = layers * (4096 * q.hidden * 2 + 1024 * q.hidden * 2 + 3 * q.intermediate * q.hidden) + \
        c["features"] * q.hidden * q.hidden
    return old_params * 12 + 2 * VOCAB * q.hidden * 2 + seq_bytes + block_bytes * scale * tokens / tau * layers + \
        chunk_bytes * c["chunk"]


def attention_fits(attention: list[dict]) -> tuple[tuple[float, float], tuple[float, float]]:
    """The teacher's attention bytes against its packed length and the student's against its block rows, as
    (intercept, slope) fits of the measured attention points: what every role's attention part is projected from."""
    return fit(attention, "teacher_peak_new", "packed_len"), fit(attention, "student_peak_new", "student_rows")


def project(measured: dict[int, list[dict]], chunk_bytes_per_slot: float, attention: list[dict]) -> list[dict]:
    """Per shipped config and (tokens, τ): each role's GPU bytes by part, totals and whether it fits one H200."""
    teacher, student = attention_fits(attention)
    diagnostic = max(r["scorer_peak_diagnostic"] - r["scorer_peak_new"] for rows in measured.values() for r in rows)
    out = []
    for name, (path, overrides) in CONFIGS.items():
        q, c = TARGETS[name], config_fields(path, overrides)
        for tokens, tau in POINTS:
            seq = sequence_bytes(q, c, tokens, tau)
            roles = {"learner": learner_role(q, c, tokens, tau, student, chunk_bytes_per_slot, seq),
                     "scorer": scorer_role(q, c, tokens, tau, teacher, diagnostic, seq),
                     "rollout": decoder_role(q, c, c["rollout_rows"], tokens),
                     "evaluator": decoder_role(q, c, c["eval_rows"], c["eval_tokens"])}
            row = {"config": name, "tokens": tokens, "tau": tau, "prompt": c["prompt"],
                   "packed_len": packed_length(c, tokens, tau), "step_gb": c["step_sequences"] * seq / GB,
                   "layout": c["layout"], "learner_gb_old": None if q.linear_layers else
                   previous_learner(measured, q, c, tokens, tau, chunk_bytes_per_slot, seq) / GB,
                   "parts": {role: {k: v / GB for k, v in parts.items()} for role, parts in roles.items()}}
            row |= {f"{role}_gb": sum(parts.values()) / GB for role, parts in roles.items()}
            row["fits"] = {role: row[f"{role}_gb"] * GB < GPU_BYTES for role in roles}
            out.append(row)
    return out


ROLES = ("learner", "scorer", "rollout", "evaluator")


def projection_rows(projected: list[dict]) -> tuple[list[str], list[list[str]]]:
    """The per-role table, as header and cells (shared by the console and --markdown)."""
    header = ["config", "tokens", "τ", "packed L", "scorer→learner GB/step", "learner (previous)", "learner",
              "scorer", "rollout", "evaluator", f"fits one H200 ({GPU_BYTES / GB:.0f} GB)"]

    def fits(r: dict) -> str:
        over = [role for role in ROLES if not r["fits"][role]]
        return "yes, every role" if not over else "NO: " + ", ".join(over) + " over"

    cells = [[r["config"], str(r["tokens"]), f"{r['tau']:g}", f"{r['packed_len']:,.0f}", f"{r['step_gb']:,.1f}",
              "—" if r["learner_gb_old"] is None else f"{r['learner_gb_old']:,.0f}",
              *(f"{r[f'{role}_gb']:,.0f}" for role in ROLES), fits(r)] for r in projected]
    return header, cells


def parts_rows(projected: list[dict]) -> tuple[list[str], list[list[str]]]:
    """Each role's parts (GB) at each config's hardest point (4096 tokens, τ 1.5)."""
    header = ["config", "role", "parts (GB; m = measured per row/slot, f = formula)", "total GB"]
    label = {"drafter_state": "f drafter 20 B/param", "head": "f embed+head", "scored": "f scored micro-batch",
             "activations": "m+f student", "loss_chunk": "m loss chunk", "weights": "f weights",
             "forward": "m+f packed forward", "diagnostic": "m diagnostic", "shipped": "f scored batch",
             "target_kv": "f target KV", "drafter_kv": "f drafter KV", "prefill": "f prefill",
             "linear_state": "f linear states", "rollback": "f rollback record",
             "linear_replay": "f linear replay record"}
    cells = []
    for r in projected:
        if (r["tokens"], r["tau"]) != (4096, 1.5):
            continue
        for role in ROLES:
            parts = ", ".join(f"{label[k]} {v:,.1f}" for k, v in r["parts"][role].items())
            cells.append([r["config"], role, parts, f"{r[f'{role}_gb']:,.1f}"])
    return header, cells


BUDGET_CONFIGS = {"Qwen3-4B": "configs/qwen3-4b-thinking.yaml", "Qwen3-8B": "configs/qwen3-8b-thinking.yaml"}
BUDGET_POINTS = [(tokens, tau) for tokens in (1024, 4096, 8192) for tau in (6, 1.5)]


def micro_batch_shape(c: dict, tokens: int, tau: float, budget: int | None, count: int) -> tuple[float, float, float]:
    """(sequences, context tokens, block rows) of the learner's largest micro-batch when every response has
    `tokens` tokens: `count` whole sequences, or under a token budget as many as fit, or one part of a sequence
    cut at block boundaries (opd/distill/micro_batches.py)."""
    context, rows = c["prompt"] + tokens, tokens / tau * c["block"]
    if budget is None:
        return count, count * context, count * rows
    if context + rows <= budget:
        fit_count = budget // (context + rows)
        return fit_count, fit_count * context, fit_count * rows
    return 1, context, (budget - context) // c["block"] * c["block"]



def budget_learner(q: Qwen3Shape, c: dict, tokens: int, tau: float, student: tuple[float, float],
                   chunk_bytes_per_slot: float, context: float, rows: float) -> float:
    """The learner's GPU bytes for a micro-batch of `context` context tokens and `rows` block rows: the parts of
    `learner_role`, with the scored tensors held per token of the micro-batch."""
    per_token = sequence_bytes(q, c, tokens, tau) / (c["prompt"] + tokens + tokens / tau * c["block"])
    layers = c["drafter_layers"]
    activations = layers * (student[0] + student[1] * rows + rows * q.student_row_bytes()
                            + context * q.context_row_bytes())
    return (q.drafter_params(layers, c["features"]) * 20 + q.head_bytes() + (context + rows) * per_token
            + activations + chunk_bytes_per_slot * c["chunk"])


def budget_scorer(q: Qwen3Shape, c: dict, tokens: int, tau: float, teacher: tuple[float, float],
                  scorer_budget: int | None, count: int) -> float:
    """The scorer's GPU bytes for one packed forward: `count` sequences, or under a token budget as many whole packed
    sequences as fit; one longer than the budget counts the budget's tokens, or its prompt and response if more."""
    length = packed_length(c, tokens, tau)
    packed = count * length if scorer_budget is None else min(
        max(1, scorer_budget // length) * length, max(scorer_budget, c["prompt"] + tokens))
    return q.target_params() * 2 + teacher[0] + packed * (teacher[1] + q.scorer_row_bytes(c["features"]))


def budget_projection(chunk_bytes_per_slot: float, attention: list[dict], count: int) -> list[dict]:
    """The learner's and the scorer's GPU GB at thinking-length responses: `count` sequences per micro-batch (the
    fixed layout) against each thinking config's token budgets; everything but the micro-batch as `project`."""
    teacher, student = attention_fits(attention)
    out = []
    for name, path in BUDGET_CONFIGS.items():
        q, c = TARGETS[name], config_fields(path)
        for tokens, tau in BUDGET_POINTS:
            row = {"config": name, "tokens": tokens, "tau": tau, "learner_budget": c["learner_budget"],
                   "scorer_budget": c["scorer_budget"]}
            for layout, budget, scorer_budget in (("fixed", None, None),
                                                  ("budget", c["learner_budget"], c["scorer_budget"])):
                n, context, rows = micro_batch_shape(c, tokens, tau, budget, count)
                learner = budget_learner(q, c, tokens, tau, student, chunk_bytes_per_slot, context, rows)
                row[f"{layout}_sequences"], row[f"{layout}_learner_gb"] = n, learner / GB
                row[f"{layout}_scorer_gb"] = budget_scorer(q, c, tokens, tau, teacher, scorer_budget, count) / GB
            out.append(row)
    return out


def print_budget(rows: list[dict], count: int) -> None:
    """`--budget-only`'s table: fixed micro-batches beside the thinking configs' token budgets, as markdown."""
    header = ["config", "tokens", "τ", f"learner GB, {count} seq/MB", "learner GB, budget (seqs or part)",
              f"scorer GB, {count} seq/MB", "scorer GB, budget"]
    cells = [[r["config"], str(r["tokens"]), f"{r['tau']:g}", f"{r['fixed_learner_gb']:,.1f}",
              f"{r['budget_learner_gb']:,.1f} ({r['budget_sequences']:g})", f"{r['fixed_scorer_gb']:,.1f}",
              f"{r['budget_scorer_gb']:,.1f}"] for r in rows]
    print(f"token budgets: learner {rows[0]['learner_budget']:,}, scorer {rows[0]['scorer_budget']:,} tokens "
          "(the thinking configs)")
    print(markdown(header, cells))


def markdown(header: list[str], cells: list[list[str]]) -> str:
    """A markdown table, so that `--markdown` output pastes into bench/results/scale.md as it is."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in cells])


def print_projection(projected: list[dict], as_markdown: bool) -> None:
    """The per-role table and the parts table, on the console or as markdown."""
    title = (f"projected GPU GB per role at each shipped config's prompt cap ({projected[0]['prompt']} tokens), "
             f"H200 {GPU_BYTES / GB:.0f} GB")
    for header, cells in (projection_rows(projected), parts_rows(projected)):
        if as_markdown:
            print(markdown(header, cells) + "\n")
            continue
        t = Table(title=title)
        for c in header:
            t.add_column(c, justify="right")
        for row in cells:
            t.add_row(*row)
        Console(width=220).print(t)
        title = "the parts at 4096 tokens, τ 1.5"
