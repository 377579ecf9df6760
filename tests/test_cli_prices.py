"""``hotpool prices`` against the SQLite ledger of a temporary HOTPOOL_HOME, and the table
``hotpool usage`` prints."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from cli_runner import invoke
from click.testing import CliRunner

from hotpool import cli
from hotpool.billing.db import Database
from hotpool.billing.prices import PriceRecord, PriceStore


def stored(home: Path) -> list[PriceRecord]:
    db = Database(f"sqlite:///{home / 'hotpool.db'}")
    try:
        return PriceStore(db).list()
    finally:
        db.dispose()


@pytest.mark.parametrize(
    ("args", "purpose"),
    [
        (("prices",), "Prices per million tokens"),
        (("prices", "set"), "Add a price"),
        (("prices", "list"), "IN FORCE marks"),
        (("usage",), "with its cost"),
    ],
)
def test_help(run: CliRunner, args: tuple[str, ...], purpose: str) -> None:
    result = invoke(run, *args, "--help")
    assert result.exit_code == 0, result.output
    assert purpose in result.output


def test_set_takes_decimal_amounts_and_stores_exact_micro_units(run: CliRunner, home: Path) -> None:
    result = invoke(
        run, "prices", "set", "--input", "0.15", "--cached-input", ".075", "--output",
        "0.600001", "--effective-from", "2025-03-01",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == (
        "every deployment without its own price, from 2025-03-01 00:00:00 UTC: per 1M tokens,"
        " input 0.150000, cached input 0.075000, output 0.600001 USD"
    )
    result = invoke(
        run, "prices", "set", "--deployment", "smollm2", "--input", "1", "--cached-input",
        "0.5", "--output", "2", "--effective-from", "2025-03-05T02:00:00+02:00",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "smollm2, from 2025-03-05 00:00:00 UTC" in result.stdout
    assert [(p.deployment, p.input, p.cached_input, p.output, p.effective_from)
            for p in stored(home)] == [
        (None, 150_000, 75_000, 600_001, datetime(2025, 3, 1, tzinfo=UTC)),
        ("smollm2", 1_000_000, 500_000, 2_000_000, datetime(2025, 3, 5, tzinfo=UTC)),
    ]  # fmt: skip


def test_list_marks_the_prices_in_force(run: CliRunner) -> None:
    assert invoke(run, "prices", "list").stderr.startswith("no prices")
    for when, amount in (("2025-01-01", "1"), ("2025-02-01", "2"), ("2999-01-01", "3")):
        args = ("--input", amount, "--cached-input", amount, "--output", amount)
        assert invoke(run, "prices", "set", *args, "--effective-from", when).exit_code == 0
    lines = invoke(run, "prices", "list").stdout.splitlines()
    assert lines[0].split() == [
        "DEPLOYMENT", "CURRENCY", "INPUT", "CACHED", "INPUT", "OUTPUT", "FROM", "(UTC)", "IN",
        "FORCE",
    ]  # fmt: skip
    rows = [line.split() for line in lines[1:]]
    assert [(r[2], r[-1]) for r in rows] == [
        ("1.000000", "00:00:00"),  # superseded: no mark
        ("2.000000", "yes"),
        ("3.000000", "00:00:00"),  # not yet
    ]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--input", "0.1234567"), "more than 6 decimal places"),
        (("--input", "-1"), "not a non-negative decimal amount"),
        (("--input", "1e3"), "not a non-negative decimal amount"),
        (("--output", "1000001"), "must be at most 1000000.000000"),
        (("--effective-from", "next week"), "is not an ISO 8601 time"),
        (("--deployment", "a b"), "deployment must be 1 to 128"),
        (("--currency", "usd"), "currency must be 3 capital letters"),
    ],
)
def test_bad_values_are_usage_errors(
    run: CliRunner, home: Path, args: tuple[str, ...], message: str
) -> None:
    defaults = {"--input": "1", "--cached-input": "1", "--output": "1"}
    values = dict(zip(args[::2], args[1::2], strict=True))
    flat = [x for kv in {**defaults, **values}.items() for x in kv]
    result = invoke(run, "prices", "set", *flat)
    assert result.exit_code == 2, result.output
    assert message in result.stderr
    assert "Traceback" not in result.output


def test_conflicts_are_one_line_errors(run: CliRunner) -> None:
    args = ("--input", "1", "--cached-input", "1", "--output", "1")
    assert invoke(run, "prices", "set", *args, "--effective-from", "2025-03-01").exit_code == 0
    result = invoke(run, "prices", "set", *args, "--effective-from", "2025-03-01T00:00:00Z")
    assert result.exit_code == 1
    assert result.stderr.strip() == (
        "Error: the default already has a price from 2025-03-01T00:00:00+00:00"
    )
    result = invoke(run, "prices", "set", *args, "--currency", "EUR")
    assert result.exit_code == 1
    assert "the ledger's prices are in USD" in result.stderr


USAGE = {
    "object": "page",
    "data": [
        {
            "object": "bucket",
            "start_time": 1740787200,  # 2025-03-01
            "end_time": 1740873600,
            "results": [
                {"model": "smollm2", "api_key_id": "hp_AbCdEfGh", "num_model_requests": 12,
                 "input_tokens": 34567, "input_cached_tokens": 890, "output_tokens": 1234,
                 "cost": {"value": "0.012345", "currency": "USD"}, "cost_micros": 12345},
                {"model": "tiny", "api_key_id": None, "num_model_requests": 1,
                 "input_tokens": 5, "input_cached_tokens": 0, "output_tokens": 6,
                 "cost": None, "cost_micros": None},
            ],
        }
    ],
    "has_more": False,
    "next_page": None,
}  # fmt: skip


def test_usage_prints_a_table_with_cost(run: CliRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict[str, Any]] = []

    def fake_call(method: str, url: str, **kwargs: Any) -> Any:
        calls.append(kwargs["params"])
        return USAGE

    monkeypatch.setattr(cli, "_call", fake_call)
    result = invoke(run, "usage", "--group-by", "deployment", "--group-by", "api_key")
    assert result.exit_code == 0, result.output
    assert calls == [{"bucket_width": "1d", "group_by": "deployment,api_key"}]
    assert result.stdout.splitlines() == [
        "BUCKET (UTC)  DEPLOYMENT  API KEY      REQUESTS  INPUT  CACHED  OUTPUT          COST",
        "2025-03-01    smollm2     hp_AbCdEfGh        12  34567     890    1234  0.012345 USD",
        "2025-03-01    tiny        -                   1      5       0       6             -",
    ]
    result = invoke(run, "usage")  # by deployment by default
    assert calls[-1] == {"bucket_width": "1d", "group_by": "deployment"}
    assert result.stdout.splitlines()[0].split() == [
        "BUCKET", "(UTC)", "DEPLOYMENT", "REQUESTS", "INPUT", "CACHED", "OUTPUT", "COST"
    ]  # fmt: skip
