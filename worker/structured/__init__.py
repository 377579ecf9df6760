"""Structured outputs: JSON schemas, JSON mode and tool calls, as grammars that mask the
sampler (:mod:`hotpool.worker.structured.grammar`)."""
