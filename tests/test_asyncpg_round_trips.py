"""asyncpg round trips, read off the wire (issue 14, item 4), and its explicit transactions.

asyncpg has no pipeline, so each statement with parameters is a round trip of
its own. What lean (one-call) units save: they begin explicitly, and the
``BEGIN`` goes in one simple query with the aggregate write lock when that is
the unit's first statement (``BEGIN ISOLATION LEVEL READ COMMITTED; SELECT
pg_advisory_xact_lock(<ints>)``), or alone as ``BEGIN ISOLATION LEVEL
REPEATABLE READ READ ONLY`` for a read (no separate ``SET TRANSACTION``);
``COMMIT`` / ``ROLLBACK`` are simple queries of the unit. Warm calls prepare
nothing (SQLAlchemy's prepared-statement cache hits). Counted through
``benchmarks/_pgwire.WireTap``, a relay that sees every message the driver sends.
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import make_url

from agentkeep.aio import AsyncStore
from agentkeep.db import _LOCK_SQL as _LOCK
from agentkeep.errors import HeadRevisionConflict, TransactionAborted
from agentkeep.sessions.domain import Acquired
from agentkeep.sessions.records import ActivePathScope
from tests.sessions.test_round_trips import OWNER, SID, TURNS, _commit, _turns


def _wiretap_class() -> Any:
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "_pgwire.py"
    spec = importlib.util.spec_from_file_location("_ak_pgwire", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("_ak_pgwire", module)
    spec.loader.exec_module(module)
    return module.WireTap


class _TapTrace:
    """The ``Trace`` interface of test_round_trips over a WireTap."""

    def __init__(self, tap: Any) -> None:
        self._tap = tap

    @contextmanager
    def round_trips(self) -> Iterator[list[str]]:
        with self._tap.record() as trips:
            yield trips


@contextmanager
def asyncpg_calls(
    pg_url: str, **options: Any
) -> Iterator[tuple[Callable[[Callable[[Any], Any]], Any], Any]]:
    """An AsyncStore on asyncpg through a WireTap: ``(call, tap)`` (see psycopg_async_calls)."""

    async def awaited(value: Any) -> Any:
        return await value if asyncio.iscoroutine(value) or asyncio.isfuture(value) else value

    url = make_url(pg_url)
    tap = _wiretap_class()(url.host or "127.0.0.1", url.port or 5432)
    loop = asyncio.new_event_loop()
    try:
        via_tap = url.set(
            drivername="postgresql+asyncpg",
            host="127.0.0.1",
            port=tap.port,
            query={"ssl": "disable"},
        ).render_as_string(hide_password=False)
        astore = loop.run_until_complete(AsyncStore.open(via_tap, **options))
        try:
            yield (lambda fn: loop.run_until_complete(awaited(fn(astore)))), tap
        finally:
            loop.run_until_complete(astore.close())
    finally:
        loop.close()
        tap.close()


_BEGIN_LOCK = "BEGIN ISOLATION LEVEL READ COMMITTED; SELECT pg_advisory_xact_lock("


def test_a_fenced_turn_commit_on_asyncpg_merges_begin_with_its_locks(pg_url: str) -> None:
    """BEGIN + both locks in one simple query, no prepare, COMMIT of its own: 3 round trips.

    Every turn is the checking statement: BEGIN + locks; the checks with the
    writes (the first turn's inserting the head and the ledger total, the
    last turn's stamp and lease release too); COMMIT. A blind commit (no
    expected revision) is the full commit, 4 round trips: BEGIN + locks;
    lease, head and ledger totals in one read; the turn's writes in one
    statement (the usage delta with its totals upsert, the node and the head
    write carrying the checkpoint blob); COMMIT.
    """
    with asyncpg_calls(pg_url) as (call, tap):
        trips: list[list[str]] = []

        class Keep(_TapTrace):
            @contextmanager
            def round_trips(self) -> Iterator[list[str]]:
                with super().round_trips() as out:
                    yield out
                trips.append(list(out))

        counts = _turns(call, Keep(tap))
    assert counts == [3] * TURNS, trips
    for one in trips:
        assert "AS ok" in one[1] and "head_put AS" in one[1]
    with asyncpg_calls(pg_url) as (call, tap):
        got = call(lambda st: st.leases.try_claim_session_execution_lease(SID, OWNER, 600_000))
        blind = _commit(TURNS, got.lease, stamp=False, release=False).model_copy(
            update={"expected_head_revision": None}
        )
        with tap.record() as recorded:
            call(lambda st: st.commits.commit_runtime_state(blind))
        full = list(recorded)
    assert len(full) == 4, full
    assert all(f"{cte} AS" in full[2] for cte in ("totals_put", "nodes_put", "head_put")), full
    for one in trips:
        assert one[0].startswith(_BEGIN_LOCK) and "pg_advisory_xact_lock_shared(" in one[0]
        assert one[-1] == "COMMIT"
        assert sum(t.startswith("BEGIN") for t in one) == 1
    assert not [t for one in trips[1:] for t in one if t.startswith("prepare:")]


def test_lease_cycle_read_and_apply_round_trips_on_asyncpg(pg_url: str) -> None:
    """claim 4, renew 3, release 1 (one statement); load_session 4 (one BEGIN … READ ONLY);
    a refused commit."""
    sid = "sess-asyncpg-rt"
    with asyncpg_calls(pg_url) as (call, tap):
        for _ in range(2):  # warm: prepared statements
            out = call(lambda st: st.leases.try_claim_session_execution_lease(sid, OWNER, 600_000))
            assert isinstance(out, Acquired)
            call(lambda st, lease=out.lease: st.leases.release_session_execution_lease(lease))
        with tap.record() as trips:
            out = call(lambda st: st.leases.try_claim_session_execution_lease(sid, OWNER, 600_000))
        claim = list(trips)  # the tap reuses its list: a copy, before the next record
        assert isinstance(out, Acquired)
        with tap.record() as renew:
            call(lambda st: st.leases.renew_session_execution_lease(out.lease, 600_000))
        assert [len(claim), len(renew)] == [4, 3], (claim, renew)
        assert claim[0].startswith(_BEGIN_LOCK) and claim[-1] == "COMMIT"
        rc = _commit(0, out.lease, stamp=False, release=False)
        rc = rc.__class__(**{**rc.__dict__, "session_id": sid})
        call(lambda st: st.commits.commit_runtime_state(rc))
        for _ in range(2):
            call(lambda st: st.commits.load_session(sid, ActivePathScope()))
        with tap.record() as load:
            loaded = call(lambda st: st.commits.load_session(sid, ActivePathScope()))
        assert loaded is not None and loaded.head_revision == 1
        assert load[0] == "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY" and load[-1] == "COMMIT"
        assert len(load) == 4, load
        # A refused commit (stale head) is rolled back by the unit's own ROLLBACK,
        # and its connection goes back to the pool outside any transaction.
        with tap.record() as refused, pytest.raises(HeadRevisionConflict):
            call(lambda st: st.commits.commit_runtime_state(rc))
        assert refused[-1] == "ROLLBACK", refused
        with tap.record() as release:
            call(lambda st: st.leases.release_session_execution_lease(out.lease))
        assert len(release) == 1 and "pg_try_advisory_xact_lock(" in release[0], release
        assert call(lambda st: st.leases.get_session_execution_lease(sid)) is None
        again = call(lambda st: st.commits.load_session(sid, ActivePathScope()))
        assert again is not None and again.head_revision == 1


def test_asyncpg_commit_of_a_failed_transaction_is_a_definite_error(pg_url: str) -> None:
    """A lean unit that swallowed a statement's error: COMMIT (turned ROLLBACK) raises.

    The server answers COMMIT of an aborted transaction with ROLLBACK: the
    unit reports a definite TransactionAborted (nothing written), never success.
    """
    with asyncpg_calls(pg_url) as (call, _tap):

        def fn(repos: Any) -> None:
            driver = repos.runs._db
            driver.execute(_LOCK, {"ns": 1, "key": 2})
            try:
                driver._simple("SELECT 1/0")
            except Exception:  # noqa: BLE001 - the test swallows it on purpose
                pass

        with pytest.raises(TransactionAborted, match="COMMIT of a failed transaction"):
            call(lambda st: st.call_write(fn))
        assert call(lambda st: st.leases.get_session_execution_lease("nobody")) is None


def test_a_saver_put_on_asyncpg_is_three_round_trips(pg_url: str) -> None:
    """A put and a put_writes outside ``owning``: ``BEGIN`` + the locks, the write folded
    into its checking lease read (the lease is free), ``COMMIT``. A lease held by
    another owner fails that check: the unit rolls back and the guard refuses the put
    (``SessionLeaseHeld``, nothing written); once the lease expired (not released) the
    guard lets the put through on its usual path."""
    pytest.importorskip("langgraph.graph")
    from langgraph.checkpoint.base import empty_checkpoint

    from agentkeep.clock import SettableClock
    from agentkeep.errors import SessionLeaseHeld
    from agentkeep.integrations.langgraph import AgentkeepSaver
    from agentkeep.sessions.domain import LeaseOwnerIdentity

    def checkpoint(n: int) -> Any:
        cp = empty_checkpoint()
        cp["id"] = f"1ef0-{n:04}"
        return cp

    def config(thread: str, checkpoint_id: str | None = None) -> Any:
        conf = {"thread_id": thread, "checkpoint_ns": ""}
        if checkpoint_id is not None:
            conf["checkpoint_id"] = checkpoint_id
        return {"configurable": conf}

    clock = SettableClock(1_000_000)
    with asyncpg_calls(pg_url, clock=clock) as (call, tap):
        saver: Any = call(lambda st: AgentkeepSaver(st))
        call(lambda st: saver.aput(config("free"), checkpoint(0), {}, {}))  # warm
        with tap.record() as trips:
            saved = call(lambda st: saver.aput(config("free"), checkpoint(1), {}, {}))
        put = list(trips)
        with tap.record() as trips:
            call(lambda st: saver.aput_writes(saved, [("a", 1)], "task"))
        writes = list(trips)
        assert (len(put), len(writes)) == (3, 3), (put, writes)
        for one, table in ((put, "graph_nodes"), (writes, "session_pending_writes")):
            assert one[0].startswith(_BEGIN_LOCK) and one[-1] == "COMMIT", one
            assert one[1].startswith("WITH w0 AS (INSERT INTO") and table in one[1], one
        got = call(lambda st: saver.aget_tuple(config("free")))
        assert got is not None and got.pending_writes == [("task", "a", 1)]

        sid = saver.session_id("held")
        other = LeaseOwnerIdentity(owner_id="other", incarnation_id="i1")
        call(lambda st: st.leases.try_claim_session_execution_lease(sid, other, 1000))
        with pytest.raises(SessionLeaseHeld):
            call(lambda st: saver.aput(config("held"), checkpoint(1), {}, {}))
        with pytest.raises(SessionLeaseHeld):
            call(lambda st: saver.aput_writes(config("held", "1ef0-0001"), [("a", 1)], "task"))
        assert call(lambda st: saver.aget_tuple(config("held"))) is None
        assert call(lambda st: st.checkpoint_nodes.list_pending_writes(sid, "1ef0-0001")) == []
        clock.advance(1000)  # expired, not released: the check refuses, the guard lets it pass
        call(lambda st: saver.aput(config("held"), checkpoint(1), {}, {}))
        call(lambda st: saver.aput_writes(config("held", "1ef0-0001"), [("a", 1)], "task"))
        got = call(lambda st: saver.aget_tuple(config("held")))
        assert got is not None and got.pending_writes == [("task", "a", 1)]


def test_delete_session_on_asyncpg_is_three_round_trips(pg_url: str) -> None:
    """``BEGIN`` + the session lock, every DELETE as one statement of CTEs, ``COMMIT``
    (was one round trip per table); it deletes every row and counts them."""
    from agentkeep.sessions.domain import QueuedWorkDraft, QueuedWorkPayload

    sid = "del/asyncpg"
    payload = (QueuedWorkPayload(kind="k", body=1),)
    with asyncpg_calls(pg_url) as (call, tap):
        call(
            lambda st: st.queue.enqueue_queued_work(
                QueuedWorkDraft(session_id=sid, payloads=payload)
            )
        )
        call(lambda st: st.checkpoint_nodes.put_checkpoint_node(sid, "c1", b"one"))
        call(lambda st: st.leases.try_claim_session_execution_lease(sid, OWNER, 60_000))
        call(lambda st: st.catalog.delete_session("del/warm"))  # warm
        with tap.record() as trips:
            deleted = call(lambda st: st.catalog.delete_session(sid))
        assert deleted == 3, deleted  # the batch (its item by cascade), the node, the lease
        assert len(trips) == 3, trips
        assert trips[0].startswith(_BEGIN_LOCK) and trips[-1] == "COMMIT", trips
        assert trips[1].startswith("WITH deleted_"), trips
        assert call(lambda st: st.catalog.list_sessions(prefix="del/")).session_ids == []
