"""Writes ``hotpool.json``, the Grafana dashboard over the control plane's ``/metrics``.

The JSON is what Grafana loads (provisioned from ``provisioning/dashboards`` or imported by
hand); this script is where it is edited, because twenty panels of Grafana JSON repeat the
same boilerplate. ``python deploy/grafana/build_dashboard.py`` rewrites the file, and
``tests/test_grafana_board.py`` checks the two agree and that every metric queried exists.

Panels take their datasource from the ``datasource`` variable (any Prometheus one, the
provisioned ``prometheus`` by default), so the file works provisioned and imported alike.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

OUT = Path(__file__).with_name("hotpool.json")
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
DEP = 'deployment=~"$deployment"'  # every per-deployment query follows the variable
RATE = "$__rate_interval"

Panel = dict[str, Any]


def target(expr: str, legend: str, ref: str) -> dict[str, Any]:
    return {
        "datasource": DATASOURCE,
        "expr": expr,
        "legendFormat": legend,
        "range": True,
        "refId": ref,
    }


def targets(*queries: tuple[str, str]) -> list[dict[str, Any]]:
    """``(expr, legend)`` pairs as targets A, B, C..."""
    return [target(e, legend, chr(ord("A") + i)) for i, (e, legend) in enumerate(queries)]


def quantiles(histogram: str, *qs: float) -> list[dict[str, Any]]:
    """p-quantiles of a histogram per deployment, over the rate of its buckets."""
    return targets(
        *(
            (
                f"histogram_quantile({q}, sum by (deployment, le) "
                f"(rate({histogram}_bucket{{{DEP}}}[{RATE}])))",
                f"{{{{deployment}}}} p{round(q * 100)}",
            )
            for q in qs
        )
    )


def timeseries(
    title: str,
    description: str,
    unit: str,
    queries: list[dict[str, Any]],
    *,
    stacked: bool = False,
    max_value: float | None = None,
) -> Panel:
    defaults: dict[str, Any] = {
        "unit": unit,
        "min": 0,
        "custom": {
            "drawStyle": "line",
            "lineWidth": 1,
            "fillOpacity": 25 if stacked else 5,
            "showPoints": "never",
            "spanNulls": False,
            "stacking": {"mode": "normal" if stacked else "none", "group": "A"},
        },
    }
    if max_value is not None:
        defaults["max"] = max_value
    return {
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
        "targets": queries,
    }


def stat(title: str, description: str, unit: str, queries: list[dict[str, Any]]) -> Panel:
    return {
        "type": "stat",
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "background",
            "graphMode": "none",
            "textMode": "auto",
        },
        "targets": queries,
    }


def database_up() -> Panel:
    panel = stat(
        "Ledger database",
        "Whether usage records reach the database directly (down: they go to the spool)",
        "none",
        targets(("min(hotpool_ledger_database_up)", "database")),
    )
    panel["fieldConfig"]["defaults"] |= {
        "mappings": [
            {
                "type": "value",
                "options": {
                    "0": {"text": "down", "color": "red", "index": 0},
                    "1": {"text": "up", "color": "green", "index": 1},
                },
            }
        ],
        "thresholds": {
            "mode": "absolute",
            "steps": [{"color": "red", "value": None}, {"color": "green", "value": 1}],
        },
    }
    return panel


def cold_start_phases() -> Panel:
    # Cold starts are rare: a mean over the whole range says more than a sparse time series.
    return {
        "type": "bargauge",
        "title": "Cold-start seconds by phase (mean over the range)",
        "description": "fetch (object store or disk cache), load (weights), warmup; total is"
        " the whole cold start including the wait for a worker",
        "datasource": DATASOURCE,
        "fieldConfig": {"defaults": {"unit": "s", "min": 0}, "overrides": []},
        "options": {
            "orientation": "horizontal",
            "displayMode": "basic",
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "showUnfilled": True,
        },
        "targets": [
            {
                **target(
                    f"sum by (phase) (increase(hotpool_cold_start_seconds_sum{{{DEP}}}[$__range]))"
                    " / sum by (phase) "
                    f"(increase(hotpool_cold_start_seconds_count{{{DEP}}}[$__range]))",
                    "{{phase}}",
                    "A",
                ),
                "instant": True,
                "range": False,
            }
        ],
    }


def row(title: str) -> Panel:
    return {"type": "row", "title": title, "collapsed": False, "panels": []}


def layout() -> list[Panel | tuple[Panel, ...]]:
    """Rows, and the panels of each line below them (a tuple shares the 24 columns)."""
    requests = timeseries(
        "Requests by status",
        "Requests per second by outcome: completed, partial (stream cut), error, cancelled",
        "reqps",
        targets((f"sum by (status) (rate(hotpool_requests_total{{{DEP}}}[{RATE}]))", "{{status}}")),
        stacked=True,
    )
    tokens = timeseries(
        "Tokens per second by kind",
        "Metered tokens: input (prompt, cached ones included), cached_input, output",
        "short",
        targets((f"sum by (kind) (rate(hotpool_tokens_total{{{DEP}}}[{RATE}]))", "{{kind}}")),
    )
    ttft = timeseries(
        "Time to first token p50 / p95",
        "From the request's arrival (queue and cold start included) to its first token",
        "s",
        quantiles("hotpool_time_to_first_token_seconds", 0.5, 0.95),
    )
    itl = timeseries(
        "Inter-token latency p50 / p95",
        "Time between consecutive output tokens of a choice, at the control plane",
        "s",
        quantiles("hotpool_inter_token_latency_seconds", 0.5, 0.95),
    )
    e2e = timeseries(
        "End-to-end latency p50 / p95",
        "Whole request time, from arrival to its last token",
        "s",
        quantiles("hotpool_request_duration_seconds", 0.5, 0.95),
    )
    queue = timeseries(
        "Queue time p95",
        "Time a request waited for a ready replica (a cold start shows up here)",
        "s",
        quantiles("hotpool_queue_seconds", 0.95),
    )
    replicas = timeseries(
        "Replicas by state",
        "queued (no worker free), cold, loading, ready, draining",
        "short",
        targets((f"sum by (state) (hotpool_replicas{{{DEP}}})", "{{state}}")),
        stacked=True,
    )
    workers = timeseries(
        "Workers by state",
        "Worker processes of the local pool: starting, idle (warm, no model), loading,"
        " serving, draining",
        "short",
        targets(("sum by (state) (hotpool_workers_by_state)", "{{state}}")),
        stacked=True,
    )
    queue_depth = timeseries(
        "Queued and in-flight requests",
        "Requests waiting for a ready replica, and requests being served",
        "short",
        targets(
            (f"sum by (deployment) (hotpool_queue_depth{{{DEP}}})", "{{deployment}} queued"),
            (
                f"sum by (deployment) (hotpool_inflight_requests{{{DEP}}})",
                "{{deployment}} in flight",
            ),
        ),
    )
    scale = timeseries(
        "Scale events",
        "Replicas added (up) and removed (down) per interval",
        "short",
        targets(
            (
                f"sum by (deployment, direction) "
                f"(increase(hotpool_scale_events_total{{{DEP}}}[{RATE}]))",
                "{{deployment}} {{direction}}",
            )
        ),
    )
    kv = timeseries(
        "KV cache usage",
        "Fraction of KV cache blocks in use, the highest of each deployment's ready replicas;"
        " near 1 the engine preempts requests",
        "percentunit",
        targets(
            (
                f"max by (deployment) (hotpool_kv_cache_usage_ratio{{{DEP}}})",
                "{{deployment}}",
            )
        ),
        max_value=1,
    )
    failures = timeseries(
        "Ledger write failures",
        "Database writes of usage that failed (their records went to the spool or were"
        " retried), and records the database refused",
        "short",
        targets(
            (f"sum(increase(hotpool_ledger_write_failures_total[{RATE}]))", "failed writes"),
            (f"sum(increase(hotpool_ledger_rejected_records_total[{RATE}]))", "refused records"),
            (f"sum(increase(hotpool_ledger_spooled_records_total[{RATE}]))", "records spooled"),
        ),
    )
    spool = timeseries(
        "Ledger spool",
        "Bytes of usage records waiting in the spool for the database to come back",
        "bytes",
        targets(("sum(hotpool_ledger_spool_bytes)", "spool")),
    )
    return [
        row("Traffic"),
        (requests, tokens),
        row("Latency"),
        (ttft, itl),
        (e2e, queue),
        row("Capacity"),
        (replicas, workers),
        (queue_depth, scale),
        (cold_start_phases(), kv),
        row("Ledger"),
        (database_up(), failures, spool),
    ]


def place(items: list[Panel | tuple[Panel, ...]]) -> list[Panel]:
    """Ids and grid positions: rows a line of their own, panels share a line evenly."""
    panels: list[Panel] = []
    y = 0
    for item in items:
        line = item if isinstance(item, tuple) else (item,)
        is_row = len(line) == 1 and line[0]["type"] == "row"
        height = 1 if is_row else 8
        w = 24 // len(line)
        for i, panel in enumerate(line):
            grid = {"h": height, "w": w, "x": i * w, "y": y}
            panels.append({"id": len(panels) + 1, "gridPos": grid, **panel})
        y += height
    return panels


def templating() -> dict[str, Any]:
    deployments = "label_values(hotpool_requests_total, deployment)"
    return {
        "list": [
            {
                "name": "datasource",
                "label": "Prometheus",
                "type": "datasource",
                "query": "prometheus",
                "current": {"text": "Prometheus", "value": "prometheus"},
                "hide": 0,
                "refresh": 1,
                "regex": "",
                "options": [],
            },
            {
                "name": "deployment",
                "label": "Deployment",
                "type": "query",
                "datasource": DATASOURCE,
                "definition": deployments,
                "query": {
                    "qryType": 1,
                    "query": deployments,
                    "refId": "PrometheusVariableQueryEditor-VariableQuery",
                },
                "includeAll": True,
                "multi": True,
                "allValue": ".*",
                "current": {"text": ["All"], "value": ["$__all"]},
                "refresh": 2,  # on time range change: new deployments appear
                "sort": 1,
                "hide": 0,
                "regex": "",
                "options": [],
            },
        ]
    }


def dashboard() -> dict[str, Any]:
    return {
        "annotations": {
            "list": [
                {
                    "builtIn": 1,
                    "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                    "enable": True,
                    "hide": True,
                    "iconColor": "rgba(0, 211, 255, 1)",
                    "name": "Annotations & Alerts",
                    "type": "dashboard",
                }
            ]
        },
        "description": "hotpool control plane: traffic, tokens, latency, replicas, workers,"
        " cold starts, KV cache and the usage ledger",
        "editable": True,
        "fiscalYearStartMonth": 0,
        "graphTooltip": 1,
        "id": None,
        "links": [],
        "panels": place(layout()),
        "refresh": "30s",
        "schemaVersion": 39,
        "tags": ["hotpool", "llm"],
        "templating": templating(),
        "time": {"from": "now-6h", "to": "now"},
        "timepicker": {},
        "timezone": "browser",
        "title": "hotpool",
        "uid": "hotpool",
        "version": 1,
        "weekStart": "",
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}")
