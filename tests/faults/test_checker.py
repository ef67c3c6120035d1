"""The campaign's checker finds what it must: each kind of loss or doubling is reported.

One worker runs a short, fault-free workload (every action of the campaign)
in this process; the checker must find nothing. Then the database and the
journal are damaged the ways a broken store would damage them (an acked row
lost, a turn's usage counted twice, a generation or a fencing token handed
out wrongly), and the checker must report each under its invariant.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agentkeep.store import Store
from tests.faults.campaign import seed
from tests.faults.checker import check
from tests.faults.journal import Journal, read_journals
from tests.faults.worker import Worker
from tests.support import raw_exec


def _workload(url: str, directory: Path) -> list[dict[str, Any]]:
    seed(url)
    with Store.open(url) as store:
        journal = Journal(directory, 0, 1)
        worker = Worker(store, journal, 0, 1, seed=7)
        for action, times in (
            (worker.runs_lifecycle, 2),
            (worker.runs_assign, 4),
            (worker.runs_vacate, 2),
            (worker.enqueue_work, 6),
            (worker.enqueue_input, 6),
            (worker.session_turns, 4),
            (worker.enqueue_work, 3),  # these stay queued
            (worker.boundary, 3),
            (worker.bare_boundary, 2),
        ):
            for _ in range(times):
                action()
        journal.close()
    return read_journals(directory)


def _first(entries: list[dict[str, Any]], kind: str, **match: Any) -> dict[str, Any]:
    return next(e for e in entries if e["k"] == kind and all(e[k] == v for k, v in match.items()))


def test_checker_reports_each_kind_of_damage(db_url: str, tmp_path: Path) -> None:
    entries = _workload(db_url, tmp_path)
    assert not [e for e in entries if e["k"] == "bad"], entries
    baseline = check(db_url, entries)
    assert not baseline.violations, baseline.violations
    assert baseline.instances > 50

    run = _first(entries, "run_create")
    commit = _first(entries, "commit")
    queued = [e for e in entries if e["k"] == "q_enq"][-1]
    receipt = _first(entries, "boundary")
    item = _first(entries, "ti_enq")
    raw_exec(
        db_url,
        "DELETE FROM runs WHERE id = :rid",
        params={"rid": run["rid"]},
    )
    raw_exec(
        db_url,
        "DELETE FROM runtime_turn_commits WHERE session_id = :sid AND turn_id = :turn",
        params={"sid": commit["sid"], "turn": commit["turn"]},
    )
    raw_exec(  # one turn's usage counted twice
        db_url,
        "INSERT INTO usage_deltas (session_id, source, model, input_tokens, output_tokens, "
        "cache_read_input_tokens, cache_write_input_tokens, reasoning_output_tokens) "
        "VALUES (:sid, 'faults', 'm', 1, 0, 0, 0, 0)",
        params={"sid": commit["sid"]},
    )
    raw_exec(
        db_url,
        "DELETE FROM queued_work_batches WHERE batch_id = :bid",
        params={"bid": queued["bid"]},
    )
    raw_exec(
        db_url,
        "DELETE FROM runtime_boundary_receipts WHERE run_id = :run",
        params={"run": receipt["run"]},
    )
    raw_exec(
        db_url,
        "DELETE FROM pending_turn_inputs WHERE input_id = :iid",
        params={"iid": item["iid"]},
    )
    gen = _first(entries, "run_gen")
    lease = _first(entries, "lease")
    late = max(e.get("t1", 0) for e in entries) + 1
    forged = [
        # a generation handed out again, after a higher one had been acked
        {**gen, "gen": 1, "t0": late, "t1": late + 1},
        {**gen, "gen": 10**6, "t0": late - 0.5, "t1": late - 0.4},
        # a fencing token acked to another incarnation
        {**lease, "inc": "w9i9", "t0": late, "t1": late + 1},
    ]
    damaged = check(db_url, [*entries, *forged])

    violated = {i.name for i in damaged.invariants.values() if i.violations}
    expected = {
        "run: every acked create is stored with its creator's marker",
        "commit: every acked turn is recorded with its hash and revision",
        "head: the turn records' revisions are exactly 1..head",
        "head: the usage ledger counts every turn once",
        "queue: every acked batch is queued or completed by one turn",
        "boundary: every acked receipt is stored as acked",
        "input: every acked input is stored under its source key",
        "run: acked generations are distinct and at most G",
        "run: acked generations increase in real-time order",
        "lease: each acked fencing token belongs to one incarnation",
    }
    assert expected <= violated, expected - violated
