"""Every shipped cluster config runs on its target as published, in miniature (issue 69).

Each config's target is built from its published config.json (bench/fixtures/targets/) with only the sizes shrunk
(opd/tiny/miniature.py): multimodal wrappers with `text_config` and the `model.language_model.*` prefix, the vision
tower beside it, MXFP4 experts, sharded safetensors with an index. Then every command a user runs on the config
runs on it: `opd validate`, `opd run` (the learner's shared head, rollout, scorer, evaluator), `opd eval`,
`opd export` in every layout the family has (each loaded in its client's own classes) and `opd serve-bench`'s
preflight. Every config validates and every published layout loads in the fast suite; the full command chain runs
there on two configs (`LOCAL_IN_FAST_SUITE`) and on every config, locally and on Ray, in `make test-all`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from opd.cli import main
from opd.commands.export import check_code, layouts
from opd.commands.serve_bench import served_config
from opd.errors import OpdError
from opd.model_dir import ModelDir
from opd.models.registry import detect
from opd.models.shared_head import load_shared_head
from opd.models.target import load_target
from opd.spec import load_spec
from opd.tiny.miniature import FIXTURES, Miniature, build, text_section
from tests.helpers.miniatures import PUBLISHED, fitted_sets, shipped_configs, target_of

CONFIGS = shipped_configs()
# The fast suite runs every command locally on a multimodal wrapper and on MXFP4 experts; `make test-all` runs every
# config, locally and on Ray. The Ray run's own pieces are fast tests: the learner actor's shared head on every
# published layout (below), the Ray path against the local one (tests/test_ray.py).
LOCAL_IN_FAST_SUITE = {"gemma4-31b.yaml", "gpt-oss-20b.yaml"}


@pytest.fixture(scope="module")
def miniatures(tmp_path_factory):
    """name -> its Miniature, each built once on first use."""
    root = tmp_path_factory.mktemp("published")
    built: dict[str, Miniature] = {}

    def get(name: str) -> Miniature:
        if name not in built:
            built[name] = build(name, root / name)
        return built[name]

    return get


def _ids(paths: list[Path]) -> list[str]:
    return [p.name for p in paths]


@pytest.mark.parametrize("config", CONFIGS, ids=_ids(CONFIGS))
def test_every_shipped_config_has_a_miniature(config):
    basename = Path(load_spec(str(config), [], check_paths=False).models.target_path).name
    assert basename in PUBLISHED, (f"{config.name}: its target {basename} has no miniature; add its published "
                                   f"config.json to {FIXTURES} and its name to tests/helpers/miniatures.py PUBLISHED")
    assert (FIXTURES / f"{PUBLISHED[basename]}.json").is_file()


@pytest.mark.parametrize("name", sorted(set(PUBLISHED.values())))
def test_the_miniature_keeps_the_published_layout(name, miniatures):
    """Architecture, nesting, prefixes, tying, quantization and sharding as published; the learner's shared head
    reads the very embedding and head the rollout's target loads; the vision tower is left unread and counted."""
    mini = miniatures(name)
    directory = ModelDir.read(mini.path)
    published = json.loads((FIXTURES / f"{name}.json").read_text())
    assert directory.architectures == published["architectures"]
    assert ("text_config" in directory.config) == ("text_config" in published)
    assert (directory.path / "model.safetensors.index.json").is_file() and len(directory.weight_files()) > 1
    target = load_target(str(mini.path), dtype=torch.float32, layer_ids=[0, 1])
    head = load_shared_head(str(mini.path), dtype=torch.float32, layer_ids=[0, 1])
    assert torch.equal(head.embed_tokens.weight, target.embed_tokens.weight)
    assert torch.equal(head.lm_head.weight, target.lm_head.weight)
    assert head.num_layers == target.num_layers == mini.num_layers
    tied = directory.text_config.get("tie_word_embeddings", directory.config.get("tie_word_embeddings"))
    assert (head.lm_head.weight is head.embed_tokens.weight) == bool(tied)
    towers = {n for n in directory.tensor_shapes() if ".visual." in n or "vision" in n or n.startswith("mtp.")}
    assert towers <= set(target.unread) and (towers or not target.unread)
    if text_section(published).get("mtp_num_hidden_layers"):
        assert any(n.startswith("mtp.") for n in target.unread)
    if "quantization_config" in published:
        assert any(n.endswith("_blocks") or n.endswith("weight_scale_inv") for n in directory.tensor_shapes())


@pytest.mark.parametrize("config", CONFIGS, ids=_ids(CONFIGS))
def test_validate_on_the_miniature(config, miniatures, tmp_path):
    mini = miniatures(target_of(config))
    assert main(["validate", str(config), *fitted_sets(config, mini, tmp_path)]) == 0


def _run_then_every_command(config: Path, mini: Miniature, tmp_path: Path, engine: str, capsys) -> None:
    """`opd run` for two steps, then `opd eval` on its checkpoint, `opd export` in each layout (loaded in the
    client's classes, or refused in one line naming a layout that loads) and serve-bench's preflight of each."""
    sets = fitted_sets(config, mini, tmp_path) + ["--set", f"engine={engine}"]
    assert main(["run", str(config), *sets]) == 0
    checkpoint = max((tmp_path / Path(config).stem / "checkpoints").glob("step-*"))
    assert main(["eval", str(config), *sets, "--draft", str(checkpoint)]) == 0
    found = detect(ModelDir.read(checkpoint))
    spec = load_spec(str(config), sets[1::2])
    loaded = []
    for layout in layouts(found):
        out = tmp_path / f"export-{layout}"
        capsys.readouterr()
        if main(["export", str(checkpoint), "--to", layout, "--out", str(out), "--target", str(mini.path)]) != 0:
            error = capsys.readouterr().err.strip()
            assert "\n" not in error and "(expected --to " in error, error
            continue
        if layout != "target":
            exported = ModelDir.read(out)
            written = found.public_layout if layout == "public" else "speculators"
            check = subprocess.run([sys.executable, "-c", check_code(exported, written, str(mini.path))],
                                   capture_output=True, text=True, timeout=120)
            assert check.returncode == 0, check.stderr[-2000:]
            assert served_config(str(out), spec)["model"] == str(out)
        loaded.append(layout)
    assert loaded and loaded[0] == layouts(found, ModelDir.read(mini.path))[0]


@pytest.mark.parametrize("config", [pytest.param(c, marks=[] if c.name in LOCAL_IN_FAST_SUITE else pytest.mark.slow)
                                    for c in CONFIGS], ids=_ids(CONFIGS))
def test_every_command_runs_on_the_miniature(config, miniatures, tmp_path, capsys):
    _run_then_every_command(config, miniatures(target_of(config)), tmp_path, "local", capsys)


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS, ids=_ids(CONFIGS))
def test_every_command_runs_on_the_miniature_on_ray(config, miniatures, tmp_path, capsys):
    _run_then_every_command(config, miniatures(target_of(config)), tmp_path, "ray", capsys)


def test_a_shard_the_index_names_but_is_missing_is_one_line(miniatures, tmp_path):
    import shutil

    copy = tmp_path / "target"
    shutil.copytree(miniatures("qwen3.5-9b").path, copy)
    (copy / "model-00002-of-00004.safetensors").unlink()
    for load in (load_target, load_shared_head):
        with pytest.raises(OpdError, match=r"model-00002-of-00004\.safetensors: weights file not found \(expected "
                                           r"it next to config\.json, as model\.safetensors\.index\.json names it\)$"):
            load(str(copy), dtype=torch.float32, layer_ids=[0, 1])


def test_validate_names_every_field_a_fresh_drafter_lacks_before_any_actor(miniatures, tmp_path, capsys):
    """Qwen3.5-122B-A10B states no dense MLP width: `opd validate` refuses a fresh drafter in one line naming the
    spec field, instead of a learner actor failing minutes in."""
    config = CONFIGS[[c.name for c in CONFIGS].index("qwen3.5-122b-a10b.yaml")]
    sets = fitted_sets(config, miniatures("qwen3.5-122b-a10b"), tmp_path)
    without = [arg for pair in zip(sets[::2], sets[1::2], strict=True) if "intermediate_size" not in pair[1]
               for arg in pair]
    assert main(["validate", str(config), *without]) == 2
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and "intermediate_size: set models.drafter.intermediate_size (" in error
