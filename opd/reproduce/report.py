"""The `opd reproduce` report: the paper's tables as markdown (mean ± std over seeds) and two plots."""

from __future__ import annotations

import os
import platform
import statistics
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import torch

from opd.outputs import write_text_atomic
from opd.reproduce.arms import shares_samples
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


def baseline_arm(arm: str, names: Collection[str]) -> str:
    """The continued-SFT arm an arm is compared with: its drafter family's, named by the longest shared prefix
    (`eagle3-draft-opd` -> `eagle3-sft`), else `sft`."""
    cuts = [i + 1 for i, ch in enumerate(arm) if ch == "-"]
    return next((arm[:i] + "sft" for i in reversed(cuts) if arm[:i] + "sft" in names), "sft")


def summarize(results: list[ArmResult]) -> dict[str, ArmSummary]:
    by_arm: dict[str, dict[int, ArmResult]] = {}
    for r in results:
        by_arm.setdefault(r.arm, {})[r.seed] = r
    out = {}
    for arm, runs in by_arm.items():
        samplings = list(next(iter(runs.values())).final)
        base = baseline_arm(arm, by_arm)
        sft = by_arm.get(base, {})
        paired = [runs[s].final["greedy"] / sft[s].final["greedy"] - 1 for s in runs if s in sft]
        out[arm] = ArmSummary(
            arm, len(runs), {k: _mean_std([r.final[k] for r in runs.values()]) for k in samplings},
            _mean_std(paired) if paired and arm != base else None,
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


def _cells(rows: list[dict]) -> dict[str, dict]:
    return {r["sampling"]: r for r in rows}


def _by_arm(results: list[ArmResult]) -> dict[str, dict[int, ArmResult]]:
    out: dict[str, dict[int, ArmResult]] = {}
    for r in results:
        if r.final_rows:
            out.setdefault(r.arm, {})[r.seed] = r
    return out


def _warm_runs(by_arm: dict[str, dict[int, ArmResult]]) -> list[ArmResult]:
    """The runs that measured the warm drafter's rows (the budget arm's, one per seed)."""
    return [r for r in by_arm.get(BUDGET_ARM, {}).values() if r.initial_rows]


def _families_tables(results: list[ArmResult], arms: list[str]) -> list[str]:
    """Every arm on every prompt family and setting: τ, its ratio to continued SFT (paired by seed) and to the
    warm drafter, the numbers issue 17's goals are stated in. Each arm is compared with its own drafter family's
    SFT arm (`baseline_arm`) and its own warm drafter (its runs' initial rows); the warm row is the budget arm's."""
    by_arm = _by_arm(results)
    warm_runs = _warm_runs(by_arm)
    if not warm_runs:
        return []
    cols = [(f, s) for f, rows in warm_runs[0].initial_rows.items() for s in _cells(rows)]

    def tau(rows_of: dict[str, list[dict]], f: str, s: str) -> float:
        return _cells(rows_of[f])[s]["tau"]

    def ci(rows_of: dict[str, list[dict]], f: str, s: str) -> float:
        return _cells(rows_of[f])[s].get("tau_ci", 0.0)

    def cell(runs: list[ArmResult], c: tuple[str, str], rows: str) -> str:
        """mean ± std over seeds, then the mean over seeds of the 95% interval over prompts."""
        values = [tau(getattr(r, rows), *c) for r in runs]
        return f"{_fmt(_mean_std(values))} [±{statistics.fmean(ci(getattr(r, rows), *c) for r in runs):.3f}]"

    head = " | ".join(f"{f} {s}" for f, s in cols)
    lines = ["### Every prompt family and setting (held-out τ, mean ± std over seeds [± 95% interval over prompts, "
             "mean over seeds])", "",
             f"| arm | {head} |", "|---|" + "---|" * len(cols),
             "| warm drafter | " + " | ".join(cell(warm_runs, c, "initial_rows") for c in cols) + " |"]
    ratios = ["", "### The same, relative (mean ± std over seeds): vs continued SFT paired by seed; vs the warm "
              "drafter; worst: the lowest ratio to the warm drafter over all columns", "",
              f"| arm | {' | '.join(f'vs SFT {f} {s}' for f, s in cols)} | worst vs warm |",
              "|---|" + "---|" * (len(cols) + 1)]
    for arm in [a for a in arms if a in by_arm]:
        runs = by_arm[arm]
        lines.append(f"| {arm} | " + " | ".join(cell(list(runs.values()), c, "final_rows") for c in cols) + " |")
        base = baseline_arm(arm, by_arm)
        if arm == base:
            continue
        sft = by_arm.get(base, {})
        own_warm = [r for r in runs.values() if r.initial_rows] or warm_runs
        warm = {c: statistics.fmean(tau(r.initial_rows, *c) for r in own_warm) for c in cols}
        paired = [_fmt(_mean_std([tau(runs[s].final_rows, *c) / tau(sft[s].final_rows, *c) - 1
                                  for s in runs if s in sft]), pct=True) if sft else "" for c in cols]
        worst = min(statistics.fmean(tau(r.final_rows, *c) for r in runs.values()) / warm[c] - 1 for c in cols)
        ratios.append(f"| {arm} | " + " | ".join(paired) + f" | {worst:+.1%} |")
    return lines + ratios + [""]


def _ceiling_table(results: list[ArmResult], arms: list[str]) -> list[str]:
    """Each arm's share of the reachable gain, (τ − 1) / (ceiling − 1), mean over seeds, at every (family, setting)
    whose rows carry a ceiling: the argmax oracle on the seed's stored samples for point-mass settings, full
    acceptance for sampled drafts (opd/eval/ceiling.py). A τ ratio says which arm is ahead; this says how much of
    what the drafter could take on that text it takes."""
    by_arm = _by_arm(results)
    warm_runs = _warm_runs(by_arm)
    if not warm_runs:
        return []
    cols = [(f, s) for f, rows in warm_runs[0].initial_rows.items() for s, row in _cells(rows).items()
            if row.get("ceiling") is not None]
    if not cols:
        return []

    def share(rows_of: list[dict[str, list[dict]]], c: tuple[str, str]) -> str:
        cells = [_cells(rows[c[0]])[c[1]] for rows in rows_of]
        if any(cell.get("ceiling") is None for cell in cells):
            return ""
        return f"{statistics.fmean((x['tau'] - 1) / max(1e-9, x['ceiling'] - 1) for x in cells):.0%}"

    warm = [r.initial_rows for r in warm_runs]
    ceiling = [statistics.fmean(_cells(rows[f])[s]["ceiling"] for rows in warm) for f, s in cols]
    lines = ["### Share of the reachable gain, (τ − 1) / (ceiling − 1), mean over seeds", "",
             ("Ceiling: the argmax oracle on the same stored samples (point-mass drafts), full acceptance q = p on "
              "the decoded text (sampled drafts)."), "",
             f"| arm | {' | '.join(f'{f} {s}' for f, s in cols)} |", "|---|" + "---|" * len(cols),
             "| ceiling (τ) | " + " | ".join(f"{c:.3f}" for c in ceiling) + " |",
             "| warm drafter | " + " | ".join(share(warm, c) for c in cols) + " |"]
    for arm in [a for a in arms if a in by_arm]:
        rows_of = [r.final_rows for r in by_arm[arm].values()]
        lines.append(f"| {arm} | " + " | ".join(share(rows_of, c) for c in cols) + " |")
    return lines + [""]


def _diagnostic_tables(results: list[ArmResult], arms: list[str], family: str = "heldout") -> list[str]:
    """The expected-acceptance diagnostic on one family: every (states, rule) pair, then a_k per position for
    the sampled rule. Rule on the other setting's states vs its own separates 'which states' from 'the loss'."""
    by_arm = _by_arm(results)
    warm_runs = _warm_runs(by_arm)
    if not warm_runs:
        return []
    first = _cells(warm_runs[0].initial_rows[family])
    pairs = [(states, rule) for states, row in first.items() for rule in row["expected"]]
    sampled = [rule for _, rule in pairs if rule != "greedy"][:1]

    def mean(runs: list[dict[str, list[dict]]], states: str, rule: str, key: str):
        values = [_cells(r[family])[states]["expected"][rule][key] for r in runs]
        return ([statistics.fmean(v[i] for v in values) for i in range(len(values[0]))]
                if isinstance(values[0], list) else statistics.fmean(values))

    table = {"warm drafter": [r.initial_rows for r in warm_runs]}
    table.update({a: [r.final_rows for r in by_arm[a].values()] for a in arms if a in by_arm})
    head = " | ".join(f"{rule} rule on {states} states" for states, rule in pairs)
    lines = [f"### Expected τ from p and q on the {family} prompts (token-weighted, mean over seeds)", "",
             "Rows: arm; columns: whose decoding visited the states, and which acceptance rule is applied "
             "to the drafts there (opd/eval/expected.py).", "", f"| arm | {head} |", "|---|" + "---|" * len(pairs)]
    for arm, runs in table.items():
        lines.append(f"| {arm} | " + " | ".join(f"{mean(runs, s, r, 'tau_token_weighted'):.3f}" for s, r in pairs)
                     + " |")
    for rule in sampled:
        for states in [s for s in first if rule in first[s]["expected"]]:
            k = len(first[states]["expected"][rule]["slot"])
            lines += ["", f"Expected acceptance a_k of the {rule} rule on {states} states, per drafted position:",
                      "", "| arm | " + " | ".join(str(i) for i in range(1, k + 1)) + " |", "|---|" + "---|" * k]
            lines += [f"| {arm} | " + " | ".join(f"{a:.3f}" for a in mean(runs, states, rule, "slot")) + " |"
                      for arm, runs in table.items()]
    return lines + [""]


def _rollout_table(results: list[ArmResult], arms: list[str], window: int = 5) -> list[str]:
    """The diagnostic on each arm's own training rollouts: every rule's expected τ over the first and the last
    `window` steps (mean over seeds). Where the rollouts are greedy, the sampled rule on them says whether the
    loss alone moves sampled acceptance on the states it trains on."""
    by_arm = {a: [r for r in results if r.arm == a and r.rollout_expected] for a in arms}
    by_arm = {a: runs for a, runs in by_arm.items() if runs}
    if not by_arm:
        return []
    rules = list(next(iter(by_arm.values()))[0].rollout_expected)
    head = " | ".join(f"{rule} rule: first {window} → last {window} steps" for rule in rules)
    lines = ["### Expected τ on each arm's own training rollouts (mean over seeds)", "", f"| arm | {head} |",
             "|---|" + "---|" * len(rules)]
    for arm, runs in by_arm.items():
        cells = []
        for rule in rules:
            first = statistics.fmean(statistics.fmean(r.rollout_expected[rule][:window]) for r in runs)
            last = statistics.fmean(statistics.fmean(r.rollout_expected[rule][-window:]) for r in runs)
            cells.append(f"{first:.3f} → {last:.3f}")
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
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


def _eval_share(results: list[ArmResult]) -> float:
    return sum(r.eval_minutes for r in results) / max(1e-9, sum(r.minutes for r in results))


def _rollouts_line(spec: ReproduceSpec) -> str:
    """Where each arm's rollouts came from: shared target samples per seed, or its own speculative decoding."""
    opd = [a for a in spec.arms if a.kind == "opd"]
    own = [a.name for a in opd if not (spec.share_samples and shares_samples(spec.experiment, spec.set, a))]
    if len(own) == len(opd):
        return "Rollouts: every opd arm decodes its own (speculative decoding with its current drafter)."
    where = f" except {', '.join(own)}, which decode their own (the speculative engine)" if own else ""
    return (f"Rollouts: each seed's opd arms train on one shared file of target samples (samples/seed<S>.jsonl, "
            f"rollout.source target, blocks rebuilt with each arm's current drafter){where}.")


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
             f"{minutes:.1f} min wall; held-out evaluation took {_eval_share(results):.0%} of the arms' time "
             f"({'offline' if spec.offline_eval else 'decoded'})."), "", _rollouts_line(spec), ""]
    lines += _table("All arms", [a.name for a in spec.arms], summary, warm)
    lines += _families_tables(results, [a.name for a in spec.arms])
    lines += _ceiling_table(results, [a.name for a in spec.arms])
    lines += _diagnostic_tables(results, [a.name for a in spec.arms])
    lines += _rollout_table(results, [a.name for a in spec.arms])
    for title, arms in TABLES:
        lines += _table(title, arms, summary, warm)
    lines += _histogram_table(results)
    lines += ["![held-out τ vs FLOPs](tau_vs_flops.png)", "", "![first rejected position](first_rejection.png)", ""]
    path = out / "results.md"
    write_text_atomic(path, "\n".join(lines))
    return path
