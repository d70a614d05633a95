"""`opd serve-bench`: the exported drafters in a real serving engine (vLLM, `method: dflash`, `eagle3`, `mtp`, ...).

An MTP head exported into its target's layout (`opd export --to target`) is a target directory: with
`models.drafter.kind: mtp` in the spec it is served as the model itself, its head drafting (vLLM's `method: mtp`).

`opd eval` measures τ and speedup in this project's own decoder; what a deployment gets is decided by the
serving engine, where batching across requests eats into the speculative speedup as concurrency grows. So each
drafter is served with the spec's target over the held-out prompts (data.eval_prompts, eval.num_prompts of them,
eval.max_new_tokens each, sampled as eval.sampling's first setting) at every concurrency level, with the plain
target as the baseline, and the table reports output tokens/s, τ from vLLM's acceptance counters, and speedup.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from opd.commands import launch
from opd.commands.preflight import target_shape
from opd.data.prompts import eval_prompts, load_tokenizer
from opd.decoding.sampling import Sampling
from opd.errors import OpdError
from opd.model_dir import ModelDir
from opd.models.family import DrafterFamily
from opd.models.registry import detect, family
from opd.outputs import check_output_file, write_text_atomic
from opd.progress import progress_bar, table_console
from opd.serving.engine import check_vllm, engine_args, sampling_dict, vllm_worker
from opd.spec import ExperimentSpec

BASELINE = "target only"


@dataclass
class ServeRow:
    drafter: str  # a drafter directory, or BASELINE
    concurrency: int
    requests: int
    output_tokens: int
    seconds: float
    tokens_per_s: float
    tau: float | None  # 1 + accepted / drafts from vLLM's counters; None for the baseline
    speedup: float | None  # tokens/s over the baseline's at the same concurrency


def parse_concurrency(text: str) -> list[int]:
    """"1,4,8" -> [1, 4, 8]; anything but distinct positive integers is a one-line error."""
    try:
        levels = [int(part) for part in text.split(",")]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1 or len(set(levels)) != len(levels):
        raise OpdError(f"--concurrency {text!r}: expected distinct positive integers separated by commas, e.g. 1,4,8")
    return levels


def draft_family(directory: ModelDir, spec: ExperimentSpec) -> DrafterFamily:
    """The family of a `--draft` directory: its config's; for a target directory (a head exported into its target's
    layout, `opd export --to target`), the spec's drafter kind where that family is written into a target."""
    kind = spec.models.drafter.kind
    if directory.kind.layout == "target" and family(kind).lives_in_target:
        return family(kind)
    directory.expect("drafter", "--draft")  # the target given as a drafter: its own line, naming the flag
    return detect(directory)


def drafter_block_size(path: str, spec: ExperimentSpec) -> int:
    """Check an exported drafter directory of any family up front (a one-line error beats a vLLM traceback minutes
    into loading) and return its block size."""
    try:
        directory = ModelDir.read(path, "drafter")
    except OpdError as exc:
        raise OpdError(f"--draft {path}: {exc}") from None
    found = draft_family(directory, spec)
    try:
        target_dir = ModelDir.find(spec.models.target_path, "target model")
        target = target_shape(target_dir, []) if target_dir is not None else None
        return found.served_block_size(directory, target, spec.models.drafter)
    except OpdError as exc:
        raise OpdError(f"--draft {path}: {exc}") from None


def served_config(path: str, spec: ExperimentSpec) -> dict:
    """vLLM's speculative config for a checked `--draft` directory (`drafter_block_size`)."""
    block_size = drafter_block_size(path, spec)
    directory = ModelDir.read(path, "drafter")
    return draft_family(directory, spec).vllm_config(directory, block_size)


def run_serve_bench(spec: ExperimentSpec, drafts: list[str], concurrency: str, json_out: str | None,
                    baseline: bool = True) -> int:
    """Check the arguments and drafters, then serve and report; every user error comes before vLLM starts."""
    levels = parse_concurrency(concurrency)
    if json_out:
        check_output_file(json_out, "--json", "the results")
    engines: dict[str, dict | None] = {d: served_config(d, spec) for d in drafts}
    check_vllm(spec, "opd serve-bench")
    launch.vllm_workers()
    if baseline:  # the target alone: no speculative config
        engines = {BASELINE: None, **engines}
    e = spec.eval
    prompts = eval_prompts(spec.data, load_tokenizer(spec.models.tokenizer), e.num_prompts)
    setting = e.sampling[0]
    sampling = Sampling.of(setting)
    rows: list[ServeRow] = []
    with progress_bar() as bar:
        for name, config in engines.items():
            task = bar.add_task(f"serve {Path(name).name}", total=len(levels))
            rows += _serve(spec, name, config, [p.ids for p in prompts], sampling, levels, lambda: bar.advance(task))
    base = {r.concurrency: r.tokens_per_s for r in rows if r.drafter == BASELINE}
    for r in rows:
        r.speedup = r.tokens_per_s / base[r.concurrency] if base and r.drafter != BASELINE else None
    title = (f"vLLM serving: {spec.models.target_path}, {len(prompts)} prompts x {e.max_new_tokens} new tokens, "
             f"sampling {setting.name}")
    print_rows(rows, title)
    if json_out:
        write_text_atomic(json_out, json.dumps({
            "target": spec.models.target_path, "prompts": len(prompts), "max_new_tokens": e.max_new_tokens,
            "sampling": setting.model_dump(), "rows": [asdict(r) for r in rows]}, indent=2) + "\n")
    return 0


def _serve(spec: ExperimentSpec, name: str, config: dict | None, prompts: list[list[int]], sampling: Sampling,
           levels: list[int], tick: Callable[[], None]) -> list[ServeRow]:
    """Every concurrency level on one engine, in a vLLM worker of its own that ends on return, freeing its GPU
    memory for the next engine."""
    max_tokens = spec.eval.max_new_tokens
    engine = engine_args(spec, max_tokens=max_tokens, speculative_config=config, max_num_seqs=max(levels), stats=True)
    if config is not None and "model" not in config:  # a head in its target's layout: that directory is served
        engine["model"] = name
    worker = vllm_worker(spec, engine, "opd serve-bench")
    try:
        target = sampling_dict(sampling)
        worker.call("serve", prompts[: max(levels)], target, 8, max(levels), "warmup")
        rows = []
        for c in levels:
            done = worker.call("serve", prompts, target, max_tokens, c, f"c{c}")
            tau = 1 + done["accepted"] / done["drafts"] if config is not None and done["drafts"] else None
            rows.append(ServeRow(name, c, len(prompts), done["tokens"], done["seconds"],
                                 done["tokens"] / done["seconds"], tau, None))
            tick()
        return rows
    finally:
        worker.close()


def print_rows(rows: list[ServeRow], title: str, console: Console | None = None) -> None:
    console = console or table_console()
    table = Table(title=title)
    for column in ("drafter", "concurrency", "requests", "output tokens", "s", "tok/s", "τ", "speedup"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(r.drafter, str(r.concurrency), str(r.requests), str(r.output_tokens), f"{r.seconds:.1f}",
                      f"{r.tokens_per_s:.1f}", "-" if r.tau is None else f"{r.tau:.3f}",
                      "-" if r.speedup is None else f"{r.speedup:.2f}x")
    console.print(table)
    console.print("τ = 1 + accepted / drafts (vLLM's spec-decode counters); speedup: tokens/s over "
                                 "the target alone at the same concurrency.")
