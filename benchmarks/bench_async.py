"""AsyncStore under concurrency: native asyncio drivers vs the thread facade, SQLite and Postgres.

    .venv/bin/python benchmarks/bench_async.py [--tasks 100] [--turns 20] [--repeats 3]
        [--pool default,20] [--backends sqlite,postgres] [--threads N] [--rtt-ms MS]
        [--modes DRIVER,...] [--no-check]

100 asyncio tasks, each committing ``--turns`` turns one after the other on its
own session, all running at once (``asyncio.gather``). A turn is one
``await astore.commits.commit_runtime_state(...)`` fenced by the task's lease:
three message nodes (user, assistant, tool result) appended to the active
path, a small checkpoint state and one usage delta. Throughput is turns per
second of wall time for the whole gather; also printed: the time one turn
takes as its task sees it, this process's CPU time per turn (all threads:
the event loop's, the executor's, aiosqlite's), and how many connections the
pool opened during the timed gather (SQLAlchemy's QueuePool closes an
overflow connection that comes back to a full pool, so 100 tasks on 5 + 10
connections keep opening new ones).

Configurations (each on a fresh database: a temp SQLite file, or a temp
Postgres database created, migrated, and dropped at the end):

* SQLite: thread facade (``sqlite:///…``) and native (``sqlite+aiosqlite:///…``);
* Postgres: thread facade (``postgresql+psycopg://…``), native asyncpg
  (``postgresql+asyncpg://…``) and native psycopg (``postgresql+psycopg_async://…``).

Pool settings (``--pool``): ``default`` is SQLAlchemy's (``pool_size=5``,
``max_overflow=10``) for every mode; ``20`` is ``pool_size=20,
max_overflow=0`` for every mode; ``20-noping`` is ``20`` without the pool's
pre-ping (a diagnostic: agentkeep's engines ping on checkout). The thread
facade runs each operation on the event loop's default executor, so at most
that many operations run at once: ``min(32, cpu + 4)`` threads by default,
or ``--threads N``.

``--rtt-ms MS`` (Postgres): the timed rounds connect through a relay process
(``_pgwire.start_delay_relay``) that holds every chunk ``MS / 2`` in each
direction, as a network between application and database would; the
measured ``SELECT 1`` time through it is printed (the relay's timers round
up to whole milliseconds).

Method: a round opens the store, warms up (one turn per task, untimed: opens
the pooled connections, the executor's threads, prepared statements), then
times one gather of ``--turns`` turns per task, and closes the store. Rounds
of the configurations are interleaved (round r of each before round r+1 of
any), so background load hits them alike; ``--repeats`` rounds, median kept.
Afterwards every database must hold exactly the turns committed (head
revision and nodes of every session), or the script exits 1.

Checks (``--no-check`` skips them; exit 1 on a mismatch): one turn of each
mode runs with agentkeep's driver calls recorded (:class:`agentkeep.db.Driver`
statements, BEGIN, SAVEPOINTs, COMMIT): the modes of one backend must make
exactly the same calls. Then what reaches the database is shown per turn:
Postgres round trips, read off the wire by a relay (``_pgwire.WireTap``), so
the pool's pre-ping and each driver's own BEGIN count too; SQLite statements
(sqlite3's trace callback) and the hops to aiosqlite's worker thread.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _common import print_table
from sqlalchemy import create_engine, event, make_url, text

from agentkeep import db as akdb
from agentkeep.aio import AsyncStore
from agentkeep.migrations import upgrade
from agentkeep.sessions.domain import Acquired, LeaseFence, LeaseOwnerIdentity
from agentkeep.sessions.records import (
    AppendNodes,
    HydratedSessionCheckpoint,
    RuntimeCommit,
    SessionNodeRecord,
    TokenUsage,
    UsageDelta,
)

PG_ADMIN_URL = os.environ.get(
    "AGENTKEEP_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)
OWNER = LeaseOwnerIdentity(owner_id="bench", incarnation_id="bench-1")
LEASE_TTL_MS = 10**12
NODES_PER_TURN = 3
USER_TEXT = "Please summarise the last three messages and list the open questions."
ASSISTANT_TEXT = "Here is the summary you asked for, with two open questions at the end."
TOOL_TEXT = '{"status": "ok", "rows": 3}'


@dataclass(frozen=True)
class Mode:
    """One way of opening the store: backend, label and URL driver name."""

    backend: str  # "sqlite" | "postgres"
    label: str
    drivername: str

    @property
    def native(self) -> bool:
        return self.drivername in (
            "sqlite+aiosqlite",
            "postgresql+asyncpg",
            "postgresql+psycopg_async",
        )


MODES = (
    Mode("sqlite", "thread (pysqlite)", "sqlite"),
    Mode("sqlite", "native aiosqlite", "sqlite+aiosqlite"),
    Mode("postgres", "thread (psycopg)", "postgresql+psycopg"),
    Mode("postgres", "native asyncpg", "postgresql+asyncpg"),
    Mode("postgres", "native psycopg_async", "postgresql+psycopg_async"),
)

POOLS: dict[str, dict[str, Any]] = {
    "default": {},
    "20": {"pool_size": 20, "max_overflow": 0},
    # Diagnostic: what the checkout's pre-ping costs (agentkeep pings by default on Postgres).
    "20-noping": {"pool_size": 20, "max_overflow": 0, "pool_pre_ping": False},
}


def pool_text(pool: str) -> str:
    if pool == "default":
        return "pool_size=5, max_overflow=10 (SQLAlchemy's defaults)"
    return ", ".join(f"{k}={v}" for k, v in POOLS[pool].items())


# --------------------------------------------------------------------------
# Databases


class Database:
    """A fresh migrated database for one configuration (``url`` on the sync driver)."""

    def __init__(self, backend: str, tmp: Path) -> None:
        self.backend = backend
        if backend == "sqlite":
            self.url = f"sqlite:///{tmp / f'bench-{uuid.uuid4().hex[:8]}.db'}"
        else:
            name = f"agentkeep_bench_{uuid.uuid4().hex[:12]}"
            admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
            with admin.connect() as conn:
                conn.execute(text(f'CREATE DATABASE "{name}"'))
            admin.dispose()
            self.url = make_url(PG_ADMIN_URL).set(database=name).render_as_string(False)
        upgrade(self.url)

    def url_for(self, mode: Mode, port: int | None = None) -> str:
        """The URL on ``mode``'s driver (Postgres: through 127.0.0.1:``port`` when given)."""
        url = make_url(self.url).set(drivername=mode.drivername)
        if port is not None:
            url = url.set(host="127.0.0.1", port=port)
        return url.render_as_string(False)

    def drop(self) -> None:
        if self.backend == "postgres":
            name = make_url(self.url).database
            admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
            with admin.connect() as conn:
                conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
            admin.dispose()

    def count(self) -> tuple[dict[str, int], int]:
        """Head revision of every session, and the number of graph nodes."""
        engine = create_engine(self.url)
        try:
            with engine.connect() as conn:
                heads = dict(
                    conn.execute(text("SELECT session_id, head_revision FROM session_head")).all()
                )
                nodes = conn.execute(text("SELECT count(*) FROM graph_nodes")).scalar_one()
        finally:
            engine.dispose()
        return {str(k): int(v) for k, v in heads.items()}, int(nodes)


def round_trip_ms(port: int | None, n: int = 50) -> float:
    """Median ms of ``SELECT 1`` on the admin database (through 127.0.0.1:``port`` if given)."""
    url = make_url(PG_ADMIN_URL)
    if port is not None:
        url = url.set(host="127.0.0.1", port=port)
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            times = []
            for _ in range(n):
                t0 = time.perf_counter()
                conn.exec_driver_sql("SELECT 1").all()
                times.append(time.perf_counter() - t0)
    finally:
        engine.dispose()
    return statistics.median(times) * 1000


def postgres_reachable() -> str | None:
    try:
        engine = create_engine(PG_ADMIN_URL, connect_args={"connect_timeout": 5})
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
        engine.dispose()
    except Exception as exc:  # noqa: BLE001 - any failure means unreachable
        return f"{type(exc).__name__}: {exc}"
    return None


# --------------------------------------------------------------------------
# Sessions and turns


@dataclass
class SessionState:
    """One task's session: its lease and where its head is."""

    sid: str
    lease: LeaseFence | None = None
    rev: int = 0
    leaf: str | None = None
    turn: int = 0


def turn_commit(s: SessionState) -> RuntimeCommit:
    i = s.turn
    user = SessionNodeRecord(
        node_id=f"{i}-u",
        parent_node_id=s.leaf,
        timestamp=i,
        payload={"role": "user", "content": USER_TEXT},
    )
    assistant = SessionNodeRecord(
        node_id=f"{i}-a",
        parent_node_id=user.node_id,
        timestamp=i,
        payload={"role": "assistant", "content": ASSISTANT_TEXT},
    )
    tool = SessionNodeRecord(
        node_id=f"{i}-t",
        parent_node_id=assistant.node_id,
        timestamp=i,
        payload={"role": "tool", "content": TOOL_TEXT},
    )
    return RuntimeCommit(
        session_id=s.sid,
        expected_head_revision=s.rev,
        session_execution_lease=s.lease,
        graph=AppendNodes(nodes=(user, assistant, tool), leaf_node_id=tool.node_id),
        checkpoint=HydratedSessionCheckpoint(turn_state={"turn": i, "pending_tools": []}),
        usage_deltas=(
            UsageDelta(
                source="chat",
                model="m-1",
                usage=TokenUsage(input_tokens=120, output_tokens=40),
            ),
        ),
    )


async def one_turn(astore: AsyncStore, s: SessionState) -> None:
    result = await astore.commits.commit_runtime_state(turn_commit(s))
    s.rev = result.head_revision
    s.leaf = f"{s.turn}-t"
    s.turn += 1


async def run_turns(astore: AsyncStore, sessions: list[SessionState], turns: int) -> None:
    async def task(s: SessionState) -> None:
        for _ in range(turns):
            await one_turn(astore, s)

    await asyncio.gather(*(task(s) for s in sessions))


async def claim_leases(astore: AsyncStore, sessions: list[SessionState]) -> None:
    for s in sessions:
        if s.lease is None:
            out = await astore.leases.try_claim_session_execution_lease(s.sid, OWNER, LEASE_TTL_MS)
            assert isinstance(out, Acquired), out
            s.lease = out.lease


# --------------------------------------------------------------------------
# Timed rounds


@dataclass(frozen=True)
class Round:
    """One timed gather: wall and CPU seconds, connections the pool opened meanwhile."""

    wall: float
    cpu: float  # this process's CPU seconds, all threads (the event loop's and workers')
    connects: int


@dataclass
class Config:
    mode: Mode
    pool: str
    db: Database
    sessions: list[SessionState]
    rounds: list[Round] = field(default_factory=list)


def in_loop(coro_fn: Callable[[], Awaitable[Any]], threads: int | None) -> Any:
    """Run ``coro_fn()`` in a fresh event loop (with ``threads`` default-executor threads)."""

    async def main() -> Any:
        if threads is not None:
            asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(threads))
        return await coro_fn()

    return asyncio.run(main())


def one_round(cfg: Config, turns: int, threads: int | None, port: int | None) -> Round:
    async def body() -> Round:
        url = cfg.db.url_for(cfg.mode, port if cfg.mode.backend == "postgres" else None)
        astore = await AsyncStore.open(url, **POOLS[cfg.pool])
        engine = astore.engine.sync_engine if cfg.mode.native else astore.engine
        connects = [0]

        def on_connect(*_: Any) -> None:
            connects[0] += 1

        event.listen(engine, "connect", on_connect)
        try:
            await claim_leases(astore, cfg.sessions)
            await run_turns(astore, cfg.sessions, 1)  # warm-up
            connects[0] = 0
            c0, t0 = time.process_time(), time.perf_counter()
            await run_turns(astore, cfg.sessions, turns)
            return Round(time.perf_counter() - t0, time.process_time() - c0, connects[0])
        finally:
            await astore.close()

    result: Round = in_loop(body, None if cfg.mode.native else threads)
    return result


# --------------------------------------------------------------------------
# What each mode runs per turn


def _driver_label(stmt: Any) -> str:
    return str(getattr(stmt, "name", None) or stmt)


@contextmanager
def driver_calls() -> Iterator[list[str]]:
    """Record agentkeep's calls on :class:`agentkeep.db.Driver` (statements, BEGIN, COMMIT…)."""
    seen: list[str] = []
    D = akdb.Driver
    real = {
        n: getattr(D, n)
        for n in (
            "execute",
            "executemany",
            "begin",
            "commit",
            "rollback",
            "_plain",
            "send_with_begin",
            "defer",
        )
    }
    deferring = [False]  # an execute made by defer (SQLite, asyncpg) is that defer's call

    def execute(self: Any, stmt: Any, params: Any) -> Any:
        if not deferring[0]:
            seen.append(f"execute {_driver_label(stmt)}")
        return real["execute"](self, stmt, params)

    def defer(self: Any, stmt: Any, params: Any, check: Any = None) -> None:
        # a deferred write is the same call as an execute of it, sent now or pipelined
        seen.append(f"execute {_driver_label(stmt)}")
        deferring[0] = True
        try:
            real["defer"](self, stmt, params, check)
        finally:
            deferring[0] = False

    def executemany(self: Any, stmt: Any, params: Any) -> Any:
        seen.append(f"executemany {_driver_label(stmt)} x{len(params)}")
        return real["executemany"](self, stmt, params)

    def begin(self: Any, *, write: bool) -> None:
        seen.append(f"begin(write={write})")
        real["begin"](self, write=write)

    def commit(self: Any) -> None:
        seen.append("commit")
        real["commit"](self)

    def rollback(self: Any) -> None:
        seen.append("rollback")
        real["rollback"](self)

    def plain(self: Any, sql: str) -> None:
        seen.append(_mask_savepoint(sql))
        real["_plain"](self, sql)

    def send_with_begin(self: Any, stmt: Any, params: Any) -> bool:
        # psycopg sends a lock with the unit's BEGIN: the same call as an execute of it
        sent: bool = real["send_with_begin"](self, stmt, params)
        if sent:
            seen.append(f"execute {_driver_label(stmt)}")
        return sent

    for name, fn in (
        ("execute", execute),
        ("executemany", executemany),
        ("begin", begin),
        ("commit", commit),
        ("rollback", rollback),
        ("_plain", plain),
        ("send_with_begin", send_with_begin),
        ("defer", defer),
    ):
        setattr(D, name, fn)
    try:
        yield seen
    finally:
        for name, fn in real.items():
            setattr(D, name, fn)


@contextmanager
def aiosqlite_hops() -> Iterator[list[int]]:
    """Count the calls handed to aiosqlite's worker thread (each one a queue hop and back)."""
    import aiosqlite

    count = [0]
    real = aiosqlite.Connection._execute

    async def _execute(self: Any, fn: Any, *args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return await real(self, fn, *args, **kwargs)

    aiosqlite.Connection._execute = _execute  # type: ignore[method-assign]
    try:
        yield count
    finally:
        aiosqlite.Connection._execute = real  # type: ignore[method-assign]


@dataclass
class Trace:
    driver: list[str]
    wire: list[str]  # Postgres round trips, or SQLite statements
    hops: int | None = None  # aiosqlite worker-thread hops (native SQLite)


def trace_turn(mode: Mode, db: Database, tap: Any) -> Trace:
    """One steady-state turn of ``mode`` (after warm-up turns), with what it ran recorded."""
    url = db.url_for(mode)
    kwargs: dict[str, Any] = {}
    if mode.backend == "postgres":
        url = make_url(url).set(host="127.0.0.1", port=tap.port).render_as_string(False)
        kwargs["connect_args"] = (
            {"ssl": False}
            if mode.drivername.endswith("asyncpg")
            else {"sslmode": "disable", "gssencmode": "disable"}
        )
    session = SessionState(sid=f"trace-{mode.drivername}")
    trace_sql: list[str] = []
    on = [False]

    async def body() -> Trace:
        astore = await AsyncStore.open(url, pool_size=1, max_overflow=0, **kwargs)
        if mode.backend == "sqlite":
            # New connections get the trace callback: drop the one opened so far.
            if mode.native:
                sync_engine = astore.engine.sync_engine
                await astore.engine.dispose()
            else:
                sync_engine = astore.engine
                sync_engine.dispose()

            @event.listens_for(sync_engine, "connect")
            def _connect(dbapi_conn: Any, _rec: Any) -> None:
                raw = akdb._sqlite3_connection(dbapi_conn)
                raw.set_trace_callback(lambda s: trace_sql.append(s) if on[0] else None)

        try:
            await claim_leases(astore, [session])
            for _ in range(3):
                await one_turn(astore, session)
            if mode.backend == "postgres":
                with driver_calls() as calls, tap.record() as trips:
                    await one_turn(astore, session)
                return Trace(calls, list(trips))
            with driver_calls() as calls, aiosqlite_hops() as hops:
                on[0] = True
                await one_turn(astore, session)
                on[0] = False
            return Trace(calls, list(trace_sql), hops[0] if mode.native else None)
        finally:
            await astore.close()

    return in_loop(body, None)


def _mask_savepoint(sql: str) -> str:
    return " ".join("ak_sp_N" if w.startswith("ak_sp_") else w for w in sql.split())


_CAST = re.compile(r"::[A-Z]+\b")
_STRING = re.compile(r"[xX]?'(?:[^']|'')*'")
_NUMBER = re.compile(r"(?<![\w$])-?\d+(?:\.\d+)?\b")


def _short(sql: str, width: int = 90) -> str:
    sql = _mask_savepoint(sql)
    return sql if len(sql) <= width else sql[: width - 1] + "…"


def report_traces(modes: list[Mode], dbs: dict[str, Database]) -> bool:
    """Print what each mode runs per turn; False if modes of one backend differ in driver calls."""
    tap = None
    if any(m.backend == "postgres" for m in modes):
        from _pgwire import WireTap

        admin = make_url(PG_ADMIN_URL)
        tap = WireTap(admin.host or "127.0.0.1", admin.port or 5432)
    ok = True
    try:
        for backend in ("sqlite", "postgres"):
            ms = [m for m in modes if m.backend == backend]
            if not ms:
                continue
            traces = {m: trace_turn(m, dbs[backend], tap) for m in ms}
            first = traces[ms[0]].driver
            same = all(t.driver == first for t in traces.values())
            ok = ok and same
            print()
            print(
                f"{backend}: agentkeep's driver calls per turn: {len(first)} "
                + ("(identical in every mode)" if same else "(DIFFERENT between modes)")
            )
            for m, t in traces.items():
                if t.driver != first:
                    print(f"  {m.label}: {t.driver}")
            for call in first:
                print(f"    {_short(call)}")
            what = (
                "round trips to the server (on the wire)"
                if backend == "postgres"
                else ("statements SQLite ran (trace callback)")
            )
            counts = [
                (m.label, str(len(t.wire)), "" if t.hops is None else str(t.hops))
                for m, t in traces.items()
            ]
            print()
            print(f"{backend}: {what} per turn")
            headers = ["mode", "count"] + (["aiosqlite thread hops"] if backend == "sqlite" else [])
            print_table(headers, [c if backend == "sqlite" else c[:2] for c in counts])
            baseline = traces[ms[0]].wire
            for m, t in traces.items():
                print()
                print(f"  {m.label}:" + ("" if m is ms[0] else _diff_note(baseline, t.wire)))
                for line in t.wire:
                    print(f"    {_short(line)}")
    finally:
        if tap is not None:
            tap.close()
    return ok


def _normal(sql: str) -> str:
    """A statement as compared across modes: literals, savepoint names, bind casts masked.

    SQLite's trace shows the bound values (each mode's turn has its own
    session and times); the Postgres dialects render the casts of some binds
    differently for the same statement (psycopg ``%(content)s``, asyncpg
    ``$4::BYTEA``); asyncpg ends its simple queries with ``;``.
    """
    sql = _CAST.sub("", _mask_savepoint(sql))
    sql = _NUMBER.sub("N", _STRING.sub("'…'", sql))
    return sql.rstrip(";").rstrip() or sql


def _diff_note(base: list[str], other: list[str]) -> str:
    base, other = [_normal(s) for s in base], [_normal(s) for s in other]
    if other == base:
        return " the same statements as the thread facade, in the same order"
    extra = Counter(other) - Counter(base)
    missing = Counter(base) - Counter(other)
    parts = []
    if extra:
        parts.append("extra: " + "; ".join(f"{n}x {_short(s, 50)}" for s, n in extra.items()))
    if missing:
        parts.append("not sent: " + "; ".join(f"{n}x {_short(s, 50)}" for s, n in missing.items()))
    return " " + " | ".join(parts)


# --------------------------------------------------------------------------
# main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=100)
    parser.add_argument("--turns", type=int, default=20, help="timed turns per task per round")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--pool", default="default,20", help="comma list of: default, 20")
    parser.add_argument("--backends", default="sqlite,postgres")
    parser.add_argument(
        "--threads", type=int, default=None, help="thread facade: default-executor threads"
    )
    parser.add_argument(
        "--modes", default="", help="only these URL drivers, e.g. sqlite,postgresql+asyncpg"
    )
    parser.add_argument(
        "--rtt-ms",
        type=float,
        default=0.0,
        help="Postgres: time every round trip through a relay adding this much (a network's RTT)",
    )
    parser.add_argument("--no-check", action="store_true")
    args = parser.parse_args()

    backends = [b for b in args.backends.split(",") if b]
    pools = [p for p in args.pool.split(",") if p]
    for p in pools:
        if p not in POOLS:
            parser.error(f"--pool: {p!r} is not one of {sorted(POOLS)}")
    if "postgres" in backends:
        err = postgres_reachable()
        if err is not None:
            print(f"Postgres unreachable at {PG_ADMIN_URL} ({err}): Postgres skipped")
            backends.remove("postgres")
    wanted = {d for d in args.modes.split(",") if d}
    modes = [m for m in MODES if m.backend in backends and (not wanted or m.drivername in wanted)]
    threads = args.threads or min(32, (os.cpu_count() or 1) + 4)

    print(
        f"{args.tasks} tasks x {args.turns} turns each (one session per task, all at once), "
        f"{args.repeats} rounds, median; a turn = commit_runtime_state of "
        f"{NODES_PER_TURN} nodes + checkpoint + usage delta"
    )
    print(
        f"thread facade: {threads} default-executor threads"
        + ("" if args.threads else " (asyncio's default, min(32, cpu+4))")
        + f"; cpus: {os.cpu_count()}; Python {sys.version.split()[0]}; "
        + f"load average at start: {os.getloadavg()[0]:.1f}"
    )

    relay = None
    relay_port: int | None = None
    if args.rtt_ms and "postgres" in backends:
        from _pgwire import start_delay_relay

        admin = make_url(PG_ADMIN_URL)
        relay, relay_port = start_delay_relay(
            admin.host or "127.0.0.1", admin.port or 5432, args.rtt_ms
        )
        direct, relayed = round_trip_ms(None), round_trip_ms(relay_port)
        print(
            f"Postgres through a relay adding {args.rtt_ms:g} ms per round trip: "
            f"SELECT 1 takes {relayed:.2f} ms (direct: {direct:.2f} ms)"
        )

    status = 0
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        configs: list[Config] = []
        try:
            for pool in pools:
                for mode in modes:
                    sessions = [SessionState(sid=f"bench-{i:03d}") for i in range(args.tasks)]
                    configs.append(Config(mode, pool, Database(mode.backend, tmp), sessions))
            for r in range(args.repeats):
                order = configs[r % len(configs) :] + configs[: r % len(configs)]
                for cfg in order:
                    done = one_round(cfg, args.turns, args.threads, relay_port)
                    cfg.rounds.append(done)
                    print(
                        f"  round {r + 1}: {cfg.mode.label:<22} pool {cfg.pool:<7} "
                        f"{args.tasks * args.turns / done.wall:>8,.0f} turns/s",
                        file=sys.stderr,
                    )
            # Every turn landed: head revision and nodes of every session.
            for cfg in configs:
                heads, nodes = cfg.db.count()
                want_rev = args.repeats * (1 + args.turns)
                bad = {k: v for k, v in heads.items() if v != want_rev}
                if (
                    len(heads) != args.tasks
                    or bad
                    or nodes != NODES_PER_TURN * args.tasks * want_rev
                ):
                    print(
                        f"FAILED: {cfg.mode.label} pool {cfg.pool}: {len(heads)} sessions, "
                        f"{nodes} nodes, wrong heads {bad}"
                    )
                    status = 1

            for pool in pools:
                print()
                print(f"Pool: {pool_text(pool)}")
                rows = []
                for backend in backends:
                    group = [c for c in configs if c.pool == pool and c.mode.backend == backend]
                    thread = next((c for c in group if not c.mode.native), None)
                    for c in group:
                        n = args.tasks * args.turns
                        med = statistics.median(r.wall for r in c.rounds)
                        ratio = "1.00x" if c is thread else "-"
                        if thread is not None and c is not thread:
                            ratio = f"{statistics.median(r.wall for r in thread.rounds) / med:.2f}x"
                        rows.append(
                            (
                                f"{backend} {c.mode.label}",
                                f"{n / med:,.0f}",
                                ratio,
                                f"{med * 1000 / args.turns:.1f}",
                                f"{statistics.median(r.cpu for r in c.rounds) / n * 1e6:,.0f}",
                                f"{statistics.median(r.connects for r in c.rounds):.0f}",
                                ", ".join(f"{n / r.wall:,.0f}" for r in c.rounds),
                            )
                        )
                print_table(
                    [
                        "configuration",
                        "turns/s",
                        "vs thread",
                        "ms/turn seen by a task",
                        "client CPU µs/turn",
                        "conns opened",
                        "rounds (turns/s)",
                    ],
                    rows,
                )

            print()
            print(f"load average at the end of the timed rounds: {os.getloadavg()[0]:.1f}")
            if not args.no_check:
                dbs = {c.mode.backend: c.db for c in configs}
                if not report_traces(modes, dbs):
                    print("FAILED: the modes of one backend make different driver calls")
                    status = 1
        finally:
            for cfg in configs:
                cfg.db.drop()
            if relay is not None:
                assert relay.stdin is not None
                relay.stdin.close()
                relay.wait(10)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
