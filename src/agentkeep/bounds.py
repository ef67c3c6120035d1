"""Integer bounds of the stores, defined once, with the checks that apply them.

Two ranges matter, and which one a value gets depends on where it lives:

* ``0..I64_MAX`` (``2**63-1``, the "u63" range): every integer the stores keep
  in a column of their own — times in milliseconds, generations, fencing
  tokens, counters, ``LIMIT``/``OFFSET`` binds. Both backends store them in a
  signed 64-bit column (``BIGINT`` on Postgres, ``INTEGER`` on SQLite), so a
  larger value cannot be stored: it is refused as input
  (:func:`check_u63`), and counters that must grow saturate there
  (:func:`saturating_add`) instead of wrapping. Negative values have no meaning
  for them and are refused too.
* ``0..U64_MAX`` (``2**64-1``): caller-facing ``u64`` values that the original
  (Rust) stores accepted, and that are therefore accepted here too
  (:func:`check_u64`): values kept inside JSON rather than in an integer column
  (a step entry's ``at``, token usage), values only compared and never stored
  (a compare-and-set's ``expected_gen``: one above ``I64_MAX`` is a valid
  question that never matches), and values bit-reinterpreted into a signed
  column (a boundary receipt's sequence).

:data:`I64_MIN` and :data:`U32_MAX` are the other Rust ranges that appear in
JSON (signed ``i64`` timestamps, ``u32`` attempt counts).

The pydantic field types :data:`U32`, :data:`U64`, :data:`I64` and
:data:`U63` apply the same ranges to model fields, strictly (an ``int``, never
a ``bool``, a float or a numeric string).
"""

from __future__ import annotations

from typing import Annotated, Final

from pydantic import Field, Strict

from agentkeep.errors import InvalidInput

__all__ = [
    "I64",
    "I64_MAX",
    "I64_MIN",
    "U32",
    "U32_MAX",
    "U63",
    "U64",
    "U64_MAX",
    "check_u63",
    "check_u64",
    "saturating_add",
]

#: The largest value of a signed 64-bit column; the top of every stored counter.
I64_MAX: Final = 2**63 - 1
#: The smallest signed 64-bit value (``i64`` timestamps kept in JSON).
I64_MIN: Final = -(2**63)
#: The largest ``u64``: the top of caller-facing values the original stores accepted.
U64_MAX: Final = 2**64 - 1
#: The largest ``u32`` (attempt and turn counts kept in JSON).
U32_MAX: Final = 2**32 - 1

U32 = Annotated[int, Strict(), Field(ge=0, le=U32_MAX)]
"""A strict ``int`` in ``0..2**32-1``."""
U64 = Annotated[int, Strict(), Field(ge=0, le=U64_MAX)]
"""A strict ``int`` in ``0..2**64-1``."""
I64 = Annotated[int, Strict(), Field(ge=I64_MIN, le=I64_MAX)]
"""A strict ``int`` in ``-2**63..2**63-1``."""
U63 = Annotated[int, Strict(), Field(ge=0, le=I64_MAX)]
"""A strict ``int`` in ``0..2**63-1``: what a signed 64-bit column holds of a non-negative value."""


def check_u63(value: object, field: str) -> int:
    """Check an integer argument bound for a signed 64-bit column: ``0..2**63-1``.

    Returns:
        ``value``.

    Raises:
        InvalidInput: (field ``field``) not an ``int`` (``bool`` included), or
            outside ``0..2**63-1``.
    """
    if type(value) is not int:
        raise InvalidInput(field, f"expected an integer, got {type(value).__name__}")
    if not 0 <= value <= I64_MAX:
        raise InvalidInput(field, f"must be in 0..2**63-1, got {value}")
    return value


def check_u64(value: object, field: str) -> int:
    """Check a caller-facing ``u64`` argument: an ``int`` in ``0..2**64-1``.

    Returns:
        ``value``.

    Raises:
        InvalidInput: (field ``field``) not an ``int`` (``bool`` included), or
            outside ``0..2**64-1``.
    """
    if type(value) is not int:
        raise InvalidInput(field, f"expected an integer, got {type(value).__name__}")
    if not 0 <= value <= U64_MAX:
        raise InvalidInput(field, f"must be in 0..2**64-1, got {value}")
    return value


def saturating_add(a: int, b: int) -> int:
    """``a + b`` capped at ``2**63-1`` (the largest value a signed 64-bit column holds)."""
    return min(a + b, I64_MAX)
