"""Driver.defer / flush / prefetch: the same outcomes pipelined (psycopg) or one by one.

On psycopg deferred writes go out together and their checks run afterwards;
on SQLite (and asyncpg) each runs at once. Either way the first failing
check, or database error, in statement order is the error, and the unit
rolls back whole.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import pytest
from sqlalchemy import bindparam as p
from sqlalchemy import insert, select

from agentkeep import Store
from agentkeep.db import LockNamespace, lock_aggregate
from agentkeep.errors import DatabaseError, StoreBusy
from agentkeep.sessions.models import SessionMetaRow
from agentkeep.statements import Statement, upsert

_VALUES: dict[str, Any] = {
    "session_id": p("sid"),
    "session_name": p("name"),
    "created_at": "2026",
    "model": "m",
}
#: Returns the id, or no row when the id exists.
_PUT_IF_NEW = Statement(
    lambda d: (
        upsert(d, SessionMetaRow)
        .values(**_VALUES)
        .on_conflict_do_nothing(index_elements=[SessionMetaRow.session_id])
        .returning(SessionMetaRow.session_id)
    ),
    name="test.put_if_new",
)
#: A duplicate id is a unique violation (a database error).
_PUT = Statement(insert(SessionMetaRow).values(**_VALUES), name="test.put")
_NAMES = Statement(
    select(SessionMetaRow.session_id, SessionMetaRow.session_name).order_by(
        SessionMetaRow.session_id
    ),
    name="test.names",
)
_NAME = Statement(
    select(SessionMetaRow.session_name).where(SessionMetaRow.session_id == p("sid")),
    name="test.name",
)


class Missing(Exception):
    pass


def _inserted(result: Any) -> None:
    if result.fetchone() is None:
        raise Missing


def _rows(store: Store) -> list[tuple[str, str]]:
    with store.read() as uow:
        return [tuple(r) for r in uow.driver.execute(_NAMES, {}).fetchall()]


@pytest.fixture
def store(db_url: str) -> Any:
    with Store.open(db_url) as s:
        s.call_write(lambda r: r.driver.execute(_PUT, {"sid": "a", "name": "first"}))
        yield s


def test_deferred_writes_are_checked_in_order_when_flushed(store: Store) -> None:
    def unit(r: Any) -> None:
        d = r.driver
        d.defer(_PUT_IF_NEW, {"sid": "b", "name": "b"}, _inserted)
        d.defer(_PUT_IF_NEW, {"sid": "c", "name": "c"}, _inserted)
        d.flush()
        assert d.execute(_NAME, {"sid": "c"}).fetchone() == ("c",)

    store.call_write(unit)
    assert _rows(store) == [("a", "first"), ("b", "b"), ("c", "c")]


def test_an_earlier_check_comes_before_a_later_database_error(store: Store) -> None:
    """``a`` exists: the check of the first write fails, the second is a unique violation."""

    def unit(r: Any) -> None:
        d = r.driver
        d.defer(_PUT_IF_NEW, {"sid": "b", "name": "b"}, _inserted)
        d.defer(_PUT_IF_NEW, {"sid": "a", "name": "again"}, _inserted)
        d.defer(_PUT, {"sid": "a", "name": "dup"})
        d.flush()

    with pytest.raises(Missing):
        store.call_write(unit)
    assert _rows(store) == [("a", "first")]


def test_a_database_error_before_a_failing_check_is_the_error(store: Store) -> None:
    def unit(r: Any) -> None:
        d = r.driver
        d.defer(_PUT, {"sid": "a", "name": "dup"})
        d.defer(_PUT_IF_NEW, {"sid": "a", "name": "again"}, _inserted)
        d.flush()

    with pytest.raises(DatabaseError):
        store.call_write(unit)
    assert _rows(store) == [("a", "first")]


def test_an_error_raised_while_writes_are_queued_comes_after_their_checks(store: Store) -> None:
    def unit(r: Any) -> None:
        d = r.driver
        with d.deferred_first():
            d.defer(_PUT_IF_NEW, {"sid": "a", "name": "again"}, _inserted)
            raise ValueError("the caller's own error")

    with pytest.raises(Missing):
        store.call_write(unit)

    def passing(r: Any) -> None:
        d = r.driver
        with d.deferred_first():
            d.defer(_PUT_IF_NEW, {"sid": "b", "name": "b"}, _inserted)
            raise ValueError("the caller's own error")

    with pytest.raises(ValueError, match="own error"):
        store.call_write(passing)
    assert _rows(store) == [("a", "first")]


def test_a_savepoint_sends_and_checks_its_deferred_writes_inside_it(store: Store) -> None:
    with store.write() as uow:
        d = uow.driver
        d.defer(_PUT_IF_NEW, {"sid": "b", "name": "b"}, _inserted)
        with pytest.raises(Missing), d.savepoint():
            d.defer(_PUT_IF_NEW, {"sid": "c", "name": "c"}, _inserted)
            d.defer(_PUT_IF_NEW, {"sid": "a", "name": "again"}, _inserted)
        with d.savepoint():
            d.defer(_PUT_IF_NEW, {"sid": "d", "name": "d"}, _inserted)
    # b (before the savepoints) and d kept; c rolled back with its savepoint
    assert _rows(store) == [("a", "first"), ("b", "b"), ("d", "d")]


def test_a_write_left_deferred_in_a_write_block_is_committed(store: Store) -> None:
    with store.write() as uow:
        uow.driver.defer(_PUT_IF_NEW, {"sid": "b", "name": "b"}, _inserted)
    assert _rows(store) == [("a", "first"), ("b", "b")]


def test_prefetched_reads_answer_the_same_statement_once_inside_the_block(store: Store) -> None:
    def unit(r: Any) -> list[Any]:
        d = r.driver
        with d.prefetching([(_NAME, {"sid": "a"}), (_NAME, {"sid": "zz"})]):
            d.defer(_PUT, {"sid": "b", "name": "b"})
            out = [
                d.execute(_NAME, {"sid": "a"}).fetchone(),
                d.execute(_NAME, {"sid": "zz"}).fetchone(),
            ]
            # a read not prefetched sees the unit's writes (the queue goes out first)
            out.append(d.execute(_NAME, {"sid": "b"}).fetchone())
            d.defer(_PUT, {"sid": "zz", "name": "late"})
        # after the block, a read prefetched but not asked for runs as usual
        with d.prefetching([(_NAME, {"sid": "q"})]):
            d.execute(_PUT, {"sid": "c", "name": "c"})  # q's read goes out with it: no row
        d.execute(_PUT, {"sid": "q", "name": "q"})
        out.append(d.execute(_NAME, {"sid": "q"}).fetchone())
        return out

    assert store.call_write(unit) == [("first",), None, ("b",), ("q",)]


def test_a_write_deferred_before_a_lock_goes_out_before_it(db_url: str, backend: str) -> None:
    """A lock is a statement like any other: the queue goes out first.

    The deferred write is a unique violation; the lock is held by another
    unit. One by one (SQLite, where the lock is free anyway) the write fails
    at once; pipelined it must too, not wait for the lock and come out as
    ``StoreBusy`` (a BEGIN merged with the lock used to skip the queue).
    """
    with Store.open(db_url, busy_timeout_ms=300, retry_attempts=1) as s:
        s.call_write(lambda r: r.driver.execute(_PUT, {"sid": "a", "name": "first"}))

        def unit(r: Any) -> None:
            r.driver.defer(_PUT, {"sid": "a", "name": "dup"})
            lock_aggregate(r.driver, LockNamespace.SESSION, "held")

        holder = s.write() if backend == "postgres" else nullcontext()
        with holder as uow:
            if uow is not None:
                lock_aggregate(uow.driver, LockNamespace.SESSION, "held")
            with pytest.raises(DatabaseError) as caught:
                s.call_write(unit)
        assert not isinstance(caught.value, StoreBusy), caught.value
        assert _rows(s) == [("a", "first")]
