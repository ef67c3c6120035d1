"""One-call forms of the session store's operations (``store.leases``, ``store.queue``, ...).

Each method runs the repository method of the same name in its own unit of
work, retried as a whole on a transient busy/serialisation error. The
repositories hold the only implementation; see them for fences, outcomes and
errors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from agentkeep.sessions.domain import (
    AcquireOutcome,
    LeaseFence,
    LeaseOwnerIdentity,
    SessionExecutionLease,
)
from agentkeep.sessions.liveness import ProcessProbe, procfs_probe

if TYPE_CHECKING:
    from agentkeep.store import Store

__all__ = ["LeaseCalls"]


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
