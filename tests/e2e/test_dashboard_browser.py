"""The ``/dashboard`` page in a real browser (Debian's chromium, driven by Playwright; no
downloaded browser) against a real ``hotpool serve`` with API keys on.

The ledger holds a month of generated usage for two tenants (written straight into the
server's SQLite file, with prices in force, so costs are real ledger costs) plus real
requests to SmolLM2, whose cold start gives scale events with phases. Every number the page
draws is compared with what ``/v1/usage`` and ``/v1/usage/summary`` report for the same
window; tenant A's page never shows a name of tenant B's; the console stays clean. One
request took 100 times longer than the others (the latency bars must stay readable), and a
server with no prices shows rankings by tokens.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_process import Server, running_server

from hotpool.billing.db import Database
from hotpool.billing.keys import KeyStore
from hotpool.billing.ledger import Ledger, UsageRecord
from hotpool.billing.prices import PriceStore
from hotpool.billing.tenants import TenantStore

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
if not Path(CHROMIUM).exists():
    if os.environ.get("HOTPOOL_REQUIRE_BROWSER") == "1":  # CI: a skip would hide the test
        pytest.fail(f"HOTPOOL_REQUIRE_BROWSER=1 but there is no {CHROMIUM}", pytrace=False)
    pytest.skip(
        "Debian's chromium is not installed (apt-get install chromium; .ci/run does it)",
        allow_module_level=True,
    )
sync_api = pytest.importorskip("playwright.sync_api")
# Web-first assertions: what the page's script renders is waited for, never read once right
# after a navigation or a click (a loaded CI machine answers the page's requests late).
expect = sync_api.expect
expect.set_options(timeout=30_000)

RANGES = ("1h", "24h", "7d", "30d")
# One batch job of alpha's took 50 minutes, 100 times the slowest of its other requests.
SLOW_DEPLOYMENT, SLOW_SECONDS = "alpha-batch", 3000.0
STATUSES = ("completed", "completed", "completed", "partial", "error", "cancelled")
NO_VALUE = "\u2013"  # the en dash the page shows where it has no value


@dataclass
class Board:
    server: Server
    keys: dict[str, str]  # "alpha:usage", "beta:usage", "alpha:operator", "alpha:invoke", ...
    deployments: dict[str, set[str]]  # tenant -> its deployment names

    def get(self, path: str, who: str, **params: Any) -> Any:
        r = httpx.get(
            f"{self.server.url}{path}",
            params=params,
            headers={"authorization": f"Bearer {self.keys[who]}"},
            timeout=30,
        )
        assert r.status_code == 200, r.text
        return r.json()


def _seed(db: Database, now: datetime) -> tuple[dict[str, str], dict[str, set[str]]]:
    """Two tenants with keys, prices, and a month of usage each (deterministic)."""
    tenants, keystore = TenantStore(db), KeyStore(db)
    PriceStore(db).set(None, 150_000, 75_000, 600_000, effective_from=now - timedelta(days=60))
    keys: dict[str, str] = {}
    deployments = {"alpha": {"alpha-chat", "alpha-summarize"}, "beta": {"beta-secret"}}
    rng = random.Random(9)
    records = []
    for tenant_name in ("alpha", "beta"):
        tenant = tenants.create(tenant_name)
        key_ids = []
        for scopes in ("usage", "admin", "invoke,deploy", "deploy", "operator"):
            record, keys[f"{tenant_name}:{scopes}"] = keystore.create(tenant.id, scopes)
            key_ids.append(record.id)
        for i in range(60):
            # Half in the last hour (the 1h range has data), the rest over 30 days.
            ago = (
                timedelta(minutes=rng.uniform(1, 55))
                if i % 2
                else timedelta(hours=rng.uniform(1, 29 * 24))
            )
            prompt = rng.randint(20, 4000) * (10 if tenant_name == "beta" else 1)
            records.append(
                UsageRecord(
                    f"seed-{tenant_name}-{i}",
                    rng.choice(sorted(deployments[tenant_name])),
                    "chat.completions",
                    rng.choice(STATUSES),
                    prompt,
                    rng.randint(1, 500),
                    cached_tokens=rng.randint(0, prompt // 2),
                    tenant_id=tenant.id,
                    api_key_id=rng.choice(key_ids[2:]),
                    queue_seconds=rng.uniform(0, 0.2),
                    ttft_seconds=rng.uniform(0.05, 2.0),
                    total_seconds=rng.uniform(2.0, 30.0),
                    created_at=now - ago,
                )
            )
        if tenant_name == "alpha":
            records.append(
                UsageRecord(f"seed-{SLOW_DEPLOYMENT}", SLOW_DEPLOYMENT, "chat.completions",
                            "completed", 1200, 300, tenant_id=tenant.id, api_key_id=key_ids[2],
                            ttft_seconds=1.5, total_seconds=SLOW_SECONDS,
                            created_at=now - timedelta(minutes=30))
            )  # fmt: skip
            deployments["alpha"].add(SLOW_DEPLOYMENT)
    Ledger(db).record_many(records)
    return keys, deployments


@pytest.fixture(scope="module")
def board(tmp_path_factory: pytest.TempPathFactory, smollm2_snapshot_bf16: Path) -> Iterator[Board]:
    home = tmp_path_factory.mktemp("dashboard-home")
    uri = f"file://{smollm2_snapshot_bf16}"
    env = {"HOTPOOL_AUTH": "keys", "HOTPOOL_MAX_WORKERS": "1", "HOTPOOL_WARM_WORKERS": "0"}
    with running_server(home, uri, env) as server:
        db = Database(f"sqlite:///{home / 'hotpool.db'}")
        try:
            keys, deployments = _seed(db, datetime.now(UTC))
        finally:
            db.dispose()
        b = Board(server, keys, deployments)
        # Real traffic for alpha: a deployment of SmolLM2, a cold start, three requests.
        deploy = {"authorization": f"Bearer {keys['alpha:invoke,deploy']}"}
        # With n-gram speculation, whose figures the workers' heartbeats bring to the page.
        spec = {"name": "alpha-live", "snapshot_uri": uri, "idle_timeout_s": 600,
                "speculative": {"method": "ngram", "num_tokens": 3}}  # fmt: skip
        r = httpx.post(f"{server.url}/v1/deployments", json=spec, headers=deploy)
        assert r.status_code == 201, r.text
        deployments["alpha"].add("alpha-live")
        for i in range(3):
            prompt = f"Count to {i + 3}: 1, 2, 3, 1, 2, 3, 1, 2,"
            body = {"model": "alpha-live", "prompt": prompt, "max_tokens": 8}
            r = httpx.post(f"{server.url}/v1/completions", json=body, headers=deploy, timeout=120)
            assert r.status_code == 200, r.text
        # The scale-up's phases are written once the replica is ready; the ledger off the
        # request path: wait for both.
        server.wait_for(
            "the cold start's phases, the ledger rows and a heartbeat's speculation figures",
            lambda: _has_phases(b) and _live_requests(b) == 3 and _proposed(b) > 0,
            timeout_s=30,
        )
        # A canary of alpha-live (a new max_model_len is a new version), with some traffic
        # of each version in the ledger, for the side-by-side view.
        canary = {"max_model_len": 512, "canary": {"percent": 25}}
        r = httpx.patch(f"{server.url}/v1/deployments/alpha-live", json=canary, headers=deploy)
        assert r.status_code == 200 and r.json()["canary"]["version"] == 2, r.text
        _seed_versions(home, datetime.now(UTC))
        yield b


def _seed_versions(home: Path, now: datetime) -> None:
    db = Database(f"sqlite:///{home / 'hotpool.db'}")
    try:
        alpha = TenantStore(db).by_name("alpha")
        assert alpha is not None
        Ledger(db).record_many(
            UsageRecord(f"canary-{i}", "alpha-live", "completions",
                        "error" if i == 9 else "completed", 40, 8, tenant_id=alpha.id,
                        version=2 if i >= 6 else 1, ttft_seconds=0.05 * (i + 1),
                        total_seconds=0.5 + i, created_at=now - timedelta(minutes=2))
            for i in range(10)
        )  # fmt: skip
    finally:
        db.dispose()


def _has_phases(b: Board) -> bool:
    summary = b.get("/v1/usage/summary", "alpha:usage")
    return any(e["phases"] for e in summary["scale_events"] if e["deployment"] == "alpha-live")


def _proposed(b: Board) -> int:
    summary = b.get("/v1/usage/summary", "alpha:usage")
    live = next(d for d in summary["deployments"] if d["name"] == "alpha-live")
    return int((live["speculation"] or {}).get("proposed", 0))


def _live_requests(b: Board) -> int:
    summary = b.get("/v1/usage/summary", "alpha:usage")
    live = next(d for d in summary["deployments"] if d["name"] == "alpha-live")
    return sum(live["requests"].values())


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with sync_api.sync_playwright() as p:
        # --no-sandbox: CI runs as root, where chromium's sandbox cannot start.
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture
def page(browser: Any, board: Board) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    problems: list[str] = []
    page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.on("requestfailed", lambda r: problems.append(f"request failed: {r.url} {r.failure}"))
    page.goto(f"{board.server.url}/dashboard")
    yield page
    context.close()
    # A 401 for a bad key is the page's own check, answered in the form; nothing else.
    assert [p for p in problems if "401" not in p] == [], problems


def _sign_in(page: Any, key: str) -> None:
    page.fill("#api-key", key)
    page.click("#sign-in-button")


def _wait_loaded(page: Any, after: int = 0, range_: str = "", tenant: str | None = None) -> None:
    """Until the page has drawn data newer than ``after`` (for ``range_`` and ``tenant`` when
    given: a load already in flight when a range is clicked still draws the old one)."""
    page.wait_for_function(
        """([after, range, tenant]) => {
            const s = window.hotpoolDashboard;
            return Number(document.getElementById('board').dataset.loaded || 0) > after
                && (!range || s.data.range === range)
                && (tenant === null || s.data.tenant === tenant);
        }""",
        arg=[after, range_, tenant],
        timeout=30000,
    )


def _loaded_at(page: Any) -> int:
    return int(page.evaluate("() => document.getElementById('board').dataset.loaded || 0"))


def _shown(page: Any) -> dict[str, Any]:
    """Everything the page shows, read in one run of its event loop: an automatic refresh
    cannot land between two reads and mix two windows' numbers."""
    return page.evaluate(  # type: ignore[no-any-return]
        """() => {
            const s = window.hotpoolDashboard;
            const rows = (sel, f) => [...document.querySelectorAll(sel)].map(f);
            return {
                window: s.data.window,
                kpi: Object.fromEntries(["requests", "input", "cached", "output", "cost"].map(
                    k => [k, document.getElementById(`kpi-${k}`).dataset.value])),
                charts: Object.fromEntries(Object.entries(s.charts).map(([id, c]) => [id, {
                    labels: c.data.labels.map(String),
                    datasets: c.data.datasets.map(d => ({
                        label: d.label, data: d.data.map(v => (v === null ? v : Number(v)))}))}])),
                topKeys: rows("#table-top-keys tbody tr",
                    r => [r.dataset.name, r.dataset.tokens, r.dataset.costMicros]),
                topDeployments: rows("#table-top-deployments tbody tr",
                    r => [r.dataset.name, r.dataset.tokens, r.dataset.costMicros]),
                deployments: rows("#table-deployments tbody tr", r => r.dataset.name),
                versions: rows("#table-versions tbody tr", r => [r.dataset.name,
                    Number(r.dataset.version), Number(r.dataset.requests),
                    Number(r.dataset.errors), Number(r.dataset.tokens)]),
                versionsVisible: document.getElementById("panel-versions").checkVisibility(),
                text: document.body.innerText,
            };
        }"""
    )


def _sums(page_: dict[str, Any], key: Any) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for bucket in page_["data"]:
        for r in bucket["results"]:
            g = out.setdefault(key(r), {"input": 0, "cached": 0, "output": 0, "requests": 0,
                                        "cost": 0})  # fmt: skip
            g["input"] += r["input_tokens"]
            g["cached"] += r["input_cached_tokens"]
            g["output"] += r["output_tokens"]
            g["requests"] += r["num_model_requests"]
            g["cost"] += r["cost_micros"] or 0
    return out


def _check_against_api(page: Any, board: Board, who: str, tenant: str = "") -> dict[str, Any]:
    """Every number the page shows equals the APIs' for the page's own window."""
    shown = _shown(page)
    w = shown["window"]
    params = {"start_time": w["start"], "end_time": w["end"], "bucket_width": w["width"],
              "limit": w["buckets"], **({"tenant": tenant} if tenant else {})}  # fmt: skip
    series = board.get("/v1/usage", who, **params)
    by_model = _sums(board.get("/v1/usage", who, group_by="model", **params), lambda r: r["model"])
    by_key = _sums(board.get("/v1/usage", who, group_by="api_key", **params),
                   lambda r: r["api_key_id"] or "no key")  # fmt: skip
    summary = board.get("/v1/usage/summary", who, start_time=w["start"], end_time=w["end"],
                        **({"tenant": tenant} if tenant else {}))  # fmt: skip
    total = _sums(series, lambda r: "all").get(
        "all", {"input": 0, "cached": 0, "output": 0, "requests": 0, "cost": 0}
    )
    assert shown["kpi"] == {"requests": str(total["requests"]), "input": str(total["input"]),
                   "cached": str(total["cached"]), "output": str(total["output"]),
                   "cost": str(total["cost"])}  # fmt: skip

    charts = shown["charts"]
    tokens = charts["chart-tokens"]
    assert len(tokens["labels"]) == len(series["data"]) == w["buckets"]
    assert sum(sum(d["data"]) for d in tokens["datasets"]) == total["input"] + total["output"]
    cached = next(d for d in tokens["datasets"] if d["label"] == "cached input")
    assert sum(cached["data"]) == total["cached"]
    cost = charts["chart-cost"]["datasets"][0]["data"]
    assert sum(cost) == pytest.approx(total["cost"] / 1e6)

    top = charts["chart-top-deployments"]
    drawn = {
        name: sum(d["data"][i] for d in top["datasets"]) for i, name in enumerate(top["labels"])
    }
    assert drawn == {m: g["input"] + g["output"] for m, g in by_model.items()}
    assert {name: (int(t), int(c or 0)) for name, t, c in shown["topKeys"]} == {
        k: (g["input"] + g["output"], g["cost"]) for k, g in by_key.items()
    }
    # Prices are set: both rankings go by cost, the highest first.
    for ranking in (shown["topKeys"], shown["topDeployments"]):
        costs = [int(c) for _, _, c in ranking]
        assert costs == sorted(costs, reverse=True), ranking

    status = charts["chart-status"]
    assert (
        dict(zip(status["labels"], status["datasets"][0]["data"], strict=True))
        == summary["requests"]
    )
    assert sum(summary["requests"].values()) == total["requests"]
    latency = charts["chart-latency"]
    for i, name in enumerate(latency["labels"]):
        d = next(x for x in summary["deployments"] if x["name"] == name)
        assert latency["datasets"][1]["data"][i] == pytest.approx(d["ttft_seconds"]["p95"])
        assert latency["datasets"][3]["data"][i] == pytest.approx(d["total_seconds"]["p95"])
    assert shown["deployments"] == [d["name"] for d in summary["deployments"]]
    # While a canary runs, its versions side by side, as the summary reports them.
    versions = shown["versions"]
    assert versions == [
        [d["name"], v["version"], sum(v["requests"].values()),
         v["requests"]["error"] + v["requests"]["partial"], v["input_tokens"] + v["output_tokens"]]
        for d in summary["deployments"] if d["versions"] for v in d["versions"]
    ]  # fmt: skip
    assert shown["versionsVisible"] == bool(versions)
    return {"charts": charts, "summary": summary, "by_model": by_model,
            "names": _visible_names(shown)}  # fmt: skip


def _visible_names(shown: dict[str, Any]) -> str:
    """All the text a person can see, plus every chart label and legend."""
    charts = shown["charts"]
    labels = [str(x) for c in charts.values() for x in c["labels"]]
    legends = [str(d["label"]) for c in charts.values() for d in c["datasets"]]
    return "\n".join([shown["text"], *labels, *legends])


def test_a_bad_key_gets_a_clear_message(page: Any, board: Board) -> None:
    # The form shows once the page's own /v1/me check has answered (401: no key kept).
    expect(page.locator("#sign-in-form")).to_be_visible()
    _sign_in(page, "hp_notakey00_0000000000000000")
    error = page.locator("#sign-in-error")
    expect(error).to_have_text(re.compile(r"^This API key was not accepted:"))
    expect(page.locator("#board")).to_be_hidden()
    # A key without the usage scope is turned away with a reason, too.
    _sign_in(page, board.keys["alpha:deploy"])
    expect(error).to_contain_text("lacks the usage scope")
    expect(page.locator("#board")).to_be_hidden()


def test_a_tenant_sees_its_own_totals_in_every_chart_and_range(
    page: Any, board: Board, tmp_path: Path
) -> None:
    _sign_in(page, board.keys["alpha:usage"])
    _wait_loaded(page)
    expect(page.locator("#who-tenant")).to_have_text("alpha")
    expect(page.locator("#tenant-filter")).to_be_hidden()  # not an operator
    seen = _check_against_api(page, board, "alpha:usage")
    # The real requests: the live deployment is ready, with a cold start split into phases.
    live = next(d for d in seen["summary"]["deployments"] if d["name"] == "alpha-live")
    assert live["replicas"]["ready"] == 1
    row = page.locator("#table-deployments tbody tr[data-name='alpha-live'] td")
    expect(row.nth(2)).to_have_text("ready")
    assert live["quantization"] == "none"
    expect(row.nth(8)).to_have_text("dense")
    spec = live["speculation"]
    assert spec["method"] == "ngram" and spec["num_tokens"] == 3 and spec["proposed"] > 0
    assert 0 <= spec["accepted"] <= spec["proposed"] and spec["replicas"] == 1
    expect(row.nth(9)).to_have_text(re.compile(r"^ngram k=3 · .*% accepted$"))
    cold = seen["charts"]["chart-cold-starts"]
    assert {"load", "warmup"} <= {d["label"] for d in cold["datasets"]}
    canary = next(d for d in seen["summary"]["deployments"] if d["name"] == "alpha-live")
    assert [(v["version"], v["role"], v["traffic_percent"]) for v in canary["versions"]] == [
        (1, "stable", 75.0), (2, "canary", 25.0)
    ]  # fmt: skip
    assert canary["versions"][1]["requests"]["error"] == 1
    expect(page.locator("#panel-versions")).to_be_visible()
    replicas = seen["charts"]["chart-replicas"]
    assert max(next(d for d in replicas["datasets"] if d["label"] == "alpha-live")["data"]) == 1
    # Numbers are for people: a K or M, a currency sign.
    expect(page.locator("#kpi-input")).to_have_text(re.compile(r"[KM]$"))
    expect(page.locator("#kpi-cost")).to_have_text(re.compile(r"^\$"))

    shot = tmp_path / "dashboard.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 20_000
    # docs/dashboard.png is made this way, then `pngquant --quality=70-95 --strip` (a third
    # of the size: the page has few colours).
    if os.environ.get("HOTPOOL_DASHBOARD_SCREENSHOT"):
        shutil.copy(shot, os.environ["HOTPOOL_DASHBOARD_SCREENSHOT"])

    for range_ in RANGES:
        before = _loaded_at(page)
        page.click(f"[data-range='{range_}']")
        _wait_loaded(page, before, range_)
        assert "beta" not in _check_against_api(page, board, "alpha:usage")["names"]


def _latency_bars(page: Any) -> list[dict[str, Any]]:
    """Each bar of the latency chart as drawn: its value, and its height as a share of the
    chart's plot area (from the chart's own geometry: what a person sees)."""
    return page.evaluate(  # type: ignore[no-any-return]
        """() => {
            const c = window.hotpoolDashboard.charts["chart-latency"];
            const height = c.chartArea.bottom - c.chartArea.top;
            return c.data.datasets.flatMap((d, i) => c.getDatasetMeta(i).data.map((bar, j) => ({
                deployment: c.data.labels[j], series: d.label, seconds: d.data[j],
                share: (bar.base - bar.y) / height})));
        }"""
    )


def test_one_slow_request_leaves_the_other_latency_bars_readable(page: Any, board: Board) -> None:
    _sign_in(page, board.keys["alpha:usage"])
    _wait_loaded(page)
    bars = [b for b in _latency_bars(page) if b["seconds"] is not None]
    slowest = max(bars, key=lambda b: b["seconds"])
    assert (slowest["deployment"], slowest["seconds"]) == (SLOW_DEPLOYMENT, SLOW_SECONDS)
    assert slowest["share"] == pytest.approx(max(b["share"] for b in bars))
    ordinary = [b for b in bars if b["seconds"] <= SLOW_SECONDS / 100]
    assert {b["deployment"] for b in ordinary} >= {"alpha-chat", "alpha-summarize", "alpha-live"}
    # On a linear axis these were at most 1% of the plot's height (a pixel or two); each
    # keeps a tenth of it at least, and a slower request still draws a taller bar.
    assert min(b["share"] for b in ordinary) > 0.1, ordinary
    by_seconds = sorted(bars, key=lambda b: b["seconds"])
    assert [b["share"] for b in by_seconds] == sorted(b["share"] for b in by_seconds)


def test_the_page_refreshes_by_itself(page: Any, board: Board) -> None:
    expect(page.locator("#sign-in-form")).to_be_visible()  # the first /v1/me has settled
    page.goto(f"{board.server.url}/dashboard?refresh=2")
    _sign_in(page, board.keys["alpha:usage"])
    _wait_loaded(page)
    before = int(_shown(page)["kpi"]["requests"])
    db = Database(f"sqlite:///{board.server.home / 'hotpool.db'}")
    try:
        alpha = TenantStore(db).by_name("alpha")
        assert alpha is not None
        rec = UsageRecord("late-arrival", "alpha-chat", "completions", "completed", 7, 3,
                          tenant_id=alpha.id)  # fmt: skip
        Ledger(db).record(rec)
    finally:
        db.dispose()
    # No click: the next refresh (within 2 s) shows the new request.
    page.wait_for_function(
        f"() => Number(document.getElementById('kpi-requests').dataset.value) === {before + 1}",
        timeout=15000,
    )


def test_tenant_b_never_sees_tenant_a(page: Any, board: Board) -> None:
    _sign_in(page, board.keys["beta:usage"])
    _wait_loaded(page)
    before = _loaded_at(page)
    page.click("[data-range='30d']")
    _wait_loaded(page, before, "30d")
    seen = _check_against_api(page, board, "beta:usage")
    assert set(seen["by_model"]) == board.deployments["beta"]
    assert "alpha" not in seen["names"]


def test_the_operator_sees_every_tenant_and_can_filter_by_one(page: Any, board: Board) -> None:
    _sign_in(page, board.keys["alpha:operator"])
    _wait_loaded(page)
    before = _loaded_at(page)
    page.click("[data-range='30d']")
    _wait_loaded(page, before, "30d")
    expect(page.locator("#tenant-filter")).to_be_visible()
    everything = _check_against_api(page, board, "alpha:operator")
    assert set(everything["by_model"]) == board.deployments["alpha"] | board.deployments["beta"]
    before = _loaded_at(page)
    page.select_option("#tenant-select", "beta")
    _wait_loaded(page, before, "30d", "beta")
    only_beta = _check_against_api(page, board, "alpha:operator", tenant="beta")
    assert set(only_beta["by_model"]) == board.deployments["beta"]
    assert "alpha-chat" not in only_beta["names"]
    # Signing out forgets the key: a reload asks for one again.
    page.click("#sign-out")
    page.reload()
    expect(page.locator("#sign-in-form")).to_be_visible()
    expect(page.locator("#board")).to_be_hidden()


def _live(board: Board) -> dict[str, Any]:
    summary = board.get("/v1/usage/summary", "alpha:usage")
    return next(d for d in summary["deployments"] if d["name"] == "alpha-live")


def test_a_deployment_scaled_to_zero_keeps_its_acceptance_rate(page: Any, board: Board) -> None:
    """Runs after the tests that need alpha-live's replica: it scales alpha-live to zero."""
    before = _live(board)["speculation"]
    assert before["proposed"] > 0 and before["replicas"] == 1
    deploy = {"authorization": f"Bearer {board.keys['alpha:invoke,deploy']}"}
    r = httpx.patch(f"{board.server.url}/v1/deployments/alpha-live", json={"idle_timeout_s": 1},
                    headers=deploy)  # fmt: skip
    assert r.status_code == 200, r.text
    board.server.wait_for(
        "alpha-live to scale to zero", lambda: sum(_live(board)["replicas"].values()) == 0
    )
    after = _live(board)["speculation"]
    # No replica reports any more; what the gone one reported last stays (no request since).
    assert after["replicas"] == 0
    for field in ("proposed", "accepted", "acceptance_rate"):
        assert after[field] == before[field], field
    _sign_in(page, board.keys["alpha:usage"])
    _wait_loaded(page)
    row = page.locator("#table-deployments tbody tr[data-name='alpha-live'] td")
    expect(row.nth(2)).to_have_text("scaled to zero")
    percent = math.floor(100 * after["acceptance_rate"] + 0.5)  # as the page rounds
    expect(row.nth(9)).to_have_text(f"ngram k=3 · {percent}% accepted")


def test_local_only_mode_needs_no_key_and_says_so(
    browser: Any, tmp_path: Path, smollm2_snapshot_bf16: Path
) -> None:
    """What `make run` users see: no sign-in, the board, and a warning that keys are off."""
    env = {"HOTPOOL_AUTH": "none", "HOTPOOL_WARM_WORKERS": "0"}
    with (
        running_server(tmp_path, f"file://{smollm2_snapshot_bf16}", env) as server,
        _checked_page(browser, f"{server.url}/dashboard") as page,
    ):
        _wait_loaded(page)
        expect(page.locator("#local-mode")).to_be_visible()
        expect(page.locator("#sign-in")).to_be_hidden()
        expect(page.locator("#kpi-requests")).to_have_attribute("data-value", "0")


@contextlib.contextmanager
def _checked_page(browser: Any, url: str) -> Iterator[Any]:
    """A fresh page at ``url`` whose console must stay clean."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    problems: list[str] = []
    page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.goto(url)
    try:
        yield page
    finally:
        context.close()
    assert problems == []


def test_without_prices_the_rankings_go_by_tokens_and_say_so(
    browser: Any, tmp_path: Path, smollm2_snapshot_bf16: Path
) -> None:
    """No prices: no cost to rank by, so the tables rank by tokens (names in the reverse
    order, so an order by name cannot pass) and say how to set prices; no column of dashes."""
    env = {"HOTPOOL_AUTH": "none", "HOTPOOL_WARM_WORKERS": "0"}
    tokens = {"a-small": 10, "b-large": 5000, "c-medium": 300}
    with running_server(tmp_path, f"file://{smollm2_snapshot_bf16}", env) as server:
        db = Database(f"sqlite:///{tmp_path / 'hotpool.db'}")
        try:
            at = datetime.now(UTC) - timedelta(minutes=5)
            Ledger(db).record_many(
                UsageRecord(f"unpriced-{name}", name, "completions", "completed", n, 0,
                            created_at=at)
                for name, n in tokens.items()
            )  # fmt: skip
        finally:
            db.dispose()
        usage = httpx.get(f"{server.url}/v1/usage", params={"group_by": "model"}).json()
        assert {r["cost_micros"] for b in usage["data"] for r in b["results"]} == {None}
        with _checked_page(browser, f"{server.url}/dashboard") as page:
            _wait_loaded(page)
            table = page.locator("#table-top-deployments")
            expect(table.locator("tbody tr")).to_have_count(3)
            names = table.locator("tbody tr").evaluate_all("rows => rows.map(r => r.dataset.name)")
            assert names == sorted(tokens, key=lambda n: -tokens[n])
            expect(table.locator("thead th")).to_have_text(["By tokens", "Requests", "Tokens"])
            for table_id in ("#table-top-deployments", "#table-top-keys"):
                note = page.locator(f"{table_id} caption")
                expect(note).to_contain_text("No prices are set, so this ranks by tokens.")
                expect(note).to_contain_text("hotpool prices set")
                expect(note).to_contain_text("POST /v1/prices")
                expect(page.locator(f"{table_id} td", has_text=NO_VALUE)).to_have_count(0)
