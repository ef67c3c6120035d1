"""Cancellation in the native mode: every cancelled operation is applied completely or not at all.

The contract is the :mod:`agentkeep.aio` module docstring:

* a one-call operation cancelled before it sends its COMMIT is interrupted
  where it waits, rolled back, and the caller ends with ``CancelledError``
  (none of it); cancelled once COMMIT was sent, the caller waits for the
  COMMIT's answer and then ends cancelled (all of it);
* ``runtime.commit_unregister_finalization`` is never interrupted;
* in ``async with astore.write()``, a cancellation inside the block rolls the
  unit back; the end-of-block commit is never interrupted; a block that
  catches the ``CancelledError`` of an interrupted repository call and exits
  normally is rolled back and ``CancelledError`` is raised.

After every cancellation the store keeps working: the next operations
succeed and no pooled connection stays checked out.

Locks are held by another OS process (:func:`~tests.aio.support.hold_write_lock`).
Where a cancellation must arrive at an exact point (during COMMIT, inside a
repository call) the operation is parked there on an asyncio event
(:class:`~tests.aio.support.Gate`), never timed.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from sqlalchemy import event

from agentkeep import db
from agentkeep.aio import AsyncStore
from agentkeep.clock import SettableClock
from agentkeep.runs.domain import RunStatus
from agentkeep.runtime import (
    InputStatePersistenceRecord,
    MachineLifecycleCommit,
    OpsSnapshot,
    ReferenceDomain,
    StoredInputState,
    UnregisterFinalizationCommit,
    issue_delete_ops_finalization_authority,
)
from agentkeep.sessions.domain import Acquired, LeaseFence
from agentkeep.sessions.records import RuntimeCommitResult
from tests.runtime.support import RT

from .support import (
    SID,
    T0,
    TTL,
    A,
    Observer,
    finished,
    gate_commit,
    gate_execute,
    gate_unit_commit,
    hold_write_lock,
    is_sqlite,
    new_run,
    open_astore,
    pending,
    pg_lock_waiters,
    run_status,
    runtime_commit,
    still_running,
    until,
)


async def healthy(astore: AsyncStore, url: str, run_id: str) -> None:
    """The store works after a cancellation: more concurrent operations than pooled
    connections succeed, the run moves on, nothing stays checked out, and no
    connection was left inside a transaction."""
    gets = await asyncio.gather(*(astore.runs.get(run_id) for _ in range(12)))
    assert {g.id for g in gets} == {run_id}
    assert await astore.runs.try_transition(run_id, RunStatus.PENDING, RunStatus.RUNNING)
    assert astore.engine.pool.checkedout() == 0
    with Observer(url) as seen:
        assert await seen.no_transaction_left_open()


async def lease(astore: AsyncStore) -> LeaseFence:
    out = await astore.leases.try_claim_session_execution_lease(SID, A, TTL)
    assert isinstance(out, Acquired), out
    return out.lease


# --------------------------------------------------------------------------
# A lock held by another process


@pytest.mark.parametrize("how", ["one_call", "unit"])
def test_cancel_while_waiting_for_a_lock_held_by_another_process(async_url: str, how: str) -> None:
    """A write waits for run R-1's write lock, which another process holds; it is cancelled.

    ``one_call``: ``runs.try_transition``. ``unit``: ``async with
    astore.write()`` creating R-2, then transitioning R-1 (on SQLite the
    unit's own ``BEGIN IMMEDIATE`` waits; on Postgres the transition waits for
    R-1's advisory lock after R-2 was written in the unit).

    Expected: the caller ends with ``CancelledError``; once the holder has let
    go, nothing of the operation is stored (R-1 Pending, no R-2); the store
    then works. Postgres (asyncpg, psycopg_async): the wait is interrupted at
    once, so the caller ends while the holder still holds the lock, and the
    server no longer waits for it. SQLite (aiosqlite): the waiting statement
    runs on aiosqlite's thread and cannot be interrupted (``sqlite3``'s
    ``interrupt()`` does not end a busy wait either); the cancellation takes
    effect when the wait ends, so the test releases the holder, then awaits
    the caller.
    """
    began = threading.Event()  # the operation took its connection: it begins at once
    sqlite = is_sqlite(async_url)

    async def scenario() -> None:
        astore = await open_astore(async_url)
        event.listen(astore.engine.sync_engine, "checkout", lambda *_: began.set())
        try:
            await astore.runs.create(new_run("R-1"))
            began.clear()

            async def in_a_unit() -> None:
                async with astore.write() as uow:
                    await uow.runs.create(new_run("R-2"))
                    await uow.runs.try_transition("R-1", RunStatus.PENDING, RunStatus.RUNNING)

            with hold_write_lock(async_url, db.LockNamespace.RUN, "R-1") as holder:
                op: Any = (
                    astore.runs.try_transition("R-1", RunStatus.PENDING, RunStatus.RUNNING)
                    if how == "one_call"
                    else in_a_unit()
                )
                task = asyncio.ensure_future(op)
                if sqlite:
                    await until(began.is_set, "the write began")
                    await asyncio.sleep(0.05)  # into the busy wait (either way: nothing written)
                else:
                    await until(lambda: pg_lock_waiters(async_url) == 1, "it waits for the lock")
                assert await still_running(task)
                task.cancel()
                if not sqlite:
                    await finished(task)  # interrupted while the holder still holds the lock
                    assert task.cancelled()
                    await until(lambda: pg_lock_waiters(async_url) == 0, "the server's wait ended")
                holder.release()
                await finished(task)
                assert task.cancelled()
            assert pending(async_url, "R-1")
            assert run_status(async_url, "R-2") is None
            await healthy(astore, async_url, "R-1")
        finally:
            await astore.close()

    asyncio.run(scenario())


# --------------------------------------------------------------------------
# During COMMIT


def test_cancel_during_commit_waits_for_it_and_the_write_is_there(
    async_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A multi-table ``commits.commit_runtime_state`` is cancelled while its COMMIT is under way.

    The COMMIT is parked at a gate after the operation marked it sent.
    Expected: the caller does not end while the COMMIT waits (a second
    cancellation changes nothing); once it completes the caller ends with
    ``CancelledError``, and the whole turn is stored (stamp, nodes, usage,
    enqueued batch, head revision 1).
    """

    async def scenario() -> None:
        astore = await open_astore(async_url)
        try:
            fence = await lease(astore)
            gate = gate_commit(monkeypatch)
            gate.armed = True
            task = asyncio.ensure_future(
                astore.commits.commit_runtime_state(runtime_commit(fence, "t1", 0))
            )
            await asyncio.wait_for(gate.entered.wait(), 60)
            task.cancel()
            assert await still_running(task), "the caller left while its COMMIT was under way"
            task.cancel()
            assert await still_running(task)
            with Observer(async_url) as seen:
                assert seen.turns() == []  # not committed yet
            gate.opened.set()
            await finished(task)
            assert task.cancelled()
            assert gate.passed == 1
            with Observer(async_url) as seen:
                assert seen.turns() == ["t1"]
            assert await astore.commits.get_head_revision(SID) == 1
            await astore.runs.create(new_run("R-1"))
            await healthy(astore, async_url, "R-1")
        finally:
            await astore.close()

    asyncio.run(scenario())


# --------------------------------------------------------------------------
# At random points


async def measured(op: Any) -> tuple[float, int]:
    """Run ``op`` to its end; how long it took and how many loop iterations it spanned."""
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(op)
    started = loop.time()
    ticks = 0
    while not task.done():
        await asyncio.sleep(0)
        ticks += 1
    took = loop.time() - started
    task.result()
    return took, ticks


ROUNDS = 24


def test_cancel_at_random_points_is_all_or_nothing(async_url: str) -> None:
    """Turn commits cancelled after a random delay: each is stored entirely or not at all.

    Each round starts a ``commits.commit_runtime_state`` (two nodes, a
    checkpoint blob, a usage delta, a turn stamp, an enqueued batch, the
    head) and cancels it after a random number of event loop iterations or
    a random pause, each up to 1.5 times what an uncancelled commit took
    (the median of three). Expected
    after every round: the caller got the result (the turn is stored) or
    ``CancelledError`` (the turn is stored completely or not at all); the
    multi-table invariant holds (:meth:`~tests.aio.support.Observer.turns`);
    and the next round, against the head that is actually stored, succeeds
    or is cancelled in turn. Round 0 is cancelled before it starts
    (nothing stored).
    """
    rng = random.Random(20_260_512)

    async def scenario() -> None:
        astore = await open_astore(async_url, SettableClock(T0))
        seen = Observer(async_url)
        try:
            fence = await lease(astore)
            committed: list[str] = []
            times: list[float] = []
            ticks: list[int] = []
            for turn in ("warm-1", "warm-2", "warm-3"):
                parent = f"{committed[-1]}-b" if committed else None
                took, ticked = await measured(
                    astore.commits.commit_runtime_state(
                        runtime_commit(fence, turn, len(committed), parent)
                    )
                )
                committed.append(turn)
                times.append(took)
                ticks.append(ticked)
            typical_s, typical_ticks = sorted(times)[1], sorted(ticks)[1]
            outcomes = {"result": 0, "nothing": 0, "all": 0}
            for i in range(ROUNDS):
                turn = f"t{i:02d}"
                parent = f"{committed[-1]}-b"
                task = asyncio.ensure_future(
                    astore.commits.commit_runtime_state(
                        runtime_commit(fence, turn, len(committed), parent)
                    )
                )
                if i == 0:
                    pass
                elif i % 2:
                    for _ in range(rng.randrange(1, int(typical_ticks * 1.5) + 2)):
                        await asyncio.sleep(0)
                else:
                    await asyncio.sleep(rng.uniform(0, typical_s * 1.5))
                task.cancel()
                await finished(task)
                stored = seen.turns()
                if task.cancelled():
                    assert stored in (sorted(committed), sorted([*committed, turn])), stored
                    outcomes["all" if turn in stored else "nothing"] += 1
                else:
                    result = task.result()
                    assert isinstance(result, RuntimeCommitResult)
                    assert result.head_revision == len(committed) + 1
                    assert stored == sorted([*committed, turn])
                    outcomes["result"] += 1
                if turn in stored:
                    committed.append(turn)
                assert astore.engine.pool.checkedout() == 0
                assert await seen.no_transaction_left_open(), f"round {i}: a transaction left open"
            assert outcomes["nothing"] >= 1, outcomes
            assert sum(outcomes.values()) == ROUNDS
            assert await astore.commits.get_head_revision(SID) == len(committed)
            await astore.runs.create(new_run("R-1"))
            await healthy(astore, async_url, "R-1")
        finally:
            seen.close()
            await astore.close()

    asyncio.run(scenario())


STEPS = 40
#: The most steps swept one by one around the first statement.
DENSE = 120


def stored_result(seen: Observer, run_id: str) -> Any:
    value = seen.scalar("SELECT result_ref_json FROM runs WHERE id = :id", id=run_id)
    return None if value is None else json.loads(value)


async def first_statement_window(
    astore: AsyncStore, monkeypatch: pytest.MonkeyPatch, op: Callable[[], Awaitable[Any]]
) -> tuple[int, int, int]:
    """Run ``op`` uncancelled; the loop iterations at which it took its connection,
    at which its first statement returned, and at which it ended."""
    ticks = 0
    marks: dict[str, int] = {}
    original = db.Driver.execute
    original_alone = db.Driver.execute_alone

    def execute(self: db.Driver, stmt: Any, params: Any) -> Any:
        cursor = original(self, stmt, params)
        marks.setdefault("first", ticks)
        return cursor

    def execute_alone(self: db.Driver, stmt: Any, params: Any, **kw: Any) -> Any:
        # A one-call write sent as one statement of its own (runs.set_result on Postgres).
        cursor = original_alone(self, stmt, params, **kw)
        if cursor is not None:
            marks.setdefault("first", ticks)
        return cursor

    def checkout(*_: Any) -> None:
        marks.setdefault("checkout", ticks)

    engine = astore.engine.sync_engine
    event.listen(engine, "checkout", checkout)
    with monkeypatch.context() as patch:
        patch.setattr(db.Driver, "execute", execute)
        patch.setattr(db.Driver, "execute_alone", execute_alone)
        task = asyncio.ensure_future(op())
        while not task.done():
            await asyncio.sleep(0)
            ticks += 1
    event.remove(engine, "checkout", checkout)
    task.result()
    return marks["checkout"], marks["first"], ticks


@pytest.mark.parametrize("how", ["one_call", "unit", "read"])
def test_cancel_at_each_loop_step_leaves_no_stale_transaction(
    async_url: str, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """An operation is cancelled after k event loop iterations, for k across its whole run;
    after each, a write runs uncancelled and must be stored.

    The cancelled operation is a write, ``runs.set_result`` (``one_call``),
    or the same in ``async with astore.write()`` (``unit``), or a read of
    several statements, ``call_read`` (``read``: it opens a snapshot
    transaction first). k takes every value from the iteration at which an
    uncancelled one took its connection to the one at which its first
    statement returned (where the driver opens its transaction), with a
    margin of half that on each side (about :data:`DENSE` values at most),
    and :data:`STEPS` values spread up to 1.5 times its whole run.

    Expected after each cancellation: the caller got ``CancelledError`` or
    the result, and the stored result is the previous one or the cancelled
    write's (the one it returned, if it returned); no connection is left
    inside a transaction; and the next, uncancelled write is stored (read
    back on another connection). A regression test: asyncpg interrupted in
    its implicit ``BEGIN`` forgets the transaction it opened; such a
    connection went back to the pool with its rollback a no-op, and later
    units on it ran inside that stale transaction (writes reported success
    and were never committed; a read's ``SET TRANSACTION`` failed).
    """

    async def scenario() -> None:
        astore = await open_astore(async_url)
        seen = Observer(async_url)
        try:
            await astore.runs.create(new_run("R-1"))

            async def write(value: Any) -> None:
                if how == "unit":
                    async with astore.write() as uow:
                        await uow.runs.set_result("R-1", value)
                    return
                await astore.runs.set_result("R-1", value)

            async def operation(value: Any) -> Any:
                if how == "read":
                    return await astore.call_read(lambda r: r.runs.get("R-1").result_ref)
                return await write(value)

            await write({"warm": 0})
            took, first, last = await first_statement_window(
                astore, monkeypatch, lambda: operation({"warm": 1})
            )
            end = 3 * last // 2 + 1
            margin = (first - took) // 2 + 2
            dense = range(max(0, took - margin), first + margin, max(1, 2 * margin // DENSE))
            ks = sorted({*dense, *(end * i // STEPS for i in range(STEPS + 1))})
            previous = stored_result(seen, "R-1")
            for k in ks:
                task = asyncio.ensure_future(operation({"cancelled": k}))
                for _ in range(k):
                    await asyncio.sleep(0)
                task.cancel()
                await finished(task)
                got = stored_result(seen, "R-1")
                if how == "read":
                    assert got == previous, (k, got)
                    assert task.cancelled() or task.result() == previous, (k, task.result())
                elif task.cancelled():
                    assert got in (previous, {"cancelled": k}), (k, got)
                else:
                    assert task.result() is None
                    assert got == {"cancelled": k}, (k, got)
                assert astore.engine.pool.checkedout() == 0
                assert await seen.no_transaction_left_open(), f"after a cancel at step {k}"
                await write({"after": k})
                assert stored_result(seen, "R-1") == {"after": k}, f"step {k}: not durable"
                previous = {"after": k}
            await healthy(astore, async_url, "R-1")
        finally:
            seen.close()
            await astore.close()

    asyncio.run(scenario())


# --------------------------------------------------------------------------
# Inside async with astore.write()


def test_cancelled_inside_a_unit_block_rolls_back(async_url: str) -> None:
    """The task running ``async with astore.write()`` is cancelled while the block awaits
    something else (not the store), after writing. Expected: ``CancelledError``;
    the unit is rolled back (no R-2, R-1 Pending); the store works (on SQLite
    the unit's write lock was freed)."""

    async def scenario() -> None:
        astore = await open_astore(async_url)
        try:
            await astore.runs.create(new_run("R-1"))
            inside = asyncio.Event()

            async def block() -> None:
                async with astore.write() as uow:
                    await uow.runs.create(new_run("R-2"))
                    assert await uow.runs.try_transition(
                        "R-1", RunStatus.PENDING, RunStatus.RUNNING
                    )
                    inside.set()
                    await asyncio.Event().wait()

            task = asyncio.ensure_future(block())
            await asyncio.wait_for(inside.wait(), 60)
            task.cancel()
            await finished(task)
            assert task.cancelled()
            assert pending(async_url, "R-1")
            assert run_status(async_url, "R-2") is None
            await healthy(astore, async_url, "R-1")
        finally:
            await astore.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("block_catches", [False, True])
def test_interrupted_repository_call_in_a_unit_rolls_it_back(
    async_url: str, monkeypatch: pytest.MonkeyPatch, block_catches: bool
) -> None:
    """A repository call inside ``async with astore.write()`` is interrupted by a cancellation
    while it waits in a driver call (parked at a gate), after the unit wrote R-2.

    Expected: the call raises ``CancelledError``. A block that lets it
    propagate: the unit is rolled back. A block that catches it and exits
    normally: the unit is still rolled back (it holds half an operation) and
    ``CancelledError`` is raised at the end of the ``async with``. Either way
    the task ends cancelled and nothing of the unit is stored.
    """

    async def scenario() -> None:
        astore = await open_astore(async_url)
        try:
            await astore.runs.create(new_run("R-1"))
            gate = gate_execute(monkeypatch)
            caught: list[BaseException] = []
            after_block: list[str] = []

            async def block() -> None:
                async with astore.write() as uow:
                    await uow.runs.create(new_run("R-2"))
                    gate.armed = True
                    try:
                        await uow.runs.try_transition("R-1", RunStatus.PENDING, RunStatus.RUNNING)
                    except asyncio.CancelledError as exc:
                        if not block_catches:
                            raise
                        caught.append(exc)
                    after_block.append("block ended")
                after_block.append("unit ended")

            task = asyncio.ensure_future(block())
            await asyncio.wait_for(gate.entered.wait(), 60)
            task.cancel()
            await finished(task)
            assert task.cancelled()
            assert gate.passed == 0
            assert len(caught) == int(block_catches)
            assert after_block == (["block ended"] if block_catches else [])
            assert pending(async_url, "R-1")
            assert run_status(async_url, "R-2") is None
            await healthy(astore, async_url, "R-1")
        finally:
            await astore.close()

    asyncio.run(scenario())


def test_cancel_during_a_unit_commit_waits_and_commits(async_url: str) -> None:
    """The end-of-block COMMIT of ``async with astore.write()`` is parked at a gate; the task
    is cancelled meanwhile. Expected: the task does not end while the COMMIT
    waits; then it ends with ``CancelledError`` and the unit is committed
    (R-2 created, R-1 Running)."""

    async def scenario() -> None:
        astore = await open_astore(async_url)
        try:
            await astore.runs.create(new_run("R-1"))
            with gate_unit_commit(astore) as gate:

                async def block() -> None:
                    async with astore.write() as uow:
                        await uow.runs.create(new_run("R-2"))
                        assert await uow.runs.try_transition(
                            "R-1", RunStatus.PENDING, RunStatus.RUNNING
                        )
                        gate.armed = True

                task = asyncio.ensure_future(block())
                await asyncio.wait_for(gate.entered.wait(), 60)
                task.cancel()
                assert await still_running(task), "the caller left while the unit committed"
                assert pending(async_url, "R-1")
                gate.opened.set()
                await finished(task)
                assert task.cancelled()
                assert gate.passed == 1
            assert run_status(async_url, "R-1") == RunStatus.RUNNING.value
            assert run_status(async_url, "R-2") == RunStatus.PENDING.value
            await healthy(astore, async_url, "R-2")
        finally:
            await astore.close()

    asyncio.run(scenario())


# --------------------------------------------------------------------------
# Unregister finalization (seed test #30, native)

EPOCH = "epoch-e"


class _SignallingDomain(ReferenceDomain):
    """The reference domain; ``started`` is set when a finalization starts encoding."""

    def __init__(self) -> None:
        super().__init__()
        self.started = threading.Event()

    def encode_lifecycle(self, snapshot: MachineLifecycleCommit) -> bytes:
        self.started.set()
        return super().encode_lifecycle(snapshot)


def test_cancelled_finalization_is_shielded_and_fully_applied(async_url: str) -> None:
    """Seed test #30 in the native mode: another process holds the runtime's write lock
    while ``runtime.commit_unregister_finalization`` runs; its caller is cancelled.

    Expected: the cancellation does not return while the holder holds the
    lock (the finalization is never interrupted; nothing of it is stored
    yet); after the release the caller ends with ``CancelledError`` and the
    finalization is fully applied: lifecycle idle, the input state stored,
    the ops lifecycle of the retired epoch deleted.
    """

    async def scenario() -> None:
        domain = _SignallingDomain()
        astore = await open_astore(async_url, runtime_domain=domain)
        try:
            await astore.runtime.persist_ops_lifecycle(RT, OpsSnapshot(epoch_id=EPOCH))
            state = StoredInputState.new_accepted()
            finalization = UnregisterFinalizationCommit(
                lifecycle=MachineLifecycleCommit(runtime_state="idle"),
                input_states=(InputStatePersistenceRecord.from_machine_snapshot(state),),
                retired_ops_epoch=EPOCH,
                authority=issue_delete_ops_finalization_authority(),
            )
            with hold_write_lock(async_url, db.LockNamespace.RUNTIME, RT) as holder:
                task = asyncio.ensure_future(
                    astore.runtime.commit_unregister_finalization(RT, finalization)
                )
                await until(domain.started.is_set, "the finalizer started")
                if not is_sqlite(async_url):
                    await until(lambda: pg_lock_waiters(async_url) == 1, "it waits for the lock")
                task.cancel()
                assert await still_running(task), "cancellation returned during the finalization"
                assert await astore.runtime.load_machine_lifecycle_record(RT) is None
                assert await astore.runtime.load_ops_lifecycle(RT) == OpsSnapshot(epoch_id=EPOCH)
                holder.release()
                await finished(task)
                assert task.cancelled()
            lifecycle = await astore.runtime.load_machine_lifecycle(RT)
            assert lifecycle == MachineLifecycleCommit(runtime_state="idle")
            assert await astore.runtime.load_input_states(RT) == [state]
            assert await astore.runtime.load_ops_lifecycle(RT) is None
            assert astore.engine.pool.checkedout() == 0
        finally:
            await astore.close()

    asyncio.run(scenario())
