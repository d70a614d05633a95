"""The experiment spec: defaults, shipped configs, inheritance, overrides, checks against files, export."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from opd.formats.dflash import default_target_layer_ids
from opd.spec import (
    ExperimentSpec,
    LossSpec,
    ReplaySpec,
    SpecError,
    flatten,
    load_spec,
    path_problems,
    validate_spec,
)
from tests.helpers.specs import MINIMAL, make_model_dir

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted(p for p in (ROOT / "configs").rglob("*.yaml")  # reproduce specs, presets and suites are not experiments
                 if p.parent.name not in ("reproduce", "presets", "suites"))
PRESETS = sorted((ROOT / "configs" / "presets").glob("*.yaml"))
TINY = ROOT / "configs" / "tiny.yaml"  # the embedded default: the paper's setup with the recommended recipe
PAPER = ROOT / "configs" / "tiny-paper.yaml"  # the same with the paper's exact loss


def write(path: Path, data: dict | str) -> Path:
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


def test_defaults_are_the_papers() -> None:
    spec = ExperimentSpec.model_validate(MINIMAL)
    assert (spec.models.drafter.block_size, spec.models.drafter.num_layers) == (16, 5)
    assert (spec.loss.kl_mode, spec.loss.gamma, spec.loss.lambda_acc, spec.loss.lambda_rej) == ("mixed", 0.8, 1, 1)
    assert spec.loss.rejected_decay and not spec.loss.first_rejected_only and not spec.loss.accepted_decay
    assert (spec.optim.lr, spec.optim.schedule, spec.optim.warmup_ratio, spec.optim.batch_size) == (
        3e-4, "cosine", 0.05, 24)
    assert (spec.replay.anchors, spec.replay.teacher_temperature, spec.rollout.mode) == ("error", 1.0, "draft_opd")
    assert (spec.sft.lr, spec.sft.epochs, spec.sft.gamma, spec.sft.anchors_per_seq, spec.sft.max_length) == (
        6e-4, 6, 7.0, 512, 3072)
    assert [s.model_dump() for s in spec.eval.sampling] == [
        {"name": "greedy", "temperature": 0.0, "top_p": 1.0, "top_k": 0, "draft": "argmax"},
        {"name": "sampled", "temperature": 0.6, "top_p": 0.95, "top_k": 20, "draft": "argmax"}]
    assert spec.rollout.mix == [] and spec.loss.acceptance_weight == 0.0
    assert spec.engine == "ray" and spec.models.tokenizer == "t"


def test_default_layer_ids_match_public_drafters() -> None:
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B DFlash
    assert default_target_layer_ids(36, 1) == [18]
    assert default_target_layer_ids(6, 2) == [1, 3]
    assert default_target_layer_ids(48, 8) == [1, 7, 14, 20, 26, 32, 39, 45]  # rounds, never truncates
    spec = load_spec(ROOT / "configs" / "qwen3-8b.yaml", check_paths=False)
    assert spec.models.layer_ids == [1, 9, 17, 25, 33]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(ROOT / "configs")))
def test_every_config_validates_and_round_trips(path: Path) -> None:
    spec = load_spec(path, check_paths=False)
    assert ExperimentSpec.model_validate(yaml.safe_load(spec.to_yaml())) == spec
    assert all(0 <= i < spec.models.target_num_layers for i in spec.models.layer_ids)


def test_config_set_is_complete() -> None:
    names = {str(p.relative_to(ROOT / "configs")) for p in CONFIGS}
    ablations = {"no_decay", "all_forward", "all_reverse", "random_anchors", "naive_rollout",
                 "first_rejected_only", "accepted_decay"}
    assert {"tiny.yaml", "tiny-paper.yaml", "qwen3-4b.yaml", "qwen3-8b.yaml", "qwen3-30b-a3b.yaml"} <= names
    assert {f"ablations/{a}.yaml" for a in ablations} <= names


@pytest.mark.parametrize("path", sorted((ROOT / "configs" / "ablations").glob("*.yaml")), ids=lambda p: p.stem)
def test_ablation_differs_from_base_in_one_field(path: Path) -> None:
    base, ablation = flatten(load_spec(PAPER, check_paths=False)), flatten(load_spec(path, check_paths=False))
    changed = {key for key in base if base[key] != ablation[key]}
    assert base.keys() == ablation.keys()
    assert len(changed - {"name"}) == 1 and "name" in changed


def _flat(value, prefix: str = "") -> dict[str, str]:
    """A raw YAML mapping keyed and valued as `flatten` keys and values a spec."""
    if isinstance(value, dict):
        return {k: v for key, sub in value.items() for k, v in _flat(sub, f"{prefix}.{key}" if prefix else key).items()}
    if isinstance(value, list):
        return {k: v for i, sub in enumerate(value) for k, v in _flat(sub, f"{prefix}.{i}").items()}
    return {prefix: value if isinstance(value, str) else json.dumps(value)}


def test_make_run_runs_the_recommended_preset_on_the_papers_setup() -> None:
    """`make run` runs configs/tiny.yaml, which is tiny-paper.yaml with exactly the sampled-serving preset's fields
    changed (and its name), the recipe the docs recommend (Getting started)."""
    assert ".venv/bin/opd run configs/tiny.yaml" in (ROOT / "Makefile").read_text()
    preset = _flat(yaml.safe_load((ROOT / "configs" / "presets" / "sampled-serving.yaml").read_text()))
    paper, tiny = flatten(load_spec(PAPER, check_paths=False)), flatten(load_spec(TINY, check_paths=False))
    changed = {key for key in tiny.keys() | paper.keys() if tiny.get(key) != paper.get(key)}
    assert changed == {"name", "rollout.mix", *preset}  # rollout.mix: the paper's empty list, flattened as one key
    assert all(tiny[key] == value for key, value in preset.items())
    assert "configs/presets/sampled-serving.yaml" in (ROOT / "docs" / "getting-started.md").read_text()


def test_the_paper_config_keeps_the_papers_loss() -> None:
    """tiny-paper.yaml: the paper's exact objective (the schema defaults of loss and replay) on every slot."""
    spec = load_spec(PAPER, check_paths=False)
    assert spec.loss == LossSpec() and spec.replay.anchors == ReplaySpec().anchors
    assert [(s.temperature, s.top_p, s.top_k) for s in spec.rollout.settings] == [(0.0, 1.0, 0)]


def test_base_chain_merges_deeply_and_child_wins(tmp_path: Path) -> None:
    write(tmp_path / "a.yaml", {**MINIMAL, "optim": {"lr": 1e-3, "batch_size": 16}, "models": {
        "target_path": "t", "drafter_path": "d", "drafter": {"block_size": 8, "num_layers": 2}}})
    (tmp_path / "sub").mkdir()
    write(tmp_path / "sub" / "b.yaml", {"base": "../a.yaml", "optim": {"lr": 2e-3}, "models": {"drafter_path": None}})
    write(tmp_path / "c.yaml", {"base": "sub/b.yaml", "models": {"drafter": {"block_size": 4}}})
    spec = load_spec(tmp_path / "c.yaml", check_paths=False)
    assert (spec.optim.lr, spec.optim.batch_size) == (2e-3, 16)
    assert spec.models.drafter_path is None and spec.models.target_path == "t"
    assert (spec.models.drafter.block_size, spec.models.drafter.num_layers) == (4, 2)


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_every_preset_layers_onto_every_experiment(preset: Path, tmp_path: Path) -> None:
    """A preset holds only its recipe's fields, so `base: [experiment, preset]` works for every shipped
    experiment and changes nothing but those fields (and, for a serving mode, the eval row that measures it)."""
    raw = yaml.safe_load(preset.read_text())
    assert "base" not in raw and set(raw) <= {"rollout", "replay", "loss", "serving"}
    for experiment in [PAPER, *sorted((ROOT / "configs").glob("qwen3-*.yaml"))]:
        write(tmp_path / "run.yaml", {"base": [str(experiment), str(preset)]})
        layered = flatten(load_spec(tmp_path / "run.yaml", check_paths=False))
        plain = flatten(load_spec(experiment, check_paths=False))
        changed = {k.split(".")[0] for k in {*plain, *layered} if plain.get(k) != layered.get(k)}
        assert changed == set(raw) | ({"eval"} if "serving" in raw else set()), experiment


def test_a_list_of_bases_layers_a_preset_on_an_experiment(tmp_path: Path) -> None:
    write(tmp_path / "exp.yaml", {**MINIMAL, "loss": {"gamma": 0.5}, "optim": {"lr": 1e-3}})
    write(tmp_path / "preset.yaml", {"loss": {"kl_mode": "all_forward", "gamma": 0.7}})
    write(tmp_path / "run.yaml", {"base": ["exp.yaml", "preset.yaml"], "optim": {"lr": 2e-3}})
    spec = load_spec(tmp_path / "run.yaml", check_paths=False)
    assert (spec.loss.kl_mode, spec.loss.gamma, spec.optim.lr, spec.steps) == ("all_forward", 0.7, 2e-3, 10)
    write(tmp_path / "bad.yaml", {"base": ["exp.yaml", 3]})
    with pytest.raises(SpecError, match=r"bad\.yaml: base: got \['exp\.yaml', 3\]"):
        load_spec(tmp_path / "bad.yaml", check_paths=False)


def test_overrides_are_typed(tmp_path: Path) -> None:
    spec = load_spec(TINY, ["optim.lr=1e-4", "loss.rejected_decay=false", "resources.rollout.replicas=2",
                            "optim.betas=[0.8, 0.99]", "name=x", "models.drafter_path="], check_paths=False)
    assert spec.optim.lr == 1e-4 and spec.loss.rejected_decay is False
    assert spec.resources.rollout.replicas == 2 and spec.optim.betas == (0.8, 0.99)
    assert spec.name == "x" and spec.models.drafter_path is None


def test_overrides_address_list_items(tmp_path: Path) -> None:
    """An index reaches into a list the config sets, or into the spec's default list; other items are kept."""
    default = load_spec(TINY, check_paths=False).eval.sampling
    spec = load_spec(TINY, ["eval.sampling.0.temperature=0.6", "eval.sampling.1.top_k=5", "optim.betas.1=0.95"],
                     check_paths=False)
    assert [s.temperature for s in spec.eval.sampling] == [0.6, default[1].temperature]
    assert [s.top_k for s in spec.eval.sampling] == [default[0].top_k, 5]
    assert [s.name for s in spec.eval.sampling] == [s.name for s in default] and spec.optim.betas[1] == 0.95
    config = write(tmp_path / "mix.yaml", f"base: {TINY}\nrollout: {{mix: [{{temperature: 0.6}}, {{top_k: 3}}]}}\n")
    mixed = load_spec(config, ["rollout.mix.1.temperature=0.9"], check_paths=False).rollout.mix
    assert [(m.temperature, m.top_k) for m in mixed] == [(0.6, 0), (0.9, 3)]


@pytest.mark.parametrize("override, expected", [
    ("eval.sampling.2.temperature=0.6", "eval.sampling.2: index out of range (eval.sampling has 2 items; "
                                        "indices 0..1)"),
    ("rollout.mix.0.temperature=0.6", "rollout.mix.0: index out of range (rollout.mix has 0 items; indices none"),
    ("eval.sampling.first.temperature=0.6", "eval.sampling is a list (expected an item index, 0..1; got 'first')"),
    ("optim.0=1", "optim is a mapping, not a list (index 0 needs a list field)"),
    ("optim.lr.0=1", "optim.lr is a float, not a section"),
    ("models.drafter.target_layer_ids.0=1", "models.drafter.target_layer_ids is not a list"),
])
def test_a_bad_list_override_is_one_line(override: str, expected: str) -> None:
    with pytest.raises(SpecError) as err:
        load_spec(PAPER, [override], check_paths=False)
    assert str(err.value).startswith(f"--set {override!r}: {expected}")
    assert len(str(err.value).splitlines()) == 1


def test_errors_collect_every_problem_one_line_each() -> None:
    bad = {**MINIMAL, "steps": 0, "optim": {"lr": -1, "lrr": 1}, "loss": {"gamma": 2},
           "eval": {"sampling": [{"name": "g", "draft": "sample"}]}}
    with pytest.raises(SpecError) as info:
        validate_spec(bad, check_paths=False)
    assert sorted(m.split(":")[0] for m in info.value.messages) == [
        "eval.sampling[0].draft", "loss.gamma", "optim.lr", "optim.lrr", "steps"]
    assert "did you mean 'lr'?" in str(info.value)


def test_duplicate_yaml_key_is_rejected(tmp_path: Path) -> None:
    path = write(tmp_path / "dup.yaml", "steps: 1\noptim:\n  lr: 0.1\noptim:\n  lr: 0.2\n")
    with pytest.raises(SpecError, match=r"dup.yaml: invalid YAML at line 4.*duplicate key 'optim'"):
        load_spec(path, check_paths=False)


def test_target_depth_is_read_from_checkpoint(tmp_path: Path) -> None:
    target = make_model_dir(tmp_path / "target", {"num_hidden_layers": 8})
    spec = validate_spec({**MINIMAL, "models": {"target_path": target, "drafter": {"num_layers": 2}}},
                         check_paths=False)
    assert spec.models.target_num_layers == 8 and spec.models.layer_ids == [1, 5]
    with pytest.raises(SpecError, match=r"^models.target_num_layers: 6 disagrees with num_hidden_layers 8"):
        validate_spec({**MINIMAL, "models": {"target_path": target, "target_num_layers": 6}}, check_paths=False)
    with pytest.raises(SpecError, match=r"^models.drafter.target_layer_ids: layer 8 is outside the target"):
        validate_spec({**MINIMAL, "models": {"target_path": target, "drafter": {"target_layer_ids": [1, 8]}}},
                      check_paths=False)


def test_files_are_read_when_the_spec_is_resolved_and_never_when_an_actor_validates_it(tmp_path: Path,
                                                                                        monkeypatch) -> None:
    target = make_model_dir(tmp_path / "target", {"num_hidden_layers": 8})
    prompts = tmp_path / "train.jsonl"
    prompts.write_text('{"prompt": "a"}\n\n{"prompt": "b"}\n')
    reads = []
    read_text, read_bytes = Path.read_text, Path.read_bytes

    def counting(original):
        def read(self: Path, *args, **kwargs):
            reads.append(self.name)
            return original(self, *args, **kwargs)

        return read

    monkeypatch.setattr(Path, "read_text", counting(read_text))
    monkeypatch.setattr(Path, "read_bytes", counting(read_bytes))
    data = {**MINIMAL, "models": {"target_path": target, "drafter": {"num_layers": 2}},
            "data": {**MINIMAL["data"], "train_prompts": str(prompts)}}
    resolved = validate_spec(data, check_paths=False)
    assert sorted(reads) == ["config.json", "train.jsonl"]
    assert resolved.models.target_num_layers == 8 and resolved.data.train_pool_size == 2
    again = ExperimentSpec.model_validate(resolved.model_dump())  # what every actor does with the driver's spec
    assert again == resolved and sorted(reads) == ["config.json", "train.jsonl"]


def test_warm_drafter_must_match_spec(tmp_path: Path) -> None:
    drafter = make_model_dir(tmp_path / "drafter", {"block_size": 8, "num_hidden_layers": 2,
                                                    "dflash_config": {"target_layer_ids": [1, 3]}})
    models = {"target_path": "t", "target_num_layers": 6, "drafter_path": drafter,
              "drafter": {"block_size": 8, "num_layers": 2}}
    validate_spec({**MINIMAL, "models": models}, check_paths=False)
    models["drafter"] = {"block_size": 16, "num_layers": 2}
    with pytest.raises(SpecError, match=r"^models.drafter.block_size: 16 disagrees with the warm drafter's 8"):
        validate_spec({**MINIMAL, "models": models}, check_paths=False)


def test_check_paths_lists_every_missing_path(tmp_path: Path) -> None:
    spec = validate_spec({**MINIMAL, "models": {"target_path": str(tmp_path / "nope"), "drafter_path": "d"}},
                         check_paths=False)
    fields = [m.split(":")[0] for m in path_problems(spec)]
    assert fields == ["models.target_path", "models.drafter_path", "data.train_prompts", "data.eval_prompts"]
    make_model_dir(tmp_path / "nope", {})
    (tmp_path / "a").write_text("{}\n")
    (tmp_path / "b").mkdir()
    spec = validate_spec({**MINIMAL, "models": {"target_path": str(tmp_path / "nope")},
                          "data": {"train_prompts": str(tmp_path / "a"), "eval_prompts": str(tmp_path / "b")}},
                         check_paths=False)
    assert [m.split(":")[0] for m in path_problems(spec)] == ["data.eval_prompts"]


def test_run_dir_and_default_tracking_uri() -> None:
    spec = load_spec(TINY, ["tracking.run_dir=out/{name}-a"], check_paths=False)
    assert spec.run_dir == Path("out/tiny-a")
    assert spec.tracking_uri == f"sqlite:///{Path('out/tiny-a/mlflow.db').resolve()}"
    assert load_spec(TINY, ["tracking.uri=http://mlflow:5000"], check_paths=False).tracking_uri == "http://mlflow:5000"


def test_tracking_uri_falls_back_to_opd_tracking_uri_never_to_mlflows_variable(monkeypatch) -> None:
    """A cluster's pods name its MLflow server once, for every spec; the spec's own tracking.uri wins. MLflow's
    MLFLOW_TRACKING_URI is ignored: `mlflow.set_tracking_uri` rewrites it for the whole process."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///somewhere-else.db")
    monkeypatch.delenv("OPD_TRACKING_URI", raising=False)
    assert load_spec(TINY, check_paths=False).tracking_uri == f"sqlite:///{Path('runs/tiny/mlflow.db').resolve()}"
    monkeypatch.setenv("OPD_TRACKING_URI", "http://opd-mlflow:5000")
    assert load_spec(TINY, check_paths=False).tracking_uri == "http://opd-mlflow:5000"
    assert load_spec(TINY, ["tracking.uri=http://other:5000"], check_paths=False).tracking_uri == "http://other:5000"


def test_qwen3_configs_keep_their_run_dir_on_shared_storage_and_prune_checkpoints() -> None:
    for path in sorted((ROOT / "configs").glob("qwen3-*.yaml")):
        spec = load_spec(path, check_paths=False)
        assert spec.run_dir == Path(f"/mnt/runs/{spec.name}") and spec.tracking.keep_last == 3, path.name
    assert load_spec(TINY, check_paths=False).tracking.keep_last is None  # the tiny default keeps every one
    with pytest.raises(SpecError, match=r"tracking\.keep_last"):
        load_spec(TINY, ["tracking.keep_last=0"], check_paths=False)


def test_flatten_gives_mlflow_params() -> None:
    params = flatten(load_spec(TINY, check_paths=False))
    assert params["optim.lr"] == "0.0001" and params["loss.rejected_decay"] == "true"
    assert params["replay.teacher_topk"] == "null" and params["models.target_path"] == "opd/assets/tiny/target"
    assert params["eval.sampling.1.top_k"] == "20" and params["optim.betas"] == "[0.9, 0.95]"
    assert all(isinstance(v, str) for v in params.values())
    assert all(re.fullmatch(r"[\w.\- /]+", key) for key in params)  # MLflow's allowed key characters


@pytest.mark.parametrize(("change", "hint"), [
    ("sft.objective=dspark", "did you mean models.drafter.sft_objective (kind dspark)?"),  # a family's option
    ("loss.confidence_weight=1", "did you mean models.drafter.confidence_weight (kind dspark)?"),
    ("models.drafter.path=x", "did you mean models.drafter_path?"),  # one level up
    ("optim.vllm_python=x", "did you mean resources.vllm_python?"),  # another section's
    ("loss.block_size=4", "did you mean models.drafter.block_size?"),  # every family has it: no kind named
    ("rollout.lr=1e-3", "did you mean sft.lr or optim.lr?"),
    ("loss.gammma=0.5", "did you mean 'gamma'?"),  # a typo within the section
])
def test_a_misplaced_key_is_pointed_to_where_it_lives(change, hint):
    with pytest.raises(SpecError) as info:
        load_spec("configs/tiny.yaml", [change])
    assert str(info.value) == f"{change.split('=')[0]}: unknown key ({hint})"
