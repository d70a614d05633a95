"""The weight publisher: snapshots finished in the background are of the step that published them, reach the sink
in version order, and a failure there stops the learner at its next step with one line."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import opd.train.publisher as publisher_module
from opd.errors import OpdError
from opd.train.messages import WeightSnapshot, checksum
from opd.train.publisher import Publisher


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _step(model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
    optim.zero_grad()
    model(torch.randn(4, 8)).square().sum().backward()
    optim.step()


def _first(model: torch.nn.Module) -> WeightSnapshot:
    return WeightSnapshot.of(model.state_dict(), 0)


def test_the_snapshot_of_step_s_survives_step_s_plus_1_running_before_it_is_finished(monkeypatch):
    release, entered = threading.Event(), threading.Event()

    def slow_checksum(state: dict[str, torch.Tensor]) -> str:
        entered.set()
        assert release.wait(10)
        return checksum(state)

    monkeypatch.setattr(publisher_module, "checksum", slow_checksum)
    model, optim = _model()
    publisher = Publisher(_first(model))
    _step(model, optim)
    after_step_1 = {k: v.clone() for k, v in model.state_dict().items()}
    publisher.submit(model.state_dict(), 1)
    assert entered.wait(10)
    _step(model, optim)  # step 2 changes the live weights while publication 1 is still under way
    assert not torch.equal(model.state_dict()["0.weight"], after_step_1["0.weight"])
    release.set()
    snapshot = publisher.latest()
    assert snapshot.version == 1 and snapshot.state.keys() == after_step_1.keys()
    assert all(torch.equal(snapshot.state[k], v) for k, v in after_step_1.items())
    assert snapshot.verified(1) is snapshot
    publisher.close()


def test_publications_reach_the_sink_in_version_order_and_close_waits_for_the_last():
    model, optim = _model()
    seen: list[int] = []

    def slow_sink(snapshot: WeightSnapshot) -> None:
        time.sleep(0.02)
        seen.append(snapshot.version)

    publisher = Publisher(_first(model), slow_sink)
    for version in range(1, 6):
        _step(model, optim)
        publisher.submit(model.state_dict(), version)
    publisher.close()  # version 5 is still pending here
    assert seen == [1, 2, 3, 4, 5]
    assert publisher.latest().version == 5


def test_a_failed_publication_surfaces_at_the_next_step_in_one_line():
    model, _ = _model()

    def sink(snapshot: WeightSnapshot) -> None:
        if snapshot.version == 2:
            raise ConnectionError("weight store gone\n\tclass_name: WeightStore")

    publisher = Publisher(_first(model), sink)
    publisher.submit(model.state_dict(), 1)
    publisher.submit(model.state_dict(), 2)  # waits for 1, which succeeds
    deadline = time.monotonic() + 10
    with pytest.raises(OpdError) as err:
        while time.monotonic() < deadline:  # the learner's steps, until the thread has failed
            publisher.check()
            time.sleep(0.01)
    assert str(err.value) == "weight publication v2 failed: ConnectionError: weight store gone"
    assert publisher.latest().version == 1  # the failed version was never published
    publisher.close()


def test_check_never_waits_for_a_publication_under_way(monkeypatch):
    release = threading.Event()
    monkeypatch.setattr(publisher_module, "checksum", lambda state: (release.wait(10), "crc32:0")[1])
    model, _ = _model()
    publisher = Publisher(_first(model))
    publisher.submit(model.state_dict(), 1)
    t0 = time.perf_counter()
    publisher.check()
    assert time.perf_counter() - t0 < 1.0
    release.set()
    publisher.close()
    assert publisher.latest().version == 1
