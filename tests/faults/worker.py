"""A fault-campaign worker: a mixed workload over every store, through one-call operations.

One worker *incarnation* (a process) opens its own :class:`~agentkeep.store.Store`
and loops over randomly chosen actions until the stop file appears, or until
the campaign SIGKILLs it:

* **runs**: ``create`` of the run of the current time bucket (every worker
  races to create the same id, each with its own ``input_json`` marker), then
  ``try_transition(pending -> running)``; the winner appends a step entry and
  moves it on with ``try_transition(running -> done)``. ``acquire_assignee`` /
  ``get`` + ``vacate_assignee(expected_gen)`` on a few shared runs (run
  generations).
* **session leases**: ``try_claim``, and ``reclaim`` from a holder whose
  process is gone (a SIGKILLed worker); ``renew`` and ``release`` (fencing tokens).
* **queued work and turn inputs**: enqueue with source keys; claimed under
  the lease and completed by the turn commit (or, for inputs, by
  ``complete_turn_input_claim``); abandoned when the commit is refused.
* **turn commits**: ``commit_runtime_state`` expecting the head revision it
  read, appending node ``n-<session>-<revision>`` (its payload names the
  revision, the turn and the batches and inputs the turn completed, so the
  completions are durable with the commit), a checkpoint, one usage delta
  and a turn stamp; sometimes sent again, which must replay.
* **runtime boundaries**: ``atomic_apply`` of the runtime's session snapshot
  with one more message and a receipt naming it (``conversation_digest`` =
  the message, ``message_count`` = its position) and an input state; or a
  bare receipt with an input state.

Every acknowledged result goes to the incarnation's
:class:`~tests.faults.journal.Journal` after the call returned; refusals
by the store's documented typed errors are noted; any other exception from
a public call (an untyped one, or an agentkeep error this workload cannot
cause) is journaled as ``bad`` with its traceback, and the campaign fails.

``python -m tests.faults.worker URL JOURNAL_DIR SLOT INC SEED STOP_FILE`` runs
one incarnation by hand.
"""

from __future__ import annotations

import os
import random
import sys
import time
import traceback
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

from pydantic import ValidationError

from agentkeep.errors import (
    AgentkeepError,
    ClaimSuperseded,
    CommitOutcomeUnknown,
    HeadRevisionConflict,
    RunDuplicate,
    SessionExecutionLeaseExpired,
    StoreBusy,
)
from agentkeep.runs.domain import Released, RunRecord, RunStatus, StepEntry
from agentkeep.runtime import ReferenceDomain, RunBoundaryReceipt, StoredInputState
from agentkeep.runtime.errors import SessionSnapshotSuperseded, WriteFailed
from agentkeep.sessions.domain import (
    Acquired,
    Busy,
    ClaimBoundary,
    LeaseOwnerIdentity,
    NextTurnIngress,
    PendingTurnInputDraft,
    QueuedWorkClaim,
    QueuedWorkDraft,
    QueuedWorkPayload,
    SessionExecutionLease,
    TurnInputClaim,
)
from agentkeep.sessions.liveness import capture_liveness
from agentkeep.sessions.records import (
    AppendNodes,
    HydratedSessionCheckpoint,
    RuntimeCommit,
    SessionNodeRecord,
    TokenUsage,
    TurnCommitStamp,
    UsageDelta,
)
from agentkeep.store import Store
from tests.faults.journal import Journal

__all__ = [
    "RUNTIMES",
    "SEED_MESSAGES",
    "SESSIONS",
    "SHARED_RUNS",
    "node_id",
    "run_worker",
    "runtime_session_id",
]

SESSIONS: Final = ("fs-0", "fs-1", "fs-2")
SHARED_RUNS: Final = ("R-shared-0", "R-shared-1", "R-shared-2", "R-shared-3")
RUNTIMES: Final = ("rt-0", "rt-1", "rt-2")
#: Messages of each runtime's seeded snapshot (so it is never a placeholder).
SEED_MESSAGES: Final = ("seed-0", "seed-1")
SLOTS: Final = ("planner", "executor", "reviewer")
TASK_ID: Final = "T-faults"
#: Lease ttl: long enough for a few turns, short enough that a lease a killed
#: worker held (and nobody reclaimed) frees itself soon.
TTL_MS: Final = 2_000
#: Every worker races to create the run of the current time bucket.
CREATE_BUCKET_S: Final = 0.25
BUSY_TIMEOUT_MS: Final = 15_000
_NS: Final = uuid.UUID("6f0a8d3e-2b1c-4c5e-9a7d-3e1f0b2c4d5e")

#: The store's documented refusals that this workload provokes on purpose
#: (contention, lost leases) or that faults cause (busy, lost connection).
EXPECTED: Final = (
    StoreBusy,
    RunDuplicate,
    SessionExecutionLeaseExpired,
    HeadRevisionConflict,
    ClaimSuperseded,
    WriteFailed,
    SessionSnapshotSuperseded,
)


def runtime_session_id(runtime_id: str) -> str:
    """The (UUID) session id of a runtime's snapshot."""
    return str(uuid.uuid5(_NS, runtime_id))


def node_id(session_id: str, revision: int) -> str:
    """The id of the graph node the commit creating ``revision`` appends."""
    return f"n-{session_id}-{revision}"


class _Failed:
    """The outcome of a call that raised (already journaled)."""


FAILED: Final = _Failed()


class Worker:
    """One incarnation's workload (see the module docstring)."""

    def __init__(self, store: Store, journal: Journal, slot: int, inc: int, seed: int) -> None:
        self.store = store
        self.journal = journal
        self.slot = slot
        self.inc = inc
        self.rng = random.Random(seed)
        self.tag = f"w{slot}i{inc}"
        self.owner = LeaseOwnerIdentity(
            owner_id=f"faults-w{slot}",
            incarnation_id=f"faults-{self.tag}-{os.getpid()}",
            liveness=capture_liveness(),
        )
        self.domain = ReferenceDomain()
        self.n = 0

    # ------------------------------------------------------------------ calls

    def call(self, op: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, or :data:`FAILED` once its exception is journaled.

        Sets ``self.t0`` / ``self.t1`` around the call for the ack.
        """
        self.t0 = time.monotonic()
        try:
            result = fn(*args, **kwargs)
        except CommitOutcomeUnknown as exc:
            self.journal.note(
                "unknown", op=op, dt=time.monotonic() - self.t0, detail=str(exc)[:300]
            )
            return FAILED
        except EXPECTED as exc:
            self.journal.note("err", op=op, dt=time.monotonic() - self.t0, type=type(exc).__name__)
            return FAILED
        except (AgentkeepError, ValidationError) as exc:
            self._bad(op, "unexpected", exc)
            return FAILED
        except Exception as exc:  # noqa: BLE001 - an untyped error from a public call
            self._bad(op, "raw", exc)
            return FAILED
        self.t1 = time.monotonic()
        self.journal.note("ok", op=op, dt=self.t1 - self.t0)
        return result

    def _bad(self, op: str, what: str, exc: BaseException) -> None:
        self.journal.note(
            "bad",
            op=op,
            what=what,
            type=f"{type(exc).__module__}.{type(exc).__qualname__}",
            tb="".join(traceback.format_exception(exc)),
        )

    def ack(self, kind: str, **fields: Any) -> None:
        self.journal.ack(kind, self.t0, self.t1, **fields)

    def next_n(self) -> int:
        self.n += 1
        return self.n

    # ---------------------------------------------------------------- actions

    def step(self) -> None:
        """One action, chosen at random."""
        action = self.rng.choices(
            (
                self.runs_lifecycle,
                self.runs_assign,
                self.runs_vacate,
                self.enqueue_work,
                self.enqueue_input,
                self.session_turns,
                self.boundary,
                self.bare_boundary,
            ),
            weights=(2, 2, 1, 2, 2, 3, 2, 1),
        )[0]
        action()

    def runs_lifecycle(self) -> None:
        bucket = int(time.time() / CREATE_BUCKET_S)
        rid = f"R-c-{bucket}"
        marker = f"{self.tag}-{self.next_n()}"
        record = RunRecord.new(rid, TASK_ID, created_at=bucket, input_json=marker)
        if self.call("runs.create", self.store.runs.create, record) is None:
            self.ack("run_create", rid=rid, marker=marker)
        runs = self.store.runs
        won = self.call(
            "runs.try_transition", runs.try_transition, rid, RunStatus.PENDING, RunStatus.RUNNING
        )
        if won is not True:
            return
        self.ack("run_trans", rid=rid, to="running")
        step_id = f"ST-{self.tag}-{self.n}"
        entry = StepEntry.basic(step_id, self.tag, "ran", None, int(time.time()))
        if self.call("runs.append_step_entry", runs.append_step_entry, rid, entry) is None:
            self.ack("run_step", rid=rid, step=step_id)
        if (
            self.call(
                "runs.try_transition", runs.try_transition, rid, RunStatus.RUNNING, RunStatus.DONE
            )
            is True
        ):
            self.ack("run_trans", rid=rid, to="done")

    def runs_assign(self) -> None:
        rid = self.rng.choice(SHARED_RUNS)
        got = self.call(
            "runs.acquire_assignee",
            self.store.runs.acquire_assignee,
            rid,
            self.rng.choice(SLOTS),
            f"S-{self.tag}",
            f"fault worker {self.tag}",
        )
        if got is not FAILED:
            self.ack("run_gen", rid=rid, gen=got[0], op="acquire")

    def runs_vacate(self) -> None:
        rid = self.rng.choice(SHARED_RUNS)
        record = self.call("runs.get", self.store.runs.get, rid)
        if record is FAILED:
            return
        slot = self.rng.choice(SLOTS)
        holder = record.current.get(slot)
        if holder is None:
            return
        out = self.call(
            "runs.vacate_assignee", self.store.runs.vacate_assignee, rid, slot, holder.gen
        )
        if isinstance(out, Released):
            self.ack("run_gen", rid=rid, gen=out.generation, op="vacate")

    def enqueue_work(self) -> None:
        sid = self.rng.choice(SESSIONS)
        key = f"q-{self.tag}-{self.next_n()}"
        draft = QueuedWorkDraft(
            session_id=sid,
            source_key=key,
            payloads=(QueuedWorkPayload(kind="user_message", body={"key": key}),),
        )
        batch = self.call("queue.enqueue_queued_work", self.store.queue.enqueue_queued_work, draft)
        if batch is not FAILED:
            self.ack("q_enq", sid=sid, key=key, bid=batch.batch_id)

    def enqueue_input(self) -> None:
        sid = self.rng.choice(SESSIONS)
        key = f"i-{self.tag}-{self.next_n()}"
        draft = PendingTurnInputDraft(
            session_id=sid, source_key=key, ingress=NextTurnIngress(), input={"key": key}
        )
        item = self.call(
            "turn_inputs.enqueue_pending_turn_input",
            self.store.turn_inputs.enqueue_pending_turn_input,
            draft,
        )
        if item is not FAILED:
            self.ack("ti_enq", sid=sid, key=key, iid=item.input_id)

    def _lease(self, sid: str) -> SessionExecutionLease | None:
        leases = self.store.leases
        out = self.call(
            "leases.try_claim",
            leases.try_claim_session_execution_lease,
            sid,
            self.owner,
            TTL_MS,
        )
        if isinstance(out, Busy) and out.holder.owner.incarnation_id != self.owner.incarnation_id:
            # Maybe a SIGKILLed worker's: taken over at once if its process is gone.
            out = self.call(
                "leases.reclaim",
                leases.reclaim_session_execution_lease,
                sid,
                self.owner,
                out.holder,
                TTL_MS,
            )
            op = "reclaim"
        else:
            op = "try_claim"
        if not isinstance(out, Acquired):
            return None
        self.ack("lease", sid=sid, token=out.lease.fencing_token, inc=self.tag, op=op)
        return out.lease

    def session_turns(self) -> None:
        sid = self.rng.choice(SESSIONS)
        lease = self._lease(sid)
        if lease is None:
            return
        turns = self.rng.randint(1, 3)
        for t in range(turns):
            last = t == turns - 1
            release = last and self.rng.random() < 0.5
            if not self._turn(sid, lease, release):
                return
            if release:
                return
            if self.rng.random() < 0.5:
                renewed = self.call(
                    "leases.renew",
                    self.store.leases.renew_session_execution_lease,
                    lease,
                    TTL_MS,
                )
                if renewed is FAILED:
                    return
                self.ack("lease", sid=sid, token=renewed.fencing_token, inc=self.tag, op="renew")
                lease = renewed
        self.call("leases.release", self.store.leases.release_session_execution_lease, lease)

    def _turn(self, sid: str, lease: SessionExecutionLease, release: bool) -> bool:
        """One turn under ``lease``: claim, commit; False when the turn could not commit."""
        queue, inputs, owner = self.store.queue, self.store.turn_inputs, self.owner
        qclaim = self.call(
            "queue.claim_ready_queued_work",
            queue.claim_ready_queued_work,
            sid,
            lease,
            owner,
            ClaimBoundary.IDLE,
            3,
        )
        if qclaim is FAILED:
            return False
        iclaim = self.call(
            "turn_inputs.claim_next_turn_inputs",
            inputs.claim_next_turn_inputs,
            sid,
            lease,
            owner,
            3,
        )
        if iclaim is FAILED:
            self._abandon(qclaim, None)
            return False
        if iclaim is not None and self.rng.random() < 0.25:
            done = self.call(
                "turn_inputs.complete_turn_input_claim",
                inputs.complete_turn_input_claim,
                lease,
                iclaim.completion(),
            )
            if done is FAILED:
                self._abandon(qclaim, iclaim)
                return False
            self.ack("ti_done", sid=sid, iids=[i.input_id for i in iclaim.inputs])
            iclaim = None
        revision = self.call("commits.get_head_revision", self.store.commits.get_head_revision, sid)
        if revision is FAILED:
            self._abandon(qclaim, iclaim)
            return False
        target = revision + 1
        turn = f"turn-{self.tag}-{self.next_n()}"
        batches = [[b.batch_id, b.source_key] for b in qclaim.batches] if qclaim else []
        iids = [i.input_id for i in iclaim.inputs] if iclaim else []
        node = SessionNodeRecord(
            node_id=node_id(sid, target),
            parent_node_id=node_id(sid, revision) if revision else None,
            timestamp=int(time.time()),
            payload={"rev": target, "turn": turn, "batches": batches, "inputs": iids},
        )
        commit = RuntimeCommit(
            session_id=sid,
            expected_head_revision=revision,
            session_execution_lease=lease,
            graph=AppendNodes(nodes=(node,), leaf_node_id=node.node_id),
            checkpoint=HydratedSessionCheckpoint(turn_state={"rev": target, "turn": turn}),
            usage_deltas=(
                UsageDelta(source="faults", model="m", usage=TokenUsage(input_tokens=1)),
            ),
            turn_commit=TurnCommitStamp(session_id=sid, turn_id=turn, turn_commit_hash=turn),
            completed_queue_claims=(qclaim.completion(),) if qclaim else (),
            completed_turn_input_claims=(iclaim.completion(),) if iclaim else (),
            release_session_execution_lease=lease if release else None,
        )
        commits = self.store.commits
        result = self.call("commits.commit_runtime_state", commits.commit_runtime_state, commit)
        if result is FAILED:
            self._abandon(qclaim, iclaim)
            return False
        self.ack(
            "commit",
            sid=sid,
            turn=turn,
            rev=result.head_revision,
            batches=batches,
            inputs=iids,
        )
        if self.rng.random() < 0.15:  # the same turn again: a replay of the stored result
            again = self.call("commits.replay", commits.commit_runtime_state, commit)
            if again is not FAILED:
                self.ack("replay", sid=sid, turn=turn, rev=again.head_revision)
        return True

    def _abandon(self, qclaim: QueuedWorkClaim | None, iclaim: TurnInputClaim | None) -> None:
        if qclaim is not None:
            self.call(
                "queue.abandon_queued_work_claim",
                self.store.queue.abandon_queued_work_claim,
                qclaim,
            )
        if iclaim is not None:
            self.call(
                "turn_inputs.abandon_turn_input_claim",
                self.store.turn_inputs.abandon_turn_input_claim,
                iclaim,
            )

    def boundary(self) -> None:
        rt = self.rng.choice(RUNTIMES)
        runtime = self.store.runtime
        data = self.call("runtime.load_session_snapshot", runtime.load_session_snapshot, rt)
        if data is FAILED or data is None:
            return
        session = self.call("decode the snapshot", self.domain.decode_persisted_session, data)
        if session is FAILED:
            return
        message = f"m-{self.tag}-{self.next_n()}"
        session = session.with_message("user", message)
        iid = str(uuid.uuid4())
        receipt = RunBoundaryReceipt(
            run_id=str(uuid.uuid4()),
            boundary="Turn",
            contributing_input_ids=(iid,),
            conversation_digest=message,
            message_count=len(session.messages),
            sequence=self.n,
        )
        applied = self.call(
            "runtime.atomic_apply",
            runtime.atomic_apply,
            rt,
            self.domain.encode_session(session),
            receipt,
            [StoredInputState.new_accepted(iid)],
            session_store_key=session.id,
        )
        if applied is None:
            self.ack(
                "boundary",
                rt=rt,
                run=receipt.run_id,
                seq=receipt.sequence,
                msg=message,
                count=receipt.message_count,
                iid=iid,
            )

    def bare_boundary(self) -> None:
        rt = self.rng.choice(RUNTIMES)
        iid = str(uuid.uuid4())
        receipt = RunBoundaryReceipt(
            run_id=str(uuid.uuid4()),
            boundary="Bare",
            contributing_input_ids=(iid,),
            message_count=0,
            sequence=self.next_n(),
        )
        state = StoredInputState.new_accepted(iid)
        if (
            self.call(
                "runtime.atomic_apply", self.store.runtime.atomic_apply, rt, None, receipt, [state]
            )
            is None
        ):
            self.ack(
                "boundary",
                rt=rt,
                run=receipt.run_id,
                seq=receipt.sequence,
                msg=None,
                count=0,
                iid=iid,
            )


def open_store(url: str, journal: Journal, stop_file: str) -> Store | None:
    """``Store.open(url)``, retried while it fails with a typed error (faults happen there too).

    None when the stop file appears first. An untyped error is journaled as ``bad``.
    """
    while not os.path.exists(stop_file):
        try:
            return Store.open(url, busy_timeout_ms=BUSY_TIMEOUT_MS)
        except AgentkeepError as exc:
            journal.note("err", op="Store.open", type=type(exc).__name__)
        except Exception as exc:  # noqa: BLE001 - an untyped error from Store.open
            journal.note(
                "bad",
                op="Store.open",
                what="raw",
                type=f"{type(exc).__module__}.{type(exc).__qualname__}",
                tb="".join(traceback.format_exception(exc)),
            )
        time.sleep(0.05)
    return None


def run_worker(url: str, journal_dir: str, slot: int, inc: int, seed: int, stop_file: str) -> None:
    """Run one worker incarnation until ``stop_file`` exists (see the module docstring).

    Creates ``ready-<slot>-<inc>`` in ``journal_dir`` once its store is open.
    """
    journal = Journal(journal_dir, slot, inc)
    started = time.monotonic()
    store = open_store(url, journal, stop_file)
    if store is None:
        return
    journal.note("ready", at=time.monotonic(), dt=time.monotonic() - started)
    worker = Worker(store, journal, slot, inc, seed)
    Path(journal_dir, f"ready-{slot}-{inc}").touch()
    try:
        while not os.path.exists(stop_file):
            worker.step()
        store.close()
    except BaseException as exc:  # a bug of the workload itself: reported, then the exit code
        worker._bad("worker", "crash", exc)
        raise
    finally:
        journal.close()


if __name__ == "__main__":
    url_, dir_, slot_, inc_, seed_, stop_ = sys.argv[1:7]
    run_worker(url_, dir_, int(slot_), int(inc_), int(seed_), stop_)
