"""`opd gen-samples`: target samples drawn once and kept, for `rollout.source: samples` (training prompts at every
rollout setting) or offline evaluation (`--eval`: held-out prompts at every point-mass eval setting).

Any lossless sampler will do (opd/sources/samplers.py): vLLM on a GPU box, unpatched, is the fast one. Files are
appended to as samples are drawn and skipped where they exist, so an interrupted run continues, and two runs on
one file draw each sample once (opd/sources/store.py).
"""

from __future__ import annotations

from pathlib import Path

from opd.data.prompts import load_tokenizer, spec_prompts, train_prompts
from opd.errors import OpdError
from opd.eval.offline import draw_eval_samples
from opd.models.build import build_models
from opd.progress import progress_bar
from opd.serving.engine import require_vllm
from opd.sources.samplers import build_sampler
from opd.sources.store import GEN_CHUNK, SampleStore, rollout_draw, wanted
from opd.spec import ExperimentSpec


def run_gen_samples(spec: ExperimentSpec, engine: str | None, count: int, out: str | None, *,
                    held_out: bool = False, prompts_file: str | None = None) -> int:
    """`opd gen-samples`: write (or finish) a sample file with the sampler `engine`. Training prompts: `count`
    samples per prompt at every sampled rollout setting, one at every greedy one. `held_out`: one sample of each of
    eval.num_prompts held-out prompts (or of `prompts_file`) at every point-mass eval setting, with the eval's
    length, seed and keys, for offline evaluation (opd/eval/offline.py)."""
    if count < 1:
        raise OpdError(f"--samples: {count} (expected at least 1 sample per prompt)")
    kind = engine or spec.rollout.sampler
    default = spec.run_dir / ("eval_samples.jsonl" if held_out else "samples.jsonl")
    path = Path(out or (None if held_out else spec.rollout.samples_path) or default)
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "vllm":
        require_vllm("opd gen-samples --engine vllm")
        tokenizer, target, drafter = load_tokenizer(spec.models.tokenizer), None, None
    else:
        models = build_models(spec)
        tokenizer, target, drafter = models.tokenizer, models.target, models.drafter
    sampler = build_sampler(spec, kind, target, drafter, tokenizer.eos_token_id)
    if held_out:
        prompts = spec_prompts(spec.data, prompts_file or spec.data.eval_prompts, tokenizer,
                               spec.eval.num_prompts).prompts
        draw_eval_samples(spec, sampler, prompts, path)
        print(f"held-out target samples ({kind}) of {len(prompts)} prompts in {path}")
        return 0
    prompts = train_prompts(spec.data, tokenizer)
    store = SampleStore(path, spec.rollout.settings, prompts, field="--out")
    draw = rollout_draw(spec, sampler)
    jobs = [wanted(spec, p, s, j) for s in range(len(store.settings)) for j in range(count) for p in prompts]
    jobs = list({(w.prompt.id, w.setting, w.j): w for w in jobs}.values())  # greedy settings: one sample
    with progress_bar() as bar:
        task = bar.add_task("target samples", total=len(jobs))
        for start in range(0, len(jobs), GEN_CHUNK):
            store.fetch(jobs[start : start + GEN_CHUNK], draw)
            bar.update(task, advance=len(jobs[start : start + GEN_CHUNK]))
    print(f"{len(jobs)} target samples ({kind}) of {len(prompts)} prompts in {path}")
    return 0
