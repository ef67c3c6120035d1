"""``store.write(join=...)`` / ``store.read(join=...)``: units inside the host's transaction.

The host holds a transaction in its own ``Session`` or ``Connection`` on the
engine it gave ``Store.open(engine)`` (:mod:`tests.host_app`). Every test
runs on SQLite and Postgres unless named ``test_sqlite_*`` / ``test_postgres_*``.

* agentkeep's writes commit when the host commits and roll back when it rolls
  back; the unit itself never commits (after the block the host's transaction
  is still open and nothing is visible to another connection);
* a block that raises rolls back only its own work (a SAVEPOINT): what the
  host did before it, and does after it, commits with the host;
* ``uow.session`` is the host's Session, or a Session on the host's Connection;
* the fence does not weaken: SQLite holds the database write lock from the
  join until the host's transaction ends (taking it with BEGIN IMMEDIATE, or
  upgrading a deferred transaction, which fails with the typed
  ``JoinedTransactionStale`` when the host read a snapshot another writer has
  since replaced); Postgres advisory locks are held until the host's commit,
  and a host transaction that is not READ COMMITTED is refused;
* a joined read unit sees the host's uncommitted writes and refuses writes;
* refusals (not a Session/Connection, another engine, autocommit) write nothing.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Connection, Engine, create_engine, event, insert, make_url, select, text
from sqlalchemy.orm import Session, scoped_session, sessionmaker

from agentkeep import migrations as migrate
from agentkeep.clock import SettableClock
from agentkeep.errors import (
    DatabaseError,
    InvalidInput,
    JoinedTransactionStale,
    ReadOnlyUnitOfWork,
    RunDuplicate,
    RunNotFound,
    StoreBusy,
)
from agentkeep.runs.domain import RunRecord, RunStatus
from agentkeep.store import Store
from tests.host_app import HostNote, host_tables, notes

T0 = 1_700_000_000_000


class Boom(Exception):
    """Raised by a test inside a joined unit."""


@pytest.fixture
def host_url(db_url: str) -> Iterator[str]:
    with host_tables(db_url) as url:
        yield url


@pytest.fixture
def host_engine(host_url: str) -> Iterator[Engine]:
    engine = create_engine(host_url)
    yield engine
    engine.dispose()


@pytest.fixture
def hstore(host_engine: Engine) -> Iterator[Store]:
    """agentkeep on the host's engine."""
    store = Store.open(host_engine, clock=SettableClock(T0))
    yield store
    store.close()


@pytest.fixture
def observer(host_url: str) -> Iterator[Store]:
    """Another process's view: its own store on its own connections."""
    store = Store.open(host_url, clock=SettableClock(T0))
    yield store
    store.close()


def run_exists(store: Store, run_id: str) -> bool:
    try:
        store.runs.get(run_id)
    except RunNotFound:
        return False
    return True


def add_note(host: Session | Connection, note_id: int, note: str) -> None:
    """The host writes a row of its own, through its Session or its Connection."""
    if isinstance(host, Session):
        host.add(HostNote(id=note_id, run_id="R-1", note=note))
        host.flush()
    else:
        host.execute(insert(HostNote).values(id=note_id, run_id="R-1", note=note))


def host_open(engine: Engine, via: str) -> Session | Connection:
    return Session(engine) if via == "session" else engine.connect()


VIA = pytest.mark.parametrize("via", ["session", "connection"])


# ---------------------------------------------------------------- commit and rollback with the host


@VIA
def test_joined_writes_commit_when_the_host_commits(
    hstore: Store, observer: Store, host_engine: Engine, host_url: str, via: str
) -> None:
    host = host_open(host_engine, via)
    try:
        add_note(host, 1, "before")
        with hstore.write(join=host) as uow:
            if isinstance(host, Session):
                assert uow.session is host
            else:
                assert uow.session.get_bind() is host
            uow.runs.create(RunRecord.new("R-1", "T-1", 10))
            uow.runs.update_status("R-1", RunStatus.RUNNING)
            uow.session.add(HostNote(id=2, run_id="R-1", note="inside"))
        # the unit did not commit: the host's transaction is open, nothing is visible
        assert host.in_transaction()
        assert not run_exists(observer, "R-1")
        assert notes(host_url) == {}
        add_note(host, 3, "after")
        host.commit()
    finally:
        host.close()
    assert observer.runs.get("R-1").status is RunStatus.RUNNING
    assert sorted(notes(host_url)) == [1, 2, 3]


@VIA
def test_joined_writes_roll_back_when_the_host_rolls_back(
    hstore: Store, observer: Store, host_engine: Engine, host_url: str, via: str
) -> None:
    hstore.runs.create(RunRecord.new("R-1", "T-1", 10))
    host = host_open(host_engine, via)
    try:
        add_note(host, 1, "before")
        with hstore.write(join=host) as uow:
            assert uow.runs.try_transition("R-1", RunStatus.PENDING, RunStatus.RUNNING)
            uow.runs.create(RunRecord.new("R-2", "T-1", 20))
        host.rollback()
    finally:
        host.close()
    assert observer.runs.get("R-1").status is RunStatus.PENDING
    assert not run_exists(observer, "R-2")
    assert notes(host_url) == {}
    # and another writer can win the transition the rolled-back host had won
    assert observer.runs.try_transition("R-1", RunStatus.PENDING, RunStatus.RUNNING)


@VIA
@pytest.mark.parametrize("failure", ["exception", "store_error", "database_error"])
def test_a_raising_joined_block_rolls_back_only_its_own_work(
    hstore: Store, observer: Store, host_engine: Engine, host_url: str, via: str, failure: str
) -> None:
    hstore.runs.create(RunRecord.new("R-1", "T-1", 10))
    host = host_open(host_engine, via)
    expected: type[BaseException] = {
        "exception": Boom,
        "store_error": RunDuplicate,
        "database_error": DatabaseError,
    }[failure]
    try:
        add_note(host, 1, "before")
        with pytest.raises(expected):
            with hstore.write(join=host) as uow:
                uow.runs.update_status("R-1", RunStatus.RUNNING)
                uow.runs.create(RunRecord.new("R-2", "T-1", 20))
                uow.session.add(HostNote(id=2, run_id="R-1", note="inside, undone"))
                uow.session.flush()
                if failure == "exception":
                    raise Boom()
                if failure == "store_error":
                    uow.runs.create(RunRecord.new("R-1", "T-1", 10))
                uow.connection.execute(text("SELECT * FROM no_such_table"))
        # the host's transaction is intact and usable
        assert host.in_transaction()
        add_note(host, 3, "after")
        with hstore.write(join=host) as uow:  # and can join again
            uow.runs.create(RunRecord.new("R-3", "T-1", 30))
        host.commit()
    finally:
        host.close()
    assert observer.runs.get("R-1").status is RunStatus.PENDING
    assert not run_exists(observer, "R-2")
    assert run_exists(observer, "R-3")
    assert sorted(notes(host_url)) == [1, 3]


def test_a_session_rollback_inside_the_block_undoes_the_unit_only(
    hstore: Store, observer: Store, host_engine: Engine, host_url: str
) -> None:
    """``uow.session`` on a joined Connection: its rollback undoes the unit, not the host."""
    with host_engine.connect() as conn:
        add_note(conn, 1, "before")
        with hstore.write(join=conn) as uow:
            uow.runs.create(RunRecord.new("R-1", "T-1", 10))
            uow.session.add(HostNote(id=2, run_id="R-1", note="inside"))
            uow.session.flush()
            uow.session.rollback()
        conn.commit()
    assert not run_exists(observer, "R-1")
    assert sorted(notes(host_url)) == [1]


def test_join_accepts_a_scoped_session_and_begins_a_connection(
    hstore: Store, observer: Store, host_engine: Engine, host_url: str
) -> None:
    scoped = scoped_session(sessionmaker(host_engine))
    try:
        with hstore.write(join=scoped) as uow:
            uow.runs.create(RunRecord.new("R-1", "T-1", 10))
        scoped.commit()
    finally:
        scoped.remove()
    with host_engine.connect() as conn:  # no transaction begun yet: the join begins it
        assert not conn.in_transaction()
        with hstore.write(join=conn) as uow:
            uow.runs.create(RunRecord.new("R-2", "T-1", 20))
        assert conn.in_transaction()
        conn.commit()
    assert run_exists(observer, "R-1") and run_exists(observer, "R-2")


# ---------------------------------------------------------------- joined reads


@VIA
def test_a_joined_read_sees_the_host_writes_and_refuses_writes(
    hstore: Store, host_engine: Engine, via: str
) -> None:
    hstore.runs.create(RunRecord.new("R-1", "T-1", 10))
    host = host_open(host_engine, via)
    try:
        with hstore.write(join=host) as uow:
            uow.runs.update_status("R-1", RunStatus.RUNNING)
        with hstore.read(join=host) as uow:
            assert uow.runs.get("R-1").status is RunStatus.RUNNING  # uncommitted, seen
            with pytest.raises(ReadOnlyUnitOfWork):
                uow.runs.update_status("R-1", RunStatus.DONE)
        assert host.in_transaction()
        host.rollback()
    finally:
        host.close()
    assert hstore.runs.get("R-1").status is RunStatus.PENDING


# ---------------------------------------------------------------- refusals


def test_join_refuses_what_is_not_a_session_or_connection(hstore: Store) -> None:
    with pytest.raises(InvalidInput) as info:
        with hstore.write(join="session"):  # type: ignore[arg-type]
            pass
    assert info.value.field == "join"


def test_join_refuses_a_session_of_another_engine(
    hstore: Store, observer: Store, host_url: str
) -> None:
    other = create_engine(host_url)
    try:
        with Session(other) as session:
            with pytest.raises(InvalidInput) as info:
                with hstore.write(join=session) as uow:
                    uow.runs.create(RunRecord.new("R-1", "T-1", 10))
            assert "engine" in str(info.value)
    finally:
        other.dispose()
    assert not run_exists(observer, "R-1")


def test_join_refuses_an_autocommit_connection(hstore: Store, host_engine: Engine) -> None:
    with host_engine.connect() as conn:
        conn = conn.execution_options(isolation_level="AUTOCOMMIT")
        with pytest.raises(InvalidInput) as info:
            with hstore.write(join=conn) as uow:
                uow.runs.create(RunRecord.new("R-1", "T-1", 10))
        assert "AUTOCOMMIT" in str(info.value)
    assert not run_exists(hstore, "R-1")


# ---------------------------------------------------------------- SQLite: the write lock


def _outsider(path: str) -> sqlite3.Connection:
    return sqlite3.connect(path, timeout=0.05, isolation_level=None)


def _can_write(con: sqlite3.Connection) -> bool:
    try:
        con.execute("BEGIN IMMEDIATE")
    except sqlite3.OperationalError:
        return False
    con.execute("ROLLBACK")
    return True


@pytest.fixture
def sqlite_host(tmp_path: Path) -> Iterator[tuple[Engine, Store, sqlite3.Connection]]:
    """SQLite only: a migrated file, the host's engine, agentkeep on it, an outsider."""
    url = f"sqlite:///{tmp_path / 'host.db'}"
    migrate.upgrade(url)
    with host_tables(url):
        engine = create_engine(url)
        store = Store.open(engine, clock=SettableClock(T0))
        outsider = _outsider(str(make_url(url).database))
        try:
            yield engine, store, outsider
        finally:
            outsider.close()
            store.close()
            engine.dispose()


@VIA
def test_sqlite_joined_write_holds_the_write_lock_until_the_host_ends(
    sqlite_host: tuple[Engine, Store, sqlite3.Connection], via: str
) -> None:
    """SQLite only: the lock is taken at the join and held past the block until the commit."""
    engine, store, outsider = sqlite_host
    store.runs.create(RunRecord.new("R-1", "T-1", 10))
    for end in ("commit", "rollback"):
        host = host_open(engine, via)
        try:
            if isinstance(host, Session):
                assert host.scalars(select(HostNote)).all() == []  # the host has read
            assert _can_write(outsider)
            with store.write(join=host) as uow:
                assert not _can_write(outsider)
                uow.runs.get("R-1")
            assert not _can_write(outsider)  # held until the host's transaction ends
            getattr(host, end)()
            assert _can_write(outsider)
        finally:
            host.close()


def test_sqlite_join_upgrades_a_deferred_transaction_that_has_not_read(tmp_path: Path) -> None:
    """SQLite only: a host transaction begun DEFERRED at the driver is upgraded in place."""
    url = f"sqlite:///{tmp_path / 'own.db'}"
    migrate.upgrade(url)
    with Store.open(url, clock=SettableClock(T0)) as store:  # its engine begins DEFERRED
        store.runs.create(RunRecord.new("R-1", "T-1", 10))
        outsider = _outsider(str(make_url(url).database))
        try:
            with Session(store.engine) as session:
                session.connection()  # BEGIN (deferred): no lock yet
                assert _can_write(outsider)
                with store.write(join=session) as uow:
                    assert not _can_write(outsider)
                    assert uow.runs.try_transition("R-1", RunStatus.PENDING, RunStatus.RUNNING)
                session.commit()
        finally:
            outsider.close()
        assert store.runs.get("R-1").status is RunStatus.RUNNING


def test_sqlite_join_on_a_stale_deferred_snapshot_is_a_typed_error(tmp_path: Path) -> None:
    """SQLite only: never a silent stale write.

    The host's deferred transaction read (a WAL snapshot); another writer then
    committed; the join cannot upgrade it to a writer (SQLITE_BUSY_SNAPSHOT):
    ``JoinedTransactionStale`` (a ``StoreBusy``), nothing written. Rolling the
    host's transaction back and running it again succeeds.
    """
    url = f"sqlite:///{tmp_path / 'own.db'}"
    migrate.upgrade(url)
    with Store.open(url, clock=SettableClock(T0)) as store, Store.open(url) as other:
        store.runs.create(RunRecord.new("R-1", "T-1", 10))
        with Session(store.engine) as session:
            session.execute(text("SELECT count(*) FROM runs")).scalar()  # snapshot taken
            other.runs.update_status("R-1", RunStatus.FAILED)  # another writer commits
            with pytest.raises(JoinedTransactionStale) as info:
                with store.write(join=session) as uow:
                    uow.runs.update_status("R-1", RunStatus.RUNNING)
            assert isinstance(info.value, StoreBusy)
            session.rollback()
            with store.write(join=session) as uow:  # the retried transaction wins
                assert uow.runs.try_transition("R-1", RunStatus.FAILED, RunStatus.RUNNING)
            session.commit()
        assert store.runs.get("R-1").status is RunStatus.RUNNING

        # a host transaction begun IMMEDIATE holds the lock before it reads: no stale snapshot
        with Session(store.engine.execution_options(sqlite_begin="IMMEDIATE")) as session:
            session.execute(text("SELECT count(*) FROM runs")).scalar()
            with pytest.raises(StoreBusy):
                with Store.open(url, busy_timeout_ms=50, retry_attempts=1) as late:
                    late.runs.update_status("R-1", RunStatus.FAILED)
            with store.write(join=session) as uow:
                uow.runs.update_status("R-1", RunStatus.DONE)
            session.commit()
        assert store.runs.get("R-1").status is RunStatus.DONE


@VIA
def test_sqlite_joined_read_is_one_snapshot_and_leaves_the_host_as_it_was(
    sqlite_host: tuple[Engine, Store, sqlite3.Connection], via: str
) -> None:
    """SQLite only: a host that has not written keeps a connection pysqlite has not begun.

    Rows the block adds through ``uow.session`` stay in the host's transaction.
    """
    engine, store, outsider = sqlite_host
    store.runs.create(RunRecord.new("R-1", "T-1", 10))
    host = host_open(engine, via)
    try:
        with store.read(join=host) as uow:
            assert uow.runs.get("R-1").status is RunStatus.PENDING
            outsider.execute("UPDATE runs SET updated_at = 99")  # a writer commits meanwhile
            assert uow.runs.get("R-1").updated_at != 99  # one snapshot
        sa_conn = host.connection() if isinstance(host, Session) else host
        raw: Any = sa_conn.connection.driver_connection
        assert not raw.in_transaction  # as before the read
        add_note(host, 1, "written after the read")  # no stale-snapshot error
        host.commit()
        with store.read(join=host) as uow:
            uow.runs.get("R-1")
            uow.session.add(HostNote(id=2, run_id="R-1", note="added in a read unit"))
        assert raw.in_transaction  # left open for the host
        host.rollback()
    finally:
        host.close()
    assert sorted(notes(str(engine.url))) == [1]


def test_sqlite_host_engine_with_the_sqlalchemy_begin_recipe(tmp_path: Path) -> None:
    """SQLite only: a host engine that already emits its own ``BEGIN`` (SQLAlchemy's recipe).

    agentkeep's write units still hold the write lock from their start, and a
    join on a fresh host transaction takes it.
    """
    url = f"sqlite:///{tmp_path / 'recipe.db'}"
    migrate.upgrade(url)
    engine = create_engine(url)

    @event.listens_for(engine, "connect")
    def _connect(dbapi_conn: Any, _rec: Any) -> None:
        dbapi_conn.isolation_level = None

    @event.listens_for(engine, "begin")
    def _begin(conn: Connection) -> None:
        conn.exec_driver_sql("BEGIN")

    outsider = _outsider(str(make_url(url).database))
    try:
        with Store.open(engine, clock=SettableClock(T0)) as store:
            store.runs.create(RunRecord.new("R-1", "T-1", 10))
            with store.write() as uow:
                assert not _can_write(outsider)
                uow.runs.update_status("R-1", RunStatus.RUNNING)
            with Session(engine) as session:
                session.connection()
                assert _can_write(outsider)  # the host's own BEGIN is deferred
                with store.write(join=session) as uow:
                    assert not _can_write(outsider)
                    uow.runs.update_status("R-1", RunStatus.DONE)
                session.commit()
            assert store.runs.get("R-1").status is RunStatus.DONE
    finally:
        outsider.close()
        engine.dispose()


# -------------------------------------------------------- Postgres: advisory locks, isolation


def test_postgres_joined_advisory_lock_is_held_until_the_host_commits(
    hstore: Store, host_engine: Engine, host_url: str, backend: str
) -> None:
    """Postgres only: a writer of the same run waits for the host's commit, then sees it."""
    if backend != "postgres":
        pytest.skip("Postgres only: advisory locks")
    hstore.runs.create(RunRecord.new("R-1", "T-1", 10))
    hstore.runs.create(RunRecord.new("R-2", "T-1", 10))
    impatient = Store.open(host_url, busy_timeout_ms=300, retry_attempts=1)
    patient = Store.open(host_url, busy_timeout_ms=20_000, retry_attempts=1)
    try:
        with Session(host_engine) as session:
            with hstore.write(join=session) as uow:
                assert uow.runs.try_transition("R-1", RunStatus.PENDING, RunStatus.RUNNING)
            with pytest.raises(StoreBusy):  # the lock outlives the block
                impatient.runs.try_transition("R-1", RunStatus.PENDING, RunStatus.FAILED)
            assert impatient.runs.try_transition("R-2", RunStatus.PENDING, RunStatus.RUNNING)
            result: dict[str, Any] = {}
            waiter = threading.Thread(
                target=lambda: result.update(
                    won=patient.runs.try_transition("R-1", RunStatus.PENDING, RunStatus.FAILED)
                )
            )
            waiter.start()
            waiter.join(0.5)
            assert waiter.is_alive()  # waiting on the advisory lock
            session.commit()
            waiter.join(20)
        assert result == {"won": False}  # it saw the host's committed transition
        assert hstore.runs.get("R-1").status is RunStatus.RUNNING
    finally:
        impatient.close()
        patient.close()


@pytest.mark.parametrize("level", ["REPEATABLE READ", "SERIALIZABLE"])
def test_postgres_join_refuses_a_host_transaction_that_is_not_read_committed(
    hstore: Store, observer: Store, host_engine: Engine, backend: str, level: str
) -> None:
    """Postgres only: a snapshot older than the lock would let a write act on stale reads."""
    if backend != "postgres":
        pytest.skip("Postgres only: isolation levels")
    hstore.runs.create(RunRecord.new("R-1", "T-1", 10))
    with Session(host_engine.execution_options(isolation_level=level)) as session:
        add_note(session, 1, "host")
        with pytest.raises(InvalidInput) as info:
            with hstore.write(join=session) as uow:
                uow.runs.update_status("R-1", RunStatus.RUNNING)
        assert "READ COMMITTED" in str(info.value)
        with hstore.read(join=session) as uow:  # reads are fine at any level
            assert uow.runs.get("R-1").status is RunStatus.PENDING
        session.commit()
    assert observer.runs.get("R-1").status is RunStatus.PENDING
