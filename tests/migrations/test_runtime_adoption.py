"""Adoption of un-versioned runtime-store files (spec runtime §1.14, design §5).

The original Rust runtime store created its tables with ``CREATE TABLE IF NOT
EXISTS`` on every connection and kept no version table, so an old file holds
some or all of the eleven tables of §1.14. Such a file is stamped
``runtime_0001`` (missing tables created) and upgraded with its rows intact;
a table of another shape is refused with the file left byte-for-byte as it
was. SQLite only for adoption; an un-versioned Postgres database with runtime
tables is refused.
"""

from __future__ import annotations

import hashlib
import sqlite3
from pathlib import Path

import pytest
import sqlalchemy as sa

from agentkeep import migrations as migrate
from agentkeep.errors import LegacySchemaMismatch
from agentkeep.runtime import ReadFailed
from agentkeep.runtime.adoption import SHAPE
from agentkeep.store import Store
from tests.conftest import create_pg_database, drop_pg_database

#: The seed's DDL, verbatim (§1.14).
SEED_DDL = {
    "runtime_input_states": "CREATE TABLE IF NOT EXISTS runtime_input_states (runtime_id TEXT NOT NULL, input_id TEXT NOT NULL, state_json BLOB NOT NULL, PRIMARY KEY (runtime_id, input_id))",  # noqa: E501
    "runtime_boundary_receipts": "CREATE TABLE IF NOT EXISTS runtime_boundary_receipts (runtime_id TEXT NOT NULL, run_id TEXT NOT NULL, sequence INTEGER NOT NULL, receipt_json BLOB NOT NULL, PRIMARY KEY (runtime_id, run_id, sequence))",  # noqa: E501
    "runtime_session_snapshots": "CREATE TABLE IF NOT EXISTS runtime_session_snapshots (runtime_id TEXT PRIMARY KEY, session_snapshot BLOB NOT NULL)",  # noqa: E501
    "runtime_states": "CREATE TABLE IF NOT EXISTS runtime_states (runtime_id TEXT PRIMARY KEY, runtime_state_json BLOB NOT NULL)",  # noqa: E501
    "runtime_ops_lifecycle": "CREATE TABLE IF NOT EXISTS runtime_ops_lifecycle (runtime_id TEXT PRIMARY KEY, state_json BLOB NOT NULL)",  # noqa: E501
    "runtime_retired_ops_epochs": "CREATE TABLE IF NOT EXISTS runtime_retired_ops_epochs (runtime_id TEXT NOT NULL, epoch_id TEXT NOT NULL, PRIMARY KEY (runtime_id, epoch_id))",  # noqa: E501
    "runtime_auth_oauth_flow_state": "CREATE TABLE IF NOT EXISTS runtime_auth_oauth_flow_state (id TEXT PRIMARY KEY, state_json BLOB NOT NULL)",  # noqa: E501
    "runtime_projection_quarantine": "CREATE TABLE IF NOT EXISTS runtime_projection_quarantine (runtime_id TEXT PRIMARY KEY)",  # noqa: E501
    "runtime_compaction_projection_outbox": "CREATE TABLE IF NOT EXISTS runtime_compaction_projection_outbox (runtime_id TEXT NOT NULL, session_id TEXT NOT NULL, parent_revision TEXT NOT NULL, revision TEXT NOT NULL, commit_fingerprint TEXT NOT NULL, intent_json BLOB NOT NULL, state TEXT NOT NULL CHECK (state IN ('pending','finalized')), PRIMARY KEY (runtime_id, session_id, parent_revision, revision, commit_fingerprint))",  # noqa: E501
    "runtime_mob_host_bindings": "CREATE TABLE IF NOT EXISTS runtime_mob_host_bindings (mob_id TEXT PRIMARY KEY, record_json BLOB NOT NULL)",  # noqa: E501
    "runtime_mob_host_revocations": "CREATE TABLE IF NOT EXISTS runtime_mob_host_revocations (mob_id TEXT PRIMARY KEY, receipt_json BLOB NOT NULL)",  # noqa: E501
}
SESSIONS_DDL = (
    "CREATE TABLE sessions (session_id TEXT PRIMARY KEY, created_at_ms INTEGER NOT NULL, "
    "updated_at_ms INTEGER NOT NULL, message_count INTEGER NOT NULL, total_tokens INTEGER "
    "NOT NULL, metadata_json TEXT NOT NULL, session_json BLOB NOT NULL)"
)


def build(path: Path, tables: list[str], *, extra: list[str] = ()) -> None:  # type: ignore[assignment]
    conn = sqlite3.connect(path)
    try:
        for name in tables:
            conn.execute(SEED_DDL[name])
        for stmt in extra:
            conn.execute(stmt)
        conn.commit()
    finally:
        conn.close()


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_seed_ddl_covers_every_table() -> None:
    assert set(SEED_DDL) == set(SHAPE)


@pytest.mark.parametrize("subset", ["all", "v0_6_34", "only_states"])
def test_unversioned_runtime_file_is_adopted_with_rows(tmp_path: Path, subset: str) -> None:
    tables = {
        "all": list(SEED_DDL),
        "v0_6_34": [
            "runtime_states",
            "runtime_input_states",
            "runtime_boundary_receipts",
            "runtime_session_snapshots",
            "runtime_ops_lifecycle",
        ],
        "only_states": ["runtime_states"],
    }[subset]
    path = tmp_path / "legacy.db"
    build(
        path,
        tables,
        extra=[
            SESSIONS_DDL,
            "INSERT INTO sessions VALUES ('s', 1, 2, 0, 0, '{}', x'7b7d')",
            "INSERT INTO runtime_states VALUES ('rt-1', CAST('\"idle\"' AS BLOB))",
        ],
    )
    url = f"sqlite:///{path}"
    with pytest.raises(Exception, match="upgrade"):
        Store.open(url)  # behind head: refused without migrate=True, nothing written
    store = Store.open(url, migrate=True)
    try:
        assert migrate.current(url) == migrate.head_revisions()
        assert migrate.check(url) == []
        # The legacy row is kept, and stays fail-closed on ordinary reads (I12).
        assert store.runtime.load_machine_lifecycle_record("rt-1") == b'"idle"'
        with pytest.raises(ReadFailed):
            store.runtime.load_runtime_state("rt-1")
        # Every runtime table now exists and works.
        assert store.runtime.put_mob_host_binding_if_absent("mob", b"record") is True
        assert store.runtime.load_session_snapshot("rt-1") is None
    finally:
        store.close()
    conn = sqlite3.connect(path)
    try:
        names = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        assert set(SHAPE) <= names
        assert conn.execute("SELECT session_id FROM sessions").fetchall() == [("s",)]
    finally:
        conn.close()


@pytest.mark.parametrize(
    "ddl",
    [
        "CREATE TABLE runtime_states (runtime_id TEXT PRIMARY KEY, "
        "runtime_state_json TEXT NOT NULL)",
        "CREATE TABLE runtime_states (runtime_id TEXT PRIMARY KEY, runtime_state_json BLOB)",
        "CREATE TABLE runtime_states (runtime_id TEXT PRIMARY KEY, "
        "runtime_state_json BLOB NOT NULL, extra TEXT)",
        "CREATE TABLE runtime_input_states (runtime_id TEXT NOT NULL, input_id TEXT NOT NULL, "
        "state_json BLOB NOT NULL, PRIMARY KEY (input_id, runtime_id))",
        "CREATE TABLE runtime_compaction_projection_outbox (runtime_id TEXT NOT NULL, session_id "
        "TEXT NOT NULL, parent_revision TEXT NOT NULL, revision TEXT NOT NULL, commit_fingerprint "
        "TEXT NOT NULL, intent_json BLOB NOT NULL, state TEXT NOT NULL, PRIMARY KEY (runtime_id, "
        "session_id, parent_revision, revision, commit_fingerprint))",
        "CREATE VIEW runtime_states AS SELECT 'rt' AS runtime_id, x'00' AS runtime_state_json",
    ],
    ids=["text_payload", "nullable_payload", "extra_column", "key_order", "no_check", "view"],
)
def test_unknown_runtime_shape_is_refused_and_file_untouched(tmp_path: Path, ddl: str) -> None:
    path = tmp_path / "odd.db"
    build(path, [], extra=[ddl])
    before = digest(path)
    with pytest.raises(LegacySchemaMismatch):
        migrate.upgrade(f"sqlite:///{path}")
    with pytest.raises(LegacySchemaMismatch):
        Store.open(f"sqlite:///{path}", migrate=True)
    assert digest(path) == before


def test_unversioned_postgres_runtime_tables_are_refused() -> None:
    url = create_pg_database()
    try:
        engine = sa.create_engine(url)
        with engine.begin() as conn:
            conn.execute(
                sa.text(
                    "CREATE TABLE runtime_states (runtime_id TEXT PRIMARY KEY, "
                    "runtime_state_json BYTEA NOT NULL)"
                )
            )
        engine.dispose()
        with pytest.raises(LegacySchemaMismatch, match="Postgres"):
            migrate.upgrade(url)
        engine = sa.create_engine(url)
        with engine.connect() as conn:
            assert not sa.inspect(conn).has_table(migrate.VERSION_TABLE)
        engine.dispose()
    finally:
        drop_pg_database(url)
