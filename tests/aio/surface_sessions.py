"""Cases of the async surface suite: the session store's facades (see surface.py).

``astore.queue``, ``.turn_inputs``, ``.commits``, ``.maintenance``,
``.catalog`` and ``.checkpoint_nodes``, plus the two unit-only reads
``uow.queue.ensure_queued_work_completion`` and
``uow.turn_inputs.ensure_turn_input_completion``.
"""

from __future__ import annotations

from agentkeep.errors import (
    HeadRevisionConflict,
    InvalidInput,
    NodeAlreadyExists,
    PendingTurnInputSourceKeyConflict,
    QueuedWorkClaimSuperseded,
    QueuedWorkSourceKeyConflict,
    SessionCorrupt,
    SessionExecutionLeaseExpired,
    SessionLeaseHeld,
    TurnInputClaimSuperseded,
    TurnInputDuplicate,
)
from agentkeep.sessions.checkpoint_nodes import PendingWrite
from agentkeep.sessions.domain import (
    Acquired,
    ActiveTurnIngress,
    AnchorNotFound,
    Cancelled,
    CheckpointKind,
    ClaimBoundary,
    InputIdTarget,
    LeaseOwnerIdentity,
    NextTurnIngress,
    NotFoundOutcome,
    PendingTurnInputDraft,
    QueuedWorkDraft,
    QueuedWorkPayload,
    SessionExecutionLease,
    SuffixOutcomes,
    TurnInputState,
)
from agentkeep.sessions.records import RuntimeCommitResult, SessionMeta

from .support import SID, TTL, A, B, runtime_commit
from .surface import Ctx, covers

OTHER = "sess-aio-2"


async def hold(c: Ctx, owner: LeaseOwnerIdentity = A, sid: str = SID) -> SessionExecutionLease:
    got = await c.astore.leases.try_claim_session_execution_lease(sid, owner, TTL)
    assert isinstance(got, Acquired), got
    return got.lease


async def take_over(c: Ctx, old: SessionExecutionLease) -> SessionExecutionLease:
    """``old`` expires and B reclaims the lease: ``old`` is now a zombie's fence."""
    c.clock.advance(TTL + 1)
    got = await c.astore.leases.reclaim_session_execution_lease(old.session_id, B, old, TTL)
    assert isinstance(got, Acquired), got
    return got.lease


def work(body: object, source_key: str | None = None, kind: str = "user_input") -> QueuedWorkDraft:
    return QueuedWorkDraft(
        session_id=SID,
        source_key=source_key,
        payloads=(QueuedWorkPayload(kind=kind, body=body),),
    )


def next_input(text: str, source_key: str | None = None, **kw: object) -> PendingTurnInputDraft:
    return PendingTurnInputDraft(
        session_id=SID,
        source_key=source_key,
        ingress=NextTurnIngress(),
        input={"text": text},
        **kw,
    )


def active_input(text: str, turn: str = "turn-1") -> PendingTurnInputDraft:
    return PendingTurnInputDraft(
        session_id=SID, ingress=ActiveTurnIngress(turn_id=turn), input={"text": text}
    )


# --------------------------------------------------------------------------
# queue


@covers("queue.enqueue_queued_work")
async def _enqueue_queued_work(c: Ctx) -> None:
    enqueue = c.op("queue.enqueue_queued_work")
    batch = await enqueue(work(1, "src-1"))
    assert batch.session_id == SID and [i.payload.body for i in batch.items] == [1]
    again = await c.unchanged(enqueue(work(1, "src-1")))  # idempotent by its source key
    assert again.batch_id == batch.batch_id
    await c.refused(QueuedWorkSourceKeyConflict, enqueue(work(2, "src-1")))
    await c.refused(InvalidInput, enqueue(work(1).model_copy(update={"payloads": ()})))
    assert [b.batch_id for b in await c.astore.queue.list_queued_work(SID)] == [batch.batch_id]


@covers("queue.claim_leading_ready_session_command")
async def _claim_leading_ready_session_command(c: Ctx) -> None:
    fence = await hold(c)
    claim = c.op("queue.claim_leading_ready_session_command")
    await c.astore.queue.enqueue_queued_work(work(1))
    assert await c.unchanged(claim(SID, fence, A)) is None  # the leading batch is turn work
    await c.astore.queue.cancel_queued_work_batch(
        SID, (await c.astore.queue.list_queued_work(SID))[0].batch_id
    )
    command = await c.astore.queue.enqueue_queued_work(work("stop", kind="session_command"))
    got = await claim(SID, fence, A)
    assert got is not None and [b.batch_id for b in got.batches] == [command.batch_id]
    assert await c.astore.queue.list_pending_queued_work(SID) == []
    zombie = fence
    await take_over(c, zombie)
    await c.refused(SessionExecutionLeaseExpired, claim(SID, zombie, A))


@covers("queue.claim_ready_queued_work")
async def _claim_ready_queued_work(c: Ctx) -> None:
    fence = await hold(c)
    claim = c.op("queue.claim_ready_queued_work")
    assert await c.unchanged(claim(SID, fence, A, ClaimBoundary.IDLE, 8)) is None  # empty
    batch = await c.astore.queue.enqueue_queued_work(work(1))
    got = await claim(SID, fence, A, ClaimBoundary.IDLE, 8)
    assert got is not None and [b.batch_id for b in got.batches] == [batch.batch_id]
    assert got.session_lease_generation == fence.fencing_token
    assert await c.unchanged(claim(SID, fence, A, ClaimBoundary.IDLE, 8)) is None  # claimed
    await c.refused(InvalidInput, claim(SID, fence, A, ClaimBoundary.IDLE, -1))
    await take_over(c, fence)
    await c.refused(SessionExecutionLeaseExpired, claim(SID, fence, A, ClaimBoundary.IDLE, 8))


@covers("queue.claim_ready_queued_work_by_batch_ids")
async def _claim_by_batch_ids(c: Ctx) -> None:
    fence = await hold(c)
    first = await c.astore.queue.enqueue_queued_work(work(1))
    second = await c.astore.queue.enqueue_queued_work(work(2))
    claim = c.op("queue.claim_ready_queued_work_by_batch_ids")
    got = await claim(SID, fence, A, ClaimBoundary.IDLE, [second.batch_id])
    assert got is not None and [b.batch_id for b in got.batches] == [second.batch_id]
    assert await c.unchanged(claim(SID, fence, A, ClaimBoundary.IDLE, ["no-such"])) is None
    await c.refused(InvalidInput, claim(SID, fence, A, ClaimBoundary.IDLE, [" "]))
    await take_over(c, fence)
    await c.refused(
        SessionExecutionLeaseExpired, claim(SID, fence, A, ClaimBoundary.IDLE, [first.batch_id])
    )


@covers("queue.abandon_queued_work_claim")
async def _abandon_queued_work_claim(c: Ctx) -> None:
    fence = await hold(c)
    batch = await c.astore.queue.enqueue_queued_work(work(1))
    got = await c.astore.queue.claim_ready_queued_work(SID, fence, A, ClaimBoundary.IDLE, 8)
    assert got is not None
    assert await c.astore.queue.list_pending_queued_work(SID) == []
    assert await c.op("queue.abandon_queued_work_claim")(got) is None
    pending = await c.astore.queue.list_pending_queued_work(SID)
    assert [b.batch_id for b in pending] == [batch.batch_id] and pending[0].claim_id is None
    await c.refused(InvalidInput, c.op("queue.abandon_queued_work_claim")("not a claim"))


@covers("queue.complete_queued_work_claim")
async def _complete_queued_work_claim(c: Ctx) -> None:
    fence = await hold(c)
    await c.astore.queue.enqueue_queued_work(work(1))
    got = await c.astore.queue.claim_ready_queued_work(SID, fence, A, ClaimBoundary.IDLE, 8)
    assert got is not None
    complete = c.op("queue.complete_queued_work_claim")
    wrong = got.completion().model_copy(update={"batch_ids": ("no-such",)})
    await c.refused(QueuedWorkClaimSuperseded, complete(fence, wrong))
    assert await complete(fence, got.completion()) is None
    assert await c.astore.queue.list_queued_work(SID) == []
    await c.astore.queue.enqueue_queued_work(work(2))
    again = await c.astore.queue.claim_ready_queued_work(SID, fence, A, ClaimBoundary.IDLE, 8)
    assert again is not None
    await take_over(c, fence)
    await c.refused(SessionExecutionLeaseExpired, complete(fence, again.completion()))


@covers("queue.ensure_queued_work_completion", modes=("unit",))
async def _ensure_queued_work_completion(c: Ctx) -> None:
    fence = await hold(c)
    await c.astore.queue.enqueue_queued_work(work(1))
    got = await c.astore.queue.claim_ready_queued_work(SID, fence, A, ClaimBoundary.IDLE, 8)
    assert got is not None
    ensure = c.op("queue.ensure_queued_work_completion")
    assert await ensure(got.completion()) is None
    wrong = got.completion().model_copy(update={"batch_ids": ("no-such",)})
    await c.refused(QueuedWorkClaimSuperseded, ensure(wrong))
    await c.refused(InvalidInput, ensure("not a completion"))


@covers("queue.cancel_queued_work_batch")
async def _cancel_queued_work_batch(c: Ctx) -> None:
    fence = await hold(c)
    first = await c.astore.queue.enqueue_queued_work(work(1))
    cancel = c.op("queue.cancel_queued_work_batch")
    got = await cancel(SID, first.batch_id)
    assert got is not None and got.batch_id == first.batch_id
    assert await c.astore.queue.list_queued_work(SID) == []
    assert await c.unchanged(cancel(SID, first.batch_id)) is None  # gone
    second = await c.astore.queue.enqueue_queued_work(work(2))
    assert await c.astore.queue.claim_ready_queued_work(SID, fence, A, ClaimBoundary.IDLE, 8)
    assert await c.unchanged(cancel(SID, second.batch_id)) is None  # live-claimed
    await c.refused(InvalidInput, cancel(SID, " "))
    third = await c.astore.queue.enqueue_queued_work(work(3))
    corrupt(c, third.batch_id)
    await c.refused(SessionCorrupt, cancel(SID, third.batch_id))  # nothing is deleted


@covers("queue.list_queued_work")
async def _list_queued_work(c: Ctx) -> None:
    listed = c.op("queue.list_queued_work")
    assert await listed(SID) == []
    fence = await hold(c)
    one = await c.astore.queue.enqueue_queued_work(work(1))
    two = await c.astore.queue.enqueue_queued_work(work(2))
    await c.astore.queue.claim_ready_queued_work_by_batch_ids(
        SID, fence, A, ClaimBoundary.IDLE, [one.batch_id]
    )
    assert [b.batch_id for b in await listed(SID)] == [one.batch_id, two.batch_id]
    await c.refused(InvalidInput, listed(" "))
    corrupt(c, two.batch_id)
    error = await c.refused(SessionCorrupt, listed(SID))
    assert (error.table, error.key) == ("queued_work_batches", two.batch_id)


def corrupt(c: Ctx, batch_id: str) -> None:
    """Make the stored batch ``batch_id`` undecodable."""
    c.seen.execute(
        "UPDATE queued_work_batches SET merge_key_json = '{not json' WHERE batch_id = :b",
        b=batch_id,
    )


@covers("queue.list_pending_queued_work")
async def _list_pending_queued_work(c: Ctx) -> None:
    listed = c.op("queue.list_pending_queued_work")
    fence = await hold(c)
    one = await c.astore.queue.enqueue_queued_work(work(1))
    two = await c.astore.queue.enqueue_queued_work(work(2))
    assert [b.batch_id for b in await listed(SID)] == [one.batch_id, two.batch_id]
    await c.astore.queue.claim_ready_queued_work_by_batch_ids(
        SID, fence, A, ClaimBoundary.IDLE, [one.batch_id]
    )
    assert [b.batch_id for b in await listed(SID)] == [two.batch_id]
    await c.refused(InvalidInput, listed(""))


# --------------------------------------------------------------------------
# turn inputs


@covers("turn_inputs.enqueue_pending_turn_input")
async def _enqueue_pending_turn_input(c: Ctx) -> None:
    enqueue = c.op("turn_inputs.enqueue_pending_turn_input")
    got = await enqueue(next_input("hi", "k-1"))
    assert got.state == TurnInputState.DEFERRED_NEXT_TURN and got.input == {"text": "hi"}
    again = await c.unchanged(enqueue(next_input("hi", "k-1")))
    assert again.input_id == got.input_id
    await c.refused(PendingTurnInputSourceKeyConflict, enqueue(next_input("other", "k-1")))
    await c.refused(TurnInputDuplicate, enqueue(next_input("x", input_id=got.input_id)))
    await c.refused(InvalidInput, enqueue(next_input("x").model_copy(update={"session_id": ""})))


@covers("turn_inputs.list_pending_turn_inputs")
async def _list_pending_turn_inputs(c: Ctx) -> None:
    listed = c.op("turn_inputs.list_pending_turn_inputs")
    one = await c.astore.turn_inputs.enqueue_pending_turn_input(next_input("1"))
    two = await c.astore.turn_inputs.enqueue_pending_turn_input(next_input("2"))
    assert [i.input_id for i in await listed(SID)] == [one.input_id, two.input_id]
    fence = await hold(c)
    assert await c.astore.turn_inputs.claim_next_turn_inputs(SID, fence, A, 1)
    assert [i.input_id for i in await listed(SID)] == [two.input_id]
    await c.refused(InvalidInput, listed(" "))


@covers("turn_inputs.list_turn_inputs")
async def _list_turn_inputs(c: Ctx) -> None:
    listed = c.op("turn_inputs.list_turn_inputs")
    assert await listed(SID) == []
    one = await c.astore.turn_inputs.enqueue_pending_turn_input(next_input("1"))
    two = await c.astore.turn_inputs.enqueue_pending_turn_input(next_input("2"))
    await c.astore.turn_inputs.cancel_pending_turn_inputs(
        SID, [InputIdTarget(input_id=one.input_id)]
    )
    states = [(i.input_id, i.state) for i in await listed(SID)]
    assert states == [
        (one.input_id, TurnInputState.CANCELLED),
        (two.input_id, TurnInputState.DEFERRED_NEXT_TURN),
    ]
    await c.refused(InvalidInput, listed(""))


@covers("turn_inputs.cancel_pending_turn_inputs")
async def _cancel_pending_turn_inputs(c: Ctx) -> None:
    one = await c.astore.turn_inputs.enqueue_pending_turn_input(next_input("1"))
    cancel = c.op("turn_inputs.cancel_pending_turn_inputs")
    target, missing = InputIdTarget(input_id=one.input_id), InputIdTarget(input_id="no-such")
    results = await cancel(SID, [target, missing])
    assert [r.target for r in results] == [target, missing]
    assert isinstance(results[0].outcome, Cancelled)
    assert isinstance(results[1].outcome, NotFoundOutcome)
    (only,) = await c.astore.turn_inputs.list_turn_inputs(SID)
    assert only.state == TurnInputState.CANCELLED
    await c.refused(InvalidInput, cancel(SID, ["not a target"]))


@covers("turn_inputs.cancel_pending_turn_input_suffix")
async def _cancel_pending_turn_input_suffix(c: Ctx) -> None:
    ti = c.astore.turn_inputs
    one = await ti.enqueue_pending_turn_input(next_input("1"))
    two = await ti.enqueue_pending_turn_input(next_input("2"))
    three = await ti.enqueue_pending_turn_input(next_input("3"))
    suffix = c.op("turn_inputs.cancel_pending_turn_input_suffix")
    missing = InputIdTarget(input_id="no-such")
    assert await c.unchanged(suffix(SID, missing)) == AnchorNotFound(anchor=missing)
    got = await suffix(SID, InputIdTarget(input_id=two.input_id))
    assert isinstance(got, SuffixOutcomes) and len(got.outcomes) == 2
    assert all(isinstance(o, Cancelled) for o in got.outcomes)
    states = {i.input_id: i.state for i in await ti.list_turn_inputs(SID)}
    assert states == {
        one.input_id: TurnInputState.DEFERRED_NEXT_TURN,
        two.input_id: TurnInputState.CANCELLED,
        three.input_id: TurnInputState.CANCELLED,
    }
    await c.refused(InvalidInput, suffix(" ", InputIdTarget(input_id=one.input_id)))


@covers("turn_inputs.claim_active_turn_inputs")
async def _claim_active_turn_inputs(c: Ctx) -> None:
    fence = await hold(c)
    claim = c.op("turn_inputs.claim_active_turn_inputs")
    after = CheckpointKind.AFTER_WORK
    assert await c.unchanged(claim(SID, fence, A, "turn-1", after, 5)) is None
    item = await c.astore.turn_inputs.enqueue_pending_turn_input(active_input("steer"))
    assert await c.unchanged(claim(SID, fence, A, "turn-2", after, 5)) is None  # another turn
    got = await claim(SID, fence, A, "turn-1", after, 5)
    assert got is not None and [i.input_id for i in got.inputs] == [item.input_id]
    assert got.inputs[0].state == TurnInputState.ACCEPTED
    await c.refused(InvalidInput, claim(SID, fence, A, "turn-1", after, -1))
    await take_over(c, fence)
    await c.refused(SessionExecutionLeaseExpired, claim(SID, fence, A, "turn-1", after, 5))


@covers("turn_inputs.claim_next_turn_inputs")
async def _claim_next_turn_inputs(c: Ctx) -> None:
    fence = await hold(c)
    claim = c.op("turn_inputs.claim_next_turn_inputs")
    assert await c.unchanged(claim(SID, fence, A, 5)) is None
    one = await c.astore.turn_inputs.enqueue_pending_turn_input(next_input("1"))
    await c.astore.turn_inputs.enqueue_pending_turn_input(next_input("2"))
    got = await claim(SID, fence, A, 1)
    assert got is not None and [i.input_id for i in got.inputs] == [one.input_id]
    await c.refused(InvalidInput, claim(SID, fence, A, -1))
    await take_over(c, fence)
    await c.refused(SessionExecutionLeaseExpired, claim(SID, fence, A, 5))


@covers("turn_inputs.abandon_turn_input_claim")
async def _abandon_turn_input_claim(c: Ctx) -> None:
    fence = await hold(c)
    one = await c.astore.turn_inputs.enqueue_pending_turn_input(next_input("1"))
    got = await c.astore.turn_inputs.claim_next_turn_inputs(SID, fence, A, 5)
    assert got is not None
    assert await c.astore.turn_inputs.list_pending_turn_inputs(SID) == []
    assert await c.op("turn_inputs.abandon_turn_input_claim")(got) is None
    (back,) = await c.astore.turn_inputs.list_pending_turn_inputs(SID)
    assert back.input_id == one.input_id and back.claim_id is None
    await c.refused(InvalidInput, c.op("turn_inputs.abandon_turn_input_claim")("not a claim"))


@covers("turn_inputs.complete_turn_input_claim")
async def _complete_turn_input_claim(c: Ctx) -> None:
    fence = await hold(c)
    await c.astore.turn_inputs.enqueue_pending_turn_input(next_input("1"))
    got = await c.astore.turn_inputs.claim_next_turn_inputs(SID, fence, A, 5)
    assert got is not None
    complete = c.op("turn_inputs.complete_turn_input_claim")
    wrong = got.completion().model_copy(update={"input_ids": ("no-such",)})
    await c.refused(TurnInputClaimSuperseded, complete(fence, wrong))
    assert await complete(fence, got.completion()) is None
    (done,) = await c.astore.turn_inputs.list_turn_inputs(SID)
    assert done.state == TurnInputState.COMPLETED
    await c.astore.turn_inputs.enqueue_pending_turn_input(next_input("2"))
    again = await c.astore.turn_inputs.claim_next_turn_inputs(SID, fence, A, 5)
    assert again is not None
    await take_over(c, fence)
    await c.refused(SessionExecutionLeaseExpired, complete(fence, again.completion()))


@covers("turn_inputs.ensure_turn_input_completion", modes=("unit",))
async def _ensure_turn_input_completion(c: Ctx) -> None:
    fence = await hold(c)
    await c.astore.turn_inputs.enqueue_pending_turn_input(next_input("1"))
    got = await c.astore.turn_inputs.claim_next_turn_inputs(SID, fence, A, 5)
    assert got is not None
    ensure = c.op("turn_inputs.ensure_turn_input_completion")
    assert await ensure(got.completion()) is None
    wrong = got.completion().model_copy(update={"input_ids": ("no-such",)})
    await c.refused(TurnInputClaimSuperseded, ensure(wrong))
    await c.refused(InvalidInput, ensure("not a completion"))


@covers("turn_inputs.recover_stale_turn_input_claims")
async def _recover_stale_turn_input_claims(c: Ctx) -> None:
    old = await hold(c)
    item = await c.astore.turn_inputs.enqueue_pending_turn_input(active_input("steer"))
    claimed = await c.astore.turn_inputs.claim_active_turn_inputs(
        SID, old, A, "turn-1", CheckpointKind.AFTER_WORK, 5
    )
    assert claimed is not None
    recover = c.op("turn_inputs.recover_stale_turn_input_claims")
    assert await c.unchanged(recover(SID, old)) == []  # the claim is live: nothing is stale
    new = await take_over(c, old)
    await c.refused(SessionExecutionLeaseExpired, recover(SID, old))
    (back,) = await recover(SID, new)
    assert back.input_id == item.input_id and back.state == TurnInputState.PENDING_ACTIVE
    assert back.claim_id is None


# --------------------------------------------------------------------------
# commits


@covers("commits.commit_runtime_state")
async def _commit_runtime_state(c: Ctx) -> None:
    fence = await hold(c)
    commit = c.op("commits.commit_runtime_state")
    got = await commit(runtime_commit(fence, "t1", 0))
    assert isinstance(got, RuntimeCommitResult) and got.head_revision == 1
    assert [b.source_key for b in got.enqueued_queue_batches] == ["src-t1"]
    replay = await c.unchanged(commit(runtime_commit(fence, "t1", 0)))  # idempotent by its stamp
    assert replay.head_revision == 1 and replay.checkpoint_ref == got.checkpoint_ref
    await c.refused(HeadRevisionConflict, commit(runtime_commit(fence, "t2", 0, parent="t1-b")))
    await c.refused(
        NodeAlreadyExists,
        commit(
            runtime_commit(fence, "t1", 1, parent="t1-b").model_copy(update={"turn_commit": None})
        ),
    )
    await c.refused(SessionExecutionLeaseExpired, commit(runtime_commit(None, "t3", 1)))
    await take_over(c, fence)
    await c.refused(
        SessionExecutionLeaseExpired, commit(runtime_commit(fence, "t4", 1, parent="t1-b"))
    )
    assert await c.astore.commits.get_head_revision(SID) == 1


@covers("commits.load_session")
async def _load_session(c: Ctx) -> None:
    load = c.op("commits.load_session")
    assert await load(SID) is None
    fence = await hold(c)
    await c.astore.commits.commit_runtime_state(runtime_commit(fence, "t1", 0))
    got = await load(SID)
    assert got is not None and got.head_revision == 1
    assert {n.node_id for n in got.graph.nodes} == {"t1-a", "t1-b"}
    assert got.graph.leaf_node_id == "t1-b"
    assert got.checkpoint is not None and got.checkpoint.turn_state == {"turn": "t1"}
    await c.refused(InvalidInput, load(" "))


@covers("commits.load_node")
async def _load_node(c: Ctx) -> None:
    fence = await hold(c)
    await c.astore.commits.commit_runtime_state(runtime_commit(fence, "t1", 0))
    load = c.op("commits.load_node")
    got = await load(SID, "t1-b")
    assert got is not None and got.parent_node_id == "t1-a" and got.payload == {"n": "t1-b"}
    assert await load(SID, "no-such") is None
    await c.refused(InvalidInput, load(SID, ""))


@covers("commits.get_head_revision")
async def _get_head_revision(c: Ctx) -> None:
    head = c.op("commits.get_head_revision")
    assert await head(SID) == 0
    fence = await hold(c)
    await c.astore.commits.commit_runtime_state(runtime_commit(fence, "t1", 0))
    await c.astore.commits.commit_runtime_state(runtime_commit(fence, "t2", 1, parent="t1-b"))
    assert await head(SID) == 2
    await c.refused(InvalidInput, head(""))


def meta(name: str = "first") -> SessionMeta:
    return SessionMeta(
        session_id=SID, session_name=name, created_at="c", model="m", relation={"k": [1]}
    )


@covers("commits.save_session_meta")
async def _save_session_meta(c: Ctx) -> None:
    save = c.op("commits.save_session_meta")
    assert await save(meta()) is None
    assert await c.astore.commits.load_session_meta(SID) == meta()
    await save(meta("renamed"))  # insert or replace
    assert await c.astore.commits.load_session_meta(SID) == meta("renamed")
    await c.refused(InvalidInput, save("not a meta"))


@covers("commits.load_session_meta")
async def _load_session_meta(c: Ctx) -> None:
    load = c.op("commits.load_session_meta")
    assert await load(SID) is None
    await c.astore.commits.save_session_meta(meta())
    assert await load(SID) == meta()
    await c.refused(InvalidInput, load(""))


# --------------------------------------------------------------------------
# maintenance


async def two_turns(c: Ctx) -> None:
    fence = await hold(c)
    await c.astore.commits.commit_runtime_state(runtime_commit(fence, "t1", 0))
    await c.astore.commits.commit_runtime_state(runtime_commit(fence, "t2", 1, parent="t1-b"))


@covers("maintenance.tombstone_nodes")
async def _tombstone_nodes(c: Ctx) -> None:
    await two_turns(c)
    assert await c.op("maintenance.tombstone_nodes")(SID, ["t1-a"]) is None
    assert await c.astore.commits.load_node(SID, "t1-a") is None
    assert await c.astore.commits.load_node(SID, "t1-b") is not None
    await c.refused(InvalidInput, c.op("maintenance.tombstone_nodes")(SID, [""]))


@covers("maintenance.vacuum")
async def _vacuum(c: Ctx) -> None:
    await two_turns(c)
    await c.astore.maintenance.tombstone_nodes(SID, ["t1-a"])
    one = await c.astore.turn_inputs.enqueue_pending_turn_input(next_input("1"))
    await c.astore.turn_inputs.cancel_pending_turn_inputs(
        SID, [InputIdTarget(input_id=one.input_id)]
    )
    report = await c.op("maintenance.vacuum")(SID)
    assert report.removed_node_count == 1
    assert report.removed_pending_turn_input_tombstone_count == 1
    assert await c.astore.turn_inputs.list_turn_inputs(SID) == []
    empty = await c.unchanged(c.op("maintenance.vacuum")(SID))
    assert empty.removed_node_count == empty.removed_pending_turn_input_tombstone_count == 0
    await c.refused(InvalidInput, c.op("maintenance.vacuum")(" "))


@covers("maintenance.vacuum_all_sessions")
async def _vacuum_all_sessions(c: Ctx) -> None:
    await two_turns(c)
    await c.astore.maintenance.tombstone_nodes(SID, ["t1-a", "t2-a"])
    report = await c.op("maintenance.vacuum_all_sessions")()
    assert report.removed_node_count == 2
    empty = await c.unchanged(c.op("maintenance.vacuum_all_sessions")())
    assert empty.removed_node_count == 0


async def _check_gc(c: Ctx, operation: str) -> None:
    await two_turns(c)
    await c.astore.catalog.delete_session(SID)  # every blob of the session is unreachable now
    blobs = len(c.seen.rows("SELECT hash FROM blobs"))
    assert blobs > 0
    report = await c.op(operation)()
    assert report.deleted_blob_count == blobs and report.retained_blob_count == 0
    assert c.seen.rows("SELECT hash FROM blobs") == []
    again = await c.unchanged(c.op(operation)())
    assert again.deleted_blob_count == 0
    await two_turns(c)
    kept = await c.op(operation)()
    assert kept.root_count >= 1 and kept.retained_blob_count >= 1
    assert (await c.astore.commits.load_session(SID)) is not None


@covers("maintenance.gc_unreachable")
async def _gc_unreachable(c: Ctx) -> None:
    await _check_gc(c, "maintenance.gc_unreachable")


@covers("maintenance.gc_unreachable_strict")
async def _gc_unreachable_strict(c: Ctx) -> None:
    await _check_gc(c, "maintenance.gc_unreachable_strict")


# --------------------------------------------------------------------------
# catalog


@covers("catalog.list_sessions")
async def _list_sessions(c: Ctx) -> None:
    listed = c.op("catalog.list_sessions")
    assert (await listed()).session_ids == []
    await c.astore.commits.save_session_meta(meta())
    await c.astore.queue.enqueue_queued_work(work(1).model_copy(update={"session_id": OTHER}))
    page = await listed(limit=1)
    assert page.session_ids == [SID] and page.next_after == SID
    rest = await listed(after=page.next_after)
    assert rest.session_ids == [OTHER] and rest.next_after is None
    assert (await listed(prefix=OTHER)).session_ids == [OTHER]
    await c.refused(InvalidInput, listed(limit=-1))


@covers("catalog.delete_session")
async def _delete_session(c: Ctx) -> None:
    await two_turns(c)
    await c.astore.commits.save_session_meta(meta())
    delete = c.op("catalog.delete_session")
    assert await delete(SID) > 0
    assert await c.astore.commits.load_session(SID) is None
    assert (await c.astore.catalog.list_sessions()).session_ids == []
    assert await c.unchanged(delete(SID)) == 0
    await c.refused(InvalidInput, delete(" "))


# --------------------------------------------------------------------------
# checkpoint nodes


@covers("checkpoint_nodes.put_checkpoint_node")
async def _put_checkpoint_node(c: Ctx) -> None:
    put = c.op("checkpoint_nodes.put_checkpoint_node")
    ref = await put(SID, "c1", b"one", node_json='{"k": 1}', run_id="r1")
    assert isinstance(ref, str) and ref
    got = await c.astore.checkpoint_nodes.get_checkpoint_node(SID, "c1")
    assert got is not None and (got.body, got.node_json, got.run_id) == (b"one", '{"k": 1}', "r1")
    await c.refused(InvalidInput, put(SID, "c2", "not bytes"))
    fence = await hold(c)
    await c.refused(SessionLeaseHeld, put(SID, "c2", b"two"))  # unfenced under A's live lease
    assert await put(SID, "c2", b"two", fence=fence)
    await take_over(c, fence)
    await c.refused(SessionExecutionLeaseExpired, put(SID, "c3", b"three", fence=fence))


def writes() -> list[PendingWrite]:
    return [PendingWrite(0, "a", "json", b"1"), PendingWrite(1, "b", "json", b"2")]


@covers("checkpoint_nodes.put_pending_writes")
async def _put_pending_writes(c: Ctx) -> None:
    await c.astore.checkpoint_nodes.put_checkpoint_node(SID, "c1", b"one")
    put = c.op("checkpoint_nodes.put_pending_writes")
    assert await put(SID, "c1", "task-1", writes()) is None
    stored = await c.astore.checkpoint_nodes.list_pending_writes(SID, "c1")
    assert [(w.task_id, w.idx, w.value) for w in stored] == [
        ("task-1", 0, b"1"),
        ("task-1", 1, b"2"),
    ]
    await c.unchanged(put(SID, "c1", "task-1", writes()))  # stored once per task and index
    await c.refused(InvalidInput, put(SID, "c1", "task-1", ["not a write"]))
    await hold(c)
    await c.refused(SessionLeaseHeld, put(SID, "c1", "task-2", writes()))


@covers("checkpoint_nodes.get_checkpoint_node")
async def _get_checkpoint_node(c: Ctx) -> None:
    get = c.op("checkpoint_nodes.get_checkpoint_node")
    assert await get(SID) is None
    await c.astore.checkpoint_nodes.put_checkpoint_node(SID, "c1", b"one")
    await c.astore.checkpoint_nodes.put_checkpoint_node(SID, "c2", b"two", parent_node_id="c1")
    latest = await get(SID)
    assert latest is not None and (latest.node_id, latest.body) == ("c2", b"two")
    assert latest.parent_node_id == "c1"
    assert await get(SID, "no-such") is None
    await c.refused(InvalidInput, get(SID, " "))


@covers("checkpoint_nodes.list_checkpoint_nodes")
async def _list_checkpoint_nodes(c: Ctx) -> None:
    listed = c.op("checkpoint_nodes.list_checkpoint_nodes")
    for nid in ("c1", "c3", "c2"):
        await c.astore.checkpoint_nodes.put_checkpoint_node(SID, nid, nid.encode())
    assert [n.node_id for n in await listed(SID)] == ["c3", "c2", "c1"]
    assert [n.node_id for n in await listed(SID, before="c3", limit=1)] == ["c2"]
    await c.refused(InvalidInput, listed(SID, limit=-1))


@covers("checkpoint_nodes.list_pending_writes")
async def _list_pending_writes(c: Ctx) -> None:
    listed = c.op("checkpoint_nodes.list_pending_writes")
    await c.astore.checkpoint_nodes.put_checkpoint_node(SID, "c1", b"one")
    assert await listed(SID, "c1") == []
    await c.astore.checkpoint_nodes.put_pending_writes(SID, "c1", "t-b", writes()[:1])
    await c.astore.checkpoint_nodes.put_pending_writes(SID, "c1", "t-a", writes()[1:])
    assert [(w.task_id, w.idx) for w in await listed(SID, "c1")] == [("t-a", 1), ("t-b", 0)]
    await c.refused(InvalidInput, listed(SID, ""))


@covers("checkpoint_nodes.delete_nodes_for_runs")
async def _delete_nodes_for_runs(c: Ctx) -> None:
    nodes = c.astore.checkpoint_nodes
    await nodes.put_checkpoint_node(SID, "c1", b"1", run_id="r1")
    await nodes.put_checkpoint_node(SID, "c2", b"2", run_id="r2")
    await nodes.put_pending_writes(SID, "c1", "t", writes())
    delete = c.op("checkpoint_nodes.delete_nodes_for_runs")
    assert await delete(["r1"]) == 1
    assert [n.node_id for n in await nodes.list_checkpoint_nodes(SID)] == ["c2"]
    assert await nodes.list_pending_writes(SID, "c1") == []
    assert await c.unchanged(delete(["r1"])) == 0
    await c.refused(InvalidInput, delete([""]))


@covers("checkpoint_nodes.prune_checkpoint_nodes")
async def _prune_checkpoint_nodes(c: Ctx) -> None:
    nodes = c.astore.checkpoint_nodes
    for nid in ("c1", "c2", "c3"):
        await nodes.put_checkpoint_node(SID, nid, nid.encode())
    prune = c.op("checkpoint_nodes.prune_checkpoint_nodes")
    assert await prune(SID, keep_latest=True) == 2
    assert [n.node_id for n in await nodes.list_checkpoint_nodes(SID)] == ["c3"]
    assert await prune(SID, keep_latest=False) == 1
    assert await nodes.list_checkpoint_nodes(SID) == []
    await c.refused(InvalidInput, prune(" ", keep_latest=True))


@covers("checkpoint_nodes.copy_checkpoint_nodes")
async def _copy_checkpoint_nodes(c: Ctx) -> None:
    nodes = c.astore.checkpoint_nodes
    await nodes.put_checkpoint_node(SID, "c1", b"1")
    await nodes.put_checkpoint_node(SID, "c2", b"2", parent_node_id="c1")
    await nodes.put_pending_writes(SID, "c2", "t", writes())
    copy = c.op("checkpoint_nodes.copy_checkpoint_nodes")
    assert await copy(SID, OTHER) == 2
    copied = await nodes.list_checkpoint_nodes(OTHER)
    assert [(n.node_id, n.body) for n in copied] == [("c2", b"2"), ("c1", b"1")]
    assert len(copied[0].writes) == 2
    await c.refused(InvalidInput, copy(SID, SID))
