"""Un-versioned session-store tables are refused, never guessed at.

The original Rust session store kept one session per file in tables of a
different shape (a singleton head, no ``session_id`` on most tables), so there
is no historical shape to stamp: a database that holds our session tables
without a version row is refused with
:class:`~agentkeep.errors.LegacySchemaMismatch`, and nothing is written
(docs/sessions.md#un-versioned-session-tables,
docs/decisions.md#unknown-legacy-shapes-are-refused).
"""

from __future__ import annotations

from typing import Final

from sqlalchemy import Connection, inspect

from agentkeep.errors import LegacySchemaMismatch

__all__ = ["detect_sessions_revision"]

_TABLES: Final = (
    "session_execution_leases",
    "queued_work_batches",
    "queued_work_items",
    "pending_turn_inputs",
    "session_head",
    "graph_nodes",
    "usage_deltas",
    "runtime_turn_commits",
    "attachment_manifest",
    "blobs",
    "artifact_refs",
    "session_meta",
    "session_usage_totals",
)


def detect_sessions_revision(conn: Connection) -> str | None:
    """Return None (create the tables) unless some already exist un-versioned.

    Raises:
        LegacySchemaMismatch: session-store tables exist without a version row.
    """
    present = [t for t in _TABLES if inspect(conn).has_table(t)]
    if present:
        raise LegacySchemaMismatch(
            present[0],
            "none",
            [f"un-versioned session-store tables {present}: no known shape to adopt"],
        )
    return None
