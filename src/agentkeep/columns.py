"""Shared value encodings: canonical JSON text and the JSON-value check.

Every store writes JSON it only round-trips as canonical text (sorted keys,
no whitespace, no NaN, UTF-8 as is) so that equal values give equal bytes:
idempotency checks compare parsed values, and content hashes stay stable.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Final

__all__ = ["JSON_MAX_DEPTH", "canonical_json", "json_value_problem"]

#: serde_json's default recursion limit, applied to values we accept.
JSON_MAX_DEPTH: Final = 128

_SURROGATE = re.compile("[\ud800-\udfff]")
_CANONICAL = json.JSONEncoder(
    ensure_ascii=False, allow_nan=False, sort_keys=True, separators=(",", ":")
)


def canonical_json(value: Any) -> str:
    """Encode a JSON value canonically (sorted keys, compact, no NaN).

    Raises:
        ValueError: ``value`` is not a JSON value (see :func:`json_value_problem`).
    """
    problem = json_value_problem(value)
    if problem is not None:
        raise ValueError(problem)
    return _CANONICAL.encode(value)


def json_value_problem(value: object) -> str | None:
    """Say why ``value`` is not a storable JSON value, or return None if it is.

    A storable JSON value is ``None``, ``bool``, ``int``, a finite ``float``,
    ``str``, a ``list`` or ``tuple`` of JSON values, or a ``dict`` with ``str``
    keys and JSON values, nested at most :data:`JSON_MAX_DEPTH` deep. Strings
    and keys must not contain lone UTF-16 surrogates (they cannot be stored as
    UTF-8).

    Args:
        value: the candidate value.

    Returns:
        None when the value is acceptable, else a short description of the
        first problem found.
    """
    return _json_problem(value, 0)


def _json_problem(value: object, depth: int) -> str | None:
    if value is None or value is True or value is False:
        return None
    if isinstance(value, str):
        if not value.isascii() and _SURROGATE.search(value):
            return "a string contains a lone UTF-16 surrogate"
        return None
    if isinstance(value, int):
        return None
    if isinstance(value, float):
        return None if math.isfinite(value) else f"{value!r} is not a JSON number"
    if isinstance(value, list | tuple):
        if depth >= JSON_MAX_DEPTH:
            return f"nested deeper than {JSON_MAX_DEPTH} levels"
        for item in value:
            problem = _json_problem(item, depth + 1)
            if problem is not None:
                return problem
        return None
    if isinstance(value, dict):
        if depth >= JSON_MAX_DEPTH:
            return f"nested deeper than {JSON_MAX_DEPTH} levels"
        for key, item in value.items():
            if not isinstance(key, str):
                return f"object key {key!r} is not a string"
            if not key.isascii() and _SURROGATE.search(key):
                return "an object key contains a lone UTF-16 surrogate"
            problem = _json_problem(item, depth + 1)
            if problem is not None:
                return problem
        return None
    return f"{type(value).__name__} is not a JSON type"
