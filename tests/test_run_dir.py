"""The run directory: an unwritable one is refused up front (issue 16, item 3), and one run at a time holds it, a
second being refused in one line naming the holder's PID (item 5)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from opd.cli import main
from opd.spec import load_spec

HOLD = """
import sys, time
from opd.run_dir import RunDirLock
lock = RunDirLock(sys.argv[1])
print("holding", flush=True)
time.sleep(120)
"""


def test_an_unwritable_run_dir_is_refused_before_anything_loads(micro_spec_file, tmp_path, capsys, monkeypatch):
    import opd.main_job

    monkeypatch.setattr(opd.main_job, "check_inputs", lambda spec: pytest.fail("inputs checked before the run_dir"))
    (tmp_path / "a-file").write_text("")
    run_dir = tmp_path / "a-file" / "run"  # as unwritable as a read-only mount, even for root
    for command in ("train", "run", "validate"):
        started = time.perf_counter()
        assert main([command, str(micro_spec_file), "--set", f"tracking.run_dir={run_dir}"]) == 2
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1 and err.startswith(f"error: tracking.run_dir: {run_dir}"), err
        assert "expected a writable directory" in err and time.perf_counter() - started < 5


def test_a_second_run_in_the_same_run_dir_is_refused_naming_the_holder(micro_spec_file, capsys):
    run_dir = load_spec(micro_spec_file).run_dir
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "holding\n"
        for command in ("train", "run"):
            assert main([command, str(micro_spec_file)]) == 2
            err = capsys.readouterr().err
            assert err == (f"error: tracking.run_dir: {run_dir} is in use by another run (pid {holder.pid} on "
                           f"{os.uname().nodename}); wait for it to end, or set another tracking.run_dir\n")
    finally:
        holder.kill()
        holder.wait()
    from opd.run_dir import RunDirLock

    with RunDirLock(run_dir):  # the kernel dropped the killed holder's lock: no stale lock to clean up
        pass


def test_a_checkpoint_is_written_under_a_temporary_name_of_its_own(micro_assets, tmp_path, monkeypatch):
    """Two writers of one step once shared `step-N.tmp` and deleted each other's half-written checkpoint."""
    from opd.models.drafter import DFlashDrafter
    from opd.train.checkpoint import latest_checkpoint, save_checkpoint

    written = []
    monkeypatch.setattr(DFlashDrafter, "save_pretrained", lambda self, d: (written.append(d), d.mkdir()))
    (tmp_path / "checkpoints" / "step-0000002.tmp").mkdir(parents=True)  # another writer, mid-write
    path = save_checkpoint(tmp_path, 2, DFlashDrafter.__new__(DFlashDrafter), {"step": 2})
    assert str(os.getpid()) in written[0].name and (tmp_path / "checkpoints" / "step-0000002.tmp").is_dir()
    assert latest_checkpoint(tmp_path) == path
