"""Up-front checks of a run's inputs, in the driver, before any actor or model starts.

A bad prompt line or a truncated checkpoint found inside a Ray actor's constructor surfaces as pages of actor
output, minutes in; found here it is one `OpdError` line in seconds. The checks read what is cheap to read even
for a Qwen3-sized run on a CPU-only head node: the tokenizer, every prompt, the configs, and the safetensors
headers (which safetensors checks against the file's length, so a truncated file is caught without reading the
weights). A target whose layer kinds nothing here runs exactly (chunked attention, ...) is refused from its
config.json alone. `opd validate`, `opd train` and `opd run` all call `check_inputs`.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from opd.data.prompts import Prompt, load_tokenizer, spec_prompts
from opd.data.render import Rendering
from opd.data.suite import built_suite, scored_settings, suite_inputs, target_context
from opd.errors import OpdError
from opd.formats.section import DrafterSection
from opd.model_dir import DRAFTER_FIELD, TARGET_FIELD, WEIGHTS_FILE, ModelDir
from opd.serving.engine import check_vllm
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
    target_dir = ModelDir.read(m.target_path, "target model").expect("target", TARGET_FIELD)  # read once, here
    target = check_target(target_dir, m.layer_ids or [])
    check_layer_kinds_of(target_dir, target.config)
    if len(tokenizer) > target.vocab_size:
        raise OpdError(f"tokenizer {m.tokenizer}: {len(tokenizer)} tokens but the target's vocabulary has "
                       f"{target.vocab_size} (expected a tokenizer that fits the target)")
    if (warm := m.warm_path) is not None:
        check_drafter(warm, target, m.drafter)
    else:
        from opd.models.registry import family

        family(m.drafter.kind).check_initial(m.drafter, tokenizer, target)
    if spec.rollout.source == "target" and spec.rollout.sampler == "vllm":
        check_vllm(spec, "rollout.sampler vllm")
    train = spec_prompts(spec.data, spec.data.train_prompts, tokenizer)
    held_out = spec_prompts(spec.data, spec.data.eval_prompts, tokenizer, spec.eval.num_prompts)
    for name, read in (("data.train_prompts", train), ("data.eval_prompts", held_out)):
        if (note := read.skipped_note(name)) is not None:
            print(note, file=sys.stderr)
    prompts = train.prompts
    if spec.rollout.source == "samples":
        SampleStore.for_rollout(spec, prompts).check_budget(spec)  # prompt ids and enough samples for the step budget
    if spec.eval.suite is not None:
        check_suite(spec, Path(spec.eval.suite), tokenizer)
    return prompts[0]


def check_suite(spec: ExperimentSpec, suite: Path, tokenizer) -> None:
    """`suite` (`eval.suite`) is a finished build, scored at a point-mass setting, and every prompt of it parses,
    renders and fits the target's context with its answer: found after training, any of these would cost a cluster
    run its table hours in."""
    scored_settings(spec.eval.sampling)
    suite_inputs(built_suite(suite, field="eval.suite:"), suite, tokenizer, Rendering.of(spec.data),
                 target_context(spec.models.target_path), "eval.suite:")


def check_target(directory: ModelDir, layer_ids: list[int]) -> SimpleNamespace:
    """The target's shape from its config.json (what a drafter must fit), after checking its weight files."""
    directory.tensor_shapes()
    return target_shape(directory, layer_ids)


def target_shape(directory: ModelDir, layer_ids: list[int]) -> SimpleNamespace:
    """What a drafter checkpoint is checked against (`TargetShape`), from the target's config.json alone."""
    from opd.models.shared_head import target_config

    return SimpleNamespace(hidden_size=directory.int_field("hidden_size"), vocab_size=directory.int_field("vocab_size"),
                           num_layers=directory.int_field("num_hidden_layers"), layer_ids=layer_ids,
                           config=target_config(str(directory.path)))


def check_layer_kinds_of(directory: ModelDir, config: Any | None = None) -> None:
    """Refuse a target whose layer kinds the decoder or packed replay cannot run exactly
    (docs/guides/target-layer-kind.md), by `Target`'s own rule (`layer_kinds`) applied to the model class's
    skeleton built from config.json: no weights are read, so a run ends here in seconds rather than when an actor
    loads the target. `config` is the text config already read (`target_shape`), else it is read here."""
    from opd.models.layer_kind import layer_kinds
    from opd.models.shared_head import skeleton, target_config
    from opd.models.target import missing_tensors

    path = str(directory.path)
    config = target_config(path) if config is None else config
    try:
        model = skeleton(config)
    except (ValueError, KeyError, ImportError) as exc:
        raise OpdError(f"target model {path}: {str(exc).strip().splitlines()[0]}") from exc
    layer_kinds(model)
    missing = missing_tensors(model, directory.text_names()) if directory.weight_files() else []
    if missing:  # a directory of other weight files than safetensors is left to transformers
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise OpdError(f"target model {path}: its weights lack {missing[0]}{more} (expected every tensor of "
                       f"{type(model).__name__}; transformers would fill them with random values)")


def check_drafter(path: str, target: SimpleNamespace, section: DrafterSection) -> None:
    """The warm drafter fits the target: config, tensor names and shapes, read from the header only, as its
    family lays them out (told apart by its config.json)."""
    from opd.models.registry import detect

    directory = ModelDir.read(path, "drafter").expect("drafter", DRAFTER_FIELD)
    expected, borrowed = detect(directory).expected_shapes(directory, target, section)
    where = directory.path / WEIGHTS_FILE
    if not directory.weight_files():
        raise OpdError(f"{where}: drafter weights not found")
    found = {k: v for k, v in directory.tensor_shapes().items() if not borrowed(k)}
    for problem, names in (("missing", expected.keys() - found.keys()), ("unexpected", found.keys() - expected.keys())):
        if names:
            raise OpdError(f"{where}: {problem} tensor(s) {', '.join(sorted(names)[:5])}")
    for name, shape in expected.items():
        if found[name] != shape:
            raise OpdError(f"{where}: tensor {name} has shape {list(found[name])}, expected {list(shape)}")
