"""Offline against decoded held-out evaluation, side by side in one process.

For each drafter (the shipped warm one and a random one), the held-out prompts are evaluated at greedy and
Qwen3's T=0.6 serving setting: by speculative decoding alone (`opd.eval.online.evaluate`, what periodic evals and `opd
reproduce` run), by speculative decoding with the autoregressive baseline (what `opd eval` and `opd run`'s
before/after table run, for the speedup), and offline (`opd.eval.offline.OfflineEval`) on target samples drawn
once by the warm drafter's decodes, with the target's view cached. Prints τ ± 95% interval both ways and the
seconds, writes JSON:

    python bench/offline_eval.py                  # 200 prompts x 2 settings, 128 tokens (configs/tiny-paper.yaml)
    python bench/offline_eval.py --prompts 64
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from opd.data.prompts import eval_prompts
from opd.eval.offline import OfflineEval
from opd.eval.online import evaluate
from opd.models.build import Models, build_drafter, build_models
from opd.sources.provenance import Provenance
from opd.sources.samplers import build_sampler
from opd.sources.store import SampleStore, Wanted, sampler_draw
from opd.spec import SamplingSpec, load_spec

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = [SamplingSpec(name="greedy"), SamplingSpec(name="sampled", temperature=0.6, top_p=0.95, top_k=20)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/tiny-paper.yaml")
    parser.add_argument("--prompts", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=8, help="decoding batch (eval.batch_size)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "offline_eval.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    spec = load_spec(args.config, [f"eval.num_prompts={args.prompts}"])
    models = build_models(spec)
    prompts = eval_prompts(spec.data, models.tokenizer, args.prompts)
    e, path = spec.eval, Path("/tmp/opd-bench-offline/eval_samples.jsonl")
    path.unlink(missing_ok=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    sampler = build_sampler(spec, "speculative", models.target, models.drafter, models.eos_id)
    SampleStore.of(spec, path, SETTINGS, prompts, e.max_new_tokens).fetch([Wanted(p, i, 0) for i in range(len(SETTINGS)) for p in prompts],
                                               sampler_draw(sampler, SETTINGS, e.max_new_tokens, spec.seed))
    drawing = time.perf_counter() - t0
    t0 = time.perf_counter()
    offline = OfflineEval(models, path, prompts, SETTINGS, Provenance.of(spec, e.max_new_tokens))
    view = time.perf_counter() - t0
    drafters = {"warm": models.drafter, "random": build_drafter(spec, models.target, models.tokenizer, "random")}
    rows = []
    for name, drafter in drafters.items():
        drafter.eval()
        t0 = time.perf_counter()
        decoded = evaluate(Models(models.target, drafter, models.tokenizer), prompts, SETTINGS,
                           max_new_tokens=e.max_new_tokens, batch_size=args.batch_size, seed=spec.seed,
                           baseline=False)
        decode_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        evaluate(Models(models.target, drafter, models.tokenizer), prompts, SETTINGS, max_new_tokens=e.max_new_tokens,
                 batch_size=args.batch_size, seed=spec.seed, baseline=True)
        baseline_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        rebuilt = offline.evaluate(drafter)
        offline_s = time.perf_counter() - t0
        rows.append({"drafter": name, "decode_s": decode_s, "decode_with_baseline_s": baseline_s,
                     "offline_s": offline_s, "ratio": decode_s / offline_s, "ratio_with_baseline": baseline_s / offline_s,
                     "tau": {r.sampling: {"decoded": r.tau, "decoded_ci": r.tau_ci} for r in decoded}})
        for r in rebuilt:
            rows[-1]["tau"][r.sampling].update(offline=r.tau, offline_ci=r.tau_ci)
    out = {"prompts": len(prompts), "settings": [s.name for s in SETTINGS], "max_new_tokens": e.max_new_tokens,
           "batch_size": args.batch_size, "drawing_s": drawing, "target_view_s": view, "rows": rows}
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    table = Table(title=f"{len(prompts)} held-out prompts x {len(SETTINGS)} settings, {e.max_new_tokens} tokens, "
                        f"1 thread: decoded vs offline (samples drawn once: {drawing:.0f} s; target view "
                        f"{view:.1f} s)")
    for column in ("drafter", "decode s", "decode + AR s", "offline s", "ratio", "ratio (+AR)",
                   *(f"τ {s.name} decoded / offline" for s in SETTINGS)):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(r["drafter"], f"{r['decode_s']:.1f}", f"{r['decode_with_baseline_s']:.1f}",
                      f"{r['offline_s']:.1f}", f"{r['ratio']:.1f}x", f"{r['ratio_with_baseline']:.1f}x",
                      *(f"{t['decoded']:.3f} ± {t['decoded_ci']:.3f} / {t['offline']:.3f} ± {t['offline_ci']:.3f}"
                        for t in r["tau"].values()))
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
