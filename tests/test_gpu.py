"""The GPU path: flash-attn targets, vLLM serving of an exported drafter, and bench/gpu.py.

The `gpu` tests are deselected by default (`pytest -m gpu` runs them) and skip without CUDA, flash-attn or vLLM.
`bench/gpu.py --tiny` runs end to end on the CPU in a subprocess under `make test-all` (`slow`); `make test` keeps
the in-process check of its time guard and output format.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from opd.cli import main
from opd.decoding.autoregressive import generate_autoregressive
from opd.decoding.sampling import Sampling
from opd.decoding.speculative import SpeculativeDecoder
from opd.models.target import load_target
from opd.spec import ResourcesSpec
from opd.tiny.micro import micro_drafter, micro_target
from tests.helpers.vllm_assets import LAYERS

ROOT = Path(__file__).resolve().parents[1]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
flash_attn = pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None, reason="needs flash-attn")
vllm = pytest.mark.skipif(not Path(ResourcesSpec().vllm_python).exists(),
                          reason=f"needs the vLLM environment at {ResourcesSpec().vllm_python} (make vllm-env)")
EOS, MASK = 6, 7


@pytest.fixture(scope="module")
def vocab8_target_dir(tmp_path_factory) -> str:
    """A micro target with flash-attn-sized heads (4 x 64) and 8 tokens, so random drafts are often accepted."""
    path = tmp_path_factory.mktemp("fa2") / "target"
    micro_target(vocab_size=8, hidden_size=256, num_kv_heads=2, dtype=torch.float32, layer_ids=LAYERS
                 ).model.save_pretrained(path)
    return str(path)


def gpu_target(path: str, dtype: torch.dtype, attn: str):
    return load_target(path, dtype=dtype, attn_implementation=attn, layer_ids=LAYERS).to("cuda")


@pytest.mark.gpu
@cuda
@flash_attn
def test_flash_attention_target_is_as_accurate_as_sdpa_with_padding_and_holes(vocab8_target_dir):
    """bf16 flash-attn vs a float32 reference must err no more than bf16 sdpa does, at every valid position of a
    batch with left padding and a masked hole (what ragged speculative decoding leaves in the KV cache)."""
    ids = torch.randint(0, 8, (2, 16), generator=torch.Generator().manual_seed(0)).cuda()
    mask = torch.ones_like(ids)
    mask[0, :3], mask[1, 6:9] = 0, 0
    positions, valid = (mask.cumsum(-1) - 1).clamp_min(0), mask.bool()
    out = {}
    for name, dtype, attn in [("ref", torch.float32, "sdpa"), ("sdpa", torch.bfloat16, "sdpa"),
                              ("flash", torch.bfloat16, "flash_attention_2")]:
        target = gpu_target(vocab8_target_dir, dtype, attn)
        assert target.model.config._attn_implementation == attn
        o = target(ids, attention_mask=mask, position_ids=positions)
        out[name] = (o.logits.float()[valid], o.features.float()[valid])
    for i in range(2):  # logits, then features
        sdpa_err = (out["sdpa"][i] - out["ref"][i]).abs().max().item()
        flash_err = (out["flash"][i] - out["ref"][i]).abs().max().item()
        assert flash_err <= 2 * sdpa_err + 1e-3, (i, flash_err, sdpa_err)


@pytest.mark.gpu
@cuda
@flash_attn
def test_flash_attention_greedy_speculative_equals_autoregressive(vocab8_target_dir):
    """Token for token, except where the bf16 target itself is undecided: a response may leave the autoregressive
    one only at a near-tie of its top two logits (float32 ties are what tests/test_decoding.py rules out)."""
    target = gpu_target(vocab8_target_dir, torch.bfloat16, "flash_attention_2")
    prompts = [[1, 2, 3], [4, 5], [1, 1, 1, 1, 2], [3], [2, 2], [0, 1, 2, 3, 4, 5], [5, 4], [1]]
    records = SpeculativeDecoder(target, micro_drafter(target, seed=1, mask_token_id=MASK), eos_id=EOS).generate(
        prompts, Sampling(), max_new_tokens=32)
    baseline = generate_autoregressive(target, prompts, Sampling(), max_new_tokens=32, eos_id=EOS)
    assert any(r > 0 for rec in records for r in rec.accepted)  # drafts accepted and rejected: ragged holes
    same = 0
    for prompt, rec, base in zip(prompts, records, baseline):
        diverge = next((i for i, (a, b) in enumerate(zip(rec.response_ids, base)) if a != b), None)
        if diverge is None:
            same += rec.response_ids == base
            continue
        logits = target(torch.tensor([prompt + base[:diverge]], device="cuda")).logits[0, -1].float()
        top2 = logits.topk(2).values
        assert top2[0] - top2[1] <= 0.03 * logits.abs().max(), f"prompt {prompt}: diverged at {diverge}, no tie"
    assert same >= len(prompts) // 2


@pytest.mark.gpu
@cuda
@vllm
def test_vllm_generates_sft_data_and_serves_the_exported_drafter(vllm_spec_file, tmp_path):
    assert main(["gen-sft-data", str(vllm_spec_file), "--engine", "vllm"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "runs" / "vllm" / "sft_data.jsonl").read_text().splitlines()]
    assert len(rows) == 40 and all(1 <= len(r["response_ids"]) <= 16 for r in rows)

    out = tmp_path / "serve.json"
    assert main(["serve-bench", str(vllm_spec_file), "--draft", str(tmp_path / "drafter"), "--concurrency", "1,4",
                 "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["drafter"], r["concurrency"]) for r in rows] == [("target only", 1), ("target only", 4),
                                                                (str(tmp_path / "drafter"), 1),
                                                                (str(tmp_path / "drafter"), 4)]
    assert all(r["tokens_per_s"] > 0 and r["output_tokens"] > 0 for r in rows)
    assert all(1.0 <= r["tau"] <= 4.0 for r in rows[2:])  # vLLM speculated with it: τ within [1, K]


@pytest.mark.gpu
@cuda
@vllm
def test_vllm_samples_rollouts_that_the_scorer_rebuilds_and_trains_on(vllm_spec_file, tmp_path):
    """rollout.source target with vLLM's plain sampling: greedy samples equal the HF speculative decoder's text,
    and the run trains on the rebuilt blocks."""
    from opd.spec import load_spec
    from opd.train.local import LocalTrainer

    sets = ["rollout.source=target", "rollout.max_new_tokens=16", "steps=2", "eval.every=0", "models.dtype=float32"]
    hf = LocalTrainer(load_spec(vllm_spec_file, [*sets, f"tracking.run_dir={tmp_path / 'hf'}"]), track=False)
    vllm_run = LocalTrainer(load_spec(vllm_spec_file, [*sets, "rollout.sampler=vllm",
                                                       f"tracking.run_dir={tmp_path / 'vllm'}"]), track=False)
    same = sum(a.response_ids == b.response_ids
               for a, b in zip(hf.rollout.run(0).records, vllm_run.rollout.run(0).records))
    assert same >= 1  # greedy text agrees (float kernels may split a near-tie)
    result = vllm_run.run()
    assert result.steps == 2 and all(loss == loss for loss in result.losses)


# ------------------------------------------------------------------------------------------------ bench/gpu.py

SECTIONS = {"decode": {"mode", "batch", "tokens_per_s", "ms_per_step", "seconds", "runs"},
            "replay": {"batch", "length", "anchors", "anchors_per_s", "tokens_per_s", "seconds"},
            "learner": {"anchors", "anchors_per_s", "loss", "seconds"}}


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["dflash", "eagle3"])
def test_bench_gpu_tiny_runs_end_to_end(tmp_path, drafter):
    out = tmp_path / "gpu.json"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu.py"), "--tiny", "--drafter", drafter,
                          "--json", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(out.read_text())
    assert result["tiny"] and not result["errors"] and not result["skipped"]
    assert result["drafter"]["kind"] == drafter
    assert {"device", "dtype", "attn_implementation", "target_shapes", "drafter", "budget_s", "elapsed_s",
            "note"} <= set(result)
    assert [(r["mode"], r["batch"]) for r in result["decode"]] == [
        ("autoregressive", 1), ("speculative", 1), ("autoregressive", 4), ("speculative", 4),
        ("speculative_static", 4)]
    block = result["drafter"]["block_size"]  # dflash: the tiny plan's 4; eagle3: 8
    assert all(1.0 <= r["tau"] <= block for r in result["decode"] if r["mode"].startswith("speculative"))
    for section, keys in SECTIONS.items():
        assert result[section] and all(keys <= set(row) for row in result[section]), section


@pytest.mark.parametrize("drafter", ["dflash", "eagle3"])
def test_bench_gpu_time_guard_skips_what_does_not_fit(tmp_path, monkeypatch, drafter):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    gpu = importlib.import_module("gpu")
    assert gpu.main(["--tiny", "--budget-s", "0", "--drafter", drafter, "--json", str(tmp_path / "gpu.json")]) == 0
    result = json.loads((tmp_path / "gpu.json").read_text())
    assert result["decode"] == result["replay"] == result["learner"] == [] and not result["errors"]
    assert result["drafter"] == ({"kind": "dflash", "num_layers": 1, "block_size": 4} if drafter == "dflash" else
                                 {"kind": "eagle3", "block_size": 8, "draft_vocab_size": 512,
                                  "aux_layer_ids": [2, 3, 3]})
    assert len(result["skipped"]) == 8  # 2 batches x 2 modes + static at batch 4, 2 replay batches, 1 learner step
