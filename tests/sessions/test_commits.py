"""Session commits and reads (spec sessions §2.2–2.4, §2.9, §4.11, §4.12), on SQLite and Postgres.

Every runtime-commit scenario of §5.2 is one test named after it (C-01..C-27),
plus invariants I-8, I-9, I-11, I-12, the read scenarios M-03..M-06 and M-09,
the error precedence of §2.4, injected faults (a trigger raising on the
INSERT into ``usage_deltas``, ``graph_nodes`` or ``runtime_turn_commits``), a
lost worker replaying and committing, the savepoint semantics inside a
caller's unit, corrupt stored rows, session metadata, and the cost of the
active-path walk. Where a decision of spec/README.md changes an expected
outcome (C-08, C-14, C-18, C-26, C-27), the test docstring says so.

"Nothing of the commit persists" is checked by comparing the full contents of
every session-store table before and after (:func:`snapshot`). Time comes
from the ``store`` fixture's :class:`SettableClock`. The concurrent scenarios
(two committers, killed processes) are in ``test_commit_races.py``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest
from sqlalchemy import text

from agentkeep.clock import SettableClock
from agentkeep.errors import (
    DatabaseError,
    Duplicate,
    HeadRevisionConflict,
    InvalidInput,
    NodeAlreadyExists,
    QueuedWorkClaimSuperseded,
    QueuedWorkSourceKeyConflict,
    ReadOnlyUnitOfWork,
    RuntimeTurnCommitConflict,
    SessionBindingMismatch,
    SessionCorrupt,
    SessionExecutionLeaseExpired,
    TurnInputClaimSuperseded,
    UsageLedgerOverflow,
)
from agentkeep.sessions import commits as commits_mod
from agentkeep.sessions.commits import ACTIVE_PATH
from agentkeep.sessions.domain import (
    ActiveTurnIngress,
    CheckpointKind,
    ClaimBoundary,
    LeaseFence,
    LeaseOwnerIdentity,
    MergeKey,
    NextTurnIngress,
    PendingTurnInputDraft,
    QueuedWorkClaim,
    QueuedWorkCompletion,
    QueuedWorkDraft,
    QueuedWorkPayload,
    SessionExecutionLease,
    SlotPolicy,
    TurnInputClaim,
    TurnInputCompletion,
)
from agentkeep.sessions.facade import SessionCalls
from agentkeep.sessions.maintenance import MaintenanceRepository
from agentkeep.sessions.records import (
    ActivePathScope,
    AppendNodes,
    BlobProfile,
    FullGraphScope,
    GcReport,
    HeadScope,
    HydratedSessionCheckpoint,
    PersistedSessionRead,
    ReplaceFullGraph,
    RuntimeCommit,
    RuntimeCommitResult,
    SessionGraph,
    SessionMeta,
    SessionNodeRecord,
    TokenUsage,
    TurnCommitStamp,
    UnchangedGraph,
    UsageDelta,
    UsageLedgerEntry,
)
from agentkeep.statements import CompileTarget
from agentkeep.store import Store
from tests.support import execute_sql, explain, query

from .support import LeaseTaker, enqueue

T = TypeVar("T")

SID = "sess-commit-1"
OTHER = "sess-commit-2"
TTL = 10_000
A = LeaseOwnerIdentity(owner_id="owner-A", incarnation_id="inc-A1")
B = LeaseOwnerIdentity(owner_id="owner-B", incarnation_id="inc-B1")
TABLES = (
    "session_head",
    "graph_nodes",
    "usage_deltas",
    "session_usage_totals",
    "runtime_turn_commits",
    "attachment_manifest",
    "blobs",
    "artifact_refs",
    "session_meta",
    "session_execution_leases",
    "queued_work_batches",
    "queued_work_items",
    "pending_turn_inputs",
)


# --------------------------------------------------------------------------
# Helpers

hold = LeaseTaker(owner=A, sid=SID, ttl=TTL)


def take_over(
    store: Store, clock: SettableClock, owner: LeaseOwnerIdentity = B, sid: str = SID
) -> SessionExecutionLease:
    """Let the current lease expire, then acquire the next generation as ``owner``."""
    clock.advance(TTL + 1)
    return hold(store, owner, sid)


def node(nid: str, parent: str | None = None, payload: Any = None) -> SessionNodeRecord:
    return SessionNodeRecord(
        node_id=nid, parent_node_id=parent, timestamp=7, payload=payload or {"n": nid}
    )


def mk(
    fence: LeaseFence | None,
    *,
    sid: str = SID,
    expected: int | None = None,
    nodes: tuple[SessionNodeRecord, ...] = (),
    leaf: str | None = None,
    **kw: Any,
) -> RuntimeCommit:
    """A commit; ``nodes`` become an Append (leaf: the last node) unless ``graph`` is given."""
    if "graph" not in kw:
        kw["graph"] = (
            AppendNodes(nodes=nodes, leaf_node_id=leaf or nodes[-1].node_id)
            if nodes
            else UnchangedGraph(leaf_node_id=leaf)
        )
    kw.setdefault("checkpoint", HydratedSessionCheckpoint(turn_state={"turn": 1}))
    return RuntimeCommit(
        session_id=sid, expected_head_revision=expected, session_execution_lease=fence, **kw
    )


def commit(store: Store, c: RuntimeCommit, **kw: Any) -> RuntimeCommitResult:
    return store.call_write(lambda r: r.commits.commit_runtime_state(c, **kw))


def stamp(turn: str, h: str = "h1", sid: str = SID) -> TurnCommitStamp:
    return TurnCommitStamp(session_id=sid, turn_id=turn, turn_commit_hash=h)


def usage(source: str = "src", model: str = "m", **counts: int) -> UsageDelta:
    return UsageDelta(source=source, model=model, usage=TokenUsage(**counts))


def qdraft(
    sid: str = SID, n: int = 0, key: str | None = None, join: bool = False
) -> QueuedWorkDraft:
    """A turn-work batch; ``join`` ones (merge group "g") are claimed together."""
    return QueuedWorkDraft(
        session_id=sid,
        source_key=key,
        slot_policy=SlotPolicy.JOIN if join else SlotPolicy.EXCLUSIVE,
        merge_key=MergeKey.of_group("g") if join else MergeKey.never(),
        payloads=(QueuedWorkPayload(kind="user_input", body=n),),
    )


def load(
    store: Store, sid: str = SID, scope: FullGraphScope | ActivePathScope | HeadScope | None = None
) -> PersistedSessionRead | None:
    return store.call_read(lambda r: r.commits.load_session(sid, scope or FullGraphScope()))


def loaded(store: Store, sid: str = SID, **kw: Any) -> PersistedSessionRead:
    got = load(store, sid, **kw)
    assert got is not None
    return got


def path_ids(store: Store, leaf: str | None = None, sid: str = SID) -> list[str]:
    got = loaded(store, sid, scope=ActivePathScope(leaf_node_id=leaf))
    return [n.node_id for n in got.graph.nodes]


def head_revision(store: Store, sid: str = SID) -> int:
    return store.call_read(lambda r: r.commits.get_head_revision(sid))


def _plain(value: Any) -> Any:
    return bytes(value) if isinstance(value, memoryview | bytearray) else value


def snapshot(store: Store) -> dict[str, list[tuple[Any, ...]]]:
    """The full contents of every session-store table (rows sorted), read with raw SQL."""
    out = {}
    with store.read() as uow:
        for table in TABLES:
            got = uow.connection.execute(text(f"SELECT * FROM {table}")).all()
            out[table] = sorted((tuple(_plain(v) for v in r) for r in got), key=repr)
    return out


def claim_batches(store: Store, fence: LeaseFence, n: int = 8) -> QueuedWorkClaim:
    c = store.queue.claim_ready_queued_work(SID, fence, fence.owner, ClaimBoundary.IDLE, n)
    assert c is not None
    return c


def input_draft(turn: str | None = "T", sid: str = SID, key: str | None = None) -> Any:
    ingress = NextTurnIngress() if turn is None else ActiveTurnIngress(turn_id=turn)
    return PendingTurnInputDraft(
        session_id=sid, source_key=key, ingress=ingress, input={"text": f"for {turn}"}
    )


def claim_active(store: Store, fence: LeaseFence, turn: str = "T", n: int = 10) -> TurnInputClaim:
    c = store.turn_inputs.claim_active_turn_inputs(
        SID, fence, fence.owner, turn, CheckpointKind.AFTER_WORK, n
    )
    assert c is not None
    return c


def input_row(store: Store, input_id: str) -> dict[str, Any]:
    (row,) = query(store, "SELECT * FROM pending_turn_inputs WHERE input_id = :i", i=input_id)
    return row


def advance_head(store: Store, fence: LeaseFence, n: int) -> None:
    """``n`` plain commits (each appends one node)."""
    for _ in range(n):
        rev = head_revision(store)
        commit(store, mk(fence, nodes=(node(f"pad-{rev}"),)))


# --------------------------------------------------------------------------
# Commit basics (C-01, C-02, C-04)


def test_c_01_first_commit_writes_the_head(store: Store) -> None:
    fence = hold(store)
    result = commit(
        store,
        mk(
            fence,
            nodes=(node("n1"), node("n2", "n1")),
            config={"model": "m", "temperature": 0.5},
            agent_frames=({"frame": 1}, {"frame": 2}),
            current_agent_frame_id="f2",
            checkpoint=HydratedSessionCheckpoint(turn_state={"t": 1}, tool_state={"tools": [1]}),
        ),
    )
    assert result.head_revision == 1
    assert len(result.checkpoint_ref) == 64
    assert result.manifest.tool_state_ref is not None
    (head,) = query(store, "SELECT * FROM session_head")
    assert head["session_id"] == SID
    assert head["head_revision"] == 1
    assert head["checkpoint_ref"] == result.checkpoint_ref
    assert head["leaf_node_id"] == "n2"
    assert head["graph_node_count"] == 2
    assert head["current_agent_frame_id"] == "f2"
    blobs = {r["hash"] for r in query(store, "SELECT hash FROM blobs")}
    assert blobs == {result.checkpoint_ref, result.manifest.tool_state_ref}

    got = loaded(store)
    assert got.head_revision == 1
    assert got.config == {"model": "m", "temperature": 0.5}
    assert got.agent_frames == ({"frame": 1}, {"frame": 2})
    assert got.current_agent_frame_id == "f2"
    assert got.graph == SessionGraph(nodes=(node("n1"), node("n2", "n1")), leaf_node_id="n2")
    assert got.checkpoint_ref == result.checkpoint_ref
    assert got.checkpoint is not None
    assert got.checkpoint.turn_state == {"t": 1}
    assert got.checkpoint.tool_state == {"tools": [1]}


def test_c_02_expected_zero_on_an_empty_store_succeeds(store: Store) -> None:
    fence = hold(store)
    assert commit(store, mk(fence, expected=0)).head_revision == 1
    assert head_revision(store) == 1


def test_c_04_no_expected_revision_is_a_blind_write(store: Store) -> None:
    fence = hold(store)
    advance_head(store, fence, 3)
    assert commit(store, mk(fence, expected=None)).head_revision == 4
    assert commit(store, mk(fence, expected=4)).head_revision == 5


def test_i_8_head_revision_grows_by_one_per_non_replay_commit(store: Store) -> None:
    fence = hold(store)
    seen = []
    for i in range(4):
        seen.append(commit(store, mk(fence, turn_commit=stamp(f"t{i}"))).head_revision)
        # a replay of the same turn does not move the head
        assert commit(store, mk(fence, turn_commit=stamp(f"t{i}"))).head_revision == seen[-1]
        assert head_revision(store) == seen[-1]
    assert seen == [1, 2, 3, 4]


# --------------------------------------------------------------------------
# Refusals that write nothing (C-03, C-05..C-07)


def _loaded_commit(fence: LeaseFence | None, **kw: Any) -> RuntimeCommit:
    """A commit that would write something into every table it touches."""
    kw.setdefault("nodes", (node("new-1"), node("new-2", "new-1")))
    kw.setdefault(
        "checkpoint",
        HydratedSessionCheckpoint(
            turn_state={"fresh": True}, tool_state={"fresh": "tool"}, execution_state=[1, 2, 3]
        ),
    )
    kw.setdefault("usage_deltas", (usage(input_tokens=10), usage(output_tokens=3)))
    kw.setdefault("enqueued_queue_batches", (qdraft(n=99),))
    kw.setdefault("turn_commit", stamp("turn-new"))
    kw.setdefault("committed_attachment_ids", ("att-1",))
    return mk(fence, **kw)


def add_attachment(store: Store, aid: str = "att-1", sid: str = SID) -> None:
    execute_sql(
        store,
        "INSERT INTO attachment_manifest (session_id, attachment_id, canonical_uri, intent_at_ms) "
        "VALUES (:s, :a, :u, 1)",
        s=sid,
        a=aid,
        u=f"file:///{aid}",
    )


def test_c_03_head_revision_conflict_writes_nothing(store: Store) -> None:
    fence = hold(store)
    advance_head(store, fence, 3)
    add_attachment(store)
    before = snapshot(store)
    with pytest.raises(HeadRevisionConflict) as info:
        commit(store, _loaded_commit(fence, expected=2))
    assert (info.value.session_id, info.value.expected, info.value.actual) == (SID, 2, 3)
    assert snapshot(store) == before


def test_c_05_a_commit_without_a_fence_is_refused(store: Store) -> None:
    hold(store)
    add_attachment(store)
    before = snapshot(store)
    with pytest.raises(SessionExecutionLeaseExpired) as info:
        commit(store, _loaded_commit(None))
    assert info.value.session_id == SID
    assert snapshot(store) == before


@pytest.mark.parametrize("how", ["taken_over", "reacquired_by_the_same_owner"])
def test_c_06_a_fence_one_generation_behind_is_refused(
    store: Store, clock: SettableClock, how: str
) -> None:
    old = hold(store)
    if how == "taken_over":
        take_over(store, clock)
    else:
        store.leases.release_session_execution_lease(old)
        assert hold(store).fencing_token == old.fencing_token + 1
    add_attachment(store)
    before = snapshot(store)
    with pytest.raises(SessionExecutionLeaseExpired):
        commit(store, _loaded_commit(old))
    assert snapshot(store) == before


def test_c_07_a_stale_fence_wins_over_a_wrong_expected_revision(
    store: Store, clock: SettableClock
) -> None:
    old = hold(store)
    advance_head(store, old, 2)
    take_over(store, clock)
    before = snapshot(store)
    with pytest.raises(SessionExecutionLeaseExpired):
        commit(store, _loaded_commit(old, expected=0))
    assert snapshot(store) == before


def test_an_expired_fence_is_refused_even_if_nobody_took_over(
    store: Store, clock: SettableClock
) -> None:
    fence = hold(store)
    clock.advance(TTL)  # expires == now: dead (strict)
    with pytest.raises(SessionExecutionLeaseExpired):
        commit(store, mk(fence))
    assert head_revision(store) == 0


def test_error_precedence_follows_the_spec_order(store: Store, clock: SettableClock) -> None:
    """§2.4: lease → head CAS → queue claims → turn-input claims → nodes → drafts.

    One commit carries every fault; fixing them one at a time reveals the next.
    """
    fence = hold(store)
    commit(store, mk(fence, nodes=(node("dup"),)))
    bad_q = QueuedWorkCompletion(
        session_id=SID, claim_id="qwc:x", lease_token="t", batch_ids=("b",)
    )
    bad_t = TurnInputCompletion(session_id=SID, claim_id="tic:x", lease_token="t", input_ids=("i",))
    stale = fence.model_copy(update={"fencing_token": fence.fencing_token + 5})
    faults: dict[str, Any] = {
        "session_execution_lease": stale,
        "expected_head_revision": 7,
        "completed_queue_claims": (bad_q,),
        "completed_turn_input_claims": (bad_t,),
        "graph": AppendNodes(nodes=(node("dup"),), leaf_node_id="dup"),
        "enqueued_queue_batches": (qdraft(sid=OTHER),),
    }
    fixes: dict[str, Any] = {
        "session_execution_lease": fence,
        "expected_head_revision": 1,
        "completed_queue_claims": (),
        "completed_turn_input_claims": (),
        "graph": UnchangedGraph(leaf_node_id="dup"),
        "enqueued_queue_batches": (),
    }
    expected_errors = [
        SessionExecutionLeaseExpired,
        HeadRevisionConflict,
        QueuedWorkClaimSuperseded,
        TurnInputClaimSuperseded,
        NodeAlreadyExists,
        SessionBindingMismatch,
    ]
    before = snapshot(store)
    base = RuntimeCommit(session_id=SID, **faults)
    for field, error in zip(faults, expected_errors, strict=True):
        with pytest.raises(error):
            commit(store, base)
        assert snapshot(store) == before
        base = base.model_copy(update={field: fixes[field]})
    assert commit(store, base).head_revision == 2


# --------------------------------------------------------------------------
# Multi-session heads (C-08)


def test_c_08_each_session_has_its_own_head(store: Store) -> None:
    """Decision (spec/README.md, multi-session): no binding; each session keeps its own head.

    The seed refused a commit for session B on a file bound to A
    (``SessionBindingMismatch``); here both commit independently.
    """
    fa = hold(store, sid=SID)
    fb = hold(store, B, sid=OTHER)
    commit(store, mk(fa, nodes=(node("a1"),), usage_deltas=(usage(input_tokens=1),)))
    commit(store, mk(fa, nodes=(node("a2", "a1"),)))
    rb = commit(store, mk(fb, sid=OTHER, expected=0, nodes=(node("b1"),)))
    assert rb.head_revision == 1
    assert (head_revision(store, SID), head_revision(store, OTHER)) == (2, 1)
    a, b = loaded(store, SID), loaded(store, OTHER)
    assert [n.node_id for n in a.graph.nodes] == ["a1", "a2"]
    assert [n.node_id for n in b.graph.nodes] == ["b1"]
    assert b.token_ledger == ()
    # The same node id may exist in two sessions.
    commit(store, mk(fb, sid=OTHER, nodes=(node("a1"),)))
    assert store.call_read(lambda r: r.commits.load_node(OTHER, "a1")) == node("a1")


def test_a_fence_of_another_session_is_refused(store: Store) -> None:
    hold(store, sid=SID)
    other_fence = hold(store, B, sid=OTHER)
    with pytest.raises(SessionExecutionLeaseExpired):
        commit(store, mk(other_fence, sid=SID))
    assert head_revision(store, SID) == head_revision(store, OTHER) == 0


# --------------------------------------------------------------------------
# Turn-commit idempotency (C-09..C-12, I-9)


def test_c_09_replay_with_a_stale_fence_returns_the_stored_result(
    store: Store, clock: SettableClock
) -> None:
    fence = hold(store)
    advance_head(store, fence, 4)
    c = mk(
        fence, nodes=(node("t1-node"),), turn_commit=stamp("t1"), enqueued_queue_batches=(qdraft(),)
    )
    original = commit(store, c)
    assert original.head_revision == 5
    advance_head(store, fence, 2)
    take_over(store, clock)  # the fence in ``c`` is now stale
    before = snapshot(store)

    replayed = commit(store, c)
    assert replayed == original
    assert replayed.head_revision == 5
    assert head_revision(store) == 7
    assert snapshot(store) == before


def test_c_10_replay_runs_the_matching_release(store: Store) -> None:
    fence = hold(store)
    c = mk(fence, turn_commit=stamp("t1"))
    original = commit(store, c)
    before = snapshot(store)
    replay = c.model_copy(update={"release_session_execution_lease": fence})

    assert commit(store, replay) == original
    assert store.leases.get_session_execution_lease(SID) is None
    after = snapshot(store)
    assert {t: v for t, v in after.items() if t != "session_execution_leases"} == {
        t: v for t, v in before.items() if t != "session_execution_leases"
    }
    (lease,) = query(store, "SELECT * FROM session_execution_leases")
    assert lease["lease_fencing_token"] == fence.fencing_token  # release keeps the generation


def test_replay_with_a_release_that_no_longer_matches_is_a_silent_no_op(
    store: Store, clock: SettableClock
) -> None:
    fence = hold(store)
    c = mk(fence, turn_commit=stamp("t1"))
    original = commit(store, c)
    new = take_over(store, clock)
    before = snapshot(store)
    assert (
        commit(store, c.model_copy(update={"release_session_execution_lease": fence})) == original
    )
    assert snapshot(store) == before
    assert store.leases.get_session_execution_lease(SID) == new


def test_c_11_same_turn_with_another_hash_conflicts(store: Store) -> None:
    fence = hold(store)
    commit(store, mk(fence, turn_commit=stamp("t1", "h1")))
    before = snapshot(store)
    with pytest.raises(RuntimeTurnCommitConflict) as info:
        commit(store, _loaded_commit(fence, turn_commit=stamp("t1", "h2")))
    assert (info.value.session_id, info.value.turn_id) == (SID, "t1")
    assert snapshot(store) == before


def test_c_12_a_stamp_for_another_session_conflicts(store: Store) -> None:
    fence = hold(store)
    before = snapshot(store)
    with pytest.raises(RuntimeTurnCommitConflict) as info:
        commit(store, mk(fence, turn_commit=stamp("t1", sid=OTHER)))
    assert (info.value.session_id, info.value.turn_id) == (OTHER, "t1")
    assert snapshot(store) == before


def test_i_9_replay_returns_the_original_result_byte_for_byte(store: Store) -> None:
    fence = hold(store)
    c = mk(
        fence,
        nodes=(node("n1"),),
        checkpoint=HydratedSessionCheckpoint(turn_state={"b": [1, {"z": None}]}, tool_state="x"),
        turn_commit=stamp("t1"),
        enqueued_queue_batches=(qdraft(n=1), qdraft(n=2, key="k")),
    )
    original = commit(store, c)
    (rec,) = query(store, "SELECT * FROM runtime_turn_commits")
    assert RuntimeCommitResult.model_validate_json(rec["result_json"]) == original
    assert rec["checkpoint_ref"] == original.checkpoint_ref
    assert rec["turn_commit_hash"] == "h1"
    for _ in range(2):
        again = commit(store, c)
        assert again == original
        assert again.model_dump_json() == original.model_dump_json()
    # One (session, turn) → one hash: the record was not rewritten.
    assert query(store, "SELECT * FROM runtime_turn_commits") == [rec]


def test_a_corrupt_stored_result_fails_the_replay_loudly(store: Store) -> None:
    fence = hold(store)
    c = mk(fence, turn_commit=stamp("t1"))
    commit(store, c)
    execute_sql(store, "UPDATE runtime_turn_commits SET result_json = '{\"head_revision\": -1}'")
    before = snapshot(store)
    with pytest.raises(SessionCorrupt) as info:
        commit(store, c)
    assert (info.value.table, info.value.column) == ("runtime_turn_commits", "result_json")
    assert SID in info.value.key
    assert snapshot(store) == before


def test_lost_worker_replays_its_turn_and_is_refused_a_new_one(
    store: Store, clock: SettableClock
) -> None:
    """A worker that lost its lease gets its recorded result back, and nothing else."""
    fence = hold(store)
    q = claim_batches_after_enqueue(store, fence)
    c = mk(
        fence,
        nodes=(node("n1"),),
        usage_deltas=(usage(input_tokens=5),),
        completed_queue_claims=(q.completion(),),
        turn_commit=stamp("t1"),
    )
    original = commit(store, c)
    new = take_over(store, clock)
    commit(store, mk(new, nodes=(node("n2", "n1"),), turn_commit=stamp("t2", "x")))
    before = snapshot(store)

    assert commit(store, c) == original  # the lost worker retries its last turn
    assert snapshot(store) == before
    with pytest.raises(SessionExecutionLeaseExpired):  # and may not commit a new one
        commit(store, mk(fence, nodes=(node("n3", "n1"),), turn_commit=stamp("t3")))
    with pytest.raises(RuntimeTurnCommitConflict):  # nor overwrite the new holder's turn
        commit(store, mk(fence, turn_commit=stamp("t2", "other")))
    assert snapshot(store) == before


def claim_batches_after_enqueue(store: Store, fence: LeaseFence, n: int = 2) -> QueuedWorkClaim:
    for i in range(n):
        enqueue(store, qdraft(n=i, join=True))
    claim = claim_batches(store, fence, n)
    assert len(claim.batches) == n
    return claim


# --------------------------------------------------------------------------
# Queue claims (C-13..C-15)


def test_c_13_a_reclaimed_queue_claim_fails_the_commit(store: Store, clock: SettableClock) -> None:
    old_fence = hold(store)
    old_claim = claim_batches_after_enqueue(store, old_fence)
    new_fence = take_over(store, clock)
    new_claim = claim_batches(store, new_fence)
    assert {b.batch_id for b in new_claim.batches} == {b.batch_id for b in old_claim.batches}
    before = snapshot(store)

    # The new holder (valid fence) presenting the superseded claim: the ownership check fails.
    with pytest.raises(QueuedWorkClaimSuperseded) as info:
        commit(store, _loaded_commit(new_fence, completed_queue_claims=(old_claim.completion(),)))
    assert (info.value.session_id, info.value.claim_id) == (SID, old_claim.claim_id)
    # The old holder fails its fence first.
    with pytest.raises(SessionExecutionLeaseExpired):
        commit(store, _loaded_commit(old_fence, completed_queue_claims=(old_claim.completion(),)))
    assert snapshot(store) == before
    # the g+1 claim is intact
    store.call_read(lambda r: r.queue.ensure_queued_work_completion(new_claim.completion()))


def test_c_14_completion_with_a_wrong_batch_set_is_refused(store: Store) -> None:
    """Decision (strict claim completion): ``[A, C]`` for a claim owning ``{A, B}`` is refused.

    The seed compared counts only (2 == 2), deleted A and left B claimed.
    """
    fence = hold(store)
    q = claim_batches_after_enqueue(store, fence)
    a, b = (x.batch_id for x in q.batches)
    c_batch = enqueue(store, qdraft(n=7)).batch_id
    before = snapshot(store)
    for ids in ([a, c_batch], [a], [a, b, b], [a, b, c_batch]):
        wrong = QueuedWorkCompletion(
            session_id=SID, claim_id=q.claim_id, lease_token=q.lease_token, batch_ids=tuple(ids)
        )
        with pytest.raises(QueuedWorkClaimSuperseded):
            commit(store, _loaded_commit(fence, completed_queue_claims=(wrong,)))
        assert snapshot(store) == before
    # Exactly the owned set (any order) completes: both rows and their items are deleted.
    right = q.completion().model_copy(update={"batch_ids": (b, a)})
    commit(store, mk(fence, completed_queue_claims=(right,)))
    left = query(store, "SELECT batch_id FROM queued_work_batches")
    assert [r["batch_id"] for r in left] == [c_batch]
    assert (
        query(store, "SELECT batch_id FROM queued_work_items WHERE batch_id <> :c", c=c_batch) == []
    )


def test_c_15_a_queue_completion_for_another_session_is_superseded(store: Store) -> None:
    fence = hold(store)
    hold(store, B, sid=OTHER)
    foreign = QueuedWorkCompletion(
        session_id=OTHER, claim_id="qwc:1:1", lease_token="tok", batch_ids=("b",)
    )
    before = snapshot(store)
    with pytest.raises(QueuedWorkClaimSuperseded) as info:
        commit(store, _loaded_commit(fence, completed_queue_claims=(foreign,)))
    assert (info.value.session_id, info.value.claim_id) == (OTHER, "qwc:1:1")
    assert snapshot(store) == before


def test_q_25_a_commit_deletes_only_rows_its_claim_still_owns(store: Store) -> None:
    fence = hold(store)
    q = claim_batches_after_enqueue(store, fence, 2)
    unclaimed = enqueue(store, qdraft(n=5))
    result = commit(store, mk(fence, completed_queue_claims=(q.completion(),)))
    assert result.head_revision == 1
    left = store.queue.list_queued_work(SID)
    assert [b.batch_id for b in left] == [unclaimed.batch_id]


# --------------------------------------------------------------------------
# Turn-input claims (C-16, C-17)


def test_c_16_completing_an_active_turn_claim(store: Store) -> None:
    fence = hold(store)
    i1, i2 = enqueue(store, input_draft("T")), enqueue(store, input_draft("T"))
    claim = claim_active(store, fence)
    assert [i.input_id for i in claim.inputs] == [i1.input_id, i2.input_id]
    commit(store, mk(fence, completed_turn_input_claims=(claim.completion(),)))
    for item in (i1, i2):
        row = input_row(store, item.input_id)
        assert row["state"] == "completed"
        assert (row["claim_id"], row["claim_token"], row["claim_owner_id"]) == (None, None, None)
        assert row["claim_session_lease_generation"] == 0
        assert row["claim_fencing_token"] == 1  # kept


def test_c_17_completing_a_next_turn_claim(store: Store) -> None:
    fence = hold(store)
    item = enqueue(store, input_draft(None))
    claim = store.turn_inputs.claim_next_turn_inputs(SID, fence, A, 5)
    assert claim is not None
    assert input_row(store, item.input_id)["state"] == "deferred_next_turn"
    commit(store, mk(fence, completed_turn_input_claims=(claim.completion(),)))
    row = input_row(store, item.input_id)
    assert (row["state"], row["claim_token"], row["claim_fencing_token"]) == ("completed", None, 1)


def test_turn_input_completion_must_name_exactly_the_owned_inputs(
    store: Store, clock: SettableClock
) -> None:
    fence = hold(store)
    i1, _ = enqueue(store, input_draft("T")), enqueue(store, input_draft("T"))
    claim = claim_active(store, fence)
    before = snapshot(store)
    partial = claim.completion().model_copy(update={"input_ids": (i1.input_id,)})
    foreign = claim.completion().model_copy(update={"session_id": OTHER})
    for bad in (partial, foreign):
        with pytest.raises(TurnInputClaimSuperseded) as info:
            commit(store, _loaded_commit(fence, completed_turn_input_claims=(bad,)))
        assert info.value.session_id == bad.session_id
        assert snapshot(store) == before


def test_a_new_generation_may_complete_an_orphaned_claim(
    store: Store, clock: SettableClock
) -> None:
    """§2.4 notes: completion checks (claim_id, token), not the claim's generation."""
    old = hold(store)
    item = enqueue(store, input_draft("T"))
    claim = claim_active(store, old)
    new = take_over(store, clock)
    commit(store, mk(new, completed_turn_input_claims=(claim.completion(),)))
    assert input_row(store, item.input_id)["state"] == "completed"


# --------------------------------------------------------------------------
# The graph (C-18, C-19, I-12, M-03, M-04, M-09)


def test_c_18_appending_an_existing_node_id_fails_typed(store: Store) -> None:
    """Decision (brief): a duplicate node id is ``NodeAlreadyExists`` (a ``Duplicate``).

    The spec surfaces the unique violation as ``Backend``; nothing persists either way.
    """
    fence = hold(store)
    commit(store, mk(fence, nodes=(node("n1"),)))
    add_attachment(store)
    before = snapshot(store)
    for nodes in ((node("n2", "n1"), node("n1")), (node("n3"), node("n3"))):
        with pytest.raises(NodeAlreadyExists) as info:
            commit(store, _loaded_commit(fence, nodes=nodes))
        assert isinstance(info.value, Duplicate)
        assert info.value.session_id == SID
        assert info.value.node_id == nodes[-1].node_id
        assert snapshot(store) == before
    assert head_revision(store) == 1


def test_a_long_delta_is_inserted_in_order_and_a_late_duplicate_fails(store: Store) -> None:
    """Nodes go in multi-row inserts of at most 16: 40 nodes are three statements.

    The graph keeps the delta's order (insertion order), and a duplicate in
    the last statement of an id the first inserted is ``NodeAlreadyExists``
    naming it, with nothing of the commit kept.
    """
    fence = hold(store)
    many = tuple(node(f"m{i}", f"m{i - 1}" if i else None) for i in range(40))
    commit(store, mk(fence, nodes=many))
    assert [n.node_id for n in loaded(store).graph.nodes] == [n.node_id for n in many]
    before = snapshot(store)
    late = (*(node(f"k{i}") for i in range(34)), node("k3"), node("k40"))
    with pytest.raises(NodeAlreadyExists) as info:
        commit(store, mk(fence, nodes=late))
    assert info.value.node_id == "k3"
    assert snapshot(store) == before


def test_a_failed_commit_caught_inside_call_write_leaves_nothing(store: Store) -> None:
    """``store.call_write(fn)``: ``fn`` may catch an operation's error and still commit.
    A commit that fails after some of its writes (here the last of its nodes is a
    duplicate, found after the blob, usage and first node were written) must leave
    none of them: the commit runs in a SAVEPOINT there, while the one-call form,
    whose error always ends the unit, needs none."""
    fence = hold(store)
    commit(store, mk(fence, nodes=(node("n1"),)))
    add_attachment(store)
    before = snapshot(store)
    caught: list[BaseException] = []

    def fn(r: Any) -> str:
        try:
            r.commits.commit_runtime_state(
                _loaded_commit(fence, nodes=(node("n2", "n1"), node("n1")))
            )
        except NodeAlreadyExists as exc:
            caught.append(exc)
        return "committed"

    assert store.call_write(fn) == "committed"
    assert len(caught) == 1
    assert snapshot(store) == before
    assert head_revision(store) == 1
    with pytest.raises(NodeAlreadyExists):  # the one-call form: the unit rolls back
        store.commits.commit_runtime_state(
            _loaded_commit(fence, nodes=(node("n2", "n1"), node("n1")))
        )
    assert snapshot(store) == before


def test_c_19_replace_full_replaces_the_sessions_nodes_only(store: Store) -> None:
    fence = hold(store)
    other = hold(store, B, sid=OTHER)
    commit(store, mk(other, sid=OTHER, nodes=(node("o1"),)))
    chain = tuple(node(f"n{i}", f"n{i - 1}" if i else None) for i in range(5))
    commit(store, mk(fence, nodes=chain))
    execute_sql(
        store,
        "UPDATE graph_nodes SET tombstoned = 1 WHERE session_id = :s AND node_id IN ('n1', 'n3')",
        s=SID,
    )
    new = SessionGraph(nodes=(node("r1"), node("r2", "r1"), node("n1", "r2")), leaf_node_id="n1")
    commit(store, mk(fence, graph=ReplaceFullGraph(graph=new)))

    stored = query(
        store,
        "SELECT node_id, tombstoned FROM graph_nodes WHERE session_id = :s ORDER BY seq",
        s=SID,
    )
    assert stored == [
        {"node_id": "r1", "tombstoned": 0},
        {"node_id": "r2", "tombstoned": 0},
        {"node_id": "n1", "tombstoned": 0},
    ]
    got = loaded(store)
    assert got.graph == new
    (head,) = query(store, "SELECT * FROM session_head WHERE session_id = :s", s=SID)
    assert (head["graph_node_count"], head["leaf_node_id"]) == (3, "n1")
    assert [n.node_id for n in loaded(store, OTHER).graph.nodes] == ["o1"]


def test_replace_full_with_a_duplicate_inside_the_graph_fails(store: Store) -> None:
    fence = hold(store)
    commit(store, mk(fence, nodes=(node("n1"),)))
    before = snapshot(store)
    bad = SessionGraph(nodes=(node("x"), node("x")), leaf_node_id="x")
    with pytest.raises(NodeAlreadyExists):
        commit(store, mk(fence, graph=ReplaceFullGraph(graph=bad)))
    assert snapshot(store) == before


def test_node_count_excludes_tombstoned_nodes(store: Store) -> None:
    fence = hold(store)
    commit(store, mk(fence, nodes=(node("a"), node("b", "a"), node("c", "b"))))
    # Tombstoning goes through the API: the head's live-node count is kept
    # incrementally (commits never count the graph), and tombstone_nodes
    # decrements it in the same transaction.
    store.maintenance.tombstone_nodes(SID, ["b"])
    (head,) = query(store, "SELECT graph_node_count FROM session_head")
    assert head["graph_node_count"] == 2
    commit(store, mk(fence, nodes=(node("d", "c"),)))
    (head,) = query(store, "SELECT graph_node_count FROM session_head")
    assert head["graph_node_count"] == 3


def test_unchanged_graph_moves_only_the_leaf(store: Store) -> None:
    fence = hold(store)
    commit(store, mk(fence, nodes=(node("a"), node("b", "a"), node("c", "a"))))
    commit(store, mk(fence, graph=UnchangedGraph(leaf_node_id="b")))
    got = loaded(store)
    assert [n.node_id for n in got.graph.nodes] == ["a", "b", "c"]
    assert got.graph.leaf_node_id == "b"
    assert path_ids(store) == ["a", "b"]


def test_i_12_tombstoned_nodes_are_invisible_to_every_read(store: Store) -> None:
    fence = hold(store)
    commit(store, mk(fence, nodes=(node("a"), node("b", "a"), node("c", "b"))))
    execute_sql(store, "UPDATE graph_nodes SET tombstoned = 1 WHERE node_id = 'c'")
    assert store.call_read(lambda r: r.commits.load_node(SID, "c")) is None
    assert [n.node_id for n in loaded(store).graph.nodes] == ["a", "b"]
    assert loaded(store).graph.leaf_node_id == "c"  # the head's leaf, even if not visible
    assert path_ids(store) == []  # the walk starts at a tombstoned leaf
    assert path_ids(store, "b") == ["a", "b"]


def test_m_03_active_path_stops_at_a_tombstoned_ancestor(store: Store) -> None:
    fence = hold(store)
    chain = (node("root"), node("a", "root"), node("b", "a"), node("L", "b"), node("x", "root"))
    commit(store, mk(fence, nodes=chain, leaf="L"))
    assert path_ids(store) == ["root", "a", "b", "L"]
    execute_sql(store, "UPDATE graph_nodes SET tombstoned = 1 WHERE node_id = 'a'")
    assert path_ids(store) == ["b", "L"]
    execute_sql(store, "DELETE FROM graph_nodes WHERE node_id = 'b'")  # a missing ancestor
    assert path_ids(store) == ["L"]


def test_m_04_active_path_leaf_defaults_to_the_head_and_may_be_missing(store: Store) -> None:
    fence = hold(store)
    nodes = (node("r"), node("m", "r"), node("L", "m"), node("s", "r"))
    commit(store, mk(fence, nodes=nodes, leaf="L"))
    got = loaded(store, scope=ActivePathScope())
    assert [n.node_id for n in got.graph.nodes] == ["r", "m", "L"]
    assert got.graph.leaf_node_id == "L"
    assert path_ids(store, "s") == ["r", "s"]
    missing = loaded(store, scope=ActivePathScope(leaf_node_id="X"))
    assert missing.graph == SessionGraph(nodes=(), leaf_node_id="X")
    commit(store, mk(fence, graph=UnchangedGraph(leaf_node_id=None)))
    no_leaf = loaded(store, scope=ActivePathScope())
    assert no_leaf.graph == SessionGraph(nodes=(), leaf_node_id=None)


def test_m_05_load_session_on_an_empty_store_is_none(store: Store) -> None:
    assert load(store) is None
    assert load(store, scope=ActivePathScope()) is None
    assert head_revision(store) == 0
    hold(store)
    assert load(store) is None  # a lease alone is no head


def test_m_09_an_undecodable_node_is_none_and_skipped(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    fence = hold(store)
    commit(store, mk(fence, nodes=(node("a"), node("b", "a"), node("c", "b"))))
    execute_sql(store, "UPDATE graph_nodes SET node_json = '{not json' WHERE node_id = 'b'")
    with caplog.at_level(logging.WARNING, logger="agentkeep.sessions"):
        assert store.call_read(lambda r: r.commits.load_node(SID, "b")) is None
        assert [n.node_id for n in loaded(store).graph.nodes] == ["a", "c"]
        # the walk continues through the undecodable node (the parent column is intact)
        assert path_ids(store) == ["a", "c"]
    warnings = [r for r in caplog.records if "graph_nodes" in r.getMessage()]
    assert len(warnings) == 1, "a warning once per row"
    assert store.call_read(lambda r: r.commits.load_node(SID, "a")) == node("a")
    assert store.call_read(lambda r: r.commits.load_node(SID, "zz")) is None


def test_a_node_whose_json_names_another_id_is_undecodable(store: Store) -> None:
    fence = hold(store)
    commit(store, mk(fence, nodes=(node("a"),)))
    execute_sql(
        store, "UPDATE graph_nodes SET node_json = :j WHERE node_id = 'a'", j='{"node_id":"b"}'
    )
    assert store.call_read(lambda r: r.commits.load_node(SID, "a")) is None


def test_a_parent_cycle_on_the_path_is_corrupt(store: Store) -> None:
    fence = hold(store)
    commit(store, mk(fence, nodes=(node("a"), node("b", "a"))))
    execute_sql(store, "UPDATE graph_nodes SET parent_node_id = 'b' WHERE node_id = 'a'")
    with pytest.raises(SessionCorrupt) as info:
        load(store, scope=ActivePathScope())
    assert (info.value.table, info.value.column) == ("graph_nodes", "parent_node_id")


def _fill_graph(store: Store, backend: str, start: int, stop: int) -> None:
    """Raw-insert filler nodes ``f<start>..f<stop-1>`` into SID (children of the path nodes)."""
    values = "SELECT :s, 'f' || i, 'p' || (i - (i / 10) * 10), :pre || i || :post, 0"
    if backend == "sqlite":
        sql = (
            "INSERT INTO graph_nodes (session_id, node_id, parent_node_id, node_json, tombstoned) "
            "WITH RECURSIVE n(i) AS (SELECT :a UNION ALL SELECT i + 1 FROM n WHERE i + 1 < :b) "
            f"{values} FROM n"
        )
    else:
        sql = (
            "INSERT INTO graph_nodes (session_id, node_id, parent_node_id, node_json, tombstoned) "
            f"{values} FROM generate_series(CAST(:a AS integer), CAST(:b AS integer) - 1) AS i"
        )
    post = '","payload":null,"timestamp":0}'
    execute_sql(store, sql, s=SID, a=start, b=stop, pre='{"node_id":"f', post=post)
    if backend == "postgres":
        execute_sql(store, "ANALYZE graph_nodes")


def _path_plan(store: Store) -> str:
    """The plan of the active-path statement exactly as the store compiles and binds it."""
    with store.read() as uow:
        got = explain(uow, ACTIVE_PATH, {"sid": SID, "leaf": "p9"})
    return "\n".join(" ".join(str(v) for v in r) for r in got)


def _sqlite_steps(store: Store) -> int:
    """SQLite VM instructions spent by the active-path query (timing-independent)."""
    raw: Any = store.engine.raw_connection()
    try:
        driver = raw.driver_connection
        steps = [0]

        def tick() -> int:
            steps[0] += 1
            return 0

        driver.set_progress_handler(tick, 1)
        try:
            form = ACTIVE_PATH.compiled(CompileTarget.of(store.engine.dialect))
            found = driver.execute(form.sql, form.bind({"sid": SID, "leaf": "p9"})).fetchall()
        finally:
            driver.set_progress_handler(None, 1)
        assert len(found) == 10
        return steps[0]
    finally:
        raw.close()


def test_active_path_cost_follows_the_path_not_the_graph(store: Store, backend: str) -> None:
    """1k vs 100k nodes: the same 10-node path; each step looks up (session_id, node_id)."""
    fence = hold(store)
    chain = tuple(node(f"p{i}", f"p{i - 1}" if i else None) for i in range(10))
    commit(store, mk(fence, nodes=chain))
    _fill_graph(store, backend, 0, 1_000)
    small = path_ids(store)
    small_steps = _sqlite_steps(store) if backend == "sqlite" else 0
    _fill_graph(store, backend, 1_000, 100_000)
    assert path_ids(store) == small == [f"p{i}" for i in range(10)]

    plan = _path_plan(store)
    if backend == "sqlite":
        assert "sqlite_autoindex_graph_nodes_1" in plan, plan
        assert "SCAN g" not in plan and "SCAN graph_nodes" not in plan, plan
        big_steps = _sqlite_steps(store)
        assert big_steps < small_steps * 2, (small_steps, big_steps)
    else:
        assert "uq_graph_nodes_session_id_node_id" in plan, plan
        assert "Seq Scan on graph_nodes" not in plan, plan


# --------------------------------------------------------------------------
# Interrupted turns, attachments, enqueued work (C-20..C-24)


def test_c_20_an_interrupted_turn_defers_its_pending_inputs(store: Store) -> None:
    fence = hold(store)
    a1 = enqueue(store, input_draft("T"))
    claim_active(store, fence, "T", 1)  # a1 → accepted
    p1 = enqueue(store, input_draft("T", key="k1"))
    # p1 is claimed and abandoned once, so it carries a per-row counter.
    abandoned = claim_active(store, fence, "T", 1)
    store.turn_inputs.abandon_turn_input_claim(abandoned)
    p2 = enqueue(store, input_draft("U"))
    other = enqueue(store, input_draft("T", sid=OTHER))
    before = {i.input_id: input_row(store, i.input_id) for i in (a1, p1, p2, other)}

    commit(store, mk(fence, interrupted_turn_input_turn_id="T"))

    row = input_row(store, p1.input_id)
    assert row["state"] == "deferred_next_turn"
    assert row["ingress_json"] == '{"scope":"next_turn"}'
    assert row["submitted_ingress_json"] == before[p1.input_id]["submitted_ingress_json"]
    assert (row["claim_id"], row["claim_token"], row["claim_owner_id"]) == (None, None, None)
    assert row["claim_session_lease_generation"] == 0
    assert row["claim_fencing_token"] == before[p1.input_id]["claim_fencing_token"] == 1
    for untouched in (a1, p2, other):
        assert input_row(store, untouched.input_id) == before[untouched.input_id]
    assert before[a1.input_id]["state"] == "accepted"
    # Source-key idempotency still recognises the original draft (submitted ingress kept).
    assert enqueue(store, input_draft("T", key="k1")).input_id == p1.input_id


def test_a_corrupt_ingress_fails_an_interrupting_commit(store: Store) -> None:
    fence = hold(store)
    item = enqueue(store, input_draft("T"))
    execute_sql(
        store,
        "UPDATE pending_turn_inputs SET ingress_json = 'nope' WHERE input_id = :i",
        i=item.input_id,
    )
    before = snapshot(store)
    with pytest.raises(SessionCorrupt) as info:
        commit(store, _loaded_commit(fence, interrupted_turn_input_turn_id="T"))
    assert (info.value.key, info.value.column) == (item.input_id, "ingress_json")
    assert snapshot(store) == before


def test_c_21_i_11_the_first_commit_stamps_an_attachment(
    store: Store, clock: SettableClock
) -> None:
    fence = hold(store)
    add_attachment(store, "att1")
    assert query(store, "SELECT committed_at_ms FROM attachment_manifest") == [
        {"committed_at_ms": None}
    ]
    first = clock.advance(10)
    commit(store, mk(fence, committed_attachment_ids=("att1",)))
    clock.advance(10)
    commit(store, mk(fence, committed_attachment_ids=("att1",)))
    (row,) = query(store, "SELECT committed_at_ms FROM attachment_manifest")
    assert row["committed_at_ms"] == first


def test_c_22_an_attachment_of_another_session_is_ignored(store: Store) -> None:
    fence = hold(store)
    add_attachment(store, "att1", sid=OTHER)
    before = query(store, "SELECT * FROM attachment_manifest")
    commit(store, mk(fence, committed_attachment_ids=("att1", "unknown")))
    assert query(store, "SELECT * FROM attachment_manifest") == before
    assert head_revision(store) == 1


def test_c_23_a_draft_for_another_session_rolls_the_commit_back(store: Store) -> None:
    fence = hold(store)
    q = claim_batches_after_enqueue(store, fence)
    item = enqueue(store, input_draft("T"))
    add_attachment(store)
    before = snapshot(store)
    c = _loaded_commit(
        fence,
        completed_queue_claims=(q.completion(),),
        interrupted_turn_input_turn_id="T",
    ).model_copy(update={"enqueued_queue_batches": (qdraft(n=1), qdraft(sid=OTHER, n=2))})
    with pytest.raises(SessionBindingMismatch) as info:
        commit(store, c)
    assert (info.value.bound_session_id, info.value.attempted_session_id) == (SID, OTHER)
    assert snapshot(store) == before
    assert input_row(store, item.input_id)["state"] == "pending_active"


def test_c_24_two_drafts_in_one_commit_get_distinct_ids(store: Store, clock: SettableClock) -> None:
    fence = hold(store)
    result = commit(store, mk(fence, enqueued_queue_batches=(qdraft(n=1), qdraft(n=2))))
    first, second = result.enqueued_queue_batches
    assert first.batch_id != second.batch_id
    assert first.enqueue_seq < second.enqueue_seq
    assert first.enqueued_at_ms == second.enqueued_at_ms == clock.now_ms()
    assert [i.payload.body for b in result.enqueued_queue_batches for i in b.items] == [1, 2]
    assert store.queue.list_queued_work(SID) == [first, second]


def test_an_enqueued_source_key_with_other_content_fails_the_commit(store: Store) -> None:
    fence = hold(store)
    enqueue(store, qdraft(n=1, key="k"))
    before = snapshot(store)
    with pytest.raises(QueuedWorkSourceKeyConflict):
        commit(
            store,
            _loaded_commit(fence).model_copy(
                update={"enqueued_queue_batches": (qdraft(n=2, key="k"),)}
            ),
        )
    assert snapshot(store) == before


# --------------------------------------------------------------------------
# The ledger (C-25, C-26)


def test_c_25_the_ledger_merges_by_source_and_model(store: Store) -> None:
    fence = hold(store)
    commit(
        store,
        mk(fence, usage_deltas=(usage(input_tokens=10), usage("other", "m", output_tokens=1))),
    )
    commit(store, mk(fence, usage_deltas=(usage(input_tokens=5, cache_read_input_tokens=2),)))
    commit(store, mk(fence, usage_deltas=(usage("r", "m", reasoning_output_tokens=40),)))
    commit(store, mk(fence, usage_deltas=(usage(reasoning_output_tokens=3, output_tokens=1),)))
    assert loaded(store).token_ledger == (
        UsageLedgerEntry(
            source="src",
            model="m",
            usage=TokenUsage(
                input_tokens=15,
                output_tokens=1,
                cache_read_input_tokens=2,
                reasoning_output_tokens=3,
            ),
        ),
        UsageLedgerEntry(source="other", model="m", usage=TokenUsage(output_tokens=1)),
    )
    assert len(query(store, "SELECT seq FROM usage_deltas")) == 5  # the raw rows are all kept


def test_c_26_the_same_unstamped_commit_twice_double_counts(store: Store) -> None:
    """Decision: kept as the seed does — without a turn stamp there is no idempotency."""
    fence = hold(store)
    c = mk(fence, usage_deltas=(usage(input_tokens=10),))
    assert commit(store, c).head_revision == 1
    assert commit(store, c).head_revision == 2
    (entry,) = loaded(store).token_ledger
    assert entry.usage.input_tokens == 20


def test_the_load_reads_the_totals_the_commit_kept_not_the_usage_rows(store: Store) -> None:
    """The ledger is the commit-kept totals: a later change to ``usage_deltas`` is not read."""
    fence = hold(store)
    commit(store, mk(fence, usage_deltas=(usage(input_tokens=1), usage(input_tokens=2))))
    execute_sql(store, "UPDATE usage_deltas SET output_tokens = -5 WHERE input_tokens = 2")
    execute_sql(store, "DELETE FROM usage_deltas WHERE input_tokens = 1")
    (entry,) = loaded(store).token_ledger
    assert entry.usage == TokenUsage(input_tokens=3)


def test_a_commit_past_the_ledger_maximum_is_refused_and_writes_nothing(store: Store) -> None:
    """Decision: refused with ``UsageLedgerOverflow`` (the ledger stays exact), never saturated.

    Within one commit, and across commits (the stored sums plus the new
    deltas): the refused commit writes nothing and the session still loads.
    """
    fence = hold(store)
    big = 2**63 - 1
    with pytest.raises(UsageLedgerOverflow) as info:
        commit(store, mk(fence, usage_deltas=(usage(input_tokens=big), usage(input_tokens=1))))
    assert (info.value.session_id, info.value.counter) == (SID, "input_tokens")
    assert isinstance(info.value, InvalidInput)
    assert load(store) is None  # the first commit wrote nothing, not even its checkpoint
    commit(store, mk(fence, usage_deltas=(usage(input_tokens=big - 5), usage(output_tokens=3))))
    before = snapshot(store)
    for over in (
        mk(fence, nodes=(node("n1"),), usage_deltas=(usage(input_tokens=6),)),
        mk(fence, usage_deltas=(usage(input_tokens=3), usage(input_tokens=3))),
        mk(
            fence,
            usage_deltas=(
                usage(output_tokens=1, reasoning_output_tokens=big),
                usage(output_tokens=1, reasoning_output_tokens=1),
            ),
        ),
    ):
        with pytest.raises(UsageLedgerOverflow):
            commit(store, over)
        assert snapshot(store) == before
    (entry,) = loaded(store).token_ledger
    assert (entry.usage.input_tokens, entry.usage.output_tokens) == (big - 5, 3)
    # At the maximum exactly is accepted; another (source, model) pair has its own counters;
    # a delta whose total() is 0 is not merged, so it cannot overflow the ledger.
    commit(store, mk(fence, usage_deltas=(usage(input_tokens=5), usage("other", input_tokens=big))))
    commit(store, mk(fence, usage_deltas=(usage(reasoning_output_tokens=big),)))
    ledger = {(e.source, e.model): e.usage.input_tokens for e in loaded(store).token_ledger}
    assert ledger == {("src", "m"): big, ("other", "m"): big}


@pytest.mark.parametrize(
    ("column", "value"),
    [("input_tokens", -1), ("output_tokens", "'x'"), ("ordinal", -3), ("source", "NULL")],
)
def test_a_corrupt_ledger_total_fails_the_load(store: Store, column: str, value: str) -> None:
    fence = hold(store)
    commit(store, mk(fence, usage_deltas=(usage(input_tokens=1),)))
    if column == "source":  # NOT NULL on both backends: a blob key (SQLite) or skip
        if store.engine.dialect.name != "sqlite":
            pytest.skip("Postgres keeps the text type of the column")
        value = "x'00'"
    if column == "output_tokens" and store.engine.dialect.name != "sqlite":
        pytest.skip("Postgres keeps the integer type of the column")
    execute_sql(store, f"UPDATE session_usage_totals SET {column} = {value}")
    with pytest.raises(SessionCorrupt) as info:
        load(store)
    assert (info.value.table, info.value.column) == ("session_usage_totals", column)
    with pytest.raises(SessionCorrupt):
        load(store, scope=HeadScope())


def test_a_ledger_total_past_the_bigint_maximum_is_refused_and_nothing_changes(
    store: Store,
) -> None:
    fence = hold(store)
    big = 2**63 - 1
    commit(store, mk(fence, usage_deltas=(usage(input_tokens=big),)))
    before = loaded(store)
    rows = query(store, "SELECT * FROM usage_deltas ORDER BY seq")
    with pytest.raises(UsageLedgerOverflow) as info:
        commit(store, mk(fence, usage_deltas=(usage(output_tokens=1), usage(input_tokens=1))))
    assert (info.value.source, info.value.model, info.value.counter) == ("src", "m", "input_tokens")
    assert loaded(store) == before
    assert query(store, "SELECT * FROM usage_deltas ORDER BY seq") == rows


# --------------------------------------------------------------------------
# Auto-GC through the facade (C-27)


def test_c_27_auto_gc_runs_every_n_successful_facade_commits(
    db_url: str, clock: SettableClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decision: the facade keeps its own commit counter (not shared with id nonces, §0.5).

    With ``auto_gc_every_commits=2``, GC runs after the 2nd and 4th successful
    commits (a replay counts; a failed commit does not; enqueues do not shift it).
    """
    gc_runs = [0]
    real = MaintenanceRepository.gc_unreachable

    def counting(self: MaintenanceRepository) -> GcReport:
        gc_runs[0] += 1
        return real(self)

    monkeypatch.setattr(MaintenanceRepository, "gc_unreachable", counting)
    with Store.open(db_url, clock=clock, auto_gc_every_commits=2) as s:
        calls = SessionCalls(s)
        fence = hold(s)
        c1 = mk(fence, turn_commit=stamp("t1"), enqueued_queue_batches=(qdraft(), qdraft(n=2)))
        calls.commit_runtime_state(c1)
        assert gc_runs == [0]
        calls.commit_runtime_state(c1)  # a replay is a successful commit
        assert gc_runs == [1]
        with pytest.raises(HeadRevisionConflict):
            calls.commit_runtime_state(mk(fence, expected=9))
        s.queue.enqueue_queued_work(qdraft(n=3))  # enqueues do not shift the cadence
        calls.commit_runtime_state(mk(fence))
        assert gc_runs == [1]
        calls.commit_runtime_state(mk(fence))
        assert gc_runs == [2]
        # commits inside a caller's unit neither count nor collect
        with s.write() as uow:
            uow.commits.commit_runtime_state(mk(fence))
        calls.commit_runtime_state(mk(fence))
        assert gc_runs == [2]
        calls.commit_runtime_state(mk(fence))
        assert gc_runs == [3]


def test_c_27_auto_gc_deletes_an_orphan_blob_after_the_nth_commit(
    db_url: str, clock: SettableClock
) -> None:
    with Store.open(db_url, clock=clock, auto_gc_every_commits=2) as s:
        calls = SessionCalls(s)
        fence = hold(s)
        execute_sql(
            s,
            "INSERT INTO blobs (hash, kind, compression, content) "
            "VALUES ('orphan', 'x', 'none', :c)",
            c=b"{}",
        )
        first = calls.commit_runtime_state(
            mk(fence, checkpoint=HydratedSessionCheckpoint(turn_state=1))
        )
        assert {r["hash"] for r in query(s, "SELECT hash FROM blobs")} == {
            "orphan",
            first.checkpoint_ref,
        }
        second = calls.commit_runtime_state(
            mk(fence, checkpoint=HydratedSessionCheckpoint(turn_state=2))
        )
        # GC ran after the 2nd commit: the orphan and the superseded manifest are gone.
        assert {r["hash"] for r in query(s, "SELECT hash FROM blobs")} == {second.checkpoint_ref}


def test_auto_gc_errors_never_fail_the_commit(
    db_url: str, clock: SettableClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(self: MaintenanceRepository) -> GcReport:
        raise DatabaseError("gc exploded")

    monkeypatch.setattr(MaintenanceRepository, "gc_unreachable", broken)
    with Store.open(db_url, clock=clock, auto_gc_every_commits=1) as s:
        calls = SessionCalls(s)
        fence = hold(s)
        assert calls.commit_runtime_state(mk(fence)).head_revision == 1
        assert calls.get_head_revision(SID) == 1


def test_a_replay_after_gc_names_a_blob_that_still_exists(store: Store) -> None:
    """GC roots include the checkpoints named by turn-commit records (spec/README.md)."""
    fence = hold(store)
    c = mk(fence, turn_commit=stamp("t1"), checkpoint=HydratedSessionCheckpoint(tool_state="old"))
    original = commit(store, c)
    commit(store, mk(fence, checkpoint=HydratedSessionCheckpoint(tool_state="new")))
    report = store.call_write(lambda r: r.maintenance.gc_unreachable_strict())
    assert report.deleted_blob_count == 0
    replayed = commit(store, c)
    assert replayed == original
    present = {r["hash"] for r in query(store, "SELECT hash FROM blobs")}
    assert {replayed.checkpoint_ref, replayed.manifest.tool_state_ref} <= present


def test_without_an_interval_the_facade_never_collects(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    def never(self: MaintenanceRepository) -> GcReport:
        raise AssertionError("GC must not run")

    monkeypatch.setattr(MaintenanceRepository, "gc_unreachable", never)
    calls = SessionCalls(store)
    fence = hold(store)
    for _ in range(3):
        calls.commit_runtime_state(mk(fence))
    assert calls.get_head_revision(SID) == 3


# --------------------------------------------------------------------------
# Checkpoints (M-06) and corrupt stored data


def test_m_06_a_deleted_checkpoint_blob_reads_as_none(store: Store) -> None:
    fence = hold(store)
    result = commit(store, mk(fence, checkpoint=HydratedSessionCheckpoint(turn_state={"x": 1})))
    execute_sql(store, "DELETE FROM blobs WHERE hash = :h", h=result.checkpoint_ref)
    got = loaded(store)
    assert got.checkpoint is None
    assert got.checkpoint_ref == result.checkpoint_ref


def test_a_corrupt_manifest_fails_the_load(store: Store) -> None:
    fence = hold(store)
    result = commit(store, mk(fence))
    execute_sql(
        store,
        "UPDATE blobs SET content = :c WHERE hash = :h",
        c=b"garbage",
        h=result.checkpoint_ref,
    )
    with pytest.raises(SessionCorrupt) as info:
        load(store)
    assert (info.value.table, info.value.key) == ("blobs", result.checkpoint_ref)


@pytest.mark.parametrize(
    ("column", "value"),
    [("schema_version", 99), ("config_json", "{bad"), ("agent_frames_json", '{"a":1}')],
)
def test_a_corrupt_head_fails_the_load(store: Store, column: str, value: Any) -> None:
    fence = hold(store)
    commit(store, mk(fence))
    execute_sql(store, f"UPDATE session_head SET {column} = :v", v=value)
    with pytest.raises(SessionCorrupt) as info:
        load(store)
    assert (info.value.table, info.value.key, info.value.column) == ("session_head", SID, column)


def test_blob_profile_compresses_but_the_hash_is_over_the_plain_bytes(store: Store) -> None:
    fence = hold(store)
    big = {"text": "x" * 2_000}
    balanced = commit(store, mk(fence, checkpoint=HydratedSessionCheckpoint(tool_state=big)))
    compact = commit(
        store,
        mk(fence, checkpoint=HydratedSessionCheckpoint(tool_state=big)),
        blob_profile=BlobProfile.COMPACT,
    )
    assert balanced.checkpoint_ref == compact.checkpoint_ref
    ref = balanced.manifest.tool_state_ref
    (row,) = query(store, "SELECT compression FROM blobs WHERE hash = :h", h=ref)
    assert row["compression"] == "none"  # first writer wins (insert-or-ignore); 2 KB < 4 KiB
    other = commit(
        store,
        mk(fence, checkpoint=HydratedSessionCheckpoint(tool_state={"text": "y" * 2_000})),
        blob_profile=BlobProfile.COMPACT,
    )
    (row,) = query(
        store, "SELECT compression FROM blobs WHERE hash = :h", h=other.manifest.tool_state_ref
    )
    assert row["compression"] == "zlib"
    cp = loaded(store).checkpoint
    assert cp is not None and cp.tool_state == {"text": "y" * 2_000}


# --------------------------------------------------------------------------
# Units of work: savepoint, read units, bad input


def test_a_caught_commit_error_keeps_the_callers_earlier_work(store: Store) -> None:
    fence = hold(store)
    commit(store, mk(fence))
    late_failure = _loaded_commit(fence, enqueued_queue_batches=(qdraft(sid=OTHER),))
    with store.write() as uow:
        batch = uow.queue.enqueue_queued_work(qdraft(n=1))
        with pytest.raises(HeadRevisionConflict):  # fails before its first write
            uow.commits.commit_runtime_state(_loaded_commit(fence, expected=0))
        with pytest.raises(SessionBindingMismatch):  # fails after all its other writes
            uow.commits.commit_runtime_state(late_failure)
        # the unit is still usable, and the failed commits left nothing
        assert uow.commits.get_head_revision(SID) == 1
    assert [b.batch_id for b in store.queue.list_queued_work(SID)] == [batch.batch_id]
    assert query(store, "SELECT * FROM usage_deltas") == []
    assert query(store, "SELECT * FROM graph_nodes") == []
    assert query(store, "SELECT * FROM runtime_turn_commits") == []
    assert len(query(store, "SELECT * FROM blobs")) == 1  # the first commit's manifest


def test_a_failing_unit_rolls_back_a_successful_commit(store: Store) -> None:
    fence = hold(store)
    before = snapshot(store)
    with pytest.raises(RuntimeError), store.write() as uow:
        uow.commits.commit_runtime_state(_loaded_commit(fence))
        raise RuntimeError("the caller's later work failed")
    assert snapshot(store) == before


def test_commit_and_reads_in_one_unit_see_each_other(store: Store) -> None:
    fence = hold(store)
    with store.write() as uow:
        uow.commits.commit_runtime_state(mk(fence, nodes=(node("a"),)))
        got = uow.commits.load_session(SID)
        assert got is not None and got.head_revision == 1
        assert uow.commits.load_node(SID, "a") == node("a")


def test_writes_are_refused_in_a_read_unit(store: Store) -> None:
    fence = hold(store)
    meta = SessionMeta(
        session_id=SID, session_name="n", created_at="2024-01-01T00:00:00Z", model="m"
    )
    with store.read() as uow:
        with pytest.raises(ReadOnlyUnitOfWork):
            uow.commits.commit_runtime_state(mk(fence))
        with pytest.raises(ReadOnlyUnitOfWork):
            uow.commits.save_session_meta(meta)
        assert uow.commits.load_session(SID) is None


def _bad_inputs(fence: LeaseFence) -> Iterator[tuple[str, Callable[[], Any]]]:
    yield "blank session", lambda: mk(fence, sid=" ")
    yield "nan config", lambda: mk(fence, config={"x": float("nan")})
    yield "nan node payload", lambda: mk(fence, nodes=(node("a", payload={"x": float("inf")}),))
    yield "blank node id", lambda: mk(fence, nodes=(node(""),))
    yield (
        "bad checkpoint",
        lambda: mk(fence, checkpoint=HydratedSessionCheckpoint(tool_state={"x": float("nan")})),
    )
    yield "blank attachment", lambda: mk(fence, committed_attachment_ids=("",))
    yield (
        "empty completion",
        lambda: mk(
            fence,
            completed_queue_claims=(
                QueuedWorkCompletion(session_id=SID, claim_id="c", lease_token="t", batch_ids=()),
            ),
        ),
    )
    yield (
        "empty draft",
        lambda: mk(
            fence,
            enqueued_queue_batches=(
                QueuedWorkDraft.model_construct(
                    session_id=SID,
                    source_key=None,
                    delivery_policy=qdraft().delivery_policy,
                    slot_policy=qdraft().slot_policy,
                    merge_key=qdraft().merge_key,
                    available_at_ms=0,
                    payloads=(),
                ),
            ),
        ),
    )
    yield "blank stamp", lambda: mk(fence, turn_commit=stamp(" "))


def test_bad_input_is_refused_before_anything_is_written(store: Store) -> None:
    fence = hold(store)
    commit(store, mk(fence, nodes=(node("root"),)))
    before = snapshot(store)
    for name, build in _bad_inputs(fence):
        with pytest.raises(InvalidInput):
            commit(store, build())
        assert snapshot(store) == before, name
    with pytest.raises(InvalidInput):
        store.call_write(lambda r: r.commits.commit_runtime_state("not a commit"))  # type: ignore[arg-type]
    with pytest.raises(InvalidInput):
        commit(store, mk(fence), blob_profile="fast")
    with pytest.raises(InvalidInput):
        load(store, sid="")
    assert snapshot(store) == before


def test_a_release_naming_another_session_is_refused(store: Store) -> None:
    """Choice (module docstring): the release must name the commit's session."""
    fence = hold(store)
    other = hold(store, B, sid=OTHER)
    before = snapshot(store)
    with pytest.raises(SessionBindingMismatch):
        commit(store, _loaded_commit(fence, release_session_execution_lease=other))
    assert snapshot(store) == before


def test_a_commit_may_release_its_own_lease(store: Store) -> None:
    fence = hold(store)
    result = commit(store, mk(fence, release_session_execution_lease=fence))
    assert result.head_revision == 1
    assert store.leases.get_session_execution_lease(SID) is None
    with pytest.raises(SessionExecutionLeaseExpired):
        commit(store, mk(fence))


# --------------------------------------------------------------------------
# Faults injected mid-commit (trigger on an INSERT → nothing of the commit persists)

# (the ``fault_on`` fixture: tests/sessions/conftest.py)


@pytest.mark.parametrize(
    "table", ["usage_deltas", "session_usage_totals", "graph_nodes", "runtime_turn_commits"]
)
@pytest.mark.parametrize("unit", ["one_call", "caller_unit"])
def test_a_fault_mid_commit_leaves_nothing(
    store: Store, fault_on: Callable[[str], None], table: str, unit: str
) -> None:
    fence = hold(store)
    commit(store, mk(fence, nodes=(node("root"),)))
    q = claim_batches_after_enqueue(store, fence)
    enqueue(store, input_draft("T"))
    t_claim = claim_active(store, fence)
    enqueue(store, input_draft("T"))  # pending_active, deferred by the commit
    add_attachment(store)
    before = snapshot(store)
    fault_on(table)
    c = _loaded_commit(
        fence,
        expected=1,
        nodes=(node("n1", "root"), node("n2", "n1")),
        completed_queue_claims=(q.completion(),),
        completed_turn_input_claims=(t_claim.completion(),),
        interrupted_turn_input_turn_id="T",
        release_session_execution_lease=fence,
    )
    if unit == "one_call":
        with pytest.raises(DatabaseError, match="injected fault"):
            commit(store, c)
    else:
        with store.write() as uow:
            with pytest.raises(DatabaseError, match="injected fault"):
                uow.commits.commit_runtime_state(c)
            uow.commits.save_session_meta(
                SessionMeta(session_id=SID, session_name="kept", created_at="t", model="m")
            )
        assert store.call_read(lambda r: r.commits.load_session_meta(SID)) is not None
        execute_sql(store, "DELETE FROM session_meta")
    assert snapshot(store) == before


# --------------------------------------------------------------------------
# Session metadata (§2.9)


def test_session_meta_round_trips_and_upserts(store: Store) -> None:
    assert store.call_read(lambda r: r.commits.load_session_meta(SID)) is None
    meta = SessionMeta(
        session_id=SID,
        session_name="first",
        created_at="2024-05-01T10:00:00Z",
        model="m1",
        cwd="/tmp",
        relation={"parent": "s0", "kind": ["fork"]},
    )
    calls = SessionCalls(store)
    calls.save_session_meta(meta)
    assert calls.load_session_meta(SID) == meta
    renamed = meta.model_copy(update={"session_name": "second", "cwd": None, "relation": None})
    calls.save_session_meta(renamed)
    assert calls.load_session_meta(SID) == renamed
    assert len(query(store, "SELECT * FROM session_meta")) == 1
    assert calls.load_session_meta(OTHER) is None


def test_corrupt_session_meta_is_an_error_not_none(store: Store) -> None:
    calls = SessionCalls(store)
    calls.save_session_meta(
        SessionMeta(session_id=SID, session_name="n", created_at="c", model="m", relation=[1])
    )
    execute_sql(store, "UPDATE session_meta SET relation_json = '[1,'")
    with pytest.raises(SessionCorrupt) as info:
        calls.load_session_meta(SID)
    assert (info.value.table, info.value.key, info.value.column) == (
        "session_meta",
        SID,
        "relation_json",
    )


def test_bad_session_meta_is_refused(store: Store) -> None:
    calls = SessionCalls(store)
    with pytest.raises(InvalidInput):
        calls.save_session_meta(
            SessionMeta(
                session_id=SID, session_name="n", created_at="c", model="m", relation=float("nan")
            )
        )
    with pytest.raises(InvalidInput):
        calls.save_session_meta(
            SessionMeta(session_id="", session_name="n", created_at="c", model="m")
        )
    assert query(store, "SELECT * FROM session_meta") == []


def test_facade_reads(store: Store) -> None:
    calls = SessionCalls(store)
    fence = hold(store)
    calls.commit_runtime_state(mk(fence, nodes=(node("a"), node("b", "a"))))
    assert calls.get_head_revision(SID) == 1
    assert calls.load_node(SID, "b") == node("b", "a")
    got = calls.load_session(SID, ActivePathScope(leaf_node_id="a"))
    assert got is not None and [n.node_id for n in got.graph.nodes] == ["a"]
    full = calls.load_session(SID)
    assert full is not None and len(full.graph.nodes) == 2


def test_merge_helper_is_exported() -> None:
    entries = [
        UsageLedgerEntry(source="s", model="m", usage=TokenUsage(input_tokens=1)),
        UsageLedgerEntry(source="s", model="n", usage=TokenUsage(reasoning_output_tokens=9)),
        UsageLedgerEntry(source="s", model="m", usage=TokenUsage(output_tokens=2)),
    ]
    (merged,) = commits_mod.merge_token_ledger(entries)
    assert merged.usage == TokenUsage(input_tokens=1, output_tokens=2)


# --------------------------------------------------------------------------
# The ledger writes of one commit (Postgres folds the deltas and the totals
# into one statement: 1..4 of each; SQLite and larger shapes one per row)


@pytest.mark.parametrize("deltas", [1, 2, 4, 5, 9])
def test_the_ledger_rows_and_totals_of_commits_of_every_shape(store: Store, deltas: int) -> None:
    """New and existing pairs, zero-total deltas, every shape of the folded statement
    and past it: the raw rows are kept in order and the totals are the running sums."""
    fence = hold(store)
    commit(store, mk(fence, usage_deltas=(usage("p0", input_tokens=1),)))
    expected: dict[tuple[str, str], list[int]] = {("p0", "m"): [1, 0, 0, 0, 0]}
    raw: list[tuple[Any, ...]] = [("p0", "m", 1, 0, 0, 0, 0)]
    for turn in range(3):
        made = []
        for i in range(deltas):
            pair = (f"p{(i + turn) % 3}", "m" if i % 2 == 0 else "m2")
            counts = [turn + i + 1, i, 2 * i, turn, 3] if i % 4 != 3 else [0, 0, 0, 0, 7]
            made.append(
                usage(pair[0], pair[1], **dict(zip(commits_mod._USAGE_FIELDS, counts, strict=True)))
            )
            raw.append((*pair, *counts))
            if sum(counts[:4]) != 0:
                row = expected.setdefault(pair, [0, 0, 0, 0, 0])
                expected[pair] = [a + b for a, b in zip(row, counts, strict=True)]
        commit(store, mk(fence, usage_deltas=tuple(made)))
    ledger = {
        (e.source, e.model): list(commits_mod._counters(e.usage))
        for e in loaded(store).token_ledger
    }
    assert ledger == expected
    rows = query(
        store,
        "SELECT source, model, input_tokens, output_tokens, cache_read_input_tokens,"
        " cache_write_input_tokens, reasoning_output_tokens FROM usage_deltas ORDER BY seq",
    )
    assert [tuple(r.values()) for r in rows] == raw
    # The totals' ordinals follow first appearance: the ledger's order is stable.
    order = [(e.source, e.model) for e in loaded(store).token_ledger]
    assert order == list(expected)


def test_only_zero_total_deltas_write_their_rows_and_no_total(store: Store) -> None:
    fence = hold(store)
    commit(store, mk(fence, usage_deltas=(usage(reasoning_output_tokens=4), usage("x"))))
    assert loaded(store).token_ledger == ()
    assert len(query(store, "SELECT seq FROM usage_deltas")) == 2
    assert query(store, "SELECT * FROM session_usage_totals") == []


def test_the_folded_ledger_statement_compiles_to_one_statement_on_postgres() -> None:
    """``WITH ledger AS (INSERT INTO usage_deltas ...) INSERT INTO session_usage_totals ...``."""
    from sqlalchemy.dialects import postgresql

    for (m, n), statement in commits_mod._PUT_USAGE_AND_TOTALS.items():
        sql = str(statement.construct(postgresql.dialect()).compile(dialect=postgresql.dialect()))
        assert sql.startswith("WITH ledger AS")
        assert sql.count("INSERT INTO usage_deltas") == 1
        assert sql.count("INSERT INTO session_usage_totals") == 1
        assert sql.count("%(dsource") == m and sql.count("%(tsource") == n


def test_a_fault_in_the_folded_ledger_statement_leaves_nothing(
    store: Store, fault_on: Callable[[str], None]
) -> None:
    """A trigger on either table of the folded statement fails it whole: no delta row,
    no total, no head, no node, no blob of the commit."""
    fence = hold(store)
    commit(store, mk(fence, nodes=(node("root"),), usage_deltas=(usage(input_tokens=1),)))
    before = snapshot(store)
    for table in ("usage_deltas", "session_usage_totals"):
        fault_on(table)
        c = mk(
            fence,
            nodes=(node("n1", "root"),),
            usage_deltas=(usage(input_tokens=2), usage("new", output_tokens=1)),
            checkpoint=HydratedSessionCheckpoint(turn_state={"turn": table}),
        )
        with pytest.raises(DatabaseError, match="injected fault"):
            commit(store, c)
        assert snapshot(store) == before


# --------------------------------------------------------------------------
# The fence is checked on the lease row read in one statement with the head
# (and the ledger totals when the commit has usage): both shapes of that read


@pytest.mark.parametrize("with_usage", [False, True])
@pytest.mark.parametrize("how", ["no_lease_row", "other_session", "expired", "released", "ok"])
def test_the_fence_read_with_the_head_keeps_every_outcome(
    store: Store, clock: SettableClock, with_usage: bool, how: str
) -> None:
    fence = hold(store)
    deltas = (usage(input_tokens=3),) if with_usage else ()
    commit(store, mk(fence, nodes=(node("root"),), usage_deltas=deltas))
    c = mk(fence, expected=1, nodes=(node("n1", "root"),), usage_deltas=deltas)
    if how == "no_lease_row":
        execute_sql(store, "DELETE FROM session_execution_leases")
    elif how == "other_session":
        c = c.model_copy(
            update={"session_execution_lease": fence.model_copy(update={"session_id": OTHER})}
        )
    elif how == "expired":
        clock.advance(TTL)
    elif how == "released":
        store.leases.release_session_execution_lease(fence)
    before = snapshot(store)
    if how == "ok":
        assert commit(store, c).head_revision == 2
        got = loaded(store)
        assert [n.node_id for n in got.graph.nodes] == ["root", "n1"]
        assert got.token_ledger == (
            (UsageLedgerEntry(source="src", model="m", usage=TokenUsage(input_tokens=6)),)
            if with_usage
            else ()
        )
        return
    with pytest.raises(SessionExecutionLeaseExpired) as info:
        commit(store, c)
    assert info.value.session_id == SID
    assert snapshot(store) == before


@pytest.mark.parametrize("with_usage", [False, True])
def test_a_corrupt_fencing_token_read_with_the_head_is_session_corrupt(
    store: Store, backend: str, with_usage: bool
) -> None:
    fence = hold(store)
    deltas = (usage(input_tokens=3),) if with_usage else ()
    commit(store, mk(fence, usage_deltas=deltas))
    execute_sql(store, "UPDATE session_execution_leases SET lease_fencing_token = -1")
    before = snapshot(store)
    with pytest.raises(SessionCorrupt) as info:
        commit(store, mk(fence, expected=1, usage_deltas=deltas))
    assert (info.value.table, info.value.column) == (
        "session_execution_leases",
        "lease_fencing_token",
    )
    assert snapshot(store) == before


# --------------------------------------------------------------------------
# The checkpoint's blobs (Postgres: written in the head's statement, 1..4 of them)


@pytest.mark.parametrize(
    "shape", ["turn_state_only", "one_component", "all_components", "same_bodies"]
)
def test_the_checkpoint_blobs_of_every_shape_are_written_with_the_head(
    store: Store, shape: str
) -> None:
    fence = hold(store)
    body = {"k": list(range(50))}
    checkpoints = {
        "turn_state_only": HydratedSessionCheckpoint(turn_state={"t": 1}),
        "one_component": HydratedSessionCheckpoint(turn_state={"t": 2}, tool_state=body),
        "all_components": HydratedSessionCheckpoint(
            turn_state={"t": 3},
            tool_state={"tool": 1},
            plugin_snapshot={"plugin": 2},
            plugin_snapshot_revision=4,
            execution_state={"exec": 3},
        ),
        # Equal bodies: one content-addressed blob, named twice in one statement.
        "same_bodies": HydratedSessionCheckpoint(
            turn_state={"t": 4}, tool_state=body, plugin_snapshot=body, execution_state=body
        ),
    }
    cp = checkpoints[shape]
    first = commit(store, mk(fence, nodes=(node("root"),), checkpoint=cp))
    # The same checkpoint again: every blob is already stored.
    second = commit(store, mk(fence, expected=1, checkpoint=cp))
    assert second.checkpoint_ref == first.checkpoint_ref
    got = loaded(store)
    assert got.head_revision == 2 and got.checkpoint is not None
    for field in ("turn_state", "tool_state", "plugin_snapshot", "execution_state"):
        assert getattr(got.checkpoint, field) == getattr(cp, field), field
    refs = [
        first.checkpoint_ref,
        *(
            r
            for r in (
                first.manifest.tool_state_ref,
                first.manifest.plugin_snapshot_ref,
                first.manifest.execution_state_ref,
            )
            if r is not None
        ),
    ]
    stored = {r["hash"] for r in query(store, "SELECT hash FROM blobs")}
    assert set(refs) <= stored
    assert len(stored) == len(set(refs))


def test_a_fault_on_the_blob_insert_written_with_the_head_leaves_nothing(
    store: Store, fault_on: Callable[[str], None]
) -> None:
    fence = hold(store)
    commit(store, mk(fence, nodes=(node("root"),)))
    before = snapshot(store)
    fault_on("blobs")
    c = mk(
        fence,
        expected=1,
        nodes=(node("n1", "root"),),
        usage_deltas=(usage(input_tokens=2),),
        checkpoint=HydratedSessionCheckpoint(turn_state={"new": 1}, tool_state={"x": 1}),
    )
    with pytest.raises(DatabaseError, match="injected fault"):
        commit(store, c)
    assert snapshot(store) == before
