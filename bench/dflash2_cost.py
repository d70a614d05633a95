"""What a DFlash 2 block costs to draft against a DFlash 1 block of the same depth and block size, on the shipped tiny
target: FLOPs per block (the counters of opd/models/flops.py) and CPU wall-clock, side by side in one run.

Both drafters decode the same held-out prompts greedily (`SpeculativeDecoder`), interleaved batch by batch, and the
decoder's own timers split each verification step into drafting, verification and bookkeeping; the drafting time
per block is the ratio the issue asks for. Parameter counts come from the drafters themselves. Last, the DFlash 2
drafter decodes the same prompts drafting its logits' argmax instead of its selector's path: what the selector adds.

    python bench/dflash2_cost.py [--prompts 32] [--max-new-tokens 128] [--batch 8] [--rounds 2] [--compiled]

`--compiled` decodes with the compiled static-shape step (`SpeculativeDecoder(compiled=True)`; a warm-up batch
per drafter compiles it first). Writes bench/results/dflash2_cost.json (dflash2_cost_compiled.json).

A tiny drafter hides what a real one costs: its fixed per-operation overhead outweighs its arithmetic. So
`--shapes qwen3-4b` drafts at z-lab's Qwen3-4B drafter shape instead (random bf16 weights, no target, no
download: `real_shapes`), timing the drafting call the decoder makes per step on a cache of random context:

    python bench/dflash2_cost.py --shapes qwen3-4b [--layers 5] [--context 384] [--committed 6] [--repeats 3]

Writes bench/results/dflash2_cost_qwen3_4b.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import Qwen3Config

from opd.data.prompts import eval_prompts
from opd.decoding.sampling import Sampling
from opd.decoding.speculative import SpeculativeDecoder
from opd.eval.acceptance import AcceptanceStats
from opd.formats.dflash import DFlashConfig, default_target_layer_ids
from opd.formats.dflash2 import DFlash2Config
from opd.models.build import build_models
from opd.models.dflash import DFlashDrafter
from opd.models.dflash2 import DFlash2Drafter
from opd.models.drafter_cache import DrafterCache
from opd.models.flops import DrafterParams
from opd.spec import load_spec

RESULTS = Path(__file__).parent / "results"
DRAFTERS = {"DFlash 1": "opd/assets/tiny/drafter", "DFlash 2": "opd/assets/tiny/dflash2"}
# Qwen3-4B (the target z-lab's Qwen3-4B-DFlash-b16 drafts for): its config.json's fields a drafter copies.
QWEN3_4B = Qwen3Config(vocab_size=151_936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
                       max_position_embeddings=40_960, rope_theta=1_000_000, tie_word_embeddings=True)
QWEN3_4B_BLOCK = 16
QWEN3_4B_FEATURES = 5  # the target layers z-lab's Qwen3-4B drafter reads (its 5 layers' default ids)
QWEN3_MASK = 151_669  # z-lab's Qwen3 drafters' mask_token_id (configs/qwen3-4b.yaml)
# z-lab's published DFlash 2 drafters' additions (REFERENCE.md's DFlash 2 bullet).
ZLAB_DFLASH2: dict[str, Any] = {"selector_top_k": 16, "selector_rank": 256, "conv_kernel_size": 2, "conv_group_size": 16}
BATCHES = (1, 8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", choices=["tiny", "qwen3-4b"], default="tiny",
                        help="the shipped tiny drafters decoding (default), or random drafters at Qwen3-4B's shape")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--compiled", action="store_true", help="the compiled static-shape decoding step")
    parser.add_argument("--layers", type=int, default=5, help="qwen3-4b: decoder layers of both drafters")
    parser.add_argument("--context", type=int, default=384, help="qwen3-4b: cached context positions per row")
    parser.add_argument("--committed", type=int, default=6,
                        help="qwen3-4b: positions the previous step committed, projected by the timed draft")
    parser.add_argument("--repeats", type=int, default=3, help="qwen3-4b: timed drafts per drafter and batch")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.shapes == "qwen3-4b":
        real_shapes(args)
        return
    spec = load_spec("configs/tiny.yaml", ["engine=local"])
    base = build_models(spec)
    prompts = [p.ids for p in eval_prompts(spec.data, base.tokenizer, args.prompts)]
    drafters = {name: base.drafter if name == "DFlash 1" else build_models(spec, path).drafter
                for name, path in DRAFTERS.items()}
    decoders = {name: SpeculativeDecoder(base.target, d, eos_id=base.eos_id, static_cache=args.compiled,
                                         compiled=args.compiled) for name, d in drafters.items()}
    for decoder in decoders.values():  # the warm-up (and the compilation) is not timed
        decoder.generate(prompts[: args.batch], Sampling(), max_new_tokens=args.max_new_tokens)
        decoder.timings.clear()
    records: dict[str, list] = {name: [] for name in drafters}
    for _ in range(args.rounds):
        for i in range(0, len(prompts), args.batch):
            for name, decoder in decoders.items():  # interleaved: the machine's drift hits both alike
                records[name] += decoder.generate(prompts[i : i + args.batch], Sampling(),
                                                  max_new_tokens=args.max_new_tokens)
    rows = {}
    for name, drafter in drafters.items():
        params, timings, k = DrafterParams.of(drafter), decoders[name].timings, drafter.block_size
        steps = timings["steps"]
        rows[name] = {"parameters": sum(p.numel() for p in drafter.parameters()),
                      "block_flops": params.forward(context=0, blocks=1, slots=k - 1),
                      "context_flops_per_token": params.forward(context=1, blocks=0, slots=0),
                      "draft_ms_per_step": 1000 * timings["draft"] / steps,
                      "step_ms": 1000 * (timings["draft"] + timings["verify"] + timings["bookkeeping"]) / steps,
                      "tau": AcceptanceStats.from_records(records[name], k).tau}
    two_drafter = drafters["DFlash 2"]
    two_drafter.choose = lambda hidden, logits, anchor_ids: logits.argmax(-1)  # the selector bypassed
    plain = [r for i in range(0, len(prompts), args.batch) for r in SpeculativeDecoder(
        base.target, two_drafter, eos_id=base.eos_id).generate(prompts[i : i + args.batch], Sampling(),
                                                                max_new_tokens=args.max_new_tokens)]
    rows["DFlash 2"]["tau_logits_argmax"] = AcceptanceStats.from_records(plain, two_drafter.block_size).tau
    one, two = rows["DFlash 1"], rows["DFlash 2"]
    ratios = {"block_flops": two["block_flops"] / one["block_flops"],
              "draft_wall": two["draft_ms_per_step"] / one["draft_ms_per_step"],
              "step_wall": two["step_ms"] / one["step_ms"]}
    print(f"{'drafter':<10}{'params':>11}{'block GFLOP':>13}{'draft ms/step':>15}{'step ms':>9}{'greedy τ':>10}")
    for name, r in rows.items():
        print(f"{name:<10}{r['parameters']:>11,}{r['block_flops'] / 1e9:>13.4f}{r['draft_ms_per_step']:>15.2f}"
              f"{r['step_ms']:>9.2f}{r['tau']:>10.3f}")
    print(f"DFlash 2 drafting its logits' argmax, not the selector's path: greedy τ {two['tau_logits_argmax']:.3f}")
    print(f"DFlash 2 / DFlash 1: block FLOPs {ratios['block_flops']:.3f}x, drafting wall {ratios['draft_wall']:.2f}x, "
          f"whole step {ratios['step_wall']:.2f}x ({len(prompts)} prompts x {args.rounds} rounds, batch {args.batch})")
    out = RESULTS / ("dflash2_cost_compiled.json" if args.compiled else "dflash2_cost.json")
    out.write_text(json.dumps({"drafters": rows, "ratios": ratios, "prompts": len(prompts), "rounds": args.rounds,
                               "batch": args.batch, "compiled": args.compiled}, indent=2) + "\n")


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Modules built inside start in `dtype`: a Qwen3-4B drafter built in float32 first would take twice the
    memory and the time to initialise."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def qwen3_4b_drafters(layers: int, seed: int = 0) -> dict[str, DFlashDrafter]:
    """A DFlash 1 drafter at z-lab's Qwen3-4B drafter shape (`layers` deep) and a DFlash 2 drafter with the same
    weights plus z-lab's DFlash 2 additions, random bf16, on one tied random embedding / LM head of Qwen3-4B's
    vocabulary: what differs between them is only what DFlash 2 adds."""
    config = DFlashConfig.for_target(QWEN3_4B, num_layers=layers, block_size=QWEN3_4B_BLOCK, mask_token_id=QWEN3_MASK,
                                     target_layer_ids=default_target_layer_ids(QWEN3_4B.num_hidden_layers,
                                                                                QWEN3_4B_FEATURES))
    with torch.random.fork_rng(devices=[]), default_dtype(torch.bfloat16):
        torch.manual_seed(seed)
        embed = nn.Embedding(config.vocab_size, config.hidden_size)
        nn.init.normal_(embed.weight, std=0.02)
        head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        head.weight = embed.weight  # tied, as Qwen3-4B's
        one = DFlashDrafter(config, embed, head)
        two = DFlash2Drafter(DFlash2Config.of(config, ZLAB_DFLASH2), embed, head)
        two.load_state_dict(one.state_dict(), strict=False)  # the convolutions and the selector stay random
    return {"DFlash 1": one.eval(), "DFlash 2": two.eval()}


def filled_cache(drafter: DFlashDrafter, features: torch.Tensor) -> DrafterCache:
    """A growing cache (the eager decoder's) holding every row's context `features` [B,C,n*H] at positions 0..C-1,
    through the call the decoder's prefill makes; every row equally long, so dense, as the decoder marks it."""
    batch, length = features.shape[:2]
    cache = drafter.new_cache(batch)
    positions = torch.arange(length).expand(batch, -1)
    drafter.extend_cache(cache, features, positions, torch.ones(batch, length, dtype=torch.bool))
    cache.dense = True
    return cache


def timed_draft(drafter: DFlashDrafter, cache: DrafterCache, committed: torch.Tensor, anchor: torch.Tensor
                ) -> tuple[float, torch.Tensor]:
    """(seconds, drafts [B,K-1]) of one decoding step's drafting, as `SpeculativeDecoder` times it: the previous
    step's committed features [B,W,n*H] deferred (`defer_context`), then `draft`, which projects them with the
    block. It runs on a shallow copy of `cache`: the fold replaces the copy's tensors, so every repeat starts from
    the same cache."""
    cache = dataclasses.replace(cache, keys=list(cache.keys), values=list(cache.values))
    batch, width = committed.shape[:2]
    positions = cache.length + torch.arange(width).expand(batch, -1)
    valid = torch.ones(batch, width, dtype=torch.bool)
    start = time.perf_counter()
    drafter.defer_context(cache, committed, positions, valid)
    drafts, _ = drafter.draft(cache, anchor, torch.full((batch,), cache.length + width))
    return time.perf_counter() - start, drafts


def draft_times(drafters: dict[str, DFlashDrafter], batch: int, args: argparse.Namespace,
                generator: torch.Generator) -> dict[str, dict]:
    """Per drafter, the drafting times at `batch` rows, both drafters on the same random context and interleaved
    repeat by repeat (the first draft of each, a warm-up, untimed). The committed features are the first W of
    the verified block's [B,K,n*H], a slice, as the decoder hands them over (`features[:, :width]`)."""
    width = QWEN3_4B_FEATURES * QWEN3_4B.hidden_size
    context = torch.randn(batch, args.context, width, generator=generator).bfloat16()
    block = torch.randn(batch, QWEN3_4B_BLOCK, width, generator=generator).bfloat16()
    anchor = torch.randint(QWEN3_4B.vocab_size, (batch,), generator=generator)
    caches = {name: filled_cache(d, context) for name, d in drafters.items()}
    committed = block[:, : args.committed]
    seconds: dict[str, list[float]] = {name: [] for name in drafters}
    for repeat in range(args.repeats + 1):
        for name, drafter in drafters.items():
            spent, _ = timed_draft(drafter, caches[name], committed, anchor)
            if repeat:
                seconds[name].append(spent)
    return {name: {"best_ms": 1000 * min(times), "median_ms": 1000 * statistics.median(times),
                   "ms": [1000 * t for t in times]} for name, times in seconds.items()}


@torch.inference_mode()
def real_shapes(args: argparse.Namespace) -> None:
    """DFlash 2 against DFlash 1 at Qwen3-4B's drafter shape: block FLOPs and drafting wall per block, at batch 1
    and 8."""
    drafters = qwen3_4b_drafters(args.layers)
    generator = torch.Generator().manual_seed(1)
    times = {batch: draft_times(drafters, batch, args, generator) for batch in BATCHES}
    rows: dict[str, dict] = {}
    for name, drafter in drafters.items():
        params, k = DrafterParams.of(drafter), drafter.block_size
        rows[name] = {"parameters": sum(p.numel() for p in drafter.parameters()),
                      "block_flops": params.forward(context=0, blocks=1, slots=k - 1),
                      "step_flops": params.forward(context=args.committed, blocks=1, slots=k - 1),
                      **{f"batch {b}": times[b][name] for b in BATCHES}}
    one, two = rows["DFlash 1"], rows["DFlash 2"]
    ratios = {"block_flops": two["block_flops"] / one["block_flops"],
              **{f"batch {b}": two[f"batch {b}"]["median_ms"] / one[f"batch {b}"]["median_ms"] for b in BATCHES}}
    print(f"Qwen3-4B drafter shape, {args.layers} layers, block {QWEN3_4B_BLOCK}, bf16, 1 thread; {args.context} "
          f"cached positions, {args.committed} committed per step; draft ms per block, median (best) of "
          f"{args.repeats}")
    print(f"{'drafter':<10}{'params':>13}{'block GFLOP':>13}" + "".join(f"{f'batch {b}':>21}" for b in BATCHES))
    for name, r in rows.items():
        cells = "".join(f"{r[f'batch {b}']['median_ms']:>12.0f} ({r[f'batch {b}']['best_ms']:>6.0f})"
                        for b in BATCHES)
        print(f"{name:<10}{r['parameters']:>13,}{r['block_flops'] / 1e9:>13.2f}{cells}")
    print(f"DFlash 2 / DFlash 1: block FLOPs {ratios['block_flops']:.3f}x; drafting wall (medians) "
          + ", ".join(f"{ratios[f'batch {b}']:.3f}x at batch {b}" for b in BATCHES))
    out = RESULTS / "dflash2_cost_qwen3_4b.json"
    out.write_text(json.dumps({"drafters": rows, "ratios": ratios, "layers": args.layers,
                               "block_size": QWEN3_4B_BLOCK, "context": args.context, "committed": args.committed,
                               "repeats": args.repeats, "dtype": "bfloat16", "threads": 1,
                               "dflash2": ZLAB_DFLASH2}, indent=2) + "\n")


if __name__ == "__main__":
    main()
