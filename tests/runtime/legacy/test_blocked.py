"""Preflight verdicts (spec runtime §2.39, §5.2 items 12–14), on SQLite and Postgres.

Every Blocked detail is compared verbatim (decoder messages are computed
from the same decoder), and every blocked case also checks that an apply
refuses and writes nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from agentkeep.legacy.migrator import (
    LegacyMigrationBlocked,
    LegacyV0634MigrationItem,
    migrate_v0_6_34_completed_idle,
)
from agentkeep.runtime.domain import OpsSnapshot
from agentkeep.runtime.errors import ReadFailed

from . import _legacy_db as F
from ._legacy_db import DOMAIN, D, LegacyDb

RT = F.RUNTIME_ID
OTHER_SESSION = "018f0000-0000-7000-8000-0000000000ff"
OTHER_ID = "018f0000-0000-7000-8000-0000000000ee"
INPUT_PREFIX = f"input {F.INPUT_ID}: "


def _set(db: LegacyDb, table: str, column: str, value: bytes) -> None:
    assert db.execute(f"UPDATE {table} SET {column} = ? WHERE runtime_id = ?", (value, RT)) == 1


def _set_input(value: dict[str, Any] | bytes) -> Callable[[LegacyDb], None]:
    data = value if isinstance(value, bytes) else F.compact(value)
    return lambda db: _set(db, "runtime_input_states", "state_json", data)


def _set_input_row(input_id: str, value: dict[str, Any]) -> Callable[[LegacyDb], None]:
    def setup(db: LegacyDb) -> None:
        sql = "UPDATE runtime_input_states SET state_json = ? WHERE runtime_id = ? AND input_id = ?"
        assert db.execute(sql, (F.compact(value), RT, input_id)) == 1

    return setup


def _set_ops(value: dict[str, Any] | bytes) -> Callable[[LegacyDb], None]:
    data = value if isinstance(value, bytes) else F.compact(value)
    return lambda db: _set(db, "runtime_ops_lifecycle", "state_json", data)


def _set_lifecycle(value: bytes) -> Callable[[LegacyDb], None]:
    return lambda db: _set(db, "runtime_states", "runtime_state_json", value)


def _replace_receipt(run_id: str, sequence: int, payload: dict[str, Any]) -> Callable[..., None]:
    def setup(db: LegacyDb) -> None:
        db.execute("DELETE FROM runtime_boundary_receipts WHERE runtime_id = ?", (RT,))
        db.execute(
            "INSERT INTO runtime_boundary_receipts (runtime_id, run_id, sequence, receipt_json) "
            "VALUES (?, ?, ?, ?)",
            (RT, run_id, sequence, F.compact(payload)),
        )

    return setup


def _decoder_message(decode: Callable[[bytes], object], data: bytes) -> str:
    with pytest.raises(ReadFailed) as info:
        decode(data)
    return str(info.value.message)


BAD_SESSION = F.compact({"id": F.SESSION_ID, "messages": []})  # no envelope version
NOT_EXACT = 'not the exact v0.6.34 bare "idle" record'
LIVE_OPS = "ops snapshot contains live or completed operation authority"
NONDEFAULT = "ops snapshot contains nondefault capacity policy"
UNVERSIONED = F.compact({"runtime_state": "idle", "binding": None})


def _not_terminal(state: str, outcome: Any, observed: str) -> tuple[Any, ...]:
    value = F.input_state(state=state, outcome=outcome)
    if outcome is None:
        value["terminal_outcome"] = None
    return (
        f"input-{state}-{observed}",
        _set_input(value),
        INPUT_PREFIX
        + f"only terminal phase/outcome pairs are safe to migrate (observed {observed})",
    )


BLOCKED_CASES: list[tuple[Any, ...]] = [
    ("lifecycle-running", _set_lifecycle(b'"running"'), NOT_EXACT),
    ("lifecycle-leading-space", _set_lifecycle(b' "idle"'), NOT_EXACT),
    ("lifecycle-trailing-newline", _set_lifecycle(b'"idle"\n'), NOT_EXACT),
    ("lifecycle-retired", _set_lifecycle(b'"retired"'), NOT_EXACT),
    ("lifecycle-unversioned-object", _set_lifecycle(UNVERSIONED), NOT_EXACT),
    (
        "session-owned-by-another-runtime",
        lambda db: _set(
            db, "runtime_session_snapshots", "session_snapshot", F.session_snapshot(OTHER_SESSION)
        ),
        f"session {OTHER_SESSION} belongs to runtime rt:session:{OTHER_SESSION}, not {RT}",
    ),
    (
        "session-undecodable",
        lambda db: _set(db, "runtime_session_snapshots", "session_snapshot", BAD_SESSION),
        _decoder_message(DOMAIN.decode_persisted_session, BAD_SESSION),
    ),
    (
        "receipt-run-id-mismatch",
        _replace_receipt(F.RUN_ID, 1, F.receipt(run_id=OTHER_ID)),
        f"receipt payload identity {OTHER_ID}:1 does not match row {F.RUN_ID}:1",
    ),
    (
        "receipt-sequence-mismatch",
        _replace_receipt(F.RUN_ID, 1, F.receipt(sequence=2)),
        f"receipt payload identity {F.RUN_ID}:2 does not match row {F.RUN_ID}:1",
    ),
    (
        "receipt-sequence-2pow63",
        _replace_receipt(F.RUN_ID, -(2**63), F.receipt(sequence=2**63)),
        "receipt sequence 9223372036854775808 is out of range",
    ),
    (
        "receipt-sequence-u64-max",
        _replace_receipt(F.RUN_ID, -1, F.receipt(sequence=2**64 - 1)),
        "receipt sequence 18446744073709551615 is out of range",
    ),
    (
        "input-payload-id-mismatch",
        _set_input(F.input_state(OTHER_ID)),
        INPUT_PREFIX + "payload id does not match row key",
    ),
    _not_terminal("accepted", None, "Accepted"),
    _not_terminal("queued", None, "Queued"),
    _not_terminal("applied_pending_consumption", None, "AppliedPendingConsumption"),
    _not_terminal("consumed", None, "Consumed"),
    _not_terminal(
        "consumed", {"outcome_type": "superseded", "superseded_by": OTHER_ID}, "Consumed"
    ),
    _not_terminal("abandoned", {"outcome_type": "consumed"}, "Abandoned"),
    (
        "input-mixed-current",
        _set_input(DOMAIN.encode_input_state(F.current_input_state())),
        INPUT_PREFIX
        + "mixed current-format companion under a bare v0.6.34 lifecycle is unsupported",
    ),
    (
        "ops-mixed-current",
        _set_ops(DOMAIN.encode_ops(OpsSnapshot(epoch_id="epoch-current", payload={}))),
        "mixed current-format ops authority under a bare v0.6.34 lifecycle is unsupported",
    ),
    ("ops-active-count", _set_ops(F.ops(active_count=1)), LIVE_OPS),
    ("ops-agent-cursor", _set_ops(F.ops(agent_applied_cursor=3)), LIVE_OPS),
    ("ops-observed-cursor", _set_ops(F.ops(runtime_observed_seq=1)), LIVE_OPS),
    ("ops-injected-cursor", _set_ops(F.ops(runtime_last_injected_seq=1)), LIVE_OPS),
    ("ops-operation", _set_ops(F.ops(operations={"op-1": {}})), LIVE_OPS),
    ("ops-spec", _set_ops(F.ops(operation_specs={"op-1": {}})), LIVE_OPS),
    ("ops-completed-order", _set_ops(F.ops(completed_order=["op-1"])), LIVE_OPS),
    ("ops-completion-entry", _set_ops(F.ops(completion_entries=[{}])), LIVE_OPS),
    ("ops-wait-request", _set_ops(F.ops(wait_request_id="w-1")), LIVE_OPS),
    ("ops-wait-ids", _set_ops(F.ops(wait_operation_ids=["op-1"])), LIVE_OPS),
    ("ops-next-completion", _set_ops(F.ops(next_completion_seq=1)), LIVE_OPS),
    ("ops-max-concurrent", _set_ops(F.ops(max_concurrent=4)), NONDEFAULT),
    ("ops-max-completed", _set_ops(F.ops(max_completed=100)), NONDEFAULT),
    # live authority is reported before a nondefault capacity
    ("ops-live-and-nondefault", _set_ops(F.ops(active_count=1, max_concurrent=4)), LIVE_OPS),
]

#: (case id, setup, detail prefix, words the detail must contain) for decoder messages.
DECODER_CASES: list[tuple[Any, ...]] = [
    (
        "input-unknown-field",
        _set_input(F.input_state(unexpected_field=1)),
        INPUT_PREFIX + "not a v0.6.34 input-state row: ",
        ["unexpected_field"],
    ),
    (
        "input-unknown-history-field",
        _set_input(
            F.input_state(
                history=[{"timestamp": "2024-05-01T10:00:00Z", "from": "a", "to": "b", "x": 1}]
            )
        ),
        INPUT_PREFIX + "not a v0.6.34 input-state row: ",
        ["history"],
    ),
    (
        "input-missing-created-at",
        _set_input({k: v for k, v in F.input_state().items() if k != "created_at"}),
        INPUT_PREFIX + "not a v0.6.34 input-state row: ",
        ["created_at"],
    ),
    (
        "input-bad-timestamp",
        _set_input(F.input_state(updated_at="yesterday")),
        INPUT_PREFIX + "not a v0.6.34 input-state row: ",
        ["updated_at", "RFC 3339"],
    ),
    (
        "input-duplicate-key",
        _set_input(F.INPUT_STATE_CONSUMED[:-1] + b',"attempt_count":1}'),
        INPUT_PREFIX + "not a v0.6.34 input-state row: ",
        ["duplicate field `attempt_count`"],
    ),
    (
        "input-bare-string",
        _set_input(b'"consumed"'),
        INPUT_PREFIX + "not a v0.6.34 input-state row: ",
        ["JSON object"],
    ),
    (
        "input-unknown-state",
        _set_input(F.input_state(state="finished")),
        INPUT_PREFIX + "not a v0.6.34 input-state row: ",
        ["current_state"],
    ),
    (
        "input-bool-attempt-count",
        _set_input(F.input_state(attempt_count=True)),
        INPUT_PREFIX + "not a v0.6.34 input-state row: ",
        ["attempt_count"],
    ),
    (
        "ops-unknown-field",
        _set_ops(F.ops(extra_top_level=[])),
        "not a v0.6.34 ops snapshot: ",
        ["extra_top_level"],
    ),
    (
        "ops-missing-cursors",
        _set_ops({k: v for k, v in F.ops().items() if k != "cursors"}),
        "not a v0.6.34 ops snapshot: ",
        ["cursors"],
    ),
    (
        "receipt-undecodable",
        _replace_receipt(F.RUN_ID, 1, {"run_id": F.RUN_ID, "sequence": 1}),
        "invalid run boundary receipt: ",
        ["boundary", "message_count"],
    ),
]


def _assert_apply_refused(db: LegacyDb, blocked: list[str]) -> None:
    before = db.snapshot()
    with pytest.raises(LegacyMigrationBlocked) as info:
        migrate_v0_6_34_completed_idle(db.target, apply=True)
    assert isinstance(info.value, ReadFailed)
    assert info.value.message == f"legacy migration blocked for runtime(s): {', '.join(blocked)}"
    assert list(info.value.runtime_ids) == blocked
    assert db.snapshot() == before
    assert F.AUDIT not in db.tables()


@pytest.mark.parametrize(
    ("setup", "detail"), [pytest.param(s, d, id=i) for i, s, d in BLOCKED_CASES]
)
def test_blocked_detail_is_exact_and_apply_writes_nothing(
    legacy_db: LegacyDb, setup: Callable[[LegacyDb], None], detail: str
) -> None:
    F.build_complete_v0_6_34(legacy_db)
    setup(legacy_db)
    report = migrate_v0_6_34_completed_idle(legacy_db.target)
    assert report.items == (LegacyV0634MigrationItem(RT, D.BLOCKED, detail),)
    assert report.blocked_count() == 1 and report.migration_count() == 0
    _assert_apply_refused(legacy_db, [RT])


@pytest.mark.parametrize(
    ("setup", "prefix", "words"), [pytest.param(s, p, w, id=i) for i, s, p, w in DECODER_CASES]
)
def test_blocked_decoder_detail(
    legacy_db: LegacyDb, setup: Callable[[LegacyDb], None], prefix: str, words: list[str]
) -> None:
    F.build_complete_v0_6_34(legacy_db)
    setup(legacy_db)
    (item,) = migrate_v0_6_34_completed_idle(legacy_db.target).items
    assert item.disposition is D.BLOCKED
    assert item.detail is not None and item.detail.startswith(prefix), item.detail
    for word in words:
        assert word in item.detail
    _assert_apply_refused(legacy_db, [RT])


def test_checks_run_in_spec_order(legacy_db: LegacyDb) -> None:
    """Session before receipts before inputs (by input id) before ops; the first failure wins."""
    F.build_complete_v0_6_34(legacy_db)
    db = legacy_db
    second_input = "018f0000-0000-7000-8000-000000000009"  # sorts after F.INPUT_ID
    db.execute(
        "INSERT INTO runtime_input_states (runtime_id, input_id, state_json) VALUES (?, ?, ?)",
        (RT, second_input, F.compact(F.input_state(second_input, state="queued"))),
    )
    _set_ops(F.ops(active_count=1))(db)
    _set_input_row(F.INPUT_ID, F.input_state(OTHER_ID))(db)
    _replace_receipt(F.RUN_ID, 1, F.receipt(sequence=2))(db)
    _set(db, "runtime_session_snapshots", "session_snapshot", F.session_snapshot(OTHER_SESSION))

    expected = [
        f"session {OTHER_SESSION} belongs to runtime rt:session:{OTHER_SESSION}, not {RT}",
        f"receipt payload identity {F.RUN_ID}:2 does not match row {F.RUN_ID}:1",
        INPUT_PREFIX + "payload id does not match row key",
        f"input {second_input}: only terminal phase/outcome pairs are safe to migrate "
        "(observed Queued)",
        LIVE_OPS,
    ]
    fixes: list[Callable[[LegacyDb], None]] = [
        lambda d: _set(d, "runtime_session_snapshots", "session_snapshot", F.session_snapshot()),
        _replace_receipt(F.RUN_ID, 1, F.receipt()),
        _set_input_row(F.INPUT_ID, F.input_state()),
        _set_input_row(second_input, F.input_state(second_input)),
        _set_ops(F.ops()),
    ]
    for detail, fix in zip(expected, fixes, strict=True):
        (item,) = migrate_v0_6_34_completed_idle(db.target).items
        assert item.detail == detail
        fix(db)
    (item,) = migrate_v0_6_34_completed_idle(db.target).items
    assert item == LegacyV0634MigrationItem(RT, D.WOULD_MIGRATE)


def test_current_lifecycle_is_current_whatever_its_companions(legacy_db: LegacyDb) -> None:
    F.build_complete_v0_6_34(legacy_db)
    current = F.current_lifecycle()
    _set_lifecycle(current)(legacy_db)
    _set_ops(F.ops(active_count=7))(legacy_db)  # would block a legacy runtime
    before = legacy_db.snapshot()
    for apply in (False, True):
        report = migrate_v0_6_34_completed_idle(legacy_db.target, apply=apply)
        assert report.items == (LegacyV0634MigrationItem(RT, D.CURRENT),)
        assert report.migration_count() == 0 and report.applied is apply
    assert legacy_db.snapshot() == before
    assert F.AUDIT not in legacy_db.tables()  # nothing migrated: no audit table


@pytest.mark.parametrize(
    "outcome",
    [
        {"outcome_type": "superseded", "superseded_by": OTHER_ID},
        {"outcome_type": "coalesced", "aggregate_id": OTHER_ID},
        {"outcome_type": "abandoned", "reason": "retired"},
        {"outcome_type": "abandoned", "reason": "cancelled"},
    ],
    ids=["superseded", "coalesced", "abandoned-retired", "abandoned-cancelled"],
)
def test_every_terminal_pair_migrates(legacy_db: LegacyDb, outcome: dict[str, Any]) -> None:
    F.build_complete_v0_6_34(legacy_db)
    _set_input(F.input_state(state=outcome["outcome_type"], outcome=outcome))(legacy_db)
    report = migrate_v0_6_34_completed_idle(legacy_db.target, apply=True)
    assert report.items == (LegacyV0634MigrationItem(RT, D.MIGRATED),)
    stored = legacy_db.payload("runtime_input_states", "state_json", runtime_id=RT)
    assert stored is not None
    state = DOMAIN.decode_input_state(stored)
    assert (state.current_state, state.terminal_outcome) == (outcome["outcome_type"], outcome)


def test_all_or_nothing_one_migratable_one_blocked(legacy_db: LegacyDb) -> None:
    db = legacy_db
    F.build_complete_v0_6_34(db)  # A: migratable
    b = "rt:zz-blocked"
    F.insert_runtime(db, b, ops_record=F.compact(F.ops(active_count=1)))
    report = migrate_v0_6_34_completed_idle(db.target)
    assert report.items == (
        LegacyV0634MigrationItem(RT, D.WOULD_MIGRATE),
        LegacyV0634MigrationItem(b, D.BLOCKED, LIVE_OPS),
    )
    assert (report.migration_count(), report.blocked_count()) == (1, 1)
    with pytest.raises(LegacyMigrationBlocked) as info:
        migrate_v0_6_34_completed_idle(db.target, apply=True)
    assert str(info.value) == f"Store read failed: legacy migration blocked for runtime(s): {b}"
    assert info.value.report.items == report.items and not info.value.report.applied
    assert db.lifecycle(RT) == b'"idle"'
    assert db.payload("runtime_input_states", "state_json", runtime_id=RT) == (
        F.INPUT_STATE_CONSUMED
    )
    assert F.AUDIT not in db.tables()


def test_several_blocked_runtimes_are_listed_in_id_order(legacy_db: LegacyDb) -> None:
    db = legacy_db
    F.build_complete_v0_6_34(db)
    for rid in ("rt:c", "rt:a", "rt:b"):
        F.insert_runtime(db, rid, lifecycle=b'"stopped"', ops_record=None)
    _assert_apply_refused(db, ["rt:a", "rt:b", "rt:c"])
    report = migrate_v0_6_34_completed_idle(db.target)
    assert [i.runtime_id for i in report.items] == ["rt:a", "rt:b", "rt:c", RT]
    assert report.blocked_count() == 3


def test_only_runtime_states_table(legacy_db: LegacyDb) -> None:
    """A file lacking every companion table still migrates: just the lifecycle."""
    db = legacy_db
    F.create_schema(db, ["runtime_states"], sessions=False)
    F.insert_runtime(db, RT, snapshot=None, inputs=[], receipts=[], ops_record=None)
    assert migrate_v0_6_34_completed_idle(db.target).items == (
        LegacyV0634MigrationItem(RT, D.WOULD_MIGRATE),
    )
    report = migrate_v0_6_34_completed_idle(db.target, apply=True)
    assert report.items == (LegacyV0634MigrationItem(RT, D.MIGRATED),)
    assert db.tables() == {"runtime_states", F.AUDIT}
    assert db.query(f"SELECT runtime_id, table_name, row_key, action FROM {F.AUDIT}") == [
        (RT, "runtime_states", "singleton", "replace")
    ]
    lifecycle = db.lifecycle()
    assert lifecycle is not None and DOMAIN.decode_lifecycle(lifecycle).runtime_state == "idle"


@pytest.mark.parametrize(
    "missing", ["runtime_session_snapshots", "runtime_boundary_receipts", "runtime_ops_lifecycle"]
)
def test_one_companion_table_missing(legacy_db: LegacyDb, missing: str) -> None:
    db = legacy_db
    F.create_schema(db, [t for t in F.LEGACY_TABLES if t != missing])
    F.insert_runtime(
        db,
        snapshot=None if missing == "runtime_session_snapshots" else F.FIXTURE,
        receipts=[] if missing == "runtime_boundary_receipts" else F.FIXTURE,
        ops_record=None if missing == "runtime_ops_lifecycle" else F.OPS_LIFECYCLE_EMPTY,
    )
    report = migrate_v0_6_34_completed_idle(db.target, apply=True)
    assert report.items == (LegacyV0634MigrationItem(RT, D.MIGRATED),)
    assert missing not in db.tables()


def test_no_runtime_states_table_gives_an_empty_report(legacy_db: LegacyDb) -> None:
    db = legacy_db
    F.create_schema(db, ["runtime_input_states"])
    objects = db.schema_objects()
    for apply in (False, True):
        report = migrate_v0_6_34_completed_idle(db.target, apply=apply)
        assert report.items == () and report.applied is apply
    assert db.schema_objects() == objects
