"""bench_gateway.py's native load client: ``stream_client.c``, built with the system C
compiler on first use and driven through its stdin and stdout.

On a 2-core box the client shares a core with the control plane, so the client's own CPU is
taken from the gateway path alone and shows up as latency "added by the control plane".
The Python client (asyncio and hotpool's lean stream client) costs ~1 ms of CPU per 16-token
stream there; the C one a few microseconds per event. Both paths use the same client, as
before; only the instrument is lighter.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

SOURCE = Path(__file__).with_name("stream_client.c")
PLACEHOLDER = "@@REQUEST_ID@@"  # the C client puts a fresh id in its place per request


@dataclass(frozen=True)
class Target:
    """Where a named batch of requests goes, and what each one sends."""

    name: str
    mode: str  # "sse" (the control plane) or "ndjson" (a worker)
    url: str
    authorization: str
    body: dict[str, object]


@dataclass(frozen=True)
class Outcome:
    """One request, as the C client saw it."""

    ttft: float | None  # seconds to the first event with text
    total: float  # seconds to the end of the stream
    tokens: int  # completion tokens reported by the stream
    request_id: str
    error: str | None


def build(cache: Path) -> Path | None:
    """The compiled client (rebuilt when the source changes), or None without a compiler."""
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        return None
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
    binary = cache / f"stream_client-{digest}"
    if not binary.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        tmp = binary.with_suffix(".tmp")
        subprocess.run([cc, "-O2", "-o", str(tmp), str(SOURCE)], check=True)
        tmp.replace(binary)
    return binary


class NativeClient:
    """One ``stream_client`` process with keep-alive connections to every target."""

    def __init__(self, binary: Path, targets: list[Target], timeout_s: float) -> None:
        self._files = tempfile.TemporaryDirectory(prefix="hotpool-bench-")
        argv = [str(binary), str(timeout_s)]
        for t in targets:
            parts = urlsplit(t.url)
            body = Path(self._files.name) / f"{t.name}.json"
            body.write_text(json.dumps(t.body))
            argv += [
                "--target", t.name, t.mode, parts.hostname or "127.0.0.1",
                str(parts.port or 80), parts.path or "/", t.authorization, str(body),
            ]  # fmt: skip
        self._proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
        )

    @property
    def pid(self) -> int:
        return self._proc.pid

    def batch(self, target: str, count: int) -> list[Outcome]:
        """``count`` simultaneous requests to ``target``; returns when all have ended."""
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.write(f"{target} {count}\n")
        self._proc.stdin.flush()
        out = []
        for line in self._proc.stdout:
            if line == "end\n":
                return out
            ttft, total, tokens, rid, error = line.rstrip("\n").split("\t", 4)
            out.append(
                Outcome(
                    ttft=None if ttft == "-" else float(ttft),
                    total=float(total),
                    tokens=int(tokens),
                    request_id="" if rid == "-" else rid,
                    error=None if error == "-" else error,
                )
            )
        raise RuntimeError(f"the native client exited ({self._proc.wait()}) mid-batch")

    def close(self) -> None:
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._files.cleanup()
