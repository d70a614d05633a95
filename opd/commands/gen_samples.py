"""`opd gen-samples`: target samples drawn once into the sample store (opd/sources/store.py), for one of three
readers:
- `rollout` (default): the training prompts at every rollout setting, for `rollout.source: samples`;
- `eval` (`--eval`): held-out prompts at every point-mass eval setting, for offline evaluation;
- `sft` (`--sft`, or `opd gen-sft-data`): one response per training prompt at the SFT setting, for `opd sft`.

Any lossless sampler will do (opd/sources/samplers.py): vLLM on a GPU box, unpatched, is the fast one. Files are
appended to as samples are drawn and skipped where they exist, so an interrupted run continues, and two runs on
one file draw each sample once.
"""

from __future__ import annotations

from pathlib import Path

from opd.commands import launch
from opd.data.prompts import load_tokenizer, spec_prompts, train_prompts
from opd.errors import OpdError
from opd.eval.offline import draw_eval_samples, stale_advice
from opd.models.build import build_models
from opd.progress import progress_bar
from opd.serving.engine import check_vllm
from opd.sources.samplers import TargetSampler, build_sampler
from opd.sources.store import GEN_CHUNK, SampleStore, rollout_draw, wanted
from opd.spec import ExperimentSpec
from opd.train.sft_data import sft_examples, sft_samples_path, sft_store

DEFAULT_ENGINE = {"rollout": None, "eval": None, "sft": "autoregressive"}  # None: rollout.sampler


def run_gen_samples(spec: ExperimentSpec, engine: str | None, count: int, out: str | None, *,
                    purpose: str = "rollout", prompts_file: str | None = None) -> int:
    """Write (or finish) a sample file for `purpose` with the sampler `engine`. Rollout: `count` samples per
    prompt at every sampled rollout setting, one at every greedy one. Eval: one sample of each of eval.num_prompts
    held-out prompts (or of `prompts_file`) at every point-mass eval setting, with the eval's length, seed and keys.
    SFT: one response per training prompt at the SFT setting."""
    if count < 1:
        raise OpdError(f"--samples: {count} (expected at least 1 sample per prompt)")
    path = Path(out or _default_path(spec, purpose))
    path.parent.mkdir(parents=True, exist_ok=True)
    kind = engine or DEFAULT_ENGINE[purpose] or spec.rollout.sampler
    tokenizer, sampler = _sampler(spec, kind)
    if purpose == "eval":
        prompts = spec_prompts(spec.data, prompts_file or spec.data.eval_prompts, tokenizer,
                               spec.eval.num_prompts).prompts
        draw_eval_samples(spec, sampler, prompts, path, field="--out", stale=stale_advice("--out"))
        print(f"held-out target samples ({kind}) of {len(prompts)} prompts in {path}")
        return 0
    prompts = train_prompts(spec.data, tokenizer)
    if purpose == "sft":
        examples = sft_examples(spec, sft_store(spec, prompts, path, field="--out"), prompts, sampler)
        where = "" if path.resolve() == sft_samples_path(spec).resolve() else f" (set sft.samples_path: {path})"
        print(f"{len(examples)} SFT responses ({kind}), {sum(len(e.response_ids) for e in examples)} tokens, "
              f"in {path}{where}")
        return 0
    _draw_rollout_samples(spec, sampler, prompts, path, count)
    return 0


def _default_path(spec: ExperimentSpec, purpose: str) -> Path:
    if purpose == "eval":
        return spec.run_dir / "eval_samples.jsonl"
    if purpose == "sft":
        return sft_samples_path(spec)
    return Path(spec.rollout.samples_path or spec.run_dir / "samples.jsonl")


def _sampler(spec: ExperimentSpec, kind: str) -> tuple[object, TargetSampler]:
    """The tokenizer and the sampler `kind`; vLLM loads its own target, so no model is built here for it."""
    if kind == "vllm":
        command = "opd gen-samples --engine vllm"
        check_vllm(spec, command)
        launch.vllm_workers()
        tokenizer = load_tokenizer(spec.models.tokenizer)
        return tokenizer, build_sampler(spec, kind, None, None, tokenizer.eos_token_id, command)
    models = build_models(spec, "random" if kind == "autoregressive" else None)  # the sampler needs no drafter
    return models.tokenizer, build_sampler(spec, kind, models.target, models.drafter, models.eos_id)


def _draw_rollout_samples(spec: ExperimentSpec, sampler: TargetSampler, prompts: list, path: Path,
                          count: int) -> None:
    store = SampleStore.of(spec, path, spec.rollout.settings, prompts, spec.rollout.max_new_tokens, field="--out")
    draw = rollout_draw(spec, sampler)
    jobs = [wanted(spec, p, s, j) for s in range(len(store.settings)) for j in range(count) for p in prompts]
    jobs = list({(w.prompt.id, w.setting, w.j): w for w in jobs}.values())  # greedy settings: one sample
    with progress_bar() as bar:
        task = bar.add_task("target samples", total=len(jobs))
        for start in range(0, len(jobs), GEN_CHUNK):
            store.fetch(jobs[start : start + GEN_CHUNK], draw)
            bar.update(task, advance=len(jobs[start : start + GEN_CHUNK]))
    print(f"{len(jobs)} target samples of {len(prompts)} prompts in {path}")
