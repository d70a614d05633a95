"""A target sharded over 2 gloo processes (transformers' tensor-parallel plan) against the same target whole, on the
tiny Qwen3 assets in fp32: features within 1e-5; logits, final hidden states of packed replay and the teacher's
logits over its slots within 1e-5 plus 1e-5 of their size (entries reach 5-20, and splitting a projection's sum
in two moves fp32 results by a few ulps of that); greedy and sampled speculative decodes and rebuilt blocks
token for token (tests/sharded_worker.py runs both sides; the whole target's side runs here, on one thread as the
ranks do, while the ranks run)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import sharded_worker
import torch

from opd.errors import OpdError
from opd.models.sharding import check_sinks, load_sharded_target
from opd.train.distributed import free_address

WORKER = Path(sharded_worker.__file__)
TOL = 1e-5
CLOSE = {"logits": TOL, "features": 0, "scored_teacher": TOL, "scored_features": 0, "view_teacher": TOL,
         "teacher_logits": TOL}  # name: relative tolerance on top of TOL
EQUAL = ("greedy", "sampled", "rebuilt")


def start_sharded(world: int, out: Path, *model: str) -> list[subprocess.Popen]:
    """`world` worker processes over one gloo group, running (`model`: a model directory and attention
    implementation for `run_forward`)."""
    port = free_address().rsplit(":", 1)[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return [subprocess.Popen([sys.executable, str(WORKER), str(rank), str(world), port, str(out), *model], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for rank in range(world)]


def finish_sharded(procs: list[subprocess.Popen], out: Path) -> dict:
    """Rank 0's results, once every rank has exited cleanly."""
    logs = [p.communicate(timeout=240)[0] for p in procs]
    failed = [(rank, log) for rank, (p, log) in enumerate(zip(procs, logs)) if p.returncode]
    assert not failed, f"rank {failed[0][0]} failed:\n{failed[0][1][-3000:]}"
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("sharded") / "rank0.pt"
    procs = start_sharded(2, out)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        whole = sharded_worker.run_all(*sharded_worker.load(1))
    finally:
        torch.set_num_threads(threads)
    return finish_sharded(procs, out), whole


@pytest.mark.parametrize("name", CLOSE)
def test_sharded_tensors_match_the_whole_target(results, name):
    sharded, whole = results
    assert sharded[name].shape == whole[name].shape
    torch.testing.assert_close(sharded[name], whole[name], rtol=CLOSE[name], atol=TOL)


@pytest.mark.parametrize("name", EQUAL)
def test_sharded_decodes_and_rebuilds_are_identical(results, name):
    sharded, whole = results
    assert sharded[name] == whole[name]
    assert any(sum(accepted) for _, _, _, accepted in whole[name])  # the drafter is accepted somewhere


def test_sharding_without_its_group_is_refused():
    with pytest.raises(OpdError, match="needs their process group"):
        load_sharded_target(str(sharded_worker.TINY / "target"), dtype=torch.float32, attn_implementation="sdpa",
                            layer_ids=[1, 3], device="cpu", world=2)


def test_sinks_sharded_unlike_their_heads_are_refused(tmp_path):
    model = _micro_gpt_oss()
    layer = model.model.layers[1].self_attn
    layer.sinks = torch.nn.Parameter(layer.sinks.detach()[:2])  # as if split over 2 ranks while the heads are not
    with pytest.raises(OpdError, match=r"model.layers.1.self_attn.sinks holds 2 of 4 heads' sinks but the rank runs 4"):
        check_sinks(model)


def _micro_gpt_oss():
    """gpt-oss in miniature: sinks, alternating sliding and full layers, 4 experts (its plan shards the experts
    and the embedding, not the attention)."""
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(0)
    config = GptOssConfig(vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=3,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                          num_experts_per_tok=2, sliding_window=4, tie_word_embeddings=False,
                          layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    model = GptOssForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_()
    return model


def _micro_qwen3_moe():
    """Qwen3-MoE in miniature: attention split over the ranks by heads, 4 experts split by expert parallelism."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
        tie_word_embeddings=False))


@pytest.mark.slow
@pytest.mark.parametrize(("build", "attn_implementation"), [(_micro_qwen3_moe, "sdpa"), (_micro_gpt_oss, "eager")])
def test_sharded_moe_and_sink_targets_match_the_whole_target(tmp_path, build, attn_implementation):
    build().save_pretrained(tmp_path / "model")
    model = (str(tmp_path / "model"), attn_implementation)
    procs = start_sharded(2, tmp_path / "rank0.pt", *model)
    whole = sharded_worker.run_forward(sharded_worker.load_model(*model, 1))
    sharded = finish_sharded(procs, tmp_path / "rank0.pt")
    for name, value in whole.items():
        torch.testing.assert_close(sharded[name], value, rtol=0, atol=TOL, msg=name)
