"""Held-out evaluation of published weights, off the learner's critical path.

An `Evaluator` owns a target, a drafter copy and the held-out prompts, and evaluates them (offline on stored
target samples where `eval.samples_path` gives them, else by decoding) with whatever weights it is handed: a
`WeightSnapshot` the learner published (the periodic eval, logged at the snapshot's step), or drafter
directories (`opd run`'s before/after table, with the autoregressive baseline for the speedup, and its benchmark
suite table). The learner never decodes: it hands snapshots over through `Evaluations` and logs the results when
they come back.
`engine: local` evaluates inline (`InlineEvaluations`, the same object in the same process); `engine: ray` runs it
in its own actor (actors/evaluator.py), so the learner steps on while the evaluator decodes; with
`resources.evaluator.gpus_per_replica` N > 1, in N actors over one sharded target, each holding an `Evaluator`
that runs the same calls (actors/replica.py).
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

from opd.data.prompts import eval_prompts
from opd.data.suite import built_suite
from opd.eval.offline import OfflineEval, draw_eval_samples
from opd.eval.online import evaluate
from opd.eval.row import EvalRow
from opd.eval.suite import SuiteResult, evaluate_suite
from opd.models.build import Models, build_drafter, build_models
from opd.sources.provenance import Provenance
from opd.sources.samplers import build_sampler
from opd.spec import ExperimentSpec, with_eval_samples
from opd.train.messages import WeightSnapshot


@dataclass
class Checkpoint:
    """`opd run` → evaluator: a drafter directory to evaluate (None: the warm drafter), and the rows the training
    run already measured of those weights, if any."""

    path: str | None
    measured: list[EvalRow] | None = None


@dataclass
class EvalResult:
    """Evaluator → learner: held-out rows for the weights published at learner step `step`."""

    step: int
    rows: list[EvalRow]


class Evaluator:
    """Evaluates the spec's held-out prompts with given drafter weights against the frozen target: offline on the
    stored samples of `eval.samples_path` where it can (opd/eval/offline.py), by decoding otherwise."""

    def __init__(self, spec: ExperimentSpec, models: Models | None = None, rank: int = 0) -> None:
        """`models`: a target and a drafter of its own to load weights into (default: built from the spec).
        `rank`: this process's rank in a sharded evaluator; past 0 it draws samples into copies of its own
        (`private_copy`)."""
        self.spec, self.rank = spec, rank
        self.models = models or build_models(spec)
        self.prompts = eval_prompts(spec.data, self.models.tokenizer, spec.eval.num_prompts)
        self._offline: OfflineEval | None = None

    def __call__(self, snapshot: WeightSnapshot) -> EvalResult:
        """The periodic eval of published weights: every eval setting, with the expected-acceptance diagnostic
        where `eval.diagnostic` asks for it."""
        self.models.drafter.load_state_dict(snapshot.verified().state)
        rows = self._rows(self.models, baseline=False, diagnose=self.spec.eval.diagnostic, version=snapshot.version)
        return EvalResult(snapshot.version, rows)

    def checkpoints(self, drafters: list[Checkpoint]) -> list[list[EvalRow]]:
        """Drafter directories with the autoregressive baseline's speedup, one after another in this process, so
        their speedups are measured side by side."""
        return [self.checkpoint(c.path, c.measured) for c in drafters]

    def checkpoint(self, drafter_path: str | None, measured: list[EvalRow] | None = None) -> list[EvalRow]:
        """A drafter directory (None: the spec's warm drafter), with the autoregressive baseline's speedup.
        `measured`: the rows a training run's periodic eval already took of these very weights; their offline
        rows are kept (copied), so only what needs decoding decodes."""
        m = self.models
        drafter = build_drafter(self.spec, m.target, m.tokenizer, drafter_path)
        return self._rows(Models(m.target, drafter, m.tokenizer), baseline=True, diagnose=False, version=0,
                          measured=measured)

    def draw_samples(self, path: str) -> None:
        """Store the held-out samples in `path` (resumable), decoded by the spec's warm drafter, so its offline τ
        is its decoded τ; evaluate offline on them from now on."""
        m, own = self.models, private_copy(Path(path), self.rank)
        drafter = build_drafter(self.spec, m.target, m.tokenizer)
        draw_eval_samples(self.spec, build_sampler(self.spec, "speculative", m.target, drafter, m.eos_id),
                          self.prompts, own)
        self.spec, self._offline = with_eval_samples(self.spec, str(own)), None

    def suite(self, drafters: dict[str, str], out: str) -> SuiteResult:
        """`opd run`'s benchmark table (`eval.suite`) of drafter directories (label -> path) on this evaluator's
        target, the samples drawn by a fresh copy of the warm drafter into OUT/samples/. Returned without the
        rebuilt records: only the cells are reported, and from an actor the records would cross to the driver."""
        assert self.spec.eval.suite is not None  # only called for a spec with a suite (opd/commands/run.py)
        m, suite = self.models, Path(self.spec.eval.suite)
        warm = Models(m.target, build_drafter(self.spec, m.target, m.tokenizer), m.tokenizer)
        own = private_copy(Path(out) / "samples", self.rank).parent  # what evaluate_suite writes: OUT/samples/
        result = evaluate_suite(self.spec, built_suite(suite, field="eval.suite:"), suite, drafters, own, warm,
                                speedup_prompts=self.spec.eval.speedup_prompts)
        result.records = {}
        return result

    def _rows(self, models: Models, *, baseline: bool, diagnose: bool, version: int,
              measured: list[EvalRow] | None = None) -> list[EvalRow]:
        """Point-mass settings offline when samples exist (or as `measured` already), the rest decoded; with
        `baseline`, the speedup (a wall-clock ratio) is still decoded, on the first `eval.speedup_prompts` prompts."""
        e = self.spec.eval
        if measured is not None:
            rows = [replace(r) for r in measured if r.offline]
        else:
            offline = self.offline()
            rows = offline.evaluate(models.drafter, diagnose=diagnose, draft_version=version) if offline else []
        done = {r.sampling for r in rows}
        decode = [s for s in e.sampling if s.name not in done]
        if decode:
            rows += self._decode(models, self.prompts, decode, baseline=baseline, diagnose=diagnose, version=version)
        if baseline and done:
            timed = self._decode(models, self.prompts[: e.speedup_prompts], [s for s in e.sampling if s.name in done],
                                 baseline=True, diagnose=False, version=version)
            by_name = {t.sampling: t for t in timed}
            for row in (r for r in rows if r.offline):
                t = by_name[row.sampling]
                row.spec_tokens_per_s, row.ar_tokens_per_s = t.spec_tokens_per_s, t.ar_tokens_per_s
                row.speedup, row.greedy_match = t.speedup, t.greedy_match
        order = [s.name for s in e.sampling]
        return sorted(rows, key=lambda r: order.index(r.sampling))

    def offline(self) -> OfflineEval | None:
        """The offline evaluator of `eval.samples_path` (its target view computed once), or None."""
        if self._offline is None and self.spec.eval.samples_path:
            self._offline = OfflineEval(self.models, self.spec.eval.samples_path, self.prompts,
                                        self.spec.eval.sampling, Provenance.of(self.spec, self.spec.eval.max_new_tokens))
        return self._offline

    def _decode(self, models: Models, prompts, samplings, *, baseline: bool, diagnose: bool,
                version: int) -> list[EvalRow]:
        e = self.spec.eval
        return evaluate(models, prompts, samplings, max_new_tokens=e.max_new_tokens, batch_size=e.batch_size,
                        seed=self.spec.seed, baseline=baseline, draft_version=version,
                        static_cache=self.spec.rollout.static_cache, compiled=self.spec.rollout.compile,
                        diagnose=diagnose)


def private_copy(path: Path, rank: int) -> Path:
    """Where rank `rank` of a sharded evaluator keeps the samples it draws: rank 0 at `path`, every other rank in
    a copy of what `path` holds now, in a temporary directory of its own. The ranks cannot share the file: rank 0
    draws under its lock, in collectives that the others would be waiting on that lock to join. A copy starts as
    rank 0's file does, because rank 0 appends nothing before the others join its first draw, and grows alike,
    because the ranks draw the same samples."""
    if rank == 0:
        return path
    own = Path(tempfile.mkdtemp(prefix=f"opd-rank{rank}-")) / path.name
    if path.is_dir():
        shutil.copytree(path, own)
    elif path.exists():
        shutil.copy2(path, own)
    return own


class Evaluations(Protocol):
    """How the learner reaches its evaluator: hand a snapshot over, later collect what has finished."""

    def submit(self, snapshot: WeightSnapshot) -> None:
        """Start evaluating `snapshot`; returns without waiting for the result (where the engine allows)."""

    def finished(self, wait: bool = False) -> list[EvalResult]:
        """The results finished since the last call, in submission order; `wait`: all of them, blocking."""


class InlineEvaluations:
    """`engine: local`: each snapshot is evaluated at once, in this process."""

    def __init__(self, evaluator: Evaluator) -> None:
        self.evaluator = evaluator
        self.done: list[EvalResult] = []

    def submit(self, snapshot: WeightSnapshot) -> None:
        self.done.append(self.evaluator(snapshot))

    def finished(self, wait: bool = False) -> list[EvalResult]:
        done, self.done = self.done, []
        return done
