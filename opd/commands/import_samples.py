"""`opd import-samples`: a user's serving logs into the sample store, so a run trains on the traffic they serve with
no decoding (`rollout.source: samples`; opd/sources/served.py says what is kept and why).

Writes the sample rows to `--out` and the prompts they name to `--prompts-out` (default: beside them), prints the
format read per file and one table of rows read, imported and skipped by reason per sampling setting, and the
settings that train on them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from rich.table import Table

from opd.data.prompts import load_tokenizer
from opd.data.render import Rendering
from opd.errors import OpdError
from opd.outputs import write_text_atomic
from opd.progress import progress_bar, table_console
from opd.sources.provenance import Provenance
from opd.sources.served import Imported, Target, import_logs, log_facts
from opd.spec import ExperimentSpec


def run_import_samples(spec: ExperimentSpec, logs: list[str], out: str, prompts_out: str | None, fmt: str | None,
                       model: str | None, sampling: dict[str, float] | None) -> int:
    paths = [Path(log) for log in logs]
    for path in paths:
        if not path.is_file():
            raise OpdError(f"{path}: not found (expected a JSONL log of served completions)")
    target = Target(load_tokenizer(spec.models.tokenizer), Rendering.of(spec.data), spec.rollout.max_new_tokens,
                    model, sampling)
    digests, rows = zip(*map(log_facts, paths))
    made = Provenance.of(spec, spec.rollout.max_new_tokens).as_row()
    made["made_by"]["served_from"] = list(digests)
    with progress_bar() as bar:
        task = bar.add_task("import", total=sum(rows))
        imported = import_logs(paths, fmt, target, made, lambda: bar.advance(task))
    prompts_path = Path(prompts_out) if prompts_out else Path(out).with_suffix(".prompts.jsonl")
    write_text_atomic(out, "".join(json.dumps(row) + "\n" for row in imported.rows))
    write_text_atomic(prompts_path, "".join(json.dumps(p) + "\n" for p in imported.prompts.values()))
    for log, name in imported.formats.items():
        print(f"{log}: read as {name}")
    if imported.malformed:
        more = f" (and {len(imported.malformed) - 1} more)" if len(imported.malformed) > 1 else ""
        print(f"note: {imported.malformed[0]}; skipped{more}", file=sys.stderr)
    table_console().print(summary(imported))
    if not imported.rows:
        raise OpdError(f"{', '.join(logs)}: no row could be imported (the table above says why)")
    settings = sorted({json.dumps(row["sampling"], sort_keys=True) for row in imported.rows})
    print(f"{len(imported.rows)} samples of {len(imported.prompts)} prompts in {out}, the prompts in {prompts_path}; "
          f"train on them with --set rollout.source=samples --set rollout.samples_path={out} --set "
          f"data.train_prompts={prompts_path} and rollout settings among {', '.join(settings)}")
    return 0


def summary(imported: Imported) -> Table:
    """Rows read, imported, and skipped by reason, per sampling setting."""
    table = Table("setting", "outcome", "rows", title="served completions")
    for (setting, outcome), count in sorted(imported.counts.items(), key=lambda item: (item[0][0], item[0][1])):
        if count:
            table.add_row(setting, outcome, str(count))
    table.add_row("all", "read", str(sum(n for (_, outcome), n in imported.counts.items()
                                         if not outcome.startswith("n > 1"))))
    return table
