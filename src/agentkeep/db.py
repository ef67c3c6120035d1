"""Engines, dialect differences, the aggregate write lock and transient-error retry.

This is the only module that knows dialect settings. Repositories never branch
on the dialect name; what differs between SQLite and Postgres is behind the
functions here.

SQLite (the recipe that gives SQLAlchemy and pysqlite real transactions;
docs/architecture.md#sqlite-and-postgres): the driver's
own transaction handling is switched off in the ``connect`` hook
(``autocommit = LEGACY_TRANSACTION_CONTROL`` where it exists, then
``isolation_level = None``) and a ``begin`` hook emits ``BEGIN <mode>`` from
the execution option ``sqlite_begin``. Write units run on
``engine.execution_options(sqlite_begin="IMMEDIATE")`` so the write lock is
taken before the first read; read units get a deferred ``BEGIN`` (one WAL
snapshot). The engine is never given ``isolation_level`` (that would re-enable
the driver's implicit BEGIN).

Postgres (psycopg 3): READ COMMITTED set explicitly (fenced UPDATEs rely on a
blocked writer re-checking its predicate), no pool pre-ping (a connection
found dead by a unit's first statement is :class:`ConnectionLost`, and a
one-call operation runs again on a new one), ``lock_timeout``
equal to the SQLite busy timeout. The aggregate write lock is
``pg_advisory_xact_lock(namespace, hash(key))`` taken before the first read of
a write operation (docs/decisions.md#one-write-lock-per-aggregate); on
SQLite ``BEGIN IMMEDIATE`` already is that lock and :func:`lock_aggregate`
does nothing.

A host application's own engine (``Store.open(engine)``) is made fit for the
same units by :func:`adopt_engine` without changing how the host's own
transactions behave: see its docstring for what is installed, applied,
verified and refused on each dialect. :func:`join_write` and
:func:`join_read` prepare a transaction the host already holds for a joined
unit.

Namespaces (``schema=``): agentkeep's tables may live apart from a host's
tables of the same names. Statements are compiled with the schema map
``{None: schema}`` (:mod:`agentkeep.statements`). On Postgres that is a
schema of the database. On SQLite it is a database file attached under the
schema's name to every connection (:func:`attach_schema`), next to the main
file: ``app.db`` with ``schema="agentkeep"`` keeps agentkeep's tables in
``app.agentkeep.db``. :func:`check_schema_name` says which names are accepted
(docs/architecture.md#namespaces).
"""

from __future__ import annotations

import functools
import itertools
import os
import random
import re
import select as _select
import sqlite3
import threading
import time
import weakref
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, NamedTuple, TypeVar

from sqlalchemy import Connection, Engine, bindparam, event, false, func, select, update
from sqlalchemy import create_engine as sa_create_engine
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import URL, make_url
from sqlalchemy.pool import StaticPool
from sqlalchemy.util import await_

from agentkeep import observability
from agentkeep.errors import (
    AgentkeepError,
    CommitOutcomeUnknown,
    ConnectionLost,
    DatabaseError,
    DatabaseUnavailable,
    InvalidInput,
    JoinedTransactionStale,
    MissingDependency,
    StoreBusy,
    TransactionAborted,
)
from agentkeep.limits import DEFAULT_LIMITS, ColumnKind, Limits
from agentkeep.observability import current_operation
from agentkeep.runs.models import Run
from agentkeep.statements import Compiled, CompileTarget, Statement
from agentkeep.text import check_text

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine
    from sqlalchemy.sql.selectable import CTE

__all__ = [
    "ASYNC_DRIVERS",
    "DEFAULT_BUSY_TIMEOUT_MS",
    "EngineSettings",
    "LockNamespace",
    "adopt_engine",
    "aggregate_try_lock_cte",
    "aggregate_lock_params",
    "attach_schema",
    "check_schema_name",
    "create_private_file",
    "check_url",
    "create_async_engine",
    "create_engine",
    "enable_wal",
    "ensure_attached",
    "engine_settings",
    "CommitWatch",
    "Answered",
    "Driver",
    "PrefetchCheckFailed",
    "is_memory_sqlite",
    "is_postgres",
    "is_autocommit",
    "is_transient",
    "join_read",
    "join_write",
    "lock_aggregate",
    "lock_aggregate_and_blobs",
    "mask_url",
    "migration_lock_key",
    "open_failure",
    "opening",
    "read_engine",
    "retry_transient",
    "rollback_after",
    "savepoint",
    "schema_map",
    "sqlite_file",
    "sqlite_schema_file",
    "plain_sql",
    "PRIVATE_FILE_MODE",
    "sqlite_creates_file",
    "sqlite_in_transaction",
    "translate_db_error",
    "watch_commit",
    "write_engine",
]

T = TypeVar("T")

#: Default wait for a lock: SQLite ``busy_timeout`` and Postgres ``lock_timeout``.
DEFAULT_BUSY_TIMEOUT_MS: Final = 30_000

_BEGIN_MODES: Final = frozenset({"DEFERRED", "IMMEDIATE", "EXCLUSIVE"})
_BEGIN_SQL: Final = {mode: f"BEGIN {mode}" for mode in _BEGIN_MODES}
_SYNCHRONOUS: Final = frozenset({"OFF", "NORMAL", "FULL", "EXTRA"})
# RETURNING needs 3.35; ON CONFLICT upsert 3.24.
_MIN_SQLITE: Final = (3, 35, 0)


class LockNamespace:
    """The first key of ``pg_advisory_xact_lock(int4, int4)``, one per aggregate kind.

    Constants are arbitrary but fixed forever: changing one would let an old
    and a new process hold "the same" lock at once.
    """

    MIGRATION: Final = 0x61_6B_00_01
    RUN: Final = 0x61_6B_00_10
    SESSION: Final = 0x61_6B_00_20
    RUNTIME: Final = 0x61_6B_00_30
    MOB: Final = 0x61_6B_00_31
    OAUTH: Final = 0x61_6B_00_32
    #: Blob garbage collection: commits hold it shared, GC exclusive (key "blobs").
    BLOB_GC: Final = 0x61_6B_00_21


def is_postgres(bind: Engine | Connection) -> bool:
    """True if ``bind`` talks to Postgres."""
    return bind.dialect.name == "postgresql"


def is_memory_sqlite(url: str) -> bool:
    """True for an in-memory SQLite URL (``sqlite://``, ``sqlite:///:memory:``)."""
    u = make_url(url)
    if u.get_backend_name() != "sqlite":
        return False
    db = u.database or ""
    return db in ("", ":memory:") or "mode=memory" in str(u.query.get("mode", ""))


_SCHEMA_NAME: Final = re.compile(r"[a-z_][a-z0-9_]{0,62}")
#: Names that are already something else: SQLite's own schemas, Postgres's default
#: and system schemas.
_RESERVED_SCHEMAS: Final = frozenset({"main", "temp", "public", "information_schema"})


def check_schema_name(schema: str | None) -> str | None:
    """Return ``schema`` if it is an acceptable namespace for agentkeep's tables.

    ``None`` is the default namespace (the original stores' table names, no
    schema). A name is lower-case letters, digits and ``_``, starting with a
    letter or ``_``, at most 63 characters (Postgres's identifier limit), so
    it never needs quoting; ``main``, ``temp``, ``public``,
    ``information_schema`` and names starting with ``pg_`` or ``sqlite_`` are
    taken by the databases themselves.

    Raises:
        InvalidInput: any other value.
    """
    if schema is None:
        return None
    if not isinstance(schema, str) or not _SCHEMA_NAME.fullmatch(schema):
        raise InvalidInput(
            "schema",
            f"{schema!r} is not a namespace name: lower-case letters, digits and _, "
            "starting with a letter or _, at most 63 characters",
        )
    if schema in _RESERVED_SCHEMAS or schema.startswith(("pg_", "sqlite_")):
        raise InvalidInput(
            "schema",
            f"{schema!r} is a name the database uses itself"
            + (": omit schema= for the default namespace" if schema == "public" else ""),
        )
    return schema


def schema_map(schema: str | None) -> dict[str | None, str | None] | None:
    """The ``schema_translate_map`` that puts agentkeep's tables into ``schema`` (None: none)."""
    return None if schema is None else {None: schema}


#: The mode of a SQLite file agentkeep creates (before the process umask): owner-only.
PRIVATE_FILE_MODE: Final = 0o600


def create_private_file(path: str | os.PathLike[str]) -> bool:
    """Create ``path`` as an empty file with mode :data:`PRIVATE_FILE_MODE`, unless it exists.

    SQLite takes an empty file for an empty database, and gives the
    ``-wal``, ``-shm`` and ``-journal`` files it creates next to a database
    the permission bits of the database file; creating the file first is how
    a new database and its companions get mode 0600 instead of 0644. The
    create is exclusive (``O_CREAT | O_EXCL``): a file that exists, a
    symbolic link included, is left exactly as it is (its mode is never
    changed), and when two processes create the same file at once, one
    creates it and the other finds it. The process umask still applies. On
    Windows the mode is ignored (the file gets the default ACL).

    Returns:
        True if this call created the file, False if something was already there.

    Raises:
        OSError: the file could not be created (a missing directory, a
            read-only file system, no permission).
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, PRIVATE_FILE_MODE)
    except FileExistsError:
        return False
    os.close(fd)
    return True


def sqlite_creates_file(database: object, *, uri: bool = False) -> str | None:
    """The file ``sqlite3.connect(database, uri=uri)`` would create if missing, or None.

    None for an in-memory or temporary database (``:memory:``, ``""``), and
    for a URI filename (``uri=True`` and ``file:...``) that does not create
    files: ``mode=ro``, ``mode=rw``, ``mode=memory``, ``immutable=``, a
    ``vfs=`` of its own, or an authority other than ``localhost``. The path
    of a URI filename is percent-decoded as SQLite does; a relative path is
    relative to the working directory, as for SQLite.
    """
    if isinstance(database, os.PathLike):
        database = os.fspath(database)
    if not isinstance(database, str):
        return None  # bytes names and anything else: left to SQLite
    if uri and database.startswith("file:"):
        return _sqlite_uri_file(database[len("file:") :])
    return None if database in ("", ":memory:") else database


def _sqlite_uri_file(rest: str) -> str | None:
    """The file of a SQLite URI filename (after ``file:``) that may be created, or None."""
    from urllib.parse import unquote

    rest = rest.split("#", 1)[0]
    path, _, query = rest.partition("?")
    if path.startswith("//"):
        authority, slash, tail = path[2:].partition("/")
        if authority not in ("", "localhost"):
            return None
        path = slash + tail
    for pair in query.split("&") if query else ():
        key, _, value = pair.partition("=")
        key, value = unquote(key), unquote(value)
        if key == "mode" and value != "rwc":
            return None  # ro, rw and memory never create a file
        if key in ("vfs", "immutable"):
            return None
    path = unquote(path)
    return None if path in ("", ":memory:") else path


def _create_missing_database(dialect: Any, record: Any, cargs: Any, cparams: Any) -> None:
    """``do_connect`` hook of agentkeep's SQLite engines: a missing file is created 0600 first.

    Failing to create it (a missing directory, a read-only file system) is
    left to SQLite, which reports it when it opens the file.
    """
    if os.name == "nt":
        return  # the mode has no effect there
    database = cargs[0] if cargs else cparams.get("database")
    path = sqlite_creates_file(database, uri=bool(cparams.get("uri", False)))
    if path is not None:
        try:
            create_private_file(path)
        except OSError:
            pass


def sqlite_schema_file(database: str | Path, schema: str) -> Path:
    """The file that holds namespace ``schema`` of the SQLite database file ``database``.

    Next to it, the schema's name before the suffix: ``app.db`` ->
    ``app.agentkeep.db``, ``data`` -> ``data.agentkeep``.
    """
    path = Path(database)
    return path.with_name(f"{path.stem}.{schema}{path.suffix}")


@dataclass(frozen=True)
class EngineSettings:
    """What agentkeep applied to, or found on, an engine its units run on.

    Attributes:
        owned: built by :func:`create_engine` (every setting applied at connect).
        busy_timeout_ms: SQLite: the ``busy_timeout`` of every connection.
            Postgres: the ``lock_timeout`` of an owned engine; for a host's
            engine, whose own setting stands, the ``lock_timeout`` its
            connection had when it was adopted (None: 0, no limit). It is
            the one deadline of a one-call operation (``Store._deadline``).
        synchronous: SQLite ``PRAGMA synchronous`` applied to every connection,
            or None where the connections keep their own.
        pg_read_committed: Postgres: the engine's transactions are not READ
            COMMITTED by default, so agentkeep's write units ask for it per
            transaction (a host engine configured otherwise).
    """

    owned: bool
    busy_timeout_ms: int | None
    synchronous: str | None
    pg_read_committed: bool = False


#: Every engine agentkeep runs on, with what it applied or found (see adopt_engine).
_SETTINGS: weakref.WeakKeyDictionary[Engine, EngineSettings] = weakref.WeakKeyDictionary()
_ADOPTING: Final = threading.Lock()  # two stores opening one engine adopt it once
_CONFIGURED: Final = "agentkeep.configured"
#: The drivers the lean path runs its statements on (connection.execute, error classes).
_DRIVERS: Final = {
    "sqlite": frozenset({"pysqlite", "aiosqlite"}),
    "postgresql": frozenset({"psycopg", "psycopg_async", "asyncpg"}),
}
#: The async drivers (an AsyncEngine's ``sync_engine`` runs on them; see agentkeep.aio).
ASYNC_DRIVERS: Final = frozenset({"aiosqlite", "psycopg_async", "asyncpg"})
#: SQLite: the namespaces attached to every connection of an engine (see attach_schema).
_ATTACHED_SCHEMAS: weakref.WeakKeyDictionary[Engine, set[str]] = weakref.WeakKeyDictionary()
#: Pool record info key: the namespaces attached to that driver connection.
_ATTACHED: Final = "agentkeep.attached"


def create_engine(
    url: str,
    *,
    busy_timeout_ms: int = DEFAULT_BUSY_TIMEOUT_MS,
    synchronous: str = "NORMAL",
    **engine_kwargs: Any,
) -> Engine:
    """Build an engine configured for agentkeep's units of work.

    Args:
        url: a SQLAlchemy URL (``sqlite:///path.db``, ``sqlite://`` for memory,
            ``postgresql+psycopg://user@host/db``). ``postgresql://`` is taken as psycopg 3.
        busy_timeout_ms: how long a writer waits for a lock before
            :class:`~agentkeep.errors.StoreBusy` (SQLite ``busy_timeout``,
            Postgres ``lock_timeout``).
        synchronous: SQLite ``PRAGMA synchronous`` (``NORMAL`` or ``FULL``).
            With WAL, NORMAL survives an application crash but may lose the
            last commits on power loss; choose FULL when that matters.
        **engine_kwargs: passed to :func:`sqlalchemy.create_engine`.

    Returns:
        The engine. Use :func:`write_engine` for write units.

    Raises:
        InvalidInput: for an unsupported backend or option.
    """
    if busy_timeout_ms < 0:
        raise InvalidInput("busy_timeout_ms", "must be >= 0")
    u = check_url(url)
    backend = u.get_backend_name()
    if u.get_driver_name() in ASYNC_DRIVERS:
        raise InvalidInput(
            "url",
            f"{u.drivername} is an asyncio driver: open it with agentkeep.AsyncStore.open "
            "(or agentkeep.db.create_async_engine)",
        )
    if backend == "sqlite":
        sync = _check_synchronous(synchronous)
        engine: Engine = _create_sqlite_engine(url, busy_timeout_ms, sync, engine_kwargs)
        _SETTINGS[engine] = EngineSettings(True, busy_timeout_ms, sync)
        return engine
    if backend == "postgresql":
        if u.drivername == "postgresql":
            u = u.set(drivername="postgresql+psycopg")
        engine = _create_postgres_engine(
            u.render_as_string(hide_password=False), busy_timeout_ms, engine_kwargs
        )
        _SETTINGS[engine] = EngineSettings(True, busy_timeout_ms, None)
        return engine
    raise InvalidInput("url", f"unsupported backend {backend!r}: use sqlite or postgresql")


def create_async_engine(
    url: str,
    *,
    busy_timeout_ms: int = DEFAULT_BUSY_TIMEOUT_MS,
    synchronous: str = "NORMAL",
    **engine_kwargs: Any,
) -> AsyncEngine:
    """Build an :class:`~sqlalchemy.ext.asyncio.AsyncEngine` configured like :func:`create_engine`.

    The same settings on the asyncio drivers: ``sqlite+aiosqlite`` (the
    driver's own transaction handling off, ``BEGIN <mode>`` from the ``begin``
    hook, busy timeout, ``foreign_keys``, ``synchronous``),
    ``postgresql+asyncpg`` and ``postgresql+psycopg_async`` (READ COMMITTED,
    ``lock_timeout`` = ``busy_timeout_ms``). The hooks are installed on its
    ``sync_engine``, which agentkeep's repositories run on through
    SQLAlchemy's greenlet bridge (:mod:`agentkeep.aio`).

    Raises:
        InvalidInput: a URL whose driver is not one of the three.
    """
    from sqlalchemy.ext.asyncio import create_async_engine as sa_create_async_engine

    _require_async_driver(url)
    if busy_timeout_ms < 0:
        raise InvalidInput("busy_timeout_ms", "must be >= 0")
    u = check_url(url)
    backend, driver = u.get_backend_name(), u.get_driver_name()
    if driver not in ASYNC_DRIVERS or driver not in _DRIVERS.get(backend, ()):
        raise InvalidInput(
            "url",
            f"{u.drivername} is not an asyncio driver agentkeep runs on: use "
            "sqlite+aiosqlite, postgresql+asyncpg or postgresql+psycopg_async",
        )
    engine: AsyncEngine
    if backend == "sqlite":
        sync = _check_synchronous(synchronous)
        engine = _create_sqlite_engine(
            url, busy_timeout_ms, sync, engine_kwargs, make=sa_create_async_engine
        )
        _SETTINGS[engine.sync_engine] = EngineSettings(True, busy_timeout_ms, sync)
        return engine
    engine = _create_postgres_engine(
        url,
        busy_timeout_ms,
        engine_kwargs,
        make=sa_create_async_engine,
        asyncpg=driver == "asyncpg",
    )
    _SETTINGS[engine.sync_engine] = EngineSettings(True, busy_timeout_ms, None)
    return engine


#: The extra that installs each asyncio driver (and greenlet, SQLAlchemy's bridge).
_ASYNC_EXTRA: Final = {"aiosqlite": "aiosqlite", "asyncpg": "asyncpg", "psycopg_async": "postgres"}


def _require_async_driver(url: str) -> None:
    """Raise :class:`MissingDependency` when the URL's asyncio driver or greenlet is missing."""
    driver = make_url(url).get_driver_name()
    extra = _ASYNC_EXTRA.get(driver)
    if extra is None:
        return
    package = "psycopg" if driver == "psycopg_async" else driver
    for needed in (package, "greenlet"):
        try:
            __import__(needed)
        except ImportError as exc:
            raise MissingDependency(f"the {driver} driver", needed, extra) from exc


def _check_synchronous(synchronous: str) -> str:
    sync = synchronous.upper() if isinstance(synchronous, str) else ""
    if sync not in _SYNCHRONOUS:
        raise InvalidInput("synchronous", f"{synchronous!r} is not one of {sorted(_SYNCHRONOUS)}")
    return sync


def _check_sqlite_version() -> None:
    if sqlite3.sqlite_version_info < _MIN_SQLITE:
        raise DatabaseError(
            f"SQLite {sqlite3.sqlite_version} is too old: agentkeep needs >= "
            + ".".join(map(str, _MIN_SQLITE))
        )


def _create_sqlite_engine(
    url: str,
    busy_timeout_ms: int,
    synchronous: str,
    engine_kwargs: dict[str, Any],
    make: Callable[..., Any] = sa_create_engine,
) -> Any:
    _check_sqlite_version()
    memory = is_memory_sqlite(url)
    connect_args = dict(engine_kwargs.pop("connect_args", {}))
    connect_args.setdefault("check_same_thread", False)
    connect_args.setdefault("timeout", busy_timeout_ms / 1000)
    if memory:
        # One shared connection: the in-memory database lives in it. Callers
        # serialise units of work on it (Store holds a mutex).
        engine_kwargs.setdefault("poolclass", StaticPool)
    # sqlite3 takes :name parameters natively: statements are compiled in that
    # style, so a call binds its parameter dict as is.
    engine_kwargs.setdefault("paramstyle", "named")
    made = make(url, connect_args=connect_args, **engine_kwargs)
    engine: Engine = getattr(made, "sync_engine", made)  # an AsyncEngine's hooks go here
    if not memory:  # a new file is created 0600 (its -wal and -shm follow its mode)
        event.listen(engine, "do_connect", _create_missing_database)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        if hasattr(sqlite3, "LEGACY_TRANSACTION_CONTROL") and isinstance(
            dbapi_conn, sqlite3.Connection
        ):  # Python >= 3.12 (aiosqlite's connections keep sqlite3's default, this one)
            dbapi_conn.autocommit = sqlite3.LEGACY_TRANSACTION_CONTROL  # type: ignore[attr-defined]
        dbapi_conn.isolation_level = None  # the driver never emits BEGIN
        # journal_mode is NOT set here: it is stored in the file, and a legacy
        # file whose adoption is refused must stay byte-for-byte unchanged.
        # enable_wal() switches it once the schema is accepted.
        _sqlite_pragmas(dbapi_conn, busy_timeout_ms, synchronous)

    event.listen(engine, "begin", _sqlite_begin_hook("DEFERRED"))
    return made


#: ``Connection.info`` key: a statement of the current unit, run through SQLAlchemy on
#: this connection, failed (asyncpg; see watch_failed_statements).
_FAILED_STATEMENT: Final = "agentkeep_failed_statement"


def _note_failed_statement(context: Any) -> None:
    """``handle_error`` hook: mark the connection a statement failed on."""
    conn = context.connection
    if conn is not None:
        try:
            conn.info[_FAILED_STATEMENT] = True
        except Exception:  # noqa: BLE001 - an invalidated connection: its unit fails anyway
            pass


def watch_failed_statements(conn: Connection) -> None:
    """Start a write unit's record of statements that failed through ``conn`` (asyncpg).

    asyncpg keeps no failed-transaction state of its own, so
    :meth:`Driver.check_not_aborted` asks the server only after a statement
    of the unit failed: the unit's own statements tell the Driver, the
    statements of the code in the unit (``uow.connection``, ``uow.session``)
    are seen by a ``handle_error`` hook on the engine. Forgets failures of
    earlier units on the same pooled connection. Other drivers: nothing.
    """
    if conn.dialect.driver != "asyncpg":
        return
    engine = conn.engine
    if not event.contains(engine, "handle_error", _note_failed_statement):
        event.listen(engine, "handle_error", _note_failed_statement)
    conn.info.pop(_FAILED_STATEMENT, None)


def failed_statements(conn: Connection) -> bool:
    """True when a statement failed through ``conn`` since :func:`watch_failed_statements`."""
    return bool(conn.info.get(_FAILED_STATEMENT, False))


def _sqlite_pragmas(dbapi_conn: Any, busy_timeout_ms: int, synchronous: str | None) -> None:
    """The per-connection settings agentkeep needs (run outside a transaction)."""
    cur = dbapi_conn.cursor()
    try:
        cur.execute(f"PRAGMA busy_timeout={int(busy_timeout_ms)}")
        cur.execute("PRAGMA foreign_keys=ON")
        if synchronous is not None:
            cur.execute(f"PRAGMA synchronous={synchronous}")
    finally:
        cur.close()


def _sqlite3_connection(dbapi_conn: Any) -> Any:
    """The ``sqlite3.Connection`` under a DBAPI connection (pysqlite, or aiosqlite's adapter)."""
    if isinstance(dbapi_conn, sqlite3.Connection):
        return dbapi_conn
    inner = getattr(dbapi_conn, "_connection", None)  # SQLAlchemy's aiosqlite adapter
    return getattr(inner, "_conn", None)


def sqlite_in_transaction(dbapi_conn: Any) -> bool:
    """True if the SQLite DBAPI connection (pysqlite or aiosqlite's adapter) is in a transaction."""
    if isinstance(dbapi_conn, sqlite3.Connection):
        return dbapi_conn.in_transaction
    inner = getattr(dbapi_conn, "_connection", None)
    if inner is None:  # a wrapper around a sqlite3 connection (instrumentation, a recorder)
        return bool(dbapi_conn.in_transaction)
    return bool(inner.in_transaction)  # aiosqlite.Connection's own property


def _sqlite_total_changes(dbapi_conn: Any) -> int:
    if isinstance(dbapi_conn, sqlite3.Connection):
        return dbapi_conn.total_changes
    return int(dbapi_conn._connection.total_changes)


def plain_sql(dbapi_conn: Any, sql: str, params: Any = None) -> None:
    """Run one statement whose rows are not needed on a DBAPI connection (any driver)."""
    cur = dbapi_conn.cursor()
    try:
        if params is None:
            cur.execute(sql)
        else:
            cur.execute(sql, params)
    finally:
        cur.close()


def _sqlite_begin_hook(default: str | None) -> Callable[[Connection], None]:
    """The ``begin`` hook: ``BEGIN <mode>`` from the execution option ``sqlite_begin``.

    ``default`` is the mode of a transaction without the option: DEFERRED on
    agentkeep's own engines (whose driver never begins by itself), None on a
    host's engine (the host's transactions stay exactly as pysqlite runs them).
    When a BEGIN was already emitted (a host's own begin hook ran first), a
    writer takes the write lock with a no-op write instead: on a transaction
    that has not read yet, that waits for the lock like ``BEGIN IMMEDIATE``.
    The no-op write is on agentkeep's table in the unit's namespace (execution
    option ``agentkeep_schema``, set by :func:`write_engine`), so that it
    locks the file agentkeep's tables live in.
    """

    def _on_begin(conn: Connection) -> None:
        mode = conn.get_execution_options().get("sqlite_begin", default)
        if mode is None:
            return
        if mode not in _BEGIN_MODES:
            raise ValueError(f"sqlite_begin={mode!r}")
        # Straight to the driver: this runs once per unit of work, on the hot
        # path. SQLAlchemy does not wrap errors raised by a begin hook, so a
        # busy timeout is translated here (to the retryable StoreBusy).
        driver: Any = conn.connection.dbapi_connection
        try:
            if not sqlite_in_transaction(driver):
                plain_sql(driver, _BEGIN_SQL[mode])
            elif mode != "DEFERRED":
                schema = conn.get_execution_options().get("agentkeep_schema")
                target = CompileTarget.of(conn.dialect, schema_map(schema))
                form = _SQLITE_WRITE_LOCK.compiled(target)
                plain_sql(driver, form.sql, form.bind({}))
        except sqlite3.Error as exc:
            raise _translate_driver_error(exc) from exc

    return _on_begin


def attach_schema(engine: Engine, schema: str) -> None:
    """SQLite: attach namespace ``schema``'s file to every connection of ``engine`` (idempotent).

    The file is :func:`sqlite_schema_file` of the connection's main file; it
    is created empty, with mode 0600 (:func:`create_private_file`), if
    missing (the migrations fill it). ``ATTACH DATABASE
    '<file>' AS <schema>`` runs on every new connection (``connect``) and on
    every connection already pooled (``checkout``), and a synchronous setting
    agentkeep applies (``synchronous=``) is applied to the attached file too.
    The host's statements on those connections see the namespace as well
    (``<schema>.runs``); their own unqualified names are not affected.

    Postgres: nothing to do (a schema needs no attaching).

    Raises:
        InvalidInput: an in-memory SQLite database (no file to put the
            namespace next to), an invalid name, or an engine that agentkeep
            neither created nor adopted.
    """
    check_schema_name(schema)
    if engine.dialect.name != "sqlite":
        return
    settings = _SETTINGS.get(engine)
    if settings is None:
        raise InvalidInput("engine", "adopt it first (agentkeep.db.adopt_engine)")
    if is_memory_sqlite(engine.url.render_as_string(hide_password=False)):
        raise InvalidInput(
            "schema",
            "an in-memory SQLite database has no file to keep the namespace in: "
            "use a database file (or no schema)",
        )
    sync = settings.synchronous
    with _ADOPTING:
        schemas = _ATTACHED_SCHEMAS.setdefault(engine, set())
        if schema in schemas:
            return
        schemas.add(schema)

    def attach(dbapi_conn: Any, record: Any, *_proxy: Any) -> None:
        _attach(dbapi_conn, record.info, schema, sync)

    event.listen(engine, "connect", attach)
    event.listen(engine, "checkout", attach)


def ensure_attached(conn: Connection, schema: str | None) -> None:
    """SQLite: make sure ``schema`` is attached to the connection a joined unit runs on.

    A connection the host checked out before the store was opened missed the
    ``checkout`` hook of :func:`attach_schema`; it is attached now (SQLite
    allows that inside a transaction; the joined unit's write lock is then
    taken on the attached file).

    Raises:
        InvalidInput: SQLite refused to attach the file (the message says why).
    """
    if schema is None or conn.dialect.name != "sqlite":
        return
    info = conn.connection.info
    attached = info.get(_ATTACHED)
    if attached is not None and schema in attached:
        return
    driver: Any = conn.connection.dbapi_connection
    try:
        _attach(driver, info, schema, None)
    except sqlite3.OperationalError as exc:
        raise InvalidInput(
            "join",
            f"the host's connection does not have agentkeep's namespace {schema!r} attached "
            f"and SQLite refused to attach it ({exc}): open the store before checking out "
            "the connection",
        ) from exc


def _attach(dbapi_conn: Any, info: dict[Any, Any], schema: str, sync: str | None) -> None:
    attached = info.get(_ATTACHED)
    if attached is not None and schema in attached:
        return
    cur = dbapi_conn.cursor()
    try:
        cur.execute("PRAGMA database_list")
        files = {row[1]: row[2] for row in cur.fetchall()}
        main = files.get("main") or ""
        if not main:
            raise InvalidInput(
                "schema",
                "an in-memory SQLite database has no file to keep the namespace in",
            )
        want = str(sqlite_schema_file(main, schema))
        have = files.get(schema)
        if have is None:
            try:  # a new namespace file is 0600, like a database agentkeep creates
                create_private_file(want)
            except OSError:
                pass  # ATTACH reports why the file cannot be opened
            cur.execute(f'ATTACH DATABASE ? AS "{schema}"', (want,))
            if sync is not None:
                cur.execute(f'PRAGMA "{schema}".synchronous={sync}')
        elif have != want:
            raise InvalidInput(
                "schema",
                f"{schema!r} is already attached to {have} on this connection, not to {want}",
            )
    finally:
        cur.close()
    info.setdefault(_ATTACHED, set()).add(schema)


def _create_postgres_engine(
    url: str,
    busy_timeout_ms: int,
    engine_kwargs: dict[str, Any],
    make: Callable[..., Any] = sa_create_engine,
    *,
    asyncpg: bool = False,
) -> Any:
    connect_args = dict(engine_kwargs.pop("connect_args", {}))
    if asyncpg:  # asyncpg takes server settings, not libpq's options string
        settings = dict(connect_args.get("server_settings", {}))
        settings.setdefault("lock_timeout", str(int(busy_timeout_ms)))
        connect_args["server_settings"] = settings
    else:
        options = connect_args.get("options", "")
        connect_args["options"] = f"{options} -c lock_timeout={int(busy_timeout_ms)}".strip()
    # No pre-ping: it costs a round trip per checkout. A connection found dead
    # before COMMIT is ConnectionLost, which a one-call operation retries.
    engine_kwargs.setdefault("pool_pre_ping", False)
    # READ COMMITTED explicitly: a role default of REPEATABLE READ would turn
    # fenced UPDATEs into serialization failures instead of re-checks.
    engine_kwargs.setdefault("isolation_level", "READ COMMITTED")
    return make(url, connect_args=connect_args, **engine_kwargs)


# --------------------------------------------------------------------------
# A host application's engine


def adopt_engine(
    engine: Engine,
    *,
    busy_timeout_ms: int | None = None,
    synchronous: str | None = None,
) -> EngineSettings:
    """Make an engine the host application built fit for agentkeep's units (idempotent).

    Called by ``Store.open(engine)`` and ``Store(engine)``. An engine made by
    :func:`create_engine`, or adopted before, is returned as it is (settings
    given again must agree with the ones it has).

    SQLite (driver pysqlite). The host's own transactions keep pysqlite's
    behaviour (the driver begins a deferred transaction before the first
    write; a transaction that has only read holds no lock); agentkeep installs:

    * a ``begin`` hook that emits ``BEGIN <mode>`` only for connections
      carrying the execution option ``sqlite_begin``, which agentkeep's own
      units set (``IMMEDIATE`` for writes, ``DEFERRED`` for reads);
    * on every connection of the engine, also those already pooled:
      ``PRAGMA busy_timeout`` (``busy_timeout_ms``, default 30 s) and
      ``PRAGMA foreign_keys=ON`` (agentkeep's tables rely on ON DELETE
      CASCADE); ``PRAGMA synchronous`` only when ``synchronous`` is given.
      These are connection-wide: the host's statements get them too.

    Refused: another driver; on Python >= 3.12 a driver ``autocommit`` other
    than ``LEGACY_TRANSACTION_CONTROL`` (``connect_args={"autocommit": ...}``):
    agentkeep's units open and commit their transactions themselves.

    Postgres (driver psycopg 3). The engine is used as is: nothing is
    installed and no setting is changed. Refused: an ``AUTOCOMMIT`` engine
    (``isolation_level="AUTOCOMMIT"`` on the engine or its execution options,
    or a driver connection in autocommit): a fenced write must be one
    transaction. ``busy_timeout_ms`` and ``synchronous`` are refused too: set
    ``lock_timeout`` on the engine (``connect_args={"options": "-c
    lock_timeout=30000"}``) to bound agentkeep's lock waits; without it a
    writer waits as long as the engine's setting says. The ``lock_timeout``
    a connection of the engine has when it is adopted is read (nothing is
    set) and is the deadline of a one-call operation, retries included, as
    the busy timeout is for an engine agentkeep creates. When the engine's
    transactions are not READ COMMITTED (a REPEATABLE READ engine or role
    default), agentkeep's write units still run READ COMMITTED (the host's
    connections keep their level); the fences rely on it.

    Raises:
        InvalidInput: an engine or setting that is refused (the message says
            what to change); nothing was changed.
        DatabaseError: the database could not be reached.
    """
    if not isinstance(engine, Engine):
        raise InvalidInput(
            "url", f"expected a URL string or a sqlalchemy Engine, not {type(engine).__name__}"
        )
    with _ADOPTING:
        known = _SETTINGS.get(engine)
        if known is not None:
            _check_same(known, busy_timeout_ms, synchronous)
            return known
        settings = _adopt(engine, busy_timeout_ms, synchronous)
        _SETTINGS[engine] = settings
        return settings


def _adopt(engine: Engine, busy_timeout_ms: int | None, synchronous: str | None) -> EngineSettings:
    name, driver = engine.dialect.name, engine.dialect.driver
    if driver not in _DRIVERS.get(name, ()):
        raise InvalidInput(
            "engine",
            f"{name}+{driver} is not supported: agentkeep runs on sqlite (pysqlite, "
            "aiosqlite) and postgresql (psycopg 3, psycopg_async, asyncpg) engines",
        )
    if busy_timeout_ms is not None and busy_timeout_ms < 0:
        raise InvalidInput("busy_timeout_ms", "must be >= 0")
    if name == "sqlite":
        return _adopt_sqlite(engine, busy_timeout_ms, synchronous)
    return _adopt_postgres(engine, busy_timeout_ms, synchronous)


def _check_same(
    known: EngineSettings, busy_timeout_ms: int | None, synchronous: str | None
) -> None:
    if busy_timeout_ms is not None and busy_timeout_ms != known.busy_timeout_ms:
        raise InvalidInput(
            "busy_timeout_ms",
            f"this engine already runs agentkeep with {known.busy_timeout_ms} "
            "(from its first Store.open or create_engine): give the same value or none",
        )
    if synchronous is not None and _check_synchronous(synchronous) != known.synchronous:
        raise InvalidInput(
            "synchronous",
            f"this engine already runs agentkeep with synchronous={known.synchronous}: "
            "give the same value or none",
        )


def _adopt_sqlite(
    engine: Engine, busy_timeout_ms: int | None, synchronous: str | None
) -> EngineSettings:
    _check_sqlite_version()
    busy = DEFAULT_BUSY_TIMEOUT_MS if busy_timeout_ms is None else busy_timeout_ms
    sync = None if synchronous is None else _check_synchronous(synchronous)
    legacy = getattr(sqlite3, "LEGACY_TRANSACTION_CONTROL", None)
    raw = engine.raw_connection()
    try:
        autocommit = getattr(_sqlite3_connection(raw.dbapi_connection), "autocommit", legacy)
        if legacy is not None and autocommit != legacy:
            raise InvalidInput(
                "engine",
                "its sqlite3 connections have autocommit="
                f"{autocommit!r}: create the engine without "
                "connect_args autocommit (sqlite3.LEGACY_TRANSACTION_CONTROL, the default)",
            )
    finally:
        raw.close()

    def configure(dbapi_conn: Any, record: Any, *_proxy: Any) -> None:
        if record.info.get(_CONFIGURED):
            return
        _sqlite_pragmas(dbapi_conn, busy, sync)
        record.info[_CONFIGURED] = True

    # New connections on connect; connections the host pooled before, on checkout.
    event.listen(engine, "connect", configure)
    event.listen(engine, "checkout", configure)
    event.listen(engine, "begin", _sqlite_begin_hook(None))
    return EngineSettings(False, busy, sync)


def _adopt_postgres(
    engine: Engine, busy_timeout_ms: int | None, synchronous: str | None
) -> EngineSettings:
    if busy_timeout_ms is not None:
        raise InvalidInput(
            "busy_timeout_ms",
            "a Postgres engine is used as is: set lock_timeout on it instead, e.g. "
            "create_engine(url, connect_args={'options': '-c lock_timeout=30000'})",
        )
    if synchronous is not None:
        raise InvalidInput("synchronous", "is a SQLite setting; a Postgres engine is used as is")
    autocommit = (
        "it is configured with isolation_level='AUTOCOMMIT'" if is_autocommit(engine) else None
    )
    level = None
    lock_wait_ms = None
    if autocommit is None:
        try:
            with engine.connect() as conn:
                if conn.connection.dbapi_connection.autocommit:  # type: ignore[union-attr]
                    autocommit = "its driver connections are in autocommit mode"
                else:
                    level = conn.get_isolation_level()
                    lock_wait_ms = _pg_lock_timeout_ms(conn)
        except sa_exc.DBAPIError as exc:
            raise translate_db_error(exc) from exc
    if autocommit is not None:
        raise InvalidInput(
            "engine",
            f"{autocommit} (AUTOCOMMIT): agentkeep's fenced writes need a transaction; "
            "use an engine without isolation_level='AUTOCOMMIT' (READ COMMITTED or the default)",
        )
    return EngineSettings(False, lock_wait_ms, None, pg_read_committed=level != "READ COMMITTED")


_PG_LOCK_TIMEOUT: Final = "SELECT setting FROM pg_settings WHERE name = 'lock_timeout'"


def _pg_lock_timeout_ms(conn: Connection) -> int | None:
    """The ``lock_timeout`` a connection of the host's engine runs with (None: 0, no limit)."""
    value = conn.exec_driver_sql(_PG_LOCK_TIMEOUT).scalar()
    try:
        ms = int(str(value))
    except ValueError:
        return None
    return ms if ms > 0 else None


def is_autocommit(bind: Engine | Connection) -> bool:
    """True if ``bind`` runs AUTOCOMMIT (no transaction to join or to fence in).

    Configured with ``isolation_level="AUTOCOMMIT"`` (on the engine, its
    execution options or the connection's), or a psycopg driver connection
    in autocommit mode.
    """
    level = bind.get_execution_options().get("isolation_level")
    if level is None:
        level = getattr(bind.dialect, "_on_connect_isolation_level", None)
    if level == "AUTOCOMMIT":
        return True
    if isinstance(bind, Connection) and bind.dialect.name == "postgresql" and not bind.closed:
        return bool(bind.connection.dbapi_connection.autocommit)  # type: ignore[union-attr]
    return False


def engine_settings(engine: Engine) -> EngineSettings | None:
    """What agentkeep applied to ``engine`` (None: neither created nor adopted by it)."""
    return _SETTINGS.get(engine)


def enable_wal(engine: Engine, schema: str | None = None) -> None:
    """Put a SQLite database file in WAL mode (persistent; a no-op elsewhere).

    Called by :meth:`agentkeep.Store.open` and :func:`agentkeep.migrations.upgrade`
    after the schema was accepted, never before: switching the journal mode
    rewrites the file header. WAL lets readers run beside the single writer;
    without it every ``BEGIN IMMEDIATE`` would queue the readers too. With
    ``schema``, the namespace's attached file is switched (see
    :func:`attach_schema`), and the main file is left in the mode it has.
    """
    if engine.dialect.name != "sqlite" or is_memory_sqlite(
        engine.url.render_as_string(hide_password=False)
    ):
        return
    raw = engine.raw_connection()
    try:
        cur = raw.cursor()
        try:
            prefix = "" if schema is None else f'"{check_schema_name(schema)}".'
            _switch_to_wal(cur, prefix, engine.dialect.loaded_dbapi.OperationalError)
        finally:
            cur.close()
    finally:
        raw.close()


def _switch_to_wal(cur: Any, prefix: str, busy_error: type[Exception]) -> None:
    """Switch the journal mode to WAL, waiting up to the connection's busy timeout.

    The switch needs a moment with no other connection in a transaction.
    SQLite's busy handler does not always wait for it: two connections
    switching a fresh file at once both read the header, and the one whose
    lock upgrade would deadlock gets ``database is locked`` at once. So a
    locked switch is tried again (the mode read first: the other connection
    may have switched it) every few milliseconds until the busy timeout has
    passed, then the last error is raised.
    """
    cur.execute("PRAGMA busy_timeout")
    row: Any = cur.fetchone()
    deadline = time.monotonic() + max(int(row[0]), 0) / 1000
    pause = 0.002
    while True:
        cur.execute(f"PRAGMA {prefix}journal_mode")
        mode: Any = cur.fetchone()
        if str(mode[0]).lower() == "wal":
            return
        try:
            cur.execute(f"PRAGMA {prefix}journal_mode=WAL")
            return
        except busy_error as exc:
            if "locked" not in str(exc) and "busy" not in str(exc):
                raise
            if time.monotonic() >= deadline:
                raise
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


def read_engine(engine: Engine) -> Engine:
    """The same engine (shared pool) whose transactions are consistent read snapshots.

    On SQLite a deferred ``BEGIN`` reads one WAL snapshot (asked for with the
    ``sqlite_begin`` option, which a host's engine needs: its driver would
    not begin a transaction before the first write). On Postgres, READ
    COMMITTED would give each SELECT its own snapshot; read units run
    ``REPEATABLE READ READ ONLY`` instead
    (docs/decisions.md#multi-statement-reads-use-one-snapshot). Pooled
    connections return to the engine's level for other units.
    """
    if engine.dialect.name == "postgresql":
        return engine.execution_options(isolation_level="REPEATABLE READ", postgresql_readonly=True)
    return engine.execution_options(sqlite_begin="DEFERRED")


def write_engine(engine: Engine, schema: str | None = None) -> Engine:
    """The same engine (shared pool) whose transactions begin as writers.

    On SQLite its ``BEGIN`` is ``BEGIN IMMEDIATE``: the database write lock is
    taken before the first read, so a read-modify-write never meets
    ``SQLITE_BUSY_SNAPSHOT`` (with attached namespaces, it locks every
    attached file too). On Postgres the option is ignored; a host engine
    whose transactions are not READ COMMITTED gets READ COMMITTED for these
    transactions (:func:`adopt_engine`). ``schema`` is the namespace of the
    units (see the ``begin`` hook).
    """
    options: dict[str, Any] = {"sqlite_begin": "IMMEDIATE"}
    if schema is not None:
        options["agentkeep_schema"] = schema
    settings = _SETTINGS.get(engine)
    if settings is not None and settings.pg_read_committed:
        options["isolation_level"] = "READ COMMITTED"
    return engine.execution_options(**options)


# --------------------------------------------------------------------------
# Hot-path statements


_SAVEPOINTS = itertools.count(1)
_READ_SNAPSHOT_PG: Final = "SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY"
_READ_COMMITTED_PG: Final = "SET TRANSACTION ISOLATION LEVEL READ COMMITTED"
#: The explicit BEGINs of lean units on psycopg (Driver.begin, lean mode).
_BEGIN_WRITE_PG: Final = "BEGIN ISOLATION LEVEL READ COMMITTED"
_BEGIN_READ_PG: Final = "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY"
#: Drivers whose lean units begin explicitly: psycopg runs a query without
#: parameters as one simple query, several statements included.
_MERGED_BEGIN_DRIVERS: Final = frozenset({"psycopg", "psycopg_async"})
#: A numbered parameter of asyncpg's paramstyle (Driver.send_with_begin).
_DOLLAR_PARAM: Final = re.compile(r"\$(\d+)\b")
#: SQLite: a write that changes nothing, to take the database write lock inside
#: a transaction that has already begun (the UPDATE acquires the RESERVED lock
#: even though no row matches). On an agentkeep table, so that it locks the
#: database agentkeep's tables live in.
_SQLITE_WRITE_LOCK: Final = Statement(
    update(Run).values(id=Run.id).where(false()), name="db.sqlite_write_lock"
)
_SQLITE_BUSY_SNAPSHOT: Final = 517
#: Postgres transaction isolation levels a joined write unit accepts (READ
#: UNCOMMITTED behaves as READ COMMITTED on Postgres).
_PG_JOINABLE: Final = frozenset({"read committed", "read uncommitted"})


class Answered(NamedTuple):
    """A read for :meth:`Driver.prefetching` sent as another statement whose rows answer it.

    ``sent`` returns the rows ``stmt`` would return, or fails with
    ``division_by_zero`` (SQLSTATE 22012) when a condition the caller needs
    does not hold (see :class:`PrefetchCheckFailed`).
    """

    stmt: Statement
    params: Mapping[str, Any]
    sent: Statement
    sent_params: Mapping[str, Any]


#: The SQLSTATE a checking read (:class:`Answered`) fails with to refuse.
CHECK_FAILED_SQLSTATE: Final = "22012"


class PrefetchCheckFailed(Exception):
    """A checking read of a one-round-trip commit refused (:meth:`Driver.prefetching`).

    Nothing of the round trip was committed (the server skipped the rest of
    the pipeline, COMMIT included) and the transaction is aborted: the caller
    calls :meth:`Driver.restart` and does the work the two-round-trip way,
    which judges the condition itself. Never leaves the repository that asked
    for the check.
    """


class CommitWatch:
    """Set by :meth:`Driver.commit` when an operation starts sending its COMMIT.

    The async facade (:mod:`agentkeep.aio`) watches each operation with one
    (:func:`watch_commit`): a caller cancelled before the COMMIT interrupts
    the operation (rolled back: none of it), after it waits for the outcome
    (all of it).
    """

    __slots__ = ("committing",)

    def __init__(self) -> None:
        self.committing = False


_COMMIT_WATCH: ContextVar[CommitWatch | None] = ContextVar("agentkeep_commit_watch", default=None)


@contextmanager
def watch_commit(watch: CommitWatch) -> Iterator[CommitWatch]:
    """Let :meth:`Driver.commit` mark ``watch`` for the operations run in the block."""
    token = _COMMIT_WATCH.set(watch)
    try:
        yield watch
    finally:
        _COMMIT_WATCH.reset(token)


#: libpq's ``PQTRANS_IDLE`` (psycopg's ``pq.TransactionStatus.IDLE``).
_PQTRANS_IDLE: Final = 0
_PQTRANS_INERROR: Final = 3  # libpq's PQTRANS_INERROR: the transaction failed


class Driver:
    """A unit of work's driver (DBAPI) connection, as repositories use it.

    Repositories run their :class:`~agentkeep.statements.Statement` constants
    through :meth:`execute`,
    inside the unit's transaction: on SQLite that is the ``BEGIN IMMEDIATE``
    (or deferred ``BEGIN``) the unit opened; on Postgres the driver's implicit
    transaction. Driver errors come out as :class:`~agentkeep.errors.StoreBusy`
    (retryable) or :class:`~agentkeep.errors.DatabaseError`.

    What waits for the unit's next round trip (psycopg, sync and async;
    docs/architecture.md#one-round-trip-commit), sent at its head in this
    order: a lean unit's ``BEGIN`` (:meth:`begin`, with a lock wait limit);
    a ``RELEASE SAVEPOINT`` of a lean unit's ended :meth:`savepoint` block;
    the ``SAVEPOINT`` of a block that has sent nothing yet; writes queued by
    :meth:`defer`. A statement failing in that round trip raises its typed
    error as if it had gone alone (a failed ``BEGIN``, ``SAVEPOINT`` or
    ``RELEASE`` stops the round trip there: its error is the one raised).
    At :meth:`commit`, a pending ``RELEASE`` goes with ``COMMIT`` and fails
    as ``COMMIT`` does (:meth:`commit_failure`); a unit that sent nothing
    sends nothing, savepoints included.

    Attributes:
        raw: the DBAPI connection (``sqlite3.Connection`` or ``psycopg.Connection``).
        postgres: True on Postgres.
        schema: the namespace the target's schema map puts agentkeep's tables
            in, or None.
    """

    __slots__ = (
        "_began",
        "_sqlite_began",
        "_failed",
        "_commit_ahead",
        "_committed",
        "_implicit",
        "_cursor",
        "_deferred",
        "_error",
        "_lean",
        "_merge_begin",
        "_multi_rowcount",
        "_pending_begin",
        "_pending_sp",
        "_pipeline",
        "_asyncpg_simple",
        "_prefetch",
        "_prefetched",
        "_release_later",
        "_text_bounds",
        "_byte_bounds",
        "_sync_psycopg",
        "limits",
        "_pg_read_committed",
        "postgres",
        "raw",
        "schema",
        "target",
    )

    def __init__(
        self,
        raw: Any,
        target: CompileTarget,
        error: type[BaseException],
        *,
        pg_read_committed: bool = False,
        lean: bool = False,
        limits: Limits = DEFAULT_LIMITS,
    ) -> None:
        self.raw = raw
        #: The size limits of written values (:mod:`agentkeep.limits`).
        self.limits = limits
        self._text_bounds = limits.text_bounds()
        #: Per kind, the longest ``bytes`` value within its limit (``inf``: no limit).
        self._byte_bounds: dict[ColumnKind, float] = {}
        for kind in self._text_bounds:
            limit = limits.of(kind)
            self._byte_bounds[kind] = float("inf") if limit is None else limit
        self.target = target
        self.postgres = target.dialect.name == "postgresql"
        schemas = target.schema_translate_map
        self.schema: str | None = schemas.get(None) if schemas else None
        self._error = error
        self._pg_read_committed = pg_read_committed
        self._multi_rowcount: bool = target.dialect.supports_sane_multi_rowcount
        # Lean units on Postgres run in the driver's autocommit mode until they
        # begin. On psycopg (sync or async) they begin explicitly: the BEGIN waits
        # in _pending_begin and goes out with the unit's first statement (merged
        # into one round trip with an aggregate lock).
        self._lean = lean and self.postgres
        # asyncpg lean units begin explicitly too: BEGIN (and COMMIT, ROLLBACK)
        # go as simple queries on the asyncpg connection (_simple), the adapter
        # staying in autocommit mode, so that BEGIN merges with an aggregate lock.
        self._asyncpg_simple = self._lean and target.dialect.driver == "asyncpg"
        self._merge_begin = self._lean and (
            target.dialect.driver in _MERGED_BEGIN_DRIVERS or self._asyncpg_simple
        )
        self._pending_begin: str | None = None
        self._cursor: Any = None  # the cursor of the last execute (see close_cursor)
        # psycopg (sync or async): several statements per round trip (see defer, prefetch).
        self._pipeline = (
            self.postgres and target.dialect.driver in _MERGED_BEGIN_DRIVERS and _libpq_pipelines()
        )
        # The raw cursor is ours to create on a sync psycopg connection only: an async
        # one is SQLAlchemy's adapter (which holds its cursor), told by the connection,
        # not the target (sync and async psycopg engines share one CompileTarget).
        self._sync_psycopg = (
            self.postgres
            and target.dialect.driver == "psycopg"
            and getattr(raw, "_connection", None) is None
        )
        # psycopg: SAVEPOINT / RELEASE SAVEPOINT statements that go out at the head of
        # the next round trip (after a pending BEGIN), each with the savepoint it
        # opens (None for a RELEASE). See savepoint.
        self._pending_sp: list[tuple[str, _Savepoint | None]] = []
        # ... RELEASE included: a lean unit's (its transaction is the Driver's alone)
        self._release_later = self._lean and self._pipeline
        self._deferred: list[_Deferred] = []
        self._prefetch: list[tuple[Statement, Mapping[str, Any], Statement, Mapping[str, Any]]] = []
        self._prefetched: list[tuple[Statement, Mapping[str, Any], _Fetched]] = []
        # One-round-trip commit (prefetching(commit=True)): COMMIT goes with the
        # prefetched statements; _committed once it came back.
        self._commit_ahead = False
        self._implicit = False  # ... as the pipeline's implicit transaction (prefetching)
        self._committed = False
        self._began: str | None = None  # the BEGIN last sent in a round trip (restart)
        # SQLite: this write unit sent BEGIN IMMEDIATE (begin); its COMMIT checks the
        # transaction is still there (check_not_aborted).
        self._sqlite_began = False
        # A statement of this unit failed (translate): on asyncpg, whose connection keeps
        # no failed-transaction state, check_not_aborted asks the server.
        self._failed = False

    @classmethod
    def of(
        cls,
        conn: Connection,
        schema_translate_map: Mapping[str | None, str | None] | None = None,
    ) -> Driver:
        """The driver connection under a SQLAlchemy connection (inside its transaction)."""
        return cls(
            conn.connection.dbapi_connection,
            CompileTarget.of(conn.dialect, schema_translate_map),
            conn.dialect.loaded_dbapi.Error,
        )

    def execute(self, stmt: Statement, params: Mapping[str, Any]) -> Any:
        """Run ``stmt``; return the DBAPI cursor.

        The statement is compiled for this connection's target on first use
        (:mod:`agentkeep.statements`); only ``params`` are bound per call.
        Use ``fetchone()`` / ``fetchall()`` for rows (plain tuples) and
        ``rowcount`` for UPDATE/DELETE (exact on both drivers; never for
        ``INSERT … ON CONFLICT``: use ``RETURNING``).

        Before the statement runs, ``params`` are checked: every string
        against the text rule (:mod:`agentkeep.text`), every written value
        against its column's limit (:mod:`agentkeep.limits`).

        On psycopg, a lean unit's pending ``BEGIN``, a pending ``SAVEPOINT``
        or ``RELEASE SAVEPOINT`` (:meth:`savepoint`) and any prefetched
        reads (:meth:`prefetching`) go out with the statement in one
        pipelined round trip; the result is then already read (``fetchone``
        / ``fetchall`` / ``rowcount`` as on a cursor).

        Raises:
            InvalidInput: a string holds a NUL or a lone surrogate.
            PayloadTooLarge: a written value is over its limit.
        """
        form = stmt.compiled(self.target)
        self._check(form, params)
        if self._prefetched and (hit := self._take_prefetched(stmt, params)) is not None:
            return hit
        if self._committed:
            raise _after_commit(stmt)
        if self._deferred:
            self.flush()
        if (
            self._prefetch
            or self._commit_ahead
            or self._pending_sp
            or (self._pending_begin is not None and self._pipeline)
        ):
            # psycopg: a pending BEGIN, SAVEPOINT or RELEASE goes out with the
            # statement, one round trip.
            return self._execute_with_prefetch(*self._sent(form, params, pipelined=True))
        if form.raw is None:  # _sent and _new_cursor of the common case, without the calls
            sql, bound = form.sql, params if form.plain else form.bind(params)
        else:
            sql, bound = self._sent(form, params, pipelined=False)
        try:
            if self._pending_begin is not None:
                self._send_ahead()
            cur = self._cursor = self._new_cursor(bound) if form.raw else self.raw.cursor()
            cur.execute(sql, bound)
        except self._error as exc:
            raise self.translate(exc) from exc
        return cur

    def _sent(
        self, form: Compiled, params: Mapping[str, Any], *, pipelined: bool
    ) -> tuple[str, Any]:
        """The SQL and bound parameters that go to the driver for ``form``.

        The named form with the caller's dict as it is in the common case (a
        named or pyformat driver, nothing fixed in the construct). A statement
        psycopg would parse again at every run (:attr:`Compiled.raw`) goes in
        its ``$n`` form, its parameters a :class:`_RawParams` tuple that
        :meth:`_new_cursor` and the pipelined round trips send through
        psycopg's raw cursor: in a pipeline (sync or async psycopg), or
        alone on a sync psycopg connection (the async adapter's cursor is
        SQLAlchemy's).
        """
        raw = form.raw
        if raw is not None and (pipelined or self._sync_psycopg):
            return raw.sql, _RawParams(raw.bind(params))
        return form.sql, params if form.plain else form.bind(params)

    def _new_cursor(self, bound: Any) -> Any:
        """A cursor for ``bound``: psycopg's raw cursor for :class:`_RawParams`."""
        if type(bound) is _RawParams:
            return _raw_cursor_class()(self.raw)
        return self.raw.cursor()

    def executemany(
        self, stmt: Statement, params: Sequence[Mapping[str, Any]], *, count: bool = True
    ) -> int:
        """Run ``stmt`` once per parameter set (one driver call: no per-row Python overhead).

        For batches of INSERT / UPDATE / upsert statements whose rows are not
        needed. An error in any row fails the call; the unit's transaction
        (or savepoint) decides what is undone.

        Args:
            count: False when the caller does not need the row count (an
                upsert): asyncpg then runs the batch as one driver
                ``executemany`` (one round trip), as the other drivers do.

        Returns:
            The rows changed by all the parameter sets together (the summed
            ``rowcount``, exact on both drivers for UPDATE / DELETE; never
            for ``INSERT … ON CONFLICT``). 0 for no parameter sets; -1 with
            ``count=False`` on asyncpg.
        """
        if not params:
            return 0
        form = stmt.compiled(self.target)
        for one in params:
            self._check(form, one)
        if self._committed:
            raise _after_commit(stmt)
        if self._deferred:
            self.flush()
        rows: Any = params if form.plain else [form.bind(p) for p in params]
        try:
            if self._pending_begin is not None or self._pending_sp:
                self._send_ahead()
            cur = self.raw.cursor()
        except self._error as exc:
            raise self.translate(exc) from exc
        try:
            if len(rows) == 1:  # one set: a plain execute (psycopg's executemany pipelines)
                cur.execute(form.sql, rows[0])
                changed: int = cur.rowcount
            elif self._multi_rowcount or not count:
                cur.executemany(form.sql, rows)
                changed = cur.rowcount if self._multi_rowcount else -1
            else:  # asyncpg reports no row count for executemany: one execute per set
                changed = 0
                for row in rows:
                    cur.execute(form.sql, row)
                    changed += cur.rowcount
        except self._error as exc:
            raise self.translate(exc) from exc
        finally:
            cur.close()
        return changed

    def fits(self, stmt: Statement, params: Mapping[str, Any]) -> bool:
        """True when :meth:`execute` would take ``params`` for ``stmt`` (the checks of
        :meth:`_check`: the text rule, the size limits); nothing is sent."""
        try:
            self._check(stmt.compiled(self.target), params)
        except InvalidInput:  # PayloadTooLarge included
            return False
        return True

    def _check(self, form: Compiled, params: Mapping[str, Any]) -> None:
        """The text rule on every string, the size limits on every written value.

        The text rule is :func:`~agentkeep.text.check_params`, inlined (every
        statement runs it). A written integer or None is never measured, nor
        text within its kind's :meth:`~agentkeep.limits.Limits.text_bounds`,
        nor ``bytes`` within its kind's limit (a length test here, no call);
        anything else goes to :meth:`~agentkeep.limits.Limits.check`.
        """
        for name, value in params.items():
            if isinstance(value, str) and ("\x00" in value or not value.isascii()):
                check_text(value, name)
        written = form.written
        if written:
            texts = self._text_bounds
            blobs = self._byte_bounds
            for param, column, kind in written:
                got: Any = params.get(param)
                kind_of = type(got)
                if kind_of is str:
                    if len(got) <= texts[kind]:
                        continue
                elif kind_of is bytes:
                    if len(got) <= blobs[kind]:
                        continue
                elif got is None or kind_of is int:
                    continue
                self.limits.check(column, kind, got)

    def limit_lock_wait(self, ms: int) -> None:
        """Wait at most ``ms`` for a lock in this unit (a retry near the operation's deadline).

        SQLite: sets the connection's ``busy_timeout`` (call before
        :meth:`begin`; :meth:`restore_lock_wait` sets it back). Postgres:
        ``SET LOCAL lock_timeout`` (call after :meth:`begin`; it ends with
        the transaction).
        """
        ms = max(1, int(ms))
        try:
            if self.postgres and self._pending_begin is not None:
                self._pending_begin += f"; SET LOCAL lock_timeout = {ms}"
            elif self.postgres:
                self.raw.execute(f"SET LOCAL lock_timeout = {ms}")
            else:
                self.raw.execute(f"PRAGMA busy_timeout = {ms}")
        except self._error as exc:
            raise self.translate(exc) from exc

    def restore_lock_wait(self, ms: int) -> None:
        """SQLite: set the connection's ``busy_timeout`` back (no-op on Postgres)."""
        if not self.postgres:
            self.raw.execute(f"PRAGMA busy_timeout = {int(ms)}")

    def begin(self, *, write: bool) -> None:
        """Open the unit's transaction (lean one-call units).

        SQLite: ``BEGIN IMMEDIATE`` (write) or ``BEGIN`` (read). Postgres
        (psycopg, asyncpg): an explicit ``BEGIN`` (READ COMMITTED for a write,
        REPEATABLE READ READ ONLY for a read) waits for the unit's first
        statement and goes out with it (one simple query with an aggregate
        lock). A non-lean driver: the driver begins at the first statement,
        after ``SET TRANSACTION`` asks for the same levels.
        """
        if self._merge_begin:  # sent with the unit's first statement (see send_with_begin)
            self._pending_begin = _BEGIN_WRITE_PG if write else _BEGIN_READ_PG
            return
        if self._lean:  # asyncpg: its adapter begins at the unit's first statement
            self._autocommit(False)
        try:
            if self.postgres:
                if not write:  # one consistent snapshot for every SELECT of a read unit
                    self.raw.execute(_READ_SNAPSHOT_PG)
                elif self._pg_read_committed:
                    self.raw.execute(_READ_COMMITTED_PG)
            else:
                self.raw.execute(_BEGIN_SQL["IMMEDIATE" if write else "DEFERRED"])
                self._sqlite_began = write
        except self._error as exc:
            raise self.translate(exc) from exc

    def commit(self) -> None:
        """Commit the unit's transaction.

        Marks the operation's :class:`CommitWatch` (when the caller set one,
        see :func:`watch_commit`) before COMMIT is sent: from then on the
        async facade lets a cancelled caller's operation finish instead of
        interrupting it, so its outcome is never left unknown.

        A ``RELEASE SAVEPOINT`` still pending (psycopg, a lean unit whose
        last statement was in a :meth:`savepoint` block) goes with
        ``COMMIT``, as one simple query: one round trip, whose failure is a
        failed COMMIT's (:meth:`commit_failure`: the server's error, nothing
        committed, or ``CommitOutcomeUnknown`` for a connection lost with it
        in flight). A connection the server closed since the unit's last
        round trip (:meth:`closed_while_idle`) sends the RELEASE alone first,
        so that it fails as a statement does (``ConnectionLost``: nothing
        committed).

        Raises:
            TransactionAborted: the database already ended the unit's
                transaction (:meth:`check_not_aborted`); COMMIT is not sent.
            DatabaseError: the failure of COMMIT (:meth:`commit_failure`).
        """
        if self._deferred:
            self.flush()
        if self._prefetch or self._prefetched:
            self._prefetch, self._prefetched = [], []
        if self._committed:  # COMMIT went with the unit's round trip (prefetching)
            self._committed = False
            return
        if self._pending_begin is not None:  # the unit sent nothing: nothing to commit
            self._pending_begin = None
            self._pending_sp = []
            return
        if self._sqlite_began or (self.postgres and not self._asyncpg_simple):
            self.check_not_aborted()  # asyncpg lean units: _asyncpg_end checks COMMIT's answer
        self._sqlite_began = self._failed = False
        release = ""
        if self._pending_sp:
            if self.closed_while_idle():
                self._send_pending_alone()
            else:
                release = "; ".join(sql for sql, _ in self._pending_sp)
                self._pending_sp = []
        watch = _COMMIT_WATCH.get()
        if watch is not None:
            watch.committing = True
        try:
            if release:  # psycopg: RELEASE SAVEPOINT and COMMIT, one simple query
                self._simple(f"{release}; COMMIT")
            elif self._asyncpg_simple:  # the adapter is in autocommit mode: COMMIT is ours
                self._asyncpg_end("COMMIT")
            else:
                self.raw.commit()
        except self._error as exc:
            raise self.commit_failure(exc) from exc

    def translate(self, exc: BaseException) -> DatabaseError:
        """The typed error for a driver error raised before COMMIT.

        :class:`~agentkeep.errors.ConnectionLost` when the connection is gone
        (nothing of the unit was written), :class:`~agentkeep.errors.StoreBusy`
        when transient, :class:`~agentkeep.errors.DatabaseError` otherwise.
        Notes the failure for :meth:`check_not_aborted`.
        """
        self._failed = True
        if _is_disconnect(exc, self.raw, self.target):
            return ConnectionLost(f"{_prefix(exc)}: {exc}")
        return _translate_driver_error(exc)

    def check_not_aborted(self, *, failed_outside: bool = False) -> None:
        """The fence against acknowledging a write unit the database already rolled back.

        Called just before a write unit sends COMMIT. A statement that failed
        inside the unit's transaction (its error caught by the code in the
        unit) leaves a Postgres transaction aborted, and COMMIT then rolls
        everything back while the driver reports success; SQLite rolls a
        transaction back by itself on some errors (a trigger's
        ``RAISE(ROLLBACK, ...)``, a full disk, an I/O error), and COMMIT then
        has nothing to commit. Either way the unit's writes are gone, and
        acknowledging it would lose them silently. How the state is read:

        * SQLite (a unit whose ``BEGIN`` was sent): the connection is no
          longer in a transaction;
        * psycopg, sync or async: libpq reports the transaction failed (its
          own state, no round trip);
        * asyncpg, whose connection keeps no such state: only when a
          statement of the unit failed (on this driver, or ``failed_outside``:
          through the unit's SQLAlchemy connection), one ``SELECT 1``, which
          an aborted transaction refuses with SQLSTATE 25P02
          (``in_failed_sql_transaction``).

        Raises:
            TransactionAborted: the transaction was ended; nothing of the unit
                is stored, and the caller rolls the connection back.
            DatabaseError: (asyncpg) the check itself failed otherwise.
        """
        if not self.postgres:
            if not sqlite_in_transaction(self.raw):
                self._sqlite_began = False
                raise TransactionAborted(
                    "sqlite: the unit's transaction was rolled back by the database after an "
                    "error inside it (caught in the unit); nothing of the unit was written"
                )
            return
        conn = getattr(self.raw, "_connection", None) or self.raw
        pgconn = getattr(conn, "pgconn", None)
        if pgconn is not None:  # psycopg: libpq's own transaction status
            if pgconn.transaction_status == _PQTRANS_INERROR:
                raise TransactionAborted(
                    "postgres: the unit's transaction was aborted by a statement that failed "
                    "inside it (its error was caught in the unit); COMMIT would roll it back: "
                    "nothing of the unit was written"
                )
            return
        if not (self._failed or failed_outside):
            return
        try:
            await_(_asyncpg_query(self.raw, "SELECT 1"))
        except self._error as exc:
            if getattr(exc, "sqlstate", None) == _PG_IN_FAILED_TRANSACTION:
                raise TransactionAborted(
                    "postgres: the unit's transaction was aborted by a statement that failed "
                    "inside it (its error was caught in the unit); nothing of the unit was written"
                ) from exc
            raise self.translate(exc) from exc

    def commit_failure(self, exc: BaseException) -> DatabaseError:
        """The typed error for a failed COMMIT: definite when provable, else unknown.

        Postgres: a COMMIT the server answered with an error was rolled back
        (the translated error: nothing written); a connection lost while
        COMMIT was in flight leaves the outcome unknown. SQLite: a transaction
        still open after the failed COMMIT was not committed (the translated
        error; the caller rolls it back); one that is gone may or may not
        have been.

        Returns:
            :class:`~agentkeep.errors.CommitOutcomeUnknown` (naming no
            operation: the one-call layer adds it) or the definite error.
        """
        if self.postgres:
            if not _is_disconnect(exc, self.raw, self.target):
                return _translate_driver_error(exc)
        else:
            try:
                still_open = sqlite_in_transaction(self.raw)
            except Exception:  # noqa: BLE001 - a closed connection: the outcome is unknown
                still_open = False
            if still_open:
                return _translate_driver_error(exc)
        observability.commit_outcome_unknown(current_operation() or "transaction", str(exc))
        return CommitOutcomeUnknown("transaction", detail=f"{_prefix(exc)}: {exc}")

    def rollback(self) -> None:
        """Roll the unit's transaction back (errors while rolling back are not masked)."""
        self._sqlite_began = self._failed = False
        self._pending_begin = None
        self._pending_sp = []
        self._deferred, self._prefetch, self._prefetched = [], [], []
        self._commit_ahead = self._implicit = self._committed = False
        if self._asyncpg_simple:
            self._asyncpg_end("ROLLBACK")
        self.raw.rollback()

    def close_cursor(self) -> None:
        """Close the cursor of the last :meth:`execute` (a failed or interrupted unit).

        On SQLite a statement whose rows were not all read stays in progress
        while its cursor lives, and an interrupted unit's cursor can outlive
        it (held by the traceback of the cancelled task): a write statement
        left in progress (``INSERT … RETURNING``) makes every later COMMIT on
        the connection fail with "SQL statements in progress". Closing it
        resets the statement. Errors are ignored: the connection's own
        rollback or disposal follows.
        """
        cur, self._cursor = self._cursor, None
        if cur is not None:
            try:
                cur.close()
            except Exception:  # noqa: BLE001 - best effort; rollback/invalidate follows
                pass

    def enter_lean(self) -> None:
        """A lean unit's connection, just checked out of the pool (see :meth:`leave_lean`).

        On Postgres the connection switches to autocommit mode (a setting of
        the driver connection: nothing is sent), so that a single-statement
        read, which calls no :meth:`begin`, is one round trip. On psycopg
        :meth:`begin` then sends an explicit ``BEGIN`` with the unit's first
        statement, saving the round trip of the driver's own ``BEGIN``; so
        does asyncpg, through the asyncpg connection (:meth:`_simple`), whose
        ``COMMIT`` / ``ROLLBACK`` the unit then sends itself. No-op on
        SQLite, whose driver opens no transaction for a SELECT.
        """
        if self._lean:
            self._autocommit(True)

    def leave_lean(self) -> None:
        """Switch the connection back (driver transactions) before it goes back to the pool.

        Raises:
            DatabaseError: the switch failed (a dead connection): the caller
                must discard the connection, never pool it in autocommit mode.
        """
        self._pending_begin = None
        self._pending_sp = []
        self._deferred, self._prefetch, self._prefetched = [], [], []
        self._commit_ahead = self._implicit = self._committed = False
        if self._asyncpg_simple and _asyncpg_in_transaction(self.raw):
            # psycopg refuses the switch in a transaction; the adapter would not
            raise DatabaseError("postgres: a transaction left open by an ended unit")
        if self._lean:
            self._autocommit(False)

    def park(self) -> None:
        """Forget the ended unit, so that the next unit can run on this driver (parked).

        Closes the last cursor (on SQLite, a statement whose rows were not
        all read stays in progress, holding its snapshot, while its cursor
        lives) and drops anything the unit left pending. Only for a
        connection outside any transaction (see ``Store._park_connections``).
        """
        if self._cursor is not None:
            self.close_cursor()
        self._pending_begin = self._began = None
        self._commit_ahead = self._implicit = self._committed = False
        self._sqlite_began = self._failed = False
        if self._pending_sp:
            self._pending_sp = []
        if self._deferred or self._prefetch or self._prefetched:
            self._deferred, self._prefetch, self._prefetched = [], [], []

    def outside_transaction(self) -> bool:
        """True when the connection is known to be outside any transaction (it may be parked).

        SQLite (pysqlite): the connection's ``in_transaction`` is false. psycopg: libpq
        reports the connection idle (not in a transaction, a failed one, or a
        statement in progress, and not in an unknown state). Any other
        connection: False.
        """
        if not self.postgres:  # parked only on pysqlite (Store._park_connections)
            return not self.raw.in_transaction
        pgconn = getattr(self.raw, "pgconn", None)
        if pgconn is not None:  # psycopg: libpq's status, as info.transaction_status reads it
            return bool(pgconn.transaction_status == _PQTRANS_IDLE)
        info = getattr(self.raw, "info", None)
        if info is None:  # an asyncio connection's adapter
            return False
        from psycopg import pq

        return bool(info.transaction_status == pq.TransactionStatus.IDLE)

    def send_with_begin(self, stmt: Statement, params: Mapping[str, int]) -> bool:
        """Send a pending ``BEGIN`` and ``stmt`` in one round trip; False if none is pending.

        For statements whose parameters are all integers (the aggregate
        locks): they are written into the text, so that ``BEGIN`` and the
        statement go out as one simple query. The caller runs ``stmt`` as
        usual when this returns False: also when reads are to go with it or
        writes are deferred (:meth:`execute` sends them first, with the BEGIN), or
        when a ``SAVEPOINT`` waits (:meth:`savepoint`: :meth:`execute` sends it
        with the BEGIN in a pipeline, which tells whether it was established).
        """
        pending = self._pending_begin
        if (
            pending is None
            or self._prefetch
            or self._deferred
            or self._commit_ahead
            or self._pending_sp
        ):
            return False
        form = stmt.compiled(self.target)
        bound = params if form.plain else form.bind(params)
        if isinstance(bound, Mapping):  # psycopg: %(name)s
            text = form.sql % {k: int(v) for k, v in bound.items()}
        else:  # asyncpg: $1, $2 ... in the order of the tuple
            text = _DOLLAR_PARAM.sub(lambda m: str(int(bound[int(m[1]) - 1])), form.sql)
        sql = f"{pending}; {text}"
        self._began, self._pending_begin = pending, None
        try:
            self._simple(sql)
        except self._error as exc:
            raise self.translate(exc) from exc
        return True

    def execute_alone(
        self, stmt: Statement, params: Mapping[str, Any], *, writes: bool = True
    ) -> Any | None:
        """Run ``stmt`` as a transaction of its own, ahead of the unit's (one round trip).

        For a one-call operation whose work is one statement that carries its
        own lock and fence (``runs.try_transition``): in a lean unit on
        Postgres that has sent nothing yet, the statement runs in autocommit
        mode, so the server commits it when it ends, and the unit's own
        transaction stays unbegun (its next statement begins it as usual; a
        unit that sends nothing more commits nothing). Returns the cursor, or
        None when the statement cannot run alone: SQLite, a ``store.write()``
        unit, a unit that has sent a statement, or one whose lock wait is
        limited (a retry near its deadline), or inside a :meth:`savepoint`
        block; the caller then runs its usual locked path.

        A write (``writes``) is its own COMMIT: the operation's
        :class:`CommitWatch` is marked before it is sent, and a connection
        lost while it is in flight raises
        :class:`~agentkeep.errors.CommitOutcomeUnknown`. A read
        (``writes=False``, a SELECT that precedes such a write) fails as
        :meth:`execute` does (``ConnectionLost``: nothing was written).

        Raises:
            InvalidInput, PayloadTooLarge: as :meth:`execute`.
            CommitOutcomeUnknown: a write's connection was lost with it in flight.
            ConnectionLost: a read's connection was lost.
            StoreBusy, DatabaseError: the server refused it (nothing was written).
        """
        if (
            not self._lean
            or self._prefetch
            or self._deferred
            or self._prefetched
            or self._pending_sp
        ):
            return None
        # Every lean Postgres unit begins explicitly (_merge_begin): the
        # connection is in autocommit mode until its pending BEGIN goes out,
        # and a limited lock wait rides on that BEGIN.
        if self._pending_begin != _BEGIN_WRITE_PG:
            return None
        form = stmt.compiled(self.target)
        self._check(form, params)
        sql, bound = self._sent(form, params, pipelined=False)
        if writes and self.closed_while_idle():
            # A pooled connection the server closed: the locked path's first
            # statement fails as ConnectionLost (nothing sent, retried), where a
            # write sent alone would be its own COMMIT (CommitOutcomeUnknown).
            return None
        if writes and (watch := _COMMIT_WATCH.get()) is not None:
            watch.committing = True
        try:
            cur = self._cursor = self._new_cursor(bound)
            cur.execute(sql, bound)
        except self._error as exc:
            raise (self.commit_failure(exc) if writes else self.translate(exc)) from exc
        return cur

    # ------------------------------------------------------------------ pipelining

    @property
    def pipelines(self) -> bool:
        """True where :meth:`defer` queues and :meth:`prefetching` sends early (psycopg).

        Elsewhere (SQLite, asyncpg) both run each statement when it is made.
        """
        return self._pipeline

    def prefetching(
        self,
        reads: Sequence[tuple[Statement, Mapping[str, Any]] | Answered],
        *,
        commit: bool = False,
        implicit: bool = False,
    ) -> AbstractContextManager[None]:
        """Send ``reads`` with the next statement sent in the block, in its round trip (psycopg).

        For a repository that knows the reads it will make right after its
        first statement (a commit: the fence reads after the write lock). The
        reads go out after that statement, in one pipelined round trip
        (psycopg pipeline mode), and each result is kept for the first
        :meth:`execute` of the same statement with equal parameters in the
        block, which then sends nothing. The caller vouches that nothing it
        writes before such a read changes what the read returns. Results not
        asked for are dropped when the block ends (a later read, say after
        the caller caught the block's error, runs as usual). On SQLite and
        asyncpg nothing is sent early: each read runs when executed, so both
        paths run the same repository code.

        An :class:`Answered` read is sent as its ``sent`` statement, whose
        rows answer an :meth:`execute` of its ``stmt``.

        One-round-trip commit (``commit=True``, docs/architecture.md#one-round-trip-commit):
        ``COMMIT`` goes at the end of the same round trip, and the unit's
        :meth:`commit` then sends nothing. Only for a one-call unit whose
        every statement is among ``reads`` (or is the first statement) and
        whose every decision is already made by the server in that round
        trip: anything the caller judges from the results afterwards must
        have been enforced by a checking read (an :class:`Answered` whose
        ``sent`` fails with SQLSTATE 22012 when the condition does not
        hold), since the work is committed by then. A statement not answered
        from the round trip after it raises ``RuntimeError`` (it would run
        outside the transaction). Outcomes of that round trip:

        * it came back: committed;
        * a checking read refused: :class:`PrefetchCheckFailed`, nothing
          committed (the server skips the rest of a failed pipeline, COMMIT
          included); call :meth:`restart` and do it the two-round-trip way;
        * the server refused another statement or the COMMIT: its typed
          error (``StoreBusy``, ``DatabaseError``), nothing committed;
        * the connection was lost: the COMMIT may or may not have been
          applied, :class:`~agentkeep.errors.CommitOutcomeUnknown`, as for a
          lost answer to a COMMIT sent alone (:meth:`commit_failure`).

        Without pipelining ``commit`` is ignored: the unit commits as usual.

        ``implicit`` (with ``commit``): the round trip is sent without its
        ``BEGIN`` and ``COMMIT``, as the implicit transaction the server
        runs every statement up to a pipeline's Sync in: committed at the
        Sync when every statement succeeded, rolled back otherwise (two
        statements fewer, the same outcomes). Only where the unit's
        ``BEGIN`` is the plain ``READ COMMITTED`` one (no lock wait limit),
        the connection is in autocommit mode (a lean unit) and the engine's
        default isolation was READ COMMITTED; else the round trip carries
        both as above. The implicit transaction runs at the session's
        default isolation, so the caller's checking read must refuse
        (SQLSTATE 22012) unless ``transaction_isolation`` is ``read
        committed``, whatever rows it reads.

        Raises:
            InvalidInput, PayloadTooLarge: as :meth:`execute`, for a read's parameters.
        """
        if not self._pipeline:
            return _NOTHING_SENT_EARLY  # SQLite, asyncpg: no generator frame per unit
        return self._prefetching(reads, commit, implicit)

    @contextmanager
    def _prefetching(
        self,
        reads: Sequence[tuple[Statement, Mapping[str, Any]] | Answered],
        commit: bool,
        implicit: bool,
    ) -> Iterator[None]:
        """:meth:`prefetching` on a pipelining connection."""
        prefetch = []
        for read in reads:
            if isinstance(read, Answered):
                item = (read.stmt, read.params, read.sent, read.sent_params)
            else:
                item = (read[0], read[1], read[0], read[1])
            self._check(item[2].compiled(self.target), item[3])
            prefetch.append(item)
        self._prefetch, self._prefetched = prefetch, []
        self._commit_ahead = commit
        self._implicit = commit and implicit
        try:
            yield
        finally:
            self._prefetch, self._prefetched = [], []
            self._commit_ahead = self._implicit = False

    @property
    def commits_ahead(self) -> bool:
        """True when ``prefetching(commit=True)`` would send COMMIT in the round trip.

        psycopg with pipelining, in a one-call (lean) unit, which begins
        explicitly, that has sent nothing yet (its ``BEGIN`` is pending) and
        is not in a :meth:`savepoint` block: so the round trip holds the whole
        unit, and :meth:`restart` after a refused check loses nothing but it.
        """
        return (
            self._pipeline
            and self._merge_begin
            and self._pending_begin is not None
            and not self._pending_sp
            and not self.closed_while_idle()
        )

    @property
    def commits_with_write(self) -> bool:
        """True when ``prefetching((), commit=True)`` would send COMMIT with the next write.

        psycopg with pipelining, in a one-call (lean) unit that has begun
        (its ``BEGIN`` went out with an earlier statement): the write and
        ``COMMIT`` go in one round trip. For a unit whose last statement is
        that write and whose every decision was made before it, so that the
        write's result only confirms what the unit already knew (a fenced
        write that matched nothing wrote nothing: committing the unit then
        commits nothing it wrote). The outcomes are those of
        :meth:`prefetching` with ``commit``: a lost connection is
        ``CommitOutcomeUnknown``.
        """
        return (
            self._pipeline
            and self._merge_begin
            and self._pending_begin is None
            and not self._committed
            and not self._deferred
        )

    @property
    def checks_one_call(self) -> bool:
        """True when :meth:`execute_checking` may end a failed check with :meth:`restart`.

        A one-call (lean) unit on Postgres (psycopg or asyncpg) that has sent
        nothing yet, outside any :meth:`savepoint` block: its transaction is
        the operation's own, so rolling it back and beginning again loses
        nothing else.
        """
        return (
            self._merge_begin
            and self._pending_begin is not None
            and not self._committed
            and not self._deferred
            and not self._pending_sp
        )

    def execute_checking(self, stmt: Statement, params: Mapping[str, Any]) -> Any:
        """Run a *checking* statement, with ``COMMIT`` in its round trip where it can go there.

        A checking statement fails with SQLSTATE 22012
        (:data:`CHECK_FAILED_SQLSTATE`, ``division_by_zero``) when a condition
        it checks does not hold, so its writes (data-modifying CTEs) are kept
        only when every check passed. For a one-call unit's last statement,
        sent after its locks: on psycopg ``COMMIT`` goes in the same round
        trip (:attr:`commits_with_write`) and the unit's commit then sends
        nothing; elsewhere the unit commits as usual. Outcomes:

        * it came back: its writes are made (committed, with ``COMMIT``);
        * the check refused: :class:`PrefetchCheckFailed`, nothing written and
          the transaction aborted: call :meth:`restart` and do the work the
          long way, which judges the conditions itself;
        * any other failure: its typed error, as :meth:`execute` and
          :meth:`prefetching` with ``commit`` raise them (a connection lost
          while ``COMMIT`` was in flight: ``CommitOutcomeUnknown``).
        """
        try:
            if self.commits_with_write:
                with self.prefetching((), commit=True):
                    return self.execute(stmt, params)
            return self.execute(stmt, params)
        except Exception as exc:
            if getattr(exc.__cause__, "sqlstate", None) == CHECK_FAILED_SQLSTATE:
                raise PrefetchCheckFailed(str(exc)) from exc
            raise

    def closed_while_idle(self) -> bool:
        """True when the server closed (or wrote to) this Postgres connection while it sat idle.

        There is no pre-ping when a pooled connection is checked out: a unit
        whose first round trip fails on a connection the server had already
        closed (a restarted server, a terminated backend, an idle timeout)
        gets ``ConnectionLost``, which is definite (nothing was applied) and
        retried on a fresh connection. A first round trip that carries its
        own ``COMMIT`` (:meth:`commits_ahead`, :meth:`execute_alone`) cannot
        tell that case from a connection lost after the server committed, so
        it would report ``CommitOutcomeUnknown``. Before sending one, the unit
        asks this: the connection has sent nothing since it was checked out,
        so any input waiting on its socket is the server's goodbye (a closed
        socket reads as ready; a terminated backend sends its FATAL message
        first) or an unsolicited message; either way the unit takes its
        ordinary path, whose first round trip carries no ``COMMIT``. One
        ``select`` with a zero timeout on psycopg; asyncpg reports a
        connection its event loop saw close. A connection that dies silently
        (no FIN reaches the client) or while the round trip is in flight is
        not seen here: that stays ``CommitOutcomeUnknown``.
        """
        if not self.postgres:
            return False
        conn = getattr(self.raw, "_connection", None) or self.raw
        pgconn = getattr(conn, "pgconn", None)
        if pgconn is None:  # asyncpg
            is_closed = getattr(conn, "is_closed", None)
            return bool(is_closed()) if is_closed is not None else False
        try:
            ready, _, _ = _select.select([pgconn.socket], [], [], 0)
        except (OSError, ValueError, self._error):
            return True  # no usable socket: the connection is gone
        return bool(ready)

    def restart(self) -> None:
        """Roll back a one-call write unit's aborted transaction and begin it again.

        After :class:`PrefetchCheckFailed`: the next statement sends a fresh
        ``BEGIN`` with it (psycopg), as the unit began (its lock wait limit
        included).

        Raises:
            ConnectionLost: the rollback failed: the connection is lost, or
                psycopg left it in an aborted pipeline it cannot leave (the
                refused check's error can surface while later statements of
                the round trip are still being sent; then ``ROLLBACK`` fails
                with "cannot exit pipeline mode while busy"). Nothing of the
                unit was committed either way (the server skips the rest of a
                failed pipeline, ``COMMIT`` included), so the one-call layer
                retries the unit on another connection; this one is discarded.
        """
        try:
            self.rollback()
        except self._error as exc:
            error = self.translate(exc)
            if isinstance(error, ConnectionLost):
                raise error from exc
            lost = ConnectionLost(
                f"the connection could not be rolled back after a refused check "
                f"(nothing was committed): {error}"
            )
            lost.only_this_connection = True  # the server answered: its peers are fine
            raise lost from exc
        self._pending_begin = self._began or _BEGIN_WRITE_PG

    def defer(
        self,
        stmt: Statement,
        params: Mapping[str, Any],
        check: Callable[[Any], None] | None = None,
    ) -> None:
        """Run a write whose result is not needed yet; ``check`` judges its result later.

        On psycopg the statement is queued, and the queue goes out in one
        pipelined round trip (:meth:`flush`) before the next statement that
        is not deferred, before a savepoint ends, before COMMIT, or when the
        caller flushes; elsewhere it runs at once. A repository method that
        defers flushes before it returns (an error raised in between:
        :meth:`deferred_first`): a unit's own commit path, and a host's ORM
        session on the same connection, do not see the queue. Either way ``check`` gets
        the statement's result (``fetchone`` / ``fetchall`` / ``rowcount``)
        and raises the caller's typed error, the statements run in the order
        they were deferred, and the checks run in that order before anything
        later is sent: the first failing check (or database error) is the
        error, as if the statements had run one by one.

        Raises:
            InvalidInput, PayloadTooLarge: as :meth:`execute`, at once (after
                the queued statements are flushed and checked, so that an
                earlier statement's error comes first).
            DatabaseError, StoreBusy, ConnectionLost: on SQLite and asyncpg,
                at once; on psycopg, from the flush.
        """
        if not self._pipeline:
            cur = self.execute(stmt, params)
            if check is not None:
                check(cur)
            return
        form = stmt.compiled(self.target)
        try:
            self._check(form, params)
        except BaseException:
            self.flush()
            raise
        self._deferred.append(_Deferred(*self._sent(form, params, pipelined=True), check))

    def flush(self) -> None:
        """Send the deferred writes (one round trip) and run their checks in order.

        A database error in statement ``k`` comes after the checks of the
        statements before it (their results arrived): the first failing
        check is raised instead, as it would have been had they run one by
        one. Nothing is left queued either way.

        Raises:
            whatever a check raises; DatabaseError, StoreBusy or
            ConnectionLost for a statement the server refused.
        """
        deferred, self._deferred = self._deferred, []
        if not deferred:
            return
        if self._committed:
            raise RuntimeError("deferred writes after the unit's pipelined COMMIT")
        out: list[_Fetched | None] = []
        try:
            self._round_trip([(d.sql, d.params) for d in deferred], out)
        except self._error as exc:
            error = self.translate(exc)
            if not isinstance(error, ConnectionLost):
                for d, result in zip(deferred, out, strict=False):
                    if result is not None and d.check is not None:
                        d.check(result)
            raise error from exc
        for d, result in zip(deferred, out, strict=True):
            if d.check is not None:
                d.check(result)

    @contextmanager
    def deferred_first(self) -> Iterator[None]:
        """Let the checks of writes deferred in the block come before an error raised in it.

        An error the caller raises itself (no statement sent) while writes
        are queued would otherwise skip their checks: the queue is flushed
        first, so a failing check is the error, as if the writes had run one
        by one. Cancellation (a ``BaseException`` that is not an
        ``Exception``) sends nothing.
        """
        try:
            yield
        except Exception:
            if self._deferred:
                self.flush()
            raise

    def _take_prefetched(self, stmt: Statement, params: Mapping[str, Any]) -> _Fetched | None:
        for i, (s, p, result) in enumerate(self._prefetched):
            if s is stmt and p == params:
                del self._prefetched[i]
                return result
        return None

    def _execute_with_prefetch(self, sql: str, bound: Any) -> _Fetched:
        reads, self._prefetch = self._prefetch, []
        items = [(sql, bound)]
        for _, _, sent, params in reads:
            items.append(self._sent(sent.compiled(self.target), params, pipelined=True))
        commit, self._commit_ahead = self._commit_ahead, False
        implicit, self._implicit = self._implicit, False
        if commit:
            if implicit and self._implicit_commit_fits():
                # No BEGIN, no COMMIT: the pipeline's implicit transaction (see prefetching).
                self._began, self._pending_begin = self._pending_begin, None
            else:
                items.append(("COMMIT", None))
            watch = _COMMIT_WATCH.get()
            if watch is not None:
                watch.committing = True
        out: list[_Fetched | None] = []
        try:
            self._round_trip(items, out)
        except self._error as exc:
            if not commit:
                raise self.translate(exc) from exc
            if getattr(exc, "sqlstate", None) == CHECK_FAILED_SQLSTATE and any(
                read[2] is not read[0] for read in reads
            ):
                raise PrefetchCheckFailed(str(exc)) from exc
            # A server error: the pipeline stopped there, COMMIT not run (definite).
            # A lost connection: the COMMIT may have been applied (unknown).
            raise self.commit_failure(exc) from exc
        self._committed = commit
        self._prefetched = [
            (stmt, params, result)
            for (stmt, params, _, _), result in zip(reads, out[1:], strict=False)
            if result is not None
        ]
        first = out[0]
        assert first is not None
        return first

    def _implicit_commit_fits(self) -> bool:
        """True when a one-round-trip commit may go as an implicit transaction (prefetching)."""
        if self._pending_begin != _BEGIN_WRITE_PG or self._pg_read_committed or self._pending_sp:
            return False  # (a SAVEPOINT needs a transaction block)
        conn = getattr(self.raw, "_connection", None) or self.raw
        return getattr(conn, "autocommit", False) is True

    def _round_trip(self, items: list[tuple[str, Any]], out: list[_Fetched | None]) -> None:
        """Run ``items`` (after a pending BEGIN, SAVEPOINT, RELEASE) in one pipelined round trip.

        Appends one result per item to ``out``, None for an item the server
        did not run (it came after a failing one); driver errors propagate
        (the results before the failing item are in ``out``). A pending
        ``SAVEPOINT`` the server ran is marked established (``opened``),
        failure or not, so that :meth:`savepoint` rolls back to it only then.
        """
        batch: list[tuple[str, Any]] = []
        if self._pending_begin is not None:
            batch = [(part, None) for part in self._pending_begin.split("; ")]
            self._began, self._pending_begin = self._pending_begin, None
        ahead = self._pending_sp
        first = len(batch)
        if ahead:
            self._pending_sp = []
            batch.extend((sql, None) for sql, _ in ahead)
        skip = len(batch)
        batch.extend(items)
        ran: list[bool] = []
        raw = self.raw
        conn = getattr(raw, "_connection", None)  # SQLAlchemy's adapter of an async connection
        if conn is None:
            curs = []
            try:
                with raw.pipeline():
                    for sql, params in batch:
                        cur = self._new_cursor(params)
                        curs.append(cur)
                        cur.execute(sql, params)
            finally:
                if ahead:
                    ran.extend(_ran(cur) for cur in curs[first:skip])
                    _mark_opened(ahead, ran)
                for cur in curs[skip:]:
                    if cur.pgresult is None:
                        out.append(None)
                    else:
                        # nfields, not description: that builds a Column per field.
                        rows = cur.fetchall() if cur.pgresult.nfields else []
                        out.append(_Fetched(rows, cur.rowcount))
                        cur.close()
        else:
            try:
                await_(_async_round_trip(conn, batch, skip, out, first, ran))
            finally:
                if ahead:
                    _mark_opened(ahead, ran)

    def _send_ahead(self) -> None:
        """Send what waits for the unit's next statement, alone (a statement that cannot carry it).

        A pending ``SAVEPOINT`` or ``RELEASE`` (after a pending ``BEGIN``) in
        one pipelined round trip, which tells which were established
        (:meth:`_round_trip`); a ``BEGIN`` alone as one simple query.
        Called inside the callers' try blocks: a driver error is translated there.
        """
        if self._pending_sp:
            self._round_trip([], [])
        else:
            self._send_begin()

    def _send_pending_alone(self) -> None:
        """:meth:`_send_ahead`, its driver error translated (``ConnectionLost`` when the
        connection is gone: nothing was committed)."""
        try:
            self._send_ahead()
        except self._error as exc:
            raise self.translate(exc) from exc

    def _send_begin(self) -> None:
        # Called inside the callers' try blocks: a driver error is translated there.
        pending, self._pending_begin = self._pending_begin, None
        assert pending is not None
        self._simple(pending)

    def _simple(self, sql: str) -> Any:
        """Run ``sql`` (no parameters; one or more statements) as one simple query.

        On asyncpg through the asyncpg connection itself (SQLAlchemy's adapter
        would prepare it: a round trip more, and one statement only); its
        errors come out as the adapter's DBAPI errors. Returns asyncpg's
        status of the last statement (None on psycopg).
        """
        if self._asyncpg_simple:
            return await_(_asyncpg_query(self.raw, sql))
        self.raw.execute(sql)
        return None

    def _asyncpg_end(self, sql: str) -> None:
        """asyncpg lean unit: ``COMMIT`` or ``ROLLBACK`` the explicit transaction, if open.

        Nothing is sent when no transaction is open (a unit that sent
        nothing, or one single-statement read). A COMMIT the server turns
        into ROLLBACK (the transaction had failed) raises: nothing was written.
        """
        if not _asyncpg_in_transaction(self.raw):
            return
        status = self._simple(sql)
        if sql == "COMMIT" and status != "COMMIT":
            raise TransactionAborted(
                f"postgres: COMMIT of a failed transaction was answered {status}: the unit's "
                "transaction was aborted by a statement that failed inside it; nothing of the "
                "unit was written"
            )

    def _autocommit(self, on: bool) -> None:
        try:
            self.raw.autocommit = on
        except self._error as exc:
            raise self.translate(exc) from exc

    @contextmanager
    def _savepoint_body(self) -> Iterator[None]:
        """A savepoint block's body (:meth:`savepoint`, both forms): writes deferred in it
        go out at its end, checked inside its savepoint; when it raises, those not yet
        sent are dropped (rolled back by not sending them) and the error propagates."""
        try:
            with self.deferred_first():
                yield
                self.flush()
        except BaseException:
            self._deferred = []
            raise

    @contextmanager
    def savepoint(self) -> Iterator[None]:
        """Run a block that may roll back only its own work (SAVEPOINT on both dialects).

        When the block raises, its writes are rolled back to the savepoint and
        the exception propagates; the rest of the unit of work is untouched.
        A repository that decides "lost the race → None" raises a private
        exception inside the block and turns it into its return value outside.

        SQLite and asyncpg send ``SAVEPOINT`` when the block starts and
        ``RELEASE SAVEPOINT`` when it ends, each alone. On psycopg (sync and
        async) the block costs no round trip of its own:

        * writes deferred before the block go out first (:meth:`flush`);
        * ``SAVEPOINT`` waits for the block's first statement and goes out at
          the head of its pipelined round trip (after the unit's pending
          ``BEGIN``, if any). A block that sends nothing sends neither
          ``SAVEPOINT`` nor ``RELEASE``;
        * ``RELEASE SAVEPOINT`` then waits, in a one-call (lean) unit, for the
          unit's next statement, at the head of its round trip, or for the
          unit's :meth:`commit`, with which it goes as one simple query; in a
          ``store.write()`` or joined unit (whose transaction the host's
          connection shares) it goes when the block ends, alone;
        * when the block raises after its ``SAVEPOINT`` was established,
          ``ROLLBACK TO SAVEPOINT`` and ``RELEASE SAVEPOINT`` go as one simple
          query (releases still pending from blocks inside it are dropped:
          the rollback ends those savepoints). When the round trip that
          carried the ``SAVEPOINT`` failed before the server ran it (a lost
          connection, an already failed transaction), nothing of the block
          ran and nothing is sent: the block's error (the round trip's,
          translated as :meth:`execute` translates it) propagates as it is.

        So a statement failing in the round trip that carries the
        ``SAVEPOINT`` raises the same typed error as before, and the rollback
        to the savepoint still leaves the unit usable. A pending ``RELEASE``
        that fails makes the statement it went with (or the COMMIT) fail:
        the server runs nothing after it in that round trip.
        """
        name = f"ak_sp_{next(_SAVEPOINTS)}"
        if not self._pipeline:
            self._plain(f"SAVEPOINT {name}")
            try:
                with self._savepoint_body():
                    yield
            except BaseException:
                self._plain(f"ROLLBACK TO SAVEPOINT {name}")
                self._plain(f"RELEASE SAVEPOINT {name}")
                raise
            self._plain(f"RELEASE SAVEPOINT {name}")
            return
        if self._committed:
            raise RuntimeError(f"SAVEPOINT {name}: a statement after the unit's pipelined COMMIT")
        if self._deferred:
            self.flush()  # writes queued before the block stay outside its savepoint
        sp = _Savepoint()
        entry = (f"SAVEPOINT {name}", sp)
        self._pending_sp.append(entry)
        try:
            with self._savepoint_body():
                yield
        except BaseException:
            if self._unsent(entry) or not sp.opened:
                raise  # nothing of the block ran: nothing to roll back
            self._pending_sp = []  # RELEASEs of savepoints inside the block: ended by the rollback
            self._plain(f"ROLLBACK TO SAVEPOINT {name}; RELEASE SAVEPOINT {name}")
            raise
        if self._unsent(entry) or not sp.opened:
            return  # the block sent nothing: neither SAVEPOINT nor RELEASE
        release = f"RELEASE SAVEPOINT {name}"
        if self._release_later:
            if self._committed:
                raise RuntimeError(f"{release}: a statement after the unit's pipelined COMMIT")
            self._pending_sp.append((release, None))
        else:
            self._plain(release)

    def _unsent(self, entry: tuple[str, _Savepoint | None]) -> bool:
        """True (and ``entry`` dropped) when ``entry`` still waits for a round trip."""
        for i, pending in enumerate(self._pending_sp):
            if pending is entry:
                del self._pending_sp[i]
                return True
        return False

    def _plain(self, sql: str) -> None:
        if self._committed:
            raise RuntimeError(f"{sql}: a statement after the unit's pipelined COMMIT")
        if self._deferred:
            self.flush()
        try:
            if self._pending_begin is not None or self._pending_sp:
                self._send_ahead()
            self.raw.execute(sql)
        except self._error as exc:
            raise self.translate(exc) from exc


class _Savepoint:
    """A :meth:`Driver.savepoint` block's savepoint: ``opened`` once the server ran its
    ``SAVEPOINT`` (:meth:`Driver._round_trip`)."""

    __slots__ = ("opened",)

    def __init__(self) -> None:
        self.opened = False


#: libpq's ``PGRES_COMMAND_OK`` (psycopg's ``pq.ExecStatus.COMMAND_OK``).
_PGRES_COMMAND_OK: Final = 1


def _ran(cur: Any) -> bool:
    """True when the server ran ``cur``'s statement (no rows) in a pipeline without error."""
    result = cur.pgresult
    return result is not None and result.status == _PGRES_COMMAND_OK


def _mark_opened(ahead: list[tuple[str, _Savepoint | None]], ran: list[bool]) -> None:
    """Mark the savepoints whose pending ``SAVEPOINT`` ran (``ran``: one flag per statement)."""
    for (_, sp), done in zip(ahead, ran, strict=False):
        if sp is not None and done:
            sp.opened = True


def _after_commit(stmt: Statement) -> RuntimeError:
    return RuntimeError(
        f"{stmt.name or stmt!r}: a statement after the unit's pipelined COMMIT "
        "(prefetching(commit=True) takes every statement of the unit)"
    )


@functools.cache
def _libpq_pipelines() -> bool:
    """True if psycopg's libpq has pipeline mode (libpq 14 or later)."""
    import psycopg

    return bool(psycopg.Pipeline.is_supported())


class _RawParams(tuple[Any, ...]):
    """The positional parameters of a statement's ``$n`` form (:attr:`Compiled.raw`),
    marked for psycopg's raw cursor (``Driver._sent``)."""

    __slots__ = ()


@functools.cache
def _raw_cursor_class() -> Any:
    """psycopg's ``RawCursor`` (``$n`` placeholders, nothing converted per call)."""
    import psycopg

    return psycopg.RawCursor


@functools.cache
def _async_raw_cursor_class() -> Any:
    """psycopg's ``AsyncRawCursor``."""
    import psycopg

    return psycopg.AsyncRawCursor


class _Deferred(NamedTuple):
    """A write queued by :meth:`Driver.defer`: its SQL, bound parameters and check."""

    sql: str
    params: Any
    check: Callable[[Any], None] | None


#: :meth:`Driver.prefetching` where nothing is sent early (a reusable no-op block).
_NOTHING_SENT_EARLY: Final = nullcontext()


class _Fetched:
    """A statement's result read in a pipelined round trip (a cursor's read side)."""

    __slots__ = ("_rows", "rowcount")

    def __init__(self, rows: list[Any], rowcount: int) -> None:
        self._rows = rows
        self.rowcount = rowcount

    def fetchone(self) -> Any:
        return self._rows.pop(0) if self._rows else None

    def fetchall(self) -> list[Any]:
        rows, self._rows = self._rows, []
        return rows

    def close(self) -> None:
        self._rows = []


async def _asyncpg_query(adapter: Any, sql: str) -> Any:
    """:meth:`Driver._simple` on SQLAlchemy's asyncpg adapter (its mutex, its error mapping)."""
    async with adapter._execute_mutex:
        try:
            return await adapter._connection.execute(sql)
        except Exception as error:  # noqa: BLE001 - re-raised as the adapter's DBAPI error
            adapter._handle_exception(error)


def _asyncpg_in_transaction(adapter: Any) -> bool:
    """True when the asyncpg connection's last answer said a transaction is open (or failed)."""
    return bool(adapter._connection.is_in_transaction())


async def _async_round_trip(
    conn: Any,
    batch: list[tuple[str, Any]],
    skip: int,
    out: list[_Fetched | None],
    first: int,
    ran: list[bool],
) -> None:
    """:meth:`Driver._round_trip` on a psycopg ``AsyncConnection``.

    ``ran`` gets, for ``batch[first:skip]`` (the pending savepoint statements),
    whether each ran (:func:`_ran`).
    """
    curs = []
    try:
        async with conn.pipeline():
            for sql, params in batch:
                cur = (
                    _async_raw_cursor_class()(conn) if type(params) is _RawParams else conn.cursor()
                )
                curs.append(cur)
                await cur.execute(sql, params)
    finally:
        if skip > first:
            ran.extend(_ran(cur) for cur in curs[first:skip])
        for cur in curs[skip:]:
            if cur.pgresult is None:
                out.append(None)
            else:
                rows = await cur.fetchall() if cur.pgresult.nfields else []
                out.append(_Fetched(rows, cur.rowcount))
                await cur.close()


# --------------------------------------------------------------------------
# The aggregate write lock

_LOCK_SQL: Final = Statement(
    select(func.pg_advisory_xact_lock(bindparam("ns"), bindparam("key"))), name="advisory_lock"
)
_LOCK_WITH_BLOBS_SQL: Final = Statement(
    select(
        func.pg_advisory_xact_lock(bindparam("ns"), bindparam("key")),
        func.pg_advisory_xact_lock_shared(bindparam("gc_ns"), bindparam("gc_key")),
    ),
    name="advisory_lock_with_blobs",
)
_LOCK_SHARED_SQL: Final = Statement(
    select(func.pg_advisory_xact_lock_shared(bindparam("ns"), bindparam("key"))),
    name="advisory_lock_shared",
)


def _key_hash(key: str) -> int:
    """A stable signed 32-bit hash of ``key`` (crc32, shifted into int4 range)."""
    return zlib.crc32(key.encode("utf-8")) - 0x8000_0000


def _namespaced(key: str, schema: str | None) -> str:
    # The default namespace keeps the keys it always had; a schema's keys differ,
    # so two namespaces of one database do not serialise each other.
    return key if schema is None else f"{schema}\x00{key}"


def migration_lock_key(schema: str | None) -> int:
    """The second key of the migration lock ``pg_advisory_xact_lock(MIGRATION, key)``.

    0 for the default namespace (as always); a hash of the schema's name
    otherwise, so migrations of different namespaces do not wait for each other.
    """
    return 0 if schema is None else _key_hash(_namespaced("", schema))


def aggregate_try_lock_cte(name: str = "aggregate_lock") -> CTE:
    """The aggregate write lock, if free, as a CTE of a statement that takes it itself (Postgres).

    ``WITH <name> AS (SELECT pg_try_advisory_xact_lock(:ns, :key) AS locked)``,
    bound with :func:`aggregate_lock_params`: the lock :func:`lock_aggregate`
    takes, without waiting for it. A statement whose write requires
    ``<name>.locked`` (true when this statement now holds it) writes only
    while it holds the lock, so a unit holding that aggregate's lock excludes
    it; in autocommit mode the lock ends with the statement. When the lock is
    held elsewhere the statement writes nothing and its caller takes the
    usual path (:func:`lock_aggregate`, which waits). Never waiting inside
    the statement keeps a lost connection during a lock wait where it was: before
    COMMIT (``ConnectionLost``, retried), not inside a statement that is its
    own COMMIT. The statement's fence must be one that Postgres re-checks on
    the row's latest version (an UPDATE's WHERE), never a value read before.
    """
    locked = func.pg_try_advisory_xact_lock(bindparam("ns"), bindparam("key"))
    return select(locked.label("locked")).cte(name)


def aggregate_lock_params(driver: Driver, namespace: int, key: str) -> dict[str, int]:
    """The parameters ``ns`` and ``key`` of the lock of :func:`aggregate_try_lock_cte`."""
    check_text(key, "key")
    return {"ns": namespace, "key": _key_hash(_namespaced(key, driver.schema))}


def lock_aggregate(driver: Driver, namespace: int, key: str, *, shared: bool = False) -> None:
    """Take the write lock of one aggregate for the rest of the transaction.

    Every write operation calls this before its first read
    (docs/decisions.md#one-write-lock-per-aggregate). On SQLite the write
    unit's ``BEGIN IMMEDIATE`` already holds the database-wide write lock, so
    this does nothing. On Postgres it takes
    ``pg_advisory_xact_lock(namespace, crc32(key))``: every read after it
    reflects every committed writer of that aggregate, including rows that do
    not exist yet. Two keys may hash alike; that only serialises them.

    Args:
        driver: the unit of work's driver connection, inside its transaction.
        namespace: a :class:`LockNamespace` constant.
        key: the aggregate id. In a schema (``driver.schema``) the key is
            hashed with the schema's name, so the same id in two namespaces
            takes two different locks.
        shared: take it shared (``pg_advisory_xact_lock_shared``): shared
            holders do not exclude each other, only an exclusive holder. Used
            by commits against blob GC.
    """
    check_text(key, "key")
    if driver.postgres:
        stmt = _LOCK_SHARED_SQL if shared else _LOCK_SQL
        params = aggregate_lock_params(driver, namespace, key)
        if not driver.send_with_begin(stmt, params):
            driver.execute(stmt, params)


def lock_aggregate_and_blobs(driver: Driver, namespace: int, key: str) -> None:
    """:func:`lock_aggregate` of ``key``, then the blob GC lock shared, in one statement.

    For a write that stores blobs (a session commit): the same two locks,
    in the same order, as two :func:`lock_aggregate` calls, in one round trip.
    """
    check_text(key, "key")
    if driver.postgres:
        schema = driver.schema
        params = {
            "ns": namespace,
            "key": _key_hash(_namespaced(key, schema)),
            "gc_ns": LockNamespace.BLOB_GC,
            "gc_key": _key_hash(_namespaced("blobs", schema)),
        }
        if not driver.send_with_begin(_LOCK_WITH_BLOBS_SQL, params):
            driver.execute(_LOCK_WITH_BLOBS_SQL, params)


def join_write(driver: Driver) -> None:
    """Make the host's transaction under ``driver`` fit for a joined write unit.

    SQLite: the transaction must hold the database write lock for as long as
    it lasts (every fence relies on it, like ``BEGIN IMMEDIATE`` in agentkeep's
    own write units). A driver connection with no transaction open (pysqlite
    had not begun one: the host has not written yet) begins ``BEGIN
    IMMEDIATE``, waiting up to the busy timeout. A transaction already begun
    takes the lock with a write that changes nothing: free if it holds the
    lock already, a wait for the lock if it has not read yet; if it has read,
    SQLite cannot upgrade it while another writer holds the lock (immediate
    ``StoreBusy``) or once another writer has committed since its snapshot
    (:class:`~agentkeep.errors.JoinedTransactionStale`). The host's commit or
    rollback ends the transaction, and releases the lock.

    Postgres: the per-aggregate advisory locks are transaction-scoped, so
    they hold until the host's transaction ends. The transaction must be READ
    COMMITTED: at REPEATABLE READ or SERIALIZABLE its snapshot may predate the
    lock, and a write could act on reads older than the last writer's commit.

    Raises:
        JoinedTransactionStale: SQLite, see above; nothing was written.
        StoreBusy: SQLite, the lock could not be had.
        InvalidInput: Postgres, the transaction is not READ COMMITTED.
    """
    raw = driver.raw
    if driver.postgres:
        try:
            cur = raw.cursor()
            cur.execute(_PG_ISOLATION)
            level = str(cur.fetchone()[0])
            cur.close()
        except driver._error as exc:
            raise _translate_driver_error(exc) from exc
        if level not in _PG_JOINABLE:
            raise InvalidInput(
                "join",
                f"the host's transaction is {level.upper()}: a joined write unit needs READ "
                "COMMITTED (its fences wait for a lock, then must read past it); use "
                "store.read(join=...) to read in it, or begin it READ COMMITTED",
            )
        return
    begun = sqlite_in_transaction(raw)
    try:
        if begun:
            form = _SQLITE_WRITE_LOCK.compiled(driver.target)
            plain_sql(raw, form.sql, form.bind({}))
        else:
            plain_sql(raw, _BEGIN_SQL["IMMEDIATE"])
    except sqlite3.Error as exc:
        if getattr(exc, "sqlite_errorcode", None) == _SQLITE_BUSY_SNAPSHOT:
            raise JoinedTransactionStale(
                f"sqlite: {exc}: the host's deferred transaction read a snapshot that another "
                "writer has since committed over; roll it back and run it again, or begin it "
                "IMMEDIATE"
            ) from exc
        error = _translate_driver_error(exc)
        if begun and isinstance(error, StoreBusy):
            raise StoreBusy(
                f"{error}: the host's transaction had already begun (deferred) and could not "
                "take the write lock; roll it back and run it again, or begin it IMMEDIATE"
            ) from exc
        raise error from exc


_PG_ISOLATION: Final = "SELECT current_setting('transaction_isolation')"


@contextmanager
def join_read(driver: Driver) -> Iterator[None]:
    """Hold a joined read unit's reads in one transaction of the host's connection.

    SQLite: a connection pysqlite has not begun a transaction on (the host
    has not written yet) begins a deferred one for the block, so that its
    reads see one snapshot; the unit's SAVEPOINT nests inside it. When the
    block wrote nothing that is still pending (the host may add rows through
    ``uow.session``), that transaction is committed at the end (it only
    read), so the host's connection is left as it was; otherwise it stays
    open for the host to commit. Postgres: nothing to do (the driver has
    begun the host's transaction).
    """
    raw = driver.raw
    if driver.postgres or sqlite_in_transaction(raw):
        yield
        return
    driver._plain(_BEGIN_SQL["DEFERRED"])
    changes = _sqlite_total_changes(raw)
    try:
        yield
    finally:
        if sqlite_in_transaction(raw) and _sqlite_total_changes(raw) == changes:
            driver.commit()


def atomic(driver: Driver, nested: bool) -> AbstractContextManager[None]:
    """The block of one repository operation that must be all or nothing.

    ``nested`` is the unit's: True when the unit may hold other operations
    or a caller that catches this one's error and still commits
    (``store.write()``, ``store.call_write(fn)``). The block then runs in a
    SAVEPOINT, so an error leaves nothing of it. False in a one-call unit,
    whose transaction belongs to this operation alone: its error ends and
    rolls back the whole unit, so no SAVEPOINT is sent (two statements saved;
    on asyncpg a round trip each, on psycopg they ride with other statements:
    :meth:`Driver.savepoint`). Either way the checks of writes
    deferred in the block come before an error raised in it
    (:meth:`Driver.deferred_first`).
    """
    return driver.savepoint() if nested else driver.deferred_first()


@contextmanager
def savepoint(conn: Connection) -> Iterator[None]:
    """Run a block that may roll back only its own work.

    Rolls back to the savepoint when the block raises (and re-raises); the
    enclosing unit of work stays usable. Never the outermost transaction: a
    savepoint cannot be IMMEDIATE.
    """
    with conn.begin_nested():
        yield


# --------------------------------------------------------------------------
# Errors: classification and retry

_PG_TRANSIENT: Final = frozenset({"40001", "40P01", "55P03"})


def is_transient(exc: BaseException) -> bool:
    """True if ``exc`` is a busy/serialisation error after which a retry may succeed.

    SQLite: ``SQLITE_BUSY`` (and its extended codes, including
    ``SQLITE_BUSY_SNAPSHOT``) and ``SQLITE_LOCKED``. Postgres: 40001
    (serialization failure), 40P01 (deadlock), 55P03 (lock not available,
    which includes ``lock_timeout``).
    """
    if isinstance(exc, StoreBusy):
        return True
    orig = exc.orig if isinstance(exc, sa_exc.DBAPIError) else exc
    if isinstance(orig, sqlite3.OperationalError):
        name = getattr(orig, "sqlite_errorname", "") or ""
        if name.startswith(("SQLITE_BUSY", "SQLITE_LOCKED")):
            return True
        msg = str(orig)
        return "database is locked" in msg or "database table is locked" in msg
    sqlstate = getattr(orig, "sqlstate", None)
    return sqlstate in _PG_TRANSIENT


def translate_db_error(exc: sa_exc.DBAPIError) -> DatabaseError:
    """Map a SQLAlchemy-wrapped driver error to a typed one.

    :class:`ConnectionLost` when SQLAlchemy found the connection gone
    (``connection_invalidated``), else :class:`StoreBusy` or :class:`DatabaseError`.
    """
    orig = exc.orig if exc.orig is not None else exc
    if exc.connection_invalidated or _disconnect_sqlstate(orig):
        return ConnectionLost(f"{_prefix(orig)}: {orig}")
    return _translate_driver_error(orig)


def _prefix(orig: BaseException) -> str:
    module = type(orig).__module__
    postgres = module.startswith(("psycopg", "asyncpg")) or "postgres" in module
    return "postgres" if postgres else "sqlite"


def _translate_driver_error(orig: BaseException) -> DatabaseError:
    msg = f"{_prefix(orig)}: {orig}"
    return StoreBusy(msg) if is_transient(orig) else DatabaseError(msg)


#: Postgres SQLSTATE ``in_failed_sql_transaction``: a statement sent in a transaction that
#: an earlier failure aborted (the server's message text may be translated; this is not).
_PG_IN_FAILED_TRANSACTION: Final = "25P02"

#: Postgres SQLSTATEs of a connection that is gone: class 08 (connection
#: exception) and the operator-intervention codes of a terminated backend.
_PG_DISCONNECT: Final = frozenset({"57P01", "57P02", "57P03"})


def _disconnect_sqlstate(orig: BaseException) -> bool:
    state = getattr(orig, "sqlstate", None)
    return isinstance(state, str) and (state.startswith("08") or state in _PG_DISCONNECT)


def _is_disconnect(orig: BaseException, raw: Any, target: CompileTarget) -> bool:
    """True if ``orig`` says the connection under ``raw`` is gone.

    A client-side driver error (no SQLSTATE) is judged by the driver error
    it was raised over: psycopg leaving pipeline mode on a terminated backend
    raises ``OperationalError("cannot exit pipeline mode while busy")`` while
    handling the server's ``AdminShutdown``; that is a lost connection, and a
    COMMIT sent in that pipeline has an unknown outcome. The walk stops at an
    error the server sent (it has its own SQLSTATE) and at agentkeep's own
    errors (an earlier, handled failure of another attempt).
    """
    cause: BaseException | None = orig
    for _ in range(8):  # a bounded walk of __cause__ / __context__
        if cause is None or isinstance(cause, AgentkeepError):
            break
        if _disconnect_sqlstate(cause):
            return True
        if getattr(cause, "sqlstate", None) is not None:
            break
        cause = cause.__cause__ or cause.__context__
    if getattr(raw, "closed", False) or getattr(raw, "broken", False):  # psycopg
        return True
    try:
        return bool(target.dialect.is_disconnect(orig, raw, None))  # type: ignore[arg-type]
    except Exception:  # noqa: BLE001 - a dialect that cannot tell: not a disconnect
        return False


# --------------------------------------------------------------------------
# Opening a database: URLs and the errors of the open path


def check_url(url: object) -> URL:
    """Parse a database URL; refuse what cannot name a database.

    Raises:
        InvalidInput: not a string or :class:`~sqlalchemy.engine.URL`; a NUL
            character or a lone surrogate in it; text SQLAlchemy cannot parse.
            The message never repeats the URL (it may hold a password).
    """
    if isinstance(url, URL):
        text = url.render_as_string(hide_password=False)
    elif isinstance(url, str):
        text = url
    else:
        raise InvalidInput(
            "url", f"expected a URL string or a sqlalchemy Engine, not {type(url).__name__}"
        )
    if "\x00" in text:
        raise InvalidInput("url", "contains a NUL character")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidInput("url", "contains a lone surrogate (not valid UTF-8)") from exc
    try:
        return make_url(text)
    except (sa_exc.ArgumentError, ValueError) as exc:
        raise InvalidInput(
            "url",
            f"not a database URL ({exc}): use sqlite:///path.db or "
            "postgresql+psycopg://user@host/dbname",
        ) from exc


def mask_url(url: str | URL) -> str:
    """``url`` with its password replaced by ``***`` (also for a URL SQLAlchemy cannot parse)."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except (sa_exc.ArgumentError, ValueError):
        text = str(url)
        head, sep, rest = text.partition("://")
        userinfo, at, hostpart = rest.rpartition("@")
        if sep and at and ":" in userinfo:
            user = userinfo.split(":", 1)[0]
            return f"{head}://{user}:***@{hostpart}"
        return text


def sqlite_file(url: str | URL) -> Path | None:
    """The file a SQLite URL opens, or ``None`` (in-memory SQLite, or another backend)."""
    u = make_url(url)
    if u.get_backend_name() != "sqlite" or is_memory_sqlite(
        u.render_as_string(hide_password=False)
    ):
        return None
    database = u.database or ""
    if database.startswith("file:"):  # a URI filename (?uri=true)
        database = database[len("file:") :].split("?", 1)[0]
        if not database or database == ":memory:":
            return None
    return Path(database)


#: What :func:`opening` is given to name the database: a URL, an engine, a connection.
OpenTarget = str | URL | Engine | Connection


@contextmanager
def opening(target: OpenTarget | None) -> Iterator[None]:
    """Raise typed errors for what opening, checking or migrating a database raises.

    Wraps the open path (:meth:`agentkeep.Store.open`,
    :func:`agentkeep.migrations.upgrade`, ...): a driver error (wrapped by
    SQLAlchemy or raw) or an ``OSError`` becomes :func:`open_failure`'s
    typed error, the original chained as ``__cause__``. agentkeep's own
    errors pass unchanged.
    """
    try:
        yield
    except AgentkeepError:
        raise
    except sa_exc.DBAPIError as exc:
        orig = exc.orig if exc.orig is not None else exc
        raise open_failure(orig, target, connecting=exc.statement is None) from exc
    except (sqlite3.Error, OSError) as exc:
        raise open_failure(exc, target) from exc
    except Exception as exc:
        if _driver_module(exc):
            raise open_failure(exc, target) from exc
        raise


def _driver_module(exc: BaseException) -> bool:
    """True for an exception class of a database driver (or SQLAlchemy's async adapters)."""
    module = type(exc).__module__
    return module.split(".")[0] in ("psycopg", "asyncpg", "aiosqlite", "sqlite3") or (
        module.startswith(("sqlalchemy.dialects.", "sqlalchemy.connectors."))
    )


def _target_url(target: OpenTarget | None) -> URL | None:
    try:
        if isinstance(target, (Engine, Connection)):
            return target.engine.url
        if isinstance(target, (str, URL)):
            return make_url(target)
    except (sa_exc.ArgumentError, ValueError):
        pass
    return None


def _sqlite_cause(exc: BaseException) -> sqlite3.Error | None:
    """The ``sqlite3.Error`` behind ``exc`` (itself, or an async adapter's cause)."""
    seen: BaseException | None = exc
    for _ in range(4):
        if seen is None:
            return None
        if isinstance(seen, sqlite3.Error):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


#: SQLite result codes (primary) that say the database file itself cannot be used.
_SQLITE_UNUSABLE: Final = frozenset(
    {"SQLITE_CANTOPEN", "SQLITE_NOTADB", "SQLITE_READONLY", "SQLITE_PERM", "SQLITE_IOERR",
     "SQLITE_CORRUPT", "SQLITE_FULL", "SQLITE_AUTH"}
)  # fmt: skip
#: Postgres SQLSTATEs of a refused connection: class 08 (connection exception),
#: 28 (authorization), 3D000 (unknown database), 57P03 (cannot connect now).
_PG_REFUSED: Final = frozenset({"3D000", "57P03"})


def open_failure(
    exc: BaseException, target: OpenTarget | None, *, connecting: bool = False
) -> DatabaseError:
    """The typed error for a driver error (or ``OSError``) met while opening a database.

    * :class:`~agentkeep.errors.DatabaseUnavailable`: a SQLite file that
      cannot be used (a directory, a missing directory, read-only, not a
      database, corrupt, a full disk) or a Postgres server that refused the
      connection (unreachable, unknown database, authentication);
    * :class:`~agentkeep.errors.StoreBusy`: a lock held elsewhere outlasted
      the busy timeout (a migration running in another process), and
      :class:`~agentkeep.errors.ConnectionLost` for a connection lost in the
      middle (both retryable);
    * :class:`~agentkeep.errors.DatabaseError` otherwise (a statement timeout,
      a refused statement), naming the database.

    Args:
        exc: the driver's error (``DBAPIError.orig``), or an ``OSError``.
        target: the URL, engine or connection being opened.
        connecting: the error came from connecting (no statement ran).
    """
    url = _target_url(target)
    masked = mask_url(url) if url is not None else "the database"
    lite = _sqlite_cause(exc)
    if lite is not None:
        path = None
        try:
            path = sqlite_file(url) if url is not None else None
        except (sa_exc.ArgumentError, ValueError):
            path = None
        reason = _sqlite_unusable(lite, path)
        if reason is not None:
            return DatabaseUnavailable(masked, reason, None if path is None else str(path))
        exc = lite
    elif isinstance(exc, OSError) and not _driver_module(exc):
        return DatabaseUnavailable(masked, f"{type(exc).__name__}: {exc}")
    else:
        state = getattr(exc, "sqlstate", None)
        refused = isinstance(state, str) and (
            state in _PG_REFUSED or state.startswith(("08", "28"))
        )
        if refused or (connecting and state is None):
            return DatabaseUnavailable(masked, _first_line(f"{_prefix(exc)}: {exc}"))
    message = f"{masked}: opening the database: " + _first_line(f"{_prefix(exc)}: {exc}")
    if _disconnect_sqlstate(exc):
        return ConnectionLost(message)
    return StoreBusy(message) if is_transient(exc) else DatabaseError(message)


def _first_line(message: str) -> str:
    """The first line of a driver's message (psycopg adds the statement's LINE and caret)."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    return lines[0] if lines else message


def _sqlite_unusable(exc: sqlite3.Error, path: Path | None) -> str | None:
    """Why SQLite cannot use the file at ``path``, in words (None: not a file problem)."""
    name = getattr(exc, "sqlite_errorname", "") or ""
    primary = "_".join(name.split("_")[:2])
    message = str(exc)
    if primary not in _SQLITE_UNUSABLE and "unable to open database file" not in message:
        return None
    if path is None:
        return f"sqlite: {message}"
    parent = path.parent if str(path.parent) else Path(".")
    try:
        if path.is_dir():
            return f"{path} is a directory, not a database file"
        if not parent.exists():
            return f"the directory {parent} does not exist (nothing was created)"
        if not parent.is_dir():
            return f"{parent} is not a directory"
        if primary == "SQLITE_NOTADB":
            return f"{path} is not a SQLite database (or it is encrypted)"
        if primary == "SQLITE_CORRUPT":
            return f"{path} is corrupt: sqlite: {message}"
        if primary == "SQLITE_FULL":
            return f"the disk holding {path} is full: sqlite: {message}"
        writable = os.access(parent, os.W_OK) and (not path.exists() or os.access(path, os.W_OK))
        if not writable:
            return (
                f"{path} cannot be written (a read-only file system, or no write permission "
                f"on the file or on its directory {parent}): sqlite: {message}"
            )
        if not path.exists():
            return f"{path} does not exist and SQLite could not create it: sqlite: {message}"
        if primary == "SQLITE_READONLY":
            return (
                f"{path} is open read-only (a read-only URL such as ?mode=ro, or a read-only "
                f"file system): agentkeep writes to it: sqlite: {message}"
            )
    except OSError as err:  # the path itself cannot be examined (too long, ...)
        return f"{path} cannot be examined ({err}): sqlite: {message}"
    return f"sqlite cannot open {path}: {message}"


def rollback_after(
    error: BaseException, rollback: Callable[[], object], discard: Callable[[], object]
) -> None:
    """Roll a failed unit back while ``error`` propagates; a failing rollback never replaces it.

    The rollback's own failure (a dead connection, a cancelled driver call)
    is attached to ``error`` as a note naming it, and ``discard`` throws the
    connection away (its transaction state is unknown, it must not be
    pooled again). The caller then re-raises ``error``.
    """
    try:
        rollback()
    except Exception as failure:  # noqa: BLE001 - error is the one to report
        reason = _first_line(f"{type(failure).__name__}: {failure}")
        error.add_note(f"rolling back failed too ({reason}); the connection was discarded")
        discard()


def retry_transient(
    fn: Callable[[], T],
    *,
    attempts: int = 5,
    base_delay_s: float = 0.005,
    max_delay_s: float = 0.5,
    sleep: Callable[[float], object] = time.sleep,
    deadline: float | None = None,
) -> T:
    """Run ``fn`` (a whole unit of work), retrying it on transient errors.

    The retry is bounded and jittered (full jitter, exponential cap). Only
    errors classified by :func:`is_transient` are retried (busy, lock
    timeouts, serialisation failures, a connection lost before COMMIT);
    everything else propagates at once. ``fn`` must be a complete unit of
    work: a retried attempt starts from a fresh transaction, nothing of the
    failed one remains.

    ``sleep`` waits between attempts (the async facade passes one that
    yields to the event loop). ``deadline`` (a :func:`time.monotonic` time)
    ends the retries: no attempt starts, and no pause runs, past it.

    Raises:
        StoreBusy: when every attempt failed transiently, or the deadline passed.
    """
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except (StoreBusy, sa_exc.DBAPIError) as exc:
            delay = random.uniform(0, min(max_delay_s, base_delay_s * (2 ** (attempt - 1))))
            late = deadline is not None and time.monotonic() + delay >= deadline
            if attempt == attempts or late or not is_transient(exc):
                if attempt > 1 or late:
                    if is_transient(exc):
                        observability.retries_exhausted(exc, attempt, attempts, late)
                if isinstance(exc, sa_exc.DBAPIError):
                    raise translate_db_error(exc) from exc
                raise
            observability.retrying(exc, attempt, attempts, delay)
            sleep(delay)
    raise AssertionError("unreachable")  # pragma: no cover
