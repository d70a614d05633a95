"""This project's decoder against z-lab's `dflash_generate`, greedy, on the tiny target's held-out prompts.

Per response budget: how many responses are identical, how many per-verification token counts are identical
(z-lab's `acceptance_lengths` against `SequenceRecord.written`), and τ as z-lab's benchmark averages it (the mean
over responses of each response's mean) from both. The two may differ only within the last K − 1 tokens of the
budget, where z-lab's harness drafts a shortened block (README, "Using drafters from z-lab's dflash"). Needs the
`interop` extra (z-lab's `dflash` package). Prints a table, writes JSON:

    python bench/zlab_interop.py                                   # 32 prompts, 48 and 128 new tokens
    python bench/zlab_interop.py --drafter runs/tiny/checkpoints/step-60 --budgets 128
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from opd.data.prompts import eval_prompts
from opd.decoding.sampling import Sampling
from opd.decoding.speculative import SpeculativeDecoder
from opd.models.build import build_drafter, build_models
from opd.spec import load_spec

ROOT = Path(__file__).resolve().parents[1]


def compare(models, drafter_dir: str, drafter, prompts: list[list[int]], budget: int) -> dict:
    """One budget's row: identical responses and per-verification counts, and τ both ways."""
    import dflash.model as zlab

    zlab._cuda_time = time.perf_counter  # its clock synchronises CUDA; this runs on the CPU
    theirs_model = zlab.DFlashDraftModel.from_pretrained(drafter_dir, dtype=torch.float32).eval()
    ours = SpeculativeDecoder(models.target, drafter, eos_id=models.eos_id).generate(
        prompts, Sampling(), max_new_tokens=budget)
    same_text = same_counts = 0
    theirs_tau = []
    for prompt, record in zip(prompts, ours):
        theirs = zlab.dflash_generate(theirs_model, models.target.model, torch.tensor([prompt]), budget,
                                      [models.eos_id], return_stats=True)
        same_text += theirs.output_ids[0, len(prompt):].tolist() == record.response_ids
        same_counts += theirs.acceptance_lengths == record.written
        theirs_tau.append(statistics.mean(theirs.acceptance_lengths))
    return {"max_new_tokens": budget, "prompts": len(prompts), "same_responses": same_text,
            "same_per_verification": same_counts, "zlab_tau": statistics.mean(theirs_tau),
            "ours_tau": statistics.mean(r.tau for r in ours)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--drafter", default=None, help="drafter directory (default: the config's warm drafter)")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--budgets", type=int, nargs="+", default=[48, 128])
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "zlab_interop.json"))
    args = parser.parse_args()
    torch.manual_seed(0)
    spec = load_spec(args.config)
    models = build_models(spec)
    drafter_dir = args.drafter or spec.models.drafter_path
    drafter = build_drafter(spec, models.target, models.tokenizer, drafter_dir)
    prompts = [p.ids for p in eval_prompts(spec.data, models.tokenizer, args.prompts)]
    rows = [compare(models, drafter_dir, drafter, prompts, budget) for budget in args.budgets]
    table = Table(title=f"z-lab's dflash_generate against SpeculativeDecoder, greedy ({drafter_dir})")
    for name in ("max new tokens", "identical responses", "identical per verification", "z-lab τ", "our τ"):
        table.add_column(name, justify="right")
    for r in rows:
        table.add_row(str(r["max_new_tokens"]), f"{r['same_responses']}/{r['prompts']}",
                      f"{r['same_per_verification']}/{r['prompts']}", f"{r['zlab_tau']:.6f}", f"{r['ours_tau']:.6f}")
    Console().print(table)
    Path(args.out).write_text(json.dumps({"drafter": drafter_dir, "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
