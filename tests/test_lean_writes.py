"""Lean one-call write units: the SQLite writer queue (``Store._lean``), and
single-row batches (``Driver.executemany``) on both backends.

* SQLite: one-call writers of one store queue on its mutex; a
  writer still queued when the busy timeout passes gets ``StoreBusy`` and
  writes nothing; writers racing in real threads all commit.
* ``executemany`` of one parameter set runs it as one execute: it writes the
  row, reports its row count, and a refused row fails the unit with nothing
  written (SQLite and Postgres).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from agentkeep import migrations as migrate
from agentkeep.errors import DatabaseError, RunNotFound, StoreBusy
from agentkeep.runs.domain import RunRecord
from agentkeep.sessions.checkpoint_nodes import _ADD_WRITE, _DELETE_NODE_WRITES
from agentkeep.sessions.maintenance import _in_params
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


def test_a_batch_of_one_writes_its_row_and_counts_it(store: Store) -> None:
    def unit(r: Repositories) -> int:
        r.driver.executemany(_ADD_WRITE, [_write_row("n-1", b"v1")])
        return r.driver.executemany(
            _DELETE_NODE_WRITES, [{"sid": "S-1", **_in_params(["n-0", "n-2"])}]
        )

    assert store.call_write(unit) == 0  # nothing of n-0 / n-2 to delete
    writes = store.checkpoint_nodes.list_pending_writes("S-1", "n-1")
    assert [(w.channel, w.value) for w in writes] == [("c", b"v1")]
    deleted = store.call_write(
        lambda r: r.driver.executemany(_DELETE_NODE_WRITES, [{"sid": "S-1", **_in_params(["n-1"])}])
    )
    assert deleted == 1
    assert store.checkpoint_nodes.list_pending_writes("S-1", "n-1") == []


def test_a_refused_batch_of_one_fails_the_unit_and_leaves_nothing(store: Store) -> None:
    def unit(r: Repositories) -> None:
        r.runs.create(RunRecord.new("R-1", "T-1", 10))
        r.driver.executemany(_ADD_WRITE, [_write_row("n-1", None)])  # NOT NULL: refused

    with pytest.raises(DatabaseError) as info:
        store.call_write(unit)
    assert not isinstance(info.value, StoreBusy)
    with pytest.raises(RunNotFound):
        store.runs.get("R-1")
    assert store.checkpoint_nodes.list_pending_writes("S-1", "n-1") == []
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


@pytest.mark.parametrize("busy_timeout_ms", [300, 0], ids=["timeout-300ms", "timeout-0ms"])
def test_sqlite_a_one_call_write_inside_a_queued_write_is_store_busy(
    tmp_path: Path, busy_timeout_ms: int
) -> None:
    """SQLite only: a one-call write made inside this thread's own queued write does not
    wait for itself on the queue; SQLite's busy handler refuses it (``StoreBusy``) as
    it did before the queue, and the outer write still commits."""
    url = f"sqlite:///{tmp_path / 'agentkeep.db'}"
    migrate.upgrade(url)
    store = Store.open(url, busy_timeout_ms=busy_timeout_ms, retry_attempts=2)
    inner: dict[str, Any] = {}

    def outer(r: Repositories) -> None:
        r.runs.create(RunRecord.new("R-1", "T-1", 10))
        try:
            store.runs.create(RunRecord.new("R-2", "T-1", 10))
        except StoreBusy as exc:
            inner["error"] = exc

    def run() -> None:
        try:
            store.call_write(outer)
        except BaseException as exc:  # noqa: BLE001 - asserted below
            inner["outer"] = exc

    thread = threading.Thread(target=run, daemon=True)
    try:
        thread.start()
        thread.join(60)
        assert not thread.is_alive(), "the inner one-call write waited for its own thread"
        assert "outer" not in inner, inner.get("outer")
        assert isinstance(inner.get("error"), StoreBusy)
        assert store.runs.get("R-1").id == "R-1"
        with pytest.raises(RunNotFound):
            store.runs.get("R-2")
    finally:
        if not thread.is_alive():
            store.close()
