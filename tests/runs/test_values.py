"""Stored values: NULL vs ``{}`` vs JSON null (spec runs.md §5.4) and corrupt columns (§5.5).

Every test runs on both backends unless its docstring says "SQLite-only": a
BLOB in a TEXT column, or text / a REAL in an INTEGER column, can only be
stored on SQLite (Postgres refuses the write itself).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from agentkeep.clock import SettableClock
from agentkeep.errors import RunCorrupt, RunNotFound
from agentkeep.runs.domain import (
    UNSET,
    Assignee,
    DegradationEntry,
    Released,
    RunListFilter,
    RunStatus,
    StepEntry,
)
from agentkeep.store import Store
from tests.support import execute_sql

from .support import SLOT_A, SLOT_B, mk, run_row


def raw_value(store: Store, run_id: str, column: str) -> Any:
    row = run_row(store, run_id)
    assert row is not None
    return row[column]


# ---------------------------------------------------------------------- §5.4


def test_vacating_the_last_holder_stores_sql_null(store: Store) -> None:
    store.runs.create(mk("R-1"))
    store.runs.acquire_assignee("R-1", SLOT_A, "S-a", "holds a")
    store.runs.acquire_assignee("R-1", SLOT_B, "S-b", "holds b")
    store.runs.vacate_assignee("R-1", SLOT_A, 1)
    assert (
        raw_value(store, "R-1", "current_json")
        == '{"phase-b-op":{"op":"S-b","desc":"holds b","gen":2}}'
    )
    store.runs.vacate_assignee("R-1", SLOT_B, 2)
    assert raw_value(store, "R-1", "current_json") is None
    with store.read() as uow:
        n = uow.connection.execute(
            text("SELECT COUNT(*) FROM runs WHERE id = 'R-1' AND current_json IS NULL")
        ).scalar_one()
    assert n == 1
    assert store.runs.get("R-1").current == {}


def test_create_with_an_empty_map_stores_null_never_braces(store: Store) -> None:
    store.runs.create(mk("R-1", current={}))
    store.runs.create(
        mk("R-2", current={SLOT_A: Assignee(op="S-x", desc="seeded", gen=3)}, next_generation=3)
    )
    assert raw_value(store, "R-1", "current_json") is None
    assert (
        raw_value(store, "R-2", "current_json")
        == '{"phase-a-op":{"op":"S-x","desc":"seeded","gen":3}}'
    )


def test_raw_braces_read_as_empty_and_the_next_emptying_write_stores_null(store: Store) -> None:
    store.runs.create(mk("R-1"))
    execute_sql(store, "UPDATE runs SET current_json = '{}' WHERE id = 'R-1'")
    got = store.runs.get("R-1")
    assert got.current == {}
    assert got.next_generation == 0
    assert [r.id for r in store.runs.list()] == ["R-1"]
    assert store.runs.acquire_assignee("R-1", SLOT_A, "S-a", "holds a") == (1, None)
    assert (
        raw_value(store, "R-1", "current_json")
        == '{"phase-a-op":{"op":"S-a","desc":"holds a","gen":1}}'
    )
    outcome = store.runs.vacate_assignee("R-1", SLOT_A, 1)
    assert isinstance(outcome, Released)
    assert raw_value(store, "R-1", "current_json") is None


def test_json_null_result_is_stored_as_text_null_and_unset_stays_sql_null(store: Store) -> None:
    store.runs.create(mk("R-never"))
    store.runs.create(mk("R-set"))
    store.runs.create(mk("R-created-null", result_ref=None))
    store.runs.set_result("R-set", None)
    assert raw_value(store, "R-never", "result_ref_json") is None
    assert store.runs.get("R-never").result_ref is UNSET
    for run_id in ("R-set", "R-created-null"):
        assert raw_value(store, run_id, "result_ref_json") == "null"
        got = store.runs.get(run_id).result_ref
        assert got is None
        assert got is not UNSET


def test_set_result_overwrites_and_json_null_replaces_a_value(store: Store) -> None:
    store.runs.create(mk("R-1"))
    store.runs.set_result("R-1", {"b": [1, 2.5, "x"], "a": None})
    assert raw_value(store, "R-1", "result_ref_json") == '{"a":null,"b":[1,2.5,"x"]}'
    store.runs.set_result("R-1", None)
    assert raw_value(store, "R-1", "result_ref_json") == "null"
    assert store.runs.get("R-1").result_ref is None


@pytest.mark.parametrize(
    "value",
    ["", "not json", '{"b":1,  "a":2}', "  [1,2] ", '{"unterminated": ', "ünï \u3000 ☃"],
)
def test_input_json_is_stored_verbatim(store: Store, value: str) -> None:
    store.runs.create(mk("R-created", input_json=value))
    store.runs.create(mk("R-set"))
    store.runs.set_input_json("R-set", value)
    for run_id in ("R-created", "R-set"):
        stored = raw_value(store, run_id, "input_json")
        assert stored == value
        assert stored is not None
        assert store.runs.get(run_id).input_json == value


def test_never_set_input_json_stays_null(store: Store) -> None:
    store.runs.create(mk("R-1"))
    assert raw_value(store, "R-1", "input_json") is None
    assert store.runs.get("R-1").input_json is None


# ---------------------------------------------------------------------- §5.5 corrupt columns

# (column, stored text, the field named in "decode <field>")
CORRUPT_CASES: list[tuple[str, Any, str]] = [
    ("status", '"paused"', "status"),
    ("status", "pending", "status"),
    ("status", '"Pending"', "status"),
    ("status", "5", "status"),
    ("status", "null", "status"),
    ("status", "", "status"),
    ("step_entries_json", "null", "step_entries"),
    ("step_entries_json", "{}", "step_entries"),
    ("step_entries_json", "[1]", "step_entries"),
    ("step_entries_json", '[{"step_id":"T-1","at":1}]', "step_entries"),
    ("step_entries_json", '[{"step_id":"ST-1","step_ref":"a","status":null}]', "step_entries"),
    ("step_entries_json", '[{"step_id":"ST-1","at":-1}]', "step_entries"),
    ("step_entries_json", '[{"step_id":"ST-1","at":1.5}]', "step_entries"),
    ("step_entries_json", '[{"step_id":"ST-1","at":true}]', "step_entries"),
    (
        "step_entries_json",
        '[{"step_id":"ST-1","binding_digest":"sha256:ABCDEF","at":1}]',
        "step_entries",
    ),
    ("step_entries_json", '[{"step_id":"ST-1","at":1}', "step_entries"),
    ("degradations_json", '[{"error":"boom","fallback":"cached","at":1}]', "degradations"),
    (
        "degradations_json",
        '[{"tool":"t","error":"e","fallback":"f","attempt":4294967296,"at":1}]',
        "degradations",
    ),
    ("degradations_json", "null", "degradations"),
    ("current_json", "null", "current"),
    ("current_json", "[]", "current"),
    ("current_json", '{"op":"main-ai","desc":"held","gen":1}', "current"),
    ("current_json", '{"phase-a-op":{"op":"S-1","gen":1}}', "current"),
    ("current_json", '{"phase-a-op":{"op":"S-1","desc":"d","gen":-1}}', "current"),
    ("current_json", '{"phase-a-op":{"op":"S-1","desc":"d","gen":1.0}}', "current"),
    ("current_json", '{"phase-a-op":{"op":"S-1","desc":"d","gen":true}}', "current"),
    ("current_json", '{"phase-a-op":{"op":"S-1","desc":"d","gen":"1"}}', "current"),
    ("current_json", '{"phase-a-op":{"op":"S-1","desc":"d","gen":NaN}}', "current"),
    ("current_json", "NaN", "current"),
    ("result_ref_json", '{"ok":', "result_ref"),
    ("result_ref_json", "NaN", "result_ref"),
    ("result_ref_json", "", "result_ref"),
    ("task_id", "R-1", "task_id"),
    ("task_id", "T-", "task_id"),
    ("next_generation", -1, "next_generation"),
    ("created_at", -5, "created_at"),
    ("updated_at", -1, "updated_at"),
]


def _case_id(case: tuple[str, Any, str]) -> str:
    return f"{case[0]}={case[1]!r}"


def _seed_three(store: Store) -> None:
    """R-1 (T-1, 100), R-2 (T-2, 200), R-3 (T-1, 300); R-1 holds a slot at G 5."""
    store.runs.create(
        mk(
            "R-1",
            "T-1",
            100,
            current={SLOT_A: Assignee(op="S-1", desc="d", gen=1)},
            next_generation=5,
        )
    )
    store.runs.create(mk("R-2", "T-2", 200))
    store.runs.create(mk("R-3", "T-1", 300))


def _assert_corrupt(exc: RunCorrupt, field: str, key: str) -> None:
    assert f"decode {field}" in str(exc)
    assert exc.field == field
    assert exc.key == key
    assert exc.table == "runs"


@pytest.mark.parametrize("case", CORRUPT_CASES, ids=_case_id)
def test_corrupt_column_fails_get_and_list(store: Store, case: tuple[str, Any, str]) -> None:
    column, value, field = case
    _seed_three(store)
    execute_sql(store, f"UPDATE runs SET {column} = :v WHERE id = 'R-1'", v=value)
    with pytest.raises(RunCorrupt) as err:
        store.runs.get("R-1")
    _assert_corrupt(err.value, field, "R-1")
    with pytest.raises(RunCorrupt) as err:
        store.runs.list()
    _assert_corrupt(err.value, field, "R-1")
    if column != "task_id":
        with pytest.raises(RunCorrupt) as err:
            store.runs.list_by_task("T-1")
        _assert_corrupt(err.value, field, "R-1")
        with pytest.raises(RunCorrupt) as err:
            store.runs.list(RunListFilter(task_id="T-1"))
        _assert_corrupt(err.value, field, "R-1")
    # Rows outside the filter still read.
    assert [r.id for r in store.runs.list(RunListFilter(task_id="T-2"))] == ["R-2"]
    assert store.runs.get("R-3").id == "R-3"


def test_corrupt_id_fails_list_and_names_the_stored_id(store: Store) -> None:
    _seed_three(store)
    execute_sql(store, "UPDATE runs SET id = 'X-1' WHERE id = 'R-1'")
    with pytest.raises(RunNotFound):
        store.runs.get("R-1")
    for call in (
        store.runs.list,
        lambda: store.runs.list_by_task("T-1"),
        lambda: store.runs.list(RunListFilter(offset=2)),
    ):
        with pytest.raises(RunCorrupt) as err:
            call()
        _assert_corrupt(err.value, "id", "X-1")
    assert [r.id for r in store.runs.list(RunListFilter(limit=2))] == ["R-3", "R-2"]


def test_corrupt_row_in_list_running_fails_it(store: Store) -> None:
    _seed_three(store)
    store.runs.update_status("R-1", RunStatus.RUNNING)
    assert [r.id for r in store.runs.list_running()] == ["R-1"]
    execute_sql(store, "UPDATE runs SET step_entries_json = '[1]' WHERE id = 'R-1'")
    with pytest.raises(RunCorrupt) as err:
        store.runs.list_running()
    _assert_corrupt(err.value, "step_entries", "R-1")


def test_first_corrupt_field_in_decode_order_is_reported(store: Store) -> None:
    _seed_three(store)
    execute_sql(
        store,
        "UPDATE runs SET status = 'pending', step_entries_json = 'null', "
        "degradations_json = '{}', current_json = '[]', result_ref_json = '{', "
        "task_id = 'R-9', id = 'X-1' WHERE id = 'R-1'",
    )
    # (field reported, repair applied before the next round)
    chain = [
        ("status", "status = '\"pending\"'"),
        ("step_entries", "step_entries_json = '[]'"),
        ("degradations", "degradations_json = '[]'"),
        ("current", "current_json = NULL"),
        ("result_ref", "result_ref_json = NULL"),
        ("id", "id = 'R-1'"),
        ("task_id", "task_id = 'T-1'"),
    ]
    row_id = "X-1"
    for field, repair in chain:
        with pytest.raises(RunCorrupt) as err:
            store.runs.list()
        _assert_corrupt(err.value, field, row_id)
        execute_sql(store, f"UPDATE runs SET {repair} WHERE id = :id", id=row_id)
        if field == "id":
            row_id = "R-1"
    assert [r.id for r in store.runs.list()] == ["R-3", "R-2", "R-1"]


def test_get_reports_the_first_corrupt_field_too(store: Store) -> None:
    _seed_three(store)
    execute_sql(
        store,
        "UPDATE runs SET current_json = '[]', result_ref_json = '{', task_id = 'nope' "
        "WHERE id = 'R-1'",
    )
    with pytest.raises(RunCorrupt) as err:
        store.runs.get("R-1")
    _assert_corrupt(err.value, "current", "R-1")
    execute_sql(store, "UPDATE runs SET current_json = NULL WHERE id = 'R-1'")
    with pytest.raises(RunCorrupt) as err:
        store.runs.get("R-1")
    _assert_corrupt(err.value, "result_ref", "R-1")
    execute_sql(store, "UPDATE runs SET result_ref_json = 'null' WHERE id = 'R-1'")
    with pytest.raises(RunCorrupt) as err:
        store.runs.get("R-1")
    _assert_corrupt(err.value, "task_id", "R-1")


def test_list_fails_only_when_the_bad_row_is_inside_the_filter_or_page(store: Store) -> None:
    _seed_three(store)  # list order: R-3 (300), R-2 (200), R-1 (100)
    store.runs.update_status("R-3", RunStatus.RUNNING)
    execute_sql(store, "UPDATE runs SET step_entries_json = '[1]' WHERE id = 'R-2'")

    def ids(**kw: Any) -> list[str]:
        return [r.id for r in store.runs.list(RunListFilter(**kw))]

    assert ids(task_id="T-1") == ["R-3", "R-1"]
    assert ids(status=RunStatus.RUNNING) == ["R-3"]
    assert ids(limit=1) == ["R-3"]
    assert ids(offset=2) == ["R-1"]
    assert ids(limit=0) == []
    assert ids(offset=3) == []
    assert [r.id for r in store.runs.list_by_task("T-1")] == ["R-1", "R-3"]
    assert [r.id for r in store.runs.list_running()] == ["R-3"]
    for kw in (
        {},
        {"limit": 2},
        {"offset": 1, "limit": 1},
        {"offset": 1},
        {"task_id": "T-2"},
        {"status": RunStatus.PENDING},
    ):
        with pytest.raises(RunCorrupt) as err:
            ids(**kw)
        _assert_corrupt(err.value, "step_entries", "R-2")
    with pytest.raises(RunCorrupt):
        store.runs.list_by_task("T-2")


BAD_STEPS = ["null", "{}", "[1]", '[{"step_id":"T-1","at":1}]', '[{"step_id":"ST-1","at":1}']
BAD_DEGRADATIONS = ["null", "{}", '[{"tool":"t","error":"e","at":1}]', "[", '[{"tool":1}]']


def _write_refused_unchanged(store: Store, clock: SettableClock, call: Any, field: str) -> None:
    before = run_row(store, "R-1")
    clock.advance(60_000)
    with pytest.raises(RunCorrupt) as err:
        call()
    _assert_corrupt(err.value, field, "R-1")
    assert run_row(store, "R-1") == before


@pytest.mark.parametrize("bad", BAD_STEPS)
def test_append_step_entry_on_corrupt_column_raises_and_leaves_it(
    store: Store, clock: SettableClock, bad: str
) -> None:
    store.runs.create(mk("R-1"))
    execute_sql(store, "UPDATE runs SET step_entries_json = :v WHERE id = 'R-1'", v=bad)
    entry = StepEntry.basic("ST-9", "step-z", "dispatched", None, 9)
    _write_refused_unchanged(
        store, clock, lambda: store.runs.append_step_entry("R-1", entry), "step_entries"
    )
    assert raw_value(store, "R-1", "step_entries_json") == bad


@pytest.mark.parametrize("bad", BAD_DEGRADATIONS)
def test_append_degradation_on_corrupt_column_raises_and_leaves_it(
    store: Store, clock: SettableClock, bad: str
) -> None:
    store.runs.create(mk("R-1"))
    execute_sql(store, "UPDATE runs SET degradations_json = :v WHERE id = 'R-1'", v=bad)
    entry = DegradationEntry(tool="t", error="e", fallback="f", at=9)
    _write_refused_unchanged(
        store, clock, lambda: store.runs.append_degradation("R-1", entry), "degradations"
    )
    assert raw_value(store, "R-1", "degradations_json") == bad


BAD_SLOTS: list[tuple[str, Any, str]] = [
    ("current_json", "null", "current"),
    ("current_json", "[]", "current"),
    ("current_json", '{"op":"S-1","desc":"held","gen":1}', "current"),
    ("current_json", '{"phase-a-op":{"op":"S-1","gen":1}}', "current"),
    ("current_json", '{"phase-a-op":{"op":"S-1","desc":"d","gen":1.0}}', "current"),
    ("current_json", '{"phase-a-op":', "current"),
    ("next_generation", -3, "next_generation"),
]


@pytest.mark.parametrize("case", BAD_SLOTS, ids=_case_id)
@pytest.mark.parametrize("operation", ["acquire", "vacate"])
def test_acquire_and_vacate_on_corrupt_slots_raise_and_write_nothing(
    store: Store, clock: SettableClock, case: tuple[str, Any, str], operation: str
) -> None:
    column, value, field = case
    store.runs.create(
        mk("R-1", current={SLOT_A: Assignee(op="S-1", desc="held", gen=1)}, next_generation=1)
    )
    execute_sql(store, f"UPDATE runs SET {column} = :v WHERE id = 'R-1'", v=value)
    if operation == "acquire":
        call: Any = lambda: store.runs.acquire_assignee("R-1", SLOT_A, "S-2", "takeover")  # noqa: E731
    else:
        call = lambda: store.runs.vacate_assignee("R-1", SLOT_A, 1)  # noqa: E731
    _write_refused_unchanged(store, clock, call, field)
    row = run_row(store, "R-1")
    assert row is not None
    assert row[column] == value


@pytest.mark.parametrize("bad", ['"paused"', "pending", '"Pending"', "5", "null", "[]"])
def test_update_status_repairs_a_corrupt_status(
    store: Store, clock: SettableClock, bad: str
) -> None:
    store.runs.create(mk("R-1"))
    execute_sql(store, "UPDATE runs SET status = :v WHERE id = 'R-1'", v=bad)
    with pytest.raises(RunCorrupt):
        store.runs.get("R-1")
    clock.set(1_800_000_000_500)
    store.runs.update_status("R-1", RunStatus.DONE)
    got = store.runs.get("R-1")
    assert got.status is RunStatus.DONE
    assert got.updated_at == 1_800_000_000
    assert raw_value(store, "R-1", "status") == '"done"'


@pytest.mark.parametrize("bad", ['"paused"', "pending", '"Pending"', "5", "null"])
def test_try_transition_on_a_corrupt_status_returns_false(
    store: Store, clock: SettableClock, bad: str
) -> None:
    store.runs.create(mk("R-1"))
    execute_sql(store, "UPDATE runs SET status = :v WHERE id = 'R-1'", v=bad)
    before = run_row(store, "R-1")
    clock.advance(60_000)
    for from_ in RunStatus:
        for to in (RunStatus.RUNNING, from_):
            assert store.runs.try_transition("R-1", from_, to) is False
    assert run_row(store, "R-1") == before


# ---------------------------------------------------------------------- SQLite-only


@pytest.fixture
def sqlite_store(tmp_path: Path) -> Iterator[Store]:
    """A store on a SQLite file (these values cannot be stored on Postgres)."""
    s = Store.open(
        f"sqlite:///{tmp_path / 'values.db'}", migrate=True, clock=SettableClock(1_700_000_000_000)
    )
    yield s
    s.close()


SQLITE_ONLY_CASES: list[tuple[str, Any, str]] = [
    ("created_at", "abc", "created_at"),
    ("updated_at", "1x", "updated_at"),
    ("next_generation", "abc", "next_generation"),
    ("created_at", 1.5, "created_at"),
    ("status", b'"pending"', "status"),
    ("step_entries_json", b"[]", "step_entries"),
    ("current_json", b"{}", "current"),
    ("result_ref_json", b"null", "result_ref"),
    ("task_id", b"T-1", "task_id"),
    ("status", 5, "status"),
    ("operator_sid", b"S-1", "operator_sid"),
    ("input_json", b"{}", "input_json"),
]


@pytest.mark.parametrize("case", SQLITE_ONLY_CASES, ids=_case_id)
def test_sqlite_only_wrong_storage_class_fails_loudly(
    sqlite_store: Store, case: tuple[str, Any, str]
) -> None:
    """SQLite-only: a BLOB in a TEXT column, text or REAL in an INTEGER column.

    Postgres cannot store these values at all (type error on the UPDATE), so
    the case does not exist there.
    """
    column, value, field = case
    store = sqlite_store
    _seed_three(store)
    execute_sql(store, f"UPDATE runs SET {column} = :v WHERE id = 'R-1'", v=value)
    with store.read() as uow:
        kind = uow.connection.execute(
            text(f"SELECT typeof({column}) FROM runs WHERE id = 'R-1'")
        ).scalar_one()
    assert kind in ("blob", "text", "real", "integer")
    with pytest.raises(RunCorrupt) as err:
        store.runs.get("R-1")
    _assert_corrupt(err.value, field, "R-1")
    with pytest.raises(RunCorrupt) as err:
        store.runs.list()
    _assert_corrupt(err.value, field, "R-1")
    assert [r.id for r in store.runs.list(RunListFilter(task_id="T-2"))] == ["R-2"]


def test_sqlite_only_numeric_text_in_integer_column_is_coerced(sqlite_store: Store) -> None:
    """SQLite-only: type affinity turns the text '42' into INTEGER 42, which reads fine."""
    store = sqlite_store
    store.runs.create(mk("R-1"))
    execute_sql(store, "UPDATE runs SET created_at = '42' WHERE id = 'R-1'")
    with store.read() as uow:
        kind = uow.connection.execute(
            text("SELECT typeof(created_at) FROM runs WHERE id = 'R-1'")
        ).scalar_one()
    assert kind == "integer"
    assert store.runs.get("R-1").created_at == 42


def test_sqlite_only_blob_in_current_fails_acquire_and_writes_nothing(
    sqlite_store: Store,
) -> None:
    """SQLite-only: a BLOB in current_json (Postgres TEXT cannot hold one)."""
    store = sqlite_store
    store.runs.create(mk("R-1"))
    execute_sql(store, "UPDATE runs SET current_json = :v WHERE id = 'R-1'", v=b"{}")
    before = run_row(store, "R-1")
    assert isinstance(store.clock, SettableClock)
    store.clock.advance(60_000)
    with pytest.raises(RunCorrupt) as err:
        store.runs.acquire_assignee("R-1", SLOT_A, "S-1", "hold")
    _assert_corrupt(err.value, "current", "R-1")
    assert run_row(store, "R-1") == before
