"""Up-front checks of a run's inputs, in the driver, before any actor or model starts.

A bad prompt line or a truncated checkpoint found inside a Ray actor's constructor surfaces as pages of actor
output, minutes in; found here it is one `OpdError` line in seconds. The checks read what is cheap to read even
for a Qwen3-sized run on a CPU-only head node: the tokenizer, every prompt, the configs, and the safetensors
headers (which safetensors checks against the file's length, so a truncated file is caught without reading the
weights). `opd validate`, `opd train` and `opd run` all call `check_inputs`.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from opd.data import Prompt, eval_prompts, load_tokenizer, mask_token_id, train_prompts
from opd.errors import OpdError
from opd.samples import SampleStore
from opd.spec import ExperimentSpec


def check_inputs(spec: ExperimentSpec) -> Prompt:
    """Raise OpdError naming the first unusable input: tokenizer, prompt files (every row rendered as the target
    will see it, its length checked), target, warm drafter or sample file. Returns the first training prompt as
    rendered."""
    m = spec.models
    no_gpu = [role for role in ("learner", "scorer", "rollout") if not getattr(spec.resources, role).num_gpus]
    if m.device == "cuda" and spec.engine == "ray" and no_gpu:
        raise OpdError(f"models.device: cuda but resources.{no_gpu[0]}.num_gpus is 0, so that actor sees no GPU "
                       f"(expected auto, or GPUs for every role)")
    tokenizer = load_tokenizer(m.tokenizer)
    target = check_target(m.target_path, m.layer_ids or [])
    if len(tokenizer) > target.vocab_size:
        raise OpdError(f"tokenizer {m.tokenizer}: {len(tokenizer)} tokens but the target's vocabulary has "
                       f"{target.vocab_size} (expected a tokenizer that fits the target)")
    if m.drafter_path is None:
        mask_token_id(tokenizer, m.drafter.mask_token_id)  # a random drafter takes the tokenizer's mask token
    else:
        check_drafter(m.drafter_path, target)
    prompts = train_prompts(spec.data, tokenizer)
    eval_prompts(spec.data, tokenizer, spec.eval.num_prompts)
    if spec.rollout.source == "samples":
        SampleStore.for_rollout(spec, prompts).check_budget(spec)  # prompt ids and enough samples for the step budget
    return prompts[0]


def check_target(path: str, layer_ids: list[int]) -> SimpleNamespace:
    """The target's shape from its config.json (what a drafter must fit), after checking its weight files."""
    config = _json(Path(path) / "config.json", "target model")
    try:
        shape = SimpleNamespace(hidden_size=int(config["hidden_size"]), vocab_size=int(config["vocab_size"]),
                                num_layers=int(config["num_hidden_layers"]), layer_ids=layer_ids)
    except (KeyError, TypeError, ValueError) as exc:
        raise OpdError(f"target model {path}/config.json: field {exc} missing or not an integer") from None
    index = Path(path) / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(_json(index, "target model").get("weight_map", {}).values()))
        for shard in shards:
            check_safetensors(Path(path) / shard)
    elif (Path(path) / "model.safetensors").is_file():
        check_safetensors(Path(path) / "model.safetensors")
    return shape


def check_drafter(path: str, target: SimpleNamespace) -> None:
    """The warm drafter fits the target: config, tensor names and shapes, read from the header only (a drafter
    built on the meta device gives the expected shapes without allocating them)."""
    import torch
    from torch import nn

    from opd.models.dflash_format import CONFIG_FILE, SHARED_TENSOR_SUFFIXES, WEIGHTS_FILE, read_config
    from opd.models.drafter import DFlashDrafter

    if not (Path(path) / CONFIG_FILE).is_file():
        raise OpdError(f"drafter: {path}/config.json not found (expected a DFlash drafter directory or 'random')")
    config = read_config(Path(path) / CONFIG_FILE, target)
    with torch.device("meta"):
        shared = nn.Embedding(config.vocab_size, config.hidden_size), nn.Linear(config.hidden_size,
                                                                                 config.vocab_size, bias=False)
        expected = {k: tuple(v.shape) for k, v in DFlashDrafter(config, *shared).state_dict().items()}
    weights = Path(path) / WEIGHTS_FILE
    if not weights.is_file():
        raise OpdError(f"{weights}: drafter weights not found")
    found = {k: v for k, v in check_safetensors(weights).items() if not k.endswith(SHARED_TENSOR_SUFFIXES)}
    for problem, names in (("missing", expected.keys() - found.keys()), ("unexpected", found.keys() - expected.keys())):
        if names:
            raise OpdError(f"{weights}: {problem} tensor(s) {', '.join(sorted(names)[:5])}")
    for name, shape in expected.items():
        if found[name] != shape:
            raise OpdError(f"{weights}: tensor {name} has shape {list(found[name])}, expected {list(shape)}")


def check_safetensors(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from a safetensors header; a truncated or corrupt file raises OpdError."""
    from safetensors import SafetensorError, safe_open

    if not path.is_file():
        raise OpdError(f"{path}: weights file not found (expected it next to config.json)")
    try:
        with safe_open(str(path), framework="pt") as f:
            return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    except (SafetensorError, OSError) as exc:
        raise OpdError(f"{path}: unreadable safetensors file ({exc})") from None


def _json(path: Path, what: str) -> dict:
    if not path.is_file():
        raise OpdError(f"{what}: {path} not found (expected a local HF model directory)")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise OpdError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise OpdError(f"{path}: expected a JSON object")
    return data
