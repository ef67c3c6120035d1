"""LangGraph checkpointer benchmark: AgentkeepSaver vs the stock SqliteSaver and PostgresSaver.

    .venv/bin/python benchmarks/bench_langgraph.py [--steps 200] [--rounds 3] [--no-postgres]

One real ``StateGraph`` (three nodes, ``plan -> act -> review -> plan ...``,
a ``messages`` state that grows by one message per step) runs ``--steps``
super-steps in one ``invoke`` on a fresh thread, once per saver and round
(the rounds go round-robin over the savers, all open at once); the best round
is reported. Every step is one checkpoint ``put`` and one
``put_writes`` (plus the input checkpoint), so the figure is the saver's cost
per step under a real graph, LangGraph's own work included.

Savers, side by side in one run:

* SQLite: ``AgentkeepSaver(Store)`` (WAL, ``synchronous=NORMAL``: the store's
  defaults), the same inside ``owning`` (fenced puts), and the stock
  ``SqliteSaver`` on a sqlite3 connection (its ``setup`` turns WAL on;
  ``synchronous`` is sqlite3's default FULL unless ``--stock-normal``).
* The SQLite floor (``--floor``): ``FloorSaver``, a saver that sends the
  statements AgentkeepSaver sends on SQLite (``BEGIN IMMEDIATE``, the node
  upsert with the folded lease guard, the blob insert, ``COMMIT``; the
  pending writes as one guarded insert in autocommit), compiled from the
  same Statement objects, on a bare sqlite3 connection with a lock, and
  nothing else: no argument or text checks, no unit of work, no retry.
  Its ratio is the most this schema and these statements allow; the gap
  between it and AgentkeepSaver is agentkeep's Python.
* Postgres (unless ``--no-postgres``; a fresh database per saver):
  ``AgentkeepSaver(Store)`` on psycopg, the same inside ``owning``, and the
  stock ``PostgresSaver`` (autocommit, pipeline where supported).

Ratios are the stock saver's time over agentkeep's on the same backend:
above 1.0 agentkeep is faster.

``--replay`` (SQLite) measures the savers alone, without the graph: the
put / put_writes calls of one ``--steps`` invoke are recorded (an
``InMemorySaver`` subclass), the serializer's bytes of every value computed
once and handed back by a caching serializer, and the calls replayed into
each saver on a fresh thread id, ``--rounds`` times round-robin; it prints
thread CPU µs per put and per put_writes (best and median). Only the
saver's own work counts (its Python, its statements, the content hash).
``--saver NAME --replays N`` replays into one saver only, N times: under
``valgrind --tool=callgrind``, (instructions with N=5 - with N=1) / 4 /
(steps + 1) is that saver's cost per step, independent of the machine's load.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import sqlite3
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from pathlib import Path
from typing import Annotated, Any, TypedDict

import psycopg
from langgraph.checkpoint.base import WRITES_IDX_MAP, get_checkpoint_metadata
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.checkpoint.postgres import PostgresSaver
from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer
from langgraph.checkpoint.sqlite import SqliteSaver
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages

from agentkeep import Store
from agentkeep.integrations.langgraph import AgentkeepSaver
from agentkeep.sessions import checkpoint_nodes as nodes
from agentkeep.statements import CompileTarget, Statement

PG = "postgresql://postgres@127.0.0.1:5432"


class State(TypedDict):
    messages: Annotated[list[Any], add_messages]


def build_graph(saver: Any, steps: int) -> Any:
    """plan -> act -> review -> plan ... for exactly ``steps`` node runs (one per super-step)."""

    order = ("plan", "act", "review")

    def node(name: str) -> Callable[[State], dict[str, Any]]:
        def run(state: State) -> dict[str, Any]:
            return {"messages": [("ai", f"{name} {len(state['messages'])}")]}

        return run

    def after(name: str) -> Callable[[State], str]:
        following = order[(order.index(name) + 1) % len(order)]

        def route(state: State) -> str:
            return following if len(state["messages"]) <= steps else END

        return route

    graph = StateGraph(State)
    for name in order:
        graph.add_node(name, node(name))
        graph.add_conditional_edges(name, after(name), [order[(order.index(name) + 1) % 3], END])
    graph.add_edge(START, "plan")
    return graph.compile(checkpointer=saver)


def run_once(saver: Any, steps: int, owning: bool) -> float:
    """Seconds for one ``invoke`` of ``steps`` super-steps on a fresh thread."""
    graph = build_graph(saver, steps)
    thread = uuid.uuid4().hex
    config = {"configurable": {"thread_id": thread}, "recursion_limit": steps + 10}
    block: AbstractContextManager[Any] = saver.owning(thread) if owning else nullcontext()
    start = time.perf_counter()
    with block:
        out = graph.invoke({"messages": [("user", "go")]}, config)
    elapsed = time.perf_counter() - start
    assert len(out["messages"]) == steps + 1, len(out["messages"])
    history = list(saver.list({"configurable": {"thread_id": thread}}))
    assert len(history) == steps + 2, len(history)  # input, start, one per step
    return elapsed


@contextmanager
def pg_database() -> Iterator[str]:
    name = f"ak_bench_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(f"{PG}/postgres", autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"{PG}/{name}"
    finally:
        with psycopg.connect(f"{PG}/postgres", autocommit=True) as admin:
            admin.execute(f'DROP DATABASE "{name}" WITH (FORCE)')


@contextmanager
def agentkeep_saver(url: str) -> Iterator[AgentkeepSaver]:
    store = Store.open(url, migrate=True)
    try:
        yield AgentkeepSaver(store)
    finally:
        store.close()


class FloorSaver(AgentkeepSaver):
    """AgentkeepSaver's SQLite statements on a bare sqlite3 connection, nothing else.

    The same Statement objects, compiled for the store's dialect, the same
    parameters (the lease guard judged at the wall clock), one lock for the
    connection; no checks, no unit of work. Unfenced puts only (no ``owning``).
    """

    def __init__(self, store: Store, path: Path) -> None:
        super().__init__(store)
        self.conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self.conn.execute("PRAGMA synchronous=NORMAL")
        self.conn.execute("PRAGMA busy_timeout=5000")
        with store.engine.connect() as conn:
            self.target = CompileTarget.of(conn.dialect)
        self.lock = threading.Lock()

    def _run(self, stmt: Statement, params: dict[str, Any]) -> None:
        form = stmt.compiled(self.target)
        self.conn.execute(form.sql, params if form.plain else form.bind(params))

    def put(self, config: Any, checkpoint: Any, metadata: Any, new_versions: Any) -> Any:
        conf = config["configurable"]
        thread, ns = conf["thread_id"], conf.get("checkpoint_ns", "")
        type_, body = self.serde.dumps_typed(checkpoint)
        meta = get_checkpoint_metadata(config, metadata)
        ref = hashlib.sha256(body).hexdigest()
        node = {
            "sid": self.session_id(thread, ns),
            "nid": checkpoint["id"],
            "parent": conf.get("checkpoint_id"),
            "json": json.dumps({"type": type_, "metadata": meta}, ensure_ascii=False),
            "live": 0,
            "ref": ref,
            "run": None,
        }
        guard = nodes._sqlite_guard_params(self.session_id(thread), None, _now_ms(), None)
        assert guard is not None
        blob = {"hash": ref, "kind": nodes.KIND_OPAQUE, "compression": "none", "content": body}
        with self.lock:
            self.conn.execute("BEGIN IMMEDIATE")
            self._run(nodes._SQLITE_PUT_NODE[False], {**node, **guard})
            self._run(nodes._PUT_BLOB, blob)
            self.conn.execute("COMMIT")
        return {
            "configurable": {
                "thread_id": thread,
                "checkpoint_ns": ns,
                "checkpoint_id": checkpoint["id"],
            }
        }

    def put_writes(self, config: Any, writes: Any, task_id: str, task_path: str = "") -> None:
        conf = config["configurable"]
        thread = conf["thread_id"]
        sid = self.session_id(thread, conf.get("checkpoint_ns", ""))
        rows = []
        for idx, (channel, value) in enumerate(writes):
            type_, raw = self.serde.dumps_typed(value)
            rows.append(
                {
                    "sid": sid,
                    "nid": conf["checkpoint_id"],
                    "task": task_id,
                    "path": task_path,
                    "idx": WRITES_IDX_MAP.get(channel, idx),
                    "channel": channel,
                    "type": type_,
                    "value": raw,
                }
            )
        guard = nodes._sqlite_guard_params(self.session_id(thread), None, _now_ms(), None)
        assert guard is not None
        params = {**nodes._write_rows_params(rows), **guard}
        with self.lock:
            self._run(nodes._SQLITE_ADD_WRITES[False, len(rows)], params)


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


@contextmanager
def stock_sqlite(path: Path, normal: bool) -> Iterator[SqliteSaver]:
    conn = sqlite3.connect(path, check_same_thread=False)
    try:
        saver = SqliteSaver(conn)
        saver.setup()
        if normal:
            conn.execute("PRAGMA synchronous=NORMAL")
        yield saver
    finally:
        conn.close()


class _RecordingSaver(InMemorySaver):
    """An in-memory saver that keeps a deep copy of every put / put_writes call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def put(self, config: Any, checkpoint: Any, metadata: Any, new_versions: Any) -> Any:
        self.calls.append(("put", copy.deepcopy((config, checkpoint, metadata, new_versions))))
        return super().put(config, checkpoint, metadata, new_versions)

    def put_writes(self, config: Any, writes: Any, task_id: str, task_path: str = "") -> None:
        self.calls.append(("put_writes", copy.deepcopy((config, writes, task_id, task_path))))
        super().put_writes(config, writes, task_id, task_path)


class _CachedSerde:
    """LangGraph's serializer with every recorded value's bytes computed once (by identity)."""

    def __init__(self, calls: list[tuple[str, tuple[Any, ...]]]) -> None:
        self.real = JsonPlusSerializer()
        self.bytes: dict[int, tuple[str, bytes]] = {}
        for kind, args in calls:
            values = [args[1]] if kind == "put" else [value for _, value in args[1]]
            for value in values:
                self.bytes[id(value)] = self.real.dumps_typed(value)

    def dumps_typed(self, obj: Any) -> tuple[str, bytes]:
        hit = self.bytes.get(id(obj))
        return self.real.dumps_typed(obj) if hit is None else hit

    def loads_typed(self, data: tuple[str, bytes]) -> Any:
        return self.real.loads_typed(data)


def replay_calls(saver: Any, calls: list[tuple[str, tuple[Any, ...]]]) -> dict[str, int]:
    """Replay ``calls`` into ``saver`` on a fresh thread id: thread CPU ns per kind of call."""
    thread = uuid.uuid4().hex
    spent = {"put": 0, "put_writes": 0}
    for kind, args in calls:
        config = {"configurable": {**args[0]["configurable"], "thread_id": thread}}
        call = saver.put if kind == "put" else saver.put_writes
        start = time.thread_time_ns()
        call(config, *args[1:])
        spent[kind] += time.thread_time_ns() - start
    return spent


def replay_main(args: argparse.Namespace) -> None:
    """``--replay``: the savers alone, on the recorded calls of one invoke (module docstring)."""
    recorder = _RecordingSaver()
    run_graph = build_graph(recorder, args.steps)
    config = {"configurable": {"thread_id": "recorded"}, "recursion_limit": args.steps + 10}
    run_graph.invoke({"messages": [("user", "go")]}, config)
    calls = recorder.calls
    serde = _CachedSerde(calls)
    puts = sum(1 for kind, _ in calls if kind == "put")
    counts = {"put": puts, "put_writes": len(calls) - puts}
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        savers: dict[str, Any] = {}
        store = stack.enter_context(Store.open(f"sqlite:///{Path(tmp) / 'ak.db'}", migrate=True))
        savers["AgentkeepSaver"] = AgentkeepSaver(store, serde=serde)  # type: ignore[arg-type]
        floor_path = Path(tmp) / "floor.db"
        floor_store = stack.enter_context(Store.open(f"sqlite:///{floor_path}", migrate=True))
        floor = FloorSaver(floor_store, floor_path)
        floor.serde = serde  # type: ignore[assignment]
        stack.callback(floor.conn.close)
        savers["floor"] = floor
        stock = stack.enter_context(stock_sqlite(Path(tmp) / "stock.db", True))
        stock.serde = serde  # type: ignore[assignment]
        savers["SqliteSaver"] = stock
        if args.saver:
            for _ in range(args.replays):
                replay_calls(savers[args.saver], calls)
            return
        for saver in savers.values():
            replay_calls(saver, calls)  # warm-up: statements compiled, pages cached
        spent: dict[str, list[dict[str, int]]] = {name: [] for name in savers}
        for _ in range(args.rounds):
            for name, saver in savers.items():
                spent[name].append(replay_calls(saver, calls))
    print(
        f"the put / put_writes calls of one {args.steps}-step invoke, replayed (serializer "
        f"bytes cached), SQLite, {args.rounds} rounds: thread CPU µs per call, best / median"
    )
    for name, rounds in spent.items():
        cells = []
        for kind in ("put", "put_writes"):
            per_call = sorted(r[kind] / counts[kind] / 1e3 for r in rounds)
            cells.append(f"{kind} {per_call[0]:6.1f} / {per_call[len(per_call) // 2]:6.1f}")
        print(f"  {name:<16} " + "   ".join(cells))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-postgres", action="store_true")
    ap.add_argument(
        "--stock-normal", action="store_true", help="SqliteSaver with synchronous=NORMAL"
    )
    ap.add_argument(
        "--floor", action="store_true", help="also FloorSaver: agentkeep's SQLite statements, bare"
    )
    ap.add_argument(
        "--replay", action="store_true", help="the savers alone, on one invoke's recorded calls"
    )
    ap.add_argument(
        "--saver",
        choices=("AgentkeepSaver", "floor", "SqliteSaver"),
        help="--replay: only this saver, --replays times, nothing printed (for callgrind)",
    )
    ap.add_argument("--replays", type=int, default=1)
    args = ap.parse_args()
    if args.replay:
        replay_main(args)
        return
    steps, rounds = args.steps, args.rounds
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        # (backend, name, saver, owning), every saver open at once: the rounds
        # go round-robin over them, so a slow spell of the machine hits all alike.
        runs: list[tuple[str, str, Any, bool]] = []
        ak_sqlite = stack.enter_context(agentkeep_saver(f"sqlite:///{Path(tmp) / 'ak.db'}"))
        runs.append(("sqlite", "AgentkeepSaver", ak_sqlite, False))
        runs.append(("sqlite", "AgentkeepSaver + owning", ak_sqlite, True))
        if args.floor:
            floor_path = Path(tmp) / "floor.db"
            floor_store = stack.enter_context(Store.open(f"sqlite:///{floor_path}", migrate=True))
            floor = FloorSaver(floor_store, floor_path)
            stack.callback(floor.conn.close)
            runs.append(("sqlite", "floor: same SQL, bare", floor, False))
        stock = stack.enter_context(stock_sqlite(Path(tmp) / "stock.db", args.stock_normal))
        runs.append(("sqlite", "SqliteSaver (stock)", stock, False))
        if not args.no_postgres:
            url = stack.enter_context(pg_database())
            ak_pg = stack.enter_context(
                agentkeep_saver(url.replace("postgresql://", "postgresql+psycopg://"))
            )
            runs.append(("postgres", "AgentkeepSaver", ak_pg, False))
            runs.append(("postgres", "AgentkeepSaver + owning", ak_pg, True))
            stock_url = stack.enter_context(pg_database())
            stock_pg = stack.enter_context(PostgresSaver.from_conn_string(stock_url))
            stock_pg.setup()
            runs.append(("postgres", "PostgresSaver (stock)", stock_pg, False))
        for _, _, saver, owning in runs:
            run_once(saver, 5, owning)  # warm-up: statements compiled, connections open
        best = [float("inf")] * len(runs)
        for _ in range(rounds):
            for i, (_, _, saver, owning) in enumerate(runs):
                best[i] = min(best[i], run_once(saver, steps, owning))
    results = [(b, name, t) for (b, name, _, _), t in zip(runs, best, strict=True)]

    print(
        f"LangGraph StateGraph, 3 nodes, messages state, {steps} steps per invoke, "
        f"best of {rounds} (round-robin)"
    )
    print(f"{'backend':<10} {'saver':<26} {'total ms':>10} {'ms/step':>9} {'stock/this':>11}")
    stock_time = {b: t for b, name, t in results if "stock" in name}
    for backend, name, t in results:
        ratio = stock_time[backend] / t if backend in stock_time else float("nan")
        print(
            f"{backend:<10} {name:<26} {t * 1000:>10.1f} {t * 1000 / steps:>9.3f} {ratio:>10.2f}x"
        )


if __name__ == "__main__":
    main()
