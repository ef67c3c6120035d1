"""Two processes upgrading the same database at the same moment (design §5, spec runs §5.1).

Real processes (multiprocessing "spawn"), released together by a barrier: one
calls ``migrations.upgrade(url)``, the other ``Store.open(url, migrate=True)``.
The fresh-database case runs on SQLite and Postgres; the legacy-file case is
SQLite only (legacy files exist only as SQLite files).
"""

from __future__ import annotations

import multiprocessing
import queue
import sqlite3
from pathlib import Path
from typing import Any

from agentkeep import migrations as migrate
from tests.racing import READY_TIMEOUT_S

from . import _legacy as L
from ._workers import upgrade_in_child

TIMEOUT_S = 90  # for an upgrade, once both children are up


def race_upgrade(url: str) -> list[tuple[Any, ...]]:
    """Run the two upgraders at once; return both reports (bounded waits throughout)."""
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(2, timeout=READY_TIMEOUT_S)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=upgrade_in_child, args=(url, how, barrier, results))
        for how in ("upgrade", "store_open")
    ]
    for p in procs:
        p.start()
    reports: list[tuple[Any, ...]] = []
    try:
        for _ in procs:
            reports.append(results.get(timeout=READY_TIMEOUT_S + TIMEOUT_S))
    except queue.Empty:
        pass
    finally:
        for p in procs:
            p.join(timeout=TIMEOUT_S)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
    assert len(reports) == 2, f"a child did not report: {reports}"
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return reports


def test_two_processes_upgrade_a_fresh_database(fresh_url: str) -> None:
    reports = race_upgrade(fresh_url)

    for how, status, detail, _ in reports:
        assert status == "ok", (how, detail)
        assert detail == migrate.head_revisions(), how
    # The runs adopter ran once, in the process that migrated; the other found the
    # branch stamped and did not look again.
    consulted = [a for *_, adoptions in reports for a in adoptions]
    assert consulted == [None]
    assert migrate.current(fresh_url) == migrate.head_revisions()
    assert migrate.check(fresh_url) == []


def test_two_processes_adopt_the_same_legacy_file_once(tmp_path: Path) -> None:
    """SQLite only: an L2 file carried forward by ALTERs, without the index, with rows."""
    path = tmp_path / "legacy.db"
    L.build_legacy(path, "L2", order="altered", index=False)
    url = f"sqlite:///{path}"
    conn = sqlite3.connect(path)
    conn.row_factory = sqlite3.Row
    before = [dict(r) for r in conn.execute("SELECT * FROM runs ORDER BY rowid")]
    conn.close()

    reports = race_upgrade(url)

    for how, status, detail, _ in reports:
        assert status == "ok", (how, detail)  # e.g. no "duplicate column name"
        assert detail == migrate.head_revisions(), how
    consulted = [a for *_, adoptions in reports for a in adoptions]
    assert consulted == ["runs_0003"]  # adopted exactly once, at the L2 revision
    assert migrate.current(url) == migrate.head_revisions()
    assert migrate.check(url) == []
    assert L.query(path, f"SELECT version_num FROM {migrate.VERSION_TABLE}") == [
        migrate.head_revisions()
    ]

    conn = sqlite3.connect(path)
    conn.row_factory = sqlite3.Row
    after = [dict(r) for r in conn.execute("SELECT * FROM runs ORDER BY seq")]
    conn.close()
    assert [r["id"] for r in after] == [r["id"] for r in before]  # seq keeps rowid order
    for old, new in zip(before, after, strict=True):
        assert {k: new[k] for k in old} == old
        assert (new["current_json"], new["next_generation"]) == (None, 0)
