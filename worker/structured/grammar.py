"""Structured output with llguidance: constraints compiled once, matched per request.

Why llguidance (``benchmarks/bench_grammar_engines.py``, measured on this 2-core CPU): its
compile is lazy (a schema is ready in ~1 ms where xgrammar's compile walks the whole
vocabulary, ~100x longer with Gemma's 262k tokens), its mask per step is of the same order,
it takes Lark grammars with JSON schemas inside (``%json {...}``: how a tool call's format
and its arguments' schema are one grammar), its resource limits bound every compile and
every step (no schema stalls a worker), and it has no dependencies.

A :class:`GrammarCompiler` belongs to a loaded model (its tokenizer and vocabulary). A
constraint (the worker's ``response_format`` JSON, or a Lark grammar) compiles into a
pristine matcher kept in a bounded LRU cache by the constraint's hash; each request gets a
``deep_copy`` of it (cheap: the lexer and its caches are shared). Beside it each matcher
runs a bound on the digits of the numbers it lets through (:mod:`.numbers`), which
llguidance's own JSON numbers lack.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from typing import Any

import llguidance
import torch

from hotpool.worker.engine.grammar import TokenGrammar
from hotpool.worker.structured.numbers import START, NumberBound, State
from hotpool.worker.structured.schemas import closed_objects

CACHE_SIZE = 256  # compiled constraints kept per loaded model
# llguidance's own limits, a little tighter than its defaults: a compile or a step past
# them fails that request (a 400, or an error for the one request), never the worker.
LIMITS = llguidance.LLParserLimits(initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000)
# JSON as OpenAI's structured outputs write it: no free whitespace between tokens (free
# whitespace lets a weak model pad forever and never close the object).
JSON_OPTIONS: llguidance.JsonCompileOptions = {"whitespace_flexible": False}
ANY_OBJECT: dict[str, Any] = {"type": "object"}


class GrammarError(ValueError):
    """A constraint the grammar engine cannot compile; the message says where."""


class Matcher(TokenGrammar):
    """One request's position in its grammar, and in its numbers' bound."""

    __slots__ = ("_bound", "_m", "_state")
    _executor: llguidance.LLExecutor | None = None
    _executor_lock = threading.Lock()

    def __init__(self, matcher: llguidance.LLMatcher, bound: NumberBound) -> None:
        self._m = matcher
        self._bound = bound
        self._state: State = START

    def accept(self, token_id: int) -> bool:
        state, within = self._bound.advance(self._state, token_id)
        if not within and self._bound_leaves_a_choice():
            return False  # the mask left it out: a number past the bound
        if not self._m.consume_token(token_id):
            return False
        self._state = state
        return True

    @property
    def is_terminated(self) -> bool:
        return bool(self._m.is_stopped())

    @property
    def error(self) -> str | None:
        return self._m.get_error() if self._m.is_error() else None

    @classmethod
    def fill_bitmasks(cls, rows: Sequence[tuple[TokenGrammar, int]], bitmask: torch.Tensor) -> None:
        if not bitmask.is_contiguous() or bitmask.dtype != torch.int32 or bitmask.is_cuda:
            raise ValueError("the bitmask must be a contiguous int32 CPU tensor")
        pairs = [(g._m, row) for g, row in rows if isinstance(g, Matcher)]
        if len(pairs) == 1:  # one row: no thread hand-off
            m, row = pairs[0]
            v = bitmask[row]
            m.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * 4)
        elif pairs:
            executor = cls._shared_executor()
            executor.unsafe_compute_mask_ptr(
                pairs, bitmask.data_ptr(), bitmask.shape[1] * 4, bitmask.shape[0]
            )
        for g, row in rows:
            if isinstance(g, Matcher):
                g._narrow(bitmask[row])

    def _narrow(self, row: torch.Tensor) -> None:
        """Leave out of the grammar's ``row`` the tokens that would take a number past the
        bound, unless they are all it allows (the schema asks for a longer number)."""
        keep = self._bound.keep(self._state)
        if keep is None:
            return
        narrowed = row[: keep.numel()] & keep
        if narrowed.any():
            row[: keep.numel()] = narrowed

    def _bound_leaves_a_choice(self) -> bool:
        """Whether the grammar allows a token within the bound here (as :meth:`_narrow`
        decides for the mask)."""
        keep = self._bound.keep(self._state)
        if keep is None:
            return True
        row = torch.empty(keep.numel(), dtype=torch.int32)
        self._m.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)
        return bool((row & keep).any())

    @classmethod
    def _shared_executor(cls) -> llguidance.LLExecutor:
        with cls._executor_lock:
            if cls._executor is None:
                cls._executor = llguidance.LLExecutor(num_threads=max(1, torch.get_num_threads()))
            return cls._executor


class GrammarCompiler:
    """Compiles constraints for one tokenizer; thread-safe (the worker compiles off its event
    loop while the engine thread matches)."""

    def __init__(
        self, tokenizer_json: str, vocab_size: int, eos_token_ids: Iterable[int],
        cache_size: int = CACHE_SIZE,
    ) -> None:  # fmt: skip
        eos = sorted(eos_token_ids)
        self.vocab_size = vocab_size
        self._tok = llguidance.LLTokenizer(
            tokenizer_json, n_vocab=vocab_size, eos_token=eos or None
        )
        self._bound = NumberBound(vocab_size, self._token_bytes)
        self._cache: OrderedDict[str, Future[llguidance.LLMatcher]] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.compiles = 0  # constraints compiled (cache misses)

    def matcher(self, constraint: str) -> Matcher:
        """A fresh matcher for ``constraint``: a ``response_format`` JSON text
        (``{"type": "json_object"}`` or ``{"type": "json_schema", "schema": ...}``) or
        ``{"type": "lark", "grammar": ...}``. Raises :class:`GrammarError`."""
        key = hashlib.sha256(constraint.encode()).hexdigest()
        with self._lock:
            entry = self._cache.get(key)
            owner = entry is None
            if entry is None:  # compiled once: requests that race for it wait for this one
                entry = self._cache[key] = Future()
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(key)
        if owner:
            try:
                entry.set_result(self._compile(constraint))
            except BaseException as exc:
                with self._lock:
                    self._cache.pop(key, None)
                entry.set_exception(exc)
        pristine = entry.result()
        return Matcher(pristine.deep_copy(), self._bound)

    def _token_bytes(self, token_id: int) -> bytes:
        """What a token writes; nothing for a special one (an EOS writes no number)."""
        return b"" if self._tok.is_special_token(token_id) else self._tok.decode_bytes([token_id])

    def _compile(self, constraint: str) -> llguidance.LLMatcher:
        try:
            spec = json.loads(constraint)
            kind = spec["type"]
        except (ValueError, KeyError, TypeError):
            raise GrammarError(f"malformed constraint {constraint[:80]!r}") from None
        where = "response_format"
        if kind == "json_object":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(ANY_OBJECT, JSON_OPTIONS)
        elif kind == "json_schema":
            schema = spec.get("schema")
            where = "response_format.json_schema.schema"
            if spec.get("strict"):
                schema = closed_objects(schema)
            try:
                grammar = llguidance.LLMatcher.grammar_from_json_schema(
                    schema if schema not in (None, {}) else True, JSON_OPTIONS
                )
            except ValueError as exc:
                raise GrammarError(f"`{where}` is not usable: {exc}") from None
        elif kind == "lark":
            grammar = llguidance.LLMatcher.grammar_from_lark(str(spec.get("grammar", "")))
            where = str(spec.get("where") or "tools")
        else:
            raise GrammarError(f"unknown constraint type {kind!r}")
        m = llguidance.LLMatcher(self._tok, grammar, log_level=0, limits=LIMITS)
        if m.is_error():
            raise GrammarError(_explain(where, m.get_error(), spec.get("schema")))
        self.compiles += 1
        return m


def _explain(where: str, error: str, schema: Any) -> str:
    """The engine's error with the schema path of the keyword it names, where it names one
    ("Unimplemented keys: ["not"]" -> where.properties.a: ...)."""
    path = None
    if schema is not None and error.startswith("Unimplemented keys"):
        try:
            keys = json.loads(error.split(":", 1)[1])
        except (ValueError, IndexError):
            keys = []
        path = next((p for k in keys if (p := _find_key(schema, k)) is not None), None)
    shown = f"{where}{path}" if path else where
    return f"`{shown}` is not supported by the grammar engine: {error}"


def _find_key(node: Any, key: str, path: str = "") -> str | None:
    if isinstance(node, dict):
        if key in node:
            return path
        items: Iterable[tuple[str, Any]] = ((f".{k}", v) for k, v in node.items())
    elif isinstance(node, list):
        items = ((f"[{i}]", v) for i, v in enumerate(node))
    else:
        return None
    for step, child in items:
        found = _find_key(child, key, path + step)
        if found is not None:
            return found
    return None
