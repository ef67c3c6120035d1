"""The append-only audit table of the legacy migrator (spec runtime §1.12, §6.5, §5.2 item 15)."""

from __future__ import annotations

import pytest

from agentkeep.legacy.migrator import (
    LegacyV0634MigrationDisposition,
    LegacyV0634MigrationItem,
    migrate_v0_6_34_completed_idle,
)
from agentkeep.runtime.errors import WriteFailed

from . import _legacy_db as F
from ._legacy_db import LegacyDb

D = LegacyV0634MigrationDisposition
RT = F.RUNTIME_ID


def _audit_rows(db: LegacyDb) -> list[tuple[object, ...]]:
    return db.query(f"SELECT * FROM {F.AUDIT} ORDER BY runtime_id, table_name, row_key")


def _triggers(db: LegacyDb) -> list[str]:
    if db.backend == "sqlite":
        rows = db.query(
            "SELECT name FROM sqlite_master WHERE type = 'trigger' AND tbl_name = ?", (F.AUDIT,)
        )
    else:
        rows = db.query(
            "SELECT tgname FROM pg_trigger WHERE tgrelid = to_regclass(?) AND NOT tgisinternal",
            (F.AUDIT,),
        )
    return sorted(r[0] for r in rows)


def _expected_triggers(db: LegacyDb) -> list[str]:
    kinds = ["no_delete", "no_update"] + (["no_truncate"] if db.backend == "postgres" else [])
    return sorted(f"{F.AUDIT}_{k}" for k in kinds)


def test_audit_rows_are_append_only(legacy_db: LegacyDb) -> None:
    db = legacy_db
    F.build_complete_v0_6_34(db)
    migrate_v0_6_34_completed_idle(db.target, apply=True)
    rows = _audit_rows(db)
    assert len(rows) == 3
    statements = [
        f"UPDATE {F.AUDIT} SET action = 'delete' WHERE table_name = 'runtime_states'",
        f"UPDATE {F.AUDIT} SET original_record = migrated_record",
        f"DELETE FROM {F.AUDIT} WHERE table_name = 'runtime_ops_lifecycle'",
        f"DELETE FROM {F.AUDIT}",
    ]
    if db.backend == "postgres":
        statements.append(f"TRUNCATE {F.AUDIT}")
    for statement in statements:
        with pytest.raises(F.DB_ERRORS, match=F.APPEND_ONLY):
            db.execute(statement)
        assert _audit_rows(db) == rows, statement
    assert _triggers(db) == _expected_triggers(db)


def test_later_apply_appends_to_the_audit_without_recreating_it(legacy_db: LegacyDb) -> None:
    """A runtime found legacy after an earlier apply is migrated; triggers stay one set."""
    db = legacy_db
    F.build_complete_v0_6_34(db)
    migrate_v0_6_34_completed_idle(db.target, apply=True)
    first = _audit_rows(db)
    F.insert_runtime(db, "rt:later", ops_record=None)
    report = migrate_v0_6_34_completed_idle(db.target, apply=True)
    assert report.items == (
        LegacyV0634MigrationItem("rt:later", D.MIGRATED),
        LegacyV0634MigrationItem(RT, D.CURRENT),
    )
    rows = _audit_rows(db)
    assert [r for r in rows if r[0] == RT] == first
    assert [(r[0], r[1], r[2], r[5]) for r in rows if r[0] == "rt:later"] == [
        ("rt:later", "runtime_states", "singleton", "replace")
    ]
    assert _triggers(db) == _expected_triggers(db)


def test_reinserting_an_audit_key_fails_and_rolls_back_everything(legacy_db: LegacyDb) -> None:
    """A legacy row written again after commit (a process left running) cannot be re-audited."""
    db = legacy_db
    F.build_complete_v0_6_34(db)
    migrate_v0_6_34_completed_idle(db.target, apply=True)
    # a new legacy runtime that sorts first (its writes happen, then must roll back) ...
    F.insert_runtime(db, "rt:a-fresh", ops_record=None)
    # ... and the migrated runtime written back in its legacy form
    db.execute(
        "UPDATE runtime_states SET runtime_state_json = ? WHERE runtime_id = ?",
        (F.RUNTIME_STATE, RT),
    )
    db.execute(
        "UPDATE runtime_input_states SET state_json = ? WHERE runtime_id = ?",
        (F.INPUT_STATE_CONSUMED, RT),
    )
    report = migrate_v0_6_34_completed_idle(db.target)
    assert [i.disposition for i in report.items] == [D.WOULD_MIGRATE, D.WOULD_MIGRATE]
    before = db.snapshot()
    with pytest.raises(WriteFailed) as info:
        migrate_v0_6_34_completed_idle(db.target, apply=True)
    assert "unique" in str(info.value).lower() or "duplicate" in str(info.value).lower()
    assert db.snapshot() == before
    assert db.lifecycle("rt:a-fresh") == db.lifecycle(RT) == F.RUNTIME_STATE
