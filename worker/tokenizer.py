"""Text <-> token ids for a snapshot: ``tokenizer.json``, its config and chat template."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from hotpool.worker.protocol import ChatMessage


class TemplateError(ValueError):
    """The chat template could not render these messages."""


class TextTokenizer:
    def __init__(self, snapshot_dir: Path) -> None:
        self._tok = Tokenizer.from_file(str(snapshot_dir / "tokenizer.json"))
        cfg_path = snapshot_dir / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        self.bos_token: str | None = _token_str(cfg.get("bos_token"))
        self.eos_token: str | None = _token_str(cfg.get("eos_token"))
        self.add_bos = bool(cfg.get("add_bos_token", False))
        template = cfg.get("chat_template")
        # Templates are user-supplied code: render them in Jinja's sandbox.
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        self._template = env.from_string(template) if template else None

    @property
    def eos_token_ids(self) -> frozenset[int]:
        ids = {self._tok.token_to_id(t) for t in (self.eos_token,) if t}
        return frozenset(i for i in ids if i is not None)

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def encode(self, text: str) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        bos = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        if self.add_bos and bos is not None and (not ids or ids[0] != bos):
            ids.insert(0, bos)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def apply_chat_template(self, messages: Sequence[ChatMessage]) -> str:
        if self._template is None:
            raise TemplateError("this model has no chat template; use /v1/completions")
        try:
            return self._template.render(
                messages=[{"role": m.role, "content": m.content} for m in messages],
                add_generation_prompt=True,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except Exception as exc:
            raise TemplateError(f"chat template failed: {exc}") from exc


def _token_str(value: object) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", ...} form
        value = value.get("content")
    return value if isinstance(value, str) else None


def _raise(message: str) -> None:
    raise TemplateError(message)
