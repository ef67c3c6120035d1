"""Schema migrations: upgrade, current, drift check and adoption of legacy files.

There is one Alembic history (``alembic/versions``; the wheel carries the same
scripts as ``agentkeep/_alembic``) with one branch per store (labels ``runs``,
``sessions``, ``runtime``) and the version table ``agentkeep_alembic_version``,
so it never collides with a host application's own Alembic.

Invariants:

* An upgrade is one transaction holding the migration lock: on SQLite a
  ``BEGIN IMMEDIATE`` connection handed to Alembic (``config.attributes``), so
  adoption, stamp, every revision and the final verification commit or roll
  back together; on Postgres additionally ``pg_advisory_xact_lock`` so hosts
  booting at once migrate one after the other.
* Tables are never created without being stamped (they are created by the
  revisions, in the transaction that writes the version row).
* A database stamped with a revision this code does not know is refused with
  both revisions named; nothing is changed.
* An un-versioned database that already holds a store's tables (written by the
  original Rust stores) is adopted: the store's adopter fingerprints the
  tables, the branch is stamped at the matching revision, and everything is
  upgraded to head with the rows intact. A shape that matches no revision is
  refused with :class:`~agentkeep.errors.LegacySchemaMismatch` and the file is
  left as it was (the transaction rolls back before anything is written).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import Any, Final

from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util.exc import CommandError
from sqlalchemy import Connection, Engine, text

from agentkeep import db
from agentkeep.base import load_all_models, table_applies
from agentkeep.errors import SchemaBehind, SchemaError, SchemaNewer
from alembic import command

__all__ = [
    "VERSION_TABLE",
    "check",
    "current",
    "downgrade",
    "ensure_schema",
    "head_revisions",
    "run_env",
    "script_location",
    "upgrade",
]

VERSION_TABLE: Final = "agentkeep_alembic_version"

# Alembic's `context` and `op` are module-global proxies: one command at a
# time per process. Other processes are serialised by the database lock.
_ALEMBIC_LOCK = threading.RLock()

Adopter = Callable[[Connection], "str | None"]


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


def _config(connection: Connection | None = None) -> Config:
    cfg = Config()
    location = script_location()
    cfg.set_main_option("script_location", location)
    cfg.set_main_option("version_locations", str(Path(location) / "versions"))
    cfg.set_main_option("path_separator", "os")
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


@cache
def _script() -> ScriptDirectory:
    return ScriptDirectory.from_config(_config())


def head_revisions() -> tuple[str, ...]:
    """The head revisions of the migration history (one, once the branches merge)."""
    return tuple(sorted(_script().get_heads()))


def _migration_context(conn: Connection, **opts: Any) -> MigrationContext:
    return MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE, **opts})


def _current(conn: Connection) -> tuple[str, ...]:
    return tuple(sorted(_migration_context(conn).get_current_heads()))


def _branches_of(revision: str) -> set[str]:
    labels: set[str] = set()
    for rev in _script().iterate_revisions(revision, "base"):
        if rev is not None:
            labels.update(rev.branch_labels)
    return labels


def _refuse_unknown(current: tuple[str, ...]) -> None:
    unknown = []
    for rev in current:
        try:
            _script().get_revision(rev)
        except CommandError:
            unknown.append(rev)
    if unknown:
        raise SchemaNewer(unknown, head_revisions())


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


@contextmanager
def _migration_transaction(engine: Engine) -> Iterator[Connection]:
    """One write transaction holding the migration lock, committed on success."""
    with db.write_engine(engine).connect() as conn, conn.begin():
        if db.is_postgres(conn):
            conn.execute(
                text("SELECT pg_advisory_xact_lock(:ns, 0)"), {"ns": db.LockNamespace.MIGRATION}
            )
        yield conn


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
# Public commands


def upgrade(url_or_engine: str | Engine, revision: str = "heads") -> tuple[str, ...]:
    """Adopt legacy tables if needed, then upgrade to ``revision``, in one transaction.

    Args:
        url_or_engine: a database URL or an engine made by
            :func:`agentkeep.db.create_engine`.
        revision: the target (default: every head).

    Returns:
        The revisions stamped afterwards.

    Raises:
        SchemaNewer: the database carries a revision this code does not know.
        LegacySchemaMismatch: un-versioned tables of an unknown shape.
        SchemaError: after upgrading to head the tables still differ from the models.
    """
    with _ALEMBIC_LOCK, _engine_for(url_or_engine) as engine:
        with _migration_transaction(engine) as conn:
            _upgrade_in(conn, revision)
            revisions = _current(conn)
        db.enable_wal(engine)
        return revisions


def _upgrade_in(conn: Connection, revision: str) -> None:
    _refuse_unknown(_current(conn))
    _adopt_unstamped_branches(conn)
    command.upgrade(_config(conn), revision)
    if revision in ("head", "heads"):
        diffs = _drift(conn)
        if diffs:
            raise SchemaError(
                "after upgrading, the database differs from the models (rolled back): "
                + "; ".join(diffs)
            )


def downgrade(url_or_engine: str | Engine, revision: str) -> tuple[str, ...]:
    """Downgrade to ``revision`` (``"base"`` drops every agentkeep table) in one transaction.

    Downgrades are lossy: dropped columns lose their data.
    """
    with _ALEMBIC_LOCK, _engine_for(url_or_engine) as engine:
        with _migration_transaction(engine) as conn:
            _refuse_unknown(_current(conn))
            command.downgrade(_config(conn), revision)
            return _current(conn)


def current(url_or_engine: str | Engine) -> tuple[str, ...]:
    """The revisions stamped in the database (empty when un-versioned)."""
    with _engine_for(url_or_engine) as engine, engine.connect() as conn, conn.begin():
        return _current(conn)


def check(url_or_engine: str | Engine) -> list[str]:
    """Differences between the models and the database (empty means no drift).

    Also reports a database that is not at head.
    """
    with _engine_for(url_or_engine) as engine, engine.connect() as conn, conn.begin():
        problems = []
        cur = _current(conn)
        if cur != head_revisions():
            problems.append(
                f"revision {', '.join(cur) or 'none'} is not head {', '.join(head_revisions())}"
            )
        problems.extend(_drift(conn))
        return problems


def ensure_schema(engine: Engine, *, migrate: bool) -> None:
    """Check, when a store opens, that the database is at head.

    Args:
        engine: the store's engine.
        migrate: upgrade (adopting legacy tables) instead of failing when behind.

    Raises:
        SchemaBehind: behind head and ``migrate`` is false.
        SchemaNewer: stamped with a revision this code does not know.
    """
    with engine.connect() as conn, conn.begin():
        cur = _current(conn)
    heads = head_revisions()
    if cur == heads:
        return
    _refuse_unknown(cur)
    if migrate:
        upgrade(engine)
        return
    raise SchemaBehind(cur, heads, "run `agentkeep upgrade` (or open with migrate=True)")


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
    """The body of ``alembic/env.py``.

    With a connection in ``config.attributes["connection"]`` (agentkeep's own
    commands) it runs the migrations inside that connection's transaction.
    Without one (the ``alembic`` command line) it opens the migration
    transaction itself, adopts legacy tables on ``upgrade``, and commits.
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
