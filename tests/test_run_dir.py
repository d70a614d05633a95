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
    import opd.commands.run

    monkeypatch.setattr(opd.commands.run, "check_inputs", lambda spec: pytest.fail("inputs checked before the run_dir"))
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
        for command in ("train", "run", "sft"):
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


def test_a_second_reproduction_in_the_same_out_dir_is_refused(micro_spec_file, tmp_path, capsys):
    out = tmp_path / "reproduce"
    spec = tmp_path / "r.yaml"
    spec.write_text(f"experiment: {micro_spec_file}\nopd_steps: 2\nout_dir: {out}\n"
                    "arms: [{name: draft-opd}, {name: other}]\n")
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "holding\n"
        assert main(["reproduce", str(spec)]) == 2
        err = capsys.readouterr().err
        assert err == (f"error: out_dir: {out} is in use by another run (pid {holder.pid} on {os.uname().nodename}); "
                       "wait for it to end, or set another out_dir\n")
    finally:
        holder.kill()
        holder.wait()


def test_a_checkpoint_is_written_under_a_temporary_name_of_its_own(micro_assets, tmp_path, monkeypatch):
    """Two writers of one step once shared `step-N.tmp` and deleted each other's half-written checkpoint."""
    from opd.models.dflash import DFlashDrafter
    from opd.train.checkpoint import latest_checkpoint, save_checkpoint

    written = []
    monkeypatch.setattr(DFlashDrafter, "save_pretrained", lambda self, d: (written.append(d), d.mkdir()))
    (tmp_path / "checkpoints" / "step-0000002.tmp").mkdir(parents=True)  # another writer, mid-write
    path = save_checkpoint(tmp_path, 2, DFlashDrafter.__new__(DFlashDrafter), {"step": 2})
    assert str(os.getpid()) in written[0].name and (tmp_path / "checkpoints" / "step-0000002.tmp").is_dir()
    assert latest_checkpoint(tmp_path) == path


def test_the_driver_resolves_one_absolute_run_dir_and_mlflow_uri_for_every_actor(micro_spec_file, tmp_path,
                                                                                  monkeypatch):
    """An actor's working directory is not the driver's (on another node, another copy of the job's): the spec it
    gets must name the driver's directory absolutely, and the sqlite store inside it."""
    from opd.run_dir import for_actors

    monkeypatch.chdir(tmp_path)
    spec = load_spec(micro_spec_file, ["tracking.run_dir=out/{name}-x"])
    resolved = for_actors(spec)
    assert resolved.tracking.run_dir == str(tmp_path / "out" / "micro-x") == str(resolved.run_dir)
    assert resolved.tracking_uri == f"sqlite:///{tmp_path / 'out' / 'micro-x' / 'mlflow.db'}"
    monkeypatch.chdir(tmp_path / "..")  # another process's working directory: the resolved spec does not move
    assert resolved.run_dir == tmp_path / "out" / "micro-x" and resolved.tracking_uri.endswith("micro-x/mlflow.db")
    odd = for_actors(load_spec(micro_spec_file, [f"tracking.run_dir={tmp_path}/{{{{x}}}}"]))  # braces survive
    assert odd.run_dir == tmp_path / "{x}"


def test_a_relative_run_dir_on_several_nodes_is_one_line(micro_spec_file, tmp_path):
    from opd.errors import OpdError
    from opd.run_dir import for_actors

    spec = load_spec(micro_spec_file, ["tracking.run_dir=runs/{name}"])
    for_actors(spec, nodes=1)  # one node: the driver's directory is the learner's
    with pytest.raises(OpdError) as refused:
        for_actors(spec, nodes=2)
    message = str(refused.value)
    assert "\n" not in message and message.startswith("tracking.run_dir: 'runs/{name}' is relative")
    assert "2 nodes" in message and "expected an absolute path on storage every node mounts" in message
    assert for_actors(load_spec(micro_spec_file), nodes=2).run_dir == tmp_path / "runs" / "micro"


def test_a_sqlite_store_written_from_two_hosts_is_refused(micro_spec_file, monkeypatch):
    from opd.errors import OpdError
    from opd.run_dir import for_actors

    monkeypatch.delenv("OPD_TRACKING_URI", raising=False)
    spec = load_spec(micro_spec_file)
    with pytest.raises(OpdError, match=r"^tracking\.uri: the sqlite store .*mlflow\.db would be written from two "
                                       r"hosts .*expected an MLflow server URI"):
        for_actors(spec, nodes=2, learner_elsewhere=True)
    for_actors(spec, nodes=2, learner_elsewhere=True, tracked=False)  # nothing logs: nothing to refuse
    for_actors(spec, nodes=2, learner_elsewhere=False)  # the learner beside the driver: one host
    monkeypatch.setenv("OPD_TRACKING_URI", "http://mlflow:5000")  # a server writes the store alone
    assert for_actors(spec, nodes=2, learner_elsewhere=True).tracking.uri == "http://mlflow:5000"


def _fake_saves(monkeypatch):
    from opd.models.dflash import DFlashDrafter

    monkeypatch.setattr(DFlashDrafter, "save_pretrained", lambda self, d: d.mkdir(parents=True))
    return DFlashDrafter.__new__(DFlashDrafter)


def test_keep_last_prunes_all_but_the_newest_checkpoints_after_each_save(tmp_path, monkeypatch):
    from opd.train.checkpoint import checkpoint_dir, latest_checkpoint, save_checkpoint

    drafter = _fake_saves(monkeypatch)
    (checkpoint_dir(tmp_path) / "step-0000009.tmp-other-1").mkdir(parents=True)  # another writer, mid-write
    for step in range(1, 6):
        save_checkpoint(tmp_path, step, drafter, {"step": step}, keep_last=2)
        expected = [f"step-{s:07d}" for s in range(max(1, step - 1), step + 1)]
        assert sorted(p.name for p in checkpoint_dir(tmp_path).glob("step-???????")) == expected
    assert latest_checkpoint(tmp_path).name == "step-0000005"
    assert (checkpoint_dir(tmp_path) / "step-0000009.tmp-other-1").is_dir()
    for step in (6, 7):
        save_checkpoint(tmp_path, step, drafter, {"step": step})  # keep_last None: keep everything
    assert len(list(checkpoint_dir(tmp_path).glob("step-???????"))) == 4


def test_keep_last_never_deletes_the_checkpoint_the_run_resumed_from(tmp_path, monkeypatch):
    from opd.train.checkpoint import checkpoint_dir, save_checkpoint

    drafter = _fake_saves(monkeypatch)
    resumed = save_checkpoint(tmp_path, 3, drafter, {"step": 3})
    for step in (4, 5, 6):
        save_checkpoint(tmp_path, step, drafter, {"step": step}, keep_last=1, resumed_from=resumed)
    assert sorted(p.name for p in checkpoint_dir(tmp_path).iterdir()) == ["step-0000003", "step-0000006"]



def test_on_several_nodes_relative_inputs_are_resolved_here_unless_a_working_dir_ships(micro_spec_file, tmp_path):
    from opd.run_dir import for_actors

    target = load_spec(micro_spec_file, []).models.target_path
    spec = load_spec(micro_spec_file, [f"models.target_path={os.path.relpath(target)}",
                                       f"tracking.run_dir={tmp_path}/runs"])
    assert for_actors(spec, nodes=2).models.target_path == target
    assert for_actors(spec, nodes=2, working_dir=True).models.target_path == os.path.relpath(target)
    assert for_actors(spec, nodes=1).models.target_path == os.path.relpath(target)
