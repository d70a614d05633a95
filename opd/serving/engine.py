"""The trainer's side of vLLM: what to ask a vLLM worker for, in plain data, and the worker itself.

vLLM runs in an environment of its own (opd/serving/vllm_env.py), in a worker (opd/serving/vllm_worker.py) that
actors/isolated.py starts as a Ray actor of that environment's interpreter and registers here (`starts_vllm_workers`),
so opd/ never imports Ray. This module turns the spec and an exported drafter into vLLM's engine arguments and
checks the environment, so every user error comes before a model loads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from typing import Any, Protocol

from opd.decoding.sampling import Sampling
from opd.errors import OpdError
from opd.serving.vllm_env import check_vllm_env
from opd.spec import ExperimentSpec


class EngineWorker(Protocol):
    """A vLLM worker as its callers see it: methods called by name with plain data, and an end."""

    def call(self, method: str, *args: Any) -> Any: ...

    def close(self) -> None: ...


WorkerStart = Callable[[ExperimentSpec, dict, str], EngineWorker]  # (spec, engine arguments, command)
_STARTS: list[WorkerStart] = []


def engine_args(spec: ExperimentSpec, *, max_tokens: int, speculative_config: dict | None = None,
                max_num_seqs: int | None = None, stats: bool = False, tensor_parallel_size: int = 1) -> dict:
    """vLLM's `LLM` arguments for the spec's target (its dtype, tokenizer and seed), optionally speculating with a
    drafter, over `tensor_parallel_size` of the worker's GPUs.

    `max_model_len` is prompt + response budget: otherwise a Qwen3's 40K context sizes the scheduler for nothing.
    `stats` turns on the Prometheus counters τ is read from. Past one GPU, vLLM's ranks are processes of its own
    (the "mp" backend) on the GPUs the worker holds: otherwise vLLM would ask Ray for a GPU bundle per rank.
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
    return kwargs


def sampling_dict(sampling: Sampling) -> dict[str, Any]:
    """The target's sampling as it crosses to the worker (draft sampling is this project's decoder's alone)."""
    return {k: v for k, v in asdict(sampling).items() if k != "sample_drafts"}


def check_vllm(spec: ExperimentSpec, command: str) -> None:
    """The vLLM environment, checked before anything loads: one line for each thing a worker would fail on."""
    check_vllm_env(spec.resources.vllm_python, command)


def starts_vllm_workers(start: WorkerStart) -> WorkerStart:
    """Register how this process starts a vLLM worker (actors/isolated.py: a Ray actor of the vLLM environment)."""
    _STARTS[:] = [start]
    return start


def vllm_worker(spec: ExperimentSpec, engine: dict, command: str) -> EngineWorker:
    """A vLLM engine in the vLLM environment, on `engine`'s tensor-parallel GPUs; the caller has checked the
    environment (`check_vllm`)."""
    if not _STARTS:
        raise OpdError(f"{command}: this process cannot start a vLLM worker (it starts as a Ray actor: run the "
                       "opd command, or import actors.isolated first)")
    return _STARTS[0](spec, engine, command)
