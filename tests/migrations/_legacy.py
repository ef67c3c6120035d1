"""Builders of un-versioned legacy ``runs`` files (spec runs §1.1–1.2) and file probes.

SQLite only. Files are written with the ``sqlite3`` module, the way the
original Rust store wrote them: rollback-journal mode (no WAL), the exact
original ``CREATE TABLE`` text (minus the columns a shape lacks), or the
first release's table carried forward by ``ALTER TABLE runs ADD COLUMN``.
"""

from __future__ import annotations

import hashlib
import sqlite3
from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: The original head DDL, column by column, in its CREATE TABLE order.
FULL_COLUMNS: tuple[tuple[str, str], ...] = (
    ("id", "TEXT PRIMARY KEY"),
    ("task_id", "TEXT NOT NULL"),
    ("status", "TEXT NOT NULL"),
    ("step_entries_json", "TEXT NOT NULL"),
    ("degradations_json", "TEXT NOT NULL DEFAULT '[]'"),
    ("operator_sid", "TEXT"),
    ("current_json", "TEXT"),
    ("next_generation", "INTEGER NOT NULL DEFAULT 0"),
    ("result_ref_json", "TEXT"),
    ("input_json", "TEXT"),
    ("created_at", "INTEGER NOT NULL"),
    ("updated_at", "INTEGER NOT NULL"),
)
DECL = dict(FULL_COLUMNS)

#: The columns added after the first release, in the ad-hoc migrator's order.
ADDED_ORDER: tuple[str, ...] = (
    "degradations_json",
    "input_json",
    "current_json",
    "next_generation",
)
L0_COLUMNS: tuple[str, ...] = tuple(n for n, _ in FULL_COLUMNS if n not in ADDED_ORDER)

#: shape -> (number of ADDED_ORDER columns it has, revision it must be stamped at)
SHAPES: dict[str, tuple[int, str]] = {
    "L0": (0, "runs_0001"),
    "L1": (1, "runs_0002"),
    "L2": (2, "runs_0003"),
    "L3a": (3, "runs_0004"),
    "L3": (4, "runs_0005"),
}

INDEX_SQL = "CREATE INDEX IF NOT EXISTS ix_runs_task_id ON runs(task_id, created_at)"

STEP_JSON = '[{"step_id":"ST-1","step_ref":"s1","status":"passed","binding_digest":null,"at":120}]'

#: Rows written while the table had only the L0 columns. Insertion (rowid)
#: order c, a, b differs from id order and from (created_at, id) order.
L0_ROWS: tuple[dict[str, Any], ...] = (
    {
        "id": "R-c",
        "task_id": "T-1",
        "status": '"running"',
        "step_entries_json": STEP_JSON,
        "operator_sid": "S-op1",
        "result_ref_json": None,
        "created_at": 100,
        "updated_at": 150,
    },
    {
        "id": "R-a",
        "task_id": "T-1",
        "status": '"pending"',
        "step_entries_json": "[]",
        "operator_sid": None,
        "result_ref_json": '{"k":[1,2]}',
        "created_at": 100,
        "updated_at": 100,
    },
    {
        "id": "R-b",
        "task_id": "T-2",
        "status": '"done"',
        "step_entries_json": "[]",
        "operator_sid": None,
        "result_ref_json": None,
        "created_at": 90,
        "updated_at": 200,
    },
)


def shape_columns(shape: str) -> tuple[str, ...]:
    """The column names of ``shape`` in the original CREATE TABLE order."""
    n_added, _ = SHAPES[shape]
    have = set(L0_COLUMNS) | set(ADDED_ORDER[:n_added])
    return tuple(name for name, _ in FULL_COLUMNS if name in have)


def create_table_sql(columns: Sequence[tuple[str, str]], suffix: str = "") -> str:
    body = ", ".join(f"{name} {decl}" for name, decl in columns)
    return f"CREATE TABLE IF NOT EXISTS runs ({body}){suffix}"


def insert_rows(conn: sqlite3.Connection, rows: Sequence[dict[str, Any]]) -> None:
    for row in rows:
        cols = ", ".join(row)
        marks = ", ".join("?" for _ in row)
        conn.execute(f"INSERT INTO runs ({cols}) VALUES ({marks})", tuple(row.values()))


def build_legacy(path: Path, shape: str, *, order: str, index: bool) -> None:
    """Write an un-versioned ``runs`` file of ``shape`` with the L0 rows in it.

    Args:
        path: the file to create.
        shape: ``L0``, ``L1``, ``L2``, ``L3a`` or ``L3``.
        order: ``"fresh"`` (the shape's own CREATE TABLE) or ``"altered"``
            (L0's CREATE TABLE, rows, then ``ALTER TABLE ... ADD COLUMN``).
        index: whether ``ix_runs_task_id`` exists.
    """
    n_added, _ = SHAPES[shape]
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        if order == "fresh":
            cols = [(n, DECL[n]) for n in shape_columns(shape)]
            conn.execute(create_table_sql(cols))
            if index:
                conn.execute(INDEX_SQL)
            insert_rows(conn, L0_ROWS)
        elif order == "altered":
            conn.execute(create_table_sql([(n, DECL[n]) for n in L0_COLUMNS]))
            if index:
                conn.execute(INDEX_SQL)
            insert_rows(conn, L0_ROWS)
            for name in ADDED_ORDER[:n_added]:
                conn.execute(f"ALTER TABLE runs ADD COLUMN {name} {DECL[name]}")
        else:
            raise ValueError(order)
    finally:
        conn.close()


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def query(path: Path, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
    """Run one query on ``path`` with a plain sqlite3 connection (no writes)."""
    conn = sqlite3.connect(path)
    try:
        return conn.execute(sql, tuple(params)).fetchall()
    finally:
        conn.close()


def names(path: Path) -> set[str]:
    """Names of every table, index, view and trigger in the file."""
    return {r[0] for r in query(path, "SELECT name FROM sqlite_master")}


def columns(path: Path, table: str = "runs") -> list[str]:
    return [r[1] for r in query(path, f"PRAGMA table_info({table})")]


def snapshot(path: Path) -> dict[str, Any]:
    """Everything a refused or rolled-back attempt must leave as it was."""
    return {
        "schema": query(path, "SELECT type, name, tbl_name, sql FROM sqlite_master ORDER BY name"),
        "journal_mode": query(path, "PRAGMA journal_mode")[0][0],
        "dump": list(_dump(path)),
        "sha256": sha256(path),
    }


def _dump(path: Path) -> list[str]:
    conn = sqlite3.connect(path)
    try:
        return list(conn.iterdump())
    finally:
        conn.close()


def assert_unchanged(path: Path, before: dict[str, Any]) -> None:
    """Assert the file is logically and byte-for-byte what it was.

    The logical parts are compared first so that a failure says *what*
    changed; the SHA-256 catches the rest (for example a journal-mode switch,
    which rewrites header bytes 18-19).
    """
    after = snapshot(path)
    assert after["schema"] == before["schema"]
    assert after["dump"] == before["dump"]
    assert after["journal_mode"] == before["journal_mode"]
    assert after["sha256"] == before["sha256"], "file bytes changed (header or pages)"
