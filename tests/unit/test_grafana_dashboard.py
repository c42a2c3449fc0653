"""The Grafana dashboard in docs/ graphs metrics that exist."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

from dedupe.observability.metrics import Metrics
from dedupe.pipeline.stats import Stats
from tests.conftest import ROOT


def test_every_metric_the_dashboard_queries_is_exported() -> None:
    dashboard = json.loads((ROOT / "docs" / "grafana-dashboard.json").read_text())
    queried = {
        name
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in re.findall(r"\bdedupe_[a-z_]+", target["expr"])
    }
    metrics = Metrics()
    stats = Stats()
    stats.dead_lettered["key_conflict"] += 1
    worker = SimpleNamespace(stats=stats, in_flight=0, app=SimpleNamespace(handlers={"h": None}))
    metrics.watch_processor(worker)  # type: ignore[arg-type]
    metrics.watch_receiver({"accepted": 1})
    metrics.claimed("h", 0.002, 10)
    metrics.ran("h", 0.02, ok=False)
    exported = set()
    for family in metrics.registry.collect():
        exported |= {sample.name for sample in family.samples}
    assert queried, "the dashboard queries nothing"
    assert queried <= exported, queried - exported
