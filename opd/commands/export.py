"""`opd export`: a drafter directory of any family written in the layout a serving engine's client reads, with
the `speculative_config` vLLM takes for it and the command that loads it in that client's own code.

`--to public` writes the family's own public layout (`save_pretrained`): z-lab's for DFlash and DFlash 2,
SpecForge's for EAGLE-3, which vLLM serves as they are (`--to zlab` is its old name, still taken). `--to
speculators` writes vLLM's `speculators` layout (`save_speculators`), the one DSpark and P-EAGLE are published in
and the one speculators' own classes load without a converter.
`--to target` (an MTP head) writes the target's own checkpoint layout into `--out` (`save_into_target`): the
target's shards linked (those that held its old head rewritten without it), the head in a new shard, an updated
index; vLLM serves that directory as the model with its MTP method. A family is refused a layout it has none of, in
one line naming the ones it has.

The drafter is loaded on the target's embedding and LM head alone (`load_shared_head`), in the dtype its checkpoint
records, so exporting the drafter of a large target needs no GPU and writes the checkpoint's very tensors. The
target is `--target`, else the spec's (`--config`), else the one the checkpoint's run recorded (a run's
`checkpoints/step-N`).
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from opd.commands.shell import shell_line
from opd.errors import OpdError
from opd.model_dir import ModelDir
from opd.models.build import DTYPES
from opd.models.family import DrafterFamily
from opd.models.protocol import Drafter
from opd.models.registry import detect, family
from opd.models.shared_head import SharedHead, load_shared_head, target_config
from opd.outputs import atomic_dir, check_output_dir
from opd.spec import ExperimentSpec, load_spec
from opd.train.checkpoint import STATE_FILE, recorded_fields

LAYOUT_NAMES = {"public": "its family's public", "zlab": "z-lab's", "specforge": "SpecForge's",
                "speculators": "vLLM's speculators", "target": "the target's own"}
CLIENTS = {"zlab": "z-lab's dflash package", "specforge": "speculators' EAGLE-3 converter and model class",
           "speculators": "speculators' model class"}  # the code that checks each layout
# speculators' package __init__ imports its training data pipeline (openai, datasets, ...) for one type alias, which
# its model classes never use; installed without its dependencies (as `make test` installs it), it needs this.
SPECULATORS_IMPORT = ('import sys, types; sys.modules.setdefault("speculators.train.data", '
                      'types.SimpleNamespace(BatchType=dict)); from speculators import SpeculatorModel')


def layouts(found: DrafterFamily, target: ModelDir | None = None) -> list[str]:
    """The `--to` layouts a family is written in, the one to serve it from first: its public layout where that is
    z-lab's or SpecForge's (`public`), then speculators' where the family writes it, then the target's own (`target`)
    where the family is part of a target's checkpoint; for a known `target`, only those its client loads."""
    public = [] if found.public_layout == "speculators" else ["public"]
    public += ["speculators"] if found.writes_speculators else []
    every = public + (["target"] if found.lives_in_target else [])
    return every if target is None else [name for name in every if found.unloadable(name, target) is None]


def export_command(checkpoint: str | Path, kind: str, out: str | Path, target: str | None = None) -> str:
    """The `opd export` line that takes a trained checkpoint of `kind` out to vLLM (what `opd run` and `opd train`
    print last), in the first layout whose client loads it for `target`."""
    layout = layouts(family(kind), ModelDir.find(target, "target model"))[0]
    return shell_line("opd", "export", str(checkpoint), "--to", layout, "--out", str(out))


def run_export(checkpoint: str, to: str, out: str, target: str | None, config: str | None) -> int:
    """Check the output, the layout and the target, then load, write atomically and print what to run next."""
    check_output_dir(out, "--out", "the exported drafter")
    if Path(out).is_dir() and any(Path(out).iterdir()):
        raise OpdError(f"--out: {out} is not empty (expected a new or empty directory for the exported drafter)")
    directory = ModelDir.read(checkpoint, "drafter", expected="a drafter directory: a run's checkpoints/step-N, "
                                                               "or an exported drafter").expect("drafter", "CKPT",
                                                                                                "--target")
    found = detect(directory)
    if to not in layouts(found):
        raise OpdError(f"--to {to}: a {found.kind} drafter cannot be written in {LAYOUT_NAMES[to]} layout (it can be "
                       f"written as: {', '.join(layouts(found))})")
    spec = _spec(config)
    verifier = _target_path(checkpoint, target, spec)
    section = (spec.models.drafter if spec is not None and spec.models.drafter.kind == found.kind
               else found.section.model_validate({}))
    target_dir = ModelDir.read(verifier, "target model")
    if (reason := found.unloadable(to, target_dir)) is not None:
        raise OpdError(f"--to {to}: {reason}{_instead(found, to, target_dir)}")
    head = _shared_head(directory, found, verifier)
    drafter = found.load(directory, head, section)
    block_size = found.served_block_size(directory, head, section)  # refused here if vLLM cannot serve it
    destination = Path(out).absolute()
    try:
        with atomic_dir(destination) as tmp:
            _write(found, drafter, to, tmp, verifier)
    except OpdError as exc:
        raise OpdError(f"--to {to}: {exc}{_instead(found, to, target_dir)}") from None
    if to == "target":
        return _print_into_target(found, destination, block_size)
    exported = ModelDir.read(destination, "drafter")
    written = found.public_layout if to == "public" else "speculators"
    speculative = json.dumps(found.vllm_config(exported, block_size))
    print(f"exported the {found.kind} drafter in {LAYOUT_NAMES[written]} layout to {destination}\n"
          f"serve it with vLLM:\n"
          f"  {shlex.join(['vllm', 'serve', verifier, '--speculative-config', speculative])}\n"
          f"check it in {CLIENTS[written]}:\n"
          f"  {shell_line('python', '-c', check_code(exported, written, verifier))}")
    return 0


def _instead(found: DrafterFamily, refused: str, target: ModelDir) -> str:
    """The layouts to write a drafter in when its client cannot load it in `refused`: its family's others that
    load for `target`."""
    others = [name for name in layouts(found, target) if name != refused]
    return f" (expected --to {' or --to '.join(others)}, which writes this drafter as it is)" if others else ""


def _spec(config: str | None) -> ExperimentSpec | None:
    return None if config is None else load_spec(config, [], check_paths=False)


def _target_path(checkpoint: str, target: str | None, spec: ExperimentSpec | None) -> str:
    """The target's directory as an absolute path (what a speculators export names as its verifier): `--target`,
    else the spec's, else the one the checkpoint's run recorded; a one-line OpdError when none is, or when the one
    named is not a model directory."""
    if target is not None:
        path, origin = target, "--target"
    elif spec is not None:
        path, origin = spec.models.target_path, "models.target_path"
    elif (recorded := (recorded_fields(checkpoint) or {}).get("models.target_path")) is not None:
        path, origin = recorded, f"the models.target_path its run recorded ({Path(checkpoint) / STATE_FILE})"
    else:
        raise OpdError(f"{checkpoint}: no target to export it for (it is not a run's checkpoint that records one); "
                       "pass --target PATH, the target model's directory, or --config SPEC")
    if (found := ModelDir.find(path)) is None:
        raise OpdError(f"{origin}: {path} is not a model directory with config.json from here (expected the "
                       "target's; pass --target PATH)")
    found.expect("target", origin, "CKPT")
    return str(Path(path).absolute())


def _shared_head(directory: ModelDir, found: DrafterFamily, target: str) -> SharedHead:
    """The target's embedding and LM head, for the layers the drafter reads, in the dtype of the drafter's
    checkpoint (float32 where it records none: a wider copy changes no value)."""
    try:
        layer_ids = found.target_layer_ids(directory, int(target_config(target).num_hidden_layers))
    except OpdError as exc:
        raise OpdError(f"drafter {directory.path}: {exc}") from None
    recorded = directory.config.get("dtype", directory.config.get("torch_dtype"))
    dtype = DTYPES.get(recorded, DTYPES["float32"]) if isinstance(recorded, str) else DTYPES["float32"]
    return load_shared_head(target, dtype=dtype, layer_ids=layer_ids)


def _print_into_target(found: DrafterFamily, destination: Path, block_size: int) -> int:
    """What to run with a target-layout export: vLLM serves the directory itself as the model, the head in it."""
    speculative = json.dumps(found.vllm_config(ModelDir.read(destination, "target"), block_size))
    print(f"exported the {found.kind} drafter in the target's own layout to {destination} (the target's files "
          f"linked)\nserve it with vLLM:\n"
          f"  {shlex.join(['vllm', 'serve', str(destination), '--speculative-config', speculative])}\n"
          f"train on from it: models.target_path: {destination} with models.drafter.kind: {found.kind}")
    return 0


def _write(found: DrafterFamily, drafter: Drafter, to: str, directory: Path, verifier: str) -> None:
    if to == "public":
        drafter.save_pretrained(directory)
    elif to == "target":
        found.save_into_target(drafter, verifier, directory)
    else:
        found.save_speculators(drafter, directory, verifier)


def check_code(exported: ModelDir, layout: str, verifier: str) -> str:
    """Python that loads the export in its client's own code, on one line: z-lab's class, which reports every
    missing, unexpected or mismatched tensor (exit 1 if any); speculators' `SpeculatorModel`, which resolves the
    family's class from config.json; for SpecForge's layout, speculators' EAGLE-3 converter first, given the layer
    ids it does not read from `eagle_config`."""
    path = json.dumps(str(exported.path))  # a Python string literal in double quotes: the shell quotes in single
    if layout == "zlab":
        name = exported.architectures[0]
        return (f"from dflash.model import {name}; model, info = {name}.from_pretrained({path}, "
                "output_loading_info=True); bad = {k: v for k, v in info.items() if v}; "
                f'print(type(model).__name__, "loads", {path}, bad or "whole"); raise SystemExit(bool(bad))')
    if layout == "specforge":
        ids = exported.config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
        return (f"import tempfile; {SPECULATORS_IMPORT}; from speculators.convert.entrypoints import convert_model; "
                f'out = tempfile.mkdtemp(); convert_model({path}, {json.dumps(verifier)}, "eagle3", output_path=out, '
                f"eagle_aux_hidden_state_layer_ids={ids}); "
                f'print(type(SpeculatorModel.from_pretrained(out)).__name__, "loads", {path})')
    return f'{SPECULATORS_IMPORT}; print(type(SpeculatorModel.from_pretrained({path})).__name__, "loads", {path})'
