"""Run store scale check: per-call cost at a small and a large table (SQLite).

Usage::

    .venv/bin/python benchmarks/bench_runs_scale.py [--n N] [--rounds R] [--sizes 1000 100000]

For each size a fresh migrated file is filled in bulk with raw ``sqlite3``
``executemany`` (typical runs: 3 step entries, one slot holder; 5 runs per
task; statuses rotate running/pending/done). Then, through the store's
one-call methods, it times ``get`` (random ids), ``try_transition`` (random
pending runs, flipped there and back), ``list(status=running, limit=20)`` and
``list_by_task`` (random tasks, 5 runs each), and prints µs per call at each
size and their ratio: with the indexes the cost must stay flat (ratio near 1;
B-tree depth adds a little). For reference the same queries run through raw
``sqlite3`` on copies of the files (the same SQL), so growth that comes from
SQLite itself (deeper B-trees, colder pages, more WAL pages per commit) shows
in the raw columns too. Sizes and variants are timed round by round,
interleaved, so background load hits all alike. Finally the ``EXPLAIN QUERY PLAN`` of every
query at the largest size is printed; the script exits 1 if a plan scans the
table or sorts in a temporary B-tree (an index is missing or unusable).
"""

from __future__ import annotations

import argparse
import random
import sqlite3
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    SEED_SQL,
    SQL,
    STATUS_TEXT,
    copy_db,
    make_template,
    print_table,
    raw_connect,
    raw_record,
    remove_db,
    seed_id,
    seed_rows,
    seed_status,
    seed_task,
    timed,
)

from agentkeep import RunListFilter, RunStatus, Store  # noqa: E402

PER_TASK = 5
FLAT_RATIO = 2.0  # a cost ratio above this between the sizes is reported as not flat


class Workload:
    """Arguments for one size, drawn once from a seeded RNG (the same for every round)."""

    def __init__(self, size: int, calls: int, seed: int = 42) -> None:
        rng = random.Random(seed)
        self.get_ids = [seed_id(rng.randrange(size)) for _ in range(calls)]
        pending = [i for i in range(size) if seed_status(i) is RunStatus.PENDING]
        picked = rng.sample(pending, min(len(pending), 500))
        # call k flips picked[k % p]: pending -> running on even passes, back on odd ones
        p = len(picked)
        fwd = (RunStatus.PENDING, RunStatus.RUNNING)
        back = (RunStatus.RUNNING, RunStatus.PENDING)
        self.transitions = [
            (seed_id(picked[k % p]), *(fwd if (k // p) % 2 == 0 else back)) for k in range(calls)
        ]
        tasks = size // PER_TASK
        self.tasks = [seed_task(rng.randrange(tasks) * PER_TASK, PER_TASK) for _ in range(calls)]
        self.flt = RunListFilter(status=RunStatus.RUNNING, limit=20)


def op_get(store: Store, w: Workload, k: int) -> None:
    store.runs.get(w.get_ids[k])


def op_transition(store: Store, w: Workload, k: int) -> None:
    rid, frm, to = w.transitions[k]
    if not store.runs.try_transition(rid, frm, to):
        raise RuntimeError(f"transition {rid} {frm}->{to} lost")


def op_list_status(store: Store, w: Workload, k: int) -> None:
    if len(store.runs.list(w.flt)) != 20:
        raise RuntimeError("list returned fewer than 20 runs")


def op_list_by_task(store: Store, w: Workload, k: int) -> None:
    if len(store.runs.list_by_task(w.tasks[k])) != PER_TASK:
        raise RuntimeError("list_by_task returned the wrong number of runs")


def raw_get(conn: sqlite3.Connection, w: Workload, k: int) -> None:
    conn.execute("BEGIN DEFERRED")
    row = conn.execute(SQL["get"], {"id": w.get_ids[k]}).fetchone()
    conn.commit()
    raw_record(row)


def raw_transition(conn: sqlite3.Connection, w: Workload, k: int) -> None:
    rid, frm, to = w.transitions[k]
    now = time.time_ns() // 1_000_000_000
    conn.execute("BEGIN IMMEDIATE")
    cur = conn.execute(
        SQL["transition"],
        {"id": rid, "from_": STATUS_TEXT[frm], "to": STATUS_TEXT[to], "now": now},
    )
    conn.commit()
    if cur.rowcount != 1:
        raise RuntimeError(f"transition {rid} {frm}->{to} lost")


def raw_list_status(conn: sqlite3.Connection, w: Workload, k: int) -> None:
    conn.execute("BEGIN DEFERRED")
    rows = conn.execute(
        SQL["list_status"], {"status": STATUS_TEXT[RunStatus.RUNNING], "limit": 20, "offset": 0}
    ).fetchall()
    conn.commit()
    if len([raw_record(r) for r in rows]) != 20:
        raise RuntimeError("list returned fewer than 20 runs")


def raw_list_by_task(conn: sqlite3.Connection, w: Workload, k: int) -> None:
    conn.execute("BEGIN DEFERRED")
    rows = conn.execute(SQL["list_by_task"], {"task_id": w.tasks[k]}).fetchall()
    conn.commit()
    if len([raw_record(r) for r in rows]) != PER_TASK:
        raise RuntimeError("list_by_task returned the wrong number of runs")


# (name, store call, raw sqlite3 equivalent running the repository's SQL)
OPS: list[tuple[str, Callable[[Store, Workload, int], None], Callable[..., None]]] = [
    ("get", op_get, raw_get),
    ("try_transition", op_transition, raw_transition),
    ("list(status,limit=20)", op_list_status, raw_list_status),
    ("list_by_task (5 runs)", op_list_by_task, raw_list_by_task),
]


def build(path: Path, template: Path, size: int) -> float:
    """Copy the migrated template and bulk-insert ``size`` runs; return seconds taken."""
    copy_db(template, path)
    t0 = time.perf_counter()
    conn = raw_connect(path)
    try:
        conn.execute("BEGIN IMMEDIATE")
        conn.executemany(SEED_SQL, seed_rows(size, per_task=PER_TASK))
        conn.commit()
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        conn.close()
    return time.perf_counter() - t0


def plans(path: Path, size: int) -> tuple[list[str], bool]:
    """EXPLAIN QUERY PLAN of each timed query; True if any plan scans or sorts."""
    conn = raw_connect(path)
    out: list[str] = []
    bad = False
    queries: list[tuple[str, str, dict[str, Any]]] = [
        ("get", SQL["get"], {"id": seed_id(size // 2)}),
        (
            "try_transition",
            SQL["transition"],
            {
                "id": seed_id(size // 2),
                "from_": STATUS_TEXT[RunStatus.PENDING],
                "to": STATUS_TEXT[RunStatus.RUNNING],
                "now": 1,
            },
        ),
        (
            "list(status,limit=20)",
            SQL["list_status"],
            {"status": STATUS_TEXT[RunStatus.RUNNING], "limit": 20, "offset": 0},
        ),
        ("list_by_task", SQL["list_by_task"], {"task_id": seed_task(size // 2, PER_TASK)}),
    ]
    try:
        for name, sql, params in queries:
            rows = conn.execute("EXPLAIN QUERY PLAN " + sql, params).fetchall()
            out.append(f"{name}:  {' '.join(sql.split())}")
            for row in rows:
                detail = str(row[-1])
                note = ""
                if (detail.startswith("SCAN runs") and "INDEX" not in detail) or (
                    "TEMP B-TREE FOR ORDER BY" in detail
                ):
                    bad = True
                    note = "   <-- full scan or full sort"
                elif "TEMP B-TREE FOR RIGHT PART OF ORDER BY" in detail:
                    # The index gives the leading order; only rows that tie on it
                    # are sorted (here: one task's runs by seq). Bounded, not a scan.
                    note = "   <-- partial sort of rows tying on the index prefix"
                out.append(f"    {detail}{note}")
    finally:
        conn.close()
    return out, bad


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=1000, help="calls per timed round (default 1000)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds, best kept (default 5)")
    p.add_argument("--warmup", type=int, default=200, help="warm-up calls (default 200)")
    p.add_argument(
        "--sizes", type=int, nargs=2, default=[1_000, 100_000], metavar=("SMALL", "LARGE")
    )
    args = p.parse_args(argv)
    calls = args.warmup + args.rounds * args.n
    small, large = args.sizes
    if small < 3 * PER_TASK or large < small:
        p.error("--sizes: SMALL >= 15 and LARGE >= SMALL")

    with tempfile.TemporaryDirectory(prefix="agentkeep-scale-") as tmp:
        d = Path(tmp)
        template = d / "template.db"
        make_template(template)
        files = {size: d / f"runs-{size}.db" for size in (small, large)}
        for size, f in files.items():
            took = build(f, template, size)
            print(f"built {size:>7,} runs by executemany in {took:.2f} s ({f.stat().st_size:,} B)")
        print(
            f"N={args.n} calls per round, {args.rounds} rounds (best kept), {args.warmup} "
            f"warm-up; one-call store methods; synchronous=NORMAL, WAL, no ANALYZE"
        )

        raw_files = {size: d / f"runs-{size}-raw.db" for size in files}
        for size, f in raw_files.items():
            copy_db(files[size], f)  # the raw side flips its own copy of the rows
        stores = {size: Store.open(f"sqlite:///{f}") for size, f in files.items()}
        conns = {size: raw_connect(f) for size, f in raw_files.items()}
        loads = {size: Workload(size, calls) for size in files}
        results: dict[str, dict[tuple[str, int], float]] = {}
        try:
            for name, fn, raw_fn in OPS:
                loops: dict[tuple[str, int], Callable[[int, int], None]] = {}
                for size in files:
                    for kind, target, f in (
                        ("store", stores[size], fn),
                        ("raw", conns[size], raw_fn),
                    ):

                        def loop(
                            start: int,
                            n: int,
                            t: Any = target,
                            w: Workload = loads[size],
                            f: Any = f,
                        ) -> None:
                            for k in range(start, start + n):
                                f(t, w, k)

                        loops[(kind, size)] = loop
                        loop(0, args.warmup)
                keys = list(loops)
                best = {key: float("inf") for key in keys}
                for r in range(args.rounds):
                    start = args.warmup + r * args.n
                    for key in keys[r % len(keys) :] + keys[: r % len(keys)]:
                        best[key] = min(best[key], timed(loops[key], start, args.n))
                results[name] = {key: best[key] / args.n * 1e6 for key in keys}
        finally:
            for st in stores.values():
                st.close()
            for c in conns.values():
                c.close()

        rows = []
        flat = True
        for name, _fn, _raw in OPS:
            res = results[name]
            a, b = res[("store", small)], res[("store", large)]
            ra, rb = res[("raw", small)], res[("raw", large)]
            ratio = b / a
            ok = ratio <= FLAT_RATIO
            flat = flat and ok
            rows.append(
                [
                    name,
                    f"{a:.1f}",
                    f"{b:.1f}",
                    f"{ratio:.2f}x",
                    "flat" if ok else "NOT FLAT",
                    f"{ra:.1f}",
                    f"{rb:.1f}",
                    f"{rb / ra:.2f}x",
                ]
            )
        print()
        print_table(
            [
                "operation",
                f"µs/call @ {small:,}",
                f"µs/call @ {large:,}",
                "ratio",
                "verdict",
                f"raw µs @ {small:,}",
                f"raw µs @ {large:,}",
                "raw ratio",
            ],
            rows,
        )
        print("(raw: stdlib sqlite3 running the same SQL on a copy, for reference)")
        lines, bad = plans(files[large], large)
        print(f"\nEXPLAIN QUERY PLAN at {large:,} rows:")
        print("\n".join(lines))
        for f in [*files.values(), *raw_files.values()]:
            remove_db(f)
    if bad:
        print(
            "\nFAIL: a query scans the table or sorts every match in a temp B-tree", file=sys.stderr
        )
        return 1
    if not flat:
        print(
            f"\nWARNING: a cost grew more than {FLAT_RATIO}x between the sizes "
            "(timing noise on a loaded machine can do this; re-run to confirm)",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
