"""Check that the GPU stack's two environments resolve, and share the packages both import at one version.

    python cluster/check_gpu_stack.py            # resolve both (seconds; needs the package index, installs nothing)
    python cluster/check_gpu_stack.py --write    # write cluster/vllm.lock from cluster/vllm.in (`make lock`)

The trainer's environment is pyproject.toml with the `gpu` extra (CUDA torch and DeepSpeed), constrained by
requirements.lock, the versions the tests passed on. The vLLM environment is cluster/vllm.lock, compiled from
cluster/vllm.in with vLLM's own torch and transformers. vLLM caps transformers below the trainer's, release after
release, so the two never share one environment; what they do share crosses a Ray boundary, so Ray (a worker of
another Ray version is refused), pydantic, tokenizers and huggingface-hub must be the same version in both.

Both are resolved with `uv pip compile` for the cluster image: Linux x86_64, Python 3.11, and PyPI's CUDA builds
of torch. Exits 1 with one `error:` line per problem when a lock no longer resolves or the shared packages
differ; a package index that cannot be reached is one `note:` line and exit 0, since it says nothing about the
locks.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAINER_LOCK = ROOT / "requirements.lock"
VLLM_IN = ROOT / "cluster" / "vllm.in"
VLLM_LOCK = ROOT / "cluster" / "vllm.lock"
SHARED = ("ray", "pydantic", "pydantic-core", "tokenizers", "huggingface-hub")
PLATFORM = ["--python-platform", "x86_64-manylinux_2_28", "--python-version", "3.11"]
PIN = re.compile(r"^([A-Za-z0-9_.-]+)(\[[^]]*\])?==([^;\s]+)")


class Unreachable(Exception):
    """The package index did not answer: nothing is known about the locks."""


class Conflict(Exception):
    """The requirements do not resolve together."""


def canonical(name: str) -> str:
    """PEP 503 name, so `pydantic_core` matches `pydantic-core`."""
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(lines: list[str]) -> dict[str, str]:
    """{name: version} of the `name==version` lines of a lock or requirements file (comments and others skipped)."""
    out = {}
    for line in lines:
        if match := PIN.match(line.strip()):
            out[canonical(match.group(1))] = match.group(3)
    return out


def locked(path: Path) -> dict[str, str]:
    return pins(path.read_text().splitlines())


def resolve(*args: str) -> dict[str, str]:
    """{name: version} that `uv pip compile ARGS` resolves for the cluster image's platform."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "resolved.txt"
        cmd = [sys.executable, "-m", "uv", "pip", "compile", "--quiet", "--no-header", "--no-annotate", *PLATFORM,
               *args, "-o", str(out)]
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        if done.returncode != 0:
            raise _failure(done.stderr)
        return locked(out)


def _failure(stderr: str) -> Exception:
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    text = " | ".join(lines[-4:]) or "no output"
    return Conflict(text) if "No solution found" in stderr else Unreachable(text)


def trainer() -> dict[str, str]:
    """The trainer's GPU environment: the project with the `gpu` extra, at the tested versions."""
    return resolve(str(ROOT / "pyproject.toml"), "--extra", "gpu", "-c", str(TRAINER_LOCK))


def vllm() -> dict[str, str]:
    """The vLLM environment as its lock pins it (every pin, with what each requires: a stale lock fails here)."""
    return resolve(str(VLLM_LOCK))


def shared_mismatches(trainer_pins: dict[str, str], vllm_pins: dict[str, str], where: str) -> list[str]:
    """One line per shared package whose versions differ (or that one side lacks)."""
    return [f"{name}: {trainer_pins.get(name)} in the trainer's environment but {vllm_pins.get(name)} in the vLLM "
            f"environment ({where}; expected the same version, since both sides of the vLLM worker import it)"
            for name in SHARED if trainer_pins.get(name) != vllm_pins.get(name)]


def check() -> list[str]:
    """Problems with the two locks (empty when both resolve and agree); prints what was resolved."""
    problems = shared_mismatches(locked(TRAINER_LOCK), locked(VLLM_LOCK), "requirements.lock, cluster/vllm.lock")
    ours, theirs = trainer(), vllm()
    for name in ("torch", "transformers", "deepspeed", *SHARED):
        print(f"{name:16} trainer {ours.get(name, '-'):12} vllm {theirs.get(name, '-')}")
    print(f"{'vllm':16} trainer {'-':12} vllm {theirs.get('vllm')}")
    problems += shared_mismatches(ours, theirs, "as resolved")
    return problems


def write_vllm_lock() -> None:
    """cluster/vllm.lock from cluster/vllm.in, the shared packages held at requirements.lock's versions."""
    shared = locked(TRAINER_LOCK)
    with tempfile.TemporaryDirectory() as tmp:
        constraints = Path(tmp) / "shared.txt"
        constraints.write_text("".join(f"{name}=={shared[name]}\n" for name in SHARED))
        resolved = resolve(str(VLLM_IN), "-c", str(constraints))
    header = ("# The vLLM environment (resources.vllm_python), written by `make lock` (cluster/check_gpu_stack.py "
              "--write) from cluster/vllm.in\n# for Linux x86_64, Python 3.11; the packages it shares with the "
              "trainer are at requirements.lock's versions.\n")
    VLLM_LOCK.write_text(header + "".join(f"{name}=={version}\n" for name, version in sorted(resolved.items())))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="write cluster/vllm.lock from cluster/vllm.in")
    args = parser.parse_args(argv)
    try:
        if args.write:
            write_vllm_lock()
            print(f"wrote {VLLM_LOCK.relative_to(ROOT)}")
            return 0
        problems = check()
    except Unreachable as exc:
        print(f"note: the package index could not be reached, so the GPU stack was not resolved ({exc})")
        return 0
    except Conflict as exc:
        problems = [f"the GPU stack does not resolve: {exc}"]
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    if not problems:
        print("the trainer's and the vLLM environment's locks resolve, and share one version of "
              + ", ".join(SHARED))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
