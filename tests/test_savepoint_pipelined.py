"""``Driver.savepoint`` on psycopg: no round trip of its own, the same outcomes.

On psycopg (sync and asyncio) a savepoint block's ``SAVEPOINT`` goes out at
the head of the block's first round trip (after the unit's pending
``BEGIN``), and, in a one-call (lean) unit, its ``RELEASE SAVEPOINT`` at the
head of the unit's next round trip, or with its ``COMMIT``
(docs/architecture.md#one-round-trip-commit). Counted off the wire (libpq's
trace, :class:`tests.sessions.test_round_trips.Trace`).

The outcomes are those of a savepoint sent alone, on both backends: a
statement failing in the round trip that carries the ``SAVEPOINT`` raises the
error it raises outside a savepoint, and only the block is rolled back; a
block that raises after its writes leaves none of them; a failure of the
round trip carrying ``RELEASE`` and ``COMMIT`` is a failed COMMIT's (the
server's error, nothing committed; a lost connection:
``CommitOutcomeUnknown``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from sqlalchemy import delete, make_url

from agentkeep import Store, db
from agentkeep.errors import CommitOutcomeUnknown, ConnectionLost, DatabaseError
from agentkeep.sessions.models import SessionMetaRow
from agentkeep.statements import Statement
from tests.sessions.test_round_trips import Trace, psycopg_async_calls
from tests.support import raw_rows
from tests.test_pipelining import _NAMES, _PUT

Call = Callable[[Callable[[Any], Any]], Any]
_DELETE_ALL = Statement(delete(SessionMetaRow), name="test.delete_all")


class Boom(Exception):
    pass


def _put(d: db.Driver, sid: str, name: str | None = None) -> None:
    d.execute(_PUT, {"sid": sid, "name": name or sid})


def _ids(url: str) -> list[str]:
    return [r[0] for r in raw_rows(url, "SELECT session_id FROM session_meta ORDER BY session_id")]


def _wire(trace: Trace) -> str:
    """What the last ``trace.round_trips()`` block traced (every message)."""
    trace._file.seek(0)
    return trace._file.read().decode("utf-8", "replace")


def _count(call: Call, trace: Trace, fn: Callable[[Any], Any]) -> tuple[int, str]:
    """Round trips of ``call_write(fn)`` (after warm runs), and its wire trace."""
    for _ in range(2):  # warm: the parked connection, prepared statements
        call(lambda st: st.call_write(lambda r: None))
    with trace.round_trips() as trips:
        call(lambda st: st.call_write(fn))
    return len(trips), _wire(trace)


# ---------------------------------------------------------------- round trips (psycopg)


def _one_block(r: Any) -> None:
    with r.driver.savepoint():
        _put(r.driver, "a")


def _two_blocks_then_a_read(r: Any) -> None:
    d = r.driver
    with d.savepoint():
        _put(d, "b")
    with d.savepoint():
        _put(d, "c")
    assert d.execute(_NAMES, {}).fetchall()


def _empty_block_then_a_write(r: Any) -> None:
    with r.driver.savepoint():
        pass
    _put(r.driver, "d")


#: fn -> (round trips, and before this change). one block: BEGIN + SAVEPOINT +
#: INSERT, then RELEASE + COMMIT (was BEGIN, SAVEPOINT, INSERT, RELEASE, COMMIT
#: each alone); two blocks and a read: [BEGIN, SAVEPOINT, INSERT], [RELEASE,
#: SAVEPOINT, INSERT], [RELEASE, SELECT], [COMMIT] (was 8); an empty block:
#: nothing of it, [BEGIN, INSERT], [COMMIT] (was 5).
CASES = {
    "one block": (_one_block, 2),
    "two blocks and a read": (_two_blocks_then_a_read, 4),
    "empty block": (_empty_block_then_a_write, 2),
}


def _check_counts(call: Call, trace: Trace) -> None:
    for name, (fn, expected) in CASES.items():
        trips, wire = _count(call, trace, fn)
        assert trips == expected, (name, trips, wire)
        if name == "empty block":
            assert "SAVEPOINT" not in wire, wire
        call(lambda st: st.call_write(lambda r: r.driver.execute(_DELETE_ALL, {})))


def test_a_savepoint_block_costs_no_round_trip_of_its_own_on_psycopg(pg_url: str) -> None:
    with Store.open(pg_url) as store:
        _check_counts(lambda fn: fn(store), Trace(store.engine, store))


def test_a_savepoint_block_costs_no_round_trip_of_its_own_on_psycopg_async(pg_url: str) -> None:
    with psycopg_async_calls(pg_url) as (call, trace):
        _check_counts(call, trace)


def test_a_write_unit_sends_its_savepoint_with_the_first_statement(pg_url: str) -> None:
    """``store.write()`` (the host's connection shares the transaction): the SAVEPOINT goes
    with the block's first statement, the RELEASE when the block ends, alone."""
    with Store.open(pg_url) as store:
        trace = Trace(store.engine, store)
        with trace.round_trips() as trips:
            with store.write() as uow:
                with uow.driver.savepoint():
                    _put(uow.driver, "a")
                    _put(uow.driver, "b")
                with uow.driver.savepoint():  # sends nothing
                    pass
        # psycopg's own BEGIN, SAVEPOINT + INSERT, INSERT, RELEASE, COMMIT (was 6: the
        # SAVEPOINT alone)
        assert len(trips) == 5, _wire(trace)
        sent = [line for line in _wire(trace).splitlines() if line.startswith("F")]
        assert len([line for line in sent if "SAVEPOINT" in line]) == 2  # SAVEPOINT, RELEASE
    assert _ids(pg_url) == ["a", "b"]


# ---------------------------------------------------------------- outcomes (both backends)


def _dup_error(store: Store) -> DatabaseError:
    """The error a duplicate insert raises outside any savepoint."""
    with pytest.raises(DatabaseError) as caught:
        store.call_write(lambda r: _put(r.driver, "a", "again"))
    return caught.value


def _failing_blocks(seen: list[BaseException]) -> Callable[[Any], None]:
    """A unit whose blocks fail on a duplicate insert (caught), the rest kept."""

    def fn(r: Any) -> None:
        d = r.driver
        try:
            with d.savepoint():  # the unit's first statement: BEGIN + SAVEPOINT + INSERT
                _put(d, "a", "again")
        except DatabaseError as exc:
            seen.append(exc)
        _put(d, "b")
        with d.savepoint():  # a block that succeeds, its RELEASE pending
            _put(d, "c")
        try:
            with d.savepoint():  # RELEASE + SAVEPOINT + a write, then the duplicate
                _put(d, "x")
                _put(d, "a", "again")
        except DatabaseError as exc:
            seen.append(exc)
        try:
            with d.savepoint():  # RELEASE + SAVEPOINT + the duplicate in one round trip
                _put(d, "a", "again")
        except DatabaseError as exc:
            seen.append(exc)
        _put(d, "d")

    return fn


def _check_failed_blocks(url: str, seen: list[BaseException], expected: DatabaseError) -> None:
    assert len(seen) == 3
    for exc in seen:
        assert type(exc) is type(expected), (exc, expected)
        assert type(exc.__cause__) is type(expected.__cause__)
    assert _ids(url) == ["a", "b", "c", "d"]
    name = raw_rows(url, "SELECT session_name FROM session_meta WHERE session_id = 'a'")
    assert name == [("a",)]


def test_a_statement_failing_with_the_savepoint_rolls_back_only_the_block(db_url: str) -> None:
    """The failing statement is the block's first (on psycopg it went out with SAVEPOINT,
    and, as the unit's first, with BEGIN, in one round trip), or follows a write of
    the block: the error is the one it raises outside a savepoint, only the block is
    rolled back, and the unit goes on."""
    with Store.open(db_url) as store:
        _put_alone(store, "a")
        expected = _dup_error(store)
        seen: list[BaseException] = []
        store.call_write(_failing_blocks(seen))
        _check_failed_blocks(db_url, seen, expected)


def test_a_statement_failing_with_the_savepoint_on_psycopg_async(pg_url: str) -> None:
    with Store.open(pg_url) as store:
        _put_alone(store, "a")
        expected = _dup_error(store)
    with psycopg_async_calls(pg_url) as (call, _trace):
        seen: list[BaseException] = []
        call(lambda st: st.call_write(_failing_blocks(seen)))
    _check_failed_blocks(pg_url, seen, expected)


def _put_alone(store: Store, sid: str) -> None:
    store.call_write(lambda r: _put(r.driver, sid))


@pytest.mark.parametrize("unit", ["call_write", "write"])
def test_a_block_raising_after_its_writes_leaves_none_of_them(db_url: str, unit: str) -> None:
    with Store.open(db_url) as store:

        def fn(r: Any) -> None:
            d = r.driver
            _put(d, "kept")
            try:
                with d.savepoint():
                    _put(d, "x")
                    with d.savepoint():  # ends cleanly: its RELEASE waits (lean psycopg)
                        _put(d, "y")
                    raise Boom
            except Boom:
                pass
            try:
                with d.savepoint():
                    with d.savepoint():
                        _put(d, "z")
                    raise Boom  # nothing sent since the inner block: its RELEASE is dropped
            except Boom:
                pass
            _put(d, "after")

        if unit == "call_write":
            store.call_write(fn)
        else:
            with store.write() as uow:
                fn(uow)
    assert _ids(db_url) == ["after", "kept"]


def test_a_store_operation_failing_in_its_savepoint_leaves_nothing_of_it(
    db_url: str, backend: str
) -> None:
    """An enqueue whose item INSERT aborts (a trigger), inside ``call_write``: its savepoint
    takes back the batch row; the rest of the unit commits."""
    from agentkeep.sessions.domain import QueuedWorkDraft, QueuedWorkPayload
    from tests.runtime.support import abort_trigger

    body = QueuedWorkPayload(kind="user_message", body={"text": "hi"})
    with Store.open(db_url) as store:

        def fn(r: Any) -> str:
            try:
                r.queue.enqueue_queued_work(QueuedWorkDraft(session_id="s-1", payloads=(body,) * 3))
            except DatabaseError as exc:
                _put(r.driver, "after")
                return type(exc).__name__
            return "no error"

        with abort_trigger(db_url, backend, "queued_work_items", "INSERT"):
            assert store.call_write(fn) == "DatabaseError"
    assert raw_rows(db_url, "SELECT count(*) FROM queued_work_batches") == [(0,)]
    assert raw_rows(db_url, "SELECT count(*) FROM queued_work_items") == [(0,)]
    assert _ids(db_url) == ["after"]


# ---------------------------------------------------------------- RELEASE + COMMIT failing


@pytest.fixture
def refused_at_commit(pg_url: str) -> Iterator[str]:
    """A deferred constraint trigger that refuses a session named ``refuse`` at COMMIT."""
    admin = _admin(pg_url)
    try:
        admin.execute(
            "CREATE FUNCTION ak_test_refuse() RETURNS trigger LANGUAGE plpgsql AS "
            "$$ BEGIN RAISE EXCEPTION 'refused at commit'; END $$"
        )
        admin.execute(
            "CREATE CONSTRAINT TRIGGER ak_test_refuse AFTER INSERT ON session_meta "
            "DEFERRABLE INITIALLY DEFERRED FOR EACH ROW "
            "WHEN (NEW.session_name = 'refuse') EXECUTE FUNCTION ak_test_refuse()"
        )
        yield pg_url
    finally:
        admin.execute("DROP TRIGGER IF EXISTS ak_test_refuse ON session_meta")
        admin.execute("DROP FUNCTION IF EXISTS ak_test_refuse()")
        admin.close()


def _admin(pg_url: str) -> psycopg.Connection[Any]:
    return psycopg.connect(
        make_url(pg_url).set(drivername="postgresql").render_as_string(hide_password=False),
        autocommit=True,
    )


def _terminate(admin: psycopg.Connection[Any], pid: int) -> None:
    admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
    while admin.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchall():
        threading.Event().wait(0.002)


def test_a_commit_refused_with_the_pending_release_is_the_servers_error(
    refused_at_commit: str,
) -> None:
    url = refused_at_commit
    with Store.open(url) as store:
        trace = Trace(store.engine, store)

        def fn(r: Any) -> None:
            with r.driver.savepoint():
                _put(r.driver, "r", "refuse")

        with trace.round_trips() as trips, pytest.raises(DatabaseError) as caught:
            store.call_write(fn)
        assert not isinstance(caught.value, CommitOutcomeUnknown | ConnectionLost), caught.value
        assert "refused at commit" in str(caught.value)
        assert "RELEASE SAVEPOINT" in _wire(trace) and len(trips) == 2, _wire(trace)
        assert _ids(url) == []
        _put_alone(store, "ok")  # the connection is usable after the failed COMMIT
    assert _ids(url) == ["ok"]


def test_a_connection_lost_with_release_and_commit_in_flight_is_commit_outcome_unknown(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    admin = _admin(pg_url)
    original = db.Driver._simple
    fired: list[str] = []

    def simple(driver: db.Driver, sql: str) -> Any:
        if not fired and sql.startswith("RELEASE SAVEPOINT") and sql.endswith("; COMMIT"):
            fired.append(sql)
            original(driver, sql)  # applied; the answer is "lost"
            _terminate(admin, driver.raw.info.backend_pid)
            driver.raw.close()
            raise psycopg.OperationalError("the connection was lost (injected after COMMIT)")
        return original(driver, sql)

    monkeypatch.setattr(db.Driver, "_simple", simple)
    try:
        with Store.open(pg_url) as store:

            def fn(r: Any) -> None:
                with r.driver.savepoint():
                    _put(r.driver, "a")

            with pytest.raises(CommitOutcomeUnknown):
                store.call_write(fn)
            assert fired
            assert _ids(pg_url) == ["a"]  # it was applied: unknown, never silent
    finally:
        admin.close()


def test_a_connection_closed_before_release_and_commit_is_connection_lost(pg_url: str) -> None:
    """The server closed the connection after the block's round trip: the RELEASE goes
    alone (Driver.closed_while_idle) and fails as a statement does, so the one-call
    layer retries the unit (ConnectionLost: nothing was committed)."""
    admin = _admin(pg_url)
    runs: list[int] = []
    try:
        with Store.open(pg_url) as store:

            def fn(r: Any) -> None:
                runs.append(1)
                with r.driver.savepoint():
                    _put(r.driver, "a")
                if len(runs) == 1:
                    _terminate(admin, r.driver.raw.info.backend_pid)

            store.call_write(fn)
            assert len(runs) == 2
    finally:
        admin.close()
    assert _ids(pg_url) == ["a"]
