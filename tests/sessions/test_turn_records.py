"""The turn's cheap paths build and refuse exactly what the checked paths did.

A node's payload is walked once where it sits in the node
(``commits._node_text``): the deepest payload a node may hold is committed
and read back, one level deeper is refused as before
(``InvalidInput`` naming the payload, nothing written). The records a read
builds without validation (``records.checked_builder``) equal the validated
ones, fields set included. On both backends.
"""

from __future__ import annotations

from typing import Any

import pytest

from agentkeep.errors import InvalidInput
from agentkeep.sessions.domain import LeaseOwnerIdentity
from agentkeep.sessions.records import (
    ActivePathScope,
    AppendNodes,
    HeadScope,
    HydratedSessionCheckpoint,
    PersistedSessionRead,
    RuntimeCommit,
    SessionNodeRecord,
    TokenUsage,
    UsageDelta,
)
from agentkeep.store import Store
from agentkeep.strict_json import json_value_problem
from tests.sessions.support import acquire_lease
from tests.support import query

A = LeaseOwnerIdentity(owner_id="owner-A", incarnation_id="inc-A")


def nested(levels: int) -> Any:
    value: Any = "leaf"
    for _ in range(levels):
        value = [value]
    return value


def deepest_node_payload() -> Any:
    """The most deeply nested list a node's payload may be (one level inside the node)."""
    levels = 1
    while json_value_problem(nested(levels + 1), 1) is None:
        levels += 1
    return nested(levels)


def commit(store: Store, rev: int, node: SessionNodeRecord, **extra: Any) -> int:
    lease = acquire_lease(store, "s1", A, 60_000)
    return store.commits.commit_runtime_state(
        RuntimeCommit(
            session_id="s1",
            expected_head_revision=rev,
            session_execution_lease=lease,
            graph=AppendNodes(nodes=(node,), leaf_node_id=node.node_id),
            **extra,
        )
    ).head_revision


def test_the_deepest_payload_commits_and_one_level_more_is_refused(store: Store) -> None:
    deepest = deepest_node_payload()
    assert commit(store, 0, SessionNodeRecord(node_id="n1", payload=deepest)) == 1
    read = store.commits.load_session("s1", ActivePathScope())
    assert read is not None and read.graph.nodes[0].payload == deepest
    before = query(store, "SELECT * FROM graph_nodes")
    too_deep = SessionNodeRecord(node_id="n2", parent_node_id="n1", payload=[deepest])
    with pytest.raises(InvalidInput) as info:
        commit(store, 1, too_deep)
    assert info.value.field == "commit.graph.nodes[0].payload"
    assert "nested deeper" in str(info.value)
    assert query(store, "SELECT * FROM graph_nodes") == before


@pytest.mark.parametrize("node_id", ["n\u00e9", "n1"])
def test_a_surrogate_in_the_payload_is_refused_naming_it(store: Store, node_id: str) -> None:
    node = SessionNodeRecord(node_id=node_id, payload={"k": ["ok", "\ud800"]})
    with pytest.raises(InvalidInput) as info:
        commit(store, 0, node)
    assert info.value.field == "commit.graph.nodes[0].payload"
    assert "surrogate" in str(info.value)
    assert query(store, "SELECT * FROM session_head") == []


def test_read_records_equal_validated_ones(store: Store) -> None:
    usage = TokenUsage(input_tokens=3, output_tokens=2, reasoning_output_tokens=1)
    node = SessionNodeRecord(node_id="n\u00e9", payload={"m": "hi"}, timestamp=5)
    commit(
        store,
        0,
        node,
        config={"c": [1, 2]},
        agent_frames=({"f": 1},),
        current_agent_frame_id="f1",
        checkpoint=HydratedSessionCheckpoint(turn_state={"t": 1}, tool_state=[1, 2]),
        usage_deltas=(UsageDelta(source="agent", model="m", usage=usage),),
    )
    for scope in (HeadScope(), ActivePathScope(), ActivePathScope(tail=1)):
        read = store.commits.load_session("s1", scope)
        assert read is not None
        fields = {name: getattr(read, name) for name in PersistedSessionRead.model_fields}
        validated = PersistedSessionRead.model_validate(read.model_dump())
        assert read == validated == PersistedSessionRead(**fields)
        assert repr(read) == repr(validated)
        for got, want in (
            (read, validated),
            (read.graph, validated.graph),
            (read.checkpoint, validated.checkpoint),
            (read.token_ledger[0], validated.token_ledger[0]),
            (read.token_ledger[0].usage, validated.token_ledger[0].usage),
        ):
            assert type(got) is type(want)
            assert got.model_fields_set == want.model_fields_set  # type: ignore[union-attr]
        assert read.checkpoint is not None and read.checkpoint.tool_state == [1, 2]
        assert read.token_ledger[0].usage == usage
        assert read.current_agent_frame_id == "f1" and read.config == {"c": [1, 2]}


def _same_as_validated(record: Any) -> None:
    """``record`` equals its validated rebuild (type, fields, repr), nested too; a record
    the store builds without validation has every field set, as validation leaves it."""
    from agentkeep.sessions import domain

    validated = type(record).model_validate(record.model_dump())
    assert record == validated
    assert repr(record) == repr(validated)
    built = (
        domain.LeaseOwnerIdentity,
        domain.SessionExecutionLease,
        domain.QueuedWorkPayload,
        domain.QueuedWorkItem,
        domain.QueuedWorkBatch,
        domain.PendingTurnInput,
        domain.QueuedWorkClaim,
        domain.TurnInputClaim,
    )
    if isinstance(record, built):
        assert record.model_fields_set == set(type(record).model_fields)
    for name in type(record).model_fields:
        value = getattr(record, name)
        for inner in value if isinstance(value, tuple) else (value,):
            if hasattr(inner, "model_fields_set"):
                _same_as_validated(inner)


def test_lease_queue_and_input_records_equal_validated_ones(store: Store) -> None:
    """Leases, batches, turn inputs and claims are built from checked values without
    validation (``domain.checked_builder``); each equals what validation builds."""
    from agentkeep.sessions.domain import (
        Acquired,
        ClaimBoundary,
        NextTurnIngress,
        PendingTurnInputDraft,
        QueuedWorkDraft,
        QueuedWorkPayload,
    )

    owner = A.model_validate(A.model_dump())  # every field set, as a decoded owner has
    claimed = store.leases.try_claim_session_execution_lease("s1", owner, 60_000)
    assert isinstance(claimed, Acquired)
    lease = store.leases.renew_session_execution_lease(claimed.lease, 60_000)
    held = store.leases.get_session_execution_lease("s1")
    payloads = (QueuedWorkPayload(kind="user_message", body={"t": ["é", 1]}),) * 2
    batch = store.queue.enqueue_queued_work(QueuedWorkDraft(session_id="s1", payloads=payloads))
    claim = store.queue.claim_ready_queued_work("s1", lease, owner, ClaimBoundary.IDLE, 1)
    draft = PendingTurnInputDraft(session_id="s1", ingress=NextTurnIngress(), input={"x": [1]})
    pending = store.turn_inputs.enqueue_pending_turn_input(draft)
    taken = store.turn_inputs.claim_next_turn_inputs("s1", lease, owner, 1)
    assert claim is not None and taken is not None and held is not None
    for record in (
        claimed.lease,
        lease,
        held,
        batch,
        claim,
        pending,
        taken,
        *store.queue.list_queued_work("s1"),
        *store.turn_inputs.list_turn_inputs("s1"),
    ):
        _same_as_validated(record)
