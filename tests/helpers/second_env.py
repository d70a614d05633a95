"""A second Python environment on this CPU machine, built once under build/: the vLLM environment's versions
(cluster/vllm.lock: another transformers, the same Ray) with this machine's CPU torch instead of vLLM and its CUDA
torch. A worker started in it (actors/isolated.py) is a worker of another environment, as vLLM's is."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENV = ROOT / "build" / "second-env"
LOCK = ROOT / "cluster" / "vllm.lock"
TORCH = "torch==2.13.0"  # the local CPU wheel `make` installs (pip finds it; a bare torch would be a CUDA build)
# What the project's autoregressive sampler imports, at the vLLM lock's versions (opd itself comes from the
# checkout, which Ray puts on its workers' path).
PACKAGES = ["ray", "transformers", "tokenizers", "huggingface-hub", "pydantic", "pyyaml", "safetensors", "rich"]


def _constraints() -> str:
    """The vLLM lock without vLLM and the CUDA torch stack, which this CPU environment replaces."""
    skip = ("vllm", "torch", "nvidia-", "triton", "xformers", "flashinfer")
    return "".join(line + "\n" for line in LOCK.read_text().splitlines()
                   if line and not line.startswith("#") and not line.startswith(skip))


def second_env() -> str:
    """The second environment's interpreter, built unless its stamp says it is current."""
    constraints = _constraints()
    stamp = hashlib.sha256((constraints + TORCH + " ".join(PACKAGES)).encode()).hexdigest()
    python, done = ENV / "bin" / "python", ENV / ".stamp"
    if done.exists() and done.read_text() == stamp and python.exists():
        return str(python)
    _run(sys.executable, "-m", "venv", "--clear", str(ENV))
    _run(str(python), "-m", "pip", "install", "-q", "--no-compile", TORCH)
    (ENV / "constraints.txt").write_text(constraints)
    _run(sys.executable, "-m", "uv", "pip", "install", "-q", "--python", str(python), "-c",
         str(ENV / "constraints.txt"), *PACKAGES)
    done.write_text(stamp)
    return str(python)


def _run(*cmd: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"building {ENV} failed: {' '.join(cmd)}: {done.stderr.strip()[-2000:]}")
