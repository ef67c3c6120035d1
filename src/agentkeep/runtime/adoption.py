"""Adoption of un-versioned runtime-store tables written by the original store.

The Rust runtime store created its eleven tables with ``CREATE TABLE IF NOT
EXISTS`` on every connection
(docs/runtime.md#adopting-un-versioned-runtime-tables), so an old file holds
some or all of them, in exactly that shape, and no version table.
:func:`detect_runtime_revision` checks every present runtime table against that
shape (column set, declared types, NOT NULL, primary key, the outbox's CHECK),
creates the missing ones, and returns ``runtime_0001`` for
:mod:`agentkeep.migrations` to stamp, in the same transaction. Rows are kept as
they are: legacy *contents* (a bare ``"idle"`` lifecycle) stay fail-closed
on read and belong to the explicit legacy migrator.

Anything else raises :class:`~agentkeep.errors.LegacySchemaMismatch` before a
single statement writes. Adoption is SQLite-only: no Postgres database
predates agentkeep, so un-versioned runtime tables on Postgres are refused.
Foreign tables in the same file (the session store's ``sessions``, the
migrator's audit table) are not ours and are left alone.
"""

from __future__ import annotations

from typing import Final, NamedTuple

from sqlalchemy import Connection, inspect, text
from sqlalchemy.schema import CreateTable

from agentkeep.errors import LegacySchemaMismatch

__all__ = ["SHAPE", "detect_runtime_revision"]


class _Col(NamedTuple):
    type: str
    notnull: bool
    pk: int  # position in the primary key (1-based), 0 if not part of it


_T, _B = "TEXT", "BLOB"

#: Table -> column -> (declared type, NOT NULL, primary-key position), as the
#: original store's DDL declares them.
#: ``NOT NULL`` is not compared on primary-key columns: ``x TEXT PRIMARY KEY``
#: is nullable in SQLite, our baseline declares it NOT NULL; both hold the same rows.
SHAPE: Final[dict[str, dict[str, _Col]]] = {
    "runtime_input_states": {
        "runtime_id": _Col(_T, True, 1),
        "input_id": _Col(_T, True, 2),
        "state_json": _Col(_B, True, 0),
    },
    "runtime_boundary_receipts": {
        "runtime_id": _Col(_T, True, 1),
        "run_id": _Col(_T, True, 2),
        "sequence": _Col("INTEGER", True, 3),
        "receipt_json": _Col(_B, True, 0),
    },
    "runtime_session_snapshots": {
        "runtime_id": _Col(_T, False, 1),
        "session_snapshot": _Col(_B, True, 0),
    },
    "runtime_states": {"runtime_id": _Col(_T, False, 1), "runtime_state_json": _Col(_B, True, 0)},
    "runtime_ops_lifecycle": {"runtime_id": _Col(_T, False, 1), "state_json": _Col(_B, True, 0)},
    "runtime_retired_ops_epochs": {
        "runtime_id": _Col(_T, True, 1),
        "epoch_id": _Col(_T, True, 2),
    },
    "runtime_auth_oauth_flow_state": {"id": _Col(_T, False, 1), "state_json": _Col(_B, True, 0)},
    "runtime_projection_quarantine": {"runtime_id": _Col(_T, False, 1)},
    "runtime_compaction_projection_outbox": {
        "runtime_id": _Col(_T, True, 1),
        "session_id": _Col(_T, True, 2),
        "parent_revision": _Col(_T, True, 3),
        "revision": _Col(_T, True, 4),
        "commit_fingerprint": _Col(_T, True, 5),
        "intent_json": _Col(_B, True, 0),
        "state": _Col(_T, True, 0),
    },
    "runtime_mob_host_bindings": {"mob_id": _Col(_T, False, 1), "record_json": _Col(_B, True, 0)},
    "runtime_mob_host_revocations": {
        "mob_id": _Col(_T, False, 1),
        "receipt_json": _Col(_B, True, 0),
    },
}

_OUTBOX: Final = "runtime_compaction_projection_outbox"


def detect_runtime_revision(conn: Connection) -> str | None:
    """Return ``runtime_0001`` for adoptable un-versioned runtime tables, else None.

    Args:
        conn: the migration connection, inside its write transaction.

    Returns:
        ``None`` when no runtime table exists (a fresh database for this
        branch); ``"runtime_0001"`` after creating the tables an older file
        lacks, when every present table has the original store's shape.

    Raises:
        LegacySchemaMismatch: a present table differs from that shape, or
            un-versioned runtime tables sit in a Postgres database.
    """
    present = [name for name in SHAPE if inspect(conn).has_table(name)]
    if not present:
        return None
    if conn.dialect.name != "sqlite":
        raise LegacySchemaMismatch(
            present[0],
            "none",
            [
                f"an un-versioned Postgres database already has runtime tables {present}; "
                "no Postgres database predates agentkeep, so they are not adopted"
            ],
        )
    for name in present:
        diffs = _differences(conn, name)
        if diffs:
            raise LegacySchemaMismatch(name, "runtime_0001", diffs)
    missing = [name for name in SHAPE if name not in present]
    if missing:
        from agentkeep.base import Base
        from agentkeep.runtime import models as _models  # noqa: F401 - registers the tables

        # The runtime_0001 shape: the table alone. Indexes of later revisions
        # come from those revisions when the branch upgrades after the stamp.
        for name in missing:
            conn.execute(CreateTable(Base.metadata.tables[name]))
    return "runtime_0001"


def _differences(conn: Connection, table: str) -> list[str]:
    kind = conn.execute(
        text("SELECT type, sql FROM sqlite_master WHERE name = :n"), {"n": table}
    ).one()
    if kind[0] != "table":
        return [f"{table} is a {kind[0]}, not a table"]
    want = SHAPE[table]
    live = {
        str(row[1]): _Col(str(row[2]).upper(), bool(row[3]), int(row[5]))
        for row in conn.execute(text(f'PRAGMA table_info("{table}")'))
    }
    diffs: list[str] = []
    missing = sorted(set(want) - set(live))
    extra = sorted(set(live) - set(want))
    if missing:
        diffs.append(f"missing columns {missing}")
    if extra:
        diffs.append(f"unexpected columns {extra}")
    for col in sorted(set(want) & set(live)):
        w, g = want[col], live[col]
        if g.type != w.type:
            diffs.append(f"{col}: type {g.type or '(none)'} instead of {w.type}")
        if w.pk == 0 and g.notnull != w.notnull:
            diffs.append(f"{col}: {'NOT NULL' if g.notnull else 'nullable'} instead of NOT NULL")
        if g.pk != w.pk:
            diffs.append(f"{col}: primary-key position {g.pk} instead of {w.pk}")
    if table == _OUTBOX:
        sql = " ".join(str(kind[1] or "").split()).lower()
        if "check (state in ('pending','finalized'))" not in sql.replace(", ", ","):
            diffs.append("state: missing CHECK (state IN ('pending','finalized'))")
    return diffs
