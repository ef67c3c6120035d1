"""Canonical JSON encoding and strict decoding of the ``runs`` columns.

This module owns the text that goes into, and comes out of, the JSON columns
of the ``runs`` table (docs/runs.md#the-runs-table, docs/runs.md#encoding,
docs/runs.md#corrupt-rows), plus the type checks for the plain columns a
driver hands back and for the integers and strings an API caller hands in.
There is no database code here and so no fence (the fenced writes are
:mod:`agentkeep.runs.repository`'s); the repository passes raw column values
in and gets domain values (or a :class:`CodecError`) out.

Encoding (always canonical, because compare-and-set and filters compare
``status`` text byte for byte):

* compact separators, ``ensure_ascii=False``, no NaN/Infinity;
* struct fields in declared order; ``StepEntry.step_ref``/``status`` are
  written as ``null`` when None, every other optional field is omitted;
* map keys (the ``current`` map, keys inside ``adapter_data`` and
  ``result_ref``) sorted by code point, as Rust's ``BTreeMap`` does;
* an empty ``current`` map is SQL NULL (``None``), never ``{}``;
* a string holding a lone UTF-16 surrogate cannot be stored as UTF-8 and is
  refused (:class:`CodecError`).

Decoding follows serde_json, strictly (the JSON rules themselves are
:mod:`agentkeep.strict_json`'s, shared by every store):

* NaN, Infinity, -Infinity and out-of-range floats are refused;
* nesting deeper than 128 levels is refused, counted from the free JSON value
  (``result_ref``, ``adapter_data``): the entry arrays and the slot map add
  their own two levels on top;
* the container type must be exact (``current`` an object of Assignee
  objects, the entry columns arrays of objects);
* required keys must be present; unknown keys are ignored;
* integers must be JSON integers (no ``true``, no ``1.0``) inside their Rust
  range; strings must be strings;
* a field repeated inside a struct object (an entry, an Assignee, a usage
  object) is refused; a repeated unknown key of a struct is skipped like any
  unknown key, and a key repeated inside a free JSON value (``adapter_data``,
  ``result_ref``) or in the ``current`` map keeps the last value, all as
  serde does;
* lone UTF-16 surrogates (raw, or as a ``\\uD8xx`` escape) are refused;
* a value that is not text where text is stored (a BLOB, an integer) is
  refused; it is never read as empty or absent.

Decisions the original store did not make
(docs/decisions.md#generations-never-wrap): an Assignee ``gen`` (and so every
generation) above ``2**63-1`` is refused on decode, because the counter it must
not exceed is a ``BIGINT``; a usage object whose derived total
(``input + output``) overflows u64 is refused rather than wrapped.

Appends keep earlier entries verbatim: :func:`append_json_array` splices the
new element's text into the stored array text, so unknown keys written by
other versions survive (docs/decisions.md#appends-keep-earlier-entries-verbatim).
"""

from __future__ import annotations

import json
import json.encoder
import json.scanner
import operator
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Final, TypeVar

from agentkeep.bounds import I64_MAX, I64_MIN, U32_MAX, U64_MAX, check_u63
from agentkeep.checked_records import (
    fill,
    new_record,
    set_dict,
    set_extra,
    set_fields_set,
    set_private,
)
from agentkeep.errors import InvalidInput
from agentkeep.runs.domain import (
    UNSET,
    Assignee,
    DegradationEntry,
    PrefixedId,
    RunId,
    RunStatus,
    StepEntry,
    StepId,
    TaskId,
    Usage,
)
from agentkeep.strict_json import (
    JSON_MAX_DEPTH,
    DuplicateKeys,
    JsonError,
    dumps,
    has_lone_surrogate,
    json_value_problem,
    loads,
    loads_marking_duplicates,
)

__all__ = [
    "build_model",
    "model_builder",
    "CodecError",
    "append_json_array",
    "check_degradations",
    "check_step_entries",
    "check_text",
    "check_u63",
    "decode_current",
    "decode_degradations",
    "decode_id",
    "decode_result_ref",
    "decode_status",
    "decode_step_entries",
    "decode_text_or_none",
    "decode_u63",
    "encode_current",
    "encode_degradation",
    "encode_degradations",
    "encode_result_ref",
    "encode_status",
    "encode_step_entries",
    "encode_step_entry",
]


class CodecError(ValueError):
    """A column value could not be encoded or decoded.

    The repository turns it into ``RunCorrupt`` (decode) or an encode error,
    adding the table, row id and column.

    Attributes:
        field: the field name the messages use (``status``, ``step_entries``,
            ``degradations``, ``current``, ``result_ref``, ``id``,
            ``task_id``) or an integer/text column name (``next_generation``,
            ``created_at``, ``updated_at``, ``operator_sid``, ``input_json``).
        detail: what was wrong.
    """

    def __init__(self, field: str, detail: str) -> None:
        self.field = field
        self.detail = detail
        super().__init__(f"{field}: {detail}")


# --------------------------------------------------------------------------
# JSON primitives (the rules live in agentkeep.strict_json)

_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_JSON_WS: Final = " \t\n\r"
_MISSING: Final = object()
# The entry arrays and the slot map wrap free JSON (``adapter_data``) two
# levels down: an array of objects, or a map of objects.
_WRAPPED_DEPTH: Final = JSON_MAX_DEPTH + 2


def _kind(value: object) -> str:
    """Name a decoded JSON value's type the way serde's messages do."""
    if value is None:
        return "null"
    if value is True or value is False:
        return f"boolean `{'true' if value else 'false'}`"
    if type(value) is int:
        return f"integer `{value}`"
    if type(value) is float:
        return f"floating point `{value!r}`"
    if type(value) is str:
        return f"string {json.dumps(value, ensure_ascii=False)}"
    if type(value) is list:
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _describe_raw(raw: object) -> str:
    """Describe a column value of the wrong storage class, as a driver returned it."""
    if raw is None:
        return "NULL"
    if isinstance(raw, bytes | bytearray | memoryview):
        return "a BLOB"
    shown = repr(raw)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    if isinstance(raw, str):
        return f"text {shown}"
    return f"a {type(raw).__name__} ({shown})"


def _text(raw: object, field: str) -> str:
    if type(raw) is str:
        return raw
    raise CodecError(field, f"expected text, got {_describe_raw(raw)}")


def _json_error(field: str, exc: JsonError) -> CodecError:
    if exc.kind in ("surrogate", "depth"):
        return CodecError(field, str(exc))
    return CodecError(field, f"invalid JSON: {exc}")


def _loads(text: str, field: str, *, structs: bool) -> tuple[Any, bool]:
    """Parse ``text`` strictly.

    Returns the value and whether some object repeated a key (such objects
    come back as :class:`~agentkeep.strict_json.DuplicateKeys`). Duplicate
    detection is only done when ``structs`` is set, because only struct
    objects refuse them; otherwise a repeated key keeps its last value.
    """
    try:
        if structs:
            return loads_marking_duplicates(text, max_depth=_WRAPPED_DEPTH)
        return loads(text, duplicate_keys="last"), False
    except JsonError as exc:
        raise _json_error(field, exc) from None


def _dumps(value: object, field: str, *, sort_keys: bool = False) -> str:
    try:
        return dumps(value, sort_keys=sort_keys)
    except JsonError as exc:
        raise CodecError(field, str(exc)) from None


# The writer ``json`` uses for a string with ``ensure_ascii=False`` (quotes
# included), and for an integer: the texts of the directly formatted values.
_quote: Final = json.encoder.encode_basestring
_int_text: Final = int.__repr__


def _plain(value: Any) -> Any:
    """Turn every marked object (``DuplicateKeys``) inside a free JSON value into a plain dict."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if type(value) is list:
        return [_plain(v) for v in value]
    return value


# --------------------------------------------------------------------------
# Fast construction of validated values
#
# Decoded values were checked field by field below, so they are built without
# a second pydantic validation pass. ``model_construct`` is the supported way;
# filling the instance slots directly does the same work at a fraction of the
# cost and is verified against ``model_construct`` at import time.

_M = TypeVar("_M", StepEntry, DegradationEntry, Assignee, Usage)
_STEP_FIELDS: Final = frozenset(StepEntry.model_fields)
_DEGRADATION_FIELDS: Final = frozenset(DegradationEntry.model_fields)
_ASSIGNEE_FIELDS: Final = frozenset(Assignee.model_fields)
_USAGE_FIELDS: Final = frozenset(Usage.model_fields)
_str_new = str.__new__


_direct = fill  # agentkeep.checked_records: the instance slots set directly


def _via_construct(cls: type[_M], values: dict[str, Any]) -> _M:
    return cls.model_construct(**values)


def _pick_builder() -> Callable[[type[_M], dict[str, Any]], _M]:
    sample: dict[str, Any] = {"op": "o", "desc": "d", "gen": 1}
    try:
        fast = _direct(Assignee, dict(sample))
        slow = Assignee.model_construct(**sample)
        if (
            fast == slow
            and fast.__pydantic_fields_set__ == slow.__pydantic_fields_set__
            and hash(fast) == hash(slow)
            and fast.model_dump() == slow.model_dump()
        ):
            return _direct
    except Exception:  # pragma: no cover - a future pydantic changed its internals
        pass
    return _via_construct  # pragma: no cover


_build = _pick_builder()


def _checked_only(cls: type[_M], values: dict[str, Any]) -> _M:
    """The builder of a check that keeps no value (:func:`check_step_entries`): builds nothing."""
    return None  # type: ignore[return-value]  # the caller discards it


def build_model(cls: type[Any], values: dict[str, Any]) -> Any:
    """Build a frozen model from values that were already validated, without a second pydantic pass.

    Equivalent to ``cls.model_construct(**values)`` (checked once at import),
    about 4x cheaper. ``values`` must hold every field, in declaration order.
    """
    return _build(cls, values)


def model_builder() -> Callable[[type[Any], dict[str, Any]], Any]:
    """The function :func:`build_model` calls, for a caller that builds one model per row.

    Called as ``builder(cls, values)``, with :func:`build_model`'s rules; one
    call less per model than :func:`build_model`.
    """
    return _build


# --------------------------------------------------------------------------
# Field readers for struct objects (serde semantics)


def _obj(value: Any, field: str, where: str, fields: frozenset[str]) -> dict[str, Any]:
    """Return ``value`` as a struct object with ``fields``, or raise."""
    if type(value) is dict:
        return value
    if type(value) is DuplicateKeys:
        for key in value.duplicates:
            if key in fields:
                raise CodecError(field, f"{where}: duplicate field `{key}`")
        return value
    raise CodecError(field, f"{where}: invalid type: {_kind(value)}, expected an object")


def _req_str(o: dict[str, Any], key: str, field: str, where: str) -> str:
    v = o.get(key, _MISSING)
    if type(v) is str:
        return v
    if v is _MISSING:
        raise CodecError(field, f"{where}: missing field `{key}`")
    raise CodecError(field, f"{where}.{key}: invalid type: {_kind(v)}, expected a string")


def _opt_str(o: dict[str, Any], key: str, field: str, where: str) -> str | None:
    v = o.get(key)
    if v is None or type(v) is str:
        return v
    raise CodecError(field, f"{where}.{key}: invalid type: {_kind(v)}, expected a string")


def _int_in(v: Any, lo: int, hi: int, key: str, field: str, where: str, kind: str) -> int:
    if type(v) is int:
        if lo <= v <= hi:
            return v
        raise CodecError(field, f"{where}.{key}: invalid value: integer `{v}`, expected {kind}")
    raise CodecError(field, f"{where}.{key}: invalid type: {_kind(v)}, expected {kind}")


def _req_int(
    o: dict[str, Any], key: str, lo: int, hi: int, kind: str, field: str, where: str
) -> int:
    v = o.get(key, _MISSING)
    if type(v) is int and lo <= v <= hi:
        return v
    if v is _MISSING:
        raise CodecError(field, f"{where}: missing field `{key}`")
    return _int_in(v, lo, hi, key, field, where, kind)


def _opt_int(
    o: dict[str, Any], key: str, lo: int, hi: int, kind: str, field: str, where: str
) -> int | None:
    v = o.get(key)
    if v is None or (type(v) is int and lo <= v <= hi):
        return v
    return _int_in(v, lo, hi, key, field, where, kind)


# --------------------------------------------------------------------------
# status


_STATUS_TEXT: Final = {s: f'"{s.value}"' for s in RunStatus}
_STATUS_BY_TEXT: Final = {text: s for s, text in _STATUS_TEXT.items()}


def encode_status(s: RunStatus) -> str:
    """Encode a status as its JSON string literal, quotes included (``'"pending"'``).

    Raises:
        CodecError: ``s`` is not a run status.
    """
    try:
        text = _STATUS_TEXT.get(s)
    except TypeError:  # unhashable
        text = None
    if text is None:
        raise CodecError("status", f"not a run status: {s!r}")
    return text


def decode_status(raw: object) -> RunStatus:
    """Decode the ``status`` column (a JSON string literal such as ``"running"``).

    Raises:
        CodecError: not text, not JSON, not a JSON string, or an unknown
            variant (case-sensitive; ``pending`` without quotes is refused).
    """
    if type(raw) is str:
        status = _STATUS_BY_TEXT.get(raw)
        if status is not None:
            return status
    value, _ = _loads(_text(raw, "status"), "status", structs=False)
    if type(value) is not str:
        raise CodecError("status", f"invalid type: {_kind(value)}, expected a string")
    try:
        return RunStatus(value)
    except ValueError:
        expected = ", ".join(f"`{s.value}`" for s in RunStatus)
        raise CodecError(
            "status", f"unknown variant {json.dumps(value)}, expected one of {expected}"
        ) from None


# --------------------------------------------------------------------------
# step entries


def _usage_dict(u: Usage) -> dict[str, int]:
    return {
        "input_tokens": u.input_tokens,
        "output_tokens": u.output_tokens,
        "total_tokens": u.total_tokens,
    }


def _encode_step_entry(e: StepEntry, field: str) -> str:
    values = e.__dict__
    step_id, step_ref, status, at = values["step_id"], e.step_ref, e.status, e.at
    if (
        type(at) is int
        and isinstance(step_id, str)
        and (step_ref is None or type(step_ref) is str)
        and (status is None or type(status) is str)
        and _STATS_FIELDS_NONE(values)
    ):
        # A pre-stats entry, formatted directly (see _plain_map_text: the same
        # string writer and integer text as json; a test compares them).
        text = (
            f'{{"step_id":{_quote(str(step_id))},'
            f'"step_ref":{"null" if step_ref is None else _quote(step_ref)},'
            f'"status":{"null" if status is None else _quote(status)},'
            f'"at":{_int_text(at)}}}'
        )
        if not text.isascii() and has_lone_surrogate(text):
            raise CodecError(field, "a string contains a lone UTF-16 surrogate")
        return text
    d: dict[str, Any] = {
        "step_id": str(e.step_id),
        "step_ref": e.step_ref,
        "status": e.status,
    }
    if e.binding_digest is not None:
        d["binding_digest"] = e.binding_digest
    d["at"] = e.at
    if e.attempt is not None:
        d["attempt"] = e.attempt
    if e.started_at_ms is not None:
        d["started_at_ms"] = e.started_at_ms
    if e.completed_at_ms is not None:
        d["completed_at_ms"] = e.completed_at_ms
    if e.duration_ms is not None:
        d["duration_ms"] = e.duration_ms
    if e.worker_kind is not None:
        d["worker_kind"] = e.worker_kind
    if e.model is not None:
        d["model"] = e.model
    if e.usage is not None:
        d["usage"] = _usage_dict(e.usage)
    if e.num_turns is not None:
        d["num_turns"] = e.num_turns
    text = _dumps(d, field)
    if e.adapter_data is not None:
        # Free JSON: its object keys are sorted (serde_json's Value map).
        text = text[:-1] + ',"adapter_data":' + _dumps(e.adapter_data, field, sort_keys=True) + "}"
    return text


def _stats_fields_none() -> Callable[[dict[str, Any]], bool]:
    """A test that every field of a step entry's ``__dict__`` but the first four is None."""
    stats = tuple(
        n for n in StepEntry.model_fields if n not in ("step_id", "step_ref", "status", "at")
    )
    none = (None,) * len(stats)
    getter = operator.itemgetter(*stats)

    def test(values: dict[str, Any]) -> bool:
        return bool(getter(values) == none)

    return test


_STATS_FIELDS_NONE: Final = _stats_fields_none()


def encode_step_entry(e: StepEntry) -> str:
    """Encode one step entry as a compact JSON object, fields in declared order.

    Example: ``{"step_id":"ST-1","step_ref":"step-a","status":"dispatched","at":101}``.

    Raises:
        CodecError: (field ``step_entries``) the entry holds a value that is
            not storable JSON.
    """
    return _encode_step_entry(e, "step_entries")


def encode_step_entries(es: Sequence[StepEntry]) -> str:
    """Encode a list of step entries as a JSON array (``[]`` when empty).

    Raises:
        CodecError: (field ``step_entries``) an entry is not storable JSON.
    """
    return "[" + ",".join([_encode_step_entry(e, "step_entries") for e in es]) + "]"


def _decode_usage(v: Any, field: str, where: str) -> Usage | None:
    if v is None:
        return None
    o = _obj(v, field, where, _USAGE_FIELDS)
    inp = _opt_int(o, "input_tokens", 0, U64_MAX, "u64", field, where)
    out = _opt_int(o, "output_tokens", 0, U64_MAX, "u64", field, where)
    total = _opt_int(o, "total_tokens", 0, U64_MAX, "u64", field, where)
    inp = inp or 0
    out = out or 0
    if total is None:
        total = inp + out
        if total > U64_MAX:
            raise CodecError(field, f"{where}.total_tokens: input + output overflows u64")
    return _build(Usage, {"input_tokens": inp, "output_tokens": out, "total_tokens": total})


_STEP_PREFIX: Final = StepId.PREFIX
_STEP_PREFIX_LEN: Final = len(StepId.PREFIX)
_STEP_STATS_KEYS: Final = frozenset(
    {
        "binding_digest",
        "attempt",
        "started_at_ms",
        "completed_at_ms",
        "duration_ms",
        "worker_kind",
        "model",
        "usage",
        "num_turns",
        "adapter_data",
    }
)


# Every field of a pre-stats step entry, in declaration order, stats fields None.
_PRE_STATS: Final[dict[str, Any]] = {name: None for name in StepEntry.model_fields}


def _pre_stats_fields(step_id: StepId, step_ref: Any, status: Any, at: Any) -> dict[str, Any]:
    """The fields of a step entry written before step stats existed (every stats field None).

    A copy of :data:`_PRE_STATS` with the four values set (a copy keeps the
    declaration order and costs about half of building the dict).
    """
    fields = _PRE_STATS.copy()
    fields["step_id"] = step_id
    fields["step_ref"] = step_ref
    fields["status"] = status
    fields["at"] = at
    return fields


def _decode_step_entry(
    o: Any,
    index: int,
    dup_seen: bool,
    build: Callable[[type[StepEntry], dict[str, Any]], StepEntry] = _build,
) -> StepEntry:
    f = "step_entries"
    if type(o) is not dict:
        o = _obj(o, f, f"[{index}]", _STEP_FIELDS)
    get = o.get
    sid = get("step_id")
    step_ref = get("step_ref")
    status = get("status")
    at = get("at")
    if not (
        type(sid) is str
        and (step_ref is None or type(step_ref) is str)
        and (status is None or type(status) is str)
        and type(at) is int
        and 0 <= at <= U64_MAX
    ):
        # Slow path, only to name the offending key.
        w = f"[{index}]"
        _req_str(o, "step_id", f, w)
        _opt_str(o, "step_ref", f, w)
        _opt_str(o, "status", f, w)
        _req_int(o, "at", 0, U64_MAX, "u64", f, w)
    if len(sid) > _STEP_PREFIX_LEN and sid.startswith(_STEP_PREFIX) and "\x00" not in sid:
        # The StepId rule, inlined: this loop is the hot path of `get`.
        step_id = _str_new(StepId, sid)
    else:
        try:
            step_id = StepId(sid)
        except InvalidInput as exc:
            raise CodecError(f, f"[{index}].step_id: {exc}") from None
        raise AssertionError("unreachable: StepId accepted a rejected id")  # pragma: no cover
    if _STEP_STATS_KEYS.isdisjoint(o):
        # The common pre-stats entry: nothing else to check.
        if build is _checked_only:
            return None  # type: ignore[return-value]  # a check: nothing to build
        return build(StepEntry, _pre_stats_fields(step_id, step_ref, status, at))
    w = f"[{index}]"
    digest = get("binding_digest")
    if digest is not None and (type(digest) is not str or not _DIGEST.fullmatch(digest)):
        raise CodecError(
            f,
            f"{w}.binding_digest: invalid value: {_kind(digest)}, "
            "expected `sha256:` followed by 64 lowercase hex digits",
        )
    adapter_data = get("adapter_data")
    if dup_seen and adapter_data is not None:
        adapter_data = _plain(adapter_data)
    return build(
        StepEntry,
        {
            "step_id": step_id,
            "step_ref": step_ref,
            "status": status,
            "binding_digest": digest,
            "at": at,
            "attempt": _opt_int(o, "attempt", 0, U32_MAX, "u32", f, w),
            "started_at_ms": _opt_int(o, "started_at_ms", I64_MIN, I64_MAX, "i64", f, w),
            "completed_at_ms": _opt_int(o, "completed_at_ms", I64_MIN, I64_MAX, "i64", f, w),
            "duration_ms": _opt_int(o, "duration_ms", 0, U64_MAX, "u64", f, w),
            "worker_kind": _opt_str(o, "worker_kind", f, w),
            "model": _opt_str(o, "model", f, w),
            "usage": _decode_usage(get("usage"), f, f"{w}.usage"),
            "num_turns": _opt_int(o, "num_turns", 0, U32_MAX, "u32", f, w),
            "adapter_data": adapter_data,
        },
    )


# --------------------------------------------------------------------------
# The canonical fast path
#
# Most stored arrays and maps are exactly what this module writes: ASCII, no
# escape, pre-stats entries, holders of three fields. For those the strict
# decode (duplicate marking in a Python hook per object, the depth scan) is
# replaced by the C scanner alone and a proof that no object repeated a key:
# in a text without a backslash every ``"`` delimits a string, so the text
# holds ``count('"') / 2`` strings (keys and string values); the decoded
# value holds ``keys + string values`` of them, fewer exactly when an object
# repeated a key (the earlier occurrence and its value are dropped). Equal
# counts prove there was none. Anything else (non-ASCII, an escape, an
# unknown or stats key, a float, a count that differs, a syntax error) goes
# down the strict path, which then decides, so results and errors are the
# strict path's in every case.

_scan_once: Final = json.scanner.make_scanner(json.JSONDecoder())  # type: ignore[arg-type]


def _scan_canonical(text: str) -> Any:
    """``text`` decoded by the C scanner, or None when it is not plain ASCII JSON without escapes.

    The caller still checks the shape and the string count (see above).
    """
    if not text.isascii() or "\\" in text:
        return None
    try:
        value, end = _scan_once(text, 0)
    except (StopIteration, ValueError, RecursionError):
        return None
    return value if end == len(text) else None


# A canonical array of pre-stats entries, matched whole by one regex: exactly
# the four keys in their order, no whitespace, strings without a quote, a
# backslash or a control character (so each string's JSON value is its text),
# ``at`` a JSON integer without sign or leading zero. On an ASCII text (no lone
# surrogate) every match is a text the strict path accepts, with the same
# values, once ``at`` is checked against u64; anything else takes the scanner.
_PLAIN_STRING: Final = r'"[^"\\\x00-\x1f]*"'
_PRE_STATS_ENTRY: Final = (
    r'\{"step_id":"(' + re.escape(StepId.PREFIX) + r'[^"\\\x00-\x1f]+)",'
    r'"step_ref":(null|' + _PLAIN_STRING + r"),"
    r'"status":(null|' + _PLAIN_STRING + r"),"
    r'"at":(0|[1-9][0-9]{0,19})\}'
)
# Each entry with the character before it (``[`` for the first, ``,`` for the
# others), so that one findall both reads the entries and proves the whole
# text is ``[`` entry (``,`` entry)* ``]``: the matches do not overlap, so when
# the first starts with ``[``, every other with ``,``, the text ends with ``]``
# and their lengths add up to the text's length less that ``]``, they tile it.
_PRE_STATS_ITEMS: Final = re.compile(r"([\[,])" + _PRE_STATS_ENTRY)
# The length of an item without its four captured values.
_PRE_STATS_ITEM_FIXED: Final = len(
    '[{"step_id":"' + '","step_ref":' + ',"status":' + ',"at":' + "}"
)
_STEP_FIELDS_SET: Final = frozenset(StepEntry.model_fields)


def _plain_step_entries(text: str, build: bool) -> tuple[StepEntry, ...] | None:
    """The regex fast path of :func:`_fast_step_entries`; None: not such an array."""
    if not text.isascii() or not text.endswith("]"):
        return None
    items = _PRE_STATS_ITEMS.findall(text)
    if not items:
        return None
    covered = 1 + _PRE_STATS_ITEM_FIXED * len(items)  # the closing "]" and the fixed text
    out = []
    fast = build and _build is _direct
    expected_lead = "["
    for lead, sid, step_ref, status, at_text in items:
        covered += len(sid) + len(step_ref) + len(status) + len(at_text)
        at = int(at_text)
        if at > U64_MAX or lead != expected_lead:
            return None
        expected_lead = ","
        if build:
            fields = _PRE_STATS.copy()
            fields["step_id"] = _str_new(StepId, sid)
            fields["step_ref"] = None if step_ref == "null" else step_ref[1:-1]
            fields["status"] = None if status == "null" else status[1:-1]
            fields["at"] = at
            if fast:  # _direct, inlined, with the field set copied rather than built
                obj = new_record(StepEntry)
                set_dict(obj, fields)
                set_fields_set(obj, set(_STEP_FIELDS_SET))
                set_extra(obj, None)
                set_private(obj, None)
                out.append(obj)
            else:
                out.append(_build(StepEntry, fields))
    if covered != len(text):
        return None
    return tuple(out)


def _fast_step_entries(text: str, build: bool = True) -> tuple[StepEntry, ...] | None:
    """The canonical fast path of :func:`decode_step_entries`; None: take the strict path.

    ``build=False`` (:func:`check_step_entries`): only the checks; ``()`` when they pass.
    """
    plain = _plain_step_entries(text, build)
    if plain is not None:
        return plain
    items = _scan_canonical(text)
    if type(items) is not list:
        return None
    strings = 0
    out = []
    for o in items:
        if type(o) is not dict or len(o) != 4:
            return None
        get = o.get
        sid = get("step_id")
        step_ref = get("step_ref")
        status = get("status")
        at = get("at")
        if not (
            type(sid) is str
            and type(at) is int
            and 0 <= at <= U64_MAX
            and len(sid) > _STEP_PREFIX_LEN
            and sid.startswith(_STEP_PREFIX)
            and "\x00" not in sid
        ):
            return None
        strings += 1
        if type(step_ref) is str:
            strings += 1
        elif step_ref is not None or "step_ref" not in o:
            return None
        if type(status) is str:
            strings += 1
        elif status is not None or "status" not in o:
            return None
        if not build:
            continue
        fields = _pre_stats_fields(_str_new(StepId, sid), step_ref, status, at)
        out.append(_build(StepEntry, fields))
    # Four keys per entry: the text holds exactly these strings, no repeated key.
    if text.count('"') != 2 * (4 * len(items) + strings):
        return None
    return tuple(out)


# A canonical slot map, read by one findall (as the step array above): each
# holder exactly ``"slot":{"op":…,"desc":…,"gen":…}``, plain strings, ``gen``
# a JSON integer without sign or leading zero, checked against 2**63-1. Each
# holder is matched with the character after it (``,`` for all but the last,
# ``}`` for the last), so that one findall both reads the holders and proves
# the whole text is ``{`` holder (``,`` holder)* ``}``: a match starts with
# ``"``, so the text's first character, ``{``, is in none; when the matches'
# lengths add up to the text's length less that one, they tile the rest.
_HOLDER: Final = (
    r'"([^"\\\x00-\x1f]*)":\{"op":"([^"\\\x00-\x1f]*)",'
    r'"desc":"([^"\\\x00-\x1f]*)","gen":(0|[1-9][0-9]{0,18})\}'
)
_HOLDER_ITEMS: Final = re.compile(_HOLDER + r"([,}])")
# The length of a holder item without its four captured values.
_HOLDER_ITEM_FIXED: Final = len('"":{"op":"","desc":"","gen":}}')


def _plain_current(text: str) -> dict[str, Assignee] | None:
    """The regex fast path of :func:`_fast_current`; None: not such a map (or a repeated slot)."""
    if not text.isascii() or not text.startswith("{"):
        return None
    holders = _HOLDER_ITEMS.findall(text)
    if not holders:
        return None
    covered = 1 + _HOLDER_ITEM_FIXED * len(holders)  # the opening "{" and the fixed text
    commas = 0
    for slot, op, desc, gen_text, after in holders:
        covered += len(slot) + len(op) + len(desc) + len(gen_text)
        if after == ",":
            commas += 1
    # Every holder but the last followed by ",", the last by the closing "}".
    if covered != len(text) or commas != len(holders) - 1 or holders[-1][4] != "}":
        return None
    result: dict[str, Assignee] = {}
    for slot, op, desc, gen_text, _ in sorted(holders) if len(holders) > 1 else holders:
        gen = int(gen_text)
        if gen > I64_MAX or slot in result:
            return None  # out of range, or a repeated slot: the strict path decides
        result[slot] = _build(Assignee, {"op": op, "desc": desc, "gen": gen})
    return result


def _fast_current(text: str) -> dict[str, Assignee] | None:
    """The canonical fast path of :func:`decode_current`; None: take the strict path."""
    plain = _plain_current(text)
    if plain is not None:
        return plain
    value = _scan_canonical(text)
    if type(value) is not dict:
        return None
    result: dict[str, Assignee] = {}
    for slot in sorted(value):
        o = value[slot]
        if type(o) is not dict or len(o) != 3:
            return None
        op = o.get("op")
        desc = o.get("desc")
        gen = o.get("gen")
        if not (type(op) is str and type(desc) is str and type(gen) is int and 0 <= gen <= I64_MAX):
            return None
        result[slot] = _build(Assignee, {"op": op, "desc": desc, "gen": gen})
    # Per holder: its slot key, three keys, two string values.
    if text.count('"') != 12 * len(result):
        return None
    return result


def _array(raw: object, field: str) -> tuple[list[Any], bool]:
    if raw == "[]":
        return [], False
    value, dup_seen = _loads(_text(raw, field), field, structs=True)
    if type(value) is not list:
        raise CodecError(field, f"invalid type: {_kind(value)}, expected an array")
    return value, dup_seen


def decode_step_entries(raw: object) -> tuple[StepEntry, ...]:
    """Decode the ``step_entries_json`` column.

    Raises:
        CodecError: (field ``step_entries``) not text, not a JSON array, or
            an element that is not a valid step entry.
    """
    if type(raw) is str and raw != "[]":
        fast = _fast_step_entries(raw)
        if fast is not None:
            return fast
    items, dup_seen = _array(raw, "step_entries")
    return tuple([_decode_step_entry(v, i, dup_seen) for i, v in enumerate(items)])


def check_step_entries(raw: object) -> None:
    """Check the ``step_entries_json`` column as :func:`decode_step_entries` does, keeping nothing.

    The same checks, in the same code; only the entry values are not built
    (an append checks the stored array, then splices its text).

    Raises:
        CodecError: exactly when :func:`decode_step_entries` raises it.
    """
    if type(raw) is str and raw != "[]" and _fast_step_entries(raw, build=False) is not None:
        return
    items, dup_seen = _array(raw, "step_entries")
    for i, v in enumerate(items):
        _decode_step_entry(v, i, dup_seen, _checked_only)


# --------------------------------------------------------------------------
# degradations


def _encode_degradation(d: DegradationEntry, field: str) -> str:
    out: dict[str, Any] = {"tool": d.tool, "error": d.error, "fallback": d.fallback}
    if d.note is not None:
        out["note"] = d.note
    if d.step_ref is not None:
        out["step_ref"] = d.step_ref
    if d.attempt is not None:
        out["attempt"] = d.attempt
    out["at"] = d.at
    return _dumps(out, field)


def encode_degradation(d: DegradationEntry) -> str:
    """Encode one degradation entry (fields in declared order, None omitted).

    Raises:
        CodecError: (field ``degradations``) a string holds a lone surrogate.
    """
    return _encode_degradation(d, "degradations")


def encode_degradations(ds: Sequence[DegradationEntry]) -> str:
    """Encode degradation entries as a JSON array (``[]`` when empty).

    Raises:
        CodecError: (field ``degradations``) a string holds a lone surrogate.
    """
    return "[" + ",".join([_encode_degradation(d, "degradations") for d in ds]) + "]"


def _decode_degradation(
    value: Any,
    index: int,
    build: Callable[[type[DegradationEntry], dict[str, Any]], DegradationEntry] = _build,
) -> DegradationEntry:
    f = "degradations"
    w = f"[{index}]"
    o = _obj(value, f, w, _DEGRADATION_FIELDS)
    return build(
        DegradationEntry,
        {
            "tool": _req_str(o, "tool", f, w),
            "error": _req_str(o, "error", f, w),
            "fallback": _req_str(o, "fallback", f, w),
            "note": _opt_str(o, "note", f, w),
            "step_ref": _opt_str(o, "step_ref", f, w),
            "attempt": _opt_int(o, "attempt", 0, U32_MAX, "u32", f, w),
            "at": _req_int(o, "at", 0, U64_MAX, "u64", f, w),
        },
    )


def decode_degradations(raw: object) -> tuple[DegradationEntry, ...]:
    """Decode the ``degradations_json`` column.

    Raises:
        CodecError: (field ``degradations``) not text, not a JSON array, or
            an element that is not a valid degradation entry.
    """
    items, _ = _array(raw, "degradations")
    return tuple([_decode_degradation(v, i) for i, v in enumerate(items)])


def check_degradations(raw: object) -> None:
    """Check the ``degradations_json`` column as :func:`decode_degradations` does, keeping nothing.

    Raises:
        CodecError: exactly when :func:`decode_degradations` raises it.
    """
    items, _ = _array(raw, "degradations")
    for i, v in enumerate(items):
        _decode_degradation(v, i, _checked_only)


# --------------------------------------------------------------------------
# append


def append_json_array(raw_text: str, item_json: str) -> str:
    """Append one encoded element to a stored JSON array, keeping the rest verbatim.

    Every earlier element keeps its original text (unknown keys included);
    only the closing bracket moves. Whitespace after the closing bracket is
    dropped.

    Args:
        raw_text: the stored array text, already validated by a decode call.
        item_json: the encoded new element.

    Returns:
        The new array text.

    Raises:
        CodecError: (field ``array``) ``raw_text`` does not end with ``]``.
    """
    body = raw_text.rstrip(_JSON_WS)
    if not body.endswith("]"):
        raise CodecError("array", "stored text is not a JSON array")
    head = body[:-1].rstrip(_JSON_WS)
    if head.endswith("["):  # the array was empty: a value never ends with `[`
        return f"{head}{item_json}]"
    return f"{head},{item_json}]"


# --------------------------------------------------------------------------
# current


def _plain_map_text(m: Mapping[str, Assignee]) -> str | None:
    """:func:`encode_current`'s text, formatted directly; None: not a map of plain values.

    Only for a map whose slots and holder strings are exact ``str`` and whose
    ``gen`` values are exact ``int``: each string is written by the function
    ``json`` itself writes strings with here (``ensure_ascii=False``), each
    integer by ``int.__repr__``, as ``json`` does, so the text is the one
    :func:`encode_current` builds through ``json`` (a test compares them).
    A lone surrogate is refused as there. Anything else: None.
    """
    slots: Iterable[str] = m
    if len(m) > 1:
        for slot in m:
            if type(slot) is not str:
                return None  # sorted() would compare it with a str
        slots = sorted(m)
    parts = []
    for slot in slots:
        a = m[slot]
        op, desc, gen = a.op, a.desc, a.gen
        if not (type(slot) is str and type(op) is str and type(desc) is str and type(gen) is int):
            return None
        parts.append(
            f'{_quote(slot)}:{{"op":{_quote(op)},"desc":{_quote(desc)},"gen":{_int_text(gen)}}}'
        )
    text = "{" + ",".join(parts) + "}"
    if not text.isascii() and has_lone_surrogate(text):
        raise CodecError("current", "a string contains a lone UTF-16 surrogate")
    return text


def encode_current(m: Mapping[str, Assignee]) -> str | None:
    """Encode the slot map; an empty map is None (SQL NULL), never ``{}``.

    Keys are sorted by code point; each holder is ``{"op":…,"desc":…,"gen":…}``.

    Raises:
        CodecError: (field ``current``) a key is not a string, or a string
            holds a lone surrogate.
    """
    if not m:
        return None
    text = _plain_map_text(m)
    if text is not None:
        return text
    for slot in m:
        if not isinstance(slot, str):
            raise CodecError("current", f"slot {slot!r} is not a string")
    out: dict[str, dict[str, Any]] = {}
    for slot in sorted(m):
        a = m[slot]
        out[slot] = {"op": a.op, "desc": a.desc, "gen": a.gen}
    return _dumps(out, "current")


def decode_current(raw: object) -> dict[str, Assignee]:
    """Decode the ``current_json`` column into a slot map in sorted key order.

    SQL NULL and the text ``{}`` both read as the empty map.

    Raises:
        CodecError: (field ``current``) not text; not a JSON object (``null``,
            an array, ...); a value that is not an Assignee object (including
            a bare Assignee stored as the map itself, whose values ``op``,
            ``desc`` and ``gen`` are not objects); a missing key; a ``gen``
            that is not an integer in ``0..2**63-1``.
    """
    if raw is None:
        return {}
    text = _text(raw, "current")
    if text == "{}":
        return {}
    fast = _fast_current(text)
    if fast is not None:
        return fast
    value, _ = _loads(text, "current", structs=True)
    if not isinstance(value, dict):
        raise CodecError("current", f"invalid type: {_kind(value)}, expected a map")
    result: dict[str, Assignee] = {}
    for slot in sorted(value):
        o = value[slot]
        if type(o) is not dict:
            o = _obj(o, "current", _slot_where(slot), _ASSIGNEE_FIELDS)
        op = o.get("op")
        desc = o.get("desc")
        gen = o.get("gen")
        if type(op) is str and type(desc) is str and type(gen) is int and 0 <= gen <= I64_MAX:
            result[slot] = _build(Assignee, {"op": op, "desc": desc, "gen": gen})
        else:
            _assignee_error(o, slot)
    return result


def _slot_where(slot: str) -> str:
    return f"[{json.dumps(slot, ensure_ascii=False)}]"


def _assignee_error(o: dict[str, Any], slot: str) -> None:
    f = "current"
    w = _slot_where(slot)
    _req_str(o, "op", f, w)
    _req_str(o, "desc", f, w)
    _req_int(o, "gen", 0, I64_MAX, "an integer in 0..2**63-1", f, w)
    raise AssertionError("unreachable: the holder was valid")  # pragma: no cover


# --------------------------------------------------------------------------
# result_ref


def encode_result_ref(v: object) -> str | None:
    """Encode a result: :data:`UNSET` is None (SQL NULL), JSON null is ``'null'``.

    Object keys are sorted.

    Raises:
        CodecError: (field ``result_ref``) ``v`` is not a JSON value (a
            non-string key, NaN or infinity, an unsupported type, a lone
            surrogate, nesting deeper than 128).
    """
    if v is UNSET:
        return None
    problem = json_value_problem(v)
    if problem is not None:
        raise CodecError("result_ref", f"not a JSON value: {problem}")
    return _dumps(v, "result_ref", sort_keys=True)


def decode_result_ref(raw: object) -> object:
    """Decode ``result_ref_json``: NULL is :data:`UNSET`, any other text is JSON.

    Raises:
        CodecError: (field ``result_ref``) not text, or not strict JSON.
    """
    if raw is None:
        return UNSET
    value, _ = _loads(_text(raw, "result_ref"), "result_ref", structs=False)
    return value


# --------------------------------------------------------------------------
# plain columns

_IdT = TypeVar("_IdT", bound=PrefixedId)
_PREFIXED_NEW: Final = PrefixedId.__new__


def decode_id(raw: object, cls: type[_IdT], field: str) -> _IdT:
    """Decode an id column (``id``, ``task_id``) into ``cls``.

    Raises:
        CodecError: (field ``field``) not text, or the prefix rule fails.
    """
    if type(raw) is str and cls.__new__ is _PREFIXED_NEW:
        prefix = cls.PREFIX
        if len(raw) > len(prefix) and raw.startswith(prefix) and "\x00" not in raw:
            # PrefixedId's rule, inlined (every row read decodes two ids); the
            # class's own constructor below raises the error otherwise.
            return _str_new(cls, raw)
    try:
        return cls(_text(raw, field))
    except InvalidInput as exc:
        raise CodecError(field, str(exc)) from None


def _plain_ids() -> tuple[str, str] | None:
    """RunId's and TaskId's prefixes when both keep PrefixedId's rule (checked once)."""
    if RunId.__new__ is _PREFIXED_NEW and TaskId.__new__ is _PREFIXED_NEW:
        return RunId.PREFIX, TaskId.PREFIX
    return None  # pragma: no cover - a subclass with rules of its own


_ID_PREFIXES: Final = _plain_ids()


def decode_run_ids(raw_id: object, raw_task_id: object) -> tuple[RunId, TaskId]:
    """Decode a run row's ``id`` and ``task_id`` as :func:`decode_id` does, in one call.

    Returns:
        ``(RunId, TaskId)``.

    Raises:
        CodecError: (field ``id`` or ``task_id``) as :func:`decode_id`.
    """
    prefixes = _ID_PREFIXES
    if (
        prefixes is not None
        and type(raw_id) is str
        and type(raw_task_id) is str
        and len(raw_id) > len(prefixes[0])
        and len(raw_task_id) > len(prefixes[1])
        and raw_id.startswith(prefixes[0])
        and raw_task_id.startswith(prefixes[1])
        and "\x00" not in raw_id
        and "\x00" not in raw_task_id
    ):
        return _str_new(RunId, raw_id), _str_new(TaskId, raw_task_id)
    return decode_id(raw_id, RunId, "id"), decode_id(raw_task_id, TaskId, "task_id")


def decode_u63(raw: object, field: str) -> int:
    """Decode an integer column that must hold ``0..2**63-1``.

    Raises:
        CodecError: (field ``field``) not an integer (text, a BLOB, a float,
            NULL) or negative.
    """
    if type(raw) is int:
        if 0 <= raw <= I64_MAX:
            return raw
        raise CodecError(field, f"invalid value: {raw}, expected an integer in 0..2**63-1")
    raise CodecError(field, f"expected an integer, got {_describe_raw(raw)}")


def decode_text_or_none(raw: object, field: str) -> str | None:
    """Pass a nullable text column (``operator_sid``, ``input_json``) through.

    Raises:
        CodecError: (field ``field``) neither NULL nor text (a BLOB, a number).
    """
    if raw is None or type(raw) is str:
        return raw
    raise CodecError(field, f"expected text or NULL, got {_describe_raw(raw)}")


def check_text(value: str, field: str) -> str:
    """Check a text argument that is stored as-is (slot, op, ``input_json`` …).

    Returns:
        ``value``.

    Raises:
        InvalidInput: (field ``field``) not a ``str``, contains a NUL
            character (Postgres TEXT cannot hold it), or contains a lone UTF-16
            surrogate (no backend can store it as UTF-8).
    """
    if type(value) is str and value.isascii() and "\x00" not in value:
        return value  # the common case, without a call (ASCII: no surrogate)
    if not isinstance(value, str):
        raise InvalidInput(field, f"expected a string, got {type(value).__name__}")
    if "\x00" in value:
        raise InvalidInput(field, "contains a NUL character")
    if has_lone_surrogate(value):
        raise InvalidInput(field, "contains a lone UTF-16 surrogate")
    return value
