"""A request's prefix-cache block hashes, as the replica that serves it will compute them:
the same token ids (worker/prompt.py, over the snapshot's own tokenizer and chat template)
and the same chained hashes and salt (worker/prefix_hash.py). The router compares them with
what each replica reports holding.

The tokenizer files come from a ready replica (``GET /tokenizer`` on its worker), once per
snapshot digest, in the background: until they are here, requests are routed without
affinity. A request the template cannot render gets no hashes (its worker answers the
error). Tokenizing costs the control plane ~0.1-2 ms a request, so the router asks only when
there are replicas to choose between.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import httpx

from hotpool.pool.replica import Replica
from hotpool.worker.prefix_hash import deployment_salt, prompt_block_hashes, reported
from hotpool.worker.prompt import parse_tools, prompt_bytes, prompt_token_ids
from hotpool.worker.protocol import GenerateRequest
from hotpool.worker.tokenizer import TOKENIZER_FILES, TextTokenizer

log = logging.getLogger("hotpool.router")

MAX_BLOCKS = 2048  # prefixes past 32k tokens (16-token blocks) are not told apart
MAX_TOKENIZERS = 8  # snapshots whose tokenizers stay loaded, least recently used out
RETRY_S = 30.0  # after a failed fetch
INLINE_BYTES = 64 << 10  # longer prompts are tokenized in a thread (prepare)
MAX_PREPARED = 4096


@dataclass(frozen=True)
class PromptKey:
    """A prompt as the router weighs it: its token count and its full blocks' hashes."""

    tokens: int
    hashes: list[str]


class PromptHasher:
    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client
        self._tokenizers: OrderedDict[str, TextTokenizer] = OrderedDict()
        self._fetching: dict[str, asyncio.Task[None]] = {}
        self._failed_at: dict[str, float] = {}
        # (request id, snapshot digest) -> the prompt's ids, tokenized off the event loop
        self._prepared: dict[tuple[str, str], tuple[int, ...] | None] = {}

    def hashes(self, replica: Replica, request: GenerateRequest) -> list[str] | None:
        """The request's block hashes on ``replica``'s deployment (:meth:`key`)."""
        key = self.key(replica, request)
        return None if key is None else key.hashes

    def key(self, replica: Replica, request: GenerateRequest) -> PromptKey | None:
        """The request's prompt on ``replica``'s deployment, or None when it cannot be
        known yet (no tokenizer here yet, no block size reported, a template error)."""
        load = replica.load
        if load is None:
            return None
        block_size = replica.prefixes.block_size or load.kv_block_size
        tok = self._tokenizers.get(load.digest)
        if tok is None:
            self.prefetch(replica)
            return None
        if block_size is None:
            return None
        self._tokenizers.move_to_end(load.digest)
        at = (request.request_id, load.digest)
        if at in self._prepared:
            ids = self._prepared[at]
        elif prompt_bytes(request) > INLINE_BYTES:
            return None  # never tokenized on the event loop: see prepare()
        else:
            ids = _token_ids(tok, request)
        if ids is None:
            return None
        salt = deployment_salt(load.digest, load.deployment)
        hashes = prompt_block_hashes(ids, block_size, salt, MAX_BLOCKS)
        return PromptKey(len(ids), [reported(h) for h in hashes])

    async def prepare(self, replicas: list[Replica], request: GenerateRequest) -> None:
        """Tokenize a long prompt (over ``INLINE_BYTES``) for the snapshots of ``replicas``,
        in a thread: the tokenizer lets go of the GIL, and on the event loop a megabyte of
        prompt held every request and stream of the control plane for ~0.4 s. :meth:`key`
        then finds the ids; a long prompt not prepared is routed by load alone."""
        if prompt_bytes(request) <= INLINE_BYTES:
            return
        if len(self._prepared) > MAX_PREPARED:  # forget() was skipped somewhere: a bound
            self._prepared.clear()
        for replica in replicas:
            load = replica.load
            at = (request.request_id, load.digest if load else "")
            tok = self._tokenizers.get(at[1])
            if tok is None or at in self._prepared:
                continue
            self._prepared[at] = await asyncio.to_thread(_token_ids, tok, request)

    def forget(self, request_id: str) -> None:
        """Drop what :meth:`prepare` kept for a request that has its replica."""
        if self._prepared:
            for at in [at for at in self._prepared if at[0] == request_id]:
                del self._prepared[at]

    def ready(self, digest: str) -> bool:
        return digest in self._tokenizers

    async def wait_fetched(self, digest: str) -> None:
        """Until the fetch of ``digest``'s tokenizer under way (if any) has ended."""
        task = self._fetching.get(digest)
        if task is not None:
            await asyncio.shield(task)

    def prefetch(self, replica: Replica) -> None:
        """Fetch ``replica``'s tokenizer in the background if it is not here (a replica
        just became ready: its first requests then find it)."""
        if replica.load is not None and replica.load.digest not in self._tokenizers:
            self._fetch(replica, replica.load.digest)

    def _fetch(self, replica: Replica, digest: str) -> None:
        if digest in self._fetching or replica.worker is None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # not on the server's loop (a test's direct call): no fetch
            return
        failed = self._failed_at.get(digest)
        if failed is not None and loop.time() - failed < RETRY_S:
            return
        task = loop.create_task(self._load(replica.address, digest))
        self._fetching[digest] = task
        task.add_done_callback(lambda _: self._fetching.pop(digest, None))

    async def _load(self, address: str, digest: str) -> None:
        try:
            r = await self.client.get(f"{address}/tokenizer", timeout=30.0)
            r.raise_for_status()
            body = r.json()
            if body.get("digest") != digest:
                return  # the worker moved on to another snapshot: a later request retries
            tok = await asyncio.to_thread(_tokenizer_from, body["files"])
        except Exception as exc:  # any failure: routing goes on without affinity
            self._failed_at[digest] = asyncio.get_running_loop().time()
            log.warning("no prompt hashes for snapshot %s: %r", digest[:12], exc)
            return
        self._tokenizers[digest] = tok
        while len(self._tokenizers) > MAX_TOKENIZERS:
            self._tokenizers.popitem(last=False)


def _tokenizer_from(files: dict[str, str]) -> TextTokenizer:
    with tempfile.TemporaryDirectory(prefix="hotpool-tok-") as tmp:
        for name in TOKENIZER_FILES:
            if isinstance(files.get(name), str):
                (Path(tmp) / name).write_text(files[name])
        return TextTokenizer(Path(tmp))


def _token_ids(tok: TextTokenizer, request: GenerateRequest) -> tuple[int, ...] | None:
    """The prompt's ids; None on any failure (the worker answers the request's own error)."""
    try:
        return prompt_token_ids(tok, request, parse_tools(request))
    except Exception:
        return None
