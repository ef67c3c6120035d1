"""The asyncio facade: :class:`AsyncStore`, its one-call operations and async units of work.

Described in docs/async.md.

There is one implementation of every fence: the synchronous repositories.
:class:`AsyncStore` runs them in one of two ways, chosen by what it is opened on:

* **Native** (``sqlite+aiosqlite``, ``postgresql+asyncpg``,
  ``postgresql+psycopg_async`` URLs, or a host's
  :class:`~sqlalchemy.ext.asyncio.AsyncEngine`): the repositories run on the
  event loop, through SQLAlchemy's greenlet bridge (the mechanism under
  ``AsyncConnection.run_sync``): each driver call inside them awaits the async
  driver. No worker thread of agentkeep's is involved. ``async with
  astore.write() as uow`` gives a unit of work whose repositories are awaited
  and whose ``uow.session`` is an :class:`~sqlalchemy.ext.asyncio.AsyncSession`
  in the same transaction.
* **Thread** (a synchronous URL or Engine, e.g. ``sqlite:///app.db``): each
  one-call operation runs the synchronous store's operation on a worker
  thread. Kept for applications whose engine is synchronous (shared with
  their sync code) and for SQLite without the ``aiosqlite`` extra: pysqlite
  on a thread is what aiosqlite does too (it runs sqlite3 on a thread of its
  own). Units of work (``write()``/``read()``) need the native mode.

Cancellation: **a cancelled operation is applied completely or not at all,
and the caller ends cancelled**:

* One-call operations (``astore.runs.try_transition(...)``): a cancellation
  that arrives before the operation sends its COMMIT interrupts it where it
  waits (a lock, a statement, a retry pause); its transaction is rolled back
  (on Postgres by closing the connection, never reused: a driver
  interrupted in a call may misjudge its transaction) and the caller gets
  ``CancelledError`` (none of it). A cancellation that arrives once COMMIT was sent waits for
  the COMMIT's answer and then propagates (all of it).
  ``runtime.commit_unregister_finalization`` is never interrupted: a
  cancelled caller waits for it to end, as in the original store. In the
  thread mode every operation runs to its end first (a thread cannot be
  interrupted). So a cancelled caller is never followed by a write that
  lands later. SQLite: an interrupted statement finishes on aiosqlite's
  thread before the rollback runs there, so a cancellation during a lock
  wait takes effect when the wait ends (the lock is freed or the busy
  timeout passes); nothing is written. (``sqlite3``'s
  ``Connection.interrupt()`` would not end it sooner: SQLite does not check
  for an interrupt while its busy handler waits.)
* Units of work: a cancellation inside the block rolls the whole unit back
  (closing its connection, as above). The commit at the end of the block
  is never interrupted. If a repository call inside the block was
  interrupted and the block then exits normally (it caught the
  ``CancelledError``), the unit is rolled back and ``CancelledError`` is
  raised: half an operation is never committed.

``asyncio.timeout(...)``, ``asyncio.wait_for`` and task groups work on top
of this: their cancellation is the caller's.

Usage::

    astore = await AsyncStore.open("postgresql+asyncpg://app@db/app", migrate=True)
    if await astore.runs.try_transition("R-1", RunStatus.PENDING, RunStatus.RUNNING):
        ...
    async with astore.write() as uow:
        await uow.runs.set_result("R-1", {"ok": True})
        uow.session.add(AuditRow(run_id="R-1"))     # the host's row, same transaction
    await astore.close()
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractContextManager, asynccontextmanager, nullcontext
from typing import TYPE_CHECKING, Any, Concatenate, Generic, ParamSpec, Protocol, TypeVar

from sqlalchemy import Connection, Engine
from sqlalchemy.engine import URL, make_url
from sqlalchemy.orm import Session

from agentkeep import db, observability
from agentkeep.clock import Clock
from agentkeep.crypto import PayloadCodec
from agentkeep.errors import InvalidInput
from agentkeep.limits import Limits
from agentkeep.runs.facade import RunCalls
from agentkeep.runtime.domain import RuntimeDomain
from agentkeep.runtime.facade import RuntimeCalls
from agentkeep.sessions.facade import (
    CatalogCalls,
    CheckpointNodeCalls,
    LeaseCalls,
    MaintenanceCalls,
    QueueCalls,
    SessionCalls,
    TurnInputCalls,
)
from agentkeep.store import Store, _check_open_options, _refuse_memory_schema
from agentkeep.unit_of_work import UnitOfWork

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession

__all__ = [
    "AsyncLeaseCalls",
    "AsyncCatalogCalls",
    "AsyncCheckpointNodeCalls",
    "AsyncMaintenanceCalls",
    "AsyncQueueCalls",
    "AsyncRepository",
    "AsyncRunCalls",
    "AsyncRuntimeCalls",
    "AsyncSessionCalls",
    "AsyncStore",
    "AsyncTurnInputCalls",
    "AsyncUnitOfWork",
    "run_to_completion",
]

P = ParamSpec("P")
T = TypeVar("T")
S = TypeVar("S")


class Runner(Protocol):
    """How a facade runs a synchronous operation: on a thread, or on the loop."""

    def __call__(self, fn: Callable[[], T], *, shield: bool = False) -> Awaitable[T]: ...


# --------------------------------------------------------------------------
# Running synchronous code: on a thread, or on the loop through the greenlet bridge


async def run_to_completion(fn: Callable[[], T], *, shield: bool = True) -> T:
    """Run ``fn`` on a worker thread; a cancellation waits for it to finish, then propagates.

    The thread mode's runner (a thread cannot be interrupted: ``shield`` is
    always in effect).

    Returns:
        ``fn()``'s result.

    Raises:
        asyncio.CancelledError: the caller was cancelled (raised after ``fn``
            finished, whatever its outcome).
        Exception: whatever ``fn`` raised, when the caller was not cancelled.
    """
    # The caller's context goes with it (the current span, the running operation).
    context = contextvars.copy_context()
    future = asyncio.get_running_loop().run_in_executor(None, context.run, fn)
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


def _greenlet_spawn() -> Callable[..., Awaitable[Any]]:
    from sqlalchemy.util.concurrency import greenlet_spawn

    return greenlet_spawn


async def run_on_loop(fn: Callable[[], T], *, shield: bool = False) -> T:
    """Run the synchronous ``fn`` on the event loop through SQLAlchemy's greenlet bridge.

    The native mode's runner: ``fn``'s driver calls await the async driver.
    A cancellation before ``fn`` starts its COMMIT (:class:`agentkeep.db.CommitWatch`)
    interrupts it at the driver call it waits in (``fn`` rolls back); after,
    it waits for ``fn`` to finish. Either way it then propagates. With
    ``shield``, a cancellation never interrupts ``fn``: it waits for ``fn``
    to finish, whatever it waits for.

    Raises:
        asyncio.CancelledError: the caller was cancelled (raised after ``fn``
            ended, applied completely or not at all).
        Exception: whatever ``fn`` raised, when the caller was not cancelled.
    """
    watch = db.CommitWatch()

    def watched() -> T:
        with db.watch_commit(watch):
            return fn()

    task: asyncio.Future[T] = asyncio.ensure_future(_greenlet_spawn()(watched))
    return await _outlast(task, None if shield else watch)


async def _outlast(task: asyncio.Future[T], watch: db.CommitWatch | None) -> T:
    """Await ``task``; on cancellation interrupt it unless it is committing, then wait for it.

    With ``watch`` None the task is never interrupted (it is a commit or a
    cleanup that must finish).
    """
    cancelled = False
    while not task.done():
        try:
            await asyncio.wait({task})
        except asyncio.CancelledError:
            cancelled = True
            if watch is not None and not watch.committing:
                task.cancel()
    if cancelled:
        if not task.cancelled():
            task.exception()  # retrieved: the caller's cancellation is what it reports
        raise asyncio.CancelledError
    return task.result()


# --------------------------------------------------------------------------
# The one-call facades


class _Async(Generic[S, P, T]):
    """A descriptor turning ``SyncCalls.method`` into an awaitable method of an async facade."""

    def __init__(self, method: Callable[Concatenate[S, P], T], *, shield: bool = False) -> None:
        self._method = method
        self._shield = shield
        functools.update_wrapper(self, method)  # type: ignore[arg-type]

    def __get__(
        self, instance: _AsyncCalls[Any] | None, owner: type[Any]
    ) -> Callable[P, Awaitable[T]]:
        if instance is None:
            raise AttributeError("async facade methods are bound to an instance")
        sync = instance._sync
        run = instance._run
        method = self._method
        shield = self._shield

        if not observability.INSTALLED:

            async def call(*args: P.args, **kwargs: P.kwargs) -> T:
                return await run(functools.partial(method, sync, *args, **kwargs), shield=shield)

        else:
            # One public operation, measured here on the caller's context (the
            # synchronous layer it runs sees it and records nothing itself).
            operation = _operation_name(method)

            async def call(*args: P.args, **kwargs: P.kwargs) -> T:
                with observability.operation(operation):
                    return await run(
                        functools.partial(method, sync, *args, **kwargs), shield=shield
                    )

        call.__doc__ = method.__doc__
        call.__name__ = getattr(method, "__name__", "call")
        return call


def _operation_name(method: Any) -> str:
    """The operation name of a synchronous facade method (a forwarder or a traced method)."""
    return str(
        getattr(method, "_operation", None)
        or getattr(method, "__agentkeep_operation__", None)
        or getattr(method, "__name__", "operation")
    )


class _AsyncCalls(Generic[S]):
    __slots__ = ("_run", "_sync")

    def __init__(self, sync: S, run: Runner = run_to_completion) -> None:
        self._sync = sync
        self._run = run


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
    # Never interrupted: a cancelled caller waits for it (test #30 of the runtime store).
    commit_unregister_finalization = _Async(
        RuntimeCalls.commit_unregister_finalization, shield=True
    )
    # mob hosts
    load_mob_host_binding = _Async(RuntimeCalls.load_mob_host_binding)
    list_mob_host_bindings = _Async(RuntimeCalls.list_mob_host_bindings)
    put_mob_host_binding_if_absent = _Async(RuntimeCalls.put_mob_host_binding_if_absent)
    compare_and_put_mob_host_binding = _Async(RuntimeCalls.compare_and_put_mob_host_binding)
    delete_mob_host_binding = _Async(RuntimeCalls.delete_mob_host_binding)
    load_mob_host_revocation = _Async(RuntimeCalls.load_mob_host_revocation)
    list_mob_host_revocations = _Async(RuntimeCalls.list_mob_host_revocations)
    revoke_mob_host_binding = _Async(RuntimeCalls.revoke_mob_host_binding)
    # OAuth flow state (synchronous only in the original store; here as
    # coroutines too, since a native store has no synchronous path). The
    # callback of update_auth_oauth_flow_snapshot is synchronous.
    load_auth_oauth_flow_snapshot = _Async(RuntimeCalls.load_auth_oauth_flow_snapshot)
    persist_auth_oauth_flow_snapshot = _Async(RuntimeCalls.persist_auth_oauth_flow_snapshot)
    update_auth_oauth_flow_snapshot = _Async(RuntimeCalls.update_auth_oauth_flow_snapshot)
    reencrypt_auth_oauth_flow_snapshot = _Async(RuntimeCalls.reencrypt_auth_oauth_flow_snapshot)


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


class AsyncCatalogCalls(_AsyncCalls[CatalogCalls]):
    """``astore.catalog``: enumerate sessions and delete a session as coroutines."""

    __slots__ = ()

    list_sessions = _Async(CatalogCalls.list_sessions)
    delete_session = _Async(CatalogCalls.delete_session)


class AsyncCheckpointNodeCalls(_AsyncCalls[CheckpointNodeCalls]):
    """``astore.checkpoint_nodes``: checkpoint nodes and pending writes as coroutines."""

    __slots__ = ()

    put_checkpoint_node = _Async(CheckpointNodeCalls.put_checkpoint_node)
    put_pending_writes = _Async(CheckpointNodeCalls.put_pending_writes)
    delete_nodes_for_runs = _Async(CheckpointNodeCalls.delete_nodes_for_runs)
    prune_checkpoint_nodes = _Async(CheckpointNodeCalls.prune_checkpoint_nodes)
    copy_checkpoint_nodes = _Async(CheckpointNodeCalls.copy_checkpoint_nodes)
    get_checkpoint_node = _Async(CheckpointNodeCalls.get_checkpoint_node)
    list_checkpoint_nodes = _Async(CheckpointNodeCalls.list_checkpoint_nodes)
    list_pending_writes = _Async(CheckpointNodeCalls.list_pending_writes)


class AsyncMaintenanceCalls(_AsyncCalls[MaintenanceCalls]):
    """``astore.maintenance``: tombstones, vacuum and blob GC as coroutines."""

    __slots__ = ()

    tombstone_nodes = _Async(MaintenanceCalls.tombstone_nodes)
    vacuum = _Async(MaintenanceCalls.vacuum)
    vacuum_all_sessions = _Async(MaintenanceCalls.vacuum_all_sessions)
    gc_unreachable = _Async(MaintenanceCalls.gc_unreachable)
    gc_unreachable_strict = _Async(MaintenanceCalls.gc_unreachable_strict)


# --------------------------------------------------------------------------
# Async units of work


class AsyncRepository:
    """A unit of work's repository whose methods are awaited (``await uow.runs.get(...)``).

    Every method is the synchronous repository's method of the same name,
    with the same arguments, results and errors (see the repository's
    docstring: :class:`~agentkeep.runs.repository.RunRepository`,
    :class:`~agentkeep.sessions.leases.SessionLeaseRepository`, ...), run on
    the unit's connection through the greenlet bridge. Calls of one unit run
    one at a time, in the order they were awaited.
    """

    __slots__ = ("_repo", "_unit")

    def __init__(self, repo: Any, unit: AsyncUnitOfWork) -> None:
        self._repo = repo
        self._unit = unit

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._repo, name)
        if not callable(attr):
            if attr is None or isinstance(attr, (str, int, float, bool, bytes)):
                return attr
            return AsyncRepository(attr, self._unit)
        unit = self._unit

        async def call(*args: Any, **kwargs: Any) -> Any:
            return await unit._call(functools.partial(attr, *args, **kwargs))

        call.__doc__ = attr.__doc__
        call.__name__ = name
        return call

    def __dir__(self) -> list[str]:
        return [n for n in dir(self._repo) if not n.startswith("_")]

    def __repr__(self) -> str:
        return f"<AsyncRepository of {type(self._repo).__name__}>"


class AsyncUnitOfWork:
    """The unit of work of ``async with astore.write()`` / ``astore.read()``.

    The same repositories as the synchronous :class:`~agentkeep.UnitOfWork`,
    awaited; one transaction, committed when the block exits normally and
    rolled back when it raises (or was cancelled).

    Attributes:
        runs, leases, queue, turn_inputs, commits, maintenance, catalog,
        checkpoint_nodes, runtime: the repositories (:class:`AsyncRepository`).
        writable: False in a read unit (write operations raise
            :class:`~agentkeep.errors.ReadOnlyUnitOfWork`).
    """

    def __init__(self, uow: UnitOfWork, host_session: AsyncSession | None) -> None:
        self._uow = uow
        self._host_session = host_session
        self._session: AsyncSession | None = host_session
        self._lock = asyncio.Lock()
        self._interrupted = False
        self.writable = uow.writable
        self.runs = AsyncRepository(uow.runs, self)
        self.leases = AsyncRepository(uow.leases, self)
        self.queue = AsyncRepository(uow.queue, self)
        self.turn_inputs = AsyncRepository(uow.turn_inputs, self)
        self.commits = AsyncRepository(uow.commits, self)
        self.maintenance = AsyncRepository(uow.maintenance, self)
        self.catalog = AsyncRepository(uow.catalog, self)
        self.checkpoint_nodes = AsyncRepository(uow.checkpoint_nodes, self)
        self.runtime = AsyncRepository(uow.runtime, self)

    @property
    def session(self) -> AsyncSession:
        """An :class:`~sqlalchemy.ext.asyncio.AsyncSession` in this unit's transaction.

        Created on first use, like the synchronous ``uow.session``: the host
        adds its own ORM rows through it and they commit or roll back with
        agentkeep's writes (``await session.commit()`` inside the block only
        flushes; a rollback of it rolls the unit back). In a unit joined to
        the host's AsyncSession it is that AsyncSession.
        """
        if self._session is None:
            from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession

            conn = self._uow.connection
            bind = AsyncConnection(AsyncEngine(conn.engine), conn)
            self._session = AsyncSession(
                bind=bind, join_transaction_mode="rollback_only", expire_on_commit=False
            )
            self._uow._session = self._session.sync_session  # flushed and closed by the unit
        return self._session

    @property
    def connection(self) -> AsyncConnection:
        """The unit's connection as an :class:`~sqlalchemy.ext.asyncio.AsyncConnection`."""
        from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

        conn = self._uow.connection
        return AsyncConnection(AsyncEngine(conn.engine), conn)

    async def _call(self, fn: Callable[[], T]) -> T:
        async with self._lock:
            try:
                result: T = await _greenlet_spawn()(fn)
                return result
            except BaseException as exc:
                if not isinstance(exc, Exception):  # cancelled between two statements
                    self._interrupted = True
                raise


# --------------------------------------------------------------------------
# The store


#: One native open at a time per event loop: adopting an engine holds a thread
#: lock across driver calls, which two tasks of one loop must not interleave.
_OPENING: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock] = (
    weakref.WeakKeyDictionary()
)


def _opening_lock() -> asyncio.Lock:
    loop = asyncio.get_running_loop()
    lock = _OPENING.get(loop)
    if lock is None:
        lock = _OPENING[loop] = asyncio.Lock()
    return lock


def _is_async_engine(url: object) -> bool:
    try:
        from sqlalchemy.ext.asyncio import AsyncEngine
    except ImportError:  # pragma: no cover - sqlalchemy always ships it
        return False
    return isinstance(url, AsyncEngine)


def _async_url(url: object) -> str | None:
    """The URL string when ``url`` names an asyncio driver, else None."""
    if not isinstance(url, (str, URL)):
        return None
    text = url.render_as_string(hide_password=False) if isinstance(url, URL) else url
    try:
        driver = make_url(text).get_driver_name()
    except Exception:  # noqa: BLE001 - the sync path reports a bad URL
        return None
    return text if driver in db.ASYNC_DRIVERS else None


async def _await_sleep_in_greenlet(seconds: float) -> None:
    await asyncio.sleep(seconds)


def _sleep_on_loop(seconds: float) -> None:
    """A retry pause inside the greenlet bridge: yields to the event loop."""
    from sqlalchemy.util.concurrency import await_only

    await_only(_await_sleep_in_greenlet(seconds))


class AsyncStore:
    """An asyncio handle on one agentkeep database.

    Open it with :meth:`open`. Native on an asyncio driver or AsyncEngine,
    thread-backed on a synchronous URL or Engine (see the module doc).

    Attributes:
        store: the synchronous :class:`~agentkeep.Store` whose repositories the
            operations run (native: on the AsyncEngine's ``sync_engine``; call
            it only through this facade, its driver calls need the bridge).
        engine: the :class:`~sqlalchemy.ext.asyncio.AsyncEngine` (native) or
            the synchronous Engine (thread mode).
        native: True when the operations run on the event loop.
        runtime: the runtime store's operations as coroutines.
        runs, leases, queue, turn_inputs, commits, maintenance, catalog,
            checkpoint_nodes: the other stores' one-call operations as coroutines.
    """

    __slots__ = (
        "_owns_engine",
        "_run",
        "_serial",
        "catalog",
        "checkpoint_nodes",
        "commits",
        "engine",
        "leases",
        "maintenance",
        "native",
        "queue",
        "runs",
        "runtime",
        "store",
        "turn_inputs",
    )

    def __init__(self, store: Store, *, async_engine: AsyncEngine | None = None) -> None:
        """Wrap ``store``: thread mode, or native on ``async_engine`` (``store`` runs on its
        sync_engine).

        Most code wants :meth:`open`.
        """
        self.store = store
        self.native = async_engine is not None
        self.engine: Any = async_engine if async_engine is not None else store.engine
        self._owns_engine = False
        self._serial: asyncio.Lock | None = None
        if async_engine is not None:
            store._sleep = _sleep_on_loop
            # Units of one loop interleave on it: a thread lock held by one
            # would block the loop for the others (they wait in the database).
            store._writers = None
            if store.memory:
                # One shared connection: units of one loop take turns (an
                # asyncio lock; the sync store's thread lock cannot tell tasks apart).
                store._mutex = nullcontext
                self._serial = asyncio.Lock()
            run: Runner = self._run_native
        else:
            run = run_to_completion
        self._run = run
        self.runtime = AsyncRuntimeCalls(store.runtime, run)
        self.runs = AsyncRunCalls(store.runs, run)
        self.leases = AsyncLeaseCalls(store.leases, run)
        self.queue = AsyncQueueCalls(store.queue, run)
        self.turn_inputs = AsyncTurnInputCalls(store.turn_inputs, run)
        self.commits = AsyncSessionCalls(store.commits, run)
        self.maintenance = AsyncMaintenanceCalls(store.maintenance, run)
        self.catalog = AsyncCatalogCalls(store.catalog, run)
        self.checkpoint_nodes = AsyncCheckpointNodeCalls(store.checkpoint_nodes, run)

    @classmethod
    async def open(
        cls,
        url: str | URL | AsyncEngine | Engine = "sqlite:///agentkeep.db",
        *,
        migrate: bool = False,
        clock: Clock | None = None,
        busy_timeout_ms: int | None = None,
        synchronous: str | None = None,
        retry_attempts: int = 5,
        auto_gc_every_commits: int | None = None,
        runtime_domain: RuntimeDomain[Any] | None = None,
        schema: str | None = None,
        oauth_codec: PayloadCodec | None = None,
        limits: Limits | None = None,
        **engine_kwargs: Any,
    ) -> AsyncStore:
        """Open the database at ``url``, or the database of the host's engine.

        Native (the operations run on the event loop) for:

        * ``sqlite+aiosqlite:///path.db`` (extra ``agentkeep[aiosqlite]``),
          ``postgresql+asyncpg://…`` (extra ``agentkeep[asyncpg]``) and
          ``postgresql+psycopg_async://…`` (extra ``agentkeep[postgres]``):
          agentkeep builds and owns the AsyncEngine
          (:func:`agentkeep.db.create_async_engine`), and :meth:`close`
          disposes it;
        * the host's :class:`~sqlalchemy.ext.asyncio.AsyncEngine` on one of
          those drivers: adopted like a synchronous engine by
          :meth:`Store.open <agentkeep.Store.open>` (its ``sync_engine`` gets
          the same hooks and checks), never disposed.

        Thread mode for a synchronous URL (``sqlite:///…``,
        ``postgresql+psycopg://…``) or Engine: :meth:`Store.open
        <agentkeep.Store.open>` on a worker thread.

        The arguments are :meth:`Store.open <agentkeep.Store.open>`'s, with the
        same meaning and checks (``limits``: the same
        :class:`~agentkeep.limits.Limits`, applied by the same driver check).

        Raises:
            InvalidInput: a refused argument or engine; nothing was changed.
            SchemaBehind, SchemaNewer, LegacySchemaMismatch: as :meth:`Store.open`.
            DatabaseUnavailable, StoreBusy, DatabaseError: opening failed, as
                for :meth:`Store.open`.
        """
        options: dict[str, Any] = {
            "migrate": migrate,
            "clock": clock,
            "retry_attempts": retry_attempts,
            "auto_gc_every_commits": auto_gc_every_commits,
            "runtime_domain": runtime_domain,
            "schema": schema,
            "oauth_codec": oauth_codec,
            "limits": limits,
        }
        text = _async_url(url)
        if text is None and not _is_async_engine(url):
            store = await asyncio.to_thread(
                functools.partial(
                    Store.open,
                    url,  # type: ignore[arg-type]
                    busy_timeout_ms=busy_timeout_ms,
                    synchronous=synchronous,
                    **options,
                    **engine_kwargs,
                )
            )
            return cls(store)
        _check_open_options(retry_attempts, auto_gc_every_commits, schema, oauth_codec, limits)
        async_engine: AsyncEngine
        if text is not None:
            _refuse_memory_schema(schema, text)
            async_engine = db.create_async_engine(
                text,
                busy_timeout_ms=(
                    db.DEFAULT_BUSY_TIMEOUT_MS if busy_timeout_ms is None else busy_timeout_ms
                ),
                synchronous="NORMAL" if synchronous is None else synchronous,
                **engine_kwargs,
            )
            owned = True
        else:
            if engine_kwargs:
                raise InvalidInput(
                    "engine_kwargs",
                    f"{sorted(engine_kwargs)} apply to an engine agentkeep creates: "
                    "pass them to your own create_async_engine call",
                )
            async_engine = url  # type: ignore[assignment]
            owned = False
        spawn = _greenlet_spawn()
        async with _opening_lock():
            try:
                if not owned:
                    with db.opening(async_engine.sync_engine):
                        await spawn(
                            db.adopt_engine,
                            async_engine.sync_engine,
                            busy_timeout_ms=busy_timeout_ms,
                            synchronous=synchronous,
                        )
                store = await spawn(
                    functools.partial(
                        Store._on_engine, async_engine.sync_engine, owned=False, **options
                    )
                )
            except BaseException:
                if owned:
                    await async_engine.dispose()
                raise
        astore = cls(store, async_engine=async_engine)
        astore._owns_engine = owned
        return astore

    # ------------------------------------------------------------------ running

    async def _run_native(self, fn: Callable[[], T], *, shield: bool = False) -> T:
        if self._serial is None:
            return await run_on_loop(fn, shield=shield)
        async with self._serial:
            return await run_on_loop(fn, shield=shield)

    async def call_write(self, fn: Callable[[Any], T]) -> T:
        """Run ``fn(repositories)`` in one write unit, retried (``Store.call_write``).

        ``fn`` is synchronous code using the synchronous repositories; it runs
        on the event loop (native) or a worker thread (thread mode).
        """
        return await self._run(functools.partial(self.store.call_write, fn))

    async def call_read(self, fn: Callable[[Any], T]) -> T:
        """Run ``fn(repositories)`` in one read unit (one snapshot), retried."""
        return await self._run(functools.partial(self.store.call_read, fn))

    # ------------------------------------------------------------------ units of work

    @asynccontextmanager
    async def write(
        self, *, join: AsyncSession | AsyncConnection | None = None
    ) -> AsyncIterator[AsyncUnitOfWork]:
        """A write unit of work: ``async with astore.write() as uow:`` (native mode).

        The unit of :meth:`Store.write <agentkeep.Store.write>` (``BEGIN
        IMMEDIATE`` on SQLite, READ COMMITTED and per-aggregate advisory
        locks on Postgres) with awaited repositories and ``uow.session``, an
        AsyncSession in the same transaction. Commits when the block exits
        normally, rolls back when it raises or is cancelled.

        With ``join``, the unit runs inside the transaction the host's
        :class:`~sqlalchemy.ext.asyncio.AsyncSession` or
        :class:`~sqlalchemy.ext.asyncio.AsyncConnection` holds, on this
        store's engine, exactly as ``Store.write(join=...)`` does with a
        synchronous Session or Connection: it never commits, its block runs
        in a SAVEPOINT, and ``uow.session`` is the host's AsyncSession.

        Raises:
            InvalidInput: thread mode (open the store on an asyncio driver),
                or a refused ``join`` (see ``Store.write``).
            StoreBusy, JoinedTransactionStale, DatabaseError: as ``Store.write``.
        """
        async with self._unit(writable=True, join=join) as uow:
            yield uow

    @asynccontextmanager
    async def read(
        self, *, join: AsyncSession | AsyncConnection | None = None
    ) -> AsyncIterator[AsyncUnitOfWork]:
        """A read unit of work (one consistent snapshot; writes refused), native mode.

        See :meth:`write` and :meth:`Store.read <agentkeep.Store.read>`.

        Raises:
            InvalidInput: thread mode, or a refused ``join``.
            DatabaseError: a driver failure.
        """
        async with self._unit(writable=False, join=join) as uow:
            yield uow

    @asynccontextmanager
    async def _unit(self, *, writable: bool, join: Any) -> AsyncIterator[AsyncUnitOfWork]:
        if not self.native:
            raise InvalidInput(
                "url",
                "async units of work (with an AsyncSession) need an asyncio driver: open the "
                "store on sqlite+aiosqlite, postgresql+asyncpg, postgresql+psycopg_async or an "
                "AsyncEngine; this store runs on a synchronous engine (one-call operations "
                "and call_write/call_read work)",
            )
        host_session, sync_join = _sync_join(join)
        store = self.store
        cm: AbstractContextManager[UnitOfWork]
        if sync_join is None:
            engine = store._write_engine if writable else store._read_engine
            cm = store._unit(engine, writable=writable)
        else:
            cm = store._joined(sync_join, writable=writable)
        spawn = _greenlet_spawn()
        serial = self._serial
        if serial is not None:
            await serial.acquire()

        async def leave(exc: BaseException | None) -> None:
            # Leave the unit (commit when exc is None, else roll back); never interrupted:
            # a cancellation waits for the outcome.
            exit_args = (None, None, None) if exc is None else (type(exc), exc, exc.__traceback__)
            await _outlast(asyncio.ensure_future(spawn(cm.__exit__, *exit_args)), None)

        try:
            # Entering: a cancellation interrupts it (the unit cleans up after itself).
            enter = asyncio.ensure_future(spawn(cm.__enter__))
            try:
                uow = await _outlast(enter, db.CommitWatch())
            except asyncio.CancelledError as cancelled:
                if not enter.cancelled() and enter.exception() is None:
                    # Cancelled just as the unit was entered: leave it again (roll back).
                    await leave(cancelled)
                raise
            unit = AsyncUnitOfWork(uow, host_session)
            try:
                yield unit
            except BaseException as exc:
                # The block raised (or was cancelled): roll back, never interrupted.
                await leave(exc)
                raise
            if unit._interrupted:
                interrupted = asyncio.CancelledError()
                await leave(interrupted)
                raise interrupted
            # Committing: never interrupted; a cancellation waits for the outcome.
            await leave(None)
        finally:
            if serial is not None:
                serial.release()

    # ------------------------------------------------------------------ lifetime

    async def close(self) -> None:
        """Release every pooled connection of an engine the store created.

        A host's engine (AsyncEngine or Engine) is left as it is.
        """
        if self.native:
            if self._owns_engine:
                await self.engine.dispose()
        else:
            await asyncio.to_thread(self.store.close)

    async def __aenter__(self) -> AsyncStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def _sync_join(join: Any) -> tuple[AsyncSession | None, Session | Connection | None]:
    """The host's AsyncSession (or None) and the synchronous object a joined unit runs on."""
    if join is None:
        return None, None
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession, async_scoped_session

    if isinstance(join, async_scoped_session):
        join = join()
    if isinstance(join, AsyncSession):
        return join, join.sync_session
    if isinstance(join, AsyncConnection):
        if join.sync_connection is None:
            raise InvalidInput(
                "join", "the AsyncConnection is not started (await it or use it in async with)"
            )
        return None, join.sync_connection
    raise InvalidInput(
        "join",
        f"expected a sqlalchemy AsyncSession or AsyncConnection, not {type(join).__name__}",
    )
