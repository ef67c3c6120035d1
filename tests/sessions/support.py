"""Shared helpers of the session store tests: taking leases, enqueueing, raw rows.

* :func:`acquire_lease` and :class:`LeaseTaker`: take a session execution
  lease with ``try_claim`` and fail the test unless it was ``Acquired``;
  a test module binds a :class:`LeaseTaker` to its own session, owner and
  ttl (``hold = LeaseTaker(owner=A, sid=SID, ttl=TTL)``).
* :func:`enqueue`: enqueue a queued-work or a turn-input draft, each in its
  own write unit.
* :func:`lease_rows`, :func:`lease_row`, :func:`turn_input_rows`: rows as
  stored, read with raw SQL in a read unit (every column), for "nothing
  changed" checks and assertions on stored columns.

Store-independent raw SQL (:func:`~tests.support.query`,
:func:`~tests.support.execute_sql`) is in :mod:`tests.support`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, overload

from agentkeep.sessions.domain import (
    Acquired,
    LeaseOwnerIdentity,
    PendingTurnInput,
    PendingTurnInputDraft,
    QueuedWorkBatch,
    QueuedWorkDraft,
    SessionExecutionLease,
)
from agentkeep.store import Store
from tests.support import query

# --------------------------------------------------------------------------
# Leases


def acquire_lease(
    store: Store, sid: str, owner: LeaseOwnerIdentity, ttl: int
) -> SessionExecutionLease:
    """``owner`` acquires (or extends) its lease of ``sid`` for ``ttl`` ms from the store's now.

    Raises:
        AssertionError: ``try_claim`` did not return ``Acquired`` (another holder).
    """
    out = store.leases.try_claim_session_execution_lease(sid, owner, ttl)
    assert isinstance(out, Acquired), out
    return out.lease


@dataclass(frozen=True)
class LeaseTaker:
    """:func:`acquire_lease` with a test module's default session, owner and ttl.

    ``taker(store)`` takes the default owner's lease of the default session;
    ``taker(store, B)``, ``taker(store, sid=OTHER)`` or ``taker(store, A, ttl=1_000)``
    override one of them.
    """

    owner: LeaseOwnerIdentity
    sid: str
    ttl: int

    def __call__(
        self,
        store: Store,
        owner: LeaseOwnerIdentity | None = None,
        sid: str | None = None,
        ttl: int | None = None,
    ) -> SessionExecutionLease:
        return acquire_lease(
            store,
            self.sid if sid is None else sid,
            self.owner if owner is None else owner,
            self.ttl if ttl is None else ttl,
        )


# --------------------------------------------------------------------------
# Enqueueing


@overload
def enqueue(store: Store, draft: QueuedWorkDraft) -> QueuedWorkBatch: ...
@overload
def enqueue(store: Store, draft: PendingTurnInputDraft) -> PendingTurnInput: ...
def enqueue(
    store: Store, draft: QueuedWorkDraft | PendingTurnInputDraft
) -> QueuedWorkBatch | PendingTurnInput:
    """Enqueue ``draft`` in its own write unit: queued work, or a pending turn input."""
    if isinstance(draft, QueuedWorkDraft):
        return store.queue.enqueue_queued_work(draft)
    return store.turn_inputs.enqueue_pending_turn_input(draft)


# --------------------------------------------------------------------------
# Raw rows


def lease_rows(store: Store) -> list[dict[str, Any]]:
    """Every ``session_execution_leases`` row as stored, ordered by session."""
    return query(store, "SELECT * FROM session_execution_leases ORDER BY session_id")


def lease_row(store: Store, sid: str) -> dict[str, Any] | None:
    """The ``session_execution_leases`` row of ``sid`` as stored, or None."""
    rows = query(store, "SELECT * FROM session_execution_leases WHERE session_id = :s", s=sid)
    return rows[0] if rows else None


def turn_input_rows(store: Store) -> list[dict[str, Any]]:
    """Every ``pending_turn_inputs`` row as stored, ordered by ``enqueue_seq``."""
    return query(store, "SELECT * FROM pending_turn_inputs ORDER BY enqueue_seq")
