"""The replay data path at Qwen3's real vocabulary and hidden sizes, on a CPU: the replaced path beside the new one.

    python bench/scale.py [--hidden 2560 4096] [--lengths 128 256 512] [--old-max-length 128]
                          [--json bench/results/scale.json] [--sft-only]

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
measured, as on the GPU. Then every figure is projected to the shipped configs (4B and 8B, 2048 and 4096
tokens, τ 3 and 6, 512-token prompts, 24 sequences per step) from the formulas printed beside the measurements.
Writes bench/results/scale.json. No assertions: numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import pickle
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from replay import synthetic_record  # bench/replay.py, beside this script
from rich.console import Console
from rich.table import Table
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from opd.expected_acceptance import point_mass_settings, record_drafts, teacher_acceptance
from opd.losses import acceptance_aware_loss, sft_loss, teacher_distribution
from opd.memory import peak_cpu_bytes
from opd.models.drafter import DFlashConfig, DFlashDrafter
from opd.models.packed_attention import BlockChunks
from opd.models.target import Target
from opd.replay import pack, packed_inputs, score, student_hidden
from opd.spec import EvalSpec, LossSpec
from opd.train.messages import WeightSnapshot
from opd.train.sft import SftBatch, SftExample, sft_batch_loss, sft_micro_batches

VOCAB, K, N_FEATURES, STEP_SEQUENCES, GPU_BYTES = 151_936, 16, 5, 24, 141e9
# The shipped configs' drafters: width and MLP of the target, 5 layers (8 for the MoE target, whose dense
# intermediate size the drafter takes), one target feature per drafter layer.
QWEN3 = {"4B": {"hidden": 2560, "intermediate": 9728, "drafter_layers": 5},
         "8B": {"hidden": 4096, "intermediate": 12288, "drafter_layers": 5},
         "30B-A3B": {"hidden": 2048, "intermediate": 6144, "drafter_layers": 8}}
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


def dense_references() -> tuple:
    """The replaced dense masks, kept as tests/test_packed_attention.py's naive reference."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.test_packed_attention import dense_block_mask, dense_teacher_masks

    return dense_teacher_masks, dense_block_mask


def heads(rows: int, count: int, g: torch.Generator, grad: bool = False) -> torch.Tensor:
    """Random [1, count, rows, 128] fp32 queries, keys or values, as a layer's projections make them."""
    return torch.randn(1, count, rows, HEAD_DIM, generator=g).requires_grad_(grad)


def old_teacher_attention(packed: list, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The replaced teacher attention: the [1, 1, L, L] bool mask from its Python loop over blocks, then HF's sdpa
    with it (which repeats K/V per query head when a mask is given)."""
    mask = dense_references()[0](packed, K, q.shape[2])
    stub = SimpleNamespace(num_key_value_groups=HEADS // KV_HEADS, is_causal=True, training=False)
    return sdpa_attention_forward(stub, q, k, v, mask, scaling=HEAD_DIM**-0.5)[0]


def old_student_attention(valid: torch.Tensor, anchors: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                          v: torch.Tensor, context: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The replaced DFlashAttention: the dense [1, 1, M*K, C+M*K] block mask, K/V repeated per query head."""
    mask = dense_references()[1](valid, anchors, K)
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


def fit(rows: list[dict], key: str, per: str) -> tuple[float, float]:
    """Least-squares (intercept, slope) of rows[key] against rows[per] (two or more measured lengths)."""
    pts = [(r[per], r[key]) for r in rows if key in r]
    n = len(pts)
    mx, my = sum(x for x, _ in pts) / n, sum(y for _, y in pts) / n
    slope = sum((x - mx) * (y - my) for x, y in pts) / max(1e-12, sum((x - mx) ** 2 for x, _ in pts))
    return my - slope * mx, slope


def project(measured: dict[int, list[dict]], chunk_bytes_per_slot: float, args) -> list[dict]:
    """Per shipped config: bytes per step scorer -> learner, and the learner's GPU memory, old and new."""
    out = []
    for name, shape in QWEN3.items():
        h, first = shape["hidden"], next(iter(measured))
        rows, scale = (measured[h], 1.0) if h in measured else (measured[first], h / first)
        _, block_bytes = fit(rows, "learner_peak_new", "blocks")  # student activations per block, 1 layer
        layers = features = shape["drafter_layers"]
        drafter_params = layers * (4096 * h * 2 + 1024 * h * 2 + 3 * shape["intermediate"] * h) + features * h * h
        static = drafter_params * (2 + 2 + 8) + 2 * VOCAB * h * 2  # bf16 weights + grads, fp32 AdamW, embed + head
        for length in (2048, 4096):
            for tau in (3, 6):
                blocks = length / tau
                slots = blocks * (K - 1)
                prefix = args.projection_prompt + length
                new_seq = slots * h * 2 + prefix * features * h * 2 + slots * DIAGNOSTIC_BYTES_PER_SLOT
                old_seq = slots * VOCAB * 4 + (prefix + blocks * (K - 2)) * features * h * 2
                activations = block_bytes * scale * blocks * layers
                new_gpu = static + new_seq + activations + chunk_bytes_per_slot * args.projection_chunk
                old_gpu = static + STEP_SEQUENCES * old_seq + activations + args.old_loss_factor * slots * VOCAB * 4
                out.append({"config": f"Qwen3-{name}", "tokens": length, "tau": tau,
                            "step_gb_old": STEP_SEQUENCES * old_seq / GB, "step_gb_new": STEP_SEQUENCES * new_seq / GB,
                            "learner_gb_old": old_gpu / GB, "learner_gb_new": new_gpu / GB,
                            "fits_old": old_gpu < GPU_BYTES, "fits_new": new_gpu < GPU_BYTES})
    return out


def print_tables(result: dict) -> None:
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
    p = Table(title=f"projected: {STEP_SEQUENCES} sequences per step, {result['args']['projection_prompt']}-token "
                    f"prompts, loss chunk {result['args']['projection_chunk']} slots, H200 141 GB")
    for c in ("config", "tokens", "τ", "scorer→learner GB/step old", "new", "learner GPU GB old", "new"):
        p.add_column(c, justify="right")
    for r in result["projected"]:
        p.add_row(r["config"], str(r["tokens"]), str(r["tau"]), f"{r['step_gb_old']:,.1f}", f"{r['step_gb_new']:,.2f}",
                  f"{r['learner_gb_old']:,.0f}" + ("" if r["fits_old"] else " OOM"), f"{r['learner_gb_new']:,.1f}")
    console.print(p)


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
    target, drafter = build(QWEN3["4B"]["hidden"])
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
    parser.add_argument("--project-only", action="store_true", help="re-project the measurements in --json")
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
    if args.project_only:
        result = json.loads(Path(args.json).read_text())
        args.old_loss_factor = result["old_loss_bytes_per_teacher_byte"]
        measured = {int(h): rows for h, rows in result["measured"].items()}
        result["projected"] = project(measured, result["chunk_bytes_per_slot"], args)
        print_tables(result)
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
    old_rows = [r for r in first if "learner_peak_old" in r]
    args.old_loss_factor = (sum((r["learner_peak_old"] - r["learner_peak_new"]) / (r["blocks"] * (K - 1) * VOCAB * 4)
                                for r in old_rows) / len(old_rows))
    result = {"args": vars(args), "measured": measured, "once": once,
              "chunk_bytes_per_slot": base / args.chunk, "old_loss_bytes_per_teacher_byte": args.old_loss_factor}
    result["projected"] = project(measured, result["chunk_bytes_per_slot"], args)
    result["attention"] = measure_attention(args)
    args.sft_chunk_bytes_per_slot = result["chunk_bytes_per_slot"]
    result["sft"] = measure_sft(args)
    print_tables(result)
    print_attention(result["attention"])
    print_sft(result["sft"], args)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    Console().print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
