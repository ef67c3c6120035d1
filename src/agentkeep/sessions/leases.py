"""Fenced session execution leases: acquire, take over, renew, release, and the FENCE_OK check.

One lease per session decides who may work on it
(docs/sessions.md#execution-leases; its states and transitions:
docs/sessions.md#lease-states). Its ``fencing_token`` is the session-lease
*generation*: it grows by exactly one on every acquisition or takeover and
never decreases (release keeps it), so a worker that lost the lease can be
told apart from the one that holds it by a single integer.

Every operation takes the ``session:<id>`` write lock first
(:func:`agentkeep.db.lock_aggregate`), samples ``now`` once after it, and
writes with a fenced statement; inside the lock a fence that matches nothing
is a bug signal (:class:`~agentkeep.errors.ConcurrentModification`).

Round trips (psycopg, sync or asyncio). Claim and reclaim send the lease
read with ``BEGIN`` and the lock, in their round trip
(:meth:`Driver.prefetching`); the fenced write needs ``now``, sampled once
the lock is held, so it goes in a second round trip, with ``COMMIT`` in a
one-call unit (``_last_write``): two. In a ``store.write()`` unit the write
and ``COMMIT`` go separately (four, with the unit's own ``BEGIN``); on
asyncpg, which does not pipeline, four.
Renew reads nothing first: FENCE_OK is its UPDATE's WHERE (the holder fence
and ``expires > now``, ``now`` sampled once the lock is held), which returns
the stored ``claimed_at``; the lease row is read only to say why a refused
renew was refused (it goes with the UPDATE on psycopg). In a one-call unit
the UPDATE goes with ``COMMIT``: two round trips (``BEGIN`` + lock, UPDATE +
``COMMIT``); three on asyncpg; on SQLite ``BEGIN IMMEDIATE``, the UPDATE,
``COMMIT``. Renew keeps the lock round trip: a statement that took the lock
itself would compare the expiry with a ``now`` sampled before it, possibly
older than that of a writer that ran in between and saw the lease expired
(docs/decisions.md#now-is-sampled-once-after-the-lock). Release reads
nothing and compares no time: in a one-call unit on Postgres (psycopg and
asyncpg) it is one statement of its own that takes the lock itself if free
(:func:`_release_alone`), one round trip; when the lock is held elsewhere, or
in a ``store.write()`` unit, its fenced UPDATE goes out with ``BEGIN`` and the
lock (:func:`_run_locked`; two round trips on psycopg), and still runs only
once the lock is granted. SQLite: ``BEGIN IMMEDIATE``, the UPDATE, ``COMMIT``.

:func:`ensure_session_execution_lease` is FENCE_OK
(docs/sessions.md#named-predicates): the one check every fenced operation of
the session store calls (claims, completions, commits).

Outcomes:

* :class:`Acquired` — the caller holds the lease (new, extended, or taken over);
* :class:`Busy` — another owner holds a live lease; nothing was written;
* :class:`~agentkeep.errors.SessionExecutionLeaseExpired` — a renew or a
  fenced operation presented a fence that is not the live lease.

Statements are module-level :class:`~agentkeep.statements.Statement` constants
built from :class:`~agentkeep.sessions.models.SessionLeaseRow` (``leases.*``),
run on the unit's driver with the parameter names the methods pass
(``sid``, ``owner``, ``inc``, ``token``, ``fencing``, ...). The holder fence of
takeover, renew and release is one shared predicate: session, owner,
incarnation (a NULL incarnation reads as the owner id), token and generation.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any, Final

from sqlalchemy import bindparam as p
from sqlalchemy import func, null, select, true, update
from sqlalchemy.engine import Dialect

from agentkeep import observability
from agentkeep.clock import Clock
from agentkeep.db import (
    Driver,
    LockNamespace,
    aggregate_lock_params,
    aggregate_try_lock_cte,
    lock_aggregate,
    lock_aggregate_and_blobs,
)
from agentkeep.errors import (
    ConcurrentModification,
    ReadOnlyUnitOfWork,
    SessionCorrupt,
    SessionExecutionLeaseExpired,
    SessionLeaseHeld,
)
from agentkeep.sessions.codec import decode_owner, encode_liveness
from agentkeep.sessions.domain import (
    Acquired,
    AcquireOutcome,
    Busy,
    LeaseFence,
    LeaseOwnerIdentity,
    SessionExecutionLease,
    check_fence,
    check_id,
    check_ms,
    check_owner,
    checked_lease,
    same_incarnation,
    saturating_add,
)
from agentkeep.sessions.liveness import (
    ProcessProbe,
    is_definitely_dead_for_claimant,
    procfs_probe,
)
from agentkeep.sessions.models import SessionLeaseRow
from agentkeep.statements import Statement, upsert

__all__ = [
    "SessionLeaseRepository",
    "begin_session_write",
    "ensure_session_execution_lease",
    "guard_session_write",
    "LEASE_COLUMNS",
    "check_fence_row",
    "lease_read",
    "release_locked",
]

_L = SessionLeaseRow
_BY_SESSION = _L.session_id == p("sid")
#: The lease row as :class:`_Row` reads it (positions matter).
_LEASE_COLUMNS: Final = (
    _L.lease_owner_id,
    _L.lease_owner_incarnation_id,
    _L.lease_owner_liveness_json,
    _L.lease_token,
    _L.lease_fencing_token,
    _L.lease_claimed_at_ms,
    _L.lease_expires_at_ms,
)
_GET: Final = Statement(select(*_LEASE_COLUMNS).where(_BY_SESSION), name="leases.get")


def _acquire(dialect: Dialect) -> Any:
    """Insert, or overwrite the row whose generation was read.

    An acquisition as described in docs/sessions.md#execution-leases.
    """
    insert = upsert(dialect, _L).values(
        session_id=p("sid"),
        lease_owner_id=p("owner"),
        lease_owner_incarnation_id=p("inc"),
        lease_owner_liveness_json=p("liveness"),
        lease_token=p("token"),
        lease_fencing_token=p("fencing"),
        lease_claimed_at_ms=p("now"),
        lease_expires_at_ms=p("expires"),
    )
    taken = (col.key for col in _LEASE_COLUMNS)
    return insert.on_conflict_do_update(
        index_elements=[_L.session_id],
        set_={key: insert.excluded[key] for key in taken},
        where=_L.lease_fencing_token == p("previous"),
    ).returning(_L.lease_fencing_token)


_ACQUIRE: Final = Statement(_acquire, name="leases.acquire")
_EXTEND: Final = Statement(
    update(_L)
    .values(lease_expires_at_ms=p("expires"))
    .where(_BY_SESSION, _L.lease_token == p("token"), _L.lease_fencing_token == p("fencing")),
    name="leases.extend",
)
#: The holder fence: session, owner, incarnation (NULL reads as the owner), token, generation.
_HOLDER_FENCE: Final = (
    _BY_SESSION,
    _L.lease_owner_id == p("owner"),
    func.coalesce(_L.lease_owner_incarnation_id, _L.lease_owner_id) == p("inc"),
    _L.lease_token == p("token"),
    _L.lease_fencing_token == p("fencing"),
)
_TAKEOVER: Final = Statement(
    update(_L)
    .values(
        lease_owner_id=p("new_owner"),
        lease_owner_incarnation_id=p("new_inc"),
        lease_owner_liveness_json=p("new_liveness"),
        lease_token=p("new_token"),
        lease_fencing_token=p("new_fencing"),
        lease_claimed_at_ms=p("now"),
        lease_expires_at_ms=p("expires"),
    )
    .where(*_HOLDER_FENCE),
    name="leases.takeover",
)
#: The renew: FENCE_OK (the holder fence and ``expires > now``) in the UPDATE's WHERE,
#: run under the lock with ``now`` sampled after it; the stored ``claimed_at`` back.
_RENEW: Final = Statement(
    update(_L)
    .values(lease_expires_at_ms=p("expires"))
    .where(*_HOLDER_FENCE, _L.lease_expires_at_ms > p("now"))
    .returning(_L.lease_claimed_at_ms),
    name="leases.renew",
)
# Release keeps lease_fencing_token: the next acquisition is generation + 1.
_RELEASED: Final = {
    _L.lease_owner_id: null(),
    _L.lease_owner_incarnation_id: null(),
    _L.lease_owner_liveness_json: null(),
    _L.lease_token: null(),
    _L.lease_claimed_at_ms: 0,
    _L.lease_expires_at_ms: 0,
}
_RELEASE: Final = Statement(
    update(_L).values(_RELEASED).where(*_HOLDER_FENCE), name="leases.release"
)


def holder_fence() -> tuple[Any, ...]:
    """The holder fence (FENCE_OK without the clock) as WHERE terms on the lease row.

    They bind ``:sid``, ``:owner``, ``:inc`` (a NULL stored incarnation is
    read as the owner id), ``:token`` and ``:fencing``: for a statement of
    another module that checks or releases a lease in SQL (the turn commit's
    checking statement, ``sessions.commits._checked_turn``).
    """
    return _HOLDER_FENCE


def release_update() -> Any:
    """The fenced release (:data:`_RELEASE`'s UPDATE, :func:`holder_fence`) as a construct."""
    return update(_L).values(_RELEASED).where(*_HOLDER_FENCE)


def _release_alone() -> Statement:
    """The release as one statement that takes ``session:<id>`` itself (Postgres, one-call units).

    The release's UPDATE, fenced as :data:`_RELEASE` (the holder fence: no
    clock, nothing read before), runs only if the statement got the
    session's write lock (:func:`agentkeep.db.aggregate_try_lock_cte`, which
    does not wait), so a unit holding ``session:<id>`` (a turn commit, a
    claim, a renew) excludes it as it excludes the locked path; Postgres
    re-checks the fence on the row's latest version. One row: ``moved`` (1:
    this call released the lease) and ``locked`` (the statement held the
    lock). ``moved`` 0 with ``locked`` true is the locked path's silent no-op
    (the fence matched nothing while every other lease writer was excluded);
    ``moved`` 0 with ``locked`` false (the lock held elsewhere) hands over to
    the locked path, which waits for the lock.
    """
    lock = aggregate_try_lock_cte("lease_lock")
    locked = select(lock.c.locked).scalar_subquery()
    moved = (
        update(_L)
        .values(_RELEASED)
        .where(*_HOLDER_FENCE, locked.is_(true()))
        .returning(_L.session_id)
        .cte("moved")
    )
    return Statement(
        select(
            select(func.count()).select_from(moved).scalar_subquery().label("moved"),
            locked.label("locked"),
        ).add_cte(moved),
        name="leases.release_alone",
    )


_RELEASE_ALONE: Final = _release_alone()


# --------------------------------------------------------------------------
# Shared by every session-store write


def begin_session_write(
    db: Driver, clock: Clock, writable: bool, session_id: str, *, blobs: bool = False
) -> int:
    """Take the ``session:<id>`` write lock and return ``now`` (ms), sampled after it.

    With ``blobs``, also the blob GC lock shared (a write that stores blobs),
    in the same statement.

    Raises:
        ReadOnlyUnitOfWork: inside ``store.read()``.
    """
    if not writable:
        raise ReadOnlyUnitOfWork("session store writes need store.write(), not store.read()")
    if blobs:
        lock_aggregate_and_blobs(db, LockNamespace.SESSION, session_id)
    else:
        lock_aggregate(db, LockNamespace.SESSION, session_id)
    return clock.now_ms()


class _Row:
    """A lease row as read (positions of :data:`_LEASE_COLUMNS`)."""

    __slots__ = ("claimed_at", "expires", "fencing", "owner", "token")

    def __init__(self, session_id: str, row: Sequence[Any]) -> None:
        self.owner = decode_owner(row[0], row[1], row[2])
        self.token: str | None = row[3]
        self.fencing: int = row[4]
        self.claimed_at: int = row[5]
        self.expires: int = row[6]
        if type(self.fencing) is not int or self.fencing < 0:
            raise SessionCorrupt(
                "session_execution_leases", session_id, "lease_fencing_token", repr(self.fencing)
            )

    def live(self, now: int) -> bool:
        """LEASE_LIVE: a token is set and the expiry is strictly after ``now``."""
        return self.token is not None and self.expires > now

    def holder(self, session_id: str) -> SessionExecutionLease:
        if self.owner is None or self.token is None:
            what = "owner" if self.owner is None else "lease token"
            raise SessionCorrupt(
                "session_execution_leases",
                session_id,
                "lease_owner_id",
                f"live lease missing {what}",
            )
        return checked_lease(
            session_id=session_id,
            owner=self.owner,
            lease_token=self.token,
            fencing_token=self.fencing,
            claimed_at_epoch_ms=self.claimed_at,
            expires_at_epoch_ms=self.expires,
        )


def _load(db: Driver, session_id: str) -> _Row | None:
    row = db.execute(_GET, {"sid": session_id}).fetchone()
    return None if row is None else _Row(session_id, row)


def _run_locked(
    db: Driver, clock: Clock, writable: bool, session_id: str, stmt: Statement, params: Any
) -> Any:
    """Take the ``session:<id>`` write lock, then run ``stmt``: one round trip on psycopg.

    For a single fenced write that needs neither a read nor ``now``
    (release): the statement is sent right after the lock, in its pipelined
    round trip (:meth:`Driver.prefetching`), and the server runs it once the
    lock is granted, so it is serialised with every other session writer
    exactly as if it were sent after the lock's answer. Its result is taken
    at once; if the lock fails, the server does not run it. Elsewhere the
    lock and the statement run one after the other.

    Raises:
        ReadOnlyUnitOfWork: inside ``store.read()``.
    """
    with db.prefetching([(stmt, params)]):
        begin_session_write(db, clock, writable, session_id)
        return db.execute(stmt, params)


def lease_read(session_id: str) -> tuple[Statement, dict[str, Any]]:
    """The read FENCE_OK makes of ``session_id``'s lease, for :meth:`Driver.prefetching`."""
    return _GET, {"sid": session_id}


def release_locked(db: Driver, completion: LeaseFence) -> None:
    """The fenced release of :meth:`SessionLeaseRepository.release_session_execution_lease`.

    Without taking the lock: for a caller that holds ``session:<id>`` already
    (a commit's step 21). The write is deferred (:meth:`Driver.defer`): it
    returns nothing and a mismatch is a silent no-op, so it can go out with
    the caller's other writes; the caller flushes before it returns.

    Raises:
        InvalidInput: bad fence.
    """
    db.defer(_RELEASE, _release_params(completion))


def _release_params(completion: LeaseFence) -> dict[str, Any]:
    """The holder fence of a release (checked: raises InvalidInput for a bad fence)."""
    _check_fence(completion, "completion")
    check_id(completion.session_id, "completion.session_id")
    return {
        "sid": completion.session_id,
        "owner": completion.owner.owner_id,
        "inc": completion.owner.incarnation_id,
        "token": completion.lease_token,
        "fencing": completion.fencing_token,
    }


def _check_fence(value: object, field: str) -> LeaseFence:
    return check_fence(value, field)


def _check_owner(value: object) -> LeaseOwnerIdentity:
    return check_owner(value)


def ensure_session_execution_lease(
    db: Driver, session_id: str, fence: LeaseFence, now: int
) -> None:
    """FENCE_OK: ``fence`` is the live lease of ``session_id`` at ``now``.

    See docs/sessions.md#named-predicates.

    A pure read; it never extends the lease. Call it inside the write unit,
    after :func:`begin_session_write`.

    Raises:
        SessionExecutionLeaseExpired: the fence names another session; no lease
            row exists; the owner (incarnation), token or generation differ; or
            the lease expired (``expires <= now``).
    """
    _fenced_row(db, session_id, fence, now)


def _fenced_row(db: Driver, session_id: str, fence: LeaseFence, now: int) -> _Row:
    """FENCE_OK, returning the lease row it checked."""
    if fence.session_id != session_id:
        raise SessionExecutionLeaseExpired(session_id)
    return _checked(session_id, fence, now, _load(db, session_id))


#: The lease columns FENCE_OK reads, in :func:`check_fence_row`'s order, for a
#: caller that selects them in a statement of its own (under the session lock).
LEASE_COLUMNS: Final = _LEASE_COLUMNS


def check_fence_row(
    session_id: str, fence: LeaseFence, now: int, raw: Sequence[Any] | None
) -> None:
    """FENCE_OK on the lease row ``raw`` (:data:`LEASE_COLUMNS`, None: no row) that the
    caller read under ``session_id``'s write lock: the same check, outcome and
    errors as :func:`ensure_session_execution_lease`, without its read.

    Raises:
        SessionExecutionLeaseExpired: as :func:`ensure_session_execution_lease`.
        SessionCorrupt: the stored fencing token is not a non-negative integer.
    """
    if fence.session_id != session_id:
        raise SessionExecutionLeaseExpired(session_id)
    _checked(session_id, fence, now, None if raw is None else _Row(session_id, raw))


def _checked(session_id: str, fence: LeaseFence, now: int, row: _Row | None) -> _Row:
    if (
        row is None
        or row.owner is None
        or not same_incarnation(row.owner, fence.owner)
        or row.token != fence.lease_token
        or row.fencing != fence.fencing_token
        or not row.expires > now
    ):
        raise SessionExecutionLeaseExpired(session_id)
    return row


def guard_session_write(
    db: Driver, session_id: str, fence: LeaseFence | None, now: int, renew_ms: int | None = None
) -> None:
    """LEASE_GUARD: a write guarded by ``session_id``'s lease may go ahead at ``now``.

    The one check of writes that are allowed without a lease but must not
    interleave with an owner's (checkpoint nodes and pending writes,
    docs/sessions.md#checkpoint-nodes):

    * ``fence`` None: allowed unless another owner holds a **live** lease
      (LEASE_LIVE: a token set and ``expires > now``); a released or
      expired lease does not block (expiry is how a crashed owner's lease is
      reclaimed).
    * ``fence`` given: FENCE_OK (:func:`ensure_session_execution_lease`);
      with ``renew_ms``, a lease with less than half of ``renew_ms`` left is
      extended to ``now + renew_ms`` in the same transaction (fenced on the
      token and generation just checked), so an owner that keeps writing
      keeps its lease.

    Call it inside the write unit, after :func:`begin_session_write`.

    Raises:
        SessionLeaseHeld: no fence, and another owner holds a live lease.
        SessionExecutionLeaseExpired: the fence is not the live lease (lost,
            taken over, expired or released).
    """
    if fence is None:
        row = _load(db, session_id)
        if row is not None and row.live(now):
            holder = row.holder(session_id)
            raise SessionLeaseHeld(session_id, holder.owner.owner_id, row.expires)
        return
    row = _fenced_row(db, session_id, fence, now)
    if renew_ms is not None and row.expires - now < renew_ms // 2:
        params = {
            "sid": session_id,
            "token": row.token,
            "fencing": row.fencing,
            "expires": saturating_add(now, renew_ms),
        }
        if db.execute(_EXTEND, params).rowcount != 1:
            raise ConcurrentModification(f"session {session_id}: lease changed under the lock")


# --------------------------------------------------------------------------
# The repository


def _note_expired_takeover(
    row: _Row | None, session_id: str, owner: LeaseOwnerIdentity, fencing: int
) -> None:
    """Log and count an acquisition that took an unreleased, expired lease from another owner."""
    if (
        row is not None
        and row.token is not None
        and row.owner is not None
        and not same_incarnation(row.owner, owner)
    ):
        observability.lease_takeover(
            "expired", session_id, row.owner.owner_id, owner.owner_id, fencing
        )


class SessionLeaseRepository:
    """Session execution lease operations inside one unit of work (``uow.leases``)."""

    def __init__(
        self, driver: Driver, clock: Clock, *, writable: bool, nested: bool = True
    ) -> None:
        self._db = driver
        self._clock = clock
        self._writable = writable
        # A one-call unit (not nested) holds this one operation and nothing else:
        # a release may then run as a transaction of its own, and a renew may
        # send COMMIT with its write.
        self._alone = not nested and driver.postgres

    def _begin_and_load(self, session_id: str) -> tuple[int, _Row | None]:
        """Take the write lock, sample ``now`` after it, and read the lease row.

        On psycopg the read goes out with the lock, in its round trip.
        """
        with self._db.prefetching([lease_read(session_id)]):
            now = begin_session_write(self._db, self._clock, self._writable, session_id)
            return now, _load(self._db, session_id)

    def _last_write(self) -> AbstractContextManager[None]:
        """The block around a claim's or a reclaim's one write, the last statement of its unit.

        In a one-call unit on psycopg (:attr:`Driver.commits_with_write`) the
        write goes with ``COMMIT``, in one round trip: every decision was made
        from the lease row read under the lock, and the write is fenced on
        that row, so a write that matches nothing (a bug signal under the
        lock: ConcurrentModification) wrote nothing and the COMMIT commits
        nothing. A connection lost with that round trip in flight leaves the
        outcome unknown (``CommitOutcomeUnknown``); the one-call forms settle
        it by claiming again (``store.leases``). Elsewhere the unit commits
        as usual.
        """
        db = self._db
        return db.prefetching((), commit=self._alone and db.commits_with_write)

    def _acquire(
        self, session_id: str, owner: LeaseOwnerIdentity, previous: int | None, now: int, ttl: int
    ) -> SessionExecutionLease:
        """An acquisition: the next generation, a fresh token, ``expires = now + ttl``.

        ``now + ttl`` saturates at 2**63-1 (docs/sessions.md#execution-leases).
        """
        fencing = saturating_add(previous or 0, 1)
        token = f"{session_id}:{owner.owner_id}:{owner.incarnation_id}:{now}:{fencing}"
        expires = saturating_add(now, ttl)
        params = {
            "sid": session_id,
            "owner": owner.owner_id,
            "inc": owner.incarnation_id,
            "liveness": encode_liveness(owner),
            "token": token,
            "fencing": fencing,
            "now": now,
            "expires": expires,
            "previous": previous if previous is not None else -1,
        }
        with self._last_write():
            acquired = self._db.execute(_ACQUIRE, params).fetchone()
        if acquired is None:
            raise ConcurrentModification(
                f"session {session_id}: lease changed under the write lock"
            )
        return checked_lease(
            session_id=session_id,
            owner=owner,
            lease_token=token,
            fencing_token=fencing,
            claimed_at_epoch_ms=now,
            expires_at_epoch_ms=expires,
        )

    def try_claim_session_execution_lease(
        self, session_id: str, owner: LeaseOwnerIdentity, ttl_ms: int
    ) -> AcquireOutcome:
        """Acquire the session's lease, or extend it if ``owner`` already holds it.

        See docs/sessions.md#try_claim_session_execution_lease.

        * No live lease (none, released, or ``expires <= now``): acquire with
          generation ``previous + 1`` — also for the previous owner, whose
          claims then go stale.
        * A live lease of the same incarnation: extend to ``now + ttl``
          (which may shorten it); token and generation unchanged.
        * A live lease of anyone else: :class:`Busy` naming the holder.

        ``ttl_ms = 0`` acquires a lease that is already not live.

        Raises:
            InvalidInput: blank session id, bad owner, ttl outside ``0..2**63-1``.
        """
        check_id(session_id, "session_id")
        _check_owner(owner)
        check_ms(ttl_ms, "ttl_ms")
        now, row = self._begin_and_load(session_id)
        if row is not None and row.live(now):
            holder = row.holder(session_id)
            if not same_incarnation(holder.owner, owner):
                return Busy(holder=holder)
            expires = saturating_add(now, ttl_ms)
            params = {
                "sid": session_id,
                "expires": expires,
                "token": row.token,
                "fencing": row.fencing,
            }
            with self._last_write():
                extended = self._db.execute(_EXTEND, params).rowcount
            if extended != 1:
                raise ConcurrentModification(f"session {session_id}: lease changed under the lock")
            return Acquired(
                lease=holder.model_copy(update={"owner": owner, "expires_at_epoch_ms": expires})
            )
        previous = None if row is None else row.fencing
        lease = self._acquire(session_id, owner, previous, now, ttl_ms)
        _note_expired_takeover(row, session_id, owner, lease.fencing_token)
        return Acquired(lease=lease)

    def reclaim_session_execution_lease(
        self,
        session_id: str,
        owner: LeaseOwnerIdentity,
        observed_holder: LeaseFence,
        ttl_ms: int,
        *,
        probe: ProcessProbe = procfs_probe,
    ) -> AcquireOutcome:
        """Take the lease over from a holder that is definitely dead.

        See docs/sessions.md#reclaim_session_execution_lease.

        A lease that is absent, released or expired is simply acquired
        (``observed_holder`` is ignored). A live lease is taken over — with
        generation + 1 — only if ``observed_holder`` is exactly the stored
        holder (session, incarnation, token, generation) and
        :func:`~agentkeep.sessions.liveness.is_definitely_dead_for_claimant`
        holds for the *stored* holder's liveness; otherwise :class:`Busy`.
        Of two reclaimers of one dead holder, the second sees a new token and
        generation, so it gets ``Busy``.

        Args:
            probe: decides whether a local pid is gone (injectable for tests).

        Raises:
            InvalidInput: blank session id, bad owner or fence, bad ttl.
        """
        check_id(session_id, "session_id")
        _check_owner(owner)
        _check_fence(observed_holder, "observed_holder")
        check_ms(ttl_ms, "ttl_ms")
        now, row = self._begin_and_load(session_id)
        if row is None or not row.live(now):
            previous = None if row is None else row.fencing
            lease = self._acquire(session_id, owner, previous, now, ttl_ms)
            _note_expired_takeover(row, session_id, owner, lease.fencing_token)
            return Acquired(lease=lease)
        holder = row.holder(session_id)
        if not (
            observed_holder.session_id == session_id
            and same_incarnation(holder.owner, observed_holder.owner)
            and holder.lease_token == observed_holder.lease_token
            and holder.fencing_token == observed_holder.fencing_token
            and is_definitely_dead_for_claimant(holder.owner, owner, probe)
        ):
            return Busy(holder=holder)
        fencing = saturating_add(holder.fencing_token, 1)
        token = f"{session_id}:{owner.owner_id}:{owner.incarnation_id}:{now}:{fencing}"
        expires = saturating_add(now, ttl_ms)
        params = {
            "sid": session_id,
            "owner": observed_holder.owner.owner_id,
            "inc": observed_holder.owner.incarnation_id,
            "token": observed_holder.lease_token,
            "fencing": observed_holder.fencing_token,
            "new_owner": owner.owner_id,
            "new_inc": owner.incarnation_id,
            "new_liveness": encode_liveness(owner),
            "new_token": token,
            "new_fencing": fencing,
            "now": now,
            "expires": expires,
        }
        with self._last_write():
            taken = self._db.execute(_TAKEOVER, params).rowcount
        if taken != 1:
            raise ConcurrentModification(f"session {session_id}: lease changed under the lock")
        observability.lease_takeover(
            "reclaimed", session_id, holder.owner.owner_id, owner.owner_id, fencing
        )
        return Acquired(
            lease=checked_lease(
                session_id=session_id,
                owner=owner,
                lease_token=token,
                fencing_token=fencing,
                claimed_at_epoch_ms=now,
                expires_at_epoch_ms=expires,
            )
        )

    def renew_session_execution_lease(
        self, fence: LeaseFence, ttl_ms: int
    ) -> SessionExecutionLease:
        """Extend a live lease held with exactly ``fence`` to ``now + ttl``.

        See docs/sessions.md#renew_session_execution_lease.

        An expired lease cannot be renewed, even if nobody took it over: the
        holder must ``try_claim`` and gets a new generation.

        Raises:
            SessionExecutionLeaseExpired: ``fence`` is not the live lease.
            InvalidInput: bad fence or ttl.
        """
        _check_fence(fence, "fence")
        check_id(fence.session_id, "fence.session_id")
        check_ms(ttl_ms, "ttl_ms")
        sid = fence.session_id
        db = self._db
        # A one-call unit on psycopg that has sent nothing: COMMIT may go with the write.
        commit_ahead = self._alone and db.commits_ahead
        now = begin_session_write(db, self._clock, self._writable, sid)
        expires = saturating_add(now, ttl_ms)
        params = {
            "sid": sid,
            "owner": fence.owner.owner_id,
            "inc": fence.owner.incarnation_id,
            "token": fence.lease_token,
            "fencing": fence.fencing_token,
            "now": now,
            "expires": expires,
        }
        # psycopg: the lease read goes with the UPDATE (and COMMIT), for a refusal only.
        with db.prefetching([lease_read(sid)], commit=commit_ahead):
            renewed = db.execute(_RENEW, params).fetchone()
            if renewed is None:  # the row as FENCE_OK judges it: why it was refused
                _fenced_row(db, sid, fence, now)
                raise ConcurrentModification(f"session {sid}: lease changed under the lock")
        return checked_lease(
            session_id=sid,
            owner=fence.owner,
            lease_token=fence.lease_token,
            fencing_token=fence.fencing_token,
            claimed_at_epoch_ms=renewed[0],
            expires_at_epoch_ms=expires,
        )

    def release_session_execution_lease(self, completion: LeaseFence) -> None:
        """Release the lease held with exactly ``completion``.

        See docs/sessions.md#release_session_execution_lease.

        The generation is kept (the next acquisition is generation + 1). No
        expiry check: an expired, not-taken-over lease can still be released.
        A fence that no longer matches (after a takeover) is a silent no-op.
        Claims pinned to this generation go stale; they are not touched.

        Raises:
            InvalidInput: bad fence.
        """
        params = _release_params(completion)
        sid = completion.session_id
        if self._alone and self._released_alone(sid, params):
            return
        _run_locked(self._db, self._clock, self._writable, sid, _RELEASE, params)

    def _released_alone(self, session_id: str, params: dict[str, Any]) -> bool:
        """Run :data:`_RELEASE_ALONE` as a transaction of its own (Postgres, one round trip).

        Returns True when the release is decided: it released the lease
        (committed with the statement), or it held the session's lock and
        the fence matched nothing (the silent no-op). False, having written
        nothing, when the unit cannot run it alone
        (:meth:`~agentkeep.db.Driver.execute_alone`) or the lock is held
        elsewhere: the locked path decides.

        Raises:
            ReadOnlyUnitOfWork: inside ``store.read()``.
            CommitOutcomeUnknown: the connection was lost with it in flight.
        """
        if not self._writable:
            raise ReadOnlyUnitOfWork("session store writes need store.write(), not store.read()")
        db = self._db
        alone = {**params, **aggregate_lock_params(db, LockNamespace.SESSION, session_id)}
        cur = db.execute_alone(_RELEASE_ALONE, alone)
        if cur is None:
            return False
        moved, locked = cur.fetchone()
        return bool(moved == 1 or locked)

    def ensure_session_execution_lease(self, fence: LeaseFence) -> None:
        """Check that ``fence`` is the live lease now (FENCE_OK); writes nothing.

        Raises:
            SessionExecutionLeaseExpired: it is not.
        """
        _check_fence(fence, "fence")
        check_id(fence.session_id, "fence.session_id")
        ensure_session_execution_lease(self._db, fence.session_id, fence, self._clock.now_ms())

    def get_session_execution_lease(self, session_id: str) -> SessionExecutionLease | None:
        """The stored lease as an observer sees it (live or expired), or None if released/absent."""
        check_id(session_id, "session_id")
        row = _load(self._db, session_id)
        if row is None or row.token is None:
            return None
        return row.holder(session_id)
