"""Shared fixtures-as-functions of the run store tests (spec runs §2.4, §2.9, §4)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import text

from agentkeep.runs.domain import DegradationEntry, RunRecord
from agentkeep.store import Store

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


def raw_rows(store: Store) -> list[dict[str, Any]]:
    """Every ``runs`` row as stored (raw SQL), ordered by id."""
    with store.read() as uow:
        rows = uow.connection.execute(text("SELECT * FROM runs ORDER BY id")).mappings().all()
    return [dict(r) for r in rows]
