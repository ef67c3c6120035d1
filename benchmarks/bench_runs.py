"""Run store micro-benchmark: one-call vs held unit of work vs raw sqlite3 (design §7).

Usage::

    .venv/bin/python benchmarks/bench_runs.py [--n N] [--rounds R] [--warmup W] [--url URL]
        [--ops OP ...] [--layers] [--profile OP ...] [--profile-only] [--no-check]

For each hot operation (create, get, try_transition, acquire_assignee,
append_step_entry, list(status, limit 20)) and each variant, a fresh copy of a
migrated, seeded SQLite file is used:

* one-call: ``store.runs.<op>(...)``, one unit of work (and retry wrapper) per call;
* in-uow: ``with store.write() as uow:`` (``store.read()`` for reads), then N
  calls of ``uow.runs.<op>(...)``, commit included in the time;
* raw sqlite3: the stdlib driver (``isolation_level=None``, the store's PRAGMAs)
  running the SAME SQL text the repository sends, with the same transaction
  shape as one-call (``BEGIN IMMEDIATE``/``BEGIN DEFERRED`` ... ``COMMIT`` per
  call), JSON done with :mod:`json`.

Before timing, a check runs one call of each operation both ways on twin
files and compares the SQL statements SQLite saw (literals masked) and the
rows left behind; a mismatch aborts the benchmark.

Each variant: warm-up calls, then ``--rounds`` timed rounds of N calls with the
garbage collector paused (as :mod:`timeit` does); the best round is reported.
With a ``postgresql+psycopg://`` URL the store calls are timed on Postgres
instead (no raw comparison); the database must have an empty (or no) ``runs``
table, and every row the benchmark writes is deleted at the end.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import platform
import pstats
import re
import sqlite3
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import sqlalchemy  # noqa: E402
from _common import (  # noqa: E402
    CLOCK,
    SEED_SQL,
    SQL,
    STATUS_TEXT,
    T0,
    copy_db,
    fmt_int,
    make_template,
    migrate_upgrade,
    print_table,
    raw_connect,
    raw_record,
    remove_db,
    seed_id,
    seed_rows,
    seed_sqlite,
    seed_status,
    table_rows,
    timed,
    traced_store,
)
from sqlalchemy import text  # noqa: E402
from sqlalchemy.engine import make_url  # noqa: E402

from agentkeep import RunListFilter, RunRecord, RunStatus, StepEntry, Store  # noqa: E402
from agentkeep.bounds import I64_MAX as _MAX_I64  # noqa: E402

SEED_RUNS = 3000  # "a few thousand": list() filters and orders over all of them
HOT_RUNS = 500  # write targets rotate over this many runs
_JSON_DUMPS = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode
_time_ns = time.time_ns


class BenchError(Exception):
    pass


# --------------------------------------------------------------------------
# Operations. ``call(target, k)`` runs the k-th call on ``store.runs`` or
# ``uow.runs`` (same method names); ``raw(conn, k)`` is the raw sqlite3 body
# of the same call, without the transaction (the harness adds it).


class Op:
    name = ""
    write = True
    begin: str | None = "BEGIN IMMEDIATE"

    def prepare(self, calls: int) -> None:
        """Build per-call arguments outside the timed loops."""

    def call(self, target: Any, k: int) -> Any:
        raise NotImplementedError

    def raw(self, conn: sqlite3.Connection, k: int) -> Any:
        raise NotImplementedError

    def summary_store(self, result: Any) -> Any:
        return result

    def summary_raw(self, result: Any) -> Any:
        return result


class Create(Op):
    name = "create"

    def prepare(self, calls: int) -> None:
        self.records = [
            RunRecord.new(
                f"R-new-{k:07d}",
                f"T-new-{k // 5:07d}",
                T0 + 10_000 + k,
                operator_sid="S-bench",
                input_json='{"prompt":"benchmark"}',
            )
            for k in range(calls)
        ]

    def call(self, target: Any, k: int) -> Any:
        return target.create(self.records[k])

    def raw(self, conn: sqlite3.Connection, k: int) -> Any:
        r = self.records[k]
        current = r.current
        row = conn.execute(
            SQL["insert"],
            {
                "id": r.id,
                "task_id": r.task_id,
                "status": STATUS_TEXT[r.status],
                "steps": _JSON_DUMPS([e.model_dump() for e in r.step_entries]),
                "degradations": _JSON_DUMPS([e.model_dump() for e in r.degradations]),
                "operator_sid": r.operator_sid,
                "current": _JSON_DUMPS({s: current[s].model_dump() for s in sorted(current)})
                if current
                else None,
                "gen": r.next_generation,
                "result": None,  # result_ref is UNSET on a fresh run
                "input": r.input_json,
                "created_at": r.created_at,
                "updated_at": r.updated_at,
            },
        ).fetchone()
        if row is None:
            raise BenchError(f"duplicate {r.id}")


class Get(Op):
    name = "get"
    write = False
    begin = None  # one SELECT: the store opens no snapshot transaction for it

    def prepare(self, calls: int) -> None:
        self.ids = [seed_id((k * 7919) % SEED_RUNS) for k in range(calls)]

    def call(self, target: Any, k: int) -> Any:
        return target.get(self.ids[k])

    def raw(self, conn: sqlite3.Connection, k: int) -> Any:
        row = conn.execute(SQL["get"], {"id": self.ids[k]}).fetchone()
        if row is None:
            raise BenchError(f"not found {self.ids[k]}")
        return raw_record(row)

    def summary_store(self, r: Any) -> Any:
        return (r.id, r.status.value, len(r.step_entries), r.next_generation, r.input_json)

    def summary_raw(self, r: Any) -> Any:
        return (r["id"], r["status"], len(r["step_entries"]), r["next_generation"], r["input_json"])


class TryTransition(Op):
    """pending -> running, then back, rotating over the pending seeds: every call wins."""

    name = "try_transition"

    def prepare(self, calls: int) -> None:
        pending = [seed_id(i) for i in range(SEED_RUNS) if seed_status(i) is RunStatus.PENDING]
        pending = pending[:HOT_RUNS]
        p = len(pending)
        fwd = (RunStatus.PENDING, RunStatus.RUNNING)
        back = (RunStatus.RUNNING, RunStatus.PENDING)
        self.args = [(pending[k % p], *(fwd if (k // p) % 2 == 0 else back)) for k in range(calls)]

    def call(self, target: Any, k: int) -> Any:
        rid, frm, to = self.args[k]
        return target.try_transition(rid, frm, to)

    def raw(self, conn: sqlite3.Connection, k: int) -> Any:
        rid, frm, to = self.args[k]
        now = _time_ns() // 1_000_000_000
        cur = conn.execute(
            SQL["transition"],
            {"id": rid, "from_": STATUS_TEXT[frm], "to": STATUS_TEXT[to], "now": now},
        )
        return cur.rowcount == 1


class AcquireAssignee(Op):
    """Take slot ``main`` (held by the seed) on a rotating run: displaces a holder, G += 1."""

    name = "acquire_assignee"
    slot = "main"
    op = "op-bench"
    desc = "benchmark holder"

    def prepare(self, calls: int) -> None:
        self.ids = [seed_id(k % HOT_RUNS) for k in range(calls)]

    def call(self, target: Any, k: int) -> Any:
        return target.acquire_assignee(self.ids[k], self.slot, self.op, self.desc)

    def raw(self, conn: sqlite3.Connection, k: int) -> Any:
        rid = self.ids[k]
        slot = self.slot
        now = _time_ns() // 1_000_000_000
        row = conn.execute(SQL["get_slots"], {"id": rid}).fetchone()
        if row is None:
            raise BenchError(f"not found {rid}")
        current_json, gen = row
        current = {} if current_json is None else json.loads(current_json)
        if gen >= _MAX_I64:
            raise BenchError("generation overflow")
        new_gen = gen + 1
        previous = current.get(slot)
        current[slot] = {"op": self.op, "desc": self.desc, "gen": new_gen}
        encoded = _JSON_DUMPS({s: current[s] for s in sorted(current)})
        cur = conn.execute(
            SQL["set_slots"],
            {"id": rid, "current": encoded, "new_gen": new_gen, "old_gen": gen, "now": now},
        )
        if cur.rowcount != 1:
            raise BenchError("fence missed")
        return new_gen, previous

    def summary_store(self, r: Any) -> Any:
        gen, prev = r
        return gen, None if prev is None else (prev.op, prev.desc, prev.gen)

    def summary_raw(self, r: Any) -> Any:
        gen, prev = r
        return gen, None if prev is None else (prev["op"], prev["desc"], prev["gen"])


class AppendStepEntry(Op):
    """Append one entry to a rotating run (the stored array is decoded, then spliced)."""

    name = "append_step_entry"

    def prepare(self, calls: int) -> None:
        self.ids = [seed_id(k % HOT_RUNS) for k in range(calls)]
        self.entry = StepEntry.basic("ST-bench", "step-bench", "dispatched", None, T0 + 50)
        self.entry_dict = {
            "step_id": "ST-bench",
            "step_ref": "step-bench",
            "status": "dispatched",
            "at": T0 + 50,
        }

    def call(self, target: Any, k: int) -> Any:
        return target.append_step_entry(self.ids[k], self.entry)

    def raw(self, conn: sqlite3.Connection, k: int) -> Any:
        rid = self.ids[k]
        item = _JSON_DUMPS(self.entry_dict)
        now = _time_ns() // 1_000_000_000
        row = conn.execute(SQL["get_steps"], {"id": rid}).fetchone()
        if row is None:
            raise BenchError(f"not found {rid}")
        old = row[0]
        if type(json.loads(old)) is not list:  # the validating decode
            raise BenchError("corrupt")
        head = old.rstrip()[:-1].rstrip()
        new = f"{head}{item}]" if head.endswith("[") else f"{head},{item}]"
        cur = conn.execute(SQL["set_steps"], {"id": rid, "new": new, "now": now, "old": old})
        if cur.rowcount != 1:
            raise BenchError("fence missed")


class ListStatus(Op):
    """list(RunListFilter(status=running, limit=20)) over SEED_RUNS runs (a third running)."""

    name = "list(status,limit=20)"
    write = False
    begin = None  # one SELECT: the store opens no snapshot transaction for it

    def prepare(self, calls: int) -> None:
        self.flt = RunListFilter(status=RunStatus.RUNNING, limit=20)

    def call(self, target: Any, k: int) -> Any:
        return target.list(self.flt)

    def raw(self, conn: sqlite3.Connection, k: int) -> Any:
        rows = conn.execute(
            SQL["list_status"], {"limit": 20, "offset": 0, "status": STATUS_TEXT[RunStatus.RUNNING]}
        )
        return [raw_record(r) for r in rows.fetchall()]

    def summary_store(self, r: Any) -> Any:
        return [x.id for x in r]

    def summary_raw(self, r: Any) -> Any:
        return [x["id"] for x in r]


OPS: list[Op] = [
    Create(),
    Get(),
    TryTransition(),
    AcquireAssignee(),
    AppendStepEntry(),
    ListStatus(),
]
OP_BY_NAME = {op.name: op for op in OPS} | {"list": OPS[-1]}
VARIANTS = ("one-call", "in-uow", "raw", "raw-1txn")


# --------------------------------------------------------------------------
# Timing


class Plan:
    def __init__(self, n: int, rounds: int, warmup: int) -> None:
        self.n = n
        self.rounds = rounds
        self.warmup = warmup

    @property
    def calls(self) -> int:
        return self.warmup + self.rounds * self.n


class Variant:
    """One way of running an operation, on its own database handle.

    ``loop(start, n)`` runs calls ``start .. start+n-1``; every variant of an
    operation sees the same call indexes in the same order, so the data
    evolves identically in each variant's file.
    """

    name = ""

    def __init__(self, op: Op) -> None:
        self.op = op

    def loop(self, start: int, n: int) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class OneCall(Variant):
    name = "one-call"

    def __init__(self, op: Op, store: Store) -> None:
        super().__init__(op)
        self.store = store

    def loop(self, start: int, n: int) -> None:
        call = self.op.call
        runs = self.store.runs
        for k in range(start, start + n):
            call(runs, k)

    def close(self) -> None:
        self.store.close()


class InUow(OneCall):
    name = "in-uow"

    def loop(self, start: int, n: int) -> None:
        call = self.op.call
        unit = self.store.write if self.op.write else self.store.read
        with unit() as uow:
            runs = uow.runs
            for k in range(start, start + n):
                call(runs, k)


class Raw(Variant):
    """Raw sqlite3, one transaction per call (the shape of one-call)."""

    name = "raw"

    def __init__(self, op: Op, conn: sqlite3.Connection) -> None:
        super().__init__(op)
        self.conn = conn

    def loop(self, start: int, n: int) -> None:
        conn = self.conn
        body = self.op.raw
        begin = self.op.begin
        execute = conn.execute
        commit = conn.commit
        if begin is None:  # a single statement, its own implicit transaction
            for k in range(start, start + n):
                body(conn, k)
            return
        for k in range(start, start + n):
            execute(begin)
            try:
                body(conn, k)
            except BaseException:
                conn.rollback()
                raise
            commit()

    def close(self) -> None:
        self.conn.close()


class RawOneTxn(Raw):
    """Raw sqlite3, one transaction around all n calls (the shape of in-uow)."""

    name = "raw-1txn"

    def loop(self, start: int, n: int) -> None:
        conn = self.conn
        body = self.op.raw
        conn.execute(self.op.begin or "BEGIN DEFERRED")
        try:
            for k in range(start, start + n):
                body(conn, k)
        except BaseException:
            conn.rollback()
            raise
        conn.commit()


def run_interleaved(variants: list[Variant], plan: Plan) -> dict[str, float]:
    """Warm every variant up, then time round r of every variant before round r+1 of any.

    Interleaving spreads background load over all variants alike; the order
    rotates each round. Returns the best round of each variant as ops/s.
    """
    for v in variants:
        v.loop(0, plan.warmup)
    best = {v.name: float("inf") for v in variants}
    for r in range(plan.rounds):
        start = plan.warmup + r * plan.n
        order = variants[r % len(variants) :] + variants[: r % len(variants)]
        for v in order:
            best[v.name] = min(best[v.name], timed(v.loop, start, plan.n))
    return {name: plan.n / t for name, t in best.items()}


# --------------------------------------------------------------------------
# Same-SQL check

_LITERALS = re.compile(r"'(?:[^']|'')*'|\bNULL\b|(?<![\w.])-?\d+(?![\w.])")


def _mask(sql: str) -> str:
    return _LITERALS.sub("?", " ".join(sql.split()))


def check_same_sql(op: Op, template: Path, workdir: Path) -> list[str]:
    """One call via the store and via raw sqlite3 on twin files; both must match."""
    a, b = workdir / f"check-{op.name}-store.db", workdir / f"check-{op.name}-raw.db"
    copy_db(template, a)
    copy_db(template, b)
    k = 1  # not 0: exercises the rotation
    problems = []
    try:
        with traced_store(a) as (store, store_trace, on):
            on[0] = True
            store_result = op.call(store.runs, k)
            on[0] = False
        conn = raw_connect(b)
        raw_trace: list[str] = []
        conn.set_trace_callback(raw_trace.append)
        if op.begin is not None:
            conn.execute(op.begin)
        raw_result = op.raw(conn, k)
        conn.commit()
        conn.set_trace_callback(None)
        conn.close()
        s_sql = [_mask(s) for s in store_trace]
        r_sql = [_mask(s) for s in raw_trace]
        if s_sql != r_sql:
            problems.append(f"{op.name}: statements differ\n  store: {s_sql}\n  raw:   {r_sql}")
        if op.summary_store(store_result) != op.summary_raw(raw_result):
            problems.append(
                f"{op.name}: results differ: store {op.summary_store(store_result)!r} "
                f"raw {op.summary_raw(raw_result)!r}"
            )
        ra, rb = raw_connect(a), raw_connect(b)
        try:
            if table_rows(ra) != table_rows(rb):
                problems.append(f"{op.name}: rows differ after the call")
        finally:
            ra.close()
            rb.close()
        if not problems:
            shown: list[list[Any]] = []  # consecutive repeats (trigger steps) collapsed
            for stmt in s_sql:
                head = stmt.split(" WHERE")[0].split(" VALUES")[0][:44]
                if shown and shown[-1][0] == head:
                    shown[-1][1] += 1
                else:
                    shown.append([head, 1])
            print(
                f"  {op.name:<22} " + " ; ".join(h if c == 1 else f"{h} (x{c})" for h, c in shown)
            )
    finally:
        remove_db(a)
        remove_db(b)
    return problems


# --------------------------------------------------------------------------
# Drivers


def run_sqlite(args: argparse.Namespace, workdir: Path) -> int:
    plan = Plan(args.n, args.rounds, args.warmup)
    ops = [OP_BY_NAME[n] for n in args.ops] if args.ops else OPS
    base = workdir / "template.db"
    remove_db(base)
    make_template(base)
    seeded = workdir / "seeded.db"
    copy_db(base, seeded)
    seed_sqlite(seeded, seed_rows(SEED_RUNS))
    for op in ops:
        op.prepare(plan.calls)

    print(
        f"Python {platform.python_version()}, SQLite {sqlite3.sqlite_version}, "
        f"SQLAlchemy {sqlalchemy.__version__}; files in {workdir}"
    )
    print(
        f"N={plan.n} calls per round, {plan.rounds} rounds (best kept), {plan.warmup} warm-up "
        f"calls; table seeded with {SEED_RUNS} runs; synchronous=NORMAL, WAL; "
        f"clock: {'thread CPU time' if CLOCK[0] is time.thread_time else 'wall time'}"
    )

    if args.check:
        print("\nSame-SQL check (one call each way, literals masked; rows compared after):")
        problems = [p for op in ops for p in check_same_sql(op, seeded, workdir)]
        if problems:
            print("\n".join(problems), file=sys.stderr)
            return 1

    if args.layers:
        run_layers(seeded, workdir, plan)
    if args.profile:
        for name in args.profile:
            profile_onecall(OP_BY_NAME[name], seeded, workdir, plan)
    if args.profile_only:
        return 0

    rows, extra = [], []
    t_start = time.perf_counter()
    for op in ops:
        files = {name: workdir / f"bench-{op.name}-{name}.db" for name in VARIANTS}
        for f in files.values():
            copy_db(seeded, f)
        variants: list[Variant] = []
        try:
            variants.append(OneCall(op, Store.open(f"sqlite:///{files['one-call']}")))
            variants.append(InUow(op, Store.open(f"sqlite:///{files['in-uow']}")))
            variants.append(Raw(op, raw_connect(files["raw"])))
            variants.append(RawOneTxn(op, raw_connect(files["raw-1txn"])))
            res = run_interleaved(variants, plan)
        finally:
            for v in variants:
                v.close()
            for f in files.values():
                remove_db(f)
        one, uow, raw, raw1 = res["one-call"], res["in-uow"], res["raw"], res["raw-1txn"]
        rows.append(
            [
                op.name,
                fmt_int(one),
                fmt_int(uow),
                fmt_int(raw),
                f"{raw / one:.2f}x",
                f"{raw / uow:.2f}x",
            ]
        )
        extra.append(
            [
                op.name,
                f"{1e6 / one:.1f}",
                f"{1e6 / uow:.1f}",
                f"{1e6 / raw:.1f}",
                f"{1e6 / raw1:.1f}",
                f"{1e6 / one - 1e6 / raw:.1f}",
                f"{raw1 / uow:.2f}x",
            ]
        )
    elapsed = time.perf_counter() - t_start

    print("\nSQLite (ops/s, higher is better; ratio = raw ops/s / store ops/s, lower is better)")
    print_table(
        [
            "operation",
            "one-call ops/s",
            "in-uow ops/s",
            "raw sqlite3 ops/s",
            "one-call/raw",
            "in-uow ratio",
        ],
        rows,
    )
    print("\nPer call (µs). raw-1txn: the raw bodies with one BEGIN/COMMIT around all N calls,")
    print("the fair baseline for in-uow; overhead = one-call µs - raw µs.")
    print_table(
        [
            "operation",
            "one-call",
            "in-uow",
            "raw",
            "raw-1txn",
            "one-call overhead",
            "in-uow/raw-1txn",
        ],
        extra,
    )
    print(f"\n(timed section {elapsed:.1f} s)")
    return 0


def profile_onecall(op: Op, seeded: Path, workdir: Path, plan: Plan) -> None:
    f = workdir / f"profile-{op.name}.db"
    copy_db(seeded, f)
    store = Store.open(f"sqlite:///{f}")
    try:
        runs = store.runs
        for k in range(plan.warmup):
            op.call(runs, k)
        prof = cProfile.Profile()
        prof.enable()
        for k in range(plan.warmup, plan.warmup + plan.n):
            op.call(runs, k)
        prof.disable()
    finally:
        store.close()
        remove_db(f)
    name = f"store.runs.{op.name}"
    for key, what in (("cumulative", "cumulative time"), ("tottime", "own time (tottime)")):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).strip_dirs().sort_stats(key).print_stats(15)
        print(f"\ncProfile of {plan.n} one-call {name} calls, top 15 by {what}:")
        print(buf.getvalue().strip())


def _best_us(fn: Callable[[], Any], plan: Plan) -> float:
    """Best-of-rounds µs per call of a no-argument callable."""

    def loop(_start: int, n: int) -> None:
        for _ in range(n):
            fn()

    loop(0, plan.warmup)
    return min(timed(loop, 0, plan.n) for _ in range(plan.rounds)) / plan.n * 1e6


def run_layers(seeded: Path, workdir: Path, plan: Plan) -> None:
    """Time each layer of the one-call path on its own (µs per call, SQLite).

    Each line adds one layer to the line above it where that makes sense, so
    the differences say what a layer costs. Uses a few private names of the
    library (``Driver.execute``, ``repository._GET``, ``RunRepository``): a
    diagnostic, not an API.
    """
    from agentkeep import db as akdb
    from agentkeep.runs import codec
    from agentkeep.runs import repository as repo

    f = workdir / "layers.db"
    copy_db(seeded, f)
    rid = seed_id(7)
    conn = raw_connect(f)
    store = Store.open(f"sqlite:///{f}")
    engine = store.engine
    wengine = akdb.write_engine(engine)
    raw_get_sql = SQL["get"]
    lines: list[tuple[str, Callable[[], Any]]] = []

    def raw_empty(begin: str) -> Callable[[], None]:
        def fn() -> None:
            conn.execute(begin)
            conn.commit()

        return fn

    def raw_get() -> Any:
        conn.execute("BEGIN DEFERRED")
        row = conn.execute(raw_get_sql, {"id": rid}).fetchone()
        conn.commit()
        return raw_record(row)

    def sa_connect_close(eng: Any) -> Callable[[], None]:
        def fn() -> None:
            c = eng.connect()
            c.close()

        return fn

    def sa_begin_commit(eng: Any) -> Callable[[], None]:
        def fn() -> None:
            c = eng.connect()
            c.begin()
            c.commit()
            c.close()

        return fn

    def unit_only(unit: Callable[[], AbstractContextManager[Any]]) -> Callable[[], None]:
        def fn() -> None:
            with unit():
                pass

        return fn

    lines += [
        ("raw: BEGIN DEFERRED; COMMIT (empty)", raw_empty("BEGIN DEFERRED")),
        ("raw: BEGIN IMMEDIATE; COMMIT (empty)", raw_empty("BEGIN IMMEDIATE")),
        ("raw: get (BEGIN; SELECT; COMMIT; dict)", raw_get),
        ("SA: engine.connect(); close()  [pool checkout+checkin]", sa_connect_close(engine)),
        ("SA: + begin() [hook: BEGIN DEFERRED]; commit()", sa_begin_commit(engine)),
        ("SA: same, write engine [BEGIN IMMEDIATE]", sa_begin_commit(wengine)),
        ("store.read(): empty unit [contextmanager, UnitOfWork]", unit_only(store.read)),
        ("store.write(): empty unit", unit_only(store.write)),
        ("store.call_read(lambda uow: None) [+ retry wrapper]", lambda: store.call_read(_noop)),
        ("store.call_write(lambda uow: None)", lambda: store.call_write(_noop)),
        ("store.call_read(lambda uow: uow.runs) [+ repository]", lambda: store.call_read(_runs)),
    ]
    results = [(label, _best_us(fn, plan)) for label, fn in lines]

    with store.read() as uow:
        c = uow.connection
        r = uow.runs
        row = uow.driver.execute(repo._GET, {"id": rid}).fetchone()
        fields = {
            "id": r.get(rid).id,
            "task_id": row[1],
            "status": RunStatus.RUNNING,
            "step_entries": codec.decode_step_entries(row[3]),
            "degradations": (),
            "operator_sid": row[5],
            "current": codec.decode_current(row[6]),
            "next_generation": row[7],
            "result_ref": codec.decode_result_ref(row[8]),
            "input_json": row[9],
            "created_at": row[10],
            "updated_at": row[11],
        }
        in_uow = [
            (
                "in uow: uow.driver.execute(_GET).fetchone() [SQL only]",
                lambda: uow.driver.execute(repo._GET, {"id": rid}).fetchone(),
            ),
            (
                "in uow: driver_connection.execute(same SQL) [no helper]",
                lambda: c.connection.driver_connection.execute(raw_get_sql, {"id": rid}).fetchone(),
            ),
            ("decode: repository._row_to_record(row) [all columns]", lambda: r._row_to_record(row)),
            (
                "decode: codec.decode_step_entries (3 entries)",
                lambda: codec.decode_step_entries(row[3]),
            ),
            ("decode: codec.decode_current (1 holder)", lambda: codec.decode_current(row[6])),
            (
                "decode: RunRecord.model_construct(**fields)",
                lambda: RunRecord.model_construct(**fields),
            ),
            ("decode: json.loads of the 4 JSON columns (raw side)", lambda: raw_record(row)),
            ("in uow: uow.runs.get(id) [whole repository call]", lambda: r.get(rid)),
        ]
        results += [(label, _best_us(fn, plan)) for label, fn in in_uow]
    results.append(("one-call: store.runs.get(id)", _best_us(lambda: store.runs.get(rid), plan)))
    acq = OP_BY_NAME["acquire_assignee"]
    acq.prepare(2 * (plan.warmup + plan.rounds * plan.n))
    counter = iter(range(10**9))
    results.append(
        (
            "one-call: store.runs.acquire_assignee",
            _best_us(lambda: acq.call(store.runs, next(counter)), plan),
        )
    )
    with store.write() as uow:
        wr = uow.runs
        results.append(
            (
                "in uow: uow.runs.acquire_assignee",
                _best_us(lambda: acq.call(wr, next(counter)), plan),
            )
        )
    store.close()
    conn.close()
    remove_db(f)
    print("\nLayers of the one-call path, µs per call (best of rounds, SQLite):")
    print_table(["layer", "µs"], [[label, f"{us:.2f}"] for label, us in results])


def _noop(_uow: Any) -> None:
    return None


def _runs(uow: Any) -> Any:
    return uow.runs


def run_postgres(args: argparse.Namespace) -> int:
    plan = Plan(args.n, args.rounds, args.warmup)
    ops = [OP_BY_NAME[n] for n in args.ops] if args.ops else OPS
    url = args.url
    migrate_upgrade(url)
    store = Store.open(url)
    try:
        with store.read() as uow:
            count = uow.connection.execute(text("SELECT count(*) FROM runs")).scalar_one()
        if count:
            print(
                f"refusing: {url} has {count} rows in runs; use an empty database", file=sys.stderr
            )
            return 2
        for op in ops:
            op.prepare(plan.calls)
        seed = list(seed_rows(SEED_RUNS))
        print(
            f"Postgres {store.engine.dialect.server_version_info}, SQLAlchemy "
            f"{sqlalchemy.__version__}, psycopg; N={plan.n}, {plan.rounds} rounds, "
            f"{plan.warmup} warm-up; {SEED_RUNS} seeded runs"
        )
        rows = []
        try:
            for op in ops:
                res = {}
                # One database, so the two variants run one after the other, each on
                # freshly seeded rows (their writes would collide otherwise).
                for cls in (OneCall, InUow):
                    with store.write() as uow:
                        uow.connection.execute(text("DELETE FROM runs"))
                        uow.connection.execute(text(SEED_SQL), seed)
                    with store.engine.connect() as c:  # fresh statistics for the planner
                        c.execute(text("ANALYZE runs"))
                        c.commit()
                    res.update(run_interleaved([cls(op, store)], plan))
                rows.append(
                    [
                        op.name,
                        fmt_int(res["one-call"]),
                        fmt_int(res["in-uow"]),
                        f"{1e6 / res['one-call']:.0f}",
                        f"{1e6 / res['in-uow']:.0f}",
                    ]
                )
        finally:
            with store.write() as uow:
                uow.connection.execute(text("DELETE FROM runs"))
        print("\nPostgres (store calls only)")
        print_table(
            ["operation", "one-call ops/s", "in-uow ops/s", "one-call µs", "in-uow µs"], rows
        )
    finally:
        store.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--n", type=int, default=None, help="calls per timed round (default 1000; Postgres 300)"
    )
    p.add_argument(
        "--rounds", type=int, default=None, help="timed rounds, best kept (default 5; Postgres 3)"
    )
    p.add_argument("--warmup", type=int, default=None, help="warm-up calls (default N/5, >=20)")
    p.add_argument(
        "--url",
        default=None,
        help="sqlite:///base.db (scratch files are made beside it) or postgresql+psycopg://…; "
        "default: a temporary directory",
    )
    p.add_argument(
        "--ops",
        nargs="+",
        choices=sorted(OP_BY_NAME),
        metavar="OP",
        help=f"only these operations ({', '.join(sorted(OP_BY_NAME))})",
    )
    p.add_argument(
        "--profile",
        nargs="+",
        choices=sorted(OP_BY_NAME),
        metavar="OP",
        default=[],
        help="also cProfile N one-call calls of these operations (top 15 cumulative / own)",
    )
    p.add_argument(
        "--layers",
        action="store_true",
        help="also time each layer of the one-call path (pool, BEGIN hook, unit, retry, decode)",
    )
    p.add_argument("--profile-only", action="store_true", help="only the --profile/--layers output")
    p.add_argument("--no-check", dest="check", action="store_false", help="skip the same-SQL check")
    p.add_argument(
        "--cpu",
        action="store_true",
        help="time with the thread's CPU clock, not the wall clock (a busy, shared machine)",
    )
    args = p.parse_args(argv)
    if args.cpu:
        CLOCK[0] = time.thread_time
    postgres = bool(args.url) and make_url(args.url).get_backend_name() == "postgresql"
    if args.n is None:
        args.n = 300 if postgres else 1000
    if args.rounds is None:
        args.rounds = 3 if postgres else 5
    if args.n < 1 or args.rounds < 1:
        p.error("--n and --rounds must be >= 1")
    if args.warmup is None:
        args.warmup = max(20, args.n // 5)
    if args.ops:
        args.ops = list(dict.fromkeys(OP_BY_NAME[n].name for n in args.ops))

    if postgres:
        return run_postgres(args)
    if args.url:
        base = make_url(args.url).database
        if not base or base == ":memory:":
            p.error("a SQLite --url must name a file (scratch files are made beside it)")
        d = Path(base).resolve().parent
        d.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=d, prefix="agentkeep-bench-") as tmp:
            return run_sqlite(args, Path(tmp))
    with tempfile.TemporaryDirectory(prefix="agentkeep-bench-") as tmp:
        return run_sqlite(args, Path(tmp))


if __name__ == "__main__":
    sys.exit(main())
