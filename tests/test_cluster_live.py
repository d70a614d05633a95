"""A real Ray 2.60 head on this machine (`ray start --head`, token auth on, the venv NOT on its PATH): `opd train`
joins it, and cluster/submit.sh submits configs/tiny.yaml to it as a job that SUCCEEDS and leaves an MLflow run.

The head is private to this module: its own HOME (auth token), TMPDIR (so no other Ray session on the machine
finds it, and it finds none), free ports, and its own process group, which is all that is stopped at the end.
Slow: starting the head takes 10-40 s on a busy 2-core machine, the job a few minutes.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
HEAD_CPUS = 3  # not the 2 that configs/tiny.yaml declares, so joining the head shows in the CPU count
# Run with the token in the environment (a separate process: RAY_AUTH_MODE must not leak into this one).
WAIT_FOR_JOB = """
import sys, time
from ray.job_submission import JobSubmissionClient
client = JobSubmissionClient(sys.argv[1])
while not (status := client.get_job_status(sys.argv[2])).is_terminal():
    time.sleep(3)
print(status.value)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _clean_env(**extra: str) -> dict[str, str]:
    """This environment without any Ray address, auth setting or temp dir (tests/conftest.py sets RAY_TMPDIR, which
    would override the TMPDIR given here), and without the venv on PATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "RAY_AUTH", "RAY_TMPDIR"))}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if Path(p) != VENV_BIN)
    return env | extra


@dataclass
class Head:
    home: Path  # holds .ray/auth_token, the cluster's token
    env: dict[str, str]  # HOME and TMPDIR of the head: a process with these finds it as `ray start`'s cluster
    dashboard: str
    token: Path


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    root = tmp_path_factory.mktemp("ray-head")
    home = root / "home"
    (home / ".ray").mkdir(parents=True)
    tmp = Path(tempfile.mkdtemp(prefix="opdh-", dir="/tmp"))  # short: Ray's socket paths must fit in 107 bytes
    token = home / ".ray" / "auth_token"
    token.write_text(uuid.uuid4().hex)
    env = _clean_env(HOME=str(home), TMPDIR=str(tmp), RAY_AUTH_MODE="token")
    port, dashboard_port = _free_port(), _free_port()
    log = root / "head.log"
    cmd = [str(VENV_BIN / "ray"), "start", "--head", "--block", f"--port={port}", "--dashboard-host=127.0.0.1",
           f"--dashboard-port={dashboard_port}", f"--ray-client-server-port={_free_port()}",
           f"--dashboard-agent-listen-port={_free_port()}", f"--num-cpus={HEAD_CPUS}", "--num-gpus=0",
           "--disable-usage-stats"]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while "Ray runtime started" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, f"ray start failed:\n{log.read_text()}"
            time.sleep(1)
        yield Head(home, env, f"http://127.0.0.1:{dashboard_port}", token)
    finally:
        _stop(proc)
        shutil.rmtree(tmp, ignore_errors=True)


def _stop(proc: subprocess.Popen) -> None:
    """Stop only this head: `ray start --block` tears its node down on SIGTERM; its process group follows."""
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            time.sleep(2)
        except subprocess.TimeoutExpired:
            continue
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # stragglers of the group (gcs_server, raylet, dashboard)
    except ProcessLookupError:
        pass


def test_opd_train_joins_the_running_head(head):
    """Ray's own rule would refuse the spec's num_cpus here; init_ray joins the head and its 3 CPUs instead."""
    code = ("import ray; from actors.session import init_ray; from opd.spec import load_spec; "
            "init_ray(load_spec('configs/tiny.yaml')); print('CPU', ray.cluster_resources()['CPU'])")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=head.env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"CPU {float(HEAD_CPUS)}" in done.stdout
    assert "note: joining the Ray cluster that `ray start` runs at" in done.stderr


def test_submit_sh_runs_tiny_to_success_with_the_token_and_without_opd_on_path(head, tmp_path):
    client = _clean_env(HOME=str(tmp_path / "client-home"), TMPDIR=str(tmp_path), RAY_ADDRESS=head.dashboard)
    client["PATH"] = f"{VENV_BIN}{os.pathsep}{client['PATH']}"  # the submitting laptop has ray (and opd)
    run_dir = tmp_path / "run"
    train = ["--set", "steps=2", "--set", "rollout.max_new_tokens=32", "--set", "optim.batch_size=8",
             "--set", "eval.every=2", "--set", "eval.num_prompts=4", "--set", "eval.max_new_tokens=16",
             "--set", "tracking.checkpoint_every=2", "--set", f"tracking.run_dir={run_dir}"]
    submit = [str(ROOT / "cluster" / "submit.sh"), "--python", sys.executable, "configs/tiny.yaml", *train]

    refused = subprocess.run(["bash", *submit], cwd=ROOT, env=client, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert "wants its Ray auth token" in refused.stderr and "--token-file" in refused.stderr

    job_id = None
    for _ in range(10):  # the head's job agent can take a while to come up on a busy machine
        done = subprocess.run(["bash", submit[0], "--token-file", str(head.token), *submit[1:]], cwd=ROOT,
                              env=client, capture_output=True, text=True, timeout=300)
        if done.returncode == 0 or "No available agent" not in done.stderr:
            break
        time.sleep(6)
    assert done.returncode == 0, done.stderr
    job_id = next(line.split()[-1] for line in done.stdout.splitlines() if line.startswith("job id:"))

    status_env = client | {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(head.token)}
    status = subprocess.run([sys.executable, "-c", WAIT_FOR_JOB, head.dashboard, job_id], env=status_env,
                            capture_output=True, text=True, timeout=900).stdout.strip()
    logs = subprocess.run([str(VENV_BIN / "ray"), "job", "logs", "--address", head.dashboard, job_id],
                          env=status_env, capture_output=True, text=True, timeout=120).stdout
    assert status == "SUCCEEDED", f"{status}\n{logs[-4000:]}"
    assert "opd: not found" not in logs

    db = run_dir / "mlflow.db"
    assert db.is_file(), f"no MLflow store in {run_dir}: {sorted(p.name for p in run_dir.iterdir())}"
    with sqlite3.connect(db) as conn:
        runs = conn.execute("select status from runs").fetchall()
        steps = conn.execute("select count(distinct step) from metrics").fetchone()[0]
    assert runs and all(status == "FINISHED" for (status,) in runs), runs
    assert steps >= 2
