"""The report of the explicit v0.6.34 legacy migrator (docs/legacy-migration.md#the-report).

A report is ``{applied, items}``: one item per ``runtime_states`` row, sorted
by runtime id, each with a disposition (``would_migrate``, ``migrated``,
``current``, ``blocked``) and, for Blocked items only, the detail text that
says why. :meth:`LegacyV0634MigrationReport.to_json` gives the JSON form
(snake_case dispositions, ``detail`` omitted when absent) and
:func:`render_table` the human form the ``agentkeep migrate-legacy runtime``
command prints.

This module also holds the two values the migrator hands to its callers
besides the report: :class:`LegacyMigrationProgress` (one per runtime and
phase, for a progress callback) and :class:`LegacyMigrationBlocked`, the
refusal of an apply when any runtime is blocked.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal, TypeAlias

from agentkeep.errors import LegacyMigrationBlocked

__all__ = [
    "LegacyMigrationBlocked",
    "LegacyMigrationProgress",
    "LegacyV0634MigrationDisposition",
    "LegacyV0634MigrationItem",
    "LegacyV0634MigrationReport",
    "ProgressCallback",
    "render_table",
]


class LegacyV0634MigrationDisposition(StrEnum):
    """What the migrator did, or would do, with one runtime (serialised snake_case)."""

    #: Dry run: the runtime is the exact completed-idle v0.6.34 shape and would be migrated.
    WOULD_MIGRATE = "would_migrate"
    #: Apply: the runtime was migrated in this call's transaction.
    MIGRATED = "migrated"
    #: The lifecycle row already decodes as a current record; nothing to do.
    CURRENT = "current"
    #: The runtime cannot be migrated safely; ``detail`` says why.
    BLOCKED = "blocked"


@dataclass(frozen=True, slots=True)
class LegacyV0634MigrationItem:
    """One runtime of a report.

    Attributes:
        runtime_id: the logical runtime id (the ``runtime_states`` key).
        disposition: see :class:`LegacyV0634MigrationDisposition`.
        detail: why the runtime is blocked (Blocked items only), else None.
    """

    runtime_id: str
    disposition: LegacyV0634MigrationDisposition
    detail: str | None = None

    def to_json(self) -> dict[str, Any]:
        """Return ``{runtime_id, disposition[, detail]}``; ``detail`` only when present."""
        out: dict[str, Any] = {
            "runtime_id": self.runtime_id,
            "disposition": self.disposition.value,
        }
        if self.detail is not None:
            out["detail"] = self.detail
        return out


@dataclass(frozen=True, slots=True)
class LegacyV0634MigrationReport:
    """The result of one migrator call.

    Attributes:
        applied: True for an apply that committed, False for a dry run.
        items: one item per ``runtime_states`` row, sorted by runtime id.
    """

    applied: bool
    items: tuple[LegacyV0634MigrationItem, ...] = field(default_factory=tuple)

    def migration_count(self) -> int:
        """Count the WouldMigrate and Migrated items."""
        return sum(
            1
            for item in self.items
            if item.disposition
            in (
                LegacyV0634MigrationDisposition.WOULD_MIGRATE,
                LegacyV0634MigrationDisposition.MIGRATED,
            )
        )

    def blocked_count(self) -> int:
        """Count the Blocked items."""
        return sum(
            1 for item in self.items if item.disposition is LegacyV0634MigrationDisposition.BLOCKED
        )

    def blocked_runtime_ids(self) -> tuple[str, ...]:
        """Return the ids of the Blocked items, in report (runtime id) order."""
        return tuple(
            item.runtime_id
            for item in self.items
            if item.disposition is LegacyV0634MigrationDisposition.BLOCKED
        )

    def to_json(self) -> dict[str, Any]:
        """Return ``{"applied": bool, "items": [...]}`` (items as their ``to_json``)."""
        return {"applied": self.applied, "items": [item.to_json() for item in self.items]}

    def to_json_text(self, *, indent: int | None = 2) -> str:
        """Return :meth:`to_json` as JSON text (keys in the order above, UTF-8 kept)."""
        return json.dumps(self.to_json(), indent=indent, ensure_ascii=False)


ProgressPhase: TypeAlias = Literal["check", "migrate"]


@dataclass(frozen=True, slots=True)
class LegacyMigrationProgress:
    """One step of the migrator, reported to a progress callback.

    ``check`` steps come from the preflight (dry run and apply alike), one per
    ``runtime_states`` row once its disposition is known; ``migrate`` steps come
    from an apply, one per migrated runtime once its rows are written inside the
    still-open transaction (nothing is durable before the final COMMIT).

    Attributes:
        phase: ``"check"`` or ``"migrate"``.
        index: 1-based position of this runtime in the phase.
        total: number of runtimes in the phase.
        runtime_id: the runtime.
    """

    phase: ProgressPhase
    index: int
    total: int
    runtime_id: str


#: A progress callback. An exception it raises aborts the call; an apply rolls back.
ProgressCallback: TypeAlias = Callable[[LegacyMigrationProgress], None]


def render_table(report: LegacyV0634MigrationReport) -> list[str]:
    """Render a report as aligned text lines: a header, one row per item, a summary.

    Args:
        report: the report.

    Returns:
        The lines, without trailing newlines.
    """
    headers: Sequence[str] = ("RUNTIME", "DISPOSITION", "DETAIL")
    rows = [(i.runtime_id, i.disposition.value, i.detail or "") for i in report.items]
    width0 = max([len(headers[0])] + [len(r[0]) for r in rows])
    width1 = max([len(headers[1])] + [len(r[1]) for r in rows])

    def line(cells: Sequence[str]) -> str:
        return f"{cells[0]:<{width0}}  {cells[1]:<{width1}}  {cells[2]}".rstrip()

    lines = [line(headers)] + [line(r) for r in rows]
    counts = {d: 0 for d in LegacyV0634MigrationDisposition}
    for item in report.items:
        counts[item.disposition] += 1
    if report.applied:
        summary = (
            f"applied: {counts[LegacyV0634MigrationDisposition.MIGRATED]} migrated, "
            f"{counts[LegacyV0634MigrationDisposition.CURRENT]} current"
        )
    else:
        summary = (
            f"dry run: {counts[LegacyV0634MigrationDisposition.WOULD_MIGRATE]} would migrate, "
            f"{counts[LegacyV0634MigrationDisposition.CURRENT]} current, "
            f"{counts[LegacyV0634MigrationDisposition.BLOCKED]} blocked"
        )
    lines.append(summary if report.items else f"{summary} (no runtime_states rows)")
    return lines
