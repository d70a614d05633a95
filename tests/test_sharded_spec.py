"""`resources.<role>.gpus_per_replica`: a sharded role's layout and degree are refused in one line when the cluster
cannot hold it or the degree does not divide the target's heads or experts, or divide or be a multiple of its
key/value heads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from opd.cli import main
from opd.spec import load_spec

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"  # its target: 4 heads, 2 key/value heads


def refusal(tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str) -> str:
    """What `opd validate` prints for tiny.yaml changed by `text`: one line per problem."""
    config = tmp_path / "spec.yaml"
    config.write_text(f"base: {TINY}\n{text}")
    assert main(["validate", str(config), "--no-path-check"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err and all(line.startswith("error: ") for line in err.splitlines()), err
    return err


@pytest.mark.parametrize(("text", "expected"), [
    ("resources: {cluster: {num_cpus: 16}, scorer: {gpus_per_replica: 3}}",
     "resources.scorer.gpus_per_replica: 3 does not divide the target's num_attention_heads 4, num_key_value_heads 2"),
    ("resources: {cluster: {num_cpus: 16}, rollout: {gpus_per_replica: 8}}",
     "resources.rollout.gpus_per_replica: 8 does not divide the target's num_attention_heads 4 (expected"),
    ("resources: {cluster: {num_gpus: 16, gpus_per_node: 8}, evaluator: {num_gpus: 1},"
     " scorer: {num_gpus: 1, gpus_per_replica: 16}}",
     "resources.scorer.gpus_per_replica: 16 GPUs, but a node has cluster.gpus_per_node 8"),
    ("resources: {cluster: {num_gpus: 6, num_cpus: 16}, evaluator: {num_gpus: 1}, rollout: {replicas: 2, num_gpus: 1,"
     " gpus_per_replica: 2}, scorer: {num_gpus: 1, gpus_per_replica: 2}}",
     "resources.cluster.num_gpus: the roles need rollout 4 + scorer 2 + evaluator 1 = 7"),
    ("resources: {cluster: {num_gpus: 4}, rollout: {replicas: 2, num_gpus: 1, gpus_per_replica: 4},"
     " evaluator: {num_gpus: 1}}",
     "resources.rollout: 2 replicas x 4 GPUs = 8 GPUs, but the cluster declares 4"),
    ("resources: {cluster: {num_gpus: 8}, scorer: {num_gpus: 2, gpus_per_replica: 2}}",
     "resources.scorer.num_gpus: 2 with gpus_per_replica 2 (expected 1, a GPU per rank, or 0 for CPU ranks)"),
    ("resources: {learner: {gpus_per_replica: 2}}", "resources.learner.gpus_per_replica: 2 (expected 1"),
    ("resources: {cluster: {num_gpus: 18, gpus_per_node: 8}, evaluator: {num_gpus: 1}, learner: {num_gpus: 1},"
     " scorer: {num_gpus: 1, gpus_per_replica: 8}}",
     "resources.scorer: 8 ranks of 1 GPU beside the learner's 1 need 9 GPUs on one node, but cluster.gpus_per_node is"
     " 8"),
    ("resources: {evaluator: {num_cpus: 0, gpus_per_replica: 2}}",
     "resources.evaluator.num_cpus: 0 and num_gpus 0 with gpus_per_replica 2 (expected CPUs or GPUs per rank"),
])
def test_unschedulable_or_uneven_layouts_are_one_line(tmp_path, capsys, text, expected):
    assert expected in refusal(tmp_path, capsys, text)


def test_degree_counts_experts_and_a_nested_text_config(tmp_path, capsys):
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"num_hidden_layers": 6, "text_config": {
        "num_attention_heads": 32, "num_key_value_heads": 2, "num_experts": 6}}))
    err = refusal(tmp_path, capsys, f"models: {{target_path: {target}}}\nresources: {{cluster: {{num_cpus: 16}},"
                                    " scorer: {gpus_per_replica: 2}, rollout: {gpus_per_replica: 4}}")
    assert "resources.rollout.gpus_per_replica: 4 does not divide the target's num_experts 6" in err
    assert "scorer" not in err  # 2 divides all three


def test_a_degree_past_the_key_value_heads_is_accepted(tmp_path):
    """4 ranks over the tiny target's 2 key/value heads: each rank holds its attention whole."""
    config = tmp_path / "spec.yaml"
    config.write_text(f"base: {TINY}\nresources: {{cluster: {{num_cpus: 8}}, rollout: {{gpus_per_replica: 4}}}}")
    assert load_spec(config, check_paths=False).resources.rollout.ranks == 4


def test_a_layout_that_fits_is_accepted(tmp_path):
    config = tmp_path / "spec.yaml"
    config.write_text(f"base: {TINY}\nresources: {{cluster: {{num_cpus: 8}}, scorer: {{gpus_per_replica: 2}}, "
                      "rollout: {gpus_per_replica: 2}}")
    spec = load_spec(config, check_paths=False)
    assert (spec.resources.scorer.ranks, spec.resources.rollout.ranks, spec.resources.learner.ranks) == (2, 2, 1)


def test_a_vllm_rollout_replica_is_one_actor_holding_its_gpus():
    """vLLM starts its own tensor-parallel ranks, so Ray places a vLLM replica as one actor with all its GPUs."""
    from opd.train.fleet import placed_role

    sets = ["rollout.source=target", "rollout.sampler=vllm", "resources.cluster.num_gpus=9", "resources.cluster.num_cpus=32",
            "resources.rollout.replicas=2", "resources.rollout.num_gpus=1", "resources.rollout.num_cpus=2",
            "resources.rollout.gpus_per_replica=4", "resources.evaluator.num_gpus=1"]
    role = placed_role(load_spec(TINY, sets, check_paths=False), "rollout")
    assert (role.replicas, role.gpus_per_replica, role.num_gpus, role.num_cpus) == (2, 1, 4, 8)
    hf = placed_role(load_spec(TINY, sets[2:], check_paths=False), "rollout")
    assert (hf.replicas, hf.gpus_per_replica, hf.num_gpus) == (2, 4, 1)
