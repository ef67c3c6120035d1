"""Explicit migrator of v0.6.34 completed-idle runtime rows.

Described in docs/legacy-migration.md#the-v0634-legacy-migrator.

Ordinary runtime-store reads are fail-closed: a bare legacy lifecycle
(``"idle"``) and legacy input rows raise ReadFailed. This module is the one
place that converts them, on request, for a database that every process has
stopped using (an apply is one atomic transaction, but it cannot stop an old
process from writing legacy rows after it commits)::

    report = migrate_v0_6_34_completed_idle("sessions.sqlite3")             # dry run
    report = migrate_v0_6_34_completed_idle("sessions.sqlite3", apply=True)  # migrate

The CLI is ``agentkeep migrate-legacy runtime [URL] [--apply] [--json]``.

**Dry run** (``apply=False``): opens read-only, never creates or changes
anything (no table, no file: a missing file is ReadFailed), fails fast on a
lock, and reports one item per ``runtime_states`` row: ``current`` (already a
current record), ``would_migrate`` or ``blocked`` (with the exact detail).

**Apply**: takes the exclusive lock without waiting (WriteFailed when another
connection is in the way), runs the same preflight inside that transaction,
refuses with :class:`~agentkeep.legacy.report.LegacyMigrationBlocked` (a
ReadFailed, ``legacy migration blocked for runtime(s): A, B``) when any runtime
is blocked, else creates the append-only audit table
``runtime_legacy_v0_6_34_audit`` (docs/legacy-migration.md#the-audit-table;
plpgsql triggers on Postgres, which also block TRUNCATE) and, per runtime in id
order: audits and replaces the lifecycle record, audits and replaces each input
(by input id), audits and deletes a zero ops record; then commits. WouldMigrate
items become Migrated. Applying again reports those runtimes ``current``.
Session snapshots, receipts, the ``sessions`` table and everything else are
never written. Locks, fences and error variants are described in
:mod:`agentkeep.legacy.connections`.

**Preflight** (docs/legacy-migration.md#preflight,
docs/legacy-migration.md#companion-checks), per runtime (first matching rule
wins): a current lifecycle is Current; anything but the exact bytes ``"idle"``
is Blocked; then the companions, in this order, each only if its table (and
row) exists: the session snapshot (decodes, owned by this runtime), the
receipts by (run_id, sequence) (decode, sequence fits i64, payload identity
equals the row), the inputs by input id (not current-format; the strict legacy
shape; a terminal pair; payload id equals the row key; mapped, recovered,
encoded and re-decoded), the ops row (not current-format; the strict legacy
shape; zero; default capacity). The first failure is the Blocked detail.
Otherwise the migrated lifecycle record is computed (a failure there is
:class:`~agentkeep.errors.RuntimeInternalError` and aborts the call) and the
runtime WouldMigrate.

**Input mapping** (docs/legacy-migration.md#input-mapping). Our
:class:`~agentkeep.runtime.domain.StoredInputState` is smaller than upstream's,
so a legacy input maps as: ``input_id`` (canonical), ``current_state`` = legacy
``current_state``, ``terminal_outcome`` = legacy ``terminal_outcome``
(``{"outcome_type": ...}``), ``recovery_count`` kept; under ``details``:
``history``, ``created_at``, ``updated_at``, ``durability``,
``idempotency_key`` (kept), ``last_run_id``, ``last_boundary_sequence``,
``attempt_count`` (taken from the legacy row), ``admission_sequence`` and
``recovery_lane`` (null). Dropped (absent): ``policy``, ``runtime_semantics``,
``reconstruction_source``, ``persisted_input`` (and upstream's
``interaction_terminal_outbox``, which v0.6.34 did not have). The conversions
live behind :class:`~agentkeep.legacy.adapter.LegacyV0634Adapter`.

Choices where the original store was open
(docs/decisions.md#legacy-migrator-on-both-backends,
docs/decisions.md#legacy-migrator-details):

* Both backends. On Postgres the same tables (BYTEA payloads) are checked with
  ``to_regclass`` and never created; a missing database is ReadFailed.
* The dry run reads inside one read transaction (the original store runs
  autocommit SELECTs), so the report is one consistent snapshot.
* A database error while reading companion rows fails the call with ReadFailed
  (the original store turns it into a Blocked detail); a payload that is
  neither BLOB nor TEXT is ReadFailed too. TEXT payloads are read as their
  UTF-8 bytes.
* Each UPDATE/DELETE must touch exactly one row (it always does under the
  lock); otherwise WriteFailed and nothing is committed.
* ``progress`` is called per runtime: phase ``check`` in the preflight and
  phase ``migrate`` after each runtime's writes, before COMMIT.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any, Final

from sqlalchemy import bindparam as p
from sqlalchemy import delete, insert, select, update
from sqlalchemy.engine import Dialect

from agentkeep.legacy.adapter import (
    LegacyBlocked,
    LegacyV0634Adapter,
    ReferenceLegacyV0634Adapter,
)
from agentkeep.legacy.connections import (
    AUDIT,
    LegacyConnection,
    open_for_apply,
    open_for_dry_run,
    resolve_target,
)
from agentkeep.legacy.report import (
    LegacyMigrationBlocked,
    LegacyMigrationProgress,
    LegacyV0634MigrationDisposition,
    LegacyV0634MigrationItem,
    LegacyV0634MigrationReport,
    ProgressCallback,
)
from agentkeep.runtime.access import payload_bytes
from agentkeep.runtime.errors import (
    ReadFailed,
    RuntimeInternalError,
    RuntimeStoreError,
    WriteFailed,
)
from agentkeep.runtime.models import (
    BoundaryReceiptRow,
    InputStateRow,
    OpsLifecycleRow,
    RuntimeStateRow,
    SessionSnapshotRow,
)
from agentkeep.statements import Statement

__all__ = [
    "LegacyBlocked",
    "LegacyMigrationBlocked",
    "LegacyMigrationProgress",
    "LegacyV0634Adapter",
    "LegacyV0634MigrationDisposition",
    "LegacyV0634MigrationItem",
    "LegacyV0634MigrationReport",
    "ReferenceLegacyV0634Adapter",
    "migrate_v0_6_34_completed_idle",
]


def _byte_order(column: Any, dialect: Dialect) -> Any:
    """``column`` ordered by its bytes: ``COLLATE "C"`` on Postgres (SQLite's default)."""
    return column.collate("C") if dialect.name == "postgresql" else column


# The migrator's statements, built from the runtime store's models and compiled
# for the migrator's own connections (agentkeep.legacy.connections).
_RID: Any = p("rid")
_LIFECYCLES: Final = Statement(
    lambda d: select(RuntimeStateRow.runtime_id, RuntimeStateRow.runtime_state_json).order_by(
        _byte_order(RuntimeStateRow.runtime_id, d)
    ),
    name="legacy.lifecycles",
)
_SNAPSHOT: Final = Statement(
    select(SessionSnapshotRow.session_snapshot).where(SessionSnapshotRow.runtime_id == _RID),
    name="legacy.snapshot",
)
_RECEIPTS: Final = Statement(
    lambda d: (
        select(
            BoundaryReceiptRow.run_id, BoundaryReceiptRow.sequence, BoundaryReceiptRow.receipt_json
        )
        .where(BoundaryReceiptRow.runtime_id == _RID)
        .order_by(_byte_order(BoundaryReceiptRow.run_id, d), BoundaryReceiptRow.sequence)
    ),
    name="legacy.receipts",
)
_INPUTS: Final = Statement(
    lambda d: (
        select(InputStateRow.input_id, InputStateRow.state_json)
        .where(InputStateRow.runtime_id == _RID)
        .order_by(_byte_order(InputStateRow.input_id, d))
    ),
    name="legacy.inputs",
)
_OPS: Final = Statement(
    select(OpsLifecycleRow.state_json).where(OpsLifecycleRow.runtime_id == _RID),
    name="legacy.ops",
)
_AUDIT_INSERT: Final = Statement(
    insert(AUDIT).values(
        runtime_id=_RID,
        table_name=p("table"),
        row_key=p("key"),
        original_record=p("original"),
        migrated_record=p("migrated"),
        action=p("action"),
    ),
    name="legacy.audit_insert",
)
_SET_LIFECYCLE: Final = Statement(
    update(RuntimeStateRow)
    .values(runtime_state_json=p("data"))
    .where(RuntimeStateRow.runtime_id == _RID),
    name="legacy.set_lifecycle",
)
_SET_INPUT: Final = Statement(
    update(InputStateRow)
    .values(state_json=p("data"))
    .where(InputStateRow.runtime_id == _RID, InputStateRow.input_id == p("iid")),
    name="legacy.set_input",
)
_DELETE_OPS: Final = Statement(
    delete(OpsLifecycleRow).where(OpsLifecycleRow.runtime_id == _RID), name="legacy.delete_ops"
)

_D = LegacyV0634MigrationDisposition
_MISMATCH = "mixed current-format companion under a bare v0.6.34 lifecycle is unsupported"
_MIXED_OPS = "mixed current-format ops authority under a bare v0.6.34 lifecycle is unsupported"


@dataclass(frozen=True, slots=True)
class _PreparedInput:
    input_id: str
    original: bytes
    migrated: bytes


@dataclass(frozen=True, slots=True)
class _PreparedRuntime:
    runtime_id: str
    original_lifecycle: bytes
    migrated_lifecycle: bytes
    inputs: tuple[_PreparedInput, ...]
    zero_ops: bytes | None


@dataclass(frozen=True, slots=True)
class _Preflight:
    items: tuple[LegacyV0634MigrationItem, ...]
    runtimes: tuple[_PreparedRuntime, ...]


def migrate_v0_6_34_completed_idle(
    url_or_path: str | os.PathLike[str],
    apply: bool = False,
    *,
    adapter: LegacyV0634Adapter | None = None,
    progress: ProgressCallback | None = None,
) -> LegacyV0634MigrationReport:
    """Inspect (dry run) or atomically migrate v0.6.34 completed-idle runtimes.

    With ``apply=True`` every process that can use the database must be stopped.

    Args:
        url_or_path: a SQLite file path, ``sqlite:///path`` or a Postgres URL.
        apply: migrate (one transaction) instead of only reporting.
        adapter: the content decisions (default :class:`ReferenceLegacyV0634Adapter`).
        progress: called once per runtime and phase (see :class:`LegacyMigrationProgress`).

    Returns:
        The report: ``applied`` is False for a dry run, True after a commit.

    Raises:
        InvalidInput: an in-memory SQLite URL or an unsupported backend.
        ReadFailed: the database does not exist; a dry run cannot open it, or
            finds it locked; a SELECT fails; a lifecycle or companion value is
            neither BLOB nor TEXT. :class:`LegacyMigrationBlocked` (a
            ReadFailed): an apply found blocked runtimes and wrote nothing.
        WriteFailed: an apply cannot open the database read-write, cannot take
            the exclusive lock at once, or a DDL/DML/COMMIT statement fails
            (nothing is written).
        RuntimeInternalError: the completed-idle lifecycle recovery failed.
    """
    legacy_adapter: LegacyV0634Adapter = adapter or ReferenceLegacyV0634Adapter()
    target = resolve_target(url_or_path)
    if not apply:
        conn = open_for_dry_run(target)
        try:
            preflight = _preflight(conn, legacy_adapter, progress)
        finally:
            conn.close()
        return LegacyV0634MigrationReport(applied=False, items=preflight.items)

    conn = open_for_apply(target)
    try:
        preflight = _preflight(conn, legacy_adapter, progress)
        report = LegacyV0634MigrationReport(applied=False, items=preflight.items)
        if report.blocked_count():
            raise LegacyMigrationBlocked(report)
        if preflight.runtimes:
            conn.create_audit_table()
        total = len(preflight.runtimes)
        for index, runtime in enumerate(preflight.runtimes, start=1):
            _write_runtime(conn, runtime)
            if progress is not None:
                progress(LegacyMigrationProgress("migrate", index, total, runtime.runtime_id))
        conn.commit()
    finally:
        conn.close()  # rolls back unless committed
    items = tuple(
        replace(item, disposition=_D.MIGRATED) if item.disposition is _D.WOULD_MIGRATE else item
        for item in preflight.items
    )
    return LegacyV0634MigrationReport(applied=True, items=items)


# --------------------------------------------------------------------------
# Preflight


def _text(value: object, what: str) -> str:
    if not isinstance(value, str):
        raise ReadFailed(f"{what} is a {type(value).__name__}, not TEXT")
    return value


def _preflight(
    conn: LegacyConnection, adapter: LegacyV0634Adapter, progress: ProgressCallback | None
) -> _Preflight:
    if not conn.table_exists("runtime_states"):
        return _Preflight(items=(), runtimes=())
    raw = conn.select(_LIFECYCLES, {})
    rows = sorted(
        (
            _text(rid, "runtime_states.runtime_id"),
            payload_bytes(data, f"runtime_states.runtime_state_json of runtime {rid}"),
        )
        for rid, data in raw
    )
    tables = frozenset(
        t
        for t in (
            "runtime_session_snapshots",
            "runtime_boundary_receipts",
            "runtime_input_states",
            "runtime_ops_lifecycle",
        )
        if conn.table_exists(t)
    )
    items: list[LegacyV0634MigrationItem] = []
    runtimes: list[_PreparedRuntime] = []
    for index, (runtime_id, data) in enumerate(rows, start=1):
        item, prepared = _classify(conn, adapter, tables, runtime_id, data)
        items.append(item)
        if prepared is not None:
            runtimes.append(prepared)
        if progress is not None:
            progress(LegacyMigrationProgress("check", index, len(rows), runtime_id))
    return _Preflight(items=tuple(items), runtimes=tuple(runtimes))


def _classify(
    conn: LegacyConnection,
    adapter: LegacyV0634Adapter,
    tables: frozenset[str],
    runtime_id: str,
    data: bytes,
) -> tuple[LegacyV0634MigrationItem, _PreparedRuntime | None]:
    if adapter.is_current_lifecycle(data):
        return LegacyV0634MigrationItem(runtime_id, _D.CURRENT), None
    try:
        adapter.check_legacy_lifecycle(data)
        inputs, zero_ops = _companions(conn, adapter, tables, runtime_id)
    except LegacyBlocked as blocked:
        return LegacyV0634MigrationItem(runtime_id, _D.BLOCKED, blocked.detail), None
    try:
        migrated = adapter.migrated_lifecycle(runtime_id)
    except RuntimeStoreError:
        raise  # e.g. an encode failure: propagates as it is
    except Exception as exc:
        raise RuntimeInternalError(
            f"v0.6.34 completed-idle lifecycle recovery failed for runtime {runtime_id}: {exc}"
        ) from exc
    prepared = _PreparedRuntime(runtime_id, data, migrated, inputs, zero_ops)
    return LegacyV0634MigrationItem(runtime_id, _D.WOULD_MIGRATE), prepared


def _companions(
    conn: LegacyConnection, adapter: LegacyV0634Adapter, tables: frozenset[str], runtime_id: str
) -> tuple[tuple[_PreparedInput, ...], bytes | None]:
    """Check the companion rows in order; raise LegacyBlocked at the first failure.

    The order is that of docs/legacy-migration.md#companion-checks.
    """
    if "runtime_session_snapshots" in tables:
        rows = conn.select(_SNAPSHOT, {"rid": runtime_id})
        if rows:
            what = f"runtime_session_snapshots.session_snapshot of runtime {runtime_id}"
            adapter.check_session_snapshot(runtime_id, payload_bytes(rows[0][0], what))
    if "runtime_boundary_receipts" in tables:
        for run_id, sequence, receipt in conn.select(_RECEIPTS, {"rid": runtime_id}):
            run_text = _text(run_id, "runtime_boundary_receipts.run_id")
            if type(sequence) is not int:
                raise ReadFailed(f"receipt sequence of run {run_text} is not an INTEGER")
            what = f"runtime_boundary_receipts.receipt_json of run {run_text}"
            adapter.check_receipt(run_text, sequence, payload_bytes(receipt, what))
    inputs: list[_PreparedInput] = []
    if "runtime_input_states" in tables:
        for input_id, state in conn.select(_INPUTS, {"rid": runtime_id}):
            key = _text(input_id, "runtime_input_states.input_id")
            original = payload_bytes(state, f"runtime_input_states.state_json of input {key}")
            if adapter.is_current_input(original):
                raise LegacyBlocked(f"input {key}: {_MISMATCH}")
            inputs.append(_PreparedInput(key, original, adapter.convert_input(key, original)))
    zero_ops: bytes | None = None
    if "runtime_ops_lifecycle" in tables:
        rows = conn.select(_OPS, {"rid": runtime_id})
        if rows:
            ops = payload_bytes(
                rows[0][0], f"runtime_ops_lifecycle.state_json of runtime {runtime_id}"
            )
            if adapter.is_current_ops(ops):
                raise LegacyBlocked(_MIXED_OPS)
            adapter.validate_zero_ops(ops)
            zero_ops = ops
    return tuple(inputs), zero_ops


# --------------------------------------------------------------------------
# Apply


def _audit(
    conn: LegacyConnection,
    rid: str,
    table: str,
    key: str,
    original: bytes,
    migrated: bytes | None,
    action: str,
) -> None:
    conn.write(
        _AUDIT_INSERT,
        {
            "rid": rid,
            "table": table,
            "key": key,
            "original": original,
            "migrated": migrated,
            "action": action,
        },
    )


def _write_one(
    conn: LegacyConnection, stmt: Statement, params: dict[str, object], what: str
) -> None:
    count = conn.write(stmt, params)
    if count != 1:
        raise WriteFailed(f"{what} changed {count} rows under the migration lock, expected 1")


def _write_runtime(conn: LegacyConnection, runtime: _PreparedRuntime) -> None:
    rid = runtime.runtime_id
    _audit(
        conn,
        rid,
        "runtime_states",
        "singleton",
        runtime.original_lifecycle,
        runtime.migrated_lifecycle,
        "replace",
    )
    _write_one(
        conn,
        _SET_LIFECYCLE,
        {"rid": rid, "data": runtime.migrated_lifecycle},
        f"lifecycle of runtime {rid}",
    )
    for item in runtime.inputs:
        _audit(
            conn,
            rid,
            "runtime_input_states",
            item.input_id,
            item.original,
            item.migrated,
            "replace",
        )
        _write_one(
            conn,
            _SET_INPUT,
            {"rid": rid, "iid": item.input_id, "data": item.migrated},
            f"input {item.input_id} of runtime {rid}",
        )
    if runtime.zero_ops is not None:
        _audit(conn, rid, "runtime_ops_lifecycle", "singleton", runtime.zero_ops, None, "delete")
        _write_one(conn, _DELETE_OPS, {"rid": rid}, f"ops record of runtime {rid}")
