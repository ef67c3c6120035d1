"""The integer bounds of :mod:`agentkeep.bounds`, and the old names that re-bind them.

* the constants are the Rust ranges (i64, u64, u32);
* :func:`check_u63` and :func:`check_u64` accept their edges and refuse
  ``bool``, floats, strings and values one past either edge;
* :func:`saturating_add` caps at ``2**63-1``;
* the pydantic field types apply the same ranges, strictly;
* every store's old name is the same value or function.
"""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from agentkeep.bounds import (
    I64,
    I64_MAX,
    I64_MIN,
    U32,
    U32_MAX,
    U63,
    U64,
    U64_MAX,
    check_u63,
    check_u64,
    saturating_add,
)
from agentkeep.errors import InvalidInput


def test_constants() -> None:
    assert I64_MAX == 9223372036854775807 == 2**63 - 1
    assert I64_MIN == -(2**63)
    assert U64_MAX == 18446744073709551615 == 2**64 - 1
    assert U32_MAX == 2**32 - 1


@pytest.mark.parametrize(
    ("check", "top"), [(check_u63, I64_MAX), (check_u64, U64_MAX)], ids=["u63", "u64"]
)
def test_checks(check: Any, top: int) -> None:
    for good in (0, 1, top):
        assert check(good, "f") == good
    for bad in (-1, top + 1, True, False, 1.0, "1", None):
        with pytest.raises(InvalidInput) as info:
            check(bad, "f")
        assert info.value.field == "f"


def test_saturating_add() -> None:
    assert saturating_add(1, 2) == 3
    assert saturating_add(I64_MAX - 1, 1) == I64_MAX
    assert saturating_add(I64_MAX, I64_MAX) == I64_MAX


class _Fields(BaseModel):
    u32: U32 = 0
    u63: U63 = 0
    u64: U64 = 0
    i64: I64 = 0


@pytest.mark.parametrize(
    ("field", "lo", "hi"),
    [("u32", 0, U32_MAX), ("u63", 0, I64_MAX), ("u64", 0, U64_MAX), ("i64", I64_MIN, I64_MAX)],
)
def test_field_types(field: str, lo: int, hi: int) -> None:
    assert getattr(_Fields(**{field: lo}), field) == lo
    assert getattr(_Fields(**{field: hi}), field) == hi
    for bad in (lo - 1, hi + 1, True, 1.0, "1"):
        with pytest.raises(ValidationError):
            _Fields(**{field: bad})


def test_old_names_are_the_bounds() -> None:
    from agentkeep.legacy import adapter as legacy_adapter
    from agentkeep.runs import codec as runs_codec
    from agentkeep.runs import domain as runs_domain
    from agentkeep.runtime import session_model
    from agentkeep.sessions import domain as sessions_domain

    assert runs_domain.I64_MAX == sessions_domain.MAX_I64 == session_model.MAX_U63 == I64_MAX
    assert legacy_adapter.MAX_I64 == I64_MAX
    assert (runs_domain.U64_MAX, runs_domain.U32_MAX, runs_domain.I64_MIN) == (
        U64_MAX,
        U32_MAX,
        I64_MIN,
    )
    assert runs_domain.check_u63 is runs_codec.check_u63 is check_u63
    assert sessions_domain.check_ms is check_u63
    assert sessions_domain.saturating_add is saturating_add
