"""Targets larger than one GPU, laid out on 8×H200 nodes: each role's degree (ranks per replica), memory per rank,
step time from FLOPs and GPU-hours for the authors' schedule, from the targets' public config fields.

    python bench/sharded_layout.py [--json bench/results/sharded_layout.json] [--markdown bench/results/sharded_layout.md]

The config fields are fixtures (bench/fixtures/targets/*.json, copied by hand from the public config.json files and
model cards, each saying where its fields come from; nothing is downloaded). A role's degree is the smallest of 1,
2, 4, 8 (a replica packed on one node) or 16 (two nodes: projected only, the code packs a replica on one node)
that the spec accepts for the target (`opd.spec.shard_degree_issues`: it divides the heads, key/value heads and
experts, as transformers' tensor- and expert-parallel plans split them) and at which a rank fits an H200. What a
rank holds resident is what the spec sets (`KNOBS`): the shipped configs' rollout.batch_size 21,
replay.micro_batch_tokens 16,384 and eval.batch_size 1, lowered (as a user would set them, down to a floor) only
where no degree within a node holds them; each lowered value is a note under the table. A role that fits at no
degree is refused in one line naming the role and the bytes.

Memory per rank, in the precision each target is published in (FP8 for GLM 5.1 and Kimi K2.x; bf16 for the others,
and for Qwen3.5-397B-A17B also its FP8 checkpoint; MiniMax's FP8 release is taken in bf16, the larger; FP8 is
every linear weight in one byte, embedding and LM head in bf16): the weights transformers' plan splits, divided by
the degree, plus those it keeps whole (per family in `FAMILIES`: gpt-oss's and DeepSeek-V3's plans keep the
attention whole; MiniMax M2's gathers its q, k and v; only gpt-oss's splits the embedding), plus a whole copy of
the split embedding or LM head that a sharded target hands the drafter (opd/models/sharding.py; an unsplit one is
shared, not copied), plus the role's keys and values (split only where the attention's heads are; latent
attention's cached expanded per head, as transformers caches them) and Gated DeltaNet states (whole on every rank:
the plan gathers the linear layers' projections), plus a bf16 drafter copy on a rollout or evaluator rank. Past
the key/value heads (Qwen3.5's 2 at 4 or 8 ranks) each rank holds the attention whole, its keys and values with
it. 10% of the GPU is left for activations and the allocator.

The learner: one GPU holding the drafter's 20 bytes a parameter at the step (opd/train/master_weights.py) and the
target's embedding and LM head, on the scorer's node (the spec refuses more than a node holds). Where the scorer's
ranks fill that node, learner ranks share their GPUs (`resources.colocate_learner`): as many as divide the 210
sequences of an update, up to the scorer's ranks, with DeepSpeed ZeRO-2 splitting the fp32 state over them, and
the scorer holding what leaves room for one. Where the layout is still over two nodes, rollout-0 serves the
held-out evaluation (`resources.evaluate_on: rollout`) if its ranks hold a second drafter copy. A layout over two
nodes, and one only projected (an FP8 load, a family without a sharded test here, 16 ranks), say so under the
table.

Time per update (pipelined roles: the slowest one; the scorer and learner ranks that share GPUs take turns), from
FLOPs at an assumed MFU (`--mfu`, 0.4) of the H200's 989 TFLOP/s dense bf16, and, for decoding, no faster than
reading the rank's weights once per verification at 4.8 TB/s: the authors' update of 210 sequences, `--prompt`
prompt and `--response` response tokens at τ `--tau` with blocks of 16. A scorer over two nodes ships its batches
over the network: its bytes per update and their time on one 400 Gb/s link are a note. GPU-hours: 534 updates
(configs/qwen3-4b.yaml's schedule) × that time × the layout's GPUs. No assertions: a projection, not a
measurement.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from opd.model_dir import ModelDir
from opd.models.quantization import MXFP4, Quantization
from opd.spec import ResourcesSpec, RoleSpec, shard_degree_issues

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "targets"
GB, H200_BYTES, USABLE = 1e9, 141e9, 0.9
PEAK_FLOPS, HBM_BYTES_PER_S = 989e12, 4.8e12
DEGREES, GPUS_PER_NODE, NODES = (1, 2, 4, 8, 16), 8, 2
# Bytes a parameter in each precision: (the weights the plan splits outside the attention and the vocabulary, the
# rest). MXFP4 is gpt-oss's experts as published (4 bits and an 8-bit scale per 32 values), the rest bf16.
BYTES = {"bf16": (2.0, 2.0), "fp8": (1.0, 1.0), "mxfp4": (Quantization(MXFP4).bytes_per_parameter, 2.0)}
# (fixture, precision): each target in bf16 (what a dequantizing load holds), Qwen3.5-397B-A17B also from its FP8
# checkpoint and gpt-oss-120b also as published, in MXFP4 (its kernel path)
LAYOUTS = [("gpt-oss-120b", "bf16"), ("gpt-oss-120b", "mxfp4"), ("qwen3.5-122b-a10b", "bf16"), ("qwen3.5-397b-a17b", "bf16"),
           ("qwen3.5-397b-a17b", "fp8"), ("minimax-m2.5", "bf16"), ("glm-5.1", "fp8"), ("kimi-k2", "fp8")]
PROJECTED_ONLY = {"fp8": "an FP8 checkpoint's sharded load is not tested here (the CPU tests load bf16 and fp32)",
                  "mxfp4": "the MXFP4 kernel needs transformers' `kernels` package on the GPU, which the gpu extra "
                           "does not install; without it the trainer dequantizes to bf16 (the bf16 row)",
                  "minimax_m2": "no sharded test of MiniMax M2 here",
                  "deepseek_v3": "no sharded test of DeepSeek-V3's latent attention here",
                  "glm_moe_dsa": "the project refuses GLM 5's sparse attention (not an exact layer kind yet)",
                  16: "16 ranks span two nodes, and the code packs a replica on one node",
                  "zero": "DeepSpeed ZeRO-2 is not installed here (the shared placement runs here with the torch "
                          "learner)"}
SEQUENCES, UPDATES, BLOCK, DRAFTER_LAYERS = 210, 534, 16, 5
LIMIT = USABLE * H200_BYTES
NET_BYTES_PER_S = 50e9  # one 400 Gb/s link between nodes
# What each role holds resident, as the spec sets it: the shipped configs' value first, then the smaller ones a user
# would set where a rank cannot hold it (rollout.batch_size divides the update's 210 sequences, down to a third of
# 21; replay.micro_batch_tokens down to one sequence of prompt + response and a block; eval.batch_size is 1)
KNOBS = {"rollout": ("rollout.batch_size", (21, 15, 14, 10, 7)),
         "scorer": ("replay.micro_batch_tokens", (16_384, 8_192, 4_096)),
         "evaluator": ("eval.batch_size", (1,))}


@dataclass(frozen=True)
class Shape:
    """The parameter counts a layout needs, from a target's config fields, in the precision its weights load in."""

    name: str
    family: str  # config.json's model_type
    precision: str  # a key of BYTES: bf16; fp8 (every linear weight one byte, scales left out); mxfp4 (the experts)
    hidden: int
    vocab: int
    kv_heads: int
    total: float  # parameters
    active: float  # parameters a token runs through
    split: float  # parameters transformers' plan splits over the ranks, outside the attention and the vocabulary
    attention: float  # attention parameters the plan splits by heads (whole on every rank past the key/value heads)
    vocab_split: float  # embedding and LM head parameters the plan splits (the rest of 2 x vocab x hidden is whole)
    kv_bytes_per_token: float  # all attention layers, bf16, as transformers caches them (MLA's expanded per head)
    attention_split: bool  # the plan splits the attention's weights by heads (where the degree divides them)
    kv_split: bool  # ... and its keys and values with them (not where it gathers the projections' outputs)
    linear_state_bytes: float  # per sequence, all linear layers (fp32 recurrent + bf16 conv)
    config: dict

    @property
    def head_bytes(self) -> float:
        """Embedding + LM head, bf16 (untied targets here)."""
        return 2 * self.vocab * self.hidden * 2

    @property
    def weight_bytes(self) -> float:
        """All weights, in their precision."""
        split, rest = BYTES[self.precision]
        return split * self.split + rest * (self.total - self.split - 2 * self.vocab * self.hidden) + self.head_bytes

    def splits_attention(self, degree: int) -> bool:
        return self.attention_split and self.kv_heads % degree == 0

    def splits_kv(self, degree: int) -> bool:
        return self.kv_split and self.splits_attention(degree)


@dataclass(frozen=True)
class Blocks:
    """A family's parameter counts, from which `shape` sums a target's."""

    attention: float  # split by heads where the plan splits them
    attention_whole: float  # attention parameters no plan splits (MLA's down-projections)
    mlp_split: float  # experts, shared experts, dense MLPs: split (expert or tensor parallel)
    mlp_active: float  # what one token runs through of them
    router: float
    linear: float = 0.0  # linear-attention projections (split, their outputs gathered)
    kv_bytes_per_token: float = 0.0
    state_bytes: float = 0.0
    attention_split: bool = True
    kv_split: bool = True
    vocab_split_share: int = 2  # of the embedding and LM head, how many the plan splits


def gpt_oss(t: dict) -> Blocks:
    """q, k, v, o with biases, sinks; experts: gate_up, down, their biases. The plan splits the experts, the
    embedding and the LM head, not the attention."""
    h, layers, heads, kv, hd, experts = (t["hidden_size"], t["num_hidden_layers"], t["num_attention_heads"],
                                         t["num_key_value_heads"], t["head_dim"], t["num_local_experts"])
    attention = h * (heads + 2 * kv) * hd + heads * hd * h + (heads + 2 * kv) * hd + h + heads
    expert = 3 * h * t["intermediate_size"] + 3 * t["intermediate_size"] + h
    return Blocks(layers * attention, 0, layers * experts * expert, layers * t["num_experts_per_tok"] * expert,
                  layers * (h * experts + experts), kv_bytes_per_token=2 * layers * 2 * kv * hd,
                  attention_split=False, kv_split=False)


def qwen3_5(t: dict) -> Blocks:
    """Gated queries; Gated DeltaNet qkv, z, b, a, out (split, outputs gathered: its states whole on every rank);
    experts with a shared expert and its gate. The plan splits attention, linear attention, experts and the LM
    head, not the embedding."""
    h, layers, heads, kv, hd, experts = (t["hidden_size"], t["num_hidden_layers"], t["num_attention_heads"],
                                         t["num_key_value_heads"], t["head_dim"], t["num_experts"])
    full = layers // t["full_attention_interval"]
    kh, vh, dk, dv = (t["linear_num_key_heads"], t["linear_num_value_heads"], t["linear_key_head_dim"],
                      t["linear_value_head_dim"])
    conv = 2 * kh * dk + vh * dv
    linear = (layers - full) * (h * (conv + vh * dv + 2 * vh) + vh * dv * h)
    expert, shared = 3 * h * t["moe_intermediate_size"], 3 * h * t["shared_expert_intermediate_size"] + h
    state = (layers - full) * (vh * dk * dv * 4 + conv * t["linear_conv_kernel_dim"] * 2)
    return Blocks(full * (h * (2 * heads + 2 * kv) * hd + heads * hd * h), 0, layers * (experts * expert + shared),
                  layers * (t["num_experts_per_tok"] * expert + shared), layers * h * experts, linear,
                  2 * full * 2 * kv * hd, state, vocab_split_share=1)


def minimax_m2(t: dict) -> Blocks:
    """q, k, v split and their outputs gathered (every rank attends with all heads: keys and values whole), o
    split; 256 experts (expert parallel) with their routing biases. The plan splits the LM head, not the
    embedding."""
    h, layers, heads, kv, hd, experts = (t["hidden_size"], t["num_hidden_layers"], t["num_attention_heads"],
                                         t["num_key_value_heads"], t["head_dim"], t["num_local_experts"])
    expert = 3 * h * t["intermediate_size"]
    return Blocks(layers * (h * (heads + 2 * kv) * hd + heads * hd * h), 0, layers * experts * expert,
                  layers * t["num_experts_per_tok"] * expert, layers * (h * experts + experts),
                  kv_bytes_per_token=2 * layers * 2 * kv * hd, kv_split=False, vocab_split_share=1)


def mla_moe(t: dict) -> Blocks:
    """DeepSeek-V3's latent attention (Kimi K2; GLM 5 adds its sparse-attention indexer), the first layers dense,
    then routed and shared experts. transformers caches the keys and values expanded per head, not the latent.
    DeepSeek-V3's plan keeps the attention whole; GLM 5's splits q_b, kv_b and o by heads. Both split the LM head,
    not the embedding."""
    h, layers, heads, first = t["hidden_size"], t["num_hidden_layers"], t["num_attention_heads"], t["first_k_dense_replace"]
    qk, v, q_lora, kv_lora = (t["qk_nope_head_dim"] + t["qk_rope_head_dim"], t["v_head_dim"], t["q_lora_rank"],
                              t["kv_lora_rank"])
    by_heads = q_lora * heads * qk + kv_lora * heads * (t["qk_nope_head_dim"] + v) + heads * v * h
    down = h * q_lora + h * (kv_lora + t["qk_rope_head_dim"])
    indexer = q_lora * t.get("index_n_heads", 0) * t.get("index_head_dim", 0) + h * (
        t.get("index_head_dim", 0) + t.get("index_n_heads", 0))
    expert = 3 * h * t["moe_intermediate_size"]
    experts, moe = t["n_routed_experts"], layers - first
    glm = "index_n_heads" in t
    return Blocks(layers * by_heads, layers * (down + indexer),
                  first * 3 * h * t["intermediate_size"] + moe * (experts + t["n_shared_experts"]) * expert,
                  first * 3 * h * t["intermediate_size"] + moe * (t["num_experts_per_tok"] + t["n_shared_experts"])
                  * expert, moe * h * experts, kv_bytes_per_token=2 * layers * heads * (qk + v),
                  attention_split=glm, kv_split=glm, vocab_split_share=1)


FAMILIES = {"gpt_oss": gpt_oss, "qwen3_5_moe": qwen3_5, "minimax_m2": minimax_m2, "deepseek_v3": mla_moe,
            "glm_moe_dsa": mla_moe}


def shape(name: str, config: dict, precision: str = "bf16") -> Shape:
    text = config.get("text_config") or config
    h, vocab = text["hidden_size"], text["vocab_size"]
    b = FAMILIES[config["model_type"]](text)
    mixers = b.attention + b.attention_whole + b.linear
    total = mixers + b.mlp_split + b.router + 2 * vocab * h
    active = mixers + b.mlp_active + b.router + vocab * h  # the LM head, not the lookup
    return Shape(name, config["model_type"], precision, h, vocab, text["num_key_value_heads"], total, active, b.mlp_split + b.linear,
                 b.attention, b.vocab_split_share * vocab * h, b.kv_bytes_per_token, b.attention_split, b.kv_split,
                 b.state_bytes, text)


def rank_bytes(s: Shape, degree: int, tokens: float, sequences: float) -> float:
    """One rank's GPU bytes at `degree`, holding the keys and values of `tokens` and the states of `sequences`."""
    vocab = 2 * s.vocab * s.hidden
    attention = s.attention / (degree if s.splits_attention(degree) else 1)
    whole = s.total - s.split - s.attention - vocab
    split, rest = BYTES[s.precision]
    weights = split * s.split / degree + rest * (attention + whole) + 2 * (s.vocab_split / degree
                                                                                  + vocab - s.vocab_split)
    copies = 2 * s.vocab_split if degree > 1 else 0.0  # a whole copy of what the plan splits; the rest is shared
    kv = tokens * s.kv_bytes_per_token / (degree if s.splits_kv(degree) else 1)
    return weights + copies + kv + sequences * s.linear_state_bytes


def role_bytes(s: Shape, role: str, degree: int, knob: int, text: int) -> float:
    """A rank of `role` at `degree` holding what `knob` makes resident: the scorer's keys and values for
    `replay.micro_batch_tokens` tokens (twice them: the packed rows' drafted slots) and the states of as many
    sequences of `text` tokens as they hold; a rollout's or the evaluator's for `knob` sequences of `text` tokens,
    and its bf16 drafter copy."""
    if role == "scorer":
        return rank_bytes(s, degree, 2 * knob, knob / text)
    return rank_bytes(s, degree, knob * text, knob) + 2 * drafter_params(s)


@dataclass(frozen=True)
class Placed:
    degree: int
    knob: int  # the resident sequences (rollout, evaluator) or tokens (scorer) the rank holds
    bytes: float


def degree_for(s: Shape, role: str, text: int, beside: float = 0.0) -> Placed | str:
    """The smallest degree the spec accepts at which a rank (and `beside` more bytes on its GPU) fits an H200,
    holding as much of `KNOBS[role]` as fits: the shipped value at any degree within a node first, then smaller
    values (what a user would lower before spreading a replica over more GPUs), then the same over two nodes. Else
    a one-line refusal naming the role and the bytes."""
    config = ModelDir(Path(s.name), {"text_config": s.config})
    issues = {d: shard_degree_issues(ResourcesSpec(scorer=RoleSpec(gpus_per_replica=d)), config)
              for d in DEGREES}
    allowed = [d for d in DEGREES if not issues[d]]
    knobs = KNOBS[role][1]
    for d, knob in sorted(((d, k) for d in allowed for k in knobs),
                          key=lambda dk: (dk[0] > GPUS_PER_NODE, knobs.index(dk[1]), dk[0])):
        if (need := role_bytes(s, role, d, knob, text)) + beside <= LIMIT:
            return Placed(d, knob, need)
    d, (field, knobs) = max(allowed), KNOBS[role]
    limit = next((i[0].split(": ", 1)[1] for i in issues.values() if i),
                 f"{NODES} nodes hold {NODES * GPUS_PER_NODE}")
    return (f"{role}: {s.name} ({s.precision}) needs {role_bytes(s, role, d, knobs[-1], text) / GB:.0f} GB per rank "
            f"at {d} ranks and {field} {knobs[-1]}, over the {LIMIT / GB:.0f} GB an H200 leaves (more ranks: "
            f"{limit.split(' (')[0]})")


def drafter_params(s: Shape) -> float:
    """A DFlash drafter of `DRAFTER_LAYERS` Qwen3-style layers at the target's width (32 heads of 128, 8 key/value
    heads, MLP 3x the width: the z-lab drafters' widths for MoE targets are not published), and its fc over 5
    features."""
    h = s.hidden
    return DRAFTER_LAYERS * (2 * h * (4096 + 1024) + 3 * h * 3 * h) + 5 * h * h


def learner_bytes(s: Shape, ranks: int) -> float:
    """One learner rank of `ranks`: the drafter's bf16 weights and gradients whole (2 + 2 bytes a parameter), its
    fp32 masters, AdamW moments and the step's fp32 gradients (16 bytes) split over the ranks by ZeRO-2 (one rank:
    the 20 bytes opd/train/master_weights.py states), and the target's bf16 embedding and LM head."""
    return drafter_params(s) * (4 + 16 / ranks) + s.head_bytes


def scored_bytes(s: Shape, p: int, r: int, tau: float) -> float:
    """What the scorer ships per sequence (as bench/projection.py's `sequence_bytes` counts it): the bf16 final
    hidden states at the drafted slots and the bf16 features of the text, at `DRAFTER_LAYERS` target layers."""
    return (r / tau * (BLOCK - 1) + (p + r) * DRAFTER_LAYERS) * s.hidden * 2


def project(s: Shape, args) -> dict:
    p, r, tau = args.prompt, args.response, args.tau
    roles = {role: degree_for(s, role, p + r) for role in KNOBS}
    row: dict = {"target": s.name, "precision": s.precision, "params_b": s.total / 1e9, "active_b": s.active / 1e9,
                 "weights_gb": s.weight_bytes / GB}
    refused = [v for v in roles.values() if isinstance(v, str)]
    if refused:
        return row | {"refused": refused}
    rollout, scorer, evaluator = (v for v in roles.values() if isinstance(v, Placed))
    nd, notes = drafter_params(s), []
    # the scorer's ranks share the learner's node; where they fill it, learner ranks share their GPUs
    colocated = scorer.degree + 1 > GPUS_PER_NODE
    learners = max(k for k in range(1, scorer.degree + 1) if SEQUENCES % k == 0) if colocated else 1
    learner = learner_bytes(s, learners)
    if colocated:  # the scorer holds what leaves room for the learner rank beside it
        beside = degree_for(s, "scorer", p + r, learner)
        if isinstance(beside, str) or beside.degree != scorer.degree:
            return row | {"refused": [f"scorer: {s.name} ({s.precision}) needs {scorer.degree} ranks of "
                                      f"{scorer.bytes / GB:.0f} GB, and a learner rank of {learners} (ZeRO-2) beside "
                                      f"one takes {learner / GB:.0f} GB more: over the {LIMIT / GB:.0f} GB of an H200"]}
        scorer = beside
    learner_gpus = 0 if colocated else 1
    if colocated:
        notes.append(f"learner: {learners} ranks (ZeRO-2, resources.colocate_learner) beside {learners} of the "
                     f"scorer's {scorer.degree} ranks: {(scorer.bytes + learner) / GB:.0f} GB per shared H200; "
                     f"projected only: {PROJECTED_ONLY['zero']}")
    # the evaluator gets GPUs of its own only where the layout still fits two nodes; else rollout-0 evaluates
    # where rollout-0 can hold a second drafter copy, the evaluator's (its held-out sequence waits its turn)
    over = rollout.degree + scorer.degree + learner_gpus + evaluator.degree > NODES * GPUS_PER_NODE
    shared = degree_for(s, "rollout", p + r, 2 * nd) if over else None
    shared_eval = isinstance(shared, Placed) and shared.degree == rollout.degree
    if isinstance(shared, Placed) and shared_eval:
        rollout = shared
        notes.append("evaluator: on rollout-0 (resources.evaluate_on: rollout), its drafter copy there")
    elif over:
        notes.append(f"evaluator: {rollout.degree} rollout ranks cannot hold its drafter copy too, so it keeps "
                     f"{evaluator.degree} GPUs of its own")
    rollout_bytes = rollout.bytes + 2 * nd * shared_eval
    eval_gpus = 0 if shared_eval else evaluator.degree
    notes += [f"{role}: {KNOBS[role][0]} {v.knob} (not {KNOBS[role][1][0]}: a rank would not fit)"
              for role, v in (("rollout", rollout), ("scorer", scorer), ("evaluator", evaluator))
              if v.knob != KNOBS[role][1][0]]
    free = NODES * GPUS_PER_NODE - scorer.degree - learner_gpus - eval_gpus
    replicas = max(1, free // rollout.degree)
    blocks = r / tau
    rollout_flops = SEQUENCES * (2 * s.active * (p + blocks * BLOCK) + 2 * nd * blocks * BLOCK)
    flop_time = rollout_flops / (replicas * rollout.degree * PEAK_FLOPS * args.mfu)
    read_time = SEQUENCES / (replicas * rollout.knob) * blocks * rollout.bytes / HBM_BYTES_PER_S
    scorer_flops = SEQUENCES * 2 * s.active * (p + r + blocks * (BLOCK - 1))
    learner_flops = SEQUENCES * blocks * (BLOCK - 1) * 6 * (nd + s.vocab * s.hidden)
    times = {"rollout_s": max(flop_time, read_time), "scorer_s": scorer_flops / (scorer.degree * PEAK_FLOPS * args.mfu),
             "learner_s": learner_flops / (learners * PEAK_FLOPS * args.mfu)}
    # colocated, the scorer's and the learner's ranks take turns on the same GPUs
    step = max(times["rollout_s"], times["scorer_s"] + times["learner_s"]) if colocated else max(times.values())
    gpus = replicas * rollout.degree + scorer.degree + learner_gpus + eval_gpus
    if scorer.degree > GPUS_PER_NODE:
        shipped = SEQUENCES * scored_bytes(s, p, r, tau)
        notes.append(f"scorer: its {scorer.degree} ranks span two nodes, so its batches cross the network: "
                     f"{shipped / GB:.0f} GB per update, {shipped / NET_BYTES_PER_S:.1f} s at "
                     f"{NET_BYTES_PER_S / GB:.0f} GB/s against {step:.0f} s per update")
    if s.family == "deepseek_v3" and rollout.degree > GPUS_PER_NODE:
        latent = s.config["num_hidden_layers"] * (s.config["kv_lora_rank"] + s.config["qk_rope_head_dim"]) * 2
        notes.append(f"rollout: vLLM's engine (rollout.sampler: vllm) would cache the latent, {latent / 1e3:.0f} KB "
                     f"a token against {s.kv_bytes_per_token / 1e6:.1f} MB, but its weights take "
                     f"{rank_bytes(s, GPUS_PER_NODE, 0, 0) / GB:.0f} GB per rank at {GPUS_PER_NODE} ranks, over "
                     f"{LIMIT / GB:.0f}, and a vLLM replica is one actor on one node")
    notes += [f"at {d} ranks each rank holds the attention whole ({s.kv_heads} key/value heads)"
              for d in sorted({rollout.degree, scorer.degree, evaluator.degree})
              if s.attention_split and not s.splits_attention(d)]
    notes += [f"projected only: {PROJECTED_ONLY[why]}"
              for why in (s.precision, s.family, max(rollout.degree, scorer.degree, evaluator.degree))
              if why in PROJECTED_ONLY]
    if gpus > NODES * GPUS_PER_NODE:
        notes.append(f"over {NODES} nodes: rollout {replicas * rollout.degree} + scorer {scorer.degree} + learner "
                     f"{learner_gpus} + evaluator {eval_gpus} = {gpus} GPUs (each role fits {NODES} nodes)")
    return row | {"notes": notes, "rollout": f"{replicas} x {rollout.degree}", "rollout_sequences": rollout.knob,
                  "rollout_gb": rollout_bytes / GB, "scorer": scorer.degree, "scorer_tokens": scorer.knob,
                  "scorer_gb": scorer.bytes / GB, "evaluator": "rollout-0" if shared_eval else evaluator.degree,
                  "evaluator_gb": (rollout_bytes if shared_eval else evaluator.bytes) / GB, "learner_gb": learner / GB,
                  "learner_ranks": learners, "learner_beside_scorer": colocated, "gpus": gpus,
                  "nodes": math.ceil(gpus / GPUS_PER_NODE), "rollout_bound": "flops" if flop_time >= read_time
                  else "weights read", **times, "step_s": step, "gpu_hours": UPDATES * step * gpus / 3600}


def markdown(rows: list[dict], args) -> str:
    head = ("| target | precision | params (B) | active (B) | weights (GB) | rollout replicas x ranks (sequences) | "
            "GB/rank | scorer ranks (micro-batch tokens) | GB/rank | evaluator ranks | GB/rank | learner ranks, GB "
            "| GPUs (nodes) | s/update (rollout, scorer, learner) | GPU-hours, 534 updates |\n" + "|---" * 15 + "|\n")
    lines = []
    for r in rows:
        if "refused" in r:
            lines.append(f"| {r['target']} | {r['precision']} | {r['params_b']:.1f} | {r['active_b']:.1f} | "
                         f"{r['weights_gb']:.0f} | refused (below) |" + " |" * 9)
            continue
        learner = (f"{r['learner_ranks']} beside the scorer's" if r["learner_beside_scorer"] else "1 GPU") + (
            f", {r['learner_gb']:.0f}")
        lines.append(f"| {r['target']} | {r['precision']} | {r['params_b']:.1f} | {r['active_b']:.1f} | "
                     f"{r['weights_gb']:.0f} | {r['rollout']} ({r['rollout_sequences']}) | {r['rollout_gb']:.0f} | "
                     f"{r['scorer']} ({r['scorer_tokens']:,}) | {r['scorer_gb']:.0f} | {r['evaluator']} | "
                     f"{r['evaluator_gb']:.0f} | {learner} | {r['gpus']} ({r['nodes']}) | {r['step_s']:.0f} "
                     f"({r['rollout_s']:.0f}, {r['scorer_s']:.0f}, {r['learner_s']:.1f}; rollout "
                     f"{r['rollout_bound']}-bound) | {r['gpu_hours']:.0f} |")
    said = (f"Assumptions: prompt {args.prompt}, response {args.response} tokens, τ {args.tau}, blocks of {BLOCK}, "
            f"MFU {args.mfu} of bf16 peak, {NODES} nodes of {GPUS_PER_NODE} H200 ({H200_BYTES / GB:.0f} GB, "
            f"{USABLE:.0%} usable).\n")
    refusals = "".join(f"- {line}\n" for r in rows for line in r.get("refused", []))
    notes = "".join(f"- {r['target']} ({r['precision']}): {note}\n" for r in rows for note in r.get("notes", []))
    return (head + "\n".join(lines) + "\n\n" + said + ("\nNotes:\n\n" + notes if notes else "")
            + ("\nRefused:\n\n" + refusals if refusals else ""))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--response", type=int, default=2048)
    parser.add_argument("--tau", type=float, default=4.0)
    parser.add_argument("--mfu", type=float, default=0.4)
    parser.add_argument("--json", default="bench/results/sharded_layout.json")
    parser.add_argument("--markdown", default="bench/results/sharded_layout.md")
    args = parser.parse_args(argv)
    shapes = [shape(name, json.loads((FIXTURES / f"{name}.json").read_text()), precision)
              for name, precision in LAYOUTS]
    rows = [project(s, args) for s in shapes]
    table = markdown(rows, args)
    print(table)
    Path(args.json).write_text(json.dumps({"args": vars(args), "shapes": [asdict(s) | {"config": None}
                                                                            for s in shapes], "rows": rows}, indent=1))
    Path(args.markdown).write_text(table)


if __name__ == "__main__":
    main()
