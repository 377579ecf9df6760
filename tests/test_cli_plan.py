"""``hotpool plan`` as a user sees it, on canned ``GET /v1/deployments/{name}/capacity``
answers (the API itself is tests/platform/test_capacity_api.py's): the devices it counts
are the ones the replicas' workers reported, and a curve with no prefill measured asks for
one rather than declaring the target unreachable."""

from __future__ import annotations

from typing import Any

import pytest
from cli_runner import invoke
from click.testing import CliRunner, Result

# A replica that measured decode steps and prompts of up to 512 tokens.
CURVE = [
    {"step_tokens": 1, "tokens_per_second": 20.0},
    {"step_tokens": 8, "tokens_per_second": 120.0},
    {"step_tokens": 256, "tokens_per_second": 700.0},
    {"step_tokens": 512, "tokens_per_second": 800.0},
]
ARGS = ("--deployment", "chat", "--rps", "2", "--prompt-tokens", "256", "--output-tokens", "16",
        "--ttft-p95", "2")  # fmt: skip


def _capacity(devices: list[str | None], curve: list[dict[str, float]]) -> dict[str, Any]:
    """The capacity API's answer for ready replicas on ``devices`` (None: a server from
    before replicas said their device, which leaves the field out)."""
    replicas = []
    for i, device in enumerate(devices):
        replica = {"id": f"r{i}", "version": 1, "curve": curve, "inflight": 0,
                   "queued_prompt_tokens": 0, "queued_output_tokens": 0,
                   "backlog_seconds": 0.0, "kv_cache_usage": 0.1}  # fmt: skip
        replicas.append(replica if device is None else {**replica, "device": device})
    return {"deployment": "chat", "replicas": replicas, "curve": curve,
            "measured_replicas": len(devices), "output_tokens_mean": 16.0,
            "scale_backlog_s": 4.0, "target_concurrency": 8}  # fmt: skip


def _plan(
    run: CliRunner, monkeypatch: pytest.MonkeyPatch, capacity: dict[str, Any], *extra: str
) -> Result:
    monkeypatch.setattr("hotpool.cli_plan.call_api", lambda *_, **__: capacity)
    return invoke(run, "plan", *ARGS, *extra)


def _count(out: str, label: str) -> int:
    return int(out.split(f"\n{label}: ")[1].split()[0])


def test_a_cpu_pool_is_planned_in_cpu_workers(
    run: CliRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    result = _plan(run, monkeypatch, _capacity(["cpu", "cpu"], CURVE))
    assert result.exit_code == 0, result.output
    assert "gpu" not in result.stdout.lower()
    assert _count(result.stdout, "cpu workers") == _count(result.stdout, "replicas") >= 1


@pytest.mark.parametrize(
    ("devices", "label"),
    [
        (["cuda"], "gpus"),
        (["cuda:0", "cuda:1"], "gpus"),
        (["cpu", "cuda"], "devices"),
        ([None], "devices"),
    ],
)
def test_the_devices_are_named_as_the_workers_reported_them(
    run: CliRunner, monkeypatch: pytest.MonkeyPatch, devices: list[str | None], label: str
) -> None:
    result = _plan(run, monkeypatch, _capacity(devices, CURVE), "--devices-per-replica", "2")
    assert result.exit_code == 0, result.output
    assert _count(result.stdout, label) == 2 * _count(result.stdout, "replicas")


def test_the_older_gpus_per_replica_option_still_works(
    run: CliRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    result = _plan(run, monkeypatch, _capacity(["cuda"], CURVE), "--gpus-per-replica", "8")
    assert result.exit_code == 0, result.output
    assert _count(result.stdout, "gpus") == 8 * _count(result.stdout, "replicas")


def test_a_curve_without_prefill_asks_for_prompts(
    run: CliRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    decode = [{"step_tokens": 1, "tokens_per_second": 8.8}]  # a few short requests' worth
    result = _plan(run, monkeypatch, _capacity(["cpu"], decode))
    assert result.exit_code == 1
    assert "no replica count meets the target" not in result.stderr
    assert "prefill has not been measured yet" in result.stderr
    assert "prompts of ~256 tokens" in result.stderr
    assert "not measured yet" in result.stdout  # what it measured says so, with no number
