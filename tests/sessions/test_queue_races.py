"""Queued-work claim races with real concurrency (spec sessions §5.2 Q-24, §6.3), both backends.

Each racer opens its own :class:`Store` from the database URL, in a thread or
in a ``spawn``-ed process; the racers claim in lockstep rounds (a barrier
before every claim), so every round is a real contest for the queue head.
Time comes from each racer's :class:`SettableClock`; nothing sleeps.

* Q-24: racers holding the same live fence claim until the queue is empty. The union of
  the claimed rows has no duplicates and covers the queue; each returned claim
  owns all its rows in the database afterwards; every racer ends with ``None``.
* A stale-generation claimant racing the new holder: the old holder (its
  clock still inside its lease) claims while the new holder takes the lease
  over and claims. Once the old holder is refused it stays refused, and no row
  ends up owned by the old generation: every claim it got before the takeover
  is superseded.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from sqlalchemy import text

from agentkeep.clock import SettableClock
from agentkeep.errors import QueuedWorkClaimSuperseded, SessionExecutionLeaseExpired
from agentkeep.sessions.domain import (
    Acquired,
    ClaimBoundary,
    LeaseOwnerIdentity,
    MergeKey,
    QueuedWorkCompletion,
    QueuedWorkDraft,
    QueuedWorkPayload,
    SessionExecutionLease,
    SlotPolicy,
)
from agentkeep.store import Store
from tests.racing import Racing

from .support import acquire_lease

SID = "race-session"
A = LeaseOwnerIdentity(owner_id="owner-a", incarnation_id="inc-a")
B = LeaseOwnerIdentity(owner_id="owner-b", incarnation_id="inc-b")
T0 = 1_700_000_000_000
ROUNDS = 22  # lockstep rounds; each claims >= 1 of the 20 batches while any is left

Outcome = tuple[Any, ...]


# --------------------------------------------------------------------------
# Racer bodies (module level so that spawned children can import them)


def _claim_once(store: Store, fence: SessionExecutionLease, max_batches: int) -> Outcome:
    try:
        claim = store.call_write(
            lambda r: r.queue.claim_ready_queued_work(
                SID, fence, fence.owner, ClaimBoundary.IDLE, max_batches
            )
        )
    except SessionExecutionLeaseExpired:
        return ("expired",)
    if claim is None:
        return ("none",)
    return (
        "claim",
        claim.claim_id,
        claim.lease_token,
        claim.session_lease_generation,
        tuple(b.batch_id for b in claim.batches),
    )


def _body_same_fence(store: Store, i: int, barrier: Any, p: dict[str, Any]) -> list[Outcome]:
    """Q-24: every round, all racers claim at once with the shared live fence."""
    fence = SessionExecutionLease.model_validate_json(p["fence"])
    out = []
    for _ in range(ROUNDS):
        barrier.wait()
        out.append(_claim_once(store, fence, p["max_batches"]))
    return out


def _body_stale_vs_new(store: Store, i: int, barrier: Any, p: dict[str, Any]) -> list[Outcome]:
    """Racer 0: the old holder, inside its lease by its own clock, claims every round.

    Racer 1: the new holder; in round 0 it takes the lease over (its clock is
    past the old expiry) and claims, racing the old holder's first claim.
    """
    clock = store.clock
    assert isinstance(clock, SettableClock)
    out: list[Outcome] = []
    if i == 0:
        clock.set(p["old_now"])
        fence = SessionExecutionLease.model_validate_json(p["fence"])
        for _ in range(ROUNDS):
            barrier.wait()
            out.append(_claim_once(store, fence, p["max_batches"]))
        return out
    clock.set(p["new_now"])
    lease = None
    for _ in range(ROUNDS):
        barrier.wait()
        if lease is None:
            got = store.leases.try_claim_session_execution_lease(SID, B, 600_000)
            assert isinstance(got, Acquired)
            lease = got.lease
            out.append(("acquired", lease.fencing_token))
        out.append(_claim_once(store, lease, p["max_batches"]))
    return out


#: Two racers, each with its own store and clock at T0.
RACING = Racing(processes=2, threads=2, clock_ms=T0, barrier_timeout_s=30.0, join_timeout_s=120.0)
proc_pool = RACING.pool_fixture()

KINDS = pytest.mark.parametrize("kind", ["threads", "processes"])


# --------------------------------------------------------------------------
# Setup and checks


def fill_queue(store: Store) -> list[str]:
    """20 ready turn-work batches: 8 singles and 4 Join groups of three, interleaved."""
    ids = []
    for n in range(12):
        if n % 3 == 2:
            drafts = [
                QueuedWorkDraft(
                    session_id=SID,
                    slot_policy=SlotPolicy.JOIN,
                    merge_key=MergeKey.of_group(f"g{n}"),
                    payloads=(QueuedWorkPayload(kind="user_input", body={"n": n, "k": k}),),
                )
                for k in range(3)
            ]
        else:
            drafts = [
                QueuedWorkDraft(
                    session_id=SID, payloads=(QueuedWorkPayload(kind="user_input", body=n),)
                )
            ]
        for d in drafts:
            ids.append(store.call_write(lambda r, d=d: r.queue.enqueue_queued_work(d)).batch_id)
    assert len(ids) == 20
    return ids


def stored_claims(store: Store) -> dict[str, tuple[Any, ...]]:
    """batch_id → (claim_id, claim_token, generation) as stored."""
    with store.read() as uow:
        rows = uow.connection.execute(
            text(
                "SELECT batch_id, claim_id, claim_token, claim_session_lease_generation "
                "FROM queued_work_batches WHERE session_id = :s"
            ),
            {"s": SID},
        ).all()
    return {r[0]: (r[1], r[2], r[3]) for r in rows}


def claims_of(outcomes: list[Outcome]) -> list[Outcome]:
    return [o for o in outcomes if o[0] == "claim"]


def completion(o: Outcome) -> QueuedWorkCompletion:
    return QueuedWorkCompletion(session_id=SID, claim_id=o[1], lease_token=o[2], batch_ids=o[4])


# --------------------------------------------------------------------------
# Races


@KINDS
@pytest.mark.parametrize("max_batches", [1, 3])
def test_q_24_racers_with_the_same_fence_never_share_a_row(
    request: pytest.FixtureRequest, store: Store, db_url: str, kind: str, max_batches: int
) -> None:
    ids = fill_queue(store)
    fence = acquire_lease(store, SID, A, 600_000)
    results = RACING.run(
        request,
        kind,
        db_url,
        _body_same_fence,
        {"fence": fence.model_dump_json(), "max_batches": max_batches},
    )

    claims = [c for outcomes in results for c in claims_of(outcomes)]
    claimed = [bid for c in claims for bid in c[4]]
    assert not [bid for bid, n in Counter(claimed).items() if n > 1], "a row was claimed twice"
    assert sorted(claimed) == sorted(ids)
    assert all(outcomes[-1] == ("none",) for outcomes in results)
    assert all(claims_of(outcomes) for outcomes in results), "no contest: one racer took all"
    assert len({c[1] for c in claims}) == len(claims)

    stored = stored_claims(store)
    for c in claims:
        assert c[3] == fence.fencing_token
        owned = {bid for bid, (cid, tok, _) in stored.items() if (cid, tok) == (c[1], c[2])}
        assert owned == set(c[4]), "a returned claim does not own all its rows"
        store.call_read(lambda r, c=c: r.queue.ensure_queued_work_completion(completion(c)))


@KINDS
def test_a_stale_generation_claimant_never_wins_a_row_from_the_new_holder(
    request: pytest.FixtureRequest, store: Store, db_url: str, kind: str
) -> None:
    ids = fill_queue(store)
    old = acquire_lease(store, SID, A, 1_000)
    results = RACING.run(
        request,
        kind,
        db_url,
        _body_stale_vs_new,
        {
            "fence": old.model_dump_json(),
            "max_batches": 2,
            "old_now": T0 + 500,  # A's lease is live by A's clock
            "new_now": T0 + 2_000,  # and expired by B's
        },
    )
    old_out, new_out = results
    assert new_out[0] == ("acquired", old.fencing_token + 1)
    new_gen = old.fencing_token + 1

    # Once refused, the old holder stays refused; before that it claimed under its own generation.
    kinds = [o[0] for o in old_out]
    if "expired" in kinds:
        first = kinds.index("expired")
        assert set(kinds[first:]) == {"expired"}
    assert all(c[3] == old.fencing_token for c in claims_of(old_out))
    assert new_out[-1] == ("none",)

    # The new holder ends up owning every row; the old generation owns none.
    stored = stored_claims(store)
    assert set(stored) == set(ids)
    assert {gen for (_, _, gen) in stored.values()} == {new_gen}
    new_claims = claims_of(new_out)
    assert sorted(bid for c in new_claims for bid in c[4]) == sorted(ids)
    for c in new_claims:
        owned = {bid for bid, (cid, tok, _) in stored.items() if (cid, tok) == (c[1], c[2])}
        assert owned == set(c[4])
    for c in claims_of(old_out):
        with pytest.raises(QueuedWorkClaimSuperseded):
            store.call_read(lambda r, c=c: r.queue.ensure_queued_work_completion(completion(c)))
