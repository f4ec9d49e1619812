"""The Grafana dashboard in docs/ is valid JSON whose queries name only metrics the
connector exposes (the e2e API server test checks them on a running server's `/metrics`)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from hybridkv.integration.stats import exposed_names

DASHBOARD = Path(__file__).parents[2] / "docs" / "grafana" / "hybridkv.json"
# PromQL names with a colon are metric names (labels and functions have none)
METRIC_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*:[a-zA-Z0-9_:]*")


def queries(dashboard: dict[str, Any]) -> list[str]:
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    variables = dashboard["templating"]["list"]
    return exprs + [v["definition"] for v in variables if v["type"] == "query"]


def test_every_query_names_only_metrics_the_connector_exposes() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    known = exposed_names()
    for query in queries(dashboard):
        names = set(METRIC_NAME.findall(query))
        assert names, query
        assert names <= known, (query, names - known)


def test_the_panels_an_operator_needs_are_there() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    titles = {panel["title"] for panel in dashboard["panels"]}
    assert {"Pool hit rate", "Load latency", "Save latency", "Bytes moved"} <= titles
    assert {"Failed loads and saves", "Quarantine", "Lookup breaker"} <= titles
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(set(ids)) == len(ids)
    used = {name for query in queries(dashboard) for name in METRIC_NAME.findall(query)}
    assert "vllm:hybridkv_load_duration_seconds_bucket" in used
    assert "vllm:hybridkv_save_duration_seconds_bucket" in used
