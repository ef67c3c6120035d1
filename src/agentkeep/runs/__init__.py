"""The run store: status compare-and-set, step and degradation logs, assignment slots.

Described in docs/runs.md#the-run-store. Tables in :mod:`.models`, values in
:mod:`.domain`, JSON encoding in :mod:`.codec`, operations in
:mod:`.repository` (one-call forms in :mod:`.facade`), legacy adoption in
:mod:`.adoption`.

The run store's errors (:class:`~agentkeep.errors.RunNotFound`, ...) live in
:mod:`agentkeep.errors` with every other error, and are re-exported here.
"""

from __future__ import annotations

from agentkeep.errors import (
    AssigneeDescRequired,
    AssigneeGenerationAhead,
    AssigneeSlotRequired,
    GenerationOverflow,
    RunCorrupt,
    RunDuplicate,
    RunNotFound,
    RunStoreError,
)
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
    "DegradationEntry",
    "GenerationOverflow",
    "Released",
    "RunId",
    "RunCorrupt",
    "RunDuplicate",
    "RunListFilter",
    "RunNotFound",
    "RunRecord",
    "RunStatus",
    "RunStoreError",
    "Stale",
    "StepEntry",
    "StepId",
    "TaskId",
    "VacateOutcome",
]
