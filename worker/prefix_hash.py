"""The prefix cache's chained block hashes: computed by the worker's KV manager, and by the
control plane's router over the same token ids to find the replica holding a prompt's prefix.

One function for both sides, so a hash the router computes is the one the worker cached.
Hashes leave the worker (heartbeats report what it holds), so the encoding is fixed: token
ids as little-endian 64-bit integers on every host.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence

# Heartbeats and the router's index carry the first 8 bytes of each hash: a collision in
# 2**64 only misroutes one request (the worker's own lookup uses all 16).
REPORTED_BYTES = 8


def deployment_salt(digest: str, deployment: str) -> bytes:
    """The salt of a deployment's prefix cache: its snapshot's digest and its name, so two
    deployments (two tenants') never share a hash, even of the same snapshot and prompt."""
    return f"{digest}\0{deployment}".encode()


def hash_block_tokens(parent: bytes | None, token_ids: Sequence[int], salt: bytes) -> bytes:
    """Chained 16-byte hash of one full block: its parent block's hash, its tokens, the salt.

    The encoding is unambiguous: the salt is length-prefixed and a marker byte tells a root
    block from a child, so no two distinct inputs share a byte string.
    """
    h = hashlib.blake2b(digest_size=16)
    h.update(len(salt).to_bytes(8, "little"))
    h.update(salt)
    if parent is None:
        h.update(b"\x00")
    else:
        h.update(b"\x01")
        h.update(parent)
    ids = array("q", token_ids)
    if sys.byteorder == "big":
        ids.byteswap()
    h.update(ids.tobytes())
    return h.digest()


def prompt_block_hashes(
    token_ids: Sequence[int], block_size: int, salt: bytes, max_blocks: int | None = None
) -> list[bytes]:
    """The chained hashes of every full block of ``token_ids`` (at most ``max_blocks``)."""
    n = len(token_ids) // block_size
    if max_blocks is not None:
        n = min(n, max_blocks)
    out: list[bytes] = []
    parent = None
    for i in range(n):
        parent = hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size], salt)
        out.append(parent)
    return out


def reported(block_hash: bytes) -> str:
    """How a hash travels in a heartbeat and sits in the router's index."""
    return block_hash[:REPORTED_BYTES].hex()
