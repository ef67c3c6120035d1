"""Per-append cost of a run's step log as it grows (spec runs §5.9).

The step log is one JSON array in ``runs.step_entries_json``; every append
reads, validates and rewrites the whole array (the original store's format),
so an append costs O(entries) and a run with n entries cost O(n^2) in total.
This prints the cost of one append and one ``get`` at several log sizes so the
budget is explicit.

    .venv/bin/python benchmarks/bench_step_log.py [--sizes 100,1000,10000]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from sqlalchemy import bindparam, func, select

from agentkeep import RunRecord, StepEntry, Store
from agentkeep.runs.models import Run
from agentkeep.statements import Statement

_LEN = Statement(
    select(func.length(Run.step_entries_json)).where(Run.id == bindparam("id")),
    name="bench.step_log_length",
)


def _per_call_us(fn: object, n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        fn()  # type: ignore[operator]
    return (time.perf_counter() - start) / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="100,1000,10000", help="log sizes to measure at")
    parser.add_argument("--n", type=int, default=50, help="timed calls per size (default 50)")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]

    with tempfile.TemporaryDirectory() as tmp:
        store = Store.open(f"sqlite:///{Path(tmp) / 'log.db'}", migrate=True)
        store.runs.create(RunRecord.new("R-log", "T-log", 1))
        entry = StepEntry.basic("ST-1", "step", "passed", None, 1)
        have = 0
        print(f"{'entries':>8} | {'append µs':>10} | {'get µs':>10} | {'stored bytes':>12}")
        for size in sizes:
            with store.write() as uow:  # grow the log in one unit (fast set-up)
                for _ in range(size - have):
                    uow.runs.append_step_entry("R-log", entry)
            have = size
            append_us = _per_call_us(lambda: store.runs.append_step_entry("R-log", entry), args.n)
            have += args.n
            get_us = _per_call_us(lambda: store.runs.get("R-log"), args.n)
            with store.read() as uow:
                size_b = uow.driver.execute(_LEN, {"id": "R-log"}).fetchone()[0]
            print(f"{have:>8} | {append_us:>10.1f} | {get_us:>10.1f} | {size_b:>12,}")
        store.close()


if __name__ == "__main__":
    main()
