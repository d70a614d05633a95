"""Every dashboard panel plots a metric the code emits, and every emitted metric has a panel."""

from __future__ import annotations

import json
import re
from pathlib import Path

from actors.metrics import DEFINITIONS

DASHBOARD = Path(__file__).resolve().parents[1] / "dashboards" / "draft_opd.json"
SUFFIXES = {"gauge": [""], "counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}


def exported_names() -> dict[str, str]:
    """Prometheus series name -> our metric name, following Ray's `ray_` prefix and Prometheus suffixes."""
    return {f"ray_{name}{suffix}": name for name, (kind, _, _) in DEFINITIONS.items() for suffix in SUFFIXES[kind]}


def test_panels_and_metrics_match_both_ways():
    panels = json.loads(DASHBOARD.read_text())["panels"]
    exported = exported_names()
    plotted = set()
    for panel in panels:
        series = set(re.findall(r"\bray_opd_[a-z_]+", " ".join(t["expr"] for t in panel["targets"])))
        assert series and series <= set(exported), f"panel {panel['title']!r} plots unknown series {series}"
        plotted |= {exported[s] for s in series}
    assert plotted == set(DEFINITIONS)
