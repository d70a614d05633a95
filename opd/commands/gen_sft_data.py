"""`opd gen-sft-data`: the target's responses to the training prompts, i.e. the data `opd sft` trains on.

The rows (`{"id", "prompt_ids", "response_ids"}`) go to RUN_DIR/sft_data.jsonl by default, the very file `opd sft`
reads, so the responses can be made once — with vLLM on a GPU box, far faster than batched HF decoding of a
multi-billion-parameter target — and SFT started from them later. Both engines append as they go and skip the
rows already written, so an interrupted run continues where it stopped, whichever engine started the file.
"""

from __future__ import annotations

import functools
from pathlib import Path

from opd.data.prompts import Prompt, load_tokenizer, train_prompts
from opd.models.build import build_models
from opd.serving.engine import generate, require_vllm, sampling_params, target_llm
from opd.spec import ExperimentSpec
from opd.train.sft import SftExample, append_responses, generate_responses, response_sampling

VLLM_CHUNK = 1024  # prompts per vLLM call: large enough to keep it busy, small enough to lose little on a crash


def run_gen_sft_data(spec: ExperimentSpec, engine: str, out: str | None) -> int:
    """Generate (or finish generating) the SFT responses with `engine` ("hf" or "vllm")."""
    if engine == "vllm":
        require_vllm("opd gen-sft-data --engine vllm")
    default = spec.run_dir / "sft_data.jsonl"
    cache = Path(out) if out else default
    cache.parent.mkdir(parents=True, exist_ok=True)
    if engine == "hf":
        models = build_models(spec, "random")  # the drafter is unused; "random" spares needing a warm one
        examples = generate_responses(spec, models, train_prompts(spec.data, models.tokenizer), cache)
    else:
        examples = vllm_responses(spec, train_prompts(spec.data, load_tokenizer(spec.models.tokenizer)), cache)
    tokens = sum(len(e.response_ids) for e in examples)
    where = "" if cache.resolve() == default.resolve() else f" (`opd sft` reads {default})"
    print(f"{len(examples)} target responses, {tokens} tokens, in {cache}{where}")
    return 0


def vllm_responses(spec: ExperimentSpec, prompts: list[Prompt], cache: Path) -> list[SftExample]:
    """`generate_responses` with vLLM: same rows, same resume rule; the engine starts only if work is left."""
    max_tokens = spec.sft.response_max_new_tokens

    @functools.cache
    def engine():  # built on the first chunk
        return target_llm(spec, max_tokens=max_tokens), sampling_params(response_sampling(spec), max_tokens)

    def generate_chunk(chunk: list[Prompt]) -> list[list[int]]:
        llm, params = engine()
        return generate(llm, [p.ids for p in chunk], params)

    return append_responses(prompts, cache, generate_chunk, VLLM_CHUNK, "sft data (vLLM)")
