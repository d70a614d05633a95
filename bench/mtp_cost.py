"""What an MTP head's chain costs to draft against EAGLE-3's chain at the same target shape (Qwen3-8B: hidden 4096,
vocabulary 151,936), random bf16 weights, no target, no download: FLOPs per block and wall-clock of the drafting
call the decoder makes per step, side by side in one run, at batch 1 and 8.

Both drafters chain one layer K-1 times from the cached output of the column before the anchor (opd/models/mtp.py,
opd/models/eagle3.py), on a cache filled with the same random context. What differs is what each step runs: the
MTP head is one of the target's own decoder layers (H wide, the target's MLP) behind its input projection, and
reads the target's full LM head; EAGLE-3's layer reads a 2H input and its own 32,000-row draft-vocabulary head.

    python bench/mtp_cost.py [--block-size 8] [--context 128] [--repeats 3] [--threads 1]

Writes bench/results/mtp_cost.json (mtp_cost_<device>.json off the CPU).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch import nn
from transformers import Qwen3Config

from opd.formats.eagle3 import Eagle3Config
from opd.formats.mtp import MTPConfig
from opd.models.drafter_cache import DrafterCache
from opd.models.eagle3 import Eagle3Drafter
from opd.models.flops import DrafterParams
from opd.models.mtp import MTPDrafter, json_config

RESULTS = Path(__file__).parent / "results"
# Qwen3-8B's config.json fields (the paper's target): what a drafter at its shape copies.
QWEN3_8B = Qwen3Config(vocab_size=151_936, hidden_size=4096, intermediate_size=12_288, num_hidden_layers=36,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
                       max_position_embeddings=40_960, rope_theta=1_000_000, tie_word_embeddings=False)
EAGLE3_DRAFT_VOCAB = 32_000  # the public Qwen3 EAGLE-3 drafters' (SpecForge's default)
BATCHES = (1, 8)


def drafters(block_size: int, device: str, seed: int = 0) -> dict[str, nn.Module]:
    """An MTP head (a Qwen3 decoder layer: speculators' `qwen3` MTP layout) and an EAGLE-3 drafter at Qwen3-8B's
    shape, random bf16, on one random embedding and LM head of Qwen3-8B's vocabulary."""
    hf = QWEN3_8B.__class__(**QWEN3_8B.to_dict())
    hf._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        embed = nn.Embedding(hf.vocab_size, hf.hidden_size, dtype=torch.bfloat16)
        head = nn.Linear(hf.hidden_size, hf.vocab_size, bias=False, dtype=torch.bfloat16)
        for weight in (embed.weight, head.weight):
            nn.init.normal_(weight, std=0.02)
        mtp = MTPDrafter(MTPConfig(block_size, "speculators", json_config(hf)), embed, head, hf)
        eagle = Eagle3Drafter(Eagle3Config.for_target(hf, draft_vocab_size=EAGLE3_DRAFT_VOCAB, block_size=block_size),
                              embed, head)
    return {"MTP": mtp.eval(), "EAGLE-3": eagle.eval()}


def filled_cache(drafter: nn.Module, features: torch.Tensor, next_ids: torch.Tensor) -> DrafterCache:
    """A growing cache holding every row's context columns at positions 0..C-1 (the decoder's prefill call)."""
    batch, length = next_ids.shape
    cache = drafter.new_cache(batch)
    drafter.extend_cache(cache, features, torch.arange(length, device=features.device).expand(batch, -1),
                         torch.ones(batch, length, dtype=torch.bool, device=features.device), next_ids)
    return cache


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def draft_times(models: dict[str, nn.Module], batch: int, args: argparse.Namespace) -> dict[str, dict]:
    """Per drafter, the seconds of `draft` at `batch` rows on the same random context, interleaved repeat by
    repeat (the first draft of each untimed)."""
    generator = torch.Generator(device=args.device).manual_seed(batch)
    width = QWEN3_8B.hidden_size
    context = torch.randn(batch, args.context, 3 * width, generator=generator, device=args.device).bfloat16()
    next_ids = torch.randint(QWEN3_8B.vocab_size, (batch, args.context), generator=generator, device=args.device)
    anchor = next_ids[:, -1]
    positions = torch.full((batch,), args.context, device=args.device)
    features = {"MTP": context[..., -width:], "EAGLE-3": context}  # the last target state; three fused states
    caches = {name: filled_cache(d, features[name], next_ids) for name, d in models.items()}
    seconds: dict[str, list[float]] = {name: [] for name in models}
    for repeat in range(args.repeats + 1):
        for name, drafter in models.items():
            synchronize(args.device)
            start = time.perf_counter()
            drafter.draft(caches[name], anchor, positions)
            synchronize(args.device)
            if repeat:
                seconds[name].append(time.perf_counter() - start)
    return {name: {"median_ms": 1000 * statistics.median(t), "best_ms": 1000 * min(t), "ms": [1000 * s for s in t]}
            for name, t in seconds.items()}


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-size", type=int, default=8, help="K: the chain drafts K-1 tokens")
    parser.add_argument("--context", type=int, default=128, help="cached context positions per row")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    models = drafters(args.block_size, args.device)
    times = {batch: draft_times(models, batch, args) for batch in BATCHES}
    rows: dict[str, dict] = {}
    for name, drafter in models.items():
        params, k = DrafterParams.of(drafter), drafter.block_size
        rows[name] = {"trainable_parameters": sum(p.numel() for p in drafter.parameters()),
                      "head_rows": params.head // QWEN3_8B.hidden_size,
                      "chain_flops": params.forward(context=0, blocks=1, slots=k - 1),
                      **{f"batch {b}": times[b][name] for b in BATCHES}}
    mtp, eagle = rows["MTP"], rows["EAGLE-3"]
    ratios = {"chain_flops": mtp["chain_flops"] / eagle["chain_flops"],
              **{f"batch {b}": mtp[f"batch {b}"]["median_ms"] / eagle[f"batch {b}"]["median_ms"] for b in BATCHES}}
    device = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU, {args.threads} thread(s)"
    print(f"Qwen3-8B target shape, K={args.block_size} ({args.block_size - 1} drafts: {args.block_size - 2} chained "
          f"layer steps, {args.block_size - 1} head rows), bf16, {device}; {args.context} cached positions; draft "
          f"ms per block, median (best) of {args.repeats}")
    print(f"{'drafter':<9}{'params':>13}{'head rows':>11}{'chain GFLOP':>13}" + "".join(f"{f'batch {b}':>21}"
                                                                                          for b in BATCHES))
    for name, r in rows.items():
        cells = "".join(f"{r[f'batch {b}']['median_ms']:>12.1f} ({r[f'batch {b}']['best_ms']:>6.1f})" for b in BATCHES)
        print(f"{name:<9}{r['trainable_parameters']:>13,}{r['head_rows']:>11,}{r['chain_flops'] / 1e9:>13.2f}{cells}")
    print(f"MTP / EAGLE-3: chain FLOPs {ratios['chain_flops']:.2f}x; drafting wall (medians) "
          + ", ".join(f"{ratios[f'batch {b}']:.2f}x at batch {b}" for b in BATCHES))
    name = "mtp_cost.json" if args.device == "cpu" else f"mtp_cost_{args.device}.json"
    (RESULTS / name).write_text(json.dumps({"drafters": rows, "ratios": ratios, "device": device,
                                            "block_size": args.block_size, "context": args.context,
                                            "repeats": args.repeats, "dtype": "bfloat16",
                                            "target_shape": "Qwen3-8B"}, indent=2) + "\n")


if __name__ == "__main__":
    main()
