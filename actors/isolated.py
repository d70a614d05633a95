"""A worker in another Python environment: a Ray actor started with that environment's interpreter (Ray's
`runtime_env["py_executable"]`, as NeMo-RL runs a venv per worker role), and how this project starts its vLLM
workers (registered with opd/serving/engine.py, which never imports Ray).

vLLM pins its own torch and transformers, which the trainer's tested versions do not meet, so it runs in an
interpreter of its own. Nothing but plain data crosses (opd/serving/plain.py). `allow_vllm_workers` is what lets a
process start them: the launcher calls it for the commands it runs, a rollout or evaluator actor for itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ray

from actors.errors import first_line, root
from actors.session import init_ray
from opd.errors import OpdError
from opd.serving.engine import starts_vllm_workers
from opd.serving.plain import plain
from opd.serving.vllm_env import check_gpus
from opd.serving.vllm_worker import VllmWorker
from opd.spec import ExperimentSpec


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
            raise OpdError(f"{self.what}: {first_line(root(exc))}") from None

    def close(self) -> None:
        """End the actor now, so the GPU memory it held is free for the next one."""
        ray.kill(self.actor)


def start_vllm_worker(spec: ExperimentSpec, engine: dict, command: str) -> Worker:
    """A vLLM engine in the vLLM environment, on `engine`'s tensor-parallel GPUs of the Ray cluster (joined, or
    started here with resources.cluster's GPUs, 0: as many as this machine has), refused in one line without
    them."""
    gpus = engine["tensor_parallel_size"]
    init_ray(spec, num_gpus=spec.resources.cluster.num_gpus or None)
    check_gpus(spec.resources.vllm_python, command, gpus, float(ray.cluster_resources().get("GPU", 0)))
    return Worker(VllmWorker, spec.resources.vllm_python, [engine], gpus=gpus, what=f"vLLM worker ({command})")


def allow_vllm_workers() -> None:
    """Register `start_vllm_worker` as how this process starts vLLM workers (opd/serving/engine.py)."""
    starts_vllm_workers(start_vllm_worker)
