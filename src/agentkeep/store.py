"""The :class:`Store` facade: open a database, units of work, one-call operations.

``Store.open(url)`` builds the engine (:mod:`agentkeep.db`), checks that the
schema is at head (or migrates it with ``migrate=True``), and hands out units
of work. Each store's operations are reachable two ways, with one
implementation:

* ``with store.write() as uow: uow.runs.acquire_assignee(...)`` — several
  operations (and the host's own ORM rows) in one transaction;
* ``store.runs.acquire_assignee(...)`` — one operation in its own unit,
  retried as a whole on a transient busy/serialisation error.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, TypeVar

from sqlalchemy import Engine
from sqlalchemy import exc as sa_exc

from agentkeep import db
from agentkeep import migrations as _migrations
from agentkeep.clock import Clock, SystemClock
from agentkeep.errors import InvalidInput
from agentkeep.runs.facade import RunCalls
from agentkeep.runtime.domain import ReferenceDomain, RuntimeDomain
from agentkeep.runtime.facade import RuntimeCalls
from agentkeep.sessions.facade import (
    LeaseCalls,
    MaintenanceCalls,
    QueueCalls,
    SessionCalls,
    TurnInputCalls,
)
from agentkeep.statements import CompileTarget
from agentkeep.unit_of_work import Repositories, UnitOfWork

__all__ = ["Store"]

T = TypeVar("T")


class Store:
    """A handle on one agentkeep database.

    Use :meth:`open` to create one; close it with :meth:`close` or a ``with``
    block. Thread-safe: each unit of work takes its own pooled connection
    (an in-memory SQLite database has one shared connection, and its units
    are serialised by a mutex).
    """

    def __init__(
        self,
        engine: Engine,
        *,
        clock: Clock | None = None,
        retry_attempts: int = 5,
        memory: bool = False,
        auto_gc_every_commits: int | None = None,
        runtime_domain: RuntimeDomain[Any] | None = None,
    ) -> None:
        if retry_attempts < 1:
            raise InvalidInput("retry_attempts", "must be >= 1")
        if auto_gc_every_commits is not None and (
            type(auto_gc_every_commits) is not int or auto_gc_every_commits < 1
        ):
            raise InvalidInput("auto_gc_every_commits", "must be None or an integer >= 1")
        #: Run blob GC after every N one-call session commits (None: never).
        self.auto_gc_every_commits = auto_gc_every_commits
        self.engine = engine
        self.clock: Clock = clock or SystemClock()
        self._write_engine = db.write_engine(engine)
        self._read_engine = db.read_engine(engine)
        self._target: CompileTarget | None = None
        self._dbapi_error: type[BaseException] = engine.dialect.loaded_dbapi.Error
        self._retry_attempts = retry_attempts
        self._mutex: Callable[[], AbstractContextManager[Any]]
        self._memory = memory
        if memory:
            lock = threading.RLock()
            self._mutex = lambda: lock
        else:
            self._mutex = nullcontext
        self.runs = RunCalls(self)
        self.leases = LeaseCalls(self)
        self.queue = QueueCalls(self)
        self.turn_inputs = TurnInputCalls(self)
        self.sessions = SessionCalls(self)
        self.maintenance = MaintenanceCalls(self)
        #: The runtime store's domain rules (session codec, guards, codecs).
        self.runtime_domain: RuntimeDomain[Any] = (
            runtime_domain if runtime_domain is not None else ReferenceDomain()
        )
        self.runtime = RuntimeCalls(self)

    @classmethod
    def open(
        cls,
        url: str = "sqlite:///agentkeep.db",
        *,
        migrate: bool = False,
        clock: Clock | None = None,
        busy_timeout_ms: int = db.DEFAULT_BUSY_TIMEOUT_MS,
        synchronous: str = "NORMAL",
        retry_attempts: int = 5,
        auto_gc_every_commits: int | None = None,
        runtime_domain: RuntimeDomain[Any] | None = None,
        **engine_kwargs: Any,
    ) -> Store:
        """Open the database at ``url``.

        Args:
            url: ``sqlite:///path.db`` (default ``sqlite:///agentkeep.db``),
                ``sqlite://`` for in-memory, or ``postgresql+psycopg://…``.
            migrate: upgrade a database behind head (adopting tables written
                by the original stores) instead of failing. An in-memory
                database is always migrated.
            clock: time source (default: the system clock).
            busy_timeout_ms: lock wait before :class:`~agentkeep.errors.StoreBusy`.
            synchronous: SQLite ``PRAGMA synchronous`` (NORMAL or FULL).
            retry_attempts: attempts of a one-call operation on transient errors.
            auto_gc_every_commits: run blob GC after every N successful
                ``store.sessions.commit_runtime_state`` calls (best effort).
            runtime_domain: the runtime store's domain rules (default
                :class:`~agentkeep.runtime.domain.ReferenceDomain`).
            **engine_kwargs: passed to :func:`sqlalchemy.create_engine`.

        Raises:
            SchemaBehind: the schema is behind head and ``migrate`` is false.
            SchemaNewer: the database was written by a newer agentkeep.
            LegacySchemaMismatch: (``migrate=True``) legacy tables of unknown shape.
        """
        if retry_attempts < 1:  # before anything touches the database
            raise InvalidInput("retry_attempts", "must be >= 1")
        if auto_gc_every_commits is not None and (
            type(auto_gc_every_commits) is not int or auto_gc_every_commits < 1
        ):
            raise InvalidInput("auto_gc_every_commits", "must be None or an integer >= 1")
        memory = db.is_memory_sqlite(url)
        engine = db.create_engine(
            url, busy_timeout_ms=busy_timeout_ms, synchronous=synchronous, **engine_kwargs
        )
        try:
            _migrations.ensure_schema(engine, migrate=migrate or memory)
            db.enable_wal(engine)
        except BaseException:
            engine.dispose()
            raise
        return cls(
            engine,
            clock=clock,
            retry_attempts=retry_attempts,
            memory=memory,
            auto_gc_every_commits=auto_gc_every_commits,
            runtime_domain=runtime_domain,
        )

    def migrate(self) -> tuple[str, ...]:
        """Upgrade this database to head (adopting legacy tables); return the revisions."""
        return _migrations.upgrade(self.engine)

    # ------------------------------------------------------------------ units of work

    @contextmanager
    def write(self) -> Iterator[UnitOfWork]:
        """A write unit of work: ``BEGIN IMMEDIATE`` on SQLite, READ COMMITTED on Postgres.

        Commits when the block exits normally; rolls back when it raises.

        Raises:
            StoreBusy: the write lock could not be had within the busy timeout.
            DatabaseError: any other driver failure.
        """
        with self._unit(self._write_engine, writable=True) as uow:
            yield uow

    @contextmanager
    def read(self) -> Iterator[UnitOfWork]:
        """A read unit of work: one consistent snapshot; write operations are refused."""
        with self._unit(self._read_engine, writable=False) as uow:
            yield uow

    @contextmanager
    def _unit(self, engine: Engine, *, writable: bool) -> Iterator[UnitOfWork]:
        with self._mutex():
            try:
                conn = engine.connect()
            except sa_exc.DBAPIError as exc:
                raise db.translate_db_error(exc) from exc
            try:
                try:
                    conn.begin()
                except sa_exc.DBAPIError as exc:
                    raise db.translate_db_error(exc) from exc
                uow = UnitOfWork(
                    conn, self.clock, writable=writable, runtime_domain=self.runtime_domain
                )
                try:
                    yield uow
                    uow._flush()
                    conn.commit()
                except sa_exc.DBAPIError as exc:
                    uow._discard()
                    conn.rollback()
                    raise db.translate_db_error(exc) from exc
                except BaseException:
                    uow._discard()
                    conn.rollback()
                    raise
            finally:
                conn.close()

    def call_write(self, fn: Callable[[Repositories], T]) -> T:
        """Run ``fn`` in its own lean write unit, retrying the unit on transient errors.

        The unit is a pooled driver connection whose transaction is opened
        (``BEGIN IMMEDIATE`` on SQLite) and committed directly; ``fn`` gets its
        repositories. Every one-call operation (``store.runs.<op>``) goes
        through here.

        Raises:
            StoreBusy: every attempt met a busy/serialisation error.
        """
        return db.retry_transient(lambda: self._lean(fn, write=True), attempts=self._retry_attempts)

    def call_read(self, fn: Callable[[Repositories], T], *, single_statement: bool = False) -> T:
        """Run ``fn`` in its own lean read unit (one snapshot), retried like :meth:`call_write`.

        Args:
            fn: the read.
            single_statement: ``fn`` runs exactly one SELECT, which is a
                consistent snapshot by itself: the unit then skips opening an
                explicit snapshot transaction (``BEGIN`` on SQLite, ``SET
                TRANSACTION … REPEATABLE READ`` on Postgres), saving a round
                trip. Never set it for a read of several statements.
        """
        return db.retry_transient(
            lambda: self._lean(fn, write=False, snapshot=not single_statement),
            attempts=self._retry_attempts,
        )

    def _lean(self, fn: Callable[[Repositories], T], *, write: bool, snapshot: bool = True) -> T:
        with self.pooled_driver() as (driver, _pooled):
            if write or snapshot:
                driver.begin(write=write)
            try:
                result = fn(self.repositories(driver, write=write))
                driver.commit()
            except BaseException:
                driver.rollback()
                raise
            return result

    @contextmanager
    def pooled_driver(self) -> Iterator[tuple[db.Driver, Any]]:
        """A pooled connection's :class:`~agentkeep.db.Driver`, outside any transaction.

        For operations that own their transaction's end (unregister
        finalization commits, then classifies an unacknowledged COMMIT).
        Yields the driver and the pool's connection record (``invalidate()``
        it to discard a connection whose state is unknown). Most code wants
        :meth:`call_write` instead.

        Raises:
            DatabaseError: connecting failed (StoreBusy if transient).
        """
        with self._mutex():
            try:
                pooled = self.engine.raw_connection()
            except sa_exc.DBAPIError as exc:
                raise db.translate_db_error(exc) from exc
            try:
                driver = db.Driver(pooled.driver_connection, self.compile_target, self._dbapi_error)
                yield driver, pooled
            finally:
                pooled.close()

    def repositories(self, driver: db.Driver, *, write: bool) -> Repositories:
        """The repositories of a one-call unit on ``driver`` (see :meth:`pooled_driver`)."""
        return Repositories(driver, self.clock, writable=write, runtime_domain=self.runtime_domain)

    @property
    def compile_target(self) -> CompileTarget:
        """What this store's statements are compiled for (its dialect and paramstyle).

        Built after the first connection, when the dialect knows the server version.
        """
        target = self._target
        if target is None:
            target = self._target = CompileTarget.of(self.engine.dialect)
        return target

    @property
    def retry_attempts(self) -> int:
        """Attempts of a one-call operation on transient errors."""
        return self._retry_attempts

    @property
    def memory(self) -> bool:
        """True for an in-memory SQLite database (one shared connection)."""
        return self._memory

    # ------------------------------------------------------------------ lifetime

    def close(self) -> None:
        """Release every pooled connection."""
        self.engine.dispose()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
