"""The shell commands of README.md's ```bash blocks, as a user would paste them."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
_BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)


@dataclass(frozen=True)
class Command:
    line: int  # where it starts in README.md
    text: str  # as written, continuation lines joined, the trailing comment dropped

    @property
    def words(self) -> list[str]:
        return shlex.split(self.text)

    @property
    def env(self) -> dict[str, str]:
        """The ``NAME=value`` assignments it starts with."""
        found = {}
        for word in self.words:
            name, eq, value = word.partition("=")
            if not eq or not re.fullmatch(r"[A-Z_][A-Z0-9_]*", name):
                break
            found[name] = value
        return found

    @property
    def argv(self) -> list[str]:
        return self.words[len(self.env) :]


def blocks(language: str = "bash") -> list[tuple[int, str]]:
    """Each fenced block of ``language``: the line it starts on and its text."""
    text = README.read_text()
    return [
        (text[: m.start()].count("\n") + 2, m.group(2))
        for m in _BLOCK.finditer(text)
        if m.group(1) == language
    ]


def commands() -> list[Command]:
    """Every command of every bash block, in order; a quote left open runs on to the lines
    after it (a JSON body over several lines), as in a shell."""
    found = []
    for start, body in blocks():
        pending: list[str] = []
        first = start
        for offset, line in enumerate(body.splitlines()):
            if not pending:
                first = start + offset
            pending.append(line)
            joined = "\n".join(pending)
            try:
                shlex.split(joined, comments=True)
            except ValueError:  # a quote still open
                continue
            pending = []
            text = _without_comment(joined)
            if text:
                found.append(Command(first, text))
    return found


def _without_comment(text: str) -> str:
    """``text`` without its trailing ``  # ...`` comment, stripped."""
    head, sep, _ = text.rpartition("  # ")
    if sep and shlex.split(head) == shlex.split(text, comments=True):
        return head.strip()
    return text.strip()
