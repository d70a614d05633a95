"""The project's Ray metrics (exported to Prometheus with Ray's `ray_` prefix; plotted by dashboards/).

Metrics must be created in the process that records them, so each actor calls `Metrics()` in its constructor.
"""

from __future__ import annotations

from ray.util.metrics import Counter, Gauge, Histogram

SECONDS = [0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 300]
LAGS = [0.5, 1.5, 2.5, 3.5, 4.5, 8.5, 16.5]  # integer lags fall between the bounds

# name -> (kind, description, tag keys); dashboards/ must plot exactly these (a test checks both ways).
DEFINITIONS = {
    "opd_rollout_tokens_per_s": ("gauge", "rollout committed tokens per second, per actor", ("actor",)),
    "opd_rollout_tau": ("gauge", "mean acceptance length of the last rollout batch", ("actor",)),
    "opd_rollout_batches": ("counter", "rollout batches produced", ("actor",)),
    "opd_queue_depth": ("gauge", "batches waiting in a queue", ("queue",)),
    "opd_queue_put_wait_s": ("histogram", "seconds a producer blocked on a full queue", ("queue",)),
    "opd_policy_lag": ("histogram", "learner version minus the draft version of a trained batch", ()),
    "opd_stale_batches": ("counter", "batches discarded for exceeding max_policy_lag", ()),
    "opd_learner_step_s": ("histogram", "seconds per learner optimizer step", ()),
    "opd_learner_idle_fraction": ("gauge", "share of learner time spent waiting for data", ()),
    "opd_broadcast_s": ("histogram", "seconds to publish draft weights to the object store", ()),
    "opd_loss": ("gauge", "Draft-OPD loss (part: total, acc, rej)", ("part",)),
    "opd_replicas": ("gauge", "replicas of a role running (the others wait for room)", ("role",)),
}


class Metrics:
    def __init__(self) -> None:
        self._m = {}
        for name, (kind, description, tags) in DEFINITIONS.items():
            if kind == "gauge":
                self._m[name] = Gauge(name, description, tag_keys=tags)
            elif kind == "counter":
                self._m[name] = Counter(name, description, tag_keys=tags)
            else:
                bounds = LAGS if name == "opd_policy_lag" else SECONDS
                self._m[name] = Histogram(name, description, boundaries=bounds, tag_keys=tags)

    def record(self, name: str, value: float, **tags: str) -> None:
        metric = self._m[name]
        if isinstance(metric, Counter):
            metric.inc(value, tags=tags or None)
        elif isinstance(metric, Gauge):
            metric.set(value, tags=tags or None)
        else:
            metric.observe(value, tags=tags or None)
