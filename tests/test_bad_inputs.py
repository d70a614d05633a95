"""Output paths (issue 33): a command's output path is checked before any model loads, in one line naming the flag
and what is expected; results and drafters are written whole or not at all (opd/outputs.py)."""

from __future__ import annotations

import os
import shutil

import pytest

from opd.cli import main
from opd.outputs import atomic_dir, write_text_atomic


def one_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "Traceback" not in err[0], err
    return err[0]


def no_compute(monkeypatch, module) -> None:
    monkeypatch.setattr(module, "build_models", lambda *a, **k: pytest.fail("compute started before the output was "
                                                                            "checked"))


def test_eval_json_naming_a_directory_is_refused_before_decoding(micro_spec_file, tmp_path, capsys, monkeypatch):
    import opd.eval.online

    no_compute(monkeypatch, opd.eval.online)
    assert main(["eval", str(micro_spec_file), "--draft", "random", "--json", str(tmp_path)]) == 2
    assert one_error(capsys) == f"error: --json: {tmp_path} is a directory (expected a file path for the results)"
    (tmp_path / "a-file").write_text("")
    under_a_file = tmp_path / "a-file" / "eval.json"
    assert main(["eval", str(micro_spec_file), "--json", str(under_a_file)]) == 2
    assert one_error(capsys) == (f"error: --json: {under_a_file} cannot be written ({tmp_path / 'a-file'} is a file; "
                                 "expected a file path for the results)")


@pytest.mark.parametrize("command, module", [("gen-samples", "opd.commands.gen_samples.run_gen_samples"),
                                             ("gen-sft-data", "opd.commands.gen_samples.run_gen_samples")])
def test_sample_and_sft_data_out_naming_a_directory_is_refused_first(micro_spec_file, tmp_path, capsys, monkeypatch,
                                                                     command, module):
    monkeypatch.setattr(module, lambda *a, **k: pytest.fail("the command ran before --out was checked"))
    assert main([command, str(micro_spec_file), "--out", str(tmp_path)]) == 2
    assert one_error(capsys).startswith(f"error: --out: {tmp_path} is a directory (expected a file path for the ")


def test_serve_bench_json_naming_a_directory_is_refused_first(micro_spec_file, micro_assets, tmp_path, capsys):
    assert main(["serve-bench", str(micro_spec_file), "--draft", micro_assets["drafter"], "--json", str(tmp_path)]) == 2
    assert one_error(capsys) == f"error: --json: {tmp_path} is a directory (expected a file path for the results)"


def test_sft_out_naming_a_file_is_refused_before_training(micro_spec_file, tmp_path, capsys, monkeypatch):
    import opd.train.sft

    no_compute(monkeypatch, opd.train.sft)
    out = tmp_path / "drafter.safetensors"
    out.write_text("kept")
    assert main(["sft", str(micro_spec_file), "--out", str(out)]) == 2
    assert one_error(capsys) == f"error: --out: {out} is a file (expected a directory for the drafter)"
    assert out.read_text() == "kept"


def test_sft_out_holding_other_files_is_refused_not_deleted(micro_spec_file, tmp_path, capsys, monkeypatch):
    import opd.train.sft

    no_compute(monkeypatch, opd.train.sft)
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("kept")
    assert main(["sft", str(micro_spec_file), "--out", str(out)]) == 2
    assert one_error(capsys) == (f"error: --out: {out} holds notes.txt, which is not a drafter file (expected a new "
                                 "or empty directory, or a drafter directory to replace: config.json, "
                                 "model.safetensors)")
    assert (out / "notes.txt").read_text() == "kept"


def test_a_directory_write_that_fails_leaves_the_old_one_whole(micro_assets, tmp_path):
    out = tmp_path / "drafter"
    shutil.copytree(micro_assets["drafter"], out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(RuntimeError), atomic_dir(out) as tmp:
        tmp.mkdir()
        (tmp / "config.json").write_text("{")  # half written when the process dies
        raise RuntimeError("killed")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    with atomic_dir(out) as tmp:
        tmp.mkdir()
        (tmp / "config.json").write_text("{}")
    assert [p.name for p in out.iterdir()] == ["config.json"]  # replaced whole: no stale weights beside it
    assert [p.name for p in tmp_path.iterdir()] == ["drafter"]  # no temporary left behind


def test_a_directory_that_cannot_be_moved_in_puts_the_old_one_back(micro_assets, tmp_path, monkeypatch):
    out = tmp_path / "drafter"
    shutil.copytree(micro_assets["drafter"], out)
    real = os.replace

    def refuse_the_new_one(src, dst):
        if ".tmp" in str(src) and not str(src).endswith("-old"):  # the new directory, not the one set aside
            raise OSError("no space left on device")
        real(src, dst)

    monkeypatch.setattr("os.replace", refuse_the_new_one)
    with pytest.raises(OSError), atomic_dir(out) as tmp:
        tmp.mkdir()
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["drafter"]


def test_a_file_write_that_fails_leaves_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "results.json"
    path.write_text("old")

    def die(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("os.replace", die)
    with pytest.raises(OSError):
        write_text_atomic(path, "new")
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["results.json"]
