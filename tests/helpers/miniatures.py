"""The shipped cluster configs fitted to their targets' miniatures (opd/tiny/miniature.py): the config's own recipe,
drafter family, rendering and sharding, with the sizes a CPU runs in seconds (a fresh drafter of one layer, a few
short prompts, two steps, no GPU)."""

from __future__ import annotations

from pathlib import Path

import yaml

from opd.tiny.miniature import Miniature

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
PROMPTS = ROOT / "opd" / "assets" / "tiny" / "prompts"
# the published checkpoint each shipped config's target is (the basename of its models.target_path)
PUBLISHED = {
    "Qwen3-4B": "qwen3-4b", "Qwen3-8B": "qwen3-8b", "Qwen3-30B-A3B-Thinking-2507": "qwen3-30b-a3b",
    "Llama-3.1-8B-Instruct": "llama3.1-8b", "gemma-4-31B-it": "gemma4-31b", "gpt-oss-20b": "gpt-oss-20b",
    "gpt-oss-120b": "gpt-oss-120b", "Qwen3.5-9B": "qwen3.5-9b", "Qwen3.5-122B-A10B": "qwen3.5-122b-a10b",
    "Qwen3.5-397B-A17B": "qwen3.5-397b-a17b",
}


def shipped_configs() -> list[Path]:
    """Every shipped cluster config (the tiny ones run on the shipped tiny models already)."""
    return sorted(p for p in CONFIGS.glob("*.yaml") if not p.name.startswith("tiny"))


def fitted_sets(config: Path, mini: Miniature, run_dir: Path) -> list[str]:
    """`--set` overrides that fit a shipped config to its miniature on this machine."""
    layers = mini.num_layers
    sets = {
        "models.target_path": str(mini.path), "models.drafter_path": "", "models.target_num_layers": layers,
        "models.drafter.target_layer_ids": [0, layers - 2], "models.drafter.num_layers": 1,
        "models.drafter.block_size": 4, "models.drafter.mask_token_id": mini.mask_token_id,
        "models.dtype": "float32", "models.attn_implementation": None,
        "data.train_prompts": str(PROMPTS / "train.jsonl"), "data.eval_prompts": str(PROMPTS / "heldout.jsonl"),
        "data.train_pool_size": None, "data.max_prompt_tokens": 256,
        "rollout.batch_size": 2, "rollout.max_new_tokens": 8,
        "optim.batch_size": 4, "optim.micro_batch_tokens": None, "optim.micro_batch_size": 1,
        "replay.micro_batch_tokens": None, "steps": 2, "epochs": None,
        **fitted_resources(config),
        "tracking.run_dir": str(run_dir / "{name}"), "eval.every": 2, "eval.num_prompts": 2,
        "eval.max_new_tokens": 8, "eval.suite": None,
    }
    if "intermediate_size" not in published_text(mini):  # an MoE target states its experts' width only
        sets["models.drafter.intermediate_size"] = 128
    return [arg for key, value in sets.items() for arg in ("--set", f"{key}={_yaml(value)}")]


def published_text(mini: Miniature) -> dict:
    """The miniature's language-model config fields, as written."""
    import json

    from opd.tiny.miniature import text_section

    return text_section(json.loads((mini.path / "config.json").read_text()))


def fitted_resources(config: Path) -> dict[str, object]:
    """The config's placement on CPUs: each sharded role at 2 ranks (the config shards it wider), one replica a
    role, a colocated learner with as many ranks as the scorer, the evaluator where the config puts it."""
    from opd.spec import load_spec

    r = load_spec(str(config), [], check_paths=False).resources
    width = {name: min(getattr(r, name).gpus_per_replica, 2) for name in ("rollout", "scorer", "evaluator")}
    cpus = 0.25 if r.colocate_learner else 0.5
    out: dict[str, object] = {
        "resources.cluster": {"num_gpus": 0, "num_cpus": 4},
        "resources.rollout": {"replicas": 1, "num_gpus": 0, "num_cpus": 0.5, "gpus_per_replica": width["rollout"]},
        "resources.scorer": {"replicas": 1, "num_gpus": 0, "num_cpus": cpus, "gpus_per_replica": width["scorer"]},
        "resources.learner": {"replicas": min(r.learner.replicas, width["scorer"]) if r.colocate_learner else 1,
                              "num_gpus": 0, "num_cpus": cpus},
        "resources.evaluator": ({"num_gpus": 0, "num_cpus": 0} if r.evaluate_on == "rollout" else
                                {"num_gpus": 0, "num_cpus": 0.5, "gpus_per_replica": width["evaluator"]}),
    }
    return out


def _yaml(value: object) -> str:
    return "" if value == "" else yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("\n...")


def target_of(config: Path) -> str:
    """The fixture name of `config`'s target (a KeyError naming what to add when it has none)."""
    spec = yaml.safe_load(config.read_text())
    base = spec
    while "target_path" not in base.get("models", {}):
        base = yaml.safe_load((CONFIGS / base["base"]).read_text())
    return PUBLISHED[Path(base["models"]["target_path"]).name]
