"""A rank that only answers the driver's liveness call, in a module of its own so the Ray worker that hosts it
imports nothing heavy (a test module would bring torch into every such worker)."""

from __future__ import annotations

import os

import ray


@ray.remote(num_cpus=0, max_concurrency=2)
class ToyRank:
    def ready(self) -> None:
        pass

    def pid(self) -> int:
        return os.getpid()
