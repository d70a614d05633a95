"""The `fake_vllm` fixture: the stand-in `vllm` package (tests/helpers/fake_vllm_pkg) as the vLLM environment.

The vLLM environment is this interpreter with the stand-in on PYTHONPATH, and a private Ray with one logical GPU,
so `opd gen-samples --engine vllm`, `rollout.sampler: vllm` and `opd serve-bench` start their vLLM worker in a
Ray actor of that environment, as on a GPU machine. `fake_vllm.made()` reads back what each engine was asked.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import ray

from actors.isolated import allow_vllm_workers

PACKAGE = Path(__file__).resolve().parent / "fake_vllm_pkg"
# The spec settings of a run whose vLLM environment is this interpreter, with a logical GPU to place the worker.
VLLM_SETS = [f"resources.vllm_python={sys.executable}", "resources.cluster.num_gpus=1"]


class Engines:
    def __init__(self, log: Path) -> None:
        self.log = log

    def made(self) -> list[SimpleNamespace]:
        """Each engine made so far, oldest first: its kwargs, its generate calls (prompts, params), the prompt ids
        it served request by request and, per request-id prefix, the most requests it had in flight."""
        records = [json.loads(p.read_text()) for p in sorted(self.log.glob("*.json"))]
        return [SimpleNamespace(kwargs=r["kwargs"], peak=r["peak"], served=r["served"],
                                calls=[(p, [SimpleNamespace(**q) for q in params]) for p, params in r["calls"]])
                for r in records]


@pytest.fixture(scope="module")
def fake_vllm_ray(tmp_path_factory):
    """A private Ray of two logical GPUs whose workers see the stand-in vLLM (a worker's environment is fixed when
    Ray starts)."""
    log = tmp_path_factory.mktemp("fake_vllm_log")
    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", "FAKE_VLLM_LOG")}
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(PACKAGE), saved["PYTHONPATH"]) if p)
    os.environ["FAKE_VLLM_LOG"] = str(log)
    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=2, num_gpus=2, include_dashboard=False, configure_logging=False)
    allow_vllm_workers()  # this process starts the vLLM workers, as opd's commands do
    yield log
    ray.shutdown()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture
def fake_vllm(fake_vllm_ray) -> Engines:
    shutil.rmtree(fake_vllm_ray)
    fake_vllm_ray.mkdir()
    return Engines(fake_vllm_ray)
