"""Demo scenario of the runtime store: racing boundary commits and unregister finalization.

Worker processes, each with its own :class:`~agentkeep.Store`, line up on a
barrier before every step.

**Boundaries.** The parent commits a first head snapshot of one runtime and
prepares a chain of successors (each the one before plus one message). Each
round has three steps:

a. *successive snapshots*: worker ``w`` commits ``atomic_apply`` with the
   round's ``w+1``-th successor of the head, its own receipt and two new input
   states. In any commit order the longest successor commits and ends as the
   head; a shorter one that lands after a longer one is
   ``SessionSnapshotSuperseded``.
b. *stale boundary*: one worker submits the snapshot the round began with,
   after the head advanced, under a new receipt: always superseded, and the
   head, that receipt and its inputs stay unwritten.
c. *same receipt key*: every worker submits the same receipt key (no
   snapshot) with its own inputs: exactly one wins, the others get
   ``WriteFailed``.

**Unregister finalization**, twice (on two runtimes whose ops snapshot
belongs to epoch E): worker 0 finalizes with an injected fault — a lost
acknowledgement (``synthetic_fault(3)``: Ok once the re-read classifies the
commit as durable), then a power cut (``synthetic_fault(1)``: ``WriteFailed``
with nothing written, then a retry converges and a second retry is a no-op).
Meanwhile worker 1 keeps persisting ops snapshots of epoch E and the others
keep reading the lifecycle and the ops row in one read unit. Afterwards every
worker tries to persist and to initialize an ops snapshot of E.

Checked: I1 (every stored receipt's inputs are stored, a superseded or losing
boundary left no receipt and no inputs), I2 (superseded means nothing
written), the receipt-key fence, I6 (a retired epoch refuses
``persist_ops_lifecycle`` and ``initialize_ops_lifecycle_if_absent``, its
marker stays) and I7 (no reader ever saw a final lifecycle next to an ops row
of the retired epoch). The invariants are those of docs/runtime.md#invariants.
"""

from __future__ import annotations

import multiprocessing as mp
import secrets
import time
import uuid
from typing import Any, Final, Literal

from agentkeep.demo.report import Report
from agentkeep.demo.runtime_checks import check_boundaries, check_finalizations
from agentkeep.demo.runtime_shared import EPOCH as _EPOCH
from agentkeep.demo.runtime_shared import OK as _OK
from agentkeep.demo.runtime_shared import RETIRED as _RETIRED
from agentkeep.demo.runtime_shared import digest as _digest
from agentkeep.demo.runtime_shared import observe as _observe
from agentkeep.demo.runtime_shared import split as _split
from agentkeep.runtime import (
    FinalizationPoint,
    InputStatePersistenceRecord,
    MachineLifecycleCommit,
    OpsSnapshot,
    ReferenceDomain,
    RunBoundaryReceipt,
    RuntimeStoreError,
    Session,
    StoredInputState,
    UnregisterFinalizationCommit,
    issue_delete_ops_finalization_authority,
    synthetic_fault,
)
from agentkeep.store import Store

__all__ = ["run"]

_WAIT_S: Final = 120.0
_RESULT_WAIT_S: Final = 600.0
_MAX_POLLS: Final = 100_000
_FAULTS: Final = (3, 1)
_ROLES: Final[tuple[Literal["user"], Literal["assistant"]]] = ("user", "assistant")


def _outcome(call: Any) -> tuple[str, str]:
    """Run ``call``; return ("ok", "") or the runtime-store error's class name and text."""
    try:
        call()
    except RuntimeStoreError as exc:
        return type(exc).__name__, str(exc)
    return _OK, ""


# --------------------------------------------------------------------------
# Worker: boundaries


def _apply(
    store: Store,
    rt: str,
    where: tuple[str, int, int],
    snapshot: bytes | None,
    receipt_key: tuple[str, int],
) -> dict[str, Any]:
    """One ``atomic_apply`` with two new input states that name the step ``where``."""
    phase, rnd, worker = where
    states = [
        StoredInputState(
            input_id=str(uuid.uuid4()),
            current_state="accepted",
            details={"phase": phase, "round": rnd, "worker": worker},
        )
        for _ in range(2)
    ]
    run_id, seq = receipt_key
    receipt = RunBoundaryReceipt(
        run_id=run_id,
        boundary="RunCheckpoint",
        sequence=seq,
        contributing_input_ids=tuple(s.input_id for s in states),
    )
    records = [InputStatePersistenceRecord.from_machine_snapshot(s) for s in states]
    outcome, message = _outcome(lambda: store.runtime.atomic_apply(rt, snapshot, receipt, records))
    return {
        "phase": phase,
        "round": rnd,
        "worker": worker,
        "key": receipt_key,
        "inputs": receipt.contributing_input_ids,
        "outcome": outcome,
        "message": message,
    }


def _boundary_rounds(
    store: Store, rt: str, worker: int, plan: list[dict[str, Any]], barrier: Any
) -> list[dict[str, Any]]:
    applies = []
    for step in plan:
        rnd, run_id = step["round"], step["run_id"]
        barrier.wait(_WAIT_S)
        applies.append(
            _apply(store, rt, ("race", rnd, worker), step["snapshot"], (run_id, worker + 1))
        )
        barrier.wait(_WAIT_S)
        if step["stale"] is not None:
            before = store.runtime.load_session_snapshot(rt)
            rec = _apply(store, rt, ("stale", rnd, worker), step["stale"], (run_id, 0))
            after = store.runtime.load_session_snapshot(rt)
            rec["head_before"] = _digest(before)
            rec["head_unchanged"] = before == after
            applies.append(rec)
        barrier.wait(_WAIT_S)
        applies.append(
            _apply(store, rt, ("same-key", rnd, worker), None, (run_id, step["same_key_seq"]))
        )
    return applies


# --------------------------------------------------------------------------
# Worker: unregister finalization


def _finalize(store: Store, case: dict[str, Any]) -> dict[str, Any]:
    """Worker 0: the faulty finalization, then its retries."""
    rt, fault = case["rt"], case["fault"]
    commit = UnregisterFinalizationCommit(
        lifecycle=MachineLifecycleCommit(runtime_state="retired"),
        input_states=tuple(
            InputStatePersistenceRecord.from_machine_snapshot(
                StoredInputState(
                    input_id=iid, current_state="abandoned", terminal_outcome="unregistered"
                )
            )
            for iid in case["input_ids"]
        ),
        retired_ops_epoch=_EPOCH,
        authority=issue_delete_ops_finalization_authority(),
    )
    points: list[str] = []
    inject = synthetic_fault(fault)

    def hook(at: FinalizationPoint) -> None:
        points.append(str(at))
        inject(at)

    def finalize(fault_hook: Any = None) -> None:
        store.runtime.commit_unregister_finalization(rt, commit, fault_hook=fault_hook)

    first = _outcome(lambda: finalize(hook))
    after_first = _observe(store, rt)
    retries = [_outcome(finalize), _outcome(finalize)]
    return {
        "first": first,
        "points": points,
        "after_first": after_first,
        "retries": retries,
        "after_retries": _observe(store, rt),
    }


def _late_writes(store: Store, rt: str, done: Any) -> dict[str, Any]:
    """Worker 1: persist ops of the epoch being retired until refused (or finalization ended)."""
    accepted = refused = 0
    accepted_after_done = 0
    splits = 0
    for k in range(_MAX_POLLS):
        finished = done.is_set()
        outcome, _ = _outcome(
            lambda k=k: store.runtime.persist_ops_lifecycle(
                rt, OpsSnapshot(epoch_id=_EPOCH, payload={"late": k})
            )
        )
        if outcome == _OK:
            accepted += 1
            accepted_after_done += finished
        elif outcome == _RETIRED:
            refused += 1
        else:
            raise RuntimeError(f"late ops write: {outcome}")
        splits += _split(_observe(store, rt))
        if refused or finished:
            break
    return {
        "accepted": accepted,
        "refused": refused,
        "after_done": accepted_after_done,
        "splits": splits,
        "observations": k + 1,
    }


def _watch(store: Store, rt: str, done: Any) -> dict[str, Any]:
    """Workers 2+: read lifecycle and ops together while the finalization runs."""
    splits = observations = 0
    while observations < _MAX_POLLS:
        finished = done.is_set()
        splits += _split(_observe(store, rt))
        observations += 1
        if finished:
            break
    return {"splits": splits, "observations": observations}


def _finalizations(
    store: Store, worker: int, cases: list[dict[str, Any]], barrier: Any, dones: list[Any]
) -> list[dict[str, Any]]:
    out = []
    for case, done in zip(cases, dones, strict=True):
        rt = case["rt"]
        barrier.wait(_WAIT_S)
        try:
            if worker == 0:
                result = {"role": "finalizer", **_finalize(store, case)}
            elif worker == 1:
                result = {"role": "late-writer", **_late_writes(store, rt, done)}
            else:
                result = {"role": "watcher", **_watch(store, rt, done)}
        finally:
            if worker == 0:
                done.set()
        barrier.wait(_WAIT_S)
        out.append({**result, **_writes_after_retirement(store, rt)})
    return out


def _writes_after_retirement(store: Store, rt: str) -> dict[str, Any]:
    """Every worker, once the epoch is retired: both ops writes of it, then a read."""
    stale = OpsSnapshot(epoch_id=_EPOCH)
    return {
        "persist_after": _outcome(lambda: store.runtime.persist_ops_lifecycle(rt, stale))[0],
        "initialize_after": _outcome(
            lambda: store.runtime.initialize_ops_lifecycle_if_absent(rt, stale)
        )[0],
        "after": _observe(store, rt),
    }


def _worker(
    url: str,
    worker: int,
    rt: str,
    plan: list[dict[str, Any]],
    cases: list[dict[str, Any]],
    barrier: Any,
    dones: list[Any],
    out: Any,
) -> None:
    events: dict[str, Any] = {}
    try:
        with Store.open(url) as store:
            barrier.wait(_WAIT_S)  # every worker started: time the rounds alone
            events["start"] = time.time()
            events["applies"] = _boundary_rounds(store, rt, worker, plan, barrier)
            events["boundaries_end"] = time.time()
            events["finalizations"] = _finalizations(store, worker, cases, barrier, dones)
    except BaseException as exc:  # report, never hang the parent or the other workers
        barrier.abort()
        for done in dones:
            done.set()
        events["error"] = f"{type(exc).__name__}: {exc}"
    out.put((worker, events))


# --------------------------------------------------------------------------
# Parent: setup


def _chain(length: int) -> list[bytes]:
    """A head snapshot (~5 KiB) and ``length`` successors, each one message longer."""
    domain = ReferenceDomain()
    session = Session.new().with_message("system", "You are the agentkeep demo runtime.")
    for i in range(10):
        session = session.with_message(_ROLES[i % 2], f"turn {i}: " + "lorem ipsum dolor " * 25)
    chain = [domain.encode_session(session)]
    for j in range(1, length + 1):
        session = session.with_message(_ROLES[j % 2], f"step {j}: " + "sit amet " * 10)
        chain.append(domain.encode_session(session))
    return chain


def _plans(chain: list[bytes], rounds: int, workers: int) -> list[list[dict[str, Any]]]:
    """Per worker, per round: its successor, the stale snapshot (one worker), receipt keys."""
    run_ids = [str(uuid.uuid4()) for _ in range(rounds)]
    return [
        [
            {
                "round": r,
                "run_id": run_ids[r],
                "snapshot": chain[r * workers + w + 1],
                "stale": chain[r * workers] if w == r % workers else None,
                "same_key_seq": workers + 1,
            }
            for r in range(rounds)
        ]
        for w in range(workers)
    ]


def _setup_case(store: Store, rt: str, fault: int) -> dict[str, Any]:
    """An idle runtime with two accepted inputs and an ops snapshot of the epoch to retire."""
    inputs = [StoredInputState.new_accepted() for _ in range(2)]
    store.runtime.commit_machine_lifecycle(rt, MachineLifecycleCommit(runtime_state="idle"), inputs)
    store.runtime.persist_ops_lifecycle(rt, OpsSnapshot(epoch_id=_EPOCH, payload={"ops": []}))
    return {"rt": rt, "fault": fault, "input_ids": [s.input_id for s in inputs]}


def _spawn(
    url: str,
    rt: str,
    plans: list[list[dict[str, Any]]],
    cases: list[dict[str, Any]],
) -> dict[int, dict[str, Any]]:
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(len(plans))
    dones = [ctx.Event() for _ in cases]
    out = ctx.Queue()
    procs = [
        ctx.Process(
            target=_worker, args=(url, w, rt, plan, cases, barrier, dones, out), daemon=True
        )
        for w, plan in enumerate(plans)
    ]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=_RESULT_WAIT_S) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    return results


# --------------------------------------------------------------------------
# Parent


def run(url: str, *, workers: int = 4, ops: int = 200) -> Report:
    """Race ``workers`` (at least 2) processes on one runtime for rounds sized by ``ops``."""
    report = Report()
    workers = max(2, workers)
    rounds = max(2, min(20, ops // 20))
    rt = f"rt:demo:{secrets.token_hex(4)}"
    store = Store.open(url, migrate=True)
    try:
        chain = _chain(rounds * workers)
        first = RunBoundaryReceipt(run_id=str(uuid.uuid4()), boundary="RunStart", sequence=0)
        store.runtime.atomic_apply(rt, chain[0], first)
        cases = [_setup_case(store, f"{rt}:unregister:fault{f}", f) for f in _FAULTS]
        started = time.perf_counter()
        results = _spawn(url, rt, _plans(chain, rounds, workers), cases)
        elapsed = time.perf_counter() - started
        errors = [
            f"worker {w}: {ev['error']}" for w, ev in sorted(results.items()) if "error" in ev
        ]
        report.check("every worker finished without error", not errors, "; ".join(errors))
        if errors:
            return report
        report.figure("workers x rounds", f"{workers} x {rounds}")
        applies = [a for ev in results.values() for a in ev["applies"]]
        busy = max(ev["boundaries_end"] for ev in results.values()) - min(
            ev["start"] for ev in results.values()
        )
        report.figure("boundary commits/s (incl. barrier waits)", f"{len(applies) / busy:,.0f}")
        report.figure("scenario wall time (incl. process start)", f"{elapsed:.1f} s")
        check_boundaries(report, store, rt, chain, workers, applies)
        check_finalizations(report, store, cases, results)
    finally:
        store.close()
    return report
