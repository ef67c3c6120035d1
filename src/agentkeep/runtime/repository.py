"""The runtime store's repository: every operation of the runtime store, in one namespace.

Every operation is described under its own heading in
docs/runtime.md#the-runtime-store.

``uow.runtime`` (and, one call per unit, ``store.runtime``) is a
:class:`RuntimeRepository`. It is composed, not inherited: one part object
per concern, each in the module named for it, which holds that concern's
statements, fences and outcomes. The parts share the unit's
:class:`~agentkeep.runtime.access.RuntimeAccess` (driver, domain, write
lock, phase-mapped errors, savepoint rule); steps more than one part runs
(upsert the snapshot, upsert input states, the outbox checks, ...) are plain
functions of that access in the module that owns the rows.

* ``snapshots`` (:mod:`~agentkeep.runtime.snapshots`) — session snapshots:
  commit (identical-bytes fast path), transcript rewrite, load, clear,
  replace/clear-if-current, quarantine; the rows in
  :mod:`~agentkeep.runtime.snapshot_rows`;
* ``outbox`` (:mod:`~agentkeep.runtime.outbox`) — the compaction-projection
  outbox: the insert-and-compare and replay checks every snapshot writer
  runs, the pending list, finalization;
* ``boundaries`` (:mod:`~agentkeep.runtime.boundaries`) — boundary commits
  (``atomic_apply*``) with the supersession verdict, and boundary receipts;
* ``inputs`` (:mod:`~agentkeep.runtime.inputs`) — input states, and their
  batch compare-and-swap;
* ``lifecycle`` (:mod:`~agentkeep.runtime.lifecycle`) — machine lifecycle
  records, ops lifecycle snapshots and retired epochs;
* ``finalization`` (:mod:`~agentkeep.runtime.finalization`) — the statements
  of unregister finalization;
* ``mob_hosts`` (:mod:`~agentkeep.runtime.mob`) — mob host bindings and
  revocations;
* ``oauth`` (:mod:`~agentkeep.runtime.oauth`) — the OAuth flow singleton.

``uow.runtime.<op>(...)`` forwards each public operation to its part (one
line each below, typed by the part method's own signature). The pre-encoded
forms the one-call facade runs (``apply_*``) and the finalization steps are
reachable on the parts only (``uow.runtime.snapshots.apply_session_snapshot``).

Unregister finalization (:mod:`~agentkeep.runtime.finalization`) owns its
transaction (it classifies an unacknowledged COMMIT on a fresh connection),
so it is a one-call operation only: ``store.runtime.commit_unregister_finalization``.

Choices where the original store was open (docs/decisions.md#runtime-store):

* **Locks.** Every runtime-scoped write takes ``runtime:<id>``; mob
  operations ``mob:<id>``; the OAuth flow its singleton key — ``BEGIN
  IMMEDIATE`` on SQLite, ``pg_advisory_xact_lock`` under READ COMMITTED on
  Postgres (never SERIALIZABLE, never ``FOR UPDATE`` alone: absence checks
  need the lock; docs/decisions.md#runtime-locks).
* **Errors by phase**, as the original store: failing SELECTs are
  ``ReadFailed``, failing writes ``WriteFailed``; a busy database is retried
  as a whole unit and reported as ``WriteFailed`` / ``ReadFailed`` once the
  retries are spent (docs/decisions.md#errors-by-phase). Refusals that need no
  database (undecodable snapshot, invalid intent, key mismatch, bad batch
  shape, non-UUID input id) are raised before the unit opens
  (docs/decisions.md#checks-before-the-unit-opens). Reads never create tables
  (the schema comes from migrations).
* **Fences in SQL.** A compare-and-set (input-state batch swap, snapshot
  replace / clear if current, mob compare-and-put / delete / revoke)
  compares in Python under the lock, then writes with ``UPDATE`` /
  ``DELETE ... WHERE`` the value it read and checks the row count; each
  fence lives in one module with its preparation and statement
  (:mod:`~agentkeep.runtime.input_cas`, :mod:`~agentkeep.runtime.snapshots`,
  :mod:`~agentkeep.runtime.mob`). A fence that matches nothing inside the
  lock is :class:`~agentkeep.errors.ConcurrentModification`, raised as
  itself (not a ``WriteFailed``): a writer bypassed the lock, a bug signal,
  never retried. The operations' outcomes (Swapped / Stale, True / False)
  are decided by the compare and are unchanged.
* **TEXT in payload columns** is read as its UTF-8 bytes everywhere; the
  compare-and-sets compare after that normalisation and bind their fence on
  the value as stored, so a TEXT row matches (the original store's SQL
  comparison silently missed TEXT rows); the identical-bytes fast path keeps
  the original SQL comparison, so a TEXT row takes the slow path and is
  rewritten as a BLOB (docs/decisions.md#text-payloads-in-compare-and-set).
* **Units of work.** Inside ``store.write()``, an operation that can fail
  after writing runs in a SAVEPOINT, so a caught error leaves nothing of it
  (docs/decisions.md#savepoints-in-caller-units).
* **Fault injection** is a per-call hook at named points, never global state
  (docs/decisions.md#fault-hooks-not-globals).
* **Async**: a cancelled operation is applied completely or not at all;
  unregister finalization is never interrupted, as in the original store
  (docs/decisions.md#cancellation-all-of-the-operation-or-none-of-it).
* The outbox's pending list has an index (``runtime_0002``); the original
  store had none (docs/decisions.md#outbox-pending-index).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar, cast, overload

from agentkeep.crypto import PayloadCodec
from agentkeep.db import Driver
from agentkeep.runtime.access import RuntimeAccess
from agentkeep.runtime.boundaries import BoundaryOps
from agentkeep.runtime.domain import RuntimeDomain
from agentkeep.runtime.finalization import FinalizationOps
from agentkeep.runtime.inputs import InputStateOps
from agentkeep.runtime.lifecycle import LifecycleOps
from agentkeep.runtime.mob import MobHostOps
from agentkeep.runtime.oauth import OAuthOps
from agentkeep.runtime.outbox import OutboxOps
from agentkeep.runtime.snapshots import SnapshotOps

__all__ = ["RuntimeRepository"]

P = ParamSpec("P")
T = TypeVar("T")
PartT = TypeVar("PartT")


class _Forward(Generic[P, T]):
    """``repo.<op>`` is ``repo.<part>.<op>``, typed by the part method's signature."""

    def __init__(self, part: str, method: Callable[Concatenate[Any, P], T]) -> None:
        self._part = part
        self._method = method
        self._name = method.__name__
        self.__doc__ = method.__doc__

    def __set_name__(self, owner: type[Any], name: str) -> None:
        # The declaration must name the operation of the part it forwards to.
        part = owner.__dict__.get(self._part)
        if (
            name != self._name
            or not isinstance(part, _Part)
            or getattr(part.factory, name, None) is not self._method
        ):
            raise TypeError(f"{owner.__name__}.{name} does not forward to {self._part}.{name}")

    @overload
    def __get__(self, obj: None, owner: type[Any]) -> _Forward[P, T]: ...

    @overload
    def __get__(self, obj: object, owner: type[Any]) -> Callable[P, T]: ...

    def __get__(self, obj: object | None, owner: type[Any]) -> _Forward[P, T] | Callable[P, T]:
        if obj is None:
            return self
        return cast("Callable[P, T]", getattr(getattr(obj, self._part), self._name))


class _Part(Generic[PartT]):
    """A part of the repository, built from the unit's access on first use, then kept."""

    def __init__(self, factory: Callable[[RuntimeAccess], PartT]) -> None:
        self.factory = factory
        self._name = ""

    def __set_name__(self, owner: type[Any], name: str) -> None:
        self._name = name

    @overload
    def __get__(self, obj: None, owner: type[Any]) -> _Part[PartT]: ...

    @overload
    def __get__(self, obj: RuntimeRepository, owner: type[Any]) -> PartT: ...

    def __get__(self, obj: RuntimeRepository | None, owner: type[Any]) -> _Part[PartT] | PartT:
        if obj is None:
            return self
        part = self.factory(obj.access)
        # A non-data descriptor: the instance attribute shadows it from now on.
        obj.__dict__[self._name] = part
        return part


def _on(part: str) -> Callable[[Callable[Concatenate[Any, P], T]], _Forward[P, T]]:
    """Declare forwarders to one part: ``op = _snapshots(SnapshotOps.op)``."""

    def forward(method: Callable[Concatenate[Any, P], T]) -> _Forward[P, T]:
        return _Forward(part, method)

    return forward


_snapshots = _on("snapshots")
_outbox = _on("outbox")
_boundaries = _on("boundaries")
_inputs = _on("inputs")
_lifecycle = _on("lifecycle")
_mob_hosts = _on("mob_hosts")
_oauth = _on("oauth")


class RuntimeRepository:
    """Every runtime-store operation of one unit of work (see the module docstring).

    Attributes:
        access: the unit's shared access (driver, domain, lock, errors).
        snapshots: the part :class:`~agentkeep.runtime.snapshots.SnapshotOps`.
        outbox: the part :class:`~agentkeep.runtime.outbox.OutboxOps`.
        boundaries: the part :class:`~agentkeep.runtime.boundaries.BoundaryOps`.
        inputs: the part :class:`~agentkeep.runtime.inputs.InputStateOps`.
        lifecycle: the part :class:`~agentkeep.runtime.lifecycle.LifecycleOps`.
        finalization: the part :class:`~agentkeep.runtime.finalization.FinalizationOps`.
        mob_hosts: the part :class:`~agentkeep.runtime.mob.MobHostOps`.
        oauth: the part :class:`~agentkeep.runtime.oauth.OAuthOps`.
    """

    def __init__(
        self,
        driver: Driver,
        domain: RuntimeDomain[Any] | None = None,
        *,
        writable: bool,
        nested: bool = False,
        oauth_codec: PayloadCodec | None = None,
    ) -> None:
        self.access = RuntimeAccess(
            driver, domain, writable=writable, nested=nested, oauth_codec=oauth_codec
        )

    # The parts, each built on first use (a one-call unit touches one or two).
    snapshots = _Part(SnapshotOps)
    outbox = _Part(OutboxOps)
    boundaries = _Part(BoundaryOps)
    inputs = _Part(InputStateOps)
    lifecycle = _Part(LifecycleOps)
    finalization = _Part(FinalizationOps)
    mob_hosts = _Part(MobHostOps)
    oauth = _Part(OAuthOps)

    # -- snapshots and quarantine
    commit_session_snapshot = _snapshots(SnapshotOps.commit_session_snapshot)
    commit_session_transcript_rewrite_snapshot = _snapshots(
        SnapshotOps.commit_session_transcript_rewrite_snapshot
    )
    load_session_snapshot = _snapshots(SnapshotOps.load_session_snapshot)
    clear_session_snapshot = _snapshots(SnapshotOps.clear_session_snapshot)
    replace_session_snapshot_if_current = _snapshots(
        SnapshotOps.replace_session_snapshot_if_current
    )
    clear_session_snapshot_if_current = _snapshots(SnapshotOps.clear_session_snapshot_if_current)
    is_runtime_projection_quarantined = _snapshots(SnapshotOps.is_runtime_projection_quarantined)

    # -- the compaction-projection outbox
    load_pending_compaction_projections = _outbox(OutboxOps.load_pending_compaction_projections)
    mark_compaction_projection_finalized = _outbox(OutboxOps.mark_compaction_projection_finalized)

    # -- boundary commits and receipts
    atomic_apply = _boundaries(BoundaryOps.atomic_apply)
    atomic_apply_with_machine_lifecycle = _boundaries(
        BoundaryOps.atomic_apply_with_machine_lifecycle
    )
    load_boundary_receipt = _boundaries(BoundaryOps.load_boundary_receipt)

    # -- input states
    load_input_states = _inputs(InputStateOps.load_input_states)
    load_input_state = _inputs(InputStateOps.load_input_state)
    persist_input_state = _inputs(InputStateOps.persist_input_state)
    persist_input_states_atomically = _inputs(InputStateOps.persist_input_states_atomically)
    compare_and_swap_input_states_atomically = _inputs(
        InputStateOps.compare_and_swap_input_states_atomically
    )

    # -- machine lifecycle and ops lifecycle
    load_machine_lifecycle_record = _lifecycle(LifecycleOps.load_machine_lifecycle_record)
    load_machine_lifecycle = _lifecycle(LifecycleOps.load_machine_lifecycle)
    load_runtime_state = _lifecycle(LifecycleOps.load_runtime_state)
    commit_machine_lifecycle = _lifecycle(LifecycleOps.commit_machine_lifecycle)
    persist_ops_lifecycle = _lifecycle(LifecycleOps.persist_ops_lifecycle)
    initialize_ops_lifecycle_if_absent = _lifecycle(LifecycleOps.initialize_ops_lifecycle_if_absent)
    load_ops_lifecycle = _lifecycle(LifecycleOps.load_ops_lifecycle)
    delete_ops_lifecycle = _lifecycle(LifecycleOps.delete_ops_lifecycle)

    # -- mob host bindings
    load_mob_host_binding = _mob_hosts(MobHostOps.load_mob_host_binding)
    list_mob_host_bindings = _mob_hosts(MobHostOps.list_mob_host_bindings)
    load_mob_host_revocation = _mob_hosts(MobHostOps.load_mob_host_revocation)
    list_mob_host_revocations = _mob_hosts(MobHostOps.list_mob_host_revocations)
    put_mob_host_binding_if_absent = _mob_hosts(MobHostOps.put_mob_host_binding_if_absent)
    compare_and_put_mob_host_binding = _mob_hosts(MobHostOps.compare_and_put_mob_host_binding)
    delete_mob_host_binding = _mob_hosts(MobHostOps.delete_mob_host_binding)
    revoke_mob_host_binding = _mob_hosts(MobHostOps.revoke_mob_host_binding)

    # -- the OAuth flow singleton
    persist_auth_oauth_flow_snapshot = _oauth(OAuthOps.persist_auth_oauth_flow_snapshot)
    load_auth_oauth_flow_snapshot = _oauth(OAuthOps.load_auth_oauth_flow_snapshot)
    update_auth_oauth_flow_snapshot = _oauth(OAuthOps.update_auth_oauth_flow_snapshot)
    reencrypt_auth_oauth_flow_snapshot = _oauth(OAuthOps.reencrypt_auth_oauth_flow_snapshot)
