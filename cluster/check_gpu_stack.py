"""Check that the pinned GPU stack (pyproject.toml's `gpu` and `flash-attn` extras) installs together.

    python cluster/check_gpu_stack.py [--pin vllm==0.33.0 ...]

Runs `pip install --dry-run` (needs the package index, installs nothing) the way cluster/Dockerfile installs:
the project's dependencies with the `gpu` extra must resolve to exactly the pinned torch, vLLM and DeepSpeed (a
vLLM that requires another torch makes pip swap torch, which breaks a flash-attn built against the pinned one),
and flash-attn's source distribution must prepare against the installed torch with --no-build-isolation (it has
no wheel on PyPI). `--pin` overrides a pin, to see what a bump would do. Prints one line per package; exits 1
with one `error:` line per drifted pin. On CUDA machines the torch wheel comes from the CUDA index; the version
resolution checked here is the same.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PIN = re.compile(r"^([A-Za-z0-9_.-]+)==([^;\s]+)$")


def canonical(name: str) -> str:
    """PEP 503 name, so `flash_attn` in a report matches `flash-attn` in a pin."""
    return re.sub(r"[-_.]+", "-", name).lower()


def extras(pyproject: Path = ROOT / "pyproject.toml") -> dict[str, list[str]]:
    """The optional-dependency groups of pyproject.toml."""
    return tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]


def pins(requirements: list[str]) -> dict[str, str]:
    """{name: version} of `name==version` requirements; anything looser is an error: the stack must be pinned."""
    out = {}
    for req in requirements:
        match = PIN.match(req.strip())
        if not match:
            raise ValueError(f"{req!r} is not pinned (expected name==version)")
        out[canonical(match.group(1))] = match.group(2)
    return out


def dry_run(requirements: list[str], *args: str, env: dict[str, str] | None = None) -> dict[str, str]:
    """{name: version} pip would install for `requirements` into an empty environment."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
               "--report", str(report), *args, *requirements]
        done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})
        if done.returncode != 0:
            lines = [line for line in done.stderr.splitlines() if line.strip() and "is ignored" not in line]
            raise RuntimeError(f"pip could not resolve {' '.join(requirements)}: {' | '.join(lines[-3:])}")
        installed = json.loads(report.read_text())["install"]
    return {canonical(item["metadata"]["name"]): item["metadata"]["version"] for item in installed}


def same_version(resolved: str | None, pinned: str) -> bool:
    """2.13.0+cu128 (or +cpu) is the pinned 2.13.0: a local build label does not change the release."""
    return resolved is not None and resolved.split("+")[0] == pinned


def check(overrides: dict[str, str] | None = None) -> list[str]:
    """Problems with the pinned stack (empty when it is coherent); prints what was resolved."""
    groups = extras()
    gpu, flash = pins(groups["gpu"]) | (overrides or {}), pins(groups["flash-attn"])
    base = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    problems = []
    # torch is left free here: what pip picks for it beside the other pins is what would replace the pinned one
    # (with torch pinned as well, a drifted set would only say "cannot resolve").
    others = [f"{name}=={version}" for name, version in gpu.items() if name != "torch"]
    resolved = dry_run([*base, *others])
    for name, version in gpu.items():
        print(f"{name:12} pinned {version:12} resolves {resolved.get(name)}")
        if not same_version(resolved.get(name), version):
            problems.append(f"{name}: pinned {version} but the gpu extra resolves {resolved.get(name)} "
                            f"(with {', '.join(others)})")
    torch_here = _installed_torch()
    if not same_version(torch_here, gpu["torch"]):
        problems.append(f"flash-attn: builds against the installed torch, which is {torch_here}, not the pinned "
                        f"{gpu['torch']} (run this in the environment that has the pinned torch)")
    else:
        built = dry_run([f"{n}=={v}" for n, v in flash.items()], "--no-deps", "--no-build-isolation",
                        env={"FLASH_ATTENTION_SKIP_CUDA_BUILD": "TRUE"})
        for name, version in flash.items():
            print(f"{name:12} pinned {version:12} prepares {built.get(name)} against torch {torch_here}")
            if not same_version(built.get(name), version):
                problems.append(f"{name}: pinned {version} but pip prepares {built.get(name)}")
    return problems


def _installed_torch() -> str | None:
    try:
        import torch
    except ImportError:
        return None
    return torch.__version__


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pin", action="append", default=[], help="override a gpu pin, e.g. vllm==0.33.0")
    args = parser.parse_args(argv)
    try:
        problems = check(pins(args.pin))
    except (ValueError, RuntimeError) as exc:
        problems = [str(exc)]
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
