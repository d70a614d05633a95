"""The GPU stack is one pinned set: pyproject.toml's extras, cluster/Dockerfile and cluster/cluster.yaml agree on
it (fast, offline), and it resolves with pip (slow: `pip install --dry-run` needs the package index)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "cluster"))
check_gpu_stack = importlib.import_module("check_gpu_stack")


@pytest.fixture(scope="module")
def stack() -> dict[str, str]:
    groups = check_gpu_stack.extras()
    return check_gpu_stack.pins(groups["gpu"]) | check_gpu_stack.pins(groups["flash-attn"])


def _install_lines(commands: list[str]) -> list[str]:
    """The pip install commands, in order, with line continuations joined."""
    return [c for c in commands if "pip install" in c]


def _check_install_order(lines: list[str], stack: dict[str, str], where: str) -> None:
    """torch (CUDA index) → project with [gpu] → flash-attn with --no-build-isolation, each at the pinned version."""
    torch_at = next(i for i, c in enumerate(lines) if f"torch=={stack['torch']}" in c)
    assert "--index-url https://download.pytorch.org/whl/cu" in lines[torch_at], where
    gpu_at = next(i for i, c in enumerate(lines) if ".[gpu]" in c)
    assert "--no-build-isolation" not in lines[gpu_at], f"{where}: the project itself needs no build step"
    flash_at = next(i for i, c in enumerate(lines) if "flash-attn" in c)
    assert f"flash-attn=={stack['flash-attn']}" in lines[flash_at], where
    assert "--no-build-isolation" in lines[flash_at], f"{where}: flash-attn compiles against the installed torch"
    assert torch_at < gpu_at < flash_at, f"{where}: torch, then .[gpu], then flash-attn"
    pinned = re.findall(r"([A-Za-z0-9_-]+)==([0-9][^\s'\"\\]*)", " ".join(lines))
    for name, version in pinned:
        assert stack.get(check_gpu_stack.canonical(name)) == version, f"{where}: {name}=={version} is not the pin"


def test_the_gpu_extras_pin_every_package_of_the_stack(stack):
    assert set(stack) == {"torch", "vllm", "deepspeed", "flash-attn"}
    groups = check_gpu_stack.extras()
    assert check_gpu_stack.pins(groups["deepspeed"]) == {"deepspeed": stack["deepspeed"]}  # CPU extra: same pin
    assert "flash-attn" not in " ".join(groups["gpu"]), "flash-attn needs its own --no-build-isolation step"


def test_the_pinned_torch_is_the_one_make_installs_and_the_dependency_allows(stack):
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(rf"pip install -q (--no-compile )?torch=={re.escape(stack['torch'])}\b", makefile)
    deps = check_gpu_stack.tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (torch_dep,) = [d for d in deps if d.startswith("torch")]
    low, high = re.fullmatch(r"torch>=([\d.]+),<([\d.]+)", torch_dep).groups()
    as_tuple = lambda v: tuple(int(x) for x in v.split("."))  # noqa: E731
    assert as_tuple(low) <= as_tuple(stack["torch"]) < as_tuple(high)


def test_dockerfile_installs_exactly_the_pinned_stack(stack):
    text = (ROOT / "cluster" / "Dockerfile").read_text().replace("\\\n", " ")
    commands = [c for line in text.splitlines() if line.startswith("RUN ") for c in line[4:].split("&&")]
    _check_install_order(_install_lines(commands), stack, "cluster/Dockerfile")


def test_cluster_launcher_installs_exactly_the_pinned_stack(stack):
    launcher = yaml.safe_load((ROOT / "cluster" / "cluster.yaml").read_text())
    _check_install_order(_install_lines(launcher["setup_commands"]), stack, "cluster/cluster.yaml")


def test_the_gpu_guide_names_the_flash_attn_build_step(stack):
    guide = (ROOT / "docs" / "guides" / "gpu-extras.md").read_text()
    assert f"pip install --no-build-isolation flash-attn=={stack['flash-attn']}" in guide


@pytest.mark.slow
def test_the_pinned_stack_resolves_with_pip():
    assert check_gpu_stack.check() == []


@pytest.mark.slow
def test_a_vllm_that_swaps_torch_is_caught():
    """vLLM 0.33 requires torch 2.14: the check must name torch, as a drifting pin would."""
    problems = check_gpu_stack.check({"vllm": "0.33.0"})
    assert any(p.startswith("torch: pinned 2.13.0 but the gpu extra resolves 2.14") for p in problems), problems
