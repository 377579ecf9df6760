"""What a model's publisher ships beside its weights that its GGUF may lack."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ChatSettings:
    """The chat template (replacing the GGUF's own, if any) and the tokens that end a reply
    besides the GGUF's EOS (Gemma's ``<end_of_turn>``), for ``generation_config.json``."""

    chat_template: str | None = None
    eos_tokens: tuple[str, ...] = ()
