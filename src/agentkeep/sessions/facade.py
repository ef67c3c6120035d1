"""One-call forms of the session store's operations (``store.leases``, ``store.queue``, ...).

Each method runs the repository method of the same name in its own unit of
work, retried as a whole on a transient busy/serialisation error. The
repositories hold the only implementation; see them for fences, outcomes and
errors.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from agentkeep.errors import DatabaseError, SessionCorrupt
from agentkeep.sessions.domain import (
    AcquireOutcome,
    AnchorNotFound,
    CancelResult,
    CancelTarget,
    CheckpointKind,
    ClaimBoundary,
    LeaseFence,
    LeaseOwnerIdentity,
    PendingTurnInput,
    PendingTurnInputDraft,
    QueuedWorkBatch,
    QueuedWorkClaim,
    QueuedWorkCompletion,
    QueuedWorkDraft,
    SessionExecutionLease,
    SuffixOutcomes,
    TurnInputClaim,
    TurnInputCompletion,
)
from agentkeep.sessions.liveness import ProcessProbe, procfs_probe
from agentkeep.sessions.maintenance import log_gc_failure
from agentkeep.sessions.records import (
    BlobProfile,
    FullGraphScope,
    GcReport,
    LoadScope,
    PersistedSessionRead,
    RuntimeCommit,
    RuntimeCommitResult,
    SessionMeta,
    SessionNodeRecord,
    VacuumReport,
)

if TYPE_CHECKING:
    from agentkeep.store import Store

__all__ = ["LeaseCalls", "MaintenanceCalls", "QueueCalls", "SessionCalls", "TurnInputCalls"]


class LeaseCalls:
    """``store.leases``: session execution leases, each call in its own unit of work."""

    __slots__ = ("_store",)

    def __init__(self, store: Store) -> None:
        self._store = store

    def try_claim_session_execution_lease(
        self, session_id: str, owner: LeaseOwnerIdentity, ttl_ms: int
    ) -> AcquireOutcome:
        """See :meth:`SessionLeaseRepository.try_claim_session_execution_lease`."""
        return self._store.call_write(
            lambda r: r.leases.try_claim_session_execution_lease(session_id, owner, ttl_ms)
        )

    def reclaim_session_execution_lease(
        self,
        session_id: str,
        owner: LeaseOwnerIdentity,
        observed_holder: LeaseFence,
        ttl_ms: int,
        *,
        probe: ProcessProbe = procfs_probe,
    ) -> AcquireOutcome:
        """See :meth:`SessionLeaseRepository.reclaim_session_execution_lease`."""
        return self._store.call_write(
            lambda r: r.leases.reclaim_session_execution_lease(
                session_id, owner, observed_holder, ttl_ms, probe=probe
            )
        )

    def renew_session_execution_lease(
        self, fence: LeaseFence, ttl_ms: int
    ) -> SessionExecutionLease:
        """See :meth:`SessionLeaseRepository.renew_session_execution_lease`."""
        return self._store.call_write(
            lambda r: r.leases.renew_session_execution_lease(fence, ttl_ms)
        )

    def release_session_execution_lease(self, completion: LeaseFence) -> None:
        """See :meth:`SessionLeaseRepository.release_session_execution_lease`."""
        self._store.call_write(lambda r: r.leases.release_session_execution_lease(completion))

    def ensure_session_execution_lease(self, fence: LeaseFence) -> None:
        """See :meth:`SessionLeaseRepository.ensure_session_execution_lease`."""
        self._store.call_read(lambda r: r.leases.ensure_session_execution_lease(fence))

    def get_session_execution_lease(self, session_id: str) -> SessionExecutionLease | None:
        """See :meth:`SessionLeaseRepository.get_session_execution_lease`."""
        return self._store.call_read(lambda r: r.leases.get_session_execution_lease(session_id))


class QueueCalls:
    """``store.queue``: queued work of sessions, each call in its own unit of work."""

    __slots__ = ("_store",)

    def __init__(self, store: Store) -> None:
        self._store = store

    def enqueue_queued_work(self, draft: QueuedWorkDraft) -> QueuedWorkBatch:
        """See :meth:`QueuedWorkRepository.enqueue_queued_work`."""
        return self._store.call_write(lambda r: r.queue.enqueue_queued_work(draft))

    def claim_leading_ready_session_command(
        self, session_id: str, fence: LeaseFence, owner: LeaseOwnerIdentity
    ) -> QueuedWorkClaim | None:
        """See :meth:`QueuedWorkRepository.claim_leading_ready_session_command`."""
        return self._store.call_write(
            lambda r: r.queue.claim_leading_ready_session_command(session_id, fence, owner)
        )

    def claim_ready_queued_work(
        self,
        session_id: str,
        fence: LeaseFence,
        owner: LeaseOwnerIdentity,
        boundary: ClaimBoundary,
        max_batches: int,
    ) -> QueuedWorkClaim | None:
        """See :meth:`QueuedWorkRepository.claim_ready_queued_work`."""
        return self._store.call_write(
            lambda r: r.queue.claim_ready_queued_work(
                session_id, fence, owner, boundary, max_batches
            )
        )

    def claim_ready_queued_work_by_batch_ids(
        self,
        session_id: str,
        fence: LeaseFence,
        owner: LeaseOwnerIdentity,
        boundary: ClaimBoundary,
        batch_ids: Sequence[str],
    ) -> QueuedWorkClaim | None:
        """See :meth:`QueuedWorkRepository.claim_ready_queued_work_by_batch_ids`."""
        return self._store.call_write(
            lambda r: r.queue.claim_ready_queued_work_by_batch_ids(
                session_id, fence, owner, boundary, batch_ids
            )
        )

    def abandon_queued_work_claim(self, claim: QueuedWorkClaim | QueuedWorkCompletion) -> None:
        """See :meth:`QueuedWorkRepository.abandon_queued_work_claim`."""
        self._store.call_write(lambda r: r.queue.abandon_queued_work_claim(claim))

    def complete_queued_work_claim(
        self, fence: LeaseFence, completion: QueuedWorkCompletion
    ) -> None:
        """See :meth:`QueuedWorkRepository.complete_queued_work_claim`."""
        self._store.call_write(lambda r: r.queue.complete_queued_work_claim(fence, completion))

    def cancel_queued_work_batch(self, session_id: str, batch_id: str) -> QueuedWorkBatch | None:
        """See :meth:`QueuedWorkRepository.cancel_queued_work_batch`."""
        return self._store.call_write(
            lambda r: r.queue.cancel_queued_work_batch(session_id, batch_id)
        )

    def list_queued_work(self, session_id: str) -> list[QueuedWorkBatch]:
        """See :meth:`QueuedWorkRepository.list_queued_work`."""
        return self._store.call_read(lambda r: r.queue.list_queued_work(session_id))

    def list_pending_queued_work(self, session_id: str) -> list[QueuedWorkBatch]:
        """See :meth:`QueuedWorkRepository.list_pending_queued_work`."""
        return self._store.call_read(lambda r: r.queue.list_pending_queued_work(session_id))


class TurnInputCalls:
    """``store.turn_inputs``: pending turn inputs, each call in its own unit of work."""

    __slots__ = ("_store",)

    def __init__(self, store: Store) -> None:
        self._store = store

    def enqueue_pending_turn_input(self, draft: PendingTurnInputDraft) -> PendingTurnInput:
        """See :meth:`TurnInputRepository.enqueue_pending_turn_input`."""
        return self._store.call_write(lambda r: r.turn_inputs.enqueue_pending_turn_input(draft))

    def list_pending_turn_inputs(self, session_id: str) -> list[PendingTurnInput]:
        """See :meth:`TurnInputRepository.list_pending_turn_inputs`."""
        return self._store.call_read(lambda r: r.turn_inputs.list_pending_turn_inputs(session_id))

    def list_turn_inputs(self, session_id: str) -> list[PendingTurnInput]:
        """See :meth:`TurnInputRepository.list_turn_inputs`."""
        return self._store.call_read(lambda r: r.turn_inputs.list_turn_inputs(session_id))

    def cancel_pending_turn_inputs(
        self, session_id: str, targets: Sequence[CancelTarget]
    ) -> list[CancelResult]:
        """See :meth:`TurnInputRepository.cancel_pending_turn_inputs`."""
        return self._store.call_write(
            lambda r: r.turn_inputs.cancel_pending_turn_inputs(session_id, targets)
        )

    def cancel_pending_turn_input_suffix(
        self, session_id: str, anchor: CancelTarget
    ) -> AnchorNotFound | SuffixOutcomes:
        """See :meth:`TurnInputRepository.cancel_pending_turn_input_suffix`."""
        return self._store.call_write(
            lambda r: r.turn_inputs.cancel_pending_turn_input_suffix(session_id, anchor)
        )

    def claim_active_turn_inputs(
        self,
        session_id: str,
        fence: LeaseFence,
        owner: LeaseOwnerIdentity,
        turn_id: str,
        checkpoint: CheckpointKind,
        max_inputs: int,
    ) -> TurnInputClaim | None:
        """See :meth:`TurnInputRepository.claim_active_turn_inputs`."""
        return self._store.call_write(
            lambda r: r.turn_inputs.claim_active_turn_inputs(
                session_id, fence, owner, turn_id, checkpoint, max_inputs
            )
        )

    def claim_next_turn_inputs(
        self, session_id: str, fence: LeaseFence, owner: LeaseOwnerIdentity, max_inputs: int
    ) -> TurnInputClaim | None:
        """See :meth:`TurnInputRepository.claim_next_turn_inputs`."""
        return self._store.call_write(
            lambda r: r.turn_inputs.claim_next_turn_inputs(session_id, fence, owner, max_inputs)
        )

    def abandon_turn_input_claim(self, claim: TurnInputClaim) -> None:
        """See :meth:`TurnInputRepository.abandon_turn_input_claim`."""
        self._store.call_write(lambda r: r.turn_inputs.abandon_turn_input_claim(claim))

    def complete_turn_input_claim(self, fence: LeaseFence, completion: TurnInputCompletion) -> None:
        """See :meth:`TurnInputRepository.complete_turn_input_claim`."""
        self._store.call_write(lambda r: r.turn_inputs.complete_turn_input_claim(fence, completion))

    def recover_stale_turn_input_claims(
        self, session_id: str, fence: LeaseFence
    ) -> list[PendingTurnInput]:
        """See :meth:`TurnInputRepository.recover_stale_turn_input_claims`."""
        return self._store.call_write(
            lambda r: r.turn_inputs.recover_stale_turn_input_claims(session_id, fence)
        )


# --------------------------------------------------------------------------
# Maintenance (appended; its imports stay with it so appends never collide)


class MaintenanceCalls:
    """``store.maintenance``: tombstones, vacuum and blob GC, each call in its own unit of work."""

    __slots__ = ("_store",)

    def __init__(self, store: Store) -> None:
        self._store = store

    def tombstone_nodes(self, session_id: str, node_ids: Sequence[str]) -> None:
        """See :meth:`MaintenanceRepository.tombstone_nodes`."""
        self._store.call_write(lambda r: r.maintenance.tombstone_nodes(session_id, node_ids))

    def vacuum(self, session_id: str) -> VacuumReport:
        """See :meth:`MaintenanceRepository.vacuum`."""
        return self._store.call_write(lambda r: r.maintenance.vacuum(session_id))

    def vacuum_all_sessions(self) -> VacuumReport:
        """See :meth:`MaintenanceRepository.vacuum_all_sessions`."""
        return self._store.call_write(lambda r: r.maintenance.vacuum_all_sessions())

    def gc_unreachable(self) -> GcReport:
        """See :meth:`MaintenanceRepository.gc_unreachable` (never raises for a failed GC).

        Unlike the repository method, a transient lock timeout is first retried
        like any one-call operation; only when the GC still fails is the
        failure logged and an all-zero report returned.
        """
        try:
            return self.gc_unreachable_strict()
        except (SessionCorrupt, DatabaseError) as exc:
            log_gc_failure(exc)
            return GcReport()

    def gc_unreachable_strict(self) -> GcReport:
        """See :meth:`MaintenanceRepository.gc_unreachable_strict`."""
        return self._store.call_write(lambda r: r.maintenance.gc_unreachable_strict())


_session_log = logging.getLogger("agentkeep.sessions")
_FULL_GRAPH_SCOPE = FullGraphScope()


class SessionCalls:
    """``store.sessions``: session commits and reads, each call in its own unit of work.

    Auto-GC (spec §4.12): when the store was opened with
    ``auto_gc_every_commits=N``, every N-th successful
    :meth:`commit_runtime_state` through this object (replays included) is
    followed by a blob GC in its own unit. The counter is process-local and
    per ``SessionCalls`` object, separate from the id nonces (§0.5 [PROPOSED]);
    GC errors are logged and swallowed, never reported to the committer.
    Commits made inside ``store.write()`` do not count and never trigger GC.
    """

    __slots__ = ("_commits", "_store")

    def __init__(self, store: Store) -> None:
        self._store = store
        self._commits = itertools.count(1)

    def commit_runtime_state(
        self, commit: RuntimeCommit, *, blob_profile: BlobProfile = BlobProfile.BALANCED
    ) -> RuntimeCommitResult:
        """See :meth:`SessionCommitRepository.commit_runtime_state`; then maybe auto-GC."""
        result = self._store.call_write(
            lambda r: r.sessions.commit_runtime_state(commit, blob_profile=blob_profile)
        )
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

    def load_session(
        self, session_id: str, scope: LoadScope = _FULL_GRAPH_SCOPE
    ) -> PersistedSessionRead | None:
        """See :meth:`SessionCommitRepository.load_session` (one read snapshot)."""
        return self._store.call_read(lambda r: r.sessions.load_session(session_id, scope))

    def load_node(self, session_id: str, node_id: str) -> SessionNodeRecord | None:
        """See :meth:`SessionCommitRepository.load_node`."""
        return self._store.call_read(lambda r: r.sessions.load_node(session_id, node_id))

    def get_head_revision(self, session_id: str) -> int:
        """See :meth:`SessionCommitRepository.get_head_revision`."""
        return self._store.call_read(lambda r: r.sessions.get_head_revision(session_id))

    def save_session_meta(self, meta: SessionMeta) -> None:
        """See :meth:`SessionCommitRepository.save_session_meta`."""
        self._store.call_write(lambda r: r.sessions.save_session_meta(meta))

    def load_session_meta(self, session_id: str) -> SessionMeta | None:
        """See :meth:`SessionCommitRepository.load_session_meta`."""
        return self._store.call_read(lambda r: r.sessions.load_session_meta(session_id))
