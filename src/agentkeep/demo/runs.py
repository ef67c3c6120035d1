"""Demo scenario of the run store: worker processes race on a handful of runs.

Every worker process opens its own :class:`~agentkeep.Store` on the URL and,
for a number of rounds, picks a run at random and either

* resumes it — ``try_transition(interrupted → running)``; the winner appends a
  step entry and hands the run back with ``try_transition(running →
  interrupted)``, which must succeed because nobody else may hold it;
* takes an assignment slot — ``acquire_assignee`` (the run-wide generation
  counter advances); or
* releases a slot the fenced way — reads the holder and
  ``vacate_assignee(expected_gen=<its gen>)``, which may come back ``Stale``.

Afterwards the parent checks: no resume was won twice at once (every
hand-back succeeded, and each run's log holds exactly the resumes the workers
won), generations are distinct and gap-free per run (1..G), and no step entry
was lost or duplicated (the generation model: docs/runs.md#the-assignment-model).
"""

from __future__ import annotations

import multiprocessing as mp
import random
import secrets
import time
from collections import Counter, defaultdict
from typing import Any

from agentkeep.demo.report import Report
from agentkeep.runs.domain import Released, RunRecord, RunStatus, StepEntry
from agentkeep.store import Store

__all__ = ["run"]

_SLOTS = ("planner", "executor", "reviewer")


def _worker(url: str, run_ids: list[str], worker: int, ops: int, barrier: Any, out: Any) -> None:
    rng = random.Random(worker * 7919 + 17)
    events: dict[str, Any] = {"won": [], "handback_lost": 0, "gens": [], "steps": [], "ops": 0}
    try:
        store = Store.open(url)
        # The wait covers the slowest worker's start-up (imports included).
        barrier.wait(timeout=300)
        events["start"] = time.time()
        for i in range(ops):
            rid = rng.choice(run_ids)
            pick = rng.random()
            if pick < 0.4:
                events["ops"] += 1
                if store.runs.try_transition(rid, RunStatus.INTERRUPTED, RunStatus.RUNNING):
                    step_id = f"ST-w{worker}-{i}"
                    store.runs.append_step_entry(
                        rid,
                        StepEntry.basic(step_id, f"w{worker}", "resumed", None, int(time.time())),
                    )
                    events["won"].append(rid)
                    events["steps"].append((rid, step_id))
                    events["ops"] += 2
                    if not store.runs.try_transition(rid, RunStatus.RUNNING, RunStatus.INTERRUPTED):
                        events["handback_lost"] += 1
            elif pick < 0.8:
                gen, _ = store.runs.acquire_assignee(
                    rid, rng.choice(_SLOTS), f"S-w{worker}", f"demo worker {worker}"
                )
                events["gens"].append((rid, gen))
                events["ops"] += 1
            else:
                slot = rng.choice(_SLOTS)
                held = store.runs.get(rid).current.get(slot)
                events["ops"] += 1
                if held is not None:
                    outcome = store.runs.vacate_assignee(rid, slot, held.gen)
                    events["ops"] += 1
                    if isinstance(outcome, Released):
                        events["gens"].append((rid, outcome.generation))
        events["end"] = time.time()
        store.close()
    except BaseException as exc:  # report, never hang the parent
        events["error"] = f"{type(exc).__name__}: {exc}"
    out.put((worker, events))


def run(url: str, *, workers: int = 4, ops: int = 200, runs: int = 6) -> Report:
    """Race ``workers`` processes for ``ops`` rounds each over ``runs`` runs at ``url``."""
    report = Report()
    tag = secrets.token_hex(4)
    store = Store.open(url, migrate=True)
    run_ids = [f"R-demo-{tag}-{n}" for n in range(runs)]
    now = int(time.time())
    for rid in run_ids:
        store.runs.create(RunRecord.new(rid, f"T-demo-{tag}", now, status=RunStatus.INTERRUPTED))

    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(workers)
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(url, run_ids, w, ops, barrier, out), daemon=True)
        for w in range(workers)
    ]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=30)

    errors = [f"worker {w}: {ev['error']}" for w, ev in results.items() if "error" in ev]
    report.check("every worker finished without error", not errors, "; ".join(errors))
    if errors:
        store.close()
        return report

    elapsed = max(ev["end"] for ev in results.values()) - min(
        ev["start"] for ev in results.values()
    )
    records = {rid: store.runs.get(rid) for rid in run_ids}
    store.close()
    total_ops = sum(ev["ops"] for ev in results.values())
    won = Counter(rid for ev in results.values() for rid in ev["won"])
    report.figure("workers x rounds", f"{workers} x {ops}")
    report.figure("store operations", str(total_ops))
    report.figure("throughput (all workers)", f"{total_ops / elapsed:,.0f} ops/s")
    report.figure("resumes won", str(sum(won.values())))

    lost = sum(ev["handback_lost"] for ev in results.values())
    report.check(
        "no transition won twice (every winner's hand-back succeeded)", lost == 0, f"{lost} lost"
    )
    logged = {rid: len(rec.step_entries) for rid, rec in records.items()}
    report.check(
        "each run's log holds exactly the resumes won",
        all(logged[rid] == won.get(rid, 0) for rid in run_ids),
        ", ".join(f"{rid[-1]}: {logged[rid]}/{won.get(rid, 0)}" for rid in run_ids),
    )
    report.check(
        "every run is back to interrupted",
        all(rec.status is RunStatus.INTERRUPTED for rec in records.values()),
    )

    gens: dict[str, list[int]] = defaultdict(list)
    for ev in results.values():
        for rid, gen in ev["gens"]:
            gens[rid].append(gen)
    gap_free = all(
        sorted(gens[rid]) == list(range(1, records[rid].next_generation + 1)) for rid in run_ids
    )
    report.figure("generations handed out", str(sum(len(g) for g in gens.values())))
    report.check("generations distinct and gap-free per run (1..G)", gap_free)
    holders_ok = all(
        len({a.gen for a in rec.current.values()}) == len(rec.current)
        and all(a.gen <= rec.next_generation for a in rec.current.values())
        for rec in records.values()
    )
    report.check("holders carry distinct generations <= G", holders_ok)

    appended = Counter((rid, sid) for ev in results.values() for rid, sid in ev["steps"])
    stored = Counter(
        (rid, str(e.step_id)) for rid, rec in records.items() for e in rec.step_entries
    )
    report.check(
        "no step entry lost or duplicated",
        appended == stored and all(n == 1 for n in stored.values()),
        f"{sum(appended.values())} appended, {sum(stored.values())} stored",
    )
    return report
