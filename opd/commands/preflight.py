"""Up-front checks of a run's inputs, in the driver, before any actor or model starts.

A bad prompt line or a truncated checkpoint found inside a Ray actor's constructor surfaces as pages of actor
output, minutes in; found here it is one `OpdError` line in seconds. The checks read what is cheap to read even
for a Qwen3-sized run on a CPU-only head node: the tokenizer, every prompt, the configs, and the safetensors
headers (which safetensors checks against the file's length, so a truncated file is caught without reading the
weights). A target whose layer kinds nothing here runs exactly (chunked attention, ...) is refused from its
config.json alone. `opd validate`, `opd train` and `opd run` all call `check_inputs`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

from opd.data.prompts import Prompt, eval_prompts, load_tokenizer, mask_token_id, train_prompts
from opd.data.render import Rendering
from opd.data.suite import built_suite, scored_settings, suite_inputs, target_context
from opd.errors import OpdError
from opd.sources.store import SampleStore
from opd.spec import ExperimentSpec


def check_inputs(spec: ExperimentSpec) -> Prompt:
    """Raise OpdError naming the first unusable input: tokenizer, prompt files (every row rendered as the target
    will see it, its length checked), target, warm drafter, sample file or benchmark suite. Returns the first
    training prompt as rendered."""
    m = spec.models
    no_gpu = [role for role in ("learner", "scorer", "rollout") if not getattr(spec.resources, role).num_gpus]
    if m.device == "cuda" and spec.engine == "ray" and no_gpu:
        raise OpdError(f"models.device: cuda but resources.{no_gpu[0]}.num_gpus is 0, so that actor sees no GPU "
                       f"(expected auto, or GPUs for every role)")
    tokenizer = load_tokenizer(m.tokenizer)
    target = check_target(m.target_path, m.layer_ids or [])
    check_layer_kinds_of(m.target_path)
    if len(tokenizer) > target.vocab_size:
        raise OpdError(f"tokenizer {m.tokenizer}: {len(tokenizer)} tokens but the target's vocabulary has "
                       f"{target.vocab_size} (expected a tokenizer that fits the target)")
    if m.drafter_path is None:
        if m.drafter.kind == "dflash":  # a random DFlash drafter takes the tokenizer's mask token; EAGLE-3 has none
            mask_token_id(tokenizer, m.drafter.mask_token_id)
        if m.drafter.dflash2:
            from opd.models.dflash_format import check_dflash2_fields

            check_dflash2_fields(m.drafter.dflash2, target.hidden_size, target.vocab_size, "models.drafter.{}")
    else:
        check_drafter(m.drafter_path, target, m.drafter.block_size)
        check_selector_term(spec)
    prompts = train_prompts(spec.data, tokenizer)
    eval_prompts(spec.data, tokenizer, spec.eval.num_prompts)
    if spec.rollout.source == "samples":
        SampleStore.for_rollout(spec, prompts).check_budget(spec)  # prompt ids and enough samples for the step budget
    if spec.eval.suite is not None:
        check_suite(spec, tokenizer)
    return prompts[0]


def check_suite(spec: ExperimentSpec, tokenizer) -> None:
    """`eval.suite` is a finished build, scored at a point-mass setting, and every prompt of it parses, renders and
    fits the target's context with its answer: found after training, any of these would cost a cluster run its
    table hours in."""
    suite = Path(spec.eval.suite)
    scored_settings(spec.eval.sampling)
    suite_inputs(built_suite(suite, field="eval.suite:"), suite, tokenizer, Rendering.of(spec.data),
                 target_context(spec.models.target_path), "eval.suite:")


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


def check_layer_kinds_of(path: str) -> None:
    """Refuse a target whose layer kinds the decoder or packed replay cannot run exactly
    (docs/guides/target-layer-kind.md), by `Target`'s own rule (`attention_windows`) applied to the model class's
    skeleton built from config.json: no weights are read, so a run ends here in seconds rather than when an actor
    loads the target."""
    from opd.models.shared_head import skeleton, target_config
    from opd.models.target import attention_windows

    config = target_config(path)
    try:
        model = skeleton(config)
    except (ValueError, KeyError, ImportError) as exc:
        raise OpdError(f"target model {path}: {str(exc).strip().splitlines()[0]}") from exc
    attention_windows(model)


def check_selector_term(spec: ExperimentSpec) -> None:
    """A DFlash 2 drafter's selector term reads the teacher at its candidates, which a top-k teacher may not hold
    (opd/distill/selector_loss.py): refused together, from the drafter's config.json."""
    from opd.models.family import is_dflash2

    config = json.loads((Path(spec.models.drafter_path) / "config.json").read_text(encoding="utf-8"))
    if is_dflash2(config) and spec.loss.selector_weight > 0 and spec.replay.teacher_topk is not None:
        raise OpdError("loss.selector_weight: a DFlash 2 drafter's selector term reads the full teacher at its "
                       "candidates; expected replay.teacher_topk: null, or loss.selector_weight: 0")


def check_drafter(path: str, target: SimpleNamespace, block_size: int) -> None:
    """The warm drafter fits the target: config, tensor names and shapes, read from the header only. Either
    family, told apart by its config.json; `block_size` is the spec's, which an EAGLE-3 file without one takes."""
    from opd.models.dflash_format import CONFIG_FILE, WEIGHTS_FILE
    from opd.models.family import checkpoint_kind

    if not (Path(path) / CONFIG_FILE).is_file():
        raise OpdError(f"drafter: {path}/config.json not found (expected a DFlash or EAGLE-3 drafter directory or "
                       "'random')")
    if checkpoint_kind(path) == "eagle3":
        expected, borrowed = _eagle3_shapes(path, target, block_size)
    else:
        expected, borrowed = _dflash_shapes(path, target)
    weights = Path(path) / WEIGHTS_FILE
    if not weights.is_file():
        raise OpdError(f"{weights}: drafter weights not found")
    found = {k: v for k, v in check_safetensors(weights).items() if not borrowed(k)}
    for problem, names in (("missing", expected.keys() - found.keys()), ("unexpected", found.keys() - expected.keys())):
        if names:
            raise OpdError(f"{weights}: {problem} tensor(s) {', '.join(sorted(names)[:5])}")
    for name, shape in expected.items():
        if found[name] != shape:
            raise OpdError(f"{weights}: tensor {name} has shape {list(found[name])}, expected {list(shape)}")


def _dflash_shapes(path: str, target: SimpleNamespace) -> tuple[dict[str, tuple[int, ...]], Callable[[str], bool]]:
    """(tensor shapes, which names are the target's tensors that the loader drops) of a DFlash drafter: one
    built on the meta device gives the shapes without allocating them."""
    import torch
    from torch import nn

    from opd.models.dflash2 import dflash_class
    from opd.models.dflash_format import CONFIG_FILE, SHARED_TENSOR_SUFFIXES, read_config

    config = read_config(Path(path) / CONFIG_FILE, target)
    with torch.device("meta"):
        shared = nn.Embedding(config.vocab_size, config.hidden_size), nn.Linear(config.hidden_size,
                                                                                 config.vocab_size, bias=False)
        expected = {k: tuple(v.shape) for k, v in dflash_class(config)(config, *shared).state_dict().items()}
    return expected, lambda name: name.endswith(SHARED_TENSOR_SUFFIXES)


def _eagle3_shapes(path: str, target: SimpleNamespace,
                   block_size: int) -> tuple[dict[str, tuple[int, ...]], Callable[[str], bool]]:
    """(tensor shapes, which names are the target's embedding that the loader drops) of an EAGLE-3 drafter,
    whose fused layers must be the ones the spec captures (`target.layer_ids`), as the loader demands later."""
    from opd.models.eagle3_format import CONFIG_FILE, SHARED_EMBEDDING, expected_shapes, read_config

    config = read_config(Path(path) / CONFIG_FILE, target, block_size)
    if config.target_layer_ids != target.layer_ids:
        raise OpdError(f"drafter {path}: fuses target layers {config.target_layer_ids} but "
                       f"models.drafter.target_layer_ids resolves to {target.layer_ids} (expected them to agree)")
    return expected_shapes(config), lambda name: name == SHARED_EMBEDDING


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
