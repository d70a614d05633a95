"""`opd gen-sft-data`: the target's responses to the training prompts, i.e. the data `opd sft` trains on.

The rows (`{"id", "prompt_ids", "response_ids"}`) go to RUN_DIR/sft_data.jsonl by default, the very file `opd sft`
reads, so the responses can be made once — with vLLM on a GPU box, far faster than batched HF decoding of a
multi-billion-parameter target — and SFT started from them later. Both engines append as they go and skip the
rows already written, so an interrupted run continues where it stopped, whichever engine started the file.
"""

from __future__ import annotations

import json
from pathlib import Path

from opd.data import Prompt, load_prompts, load_tokenizer
from opd.models.build import build_models
from opd.progress import progress_bar
from opd.serving.engine import generate, require_vllm, sampling_params, target_llm
from opd.spec import ExperimentSpec
from opd.train.sft import SftExample, generate_responses, response_sampling

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
        examples = generate_responses(spec, models, _train_prompts(spec, models.tokenizer), cache)
    else:
        examples = vllm_responses(spec, _train_prompts(spec, load_tokenizer(spec.models.tokenizer)), cache)
    tokens = sum(len(e.response_ids) for e in examples)
    where = "" if cache.resolve() == default.resolve() else f" (`opd sft` reads {default})"
    print(f"{len(examples)} target responses, {tokens} tokens, in {cache}{where}")
    return 0


def vllm_responses(spec: ExperimentSpec, prompts: list[Prompt], cache: Path) -> list[SftExample]:
    """`generate_responses` with vLLM: same rows, same resume rule (the first len(done) prompts are done)."""
    done = [json.loads(line) for line in cache.read_text().splitlines()] if cache.exists() else []
    todo = prompts[len(done):]
    if todo:
        max_tokens = spec.sft.response_max_new_tokens
        llm = target_llm(spec, max_tokens=max_tokens)
        params = sampling_params(response_sampling(spec), max_tokens)
        with progress_bar() as bar, cache.open("a") as f:
            task = bar.add_task("sft data (vLLM)", total=len(prompts), completed=len(done))
            for i in range(0, len(todo), VLLM_CHUNK):
                chunk = todo[i : i + VLLM_CHUNK]
                for p, response in zip(chunk, generate(llm, [p.ids for p in chunk], params)):
                    row = {"id": p.id, "prompt_ids": p.ids, "response_ids": response}
                    f.write(json.dumps(row) + "\n")
                    done.append(row)
                f.flush()
                bar.update(task, completed=len(done))
    return [SftExample(d["prompt_ids"], d["response_ids"]) for d in done]


def _train_prompts(spec: ExperimentSpec, tokenizer) -> list[Prompt]:
    d = spec.data
    return load_prompts(d.train_prompts, tokenizer, max_prompt_tokens=d.max_prompt_tokens,
                        skip_bad_lines=d.skip_bad_lines).prompts
