"""`opd export` for every registered family (`opd.models.registry.FAMILIES`), run as a user types it: each tiny
drafter of tests/helpers/tiny_families.py, saved as a run saves its checkpoints, is exported in every layout its
family has; the export loads in its client's own classes (z-lab's `dflash` package, or speculators', through its
EAGLE-3 converter for SpecForge's layout), which compute the drafter's logits on a fixed text; the printed vLLM
config is the family's and both printed commands run as printed. A layout a family has none of, a non-empty
`--out` and a drafter with no target to be exported for are each refused in one line.

The target is the contract's micro target (tests/test_family_contract.py) saved as a model directory, in float64,
which the exports keep and the clients run in; their RoPE tables are float32 (transformers'), so logits agree to
about 1e-7 with the same argmax everywhere.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import torch
import yaml

from opd.cli import main
from opd.commands.export import export_command, layouts
from opd.model_dir import ModelDir
from opd.models.registry import FAMILIES, family
from opd.tiny.micro import micro_target
from opd.train.checkpoint import save_checkpoint
from tests.helpers.specs import MINIMAL
from tests.helpers.speculators import drafted_logits, quiet, speculators_model  # noqa: F401 (quiet: a fixture)
from tests.helpers.tiny_families import TINY, draw

zlab = pytest.importorskip("dflash.model", reason="z-lab's dflash package is not installed (pip install .[interop])")
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"),  # speculators' default-layer-id notices
              pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")]

ANCHORS, LENGTH = [3, 10, 17], 24


@pytest.fixture(scope="module")
def target():
    return micro_target(seed=0, vocab_size=8, num_layers=6, layer_ids=[1, 2, 3])


@pytest.fixture(scope="module")
def target_dir(target, tmp_path_factory) -> str:
    directory = tmp_path_factory.mktemp("target")
    target.model.save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module")
def checkpoints(target, tmp_path_factory):
    """kind -> (the family's tiny drafter, its directory as a run saves it: the family's public layout)."""
    saved = {}
    for kind in FAMILIES:
        drafter = draw(kind, target)
        directory = tmp_path_factory.mktemp(kind)
        drafter.save_pretrained(directory)
        saved[kind] = drafter, str(directory)
    return saved


@pytest.fixture(scope="module")
def text(target):
    """A token sequence, the target's final hidden states and its features there."""
    ids = torch.randint(0, target.vocab_size, (1, LENGTH), generator=torch.Generator().manual_seed(0))
    last, features = target.hidden_states(ids)
    return ids, last, features


def export(capsys, *args: str) -> tuple[int, list[str], str]:
    """`opd export ARGS` through the CLI: (exit code, stdout's lines, stderr)."""
    code = main(["export", *args])
    out, err = capsys.readouterr()
    return code, out.splitlines(), err


def refused(code: int, err: str) -> str:
    """The one `error: ` line of a refusal, with no traceback."""
    assert code == 2 and "Traceback" not in err and err.count("\n") == 1 and err.startswith("error: "), err
    return err


def ours(drafter, text, anchors: list[int]) -> torch.Tensor:
    """Our drafter's logits [M,K-1,V] at the drafted slots of the blocks at `anchors`, the text fed as the chain."""
    ids, _, features = text
    width = drafter.block_size - 1
    inputs = torch.stack([ids[0, a:a + width] for a in anchors])[None]
    with torch.no_grad():
        hidden = drafter.block_hidden(features, ids, torch.ones_like(ids, dtype=torch.bool), torch.tensor([anchors]),
                                      inputs)
    return drafter.logits(hidden)[0]


def zlab_logits(directory: Path, target, text, anchors: list[int]) -> torch.Tensor:
    """z-lab's class of the export (its config.json's architecture) loads it whole, and drafts each block as its
    `dflash_generate` does: the context's features, then the anchor and mask tokens' embeddings."""
    model_class = getattr(zlab, ModelDir.read(directory).architectures[0])
    model, info = model_class.from_pretrained(str(directory), output_loading_info=True, dtype=torch.float64)
    assert not any(info.values()), info
    ids, _, features = text
    scale = float(zlab._draft_value(model.config, "input_embedding_scale", 1.0))
    logits = []
    with torch.no_grad():
        for a in anchors:
            block = torch.full((1, model.block_size), model.mask_token_id)
            block[0, 0] = ids[0, a]
            hidden = model(target_hidden=features[:, :a], noise_embedding=zlab._raw_input_embeddings(
                target.model, block, scale), position_ids=torch.arange(a + model.block_size)[None])
            logits.append(model.compute_logits(hidden[0, 1:], target.lm_head))
    return torch.stack(logits)


def run_printed(line: str, monkeypatch, tmp_path: Path) -> str:
    """Run a printed `python -c CODE` line as the shell splits it, in this process (its imports already loaded):
    what it prints. A SpecForge check converts into tmp_path/converted (its temporary directory)."""
    python, flag, code = shlex.split(line)
    assert Path(python).name == "python" and flag == "-c"
    monkeypatch.setattr("tempfile.mkdtemp", lambda *a, **k: str(tmp_path / "converted"))
    with pytest.raises(SystemExit) as done:
        exec(code + "\nraise SystemExit(0)", {})
    assert not done.value.code
    return code


@pytest.mark.parametrize("layout", ["public", "speculators"])
@pytest.mark.parametrize("kind", FAMILIES)
def test_every_family_exports_to_what_its_client_loads_with_the_same_logits(kind, layout, checkpoints, target,
                                                                            target_dir, text, tmp_path, capsys,
                                                                            monkeypatch):
    drafter, checkpoint = checkpoints[kind]
    out = tmp_path / "export"
    code, printed, err = export(capsys, checkpoint, "--to", layout, "--out", str(out), "--target", target_dir)
    if layout not in layouts(family(kind)):
        message = refused(code, err)
        assert f"--to {layout}: a {kind} drafter cannot be written in" in message
        assert f"(it can be written as: {', '.join(layouts(family(kind)))})" in message and not out.exists()
        return
    assert code == 0, err
    assert len(printed) == 5 and printed[0].endswith(f"layout to {out}"), printed
    vllm, serve, target_arg, flag, config = shlex.split(printed[2])
    assert (vllm, serve, target_arg, flag) == ("vllm", "serve", target_dir, "--speculative-config")
    assert json.loads(config) == family(kind).vllm_config(ModelDir.read(out), drafter.block_size)
    run_printed(printed[4], monkeypatch, tmp_path)
    written = ModelDir.read(out)
    if "speculators_model_type" in written.config:
        theirs = drafted_logits(speculators_model(out, torch.float64), text, ANCHORS, drafter.block_size)
    elif written.architectures[0] in ("DFlashDraftModel", "DFlash2DraftModel"):
        theirs = zlab_logits(out, target, text, ANCHORS)
    else:  # SpecForge's layout: the check command converted it with speculators' EAGLE-3 converter
        theirs = drafted_logits(speculators_model(tmp_path / "converted", torch.float64), text, ANCHORS,
                                drafter.block_size)
    mine = ours(drafter, text, ANCHORS)
    torch.testing.assert_close(theirs.to(mine.dtype), mine, rtol=1e-5, atol=1e-6)  # the clients' RoPE: float32
    assert torch.equal(theirs.argmax(-1), mine.argmax(-1))


def test_a_runs_checkpoint_exports_for_the_target_its_run_recorded(checkpoints, target_dir, tmp_path, capsys):
    """The line `opd run` and `opd train` print last runs as printed (the checkpoint's run names the target)."""
    kind = next(iter(FAMILIES))
    drafter, _ = checkpoints[kind]
    checkpoint = save_checkpoint(tmp_path / "run", 60, drafter, {"spec": {"models.target_path": target_dir}})
    line = export_command(checkpoint, kind, tmp_path / "run" / "export" / checkpoint.name)
    opd, *args = shlex.split(line)
    assert Path(opd).name == "opd" and args[:2] == ["export", str(checkpoint)]
    code, printed, err = export(capsys, *args[1:])
    assert code == 0 and f"vllm serve {target_dir} " in printed[2], err


def test_a_spec_names_the_target(checkpoints, target_dir, tmp_path, capsys):
    spec = tmp_path / "spec.yaml"
    kind = next(iter(FAMILIES))
    drafter = {"kind": kind, **TINY[kind].section, "target_layer_ids": [1, 2, 3]}
    spec.write_text(yaml.safe_dump(MINIMAL | {"models": {"target_path": target_dir, "drafter": drafter}}))
    code, printed, err = export(capsys, checkpoints[kind][1], "--to", layouts(family(kind))[0], "--out",
                                str(tmp_path / "out"), "--config", str(spec))
    assert code == 0 and f"vllm serve {target_dir} " in printed[2], err


def test_a_drafter_with_no_target_is_refused_in_one_line(checkpoints, tmp_path, capsys):
    kind = next(iter(FAMILIES))
    code, _, err = export(capsys, checkpoints[kind][1], "--to", "speculators", "--out", str(tmp_path / "out"))
    assert "no target to export it for" in refused(code, err) and "pass --target PATH" in err
    assert not (tmp_path / "out").exists()


def test_a_non_empty_out_is_refused_in_one_line(checkpoints, target_dir, tmp_path, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    kind = next(iter(FAMILIES))
    code, _, err = export(capsys, checkpoints[kind][1], "--to", "speculators", "--out", str(tmp_path / "out"),
                          "--target", target_dir)
    assert f"--out: {tmp_path / 'out'} is not empty" in refused(code, err)
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["keep.txt"]
