"""Attention at real lengths on a CPU: one sequence's attention in one Qwen3-4B layer, block-sparse beside the
replaced dense masks. bench/scale.py runs it (`--attention-only` runs just this); the projection reads the
teacher's bytes per packed row and the student's per block row from it.

32 query / 8 key-value heads of 128, fp32: the teacher's packed replay (no grad) and the student's blocks (with
grad), block-sparse against the replaced dense masks where the packed length is at most `--attention-old-max`, at
2048 and 4096-token responses and τ 1.5 and 6 (`--attention-points`), measured.
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from projection import VOCAB  # bench/projection.py, beside this script
from replay import synthetic_record  # bench/replay.py, beside this script
from rich.console import Console
from rich.table import Table
from scale_data_path import K  # bench/scale_data_path.py, beside this script
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from opd.distill.dense_reference import dense_block_mask, dense_teacher_masks
from opd.distill.replay import packed_inputs
from opd.memory import peak_cpu_bytes
from opd.models.packed_attention import BlockChunks

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


def timed_peak(fn: Callable[[], object]) -> tuple[int, float]:
    """(peak bytes above the start, seconds) of one call."""
    seconds = []

    def run() -> None:
        started = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - started)

    return peak_cpu_bytes(run), seconds[0]


def attention_point(response: int, tau: float, args: argparse.Namespace) -> dict:
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


def measure_attention(args: argparse.Namespace) -> list[dict]:
    """Every `--attention-points` response:τ point, in the order given."""
    points = [tuple(float(x) for x in point.split(":")) for point in args.attention_points]
    return [attention_point(int(response), tau, args) for response, tau in points]


def print_attention(rows: list[dict]) -> None:
    """The attention table, by response length and then τ from the largest."""
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
