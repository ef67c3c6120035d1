"""A LangGraph checkpointer on agentkeep: :class:`AgentkeepSaver` (docs/langgraph.md).

Install with the extra ``agentkeep[langgraph]``. The saver works on a
:class:`~agentkeep.Store` and on an :class:`~agentkeep.AsyncStore` (native on
the event loop, or thread mode), on SQLite and Postgres, with LangGraph's sync
and async entry points.

Mapping (docs/langgraph.md#how-threads-are-stored):

* a thread and checkpoint namespace is a **session**, id
  ``<prefix>/<thread>/<ns>`` with both parts percent-encoded (so the ids of
  one thread share the prefix ``<prefix>/<thread>/`` and no thread's prefix
  is another's);
* a checkpoint is a **checkpoint node** of that session's graph
  (:mod:`agentkeep.sessions.checkpoint_nodes`): node id = checkpoint id,
  parent = the parent checkpoint, the serializer's bytes in a
  content-addressed blob, the serializer's type tag and the metadata (JSON,
  as LangGraph's own SQL savers keep it) in ``node_json``, ``run_id`` from the
  metadata;
* pending writes are the node's pending writes, stored once per
  ``(task_id, idx)`` (LangGraph's special channels, with negative indexes,
  replace), each value as the serializer's bytes.

Ownership (docs/langgraph.md#owning-a-thread): ``with saver.owning(thread_id):``
(``async with saver.aowning(...)``) takes the execution lease of the thread's
root session (namespace ``""``) for the block. While it is held, a put or
put_writes on any namespace of the thread by anyone else fails with
:class:`~agentkeep.errors.SessionLeaseHeld`; the owner's own writes are fenced
on its lease (:class:`~agentkeep.errors.SessionExecutionLeaseExpired` once it
lost it) and renew it when half of the TTL is gone. A crashed owner's lease
expires after the TTL and can then be taken. Without ``owning`` the saver
behaves as LangGraph's stock savers do.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import json
import random
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from typing import Any, TypeVar
from urllib.parse import quote, unquote

from agentkeep.aio import AsyncStore, run_to_completion
from agentkeep.errors import (
    CommitOutcomeUnknown,
    InvalidInput,
    MissingDependency,
    SessionCorrupt,
    SessionExecutionLeaseExpired,
    SessionLeaseHeld,
)
from agentkeep.one_call import leaves_unknown, still_unknown
from agentkeep.sessions.checkpoint_nodes import LEASE_REFUSALS, CheckpointNode, PendingWrite
from agentkeep.sessions.domain import Busy, LeaseOwnerIdentity, SessionExecutionLease
from agentkeep.store import Store
from agentkeep.unit_of_work import Repositories

try:
    from langchain_core.runnables import RunnableConfig
    from langgraph.checkpoint.base import (
        WRITES_IDX_MAP,
        BaseCheckpointSaver,
        ChannelVersions,
        Checkpoint,
        CheckpointMetadata,
        CheckpointTuple,
        get_checkpoint_id,
        get_checkpoint_metadata,
    )
    from langgraph.checkpoint.serde.base import SerializerProtocol
except ImportError as exc:  # pragma: no cover - exercised without the extra only
    raise MissingDependency(
        "agentkeep.integrations.langgraph", "langgraph-checkpoint", "langgraph"
    ) from exc

__all__ = ["DEFAULT_LEASE_TTL_MS", "AgentkeepSaver"]

T = TypeVar("T")

#: The lease TTL of :meth:`AgentkeepSaver.owning` unless given.
DEFAULT_LEASE_TTL_MS = 60_000
#: Sessions listed per catalog page while enumerating a thread's namespaces.
_PAGE = 1000
#: Encoded session ids a saver keeps (then it starts over).
_IDS_KEPT = 4096
#: ``json.dumps(value, ensure_ascii=False)`` without building an encoder per call
#: (``json.dumps`` makes one for every call with a non-default option; the encoder
#: keeps no state between calls).
_JSON_TEXT = json.JSONEncoder(ensure_ascii=False).encode


def _part(value: object) -> str:
    return quote(str(value), safe="")


class AgentkeepSaver(BaseCheckpointSaver[str]):
    """LangGraph checkpointer storing threads as agentkeep sessions (module docstring).

    Args:
        store: a :class:`~agentkeep.Store` or an :class:`~agentkeep.AsyncStore`
            (migrated: ``open(..., migrate=True)`` or ``agentkeep upgrade``).
        serde: LangGraph's serializer (default: LangGraph's ``JsonPlusSerializer``).
        session_prefix: the first part of every session id the saver uses.
        owner_id: the owner id this saver's leases carry (default: a random
            id per saver). Every ``owning`` block takes a fresh incarnation,
            so two blocks never share a lease.
        lease_ttl_ms: the lease TTL of ``owning``; an owner renews it on
            every put once half of it is gone, so set it above the longest
            step of a run.

    The sync methods on a native :class:`~agentkeep.AsyncStore` run on its
    event loop and must be called from another thread (as LangGraph's async
    savers require).
    """

    def __init__(
        self,
        store: Store | AsyncStore,
        *,
        serde: SerializerProtocol | None = None,
        session_prefix: str = "langgraph",
        owner_id: str | None = None,
        lease_ttl_ms: int = DEFAULT_LEASE_TTL_MS,
    ) -> None:
        super().__init__(serde=serde)
        if not isinstance(store, Store | AsyncStore):
            raise InvalidInput("store", "expected an agentkeep Store or AsyncStore")
        if not isinstance(session_prefix, str) or not session_prefix or "/" in session_prefix:
            raise InvalidInput("session_prefix", "expected a non-empty string without '/'")
        if type(lease_ttl_ms) is not int or lease_ttl_ms < 1:
            raise InvalidInput("lease_ttl_ms", "expected an int >= 1")
        self.astore: AsyncStore | None = store if isinstance(store, AsyncStore) else None
        self.store: Store = store.store if isinstance(store, AsyncStore) else store
        self.session_prefix = session_prefix
        self.owner_id = owner_id or f"agentkeep-saver-{uuid.uuid4().hex}"
        self.lease_ttl_ms = lease_ttl_ms
        #: A sync Store on pysqlite: unfenced put_writes run in autocommit (_one_call).
        engine = self.store.engine
        self._sqlite = self.astore is None and engine.dialect.driver == "pysqlite"
        #: Session ids already encoded, by (thread, namespace): the namespace's and the
        #: thread's root session's (the one whose lease guards the put), as every put
        #: and put_writes names both.
        self._ids: dict[tuple[str, str], tuple[str, str]] = {}
        self._owned: contextvars.ContextVar[dict[str, SessionExecutionLease] | None] = (
            contextvars.ContextVar(f"agentkeep_saver_{id(self)}", default=None)
        )
        try:
            self.loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self.loop = None

    # ------------------------------------------------------------------ ids

    def session_id(self, thread_id: object, checkpoint_ns: str = "") -> str:
        """The session id of a thread's namespace."""
        return self._sids(thread_id, checkpoint_ns)[0]

    def _sids(self, thread_id: object, checkpoint_ns: object) -> tuple[str, str]:
        """The session ids of a thread's namespace and of the thread's root namespace
        (``""``: the session whose lease ``owning`` takes), encoded once per saver."""
        key = (
            thread_id if type(thread_id) is str else str(thread_id),
            checkpoint_ns if type(checkpoint_ns) is str else str(checkpoint_ns),
        )
        ids = self._ids.get(key)
        if ids is None:
            if len(self._ids) >= _IDS_KEPT:
                self._ids.clear()
            thread = f"{self.session_prefix}/{_part(key[0])}/"
            ids = self._ids[key] = (f"{thread}{_part(key[1])}", thread)
        return ids

    def _thread_prefix(self, thread_id: object) -> str:
        return f"{self.session_prefix}/{_part(thread_id)}/"

    def _split(self, session_id: str) -> tuple[str, str]:
        _, thread, ns = session_id.split("/", 2)
        return unquote(thread), unquote(ns)

    # ------------------------------------------------------------------ running

    def _sync(self, fn: Callable[[], T], coro: Callable[[], Awaitable[T]]) -> T:
        """Run a sync method: directly, or on the native AsyncStore's loop from another thread."""
        if self.astore is None or not self.astore.native:
            return fn()
        loop = self.loop
        if loop is None:
            raise asyncio.InvalidStateError(
                "this saver's AsyncStore is native: use the async methods (aput, aget_tuple, ...) "
                "once, or create the saver inside the event loop"
            )
        try:
            if asyncio.get_running_loop() is loop:
                raise asyncio.InvalidStateError(
                    "synchronous calls to AgentkeepSaver on a native AsyncStore are only allowed "
                    "from a different thread; from the event loop use the async methods"
                )
        except RuntimeError:
            pass
        return asyncio.run_coroutine_threadsafe(_as_coroutine(coro), loop).result()

    async def _async(
        self, fn: Callable[[Store], T], afn: Callable[[AsyncStore], Awaitable[T]]
    ) -> T:
        """Run an async method: on the AsyncStore, or the sync Store on a worker thread."""
        if self.astore is not None:
            if self.loop is None and self.astore.native:
                self.loop = asyncio.get_running_loop()
            return await afn(self.astore)
        store = self.store
        return await run_to_completion(functools.partial(fn, store))

    def _write_unit(self, fn: Callable[[Repositories], T]) -> T:
        """Run a write in one unit. Every write of the saver is idempotent (a put
        replaces the same node, a pending write is stored once per task and index,
        deletes and prunes delete what is left), so a lost COMMIT answer
        (``CommitOutcomeUnknown``) is settled by running it once more; when that
        run fails on the database the outcome stays unknown (:func:`_settle`)."""

        def once() -> T:
            return self._sync(lambda: self.store.call_write(fn), lambda: self._awrite_once(fn))

        try:
            return once()
        except CommitOutcomeUnknown as unknown:
            return _settle(once, unknown)

    async def _awrite_unit(self, fn: Callable[[Repositories], T]) -> T:
        try:
            return await self._awrite_once(fn)
        except CommitOutcomeUnknown as unknown:
            first = unknown
        try:
            return await self._awrite_once(fn)
        except Exception as failed:
            if not leaves_unknown(failed, LEASE_REFUSALS):
                raise
            raise still_unknown(first, failed) from failed

    async def _awrite_once(self, fn: Callable[[Repositories], T]) -> T:
        return await self._async(lambda s: s.call_write(fn), lambda a: a.call_write(fn))

    def _one_call(self, op: Callable[[Any], Any], *, begin: bool = True) -> None:
        """Run a put as a one-call operation: its own unit, holding it alone.

        ``op(on)`` calls one method of ``on.checkpoint_nodes``: a unit's
        :class:`~agentkeep.unit_of_work.Repositories` (the repository), or a
        Store or AsyncStore (the one-call facade). The unit sends no
        SAVEPOINT and, on psycopg, pipelines the put's writes with its lock
        and lease read, and outside ``owning`` COMMIT too, when the server
        finds the lease free (one round trip; two with a fence:
        ``CheckpointNodeRepository._guarded``). On a sync Store it runs the
        repository method in ``Store._call_operation`` directly (the facade's
        argument check and telemetry wrapper cost more CPU than a SQLite
        put's statements; the repository checks the arguments); a lost
        COMMIT answer (``CommitOutcomeUnknown``) is settled by running the put
        once more (puts are idempotent). On an AsyncStore it calls the async
        facade (``astore.checkpoint_nodes``), which settles a lost answer the
        same way.

        ``begin=False`` (an unfenced put_writes on a sync SQLite store): the
        unit opens no transaction, and the repository writes with one
        statement in autocommit (its guard folded in), or opens the
        transaction itself when that statement wrote nothing
        (``CheckpointNodeRepository._writes_sqlite``): one statement instead
        of three (``BEGIN IMMEDIATE``, the insert, ``COMMIT``).
        """
        astore = self.astore
        if astore is None:
            store = self.store
            try:
                store._call_operation(op, begin=begin)
            except CommitOutcomeUnknown as unknown:
                _settle(lambda: store._call_operation(op, begin=begin), unknown)
            return
        self._sync(lambda: op(self.store), lambda: op(astore))

    async def _aone_call(self, op: Callable[[Any], Any]) -> None:
        """Async :meth:`_one_call`."""
        await self._async(op, op)

    def _read_unit(self, fn: Callable[[Repositories], T]) -> T:
        return self._sync(lambda: self.store.call_read(fn), lambda: self._aread_unit(fn))

    async def _aread_unit(self, fn: Callable[[Repositories], T]) -> T:
        return await self._async(lambda s: s.call_read(fn), lambda a: a.call_read(fn))

    # ------------------------------------------------------------------ encoding

    def _fence(self, thread_id: object) -> SessionExecutionLease | None:
        owned = self._owned.get()
        return None if owned is None else owned.get(str(thread_id))

    def _put_op(
        self, config: RunnableConfig, checkpoint: Checkpoint, metadata: CheckpointMetadata
    ) -> tuple[Callable[[Any], Any], RunnableConfig]:
        """The put operation (for :meth:`_one_call`) and the config it returns."""
        conf = config["configurable"]
        thread_id = conf["thread_id"]
        ns = conf.get("checkpoint_ns", "")
        checkpoint_id = checkpoint["id"]
        type_, body = self.serde.dumps_typed(checkpoint)
        meta = get_checkpoint_metadata(config, metadata)
        try:
            node_json = _JSON_TEXT({"type": type_, "metadata": meta})
        except (TypeError, ValueError) as exc:
            raise InvalidInput("metadata", f"not JSON-serializable: {exc}") from None
        run_id = meta.get("run_id")
        fence = self._fence(thread_id)
        sid, lease_sid = self._sids(thread_id, ns)
        parent = conf.get("checkpoint_id")
        run = None if run_id is None else str(run_id)
        renew_ms = None if fence is None else self.lease_ttl_ms

        def op(on: Any) -> Any:
            return on.checkpoint_nodes.put_checkpoint_node(
                sid,
                checkpoint_id,
                body,
                node_json=node_json,
                parent_node_id=parent,
                run_id=run,
                lease_session_id=lease_sid,
                fence=fence,
                renew_ms=renew_ms,
            )

        saved: RunnableConfig = {
            "configurable": {
                "thread_id": thread_id,
                "checkpoint_ns": ns,
                "checkpoint_id": checkpoint_id,
            }
        }
        return op, saved

    def _writes_op(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str,
    ) -> tuple[Callable[[Any], Any], bool]:
        """The put_writes operation (for :meth:`_one_call`), and whether it is fenced
        (inside ``owning``)."""
        conf = config["configurable"]
        thread_id = conf["thread_id"]
        sid, lease_sid = self._sids(thread_id, conf.get("checkpoint_ns", ""))
        dumps = self.serde.dumps_typed
        rows = [
            PendingWrite(WRITES_IDX_MAP.get(channel, idx), channel, *dumps(value))
            for idx, (channel, value) in enumerate(writes)
        ]
        fence = self._fence(thread_id)
        checkpoint_id = conf["checkpoint_id"]
        renew_ms = None if fence is None else self.lease_ttl_ms

        def op(on: Any) -> Any:
            return on.checkpoint_nodes.put_pending_writes(
                sid,
                checkpoint_id,
                task_id,
                rows,
                task_path=task_path,
                lease_session_id=lease_sid,
                fence=fence,
                renew_ms=renew_ms,
            )

        return op, fence is not None

    def _tuple(self, session_id: str, node: CheckpointNode) -> CheckpointTuple:
        """Decode a stored node; a value that does not decode is SessionCorrupt."""
        thread_id, ns = self._split(session_id)
        where = f"{session_id}/{node.node_id}"
        try:
            head = json.loads(node.node_json)
            checkpoint: Checkpoint = self.serde.loads_typed((head["type"], node.body))
            metadata: CheckpointMetadata = head["metadata"]
            if not isinstance(checkpoint, dict) or not isinstance(metadata, dict):
                raise TypeError("a checkpoint and its metadata are mappings")
            writes = [
                (w.task_id, w.channel, self.serde.loads_typed((w.value_type, w.value)))
                for w in node.writes
            ]
        except Exception as exc:  # noqa: BLE001 - any decode failure is corruption
            raise SessionCorrupt("graph_nodes", where, "node_json", repr(exc)) from None
        parent = (
            {
                "configurable": {
                    "thread_id": thread_id,
                    "checkpoint_ns": ns,
                    "checkpoint_id": node.parent_node_id,
                }
            }
            if node.parent_node_id
            else None
        )
        return CheckpointTuple(
            config={
                "configurable": {
                    "thread_id": thread_id,
                    "checkpoint_ns": ns,
                    "checkpoint_id": node.node_id,
                }
            },
            checkpoint=checkpoint,
            metadata=metadata,
            parent_config=parent,  # type: ignore[arg-type]
            pending_writes=writes,
        )

    def _get_op(self, config: RunnableConfig) -> Callable[[Repositories], Any]:
        conf = config["configurable"]
        sid = self.session_id(conf["thread_id"], conf.get("checkpoint_ns", ""))
        checkpoint_id = get_checkpoint_id(config)

        def op(r: Repositories) -> tuple[str, CheckpointNode | None]:
            return sid, r.checkpoint_nodes.get_checkpoint_node(sid, checkpoint_id)

        return op

    def _list_op(
        self,
        config: RunnableConfig | None,
        before: RunnableConfig | None,
        limit: int | None,
        filtered: bool,
    ) -> Callable[[Repositories], list[tuple[str, CheckpointNode]]]:
        """Read every matching node (before the metadata filter) in one unit."""
        conf = config["configurable"] if config else {}
        checkpoint_id = conf.get("checkpoint_id")
        before_id = get_checkpoint_id(before) if before else None
        sql_limit = None if filtered else limit
        if config is None:
            prefix, single = f"{self.session_prefix}/", None
        elif "checkpoint_ns" in conf and conf["checkpoint_ns"] is not None:
            prefix, single = "", self.session_id(conf["thread_id"], conf["checkpoint_ns"])
        else:
            prefix, single = self._thread_prefix(conf["thread_id"]), None

        def op(r: Repositories) -> list[tuple[str, CheckpointNode]]:
            found: list[tuple[str, CheckpointNode]] = []
            for sid in [single] if single else _sessions(r, prefix):
                if sql_limit is not None and len(found) >= sql_limit:
                    break
                if checkpoint_id:
                    node = r.checkpoint_nodes.get_checkpoint_node(sid, checkpoint_id)
                    nodes = (
                        [] if node is None or (before_id and node.node_id >= before_id) else [node]
                    )
                else:
                    left = None if sql_limit is None else sql_limit - len(found)
                    nodes = r.checkpoint_nodes.list_checkpoint_nodes(
                        sid, before=before_id, limit=left
                    )
                found.extend((sid, n) for n in nodes)
            return found

        return op

    def _select(
        self,
        found: list[tuple[str, CheckpointNode]],
        filter: dict[str, Any] | None,
        limit: int | None,
    ) -> Iterator[CheckpointTuple]:
        count = 0
        for sid, node in found:
            if limit is not None and count >= limit:
                return
            tup = self._tuple(sid, node)
            if filter and not all(tup.metadata.get(k) == v for k, v in filter.items()):
                continue
            count += 1
            yield tup

    def _delete_thread_op(self, thread_id: str) -> Callable[[Repositories], None]:
        prefix = self._thread_prefix(thread_id)

        def op(r: Repositories) -> None:
            while page := r.catalog.list_sessions(prefix=prefix, limit=_PAGE).session_ids:
                for sid in page:
                    r.catalog.delete_session(sid)

        return op

    def _copy_op(self, source: str, target: str) -> Callable[[Repositories], None]:
        prefix = self._thread_prefix(source)

        def op(r: Repositories) -> None:
            for sid in _sessions(r, prefix):
                _, ns = self._split(sid)
                r.checkpoint_nodes.copy_checkpoint_nodes(sid, self.session_id(target, ns))

        return op

    def _prune_op(self, thread_ids: Sequence[str], strategy: str) -> Callable[[Repositories], None]:
        if strategy not in ("keep_latest", "delete"):
            raise InvalidInput("strategy", "expected 'keep_latest' or 'delete'")
        prefixes = [self._thread_prefix(t) for t in thread_ids]

        def op(r: Repositories) -> None:
            for prefix in prefixes:
                for sid in _sessions(r, prefix):
                    r.checkpoint_nodes.prune_checkpoint_nodes(
                        sid, keep_latest=strategy == "keep_latest"
                    )

        return op

    # ------------------------------------------------------------------ sync API

    def get_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        """The checkpoint ``config`` names (its ``checkpoint_id``, else the latest), or None."""
        sid, node = self._read_unit(self._get_op(config))
        return None if node is None else self._tuple(sid, node)

    def list(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> Iterator[CheckpointTuple]:
        """Checkpoints matching ``config`` (thread, namespace, id), newest first per namespace.

        ``filter`` compares metadata keys for equality; ``before`` keeps ids
        below its checkpoint id; ``limit`` caps the count. The matching rows
        are read in one snapshot before the first tuple is yielded.
        """
        found = self._read_unit(self._list_op(config, before, limit, bool(filter)))
        yield from self._select(found, filter, limit)

    def put(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        """Store a checkpoint (one transaction); return the config naming it.

        Raises:
            SessionLeaseHeld: another owner holds the thread (``owning``).
            SessionExecutionLeaseExpired: this block's ``owning`` lease was lost.
        """
        op, saved = self._put_op(config, checkpoint, metadata)
        self._one_call(op)
        return saved

    def put_writes(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str = "",
    ) -> None:
        """Store a task's pending writes against the checkpoint ``config`` names (idempotent).

        Raises:
            SessionLeaseHeld, SessionExecutionLeaseExpired: as :meth:`put`.
        """
        if writes:
            # Outside owning on a sync SQLite store: no transaction of the unit's
            # own, the writes are one statement in autocommit (see _one_call).
            op, fenced = self._writes_op(config, writes, task_id, task_path)
            self._one_call(op, begin=fenced or not self._sqlite)

    def delete_thread(self, thread_id: str) -> None:
        """Delete every session of the thread (all namespaces) in one transaction.

        Their checkpoint blobs become unreachable; the next blob GC
        (``store.maintenance.gc_unreachable()``) collects them.
        """
        self._write_unit(self._delete_thread_op(thread_id))

    def delete_for_runs(self, run_ids: Sequence[str]) -> None:
        """Delete every checkpoint (and its pending writes) whose metadata ``run_id`` is listed."""
        ids = [str(r) for r in run_ids]
        if ids:
            self._write_unit(lambda r: r.checkpoint_nodes.delete_nodes_for_runs(ids))

    def copy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        """Copy every checkpoint and pending write of a thread to another (blobs are shared)."""
        self._write_unit(self._copy_op(source_thread_id, target_thread_id))

    def prune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        """``keep_latest``: keep each namespace's latest checkpoint; ``delete``: delete all."""
        self._write_unit(self._prune_op(thread_ids, strategy))

    def get_next_version(self, current: str | None, channel: None) -> str:
        """Monotonic string versions, as LangGraph's own savers make them."""
        if current is None:
            current_v = 0
        elif isinstance(current, int):
            current_v = current
        else:
            current_v = int(current.split(".")[0])
        return f"{current_v + 1:032}.{random.random():016}"

    # ------------------------------------------------------------------ async API

    async def aget_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        """Async :meth:`get_tuple`."""
        sid, node = await self._aread_unit(self._get_op(config))
        return None if node is None else self._tuple(sid, node)

    async def alist(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> AsyncIterator[CheckpointTuple]:
        """Async :meth:`list`."""
        found = await self._aread_unit(self._list_op(config, before, limit, bool(filter)))
        for tup in self._select(found, filter, limit):
            yield tup

    async def aput(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        """Async :meth:`put`."""
        op, saved = self._put_op(config, checkpoint, metadata)
        await self._aone_call(op)
        return saved

    async def aput_writes(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str = "",
    ) -> None:
        """Async :meth:`put_writes`."""
        if writes:
            await self._aone_call(self._writes_op(config, writes, task_id, task_path)[0])

    async def adelete_thread(self, thread_id: str) -> None:
        """Async :meth:`delete_thread`."""
        await self._awrite_unit(self._delete_thread_op(thread_id))

    async def adelete_for_runs(self, run_ids: Sequence[str]) -> None:
        """Async :meth:`delete_for_runs`."""
        ids = [str(r) for r in run_ids]
        if ids:
            await self._awrite_unit(lambda r: r.checkpoint_nodes.delete_nodes_for_runs(ids))

    async def acopy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        """Async :meth:`copy_thread`."""
        await self._awrite_unit(self._copy_op(source_thread_id, target_thread_id))

    async def aprune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        """Async :meth:`prune`."""
        await self._awrite_unit(self._prune_op(thread_ids, strategy))

    # ------------------------------------------------------------------ ownership

    def _claim(self, thread_id: object, ttl_ms: int | None) -> tuple[str, LeaseOwnerIdentity, int]:
        owner = LeaseOwnerIdentity(owner_id=self.owner_id, incarnation_id=uuid.uuid4().hex)
        return self.session_id(thread_id), owner, ttl_ms or self.lease_ttl_ms

    @staticmethod
    def _held(outcome: Any) -> SessionExecutionLease:
        if isinstance(outcome, Busy):
            holder = outcome.holder
            raise SessionLeaseHeld(
                holder.session_id, holder.owner.owner_id, holder.expires_at_epoch_ms
            )
        lease: SessionExecutionLease = outcome.lease
        return lease

    @contextmanager
    def owning(
        self, thread_id: str, *, ttl_ms: int | None = None
    ) -> Iterator[SessionExecutionLease]:
        """Own ``thread_id`` for the block: its puts are fenced, everyone else's refused.

        Takes the execution lease of the thread's root session (TTL
        ``ttl_ms`` or the saver's ``lease_ttl_ms``) and releases it when the
        block ends. Inside the block (and in the threads and tasks it starts,
        which inherit its context) this saver's puts on the thread are fenced
        on the lease and renew it.

        Raises:
            SessionLeaseHeld: another owner holds a live lease on the thread
                (entering the block); nothing was written.
            SessionExecutionLeaseExpired: from a put inside the block, once
                the lease was lost (expired and taken, or the thread deleted).
        """
        sid, owner, ttl = self._claim(thread_id, ttl_ms)
        lease = self._held(
            self._sync(
                lambda: self.store.leases.try_claim_session_execution_lease(sid, owner, ttl),
                lambda: self._aclaim(sid, owner, ttl),
            )
        )
        token = self._owned.set({**(self._owned.get() or {}), str(thread_id): lease})
        try:
            yield lease
        finally:
            self._owned.reset(token)
            try:
                self._sync(
                    lambda: self.store.leases.release_session_execution_lease(lease),
                    lambda: self._arelease(lease),
                )
            except SessionExecutionLeaseExpired:
                pass  # lost already: nothing of ours to release

    async def _aclaim(self, sid: str, owner: LeaseOwnerIdentity, ttl: int) -> Any:
        return await self._async(
            lambda s: s.leases.try_claim_session_execution_lease(sid, owner, ttl),
            lambda a: a.leases.try_claim_session_execution_lease(sid, owner, ttl),
        )

    async def _arelease(self, lease: SessionExecutionLease) -> None:
        await self._async(
            lambda s: s.leases.release_session_execution_lease(lease),
            lambda a: a.leases.release_session_execution_lease(lease),
        )

    @asynccontextmanager
    async def aowning(
        self, thread_id: str, *, ttl_ms: int | None = None
    ) -> AsyncIterator[SessionExecutionLease]:
        """Async :meth:`owning` (``async with saver.aowning(thread_id):``)."""
        sid, owner, ttl = self._claim(thread_id, ttl_ms)
        lease = self._held(await self._aclaim(sid, owner, ttl))
        token = self._owned.set({**(self._owned.get() or {}), str(thread_id): lease})
        try:
            yield lease
        finally:
            self._owned.reset(token)
            try:
                await self._arelease(lease)
            except SessionExecutionLeaseExpired:
                pass


def _settle(again: Callable[[], T], first: CommitOutcomeUnknown) -> T:
    """Settle the lost COMMIT answer ``first`` of an idempotent write by running it again.

    Raises:
        CommitOutcomeUnknown: that second run's answer was lost too, or it
            failed on the database (busy, its connection lost, the database
            unavailable) or was refused by the lease guard
            (``SessionLeaseHeld``, ``SessionExecutionLeaseExpired``: the
            lease may have changed hands or expired after the first run
            committed), which leaves ``first`` unknown.
    """
    try:
        return again()
    except Exception as failed:
        if not leaves_unknown(failed, LEASE_REFUSALS):
            raise
        raise still_unknown(first, failed) from failed


def _sessions(r: Repositories, prefix: str) -> list[str]:
    """Every session id with ``prefix``, through the catalog's pages."""
    ids: list[str] = []
    after: str | None = None
    while True:
        page = r.catalog.list_sessions(prefix=prefix, after=after, limit=_PAGE)
        ids.extend(page.session_ids)
        if page.next_after is None:
            return ids
        after = page.next_after


async def _as_coroutine(make: Callable[[], Awaitable[T]]) -> T:
    return await make()
