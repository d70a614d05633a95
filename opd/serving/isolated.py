"""A worker in another Python environment: a Ray actor started with that environment's interpreter.

vLLM pins its own torch and transformers, which the trainer's tested versions do not meet, so vLLM runs in an
interpreter of its own (Ray's `runtime_env["py_executable"]`, as NeMo-RL runs a venv per worker role). Nothing but
plain data crosses: every argument and result is checked to be lists, dicts, strings and numbers, so neither side
ever unpickles the other's tensors or classes. This is the one module of opd/ besides the launcher that uses Ray
(tests/test_layering.py): a worker of another environment is a process, and Ray is how this project runs one,
from the driver (`opd gen-samples`, `opd serve-bench`), the local trainer, or a rollout actor alike.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import ray

from opd.errors import OpdError

PLAIN = (str, int, float, bool, type(None))


def plain(value: Any, where: str) -> Any:
    """`value` itself when it is plain data (nested lists, tuples and dicts of str, int, float, bool, None), else
    a TypeError naming `where`: the boundary to another environment carries nothing its pickles would need."""
    if isinstance(value, PLAIN):
        return value
    if isinstance(value, list | tuple):
        for item in value:
            plain(item, where)
        return value
    if isinstance(value, dict):
        for key, item in value.items():
            plain(key, where)
            plain(item, where)
        return value
    raise TypeError(f"{where}: {type(value).__name__} cannot cross to another Python environment (plain lists, "
                    f"dicts, strings and numbers only)")


def ensure_ray(num_gpus: int | None = None) -> None:
    """Join the running Ray (RAY_ADDRESS, a rollout actor's own) or start a private one on this machine."""
    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS")
    if address and address != "local":
        ray.init(address=address, configure_logging=False)
    else:
        ray.init(address="local", num_gpus=num_gpus, include_dashboard=False, configure_logging=False)


def cluster_gpus() -> float:
    """The GPUs the Ray cluster has in all, as Ray counts them."""
    return float(ray.cluster_resources().get("GPU", 0))


class Worker:
    """A handle on an actor of `cls` running under `python`; `call` returns a method's plain result."""

    def __init__(self, cls: type, python: str, args: list[Any], *, gpus: int, what: str) -> None:
        """`gpus`: the GPUs the worker holds. Inside a placement group that captures its children (a rollout
        replica's, actors/driver.py), the worker is placed in that group, on the GPUs its parent leaves free."""
        self.what = what
        options = {"runtime_env": {"py_executable": str(Path(python).absolute())}, "num_gpus": gpus, "num_cpus": 0}
        self.actor = ray.remote(cls).options(**options).remote(*plain(args, f"{what}: arguments"))
        self.call("ready")

    def call(self, method: str, *args: Any) -> Any:
        """`method`'s result, or an OpdError naming the worker and its first error line."""
        ref = getattr(self.actor, method).remote(*plain(args, f"{self.what}.{method}: arguments"))
        try:
            return plain(ray.get(ref), f"{self.what}.{method}: result")
        except ray.exceptions.RayError as exc:
            raise OpdError(f"{self.what}: {_first_line(exc)}") from None

    def close(self) -> None:
        """End the actor now, so the GPU memory it held is free for the next one."""
        ray.kill(self.actor)


def _first_line(exc: Exception) -> str:
    """The worker's own error, not Ray's wrapping of it."""
    cause = getattr(exc, "cause", None) or exc
    lines = [line.strip() for line in str(cause).splitlines() if line.strip()]
    return lines[-1] if lines else type(cause).__name__
