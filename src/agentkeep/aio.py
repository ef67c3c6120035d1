"""The async facade: :class:`AsyncStore`, ``astore.runtime`` and the other stores.

Described in docs/architecture.md#async-facade.

Every async method runs the synchronous one-call operation of the same name
on a worker thread (the repositories hold the only implementation of every
fence) and awaits it. **Cancellation never detaches a write**: if the
awaiting task is cancelled while the operation runs, the cancellation waits
until the thread has finished — committed completely or not at all — and
only then propagates. So a cancelled caller can never be followed by a write
that lands later (after, say, a same-runtime-id replacement). This matters
most for ``commit_unregister_finalization`` (the original store hardened
only that operation) and is applied uniformly, which is stricter and
harmless (docs/decisions.md#cancellation-waits-for-the-transaction).

Consequence for callers: ``asyncio.wait_for(op, timeout)`` returns only once
the operation's thread is done, even after the timeout fired. Use
``asyncio.wait({task}, timeout=...)`` to stop *waiting* without cancelling.

Usage::

    astore = await AsyncStore.open("sqlite:///agent.db", migrate=True)
    await astore.runtime.atomic_apply(runtime_id, snapshot, receipt, inputs, session_id)
    await astore.close()
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar

from sqlalchemy import Engine

from agentkeep.runs.facade import RunCalls
from agentkeep.runtime.facade import RuntimeCalls
from agentkeep.sessions.facade import (
    LeaseCalls,
    MaintenanceCalls,
    QueueCalls,
    SessionCalls,
    TurnInputCalls,
)
from agentkeep.store import Store

__all__ = [
    "AsyncLeaseCalls",
    "AsyncMaintenanceCalls",
    "AsyncQueueCalls",
    "AsyncRunCalls",
    "AsyncRuntimeCalls",
    "AsyncSessionCalls",
    "AsyncStore",
    "AsyncTurnInputCalls",
    "run_to_completion",
]

P = ParamSpec("P")
T = TypeVar("T")
S = TypeVar("S")


async def run_to_completion(fn: Callable[[], T]) -> T:
    """Run ``fn`` on a worker thread; a cancellation waits for it to finish, then propagates.

    Returns:
        ``fn()``'s result.

    Raises:
        asyncio.CancelledError: the caller was cancelled (raised after ``fn``
            finished, whatever its outcome).
        Exception: whatever ``fn`` raised, when the caller was not cancelled.
    """
    future = asyncio.get_running_loop().run_in_executor(None, fn)
    cancelled = False
    while not future.done():
        try:
            # wait() neither cancels the future nor raises its exception.
            await asyncio.wait({future})
        except asyncio.CancelledError:
            cancelled = True  # the thread's transaction is still running: keep waiting
    if cancelled:
        raise asyncio.CancelledError
    return future.result()


class _Async(Generic[S, P, T]):
    """A descriptor turning ``SyncCalls.method`` into an awaitable method of an async facade."""

    def __init__(self, method: Callable[Concatenate[S, P], T]) -> None:
        self._method = method
        functools.update_wrapper(self, method)  # type: ignore[arg-type]

    def __get__(
        self, instance: _AsyncCalls[Any] | None, owner: type[Any]
    ) -> Callable[P, Awaitable[T]]:
        if instance is None:
            raise AttributeError("async facade methods are bound to an instance")
        sync = instance._sync
        method = self._method

        async def call(*args: P.args, **kwargs: P.kwargs) -> T:
            return await run_to_completion(functools.partial(method, sync, *args, **kwargs))

        call.__doc__ = method.__doc__
        call.__name__ = getattr(method, "__name__", "call")
        return call


class _AsyncCalls(Generic[S]):
    __slots__ = ("_sync",)

    def __init__(self, sync: S) -> None:
        self._sync = sync


class AsyncRuntimeCalls(_AsyncCalls[RuntimeCalls]):
    """``astore.runtime``: the runtime store's operations as coroutines (see the module doc)."""

    __slots__ = ()

    auth_authority_key = _Async(RuntimeCalls.auth_authority_key)
    supports_compaction_projection_outbox = _Async(
        RuntimeCalls.supports_compaction_projection_outbox
    )
    # snapshots
    commit_session_snapshot = _Async(RuntimeCalls.commit_session_snapshot)
    commit_session_transcript_rewrite_snapshot = _Async(
        RuntimeCalls.commit_session_transcript_rewrite_snapshot
    )
    load_session_snapshot = _Async(RuntimeCalls.load_session_snapshot)
    clear_session_snapshot = _Async(RuntimeCalls.clear_session_snapshot)
    replace_session_snapshot_if_current = _Async(RuntimeCalls.replace_session_snapshot_if_current)
    clear_session_snapshot_if_current = _Async(RuntimeCalls.clear_session_snapshot_if_current)
    is_runtime_projection_quarantined = _Async(RuntimeCalls.is_runtime_projection_quarantined)
    # outbox
    load_pending_compaction_projections = _Async(RuntimeCalls.load_pending_compaction_projections)
    mark_compaction_projection_finalized = _Async(RuntimeCalls.mark_compaction_projection_finalized)
    # boundaries
    atomic_apply = _Async(RuntimeCalls.atomic_apply)
    atomic_apply_with_machine_lifecycle = _Async(RuntimeCalls.atomic_apply_with_machine_lifecycle)
    load_boundary_receipt = _Async(RuntimeCalls.load_boundary_receipt)
    # input states
    load_input_states = _Async(RuntimeCalls.load_input_states)
    load_input_state = _Async(RuntimeCalls.load_input_state)
    persist_input_state = _Async(RuntimeCalls.persist_input_state)
    persist_input_states_atomically = _Async(RuntimeCalls.persist_input_states_atomically)
    compare_and_swap_input_states_atomically = _Async(
        RuntimeCalls.compare_and_swap_input_states_atomically
    )
    # lifecycle, ops, finalization
    load_machine_lifecycle_record = _Async(RuntimeCalls.load_machine_lifecycle_record)
    load_machine_lifecycle = _Async(RuntimeCalls.load_machine_lifecycle)
    load_runtime_state = _Async(RuntimeCalls.load_runtime_state)
    commit_machine_lifecycle = _Async(RuntimeCalls.commit_machine_lifecycle)
    persist_ops_lifecycle = _Async(RuntimeCalls.persist_ops_lifecycle)
    initialize_ops_lifecycle_if_absent = _Async(RuntimeCalls.initialize_ops_lifecycle_if_absent)
    load_ops_lifecycle = _Async(RuntimeCalls.load_ops_lifecycle)
    delete_ops_lifecycle = _Async(RuntimeCalls.delete_ops_lifecycle)
    commit_unregister_finalization = _Async(RuntimeCalls.commit_unregister_finalization)
    # mob hosts
    load_mob_host_binding = _Async(RuntimeCalls.load_mob_host_binding)
    list_mob_host_bindings = _Async(RuntimeCalls.list_mob_host_bindings)
    put_mob_host_binding_if_absent = _Async(RuntimeCalls.put_mob_host_binding_if_absent)
    compare_and_put_mob_host_binding = _Async(RuntimeCalls.compare_and_put_mob_host_binding)
    delete_mob_host_binding = _Async(RuntimeCalls.delete_mob_host_binding)
    load_mob_host_revocation = _Async(RuntimeCalls.load_mob_host_revocation)
    list_mob_host_revocations = _Async(RuntimeCalls.list_mob_host_revocations)
    revoke_mob_host_binding = _Async(RuntimeCalls.revoke_mob_host_binding)


class AsyncRunCalls(_AsyncCalls[RunCalls]):
    """``astore.runs``: the run store's operations as coroutines."""

    __slots__ = ()

    create = _Async(RunCalls.create)
    get = _Async(RunCalls.get)
    list_by_task = _Async(RunCalls.list_by_task)
    list_running = _Async(RunCalls.list_running)
    list = _Async(RunCalls.list)
    append_step_entry = _Async(RunCalls.append_step_entry)
    append_degradation = _Async(RunCalls.append_degradation)
    update_status = _Async(RunCalls.update_status)
    try_transition = _Async(RunCalls.try_transition)
    acquire_assignee = _Async(RunCalls.acquire_assignee)
    vacate_assignee = _Async(RunCalls.vacate_assignee)
    set_result = _Async(RunCalls.set_result)
    set_input_json = _Async(RunCalls.set_input_json)
    delete = _Async(RunCalls.delete)

    @property
    def name(self) -> str:
        """``"sqlite"`` or ``"postgres"`` (no database access)."""
        return self._sync.name


class AsyncLeaseCalls(_AsyncCalls[LeaseCalls]):
    """``astore.leases``: session execution leases as coroutines."""

    __slots__ = ()

    try_claim_session_execution_lease = _Async(LeaseCalls.try_claim_session_execution_lease)
    reclaim_session_execution_lease = _Async(LeaseCalls.reclaim_session_execution_lease)
    renew_session_execution_lease = _Async(LeaseCalls.renew_session_execution_lease)
    release_session_execution_lease = _Async(LeaseCalls.release_session_execution_lease)
    ensure_session_execution_lease = _Async(LeaseCalls.ensure_session_execution_lease)
    get_session_execution_lease = _Async(LeaseCalls.get_session_execution_lease)


class AsyncQueueCalls(_AsyncCalls[QueueCalls]):
    """``astore.queue``: queued work of sessions as coroutines."""

    __slots__ = ()

    enqueue_queued_work = _Async(QueueCalls.enqueue_queued_work)
    claim_leading_ready_session_command = _Async(QueueCalls.claim_leading_ready_session_command)
    claim_ready_queued_work = _Async(QueueCalls.claim_ready_queued_work)
    claim_ready_queued_work_by_batch_ids = _Async(QueueCalls.claim_ready_queued_work_by_batch_ids)
    abandon_queued_work_claim = _Async(QueueCalls.abandon_queued_work_claim)
    complete_queued_work_claim = _Async(QueueCalls.complete_queued_work_claim)
    cancel_queued_work_batch = _Async(QueueCalls.cancel_queued_work_batch)
    list_queued_work = _Async(QueueCalls.list_queued_work)
    list_pending_queued_work = _Async(QueueCalls.list_pending_queued_work)


class AsyncTurnInputCalls(_AsyncCalls[TurnInputCalls]):
    """``astore.turn_inputs``: pending turn inputs as coroutines."""

    __slots__ = ()

    enqueue_pending_turn_input = _Async(TurnInputCalls.enqueue_pending_turn_input)
    list_pending_turn_inputs = _Async(TurnInputCalls.list_pending_turn_inputs)
    list_turn_inputs = _Async(TurnInputCalls.list_turn_inputs)
    cancel_pending_turn_inputs = _Async(TurnInputCalls.cancel_pending_turn_inputs)
    cancel_pending_turn_input_suffix = _Async(TurnInputCalls.cancel_pending_turn_input_suffix)
    claim_active_turn_inputs = _Async(TurnInputCalls.claim_active_turn_inputs)
    claim_next_turn_inputs = _Async(TurnInputCalls.claim_next_turn_inputs)
    abandon_turn_input_claim = _Async(TurnInputCalls.abandon_turn_input_claim)
    complete_turn_input_claim = _Async(TurnInputCalls.complete_turn_input_claim)
    recover_stale_turn_input_claims = _Async(TurnInputCalls.recover_stale_turn_input_claims)


class AsyncSessionCalls(_AsyncCalls[SessionCalls]):
    """``astore.commits``: session commits and reads as coroutines."""

    __slots__ = ()

    commit_runtime_state = _Async(SessionCalls.commit_runtime_state)
    load_session = _Async(SessionCalls.load_session)
    load_node = _Async(SessionCalls.load_node)
    get_head_revision = _Async(SessionCalls.get_head_revision)
    save_session_meta = _Async(SessionCalls.save_session_meta)
    load_session_meta = _Async(SessionCalls.load_session_meta)


class AsyncMaintenanceCalls(_AsyncCalls[MaintenanceCalls]):
    """``astore.maintenance``: tombstones, vacuum and blob GC as coroutines."""

    __slots__ = ()

    tombstone_nodes = _Async(MaintenanceCalls.tombstone_nodes)
    vacuum = _Async(MaintenanceCalls.vacuum)
    vacuum_all_sessions = _Async(MaintenanceCalls.vacuum_all_sessions)
    gc_unreachable = _Async(MaintenanceCalls.gc_unreachable)
    gc_unreachable_strict = _Async(MaintenanceCalls.gc_unreachable_strict)


class AsyncStore:
    """An asyncio handle on one agentkeep database (wraps a :class:`~agentkeep.Store`).

    Attributes:
        store: the synchronous store (its units of work).
        runtime: the runtime store's operations as coroutines.
        runs, leases, queue, turn_inputs, commits, maintenance: the other
            stores' one-call operations as coroutines.
    """

    __slots__ = (
        "leases",
        "maintenance",
        "queue",
        "runs",
        "runtime",
        "commits",
        "store",
        "turn_inputs",
    )

    def __init__(self, store: Store) -> None:
        self.store = store
        self.runtime = AsyncRuntimeCalls(store.runtime)
        self.runs = AsyncRunCalls(store.runs)
        self.leases = AsyncLeaseCalls(store.leases)
        self.queue = AsyncQueueCalls(store.queue)
        self.turn_inputs = AsyncTurnInputCalls(store.turn_inputs)
        self.commits = AsyncSessionCalls(store.commits)
        self.maintenance = AsyncMaintenanceCalls(store.maintenance)

    @classmethod
    async def open(cls, url: str | Engine = "sqlite:///agentkeep.db", **kwargs: Any) -> AsyncStore:
        """Open the database at ``url`` off the event loop (arguments as :meth:`Store.open`).

        ``url`` may be the host's own (synchronous) SQLAlchemy Engine, as for
        :meth:`Store.open`; an ``AsyncEngine`` is refused.
        """
        store = await asyncio.to_thread(functools.partial(Store.open, url, **kwargs))
        return cls(store)

    async def call_write(self, fn: Callable[[Any], T]) -> T:
        """Run ``fn(repositories)`` in one write unit on a worker thread (``Store.call_write``)."""
        return await run_to_completion(functools.partial(self.store.call_write, fn))

    async def call_read(self, fn: Callable[[Any], T]) -> T:
        """Run ``fn(repositories)`` in one read unit on a worker thread."""
        return await run_to_completion(functools.partial(self.store.call_read, fn))

    async def close(self) -> None:
        """Release every pooled connection."""
        await asyncio.to_thread(self.store.close)

    async def __aenter__(self) -> AsyncStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
