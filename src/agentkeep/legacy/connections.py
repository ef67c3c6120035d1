"""Connections of the v0.6.34 legacy migrator: opening, fail-fast locks, audit DDL.

Described in docs/legacy-migration.md#locks-and-errors.

The migrator is not a Store operation: it opens its own connection (the
stdlib :mod:`sqlite3` driver, or :mod:`psycopg` for Postgres) so that it
controls exactly which locks it takes and never runs the store's schema
machinery. :func:`open_for_dry_run` and :func:`open_for_apply` return a
:class:`LegacyConnection` whose statements are written once, with ``?``
placeholders.

Locks and fences (each fails at once instead of waiting):

* SQLite dry run: ``file:{path}?mode=ro`` (read-only, never creates the file),
  busy timeout 0, ``PRAGMA query_only``, and one deferred read transaction so
  the whole report comes from one snapshot. A writer holding an exclusive lock
  makes the first read fail with ReadFailed ("database is locked"). No DDL and
  no write ever runs; for a WAL-mode file SQLite itself creates the ``-wal``
  and ``-shm`` side files any reader needs, the database file is untouched.
  A hot journal left by a crashed writer cannot be rolled back read-only: the
  dry run then fails with ReadFailed until a read-write open (an apply, or
  the ordinary store) has recovered the file.
* SQLite apply: ``mode=rw`` (never creates the file), busy timeout 0,
  ``PRAGMA locking_mode = EXCLUSIVE`` and ``BEGIN EXCLUSIVE``. In rollback
  journal mode this fails with WriteFailed while any other connection holds a
  read or write transaction; in WAL mode (where ``BEGIN EXCLUSIVE`` alone does
  not exclude readers) the exclusive locking mode makes it fail while any
  other connection has the file open at all. Once taken, no other connection
  can read or write the file until the migrator's connection closes.
* Postgres dry run: a ``READ ONLY``, ``REPEATABLE READ`` transaction (one
  snapshot) with ``SET LOCAL lock_timeout = '1ms'``: MVCC readers do not wait
  for ordinary writers, and a holder of an ACCESS EXCLUSIVE lock (an apply in
  progress) makes the dry run fail with ReadFailed after 1 ms. Never
  ``lock_timeout = 0``, which means "wait forever".
* Postgres apply: ``SET LOCAL lock_timeout = '1ms'`` then ``LOCK TABLE`` (the
  runtime tables the migrator reads or writes that exist) ``IN ACCESS
  EXCLUSIVE MODE NOWAIT``: WriteFailed (SQLSTATE 55P03) while any other
  transaction holds any lock on them, readers included.

Error variants by phase, the runtime store's ReadFailed and WriteFailed
(docs/runtime.md#errors): a missing SQLite file or Postgres database is
ReadFailed("runtime database does not exist: ..."); other open failures are
ReadFailed for a dry run and WriteFailed for an apply; failing to set the busy
timeout is ReadFailed; taking the apply lock, DDL, DML and COMMIT failures are
WriteFailed; SELECT failures are ReadFailed.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Protocol

from sqlalchemy import Column, LargeBinary, MetaData, Table, Text
from sqlalchemy.dialects import sqlite as _sqlite_dialect
from sqlalchemy.engine import Dialect, make_url
from sqlalchemy.exc import ArgumentError

from agentkeep.errors import InvalidInput
from agentkeep.runtime.errors import ReadFailed, WriteFailed
from agentkeep.statements import CompileTarget, Statement

__all__ = [
    "AUDIT",
    "AUDIT_TABLE",
    "LOCKED_TABLES",
    "LegacyConnection",
    "PostgresTarget",
    "SqliteTarget",
    "open_for_apply",
    "open_for_dry_run",
    "resolve_target",
]

AUDIT_TABLE: Final = "runtime_legacy_v0_6_34_audit"
#: The tables the migrator reads or writes (besides its audit table).
LOCKED_TABLES: Final = (
    "runtime_states",
    "runtime_input_states",
    "runtime_ops_lifecycle",
    "runtime_session_snapshots",
    "runtime_boundary_receipts",
)

_APPEND_ONLY: Final = "legacy migration audit rows are append-only"

#: The audit table, for the migrator's statements. It is not one of the store's
#: models (the migrator creates it with the DDL below, verbatim), so it has a
#: MetaData of its own that the drift check never sees.
AUDIT: Final = Table(
    AUDIT_TABLE,
    MetaData(),
    Column("runtime_id", Text, primary_key=True),
    Column("table_name", Text, primary_key=True),
    Column("row_key", Text, primary_key=True),
    Column("original_record", LargeBinary, nullable=False),
    Column("migrated_record", LargeBinary),
    Column("action", Text, nullable=False),
)

#: The original store's audit table DDL, verbatim (one statement per entry:
#: sqlite3 runs one at a time); see docs/legacy-migration.md#the-audit-table.
_SQLITE_AUDIT_DDL: Final = (
    f"CREATE TABLE IF NOT EXISTS {AUDIT_TABLE} ("
    "runtime_id TEXT NOT NULL, table_name TEXT NOT NULL, row_key TEXT NOT NULL, "
    "original_record BLOB NOT NULL, migrated_record BLOB, "
    "action TEXT NOT NULL CHECK (action IN ('replace', 'delete')), "
    "PRIMARY KEY (runtime_id, table_name, row_key))",
    f"CREATE TRIGGER IF NOT EXISTS {AUDIT_TABLE}_no_update BEFORE UPDATE ON {AUDIT_TABLE} "
    f"BEGIN SELECT RAISE(ABORT, '{_APPEND_ONLY}'); END",
    f"CREATE TRIGGER IF NOT EXISTS {AUDIT_TABLE}_no_delete BEFORE DELETE ON {AUDIT_TABLE} "
    f"BEGIN SELECT RAISE(ABORT, '{_APPEND_ONLY}'); END",
)


def _pg_trigger(name: str, timing: str, level: str) -> str:
    # PG has no CREATE TRIGGER IF NOT EXISTS: guard with a pg_trigger lookup.
    return (
        "DO $$ BEGIN IF NOT EXISTS (SELECT 1 FROM pg_trigger "
        f"WHERE tgrelid = '{AUDIT_TABLE}'::regclass AND tgname = '{AUDIT_TABLE}_{name}') THEN "
        f"CREATE TRIGGER {AUDIT_TABLE}_{name} {timing} ON {AUDIT_TABLE} FOR EACH {level} "
        "EXECUTE FUNCTION runtime_legacy_audit_append_only(); END IF; END $$"
    )


#: The same audit table on Postgres: BYTEA payloads, plpgsql triggers, TRUNCATE
#: blocked too (docs/decisions.md#legacy-migrator-on-both-backends).
_PG_AUDIT_DDL: Final = (
    f"CREATE TABLE IF NOT EXISTS {AUDIT_TABLE} ("
    "runtime_id TEXT NOT NULL, table_name TEXT NOT NULL, row_key TEXT NOT NULL, "
    "original_record BYTEA NOT NULL, migrated_record BYTEA, "
    "action TEXT NOT NULL CHECK (action IN ('replace', 'delete')), "
    "PRIMARY KEY (runtime_id, table_name, row_key))",
    "CREATE OR REPLACE FUNCTION runtime_legacy_audit_append_only() RETURNS trigger "
    f"LANGUAGE plpgsql AS $$ BEGIN RAISE EXCEPTION '{_APPEND_ONLY}'; END $$",
    _pg_trigger("no_update", "BEFORE UPDATE", "ROW"),
    _pg_trigger("no_delete", "BEFORE DELETE", "ROW"),
    _pg_trigger("no_truncate", "BEFORE TRUNCATE", "STATEMENT"),
)


@dataclass(frozen=True, slots=True)
class SqliteTarget:
    """A SQLite database file (``path`` as given)."""

    path: str


@dataclass(frozen=True, slots=True)
class PostgresTarget:
    """A Postgres database (``url`` a SQLAlchemy URL; ``shown`` without the password)."""

    url: str
    shown: str


def resolve_target(url_or_path: str | os.PathLike[str]) -> SqliteTarget | PostgresTarget:
    """Tell a SQLite file (a path or ``sqlite:///path`` URL) from a Postgres URL.

    Raises:
        InvalidInput: an in-memory SQLite URL, an unparsable URL or another backend.
    """
    if isinstance(url_or_path, os.PathLike):
        return SqliteTarget(os.fspath(url_or_path))
    if "://" not in url_or_path:
        return SqliteTarget(url_or_path)
    try:
        url = make_url(url_or_path)
    except ArgumentError as exc:
        raise InvalidInput("url", f"cannot parse {url_or_path!r}: {exc}") from exc
    backend = url.get_backend_name()
    if backend == "sqlite":
        database = url.database or ""
        if database in ("", ":memory:") or url.query.get("mode") == "memory":
            raise InvalidInput("url", "an in-memory SQLite database holds no legacy rows")
        return SqliteTarget(database)
    if backend == "postgresql":
        return PostgresTarget(
            url.render_as_string(hide_password=False), url.render_as_string(hide_password=True)
        )
    raise InvalidInput("url", f"unsupported backend {backend!r}: use sqlite or postgresql")


class LegacyConnection(Protocol):
    """One migrator connection with its transaction already open (see the module docstring)."""

    #: What the migrator's statements are compiled for on this connection.
    target: CompileTarget

    def table_exists(self, table: str) -> bool:
        """True if ``table`` exists. Raises ReadFailed."""
        ...

    def select(self, stmt: Statement, params: Mapping[str, Any]) -> list[tuple[Any, ...]]:
        """Run a query; return all rows. Raises ReadFailed."""
        ...

    def write(self, stmt: Statement, params: Mapping[str, Any]) -> int:
        """Run a DML statement; return the row count. Raises WriteFailed."""
        ...

    def create_audit_table(self) -> None:
        """Create the audit table and its append-only triggers if absent. Raises WriteFailed."""
        ...

    def commit(self) -> None:
        """Commit. Raises WriteFailed."""
        ...

    def close(self) -> None:
        """Close; anything not committed is rolled back."""
        ...


# --------------------------------------------------------------------------
# SQLite


def _missing(shown: str) -> ReadFailed:
    return ReadFailed(f"runtime database does not exist: {shown}")


class _SqliteConnection:
    target = CompileTarget.of(_sqlite_dialect.dialect(paramstyle="named"))

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn

    def table_exists(self, table: str) -> bool:
        rows = self._select(
            "SELECT EXISTS(SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?)",
            (table,),
        )
        return bool(rows[0][0])

    def select(self, stmt: Statement, params: Mapping[str, Any]) -> list[tuple[Any, ...]]:
        form = stmt.compiled(self.target)
        return self._select(form.sql, form.bind(params))

    def _select(self, sql: str, params: Any) -> list[tuple[Any, ...]]:
        try:
            return [tuple(r) for r in self._conn.execute(sql, params).fetchall()]
        except sqlite3.Error as exc:
            raise ReadFailed(str(exc)) from exc

    def write(self, stmt: Statement, params: Mapping[str, Any]) -> int:
        form = stmt.compiled(self.target)
        return self._write(form.sql, form.bind(params))

    def _write(self, sql: str, params: Any = ()) -> int:
        try:
            return self._conn.execute(sql, params).rowcount
        except sqlite3.Error as exc:
            raise WriteFailed(str(exc)) from exc

    def create_audit_table(self) -> None:
        for statement in _SQLITE_AUDIT_DDL:
            self._write(statement)

    def commit(self) -> None:
        self._write("COMMIT")

    def close(self) -> None:
        self._conn.close()


def _sqlite_connect(
    path: str, mode: str, error: type[ReadFailed | WriteFailed]
) -> sqlite3.Connection:
    if not os.path.isfile(path):
        raise _missing(path)
    uri = f"{Path(path).resolve().as_uri()}?mode={mode}"  # no "c": never creates the file
    try:
        conn = sqlite3.connect(
            uri, uri=True, timeout=0.0, isolation_level=None, check_same_thread=False
        )
    except sqlite3.Error as exc:
        raise error(str(exc)) from exc
    try:
        conn.execute("PRAGMA busy_timeout = 0")
    except sqlite3.Error as exc:
        conn.close()
        raise ReadFailed(str(exc)) from exc
    return conn


def _sqlite_run(conn: sqlite3.Connection, sql: str, error: type[ReadFailed | WriteFailed]) -> None:
    try:
        conn.execute(sql)
    except sqlite3.Error as exc:
        conn.close()
        raise error(str(exc)) from exc


# --------------------------------------------------------------------------
# Postgres


def _psycopg_dialect() -> Dialect:
    from sqlalchemy.dialects.postgresql import psycopg

    dialect: Dialect = psycopg.dialect()  # type: ignore[no-untyped-call]
    return dialect


class _PostgresConnection:
    target = CompileTarget.of(_psycopg_dialect())

    def __init__(self, conn: Any) -> None:
        import psycopg

        self._conn = conn
        self._error: type[Exception] = psycopg.Error

    def table_exists(self, table: str) -> bool:
        return bool(self._select(_pg_sql("SELECT to_regclass(?) IS NOT NULL"), (table,))[0][0])

    def select(self, stmt: Statement, params: Mapping[str, Any]) -> list[tuple[Any, ...]]:
        form = stmt.compiled(self.target)
        return self._select(form.sql, form.bind(params))

    def _select(self, sql: str, params: Any) -> list[tuple[Any, ...]]:
        try:
            return [tuple(r) for r in self._conn.execute(sql, params).fetchall()]
        except self._error as exc:
            raise ReadFailed(str(exc).strip()) from exc

    def write(self, stmt: Statement, params: Mapping[str, Any]) -> int:
        form = stmt.compiled(self.target)
        return self._write(form.sql, form.bind(params))

    def _write(self, sql: str, params: Any = None) -> int:
        try:
            rowcount: int = self._conn.execute(sql, params).rowcount
        except self._error as exc:
            raise WriteFailed(str(exc).strip()) from exc
        return rowcount

    def create_audit_table(self) -> None:
        for statement in _PG_AUDIT_DDL:
            self._write(_pg_sql(statement))

    def commit(self) -> None:
        try:
            self._conn.commit()
        except self._error as exc:
            raise WriteFailed(str(exc).strip()) from exc

    def close(self) -> None:
        self._conn.close()


def _pg_sql(sql: str) -> str:
    return sql.replace("?", "%s")


def _pg_connect(target: PostgresTarget, error: type[ReadFailed | WriteFailed]) -> Any:
    try:
        import psycopg
        from psycopg.conninfo import make_conninfo
    except ImportError as exc:  # pragma: no cover - psycopg is in the postgres extra
        raise error(f"psycopg is required for Postgres: {exc}") from exc
    url = make_url(target.url)
    query = {k: v if isinstance(v, str) else v[-1] for k, v in url.query.items()}
    query.setdefault("connect_timeout", "10")
    conninfo = make_conninfo(
        host=url.host,
        port=url.port,
        user=url.username,
        password=url.password,
        dbname=url.database,
        **query,
    )
    try:
        return psycopg.connect(conninfo, autocommit=False)
    except psycopg.Error as exc:
        if f'database "{url.database}" does not exist' in str(exc):
            raise _missing(target.shown) from exc
        raise error(str(exc).strip()) from exc


def _pg_begin(conn: Any, statements: Sequence[str], error: type[ReadFailed | WriteFailed]) -> None:
    import psycopg

    try:
        for statement in statements:
            conn.execute(statement)
    except psycopg.Error as exc:
        conn.close()
        raise error(str(exc).strip()) from exc


# --------------------------------------------------------------------------
# Entry points


def open_for_dry_run(target: SqliteTarget | PostgresTarget) -> LegacyConnection:
    """Open read-only, inside one read snapshot, failing fast on a lock.

    Raises:
        ReadFailed: the database does not exist, cannot be opened or is locked.
    """
    if isinstance(target, SqliteTarget):
        conn = _sqlite_connect(target.path, "ro", ReadFailed)
        _sqlite_run(conn, "PRAGMA query_only = ON", ReadFailed)
        _sqlite_run(conn, "BEGIN DEFERRED", ReadFailed)
        return _SqliteConnection(conn)
    import psycopg

    pg = _pg_connect(target, ReadFailed)
    pg.read_only = True
    pg.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
    _pg_begin(pg, ["SET LOCAL lock_timeout = '1ms'"], ReadFailed)
    return _PostgresConnection(pg)


def open_for_apply(target: SqliteTarget | PostgresTarget) -> LegacyConnection:
    """Open read-write and take the exclusive migration lock without waiting.

    Raises:
        ReadFailed: the database does not exist, or the busy timeout cannot be set.
        WriteFailed: the database cannot be opened read-write, or another
            connection holds a conflicting lock.
    """
    if isinstance(target, SqliteTarget):
        conn = _sqlite_connect(target.path, "rw", WriteFailed)
        _sqlite_run(conn, "PRAGMA locking_mode = EXCLUSIVE", WriteFailed)
        _sqlite_run(conn, "BEGIN EXCLUSIVE", WriteFailed)
        return _SqliteConnection(conn)
    pg = _pg_connect(target, WriteFailed)
    _pg_begin(pg, ["SET LOCAL lock_timeout = '1ms'"], WriteFailed)
    wrapped = _PostgresConnection(pg)
    try:
        present = [t for t in LOCKED_TABLES if wrapped.table_exists(t)]
    except ReadFailed:
        pg.close()
        raise
    if present:
        _pg_begin(
            pg, [f"LOCK TABLE {', '.join(present)} IN ACCESS EXCLUSIVE MODE NOWAIT"], WriteFailed
        )
    return wrapped
