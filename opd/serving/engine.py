"""The one module that talks to vLLM, through its public offline API only (`LLM`, `SamplingParams`, the engine's
`add_request`/`step` loop, `LLM.get_metrics()`), so a vLLM upgrade touches one small file.

vLLM is the `[gpu]` extra: it pins its own CUDA torch and transformers and has no CPU build, so it is imported
lazily and a missing install is a one-line user error, never a traceback.
"""

from __future__ import annotations

import gc
import time
from typing import Any

from opd.decoding.sampling import Sampling
from opd.errors import OpdError
from opd.model_dir import ModelDir
from opd.models.families import detect
from opd.spec import ExperimentSpec

DRAFTS = "vllm:spec_decode_num_drafts"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"


def require_vllm(command: str) -> Any:
    """The `vllm` module, or an OpdError naming the install command (checked before any model is loaded)."""
    try:
        import vllm
    except ImportError as exc:
        raise OpdError(f"{command} needs vLLM ({exc}): pip install -e .[gpu] on a CUDA machine") from None
    return vllm


def target_llm(spec: ExperimentSpec, *, max_tokens: int, speculative_config: dict | None = None,
               max_num_seqs: int | None = None, stats: bool = False, tensor_parallel_size: int = 1) -> Any:
    """A vLLM engine for the spec's target (its dtype, tokenizer and seed), optionally speculating with a drafter,
    over `tensor_parallel_size` of this process's GPUs.

    `max_model_len` is prompt + response budget: otherwise a Qwen3's 40K context sizes the scheduler for nothing.
    `stats` turns on the Prometheus counters that `spec_decode_counts` reads. Past one GPU, vLLM's ranks are
    processes of its own (the "mp" backend) on the GPUs this process sees: inside a Ray actor vLLM would otherwise
    ask Ray for a GPU bundle per rank, while the actor already holds them all (actors/driver.py `placed_rollout`).
    """
    m = spec.models
    kwargs: dict[str, Any] = dict(model=m.target_path, tokenizer=m.tokenizer, dtype=m.dtype, seed=spec.seed,
                                  max_model_len=spec.data.max_prompt_tokens + max_tokens,
                                  disable_log_stats=not stats, tensor_parallel_size=tensor_parallel_size)
    if tensor_parallel_size > 1:
        kwargs["distributed_executor_backend"] = "mp"
    if speculative_config is not None:
        kwargs["speculative_config"] = speculative_config
    if max_num_seqs is not None:
        kwargs["max_num_seqs"] = max_num_seqs
    return require_vllm("vLLM serving").LLM(**kwargs)


def speculative_config(drafter_dir: str, block_size: int) -> dict:
    """vLLM's speculative config for an exported drafter of any family, as its config.json says, so callers never
    ask which family they serve; every family drafts block_size − 1 tokens per step."""
    directory = ModelDir.read(drafter_dir, "drafter")
    return detect(directory).vllm_config(directory, block_size)


def sampling_params(sampling: Sampling, max_tokens: int, seed: int | None = None) -> Any:
    """Our sampling as vLLM's (our top_k 0 = off is vLLM's -1, which every vLLM version accepts); `seed` makes
    one request's sample reproducible whatever it is batched with."""
    return require_vllm("vLLM serving").SamplingParams(
        temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k or -1, max_tokens=max_tokens,
        seed=seed)


def generate(llm: Any, prompts: list[list[int]], params: Any) -> list[list[int]]:
    """Response token ids per prompt (`params`: one SamplingParams for all, or one per prompt), prompts passed as
    token ids so vLLM sees exactly what the HF path sees.

    vLLM keeps the eos token in `token_ids` when it stops on it, as `generate_autoregressive` does.
    """
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    return [list(out.outputs[0].token_ids) for out in outputs]


def serve_closed_loop(llm: Any, prompts: list[list[int]], params: Any, concurrency: int, tag: str) -> tuple[int, float]:
    """Serve every prompt with exactly `concurrency` requests in flight, a new one entering as each finishes
    (what a fixed-concurrency serving client does); returns (output tokens, wall seconds).

    One engine thus covers every concurrency level: `max_num_seqs` would need an engine per level.
    """
    engine, todo = llm.llm_engine, iter(enumerate(prompts))
    in_flight = tokens = 0
    start = time.perf_counter()
    while True:
        while in_flight < concurrency and (item := next(todo, None)) is not None:
            engine.add_request(f"{tag}-{item[0]}", {"prompt_token_ids": item[1]}, params)
            in_flight += 1
        if not in_flight:
            return tokens, time.perf_counter() - start
        for out in engine.step():
            if out.finished:
                in_flight -= 1
                tokens += len(out.outputs[0].token_ids)


def spec_decode_counts(llm: Any) -> tuple[float, float]:
    """(drafts, accepted draft tokens) so far; over an interval τ = 1 + Δaccepted / Δdrafts."""
    totals = {DRAFTS: 0.0, ACCEPTED: 0.0}
    for metric in llm.get_metrics():
        if metric.name in totals:
            totals[metric.name] += metric.value
    return totals[DRAFTS], totals[ACCEPTED]


def release_gpu_memory() -> None:
    """Free a dropped engine's GPU memory before the next one is made (vLLM's own tests do this)."""
    gc.collect()
    from vllm.distributed import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()
