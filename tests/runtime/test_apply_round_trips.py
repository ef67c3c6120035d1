"""Postgres round trips of ``atomic_apply``, counted off the wire (issue 14).

On psycopg (sync and asyncio) a boundary is three round trips: ``BEGIN`` +
the ``runtime:<id>`` lock + the stored head, then every write pipelined
(snapshot, quarantine marker, receipt, inputs), then ``COMMIT``. A write that
fails in the pipeline is still ``WriteFailed`` naming its table, and nothing
of the boundary stays (the writes after it do not run; the unit rolls back).
On asyncpg the input upserts are one ``executemany`` (one round trip).
Counted with :class:`tests.sessions.test_round_trips.Trace`.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from agentkeep import Store
from agentkeep.aio import AsyncStore
from agentkeep.runtime import WriteFailed
from tests.conftest import as_async_url
from tests.sessions.test_round_trips import Trace, psycopg_async_calls

from .builders import encode, input_record, receipt, user_session
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


def test_asyncpg_upserts_a_boundarys_inputs_in_one_batch_all_or_nothing(pg_url: str) -> None:
    """asyncpg: the input upserts go as one ``executemany`` (no row count needed).

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
