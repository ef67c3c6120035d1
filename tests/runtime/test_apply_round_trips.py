"""Postgres round trips of ``atomic_apply``, counted off the wire (issue 14).

On psycopg (sync and asyncio) a boundary is three round trips: ``BEGIN`` +
the ``runtime:<id>`` lock + the stored head, then every write pipelined
(snapshot, quarantine marker, receipt, inputs), then ``COMMIT``. A write that
fails in the pipeline is still ``WriteFailed`` naming its table, and nothing
of the boundary stays (the writes after it do not run; the unit rolls back).
On asyncpg, which does not pipeline, a boundary is four round trips:
``BEGIN`` + the lock, the stored head, every write in one statement of
data-modifying CTEs (:func:`agentkeep.statements.merged_writes`), ``COMMIT``.
A write that fails there fails the statement (``WriteFailed`` naming what it
wrote), and nothing of the boundary stays. Counted with
:class:`tests.sessions.test_round_trips.Trace` (psycopg) and the wire relay
of :mod:`tests.test_asyncpg_round_trips` (asyncpg).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from sqlalchemy import create_engine, text

from agentkeep import Store
from agentkeep.aio import AsyncStore
from agentkeep.runtime import WriteFailed
from tests.conftest import as_async_url
from tests.sessions.test_round_trips import Trace, psycopg_async_calls
from tests.test_asyncpg_round_trips import _TapTrace, asyncpg_calls

from .builders import (
    accepted_input,
    encode,
    idle_lifecycle,
    input_record,
    receipt,
    user_session,
)
from .support import abort_trigger

_INPUTS = "runtime_input_states"

BOUNDARIES = 6  # past psycopg's prepare threshold (5)


def _boundaries(call: Callable[[Callable[[Any], Any]], Any], trace: Trace, rt: str) -> list[int]:
    """Round trips of each boundary of a growing session, then of a duplicate receipt."""
    run_id = str(uuid.uuid4())
    contents: list[str] = []
    session = user_session()
    counts = []
    for i in range(BOUNDARIES):
        contents.append(f"message {i}")
        session = user_session(*contents, session_id=session.id)
        data = encode(session)
        inputs = [input_record() for _ in range(4)]
        with trace.round_trips() as trips:
            call(
                lambda st, d=data, i=i, n=inputs: st.runtime.atomic_apply(
                    rt, d, receipt(i, run_id), n
                )
            )
        counts.append(len(trips))
    assert call(lambda st: st.runtime.load_session_snapshot(rt)) == encode(session)
    stored = call(lambda st: st.runtime.load_input_states(rt))
    assert len(stored) == 4 * BOUNDARIES
    # The receipt INSERT fails inside the pipeline: WriteFailed naming it, nothing written.
    grown = encode(user_session(*contents, "one more", session_id=session.id))
    with pytest.raises(WriteFailed, match="runtime_boundary_receipts"):
        call(lambda st: st.runtime.atomic_apply(rt, grown, receipt(0, run_id), [input_record()]))
    assert call(lambda st: st.runtime.load_session_snapshot(rt)) == encode(session)
    assert call(lambda st: st.runtime.load_input_states(rt)) == stored
    return counts


def test_atomic_apply_takes_three_round_trips_on_psycopg(pg_url: str) -> None:
    with Store.open(pg_url) as store:
        trace = Trace(store.engine, store)
        assert _boundaries(lambda fn: fn(store), trace, "rt-rtrips") == [3] * BOUNDARIES


def test_atomic_apply_takes_three_round_trips_on_psycopg_async(pg_url: str) -> None:
    with psycopg_async_calls(pg_url) as (call, trace):
        assert _boundaries(call, trace, "rt-rtrips-async") == [3] * BOUNDARIES


def test_atomic_apply_takes_four_round_trips_on_asyncpg(pg_url: str) -> None:
    """BEGIN + lock, the stored head, the writes merged into one statement, COMMIT."""
    with asyncpg_calls(pg_url) as (call, tap):
        trips: list[list[str]] = []

        class Keep(_TapTrace):
            @contextmanager
            def round_trips(self) -> Iterator[list[str]]:
                with super().round_trips() as out:
                    yield out
                trips.append(list(out))

        assert _boundaries(call, Keep(tap), "rt-rtrips-asyncpg") == [4] * BOUNDARIES, trips
    for one in trips:
        assert one[0].startswith("BEGIN ISOLATION LEVEL READ COMMITTED; SELECT pg_advisory")
        assert one[1].startswith("SELECT runtime_session_snapshots.session_snapshot")
        merged = one[2]
        assert merged.startswith("WITH w0 AS") and merged.rstrip().endswith("SELECT 1")
        for table in ("runtime_session_snapshots", "runtime_boundary_receipts", _INPUTS):
            assert f"INSERT INTO {table}" in merged
        assert "DELETE FROM runtime_projection_quarantine" in merged
        assert one[3] == "COMMIT"


@pytest.mark.parametrize(
    ("table", "event"),
    [
        ("runtime_session_snapshots", "INSERT"),
        ("runtime_projection_quarantine", "DELETE"),
        ("runtime_boundary_receipts", "INSERT"),
        (_INPUTS, "INSERT"),
    ],
)
def test_a_fault_in_any_merged_write_leaves_nothing_on_asyncpg(
    pg_url: str, table: str, event: str
) -> None:
    """A trigger aborting one of the merged statement's writes: WriteFailed, nothing written.

    The quarantine DELETE fires its trigger only for a row it deletes: the
    runtime is quarantined first.
    """
    rt, run_id = f"rt-merged-fault-{table}", str(uuid.uuid4())
    with asyncpg_calls(pg_url) as (call, _tap):
        session = user_session("one")
        call(lambda st: st.runtime.atomic_apply(rt, encode(session), receipt(0, run_id), []))
        if event == "DELETE":
            _sql(pg_url, "INSERT INTO runtime_projection_quarantine (runtime_id) VALUES (:rt)", rt)
        before = _runtime_rows(pg_url, rt)
        grown = user_session("one", "two", session_id=session.id)
        inputs = [input_record() for _ in range(3)]
        with abort_trigger(pg_url, "postgres", table, event):
            with pytest.raises(WriteFailed, match=table):
                call(
                    lambda st: st.runtime.atomic_apply(
                        rt, encode(grown), receipt(1, run_id), inputs
                    )
                )
        assert _runtime_rows(pg_url, rt) == before


def _sql(url: str, sql: str, rt: str) -> None:
    eng = create_engine(url)
    try:
        with eng.begin() as conn:
            conn.execute(text(sql), {"rt": rt})
    finally:
        eng.dispose()


def _runtime_rows(url: str, rt: str) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of ``rt`` in the tables a boundary writes."""
    tables = (
        "runtime_session_snapshots",
        "runtime_projection_quarantine",
        "runtime_boundary_receipts",
        _INPUTS,
    )
    eng = create_engine(url)
    try:
        with eng.connect() as conn:
            return {
                t: sorted(
                    tuple(r)
                    for r in conn.execute(
                        text(f"SELECT * FROM {t} WHERE runtime_id = :rt"), {"rt": rt}
                    )
                )
                for t in tables
            }
    finally:
        eng.dispose()


def test_a_boundary_of_more_writes_than_one_merged_statement_holds(pg_url: str) -> None:
    """asyncpg: 20 inputs + snapshot, quarantine, receipt: two merged statements, all kept;
    an abort in the second statement's rows leaves nothing of the first's either."""
    rt, run_id = "rt-merged-many", str(uuid.uuid4())
    with asyncpg_calls(pg_url) as (call, tap):
        session = user_session("one")
        inputs = [input_record() for _ in range(20)]
        with tap.record() as recorded:
            call(
                lambda st: st.runtime.atomic_apply(rt, encode(session), receipt(0, run_id), inputs)
            )
        trips = list(recorded)
        assert len(trips) == 5, trips
        assert all(t.startswith("WITH w0 AS") for t in trips[2:4])
        stored = call(lambda st: st.runtime.load_input_states(rt))
        assert sorted(s.input_id for s in stored) == sorted(r.state.input_id for r in inputs)
        before = _runtime_rows(pg_url, rt)
        more = [input_record() for _ in range(20)]
        grown = user_session("one", "two", session_id=session.id)
        aborted = more[-1].state.input_id
        with abort_trigger(pg_url, "postgres", _INPUTS, "INSERT", when_input_id=aborted):
            with pytest.raises(WriteFailed, match=_INPUTS):
                call(
                    lambda st: st.runtime.atomic_apply(rt, encode(grown), receipt(1, run_id), more)
                )
        assert _runtime_rows(pg_url, rt) == before


def test_asyncpg_upserts_a_boundarys_inputs_in_one_statement_all_or_nothing(pg_url: str) -> None:
    """asyncpg: the input upserts go in the boundary's one write statement.

    Every row is written; a trigger that aborts the third row's INSERT fails
    the boundary with ``WriteFailed`` naming the table, and nothing of it stays.
    """
    loop = asyncio.new_event_loop()
    try:
        astore = loop.run_until_complete(AsyncStore.open(as_async_url(pg_url, "asyncpg")))
        try:
            rt, run_id = "rt-asyncpg-batch", str(uuid.uuid4())
            session = user_session("one")
            inputs = [input_record() for _ in range(4)]
            loop.run_until_complete(
                astore.runtime.atomic_apply(rt, encode(session), receipt(0, run_id), inputs)
            )
            stored = loop.run_until_complete(astore.runtime.load_input_states(rt))
            assert sorted(s.input_id for s in stored) == sorted(r.state.input_id for r in inputs)
            more = [input_record() for _ in range(4)]
            grown = user_session("one", "two", session_id=session.id)
            aborted = more[2].state.input_id
            with abort_trigger(pg_url, "postgres", _INPUTS, "INSERT", when_input_id=aborted):
                with pytest.raises(WriteFailed, match=_INPUTS):
                    loop.run_until_complete(
                        astore.runtime.atomic_apply(rt, encode(grown), receipt(1, run_id), more)
                    )
            after = loop.run_until_complete(astore.runtime.load_input_states(rt))
            assert after == stored
            snapshot = loop.run_until_complete(astore.runtime.load_session_snapshot(rt))
            assert snapshot == encode(session)
        finally:
            loop.run_until_complete(astore.close())
    finally:
        loop.close()


def test_a_boundary_naming_an_input_twice_keeps_its_last_state_on_asyncpg(pg_url: str) -> None:
    """Two upserts of one row cannot share a statement: the batch keeps the last of each id,
    which is what upserting them in order leaves."""
    rt, run_id = "rt-merged-twice", str(uuid.uuid4())
    state, other = accepted_input(), accepted_input()
    inputs = [
        input_record(state.with_recovery_count(4)),
        input_record(other),
        input_record(state.with_recovery_count(5)),
    ]
    with asyncpg_calls(pg_url) as (call, _tap):
        session = user_session("one")
        call(lambda st: st.runtime.atomic_apply(rt, encode(session), receipt(0, run_id), inputs))
        stored = call(lambda st: st.runtime.load_input_states(rt))
    assert {s.input_id: s.recovery_count for s in stored} == {
        state.input_id: 5,
        other.input_id: 0,
    }


# --------------------------------------------------------------------------
# commit_session_snapshot and commit_machine_lifecycle: the stored head read
# with BEGIN and the lock (psycopg), the writes in one round trip


def _snapshot_and_lifecycle(call: Callable[[Callable[[Any], Any]], Any], trace: Any) -> list[int]:
    """Round trips of growing snapshot commits, then of lifecycle commits with 4 inputs."""
    rt = f"rt-snap-{uuid.uuid4().hex[:8]}"
    session = user_session("one")
    call(lambda st: st.runtime.commit_session_snapshot(rt, encode(session)))
    counts = []
    contents = ["one"]
    for i in range(BOUNDARIES):
        contents.append(f"message {i}")
        data = encode(user_session(*contents, session_id=session.id))
        with trace.round_trips() as trips:
            call(lambda st, d=data: st.runtime.commit_session_snapshot(rt, d))
        counts.append(len(trips))
        assert call(lambda st: st.runtime.load_session_snapshot(rt)) == data
    for _ in range(BOUNDARIES):
        inputs = [input_record() for _ in range(4)]
        with trace.round_trips() as trips:
            call(lambda st, n=inputs: st.runtime.commit_machine_lifecycle(rt, idle_lifecycle(), n))
        counts.append(len(trips))
    assert len(call(lambda st: st.runtime.load_input_states(rt))) == 4 * BOUNDARIES
    return counts


def test_snapshot_and_lifecycle_commits_take_three_round_trips_on_psycopg(pg_url: str) -> None:
    with Store.open(pg_url) as store:
        counts = _snapshot_and_lifecycle(lambda fn: fn(store), Trace(store.engine, store))
    assert counts == [3] * (2 * BOUNDARIES)


def test_snapshot_and_lifecycle_commits_take_three_round_trips_on_psycopg_async(
    pg_url: str,
) -> None:
    with psycopg_async_calls(pg_url) as (call, trace):
        assert _snapshot_and_lifecycle(call, trace) == [3] * (2 * BOUNDARIES)


def test_snapshot_and_lifecycle_commits_on_asyncpg(pg_url: str) -> None:
    """A snapshot commit: BEGIN + lock, the stored head, both writes merged, COMMIT (4);
    a lifecycle commit: BEGIN + lock, the lifecycle and inputs merged, COMMIT (3)."""
    with asyncpg_calls(pg_url) as (call, tap):
        counts = _snapshot_and_lifecycle(call, _TapTrace(tap))
    assert counts == [4] * BOUNDARIES + [3] * BOUNDARIES


@pytest.mark.parametrize("driver", ["psycopg", "asyncpg"])
def test_a_fault_in_a_snapshot_commits_second_write_leaves_nothing(
    pg_url: str, driver: str
) -> None:
    """The quarantine DELETE aborts after the snapshot upsert was sent with it: WriteFailed,
    the snapshot and the marker as they were."""
    rt = f"rt-snap-fault-{driver}"
    session = user_session("one")
    grown = encode(user_session("one", "two", session_id=session.id))
    before: dict[str, list[tuple[Any, ...]]] = {}

    def run(call: Callable[[Callable[[Any], Any]], Any]) -> None:
        call(lambda st: st.runtime.commit_session_snapshot(rt, encode(session)))
        _sql(pg_url, "INSERT INTO runtime_projection_quarantine (runtime_id) VALUES (:rt)", rt)
        before.update(_runtime_rows(pg_url, rt))
        with abort_trigger(pg_url, "postgres", "runtime_projection_quarantine", "DELETE"):
            with pytest.raises(WriteFailed, match="runtime_projection_quarantine"):
                call(lambda st: st.runtime.commit_session_snapshot(rt, grown))

    if driver == "asyncpg":
        with asyncpg_calls(pg_url) as (call, _tap):
            run(call)
    else:
        with Store.open(pg_url) as store:
            run(lambda fn: fn(store))
    assert _runtime_rows(pg_url, rt) == before
