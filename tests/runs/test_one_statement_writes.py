"""One-call ``try_transition`` and ``acquire_assignee`` on Postgres: the lock inside the statement.

In a one-call unit on Postgres, ``try_transition`` is one statement whose
UPDATE takes the ``run:<id>`` advisory lock itself, and ``acquire_assignee``
a read plus one such UPDATE (docs/runs.md#try_transition,
docs/runs.md#acquire_assignee). These tests check what that form must keep
of the locked path: the round trips it saves, exclusion by a unit holding
the run's lock, stamps that never move back (the locked path decides when
the clock is behind the stored stamp), and exactly one winner when it races
the locked path (``store.write()`` units). On SQLite the same tests run the
locked path and must give the same answers.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from sqlalchemy import create_engine, make_url, text

from agentkeep import db
from agentkeep.clock import SettableClock
from agentkeep.errors import CommitOutcomeUnknown
from agentkeep.runs.domain import (
    Assignee,
    DegradationEntry,
    Released,
    RunRecord,
    RunStatus,
    Stale,
    StepEntry,
)
from agentkeep.store import Store
from tests.sessions.test_round_trips import Trace

T0_MS = 1_700_000_000_000
T0_S = T0_MS // 1000


def test_one_call_transition_and_acquire_round_trips(backend: str, db_url: str) -> None:
    """psycopg: try_transition 1 round trip (won or lost); acquire, append, vacate 2 (Stale: 1).

    Counted once every statement has run past psycopg's prepare threshold (5):
    the execution that prepares a statement takes one more round trip, once
    per connection.
    """
    if backend != "postgres":
        pytest.skip("round trips are counted on Postgres")
    store = Store.open(db_url, clock=SettableClock(T0_MS))
    try:
        trace = Trace(store.engine)
        store.runs.create(RunRecord.new("R-rt", "T-1", 100))
        counts = []
        for i in range(8):
            with trace.round_trips() as won:
                assert store.runs.try_transition("R-rt", RunStatus.PENDING, RunStatus.RUNNING)
            with trace.round_trips() as lost:
                assert not store.runs.try_transition("R-rt", RunStatus.PENDING, RunStatus.DONE)
            with trace.round_trips() as absent:
                assert not store.runs.try_transition("R-absent", RunStatus.PENDING, RunStatus.DONE)
            store.runs.update_status("R-rt", RunStatus.PENDING)
            with trace.round_trips() as acquired:
                assert store.runs.acquire_assignee("R-rt", "main", f"S-{i}", "w")[0] == i + 1
            step = StepEntry.basic(f"ST-{i}", None, "ok", None, i)
            with trace.round_trips() as appended:
                store.runs.append_step_entry("R-rt", step)
            with trace.round_trips() as stale:
                assert isinstance(store.runs.vacate_assignee("R-rt", "other", 1), Stale)
            counts.append(
                (len(won), len(lost), len(absent), len(acquired), len(appended), len(stale))
            )
        assert counts[6:] == [(1, 1, 1, 2, 2, 1)] * 2, counts
        with trace.round_trips() as released:
            assert store.runs.vacate_assignee("R-rt", "main", 8) == Released(
                generation=9, released=Assignee(op="S-7", desc="w", gen=8)
            )
        assert len(released) == 2, released
        store.runs.acquire_assignee("R-rt", "main", "S-7", "w")
        rec = store.runs.get("R-rt")
        assert rec.next_generation == 10
        assert rec.current == {"main": Assignee(op="S-7", desc="w", gen=10)}
        assert [e.step_id for e in rec.step_entries] == [f"ST-{i}" for i in range(8)]
    finally:
        store.close()


def test_a_clock_behind_the_stored_stamp_still_writes_its_own_stamp(
    store: Store, clock: SettableClock
) -> None:
    """The stamp guard only hands over to the locked path: the answer and stamp are as before."""
    store.runs.create(RunRecord.new("R-back", "T-1", 100, updated_at=T0_S + 50))
    clock.set(T0_MS)  # 50 s behind the stored stamp
    assert store.runs.try_transition("R-back", RunStatus.PENDING, RunStatus.RUNNING)
    rec = store.runs.get("R-back")
    assert (rec.status, rec.updated_at) == (RunStatus.RUNNING, T0_S)
    assert not store.runs.try_transition("R-back", RunStatus.PENDING, RunStatus.RUNNING)
    clock.set(T0_MS - 7000)
    assert store.runs.acquire_assignee("R-back", "main", "S-1", "w") == (1, None)
    rec = store.runs.get("R-back")
    assert (rec.next_generation, rec.updated_at) == (1, T0_S - 7)
    assert rec.current == {"main": Assignee(op="S-1", desc="w", gen=1)}


_WAITERS = "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"


def _waiting_for_advisory_lock(url: str) -> Callable[[], bool]:
    engine = create_engine(url)

    def waiting() -> bool:
        with engine.connect() as conn:
            return bool(conn.execute(text(_WAITERS)).scalar_one())

    waiting.engine = engine  # type: ignore[attr-defined]
    return waiting


OPS: dict[str, tuple[Callable[[Store], Any], Any, Callable[[RunRecord], Any]]] = {
    # op run while a unit holds the lock, its answer, what the row shows after
    "try_transition": (
        lambda s: s.runs.try_transition("R-held", RunStatus.PENDING, RunStatus.RUNNING),
        False,
        lambda rec: rec.status,
    ),
    "acquire_assignee": (
        lambda s: s.runs.acquire_assignee("R-held", "main", "S-new", "after"),
        (2, Assignee(op="S-unit", desc="in unit", gen=1)),
        lambda rec: (rec.next_generation, rec.current["main"]),
    ),
    # Seeded holder gen 1 (below); the vacate of gen 1 waits while the unit
    # takes the slot (gen 2): Stale, showing the unit's holder.
    "vacate_assignee": (
        lambda s: s.runs.vacate_assignee("R-held", "main", 1),
        Stale(current=Assignee(op="S-unit", desc="in unit", gen=2)),
        lambda rec: (rec.next_generation, rec.current.get("main")),
    ),
}


@pytest.mark.parametrize("op", list(OPS))
def test_a_unit_holding_the_run_lock_excludes_the_one_statement_write(
    backend: str, db_url: str, store: Store, op: str
) -> None:
    """A write unit that holds ``run:<id>`` (without having written the row yet) is waited for.

    The unit takes the lock with a try_transition that loses (no row written),
    then, once the one-call write is seen waiting for the lock, cancels the
    run and takes the slot. The one-call write must judge the unit's
    committed result: the status is no longer pending (False), the slot's
    holder is the unit's (displaced, G advanced past it).
    """
    if backend != "postgres":
        pytest.skip("the run lock is a Postgres advisory lock (SQLite: BEGIN IMMEDIATE)")
    call, expected, shown = OPS[op]
    store.runs.create(RunRecord.new("R-held", "T-1", 100))
    if op == "vacate_assignee":
        store.runs.acquire_assignee("R-held", "main", "S-old", "seeded")
    other = Store.open(db_url, clock=SettableClock(T0_MS + 1000), busy_timeout_ms=10_000)
    waiting = _waiting_for_advisory_lock(db_url)
    result: list[Any] = []
    try:
        with store.write() as uow:
            assert not uow.runs.try_transition("R-held", RunStatus.DONE, RunStatus.RUNNING)
            th = threading.Thread(target=lambda: result.append(call(other)), daemon=True)
            th.start()
            for _ in range(2000):  # until the one-call write waits for the lock (at most ~20 s)
                if waiting() or not th.is_alive():
                    break
                threading.Event().wait(0.01)
            assert waiting(), "the one-call write did not wait for the unit's lock"
            uow.runs.update_status("R-held", RunStatus.CANCELLED)
            uow.runs.acquire_assignee("R-held", "main", "S-unit", "in unit")
        th.join(20)
        assert not th.is_alive()
        assert result == [expected]
        rec = store.runs.get("R-held")
        assert rec.status == RunStatus.CANCELLED
        if op == "try_transition":
            assert shown(rec) == RunStatus.CANCELLED
        elif op == "acquire_assignee":
            assert shown(rec) == (2, Assignee(op="S-new", desc="after", gen=2))
        else:
            assert shown(rec) == (2, Assignee(op="S-unit", desc="in unit", gen=2))
    finally:
        other.close()
        waiting.engine.dispose()  # type: ignore[attr-defined]


def test_one_call_and_unit_transitions_racing_have_one_winner(db_url: str, store: Store) -> None:
    """Threads, half one-call (one statement on Postgres), half in write units (locked path)."""
    k, rounds = 6, 4
    stores = [Store.open(db_url, clock=SettableClock(T0_MS + 1000 * (i + 1))) for i in range(k)]
    barrier = threading.Barrier(k)
    outcomes: list[list[bool]] = [[] for _ in range(k)]

    def racer(i: int) -> None:
        st = stores[i]
        for r in range(rounds):
            barrier.wait()
            run_id = f"R-mix-{r}"
            if i % 2 == 0:
                won = st.runs.try_transition(run_id, RunStatus.INTERRUPTED, RunStatus.RUNNING)
            else:
                with st.write() as uow:
                    won = uow.runs.try_transition(run_id, RunStatus.INTERRUPTED, RunStatus.RUNNING)
            outcomes[i].append(won)

    try:
        for r in range(rounds):
            store.runs.create(RunRecord.new(f"R-mix-{r}", "T-1", 100, status=RunStatus.INTERRUPTED))
        threads = [threading.Thread(target=racer, args=(i,), daemon=True) for i in range(k)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
            assert not th.is_alive()
        for r in range(rounds):
            winners = [i for i in range(k) if outcomes[i][r]]
            assert len(winners) == 1, (r, outcomes)
            rec = store.runs.get(f"R-mix-{r}")
            assert rec.status == RunStatus.RUNNING
            assert rec.updated_at == T0_S + winners[0] + 1
    finally:
        for st in stores:
            st.close()


def test_one_call_and_unit_acquires_racing_hand_out_each_generation_once(
    db_url: str, store: Store
) -> None:
    """Threads acquire one slot, half one-call (read + one statement on Postgres), half in units."""
    k, m = 6, 5
    stores = [Store.open(db_url, clock=SettableClock(T0_MS)) for _ in range(k)]
    barrier = threading.Barrier(k)
    got: list[list[tuple[int, Any]]] = [[] for _ in range(k)]

    def racer(i: int) -> None:
        st = stores[i]
        barrier.wait()
        for j in range(m):
            if i % 2 == 0:
                got[i].append(st.runs.acquire_assignee("R-gen", "main", f"S-{i}", f"d{j}"))
            else:
                with st.write() as uow:
                    got[i].append(uow.runs.acquire_assignee("R-gen", "main", f"S-{i}", f"d{j}"))

    try:
        store.runs.create(RunRecord.new("R-gen", "T-1", 100))
        threads = [threading.Thread(target=racer, args=(i,), daemon=True) for i in range(k)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
            assert not th.is_alive()
        results = [res for per in got for res in per]
        gens = sorted(g for g, _ in results)
        assert gens == list(range(1, k * m + 1))
        # Each displaced holder is the one that took the generation just before.
        by_gen = {g: prev for g, prev in results}
        holders = {
            g: Assignee(op=f"S-{i}", desc=f"d{j}", gen=g)
            for i, per in enumerate(got)
            for j, (g, _) in enumerate(per)
        }
        assert by_gen[1] is None
        for g in range(2, k * m + 1):
            assert by_gen[g] == holders[g - 1], g
        rec = store.runs.get("R-gen")
        assert rec.next_generation == k * m
        assert rec.current == {"main": holders[k * m]}
    finally:
        for st in stores:
            st.close()


def test_a_connection_lost_with_the_one_statement_in_flight_is_an_unknown_outcome(
    backend: str, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The statement is its own COMMIT: a lost connection is ``CommitOutcomeUnknown``, not retried.

    The backend is terminated just before the statement is sent, after the
    unit found the connection open (``Driver.closed_while_idle``: a
    connection already closed takes the locked path and is retried, see
    tests/test_idle_closed_connections.py), so it is not applied and the
    client cannot tell: the one-call form raises ``CommitOutcomeUnknown``
    naming the operation, and the store goes on.
    """
    if backend != "postgres":
        pytest.skip("Postgres only: a backend to terminate")
    admin = psycopg.connect(
        make_url(db_url).set(drivername="postgresql").render_as_string(hide_password=False),
        autocommit=True,
    )
    original = db.Driver.closed_while_idle
    fired: list[int] = []

    def closed_while_idle(driver: db.Driver) -> bool:
        closed = original(driver)
        if not fired:
            pid = driver.raw.info.backend_pid
            admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
            while admin.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchall():
                threading.Event().wait(0.002)
            fired.append(pid)
        return closed

    store = Store.open(db_url, clock=SettableClock(T0_MS))
    try:
        store.runs.create(RunRecord.new("R-lost", "T-1", 100))
        monkeypatch.setattr(db.Driver, "closed_while_idle", closed_while_idle)
        with pytest.raises(CommitOutcomeUnknown) as info:
            store.runs.try_transition("R-lost", RunStatus.PENDING, RunStatus.RUNNING)
        assert info.value.operation == "runs.try_transition"
        assert fired
        assert store.runs.get("R-lost").status == RunStatus.PENDING  # terminated before it ran
        assert store.runs.try_transition("R-lost", RunStatus.PENDING, RunStatus.RUNNING)
    finally:
        store.close()
        admin.close()


def test_a_connection_lost_during_the_unlocked_read_is_retried(
    backend: str, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """acquire_assignee's read (before its one-statement write) lost: ConnectionLost, retried."""
    if backend != "postgres":
        pytest.skip("Postgres only: a backend to terminate")
    admin = psycopg.connect(
        make_url(db_url).set(drivername="postgresql").render_as_string(hide_password=False),
        autocommit=True,
    )
    original = db.Driver.execute_alone
    fired: list[int] = []

    def execute_alone(driver: db.Driver, stmt: Any, params: Any, *, writes: bool = True) -> Any:
        if not fired:
            assert not writes  # the read comes first
            pid = driver.raw.info.backend_pid
            admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
            while admin.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchall():
                threading.Event().wait(0.002)
            fired.append(pid)
        return original(driver, stmt, params, writes=writes)

    store = Store.open(db_url, clock=SettableClock(T0_MS))
    try:
        store.runs.create(RunRecord.new("R-read-lost", "T-1", 100))
        monkeypatch.setattr(db.Driver, "execute_alone", execute_alone)
        assert store.runs.acquire_assignee("R-read-lost", "main", "S-1", "w") == (1, None)
        assert fired
        rec = store.runs.get("R-read-lost")
        assert (rec.next_generation, rec.current) == (
            1,
            {"main": Assignee(op="S-1", desc="w", gen=1)},
        )
    finally:
        store.close()
        admin.close()


def test_one_call_and_unit_appends_racing_lose_nothing(db_url: str, store: Store) -> None:
    """Threads append, half one-call (read + one statement on Postgres), half in units."""
    k, m = 6, 5
    stores = [Store.open(db_url, clock=SettableClock(T0_MS)) for _ in range(k)]
    barrier = threading.Barrier(k)

    def racer(i: int) -> None:
        st = stores[i]
        barrier.wait()
        for j in range(m):
            step = StepEntry.basic(f"ST-{i}-{j}", None, None, None, j)
            deg = DegradationEntry(tool=f"t{i}", error="e", fallback="f", at=j)
            if i % 2 == 0:
                st.runs.append_step_entry("R-app", step)
                st.runs.append_degradation("R-app", deg)
            else:
                with st.write() as uow:
                    uow.runs.append_step_entry("R-app", step)
                    uow.runs.append_degradation("R-app", deg)

    try:
        store.runs.create(RunRecord.new("R-app", "T-1", 100))
        threads = [threading.Thread(target=racer, args=(i,), daemon=True) for i in range(k)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
            assert not th.is_alive()
        rec = store.runs.get("R-app")
        ids = [e.step_id for e in rec.step_entries]
        assert sorted(ids) == sorted(f"ST-{i}-{j}" for i in range(k) for j in range(m))
        for i in range(k):  # each racer's own entries in its order
            assert [x for x in ids if x.startswith(f"ST-{i}-")] == [f"ST-{i}-{j}" for j in range(m)]
        assert sorted((d.tool, d.at) for d in rec.degradations) == sorted(
            (f"t{i}", j) for i in range(k) for j in range(m)
        )
    finally:
        for st in stores:
            st.close()
