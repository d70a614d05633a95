"""The one way this project joins Ray: the cluster `ray job submit` or `ray start` runs, or a private local one.

The driver (`opd train`/`opd run` on `engine: ray`, the before/after evaluation) and the vLLM workers that other
commands start (`opd gen-samples --engine vllm`, `opd serve-bench`) all come through here, so they join the same
cluster by the same rule.
"""

from __future__ import annotations

import logging
import os
import sys

import ray

from opd.spec import ExperimentSpec


def init_ray(spec: ExperimentSpec, num_gpus: int | None = -1) -> None:
    """Join a running cluster, else start a private local Ray sized by `resources.cluster` (`num_gpus`: None to
    let Ray count this machine's, for a vLLM worker outside training; -1: the spec's).

    The running cluster is the one RAY_ADDRESS names (`ray job submit` sets it) or, without it, the one
    `ray start --head` runs on this machine: a bare `ray.init` joins that one anyway and then refuses the spec's
    CPU/GPU counts with a ValueError, so it is joined on purpose, with its own resources (the placement check
    still refuses a layout it cannot hold). RAY_ADDRESS=local always starts a private Ray.
    """
    if ray.is_initialized():
        return
    # Ray's token-auth notice at every local start is noise in the run's output (auth stays as Ray sets it); the
    # before-eval's actor starts Ray first, so the notice is silenced here, not in RayRun.
    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
    address = os.environ.get("RAY_ADDRESS")
    if not address:
        try:  # where `ray start` records its head (TMPDIR/ray/ray_current_cluster); `ray stop` removes it
            address = ray._private.utils.read_ray_address()
        except Exception:  # a Ray without this private helper: start a private Ray beside it
            address = None
        if address:
            print(f"note: joining the Ray cluster that `ray start` runs at {address} (its resources apply, not "
                  "resources.cluster); RAY_ADDRESS=local starts a private one instead", file=sys.stderr)
    if address and address != "local":
        ray.init(address=address)
        return
    cluster = spec.resources.cluster
    ray.init(address="local", num_cpus=cluster.num_cpus, num_gpus=cluster.num_gpus if num_gpus == -1 else num_gpus,
             include_dashboard=True, configure_logging=False, log_to_driver=True)
