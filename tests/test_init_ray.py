"""`opd train` beside a Ray cluster that `ray start --head` runs on the machine joins it instead of failing.

Ray itself is replaced by a stand-in that follows Ray 2.60's rule: `ray.init()` without an address joins the
cluster `ray start` recorded, and then refuses num_cpus/num_gpus with a ValueError. The real thing is
tests/test_cluster_live.py (slow)."""

from __future__ import annotations

import pytest
import ray

import actors.session
from opd.spec import load_spec

RUNNING = "10.1.2.3:6379"


@pytest.fixture
def spec():
    return load_spec("configs/tiny.yaml")


@pytest.fixture
def fake_ray(monkeypatch):
    """Record ray.init calls; `running` is what `ray start` recorded (None: nothing runs)."""
    state = {"running": None, "calls": []}

    def init(address=None, **kwargs):
        joins = address not in ("local",) and (address or state["running"])
        if joins and ("num_cpus" in kwargs or "num_gpus" in kwargs):
            raise ValueError("When connecting to an existing cluster, num_cpus and num_gpus must not be provided.")
        state["calls"].append({"address": address, **kwargs})

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray._private.utils, "read_ray_address", lambda temp_dir=None: state["running"])
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return state


def test_a_cluster_started_with_ray_start_is_joined_with_its_own_resources(spec, fake_ray, capsys):
    fake_ray["running"] = RUNNING
    actors.session.init_ray(spec)
    assert fake_ray["calls"] == [{"address": RUNNING}]
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"joining the Ray cluster that `ray start` runs at {RUNNING}" in err
    assert "RAY_ADDRESS=local" in err


def test_without_a_running_cluster_a_private_ray_is_sized_by_the_spec(spec, fake_ray, capsys):
    actors.session.init_ray(spec)
    (call,) = fake_ray["calls"]
    assert call["address"] == "local" and (call["num_cpus"], call["num_gpus"]) == (2, 0)
    assert capsys.readouterr().err == ""


def test_ray_address_local_starts_a_private_ray_beside_a_running_one(spec, fake_ray, monkeypatch):
    fake_ray["running"] = RUNNING
    monkeypatch.setenv("RAY_ADDRESS", "local")
    actors.session.init_ray(spec)
    (call,) = fake_ray["calls"]
    assert call["address"] == "local" and call["num_cpus"] == 2


def test_ray_address_names_the_cluster_to_join(spec, fake_ray, monkeypatch):
    fake_ray["running"] = RUNNING
    monkeypatch.setenv("RAY_ADDRESS", "10.9.9.9:6379")
    actors.session.init_ray(spec)
    assert fake_ray["calls"] == [{"address": "10.9.9.9:6379"}]
