"""One structured-output compiler per tokenizer, built while a model loads.

Building a :class:`GrammarCompiler` reads the whole vocabulary into llguidance, which holds
the GIL throughout (about a third of a second for SmolLM2's 49k tokens on a quiet 2-core
CPU, seconds for Gemma's 262k, many times that on a loaded machine). Built in the
background after the worker reported ready, it froze the worker's event loop and engine
thread just as the first requests arrived: no tokens and no heartbeats, until the control
plane took the worker for dead. So a load starts it early and waits for it before the
replica is ready (:mod:`hotpool.worker.service`), and the compiler stays with the tokenizer
object it was built from, which the host-memory tier keeps with the model: a re-warm from
RAM builds nothing.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable
from concurrent.futures import Future

from hotpool.worker.structured.grammar import GrammarCompiler
from hotpool.worker.tokenizer import TextTokenizer

_built: weakref.WeakKeyDictionary[TextTokenizer, dict[int, Future[GrammarCompiler]]] = (
    weakref.WeakKeyDictionary()
)
_lock = threading.Lock()


def grammar_compiler(
    tokenizer: TextTokenizer, vocab_size: int, eos_token_ids: Iterable[int] | None = None
) -> Future[GrammarCompiler]:
    """The compiler for ``tokenizer`` and ``vocab_size``, being built in a thread of its own
    (started by the first call) or already built. A build that fails keeps its exception in
    the future, for the request that needs the compiler to report."""
    with _lock:
        per_vocab = _built.setdefault(tokenizer, {})
        future = per_vocab.get(vocab_size)
        if future is not None:
            return future
        future = per_vocab[vocab_size] = Future()
    eos = tokenizer.eos_token_ids if eos_token_ids is None else eos_token_ids
    threading.Thread(
        target=_build, args=(future, tokenizer, vocab_size, tuple(eos)), name="grammars",
        daemon=True,
    ).start()  # fmt: skip
    return future


def _build(
    future: Future[GrammarCompiler], tokenizer: TextTokenizer, vocab_size: int, eos: tuple[int, ...]
) -> None:
    try:
        future.set_result(GrammarCompiler(tokenizer.to_json(), vocab_size, eos))
    except BaseException as exc:  # reported to the request that needs it
        future.set_exception(exc)
