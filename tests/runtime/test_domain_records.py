"""Unit tests of the runtime domain records (spec runtime §3.6–§3.11, seed tests of §4)."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest

from agentkeep.errors import InvalidInput
from agentkeep.runtime.domain import (
    MAX_INPUT_STATE_BATCH_CAS,
    DeleteOpsFinalizationAuthority,
    InputStatePersistenceRecord,
    MachineLifecycleCommit,
    OpsSnapshot,
    RuntimeBinding,
    Session,
    StoredInputState,
    UnregisterFinalizationCommit,
    canonical_uuid,
    issue_delete_ops_finalization_authority,
    logical_runtime_id_for_session,
)
from agentkeep.runtime.errors import InvalidInputStateBatchCas, ReadFailed, WriteFailed
from agentkeep.runtime.input_cas import prepare_input_state_batch_cas

from .builders import unversioned_lifecycle
from .test_domain import D, to_bytes

# --------------------------------------------------------------------------
# Input states (§3.10, #38) and batch CAS (§3.6, #10)


def test_input_state_round_trip() -> None:
    st = StoredInputState.new_accepted()
    assert st.recovery_count == 0 and st.current_state == "accepted"
    data = D.encode_input_state(st)
    assert D.decode_input_state(data) == st
    assert D.encode_input_state(D.decode_input_state(data)) == data


def test_input_state_without_version_names_the_field() -> None:  # #38
    obj = json.loads(D.encode_input_state(StoredInputState.new_accepted()))
    del obj["stored_input_state_version"]
    with pytest.raises(ReadFailed, match="stored_input_state_version"):
        D.decode_input_state(to_bytes(obj))


@pytest.mark.parametrize(
    "mutate",
    [
        lambda o: o.update(stored_input_state_version=0),
        lambda o: o.update(unknown=1),
        lambda o: o.update(recovery_count=-1),
        lambda o: o.update(recovery_count=True),
        lambda o: o.update(input_id="ABC"),
        lambda o: o.pop("input_id"),
    ],
)
def test_bad_input_state_rows(mutate: Any) -> None:
    obj = json.loads(D.encode_input_state(StoredInputState.new_accepted()))
    mutate(obj)
    with pytest.raises(ReadFailed):
        D.decode_input_state(to_bytes(obj))


def states(n: int) -> list[StoredInputState]:
    return [StoredInputState.new_accepted() for _ in range(n)]


def test_batch_cas_accepts_256_rows_in_expected_order() -> None:  # #10
    expected = states(MAX_INPUT_STATE_BATCH_CAS)
    replacements = [
        InputStatePersistenceRecord.from_machine_snapshot(s.with_recovery_count(7))
        for s in reversed(expected)
    ]
    rows = prepare_input_state_batch_cas(D, expected, replacements)
    assert [r.input_id for r in rows] == [s.input_id for s in expected]
    for row, st in zip(rows, expected, strict=True):
        assert row.expected_json == D.encode_input_state(st)
        assert D.decode_input_state(row.replacement_json).recovery_count == 7


def test_batch_cas_empty_batch() -> None:
    assert prepare_input_state_batch_cas(D, [], []) == ()


def test_batch_cas_refuses_257_rows() -> None:
    expected = states(MAX_INPUT_STATE_BATCH_CAS + 1)
    with pytest.raises(InvalidInputStateBatchCas, match="exceed the maximum of 256"):
        prepare_input_state_batch_cas(D, expected, expected)


def test_batch_cas_shape_errors() -> None:
    a, b, c = states(3)
    with pytest.raises(InvalidInputStateBatchCas, match="2 expected rows but 1"):
        prepare_input_state_batch_cas(D, [a, b], [a])
    with pytest.raises(InvalidInputStateBatchCas, match="repeats in expected") as info:
        prepare_input_state_batch_cas(D, [a, a], [a, b])
    assert a.input_id in info.value.reason
    with pytest.raises(InvalidInputStateBatchCas, match="repeats in replacements"):
        prepare_input_state_batch_cas(D, [a, b], [b, b])
    with pytest.raises(InvalidInputStateBatchCas, match=f"expected input {b.input_id}"):
        prepare_input_state_batch_cas(D, [a, b], [a, c])
    with pytest.raises(InvalidInputStateBatchCas, match=f"expected input {a.input_id}"):
        # same sizes and no repeats: a differing id set always lacks a replacement first
        prepare_input_state_batch_cas(D, [a], [c])


def test_batch_cas_encode_failure_is_write_failed() -> None:
    (a,) = states(1)
    bad = a.model_copy(update={"details": {"x": float("nan")}})
    with pytest.raises(WriteFailed):
        prepare_input_state_batch_cas(D, [a], [bad])


# --------------------------------------------------------------------------
# Machine lifecycle (§3.7, #24, #31, #32)


def test_lifecycle_round_trip() -> None:  # #24
    binding = RuntimeBinding(
        agent_runtime_id="rt:session:sqlite",
        fence_token=11,
        runtime_generation=None,
        runtime_epoch_id="epoch-sqlite",
    )
    snap = MachineLifecycleCommit(runtime_state="stopped", binding=binding)
    data = D.encode_lifecycle(snap)
    obj = json.loads(data)
    assert obj["record_version"] == 3 and obj["unregister_progress"] is None
    assert obj["supervisor_authority"] == {"kind": "unbound_no_receipt"}
    assert D.decode_lifecycle(data) == snap
    idle = MachineLifecycleCommit(runtime_state="idle")
    assert D.decode_lifecycle(D.encode_lifecycle(idle)).binding == RuntimeBinding.unbound()


def test_legacy_lifecycle_rows_are_not_authority() -> None:  # #31, #32
    with pytest.raises(ReadFailed):
        D.decode_lifecycle(b'"retired"')
    legacy = unversioned_lifecycle()
    with pytest.raises(ReadFailed, match="record_version"):
        D.decode_lifecycle(to_bytes(legacy))


@pytest.mark.parametrize(
    "mutate",
    [
        lambda o: o.update(record_version=2),
        lambda o: o.update(runtime_state="running"),
        lambda o: o["binding"].pop("fence_token"),
        lambda o: o["binding"].update(fence_token=True),
        lambda o: o["binding"].update(extra=None),
        lambda o: o.update(supervisor_authority={"kind": "bound"}),
        lambda o: o.update(unregister_progress={}),
        lambda o: o.pop("unregister_progress"),
        lambda o: o.update(more=1),
    ],
)
def test_lifecycle_decode_is_strict(mutate: Any) -> None:
    obj = json.loads(D.encode_lifecycle(MachineLifecycleCommit(runtime_state="idle")))
    mutate(obj)
    with pytest.raises(ReadFailed):
        D.decode_lifecycle(to_bytes(obj))


# --------------------------------------------------------------------------
# Ops snapshot (§3.8), unregister finalization (§3.9), identifiers (§3.11)


def test_ops_codec() -> None:
    snap = OpsSnapshot(epoch_id="epoch-1", payload={"ops": [1, 2]})
    data = D.encode_ops(snap)
    assert D.decode_ops(data) == snap
    assert D.ops_epoch_of(data) == "epoch-1"
    for bad in (
        b'{"epoch_id":"e"}',
        b'{"ops_snapshot_version":2,"epoch_id":"e","payload":null}',
        b'{"ops_snapshot_version":1,"epoch_id":"","payload":null}',
        b'{"ops_snapshot_version":1,"epoch_id":"e","payload":null,"x":1}',
        b"garbage",
    ):
        with pytest.raises(ReadFailed):
            D.ops_epoch_of(bad)
    with pytest.raises(WriteFailed):
        D.encode_ops(OpsSnapshot(epoch_id="e", payload=float("inf")))


def test_unregister_finalization_commit() -> None:
    authority = issue_delete_ops_finalization_authority()
    rec = InputStatePersistenceRecord.from_machine_snapshot(StoredInputState.new_accepted())
    fin = UnregisterFinalizationCommit(
        lifecycle=MachineLifecycleCommit(runtime_state="stopped"),
        input_states=(rec,),
        retired_ops_epoch="epoch-1",
        authority=authority,
    )
    assert fin.input_states[0].into_stored() == rec.state
    with pytest.raises(TypeError):
        DeleteOpsFinalizationAuthority(object())
    with pytest.raises(InvalidInput):
        UnregisterFinalizationCommit(fin.lifecycle, (rec, rec), "epoch-1", authority)
    with pytest.raises(InvalidInput):
        UnregisterFinalizationCommit(fin.lifecycle, (), "", authority)


def test_identifiers() -> None:
    sid = str(uuid.uuid4())
    assert logical_runtime_id_for_session(sid) == f"rt:session:{sid}"
    assert canonical_uuid(sid, "session_id") == sid
    with pytest.raises(InvalidInput):
        canonical_uuid(sid.upper(), "session_id")
    with pytest.raises(InvalidInput):
        canonical_uuid(sid.replace("-", ""), "session_id")
    with pytest.raises(InvalidInput):
        Session.new("nope")


@pytest.mark.parametrize(
    "text",
    [
        "6f1c5a52-1a8a-4b43-9a0c-1f0f6f1b4a11",
        "6F1C5A52-1A8A-4B43-9A0C-1F0F6F1B4A11",
        "6f1c5a521a8a4b439a0c1f0f6f1b4a11",
        "{6f1c5a52-1a8a-4b43-9a0c-1f0f6f1b4a11}",
        "urn:uuid:6f1c5a52-1a8a-4b43-9a0c-1f0f6f1b4a11",
        "6f1c5a52-1a8a-4b43-9a0c-1f0f6f1b4a11\n",
        " 6f1c5a52-1a8a-4b43-9a0c-1f0f6f1b4a11",
        "6f1c5a52-1a8a-4b43-9a0c-1f0f6f1b4a1g",
        "6f1c5a521-a8a-4b43-9a0c-1f0f6f1b4a11",
        "6f1c5a52-1a8a-4b43-9a0c-1f0f6f1b4a1\u0661",
        "",
        "nope",
        None,
        5,
    ],
)
def test_canonical_uuid_accepts_exactly_what_uuid_prints(text: Any) -> None:
    try:
        canonical = str(uuid.UUID(text)) == text
        message = f"{text!r} is not a canonical hyphenated lower-case UUID"
    except (ValueError, AttributeError, TypeError):
        canonical, message = False, f"{text!r} is not a UUID"
    if canonical:
        assert canonical_uuid(text, "id") == text
    else:
        with pytest.raises(InvalidInput) as info:
            canonical_uuid(text, "id")
        assert message in str(info.value)
