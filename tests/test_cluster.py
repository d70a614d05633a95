"""cluster/: the KubeRay manifests, the cluster-launcher YAML and runtime env parse and carry what they must,
cluster/submit.sh builds the exact `ray job submit` command, and the qwen3 configs fit the declared cluster.
Everything runs offline: no Kubernetes, no Ray cluster."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from opd.spec import load_spec

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "cluster"
SUBMIT = CLUSTER / "submit.sh"
QWEN3 = sorted((ROOT / "configs").glob("qwen3-*.yaml"))
GPUS_PER_NODE = 8  # one H200 worker pod holds a whole 8-GPU node


def _docs(name: str) -> list[dict]:
    return [doc for doc in yaml.safe_load_all((CLUSTER / name).read_text()) if doc is not None]


def _kuberay(kind: str) -> list[dict]:
    """Every manifest of that kind under cluster/."""
    found = [doc for path in sorted(CLUSTER.glob("*.yaml")) for doc in _docs(path.name) if doc.get("kind") == kind]
    assert found, f"no {kind} manifest under cluster/"
    return found


def _cluster_specs() -> list[dict]:
    return ([m["spec"] for m in _kuberay("RayCluster")]
            + [m["spec"]["rayClusterSpec"] for m in _kuberay("RayJob")])


def _gpu_workers(spec: dict) -> list[dict]:
    return [g for g in spec["workerGroupSpecs"]
            if any("nvidia.com/gpu" in c.get("resources", {}).get("limits", {})
                   for c in g["template"]["spec"]["containers"])]


def _submit(*args: str, env_extra: dict[str, str] | None = None, drop: tuple[str, ...] = (),
            cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """Run submit.sh with this venv's `opd` on PATH, so its local `opd validate` runs as a user's would."""
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(env_extra or {})
    return subprocess.run(["bash", str(SUBMIT), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("path", sorted(CLUSTER.glob("*.yaml")), ids=lambda p: p.name)
def test_every_cluster_yaml_parses(path):
    docs = [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
    assert docs and all(isinstance(doc, dict) for doc in docs)


def test_kuberay_manifests_have_the_required_fields():
    for manifest in _kuberay("RayCluster") + _kuberay("RayJob"):
        assert manifest["apiVersion"] == "ray.io/v1"
        assert manifest["metadata"]["name"]
    for job in _kuberay("RayJob"):
        assert job["spec"]["entrypoint"].startswith("python -m opd.cli train configs/")  # no `opd` on PATH needed
        assert job["spec"]["submissionMode"] == "K8sJobMode"
        assert job["spec"]["shutdownAfterJobFinishes"] is True
        assert yaml.safe_load(job["spec"]["runtimeEnvYAML"])["working_dir"]
    for spec in _cluster_specs():
        head = spec["headGroupSpec"]
        assert head["template"]["spec"]["containers"]
        assert head["rayStartParams"]["num-gpus"] == "0"
        # KubeRay passes rayStartParams to `ray start` as strings; a YAML number here is rejected.
        assert all(isinstance(v, str) for v in head["rayStartParams"].values())
        assert spec["workerGroupSpecs"]
        for group in spec["workerGroupSpecs"]:
            assert group["groupName"] and group["template"]["spec"]["containers"]
            assert isinstance(group["rayStartParams"], dict)
            assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]


def test_gpu_workers_request_gpus_shm_and_the_shared_volumes():
    for spec in _cluster_specs():
        workers = _gpu_workers(spec)
        assert workers, "no worker group requests nvidia.com/gpu"
        for group in workers:
            pod = group["template"]["spec"]
            assert pod["nodeSelector"]["nvidia.com/gpu.product"]
            volumes = {v["name"]: v for v in pod["volumes"]}
            for container in pod["containers"]:
                resources = container["resources"]
                assert resources["limits"]["nvidia.com/gpu"] == resources["requests"]["nvidia.com/gpu"] \
                    == GPUS_PER_NODE
                mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
                assert volumes[mounts["/dev/shm"]["name"]]["emptyDir"]["medium"] == "Memory"
                assert mounts["/mnt/models"]["readOnly"] and mounts["/mnt/data"]["readOnly"]
                assert "/mnt/runs" in mounts
                env = {e["name"]: e["value"] for e in container["env"]}
                assert {"NCCL_DEBUG", "NCCL_IB_DISABLE", "NCCL_SOCKET_IFNAME"} <= set(env)


def test_rayjob_cluster_matches_raycluster():
    """The two manifests describe one cluster; an edit to one alone would make them drift apart."""
    (cluster,), (job,) = _kuberay("RayCluster"), _kuberay("RayJob")
    assert job["spec"]["rayClusterSpec"] == cluster["spec"]


def test_an_elastic_rollout_worker_group_is_shown_with_the_autoscaler_that_answers_it():
    """A run with resources.rollout.replicas {min, max} asks for max rollout groups; the pending ones are the demand
    the autoscaler answers with nodes of a group that starts empty (issue 70)."""
    for spec in _cluster_specs():
        assert spec["enableInTreeAutoscaling"] is True
        elastic = [g for g in _gpu_workers(spec) if g["minReplicas"] == g["replicas"] == 0 < g["maxReplicas"]]
        assert elastic, "no GPU worker group that starts empty and grows"
    launcher = _docs("cluster.yaml")[0]
    assert launcher["min_workers"] < launcher["max_workers"] <= len(launcher["provider"]["worker_ips"])


def test_runtime_env_and_launcher():
    env = _docs("runtime_env.yaml")[0]
    assert env["working_dir"] == "."
    assert {".venv/", "runs/", ".git/"} <= set(env["excludes"])
    assert not any("assets" in pattern for pattern in env["excludes"])  # the tiny models ship in opd/assets
    assert env["env_vars"]["HF_HUB_OFFLINE"] == "1"
    launcher = _docs("cluster.yaml")[0]
    assert launcher["provider"]["type"] == "local"
    assert launcher["provider"]["head_ip"] and launcher["provider"]["worker_ips"]
    assert any(".[gpu]" in command for command in launcher["setup_commands"])
    assert any("--num-gpus=0" in command for command in launcher["head_start_ray_commands"])


def test_submit_run_submits_opd_run_so_the_job_ends_with_the_suite_table():
    result = _submit("--dry-run", "--run", "configs/qwen3-4b.yaml", env_extra={"RAY_ADDRESS": "http://head:8265"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.endswith(" --no-wait -- python -m opd.cli run configs/qwen3-4b.yaml\n")


def test_submit_dry_run_prints_the_exact_command():
    result = _submit("--dry-run", "configs/qwen3-4b.yaml", env_extra={"RAY_ADDRESS": "http://127.0.0.1:8265"})
    assert result.returncode == 0, result.stderr
    assert re.fullmatch(
        r"ray job submit --address http://127\.0\.0\.1:8265 --runtime-env cluster/runtime_env\.yaml "
        r"--submission-id opd-qwen3-4b-\d{8}-\d{6} --no-wait -- python -m opd\.cli train configs/qwen3-4b\.yaml\n",
        result.stdout)


def test_submit_forwards_train_args_and_takes_the_name_from_the_resolved_spec(tmp_path):
    result = _submit("--dry-run", "--address", "http://head:8265", str(ROOT / "configs" / "qwen3-8b.yaml"),
                     "--set", "name=q8-rebalanced", "--set", "resources.rollout.replicas=5", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert re.fullmatch(
        r"ray job submit --address http://head:8265 --runtime-env cluster/runtime_env\.yaml "
        r"--submission-id opd-q8-rebalanced-\d{8}-\d{6} --no-wait -- python -m opd\.cli train configs/qwen3-8b\.yaml "
        r"--set name=q8-rebalanced --set resources\.rollout\.replicas=5\n", result.stdout)


def test_submit_runs_the_entrypoint_with_the_given_python(tmp_path):
    """`--python` names the head's interpreter, so the job needs neither `opd` nor the right `python` on PATH."""
    result = _submit("--dry-run", "--address", "http://head:8265", "--python", "/opt/venv/bin/python",
                     "configs/tiny.yaml")
    assert result.returncode == 0, result.stderr
    assert result.stdout.rstrip().endswith("--no-wait -- /opt/venv/bin/python -m opd.cli train configs/tiny.yaml")


AUTH_TRACEBACK = "\n".join(
    ["Traceback (most recent call last):"] + [f'  File "ray/dashboard/sdk.py", line {i}, in _do_request' for i in
                                             range(28)]
    + ["ray.exceptions.AuthenticationError: Authentication required: Unauthorized: Missing authentication token"])


def _fake_ray(tmp_path: Path, body: str) -> dict[str, str]:
    """PATH with a stand-in `ray` (and an `opd` whose validation passes at once), HOME without a Ray token."""
    bin_dir, home = tmp_path / "bin", tmp_path / "home"
    bin_dir.mkdir(exist_ok=True)
    home.mkdir(exist_ok=True)
    for name, script in (("ray", body), ("opd", "echo 'name: tiny'")):
        fake = bin_dir / name
        fake.write_text(f"#!/usr/bin/env bash\n{script}\n")
        fake.chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
            "HOME": str(home), "RAY_ADDRESS": "http://127.0.0.1:8265"}


def test_an_auth_failure_is_one_line_that_says_how_to_pass_the_token(tmp_path):
    """Ray 2.60 answers a submit without the head's token with a 30-line AuthenticationError traceback."""
    env = _fake_ray(tmp_path, f"cat >&2 <<'EOF'\n{AUTH_TRACEBACK}\nEOF\nexit 1")
    result = _submit("configs/tiny.yaml", env_extra=env, drop=("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"))
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("error: the cluster at http://127.0.0.1:8265 wants its Ray auth token")
    assert "--token-file" in result.stderr and "RAY_AUTH_TOKEN" in result.stderr


@pytest.mark.parametrize("setup, expected", [
    ({"args": ("--token-file", "token")}, "mode=token path={tmp}/token"),
    ({"env": {"RAY_AUTH_TOKEN": "abc"}}, "mode=token path="),
    ({"home_token": True}, "mode=token path="),
    ({"home_token": True, "env": {"RAY_AUTH_MODE": "disabled"}}, "mode=disabled path="),
    ({}, "mode= path="),
], ids=["token-file", "token-variable", "home-token", "auth-disabled", "no-token"])
def test_the_token_reaches_ray_in_token_mode(tmp_path, setup, expected):
    """Ray's client sends a token only with RAY_AUTH_MODE=token, so submit.sh turns it on when a token is at hand
    (a file, the variable, or ~/.ray/auth_token) and leaves an explicit RAY_AUTH_MODE alone."""
    env = _fake_ray(tmp_path, 'echo "mode=${RAY_AUTH_MODE:-} path=${RAY_AUTH_TOKEN_PATH:-}"')
    (tmp_path / "token").write_text("secret")
    if setup.get("home_token"):
        (tmp_path / "home" / ".ray").mkdir()
        (tmp_path / "home" / ".ray" / "auth_token").write_text("secret")
    result = _submit(*setup.get("args", ()), str(ROOT / "configs" / "tiny.yaml"), cwd=tmp_path,
                     env_extra=env | setup.get("env", {}),
                     drop=("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0] == expected.format(tmp=tmp_path)


@pytest.mark.parametrize("args, drop, message", [
    (("--dry-run", "configs/missing.yaml"), (), "error: config configs/missing.yaml not found"),
    (("configs/qwen3-4b.yaml",), ("RAY_ADDRESS",), "error: RAY_ADDRESS is not set"),
    (("--dry-run", "configs/qwen3-4b.yaml", "--set", "optim.lr=-1"), (), "error: optim.lr"),
    ((), (), "error: missing CONFIG"),
    (("--token-file", "/nonexistent/auth_token", "configs/tiny.yaml"), (), "error: token file /nonexistent"),
], ids=["missing-config", "no-address", "bad-spec", "no-args", "missing-token-file"])
def test_submit_errors_are_one_line(args, drop, message):
    result = _submit(*args, drop=drop)
    assert result.returncode != 0 and result.stdout == ""
    assert result.stderr.startswith(message) and result.stderr.count("\n") == 1


@pytest.mark.parametrize("path", QWEN3, ids=lambda p: p.name)
def test_qwen3_placement_fits_the_declared_cluster(path):
    resources = load_spec(path, check_paths=False).resources
    roles = (resources.rollout, resources.scorer, resources.learner)
    assert sum(role.least * role.num_gpus for role in roles) <= resources.cluster.num_gpus
    # the scorers prefer the learner's node (opd/train/fleet.py), so the shipped layouts fit them there.
    assert resources.learner.num_gpus + resources.scorer.least * resources.scorer.num_gpus <= GPUS_PER_NODE
    # The declared cluster must be one the manifests provide.
    for spec in _cluster_specs():
        offered = sum(g["replicas"] * GPUS_PER_NODE for g in _gpu_workers(spec))
        assert resources.cluster.num_gpus <= offered
