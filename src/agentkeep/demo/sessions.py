"""Demo scenario of the session store: worker processes contend for session leases.

The parent enqueues queued-work batches and next-turn inputs on a few
sessions. One "doomed" worker acquires a session's lease, claims work and is
killed with SIGKILL in the middle of its claim. Then several worker processes
loop: take a session's lease (``try_claim``; after the doomed worker's lease
expires, a live worker acquires it with a higher fencing token), claim ready
batches and turn inputs, and end each turn with ``commit_runtime_state``
(append a node, a checkpoint, usage, a turn stamp, the claim completions)
expecting the head revision it read, then release.

Afterwards the parent checks: every batch and every input was completed
exactly once (nothing lost, nothing done twice — including the doomed
worker's claim, which the new generation re-claimed), every session's fencing
tokens as handed out are distinct and increasing, and the reclaiming
generation is above the killed worker's; head revisions are gap-free per
session, no turn was committed twice, and each session's graph is one chain
(the store's invariants: docs/sessions.md#invariants).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import secrets
import signal
import time
from collections import Counter, defaultdict
from typing import Any

from agentkeep.demo.report import Report
from agentkeep.errors import SessionExecutionLeaseExpired
from agentkeep.sessions.domain import (
    Acquired,
    ClaimBoundary,
    LeaseOwnerIdentity,
    NextTurnIngress,
    PendingTurnInputDraft,
    QueuedWorkDraft,
    QueuedWorkPayload,
)
from agentkeep.sessions.liveness import capture_liveness
from agentkeep.sessions.records import (
    ActivePathScope,
    AppendNodes,
    HydratedSessionCheckpoint,
    RuntimeCommit,
    SessionNodeRecord,
    TokenUsage,
    TurnCommitStamp,
    UsageDelta,
)
from agentkeep.store import Store

__all__ = ["run"]

TTL_MS = 800


def _owner(name: str) -> LeaseOwnerIdentity:
    return LeaseOwnerIdentity(
        owner_id=name, incarnation_id=f"{name}:{os.getpid()}", liveness=capture_liveness()
    )


def _doomed(url: str, session_id: str, ready: Any) -> None:
    """Take the lease and a claim, report, then wait to be killed."""
    store = Store.open(url)
    owner = _owner("doomed")
    outcome = store.leases.try_claim_session_execution_lease(session_id, owner, TTL_MS)
    assert isinstance(outcome, Acquired)
    lease = outcome.lease
    claim = store.queue.claim_ready_queued_work(session_id, lease, owner, ClaimBoundary.IDLE, 2)
    inputs = store.turn_inputs.claim_next_turn_inputs(session_id, lease, owner, 2)
    ready.put(
        (
            lease.fencing_token,
            [b.batch_id for b in claim.batches] if claim else [],
            [i.input_id for i in inputs.inputs] if inputs else [],
        )
    )
    signal.pause()


#: How long a worker waits for the others to start (imports included).
_READY_S = 300.0


def _worker(
    url: str, sessions: list[str], worker: int, seconds: float, ready: Any, out: Any
) -> None:
    events: dict[str, Any] = {"batches": [], "inputs": [], "fencing": [], "turns": [], "ops": 0}
    try:
        store = Store.open(url)
        owner = _owner(f"worker-{worker}")
        # Every worker has started (spawned interpreters import slowly on a
        # loaded machine): only now does the time window begin.
        ready.wait(timeout=_READY_S)
        deadline = time.time() + seconds
        idle_rounds = 0
        while time.time() < deadline and idle_rounds < 40:
            did = False
            for sid in sessions[worker % len(sessions) :] + sessions[: worker % len(sessions)]:
                outcome = store.leases.try_claim_session_execution_lease(sid, owner, TTL_MS)
                events["ops"] += 1
                if not isinstance(outcome, Acquired):
                    continue
                lease = outcome.lease
                events["fencing"].append((sid, lease.fencing_token, time.time()))
                did |= _drain(store, sid, lease, owner, events)
                store.leases.release_session_execution_lease(lease)
                events["ops"] += 1
            idle_rounds = 0 if did else idle_rounds + 1
            if not did:
                time.sleep(0.05)
        store.close()
    except BaseException as exc:  # report, never hang the parent
        events["error"] = f"{type(exc).__name__}: {exc}"
    out.put((worker, events))


def _drain(store: Store, sid: str, lease: Any, owner: LeaseOwnerIdentity, events: Any) -> bool:
    """Run turns while there is work: claim, then commit the turn completing the claims."""
    did = False
    try:
        while True:
            claim = store.queue.claim_ready_queued_work(sid, lease, owner, ClaimBoundary.IDLE, 3)
            tclaim = store.turn_inputs.claim_next_turn_inputs(sid, lease, owner, 3)
            events["ops"] += 2
            if claim is None and tclaim is None:
                break
            revision = store.commits.get_head_revision(sid)
            turn_id = f"turn-{secrets.token_hex(6)}"
            node = SessionNodeRecord(
                node_id=f"n-{turn_id}",
                parent_node_id=_leaf(store, sid),
                timestamp=int(time.time()),
                payload={"worker": owner.owner_id},
            )
            result = store.commits.commit_runtime_state(
                RuntimeCommit(
                    session_id=sid,
                    expected_head_revision=revision,
                    session_execution_lease=lease,
                    graph=AppendNodes(nodes=(node,), leaf_node_id=node.node_id),
                    checkpoint=HydratedSessionCheckpoint(turn_state={"turn": turn_id}),
                    usage_deltas=(
                        UsageDelta(source="demo", model="m", usage=TokenUsage(input_tokens=1)),
                    ),
                    turn_commit=TurnCommitStamp(
                        session_id=sid, turn_id=turn_id, turn_commit_hash=turn_id
                    ),
                    completed_queue_claims=(claim.completion(),) if claim else (),
                    completed_turn_input_claims=(tclaim.completion(),) if tclaim else (),
                )
            )
            events["ops"] += 2
            events["turns"].append((sid, result.head_revision, turn_id))
            if claim:
                events["batches"].extend(b.batch_id for b in claim.batches)
            if tclaim:
                events["inputs"].extend(i.input_id for i in tclaim.inputs)
            did = True
    except SessionExecutionLeaseExpired:
        events["lost_lease"] = events.get("lost_lease", 0) + 1
    return did


def _leaf(store: Store, sid: str) -> str | None:
    read = store.commits.load_session(sid, ActivePathScope())
    return None if read is None else read.graph.leaf_node_id


def run(url: str, *, workers: int = 4, ops: int = 200, sessions: int = 3) -> Report:
    """Race ``workers`` processes over ``sessions`` sessions with work sized by ``ops``."""
    report = Report()
    tag = secrets.token_hex(4)
    sids = [f"demo-{tag}-{n}" for n in range(sessions)]
    per_session = max(4, ops // 10)
    store = Store.open(url, migrate=True)
    enqueued: set[str] = set()
    submitted: set[str] = set()
    for sid in sids:
        for n in range(per_session):
            batch = store.queue.enqueue_queued_work(
                QueuedWorkDraft(
                    session_id=sid,
                    payloads=(QueuedWorkPayload(kind="user_message", body={"n": n}),),
                )
            )
            enqueued.add(batch.batch_id)
            item = store.turn_inputs.enqueue_pending_turn_input(
                PendingTurnInputDraft(session_id=sid, ingress=NextTurnIngress(), input={"n": n})
            )
            submitted.add(item.input_id)

    ctx = mp.get_context("spawn")
    ready = ctx.Queue()
    doomed = ctx.Process(target=_doomed, args=(url, sids[0], ready), daemon=True)
    doomed.start()
    doomed_fencing, doomed_batches, doomed_inputs = ready.get(timeout=120)
    doomed.kill()  # SIGKILL mid-claim: its lease and claim stay behind
    doomed.join(30)
    report.figure("killed worker's generation on session 0", str(doomed_fencing))
    report.figure(
        "batches / inputs it held when killed", f"{len(doomed_batches)} / {len(doomed_inputs)}"
    )

    out = ctx.Queue()
    started_together = ctx.Barrier(workers)
    procs = [
        ctx.Process(target=_worker, args=(url, sids, w, 60.0, started_together, out), daemon=True)
        for w in range(workers)
    ]
    started = time.perf_counter()
    for p in procs:
        p.start()
    results = dict(out.get(timeout=_READY_S + 180) for _ in procs)
    elapsed = time.perf_counter() - started
    for p in procs:
        p.join(timeout=30)

    errors = [f"worker {w}: {ev['error']}" for w, ev in results.items() if "error" in ev]
    report.check("every worker finished without error", not errors, "; ".join(errors))
    completed = Counter(b for ev in results.values() for b in ev["batches"])
    inputs_done = Counter(i for ev in results.values() for i in ev["inputs"])
    total_ops = sum(ev["ops"] for ev in results.values())
    report.figure("sessions x batches x inputs", f"{sessions} x {per_session} x {per_session}")
    report.figure("store operations (workers)", str(total_ops))
    report.figure("throughput incl. lease waits", f"{total_ops / elapsed:,.0f} ops/s")

    report.check(
        "every batch completed exactly once",
        set(completed) == enqueued and all(n == 1 for n in completed.values()),
        f"{len(completed)}/{len(enqueued)} completed, "
        f"{sum(n > 1 for n in completed.values())} twice",
    )
    report.check(
        "every turn input completed exactly once",
        set(inputs_done) == submitted and all(n == 1 for n in inputs_done.values()),
        f"{len(inputs_done)}/{len(submitted)}",
    )
    left = [b for sid in sids for b in store.queue.list_queued_work(sid)]
    report.check("the queues are empty", not left, f"{len(left)} left")
    report.check(
        "the killed worker's claimed batches and inputs were re-claimed and completed once",
        bool(doomed_batches and doomed_inputs)
        and all(completed.get(b) == 1 for b in doomed_batches)
        and all(inputs_done.get(i) == 1 for i in doomed_inputs),
    )
    by_session: dict[str, list[tuple[float, int]]] = defaultdict(list)
    for ev in results.values():
        for sid, fencing, at in ev["fencing"]:
            by_session[sid].append((at, fencing))
    distinct = all(len({f for _, f in v}) == len(v) for v in by_session.values())
    report.check("fencing tokens handed out are distinct per session", distinct)
    increasing = all(
        [f for _, f in sorted(v)] == sorted(f for _, f in v) for v in by_session.values()
    )
    report.check("fencing tokens increase in acquisition order", increasing)
    first_after = min((f for _, f in by_session.get(sids[0], [])), default=0)
    report.check(
        "the session of the killed worker was reclaimed with a higher fencing token",
        first_after > doomed_fencing,
        f"{doomed_fencing} -> {first_after}",
    )
    turns = [t for ev in results.values() for t in ev["turns"]]
    by_sid: dict[str, list[int]] = defaultdict(list)
    for sid, revision, _ in turns:
        by_sid[sid].append(revision)
    heads = {sid: store.commits.get_head_revision(sid) for sid in sids}
    report.figure("turns committed", str(len(turns)))
    report.check(
        "head revisions are gap-free per session (1..head, each once)",
        all(sorted(by_sid[sid]) == list(range(1, heads[sid] + 1)) for sid in sids),
        ", ".join(f"{sid[-1]}: head {heads[sid]}" for sid in sids),
    )
    report.check(
        "no turn was committed twice",
        len({turn for _, _, turn in turns}) == len(turns),
    )
    paths = {sid: store.commits.load_session(sid, ActivePathScope()) for sid in sids}
    report.check(
        "each session's graph is one chain of its turns (never forked)",
        all(
            (p is None and heads[sid] == 0) or (p is not None and len(p.graph.nodes) == heads[sid])
            for sid, p in paths.items()
        ),
    )
    store.close()
    return report
