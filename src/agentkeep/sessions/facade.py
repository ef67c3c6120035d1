"""One-call forms of the session store's operations (``store.leases``, ``store.queue``, ...).

Each method runs the repository method of the same name in its own unit of
work, retried as a whole on a transient busy/serialisation error
(docs/architecture.md#one-call-operations). The repositories hold the only
implementation; see them, and docs/sessions.md#the-session-store, for fences,
outcomes and errors.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final, TypeVar

from agentkeep.errors import CommitOutcomeUnknown, DatabaseError, SessionCorrupt
from agentkeep.one_call import OneCalls, Rerun, leaves_unknown, read, rerun, still_unknown, write
from agentkeep.sessions.commits import _DEFAULT_SCOPE, _NeedsSnapshot
from agentkeep.sessions.commits import SessionCommitRepository as _SESSIONS
from agentkeep.sessions.domain import (
    Acquired,
    AcquireOutcome,
    Busy,
    LeaseOwnerIdentity,
    same_incarnation,
)
from agentkeep.sessions.leases import SessionLeaseRepository as _LEASES
from agentkeep.sessions.maintenance import MaintenanceRepository as _MAINTENANCE
from agentkeep.sessions.maintenance import Progress, log_gc_failure
from agentkeep.sessions.queue import QueuedWorkRepository as _QUEUE
from agentkeep.sessions.records import (
    ActivePathScope,
    BlobProfile,
    GcReport,
    HeadScope,
    LoadScope,
    PersistedSessionRead,
    RuntimeCommit,
    RuntimeCommitResult,
)
from agentkeep.sessions.turn_inputs import TurnInputRepository as _TURN_INPUTS

if TYPE_CHECKING:
    from agentkeep.store import Store

__all__ = [
    "CatalogCalls",
    "CheckpointNodeCalls",
    "LeaseCalls",
    "MaintenanceCalls",
    "QueueCalls",
    "SessionCalls",
    "TurnInputCalls",
]

T = TypeVar("T")


def _rerun_if_source_keyed(facade: Any, again: Callable[[], T], draft: Any) -> T:
    """A lost COMMIT of an enqueue: with a source key, enqueueing again returns the
    stored item (the enqueue is idempotent by its key); without one it could enqueue
    twice, so the unknown outcome is raised."""
    if draft.source_key is None:
        raise CommitOutcomeUnknown("enqueue without a source_key", {"draft": draft})
    return again()


def _settle_reclaim(
    facade: Any,
    again: Callable[[], AcquireOutcome],
    session_id: str,
    owner: LeaseOwnerIdentity,
    *args: Any,
    **kwargs: Any,
) -> AcquireOutcome:
    """A lost COMMIT of a reclaim: reclaim again. If the first took the lease over, the
    second finds ``owner``'s own live lease, not the observed holder's, and answers
    ``Busy`` naming it: that lease is the first reclaim's, so ``owner`` holds it
    (``Acquired``). Otherwise the second answer is the outcome."""
    outcome = again()
    if isinstance(outcome, Busy) and same_incarnation(outcome.holder.owner, owner):
        return Acquired(lease=outcome.holder)
    return outcome


class LeaseCalls(OneCalls):
    """``store.leases``: session execution leases, each call in its own unit of work."""

    _repository = "leases"

    # A lost COMMIT of a claim (its write goes with COMMIT on psycopg): claiming again
    # with the same owner extends the lease the first claim took, or takes it now.
    try_claim_session_execution_lease = write(
        _LEASES.try_claim_session_execution_lease, resolve=rerun
    )
    reclaim_session_execution_lease = write(
        _LEASES.reclaim_session_execution_lease, resolve=_settle_reclaim
    )
    renew_session_execution_lease = write(_LEASES.renew_session_execution_lease)
    # A release is idempotent by its fence: run again, it releases or matches nothing.
    release_session_execution_lease = write(_LEASES.release_session_execution_lease, resolve=rerun)
    ensure_session_execution_lease = read(
        _LEASES.ensure_session_execution_lease, single_statement=True
    )
    get_session_execution_lease = read(_LEASES.get_session_execution_lease, single_statement=True)


class QueueCalls(OneCalls):
    """``store.queue``: queued work of sessions, each call in its own unit of work."""

    _repository = "queue"

    enqueue_queued_work = write(_QUEUE.enqueue_queued_work, resolve=_rerun_if_source_keyed)
    claim_leading_ready_session_command = write(_QUEUE.claim_leading_ready_session_command)
    claim_ready_queued_work = write(_QUEUE.claim_ready_queued_work)
    claim_ready_queued_work_by_batch_ids = write(_QUEUE.claim_ready_queued_work_by_batch_ids)
    abandon_queued_work_claim = write(_QUEUE.abandon_queued_work_claim)
    complete_queued_work_claim = write(_QUEUE.complete_queued_work_claim)
    cancel_queued_work_batch = write(_QUEUE.cancel_queued_work_batch)
    list_queued_work = read(_QUEUE.list_queued_work, single_statement=True)
    list_pending_queued_work = read(_QUEUE.list_pending_queued_work, single_statement=True)


class TurnInputCalls(OneCalls):
    """``store.turn_inputs``: pending turn inputs, each call in its own unit of work."""

    _repository = "turn_inputs"

    enqueue_pending_turn_input = write(
        _TURN_INPUTS.enqueue_pending_turn_input, resolve=_rerun_if_source_keyed
    )
    list_pending_turn_inputs = read(_TURN_INPUTS.list_pending_turn_inputs, single_statement=True)
    list_turn_inputs = read(_TURN_INPUTS.list_turn_inputs, single_statement=True)
    cancel_pending_turn_inputs = write(_TURN_INPUTS.cancel_pending_turn_inputs)
    cancel_pending_turn_input_suffix = write(_TURN_INPUTS.cancel_pending_turn_input_suffix)
    claim_active_turn_inputs = write(_TURN_INPUTS.claim_active_turn_inputs)
    claim_next_turn_inputs = write(_TURN_INPUTS.claim_next_turn_inputs)
    abandon_turn_input_claim = write(_TURN_INPUTS.abandon_turn_input_claim)
    complete_turn_input_claim = write(_TURN_INPUTS.complete_turn_input_claim)
    recover_stale_turn_input_claims = write(_TURN_INPUTS.recover_stale_turn_input_claims)


# --------------------------------------------------------------------------
# Maintenance (appended; its imports stay with it so appends never collide)


class MaintenanceCalls(OneCalls):
    """``store.maintenance``: tombstones, vacuum and blob GC, each call in its own unit of work."""

    _repository = "maintenance"

    tombstone_nodes = write(_MAINTENANCE.tombstone_nodes)
    vacuum = write(_MAINTENANCE.vacuum)
    vacuum_all_sessions = write(_MAINTENANCE.vacuum_all_sessions)
    gc_unreachable_strict = write(_MAINTENANCE.gc_unreachable_strict)

    def gc_unreachable(self, *, progress: Progress | None = None) -> GcReport:
        """See :meth:`MaintenanceRepository.gc_unreachable` (never raises for a failed GC).

        Unlike the repository method, a transient lock timeout is first retried
        like any one-call operation; only when the GC still fails is the
        failure logged and an all-zero report returned.
        """
        try:
            return self.gc_unreachable_strict(progress=progress)
        except (SessionCorrupt, DatabaseError) as exc:
            log_gc_failure(exc)
            return GcReport()


_session_log = logging.getLogger("agentkeep.sessions")


class SessionCalls(OneCalls):
    """``store.commits``: session commits and reads, each call in its own unit of work.

    Auto-GC (docs/sessions.md#auto-gc): when the store was opened with
    ``auto_gc_every_commits=N``, every N-th successful
    :meth:`commit_runtime_state` through this object (replays included) is
    followed by a blob GC in its own unit. The counter is process-local and
    per ``SessionCalls`` object, separate from the id nonces (the original
    store shared one counter: docs/decisions.md#derived-ids-carry-random-bits);
    GC errors are logged and swallowed, never reported to the committer.
    Commits made inside ``store.write()`` do not count and never trigger GC.
    """

    _repository = "commits"

    load_node = read(_SESSIONS.load_node, single_statement=True)
    get_head_revision = read(_SESSIONS.get_head_revision, single_statement=True)
    save_session_meta = write(_SESSIONS.save_session_meta)
    load_session_meta = read(_SESSIONS.load_session_meta, single_statement=True)

    def __init__(self, store: Store) -> None:
        super().__init__(store)
        self._commits = itertools.count(1)
        # Postgres: the tail read in one statement saves two round trips. SQLite:
        # the snapshot read is cheaper (its two statements return 4-column node
        # rows, the one statement 24-column rows, each column a driver call).
        self._tail_alone = store.engine.dialect.name == "postgresql"

    def load_session(
        self, session_id: str, scope: LoadScope = _DEFAULT_SCOPE
    ) -> PersistedSessionRead | None:
        """See :meth:`SessionCommitRepository.load_session`.

        A :class:`HeadScope` read is one statement (head, manifest blob and
        ledger totals), and on Postgres so is an ``ActivePathScope(tail=N)``
        read from the head's leaf (``N >= 1``, no explicit leaf: the tail walk
        in the same statement); a statement is a consistent snapshot by itself, so
        they run without a snapshot transaction (no ``BEGIN`` / ``COMMIT`` on
        SQLite, one round trip in autocommit mode on Postgres). Only when the checkpoint has
        component blobs, whose reads must see the same snapshot, is the read
        made again in a snapshot unit. Every other scope reads in one
        snapshot unit.
        """
        alone: PersistedSessionRead | _NeedsSnapshot | None
        if type(scope) is HeadScope:
            alone = self._call_read(
                lambda r: r.commits._load_head_alone(session_id), single_statement=True
            )
            if not isinstance(alone, _NeedsSnapshot):
                return alone
        elif (
            self._tail_alone
            and type(scope) is ActivePathScope
            and scope.leaf_node_id is None
            and scope.tail
        ):
            tail = scope.tail
            alone = self._call_read(
                lambda r: r.commits._load_tail_alone(session_id, tail), single_statement=True
            )
            if not isinstance(alone, _NeedsSnapshot):
                return alone
        read: PersistedSessionRead | None = self._call_read(
            lambda r: r.commits.load_session(session_id, scope), single_statement=False
        )
        return read

    def commit_runtime_state(
        self, commit: RuntimeCommit, *, blob_profile: BlobProfile = BlobProfile.BALANCED
    ) -> RuntimeCommitResult:
        """See :meth:`SessionCommitRepository.commit_runtime_state`; then maybe auto-GC.

        A lost COMMIT answer (:class:`~agentkeep.errors.CommitOutcomeUnknown`)
        of a commit with a ``turn_commit`` stamp is resolved by committing
        again: such a commit is idempotent by its hash, so the second call
        returns the stored result when the first was applied, and applies it
        when it was not. Without a stamp the unknown outcome is raised, and so it
        is when that second call fails on the database (busy, its connection
        lost, the database unavailable: it says nothing of the first).
        """

        def once() -> RuntimeCommitResult:
            return self._store._call_operation(
                lambda r: r.commits.commit_runtime_state(commit, blob_profile=blob_profile)
            )

        try:
            result = once()
        except CommitOutcomeUnknown as unknown:
            if commit.turn_commit is None:
                raise CommitOutcomeUnknown(
                    "commits.commit_runtime_state", {"commit": commit}, unknown.detail
                ) from unknown
            try:
                result = once()
            except CommitOutcomeUnknown as again:
                raise CommitOutcomeUnknown(
                    "commits.commit_runtime_state", {"commit": commit}, again.detail
                ) from unknown
            except Exception as failed:
                if not leaves_unknown(failed):
                    raise
                raise still_unknown(
                    unknown, failed, "commits.commit_runtime_state", {"commit": commit}
                ) from failed
        self._maybe_auto_gc()
        return result

    def _maybe_auto_gc(self) -> None:
        interval = getattr(self._store, "auto_gc_every_commits", None)
        if not interval:
            return
        if next(self._commits) % interval != 0:
            return
        try:
            self._store.call_write(lambda r: r.maintenance.gc_unreachable())
        except Exception as exc:  # noqa: BLE001 - best effort, never fails the commit
            _session_log.warning("auto-GC after a session commit failed: %s", exc)


# --------------------------------------------------------------------------
# The session catalog and checkpoint nodes (appended; imports kept with them)

from agentkeep.sessions.catalog import SessionCatalogRepository as _CATALOG  # noqa: E402
from agentkeep.sessions.checkpoint_nodes import LEASE_REFUSALS  # noqa: E402
from agentkeep.sessions.checkpoint_nodes import (  # noqa: E402
    CheckpointNodeRepository as _CHECKPOINT_NODES,
)

#: Run a checkpoint-node write again; a lease refusal of that run settles nothing.
_RERUN_GUARDED: Final = Rerun(LEASE_REFUSALS)


class CatalogCalls(OneCalls):
    """``store.catalog``: enumerate sessions and delete a session, each call in its own unit."""

    _repository = "catalog"

    list_sessions = read(_CATALOG.list_sessions, single_statement=True)
    delete_session = write(_CATALOG.delete_session)


class CheckpointNodeCalls(OneCalls):
    """``store.checkpoint_nodes``: checkpoint nodes and pending writes, one unit per call.

    Puts are idempotent (a node put again is replaced with the same values, a
    pending write is stored once per task and index), so a lost COMMIT answer
    is settled by running the put again. That run's lease refusal
    (``SessionLeaseHeld``, ``SessionExecutionLeaseExpired``) settles nothing:
    the first run passed the guard and may have committed before the lease
    changed hands or expired, so the call raises ``CommitOutcomeUnknown``
    over it.
    """

    _repository = "checkpoint_nodes"

    put_checkpoint_node = write(_CHECKPOINT_NODES.put_checkpoint_node, resolve=_RERUN_GUARDED)
    put_pending_writes = write(_CHECKPOINT_NODES.put_pending_writes, resolve=_RERUN_GUARDED)
    delete_nodes_for_runs = write(_CHECKPOINT_NODES.delete_nodes_for_runs, resolve=_RERUN_GUARDED)
    prune_checkpoint_nodes = write(_CHECKPOINT_NODES.prune_checkpoint_nodes, resolve=_RERUN_GUARDED)
    copy_checkpoint_nodes = write(_CHECKPOINT_NODES.copy_checkpoint_nodes, resolve=_RERUN_GUARDED)
    get_checkpoint_node = read(_CHECKPOINT_NODES.get_checkpoint_node)
    list_checkpoint_nodes = read(_CHECKPOINT_NODES.list_checkpoint_nodes)
    list_pending_writes = read(_CHECKPOINT_NODES.list_pending_writes, single_statement=True)
