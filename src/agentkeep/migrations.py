"""Schema migrations: upgrade, downgrade, stamp, current, check, adoption, and the host's Alembic.

There is one Alembic history (``alembic/versions``; the wheel carries the same
scripts as ``agentkeep/_alembic``) with one branch per store (labels ``runs``,
``sessions``, ``runtime``) merged to one head, and the version table
``agentkeep_alembic_version``, so it never collides with a host application's
own Alembic.

Every command here drives Alembic's :class:`~alembic.runtime.migration.MigrationContext`
and :class:`~alembic.script.ScriptDirectory` directly on one connection, with an
isolated configuration; none goes through ``alembic.context`` (the global proxy
a host's ``env.py`` is using while it calls :func:`upgrade`). The ``op`` proxy
the revision scripts call is installed for the length of the run and put back
as it was.

What a target is: a URL string or an :class:`~sqlalchemy.engine.Engine`
(agentkeep opens, commits and closes its own connection), or a
:class:`~sqlalchemy.engine.Connection` (the caller's; see :func:`upgrade`).

Invariants (the fence of every command that writes):

* A migration is one transaction holding the migration lock: on SQLite the
  database write lock (``BEGIN IMMEDIATE``, or a write taken first inside a
  transaction the caller already holds), so adoption, stamp, every revision
  and the final verification commit or roll back together; on Postgres
  additionally ``pg_advisory_xact_lock(MIGRATION, 0)`` so hosts booting at once
  migrate one after the other.
* Tables are never created without being stamped (they are created by the
  revisions, in the transaction that writes the version row).
* A database stamped with a revision this code does not know is refused with
  :class:`~agentkeep.errors.SchemaNewer` naming both revisions; nothing is changed.
* An un-versioned database that already holds a store's tables (written by the
  original Rust stores) is adopted: the store's adopter fingerprints the
  tables, the branch is stamped at the matching revision, and everything is
  upgraded to head with the rows intact. A shape that matches no revision is
  refused with :class:`~agentkeep.errors.LegacySchemaMismatch` and the database
  is left as it was (the transaction rolls back before anything is written).
* An upgrade to head is verified against the models (the drift check); a
  difference rolls everything back with :class:`~agentkeep.errors.SchemaError`.
* :func:`stamp` never leaves a database claiming a revision its tables do not
  have: it proves, in a savepoint rolled back afterwards, that upgrading from
  the stamped revision reaches the models without drift.
* Read-only functions (:func:`current`, :func:`check`) never create a SQLite
  file; :func:`downgrade` and :func:`stamp` refuse a missing file with
  :class:`~agentkeep.errors.DatabaseMissing`.

For a host application's Alembic project, :func:`include_object` hides
agentkeep's objects from the host's autogenerate and ``alembic check``, and
``agentkeep.migrate(connection)`` (:func:`upgrade`) brings agentkeep to head on
the host's connection from its ``env.py`` (README, "Using agentkeep in your
Alembic project").

Namespaces: every command takes ``schema=`` (keyword-only), the namespace of
agentkeep's tables (see :mod:`agentkeep.db`), and then touches nothing outside it:

* Postgres: the revisions run in the schema (created first when missing, and
  logged), with the version table ``<schema>.agentkeep_alembic_version``.
  The connection carries the schema map ``{None: schema}`` (tables, indexes
  and sequences the revisions create through SQLAlchemy constructs are
  qualified) and, for the length of the command, ``SET LOCAL search_path``
  to the schema alone: what Alembic renders unqualified (``ALTER TABLE``,
  ``DROP INDEX``), the plain SQL of revisions, the adopters' and the drift
  check's reflection all resolve there and never in the host's schemas. The
  connection's previous ``search_path`` and schema map are put back after.
  The migration lock's second key is the schema's hash
  (:func:`agentkeep.db.migration_lock_key`).
* SQLite: the namespace is its own file (:func:`agentkeep.db.sqlite_schema_file`),
  and the commands run on that file as its main database, exactly as on a
  database without a namespace: the host's file is not opened
  (docs/decisions.md#a-sqlite-namespace-is-an-attached-file).
"""

from __future__ import annotations

import functools
import io
import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, Final, ParamSpec, TextIO, TypeVar

from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.operations import Operations
from alembic.runtime.migration import MigrationContext
from alembic.script import Script, ScriptDirectory
from alembic.util.exc import CommandError
from sqlalchemy import (
    Column,
    Connection,
    Engine,
    MetaData,
    PrimaryKeyConstraint,
    String,
    Table,
    make_url,
    text,
)
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import URL
from sqlalchemy.engine.mock import MockConnection
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.schema import CreateTable
from sqlalchemy.sql.base import Executable
from sqlalchemy.sql.elements import ClauseElement

from agentkeep import db
from agentkeep.base import load_all_models, table_applies
from agentkeep.errors import (
    DatabaseMissing,
    InvalidInput,
    SchemaBehind,
    SchemaError,
    SchemaNewer,
)

__all__ = [
    "VERSION_TABLE",
    "check",
    "current",
    "downgrade",
    "ensure_schema",
    "head_revisions",
    "include_object",
    "include_object_for",
    "NOT_MIGRATED",
    "mask_url",
    "require_database",
    "run_env",
    "script_directory",
    "script_location",
    "sqlite_file",
    "stamp",
    "unknown_revisions",
    "upgrade",
    "upgrade_sql",
]

VERSION_TABLE: Final = "agentkeep_alembic_version"

_log = logging.getLogger(__name__)

# Alembic's `op` is a module-global proxy: one migration run at a time per
# process. Other processes are serialised by the database lock. Re-entrant: a
# host's env.py (or one of its revisions) may call upgrade() while it holds it.
_ALEMBIC_LOCK = threading.RLock()

Adopter = Callable[[Connection], "str | None"]
#: What the commands accept: a URL, an engine, or the caller's connection.
Target = str | Engine | Connection


def _adopters() -> dict[str, Adopter]:
    """Branch label -> function returning the revision to stamp for legacy tables.

    An adopter returns ``None`` when its store's tables are absent (a fresh
    database for that branch) and raises ``LegacySchemaMismatch`` for an
    unknown shape.
    """
    from agentkeep.runs.adoption import detect_runs_revision
    from agentkeep.runtime.adoption import detect_runtime_revision
    from agentkeep.sessions.adoption import detect_sessions_revision

    return {
        "runs": detect_runs_revision,
        "sessions": detect_sessions_revision,
        "runtime": detect_runtime_revision,
    }


# --------------------------------------------------------------------------
# URLs


def mask_url(url: str) -> str:
    """``url`` with its password replaced by ``***`` (also for a URL SQLAlchemy cannot parse)."""
    return db.mask_url(url)


def sqlite_file(url: str) -> Path | None:
    """The file a SQLite URL opens, or ``None`` (in-memory SQLite, or another backend)."""
    return db.sqlite_file(url)


def require_database(url: str, *, command: str = "agentkeep upgrade") -> None:
    """Refuse a SQLite URL whose file does not exist, without creating it.

    Args:
        url: the database URL.
        command: what the error suggests to create and migrate the file.

    Raises:
        DatabaseMissing: the file is missing (other URLs pass).
    """
    db.check_url(url)
    path = sqlite_file(url)
    if path is not None and not path.exists():
        raise DatabaseMissing(mask_url(url), str(path), command)


def _missing_database(target: Target) -> bool:
    if not isinstance(target, str):
        return False
    path = sqlite_file(target)
    return path is not None and not path.exists()


P = ParamSpec("P")
T = TypeVar("T")


def _typed_errors(command: Callable[P, T]) -> Callable[P, T]:
    """A public command's errors are agentkeep's: the target is checked, driver errors typed.

    The target (first argument) must be a URL, an engine or a connection
    (:class:`~agentkeep.errors.InvalidInput` otherwise, also for a URL that
    does not parse); what the database or the file system raises comes out
    as :func:`agentkeep.db.open_failure`'s typed error
    (:class:`~agentkeep.errors.DatabaseUnavailable`, ...), the driver's
    error chained.
    """

    @functools.wraps(command)
    def typed(*args: P.args, **kwargs: P.kwargs) -> T:
        target = args[0] if args else next(iter(kwargs.values()), None)
        if isinstance(target, (str, URL)):
            db.check_url(target)
        elif not isinstance(target, (Engine, Connection, MockConnection)):
            raise InvalidInput(
                "target",
                f"expected a database URL, an Engine or a Connection, not {type(target).__name__}",
            )
        with db.opening(target if not isinstance(target, MockConnection) else None):
            return command(*args, **kwargs)

    return typed


# --------------------------------------------------------------------------
# Scripts and configuration


def script_location() -> str:
    """The directory holding ``env.py`` and ``versions/``.

    The copy inside the installed package (``agentkeep/_alembic``) when it
    exists, else the repository's ``alembic/`` (an editable install).
    """
    here = Path(__file__).resolve().parent
    shipped = here / "_alembic"
    if (shipped / "env.py").is_file():
        return str(shipped)
    repo = here.parent.parent / "alembic"
    if (repo / "env.py").is_file():
        return str(repo)
    raise SchemaError(f"agentkeep's migration scripts are missing (looked in {shipped} and {repo})")


def _config() -> Config:
    """An isolated Alembic configuration of agentkeep's scripts (no ini file, no proxies)."""
    cfg = Config()
    location = script_location()
    cfg.set_main_option("script_location", location)
    cfg.set_main_option("version_locations", str(Path(location) / "versions"))
    cfg.set_main_option("path_separator", "os")
    return cfg


@cache
def script_directory() -> ScriptDirectory:
    """agentkeep's migration scripts (read once per process)."""
    return ScriptDirectory.from_config(_config())


_script = script_directory


def head_revisions() -> tuple[str, ...]:
    """The head revisions of the migration history (one, once the branches merge)."""
    return tuple(sorted(_script().get_heads()))


@contextmanager
def _quiet_alembic() -> Iterator[None]:
    """Hold Alembic's INFO lines back while agentkeep sets up contexts and compares.

    Every context agentkeep opens would log "Context impl ..." into the host's
    ``alembic`` output, and the drift check its reflection notes; the lines
    that matter ("Running upgrade ...") are logged outside this block.
    """
    logger = logging.getLogger("alembic")
    if not logger.isEnabledFor(logging.INFO):
        yield
        return
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


def _schema_of(conn: Connection) -> str | None:
    """The namespace :func:`_in_namespace` put the connection in (None: the default)."""
    schemas = conn.get_execution_options().get("schema_translate_map")
    return schemas.get(None) if schemas else None


def _migration_context(conn: Connection, **opts: Any) -> MigrationContext:
    with _quiet_alembic():
        return MigrationContext.configure(
            conn,
            opts={
                "version_table": VERSION_TABLE,
                "version_table_schema": _schema_of(conn),
                **opts,
            },
        )


def _current(conn: Connection) -> tuple[str, ...]:
    return tuple(sorted(_migration_context(conn).get_current_heads()))


def _branches_of(revision: str) -> set[str]:
    labels: set[str] = set()
    for rev in _script().iterate_revisions(revision, "base"):
        if rev is not None:
            labels.update(rev.branch_labels)
    return labels


def unknown_revisions(current: tuple[str, ...]) -> tuple[str, ...]:
    """The revisions in ``current`` that this code does not know (written by a newer one)."""
    unknown = []
    for rev in current:
        try:
            _script().get_revision(rev)
        except CommandError:
            unknown.append(rev)
    return tuple(unknown)


def _refuse_unknown(current: tuple[str, ...]) -> None:
    unknown = unknown_revisions(current)
    if unknown:
        raise SchemaNewer(unknown, head_revisions())


@contextmanager
def _revision_errors(action: str, revision: str) -> Iterator[None]:
    """Alembic's errors about a revision argument, as :class:`SchemaError`."""
    try:
        yield
    except CommandError as exc:
        raise SchemaError(f"{action} {revision!r}: {exc}") from exc


def _version_table() -> Table:
    """The version table exactly as Alembic declares it (``version_num`` primary key)."""
    return Table(
        VERSION_TABLE,
        MetaData(),
        Column("version_num", String(32), nullable=False),
        PrimaryKeyConstraint("version_num", name=f"{VERSION_TABLE}_pkc"),
    )


# --------------------------------------------------------------------------
# Running revisions on one connection


_MISSING: Final = object()


@contextmanager
def _op_proxy(ctx: MigrationContext) -> Iterator[None]:
    """Install Alembic's ``op`` for ``ctx`` and put the module back exactly as it was."""
    import alembic.op as op_module

    namespace = vars(op_module)
    saved = dict(namespace)
    try:
        with Operations.context(ctx):
            yield
    finally:
        for key in [k for k in namespace if k not in saved]:
            del namespace[key]
        for key, value in saved.items():
            if namespace.get(key, _MISSING) is not value:
                namespace[key] = value


StepsFn = Callable[[Any, MigrationContext], Iterable[Any]]


def _run(conn: Connection, steps: StepsFn) -> None:
    """Run the revision steps ``steps`` returns inside the connection's transaction."""
    ctx = _migration_context(conn, fn=steps, target_metadata=load_all_models())
    with _op_proxy(ctx):
        ctx.run_migrations()


def _upgrade_steps(revision: str) -> StepsFn:
    return lambda rev, _ctx: _script()._upgrade_revs(revision, rev)


def _downgrade_steps(revision: str) -> StepsFn:
    return lambda rev, _ctx: _script()._downgrade_revs(revision, rev)


def _as_engine(url_or_engine: str | Engine) -> tuple[Engine, bool]:
    if isinstance(url_or_engine, Engine):
        return url_or_engine, False
    return db.create_engine(url_or_engine), True


@contextmanager
def _engine_for(url_or_engine: str | Engine) -> Iterator[Engine]:
    engine, owned = _as_engine(url_or_engine)
    try:
        yield engine
    finally:
        if owned:
            engine.dispose()


def _pg_migration_lock(conn: Connection, schema: str | None) -> None:
    conn.execute(
        text("SELECT pg_advisory_xact_lock(:ns, :key)"),
        {"ns": db.LockNamespace.MIGRATION, "key": db.migration_lock_key(schema)},
    )


@contextmanager
def _migration_transaction(engine: Engine, schema: str | None = None) -> Iterator[Connection]:
    """agentkeep's own write transaction holding the migration lock, committed on success."""
    with db.write_engine(engine).connect() as conn, conn.begin():
        if db.is_postgres(conn):
            _pg_migration_lock(conn, schema)
        yield conn


# --------------------------------------------------------------------------
# Namespaces


def _resolve(target: Target, schema: str | None) -> tuple[Target, str | None]:
    """The target a command runs on, and the Postgres schema it runs in.

    SQLite: a namespace is its own file, so the target becomes that file's
    URL and the schema None (the file is the main database of the command's
    connection). Postgres: unchanged.

    Raises:
        InvalidInput: an invalid name, or a namespace of an in-memory SQLite database.
    """
    if schema is None:
        return target, None
    db.check_schema_name(schema)
    if isinstance(target, str):
        backend = make_url(target).get_backend_name()
    else:
        backend = target.dialect.name
    if backend != "sqlite":
        return target, schema
    main: str | Path | None
    if isinstance(target, Connection):
        driver: Any = target.connection.dbapi_connection
        cur = driver.cursor()
        cur.execute("PRAGMA database_list")
        rows = cur.fetchall()
        cur.close()
        main = next((row[2] for row in rows if row[1] == "main"), None) or None
    else:
        url = target if isinstance(target, str) else str(target.url)
        main = sqlite_file(url)
    if main is None:
        raise InvalidInput(
            "schema",
            "an in-memory SQLite database has no file to keep the namespace in: "
            "use a database file (or no schema)",
        )
    return f"sqlite:///{db.sqlite_schema_file(main, schema)}", None


def _create_sqlite_file(url: str) -> None:
    """Create the SQLite file of ``url`` (empty, mode 0600) when missing, as a plain upgrade would.

    A file that cannot be created (a missing directory) is left for the
    upgrade's own connection to report.
    """
    path = sqlite_file(url) if make_url(url).get_backend_name() == "sqlite" else None
    if path is not None:
        try:
            db.create_private_file(path)
        except OSError:
            pass


def _create_schema(conn: Connection, schema: str) -> None:
    exists = conn.execute(
        text("SELECT 1 FROM pg_catalog.pg_namespace WHERE nspname = :s"), {"s": schema}
    ).first()
    if exists is None:
        _log.info("creating schema %s for agentkeep's tables", schema)
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))


@contextmanager
def _in_namespace(
    conn: Connection, schema: str | None, *, create: bool = False
) -> Iterator[Connection]:
    """Run a command's statements in agentkeep's namespace ``schema`` on ``conn``.

    The connection gets the schema map ``{None: schema}`` (None: no map, also
    when the caller's connection had one of its own); on Postgres with a
    schema, the schema is created when ``create`` is true and missing, and
    ``search_path`` is set to it alone for the transaction. Both are put back
    as they were afterwards.
    """
    previous = conn.get_execution_options().get("schema_translate_map")
    conn.execution_options(schema_translate_map=db.schema_map(schema))
    saved_path: str | None = None
    try:
        if schema is not None and db.is_postgres(conn):
            if create:
                _create_schema(conn, schema)
            saved_path = conn.execute(text("SELECT current_setting('search_path')")).scalar_one()
            conn.execute(text(f'SET LOCAL search_path TO "{schema}"'))
        yield conn
    except BaseException:
        if saved_path is not None:
            try:  # the transaction may be aborted; its rollback undoes SET LOCAL anyway
                _restore_search_path(conn, saved_path)
            except sa_exc.DBAPIError:
                pass
        raise
    else:
        if saved_path is not None:
            _restore_search_path(conn, saved_path)
    finally:
        conn.execution_options(schema_translate_map=previous)


def _restore_search_path(conn: Connection, path: str) -> None:
    conn.execute(text("SELECT set_config('search_path', :p, true)"), {"p": path})


def _sqlite_write_lock(conn: Connection) -> None:
    """Take the SQLite write lock inside the open transaction: a write that changes nothing.

    SQLite has no statement that turns a deferred transaction into a writer;
    the first write does. The version table is created if missing (a write
    when it is) and a ``DELETE ... WHERE 1 = 0`` on it is a write in every
    case. If another connection committed since this transaction first read,
    SQLite refuses at once with "database is locked" rather than let a stale
    reader migrate.
    """
    conn.execute(CreateTable(_version_table(), if_not_exists=True))
    conn.execute(text(f"DELETE FROM {VERSION_TABLE} WHERE 1 = 0"))


@contextmanager
def _on_connection(conn: Connection, schema: str | None = None) -> Iterator[Connection]:
    """Hold the migration lock on the caller's connection; commit only what this call began.

    * Postgres: ``pg_advisory_xact_lock`` inside the connection's transaction
      (held until its owner commits), or inside a transaction begun and
      committed here when the connection has none.
    * SQLite: when the driver connection is already inside a transaction
      (the host wrote in it, or began it explicitly), the write lock is taken
      inside it and the owner commits. Otherwise (Alembic's SQLite default: no
      transactional DDL, each host revision committed on its own, at most an
      SQLAlchemy-level read left open) this call runs its own ``BEGIN
      IMMEDIATE`` ... ``COMMIT`` on the driver connection, so agentkeep's
      upgrade is committed even though the host's connection is then closed
      with a rollback.
    """
    began = None if conn.in_transaction() else conn.begin()
    try:
        if db.is_postgres(conn):
            _pg_migration_lock(conn, schema)
            yield conn
        elif conn.dialect.name == "sqlite":
            with _sqlite_own_or_joined(conn):
                yield conn
        else:
            raise SchemaError(
                f"unsupported backend {conn.dialect.name!r}: agentkeep runs on sqlite or postgresql"
            )
    except BaseException:
        if began is not None:
            began.rollback()
        raise
    if began is not None:
        began.commit()


@contextmanager
def _sqlite_own_or_joined(conn: Connection) -> Iterator[None]:
    driver: Any = conn.connection.dbapi_connection
    if conn.dialect.driver not in ("pysqlite", "aiosqlite"):
        raise SchemaError(f"unsupported SQLite driver {conn.dialect.driver}: use sqlite3")
    if db.sqlite_in_transaction(driver):
        _sqlite_write_lock(conn)
        yield
        return
    # Plain SQL, not driver.commit(): it also works with sqlite3's autocommit=True.
    db.plain_sql(driver, "BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        if db.sqlite_in_transaction(driver):
            db.plain_sql(driver, "ROLLBACK")
        raise
    db.plain_sql(driver, "COMMIT")


# --------------------------------------------------------------------------
# Offline (--sql)


class _Verbatim(Executable, ClauseElement):
    """SQL text handed to a host's offline output unchanged (no bind-parameter parsing)."""

    inherit_cache = False

    def __init__(self, sql: str) -> None:
        self.sql = sql


@compiles(_Verbatim)
def _compile_verbatim(element: _Verbatim, compiler: Any, **kw: Any) -> str:
    return element.sql


def _offline(
    dialect: Any, revision: str, *, standalone: bool, schema: str | None = None
) -> tuple[str, tuple[str, ...]]:
    """The upgrade to ``revision`` as SQL text, and the revisions it stamps.

    ``revision`` may be ``FROM:TO`` (default start: base). ``standalone`` wraps
    it in its own transaction (``agentkeep upgrade --sql``); otherwise it is
    bare, for the transaction block of a host's offline run. Nothing is
    returned for an unknown revision (SchemaError), so no partial script is
    ever written. ``schema`` (Postgres only): the script creates the schema
    if missing, sets ``search_path`` to it for the revisions, stamps
    ``<schema>.agentkeep_alembic_version``, and puts ``search_path`` back.
    """
    start, sep, end = revision.partition(":")
    destination = end if sep else revision
    starting_rev = (start or None) if sep else None
    output = io.StringIO()
    with _ALEMBIC_LOCK, _revision_errors("upgrade --sql to", revision):
        stamped = _script().get_revisions(destination)
        with _quiet_alembic():
            ctx = MigrationContext.configure(
                dialect=dialect,
                opts={
                    "as_sql": True,
                    "output_buffer": output,
                    "literal_binds": True,
                    "version_table": VERSION_TABLE,
                    "version_table_schema": schema,
                    "starting_rev": starting_rev,
                    "fn": _upgrade_steps(destination),
                    "target_metadata": load_all_models(),
                },
            )
        postgres = dialect.name == "postgresql"
        if standalone:
            ctx.execute("BEGIN" if postgres else "BEGIN IMMEDIATE")
        if postgres:
            ctx.execute(
                f"SELECT pg_advisory_xact_lock({int(db.LockNamespace.MIGRATION)}, "
                f"{db.migration_lock_key(schema)})"
            )
            if schema is not None:
                ctx.execute(f'CREATE SCHEMA IF NOT EXISTS "{schema}"')
                ctx.execute(
                    "SELECT set_config('agentkeep.search_path', current_setting('search_path'), "
                    "true)"
                )
                ctx.execute(f'SET LOCAL search_path TO "{schema}"')
        with _op_proxy(ctx):
            ctx.run_migrations()
        if postgres and schema is not None:
            ctx.execute(
                "SELECT set_config('search_path', current_setting('agentkeep.search_path'), true)"
            )
        if standalone:
            ctx.execute("COMMIT")
    return output.getvalue(), tuple(sorted(s.revision for s in stamped if isinstance(s, Script)))


@_typed_errors
def upgrade_sql(
    url: str,
    revision: str = "heads",
    *,
    output: TextIO | None = None,
    schema: str | None = None,
) -> tuple[str, ...]:
    """Write the SQL of an upgrade for ``url``'s dialect, without connecting (offline mode).

    The script is one transaction (Postgres: with the migration advisory
    lock) creating the version table and every revision from base, or from
    ``FROM`` when ``revision`` is ``FROM:TO``. Adoption, refusal of unknown
    revisions and the drift check need the database and do not happen here.

    With ``schema``: on Postgres the script runs the revisions in that schema
    (creating it if missing); on SQLite it is the script of the namespace's
    own file, named in a comment on its first line (apply it to that file).

    Args:
        url: only its dialect (and, for a SQLite namespace, its file name) is
            used; no database is opened or created.
        revision: the target, or ``FROM:TO``.
        output: where the SQL goes (default ``sys.stdout``).
        schema: the namespace of agentkeep's tables (default: none).

    Returns:
        The revisions the script stamps.

    Raises:
        SchemaError: an unknown revision.
    """
    import sys

    schema_name = db.check_schema_name(schema)
    try:
        dialect = make_url(url).get_dialect()()
    except sa_exc.ArgumentError as exc:  # no such dialect or driver
        raise InvalidInput("url", f"{exc}: use sqlite or postgresql") from exc
    header = ""
    if schema is not None and dialect.name == "sqlite":
        target, schema = _resolve(url, schema)
        path = sqlite_file(str(target))
        header = f"-- agentkeep's namespace {schema_name}: apply this script to the file {path}\n\n"
    sql, revisions = _offline(dialect, revision, standalone=True, schema=schema)
    (output or sys.stdout).write(header + sql)
    return revisions


def _upgrade_into_host_output(
    mock: MockConnection, revision: str, schema: str | None
) -> tuple[str, ...]:
    if schema is not None and mock.dialect.name != "postgresql":
        raise SchemaError(
            "a SQLite namespace lives in its own file, which a host's offline script cannot "
            f"write: get its SQL with `agentkeep upgrade --sql --schema {schema} URL` and apply "
            "it to the file named there"
        )
    sql, revisions = _offline(mock.dialect, revision, standalone=False, schema=schema)
    sql = sql.strip()
    if sql:
        # The host's output adds its own statement terminator.
        mock.execute(_Verbatim(sql.removesuffix(";")))
    return revisions


# --------------------------------------------------------------------------
# Adoption and drift


def _adopt_unstamped_branches(conn: Connection) -> None:
    """Stamp every branch that has no version row at the revision its tables match."""
    current = _current(conn)
    stamped: set[str] = set()
    for rev in current:
        stamped |= _branches_of(rev)
    for label, adopter in _adopters().items():
        if label in stamped:
            continue
        revision = adopter(conn)
        if revision is not None:
            _migration_context(conn).stamp(_script(), revision)


def _drift(conn: Connection) -> list[str]:
    metadata = load_all_models()
    dialect = conn.dialect.name
    ours = {name for name, t in metadata.tables.items() if table_applies(t, dialect)}

    def include(obj: Any, name: str | None, type_: str, reflected: bool, compare_to: Any) -> bool:
        if type_ == "table":
            return name in ours
        table = getattr(obj, "table", None)
        return table is None or table.name in ours

    ctx = _migration_context(
        conn, include_object=include, compare_type=True, target_metadata=metadata
    )
    with _quiet_alembic():
        diffs = compare_metadata(ctx, metadata)
    return [_describe(d) for d in diffs if not _legacy_pk_nullability(d, dialect, metadata)]


def _legacy_pk_nullability(diff: Any, dialect: str, metadata: Any) -> bool:
    """True for "primary key column reported nullable" on SQLite.

    A rowid table declared ``id TEXT PRIMARY KEY`` (as the original stores
    did) reports ``notnull=0`` for ``id``; an adopted file keeps that
    declaration, and rebuilding a shared table to add NOT NULL is not worth its
    risk. Our writes never store a NULL key; a foreign NULL key reads as a
    corrupt id.
    """
    if dialect != "sqlite" or not isinstance(diff, list):
        return False
    if not all(isinstance(d, tuple) and d[0] == "modify_nullable" for d in diff):
        return False
    for d in diff:
        table = metadata.tables.get(d[2])
        column = table.c.get(d[3]) if table is not None else None
        if column is None or not column.primary_key:
            return False
    return True


def _describe(diff: Any) -> str:
    if isinstance(diff, list):
        return "; ".join(_describe(d) for d in diff)
    op = diff[0]
    rest = ", ".join(str(getattr(x, "name", x)) for x in diff[1:])
    return f"{op}: {rest}"


# --------------------------------------------------------------------------
# The host's autogenerate


@dataclass(frozen=True)
class _Owned:
    tables: frozenset[str]
    #: Objects that belong to no table in a comparison (sequences).
    loose: frozenset[str]


@cache
def _owned() -> _Owned:
    metadata = load_all_models()
    tables = set(metadata.tables) | {VERSION_TABLE}
    loose: set[str] = set()
    for table in metadata.tables.values():
        for column in table.columns:
            loose.add(f"{table.name}_{column.name}_seq")  # Postgres SERIAL/IDENTITY
            default = column.default
            name = getattr(default, "name", None)
            if default is not None and getattr(default, "is_sequence", False) and name:
                loose.add(str(name))
    return _Owned(frozenset(tables), frozenset(loose))


IncludeObject = Callable[[Any, "str | None", str, bool, Any], bool]


def include_object(
    object: Any,  # noqa: A002 - Alembic's parameter name
    name: str | None,
    type_: str,
    reflected: bool,
    compare_to: Any,
) -> bool:
    """Alembic ``include_object`` hook that hides agentkeep's objects from a host's autogenerate.

    Pass it to ``context.configure(include_object=...)`` in the host's
    ``env.py``: ``alembic revision --autogenerate`` and ``alembic check`` then
    ignore agentkeep's tables, their columns, indexes and constraints, its
    sequences and its version table ``agentkeep_alembic_version``, whether
    they are found in the database or in a metadata. Everything else is
    included. A host that has its own filter can combine both::

        def include_object(obj, name, type_, reflected, compare_to):
            return agentkeep.migrations.include_object(
                obj, name, type_, reflected, compare_to
            ) and my_filter(obj, name, type_, reflected, compare_to)

    This hook is for agentkeep in the default namespace: it hides objects
    named like agentkeep's in the database's default schema only; a host's
    table of such a name in another schema is included. When agentkeep
    lives in a schema (``schema=``), use :func:`include_object_for`.

    Returns:
        False for an agentkeep object, True otherwise.
    """
    return _include(None, object, name, type_)


def include_object_for(schema: str | None) -> IncludeObject:
    """The ``include_object`` hook for agentkeep in namespace ``schema``.

    ``include_object_for(None)`` behaves as :func:`include_object`. With a
    schema, the hook hides agentkeep's objects in that schema (seen by a host
    whose autogenerate compares several schemas, ``include_schemas=True``,
    or a SQLite connection with the namespace attached), and includes the
    host's own tables named like agentkeep's (``runs``, ...) in every other
    schema, the default one included::

        context.configure(
            connection=connection, target_metadata=target_metadata,
            include_object=agentkeep.migrations.include_object_for("agentkeep"),
        )

    Raises:
        InvalidInput: an invalid namespace name.
    """
    db.check_schema_name(schema)

    def hook(
        object: Any,  # noqa: A002 - Alembic's parameter name
        name: str | None,
        type_: str,
        reflected: bool,
        compare_to: Any,
    ) -> bool:
        return _include(schema, object, name, type_)

    hook.__doc__ = f"agentkeep.migrations.include_object_for({schema!r})"
    return hook


def _include(schema: str | None, obj: Any, name: str | None, type_: str) -> bool:
    owned = _owned()
    if type_ == "table":
        return not (name in owned.tables and getattr(obj, "schema", None) == schema)
    table = getattr(obj, "table", None)
    if isinstance(table, Table):
        return not (table.name in owned.tables and table.schema == schema)
    if name is None or name not in owned.loose:
        return True
    return getattr(obj, "schema", None) != schema


# --------------------------------------------------------------------------
# Public commands


@_typed_errors
def upgrade(
    target: Target | MockConnection, revision: str = "heads", *, schema: str | None = None
) -> tuple[str, ...]:
    """Adopt legacy tables if needed, then upgrade to ``revision``, in one transaction.

    This is ``agentkeep.migrate``.

    * A URL or an engine made by :func:`agentkeep.db.create_engine`: agentkeep
      opens its own connection, runs one ``BEGIN IMMEDIATE`` (SQLite) or
      advisory-locked (Postgres) transaction, commits it, and puts a SQLite
      file in WAL mode.
    * A :class:`~sqlalchemy.engine.Connection` (the host's ``env.py``, or any
      caller's connection, on any engine): runs on that connection. When the
      connection is inside a transaction, the upgrade joins it under the
      migration lock and the owner commits or rolls back both; otherwise the
      upgrade is its own transaction, committed here (on SQLite also when
      only SQLAlchemy, not the database, holds a transaction; see
      :func:`_on_connection`). The journal mode is left to the host. Alembic's
      context of the host is not touched.
    * The connection of a host's offline run (``context.get_bind()`` under
      ``alembic upgrade --sql``): agentkeep's upgrade is written into the
      host's SQL output instead (see :func:`upgrade_sql`).

    With ``schema``, the upgrade runs in that namespace (module docstring):
    on Postgres in the schema, created first when missing, on the same
    connection and transaction as above; on SQLite in the namespace's own
    file next to the database, in its own ``BEGIN IMMEDIATE`` transaction
    (also for a caller's connection: the host's file is not touched).

    Args:
        target: a URL, an engine or a connection.
        revision: the target (default: every head). Offline: also ``FROM:TO``.
        schema: the namespace of agentkeep's tables (default: none).

    Returns:
        The revisions stamped afterwards (offline: the ones the SQL stamps).

    Raises:
        SchemaNewer: the database carries a revision this code does not know.
        LegacySchemaMismatch: un-versioned tables of an unknown shape.
        SchemaError: an unknown target revision; or, after upgrading to head,
            the tables still differ from the models. Nothing was changed.
    """
    db.check_schema_name(schema)
    if isinstance(target, MockConnection):
        return _upgrade_into_host_output(target, revision, schema)
    if schema is not None and isinstance(target, str):
        _create_sqlite_file(target)
    target, schema = _resolve(target, schema)
    if isinstance(target, Connection):
        with _ALEMBIC_LOCK, _on_connection(target, schema) as conn:
            with _in_namespace(conn, schema, create=True):
                _upgrade_in(conn, revision)
                return _current(conn)
    with _ALEMBIC_LOCK, _engine_for(target) as engine:
        with _migration_transaction(engine, schema) as conn:
            with _in_namespace(conn, schema, create=True):
                _upgrade_in(conn, revision)
                revisions = _current(conn)
        db.enable_wal(engine)
        return revisions


def _upgrade_in(conn: Connection, revision: str) -> None:
    _refuse_unknown(_current(conn))
    _adopt_unstamped_branches(conn)
    with _revision_errors("upgrade to", revision):
        _run(conn, _upgrade_steps(revision))
    if revision in ("head", "heads"):
        diffs = _drift(conn)
        if diffs:
            raise SchemaError(
                "after upgrading, the database differs from the models (rolled back): "
                + "; ".join(diffs)
            )


@contextmanager
def _writing(target: Target, schema: str | None) -> Iterator[Connection]:
    """A connection holding the migration lock for a command that needs an existing database.

    ``target`` and ``schema`` as given to the command; the connection is in
    the namespace (:func:`_resolve`).
    """
    command = _upgrade_hint(schema).strip("`")
    target, schema = _resolve(target, schema)
    if isinstance(target, Connection):
        with _on_connection(target, schema) as conn, _in_namespace(conn, schema):
            yield conn
        return
    if isinstance(target, str):
        require_database(target, command=command)
    with _engine_for(target) as engine, _migration_transaction(engine, schema) as conn:
        with _in_namespace(conn, schema):
            yield conn


@_typed_errors
def downgrade(target: Target, revision: str, *, schema: str | None = None) -> tuple[str, ...]:
    """Downgrade to ``revision`` (``"base"`` drops every agentkeep table) in one transaction.

    Downgrades are lossy: dropped columns lose their data. The same lock and
    refusals as :func:`upgrade`; a missing SQLite file is not created. With
    ``schema``, in that namespace (a Postgres schema is kept, emptied of
    agentkeep's tables at base; a SQLite namespace file must exist).

    Returns:
        The revisions stamped afterwards (empty at base).

    Raises:
        DatabaseMissing: a SQLite URL whose file (or namespace file) does not exist.
        SchemaNewer: the database carries a revision this code does not know.
        SchemaError: ``revision`` is unknown or not below the current one.
    """
    with _ALEMBIC_LOCK, _writing(target, schema) as conn:
        _refuse_unknown(_current(conn))
        with _revision_errors("downgrade to", revision):
            _run(conn, _downgrade_steps(revision))
        return _current(conn)


class _TrialDone(Exception):
    """Raised to roll back the savepoint of a successful trial upgrade."""


@_typed_errors
def stamp(target: Target, revision: str, *, schema: str | None = None) -> tuple[str, ...]:
    """Set the stamped revision to ``revision`` without running revisions, if the tables agree.

    For a database whose tables were made or fixed by hand. The stamp is
    accepted only if upgrading from it (adopting un-versioned branches as
    :func:`upgrade` does) reaches the models without drift; that proof runs
    in a savepoint that is rolled back, so a refused stamp changes nothing.
    The same lock and refusals as :func:`upgrade`; a missing SQLite file is
    not created. With ``schema``, in that namespace.

    Returns:
        The revisions stamped afterwards.

    Raises:
        DatabaseMissing: a SQLite URL whose file (or namespace file) does not exist.
        SchemaNewer: the database carries a revision this code does not know.
        SchemaError: ``revision`` is unknown, or the tables do not match it.
    """
    with _ALEMBIC_LOCK, _writing(target, schema) as conn:
        _refuse_unknown(_current(conn))
        with _revision_errors("stamp", revision):
            _migration_context(conn).stamp(_script(), revision)
        stamped = _current(conn)
        try:
            with conn.begin_nested():
                _upgrade_in(conn, "heads")
                raise _TrialDone
        except _TrialDone:
            return stamped
        except Exception as exc:
            raise SchemaError(
                f"refused to stamp {revision}: upgrading from it does not reach the models "
                f"(nothing was changed): {exc}"
            ) from exc


@_typed_errors
def current(target: Target, *, schema: str | None = None) -> tuple[str, ...]:
    """The revisions stamped in the database (empty when un-versioned or missing).

    Read-only: a SQLite file that does not exist is reported as empty and not
    created. With ``schema``, the namespace's revisions (empty when the
    namespace does not exist).
    """
    target, schema = _resolve(target, schema)
    if _missing_database(target):
        return ()
    if isinstance(target, Connection):
        with _in_namespace(target, schema):
            return _current(target)
    with _engine_for(target) as engine, engine.connect() as conn, conn.begin():
        with _in_namespace(conn, schema):
            return _current(conn)


#: check()'s line for a database without an agentkeep revision.
NOT_MIGRATED: Final = "not migrated: no agentkeep revision is stamped; run `agentkeep upgrade`"


@_typed_errors
def check(target: Target, *, schema: str | None = None) -> list[str]:
    """What stands between the database and the models at head (empty: nothing).

    One line ``not migrated: ...`` for an un-versioned, empty or missing
    database (a missing SQLite file is not created); one line ``behind head:
    ...`` for a database stamped below head; otherwise one ``drift: ...`` line
    per difference between the tables and the models. With ``schema``, the
    namespace's tables (a namespace that does not exist is not migrated).

    Raises:
        SchemaNewer: the database carries a revision this code does not know.
    """
    hint = _upgrade_hint(db.check_schema_name(schema))
    target, schema = _resolve(target, schema)
    if _missing_database(target):
        return [NOT_MIGRATED.replace("`agentkeep upgrade`", hint)]
    if isinstance(target, Connection):
        with _in_namespace(target, schema):
            return _check(target, hint)
    with _engine_for(target) as engine, engine.connect() as conn, conn.begin():
        with _in_namespace(conn, schema):
            return _check(conn, hint)


def _upgrade_hint(schema: str | None) -> str:
    return "`agentkeep upgrade`" if schema is None else f"`agentkeep upgrade --schema {schema}`"


def _check(conn: Connection, hint: str) -> list[str]:
    cur = _current(conn)
    _refuse_unknown(cur)
    heads = head_revisions()
    if not cur:
        return [NOT_MIGRATED.replace("`agentkeep upgrade`", hint)]
    if cur != heads:
        return [
            f"behind head: revision {', '.join(cur)} is not head {', '.join(heads)}; run {hint}"
        ]
    return [f"drift: {line}" for line in _drift(conn)]


@_typed_errors
def ensure_schema(engine: Engine, *, migrate: bool, schema: str | None = None) -> None:
    """Check, when a store opens, that the database (its namespace) is at head.

    Args:
        engine: the store's engine.
        migrate: upgrade (adopting legacy tables) instead of failing when behind.
        schema: the store's namespace (default: none).

    Raises:
        SchemaBehind: behind head and ``migrate`` is false.
        SchemaNewer: stamped with a revision this code does not know.
    """
    target, resolved = _resolve(engine, schema)
    if isinstance(target, str):  # a SQLite namespace: its own file
        cur = current(target)
    else:
        with engine.connect() as conn, conn.begin(), _in_namespace(conn, resolved):
            cur = _current(conn)
    heads = head_revisions()
    if cur == heads:
        return
    _refuse_unknown(cur)
    if migrate:
        upgrade(engine, schema=schema)
        return
    raise SchemaBehind(cur, heads, f"run {_upgrade_hint(schema)} (or open with migrate=True)")


# --------------------------------------------------------------------------
# env.py


def _url_from_context(config: Config) -> str:
    from alembic import context

    x = context.get_x_argument(as_dictionary=True)
    url = (
        x.get("url")
        or os.environ.get("AGENTKEEP_DATABASE_URL")
        or config.get_main_option("sqlalchemy.url")
    )
    if not url:
        raise SchemaError("no database URL: pass -x url=..., or set AGENTKEEP_DATABASE_URL")
    return url


def _is_upgrade_command(config: Config) -> bool:
    cmd = getattr(config.cmd_opts, "cmd", None)
    fn = cmd[0] if isinstance(cmd, tuple) and cmd else None
    return getattr(fn, "__name__", "") == "upgrade"


def run_env() -> None:
    """The body of ``alembic/env.py``: the ``alembic`` command line run on agentkeep's scripts.

    agentkeep's own commands (:func:`upgrade`, ``agentkeep upgrade``, ...) do
    not come here: they drive the scripts directly on one connection. This is
    for ``alembic upgrade head`` from a checkout, or a programmatic
    ``alembic.command`` call on a :class:`~alembic.config.Config` of these
    scripts. With a connection in ``config.attributes["connection"]`` it runs
    the migrations inside that connection's transaction; with an engine there,
    or none (the URL from ``-x url=...``, ``AGENTKEEP_DATABASE_URL`` or
    ``sqlalchemy.url``), it opens the migration transaction itself, adopts
    legacy tables on ``upgrade``, and commits.
    """
    from alembic import context

    config = context.config
    metadata = load_all_models()

    if context.is_offline_mode():
        context.configure(
            url=_url_from_context(config),
            target_metadata=metadata,
            version_table=VERSION_TABLE,
            literal_binds=True,
            render_as_batch=True,
        )
        with context.begin_transaction():
            context.run_migrations()
        return

    def run(conn: Connection) -> None:
        context.configure(
            connection=conn,
            target_metadata=metadata,
            version_table=VERSION_TABLE,
            render_as_batch=True,
            compare_type=True,
            include_object=lambda obj, name, type_, reflected, compare_to: (
                type_ != "table"
                or (
                    name is not None
                    and name in metadata.tables
                    and table_applies(metadata.tables[name], conn.dialect.name)
                )
            ),
        )
        with context.begin_transaction():
            context.run_migrations()

    given = config.attributes.get("connection")
    if isinstance(given, Connection):
        run(given)
        return
    if isinstance(given, Engine):
        engine, owned = given, False
    else:
        engine, owned = db.create_engine(_url_from_context(config)), True
    try:
        with _ALEMBIC_LOCK, _migration_transaction(engine) as conn:
            if _is_upgrade_command(config):
                _refuse_unknown(_current(conn))
                _adopt_unstamped_branches(conn)
            run(conn)
        db.enable_wal(engine)
    finally:
        if owned:
            engine.dispose()
