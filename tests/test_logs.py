"""The JSON log format (``HOTPOOL_LOG_FORMAT=json``): one object per line, a record's
``extra`` fields at its top level."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from hotpool.logs import JsonFormatter


def _record(**extra: object) -> logging.LogRecord:
    record = logging.LogRecord(
        "hotpool.requests", logging.INFO, __file__, 1, "%s done", ("r1",), None
    )
    record.__dict__.update(extra)
    return record


def test_extra_fields_are_top_level_keys_beside_the_standard_ones() -> None:
    line = JsonFormatter().format(_record(request_id="r1", tokens=3, cold_start=False))
    assert "\n" not in line
    out = json.loads(line)
    assert out["message"] == "r1 done" and out["logger"] == "hotpool.requests"
    assert (out["level"], out["request_id"], out["tokens"], out["cold_start"]) == (
        "info", "r1", 3, False
    )  # fmt: skip
    assert out["ts"].endswith("+00:00")
    assert not {"args", "msg", "pathname", "lineno", "exc_info"} & set(out)


def test_a_processes_own_fields_go_into_every_line_and_terminal_colours_stay_out() -> None:
    formatter = JsonFormatter({"worker_id": "w-1"})
    out = json.loads(formatter.format(_record(color_message="\x1b[36mr1\x1b[0m done")))
    assert out["worker_id"] == "w-1" and "color_message" not in out


def test_an_exception_travels_in_the_same_line_and_odd_values_as_text() -> None:
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        record = _record(path=Path("/x"))
        record.exc_info = sys.exc_info()
    out = json.loads(JsonFormatter().format(record))
    assert out["path"] == "/x"
    assert "RuntimeError: boom" in out["exception"] and "Traceback" in out["exception"]
