"""The reference adapter's conversions and the report's forms (spec runtime §2.39, §3.12).

Pure unit tests, except the adapter-seam cases at the end, which run the
migrator with a custom adapter on both backends.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from agentkeep.legacy.adapter import DEFAULT_MAX_COMPLETED, LEGACY_IDLE_RECORD
from agentkeep.legacy.migrator import (
    LegacyBlocked,
    LegacyMigrationBlocked,
    LegacyV0634Adapter,
    LegacyV0634MigrationDisposition,
    LegacyV0634MigrationItem,
    LegacyV0634MigrationReport,
    ReferenceLegacyV0634Adapter,
    migrate_v0_6_34_completed_idle,
)
from agentkeep.legacy.report import render_table
from agentkeep.runtime.domain import ReferenceDomain, StoredInputState
from agentkeep.runtime.errors import ReadFailed, RuntimeInternalError, WriteFailed

from . import _legacy_db as F
from ._legacy_db import LegacyDb

D = LegacyV0634MigrationDisposition
A = ReferenceLegacyV0634Adapter()
DOMAIN = ReferenceDomain()
UPPER = "018F0000-0000-7000-8000-0000000000AB"


def _blocked(fn: Any, *args: Any) -> str:
    with pytest.raises(LegacyBlocked) as info:
        fn(*args)
    return info.value.detail


# --------------------------------------------------------------------------
# Lifecycle


def test_only_the_exact_six_bytes_are_legacy() -> None:
    assert LEGACY_IDLE_RECORD == b'"idle"' and len(LEGACY_IDLE_RECORD) == 6
    A.check_legacy_lifecycle(b'"idle"')
    for data in (b'"idle"\n', b' "idle"', b'"Idle"', b"idle", b'"idle" ', b'["idle"]', b""):
        assert _blocked(A.check_legacy_lifecycle, data) == (
            'not the exact v0.6.34 bare "idle" record'
        )


def test_migrated_lifecycle_is_a_current_idle_unbound_record() -> None:
    record = A.migrated_lifecycle(F.RUNTIME_ID)
    assert A.is_current_lifecycle(record)
    assert not A.is_current_lifecycle(LEGACY_IDLE_RECORD)
    assert json.loads(record) == {
        "record_version": 3,
        "runtime_state": "idle",
        "binding": {
            "agent_runtime_id": None,
            "fence_token": None,
            "runtime_generation": None,
            "runtime_epoch_id": None,
        },
        "supervisor_authority": {"kind": "unbound_no_receipt"},
        "unregister_progress": None,
    }


# --------------------------------------------------------------------------
# Inputs


def test_input_mapping_keeps_seeds_and_drops_exactly_what_the_spec_says() -> None:
    migrated = A.convert_input(F.INPUT_ID, F.INPUT_STATE_CONSUMED)
    state = DOMAIN.decode_input_state(migrated)
    assert migrated == DOMAIN.encode_input_state(state)  # canonical bytes
    legacy = F.input_state()
    assert state == StoredInputState(
        input_id=F.INPUT_ID,
        current_state="consumed",
        recovery_count=2,
        terminal_outcome={"outcome_type": "consumed"},
        details={
            "history": [
                {"timestamp": "2024-05-01T10:00:00Z", "from": "accepted", "to": "queued"},
                legacy["history"][1],
            ],
            "created_at": "2024-05-01T10:00:00Z",
            "updated_at": "2024-05-01T10:00:01.5Z",
            "durability": "durable",
            "idempotency_key": "idem-1",
            "last_run_id": F.RUN_ID,
            "last_boundary_sequence": 1,
            "attempt_count": 1,
            "admission_sequence": None,
            "recovery_lane": None,
        },
    )
    text = migrated.decode()
    for dropped in ("policy", "runtime_semantics", "reconstruction_source", "persisted_input"):
        assert dropped not in text


def test_minimal_legacy_input_gets_the_serde_defaults() -> None:
    minimal = {
        "input_id": F.INPUT_ID,
        "current_state": "abandoned",
        "terminal_outcome": {"outcome_type": "abandoned", "reason": "destroyed"},
        "created_at": "2024-05-01T10:00:00+02:00",
        "updated_at": "2024-05-01 10:00:00z",
    }
    state = DOMAIN.decode_input_state(A.convert_input(F.INPUT_ID, F.compact(minimal)))
    assert state.recovery_count == 0
    assert state.details == {
        "history": [],
        "created_at": "2024-05-01T10:00:00+02:00",
        "updated_at": "2024-05-01 10:00:00z",
        "durability": None,
        "idempotency_key": None,
        "last_run_id": None,
        "last_boundary_sequence": None,
        "attempt_count": 0,
        "admission_sequence": None,
        "recovery_lane": None,
    }


def test_uuids_are_compared_and_stored_canonically() -> None:
    row_key = UPPER.lower()
    outcome = {"outcome_type": "superseded", "superseded_by": UPPER}
    data = F.compact(F.input_state(UPPER, state="superseded", outcome=outcome))
    state = DOMAIN.decode_input_state(A.convert_input(row_key, data))
    assert state.input_id == row_key
    assert state.terminal_outcome == {"outcome_type": "superseded", "superseded_by": row_key}
    # the row key itself is compared as stored: an upper-case key never matches
    assert (
        _blocked(A.convert_input, UPPER, data)
        == f"input {UPPER}: payload id does not match row key"
    )


@pytest.mark.parametrize(
    "change",
    [
        {"attempt_count": 2**32},
        {"recovery_count": -1},
        {"last_boundary_sequence": 2**64},
        {"durability": "forever"},
        {"history": None},
        {"attempt_count": None},
        {"terminal_outcome": {"outcome_type": "consumed", "extra": 1}},
        {"terminal_outcome": {"outcome_type": "abandoned", "reason": "bored"}},
        {"created_at": "2024-05-01"},
        {"created_at": "2024-13-01T10:00:00Z"},
        {"last_run_id": "not-a-uuid"},
    ],
    ids=repr,
)
def test_out_of_shape_legacy_inputs_are_not_v0_6_34_rows(change: dict[str, Any]) -> None:
    data = F.compact(F.input_state(**change))
    detail = _blocked(A.convert_input, F.INPUT_ID, data)
    assert detail.startswith(f"input {F.INPUT_ID}: not a v0.6.34 input-state row: "), detail
    assert next(iter(change)) in detail


def test_non_utf8_input_is_not_a_v0_6_34_row() -> None:
    detail = _blocked(A.convert_input, F.INPUT_ID, b"\xff\xfe")
    assert detail.startswith(f"input {F.INPUT_ID}: not a v0.6.34 input-state row: not UTF-8 JSON")


def test_recovery_authority_refuses_non_terminal_states() -> None:
    with pytest.raises(ValueError, match="not a recoverable terminal"):
        A.recover_input_state(StoredInputState.new_accepted())
    mismatched = StoredInputState(
        input_id=F.INPUT_ID,
        current_state="consumed",
        terminal_outcome={"outcome_type": "coalesced"},
    )
    with pytest.raises(ValueError, match="not a recoverable terminal"):
        A.recover_input_state(mismatched)


def test_current_format_detection() -> None:
    assert A.is_current_input(DOMAIN.encode_input_state(StoredInputState.new_accepted()))
    assert not A.is_current_input(F.INPUT_STATE_CONSUMED)
    assert not A.is_current_ops(F.OPS_LIFECYCLE_EMPTY)


# --------------------------------------------------------------------------
# Ops, receipts, sessions


def test_zero_ops_at_default_capacity_passes() -> None:
    assert DEFAULT_MAX_COMPLETED == 256
    A.validate_zero_ops(F.OPS_LIFECYCLE_EMPTY)
    A.validate_zero_ops(F.compact(F.ops(epoch_id="any-epoch-text")))


def test_receipt_checks() -> None:
    A.check_receipt(F.RUN_ID, 1, F.BOUNDARY_RECEIPT)
    for boundary in ("RunStart", "run_checkpoint", "Immediate"):
        A.check_receipt(F.RUN_ID, 1, F.compact(F.receipt(boundary=boundary)))
    max_i64 = F.compact(F.receipt(sequence=2**63 - 1))
    A.check_receipt(F.RUN_ID, 2**63 - 1, max_i64)
    upper = F.compact(F.receipt(run_id=UPPER))
    assert _blocked(A.check_receipt, UPPER, 1, upper) == (
        f"receipt payload identity {UPPER.lower()}:1 does not match row {UPPER}:1"
    )
    detail = _blocked(A.check_receipt, F.RUN_ID, 1, F.compact(F.receipt(boundary="Later")))
    assert detail.startswith("invalid run boundary receipt: boundary")


def test_session_checks() -> None:
    A.check_session_snapshot(F.RUNTIME_ID, F.session_snapshot())
    assert _blocked(A.check_session_snapshot, "rt:other", F.session_snapshot()) == (
        f"session {F.SESSION_ID} belongs to runtime {F.RUNTIME_ID}, not rt:other"
    )


# --------------------------------------------------------------------------
# Report


def test_report_json_counts_and_table() -> None:
    report = LegacyV0634MigrationReport(
        applied=False,
        items=(
            LegacyV0634MigrationItem("rt:a", D.WOULD_MIGRATE),
            LegacyV0634MigrationItem("rt:b", D.CURRENT),
            LegacyV0634MigrationItem("rt:c", D.BLOCKED, "why"),
            LegacyV0634MigrationItem("rt:d", D.MIGRATED),
        ),
    )
    assert (report.migration_count(), report.blocked_count()) == (2, 1)
    expected = {
        "applied": False,
        "items": [
            {"runtime_id": "rt:a", "disposition": "would_migrate"},
            {"runtime_id": "rt:b", "disposition": "current"},
            {"runtime_id": "rt:c", "disposition": "blocked", "detail": "why"},
            {"runtime_id": "rt:d", "disposition": "migrated"},
        ],
    }
    assert report.to_json() == expected
    assert json.loads(report.to_json_text()) == expected
    assert render_table(report) == [
        "RUNTIME  DISPOSITION    DETAIL",
        "rt:a     would_migrate",
        "rt:b     current",
        "rt:c     blocked        why",
        "rt:d     migrated",
        "dry run: 1 would migrate, 1 current, 1 blocked",
    ]
    empty = LegacyV0634MigrationReport(applied=True)
    assert empty.to_json() == {"applied": True, "items": []}
    assert render_table(empty)[-1] == "applied: 0 migrated, 0 current (no runtime_states rows)"


def test_blocked_error_carries_the_report() -> None:
    report = LegacyV0634MigrationReport(
        applied=False,
        items=(
            LegacyV0634MigrationItem("rt:a", D.BLOCKED, "x"),
            LegacyV0634MigrationItem("rt:b", D.WOULD_MIGRATE),
            LegacyV0634MigrationItem("rt:c", D.BLOCKED, "y"),
        ),
    )
    error = LegacyMigrationBlocked(report)
    assert isinstance(error, ReadFailed)
    assert str(error) == "Store read failed: legacy migration blocked for runtime(s): rt:a, rt:c"
    assert error.runtime_ids == ("rt:a", "rt:c") and error.report is report


# --------------------------------------------------------------------------
# Adapter seam, through the migrator


class _FailingLifecycle(ReferenceLegacyV0634Adapter):
    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.error = error

    def migrated_lifecycle(self, runtime_id: str) -> bytes:
        raise self.error


@pytest.mark.parametrize("apply", [False, True])
def test_lifecycle_recovery_failure_is_internal_and_writes_nothing(
    legacy_db: LegacyDb, apply: bool
) -> None:
    F.build_complete_v0_6_34(legacy_db)
    before = legacy_db.snapshot()
    adapter: LegacyV0634Adapter = _FailingLifecycle(RuntimeError("machine refused"))
    with pytest.raises(RuntimeInternalError) as info:
        migrate_v0_6_34_completed_idle(legacy_db.target, apply=apply, adapter=adapter)
    assert str(info.value) == (
        "Internal error: v0.6.34 completed-idle lifecycle recovery failed for runtime "
        f"{F.RUNTIME_ID}: machine refused"
    )
    assert legacy_db.snapshot() == before


def test_lifecycle_encode_failure_propagates_unchanged(legacy_db: LegacyDb) -> None:
    F.build_complete_v0_6_34(legacy_db)
    before = legacy_db.snapshot()
    error = WriteFailed("failed to encode lifecycle")
    with pytest.raises(WriteFailed) as info:
        migrate_v0_6_34_completed_idle(
            legacy_db.target, apply=True, adapter=_FailingLifecycle(error)
        )
    assert info.value is error
    assert legacy_db.snapshot() == before


def test_a_custom_adapter_decides_what_is_legacy(legacy_db: LegacyDb) -> None:
    """The seam: an adapter that also accepts ``"stopped"`` as legacy-idle migrates it."""

    class StoppedToo(ReferenceLegacyV0634Adapter):
        def check_legacy_lifecycle(self, data: bytes) -> None:
            if data != b'"stopped"':
                super().check_legacy_lifecycle(data)

    F.build_complete_v0_6_34(legacy_db)
    F.insert_runtime(legacy_db, "rt:stopped", lifecycle=b'"stopped"', ops_record=None)
    assert migrate_v0_6_34_completed_idle(legacy_db.target).blocked_count() == 1
    report = migrate_v0_6_34_completed_idle(legacy_db.target, apply=True, adapter=StoppedToo())
    assert [i.disposition for i in report.items] == [D.MIGRATED, D.MIGRATED]
    assert legacy_db.audit_original("rt:stopped", "runtime_states", "singleton") == b'"stopped"'
