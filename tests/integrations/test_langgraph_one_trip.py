"""The saver's one-round-trip puts on psycopg (docs/architecture.md#one-round-trip-commit).

A put or put_writes without ``owning`` sends ``BEGIN``, the locks, the
checking lease read, the writes and ``COMMIT`` in one pipelined round trip
(``CheckpointNodeRepository._guarded``). Checked here, counted off the wire:
one round trip; a lease that is not free (held, or expired and not released)
falls back to the guard's own judgement (refused: nothing written; expired:
written); a connection lost in the round trip that carries COMMIT is
``CommitOutcomeUnknown`` whether the COMMIT was applied or not, and the
saver settles it by putting again (stored once).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

pytest.importorskip("langgraph.graph")

from langgraph.checkpoint.base import empty_checkpoint  # noqa: E402

from agentkeep import Store, db  # noqa: E402
from agentkeep.aio import AsyncStore  # noqa: E402
from agentkeep.clock import SettableClock  # noqa: E402
from agentkeep.errors import CommitOutcomeUnknown, SessionLeaseHeld  # noqa: E402
from agentkeep.integrations.langgraph import AgentkeepSaver  # noqa: E402
from agentkeep.sessions.checkpoint_nodes import PendingWrite  # noqa: E402
from agentkeep.sessions.domain import LeaseOwnerIdentity  # noqa: E402
from tests.conftest import as_async_url  # noqa: E402
from tests.sessions.test_queue import draft  # noqa: E402
from tests.sessions.test_round_trips import Trace  # noqa: E402

THREAD = "t-one-trip"


@pytest.fixture
def store(pg_url: str) -> Iterator[Store]:
    with Store.open(pg_url, clock=SettableClock(1_000_000)) as s:
        yield s


def _config(checkpoint_id: str | None = None) -> dict[str, Any]:
    conf = {"thread_id": THREAD, "checkpoint_ns": ""}
    if checkpoint_id is not None:
        conf["checkpoint_id"] = checkpoint_id
    return {"configurable": conf}


def _checkpoint(n: int) -> Any:
    cp = empty_checkpoint()
    cp["id"] = f"1ef0-{n:04}"
    return cp


def _stored(saver: AgentkeepSaver) -> list[str]:
    return [t.checkpoint["id"] for t in saver.list(_config())]


def test_a_put_and_put_writes_take_one_round_trip(store: Store) -> None:
    saver = AgentkeepSaver(store)
    trace = Trace(store.engine, store)
    saver.put(_config(), _checkpoint(0), {}, {})  # warm: the pool's connection is open
    counts = []
    for n in range(1, 7):  # past psycopg's prepare threshold (5)
        with trace.round_trips() as put:
            saved = saver.put(_config(), _checkpoint(n), {}, {})
        with trace.round_trips() as writes:
            saver.put_writes(saved, [("a", 1), ("b", 2)], f"task-{n}")
        counts.append((len(put), len(writes)))
    assert counts == [(1, 1)] * 6
    with saver.owning(THREAD), trace.round_trips() as owned:
        saver.put(_config(), _checkpoint(9), {}, {})
    assert len(owned) == 1  # fenced: the server checks the fence before COMMIT
    got = saver.get_tuple(_config())
    assert got is not None and got.checkpoint["id"] == "1ef0-0009"
    assert len(_stored(saver)) == 8


def test_async_psycopg_put_takes_one_round_trip(pg_url: str) -> None:
    loop = asyncio.new_event_loop()
    try:
        astore = loop.run_until_complete(AsyncStore.open(as_async_url(pg_url, "psycopg_async")))
        try:
            saver = AgentkeepSaver(astore)
            trace = Trace(astore.store.engine)
            loop.run_until_complete(saver.aput(_config(), _checkpoint(0), {}, {}))
            with trace.round_trips() as put:
                saved = loop.run_until_complete(saver.aput(_config(), _checkpoint(1), {}, {}))
            with trace.round_trips() as writes:
                loop.run_until_complete(saver.aput_writes(saved, [("a", 1)], "task"))
            assert (len(put), len(writes)) == (1, 1)
            got = loop.run_until_complete(saver.aget_tuple(_config()))
            assert got is not None and got.pending_writes == [("task", "a", 1)]
        finally:
            loop.run_until_complete(astore.close())
    finally:
        loop.close()


def test_a_lease_that_is_not_free_goes_to_the_guard(store: Store) -> None:
    clock = store.clock
    assert isinstance(clock, SettableClock)
    saver = AgentkeepSaver(store)
    sid = saver.session_id(THREAD)
    other = LeaseOwnerIdentity(owner_id="other", incarnation_id="i1")
    store.leases.try_claim_session_execution_lease(sid, other, 1000)
    with pytest.raises(SessionLeaseHeld):
        saver.put(_config(), _checkpoint(1), {}, {})
    with pytest.raises(SessionLeaseHeld):
        saver.put_writes(_config("1ef0-0001"), [("a", 1)], "task")
    assert _stored(saver) == []
    assert store.checkpoint_nodes.list_pending_writes(sid, "1ef0-0001") == []
    clock.advance(1000)  # expired, not released: not free, and the guard lets it pass
    saver.put(_config(), _checkpoint(1), {}, {})
    saver.put_writes(_config("1ef0-0001"), [("a", 1)], "task")
    got = saver.get_tuple(_config())
    assert got is not None and got.pending_writes == [("task", "a", 1)]


def _fault(monkeypatch: pytest.MonkeyPatch, pg_url: str, kind: str) -> list[int]:
    """Make the next round trip that commits lose its connection.

    ``terminate``: the backend is terminated before the round trip is sent
    (not applied); ``lost``: the round trip runs (applied), then the
    connection is closed and its answer reported lost.
    """
    fired: list[int] = []
    original = db.Driver._round_trip
    admin = psycopg.connect(pg_url.replace("+psycopg", ""), autocommit=True)

    def commits(items: list[tuple[str, Any]]) -> bool:
        """The round trip commits: it ends in COMMIT, or it is the implicit transaction
        of a checking read (Driver.prefetching's ``implicit``)."""
        return items[-1] == ("COMMIT", None) or any(
            "transaction_isolation" in sql for sql, _ in items
        )

    def round_trip(driver: db.Driver, items: list[tuple[str, Any]], out: list[Any]) -> None:
        if fired or not commits(items):
            original(driver, items, out)
            return
        fired.append(1)
        if kind == "terminate":
            pid = driver.raw.info.backend_pid
            admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
            while admin.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchall():
                pass
            original(driver, items, out)
            raise AssertionError("the round trip on a terminated backend did not fail")
        original(driver, items, out)
        driver.raw.close()
        raise psycopg.OperationalError("injected: the answer to the round trip was lost")

    monkeypatch.setattr(db.Driver, "_round_trip", round_trip)
    return fired


@pytest.mark.parametrize(("kind", "applied"), [("terminate", False), ("lost", True)])
def test_a_connection_lost_in_the_round_trip_with_commit_is_an_unknown_outcome(
    store: Store, pg_url: str, monkeypatch: pytest.MonkeyPatch, kind: str, applied: bool
) -> None:
    sid = AgentkeepSaver(store).session_id(THREAD)
    fired = _fault(monkeypatch, pg_url, kind)
    with pytest.raises(CommitOutcomeUnknown):
        store._call_operation(lambda r: r.checkpoint_nodes.put_checkpoint_node(sid, "c1", b"body"))
    assert fired == [1]
    assert (store.checkpoint_nodes.get_checkpoint_node(sid, "c1") is not None) is applied
    fired.clear()
    with pytest.raises(CommitOutcomeUnknown):
        store._call_operation(
            lambda r: r.checkpoint_nodes.put_pending_writes(
                sid, "c1", "t", [PendingWrite(0, "a", "json", b"1")]
            )
        )
    assert len(store.checkpoint_nodes.list_pending_writes(sid, "c1")) == int(applied)


@pytest.mark.parametrize("kind", ["terminate", "lost"])
def test_the_saver_settles_an_unknown_outcome_by_putting_again(
    store: Store, pg_url: str, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    saver = AgentkeepSaver(store)
    fired = _fault(monkeypatch, pg_url, kind)
    saver.put(_config(), _checkpoint(1), {}, {})
    assert fired == [1]
    fired.clear()
    saver.put_writes(_config("1ef0-0001"), [("a", 1), ("b", 2)], "task")
    assert fired == [1]
    got = saver.get_tuple(_config())
    assert got is not None and got.checkpoint["id"] == "1ef0-0001"
    assert got.pending_writes == [("task", "a", 1), ("task", "b", 2)]
    assert _stored(saver) == ["1ef0-0001"]


def test_a_statement_after_the_pipelined_commit_is_refused(store: Store) -> None:
    def after(r: Any) -> None:
        drv = r.driver
        with drv.prefetching([], commit=True):
            drv.execute(db._LOCK_SQL, {"ns": 1, "key": 1})
        drv.execute(db._LOCK_SQL, {"ns": 1, "key": 2})

    call: Callable[[], Any] = lambda: store._call_operation(after)  # noqa: E731
    with pytest.raises(RuntimeError, match="after the unit's pipelined COMMIT"):
        call()


def test_a_put_after_other_work_of_its_unit_keeps_that_work(store: Store) -> None:
    """Only a unit that has sent nothing yet takes the one round trip: a put after
    other statements of its unit goes the two-round-trip way, so a lease that is
    not free never restarts (rolls back) the work before it."""
    clock = store.clock
    assert isinstance(clock, SettableClock)
    sid = AgentkeepSaver(store).session_id(THREAD)
    owner = LeaseOwnerIdentity(owner_id="other", incarnation_id="i1")
    store.leases.try_claim_session_execution_lease(sid, owner, 1000)
    clock.advance(1000)  # expired, not released: not free

    # The other work is an enqueue: a lease claim would send its own write with
    # COMMIT in a one-call unit (SessionLeaseRepository._last_write), which
    # holds one operation only.
    def unit(r: Any) -> None:
        r.queue.enqueue_queued_work(draft(sid="other-session"))
        r.checkpoint_nodes.put_checkpoint_node(sid, "c1", b"body")

    store._call_operation(unit)
    assert store.checkpoint_nodes.get_checkpoint_node(sid, "c1") is not None
    assert len(store.queue.list_queued_work("other-session")) == 1
