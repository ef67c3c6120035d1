"""Postgres round trips of a fenced turn commit, counted off the wire (issue 14, item 4).

libpq traces every protocol message of the pooled connection (``PQtrace``);
a round trip ends with the server's ``ReadyForQuery``, so their count is the
number of times the client waited: a simple ``Query`` or an extended batch
ended by ``Sync``. A fenced turn commit on psycopg (sync and asyncio) is
three: ``BEGIN`` + the write locks + the fence reads (lease, head, ledger
totals, the turn-commit record), then every write pipelined, then ``COMMIT``.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from sqlalchemy import event

from agentkeep import Store
from agentkeep.aio import AsyncStore
from agentkeep.sessions.domain import Acquired, LeaseOwnerIdentity
from agentkeep.sessions.records import (
    AppendNodes,
    HydratedSessionCheckpoint,
    RuntimeCommit,
    SessionNodeRecord,
    TokenUsage,
    TurnCommitStamp,
    UsageDelta,
)
from tests.conftest import as_async_url

OWNER = LeaseOwnerIdentity(owner_id="owner-rt", incarnation_id="inc-rt")
SID = "sess-rt"
TURNS = 6  # past psycopg's prepare threshold (5): prepared statements change nothing


class Trace:
    """Traces the protocol of every connection checked out of ``engine`` while on, and of
    the connection parked on ``store`` (``Store._park_connections``: one-call units take
    it without a checkout)."""

    def __init__(self, engine: Any, store: Any = None) -> None:
        self.on = False
        self._file = tempfile.TemporaryFile()
        self._traced: list[Any] = []
        self._store = store
        event.listen(engine, "checkout", self._checkout)
        event.listen(engine, "checkin", self._checkin)

    def _pgconn(self, dbapi_conn: Any) -> Any:
        conn = getattr(dbapi_conn, "_connection", dbapi_conn)  # SQLAlchemy's async adapter
        assert isinstance(conn, psycopg.Connection | psycopg.AsyncConnection)
        return conn.pgconn

    def _checkout(self, dbapi_conn: Any, _record: Any, _proxy: Any) -> None:
        if self.on:
            pgconn = self._pgconn(dbapi_conn)
            pgconn.trace(self._file.fileno())
            pgconn.set_trace_flags(psycopg.pq.Trace.SUPPRESS_TIMESTAMPS)
            self._traced.append(pgconn)

    def _checkin(self, dbapi_conn: Any, _record: Any) -> None:
        pgconn = self._pgconn(dbapi_conn)
        if pgconn in self._traced:
            pgconn.untrace()
            self._traced.remove(pgconn)

    @contextmanager
    def round_trips(self) -> Iterator[list[str]]:
        """Yields a list that holds, after the block, the round trips' closing messages."""
        out: list[str] = []
        self._file.seek(0)
        self._file.truncate()
        self.on = True
        parked = [] if self._store is None else [p for p, _ in self._store._parked]
        for pooled in parked:
            self._checkout(pooled.dbapi_connection, None, None)
        try:
            yield out
        finally:
            self.on = False
            for pgconn in list(self._traced):  # still checked out (parked): stop tracing it
                pgconn.untrace()
                self._traced.remove(pgconn)
        self._file.seek(0)
        lines = self._file.read().decode("utf-8", "replace").splitlines()
        out.extend(line for line in lines if "\tReadyForQuery" in line and line.startswith("B"))
        # every traced wait was answered: the client sent as many Sync/Query messages
        sent = [
            line
            for line in lines
            if line.startswith("F") and ("\tSync" in line or "\tQuery" in line)
        ]
        assert len(sent) == len(out), lines


def _commit(turn: int, lease: Any, *, stamp: bool, release: bool) -> RuntimeCommit:
    node = SessionNodeRecord(
        node_id=f"n-{turn}",
        parent_node_id=None if turn == 0 else f"n-{turn - 1}",
        timestamp=turn,
        payload={"role": "assistant", "content": "ok"},
    )
    return RuntimeCommit(
        session_id=SID,
        expected_head_revision=turn,
        session_execution_lease=lease,
        graph=AppendNodes(nodes=(node,), leaf_node_id=node.node_id),
        checkpoint=HydratedSessionCheckpoint(turn_state={"turn": turn}),
        usage_deltas=(
            UsageDelta(
                source="chat", model="m-1", usage=TokenUsage(input_tokens=10, output_tokens=5)
            ),
        ),
        turn_commit=TurnCommitStamp(session_id=SID, turn_id=f"t-{turn}", turn_commit_hash="h")
        if stamp
        else None,
        release_session_execution_lease=lease if release else None,
    )


def _turns(call: Callable[[Callable[[Any], Any]], Any], trace: Trace) -> list[int]:
    """Round trips of each of ``TURNS`` fenced commits (the last with a stamp and the release)."""
    out = call(lambda st: st.leases.try_claim_session_execution_lease(SID, OWNER, 600_000))
    assert isinstance(out, Acquired), out
    counts = []
    for turn in range(TURNS):
        last = turn == TURNS - 1
        rc = _commit(turn, out.lease, stamp=last, release=last)
        with trace.round_trips() as trips:
            result = call(lambda st, rc=rc: st.commits.commit_runtime_state(rc))
        assert result.head_revision == turn + 1
        counts.append(len(trips))
    loaded = call(lambda st: st.commits.load_session(SID))
    assert loaded is not None and loaded.head_revision == TURNS
    assert [n.node_id for n in loaded.graph.nodes] == [f"n-{t}" for t in range(TURNS)]
    assert loaded.token_ledger[0].usage.input_tokens == 10 * TURNS
    assert call(lambda st: st.leases.get_session_execution_lease(SID)) is None
    return counts


#: Round trips of the turns of ``_turns`` on psycopg: each the checking statement
#: (locks; the statement with COMMIT), the first inserting the head, the last with
#: its stamp and release.
PSYCOPG_TURNS = [2] * TURNS


def test_a_fenced_turn_commit_takes_two_round_trips_on_psycopg(pg_url: str) -> None:
    with Store.open(pg_url) as store:
        trace = Trace(store.engine, store)
        assert _turns(lambda fn: fn(store), trace) == PSYCOPG_TURNS


@contextmanager
def psycopg_async_calls(
    pg_url: str,
) -> Iterator[tuple[Callable[[Callable[[Any], Any]], Any], Trace]]:
    """An AsyncStore on psycopg_async, driven from a sync test: ``(call, trace)``.

    ``call(fn)`` runs ``fn(astore)`` on the store's event loop and awaits what
    it returns; ``trace`` notes the round trips of the store's connections.
    """

    async def awaited(value: Any) -> Any:
        return await value if asyncio.iscoroutine(value) or asyncio.isfuture(value) else value

    loop = asyncio.new_event_loop()
    try:
        astore = loop.run_until_complete(AsyncStore.open(as_async_url(pg_url, "psycopg_async")))
        try:
            trace = Trace(astore.store.engine)
            yield (lambda fn: loop.run_until_complete(awaited(fn(astore)))), trace
        finally:
            loop.run_until_complete(astore.close())
    finally:
        loop.close()


def test_a_fenced_turn_commit_takes_two_round_trips_on_psycopg_async(pg_url: str) -> None:
    with psycopg_async_calls(pg_url) as (call, trace):
        assert _turns(call, trace) == PSYCOPG_TURNS
