"""WAL pages written per agent-turn commit and per checkpoint-saver put, per table and index.

    .venv/bin/python benchmarks/bench_pages.py [--seed 200] [--n 20]

A count, not a timing: on a shared machine it does not drift. For each
operation the script truncates the WAL (``PRAGMA wal_checkpoint(TRUNCATE)`` on
its own connection, the store's connections idle), runs the operation once,
then parses the ``-wal`` file: every frame whose salts match the WAL header is
one page written (one frame per dirty page per transaction; a frame with a
non-zero "database size" field ends a transaction). Each frame's page number
is mapped to the b-tree owning it through SQLite's ``dbstat`` virtual table
(page 1 is ``sqlite_schema`` plus the file header, rewritten when the file
grows or the free list changes; a page in no b-tree is ``<free>``). The
operation runs ``--n`` times after ``--seed`` operations of growth and the
mean per operation is printed, with the per-object split.

Operations (SQLite file, WAL, ``synchronous=NORMAL``; the payloads of
``bench_turns.py``):

* ``agentkeep turn commit``: ``commit_runtime_state`` of 3 message nodes, a
  2 KiB turn state and one usage delta under the session's lease with
  ``expected_head_revision`` (``bench_turns.AgentkeepLoop``, no read);
* ``AgentkeepSaver put`` / ``put_writes``: one checkpoint holding the 2 KiB
  state, then the 3 messages as writes of one task;
* ``SqliteSaver put`` / ``put_writes``: the same calls on LangGraph's stock
  saver (its own sqlite3 connection, WAL, ``synchronous=NORMAL``).
"""

from __future__ import annotations

import argparse
import gc
import sqlite3
import struct
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench_turns import AgentkeepLoop, _messages, _state, sqlite_saver

from agentkeep import Store
from agentkeep.sessions.records import HeadScope


def wal_frames(db: Path) -> tuple[list[int], int]:
    """(page number of each valid frame, number of commit frames) of ``db``'s WAL."""
    wal = Path(str(db) + "-wal")
    if not wal.exists():
        return [], 0
    data = wal.read_bytes()
    if len(data) < 32:
        return [], 0
    page_size = struct.unpack(">I", data[8:12])[0]
    salts = data[16:24]
    pages: list[int] = []
    commits = 0
    off = 32
    while off + 24 + page_size <= len(data):
        pgno, size = struct.unpack(">II", data[off : off + 8])
        if data[off + 8 : off + 16] != salts:
            break
        pages.append(pgno)
        commits += size != 0
        off += 24 + page_size
    return pages, commits


class Pager:
    """Counts the WAL frames one operation writes, by owning b-tree."""

    def __init__(self, db: Path) -> None:
        self.db = db
        self.conn = sqlite3.connect(str(db), isolation_level=None)

    def truncate(self) -> None:
        busy, _, _ = self.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        if busy:
            raise SystemExit(f"{self.db}: checkpoint blocked (a connection holds a transaction)")

    def owners(self) -> dict[int, str]:
        return {p: n for n, p in self.conn.execute("SELECT name, pageno FROM dbstat")}

    def measure(self, op: Callable[[], object], n: int) -> tuple[float, float, Counter[str]]:
        """(mean frames, mean commits, frames per object over all ``n``) of ``op``."""
        total, commits, split = 0, 0, Counter[str]()
        for _ in range(n):
            self.truncate()
            op()
            pages, c = wal_frames(self.db)
            owners = self.owners()
            total += len(pages)
            commits += c
            split.update(owners.get(p, "<free>") for p in pages)
        return total / n, commits / n, split


class SaverLoop:
    """put then put_writes of the bench_turns payloads on one thread of a saver."""

    def __init__(self, saver: Any, thread_id: str) -> None:
        from langgraph.checkpoint.base import empty_checkpoint

        self._empty = empty_checkpoint
        self.saver = saver
        self.latest: Any = {"configurable": {"thread_id": thread_id, "checkpoint_ns": ""}}
        self.turn = 0
        self.cfg: Any = None

    def put(self) -> None:
        i = self.turn
        checkpoint = self._empty()
        checkpoint["channel_values"] = {"state": _state(i)}
        checkpoint["channel_versions"] = {"state": i + 1}
        self.cfg = self.saver.put(
            self.latest, checkpoint, {"source": "loop", "step": i}, {"state": i + 1}
        )

    def put_writes(self) -> None:
        i = self.turn
        self.saver.put_writes(self.cfg, [("messages", m) for m in _messages(i)], task_id=f"task{i}")
        self.latest = self.cfg
        self.turn = i + 1

    def both(self) -> None:
        self.put()
        self.put_writes()


def report(name: str, result: tuple[float, float, Counter[str]], n: int) -> None:
    frames, commits, split = result
    parts = ", ".join(f"{k} {v / n:.2f}" for k, v in split.most_common())
    print(f"{name:<28} {frames:6.2f} pages  {commits:4.2f} txn  | {parts}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=200, help="operations before measuring")
    ap.add_argument("--n", type=int, default=100, help="measured operations")
    ap.add_argument("--cpu", type=int, default=0, help="then time this many operations")
    args = ap.parse_args()
    n = args.n
    print(
        f"sqlite {sqlite3.sqlite_version}; mean WAL pages per operation over {n}, after {args.seed}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        # agentkeep turn commit
        db = Path(tmp, "ak.db")
        store = Store.open(f"sqlite:///{db}", migrate=True)
        try:
            loop = AgentkeepLoop(store, "s", HeadScope())
            loop.grow(args.seed)
            pager = Pager(db)

            def commit() -> None:
                loop._commit(range(loop.turns, loop.turns + 1))

            for _ in range(5):
                commit()
            report("agentkeep turn commit", pager.measure(commit, n), n)
            cpu("agentkeep turn commit", commit, args.cpu)
            read = store.commits.load_session("s", HeadScope())
            assert read is not None and read.head_revision == loop.rev
        finally:
            store.close()

        # AgentkeepSaver
        from agentkeep.integrations.langgraph import AgentkeepSaver

        db = Path(tmp, "saver.db")
        store = Store.open(f"sqlite:///{db}", migrate=True)
        try:
            sl = SaverLoop(AgentkeepSaver(store), "t")
            for _ in range(args.seed):
                sl.both()
            pager = Pager(db)
            put, writes = _split(pager, sl, n)
            report("AgentkeepSaver put", put, n)
            report("AgentkeepSaver put_writes", writes, n)
            cpu("AgentkeepSaver put+put_writes", sl.both, args.cpu)
        finally:
            store.close()

        # LangGraph SqliteSaver
        db = Path(tmp, "lg.db")
        with sqlite_saver(db) as saver:
            sl = SaverLoop(saver, "t")
            for _ in range(args.seed):
                sl.both()
            pager = Pager(db)
            put, writes = _split(pager, sl, n)
            report("SqliteSaver put", put, n)
            report("SqliteSaver put_writes", writes, n)
            cpu("SqliteSaver put+put_writes", sl.both, args.cpu)
    sys.stdout.flush()


def cpu(name: str, op: Callable[[], object], n: int) -> None:
    """Print thread CPU µs per call of ``op`` over ``n`` calls (nothing when ``n`` is 0)."""
    if n <= 0:
        return
    gc.collect()
    gc.disable()
    try:
        t0 = time.thread_time()
        for _ in range(n):
            op()
        took = time.thread_time() - t0
    finally:
        gc.enable()
    print(f"{name:<28} {took / n * 1e6:8.1f} us CPU per operation over {n}")


def _split(
    pager: Pager, sl: SaverLoop, n: int
) -> tuple[tuple[float, float, Counter[str]], tuple[float, float, Counter[str]]]:
    """put and put_writes measured alternately (each put_writes follows its put)."""
    acc: list[list[Any]] = [[0.0, 0.0, Counter[str]()], [0.0, 0.0, Counter[str]()]]
    for _ in range(n):
        for k, op in enumerate((sl.put, sl.put_writes)):
            f, c, s = pager.measure(op, 1)
            acc[k][0] += f / n
            acc[k][1] += c / n
            acc[k][2].update(s)
    return (acc[0][0], acc[0][1], acc[0][2]), (acc[1][0], acc[1][1], acc[1][2])


if __name__ == "__main__":
    main()
