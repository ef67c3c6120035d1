"""Session commits under real concurrency and killed processes (spec sessions §2.4, I-3, I-8).

* Two committers sharing one holder's valid fence (threads, and ``spawn``-ed
  processes, each with its own :class:`Store`) commit in lockstep rounds
  against the head revision they both read: every round exactly one wins and
  the other gets :class:`HeadRevisionConflict` naming the winner's revision.
  The graph never forks: the nodes form one chain (one root, one leaf), and
  the head's revision, node count and usage ledger count only the winners.
* A committer killed with SIGKILL inside its write unit — paused right after
  the blob INSERT, the graph INSERT, the head upsert, or the lease release
  (its last statement), by a trigger-free hook on ``Driver.execute`` in the
  child — leaves nothing of the commit after a reopen, and the lock is free:
  the same commit then succeeds. Killed after COMMIT, the commit is there in
  full.

Every wait is bounded; nothing sleeps to let time pass (SettableClock).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from typing import Any

import pytest

from agentkeep.clock import SettableClock
from agentkeep.errors import HeadRevisionConflict
from agentkeep.sessions.domain import LeaseOwnerIdentity, SessionExecutionLease
from agentkeep.sessions.records import (
    ActivePathScope,
    AppendNodes,
    HydratedSessionCheckpoint,
    RuntimeCommit,
    SessionNodeRecord,
    TokenUsage,
    UsageDelta,
)
from agentkeep.store import Store
from tests.racing import READY_TIMEOUT_S, Racing
from tests.support import query

from .support import acquire_lease, enqueue
from .test_commits import (
    SID,
    add_attachment,
    claim_active,
    claim_batches_after_enqueue,
    input_draft,
    input_row,
    loaded,
    mk,
    node,
    qdraft,
    snapshot,
    stamp,
    usage,
)

A = LeaseOwnerIdentity(owner_id="owner-A", incarnation_id="inc-A1")
T0 = 1_700_000_000_000
LONG_TTL = 600_000
ROUNDS = 6


# --------------------------------------------------------------------------
# Two committers, one fence (module level so spawned children can import them)


def _committer(store: Store, i: int, barrier: Any, p: dict[str, Any]) -> list[tuple[Any, ...]]:
    """Per round: read the head, then commit a one-node successor of it with the shared fence."""
    fence = SessionExecutionLease.model_validate_json(p["fence"])
    out: list[tuple[Any, ...]] = []
    for r in range(ROUNDS):
        barrier.wait()  # every commit of the previous round has finished
        seen = store.call_read(
            lambda u: u.commits.load_session(SID, ActivePathScope(leaf_node_id=None))
        )
        rev = 0 if seen is None else seen.head_revision
        leaf = None if seen is None else seen.graph.leaf_node_id
        barrier.wait()  # both have read the same head
        nid = f"r{r}-c{i}"
        c = RuntimeCommit(
            session_id=SID,
            expected_head_revision=rev,
            session_execution_lease=fence,
            graph=AppendNodes(
                nodes=(SessionNodeRecord(node_id=nid, parent_node_id=leaf),), leaf_node_id=nid
            ),
            checkpoint=HydratedSessionCheckpoint(turn_state={"round": r, "racer": i}),
            usage_deltas=(UsageDelta(source="race", model="m", usage=TokenUsage(input_tokens=1)),),
        )
        try:
            res = store.call_write(lambda u, c=c: u.commits.commit_runtime_state(c))
            out.append(("won", r, rev, res.head_revision, nid))
        except HeadRevisionConflict as exc:
            out.append(("lost", r, rev, exc.expected, exc.actual))
    return out


#: Two committers, each with its own store and clock at T0.
RACING = Racing(processes=2, threads=2, clock_ms=T0, barrier_timeout_s=60.0, join_timeout_s=120.0)
proc_pool = RACING.pool_fixture()


@pytest.mark.parametrize("kind", ["threads", "processes"])
def test_i_8_two_committers_with_one_fence_never_fork_the_graph(
    request: pytest.FixtureRequest, store: Store, db_url: str, kind: str
) -> None:
    fence = acquire_lease(store, SID, A, LONG_TTL)
    results = RACING.run(request, kind, db_url, _committer, {"fence": fence.model_dump_json()})

    outcomes = [o for racer in results for o in racer]
    winners = []
    for r in range(ROUNDS):
        this_round = sorted((o for o in outcomes if o[1] == r), key=lambda o: o[0] != "won")
        assert [o[0] for o in this_round] == ["won", "lost"], this_round
        won, lost = this_round
        assert won[2] == lost[2] == r, "both read the same head"
        assert won[3] == r + 1
        assert (lost[3], lost[4]) == (r, r + 1), "the loser is told the winner's revision"
        winners.append(won[4])

    got = loaded(store)
    assert got.head_revision == ROUNDS
    ids = [n.node_id for n in got.graph.nodes]
    assert sorted(ids) == sorted(winners), "only winners' nodes exist"
    parents = {n.node_id: n.parent_node_id for n in got.graph.nodes}
    assert [n for n in ids if n not in parents.values()] == [winners[-1]], "exactly one leaf"
    assert [n for n, p in parents.items() if p is None] == [winners[0]], "exactly one root"
    for prev, nxt in zip(winners, winners[1:], strict=False):
        assert parents[nxt] == prev
    path = loaded(store, scope=ActivePathScope())
    assert [n.node_id for n in path.graph.nodes] == winners
    (head,) = query(store, "SELECT graph_node_count, leaf_node_id FROM session_head")
    assert (head["graph_node_count"], head["leaf_node_id"]) == (ROUNDS, winners[-1])
    (entry,) = got.token_ledger
    assert entry.usage.input_tokens == ROUNDS


# --------------------------------------------------------------------------
# A committer killed inside its commit

#: Pause right after the first statement starting with this text; "committed": after COMMIT.
KILL_POINTS = [
    "INSERT INTO blobs",
    "INSERT INTO graph_nodes",
    "INSERT INTO session_head",
    "UPDATE session_execution_leases",
    "committed",
]


def _doomed_committer(url: str, point: str, commit_json: str, ready: Any) -> None:
    from agentkeep import db as dbmod

    store = Store.open(url, clock=SettableClock(T0))
    c = RuntimeCommit.model_validate_json(commit_json)
    if point != "committed":
        real = dbmod.Driver.execute

        def paused(self: Any, stmt: Any, params: Any) -> Any:
            cur = real(self, stmt, params)
            # "in", not "startswith": on Postgres the blobs are a CTE of the head's statement.
            if point in stmt.compiled(self.target).sql:
                ready.set()
                signal.pause()  # killed here, inside the open write unit
            return cur

        # On psycopg, deferred writes and prefetched reads go out pipelined (Driver._round_trip).
        real_trip = dbmod.Driver._round_trip

        def paused_trip(self: Any, items: Any, out: Any) -> None:
            real_trip(self, items, out)
            if any(point in sql for sql, _ in items):
                ready.set()
                signal.pause()  # killed here, inside the open write unit

        dbmod.Driver.execute = paused  # type: ignore[method-assign]
        dbmod.Driver._round_trip = paused_trip  # type: ignore[method-assign]
    with store.write() as uow:
        uow.commits.commit_runtime_state(c)
    ready.set()
    signal.pause()  # killed here, after COMMIT


def _prepare_commit(store: Store) -> tuple[RuntimeCommit, dict[str, Any]]:
    """Head at 1, a live queue claim, an accepted and a pending input, an attachment."""
    fence = acquire_lease(store, SID, A, LONG_TTL)
    store.call_write(lambda u: u.commits.commit_runtime_state(mk(fence, nodes=(node("root"),))))
    q = claim_batches_after_enqueue(store, fence)
    accepted = enqueue(store, input_draft("T"))
    t_claim = claim_active(store, fence)
    pending = enqueue(store, input_draft("T"))
    add_attachment(store)
    c = mk(
        fence,
        expected=1,
        nodes=(node("n1", "root"), node("n2", "n1")),
        checkpoint=HydratedSessionCheckpoint(turn_state={"t": 2}, tool_state={"big": "x" * 64}),
        usage_deltas=(usage(input_tokens=7),),
        turn_commit=stamp("turn-2"),
        completed_queue_claims=(q.completion(),),
        completed_turn_input_claims=(t_claim.completion(),),
        interrupted_turn_input_turn_id="T",
        committed_attachment_ids=("att-1",),
        enqueued_queue_batches=(qdraft(n=42),),
        release_session_execution_lease=fence,
    )
    refs = {
        "batches": [b.batch_id for b in q.batches],
        "accepted": accepted.input_id,
        "pending": pending.input_id,
    }
    return c, refs


def _assert_fully_committed(store: Store, c: RuntimeCommit, refs: dict[str, Any]) -> None:
    got = loaded(store)
    assert got.head_revision == 2
    assert [n.node_id for n in got.graph.nodes] == ["root", "n1", "n2"]
    assert got.checkpoint is not None and got.checkpoint.tool_state == {"big": "x" * 64}
    (entry,) = got.token_ledger
    assert entry.usage.input_tokens == 7
    (rec,) = query(store, "SELECT checkpoint_ref FROM runtime_turn_commits")
    assert rec["checkpoint_ref"] == got.checkpoint_ref
    batches = store.queue.list_queued_work(SID)
    assert not {b.batch_id for b in batches} & set(refs["batches"])
    assert [i.payload.body for b in batches for i in b.items] == [42]
    assert input_row(store, refs["accepted"])["state"] == "completed"
    assert input_row(store, refs["pending"])["state"] == "deferred_next_turn"
    (att,) = query(store, "SELECT committed_at_ms FROM attachment_manifest")
    assert att["committed_at_ms"] == T0
    assert store.leases.get_session_execution_lease(SID) is None


@pytest.mark.parametrize("point", KILL_POINTS)
def test_a_committer_killed_mid_commit_leaves_all_or_nothing(
    db_url: str, clock: SettableClock, point: str
) -> None:
    store = Store.open(db_url, clock=clock, busy_timeout_ms=30_000)
    try:
        c, refs = _prepare_commit(store)
        before = snapshot(store)

        ctx = multiprocessing.get_context("spawn")
        ready = ctx.Event()
        child = ctx.Process(
            target=_doomed_committer, args=(db_url, point, c.model_dump_json(), ready), daemon=True
        )
        child.start()
        try:
            # its start-up (spawn, imports) comes first
            assert ready.wait(READY_TIMEOUT_S), f"the child never reached {point!r}"
            assert child.pid is not None
            os.kill(child.pid, signal.SIGKILL)
            child.join(30)
        finally:
            if child.is_alive():
                child.kill()
                child.join(30)
        assert child.exitcode == -signal.SIGKILL
    finally:
        store.close()

    # Reopen, as a fresh process would.
    with Store.open(db_url, clock=SettableClock(T0)) as reopened:
        if point == "committed":
            _assert_fully_committed(reopened, c, refs)
            return
        assert snapshot(reopened) == before, f"a commit killed after {point!r} left a trace"
        # The dead writer's lock is gone, and the very same commit now succeeds in full.
        result = reopened.call_write(lambda u: u.commits.commit_runtime_state(c))
        assert result.head_revision == 2
        _assert_fully_committed(reopened, c, refs)
