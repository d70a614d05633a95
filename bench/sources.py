"""Does the rollout source change what training achieves? `opd run` per (config, rollout.source, seed).

The paper's path (`speculative`: rollout decodes with a drafter copy that adopts every broadcast) against
`target` (rollout only samples the target; the scorer rebuilds the blocks with the newest drafter). Each run is
the whole main job (held-out eval before, training, eval after) in a fresh process; a run whose summary.json
exists is not run again, so an interrupted sweep continues. Prints the table and writes JSON and markdown:

    python bench/sources.py                     # configs/tiny-paper.yaml and configs/tiny.yaml, seeds 0-2
    python bench/sources.py --seeds 0 --configs configs/tiny-paper.yaml
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def run_one(config: str, source: str, seed: int, runs: Path) -> dict:
    """One main job's summary (running it unless its run directory already holds one)."""
    name = f"{Path(config).stem}-{source}-seed{seed}"
    run_dir = runs / name
    summary = run_dir / "summary.json"
    if not summary.exists():
        command = [sys.executable, "-m", "opd.cli", "run", config, "--set", f"seed={seed}",
                   "--set", f"rollout.source={source}", "--set", f"name={name}",
                   "--set", f"tracking.run_dir={run_dir}"]
        subprocess.run(command, cwd=ROOT, check=True)
    return json.loads(summary.read_text())


def gains(summary: dict) -> dict[str, float]:
    """Held-out τ gain (after / before - 1) per eval setting."""
    return {b["sampling"]: a["tau"] / b["tau"] - 1 for b, a in zip(summary["before"], summary["after"])}


def aggregate(rows: list[dict]) -> list[dict]:
    """Mean and standard deviation over seeds per (config, source) and setting."""
    out = []
    for config, source in dict.fromkeys((r["config"], r["source"]) for r in rows):
        group = [r for r in rows if (r["config"], r["source"]) == (config, source)]
        entry = {"config": config, "source": source, "seeds": len(group),
                 "minutes": statistics.mean(r["minutes"] for r in group)}
        for setting in group[0]["gain"]:
            values = [r["gain"][setting] for r in group]
            entry[setting] = {"mean": statistics.mean(values),
                              "sd": statistics.stdev(values) if len(values) > 1 else 0.0,
                              "tau_after": statistics.mean(r["tau_after"][setting] for r in group)}
        out.append(entry)
    return out


def table(summary: list[dict]) -> Table:
    t = Table(title="Held-out τ gain by rollout source (mean ± sd over seeds)")
    for column in ("config", "source", "seeds", "greedy Δτ", "sampled Δτ", "τ after (greedy / sampled)", "min/run"):
        t.add_column(column, justify="right")
    for e in summary:
        t.add_row(e["config"], e["source"], str(e["seeds"]),
                  *(f"{e[s]['mean']:+.1%} ± {e[s]['sd']:.1%}" for s in ("greedy", "sampled")),
                  f"{e['greedy']['tau_after']:.3f} / {e['sampled']['tau_after']:.3f}", f"{e['minutes']:.1f}")
    return t


def markdown(summary: list[dict]) -> str:
    lines = ["| config | source | seeds | greedy Δτ | sampled Δτ | τ after (greedy / sampled) | min/run |",
             "|---|---|---|---|---|---|---|"]
    for e in summary:
        g, s = e["greedy"], e["sampled"]
        lines.append(f"| {e['config']} | {e['source']} | {e['seeds']} | {g['mean']:+.1%} ± {g['sd']:.1%} | "
                     f"{s['mean']:+.1%} ± {s['sd']:.1%} | {g['tau_after']:.3f} / {s['tau_after']:.3f} | "
                     f"{e['minutes']:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=["configs/tiny-paper.yaml", "configs/tiny.yaml"])
    parser.add_argument("--sources", nargs="+", default=["speculative", "target"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--runs", type=Path, default=ROOT / "runs" / "bench-sources")
    parser.add_argument("--out", default="rollout-sources")
    args = parser.parse_args()
    rows = []
    for config in args.configs:
        for seed in args.seeds:
            for source in args.sources:
                s = run_one(config, source, seed, args.runs)
                rows.append({"config": Path(config).stem, "source": source, "seed": seed, "gain": gains(s),
                             "tau_after": {a["sampling"]: a["tau"] for a in s["after"]}, "minutes": s["minutes"]})
    summary = aggregate(rows)
    Console(width=160).print(table(summary))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps({"runs": rows, "summary": summary}, indent=2) + "\n")
    (RESULTS / f"{args.out}.md").write_text(markdown(summary))


if __name__ == "__main__":
    main()
