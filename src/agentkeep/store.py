"""The :class:`Store` facade: open a database, units of work, one-call operations.

``Store.open(url)`` builds the engine (:mod:`agentkeep.db`), or
``Store.open(engine)`` adopts the host application's own engine; either way
it checks that the schema is at head (or migrates it with ``migrate=True``)
and hands out units of work. Each store's operations are reachable two ways,
with one implementation:

* ``with store.write() as uow: uow.runs.acquire_assignee(...)`` — several
  operations (and the host's own ORM rows) in one transaction;
  ``store.write(join=session_or_connection)`` runs them inside a transaction
  the host already holds, committed or rolled back by the host;
* ``store.runs.acquire_assignee(...)`` — one operation in its own unit,
  retried as a whole on a transient busy/serialisation error.

``schema=`` keeps agentkeep's tables in a namespace of their own, apart from
a host's tables of the same names: a Postgres schema, or on SQLite a file
attached next to the database (:mod:`agentkeep.db`).
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, TypeVar

from sqlalchemy import Connection, Engine
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import URL, make_url
from sqlalchemy.orm import Session, scoped_session

from agentkeep import db, observability
from agentkeep import migrations as _migrations
from agentkeep.clock import Clock, SystemClock
from agentkeep.crypto import PayloadCodec
from agentkeep.errors import (
    CommitOutcomeUnknown,
    ConnectionLost,
    DatabaseError,
    InvalidInput,
    StoreBusy,
)
from agentkeep.limits import DEFAULT_LIMITS, Limits
from agentkeep.runs.facade import RunCalls
from agentkeep.runtime.domain import ReferenceDomain, RuntimeDomain
from agentkeep.runtime.facade import RuntimeCalls
from agentkeep.sessions.facade import (
    CatalogCalls,
    CheckpointNodeCalls,
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

    ``Store(engine, ...)`` is ``Store.open(engine, ...)`` without ``migrate``
    and the connection settings: it adopts the engine
    (:func:`agentkeep.db.adopt_engine`), attaches the namespace (``schema``),
    checks the schema and puts a SQLite file in WAL, like :meth:`open`.

    Attributes:
        engine: the engine the store runs on.
        schema: the namespace of agentkeep's tables (None: the default, the
            original stores' table names without a schema).
        clock: the time source.
        oauth_codec: encryption at rest of the OAuth flow state (None: stored
            as given; see :meth:`open`).

    Raises:
        InvalidInput: a refused engine or argument.
        SchemaBehind: the schema is behind head.
        SchemaNewer: the database was written by a newer agentkeep.
        DatabaseUnavailable, StoreBusy, DatabaseError: opening failed, as
            for :meth:`open`.
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
        schema: str | None = None,
        oauth_codec: PayloadCodec | None = None,
        limits: Limits | None = None,
        _checked: bool = False,
    ) -> None:
        _check_open_options(retry_attempts, auto_gc_every_commits, schema, oauth_codec, limits)
        if not isinstance(engine, Engine):
            _refuse_async(engine)
            raise InvalidInput(
                "engine", f"expected a sqlalchemy Engine, not {type(engine).__name__}"
            )
        memory = memory or _is_memory(engine)
        if not _checked:  # Store(engine): what Store.open does, without migrate
            _refuse_async(engine)
            with db.opening(engine if isinstance(engine, Engine) else None):
                db.adopt_engine(engine)
                if schema is not None:
                    db.attach_schema(engine, schema)
                _migrations.ensure_schema(engine, migrate=memory, schema=schema)
                db.enable_wal(engine, schema)
        settings = db.engine_settings(engine)
        assert settings is not None  # created or adopted above
        self._settings = settings
        self._owns_engine = False
        #: Run blob GC after every N one-call session commits (None: never).
        self.auto_gc_every_commits = auto_gc_every_commits
        self.engine = engine
        self.schema = schema
        self.clock: Clock = clock or SystemClock()
        self._write_engine = db.write_engine(engine, schema)
        self._read_engine = db.read_engine(engine)
        self._target: CompileTarget | None = None
        self._dbapi_error: type[BaseException] = engine.dialect.loaded_dbapi.Error
        self._retry_attempts = retry_attempts
        #: How a one-call operation waits between retries (the async facade's yields).
        self._sleep: Callable[[float], object] = time.sleep
        self._mutex: Callable[[], AbstractContextManager[Any]]
        self._memory = memory
        if memory:
            lock = threading.RLock()
            self._mutex = lambda: lock
        else:
            self._mutex = nullcontext
        #: SQLite file: the queue of this store's one-call write units (see _lean).
        #: None elsewhere (Postgres, in-memory, a native AsyncStore's event loop).
        self._writer_thread: int | None = None  # the thread holding _writers
        self._writers: threading.Lock | None = (
            threading.Lock() if engine.dialect.name == "sqlite" and not memory else None
        )
        #: The connection (and its driver) a one-call unit left for the next one:
        #: see :meth:`_park_connections`. Empty unless parking is on.
        self._parked: list[tuple[Any, db.Driver]] = []
        self._park = False
        #: How many connections the pool may have checked out at most (pool_size +
        #: max_overflow); None: no limit. A unit ending at it never parks.
        #: (Counted on ``engine.pool`` when a unit ends: ``engine.dispose()`` replaces it.)
        self._park_limit: int | None = None
        self.runs = RunCalls(self)
        self.leases = LeaseCalls(self)
        self.queue = QueueCalls(self)
        self.turn_inputs = TurnInputCalls(self)
        self.commits = SessionCalls(self)
        self.maintenance = MaintenanceCalls(self)
        self.catalog = CatalogCalls(self)
        self.checkpoint_nodes = CheckpointNodeCalls(self)
        #: The runtime store's domain rules (session codec, guards, codecs).
        self.runtime_domain: RuntimeDomain[Any] = (
            runtime_domain if runtime_domain is not None else ReferenceDomain()
        )
        #: Encryption at rest of the OAuth flow state (None: stored as given).
        self.oauth_codec = oauth_codec
        #: The size limits of written values (:class:`~agentkeep.limits.Limits`).
        self.limits: Limits = DEFAULT_LIMITS if limits is None else limits
        self.runtime = RuntimeCalls(self)

    @classmethod
    def open(
        cls,
        url: str | URL | Engine = "sqlite:///agentkeep.db",
        *,
        migrate: bool = False,
        clock: Clock | None = None,
        busy_timeout_ms: int | None = None,
        synchronous: str | None = None,
        retry_attempts: int = 5,
        auto_gc_every_commits: int | None = None,
        runtime_domain: RuntimeDomain[Any] | None = None,
        schema: str | None = None,
        oauth_codec: PayloadCodec | None = None,
        limits: Limits | None = None,
        **engine_kwargs: Any,
    ) -> Store:
        """Open the database at ``url``, or the database of the host's ``Engine``.

        With a URL, agentkeep builds and owns the engine (:meth:`close`
        disposes it). With a SQLAlchemy :class:`~sqlalchemy.Engine` built by
        the host application, the store runs on that engine and its pool, and
        never disposes it. The engine is adopted
        (:func:`agentkeep.db.adopt_engine`):

        * SQLite (pysqlite): agentkeep's units begin their own transactions
          (``BEGIN IMMEDIATE`` for writes, through a ``begin`` hook that acts
          only on agentkeep's units); the host's transactions keep pysqlite's
          deferred behaviour. Every connection of the engine gets the busy
          timeout and ``foreign_keys=ON`` (``synchronous`` only when given);
          the file is put in WAL once the schema is accepted.
        * Postgres (psycopg 3): the engine is used as is. An AUTOCOMMIT engine
          is refused; ``busy_timeout_ms``/``synchronous`` are refused (set
          ``lock_timeout`` on your engine); write units run READ COMMITTED
          even if the engine's default is another level.

        Either way the schema is checked like for a URL. Open the store when
        the application starts, before it holds transactions on the engine
        (switching a file to WAL waits for them).

        With ``schema``, agentkeep's tables live in a namespace of that name,
        so a database whose own tables are named like agentkeep's (``runs``,
        ``blobs``, ...) can hold both; every statement and migration runs in
        it, and its advisory-lock keys are its own:

        * Postgres: the schema ``schema`` of the database (created by the
          migrations, ``migrate=True`` or ``agentkeep upgrade --schema``).
        * SQLite: the file :func:`agentkeep.db.sqlite_schema_file` next to the
          database (``app.db`` -> ``app.agentkeep.db``), attached under that
          name to every connection of the engine, also a host's
          (:func:`agentkeep.db.attach_schema`), and put in WAL mode; the main
          file's journal mode is left as it is. An in-memory database is
          refused. A write unit's ``BEGIN IMMEDIATE`` locks both files; a
          joined unit's writes and the host's commit in one transaction, but
          SQLite does not make a commit across two WAL files atomic on a
          crash (one file may have it and the other not).

        Args:
            url: ``sqlite:///path.db`` (default ``sqlite:///agentkeep.db``),
                ``sqlite://`` for in-memory, ``postgresql+psycopg://…``, or an
                Engine.
            migrate: upgrade a database behind head (adopting tables written
                by the original stores) instead of failing. An in-memory
                database is always migrated.
            clock: time source (default: the system clock).
            busy_timeout_ms: lock wait before :class:`~agentkeep.errors.StoreBusy`
                (default 30 s; for a SQLite Engine applied to its connections).
            synchronous: SQLite ``PRAGMA synchronous`` (NORMAL or FULL;
                default NORMAL for a URL, the connections' own for an Engine).
            retry_attempts: at most this many attempts of a one-call operation
                on transient errors, all within one busy timeout (one deadline:
                docs/architecture.md#one-call-operations).
            auto_gc_every_commits: run blob GC after every N successful
                ``store.commits.commit_runtime_state`` calls (best effort).
            runtime_domain: the runtime store's domain rules (default
                :class:`~agentkeep.runtime.domain.ReferenceDomain`).
            schema: the namespace of agentkeep's tables (default None: the
                original stores' table names, no schema; see above).
            oauth_codec: encrypts the OAuth flow state at rest: any
                :class:`~agentkeep.crypto.PayloadCodec`, such as
                :class:`~agentkeep.crypto.AesGcmCodec` (extra
                ``agentkeep[crypto]``). Default None: stored as given
                (docs/runtime.md#oauth-flow-state).
            limits: the largest ids, payloads, snapshots and blobs the store
                writes (:class:`~agentkeep.limits.Limits`; default
                :data:`~agentkeep.limits.DEFAULT_LIMITS`: ids 255 characters,
                payloads 8 MiB, snapshots and blobs 64 MiB). A larger value
                raises :class:`~agentkeep.errors.PayloadTooLarge` and writes
                nothing (docs/limits.md).
            **engine_kwargs: passed to :func:`sqlalchemy.create_engine` (URL only).

        Raises:
            InvalidInput: a refused argument, URL or engine (the message says
                what to change); nothing was changed.
            SchemaBehind: the schema is behind head and ``migrate`` is false.
            SchemaNewer: the database was written by a newer agentkeep.
            LegacySchemaMismatch: (``migrate=True``) legacy tables of unknown shape.
            DatabaseUnavailable: the database cannot be opened: a SQLite path
                that is a directory, in a directory that does not exist, on a
                read-only file system (or opened ``?mode=ro``), a file that is
                not a SQLite database; a Postgres server that refuses the
                connection. Nothing was created.
            StoreBusy: a lock held elsewhere (a migration in another process)
                outlasted the busy timeout; retry.
            DatabaseError: any other failure of the database while opening
                (a statement timeout, ...), the driver's error chained.
        """
        # before touching the database
        _check_open_options(retry_attempts, auto_gc_every_commits, schema, oauth_codec, limits)
        if isinstance(url, (str, URL)):
            db.check_url(url)
        _refuse_async(url)
        owned = isinstance(url, (str, URL))
        with db.opening(url if isinstance(url, (str, URL, Engine)) else None):
            return cls._open(
                url,
                owned=owned,
                migrate=migrate,
                clock=clock,
                busy_timeout_ms=busy_timeout_ms,
                synchronous=synchronous,
                retry_attempts=retry_attempts,
                auto_gc_every_commits=auto_gc_every_commits,
                runtime_domain=runtime_domain,
                schema=schema,
                oauth_codec=oauth_codec,
                limits=limits,
                engine_kwargs=engine_kwargs,
            )

    @classmethod
    def _open(
        cls,
        url: str | URL | Engine,
        *,
        owned: bool,
        migrate: bool,
        clock: Clock | None,
        busy_timeout_ms: int | None,
        synchronous: str | None,
        retry_attempts: int,
        auto_gc_every_commits: int | None,
        runtime_domain: RuntimeDomain[Any] | None,
        schema: str | None,
        oauth_codec: PayloadCodec | None,
        limits: Limits | None,
        engine_kwargs: dict[str, Any],
    ) -> Store:
        """:meth:`open` after its argument checks: build or adopt the engine, then open on it."""
        if isinstance(url, (str, URL)):
            _refuse_memory_schema(
                schema, url.render_as_string(hide_password=False) if isinstance(url, URL) else url
            )
            engine = db.create_engine(
                url.render_as_string(hide_password=False) if isinstance(url, URL) else url,
                busy_timeout_ms=(
                    db.DEFAULT_BUSY_TIMEOUT_MS if busy_timeout_ms is None else busy_timeout_ms
                ),
                synchronous="NORMAL" if synchronous is None else synchronous,
                **engine_kwargs,
            )
        else:
            if engine_kwargs:
                raise InvalidInput(
                    "engine_kwargs",
                    f"{sorted(engine_kwargs)} apply to an engine agentkeep creates: "
                    "pass them to your own create_engine call",
                )
            engine = url
            db.adopt_engine(engine, busy_timeout_ms=busy_timeout_ms, synchronous=synchronous)
        return cls._on_engine(
            engine,
            owned=owned,
            migrate=migrate,
            clock=clock,
            retry_attempts=retry_attempts,
            auto_gc_every_commits=auto_gc_every_commits,
            runtime_domain=runtime_domain,
            schema=schema,
            oauth_codec=oauth_codec,
            limits=limits,
        )

    @classmethod
    def _on_engine(
        cls,
        engine: Engine,
        *,
        owned: bool,
        migrate: bool,
        clock: Clock | None,
        retry_attempts: int,
        auto_gc_every_commits: int | None,
        runtime_domain: RuntimeDomain[Any] | None,
        schema: str | None,
        oauth_codec: PayloadCodec | None = None,
        limits: Limits | None = None,
    ) -> Store:
        """The rest of :meth:`open` on a created or adopted engine: namespace, schema, WAL.

        Disposes an ``owned`` engine when it fails. The async facade calls it
        on an AsyncEngine's ``sync_engine`` inside SQLAlchemy's greenlet bridge.
        """
        memory = _is_memory(engine)
        try:
            with db.opening(engine):
                if schema is not None:
                    db.attach_schema(engine, schema)
                _migrations.ensure_schema(engine, migrate=migrate or memory, schema=schema)
                db.enable_wal(engine, schema)
        except BaseException:
            if owned:
                engine.dispose()
            raise
        store = cls(
            engine,
            clock=clock,
            retry_attempts=retry_attempts,
            memory=memory,
            auto_gc_every_commits=auto_gc_every_commits,
            runtime_domain=runtime_domain,
            schema=schema,
            oauth_codec=oauth_codec,
            limits=limits,
            _checked=True,
        )
        store._owns_engine = owned
        if owned:
            store._park_connections()
        return store

    def _park_connections(self) -> None:
        """Let one-call units hand their connection to the next one-call unit (owned engines).

        Returning a connection to SQLAlchemy's pool after every one-call unit
        and checking one out for the next costs more than the unit's own
        statements (a SQLite ``get`` spends about half its time there; on
        Postgres the checkout, the reset on return and the two switches of
        the autocommit mode cost about a fifth of a psycopg ``get``'s CPU). On an
        engine the store created for a SQLite file (pysqlite) or for
        Postgres on psycopg (sync), a one-call unit that ends cleanly
        (committed or rolled back, connection valid, outside any
        transaction) parks its connection and driver on the store instead,
        and the next one-call unit takes them back; at most
        :data:`_PARKED_MAX` (two) stay parked, the others go back to the pool
        as before (two: a LangGraph saver's put and put_writes of one step
        run at once, on two threads; with one parked connection about a third
        of those units checked one out of the pool). A parked
        connection holds no transaction and no statement in progress, so it
        holds no lock and no snapshot: other connections and processes see
        no difference. A parked Postgres connection stays in the lean units'
        autocommit mode, and is switched back whenever it goes back to the
        pool. It stays checked out of the pool while parked; :meth:`close`
        returns it before disposing the engine (and so does the garbage
        collection of a store never closed), and a lost connection returns
        every parked one. A parked connection the server closed meanwhile is
        what a pooled one would be (there is no pre-ping): the unit that
        takes it gets ``ConnectionLost`` before anything was applied, and
        the operation runs again on a fresh connection. Never on a host's
        engine, whose pool is the host's to size, nor on in-memory SQLite,
        an asyncio driver, or a pool with ``pool_pre_ping`` or
        ``pool_recycle`` (they act when a connection is checked out).
        """
        engine = self.engine
        driver = engine.dialect.driver
        if engine.dialect.is_async or driver not in ("pysqlite", "psycopg"):
            return
        if driver == "pysqlite" and self._writers is None:  # in-memory SQLite
            return
        pool: Any = engine.pool
        if getattr(pool, "_pre_ping", False) or getattr(pool, "_recycle", -1) >= 0:
            # pool_pre_ping / pool_recycle act at checkout: a parked connection is
            # never checked out again, so it would go unpinged past its recycle age.
            return
        size, overflow = getattr(pool, "size", None), getattr(pool, "_max_overflow", -1)
        if callable(size) and overflow >= 0:  # a pool with a limit (QueuePool)
            self._park_limit = size() + overflow
        self._park = True
        weakref.finalize(self, _release_parked, self._parked)
        _PARKING.add(self)

    def migrate(self) -> tuple[str, ...]:
        """Upgrade this store's namespace to head, adopting legacy tables; return the revisions."""
        return _migrations.upgrade(self.engine, schema=self.schema)

    # ------------------------------------------------------------------ units of work

    @contextmanager
    def write(self, *, join: Session | Connection | None = None) -> Iterator[UnitOfWork]:
        """A write unit of work: ``BEGIN IMMEDIATE`` on SQLite, READ COMMITTED on Postgres.

        Commits when the block exits normally; rolls back when it raises.

        With ``join``, the unit runs inside the transaction that the host's
        ``Session`` (or ``scoped_session``) or ``Connection`` holds (begun
        now if it has none), on the engine this store runs on:

        * the unit never commits: after a normal exit the host's transaction
          is still open, and agentkeep's writes commit or roll back when the
          host commits or rolls back;
        * the block runs in a SAVEPOINT: when it raises, only its own work
          (agentkeep's writes and what the block added through
          ``uow.session``) is rolled back, and the exception propagates; the
          host's transaction stays usable;
        * ``uow.session`` is the host's Session, or a Session on the host's
          Connection;
        * the fences hold as in an own unit. SQLite: the join takes the
          database write lock and the host's transaction keeps it until it
          ends. A host transaction pysqlite has not begun (the host has not
          written yet) is begun ``BEGIN IMMEDIATE``; one already begun is
          upgraded in place, which SQLite refuses for a deferred transaction
          that has read while another writer holds the lock (``StoreBusy``)
          or has committed since (``JoinedTransactionStale``): then roll the
          host's transaction back and run it again. Hosts whose transactions
          begin at the driver (their own ``begin`` hook, or sessions on the
          engine of ``Store.open(url)``) avoid both by joining before they
          read, or by beginning IMMEDIATE
          (``engine.execution_options(sqlite_begin="IMMEDIATE")`` on an engine
          agentkeep runs on). Postgres: advisory locks are transaction-scoped
          and held until the host's transaction ends; the host's transaction
          must be READ COMMITTED. Hold the joined transaction briefly: it
          blocks every other writer of what it locked (on SQLite, every writer).

        Raises:
            StoreBusy: the write lock could not be had within the busy timeout.
            JoinedTransactionStale: (join, SQLite) see above; nothing written.
            InvalidInput: (join) not a Session or Connection, bound to another
                engine, AUTOCOMMIT, or (Postgres) not READ COMMITTED.
            DatabaseError: any other driver failure.
        """
        if join is not None:
            with self._joined(join, writable=True) as uow:
                yield uow
            return
        with self._unit(self._write_engine, writable=True) as uow:
            yield uow

    @contextmanager
    def read(self, *, join: Session | Connection | None = None) -> Iterator[UnitOfWork]:
        """A read unit of work: one consistent snapshot; write operations are refused.

        With ``join``, the reads run inside the host's transaction (see
        :meth:`write`; nothing is locked) and see its uncommitted writes. They
        see one snapshot when the host's transaction is one: on SQLite always
        (a transaction pysqlite had not begun is begun deferred for the
        block), on Postgres at REPEATABLE READ or SERIALIZABLE; at READ
        COMMITTED each statement sees the latest commits.

        Raises:
            InvalidInput: (join) not a Session or Connection, bound to another
                engine, or AUTOCOMMIT.
            DatabaseError: a driver failure.
        """
        if join is not None:
            with self._joined(join, writable=False) as uow:
                yield uow
            return
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
                    conn,
                    self.clock,
                    writable=writable,
                    runtime_domain=self.runtime_domain,
                    driver=self._driver(conn.connection.dbapi_connection),
                    oauth_codec=self.oauth_codec,
                )
                if writable:
                    db.watch_failed_statements(conn)
                try:
                    yield uow
                    uow._flush()
                    if writable:  # never acknowledge a transaction the database ended
                        uow.driver.check_not_aborted(failed_outside=db.failed_statements(conn))
                    try:
                        conn.commit()
                    except sa_exc.DBAPIError as exc:
                        failure = _commit_failure(conn, exc)
                        if isinstance(failure, CommitOutcomeUnknown):
                            conn.invalidate()
                            raise failure from exc
                        raise  # a definite failure: rolled back below
                except sa_exc.DBAPIError as exc:
                    uow._discard()
                    _rollback_connection(conn, exc)
                    raise db.translate_db_error(exc) from exc
                except BaseException as exc:
                    uow._discard()
                    _rollback_connection(conn, exc)
                    raise
            finally:
                conn.close()

    @contextmanager
    def _joined(self, join: Any, *, writable: bool) -> Iterator[UnitOfWork]:
        """A unit inside the host's transaction, in a SAVEPOINT, never committed (see write)."""
        session, conn, bind_kw = self._host_transaction(join)
        db.ensure_attached(conn, self.schema)
        with self._mutex():
            driver = self._driver(conn.connection.dbapi_connection)
            if writable:
                try:
                    db.join_write(driver)
                except sa_exc.DBAPIError as exc:
                    raise db.translate_db_error(exc) from exc
                with self._savepoint_unit(session, conn, bind_kw, driver, writable=True) as uow:
                    yield uow
            else:
                with db.join_read(driver):
                    with self._savepoint_unit(
                        session, conn, bind_kw, driver, writable=False
                    ) as uow:
                        yield uow

    @contextmanager
    def _savepoint_unit(
        self,
        session: Session | None,
        conn: Connection,
        bind_kw: dict[str, Any],
        driver: db.Driver,
        *,
        writable: bool,
    ) -> Iterator[UnitOfWork]:
        """The joined unit's block in a SAVEPOINT of the host's Session or Connection."""
        nested: Any
        try:
            if session is not None:
                nested = session.begin_nested()  # flushes the host's pending rows first
                session.connection(**bind_kw)  # the Session emits its SAVEPOINT lazily
            else:
                nested = conn.begin_nested()
        except sa_exc.DBAPIError as exc:
            raise db.translate_db_error(exc) from exc
        uow = UnitOfWork(
            conn,
            self.clock,
            writable=writable,
            runtime_domain=self.runtime_domain,
            driver=driver,
            session=session,
            oauth_codec=self.oauth_codec,
        )
        try:
            yield uow
            uow._flush()
            if nested.is_active:  # a rollback of uow.session already undid the unit
                nested.commit()
        except sa_exc.DBAPIError as exc:
            uow._discard()
            error = db.translate_db_error(exc)
            if nested.is_active:  # the host's connection: never discarded by agentkeep
                db.rollback_after(error, nested.rollback, lambda: None)
            raise error from exc
        except BaseException as exc:
            uow._discard()
            if nested.is_active:
                db.rollback_after(exc, nested.rollback, lambda: None)
            raise

    def _host_transaction(self, join: Any) -> tuple[Session | None, Connection, dict[str, Any]]:
        """The host's Session (or None), its Connection in a transaction, checked.

        The third item is what ``Session.connection()`` needs to return that
        Connection again.
        """
        if isinstance(join, scoped_session):
            join = join()
        if isinstance(join, Session):
            try:
                bind: Engine | Connection = join.get_bind()
                kw: dict[str, Any] = {}
            except sa_exc.UnboundExecutionError:  # binds per mapper only: ask for ours
                bind, kw = self.engine, {"bind_arguments": {"bind": self.engine}}
            self._check_joinable(bind)
            try:
                conn = join.connection(**kw)
            except sa_exc.DBAPIError as exc:
                raise db.translate_db_error(exc) from exc
            self._check_joinable(conn)
            return join, conn, kw
        if isinstance(join, Connection):
            if join.closed or join.invalidated:
                raise InvalidInput("join", "the Connection is closed or invalidated")
            self._check_joinable(join)
            if not join.in_transaction():
                try:
                    join.begin()  # as the host's next statement would (autobegin)
                except sa_exc.DBAPIError as exc:
                    raise db.translate_db_error(exc) from exc
            return None, join, {}
        raise InvalidInput(
            "join", f"expected a sqlalchemy Session or Connection, not {type(join).__name__}"
        )

    def _check_joinable(self, bind: Engine | Connection) -> None:
        if bind.engine.pool is not self.engine.pool:
            raise InvalidInput(
                "join",
                f"the host's Session/Connection is bound to another engine ({bind.engine!r}): "
                "bind it to the engine this store runs on (Store.open(engine), store.engine)",
            )
        if db.is_autocommit(bind):
            raise InvalidInput(
                "join",
                "the host's connection is AUTOCOMMIT: there is no transaction to join",
            )

    def _driver(self, raw: Any, *, lean: bool = False) -> db.Driver:
        return db.Driver(
            raw,
            self.compile_target,
            self._dbapi_error,
            pg_read_committed=self._settings.pg_read_committed,
            lean=lean,
            limits=self.limits,
        )

    def call_write(self, fn: Callable[[Repositories], T]) -> T:
        """Run ``fn`` in its own lean write unit, retrying the unit on transient errors.

        The unit is a pooled driver connection whose transaction is opened
        (``BEGIN IMMEDIATE`` on SQLite) and committed directly; ``fn`` gets its
        repositories. Each operation of ``fn`` that can fail after writing
        runs in a SAVEPOINT, so an error ``fn`` catches leaves nothing of
        that operation behind (the one-call forms, whose errors always
        propagate, skip it: :meth:`_call_operation`).

        One deadline: the operation ends within the busy timeout (plus the
        statement running when it passes), retries included, after at most
        ``retry_attempts`` attempts; a retry waits for a lock only as long as
        is left.

        Raises:
            StoreBusy: every attempt met a busy/serialisation error, or the
                busy timeout passed (``ConnectionLost`` when the last attempt
                lost its connection before COMMIT).
            CommitOutcomeUnknown: the connection was lost while COMMIT was
                in flight (named ``"transaction"``; the one-call forms name
                the operation).
        """
        return self._call_write(fn, operation=False)

    def _call_operation(self, fn: Callable[[Repositories], T], *, begin: bool = True) -> T:
        """:meth:`call_write` for ``fn`` that is one repository operation whose errors propagate.

        The one-call forms (``store.runs.<op>``, ``store.commits.<op>``, ...)
        run here. An operation that can fail after some of its writes (a
        session commit whose head compare-and-set loses, a runtime operation
        whose guard refuses) then needs no SAVEPOINT of its own: its error
        leaves ``fn`` and rolls the whole unit back. :meth:`call_write` keeps
        the SAVEPOINT, because its ``fn`` may catch an operation's error and
        go on to commit. Never pass a ``fn`` that catches an operation's
        error here: the writes that operation made before failing would be
        committed. Raises what :meth:`call_write` raises.

        ``begin=False`` (SQLite only): the unit opens no transaction; ``fn``
        runs its first statement in autocommit (one atomic statement) and
        calls ``driver.begin(write=True)`` itself before it needs more; the
        unit then commits or rolls back that transaction as usual.
        """
        return self._call_write(fn, operation=True, begin=begin)

    def _call_write(
        self, fn: Callable[[Repositories], T], *, operation: bool, begin: bool = True
    ) -> T:
        deadline = self._deadline()
        return db.retry_transient(
            lambda: self._lean(
                fn, write=True, snapshot=begin, deadline=deadline, operation=operation
            ),
            attempts=self._retry_attempts,
            sleep=self._sleep,
            deadline=deadline,
        )

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
        deadline = self._deadline()
        snapshot = not single_statement
        return db.retry_transient(
            lambda: self._lean_read(fn, snapshot),
            attempts=self._retry_attempts,
            sleep=self._sleep,
            deadline=deadline,
        )

    def _lean_read(self, fn: Callable[[Repositories], T], snapshot: bool) -> T:
        """One attempt of :meth:`call_read`: :meth:`_lean_unit` of a read, shortened.

        A read never waits in the writer queue nor cuts its lock waits
        (:meth:`_lean`), so on a store that parks its connection the unit
        runs on the parked one here, with :meth:`_lean_attempt`'s error
        handling and :meth:`_lean_unit`'s exit, without the write-only steps
        around them (a one-call ``get`` is a few
        microseconds of Python around one SELECT). Otherwise (nothing
        parked: the first unit, another thread's unit holds it, or a store
        that does not park) :meth:`_lean_unit` runs it.
        """
        parked = self._parked
        if parked:
            try:
                pooled, driver = parked.pop()
            except IndexError:  # another thread took it
                pass
            else:
                try:
                    if snapshot:
                        driver.begin(write=False)
                    result = fn(
                        Repositories(
                            driver,
                            self.clock,
                            writable=False,
                            runtime_domain=self.runtime_domain,
                            oauth_codec=self.oauth_codec,
                        )
                    )
                    _end_read(driver, pooled)
                except ConnectionLost as lost:
                    _discard_lost(self, pooled, lost)
                    raise
                except CommitOutcomeUnknown:
                    pooled.invalidate()
                    raise
                except BaseException as exc:
                    _rollback_or_discard(driver, pooled, exc)
                    raise
                finally:
                    _park_or_return(self, pooled, driver)
                return result
        return self._lean_unit(fn, write=False, snapshot=snapshot, deadline=None, operation=True)

    def _deadline(self) -> float | None:
        """When a one-call operation started now must end: now + the busy timeout.

        The busy timeout: SQLite's ``busy_timeout``, the ``lock_timeout`` of
        an owned Postgres engine, or the one a host's Postgres engine had
        when it was adopted. None when that is 0 (no limit): the attempts
        alone bound the operation then.
        """
        busy = self._settings.busy_timeout_ms
        return None if busy is None else time.monotonic() + busy / 1000

    def _lean(
        self,
        fn: Callable[[Repositories], T],
        *,
        write: bool,
        snapshot: bool = True,
        deadline: float | None = None,
        operation: bool = True,
    ) -> T:
        writers = self._writers if write else None
        me = threading.get_ident()
        if writers is None or deadline is None or self._writer_thread == me:
            # No queue: Postgres, memory, a native AsyncStore; no deadline (an
            # adopted engine whose busy timeout is not known: the queue could
            # not bound its wait); or a one-call write made inside this
            # thread's own queued write (it would wait for itself; SQLite's
            # busy handler refuses it with StoreBusy, as before the queue).
            return self._lean_unit(
                fn, write=write, snapshot=snapshot, deadline=deadline, operation=operation
            )
        # SQLite: one writer at a time holds the database write lock. A second
        # BEGIN IMMEDIATE of this store would wait in SQLite's busy handler,
        # which polls in sleeps of 1, 2, 5, 10 ... ms; queued here it starts as
        # soon as the writer before it commits. Writers of other processes and
        # other stores still meet in the busy handler. The wait counts against
        # the deadline.
        if not writers.acquire(False) and not writers.acquire(
            timeout=max(0.0, deadline - time.monotonic())
        ):
            raise StoreBusy("this store's other writers held the database past the busy timeout")
        self._writer_thread = me
        try:
            return self._lean_unit(
                fn, write=write, snapshot=snapshot, deadline=deadline, operation=operation
            )
        finally:
            self._writer_thread = None
            writers.release()

    def _lean_unit(
        self,
        fn: Callable[[Repositories], T],
        *,
        write: bool,
        snapshot: bool,
        deadline: float | None,
        operation: bool,
    ) -> T:
        """One attempt of a one-call unit: its connection (:class:`_PooledDriver`), then
        :meth:`_lean_attempt` on it.

        On a store that parks, a parked connection is taken and parked again
        (or returned) here, as :class:`_PooledDriver` would, without it.
        """
        parked = self._parked
        if parked:  # only a store that parks has one
            try:
                pooled, driver = parked.pop()
            except IndexError:  # another thread took it
                pass
            else:
                try:
                    return self._lean_attempt(
                        fn, driver, pooled, write, snapshot, deadline, operation
                    )
                finally:
                    _park_or_return(self, pooled, driver)
        with _PooledDriver(self, self._park) as (driver, pooled):
            return self._lean_attempt(fn, driver, pooled, write, snapshot, deadline, operation)

    def _lean_attempt(
        self,
        fn: Callable[[Repositories], T],
        driver: db.Driver,
        pooled: Any,
        write: bool,
        snapshot: bool,
        deadline: float | None,
        operation: bool,
    ) -> T:
        """Run ``fn`` as one one-call unit on ``driver`` (``pooled``: its pool connection).

        A retry near the operation's ``deadline`` waits for locks only for
        what is left of it (``StoreBusy`` once nothing is). A write unit is
        begun (``snapshot``), run and committed; a read ends its snapshot.
        On an error the connection is discarded (:func:`_discard_lost` for
        ``ConnectionLost``; ``CommitOutcomeUnknown``: its state is unknown)
        or rolled back, and the error raised as it came.
        """
        busy = self._settings.busy_timeout_ms
        limit = None
        if deadline is not None and write and busy is not None:
            left_ms = (deadline - time.monotonic()) * 1000
            if left_ms < busy - _LOCK_WAIT_SLACK_MS:  # a retry: wait only what is left
                if left_ms <= 0:
                    raise StoreBusy("the operation's busy timeout passed before this attempt")
                limit = int(left_ms)
        try:
            if limit is not None and not driver.postgres:
                driver.limit_lock_wait(limit)
            if snapshot:  # a write's BEGIN IMMEDIATE, unless _call_operation(begin=False)
                driver.begin(write=write)  # may open the driver's transaction
            if limit is not None and driver.postgres:
                driver.limit_lock_wait(limit)
            result = fn(self.repositories(driver, write=write, nested=not operation))
            if write:
                driver.commit()
            else:
                _end_read(driver, pooled)
        except ConnectionLost as lost:
            _discard_lost(self, pooled, lost)
            raise
        except CommitOutcomeUnknown:
            pooled.invalidate()  # its state is unknown: never back to the pool
            raise
        except BaseException as exc:
            _rollback_or_discard(driver, pooled, exc)
            raise
        finally:
            if limit is not None and not driver.postgres and pooled.is_valid:
                driver.restore_lock_wait(busy)  # type: ignore[arg-type]
        return result

    def pooled_driver(self) -> AbstractContextManager[tuple[db.Driver, Any]]:
        """A pooled connection's :class:`~agentkeep.db.Driver`, outside any transaction.

        For operations that own their transaction's end (unregister
        finalization commits, then classifies an unacknowledged COMMIT).
        Yields the driver and the pool's connection record (``invalidate()``
        it to discard a connection whose state is unknown). Most code wants
        :meth:`call_write` instead.

        Raises:
            DatabaseError: connecting failed (StoreBusy if transient).
        """
        return _PooledDriver(self, False)

    def repositories(self, driver: db.Driver, *, write: bool, nested: bool = False) -> Repositories:
        """The repositories of a one-call unit on ``driver`` (see :meth:`pooled_driver`).

        ``nested``: operations that can fail after writing run in a SAVEPOINT
        (for a caller that may catch their errors and still commit).
        """
        return Repositories(
            driver,
            self.clock,
            writable=write,
            nested=nested,
            runtime_domain=self.runtime_domain,
            oauth_codec=self.oauth_codec,
        )

    @property
    def compile_target(self) -> CompileTarget:
        """What this store's statements are compiled for (dialect, paramstyle, namespace).

        Built after the first connection, when the dialect knows the server
        version. In a namespace its schema map is ``{None: schema}``.
        """
        target = self._target
        if target is None:
            target = self._target = CompileTarget.of(
                self.engine.dialect, db.schema_map(self.schema)
            )
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
        """Release every pooled connection of an engine the store created.

        An engine the host gave (``Store.open(engine)``, ``Store(engine)``)
        is left as it is: the host disposes it.
        """
        _release_parked(self._parked)
        if self._owns_engine:
            self.engine.dispose()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: A one-call attempt that starts with less than the busy timeout minus this
#: left before its deadline is a retry: its lock waits are cut to what is left.
_LOCK_WAIT_SLACK_MS = 50


class _PooledDriver:
    """:meth:`Store.pooled_driver`: a pooled connection and its lean driver, for one unit.

    A plain class rather than a generator context manager: every one-call
    unit that finds no parked connection enters one (:meth:`Store._lean_unit`,
    which takes a parked one itself), and this is the cheaper of the two.

    Enter: takes the store's mutex (in-memory SQLite only), checks a
    connection out of the engine's pool and switches it to the lean mode
    (:meth:`agentkeep.db.Driver.enter_lean`). Exit: switches it back (a
    connection that refuses is discarded, never pooled in autocommit mode)
    and returns it to the pool. The unit's transaction is the caller's: it is
    ended (committed or rolled back) before the exit.

    With ``park`` (one-call units of a store that parks, see
    :meth:`Store._park_connections`): enter takes the parked connection and
    driver when there is one; exit parks a valid connection outside any
    transaction when none is parked, and returns it to the pool otherwise.
    """

    __slots__ = ("_mutex", "_park", "_pooled", "_driver", "_store")

    def __init__(self, store: Store, park: bool) -> None:
        self._store = store
        self._park = park
        self._mutex: AbstractContextManager[Any] | None = None
        self._pooled: Any = None
        self._driver: db.Driver | None = None

    def __enter__(self) -> tuple[db.Driver, Any]:
        store = self._store
        if self._park and store._parked:
            try:
                pooled, driver = store._parked.pop()
            except IndexError:  # another thread took it
                pass
            else:
                self._pooled = pooled
                self._driver = driver
                return driver, pooled
        if store._mutex is not nullcontext:
            self._mutex = mutex = store._mutex()
            mutex.__enter__()
        try:
            try:
                pooled = store.engine.raw_connection()
            except sa_exc.DBAPIError as exc:
                raise db.translate_db_error(exc) from exc
            try:
                driver = store._driver(pooled.dbapi_connection, lean=True)
                driver.enter_lean()
            except BaseException:
                pooled.close()
                raise
        except BaseException:
            self._release_mutex()
            raise
        self._pooled = pooled
        self._driver = driver
        return driver, pooled

    def __exit__(self, *exc: object) -> None:
        pooled = self._pooled
        driver = self._driver
        assert driver is not None  # set with _pooled
        try:
            if self._park:
                _park_or_return(self._store, pooled, driver)
            else:
                _return_to_pool(pooled, driver)
        finally:
            self._release_mutex()

    def _release_mutex(self) -> None:
        mutex, self._mutex = self._mutex, None
        if mutex is not None:
            mutex.__exit__(None, None, None)


#: Connections a store parks at most (``Store._park_connections``).
_PARKED_MAX = 2


def _park_or_return(store: Store, pooled: Any, driver: db.Driver) -> None:
    """End a one-call unit's use of its connection on a store that parks (its unit ended).

    Parks a valid connection outside any transaction when fewer than
    :data:`_PARKED_MAX` are parked (a failed end of the unit discards the
    connection, which is then not valid) and the pool is below its limit
    (``Store._park_limit``); returns it to the pool otherwise
    (:func:`_return_to_pool`).

    At the pool's limit every connection it may open is checked out: a unit
    may then be waiting for one (``store.write()``, or a one-call unit that
    found nothing parked), and a parked connection never reaches it (it goes
    to the next one-call unit, not back to the pool), so it goes back to the
    pool instead. Below the limit a parked connection takes one place of the
    pool's, never the last one: a pool of one connection never parks.
    """
    parked = store._parked
    limit = store._park_limit
    if (
        pooled.is_valid
        and len(parked) < _PARKED_MAX
        and driver.outside_transaction()
        and (limit is None or _below_limit(store.engine.pool, limit))
    ):
        driver.park()
        parked.append((pooled, driver))
        return
    _return_to_pool(pooled, driver)


def _below_limit(pool: Any, limit: int) -> bool:
    """The QueuePool ``pool`` has fewer than ``limit`` (its size + overflow) checked out.

    ``checkedout()`` is ``size - idle + overflow``, so ``overflow`` (the
    connections opened, less the size) below the pool's ``max_overflow``
    already means fewer than ``limit``; only a pool that opened all it may
    open is counted. Both are read without the pool's locks, as
    ``checkedout()`` always was: another thread may check a connection out
    right after, so the answer is a snapshot, not a reservation.
    """
    return bool(pool._overflow < pool._max_overflow or pool.checkedout() < limit)


def _return_to_pool(pooled: Any, driver: db.Driver) -> None:
    """Switch a lean unit's connection back from the lean mode and return it to the pool.

    A valid connection that refuses the switch is discarded: never pooled in
    autocommit mode.
    """
    try:
        if pooled.is_valid:
            try:
                driver.leave_lean()
            except DatabaseError:  # dead: never pooled in autocommit mode
                pooled.invalidate()
    finally:
        pooled.close()


#: The stores that park connections (weakly): a forked child forgets theirs.
_PARKING: weakref.WeakSet[Store] = weakref.WeakSet()
#: The parked connections a forked child inherited: kept referenced and never used.
_INHERITED: list[tuple[Any, db.Driver]] = []


def _forget_parked_after_fork() -> None:
    """In a forked child: never use, close or return a connection parked in the parent.

    Its socket (or SQLite handle) is the parent's: a unit of the child on it
    would interleave with the parent's on one Postgres connection, and
    closing it, or returning it to the pool, would end or hand out the
    parent's connection. It is kept referenced, so that no finalizer of the
    child's ever closes it; the child's units open connections of their own.
    (Connections idle in the pool are SQLAlchemy's to handle after a fork:
    ``engine.dispose(close=False)`` in the child.)
    """
    for store in list(_PARKING):
        for _pooled, driver in store._parked:
            if driver.postgres:
                _detach_socket(driver.raw)
        _INHERITED.extend(store._parked)
        store._parked.clear()


def _detach_socket(raw: Any) -> None:
    """Point a forked child's copy of a psycopg connection's socket at ``/dev/null``.

    The descriptor number stays taken (no later socket of the child gets
    it), and whatever libpq writes on it from now on (the ``Terminate`` it
    sends when the object is freed at the child's exit) goes nowhere, not
    to the parent's server session.
    """
    try:
        fd = raw.pgconn.socket
    except Exception:  # noqa: BLE001 - a closed or odd connection: nothing to detach
        return
    null = os.open(os.devnull, os.O_RDWR)
    try:
        os.dup2(null, fd)
    finally:
        os.close(null)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_parked_after_fork)


def _discard_lost(store: Store, pooled: Any, lost: ConnectionLost) -> None:
    """Discard the connection a one-call unit lost (:class:`ConnectionLost`), never to be reused.

    After a disconnect its peers may be dead too (a server restart): SQLAlchemy's
    own rule, every connection of the pool opened before now is replaced on its
    next checkout (the parked ones go back to the pool for that). When only
    this connection became unusable while the server answered
    (``lost.only_this_connection``), only it is discarded.
    """
    if lost.only_this_connection:
        pooled.invalidate(lost)
        return
    store.engine.pool._invalidate(pooled, lost)
    _release_parked(store._parked)


def _release_parked(parked: list[tuple[Any, db.Driver]]) -> None:
    """Return the parked connections to the pool (:meth:`Store.close`, a lost connection, GC).

    Each as any lean unit's connection (:func:`_return_to_pool`): a parked
    Postgres connection is still in autocommit mode, and is switched back
    first (or discarded).
    """
    while parked:
        try:
            pooled, driver = parked.pop()
        except IndexError:
            return
        _return_to_pool(pooled, driver)


def _end_read(driver: db.Driver, pooled: Any) -> None:
    """End a one-call read unit, whose result is already read.

    The unit wrote nothing (its repositories refuse writes), so its COMMIT
    only ends the snapshot the result was read in: when the connection is
    lost while COMMIT is in flight there is no outcome to be unsure of, and
    the result stands. The connection, in an unknown state, is discarded.
    """
    try:
        driver.commit()
    except CommitOutcomeUnknown:
        pooled.invalidate()


def _rollback_or_discard(driver: db.Driver, pooled: Any, error: BaseException) -> None:
    """Roll a failed unit back; a connection whose state is unknown is discarded.

    Called while the unit's own ``error`` propagates: a failing rollback (a
    dead connection) must not replace that error, and the connection, whose
    transaction state is unknown, must not go back to the pool.

    Nor may a Postgres connection whose driver call was interrupted
    (``error`` is not an ``Exception``: an asyncio cancellation,
    KeyboardInterrupt): the driver may have sent a statement whose outcome it
    never read, and its own idea of the transaction can be wrong (asyncpg
    interrupted in its implicit ``BEGIN`` believes no transaction is open, so
    a rollback does nothing and the next units on the connection would run,
    and "commit", inside that stale transaction). SQLAlchemy invalidates a
    connection in that case for the statements it runs; agentkeep's
    statements go straight to the driver, so it does the same here (the
    server rolls back when the connection closes). A SQLite connection is
    rolled back instead: it knows its transaction (sqlite3 asks the library;
    aiosqlite finishes a statement before the rollback runs on its thread),
    and closing it would not end the transaction while a cursor of it is
    still referenced (sqlite3 then leaves the connection open, holding the
    write lock, until the cursor is collected). Its last cursor is closed
    first, so that no statement of the unit stays in progress; a connection
    that refused a COMMIT because a statement of an earlier unit is still in
    progress is rolled back, then discarded.
    """
    if not isinstance(error, Exception) and driver.postgres:
        pooled.invalidate()
        return
    if not driver.postgres:
        driver.close_cursor()  # no statement of the unit stays in progress on the connection
    db.rollback_after(error, driver.rollback, pooled.invalidate)
    if not driver.postgres and "statements in progress" in str(error):
        # A statement of an earlier unit is still in progress on this connection
        # (its cursor lives on somewhere): never reuse it; the retry gets another.
        pooled.invalidate()


def _commit_failure(conn: Connection, exc: sa_exc.DBAPIError) -> DatabaseError:
    """:meth:`agentkeep.db.Driver.commit_failure` for a unit on a SQLAlchemy Connection."""
    if exc.connection_invalidated:
        observability.commit_outcome_unknown("unit of work", str(exc.orig))
        return CommitOutcomeUnknown("unit of work", detail=str(exc.orig))
    try:
        raw = conn.connection.dbapi_connection
    except sa_exc.SQLAlchemyError:
        observability.commit_outcome_unknown("unit of work", str(exc.orig))
        return CommitOutcomeUnknown("unit of work", detail=str(exc.orig))
    driver = db.Driver(raw, CompileTarget.of(conn.dialect), conn.dialect.loaded_dbapi.Error)
    failure = driver.commit_failure(exc.orig if exc.orig is not None else exc)  # logs it
    if isinstance(failure, CommitOutcomeUnknown):
        return CommitOutcomeUnknown("unit of work", detail=failure.detail)
    return failure


def _rollback_connection(conn: Connection, error: BaseException) -> None:
    """:func:`_rollback_or_discard` for a unit on a SQLAlchemy Connection."""
    if not isinstance(error, Exception) and db.is_postgres(conn):
        conn.invalidate()
        return
    db.rollback_after(error, conn.rollback, conn.invalidate)


def _refuse_async(url: object) -> None:
    """Store is the synchronous facade: an AsyncEngine or asyncio driver belongs to AsyncStore."""
    name = None
    if isinstance(url, Engine):
        name = url.dialect.driver if url.dialect.is_async else None
    elif isinstance(url, (str, URL)):
        try:
            parsed = make_url(url)
        except sa_exc.ArgumentError:
            return  # create_engine reports it
        name = parsed.get_driver_name() if parsed.get_driver_name() in db.ASYNC_DRIVERS else None
    elif type(url).__name__ == "AsyncEngine":
        name = "AsyncEngine"
    if name is not None:
        raise InvalidInput(
            "url",
            f"{name} is asyncio: open it with agentkeep.AsyncStore.open (Store is synchronous)",
        )


def _check_open_options(
    retry_attempts: int,
    auto_gc_every_commits: int | None,
    schema: str | None,
    oauth_codec: object,
    limits: object,
) -> None:
    """The checks of the options :meth:`Store.open` and ``AsyncStore.open`` share.

    Raises:
        InvalidInput: a refused option; nothing was opened.
    """
    _check_options(retry_attempts, auto_gc_every_commits)
    db.check_schema_name(schema)
    _check_codec(oauth_codec)
    _check_limits(limits)


def _refuse_memory_schema(schema: str | None, url: str) -> None:
    """Refuse a namespace on an in-memory SQLite database (it has no file to keep it in)."""
    if schema is not None and db.is_memory_sqlite(url):
        raise InvalidInput(
            "schema",
            "an in-memory SQLite database has no file to keep the namespace in: "
            "use a database file (or no schema)",
        )


def _check_options(retry_attempts: int, auto_gc_every_commits: int | None) -> None:
    if retry_attempts < 1:
        raise InvalidInput("retry_attempts", "must be >= 1")
    if auto_gc_every_commits is not None and (
        type(auto_gc_every_commits) is not int or auto_gc_every_commits < 1
    ):
        raise InvalidInput("auto_gc_every_commits", "must be None or an integer >= 1")


def _check_codec(codec: object) -> None:
    if codec is None:
        return
    if not (callable(getattr(codec, "encode", None)) and callable(getattr(codec, "decode", None))):
        raise InvalidInput(
            "oauth_codec",
            f"{type(codec).__name__} is not a codec: it needs encode(bytes) -> bytes and "
            "decode(bytes) -> bytes (see agentkeep.crypto.PayloadCodec)",
        )


def _check_limits(limits: object) -> None:
    if limits is not None and not isinstance(limits, Limits):
        raise InvalidInput(
            "limits", f"expected an agentkeep.Limits or None, got {type(limits).__name__}"
        )


def _is_memory(engine: Engine) -> bool:
    return engine.dialect.name == "sqlite" and db.is_memory_sqlite(
        engine.url.render_as_string(hide_password=False)
    )
