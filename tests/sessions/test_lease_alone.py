"""Renew and release in their short forms: the races their fences guard, the lock exclusion.

On Postgres a one-call release is one statement that takes ``session:<id>``
itself if free (``leases.release_alone``), and a one-call renew on psycopg
sends its fenced write with ``COMMIT`` (see :mod:`agentkeep.sessions.leases`).
Each race runs with real writers (threads and ``spawn``-ed processes, each
with a Store and clock of its own) on both backends:

* renew vs a takeover after expiry: the holder renews at a ``now`` where its
  lease is live while a claimant claims at a ``now`` past its expiry. Exactly
  one wins: the renew (the claim is ``Busy`` naming the renewed lease) or
  the claim (generation + 1; the renew raises
  ``SessionExecutionLeaseExpired``).
* release vs a takeover: a reclaimer takes a dead holder's live lease over
  while the holder releases with its fence. The takeover always ends holding
  generation + 1 (a release after it matches nothing), never released.
* release vs renew, and two releases with one fence: the session always ends
  released, generation kept; a renew that returned had come first.

Lock exclusion (Postgres): a unit holding ``session:<id>`` makes the
one-statement release find the lock busy; it falls back to the locked path,
which waits, and releases only after the unit committed.

Refused calls leave the row as it was.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import psycopg
import pytest
from sqlalchemy import make_url, text

from agentkeep import Store, db, observability
from agentkeep.clock import SettableClock
from agentkeep.errors import InvalidInput, ReadOnlyUnitOfWork, SessionExecutionLeaseExpired
from agentkeep.sessions.domain import (
    Acquired,
    Busy,
    LeaseFence,
    LeaseOwnerIdentity,
    LocalProcess,
    SessionExecutionLease,
)
from agentkeep.sessions.leases import begin_session_write, ensure_session_execution_lease
from tests.racing import Racing
from tests.sessions.test_head_read import _sqlite_log

T0_MS = 1_700_000_000_000
TTL_MS = 1_000
ROUNDS = 8
HOST, BOOT = "host-alone", "boot-alone"
# Both local processes of one host: a reclaim may probe (and, with _gone, bury) the holder.
HOLDER = LeaseOwnerIdentity(
    owner_id="holder-A",
    incarnation_id="inc-A",
    liveness=LocalProcess(host_id=HOST, boot_id=BOOT, pid=7101, process_start="71"),
)
CLAIMANT = LeaseOwnerIdentity(
    owner_id="claimant-B",
    incarnation_id="inc-B",
    liveness=LocalProcess(host_id=HOST, boot_id=BOOT, pid=7102, process_start="72"),
)

RACING = Racing(processes=2, threads=2, clock_ms=T0_MS, barrier_timeout_s=30.0, join_timeout_s=90.0)
proc_pool = RACING.pool_fixture()
KINDS = pytest.mark.parametrize("kind", ["processes", "threads"])


def _gone(pid: int, start: str) -> Any:
    """The injected probe: every holder process is gone."""
    return "gone"


def _raw(store: Store, sid: str) -> dict[str, Any] | None:
    """The stored lease row, every column."""
    with store.read() as uow:
        row = (
            uow.connection.execute(
                text("SELECT * FROM session_execution_leases WHERE session_id = :s"), {"s": sid}
            )
            .mappings()
            .first()
        )
    return None if row is None else dict(row)


def _hold(store: Store, sid: str, generation: int = 1) -> SessionExecutionLease:
    """HOLDER's lease on ``sid`` at ``generation`` (from the store's clock, ttl TTL_MS)."""
    for _ in range(generation - 1):
        out = store.leases.try_claim_session_execution_lease(sid, HOLDER, TTL_MS)
        assert isinstance(out, Acquired)
        store.leases.release_session_execution_lease(out.lease)
    out = store.leases.try_claim_session_execution_lease(sid, HOLDER, TTL_MS)
    assert isinstance(out, Acquired) and out.lease.fencing_token == generation
    return out.lease


# --------------------------------------------------------------------------
# Bodies (module level: spawned racers import them)


def _body_renew_vs_takeover(store: Store, i: int, barrier: Any, p: dict[str, Any]) -> list[Any]:
    """Racer 0 renews at T0 + TTL - 1 (live), racer 1 claims at T0 + TTL (expired)."""
    assert isinstance(store.clock, SettableClock)
    store.clock.set(T0_MS + TTL_MS - 1 if i == 0 else T0_MS + TTL_MS)
    out: list[Any] = []
    for sid, fence in zip(p["sids"], p["fences"], strict=True):
        barrier.wait()
        if i == 0:
            try:
                out.append(store.leases.renew_session_execution_lease(fence, 60_000))
            except SessionExecutionLeaseExpired:
                out.append("expired")
        else:
            out.append(store.leases.try_claim_session_execution_lease(sid, CLAIMANT, 60_000))
    return out


def _body_release_vs_reclaim(store: Store, i: int, barrier: Any, p: dict[str, Any]) -> list[Any]:
    """Racer 0 releases the holder's lease, racer 1 reclaims it from the dead holder."""
    out: list[Any] = []
    for sid, fence in zip(p["sids"], p["fences"], strict=True):
        barrier.wait()
        if i == 0:
            out.append(store.leases.release_session_execution_lease(fence))
        else:
            out.append(
                store.leases.reclaim_session_execution_lease(
                    sid, CLAIMANT, fence, 60_000, probe=_gone
                )
            )
    return out


def _body_release_vs_renew(store: Store, i: int, barrier: Any, p: dict[str, Any]) -> list[Any]:
    """Racer 0 releases, racer 1 renews, both with the holder's fence."""
    out: list[Any] = []
    for fence in p["fences"]:
        barrier.wait()
        if i == 0:
            out.append(store.leases.release_session_execution_lease(fence))
        else:
            try:
                out.append(store.leases.renew_session_execution_lease(fence, 60_000))
            except SessionExecutionLeaseExpired:
                out.append("expired")
    return out


def _body_two_releases(store: Store, i: int, barrier: Any, p: dict[str, Any]) -> list[Any]:
    """Both racers release with the same fence."""
    out: list[Any] = []
    for fence in p["fences"]:
        barrier.wait()
        out.append(store.leases.release_session_execution_lease(fence))
    return out


# --------------------------------------------------------------------------
# Races


@KINDS
def test_renew_racing_a_takeover_after_expiry_has_one_winner(
    request: pytest.FixtureRequest, db_url: str, kind: str
) -> None:
    sids = [f"renew-take-{kind}-{n}" for n in range(ROUNDS)]
    with Store.open(db_url, clock=SettableClock(T0_MS)) as store:
        fences = [_hold(store, sid, 1 + n % 2) for n, sid in enumerate(sids)]
        results = RACING.run(
            request, kind, db_url, _body_renew_vs_takeover, {"sids": sids, "fences": fences}
        )
        for sid, held, renewed, claimed in zip(sids, fences, *results, strict=True):
            stored = store.leases.get_session_execution_lease(sid)
            if renewed == "expired":  # the takeover came first
                assert isinstance(claimed, Acquired), claimed
                assert claimed.lease.fencing_token == held.fencing_token + 1
                assert claimed.lease.owner == CLAIMANT
                assert stored == claimed.lease
            else:  # the renew came first: the lease was live at the claim's now
                assert isinstance(renewed, SessionExecutionLease), renewed
                assert renewed.expires_at_epoch_ms == T0_MS + TTL_MS - 1 + 60_000
                assert (renewed.lease_token, renewed.fencing_token) == (
                    held.lease_token,
                    held.fencing_token,
                )
                assert renewed.claimed_at_epoch_ms == held.claimed_at_epoch_ms
                assert isinstance(claimed, Busy) and claimed.holder == renewed, claimed
                assert stored == renewed


@KINDS
def test_release_racing_a_takeover_never_releases_the_new_holder(
    request: pytest.FixtureRequest, db_url: str, kind: str
) -> None:
    sids = [f"rel-take-{kind}-{n}" for n in range(ROUNDS)]
    with Store.open(db_url, clock=SettableClock(T0_MS)) as store:
        fences = [_hold(store, sid, 1 + n % 2) for n, sid in enumerate(sids)]
        results = RACING.run(
            request, kind, db_url, _body_release_vs_reclaim, {"sids": sids, "fences": fences}
        )
        for sid, held, released, reclaimed in zip(sids, fences, *results, strict=True):
            assert released is None
            # Reclaimed from the live holder, or acquired after the release:
            # generation + 1 either way, and a later release matches nothing.
            assert isinstance(reclaimed, Acquired), reclaimed
            assert reclaimed.lease.fencing_token == held.fencing_token + 1
            assert reclaimed.lease.owner == CLAIMANT
            assert store.leases.get_session_execution_lease(sid) == reclaimed.lease


@KINDS
def test_release_racing_a_renew_ends_released(
    request: pytest.FixtureRequest, db_url: str, kind: str
) -> None:
    sids = [f"rel-renew-{kind}-{n}" for n in range(ROUNDS)]
    with Store.open(db_url, clock=SettableClock(T0_MS)) as store:
        fences = [_hold(store, sid, 1 + n % 2) for n, sid in enumerate(sids)]
        results = RACING.run(request, kind, db_url, _body_release_vs_renew, {"fences": fences})
        for sid, held, released, renewed in zip(sids, fences, *results, strict=True):
            assert released is None
            if renewed != "expired":
                assert isinstance(renewed, SessionExecutionLease), renewed
                assert renewed.fencing_token == held.fencing_token
            raw = _raw(store, sid)
            assert raw is not None and raw["lease_token"] is None, raw
            assert raw["lease_fencing_token"] == held.fencing_token
            assert (raw["lease_claimed_at_ms"], raw["lease_expires_at_ms"]) == (0, 0)


@KINDS
def test_two_releases_with_one_fence(
    request: pytest.FixtureRequest, db_url: str, kind: str
) -> None:
    sids = [f"rel-rel-{kind}-{n}" for n in range(ROUNDS)]
    with Store.open(db_url, clock=SettableClock(T0_MS)) as store:
        fences = [_hold(store, sid, 1 + n % 2) for n, sid in enumerate(sids)]
        results = RACING.run(request, kind, db_url, _body_two_releases, {"fences": fences})
        assert results == [[None] * ROUNDS, [None] * ROUNDS]
        for sid, held in zip(sids, fences, strict=True):
            raw = _raw(store, sid)
            assert raw is not None and raw["lease_token"] is None, raw
            assert raw["lease_fencing_token"] == held.fencing_token
            again = store.leases.try_claim_session_execution_lease(sid, CLAIMANT, 60_000)
            assert isinstance(again, Acquired)
            assert again.lease.fencing_token == held.fencing_token + 1


# --------------------------------------------------------------------------
# Lock exclusion: the lock busy → the locked path, which waits


def _waiting_on_the_lock(store: Store) -> bool:
    """True when some backend waits for an advisory lock in ``pg_advisory_xact_lock``."""
    with store.read() as uow:
        n = uow.connection.execute(
            text(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND wait_event = 'advisory' AND query LIKE '%pg_advisory_xact_lock(%'"
            )
        ).scalar_one()
    return bool(n)


def test_release_while_a_unit_holds_the_lock_waits_for_it(pg_url: str) -> None:
    """The one-statement release finds ``session:<id>`` busy: it writes nothing, and the
    locked path waits for the unit; the release lands only after the unit commits, and
    still matches the holder's fence."""
    sid = "rel-lock-busy"
    with Store.open(pg_url, clock=SettableClock(T0_MS)) as store:
        held = _hold(store, sid)
        in_unit = threading.Event()
        let_go = threading.Event()
        seen: list[Any] = []

        def unit() -> None:
            # The lock and a fence check, no write to the lease row: only the
            # advisory lock keeps the release out.
            with store.write() as uow:
                now = begin_session_write(uow.driver, store.clock, True, sid)
                ensure_session_execution_lease(uow.driver, sid, held, now)
                seen.append(now)
                in_unit.set()
                assert let_go.wait(60)

        def release() -> None:
            seen.append(store.leases.release_session_execution_lease(held))

        holder = threading.Thread(target=unit)
        holder.start()
        try:
            assert in_unit.wait(60)
            releaser = threading.Thread(target=release)
            releaser.start()
            # Wait (bounded) until the release waits in the locked path's lock.
            for _ in range(6000):
                if _waiting_on_the_lock(store) or not releaser.is_alive():
                    break
                threading.Event().wait(0.01)
            assert releaser.is_alive(), seen  # it did not release under the unit's lock
            stored = _raw(store, sid)
            assert stored is not None and stored["lease_token"] == held.lease_token
        finally:
            let_go.set()
            holder.join(60)
        releaser.join(60)
        assert not releaser.is_alive()
        assert seen == [T0_MS, None]
        assert store.leases.get_session_execution_lease(sid) is None
        assert _raw(store, sid)["lease_fencing_token"] == held.fencing_token  # type: ignore[index]


# --------------------------------------------------------------------------
# Refused calls leave the row as it was


def test_refused_renew_and_release_leave_the_row_untouched(store: Store) -> None:
    sid = "refused-alone"
    held = _hold(store, sid, 2)
    before = _raw(store, sid)
    stale = LeaseFence(
        session_id=sid,
        owner=held.owner,
        lease_token=held.lease_token,
        fencing_token=held.fencing_token - 1,
    )
    other = LeaseFence(
        session_id=sid,
        owner=CLAIMANT,
        lease_token=held.lease_token,
        fencing_token=held.fencing_token,
    )
    # A stale or foreign fence: the release is a silent no-op, the renew expired.
    for fence in (stale, other):
        assert store.leases.release_session_execution_lease(fence) is None
        with pytest.raises(SessionExecutionLeaseExpired):
            store.leases.renew_session_execution_lease(fence, 60_000)
        assert _raw(store, sid) == before
    # Bad arguments: InvalidInput, nothing sent.
    for bad in (None, "fence", held.model_copy(update={"session_id": ""})):
        with pytest.raises(InvalidInput):
            store.leases.release_session_execution_lease(bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidInput):
            store.leases.renew_session_execution_lease(bad, 60_000)  # type: ignore[arg-type]
    for ttl in (-1, 2**63, 1.5):
        with pytest.raises(InvalidInput):
            store.leases.renew_session_execution_lease(held, ttl)  # type: ignore[arg-type]
    # A read unit refuses both.
    with store.read() as uow, pytest.raises(ReadOnlyUnitOfWork):
        uow.leases.release_session_execution_lease(held)
    with store.read() as uow, pytest.raises(ReadOnlyUnitOfWork):
        uow.leases.renew_session_execution_lease(held, 60_000)
    assert _raw(store, sid) == before
    # An expired lease: renew refused (row unchanged), release still releases.
    assert isinstance(store.clock, SettableClock)
    store.clock.set(held.expires_at_epoch_ms)
    with pytest.raises(SessionExecutionLeaseExpired):
        store.leases.renew_session_execution_lease(held, 60_000)
    assert _raw(store, sid) == before
    store.leases.release_session_execution_lease(held)
    after = _raw(store, sid)
    assert after is not None and after["lease_token"] is None
    assert after["lease_fencing_token"] == held.fencing_token


# --------------------------------------------------------------------------
# SQLite: BEGIN IMMEDIATE, one fenced UPDATE, COMMIT


def test_renew_and_release_are_three_statements_on_sqlite(store: Store, backend: str) -> None:
    if backend != "sqlite":
        pytest.skip("SQLite's statements")
    sid = "sqlite-statements"
    held = _hold(store, sid)
    log = _sqlite_log(store)
    renewed = store.leases.renew_session_execution_lease(held, 60_000)
    assert renewed.claimed_at_epoch_ms == held.claimed_at_epoch_ms
    renew, log[:] = list(log), []
    store.leases.release_session_execution_lease(renewed)
    release = list(log)
    for trace, verb in ((renew, "UPDATE"), (release, "UPDATE")):
        assert len(trace) == 3, trace
        assert trace[0].startswith("BEGIN IMMEDIATE") and trace[2] == "COMMIT", trace
        assert trace[1].startswith(verb) and "session_execution_leases" in trace[1], trace
    # A refused renew reads the row to say why, and writes nothing.
    log[:] = []
    with pytest.raises(SessionExecutionLeaseExpired):
        store.leases.renew_session_execution_lease(renewed, 60_000)
    assert [t.split()[0] for t in log] == ["BEGIN", "UPDATE", "SELECT", "ROLLBACK"], log


# --------------------------------------------------------------------------
# A connection lost with the one-statement release in flight


def test_a_release_lost_in_flight_is_run_again(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The statement is its own COMMIT: its connection lost in flight leaves the outcome
    unknown (``CommitOutcomeUnknown`` inside), and the one-call form runs the release
    again, which releases the lease or matches nothing: ``None`` either way.

    The backend is terminated just before the statement is sent, after the unit
    found the connection open (as tests/runs/test_one_statement_writes.py does).
    """
    admin = psycopg.connect(
        make_url(pg_url).set(drivername="postgresql").render_as_string(hide_password=False),
        autocommit=True,
    )
    original = db.Driver.closed_while_idle
    fired: list[int] = []

    def closed_while_idle(driver: db.Driver) -> bool:
        closed = original(driver)
        # Only the check execute_alone makes right before it sends the statement.
        if not fired and sys._getframe(1).f_code.co_name == "execute_alone":
            pid = driver.raw.info.backend_pid
            admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
            while admin.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchall():
                threading.Event().wait(0.002)
            fired.append(pid)
        return closed

    sid = "rel-lost"
    try:
        with Store.open(pg_url, clock=SettableClock(T0_MS)) as store:
            held = _hold(store, sid)
            monkeypatch.setattr(db.Driver, "closed_while_idle", closed_while_idle)
            resolved: list[tuple[str, str]] = []
            monkeypatch.setattr(
                observability,
                "commit_outcome_resolved",
                lambda operation, how: resolved.append((operation, how)),
            )
            assert store.leases.release_session_execution_lease(held) is None
            monkeypatch.undo()
            assert fired
            assert resolved == [("leases.release_session_execution_lease", "replayed")]
            raw = _raw(store, sid)
            assert raw is not None and raw["lease_token"] is None, raw
            assert raw["lease_fencing_token"] == held.fencing_token
    finally:
        admin.close()
