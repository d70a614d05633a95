"""Issue 50's study in one command: DSpark against DFlash 2, each with Draft-OPD at T=1.0 with drafts sampled from q,
at matched training FLOPs, on the shipped tiny target.

Runs `opd reproduce configs/reproduce/dspark.yaml` (resumable: finished arms are kept in its out_dir), copies its
report, plots and per-arm JSON to bench/results/reproduce-dspark/, and writes there summary.json and summary.md: per arm,
held-out and reworded τ before (its own warm drafter) and after Draft-OPD in every eval setting, the steps and
training FLOPs it spent, and what a block costs to draft (the counters of opd/models/flops.py: the layers over the
block's tokens, the head and the Markov bias at K-1 slots, DFlash 2's convolution taps and selector).

    python bench/dspark_study.py [--spec configs/reproduce/dspark.yaml] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import cast

from torch import nn

from opd.models.build import build_models
from opd.models.flops import DrafterParams
from opd.reproduce import ArmResult, load_reproduce_spec, run_reproduce
from opd.spec import load_spec

RESULTS = Path(__file__).parent / "results" / "reproduce-dspark"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", default="configs/reproduce/dspark.yaml")
    parser.add_argument("--set", action="append", default=[], help="a top-level override of the reproduce spec")
    args = parser.parse_args()
    run_reproduce(args.spec, args.set)
    spec = load_reproduce_spec(args.spec, args.set)
    out = Path(spec.out_dir)
    (RESULTS / "arms").mkdir(parents=True, exist_ok=True)
    for report in [out / "results.md", *out.glob("*.png")]:
        shutil.copy(report, RESULTS / report.name)
    rows = []
    for arm in spec.arms:
        for seed in spec.seeds:
            source = out / "arms" / f"{arm.name}-seed{seed}.json"
            shutil.copy(source, RESULTS / "arms" / source.name)
            result = ArmResult(**json.loads(source.read_text()))
            rows.append(_row(result, _drafter_cost(spec.experiment, [*spec.set, *arm.set])))
    summary = {"spec": args.spec, "overrides": args.set, "arms": rows}
    (RESULTS / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (RESULTS / "summary.md").write_text(_table(rows))
    print(_table(rows))


def _drafter_cost(experiment: str, overrides: list[str]) -> dict[str, float | int | str]:
    """The arm's warm drafter: its family, size and the FLOPs of one drafted block."""
    drafter = build_models(load_spec(experiment, overrides)).drafter
    params = DrafterParams.of(cast(nn.Module, drafter))  # every family is a module
    return {"family": type(drafter).__name__, "parameters": sum(p.numel() for p in drafter.parameters()),
            "block_flops": params.forward(context=0, blocks=1, slots=drafter.block_size - 1),
            "context_flops_per_token": params.forward(context=1, blocks=0, slots=0)}


def _row(result: ArmResult, cost: dict[str, float | int | str]) -> dict:
    """τ before and after per (family, setting), with what the arm spent."""
    def taus(rows: dict[str, list[dict]]) -> dict[str, float]:
        return {f"{family} {r['sampling']}": r["tau"] for family, family_rows in rows.items() for r in family_rows}

    return {"arm": result.arm, "seed": result.seed, **cost, "steps": result.steps,
            "train_flops": result.flops["total"], "before": taus(result.initial_rows),
            "after": taus(result.final_rows), "minutes": result.minutes}


def _table(rows: list[dict]) -> str:
    cells = list(rows[0]["after"])
    lines = ["| arm | drafter | parameters | FLOPs per block | steps | training FLOPs | "
             + " | ".join(f"τ {c} before → after" for c in cells) + " |",
             "|---|---|---|---|---|---|" + "---|" * len(cells)]
    for r in rows:
        moves = [f"{r['before'][c]:.3f} → {r['after'][c]:.3f}" for c in cells]
        lines.append(f"| {r['arm']} | {r['family']} | {r['parameters']:,} | {r['block_flops'] / 1e9:.4f} GFLOP | "
                     f"{r['steps']} | {r['train_flops']:.3g} | " + " | ".join(moves) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
