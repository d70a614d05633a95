"""The rebuilt-source rollout from a tensor-parallel serving engine: `rollout.sampler: vllm` with vLLM's
tensor_parallel_size from `resources.rollout.gpus_per_replica` (2, or 1 on a one-GPU machine), greedy, against the
HF speculative decoder's text, then trained on the scorer's rebuilt blocks. Runs as is on a CUDA machine with the
`[gpu]` extra; skipped here."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from opd.spec import load_spec
from opd.train.local import LocalTrainer

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (pip install -e .[gpu])")


@pytest.mark.gpu
@cuda
@vllm
def test_tensor_parallel_vllm_rollouts_are_rebuilt_and_trained_on(vllm_spec_file, tmp_path):
    degree = 2 if torch.cuda.device_count() >= 2 else 1  # the micro target's 2 key/value heads allow 2
    sets = ["rollout.source=target", "rollout.max_new_tokens=16", "steps=2", "eval.every=0", "models.dtype=float32"]
    hf = LocalTrainer(load_spec(vllm_spec_file, [*sets, f"tracking.run_dir={tmp_path / 'hf'}"]), track=False)
    tp = LocalTrainer(load_spec(vllm_spec_file, [*sets, "rollout.sampler=vllm",
                                                 f"resources.rollout.gpus_per_replica={degree}",
                                                 "resources.cluster.num_cpus=null",
                                                 f"tracking.run_dir={tmp_path / 'vllm'}"]), track=False)
    assert tp.rollout.sampler.spec.resources.rollout.gpus_per_replica == degree
    same = sum(a.response_ids == b.response_ids for a, b in zip(hf.rollout.run(0).records, tp.rollout.run(0).records))
    assert same >= 1  # greedy text agrees (float kernels may split a near-tie)
    assert tp.rollout.sampler.llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size == degree
    result = tp.run()
    assert result.steps == 2 and all(loss == loss for loss in result.losses)
