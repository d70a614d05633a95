"""A stand-in `vllm` module implementing the few calls the project makes (LLM, SamplingParams, the engine's step
loop and its speculative-decoding counters), installed in sys.modules by the `fake_vllm` fixture. It encodes the
project's reading of vLLM's API, so the tests that use it check the project's code, not vLLM."""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pytest


class FakeEngine:
    """Every step advances each running request by τ tokens; a speculating engine counts one draft per request
    and step with τ − 1 accepted tokens, so the benchmark must report exactly τ."""

    def __init__(self, speculating: bool, tau: int = 3) -> None:
        self.tau = tau if speculating else 1
        self.speculating = speculating
        self.running: dict[str, list[int]] = {}
        self.peak: dict[str, int] = {}  # most requests in flight per request-id prefix (one per level)
        self.drafts = self.accepted = 0

    def add_request(self, request_id: str, prompt: dict, params) -> None:
        assert isinstance(prompt["prompt_token_ids"], list)
        self.running[request_id] = [0, params.max_tokens]
        tag = request_id.split("-")[0]
        self.peak[tag] = max(self.peak.get(tag, 0), len(self.running))

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


class FakeLLM:
    made: list[FakeLLM] = []

    def __init__(self, **kwargs) -> None:
        self.kwargs, self.calls = kwargs, []
        self.llm_engine = FakeEngine(kwargs.get("speculative_config") is not None)
        FakeLLM.made.append(self)

    def generate(self, prompts: list[dict], params, use_tqdm: bool = True) -> list:
        """`params`: one SamplingParams for every prompt, or a list with one per prompt (as vLLM takes)."""
        self.calls.append((prompts, params))
        each = params if isinstance(params, list) else [params] * len(prompts)
        assert len(each) == len(prompts)
        responses = [(p["prompt_token_ids"][:2] + [9])[: q.max_tokens] for p, q in zip(prompts, each)]
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=r)]) for r in responses]

    def get_metrics(self) -> list:
        e = self.llm_engine
        return [SimpleNamespace(name="vllm:spec_decode_num_drafts", value=e.drafts),
                SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens", value=e.accepted),
                SimpleNamespace(name="vllm:prompt_tokens", value=123)]


@pytest.fixture
def fake_vllm(monkeypatch) -> type[FakeLLM]:
    vllm = types.ModuleType("vllm")
    vllm.LLM, vllm.SamplingParams = FakeLLM, lambda **kw: SimpleNamespace(**kw)
    distributed = types.ModuleType("vllm.distributed")
    distributed.cleanup_dist_env_and_memory = lambda: None
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.distributed", distributed)
    monkeypatch.setattr(FakeLLM, "made", [])
    return FakeLLM
