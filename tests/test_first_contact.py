"""A new user's first commands, typed as the README and guides show them but with the slips a new user makes: each
is refused in one `error:` line that says what to do, before any model loads, and never with a traceback. One
parametrized test over the command surface, not a test per message: a new refusal is a new row."""

from __future__ import annotations

import pytest

from opd.cli import main

TINY = "configs/tiny.yaml"
DRAFTER = "opd/assets/tiny/drafter"

# (what the user typed, a piece of the one line they must get)
SLIPS = {
    "a family's option under loss": (["validate", TINY, "--set", "loss.confidence_weight=1"],
                                     "did you mean models.drafter.confidence_weight (kind dspark)?"),
    "the warm drafter's path as a drafter option": (["run", TINY, "--set", "models.drafter.path=x"],
                                                    "did you mean models.drafter_path?"),
    "another section's field": (["train", TINY, "--set", "optim.vllm_python=x"],
                                "did you mean resources.vllm_python?"),
    "an experiment field on a reproduce spec": (["reproduce", "configs/reproduce/tiny.yaml", "--set",
                                                 "optim.lr=3e-4"], "an experiment field goes in its set: list"),
    "gap without held-out samples": (["gap", TINY, "--draft", DRAFTER, "--set", "eval.samples_path=null"],
                                     "--samples: no held-out target samples given"),
    "build-tiny over the shipped target": (["build-tiny", "--out-dir", "opd/assets/tiny", "--steps", "5"],
                                          "--out-dir: opd/assets/tiny is the shipped tiny target"),
    "a drafter where the target belongs": (["validate", TINY, "--set", "models.target_path=opd/assets/tiny/dspark"],
                                           "opd/assets/tiny/dspark is a speculators drafter (dspark), not a target"),
    "the target as --draft": (["eval", TINY, "--draft", "opd/assets/tiny/target"],
                              "--draft: opd/assets/tiny/target is a target model (Qwen3ForCausalLM), not a drafter"),
    "an export without a target": (["export", DRAFTER, "--to", "zlab", "--out", "/nonexistent-export"],
                                   "no target to export it for"),
    "a sampler that a speculative rollout never uses": (["run", TINY, "--set", "rollout.sampler=vllm", "--set",
                                                         "steps=2"],
                                                        "rollout.sampler: vllm but source is speculative"),
    "a random drafter of another family than the warm one": (["eval", TINY, "--draft", "random", "--set",
                                                              "models.drafter.kind=dflash2"],
                                                             "a random DFlash 2 drafter takes all of"),
    "held-out samples of other prompts": (["eval", TINY, "--prompts", "opd/assets/tiny/prompts/reworded.jsonl"],
                                          "or decode instead of reading samples: `--set eval.samples_path=null`"),
    "an EAGLE-3 drafter given to a DFlash spec": (["validate", TINY, "--set", "models.drafter_path=opd/assets/tiny/eagle3"],
                                                  "is an EAGLE-style drafter (eagle3), but this spec's models.drafter "
                                                  "(num_layers: 2, block_size: 8) was not written for it (expected a spec "
                                                  "for eagle3 drafters, e.g. configs/tiny-eagle3.yaml)"),
    "a misspelt reproduce field": (["reproduce", "configs/reproduce/tiny.yaml", "--set", "opd_stpes=3"],
                                   "opd_stpes: not a field of a reproduce spec (did you mean opd_steps?)"),
    "a target given to export as the drafter": (["export", "opd/assets/tiny/target", "--to", "zlab", "--out",
                                                 "/nonexistent-export"],
                                                "CKPT: opd/assets/tiny/target is a target model (Qwen3ForCausalLM), not "
                                                "a drafter (expected a drafter's directory; the target goes in --target)"),
    "a drafter given to export as --target": (["export", DRAFTER, "--to", "zlab", "--out", "/nonexistent-export",
                                               "--target", "opd/assets/tiny/dspark"],
                                              "--target: opd/assets/tiny/dspark is a speculators drafter (dspark), not a "
                                              "target model (expected the target's directory; a drafter goes in CKPT)"),
    "vLLM without its environment": (["gen-samples", TINY, "--engine", "vllm", "--set",
                                      "resources.vllm_python=/nonexistent/bin/python"],
                                     "resources.vllm_python: /nonexistent/bin/python does not exist"),
}


@pytest.mark.parametrize("slip", list(SLIPS))
def test_a_slip_is_one_line_that_says_what_to_do(slip, capsys):
    argv, wanted = SLIPS[slip]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and wanted in err[0], err
    assert "None" not in err[0] and "Traceback" not in err[0]


def test_tables_keep_their_columns_on_a_pipe(monkeypatch):
    """rich takes a pipe for 80 columns and cuts a wide table's cells ('ceili…'); ours keep theirs there."""
    from rich.table import Table

    from opd.progress import table_console

    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.setattr("os.isatty", lambda fd: False)
    console = table_console()
    table = Table(*[f"a column header of some width {i}" for i in range(4)])
    table.add_row(*[f"a cell of its own width {i}" for i in range(4)])
    with console.capture() as captured:
        console.print(table)
    assert "…" not in captured.get() and "a column header of some width 3" in captured.get()


def test_eval_draft_replaces_the_configs_drafter_before_any_family_check(tmp_path, capsys):
    """`opd eval CONFIG --draft DIR`: DIR is the drafter the spec then describes, whatever the config's family
    (a P-EAGLE drafter on the DFlash config), its kind and the fields its checkpoint fixes taken from DIR."""
    from opd.models.build import build_models
    from opd.spec import load_spec

    spec = load_spec("configs/tiny-eagle3.yaml", ["models.drafter_path=", "models.drafter.kind=peagle"])
    build_models(spec, "random").drafter.save_pretrained(tmp_path / "peagle")
    quick = ["--set", "eval.num_prompts=2", "--set", "eval.max_new_tokens=8", "--set", "eval.samples_path=null",
             "--set", "eval.offline=false", "--set", "eval.speedup_prompts=2", "--set", "eval.diagnostic=false"]
    assert main(["eval", TINY, "--draft", str(tmp_path / "peagle"), *quick]) == 0
    assert "Traceback" not in capsys.readouterr().err


def test_exported_weights_are_readable_as_the_umask_says(tmp_path, capsys):
    """safetensors writes 0600; an export (and a checkpoint, through the same writer) takes the user's umask, as
    config.json does, so a vLLM server running as another user can read it."""
    import os
    import stat

    out = tmp_path / "export"
    assert main(["export", DRAFTER, "--to", "zlab", "--out", str(out), "--target", "opd/assets/tiny/target"]) == 0
    mask = os.umask(0)
    os.umask(mask)
    for name in ("model.safetensors", "config.json"):
        assert stat.S_IMODE((out / name).stat().st_mode) == 0o666 & ~mask, name


def test_an_empty_prompts_file_is_named_not_the_pool_size_derived_from_it(tmp_path, capsys):
    empty = tmp_path / "prompts.jsonl"
    empty.write_text("")
    assert main(["validate", TINY, "--set", f"data.train_prompts={empty}"]) == 2
    assert capsys.readouterr().err.strip() == (f"error: data.train_prompts: {empty} holds no prompts (expected a jsonl "
                                               "file with one prompt a line)")


def test_eval_names_the_drafter_it_evaluated_and_decodes_with_offline_off(capsys, tmp_path):
    """`opd eval` says which drafter (family and path) it measured; `eval.offline: false` decodes even where
    eval.samples_path is set, as it does in a run."""
    import json

    out = tmp_path / "eval.json"
    assert main(["eval", TINY, "--set", "eval.offline=false", "--set", "eval.num_prompts=1", "--set",
                 "eval.max_new_tokens=4", "--set", "eval.sampling=[{name: greedy, temperature: 0}]", "--json",
                 str(out)]) == 0
    assert f"drafter: dflash, {DRAFTER} (target opd/assets/tiny/target)" in capsys.readouterr().out
    written = json.loads(out.read_text())
    assert (written["draft"], written["kind"]) == (DRAFTER, "dflash")
    assert [row["offline"] for row in written["rows"]] == [False]


@pytest.mark.parametrize(("argv", "wanted"), [
    (["--help"], "DFlash, DFlash 2, DSpark, XPress, EAGLE-3, P-EAGLE, MTP heads"),
    (["suite", "build", "--help"], "write a suite's prompt files"),
    (["suite", "eval", "--help"], "τ of each drafter per benchmark and setting"),
    (["serve-bench", "--help"], "exported drafter directory, of any family"),
    (["gen-sft-data", "--help"], "hf (the default)"),
    (["gen-samples", "--help"], "(default 1;"),
])
def test_help_describes_each_command_and_its_defaults(argv, wanted, capsys):
    with pytest.raises(SystemExit):
        main(argv)
    assert wanted in " ".join(capsys.readouterr().out.split())


def test_skipped_prompt_lines_are_counted_and_named(tmp_path, capsys):
    lines = open("opd/assets/tiny/prompts/train.jsonl").read().splitlines()[:6]
    bad = tmp_path / "prompts.jsonl"
    bad.write_text("\n".join([*lines[:2], "not json", *lines[2:], '{"id": "x"}']) + "\n")
    assert main(["validate", TINY, "--set", f"data.train_prompts={bad}", "--set", "data.skip_bad_lines=true"]) == 0
    assert (f"note: data.train_prompts: 2 line(s) skipped (data.skip_bad_lines), the first {bad}:3: not JSON"
            in capsys.readouterr().err)


def test_a_target_missing_a_tensor_is_refused_before_any_actor(tmp_path, capsys):
    """One tensor dropped from its shard and from the index: `opd validate` names it in one line (a run refused it
    only inside an actor, with Ray's pages around it)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    target = tmp_path / "target"
    shutil.copytree("opd/assets/tiny/target", target)
    index = json.loads((target / "model.safetensors.index.json").read_text())
    name = "model.layers.3.self_attn.k_norm.weight"
    shard = target / index["weight_map"].pop(name)
    tensors = load_file(shard)
    del tensors[name]
    save_file(tensors, shard, metadata={"format": "pt"})
    (target / "model.safetensors.index.json").write_text(json.dumps(index))
    assert main(["validate", TINY, "--set", f"models.target_path={target}"]) == 2
    assert capsys.readouterr().err.strip() == (f"error: target model {target}: its weights lack {name} (expected every "
                                               "tensor of Qwen3ForCausalLM; transformers would fill them with random "
                                               "values)")


def test_an_mtp_run_on_a_target_without_a_head_is_refused_before_any_actor(capsys):
    assert main(["validate", TINY, "--set", "models.drafter.kind=mtp", "--set", "models.drafter.num_layers=1",
                 "--set", "models.drafter_path="]) == 2
    assert "holds no MTP layers" in capsys.readouterr().err
