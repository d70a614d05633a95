"""`opd gap`: where each drafter loses to the ceiling, offline on the held-out target samples (opd/eval/gap.py).

For every point-mass eval setting of the stored samples, each drafter's blocks are rebuilt on them and every live
slot is classified against the argmax oracle from the same anchor; the tables split the lost slots by block
position, by the target's top-1 probability and by its entropy at the slot. One target forward per setting serves
every drafter.
"""

from __future__ import annotations

import json
from pathlib import Path

from rich.table import Table

from opd.data.prompts import eval_prompts
from opd.decoding.sampling import Sampling
from opd.eval.gap import OUTCOMES, GapReport, gap_report, slot_facts
from opd.eval.offline import OfflineEval, check_samples_file
from opd.models.build import build_drafter, build_models
from opd.outputs import check_output_file, write_text_atomic
from opd.progress import progress_bar, table_console
from opd.sources.provenance import Provenance
from opd.spec import ExperimentSpec


def run_gap(spec: ExperimentSpec, drafters: dict[str, str], samples: str | None, json_out: str | None) -> int:
    path = check_samples_file(samples or spec.eval.samples_path, "--samples")
    if json_out:
        check_output_file(json_out, "--json", "the results")
    models = build_models(spec)
    loaded = {name: build_drafter(spec, models.target, models.tokenizer, path) for name, path in drafters.items()}
    prompts = eval_prompts(spec.data, models.tokenizer, spec.eval.num_prompts)
    offline = OfflineEval(models, path, prompts, spec.eval.sampling, Provenance.of(spec, spec.eval.max_new_tokens),
                          field="--samples")
    reports = {}
    with progress_bar() as bar:
        task = bar.add_task("gap", total=len(offline.views) * len(drafters))
        for view in offline.views:
            facts = slot_facts(models.target, view.samples, Sampling.of(view.setting), spec.eval.batch_size)
            k = spec.models.drafter.block_size
            ceiling = offline.ceiling(view, k).tau
            for name, drafter in loaded.items():
                reports[(view.setting.name, name)] = gap_report(offline.records(view, drafter), facts, k, ceiling)
                bar.advance(task)
    print_reports(reports)
    if json_out:
        write_text_atomic(Path(json_out), json.dumps(as_json(reports), indent=2) + "\n")
    return 0


def as_json(reports: dict[tuple[str, str], GapReport]) -> list[dict]:
    return [{"setting": setting, "drafter": name, "tau": r.tau, "ceiling": r.ceiling,
             "ceiling_share": r.ceiling_share, "totals": r.totals(), "by_position": r.by_position.rows(),
             "by_top1": r.by_top1.rows(), "by_entropy": r.by_entropy.rows()} for (setting, name), r in reports.items()]


def print_reports(reports: dict[tuple[str, str], GapReport]) -> None:
    console = table_console()
    summary = Table(title="Gap to the ceiling (the argmax oracle) on the held-out samples: shares of live slots")
    for column in ("setting", "drafter", "τ", "ceiling", "share of τ−1", *OUTCOMES):
        summary.add_column(column, justify="right")
    for (setting, name), r in reports.items():
        summary.add_row(setting, name, f"{r.tau:.3f}", f"{r.ceiling:.3f}", f"{r.ceiling_share:.0%}",
                        *(f"{v:.1%}" for v in r.totals().values()))
    console.print(summary)
    for (setting, name), r in reports.items():
        for title, split in (("block position", r.by_position), ("target top-1 probability", r.by_top1),
                             ("target entropy (nats)", r.by_entropy)):
            table = Table(title=f"{name}, {setting}: lost slots by {title}")
            for column in (title, "live slots", *OUTCOMES, "share of lost"):
                table.add_column(column, justify="right")
            for row in split.rows():
                table.add_row(row["key"], str(row["slots"]), *(f"{row[o]:.1%}" for o in OUTCOMES),
                              f"{row['share_of_lost']:.1%}")
            console.print(table)

