"""The SFT step at Qwen3-4B's vocabulary and width on a CPU: the new step beside the replaced one, projected to
the shipped anchors. bench/scale.py runs it (`--sft-only` runs just this).

One sequence per micro-batch, a one-layer target read as 5 features and a one-layer drafter, fp32: the new step
(decoder features, chunked hidden-state loss) at the real response length and `--sft-anchors` anchors, the
replaced one (full target forward, all slots' logits at once) at `--sft-old-length`, both projected to 512 anchors
at 2048 tokens.
"""

from __future__ import annotations

import argparse
import gc
import time

import torch
from projection import GB, TARGETS, VOCAB, fit  # bench/projection.py, beside this script
from rich.console import Console
from rich.table import Table
from scale_data_path import K, build  # bench/scale_data_path.py, beside this script

from opd.distill.losses import sft_loss
from opd.memory import peak_cpu_bytes
from opd.models.dflash import DFlashDrafter
from opd.models.target import Target
from opd.train.sft import SftBatch, SftExample, sft_batch_loss, sft_micro_batches


def old_sft_step(target: Target, drafter: DFlashDrafter, batch: SftBatch, gamma: float) -> None:
    """The replaced SFT step: the target's full forward ([T, V] logits made only to read the features) and the
    drafter's logits at every slot at once, unchunked."""
    features = target(batch.ids, attention_mask=batch.valid.long()).features
    block_ids = torch.full((*batch.anchor_pos.shape, K), drafter.mask_token_id, dtype=torch.long)
    block_ids[..., 0] = batch.ids.gather(1, batch.anchor_pos)
    hidden = drafter.forward_blocks(drafter.project_context(features), batch.valid, block_ids, batch.anchor_pos)
    logits = drafter.logits(hidden[batch.block_valid][:, 1:])
    sft_loss(logits, batch.labels[batch.block_valid], gamma=gamma, position_mask=batch.position_mask).backward()


def sft_point(target: Target, drafter: DFlashDrafter, response: int, anchors: int, args: argparse.Namespace, *,
              old: bool) -> dict:
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


def measure_sft(args: argparse.Namespace) -> dict:
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


def print_sft(sft: dict, args: argparse.Namespace) -> None:
    """The measured SFT micro-batches, then their projection to the shipped anchors and length."""
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
