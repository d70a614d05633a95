"""The replay data path at Qwen3's real vocabulary and hidden sizes, on a CPU: the replaced path beside the new one.

    python bench/scale.py [--hidden 2560 4096] [--lengths 128 256 512] [--old-max-length 128]
                          [--json bench/results/scale.json] [--sft-only] [--attention-only] [--project-only]

Random-weight Qwen3 targets with the real vocabulary (151,936) and hidden size (2560 = 4B, 4096 = 8B), one
decoder layer (MLP width = hidden, so a CPU can run it) whose output is read five times as the drafter's
features (n = 5, as the shipped drafters), and a one-layer DFlash drafter. Synthetic rollout records with a
`--prompt`-token prompt, τ ≈ 6, block 16. Measured, per response length:

- bytes the scorer ships per sequence: the new `ScoredBatch` pickled (protocol 5: in-band + out-of-band
  buffers), and the replaced path's tensors from the same packed forward (fp32 [N, 15, V] log-probs and the
  packed row's whole feature storage, which a view pickled);
- scorer and learner peak memory per micro-batch (one sequence; `opd.memory.peak_cpu_bytes`); the scorer also
  with the expected-acceptance diagnostic it computes for the default eval settings (greedy and T=0.6 / top-p
  0.95 / top-k 20: the LM head over the drafted slots, `opd/train/scorer.py`), whose [N, K-1] results it also
  ships (counted in the bytes). The replaced
  learner is the unchunked loss on [N, 15, V] logits; the new one the chunked loss from hidden states. The
  bench uses `--chunk` 128 slots so that every length spans several chunks;
- once: the object store's rate for the new `ScoredBatch` against default torch pickling of the same tensors,
  and a weight publish + landing at Qwen3-4B drafter size (5 layers, ~1 GB bf16): copy + checksum + put, then
  get + verify — blake2b and torch pickling (replaced) against CRC-32 and zero-copy (new).

Also the SFT step at Qwen3-4B's vocabulary and width (`measure_sft`; `--sft-only` runs just that): one
sequence per micro-batch, the new step (decoder features, chunked hidden-state loss) at the real response length
and `--sft-anchors` anchors, the replaced one (full target forward, all slots' logits at once) at
`--sft-old-length`, both projected to 512 anchors at 2048 tokens.

Also the attention at real lengths (`measure_attention`; `--attention-only` runs just that): one sequence's
attention in one Qwen3-4B layer (32 query / 8 key-value heads of 128, fp32), the teacher's packed replay (no grad)
and the student's blocks (with grad), block-sparse against the replaced dense masks where the packed length is at
most `--attention-old-max`, at 2048 and 4096-token responses and τ 1.5 and 6 (`--attention-points`), measured.

The CPU runs fp32 (its bf16 matmuls are 8x slower); shipped float tensors are cast to bf16 before they are
measured, as on the GPU. Then each role's GPU memory is projected for the shipped configs (configs/qwen3-4b.yaml,
qwen3-8b.yaml, qwen3-30b-a3b.yaml: their prompt cap, batch sizes, loss chunk, eval lengths and drafter layers;
the targets' shapes from Qwen3's public configs) at 2048 and 4096-token responses and τ 6, 3 and 1.5 (`project`):
the learner, the scorer, a rollout actor and the evaluator, each part marked measured (per row or slot, from the
runs above) or formula. Also the hybrid configs/qwen3.5-9b.yaml (Gated DeltaNet and full attention, shapes from
transformers' Qwen3.5 config): its linear layers' per-sequence states and the decoder's rollback record instead
of their keys and values, and in replay each linear layer's record of the text (`linear_replay_bytes`).
`--project-only [--markdown]` re-projects stored measurements (attention from
`--attention-json`). Writes bench/results/scale.json. No assertions: numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import pickle
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from replay import synthetic_record  # bench/replay.py, beside this script
from rich.console import Console
from rich.table import Table
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from opd.distill.dense_reference import dense_block_mask, dense_teacher_masks
from opd.distill.losses import acceptance_aware_loss, sft_loss, teacher_distribution
from opd.distill.replay import pack, packed_inputs, replay_mode, score, student_hidden
from opd.eval.expected import point_mass_settings, record_drafts, teacher_acceptance
from opd.memory import peak_cpu_bytes
from opd.models.dflash import DFlashConfig, DFlashDrafter
from opd.models.linear_replay import GROUP_BYTES, SEGMENT
from opd.models.packed_attention import BlockChunks
from opd.models.target import Target
from opd.spec import EvalSpec, LossSpec, load_spec
from opd.train.messages import WeightSnapshot
from opd.train.sft import SftBatch, SftExample, sft_batch_loss, sft_micro_batches

VOCAB, K, N_FEATURES, GPU_BYTES = 151_936, 16, 5, 141e9


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
DRAFTER_LAYERS = 5  # the Qwen3-4B drafter whose publish is timed
GB = 1e9
DIAGNOSTIC_BYTES_PER_SLOT = 4 * len(point_mass_settings(EvalSpec().sampling))  # fp32 a_k per default setting


def build(hidden: int, seed: int = 0) -> tuple[Target, DFlashDrafter]:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=hidden, num_hidden_layers=1,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                         max_position_embeddings=8192, tie_word_embeddings=False, attn_implementation="sdpa")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        target = Target(Qwen3ForCausalLM(config).float(), [0] * N_FEATURES)
        drafter_config = DFlashConfig.for_target(target.config, num_layers=1, block_size=K,
                                                 mask_token_id=VOCAB - 1, target_layer_ids=[0] * N_FEATURES)
        drafter = DFlashDrafter(drafter_config, target.embed_tokens, target.lm_head)
    return target, drafter


def records(length: int, prompt: int, tau: float, count: int = 1) -> list:
    g = torch.Generator().manual_seed(length)
    accept = 1 - 1 / tau  # geometric acceptance: mean accepted + 1 ≈ τ
    return [synthetic_record(i, length, prompt, VOCAB - 1, K, accept, g) for i in range(count)]


def as_bf16(batch) -> object:
    """What the GPU path ships: float tensors in the target's bf16."""
    batch.features, batch.teacher = batch.features.bfloat16(), batch.teacher.bfloat16()
    return batch


def pickled_bytes(obj: object) -> int:
    buffers = []
    inband = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    return len(inband) + sum(memoryview(b).nbytes for b in buffers)


def old_scorer(target: Target, recs: list) -> tuple[torch.Tensor, torch.Tensor]:
    """The replaced scorer: packed forward *with* the LM head, fp32 log-probs at every slot, features as a view."""
    packed, ids, positions, layout = packed_inputs(recs, K, "draft_opd")
    with torch.no_grad():
        out = target(ids, attention_mask=layout, position_ids=positions)
        rows = torch.stack([out.logits[b, torch.tensor(s)] for b, p in enumerate(packed) for s in p.slot_index])
        return teacher_distribution(rows), out.features


def measure_length(target: Target, drafter: DFlashDrafter, length: int, args) -> dict:
    recs = records(length, args.prompt, args.tau)
    row: dict = {"length": length, "blocks": recs[0].num_steps}
    scored = {}
    row["scorer_peak_new"] = peak_cpu_bytes(lambda: scored.setdefault("b", score(target, recs, block_size=K)))
    batch = scored["b"]
    drafts, _ = record_drafts(recs)
    settings = point_mass_settings(EvalSpec().sampling)

    def scorer_with_diagnostic() -> None:
        replayed = score(target, recs, block_size=K)
        scored["a"] = teacher_acceptance(drafts, replayed.teacher, target.lm_head, settings)

    row["scorer_peak_diagnostic"] = peak_cpu_bytes(scorer_with_diagnostic)
    row["packed_tokens"] = len(pack(recs[0], K, "draft_opd").ids)
    row["shipped_new"] = pickled_bytes(as_bf16(score(target, recs, block_size=K))) + pickled_bytes(scored["a"])
    cfg = LossSpec()

    def new_learner() -> None:
        hidden = student_hidden(drafter, batch)
        acceptance_aware_loss(hidden, batch.teacher, batch.accepted, cfg, batch.position_mask, head=drafter.lm_head,
                              chunk_size=args.chunk).loss.backward()

    row["learner_peak_new"] = peak_cpu_bytes(new_learner)
    drafter.zero_grad(set_to_none=True)
    if length <= args.old_max_length:
        old = {}
        row["scorer_peak_old"] = peak_cpu_bytes(lambda: old.setdefault("t", old_scorer(target, recs)))
        teacher, features = old["t"]
        row["shipped_old"] = teacher.nbytes + features.numel() * 2  # the view pickled the whole bf16 storage

        def old_learner() -> None:
            logits = drafter.logits(student_hidden(drafter, batch))
            acceptance_aware_loss(logits, teacher, batch.accepted, cfg, batch.position_mask).loss.backward()

        row["learner_peak_old"] = peak_cpu_bytes(old_learner)
        drafter.zero_grad(set_to_none=True)
        del old, teacher, features
    gc.collect()
    return row


def object_store_rates(target: Target, args) -> dict:
    """GB/s of put + get in another worker for a scored batch: zero-copy ScoredBatch vs torch pickling."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)

    @ray.remote
    class Sink:
        def take(self, wrapped: list) -> int:
            value = ray.get(wrapped[0])
            return sum(t.numel() for t in (value.values() if isinstance(value, dict) else vars(value).values()))

    sink = Sink.remote()
    batch = as_bf16(score(target, records(args.transfer_length, args.prompt, args.tau, count=8), block_size=K))
    as_torch = dict(vars(batch))
    size = pickled_bytes(batch)
    out = {"payload_gb": size / GB}
    for name, payload in (("zero_copy", batch), ("torch_pickle", as_torch)):
        ray.get(sink.take.remote([ray.put(payload)]))  # warm the worker
        t0 = time.perf_counter()
        for _ in range(args.repeats):
            ray.get(sink.take.remote([ray.put(payload)]))
        out[f"{name}_gb_per_s"] = size * args.repeats / (time.perf_counter() - t0) / GB
    out.update(publish_times(ray, Sink))
    ray.shutdown()
    return out


def publish_times(ray, sink_cls) -> dict:
    """One publish + landing of a Qwen3-4B-sized drafter (5 layers of hidden 2560, MLP 9728, fc 5H->H), bf16."""
    h, inter, layers = 2560, 9728, DRAFTER_LAYERS
    shapes = {"fc.weight": (h, N_FEATURES * h)}
    for i in range(layers):
        shapes |= {f"layers.{i}.self_attn.q_proj.weight": (4096, h), f"layers.{i}.self_attn.k_proj.weight": (1024, h),
                   f"layers.{i}.self_attn.v_proj.weight": (1024, h), f"layers.{i}.self_attn.o_proj.weight": (h, 4096),
                   f"layers.{i}.mlp.gate_proj.weight": (inter, h), f"layers.{i}.mlp.up_proj.weight": (inter, h),
                   f"layers.{i}.mlp.down_proj.weight": (h, inter)}
    state = {k: torch.empty(s, dtype=torch.bfloat16).normal_() for k, s in shapes.items()}
    nbytes = sum(t.nbytes for t in state.values())

    def blake2b(tensors: dict) -> str:  # the replaced checksum, as it was computed (tobytes copies)
        digest = hashlib.blake2b(digest_size=16)
        for name in sorted(tensors):
            digest.update(tensors[name].contiguous().view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()

    out = {"drafter_gb": nbytes / GB}
    t0 = time.perf_counter()
    cpu = {k: v.to("cpu", copy=True) for k, v in state.items()}
    digest = blake2b(cpu)
    ref = ray.put(cpu)
    t1 = time.perf_counter()
    landed = ray.get(ref)
    assert blake2b(landed) == digest
    t2 = time.perf_counter()
    out |= {"publish_old_s": t1 - t0, "land_old_s": t2 - t1}
    del cpu, landed, ref
    t0 = time.perf_counter()
    snapshot = WeightSnapshot.of(state, 1)
    ref = ray.put(snapshot)
    t1 = time.perf_counter()
    ray.get(ref).verified(1)
    t2 = time.perf_counter()
    out |= {"publish_new_s": t1 - t0, "land_new_s": t2 - t1}
    return out


# ------------------------------------------------------------------------------------------------ attention


HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128  # one Qwen3-4B attention layer


def heads(rows: int, count: int, g: torch.Generator, grad: bool = False) -> torch.Tensor:
    """Random [1, count, rows, 128] fp32 queries, keys or values, as a layer's projections make them."""
    return torch.randn(1, count, rows, HEAD_DIM, generator=g).requires_grad_(grad)


def old_teacher_attention(packed: list, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The replaced teacher attention: the [1, 1, L, L] bool mask from its Python loop over blocks, then HF's sdpa
    with it (which repeats K/V per query head when a mask is given)."""
    mask = dense_teacher_masks(packed, K, q.shape[2])
    stub = SimpleNamespace(num_key_value_groups=HEADS // KV_HEADS, is_causal=True, training=False)
    return sdpa_attention_forward(stub, q, k, v, mask, scaling=HEAD_DIM**-0.5)[0]


def old_student_attention(valid: torch.Tensor, anchors: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                          v: torch.Tensor, context: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The replaced DFlashAttention: the dense [1, 1, M*K, C+M*K] block mask, K/V repeated per query head."""
    mask = dense_block_mask(valid, anchors, K)
    groups = HEADS // KV_HEADS
    keys = torch.cat([context[0], k], dim=2).repeat_interleave(groups, 1)
    values = torch.cat([context[1], v], dim=2).repeat_interleave(groups, 1)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=HEAD_DIM**-0.5)


def timed_peak(fn) -> tuple[int, float]:
    """(peak bytes above the start, seconds) of one call."""
    seconds = []

    def run() -> None:
        started = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - started)

    return peak_cpu_bytes(run), seconds[0]


def attention_point(response: int, tau: float, args) -> dict:
    """One sequence (`--projection-prompt`-token prompt): the teacher's packed replay attention (no grad, as the
    scorer) and the student's block attention (with grad, as the learner: what backward keeps counts),
    block-sparse, and dense as replaced where the packed length is at most `--attention-old-max`."""
    g = torch.Generator().manual_seed(response)
    recs = [synthetic_record(0, response, args.projection_prompt, VOCAB - 1, K, 1 - 1 / tau, g)]
    packed, ids, _, layout = packed_inputs(recs, K, "draft_opd")
    p, length = packed[0], ids.shape[1]
    rows, context = len(p.anchors) * K, p.prefix_len
    row = {"response": response, "tau": tau, "blocks": len(p.anchors), "packed_len": length, "student_rows": rows,
           "context": context, "old": length <= args.attention_old_max}
    q, k, v = heads(length, HEADS, g), heads(length, KV_HEADS, g), heads(length, KV_HEADS, g)
    with torch.no_grad():
        row["teacher_peak_new"], row["teacher_s_new"] = timed_peak(lambda: layout.attend(q, k, v, HEAD_DIM**-0.5))
        if row["old"]:
            row["teacher_peak_old"], row["teacher_s_old"] = timed_peak(lambda: old_teacher_attention(packed, q, k, v))
    del q, k, v
    gc.collect()
    q, k, v = heads(rows, HEADS, g, True), heads(rows, KV_HEADS, g, True), heads(rows, KV_HEADS, g, True)
    ctx = (heads(context, KV_HEADS, g, True), heads(context, KV_HEADS, g, True))
    valid, anchors = torch.ones(1, context, dtype=torch.bool), torch.tensor([p.anchors])
    chunks = BlockChunks.of(valid, anchors, K)
    row["student_peak_new"], row["student_s_new"] = timed_peak(lambda: chunks.attend(q, k, v, ctx, HEAD_DIM**-0.5))
    if row["old"]:
        row["student_peak_old"], row["student_s_old"] = timed_peak(
            lambda: old_student_attention(valid, anchors, q, k, v, ctx))
    gc.collect()
    Console().print(f"attention: response {response}, τ {tau}: measured")
    return row


def measure_attention(args) -> list[dict]:
    points = [tuple(float(x) for x in point.split(":")) for point in args.attention_points]
    return [attention_point(int(response), tau, args) for response, tau in points]


def print_attention(rows: list[dict]) -> None:
    t = Table(title="attention at real lengths, one Qwen3-4B layer (32/8 heads of 128), fp32 on this CPU, one "
                    "sequence: measured. Peak MB (per 1K rows), seconds; old = dense masks, — = not run")
    for c in ("response", "τ", "blocks", "packed L", "teacher old", "teacher new", "s old", "s new", "student rows",
              "student old", "student new", "s old", "s new"):
        t.add_column(c, justify="right")
    for r in sorted(rows, key=lambda r: (r["response"], -r["tau"])):
        def peak(key: str, per: str) -> str:
            return f"{r[key] / 1e6:,.0f} ({r[key] / r[per] / 1e3:.1f})" if key in r else "—"

        def secs(key: str) -> str:
            return f"{r[key]:.0f}" if key in r else "—"

        t.add_row(str(r["response"]), f"{r['tau']:g}", str(r["blocks"]), f"{r['packed_len']:,}",
                  peak("teacher_peak_old", "packed_len"), peak("teacher_peak_new", "packed_len"),
                  secs("teacher_s_old"), secs("teacher_s_new"), f"{r['student_rows']:,}",
                  peak("student_peak_old", "student_rows"), peak("student_peak_new", "student_rows"),
                  secs("student_s_old"), secs("student_s_new"))
    Console(width=200).print(t)


def run_attention_only(args) -> None:
    """Measure `--attention-points` and merge them into --json's attention rows (same response and τ replaced)."""
    torch.set_num_threads(2)
    stored = Path(args.json)
    result = json.loads(stored.read_text()) if stored.exists() else {}
    fresh = measure_attention(args)
    keep = [r for r in result.get("attention", []) if (r["response"], r["tau"]) not in
            {(f["response"], f["tau"]) for f in fresh}]
    result["attention"] = keep + fresh
    print_attention(result["attention"])
    stored.parent.mkdir(parents=True, exist_ok=True)
    stored.write_text(json.dumps(result, indent=1, default=str))


# ------------------------------------------------------------------------------------------------ projection


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


def project(measured: dict[int, list[dict]], chunk_bytes_per_slot: float, attention: list[dict]) -> list[dict]:
    """Per shipped config and (tokens, τ): each role's GPU bytes by part, totals and whether it fits one H200."""
    teacher, student = fit(attention, "teacher_peak_new", "packed_len"), fit(attention, "student_peak_new",
                                                                            "student_rows")
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


def budget_projection(measured: dict[int, list[dict]], chunk_bytes_per_slot: float, attention: list[dict],
                      count: int) -> list[dict]:
    """The learner's and the scorer's GPU GB at thinking-length responses: `count` sequences per micro-batch (the
    fixed layout) against each thinking config's token budgets; everything but the micro-batch as `project`."""
    teacher, student = fit(attention, "teacher_peak_new", "packed_len"), fit(attention, "student_peak_new",
                                                                            "student_rows")
    out = []
    for name, path in BUDGET_CONFIGS.items():
        q, c = TARGETS[name], config_fields(path)
        for tokens, tau in BUDGET_POINTS:
            row = {"config": name, "tokens": tokens, "tau": tau, "learner_budget": c["learner_budget"],
                   "scorer_budget": c["scorer_budget"]}
            for layout, budget, scorer_budget in (("fixed", None, None),
                                                  ("budget", c["learner_budget"], c["scorer_budget"])):
                n, context, rows = micro_batch_shape(c, tokens, tau, budget, count)
                per_token = sequence_bytes(q, c, tokens, tau) / (c["prompt"] + tokens + tokens / tau * c["block"])
                layers = c["drafter_layers"]
                activations = layers * (student[0] + student[1] * rows + rows * q.student_row_bytes()
                                        + context * q.context_row_bytes())
                learner = (q.drafter_params(layers, c["features"]) * 20 + q.head_bytes() + (context + rows) * per_token
                           + activations + chunk_bytes_per_slot * c["chunk"])
                length = packed_length(c, tokens, tau)
                packed = count * length if scorer_budget is None else min(
                    max(1, scorer_budget // length) * length, max(scorer_budget, c["prompt"] + tokens))
                scorer = q.target_params() * 2 + teacher[0] + packed * (teacher[1] + q.scorer_row_bytes(c["features"]))
                row[f"{layout}_sequences"], row[f"{layout}_learner_gb"] = n, learner / GB
                row[f"{layout}_scorer_gb"] = scorer / GB
            out.append(row)
    return out


def print_budget(rows: list[dict], count: int) -> None:
    header = ["config", "tokens", "τ", f"learner GB, {count} seq/MB", "learner GB, budget (seqs or part)",
              f"scorer GB, {count} seq/MB", "scorer GB, budget"]
    cells = [[r["config"], str(r["tokens"]), f"{r['tau']:g}", f"{r['fixed_learner_gb']:,.1f}",
              f"{r['budget_learner_gb']:,.1f} ({r['budget_sequences']:g})", f"{r['fixed_scorer_gb']:,.1f}",
              f"{r['budget_scorer_gb']:,.1f}"] for r in rows]
    print(f"token budgets: learner {rows[0]['learner_budget']:,}, scorer {rows[0]['scorer_budget']:,} tokens "
          "(the thinking configs)")
    print(markdown(header, cells))


def markdown(header: list[str], cells: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in cells])


def print_projection(projected: list[dict], as_markdown: bool) -> None:
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


def print_tables(result: dict, as_markdown: bool = False) -> None:
    console = Console()
    t = Table(title="measured on this CPU, one sequence per micro-batch (MB)")
    for c in ("hidden", "response", "blocks", "shipped old", "shipped new", "scorer peak old", "scorer peak new",
              "+ diagnostic", "learner peak old", "learner peak new"):
        t.add_column(c, justify="right")
    mb = 1e6
    for h, rows in result["measured"].items():
        for r in rows:
            def cell(key: str) -> str:
                return f"{r[key] / mb:,.0f}" if key in r else "—"
            t.add_row(str(h), str(r["length"]), str(r["blocks"]), cell("shipped_old"), cell("shipped_new"),
                      cell("scorer_peak_old"), cell("scorer_peak_new"), cell("scorer_peak_diagnostic"),
                      cell("learner_peak_old"),
                      cell("learner_peak_new"))
    console.print(t)
    o = result["once"]
    console.print(f"object store, {o['payload_gb']:.2f} GB scored batch to another worker: zero-copy "
                  f"{o['zero_copy_gb_per_s']:.2f} GB/s, torch pickling {o['torch_pickle_gb_per_s']:.2f} GB/s "
                  f"({o['zero_copy_gb_per_s'] / o['torch_pickle_gb_per_s']:.0f}x)")
    console.print(f"weight publish, {o['drafter_gb']:.2f} GB Qwen3-4B drafter: publish {o['publish_old_s']:.2f} s -> "
                  f"{o['publish_new_s']:.2f} s, landing + verify {o['land_old_s']:.2f} s -> {o['land_new_s']:.2f} s")
    print_projection(result["projected"], as_markdown)


# ------------------------------------------------------------------------------------------------ SFT at Qwen3-4B


def old_sft_step(target: Target, drafter: DFlashDrafter, batch: SftBatch, gamma: float) -> None:
    """The replaced SFT step: the target's full forward ([T, V] logits made only to read the features) and the
    drafter's logits at every slot at once, unchunked."""
    features = target(batch.ids, attention_mask=batch.valid.long()).features
    block_ids = torch.full((*batch.anchor_pos.shape, K), drafter.mask_token_id, dtype=torch.long)
    block_ids[..., 0] = batch.ids.gather(1, batch.anchor_pos)
    hidden = drafter.forward_blocks(drafter.project_context(features), batch.valid, block_ids, batch.anchor_pos)
    logits = drafter.logits(hidden[batch.block_valid][:, 1:])
    sft_loss(logits, batch.labels[batch.block_valid], gamma=gamma, position_mask=batch.position_mask).backward()


def sft_point(target: Target, drafter: DFlashDrafter, response: int, anchors: int, args, *, old: bool) -> dict:
    """Peak memory and seconds of one SFT micro-batch (one sequence) with `anchors` random anchors."""
    example = SftExample(list(range(1, args.prompt + 1)), [(7 * i) % (VOCAB - 2) + 1 for i in range(response)])
    (batch,) = sft_micro_batches([example], anchors_per_seq=anchors, max_length=args.prompt + response + 1,
                                 block_size=K, micro_batch_size=1, generator=torch.Generator().manual_seed(0))
    started = time.perf_counter()
    if old:
        peak = peak_cpu_bytes(lambda: old_sft_step(target, drafter, batch, gamma=7.0))
    else:
        peak = peak_cpu_bytes(lambda: sft_batch_loss(target, drafter, batch, gamma=7.0,
                                                     chunk_size=args.sft_chunk).backward())
    drafter.zero_grad(set_to_none=True)
    gc.collect()
    return {"response": response, "anchors": anchors, "peak": peak, "seconds": time.perf_counter() - started}


def measure_sft(args) -> dict:
    """The SFT step at Qwen3-4B's vocabulary and width (one target layer read as 5 features, a one-layer drafter,
    fp32 on this CPU): the new step at the real response length and a few anchor counts, the replaced one at a
    shorter response (its [T, V] logits and all-slot logits cost minutes here), each projected to the shipped
    512 anchors and 2048 tokens by a linear fit in anchors."""
    target, drafter = build(TARGETS["Qwen3-4B"].hidden)
    new = [sft_point(target, drafter, args.sft_length, a, args, old=False) for a in args.sft_anchors]
    old = [sft_point(target, drafter, args.sft_old_length, a, args, old=True) for a in args.sft_anchors]
    del target, drafter
    gc.collect()
    (a_new, b_new), (a_old, b_old) = fit(new, "peak", "anchors"), fit(old, "peak", "anchors")
    full = args.sft_project_anchors
    chunk_growth = (args.projection_chunk - args.sft_chunk) * args.sft_chunk_bytes_per_slot
    target_logits = (args.sft_length - args.sft_old_length) * VOCAB * 4  # the replaced target's [T, V] fp32
    return {"new": new, "old": old, "per_anchor_new": b_new, "per_anchor_old": b_old,
            "projected_new": a_new + b_new * full + chunk_growth, "projected_old": a_old + b_old * full + target_logits}


def print_sft(sft: dict, args) -> None:
    t = Table(title=f"SFT micro-batch (one sequence, {args.prompt}-token prompt) at Qwen3-4B's vocabulary and "
                    f"width, fp32 on this CPU: measured")
    for c in ("step", "response", "anchors", "slots", "peak MB", "seconds"):
        t.add_column(c, justify="right")
    for name in ("old", "new"):
        for r in sft[name]:
            t.add_row(name, str(r["response"]), str(r["anchors"]), str(r["anchors"] * (K - 1)),
                      f"{r['peak'] / 1e6:,.0f}", f"{r['seconds']:.0f}")
    Console().print(t)
    Console().print(f"projected to {args.sft_project_anchors} anchors, {args.sft_length}-token response, loss chunk "
                    f"{args.projection_chunk}: old {sft['projected_old'] / GB:,.1f} GB "
                    f"({sft['per_anchor_old'] / 1e6:,.1f} MB per anchor), new {sft['projected_new'] / GB:,.1f} GB "
                    f"({sft['per_anchor_new'] / 1e6:,.1f} MB per anchor); per sequence, so the old step's default "
                    f"16-sequence batch is 16x that, the new one's micro-batch is one sequence. The student's dense "
                    f"block-mask attention grows faster than linearly in anchors and is outside the fit.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, nargs="+", default=[2560, 4096])
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 256, 512])
    parser.add_argument("--old-max-length", type=int, default=128, help="the replaced path only up to this length")
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--tau", type=float, default=6.0)
    parser.add_argument("--chunk", type=int, default=128, help="loss chunk (slots) measured here")
    parser.add_argument("--transfer-length", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--projection-prompt", type=int, default=512)
    parser.add_argument("--projection-chunk", type=int, default=400, help="optim.loss_chunk_size projected")
    parser.add_argument("--json", default="bench/results/scale.json")
    parser.add_argument("--project-only", action="store_true",
                        help="re-project the measurements in --json (attention from --attention-json if it has none)")
    parser.add_argument("--attention-json", default="bench/results/scale-attention.json")
    parser.add_argument("--markdown", action="store_true", help="print the projection as markdown tables")
    parser.add_argument("--attention-points", nargs="+", default=["2048:6", "2048:1.5", "4096:6", "4096:1.5"],
                        help="attention: response:τ points measured")
    parser.add_argument("--attention-old-max", type=int, default=16_000,
                        help="attention: the dense path only up to this packed length")
    parser.add_argument("--attention-only", action="store_true",
                        help="measure only the attention points; merge them into --json")
    parser.add_argument("--sft-length", type=int, default=2048, help="SFT: the new step's response length")
    parser.add_argument("--sft-old-length", type=int, default=256, help="SFT: the replaced step's response length")
    parser.add_argument("--sft-anchors", type=int, nargs="+", default=[8, 24], help="SFT: anchors measured")
    parser.add_argument("--sft-chunk", type=int, default=64, help="SFT: loss chunk (slots) measured here")
    parser.add_argument("--sft-project-anchors", type=int, default=512, help="SFT: sft.anchors_per_seq projected")
    parser.add_argument("--sft-only", action="store_true",
                        help="measure only the SFT step (the loss chunk's bytes per slot read from --json)")
    parser.add_argument("--sft-json", default="bench/results/scale-sft.json", help="where --sft-only writes")
    parser.add_argument("--data-path-only", action="store_true",
                        help="measure the per-sequence data path and object store only (minutes, not the attention "
                             "and SFT sections' half hour); attention for the projection from --attention-json")
    parser.add_argument("--budget-only", action="store_true",
                        help="project learner and scorer memory at thinking lengths, fixed micro-batches of "
                             "--budget-count sequences against the thinking configs' token budgets (from --json)")
    parser.add_argument("--budget-count", type=int, default=4, help="sequences per fixed micro-batch compared")
    args = parser.parse_args()
    if args.attention_only:
        run_attention_only(args)
        return
    if args.sft_only:
        stored = Path(args.json)
        measured = json.loads(stored.read_text()) if stored.exists() else {}
        args.sft_chunk_bytes_per_slot = measured.get("chunk_bytes_per_slot", 8 * VOCAB * 4)
        torch.set_num_threads(2)
        sft = measure_sft(args)
        print_sft(sft, args)
        Path(args.sft_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.sft_json).write_text(json.dumps({"args": vars(args), **sft}, indent=1, default=str))
        return
    if args.budget_only:
        result = json.loads(Path(args.json).read_text())
        measured = {int(h): rows for h, rows in result["measured"].items()}
        attention = result.get("attention") or json.loads(Path(args.attention_json).read_text())["attention"]
        print_budget(budget_projection(measured, result["chunk_bytes_per_slot"], attention, args.budget_count),
                     args.budget_count)
        return
    if args.project_only:
        result = json.loads(Path(args.json).read_text())
        measured = {int(h): rows for h, rows in result["measured"].items()}
        attention = result.get("attention") or json.loads(Path(args.attention_json).read_text())["attention"]
        result["projected"] = project(measured, result["chunk_bytes_per_slot"], attention)
        print_tables(result, args.markdown)
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
        return
    torch.set_num_threads(2)
    measured: dict[int, list[dict]] = {}
    for i, hidden in enumerate(args.hidden):
        target, drafter = build(hidden)
        lengths = args.lengths if i == 0 else args.lengths[:2]  # two points fit the activations' slope
        measured[hidden] = [measure_length(target, drafter, n, args) for n in lengths]
        Console().print(f"hidden {hidden}: measured {lengths}")
        if i == 0:
            once = object_store_rates(target, args)
        del target, drafter
        gc.collect()
    first = measured[args.hidden[0]]
    # The loss's transient per chunk slot: the new learner's flat part, per slot of the measured chunk.
    base, _ = fit(first, "learner_peak_new", "blocks")
    result = {"args": vars(args), "measured": measured, "once": once, "chunk_bytes_per_slot": base / args.chunk}
    if args.data_path_only:
        result["attention"] = json.loads(Path(args.attention_json).read_text())["attention"]
    else:
        result["attention"] = measure_attention(args)
    result["projected"] = project(measured, result["chunk_bytes_per_slot"], result["attention"])
    print_tables(result, args.markdown)
    if not args.data_path_only:
        args.sft_chunk_bytes_per_slot = result["chunk_bytes_per_slot"]
        result["sft"] = measure_sft(args)
        print_attention(result["attention"])
        print_sft(result["sft"], args)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    Console().print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
