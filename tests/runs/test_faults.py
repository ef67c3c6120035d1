"""Atomicity under injected faults and killed processes, on SQLite and Postgres.

* A trigger that raises in the middle of a write (after the ``runs`` row was
  inserted or updated, inside the same transaction) makes the operation fail
  with a typed error, and nothing of it remains: no row, no counter advance.
* A unit of work holding several operations that fails at its last statement
  leaves none of them behind.
* A process SIGKILLed while its write unit is open (write lock held, changes
  not committed) leaves the row as it was, and the lock is released: another
  process writes at once.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import text

from agentkeep.errors import DatabaseError
from agentkeep.runs.domain import RunStatus, StepEntry
from agentkeep.store import Store
from tests.racing import READY_TIMEOUT_S
from tests.support import raw_exec

from .support import SLOT_A, mk, run_rows

_PG_FAULT_FN = """
CREATE OR REPLACE FUNCTION agentkeep_test_fault() RETURNS trigger AS $$
BEGIN
    RAISE EXCEPTION 'injected fault';
END $$ LANGUAGE plpgsql
"""


@pytest.fixture
def fault_on(db_url: str, backend: str) -> Iterator[Any]:
    """``fault_on(event)`` installs a trigger on ``runs`` that raises on that event.

    ``event`` is ``"insert"`` or ``"failed-status"`` (an UPDATE setting the
    status to ``"failed"``). SQLite: ``RAISE(ABORT)`` triggers; Postgres:
    plpgsql triggers. Dropped afterwards.
    """
    installed: list[str] = []

    def install(event: str) -> None:
        if backend == "sqlite":
            when = {
                "insert": "AFTER INSERT ON runs",
                "failed-status": "AFTER UPDATE OF status ON runs WHEN NEW.status = '\"failed\"'",
            }[event]
            raw_exec(
                db_url,
                f"CREATE TRIGGER agentkeep_test_fault_{len(installed)} {when} "
                "BEGIN SELECT RAISE(ABORT, 'injected fault'); END",
            )
        else:
            when = {
                "insert": "AFTER INSERT ON runs FOR EACH ROW",
                "failed-status": "AFTER UPDATE OF status ON runs FOR EACH ROW "
                "WHEN (NEW.status = '\"failed\"')",
            }[event]
            raw_exec(
                db_url,
                _PG_FAULT_FN,
                f"CREATE TRIGGER agentkeep_test_fault_{len(installed)} {when} "
                "EXECUTE FUNCTION agentkeep_test_fault()",
            )
        installed.append(f"agentkeep_test_fault_{len(installed)}")

    yield install
    for name in installed:
        raw_exec(
            db_url, f"DROP TRIGGER IF EXISTS {name}" + ("" if backend == "sqlite" else " ON runs")
        )


def _seq_counter(store: Store) -> Any:
    """The next insertion number: SQLite's counter row, or Postgres' sequence state."""
    with store.read() as uow:
        if uow.driver.postgres:
            return uow.connection.execute(text("SELECT last_value FROM runs_seq_seq")).scalar()
        return uow.connection.execute(text("SELECT last_seq FROM runs_seq_counter")).scalar()


def test_a_fault_after_the_insert_leaves_no_run(store: Store, fault_on: Any, backend: str) -> None:
    store.runs.create(mk("R-before"))
    before_rows = run_rows(store)
    before_counter = _seq_counter(store)
    fault_on("insert")

    with pytest.raises(DatabaseError, match="injected fault"):
        store.runs.create(mk("R-1"))

    assert run_rows(store) == before_rows
    if backend == "sqlite":  # a Postgres sequence is not transactional, by design
        assert _seq_counter(store) == before_counter


def test_a_fault_at_the_last_statement_rolls_back_the_whole_unit(
    store: Store, fault_on: Any
) -> None:
    store.runs.create(mk("R-1"))
    before = run_rows(store)
    fault_on("failed-status")

    with pytest.raises(DatabaseError, match="injected fault"), store.write() as uow:
        uow.runs.create(mk("R-2"))
        uow.runs.acquire_assignee("R-1", SLOT_A, "S-a", "held")
        uow.runs.append_step_entry("R-1", StepEntry.basic("ST-1", "a", "dispatched", None, 1))
        uow.runs.try_transition("R-1", RunStatus.PENDING, RunStatus.RUNNING)
        uow.runs.update_status("R-1", RunStatus.FAILED)  # the trigger raises here

    assert run_rows(store) == before
    # The store is usable afterwards and the same operations succeed without the fault's status.
    with store.write() as uow:
        uow.runs.create(mk("R-2"))
        assert uow.runs.acquire_assignee("R-1", SLOT_A, "S-a", "held") == (1, None)


def test_a_failed_one_call_operation_writes_nothing(store: Store, fault_on: Any) -> None:
    store.runs.create(mk("R-1"))
    store.runs.acquire_assignee("R-1", SLOT_A, "S-a", "held")
    before = run_rows(store)
    fault_on("failed-status")

    with pytest.raises(DatabaseError):
        store.runs.update_status("R-1", RunStatus.FAILED)
    with pytest.raises(DatabaseError):
        store.runs.try_transition("R-1", RunStatus.PENDING, RunStatus.FAILED)
    assert run_rows(store) == before


# --------------------------------------------------------------------------
# A process killed inside its write unit


def _hold_uncommitted(url: str, ready: Any) -> None:
    store = Store.open(url)
    with store.write() as uow:
        uow.runs.acquire_assignee("R-1", SLOT_A, "S-doomed", "never committed")
        uow.runs.append_step_entry("R-1", StepEntry.basic("ST-9", "x", "doomed", None, 9))
        ready.set()
        signal.pause()  # killed here, inside the transaction


def test_a_process_killed_inside_its_write_unit_leaves_nothing_and_frees_the_lock(
    db_url: str, clock: Any
) -> None:
    store = Store.open(db_url, clock=clock, busy_timeout_ms=10_000)
    store.runs.create(mk("R-1"))
    before = run_rows(store)

    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    child = ctx.Process(target=_hold_uncommitted, args=(db_url, ready), daemon=True)
    child.start()
    try:
        # its start-up (spawn, imports) comes first
        assert ready.wait(READY_TIMEOUT_S), "the child never reached its open write unit"
        os.kill(child.pid, signal.SIGKILL)
        child.join(30)
    finally:
        if child.is_alive():
            child.kill()
    assert child.exitcode == -signal.SIGKILL

    assert run_rows(store) == before
    # The dead writer's lock is gone: a new writer proceeds, and its generation is 1.
    assert store.runs.acquire_assignee("R-1", SLOT_A, "S-alive", "after the crash") == (1, None)
    assert store.runs.get("R-1").step_entries == ()
    store.close()


def test_an_oversized_value_is_refused_and_the_row_is_unchanged(tmp_path: Any, clock: Any) -> None:
    """SQLite only (spec §5.9): a value past SQLITE_LIMIT_LENGTH fails the append, row unchanged.

    The limit is lowered to 4 KiB on the store's connections so the test does
    not need a 1 GB string; the failure path is the same.
    """
    import sqlite3

    from sqlalchemy import event

    url = f"sqlite:///{tmp_path / 'limit.db'}"
    store = Store.open(url, migrate=True, clock=clock)

    @event.listens_for(store.engine, "connect")
    def _limit(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, 4096)

    store.engine.dispose()  # new connections get the limit
    store.runs.create(mk("R-1"))
    entry = StepEntry.basic("ST-1", "x" * 200, "dispatched", None, 1)
    appended = 0
    with pytest.raises(DatabaseError, match="too big"):
        for _ in range(100):
            store.runs.append_step_entry("R-1", entry)
            appended += 1
    before = run_rows(store)
    assert 0 < appended < 100
    assert len(store.runs.get("R-1").step_entries) == appended
    with pytest.raises(DatabaseError, match="too big"):
        store.runs.append_step_entry("R-1", entry)
    assert run_rows(store) == before
    store.close()
