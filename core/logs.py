"""Log output: readable lines by default, one JSON object per line with
``HOTPOOL_LOG_FORMAT=json`` (for Loki, CloudWatch, Datadog).

Structured fields travel in a record's ``extra``; the request log of the control plane puts
request id, tenant, deployment, tokens and timings there. Nothing logs an API key (only its
prefix) or a prompt, unless ``HOTPOOL_LOG_PROMPTS`` asks for prompts at debug level.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

# Attributes every LogRecord has; anything else on a record came from ``extra``.
# uvicorn's ``color_message`` is its message with terminal colours: nothing for a JSON log.
_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}
_STANDARD.add("color_message")


TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per record; ``fields`` (a worker's id, say) go into every one."""

    def __init__(self, fields: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self.fields = dict(fields or {})

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            **self.fields,
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def configure(
    level: str,
    fmt: str = "text",
    *,
    fields: Mapping[str, Any] | None = None,
    text_format: str = TEXT_FORMAT,
) -> None:
    """Root logging for ``hotpool serve`` and ``hotpool worker`` (uvicorn's loggers
    propagate to it when uvicorn runs with ``log_config=None``); ``fields`` go into every
    JSON line, ``text_format`` is the readable lines' format."""
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter(fields))
    else:
        handler.setFormatter(logging.Formatter(text_format))
    # Python's warnings (a library's deprecation, torch's notes) become records too, so a
    # JSON log stays JSON on every line.
    logging.captureWarnings(True)
    # Fields no format here prints, which every record would look up otherwise: the
    # caller's file and line (a walk up the stack), the thread's, the process's and
    # multiprocessing's names (the logging HOWTO's "Optimization"). The control plane logs
    # two lines per request on the event loop that relays tokens.
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    logging._srcfile = None  # type: ignore[attr-defined]
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
