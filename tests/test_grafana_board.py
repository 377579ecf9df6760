"""deploy/: the Grafana dashboard has the structure Grafana loads, is what its generator
writes, and scrapes/queries what the control plane serves; the Prometheus and Grafana
provisioning files parse. (That every metric the board queries exists: in
tests/platform/test_metrics_text.py in-process, tests/e2e/test_metrics_load.py live.)"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml
from grafana_board import BOARD, REPO, load_board, panels, queried_metrics, queries

DEPLOY = REPO / "deploy"
GRID_COLUMNS = 24


def _generator() -> ModuleType:
    path = DEPLOY / "grafana" / "build_dashboard.py"
    spec = importlib.util.spec_from_file_location("build_dashboard", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def board() -> dict[str, Any]:
    return load_board()


def test_the_board_is_what_its_generator_writes() -> None:
    assert BOARD.read_text() == _generator().render(), (
        "deploy/grafana/hotpool.json is stale: run python deploy/grafana/build_dashboard.py"
    )


def test_the_dashboard_has_what_grafana_needs(board: dict[str, Any]) -> None:
    assert board["title"] == "hotpool" and board["uid"] == "hotpool"
    assert isinstance(board["schemaVersion"], int) and 36 <= board["schemaVersion"] <= 41
    assert board["id"] is None  # Grafana assigns it; a fixed id clashes on import
    assert {"from", "to"} <= set(board["time"])
    all_panels = list(panels(board))
    ids = [p["id"] for p in all_panels]
    assert all(isinstance(i, int) for i in ids) and len(set(ids)) == len(ids)
    for panel in all_panels:
        assert panel["type"] and panel["title"], panel
        grid = panel["gridPos"]
        assert all(isinstance(grid[k], int) for k in ("h", "w", "x", "y")), panel["title"]
        assert grid["w"] > 0 and grid["h"] > 0 and grid["x"] + grid["w"] <= GRID_COLUMNS
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(set(refs)) == len(refs), panel["title"]
        for t in panel["targets"]:
            assert t["datasource"] == panel["datasource"] and t["expr"].strip()


def test_panels_do_not_overlap(board: dict[str, Any]) -> None:
    cells: dict[tuple[int, int], str] = {}
    for panel in board["panels"]:
        g = panel["gridPos"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = panel["title"]


def test_the_board_covers_what_issue_9_asks_for(board: dict[str, Any]) -> None:
    titles = " | ".join(p["title"].lower() for p in panels(board))
    for words in ("requests by status", "tokens per second", "time to first token",
                  "inter-token", "end-to-end", "queue time", "replicas by state",
                  "workers by state", "cold-start seconds by phase", "kv cache",
                  "ledger database", "ledger write failures", "ledger spool"):  # fmt: skip
        assert words in titles, words
    used = queried_metrics(board)
    assert all(re.fullmatch(r"hotpool_[a-z0-9_]+", m) for m in used), used
    assert any(m.endswith("_bucket") for m in used)  # quantiles come from histograms


def test_deployment_variable_and_quantiles(board: dict[str, Any]) -> None:
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    deployment = variables["deployment"]
    assert deployment["type"] == "query" and deployment["includeAll"]
    assert deployment["query"]["query"] == "label_values(hotpool_requests_total, deployment)"
    for expr in queries(board):
        assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), expr
        if "histogram_quantile" in expr:
            assert re.search(r"histogram_quantile\(0\.\d+, sum by \([a-z, ]*\ble\)", expr), expr
            assert "_bucket{" in expr and "rate(" in expr, expr


def test_prometheus_scrapes_the_control_planes_metrics() -> None:
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    assert config["global"]["scrape_interval"] == "15s"
    [job] = [j for j in config["scrape_configs"] if j["job_name"] == "hotpool"]
    assert job["metrics_path"] == "/metrics"
    [static] = job["static_configs"]
    assert static["targets"] == ["hotpool:8000"]


def test_grafana_provisioning_points_at_the_board_and_the_datasource(
    board: dict[str, Any],
) -> None:
    provisioning = DEPLOY / "grafana" / "provisioning"
    sources = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())
    [source] = sources["datasources"]
    assert source["type"] == "prometheus"
    default = next(v for v in board["templating"]["list"] if v["name"] == "datasource")
    assert source["uid"] == default["current"]["value"]  # the board's default datasource
    dashboards = yaml.safe_load((provisioning / "dashboards" / "hotpool.yml").read_text())
    [provider] = dashboards["providers"]
    assert provider["type"] == "file" and Path(provider["options"]["path"]).is_absolute()
