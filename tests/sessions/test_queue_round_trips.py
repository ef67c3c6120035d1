"""Round trips of the queued-work and turn-input operations on psycopg (issue 14, item 4).

Counted off the wire with :class:`tests.sessions.test_round_trips.Trace`, sync
and asyncio, in the steady state: the last cycles, past the run where psycopg
prepares the statements (a statement run outside a pipeline is prepared in a
round trip of its own, once per connection):

* ``enqueue_queued_work``: ``BEGIN`` + the session lock, the batch row and
  every item in one pipelined round trip, ``COMMIT``: 3 whatever the items
  (was 3 + one per item);
* ``claim_ready_queued_work``: the lease read goes out with ``BEGIN`` and the
  lock; the scan (it needs ``now``, sampled once the lock is held), the
  stamping UPDATE and ``COMMIT`` follow: 4 (was 5);
* ``claim_next_turn_inputs`` of one input: the lease read and the scan (it
  needs no ``now``) go out with the lock; the UPDATE, ``COMMIT``: 3 (was 5);
* ``complete_queued_work_claim`` and ``complete_turn_input_claim``: the lease
  read and the owned-rows read go with the lock; the write, ``COMMIT``: 3
  (was 5);
* ``claim_next_turn_inputs`` of two inputs: as of one, its UPDATE in a
  savepoint whose ``SAVEPOINT`` goes with the UPDATE and whose ``RELEASE``
  goes with ``COMMIT`` (``Driver.savepoint``): 3 (was 5).

The batch insert and its items are one unit: a trigger aborting an item's
INSERT leaves no batch and no item, on both backends (inside a unit of work,
the enqueue's savepoint undoes it and the unit goes on).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from agentkeep import Store
from agentkeep.errors import DatabaseError
from agentkeep.sessions.domain import (
    Acquired,
    ClaimBoundary,
    LeaseOwnerIdentity,
    NextTurnIngress,
    PendingTurnInputDraft,
    QueuedWorkDraft,
    QueuedWorkPayload,
)
from tests.runtime.support import abort_trigger
from tests.sessions.test_round_trips import Trace, psycopg_async_calls
from tests.support import raw_rows

OWNER = LeaseOwnerIdentity(owner_id="owner-q", incarnation_id="inc-q")
CYCLES = 8  # psycopg prepares a statement at its 6th run (one extra round trip, once)

Call = Callable[[Callable[[Any], Any]], Any]


def _draft(sid: str, items: int) -> QueuedWorkDraft:
    body = QueuedWorkPayload(kind="user_message", body={"text": "hi"})
    return QueuedWorkDraft(session_id=sid, payloads=(body,) * items)


def _input(sid: str) -> PendingTurnInputDraft:
    return PendingTurnInputDraft(session_id=sid, ingress=NextTurnIngress(), input={"text": "hi"})


def _cycles(call: Call, trace: Trace, prefix: str) -> dict[str, list[int]]:
    """Round trips of each operation, per warm cycle, on a fresh leased session."""
    sid = f"{prefix}-q"
    out = call(lambda st: st.leases.try_claim_session_execution_lease(sid, OWNER, 600_000))
    assert isinstance(out, Acquired), out
    lease = out.lease
    counts: dict[str, list[int]] = {}

    def counted(name: str, fn: Callable[[Any], Any]) -> Any:
        with trace.round_trips() as trips:
            result = call(fn)
        counts.setdefault(name, []).append(len(trips))
        return result

    for i in range(CYCLES):
        batch = counted(
            "enqueue", lambda st, i=i: st.queue.enqueue_queued_work(_draft(sid, 1 + i % 3))
        )
        assert len(batch.items) == 1 + i % 3
        claim = counted(
            "claim",
            lambda st: st.queue.claim_ready_queued_work(sid, lease, OWNER, ClaimBoundary.IDLE, 1),
        )
        assert claim is not None and [b.batch_id for b in claim.batches] == [batch.batch_id]
        counted(
            "complete",
            lambda st, c=claim: st.queue.complete_queued_work_claim(lease, c.completion()),
        )
        call(lambda st: st.turn_inputs.enqueue_pending_turn_input(_input(sid)))
        taken = counted(
            "input claim", lambda st: st.turn_inputs.claim_next_turn_inputs(sid, lease, OWNER, 1)
        )
        assert taken is not None and len(taken.inputs) == 1
        counted(
            "input complete",
            lambda st, c=taken: st.turn_inputs.complete_turn_input_claim(lease, c.completion()),
        )
        for _ in range(2):
            call(lambda st: st.turn_inputs.enqueue_pending_turn_input(_input(sid)))
        taken = counted(
            "input claim 2", lambda st: st.turn_inputs.claim_next_turn_inputs(sid, lease, OWNER, 2)
        )
        assert taken is not None and len(taken.inputs) == 2
        call(lambda st, c=taken: st.turn_inputs.complete_turn_input_claim(lease, c.completion()))
    assert call(lambda st: st.queue.list_queued_work(sid)) == []
    assert call(lambda st: st.turn_inputs.list_pending_turn_inputs(sid)) == []
    return counts


EXPECTED = {
    "enqueue": 3,
    "claim": 4,
    "complete": 3,
    "input claim": 3,
    "input complete": 3,
    "input claim 2": 3,
}


def _steady(counts: dict[str, list[int]]) -> dict[str, int]:
    """The round trips of the last two cycles, which must agree (past the prepare run)."""
    out = {}
    for name, seen in counts.items():
        assert len(set(seen[-2:])) == 1, (name, seen)
        out[name] = seen[-1]
    return out


def test_queue_and_turn_input_round_trips_on_psycopg(pg_url: str) -> None:
    with Store.open(pg_url) as store:
        trace = Trace(store.engine, store)
        assert _steady(_cycles(lambda fn: fn(store), trace, "sync")) == EXPECTED


def test_queue_and_turn_input_round_trips_on_psycopg_async(pg_url: str) -> None:
    with psycopg_async_calls(pg_url) as (call, trace):
        assert _steady(_cycles(call, trace, "async")) == EXPECTED


def test_an_aborted_item_insert_leaves_no_batch(store: Store, db_url: str, backend: str) -> None:
    """The batch row and its items are written together: a trigger aborting an item
    INSERT (pipelined after the batch row on psycopg) fails the enqueue, nothing stays."""
    sid = "q-fault"
    kept = store.queue.enqueue_queued_work(_draft(sid, 1))
    with abort_trigger(db_url, backend, "queued_work_items", "INSERT"):
        with pytest.raises(DatabaseError):
            store.queue.enqueue_queued_work(_draft(sid, 3))
        with store.write() as uow:  # inside a unit of work: its savepoint, the unit goes on
            with pytest.raises(DatabaseError):
                uow.queue.enqueue_queued_work(_draft(sid, 2))
            uow.turn_inputs.enqueue_pending_turn_input(_input(sid))
    assert [b.batch_id for b in store.queue.list_queued_work(sid)] == [kept.batch_id]
    assert len(store.turn_inputs.list_pending_turn_inputs(sid)) == 1
    assert raw_rows(db_url, "SELECT count(*) FROM queued_work_items") == [(1,)]
    assert raw_rows(db_url, "SELECT count(*) FROM queued_work_batches") == [(1,)]
