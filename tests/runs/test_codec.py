"""Unit tests of the ``runs`` column codec (spec runs §2.12, §3.0.5–3.0.6, §5.4–5.5).

Every decode function gets the raw value a driver would return (text, a BLOB,
an integer, NULL); no database is involved.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentkeep.errors import IdParseError, InvalidInput
from agentkeep.runs import codec
from agentkeep.runs.codec import CodecError
from agentkeep.runs.domain import (
    I64_MAX,
    U32_MAX,
    U64_MAX,
    UNSET,
    Assignee,
    DegradationEntry,
    RunId,
    RunStatus,
    StepEntry,
    StepId,
    TaskId,
    Usage,
)

from .support import DIGEST, SLOT_A, SLOT_B, mk_degradation


def full_entry() -> StepEntry:
    return StepEntry(
        step_id=StepId("ST-9"),
        step_ref="step-z",
        status="passed",
        binding_digest=DIGEST,
        at=7,
        attempt=2,
        started_at_ms=-5,
        completed_at_ms=I64_MAX,
        duration_ms=U64_MAX,
        worker_kind="agent_block",
        model="m-1",
        usage=Usage(input_tokens=1, output_tokens=2, total_tokens=4),
        num_turns=U32_MAX,
        adapter_data={"z": [1, 2.5, None], "a": {"y": "é", "b": True}},
    )


def assert_codec_error(field: str, fn: Any, *args: Any) -> CodecError:
    with pytest.raises(CodecError) as info:
        fn(*args)
    assert info.value.field == field
    assert str(info.value) == f"{field}: {info.value.detail}"
    return info.value


# --------------------------------------------------------------------------
# CodecError


def test_codec_error_shape() -> None:
    e = CodecError("current", "boom")
    assert isinstance(e, ValueError)
    assert (e.field, e.detail, str(e)) == ("current", "boom", "current: boom")


# --------------------------------------------------------------------------
# status (§2.2, §5.5)


@pytest.mark.parametrize("status", list(RunStatus))
def test_status_round_trip(status: RunStatus) -> None:
    text = codec.encode_status(status)
    assert text == f'"{status.value}"'
    assert text == json.dumps(status.value)
    assert codec.decode_status(text) is status


def test_status_encoding_is_the_legacy_text() -> None:
    assert codec.encode_status(RunStatus.PENDING) == '"pending"'
    assert len(codec.encode_status(RunStatus.PENDING)) == 9


@pytest.mark.parametrize(
    "raw",
    [
        '"paused"',
        "pending",
        '"Pending"',
        "5",
        "null",
        '["pending"]',
        "",
        "NaN",
        '"pending',
        5,
        None,
    ],
)
def test_status_corrupt(raw: object) -> None:
    assert_codec_error("status", codec.decode_status, raw)


def test_status_blob_is_corrupt() -> None:
    err = assert_codec_error("status", codec.decode_status, b'"pending"')
    assert "BLOB" in err.detail


def test_status_non_canonical_json_still_decodes_like_serde() -> None:
    assert codec.decode_status(' "running" ') is RunStatus.RUNNING
    assert codec.decode_status('"\\u0070ending"') is RunStatus.PENDING


def test_encode_status_rejects_non_status() -> None:
    assert_codec_error("status", codec.encode_status, "paused")


# --------------------------------------------------------------------------
# step entries (§2.3, §5.5)


def test_step_entry_example_encoding() -> None:
    e = StepEntry.basic("ST-1", "step-a", "dispatched", None, 101)
    assert (
        codec.encode_step_entry(e)
        == '{"step_id":"ST-1","step_ref":"step-a","status":"dispatched","at":101}'
    )


def test_step_entry_nulls_and_omissions() -> None:
    e = StepEntry.basic("ST-1", None, None, None, 1)
    assert codec.encode_step_entry(e) == '{"step_id":"ST-1","step_ref":null,"status":null,"at":1}'


def test_full_step_entry_encoding_order() -> None:
    assert codec.encode_step_entry(full_entry()) == (
        '{"step_id":"ST-9","step_ref":"step-z","status":"passed",'
        f'"binding_digest":"{DIGEST}","at":7,"attempt":2,"started_at_ms":-5,'
        f'"completed_at_ms":{I64_MAX},"duration_ms":{U64_MAX},"worker_kind":"agent_block",'
        '"model":"m-1","usage":{"input_tokens":1,"output_tokens":2,"total_tokens":4},'
        f'"num_turns":{U32_MAX},"adapter_data":{{"a":{{"b":true,"y":"é"}},"z":[1,2.5,null]}}}}'
    )


def test_step_entries_round_trip() -> None:
    entries = [
        StepEntry.basic("ST-1", "step-a", "dispatched", None, 101),
        StepEntry.basic("ST-2", "step-b", "passed", DIGEST, 102),
        full_entry(),
    ]
    text = codec.encode_step_entries(entries)
    assert json.loads(text)[0]["step_ref"] == "step-a"
    decoded = codec.decode_step_entries(text)
    assert decoded == tuple(entries)
    assert [type(d) for d in decoded] == [StepEntry] * 3
    assert type(decoded[0].step_id) is StepId
    assert codec.encode_step_entries(decoded) == text
    assert hash(decoded[0]) == hash(entries[0])
    assert decoded[2].model_dump() == entries[2].model_dump()


def test_step_entries_empty() -> None:
    assert codec.encode_step_entries([]) == "[]"
    assert codec.decode_step_entries("[]") == ()
    assert codec.decode_step_entries(" [ \n ] ") == ()


def test_step_entry_optional_keys_missing_or_null() -> None:
    (e,) = codec.decode_step_entries('[{"step_id":"ST-1","at":1}]')
    assert (e.step_ref, e.status) == (None, None)
    (e,) = codec.decode_step_entries(
        '[{"step_id":"ST-1","at":1,"attempt":null,"usage":null,"model":null,'
        '"adapter_data":null,"binding_digest":null}]'
    )
    assert e == StepEntry.basic("ST-1", None, None, None, 1)


def test_step_entry_unknown_keys_are_ignored() -> None:
    (e,) = codec.decode_step_entries('[{"step_id":"ST-1","at":1,"future":{"x":[1]},"zz":null}]')
    assert e == StepEntry.basic("ST-1", None, None, None, 1)


@pytest.mark.parametrize(
    "raw",
    [
        "null",
        "{}",
        "[1]",
        "[null]",
        "[[]]",
        '{"step_id":"ST-1","at":1}',
        '[{"step_id":"T-1","at":1}]',
        '[{"step_id":"ST-","at":1}]',
        '[{"step_id":"st-1","at":1}]',
        '[{"step_id":"ST-1\\u0000","at":1}]',
        '[{"step_id":1,"at":1}]',
        '[{"at":1}]',
        '[{"step_id":"ST-1"}]',
        '[{"step_id":"ST-1","at":-1}]',
        '[{"step_id":"ST-1","at":1.5}]',
        '[{"step_id":"ST-1","at":1.0}]',
        '[{"step_id":"ST-1","at":1e2}]',
        '[{"step_id":"ST-1","at":true}]',
        '[{"step_id":"ST-1","at":"1"}]',
        '[{"step_id":"ST-1","at":null}]',
        f'[{{"step_id":"ST-1","at":{2**64}}}]',
        '[{"step_id":"ST-1","at":1,"binding_digest":"sha256:abc"}]',
        '[{"step_id":"ST-1","at":1,"binding_digest":"sha256:' + "A" * 64 + '"}]',
        '[{"step_id":"ST-1","at":1,"binding_digest":"md5:' + "a" * 64 + '"}]',
        '[{"step_id":"ST-1","at":1,"binding_digest":5}]',
        '[{"step_id":"ST-1","at":1,"step_ref":5}]',
        '[{"step_id":"ST-1","at":1,"status":false}]',
        f'[{{"step_id":"ST-1","at":1,"attempt":{2**32}}}]',
        '[{"step_id":"ST-1","at":1,"attempt":-1}]',
        f'[{{"step_id":"ST-1","at":1,"started_at_ms":{2**63}}}]',
        f'[{{"step_id":"ST-1","at":1,"completed_at_ms":{-(2**63) - 1}}}]',
        '[{"step_id":"ST-1","at":1,"duration_ms":-1}]',
        '[{"step_id":"ST-1","at":1,"worker_kind":1}]',
        '[{"step_id":"ST-1","at":1,"model":[]}]',
        f'[{{"step_id":"ST-1","at":1,"num_turns":{2**32}}}]',
        '[{"step_id":"ST-1","at":1,"usage":[]}]',
        '[{"step_id":"ST-1","at":1,"usage":{"input_tokens":-1}}]',
        '[{"step_id":"ST-1","at":1,"usage":{"total_tokens":1.0}}]',
        '[{"step_id":"ST-1","at":1,"usage":{"output_tokens":true}}]',
        '[{"step_id":"ST-1","at":1,"adapter_data":NaN}]',
        '[{"step_id":"ST-1","at":1,"adapter_data":[Infinity]}]',
        '[{"step_id":"ST-1","at":1,"adapter_data":-Infinity}]',
        '[{"step_id":"ST-1","at":1,"adapter_data":1e400}]',
        '[{"step_id":"ST-1","at":1},]',
        '[{"step_id":"ST-1","at":1}] x',
        "",
        "[",
    ],
)
def test_step_entries_corrupt(raw: str) -> None:
    err = assert_codec_error("step_entries", codec.decode_step_entries, raw)
    # An append's check (no entry built) refuses the same text with the same error.
    assert assert_codec_error("step_entries", codec.check_step_entries, raw).detail == err.detail


@pytest.mark.parametrize("raw", [None, b"[]", bytearray(b"[]"), 5, 1.5])
def test_step_entries_not_text(raw: object) -> None:
    assert_codec_error("step_entries", codec.decode_step_entries, raw)
    assert_codec_error("step_entries", codec.check_step_entries, raw)


@pytest.mark.parametrize(
    "raw",
    [
        "[]",
        '[{"step_id":"ST-1","at":1}]',
        '[{"step_id":"ST-1","step_ref":"r","status":"s","at":1},{"step_id":"ST-2","at":2}]',
        '[{"step_id":"ST-1","at":1,"attempt":2,"usage":{"input_tokens":3},"adapter_data":{"a":1}}]',
    ],
)
def test_step_entries_check_passes_what_decodes(raw: str) -> None:
    assert codec.decode_step_entries(raw) is not None
    assert codec.check_step_entries(raw) is None


def test_step_entry_error_names_the_entry_and_key() -> None:
    text = '[{"step_id":"ST-1","at":1},{"step_id":"ST-2","at":-1}]'
    err = assert_codec_error("step_entries", codec.decode_step_entries, text)
    assert "[1].at" in err.detail
    err = assert_codec_error(
        "step_entries", codec.decode_step_entries, '[{"step_id":"T-1","at":1}]'
    )
    assert "invalid step id `T-1`" in err.detail
    err = assert_codec_error("step_entries", codec.decode_step_entries, '[{"step_id":"ST-1"}]')
    assert "missing field `at`" in err.detail


def test_step_entry_integer_bounds_accepted() -> None:
    (e,) = codec.decode_step_entries(
        f'[{{"step_id":"ST-1","at":{U64_MAX},"attempt":{U32_MAX},'
        f'"started_at_ms":{-(2**63)},"completed_at_ms":{I64_MAX},"duration_ms":0,"num_turns":0}}]'
    )
    assert (e.at, e.attempt, e.started_at_ms, e.completed_at_ms) == (
        U64_MAX,
        U32_MAX,
        -(2**63),
        I64_MAX,
    )
    (e,) = codec.decode_step_entries('[{"step_id":"ST-1","at":-0}]')
    assert e.at == 0


def test_step_entry_duplicate_keys_rejected() -> None:
    err = assert_codec_error(
        "step_entries",
        codec.decode_step_entries,
        '[{"step_id":"ST-1","at":1,"at":2}]',
    )
    assert "duplicate field `at`" in err.detail
    assert_codec_error(
        "step_entries",
        codec.decode_step_entries,
        '[{"step_id":"ST-1","at":1,"usage":{"input_tokens":1,"input_tokens":2}}]',
    )
    assert_codec_error(
        "step_entries",
        codec.decode_step_entries,
        '[{"step_id":"ST-1","step_id":"ST-1","at":1,"x":1,"x":2}]',
    )
    assert_codec_error(
        "step_entries",
        codec.decode_step_entries,
        '[{"step_id":"ST-1","at":1,"adapter_data":1,"adapter_data":null}]',
    )


def test_repeated_unknown_keys_are_skipped_like_serde() -> None:
    # serde skips unknown keys without tracking them, so repeats are fine.
    (e,) = codec.decode_step_entries('[{"step_id":"ST-1","x":1,"at":1,"x":2}]')
    assert e == StepEntry.basic("ST-1", None, None, None, 1)
    (e,) = codec.decode_step_entries(
        '[{"step_id":"ST-1","at":1,"usage":{"cache":1,"cache":2,"input_tokens":4}}]'
    )
    assert e.usage == Usage(input_tokens=4, output_tokens=0, total_tokens=4)
    (d,) = codec.decode_degradations('[{"tool":"t","error":"e","fallback":"f","at":1,"y":0,"y":1}]')
    assert d.tool == "t"
    current = codec.decode_current('{"a":{"op":"x","desc":"d","gen":1,"z":1,"z":2}}')
    assert current == {"a": Assignee(op="x", desc="d", gen=1)}


def test_step_entry_duplicate_keys_inside_adapter_data_keep_the_last() -> None:
    (e,) = codec.decode_step_entries(
        '[{"step_id":"ST-1","at":1,"adapter_data":{"k":1,"k":2,"n":[{"a":1,"a":3}]}}]'
    )
    assert e.adapter_data == {"k": 2, "n": [{"a": 3}]}
    assert type(e.adapter_data) is dict
    assert type(e.adapter_data["n"][0]) is dict


def test_usage_decode_rules() -> None:
    def usage_of(obj: str) -> Usage | None:
        (e,) = codec.decode_step_entries(f'[{{"step_id":"ST-1","at":1,"usage":{obj}}}]')
        return e.usage

    assert usage_of("{}") == Usage(input_tokens=0, output_tokens=0, total_tokens=0)
    assert usage_of('{"total_tokens":9}') == Usage(input_tokens=0, output_tokens=0, total_tokens=9)
    assert usage_of('{"input_tokens":3,"output_tokens":4}') == Usage(
        input_tokens=3, output_tokens=4, total_tokens=7
    )
    assert usage_of('{"input_tokens":3}') == Usage(input_tokens=3, output_tokens=0, total_tokens=3)
    assert usage_of('{"input_tokens":3,"output_tokens":null,"total_tokens":null}') == Usage(
        input_tokens=3, output_tokens=0, total_tokens=3
    )
    assert usage_of('{"input_tokens":1,"output_tokens":2,"total_tokens":10,"cache":5}') == Usage(
        input_tokens=1, output_tokens=2, total_tokens=10
    )
    assert usage_of("null") is None
    with pytest.raises(CodecError, match="overflows"):
        usage_of(f'{{"input_tokens":{U64_MAX},"output_tokens":1}}')


def test_step_entry_surrogates() -> None:
    # A valid escaped pair is one astral character.
    (e,) = codec.decode_step_entries('[{"step_id":"ST-1","at":1,"step_ref":"\\ud83d\\ude00"}]')
    assert e.step_ref == "\U0001f600"
    for bad in ['"\\ud800"', '"\\uDC00x"', '"a\\ude00\\ud83d"']:
        assert_codec_error(
            "step_entries",
            codec.decode_step_entries,
            f'[{{"step_id":"ST-1","at":1,"status":{bad}}}]',
        )
    assert_codec_error(
        "step_entries",
        codec.decode_step_entries,
        '[{"step_id":"ST-1","at":1,"adapter_data":{"\\udbff":1}}]',
    )
    # A raw lone surrogate in the text (only possible from a Python caller).
    assert_codec_error(
        "step_entries", codec.decode_step_entries, '[{"step_id":"ST-1","at":1,"model":"\ud800"}]'
    )
    # An escaped backslash followed by "ud800" is plain text, not a surrogate.
    (e,) = codec.decode_step_entries('[{"step_id":"ST-1","at":1,"model":"\\\\ud800"}]')
    assert e.model == "\\ud800"


def test_step_entry_encode_refuses_lone_surrogates() -> None:
    e = StepEntry.basic("ST-1", "\ud800", None, None, 1)
    assert_codec_error("step_entries", codec.encode_step_entry, e)
    assert_codec_error("step_entries", codec.encode_step_entries, [e])


def test_step_entry_unicode_round_trip() -> None:
    e = StepEntry.basic("ST-ünï", "шаг-\U0001f600", "完了\u2028", None, 1)
    text = codec.encode_step_entry(e)
    assert "ünï" in text and "\U0001f600" in text  # ensure_ascii=False
    assert codec.decode_step_entries(f"[{text}]") == (e,)


def test_step_entry_control_characters_are_escaped() -> None:
    e = StepEntry.basic("ST-1", "a\x00b\nc", None, None, 1)
    text = codec.encode_step_entry(e)
    assert "\x00" not in text and "\\u0000" in text and "\\n" in text
    assert codec.decode_step_entries(f"[{text}]") == (e,)
    # A raw control character inside a JSON string is invalid JSON (serde agrees).
    assert_codec_error(
        "step_entries", codec.decode_step_entries, '[{"step_id":"ST-1","at":1,"model":"a\nb"}]'
    )


# --------------------------------------------------------------------------
# degradations (§2.4, §5.5)


def test_degradation_encoding() -> None:
    d = mk_degradation("web_search", 101)
    assert codec.encode_degradation(d) == (
        '{"tool":"web_search","error":"boom","fallback":"cached-default",'
        '"step_ref":"worker","attempt":1,"at":101}'
    )
    bare = DegradationEntry(tool="t", error="e", fallback="f", note="n", at=0)
    assert codec.encode_degradation(bare) == (
        '{"tool":"t","error":"e","fallback":"f","note":"n","at":0}'
    )


def test_degradations_round_trip() -> None:
    ds = [mk_degradation("web_search", 101), mk_degradation("code_exec", 102)]
    text = codec.encode_degradations(ds)
    decoded = codec.decode_degradations(text)
    assert decoded == tuple(ds)
    assert [d.tool for d in decoded] == ["web_search", "code_exec"]
    assert codec.encode_degradations(decoded) == text
    assert codec.encode_degradations([]) == "[]"
    assert codec.decode_degradations("[]") == ()


@pytest.mark.parametrize(
    "raw",
    [
        "null",
        "{}",
        "[1]",
        '[{"error":"e","fallback":"f","at":1}]',
        '[{"tool":"t","fallback":"f","at":1}]',
        '[{"tool":"t","error":"e","at":1}]',
        '[{"tool":"t","error":"e","fallback":"f"}]',
        '[{"tool":null,"error":"e","fallback":"f","at":1}]',
        f'[{{"tool":"t","error":"e","fallback":"f","attempt":{2**32},"at":1}}]',
        '[{"tool":"t","error":"e","fallback":"f","at":1,"note":3}]',
        '[{"tool":"t","error":"e","fallback":"f","at":1.0}]',
        '[{"tool":"t","error":"e","fallback":"f","at":1,"tool":"u"}]',
    ],
)
def test_degradations_corrupt(raw: str) -> None:
    err = assert_codec_error("degradations", codec.decode_degradations, raw)
    assert assert_codec_error("degradations", codec.check_degradations, raw).detail == err.detail
    good = '[{"tool":"t","error":"e","fallback":"f","at":1}]'
    assert codec.check_degradations(good) is None


def test_degradations_not_text() -> None:
    assert_codec_error("degradations", codec.decode_degradations, None)
    assert_codec_error("degradations", codec.decode_degradations, b"[]")


def test_degradation_optional_nulls_and_unknown_keys() -> None:
    (d,) = codec.decode_degradations(
        '[{"tool":"t","error":"e","fallback":"f","note":null,"attempt":null,"at":1,"x":[]}]'
    )
    assert d == DegradationEntry(tool="t", error="e", fallback="f", at=1)


# --------------------------------------------------------------------------
# append_json_array (§2.3 proposal)


@pytest.mark.parametrize("empty", ["[]", "[ ]", " [\n\t] \n", "[\r\n]"])
def test_append_to_empty(empty: str) -> None:
    item = codec.encode_step_entry(StepEntry.basic("ST-1", "a", None, None, 1))
    out = codec.append_json_array(empty, item)
    assert json.loads(out) == [json.loads(item)]
    assert out.endswith(item + "]")


def test_append_keeps_earlier_entries_verbatim() -> None:
    stored = (
        '[ {"step_id":"ST-1", "at":1, "future_key":{"keep":[1,2]}, "status":"x"} ,\n'
        '  {"at":2,"step_id":"ST-2"} ]  \n'
    )
    assert len(codec.decode_step_entries(stored)) == 2  # validated first
    item = codec.encode_step_entry(StepEntry.basic("ST-3", "c", "dispatched", None, 3))
    out = codec.append_json_array(stored, item)
    assert out.startswith(stored.rstrip()[:-1].rstrip())
    assert '"future_key":{"keep":[1,2]}' in out
    decoded = codec.decode_step_entries(out)
    assert [e.step_id for e in decoded] == ["ST-1", "ST-2", "ST-3"]
    assert json.loads(out)[0]["future_key"] == {"keep": [1, 2]}


def test_append_with_nested_brackets_in_last_element() -> None:
    stored = '[{"tool":"t","error":"]","fallback":"[","at":1,"x":[[]]}]'
    item = codec.encode_degradation(mk_degradation("b", 2))
    out = codec.append_json_array(stored, item)
    assert [d.tool for d in codec.decode_degradations(out)] == ["t", "b"]


def test_append_refuses_non_array_text() -> None:
    assert_codec_error("array", codec.append_json_array, "{}", "1")


# --------------------------------------------------------------------------
# current (§2.5–2.6, §3.0.5, §5.4–5.5)


def test_encode_current_empty_is_null_never_braces() -> None:
    assert codec.encode_current({}) is None


def test_encode_current_sorted_and_shaped() -> None:
    text = codec.encode_current(
        {
            SLOT_B: Assignee(op="S-b2", desc="holds phase b", gen=2),
            SLOT_A: Assignee(op="S-a1", desc="holds phase a", gen=1),
        }
    )
    assert text == (
        '{"phase-a-op":{"op":"S-a1","desc":"holds phase a","gen":1},'
        '"phase-b-op":{"op":"S-b2","desc":"holds phase b","gen":2}}'
    )


def test_decode_current_null_and_braces() -> None:
    assert codec.decode_current(None) == {}
    assert codec.decode_current("{}") == {}
    assert codec.decode_current(" { } ") == {}


def test_current_round_trip_sorted() -> None:
    m = {
        "zeta": Assignee(op="", desc="  padded  ", gen=3),
        " ": Assignee(op="main-ai", desc="é", gen=0),
        "ünï": Assignee(op="S-1", desc="d", gen=I64_MAX),
        "Alpha": Assignee(op="S-2", desc="d", gen=1),
    }
    text = codec.encode_current(m)
    assert text is not None
    decoded = codec.decode_current(text)
    assert decoded == m
    assert list(decoded) == sorted(m)
    assert all(type(a) is Assignee for a in decoded.values())
    assert codec.encode_current(decoded) == text


def test_decode_current_sorts_foreign_key_order() -> None:
    text = '{"b":{"op":"x","desc":"d","gen":2},"a":{"op":"y","desc":"d","gen":1}}'
    assert list(codec.decode_current(text)) == ["a", "b"]


BARE_ASSIGNEE = '{"op":"main-ai","desc":"held","gen":1}'


@pytest.mark.parametrize(
    "raw",
    [
        "null",
        "[]",
        "1",
        '"x"',
        BARE_ASSIGNEE,
        '{"a":{"op":"x","gen":1}}',
        '{"a":{"desc":"d","gen":1}}',
        '{"a":{"op":"x","desc":"d"}}',
        '{"a":{"op":"x","desc":"d","gen":-1}}',
        '{"a":{"op":"x","desc":"d","gen":1.0}}',
        '{"a":{"op":"x","desc":"d","gen":true}}',
        '{"a":{"op":"x","desc":"d","gen":"1"}}',
        '{"a":{"op":"x","desc":"d","gen":NaN}}',
        "NaN",
        f'{{"a":{{"op":"x","desc":"d","gen":{2**63}}}}}',
        '{"a":{"op":null,"desc":"d","gen":1}}',
        '{"a":{"op":"x","desc":5,"gen":1}}',
        '{"a":null}',
        '{"a":[]}',
        '{"a":{"op":"x","desc":"d","gen":1,"gen":2}}',
        '{"a":{"op":"x","desc":"\\udc00","gen":1}}',
        "{",
        "",
    ],
)
def test_current_corrupt(raw: str) -> None:
    assert_codec_error("current", codec.decode_current, raw)


def test_current_bare_assignee_message() -> None:
    err = assert_codec_error("current", codec.decode_current, BARE_ASSIGNEE)
    assert '"desc"' in err.detail or '"gen"' in err.detail or '"op"' in err.detail


@pytest.mark.parametrize("raw", [b"{}", b"null", 0, 1.0])
def test_current_not_text(raw: object) -> None:
    assert_codec_error("current", codec.decode_current, raw)


def test_current_duplicate_slot_keeps_the_last_like_a_btreemap() -> None:
    text = '{"a":{"op":"x","desc":"d","gen":1},"a":{"op":"y","desc":"d","gen":2}}'
    assert codec.decode_current(text) == {"a": Assignee(op="y", desc="d", gen=2)}


def test_current_unknown_keys_in_holder_ignored() -> None:
    text = '{"a":{"op":"x","desc":"d","gen":1,"since":5}}'
    assert codec.decode_current(text) == {"a": Assignee(op="x", desc="d", gen=1)}


def test_current_hundreds_of_slots() -> None:
    m = {f"slot-{i:04d}-é": Assignee(op=f"S-{i}", desc="d" * 1000, gen=i) for i in range(500)}
    text = codec.encode_current(m)
    assert text is not None
    decoded = codec.decode_current(text)
    assert decoded == m
    assert list(decoded) == sorted(m)


def test_encode_current_refuses_non_string_slots() -> None:
    holder = Assignee(op="", desc="d", gen=0)
    assert_codec_error("current", codec.encode_current, {1: holder, "a": holder})


def test_encode_current_refuses_lone_surrogates() -> None:
    assert_codec_error(
        "current", codec.encode_current, {"\ud800": Assignee(op="", desc="d", gen=0)}
    )


# --------------------------------------------------------------------------
# result_ref (§2.9, §5.4)


def test_result_ref_unset_versus_null() -> None:
    assert codec.encode_result_ref(UNSET) is None
    assert codec.encode_result_ref(None) == "null"
    assert codec.decode_result_ref(None) is UNSET
    assert codec.decode_result_ref("null") is None


def test_result_ref_round_trip_and_sorted_keys() -> None:
    v = {"ok": True, "b": [1, 2.5, "é", None], "a": {"z": 1, "y": {}}}
    text = codec.encode_result_ref(v)
    assert text == '{"a":{"y":{},"z":1},"b":[1,2.5,"é",null],"ok":true}'
    assert codec.decode_result_ref(text) == v
    assert codec.decode_result_ref(codec.encode_result_ref({"ok": True})) == {"ok": True}
    assert codec.encode_result_ref((1, 2)) == "[1,2]"
    assert codec.decode_result_ref(codec.encode_result_ref(2**80)) == 2**80
    assert codec.decode_result_ref('"x"') == "x"


@pytest.mark.parametrize(
    "value",
    [
        float("nan"),
        float("inf"),
        [float("-inf")],
        {1: "a"},
        {"a": {None: 1}},
        {1, 2},
        b"x",
        object(),
        "\ud800",
    ],
)
def test_encode_result_ref_refuses_non_json(value: object) -> None:
    assert_codec_error("result_ref", codec.encode_result_ref, value)


@pytest.mark.parametrize(
    "raw", ["{", "NaN", "[Infinity]", "-Infinity", "1e999", "", "nul", '"\\ud800"', "[1,]"]
)
def test_result_ref_corrupt(raw: str) -> None:
    assert_codec_error("result_ref", codec.decode_result_ref, raw)


def test_result_ref_not_text() -> None:
    assert_codec_error("result_ref", codec.decode_result_ref, b"null")
    assert_codec_error("result_ref", codec.decode_result_ref, 5)


def test_result_ref_duplicate_keys_keep_the_last() -> None:
    assert codec.decode_result_ref('{"a":1,"a":2}') == {"a": 2}


# --------------------------------------------------------------------------
# plain columns (§3.0.6, §5.5–5.6)


def test_decode_id() -> None:
    rid = codec.decode_id("R-1", RunId, "id")
    assert rid == "R-1" and type(rid) is RunId
    tid = codec.decode_id("T-legacy", TaskId, "task_id")
    assert type(tid) is TaskId
    err = assert_codec_error("id", codec.decode_id, "X-1", RunId, "id")
    assert "invalid run id `X-1`" in err.detail
    err = assert_codec_error("task_id", codec.decode_id, "R-1", TaskId, "task_id")
    assert "invalid task id `R-1`" in err.detail
    assert_codec_error("id", codec.decode_id, b"R-1", RunId, "id")
    assert_codec_error("id", codec.decode_id, None, RunId, "id")
    assert_codec_error("id", codec.decode_id, "R-\x00", RunId, "id")
    assert_codec_error("id", codec.decode_id, 1, RunId, "id")


def test_decode_u63() -> None:
    assert codec.decode_u63(0, "created_at") == 0
    assert codec.decode_u63(I64_MAX, "next_generation") == I64_MAX
    for bad in [-1, -(2**63), I64_MAX + 1, "abc", "5", b"\x01", 1.0, True, None]:
        assert_codec_error("created_at", codec.decode_u63, bad, "created_at")


def test_decode_u63_messages() -> None:
    err = assert_codec_error("next_generation", codec.decode_u63, -1, "next_generation")
    assert "-1" in err.detail
    err = assert_codec_error("created_at", codec.decode_u63, "abc", "created_at")
    assert "'abc'" in err.detail
    err = assert_codec_error("created_at", codec.decode_u63, b"\x00", "created_at")
    assert "BLOB" in err.detail


def test_decode_text_or_none() -> None:
    assert codec.decode_text_or_none(None, "input_json") is None
    assert codec.decode_text_or_none("", "input_json") == ""
    snapshot = '{"blueprint":"snapshot","init_ctx":{}}'
    assert codec.decode_text_or_none(snapshot, "input_json") == snapshot
    assert codec.decode_text_or_none("not json", "input_json") == "not json"
    assert_codec_error("operator_sid", codec.decode_text_or_none, b"S-1", "operator_sid")
    assert_codec_error("input_json", codec.decode_text_or_none, 5, "input_json")


def test_check_u63() -> None:
    assert codec.check_u63(0, "next_generation") == 0
    assert codec.check_u63(I64_MAX, "next_generation") == I64_MAX
    for bad in [-1, I64_MAX + 1, 2**64, True, 1.0, "1", None]:
        with pytest.raises(InvalidInput) as info:
            codec.check_u63(bad, "gen")  # type: ignore[arg-type]
        assert info.value.field == "gen"


def test_check_text() -> None:
    assert codec.check_text("", "input_json") == ""
    assert codec.check_text("é \U0001f600", "slot") == "é \U0001f600"
    rid = RunId("R-1")
    assert codec.check_text(rid, "id") is rid
    for bad in ["a\x00b", "\x00", "\ud800", b"x", None, 5]:
        with pytest.raises(InvalidInput) as info:
            codec.check_text(bad, "slot")  # type: ignore[arg-type]
        assert info.value.field == "slot"
        assert not isinstance(info.value, IdParseError)


# --------------------------------------------------------------------------
# Property tests: round trips and canonical encoding

text_st = st.text(max_size=12)
u64 = st.integers(0, U64_MAX)
u32 = st.integers(0, U32_MAX)
i64 = st.integers(-(2**63), I64_MAX)
json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    text_st,
)
json_values = st.recursive(
    json_leaf,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(text_st, inner, max_size=4)
    ),
    max_leaves=12,
)


@st.composite
def step_entries(draw: st.DrawFn) -> StepEntry:
    maybe = lambda s: draw(st.one_of(st.none(), s))  # noqa: E731
    return StepEntry(
        step_id=StepId(
            "ST-" + draw(st.text(min_size=1, max_size=8).filter(lambda s: "\x00" not in s))
        ),
        step_ref=maybe(text_st),
        status=maybe(text_st),
        binding_digest=maybe(st.from_regex(r"\Asha256:[0-9a-f]{64}\Z")),
        at=draw(u64),
        attempt=maybe(u32),
        started_at_ms=maybe(i64),
        completed_at_ms=maybe(i64),
        duration_ms=maybe(u64),
        worker_kind=maybe(text_st),
        model=maybe(text_st),
        usage=maybe(st.builds(Usage, input_tokens=u64, output_tokens=u64, total_tokens=u64)),
        num_turns=maybe(u32),
        adapter_data=maybe(json_values.filter(lambda v: v is not None)),
    )


degradation_entries = st.builds(
    DegradationEntry,
    tool=text_st,
    error=text_st,
    fallback=text_st,
    note=st.none() | text_st,
    step_ref=st.none() | text_st,
    attempt=st.none() | u32,
    at=u64,
)
assignees = st.builds(Assignee, op=text_st, desc=text_st, gen=st.integers(0, I64_MAX))


def _json_equal(a: object, b: object) -> bool:
    """Equality where -0.0 == 0.0 and floats compare exactly (no NaN here)."""
    if isinstance(a, float) and isinstance(b, float):
        return a == b and math.copysign(1, a) == math.copysign(1, b)
    return a == b


@settings(max_examples=200, deadline=None)
@given(st.lists(step_entries(), max_size=5))
def test_property_step_entries_round_trip(entries: list[StepEntry]) -> None:
    text = codec.encode_step_entries(entries)
    decoded = codec.decode_step_entries(text)
    assert decoded == tuple(entries)
    assert codec.encode_step_entries(decoded) == text
    assert json.loads(text) == [json.loads(codec.encode_step_entry(e)) for e in entries]


@settings(max_examples=100, deadline=None)
@given(st.lists(step_entries(), max_size=4), step_entries())
def test_property_append_equals_reencode(entries: list[StepEntry], extra: StepEntry) -> None:
    stored = codec.encode_step_entries(entries)
    appended = codec.append_json_array(stored, codec.encode_step_entry(extra))
    assert appended == codec.encode_step_entries([*entries, extra])


@settings(max_examples=100, deadline=None)
@given(st.lists(degradation_entries, max_size=5))
def test_property_degradations_round_trip(ds: list[DegradationEntry]) -> None:
    text = codec.encode_degradations(ds)
    assert codec.decode_degradations(text) == tuple(ds)


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(text_st, assignees, max_size=6))
def test_property_current_round_trip(m: dict[str, Assignee]) -> None:
    text = codec.encode_current(m)
    if not m:
        assert text is None
        return
    assert text is not None and text != "{}"
    decoded = codec.decode_current(text)
    assert decoded == m
    assert list(decoded) == sorted(m)
    assert codec.encode_current(decoded) == text


@settings(max_examples=200, deadline=None)
@given(json_values)
def test_property_result_ref_round_trip(v: object) -> None:
    text = codec.encode_result_ref(v)
    assert text is not None
    back = codec.decode_result_ref(text)
    assert json.dumps(back, sort_keys=True) == json.dumps(v, sort_keys=True)
    assert codec.encode_result_ref(back) == text
    assert _json_equal(back, v) or isinstance(v, (list, dict))
