"""The db/store layer (``agentkeep.db``, ``agentkeep.store``): engines, units, locks, retry.

Backend-dependent tests run on SQLite and Postgres (``backend``/``db_url``/``store``
fixtures). SQLite-only tests are named ``test_sqlite_*`` and say so in their
docstring; the Postgres-only aggregate-lock test is ``test_postgres_*``.
Pure-function tests (``is_transient``, ``retry_transient``,
``create_engine`` refusals) need no database.
"""

from __future__ import annotations

import sqlite3
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import column, create_engine, event, inspect, make_url, select, table, text
from sqlalchemy import exc as sa_exc

from agentkeep import db
from agentkeep import migrations as migrate
from agentkeep.clock import SettableClock
from agentkeep.db import LockNamespace
from agentkeep.errors import DatabaseError, InvalidInput, RunNotFound, StoreBusy
from agentkeep.runs.domain import RunRecord, RunStatus
from agentkeep.statements import Statement
from agentkeep.store import Store
from agentkeep.unit_of_work import Repositories

HEAD = migrate.head_revisions()
#: A statement on a table no database has: running it on the driver raises a driver error.
NO_SUCH_TABLE = Statement(
    select(table("no_such_table", column("x")).c.x), name="test.no_such_table"
)


class Boom(Exception):
    """Raised by a test inside a unit of work or savepoint."""


def ids(store: Store) -> list[str]:
    """Every run id, ordered, read with raw SQL in a read unit."""
    with store.read() as uow:
        return [r[0] for r in uow.connection.execute(text("SELECT id FROM runs ORDER BY id"))]


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    """A migrated SQLite file (WAL) for the SQLite-only tests."""
    url = f"sqlite:///{tmp_path / 'agentkeep.db'}"
    migrate.upgrade(url)
    return url


def sqlite_file(url: str) -> str:
    return str(make_url(url).database)


# ---------------------------------------------------------------- in-memory store


def test_sqlite_memory_store_is_migrated_and_serialises_threads() -> None:
    """SQLite only: ``Store.open("sqlite://")`` is migrated and its units are serialised.

    Eight threads share the one in-memory connection; each acquires a slot of
    the same run repeatedly. Generations must be exactly 1..N with no error.
    """
    threads, rounds = 8, 20
    with Store.open("sqlite://", clock=SettableClock(1_700_000_000_000)) as store:
        assert migrate.current(store.engine) == HEAD
        store.runs.create(RunRecord.new("R-1", "T-1", 10))
        assert store.runs.get("R-1").next_generation == 0

        barrier = threading.Barrier(threads)
        gens: list[int] = []
        errors: list[BaseException] = []
        lock = threading.Lock()

        def worker(n: int) -> None:
            try:
                barrier.wait(timeout=10)
                for i in range(rounds):
                    gen, _ = store.runs.acquire_assignee("R-1", f"slot-{n % 3}", f"S-{n}", f"w{i}")
                    with lock:
                        gens.append(gen)
            except BaseException as exc:  # noqa: BLE001 - reported below
                with lock:
                    errors.append(exc)

        workers = [threading.Thread(target=worker, args=(n,)) for n in range(threads)]
        for t in workers:
            t.start()
        for t in workers:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in workers)

        assert errors == []
        total = threads * rounds
        assert sorted(gens) == list(range(1, total + 1))
        record = store.runs.get("R-1")
        assert record.next_generation == total
        assert {a.gen for a in record.current.values()} <= set(range(1, total + 1))


# ---------------------------------------------------------------- savepoint


@pytest.mark.parametrize("failure", ["exception", "sqlalchemy_error", "driver_error"])
def test_savepoint_rolls_back_only_its_block(store: Store, failure: str) -> None:
    with store.write() as uow:
        uow.runs.create(RunRecord.new("R-1", "T-1", 10))
        with pytest.raises((Boom, sa_exc.DBAPIError, DatabaseError)):
            with db.savepoint(uow.connection):
                uow.runs.create(RunRecord.new("R-2", "T-1", 20))
                uow.runs.update_status("R-1", RunStatus.FAILED)
                if failure == "exception":
                    raise Boom()
                if failure == "sqlalchemy_error":
                    uow.connection.execute(text("SELECT * FROM no_such_table"))
                else:
                    uow.driver.execute(NO_SUCH_TABLE, {})
        # the unit is usable after the rollback to the savepoint
        assert uow.runs.get("R-1").status is RunStatus.PENDING
        with pytest.raises(RunNotFound):
            uow.runs.get("R-2")
        uow.runs.create(RunRecord.new("R-3", "T-1", 30))
        with db.savepoint(uow.connection):  # a block that succeeds is kept
            uow.runs.create(RunRecord.new("R-4", "T-1", 40))

    assert ids(store) == ["R-1", "R-3", "R-4"]
    assert store.runs.get("R-1").status is RunStatus.PENDING


# ---------------------------------------------------------------- retry_transient


def counting(outcomes: list[BaseException | str]) -> tuple[Callable[[], str], list[int]]:
    """A function that raises / returns ``outcomes`` in order, and its call counter."""
    calls = [0]

    def fn() -> str:
        outcome = outcomes[min(calls[0], len(outcomes) - 1)]
        calls[0] += 1
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    return fn, calls


def sa_wrapped(orig: BaseException) -> sa_exc.OperationalError:
    return sa_exc.OperationalError("SELECT 1", {}, orig)


class FakePgError(Exception):
    """Stands in for a psycopg error: only ``sqlstate`` matters to the classifier."""

    def __init__(self, sqlstate: str) -> None:
        super().__init__(f"fake error {sqlstate}")
        self.sqlstate = sqlstate


def test_retry_transient_retries_busy_until_success() -> None:
    fn, calls = counting([StoreBusy("busy"), StoreBusy("busy"), "value"])
    assert db.retry_transient(fn, attempts=5, base_delay_s=0.001) == "value"
    assert calls[0] == 3


def test_retry_transient_retries_wrapped_driver_busy() -> None:
    fn, calls = counting([sa_wrapped(sqlite3.OperationalError("database is locked")), "value"])
    assert db.retry_transient(fn, attempts=3, base_delay_s=0.001) == "value"
    assert calls[0] == 2


@pytest.mark.parametrize(
    "error",
    [
        DatabaseError("postgres: syntax error"),
        ValueError("bad"),
        sa_wrapped(FakePgError("23505")),
    ],
    ids=["DatabaseError", "ValueError", "sa_unique_violation"],
)
def test_retry_transient_does_not_retry_other_errors(error: BaseException) -> None:
    fn, calls = counting([error, "value"])
    expected: type[BaseException] = ValueError if isinstance(error, ValueError) else DatabaseError
    with pytest.raises(expected) as info:
        db.retry_transient(fn, attempts=5, base_delay_s=0.001)
    assert calls[0] == 1
    assert not isinstance(info.value, StoreBusy)
    assert not isinstance(info.value, sa_exc.SQLAlchemyError)


@pytest.mark.parametrize(
    "error",
    [StoreBusy("busy"), sa_wrapped(FakePgError("40001"))],
    ids=["StoreBusy", "sa_serialization_failure"],
)
def test_retry_transient_gives_up_with_store_busy(error: BaseException) -> None:
    fn, calls = counting([error])
    with pytest.raises(StoreBusy):
        db.retry_transient(fn, attempts=4, base_delay_s=0.001)
    assert calls[0] == 4


# ---------------------------------------------------------------- is_transient


@pytest.mark.parametrize(
    ("error", "transient"),
    [
        (sqlite3.OperationalError("database is locked"), True),
        (sa_wrapped(sqlite3.OperationalError("database is locked")), True),
        (sqlite3.OperationalError("database table is locked"), True),
        (StoreBusy("busy"), True),
        (sa_wrapped(FakePgError("40001")), True),
        (sa_wrapped(FakePgError("40P01")), True),
        (sa_wrapped(FakePgError("55P03")), True),
        (FakePgError("40001"), True),
        (sa_wrapped(FakePgError("23505")), False),
        (FakePgError("23505"), False),
        (sqlite3.OperationalError("no such table: runs"), False),
        (sa_wrapped(sqlite3.OperationalError("no such table: runs")), False),
        (sa_wrapped(Exception("generic")), False),
        (DatabaseError("sqlite: disk I/O error"), False),
        (ValueError("bad"), False),
    ],
)
def test_is_transient_classification(error: BaseException, transient: bool) -> None:
    assert db.is_transient(error) is transient


def test_sqlite_is_transient_on_a_real_busy_error(tmp_path: Path) -> None:
    """SQLite only: the driver's own ``SQLITE_BUSY`` is transient."""
    path = tmp_path / "busy.db"
    holder = sqlite3.connect(path, isolation_level=None)
    contender = sqlite3.connect(path, timeout=0, isolation_level=None)
    try:
        holder.execute("BEGIN IMMEDIATE")
        with pytest.raises(sqlite3.OperationalError) as info:
            contender.execute("BEGIN IMMEDIATE")
        assert db.is_transient(info.value)
        assert isinstance(db.translate_db_error(sa_wrapped(info.value)), StoreBusy)
    finally:
        holder.close()
        contender.close()


# ---------------------------------------------------------------- create_engine


def test_create_engine_refuses_unknown_backend() -> None:
    with pytest.raises(InvalidInput) as info:
        db.create_engine("mysql://user@localhost/agentkeep")
    assert info.value.field == "url"
    assert "mysql" in str(info.value)


def test_create_engine_refuses_bad_synchronous(tmp_path: Path) -> None:
    with pytest.raises(InvalidInput) as info:
        db.create_engine(f"sqlite:///{tmp_path / 'x.db'}", synchronous="SOMETIMES")
    assert info.value.field == "synchronous"
    assert not (tmp_path / "x.db").exists()


def test_create_engine_refuses_negative_busy_timeout(tmp_path: Path) -> None:
    with pytest.raises(InvalidInput) as info:
        db.create_engine(f"sqlite:///{tmp_path / 'x.db'}", busy_timeout_ms=-1)
    assert info.value.field == "busy_timeout_ms"
    with pytest.raises(InvalidInput):
        Store.open(f"sqlite:///{tmp_path / 'x.db'}", busy_timeout_ms=-5)
    assert not (tmp_path / "x.db").exists()


# ---------------------------------------------------------------- SQLite PRAGMAs and locks


@pytest.mark.parametrize(("synchronous", "code"), [("NORMAL", 1), ("FULL", 2), ("full", 2)])
def test_sqlite_store_connection_pragmas(tmp_path: Path, synchronous: str, code: int) -> None:
    """SQLite only: PRAGMAs set on every store connection, WAL persisted after open."""
    path = tmp_path / "pragmas.db"
    url = f"sqlite:///{path}"
    pragmas = ("foreign_keys", "busy_timeout", "synchronous", "journal_mode")

    def read_pragmas(cursor_exec: Callable[[str], Any]) -> dict[str, Any]:
        return {p: cursor_exec(f"PRAGMA {p}") for p in pragmas}

    with Store.open(url, migrate=True, busy_timeout_ms=1234, synchronous=synchronous) as store:
        expected = {"foreign_keys": 1, "busy_timeout": 1234, "synchronous": code}
        with store.write() as uow:
            got = read_pragmas(lambda sql: uow.connection.exec_driver_sql(sql).scalar())
        assert {k: got[k] for k in expected} == expected
        assert str(got["journal_mode"]).lower() == "wal"
        lean = store.call_read(
            lambda r: read_pragmas(lambda sql: r.driver.raw.execute(sql).fetchone()[0])
        )
        assert {k: lean[k] for k in expected} == expected

    con = sqlite3.connect(path)
    try:
        assert con.execute("PRAGMA journal_mode").fetchone()[0] == "wal"  # persistent
    finally:
        con.close()


def test_sqlite_write_unit_holds_the_write_lock_from_its_start(sqlite_url: str) -> None:
    """SQLite only: ``store.write()`` and lean write units begin IMMEDIATE."""
    path = sqlite_file(sqlite_url)
    outsider = sqlite3.connect(path, timeout=0.1, isolation_level=None)

    def outsider_can_write() -> bool:
        try:
            outsider.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as exc:
            assert "database is locked" in str(exc)
            return False
        outsider.execute("ROLLBACK")
        return True

    try:
        with Store.open(sqlite_url) as store:
            assert outsider_can_write()
            with store.write():
                assert not outsider_can_write()  # nothing done yet, lock already held
            assert outsider_can_write()
            assert store.call_write(lambda r: outsider_can_write()) is False
            assert outsider_can_write()
            with store.read():
                assert outsider_can_write()  # a read unit takes no write lock
    finally:
        outsider.close()


@pytest.mark.parametrize("unit", ["read", "call_read"])
def test_read_unit_does_not_block_a_writer(store: Store, db_url: str, unit: str) -> None:
    store.runs.create(RunRecord.new("R-1", "T-1", 10))
    with Store.open(db_url, busy_timeout_ms=300, retry_attempts=1) as writer:

        def body(r: Repositories) -> tuple[RunStatus, RunStatus]:
            before = r.runs.get("R-1").status  # the snapshot starts here
            writer.runs.update_status("R-1", RunStatus.RUNNING)  # would hit StoreBusy if blocked
            return before, r.runs.get("R-1").status

        if unit == "read":
            with store.read() as uow:
                seen = body(uow)
        else:
            seen = store.call_read(body)

    assert seen == (RunStatus.PENDING, RunStatus.PENDING)  # one snapshot throughout
    assert store.runs.get("R-1").status is RunStatus.RUNNING


# ---------------------------------------------------------------- Store lifetime and errors


def test_store_open_refuses_retry_attempts_below_one_and_changes_nothing(
    fresh_url: str,
) -> None:
    with pytest.raises(InvalidInput) as info:
        Store.open(fresh_url, migrate=True, retry_attempts=0)
    assert info.value.field == "retry_attempts"
    # a refused call changes nothing: the empty database must not have been migrated
    assert migrate.current(fresh_url) == ()
    engine = create_engine(fresh_url)
    try:
        with engine.connect() as conn:
            assert inspect(conn).get_table_names() == []
    finally:
        engine.dispose()


def test_store_context_manager_closes_its_engine(db_url: str) -> None:
    closed: list[object] = []
    with Store.open(db_url) as store:
        event.listen(store.engine, "close", lambda dbapi_conn, record: closed.append(dbapi_conn))
        store.runs.create(RunRecord.new("R-1", "T-1", 10))
        with store.write() as uow:
            uow.runs.get("R-1")
        pool = store.engine.pool
        assert pool.checkedin() >= 1
        assert closed == []
    assert pool.checkedin() == 0
    assert len(closed) >= 1


@pytest.mark.parametrize("via", ["sqlalchemy", "driver"])
def test_write_unit_translates_driver_errors_and_rolls_back(store: Store, via: str) -> None:
    with pytest.raises(DatabaseError) as info:
        with store.write() as uow:
            uow.runs.create(RunRecord.new("R-1", "T-1", 10))
            if via == "sqlalchemy":
                uow.connection.execute(text("SELECT * FROM no_such_table"))
            else:
                uow.driver.execute(NO_SUCH_TABLE, {})
    assert type(info.value) is DatabaseError  # not StoreBusy, not a raw SQLAlchemy error
    assert not isinstance(info.value, sa_exc.SQLAlchemyError)
    assert "no_such_table" in str(info.value)

    with pytest.raises(RunNotFound):
        store.runs.get("R-1")
    assert ids(store) == []
    # the pooled connection came back clean: the next units work
    store.runs.create(RunRecord.new("R-2", "T-1", 20))
    with store.write() as uow:
        uow.runs.update_status("R-2", RunStatus.RUNNING)
    assert ids(store) == ["R-2"]


# ---------------------------------------------------------------- Postgres aggregate lock


@pytest.fixture
def pg_activity(db_url: str, backend: str) -> Iterator[Callable[[str], list[tuple[Any, ...]]]]:
    """``(application_name) -> [(wait_event_type, wait_event, state)]`` from pg_stat_activity."""
    if backend != "postgres":
        pytest.skip("Postgres only: advisory locks")
    engine = create_engine(db_url, isolation_level="AUTOCOMMIT")

    def activity(app: str) -> list[tuple[Any, ...]]:
        with engine.connect() as conn:
            rows = conn.execute(
                text(
                    "SELECT wait_event_type, wait_event, state FROM pg_stat_activity "
                    "WHERE application_name = :app AND datname = current_database()"
                ),
                {"app": app},
            )
            return [tuple(r) for r in rows]

    yield activity
    engine.dispose()


def test_postgres_aggregate_lock_serialises_writers_of_one_run(
    pg_activity: Callable[[str], list[tuple[Any, ...]]],
    store: Store,
    db_url: str,
) -> None:
    """Postgres only: ``lock_aggregate(RUN, id)`` blocks a second writer of the same run.

    The first unit takes the lock through ``uow.runs.update_status`` (leaving
    the status as it is) and stays open; a second store's one-call
    ``try_transition`` of the same run, whose statement finds the run in
    ``from_`` but its lock held, waits on the advisory lock on its locked
    path (seen in pg_stat_activity), returns only after the first commits
    and then wins; another run is not blocked meanwhile. (A run whose
    committed status is not ``from_`` is refused at once, without waiting:
    the statement's snapshot decides, docs/runs.md#common-rules.)
    """
    store.runs.create(RunRecord.new("R-1", "T-1", 10, status=RunStatus.INTERRUPTED))
    store.runs.create(RunRecord.new("R-2", "T-1", 20, status=RunStatus.INTERRUPTED))
    app = f"agentkeep-test-{uuid.uuid4().hex[:8]}"
    contender = Store.open(
        db_url, busy_timeout_ms=10_000, retry_attempts=1, connect_args={"application_name": app}
    )
    bystander = Store.open(db_url, busy_timeout_ms=500, retry_attempts=1)
    order: list[str] = []
    outcome: dict[str, Any] = {}
    started, finished = threading.Event(), threading.Event()

    def contend() -> None:
        started.set()
        try:
            outcome["won"] = contender.runs.try_transition(
                "R-1", RunStatus.INTERRUPTED, RunStatus.RUNNING
            )
            order.append("contender returned")
        except BaseException as exc:  # noqa: BLE001 - asserted below
            outcome["error"] = exc
        finally:
            finished.set()

    thread = threading.Thread(target=contend)
    try:
        contender.runs.get("R-2")  # warm its pool: the wait below is the lock, not a connect
        with store.write() as uow:
            uow.runs.update_status("R-1", RunStatus.INTERRUPTED)
            thread.start()
            assert started.wait(5)
            waiting: list[tuple[Any, ...]] = []
            for _ in range(250):  # bounded: at most ~5 s
                waiting = [r for r in pg_activity(app) if r[:2] == ("Lock", "advisory")]
                if waiting or finished.wait(0.02):
                    break
            assert waiting, f"contender never waited on the advisory lock: {outcome}"
            assert not finished.is_set()
            # another aggregate is not blocked (lock_timeout 500 ms would raise StoreBusy)
            assert bystander.runs.try_transition("R-2", RunStatus.INTERRUPTED, RunStatus.RUNNING)
            assert not finished.is_set()
            # a direct lock on R-2 from inside this unit does not wait either
            db.lock_aggregate(uow.driver, LockNamespace.RUN, "R-2")
            order.append("holder commits")
        assert finished.wait(10)
        thread.join(timeout=5)
    finally:
        contender.close()
        bystander.close()

    assert "error" not in outcome, outcome.get("error")
    assert order == ["holder commits", "contender returned"]
    assert outcome["won"] is True  # it decided after the holder committed
    assert store.runs.get("R-1").status is RunStatus.RUNNING
    assert store.runs.get("R-2").status is RunStatus.RUNNING


def _raised_over(outer: BaseException, inner: BaseException) -> BaseException:
    """``outer`` raised while handling ``inner`` (as psycopg's pipeline exit does)."""
    try:
        try:
            raise inner
        except BaseException:
            raise outer  # noqa: B904 - the implicit __context__ is the point
    except BaseException as exc:  # noqa: BLE001 - returned for inspection
        return exc


def test_a_client_error_over_a_terminated_backend_is_a_lost_connection() -> None:
    """psycopg's "cannot exit pipeline mode while busy" over ``AdminShutdown``: disconnect.

    A server error with its own SQLSTATE is judged by it, and the walk stops at
    agentkeep's own errors (a handled failure of an earlier attempt).
    """
    psycopg = pytest.importorskip("psycopg")
    from agentkeep.errors import ConnectionLost
    from agentkeep.statements import CompileTarget

    target = CompileTarget.of(create_engine("postgresql+psycopg://").dialect)

    class Raw:
        closed = broken = False

    def disconnect(exc: BaseException) -> bool:
        return db._is_disconnect(exc, Raw(), target)

    shutdown = psycopg.errors.AdminShutdown("terminating connection")
    busy = psycopg.OperationalError("cannot exit pipeline mode while busy")
    assert not disconnect(psycopg.OperationalError("cannot exit pipeline mode while busy"))
    assert disconnect(_raised_over(busy, shutdown))
    unique = psycopg.errors.UniqueViolation("duplicate key")
    assert not disconnect(_raised_over(unique, shutdown))
    lost = ConnectionLost("an earlier attempt")
    lost.__cause__ = psycopg.errors.AdminShutdown("earlier")
    assert not disconnect(
        _raised_over(psycopg.OperationalError("cannot exit pipeline mode while busy"), lost)
    )
