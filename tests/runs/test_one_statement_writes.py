"""One-call run store writes on Postgres: the lock inside the statement.

In a one-call unit on Postgres, ``try_transition``, ``update_status``,
``set_result``, ``set_input_json`` and ``delete`` are one statement whose
UPDATE (DELETE) takes the ``run:<id>`` advisory lock itself, and
``acquire_assignee``, ``vacate_assignee`` and the appends a read plus one
such UPDATE (docs/runs.md#common-rules). These tests check what that form must keep
of the locked path: the round trips it saves, exclusion by a unit holding
the run's lock, stamps that never move back (the locked path decides when
the clock is behind the stored stamp), and exactly one winner when it races
the locked path (``store.write()`` units). On SQLite the same tests run the
locked path and must give the same answers.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
from sqlalchemy import create_engine, make_url, text

from agentkeep import db
from agentkeep.clock import SettableClock
from agentkeep.errors import CommitOutcomeUnknown, RunNotFound
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
from tests.racing import Racing, run_threads
from tests.sessions.test_round_trips import Trace

T0_MS = 1_700_000_000_000
T0_S = T0_MS // 1000


def test_one_call_transition_and_acquire_round_trips(backend: str, db_url: str) -> None:
    """psycopg: try_transition 1 round trip (won or lost); acquire, append, vacate 2 (Stale: 1).

    update_status, set_result, set_input_json and delete: 1, also for a
    missing run (RunNotFound).

    Counted once every statement has run past psycopg's prepare threshold (5):
    the execution that prepares a statement takes one more round trip, once
    per connection.
    """
    if backend != "postgres":
        pytest.skip("round trips are counted on Postgres")
    store = Store.open(db_url, clock=SettableClock(T0_MS))
    try:
        trace = Trace(store.engine, store)
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
        singles = []
        for i in range(8):
            store.runs.create(RunRecord.new(f"R-one-{i}", "T-1", 100))
            with trace.round_trips() as status:
                store.runs.update_status(f"R-one-{i}", RunStatus.RUNNING)
            with trace.round_trips() as result:
                store.runs.set_result(f"R-one-{i}", {"ok": i})
            with trace.round_trips() as input_json:
                store.runs.set_input_json(f"R-one-{i}", f'{{"p":{i}}}')
            with trace.round_trips() as deleted:
                store.runs.delete(f"R-one-{i}")
            with trace.round_trips() as missing, pytest.raises(RunNotFound):
                store.runs.update_status(f"R-one-{i}", RunStatus.DONE)
            singles.append((len(status), len(result), len(input_json), len(deleted), len(missing)))
        assert singles[6:] == [(1, 1, 1, 1, 1)] * 2, singles
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


def _after_unit(
    status: RunStatus = RunStatus.CANCELLED, result: Any = "unit", input_json: str = "unit"
) -> Callable[[Store], None]:
    """A check of the row after the unit and then the one-call write (in that order)."""

    def check(s: Store) -> None:
        rec = s.runs.get("R-held")
        assert (rec.status, rec.result_ref, rec.input_json) == (status, result, input_json)

    return check


def _deleted(s: Store) -> None:
    with pytest.raises(RunNotFound):
        s.runs.get("R-held")


def _slots(expected: tuple[int, Assignee | None]) -> Callable[[Store], None]:
    def check(s: Store) -> None:
        _after_unit()(s)
        rec = s.runs.get("R-held")
        assert (rec.next_generation, rec.current.get("main")) == expected

    return check


# op: (the one-call write run while a unit holds the run's lock, its answer, the check of
# the row after both). The unit sets the status to cancelled, takes slot "main" and sets
# the result and input to "unit": the one-call write must come after all of it.
OPS: dict[str, tuple[Callable[[Store], Any], Any, Callable[[Store], None]]] = {
    "try_transition": (
        lambda s: s.runs.try_transition("R-held", RunStatus.PENDING, RunStatus.RUNNING),
        False,
        _after_unit(),
    ),
    "acquire_assignee": (
        lambda s: s.runs.acquire_assignee("R-held", "main", "S-new", "after"),
        (2, Assignee(op="S-unit", desc="in unit", gen=1)),
        _slots((2, Assignee(op="S-new", desc="after", gen=2))),
    ),
    # Seeded holder gen 1 (below); the vacate of gen 1 waits while the unit
    # takes the slot (gen 2): Stale, showing the unit's holder.
    "vacate_assignee": (
        lambda s: s.runs.vacate_assignee("R-held", "main", 1),
        Stale(current=Assignee(op="S-unit", desc="in unit", gen=2)),
        _slots((2, Assignee(op="S-unit", desc="in unit", gen=2))),
    ),
    "update_status": (
        lambda s: s.runs.update_status("R-held", RunStatus.RUNNING),
        None,
        _after_unit(status=RunStatus.RUNNING),
    ),
    "set_result": (
        lambda s: s.runs.set_result("R-held", {"call": 1}),
        None,
        _after_unit(result={"call": 1}),
    ),
    "set_input_json": (
        lambda s: s.runs.set_input_json("R-held", "call"),
        None,
        _after_unit(input_json="call"),
    ),
    "delete": (lambda s: s.runs.delete("R-held"), None, _deleted),
}


@pytest.mark.parametrize("op", list(OPS))
def test_a_unit_holding_the_run_lock_excludes_the_one_statement_write(
    backend: str, db_url: str, store: Store, op: str
) -> None:
    """A write unit that holds ``run:<id>`` (without having written the row yet) is waited for.

    The unit takes the lock with a try_transition that loses (no row written),
    then, once the one-call write is seen waiting for the lock, cancels the
    run, takes the slot and sets the result and input. The one-call write
    must come after the unit's commit: a transition or vacate judges the
    unit's result, an acquire displaces the unit's holder, an unconditional
    write overwrites the unit's value (a delete deletes the row the unit
    wrote to: had it gone first, the unit's writes would raise RunNotFound).
    """
    if backend != "postgres":
        pytest.skip("the run lock is a Postgres advisory lock (SQLite: BEGIN IMMEDIATE)")
    call, expected, check = OPS[op]
    store.runs.create(RunRecord.new("R-held", "T-1", 100))
    if op == "vacate_assignee":
        store.runs.acquire_assignee("R-held", "main", "S-old", "seeded")
    other = Store.open(db_url, clock=SettableClock(T0_MS + 1000), busy_timeout_ms=10_000)
    waiting = _waiting_for_advisory_lock(db_url)
    locked, called = threading.Event(), threading.Event()

    def unit() -> None:
        with store.write() as uow:
            assert not uow.runs.try_transition("R-held", RunStatus.DONE, RunStatus.RUNNING)
            locked.set()
            for _ in range(2000):  # until the one-call write waits for the lock (at most ~20 s)
                if waiting() or called.is_set():
                    break
                threading.Event().wait(0.01)
            assert waiting(), "the one-call write did not wait for the unit's lock"
            uow.runs.update_status("R-held", RunStatus.CANCELLED)
            uow.runs.acquire_assignee("R-held", "main", "S-unit", "in unit")
            uow.runs.set_result("R-held", "unit")
            uow.runs.set_input_json("R-held", "unit")

    def one_call() -> Any:
        assert locked.wait(60)
        try:
            return call(other)
        finally:
            called.set()

    try:
        assert run_threads([(unit, ()), (one_call, ())])[1] == expected
        check(store)
    finally:
        other.close()
        waiting.engine.dispose()  # type: ignore[attr-defined]


@contextmanager
def _racers(db_url: str, k: int, clock_ms: Callable[[int], int]) -> Iterator[list[Store]]:
    """``k`` Stores of their own (racer ``i``'s clock at ``clock_ms(i)``), closed at the end."""
    stores = [Store.open(db_url, clock=SettableClock(clock_ms(i))) for i in range(k)]
    try:
        yield stores
    finally:
        for st in stores:
            st.close()


def test_one_call_and_unit_transitions_racing_have_one_winner(db_url: str, store: Store) -> None:
    """Threads, half one-call (one statement on Postgres), half in write units (locked path)."""
    k, rounds = 6, 4
    barrier = threading.Barrier(k)

    def racer(st: Store, i: int) -> list[bool]:
        outcomes = []
        for r in range(rounds):
            barrier.wait()
            run_id = f"R-mix-{r}"
            if i % 2 == 0:
                won = st.runs.try_transition(run_id, RunStatus.INTERRUPTED, RunStatus.RUNNING)
            else:
                with st.write() as uow:
                    won = uow.runs.try_transition(run_id, RunStatus.INTERRUPTED, RunStatus.RUNNING)
            outcomes.append(won)
        return outcomes

    for r in range(rounds):
        store.runs.create(RunRecord.new(f"R-mix-{r}", "T-1", 100, status=RunStatus.INTERRUPTED))
    with _racers(db_url, k, lambda i: T0_MS + 1000 * (i + 1)) as stores:
        outcomes = run_threads([(racer, (stores[i], i)) for i in range(k)])
    for r in range(rounds):
        winners = [i for i in range(k) if outcomes[i][r]]
        assert len(winners) == 1, (r, outcomes)
        rec = store.runs.get(f"R-mix-{r}")
        assert rec.status == RunStatus.RUNNING
        assert rec.updated_at == T0_S + winners[0] + 1


def test_one_call_and_unit_acquires_racing_hand_out_each_generation_once(
    db_url: str, store: Store
) -> None:
    """Threads acquire one slot, half one-call (read + one statement on Postgres), half in units."""
    k, m = 6, 5
    barrier = threading.Barrier(k)

    def racer(st: Store, i: int) -> list[tuple[int, Any]]:
        got = []
        barrier.wait()
        for j in range(m):
            if i % 2 == 0:
                got.append(st.runs.acquire_assignee("R-gen", "main", f"S-{i}", f"d{j}"))
            else:
                with st.write() as uow:
                    got.append(uow.runs.acquire_assignee("R-gen", "main", f"S-{i}", f"d{j}"))
        return got

    store.runs.create(RunRecord.new("R-gen", "T-1", 100))
    with _racers(db_url, k, lambda i: T0_MS) as stores:
        got = run_threads([(racer, (stores[i], i)) for i in range(k)])
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


# Module level, so that spawned racers can import it (tests/racing.py).
RACING = Racing(processes=2, threads=6, clock_ms=T0_MS + 1000)
proc_pool = RACING.pool_fixture()


def _body_delete_mixed(store: Store, i: int, barrier: Any, p: dict[str, Any]) -> list[str]:
    """Racer ``i`` deletes each round's run: one-call (even ``i``) or in a write unit (odd)."""
    out = []
    for r in range(p["rounds"]):
        barrier.wait()
        run_id = f"R-del-mix-{r}"
        try:
            if i % 2 == 0:
                store.runs.delete(run_id)
            else:
                with store.write() as uow:
                    uow.runs.delete(run_id)
            out.append("deleted")
        except RunNotFound:
            out.append("missing")
    return out


def _body_writes_vs_unit(store: Store, i: int, barrier: Any, p: dict[str, Any]) -> list[str]:
    """Even racers set the status and result (one-call); odd ones read, write, read in a unit.

    The unit writes the run's input (a column the one-call racers never
    write: this takes the run's lock), reads the run, writes the input again
    and reads it again: under the lock no one-call write may land between
    the two reads, so the status and result must be as first read (an
    AssertionError fails the race).
    """
    out = []
    for r in range(p["rounds"]):
        barrier.wait()
        run_id = f"R-st-mix-{r}"
        for j in range(p["m"]):
            if i % 2 == 0:
                store.runs.update_status(run_id, (RunStatus.RUNNING, RunStatus.INTERRUPTED)[j % 2])
                store.runs.set_result(run_id, f"call {i} {j}")
                out.append("call")
            else:
                with store.write() as uow:
                    uow.runs.set_input_json(run_id, f"unit {i}")  # takes the run's lock
                    first = uow.runs.get(run_id)
                    uow.runs.set_input_json(run_id, f"unit {i} {j}")
                    again = uow.runs.get(run_id)
                    assert (again.status, again.result_ref) == (first.status, first.result_ref)
                    assert again.input_json == f"unit {i} {j}"
                out.append("unit")
    return out


@pytest.mark.parametrize("kind", ["threads", "processes"])
def test_one_call_and_unit_deletes_racing_have_one_winner(
    kind: str, db_url: str, store: Store, request: pytest.FixtureRequest
) -> None:
    """Racers (threads or processes, each its own Store) delete one run: exactly one deletes."""
    rounds = 4
    for r in range(rounds):
        store.runs.create(RunRecord.new(f"R-del-mix-{r}", "T-1", 100))
    results = RACING.run(request, kind, db_url, _body_delete_mixed, {"rounds": rounds})
    for r in range(rounds):
        outcomes = [per[r] for per in results]
        assert sorted(outcomes) == ["deleted"] + ["missing"] * (len(outcomes) - 1), outcomes
        with pytest.raises(RunNotFound):
            store.runs.get(f"R-del-mix-{r}")


@pytest.mark.parametrize("kind", ["threads", "processes"])
def test_one_call_writes_never_come_between_a_units_reads(
    kind: str, db_url: str, store: Store, request: pytest.FixtureRequest
) -> None:
    """One-call update_status/set_result racing units that read, write and read under the lock.

    Every call succeeds, no unit sees a one-call write land inside it, and
    the row ends with a one-call racer's status and result and a unit's input.
    """
    rounds, m = 3, 6
    for r in range(rounds):
        store.runs.create(RunRecord.new(f"R-st-mix-{r}", "T-1", 100))
    params = {"rounds": rounds, "m": m}
    results = RACING.run(request, kind, db_url, _body_writes_vs_unit, params)
    assert all(len(per) == rounds * m for per in results)
    for r in range(rounds):
        rec = store.runs.get(f"R-st-mix-{r}")
        assert rec.status == RunStatus.INTERRUPTED  # each caller's last write
        assert isinstance(rec.result_ref, str) and rec.result_ref.startswith("call "), rec
        assert rec.input_json is not None and rec.input_json.startswith("unit "), rec


LOST_OPS: dict[str, Callable[[Store], Any]] = {
    "try_transition": lambda s: s.runs.try_transition(
        "R-lost", RunStatus.PENDING, RunStatus.RUNNING
    ),
    "update_status": lambda s: s.runs.update_status("R-lost", RunStatus.RUNNING),
    "set_result": lambda s: s.runs.set_result("R-lost", {"r": 1}),
    "set_input_json": lambda s: s.runs.set_input_json("R-lost", "in"),
    "delete": lambda s: s.runs.delete("R-lost"),
}


@pytest.mark.parametrize("op", list(LOST_OPS))
def test_a_connection_lost_with_the_one_statement_in_flight_is_an_unknown_outcome(
    backend: str, db_url: str, monkeypatch: pytest.MonkeyPatch, op: str
) -> None:
    """The statement is its own COMMIT: a lost connection is ``CommitOutcomeUnknown``, not retried.

    The backend is terminated just before the statement is sent, after the
    unit found the connection open (``Driver.closed_while_idle``: a
    connection already closed takes the locked path and is retried, see
    tests/test_idle_closed_connections.py), so it is not applied and the
    client cannot tell: the one-call form raises ``CommitOutcomeUnknown``
    naming the operation, and the store goes on (the row untouched; the
    same call then succeeds).
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
        before = store.runs.get("R-lost")
        monkeypatch.setattr(db.Driver, "closed_while_idle", closed_while_idle)
        with pytest.raises(CommitOutcomeUnknown) as info:
            LOST_OPS[op](store)
        assert info.value.operation == f"runs.{op}"
        assert fired
        assert store.runs.get("R-lost") == before  # terminated before it ran
        LOST_OPS[op](store)
        if op == "delete":
            with pytest.raises(RunNotFound):
                store.runs.get("R-lost")
        else:
            assert store.runs.get("R-lost") != before
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
    barrier = threading.Barrier(k)

    def racer(st: Store, i: int) -> None:
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

    store.runs.create(RunRecord.new("R-app", "T-1", 100))
    with _racers(db_url, k, lambda i: T0_MS) as stores:
        run_threads([(racer, (stores[i], i)) for i in range(k)])
    rec = store.runs.get("R-app")
    ids = [e.step_id for e in rec.step_entries]
    assert sorted(ids) == sorted(f"ST-{i}-{j}" for i in range(k) for j in range(m))
    for i in range(k):  # each racer's own entries in its order
        assert [x for x in ids if x.startswith(f"ST-{i}-")] == [f"ST-{i}-{j}" for j in range(m)]
    assert sorted((d.tool, d.at) for d in rec.degradations) == sorted(
        (f"t{i}", j) for i in range(k) for j in range(m)
    )
