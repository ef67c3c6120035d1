"""Unit-of-work semantics of the run store (design.md §3), on both backends.

* several operations in one ``store.write()`` commit together and are
  invisible to other connections until the block ends;
* an exception raised inside the block rolls back everything of the block;
* a host application's own ORM rows added through ``uow.session`` commit and
  roll back atomically with ``uow.runs`` writes;
* write operations inside ``store.read()`` raise ``ReadOnlyUnitOfWork`` and
  write nothing;
* a read unit sees one consistent snapshot.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import Integer, Text, create_engine, select, text
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from agentkeep.clock import SettableClock
from agentkeep.errors import (
    AgentkeepError,
    AssigneeDescRequired,
    DatabaseError,
    ReadOnlyUnitOfWork,
    RunDuplicate,
    RunNotFound,
)
from agentkeep.runs.domain import (
    UNSET,
    Assignee,
    DegradationEntry,
    RunListFilter,
    RunStatus,
    StepEntry,
)
from agentkeep.store import Store

from .support import SLOT_A, mk, run_rows

NOW_MS = 1_800_000_000_000


class Boom(Exception):
    """Raised by a test inside a unit of work."""


# ---------------------------------------------------------------------- a host application's model


class HostBase(DeclarativeBase):
    """The host application's own declarative base (not agentkeep's)."""


class HostAudit(HostBase):
    __tablename__ = "host_audit"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    run_id: Mapped[str] = mapped_column(Text, nullable=False)
    note: Mapped[str] = mapped_column(Text, nullable=False)


@pytest.fixture
def host_table(db_url: str) -> Iterator[str]:
    """Create ``host_audit`` with raw DDL on the test database; drop it afterwards."""
    engine = create_engine(db_url)
    try:
        with engine.begin() as conn:
            conn.execute(text("DROP TABLE IF EXISTS host_audit"))
            conn.execute(
                text(
                    "CREATE TABLE host_audit (id INTEGER PRIMARY KEY, run_id TEXT NOT NULL, "
                    "note TEXT NOT NULL)"
                )
            )
        yield db_url
    finally:
        with engine.begin() as conn:
            conn.execute(text("DROP TABLE IF EXISTS host_audit"))
        engine.dispose()


def host_rows(url: str) -> list[tuple[int, str, str]]:
    engine = create_engine(url)
    try:
        with Session(engine) as session:
            return [
                (a.id, a.run_id, a.note)
                for a in session.scalars(select(HostAudit).order_by(HostAudit.id))
            ]
    finally:
        engine.dispose()


# ---------------------------------------------------------------------- write units


def test_operations_in_one_write_unit_commit_together(
    store: Store, db_url: str, clock: SettableClock
) -> None:
    store.runs.create(mk("R-0"))
    clock.set(NOW_MS)
    with Store.open(db_url, clock=clock) as observer:
        with store.write() as uow:
            uow.runs.create(mk("R-1"))
            assert uow.runs.acquire_assignee("R-1", SLOT_A, "S-1", "held") == (1, None)
            uow.runs.append_step_entry("R-1", StepEntry.basic("ST-1", "a", "dispatched", None, 1))
            uow.runs.append_degradation(
                "R-1", DegradationEntry(tool="t", error="e", fallback="f", at=2)
            )
            uow.runs.set_result("R-1", {"ok": True})
            uow.runs.set_input_json("R-1", "in")
            uow.runs.update_status("R-0", RunStatus.RUNNING)
            uow.runs.create(mk("R-2"))
            uow.runs.delete("R-2")
            # The unit sees its own writes ...
            inside = uow.runs.get("R-1")
            assert inside.current[SLOT_A].gen == 1
            assert [r.id for r in uow.runs.list_running()] == ["R-0"]
            # ... another connection sees none of them yet.
            with pytest.raises(RunNotFound):
                observer.runs.get("R-1")
            assert observer.runs.get("R-0").status is RunStatus.PENDING
        after = observer.runs.get("R-1")
    assert after == inside
    assert after.next_generation == 1
    assert len(after.step_entries) == 1 and len(after.degradations) == 1
    assert after.result_ref == {"ok": True}
    assert after.input_json == "in"
    assert after.updated_at == NOW_MS // 1000
    assert store.runs.get("R-0").status is RunStatus.RUNNING
    assert [r["id"] for r in run_rows(store)] == ["R-0", "R-1"]


def test_an_exception_in_the_block_rolls_back_everything(
    store: Store, clock: SettableClock
) -> None:
    store.runs.create(mk("R-0"))
    before = run_rows(store)
    clock.set(NOW_MS)
    boom = Boom("host failed after the writes")
    with pytest.raises(Boom) as err:
        with store.write() as uow:
            uow.runs.create(mk("R-1"))
            uow.runs.acquire_assignee("R-1", SLOT_A, "S-1", "held")
            uow.runs.append_step_entry("R-1", StepEntry.basic("ST-1", "a", None, None, 1))
            uow.runs.update_status("R-0", RunStatus.DONE)
            uow.runs.acquire_assignee("R-0", SLOT_A, "S-9", "held too")
            assert uow.runs.get("R-1").step_entries
            raise boom
    assert err.value is boom
    with pytest.raises(RunNotFound):
        store.runs.get("R-1")
    assert run_rows(store) == before
    # The store is still usable and the rolled-back generation was not burned.
    assert store.runs.acquire_assignee("R-0", SLOT_A, "S-9", "after rollback") == (1, None)


def test_a_store_error_that_escapes_the_block_rolls_it_back(store: Store) -> None:
    store.runs.create(mk("R-0"))
    before = run_rows(store)
    with pytest.raises(RunNotFound):
        with store.write() as uow:
            uow.runs.create(mk("R-1"))
            uow.runs.update_status("R-0", RunStatus.FAILED)
            uow.runs.append_step_entry("R-nope", StepEntry.basic("ST-1", None, None, None, 1))
    assert run_rows(store) == before


def test_a_store_error_caught_inside_the_block_keeps_the_rest(store: Store) -> None:
    store.runs.create(mk("R-0"))
    with store.write() as uow:
        uow.runs.create(mk("R-1"))
        with pytest.raises(RunDuplicate):
            uow.runs.create(mk("R-0", created_at=999))
        with pytest.raises(RunNotFound):
            uow.runs.update_status("R-nope", RunStatus.DONE)
        with pytest.raises(AssigneeDescRequired):
            uow.runs.acquire_assignee("R-1", SLOT_A, "S-1", " ")
        uow.runs.acquire_assignee("R-1", SLOT_A, "S-1", "held")
    got = store.runs.get("R-1")
    assert got.current == {SLOT_A: Assignee(op="S-1", desc="held", gen=1)}
    assert store.runs.get("R-0").created_at == 100


# ---------------------------------------------------------------------- host ORM rows


def test_host_rows_commit_atomically_with_run_writes(store: Store, host_table: str) -> None:
    with store.write() as uow:
        uow.runs.create(mk("R-1"))
        uow.session.add(HostAudit(id=1, run_id="R-1", note="launched"))
        uow.runs.acquire_assignee("R-1", SLOT_A, "S-1", "held")
        uow.session.add(HostAudit(id=2, run_id="R-1", note="assigned"))
        # The host's session and the run store share the transaction.
        uow.session.flush()
        n = uow.connection.execute(text("SELECT COUNT(*) FROM host_audit")).scalar_one()
        assert n == 2
    assert store.runs.get("R-1").next_generation == 1
    assert host_rows(host_table) == [(1, "R-1", "launched"), (2, "R-1", "assigned")]


def test_host_rows_roll_back_with_run_writes(store: Store, host_table: str) -> None:
    with pytest.raises(Boom):
        with store.write() as uow:
            uow.runs.create(mk("R-1"))
            uow.session.add(HostAudit(id=1, run_id="R-1", note="launched"))
            uow.session.commit()  # only flushes: the unit owns the transaction
            uow.runs.acquire_assignee("R-1", SLOT_A, "S-1", "held")
            raise Boom()
    assert run_rows(store) == []
    assert host_rows(host_table) == []


def test_a_failing_host_flush_rolls_back_the_run_writes(store: Store, host_table: str) -> None:
    with store.write() as uow:
        uow.session.add(HostAudit(id=1, run_id="R-0", note="existing"))
    with pytest.raises(AgentkeepError) as err:
        with store.write() as uow:
            uow.runs.create(mk("R-1"))
            uow.runs.acquire_assignee("R-1", SLOT_A, "S-1", "held")
            # Duplicate primary key: fails when the unit flushes at commit.
            uow.session.add(HostAudit(id=1, run_id="R-1", note="clash"))
    assert isinstance(err.value, DatabaseError)
    with pytest.raises(RunNotFound):
        store.runs.get("R-1")
    assert host_rows(host_table) == [(1, "R-0", "existing")]


def test_a_run_store_error_rolls_back_host_rows(store: Store, host_table: str) -> None:
    with pytest.raises(RunNotFound):
        with store.write() as uow:
            uow.session.add(HostAudit(id=1, run_id="R-nope", note="before the failure"))
            uow.session.flush()
            uow.runs.acquire_assignee("R-nope", SLOT_A, "S-1", "held")
    assert host_rows(host_table) == []


# ---------------------------------------------------------------------- read units

WRITE_CALLS: list[tuple[str, Callable[[Any], object]]] = [
    ("create", lambda r: r.create(mk("R-9"))),
    (
        "append_step_entry",
        lambda r: r.append_step_entry("R-1", StepEntry.basic("ST-2", None, None, None, 2)),
    ),
    (
        "append_degradation",
        lambda r: r.append_degradation(
            "R-1", DegradationEntry(tool="t", error="e", fallback="f", at=2)
        ),
    ),
    ("update_status", lambda r: r.update_status("R-1", RunStatus.DONE)),
    ("try_transition", lambda r: r.try_transition("R-1", RunStatus.PENDING, RunStatus.RUNNING)),
    ("acquire_assignee", lambda r: r.acquire_assignee("R-1", "other", "S-2", "held")),
    ("vacate_assignee", lambda r: r.vacate_assignee("R-1", SLOT_A, 1)),
    ("set_result", lambda r: r.set_result("R-1", 1)),
    ("set_input_json", lambda r: r.set_input_json("R-1", "x")),
    ("delete", lambda r: r.delete("R-1")),
]


@pytest.mark.parametrize(("name", "call"), WRITE_CALLS, ids=[w[0] for w in WRITE_CALLS])
def test_writes_in_a_read_unit_are_refused_and_write_nothing(
    store: Store, clock: SettableClock, name: str, call: Callable[[Any], object]
) -> None:
    store.runs.create(
        mk("R-1", current={SLOT_A: Assignee(op="S-1", desc="held", gen=1)}, next_generation=1)
    )
    before = run_rows(store)
    clock.set(NOW_MS)
    with store.read() as uow:
        with pytest.raises(ReadOnlyUnitOfWork):
            call(uow.runs)
        # Reads still work in the same unit.
        assert uow.runs.get("R-1").next_generation == 1
    assert run_rows(store) == before
    with pytest.raises(ReadOnlyUnitOfWork):
        with store.read() as uow:
            call(uow.runs)
    assert run_rows(store) == before


def test_a_read_unit_sees_a_consistent_snapshot(
    store: Store, db_url: str, clock: SettableClock
) -> None:
    store.runs.create(mk("R-1"))
    store.runs.create(mk("R-2", "T-2", 200))
    with Store.open(db_url, clock=clock) as writer:
        with store.read() as uow:
            first = (
                uow.runs.get("R-1"),
                uow.runs.list(),
                uow.runs.list_by_task("T-1"),
                uow.runs.list_running(),
            )
            # Another connection commits changes while the read unit is open.
            clock.set(NOW_MS)
            writer.runs.update_status("R-1", RunStatus.RUNNING)
            writer.runs.acquire_assignee("R-1", SLOT_A, "S-1", "held")
            writer.runs.create(mk("R-3", "T-1", 300, status=RunStatus.RUNNING))
            writer.runs.delete("R-2")
            assert writer.runs.get("R-1").status is RunStatus.RUNNING
            second = (
                uow.runs.get("R-1"),
                uow.runs.list(),
                uow.runs.list_by_task("T-1"),
                uow.runs.list_running(),
            )
            assert second == first
            with pytest.raises(RunNotFound):
                uow.runs.get("R-3")
    # A new read unit sees the committed changes.
    with store.read() as uow:
        assert uow.runs.get("R-1").status is RunStatus.RUNNING
        assert [r.id for r in uow.runs.list(RunListFilter())] == ["R-3", "R-1"]
        assert uow.runs.get("R-1").result_ref is UNSET
