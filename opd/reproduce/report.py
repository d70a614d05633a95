"""The `opd reproduce` report: the paper's tables as markdown (mean ± std over seeds) and two plots."""

from __future__ import annotations

import os
import platform
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch

from opd.reproduce.spec import BUDGET_ARM, ArmResult, ReproduceSpec

# Average τ over the Draft-OPD paper's three benchmarks (Qwen3-4B, T=0), as its ablation tables report it.
PAPER_TAU = {"draft-opd": 5.73, "no-decay": 5.49, "all-forward": 5.59, "all-reverse": 5.48, "random-anchors": 5.46,
             "naive-rollout": 5.42}
TABLES = [
    ("Continued SFT vs Draft-OPD at matched FLOPs (Figure 1)", ["sft", "draft-opd"]),
    ("Table 3: loss ablations", ["draft-opd", "no-decay", "all-forward", "all-reverse", "random-anchors"]),
    ("Table 4: the naive target-assisted rollout (KL on committed tokens only)", ["draft-opd", "naive-rollout"]),
    ("Tables 5 and 6: first-rejected-only and decay on accepted tokens",
     ["draft-opd", "first-rejected-only", "accepted-decay"]),
]


@dataclass
class ArmSummary:
    arm: str
    seeds: int
    tau: dict[str, tuple[float, float]]  # sampling -> (mean, std)
    gain_over_sft: tuple[float, float] | None  # greedy τ ratio − 1, paired by seed
    steps: float
    flops: float


def _mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def summarize(results: list[ArmResult]) -> dict[str, ArmSummary]:
    by_arm: dict[str, dict[int, ArmResult]] = {}
    for r in results:
        by_arm.setdefault(r.arm, {})[r.seed] = r
    sft = by_arm.get("sft", {})
    out = {}
    for arm, runs in by_arm.items():
        samplings = list(next(iter(runs.values())).final)
        paired = [runs[s].final["greedy"] / sft[s].final["greedy"] - 1 for s in runs if s in sft]
        out[arm] = ArmSummary(
            arm, len(runs), {k: _mean_std([r.final[k] for r in runs.values()]) for k in samplings},
            _mean_std(paired) if paired and arm != "sft" else None,
            statistics.fmean(r.steps for r in runs.values()), statistics.fmean(r.flops["total"] for r in runs.values()))
    return out


def _fmt(ms: tuple[float, float], pct: bool = False) -> str:
    return f"{ms[0]:+.1%} ± {ms[1]:.1%}" if pct else f"{ms[0]:.3f} ± {ms[1]:.3f}"


def _table(title: str, arms: list[str], summary: dict[str, ArmSummary], warm: dict[str, float]) -> list[str]:
    present = [a for a in arms if a in summary]
    if len(present) < 2:
        return []
    samplings = list(summary[present[0]].tau)
    head = ["arm", *[f"τ {s}" for s in samplings], "vs continued SFT (greedy)", "paper avg τ", "steps", "FLOPs"]
    lines = [f"### {title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines.append("| warm drafter | " + " | ".join(f"{warm.get(s, float('nan')):.3f}" for s in samplings) +
                 " | | | 0 | 0 |")
    for a in present:
        s = summary[a]
        gain = _fmt(s.gain_over_sft, pct=True) if s.gain_over_sft else ""
        paper = f"{PAPER_TAU[a]:.2f}" if a in PAPER_TAU else ""
        lines.append(f"| {a} | " + " | ".join(_fmt(s.tau[k]) for k in samplings) +
                     f" | {gain} | {paper} | {s.steps:.0f} | {s.flops:.3g} |")
    ranked = sorted(present, key=lambda a: -summary[a].tau["greedy"][0])
    lines += ["", f"Greedy τ order here: {' > '.join(ranked)}."]
    if all(a in PAPER_TAU for a in present):
        lines.append(f"Paper order: {' > '.join(sorted(present, key=lambda a: -PAPER_TAU[a]))}.")
    return lines + [""]


def _histogram_table(results: list[ArmResult]) -> list[str]:
    runs = [r for r in results if r.arm == BUDGET_ARM and r.first_rejection]
    if not runs:
        return []
    k = len(runs[0].first_rejection["first_half"])
    head = ["half of training", *[str(i) for i in range(1, k)], "full accept"]
    lines = ["### Table 10: first rejected position per rollout block (Draft-OPD, mean over seeds)", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for half in ("first_half", "second_half"):
        mean = [statistics.fmean(r.first_rejection[half][i] for r in runs) for i in range(k)]
        lines.append(f"| {half.replace('_', ' ')} | " + " | ".join(f"{v:.1%}" for v in mean) + " |")
    return lines + [""]


def _plot_curves(results: list[ArmResult], path: Path) -> None:
    """Held-out greedy τ against training FLOPs: mean over seeds with a ±std band (Figure 1)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for arm in dict.fromkeys(r.arm for r in results):
        runs = [r for r in results if r.arm == arm]
        n = min(len(r.curve) for r in runs)
        xs = [statistics.fmean(r.curve[i][0] for r in runs) for i in range(n)]
        ys = [_mean_std([r.curve[i][1] for r in runs]) for i in range(n)]
        main = arm in ("sft", BUDGET_ARM)
        line, = ax.plot(xs, [m for m, _ in ys], marker="o" if main else None, lw=2.2 if main else 1.0,
                        alpha=1.0 if main else 0.6, label="continued SFT" if arm == "sft" else arm)
        ax.fill_between(xs, [m - s for m, s in ys], [m + s for m, s in ys], color=line.get_color(),
                        alpha=0.15 if main else 0.05)
    ax.set_xlabel("training FLOPs (rollout + replay + drafter updates)")
    ax.set_ylabel("held-out τ, greedy")
    ax.set_title("Draft-OPD vs continued SFT from the same warm drafter")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_histogram(results: list[ArmResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in results if r.arm == BUDGET_ARM and r.first_rejection]
    if not runs:
        return
    k = len(runs[0].first_rejection["first_half"])
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for j, half in enumerate(("first_half", "second_half")):
        mean = [statistics.fmean(r.first_rejection[half][i] for r in runs) for i in range(k)]
        ax.bar([i + (j - 0.5) * 0.4 for i in range(k)], mean, width=0.4, label=half.replace("_", " "))
    ax.set_xticks(range(k), [str(i) for i in range(1, k)] + ["full"])
    ax.set_xlabel("first rejected position in the block")
    ax.set_ylabel("share of rollout blocks")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(spec: ReproduceSpec, results: list[ArmResult], out: Path, minutes: float) -> Path:
    summary = summarize(results)
    warm_runs = [r for r in results if r.arm == BUDGET_ARM]
    warm = {k: statistics.fmean(r.initial[k] for r in warm_runs) for k in warm_runs[0].initial}
    _plot_curves(results, out / "tau_vs_flops.png")
    _plot_histogram(results, out / "first_rejection.png")
    machine = (f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores, {spec.workers} worker processes "
               f"× 1 torch thread, torch {torch.__version__}")
    lines = ["# Draft-OPD claims in miniature (`opd reproduce`)", "",
             (f"Experiment `{spec.experiment}` with {' '.join(spec.set) or 'no overrides'}; seeds {spec.seeds}; "
             f"the full method runs {spec.opd_steps} steps and every arm trains to its FLOPs. Held-out τ on "
             f"{spec.eval_prompts} prompts (per-response mean, bonus token included). {machine}; "
             f"{minutes:.1f} min wall."), ""]
    lines += _table("All arms", [a.name for a in spec.arms], summary, warm)
    for title, arms in TABLES:
        lines += _table(title, arms, summary, warm)
    lines += _histogram_table(results)
    lines += ["![held-out τ vs FLOPs](tau_vs_flops.png)", "", "![first rejected position](first_rejection.png)", ""]
    path = out / "results.md"
    path.write_text("\n".join(lines))
    return path
