"""The control plane <-> worker streams' JSON (orjson, with json where orjson refuses)."""

from __future__ import annotations

import json

from hotpool.worker.protocol import (
    GenerateEvent,
    GenerateRequest,
    SamplingParams,
    Usage,
    wire_dumps,
    wire_loads,
)


def test_a_generate_request_and_an_event_round_trip() -> None:
    request = GenerateRequest(
        "req_1", SamplingParams(max_tokens=3, stop=("\n", "é")), "Ünïcode 😀 prompt", None
    )
    assert GenerateRequest.from_json(wire_loads(wire_dumps(request.to_json()))) == request
    event = GenerateEvent(text=" the", token_ids=(42,), usage=Usage(5, 1, 0))
    assert GenerateEvent.from_json(wire_loads(wire_dumps(event.to_json()))) == event


def test_a_lone_surrogate_is_escaped_not_an_error_and_reads_back() -> None:
    """No validated request holds one, but an error message might (str of an exception)."""
    frame = {"id": "req_1", "event": {"error": "bad byte \udcff here"}}
    data = wire_dumps(frame)
    assert b"\\udcff" in data  # json's escape: orjson refuses the lone surrogate
    assert wire_loads(data) == frame
    assert json.loads(wire_dumps({"a": [1, 2.5, None, True]})) == {"a": [1, 2.5, None, True]}
