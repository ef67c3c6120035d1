"""Races on the run store with real concurrency (spec runs §5.2), on SQLite (WAL file) and Postgres.

Every racer opens its own :class:`Store` (its own engine and connections) from
the database URL. Thread variants line the racers up on a
:class:`threading.Barrier`; process variants run a module-level worker in a
pool of ``spawn``-ed processes sharing one ``multiprocessing`` barrier, each
task opening its own Store in its child process. No test sleeps to let time
pass: every racer has a :class:`SettableClock`. The only sleep is the busy
test's ~0.3 s lock hold, which is the thing under test.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from sqlalchemy import create_engine, make_url, text

from agentkeep.clock import SettableClock
from agentkeep.db import LockNamespace, _key_hash
from agentkeep.errors import RunNotFound, StoreBusy
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
from tests.racing import Racing

from .support import SLOT_A, run_row

T0_MS = 1_700_000_000_000
T0_S = T0_MS // 1000

Outcome = tuple[Any, ...]  # ("ok", value) or ("err", exception class name, message)


# --------------------------------------------------------------------------
# Racer plumbing (module level so that spawned children can import it)


def _capture(fn: Callable[..., Any], *args: Any) -> Outcome:
    """Run one store call ``fn(*args)``; return a picklable outcome instead of raising."""
    try:
        return ("ok", _plain(fn(*args)))
    except Exception as exc:  # noqa: BLE001 - every error is part of the outcome
        return ("err", type(exc).__name__, str(exc))


def _plain(value: Any) -> Any:
    """Domain values as plain tuples (picklable, comparable across processes)."""
    if isinstance(value, Assignee):
        return ("assignee", value.op, value.desc, value.gen)
    if isinstance(value, Released):
        return ("released", value.generation, _plain(value.released))
    if isinstance(value, Stale):
        return ("stale", _plain(value.current))
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return value


#: Each racer with its own store and clock at T0; 4 processes (2 cores), 8 threads.
RACING = Racing(processes=4, threads=8, clock_ms=T0_MS, barrier_timeout_s=30.0, join_timeout_s=90.0)
proc_pool = RACING.pool_fixture()


KINDS = pytest.mark.parametrize("kind", ["threads", "processes"])


def count_rows(store: Store, run_id: str) -> int:
    with store.read() as uow:
        return uow.connection.execute(
            text("SELECT COUNT(*) FROM runs WHERE id = :id"), {"id": run_id}
        ).scalar_one()


def _seconds(ms: int) -> int:
    return ms // 1000


# --------------------------------------------------------------------------
# Bodies. Signature: body(store, i, barrier, params) -> picklable result.


def _body_transition(store: Store, i: int, barrier: Any, p: dict[str, Any]) -> list:
    """Per round: racer 0 resets the run to Interrupted, then all race Interrupted→Running."""
    clock = store.clock
    assert isinstance(clock, SettableClock)
    out = []
    for r in range(p["rounds"]):
        barrier.wait()
        if i == 0:
            clock.set(T0_MS + r * 10**7)
            store.runs.update_status(p["run_id"], RunStatus.INTERRUPTED)
        barrier.wait()
        clock.set(_racer_ms(r, i))
        res = _capture(
            store.runs.try_transition, p["run_id"], RunStatus.INTERRUPTED, RunStatus.RUNNING
        )
        barrier.wait()
        after = None
        if i == 0:
            rec = store.runs.get(p["run_id"])
            after = (str(rec.status), rec.updated_at)
        out.append((res, after))
    return out


def _racer_ms(rnd: int, i: int) -> int:
    """A distinct time per (round, racer), whole seconds apart, after the round's reset."""
    return T0_MS + rnd * 10**7 + (i + 1) * 1000


def _body_acquire(store: Store, i: int, barrier: Any, p: dict[str, Any]) -> list:
    """M acquires each: even steps on a slot shared by everyone, odd steps on an own slot."""
    out = []
    barrier.wait()
    for j in range(p["m"]):
        slot = f"shared-{(j // 2) % 2}" if j % 2 == 0 else f"own-{i}"
        op, desc = f"S-{i}", f"hold {i}.{j}"
        res = _capture(store.runs.acquire_assignee, p["run_id"], slot, op, desc)
        out.append((slot, op, desc, res))
    return out


def _body_vacate(store: Store, i: int, barrier: Any, p: dict[str, Any]) -> list:
    """Per round: racer 0 acquires slot A, all read its gen, all vacate with it."""
    out = []
    for r in range(p["rounds"]):
        barrier.wait()
        if i == 0:
            store.runs.acquire_assignee(p["run_id"], SLOT_A, f"S-holder-{r}", f"round {r}")
        barrier.wait()
        held = store.runs.get(p["run_id"]).current[SLOT_A]
        barrier.wait()
        res = _capture(store.runs.vacate_assignee, p["run_id"], SLOT_A, held.gen)
        barrier.wait()
        after = None
        if i == 0:
            rec = store.runs.get(p["run_id"])
            after = (rec.next_generation, _plain(rec.current.get(SLOT_A)))
        out.append((_plain(held), res, after))
    return out


def _body_acquire_vs_vacate(store: Store, i: int, barrier: Any, p: dict[str, Any]) -> list:
    """Pairs of racers, one run per pair: acquire(A) races vacate(A, observed gen)."""
    run_id = p["run_ids"][i // 2]
    role = i % 2
    out = []
    for r in range(p["rounds"]):
        barrier.wait()
        if role == 0:
            store.runs.acquire_assignee(run_id, SLOT_A, "S-old", f"old {r}")
        barrier.wait()
        observed = store.runs.get(run_id)
        held = observed.current[SLOT_A]
        barrier.wait()
        if role == 0:
            res = _capture(store.runs.acquire_assignee, run_id, SLOT_A, "S-new", f"new {r}")
        else:
            res = _capture(store.runs.vacate_assignee, run_id, SLOT_A, held.gen)
        barrier.wait()
        final = None
        if role == 0:
            rec = store.runs.get(run_id)
            final = (rec.next_generation, _plain(rec.current.get(SLOT_A)), len(rec.current))
        out.append((observed.next_generation, _plain(held), role, res, final))
    return out


STATUS_CYCLE = [RunStatus.RUNNING, RunStatus.DONE, RunStatus.FAILED, RunStatus.CANCELLED]


def _body_append_mixed(store: Store, i: int, barrier: Any, p: dict[str, Any]) -> list:
    """M rounds of: a step entry, a degradation, then an acquire or an update_status."""
    run_id = p["run_id"]
    out = []
    barrier.wait()
    for j in range(p["m"]):
        step = StepEntry.basic(f"ST-{i}-{j}", f"w{i}", str(j), None, j)
        deg = DegradationEntry(tool=f"w{i}", error="boom", fallback="cached", note=str(j), at=j)
        out.append(("step", _capture(store.runs.append_step_entry, run_id, step)))
        out.append(("deg", _capture(store.runs.append_degradation, run_id, deg)))
        if j % 2 == 0:
            res = _capture(store.runs.acquire_assignee, run_id, f"w{i}", f"S-{i}", f"d{j}")
            out.append(("acquire", res))
        else:
            status = STATUS_CYCLE[(i + j) % len(STATUS_CYCLE)]
            res = _capture(store.runs.update_status, run_id, status)
            out.append(("status", str(status), res))
    return out


def _body_create(store: Store, i: int, barrier: Any, p: dict[str, Any]) -> list:
    """Per round, every racer creates the same id with its own task id and times."""
    out = []
    for r in range(p["rounds"]):
        rec = RunRecord.new(f"R-dup-{r}", f"T-racer-{i}", 100 + i, input_json=f"racer {i}")
        barrier.wait()
        out.append(_capture(store.runs.create, rec))
    return out


def _body_delete_race(store: Store, i: int, barrier: Any, p: dict[str, Any]) -> list:
    """Per round: racers 0 and 1 delete the run; the others append and acquire on it."""
    out = []
    for r in range(p["rounds"]):
        run_id = f"R-del-{r}"
        barrier.wait()
        if i in (0, 1):
            out.append((r, "delete", _capture(store.runs.delete, run_id)))
            continue
        for j in range(p["ops"]):
            if (i + j) % 2 == 0:
                step = StepEntry.basic(f"ST-{i}-{j}", None, None, None, j)
                res = _capture(store.runs.append_step_entry, run_id, step)
                out.append((r, "append", res))
            else:
                res = _capture(store.runs.acquire_assignee, run_id, f"s{i}", f"S-{i}", "held")
                out.append((r, "acquire", res))
    return out


# --------------------------------------------------------------------------
# try_transition: exactly one winner


@KINDS
def test_concurrent_try_transition_has_exactly_one_winner(
    kind: str, db_url: str, store: Store, request: pytest.FixtureRequest
) -> None:
    """K racers CAS Interrupted→Running: one True, the rest False, updated_at bumped once."""
    store.runs.create(RunRecord.new("R-cas", "T-1", 100))
    rounds = 6 if kind == "threads" else 5
    results = RACING.run(
        request, kind, db_url, _body_transition, {"run_id": "R-cas", "rounds": rounds}
    )
    k = len(results)
    for r in range(rounds):
        outcomes = [results[i][r][0] for i in range(k)]
        assert all(o[0] == "ok" for o in outcomes), outcomes
        winners = [i for i, o in enumerate(outcomes) if o[1] is True]
        assert len(winners) == 1, outcomes
        assert sum(o[1] is False for o in outcomes) == k - 1
        status, updated_at = results[0][r][1]
        assert status == RunStatus.RUNNING
        # Every racer's clock is distinct: only the winner's time may be stored.
        assert updated_at == _seconds(_racer_ms(r, winners[0]))


# --------------------------------------------------------------------------
# acquire_assignee: distinct generations, nothing lost


@KINDS
def test_concurrent_acquires_hand_out_each_generation_once(
    kind: str, db_url: str, store: Store, request: pytest.FixtureRequest
) -> None:
    """N racers × M acquires: gens are exactly 1..N×M, G == N×M, every slot held, chains intact."""
    store.runs.create(RunRecord.new("R-acq", "T-1", 100))
    m = 6
    results = RACING.run(request, kind, db_url, _body_acquire, {"run_id": "R-acq", "m": m})
    calls = [(i, *c) for i, per in enumerate(results) for c in per]
    assert all(c[4][0] == "ok" for c in calls), [c for c in calls if c[4][0] != "ok"]
    total = len(results) * m
    gens = sorted(c[4][1][0] for c in calls)
    assert gens == list(range(1, total + 1))

    # Within one racer, its own calls commit in its program order.
    for per in results:
        own = [c[3][1][0] for c in per]
        assert own == sorted(own)

    rec = store.runs.get("R-acq")
    assert rec.next_generation == total
    by_slot: dict[str, list[tuple[int, str, str, Any]]] = {}
    for _i, slot, op, desc, res in calls:
        gen, previous = res[1]
        by_slot.setdefault(slot, []).append((gen, op, desc, previous))
    assert set(rec.current) == set(by_slot)
    for slot, events in by_slot.items():
        events.sort()
        # The holder is the last acquire on the slot...
        gen, op, desc, _ = events[-1]
        assert rec.current[slot] == Assignee(op=op, desc=desc, gen=gen)
        # ...and each acquire displaced exactly the one before it on that slot.
        assert events[0][3] is None
        for before, after in zip(events, events[1:], strict=False):
            assert after[3] == ("assignee", before[1], before[2], before[0])
    holder_gens = [a.gen for a in rec.current.values()]
    assert len(set(holder_gens)) == len(holder_gens)


# --------------------------------------------------------------------------
# vacate_assignee: one Released per expected_gen


@KINDS
def test_concurrent_vacates_with_same_gen_release_once(
    kind: str, db_url: str, store: Store, request: pytest.FixtureRequest
) -> None:
    """K racers vacate(A, g): exactly one Released(g+1, holder), the rest Stale(None)."""
    store.runs.create(RunRecord.new("R-vac", "T-1", 100))
    rounds = 5
    results = RACING.run(request, kind, db_url, _body_vacate, {"run_id": "R-vac", "rounds": rounds})
    k = len(results)
    for r in range(rounds):
        held = results[0][r][0]
        assert all(results[i][r][0] == held for i in range(k))
        gen = held[3]
        outcomes = [results[i][r][1] for i in range(k)]
        assert all(o[0] == "ok" for o in outcomes), outcomes
        values = [o[1] for o in outcomes]
        released = [v for v in values if v[0] == "released"]
        assert released == [("released", gen + 1, held)]
        assert values.count(("stale", None)) == k - 1
        assert results[0][r][2] == (gen + 1, None)
    assert store.runs.get("R-vac").next_generation == 2 * rounds


# --------------------------------------------------------------------------
# acquire racing vacate(observed gen): one of the two linearizations


@KINDS
def test_acquire_racing_vacate_is_one_of_two_linearizations(
    kind: str, db_url: str, store: Store, request: pytest.FixtureRequest
) -> None:
    """Vacate first: acquire gets (G+2, None). Acquire first: vacate gets Stale(new holder)."""
    pairs = (RACING.threads if kind == "threads" else RACING.processes) // 2
    run_ids = [f"R-av-{k}" for k in range(pairs)]
    for rid in run_ids:
        store.runs.create(RunRecord.new(rid, "T-1", 100))
    rounds = 8
    results = RACING.run(
        request, kind, db_url, _body_acquire_vs_vacate, {"run_ids": run_ids, "rounds": rounds}
    )
    seen = Counter()
    for pair in range(pairs):
        acq_side, vac_side = results[2 * pair], results[2 * pair + 1]
        for r in range(rounds):
            g0, held, _, acq, final = acq_side[r]
            g0_v, held_v, _, vac, _ = vac_side[r]
            assert (g0, held) == (g0_v, held_v)
            assert held[1:3] == ("S-old", f"old {r}") and held[3] == g0
            assert acq[0] == "ok" and vac[0] == "ok", (acq, vac)
            new_gen, previous = acq[1]
            if vac[1][0] == "released":
                # vacate committed first, then the acquire found the slot vacant
                assert vac[1] == ("released", g0 + 1, held)
                assert (new_gen, previous) == (g0 + 2, None)
                seen["vacate-first"] += 1
            else:
                # the acquire committed first; vacate saw the new holder and wrote nothing
                assert (new_gen, previous) == (g0 + 1, held)
                assert vac[1] == ("stale", ("assignee", "S-new", f"new {r}", g0 + 1))
                seen["acquire-first"] += 1
            # Never a lost holder: the new acquirer holds A with the gen it was told.
            assert final == (new_gen, ("assignee", "S-new", f"new {r}", new_gen), 1)
    assert sum(seen.values()) == pairs * rounds


# --------------------------------------------------------------------------
# appenders mixed with acquires and update_status on the same row


@KINDS
def test_concurrent_appends_lose_nothing_and_clobber_nothing(
    kind: str, db_url: str, store: Store, request: pytest.FixtureRequest
) -> None:
    """N×M step entries and degradations, each worker's in its own order; no column clobbered."""
    store.runs.create(
        RunRecord.new(
            "R-app", "T-app", 100, operator_sid="S-launch", input_json='{"k": 1}', result_ref=[1]
        )
    )
    m = 8
    results = RACING.run(request, kind, db_url, _body_append_mixed, {"run_id": "R-app", "m": m})
    n = len(results)
    for per in results:
        assert all(c[-1][0] == "ok" for c in per), per

    rec = store.runs.get("R-app")
    assert len(rec.step_entries) == n * m
    assert len(rec.degradations) == n * m
    assert len({e.step_id for e in rec.step_entries}) == n * m
    for i in range(n):
        steps = [e for e in rec.step_entries if e.step_ref == f"w{i}"]
        assert [(e.step_id, e.status, e.at) for e in steps] == [
            (f"ST-{i}-{j}", str(j), j) for j in range(m)
        ]
        degs = [d for d in rec.degradations if d.tool == f"w{i}"]
        assert [(d.note, d.at) for d in degs] == [(str(j), j) for j in range(m)]

    acquires = [(i, c[1][1]) for i, per in enumerate(results) for c in per if c[0] == "acquire"]
    assert sorted(g for _, (g, _) in acquires) == list(range(1, len(acquires) + 1))
    assert rec.next_generation == len(acquires)
    assert set(rec.current) == {f"w{i}" for i in range(n)}
    last_j = max(j for j in range(m) if j % 2 == 0)
    for i in range(n):
        last_gen = max(g for w, (g, _) in acquires if w == i)
        assert rec.current[f"w{i}"] == Assignee(op=f"S-{i}", desc=f"d{last_j}", gen=last_gen)

    statuses = {c[1] for per in results for c in per if c[0] == "status"}
    assert str(rec.status) in statuses
    # Columns nobody wrote are exactly as created.
    assert (rec.task_id, rec.operator_sid, rec.input_json, rec.result_ref) == (
        "T-app",
        "S-launch",
        '{"k": 1}',
        [1],
    )
    assert rec.created_at == 100
    assert rec.updated_at == T0_S  # every racer's clock reads T0


# --------------------------------------------------------------------------
# create with the same id


@KINDS
def test_concurrent_create_same_id_one_success_rest_duplicate(
    kind: str, db_url: str, store: Store, request: pytest.FixtureRequest
) -> None:
    """Exactly one create wins; every other racer gets RunDuplicate, never another error."""
    rounds = 4
    results = RACING.run(request, kind, db_url, _body_create, {"rounds": rounds})
    for r in range(rounds):
        outcomes = [per[r] for per in results]
        winners = [i for i, o in enumerate(outcomes) if o == ("ok", None)]
        assert len(winners) == 1, outcomes
        losers = [o for i, o in enumerate(outcomes) if i != winners[0]]
        assert all(o[:2] == ("err", "RunDuplicate") for o in losers), losers
        rec = store.runs.get(f"R-dup-{r}")
        w = winners[0]
        assert (rec.task_id, rec.created_at, rec.input_json) == (
            f"T-racer-{w}",
            100 + w,
            f"racer {w}",
        )
        assert count_rows(store, f"R-dup-{r}") == 1


# --------------------------------------------------------------------------
# delete racing append / acquire


@KINDS
def test_delete_racing_writers_leaves_no_zombie(
    kind: str, db_url: str, store: Store, request: pytest.FixtureRequest
) -> None:
    """Every call either succeeds or raises RunNotFound; exactly one delete wins; no row remains."""
    rounds = 4
    for r in range(rounds):
        store.runs.create(RunRecord.new(f"R-del-{r}", "T-1", 100))
    results = RACING.run(request, kind, db_url, _body_delete_race, {"rounds": rounds, "ops": 3})
    calls = [c for per in results for c in per]
    for _r, _what, res in calls:
        assert res[0] == "ok" or res[1] == "RunNotFound", res
    for r in range(rounds):
        deletes = [res for rr, what, res in calls if rr == r and what == "delete"]
        assert deletes.count(("ok", None)) == 1, deletes
        assert count_rows(store, f"R-del-{r}") == 0
        with pytest.raises(RunNotFound):
            store.runs.get(f"R-del-{r}")
    assert store.runs.list() == []


# --------------------------------------------------------------------------
# Busy behaviour: a foreign connection holds the lock


def _lock_kinds(backend: str) -> list[str]:
    # SQLite: the database write lock (BEGIN IMMEDIATE). Postgres has no such
    # lock; its equivalents are the run's advisory lock and a row lock.
    return ["begin_immediate"] if backend == "sqlite" else ["advisory", "row"]


@contextmanager
def foreign_lock(backend: str, url: str, run_id: str, kind: str) -> Iterator[None]:
    """Hold a lock that blocks the run store's writes to ``run_id``, from another connection."""
    if backend == "sqlite":
        assert kind == "begin_immediate"
        conn = sqlite3.connect(make_url(url).database, isolation_level=None, timeout=0)
        try:
            conn.execute("BEGIN IMMEDIATE")
            yield
            conn.execute("ROLLBACK")
        finally:
            conn.close()
        return
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            tx = conn.begin()
            try:
                if kind == "advisory":
                    conn.execute(
                        text("SELECT pg_advisory_xact_lock(:ns, :key)"),
                        {"ns": LockNamespace.RUN, "key": _key_hash(run_id)},
                    )
                else:
                    locked = conn.execute(
                        text("SELECT id FROM runs WHERE id = :id FOR UPDATE"), {"id": run_id}
                    ).all()
                    assert len(locked) == 1
                yield
            finally:
                tx.rollback()
    finally:
        engine.dispose()


def _seeded(store: Store, run_id: str) -> None:
    store.runs.create(RunRecord.new(run_id, "T-busy", 100, status=RunStatus.INTERRUPTED))
    store.runs.acquire_assignee(run_id, SLOT_A, "S-1", "seeded holder")


BUSY_OPS: dict[str, Callable[[Store, str], Any]] = {
    "acquire": lambda s, rid: s.runs.acquire_assignee(rid, SLOT_A, "S-2", "takeover"),
    "vacate": lambda s, rid: s.runs.vacate_assignee(rid, SLOT_A, 1),
    "append_step": lambda s, rid: s.runs.append_step_entry(
        rid, StepEntry.basic("ST-1", "x", "dispatched", None, 1)
    ),
    "update_status": lambda s, rid: s.runs.update_status(rid, RunStatus.DONE),
    "try_transition": lambda s, rid: s.runs.try_transition(
        rid, RunStatus.INTERRUPTED, RunStatus.RUNNING
    ),
    "delete": lambda s, rid: s.runs.delete(rid),
    "create": lambda s, rid: s.runs.create(RunRecord.new("R-busy-new", "T-busy", 100)),
}


def _timed_acquire(store: Store, run_id: str, out: list[Any]) -> None:
    t = time.monotonic()
    res = _capture(store.runs.acquire_assignee, run_id, SLOT_A, "S-2", "w")
    out.append((res, time.monotonic() - t))


def test_busy_short_hold_waits_then_succeeds(backend: str, db_url: str, store: Store) -> None:
    """A foreign lock held ~0.3 s: a store write (busy timeout 5 s) waits, then succeeds.

    SQLite: a raw sqlite3 connection holds BEGIN IMMEDIATE. Postgres: another
    connection holds the run's advisory lock, or a row lock on it.
    """
    for kind in _lock_kinds(backend):
        run_id = f"R-short-{kind.replace('_', '-')}"
        _seeded(store, run_id)
        waiter = Store.open(db_url, clock=SettableClock(T0_MS + 5000), busy_timeout_ms=5000)
        try:
            result: list[Any] = []
            with foreign_lock(backend, db_url, run_id, kind):
                th = threading.Thread(
                    target=_timed_acquire, args=(waiter, run_id, result), daemon=True
                )
                th.start()
                time.sleep(0.3)  # the hold under test, not time passing for the store
                assert not result, f"{kind}: the write did not wait for the foreign lock"
            th.join(10)
            assert not th.is_alive()
            ((res, waited),) = result
            assert res == ("ok", (2, ("assignee", "S-1", "seeded holder", 1))), (kind, res)
            assert waited >= 0.2, (kind, waited)
            rec = store.runs.get(run_id)
            assert rec.current[SLOT_A] == Assignee(op="S-2", desc="w", gen=2)
            assert rec.updated_at == T0_S + 5
        finally:
            waiter.close()


@pytest.mark.parametrize("op", list(BUSY_OPS))
def test_busy_long_hold_raises_store_busy_and_writes_nothing(
    backend: str, db_url: str, store: Store, op: str
) -> None:
    """A foreign lock held past the busy timeout (200 ms, one attempt): StoreBusy, nothing written.

    SQLite: a raw sqlite3 connection holds BEGIN IMMEDIATE. Postgres: another
    connection holds the run's advisory lock, or a row lock on it (not for
    create, which a row lock on another row cannot block).
    """
    impatient = Store.open(
        db_url, clock=SettableClock(T0_MS + 9000), busy_timeout_ms=200, retry_attempts=1
    )
    try:
        for kind in _lock_kinds(backend):
            if op == "create" and kind == "row":
                continue
            run_id = "R-busy-new" if op == "create" else f"R-long-{kind.replace('_', '-')}"
            if op != "create":
                _seeded(store, run_id)
            before = run_row(store, run_id)
            with foreign_lock(backend, db_url, run_id, kind):
                t = time.monotonic()
                with pytest.raises(StoreBusy):
                    BUSY_OPS[op](impatient, run_id)
                waited = time.monotonic() - t
            assert waited >= 0.15, (kind, waited)
            assert run_row(store, run_id) == before, kind
            if op == "create":
                assert before is None
    finally:
        impatient.close()
