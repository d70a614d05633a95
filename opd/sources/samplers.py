"""Lossless samplers of the target: what a rebuilt rollout (`rollout.source: target`) and `opd gen-samples` draw
responses with.

Any sampler whose output is distributed as the target's own sampling will do, because the scorer rebuilds the
blocks from the text (opd/sources/rebuild.py). Three are offered, chosen by `rollout.sampler`:
- `speculative`: this project's speculative decoder with the warm drafter, never updated. Lossless whatever the
  drafter, and on a CPU the fastest (bench/results/rollout.json: `cpu`, the rollout seconds per batch of its
  `target (...)` rows).
- `autoregressive`: plain batched decoding with a KV cache, the simplest reference.
- `vllm`: vLLM's sampling on a GPU, unpatched, in vLLM's own environment (`resources.vllm_python`).

Every one samples with keyed random numbers per (seed, key) where it can (vLLM: one seed per request), so a
sample depends on its prompt and key, not on its batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from opd.decoding.autoregressive import generate_autoregressive
from opd.decoding.sampling import Sampling
from opd.decoding.speculative import SpeculativeDecoder
from opd.models.flops import DrafterParams, FlopCounter, TargetParams, decode_flops, sample_flops
from opd.models.protocol import Drafter
from opd.models.target import Target
from opd.spec import ExperimentSpec

if TYPE_CHECKING:
    from opd.serving.engine import EngineWorker


@dataclass
class Samples:
    """Responses, in prompt order, and what drawing each cost (so a stored sample carries its own cost)."""

    responses: list[list[int]]
    flops: list[FlopCounter]


# (prompts, sampling, max_new_tokens, seed, keys) -> Samples
TargetSampler = Callable[[list[list[int]], Sampling, int, int, list[int]], Samples]


def build_sampler(spec: ExperimentSpec, kind: str, target: Target | None, drafter: Drafter | None,
                  eos_id: int, command: str = "rollout.sampler vllm") -> TargetSampler:
    """The sampler `kind` ("speculative", "autoregressive" or "vllm"); vLLM loads its own copy of the target on
    the first call, so `target` may be None for it, and `command` names what uses it in a refusal."""
    if kind == "vllm":
        return _VllmSampler(spec, command)
    assert target is not None  # only vLLM goes without one
    if kind == "autoregressive":
        return _AutoregressiveSampler(target, eos_id)
    assert drafter is not None  # the speculative sampler's warm drafter
    return _SpeculativeSampler(target, drafter, eos_id, spec.rollout.static_cache, spec.rollout.compile)


class _SpeculativeSampler:
    def __init__(self, target: Target, drafter: Drafter, eos_id: int, static_cache: bool, compiled: bool) -> None:
        self.decoder = SpeculativeDecoder(target, drafter, eos_id=eos_id, static_cache=static_cache, compiled=compiled)
        self.target_params, self.drafter_params = TargetParams.of(target.model), DrafterParams.of(drafter)

    def __call__(self, prompts, sampling, max_new_tokens, seed, keys) -> Samples:
        records = self.decoder.generate(prompts, sampling, max_new_tokens=max_new_tokens, seed=seed, keys=keys)
        return Samples([rec.response_ids for rec in records],
                       [decode_flops([rec], self.target_params, self.drafter_params) for rec in records])


def _params_from_config(path: str) -> TargetParams:
    """The target's parameter counts from its config alone (a meta-device model: no weights read)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return TargetParams.of(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path)))


class _AutoregressiveSampler:
    def __init__(self, target: Target, eos_id: int) -> None:
        self.target, self.eos_id = target, eos_id
        self.params = TargetParams.of(target.model)

    def __call__(self, prompts, sampling, max_new_tokens, seed, keys) -> Samples:
        responses = generate_autoregressive(self.target, prompts, sampling, max_new_tokens=max_new_tokens,
                                            eos_id=self.eos_id, seed=seed, keys=keys)
        return Samples(responses, [sample_flops(self.params, len(p), len(r), prefill_logits=True)
                                   for p, r in zip(prompts, responses)])


class _VllmSampler:
    """vLLM's plain sampling, in a vLLM worker of its own environment (opd/serving/engine.py) holding its own copy
    of the target, started on the first call, tensor-parallel over `resources.rollout.gpus_per_replica` GPUs
    (vLLM's own ranks). Only token ids, sampling settings and seeds cross to it. FLOPs are counted here from the
    target's config as for the autoregressive sampler, but with logits only at the sampled positions."""

    def __init__(self, spec: ExperimentSpec, command: str) -> None:
        self.spec, self.command = spec, command
        self.worker: EngineWorker | None = None  # started on the first call
        self.params: TargetParams | None = None  # read from the target's config on the first call

    def __call__(self, prompts, sampling, max_new_tokens, seed, keys) -> Samples:
        from opd.serving.engine import engine_args, sampling_dict, vllm_worker

        if self.worker is None:
            engine = engine_args(self.spec, max_tokens=max_new_tokens,
                                 tensor_parallel_size=self.spec.resources.rollout.gpus_per_replica)
            self.worker = vllm_worker(self.spec, engine, self.command)
            self.params = _params_from_config(self.spec.models.target_path)
        responses = self.worker.call("sample", prompts, sampling_dict(sampling), max_new_tokens, seed, keys)
        assert self.params is not None
        return Samples(responses, [sample_flops(self.params, len(p), len(r), prefill_logits=False)
                                   for p, r in zip(prompts, responses)])
