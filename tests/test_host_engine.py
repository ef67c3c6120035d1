"""``Store.open(engine)``: agentkeep on the host application's own SQLAlchemy Engine.

The host builds its engine with plain ``sqlalchemy.create_engine`` (see
:mod:`tests.host_app`). Backend-dependent tests run on SQLite and Postgres;
SQLite-only ones are named ``test_sqlite_*``, Postgres-only ones ``test_postgres_*``.

* the engine is accepted, the schema is checked (``SchemaBehind``) or
  migrated, the statements are compiled for the engine's own paramstyle, and
  closing the store never disposes the host's engine;
* ``Store(engine)`` does the same checks and configuration (it used to skip
  them silently);
* SQLite: every connection of the engine gets the busy timeout and foreign
  keys (and ``synchronous`` when asked), the file is put in WAL, agentkeep's
  write units begin IMMEDIATE, and the host's own transactions keep pysqlite's
  deferred behaviour: a transaction that has only read holds no lock;
* the host's own ORM work on that engine (insert, commit, rollback,
  savepoint, ``engine.begin()``) behaves as without agentkeep;
* Postgres: the engine is used as is; an autocommit engine is refused; write
  units of an engine whose default isolation is not READ COMMITTED still run
  READ COMMITTED, while the host's connections keep their level;
* refusals say what to change and change nothing.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, insert, make_url, select, text
from sqlalchemy.orm import Session

from agentkeep import migrations as migrate
from agentkeep.clock import SettableClock
from agentkeep.db import LockNamespace, lock_aggregate
from agentkeep.errors import InvalidInput, RunNotFound, SchemaBehind
from agentkeep.runs.domain import RunRecord, RunStatus
from agentkeep.store import Store
from tests.host_app import HostNote, HostTag, host_tables, notes

HEAD = migrate.head_revisions()
T0 = 1_700_000_000_000


@pytest.fixture
def host_url(db_url: str) -> Iterator[str]:
    """A migrated database of the backend with the host's tables."""
    with host_tables(db_url) as url:
        yield url


@pytest.fixture
def host_engine(host_url: str) -> Iterator[Engine]:
    """The host's engine: ``sqlalchemy.create_engine`` with its defaults."""
    engine = create_engine(host_url)
    yield engine
    engine.dispose()


def outsider_can_write(path: str) -> bool:
    """SQLite: can another connection take the write lock right now?"""
    con = sqlite3.connect(path, timeout=0.05, isolation_level=None)
    try:
        con.execute("BEGIN IMMEDIATE")
    except sqlite3.OperationalError as exc:
        assert "database is locked" in str(exc)
        return False
    finally:
        if con.in_transaction:
            con.execute("ROLLBACK")
        con.close()
    return True


def sqlite_path(engine: Engine) -> str:
    return str(make_url(engine.url).database)


def pragmas(conn: Any) -> dict[str, Any]:
    return {
        p: conn.exec_driver_sql(f"PRAGMA {p}").scalar()
        for p in ("foreign_keys", "busy_timeout", "synchronous", "journal_mode")
    }


# ---------------------------------------------------------------- accepted, checked, compiled


def test_store_open_accepts_the_host_engine(host_engine: Engine) -> None:
    store = Store.open(host_engine, clock=SettableClock(T0))
    try:
        assert store.engine is host_engine
        # the statements are compiled for the engine's own paramstyle (qmark on pysqlite)
        assert store.compile_target.paramstyle == host_engine.dialect.paramstyle
        store.runs.create(RunRecord.new("R-1", "T-1", 10))
        assert store.runs.try_transition("R-1", RunStatus.PENDING, RunStatus.RUNNING)
        assert not store.runs.try_transition("R-1", RunStatus.PENDING, RunStatus.RUNNING)
        with store.write() as uow:
            uow.runs.update_status("R-1", RunStatus.DONE)
            uow.runs.create(RunRecord.new("R-2", "T-1", 20))
            uow.session.add(HostNote(id=1, run_id="R-2", note="launched"))
        with store.read() as uow:
            assert uow.runs.get("R-1").status is RunStatus.DONE
            assert uow.runs.get("R-2").status is RunStatus.PENDING
        assert notes(str(host_engine.url.render_as_string(hide_password=False))) == {
            1: ("R-2", "launched")
        }
        pool = host_engine.pool
    finally:
        store.close()
    # closing the store leaves the host's engine alone: same pool, still usable
    assert host_engine.pool is pool
    with host_engine.connect() as conn:
        assert conn.execute(text("SELECT 1")).scalar() == 1


def test_store_open_on_a_host_engine_checks_the_schema(fresh_url: str, backend: str) -> None:
    engine = create_engine(fresh_url)
    try:
        with pytest.raises(SchemaBehind):
            Store.open(engine)
        assert migrate.current(fresh_url) == ()
        with Store.open(engine, migrate=True) as store:
            assert migrate.current(engine) == HEAD
            store.runs.create(RunRecord.new("R-1", "T-1", 10))
        if backend == "sqlite":
            with engine.connect() as conn:
                assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        with Store.open(engine) as store:  # at head now: opens without migrate
            assert store.runs.get("R-1").task_id == "T-1"
    finally:
        engine.dispose()


def test_store_constructor_on_a_plain_engine_checks_and_configures_it(
    fresh_url: str, backend: str
) -> None:
    """``Store(engine)`` used to skip the schema check, WAL, busy timeout, FKs and IMMEDIATE."""
    engine = create_engine(fresh_url)
    try:
        with pytest.raises(SchemaBehind):
            Store(engine)
        migrate.upgrade(fresh_url)
        with Store(engine, clock=SettableClock(T0)) as store:
            store.runs.create(RunRecord.new("R-1", "T-1", 10))
            if backend == "sqlite":
                path = sqlite_path(engine)
                with store.write() as uow:
                    got = pragmas(uow.connection)
                    assert not outsider_can_write(path)  # BEGIN IMMEDIATE
                assert got["foreign_keys"] == 1
                assert got["busy_timeout"] == 30_000
                assert got["journal_mode"] == "wal"
    finally:
        engine.dispose()


# ---------------------------------------------------------------- SQLite connection settings


def test_sqlite_host_engine_connections_get_the_settings(tmp_path: Path) -> None:
    """SQLite only: busy timeout and foreign keys on every connection; synchronous untouched.

    A connection the host pooled before ``Store.open`` gets them as well.
    """
    url = f"sqlite:///{tmp_path / 'host.db'}"
    migrate.upgrade(url)
    engine = create_engine(url)
    try:
        with engine.connect() as conn:  # pooled before the store opens
            before = pragmas(conn)
        assert before["foreign_keys"] == 0
        with Store.open(engine):
            with engine.connect() as conn:
                got = pragmas(conn)
            assert got["foreign_keys"] == 1
            assert got["busy_timeout"] == 30_000
            assert got["synchronous"] == before["synchronous"] == 2  # SQLite's FULL, untouched
            assert got["journal_mode"] == "wal"
    finally:
        engine.dispose()

    engine = create_engine(url)
    try:
        with Store.open(engine, busy_timeout_ms=1234, synchronous="NORMAL"):
            with engine.connect() as conn:
                got = pragmas(conn)
            assert (got["busy_timeout"], got["synchronous"]) == (1234, 1)
    finally:
        engine.dispose()


def test_sqlite_host_engine_write_units_begin_immediate_host_transactions_stay_deferred(
    tmp_path: Path,
) -> None:
    """SQLite only: agentkeep's write units take the lock at their start; the host's do not.

    The host's transactions behave as pysqlite makes them: a transaction that
    has only read takes no write lock; its first write does.
    """
    url = f"sqlite:///{tmp_path / 'host.db'}"
    migrate.upgrade(url)
    with host_tables(url):
        engine = create_engine(url)
        path = sqlite_path(engine)
        try:
            with Store.open(engine, clock=SettableClock(T0)) as store:
                store.runs.create(RunRecord.new("R-1", "T-1", 10))
                with store.write():
                    assert not outsider_can_write(path)
                assert outsider_can_write(path)
                assert store.call_write(lambda r: outsider_can_write(path)) is False
                with store.read():
                    assert outsider_can_write(path)

                with Session(engine) as session:
                    assert session.get(HostNote, 1) is None
                    assert outsider_can_write(path)  # a reading host holds no lock
                    session.add(HostNote(id=1, run_id="R-1", note="x"))
                    session.flush()
                    assert not outsider_can_write(path)  # its first write takes it
                    session.commit()
                assert outsider_can_write(path)
        finally:
            engine.dispose()


# ---------------------------------------------------------------- the host's own ORM work


def test_host_orm_work_on_the_engine_behaves_as_before(host_engine: Engine, host_url: str) -> None:
    """Insert, commit, rollback, savepoint and ``engine.begin()`` of the host, next to agentkeep."""
    with Store.open(host_engine, clock=SettableClock(T0)) as store:
        store.runs.create(RunRecord.new("R-1", "T-1", 10))

        with Session(host_engine) as session:  # insert + commit
            session.add_all([HostNote(id=1, run_id="R-1", note="kept"), HostTag(name="a")])
            session.commit()
        with Session(host_engine) as session:  # rollback
            session.add(HostNote(id=2, run_id="R-1", note="rolled back"))
            session.flush()
            session.rollback()
        with Session(host_engine) as session:  # savepoint
            session.add(HostNote(id=3, run_id="R-1", note="outer"))
            nested = session.begin_nested()
            session.add(HostNote(id=4, run_id="R-1", note="inner, rolled back"))
            session.flush()
            nested.rollback()
            with session.begin_nested():
                session.add(HostNote(id=5, run_id="R-1", note="inner, released"))
            session.commit()
        with host_engine.begin() as conn:  # a plain engine.begin() block
            conn.execute(insert(HostNote).values(id=6, run_id="R-1", note="core"))
        with pytest.raises(ZeroDivisionError):
            with host_engine.begin() as conn:
                conn.execute(insert(HostNote).values(id=7, run_id="R-1", note="core, failed"))
                raise ZeroDivisionError

        assert sorted(notes(host_url)) == [1, 3, 5, 6]
        with Session(host_engine) as session:
            assert session.scalars(select(HostTag.name)).all() == ["a"]
        # agentkeep's units still work on the engine afterwards
        assert store.runs.try_transition("R-1", RunStatus.PENDING, RunStatus.RUNNING)
        with pytest.raises(RunNotFound):
            store.runs.get("R-2")


# ---------------------------------------------------------------- Postgres: used as is


def test_postgres_host_engine_not_read_committed_write_units_still_are(
    host_url: str, backend: str
) -> None:
    """Postgres only: a REPEATABLE READ engine; agentkeep's writes run READ COMMITTED anyway."""
    if backend != "postgres":
        pytest.skip("Postgres only: isolation levels")
    engine = create_engine(host_url, isolation_level="REPEATABLE READ")
    show = "SHOW transaction_isolation"
    try:
        with Store.open(engine, clock=SettableClock(T0)) as store:
            with store.write() as uow:
                assert uow.connection.exec_driver_sql(show).scalar() == "read committed"

            def lean_level(r: Any) -> str:
                lock_aggregate(r.driver, LockNamespace.RUN, "R-x")  # the unit's first statement
                return str(r.driver.raw.execute(show).fetchone()[0])

            assert store.call_write(lean_level) == "read committed"
            with store.read() as uow:
                assert uow.connection.exec_driver_sql(show).scalar() == "repeatable read"
            with engine.connect() as conn:  # the host's connections keep their level
                assert conn.exec_driver_sql(show).scalar() == "repeatable read"
            store.runs.create(RunRecord.new("R-1", "T-1", 10))
            assert store.runs.acquire_assignee("R-1", "s", "op", "d")[0] == 1
    finally:
        engine.dispose()


def test_postgres_host_connections_come_back_from_agentkeep_as_they_went(
    host_url: str, backend: str
) -> None:
    """Postgres only: one-call units run in the driver's autocommit mode until they
    begin; the host's pooled connection comes back in transaction mode, after reads,
    writes, refused writes and failures alike."""
    if backend != "postgres":
        pytest.skip("Postgres only: the driver's autocommit mode")
    engine = create_engine(host_url, pool_size=1, max_overflow=0)
    try:
        with Store.open(engine, clock=SettableClock(T0)) as store:
            store.runs.create(RunRecord.new("R-1", "T-1", 10))
            assert store.runs.get("R-1").status == RunStatus.PENDING
            assert store.runs.try_transition("R-1", RunStatus.PENDING, RunStatus.RUNNING)
            assert not store.runs.try_transition("R-1", RunStatus.PENDING, RunStatus.RUNNING)
            with pytest.raises(RunNotFound):
                store.runs.get("R-2")
            with pytest.raises(RunNotFound):
                store.runs.update_status("R-2", RunStatus.RUNNING)
            with engine.connect() as conn:
                raw = conn.connection.dbapi_connection
                assert raw is not None and raw.autocommit is False
                # the host's own work is transactional as before
                conn.execute(insert(HostNote).values(id=1, run_id="R-1", note="not committed"))
                conn.rollback()
                assert conn.execute(select(HostNote)).all() == []
    finally:
        engine.dispose()


@pytest.mark.parametrize("where", ["create_engine", "execution_options"])
def test_postgres_autocommit_engine_is_refused(host_url: str, backend: str, where: str) -> None:
    """Postgres only: an AUTOCOMMIT engine cannot hold a fenced transaction."""
    if backend != "postgres":
        pytest.skip("Postgres only: autocommit isolation")
    if where == "create_engine":
        base = engine = create_engine(host_url, isolation_level="AUTOCOMMIT")
    else:
        base = create_engine(host_url)
        engine = base.execution_options(isolation_level="AUTOCOMMIT")
    try:
        with pytest.raises(InvalidInput) as info:
            Store.open(engine)
        assert "AUTOCOMMIT" in str(info.value)
    finally:
        base.dispose()


def test_postgres_engine_settings_are_refused(host_engine: Engine, backend: str) -> None:
    """Postgres only: a host engine is used as is; its lock_timeout is the host's to set."""
    if backend != "postgres":
        pytest.skip("Postgres only")
    with pytest.raises(InvalidInput) as info:
        Store.open(host_engine, busy_timeout_ms=500)
    assert "lock_timeout" in str(info.value)
    with pytest.raises(InvalidInput):
        Store.open(host_engine, synchronous="FULL")


# ---------------------------------------------------------------- refusals and reuse


def test_store_open_with_an_engine_refuses_engine_kwargs(host_engine: Engine) -> None:
    with pytest.raises(InvalidInput) as info:
        Store.open(host_engine, pool_size=3)
    assert info.value.field == "engine_kwargs"


def test_store_open_refuses_what_is_not_an_engine(host_engine: Engine) -> None:
    with host_engine.connect() as conn:
        with pytest.raises(InvalidInput) as info:
            Store.open(conn)  # type: ignore[arg-type]
    assert "Engine" in str(info.value)


def test_two_stores_on_one_host_engine(host_engine: Engine, backend: str) -> None:
    """The engine is configured once; conflicting settings for it are refused."""
    with Store.open(host_engine) as a, Store.open(host_engine) as b:
        a.runs.create(RunRecord.new("R-1", "T-1", 10))
        with b.write() as uow:  # one BEGIN IMMEDIATE, not two
            uow.runs.update_status("R-1", RunStatus.RUNNING)
        assert a.runs.get("R-1").status is RunStatus.RUNNING
        if backend == "sqlite":
            with pytest.raises(InvalidInput) as info:
                Store.open(host_engine, busy_timeout_ms=10)
            assert info.value.field == "busy_timeout_ms"
