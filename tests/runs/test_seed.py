"""The 32 seed tests of the run store (spec runs.md §4), one test function each.

The seed runs most of them on an in-memory store; here they run on the
``store`` fixture, i.e. on both backends (a SQLite file and Postgres). The
"file DB / reopen" tests close their store and open ``Store.open(db_url)``
again. Test 31 (adoption of a legacy L2 file) is SQLite-only: no Postgres
database predates the port (spec §1.5).
"""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from agentkeep.clock import SettableClock
from agentkeep.errors import (
    AssigneeDescRequired,
    AssigneeGenerationAhead,
    AssigneeSlotRequired,
    RunCorrupt,
    RunDuplicate,
    RunNotFound,
)
from agentkeep.migrations import current as migrate_current
from agentkeep.migrations import head_revisions
from agentkeep.runs.domain import (
    UNSET,
    Assignee,
    Released,
    RunStatus,
    Stale,
    StepEntry,
)
from agentkeep.store import Store

from .support import SLOT_A, SLOT_B, mk, mk_degradation


def raw_exec(url: str, sql: str, **params: object) -> None:
    """Run one statement on a connection of our own (not the store's)."""
    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(text(sql), params)
    finally:
        engine.dispose()


def raw_count(store: Store, run_id: str) -> int:
    with store.read() as uow:
        return uow.connection.execute(
            text("SELECT COUNT(*) FROM runs WHERE id = :id"), {"id": run_id}
        ).scalar_one()


# ---------------------------------------------------------------------- 1-5


def test_create_then_get(store: Store) -> None:
    store.runs.create(mk("R-1", "T-1", 100))
    got = store.runs.get("R-1")
    assert got.id == "R-1"
    assert got.task_id == "T-1"
    assert got.status is RunStatus.PENDING
    assert got.step_entries == ()
    assert got.result_ref is UNSET
    assert got == mk("R-1", "T-1", 100)


def test_create_rejects_a_holder_generation_above_the_counter(store: Store) -> None:
    seeded = Assignee(op="S-seeded", desc="seeded straight into the record", gen=99)
    rec = mk("R-1", "T-1", 100, current={SLOT_A: seeded}, next_generation=0)
    with pytest.raises(AssigneeGenerationAhead) as err:
        store.runs.create(rec)
    assert err.value.gen == 99
    assert err.value.next_generation == 0
    assert err.value.slot == SLOT_A
    with pytest.raises(RunNotFound):
        store.runs.get("R-1")
    assert raw_count(store, "R-1") == 0


def test_duplicate_create_rejected(store: Store) -> None:
    store.runs.create(mk("R-1", "T-1", 100))
    with pytest.raises(RunDuplicate) as err:
        store.runs.create(mk("R-1", "T-1", 200))
    assert err.value.run_id == "R-1"
    assert store.runs.get("R-1").created_at == 100


def test_get_missing_returns_not_found(store: Store) -> None:
    with pytest.raises(RunNotFound) as err:
        store.runs.get("R-nope")
    assert str(err.value) == "run not found: R-nope"


def test_list_by_task_filters_and_orders_ascending(store: Store) -> None:
    store.runs.create(mk("R-1", "T-1", 300))
    store.runs.create(mk("R-2", "T-2", 50))
    store.runs.create(mk("R-3", "T-1", 100))
    assert [r.id for r in store.runs.list_by_task("T-1")] == ["R-3", "R-1"]


# ---------------------------------------------------------------------- 6-10


def test_append_step_entry_accumulates_in_order(store: Store) -> None:
    store.runs.create(mk("R-1"))
    store.runs.append_step_entry("R-1", StepEntry.basic("ST-1", "step-a", "dispatched", None, 101))
    store.runs.append_step_entry("R-1", StepEntry.basic("ST-2", "step-b", "passed", None, 102))
    entries = store.runs.get("R-1").step_entries
    assert len(entries) == 2
    assert [e.step_ref for e in entries] == ["step-a", "step-b"]
    assert [e.status for e in entries] == ["dispatched", "passed"]


def test_append_step_entry_unknown_run_fails(store: Store) -> None:
    with pytest.raises(RunNotFound):
        store.runs.append_step_entry("R-nope", StepEntry.basic("ST-1", None, None, None, 1))


def test_append_degradation_accumulates_in_order(store: Store) -> None:
    store.runs.create(mk("R-1"))
    store.runs.append_degradation("R-1", mk_degradation("web_search", 101))
    store.runs.append_degradation("R-1", mk_degradation("code_exec", 102))
    degradations = store.runs.get("R-1").degradations
    assert [d.tool for d in degradations] == ["web_search", "code_exec"]
    assert degradations[0] == mk_degradation("web_search", 101)


def test_append_degradation_unknown_run_fails(store: Store) -> None:
    with pytest.raises(RunNotFound):
        store.runs.append_degradation("R-nope", mk_degradation("web_search", 1))


def test_append_degradation_bumps_updated_at(store: Store, clock: SettableClock) -> None:
    store.runs.create(mk("R-1", created_at=100))
    assert store.runs.get("R-1").updated_at == 100
    store.runs.append_degradation("R-1", mk_degradation("web_search", 200))
    updated = store.runs.get("R-1").updated_at
    assert updated > 100
    assert updated == clock.now_ms() // 1000


# ---------------------------------------------------------------------- 11-15


def test_update_status_persists(store: Store) -> None:
    store.runs.create(mk("R-1"))
    store.runs.update_status("R-1", RunStatus.DONE)
    assert store.runs.get("R-1").status is RunStatus.DONE


def test_set_result_persists(store: Store) -> None:
    store.runs.create(mk("R-1"))
    store.runs.set_result("R-1", {"ok": True})
    assert store.runs.get("R-1").result_ref == {"ok": True}


def test_persists_across_reopen(db_url: str, clock: SettableClock) -> None:
    first = Store.open(db_url, clock=clock)
    first.runs.create(mk("R-keep", "T-keep", 42))
    first.runs.append_step_entry(
        "R-keep", StepEntry.basic("ST-1", "step-a", "dispatched", None, 43)
    )
    first.close()
    with Store.open(db_url, clock=clock) as second:
        got = second.runs.get("R-keep")
    assert got.task_id == "T-keep"
    assert [e.step_ref for e in got.step_entries] == ["step-a"]


def test_list_running_filters_by_status(store: Store) -> None:
    store.runs.create(mk("R-1", created_at=100))
    store.runs.create(mk("R-2", created_at=200))
    store.runs.create(mk("R-3", created_at=300))
    store.runs.update_status("R-2", RunStatus.RUNNING)
    store.runs.update_status("R-3", RunStatus.DONE)
    running = store.runs.list_running()
    assert [r.id for r in running] == ["R-2"]
    assert running[0].status is RunStatus.RUNNING


def test_try_transition_is_atomic_compare_and_set(store: Store) -> None:
    store.runs.create(mk("R-1"))
    store.runs.update_status("R-1", RunStatus.INTERRUPTED)
    assert store.runs.try_transition("R-1", RunStatus.INTERRUPTED, RunStatus.RUNNING) is True
    assert store.runs.get("R-1").status is RunStatus.RUNNING
    assert store.runs.try_transition("R-1", RunStatus.INTERRUPTED, RunStatus.RUNNING) is False
    assert store.runs.get("R-1").status is RunStatus.RUNNING
    assert store.runs.try_transition("R-nope", RunStatus.INTERRUPTED, RunStatus.RUNNING) is False
    assert raw_count(store, "R-nope") == 0


# ---------------------------------------------------------------------- 16-20


def test_launch_starts_vacant_at_generation_zero(store: Store) -> None:
    store.runs.create(mk("R-1"))
    got = store.runs.get("R-1")
    assert got.current == {}
    assert got.next_generation == 0


def test_acquire_advances_generation_even_for_the_same_op(store: Store) -> None:
    store.runs.create(mk("R-1"))
    assert store.runs.acquire_assignee("R-1", SLOT_A, "S-a1", "first hold") == (1, None)
    gen, previous = store.runs.acquire_assignee("R-1", SLOT_A, "S-a1", "same holder, new event")
    assert gen == 2
    assert previous == Assignee(op="S-a1", desc="first hold", gen=1)
    got = store.runs.get("R-1")
    assert got.next_generation == 2
    assert len(got.current) == 1
    assert got.current[SLOT_A] == Assignee(op="S-a1", desc="same holder, new event", gen=2)


def test_assigning_one_slot_leaves_the_others_intact(store: Store) -> None:
    store.runs.create(mk("R-1"))
    store.runs.acquire_assignee("R-1", SLOT_A, "S-a1", "holds phase a")
    assert SLOT_B not in store.runs.get("R-1").current
    store.runs.acquire_assignee("R-1", SLOT_B, "S-b2", "holds phase b")
    current = store.runs.get("R-1").current
    assert current[SLOT_A].op == "S-a1"
    assert current[SLOT_B].op == "S-b2"


def test_the_generation_counter_is_shared_across_slots(store: Store) -> None:
    store.runs.create(mk("R-1"))
    g1, _ = store.runs.acquire_assignee("R-1", SLOT_A, "S-a1", "holds phase a")
    g2, _ = store.runs.acquire_assignee("R-1", SLOT_B, "S-b2", "holds phase b")
    g3, _ = store.runs.acquire_assignee("R-1", SLOT_A, "S-a3", "takes over phase a")
    assert (g1, g2, g3) == (1, 2, 3)
    got = store.runs.get("R-1")
    assert got.next_generation == 3
    assert got.current[SLOT_A].gen == 3
    assert got.current[SLOT_B].gen == 2


def test_vacate_advances_generation_and_clears_the_holder(store: Store) -> None:
    store.runs.create(mk("R-1"))
    store.runs.acquire_assignee("R-1", SLOT_A, "S-a1", "first hold")
    outcome = store.runs.vacate_assignee("R-1", SLOT_A, 1)
    assert outcome == Released(generation=2, released=Assignee(op="S-a1", desc="first hold", gen=1))
    got = store.runs.get("R-1")
    assert SLOT_A not in got.current
    assert got.next_generation == 2
    assert store.runs.acquire_assignee("R-1", SLOT_A, "S-b2", "after release") == (3, None)


# ---------------------------------------------------------------------- 21-26


def test_vacate_releases_only_the_named_slot(store: Store) -> None:
    store.runs.create(mk("R-1"))
    assert store.runs.acquire_assignee("R-1", SLOT_A, "S-a1", "holds a")[0] == 1
    assert store.runs.acquire_assignee("R-1", SLOT_B, "S-b2", "holds b")[0] == 2
    outcome = store.runs.vacate_assignee("R-1", SLOT_A, 1)
    assert isinstance(outcome, Released)
    assert outcome.released.op == "S-a1"
    current = store.runs.get("R-1").current
    assert SLOT_A not in current
    assert current[SLOT_B].op == "S-b2"


def test_a_stale_release_does_not_disturb_the_current_holder(store: Store) -> None:
    store.runs.create(mk("R-1"))
    assert (
        store.runs.acquire_assignee("R-1", SLOT_A, "S-away", "the holder that went quiet")[0] == 1
    )
    assert (
        store.runs.acquire_assignee("R-1", SLOT_A, "S-fresh", "took the seat mid-decision")[0] == 2
    )
    outcome = store.runs.vacate_assignee("R-1", SLOT_A, 1)
    assert outcome == Stale(
        current=Assignee(op="S-fresh", desc="took the seat mid-decision", gen=2)
    )
    got = store.runs.get("R-1")
    assert got.current[SLOT_A].op == "S-fresh"
    assert got.next_generation == 2


def test_vacate_on_a_vacant_run_is_stale_and_writes_nothing(store: Store) -> None:
    store.runs.create(mk("R-1"))
    before = store.runs.get("R-1")
    assert store.runs.vacate_assignee("R-1", SLOT_A, 1) == Stale(current=None)
    after = store.runs.get("R-1")
    assert after.next_generation == 0
    assert after == before


def test_acquire_never_rewrites_the_incumbent_assignee(store: Store) -> None:
    store.runs.create(mk("R-1"))
    store.runs.acquire_assignee("R-1", SLOT_A, "S-a1", "first hold")
    snapshot = store.runs.get("R-1").current[SLOT_A]
    assert snapshot.gen == 1
    _, displaced = store.runs.acquire_assignee("R-1", SLOT_A, "S-b2", "takeover")
    assert displaced is not None
    assert (displaced.op, displaced.desc, displaced.gen) == (
        snapshot.op,
        snapshot.desc,
        snapshot.gen,
    )
    assert displaced == snapshot


def test_acquire_displaces_a_live_holder(store: Store) -> None:
    store.runs.create(mk("R-1"))
    store.runs.acquire_assignee("R-1", SLOT_A, "S-a1", "first hold")
    gen, displaced = store.runs.acquire_assignee("R-1", SLOT_A, "S-b2", "takeover")
    assert gen == 2
    assert displaced is not None and displaced.op == "S-a1"
    current = store.runs.get("R-1").current
    assert current[SLOT_A].op == "S-b2"
    assert len(current) == 1


def test_acquire_rejects_a_missing_desc_without_side_effects(store: Store) -> None:
    store.runs.create(mk("R-1"))
    assert store.runs.acquire_assignee("R-1", SLOT_A, "S-a1", "first hold")[0] == 1
    before = store.runs.get("R-1")
    with pytest.raises(AssigneeDescRequired):
        store.runs.acquire_assignee("R-1", SLOT_A, "S-b2", "")
    with pytest.raises(AssigneeDescRequired):
        store.runs.acquire_assignee("R-1", SLOT_A, "S-b2", "   ")
    with pytest.raises(AssigneeSlotRequired):
        store.runs.acquire_assignee("R-1", "", "S-b2", "a real reason")
    with pytest.raises(AssigneeSlotRequired):
        store.runs.vacate_assignee("R-1", "", 1)
    after = store.runs.get("R-1")
    assert after.next_generation == 1
    assert after.current[SLOT_A].op == "S-a1"
    assert after == before


# ---------------------------------------------------------------------- 27-32


def test_concurrent_acquires_hand_out_distinct_generations(
    db_url: str, store: Store, clock: SettableClock
) -> None:
    """Eight threads, each with its own Store (own connections), acquire at once."""
    store.runs.create(mk("R-1"))
    n = 8
    stores = [Store.open(db_url, clock=clock) for _ in range(n)]
    barrier = threading.Barrier(n, timeout=30)
    gens: list[tuple[int, int]] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def worker(i: int) -> None:
        try:
            barrier.wait()
            slot = SLOT_A if i % 2 == 0 else SLOT_B
            gen, _ = stores[i].runs.acquire_assignee("R-1", slot, f"S-{i}", "concurrent hold")
            with lock:
                gens.append((i, gen))
        except BaseException as exc:  # noqa: BLE001 - reported below
            with lock:
                errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads)
    finally:
        for s in stores:
            s.close()
    assert errors == []
    assert sorted(g for _, g in gens) == list(range(1, n + 1))
    got = store.runs.get("R-1")
    assert got.next_generation == n
    assert len(got.current) == 2
    # Each slot is held by its last acquirer: the highest gen handed out for that slot.
    for slot, parity in ((SLOT_A, 0), (SLOT_B, 1)):
        i, gen = max(((i, g) for i, g in gens if i % 2 == parity), key=lambda p: p[1])
        assert got.current[slot] == Assignee(op=f"S-{i}", desc="concurrent hold", gen=gen)


def test_assignment_on_an_unknown_run_fails(store: Store) -> None:
    with pytest.raises(RunNotFound):
        store.runs.acquire_assignee("R-nope", SLOT_A, "S-a1", "nobody home")
    with pytest.raises(RunNotFound):
        store.runs.vacate_assignee("R-nope", SLOT_A, 1)
    assert raw_count(store, "R-nope") == 0


def test_assignment_survives_reopen(db_url: str, clock: SettableClock) -> None:
    first = Store.open(db_url, clock=clock)
    first.runs.create(mk("R-keep", "T-keep", 1))
    first.runs.acquire_assignee("R-keep", SLOT_A, "main-ai", "held at restart")
    first.runs.acquire_assignee("R-keep", SLOT_B, "S-b2", "also held at restart")
    first.close()
    with Store.open(db_url, clock=clock) as second:
        got = second.runs.get("R-keep")
    assert got.current[SLOT_A] == Assignee(op="main-ai", desc="held at restart", gen=1)
    assert got.current[SLOT_B].gen == 2
    assert got.next_generation == 2


def test_a_pre_slot_current_json_fails_loud_rather_than_reading_vacant(
    db_url: str, clock: SettableClock
) -> None:
    """Raw SQL stores a bare Assignee as the map (runs on both backends)."""
    first = Store.open(db_url, clock=clock)
    first.runs.create(mk("R-legacy", "T-legacy", 7))
    first.close()
    raw_exec(
        db_url,
        "UPDATE runs SET current_json = :c, next_generation = 1 WHERE id = 'R-legacy'",
        c='{"op":"main-ai","desc":"held","gen":1}',
    )
    with Store.open(db_url, clock=clock) as second:
        with pytest.raises(RunCorrupt) as err:
            second.runs.get("R-legacy")
        with pytest.raises(RunCorrupt) as list_err:
            second.runs.list_by_task("T-legacy")
    assert "decode current" in str(err.value)
    assert err.value.key == "R-legacy"
    assert err.value.column == "current_json"
    assert "decode current" in str(list_err.value)


_L2_FRESH = """
CREATE TABLE runs (
    id                TEXT PRIMARY KEY,
    task_id           TEXT NOT NULL,
    status            TEXT NOT NULL,
    step_entries_json TEXT NOT NULL,
    degradations_json TEXT NOT NULL DEFAULT '[]',
    operator_sid      TEXT,
    result_ref_json   TEXT,
    input_json        TEXT,
    created_at        INTEGER NOT NULL,
    updated_at        INTEGER NOT NULL
)
"""


def test_legacy_db_without_assignment_columns_migrates(tmp_path: Path) -> None:
    """SQLite-only: an un-versioned L2 file (fresh-L2 column order, no index) is adopted.

    Legacy adoption applies to SQLite only (spec §1.5); the file is built with the
    sqlite3 module, adopted at runs_0003 and upgraded to head.
    """
    path = tmp_path / "legacy.db"
    con = sqlite3.connect(path)
    with con:
        con.execute(_L2_FRESH)
        con.execute(
            "INSERT INTO runs (id, task_id, status, step_entries_json, degradations_json, "
            "operator_sid, result_ref_json, input_json, created_at, updated_at) "
            "VALUES ('R-old', 'T-old', '\"pending\"', '[]', '[]', NULL, NULL, NULL, 7, 7)"
        )
    con.close()
    url = f"sqlite:///{path}"
    clock = SettableClock(1_700_000_000_000)
    with Store.open(url, migrate=True, clock=clock) as store:
        got = store.runs.get("R-old")
        assert got.current == {}
        assert got.next_generation == 0
        assert got.created_at == 7
        assert got.updated_at == 7
        assert got.status is RunStatus.PENDING
        assert got.input_json is None
        gen, previous = store.runs.acquire_assignee("R-old", SLOT_A, "S-a1", "after migration")
        assert (gen, previous) == (1, None)
    assert migrate_current(url) == head_revisions()
    con = sqlite3.connect(path)
    try:
        index_cols = [r[2] for r in con.execute("PRAGMA index_info('ix_runs_task_id')")]
    finally:
        con.close()
    assert index_cols == ["task_id", "created_at"]


def test_input_json_roundtrips_across_reopen(db_url: str, clock: SettableClock) -> None:
    snapshot = '{"blueprint":"snapshot","init_ctx":{}}'
    first = Store.open(db_url, clock=clock)
    first.runs.create(mk("R-keep", "T-keep", 1, input_json=snapshot))
    first.close()
    with Store.open(db_url, clock=clock) as second:
        assert second.runs.get("R-keep").input_json == snapshot
