"""A one-call claim or reclaim on psycopg sends its fenced write with ``COMMIT``.

Claim and reclaim decide everything from the lease row read under the
``session:<id>`` lock (first round trip, with ``BEGIN``); their one fenced
write then goes with ``COMMIT`` in the second (``SessionLeaseRepository._last_write``).
Counted off the wire (libpq trace, :class:`tests.sessions.test_round_trips.Trace`):
two round trips for a claim that acquires, a claim that extends, a claim
that finds the lease busy (nothing written, the COMMIT goes alone) and a
reclaim that takes a dead holder's lease over; four inside a
``store.write()`` unit, which may hold other work (the write and ``COMMIT``
go separately, as before).

A connection lost with that round trip in flight leaves the outcome unknown;
the one-call forms settle it themselves:

* ``terminate``: the backend is terminated just before the round trip is
  sent (nothing applied). The claim runs again and acquires generation 1.
* ``lost``: the round trip ran (committed), then the connection is closed and
  the answer reported lost. The claim runs again, finds its own live lease
  and extends it: the same token and generation as stored, never a second
  acquisition. A reclaim runs again, finds ``owner``'s own lease (``Busy``
  naming it, since the observed holder is gone) and answers ``Acquired``
  with it: generation + 1, not + 2.

The race the claim's fence guards (two owners claiming at once, exactly one
``Acquired``) runs with real writers on both backends.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from sqlalchemy import make_url

from agentkeep import Store, db, observability
from agentkeep.clock import SettableClock
from agentkeep.sessions.domain import Acquired, Busy, LeaseOwnerIdentity, LocalProcess
from tests.racing import Racing
from tests.sessions.test_round_trips import Trace, psycopg_async_calls

T0_MS = 1_700_000_000_000
HOLDER = LeaseOwnerIdentity(owner_id="holder-A", incarnation_id="inc-A")


def _local(pid: int) -> LocalProcess:
    return LocalProcess(host_id="host-1", boot_id="boot-1", pid=pid, process_start="5001")


#: A claimant and a holder on one host and boot: the probe decides the holder is dead.
CLAIMANT = LeaseOwnerIdentity(owner_id="claimant-B", incarnation_id="inc-B", liveness=_local(4102))
DEAD = LeaseOwnerIdentity(owner_id="dead-C", incarnation_id="inc-C", liveness=_local(4103))


def _gone(pid: int, start: str) -> Any:
    assert pid == 4103, pid  # only the stored holder is probed
    return "gone"


def _counts(call: Any, trace: Trace, sid: str) -> list[int]:
    """Round trips of: acquire, extend, busy, reclaim from a dead holder."""
    counts = []
    with trace.round_trips() as trips:
        first = call(lambda st: st.leases.try_claim_session_execution_lease(sid, HOLDER, 60_000))
    assert isinstance(first, Acquired) and first.lease.fencing_token == 1
    counts.append(len(trips))
    with trace.round_trips() as trips:
        again = call(lambda st: st.leases.try_claim_session_execution_lease(sid, HOLDER, 90_000))
    assert isinstance(again, Acquired) and again.lease.lease_token == first.lease.lease_token
    counts.append(len(trips))
    with trace.round_trips() as trips:
        busy = call(lambda st: st.leases.try_claim_session_execution_lease(sid, CLAIMANT, 60_000))
    assert isinstance(busy, Busy) and busy.holder.lease_token == first.lease.lease_token
    counts.append(len(trips))
    dead_sid = f"{sid}-dead"
    held = call(lambda st: st.leases.try_claim_session_execution_lease(dead_sid, DEAD, 60_000))
    assert isinstance(held, Acquired)
    with trace.round_trips() as trips:
        taken = call(
            lambda st: st.leases.reclaim_session_execution_lease(
                dead_sid, CLAIMANT, held.lease, 60_000, probe=_gone
            )
        )
    assert isinstance(taken, Acquired) and taken.lease.fencing_token == 2, taken
    counts.append(len(trips))
    stored = call(lambda st: st.leases.get_session_execution_lease(dead_sid))
    assert stored == taken.lease
    return counts


def test_claims_take_two_round_trips_on_psycopg(pg_url: str) -> None:
    with Store.open(pg_url, clock=SettableClock(T0_MS)) as store:
        trace = Trace(store.engine, store)
        assert _counts(lambda fn: fn(store), trace, "claim-rt") == [2, 2, 2, 2]
        # In a store.write() unit (which may hold other work) the write and COMMIT go
        # separately, as they did before: four (the unit sends its BEGIN alone).
        with trace.round_trips() as trips, store.write() as uow:
            out = uow.leases.try_claim_session_execution_lease("claim-rt-unit", HOLDER, 60_000)
        assert isinstance(out, Acquired)
        assert len(trips) == 4
        assert store.leases.get_session_execution_lease("claim-rt-unit") == out.lease


def test_claims_take_two_round_trips_on_psycopg_async(pg_url: str) -> None:
    with psycopg_async_calls(pg_url) as (call, trace):
        assert _counts(call, trace, "claim-rt-async") == [2, 2, 2, 2]


# --------------------------------------------------------------------------
# The round trip lost in flight


class _Injector:
    """Breaks the next round trip that carries ``COMMIT`` (psycopg), once."""

    def __init__(self, pg_url: str, monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
        self.admin = psycopg.connect(
            make_url(pg_url).set(drivername="postgresql").render_as_string(hide_password=False),
            autocommit=True,
        )
        self.kind = kind
        self.fired = 0
        self.resolved: list[tuple[str, str]] = []
        original = db.Driver._round_trip
        injector = self

        def round_trip(driver: db.Driver, items: list[tuple[str, Any]], out: list[Any]) -> None:
            if injector.fired or not items or items[-1][0] != "COMMIT":
                return original(driver, items, out)
            injector.fired += 1
            if injector.kind == "terminate":  # nothing applied
                injector._terminate(driver.raw.info.backend_pid)
                return original(driver, items, out)
            original(driver, items, out)  # applied; the answer is "lost"
            injector._terminate(driver.raw.info.backend_pid)
            driver.raw.close()
            raise psycopg.OperationalError("the connection was lost (injected after COMMIT)")

        monkeypatch.setattr(db.Driver, "_round_trip", round_trip)
        monkeypatch.setattr(
            observability,
            "commit_outcome_resolved",
            lambda operation, how: self.resolved.append((operation, how)),
        )

    def _terminate(self, pid: int) -> None:
        self.admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        while self.admin.execute(
            "SELECT 1 FROM pg_stat_activity WHERE pid = %s", (pid,)
        ).fetchall():
            threading.Event().wait(0.002)

    def close(self) -> None:
        self.admin.close()


@pytest.fixture
def injected(
    pg_url: str, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> Iterator[_Injector]:
    injector = _Injector(pg_url, monkeypatch, request.param)
    try:
        yield injector
    finally:
        injector.close()


@pytest.mark.parametrize("injected", ["terminate", "lost"], indirect=True)
def test_a_claim_lost_in_flight_is_settled_by_claiming_again(
    pg_url: str, injected: _Injector
) -> None:
    sid = f"claim-lost-{injected.kind}"
    with Store.open(pg_url, clock=SettableClock(T0_MS)) as store:
        out = store.leases.try_claim_session_execution_lease(sid, HOLDER, 60_000)
        assert injected.fired == 1
        assert injected.resolved == [("leases.try_claim_session_execution_lease", "replayed")]
        assert isinstance(out, Acquired), out
        assert out.lease.owner == HOLDER
        stored = store.leases.get_session_execution_lease(sid)
        assert stored is not None
        # One acquisition, whichever way the first round trip went.
        assert (stored.lease_token, stored.fencing_token) == (out.lease.lease_token, 1)
        assert stored.expires_at_epoch_ms == out.lease.expires_at_epoch_ms


@pytest.mark.parametrize("injected", ["terminate", "lost"], indirect=True)
def test_a_reclaim_lost_in_flight_is_settled_by_reclaiming_again(
    pg_url: str, injected: _Injector
) -> None:
    sid = f"reclaim-lost-{injected.kind}"
    with Store.open(pg_url, clock=SettableClock(T0_MS)) as store:
        injected.fired = 1  # not the claim that sets the dead holder up
        held = store.leases.try_claim_session_execution_lease(sid, DEAD, 60_000)
        assert isinstance(held, Acquired)
        injected.fired = 0
        out = store.leases.reclaim_session_execution_lease(
            sid, CLAIMANT, held.lease, 60_000, probe=_gone
        )
        assert injected.fired == 1
        assert injected.resolved == [("leases.reclaim_session_execution_lease", "replayed")]
        assert isinstance(out, Acquired), out
        stored = store.leases.get_session_execution_lease(sid)
        assert stored == out.lease
        assert stored.owner == CLAIMANT and stored.fencing_token == 2  # one takeover


# --------------------------------------------------------------------------
# Two owners claiming one session at once


def _body_two_claims(store: Store, i: int, barrier: Any, p: dict[str, Any]) -> list[Any]:
    owner = LeaseOwnerIdentity(owner_id=f"racer-{i}", incarnation_id=f"inc-{i}")
    out: list[Any] = []
    for sid in p["sids"]:
        barrier.wait()
        out.append(store.leases.try_claim_session_execution_lease(sid, owner, 60_000))
    return out


RACING = Racing(processes=2, threads=2, clock_ms=T0_MS, barrier_timeout_s=30.0, join_timeout_s=90.0)
proc_pool = RACING.pool_fixture()


@pytest.mark.parametrize("kind", ["processes", "threads"])
def test_two_claims_at_once_have_one_winner(
    request: pytest.FixtureRequest, db_url: str, kind: str
) -> None:
    sids = [f"race-claim-{kind}-{n}" for n in range(10)]
    with Store.open(db_url, clock=SettableClock(T0_MS)) as store:
        results = RACING.run(request, kind, db_url, _body_two_claims, {"sids": sids})
        for n, sid in enumerate(sids):
            outcomes = [results[0][n], results[1][n]]
            won = [o for o in outcomes if isinstance(o, Acquired)]
            lost = [o for o in outcomes if isinstance(o, Busy)]
            assert len(won) == 1 and len(lost) == 1, outcomes
            assert lost[0].holder == won[0].lease
            assert won[0].lease.fencing_token == 1
            assert store.leases.get_session_execution_lease(sid) == won[0].lease


# --------------------------------------------------------------------------
# Where the write must not go with COMMIT, and what a settled reclaim may answer


def test_a_claim_in_a_unit_that_fails_after_it_is_rolled_back(db_url: str) -> None:
    """``store.call_write(fn)`` may hold more work after the claim: its write must not
    go with COMMIT (only a one-call unit's does), so an error after it undoes it."""

    class _After(Exception):
        pass

    def fn(r: Any) -> None:
        out = r.leases.try_claim_session_execution_lease("claim-then-fail", HOLDER, 60_000)
        assert isinstance(out, Acquired)
        raise _After

    with Store.open(db_url, clock=SettableClock(T0_MS)) as store:
        with pytest.raises(_After):
            store.call_write(fn)
        assert store.leases.get_session_execution_lease("claim-then-fail") is None


def test_a_settled_reclaim_answers_acquired_only_with_the_owners_own_lease() -> None:
    """The second reclaim's ``Busy`` means the first took the lease only if it names
    ``owner``'s incarnation; a lease of anyone else (another incarnation of the same
    owner id included) stays ``Busy``."""
    from agentkeep.sessions.domain import SessionExecutionLease
    from agentkeep.sessions.facade import _settle_reclaim

    def lease(owner: LeaseOwnerIdentity) -> SessionExecutionLease:
        return SessionExecutionLease(
            session_id="s",
            owner=owner,
            lease_token="t",
            fencing_token=2,
            claimed_at_epoch_ms=T0_MS,
            expires_at_epoch_ms=T0_MS + 1,
        )

    fence = lease(DEAD)
    own = lease(CLAIMANT)
    settled = _settle_reclaim(None, lambda: Busy(holder=own), "s", CLAIMANT, fence, 60_000)
    assert settled == Acquired(lease=own)
    sibling = LeaseOwnerIdentity(owner_id=CLAIMANT.owner_id, incarnation_id="inc-other")
    for other in (lease(HOLDER), lease(sibling)):
        busy = Busy(holder=other)
        assert _settle_reclaim(None, lambda b=busy: b, "s", CLAIMANT, fence, 60_000) is busy
