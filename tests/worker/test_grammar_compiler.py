"""The structured-output compiler over a small word-level tokenizer: what masks allow, the
bounded compile cache (one compile per schema, even when requests race for it), strict
objects, and errors that say where."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from hotpool.worker.engine.grammar import token_bitmask
from hotpool.worker.structured.grammar import GrammarCompiler, GrammarError, closed_objects

# A byte-level tokenizer of single characters, so that a schema's documents can be spelled
# and masks read as sets of characters.
PIECES = [*'{}[]",:0123456789-.abcdefghijklmnopqrstuvwxyz', "</s>"]
EOS = len(PIECES) - 1


def _tokenizer_json() -> str:
    vocab = {p: i for i, p in enumerate(PIECES[:-1])}
    tok = Tokenizer(models.BPE(vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("</s>", special=True)])
    return tok.to_str()


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(_tokenizer_json(), len(PIECES), [EOS], cache_size=2)


def _schema(schema: object, strict: bool = True) -> str:
    return json.dumps({"type": "json_schema", "schema": schema, "strict": strict})


def _allowed(m: object, vocab: int = len(PIECES)) -> set[str]:
    mask = token_bitmask([(m, 0)], 1, vocab)  # type: ignore[list-item]
    bits = (mask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return {PIECES[i] for i in bits.flatten()[:vocab].nonzero().flatten().tolist()}


def test_masks_follow_the_schema_to_its_end(compiler: GrammarCompiler) -> None:
    m = compiler.matcher(_schema({"enum": ["ab", "ba"]}))
    assert _allowed(m) == {'"'}
    for piece in '"a':
        assert m.accept(PIECES.index(piece))
    assert _allowed(m) == {"b"}  # "ab" is the only enum value starting with a
    for piece in 'b"':
        assert m.accept(PIECES.index(piece))
    assert m.is_terminated  # nothing may follow: the engine ends the request here
    n = compiler.matcher(_schema({"type": "integer"}))
    assert n.accept(PIECES.index("7")) and not n.is_terminated
    assert _allowed(n) == {*"0123456789", "</s>"}  # more digits, or the end
    assert n.accept(EOS) and n.is_terminated
    assert not compiler.matcher(_schema({"enum": ["ab"]})).accept(PIECES.index("{"))


def test_one_compile_per_schema_even_when_requests_race(compiler: GrammarCompiler) -> None:
    schema = _schema({"type": "object", "properties": {"n": {"type": "integer"}}})
    before = compiler.compiles
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda _: compiler.matcher(schema), range(16)))
    assert compiler.compiles == before + 1
    compiler.matcher(_schema({"type": "string"}))
    compiler.matcher(_schema({"type": "boolean"}))  # the cache holds two: the first is out
    compiler.matcher(schema)
    assert compiler.compiles == before + 4


def test_strict_objects_take_no_keys_they_do_not_name(compiler: GrammarCompiler) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {}}}}
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["a"]["additionalProperties"] is False
    m = compiler.matcher(_schema(schema))
    assert m.accept(PIECES.index("{")) and _allowed(m) == {'"', "}"}
    for piece in '"':
        m.accept(PIECES.index(piece))
    assert _allowed(m) == {"a"}  # strict: the only key is a
    lax = compiler.matcher(_schema(schema, strict=False))
    lax.accept(PIECES.index("{"))
    lax.accept(PIECES.index('"'))
    assert len(_allowed(lax)) > 10  # JSON Schema's default: any other key too


def test_errors_name_the_schema_path(compiler: GrammarCompiler) -> None:
    bad = {"type": "object", "properties": {"a": {"type": "array", "items": {"not": {}}}}}
    with pytest.raises(GrammarError, match=r"schema\.properties\.a\.items` is not supported"):
        compiler.matcher(_schema(bad))
    with pytest.raises(GrammarError, match="Pointer"):
        compiler.matcher(_schema({"$ref": "#/nowhere"}))
    with pytest.raises(GrammarError, match="malformed constraint"):
        compiler.matcher("{not json")
