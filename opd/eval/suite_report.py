"""What a suite evaluation writes: the paper's table (drafters as rows, benchmarks as columns, an average column,
and the ceiling as a row with each drafter's share of it), JSON, a bar chart and MLflow metrics per benchmark.

The headline τ is the authors' (mean over sequences of per-sequence mean acceptance), so the table reads like
the paper's; this project's pooled τ follows in its own table, and both are in the JSON.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, fields
from pathlib import Path

from opd.eval.suite import CEILING, SuiteResult


def markdown(result: SuiteResult) -> str:
    """Every table of the report as markdown, setting by setting."""
    parts = [f"# Suite `{result.suite}` on `{result.experiment}` (thinking {'on' if result.thinking else 'off'})\n",
             "τ: the authors' (mean over sequences of each sequence's mean acceptance length) ± 95% interval over "
             "prompts. τ pooled: this project's (committed tokens / verifications). ceiling: τ of the argmax "
             "oracle on the same target samples; % of ceiling: the average τ over the average ceiling.\n"]
    for setting in result.settings:
        if any(c.speedup is not None for c in result.cells if c.setting == setting):
            parts.append(_speedup_table(result, setting))
        parts.append(_tau_table(result, setting, pooled=False))
        parts.append(_tau_table(result, setting, pooled=True))
        parts.append(_positions(result, setting))
    return "\n".join(parts)


def _drafters(result: SuiteResult) -> list[str]:
    return [*result.drafters, CEILING]


def _tau_table(result: SuiteResult, setting: str, *, pooled: bool) -> str:
    title = f"### {setting} ({result.sampling[setting]}): τ {'pooled' if pooled else '(authors)'}\n"
    head = ["drafter", *result.benchmarks, "avg", "% of ceiling"]
    lines = [title, _row(head), _row(["---"] * len(head))]
    ceiling = result.average(setting, CEILING, pooled)
    for drafter in _drafters(result):
        cells = [result.cell(b, setting, drafter) for b in result.benchmarks]
        values = [f"{c.tau_pooled:.2f} ± {c.tau_pooled_ci:.2f}" if pooled else f"{c.tau:.2f} ± {c.tau_ci:.2f}"
                  for c in cells]
        average = result.average(setting, drafter, pooled)
        share = "" if drafter == CEILING else f"{average / ceiling:.0%}"
        lines.append(_row([drafter, *values, f"{average:.2f}", share]))
    return "\n".join(lines) + "\n"


def _speedup_table(result: SuiteResult, setting: str) -> str:
    """The paper's main cells: each drafter's decoded speedup over the target alone per benchmark, and its τ."""
    head = ["drafter", *result.benchmarks, "τ (avg)"]
    lines = [f"### {setting} ({result.sampling[setting]}): speedup over the target alone (decoded subset)\n",
             _row(head), _row(["---"] * len(head))]
    for drafter in result.drafters:
        cells = [result.cell(b, setting, drafter) for b in result.benchmarks]
        values = ["-" if c.speedup is None else f"{c.speedup:.2f}x" for c in cells]
        lines.append(_row([drafter, *values, f"{result.average(setting, drafter):.2f}"]))
    return "\n".join(lines) + "\n"


def _positions(result: SuiteResult, setting: str) -> str:
    """Acceptance per position P(accepted >= k), and how often a drafter's block beat the oracle's."""
    k = len(result.cells[0].survival)
    head = ["drafter", "benchmark", *(str(i) for i in range(1, k + 1)), "blocks beating the oracle"]
    lines = [f"### {setting} ({result.sampling[setting]}): acceptance per position, P(accepted >= k)\n", _row(head),
             _row(["---"] * len(head))]
    for drafter in _drafters(result):
        for b in result.benchmarks:
            c = result.cell(b, setting, drafter)
            beats = "" if c.beats_oracle is None else f"{c.beats_oracle:.1%}"
            lines.append(_row([drafter, b, *(f"{s:.2f}" for s in c.survival), beats]))
    return "\n".join(lines) + "\n"


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def to_json(result: SuiteResult) -> dict:
    """Everything but the rebuilt records (asdict would first deep-copy them all)."""
    data = {f.name: getattr(result, f.name) for f in fields(result) if f.name not in ("records", "cells")}
    data["cells"] = [asdict(c) for c in result.cells]
    data["averages"] = {s: {d: {"tau": result.average(s, d), "tau_pooled": result.average(s, d, True)}
                            for d in _drafters(result)} for s in result.settings}
    return data


def bar_chart(result: SuiteResult, path: Path) -> None:
    """τ per benchmark, one panel per setting: a bar per drafter, the ceiling as an outline behind them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = [*result.benchmarks, "avg"]
    fig, axes = plt.subplots(1, len(result.settings), figsize=(1.6 + 1.3 * len(columns) * len(result.settings), 4),
                             squeeze=False)
    width = 0.8 / len(result.drafters)
    for ax, setting in zip(axes[0], result.settings):
        ceiling = _taus(result, setting, CEILING)
        ax.bar(range(len(columns)), ceiling, 0.9, fill=False, edgecolor="black", linestyle="--", label=CEILING)
        for i, drafter in enumerate(result.drafters):
            taus = _taus(result, setting, drafter)
            ax.bar([x - 0.4 + width * (i + 0.5) for x in range(len(columns))], taus, width, label=drafter)
        ax.set_xticks(range(len(columns)), columns, rotation=30, ha="right")
        ax.set_title(f"{setting} ({result.sampling[setting]})")
        ax.set_ylabel("τ (authors': mean of per-sequence means)")
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"suite {result.suite} on {result.experiment}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _taus(result: SuiteResult, setting: str, drafter: str) -> list[float]:
    """The authors' τ per benchmark, then the average."""
    return [result.cell(b, setting, drafter).tau for b in result.benchmarks] + [result.average(setting, drafter)]


def metrics(result: SuiteResult) -> dict[str, float]:
    """MLflow metrics, per benchmark: `suite_<benchmark>_<setting>_<drafter>_<what>` (and `avg` as a benchmark)."""
    out = {}
    for c in result.cells:
        key = _key(c.benchmark, c.setting, c.drafter)
        out.update({f"{key}_tau": c.tau, f"{key}_tau_ci": c.tau_ci, f"{key}_tau_pooled": c.tau_pooled})
        out.update({f"{key}_accept_{k}": s for k, s in enumerate(c.survival, start=1)})
        if c.beats_oracle is not None:
            out[f"{key}_beats_oracle"] = c.beats_oracle
        if c.speedup is not None:
            out[f"{key}_speedup"] = c.speedup
    for setting in result.settings:
        for drafter in _drafters(result):
            out[f"{_key('avg', setting, drafter)}_tau"] = result.average(setting, drafter)
    return out


def _key(*parts: str) -> str:
    return "suite_" + "_".join(re.sub(r"[^A-Za-z0-9.-]+", "-", p) for p in parts)


def write_report(result: SuiteResult, out: Path) -> list[Path]:
    """table.md, suite.json and tau.png under `out`; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "table.md", out / "suite.json", out / "tau.png"]
    paths[0].write_text(markdown(result))
    paths[1].write_text(json.dumps(to_json(result), indent=2) + "\n")
    bar_chart(result, paths[2])
    return paths
