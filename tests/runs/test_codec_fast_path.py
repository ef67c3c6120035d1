"""The canonical fast path of the step-entry and slot-map decoders (``codec._fast_*``).

Canonical texts (ASCII, no escape, pre-stats entries, holders of three
fields) are decoded by the C scanner alone, with a count of quotes proving
that no object repeated a key. Every text must decode exactly as the strict
path decodes it, errors included: the cases here are the ones the shape
checks alone would let through (a repeated field that still leaves four keys
in an entry or three in a holder), plus texts just outside the canonical
form.
"""

from __future__ import annotations

from typing import Any

import pytest

from agentkeep.runs import codec
from agentkeep.runs.codec import CodecError


def _strict(monkeypatch: pytest.MonkeyPatch, fn: Any, text: str) -> Any:
    """``fn(text)`` through the strict path only."""
    with monkeypatch.context() as m:
        m.setattr(codec, "_fast_step_entries", lambda *a, **k: None)
        m.setattr(codec, "_fast_current", lambda *a, **k: None)
        return _outcome(fn, text)


def _outcome(fn: Any, text: str) -> Any:
    try:
        return ("ok", fn(text))
    except CodecError as exc:
        return ("error", exc.field, exc.detail)


E1 = '{"step_id":"ST-1","step_ref":"r","status":"s","at":1}'
E2 = '{"step_id":"ST-2","step_ref":null,"status":null,"at":2}'

STEP_TEXTS = [
    '[{"step_id":"ST-1","step_ref":"r","status":"passed","at":1}]',
    '[{"step_id":"ST-1","step_ref":null,"status":null,"at":1}]',
    '[{"step_id":"ST-1","step_ref":"r","status":"s","at":1},'
    '{"step_id":"ST-2","step_ref":"q","status":null,"at":2}]',
    # A repeated field leaving four keys: the quote count refuses it.
    '[{"step_id":"ST-1","step_ref":"r","status":"s","at":1,"at":2}]',
    '[{"step_id":"ST-1","step_ref":"r","status":"s","status":"t","at":1}]',
    '[{"step_id":"ST-1","step_id":"ST-2","step_ref":"r","status":"s","at":1}]',
    '[{"step_id":"ST-1","step_ref":null,"step_ref":null,"status":null,"at":1}]',
    '[{"step_id":"ST-1","step_ref":"r","at":1,"at":2}]',
    # Just outside the canonical form.
    '[{"step_id":"ST-1","step_ref":"r","status":"s","at":1} ]',
    '[{"step_id":"ST-1","step_ref":"r\\u00e9","status":"s","at":1}]',
    '[{"step_id":"ST-1","step_ref":"\u00e9","status":"s","at":1}]',
    '[{"step_id":"ST-1","step_ref":"r","status":"s","at":1.0}]',
    '[{"step_id":"ST-1","step_ref":"r","status":"s","at":true}]',
    '[{"step_id":"ST-1","step_ref":"r","status":"s","at":-1}]',
    '[{"step_id":"ST-1","step_ref":"r","status":"s","at":18446744073709551616}]',
    '[{"step_id":"ST-1","step_ref":"r","status":"s","x":1}]',
    '[{"step_id":"ST-1","step_ref":"r","status":"s","attempt":1}]',
    '[{"step_id":"XX-1","step_ref":"r","status":"s","at":1}]',
    '[{"step_id":"ST-","step_ref":"r","status":"s","at":1}]',
    '[{"step_id":"ST-1","step_ref":1,"status":"s","at":1}]',
    '[{"step_id":"ST-1","step_ref":"r","status":"s","at":NaN}]',
    '[{"step_id":"ST-1","step_ref":"r","status":"s","at":1}',
    '[{"step_id":"ST-1","step_ref":"r","status":"s","at":1}]x',
    '{"step_id":"ST-1","step_ref":"r","status":"s","at":1}',
    "[1]",
    "[[]]",
    "[]",
    "",
    # The regex path (a whole canonical pre-stats array) and texts just outside it.
    '[{"step_id":"ST-1","step_ref":"","status":"","at":0}]',
    '[{"step_id":"ST-1","step_ref":"r","status":"s","at":18446744073709551615}]',
    '[{"step_id":"ST-1","step_ref":"r","status":"s","at":99999999999999999999}]',
    '[{"step_id":"ST-1","step_ref":"r","status":"s","at":01}]',
    '[{"step_id":"ST-1","step_ref":"r\x01","status":"s","at":1}]',
    '[{"step_id":"ST-1","step_ref":"r\x7f","status":"s","at":1}]',
    '[{"step_id":"ST-1\x00","step_ref":"r","status":"s","at":1}]',
    '[{"step_id":"ST-1","step_ref":"r","status":"s","at":1},]',
    '[{"step_id":"ST-1","step_ref":"r","status":"s","at":1}{"step_id":"ST-2","step_ref":null,'
    '"status":null,"at":2}]',
    '[{"step_id":"ST-1","step_ref":"r","status":"s","at":1},'
    '{"step_id":"ST-2","step_ref":"r","status":"s","at":1,"attempt":3}]',
    # The regex path's tiling: every character between and around the entries counts.
    f"[{E1},[{E2}]",
    f"[{E1},,{E2}]",
    f"x[{E1}]",
    f"[[{E1}]",
    f",{E1}]",
    f"[{E1}],{E2}]",
    f"[{E1}x,{E2}]",
    f"[{E1},{E2}]]",
    f"[{E1},{E2} ]",
    '[{"step_id":"ST-1","step_ref":"a\\"b","status":"s","at":1}]',
    '[{"step_id":"ST-1","step_ref":"{\\"step_id\\":\\"ST-9\\"}","status":"s","at":1}]',
]


TILING = [
    (f"[{E1}]", True),
    (f"[{E1},{E2}]", True),
    (f"[{E1},{E2},{E1}]", True),
    (f"[{E1},[{E2}]", False),
    (f"[{E1},,{E2}]", False),
    (f"x[{E1}]", False),
    (f"[[{E1}]", False),
    (f",{E1}]", False),
    (f"[{E1}],{E2}]", False),
    (f"[{E1}x,{E2}]", False),
    (f"[{E1},{E2}]]", False),
    (f"[{E1}{E2}]", False),
]


@pytest.mark.parametrize(("text", "plain"), TILING)
def test_the_regex_path_takes_exactly_whole_canonical_arrays(
    monkeypatch: pytest.MonkeyPatch, text: str, plain: bool
) -> None:
    """One findall reads the entries; their lengths prove they tile the text (or None)."""
    got = codec._plain_step_entries(text, True)
    assert (got is not None) == plain
    assert (codec._plain_step_entries(text, False) is not None) == plain
    if plain:
        assert ("ok", got) == _strict(monkeypatch, codec.decode_step_entries, text)


@pytest.mark.parametrize("text", STEP_TEXTS)
def test_step_entries_decode_as_the_strict_path(monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    expected = _strict(monkeypatch, codec.decode_step_entries, text)
    assert _outcome(codec.decode_step_entries, text) == expected
    checked = _outcome(codec.check_step_entries, text)
    assert checked[0] == expected[0]
    if expected[0] == "error":
        assert checked == expected


@pytest.mark.parametrize(
    "text",
    [
        '[{"step_id":"ST-1","step_ref":"r","status":"s","at":1,"at":2}]',
        '[{"step_id":"ST-1","step_ref":"r","status":"s","status":"t","at":1}]',
        '[{"step_id":"ST-1","step_ref":null,"step_ref":null,"status":null,"at":1}]',
    ],
)
def test_a_repeated_field_that_leaves_four_keys_is_refused(text: str) -> None:
    with pytest.raises(CodecError) as info:
        codec.decode_step_entries(text)
    assert info.value.field == "step_entries"
    assert "duplicate field" in info.value.detail


CURRENT_TEXTS = [
    '{"main":{"op":"o","desc":"d","gen":1}}',
    '{"a":{"op":"o","desc":"d","gen":1},"b":{"op":"p","desc":"e","gen":2}}',
    '{"b":{"op":"p","desc":"e","gen":2},"a":{"op":"o","desc":"d","gen":1}}',
    # A repeated field leaving three keys: refused by the strict path.
    '{"main":{"op":"o","desc":"d","gen":1,"gen":2}}',
    '{"main":{"op":"o","desc":"d","desc":"e","gen":1}}',
    '{"main":{"op":"o","op":"p","gen":1}}',
    # A repeated slot: the last holder wins (strict path).
    '{"a":{"op":"x","desc":"d","gen":1},"a":{"op":"y","desc":"d","gen":2}}',
    # Just outside the canonical form.
    '{"main":{"op":"o","desc":"d","gen":1,"since":5}}',
    '{"main":{"op":"o","desc":"d\\n","gen":1}}',
    '{"main":{"op":"o","desc":"\u00e9","gen":1}}',
    '{"main":{"op":"o","desc":"d","gen":9223372036854775808}}',
    '{"main":{"op":"o","desc":"d","gen":1.0}}',
    '{"main":{"op":"o","desc":null,"gen":1}}',
    '{"main":{"op":"o","desc":"d","gen":1}} ',
    '{"main":[1,2,3]}',
    '{"op":"o","desc":"d","gen":1}',
    "[]",
    "{}",
    # The regex path (a whole canonical map) and texts just outside it.
    '{"":{"op":"","desc":"","gen":0}}',
    '{"main":{"op":"o","desc":"d","gen":9223372036854775807}}',
    '{"main":{"op":"o","desc":"d","gen":9999999999999999999}}',
    '{"main":{"op":"o","desc":"d","gen":01}}',
    '{"main":{"op":"o","desc":"d\x01","gen":1}}',
    '{"main":{"op":"o","desc":"d\x7f","gen":1}}',
    '{"a":{"op":"o","desc":"d","gen":1},}',
    '{"a":{"op":"o","desc":"d","gen":1}{"b":{"op":"o","desc":"d","gen":1}}',
    '{"a":{"op":"o","desc":"\\"b\\":{\\"op\\"","gen":1}}',
    '{"b":{"op":"y","desc":"d","gen":2},"a":{"op":"x","desc":"d","gen":1},"b":{"op":"z","desc":"e","gen":3}}',
]


@pytest.mark.parametrize("text", CURRENT_TEXTS)
def test_current_decodes_as_the_strict_path(monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    expected = _strict(monkeypatch, codec.decode_current, text)
    outcome = _outcome(codec.decode_current, text)
    assert outcome == expected
    if outcome[0] == "ok":
        assert list(outcome[1]) == list(expected[1])  # sorted slot order too


@pytest.mark.parametrize(
    "text",
    [
        '{"main":{"op":"o","desc":"d","gen":1,"gen":2}}',
        '{"main":{"op":"o","desc":"d","desc":"e","gen":1}}',
    ],
)
def test_a_repeated_holder_field_that_leaves_three_keys_is_refused(text: str) -> None:
    with pytest.raises(CodecError) as info:
        codec.decode_current(text)
    assert info.value.field == "current"
    assert "duplicate field" in info.value.detail


H1 = '"a":{"op":"o","desc":"d","gen":1}'
H2 = '"b":{"op":"p","desc":"e","gen":2}'

MAP_TILING = [
    (f"{{{H1}}}", True),
    (f"{{{H1},{H2}}}", True),
    (f"{{{H2},{H1}}}", True),
    # The characters between and around the holders count.
    (f"{{{{{H1}}}", False),
    (f"{{{H1}}}}}", False),
    (f"{{{H1}}}{H2}}}", False),
    (f"{{{H1},,{H2}}}", False),
    (f"{{{H1}{H2}}}", False),
    (f"{{{H1},{H2},}}", False),
    (f"x{H1}}}", False),
    (f"{{{H1}", False),
    (f"{{{H1},", False),
]


@pytest.mark.parametrize(("text", "plain"), MAP_TILING)
def test_the_map_regex_path_takes_exactly_whole_canonical_maps(
    monkeypatch: pytest.MonkeyPatch, text: str, plain: bool
) -> None:
    """One findall reads the holders; their lengths and separators prove they tile the text."""
    got = codec._plain_current(text)
    assert (got is not None) == plain
    expected = _strict(monkeypatch, codec.decode_current, text)
    assert _outcome(codec.decode_current, text) == expected
    if plain:
        assert ("ok", got) == expected
        assert list(got) == sorted(got)


# The encoders' direct formatting (a map of plain holders, a pre-stats entry)
# must write exactly the text json writes on their general path.
ODD_TEXTS = ["", "plain", 'q"uote', "back\\slash", "tab\tnl\n", "\x01\x1f\x7f", "é ü 中 😀", "/"]


def _general(monkeypatch: pytest.MonkeyPatch, fn: Any, value: Any) -> Any:
    with monkeypatch.context() as m:
        m.setattr(codec, "_plain_map_text", lambda *a: None)
        m.setattr(codec, "_STATS_FIELDS_NONE", lambda *a: False)
        return _outcome(fn, value)


@pytest.mark.parametrize("text", ODD_TEXTS)
def test_a_plain_slot_map_is_written_as_json_writes_it(
    monkeypatch: pytest.MonkeyPatch, text: str
) -> None:
    from agentkeep.runs.domain import Assignee

    holder = Assignee(op=text or "o", desc=text or "d", gen=7)
    maps = [
        {text: holder},
        {"b": holder, text: Assignee(op="x", desc="y", gen=0), "a": holder},
        {"z": Assignee(op="o", desc="d", gen=2**63 - 1)},
    ]
    for m in maps:
        expected = _general(monkeypatch, codec.encode_current, m)
        assert _outcome(codec.encode_current, m) == expected
        assert codec._plain_map_text(m) is not None


@pytest.mark.parametrize("text", [*ODD_TEXTS, None])
def test_a_pre_stats_entry_is_written_as_json_writes_it(
    monkeypatch: pytest.MonkeyPatch, text: str | None
) -> None:
    from agentkeep.runs.domain import StepEntry

    for entry in (
        StepEntry(step_id="ST-" + (text or "1"), step_ref=text, status=text, at=0),
        StepEntry(step_id="ST-1", step_ref=text, status="s", at=2**64 - 1),
        StepEntry(step_id="ST-1", step_ref=text, status=None, at=5, attempt=2),
        StepEntry(
            step_id="ST-1", step_ref="r", status=text, at=5, binding_digest="sha256:" + "a" * 64
        ),
    ):
        expected = _general(monkeypatch, codec.encode_step_entry, entry)
        assert _outcome(codec.encode_step_entry, entry) == expected


def test_a_lone_surrogate_is_refused_by_the_direct_formatting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from agentkeep.runs.domain import Assignee, StepEntry

    m = {"s": Assignee.model_construct(op="\ud800", desc="d", gen=1)}
    entry = StepEntry.model_construct(
        **{**StepEntry.basic("ST-1", "r", "s", None, 1).__dict__, "status": "\udfff"}
    )
    for fn, value in ((codec.encode_current, m), (codec.encode_step_entry, entry)):
        expected = _general(monkeypatch, fn, value)
        assert expected[0] == "error"
        assert _outcome(fn, value) == expected
