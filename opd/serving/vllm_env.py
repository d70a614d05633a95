"""The vLLM environment, checked before any model loads: `resources.vllm_python` names its interpreter.

vLLM caps transformers below the versions the trainer is tested on, release after release, so it lives in an
environment of its own (cluster/vllm.lock; cluster/Dockerfile builds it at the default path). What must hold
there for a worker to start (actors/isolated.py): the interpreter exists, it runs the trainer's Python
minor and Ray version (Ray refuses a worker of another version), vLLM imports, and the project's torch-free
worker module imports; and the Ray cluster has the GPUs vLLM needs. Each failure is one line naming the field and
the path, so a user learns it in seconds instead of from a worker's traceback minutes into a job.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

from opd.errors import OpdError

FIELD = "resources.vllm_python"
INSTALL = "build it with `make vllm-env VLLM_ENV=DIR` (cluster/vllm.lock) and set resources.vllm_python: DIR/bin/python"
PROBE_TIMEOUT_S = 600.0  # importing vLLM initialises CUDA and its compiled ops, which is slow: be generous

# Run by the vLLM environment's interpreter: its versions, and whether the worker's imports succeed there.
PROBE = """
import json, sys
out = {"python": "%d.%d" % sys.version_info[:2]}
try:
    from importlib.metadata import version
    out["ray"] = version("ray")
except Exception:
    out["ray"] = None
for name, module in (("vllm", "vllm"), ("worker", "opd.serving.vllm_worker")):
    try:
        __import__(module)
        out[name] = None
    except Exception as exc:
        out[name] = "%s: %s" % (type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
print("OPD-PROBE " + json.dumps(out))
"""


def probe(python: str) -> dict[str, str | None]:
    """What the interpreter at `python` reports (see PROBE), or an OpdError when it is missing or does not run."""
    path = Path(python)
    if not path.exists():
        raise OpdError(f"{FIELD}: {python} does not exist (expected the vLLM environment's interpreter: {INSTALL})")
    if not os.access(path, os.X_OK) or path.is_dir():
        raise OpdError(f"{FIELD}: {python} is not an executable interpreter ({INSTALL})")
    try:
        done = subprocess.run([str(path), "-c", PROBE], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise OpdError(f"{FIELD}: {python} did not run ({type(exc).__name__}: {exc})") from None
    report = [line for line in done.stdout.splitlines() if line.startswith("OPD-PROBE ")]
    if done.returncode != 0 or not report:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise OpdError(f"{FIELD}: {python} is not a Python interpreter that runs ({tail})")
    return json.loads(report[-1].removeprefix("OPD-PROBE "))


def check_vllm_env(python: str, command: str) -> None:
    """Refuse, in one line naming the field and the path, an environment a vLLM worker cannot start in."""
    found = probe(python)
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    if found["python"] != here:
        raise OpdError(f"{FIELD}: {python} is Python {found['python']}, this environment's is {here} (Ray runs "
                       f"workers of one Python version: rebuild the vLLM environment with Python {here})")
    ours = version("ray")
    if found["ray"] != ours:
        has = f"Ray {found['ray']}" if found["ray"] else "no Ray"
        raise OpdError(f"{FIELD}: {python} has {has}, this environment Ray {ours} (expected the same: "
                       f"pip install 'ray[default]=={ours}' there, as cluster/vllm.lock pins it)")
    if found["vllm"] is not None:
        raise OpdError(f"{command} needs vLLM, which does not import in {FIELD} {python} ({found['vllm']}); "
                       f"{INSTALL}")
    if found["worker"] is not None:
        raise OpdError(f"{FIELD}: {python} cannot import this project's vLLM worker ({found['worker']}); install "
                       f"the project there without dependencies: {python} -m pip install --no-deps -e .")


def check_gpus(python: str, command: str, needed: int, have: float) -> None:
    """Refuse a Ray cluster (with `have` GPUs) without the GPUs vLLM needs: vLLM has no CPU build."""
    if have < needed:
        where = "has no GPU" if not have else f"has {have:g} GPUs"
        raise OpdError(f"{command} needs vLLM on {needed} GPU(s) and this Ray cluster {where} ({FIELD}: {python}); "
                       f"run it on a GPU machine or cluster")
