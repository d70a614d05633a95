"""Suite evaluation: every drafter's τ on every benchmark of a built suite, at every point-mass eval setting,
beside the ceiling (the argmax oracle, opd/eval/ceiling.py), offline from target samples.

The target's samples of a benchmark do not depend on the drafter (decoding is lossless), so each benchmark's are
drawn once per setting into OUT/samples/<benchmark>.jsonl (by the spec's sampler with the warm drafter: resumable,
and the warm drafter's offline τ is then its decoded τ block by block) and every drafter's blocks are rebuilt on
them (opd/eval/offline.py). n drafters cost one target pass per benchmark plus n drafter walks.

τ is reported both ways, because papers and this project differ: the authors' (DFlash's benchmark, SGLang's
`spec_accept_length`) is the mean over sequences of each sequence's mean acceptance length; this project's pools
every verification (committed tokens / verifications). Both carry a 95% interval over the prompts.

The speedup is a wall-clock ratio, so it decodes: each drafter against the target alone, side by side in this
process, on the first `speedup_prompts` prompts of each benchmark (0: τ only); MT-Bench's on its first turn.

MT-Bench with two turns evaluates both: the second turn's context holds the target's own first answer from the
samples (opd/data/suite.py `second_turn_rows`), so each setting has its own second-turn prompts and samples.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import ValidationError

from opd.data.prompts import Prompt, load_tokenizer
from opd.data.render import Rendering
from opd.data.suite import (
    BenchmarkPrompts,
    SuiteCard,
    scored_settings,
    second_turn_rows,
    suite_inputs,
    suite_prompts,
    target_context,
    thinking,
)
from opd.decoding.record import SequenceRecord
from opd.errors import OpdError
from opd.eval.acceptance import AcceptanceStats, pooled_interval
from opd.eval.ceiling import beats_oracle, oracle_records
from opd.eval.offline import OfflineEval, SettingView, draw_eval_samples
from opd.eval.online import evaluate
from opd.models.build import Models, build_drafter, build_models
from opd.progress import progress_bar
from opd.sources.provenance import Provenance
from opd.sources.samplers import build_sampler
from opd.sources.store import SampleRow
from opd.spec import ExperimentSpec, SamplingSpec

CEILING = "ceiling"  # the argmax oracle's row in every table


@dataclass
class Cell:
    """One drafter (or the ceiling) on one benchmark at one setting."""

    benchmark: str
    setting: str
    drafter: str
    sequences: int
    tau: float  # the authors': mean over sequences of each sequence's mean acceptance length
    tau_ci: float
    tau_pooled: float  # this project's: committed tokens / verifications over every sequence
    tau_pooled_ci: float
    survival: list[float]  # acceptance per position: P(accepted >= k), k = 1..K-1
    beats_oracle: float | None  # share of blocks accepting more than the oracle from the same anchor
    speedup: float | None = None  # decoded tokens/s over the target alone's, on the benchmark's speedup subset

    @classmethod
    def of(cls, benchmark: str, setting: str, drafter: str, records: list[SequenceRecord], block_size: int,
           beats: float | None) -> Cell:
        stats = AcceptanceStats.from_records(records, block_size)
        return cls(benchmark, setting, drafter, len(records), stats.tau, stats.tau_ci, stats.tau_token_weighted,
                   pooled_interval(records), stats.survival, beats)


@dataclass
class SuiteResult:
    suite: str
    experiment: str
    thinking: bool
    settings: list[str]
    benchmarks: list[str]
    drafters: dict[str, str]  # label -> path
    sampling: dict[str, str] = field(default_factory=dict)  # setting -> "T=0.6, top-p 0.95, top-k 20"
    cells: list[Cell] = field(default_factory=list)
    seconds: float = 0.0
    # (benchmark, setting, drafter) -> its rebuilt records: kept for checks in this process, not written out
    records: dict[tuple[str, str, str], list[SequenceRecord]] = field(default_factory=dict, repr=False)

    def cell(self, benchmark: str, setting: str, drafter: str) -> Cell:
        return next(c for c in self.cells if (c.benchmark, c.setting, c.drafter) == (benchmark, setting, drafter))

    def average(self, setting: str, drafter: str, pooled: bool = False) -> float:
        """The table's average column: the unweighted mean over benchmarks, as the paper averages."""
        cells = [self.cell(b, setting, drafter) for b in self.benchmarks]
        return sum(c.tau_pooled if pooled else c.tau for c in cells) / len(cells)


def evaluate_suite(spec: ExperimentSpec, card: SuiteCard, suite_dir: Path, drafters: dict[str, str],
                   out: Path, models: Models | None = None, speedup_prompts: int = 0) -> SuiteResult:
    """Every drafter in `drafters` (label -> path, or "random") on every benchmark of the built suite in
    `suite_dir`, at `spec.eval.sampling`'s point-mass settings; samples stored under OUT/samples/. `models`: the
    target, its tokenizer and the warm drafter that draws the samples (default: built from the spec), so an
    evaluator that holds a target already does not load a second one. `speedup_prompts`: prompts per benchmark
    decoded for the speedup (0: none). Every benchmark's prompts and stored samples are checked before any model
    loads."""
    started = time.perf_counter()
    settings = scored_settings(spec.eval.sampling)
    rendering = Rendering.of(spec.data)
    tokenizer = models.tokenizer if models else load_tokenizer(spec.models.tokenizer)
    inputs = suite_inputs(card, suite_dir, tokenizer, rendering, target_context(spec.models.target_path), "--suite")
    check_stored(spec, inputs, out)
    # the sampler serves the suite's longest prompt, which data.max_prompt_tokens (the training cap) need not hold
    longest = max([spec.data.max_prompt_tokens, *(b.longest for b in inputs)])
    spec = spec.model_copy(update={"data": spec.data.model_copy(update={"max_prompt_tokens": longest})})
    models = models or build_models(spec)
    loaded = {label: build_drafter(spec, models.target, models.tokenizer, path) for label, path in drafters.items()}
    sampler = build_sampler(spec, spec.rollout.sampler, models.target, models.drafter, models.eos_id)
    result = SuiteResult(card.suite, spec.name, thinking(rendering), [s.name for s in settings],
                         [b.name for b in card.benchmarks], dict(drafters), {s.name: _described(s) for s in settings})
    for bench in inputs:
        views = _benchmark_views(spec, models, sampler, rendering, bench, out)
        with progress_bar() as bar:
            task = bar.add_task(f"{bench.card.name}: drafters", total=len(views) * len(loaded))
            for setting, parts in views.items():
                _score(result, bench.card.name, setting, parts, loaded, spec.models.drafter.block_size,
                       lambda: bar.advance(task))
        if speedup_prompts:
            _speedups(result, spec, models, bench, views, loaded, speedup_prompts)
    result.seconds = time.perf_counter() - started
    return result


def check_stored(spec: ExperimentSpec, inputs: list[BenchmarkPrompts], out: Path) -> None:
    """Samples already in OUT/samples/ were made by this target and settings (a rerun resumes them), or one line
    naming the fix, before any benchmark draws: the store's own refusal would come only as each benchmark's turn
    came, and name a command that draws held-out samples, not a suite's."""
    for bench in inputs:
        path = out / "samples" / f"{bench.card.name}.jsonl"
        first = _first_row(path)
        if first is None:
            continue
        if difference := Provenance.of(spec, bench.max_new_tokens).mismatch(first.provenance):
            raise OpdError(f"{path} line 1: {difference} (expected samples of this target and settings: write to "
                           f"another --out, or remove {path.parent} to redraw them)")


def _first_row(path: Path) -> SampleRow | None:
    """The first row of a samples file, or None: no file, or a row the store will refuse with its own line."""
    if not path.is_file():
        return None
    with path.open() as f:
        line = f.readline()
    try:
        return SampleRow.model_validate(json.loads(line))
    except (json.JSONDecodeError, ValidationError):
        return None


def _speedups(result: SuiteResult, spec: ExperimentSpec, models: Models, bench: BenchmarkPrompts,
              views: dict[str, list[View]], drafters: dict, count: int) -> None:
    """Each drafter's decoded speedup over the target alone on the benchmark's first `count` (first-turn) prompts,
    per setting, with the benchmark's own response cap."""
    for setting, parts in views.items():
        view = parts[0][1]
        prompts = [Prompt(str(s.key), "", s.prompt_ids) for s in view.samples[:count]]
        for label, drafter in drafters.items():
            row = evaluate(Models(models.target, drafter, models.tokenizer), prompts, [view.setting],
                           max_new_tokens=bench.max_new_tokens, batch_size=spec.eval.batch_size, seed=spec.seed,
                           baseline=True)[0]
            result.cell(bench.card.name, setting, label).speedup = row.speedup


def _described(setting: SamplingSpec) -> str:
    if setting.temperature == 0:
        return "T=0"
    return f"T={setting.temperature:g}, top-p {setting.top_p:g}, top-k {setting.top_k}"


View = tuple[OfflineEval, SettingView]


def _benchmark_views(spec: ExperimentSpec, models: Models, sampler, rendering: Rendering, bench: BenchmarkPrompts,
                     out: Path) -> dict[str, list[View]]:
    """Per setting, the stored samples of the benchmark (both turns with turns: 2) and the target's view of them."""
    name, tokens = bench.card.name, bench.max_new_tokens
    spec = spec.model_copy(update={"eval": spec.eval.model_copy(update={"max_new_tokens": tokens})})
    first = _drawn(spec, models, sampler, bench.prompts, out / "samples" / f"{name}.jsonl")
    views = {view.setting.name: [(first, view)] for view in first.views}
    if bench.card.turns == 2:
        for view in first.views:
            answers = [models.tokenizer.decode(s.response_ids, skip_special_tokens=True) for s in view.samples]
            second = suite_prompts(second_turn_rows(bench.rows, answers, view.setting.name), models.tokenizer,
                                   rendering, spec.data.max_prompt_tokens, f"--suite {bench.card.file} (second turn)")
            one = spec.model_copy(update={"eval": spec.eval.model_copy(update={"sampling": [view.setting]})})
            path = out / "samples" / f"{name}-turn2-{view.setting.name}.jsonl"
            offline = _drawn(one, models, sampler, second, path)
            views[view.setting.name].append((offline, offline.views[0]))
    return views


def _drawn(spec: ExperimentSpec, models: Models, sampler, prompts: list[Prompt], path: Path) -> OfflineEval:
    """The offline evaluator of `prompts`' samples in `path`, drawing what the file lacks first."""
    redraw = "opd suite eval CONFIG --suite SUITE --out ANOTHER_DIR"
    draw_eval_samples(spec, sampler, prompts, path, field="suite samples", redraw=redraw)
    return OfflineEval(models, path, prompts, spec.eval.sampling, Provenance.of(spec, spec.eval.max_new_tokens),
                       field="suite samples", redraw=redraw)


def _score(result: SuiteResult, benchmark: str, setting: str, parts: list[View], drafters: dict,
           block_size: int, tick) -> None:
    """The ceiling's cell and each drafter's, pooled over the parts (MT-Bench's turns)."""
    argmax = [a for _, view in parts for a in view.argmax]
    oracle = [rec for _, view in parts for rec in oracle_records(view.samples, view.argmax, block_size)]
    result.cells.append(Cell.of(benchmark, setting, CEILING, oracle, block_size, None))
    for label, drafter in drafters.items():
        records = [rec for offline, view in parts for rec in offline.records(view, drafter)]
        beats = beats_oracle(records, argmax, drafter.block_size)
        result.cells.append(Cell.of(benchmark, setting, label, records, drafter.block_size, beats))
        result.records[(benchmark, setting, label)] = records
        tick()
