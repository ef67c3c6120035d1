"""Strict JSON: the one decoder, the canonical encoder and the value check of every store.

Every store reads and writes its JSON through this module, so the rules below
are written once:

* ``NaN``, ``Infinity`` and ``-Infinity`` are not JSON and are refused, and so
  is a number literal too large for a float (``1e999``). Integers of any size
  are kept exactly (Python's own limit of 4300 digits still applies).
* An object must not repeat a key. Two decoders relax this for the runs codec,
  which follows serde: :func:`loads` with ``duplicate_keys="last"`` keeps the
  last value, and :func:`loads_marking_duplicates` keeps the last value but
  marks the object (a :class:`DuplicateKeys`) so that the codec can refuse a
  repeated *field* of a struct and let a repeated unknown key pass.
* A string or key must not hold a lone UTF-16 surrogate, neither raw (only a
  Python ``str`` can carry one) nor as a ``\\uD8xx`` escape without its pair:
  UTF-8, and so neither backend, can store it. A valid escaped pair
  (``\\ud83d\\ude00``) is one character and is fine.
* Arrays and objects nest at most :data:`JSON_MAX_DEPTH` (128) levels, the
  recursion limit of serde_json that the original stores decoded with. A value
  counts its own container as level 1: 128 nested arrays pass, 129 do not.
* Bytes must be UTF-8 (no other encoding is detected, and a byte-order mark is
  not JSON).

Decoding (:func:`loads`) raises :class:`JsonError`, a ``ValueError``, whose
``kind`` says which rule failed and whose message names the position (syntax,
UTF-8) or the offending item (the constant, number, key or string). Callers
render it in their own error type; see :data:`JsonErrorKind`.

Encoding: :func:`canonical_json` is the canonical text every store writes
(sorted keys, no whitespace, ``ensure_ascii=False`` so UTF-8 is kept as is, no
NaN), after :func:`json_value_problem` accepted the value, so that equal values
give equal bytes. :func:`dumps` is the same encoder without the value walk, for
values whose types were checked already (the runs codec's domain models); it
still refuses what the encoder refuses and lone surrogates.

Speed: these functions run on the stores' hot paths. The decoders are built
once (``json.loads`` with keyword arguments builds one per call); the duplicate
check runs in C (``dict(pairs)``) and only names the key on failure; the
surrogate walk runs only when UTF-8 encoding of a ``str`` fails or a regex
finds a surrogate escape (and the regex only when the text holds a backslash,
which ``memchr`` rules out for most texts); the depth check
works on the UTF-8 bytes with C-level ``translate``/``count``/``replace``, not
on the decoded value, and stops early when the text is too short or has too
few brackets to be that deep.
"""

from __future__ import annotations

import json
import math
import re
import threading
from collections.abc import Callable
from typing import Any, Final, Literal, TypeAlias

__all__ = [
    "JSON_MAX_DEPTH",
    "DuplicateKeys",
    "JsonError",
    "JsonErrorKind",
    "canonical_bytes",
    "canonical_json",
    "dumps",
    "has_lone_surrogate",
    "json_value_problem",
    "loads",
    "loads_marking_duplicates",
]

#: Deepest nesting of arrays/objects accepted (serde_json's recursion limit).
JSON_MAX_DEPTH: Final = 128

JsonErrorKind: TypeAlias = Literal[
    "utf8", "syntax", "constant", "number", "duplicate_key", "surrogate", "depth", "value"
]
"""Which rule a :class:`JsonError` reports.

``utf8``: bytes that are not UTF-8 (``pos`` is the byte offset). ``syntax``:
text that is not JSON (``pos`` is the character offset; the message gives line
and column). ``constant``: ``NaN``/``Infinity``/``-Infinity`` (``what``).
``number``: a float literal out of range, or an integer literal beyond
Python's digit limit (``what`` when known). ``duplicate_key``: an object
repeats ``what``. ``surrogate``: the string or key ``what`` holds a lone
surrogate. ``depth``: nested deeper than the limit. ``value`` (encoding only):
the Python value is not a JSON value.
"""


class JsonError(ValueError):
    """A JSON text (or a value to encode) breaks one of the rules of this module.

    A ``ValueError``, so callers that catch ``ValueError`` (the store codecs
    did, around ``json.loads``) keep catching it.

    Attributes:
        kind: which rule failed (:data:`JsonErrorKind`).
        message: the human-readable text (also ``str(error)``).
        pos: the offset of a ``utf8`` (bytes) or ``syntax`` (characters)
            error, else None.
        what: the offending constant, number literal, key or string, when known.
    """

    def __init__(
        self, kind: JsonErrorKind, message: str, *, pos: int | None = None, what: str | None = None
    ) -> None:
        self.kind: JsonErrorKind = kind
        self.message = message
        self.pos = pos
        self.what = what
        super().__init__(message)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.kind, self.message), {"pos": self.pos, "what": self.what})


class DuplicateKeys(dict[str, Any]):
    """An object of :func:`loads_marking_duplicates` that repeated a key; values are last-wins.

    Attributes:
        duplicates: the repeated keys, in input order (a key repeated twice is
            listed twice).
    """

    __slots__ = ("duplicates",)
    duplicates: list[str]


# --------------------------------------------------------------------------
# Decoding


def _reject_constant(name: str) -> Any:
    raise JsonError("constant", f"{name} is not valid JSON", what=name)


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise JsonError("number", f"number {text} is out of range", what=text)
    return value


def _first_repeated(pairs: list[tuple[str, Any]]) -> str:
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            return key
        seen.add(key)
    raise AssertionError("unreachable: no key repeats")  # pragma: no cover


def _refuse_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) == len(pairs):
        return obj
    key = _first_repeated(pairs)
    raise JsonError("duplicate_key", f"duplicate JSON key {key!r}", what=key)


_marked = threading.local()


def _mark_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) == len(pairs):
        return obj
    _marked.seen = True
    marked = DuplicateKeys(obj)
    marked.duplicates = []
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            marked.duplicates.append(key)
        seen.add(key)
    return marked


def _scanning(decoder: json.JSONDecoder) -> Callable[[str], Any]:
    """``decoder.decode`` by its C scanner alone when the text is one value edge to edge.

    ``decode`` wraps the scanner in three Python calls and two regex matches
    (leading and trailing whitespace), a quarter of a small document's
    decode. A text with surrounding whitespace, trailing data or an error at
    its start goes to ``decode`` itself, so every outcome (value, error type
    and message) is ``decode``'s; an error raised inside the scan (a hook's,
    a bad number, the recursion limit) propagates as it would from ``decode``.
    """
    # scan_once is set by JSONDecoder.__init__ (the C scanner), not in typeshed's stub.
    scan: Callable[[str, int], tuple[Any, int]] = decoder.scan_once  # type: ignore[attr-defined]
    decode = decoder.decode

    def scan_or_decode(text: str) -> Any:
        try:
            value, end = scan(text, 0)
        except StopIteration:
            return decode(text)
        return value if end == len(text) else decode(text)

    return scan_or_decode


_DECODE_REFUSE: Final = _scanning(
    json.JSONDecoder(
        parse_constant=_reject_constant,
        parse_float=_finite_float,
        object_pairs_hook=_refuse_duplicates,
    )
)
# Without a pairs hook the C scanner builds the dicts itself: the fastest path.
_DECODE_LAST: Final = _scanning(
    json.JSONDecoder(parse_constant=_reject_constant, parse_float=_finite_float)
)
_DECODE_MARK: Final = _scanning(
    json.JSONDecoder(
        parse_constant=_reject_constant,
        parse_float=_finite_float,
        object_pairs_hook=_mark_duplicates,
    )
)

# An escaped surrogate, paired or not (the walk decides).
_SURROGATE_ESCAPE: Final = re.compile(r"\\u[dD][89a-fA-F]")
# The depth check reduces UTF-8 text to its "shape": quotes and brackets only
# (``{}`` read as ``[]``). Multi-byte UTF-8 sequences never hold ASCII bytes.
_SHAPE_TABLE: Final = bytes.maketrans(b"{}", b"[]")
_SHAPE_DELETE: Final = bytes(c for c in range(256) if c not in b'"[]{}')
_SHAPE_STRING: Final = re.compile(rb'"[^"]*"')


def _show(text: str) -> str:
    """A short ASCII rendering of a string for an error message."""
    shown = ascii(text)
    return shown if len(shown) <= 60 else shown[:57] + "..."


def _not_utf8(text: str) -> bool:
    """Whether non-ASCII ``text`` holds a surrogate: encoding is faster than a regex scan."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # UTF-8 refuses nothing else
        return True
    return False


def has_lone_surrogate(text: str) -> bool:
    """Whether ``text`` holds a lone UTF-16 surrogate (which UTF-8 cannot store)."""
    return not text.isascii() and _not_utf8(text)


def _lone_surrogate(value: object) -> str | None:
    """The first string or key of a decoded value that holds a lone surrogate, else None."""
    stack = [value]
    while stack:
        item = stack.pop()
        if type(item) is str:
            if has_lone_surrogate(item):
                return item
        elif type(item) is list:
            stack.extend(item)
        elif isinstance(item, dict):
            for key, sub in item.items():
                if has_lone_surrogate(key):
                    return str(key)
                stack.append(sub)
    return None


def _too_deep(text: str, raw: bytes | None, limit: int) -> bool:
    """Whether valid JSON ``text`` (``raw``: its UTF-8, if at hand) nests deeper than ``limit``.

    Works on the bytes with C-level operations, never on the decoded value:
    escaped backslashes and quotes are dropped, then every byte but quotes and
    brackets; strings are dropped (all at once when none holds a bracket: then
    the quotes pair up as ``""``); each ``replace(b"[]", b"")`` pass then
    removes exactly the innermost containers, so the depth is the number of
    passes that empties the shape.
    """
    if raw is None:
        raw = text.encode("utf-8", "surrogatepass")
    if b"\\" in raw:
        # Left to right, ``\\`` pairs first, as JSON reads escapes; then ``\"``.
        raw = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    shape = raw.translate(_SHAPE_TABLE, _SHAPE_DELETE)
    if shape.count(b"[") <= limit:
        return False  # fewer brackets than levels (brackets in strings counted too)
    quotes = shape.count(b'"')
    if quotes:
        if shape.count(b'""') * 2 == quotes:
            shape = shape.translate(None, b'"')  # no string holds a bracket
        else:
            shape = _SHAPE_STRING.sub(b"", shape)
    for _ in range(limit):
        shape = shape.replace(b"[]", b"")
        if not shape:
            return False
    return True


def _decode(decode: Any, data: str | bytes | bytearray | memoryview, max_depth: int) -> Any:
    raw: bytes | None = None
    raw_surrogate = False
    if isinstance(data, str):
        text = data
        if not text.isascii():
            try:
                raw = text.encode("utf-8")  # also the cheapest scan for raw surrogates
            except UnicodeEncodeError:
                raw_surrogate = True
    else:
        raw = data if type(data) is bytes else bytes(data)
        try:
            text = raw.decode("utf-8")  # strict: a surrogate is not UTF-8
        except UnicodeDecodeError as exc:
            raise JsonError("utf8", str(exc), pos=exc.start) from None
    try:
        value = decode(text)
    except JsonError:
        raise
    except json.JSONDecodeError as exc:
        raise JsonError("syntax", str(exc), pos=exc.pos) from None
    except RecursionError:
        raise JsonError("depth", f"nested deeper than {max_depth} levels") from None
    except ValueError as exc:  # an integer literal beyond Python's digit limit
        raise JsonError("number", str(exc)) from None
    if len(text) > 2 * max_depth and _too_deep(text, raw, max_depth):  # a level takes 2 chars
        raise JsonError("depth", f"nested deeper than {max_depth} levels")
    # memchr finds no backslash in most texts; only then does the regex run.
    if raw_surrogate or ("\\" in text and _SURROGATE_ESCAPE.search(text)):
        bad = _lone_surrogate(value)
        if bad is not None:
            raise JsonError(
                "surrogate", f"a string contains a lone UTF-16 surrogate: {_show(bad)}", what=bad
            )
    return value


def loads(
    data: str | bytes | bytearray | memoryview,
    *,
    duplicate_keys: Literal["refuse", "last"] = "refuse",
    max_depth: int = JSON_MAX_DEPTH,
) -> Any:
    """Decode one JSON document strictly.

    Args:
        data: the text, or its UTF-8 bytes.
        duplicate_keys: ``"refuse"`` (the rule) or ``"last"`` (serde's
            ``Value`` map: a repeated key keeps its last value).
        max_depth: the deepest nesting accepted; a caller whose document wraps
            free JSON values in its own containers adds their levels.

    Returns:
        The value: ``dict``, ``list``, ``str``, ``int``, ``float``, ``bool`` or None.

    Raises:
        JsonError: ``data`` breaks a rule of this module (see :data:`JsonErrorKind`).
    """
    return _decode(_DECODE_REFUSE if duplicate_keys == "refuse" else _DECODE_LAST, data, max_depth)


def loads_marking_duplicates(
    data: str | bytes | bytearray | memoryview, *, max_depth: int = JSON_MAX_DEPTH
) -> tuple[Any, bool]:
    """Decode like :func:`loads`, but keep objects that repeat a key, marked.

    An object that repeats a key comes back as a :class:`DuplicateKeys` (last
    value wins) listing the repeated keys; every other object is a plain
    ``dict``. Serde-shaped codecs use it to refuse a repeated field of a
    struct while a repeated unknown key, or a key repeated inside a free JSON
    value, passes.

    Returns:
        The value, and whether some object repeated a key.

    Raises:
        JsonError: as :func:`loads`, never of kind ``duplicate_key``.
    """
    _marked.seen = False
    value = _decode(_DECODE_MARK, data, max_depth)
    return value, _marked.seen


# --------------------------------------------------------------------------
# Encoding

_ENCODE_SORTED: Final = json.JSONEncoder(
    ensure_ascii=False, allow_nan=False, sort_keys=True, separators=(",", ":")
).encode
_ENCODE_IN_ORDER: Final = json.JSONEncoder(
    ensure_ascii=False, allow_nan=False, separators=(",", ":")
).encode


def _walked_encoder() -> Any:
    """``_ENCODE_SORTED`` for values :func:`json_value_problem` accepted, or None.

    ``JSONEncoder.encode`` builds its C encoder on every call; this one is
    built once, without the circular-reference bookkeeping, which a walked
    value does not need (it is at most 128 levels deep, so it has no cycle).
    The C encoder is the one ``JSONEncoder.encode`` uses, with its
    arguments; if this Python has none, or builds it otherwise, None.
    """
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:  # pragma: no cover - CPython has the C encoder
        return None
    try:
        scan = make(
            None,
            _reject_unknown,
            json.encoder.encode_basestring,
            None,
            ":",
            ",",
            True,
            False,
            False,
        )
        sample = {"b": [1, 2.5, "é\n", None, True], "a": {"z": -0.0, "y": 10**30}}
        if "".join(scan(sample, 0)) != _ENCODE_SORTED(sample):  # pragma: no cover
            return None
    except Exception:  # pragma: no cover - another signature
        return None

    def encode(value: Any) -> str:
        if isinstance(value, str):
            return _ENCODE_SORTED(value)
        return "".join(scan(value, 0))

    return encode


def _reject_unknown(value: object) -> Any:
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


_ENCODE_WALKED: Final = _walked_encoder() or _ENCODE_SORTED


def json_value_problem(value: object, depth: int = 0) -> str | None:
    """Say why ``value`` is not a storable JSON value, or return None if it is.

    A storable JSON value is ``None``, ``bool``, ``int``, a finite ``float``,
    ``str``, a ``list`` or ``tuple`` of JSON values, or a ``dict`` with ``str``
    keys and JSON values, nested at most :data:`JSON_MAX_DEPTH` deep. Strings
    and keys must not contain lone UTF-16 surrogates (they cannot be stored as
    UTF-8). Subclasses (a ``str`` enum, ``bool``) count as their base type.

    Args:
        value: the candidate value.
        depth: how deep ``value`` sits inside the value that will be encoded
            (a field of an object: 1): its own nesting may go
            ``JSON_MAX_DEPTH - depth`` levels.

    Returns:
        None when the value is acceptable, else a short description of the
        first problem found.
    """
    return _json_problem(value, depth)


# Leaves of these exact types are always storable; the walk skips them inline.
_PLAIN_LEAVES: Final = frozenset({type(None), bool, int})
_SURROGATE_STRING: Final = "a string contains a lone UTF-16 surrogate"


def _json_problem(value: object, depth: int) -> str | None:
    # Exact types first (the common case), a plain leaf inside a container
    # without a call of its own; subclasses (a str enum, an IntEnum) take the
    # isinstance chain at the end. Items are checked in order, a key before
    # its value, so the first problem is the one a plain recursive walk finds.
    if type(value) in _PLAIN_LEAVES:
        return None
    if type(value) is str:
        return None if value.isascii() or not _not_utf8(value) else _SURROGATE_STRING
    if type(value) is list or type(value) is tuple or isinstance(value, list | tuple):
        if depth >= JSON_MAX_DEPTH:
            return f"nested deeper than {JSON_MAX_DEPTH} levels"
        for item in value:
            if type(item) in _PLAIN_LEAVES:
                continue
            if type(item) is str:
                if item.isascii() or not _not_utf8(item):
                    continue
                return _SURROGATE_STRING
            problem = _json_problem(item, depth + 1)
            if problem is not None:
                return problem
        return None
    if type(value) is dict or isinstance(value, dict):
        if depth >= JSON_MAX_DEPTH:
            return f"nested deeper than {JSON_MAX_DEPTH} levels"
        for key, item in value.items():
            if type(key) is not str and not isinstance(key, str):
                return f"object key {key!r} is not a string"
            if not key.isascii() and _not_utf8(key):
                return "an object key contains a lone UTF-16 surrogate"
            if type(item) in _PLAIN_LEAVES:
                continue
            if type(item) is str:
                if item.isascii() or not _not_utf8(item):
                    continue
                return _SURROGATE_STRING
            problem = _json_problem(item, depth + 1)
            if problem is not None:
                return problem
        return None
    if value is True or value is False or value is None:
        return None
    if isinstance(value, str):
        return None if value.isascii() or not _not_utf8(value) else _SURROGATE_STRING
    if isinstance(value, int):
        return None
    if isinstance(value, float):
        return None if math.isfinite(value) else f"{value!r} is not a JSON number"
    return f"{type(value).__name__} is not a JSON type"


def canonical_json(value: Any) -> str:
    """Encode a JSON value canonically: sorted keys, compact, UTF-8 kept, no NaN.

    Raises:
        JsonError: (kind ``value``, a ``ValueError``) ``value`` is not a JSON
            value; the message is :func:`json_value_problem`'s.
    """
    problem = json_value_problem(value)
    if problem is not None:
        raise JsonError("value", problem)
    try:
        return _ENCODE_WALKED(value)
    except ValueError as exc:  # an integer beyond Python's digit limit
        raise JsonError("value", str(exc)) from None


def canonical_json_checked(value: Any) -> str:
    """:func:`canonical_json` of a value the caller checked: the encoding without the walk.

    For a value whose :func:`json_value_problem` is None (the caller walked
    its parts): the same text as :func:`canonical_json`, without walking the
    value a second time.

    Raises:
        JsonError: (kind ``value``) an integer beyond Python's digit limit.
    """
    try:
        return _ENCODE_WALKED(value)
    except ValueError as exc:
        raise JsonError("value", str(exc)) from None


def canonical_bytes(value: Any) -> bytes:
    """:func:`canonical_json` as UTF-8 bytes.

    Raises:
        JsonError: (a ``ValueError``) ``value`` is not a JSON value.
    """
    return canonical_json(value).encode("utf-8")


def dumps(value: Any, *, sort_keys: bool = True) -> str:
    """Encode compactly (``ensure_ascii=False``, no NaN) a value whose types were checked.

    No :func:`json_value_problem` walk: the caller vouches for key types and
    depth (``json`` would turn an ``int`` key into a string silently). Use
    :func:`canonical_json` for values straight from a caller.

    Args:
        value: the value.
        sort_keys: sort object keys (canonical); False keeps insertion order,
            for structs encoded in declared field order.

    Raises:
        JsonError: kind ``value`` for NaN or infinity, a type ``json`` cannot
            encode, a circular reference or too deep a structure; kind
            ``surrogate`` for a string holding a lone surrogate.
    """
    try:
        text: str = (_ENCODE_SORTED if sort_keys else _ENCODE_IN_ORDER)(value)
    except (TypeError, ValueError, RecursionError) as exc:
        raise JsonError("value", f"not encodable as JSON: {exc}") from None
    if not text.isascii() and _not_utf8(text):
        raise JsonError("surrogate", "a string contains a lone UTF-16 surrogate")
    return text
