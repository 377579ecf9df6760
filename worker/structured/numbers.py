"""A bound on the digits of every number a constrained output writes.

llguidance compiles a JSON number to a regular expression whose digits never end
(``-?(0|[1-9][0-9]*)(\\.[0-9]+)?([eE][+-]?[0-9]+)?``; a ``minimum`` and a ``maximum`` bound
the integer part, never the fraction) and has no option to bound them. A weak model at
temperature 1 then writes digits until ``max_tokens`` cuts the JSON (one wrote ~180 of them
for a number between -60 and 60). So beside each llguidance matcher runs this
character-level automaton: it follows the text in and out of JSON strings, counts a
number's digits, and the step's mask leaves out the tokens that would write

- more than :data:`MAX_INTEGER_DIGITS` digits in a number without a fraction (int64's
  width),
- more than :data:`MAX_FRACTION_DIGITS` digits in one with a fraction, both parts and
  leading zeros counted (float64 keeps 17 significant digits; counting the zeros too keeps
  ``0.000...`` from going on forever),
- an exponent of more than :data:`MAX_EXPONENT_DIGITS` digits or above
  :data:`MAX_EXPONENT` (with at most 19 digits before it, below 1e308: every number the
  bound lets through is a finite float64).

The automaton does not know the schema: an ``integer`` and a ``number`` written without a
fraction look alike, so such a number may take an integer's 19 digits. A schema that asks
for less keeps its own bound (a ``maximum``, an integer range). No keyword asks for more;
only a schema that leaves no shorter way does (a ``const`` or an ``enum`` of a longer
number, a ``minimum`` of 1e25): where the bound would leave no token the grammar allows, it
steps aside for that step.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import numpy as np
import torch

MAX_INTEGER_DIGITS = 19
MAX_FRACTION_DIGITS = 17
MAX_EXPONENT_DIGITS = 3
MAX_EXPONENT = 289

# A state: (mode, n, value). In a number's integer part or fraction, n counts its digits;
# in its exponent, n counts the exponent's digits and value is the exponent. Both saturate
# one past their bound, so that the states stay few where a schema's longer number is let
# through.
State = tuple[int, int, int]
OUT, STRING, ESCAPE, INTEGER, FRACTION, EXPONENT = range(6)
START: State = (OUT, 0, 0)
_IN_STRING: State = (STRING, 0, 0)
_QUOTE, _BACKSLASH, _MINUS, _DOT = b'"\\-.'
_DIGIT_0, _DIGIT_9 = b"09"
_E = frozenset(b"eE")
_SIGNS = frozenset(b"+-")
# Only a digit or a dot can take a number past its bound: the tokens without one never do.
_MAY_BREAK = re.compile(rb"[0-9.]")


def step(state: State, c: int) -> tuple[State, bool]:
    """The state after byte ``c``, and whether the number it writes is still within bounds."""
    mode, n, value = state
    if mode == STRING:
        return ((ESCAPE if c == _BACKSLASH else OUT if c == _QUOTE else STRING), 0, 0), True
    if mode == ESCAPE:
        return _IN_STRING, True
    if _DIGIT_0 <= c <= _DIGIT_9:
        return _digit(mode, n, value, c - _DIGIT_0)
    if mode == INTEGER and c == _DOT:  # a fraction needs room for one digit at least
        return (FRACTION, n, 0), n < MAX_FRACTION_DIGITS
    if mode in (INTEGER, FRACTION) and c in _E:
        return (EXPONENT, 0, 0), True
    if mode == EXPONENT and n == 0 and c in _SIGNS:
        return state, True
    # Outside a number, or at the byte that ends one.
    if c == _QUOTE:
        return _IN_STRING, True
    return ((INTEGER, 0, 0) if c == _MINUS else START), True


def _digit(mode: int, n: int, value: int, d: int) -> tuple[State, bool]:
    if mode == INTEGER:
        return (INTEGER, min(n + 1, MAX_INTEGER_DIGITS + 1), 0), n < MAX_INTEGER_DIGITS
    if mode == FRACTION:
        return (FRACTION, min(n + 1, MAX_FRACTION_DIGITS + 1), 0), n < MAX_FRACTION_DIGITS
    if mode == EXPONENT:
        value = min(value * 10 + d, MAX_EXPONENT + 1)
        ok = n < MAX_EXPONENT_DIGITS and value <= MAX_EXPONENT
        return (EXPONENT, min(n + 1, MAX_EXPONENT_DIGITS + 1), value), ok
    return (INTEGER, 1, 0), True  # a number's first digit


def run(state: State, text: bytes) -> tuple[State, bool]:
    """The state after ``text``, and whether its numbers all stayed within bounds."""
    ok = True
    for c in text:
        state, within = step(state, c)
        ok = ok and within
    return state, ok


class NumberBound:
    """The bound for one vocabulary: which tokens each state leaves out, as a bitmask in
    the engine's layout (bit ``t % 32`` of int32 word ``t // 32`` set: token ``t`` may
    follow), computed the first time a state is met and kept: a few hundred states at
    most, each a pass over the vocabulary's few hundred tokens with a digit or a dot
    (milliseconds)."""

    def __init__(self, vocab_size: int, token_bytes: Callable[[int], bytes]) -> None:
        self.words = (vocab_size + 31) // 32
        self.token_bytes = token_bytes
        texts = ((t, token_bytes(t)) for t in range(vocab_size))
        self._breakers = [(t, b) for t, b in texts if _MAY_BREAK.search(b)]
        self._keep: dict[State, torch.Tensor | None] = {}

    def advance(self, state: State, token_id: int) -> tuple[State, bool]:
        return run(state, self.token_bytes(token_id))

    def keep(self, state: State) -> torch.Tensor | None:
        """The mask of the tokens that may follow ``state`` within bounds; None: all may."""
        if state not in self._keep:  # a race computes it twice, to the same value
            self._keep[state] = self._mask([t for t, b in self._breakers if not run(state, b)[1]])
        return self._keep[state]

    def _mask(self, refused: Sequence[int]) -> torch.Tensor | None:
        if not refused:
            return None
        bits = np.ones(self.words * 32, dtype=bool)
        bits[list(refused)] = False
        return torch.from_numpy(np.packbits(bits, bitorder="little").view(np.int32))
