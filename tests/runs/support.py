"""Shared fixtures-as-functions and raw reads of the run store tests (spec runs §2.4, §2.9, §4).

* :func:`mk`, :func:`mk_degradation`: the spec fixtures.
* :func:`run_rows`, :func:`run_row`, :func:`existing_run_row`: ``runs`` rows as
  stored, read with raw SQL in a read unit (every column, ``seq`` included).
"""

from __future__ import annotations

from typing import Any

from agentkeep.runs.domain import DegradationEntry, RunRecord
from agentkeep.store import Store
from tests.support import query

SLOT_A = "phase-a-op"
SLOT_B = "phase-b-op"
DIGEST = "sha256:" + "0123456789abcdef" * 4
MAX_I64 = 2**63 - 1


def mk(run_id: str, task_id: str = "T-1", created_at: int = 100, **kw: Any) -> RunRecord:
    """The spec fixture ``mk(id, task_id, created_at)`` (§2.9)."""
    return RunRecord.new(run_id, task_id, created_at, **kw)


def mk_degradation(tool: str, at: int) -> DegradationEntry:
    """The spec fixture ``mk_degradation(tool, at)`` (§2.4)."""
    return DegradationEntry(
        tool=tool,
        error="boom",
        fallback="cached-default",
        note=None,
        step_ref="worker",
        attempt=1,
        at=at,
    )


def run_rows(store: Store) -> list[dict[str, Any]]:
    """Every ``runs`` row as stored (raw SQL, every column), ordered by id."""
    return query(store, "SELECT * FROM runs ORDER BY id")


def run_row(store: Store, run_id: str) -> dict[str, Any] | None:
    """The ``runs`` row of ``run_id`` as stored (every column, ``seq`` included), or None."""
    rows = query(store, "SELECT * FROM runs WHERE id = :id", id=run_id)
    return rows[0] if rows else None


def existing_run_row(store: Store, run_id: str) -> dict[str, Any]:
    """The ``runs`` row of ``run_id`` as stored; the run must exist (AssertionError if not)."""
    row = run_row(store, run_id)
    assert row is not None, f"no runs row {run_id!r}"
    return row
