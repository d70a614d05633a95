"""The launcher: a validated spec in, a `TrainResult` out, on the spec's engine.

`opd train` and `opd run` (opd/commands/run.py) both train through `train` here, and `opd run` evaluates before and
after through `held_out_eval` and on its benchmark suite through `suite_eval`. It is the only module of opd/ that
imports actors/ (tests/test_layering.py checks it): `engine: local` runs `LocalTrainer` (opd/train/local.py) in
this process, `engine: ray` runs the actor system (actors/driver.py). Both fold their step reports into the result with the same loop (opd/train/result.py).
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

from opd.eval.row import EvalRow
from opd.eval.suite import SuiteResult
from opd.sources.store import StaleSamples
from opd.spec import ExperimentSpec, with_eval_samples
from opd.tracking import run_status
from opd.train.evaluator import Checkpoint
from opd.train.messages import TrainResult


def train(spec: ExperimentSpec) -> TrainResult:
    """Train with the spec's engine; the MLflow run ends FINISHED, or FAILED / KILLED with the error that stopped
    it (the Ray driver does the same for `engine: ray`)."""
    if spec.engine == "ray":
        from actors.driver import run_ray  # Ray is imported only when the spec asks for it

        return run_ray(spec)
    from opd.train.local import LocalTrainer

    if spec.rollout.sampler == "vllm":
        vllm_workers()
    trainer = LocalTrainer(spec)
    try:
        return trainer.run()
    except BaseException as exc:
        with contextlib.suppress(Exception):  # never mask the error that stopped the run
            trainer.session.close(run_status(exc))
        raise


def held_out_eval(spec: ExperimentSpec, drafters: list[Checkpoint]) -> list[list[EvalRow]]:
    """`opd run`'s before/after table for drafter directories (None: the warm drafter), with the autoregressive
    baseline: in this process for `engine: local`, in one evaluator actor on the cluster for `engine: ray` (the
    driver is often a CPU pod)."""
    if spec.engine == "ray":
        from actors.driver import evaluate_in_actor

        return evaluate_in_actor(spec, drafters)
    from opd.train.evaluator import Evaluator

    return Evaluator(spec).checkpoints(drafters)


def suite_eval(spec: ExperimentSpec, suite: str, drafters: dict[str, str], out: Path) -> SuiteResult:
    """`opd run`'s benchmark suite table (`suite`: the spec's `eval.suite`) of drafter directories (label -> path),
    samples under OUT/samples/: in this process for `engine: local`, in one evaluator actor for `engine: ray`,
    where the held-out eval runs too. Paths go to the actor absolute, as this process names them."""
    evals = spec.eval.model_copy(update={"suite": str(Path(suite).resolve())})
    spec, out = spec.model_copy(update={"eval": evals}), out.resolve()
    if spec.engine == "ray":
        from actors.driver import suite_in_actor

        return suite_in_actor(spec, drafters, str(out))
    from opd.train.evaluator import Evaluator

    if spec.rollout.sampler == "vllm":
        vllm_workers()
    return Evaluator(spec).suite(drafters, str(out))


def vllm_workers() -> None:
    """Let this process start vLLM workers: Ray actors of the vLLM environment (actors/isolated.py registers
    how with opd/serving/engine.py; Ray is imported only here, when vLLM is used)."""
    from actors.isolated import allow_vllm_workers

    allow_vllm_workers()


def held_out_samples(spec: ExperimentSpec) -> ExperimentSpec:
    """With `eval.offline` and no usable `eval.samples_path`: store the held-out samples in
    RUN_DIR/eval_samples.jsonl (the warm drafter's decodes; once, resumable), where the evaluator runs, and return
    the spec that evaluates offline on them (opd/eval/offline.py). Named samples this run cannot read (drawn with
    another eval.max_new_tokens, target or rendering, or lacking a prompt or setting) are passed over with a note:
    refusing would leave the user to redraw a file the config names, which the redraw does not replace. Every
    file is checked here, before any model loads."""
    from opd.data.prompts import eval_prompts, load_tokenizer
    from opd.eval.offline import check_eval_samples

    if not spec.eval.samples_path and not spec.eval.offline:
        return spec
    prompts = eval_prompts(spec.data, load_tokenizer(spec.models.tokenizer), spec.eval.num_prompts)
    if spec.eval.samples_path:
        if _usable(spec, spec.eval.samples_path, prompts):
            return spec
        spec = spec.model_copy(update={"eval": spec.eval.model_copy(update={"samples_path": None})})
    if not spec.eval.offline:
        return spec
    path = str(spec.run_dir.resolve() / "eval_samples.jsonl")
    if Path(path).exists():  # drawn by an earlier run here; made otherwise, it is refused now, not after loading
        check_eval_samples(spec, prompts, path, "eval.samples_path", complete=False)
    if spec.engine == "ray":
        from actors.driver import draw_samples_in_actor

        draw_samples_in_actor(spec, path)
    else:
        from opd.train.evaluator import Evaluator

        Evaluator(spec).draw_samples(path)
    return with_eval_samples(spec, path)


def _usable(spec: ExperimentSpec, samples: str, prompts: list) -> bool:
    """Whether `samples` (`eval.samples_path`) serves this run's eval of `prompts`; when not, a note says why and
    what the run does instead."""
    from opd.eval.offline import check_eval_samples

    try:
        check_eval_samples(spec, prompts, samples, "eval.samples_path")
        return True
    except StaleSamples as exc:
        instead = (f"this run draws its own into {spec.run_dir / 'eval_samples.jsonl'}" if spec.eval.offline
                   else "held-out τ is decoded instead (eval.offline is false)")
        print(f"note: {exc.reason}, so {instead}", file=sys.stderr)
        return False
