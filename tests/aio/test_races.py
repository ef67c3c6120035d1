"""Fences under real concurrency in the native mode: exactly one winner, on every asyncio driver.

* 50 tasks of one event loop race ``runs.try_transition(PENDING → RUNNING)``
  through one AsyncStore (its pool of connections): exactly one True. The
  same race with each task in its own ``async with astore.write()`` unit that
  also creates a run of its own: one winner, and only the winner's unit
  wrote its run (the losers' units rolled back).
* The same race split over two OS processes, each with its own event loop
  and AsyncStore, started together on a barrier: one winner overall.
* Lease takeover: worker A's lease expires, worker B reclaims it; zombie A's
  claims, commit and renewal are refused with ``SessionExecutionLeaseExpired``
  (its release is a silent no-op) and write nothing, alone and while B works
  concurrently; B's claims and commit succeed.
* Head compare-and-set: N tasks commit against the same expected head
  revision; one succeeds, the others get ``HeadRevisionConflict``, and the
  head moved by exactly one. The same with each committer in its own unit
  that also creates a run: only the winner's unit committed anything.
"""

from __future__ import annotations

import asyncio
from typing import Any

from agentkeep.clock import SettableClock
from agentkeep.errors import HeadRevisionConflict, SessionExecutionLeaseExpired
from agentkeep.runs.domain import RunStatus
from agentkeep.sessions.domain import (
    Acquired,
    AcquireOutcome,
    ClaimBoundary,
    NextTurnIngress,
    PendingTurnInputDraft,
    QueuedWorkDraft,
    QueuedWorkPayload,
    SessionExecutionLease,
)
from agentkeep.sessions.records import RuntimeCommitResult
from tests.racing import SPAWN, run_processes

from .support import (
    SID,
    T0,
    TTL,
    A,
    B,
    Observer,
    new_run,
    open_astore,
    rows,
    run_status,
    runtime_commit,
    session_state,
    transition_racer,
)

RACERS = 50


def acquired(outcome: AcquireOutcome) -> SessionExecutionLease:
    assert isinstance(outcome, Acquired), outcome
    return outcome.lease


# --------------------------------------------------------------------------
# try_transition


def test_fifty_tasks_of_one_loop_one_transition_wins(async_url: str) -> None:
    async def scenario() -> None:
        astore = await open_astore(async_url)
        try:
            await astore.runs.create(new_run("R-race"))
            results = await asyncio.gather(
                *(
                    astore.runs.try_transition("R-race", RunStatus.PENDING, RunStatus.RUNNING)
                    for _ in range(RACERS)
                )
            )
            assert sorted(results) == [False] * (RACERS - 1) + [True]
            assert astore.engine.pool.checkedout() == 0
        finally:
            await astore.close()

    asyncio.run(scenario())
    assert run_status(async_url, "R-race") == RunStatus.RUNNING.value


class Lost(Exception):
    """Raised by a racing unit whose transition lost: its unit rolls back."""


def test_fifty_units_of_one_loop_one_transition_wins(async_url: str) -> None:
    async def racer(astore: Any, i: int) -> bool:
        try:
            async with astore.write() as uow:
                await uow.runs.create(new_run(f"R-unit-{i}"))
                if not await uow.runs.try_transition(
                    "R-race", RunStatus.PENDING, RunStatus.RUNNING
                ):
                    raise Lost
            return True
        except Lost:
            return False

    async def scenario() -> list[bool]:
        astore = await open_astore(async_url)
        try:
            await astore.runs.create(new_run("R-race"))
            results = await asyncio.gather(*(racer(astore, i) for i in range(RACERS)))
            assert astore.engine.pool.checkedout() == 0
            return list(results)
        finally:
            await astore.close()

    results = asyncio.run(scenario())
    assert results.count(True) == 1, results
    winner = results.index(True)
    assert run_status(async_url, "R-race") == RunStatus.RUNNING.value
    created = rows(async_url, "SELECT id FROM runs WHERE id LIKE 'R-unit-%'")
    assert created == [(f"R-unit-{winner}",)]


def test_two_processes_each_with_its_loop_one_transition_wins(async_url: str) -> None:
    async def create() -> None:
        astore = await open_astore(async_url)
        try:
            await astore.runs.create(new_run("R-procs"))
        finally:
            await astore.close()

    asyncio.run(create())
    barrier = SPAWN.Barrier(2)
    per_process = RACERS // 2
    results = run_processes(
        [
            (transition_racer, (async_url, "R-procs", per_process, barrier)),
            (transition_racer, (async_url, "R-procs", per_process, barrier)),
        ]
    )
    flat = [r for process in results for r in process]
    assert len(flat) == 2 * per_process
    assert flat.count(True) == 1, results
    assert run_status(async_url, "R-procs") == RunStatus.RUNNING.value


# --------------------------------------------------------------------------
# Lease takeover


def _claims_of(url: str, owner_id: str) -> list[tuple[Any, ...]]:
    """Queued-work and turn-input rows whose claim names ``owner_id`` (any generation)."""
    return rows(
        url,
        "SELECT batch_id FROM queued_work_batches WHERE claim_owner_id = :o"
        " UNION ALL SELECT input_id FROM pending_turn_inputs WHERE claim_owner_id = :o",
        o=owner_id,
    )


def test_lease_takeover_refuses_the_zombie(async_url: str) -> None:
    """A holds the lease and claimed work; it stalls past the expiry and B reclaims.

    Zombie A (still running, still holding its generation's fence and claim)
    then tries to claim queued work and turn inputs, to commit its turn
    (completing its old claim), to renew and to release: every fenced call
    is refused with ``SessionExecutionLeaseExpired`` naming the session, the
    release is a silent no-op, and no row changes. The same calls again,
    concurrently with B's claims: A is refused, B gets the work and commits.
    """

    async def scenario() -> None:
        clock = SettableClock(T0)
        worker_a = await open_astore(async_url, clock)
        worker_b = await open_astore(async_url, clock)
        try:
            batch = await worker_a.queue.enqueue_queued_work(
                QueuedWorkDraft(
                    session_id=SID, payloads=(QueuedWorkPayload(kind="user_input", body=1),)
                )
            )
            await worker_a.turn_inputs.enqueue_pending_turn_input(
                PendingTurnInputDraft(
                    session_id=SID, ingress=NextTurnIngress(), input={"text": "next"}
                )
            )
            a = acquired(await worker_a.leases.try_claim_session_execution_lease(SID, A, TTL))
            await worker_a.commits.commit_runtime_state(runtime_commit(a, "t1", 0))
            a_claim = await worker_a.queue.claim_ready_queued_work(SID, a, A, ClaimBoundary.IDLE, 8)
            assert a_claim is not None
            assert batch.batch_id in {x.batch_id for x in a_claim.batches}

            clock.advance(TTL + 1)  # A stalls past its lease
            b = acquired(await worker_b.leases.reclaim_session_execution_lease(SID, B, a, TTL))
            assert b.fencing_token == a.fencing_token + 1

            def zombie_calls() -> list[Any]:
                return [
                    worker_a.queue.claim_ready_queued_work(SID, a, A, ClaimBoundary.IDLE, 8),
                    worker_a.turn_inputs.claim_next_turn_inputs(SID, a, A, 5),
                    worker_a.commits.commit_runtime_state(
                        runtime_commit(
                            a,
                            "zombie",
                            1,
                            parent="t1-b",
                            completed_queue_claims=(a_claim.completion(),),
                        )
                    ),
                    worker_a.leases.renew_session_execution_lease(a, TTL),
                    worker_a.leases.ensure_session_execution_lease(a),
                ]

            # Zombie A alone: refused, nothing changes.
            before = session_state(async_url)
            refused = await asyncio.gather(*zombie_calls(), return_exceptions=True)
            for outcome in refused:
                assert isinstance(outcome, SessionExecutionLeaseExpired), refused
                assert outcome.session_id == SID
            await worker_a.leases.release_session_execution_lease(a)  # a silent no-op
            assert session_state(async_url) == before

            # Zombie A and worker B concurrently.
            *zombie, b_queue, b_inputs = await asyncio.gather(
                *zombie_calls(),
                worker_b.queue.claim_ready_queued_work(SID, b, B, ClaimBoundary.IDLE, 8),
                worker_b.turn_inputs.claim_next_turn_inputs(SID, b, B, 5),
                return_exceptions=True,
            )
            assert all(isinstance(z, SessionExecutionLeaseExpired) for z in zombie), zombie
            assert b_queue is not None and not isinstance(b_queue, BaseException), b_queue
            assert b_inputs is not None and not isinstance(b_inputs, BaseException), b_inputs
            assert b_queue.session_lease_generation == b.fencing_token
            committed = await worker_b.commits.commit_runtime_state(
                runtime_commit(
                    b,
                    "t2",
                    1,
                    parent="t1-b",
                    completed_queue_claims=(b_queue.completion(),),
                    completed_turn_input_claims=(b_inputs.completion(),),
                )
            )
            assert isinstance(committed, RuntimeCommitResult)
            assert committed.head_revision == 2
            await worker_b.leases.ensure_session_execution_lease(b)
            lease = await worker_b.leases.get_session_execution_lease(SID)
            assert lease is not None and lease.owner == B
            assert lease.fencing_token == b.fencing_token
        finally:
            await worker_a.close()
            await worker_b.close()

    asyncio.run(scenario())
    with Observer(async_url) as seen:
        assert seen.turns() == ["t1", "t2"]  # nothing of the zombie's turn
    assert _claims_of(async_url, A.owner_id) == []  # B's claims replaced A's, A made none since
    owners = rows(
        async_url,
        "SELECT lease_owner_id FROM session_execution_leases WHERE session_id = :s",
        s=SID,
    )
    assert owners == [(B.owner_id,)]


# --------------------------------------------------------------------------
# Head compare-and-set


COMMITTERS = 8


def test_concurrent_commits_against_one_head_one_wins(async_url: str) -> None:
    async def scenario() -> None:
        astore = await open_astore(async_url)
        try:
            fence = acquired(await astore.leases.try_claim_session_execution_lease(SID, A, TTL))
            await astore.commits.commit_runtime_state(runtime_commit(fence, "base", 0))
            head = await astore.commits.get_head_revision(SID)
            assert head == 1
            results = await asyncio.gather(
                *(
                    astore.commits.commit_runtime_state(
                        runtime_commit(fence, f"c{i}", head, parent="base-b")
                    )
                    for i in range(COMMITTERS)
                ),
                return_exceptions=True,
            )
            won = [i for i, r in enumerate(results) if isinstance(r, RuntimeCommitResult)]
            assert len(won) == 1, results
            assert results[won[0]].head_revision == head + 1  # type: ignore[union-attr]
            lost = [r for i, r in enumerate(results) if i != won[0]]
            assert all(isinstance(r, HeadRevisionConflict) for r in lost), lost
            assert await astore.commits.get_head_revision(SID) == head + 1
            return_value = won[0]
        finally:
            await astore.close()
        with Observer(async_url) as seen:
            committed = seen.turns()
        assert committed == sorted(["base", f"c{return_value}"])

    asyncio.run(scenario())


def test_concurrent_committing_units_against_one_head_one_wins(async_url: str) -> None:
    """Each committer commits its turn and creates a run in one unit: one unit commits."""

    async def committer(astore: Any, fence: Any, head: int, i: int) -> BaseException | None:
        try:
            async with astore.write() as uow:
                await uow.runs.create(new_run(f"R-c{i}"))
                await uow.commits.commit_runtime_state(
                    runtime_commit(fence, f"c{i}", head, parent="base-b")
                )
        except HeadRevisionConflict as lost:
            return lost
        return None

    async def scenario() -> int:
        astore = await open_astore(async_url)
        try:
            fence = acquired(await astore.leases.try_claim_session_execution_lease(SID, A, TTL))
            await astore.commits.commit_runtime_state(runtime_commit(fence, "base", 0))
            results = await asyncio.gather(
                *(committer(astore, fence, 1, i) for i in range(COMMITTERS))
            )
            won = [i for i, r in enumerate(results) if r is None]
            assert len(won) == 1, results
            assert await astore.commits.get_head_revision(SID) == 2
            return won[0]
        finally:
            await astore.close()

    winner = asyncio.run(scenario())
    with Observer(async_url) as seen:
        assert seen.turns() == sorted(["base", f"c{winner}"])
    assert rows(async_url, "SELECT id FROM runs") == [(f"R-c{winner}",)]
