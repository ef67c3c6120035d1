"""Seed test 43, the ordinary-store side: fail-closed before, readable after (spec runtime §4).

Before migration the ordinary store refuses the bare ``"idle"`` lifecycle; after
an apply and a reopen it reads state idle, one input and no ops record, and the
session store's ``sessions`` row survives.

SQLite: the legacy file is built by hand and ``Store.open(url, migrate=True)``
adopts its un-versioned runtime tables. Postgres has no legacy files (and no
adoption), so there the legacy rows are written into a migrated database.
"""

from __future__ import annotations

import pytest

from agentkeep import migrations
from agentkeep.legacy.migrator import (
    LegacyV0634MigrationDisposition,
    LegacyV0634MigrationItem,
    migrate_v0_6_34_completed_idle,
)
from agentkeep.runtime.errors import ReadFailed
from agentkeep.store import Store

from . import _legacy_db as F
from ._legacy_db import LegacyDb

D = LegacyV0634MigrationDisposition
RT = F.RUNTIME_ID


def _build(db: LegacyDb) -> None:
    if db.backend == "sqlite":
        F.build_complete_v0_6_34(db)
        return
    migrations.upgrade(db.url)
    F.create_schema(db, [])  # just the session store's ``sessions`` table
    db.execute(
        "INSERT INTO sessions (session_id, created_at_ms, updated_at_ms, message_count, "
        "total_tokens, metadata_json, session_json) VALUES (?, ?, ?, ?, ?, ?, ?)",
        (*F.SESSION_ROW, F.session_snapshot()),
    )
    F.insert_runtime(db)


def test_43_ordinary_store_fails_closed_before_and_reads_after_migration(
    legacy_db: LegacyDb,
) -> None:
    db = legacy_db
    _build(db)
    sessions_rows = db.query("SELECT * FROM sessions")

    with Store.open(db.url, migrate=True) as store:
        with pytest.raises(ReadFailed):
            store.runtime.load_machine_lifecycle(RT)
        with pytest.raises(ReadFailed):
            store.runtime.load_input_states(RT)

    dry_run = migrate_v0_6_34_completed_idle(db.target)
    assert dry_run.items == (LegacyV0634MigrationItem(RT, D.WOULD_MIGRATE),)
    assert db.lifecycle() == F.RUNTIME_STATE

    applied = migrate_v0_6_34_completed_idle(db.target, apply=True)
    assert applied.items == (LegacyV0634MigrationItem(RT, D.MIGRATED),)

    with Store.open(db.url) as store:
        lifecycle = store.runtime.load_machine_lifecycle(RT)
        assert lifecycle is not None and lifecycle.runtime_state == "idle"
        inputs = store.runtime.load_input_states(RT)
        assert [(s.input_id, s.current_state) for s in inputs] == [(F.INPUT_ID, "consumed")]
        assert store.runtime.load_ops_lifecycle(RT) is None
    assert db.query("SELECT * FROM sessions") == sessions_rows

    repeated = migrate_v0_6_34_completed_idle(db.target, apply=True)
    assert repeated.migration_count() == 0
    assert repeated.items[0].disposition is D.CURRENT
