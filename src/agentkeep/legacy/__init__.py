"""The explicit migrator of runtime rows written by v0.6.34 (completed, idle runtimes).

Rows that the runtime store reads fail closed when they are in the v0.6.34
formats; this package converts them, on request, into the current formats:
``migrate_v0_6_34_completed_idle(url_or_path, apply=False)`` (dry run by
default) and the command ``agentkeep migrate-legacy runtime``. The entry point
is also importable from :mod:`agentkeep.runtime`.

Where things live:

* :mod:`.migrator` — the dry run and the all-or-nothing apply with its audit;
* :mod:`.connections` — its own connections, fail-fast locks and audit DDL;
* :mod:`.adapter` — the :class:`LegacyV0634Adapter` seam and the reference
  mapping of legacy rows;
* :mod:`.shapes` — the strict decoders of the v0.6.34 row formats;
* :mod:`.report` — the report, its items and dispositions, progress, rendering.

Behaviour, locks and every detail text: ``docs/legacy-migration.md``.
"""

from __future__ import annotations

from agentkeep.errors import LegacyMigrationBlocked
from agentkeep.legacy.adapter import LegacyV0634Adapter, ReferenceLegacyV0634Adapter
from agentkeep.legacy.migrator import migrate_v0_6_34_completed_idle
from agentkeep.legacy.report import (
    LegacyMigrationProgress,
    LegacyV0634MigrationDisposition,
    LegacyV0634MigrationItem,
    LegacyV0634MigrationReport,
)

__all__ = [
    "LegacyMigrationBlocked",
    "LegacyMigrationProgress",
    "LegacyV0634Adapter",
    "LegacyV0634MigrationDisposition",
    "LegacyV0634MigrationItem",
    "LegacyV0634MigrationReport",
    "ReferenceLegacyV0634Adapter",
    "migrate_v0_6_34_completed_idle",
]
