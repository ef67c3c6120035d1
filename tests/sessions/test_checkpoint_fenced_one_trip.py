"""Fenced checkpoint puts in one round trip on psycopg (``CheckpointNodeRepository._guarded``).

A one-call fenced put (``put_checkpoint_node`` / ``put_pending_writes`` with
a fence) sends ``BEGIN``, the locks, the *fenced checking read*
(``_FENCED_LEASE_READ``, here folded with the write into one statement) and
``COMMIT`` in one round trip. The server commits only when the fence is the
lease's (owner, incarnation, token, generation), live at the caller's ``now``
with no renewal due. Checked here, counted off the wire (Postgres) and by
outcome (both backends):

* the fence's live lease with no renewal due: one round trip, written, the
  lease row untouched (no renewal);
* the one round trip is the pipeline's implicit transaction: two statements
  (the locks, the check folded with the write), no ``BEGIN`` / ``COMMIT``;
  a session whose default isolation is not READ COMMITTED makes the check
  refuse, and the put goes the explicit ``BEGIN`` way (written, no error);
* a renewal due: the check refuses, the two-round-trip path renews the
  lease and writes (four round trips in all: the refused one, and the
  guard's three with the renewal);
* fence lost (another owner took over), expired, released, or naming
  another session: the typed error, nothing written, the lease row as it was;
* a stored NULL incarnation (read as the owner id) passes as the guard does;
* several write statements (no fold) still take one round trip;
* races with real writers (threads, own connections): an owner writing
  fenced puts while another store takes the lease over never lands a put
  after the takeover; every put that returned is stored, none that raised is.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

from agentkeep import SessionExecutionLeaseExpired
from agentkeep.clock import SettableClock
from agentkeep.sessions.checkpoint_nodes import PendingWrite
from agentkeep.sessions.domain import LeaseOwnerIdentity
from agentkeep.store import Store
from tests.racing import run_threads, wait_ready
from tests.sessions.support import acquire_lease
from tests.support import query

A = LeaseOwnerIdentity(owner_id="owner-A", incarnation_id="a1")
B = LeaseOwnerIdentity(owner_id="owner-B", incarnation_id="b1")
SID = "lg/fenced/"
TTL = 10_000
T0 = 1_000_000


@pytest.fixture
def store(db_url: str) -> Iterator[Store]:
    with Store.open(db_url, clock=SettableClock(T0)) as s:
        yield s


def _clock(store: Store) -> SettableClock:
    clock = store.clock
    assert isinstance(clock, SettableClock)
    return clock


def _put(
    store: Store, node: str, fence: Any, *, sid: str = SID, lease_sid: str | None = None
) -> Any:
    return store._call_operation(
        lambda r: r.checkpoint_nodes.put_checkpoint_node(
            sid, node, node.encode(), lease_session_id=lease_sid, fence=fence, renew_ms=TTL
        )
    )


def _writes(store: Store, node: str, fence: Any, writes: list[PendingWrite]) -> Any:
    return store._call_operation(
        lambda r: r.checkpoint_nodes.put_pending_writes(
            SID, node, "task", writes, fence=fence, renew_ms=TTL
        )
    )


def _lease_row(store: Store, sid: str = SID) -> list[dict[str, Any]]:
    return query(
        store,
        "SELECT lease_owner_id, lease_owner_incarnation_id, lease_token, lease_fencing_token,"
        " lease_claimed_at_ms, lease_expires_at_ms FROM session_execution_leases"
        " WHERE session_id = :s",
        s=sid,
    )


def _nodes(store: Store, sid: str = SID) -> list[str]:
    return sorted(n.node_id for n in store.checkpoint_nodes.list_checkpoint_nodes(sid))


def _trace(store: Store) -> Any:
    if not store.engine.dialect.name.startswith("postgres"):
        return None
    from tests.sessions.test_round_trips import Trace

    return Trace(store.engine, store)


class _Trips:
    """Round trips of a block on Postgres (None elsewhere: nothing to count)."""

    def __init__(self, store: Store) -> None:
        self.trace = _trace(store)
        self.count: int | None = None

    def __enter__(self) -> _Trips:
        if self.trace is not None:
            self._cm = self.trace.round_trips()
            self._out = self._cm.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.trace is not None:
            self._cm.__exit__(*exc)
            self.count = len(self._out)
            self.trace._file.seek(0)
            self.lines = self.trace._file.read().decode("utf-8", "replace").splitlines()

    def executed(self) -> list[str]:
        """The client's Execute messages of the block (one per statement run)."""
        return [line for line in self.lines if line.startswith("F") and "\tExecute" in line]

    def sent_text(self, word: str) -> bool:
        """True when a message the client sent names ``word`` (a statement's text)."""
        return any(line.startswith("F") and word in line for line in self.lines)


def test_a_live_fence_with_no_renewal_due_takes_one_round_trip(store: Store) -> None:
    lease = acquire_lease(store, SID, A, TTL)
    _put(store, "c0", lease)  # warm: the pool's connection is open
    before = _lease_row(store)
    counts = []
    for n in range(1, 7):  # past psycopg's prepare threshold (5)
        _clock(store).advance(100)
        with _Trips(store) as put:
            _put(store, f"c{n}", lease)
        with _Trips(store) as writes:
            _writes(store, f"c{n}", lease, [PendingWrite(0, "a", "json", b"1")])
        with _Trips(store) as several:  # a negative index: two write statements, no fold
            _writes(
                store,
                f"c{n}",
                lease,
                [PendingWrite(1, "b", "json", b"2"), PendingWrite(-1, "e", "json", b"3")],
            )
        counts.append((put.count, writes.count, several.count))
        if put.count is not None:  # the locks, then the check folded with the write
            assert len(put.executed()) == len(writes.executed()) == 2
            assert len(several.executed()) == 4  # the locks, the check, two writes
            assert not put.sent_text("BEGIN") and not put.sent_text("COMMIT")
    if store.engine.dialect.name.startswith("postgres"):
        assert counts == [(1, 1, 1)] * 6
    assert _lease_row(store) == before  # nothing renewed
    assert _nodes(store) == [f"c{n}" for n in range(7)]
    stored = store.checkpoint_nodes.list_pending_writes(SID, "c6")
    assert [(w.idx, w.value) for w in stored] == [(-1, b"3"), (0, b"1"), (1, b"2")]


def test_a_renewal_due_goes_to_the_guard_which_renews(store: Store) -> None:
    lease = acquire_lease(store, SID, A, TTL)
    _put(store, "c0", lease)
    _clock(store).advance(TTL // 2 + 1)  # less than half of renew_ms left: renewal due
    with _Trips(store) as put:
        _put(store, "c1", lease)
    if put.count is not None:
        # The refused check (its implicit transaction is rolled back at the
        # Sync: no ROLLBACK to send), then the guard's way: BEGIN, the locks,
        # the read and the write; the renewal; COMMIT.
        assert put.count == 4
    row = _lease_row(store)[0]
    assert row["lease_expires_at_ms"] == T0 + TTL // 2 + 1 + TTL
    assert row["lease_token"] == lease.lease_token
    assert _nodes(store) == ["c0", "c1"]
    with _Trips(store) as again:  # renewed: back to one round trip
        _writes(store, "c1", lease, [PendingWrite(0, "a", "json", b"1")])
    if again.count is not None:
        assert again.count == 1
    assert len(store.checkpoint_nodes.list_pending_writes(SID, "c1")) == 1


def test_exactly_at_the_renewal_threshold_no_renewal(store: Store) -> None:
    lease = acquire_lease(store, SID, A, TTL)
    _clock(store).advance(TTL - TTL // 2)  # exactly renew_ms // 2 left: not due
    before = _lease_row(store)
    with _Trips(store) as put:
        _put(store, "c1", lease)
    if put.count is not None:
        assert put.count <= 2  # the first put of the connection may not be warm
    assert _lease_row(store) == before
    assert _nodes(store) == ["c1"]


def _refused(store: Store, fence: Any, *, sid: str = SID, lease_sid: str | None = None) -> None:
    before = _lease_row(store, lease_sid or sid)
    with pytest.raises(SessionExecutionLeaseExpired):
        _put(store, "bad", fence, sid=sid, lease_sid=lease_sid)
    with pytest.raises(SessionExecutionLeaseExpired):
        store._call_operation(
            lambda r: r.checkpoint_nodes.put_pending_writes(
                sid,
                "bad",
                "task",
                [PendingWrite(0, "a", "json", b"1")],
                lease_session_id=lease_sid,
                fence=fence,
                renew_ms=TTL,
            )
        )
    assert _lease_row(store, lease_sid or sid) == before
    assert store.checkpoint_nodes.get_checkpoint_node(sid, "bad") is None
    assert store.checkpoint_nodes.list_pending_writes(sid, "bad") == []


def test_a_lost_fence_is_refused_and_nothing_is_written(store: Store) -> None:
    lease = acquire_lease(store, SID, A, TTL)
    _put(store, "c0", lease)
    _clock(store).advance(TTL)  # expired: B takes it over
    taken = acquire_lease(store, SID, B, TTL)
    _refused(store, lease)
    # A fence of the right token but another generation, owner or incarnation.
    for wrong in (
        taken.model_copy(update={"fencing_token": taken.fencing_token + 1}),
        taken.model_copy(update={"owner": A}),
        taken.model_copy(
            update={"owner": LeaseOwnerIdentity(owner_id="owner-B", incarnation_id="b2")}
        ),
        taken.model_copy(update={"lease_token": "not-the-token"}),
    ):
        _refused(store, wrong)
    _put(store, "c1", taken)
    assert _nodes(store) == ["c0", "c1"]


def test_an_expired_fence_is_refused(store: Store) -> None:
    lease = acquire_lease(store, SID, A, TTL)
    _clock(store).advance(TTL)  # expires == now: not live
    _refused(store, lease)


def test_a_released_lease_or_none_is_refused(store: Store) -> None:
    lease = acquire_lease(store, SID, A, TTL)
    store.leases.release_session_execution_lease(lease)
    _refused(store, lease)
    never = lease.model_copy(update={"session_id": "lg/never/"})
    _refused(store, never, sid="lg/never/")  # no lease row at all


def test_a_fence_of_another_session_is_refused(store: Store) -> None:
    lease = acquire_lease(store, SID, A, TTL)
    other = acquire_lease(store, "lg/other/", A, TTL)
    _refused(store, other)  # lease of SID guards the write; the fence names another session
    _refused(store, lease, sid="lg/sub/", lease_sid="lg/other/")


def test_a_stored_null_incarnation_reads_as_the_owner_id(store: Store) -> None:
    solo = LeaseOwnerIdentity(owner_id="solo", incarnation_id="solo")
    lease = acquire_lease(store, SID, solo, TTL)
    with store.engine.begin() as conn:
        from sqlalchemy import text

        conn.execute(
            text(
                "UPDATE session_execution_leases SET lease_owner_incarnation_id = NULL"
                " WHERE session_id = :s"
            ),
            {"s": SID},
        )
    _put(store, "c0", lease)
    with _Trips(store) as put:
        _put(store, "c1", lease)
    if put.count is not None:
        assert put.count == 1
    assert _nodes(store) == ["c0", "c1"]
    other_inc = lease.model_copy(
        update={"owner": LeaseOwnerIdentity(owner_id="solo", incarnation_id="x")}
    )
    _refused(store, other_inc)


# --------------------------------------------------------------------------
# Races with real writers (own Store and connections each, started together)

ROUNDS = 3
#: At most this many puts of the owner per round (it stops at its first refusal).
PUTS = 5_000
#: The taker claims once it has seen this many of the owner's puts.
SEEN = 5


def _owner(url: str, barrier: threading.Barrier, sid: str, lease: Any) -> list[tuple[str, bool]]:
    """Fenced puts as fast as it can; its clock stays at T0 (the lease looks live to it)."""
    out: list[tuple[str, bool]] = []
    with Store.open(url, clock=SettableClock(T0)) as store:
        _put(store, "warm", lease, sid=sid)
        wait_ready(barrier)
        for n in range(PUTS):
            try:
                _put(store, f"a{n:03}", lease, sid=sid)
            except SessionExecutionLeaseExpired:
                out.append((f"a{n:03}", False))
                break
            out.append((f"a{n:03}", True))
    return out


def _taker(url: str, barrier: threading.Barrier, sid: str) -> list[str]:
    """Takes the lease over (its clock is past the expiry), then reads the thread."""
    with Store.open(url, clock=SettableClock(T0 + 10 * TTL)) as store:
        store.checkpoint_nodes.list_checkpoint_nodes(sid)  # warm
        wait_ready(barrier)
        while len(_nodes(store, sid)) < SEEN:  # mid-stream: the owner is writing
            pass
        acquire_lease(store, sid, B, TTL)
        return _nodes(store, sid)


def test_race_a_takeover_stops_the_owners_fenced_puts(db_url: str) -> None:
    for round_ in range(ROUNDS):
        sid = f"race/fenced/{round_}/"
        with Store.open(db_url, clock=SettableClock(T0)) as store:
            lease = acquire_lease(store, sid, A, TTL)
        barrier = threading.Barrier(2)
        wrote, seen = run_threads(
            [(_owner, (db_url, barrier, sid, lease)), (_taker, (db_url, barrier, sid))]
        )
        with Store.open(db_url) as store:
            final = set(_nodes(store, sid))
        landed = {n for n, ok in wrote if ok}
        refused = {n for n, ok in wrote if not ok}
        assert landed <= final and not refused & final
        # Nothing of the owner landed after the taker claimed and read the thread.
        assert final == set(seen), (round_, sorted(final - set(seen)))
        assert len(refused) == 1, "the owner was never refused"
        assert len(landed) >= SEEN - 1


def test_a_default_isolation_other_than_read_committed_goes_the_begin_way(
    store: Store, db_url: str
) -> None:
    """The implicit transaction runs at the session's default isolation: the check
    refuses unless it is READ COMMITTED, and the put begins explicitly instead."""
    if not store.engine.dialect.name.startswith("postgres"):
        pytest.skip("Postgres only: the session's default isolation")
    from sqlalchemy import event

    from agentkeep.store import _release_parked

    def repeatable_read(dbapi_conn: Any, *_: Any) -> None:
        was = dbapi_conn.autocommit
        dbapi_conn.autocommit = True
        dbapi_conn.execute("SET default_transaction_isolation = 'repeatable read'")
        dbapi_conn.autocommit = was

    lease = acquire_lease(store, SID, A, TTL)
    # The setting is made at checkout: every unit checks out (none parks its connection).
    store._park = False
    _release_parked(store._parked)
    event.listen(store.engine, "checkout", repeatable_read)
    for fence in (lease, None):
        store.leases.release_session_execution_lease(lease) if fence is None else None
        node = "fenced" if fence is not None else "plain"
        with _Trips(store) as put:
            _put(store, node, fence)
        assert put.count == 3  # the refused check, then BEGIN ... and COMMIT
        assert put.sent_text("BEGIN ISOLATION LEVEL READ COMMITTED")
    assert _nodes(store) == ["fenced", "plain"]
