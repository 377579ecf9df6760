"""deploy/grafana/hotpool.json as the tests read it: its PromQL queries, the metric names
they use, and the series a ``/metrics`` text exposes (a board must query only those)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parent.parent
BOARD = REPO / "deploy" / "grafana" / "hotpool.json"
METRIC_NAME = re.compile(r"(?<![A-Za-z0-9_:])hotpool_[A-Za-z0-9_:]*")


def load_board() -> dict[str, Any]:
    board = json.loads(BOARD.read_text())
    assert isinstance(board, dict)
    return board


def panels(board: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, those folded into a collapsed row included."""
    for panel in board.get("panels", []):
        yield panel
        yield from panel.get("panels", [])


def queries(board: dict[str, Any]) -> list[str]:
    """Every PromQL text of the board: panel targets and template variable queries."""
    found = [t["expr"] for p in panels(board) for t in p.get("targets", [])]
    for var in board.get("templating", {}).get("list", []):
        if var.get("type") != "query":
            continue
        query = var.get("query")
        found.append(query["query"] if isinstance(query, dict) else str(query))
        found.append(var.get("definition", ""))
    return found


def queried_metrics(board: dict[str, Any]) -> set[str]:
    """The series names the board's queries select (``_bucket``, ``_total``... as written)."""
    return {name for q in queries(board) for name in METRIC_NAME.findall(q)}


def exposed_series(text: str) -> set[str]:
    """The sample names of a Prometheus text exposition (``_bucket``/``_sum``/``_count`` of
    histograms, ``_total`` of counters): what PromQL can select. Families with no sample
    (a labelled metric never observed) have no series, so they do not count."""
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}
