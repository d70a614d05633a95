"""A target sharded over 2 gloo processes (transformers' tensor-parallel plan) against the same target whole, on the
tiny Qwen3 assets in fp32: features within 1e-5; logits, final hidden states of packed replay and the teacher's
logits over its slots within 1e-5 plus 1e-5 of their size (entries reach 5-20, and splitting a projection's sum
in two moves fp32 results by a few ulps of that); greedy and sampled speculative decodes and rebuilt blocks
token for token; the evaluator's held-out rows (tests/sharded_worker.py runs both sides; the whole target's side runs here, on one thread as the
ranks do, while the ranks run). In the same processes, a float64 micro target with one key/value head, which 2
ranks hold whole (its attention replicated: opd/models/sharding.py `attention_splits`): the same comparisons, and
the chi-square test of sampled decoding at T=1 against the target's exact law (tests/helpers/lossless.py). At 4
ranks (`slow`: four ranks on 2 cores take half a minute), micro targets whose 4 key/value
heads split and whose 1 is replicated."""

from __future__ import annotations

import re
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import pytest
import sharded_worker
import torch

from opd.decoding.sampling import Sampling
from opd.errors import OpdError
from opd.models.sharding import check_sinks, distributed_config, load_sharded_target
from opd.tiny.micro import micro_target
from opd.train.distributed import free_address
from tests.helpers import forked
from tests.helpers.decoding import EOS as MICRO_EOS
from tests.helpers.decoding import PROMPT
from tests.helpers.lossless import chi_square, exact_joint

TOL = 1e-5
CLOSE = {"logits": TOL, "features": 0, "scored_teacher": TOL, "scored_features": 0, "view_teacher": TOL,
         "teacher_logits": TOL}  # name: relative tolerance on top of TOL
EQUAL = ("greedy", "sampled", "rebuilt")
MICRO_CLOSE = ("logits", "features", "packed_hidden", "packed_features")
MICRO_EQUAL = ("greedy", "sampled")


def start_sharded(world: int, out: Path, *mode: str) -> list[BaseProcess]:
    """`world` worker processes over one gloo group, running `mode` (tests/sharded_worker.py `main`), forked from
    this process (tests/helpers/forked.py); rank r's output goes to `out`.rank{r}.log."""
    port = int(free_address().rsplit(":", 1)[1])
    return [forked.start(sharded_worker.main, rank, world, port, str(out), list(mode), log=_log(out, rank))
            for rank in range(world)]


def _log(out: Path, rank: int) -> Path:
    return out.with_name(f"{out.name}.rank{rank}.log")


def save_micro(path: Path, kv_heads: int) -> str:
    """The float64 micro target (8 tokens, 4 heads) with `kv_heads` key/value heads, as a model directory."""
    model: Any = micro_target(seed=0, vocab_size=8, num_heads=4, num_kv_heads=kv_heads, layer_ids=[0, 2]).model
    model.save_pretrained(path)
    return str(path)


def whole_side(run):
    """`run()` in this process on one thread, as each rank runs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return run()
    finally:
        torch.set_num_threads(threads)


def finish_sharded(procs: list[BaseProcess], out: Path) -> dict:
    """Rank 0's results, once every rank has exited cleanly."""
    forked.join(procs, [_log(out, rank) for rank in range(len(procs))])
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sharded")
    micro = save_micro(tmp / "micro-mqa", kv_heads=1)
    procs = start_sharded(2, tmp / "rank0.pt", "all", micro)
    whole = whole_side(lambda: {**sharded_worker.run_tiny(1, str(tmp / "whole.samples.jsonl")),
                                **sharded_worker.run_micros([micro], 1, lossless=False)})
    return finish_sharded(procs, tmp / "rank0.pt"), whole


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


def test_a_sharded_evaluator_measures_what_the_whole_one_does(results):
    """The evaluator (opd/train/evaluator.py) over 2 ranks: the same held-out samples drawn, into one file (rank 1
    draws into a copy of its own), and the same rows: offline τ, acceptance profile, greedy match."""
    sharded, whole = results
    assert sharded["eval_samples"] == whole["eval_samples"] > 0
    assert sharded["eval_rows"] == whole["eval_rows"]
    assert [r["offline"] for r in whole["eval_rows"]] == [True, True]


@pytest.mark.parametrize("name", [f"micro0_{n}" for n in MICRO_CLOSE + MICRO_EQUAL])
def test_a_target_with_replicated_attention_matches_the_whole_target(results, name):
    assert_same(*results, name)


def test_sharded_sampling_is_lossless(results):
    """The first three tokens of 10k sharded decodes at T=1 follow the target's exact joint law (chi-square)."""
    assert_lossless(results[0]["micro0_counts"], 1)


@pytest.mark.slow
def test_four_ranks_match_the_whole_target(tmp_path):
    """4 gloo ranks: 4 key/value heads split one per rank, and 1 replicated; the same checks as at 2 ranks."""
    micros = [save_micro(tmp_path / f"micro-kv{kv}", kv) for kv in (4, 1)]
    procs = start_sharded(4, tmp_path / "rank0.pt", "micro", *micros)
    whole = whole_side(lambda: sharded_worker.run_micros(micros, 1, lossless=False))
    sharded = finish_sharded(procs, tmp_path / "rank0.pt")
    for i, kv in enumerate((4, 1)):
        for name in MICRO_CLOSE + MICRO_EQUAL:
            assert_same(sharded, whole, f"micro{i}_{name}")
        assert_lossless(sharded[f"micro{i}_counts"], kv)


def test_past_the_key_value_heads_the_plan_keeps_the_attention_whole(tmp_path):
    """The plan `load_sharded_target` asks transformers for: the model's own where the degree divides the key/value
    heads, its attention rules replicated where it does not, and the model's own again where it has none."""
    mha, mqa = save_micro(tmp_path / "kv4", 4), save_micro(tmp_path / "kv1", 1)
    _micro_gpt_oss().config.save_pretrained(tmp_path / "gpt-oss")
    assert distributed_config(mha, 4, torch.float32).tp_plan == "auto"
    whole = distributed_config(mqa, 2, torch.float32).tp_plan
    assert whole == {f"model.layers.*.self_attn.{m}": "replicate" for m in
                     ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")}
    assert distributed_config(str(tmp_path / "gpt-oss"), 4, torch.float32).tp_plan == "auto"


def assert_same(sharded: dict, whole: dict, name: str) -> None:
    """Tensors within TOL (float64: no relative slack), decodes token for token."""
    if isinstance(whole[name], torch.Tensor):
        torch.testing.assert_close(sharded[name], whole[name], rtol=0, atol=TOL, msg=name)
    else:
        assert sharded[name] == whole[name], name


def assert_lossless(counts: dict, kv_heads: int) -> None:
    target = micro_target(seed=0, vocab_size=8, num_heads=4, num_kv_heads=kv_heads, layer_ids=[0, 2])
    n = sharded_worker.LOSSLESS_SAMPLES
    stat, critical = chi_square(counts, exact_joint(target, PROMPT, Sampling(1.0), 3, MICRO_EOS), n)
    assert stat < critical, f"chi2 {stat:.1f} >= {critical:.1f}"


def test_a_collective_that_a_peer_never_joins_times_out_naming_its_module(tmp_path):
    """A stalled peer (issue 63): rank 0's forward fails after the group's timeout instead of waiting forever, and
    its line names the sharded module whose collective it was in, beside gloo's transport operation."""
    micro = save_micro(tmp_path / "micro", kv_heads=2)
    out = tmp_path / "stall.pt"
    line = finish_sharded(start_sharded(2, out, "stall", micro), out)["line"]
    assert re.search(r"[Tt]imed out.* \(in the collective of model\.\S+, its weight sharded on dim [01]\)$", line), line


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


def _micro_qwen3_5_moe():
    """Qwen3.5-MoE in miniature, laid out as the big ones are: one key/value head (fewer than the ranks, so each
    rank holds the attention whole), Gated DeltaNet layers, 4 experts split by expert parallelism, a shared
    expert."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    torch.manual_seed(0)
    return Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1,
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
        moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
        full_attention_interval=4, tie_word_embeddings=False))


@pytest.mark.parametrize(("build", "attn_implementation"), [(_micro_qwen3_moe, "sdpa"), (_micro_gpt_oss, "eager"),
                                                            (_micro_qwen3_5_moe, "sdpa")])
def test_sharded_moe_and_sink_targets_match_the_whole_target(tmp_path, build, attn_implementation):
    build().save_pretrained(tmp_path / "model")
    model = (str(tmp_path / "model"), attn_implementation)
    procs = start_sharded(2, tmp_path / "rank0.pt", "model", *model)
    whole = sharded_worker.run_forward(sharded_worker.load_model(*model, 1))
    sharded = finish_sharded(procs, tmp_path / "rank0.pt")
    for name, value in whole.items():
        torch.testing.assert_close(sharded[name], value, rtol=0, atol=TOL, msg=name)
