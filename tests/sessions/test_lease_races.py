"""Session execution lease races with real concurrency (spec sessions §5.2 L-25, L-26).

All tests run on both backends.

* L-25: two racers call ``try_claim`` on a fresh session at the same moment
  (lined up on a barrier) → exactly one ``Acquired`` with fencing 1, the other
  ``Busy`` naming the winner; over several sessions, with two ``spawn``-ed
  processes and with two threads, each racer with its own :class:`Store`.
* L-26: the holder A is dead (the injected probe says "gone"); B and C reclaim
  with A's exact fence at once → one ``Acquired`` with fencing g+1, the other
  ``Busy`` naming the winner (its observed fence no longer matches).
* The frozen holder: a child process holds the lease with a 1.5 s ttl of *real*
  time (these tests use the system clock: the child and the parent are separate
  processes and must agree on time), keeps renewing it, and is frozen with
  SIGSTOP. Past the expiry the parent takes the lease over with ``try_claim``
  (fencing + 1). Resumed with SIGCONT, the child's next renew raises
  :class:`SessionExecutionLeaseExpired` and its release with the old fence is
  a no-op: the parent still holds the lease. A second run adds queued work and
  next-turn inputs: the child's claims (gen 1) are re-claimed by the parent
  (gen 2); the resumed child's claims raise ``SessionExecutionLeaseExpired``,
  its abandons change nothing, and its cancel of the parent's batch is None.

The child is frozen only while it is outside any transaction: it renews while
holding a ``multiprocessing`` lock that the parent takes before sending
SIGSTOP (a child frozen inside a write transaction would hold the database or
advisory lock, and the parent would wait for it instead of racing it). Every
wait is bounded, and every child is resumed and killed in ``finally``.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from sqlalchemy import text

from agentkeep.clock import SettableClock, SystemClock
from agentkeep.errors import SessionExecutionLeaseExpired
from agentkeep.sessions.domain import (
    Acquired,
    AcquireOutcome,
    Busy,
    ClaimBoundary,
    LeaseFence,
    LeaseOwnerIdentity,
    LocalProcess,
    NextTurnIngress,
    PendingTurnInputDraft,
    QueuedWorkDraft,
    QueuedWorkPayload,
    SessionExecutionLease,
)
from agentkeep.store import Store
from tests.racing import READY_TIMEOUT_S, Racing

from .support import lease_row

T0_MS = 1_700_000_000_000
ROUNDS = 10
HOLD_TTL_MS = 1500  # the frozen child's lease, in real milliseconds

HOST, BOOT = "host-race", "boot-race"


def _lp(pid: int, start: str) -> LocalProcess:
    return LocalProcess(host_id=HOST, boot_id=BOOT, pid=pid, process_start=start)


RACERS = [
    LeaseOwnerIdentity(owner_id="racer-B", incarnation_id="inc-B", liveness=_lp(7002, "72")),
    LeaseOwnerIdentity(owner_id="racer-C", incarnation_id="inc-C", liveness=_lp(7003, "73")),
]
DEAD_A = LeaseOwnerIdentity(owner_id="dead-A", incarnation_id="inc-A", liveness=_lp(7001, "71"))
PARENT = LeaseOwnerIdentity(owner_id="parent", incarnation_id=f"parent-{os.getpid()}")
CHILD = LeaseOwnerIdentity(owner_id="child", incarnation_id="child-1")


# --------------------------------------------------------------------------
# Racer bodies (module level so that spawned children can import them)


def _gone(pid: int, start: str) -> Any:
    """The injected probe of L-26: every holder process is gone."""
    return "gone"


def _body_try_claim(store: Store, i: int, barrier: Any, p: dict[str, Any]) -> list[Any]:
    """Per session: wait for the other racer, then try_claim it at the same instant."""
    out = []
    for sid in p["sids"]:
        barrier.wait()
        out.append(store.leases.try_claim_session_execution_lease(sid, RACERS[i], 60_000))
    return out


def _body_reclaim(store: Store, i: int, barrier: Any, p: dict[str, Any]) -> list[Any]:
    """Per session: wait for the other racer, then reclaim from the dead holder's exact fence."""
    out = []
    for sid, observed in zip(p["sids"], p["fences"], strict=True):
        barrier.wait()
        out.append(
            store.leases.reclaim_session_execution_lease(
                sid, RACERS[i], observed, 60_000, probe=_gone
            )
        )
    return out


#: Two racers, each with its own store and clock at T0.
RACING = Racing(processes=2, threads=2, clock_ms=T0_MS, barrier_timeout_s=30.0, join_timeout_s=90.0)
proc_pool = RACING.pool_fixture()

KINDS = pytest.mark.parametrize("kind", ["processes", "threads"])


def one_winner(outcomes: list[AcquireOutcome]) -> tuple[SessionExecutionLease, Busy]:
    """Exactly one Acquired and one Busy; the Busy names the winner's lease exactly."""
    won = [o for o in outcomes if isinstance(o, Acquired)]
    lost = [o for o in outcomes if isinstance(o, Busy)]
    assert len(won) == 1 and len(lost) == 1, outcomes
    assert lost[0].holder == won[0].lease
    return won[0].lease, lost[0]


# --------------------------------------------------------------------------
# L-25, L-26


@KINDS
def test_l_25_simultaneous_try_claim_has_one_winner(
    request: pytest.FixtureRequest, db_url: str, kind: str
) -> None:
    """L-25: no row; two racers try_claim at once → one Acquired (fencing 1), one Busy naming it."""
    sids = [f"race25-{kind}-{n}" for n in range(ROUNDS)]
    results = RACING.run(request, kind, db_url, _body_try_claim, {"sids": sids})
    winners = []
    with Store.open(db_url, clock=SettableClock(T0_MS)) as store:
        for n, sid in enumerate(sids):
            lease, _ = one_winner([results[0][n], results[1][n]])
            assert lease.session_id == sid
            assert lease.fencing_token == 1
            assert lease.claimed_at_epoch_ms == T0_MS
            owner = lease.owner
            assert lease.lease_token == f"{sid}:{owner.owner_id}:{owner.incarnation_id}:{T0_MS}:1"
            row = lease_row(store, sid)
            assert row is not None
            assert (row["lease_owner_id"], row["lease_token"], row["lease_fencing_token"]) == (
                owner.owner_id,
                lease.lease_token,
                1,
            )
            store.leases.ensure_session_execution_lease(lease)
            winners.append(owner.owner_id)
    assert set(winners) <= {"racer-B", "racer-C"}


@KINDS
def test_l_26_simultaneous_reclaim_of_dead_holder_has_one_winner(
    request: pytest.FixtureRequest, db_url: str, kind: str
) -> None:
    """L-26: A dead; B and C reclaim with A's exact fence at once → one Acquired g+1, one Busy."""
    sids = [f"race26-{kind}-{n}" for n in range(ROUNDS)]
    fences: list[LeaseFence] = []
    with Store.open(db_url, clock=SettableClock(T0_MS)) as store:
        for n, sid in enumerate(sids):
            for _ in range(n % 3):  # generations 1..3 before A's
                out = store.leases.try_claim_session_execution_lease(sid, DEAD_A, 100)
                assert isinstance(out, Acquired)
                store.leases.release_session_execution_lease(out.lease)
            out = store.leases.try_claim_session_execution_lease(sid, DEAD_A, 60_000)
            assert isinstance(out, Acquired)
            fences.append(out.lease)
        params = {"sids": sids, "fences": fences}
        results = RACING.run(request, kind, db_url, _body_reclaim, params)
        for n, (sid, dead) in enumerate(zip(sids, fences, strict=True)):
            lease, busy = one_winner([results[0][n], results[1][n]])
            assert lease.fencing_token == dead.fencing_token + 1 == n % 3 + 2
            assert lease.owner in RACERS
            assert busy.holder.owner != dead.owner
            row = lease_row(store, sid)
            assert row is not None
            assert (row["lease_owner_id"], row["lease_token"], row["lease_fencing_token"]) == (
                lease.owner.owner_id,
                lease.lease_token,
                lease.fencing_token,
            )


# --------------------------------------------------------------------------
# The frozen holder (SIGSTOP past expiry, then SIGCONT)


def _attempt(fn: Callable[[], Any]) -> tuple[str, Any]:
    """("ok", value) or ("err", error class name): picklable for the parent."""
    try:
        return ("ok", fn())
    except Exception as exc:  # noqa: BLE001 - every error is part of the outcome
        return ("err", type(exc).__name__)


def _stale_work(store: Store, sid: str, lease: SessionExecutionLease, claims: Any) -> list[Any]:
    """The resumed child's fenced queue / turn-input calls with its lost lease and old claims."""
    queue_claim, input_claim = claims
    x_id = queue_claim.batches[0].batch_id
    return [
        (
            "claim_ready_queued_work",
            _attempt(
                lambda: store.call_write(
                    lambda r: r.queue.claim_ready_queued_work(
                        sid, lease, CHILD, ClaimBoundary.IDLE, 5
                    )
                )
            ),
        ),
        (
            "claim_next_turn_inputs",
            _attempt(
                lambda: store.call_write(
                    lambda r: r.turn_inputs.claim_next_turn_inputs(sid, lease, CHILD, 5)
                )
            ),
        ),
        (
            "abandon_queued_work_claim",
            _attempt(
                lambda: store.call_write(lambda r: r.queue.abandon_queued_work_claim(queue_claim))
            ),
        ),
        (
            "abandon_turn_input_claim",
            _attempt(
                lambda: store.call_write(
                    lambda r: r.turn_inputs.abandon_turn_input_claim(input_claim)
                )
            ),
        ),
        (
            "cancel_queued_work_batch",
            _attempt(
                lambda: store.call_write(lambda r: r.queue.cancel_queued_work_batch(sid, x_id))
            ),
        ),
    ]


def _frozen_holder(url: str, sid: str, gate: Any, out: Any, with_work: bool) -> None:
    """Child: hold ``sid`` (ttl 1.5 s real time), renew under ``gate`` until refused, then release.

    Reports ("acquired", lease, claims); claims is None, or (with ``with_work``)
    the child's queued-work claim (max 1 batch) and next-turn input claim
    (max 1 input) taken right after acquiring. After the refused renew it
    reports ("renew", error name), with ``with_work`` ("work", outcomes of
    :func:`_stale_work`), then ("release", None or error name) and ("done",).
    """
    store = Store.open(url)  # the system clock
    try:
        got = store.leases.try_claim_session_execution_lease(sid, CHILD, HOLD_TTL_MS)
        if not isinstance(got, Acquired):
            out.put(("failed", repr(got)))
            return
        lease = got.lease
        claims = None
        if with_work:
            with store.write() as uow:
                claims = (
                    uow.queue.claim_ready_queued_work(sid, lease, CHILD, ClaimBoundary.IDLE, 1),
                    uow.turn_inputs.claim_next_turn_inputs(sid, lease, CHILD, 1),
                )
        out.put(("acquired", lease, claims))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with gate:
                try:
                    lease = store.leases.renew_session_execution_lease(lease, HOLD_TTL_MS)
                except SessionExecutionLeaseExpired as exc:
                    out.put(("renew", type(exc).__name__))
                    if with_work:
                        out.put(("work", _stale_work(store, sid, lease, claims)))
                    try:
                        store.leases.release_session_execution_lease(lease)
                        out.put(("release", None))
                    except Exception as rel:  # noqa: BLE001 - reported to the parent
                        out.put(("release", type(rel).__name__))
                    break
            time.sleep(0.05)
        out.put(("done",))
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        out.put(("failed", f"{type(exc).__name__}: {exc}"))
    finally:
        store.close()


def _expect(out: Any, tag: str, timeout: float = 30.0) -> tuple[Any, ...]:
    msg = out.get(timeout=timeout)
    assert msg[0] == tag, msg
    return tuple(msg)


def _wait_until_past(clock: SystemClock, ms: int, limit_s: float = 10.0) -> None:
    """Real time must pass here: the frozen child's lease expires in wall-clock time."""
    deadline = time.monotonic() + limit_s
    while clock.now_ms() <= ms:
        assert time.monotonic() < deadline, "the child's lease did not expire in time"
        time.sleep(0.02)


@dataclass
class Frozen:
    """What the SIGSTOP scenario left: the parent's store (caller closes it) and the reports."""

    store: Store
    child_lease: SessionExecutionLease
    child_claims: Any
    parent_lease: SessionExecutionLease
    reports: dict[str, Any]


def run_frozen_holder(
    db_url: str,
    sid: str,
    *,
    with_work: bool = False,
    while_frozen: Callable[[Store, SessionExecutionLease], Any] | None = None,
) -> tuple[Frozen, Any]:
    """Run the SIGSTOP scenario; return it and what ``while_frozen`` returned.

    ``while_frozen(parent_store, parent_lease)`` runs after the parent's
    takeover and before SIGCONT.
    """
    ctx = multiprocessing.get_context("spawn")
    gate = ctx.Lock()
    out = ctx.Queue()
    child = ctx.Process(
        target=_frozen_holder, args=(db_url, sid, gate, out, with_work), daemon=True
    )
    clock = SystemClock()
    store = Store.open(db_url, clock=clock)
    stopped = False
    try:
        child.start()
        # the child's first report: its start-up (spawn, imports) comes first
        (_, child_lease, child_claims) = _expect(out, "acquired", timeout=READY_TIMEOUT_S)
        assert child_lease.fencing_token == 1
        renewed = time.monotonic() + 20
        while lease_row(store, sid)["lease_expires_at_ms"] <= child_lease.expires_at_epoch_ms:
            assert time.monotonic() < renewed, "the child never renewed its lease"
            time.sleep(0.05)  # let it renew at least once
        with gate:  # the child is outside any transaction now
            assert child.pid is not None
            os.kill(child.pid, signal.SIGSTOP)
            stopped = True
        row = lease_row(store, sid)
        assert row is not None and row["lease_token"] == child_lease.lease_token
        expires = row["lease_expires_at_ms"]
        assert expires > child_lease.expires_at_epoch_ms  # it did renew
        # still live: the parent is refused until the expiry passes
        early = store.leases.try_claim_session_execution_lease(sid, PARENT, 60_000)
        if clock.now_ms() < expires:
            assert isinstance(early, Busy) and early.holder.owner == CHILD
        _wait_until_past(clock, expires)
        got = store.leases.try_claim_session_execution_lease(sid, PARENT, 60_000)
        assert isinstance(got, Acquired), got
        parent_lease = got.lease
        assert parent_lease.fencing_token == child_lease.fencing_token + 1
        extra = None if while_frozen is None else while_frozen(store, parent_lease)
        os.kill(child.pid, signal.SIGCONT)
        stopped = False
        tags = ["renew", "work", "release", "done"] if with_work else ["renew", "release", "done"]
        reports = {tag: _expect(out, tag)[1:] for tag in tags}
        child.join(30)
        assert child.exitcode == 0
        return Frozen(store, child_lease, child_claims, parent_lease, reports), extra
    except BaseException:
        store.close()
        raise
    finally:
        if child.pid is not None and child.is_alive():
            if stopped:
                os.kill(child.pid, signal.SIGCONT)
            child.kill()
            child.join(10)


def _check_parent_still_holds(f: Frozen, sid: str) -> None:
    assert f.reports["renew"] == ("SessionExecutionLeaseExpired",)
    assert f.reports["release"] == (None,)  # a silent no-op, not an error
    row = lease_row(f.store, sid)
    assert row is not None
    assert (
        row["lease_owner_id"],
        row["lease_owner_incarnation_id"],
        row["lease_token"],
        row["lease_fencing_token"],
        row["lease_expires_at_ms"],
    ) == (
        PARENT.owner_id,
        PARENT.incarnation_id,
        f.parent_lease.lease_token,
        f.child_lease.fencing_token + 1,
        f.parent_lease.expires_at_epoch_ms,
    )
    f.store.leases.ensure_session_execution_lease(f.parent_lease)
    with pytest.raises(SessionExecutionLeaseExpired):
        f.store.leases.ensure_session_execution_lease(f.child_lease)


def test_frozen_holder_loses_the_lease_and_cannot_renew_or_release(db_url: str) -> None:
    """SIGSTOP past expiry → parent try_claim gets g+1; SIGCONT → renew Expired, release no-op."""
    sid = "frozen-lease"
    f, _ = run_frozen_holder(db_url, sid)
    try:
        _check_parent_still_holds(f, sid)
    finally:
        f.store.close()


def _raw_inputs(store: Store, sid: str) -> list[dict[str, Any]]:
    with store.read() as uow:
        rows = (
            uow.connection.execute(
                text(
                    "SELECT input_id, state, claim_id, claim_token, claim_session_lease_generation "
                    "FROM pending_turn_inputs WHERE session_id = :s ORDER BY enqueue_seq"
                ),
                {"s": sid},
            )
            .mappings()
            .all()
        )
    return [dict(r) for r in rows]


def _raw_batches(store: Store, sid: str) -> list[dict[str, Any]]:
    with store.read() as uow:
        rows = (
            uow.connection.execute(
                text(
                    "SELECT batch_id, claim_id, claim_token, claim_fencing_token, "
                    "claim_session_lease_generation FROM queued_work_batches "
                    "WHERE session_id = :s ORDER BY enqueue_seq"
                ),
                {"s": sid},
            )
            .mappings()
            .all()
        )
    return [dict(r) for r in rows]


def test_frozen_holder_cannot_touch_queued_work_or_turn_inputs(db_url: str) -> None:
    """The frozen holder's work claims after the takeover.

    Setup: turn-work batches X, Y and next-turn inputs i1, i2; the child (gen 1)
    claims X and i1, then is frozen past its expiry; the parent takes the lease
    (gen 2) and re-claims X and i1 (stale under gen 1). Resumed, the child's
    claims raise SessionExecutionLeaseExpired (Y and i2 were free to take),
    its abandons change nothing (the parent's claims intact), and its cancel
    of X, which the parent holds, returns None.
    """
    sid = "frozen-work"
    with Store.open(db_url) as setup, setup.write() as uow:
        batches = [
            uow.queue.enqueue_queued_work(
                QueuedWorkDraft(
                    session_id=sid,
                    source_key=f"src-{name}",
                    payloads=(QueuedWorkPayload(kind="user_message", body={"n": name}),),
                )
            )
            for name in ("X", "Y")
        ]
        inputs = [
            uow.turn_inputs.enqueue_pending_turn_input(
                PendingTurnInputDraft(session_id=sid, ingress=NextTurnIngress(), input={"n": name})
            )
            for name in ("i1", "i2")
        ]
    x_id, y_id = (b.batch_id for b in batches)
    i1_id, i2_id = (i.input_id for i in inputs)

    def parent_reclaims(store: Store, lease: SessionExecutionLease) -> Any:
        with store.write() as uow:
            return (
                uow.queue.claim_ready_queued_work(sid, lease, PARENT, ClaimBoundary.IDLE, 1),
                uow.turn_inputs.claim_next_turn_inputs(sid, lease, PARENT, 1),
            )

    f, (p_queue, p_inputs) = run_frozen_holder(
        db_url, sid, with_work=True, while_frozen=parent_reclaims
    )
    try:
        _check_parent_still_holds(f, sid)
        c_queue, c_inputs = f.child_claims
        # the child had X and i1 under generation 1; the parent re-claimed them under 2
        assert [b.batch_id for b in c_queue.batches] == [x_id]
        assert [i.input_id for i in c_inputs.inputs] == [i1_id]
        assert c_queue.session_lease_generation == c_inputs.session_lease_generation == 1
        assert p_queue is not None and [b.batch_id for b in p_queue.batches] == [x_id]
        assert p_inputs is not None and [i.input_id for i in p_inputs.inputs] == [i1_id]
        assert p_queue.session_lease_generation == p_inputs.session_lease_generation == 2
        assert p_queue.claim_id != c_queue.claim_id and p_inputs.claim_id != c_inputs.claim_id

        work = dict(f.reports["work"][0])
        assert work["claim_ready_queued_work"] == ("err", "SessionExecutionLeaseExpired")
        assert work["claim_next_turn_inputs"] == ("err", "SessionExecutionLeaseExpired")
        assert work["abandon_queued_work_claim"] == ("ok", None)
        assert work["abandon_turn_input_claim"] == ("ok", None)
        assert work["cancel_queued_work_batch"] == ("ok", None)

        assert _raw_batches(f.store, sid) == [
            {
                "batch_id": x_id,
                "claim_id": p_queue.claim_id,
                "claim_token": p_queue.lease_token,
                "claim_fencing_token": 2,
                "claim_session_lease_generation": 2,
            },
            {
                "batch_id": y_id,
                "claim_id": None,
                "claim_token": None,
                "claim_fencing_token": 0,
                "claim_session_lease_generation": 0,
            },
        ]
        assert _raw_inputs(f.store, sid) == [
            {
                "input_id": i1_id,
                "state": "deferred_next_turn",
                "claim_id": p_inputs.claim_id,
                "claim_token": p_inputs.lease_token,
                "claim_session_lease_generation": 2,
            },
            {
                "input_id": i2_id,
                "state": "deferred_next_turn",
                "claim_id": None,
                "claim_token": None,
                "claim_session_lease_generation": 0,
            },
        ]
    finally:
        f.store.close()
