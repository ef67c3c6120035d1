"""The connection a one-call unit parks for the next (``Store._park_connections``).

On an engine the store created for a SQLite file, a one-call unit that ends
cleanly leaves its connection checked out, parked on the store, and the next
one-call unit takes it back. These tests check what parking must never
change: a parked connection holds no snapshot (a later one-call read sees
what another connection committed since), holds no lock (another connection
writes while it is parked), a failed unit does not leave a transaction on it,
a lost connection and ``close`` return it to the pool, and a host's engine
and in-memory SQLite never park. On Postgres (psycopg) the same, and a
parked connection, kept in the lean units' autocommit mode, is switched back
whenever it goes back to the pool.
"""

from __future__ import annotations

import gc
import os
import sqlite3
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import pq
from sqlalchemy import create_engine

from agentkeep import migrations as migrate
from agentkeep import store as store_module
from agentkeep.errors import RunDuplicate, RunNotFound
from agentkeep.runs.domain import RunRecord, RunStatus
from agentkeep.runs.repository import _LIST_BY_TASK
from agentkeep.store import Store, _release_parked


def _file_store(tmp_path: Path) -> tuple[Store, Path]:
    path = tmp_path / "parked.db"
    migrate.upgrade(f"sqlite:///{path}")
    return Store.open(f"sqlite:///{path}"), path


def _raw(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None, timeout=5)
    conn.execute("PRAGMA busy_timeout=5000")
    return conn


def test_one_call_units_park_one_connection_and_close_returns_it(tmp_path: Path) -> None:
    store, _ = _file_store(tmp_path)
    pool = store.engine.pool
    store.runs.create(RunRecord.new("R-1", "T-1", 10))
    assert len(store._parked) == 1
    assert pool.checkedout() == 1  # the parked connection
    first = store._parked[0][0].dbapi_connection
    for _ in range(3):
        store.runs.get("R-1")
        store.runs.try_transition("R-1", RunStatus.PENDING, RunStatus.PENDING)
    assert len(store._parked) == 1
    assert store._parked[0][0].dbapi_connection is first  # taken back, not checked out anew
    assert pool.checkedout() == 1
    store.close()
    assert store._parked == []
    assert pool.checkedout() == 0


def test_a_parked_connection_holds_no_snapshot(tmp_path: Path) -> None:
    """A one-call read after another connection's commit sees that commit.

    ``get`` reads one row with ``fetchone``: its statement is not stepped to
    the end, so while its cursor lived it would keep the read transaction
    (and so the old snapshot) of the parked connection open.
    """
    store, path = _file_store(tmp_path)
    try:
        store.runs.create(RunRecord.new("R-1", "T-1", 10))
        assert store.runs.get("R-1").status is RunStatus.PENDING
        assert store._parked
        other = _raw(path)
        try:
            other.execute("UPDATE runs SET status = ? WHERE id = ?", ('"running"', "R-1"))
            other.execute(
                "INSERT INTO runs (id, task_id, status, step_entries_json, degradations_json,"
                " next_generation, created_at, updated_at)"
                " SELECT 'R-2', task_id, status, step_entries_json, degradations_json,"
                " next_generation, created_at, updated_at FROM runs WHERE id = 'R-1'"
            )
        finally:
            other.close()
        assert store.runs.get("R-1").status is RunStatus.RUNNING
        assert store.runs.get("R-2").id == "R-2"
    finally:
        store.close()


def test_a_parked_connection_holds_no_lock(tmp_path: Path) -> None:
    store, path = _file_store(tmp_path)
    try:
        store.runs.create(RunRecord.new("R-1", "T-1", 10))
        store.runs.get("R-1")
        assert store._parked
        other = _raw(path)
        try:
            other.execute("PRAGMA busy_timeout=0")  # a held lock fails at once
            other.execute("BEGIN EXCLUSIVE")
            other.execute("UPDATE runs SET updated_at = 11 WHERE id = 'R-1'")
            other.execute("COMMIT")
        finally:
            other.close()
        assert store.runs.get("R-1").updated_at == 11
    finally:
        store.close()


def test_a_parked_connection_does_not_hold_the_wal(tmp_path: Path) -> None:
    """A full checkpoint succeeds while a connection is parked after a one-row read.

    A reader's snapshot pins the WAL: ``wal_checkpoint(TRUNCATE)`` reports
    busy while any connection still has a statement in progress, as a
    SELECT of several rows of which a unit read only the first has.
    """
    store, path = _file_store(tmp_path)
    try:
        store.runs.create(RunRecord.new("R-1", "T-1", 10))
        store.runs.create(RunRecord.new("R-2", "T-1", 11))
        store.runs.try_transition("R-1", RunStatus.PENDING, RunStatus.RUNNING)
        first = store.call_read(
            lambda r: r.driver.execute(_LIST_BY_TASK, {"task_id": "T-1"}).fetchone(),
            single_statement=True,
        )
        assert first[0] == "R-1"  # R-2 left unread: the statement is still in progress
        assert store._parked
        other = _raw(path)
        try:
            other.execute("PRAGMA busy_timeout=0")
            busy, _log, _done = other.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        finally:
            other.close()
        assert busy == 0
    finally:
        store.close()


def test_a_failed_unit_leaves_no_transaction_on_the_parked_connection(db_url: str) -> None:
    store = Store.open(db_url)
    try:
        store.runs.create(RunRecord.new("R-1", "T-1", 10))
        with pytest.raises(RunDuplicate):
            store.runs.create(RunRecord.new("R-1", "T-1", 10))
        with pytest.raises(RunNotFound):
            store.runs.get("R-404")
        ((pooled, _driver),) = store._parked
        raw = pooled.dbapi_connection
        if store.engine.dialect.name == "postgresql":
            assert raw.info.transaction_status == pq.TransactionStatus.IDLE
        else:
            assert not raw.in_transaction
        store.runs.create(RunRecord.new("R-2", "T-1", 10))
        assert [r.id for r in store.runs.list_by_task("T-1")] == ["R-1", "R-2"]
    finally:
        store.close()


def test_a_store_never_closed_returns_its_parked_connection(tmp_path: Path) -> None:
    store, _ = _file_store(tmp_path)
    engine = store.engine
    store.runs.create(RunRecord.new("R-1", "T-1", 10))
    assert engine.pool.checkedout() == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # SQLAlchemy warns about a collected checked-out connection
        del store
        gc.collect()
    assert engine.pool.checkedout() == 0
    engine.dispose()


def test_no_parking_on_a_host_engine_nor_in_memory(tmp_path: Path) -> None:
    path = tmp_path / "host.db"
    migrate.upgrade(f"sqlite:///{path}")
    _no_parking_on_host_engine(f"sqlite:///{path}")
    memory = Store.open("sqlite://")
    try:
        memory.runs.create(RunRecord.new("R-1", "T-1", 10))
        assert memory._parked == []
    finally:
        memory.close()


def test_one_call_units_park_one_connection_on_postgres(pg_url: str) -> None:
    """psycopg: one connection parked and taken back, in the lean units' autocommit mode."""
    store = Store.open(pg_url)
    pool = store.engine.pool
    try:
        store.runs.create(RunRecord.new("R-1", "T-1", 10))
        assert len(store._parked) == 1
        first = store._parked[0][0].dbapi_connection
        assert first.autocommit is True  # parked as a lean unit leaves it
        for _ in range(3):
            store.runs.get("R-1")
            store.runs.try_transition("R-1", RunStatus.PENDING, RunStatus.PENDING)
        assert len(store._parked) == 1
        assert store._parked[0][0].dbapi_connection is first
        assert pool.checkedout() == 1
    finally:
        store.close()
    assert store._parked == []
    assert pool.checkedout() == 0


def test_a_parked_postgres_connection_goes_back_to_the_pool_out_of_autocommit(
    pg_url: str,
) -> None:
    """Released (a lost connection elsewhere, close, GC), the parked connection is switched
    back before the pool hands it out: a ``store.write()`` unit on it is one transaction,
    so a block that raises writes nothing."""
    store = Store.open(pg_url)
    try:
        store.runs.create(RunRecord.new("R-1", "T-1", 10))
        parked = store._parked[0][0].dbapi_connection
        _release_parked(store._parked)
        assert store._parked == []
        assert store.engine.pool.checkedout() == 0
        assert parked.autocommit is False
        with pytest.raises(RuntimeError, match="abandon"):
            with store.write() as uow:
                assert uow.driver.raw is parked  # the pool's only idle connection
                uow.runs.create(RunRecord.new("R-2", "T-1", 10))
                raise RuntimeError("abandon the unit")
        with pytest.raises(RunNotFound):
            store.runs.get("R-2")
    finally:
        store.close()


def test_a_parked_postgres_connection_holds_no_snapshot_nor_lock(pg_url: str) -> None:
    """While parked it is idle on the server: another connection's commit is seen by the
    next one-call read, and another connection takes the run's row lock at once."""
    store = Store.open(pg_url)
    url = pg_url.replace("postgresql+psycopg://", "postgresql://")
    try:
        store.runs.create(RunRecord.new("R-1", "T-1", 10))
        pid = store._parked[0][0].dbapi_connection.info.backend_pid
        with psycopg.connect(url, autocommit=True) as other:
            state = other.execute(
                "SELECT state, backend_xmin FROM pg_stat_activity WHERE pid = %s", (pid,)
            ).fetchone()
            assert state == ("idle", None)
            with other.transaction():
                other.execute("SET LOCAL lock_timeout = '2s'")
                other.execute("SELECT 1 FROM runs WHERE id = 'R-1' FOR UPDATE")
                other.execute("UPDATE runs SET task_id = 'T-2' WHERE id = 'R-1'")
        assert store.runs.get("R-1").task_id == "T-2"
    finally:
        store.close()


def test_no_parking_on_a_host_postgres_engine(pg_url: str) -> None:
    _no_parking_on_host_engine(pg_url)


def _no_parking_on_host_engine(url: str) -> None:
    """One-call units on a store over a host's engine return every connection to its pool."""
    engine = create_engine(url)
    try:
        store = Store.open(engine)
        store.runs.create(RunRecord.new("R-1", "T-1", 10))
        store.runs.get("R-1")
        assert store._parked == []
        assert engine.pool.checkedout() == 0
    finally:
        engine.dispose()


def test_a_pool_of_one_never_parks_its_connection(db_url: str) -> None:
    """A parked connection stays checked out: with one connection in the pool, a
    ``store.write()`` unit after a one-call unit would wait for it until ``pool_timeout``."""
    store = Store.open(db_url, pool_size=1, max_overflow=0, pool_timeout=5)
    try:
        store.runs.create(RunRecord.new("R-1", "T-1", 10))
        assert store._parked == []
        with store.write() as uow:
            assert uow.runs.get("R-1").id == "R-1"
    finally:
        store.close()


def test_a_unit_waiting_for_the_pool_gets_the_connection_a_one_call_unit_ends_with(
    db_url: str,
) -> None:
    """Pool of two: a ``store.read()`` block holds one connection and runs a one-call read,
    which waits in the pool while another thread's one-call unit holds the other. That unit
    ends at the pool's limit, so its connection goes back to the pool (parked, it would
    never reach the waiting read, which would fail after ``pool_timeout``)."""
    store = Store.open(db_url, pool_size=2, max_overflow=0, pool_timeout=20)
    store.runs.create(RunRecord.new("R-1", "T-1", 10))
    holding, reading = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def one_call_holder() -> None:
        try:

            def hold(_repos: Any) -> None:
                holding.set()
                assert reading.wait(20)
                time.sleep(0.3)  # the read is waiting in the pool by now (or soon: same outcome)

            store.call_write(hold)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    try:
        with store.read() as uow:
            uow.runs.get("R-1")  # this unit's connection is checked out
            holder = threading.Thread(target=one_call_holder)
            holder.start()
            assert holding.wait(20)
            reading.set()
            started = time.monotonic()
            assert store.runs.get("R-1").id == "R-1"  # a one-call read: the second connection
            assert time.monotonic() - started < 15, "waited for the pool's timeout"
        holder.join(20)
        assert not errors, errors
    finally:
        store.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_a_forked_child_never_uses_nor_ends_the_parents_parked_connection(db_url: str) -> None:
    """A store that parked a connection, then a fork (a server's workers forked after the
    app started): the child's units open their own connections, and the child closing
    what it inherited does not end the parent's session (Postgres: libpq's Terminate
    goes to /dev/null, not on the socket shared with the parent). The parent goes on on
    the same parked connection."""
    store = Store.open(db_url)
    try:
        store.runs.create(RunRecord.new("R-1", "T-1", 10))
        ((parked, _driver),) = store._parked
        read, write = os.pipe()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads (3.12+)
            pid = os.fork()
        if pid == 0:  # the child: report, then leave without any cleanup of pytest's
            answer = b"?"
            try:
                inherited_parked = any(p is parked for p, _ in store._parked)
                got = store.runs.get("R-1")
                reused = any(p is parked for p, _ in store._parked)
                # What the child's exit may do to what it inherited: close it (libpq's
                # PQfinish sends Terminate on the socket it shares with the parent).
                for inherited, driver in store_module._INHERITED:
                    if driver.postgres:
                        inherited.dbapi_connection.close()
                ok = not inherited_parked and not reused and got.id == "R-1"
                answer = b"ok" if ok else b"used the parent's connection"
            except BaseException as exc:  # noqa: BLE001 - reported to the parent
                answer = repr(exc).encode()[:300]
            finally:
                os.write(write, answer)
                os._exit(0)
        os.close(write)
        with os.fdopen(read, "rb") as pipe:
            answer = pipe.read()
        os.waitpid(pid, 0)
        assert answer == b"ok", answer
        for _ in range(3):  # still alive: a lost connection would be replaced, not parked again
            assert store.runs.get("R-1").id == "R-1"
            assert store._parked[0][0] is parked
    finally:
        store.close()


def test_the_pool_limit_holds_after_the_engine_is_disposed(db_url: str) -> None:
    """``engine.dispose()`` (a forked child's ``dispose(close=False)``, a host resetting its
    connections, ``close`` then reuse) gives the engine a new pool: a one-call unit ending
    at that pool's limit still goes back to it (counted on the old pool, it parked, and a
    ``store.write()`` block needing a second connection waited for ``pool_timeout``)."""
    store = Store.open(db_url, pool_size=2, max_overflow=0, pool_timeout=5)
    try:
        store.runs.create(RunRecord.new("R-1", "T-1", 10))
        store.engine.dispose()
        _release_parked(store._parked)
        with store.write() as uow:
            assert uow.runs.get("R-1").id == "R-1"
            assert store.runs.get("R-1").id == "R-1"  # the new pool's second, last connection
            assert store._parked == []
            assert store.engine.pool.checkedout() == 1
    finally:
        store.close()


@pytest.mark.parametrize(
    "pool_option", [{"pool_recycle": 1}, {"pool_pre_ping": True}], ids=["recycle", "pre_ping"]
)
def test_no_parking_when_the_pool_recycles_or_pre_pings(
    db_url: str, pool_option: dict[str, Any]
) -> None:
    """``pool_recycle`` and ``pool_pre_ping`` act when a connection is checked out of the
    pool: a parked connection is never checked out again, so parking would keep a
    connection past its recycle age, unpinged (the idle connection a proxy or firewall
    dropped silently, which those options are there to replace)."""
    store = Store.open(db_url, **pool_option)
    try:
        store.runs.create(RunRecord.new("R-1", "T-1", 10))
        first = store.runs.get("R-1")
        assert first.id == "R-1"
        assert store._parked == []
        assert store.engine.pool.checkedout() == 0
    finally:
        store.close()


def test_two_concurrent_one_call_units_both_park_and_a_third_goes_back(db_url: str) -> None:
    """Up to ``_PARKED_MAX`` (two) connections stay parked: units that ran at once (a
    LangGraph saver's put and put_writes) both find one next time; one more goes back
    to the pool."""
    store = Store.open(db_url)
    pool = store.engine.pool
    try:
        store.runs.create(RunRecord.new("R-1", "T-1", 10))
        assert len(store._parked) == 1
        seen: list[Any] = []

        def nested(depth: int) -> Any:
            def read(r: Any) -> Any:
                seen.append(r.runs._db.raw)  # the unit's connection, held while nested runs
                if depth > 1:
                    nested(depth - 1)
                return r.runs.get("R-1")

            return store.call_read(read)

        nested(3)  # three units at once: three connections
        assert len({id(c) for c in seen}) == 3
        assert len(store._parked) == store_module._PARKED_MAX == 2
        assert pool.checkedout() == 2  # the third went back to the pool
        parked = {id(p.dbapi_connection) for p, _ in store._parked}
        nested(2)  # two at once: both take a parked connection, no checkout
        assert {id(p.dbapi_connection) for p, _ in store._parked} == parked
        assert pool.checkedout() == 2
    finally:
        store.close()
    assert store._parked == []
    assert pool.checkedout() == 0
