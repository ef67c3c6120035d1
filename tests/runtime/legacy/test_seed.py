"""Seed tests 43–45 of spec runtime §4 (the migrator side), on SQLite and Postgres.

Test 43's checks through the ordinary store (load errors before, state idle /
1 input / no ops after) live in ``test_store_after_migration.py``.
"""

from __future__ import annotations

import pytest

from agentkeep.legacy.migrator import (
    LegacyMigrationBlocked,
    LegacyV0634MigrationItem,
    migrate_v0_6_34_completed_idle,
)
from agentkeep.runtime.domain import StoredInputState
from agentkeep.runtime.errors import ReadFailed

from . import _legacy_db as F
from ._legacy_db import DOMAIN, D, LegacyDb


def test_43_explicit_v0_6_34_completed_idle_migration_is_atomic_and_idempotent(
    legacy_db: LegacyDb,
) -> None:
    db = legacy_db
    F.build_complete_v0_6_34(db)
    rt = F.RUNTIME_ID
    original_session = db.payload("runtime_session_snapshots", "session_snapshot", runtime_id=rt)
    original_sessions_rows = db.query("SELECT * FROM sessions")
    original_receipt = db.payload("runtime_boundary_receipts", "receipt_json", runtime_id=rt)
    assert original_session == F.session_snapshot()
    assert original_receipt == F.BOUNDARY_RECEIPT

    dry_run = migrate_v0_6_34_completed_idle(db.target)
    assert not dry_run.applied
    assert dry_run.migration_count() == 1, dry_run.items
    assert dry_run.items == (LegacyV0634MigrationItem(rt, D.WOULD_MIGRATE),)
    assert db.lifecycle() == b'"idle"'
    assert F.AUDIT not in db.tables()

    applied = migrate_v0_6_34_completed_idle(db.target, apply=True)
    assert applied.applied
    assert applied.migration_count() == 1
    assert applied.items == (LegacyV0634MigrationItem(rt, D.MIGRATED),)
    assert db.audit_original(rt, "runtime_input_states", F.INPUT_ID) == F.INPUT_STATE_CONSUMED
    assert db.audit_original(rt, "runtime_states", "singleton") == F.RUNTIME_STATE
    assert db.audit_original(rt, "runtime_ops_lifecycle", "singleton") == F.OPS_LIFECYCLE_EMPTY
    audit = db.query(
        f"SELECT table_name, row_key, migrated_record, action FROM {F.AUDIT} "
        "ORDER BY table_name, row_key"
    )
    migrated_lifecycle = db.lifecycle()
    migrated_input = db.payload("runtime_input_states", "state_json", runtime_id=rt)
    assert audit == [
        ("runtime_input_states", F.INPUT_ID, migrated_input, "replace"),
        ("runtime_ops_lifecycle", "singleton", None, "delete"),
        ("runtime_states", "singleton", migrated_lifecycle, "replace"),
    ]

    with pytest.raises(F.DB_ERRORS, match=F.APPEND_ONLY):
        db.execute(f"DELETE FROM {F.AUDIT} WHERE runtime_id = ?", (rt,))
    assert len(db.query(f"SELECT * FROM {F.AUDIT}")) == 3

    assert db.query("SELECT * FROM sessions") == original_sessions_rows
    assert db.payload("runtime_session_snapshots", "session_snapshot", runtime_id=rt) == (
        original_session
    )
    assert db.payload("runtime_boundary_receipts", "receipt_json", runtime_id=rt) == (
        original_receipt
    )

    assert migrated_lifecycle is not None and migrated_input is not None
    assert DOMAIN.decode_lifecycle(migrated_lifecycle).runtime_state == "idle"
    state = DOMAIN.decode_input_state(migrated_input)
    assert (state.input_id, state.current_state) == (F.INPUT_ID, "consumed")
    assert db.query("SELECT * FROM runtime_ops_lifecycle") == []

    repeated = migrate_v0_6_34_completed_idle(db.target, apply=True)
    assert repeated.applied
    assert repeated.migration_count() == 0
    assert repeated.items[0].disposition is D.CURRENT
    assert len(db.query(f"SELECT * FROM {F.AUDIT}")) == 3


def _assert_refused_without_writes(db: LegacyDb) -> None:
    before = db.snapshot()
    lifecycle_before = db.lifecycle()
    with pytest.raises(ReadFailed) as info:
        migrate_v0_6_34_completed_idle(db.target, apply=True)
    assert isinstance(info.value, LegacyMigrationBlocked)
    assert str(info.value) == (
        f"Store read failed: legacy migration blocked for runtime(s): {F.RUNTIME_ID}"
    )
    assert db.lifecycle() == lifecycle_before == b'"idle"'
    assert db.snapshot() == before
    assert F.AUDIT not in db.tables()


def test_44_legacy_migration_refuses_nonterminal_input_without_writes(legacy_db: LegacyDb) -> None:
    db = legacy_db
    F.build_complete_v0_6_34(db)
    nonterminal = F.input_state(state="accepted")
    nonterminal["terminal_outcome"] = None
    db.execute(
        "UPDATE runtime_input_states SET state_json = ? WHERE runtime_id = ?",
        (F.compact(nonterminal), F.RUNTIME_ID),
    )

    dry_run = migrate_v0_6_34_completed_idle(db.target)
    assert dry_run.blocked_count() == 1
    assert dry_run.items[0].detail == (
        f"input {F.INPUT_ID}: only terminal phase/outcome pairs are safe to migrate "
        "(observed Accepted)"
    )
    _assert_refused_without_writes(db)


def test_45_legacy_migration_refuses_mixed_current_input_without_writes(
    legacy_db: LegacyDb,
) -> None:
    db = legacy_db
    F.build_complete_v0_6_34(db)
    current = DOMAIN.encode_input_state(StoredInputState.new_accepted())
    db.execute(
        "UPDATE runtime_input_states SET state_json = ? WHERE runtime_id = ?",
        (current, F.RUNTIME_ID),
    )

    dry_run = migrate_v0_6_34_completed_idle(db.target)
    assert dry_run.blocked_count() == 1
    detail = dry_run.items[0].detail
    assert detail is not None and "mixed current-format companion" in detail
    assert detail == (
        f"input {F.INPUT_ID}: mixed current-format companion under a bare v0.6.34 "
        "lifecycle is unsupported"
    )
    _assert_refused_without_writes(db)
