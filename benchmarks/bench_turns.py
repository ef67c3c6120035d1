"""Agent-turn benchmark: per-turn cost as a session grows, against LangGraph's checkpointers.

    .venv/bin/python benchmarks/bench_turns.py [--quick] [--window 50] [--no-postgres]

One **agent turn** is what a runtime does on every step:

* agentkeep: ``commit_runtime_state`` of 3 message nodes (appended to the
  active path), a 2 KiB ``turn_state`` and one usage delta, under the session's
  execution lease and with ``expected_head_revision``; then a resume read
  ``load_session``. The read is timed in three forms, each its own session:
  ``ActivePathScope()`` (the whole path: the issue's loop), ``HeadScope()``
  (head, leaf, checkpoint, ledger totals; no path) and
  ``ActivePathScope(tail=32)`` (the last 32 nodes). The last two exist only
  from the change that added them; on older code they are skipped.
* LangGraph: ``put`` of a checkpoint holding the same 2 KiB state, ``put_writes``
  of the same 3 messages, then ``get_tuple`` of the thread's latest checkpoint
  (``SqliteSaver`` with WAL and ``synchronous=NORMAL``; ``PostgresSaver``).

Each session is grown to 10, 1,000 and 10,000 turns (``--quick``: 10 and 1,000)
by the same calls (agentkeep seeds in commits of 100 turns: 300 nodes and 100
usage deltas each, the same rows the turns write); at each length a window of
``--window`` turns is timed: thread CPU time (``time.thread_time``, what the
process itself spends) and wall time per turn, with the garbage collector
paused. Ratios are agentkeep / LangGraph on the same backend.

Then, on SQLite files (WAL, ``synchronous=NORMAL``):

* the full-path and full-graph load of a 1,000-node path against raw
  ``sqlite3`` running the store's own statements (head, path or graph,
  checkpoint manifest) and ``json.loads`` of each node;
* ``store.runtime.atomic_apply`` (~10 KiB snapshot, 4 inputs) against raw
  ``sqlite3`` (``bench_runtime.bench_apply``: the same statements, payloads
  pre-encoded).

Postgres: ``--pg-url`` (default ``postgresql://postgres@127.0.0.1:5432``)
names a server; two scratch databases ``agentkeep_bench_turns_ak`` and
``agentkeep_bench_turns_lg`` are created and dropped at the end.
"""

from __future__ import annotations

import argparse
import gc
import json
import sqlite3
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from _common import raw_connect, sqlite_form

from agentkeep import Store
from agentkeep.migrations import upgrade
from agentkeep.sessions import checkpoints as C
from agentkeep.sessions import commits as K
from agentkeep.sessions import records as R
from agentkeep.sessions.domain import Acquired, LeaseOwnerIdentity
from agentkeep.sessions.records import (
    ActivePathScope,
    AppendNodes,
    FullGraphScope,
    HydratedSessionCheckpoint,
    RuntimeCommit,
    SessionNodeRecord,
    TokenUsage,
    UsageDelta,
)

OWNER = LeaseOwnerIdentity(owner_id="bench", incarnation_id="bench")
STATE = {"scratch": "x" * 1990, "turn": 0}  # ~2 KiB of canonical JSON
SEED_BATCH = 100
TAIL = 32


def _messages(turn: int) -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": f"question {turn}: " + "lorem ipsum " * 8},
        {"role": "assistant", "content": f"tool call {turn}", "tool": "search"},
        {"role": "assistant", "content": f"answer {turn}: " + "dolor sit amet " * 8},
    ]


def _state(turn: int) -> dict[str, Any]:
    return {**STATE, "turn": turn}


# --------------------------------------------------------------------------
# Timing


def cpu_timed(loop: Callable[[int, int], None], start: int, n: int) -> float:
    """Thread CPU seconds taken by ``loop(start, n)``, the garbage collector paused.

    ``_common.timed`` with ``time.thread_time`` for ``time.perf_counter``: on a
    shared machine the CPU time of this thread is what the code costs.
    """
    gc.collect()
    gc.disable()
    try:
        t0 = time.thread_time()
        loop(start, n)
        return time.thread_time() - t0
    finally:
        gc.enable()


def best_cpu_us(fn: Callable[[], object], n: int, rounds: int) -> float:
    """Best thread-CPU µs per call over ``rounds`` rounds of ``n`` calls, after a warm-up."""
    for _ in range(max(5, n // 10)):
        fn()

    def loop(_start: int, count: int) -> None:
        for _ in range(count):
            fn()

    return min(cpu_timed(loop, 0, n) for _ in range(rounds)) / n * 1e6


def window(turn: Callable[[int], None], start: int, count: int) -> tuple[float, float]:
    """(thread CPU ms, wall ms) per turn over turns ``start .. start+count-1``."""
    gc.collect()
    gc.disable()
    try:
        c0, w0 = time.thread_time(), time.perf_counter()
        for i in range(start, start + count):
            turn(i)
        c1, w1 = time.thread_time(), time.perf_counter()
    finally:
        gc.enable()
    return (c1 - c0) / count * 1e3, (w1 - w0) / count * 1e3


# --------------------------------------------------------------------------
# agentkeep


class AgentkeepLoop:
    """One session driven by the turn loop; ``scope`` is the resume read."""

    def __init__(self, store: Store, session_id: str, scope: Any) -> None:
        self.store, self.sid, self.scope = store, session_id, scope
        out = store.leases.try_claim_session_execution_lease(session_id, OWNER, 10**12)
        assert isinstance(out, Acquired)
        self.lease = out.lease
        self.leaf: str | None = None
        self.rev = 0
        self.turns = 0

    def _nodes(self, turn: int) -> list[SessionNodeRecord]:
        out = []
        for k, message in enumerate(_messages(turn)):
            node = SessionNodeRecord(
                node_id=f"t{turn}m{k}", parent_node_id=self.leaf, timestamp=turn, payload=message
            )
            out.append(node)
            self.leaf = node.node_id
        return out

    def _commit(self, turns: range) -> None:
        nodes = [n for t in turns for n in self._nodes(t)]
        usage = tuple(
            UsageDelta(
                source="agent",
                model="model-a",
                usage=TokenUsage(input_tokens=100 + t, output_tokens=20, reasoning_output_tokens=3),
            )
            for t in turns
        )
        result = self.store.commits.commit_runtime_state(
            RuntimeCommit(
                session_id=self.sid,
                expected_head_revision=self.rev,
                session_execution_lease=self.lease,
                graph=AppendNodes(nodes=tuple(nodes), leaf_node_id=self.leaf),
                checkpoint=HydratedSessionCheckpoint(turn_state=_state(turns[-1])),
                usage_deltas=usage,
            )
        )
        self.rev = result.head_revision
        self.turns = turns[-1] + 1

    def grow(self, length: int) -> None:
        while self.turns < length:
            self._commit(range(self.turns, min(length, self.turns + SEED_BATCH)))

    def turn(self, i: int) -> None:
        assert i == self.turns
        self._commit(range(i, i + 1))
        read = self.store.commits.load_session(self.sid, self.scope)
        assert read is not None and read.head_revision == self.rev


def _scopes() -> list[tuple[str, Any]]:
    scopes: list[tuple[str, Any]] = [("full path", ActivePathScope())]
    head = getattr(R, "HeadScope", None)
    if head is not None:
        scopes.append(("head", head()))
    if "tail" in ActivePathScope.model_fields:
        scopes.append((f"tail={TAIL}", ActivePathScope(tail=TAIL)))  # type: ignore[call-arg]
    return scopes


# --------------------------------------------------------------------------
# LangGraph


class LangGraphLoop:
    """put + put_writes + get_tuple on one thread of a LangGraph checkpointer."""

    def __init__(self, saver: Any, thread_id: str) -> None:
        from langgraph.checkpoint.base import empty_checkpoint

        self._empty = empty_checkpoint
        self.saver = saver
        self.config: dict[str, Any] = {
            "configurable": {"thread_id": thread_id, "checkpoint_ns": ""}
        }
        self.latest = self.config
        self.turns = 0

    def _put(self, i: int) -> None:
        checkpoint = self._empty()
        checkpoint["channel_values"] = {"state": _state(i)}
        checkpoint["channel_versions"] = {"state": i + 1}
        metadata: Any = {"source": "loop", "step": i}
        cfg = self.saver.put(self.latest, checkpoint, metadata, {"state": i + 1})
        self.saver.put_writes(cfg, [("messages", m) for m in _messages(i)], task_id=f"task{i}")
        self.latest = cfg
        self.turns = i + 1

    def grow(self, length: int) -> None:
        while self.turns < length:
            self._put(self.turns)

    def turn(self, i: int) -> None:
        self._put(i)
        got = self.saver.get_tuple(self.config)
        assert got is not None and got.checkpoint["channel_values"]["state"]["turn"] == i


@contextmanager
def sqlite_saver(path: Path) -> Iterator[Any]:
    from langgraph.checkpoint.sqlite import SqliteSaver

    conn = sqlite3.connect(str(path), check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    saver = SqliteSaver(conn)
    saver.setup()
    try:
        yield saver
    finally:
        conn.close()


@contextmanager
def postgres_saver(url: str) -> Iterator[Any]:
    from langgraph.checkpoint.postgres import PostgresSaver

    with PostgresSaver.from_conn_string(url) as saver:
        saver.setup()
        yield saver


@contextmanager
def scratch_databases(server: str, names: list[str]) -> Iterator[list[str]]:
    import psycopg

    def run(sql: str) -> None:
        with psycopg.connect(f"{server}/postgres", autocommit=True) as conn:
            conn.execute(sql)

    for name in names:
        run(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        run(f'CREATE DATABASE "{name}"')
    try:
        yield [f"{server}/{name}" for name in names]
    finally:
        for name in names:
            run(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


# --------------------------------------------------------------------------
# The growth table


def growth(
    backend: str,
    ak_url: str,
    lg: Any,
    lengths: list[int],
    count: int,
) -> list[str]:
    """Per-turn cost at each length: every agentkeep scope and the LangGraph saver."""
    upgrade(ak_url)
    store = Store.open(ak_url)
    try:
        loops: list[tuple[str, Any]] = [
            (f"agentkeep {name}", AgentkeepLoop(store, f"s-{j}", scope))
            for j, (name, scope) in enumerate(_scopes())
        ]
        loops.append(("langgraph", LangGraphLoop(lg, "thread-1")))
        figures: dict[tuple[str, int], tuple[float, float]] = {}
        for length in lengths:
            for name, loop in loops:
                loop.grow(length)
                figures[name, length] = window(loop.turn, length, count)
                cpu, wall = figures[name, length]
                print(
                    f"  [{backend}] {name:<24} at {length:>6} turns: "
                    f"{cpu:8.2f} ms CPU {wall:8.2f} ms wall",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        store.close()
    lines = [
        f"{backend}: ms per turn over turns L..L+{count - 1} (thread CPU / wall); "
        "ratio = agentkeep CPU / langgraph CPU"
    ]
    header = f"  {'loop':<24}" + "".join(f" | {f'L={n:,}':>24}" for n in lengths)
    lines += [header, "  " + "-" * (len(header) - 2)]
    for name, _ in loops:
        cells = []
        for n in lengths:
            cpu, wall = figures[name, n]
            ratio = cpu / figures["langgraph", n][0]
            cells.append(f" | {cpu:6.2f} / {wall:6.2f} {ratio:6.1f}x")
        lines.append(f"  {name:<24}" + "".join(cells))
    return lines


# --------------------------------------------------------------------------
# The 1,000-node load vs raw sqlite3


def raw_load(conn: sqlite3.Connection, sid: str, *, path: bool) -> Callable[[], object]:
    """Head, the active path (the store's recursive query) or every live node by seq,
    the manifest; ``json.loads`` of each node: the SQL of the store's load, and plain JSON."""
    nodes = K.ACTIVE_PATH if path else K._FULL_GRAPH
    head_q, nodes_q, blob_q = (sqlite_form(s) for s in (K._GET_HEAD, nodes, C._GET))

    def load() -> object:
        conn.execute("BEGIN")
        head = conn.execute(head_q.sql, head_q.bind({"sid": sid})).fetchone()
        params = {"sid": sid, "leaf": head[2]} if path else {"sid": sid}
        rows = conn.execute(nodes_q.sql, nodes_q.bind(params)).fetchall()
        loaded = [json.loads(r[-1]) for r in rows]
        blob = conn.execute(blob_q.sql, blob_q.bind({"hash": head[3]})).fetchone()
        json.loads(bytes(blob[2]))
        conn.commit()
        return loaded

    return load


def bench_path_load(tmp: Path, n: int, rounds: int) -> list[str]:
    url = f"sqlite:///{tmp / 'load.db'}"
    upgrade(url)
    store = Store.open(url)
    loop = AgentkeepLoop(store, "load", ActivePathScope())
    loop.grow(334)  # 1,002 nodes on one path
    sid = loop.sid
    conn = raw_connect(tmp / "load.db")
    lines = [
        "1,002-node active path on SQLite: store load vs raw sqlite3 (fetch + json.loads), "
        "thread CPU µs per call"
    ]
    try:
        for name, scope, raw in (
            ("load_session(ActivePathScope())", ActivePathScope(), raw_load(conn, sid, path=True)),
            ("load_session(FullGraphScope())", FullGraphScope(), raw_load(conn, sid, path=False)),
        ):
            read = store.commits.load_session(sid, scope)
            assert read is not None and len(read.graph.nodes) == 1002
            s_us = best_cpu_us(lambda s=scope: store.commits.load_session(sid, s), n, rounds)  # type: ignore[misc]
            r_us = best_cpu_us(raw, n, rounds)
            lines.append(f"  {name:<34} {s_us:9.0f} µs  raw {r_us:8.0f} µs  {s_us / r_us:5.2f}x")
    finally:
        conn.close()
        store.close()
    return lines


def bench_atomic_apply(tmp: Path, n: int, rounds: int) -> list[str]:
    import bench_runtime as BR

    BR.timed = cpu_timed  # bench_apply's rounds, timed in thread CPU time
    store_path, raw_path = BR._fresh(tmp / "rt-store.db"), BR._fresh(tmp / "rt-raw.db")
    store = Store.open(f"sqlite:///{store_path}")
    conn = raw_connect(raw_path)
    try:
        (s_us, r_us), _, sizes = BR.bench_apply(store, conn, n, rounds)
    finally:
        store.close()
        conn.close()
    return [
        f"atomic_apply on SQLite ({sizes[0] / 1024:.1f}–{sizes[1] / 1024:.1f} KiB snapshot, "
        "4 inputs) vs raw sqlite3 (same statements, pre-encoded), thread CPU µs per call",
        f"  {'atomic_apply':<34} {s_us:9.0f} µs  raw {r_us:8.0f} µs  {s_us / r_us:5.2f}x",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="lengths 10 and 1,000 only")
    parser.add_argument("--lengths", default=None, help="comma-separated session lengths")
    parser.add_argument("--window", type=int, default=50, help="timed turns at each length")
    parser.add_argument("--no-postgres", action="store_true")
    parser.add_argument(
        "--no-growth", action="store_true", help="only the 1,000-node load and atomic_apply"
    )
    parser.add_argument("--pg-url", default="postgresql://postgres@127.0.0.1:5432")
    parser.add_argument("--n", type=int, default=50, help="calls per round (load, apply)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.lengths:
        lengths = [int(x) for x in args.lengths.split(",")]
    else:
        lengths = [10, 1000] if args.quick else [10, 1000, 10_000]

    out: list[str] = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        if not args.no_growth:
            with sqlite_saver(tmp / "langgraph.db") as lg:
                ak = f"sqlite:///{tmp / 'agentkeep.db'}"
                out += growth("SQLite", ak, lg, lengths, args.window) + [""]
        if not args.no_postgres and not args.no_growth:
            names = ["agentkeep_bench_turns_ak", "agentkeep_bench_turns_lg"]
            with scratch_databases(args.pg_url, names) as (ak, lg_url):
                with postgres_saver(lg_url) as lg:
                    ak_url = ak.replace("postgresql://", "postgresql+psycopg://", 1)
                    out += growth("Postgres", ak_url, lg, lengths, args.window) + [""]
        out += bench_path_load(tmp, args.n, args.rounds)
        out += [""] + bench_atomic_apply(tmp, args.n, args.rounds)
    print()
    print("\n".join(out))


if __name__ == "__main__":
    main()
