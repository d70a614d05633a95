"""The SFT data: one target response to every training prompt, kept in the sample store (opd/sources/store.py).

`opd gen-samples CONFIG --sft` (or its alias `opd gen-sft-data`) draws them, with vLLM on a GPU box far faster than
batched HF decoding of a multi-billion-parameter target; `opd sft` reads them and draws only what the file lacks,
so an interrupted draw continues where it stopped, whichever engine started the file. They live at
`sft.samples_path` (default RUN_DIR/sft_data.jsonl) at one setting, `response_sampling`, with sample 0 of each
prompt keyed as a rollout's epoch 0 and capped at `sft.response_max_new_tokens`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from opd.data.prompts import Prompt
from opd.decoding.sampling import Sampling
from opd.progress import progress_bar
from opd.sources.samplers import TargetSampler
from opd.sources.store import GEN_CHUNK, SampleStore, Wanted, sampler_draw
from opd.spec import ExperimentSpec


@dataclass
class SftExample:
    prompt_ids: list[int]
    response_ids: list[int]


def response_sampling(spec: ExperimentSpec) -> Sampling:
    """sft.response_temperature when set, else the rollout's sampling."""
    r, temperature = spec.rollout, spec.sft.response_temperature
    return Sampling.of(r) if temperature is None else Sampling(temperature, 0, 1.0)


def sft_samples_path(spec: ExperimentSpec) -> Path:
    return Path(spec.sft.samples_path) if spec.sft.samples_path else spec.run_dir / "sft_data.jsonl"


def sft_store(spec: ExperimentSpec, prompts: list[Prompt], path: str | Path | None = None,
              field: str = "sft.samples_path") -> SampleStore:
    """The SFT data of `spec`'s target, rendering and response cap, at `path` (default `sft_samples_path`)."""
    return SampleStore.of(spec, path or sft_samples_path(spec), [response_sampling(spec)], prompts,
                          spec.sft.response_max_new_tokens, field=field, redraw="opd gen-samples CONFIG --sft")


def sft_examples(spec: ExperimentSpec, store: SampleStore, prompts: list[Prompt],
                 sampler: TargetSampler | None = None) -> list[SftExample]:
    """Every prompt's response from `store`; with a `sampler`, the missing ones are drawn and appended first."""
    draw = sampler and sampler_draw(sampler, [response_sampling(spec)], spec.sft.response_max_new_tokens, spec.seed)
    wanted = [Wanted(p, 0, 0) for p in prompts]
    samples = []
    with progress_bar() as bar:
        task = bar.add_task("sft data", total=len(wanted))
        for start in range(0, len(wanted), GEN_CHUNK):
            samples += store.fetch(wanted[start : start + GEN_CHUNK], draw)
            bar.update(task, completed=len(samples))
    return [SftExample(p.ids, s.response) for p, s in zip(prompts, samples)]
