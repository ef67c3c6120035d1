"""Atomicity of an apply: hundreds of runtimes in one transaction, and a SIGKILL mid-apply.

The crash case runs the migrator in a child process that pauses inside the
open transaction (through the progress callback, after the last runtime's
writes, just before COMMIT) and is killed there with SIGKILL; the database
must then hold exactly what it held before (SQLite: the same file bytes once
a connection has recovered it).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from agentkeep.legacy.migrator import (
    LegacyMigrationProgress,
    LegacyV0634MigrationDisposition,
    migrate_v0_6_34_completed_idle,
)
from agentkeep.runtime.domain import ReferenceDomain
from agentkeep.runtime.errors import ReadFailed

from . import _legacy_db as F
from ._legacy_db import LegacyDb

D = LegacyV0634MigrationDisposition
MANY = 300
WAIT_S = 120

_CHILD = textwrap.dedent(
    """
    import sys
    from agentkeep.legacy.migrator import migrate_v0_6_34_completed_idle

    target, pause_at = sys.argv[1], int(sys.argv[2])

    def progress(step):
        if step.phase == "migrate" and step.index == pause_at:
            print("paused", flush=True)
            sys.stdin.readline()  # blocks until the parent kills this process
            raise SystemExit("resumed instead of being killed")

    migrate_v0_6_34_completed_idle(target, apply=True, progress=progress)
    print("committed", flush=True)
    """
)


def test_hundreds_of_runtimes_migrate_in_one_transaction(legacy_db: LegacyDb) -> None:
    db = legacy_db
    F.create_schema(db)
    ids = F.insert_many_runtimes(db, MANY)
    steps: list[LegacyMigrationProgress] = []
    report = migrate_v0_6_34_completed_idle(db.target, apply=True, progress=steps.append)
    assert [i.runtime_id for i in report.items] == ids
    assert {i.disposition for i in report.items} == {D.MIGRATED}
    assert steps == [
        LegacyMigrationProgress(phase, n, MANY, rid)
        for phase in ("check", "migrate")
        for n, rid in enumerate(ids, start=1)
    ]
    assert db.query(f"SELECT count(*) FROM {F.AUDIT}") == [(3 * MANY,)]
    assert db.query("SELECT count(*) FROM runtime_ops_lifecycle") == [(0,)]
    domain = ReferenceDomain()
    for (payload,) in db.query("SELECT runtime_state_json FROM runtime_states"):
        assert domain.decode_lifecycle(payload).runtime_state == "idle"


def test_a_failure_at_the_last_runtime_rolls_back_every_runtime(legacy_db: LegacyDb) -> None:
    db = legacy_db
    F.create_schema(db)
    F.insert_many_runtimes(db, MANY)
    before = db.snapshot()

    def fail_at_last(step: LegacyMigrationProgress) -> None:
        if step.phase == "migrate" and step.index == MANY:
            raise RuntimeError("injected failure before COMMIT")

    with pytest.raises(RuntimeError, match="injected failure"):
        migrate_v0_6_34_completed_idle(db.target, apply=True, progress=fail_at_last)
    assert db.snapshot() == before
    assert F.AUDIT not in db.tables()


def _kill_mid_apply(db: LegacyDb, pause_at: int) -> None:
    """Run an apply in a child process, wait until it pauses inside its transaction, SIGKILL it."""
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, db.target, str(pause_at)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        line = child.stdout.readline()
        assert line == "paused\n", (line, child.stderr.read() if child.stderr else "")
        # the child holds the exclusive lock: a dry run from here fails fast
        with pytest.raises(ReadFailed):
            migrate_v0_6_34_completed_idle(db.target)
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait(WAIT_S) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(WAIT_S)


def _assert_sigkill_leaves_the_database_as_it_was(db: LegacyDb) -> None:
    F.build_complete_v0_6_34(db)
    F.insert_many_runtimes(db, MANY)
    digest = db.file_digest() if db.backend == "sqlite" else None
    rows, objects = db.snapshot(), db.schema_objects()

    _kill_mid_apply(db, pause_at=MANY + 1)  # the last runtime: every write done, no COMMIT

    assert db.snapshot() == rows  # (this read also recovers a SQLite hot journal)
    assert db.schema_objects() == objects
    if digest is not None:
        assert db.file_digest() == digest
    report = migrate_v0_6_34_completed_idle(db.target, apply=True)
    assert report.migration_count() == MANY + 1


def test_sigkill_during_apply_leaves_the_database_as_it_was(legacy_db: LegacyDb) -> None:
    _assert_sigkill_leaves_the_database_as_it_was(legacy_db)


def test_sqlite_wal_sigkill_during_apply_leaves_the_database_as_it_was(
    sqlite_db: LegacyDb,
) -> None:
    F.set_wal(sqlite_db)
    _assert_sigkill_leaves_the_database_as_it_was(sqlite_db)
