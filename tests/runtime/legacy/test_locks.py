"""Fail-fast locks and read-only opening of the legacy migrator (spec runtime §5.2 items 10–11).

Each fence is raced for real: another connection (or a second migrator in a
thread, paused mid-transaction through the progress callback) holds the lock.
"Fast" is asserted as a generous bound (the migrator never waits on a lock;
a regression would hang until the pytest timeout or take the 30 s busy wait).
SQLite-only variants (WAL journal mode) are named ``test_sqlite_*``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.engine import make_url

from agentkeep.legacy.migrator import (
    LegacyMigrationProgress,
    LegacyV0634MigrationDisposition,
    LegacyV0634MigrationItem,
    LegacyV0634MigrationReport,
    migrate_v0_6_34_completed_idle,
)
from agentkeep.runtime.errors import ReadFailed, WriteFailed

from . import _legacy_db as F
from ._legacy_db import LegacyDb

D = LegacyV0634MigrationDisposition
RT = F.RUNTIME_ID
FAST_S = 5.0  # far below the store's 30 s busy timeout; the migrator's is 0
WAIT_S = 60.0


def _fails_fast(error: type[Exception], target: str, *, apply: bool) -> Exception:
    """Run the migrator, expect ``error`` within :data:`FAST_S`; return the error."""
    start = time.monotonic()
    with pytest.raises(error) as info:
        migrate_v0_6_34_completed_idle(target, apply=apply)
    assert time.monotonic() - start < FAST_S
    return info.value


def _read_lock(db: LegacyDb) -> Any:
    """Another connection inside a read transaction that has read runtime_states."""
    begin = ["BEGIN"] if db.backend == "sqlite" else []
    return db.hold([*begin, "SELECT * FROM runtime_states"])


def _exclusive_lock(db: LegacyDb) -> Any:
    """Another connection holding the strongest write lock on runtime_states."""
    if db.backend == "sqlite":
        return db.hold(["BEGIN EXCLUSIVE"])
    return db.hold(["LOCK TABLE runtime_states IN ACCESS EXCLUSIVE MODE"])


# --------------------------------------------------------------------------
# Missing database, read-only dry run


def test_missing_database_is_read_failed_and_nothing_is_created(
    legacy_db: LegacyDb, tmp_path: Path
) -> None:
    if legacy_db.backend == "sqlite":
        missing = tmp_path / "missing" / "sessions.sqlite3"
        targets = [(str(missing), str(missing)), (f"sqlite:///{missing}", str(missing))]
    else:
        url = make_url(legacy_db.url)
        missing_url = url.set(database=f"{url.database}_missing")
        shown = missing_url.render_as_string(hide_password=True)
        targets = [(missing_url.render_as_string(hide_password=False), shown)]
    for target, shown in targets:
        for apply in (False, True):
            with pytest.raises(ReadFailed) as info:
                migrate_v0_6_34_completed_idle(target, apply=apply)
            assert type(info.value) is ReadFailed
            assert str(info.value) == f"Store read failed: runtime database does not exist: {shown}"
    if legacy_db.backend == "sqlite":
        assert not missing.parent.exists()
    else:
        name = make_url(targets[0][0]).database
        assert legacy_db.query("SELECT 1 FROM pg_database WHERE datname = ?", (name,)) == []


def test_sqlite_directory_is_not_a_database_file(tmp_path: Path) -> None:
    for apply in (False, True):
        with pytest.raises(ReadFailed, match="runtime database does not exist"):
            migrate_v0_6_34_completed_idle(tmp_path, apply=apply)
    assert list(tmp_path.iterdir()) == []


def _assert_dry_run_changes_nothing(db: LegacyDb) -> LegacyV0634MigrationReport:
    objects, rows = db.schema_objects(), db.snapshot()
    digest = db.file_digest() if db.backend == "sqlite" else None
    files = sorted(p.name for p in db.path.parent.iterdir()) if db.backend == "sqlite" else None
    report = migrate_v0_6_34_completed_idle(db.target)
    assert db.schema_objects() == objects
    assert db.snapshot() == rows
    if db.backend == "sqlite":
        assert db.file_digest() == digest
        assert sorted(p.name for p in db.path.parent.iterdir()) == files
    return report


def test_dry_run_creates_and_changes_nothing(legacy_db: LegacyDb) -> None:
    assert _assert_dry_run_changes_nothing(legacy_db).items == ()  # an empty database
    F.create_schema(legacy_db, ["runtime_states"], sessions=False)
    F.insert_runtime(legacy_db, snapshot=None, inputs=[], receipts=[], ops_record=None)
    report = _assert_dry_run_changes_nothing(legacy_db)  # no companion table gets created
    assert report.items == (LegacyV0634MigrationItem(RT, D.WOULD_MIGRATE),)
    assert legacy_db.tables() == {"runtime_states"}


def test_sqlite_wal_dry_run_leaves_the_database_file_unchanged(sqlite_db: LegacyDb) -> None:
    F.build_complete_v0_6_34(sqlite_db)
    F.set_wal(sqlite_db)
    objects, rows = sqlite_db.schema_objects(), sqlite_db.snapshot()
    digest = sqlite_db.file_digest()
    report = migrate_v0_6_34_completed_idle(sqlite_db.target)
    assert report.items == (LegacyV0634MigrationItem(RT, D.WOULD_MIGRATE),)
    assert (sqlite_db.schema_objects(), sqlite_db.snapshot()) == (objects, rows)
    assert sqlite_db.file_digest() == digest  # SQLite's own -wal/-shm side files aside


# --------------------------------------------------------------------------
# Another connection holds a lock


def test_apply_fails_fast_while_another_connection_holds_a_read_transaction(
    legacy_db: LegacyDb,
) -> None:
    db = legacy_db
    F.build_complete_v0_6_34(db)
    rows = db.snapshot()
    digest = db.file_digest() if db.backend == "sqlite" else None
    reader = _read_lock(db)
    try:
        _fails_fast(WriteFailed, db.target, apply=True)
    finally:
        reader.close()
    assert db.snapshot() == rows
    assert F.AUDIT not in db.tables()
    if digest is not None:
        assert db.file_digest() == digest
    assert migrate_v0_6_34_completed_idle(db.target, apply=True).migration_count() == 1


def test_dry_run_fails_fast_while_a_writer_holds_an_exclusive_lock(legacy_db: LegacyDb) -> None:
    db = legacy_db
    F.build_complete_v0_6_34(db)
    writer = _exclusive_lock(db)
    try:
        error = _fails_fast(ReadFailed, db.target, apply=False)
        assert "lock" in str(error).lower()
    finally:
        writer.close()
    assert migrate_v0_6_34_completed_idle(db.target).migration_count() == 1


@pytest.mark.parametrize("statements", [["BEGIN", "SELECT * FROM runtime_states"], []])
def test_sqlite_wal_apply_fails_while_another_connection_has_the_file_open(
    sqlite_db: LegacyDb, statements: list[str]
) -> None:
    """In WAL mode BEGIN EXCLUSIVE alone admits readers; the exclusive locking mode does not.

    Parametrised: the other connection is inside a read transaction, or idle
    (it read once and holds no transaction).
    """
    F.build_complete_v0_6_34(sqlite_db)
    F.set_wal(sqlite_db)
    rows = sqlite_db.snapshot()
    other = sqlite_db.hold(statements or ["SELECT count(*) FROM runtime_states"])
    try:
        error = _fails_fast(WriteFailed, sqlite_db.target, apply=True)
        assert "locked" in str(error)
    finally:
        other.close()
    assert sqlite_db.snapshot() == rows
    assert migrate_v0_6_34_completed_idle(sqlite_db.target, apply=True).migration_count() == 1


# --------------------------------------------------------------------------
# Two migrators


@dataclass
class _Paused:
    """An apply running in a thread, paused after its first runtime's writes."""

    target: str
    paused: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)
    result: list[Any] = field(default_factory=list)

    def _progress(self, step: LegacyMigrationProgress) -> None:
        if step.phase == "migrate" and not self.paused.is_set():
            self.paused.set()
            assert self.release.wait(WAIT_S)

    def run(self) -> None:
        try:
            self.result.append(
                migrate_v0_6_34_completed_idle(self.target, apply=True, progress=self._progress)
            )
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            self.result.append(exc)


@contextmanager
def _paused_apply(db: LegacyDb) -> Iterator[_Paused]:
    paused = _Paused(db.target)
    thread = threading.Thread(target=paused.run)
    thread.start()
    try:
        assert paused.paused.wait(WAIT_S), paused.result
        yield paused
    finally:
        paused.release.set()
        thread.join(WAIT_S)
        assert not thread.is_alive()


def _paused_apply_excludes_everyone(db: LegacyDb) -> None:
    F.build_complete_v0_6_34(db)
    F.insert_runtime(db, "rt:second", ops_record=None)
    with _paused_apply(db) as first:
        _fails_fast(WriteFailed, db.target, apply=True)
        _fails_fast(ReadFailed, db.target, apply=False)
    (report,) = first.result
    assert isinstance(report, LegacyV0634MigrationReport), report
    assert [i.disposition for i in report.items] == [D.MIGRATED, D.MIGRATED]
    again = migrate_v0_6_34_completed_idle(db.target, apply=True)
    assert [i.disposition for i in again.items] == [D.CURRENT, D.CURRENT]
    assert len(db.query(f"SELECT * FROM {F.AUDIT}")) == 4


def test_apply_in_progress_excludes_other_migrators(legacy_db: LegacyDb) -> None:
    _paused_apply_excludes_everyone(legacy_db)


def test_sqlite_wal_apply_in_progress_excludes_other_migrators(sqlite_db: LegacyDb) -> None:
    F.set_wal(sqlite_db)
    _paused_apply_excludes_everyone(sqlite_db)
    assert sqlite_db.query("PRAGMA journal_mode") == [("wal",)]


def _race_two_applies(target: str) -> list[Any]:
    """Start two applies at once (a barrier); return their reports or WriteFailed errors."""
    barrier = threading.Barrier(2)
    results: list[Any] = [None, None]

    def apply(slot: int) -> None:
        barrier.wait(WAIT_S)
        try:
            results[slot] = migrate_v0_6_34_completed_idle(target, apply=True)
        except WriteFailed as exc:
            results[slot] = exc

    threads = [threading.Thread(target=apply, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    return results


def test_two_concurrent_applies_never_both_migrate(legacy_db: LegacyDb) -> None:
    """At most one of two racing applies migrates; nothing is ever written twice or in part.

    A loser fails fast (WriteFailed) or runs after the winner's commit and sees
    Current. Because neither waits, on SQLite both can lose when they contend
    on the lock acquisition itself: then nothing was written and the next
    apply migrates. On Postgres the first to lock ``runtime_states`` wins.
    """
    db = legacy_db
    F.create_schema(db)
    for round_ in range(8):
        rid = f"rt:race:{round_}"
        F.insert_runtime(db, rid, ops_record=F.OPS_LIFECYCLE_EMPTY)
        results = _race_two_applies(db.target)
        winners = [
            r
            for r in results
            if isinstance(r, LegacyV0634MigrationReport)
            and LegacyV0634MigrationItem(rid, D.MIGRATED) in r.items
        ]
        assert len(winners) <= 1, results
        for loser in (r for r in results if not any(r is w for w in winners)):
            assert isinstance(loser, WriteFailed) or (
                isinstance(loser, LegacyV0634MigrationReport)
                and LegacyV0634MigrationItem(rid, D.CURRENT) in loser.items
            ), loser
        if not winners:
            assert db.backend == "sqlite", results
            assert db.lifecycle(rid) == F.RUNTIME_STATE
            assert db.query("SELECT * FROM runtime_ops_lifecycle WHERE runtime_id = ?", (rid,))
            report = migrate_v0_6_34_completed_idle(db.target, apply=True)
            assert LegacyV0634MigrationItem(rid, D.MIGRATED) in report.items
        audit = db.query(f"SELECT table_name FROM {F.AUDIT} WHERE runtime_id = ?", (rid,))
        assert sorted(audit) == [("runtime_ops_lifecycle",), ("runtime_states",)]
