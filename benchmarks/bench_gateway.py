"""Latency the control plane adds: the same requests straight to a worker and through it.

A real ``hotpool serve`` (control plane + one local worker process on the CPU) serves a tiny
random-weight Llama (2 layers, hidden 64, a ~300-token vocabulary, built on the fly and
pushed with ``hotpool snapshot push``), so the worker's compute is small and the control
plane's share shows. One replica is loaded and ready before anything is timed. The same
requests, with ``--max-tokens`` output tokens (greedy, EOS ignored), go two ways in one run:

  direct   ``POST /generate`` on the worker's internal API (newline-delimited JSON events,
           the worker token as bearer); the worker's address comes from its registration
           line in ``$HOTPOOL_HOME/logs/<worker_id>.log`` (the public API does not show it).
  gateway  ``POST /v1/completions`` with ``stream: true`` on the control plane (SSE): auth,
           routing, the replica lease, the relay of the worker's stream, SSE framing, the
           ledger and metrics.

One load client sends both paths' requests over keep-alive connections: by default a small
C program (``stream_client.c``, built with the system compiler on first use: see
``native_client``), which spends a few microseconds per event where the Python client
(``--client python``: asyncio and hotpool's lean HTTP/1.1 stream client, see ``Paths``)
spends ~1 ms of CPU per 16-token stream; on a small box the client shares the control
plane's core, so its CPU counts against the gateway path alone.
At concurrency 1 the paths alternate request by request (``--requests`` each); at
concurrency 32 they alternate round by round (``--rounds`` rounds of 32 simultaneous streams
each), so drift on a shared machine hits both alike. Both paths are warmed up first. The
client measures TTFT (to the first event that carries text) and total time (to the end of
the stream); the table shows p50 and p99 per path and the difference: ``added = p(gateway) -
p(direct)``, a difference of percentiles, with its 95% interval from a paired bootstrap over
the batches (see ``added_interval``): on a small shared machine one run's difference moves by
a few ms, so a row whose interval holds both sides of the target is marked ``PASS?`` or
``FAIL?``. The target (issue 7): at most 2 ms added at p50 and 10 ms at p99, at both
concurrencies. With ``--auth`` (on by default) a second server
runs with ``HOTPOOL_AUTH=keys`` and an API key made with ``hotpool tenants create`` /
``hotpool keys create`` before it starts, which adds rows for the cost of key
authentication; the run also checks that the key is really required (a request without one
must get a 401).

Stages: the ledger keeps the control plane's own TTFT and total per request (from the start
of the invoker to the first token from the worker, and to the end), so the added time
splits into what happens before and after the invoker (HTTP parsing, middleware, auth,
JSON, SSE) and what happens inside it (the replica lease, the relay). The share of streams
that arrived in one burst (every token within 1 ms) shows a stream held up on the way and
flushed at once (Nagle's algorithm against a delayed ACK looks like this: ~40 ms stalls).

The client reads every stream to its end (the chunked terminator), as the ``openai`` client
does: a response left unread would cost its keep-alive connection.

By default (``--pin``) the worker runs on a core of its own and the control plane and the
client share the others, as in a real deployment, where a GPU worker's host threads do not
share a core with the control plane; the client's cost then weighs on the gateway path only,
so the comparison is conservative. ``--client-core worker`` puts the client beside the
worker instead (on two cores no layout is neutral: see ``pin``). With ``--no-pin`` everything
shares the machine's cores:
on a small box the control plane's CPU time is then taken from the worker's forward passes
at concurrency 32, and other work on the machine skews everything (the 1-minute load average
is printed before and after). Per phase the run prints each process's CPU seconds (the
control plane's also per gateway request) and how busy the machine was.

The run exits nonzero only if a request failed; PASS/FAIL per row is information.

    python benchmarks/bench_gateway.py
    python benchmarks/bench_gateway.py --requests 500 --rounds 40 --no-auth --json out.json
    python benchmarks/bench_gateway.py --client-core worker
    python benchmarks/bench_gateway.py --client python
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import re
import shutil
import string
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from native_client import NativeClient, Target, build  # benchmarks/ is the script folder
from safetensors.numpy import save_file
from serve_process import pct, serve, wait_for
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from hotpool.billing.db import Database
from hotpool.billing.ledger import Ledger, UsageRecord
from hotpool.heap import settle_heap
from hotpool.platform.worker_stream import WorkerStreams

REPO = Path(__file__).resolve().parent.parent
CORES = sorted(os.sched_getaffinity(0))  # the cores this run may use, before any pinning
CACHE = REPO / ".cache" / "bench" / "gateway"
PROMPT = "Once upon a time, in a town by the sea, there lived"
TARGET_MS = {"p50": 2.0, "p99": 10.0}  # issue 7: added latency, at c=1 and c=32
BOOTSTRAP_RESAMPLES = 2000
BURST_MS = 1.0  # first text to end of stream under this: the stream came in one burst
WORKER_TOKEN = "bench-gateway-worker-token"
DEPLOYMENT = "tiny"
# What the client looks for in a line before it decodes it (see `Paths`). JSON escapes the
# quotes inside generated text, so none of these can come from a token.
ERROR_CHUNK = b'data: {"error"'  # an SSE error chunk (a stream failed mid-way)
USAGE = b'"usage": {'  # the SSE usage chunk (every other chunk has "usage": null)
UNFINISHED = b'"finish_reason": null'  # a worker event that does not end its stream
TENANT = "bench"
EOS = "<|endoftext|>"
MODEL_VERSION = "1"  # bump when the model below changes: the cached folder is rebuilt


# --- the tiny model ------------------------------------------------------------------------

TRAINING_TEXT = [
    "Once upon a time, in a town by the sea, there lived an old fisherman who told stories "
    "of the deep to anyone who would listen, and the children of the town listened well.",
    "The quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs!",
    "Sphinx of black quartz, judge my vow. How vexingly quick daft zebras jump: 0123456789.",
    "A control plane sits in front of the workers; it routes, meters and scales requests.",
]


def build_tiny_model(folder: Path) -> Path:
    """A loadable HF-format Llama folder (config.json, model.safetensors, tokenizer files)
    with random weights: 2 layers, hidden 64, 4 query / 2 KV heads, a BPE vocabulary of
    ASCII pieces (every token decodes to text, so each output token is one text event)."""
    stamp = folder / ".version"
    if stamp.is_file() and stamp.read_text() == MODEL_VERSION:
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    alphabet = [*string.ascii_letters, *string.digits, *string.punctuation, "\u2581"]
    trainer = trainers.BpeTrainer(
        vocab_size=384, special_tokens=[EOS], initial_alphabet=alphabet, show_progress=False
    )
    tok.train_from_iterator(TRAINING_TEXT * 4, trainer)
    tok.save(str(folder / "tokenizer.json"))
    eos_id = tok.token_to_id(EOS)
    chat = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": EOS, "add_bos_token": False, "chat_template": chat})
    )

    vocab, hidden, inter, layers, heads, kv_heads, head_dim = (
        tok.get_vocab_size(), 64, 128, 2, 4, 2, 16,
    )  # fmt: skip
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "eos_token_id": eos_id,
        "torch_dtype": "float32",
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))

    rng = np.random.default_rng(0)

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    tensors = {
        "model.embed_tokens.weight": w(vocab, hidden),
        "model.norm.weight": norm(hidden),
        "lm_head.weight": w(vocab, hidden),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": norm(hidden),
            p + "post_attention_layernorm.weight": norm(hidden),
            p + "self_attn.q_proj.weight": w(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": w(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": w(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": w(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": w(inter, hidden),
            p + "mlp.up_proj.weight": w(inter, hidden),
            p + "mlp.down_proj.weight": w(hidden, inter),
        }
    save_file(tensors, str(folder / "model.safetensors"), {"format": "pt"})
    stamp.write_text(MODEL_VERSION)
    return folder


def hotpool_cli(*args: str, env: dict[str, str]) -> str:
    """``python -m hotpool ARGS``; its stdout, or RuntimeError with its stderr."""
    r = subprocess.run(
        [sys.executable, "-m", "hotpool", *args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=False,
    )
    if r.returncode != 0:
        raise RuntimeError(f"hotpool {' '.join(args)} failed ({r.returncode}):\n{r.stderr}")
    return r.stdout


def snapshot() -> str:
    """The tiny model pushed (public CLI path) to a ``file://`` store outside any server
    home, so every phase's fresh home loads the same snapshot."""
    folder = build_tiny_model(CACHE / "tiny-llama")
    target = CACHE / "objects" / f"tiny-llama-v{MODEL_VERSION}"
    uri = f"file://{target}"
    if not (target / "manifest.json").is_file():
        shutil.rmtree(target, ignore_errors=True)
        hotpool_cli("snapshot", "push", str(folder), uri, env={"HOTPOOL_HOME": str(CACHE)})
    return uri


# --- the server (the pieces of tests/e2e/server_process.py a benchmark needs) ---------------


@dataclass
class Server:
    url: str
    home: Path
    proc: subprocess.Popen[bytes]
    headers: dict[str, str]

    def call(self, method: str, path: str, **kw: Any) -> Any:
        r = httpx.request(method, self.url + path, headers=self.headers, timeout=30, **kw)
        if r.status_code >= 300:
            raise RuntimeError(f"{method} {path}: HTTP {r.status_code} {r.text[:300]}")
        return r.json()

    def replicas(self, name: str) -> list[dict[str, Any]]:
        return self.call("GET", f"/v1/deployments/{name}")["replicas"]  # type: ignore[no-any-return]

    def ledger(self, ids: set[str]) -> dict[str, UsageRecord]:
        db = Database(f"sqlite:///{self.home / 'hotpool.db'}")
        try:
            rows = Ledger(db).events(DEPLOYMENT, limit=1_000_000)
        finally:
            db.dispose()
        return {r.request_id: r for r in rows if r.request_id in ids}


@contextlib.contextmanager
def running_server(home: Path, env: dict[str, str], headers: dict[str, str]) -> Iterator[Server]:
    """``hotpool serve`` with ``HOTPOOL_HOME=home`` (prepared by the caller), whose worker
    token the benchmark knows (to call a worker directly)."""
    with serve(home, {"HOTPOOL_WORKER_TOKEN": WORKER_TOKEN, **env}) as (url, proc):
        yield Server(url, home, proc, headers)


def worker_address(home: Path, worker_id: str, timeout_s: float = 30) -> str:
    """The worker's internal address, from its registration line in its log."""
    path = home / "logs" / f"{worker_id}.log"
    pattern = re.compile(rf"registered {re.escape(worker_id)} at (http://\S+)")
    found: list[str] = []

    def check() -> bool:
        with contextlib.suppress(FileNotFoundError):
            found[:] = pattern.findall(path.read_text(errors="replace"))
        return bool(found)

    wait_for(f"the registration line in {path}", check, timeout_s)
    return found[-1].rstrip("/")


# --- CPU accounting ------------------------------------------------------------------------


@dataclass(frozen=True)
class CpuSnapshot:
    """CPU seconds so far of the control plane, the worker and this client, and of the whole
    machine (busy, total), from /proc (NaN where it cannot be read)."""

    control_plane: float
    worker: float
    client: float
    busy: float
    total: float

    def since(self, before: CpuSnapshot) -> dict[str, float]:
        return {
            "control_plane_s": self.control_plane - before.control_plane,
            "worker_s": self.worker - before.worker,
            "client_s": self.client - before.client,
            "machine_busy_share": (self.busy - before.busy) / max(self.total - before.total, 1e-9),
        }


def _process_cpu_s(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return math.nan
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def cpu_snapshot(cp_pid: int, worker_pid: int, client_pid: int | None = None) -> CpuSnapshot:
    """``client_pid``: the native client's process, counted with this one as the client."""
    try:
        jiffies = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        idle = jiffies[3] + jiffies[4]  # idle + iowait
        busy, total = float(sum(jiffies) - idle), float(sum(jiffies))
    except (OSError, ValueError, IndexError):
        busy = total = math.nan
    client = sum(os.times()[:2])  # this process: the benchmark's client
    if client_pid is not None:
        client += _process_cpu_s(client_pid)
    return CpuSnapshot(_process_cpu_s(cp_pid), _process_cpu_s(worker_pid), client, busy, total)


# --- requests ------------------------------------------------------------------------------


@dataclass
class Sample:
    path: str  # direct or gateway
    ttft: float | None = None  # seconds to the first event with text
    total: float = math.nan  # seconds to the end of the stream
    tokens: int = 0
    request_id: str = ""  # gateway: the ledger key (x-hotpool-request-id)
    error: str | None = None


@dataclass
class Paths:
    """One keep-alive client per path, and how to send a request on each.

    The client is hotpool's own lean HTTP/1.1 stream client (``WorkerStreams``, what the
    control plane reaches its workers with), not httpx: httpx costs ~0.5 ms of Python per
    streamed event here, so at concurrency 32 the client alone kept a core busy and its own
    queueing swamped both paths' times. Both paths share the client, so what differs
    between them is the server side.

    Past the first text, the client decodes only the lines it needs (an error, the usage
    chunk, the worker's finishing event) and tests the others for a marker: beside the
    control plane on one core, every microsecond the client spends is taken from the
    gateway path alone (decoding every line of a 16-token stream cost ~70 us of Python,
    against ~18 us this way: ~10% of the client's CPU per request)."""

    gateway_url: str
    direct_url: str
    gateway_headers: dict[str, str]
    max_tokens: int
    timeout_s: float

    def __post_init__(self) -> None:
        bearer = self.gateway_headers.get("authorization", "Bearer local").removeprefix("Bearer ")
        self.gateway = WorkerStreams(bearer)  # with HOTPOOL_AUTH=none the key is ignored
        self.direct = WorkerStreams(WORKER_TOKEN)

    async def close(self) -> None:
        await self.gateway.aclose()
        await self.direct.aclose()

    def sender(self, path: str) -> Callable[[], Awaitable[Sample]]:
        return self.via_gateway if path == "gateway" else self.via_direct

    async def batch(self, path: str, count: int) -> list[Sample]:
        send = self.sender(path)
        return list(await asyncio.gather(*(send() for _ in range(count))))

    def gateway_body(self) -> dict[str, Any]:
        return {
            "model": DEPLOYMENT,
            "prompt": PROMPT,
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }

    def direct_body(self, request_id: str) -> dict[str, Any]:
        return {
            "request_id": request_id,
            "prompt": PROMPT,
            "params": {"max_tokens": self.max_tokens, "temperature": 0.0, "ignore_eos": True},
        }

    async def via_gateway(self) -> Sample:
        body = self.gateway_body()
        s = Sample("gateway")
        done = False
        t0 = time.perf_counter()
        try:
            async with asyncio.timeout(self.timeout_s):
                url = self.gateway_url + "/v1/completions"
                async with self.gateway.post(url, json.dumps(body).encode()) as r:
                    s.request_id = r.headers.get("x-hotpool-request-id", "")
                    if r.status != 200:
                        s.error = f"HTTP {r.status}: {(await r.read())[:200]!r}"
                        return s
                    async for line in r.lines():  # SSE: "data: ..." lines; blank ones skipped
                        if not line.startswith(b"data: "):
                            continue
                        if line == b"data: [DONE]":
                            done = True  # read on to the end of the body, as the openai client
                            continue  # does: a response left unread loses its connection
                        if s.ttft is None or line.startswith(ERROR_CHUNK) or USAGE in line:
                            chunk = json.loads(line[6:])  # the first text, errors, the usage
                            if "error" in chunk:
                                s.error = str(chunk["error"].get("message"))
                                continue
                            choices = chunk.get("choices")
                            if s.ttft is None and choices and choices[0].get("text"):
                                s.ttft = time.perf_counter() - t0
                            if chunk.get("usage"):
                                s.tokens = int(chunk["usage"]["completion_tokens"])
        except (httpx.HTTPError, TimeoutError) as exc:
            s.error = f"{type(exc).__name__}: {exc}"
        s.total = time.perf_counter() - t0
        if s.error is None and not done:
            s.error = "stream ended without [DONE]"
        return _check(s, self.max_tokens)

    async def via_direct(self) -> Sample:
        body = self.direct_body(f"bench-direct-{uuid.uuid4().hex}")
        s = Sample("direct")
        finished = False
        t0 = time.perf_counter()
        try:
            async with asyncio.timeout(self.timeout_s):
                url = self.direct_url + "/generate"
                async with self.direct.post(url, json.dumps(body).encode()) as r:
                    if r.status != 200:
                        s.error = f"HTTP {r.status}: {(await r.read())[:200]!r}"
                        return s
                    async for line in r.lines():
                        if s.ttft is not None and UNFINISHED in line:
                            continue  # a text delta after the first: nothing to read in it
                        event = json.loads(line)  # the first text and the finish (see `Paths`)
                        if s.ttft is None and event.get("text"):
                            s.ttft = time.perf_counter() - t0
                        if (finish := event.get("finish_reason")) is not None:
                            finished = True  # its usage is the exact total
                            s.tokens = int(event["usage"]["completion_tokens"])
                            if finish == "error":
                                s.error = str(event.get("error"))
        except (httpx.HTTPError, TimeoutError) as exc:
            s.error = f"{type(exc).__name__}: {exc}"
        s.total = time.perf_counter() - t0
        if s.error is None and not finished:
            s.error = "stream ended without a finish reason"
        return _check(s, self.max_tokens)


class NativePaths:
    """The same two paths and requests, sent by the C client (``native_client``): what
    differs between the paths is still only the server side, and the client's own CPU,
    which on a small box is taken from the gateway path alone, is a few microseconds an
    event instead of ~1 ms a stream."""

    def __init__(self, binary: Path, paths: Paths) -> None:
        bearer = paths.gateway_headers.get("authorization", "Bearer local")
        targets = [
            Target("gateway", "sse", paths.gateway_url + "/v1/completions", bearer,
                   paths.gateway_body()),
            Target("direct", "ndjson", paths.direct_url + "/generate", f"Bearer {WORKER_TOKEN}",
                   paths.direct_body("bench-direct-@@REQUEST_ID@@")),
        ]  # fmt: skip
        self.client = NativeClient(binary, targets, paths.timeout_s)
        self.max_tokens = paths.max_tokens

    async def batch(self, path: str, count: int) -> list[Sample]:
        # Blocking is fine: nothing else runs on this event loop while a batch is out.
        return [
            _check(
                Sample(path, o.ttft, o.total, max(o.tokens, 0), o.request_id, o.error),
                self.max_tokens,
            )
            for o in self.client.batch(path, count)
        ]

    async def close(self) -> None:
        self.client.close()


def _check(s: Sample, max_tokens: int) -> Sample:
    if s.error is None and s.tokens != max_tokens:
        s.error = f"{s.tokens} completion tokens, asked for {max_tokens}"
    elif s.error is None and s.ttft is None:
        s.error = "no event carried text"
    return s


async def measure(
    paths: Paths | NativePaths, concurrency: int, batches: int
) -> dict[str, list[Sample]]:
    """``batches`` batches of ``concurrency`` simultaneous requests per path; the paths
    alternate batch by batch, and which goes first alternates too."""
    out: dict[str, list[Sample]] = {"direct": [], "gateway": []}
    for b in range(batches):
        order = ("direct", "gateway") if b % 2 == 0 else ("gateway", "direct")
        for path in order:
            out[path] += await paths.batch(path, concurrency)
    return out


# --- one phase -----------------------------------------------------------------------------


def prepare_home(home: Path, auth: bool) -> dict[str, str]:
    """A fresh ``HOTPOOL_HOME``; with ``auth``, a tenant and an API key made with the CLI
    before the server starts. The headers a client sends."""
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir(parents=True)
    if not auth:
        return {}
    env = {"HOTPOOL_HOME": str(home)}
    hotpool_cli("tenants", "create", TENANT, env=env)
    key = hotpool_cli(
        "keys", "create", "--tenant", TENANT, "--scopes", "deploy,invoke", "--name", "bench",
        env=env,
    ).strip()  # fmt: skip
    return {"authorization": f"Bearer {key}"}


def probe_auth(srv: Server) -> dict[str, int]:
    """Status of a one-token completion without a key and with a wrong one (401 expected)."""
    body = {"model": DEPLOYMENT, "prompt": PROMPT, "max_tokens": 1}
    out = {}
    for label, headers in (("no_key", {}), ("wrong_key", {"authorization": "Bearer hp_wrong"})):
        r = httpx.post(srv.url + "/v1/completions", json=body, headers=headers, timeout=30)
        out[label] = r.status_code
    return out


def run_phase(name: str, uri: str, args: argparse.Namespace) -> dict[str, Any]:
    auth = name == "keys"
    home = CACHE / "home" / name
    headers = prepare_home(home, auth)
    env = {
        "HOTPOOL_AUTH": "keys" if auth else "none",
        "HOTPOOL_MAX_WORKERS": "1",
        "HOTPOOL_WARM_WORKERS": "1",
        "HOTPOOL_WORKER_THREADS": str(args.worker_threads),
        "HOTPOOL_KV_CACHE_BYTES": "64m",
    }
    auth_mode = env["HOTPOOL_AUTH"]
    print(
        f"[{name}] starting hotpool serve (HOTPOOL_HOME={home}, HOTPOOL_AUTH={auth_mode})",
        flush=True,
    )
    with running_server(home, env, headers) as srv:
        spec = {
            "name": DEPLOYMENT,
            "snapshot_uri": uri,
            "min_replicas": 1,
            "max_replicas": 1,
            "target_concurrency": 64,
            "idle_timeout_s": 3600,
        }
        srv.call("POST", "/v1/deployments", json=spec)
        ready: list[dict[str, Any]] = []

        def one_ready() -> bool:
            ready[:] = [r for r in srv.replicas(DEPLOYMENT) if r["state"] == "ready"]
            return bool(ready)

        wait_for("a ready replica", one_ready, 300)
        address = worker_address(home, ready[0]["worker_id"])
        print(f"[{name}] replica {ready[0]['id']} ready on worker {ready[0]['worker_id']} "
              f"(pid {ready[0]['pid']}) at {address}", flush=True)  # fmt: skip
        probe = probe_auth(srv) if auth else {}
        pids = (srv.proc.pid, int(ready[0]["pid"]))
        if args.pin:
            print(f"[{name}] {pin(*pids, client_with_worker=args.client_core == 'worker')}",
                  flush=True)  # fmt: skip
        results, cpu = asyncio.run(drive(srv, address, headers, name, args, pids))
        ids = {s.request_id for c in results.values() for s in c["gateway"] if s.request_id}
        rows: dict[str, UsageRecord] = {}

        def all_rows() -> bool:
            rows.update(srv.ledger(ids))
            return len(rows) >= len(ids)

        with contextlib.suppress(TimeoutError):  # written off the request path
            wait_for("ledger rows", all_rows, 15)
    return summarize(name, results, rows, probe, cpu, args)


def pin(cp_pid: int, worker_pid: int, client_with_worker: bool = False) -> str:
    """The worker on a core of its own, the control plane and this client on the others:
    the layout of a real deployment, where a GPU worker's host threads do not share a core
    with the control plane. Unpinned on a 2-core box, every millisecond the control plane
    runs is taken from the worker's forward pass or the client, and the comparison measures
    core sharing as much as the control plane. Every thread of each process is pinned.

    With ``client_with_worker`` the client shares the worker's core instead. On two cores
    neither layout is neutral: beside the control plane, the client's CPU weighs on the
    gateway path only (and at concurrency 32 that core is the bottleneck); beside the worker,
    it slows the worker in both paths, holds up the direct path's reads while the worker
    computes, and every gateway event crosses cores twice (worker → control plane → client).
    Three cores or more give each its own."""
    cores = CORES  # as at the start: an earlier phase pinned this process
    if len(cores) < 2:
        return "one core: nothing pinned"
    mine, others = {cores[0]}, set(cores[1:])
    client = mine if client_with_worker else others
    for pid, cpus in ((worker_pid, mine), (cp_pid, others), (os.getpid(), client)):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(ProcessLookupError):
                os.sched_setaffinity(int(tid), cpus)
    if client_with_worker:
        return (f"worker and client pinned to CPU {cores[0]}; control plane to CPU(s) "
                f"{sorted(others)}")  # fmt: skip
    return f"worker pinned to CPU {cores[0]}; control plane and client to CPU(s) {sorted(others)}"


def layout(args: argparse.Namespace) -> str:
    if not args.pin:
        return "unpinned"
    if args.client_core == "worker":
        return "worker and client on one core, control plane on the other(s)"
    return "worker on its own core"


async def drive(
    srv: Server,
    address: str,
    headers: dict[str, str],
    name: str,
    args: argparse.Namespace,
    pids: tuple[int, int],
) -> tuple[dict[int, dict[str, list[Sample]]], dict[int, dict[str, float]]]:
    """The samples per concurrency and path, and the CPU each process used per phase."""
    python_paths = Paths(srv.url, address, headers, args.max_tokens, args.request_timeout)
    paths: Paths | NativePaths = python_paths
    client_pid = None
    if args.client == "native":
        paths = NativePaths(args.native_binary, python_paths)
        client_pid = paths.client.pid
    try:
        print(f"[{name}] warming up both paths", flush=True)
        for c, batches in ((1, args.warmup), (args.concurrency, 2)):
            warm = await measure(paths, c, batches)
            bad = [s.error for v in warm.values() for s in v if s.error]
            if bad:
                raise RuntimeError(f"warm-up requests failed: {sorted(set(bad))[:3]}")
        # The client's own full collections (~50 ms each, over ~100,000 objects) would stall
        # whichever path is running; the server processes settle theirs the same way.
        settle_heap()
        results, cpu = {}, {}
        for c, batches in ((1, args.requests), (args.concurrency, args.rounds)):
            t, before = time.perf_counter(), cpu_snapshot(*pids, client_pid)
            results[c] = await measure(paths, c, batches)
            cpu[c] = cpu_snapshot(*pids, client_pid).since(before)
            print(f"[{name}] c={c}: {2 * c * batches} requests in "
                  f"{time.perf_counter() - t:.1f}s", flush=True)  # fmt: skip
        return results, cpu
    finally:
        await paths.close()
        if paths is not python_paths:
            await python_paths.close()


def summarize(
    name: str,
    results: dict[int, dict[str, list[Sample]]],
    rows: dict[str, UsageRecord],
    probe: dict[str, int],
    cpu: dict[int, dict[str, float]],
    args: argparse.Namespace,
) -> dict[str, Any]:
    out: dict[str, Any] = {"phase": name, "auth_probe": probe, "by_concurrency": {}}
    for c, by_path in results.items():
        entry: dict[str, Any] = {"failed": 0, "failures": [], "cpu": cpu[c]}
        for path, samples in by_path.items():
            ok = [s for s in samples if s.error is None]
            bad = [s for s in samples if s.error is not None]
            entry["failed"] += len(bad)
            entry["failures"] += sorted({s.error or "" for s in bad})[:3]
            ttft = [s.ttft * 1e3 for s in ok if s.ttft is not None]
            total = [s.total * 1e3 for s in ok]
            span = [(s.total - s.ttft) * 1e3 for s in ok if s.ttft is not None]
            entry[path] = {
                "requests": len(samples),
                # A stream whose tokens all arrived within BURST_MS was held up and flushed
                # at once (say, by Nagle's algorithm against a delayed ACK), not streamed.
                "burst_share": sum(x < BURST_MS for x in span) / len(span) if span else math.nan,
                "stream_span_p50_ms": pct(span, 0.5),
                **{f"ttft_{q}_ms": pct(ttft, v) for q, v in (("p50", 0.5), ("p99", 0.99))},
                **{f"total_{q}_ms": pct(total, v) for q, v in (("p50", 0.5), ("p99", 0.99))},
            }
        for metric in ("ttft", "total"):
            for q in ("p50", "p99"):
                key = f"{metric}_{q}_ms"
                added = entry["gateway"][key] - entry["direct"][key]
                entry[f"added_{key}"] = added
                entry[f"pass_{key}"] = bool(added <= TARGET_MS[q])
                entry[f"added_{key}_ci95"] = added_interval(
                    by_path["direct"], by_path["gateway"], c, metric, QUANTILES[q]
                )
        # Stages, from the ledger: the invoker's own TTFT/total vs what the client saw.
        gw = [s for s in by_path["gateway"] if s.error is None and s.request_id in rows]
        inside_ttft = [(rows[s.request_id].ttft_seconds or math.nan) * 1e3 for s in gw]
        inside_total = [(rows[s.request_id].total_seconds or math.nan) * 1e3 for s in gw]
        outside_ttft = [
            (s.ttft or math.nan) * 1e3 - i for s, i in zip(gw, inside_ttft, strict=True)
        ]
        outside_total = [s.total * 1e3 - i for s, i in zip(gw, inside_total, strict=True)]
        entry["stages"] = {
            "ledger_rows": len(gw),
            "invoker_ttft_p50_ms": pct(inside_ttft, 0.5),
            "invoker_ttft_p99_ms": pct(inside_ttft, 0.99),
            "invoker_total_p50_ms": pct(inside_total, 0.5),
            "around_invoker_ttft_p50_ms": pct(outside_ttft, 0.5),
            "around_invoker_ttft_p99_ms": pct(outside_ttft, 0.99),
            "around_invoker_total_p50_ms": pct(outside_total, 0.5),
        }
        out["by_concurrency"][str(c)] = entry
    return out


QUANTILES = {"p50": 0.5, "p99": 0.99}


def added_interval(
    direct: list[Sample], gateway: list[Sample], batch: int, metric: str, q: float
) -> tuple[float, float]:
    """The 95% interval of ``pct(gateway, q) - pct(direct, q)`` (ms), by a paired bootstrap
    over the batches: the same batch indices are drawn, with replacement, for both paths.

    Why batches, not requests: the ``batch`` streams of a batch share one worker step
    schedule and one moment of the machine, so their times move together; resampling them
    one by one would pretend to 32 times the evidence there is. Why paired: the paths
    alternate batch by batch, so batch ``i`` of each saw nearly the same machine. An
    interval that straddles the target says this run cannot tell whether it is met."""

    def matrix(samples: list[Sample]) -> np.ndarray:
        values = [
            (s.ttft if metric == "ttft" else s.total) if s.error is None else None for s in samples
        ]
        ms = np.array([math.nan if v is None else v * 1e3 for v in values], dtype=np.float64)
        return ms[: len(ms) // batch * batch].reshape(-1, batch)

    d, g = matrix(direct), matrix(gateway)
    n = min(len(d), len(g))
    if n < 2:
        return (math.nan, math.nan)
    rng = np.random.default_rng(0)  # the same draws every run: the interval is reproducible
    picks = rng.integers(0, n, size=(BOOTSTRAP_RESAMPLES, n))

    def quantiles(m: np.ndarray) -> np.ndarray:
        drawn = np.sort(m[:n][picks].reshape(BOOTSTRAP_RESAMPLES, -1), axis=1)  # NaN last
        count = (~np.isnan(drawn)).sum(axis=1)
        rank = np.clip(np.ceil(q * count).astype(np.int64) - 1, 0, None)  # as pct() ranks
        return np.where(count > 0, drawn[np.arange(len(drawn)), rank], np.nan)

    diffs = quantiles(g) - quantiles(d)
    lo, hi = np.nanpercentile(diffs, [2.5, 97.5])
    return (float(lo), float(hi))


# --- report --------------------------------------------------------------------------------


def fmt(v: float) -> str:
    return "-" if v is None or math.isnan(v) else f"{v:.2f}"


def interval(ci: tuple[float, float]) -> str:
    return f"{fmt(ci[0])} .. {fmt(ci[1])}"


def verdict_of(added: float, ci: tuple[float, float], target: float) -> str:
    """PASS or FAIL by the measured difference; with "?" when its 95% interval holds both
    sides of the target (another run could well say the opposite)."""
    word = "PASS" if added <= target else "FAIL"
    return word + "?" if ci[0] <= target < ci[1] else word


def report(phases: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print()
    print(
        f"tiny random-weight Llama (2 layers, hidden 64) on CPU ({os.cpu_count()} cores), one "
        f"replica, worker threads {args.worker_threads}, "
        f"{layout(args)}, {args.client} client, 1-minute load average "
        f"{args.load_average['before']:.2f} before / {args.load_average['after']:.2f} after; "
        f"{args.max_tokens} output tokens per "
        f"request, greedy, EOS ignored; c=1: {args.requests} requests per path, "
        f"c={args.concurrency}: {args.rounds} rounds per path. Times in ms; added = "
        f"p(gateway) - p(direct); target: added <= {TARGET_MS['p50']:g} ms at p50, "
        f"<= {TARGET_MS['p99']:g} ms at p99."
    )
    print()
    print("| auth | c | metric | direct p50 | gateway p50 | added p50 | 95% interval | "
          "direct p99 | gateway p99 | added p99 | 95% interval | p50 | p99 |")  # fmt: skip
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|:-:|:-:|")
    for p in phases:
        for c, e in p["by_concurrency"].items():
            d, g = e["direct"], e["gateway"]
            for metric in ("ttft", "total"):
                k50, k99 = f"{metric}_p50_ms", f"{metric}_p99_ms"
                verdict = [
                    verdict_of(e[f"added_{k}"], e[f"added_{k}_ci95"], TARGET_MS[q])
                    for k, q in ((k50, "p50"), (k99, "p99"))
                ]
                print(
                    f"| {p['phase']} | {c} | {metric.upper() if metric == 'ttft' else metric} | "
                    f"{fmt(d[k50])} | {fmt(g[k50])} | {fmt(e['added_' + k50])} | "
                    f"{interval(e['added_' + k50 + '_ci95'])} | "
                    f"{fmt(d[k99])} | {fmt(g[k99])} | {fmt(e['added_' + k99])} | "
                    f"{interval(e['added_' + k99 + '_ci95'])} | "
                    f"{verdict[0]} | {verdict[1]} |"
                )
    print()
    for p in phases:
        for c, e in p["by_concurrency"].items():
            st = e["stages"]
            print(
                f"{p['phase']} c={c}: direct TTFT p50 {fmt(e['direct']['ttft_p50_ms'])} ms; the "
                f"invoker's own TTFT p50 {fmt(st['invoker_ttft_p50_ms'])} ms (lease + relay "
                f"to the first token from the worker); around the invoker (HTTP, middleware, "
                f"auth, parsing, SSE) TTFT p50 {fmt(st['around_invoker_ttft_p50_ms'])} ms, "
                f"p99 {fmt(st['around_invoker_ttft_p99_ms'])} ms; ledger rows "
                f"{st['ledger_rows']}"
            )
            print(
                f"{p['phase']} c={c}: streams that arrived in one burst (first text to end < "
                f"{BURST_MS:g} ms): direct {e['direct']['burst_share']:.0%}, gateway "
                f"{e['gateway']['burst_share']:.0%}; first text to end p50: direct "
                f"{fmt(e['direct']['stream_span_p50_ms'])} ms, gateway "
                f"{fmt(e['gateway']['stream_span_p50_ms'])} ms"
            )
            cpu, n = e["cpu"], e["gateway"]["requests"]
            print(
                f"{p['phase']} c={c}: CPU over the phase (both paths): control plane "
                f"{cpu['control_plane_s']:.2f} s ({cpu['control_plane_s'] / n * 1e3:.2f} ms "
                f"per gateway request), worker {cpu['worker_s']:.2f} s, client "
                f"{cpu['client_s']:.2f} s; the machine was busy "
                f"{cpu['machine_busy_share']:.0%} of the time (near 100%: the control plane's "
                "CPU is taken from the worker and the client, and shows as added latency)"
            )
            if e["failed"]:
                print(f"{p['phase']} c={c}: FAILED requests: {e['failures']}")
    if len(phases) == 2:
        none, keys = phases
        for c in none["by_concurrency"]:
            a, b = none["by_concurrency"][c]["gateway"], keys["by_concurrency"][c]["gateway"]
            print(
                f"key auth, c={c}: gateway TTFT p50 {fmt(b['ttft_p50_ms'] - a['ttft_p50_ms'])} "
                f"ms, total p50 {fmt(b['total_p50_ms'] - a['total_p50_ms'])} ms vs no auth "
                f"(two servers, so machine noise shows here too)"
            )
    for p in phases:
        probe = p["auth_probe"]
        if probe:
            enforced = all(v == 401 for v in probe.values())
            print(
                f"{p['phase']}: /v1/completions without a key -> {probe['no_key']}, with a "
                f"wrong key -> {probe['wrong_key']}"
                + ("" if enforced else " -- WARNING: the key is NOT checked on this route, so "
                   "these rows do not include key authentication")
            )  # fmt: skip
    met = all(
        e[f"pass_{m}_{q}_ms"]
        for p in phases
        for e in p["by_concurrency"].values()
        for m in ("ttft", "total")
        for q in ("p50", "p99")
    )
    print("target met on every row" if met else "target MISSED on at least one row")
    print(
        "95% interval: of the added time, by a paired bootstrap over the batches (c=1: "
        "requests; c=32: rounds); PASS?/FAIL?: the interval holds both sides of the target, "
        "so this run cannot tell (more --requests/--rounds narrow it)"
    )
    if args.pin and len(CORES) < 3:
        shared = (
            "the worker's: it slows the worker on both paths"
            if args.client_core == "worker"
            else "the control plane's: its CPU weighs on the gateway path alone"
        )
        print(
            f"caveat: on {len(CORES)} cores the client shares a core, {shared} (see `pin`); "
            "with 3 or more, the control plane and the client have a core each"
        )
    summary = {"bench": "gateway", "args": vars(args), "target_ms": TARGET_MS, "phases": phases}
    print(json.dumps(summary, default=str))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2, default=str))


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--requests", type=int, default=200, help="requests per path at c=1")
    ap.add_argument("--rounds", type=int, default=60, help="rounds per path at --concurrency")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=20, help="warm-up requests per path at c=1")
    ap.add_argument("--worker-threads", type=int, default=1, help="the worker's CPU threads")
    ap.add_argument(
        "--pin",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the worker on a core of its own, the control plane and the client on the rest",
    )
    ap.add_argument(
        "--client-core",
        choices=("control-plane", "worker"),
        default="control-plane",
        help="with --pin: the core(s) the client shares (see pin())",
    )
    ap.add_argument(
        "--auth",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run with HOTPOOL_AUTH=keys and an API key (default: on)",
    )
    ap.add_argument(
        "--client",
        choices=("native", "python"),
        default="native",
        help="the load client: C (stream_client.c, built with the system compiler; the "
        "default) or Python (asyncio and hotpool's stream client: ~1 ms of CPU a stream)",
    )
    ap.add_argument("--request-timeout", type=float, default=120.0)
    ap.add_argument("--json", help="also write the summary to this file")
    args = ap.parse_args()
    args.native_binary = build(CACHE) if args.client == "native" else None
    if args.client == "native" and args.native_binary is None:
        print("note: no C compiler found; the Python client is used (--client python)")
        args.client = "python"
    uri = snapshot()
    load_before = os.getloadavg()[0]
    if load_before > 0.5:
        print(
            f"note: 1-minute load average {load_before:.2f} before the run; the client, the "
            "control plane and the worker share these cores, so other work skews the numbers"
        )
    phases = [run_phase(name, uri, args) for name in (["none", "keys"] if args.auth else ["none"])]
    args.load_average = {"before": load_before, "after": os.getloadavg()[0]}
    report(phases, args)
    failed = sum(e["failed"] for p in phases for e in p["by_concurrency"].values())
    if failed:
        print(f"FAIL: {failed} requests failed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
