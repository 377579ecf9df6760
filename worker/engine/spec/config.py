"""How a deployment speculates: which proposer, how many tokens, and when it stops.

``SpeculativeConfig`` is the engine's half of a deployment's ``speculative`` option (the
control plane validates the user's JSON into it; the worker loads a draft model's weights).
``SpecSwitch`` is the automatic off switch: verifying k proposals costs k more positions in
the forward pass, nearly free while a step is bound by reading the weights (few
sequences) and a plain loss once the batch makes it compute-bound (vLLM users report
throughput losses at high batch; ``benchmarks/bench_spec.py`` measures the crossover here).
Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from hotpool.worker.engine.spec.ngram import NgramConfig

SpecMethod = Literal["ngram", "draft"]
SPEC_METHODS: tuple[SpecMethod, ...] = ("ngram", "draft")
MAX_SPEC_TOKENS = 16  # k beyond this verifies mostly rejected positions
# Speculation is on while at most this many requests decode in a step. Measured with
# benchmarks/bench_spec.py on SmolLM2 (fp32, 2 AVX2 cores): n-gram speculation at k = 4 wins
# at 1-4 decoding sequences and loses from 8 on, where a step's cost grows with its tokens.
DEFAULT_MAX_BATCH = 4


@dataclass(frozen=True)
class SpeculativeConfig:
    method: SpecMethod = "ngram"
    num_tokens: int = 4  # k: tokens proposed per request and step
    # The automatic switch: off while more than ``max_batch`` requests decode in a step, on
    # again once at most ``max_batch // 2`` do (a gap, so a batch size on the edge does not
    # flip it every step). 0 keeps it on at every batch size.
    max_batch: int = DEFAULT_MAX_BATCH
    ngram: NgramConfig = field(default_factory=NgramConfig)
    draft_snapshot: str | None = None  # method "draft": the draft model's snapshot URI

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            known = ", ".join(SPEC_METHODS)
            raise ValueError(f"method must be one of {known}, got {self.method!r}")
        if not 1 <= self.num_tokens <= MAX_SPEC_TOKENS:
            raise ValueError(f"num_tokens must be in [1, {MAX_SPEC_TOKENS}], got {self.num_tokens}")
        if self.max_batch < 0:
            raise ValueError(f"max_batch must be >= 0, got {self.max_batch}")
        if (self.method == "draft") != (self.draft_snapshot is not None):
            raise ValueError(
                "draft_snapshot is required with method 'draft'"
                if self.method == "draft"
                else "draft_snapshot goes only with method 'draft'"
            )

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "method": self.method,
            "num_tokens": self.num_tokens,
            "max_batch": self.max_batch,
        }
        if self.method == "ngram":
            out["ngram"] = {"min_n": self.ngram.min_n, "max_n": self.ngram.max_n}
        if self.draft_snapshot is not None:
            out["draft_snapshot"] = self.draft_snapshot
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SpeculativeConfig:
        """The config from its JSON form; ValueError naming the field that is wrong."""
        if not isinstance(data, dict):
            raise ValueError("speculative must be an object")
        known = {"method", "num_tokens", "max_batch", "ngram", "draft_snapshot"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"unknown field(s) in speculative: {', '.join(unknown)} "
                f"(known: {', '.join(sorted(known))})"
            )
        for name in ("num_tokens", "max_batch"):
            if name in data and (type(data[name]) is not int):
                raise ValueError(f"speculative.{name} must be an integer")
        for name in ("method", "draft_snapshot"):
            if data.get(name) is not None and not isinstance(data[name], str):
                raise ValueError(f"speculative.{name} must be a string")
        ngram = data.get("ngram") or {}
        if not isinstance(ngram, dict) or set(ngram) - {"min_n", "max_n"}:
            raise ValueError("speculative.ngram must be an object with min_n and/or max_n")
        if any(type(v) is not int for v in ngram.values()):
            raise ValueError("speculative.ngram.min_n and max_n must be integers")
        try:
            return cls(
                method=data.get("method", "ngram"),
                num_tokens=data.get("num_tokens", 4),
                max_batch=data.get("max_batch", DEFAULT_MAX_BATCH),
                ngram=NgramConfig(**ngram),
                draft_snapshot=data.get("draft_snapshot"),
            )
        except ValueError as exc:
            raise ValueError(f"speculative: {exc}") from None


class SpecSwitch:
    """On or off for the next step, from how many requests decode in it (see the module)."""

    def __init__(self, max_batch: int) -> None:
        self.max_batch = max_batch
        self.on = True
        self.num_switches = 0  # times it turned off or on: a flapping switch shows here

    def update(self, num_decoding: int) -> bool:
        if self.max_batch <= 0:
            return True
        was = self.on
        if self.on and num_decoding > self.max_batch:
            self.on = False
        elif not self.on and num_decoding <= max(1, self.max_batch // 2):
            self.on = True
        self.num_switches += was != self.on
        return self.on
