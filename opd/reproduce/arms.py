"""One (arm, seed) of `opd reproduce`, from the warm drafter to the FLOP budget; runs in a worker process.

The full Draft-OPD arm (no marks given) runs `opd_steps` steps and sets the budget: the FLOPs at each of its
evaluation marks. Every other arm trains until it has spent that budget, measuring held-out greedy τ whenever it
crosses one of those marks.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import time
from dataclasses import asdict
from pathlib import Path

import torch

from opd.data.prompts import Prompt, eval_prompts, spec_prompts, train_prompts
from opd.data.render import Rendering
from opd.data.suite import CARD, built_suite, read_rows, suite_prompts
from opd.errors import OpdError
from opd.eval.offline import OfflineEval, draw_eval_samples, file_digest
from opd.eval.online import evaluate
from opd.eval.row import EvalRow
from opd.models.build import Models, build_drafter, build_models
from opd.models.flops import FlopCounter
from opd.outputs import atomic_dir
from opd.reproduce.spec import ArmJob, ArmResult, ArmSpec
from opd.sources.provenance import Provenance
from opd.sources.samplers import build_sampler
from opd.spec import DataSpec, ExperimentSpec, SamplingSpec, load_spec
from opd.train.local import LocalTrainer
from opd.train.sft import train_sft
from opd.train.sft_data import sft_examples, sft_store


class _Evaluator:
    """Held-out τ of the drafter being trained: greedy on the main family for the curve; at the start and the
    end every setting on every family, with the expected-acceptance diagnostic on the main one. With
    `job.eval_samples_dir`, offline: each family's held-out samples are the warm drafter's decodes, stored once
    per seed (the arms of a seed share them; the file lock lets one draw while another waits), and every
    point-mass setting is rebuilt on them (opd/eval/offline.py); `draft: sample` settings still decode."""

    def __init__(self, spec: ExperimentSpec, models: Models, job: ArmJob) -> None:
        self.spec, self.models = spec, models
        n, d = job.eval_prompts, spec.data
        self.prompts = eval_prompts(d, models.tokenizer, n)
        self.families = {"heldout": self.prompts}
        for name, path in job.families.items():
            self.families.update(family_prompts(spec.data, models.tokenizer, name, path, n))
        started = time.perf_counter()
        self.offline = self._offline(job) if job.eval_samples_dir else {}
        self.seconds = time.perf_counter() - started  # all evaluation time, samples and target views included

    def _offline(self, job: ArmJob) -> dict[str, OfflineEval]:
        m = self.models
        assert job.eval_samples_dir is not None  # offline evaluation only
        warm = build_drafter(self.spec, m.target, m.tokenizer)
        sampler = build_sampler(self.spec, "speculative", m.target, warm, m.eos_id)
        out = {}
        for name, prompts in self.families.items():
            path = draw_eval_samples(self.spec, sampler, prompts,
                                     Path(job.eval_samples_dir) / f"seed{job.seed}-{name}.jsonl")
            out[name] = OfflineEval(m, path, prompts, self.spec.eval.sampling,
                                    Provenance.of(self.spec, self.spec.eval.max_new_tokens))
        return out

    def __call__(self, drafter, samplings: list[SamplingSpec] | None = None) -> dict[str, float]:
        rows = self._rows(drafter, "heldout", samplings or [SamplingSpec(name="greedy")], diagnose=False)
        return {r.sampling: r.tau for r in rows}

    def every_family(self, drafter) -> dict[str, list[dict]]:
        """family -> EvalRow dicts for every eval setting; the main family's with the expected-acceptance
        diagnostic, the only one the report's diagnostic tables read (it costs a target pass per setting)."""
        return {name: [asdict(r) for r in self._rows(drafter, name, self.spec.eval.sampling,
                                                     diagnose=name == "heldout")]
                for name in self.families}

    def warm_rows(self, drafter, job: ArmJob) -> dict[str, list[dict]]:
        """`every_family` of the warm drafter, measured once per seed: every opd arm of a seed that starts from the
        same drafter, target and eval setup reads the same stored samples, so their warm rows are equal (offline
        rows are deterministic, decoded ones use the eval's keyed random numbers). Kept beside the seed's held-out
        samples under a key of everything the rows depend on; a second arm waits on the file lock for the first."""
        if not job.eval_samples_dir:
            return self.every_family(drafter)
        path = Path(job.eval_samples_dir) / f"seed{job.seed}-warm-{_warm_key(self.spec, job)}.json"
        with open(path.with_suffix(".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            if path.exists():
                return json.loads(path.read_text())
            rows = self.every_family(drafter)
            partial = path.with_suffix(f".{os.getpid()}.tmp")
            partial.write_text(json.dumps(rows))
            partial.replace(path)
            return rows

    def _rows(self, drafter, family: str, samplings, *, diagnose: bool) -> list[EvalRow]:
        started = time.perf_counter()
        was_training = drafter.training
        drafter.eval()
        e, offline = self.spec.eval, self.offline.get(family)
        names = {s.name for s in samplings}
        rows = offline.evaluate(drafter, diagnose=diagnose, names=names) if offline else []
        decode = [s for s in samplings if s.name not in {r.sampling for r in rows}]
        if decode:
            rows += evaluate(Models(self.models.target, drafter, self.models.tokenizer), self.families[family],
                             decode, max_new_tokens=e.max_new_tokens, batch_size=e.batch_size, seed=self.spec.seed,
                             baseline=False, diagnose=diagnose)
        drafter.train(was_training)
        order = [s.name for s in samplings]
        self.seconds += time.perf_counter() - started
        return sorted(rows, key=lambda r: order.index(r.sampling))


def family_prompts(data: DataSpec, tokenizer, name: str, path: str, limit: int) -> dict[str, list[Prompt]]:
    """A held-out family's first `limit` prompts: a prompt file, or a built suite directory (`opd suite build`),
    which is one family per benchmark, `<name>-<benchmark>`, rendered as `opd suite eval` renders them."""
    if not Path(path).is_dir():
        return {name: spec_prompts(data, path, tokenizer, limit).prompts}
    card, rendering = built_suite(path, field=f"families: {name}:"), Rendering.of(data)
    return {f"{name}-{bench.name}": suite_prompts(read_rows(Path(path) / bench.file), tokenizer, rendering,
                                                 data.max_prompt_tokens, f"families: {name}: {bench.file}")[:limit]
            for bench in card.benchmarks}


def _family_digest(path: str) -> str:
    """A prompt file's content, or a built suite's card (which holds every benchmark file's sha256)."""
    return file_digest(Path(path) / CARD if Path(path).is_dir() else Path(path))


def _warm_key(spec: ExperimentSpec, job: ArmJob) -> str:
    """What the warm drafter's eval rows depend on: the models (and the warm drafter's files), the eval and data
    settings, the prompt files' and the seed's held-out samples' content, the prompt count and the seed."""
    drafter = Path(spec.models.drafter_path or "")
    files = sorted(f for f in drafter.iterdir() if f.is_file()) if drafter.is_dir() else []
    prompt_files = {"heldout": spec.data.eval_prompts, **job.families}
    assert job.eval_samples_dir is not None  # the key of a stored file there (`warm_rows`)
    samples = sorted(Path(job.eval_samples_dir).glob(f"seed{job.seed}-*.jsonl"))
    parts = {"models": spec.models.model_dump(mode="json"), "eval": spec.eval.model_dump(mode="json"),
             "data": spec.data.model_dump(mode="json"), "seed": job.seed, "prompts": job.eval_prompts,
             "drafter": [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files],
             "files": {name: _family_digest(p) for name, p in prompt_files.items()},
             "samples": {f.name: file_digest(f) for f in samples}}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def _tau(rows: dict[str, list[dict]]) -> dict[str, float]:
    """The main family's τ per setting."""
    return {r["sampling"]: r["tau"] for r in rows["heldout"]}


def arm_spec(job: ArmJob, steps: int) -> ExperimentSpec:
    sets = [*job.overrides, *job.arm.set, f"seed={job.seed}", "engine=local", f"steps={steps}", "eval.every=0",
            f"tracking.run_dir={job.run_dir}", f"tracking.checkpoint_every={steps + 1}"]
    if job.samples_path is not None:
        sets += ["rollout.source=target", f"rollout.samples_path={job.samples_path}"]
    return load_spec(job.experiment, sets)


def shares_samples(experiment: str, overrides: list[str], arm: ArmSpec) -> bool:
    """Whether an opd arm can train on shared target samples: not when its recipe needs the speculative engine
    (random anchors are redrafted by the rollout's own drafter; drafts sampled from q are not a function of the
    text) or it chooses its rollout source itself."""
    if arm.kind != "opd" or any(s.split("=")[0].strip() == "rollout.source" for s in arm.set):
        return False
    spec = load_spec(experiment, [*overrides, *arm.set])
    return spec.replay.anchors != "random" and (spec.serving is None or spec.serving.draft != "sample")


def run_arm(job: ArmJob) -> ArmResult:
    """One (arm, seed) from the warm drafter to the budget; runs in a worker process."""
    torch.set_num_threads(1)
    os.environ["OPD_PROGRESS"] = "0"
    started = time.perf_counter()
    result = _run_sft_arm(job) if job.arm.kind == "sft" else _run_opd_arm(job)
    result.minutes = (time.perf_counter() - started) / 60
    return result


def _run_opd_arm(job: ArmJob) -> ArmResult:
    budget_setter = job.marks is None
    # Room past the full arm's step count for cheaper arms; the warmup stays as many steps as the full arm's.
    cap = 4 * job.opd_steps
    spec = arm_spec(job, cap)
    spec.optim.warmup_ratio *= job.opd_steps / cap
    trainer = LocalTrainer(spec, track=False)
    session = trainer.session
    trainer.start(evaluate=False)  # the arm measures its own initial τ below
    evaluator = _Evaluator(spec, trainer.models, job)
    initial_rows = evaluator.warm_rows(session.drafter, job)
    initial = _tau(initial_rows)
    curve: list[tuple[float, float | None]] = [(0.0, initial["greedy"])]
    mark_steps = {round(job.opd_steps * (i + 1) / job.eval_points) for i in range(job.eval_points)}
    marks = list(job.marks or [])
    records_by_step = []
    while True:
        report = trainer.train_step()
        records_by_step.append(report.metrics)
        spent = session.flops.total
        hit = budget_setter and session.step in mark_steps or marks and spent >= marks[0]
        marks = marks[1:] if hit else marks
        end = (budget_setter and session.step >= job.opd_steps) or (not budget_setter and not marks) or \
            session.step >= cap
        if hit:  # the mark the arm ends on reads the final rows' greedy τ below
            curve.append((spent, None if end else evaluator(session.drafter)["greedy"]))
        if end:
            break
    final_rows = evaluator.every_family(session.drafter)
    _keep(session.drafter, job)
    return ArmResult(job.arm.name, job.seed, session.step, session.flops.as_dict(), _with_final(curve, final_rows),
                     _tau(final_rows),
                     _first_rejection_halves(records_by_step, session.drafter.block_size),
                     initial if budget_setter else {}, final_rows=final_rows, initial_rows=initial_rows,
                     rollout_expected=_rollout_expected(records_by_step), eval_minutes=evaluator.seconds / 60)


def _keep(drafter, job: ArmJob) -> None:
    """The arm's final drafter, saved whole or not at all (`keep_drafters`)."""
    if job.drafter_dir is not None:
        with atomic_dir(job.drafter_dir) as tmp:
            drafter.save_pretrained(tmp)


def _with_final(curve: list[tuple[float, float | None]],
                final_rows: dict[str, list[dict]]) -> list[tuple[float, float]]:
    """The curve with its final point's τ (None: measured at the end, with every setting) filled in: the final
    rows' held-out greedy τ is that point's, on the same samples, so it is not measured twice."""
    return [(flops, _tau(final_rows)["greedy"] if tau is None else tau) for flops, tau in curve]


def _first_rejection_halves(metrics: list[dict[str, float]], block_size: int) -> dict[str, list[float]]:
    """Table 10: the rollout's first-rejected-position distribution, averaged over each half of training."""
    keys = [f"first_reject_{k}" for k in range(1, block_size)] + ["first_reject_full_accept"]
    half = len(metrics) // 2
    out = {}
    for name, part in (("first_half", metrics[:half]), ("second_half", metrics[half:])):
        out[name] = [sum(m[k] for m in part) / max(1, len(part)) for k in keys]
    return out


def _rollout_expected(metrics: list[dict[str, float]]) -> dict[str, list[float]]:
    """The diagnostic on the training rollouts: each rule's expected τ per step (`rollout_expected_<rule>_tau`)."""
    prefix, suffix = "rollout_expected_", "_tau"
    rules = [k[len(prefix):-len(suffix)] for k in metrics[0] if k.startswith(prefix) and k.endswith(suffix)]
    return {rule: [m[f"{prefix}{rule}{suffix}"] for m in metrics] for rule in rules}


def _run_sft_arm(job: ArmJob) -> ArmResult:
    assert job.marks is not None and job.sft_data is not None
    spec = arm_spec(job, job.opd_steps)
    spec.sft.max_flops = job.marks[-1]
    models = build_models(spec)
    prompts = train_prompts(spec.data, models.tokenizer)
    examples = sft_examples(spec, sft_store(spec, prompts, job.sft_data, field="sft_data"), prompts)
    evaluator = _Evaluator(spec, models, job)
    curve: list[tuple[float, float | None]] = [(0.0, evaluator(models.drafter)["greedy"])]
    marks = list(job.marks)
    steps = 0

    def on_step(flops: FlopCounter) -> None:
        nonlocal marks, steps
        steps += 1
        if marks and flops.total >= marks[0]:
            marks = marks[1:]  # training stops at the last mark (sft.max_flops): its τ is the final rows'
            curve.append((flops.total, evaluator(models.drafter)["greedy"] if marks else None))

    flops = train_sft(spec, models, examples, on_step=on_step)
    if marks:
        raise OpdError(f"arm {job.arm.name}: SFT data ran out before the FLOP budget; raise sft.epochs")
    final_rows = evaluator.every_family(models.drafter)
    _keep(models.drafter, job)
    return ArmResult(job.arm.name, job.seed, steps, flops.as_dict(), _with_final(curve, final_rows), _tau(final_rows),
                     final_rows=final_rows, eval_minutes=evaluator.seconds / 60)
