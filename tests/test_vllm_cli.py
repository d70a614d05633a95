"""`opd gen-sft-data` and `opd serve-bench` without a GPU.

The HF engine runs for real on the micro models. vLLM cannot run here, so: a missing vLLM environment is one
`error:` line naming resources.vllm_python; argument errors are caught before the environment is even looked at;
and the glue (resume, sampling mapping, the fixed-concurrency loop, τ from counter deltas, speedup) runs in a real
vLLM worker actor of its own interpreter, against a stand-in `vllm` package that implements the few calls it
makes. The stand-in encodes our reading of vLLM's API, so these tests check our code, not vLLM:
tests/test_gpu.py runs the real thing.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from opd.cli import main
from opd.spec import load_spec
from tests.helpers.fake_vllm import VLLM_SETS, fake_vllm, fake_vllm_ray  # noqa: F401 (fixtures)


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "Traceback" not in err[0], err
    return err[0]


NO_VLLM = ["--set", "resources.vllm_python=/nonexistent/vllm/bin/python"]  # a machine without the vLLM environment
SETS = [arg for s in VLLM_SETS for arg in ("--set", s)]  # this interpreter with the stand-in vLLM, one logical GPU


def names_the_missing_environment(line: str) -> bool:
    return "resources.vllm_python: /nonexistent/vllm/bin/python does not exist" in line and "make vllm-env" in line


# ------------------------------------------------------------------------------------------------ gen-sft-data


def test_gen_sft_data_hf_resumes_to_the_same_file_and_opd_sft_reuses_it(micro_spec_file, tmp_path):
    """gen-sft-data is `gen-samples --sft`: rows of the sample store, stamped with what made them."""
    sets = ["--set", "rollout.temperature=0", "--set", "sft.response_max_new_tokens=6"]
    spec = load_spec(micro_spec_file)
    cache = spec.run_dir / "sft_data.jsonl"
    assert main(["gen-sft-data", str(micro_spec_file), *sets]) == 0
    full = cache.read_text()
    rows = [json.loads(line) for line in full.splitlines()]
    assert len(rows) == 40 and all(r["max_new_tokens"] == 6 and r["sample"] == 0 for r in rows)
    assert all(r["sampling"] == {"temperature": 0.0, "top_p": 1.0, "top_k": 0} for r in rows)
    assert all(1 <= len(r["response_ids"]) <= 6 for r in rows)

    cache.write_text("".join(full.splitlines(keepends=True)[:13]))  # interrupted after 13 rows
    assert main(["gen-samples", str(micro_spec_file), "--sft", *sets]) == 0  # the same store, by its own name
    assert cache.read_text() == full  # greedy: the resumed file equals the uninterrupted one

    assert main(["sft", str(micro_spec_file), "--out", str(tmp_path / "d"), *sets, "--set", "sft.epochs=1",
                 "--set", "sft.batch_size=20", "--set", "sft.anchors_per_seq=2"]) == 0
    assert cache.read_text() == full  # opd sft trained on them without generating again


def test_sft_data_drawn_at_another_length_is_refused_before_training(micro_spec_file, tmp_path, capsys):
    sets = ["--set", "rollout.temperature=0", "--set", "sft.response_max_new_tokens=6"]
    assert main(["gen-sft-data", str(micro_spec_file), *sets]) == 0
    capsys.readouterr()
    assert main(["sft", str(micro_spec_file), "--out", str(tmp_path / "d"), "--set", "rollout.temperature=0",
                 "--set", "sft.response_max_new_tokens=8"]) == 2
    line = one_error_line(capsys)
    assert "line 1: max_new_tokens is 6, this run's is 8" in line and "opd gen-samples CONFIG --sft" in line
    assert not (tmp_path / "d").exists()


def test_gen_sft_data_vllm_without_vllm_is_one_line(micro_spec_file, capsys):
    assert main(["gen-sft-data", str(micro_spec_file), "--engine", "vllm", *NO_VLLM]) == 2
    assert names_the_missing_environment(one_error_line(capsys))


def test_gen_sft_data_vllm_writes_the_same_rows_and_resumes(micro_spec_file, tmp_path, fake_vllm):
    out = tmp_path / "data" / "sft.jsonl"
    args = ["gen-sft-data", str(micro_spec_file), "--engine", "vllm", "--out", str(out), *SETS,
            "--set", "sft.response_temperature=0.7", "--set", "sft.response_max_new_tokens=5"]
    assert main(args) == 0
    full = out.read_text()
    rows = [json.loads(line) for line in full.splitlines()]
    assert len(rows) == 40 and all(r["response_ids"] == r["prompt_ids"][:2] + [9] for r in rows)
    (llm,) = fake_vllm.made()
    prompts, params = llm.calls[0]
    assert [p["prompt_token_ids"] for p in prompts] == [r["prompt_ids"] for r in rows]
    assert {(q.temperature, q.top_k, q.top_p, q.max_tokens) for q in params} == {(0.7, -1, 1.0, 5)}
    spec = load_spec(micro_spec_file)
    assert llm.kwargs["model"] == spec.models.target_path and llm.kwargs["dtype"] == "float32"

    out.write_text("".join(full.splitlines(keepends=True)[:30]))  # interrupted after 30 rows
    assert main(args) == 0
    resumed = fake_vllm.made()[1]
    assert len(resumed.calls) == 1 and [p["prompt_token_ids"] for p in resumed.calls[0][0]] == \
        [r["prompt_ids"] for r in rows[30:]]  # only the 10 missing prompts
    assert out.read_text() == full
    assert main(args) == 0 and len(fake_vllm.made()) == 2  # all done: no engine is even started


# ------------------------------------------------------------------------------------------ rollout from vLLM


def test_rollouts_sampled_by_vllm_are_rebuilt_and_trained_on(micro_spec_file, tmp_path, fake_vllm):
    """rollout.source target, sampler vllm: one engine, one seeded request per prompt (keyed like every other
    sampler, so a sample does not depend on its batch), the blocks rebuilt by the scorer, and the run trains."""
    from opd.data.prompts import prompt_key
    from opd.train.local import LocalTrainer

    spec = load_spec(micro_spec_file, [*VLLM_SETS, "rollout.source=target", "rollout.sampler=vllm", "steps=2",
                                       "eval.every=0",
                                       "rollout.top_k=5", f"tracking.run_dir={tmp_path / 'run'}"])
    trainer = LocalTrainer(spec, track=False)
    result = trainer.run()
    assert result.steps == 2 and all(loss == loss for loss in result.losses)
    (llm,) = fake_vllm.made()
    assert len(llm.calls) == 4  # two rollout batches per step
    prompts, params = llm.calls[0]
    chosen = trainer.rollout.prompts_for(0)
    assert [p["prompt_token_ids"] for p in prompts] == [p.ids for p, _ in chosen]
    assert [q.seed for q in params] == [spec.seed * 1_000_003 + prompt_key(p.id, e) for p, e in chosen]
    assert {(q.temperature, q.top_k, q.top_p, q.max_tokens) for q in params} == {(1.0, 5, 1.0, 12)}
    batch = trainer.scorer(trainer.rollout.run(0))
    assert [r.response_ids for r in batch.batch.records] == [(p.ids[:2] + [9]) for p, _ in chosen]
    assert all(r.anchors[0] == 0 and r.draft_version == 2 for r in batch.batch.records)  # rebuilt, newest weights
    assert batch.batch.flops.target_forward > 0  # sampling and rebuilding are counted


# make test-all: a Ray run of four actors. The sampler, its requests and the training on its samples are
# test_rollouts_sampled_by_vllm_are_rebuilt_and_trained_on's; this adds where Ray places the vLLM worker.
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_rollout_replica_leaves_its_gpu_to_its_vllm_worker_and_trains_as_locally(micro_spec_file, tmp_path,
                                                                                   fake_vllm):
    """On Ray the rollout actor holds no GPU: its vLLM worker takes the bundle's, in the rollout's placement group,
    and the steps equal the single-process run's."""
    import ray

    from actors.driver import RayRun
    from opd.train.local import LocalTrainer

    sets = [*VLLM_SETS, "rollout.source=target", "rollout.sampler=vllm", "steps=2", "eval.every=0",
            "resources.cluster.num_gpus=2", "resources.rollout.num_gpus=1", "resources.evaluator.num_gpus=1",
            "resources.evaluator.num_cpus=0.25",
            "resources.max_policy_lag=0"]
    local = LocalTrainer(load_spec(micro_spec_file, [*sets, f"tracking.run_dir={tmp_path / 'local'}"]),
                         track=False).run().losses
    run = RayRun(load_spec(micro_spec_file, [*sets, "engine=ray", f"tracking.run_dir={tmp_path / 'ray'}"]),
                 track=False)
    try:
        assert run.start() == 0
        losses = [r["metrics"]["loss"] for step in (1, 2) for r in run.train(step)]
        held = ray.get(run.rollouts[0].__ray_call__.remote(
            lambda actor: ray.get_runtime_context().get_assigned_resources()))
        assert not any(name.startswith("GPU") for name in held), held  # the rollout actor holds no GPU ...
        free = ray.available_resources()
        assert free.get(f"GPU_group_{run.replicas[0].group.id.hex()}", 0) == 0  # ... and its bundle's GPU is taken: vLLM's
    finally:
        run.shutdown()
    assert losses == pytest.approx(local, rel=1e-5, abs=1e-7)


def test_a_vllm_rollout_without_vllm_is_one_line(micro_spec_file, capsys):
    assert main(["gen-samples", str(micro_spec_file), "--engine", "vllm", *NO_VLLM]) == 2
    assert names_the_missing_environment(one_error_line(capsys))
    assert main(["validate", str(micro_spec_file), "--set", "rollout.source=target", "--set", "rollout.sampler=vllm",
                 *NO_VLLM]) == 2  # checked with the other inputs, before any model loads
    assert names_the_missing_environment(one_error_line(capsys))


# ------------------------------------------------------------------------------------------------ serve-bench


def test_serve_bench_without_vllm_is_one_line(micro_spec_file, micro_assets, capsys):
    assert main(["serve-bench", str(micro_spec_file), "--draft", micro_assets["drafter"], *NO_VLLM]) == 2
    assert names_the_missing_environment(one_error_line(capsys))


@pytest.mark.parametrize("levels", ["1,x", "0,4", "4,4", "", "1,,2"])
def test_serve_bench_bad_concurrency_is_one_line(micro_spec_file, micro_assets, capsys, levels):
    assert main(["serve-bench", str(micro_spec_file), "--draft", micro_assets["drafter"],
                 "--concurrency", levels]) == 2
    assert "--concurrency" in one_error_line(capsys)


def test_serve_bench_missing_or_mismatched_drafter_is_one_line(micro_spec_file, micro_assets, tmp_path,
                                                               capsys):
    assert main(["serve-bench", str(micro_spec_file), "--draft", micro_assets["drafter"],
                 "--draft", "/nonexistent/drafter"]) == 2
    assert "/nonexistent/drafter" in one_error_line(capsys)
    config = json.loads(Path(micro_assets["drafter"], "config.json").read_text())
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text(json.dumps({**config, "hidden_size": 64}))
    assert main(["serve-bench", str(micro_spec_file), "--draft", str(tmp_path / "other")]) == 2
    assert "hidden size 64" in one_error_line(capsys)


def test_serve_bench_reports_tau_speedup_and_holds_each_concurrency(micro_spec_file, micro_assets, tmp_path,
                                                                    fake_vllm, capsys):
    out = tmp_path / "serve.json"
    assert main(["serve-bench", str(micro_spec_file), "--draft", micro_assets["drafter"], "--concurrency", "1,3",
                 "--json", str(out), *SETS, "--set", "eval.max_new_tokens=7", "--set", "eval.num_prompts=10",
                 "--set", f"data.eval_prompts={micro_assets['train']}"]) == 0
    assert "vLLM serving" in capsys.readouterr().out  # the table (its cells wrap at the terminal's width)
    result = json.loads(out.read_text())
    rows = {(r["drafter"], r["concurrency"]): r for r in result["rows"]}
    assert list(rows) == [("target only", 1), ("target only", 3), (micro_assets["drafter"], 1),
                          (micro_assets["drafter"], 3)]
    for c in (1, 3):
        base, spec = rows["target only", c], rows[micro_assets["drafter"], c]
        assert base["tau"] is None and base["speedup"] is None
        assert spec["tau"] == pytest.approx(3.0)  # the warm-up's drafts are not counted
        assert spec["speedup"] == pytest.approx(spec["tokens_per_s"] / base["tokens_per_s"])
        assert spec["requests"] == 10 and spec["output_tokens"] == 10 * 7
    target_llm, drafter_llm = fake_vllm.made()
    assert target_llm.kwargs.get("speculative_config") is None and drafter_llm.kwargs["max_num_seqs"] == 3
    assert drafter_llm.kwargs["speculative_config"] == {"method": "dflash", "model": micro_assets["drafter"],
                                                        "num_speculative_tokens": 3}  # block size 4
    assert drafter_llm.peak == {"warmup": 3, "c1": 1, "c3": 3}


# ------------------------------------------------------------------------------------------ serve-bench, EAGLE-3

TINY = Path(__file__).resolve().parents[1] / "opd" / "assets" / "tiny"


def save_eagle3(path: Path, aux_layer_ids: list[int], block_size: int | None = 4, **config_changes) -> str:
    """A random EAGLE-3 drafter for the shipped tiny target (6 layers, hidden 256, vocabulary 2048), saved in the
    public layout (block_size None: left out, as SpecForge's files do); `config_changes` are then written into its
    config.json (None deletes a key)."""
    from torch import nn
    from transformers import AutoConfig

    from opd.formats.eagle3 import Eagle3Config
    from opd.models.eagle3 import Eagle3Drafter

    config = Eagle3Config.for_target(AutoConfig.from_pretrained(TINY / "target"), draft_vocab_size=512,
                                     block_size=block_size or 2, aux_layer_ids=aux_layer_ids)
    shared = nn.Embedding(config.vocab_size, config.hidden_size), nn.Linear(config.hidden_size, config.vocab_size)
    Eagle3Drafter(config, *shared).save_pretrained(path)
    hf = json.loads((path / "config.json").read_text()) | config_changes | (
        {} if block_size else {"block_size": None})
    (path / "config.json").write_text(json.dumps({k: v for k, v in hf.items() if v is not None}))
    return str(path)


@pytest.fixture
def tiny_spec_file(tmp_path) -> Path:
    """A spec on the shipped tiny target whose drafter is EAGLE-3 with block size 6 (no warm drafter)."""
    prompts = TINY / "prompts"
    spec = {"name": "e3", "seed": 0, "engine": "local", "steps": 1,
            "models": {"target_path": str(TINY / "target"), "dtype": "float32",
                       "drafter": {"kind": "eagle3", "block_size": 6}},
            "data": {"train_prompts": str(prompts / "train.jsonl"), "eval_prompts": str(prompts / "heldout.jsonl")},
            "tracking": {"run_dir": str(tmp_path / "runs" / "{name}")},
            "eval": {"num_prompts": 4, "max_new_tokens": 5, "sampling": [{"name": "greedy", "temperature": 0.0}]}}
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_serve_bench_serves_an_eagle3_drafter_as_method_eagle3(tiny_spec_file, tmp_path, fake_vllm):
    """K − 1 chain drafts: the file's block size, else the spec's (SpecForge's files have none)."""
    ours = save_eagle3(tmp_path / "ours", [2, 3, 4], block_size=4)
    public = save_eagle3(tmp_path / "public", [2, 3, 4], block_size=None)
    assert main(["serve-bench", str(tiny_spec_file), "--draft", ours, "--draft", public, "--no-baseline", *SETS,
                 "--concurrency", "2", "--json", str(tmp_path / "serve.json")]) == 0
    assert [llm.kwargs["speculative_config"] for llm in fake_vllm.made()] == [
        {"method": "eagle3", "model": ours, "num_speculative_tokens": 3},
        {"method": "eagle3", "model": public, "num_speculative_tokens": 5}]
    rows = json.loads((tmp_path / "serve.json").read_text())["rows"]
    assert [(r["drafter"], r["tau"]) for r in rows] == [(ours, pytest.approx(3.0)), (public, pytest.approx(3.0))]


def test_serve_bench_serves_both_families_side_by_side(tiny_spec_file, tmp_path, fake_vllm):
    """The shipped DFlash drafter and an EAGLE-3 drafter of the same target in one run, each as its own method."""
    dflash, eagle3 = str(TINY / "drafter"), save_eagle3(tmp_path / "e3", [2, 3, 5], block_size=5)
    assert main(["serve-bench", str(tiny_spec_file), "--draft", dflash, "--draft", eagle3, "--concurrency", "1",
                 *SETS]) == 0
    assert [llm.kwargs.get("speculative_config") for llm in fake_vllm.made()] == [
        None, {"method": "dflash", "model": dflash, "num_speculative_tokens": 7},
        {"method": "eagle3", "model": eagle3, "num_speculative_tokens": 4}]


@pytest.mark.parametrize(("change", "message"), [
    ({"vocab_size": 4096}, r"config field 'vocab_size' is 4096; expected 2048, the target's vocabulary"),
    ({"hidden_size": 128}, r"config field 'hidden_size' is 128; expected 256"),
    ({"target_hidden_size": 512}, r"config field 'target_hidden_size' is 512; expected 256"),
    ({"num_hidden_layers": 2}, r"config field 'num_hidden_layers' is 2; only one-layer EAGLE-3 drafters"),
    ({"draft_vocab_size": None}, r"config field 'draft_vocab_size' is missing"),
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 3, 9]}}, r"expected ids in 1\.\.5"),
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 3, 3]}},
     r"--draft .*/e3: eagle_config\.eagle_aux_hidden_state_layer_ids \[2, 3, 3\] repeat a layer, which vLLM "
     r"captures once, so its fc would get 2 states for 3 \(expected distinct ids\)"),
])
def test_serve_bench_refuses_an_unusable_eagle3_drafter_in_one_line(tiny_spec_file, tmp_path, capsys,
                                                                   change, message):
    draft = save_eagle3(tmp_path / "e3", [2, 3, 4], **change)
    assert main(["serve-bench", str(tiny_spec_file), "--draft", draft]) == 2
    line = one_error_line(capsys)
    assert re.search(message, line) and draft in line, line


def test_serve_bench_checks_an_eagle3_drafter_before_looking_for_vllm(tiny_spec_file, tmp_path, capsys):
    """A good EAGLE-3 drafter gets as far as the missing vLLM; a config.json that is not JSON is one line."""
    draft = save_eagle3(tmp_path / "e3", [2, 3, 4])
    assert main(["serve-bench", str(tiny_spec_file), "--draft", draft, *NO_VLLM]) == 2
    assert names_the_missing_environment(one_error_line(capsys))
    (tmp_path / "e3" / "config.json").write_text("{not json")
    assert main(["serve-bench", str(tiny_spec_file), "--draft", draft]) == 2
    assert f"--draft {draft}: {draft}/config.json: not valid JSON (Expecting property name" in one_error_line(capsys)


# ------------------------------------------------------------------------------------------ serve-bench, P-EAGLE

def test_serve_bench_serves_a_peagle_drafter_as_eagle3_drafting_in_parallel(tiny_spec_file, tmp_path, fake_vllm):
    """vLLM serves P-EAGLE as EAGLE-3 with parallel drafting, K − 1 the file's (its pard token is in the file)."""
    from torch import nn
    from transformers import AutoConfig

    from opd.formats.eagle3 import Eagle3Config
    from opd.formats.peagle import PEagleConfig
    from opd.models.peagle import PEagleDrafter

    eagle3 = Eagle3Config.for_target(AutoConfig.from_pretrained(TINY / "target"), draft_vocab_size=512, block_size=5,
                                     aux_layer_ids=[2, 3, 4])
    config = PEagleConfig.of(eagle3, mask_token_id=2)
    shared = nn.Embedding(config.vocab_size, config.hidden_size), nn.Linear(config.hidden_size, config.vocab_size)
    PEagleDrafter(config, *shared).save_pretrained(tmp_path / "pe")
    assert main(["serve-bench", str(tiny_spec_file), "--draft", str(tmp_path / "pe"), "--no-baseline",
                 "--concurrency", "1", *SETS]) == 0
    assert [llm.kwargs["speculative_config"] for llm in fake_vllm.made()] == [
        {"method": "eagle3", "model": str(tmp_path / "pe"), "num_speculative_tokens": 4, "parallel_drafting": True}]
