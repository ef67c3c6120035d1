"""Ordering and pagination (spec runs.md §5.7), timestamps (§5.8) and delete (§5.10).

Every test runs on both backends unless its docstring says "SQLite-only"
(VACUUM with rowids renumbered by hand, and a ``run_trace`` table next to
``runs``: both only exist in a shared SQLite file).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, make_url, text

from agentkeep.clock import SettableClock
from agentkeep.errors import (
    AgentkeepError,
    AssigneeDescRequired,
    AssigneeGenerationAhead,
    AssigneeSlotRequired,
    RunDuplicate,
    RunNotFound,
)
from agentkeep.runs.domain import (
    Assignee,
    DegradationEntry,
    Released,
    RunListFilter,
    RunRecord,
    RunStatus,
    Stale,
    StepEntry,
)
from agentkeep.store import Store

from .support import SLOT_A, existing_run_row, mk, run_rows


def seqs(store: Store) -> dict[str, int]:
    with store.read() as uow:
        return {r[0]: r[1] for r in uow.connection.execute(text("SELECT id, seq FROM runs")).all()}


def ids(records: list[RunRecord]) -> list[str]:
    return [r.id for r in records]


# ---------------------------------------------------------------------- §5.7 ordering

# (id, task, created_at, status) in insertion order; ties on created_at on purpose,
# with ids that sort against insertion order.
ROWS: list[tuple[str, str, int, RunStatus]] = [
    ("R-z", "T-1", 100, RunStatus.PENDING),
    ("R-a", "T-1", 100, RunStatus.RUNNING),
    ("R-m", "T-2", 100, RunStatus.RUNNING),
    ("R-b", "T-1", 50, RunStatus.RUNNING),
    ("R-y", "T-1", 300, RunStatus.DONE),
    ("R-c", "T-2", 300, RunStatus.PENDING),
    ("R-0", "T-1", 100, RunStatus.RUNNING),
]


def _seed(store: Store, rows: list[tuple[str, str, int, RunStatus]] = ROWS) -> None:
    for run_id, task, created, status in rows:
        store.runs.create(mk(run_id, task, created, status=status))


def _expected_list(
    rows: list[tuple[str, str, int, RunStatus]],
    task: str | None = None,
    status: RunStatus | None = None,
) -> list[str]:
    """Reference model: created_at DESC, then newest insertion first."""
    picked = [
        (i, r)
        for i, r in enumerate(rows)
        if (task is None or r[1] == task) and (status is None or r[3] is status)
    ]
    picked.sort(key=lambda p: (-p[1][2], -p[0]))
    return [r[0] for _, r in picked]


def test_list_by_task_ties_keep_insertion_order(store: Store) -> None:
    store.runs.create(mk("R-z", "T-1", 100))
    store.runs.create(mk("R-a", "T-1", 100))
    assert ids(store.runs.list_by_task("T-1")) == ["R-z", "R-a"]
    _seed(store, ROWS[2:])
    assert ids(store.runs.list_by_task("T-1")) == ["R-b", "R-z", "R-a", "R-0", "R-y"]
    assert ids(store.runs.list_by_task("T-2")) == ["R-m", "R-c"]
    assert store.runs.list_by_task("T-unknown") == []


def test_list_ties_newest_insertion_first(store: Store) -> None:
    store.runs.create(mk("R-z", "T-1", 100))
    store.runs.create(mk("R-a", "T-1", 100))
    assert ids(store.runs.list()) == ["R-a", "R-z"]
    _seed(store, ROWS[2:])
    assert ids(store.runs.list()) == ["R-c", "R-y", "R-0", "R-m", "R-a", "R-z", "R-b"]
    assert ids(store.runs.list()) == _expected_list(ROWS)


@pytest.mark.parametrize("task", [None, "T-1", "T-2", "T-none"])
@pytest.mark.parametrize("status", [None, RunStatus.RUNNING, RunStatus.PENDING, RunStatus.FAILED])
def test_list_combined_filters(store: Store, task: str | None, status: RunStatus | None) -> None:
    _seed(store)
    got = ids(store.runs.list(RunListFilter(task_id=task, status=status)))
    assert got == _expected_list(ROWS, task, status)
    for r in store.runs.list(RunListFilter(task_id=task, status=status)):
        assert task is None or r.task_id == task
        assert status is None or r.status is status


def test_list_limit_zero_and_offset_beyond_the_end(store: Store) -> None:
    _seed(store)
    n = len(ROWS)
    assert store.runs.list(RunListFilter(limit=0)) == []
    assert store.runs.list(RunListFilter(limit=0, offset=0)) == []
    assert store.runs.list(RunListFilter(task_id="T-1", limit=0)) == []
    assert store.runs.list(RunListFilter(offset=n)) == []
    assert store.runs.list(RunListFilter(offset=n + 5, limit=3)) == []
    assert store.runs.list(RunListFilter(task_id="T-2", offset=2)) == []
    assert ids(store.runs.list(RunListFilter(offset=n - 1))) == _expected_list(ROWS)[-1:]


def test_list_offset_without_limit_gives_the_rest(store: Store) -> None:
    _seed(store)
    full = _expected_list(ROWS)
    for offset in range(len(full) + 1):
        assert ids(store.runs.list(RunListFilter(offset=offset))) == full[offset:]
    t1 = _expected_list(ROWS, "T-1")
    assert ids(store.runs.list(RunListFilter(task_id="T-1", offset=2))) == t1[2:]


@pytest.mark.parametrize("page", [1, 2, 3, 7, 8])
@pytest.mark.parametrize("task", [None, "T-1"])
def test_consecutive_pages_give_the_full_list(store: Store, page: int, task: str | None) -> None:
    _seed(store)
    full = ids(store.runs.list(RunListFilter(task_id=task)))
    assert full == _expected_list(ROWS, task)
    collected: list[str] = []
    for k in range(len(ROWS) + 2):  # bounded
        chunk = ids(store.runs.list(RunListFilter(task_id=task, limit=page, offset=k * page)))
        assert len(chunk) <= page
        if not chunk:
            break
        collected += chunk
    assert collected == full


def test_list_running_is_every_running_row_in_insertion_order(store: Store) -> None:
    store.runs.create(mk("R-c", created_at=300))
    store.runs.create(mk("R-a", created_at=100))
    store.runs.create(mk("R-d", created_at=50))
    store.runs.create(mk("R-b", created_at=200, status=RunStatus.RUNNING))
    assert ids(store.runs.list_running()) == ["R-b"]
    # Flip to running in an order that differs from insertion, created_at and id order.
    store.runs.update_status("R-a", RunStatus.RUNNING)
    assert store.runs.try_transition("R-c", RunStatus.PENDING, RunStatus.RUNNING)
    assert ids(store.runs.list_running()) == ["R-c", "R-a", "R-b"]
    store.runs.update_status("R-a", RunStatus.DONE)
    assert ids(store.runs.list_running()) == ["R-c", "R-b"]
    assert all(r.status is RunStatus.RUNNING for r in store.runs.list_running())


def _orderings(store: Store) -> tuple[list[str], list[str], list[str], list[str]]:
    return (
        ids(store.runs.list()),
        ids(store.runs.list_by_task("T-1")),
        ids(store.runs.list_by_task("T-2")),
        ids(store.runs.list_running()),
    )


def test_ordering_survives_reopen(db_url: str, clock: SettableClock) -> None:
    with Store.open(db_url, clock=clock) as first:
        _seed(first)
        first.runs.delete("R-a")
        first.runs.create(mk("R-a", "T-1", 100, status=RunStatus.RUNNING))
        before = _orderings(first)
    assert before[0] == ["R-c", "R-y", "R-a", "R-0", "R-m", "R-z", "R-b"]
    with Store.open(db_url, clock=clock) as second:
        assert _orderings(second) == before


def _vacuum(url: str) -> None:
    if make_url(url).get_backend_name() == "sqlite":
        con = sqlite3.connect(make_url(url).database or "", isolation_level=None)
        try:
            con.execute("VACUUM")
        finally:
            con.close()
        return
    engine = create_engine(url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            conn.execute(text("VACUUM FULL runs"))
    finally:
        engine.dispose()


def test_ordering_survives_vacuum(db_url: str, clock: SettableClock) -> None:
    """VACUUM on SQLite, VACUUM FULL (rewrites the table, new ctids) on Postgres."""
    with Store.open(db_url, clock=clock) as first:
        _seed(first)
        first.runs.delete("R-z")
        first.runs.delete("R-m")
        first.runs.create(mk("R-z", "T-1", 100))
        before = _orderings(first)
    _vacuum(db_url)
    with Store.open(db_url, clock=clock) as second:
        assert _orderings(second) == before


def test_ordering_ignores_rowid_renumbering(tmp_path: Path) -> None:
    """SQLite-only: VACUUM may renumber rowids; here they are reversed by hand.

    The tie-break must come from ``seq`` (spec §6.3), not from ``rowid``.
    """
    url = f"sqlite:///{tmp_path / 'rowid.db'}"
    clock = SettableClock(1_700_000_000_000)
    with Store.open(url, migrate=True, clock=clock) as store:
        _seed(store)
        before = _orderings(store)
    con = sqlite3.connect(tmp_path / "rowid.db", isolation_level=None)
    try:
        con.execute("UPDATE runs SET rowid = 100000 - rowid")
        con.execute("VACUUM")
        rowids = dict(con.execute("SELECT id, rowid FROM runs").fetchall())
    finally:
        con.close()
    assert rowids["R-z"] > rowids["R-a"]  # rowid order is now reversed insertion order
    with Store.open(url, clock=clock) as store:
        assert _orderings(store) == before


# ---------------------------------------------------------------------- §5.8 timestamps

NOW_MS = 1_800_000_123_999
NOW_S = NOW_MS // 1000

# (label, call, columns the call writes besides updated_at)
WRITES: list[tuple[str, Callable[[Store], object], set[str]]] = [
    (
        "append_step_entry",
        lambda s: s.runs.append_step_entry("R-1", StepEntry.basic("ST-2", "b", None, None, 5)),
        {"step_entries_json"},
    ),
    (
        "append_degradation",
        lambda s: s.runs.append_degradation(
            "R-1", DegradationEntry(tool="t", error="e", fallback="f", at=5)
        ),
        {"degradations_json"},
    ),
    ("update_status", lambda s: s.runs.update_status("R-1", RunStatus.DONE), {"status"}),
    ("update_status_same", lambda s: s.runs.update_status("R-1", RunStatus.PENDING), set()),
    (
        "try_transition",
        lambda s: s.runs.try_transition("R-1", RunStatus.PENDING, RunStatus.RUNNING),
        {"status"},
    ),
    (
        "try_transition_same",
        lambda s: s.runs.try_transition("R-1", RunStatus.PENDING, RunStatus.PENDING),
        set(),
    ),
    (
        "acquire_assignee",
        lambda s: s.runs.acquire_assignee("R-1", "other", "S-2", "hold"),
        {"current_json", "next_generation"},
    ),
    (
        "acquire_assignee_same_op",
        lambda s: s.runs.acquire_assignee("R-1", SLOT_A, "S-1", "held"),
        {"current_json", "next_generation"},
    ),
    (
        "vacate_assignee_released",
        lambda s: s.runs.vacate_assignee("R-1", SLOT_A, 1),
        {"current_json", "next_generation"},
    ),
    ("set_result", lambda s: s.runs.set_result("R-1", [1]), {"result_ref_json"}),
    ("set_input_json", lambda s: s.runs.set_input_json("R-1", "x"), {"input_json"}),
]


def _seed_r1(store: Store) -> None:
    store.runs.create(
        mk(
            "R-1",
            created_at=100,
            current={SLOT_A: Assignee(op="S-1", desc="held", gen=1)},
            next_generation=1,
        )
    )
    store.runs.create(mk("R-2", created_at=100))


@pytest.mark.parametrize(("label", "call", "columns"), WRITES, ids=[w[0] for w in WRITES])
def test_every_write_sets_updated_at_to_exactly_now(
    store: Store,
    clock: SettableClock,
    label: str,
    call: Callable[[Store], object],
    columns: set[str],
) -> None:
    _seed_r1(store)
    other = existing_run_row(store, "R-2")
    before = existing_run_row(store, "R-1")
    assert before["updated_at"] == 100
    clock.set(NOW_MS)
    result = call(store)
    assert result is not False
    after = existing_run_row(store, "R-1")
    assert after["updated_at"] == NOW_S
    changed = {k for k in after if after[k] != before[k]}
    assert changed - {"updated_at"} <= columns
    assert changed >= {"updated_at"}
    assert store.runs.get("R-1").updated_at == NOW_S
    assert existing_run_row(store, "R-2") == other
    if label not in ("vacate_assignee_released", "try_transition"):
        # Repeatable writes: a clock stepped backwards is still taken as is.
        clock.set(1_600_000_000_001)
        call(store)
        assert existing_run_row(store, "R-1")["updated_at"] == 1_600_000_000


def _refusals() -> list[Any]:
    def case(label: str, call: Callable[[Store], object], exc: type[BaseException] | None) -> Any:
        return pytest.param(call, exc, id=label)

    nope = "R-nope"
    return [
        case("get", lambda s: s.runs.get("R-1"), None),
        case("list", lambda s: s.runs.list(), None),
        case("list_by_task", lambda s: s.runs.list_by_task("T-1"), None),
        case("list_running", lambda s: s.runs.list_running(), None),
        case(
            "try_transition_false",
            lambda s: s.runs.try_transition("R-1", RunStatus.RUNNING, RunStatus.DONE),
            None,
        ),
        case(
            "try_transition_absent",
            lambda s: s.runs.try_transition(nope, RunStatus.PENDING, RunStatus.DONE),
            None,
        ),
        case("vacate_stale_gen", lambda s: s.runs.vacate_assignee("R-1", SLOT_A, 7), None),
        case("vacate_stale_vacant", lambda s: s.runs.vacate_assignee("R-1", "empty", 1), None),
        case(
            "acquire_desc",
            lambda s: s.runs.acquire_assignee("R-1", SLOT_A, "S-2", " "),
            AssigneeDescRequired,
        ),
        case(
            "acquire_slot",
            lambda s: s.runs.acquire_assignee("R-1", "", "S-2", "d"),
            AssigneeSlotRequired,
        ),
        case("vacate_slot", lambda s: s.runs.vacate_assignee("R-1", "", 1), AssigneeSlotRequired),
        case("create_duplicate", lambda s: s.runs.create(mk("R-1", created_at=5)), RunDuplicate),
        case(
            "create_gen_ahead",
            lambda s: s.runs.create(
                mk("R-3", current={"x": Assignee(op="o", desc="d", gen=2)}, next_generation=1)
            ),
            AssigneeGenerationAhead,
        ),
        case(
            "append_step_notfound",
            lambda s: s.runs.append_step_entry(nope, StepEntry.basic("ST-1", None, None, None, 1)),
            RunNotFound,
        ),
        case(
            "append_degr_notfound",
            lambda s: s.runs.append_degradation(
                nope, DegradationEntry(tool="t", error="e", fallback="f", at=1)
            ),
            RunNotFound,
        ),
        case(
            "update_status_notfound",
            lambda s: s.runs.update_status(nope, RunStatus.DONE),
            RunNotFound,
        ),
        case(
            "acquire_notfound",
            lambda s: s.runs.acquire_assignee(nope, SLOT_A, "S-2", "d"),
            RunNotFound,
        ),
        case("vacate_notfound", lambda s: s.runs.vacate_assignee(nope, SLOT_A, 1), RunNotFound),
        case("set_result_notfound", lambda s: s.runs.set_result(nope, 1), RunNotFound),
        case("set_input_notfound", lambda s: s.runs.set_input_json(nope, "x"), RunNotFound),
        case("delete_notfound", lambda s: s.runs.delete(nope), RunNotFound),
    ]


@pytest.mark.parametrize(("call", "exc"), _refusals())
def test_reads_refusals_and_non_events_leave_updated_at_unchanged(
    store: Store,
    clock: SettableClock,
    call: Callable[[Store], object],
    exc: type[BaseException] | None,
) -> None:
    _seed_r1(store)
    before = run_rows(store)
    records = store.runs.list()
    clock.set(NOW_MS)
    if exc is None:
        result = call(store)
        assert result is not True
        assert not isinstance(result, Released)
        if isinstance(result, Stale):
            assert result.current in (None, Assignee(op="S-1", desc="held", gen=1))
    else:
        with pytest.raises(exc) as err:
            call(store)
        assert isinstance(err.value, AgentkeepError)
    assert run_rows(store) == before
    assert store.runs.list() == records


def test_create_stores_the_callers_timestamps_verbatim(store: Store, clock: SettableClock) -> None:
    clock.set(NOW_MS)
    store.runs.create(mk("R-1", created_at=500, updated_at=10))
    store.runs.create(mk("R-2", created_at=0, updated_at=0))
    store.runs.create(mk("R-3", created_at=7, updated_at=2**63 - 1))
    assert (
        existing_run_row(store, "R-1")["created_at"],
        existing_run_row(store, "R-1")["updated_at"],
    ) == (500, 10)
    assert (
        existing_run_row(store, "R-2")["created_at"],
        existing_run_row(store, "R-2")["updated_at"],
    ) == (0, 0)
    assert existing_run_row(store, "R-3")["updated_at"] == 2**63 - 1
    got = store.runs.get("R-1")
    assert (got.created_at, got.updated_at) == (500, 10)


def test_update_status_to_the_same_status_still_bumps(store: Store, clock: SettableClock) -> None:
    store.runs.create(mk("R-1", status=RunStatus.RUNNING))
    for step in range(3):
        clock.set(NOW_MS + step * 1000)
        store.runs.update_status("R-1", RunStatus.RUNNING)
        got = store.runs.get("R-1")
        assert got.status is RunStatus.RUNNING
        assert got.updated_at == NOW_S + step


def test_created_at_never_changes(store: Store, clock: SettableClock) -> None:
    _seed_r1(store)
    clock.set(NOW_MS)
    for _label, call, _columns in WRITES:
        call(store)
    row = existing_run_row(store, "R-1")
    assert row["created_at"] == 100
    assert (row["id"], row["task_id"], row["operator_sid"]) == ("R-1", "T-1", None)


# ---------------------------------------------------------------------- §5.10 delete


def test_delete_then_get_is_not_found(store: Store) -> None:
    store.runs.create(mk("R-1"))
    store.runs.delete("R-1")
    with pytest.raises(RunNotFound):
        store.runs.get("R-1")
    assert store.runs.list() == []
    assert run_rows(store) == []


def test_delete_twice_is_not_found(store: Store) -> None:
    store.runs.create(mk("R-1"))
    store.runs.delete("R-1")
    with pytest.raises(RunNotFound) as err:
        store.runs.delete("R-1")
    assert err.value.run_id == "R-1"


def test_delete_leaves_other_runs_alone(store: Store) -> None:
    _seed(store)
    store.runs.acquire_assignee("R-a", SLOT_A, "S-1", "held")
    others = {r.id: r for r in store.runs.list() if r.id != "R-m"}
    store.runs.delete("R-m")
    after = {r.id: r for r in store.runs.list()}
    assert after == others
    remaining = [r for r in ROWS if r[0] != "R-m"]
    assert ids(store.runs.list()) == _expected_list(remaining)


def test_recreate_after_delete_gets_a_larger_seq(store: Store) -> None:
    store.runs.create(mk("R-1", created_at=100))
    store.runs.create(mk("R-2", created_at=100))
    store.runs.create(mk("R-3", created_at=100))
    first = seqs(store)
    assert len(set(first.values())) == 3
    store.runs.delete("R-3")  # the newest: its seq must not come back
    store.runs.delete("R-1")
    store.runs.create(mk("R-1", created_at=100, status=RunStatus.DONE))
    second = seqs(store)
    assert second["R-1"] > max(first.values())
    assert second["R-2"] == first["R-2"]
    store.runs.create(mk("R-3", created_at=100))
    third = seqs(store)
    assert third["R-3"] > second["R-1"]
    assert store.runs.get("R-1").status is RunStatus.DONE
    # The re-created runs are now the newest insertions.
    assert ids(store.runs.list()) == ["R-3", "R-1", "R-2"]
    assert ids(store.runs.list_by_task("T-1")) == ["R-2", "R-1", "R-3"]


@pytest.fixture
def sqlite_path(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "trace.db"


def test_delete_does_not_touch_run_trace(sqlite_path: Path) -> None:
    """SQLite-only: the trace store's ``run_trace`` table shares the file (spec §1.1)."""
    url = f"sqlite:///{sqlite_path}"
    clock = SettableClock(1_700_000_000_000)
    with Store.open(url, migrate=True, clock=clock) as store:
        store.runs.create(mk("R-1"))
        store.runs.create(mk("R-2"))
        with store.write() as uow:
            uow.connection.execute(
                text(
                    "CREATE TABLE run_trace (run_id TEXT NOT NULL, seq INTEGER NOT NULL, "
                    "payload TEXT, PRIMARY KEY (run_id, seq))"
                )
            )
            for run_id in ("R-1", "R-2"):
                for n in range(3):
                    uow.connection.execute(
                        text("INSERT INTO run_trace VALUES (:r, :n, :p)"),
                        {"r": run_id, "n": n, "p": f"{run_id}/{n}"},
                    )

        def trace() -> list[tuple[Any, ...]]:
            with store.read() as uow:
                return [
                    tuple(r)
                    for r in uow.connection.execute(
                        text("SELECT run_id, seq, payload FROM run_trace ORDER BY run_id, seq")
                    ).all()
                ]

        before = trace()
        assert len(before) == 6
        store.runs.delete("R-1")
        assert trace() == before
        with pytest.raises(RunNotFound):
            store.runs.get("R-1")
        assert store.runs.get("R-2").id == "R-2"
