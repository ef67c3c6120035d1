"""Session leases with the lock pipelined: round trips, and release racing a claim.

On psycopg (sync and asyncio) the lease read goes out with ``BEGIN`` and the
``session:<id>`` lock (see :mod:`agentkeep.sessions.leases`): claim is two (its
write goes with ``COMMIT``), renew two (the same), release one (one
statement that takes the lock itself), counted off the wire (libpq trace, one
``ReadyForQuery`` per wait; :class:`tests.sessions.test_round_trips.Trace`).

The race: the holder releases while another owner claims, both at once
(threads and processes, both backends). The release's UPDATE still runs only
once the lock is granted, so the two are serialised either way: the claimant
is ``Busy`` naming the live lease and the session ends released, or it
acquires generation g+1 and keeps it (the release, fenced on the old token,
is a no-op). Never both, never neither.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from agentkeep import Store
from agentkeep.clock import SettableClock
from agentkeep.sessions.domain import Acquired, Busy, LeaseOwnerIdentity
from tests.racing import Racing
from tests.sessions.test_round_trips import Trace, psycopg_async_calls

T0_MS = 1_700_000_000_000
ROUNDS = 10
HOLDER = LeaseOwnerIdentity(owner_id="holder-A", incarnation_id="inc-A")
CLAIMANT = LeaseOwnerIdentity(owner_id="claimant-B", incarnation_id="inc-B")


def _cycle(call: Callable[[Callable[[Any], Any]], Any], trace: Trace, sid: str) -> list[int]:
    """Round trips of claim, renew and release (twice: past any first-use effect)."""
    counts = []
    for _ in range(2):
        with trace.round_trips() as trips:
            out = call(lambda st: st.leases.try_claim_session_execution_lease(sid, HOLDER, 60_000))
        assert isinstance(out, Acquired)
        counts.append(len(trips))
        with trace.round_trips() as trips:
            lease = call(lambda st, f=out.lease: st.leases.renew_session_execution_lease(f, 90_000))
        assert (lease.lease_token, lease.fencing_token) == (
            out.lease.lease_token,
            out.lease.fencing_token,
        )
        counts.append(len(trips))
        with trace.round_trips() as trips:
            call(lambda st, f=lease: st.leases.release_session_execution_lease(f))
        counts.append(len(trips))
        assert call(lambda st: st.leases.get_session_execution_lease(sid)) is None
    return counts


def test_lease_cycle_round_trips_on_psycopg(pg_url: str) -> None:
    with Store.open(pg_url) as store:
        trace = Trace(store.engine, store)
        assert _cycle(lambda fn: fn(store), trace, "sess-lease-rt") == [2, 2, 1] * 2


def test_lease_cycle_round_trips_on_psycopg_async(pg_url: str) -> None:
    with psycopg_async_calls(pg_url) as (call, trace):
        assert _cycle(call, trace, "sess-lease-rt-async") == [2, 2, 1] * 2


# --------------------------------------------------------------------------
# Release racing another owner's claim


def _body_release_vs_claim(store: Store, i: int, barrier: Any, p: dict[str, Any]) -> list[Any]:
    """Racer 0 releases the holder's lease, racer 1 claims the session, at once."""
    out: list[Any] = []
    for sid, fence in zip(p["sids"], p["fences"], strict=True):
        barrier.wait()
        if i == 0:
            store.leases.release_session_execution_lease(fence)
            out.append(None)
        else:
            out.append(store.leases.try_claim_session_execution_lease(sid, CLAIMANT, 60_000))
    return out


RACING = Racing(processes=2, threads=2, clock_ms=T0_MS, barrier_timeout_s=30.0, join_timeout_s=90.0)
proc_pool = RACING.pool_fixture()


@pytest.mark.parametrize("kind", ["processes", "threads"])
def test_release_racing_a_claim_is_serialised(
    request: pytest.FixtureRequest, db_url: str, kind: str
) -> None:
    sids = [f"race-rel-{kind}-{n}" for n in range(ROUNDS)]
    with Store.open(db_url, clock=SettableClock(T0_MS)) as store:
        fences = []
        for n, sid in enumerate(sids):
            for _ in range(n % 2):  # generation 1 or 2 for the holder
                out = store.leases.try_claim_session_execution_lease(sid, HOLDER, 100)
                assert isinstance(out, Acquired)
                store.leases.release_session_execution_lease(out.lease)
            out = store.leases.try_claim_session_execution_lease(sid, HOLDER, 60_000)
            assert isinstance(out, Acquired)
            fences.append(out.lease)
        results = RACING.run(
            request, kind, db_url, _body_release_vs_claim, {"sids": sids, "fences": fences}
        )
        for sid, held, claimed in zip(sids, fences, results[1], strict=True):
            stored = store.leases.get_session_execution_lease(sid)
            if isinstance(claimed, Busy):  # claim first: the release then cleared the lease
                assert claimed.holder == held
                assert stored is None
            else:  # release first: the claim took the next generation and keeps it
                assert isinstance(claimed, Acquired), claimed
                assert claimed.lease.fencing_token == held.fencing_token + 1
                assert claimed.lease.owner == CLAIMANT
                assert stored == claimed.lease
