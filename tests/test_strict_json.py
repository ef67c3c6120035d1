"""The strict JSON rules of :mod:`agentkeep.strict_json`, shared by every store.

* each refusal (NaN and infinities, out-of-range floats, repeated keys, lone
  surrogates raw or escaped, nesting deeper than 128, bad UTF-8, bad syntax)
  raises :class:`JsonError` of its kind, naming the position or the item;
* the edge cases that must pass: nesting exactly 128 deep, brackets inside
  strings, large integers, escaped surrogate pairs, non-ASCII text;
* the relaxed decoders of the runs codec (last-wins, marked duplicates);
* the canonical encoder, :func:`dumps` and :func:`json_value_problem`;
* properties: canonical text round-trips through the strict decoder, and the
  text-based depth check agrees with the nesting of the decoded value;
* the two renderings of one decoder: the runtime's ``load_object`` texts and
  the legacy loader's serde texts;
* the old names other modules import still point at the single definitions.
"""

from __future__ import annotations

import json
import math
import pickle
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentkeep.strict_json import (
    JSON_MAX_DEPTH,
    DuplicateKeys,
    JsonError,
    canonical_bytes,
    canonical_json,
    dumps,
    has_lone_surrogate,
    json_value_problem,
    loads,
    loads_marking_duplicates,
)


def _refused(data: str | bytes, kind: str, **kw: Any) -> JsonError:
    with pytest.raises(JsonError) as info:
        loads(data, **kw)
    assert info.value.kind == kind, info.value
    assert isinstance(info.value, ValueError)
    return info.value


def _nested(depth: int, inner: str = "0") -> str:
    return "[" * depth + inner + "]" * depth


def _nested_objects(depth: int) -> str:
    return '{"k":' * depth + "0" + "}" * depth


# --------------------------------------------------------------------------
# Refusals


@pytest.mark.parametrize(
    ("text", "what"),
    [("NaN", "NaN"), ("[Infinity]", "Infinity"), ('{"a":-Infinity}', "-Infinity")],
)
def test_non_finite_constants_are_refused(text: str, what: str) -> None:
    err = _refused(text, "constant")
    assert err.what == what
    assert str(err) == f"{what} is not valid JSON"


@pytest.mark.parametrize("text", ["1e999", "[-1e400]", '{"a":' + "9" * 400 + ".0}"])
def test_floats_out_of_range_are_refused(text: str) -> None:
    err = _refused(text, "number")
    assert "out of range" in str(err)


def test_integer_beyond_the_digit_limit_is_refused() -> None:
    _refused("1" + "0" * 5000, "number")


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ('{"a":1,"a":2}', "a"),
        ('{"x":{"b":1,"c":2,"b":3}}', "b"),
        ('[{"ü":1,"ü":1}]', "ü"),
    ],
)
def test_repeated_keys_are_refused(text: str, key: str) -> None:
    err = _refused(text, "duplicate_key")
    assert err.what == key
    assert str(err) == f"duplicate JSON key {key!r}"


@pytest.mark.parametrize(
    "text",
    [
        '"\\ud800"',  # a leading surrogate alone
        '"\\uDC00x"',  # a trailing surrogate alone (upper-case hex)
        '"a\\ude00\\ud83d"',  # a pair in the wrong order
        '"\\ud800\\u0041"',  # a leading surrogate followed by a non-surrogate escape
        '{"\\udbff":1}',  # in a key
        '["ok", {"deep": ["\\udfff"]}]',
        '"\ud800"',  # raw (only a Python str can carry one)
    ],
)
def test_lone_surrogates_are_refused(text: str) -> None:
    err = _refused(text, "surrogate")
    assert err.what is not None and has_lone_surrogate(err.what)
    assert "lone UTF-16 surrogate" in str(err)


def test_escaped_surrogate_in_bytes_is_refused() -> None:
    _refused(b'["\\ud800"]', "surrogate")


@pytest.mark.parametrize(
    "text",
    [
        _nested(JSON_MAX_DEPTH + 1),
        _nested_objects(JSON_MAX_DEPTH + 1),
        '{"a":' * 64 + _nested(65) + "}" * 64,
        _nested(5000),  # deeper than Python's own recursion limit
        # Brackets in strings cannot hide depth: the outer array is level 1.
        '["' + "]" * 200 + '",' + _nested(JSON_MAX_DEPTH) + ',"' + "[" * 200 + '"]',
    ],
)
def test_nesting_deeper_than_128_is_refused(text: str) -> None:
    err = _refused(text, "depth")
    assert str(err) == f"nested deeper than {JSON_MAX_DEPTH} levels"
    _refused(text.encode(), "depth")


def test_max_depth_is_a_parameter() -> None:
    assert loads(_nested(130), max_depth=130) == json.loads(_nested(130))
    _refused(_nested(131), "depth", max_depth=130)
    _refused(_nested(3), "depth", max_depth=2)
    assert loads(_nested(2), max_depth=2) == [[0]]


def test_invalid_utf8_is_refused_with_its_byte_offset() -> None:
    err = _refused(b'"ab\xff"', "utf8")
    assert err.pos == 3
    assert "can't decode byte 0xff" in str(err)
    _refused(b'"\xed\xa0\x80"', "utf8")  # an encoded surrogate is not UTF-8


@pytest.mark.parametrize(
    ("text", "pos"),
    [("", 0), ("[1,]", 3), ('{"a" 1}', 5), ("[1] x", 4), ("\ufeff1", 0), ('"a\nb"', 2)],
)
def test_syntax_errors_name_the_position(text: str, pos: int) -> None:
    err = _refused(text, "syntax")
    assert err.pos == pos
    assert "line 1 column" in str(err) or "line 2 column" in str(err)


def test_a_bom_is_not_json() -> None:
    _refused(b"\xef\xbb\xbf{}", "syntax")


def test_error_pickles() -> None:
    err = _refused('{"a":1,"a":2}', "duplicate_key")
    back = pickle.loads(pickle.dumps(err))
    assert (back.kind, back.message, back.what, back.pos) == (
        "duplicate_key",
        err.message,
        "a",
        None,
    )


# --------------------------------------------------------------------------
# Accepted edge cases


def test_nesting_exactly_128_passes() -> None:
    assert loads(_nested(JSON_MAX_DEPTH)) == json.loads(_nested(JSON_MAX_DEPTH))
    assert loads(_nested_objects(JSON_MAX_DEPTH).encode()) == json.loads(
        _nested_objects(JSON_MAX_DEPTH)
    )
    mixed = '{"a":' * 64 + _nested(64) + "}" * 64
    assert loads(mixed) == json.loads(mixed)


def test_brackets_and_escapes_inside_strings_do_not_count_as_nesting() -> None:
    texts = [
        '["' + "[" * 300 + '"]',
        '["\\"' + "{" * 300 + '"]',
        _nested(JSON_MAX_DEPTH - 1, '"\\\\' + "[" * 200 + '\\\\"'),
        _nested(JSON_MAX_DEPTH - 1, '"é' + "]" * 200 + '"'),
    ]
    for text in texts:
        assert loads(text) == json.loads(text)
        assert loads(text.encode()) == json.loads(text)


def test_many_shallow_containers_pass() -> None:
    text = "[" + ",".join('{"a":[1,{"b":null}]}' for _ in range(1000)) + "]"
    assert len(loads(text)) == 1000


@pytest.mark.parametrize("n", [2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63) - 1, 10**100])
def test_large_integers_are_kept_exactly(n: int) -> None:
    value = loads(f'{{"n":{n}}}')
    assert value == {"n": n} and type(value["n"]) is int


def test_escaped_surrogate_pairs_are_one_character() -> None:
    assert loads('"\\ud83d\\ude00"') == "\U0001f600"
    assert loads(b'{"\\uD83D\\uDE00":"\\udbff\\udfff"}') == {"\U0001f600": "\U0010ffff"}


def test_an_escaped_backslash_before_u_is_plain_text() -> None:
    assert loads('"\\\\ud800"') == "\\ud800"


def test_non_ascii_text_passes_raw_and_escaped() -> None:
    assert loads('{"ключ":"値 ✓ é\U0001f600"}') == {"ключ": "値 ✓ é\U0001f600"}
    assert loads('{"ключ":"値"}'.encode()) == {"ключ": "値"}
    assert loads('"\\u00e9\\u2028"') == "é\u2028"


def test_bytes_like_inputs() -> None:
    assert loads(bytearray(b"[1]")) == [1]
    assert loads(memoryview(b'{"a":true}')) == {"a": True}


def test_floats_and_negative_zero() -> None:
    assert loads("[1.5,-0.0,1e308,5e-324]") == [1.5, -0.0, 1e308, 5e-324]
    assert math.copysign(1.0, loads("-0.0")) == -1.0


# --------------------------------------------------------------------------
# Relaxed decoders of the serde-shaped runs codec


def test_duplicate_keys_last_keeps_the_last_value() -> None:
    assert loads('{"a":1,"a":2}', duplicate_keys="last") == {"a": 2}
    # every other rule still holds
    _refused('{"a":NaN}', "constant", duplicate_keys="last")
    _refused('"\\ud800"', "surrogate", duplicate_keys="last")


def test_marking_decoder_marks_only_objects_with_repeats() -> None:
    value, seen = loads_marking_duplicates('{"a":{"b":1,"b":2,"b":3},"c":{"d":1}}')
    assert seen is True
    assert type(value) is dict and type(value["c"]) is dict
    inner = value["a"]
    assert type(inner) is DuplicateKeys and inner == {"b": 3}
    assert inner.duplicates == ["b", "b"]
    value, seen = loads_marking_duplicates('[{"a":1}]')
    assert (value, seen) == ([{"a": 1}], False)
    with pytest.raises(JsonError) as info:
        loads_marking_duplicates(_nested(4), max_depth=3)
    assert info.value.kind == "depth"


# --------------------------------------------------------------------------
# Encoding and the value check


def test_canonical_json_is_sorted_compact_and_keeps_utf8() -> None:
    value = {"b": [1, 2.5, None, True], "a": {"é": "✓"}, "c": (1, "x")}
    assert canonical_json(value) == '{"a":{"é":"✓"},"b":[1,2.5,null,true],"c":[1,"x"]}'
    assert canonical_bytes(value) == canonical_json(value).encode("utf-8")


@pytest.mark.parametrize(
    "value",
    [
        float("nan"),
        [float("inf")],
        {1: "a"},
        {"a": {None: 1}},
        {1, 2},
        b"x",
        "\ud800",
        {"\udc00": 1},
        json.loads(_nested(JSON_MAX_DEPTH + 1)),
    ],
)
def test_canonical_json_refuses_non_json_values(value: object) -> None:
    with pytest.raises(JsonError) as info:
        canonical_json(value)
    assert info.value.kind == "value"
    assert str(info.value) == json_value_problem(value)


def test_json_value_problem_depth() -> None:
    assert json_value_problem(json.loads(_nested(JSON_MAX_DEPTH))) is None
    assert json_value_problem(json.loads(_nested(JSON_MAX_DEPTH + 1))) == (
        f"nested deeper than {JSON_MAX_DEPTH} levels"
    )


def test_dumps_keeps_order_on_request_and_refuses_what_json_cannot_store() -> None:
    assert dumps({"b": 1, "a": 2}, sort_keys=False) == '{"b":1,"a":2}'
    assert dumps({"b": 1, "a": 2}) == '{"a":2,"b":1}'
    for bad, kind in [(float("nan"), "value"), (object(), "value"), (["\ud800"], "surrogate")]:
        with pytest.raises(JsonError) as info:
            dumps(bad)
        assert info.value.kind == kind
    circular: list[Any] = []
    circular.append(circular)
    with pytest.raises(JsonError):
        dumps(circular)


# --------------------------------------------------------------------------
# Properties

_json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text()
)
_json_values = st.recursive(
    _json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=30,
)


def _same(a: object, b: object) -> bool:
    """Equality that also compares types (``1`` is not ``1.0``) through containers."""
    if type(a) is not type(b):
        return False
    if isinstance(a, list):
        assert isinstance(b, list)
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        assert isinstance(b, dict)
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


@settings(max_examples=300, deadline=None)
@given(_json_values)
def test_canonical_text_round_trips_through_the_strict_decoder(value: Any) -> None:
    text = canonical_json(value)
    back = loads(text)
    assert _same(back, value)
    assert _same(loads(canonical_bytes(value)), value)
    assert canonical_json(back) == text  # canonical text is a fixed point
    # the encoder built once is json's own, with the canonical options
    assert text == json.dumps(
        value, ensure_ascii=False, allow_nan=False, sort_keys=True, separators=(",", ":")
    )


def _depth(value: object) -> int:
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    return 0


_tricky_text = st.text(alphabet='[]{}"\\aé', max_size=3)
_level = st.tuples(st.booleans(), _tricky_text, _tricky_text)


def _build_nested(levels: list[tuple[bool, str, str]]) -> Any:
    """Nest one container per level, with strings full of brackets around each."""
    value: Any = "leaf"
    for as_list, before, after in levels:
        value = [before, value, after] if as_list else {before: value, "x" + after: after}
    return value


@settings(max_examples=60, deadline=None)
@given(
    st.lists(_level, min_size=JSON_MAX_DEPTH - 2, max_size=JSON_MAX_DEPTH + 2),
    st.booleans(),
    st.booleans(),
)
def test_the_depth_check_agrees_with_the_decoded_nesting(
    levels: list[tuple[bool, str, str]], ensure_ascii: bool, as_bytes: bool
) -> None:
    value = _build_nested(levels)
    text = json.dumps(value, ensure_ascii=ensure_ascii)
    data: str | bytes = text.encode() if as_bytes else text
    if _depth(value) <= JSON_MAX_DEPTH:
        assert loads(data) == value
    else:
        _refused(data, "depth")


# --------------------------------------------------------------------------
# One decoder, two renderings


def test_runtime_load_object_texts() -> None:
    from agentkeep.runtime.session_model import DecodeProblem, load_object

    cases = {
        b"\xff": "session is not UTF-8 JSON: 'utf-8' codec can't decode byte 0xff",
        b"{": "session is not UTF-8 JSON: Expecting property name",
        b'{"a":1,"a":2}': "duplicate JSON key 'a'",
        b'{"a":NaN}': "session is not strict JSON: NaN is not valid JSON",
        b'{"a":"\\ud800"}': "session is not strict JSON: a string contains a lone UTF-16",
        _nested_objects(JSON_MAX_DEPTH + 1).encode(): "session is not strict JSON: nested deeper",
    }
    for data, text in cases.items():
        with pytest.raises(DecodeProblem) as info:
            load_object(data, "session")
        assert str(info.value).startswith(text), info.value


def test_legacy_loader_renders_serde_texts() -> None:
    from agentkeep.legacy.shapes import DecodeProblem, LegacyReceipt, decode_strict

    cases = {
        b"\xff": "not UTF-8 JSON: 'utf-8' codec can't decode byte 0xff in position 0",
        b"[1,]": "not UTF-8 JSON: Expecting value: line 1 column 4 (char 3)",
        b'{"run_id":1,"run_id":2}': "duplicate field `run_id`",
        b'{"sequence":NaN}': "expected value",
        b'{"sequence":1e999}': "number out of range",
        b'{"run_id":"\\udc00"}': "lone leading surrogate in hex escape",
        _nested_objects(JSON_MAX_DEPTH + 1).encode(): "recursion limit exceeded",
    }
    for data, text in cases.items():
        with pytest.raises(DecodeProblem) as info:
            decode_strict(LegacyReceipt, data)
        assert str(info.value).startswith(text), info.value


# --------------------------------------------------------------------------
# Old names


def test_old_names_are_the_single_definitions() -> None:
    from agentkeep import strict_json
    from agentkeep.runs import domain as runs_domain
    from agentkeep.runtime import session_model
    from agentkeep.sessions import codec as sessions_codec
    from agentkeep.sessions import domain as sessions_domain

    assert runs_domain.JSON_MAX_DEPTH == JSON_MAX_DEPTH == 128
    assert runs_domain.json_value_problem is json_value_problem
    assert sessions_codec.loads is strict_json.loads
    assert session_model.canonical_bytes is strict_json.canonical_bytes
    assert sessions_domain.check_json(["ok"], "f") == ["ok"]


def _reference_problem(value: object, depth: int = 0) -> str | None:
    """The value check as one plain recursive walk (the rule :func:`json_value_problem` keeps)."""
    if value is None or isinstance(value, bool | int):
        return None
    if isinstance(value, str):
        return "a string contains a lone UTF-16 surrogate" if has_lone_surrogate(value) else None
    if isinstance(value, float):
        return None if math.isfinite(value) else f"{value!r} is not a JSON number"
    if isinstance(value, list | tuple | dict):
        if depth >= JSON_MAX_DEPTH:
            return f"nested deeper than {JSON_MAX_DEPTH} levels"
        if not isinstance(value, dict):
            return next((p for p in (_reference_problem(v, depth + 1) for v in value) if p), None)
        for key, item in value.items():
            if not isinstance(key, str):
                return f"object key {key!r} is not a string"
            if has_lone_surrogate(key):
                return "an object key contains a lone UTF-16 surrogate"
            problem = _reference_problem(item, depth + 1)
            if problem is not None:
                return problem
        return None
    return f"{type(value).__name__} is not a JSON type"


class _Text(str):
    pass


class _Number(int):
    pass


_any_leaves = (
    _json_scalars
    | st.sampled_from([float("nan"), float("-inf"), "\ud800", b"x", {1}, _Text("t"), _Number(3)])
    | st.sampled_from([_Text("\udc00"), 1.5, True])
)
_any_values = st.recursive(
    _any_leaves,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.tuples(inner, inner)
        | st.dictionaries(
            st.text() | st.sampled_from(["\ud800", _Text("k")]) | st.integers(0, 3),
            inner,
            max_size=4,
        )
    ),
    max_leaves=20,
)


@settings(max_examples=500, deadline=None)
@given(_any_values)
def test_json_value_problem_reports_the_first_problem_of_a_plain_walk(value: Any) -> None:
    assert json_value_problem(value) == _reference_problem(value)


def test_json_value_problem_reports_a_key_before_later_values() -> None:
    assert json_value_problem({"a": float("nan"), 1: 2}) == "nan is not a JSON number"
    assert json_value_problem({1: 2, "a": float("nan")}) == "object key 1 is not a string"
    assert json_value_problem([1, "\ud800", [float("inf")]]) == (
        "a string contains a lone UTF-16 surrogate"
    )
    deep: Any = 1
    for _ in range(JSON_MAX_DEPTH):
        deep = [deep]
    assert json_value_problem(deep) is None
    assert json_value_problem([deep]) == f"nested deeper than {JSON_MAX_DEPTH} levels"


@pytest.mark.parametrize(
    "text",
    [' {"a": 1} ', '{"a":1}\n', "\t[1, 2]", '{"a":1} x', "[1] [2]", "", "x", "[1,2", '"abc'],
)
def test_scanner_fast_path_keeps_the_decoders_outcome(text: str) -> None:
    """loads scans an edge-to-edge value by the C scanner alone; any other text
    (surrounding whitespace, extra data, an error) gets json's own outcome."""
    try:
        expected: object = json.loads(text)
    except json.JSONDecodeError as exc:
        with pytest.raises(JsonError) as info:
            loads(text)
        assert info.value.kind == "syntax"
        assert str(exc) in str(info.value)
    else:
        assert loads(text) == expected
