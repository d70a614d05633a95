"""A stand-in `vllm` package implementing the few calls the project's vLLM worker makes (LLM, SamplingParams, the
engine's step loop and its speculative-decoding counters). The `fake_vllm` fixture (tests/helpers/fake_vllm.py)
puts this folder on the path of the vLLM worker's environment, so the worker runs in its own Ray actor exactly as
with vLLM; each engine records what it was asked in a JSON file under $FAKE_VLLM_LOG, which the test reads back.
It encodes the project's reading of vLLM's API, so the tests that use it check the project's code, not vLLM."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from types import SimpleNamespace


def SamplingParams(**kwargs) -> SimpleNamespace:  # noqa: N802 (vLLM's class name)
    return SimpleNamespace(**kwargs)


class FakeEngine:
    """Every step advances each running request by τ tokens; a speculating engine counts one draft per request
    and step with τ − 1 accepted tokens, so the benchmark must report exactly τ."""

    def __init__(self, llm: LLM, speculating: bool, tau: int = 3) -> None:
        self.llm, self.tau, self.speculating = llm, tau if speculating else 1, speculating
        self.running: dict[str, list[int]] = {}
        self.drafts = self.accepted = 0

    def add_request(self, request_id: str, prompt: dict, params) -> None:
        assert isinstance(prompt["prompt_token_ids"], list)
        self.running[request_id] = [0, params.max_tokens]
        self.llm.record["served"].append(prompt["prompt_token_ids"])
        tag = request_id.split("-")[0]
        peak = self.llm.record["peak"]
        peak[tag] = max(peak.get(tag, 0), len(self.running))
        self.llm.save()

    def step(self) -> list:
        outs = []
        for rid, state in list(self.running.items()):
            state[0] = min(state[0] + self.tau, state[1])
            if self.speculating:
                self.drafts, self.accepted = self.drafts + 1, self.accepted + self.tau - 1
            done = state[0] == state[1]
            if done:
                del self.running[rid]
            outs.append(SimpleNamespace(finished=done, outputs=[SimpleNamespace(token_ids=[5] * state[0])]))
        return outs


class LLM:
    def __init__(self, **kwargs) -> None:
        self.path = Path(os.environ["FAKE_VLLM_LOG"]) / f"{time.time_ns()}-{os.getpid()}.json"
        self.record = {"kwargs": kwargs, "calls": [], "peak": {}, "served": []}
        self.llm_engine = FakeEngine(self, kwargs.get("speculative_config") is not None)
        self.save()

    def save(self) -> None:
        self.path.write_text(json.dumps(self.record))

    def generate(self, prompts: list[dict], params, use_tqdm: bool = True) -> list:
        """`params`: one SamplingParams for every prompt, or a list with one per prompt (as vLLM takes)."""
        each = params if isinstance(params, list) else [params] * len(prompts)
        assert len(each) == len(prompts)
        self.record["calls"].append([prompts, [vars(q) for q in each]])
        self.save()
        responses = [(p["prompt_token_ids"][:2] + [9])[: q.max_tokens] for p, q in zip(prompts, each)]
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=r)]) for r in responses]

    def get_metrics(self) -> list:
        e = self.llm_engine
        return [SimpleNamespace(name="vllm:spec_decode_num_drafts", value=e.drafts),
                SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens", value=e.accepted),
                SimpleNamespace(name="vllm:prompt_tokens", value=123)]
