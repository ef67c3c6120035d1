"""Turn-input claim races with real concurrency (spec §5.2 T-23, I-4, I-6, I-7), both backends.

* T-23 across processes (``spawn``): holder A (generation g) claims inputs
  (an active-turn claim and a next-turn claim); B takes the lease over (by
  expiry, or by reclaiming from a holder it can verify is dead) as
  generation g+1 and claims the same rows; then A's completion and abandon
  run concurrently with B's completion. B owns the rows, A's completion fails
  its fence and A's abandon changes nothing. A's active claim left its rows
  ``accepted``, which no claim scans (the §3.1 orphan hazard), so B first
  runs the fenced recovery the decisions add
  (``recover_stale_turn_input_claims``); the next-turn rows it re-claims
  directly.
* Threads sharing one live fence claim concurrently until nothing is left:
  no input is ever held by two claims, and each claim owns all its rows.

Every racer opens its own :class:`Store` from the database URL, with its own
:class:`SettableClock` (no sleeping: B's clock is simply set past A's expiry).
Phases are lined up on barriers; every wait is bounded.
"""

from __future__ import annotations

import traceback
from collections import Counter
from typing import Any

import pytest
from sqlalchemy import text

from agentkeep.clock import SettableClock
from agentkeep.sessions.domain import (
    Acquired,
    ActiveTurnIngress,
    CheckpointKind,
    LeaseOwnerIdentity,
    LocalProcess,
    NextTurnIngress,
    PendingTurnInputDraft,
    TurnInputClaim,
)
from agentkeep.store import Store
from tests.racing import SPAWN, Racing, race_threads, run_processes, wait_ready

SID = "sess-ti-race"
T0_MS = 1_700_000_000_000
TTL = 5_000
WAIT_S = 60.0
A = LeaseOwnerIdentity(
    owner_id="owner-A",
    incarnation_id="inc-A1",
    liveness=LocalProcess(host_id="host-1", boot_id="boot-1", pid=4101, process_start="5001"),
)
B = LeaseOwnerIdentity(
    owner_id="owner-B",
    incarnation_id="inc-B1",
    liveness=LocalProcess(host_id="host-1", boot_id="boot-1", pid=4102, process_start="5002"),
)


def _probe_gone(pid: int, start: str) -> Any:
    """Injected process probe: A's process is gone (so B may take over before expiry)."""
    return "gone"


def _outcome(fn: Any) -> tuple[str, Any]:
    try:
        return ("ok", fn())
    except Exception as exc:  # noqa: BLE001 - the error is the outcome under test
        return ("err", type(exc).__name__)


def _plain_claim(c: TurnInputClaim | None) -> Any:
    if c is None:
        return None
    return {
        "claim_id": c.claim_id,
        "token": c.lease_token,
        "generation": c.session_lease_generation,
        "input_ids": [i.input_id for i in c.inputs],
    }


# --------------------------------------------------------------------------
# T-23 racers (module level: spawned children import them)


def _holder_a(url: str, barrier: Any, handoff: Any) -> dict[str, Any]:
    """Claim as generation g, hand the fence to B, then try to complete and abandon."""
    try:
        store = Store.open(url, clock=SettableClock(T0_MS))
        try:
            wait_ready(barrier)  # 0: both are up; B's wait for the fence starts after this
            got = store.leases.try_claim_session_execution_lease(SID, A, TTL)
            assert isinstance(got, Acquired)
            fence = got.lease
            active = store.call_write(
                lambda r: r.turn_inputs.claim_active_turn_inputs(
                    SID, fence, A, "T", CheckpointKind.AFTER_WORK, 10
                )
            )
            nxt = store.call_write(
                lambda r: r.turn_inputs.claim_next_turn_inputs(SID, fence, A, 10)
            )
            assert active is not None and nxt is not None
            handoff.put(("fence", fence))
            barrier.wait()  # 1: A holds its claims
            barrier.wait()  # 2: B took over and re-claimed
            barrier.wait()  # 3: go — concurrently with B's completion
            results = {
                "complete_active": _outcome(
                    lambda: store.call_write(
                        lambda r: r.turn_inputs.complete_turn_input_claim(
                            fence, active.completion()
                        )
                    )
                ),
                "complete_next": _outcome(
                    lambda: store.call_write(
                        lambda r: r.turn_inputs.complete_turn_input_claim(fence, nxt.completion())
                    )
                ),
                "abandon_active": _outcome(
                    lambda: store.call_write(
                        lambda r: r.turn_inputs.abandon_turn_input_claim(active)
                    )
                ),
                "abandon_next": _outcome(
                    lambda: store.call_write(lambda r: r.turn_inputs.abandon_turn_input_claim(nxt))
                ),
            }
            return {"active": _plain_claim(active), "next": _plain_claim(nxt), **results}
        finally:
            store.close()
    except BaseException:
        barrier.abort()
        handoff.put(("error", "A", traceback.format_exc()))  # B is waiting for the fence
        raise


def _taker_b(url: str, barrier: Any, handoff: Any, takeover: str) -> dict[str, Any]:
    """Take the lease over as generation g+1, re-claim the rows, complete the active claim."""
    try:
        # expiry: B's clock is past A's lease; reclaim: still live, A verifiably dead.
        at = T0_MS + TTL + 1 if takeover == "expiry" else T0_MS + 10
        store = Store.open(url, clock=SettableClock(at))
        try:
            wait_ready(barrier)  # 0
            kind, a_fence = out_get(handoff, "fence")
            barrier.wait()  # 1
            if takeover == "expiry":
                got = store.leases.try_claim_session_execution_lease(SID, B, TTL)
            else:
                got = store.leases.reclaim_session_execution_lease(
                    SID, B, a_fence, TTL, probe=_probe_gone
                )
            assert isinstance(got, Acquired), got
            fence = got.lease
            # A's active claim left its rows `accepted`; B's generation recovers them first.
            recovered = store.call_write(
                lambda r: r.turn_inputs.recover_stale_turn_input_claims(SID, fence)
            )
            active = store.call_write(
                lambda r: r.turn_inputs.claim_active_turn_inputs(
                    SID, fence, B, "T", CheckpointKind.AFTER_WORK, 10
                )
            )
            nxt = store.call_write(
                lambda r: r.turn_inputs.claim_next_turn_inputs(SID, fence, B, 10)
            )
            barrier.wait()  # 2
            barrier.wait()  # 3
            done = (
                None
                if active is None
                else _outcome(
                    lambda: store.call_write(
                        lambda r: r.turn_inputs.complete_turn_input_claim(
                            fence, active.completion()
                        )
                    )
                )
            )
            return {
                "generation": fence.fencing_token,
                "a_generation": a_fence.fencing_token,
                "recovered": [i.input_id for i in recovered],
                "active": _plain_claim(active),
                "next": _plain_claim(nxt),
                "complete_active": done,
            }
        finally:
            store.close()
    except BaseException:
        barrier.abort()
        raise


def out_get(q: Any, kind: str) -> Any:
    """The next message on ``q``, which must be of ``kind`` (or A's error report)."""
    msg = q.get(timeout=WAIT_S)
    if msg[0] == "error":
        raise RuntimeError(msg[2])
    assert msg[0] == kind, msg
    return msg


def _enqueue(store: Store, ingress: ActiveTurnIngress | NextTurnIngress, value: object) -> str:
    d = PendingTurnInputDraft(session_id=SID, ingress=ingress, input=value)
    return store.call_write(lambda r: r.turn_inputs.enqueue_pending_turn_input(d)).input_id


def _enqueue_setup(store: Store) -> tuple[list[str], list[str]]:
    active = [_enqueue(store, ActiveTurnIngress(turn_id="T"), {"n": n}) for n in range(3)]
    deferred = [_enqueue(store, NextTurnIngress(), {"m": n}) for n in range(2)]
    return active, deferred


def _raw(store: Store) -> dict[str, dict[str, Any]]:
    with store.read() as uow:
        rows = uow.connection.execute(
            text("SELECT * FROM pending_turn_inputs ORDER BY enqueue_seq")
        ).mappings()
        return {r["input_id"]: dict(r) for r in rows}


@pytest.mark.slow
@pytest.mark.parametrize("takeover", ["expiry", "reclaim"])
def test_t_23_takeover_across_processes(db_url: str, store: Store, takeover: str) -> None:
    """T-23: A (gen g) claims; B takes over (gen g+1) and claims the same rows → B owns them;
    A's completion fails its fence, A's abandon is a no-op (while B completes concurrently).

    Decision (spec/README.md, stale accepted claims): B recovers A's ``accepted``
    rows with ``recover_stale_turn_input_claims`` before re-claiming them; in
    the seed they would stay orphaned (T-22).
    """
    active_ids, deferred_ids = _enqueue_setup(store)
    barrier, handoff = SPAWN.Barrier(2, timeout=WAIT_S), SPAWN.Queue()
    a, b = run_processes(
        [
            (_holder_a, (db_url, barrier, handoff)),
            (_taker_b, (db_url, barrier, handoff, takeover)),
        ],
        3 * WAIT_S,
    )
    assert b["generation"] == b["a_generation"] + 1
    assert b["recovered"] == active_ids
    assert a["active"]["input_ids"] == b["active"]["input_ids"] == active_ids
    assert a["next"]["input_ids"] == b["next"]["input_ids"] == deferred_ids
    assert b["active"]["claim_id"] != a["active"]["claim_id"]
    assert b["active"]["generation"] == b["generation"]
    # A lost: its completions fail the fence, its abandons are silent no-ops.
    assert a["complete_active"] == ("err", "SessionExecutionLeaseExpired")
    assert a["complete_next"] == ("err", "SessionExecutionLeaseExpired")
    assert a["abandon_active"] == ("ok", None)
    assert a["abandon_next"] == ("ok", None)
    assert b["complete_active"] == ("ok", None)
    # B owns the rows: its active claim completed, its next-turn claim intact.
    rows = _raw(store)
    for iid in active_ids:
        assert rows[iid]["state"] == "completed"
        assert rows[iid]["claim_token"] is None
        assert rows[iid]["claim_fencing_token"] == 2
    for iid in deferred_ids:
        r = rows[iid]
        assert r["state"] == "deferred_next_turn"
        assert (r["claim_id"], r["claim_token"]) == (b["next"]["claim_id"], b["next"]["token"])
        assert r["claim_session_lease_generation"] == b["generation"]
        assert r["claim_owner_id"] == B.owner_id


# --------------------------------------------------------------------------
# One live fence, concurrent claimants (threads)


def _claimant(store: Store, i: int, barrier: Any, p: dict[str, Any]) -> list[TurnInputClaim]:
    """Start with the others, then claim with the shared fence until nothing is left."""
    fence = p["fence"]
    found: list[TurnInputClaim] = []
    barrier.wait()
    for _ in range(p["rounds"]):
        active = store.call_write(
            lambda r: r.turn_inputs.claim_active_turn_inputs(
                SID, fence, fence.owner, "T", CheckpointKind.AFTER_WORK, 3
            )
        )
        nxt = store.call_write(
            lambda r: r.turn_inputs.claim_next_turn_inputs(SID, fence, fence.owner, 2)
        )
        found.extend(c for c in (active, nxt) if c is not None)
        if active is None and nxt is None:
            break
    return found


@pytest.mark.parametrize("n_threads", [2, 4])
def test_concurrent_claims_with_one_fence_never_share_an_input(
    db_url: str, store: Store, n_threads: int
) -> None:
    """Threads with the same live fence claim until nothing is left: every input ends in
    exactly one claim, each claim owns all its rows (I-4, I-6), and claim ids are unique.
    """
    total = 24
    for n in range(total):
        ingress = ActiveTurnIngress(turn_id="T") if n % 2 == 0 else NextTurnIngress()
        _enqueue(store, ingress, {"n": n})
    got = store.leases.try_claim_session_execution_lease(SID, A, 60_000)
    assert isinstance(got, Acquired)
    fence = got.lease
    racing = Racing(
        threads=n_threads, clock_ms=T0_MS, barrier_timeout_s=WAIT_S, join_timeout_s=WAIT_S
    )
    found = race_threads(racing, db_url, _claimant, {"fence": fence, "rounds": total})

    claims = [c for per_thread in found for c in per_thread]
    held = Counter(i.input_id for c in claims for i in c.inputs)
    assert len(held) == total and set(held.values()) == {1}
    assert len({c.claim_id for c in claims}) == len(claims)
    rows = _raw(store)
    for c in claims:
        for i in c.inputs:
            r = rows[i.input_id]
            assert (r["claim_id"], r["claim_token"]) == (c.claim_id, c.lease_token)
            assert r["claim_session_lease_generation"] == fence.fencing_token
            assert r["claim_fencing_token"] == 1
