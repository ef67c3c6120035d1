"""The run store: status compare-and-set, step and degradation logs, assignment slots.

Spec: shared/spec/runs.md. Tables in :mod:`.models`, values in :mod:`.domain`,
JSON encoding in :mod:`.codec`, operations in :mod:`.repository` (one-call
forms in :mod:`.facade`), legacy adoption in :mod:`.adoption`.

The public error names of the spec (§2.10) are re-exported here:
``NotFound`` and ``Duplicate`` are the run store's subclasses.
"""

from __future__ import annotations

from agentkeep.errors import (
    AssigneeDescRequired,
    AssigneeGenerationAhead,
    AssigneeSlotRequired,
    RunStoreError,
)
from agentkeep.errors import RunCorrupt as Corrupt
from agentkeep.errors import RunDuplicate as Duplicate
from agentkeep.errors import RunNotFound as NotFound
from agentkeep.runs.domain import (
    UNSET,
    Assignee,
    DegradationEntry,
    Released,
    RunId,
    RunListFilter,
    RunRecord,
    RunStatus,
    Stale,
    StepEntry,
    StepId,
    TaskId,
    VacateOutcome,
)

__all__ = [
    "UNSET",
    "Assignee",
    "AssigneeDescRequired",
    "AssigneeGenerationAhead",
    "AssigneeSlotRequired",
    "Corrupt",
    "DegradationEntry",
    "Duplicate",
    "NotFound",
    "Released",
    "RunId",
    "RunListFilter",
    "RunRecord",
    "RunStatus",
    "RunStoreError",
    "Stale",
    "StepEntry",
    "StepId",
    "TaskId",
    "VacateOutcome",
]
