"""The async facade ``AsyncStore`` / ``astore.runtime`` (spec runtime §0.1, §6.7).

Seed test #30 on both backends: while another connection holds the
runtime's write lock (SQLite: a raw ``BEGIN IMMEDIATE``; Postgres: the
runtime's advisory lock), a cancelled ``commit_unregister_finalization``
task does not complete until its transaction has, and the finalization then
is fully durable — never a detached write. Also the semantics of
:func:`agentkeep.aio.run_to_completion`, typed errors through the facade, a
thread race through it, and a smoke test of the other operations.

Timeouts below only bound *negative* checks ("has not finished yet") and
failure detection; no test waits for time to pass.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import psycopg
import pytest
from sqlalchemy import make_url

from agentkeep.aio import AsyncRuntimeCalls, AsyncStore, run_to_completion
from agentkeep.db import LockNamespace, _key_hash
from agentkeep.runtime import (
    InputStatePersistenceRecord,
    MachineLifecycleCommit,
    Message,
    OpsSnapshot,
    ReferenceDomain,
    RunBoundaryReceipt,
    Session,
    StoredInputState,
    UnregisterFinalizationCommit,
    issue_delete_ops_finalization_authority,
)
from agentkeep.runtime.errors import OpsLifecycleEpochRetired, WriteFailed
from agentkeep.runtime.facade import RuntimeCalls

from .support import RT

EPOCH = "epoch-e"
WAIT_S = 10.0  # upper bound for things that must happen; never reached when green


class _SignallingDomain(ReferenceDomain):
    """The reference domain; ``started`` is set when a finalization starts encoding."""

    def __init__(self) -> None:
        super().__init__()
        self.started = threading.Event()

    def encode_lifecycle(self, snapshot: MachineLifecycleCommit) -> bytes:
        self.started.set()
        return super().encode_lifecycle(snapshot)


def _plain_pg_url(url: str) -> str:
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


@contextmanager
def _write_lock_blocker(backend: str, url: str) -> Iterator[Callable[[], None]]:
    """Hold the runtime's write lock on a separate connection; yield its release."""
    if backend == "sqlite":
        path = make_url(url).database
        assert path is not None
        lite = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        lite.execute("BEGIN IMMEDIATE")
        try:
            yield lite.rollback
        finally:
            lite.close()
        return
    pg = psycopg.connect(_plain_pg_url(url))
    try:
        pg.execute("SELECT pg_advisory_xact_lock(%s, %s)", (LockNamespace.RUNTIME, _key_hash(RT)))
        yield pg.commit
    finally:
        pg.close()


def _pg_lock_waiters(url: str) -> int:
    with psycopg.connect(_plain_pg_url(url), autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
            " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        ).fetchone()
    assert row is not None
    return int(row[0])


async def _until(predicate: Callable[[], bool], what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_S
    while not predicate():
        assert loop.time() < deadline, f"timed out waiting until {what}"
        await asyncio.sleep(0.005)


def _finalization(state: StoredInputState) -> UnregisterFinalizationCommit:
    return UnregisterFinalizationCommit(
        lifecycle=MachineLifecycleCommit(runtime_state="idle"),
        input_states=(InputStatePersistenceRecord.from_machine_snapshot(state),),
        retired_ops_epoch=EPOCH,
        authority=issue_delete_ops_finalization_authority(),
    )


# --------------------------------------------------------------------------
# Seed test #30


def test_cancelled_finalization_has_no_detached_write(backend: str, db_url: str) -> None:  # #30
    async def scenario() -> None:
        domain = _SignallingDomain()
        astore = await AsyncStore.open(db_url, runtime_domain=domain)
        try:
            await astore.runtime.persist_ops_lifecycle(RT, OpsSnapshot(epoch_id=EPOCH))
            state = StoredInputState.new_accepted()
            with _write_lock_blocker(backend, db_url) as release:
                call = astore.runtime.commit_unregister_finalization(RT, _finalization(state))
                task = asyncio.ensure_future(call)
                await _until(domain.started.is_set, "the finalizer started")
                if backend == "postgres":
                    await _until(lambda: _pg_lock_waiters(db_url) == 1, "it waits for the lock")
                await asyncio.sleep(0.05)
                task.cancel()
                done, _ = await asyncio.wait({task}, timeout=0.1)
                assert not done, "cancellation returned while the transaction was in progress"
                assert await astore.runtime.load_machine_lifecycle_record(RT) is None
                release()
                done, _ = await asyncio.wait({task}, timeout=2.0)
            assert task in done
            assert task.cancelled()
            lifecycle = await astore.runtime.load_machine_lifecycle(RT)
            assert lifecycle == MachineLifecycleCommit(runtime_state="idle")
            assert await astore.runtime.load_input_states(RT) == [state]
            assert await astore.runtime.load_ops_lifecycle(RT) is None
        finally:
            await astore.close()

    asyncio.run(scenario())


# --------------------------------------------------------------------------
# run_to_completion


def test_run_to_completion_returns_and_raises() -> None:
    async def scenario() -> None:
        assert await run_to_completion(lambda: 41 + 1) == 42

        def boom() -> None:
            raise WriteFailed("from the thread")

        with pytest.raises(WriteFailed, match="from the thread"):
            await run_to_completion(boom)

    asyncio.run(scenario())


def test_cancellation_waits_for_the_thread_then_propagates() -> None:
    gate = threading.Event()
    entered = threading.Event()
    finished: list[str] = []

    def work() -> str:
        entered.set()
        assert gate.wait(WAIT_S)
        finished.append("work")
        return "result"

    async def scenario() -> None:
        task = asyncio.create_task(run_to_completion(work))
        await _until(entered.is_set, "the work started")
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=0.1)
        assert not done
        task.cancel()  # a second cancellation does not detach it either
        done, _ = await asyncio.wait({task}, timeout=0.1)
        assert not done
        assert finished == []
        gate.set()
        done, _ = await asyncio.wait({task}, timeout=WAIT_S)
        assert task in done and task.cancelled()
        assert finished == ["work"]

    asyncio.run(scenario())


def test_wait_for_timeout_returns_only_after_the_thread() -> None:
    gate = threading.Event()
    finished: list[str] = []

    def work() -> None:
        assert gate.wait(WAIT_S)
        finished.append("work")

    async def scenario() -> None:
        task = asyncio.create_task(asyncio.wait_for(run_to_completion(work), timeout=0.01))
        done, _ = await asyncio.wait({task}, timeout=0.2)
        assert not done  # the timeout fired long ago, yet it still waits for the thread
        gate.set()
        done, _ = await asyncio.wait({task}, timeout=WAIT_S)
        assert task in done
        with pytest.raises(TimeoutError):
            task.result()
        assert finished == ["work"]

    asyncio.run(scenario())


# --------------------------------------------------------------------------
# The facade


def test_async_facade_covers_every_runtime_operation() -> None:
    sync = {n for n in dir(RuntimeCalls) if not n.startswith("_")}
    wrapped = {n for n in dir(AsyncRuntimeCalls) if not n.startswith("_")}
    assert wrapped <= sync
    # Every operation, the OAuth flow state's too (synchronous only in the
    # original store, spec §0.1; a native AsyncStore has no synchronous path).
    assert sync - wrapped == {"domain"}
    with pytest.raises(AttributeError):
        AsyncRuntimeCalls.atomic_apply  # noqa: B018 - bound to an instance only


def _receipt(run_id: str, sequence: int = 1) -> RunBoundaryReceipt:
    return RunBoundaryReceipt(run_id=run_id, boundary="RunStart", sequence=sequence)


def test_async_operations_smoke(db_url: str) -> None:
    async def scenario() -> None:
        async with await AsyncStore.open(db_url) as astore:
            rt = astore.runtime
            domain = astore.store.runtime_domain
            assert await rt.supports_compaction_projection_outbox() is True
            assert await rt.auth_authority_key() == astore.store.runtime.auth_authority_key()
            # snapshots
            head = Session.new().with_message("user", "hello")
            await rt.commit_session_snapshot(RT, domain.encode_session(head))
            assert await rt.load_session_snapshot(RT) == domain.encode_session(head)
            diverged = head.with_message("user", "a")
            other = head.with_message("user", "b")
            await rt.commit_session_snapshot(RT, domain.encode_session(diverged))
            with pytest.raises(WriteFailed):
                await rt.commit_session_snapshot(RT, domain.encode_session(other))
            assert await rt.load_session_snapshot(RT) == domain.encode_session(diverged)
            assert await rt.replace_session_snapshot_if_current(
                RT, domain.encode_session(diverged), domain.encode_session(other)
            )
            assert await rt.clear_session_snapshot_if_current(RT, domain.encode_session(other))
            assert await rt.is_runtime_projection_quarantined(RT)
            # boundary + inputs
            run_id = str(uuid.uuid4())
            state = StoredInputState.new_accepted()
            await rt.atomic_apply(RT, None, _receipt(run_id), [state])
            assert await rt.load_boundary_receipt(RT, run_id, 1) == _receipt(run_id)
            assert await rt.load_input_state(RT, state.input_id) == state
            bumped = InputStatePersistenceRecord.from_machine_snapshot(state.with_recovery_count(2))
            await rt.persist_input_state(RT, bumped)
            assert await rt.load_input_states(RT) == [state.with_recovery_count(2)]
            assert await rt.load_pending_compaction_projections(RT) == []
            # lifecycle, ops
            await rt.commit_machine_lifecycle(RT, MachineLifecycleCommit(runtime_state="stopped"))
            assert await rt.load_runtime_state(RT) == "stopped"
            first = await rt.initialize_ops_lifecycle_if_absent(RT, OpsSnapshot(epoch_id=EPOCH))
            assert first == OpsSnapshot(epoch_id=EPOCH)
            await rt.commit_unregister_finalization(RT, _finalization(state))
            with pytest.raises(OpsLifecycleEpochRetired):
                await rt.persist_ops_lifecycle(RT, OpsSnapshot(epoch_id=EPOCH))
            assert await rt.load_ops_lifecycle(RT) is None
            # mob hosts
            assert await rt.put_mob_host_binding_if_absent("mob-a", b"record-1")
            assert await rt.compare_and_put_mob_host_binding("mob-a", b"record-1", b"record-2")
            assert await rt.list_mob_host_bindings() == [("mob-a", b"record-2")]
            assert await rt.revoke_mob_host_binding("mob-a", b"record-2", b"receipt")
            assert await rt.load_mob_host_revocation("mob-a") == b"receipt"
            # whole units
            count = await astore.call_read(lambda repos: len(repos.runtime.load_input_states(RT)))
            assert count == 1

    asyncio.run(scenario())


def test_concurrent_async_boundaries_with_one_receipt_key(db_url: str) -> None:
    """Four tasks (four worker threads, four connections): exactly one boundary wins."""

    async def scenario() -> None:
        async with await AsyncStore.open(db_url) as astore:
            run_id = str(uuid.uuid4())
            states = [StoredInputState.new_accepted() for _ in range(4)]
            results = await asyncio.gather(
                *(astore.runtime.atomic_apply(RT, None, _receipt(run_id), [s]) for s in states),
                return_exceptions=True,
            )
            winners = [i for i, r in enumerate(results) if r is None]
            assert len(winners) == 1, results
            assert all(isinstance(r, WriteFailed) for r in results if r is not None)
            assert await astore.runtime.load_input_states(RT) == [states[winners[0]]]

    asyncio.run(scenario())


def test_async_session_snapshot_guard_errors_are_typed(db_url: str) -> None:
    async def scenario() -> None:
        async with await AsyncStore.open(db_url) as astore:
            before = await astore.runtime.load_session_snapshot(RT)
            with pytest.raises(WriteFailed):
                await astore.runtime.commit_session_snapshot(RT, b"{not json")
            assert await astore.runtime.load_session_snapshot(RT) == before is None
            summary = [Message(role="assistant", content="summary")]
            session = Session.new().with_message("user", "x")
            rewritten, commit = session.rewrite(0, 1, summary, actor="async-test")
            domain = astore.store.runtime_domain
            data = domain.encode_session(rewritten)
            with pytest.raises(WriteFailed, match="no previously persisted session"):
                await astore.runtime.commit_session_transcript_rewrite_snapshot(RT, data, commit)
            assert await astore.runtime.load_session_snapshot(RT) is None
            await astore.runtime.commit_session_snapshot(RT, domain.encode_session(session))
            await astore.runtime.commit_session_transcript_rewrite_snapshot(RT, data, commit)
            assert await astore.runtime.load_session_snapshot(RT) == data

    asyncio.run(scenario())


def test_cancelled_caller_ends_cancelled_even_when_the_operation_then_fails() -> None:
    release = threading.Event()

    def op() -> None:
        release.wait(5)
        raise RuntimeError("failed after the cancellation")

    async def main() -> None:
        task = asyncio.ensure_future(run_to_completion(op))
        await asyncio.sleep(0.05)
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=0.1)
        assert not done  # still waiting for the thread
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
