"""Stored target samples (`rollout.source: samples`): the file `opd gen-samples` writes and rollout reads.

A target sample does not depend on the drafter, so it can be drawn once (on vLLM, unpatched) and trained on by any
number of runs: every arm and seed of `opd reproduce`, and every epoch when rollouts are greedy. One jsonl row per
sample:

    {"id": prompt id, "prompt_ids": [...], "response_ids": [...],
     "sampling": {"temperature": T, "top_p": P, "top_k": K}, "sample": j}

Rollout batch i of a run reads, for each of its (prompt, epoch) pairs, sample `epoch` of that prompt at the batch's
setting (`rollout.settings`, i mod their count): the data cursor's order, so a resumed or re-produced batch reads
the same rows. A greedy sample is deterministic, so sample 0 serves every epoch; sampled ones may not repeat (a
repeated sample is not a fresh draw from the target), so the file must hold as many as the step budget reaches.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from opd.data import Prompt, prompt_key
from opd.decoding.sampling import Sampling
from opd.errors import OpdError
from opd.progress import progress_bar
from opd.spec import ExperimentSpec, RolloutSampling

GEN_CHUNK = 64  # prompts per sampler call while writing; the file is flushed after each


def setting_key(setting: RolloutSampling | Sampling | dict) -> tuple[float, float, int]:
    """(temperature, top_p, top_k): how a row's sampling is matched to a batch's."""
    get = setting.get if isinstance(setting, dict) else lambda name: getattr(setting, name)
    return float(get("temperature")), float(get("top_p")), int(get("top_k"))


def describe(key: tuple[float, float, int]) -> str:
    return f"temperature {key[0]:g}, top_p {key[1]:g}, top_k {key[2]}"


def samples_needed(spec: ExperimentSpec, num_prompts: int) -> list[int]:
    """Per rollout setting, how many samples of every prompt the step budget reads: 1 for greedy, else one per
    epoch its batches reach (batch i holds global prompt positions i*size .. (i+1)*size-1; epoch = position // n)."""
    settings, size = spec.rollout.settings, spec.rollout.batch_size
    total = spec.steps * spec.batches_per_step
    out = []
    for s, setting in enumerate(settings):
        last = max((i for i in range(s, total, len(settings))), default=None)
        if setting.temperature == 0 or last is None:
            out.append(1)
        else:
            out.append(((last + 1) * size - 1) // num_prompts + 1)
    return out


class SampleFile:
    """The rows of a sample file, checked against a run's prompts, settings and step budget on load."""

    def __init__(self, spec: ExperimentSpec, prompts: list[Prompt]) -> None:
        self.path = Path(spec.rollout.samples_path)
        self.settings = [setting_key(s) for s in spec.rollout.settings]
        self.rows: dict[tuple[tuple[float, float, int], str, int], list[int]] = {}
        pool = {p.id: p for p in prompts}
        for line_no, row in _rows(self.path):
            key = self._check_row(row, line_no, pool)
            self.rows[(key, row["id"], row["sample"])] = row["response_ids"]
        self._check_counts(samples_needed(spec, len(prompts)), prompts)

    def response(self, prompt: Prompt, setting: int, epoch: int) -> list[int]:
        """The response batch `setting` reads for `prompt` in `epoch` (greedy: sample 0 every epoch)."""
        key = self.settings[setting]
        return self.rows[(key, prompt.id, 0 if key[0] == 0 else epoch)]

    def _check_row(self, row: dict, line_no: int, pool: dict[str, Prompt]) -> tuple[float, float, int]:
        where = f"rollout.samples_path: {self.path} line {line_no}"
        try:
            key = setting_key(row["sampling"])
            ok = isinstance(row["response_ids"], list) and row["response_ids"] and isinstance(row["sample"], int)
        except (KeyError, TypeError, ValueError, AttributeError):
            ok = False
        if not ok:
            raise OpdError(f"{where}: not a sample row (expected id, prompt_ids, response_ids, sampling "
                           "{temperature, top_p, top_k} and sample, as `opd gen-samples` writes)")
        if key not in self.settings:
            wanted = "; ".join(describe(k) for k in self.settings)
            raise OpdError(f"{where}: sampled at {describe(key)}, not a setting of this run's batches "
                           f"(expected {wanted}: rollout and rollout.mix)")
        prompt = pool.get(row["id"])
        if prompt is None:
            raise OpdError(f"{where}: prompt id {row['id']!r} is not in data.train_prompts (expected samples of "
                           "this run's prompt pool)")
        if row.get("prompt_ids") != prompt.ids:
            raise OpdError(f"{where}: prompt {row['id']!r} has other prompt_ids than this run renders (expected the "
                           "same data.render, enable_thinking and tokenizer as the run that drew it)")
        return key

    def _check_counts(self, needed: list[int], prompts: list[Prompt]) -> None:
        for key, count in zip(self.settings, needed):
            for prompt in prompts:
                have = sum((key, prompt.id, j) in self.rows for j in range(count))
                if have < count:
                    rule = "" if key[0] == 0 else "; sampled samples may not repeat across epochs"
                    raise OpdError(f"rollout.samples_path: {self.path} has {have} sample(s) of prompt {prompt.id!r} "
                                   f"at {describe(key)}, but the step budget needs {count} per prompt{rule} "
                                   f"(expected `opd gen-samples --samples {count}`)")


def _rows(path: Path):
    """(line number, parsed row) of every non-empty line, or an OpdError naming the first unreadable one."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise OpdError(f"rollout.samples_path: {path} cannot be read ({exc.strerror}; expected a jsonl file)") from None
    for line_no, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise OpdError(f"rollout.samples_path: {path} line {line_no} is not JSON ({exc.msg})") from None
        if not isinstance(row, dict):
            raise OpdError(f"rollout.samples_path: {path} line {line_no} is not a JSON object")
        yield line_no, row


def write_samples(spec: ExperimentSpec, prompts: list[Prompt], out: Path, count: int,
                  sample: Callable[[list[Prompt], Sampling, int], list[list[int]]]) -> int:
    """Append `count` samples of every prompt at every rollout setting (1 for greedy ones) to `out`, skipping the
    rows it already holds, so an interrupted run continues where it stopped. `sample(prompts, sampling, j)`
    draws sample j (keyed by prompt_key(id, j)). Returns the number of rows the file then holds."""
    done = {(setting_key(r["sampling"]), r["id"], r["sample"]) for _, r in _rows(out)} if out.exists() else set()
    jobs = [(setting, j, p) for setting in spec.rollout.settings
            for j in range(1 if setting.temperature == 0 else count) for p in prompts]
    todo = [job for job in jobs if (setting_key(job[0]), job[2].id, job[1]) not in done]
    with progress_bar() as bar, out.open("a") as f:
        task = bar.add_task("target samples", total=len(jobs), completed=len(jobs) - len(todo))
        for start in range(0, len(todo), GEN_CHUNK):
            part = todo[start : start + GEN_CHUNK]
            for (setting, j), group in _grouped(part):
                for p, response in zip(group, sample(group, Sampling.of(setting), j)):
                    row = {"id": p.id, "prompt_ids": p.ids, "response_ids": response,
                           "sampling": setting.model_dump(), "sample": j}
                    f.write(json.dumps(row) + "\n")
            f.flush()
            bar.update(task, advance=len(part))
    return len(jobs)


def _grouped(jobs: list[tuple[RolloutSampling, int, Prompt]]) -> list[tuple[tuple[RolloutSampling, int], list[Prompt]]]:
    """Consecutive jobs with one (setting, sample) share a sampler call."""
    out: list[tuple[tuple[RolloutSampling, int], list[Prompt]]] = []
    for setting, j, p in jobs:
        if out and out[-1][0] == (setting, j):
            out[-1][1].append(p)
        else:
            out.append(((setting, j), [p]))
    return out


def sample_keys(prompts: list[Prompt], j: int) -> list[int]:
    """The keyed random numbers of sample j: the same key a rollout uses for that prompt in epoch j."""
    return [prompt_key(p.id, j) for p in prompts]


def run_gen_samples(spec: ExperimentSpec, engine: str | None, count: int, out: str | None) -> int:
    """`opd gen-samples`: write (or finish) the sample file of the training prompts with the sampler `engine`."""
    from opd.data import load_tokenizer, train_prompts
    from opd.models.build import build_models
    from opd.serving.engine import require_vllm
    from opd.target_sampler import build_sampler

    if count < 1:
        raise OpdError(f"--samples: {count} (expected at least 1 sample per prompt)")
    kind = engine or spec.rollout.sampler
    path = Path(out or spec.rollout.samples_path or spec.run_dir / "samples.jsonl")
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "vllm":
        require_vllm("opd gen-samples --engine vllm")
        tokenizer, target, drafter = load_tokenizer(spec.models.tokenizer), None, None
    else:
        models = build_models(spec)
        tokenizer, target, drafter = models.tokenizer, models.target, models.drafter
    prompts = train_prompts(spec.data, tokenizer)
    sampler = build_sampler(spec, kind, target, drafter, tokenizer.eos_token_id)

    def sample(group: list[Prompt], sampling: Sampling, j: int) -> list[list[int]]:
        return sampler([p.ids for p in group], sampling, spec.rollout.max_new_tokens, spec.seed,
                       sample_keys(group, j)).responses

    rows = write_samples(spec, prompts, path, count, sample)
    print(f"{rows} target samples ({kind}) of {len(prompts)} prompts in {path}")
    return 0
