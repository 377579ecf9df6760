"""The structured-output compiler over a small word-level tokenizer: what masks allow, the
bounded compile cache (one compile per schema, even when requests race for it), strict
objects and tools' closed arguments, numbers bounded to what int64 and float64 hold, and
errors that say where."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from hotpool.worker.engine.grammar import token_bitmask
from hotpool.worker.structured.grammar import GrammarCompiler, GrammarError, closed_objects
from hotpool.worker.structured.tools import tool_constraint

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


def test_an_object_spread_over_parts_keeps_the_keys_each_part_names(
    compiler: GrammarCompiler,
) -> None:
    """The engine intersects an object's parts: closing each part of an ``allOf`` would
    leave only ``{}``, and a closed ``anyOf`` branch would refuse the keys beside it."""
    a, b = {"properties": {"a": {"type": "integer"}}}, {"properties": {"b": {"type": "integer"}}}
    assert _accepts(compiler, {"type": "object", "allOf": [a, b]}, '{"a":1,"b":2}')
    beside = {"type": "object", "properties": {"k": {"type": "integer"}}, "anyOf": [a, b]}
    assert _accepts(compiler, beside, '{"k":1,"a":2}')
    alone = {"anyOf": [{"type": "object", **a}, {"type": "object", **b}]}
    assert not _accepts(compiler, alone, '{"a":1,"b":2}')  # each branch whole: closed


def test_tool_arguments_are_closed_unless_their_schema_opens_them(
    compiler: GrammarCompiler,
) -> None:
    """Strict or not, a tool's arguments take the keys its schema names: they become the
    function's keyword arguments. ``additionalProperties`` (true or a schema) opens them."""

    def call(parameters: dict[str, object], arguments: str) -> bool:
        tool = {"type": "function", "function": {"name": "weather", "parameters": parameters}}
        m = compiler.matcher(tool_constraint([tool], "weather", False, "llama3_json") or "")
        text = '{"name":"weather","parameters":' + arguments + "}"
        return all(m.accept(PIECES.index(piece)) for piece in text) and m.accept(EOS)

    city = {"type": "object", "properties": {"city": {"type": "string"}}}
    nested = {"type": "object", "properties": {"at": city}}
    assert call(city, '{"city":"paris"}') and call(city, "{}")
    assert not call(city, '{"city":"paris","days":2}')
    assert not call(nested, '{"at":{"city":"paris","x":1}}')  # nested objects too
    assert call({**city, "additionalProperties": True}, '{"city":"paris","days":2}')
    assert call({**city, "additionalProperties": {"type": "integer"}}, '{"days":2}')


def test_errors_name_the_schema_path(compiler: GrammarCompiler) -> None:
    bad = {"type": "object", "properties": {"a": {"type": "array", "items": {"not": {}}}}}
    with pytest.raises(GrammarError, match=r"schema\.properties\.a\.items` is not supported"):
        compiler.matcher(_schema(bad))
    with pytest.raises(GrammarError, match="Pointer"):
        compiler.matcher(_schema({"$ref": "#/nowhere"}))
    with pytest.raises(GrammarError, match="malformed constraint"):
        compiler.matcher("{not json")


def _accepts(compiler: GrammarCompiler, schema: object, text: str) -> bool:
    """Whether the grammar of ``schema`` lets ``text`` through whole, and then an EOS."""
    m = compiler.matcher(_schema(schema))
    return all(m.accept(PIECES.index(piece)) for piece in text) and m.accept(EOS)


def test_numbers_stop_at_what_int64_and_float64_hold(compiler: GrammarCompiler) -> None:
    integer, number = {"type": "integer"}, {"type": "number"}
    assert _accepts(compiler, integer, "-1234567890123456789")  # 19 digits: int64's width
    assert not _accepts(compiler, integer, "12345678901234567890")
    m = compiler.matcher(_schema(integer))
    for piece in "1234567890123456789":
        m.accept(PIECES.index(piece))
    assert _allowed(m) == {"</s>"}  # the mask ends it: no 20th digit
    for ordinary in ("0", "-12.5", "3.14159", "1e10", "59.999", "6.02e23", "1.6e-19"):
        assert _accepts(compiler, number, ordinary), ordinary
    assert _accepts(compiler, number, "1.2345678901234567")  # 17 digits: float64's precision
    assert not _accepts(compiler, number, "1.23456789012345678")
    assert not _accepts(compiler, number, "0.00000000000000000")  # zeros count: none forever
    assert _accepts(compiler, number, "1e289") and not _accepts(compiler, number, "1e290")
    assert not _accepts(compiler, number, "1e0001")  # at most 3 exponent digits
    bounded = {"type": "number", "minimum": -60, "maximum": 60}
    assert _accepts(compiler, bounded, "-59.999999999999999")
    assert not _accepts(compiler, bounded, "59.9999999999999999")
    # Digits in strings are text: unbounded, as a string's maxLength says.
    assert _accepts(compiler, {"type": "string"}, '"' + "7" * 40 + '"')


def test_a_schema_that_names_a_longer_number_still_gets_it(compiler: GrammarCompiler) -> None:
    """The bound steps aside where the grammar allows nothing shorter: no keyword asks for
    more digits, but a ``const`` or an ``enum`` leaves no choice."""
    tiny = "0." + "0" * 299 + "1"  # 1e-300 as the grammar engine spells it
    assert _accepts(compiler, {"const": 1e-300}, tiny)
    assert _accepts(compiler, {"enum": [1e-300, 5]}, tiny)
    assert not _accepts(compiler, {"type": "number"}, tiny)
