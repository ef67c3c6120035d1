"""Lean one-call write units: queued last writes (``Driver.write_at_commit``) and the
SQLite writer queue (``Store._lean``).

* ``write_at_commit``: on psycopg the queued writes go out with the unit's
  COMMIT (or before its next statement), elsewhere at once; either way a read
  after them in the same unit sees them, and a queued write that fails fails
  the unit with its typed error and leaves nothing (both backends).
* SQLite: one-call writers of one process queue on the store's mutex; a
  writer still queued when the busy timeout passes gets ``StoreBusy`` and
  writes nothing (real threads).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from agentkeep import migrations as migrate
from agentkeep.errors import CommitOutcomeUnknown, DatabaseError, RunNotFound, StoreBusy
from agentkeep.runs.domain import RunRecord
from agentkeep.sessions.checkpoint_nodes import _ADD_WRITE
from agentkeep.store import Store
from agentkeep.unit_of_work import Repositories


def _write_row(node: str, value: Any) -> dict[str, Any]:
    return {
        "sid": "S-1",
        "nid": node,
        "task": "T",
        "idx": 0,
        "channel": "c",
        "type": "bytes",
        "value": value,
        "path": "",
    }


def test_queued_writes_are_seen_by_the_units_next_read_and_committed(store: Store) -> None:
    def unit(r: Repositories) -> list[str]:
        r.checkpoint_nodes.put_checkpoint_node("S-1", "n-1", b"body", node_json='{"a":1}')
        r.driver.write_at_commit(_ADD_WRITE, [_write_row("n-1", b"v1"), _write_row("n-2", b"v2")])
        node = r.checkpoint_nodes.get_checkpoint_node("S-1", "n-1")  # after the queued writes
        assert node is not None and node.body == b"body"
        return [w.channel for w in node.writes]

    assert store.call_write(unit) == ["c"]
    node = store.checkpoint_nodes.get_checkpoint_node("S-1", "n-1")
    assert node is not None and node.node_json == '{"a":1}'
    assert [w.value for w in store.checkpoint_nodes.list_pending_writes("S-1", "n-2")] == [b"v2"]


def test_a_queued_write_that_fails_fails_the_unit_and_leaves_nothing(store: Store) -> None:
    def unit(r: Repositories) -> None:
        r.runs.create(RunRecord.new("R-1", "T-1", 10))
        r.checkpoint_nodes.put_checkpoint_node("S-1", "n-1", b"body")
        r.driver.write_at_commit(_ADD_WRITE, [_write_row("n-1", None)])  # NOT NULL: refused

    with pytest.raises(DatabaseError) as info:
        store.call_write(unit)
    assert not isinstance(info.value, StoreBusy | CommitOutcomeUnknown)  # a definite failure
    with pytest.raises(RunNotFound):
        store.runs.get("R-1")
    assert store.checkpoint_nodes.get_checkpoint_node("S-1", "n-1") is None
    # the pooled connection came back clean: the next unit writes
    store.call_write(lambda r: r.runs.create(RunRecord.new("R-2", "T-1", 10)))
    assert store.runs.get("R-2").id == "R-2"


@pytest.fixture
def sqlite_store(tmp_path: Path) -> Any:
    url = f"sqlite:///{tmp_path / 'agentkeep.db'}"
    migrate.upgrade(url)
    store = Store.open(url, busy_timeout_ms=300, retry_attempts=2)
    yield store
    store.close()


def test_sqlite_a_queued_writer_past_the_busy_timeout_is_store_busy(sqlite_store: Store) -> None:
    """SQLite only: the writer queue honours the one deadline; the queued writer writes nothing."""
    holding, release = threading.Event(), threading.Event()
    outcome: dict[str, Any] = {}

    def hold(r: Repositories) -> None:
        r.runs.create(RunRecord.new("R-1", "T-1", 10))
        holding.set()
        assert release.wait(10)

    def holder() -> None:
        try:
            sqlite_store.call_write(hold)
        except BaseException as exc:  # noqa: BLE001 - asserted below
            outcome["error"] = exc

    thread = threading.Thread(target=holder)
    thread.start()
    try:
        assert holding.wait(10)
        with pytest.raises(StoreBusy):
            sqlite_store.runs.create(RunRecord.new("R-2", "T-1", 10))
    finally:
        release.set()
        thread.join(10)
    assert "error" not in outcome, outcome.get("error")
    assert sqlite_store.runs.get("R-1").id == "R-1"
    with pytest.raises(RunNotFound):
        sqlite_store.runs.get("R-2")
    sqlite_store.runs.create(RunRecord.new("R-2", "T-1", 10))  # the queue is free again
    assert sqlite_store.runs.get("R-2").id == "R-2"


def test_sqlite_writers_of_one_process_all_commit(tmp_path: Path) -> None:
    """SQLite only: threads writing at once each commit every write, none is lost."""
    url = f"sqlite:///{tmp_path / 'agentkeep.db'}"
    migrate.upgrade(url)
    store = Store.open(url)
    errors: list[BaseException] = []
    start = threading.Barrier(6)

    def writer(n: int) -> None:
        try:
            start.wait(10)
            for i in range(20):
                store.runs.create(RunRecord.new(f"R-{n}-{i}", "T-1", 10))
        except BaseException as exc:  # noqa: BLE001 - asserted below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    try:
        assert errors == []
        found = store.call_read(
            lambda r: [r.runs.get(f"R-{n}-{i}") for n in range(6) for i in range(20)]
        )
        assert len(found) == 120
    finally:
        store.close()
