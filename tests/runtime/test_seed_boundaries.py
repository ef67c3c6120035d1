"""Boundary commits and receipts: seed tests 19, 20, 22, 23, 33, 34 (spec runtime §2.10–§2.16).

The receipt key ``(runtime_id, run_id, sequence)`` is the boundary's
idempotency fence; a boundary writes its snapshot, lifecycle (terminal form),
outbox rows, receipt and inputs all together or not at all — also when a
fault is injected mid-transaction (a trigger abort on each table in turn, in
a database of its own). The u64 sequence maps to the stored i64 one-to-one.
Every test runs on SQLite and Postgres and asserts the rows after a refusal.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import agentkeep
from agentkeep.errors import InvalidInput
from agentkeep.runtime import (
    ReadFailed,
    SessionKeyMismatch,
    SessionSnapshotSuperseded,
    StoredInputState,
    WriteFailed,
    decode_receipt_sequence,
    encode_receipt_sequence,
)
from agentkeep.runtime.receipts import MAX_U64
from agentkeep.store import Store

from .builders import (
    accepted_input,
    encode,
    idle_lifecycle,
    input_record,
    receipt,
    runtime_state,
    session_with_compaction_intent,
    table_counts,
    user_session,
)
from .support import NOTHING, RT, abort_trigger, raw_exec, raw_rows

# --------------------------------------------------------------------------
# The receipt fence (#19, #20)


def test_19_duplicate_receipt_rolls_back_the_whole_boundary(store: Store, db_url: str) -> None:
    a, b = accepted_input(), accepted_input()
    r = receipt(0)
    store.runtime.atomic_apply(RT, None, r, [input_record(a)])
    before = runtime_state(db_url, RT)
    s = user_session("new session")
    with pytest.raises(WriteFailed, match="runtime_boundary_receipts"):
        store.runtime.atomic_apply(RT, encode(s), r, [input_record(b)], s.id)
    assert store.runtime.load_session_snapshot(RT) is None
    assert store.runtime.load_input_states(RT) == [a]
    assert runtime_state(db_url, RT) == before


def test_19b_duplicate_receipt_leaves_no_outbox_row(store: Store, db_url: str) -> None:
    r = receipt(0)
    store.runtime.atomic_apply(RT, None, r)
    s, _ = session_with_compaction_intent()
    with pytest.raises(WriteFailed):
        store.runtime.atomic_apply(RT, encode(s), r, [input_record()], s.id)
    assert store.runtime.load_pending_compaction_projections(RT) == []
    assert table_counts(db_url, ["runtime_compaction_projection_outbox"]) == {
        "runtime_compaction_projection_outbox": 0
    }


def test_20_terminal_boundary_rolls_back_all_tables_on_receipt_conflict(
    store: Store, db_url: str
) -> None:
    a = accepted_input()
    r = receipt(0)
    store.runtime.atomic_apply(RT, None, r, [input_record(a)])
    before = runtime_state(db_url, RT)
    s, _ = session_with_compaction_intent()
    with pytest.raises(WriteFailed, match="runtime_boundary_receipts"):
        store.runtime.atomic_apply_with_machine_lifecycle(
            RT, encode(s), r, idle_lifecycle(), [input_record()], s.id
        )
    assert store.runtime.load_session_snapshot(RT) is None
    assert store.runtime.load_runtime_state(RT) is None
    assert store.runtime.load_input_states(RT) == [a]
    assert runtime_state(db_url, RT) == before


def test_same_receipt_key_in_another_runtime_or_run_is_no_conflict(store: Store) -> None:
    r = receipt(7)
    store.runtime.atomic_apply(RT, None, r)
    store.runtime.atomic_apply("runtime-2", None, r)  # same run id and sequence
    other_seq = receipt(8, r.run_id)
    store.runtime.atomic_apply(RT, None, other_seq)
    other_run = receipt(7)
    store.runtime.atomic_apply(RT, None, other_run)
    assert store.runtime.load_boundary_receipt(RT, r.run_id, 7) == r
    assert store.runtime.load_boundary_receipt("runtime-2", r.run_id, 7) == r
    assert store.runtime.load_boundary_receipt(RT, r.run_id, 8) == other_seq
    assert store.runtime.load_boundary_receipt(RT, other_run.run_id, 7) == other_run
    assert store.runtime.load_boundary_receipt(RT, r.run_id, 9) is None


# --------------------------------------------------------------------------
# Terminal supersession (#22) and the session-store key (#23)


def test_22_terminal_boundary_superseded_publishes_nothing(store: Store, db_url: str) -> None:
    incoming = user_session("failed turn input")
    head = incoming.with_message("user", "already advanced")
    store.runtime.commit_session_snapshot(RT, encode(head))
    before = runtime_state(db_url, RT)
    r = receipt(0)
    with pytest.raises(SessionSnapshotSuperseded):
        store.runtime.atomic_apply_with_machine_lifecycle(
            RT, encode(incoming), r, idle_lifecycle(), [input_record()], incoming.id
        )
    assert store.runtime.load_session_snapshot(RT) == encode(head)
    assert store.runtime.load_runtime_state(RT) is None
    assert store.runtime.load_input_states(RT) == []
    assert store.runtime.load_boundary_receipt(RT, r.run_id, 0) is None
    assert runtime_state(db_url, RT) == before


def test_23_mismatched_session_store_key_is_refused(store: Store, db_url: str) -> None:
    s = user_session("mine")
    other = user_session("theirs")
    calls: list[Callable[[], object]] = [
        lambda: store.runtime.atomic_apply(RT, encode(s), receipt(1), [input_record()], other.id),
        lambda: store.runtime.atomic_apply_with_machine_lifecycle(
            RT, encode(s), receipt(2), idle_lifecycle(), [input_record()], other.id
        ),
    ]
    for call in calls:
        with pytest.raises(SessionKeyMismatch) as info:
            call()
        assert (info.value.expected, info.value.actual) == (other.id, s.id)
        assert f"expected {other.id}, actual {s.id}" in str(info.value)
    assert store.runtime.load_session_snapshot(RT) is None
    assert runtime_state(db_url, RT) == runtime_state(db_url, NOTHING)


def test_key_without_a_session_is_ignored(store: Store) -> None:
    """§2.10 step 3: a key with no snapshot is not checked."""
    r = receipt(1)
    store.runtime.atomic_apply(RT, None, r, (), user_session("x").id)
    assert store.runtime.load_boundary_receipt(RT, r.run_id, 1) == r


# --------------------------------------------------------------------------
# Fault injected mid-transaction: nothing of the boundary stays (I1)

FAULTS = [
    ("runtime_input_states", "INSERT", False),
    ("runtime_boundary_receipts", "INSERT", False),
    ("runtime_compaction_projection_outbox", "INSERT", False),
    ("runtime_projection_quarantine", "DELETE", False),
    ("runtime_input_states", "INSERT", True),
    ("runtime_boundary_receipts", "INSERT", True),
    ("runtime_compaction_projection_outbox", "INSERT", True),
    ("runtime_projection_quarantine", "DELETE", True),
    ("runtime_states", "INSERT", True),  # only the terminal form writes the lifecycle
]


@pytest.mark.parametrize(
    ("table", "event", "terminal"),
    FAULTS,
    ids=[f"{'terminal' if x else 'apply'}-{t}-{e}" for t, e, x in FAULTS],
)
def test_fault_mid_boundary_leaves_nothing(
    backend: str, fresh_url: str, table: str, event: str, terminal: bool
) -> None:
    agentkeep.migrate(fresh_url)
    s, _ = session_with_compaction_intent()
    first, second = accepted_input(), accepted_input()
    r = receipt(9)
    with Store.open(fresh_url) as store:
        if table == "runtime_projection_quarantine":
            # The snapshot upsert deletes the marker: make that DELETE the fault.
            raw_exec(
                fresh_url,
                "INSERT INTO runtime_projection_quarantine VALUES (:rt)",
                params={"rt": RT},
            )
        before = runtime_state(fresh_url, RT)
        when = second.input_id if table == "runtime_input_states" else None

        def boundary(api: Any) -> None:
            inputs = [input_record(first), input_record(second)]
            if terminal:
                api.atomic_apply_with_machine_lifecycle(
                    RT, encode(s), r, idle_lifecycle(), inputs, s.id
                )
            else:
                api.atomic_apply(RT, encode(s), r, inputs, s.id)

        with abort_trigger(fresh_url, backend, table, event, when_input_id=when):
            with pytest.raises(WriteFailed, match="test trigger abort"):
                boundary(store.runtime)
            assert runtime_state(fresh_url, RT) == before
            # Inside a caller's unit: the fault rolls back only the boundary.
            other = accepted_input()
            with store.write() as uow:
                uow.runtime.persist_input_state("runtime-2", other)
                with pytest.raises(WriteFailed, match="test trigger abort"):
                    boundary(uow.runtime)
                uow.runtime.persist_input_state("runtime-2", other.with_recovery_count(1))
            assert runtime_state(fresh_url, RT) == before
            assert [x.recovery_count for x in store.runtime.load_input_states("runtime-2")] == [1]
        # Without the fault the same boundary commits everything.
        boundary(store.runtime)
        after = runtime_state(fresh_url, RT)
        assert after["runtime_session_snapshots"] == [(encode(s),)]
        assert len(after["runtime_input_states"]) == 2
        assert len(after["runtime_boundary_receipts"]) == 1
        assert len(after["runtime_compaction_projection_outbox"]) == 1
        assert after["runtime_projection_quarantine"] == []
        assert len(after["runtime_states"]) == (1 if terminal else 0)


def test_fault_on_snapshot_update_keeps_the_previous_head(backend: str, fresh_url: str) -> None:
    agentkeep.migrate(fresh_url)
    s = user_session("one")
    with Store.open(fresh_url) as store:
        store.runtime.atomic_apply(RT, encode(s), receipt(1), (), s.id)
        before = runtime_state(fresh_url, RT)
        with abort_trigger(fresh_url, backend, "runtime_session_snapshots", "UPDATE"):
            with pytest.raises(WriteFailed, match="test trigger abort"):
                store.runtime.atomic_apply(
                    RT, encode(s.with_message("user", "two")), receipt(2), [input_record()], s.id
                )
        assert runtime_state(fresh_url, RT) == before


# --------------------------------------------------------------------------
# Receipt sequence encoding (#33, #34, I11)

PROBES = [0, 1, 2**63 - 2, 2**63 - 1, 2**63, MAX_U64]


def test_33_sequence_encoding_is_injective_across_i64_boundary() -> None:
    encoded = [encode_receipt_sequence(p) for p in PROBES]
    assert len(set(encoded)) == len(PROBES)
    assert all(-(2**63) <= e < 2**63 for e in encoded)
    assert [decode_receipt_sequence(e) for e in encoded] == PROBES
    assert encode_receipt_sequence(2**63) == -(2**63)
    assert encode_receipt_sequence(MAX_U64) == -1


@given(st.integers(min_value=0, max_value=MAX_U64), st.integers(min_value=0, max_value=MAX_U64))
def test_sequence_encoding_is_a_bijection(a: int, b: int) -> None:
    assert decode_receipt_sequence(encode_receipt_sequence(a)) == a
    assert (encode_receipt_sequence(a) == encode_receipt_sequence(b)) == (a == b)


@pytest.mark.parametrize("bad", [-1, MAX_U64 + 1, 1.0, True, "1"])
def test_bad_sequences_are_refused(store: Store, bad: object) -> None:
    with pytest.raises(InvalidInput):
        encode_receipt_sequence(bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput):
        store.runtime.load_boundary_receipt(RT, receipt(0).run_id, bad)  # type: ignore[arg-type]


def test_34_receipts_straddling_i64_max_persist_distinctly(store: Store, db_url: str) -> None:
    run = receipt(0).run_id
    receipts = [receipt(seq, run) for seq in PROBES]
    for r in receipts:
        store.runtime.atomic_apply(RT, None, r)
    rows = raw_rows(
        db_url,
        "SELECT sequence FROM runtime_boundary_receipts WHERE runtime_id = :rt",
        {"rt": RT},
    )
    assert sorted(v for (v,) in rows) == sorted(encode_receipt_sequence(p) for p in PROBES)
    for r in receipts:
        assert store.runtime.load_boundary_receipt(RT, run, r.sequence) == r
    with pytest.raises(WriteFailed):  # 2**63 is its own key, and taken
        store.runtime.atomic_apply(RT, None, receipt(2**63, run))


def test_corrupt_receipt_row_fails_loudly(store: Store, db_url: str) -> None:
    r = receipt(3)
    store.runtime.atomic_apply(RT, None, r)
    raw_exec(
        db_url,
        "UPDATE runtime_boundary_receipts SET receipt_json = :d",
        params={"d": b'{"run_id": "x"}'},
    )
    with pytest.raises(ReadFailed, match="boundary receipt"):
        store.runtime.load_boundary_receipt(RT, r.run_id, 3)


def test_bad_input_ids_in_a_boundary_write_nothing(store: Store, db_url: str) -> None:
    s = user_session("x")
    bad = StoredInputState(input_id="not-a-uuid", current_state="accepted")
    with pytest.raises(InvalidInput):
        store.runtime.atomic_apply(RT, encode(s), receipt(1), [accepted_input(), bad], s.id)
    assert runtime_state(db_url, RT) == runtime_state(db_url, NOTHING)
