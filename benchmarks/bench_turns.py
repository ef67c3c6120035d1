"""Agent-turn benchmark: per-turn cost as a session grows, against LangGraph's checkpointers.

    .venv/bin/python benchmarks/bench_turns.py [--quick] [--window 50] [--no-postgres]
    .venv/bin/python benchmarks/bench_turns.py --throughput [--processes 1,4,8] [--seconds 2]

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

``--throughput`` runs only the throughput section: for each process count of
``--processes`` (default 1, 4, 8), fresh databases (SQLite files;
``agentkeep_bench_turns_tp_ak`` / ``_tp_lg`` on Postgres, created and dropped
for each count) and N spawned worker processes, each opening its own ``Store``
and its own LangGraph saver and driving its own session and thread: 10
warm-up turns on each side, then ``--tp-rounds`` (default 2) rounds of one
``--seconds`` (default 2) wall-clock window per side, every window started by
a barrier of all the workers (rounds alternate which side goes first). The
agentkeep turn reads ``load_session(HeadScope())`` (``--tp-scope tail``:
``ActivePathScope(tail=32)``), the flat resume read of the growth table.
Turns/s = all workers' turns / (last worker's end - first worker's start),
best round per side; the garbage collector stays on. After the windows every
session is checked: agentkeep's head revision equals the turns its worker
committed (checkpoint state and ledger totals too), LangGraph's latest
checkpoint is the last turn's, with one checkpoint and 3 writes per turn.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import os
import queue
import sqlite3
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _common import raw_connect, sqlite_form

from agentkeep import Store
from agentkeep.db import DEFAULT_BUSY_TIMEOUT_MS
from agentkeep.migrations import upgrade
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

    # The busy timeout agentkeep's store uses: writers of other processes wait, not fail.
    timeout = DEFAULT_BUSY_TIMEOUT_MS / 1000
    conn = sqlite3.connect(str(path), check_same_thread=False, timeout=timeout)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    saver = SqliteSaver(conn)
    saver.setup()
    try:
        yield saver
    finally:
        conn.close()


@contextmanager
def postgres_saver(url: str, *, setup: bool = True) -> Iterator[Any]:
    """A ``PostgresSaver``; ``setup=False`` for a database another process set up
    (its migrations are not safe to run from several processes at once)."""
    from langgraph.checkpoint.postgres import PostgresSaver

    with PostgresSaver.from_conn_string(url) as saver:
        if setup:
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
# The raw floor: the turn's own statements, replayed by the bare driver


class _RecordingCursor:
    """A DBAPI cursor that logs what it executes into its connection's log."""

    def __init__(self, cur: Any, log: list[tuple[Any, ...]]) -> None:
        self._cur, self._log = cur, log

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cur, name)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._cur)

    def execute(self, sql: str, params: Any = None) -> Any:
        self._log.append(("execute", sql, _frozen(params)))
        return self._cur.execute(sql) if params is None else self._cur.execute(sql, params)

    def executemany(self, sql: str, rows: Any) -> Any:
        for params in rows:
            self._log.append(("execute", sql, _frozen(params)))
        return self._cur.executemany(sql, rows)


class _RecordingConnection:
    """A DBAPI connection (sqlite3 or psycopg) that logs every statement, COMMIT,
    ROLLBACK, pipeline and autocommit switch the store's driver makes on it."""

    def __init__(self, raw: Any, log: list[tuple[Any, ...]]) -> None:
        object.__setattr__(self, "_raw", raw)
        object.__setattr__(self, "_log", log)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "autocommit":
            self._log.append(("autocommit", value))
        setattr(self._raw, name, value)

    def cursor(self, *args: Any, **kwargs: Any) -> _RecordingCursor:
        return _RecordingCursor(self._raw.cursor(*args, **kwargs), self._log)

    def execute(self, sql: str, params: Any = None) -> Any:
        self._log.append(("execute", sql, _frozen(params)))
        return self._raw.execute(sql) if params is None else self._raw.execute(sql, params)

    def commit(self) -> None:
        # A commit() outside a transaction (a single-statement read in autocommit
        # mode) sends nothing on either driver: not a COMMIT, not a round trip.
        raw = self._raw
        if isinstance(raw, sqlite3.Connection):
            idle = not raw.in_transaction
        else:
            idle = raw.info.transaction_status == 0  # psycopg's TransactionStatus.IDLE
        if not idle:
            self._log.append(("commit",))
        raw.commit()

    def rollback(self) -> None:
        self._log.append(("rollback",))
        self._raw.rollback()

    @contextmanager
    def pipeline(self) -> Iterator[Any]:
        self._log.append(("pipeline",))
        try:
            with self._raw.pipeline() as pipe:
                yield pipe
        finally:
            self._log.append(("end-pipeline",))


def _frozen(params: Any) -> Any:
    return dict(params) if isinstance(params, dict) else params


def recording_store(url: str, log: list[tuple[Any, ...]]) -> Store:
    """A store whose drivers run on recording connections (the log of every unit)."""
    store = Store.open(url)
    make = store._driver

    def driver(raw: Any, **kwargs: Any) -> Any:
        made = make(raw, **kwargs)
        made.raw = _RecordingConnection(raw, log)
        return made

    store._driver = driver  # type: ignore[method-assign]
    return store


@dataclass
class TurnCounts:
    """What one turn sends, from the recorded log (load-independent)."""

    statements: float  # statements executed (BEGIN, SAVEPOINT ... included; COMMIT not)
    commits: float
    round_trips: float  # Postgres: a pipeline or a lone statement or COMMIT is one


def turn_counts(events: list[tuple[Any, ...]], turns: int) -> TurnCounts:
    statements = sum(1 for e in events if e[0] == "execute")
    commits = sum(1 for e in events if e[0] in ("commit", "rollback"))
    trips, depth = 0, 0
    for e in events:
        if e[0] == "pipeline":
            depth += 1
            trips += depth == 1
        elif e[0] == "end-pipeline":
            depth -= 1
        elif e[0] in ("execute", "commit", "rollback") and depth == 0:
            trips += 1
    return TurnCounts(statements / turns, commits / turns, trips / turns)


class RawReplay:
    """Replays a recorded log with the bare driver (``sqlite3`` / ``psycopg``) on a
    database in the same state: the same statements, parameters, transactions and
    pipelines, rows fetched, and nothing else (no checks, no encoding, no objects).
    Its CPU time per turn is the floor the store's turn stands on."""

    def __init__(self, conn: Any, postgres: bool) -> None:
        self.conn, self.postgres = conn, postgres
        if postgres:
            conn.autocommit = False

    def run(self, events: list[tuple[Any, ...]]) -> None:
        conn, pending = self.conn, None
        for e in events:
            kind = e[0]
            if kind == "execute":
                sql, params = e[1], e[2]
                if self.postgres:
                    cur = conn.cursor()
                    cur.execute(sql, params)
                    if pending is None:
                        if cur.pgresult is not None and cur.pgresult.nfields:
                            cur.fetchall()
                    else:
                        pending.append(cur)
                else:
                    conn.execute(sql, () if params is None else params).fetchall()
            elif kind == "commit":
                conn.commit()
            elif kind == "rollback":
                conn.rollback()
            elif kind == "autocommit":
                conn.autocommit = e[1]
            elif kind == "pipeline":
                pipe = conn.pipeline()
                pipe.__enter__()
                pending = []
            elif kind == "end-pipeline":
                pipe.__exit__(None, None, None)
                for cur in pending or ():
                    if cur.pgresult is not None and cur.pgresult.nfields:
                        cur.fetchall()
                pending = None

    def follow(
        self, loop: Any, log: list[tuple[Any, ...]], lengths: list[int], count: int
    ) -> Iterator[tuple[int, list[tuple[Any, ...]], float]]:
        """Grow ``loop`` (recording into ``log``, which starts empty) to each length and
        run ``count`` turns there; replay everything the loop sent, the window's turns
        timed. Yields ``(length, the window's events, thread CPU ms per turn of their
        replay)``; the database replayed on is then in the recorded one's state."""
        done = 0
        for length in lengths:
            loop.grow(length)
            start = len(log)
            for i in range(length, length + count):
                loop.turn(i)
            self.run(log[done:start])
            events = log[start:]
            timed = cpu_timed(lambda _s, _n, ev=events: self.run(ev), 0, 1)  # type: ignore[misc]
            done = len(log)
            yield length, events, timed / count * 1e3

    def breakdown(self, loop: Any, log: list[tuple[Any, ...]]) -> Breakdown:
        """After :meth:`follow`: :data:`BREAKDOWN_TURNS` more turns of ``loop``, their
        cost per kind of statement (:meth:`cost_by_statement`)."""
        done = len(log)
        for i in range(loop.turns, loop.turns + BREAKDOWN_TURNS):
            loop.turn(i)
        return self.cost_by_statement(log[done:], BREAKDOWN_TURNS)

    def cost_by_statement(
        self, events: list[tuple[Any, ...]], turns: int
    ) -> dict[str, tuple[float, float]]:
        """Per kind of event (:func:`statement_label`): thread CPU µs per turn and
        events per turn, replaying ``events`` one at a time (SQLite only: no pipelines),
        the cost of the timing itself taken off."""
        assert not self.postgres
        cost: dict[str, tuple[float, float]] = {}
        gc.collect()
        gc.disable()
        try:
            # The timing itself (two clock reads, one call): taken off every event.
            t0 = time.thread_time_ns()
            for _ in range(1000):
                t1 = time.thread_time_ns()
                self.run([])
                time.thread_time_ns() - t1
            timing = (time.thread_time_ns() - t0) / 1000
            for e in events:
                t0 = time.thread_time_ns()
                self.run([e])
                spent = max(0.0, time.thread_time_ns() - t0 - timing)
                label = statement_label(e)
                us, n = cost.get(label, (0.0, 0.0))
                cost[label] = (us + spent / 1e3 / turns, n + 1 / turns)
        finally:
            gc.enable()
        return cost


def statement_label(event: tuple[Any, ...]) -> str:
    """``COMMIT``, or the statement's verb and its (first) table: ``INSERT graph_nodes``."""
    if event[0] != "execute":
        return str(event[0]).upper()
    words = str(event[1]).replace("(", " ").split()
    upper = [w.upper() for w in words]
    if upper[0] == "UPDATE":
        table = words[1]
    elif "INTO" in upper:
        table = words[upper.index("INTO") + 1]
    elif "FROM" in upper:
        table = words[upper.index("FROM") + 1]
    else:
        return " ".join(upper[:2])
    verb = "SELECT" if upper[0] == "WITH" else upper[0]  # a recursive walk: WITH ... SELECT
    return f"{verb} {table.strip(chr(34))}"


def breakdown_line(name: str, cost: dict[str, tuple[float, float]]) -> str:
    """``name  total µs = COMMIT 60.1 + INSERT graph_nodes 15.6 + ...``, largest first."""
    parts = " + ".join(
        f"{'' if round(n) == 1 else f'{n:g}x '}{label} {us:.1f}"
        for label, (us, n) in sorted(cost.items(), key=lambda x: -x[1][0])
    )
    return f"    {name:<24} {sum(us for us, _ in cost.values()):6.1f} µs = {parts}"


def python_calls(turn: Callable[[int], None], start: int, count: int) -> float:
    """Python function calls per turn (cProfile's count, builtins included)."""
    import cProfile
    import pstats

    profile = cProfile.Profile()
    profile.enable()
    for i in range(start, start + count):
        turn(i)
    profile.disable()
    return pstats.Stats(profile).total_calls / count  # type: ignore[attr-defined,no-any-return]


#: Turns per length whose Python calls are counted (after the timed window).
CALL_TURNS = 10


#: What one loop's turn spends per kind of statement (:meth:`RawReplay.cost_by_statement`).
Breakdown = dict[str, tuple[float, float]]
#: Turns replayed for a breakdown: enough for the WAL checkpoints (one per 1,000 pages
#: written, each a few ms) to fall on every loop's COMMITs in proportion.
BREAKDOWN_TURNS = 400


def raw_floor(
    backend: str, rec_url: str, raw_conn: Any, lengths: list[int], count: int
) -> tuple[dict[tuple[str, int], float], dict[str, TurnCounts], dict[str, Breakdown]]:
    """Thread CPU ms per turn of the raw replay of the head and tail=32 turns, the
    counts of one turn at each length and, on SQLite, the cost of each kind of
    statement at the last length.

    A recording store (its own database) runs each loop as the growth table
    does; the log of every unit, from the lease claim on, is replayed on
    ``raw_conn`` (a fresh database of the same schema), the window's turns timed.
    The breakdown replays :data:`BREAKDOWN_TURNS` turns more, one statement at a time.
    """
    upgrade(rec_url)
    log: list[tuple[Any, ...]] = []
    store = recording_store(rec_url, log)
    replay = RawReplay(raw_conn, backend == "Postgres")
    floors: dict[tuple[str, int], float] = {}
    counts: dict[str, TurnCounts] = {}
    breakdowns: dict[str, Breakdown] = {}
    try:
        for j, (name, scope) in enumerate(_scopes()):
            if name == "full path":
                continue
            name = f"agentkeep {name}"
            del log[:]
            loop = AgentkeepLoop(store, f"s-{j}", scope)
            for length, events, ms in replay.follow(loop, log, lengths, count):
                floors[name, length] = ms
                counts[name] = turn_counts(events, count)
            if not replay.postgres:
                breakdowns[name] = replay.breakdown(loop, log)
    finally:
        store.close()
    return floors, counts, breakdowns


def langgraph_raw_floor(
    tmp: Path, lengths: list[int], count: int
) -> tuple[dict[int, float], Breakdown]:
    """LangGraph's own floor on SQLite: its ``SqliteSaver`` statements, replayed bare.

    A ``SqliteSaver`` on a recording connection runs the LangGraph loop of the
    growth table; its log is replayed by ``sqlite3`` on a fresh database set up
    by ``SqliteSaver`` (same PRAGMAs, same implicit transactions), the window's
    turns timed: thread CPU ms per turn at each length, and the cost of each
    kind of statement over :data:`BREAKDOWN_TURNS` more turns at the last length.
    """
    from langgraph.checkpoint.sqlite import SqliteSaver

    log: list[tuple[Any, ...]] = []
    floors: dict[int, float] = {}
    with (
        sqlite_saver(tmp / "langgraph-recorded.db") as recorded,
        sqlite_saver(tmp / "langgraph-raw.db") as bare,
    ):
        saver = SqliteSaver(_RecordingConnection(recorded.conn, log))  # type: ignore[arg-type]
        saver.is_setup = True
        loop = LangGraphLoop(saver, "thread-raw")
        replay = RawReplay(bare.conn, False)
        for length, _, ms in replay.follow(loop, log, lengths, count):
            floors[length] = ms
        breakdown = replay.breakdown(loop, log)
    return floors, breakdown


# --------------------------------------------------------------------------
# The growth table


def growth(
    backend: str,
    ak_url: str,
    lg: Any,
    lengths: list[int],
    count: int,
    floor: tuple[str, Any] | None = None,
    langgraph_floor: Path | None = None,
) -> list[str]:
    """Per-turn cost at each length: every agentkeep scope and the LangGraph saver.

    ``floor``: (recording store URL, raw connection) for :func:`raw_floor`,
    whose figures are printed next to the store's (None: skipped).
    ``langgraph_floor``: a directory for :func:`langgraph_raw_floor`'s two
    SQLite files (None: skipped).
    """
    upgrade(ak_url)
    store = Store.open(ak_url)
    try:
        loops: list[tuple[str, Any]] = [
            (f"agentkeep {name}", AgentkeepLoop(store, f"s-{j}", scope))
            for j, (name, scope) in enumerate(_scopes())
        ]
        loops.append(("langgraph", LangGraphLoop(lg, "thread-1")))
        figures: dict[tuple[str, int], tuple[float, float]] = {}
        calls: dict[tuple[str, int], float] = {}
        for length in lengths:
            for name, loop in loops:
                loop.grow(length)
                figures[name, length] = window(loop.turn, length, count)
                calls[name, length] = python_calls(loop.turn, length + count, CALL_TURNS)
                cpu, wall = figures[name, length]
                print(
                    f"  [{backend}] {name:<24} at {length:>6} turns: "
                    f"{cpu:8.2f} ms CPU {wall:8.2f} ms wall",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        store.close()
    floors, counts, breakdowns = (
        raw_floor(backend, *floor, lengths, count) if floor else ({}, {}, {})
    )
    if langgraph_floor is not None:
        lg_floors, breakdowns["langgraph"] = langgraph_raw_floor(langgraph_floor, lengths, count)
        floors.update({("langgraph", n): ms for n, ms in lg_floors.items()})
    lines = [
        f"{backend}: ms per turn over turns L..L+{count - 1} (thread CPU / wall); "
        "ratio = agentkeep CPU / langgraph CPU; raw = the same turn's statements replayed "
        "by the bare driver (thread CPU ms; x = the loop's CPU / raw)"
    ]
    header = f"  {'loop':<24}" + "".join(f" | {f'L={n:,}':>24} | {'raw':>13}" for n in lengths)
    lines += [header, "  " + "-" * (len(header) - 2)]
    for name, _ in loops:
        cells = []
        for n in lengths:
            cpu, wall = figures[name, n]
            ratio = cpu / figures["langgraph", n][0]
            cells.append(f" | {cpu:6.2f} / {wall:6.2f} {ratio:6.1f}x")
            raw = floors.get((name, n))
            cells.append(f" | {raw:5.2f} {cpu / raw:5.1f}x" if raw else f" | {'':>13}")
        lines.append(f"  {name:<24}" + "".join(cells))
    lines.append(
        f"  per turn (at L={lengths[-1]:,}): Python calls (cProfile, {CALL_TURNS} turns); "
        "statements / COMMITs / round trips sent (recorded)"
    )
    for name, _ in loops:
        c = counts.get(name)
        sent = (
            f"; {c.statements:.1f} statements, {c.commits:.1f} COMMITs, "
            f"{c.round_trips:.1f} round trips"
            if c
            else ""
        )
        lines.append(f"    {name:<24} {calls[name, lengths[-1]]:7.0f} calls{sent}")
    if breakdowns:
        lines.append(
            f"  the raw floor by statement (from L={lengths[-1]:,}, {BREAKDOWN_TURNS} turns more, "
            "replayed one statement at a time): thread CPU µs per turn"
        )
        lines += [breakdown_line(name, cost) for name, cost in breakdowns.items()]
    return lines


# --------------------------------------------------------------------------
# The 1,000-node load vs raw sqlite3


def raw_load(conn: sqlite3.Connection, sid: str, *, path: bool) -> Callable[[], object]:
    """The head with its manifest blob and the ledger totals (one statement; two on
    older code, the totals read after the head), the active path (the store's
    recursive query) or every live node by seq; ``json.loads`` of each node and of
    the manifest: the SQL of the store's load, and plain JSON."""
    nodes_q = sqlite_form(K.ACTIVE_PATH if path else K._FULL_GRAPH)
    combined = getattr(K, "_GET_HEAD_AND_TOTALS", None)
    if combined is not None:
        head_q, totals_q, at = sqlite_form(combined), None, K._HEAD_AT
    else:  # older code: the head joined to its manifest, then the totals
        head_q, totals_q, at = sqlite_form(K._GET_HEAD), sqlite_form(K._GET_TOTALS), 0

    def load() -> object:
        conn.execute("BEGIN")
        head = conn.execute(head_q.sql, head_q.bind({"sid": sid})).fetchall()[0][at:]
        if totals_q is not None:
            conn.execute(totals_q.sql, totals_q.bind({"sid": sid})).fetchall()
        params = {"sid": sid, "leaf": head[2]} if path else {"sid": sid}
        rows = conn.execute(nodes_q.sql, nodes_q.bind(params)).fetchall()
        loaded = [json.loads(r[-1]) for r in rows]
        json.loads(bytes(head[10]))  # the manifest blob's content
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


# --------------------------------------------------------------------------
# Throughput with 1, 4 and 8 processes

#: How long a worker waits at a barrier, or the parent for a worker, before giving up.
TP_TIMEOUT_S = 120.0
SIDES = ("agentkeep", "langgraph")


@dataclass(frozen=True)
class WorkerSpec:
    """What one throughput worker is told (pickled to a spawned process)."""

    index: int
    backend: str  # "SQLite" or "Postgres"
    ak_url: str
    lg_target: str  # SQLite file path or Postgres URL
    scope: str  # "head" or "tail"
    seconds: float
    rounds: int
    warmup: int


@dataclass(frozen=True)
class Window:
    """One worker's timed window: turns done between its ``t0`` and ``t1`` (monotonic)."""

    side: str
    round: int
    turns: int
    t0: float
    t1: float
    cpu: float  # the worker's process CPU seconds in the window (the client side only)


@dataclass(frozen=True)
class WorkerResult:
    index: int
    session_id: str  # the agentkeep session and the LangGraph thread the worker drove
    ak_turns: int  # every turn it committed: warm-up and windows
    lg_turns: int
    windows: tuple[Window, ...]


def resume_scope(name: str) -> Any:
    """The resume read of the throughput loop: ``HeadScope()`` or ``ActivePathScope(tail=32)``."""
    if name == "head" and hasattr(R, "HeadScope"):
        return R.HeadScope()
    if name == "tail" and "tail" in ActivePathScope.model_fields:
        return ActivePathScope(tail=TAIL)  # type: ignore[call-arg]
    raise SystemExit(f"--tp-scope {name}: this agentkeep has no such resume read")


@contextmanager
def worker_saver(backend: str, target: str) -> Iterator[Any]:
    """The LangGraph saver of one worker: its own connection to the set-up database."""
    if backend == "SQLite":
        with sqlite_saver(Path(target)) as saver:
            yield saver
    else:
        with postgres_saver(target, setup=False) as saver:
            yield saver


def timed_turns(loop: Any, side: str, rnd: int, seconds: float) -> Window:
    """Turns of ``loop`` until ``seconds`` of wall time have passed (at least one turn)."""
    c0, t0 = time.process_time(), time.monotonic()
    deadline, turns = t0 + seconds, 0
    while True:
        loop.turn(loop.turns)
        turns += 1
        t1 = time.monotonic()
        if t1 >= deadline:
            return Window(side, rnd, turns, t0, t1, time.process_time() - c0)


def drive(spec: WorkerSpec, barrier: Any) -> WorkerResult:
    """One worker: its own store, saver and session; warm up, then the timed windows.

    Every window starts at a barrier of all workers: none is timed while another
    is still starting, connecting or warming up. Rounds alternate which side
    goes first.
    """
    sid = f"tp-{spec.index}"
    with worker_saver(spec.backend, spec.lg_target) as saver:
        store = Store.open(spec.ak_url)
        try:
            loops = {
                "agentkeep": AgentkeepLoop(store, sid, resume_scope(spec.scope)),
                "langgraph": LangGraphLoop(saver, sid),
            }
            for loop in loops.values():
                for _ in range(spec.warmup):
                    loop.turn(loop.turns)
            windows = []
            for rnd in range(spec.rounds):
                for side in SIDES if rnd % 2 == 0 else SIDES[::-1]:
                    barrier.wait(TP_TIMEOUT_S)
                    windows.append(timed_turns(loops[side], side, rnd, spec.seconds))
            barrier.wait(TP_TIMEOUT_S)  # nobody closes while another is still timed
            ak, lg = loops["agentkeep"], loops["langgraph"]
            return WorkerResult(spec.index, sid, ak.turns, lg.turns, tuple(windows))
        finally:
            store.close()


def tp_worker(spec: WorkerSpec, barrier: Any, results: Any) -> None:
    """Process entry point: put the worker's result, or its traceback, on ``results``."""
    try:
        results.put(drive(spec, barrier))
    except BaseException:
        barrier.abort()  # the others stop waiting for this one
        results.put((spec.index, traceback.format_exc()))


def run_workers(specs: list[WorkerSpec]) -> list[WorkerResult]:
    """Spawn one process per spec, wait for every result; any failure fails the run."""
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(len(specs))
    results = ctx.Queue()
    procs = [
        ctx.Process(target=tp_worker, args=(spec, barrier, results), name=f"tp-{spec.index}")
        for spec in specs
    ]
    for proc in procs:
        proc.start()
    got: dict[int, WorkerResult] = {}
    failures: list[str] = []
    budget = TP_TIMEOUT_S + max(s.seconds for s in specs) * 2 * specs[0].rounds
    deadline = time.monotonic() + budget
    try:
        while len(got) + len(failures) < len(specs):
            try:
                item = results.get(timeout=1.0)
            except queue.Empty:
                dead = [p.name for p in procs if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    failures.append(f"workers {dead or 'timed out'} reported nothing")
                    break
                continue
            if isinstance(item, WorkerResult):
                got[item.index] = item
            else:
                failures.append(f"worker {item[0]}:\n{item[1]}")
    finally:
        for proc in procs:
            proc.join(10.0)
            if proc.is_alive():
                proc.terminate()
                proc.join()
    if failures:
        raise RuntimeError("throughput run failed: " + "\n".join(failures))
    return [got[i] for i in sorted(got)]


def verify(backend: str, ak_url: str, lg_target: str, results: list[WorkerResult]) -> None:
    """After the windows: every session holds exactly the turns its worker committed.

    agentkeep: head revision = commits, the checkpoint's state is the last turn's,
    the ledger's output tokens are 20 per turn. LangGraph: the latest checkpoint
    is the last turn's; the thread has one checkpoint per turn and 3 writes per turn.
    """
    store = Store.open(ak_url)
    try:
        for res in results:
            read = store.commits.load_session(res.session_id, R.HeadScope())
            assert read is not None, res.session_id
            assert read.head_revision == res.ak_turns, (res, read.head_revision)
            assert read.checkpoint is not None
            assert read.checkpoint.turn_state["turn"] == res.ak_turns - 1, res
            (entry,) = read.token_ledger
            assert entry.usage.output_tokens == 20 * res.ak_turns, (res, entry)
    finally:
        store.close()
    # LangGraph's own tables: SqliteSaver's ``writes``, PostgresSaver's ``checkpoint_writes``.
    mark, writes = ("?", "writes") if backend == "SQLite" else ("%s", "checkpoint_writes")
    with worker_saver(backend, lg_target) as saver:
        for res in results:
            config = {"configurable": {"thread_id": res.session_id, "checkpoint_ns": ""}}
            got = saver.get_tuple(config)
            assert got is not None, res.session_id
            assert got.checkpoint["channel_values"]["state"]["turn"] == res.lg_turns - 1, res
            for table, per_turn in (("checkpoints", 1), (writes, 3)):
                sql = f"SELECT count(*) AS n FROM {table} WHERE thread_id = {mark}"
                row = saver.conn.execute(sql, (res.session_id,)).fetchone()
                count = row["n"] if isinstance(row, dict) else row[0]  # PostgresSaver: dict rows
                assert count == per_turn * res.lg_turns, (res, table, count)


@dataclass(frozen=True)
class Rate:
    turns_per_s: float
    cpu_ms: float  # the workers' CPU per turn (client side)


def rates(results: list[WorkerResult], side: str, rounds: int) -> list[Rate]:
    """Each round of ``side``: all workers' turns over the span from the first
    worker's start to the last worker's end."""
    out = []
    for rnd in range(rounds):
        ws = [w for r in results for w in r.windows if w.side == side and w.round == rnd]
        turns = sum(w.turns for w in ws)
        span = max(w.t1 for w in ws) - min(w.t0 for w in ws)
        out.append(Rate(turns / span, sum(w.cpu for w in ws) / turns * 1e3))
    return out


@contextmanager
def tp_databases(backend: str, tmp: Path, procs: int, pg_url: str) -> Iterator[tuple[str, str]]:
    """Fresh, set-up databases for one process count: (agentkeep URL, LangGraph target)."""
    if backend == "SQLite":
        ak_url, lg_target = f"sqlite:///{tmp / f'tp{procs}-ak.db'}", str(tmp / f"tp{procs}-lg.db")
        with sqlite_saver(Path(lg_target)):
            pass
        upgrade(ak_url)
        yield ak_url, lg_target
        return
    names = ["agentkeep_bench_turns_tp_ak", "agentkeep_bench_turns_tp_lg"]
    with scratch_databases(pg_url, names) as (ak, lg_target):
        ak_url = ak.replace("postgresql://", "postgresql+psycopg://", 1)
        with postgres_saver(lg_target):
            pass
        upgrade(ak_url)
        yield ak_url, lg_target


def throughput(backend: str, tmp: Path, args: argparse.Namespace) -> list[str]:
    """Turns/s of N processes on one backend, agentkeep and LangGraph side by side."""
    scope_name = "HeadScope()" if args.tp_scope == "head" else f"ActivePathScope(tail={TAIL})"
    table: dict[int, dict[str, Rate]] = {}
    for procs in args.processes:
        with tp_databases(backend, tmp, procs, args.pg_url) as (ak_url, lg_target):
            specs = [
                WorkerSpec(
                    i, backend, ak_url, lg_target, args.tp_scope, args.seconds, args.tp_rounds, 10
                )
                for i in range(procs)
            ]
            results = run_workers(specs)
            verify(backend, ak_url, lg_target, results)
        table[procs] = {}
        for side in SIDES:
            each = rates(results, side, args.tp_rounds)
            table[procs][side] = max(each, key=lambda r: r.turns_per_s)
            shown = ", ".join(f"{r.turns_per_s:,.0f}" for r in each)
            print(
                f"  [{backend} throughput] {procs} procs {side:<9}: {shown} turns/s "
                f"(rounds); verified {len(results)} sessions",
                file=sys.stderr,
                flush=True,
            )
    first = table[args.processes[0]]
    lines = [
        f"{backend}: throughput, turns/s of all processes over a {args.seconds:g} s window, "
        f"best of {args.tp_rounds} round(s); agentkeep resume read load_session({scope_name}); "
        "ratio = agentkeep turns/s / langgraph turns/s (>1: agentkeep faster); "
        f"scale = turns/s / turns/s at {args.processes[0]} proc; "
        "CPU = the workers' own CPU ms per turn",
        f"  {'procs':>5} | {'agentkeep':>9} | {'langgraph':>9} | {'ratio':>6} | "
        f"{'ak scale':>8} | {'lg scale':>8} | {'ak CPU':>6} | {'lg CPU':>6}",
    ]
    lines.append("  " + "-" * (len(lines[-1]) - 2))
    for procs, row in table.items():
        ak, lg = row["agentkeep"], row["langgraph"]
        lines.append(
            f"  {procs:>5} | {ak.turns_per_s:>9,.0f} | {lg.turns_per_s:>9,.0f} | "
            f"{ak.turns_per_s / lg.turns_per_s:>5.2f}x | "
            f"{ak.turns_per_s / first['agentkeep'].turns_per_s:>7.2f}x | "
            f"{lg.turns_per_s / first['langgraph'].turns_per_s:>7.2f}x | "
            f"{ak.cpu_ms:>6.2f} | {lg.cpu_ms:>6.2f}"
        )
    return lines


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
    parser.add_argument(
        "--throughput",
        action="store_true",
        help="only the throughput section: turns/s of 1, 4 and 8 worker processes",
    )
    parser.add_argument(
        "--processes",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[1, 4, 8],
        help="throughput: comma-separated process counts (default 1,4,8)",
    )
    parser.add_argument("--seconds", type=float, default=2.0, help="throughput: timed window")
    parser.add_argument("--tp-rounds", type=int, default=2, help="throughput: windows per side")
    parser.add_argument(
        "--tp-scope",
        choices=["head", "tail"],
        default="head",
        help=f"throughput: resume read HeadScope() or ActivePathScope(tail={TAIL})",
    )
    args = parser.parse_args()
    if args.lengths:
        lengths = [int(x) for x in args.lengths.split(",")]
    else:
        lengths = [10, 1000] if args.quick else [10, 1000, 10_000]

    out: list[str] = []
    if args.throughput:
        load = " / ".join(f"{x:.2f}" for x in os.getloadavg())
        out += [f"machine: {os.cpu_count()} cores, load average {load} (1/5/15 min) at start", ""]
        with tempfile.TemporaryDirectory() as d:
            out += throughput("SQLite", Path(d), args)
            if not args.no_postgres:
                out += [""] + throughput("Postgres", Path(d), args)
        print()
        print("\n".join(out))
        return
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        if not args.no_growth:
            with sqlite_saver(tmp / "langgraph.db") as lg:
                ak = f"sqlite:///{tmp / 'agentkeep.db'}"
                upgrade(f"sqlite:///{tmp / 'raw.db'}")
                raw = raw_connect(tmp / "raw.db")
                try:
                    floor = (f"sqlite:///{tmp / 'recorded.db'}", raw)
                    out += growth("SQLite", ak, lg, lengths, args.window, floor, tmp) + [""]
                finally:
                    raw.close()
        if not args.no_postgres and not args.no_growth:
            import psycopg

            names = [f"agentkeep_bench_turns_{n}" for n in ("ak", "lg", "rec", "raw")]
            with scratch_databases(args.pg_url, names) as (ak, lg_url, rec, raw_url):
                with postgres_saver(lg_url) as lg:
                    ak_url, rec_url, raw_ak = (
                        u.replace("postgresql://", "postgresql+psycopg://", 1)
                        for u in (ak, rec, raw_url)
                    )
                    upgrade(raw_ak)
                    with psycopg.connect(raw_url) as raw_pg:
                        floor_pg = (rec_url, raw_pg)
                        out += growth("Postgres", ak_url, lg, lengths, args.window, floor_pg)
                        out += [""]
        out += bench_path_load(tmp, args.n, args.rounds)
        out += [""] + bench_atomic_apply(tmp, args.n, args.rounds)
    print()
    print("\n".join(out))


if __name__ == "__main__":
    main()
