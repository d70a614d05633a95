"""The project's autoregressive sampler as a worker of another environment (actors/isolated.py), with the
vLLM worker's `sample` signature: token ids, a sampling dict, seeds and keys in; token ids out."""

from __future__ import annotations

import sys
from typing import Any


class AutoregressiveWorker:
    def __init__(self, spec: dict[str, Any]) -> None:
        from opd.models.build import build_models
        from opd.sources.samplers import build_sampler
        from opd.spec import ExperimentSpec

        parsed = ExperimentSpec.model_validate(spec)
        models = build_models(parsed, "random")
        self.sampler = build_sampler(parsed, "autoregressive", models.target, None, models.eos_id)

    def ready(self) -> bool:
        return True

    def versions(self) -> dict[str, str]:
        import ray
        import torch
        import transformers

        return {"python": sys.executable, "transformers": transformers.__version__, "ray": ray.__version__,
                "torch": torch.__version__}

    def sample(self, prompts: list[list[int]], sampling: dict[str, Any], max_new_tokens: int, seed: int,
               keys: list[int]) -> list[list[int]]:
        from opd.decoding.sampling import Sampling

        return self.sampler(prompts, Sampling(**sampling), max_new_tokens, seed, keys).responses
