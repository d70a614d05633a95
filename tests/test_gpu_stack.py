"""The GPU stack is two environments: the trainer's (pyproject.toml's `gpu` and `flash-attn` extras, at
requirements.lock's versions) and vLLM's (cluster/vllm.lock, at resources.vllm_python's default path).
cluster/Dockerfile and cluster/cluster.yaml install exactly these, the locks share the packages both sides import
at one version (all offline), and a lock that stops resolving is caught as a conflict (needs the package index;
.ci/run runs the whole check)."""

from __future__ import annotations

import importlib
import re
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from opd.spec import ResourcesSpec

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "cluster"))
check_gpu_stack = importlib.import_module("check_gpu_stack")
VLLM_ENV = str(Path(ResourcesSpec().vllm_python).parents[1])  # /opt/vllm: the image's vLLM environment


@pytest.fixture(scope="module")
def stack() -> dict[str, str]:
    groups = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    return check_gpu_stack.pins(groups["gpu"]) | check_gpu_stack.pins(groups["flash-attn"])


def _check_install_order(lines: list[str], stack: dict[str, str], where: str) -> None:
    """The trainer: torch (CUDA index) → project with [gpu] at the lock's versions → flash-attn with
    --no-build-isolation. vLLM's: a venv at the default path → cluster/vllm.lock → the project with --no-deps."""
    pip = [c for c in lines if "pip install" in c]
    torch_at = next(i for i, c in enumerate(pip) if f"torch=={stack['torch']}" in c)
    assert "--index-url https://download.pytorch.org/whl/cu" in pip[torch_at], where
    gpu_at = next(i for i, c in enumerate(pip) if ".[gpu]" in c)
    assert "-c requirements.lock" in pip[gpu_at], f"{where}: the trainer installs the tested versions"
    flash_at = next(i for i, c in enumerate(pip) if "flash-attn" in c)
    assert "--no-build-isolation" in pip[flash_at], f"{where}: flash-attn compiles against the installed torch"
    assert torch_at < gpu_at < flash_at, f"{where}: torch, then .[gpu], then flash-attn"
    pinned = re.findall(r"([A-Za-z0-9_-]+)==([0-9][^\s'\"\\]*)", " ".join(pip))
    for name, version in pinned:
        assert stack.get(check_gpu_stack.canonical(name)) == version, f"{where}: {name}=={version} is not the pin"
    assert any(f"-m venv {VLLM_ENV}" in c for c in lines), f"{where}: the vLLM environment at {VLLM_ENV}"
    vllm_lock = next(i for i, c in enumerate(pip) if f"{VLLM_ENV}/bin/pip install" in c and "-r cluster/vllm.lock" in c)
    project = next(i for i, c in enumerate(pip) if f"{VLLM_ENV}/bin/pip install" in c and "--no-deps -e ." in c)
    assert vllm_lock < project, f"{where}: the vLLM lock, then the project's worker module without dependencies"
    assert not any("vllm" in c for c in pip if f"{VLLM_ENV}/bin/pip" not in c), f"{where}: vLLM is not the trainer's"


def test_the_gpu_extras_pin_the_trainers_stack_and_vllm_is_not_among_them(stack):
    assert set(stack) == {"torch", "deepspeed", "flash-attn"}
    groups = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert check_gpu_stack.pins(groups["deepspeed"]) == {"deepspeed": stack["deepspeed"]}  # CPU extra: same pin
    assert "vllm" not in " ".join(sum(groups.values(), [])), "vLLM lives in its own environment (cluster/vllm.lock)"


def test_the_pinned_torch_is_the_one_make_installs_and_the_dependency_allows(stack):
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(rf"pip install -q (--no-compile )?torch=={re.escape(stack['torch'])}\b", makefile)
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (torch_dep,) = [d for d in deps if d.startswith("torch")]
    low, high = re.fullmatch(r"torch>=([\d.]+),<([\d.]+)", torch_dep).groups()
    as_tuple = lambda v: tuple(int(x) for x in v.split("."))  # noqa: E731
    assert as_tuple(low) <= as_tuple(stack["torch"]) < as_tuple(high)


def test_dockerfile_installs_both_environments(stack):
    text = (ROOT / "cluster" / "Dockerfile").read_text().replace("\\\n", " ")
    commands = [c.strip() for line in text.splitlines() if line.startswith("RUN ") for c in line[4:].split("&&")]
    _check_install_order(commands, stack, "cluster/Dockerfile")
    assert "COPY --chown=ray:users pyproject.toml README.md requirements.lock ./" in text


def test_cluster_launcher_installs_both_environments(stack):
    launcher = yaml.safe_load((ROOT / "cluster" / "cluster.yaml").read_text())
    _check_install_order(launcher["setup_commands"], stack, "cluster/cluster.yaml")


def test_the_two_locks_share_every_package_both_sides_import_at_one_version():
    trainer, vllm = check_gpu_stack.locked(check_gpu_stack.TRAINER_LOCK), check_gpu_stack.locked(
        check_gpu_stack.VLLM_LOCK)
    assert check_gpu_stack.shared_mismatches(trainer, vllm, "locks") == []
    assert set(check_gpu_stack.SHARED) <= set(trainer) & set(vllm)
    assert trainer["transformers"] != vllm["transformers"]  # the reason there are two environments
    wanted = check_gpu_stack.pins((ROOT / "cluster" / "vllm.in").read_text().splitlines())
    assert wanted["vllm"] == vllm["vllm"], "cluster/vllm.lock is stale: make lock"


def test_a_drifted_shared_package_is_named():
    problems = check_gpu_stack.shared_mismatches({"ray": "2.60.0", "pydantic": "2.14.4"},
                                                 {"ray": "2.59.0", "pydantic": "2.14.4"}, "locks")
    assert problems[0].startswith("ray: 2.60.0 in the trainer's environment but 2.59.0 in the vLLM environment")


def test_the_gpu_guide_names_both_environments(stack):
    guide = (ROOT / "docs" / "guides" / "gpu-extras.md").read_text()
    assert f"pip install --no-build-isolation flash-attn=={stack['flash-attn']}" in guide
    assert "make vllm-env" in guide and "resources.vllm_python" in guide and "Known conflict" not in guide


def test_a_conflict_fails_the_check_and_an_unreachable_index_does_not(tmp_path, monkeypatch, capsys):
    """vLLM 0.33 caps transformers below the trainer's: resolving both in one environment is a conflict."""
    requirements = tmp_path / "both.txt"
    requirements.write_text("vllm==0.33.0\ntransformers==5.24.0\n")
    try:
        with pytest.raises(check_gpu_stack.Conflict, match="transformers==5.24.0.*unsatisfiable"):
            check_gpu_stack.resolve(str(requirements))
    except check_gpu_stack.Unreachable as exc:
        pytest.skip(f"the package index cannot be reached: {exc}")

    def unreachable() -> list[str]:
        raise check_gpu_stack.Unreachable("dns error")

    monkeypatch.setattr(check_gpu_stack, "check", unreachable)
    assert check_gpu_stack.main([]) == 0
    assert capsys.readouterr().out.startswith("note: the package index could not be reached")
