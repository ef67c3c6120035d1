"""Adoption of an un-versioned ``runs`` table written by the original store.

Described in docs/runs.md#adopting-legacy-files. :func:`detect_runs_revision`
fingerprints the table and returns the revision of the ``runs`` branch whose
shape it has (L0 → runs_0001 … L3 → runs_0005); :mod:`agentkeep.migrations`
stamps it and upgrades to head, in the same transaction. Only the column *set*
matters, not the column order (files carried forward by
``ALTER TABLE ADD COLUMN`` append columns).

What is compared per column: declared type (case-insensitive), NOT NULL
(except on ``id``, which legacy rowid tables report as nullable), the default
text as ``PRAGMA table_info`` reports it, and the primary key (``id`` only).
The table must be a real rowid table, and ``ix_runs_task_id``, if present,
must be on ``(task_id, created_at)``; when absent it is created, as the
original store's ``open`` did.

Anything else raises :class:`~agentkeep.errors.LegacySchemaMismatch` before a
single statement writes: the caller's transaction rolls back and the file is
left as it was. Adoption is SQLite-only: no Postgres database predates
agentkeep, so an un-versioned Postgres database with a ``runs`` table is refused.
"""

from __future__ import annotations

from typing import Final, NamedTuple

from sqlalchemy import Connection, inspect, text
from sqlalchemy.exc import OperationalError

from agentkeep.errors import LegacySchemaMismatch

__all__ = ["SHAPES", "detect_runs_revision"]


class _Col(NamedTuple):
    type: str
    notnull: bool
    default: str | None


_T: Final = _Col("TEXT", True, None)
_T_NULL: Final = _Col("TEXT", False, None)
_I: Final = _Col("INTEGER", True, None)

_L0: Final = {
    "id": _Col("TEXT", False, None),  # notnull not compared on id
    "task_id": _T,
    "status": _T,
    "step_entries_json": _T,
    "operator_sid": _T_NULL,
    "result_ref_json": _T_NULL,
    "created_at": _I,
    "updated_at": _I,
}
_L1: Final = {**_L0, "degradations_json": _Col("TEXT", True, "'[]'")}
_L2: Final = {**_L1, "input_json": _T_NULL}
_L3A: Final = {**_L2, "current_json": _T_NULL}
_L3: Final = {**_L3A, "next_generation": _Col("INTEGER", True, "0")}

#: (shape name, revision to stamp, columns), newest first.
SHAPES: Final = (
    ("L3", "runs_0005", _L3),
    ("L3a", "runs_0004", _L3A),
    ("L2", "runs_0003", _L2),
    ("L1", "runs_0002", _L1),
    ("L0", "runs_0001", _L0),
)

_INDEX: Final = "ix_runs_task_id"
_INDEX_COLUMNS: Final = ["task_id", "created_at"]


def detect_runs_revision(conn: Connection) -> str | None:
    """Return the revision to stamp for an un-versioned ``runs`` table.

    Args:
        conn: the migration connection, inside its write transaction.

    Returns:
        ``None`` when there is no ``runs`` table (a fresh database for this
        branch, even if other tables such as ``run_trace`` exist), else the
        revision whose shape the table has. Creates the missing
        ``ix_runs_task_id`` index of a matching table.

    Raises:
        LegacySchemaMismatch: the table matches no historical shape, is a view
            or a WITHOUT ROWID table, has the index on other columns, or sits
            in an un-versioned Postgres database.
    """
    if conn.dialect.name != "sqlite":
        if inspect(conn).has_table("runs"):
            raise LegacySchemaMismatch(
                "runs",
                "none",
                [
                    "an un-versioned Postgres database already has a runs table; "
                    "no Postgres database predates agentkeep, so it is not adopted"
                ],
            )
        return None

    kind = conn.execute(
        text("SELECT type FROM sqlite_master WHERE name = 'runs' AND type IN ('table', 'view')")
    ).scalar()
    if kind is None:
        return None
    if kind == "view":
        raise LegacySchemaMismatch("runs", "none", ["runs is a view, not a table"])
    try:
        conn.execute(text("SELECT rowid FROM runs LIMIT 0"))
    except OperationalError:
        raise LegacySchemaMismatch("runs", "none", ["runs is a WITHOUT ROWID table"]) from None

    live = {
        row[1]: (_Col(str(row[2]).upper(), bool(row[3]), row[4]), int(row[5]))
        for row in conn.execute(text("PRAGMA table_info(runs)"))
    }
    index_problem = _index_problem(conn)

    best: tuple[int, str, list[str]] | None = None
    for name, revision, shape in SHAPES:
        score, diffs = _compare(live, shape)
        if not diffs and index_problem is None:
            if not _has_index(conn):
                conn.execute(
                    text("CREATE INDEX IF NOT EXISTS ix_runs_task_id ON runs(task_id, created_at)")
                )
            return revision
        if index_problem is not None:
            diffs = [*diffs, index_problem]
        # Closest = fewest differing columns and attributes; ties go to the
        # newer shape (SHAPES is newest first).
        if best is None or score < best[0]:
            best = (score, name, diffs)
    assert best is not None
    raise LegacySchemaMismatch("runs", best[1], best[2])


def _compare(live: dict[str, tuple[_Col, int]], shape: dict[str, _Col]) -> tuple[int, list[str]]:
    """Differences from ``shape``: (score = differing columns + attributes, lines)."""
    diffs: list[str] = []
    missing = sorted(set(shape) - set(live))
    extra = sorted(set(live) - set(shape))
    if missing:
        diffs.append(f"missing columns {missing}")
    if extra:
        diffs.append(f"unexpected columns {extra}")
    for col in sorted(set(shape) & set(live)):
        want = shape[col]
        got, pk = live[col]
        if got.type != want.type:
            diffs.append(f"{col}: type {got.type or '(none)'} instead of {want.type}")
        if col != "id" and got.notnull != want.notnull:
            diffs.append(
                f"{col}: {'NOT NULL' if got.notnull else 'nullable'} instead of "
                f"{'NOT NULL' if want.notnull else 'nullable'}"
            )
        if got.default != want.default:
            diffs.append(f"{col}: default {got.default} instead of {want.default}")
        if (pk > 0) != (col == "id"):
            diffs.append(f"{col}: {'part of' if pk else 'not'} the primary key")
    attribute_diffs = len(diffs) - bool(missing) - bool(extra)
    return len(missing) + len(extra) + attribute_diffs, diffs


def _has_index(conn: Connection) -> bool:
    return any(row[1] == _INDEX for row in conn.execute(text("PRAGMA index_list(runs)")))


def _index_problem(conn: Connection) -> str | None:
    if not _has_index(conn):
        return None
    cols = [row[2] for row in conn.execute(text(f"PRAGMA index_info({_INDEX})"))]
    if cols != _INDEX_COLUMNS:
        return f"index {_INDEX} is on {cols} instead of {_INDEX_COLUMNS}"
    return None
