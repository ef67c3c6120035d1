"""agentkeep: durable state for agent runtimes.

SQLAlchemy 2.x models, one Alembic migration history and fenced repositories
on SQLite (default) and Postgres. Start with :meth:`Store.open`; see README.md.
"""

from __future__ import annotations

from agentkeep.clock import Clock, SettableClock, SystemClock
from agentkeep.db import create_engine
from agentkeep.errors import (
    AgentkeepError,
    AssigneeDescRequired,
    AssigneeGenerationAhead,
    AssigneeSlotRequired,
    ConcurrentModification,
    CorruptData,
    DatabaseError,
    Duplicate,
    GenerationOverflow,
    IdParseError,
    InvalidInput,
    LegacySchemaMismatch,
    NotFound,
    ReadOnlyUnitOfWork,
    RunCorrupt,
    RunDuplicate,
    RunNotFound,
    RunStoreError,
    SchemaBehind,
    SchemaError,
    SchemaNewer,
    StoreBusy,
)
from agentkeep.migrations import upgrade as migrate
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
    Usage,
    VacateOutcome,
)
from agentkeep.store import Store
from agentkeep.unit_of_work import UnitOfWork

__all__ = [
    "UNSET",
    "AgentkeepError",
    "Assignee",
    "AssigneeDescRequired",
    "AssigneeGenerationAhead",
    "AssigneeSlotRequired",
    "Clock",
    "ConcurrentModification",
    "CorruptData",
    "DatabaseError",
    "DegradationEntry",
    "Duplicate",
    "GenerationOverflow",
    "IdParseError",
    "InvalidInput",
    "LegacySchemaMismatch",
    "NotFound",
    "ReadOnlyUnitOfWork",
    "Released",
    "RunCorrupt",
    "RunDuplicate",
    "RunId",
    "RunListFilter",
    "RunNotFound",
    "RunRecord",
    "RunStatus",
    "RunStoreError",
    "SchemaBehind",
    "SchemaError",
    "SchemaNewer",
    "SettableClock",
    "Stale",
    "StepEntry",
    "StepId",
    "Store",
    "StoreBusy",
    "SystemClock",
    "TaskId",
    "UnitOfWork",
    "Usage",
    "VacateOutcome",
    "create_engine",
    "migrate",
]
