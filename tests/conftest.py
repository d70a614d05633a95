"""Shared fixtures: micro models written to disk as real HF/DFlash directories, so the loaders, the CLI and the
trainers run their real code paths in seconds."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import yaml

from tests.helpers.chat_template import QWEN3_STYLE_TEMPLATE
from tests.helpers.dflash2 import micro_dflash2  # noqa: F401  (a fixture for every module)
from tests.helpers.vllm_assets import vllm_spec_file  # noqa: F401  (a fixture for every module)

torch.set_num_threads(1)  # tests are tiny; fewer threads means less contention on 2-core CI machines


def pytest_configure(config):
    """Every Ray this process starts (test_ray.py's, test_multinode.py's two-node cluster, `opd ... engine=ray`)
    keeps its session files and `ray_current_cluster` in a directory private to this process. Under pytest-xdist
    each worker is one such process, so a cluster one worker starts is never joined by a bare `ray.init()` or
    `init_ray` in the other (nor is a `ray start` head someone else runs on this machine). Short: Ray's socket
    paths must fit in 107 bytes."""
    config.ray_tmpdir = os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="opd-ray-", dir="/tmp")
    # Ray starts its workers at niceness 15, so while the other xdist worker computes at 0 the actors of a Ray
    # test get almost no CPU and that test, the suite's longest chain, stretches several-fold; the same priority
    # as this process shares the cores evenly.
    os.environ["RAY_worker_niceness"] = "0"
    # The empty MLflow store that new stores are copied from (opd/tracking.py): the checkout's own, not the
    # user's cache, shared by the xdist workers and kept between runs as .venv is.
    os.environ.setdefault("OPD_CACHE_DIR", str(Path(config.rootpath) / "build" / "cache"))


def pytest_unconfigure(config):
    shutil.rmtree(config.ray_tmpdir, ignore_errors=True)


# Under `make test` (pytest-xdist, --dist loadfile: a module runs on one worker, so its module-scoped fixtures
# are built once) these modules are sent first: they are the longest chains (Ray clusters and their actors,
# subprocesses, samples drawn on the tiny model), and the other worker takes the rest meanwhile.
# test_ray.py's Ray-equals-local run with its resume is the longest module (two Ray runs, about 16 actor starts);
# test_ray_sources.py's runs are make test-all's; test_ray_actors.py (single actors) is the other local Ray.
FIRST = ("test_ray.py", "test_ray_sources.py", "test_ray_actors.py", "test_rollout_sources.py", "test_offline_eval.py",
         "test_multinode.py")


def pytest_collection_modifyitems(config, items):
    """Under xdist, move the modules in FIRST to the front (the Makefile turns off xdist's own reordering, which
    sends the files with the most tests first); a plain run keeps the files' order."""
    if hasattr(config, "workerinput"):
        rank = {name: i for i, name in enumerate(FIRST)}
        items.sort(key=lambda item: rank.get(item.path.name, len(FIRST)))  # stable: the rest keep their order


@pytest.fixture(scope="module", autouse=True)
def no_ray_left_up():
    """Shut down a Ray that a module's `opd ... engine=ray` left up in this process: its processes (a dashboard
    among them) would take CPU from every later module, and its threads would be forked along with the process."""
    yield
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


def _write_prompts(path: Path, problems) -> None:
    path.write_text("".join(json.dumps({"id": p.id, "prompt": p.prompt}) + "\n" for p in problems))


def _write_micro_models(root: Path, tokenizer) -> None:
    """A float32 micro Qwen3 target sized to `tokenizer` (saved with it) and a random drafter, under `root`."""
    from opd.models.dflash import DFlashConfig, DFlashDrafter
    from opd.tiny.micro import micro_target

    target = micro_target(seed=0, vocab_size=len(tokenizer), num_layers=4, dtype=torch.float32, layer_ids=[1, 2])
    target.model.config.eos_token_id = tokenizer.eos_token_id
    target.model.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    config = DFlashConfig.for_target(target.config, num_layers=1, block_size=4,
                                     mask_token_id=tokenizer.mask_token_id, target_layer_ids=[1, 2])
    torch.manual_seed(0)
    DFlashDrafter(config, target.embed_tokens, target.lm_head).save_pretrained(root / "drafter")


@pytest.fixture(scope="session")
def micro_assets(tmp_path_factory) -> dict[str, str]:
    """A 96-token BPE tokenizer, a float32 micro Qwen3 target, a random drafter and prompt files."""
    from opd.tiny.build import build_tokenizer
    from opd.tiny.math_corpus import generate

    root = tmp_path_factory.mktemp("micro")
    problems = generate(7, 400)
    tokenizer = build_tokenizer([p.prompt + p.response for p in problems], vocab_size=96)
    _write_micro_models(root, tokenizer)
    short = [p for p in generate(8, 200) if len(tokenizer(p.prompt)["input_ids"]) < 120]
    _write_prompts(root / "train.jsonl", short[:40])
    _write_prompts(root / "heldout.jsonl", short[40:48])
    return {"root": str(root), "target": str(root / "target"), "drafter": str(root / "drafter"),
            "train": str(root / "train.jsonl"), "heldout": str(root / "heldout.jsonl")}


@pytest.fixture
def micro_spec_file(micro_assets, tmp_path) -> Path:
    """A complete spec for the micro assets (engine local, a few steps), written as YAML in tmp_path."""
    spec = {
        "name": "micro", "seed": 0, "engine": "local", "steps": 4,
        "models": {"target_path": micro_assets["target"], "drafter_path": micro_assets["drafter"],
                   "dtype": "float32", "drafter": {"num_layers": 1, "block_size": 4, "target_layer_ids": [1, 2]}},
        "data": {"train_prompts": micro_assets["train"], "eval_prompts": micro_assets["heldout"],
                 "max_prompt_tokens": 200},
        "rollout": {"batch_size": 2, "max_new_tokens": 12, "temperature": 1.0},
        "optim": {"lr": 1e-3, "batch_size": 4, "micro_batch_size": 2, "warmup_ratio": 0.0},
        "resources": {"cluster": {"num_cpus": 2}, "rollout": {"num_cpus": 0.5}, "scorer": {"num_cpus": 0.5},
                      "learner": {"num_cpus": 0.5}},
        "tracking": {"run_dir": str(tmp_path / "runs" / "{name}"), "checkpoint_every": 2},
        "eval": {"every": 2, "num_prompts": 4, "max_new_tokens": 8, "batch_size": 4,
                 "sampling": [{"name": "greedy", "temperature": 0.0}]},
    }
    path = tmp_path / "micro.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.fixture(scope="session")
def chat_assets(micro_assets, tmp_path_factory) -> dict[str, str]:
    """The micro tokenizer with Qwen3's chat tokens and QWEN3_STYLE_TEMPLATE, a micro target and random drafter
    sized to its vocabulary, and small prompt files that mix plain `prompt` rows with chat `messages` rows."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("chat")
    tokenizer = AutoTokenizer.from_pretrained(micro_assets["target"])
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.add_tokens(["<think>", "</think>"])  # Qwen3's think tags are added, not special, tokens
    tokenizer.chat_template = QWEN3_STYLE_TEMPLATE
    _write_micro_models(root, tokenizer)
    rows = [{"id": "p0", "prompt": "Tom has 3 apples. How many?"},
            {"id": "m0", "messages": [{"role": "user", "content": "What is 2 + 5?"}]},
            {"id": "m1", "messages": [{"role": "system", "content": "Be brief."},
                                      {"role": "user", "content": "Sum 4 and 4."}]},
            {"id": "p1", "prompt": "A box holds 6 pens."}]
    for name, part in (("train", rows), ("heldout", rows[1:] + rows[:1])):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    return {"root": str(root), "target": str(root / "target"), "drafter": str(root / "drafter"),
            "train": str(root / "train.jsonl"), "heldout": str(root / "heldout.jsonl")}
