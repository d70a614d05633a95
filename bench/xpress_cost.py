"""What an XPress block costs to draft against a DFlash block of the same backbone, at Qwen3-8B's drafter shape:
XPress's K Jacobi passes of its refiner against DFlash's single pass, FLOPs per block (the counters of
opd/models/flops.py) and wall-clock per block, side by side in one run.

Both drafters are random bf16 at Qwen3-8B's shape (no target, no download), the XPress drafter holding the DFlash
drafter's weights plus speculators' default refiner (rank 256, MLP ratio 2, 6 passes): what differs is only what
XPress adds. Each timed call is the drafting the decoder makes per step (the previous step's committed context
extended, then `draft`), on a cache of random context, the two drafters interleaved repeat by repeat. Few layers
keep it to minutes on a CPU; the FLOP ratio is also given at every depth up to `--ratio-depth`. The drafters are
built outside inference mode: built inside it, this CPU ran XPress's draft hundreds of times slower (not
investigated further).

    python bench/xpress_cost.py [--layers 2] [--passes 6] [--context 256] [--committed 6] [--repeats 3]
                                [--batches 1 4] [--threads 1]

Writes bench/results/xpress_cost_qwen3_8b.json. The passes stop at a fixed point (a pass that gives back the tokens
it was fed), so both modes also count the passes a draft ran: a random refiner says nothing about how soon a trained
one settles, so `--tiny` decodes held-out prompts greedily with the shipped tiny XPress drafter and the DFlash 1
drafter it is level with, interleaved batch by batch, timing the decoder's drafting per step:

    python bench/xpress_cost.py --tiny [--prompts 32] [--max-new-tokens 128] [--batch 8]

Writes bench/results/xpress_cost_tiny.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from dflash2_cost import RESULTS, default_dtype
from torch import nn
from transformers import Qwen3Config

from opd.data.prompts import eval_prompts
from opd.decoding.sampling import Sampling
from opd.decoding.speculative import SpeculativeDecoder
from opd.eval.acceptance import AcceptanceStats
from opd.formats.dflash import DFlashConfig, default_target_layer_ids
from opd.formats.xpress import DEFAULTS, XPressConfig
from opd.models.build import build_models
from opd.models.dflash import DFlashDrafter
from opd.models.drafter_cache import DrafterCache
from opd.models.flops import DrafterParams
from opd.models.xpress import XPressDrafter
from opd.spec import load_spec

# Qwen3-8B (the target of z-lab's Qwen3-8B-DFlash-b16 and of the XPress paper's headline): its config.json's fields
# a drafter copies.
QWEN3_8B = Qwen3Config(vocab_size=151_936, hidden_size=4096, intermediate_size=12_288, num_hidden_layers=36,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
                       max_position_embeddings=40_960, rope_theta=1_000_000, tie_word_embeddings=False)
BLOCK = 16
FEATURES = 5  # the target layers z-lab's Qwen3-8B drafter reads
QWEN3_MASK = 151_669
GOAL = 1.15


def drafters(layers: int, passes: int, seed: int = 0) -> dict[str, DFlashDrafter]:
    """A DFlash drafter at Qwen3-8B's drafter shape (`layers` deep) and an XPress drafter with its weights plus a
    random refiner (its mixer drawn: a fresh one is zero, which costs the same), random bf16, on one random
    embedding and LM head of Qwen3-8B's vocabulary."""
    config = DFlashConfig.for_target(QWEN3_8B, num_layers=layers, block_size=BLOCK, mask_token_id=QWEN3_MASK,
                                     target_layer_ids=default_target_layer_ids(QWEN3_8B.num_hidden_layers, FEATURES))
    with torch.random.fork_rng(devices=[]), default_dtype(torch.bfloat16):
        torch.manual_seed(seed)
        embed = nn.Embedding(config.vocab_size, config.hidden_size)
        head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        nn.init.normal_(embed.weight, std=0.02)
        nn.init.normal_(head.weight, std=0.02)
        dflash = DFlashDrafter(config, embed, head)
        xpress = XPressDrafter(XPressConfig.of(config, DEFAULTS["xpress_rank"], DEFAULTS["xpress_mlp_ratio"], passes),
                               embed, head)
        xpress.load_state_dict(dflash.state_dict(), strict=False)
        nn.init.normal_(xpress.refiner_head.mix_l, std=0.02)
    return {"DFlash": dflash.eval(), "XPress": xpress.eval()}


def filled_cache(drafter: DFlashDrafter, features: torch.Tensor, ids: torch.Tensor) -> DrafterCache:
    """A growing cache holding every row's context `features` [B,C,n*H] (and, for XPress, each position's next
    token from `ids`), every row equally long, so dense, as the decoder marks it."""
    batch, length = features.shape[:2]
    cache = drafter.new_cache(batch)
    drafter.extend_cache(cache, features, torch.arange(length).expand(batch, -1),
                         torch.ones(batch, length, dtype=torch.bool), ids[:, 1 : length + 1])
    cache.dense = True
    return cache


def timed_draft(drafter: DFlashDrafter, cache: DrafterCache, committed: torch.Tensor, ids: torch.Tensor) -> float:
    """Seconds of one decoding step's drafting: the committed features [B,W,n*H] handed over (`defer_context`,
    which XPress extends at once), then `draft`; on a shallow copy of `cache`, so every repeat starts alike."""
    cache = dataclasses.replace(cache, keys=list(cache.keys), values=list(cache.values))
    batch, width = committed.shape[:2]
    start_at = cache.length
    positions = start_at + torch.arange(width).expand(batch, -1)
    valid = torch.ones(batch, width, dtype=torch.bool)
    start = time.perf_counter()
    drafter.defer_context(cache, committed, positions, valid, ids[:, start_at + 1 : start_at + width + 1])
    drafter.draft(cache, ids[:, start_at + width], torch.full((batch,), start_at + width))
    return time.perf_counter() - start


@torch.inference_mode()
def draft_times(models: dict[str, DFlashDrafter], batch: int, args: argparse.Namespace,
                generator: torch.Generator) -> dict[str, dict]:
    """Per drafter, the drafting times at `batch` rows on the same random context, interleaved repeat by repeat
    (the first draft of each, a warm-up, untimed)."""
    width = FEATURES * QWEN3_8B.hidden_size
    context = torch.randn(batch, args.context, width, generator=generator).bfloat16()
    committed = torch.randn(batch, args.committed, width, generator=generator).bfloat16()
    ids = torch.randint(QWEN3_8B.vocab_size, (batch, args.context + args.committed + 1), generator=generator)
    caches = {name: filled_cache(d, context, ids) for name, d in models.items()}
    seconds: dict[str, list[float]] = {name: [] for name in models}
    with counted_passes(models["XPress"]) as passes:
        for repeat in range(args.repeats + 1):
            for name, drafter in models.items():
                spent = timed_draft(drafter, caches[name], committed, ids)
                if repeat:
                    seconds[name].append(spent)
    times = {name: {"best_ms": 1000 * min(t), "median_ms": 1000 * statistics.median(t), "ms": [1000 * x for x in t]}
             for name, t in seconds.items()}
    times["XPress"]["passes_per_draft"] = passes[0] / (args.repeats + 1)
    return times


@contextmanager
def counted_passes(drafter: object) -> Iterator[list[int]]:
    """Counts the refiner passes `drafter` runs while inside (each pass calls the head's `mixed` once)."""
    assert isinstance(drafter, XPressDrafter)
    head, calls = drafter.refiner_head, [0]
    mixed = head.mixed

    def counting(*args: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        return mixed(*args)

    head.mixed = counting  # type: ignore[method-assign,assignment]
    try:
        yield calls
    finally:
        del head.mixed


def block_flops(drafter: DFlashDrafter, committed: int) -> dict[str, int]:
    """A block's FLOPs alone, and with the step's committed context projected."""
    params, k = DrafterParams.of(drafter), drafter.block_size
    return {"block_flops": params.forward(context=0, blocks=1, slots=k - 1),
            "step_flops": params.forward(context=committed, blocks=1, slots=k - 1)}


def depth_ratios(depth: int, passes: int, committed: int) -> dict[int, float]:
    """XPress / DFlash step FLOPs at every depth 1..`depth` (meta tensors: nothing allocated)."""
    out = {}
    for layers in range(1, depth + 1):
        with torch.device("meta"):
            pair = drafters(layers, passes)
        flops = {name: block_flops(d, committed)["step_flops"] for name, d in pair.items()}
        out[layers] = flops["XPress"] / flops["DFlash"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2, help="decoder layers of both drafters")
    parser.add_argument("--passes", type=int, default=DEFAULTS["num_jacobi_passes"], help="XPress's Jacobi passes")
    parser.add_argument("--context", type=int, default=256, help="cached context positions per row")
    parser.add_argument("--committed", type=int, default=6, help="positions the previous step committed")
    parser.add_argument("--repeats", type=int, default=3, help="timed drafts per drafter and batch")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--ratio-depth", type=int, default=5, help="FLOP ratios at depths 1..this")
    parser.add_argument("--tiny", action="store_true",
                        help="the shipped tiny XPress and DFlash 1 drafters decoding held-out prompts instead")
    parser.add_argument("--prompts", type=int, default=32, help="--tiny: held-out prompts decoded")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="--tiny: tokens per response")
    parser.add_argument("--batch", type=int, default=8, help="--tiny: prompts per decoded batch")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.tiny:
        tiny_decoding(args)
        return
    models = drafters(args.layers, args.passes)
    generator = torch.Generator().manual_seed(1)
    times = {batch: draft_times(models, batch, args, generator) for batch in args.batches}
    rows = {name: {"parameters": sum(p.numel() for p in d.parameters()), **block_flops(d, args.committed),
                   **{f"batch {b}": times[b][name] for b in args.batches}} for name, d in models.items()}
    refiner = models["XPress"]
    assert isinstance(refiner, XPressDrafter)
    rows["XPress"]["refiner_parameters"] = sum(p.numel() for p in refiner.refiner_head.parameters())
    one, two = rows["DFlash"], rows["XPress"]
    ratios = {"step_flops": two["step_flops"] / one["step_flops"],
              **{f"batch {b}": two[f"batch {b}"]["median_ms"] / one[f"batch {b}"]["median_ms"] for b in args.batches}}
    by_depth = depth_ratios(args.ratio_depth, args.passes, args.committed)
    print(f"Qwen3-8B drafter shape, {args.layers} layers, block {BLOCK}, bf16, {args.threads} thread(s); XPress rank "
          f"{DEFAULTS['xpress_rank']}, MLP ratio {DEFAULTS['xpress_mlp_ratio']}, {args.passes} passes; "
          f"{args.context} cached positions, {args.committed} committed per step; draft ms per block, median "
          f"(best) of {args.repeats}")
    print(f"{'drafter':<8}{'params':>15}{'step GFLOP':>12}" + "".join(f"{f'batch {b}':>20}" for b in args.batches))
    for name, r in rows.items():
        cells = "".join(f"{r[f'batch {b}']['median_ms']:>11.0f} ({r[f'batch {b}']['best_ms']:>6.0f})"
                        for b in args.batches)
        print(f"{name:<8}{r['parameters']:>15,}{r['step_flops'] / 1e9:>12.2f}{cells}")
    print(f"XPress passes run per draft (of {args.passes}): "
          + ", ".join(f"{two[f'batch {b}']['passes_per_draft']:.2f} at batch {b}" for b in args.batches))
    print(f"XPress / DFlash (goal <= {GOAL}x): step FLOPs {ratios['step_flops']:.3f}x; drafting wall (medians) "
          + ", ".join(f"{ratios[f'batch {b}']:.3f}x at batch {b}" for b in args.batches))
    print("step FLOP ratio by depth: " + ", ".join(f"{n} layers {r:.3f}x" for n, r in by_depth.items()))
    out = RESULTS / "xpress_cost_qwen3_8b.json"
    out.write_text(json.dumps({"drafters": rows, "ratios": ratios, "flop_ratio_by_depth": by_depth,
                               "layers": args.layers, "passes": args.passes, "block_size": BLOCK,
                               "xpress_rank": DEFAULTS["xpress_rank"], "xpress_mlp_ratio": DEFAULTS["xpress_mlp_ratio"],
                               "context": args.context, "committed": args.committed, "repeats": args.repeats,
                               "dtype": "bfloat16", "threads": args.threads, "goal": GOAL}, indent=2) + "\n")


def tiny_decoding(args: argparse.Namespace) -> None:
    """The shipped tiny XPress and DFlash 1 drafters decoding the same held-out prompts greedily on the tiny target,
    interleaved batch by batch: drafting ms per verification step (the decoder's own timer), the passes XPress ran
    per step, and τ."""
    spec = load_spec("configs/tiny-xpress.yaml", ["engine=local"])
    base = build_models(spec)
    prompts = [p.ids for p in eval_prompts(spec.data, base.tokenizer, args.prompts)]
    xpress = base.drafter
    assert isinstance(xpress, XPressDrafter)
    models = {"DFlash 1": build_models(load_spec("configs/tiny.yaml", ["engine=local"])).drafter, "XPress": xpress}
    decoders = {name: SpeculativeDecoder(base.target, d, eos_id=base.eos_id) for name, d in models.items()}
    for decoder in decoders.values():  # the warm-up is not timed
        decoder.generate(prompts[: args.batch], Sampling(), max_new_tokens=args.max_new_tokens)
        decoder.timings.clear()
    records: dict[str, list] = {name: [] for name in models}
    with counted_passes(models["XPress"]) as passes:
        for i in range(0, len(prompts), args.batch):
            for name, decoder in decoders.items():
                records[name] += decoder.generate(prompts[i : i + args.batch], Sampling(),
                                                  max_new_tokens=args.max_new_tokens)
    rows: dict[str, dict[str, float]] = {name: {"draft_ms_per_step": 1000 * decoders[name].timings["draft"] / decoders[name].timings["steps"],
                   "steps": decoders[name].timings["steps"],
                   "tau": AcceptanceStats.from_records(records[name], d.block_size).tau}
            for name, d in models.items()}
    rows["XPress"]["passes_per_step"] = passes[0] / rows["XPress"]["steps"]
    ratio = rows["XPress"]["draft_ms_per_step"] / rows["DFlash 1"]["draft_ms_per_step"]
    print(f"{'drafter':<10}{'draft ms/step':>15}{'steps':>7}{'greedy τ':>10}{'passes/step':>13}")
    for name, r in rows.items():
        print(f"{name:<10}{r['draft_ms_per_step']:>15.2f}{r['steps']:>7.0f}{r['tau']:>10.3f}"
              f"{r.get('passes_per_step', float('nan')):>13.2f}")
    print(f"XPress / DFlash 1 drafting wall per step: {ratio:.2f}x ({len(prompts)} prompts, batch {args.batch}, "
          f"{xpress.passes} passes at most)")
    (RESULTS / "xpress_cost_tiny.json").write_text(json.dumps(
        {"drafters": rows, "draft_wall_ratio": ratio, "prompts": len(prompts), "batch": args.batch,
         "max_new_tokens": args.max_new_tokens, "max_passes": xpress.passes}, indent=2) + "\n")


if __name__ == "__main__":
    main()
