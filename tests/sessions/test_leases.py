"""Session execution leases (spec sessions §2.5, §3.2, §5.1 I-1/I-2, §5.2 L-01..L-24, L-27).

All tests run on both backends.

Every scenario of §5.2 that needs no concurrency is one test named after it
(the races L-25/L-26 are in ``test_lease_races.py``). Time comes from the
:class:`SettableClock` of the ``store`` fixture; "row unchanged" is checked on
the raw ``session_execution_leases`` rows read with SQL before and after.
Reclaims inject ``probe=`` (``(pid, start) -> "gone" | "alive" | "unknown"``)
for owners with :class:`LocalProcess` liveness; two variants also use the real
procfs probe.

``now`` is sampled once per operation *after* the session lock is held
(spec/README.md decision 2; §0.2 says before). With a settable clock that
nobody moves during a call the two are indistinguishable, so no expected value
below depends on it.

The property test drives random ``try_claim`` / ``reclaim`` / ``renew`` /
``release`` / clock-advance / liveness-change sequences by three owners of one
session against a small model, and checks I-1 (the generation never decreases
and grows by exactly one per acquisition or takeover) and I-2 (at most one
issued fence passes FENCE_OK at any instant) after every step.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from agentkeep.clock import SettableClock
from agentkeep.errors import (
    InvalidInput,
    ReadOnlyUnitOfWork,
    SessionCorrupt,
    SessionExecutionLeaseExpired,
)
from agentkeep.sessions.domain import (
    Acquired,
    AcquireOutcome,
    Busy,
    LeaseFence,
    LeaseOwnerIdentity,
    LocalProcess,
    Opaque,
    SessionExecutionLease,
    same_incarnation,
)
from agentkeep.sessions.liveness import capture_liveness
from agentkeep.store import Store
from tests.support import execute_sql

from .support import lease_row, lease_rows

SID = "sess-1"
OTHER_SID = "sess-2"
HOST = "host-1"
BOOT = "boot-1"
MAX_I64 = 2**63 - 1


def lp(pid: int, start: str, host: str = HOST, boot: str = BOOT) -> LocalProcess:
    return LocalProcess(host_id=host, boot_id=boot, pid=pid, process_start=start)


A = LeaseOwnerIdentity(owner_id="owner-A", incarnation_id="inc-A1")
B = LeaseOwnerIdentity(owner_id="owner-B", incarnation_id="inc-B1")
A_LP = LeaseOwnerIdentity(owner_id="owner-A", incarnation_id="inc-A1", liveness=lp(4101, "5001"))
B_LP = LeaseOwnerIdentity(owner_id="owner-B", incarnation_id="inc-B1", liveness=lp(4102, "5002"))


class Probe:
    """An injected process probe with a fixed answer that records its calls."""

    def __init__(self, answer: str) -> None:
        self.answer = answer
        self.calls: list[tuple[int, str]] = []

    def __call__(self, pid: int, start: str) -> Any:
        self.calls.append((pid, start))
        return self.answer


def no_probe(pid: int, start: str) -> Any:
    raise AssertionError(f"the probe must not be consulted (pid {pid}, start {start})")


def claim(store: Store, owner: LeaseOwnerIdentity, ttl: int, sid: str = SID) -> AcquireOutcome:
    return store.leases.try_claim_session_execution_lease(sid, owner, ttl)


def acquired(outcome: AcquireOutcome) -> SessionExecutionLease:
    assert isinstance(outcome, Acquired), outcome
    return outcome.lease


def hold_generation(
    store: Store, clock: SettableClock, owner: LeaseOwnerIdentity, *, at: int, ttl: int, gen: int
) -> SessionExecutionLease:
    """Make ``owner`` hold SID with generation ``gen`` (acquire/release ``gen - 1`` times first)."""
    clock.set(at)
    for _ in range(gen - 1):
        store.leases.release_session_execution_lease(acquired(claim(store, owner, ttl)))
    lease = acquired(claim(store, owner, ttl))
    assert lease.fencing_token == gen
    return lease


def lease(
    owner: LeaseOwnerIdentity, fencing: int, claimed: int, expires: int, sid: str = SID
) -> SessionExecutionLease:
    """The lease the §2.5.1 format predicts for an acquisition at ``claimed``."""
    return SessionExecutionLease(
        session_id=sid,
        owner=owner,
        lease_token=f"{sid}:{owner.owner_id}:{owner.incarnation_id}:{claimed}:{fencing}",
        fencing_token=fencing,
        claimed_at_epoch_ms=claimed,
        expires_at_epoch_ms=expires,
    )


def fence_of(x: SessionExecutionLease, **update: Any) -> LeaseFence:
    data = {
        "session_id": x.session_id,
        "owner": x.owner,
        "lease_token": x.lease_token,
        "fencing_token": x.fencing_token,
    }
    data.update(update)
    return LeaseFence(**data)


def ensure_ok(store: Store, fence: LeaseFence) -> bool:
    try:
        store.leases.ensure_session_execution_lease(fence)
    except SessionExecutionLeaseExpired:
        return False
    return True


def expect_row(row: dict[str, Any] | None, x: SessionExecutionLease) -> None:
    """The raw row holds exactly the lease ``x``."""
    assert row is not None
    assert json.loads(row.pop("lease_owner_liveness_json")) == x.owner.liveness.model_dump()
    assert row == {
        "session_id": x.session_id,
        "lease_owner_id": x.owner.owner_id,
        "lease_owner_incarnation_id": x.owner.incarnation_id,
        "lease_token": x.lease_token,
        "lease_fencing_token": x.fencing_token,
        "lease_claimed_at_ms": x.claimed_at_epoch_ms,
        "lease_expires_at_ms": x.expires_at_epoch_ms,
    }


def released_row(fencing: int, sid: str = SID) -> dict[str, Any]:
    return {
        "session_id": sid,
        "lease_owner_id": None,
        "lease_owner_incarnation_id": None,
        "lease_owner_liveness_json": None,
        "lease_token": None,
        "lease_fencing_token": fencing,
        "lease_claimed_at_ms": 0,
        "lease_expires_at_ms": 0,
    }


# --------------------------------------------------------------------------
# try_claim (§2.5.1, §2.5.2)


def test_l_01_first_claim_acquires_generation_one(store: Store, clock: SettableClock) -> None:
    """No row, t=1000 → Acquired, fencing 1, token "s:A.id:A.inc:1000:1", claimed 1000, expires
    1100.
    """
    clock.set(1000)
    out = claim(store, A, 100)
    expected = SessionExecutionLease(
        session_id="sess-1",
        owner=A,
        lease_token="sess-1:owner-A:inc-A1:1000:1",
        fencing_token=1,
        claimed_at_epoch_ms=1000,
        expires_at_epoch_ms=1100,
    )
    assert out == Acquired(lease=expected)
    expect_row(lease_row(store, SID), expected)
    assert json.loads(lease_row(store, SID)["lease_owner_liveness_json"]) == {"kind": "opaque"}
    assert store.leases.get_session_execution_lease(SID) == expected
    assert ensure_ok(store, expected)


def test_l_02_other_owner_gets_busy_and_row_unchanged(store: Store, clock: SettableClock) -> None:
    """A holds (expires 1100), t=1050 → try_claim(B) → Busy{holder=A, fencing 1, expires 1100}."""
    a = hold_generation(store, clock, A, at=1000, ttl=100, gen=1)
    clock.set(1050)
    before = lease_rows(store)
    out = claim(store, B, 100)
    assert out == Busy(holder=lease(A, 1, 1000, 1100))
    assert out.holder == a
    assert lease_rows(store) == before


def test_l_03_holder_extension_may_shrink_the_expiry(store: Store, clock: SettableClock) -> None:
    """A holds (expires 1100), t=1050 → try_claim(A, 10) → same token/fencing, claimed 1000, expires
    1060.
    """
    a = hold_generation(store, clock, A, at=1000, ttl=100, gen=1)
    clock.set(1050)
    out = acquired(claim(store, A, 10))
    assert out == lease(A, 1, 1000, 1060)
    assert out.lease_token == a.lease_token
    expect_row(lease_row(store, SID), out)
    clock.set(1060)
    assert not ensure_ok(store, out)  # the shrunk expiry is the one in force


def test_l_04_same_owner_id_other_incarnation_is_busy(store: Store, clock: SettableClock) -> None:
    """A holds; B with A's owner_id but another incarnation → try_claim(B) → Busy; row unchanged."""
    a = hold_generation(store, clock, A, at=1000, ttl=100, gen=1)
    twin = LeaseOwnerIdentity(owner_id=A.owner_id, incarnation_id="inc-A2")
    clock.set(1050)
    before = lease_rows(store)
    assert claim(store, twin, 100) == Busy(holder=a)
    assert lease_rows(store) == before


def test_l_05_expiry_boundary_is_strict(store: Store, clock: SettableClock) -> None:
    """A holds with expires 1100; t=1099 → Busy; t=1100 (equal) → try_claim(B) → Acquired, fencing
    2.
    """
    a = hold_generation(store, clock, A, at=1000, ttl=100, gen=1)
    clock.set(1099)
    assert claim(store, B, 100) == Busy(holder=a)
    clock.set(1100)
    out = acquired(claim(store, B, 100))
    assert out == lease(B, 2, 1100, 1200)
    expect_row(lease_row(store, SID), out)
    assert not ensure_ok(store, a)


def test_l_06_released_lease_reacquired_with_next_generation(
    store: Store, clock: SettableClock
) -> None:
    """A released (token NULL, fencing 1) → try_claim(A) → Acquired, fencing 2, a new token."""
    a = hold_generation(store, clock, A, at=1000, ttl=100, gen=1)
    store.leases.release_session_execution_lease(a)
    assert lease_row(store, SID) == released_row(1)
    out = acquired(claim(store, A, 100))
    assert out == lease(A, 2, 1000, 1100)
    assert out.lease_token != a.lease_token
    expect_row(lease_row(store, SID), out)


# --------------------------------------------------------------------------
# renew (§2.5.4)


def test_l_07_renew_moves_expiry_only(store: Store, clock: SettableClock) -> None:
    """A holds with fencing 5, t < expiry → renew(A's fence, ttl) → expiry t + ttl; token, fencing
    kept.
    """
    a = hold_generation(store, clock, A, at=1000, ttl=100, gen=5)
    clock.set(1090)
    out = store.leases.renew_session_execution_lease(fence_of(a), 500)
    assert out == lease(A, 5, 1000, 1590)
    assert (out.lease_token, out.fencing_token) == (a.lease_token, a.fencing_token)
    expect_row(lease_row(store, SID), out)
    # renewing may shorten the lease too
    clock.set(1100)
    assert store.leases.renew_session_execution_lease(a, 1).expires_at_epoch_ms == 1101
    assert lease_row(store, SID)["lease_expires_at_ms"] == 1101


@pytest.mark.parametrize("wrong", ["token", "fencing", "incarnation"])
def test_l_08_renew_with_wrong_fence_is_expired(
    store: Store, clock: SettableClock, wrong: str
) -> None:
    """A holds → renew with a wrong token, fencing or incarnation → SessionExecutionLeaseExpired;
    row unchanged.
    """
    a = hold_generation(store, clock, A, at=1000, ttl=100, gen=3)
    bad = {
        "token": fence_of(a, lease_token=a.lease_token + "x"),
        "fencing": fence_of(a, fencing_token=2),
        "incarnation": fence_of(
            a, owner=LeaseOwnerIdentity(owner_id=A.owner_id, incarnation_id="inc-A2")
        ),
    }[wrong]
    clock.set(1050)
    before = lease_rows(store)
    with pytest.raises(SessionExecutionLeaseExpired) as err:
        store.leases.renew_session_execution_lease(bad, 500)
    assert err.value.session_id == SID
    assert lease_rows(store) == before


def test_l_09_expired_lease_cannot_be_renewed(store: Store, clock: SettableClock) -> None:
    """A's lease expired at 1100, nobody took it, t=1200 → renew(A's fence) →
    SessionExecutionLeaseExpired.
    """
    a = hold_generation(store, clock, A, at=1000, ttl=100, gen=1)
    clock.set(1200)
    before = lease_rows(store)
    with pytest.raises(SessionExecutionLeaseExpired):
        store.leases.renew_session_execution_lease(a, 100)
    assert lease_rows(store) == before
    # the holder must try_claim instead, and gets a new generation
    assert acquired(claim(store, A, 100)).fencing_token == 2


def test_l_10_renew_without_row_is_expired(store: Store, clock: SettableClock) -> None:
    """No row → renew(fence) → SessionExecutionLeaseExpired; no row is created."""
    clock.set(1000)
    with pytest.raises(SessionExecutionLeaseExpired):
        store.leases.renew_session_execution_lease(lease(A, 1, 1000, 1100), 100)
    assert lease_rows(store) == []


# --------------------------------------------------------------------------
# release (§2.5.5)


def test_l_11_release_clears_but_keeps_generation(store: Store, clock: SettableClock) -> None:
    """A holds, fencing 3 → release(A's completion) → owner/token/liveness NULL, 0/0, fencing 3."""
    a = hold_generation(store, clock, A, at=1000, ttl=100, gen=3)
    store.leases.release_session_execution_lease(fence_of(a))
    assert lease_row(store, SID) == released_row(3)
    assert store.leases.get_session_execution_lease(SID) is None
    assert not ensure_ok(store, a)


def test_l_12_release_after_takeover_is_a_silent_no_op(store: Store, clock: SettableClock) -> None:
    """A's lease taken over by B (fencing 4) → release(A's old completion) → no change; B still
    holds.
    """
    a = hold_generation(store, clock, A, at=1000, ttl=100, gen=3)
    clock.set(1100)
    b = acquired(claim(store, B, 100))
    assert b.fencing_token == 4
    before = lease_rows(store)
    assert store.leases.release_session_execution_lease(a) is None
    assert lease_rows(store) == before
    assert ensure_ok(store, b)
    assert store.leases.get_session_execution_lease(SID) == b


def test_l_13_release_of_expired_lease_clears_it(store: Store, clock: SettableClock) -> None:
    """A's lease expired, not taken over → release(A's completion) → cleared (no expiry check)."""
    a = hold_generation(store, clock, A, at=1000, ttl=100, gen=2)
    clock.set(5000)
    store.leases.release_session_execution_lease(a)
    assert lease_row(store, SID) == released_row(2)
    assert acquired(claim(store, B, 100)).fencing_token == 3


# --------------------------------------------------------------------------
# reclaim (§2.5.3, §4.14)


def test_l_14_reclaim_without_row_acquires(store: Store, clock: SettableClock) -> None:
    """No row → reclaim(s, B, observed=anything) → Acquired, fencing 1 (observed ignored)."""
    clock.set(1000)
    garbage = LeaseFence(
        session_id=OTHER_SID, owner=A, lease_token="no-such-token", fencing_token=77
    )
    out = store.leases.reclaim_session_execution_lease(SID, B_LP, garbage, 100, probe=no_probe)
    assert out == Acquired(lease=lease(B_LP, 1, 1000, 1100))
    expect_row(lease_row(store, SID), out.lease)


def test_l_15_reclaim_of_expired_lease_ignores_observed(store: Store, clock: SettableClock) -> None:
    """A expired (fencing 2) → reclaim(s, B, observed=stale garbage) → Acquired, fencing 3."""
    hold_generation(store, clock, A, at=1000, ttl=100, gen=2)
    clock.set(1100)
    garbage = LeaseFence(session_id=SID, owner=B, lease_token="stale", fencing_token=1)
    out = store.leases.reclaim_session_execution_lease(SID, B_LP, garbage, 100, probe=no_probe)
    assert out == Acquired(lease=lease(B_LP, 3, 1100, 1200))
    expect_row(lease_row(store, SID), out.lease)


def test_l_16_reclaim_from_gone_local_process(store: Store, clock: SettableClock) -> None:
    """A (LocalProcess, same host/boot as B) holds, its pid has no procfs entry → reclaim → B,
    fencing+1.
    """
    a = hold_generation(store, clock, A_LP, at=1000, ttl=100, gen=2)
    clock.set(1040)
    probe = Probe("gone")
    out = store.leases.reclaim_session_execution_lease(SID, B_LP, a, 300, probe=probe)
    assert out == Acquired(lease=lease(B_LP, 3, 1040, 1340))
    assert out.lease.lease_token != a.lease_token
    assert probe.calls == [(4101, "5001")]  # the stored holder's pid and start time
    expect_row(lease_row(store, SID), out.lease)
    assert not ensure_ok(store, a)
    assert ensure_ok(store, out.lease)


def test_l_17_reclaim_when_pid_was_reused(store: Store, clock: SettableClock) -> None:
    """As L-16, but A's pid exists with another start time (pid reused) → Acquired.

    The injected probe answers from a fake process table in which A's pid runs
    a process that started at another time.
    """
    a = hold_generation(store, clock, A_LP, at=1000, ttl=100, gen=1)
    processes = {4101: "9999"}  # pid 4101 now belongs to a younger process
    calls: list[tuple[int, str]] = []

    def table_probe(pid: int, start: str) -> Any:
        calls.append((pid, start))
        if pid not in processes:
            return "gone"
        return "alive" if processes[pid] == start else "gone"

    clock.set(1050)
    out = store.leases.reclaim_session_execution_lease(SID, B_LP, a, 100, probe=table_probe)
    assert out == Acquired(lease=lease(B_LP, 2, 1050, 1150))
    assert calls == [(4101, "5001")]
    expect_row(lease_row(store, SID), out.lease)


def test_l_17_pid_reused_with_the_real_procfs_probe(store: Store, clock: SettableClock) -> None:
    """L-17 end to end on this host: A names our own pid with another start time → Acquired."""
    me = capture_liveness()
    assert isinstance(me, LocalProcess)
    ghost = LeaseOwnerIdentity(
        owner_id="owner-A",
        incarnation_id="inc-A1",
        liveness=me.model_copy(update={"process_start": str(int(me.process_start) + 1)}),
    )
    claimant = LeaseOwnerIdentity(owner_id="owner-B", incarnation_id="inc-B1", liveness=me)
    a = hold_generation(store, clock, ghost, at=1000, ttl=100, gen=1)
    out = store.leases.reclaim_session_execution_lease(SID, claimant, a, 100)
    assert out == Acquired(lease=lease(claimant, 2, 1000, 1100))


def test_l_18_opaque_holder_is_never_taken_over(store: Store, clock: SettableClock) -> None:
    """As L-16, but A's liveness is Opaque → Busy (even if the probe says gone); row unchanged."""
    a = hold_generation(store, clock, A, at=1000, ttl=100, gen=1)
    clock.set(1050)
    before = lease_rows(store)
    probe = Probe("gone")
    out = store.leases.reclaim_session_execution_lease(SID, B_LP, a, 100, probe=probe)
    assert out == Busy(holder=a)
    assert probe.calls == []
    assert lease_rows(store) == before


@pytest.mark.parametrize("differs", ["boot_id", "host_id"])
def test_l_19_other_host_or_boot_is_busy(store: Store, clock: SettableClock, differs: str) -> None:
    """As L-16, but B runs on another boot or host → Busy; row unchanged."""
    a = hold_generation(store, clock, A_LP, at=1000, ttl=100, gen=1)
    elsewhere = B_LP.model_copy(
        update={"liveness": B_LP.liveness.model_copy(update={differs: "elsewhere"})}
    )
    clock.set(1050)
    before = lease_rows(store)
    out = store.leases.reclaim_session_execution_lease(SID, elsewhere, a, 100, probe=Probe("gone"))
    assert out == Busy(holder=a)
    assert lease_rows(store) == before


def test_l_20_observed_generation_one_behind_is_busy(store: Store, clock: SettableClock) -> None:
    """As L-16, but observed.fencing_token is one behind the current one → Busy; row unchanged."""
    a = hold_generation(store, clock, A_LP, at=1000, ttl=100, gen=2)
    clock.set(1050)
    before = lease_rows(store)
    stale = fence_of(a, fencing_token=1)
    out = store.leases.reclaim_session_execution_lease(SID, B_LP, stale, 100, probe=Probe("gone"))
    assert out == Busy(holder=a)
    assert lease_rows(store) == before


def test_l_21_observed_fence_of_another_session_is_busy(store: Store, clock: SettableClock) -> None:
    """As L-16, but observed.session_id names another session → Busy; row unchanged."""
    a = hold_generation(store, clock, A_LP, at=1000, ttl=100, gen=1)
    clock.set(1050)
    before = lease_rows(store)
    other = fence_of(a, session_id=OTHER_SID)
    out = store.leases.reclaim_session_execution_lease(SID, B_LP, other, 100, probe=Probe("gone"))
    assert out == Busy(holder=a)
    assert lease_rows(store) == before


def test_l_22_reclaiming_own_live_lease_is_busy(store: Store, clock: SettableClock) -> None:
    """A holds and is alive → reclaim(s, A, observed=A's fence) → Busy{holder=A}; row unchanged."""
    a = hold_generation(store, clock, A_LP, at=1000, ttl=100, gen=1)
    clock.set(1050)
    before = lease_rows(store)
    probe = Probe("alive")
    assert store.leases.reclaim_session_execution_lease(SID, A_LP, a, 100, probe=probe) == Busy(
        holder=a
    )
    assert probe.calls == [(4101, "5001")]
    assert lease_rows(store) == before


def test_l_22_own_live_lease_with_the_real_procfs_probe(store: Store, clock: SettableClock) -> None:
    """L-22 end to end: A is this very process (captured liveness) → reclaim by A → Busy."""
    me = LeaseOwnerIdentity(
        owner_id="owner-A", incarnation_id="inc-A1", liveness=capture_liveness()
    )
    assert isinstance(me.liveness, LocalProcess)
    a = hold_generation(store, clock, me, at=1000, ttl=100, gen=1)
    before = lease_rows(store)
    assert store.leases.reclaim_session_execution_lease(SID, me, a, 100) == Busy(holder=a)
    assert lease_rows(store) == before


@pytest.mark.parametrize("corrupt", ["{not json", '{"kind":"martian"}', "[]", '"opaque"'])
def test_l_23_corrupt_stored_liveness_is_opaque(
    store: Store, clock: SettableClock, corrupt: str
) -> None:
    """A's stored lease_owner_liveness_json is corrupt → reclaim with A's exact fence → Busy.

    The spec (§0.2, L-23) reads undecodable liveness as Opaque silently; this
    is the one place where decision 4 ("corrupt data fails loudly") does not
    raise: the safe reading (never taken over early) is kept.
    """
    a = hold_generation(store, clock, A_LP, at=1000, ttl=100, gen=1)
    execute_sql(
        store,
        "UPDATE session_execution_leases SET lease_owner_liveness_json = :j WHERE session_id = :s",
        j=corrupt,
        s=SID,
    )
    clock.set(1050)
    before = lease_rows(store)
    probe = Probe("gone")
    out = store.leases.reclaim_session_execution_lease(SID, B_LP, a, 100, probe=probe)
    assert isinstance(out, Busy)
    assert out.holder == a.model_copy(update={"owner": A})  # A with Opaque liveness
    assert out.holder.owner.liveness == Opaque()
    assert probe.calls == []
    assert lease_rows(store) == before


def _insert_null_incarnation_row(store: Store) -> None:
    execute_sql(
        store,
        "INSERT INTO session_execution_leases (session_id, lease_owner_id, "
        "lease_owner_incarnation_id, lease_owner_liveness_json, lease_token, "
        "lease_fencing_token, lease_claimed_at_ms, lease_expires_at_ms) "
        "VALUES (:s, 'x', NULL, NULL, 'tok-x', 7, 1000, 2000)",
        s=SID,
    )


def test_l_24_null_incarnation_defaults_to_owner_id(store: Store, clock: SettableClock) -> None:
    """Row with incarnation NULL, owner "x" → try_claim(s, {x, x}) while live → extension."""
    _insert_null_incarnation_row(store)
    clock.set(1500)
    x = LeaseOwnerIdentity(owner_id="x", incarnation_id="x")
    held = SessionExecutionLease(
        session_id=SID,
        owner=x,
        lease_token="tok-x",
        fencing_token=7,
        claimed_at_epoch_ms=1000,
        expires_at_epoch_ms=2000,
    )
    assert store.leases.get_session_execution_lease(SID) == held
    # another incarnation of "x" is someone else
    other = LeaseOwnerIdentity(owner_id="x", incarnation_id="y")
    assert claim(store, other, 100) == Busy(holder=held)
    out = claim(store, x, 100)
    assert out == Acquired(lease=held.model_copy(update={"expires_at_epoch_ms": 1600}))
    row = lease_row(store, SID)
    assert row is not None
    assert row["lease_owner_incarnation_id"] is None  # extension only moves the expiry
    assert (row["lease_token"], row["lease_fencing_token"], row["lease_expires_at_ms"]) == (
        "tok-x",
        7,
        1600,
    )


def test_l_24_null_incarnation_fence_renews_and_releases(
    store: Store, clock: SettableClock
) -> None:
    """L-24 continued: the fence {x, x} passes FENCE_OK, renews and releases the NULL-incarnation
    row.
    """
    _insert_null_incarnation_row(store)
    clock.set(1500)
    x = LeaseOwnerIdentity(owner_id="x", incarnation_id="x")
    fence = LeaseFence(session_id=SID, owner=x, lease_token="tok-x", fencing_token=7)
    assert ensure_ok(store, fence)
    assert store.leases.renew_session_execution_lease(fence, 300).expires_at_epoch_ms == 1800
    assert lease_row(store, SID)["lease_expires_at_ms"] == 1800
    store.leases.release_session_execution_lease(fence)
    assert lease_row(store, SID) == released_row(7)


def test_l_27_zero_ttl_acquires_a_lease_that_is_not_live(
    store: Store, clock: SettableClock
) -> None:
    """try_claim with ttl=0 → Acquired but not live: ensure/renew → Expired; another owner →
    fencing+1.
    """
    clock.set(1000)
    a = acquired(claim(store, A, 0))
    assert a == lease(A, 1, 1000, 1000)
    expect_row(lease_row(store, SID), a)
    assert store.leases.get_session_execution_lease(SID) == a  # stored, though not live
    with pytest.raises(SessionExecutionLeaseExpired):
        store.leases.ensure_session_execution_lease(a)
    with pytest.raises(SessionExecutionLeaseExpired):
        store.leases.renew_session_execution_lease(a, 100)
    assert acquired(claim(store, B, 100)) == lease(B, 2, 1000, 1100)


# --------------------------------------------------------------------------
# I-2 at the expiry instant, and saturation


def test_i_2_one_live_holder_across_the_expiry_instant(store: Store, clock: SettableClock) -> None:
    """I-2: before expiry only A passes FENCE_OK and B is Busy; at expiry B acquires and only B
    passes.
    """
    a = hold_generation(store, clock, A, at=1000, ttl=100, gen=1)
    clock.set(1099)
    assert ensure_ok(store, a)
    assert isinstance(claim(store, B, 100), Busy)
    clock.set(1100)
    assert not ensure_ok(store, a)
    b = acquired(claim(store, B, 100))
    assert [ensure_ok(store, f) for f in (a, b)] == [False, True]
    # A's try_claim while B is live is Busy; A's old fence cannot renew or release B's lease
    assert claim(store, A, 100) == Busy(holder=b)
    with pytest.raises(SessionExecutionLeaseExpired):
        store.leases.renew_session_execution_lease(a, 100)
    store.leases.release_session_execution_lease(a)
    assert [ensure_ok(store, f) for f in (a, b)] == [False, True]


def test_expiry_saturates_at_max_i64(store: Store, clock: SettableClock) -> None:
    """``now + ttl`` saturates at 2**63-1 (§0.2) instead of failing or wrapping."""
    clock.set(1000)
    a = acquired(claim(store, A, MAX_I64))
    assert a.expires_at_epoch_ms == MAX_I64
    assert lease_row(store, SID)["lease_expires_at_ms"] == MAX_I64
    assert store.leases.renew_session_execution_lease(a, MAX_I64).expires_at_epoch_ms == MAX_I64


def test_generation_saturates_at_max_i64(store: Store, clock: SettableClock) -> None:
    """A released row at generation 2**63-1: the next acquisition stays at 2**63-1 (saturating)."""
    execute_sql(
        store,
        "INSERT INTO session_execution_leases (session_id, lease_fencing_token) VALUES (:s, :g)",
        s=SID,
        g=MAX_I64,
    )
    clock.set(1000)
    a = acquired(claim(store, A, 100))
    assert a.fencing_token == MAX_I64
    assert lease_row(store, SID)["lease_fencing_token"] == MAX_I64


def test_sessions_are_independent(store: Store, clock: SettableClock) -> None:
    """Each session has its own lease and generation: claiming one leaves the other's row alone."""
    a = hold_generation(store, clock, A, at=1000, ttl=100, gen=2)
    b = acquired(claim(store, B, 100, sid=OTHER_SID))
    assert b == lease(B, 1, 1000, 1100, sid=OTHER_SID)
    assert lease_row(store, SID) is not None
    expect_row(lease_row(store, SID), a)
    with pytest.raises(SessionExecutionLeaseExpired):  # a fence of one session does not fit another
        store.leases.renew_session_execution_lease(fence_of(a, session_id=OTHER_SID), 100)


@pytest.mark.parametrize(
    "case,column",
    [("live_without_owner", "lease_owner_id"), ("negative_generation", "lease_fencing_token")],
)
def test_corrupt_lease_row_fails_loudly(
    store: Store, clock: SettableClock, case: str, column: str
) -> None:
    """A live row without owner (§2.5.2 "live session lease missing owner") or a negative
    generation → SessionCorrupt naming table, key and column, for every operation; row unchanged.

    The spec's ``Backend`` error becomes SessionCorrupt (decision 4).
    """
    owner_sql = "NULL" if case == "live_without_owner" else "'owner-A'"
    fencing = 3 if case == "live_without_owner" else -5
    execute_sql(
        store,
        "INSERT INTO session_execution_leases (session_id, lease_owner_id, "
        "lease_owner_incarnation_id, lease_token, lease_fencing_token, lease_claimed_at_ms, "
        f"lease_expires_at_ms) VALUES (:s, {owner_sql}, 'inc-A1', 'tok', :g, 1000, 2000)",
        s=SID,
        g=fencing,
    )
    clock.set(1500)
    before = lease_rows(store)
    fence = LeaseFence(session_id=SID, owner=A, lease_token="tok", fencing_token=3)
    calls: list[Callable[[], object]] = [
        lambda: claim(store, B, 100),
        lambda: store.leases.reclaim_session_execution_lease(
            SID, B_LP, fence, 100, probe=Probe("gone")
        ),
        lambda: store.leases.get_session_execution_lease(SID),
    ]
    if case == "negative_generation":
        calls.append(lambda: store.leases.renew_session_execution_lease(fence, 100))
        calls.append(lambda: store.leases.ensure_session_execution_lease(fence))
    for call in calls:
        with pytest.raises(SessionCorrupt) as err:
            call()
        assert (err.value.table, err.value.key, err.value.column) == (
            "session_execution_leases",
            SID,
            column,
        )
    assert lease_rows(store) == before


# --------------------------------------------------------------------------
# ensure_session_execution_lease (FENCE_OK, §0.4): a pure read


def test_ensure_is_read_only_and_never_extends(store: Store, clock: SettableClock) -> None:
    """ensure works in store.read(), writes nothing, ignores liveness, and stops at expires
    (strict).
    """
    a = hold_generation(store, clock, A_LP, at=1000, ttl=100, gen=2)
    before = lease_rows(store)
    clock.set(1099)
    with store.read() as uow:
        uow.leases.ensure_session_execution_lease(a)
        # liveness is not part of the identity check
        uow.leases.ensure_session_execution_lease(fence_of(a, owner=A))
    store.leases.ensure_session_execution_lease(a)
    assert lease_rows(store) == before
    clock.set(1100)
    with pytest.raises(SessionExecutionLeaseExpired), store.read() as uow:
        uow.leases.ensure_session_execution_lease(a)
    assert lease_rows(store) == before


@pytest.mark.parametrize(
    "case", ["other_session", "no_row", "incarnation", "owner_id", "token", "fencing", "released"]
)
def test_ensure_refuses_every_mismatch(store: Store, clock: SettableClock, case: str) -> None:
    """FENCE_OK: other session, no row, other incarnation/owner/token/generation, released →
    Expired.
    """
    a = hold_generation(store, clock, A, at=1000, ttl=100, gen=2)
    fences: dict[str, Callable[[], LeaseFence]] = {
        "other_session": lambda: fence_of(a, session_id=OTHER_SID),
        "no_row": lambda: fence_of(a, session_id="sess-none"),
        "incarnation": lambda: fence_of(
            a, owner=LeaseOwnerIdentity(owner_id=A.owner_id, incarnation_id="inc-A9")
        ),
        "owner_id": lambda: fence_of(
            a, owner=LeaseOwnerIdentity(owner_id="owner-Z", incarnation_id=A.incarnation_id)
        ),
        "token": lambda: fence_of(a, lease_token="sess-1:owner-A:inc-A1:1000:3"),
        "fencing": lambda: fence_of(a, fencing_token=3),
        "released": lambda: a,
    }
    if case == "other_session":  # B holds the other session: a's fence must still not fit it
        claim(store, B, 100, sid=OTHER_SID)
    if case == "released":
        store.leases.release_session_execution_lease(a)
    fence = fences[case]()
    clock.set(1050)
    before = lease_rows(store)
    with pytest.raises(SessionExecutionLeaseExpired) as err, store.read() as uow:
        uow.leases.ensure_session_execution_lease(fence)
    assert err.value.session_id == fence.session_id
    with pytest.raises(SessionExecutionLeaseExpired):
        store.leases.ensure_session_execution_lease(fence)
    assert lease_rows(store) == before


# --------------------------------------------------------------------------
# Bad input → InvalidInput, nothing written; writes inside store.read()


BAD_IDS = ["", "   ", "\t\n", "a\x00b"]
BAD_TTLS: list[Any] = [-1, 2**63, 1.5, "100", None, True]
BAD_OWNERS: list[Any] = [
    {"owner_id": "owner-B", "incarnation_id": "inc-B1"},
    "owner-B",
    None,
    LeaseOwnerIdentity(owner_id="", incarnation_id="inc-B1"),
    LeaseOwnerIdentity(owner_id="   ", incarnation_id="inc-B1"),
    LeaseOwnerIdentity(owner_id="owner-B", incarnation_id=" "),
]


def _bad_calls() -> list[tuple[str, Callable[[Store, SessionExecutionLease], object], str]]:
    """(label, call, the refused field) for every refused argument of every lease write."""
    calls: list[tuple[str, Callable[[Store, SessionExecutionLease], object], str]] = []
    for sid in BAD_IDS:
        calls.append(
            (
                f"try_claim sid={sid!r}",
                lambda s, a, sid=sid: s.leases.try_claim_session_execution_lease(sid, A, 100),
                "session_id",
            )
        )
        calls.append(
            (
                f"reclaim sid={sid!r}",
                lambda s, a, sid=sid: s.leases.reclaim_session_execution_lease(
                    sid, B_LP, a, 100, probe=Probe("gone")
                ),
                "session_id",
            )
        )
        calls.append(
            (
                f"renew fence.session_id={sid!r}",
                lambda s, a, sid=sid: s.leases.renew_session_execution_lease(
                    fence_of(a, session_id=sid), 100
                ),
                "fence.session_id",
            )
        )
        calls.append(
            (
                f"release completion.session_id={sid!r}",
                lambda s, a, sid=sid: s.leases.release_session_execution_lease(
                    fence_of(a, session_id=sid)
                ),
                "completion.session_id",
            )
        )
    for ttl in BAD_TTLS:
        calls.append(
            (
                f"try_claim ttl={ttl!r}",
                lambda s, a, ttl=ttl: s.leases.try_claim_session_execution_lease(SID, A, ttl),
                "ttl_ms",
            )
        )
        calls.append(
            (
                f"reclaim ttl={ttl!r}",
                lambda s, a, ttl=ttl: s.leases.reclaim_session_execution_lease(
                    SID, B_LP, a, ttl, probe=Probe("gone")
                ),
                "ttl_ms",
            )
        )
        calls.append(
            (
                f"renew ttl={ttl!r}",
                lambda s, a, ttl=ttl: s.leases.renew_session_execution_lease(a, ttl),
                "ttl_ms",
            )
        )
    for i, owner in enumerate(BAD_OWNERS):
        fld = "owner" if not isinstance(owner, LeaseOwnerIdentity) else "owner."
        calls.append(
            (
                f"try_claim owner#{i}",
                lambda s, a, o=owner: s.leases.try_claim_session_execution_lease(SID, o, 100),
                fld,
            )
        )
        calls.append(
            (
                f"reclaim owner#{i}",
                lambda s, a, o=owner: s.leases.reclaim_session_execution_lease(
                    SID, o, a, 100, probe=Probe("gone")
                ),
                fld,
            )
        )
    for bad in [None, "fence", {"session_id": SID}]:
        calls.append(
            (
                f"reclaim observed={bad!r}",
                lambda s, a, bad=bad: s.leases.reclaim_session_execution_lease(
                    SID, B_LP, bad, 100, probe=Probe("gone")
                ),
                "observed_holder",
            )
        )
        calls.append(
            (
                f"renew fence={bad!r}",
                lambda s, a, bad=bad: s.leases.renew_session_execution_lease(bad, 100),
                "fence",
            )
        )
        calls.append(
            (
                f"release completion={bad!r}",
                lambda s, a, bad=bad: s.leases.release_session_execution_lease(bad),
                "completion",
            )
        )
    return calls


BAD_CALLS = _bad_calls()


@pytest.mark.parametrize("label,call,fld", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_input_is_refused_and_nothing_written(
    store: Store,
    clock: SettableClock,
    label: str,
    call: Callable[[Store, SessionExecutionLease], object],
    fld: str,
) -> None:
    """Blank ids, bad ttl (not an int in 0..2**63-1), bad owner or fence → InvalidInput.

    A (LocalProcess) holds the session, so every refused call would otherwise
    write (extend, take over with a probe saying "gone", renew, release).
    """
    a = hold_generation(store, clock, A_LP, at=1000, ttl=100, gen=2)
    clock.set(1050)
    before = lease_rows(store)
    with pytest.raises(InvalidInput) as err:
        call(store, a)
    assert err.value.field.startswith(fld), (label, err.value.field)
    assert lease_rows(store) == before


WRITES: dict[str, Callable[[Any, SessionExecutionLease], object]] = {
    "try_claim_self": lambda r, a: r.leases.try_claim_session_execution_lease(SID, A_LP, 500),
    "reclaim": lambda r, a: r.leases.reclaim_session_execution_lease(
        SID, B_LP, a, 100, probe=Probe("gone")
    ),
    "renew": lambda r, a: r.leases.renew_session_execution_lease(a, 500),
    "release": lambda r, a: r.leases.release_session_execution_lease(a),
    "try_claim_new_session": lambda r, a: r.leases.try_claim_session_execution_lease(
        OTHER_SID, B, 100
    ),
}


@pytest.mark.parametrize("op", list(WRITES))
def test_writes_inside_read_unit_are_refused(store: Store, clock: SettableClock, op: str) -> None:
    """Every lease write inside store.read() → ReadOnlyUnitOfWork; nothing written."""
    a = hold_generation(store, clock, A_LP, at=1000, ttl=100, gen=1)
    clock.set(1050)
    before = lease_rows(store)
    with pytest.raises(ReadOnlyUnitOfWork), store.read() as uow:
        WRITES[op](uow, a)
    with pytest.raises(ReadOnlyUnitOfWork):
        store.call_read(lambda r: WRITES[op](r, a))
    assert lease_rows(store) == before
    # the same call in a write unit does write
    with store.write() as uow:
        WRITES[op](uow, a)
    assert lease_rows(store) != before


def test_reads_work_inside_read_unit(store: Store, clock: SettableClock) -> None:
    """get/ensure run in store.read() and see the lease; get of an unknown session is None."""
    a = hold_generation(store, clock, A, at=1000, ttl=100, gen=1)
    with store.read() as uow:
        assert uow.leases.get_session_execution_lease(SID) == a
        assert uow.leases.get_session_execution_lease("sess-none") is None
        uow.leases.ensure_session_execution_lease(a)


# --------------------------------------------------------------------------
# I-1 / I-2 property test against a model


M_OWNERS = [
    LeaseOwnerIdentity(owner_id="m-A", incarnation_id="i-1", liveness=lp(5001, "s1")),
    LeaseOwnerIdentity(owner_id="m-B", incarnation_id="i-1", liveness=lp(5002, "s2")),
    # same owner id as the first, another incarnation: a different owner for the lease
    LeaseOwnerIdentity(owner_id="m-A", incarnation_id="i-2", liveness=lp(5003, "s3")),
]
TTLS = st.sampled_from([0, 1, 50, 100, 200, 1000])
OWNER = st.integers(0, len(M_OWNERS) - 1)
PICK = st.integers(0, 63)
model_op = st.one_of(
    st.tuples(st.just("advance"), st.sampled_from([0, 1, 30, 99, 100, 101, 250])),
    st.tuples(st.just("claim"), OWNER, TTLS),
    st.tuples(
        st.just("reclaim"), OWNER, st.sampled_from(["holder", "holder", "own", "stale"]), PICK, TTLS
    ),
    st.tuples(st.just("renew"), OWNER, st.sampled_from(["own", "stale"]), PICK, TTLS),
    st.tuples(st.just("release"), OWNER, st.sampled_from(["own", "stale"]), PICK),
    st.tuples(st.just("liveness"), OWNER, st.sampled_from(["gone", "gone", "alive", "unknown"])),
)


@dataclass
class LeaseModel:
    """What the lease row should hold, plus every lease handed out so far."""

    sid: str
    row: bool = False
    g: int = 0
    holder: int | None = None
    token: str | None = None
    claimed: int = 0
    expires: int = 0
    issued: list[SessionExecutionLease] = field(default_factory=list)
    latest: dict[int, SessionExecutionLease] = field(default_factory=dict)
    process: dict[int, str] = field(default_factory=dict)  # pid -> probe answer

    def live(self, now: int) -> bool:
        return self.token is not None and self.expires > now

    def current(self) -> SessionExecutionLease:
        assert self.holder is not None and self.token is not None
        return SessionExecutionLease(
            session_id=self.sid,
            owner=M_OWNERS[self.holder],
            lease_token=self.token,
            fencing_token=self.g,
            claimed_at_epoch_ms=self.claimed,
            expires_at_epoch_ms=self.expires,
        )

    def acquire(self, o: int, now: int, ttl: int) -> SessionExecutionLease:
        owner = M_OWNERS[o]
        self.row = True
        self.g += 1
        self.holder = o
        self.token = f"{self.sid}:{owner.owner_id}:{owner.incarnation_id}:{now}:{self.g}"
        self.claimed, self.expires = now, now + ttl
        return self.granted(o, self.current())

    def granted(self, o: int, x: SessionExecutionLease) -> SessionExecutionLease:
        self.issued.append(x)
        self.latest[o] = x
        return x

    def pick(self, o: int, how: str, n: int) -> LeaseFence:
        garbage = LeaseFence(
            session_id=self.sid, owner=M_OWNERS[o], lease_token="garbage", fencing_token=n
        )
        if how == "holder":
            return self.current() if self.token is not None else garbage
        if how == "own":
            return self.latest.get(o, garbage)
        return self.issued[n % len(self.issued)] if self.issued else garbage

    def matches(self, f: LeaseFence) -> bool:
        """The fence names the stored holder exactly (session, incarnation, token, generation)."""
        return (
            self.token is not None
            and f.session_id == self.sid
            and same_incarnation(f.owner, M_OWNERS[self.holder])  # type: ignore[index]
            and f.lease_token == self.token
            and f.fencing_token == self.g
        )

    def probe(self, pid: int, start: str) -> Any:
        return self.process.get(pid, "alive")


ACQUISITIONS = {"claim: acquire", "reclaim: acquire", "reclaim: takeover"}


def _model_step(store: Store, m: LeaseModel, op: tuple[Any, ...]) -> str:
    """Apply ``op`` to the store and the model, check the predicted outcome; return its label.

    The labels in :data:`ACQUISITIONS` are the steps that must add one generation.
    """
    clock = store.clock
    assert isinstance(clock, SettableClock)
    now = clock.now_ms()
    kind = op[0]
    leases = store.leases
    if kind == "advance":
        clock.advance(op[1])
        return "advance"
    if kind == "liveness":
        m.process[M_OWNERS[op[1]].liveness.pid] = op[2]
        return "liveness"
    o = op[1]
    if kind == "claim":
        out = leases.try_claim_session_execution_lease(m.sid, M_OWNERS[o], op[2])
        if not m.live(now):
            assert out == Acquired(lease=m.acquire(o, now, op[2]))
            return "claim: acquire"
        if m.holder == o:
            m.expires = now + op[2]
            assert out == Acquired(lease=m.granted(o, m.current()))
            return "claim: extend"
        assert out == Busy(holder=m.current())
        return "claim: busy"
    if kind == "reclaim":
        observed = m.pick(o, op[2], op[3])
        out = leases.reclaim_session_execution_lease(
            m.sid, M_OWNERS[o], observed, op[4], probe=m.probe
        )
        if not m.live(now):
            assert out == Acquired(lease=m.acquire(o, now, op[4]))
            return "reclaim: acquire"
        holder_pid = M_OWNERS[m.holder].liveness.pid  # type: ignore[index, union-attr]
        if m.matches(observed) and m.probe(holder_pid, "") == "gone":
            assert out == Acquired(lease=m.acquire(o, now, op[4]))
            return "reclaim: takeover"
        assert out == Busy(holder=m.current())
        return "reclaim: busy"
    if kind == "renew":
        fence = m.pick(o, op[2], op[3])
        if m.live(now) and m.matches(fence):
            got = leases.renew_session_execution_lease(fence, op[4])
            m.expires = now + op[4]
            assert got == m.current().model_copy(update={"owner": fence.owner})
            return "renew: ok"
        with pytest.raises(SessionExecutionLeaseExpired):
            leases.renew_session_execution_lease(fence, op[4])
        return "renew: expired"
    assert kind == "release"
    fence = m.pick(o, op[2], op[3])
    leases.release_session_execution_lease(fence)
    if m.matches(fence):
        m.holder, m.token, m.claimed, m.expires = None, None, 0, 0
        return "release: cleared"
    return "release: no-op"


def _check_model(store: Store, m: LeaseModel) -> None:
    row = lease_row(store, m.sid)
    if not m.row:
        assert row is None
        return
    assert row is not None
    owner = None if m.holder is None else M_OWNERS[m.holder]
    assert (
        row["lease_owner_id"],
        row["lease_owner_incarnation_id"],
        row["lease_token"],
        row["lease_fencing_token"],
        row["lease_claimed_at_ms"],
        row["lease_expires_at_ms"],
    ) == (
        owner and owner.owner_id,
        owner and owner.incarnation_id,
        m.token,
        m.g,
        m.claimed,
        m.expires,
    )
    # I-2: of every fence ever handed out, only the live holder's passes FENCE_OK
    clock = store.clock
    assert isinstance(clock, SettableClock)
    passing = set()
    with store.read() as uow:
        for f in m.issued:
            try:
                uow.leases.ensure_session_execution_lease(f)
            except SessionExecutionLeaseExpired:
                continue
            passing.add((f.owner.owner_id, f.owner.incarnation_id, f.lease_token, f.fencing_token))
    assert len(passing) <= 1
    if m.live(clock.now_ms()):
        assert owner is not None
        assert passing == {(owner.owner_id, owner.incarnation_id, m.token, m.g)}
    else:
        assert passing == set()


PROCESS_STATE = st.sampled_from(["gone", "alive", "unknown"])


@settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    ops=st.lists(model_op, min_size=5, max_size=30),
    initial=st.tuples(PROCESS_STATE, PROCESS_STATE, PROCESS_STATE),
)
def test_i_1_i_2_random_sequences_match_the_model(
    store: Store, ops: list[tuple[Any, ...]], initial: tuple[str, str, str]
) -> None:
    """I-1: generation never decreases, +1 exactly per acquisition/takeover; I-2: one live holder.

    Three owners (two share an owner id) with LocalProcess liveness on one host
    and boot; ``liveness`` steps change what the injected probe answers for an
    owner's pid. The store must agree with the model after every step.
    """
    m = LeaseModel(sid=f"prop-{uuid.uuid4().hex[:12]}")
    for owner, state in zip(M_OWNERS, initial, strict=True):
        m.process[owner.liveness.pid] = state  # type: ignore[union-attr]
    generations = [0]
    for op in ops:
        before = lease_row(store, m.sid)
        label = _model_step(store, m, op)
        event(label)
        _check_model(store, m)
        after = lease_row(store, m.sid)
        g_before = 0 if before is None else before["lease_fencing_token"]
        g_after = after["lease_fencing_token"] if after is not None else 0
        assert g_after == g_before + (1 if label in ACQUISITIONS else 0)  # I-1
        generations.append(g_after)
    assert generations == sorted(generations)
    # one generation per distinct token ever handed out (extensions reuse the token)
    assert generations[-1] == len({x.lease_token for x in m.issued})
