"""vLLM's own environment: a worker of another Python environment, reached through a Ray actor started with that
environment's interpreter, and the one-line refusals of an environment such a worker cannot start in.

vLLM cannot run on this CPU machine, so the mechanism is proven with a real second environment (the vLLM lock's
transformers and Ray, tests/helpers/second_env.py) running the project's autoregressive sampler: its samples
must equal the in-process sampler's token for token, greedy and sampled with keyed seeds."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
import ray
import torch

from actors.isolated import Worker
from opd.cli import main
from opd.decoding.sampling import Sampling
from opd.models.build import build_models
from opd.serving.engine import sampling_dict
from opd.serving.plain import plain
from opd.sources.samplers import build_sampler
from opd.spec import load_spec
from tests.helpers.env_sampler import AutoregressiveWorker
from tests.helpers.fake_vllm import PACKAGE
from tests.helpers.second_env import ENV, second_env


@pytest.fixture(scope="module")
def cpu_ray():
    """A private Ray on this CPU machine: no GPU, as a laptop's."""
    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=2, num_gpus=0, include_dashboard=False, configure_logging=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def other_python() -> str:
    return second_env()


def test_a_worker_of_another_environment_samples_as_this_one_does(micro_spec_file, cpu_ray, other_python):
    spec = load_spec(micro_spec_file)
    worker = Worker(AutoregressiveWorker, other_python, [spec.model_dump(mode="json")], gpus=0, what="second env")
    there = worker.call("versions")
    assert there["python"] == str(ENV / "bin" / "python")  # the actor runs the other interpreter ...
    assert there["transformers"] != version("transformers")  # ... with another transformers (the vLLM lock's)
    assert there["ray"] == ray.__version__ and there["torch"] == torch.__version__

    models = build_models(spec, "random")
    here = build_sampler(spec, "autoregressive", models.target, None, models.eos_id)
    prompts = [p for p in models.tokenizer(["1+2=", "7*3=", "12-5=", "4+4="])["input_ids"]]
    keys = [11, 12, 13, 14]
    for sampling in (Sampling(), Sampling(temperature=1.0), Sampling(temperature=0.7, top_k=5, top_p=0.9)):
        ours = here(prompts, sampling, 10, 3, keys).responses
        theirs = worker.call("sample", prompts, sampling_dict(sampling), 10, 3, keys)
        assert theirs == ours, sampling
        assert theirs != worker.call("sample", prompts, sampling_dict(sampling), 10, 4, keys) or not sampling.temperature
    worker.close()


def test_only_plain_data_crosses_the_boundary():
    assert plain({"ids": [[1, 2], [3]], "t": 0.5, "name": None, "pair": (1, "a")}, "x") is not None
    with pytest.raises(TypeError, match="sample: Tensor cannot cross to another Python environment"):
        plain([torch.tensor([1])], "sample")
    with pytest.raises(TypeError, match="Sampling cannot cross"):
        plain({"sampling": Sampling()}, "sample")


# -------------------------------------------------------------------------------------------------- refusals


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "Traceback" not in err[0], err
    return err[0]


@pytest.fixture(scope="module")
def rayless_python() -> str:
    """An interpreter of this Python without Ray (a bare venv)."""
    path = ENV.parent / "rayless-env"
    if not (path / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    return str(path / "bin" / "python")


def gen_samples(spec_file: Path, python: str) -> list[str]:
    return ["gen-samples", str(spec_file), "--engine", "vllm", "--set", f"resources.vllm_python={python}"]


def test_each_environment_a_vllm_worker_cannot_start_in_is_one_line(micro_spec_file, rayless_python, other_python,
                                                                    tmp_path, capsys):
    assert main(gen_samples(micro_spec_file, "/nonexistent/bin/python")) == 2
    line = one_error_line(capsys)
    assert "resources.vllm_python: /nonexistent/bin/python does not exist" in line and "make vllm-env" in line

    assert main(gen_samples(micro_spec_file, str(tmp_path))) == 2
    assert f"resources.vllm_python: {tmp_path} is not an executable interpreter" in one_error_line(capsys)

    assert main(gen_samples(micro_spec_file, rayless_python)) == 2
    line = one_error_line(capsys)
    assert f"resources.vllm_python: {rayless_python} has no Ray, this environment Ray {ray.__version__}" in line

    assert main(gen_samples(micro_spec_file, other_python)) == 2  # the right Ray, but no vLLM
    line = one_error_line(capsys)
    assert f"needs vLLM, which does not import in resources.vllm_python {other_python}" in line
    assert "ModuleNotFoundError: No module named 'vllm'" in line


def test_an_interpreter_of_another_python_minor_is_one_line(micro_spec_file, tmp_path, capsys):
    """No second Python minor is installed here, so a stand-in interpreter answers the probe as Python 3.99 would."""
    python = tmp_path / "python"
    python.write_text('#!/bin/sh\necho \'OPD-PROBE {"python": "3.99", "ray": null, "vllm": null, "worker": null}\'\n')
    python.chmod(0o755)
    assert main(gen_samples(micro_spec_file, str(python))) == 2
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert f"resources.vllm_python: {python} is Python 3.99, this environment's is {here}" in one_error_line(capsys)


def test_serve_bench_in_an_environment_without_vllm_is_one_line(micro_spec_file, micro_assets, capsys):
    """This interpreter has no vLLM: refused before a prompt is read."""
    assert main(["serve-bench", str(micro_spec_file), "--draft", micro_assets["drafter"],
                 "--set", f"resources.vllm_python={sys.executable}"]) == 2
    assert f"opd serve-bench needs vLLM, which does not import in resources.vllm_python {sys.executable}" in \
        one_error_line(capsys)


def test_vllm_on_a_cluster_without_gpus_is_one_line(micro_spec_file, cpu_ray, monkeypatch, capsys):
    """An environment where vLLM imports (the stand-in), on a Ray cluster with no GPU: refused before a worker."""
    monkeypatch.setenv("PYTHONPATH", str(PACKAGE))
    assert main(gen_samples(micro_spec_file, sys.executable)) == 2
    line = one_error_line(capsys)
    assert "opd gen-samples --engine vllm needs vLLM on 1 GPU(s) and this Ray cluster has no GPU" in line
    assert f"resources.vllm_python: {sys.executable}" in line


def test_a_process_that_cannot_start_vllm_workers_says_so_in_one_line(micro_spec_file, monkeypatch):
    """opd/ never imports Ray: a vLLM worker starts as a Ray actor only where actors/isolated.py is imported."""
    from opd.errors import OpdError
    from opd.serving import engine

    monkeypatch.setattr(engine, "_STARTS", [])
    with pytest.raises(OpdError, match="x: this process cannot start a vLLM worker .*import actors.isolated first"):
        engine.vllm_worker(load_spec(micro_spec_file), {"tensor_parallel_size": 1}, "x")
