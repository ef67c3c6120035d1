"""``agentkeep.migrate(connection)`` on a caller's connection, and ``include_object``.

Transactions, on a plain SQLAlchemy engine (what a host's ``env.py`` has) and on
agentkeep's own engine:

* Postgres: inside the caller's transaction the upgrade joins it under
  ``pg_advisory_xact_lock`` (held until the caller ends it) and the caller's
  rollback undoes it; with no transaction open it commits its own.
* SQLite: when the database connection is inside a transaction (the caller
  wrote, or agentkeep's engine began one) the upgrade joins it holding the
  write lock; otherwise (pysqlite opens no transaction before the first write)
  it is its own ``BEGIN IMMEDIATE`` ... ``COMMIT``, committed even if the
  caller's SQLAlchemy transaction is then rolled back.

And on every path: refusals change nothing, legacy files are adopted, Alembic's
``op`` proxy is put back as it was, the offline (mock) connection of a host's
``--sql`` run receives agentkeep's DDL.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from alembic.operations import Operations
from alembic.runtime.migration import MigrationContext

import agentkeep
from agentkeep import db
from agentkeep import migrations as migrate
from agentkeep.base import load_all_models
from agentkeep.errors import LegacySchemaMismatch, SchemaNewer

from . import _legacy as L

HEAD = migrate.head_revisions()
HOST = sa.Table("host_things", sa.MetaData(), sa.Column("id", sa.Integer, primary_key=True))


@pytest.fixture
def plain(fresh_url: str) -> Iterator[sa.Engine]:
    """A plain SQLAlchemy engine, as a host's env.py makes it (no agentkeep hooks)."""
    engine = sa.create_engine(fresh_url, poolclass=sa.pool.NullPool)
    yield engine
    engine.dispose()


def versions(url: str) -> tuple[str, ...]:
    return migrate.current(url)


def tables(url: str) -> set[str]:
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            return set(sa.inspect(conn).get_table_names())
    finally:
        engine.dispose()


def lock_is_free(url: str) -> bool:
    """Can another connection take the migration lock right now (without waiting)?"""
    path = migrate.sqlite_file(url)
    if path is not None:
        other = sqlite3.connect(path, timeout=0, isolation_level=None)
        try:
            other.execute("BEGIN IMMEDIATE")
            other.execute("ROLLBACK")
            return True
        except sqlite3.OperationalError as exc:
            assert "locked" in str(exc)
            return False
        finally:
            other.close()
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.begin() as conn:
            got = conn.execute(
                sa.text("SELECT pg_try_advisory_xact_lock(:ns, 0)"),
                {"ns": db.LockNamespace.MIGRATION},
            ).scalar()
            return bool(got)
    finally:
        engine.dispose()


def test_agentkeep_migrate_is_migrations_upgrade() -> None:
    assert agentkeep.migrate is migrate.upgrade


def test_inside_the_callers_transaction_joins_it(
    plain: sa.Engine, fresh_url: str, backend: str
) -> None:
    """The caller wrote first, so the database transaction is open: agentkeep joins it."""
    with plain.connect() as conn:
        HOST.create(conn)
        conn.commit()
        tx = conn.begin()
        conn.execute(HOST.insert().values(id=1))  # the host's write opens the transaction

        assert agentkeep.migrate(conn) == HEAD

        assert conn.in_transaction()
        assert not lock_is_free(fresh_url)  # held until the caller ends the transaction
        tx.rollback()

    assert lock_is_free(fresh_url)
    assert versions(fresh_url) == ()
    assert tables(fresh_url) <= {"host_things", migrate.VERSION_TABLE}


def test_postgres_caller_transaction_is_joined_even_before_any_write(
    plain: sa.Engine, fresh_url: str, backend: str
) -> None:
    if backend != "postgres":
        pytest.skip("Postgres: a SQLAlchemy transaction is a database transaction")
    with plain.connect() as conn:
        tx = conn.begin()
        agentkeep.migrate(conn)
        assert not lock_is_free(fresh_url)
        tx.commit()
    assert versions(fresh_url) == HEAD
    assert migrate.check(fresh_url) == []


def test_sqlite_without_a_database_transaction_commits_its_own(
    plain: sa.Engine, fresh_url: str, backend: str
) -> None:
    """SQLite only: pysqlite has not begun (no write yet), so agentkeep's upgrade is its own
    BEGIN IMMEDIATE ... COMMIT; the caller's later rollback (Alembic closing its connection)
    cannot lose it."""
    if backend != "sqlite":
        pytest.skip("SQLite driver-level transactions")
    with plain.connect() as conn:
        tx = conn.begin()
        conn.execute(sa.text("SELECT 1"))  # an SQLAlchemy transaction, no database one
        assert agentkeep.migrate(conn) == HEAD
        assert lock_is_free(fresh_url)  # committed already
        tx.rollback()
    assert versions(fresh_url) == HEAD
    assert migrate.check(fresh_url) == []


def test_no_transaction_at_all_commits_its_own(plain: sa.Engine, fresh_url: str) -> None:
    with plain.connect() as conn:
        assert agentkeep.migrate(conn) == HEAD
        assert not conn.in_transaction()
    assert versions(fresh_url) == HEAD
    assert lock_is_free(fresh_url)


def test_agentkeep_engine_transaction_is_joined(fresh_url: str) -> None:
    """agentkeep's own engine begins a database transaction with SQLAlchemy's: joined."""
    engine = db.create_engine(fresh_url)
    try:
        with engine.connect() as conn:
            tx = conn.begin()
            agentkeep.migrate(conn)
            assert not lock_is_free(fresh_url)
            tx.rollback()
        assert versions(fresh_url) == ()
        with engine.begin() as conn:
            agentkeep.migrate(conn)
        assert versions(fresh_url) == HEAD
    finally:
        engine.dispose()


def test_refusal_on_a_connection_changes_nothing(plain: sa.Engine, fresh_url: str) -> None:
    migrate.upgrade(fresh_url)
    with plain.begin() as conn:
        conn.execute(sa.text(f"UPDATE {migrate.VERSION_TABLE} SET version_num = 'zzzz_9999'"))
    before = tables(fresh_url)
    for begin in (False, True):
        with plain.connect() as conn:
            tx = conn.begin() if begin else None
            with pytest.raises(SchemaNewer):
                agentkeep.migrate(conn)
            if tx is not None:
                tx.rollback()
    assert versions(fresh_url) == ("zzzz_9999",)
    assert tables(fresh_url) == before
    assert lock_is_free(fresh_url)


def test_sqlite_legacy_file_is_adopted_on_a_connection(tmp_path: Path) -> None:
    """SQLite only: an L2 file is stamped and upgraded on the caller's connection, rows kept."""
    path = tmp_path / "legacy.db"
    L.build_legacy(path, "L2", order="altered", index=True)
    rows = L.query(path, "SELECT id, created_at FROM runs ORDER BY id")
    engine = sa.create_engine(f"sqlite:///{path}", poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            assert agentkeep.migrate(conn) == HEAD
    finally:
        engine.dispose()
    assert migrate.check(f"sqlite:///{path}") == []
    assert L.query(path, "SELECT id, created_at FROM runs ORDER BY id") == rows


def test_sqlite_unknown_legacy_shape_on_a_connection_leaves_the_file_unchanged(
    tmp_path: Path,
) -> None:
    """SQLite only: refused with LegacySchemaMismatch, byte-for-byte unchanged."""
    path = tmp_path / "legacy.db"
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE runs (id TEXT PRIMARY KEY, foo TEXT)")
    con.commit()
    con.close()
    digest = L.sha256(path)
    engine = sa.create_engine(f"sqlite:///{path}", poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn, pytest.raises(LegacySchemaMismatch):
            agentkeep.migrate(conn)
    finally:
        engine.dispose()
    assert L.sha256(path) == digest


def test_the_op_proxy_is_put_back_as_it_was(plain: sa.Engine, fresh_url: str) -> None:
    """A host revision may call agentkeep.migrate(op.get_bind()) while its own op is live."""
    import alembic.op as op_module

    with plain.connect() as conn:
        outer = MigrationContext.configure(conn)
        with Operations.context(outer) as outer_op:
            agentkeep.migrate(conn)
            assert op_module._proxy is outer_op  # type: ignore[attr-defined]
            assert op_module.get_bind() is conn
        conn.commit()
    assert getattr(op_module, "_proxy", None) is None
    assert versions(fresh_url) == HEAD


def test_offline_mock_connection_receives_agentkeep_ddl(backend: str) -> None:
    """The connection of a host's `--sql` run: agentkeep's upgrade goes into its output."""
    seen: list[str] = []
    url = "sqlite://" if backend == "sqlite" else "postgresql+psycopg://"

    def record(sql: Any, *args: Any, **kw: Any) -> None:
        seen.append(str(sql.compile(dialect=mock.dialect)))

    mock = sa.create_mock_engine(url, record)
    assert agentkeep.migrate(mock) == HEAD  # type: ignore[arg-type]
    (text,) = seen
    assert text.startswith(
        f"CREATE TABLE {migrate.VERSION_TABLE}"
        if backend == "sqlite"
        else "SELECT pg_advisory_xact_lock("
    )
    assert "CREATE TABLE runs (" in text
    # bare: the host's own BEGIN/COMMIT (or none) wraps it
    assert "BEGIN;" not in text and "BEGIN IMMEDIATE;" not in text and "COMMIT;" not in text
    assert not text.endswith(";")  # the host's output adds its own terminator


# ---------------------------------------------------------------- include_object


def test_include_object_hides_every_agentkeep_object_and_nothing_else() -> None:
    include = migrate.include_object
    metadata = load_all_models()
    for table in metadata.tables.values():
        assert include(table, table.name, "table", True, None) is False
        for column in table.columns:
            assert include(column, column.name, "column", True, None) is False
        for index in table.indexes:
            assert include(index, index.name, "index", True, None) is False
        for constraint in table.constraints:
            kind = type(constraint).__name__
            assert include(constraint, constraint.name, kind, True, None) is False
    assert include(None, migrate.VERSION_TABLE, "table", True, None) is False
    assert include(None, "runs_seq_seq", "sequence", True, None) is False
    assert include(None, "queued_work_batches_enqueue_seq_seq", "sequence", True, None) is False

    host = sa.Table(
        "book",
        sa.MetaData(),
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("title", sa.String(10), index=True),
    )
    assert include(host, "book", "table", False, None) is True
    assert include(host.c.title, "title", "column", False, None) is True
    (index,) = host.indexes
    assert include(index, index.name, "index", False, None) is True
    assert include(None, "book_id_seq", "sequence", True, None) is True
    assert include(None, "alembic_version", "table", True, None) is True
