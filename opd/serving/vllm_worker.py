"""What runs inside the vLLM environment: vLLM's offline engine behind a boundary of plain lists and dicts.

vLLM pins its own torch and transformers, so it lives in an interpreter of its own (`resources.vllm_python`,
cluster/vllm.lock) and is reached through a Ray actor started with that interpreter (actors/isolated.py).
This module is the only part of the project that interpreter imports: it needs nothing but the standard library
and vLLM, and takes and returns only token ids, sampling settings, seeds and counts. It touches vLLM's public
offline API only (`LLM`, `SamplingParams`, the engine's `add_request`/`step` loop, `LLM.get_metrics()`), so a
vLLM upgrade touches one small file.
"""

from __future__ import annotations

import time
from typing import Any

DRAFTS = "vllm:spec_decode_num_drafts"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
SEED_STRIDE = 1_000_003  # a request's seed is seed * SEED_STRIDE + key: one sample per (seed, key), whatever its batch


class VllmWorker:
    """One vLLM engine, built from `engine` (vLLM's `LLM` keyword arguments, opd/serving/engine.py `engine_args`).

    Every method takes and returns plain data, so the trainer's process needs no vLLM and this one no torch of
    the trainer's."""

    def __init__(self, engine: dict[str, Any]) -> None:
        import vllm

        self.vllm, self.llm = vllm, vllm.LLM(**engine)

    def ready(self) -> bool:
        """Answers once the engine is built (the caller waits on it to report a failed load in one line)."""
        return True

    def sample(self, prompts: list[list[int]], sampling: dict[str, Any], max_new_tokens: int, seed: int,
               keys: list[int]) -> list[list[int]]:
        """Response token ids per prompt, one seeded request each (`keys`: one per prompt), the eos token kept
        when a response stops on it, as the project's own samplers keep it."""
        params = [self._params(sampling, max_new_tokens, seed * SEED_STRIDE + key) for key in keys]
        outputs = self.llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
        return [list(out.outputs[0].token_ids) for out in outputs]

    def serve(self, prompts: list[list[int]], sampling: dict[str, Any], max_tokens: int, concurrency: int,
              tag: str) -> dict[str, float]:
        """Serve every prompt with exactly `concurrency` requests in flight, a new one entering as each finishes
        (what a fixed-concurrency serving client does). Returns output tokens, wall seconds, and the drafts and
        accepted draft tokens over this call (the engine's counters are cumulative over its life)."""
        params = self._params(sampling, max_tokens, None)
        drafts0, accepted0 = self._counts()
        engine, todo = self.llm.llm_engine, iter(enumerate(prompts))
        in_flight = tokens = 0
        start = time.perf_counter()
        while True:
            while in_flight < concurrency and (item := next(todo, None)) is not None:
                engine.add_request(f"{tag}-{item[0]}", {"prompt_token_ids": item[1]}, params)
                in_flight += 1
            if not in_flight:
                break
            for out in engine.step():
                if out.finished:
                    in_flight -= 1
                    tokens += len(out.outputs[0].token_ids)
        seconds = time.perf_counter() - start
        drafts, accepted = self._counts()
        return {"tokens": tokens, "seconds": seconds, "drafts": drafts - drafts0, "accepted": accepted - accepted0}

    def _params(self, sampling: dict[str, Any], max_tokens: int, seed: int | None) -> Any:
        """The project's sampling as vLLM's: top_k 0 (off) is vLLM's -1, which every vLLM version accepts."""
        return self.vllm.SamplingParams(temperature=sampling["temperature"], top_p=sampling["top_p"],
                                        top_k=sampling["top_k"] or -1, max_tokens=max_tokens, seed=seed)

    def _counts(self) -> tuple[float, float]:
        """(drafts, accepted draft tokens) so far, from the engine's Prometheus counters."""
        totals = {DRAFTS: 0.0, ACCEPTED: 0.0}
        for metric in self.llm.get_metrics():
            if metric.name in totals:
                totals[metric.name] += metric.value
        return totals[DRAFTS], totals[ACCEPTED]
