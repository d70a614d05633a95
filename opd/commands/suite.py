"""`opd suite build` and `opd suite eval`: the paper's benchmark table from one command per step.

`build` writes a suite's prompt files and card (opd/data/suite_build.py) once, anywhere the sources are: a
package, a local file, or the hub. `eval` runs on the target's machine: it draws each benchmark's target samples
once (resumable), rebuilds every drafter's blocks on them and reports τ both ways beside the ceiling
(opd/eval/suite.py), as a table, JSON, a bar chart and MLflow metrics.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from opd.commands import launch
from opd.data.suite import built_suite, load_suite
from opd.data.suite_build import build_suite, parse_files
from opd.errors import OpdError
from opd.eval.suite import evaluate_suite
from opd.eval.suite_report import markdown, metrics, write_report
from opd.model_dir import ModelDir
from opd.outputs import check_output_dir
from opd.sources.provenance import Provenance
from opd.spec import ExperimentSpec


def run_suite_build(suite: str, out: str, files: list[str]) -> int:
    spec = load_suite(suite)
    card = build_suite(spec, Path(out), parse_files(files))
    total = sum(b.count for b in card.benchmarks)
    print(f"wrote {len(card.benchmarks)} prompt files ({total} prompts) and {out}/card.json (seed {card.seed})")
    return 0


def parse_drafts(items: list[str]) -> dict[str, str]:
    """`--draft [LABEL=]PATH` (or `random`) -> {label: path}; the label defaults to the directory's name. A
    directory without a config.json, or the target's, is refused here, before the target loads."""
    drafts = {}
    for item in items:
        label, sep, path = item.partition("=")
        if not sep:
            label, path = Path(item).name or item, item
        if not label or not path:
            raise OpdError(f"--draft {item!r}: expected PATH, LABEL=PATH or random")
        if label in drafts:
            raise OpdError(f"--draft {item!r}: label {label!r} is used twice (expected LABEL=PATH to tell them apart)")
        drafts[label] = path
    for label, path in drafts.items():
        if path != "random":
            directory = ModelDir.read(path, f"--draft {label}={path}", expected="a drafter directory or random")
            directory.expect("drafter", f"--draft {label}")
    return drafts


def run_suite_eval(spec: ExperimentSpec, suite_dir: str, drafts: list[str], out: str | None, *,
                   track: bool = True, speedup_prompts: int = 0) -> int:
    """Evaluate, print the τ tables, write table.md, suite.json and tau.png under OUT (default
    SUITE_DIR/results/<experiment name>-<target digest>) and, with `track`, log them to an MLflow run in OUT."""
    out_dir = Path(out) if out else default_out(spec, suite_dir)
    check_output_dir(out_dir, "--out", "the suite's samples and report")
    card = built_suite(suite_dir)
    if spec.rollout.sampler == "vllm":
        launch.vllm_workers()
    result = evaluate_suite(spec, card, Path(suite_dir), parse_drafts(drafts), out_dir,
                            speedup_prompts=speedup_prompts)
    paths = write_report(result, out_dir)
    print(markdown(result))
    print(f"{len(result.benchmarks)} benchmarks x {len(result.settings)} settings x {len(result.drafters)} drafters "
          f"in {result.seconds:.0f} s; wrote {', '.join(str(p) for p in paths)}")
    if track:
        _log(spec, result, paths, out_dir)
    return 0


def default_out(spec: ExperimentSpec, suite_dir: str) -> Path:
    """SUITE_DIR/results/<experiment name>-<digest>: the digest names what the samples depend on besides the suite
    (the target and tokenizer files, the rendering), so a run with another target never meets this one's samples."""
    made = Provenance.of(spec, 0)
    identity = f"{made.target} {made.tokenizer} {made.render} {made.enable_thinking}"
    return Path(suite_dir) / "results" / f"{spec.name}-{hashlib.sha256(identity.encode()).hexdigest()[:8]}"


def _log(spec: ExperimentSpec, result, paths: list[Path], out_dir: Path) -> None:
    """One MLflow run per suite evaluation, in OUT's store unless the spec names a tracking server."""
    from opd.tracking import Tracker

    tracking = spec.tracking.model_copy(update={"run_dir": str(out_dir)})
    run_spec = spec.model_copy(update={"name": f"{spec.name}-suite-{result.suite}", "tracking": tracking})
    tracker = Tracker(run_spec)
    tracker.log(metrics(result), 0)
    for path in paths:
        tracker.artifact(path)
    tracker.close()
    print(f"MLflow run {tracker.run_id} in {run_spec.tracking_uri}")
