"""Drawing target samples for a shared file: one sampler call of 64 prompts against 8 calls of 8, side by side.

`RolloutWorker` draws a batch that a shared sample file lacks together with the batches after it (`GEN_CHUNK`
samples in one call), on the premise that a bigger batched call costs less per sample. This measures that
premise on the speculative sampler (the frozen warm drafter; `rollout.sampler: speculative`, the CPU default)
at greedy and Qwen3's T=0.6 serving setting, and checks that the samples are the same either way (they are
keyed by prompt, so the batch they are drawn in must not matter). Prints a table, writes JSON:

    python bench/sample_batching.py               # 64 training prompts, 128 tokens (configs/tiny-paper.yaml)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from opd.data.prompts import prompt_key, train_prompts
from opd.decoding.sampling import Sampling
from opd.models.build import build_models
from opd.sources.samplers import build_sampler
from opd.spec import load_spec

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {"greedy": Sampling(), "T=0.6 top-k 20 top-p 0.95": Sampling(0.6, top_k=20, top_p=0.95)}


def draw(sampler, prompts, sampling: Sampling, size: int, max_new_tokens: int) -> tuple[float, list[list[int]]]:
    """Seconds to draw every prompt's sample in calls of `size` prompts, and the samples."""
    started, out = time.perf_counter(), []
    for i in range(0, len(prompts), size):
        part = prompts[i : i + size]
        keys = [prompt_key(p.id, 0) for p in part]
        out += sampler([p.ids for p in part], sampling, max_new_tokens, 0, keys).responses
    return time.perf_counter() - started, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/tiny-paper.yaml")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--small", type=int, default=8, help="prompts per call in the small-batch arm")
    args = parser.parse_args()
    torch.set_num_threads(1)
    spec = load_spec(args.config, [])
    models = build_models(spec)
    prompts = train_prompts(spec.data, models.tokenizer)[: args.prompts]
    sampler = build_sampler(spec, "speculative", models.target, models.drafter, models.eos_id)
    rows = []
    for name, sampling in SETTINGS.items():
        small_s, small = draw(sampler, prompts, sampling, args.small, spec.rollout.max_new_tokens)
        big_s, big = draw(sampler, prompts, sampling, len(prompts), spec.rollout.max_new_tokens)
        rows.append({"setting": name, "prompts": len(prompts), "small_calls_s": small_s, "one_call_s": big_s,
                     "ratio": big_s / small_s, "same_samples": small == big})
    table = Table(title=f"Speculative sampler, {len(prompts)} prompts: {args.small}-prompt calls vs one call")
    for column in ("setting", f"{args.small} per call (s)", "one call (s)", "ratio", "same samples"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(r["setting"], f"{r['small_calls_s']:.2f}", f"{r['one_call_s']:.2f}", f"{r['ratio']:.2f}",
                      str(r["same_samples"]))
    Console(width=140).print(table)
    out = ROOT / "bench" / "results" / "sample_batching.json"
    out.write_text(json.dumps({"config": args.config, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
