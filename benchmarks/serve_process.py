"""What the benchmarks that drive a real ``hotpool serve`` share: a free port, a server
process started and stopped safely, waiting, and quantiles. (The same pieces as
tests/e2e/server_process.py; benchmarks do not import from tests/.)"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pct(values: list[float], q: float) -> float:
    """The ``q`` quantile (nearest rank) of ``values``; NaN for none."""
    if not values:
        return math.nan
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def wait_for(
    what: str, check: Callable[[], object], timeout_s: float, interval_s: float = 0.2
) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:g}s waiting for {what}")
        time.sleep(interval_s)


@contextlib.contextmanager
def serve(home: Path, env: dict[str, str]) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """``hotpool serve`` on a free port with ``HOTPOOL_HOME=home`` (which must exist) and
    ``env`` on top of the CPU defaults: its URL once /healthz answers, and the process.
    SIGTERM on exit; SIGKILL of its process group (server and workers) after a minute."""
    port = free_port()
    full_env = {
        **os.environ,
        "HOTPOOL_HOME": str(home),
        "HOTPOOL_PORT": str(port),
        "HOTPOOL_DEVICE": "cpu",
        **env,
    }
    with open(home / "serve.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "hotpool", "serve"],
            env=full_env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = (home / "serve.log").read_text(errors="replace")[-4000:]
                raise RuntimeError(f"hotpool serve did not start:\n{tail}")
            time.sleep(0.2)
        yield url, proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def smollm2_snapshot(cache: Path, dtype: str) -> str:
    """SmolLM2 in ``dtype``, pulled once into a ``file://`` store under ``cache``."""
    from hotpool.worker.snapshot.pull import pull_smollm2, smollm2_uri

    store, name = f"file://{cache}/objects", f"smollm2-{dtype}"
    uri = smollm2_uri(store, name)
    if not Path(uri.removeprefix("file://"), "manifest.json").is_file():
        uri, _ = pull_smollm2(store, name, dtype, download_dir=cache / "downloads")
    return uri
