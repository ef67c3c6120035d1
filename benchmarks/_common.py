"""Shared pieces of the run store benchmarks: seed data, SQL, raw sqlite3 connections.

The SQL that the raw ``sqlite3`` side runs is never written by hand: it is the
repository's own module constants (``agentkeep.statements.Statement``) compiled the
way the store compiles them for sqlite3 (named ``:binds``, parameter dicts). The
bind names of each statement are checked at import, so a change in the
repository makes the benchmark fail loudly instead of silently measuring
something else.
"""

from __future__ import annotations

import gc
import json
import re
import shutil
import sqlite3
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Final

from sqlalchemy import event
from sqlalchemy.dialects import sqlite as sqlite_dialect

from agentkeep import Assignee, RunStatus, StepEntry
from agentkeep import db as akdb
from agentkeep.runs import codec
from agentkeep.runs import repository as repo
from agentkeep.statements import Compiled, CompileTarget, Statement
from agentkeep.store import Store

try:  # the module was renamed once; accept either name
    from agentkeep.migrations import upgrade as migrate_upgrade
except ImportError:  # pragma: no cover
    from agentkeep.migrate import upgrade as migrate_upgrade  # type: ignore[no-redef]


BUSY_TIMEOUT_MS: Final = akdb.DEFAULT_BUSY_TIMEOUT_MS
T0: Final = 1_700_000_000

# status -> its stored JSON text; the raw side uses a lookup as the codec does.
STATUS_TEXT: Final = {s: json.dumps(s.value) for s in RunStatus}
STATUS_BY_TEXT: Final = {t: s.value for s, t in STATUS_TEXT.items()}

_BIND = re.compile(r"(?<![:\w]):(\w+)")


#: What the store compiles its statements for on sqlite3 (named binds, dicts bound as is).
SQLITE_TARGET: Final = CompileTarget.of(sqlite_dialect.dialect(paramstyle="named"))


def sqlite_form(stmt: Statement) -> Compiled:
    """One of the store's statements as it runs on sqlite3.

    ``form.sql`` is the text; ``form.bind(params)`` the parameters the store
    binds for ``params`` (adding the values the construct fixed itself, such
    as a constant state), so the raw side runs exactly the store's statement.
    """
    return stmt.compiled(SQLITE_TARGET)


def sqlite_sql(stmt: Statement) -> str:
    """The text the store hands to sqlite3 for one of its statements.

    A statement with fixed values (``sqlite_form(stmt).fixed``) also needs
    them bound: use :func:`sqlite_form` and ``form.bind(params)`` for it.
    """
    return sqlite_form(stmt).sql


def _sql(stmt: Any, expected_binds: Sequence[str]) -> str:
    """The text the repository hands to sqlite3 for ``stmt``, with its binds checked."""
    if isinstance(stmt, Statement):
        sql = sqlite_sql(stmt)
    else:  # a SQLAlchemy construct
        sql = stmt.compile(dialect=sqlite_dialect.dialect(paramstyle="named")).string
    binds = sorted(set(_BIND.findall(sql)))
    if binds != sorted(expected_binds):
        raise SystemExit(
            f"benchmark out of date: {sql!r} binds {binds}, expected {sorted(expected_binds)}"
        )
    return sql


#: The repository's statements exactly as sqlite3 receives them (named binds).
SQL: Final = {
    "insert": _sql(
        repo._INSERT,
        [
            "id",
            "task_id",
            "status",
            "steps",
            "degradations",
            "operator_sid",
            "current",
            "gen",
            "result",
            "input",
            "created_at",
            "updated_at",
        ],
    ),
    "get": _sql(repo._GET, ["id"]),
    "transition": _sql(repo._TRANSITION, ["to", "now", "id", "from_"]),
    "get_slots": _sql(repo._GET_SLOTS, ["id"]),
    "set_slots": _sql(repo._SET_SLOTS, ["current", "new_gen", "now", "id", "old_gen"]),
    "get_steps": _sql(repo._GET_STEPS, ["id"]),
    "set_steps": _sql(repo._SET_STEPS, ["new", "now", "id", "old"]),
    "list_status": _sql(repo._list_statement(False, True), ["status", "limit", "offset"]),
    "list_by_task": _sql(repo._LIST_BY_TASK, ["task_id"]),
}

#: A plain bulk insert for seeding (named binds; sqlite3 and SQLAlchemy accept it).
SEED_SQL: Final = (
    "INSERT INTO runs (id, task_id, status, step_entries_json, degradations_json, "
    "operator_sid, current_json, next_generation, result_ref_json, input_json, "
    "created_at, updated_at) VALUES (:id, :task_id, :status, :steps, :degradations, "
    ":operator_sid, :current, :gen, :result, :input, :created_at, :updated_at)"
)

_SEED_STEPS: Final = codec.encode_step_entries(
    [StepEntry.basic(f"ST-seed-{j}", f"step-{j}", "passed", None, T0 + j) for j in range(3)]
)
_SEED_CURRENT: Final = codec.encode_current(
    {"main": Assignee(op="op-seed", desc="seeded holder", gen=1)}
)
_SEED_STATUS: Final = (RunStatus.RUNNING, RunStatus.PENDING, RunStatus.DONE)


def seed_id(i: int) -> str:
    return f"R-seed-{i:07d}"


def seed_task(i: int, per_task: int = 5) -> str:
    return f"T-seed-{i // per_task:07d}"


def seed_status(i: int) -> RunStatus:
    """Every third run is running, pending, done (in that rotation)."""
    return _SEED_STATUS[i % 3]


def seed_rows(count: int, *, per_task: int = 5) -> Iterable[dict[str, Any]]:
    """Typical runs: 3 step entries, one slot holder (G=1), an input snapshot, no result."""
    for i in range(count):
        yield {
            "id": seed_id(i),
            "task_id": seed_task(i, per_task),
            "status": STATUS_TEXT[seed_status(i)],
            "steps": _SEED_STEPS,
            "degradations": "[]",
            "operator_sid": "S-seed",
            "current": _SEED_CURRENT,
            "gen": 1,
            "result": None,
            "input": '{"prompt":"hello"}',
            "created_at": T0 + i,
            "updated_at": T0 + i,
        }


def raw_connect(path: str | Path, *, synchronous: str = "NORMAL") -> sqlite3.Connection:
    """A stdlib connection configured like agentkeep's engine (driver BEGIN off, same PRAGMAs)."""
    conn = sqlite3.connect(
        str(path), isolation_level=None, check_same_thread=False, timeout=BUSY_TIMEOUT_MS / 1000
    )
    conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
    conn.execute("PRAGMA foreign_keys=ON")
    conn.execute(f"PRAGMA synchronous={synchronous}")
    mode = conn.execute("PRAGMA journal_mode").fetchone()[0]
    if str(mode).lower() != "wal":
        raise SystemExit(f"{path}: journal_mode is {mode}, expected wal (migrate.upgrade sets it)")
    return conn


def seed_sqlite(path: str | Path, rows: Iterable[dict[str, Any]]) -> None:
    """Bulk-insert rows with executemany in one transaction (raw sqlite3)."""
    conn = raw_connect(path)
    try:
        conn.execute("BEGIN IMMEDIATE")
        conn.executemany(SEED_SQL, rows)
        conn.commit()
    finally:
        conn.close()


def make_template(path: Path) -> None:
    """A migrated, empty database file (the same schema, indexes and seq trigger as the store)."""
    migrate_upgrade(f"sqlite:///{path}")


def copy_db(src: Path, dst: Path) -> None:
    """Copy a closed database (WAL already checkpointed) to a fresh file."""
    remove_db(dst)
    shutil.copyfile(src, dst)


def remove_db(path: Path) -> None:
    for suffix in ("", "-wal", "-shm", "-journal"):
        Path(str(path) + suffix).unlink(missing_ok=True)


_loads = json.loads


def raw_record(row: Sequence[Any]) -> dict[str, Any]:
    """The raw side's equivalent of ``_row_to_record``: decode the JSON columns into a dict."""
    current = row[6]
    result = row[8]
    return {
        "id": row[0],
        "task_id": row[1],
        "status": STATUS_BY_TEXT[row[2]],
        "step_entries": _loads(row[3]),
        "degradations": _loads(row[4]),
        "operator_sid": row[5],
        "current": {} if current is None else _loads(current),
        "next_generation": row[7],
        "result_ref": None if result is None else _loads(result),
        "input_json": row[9],
        "created_at": row[10],
        "updated_at": row[11],
    }


def table_rows(conn: sqlite3.Connection, *, skip_updated_at: bool = True) -> list[tuple[Any, ...]]:
    cols = "id, task_id, status, step_entries_json, degradations_json, operator_sid, " + (
        "current_json, next_generation, result_ref_json, input_json, created_at, seq"
    )
    if not skip_updated_at:
        cols += ", updated_at"
    return conn.execute(f"SELECT {cols} FROM runs ORDER BY id").fetchall()


def fmt_int(x: float) -> str:
    return f"{x:,.0f}"


def print_table(
    headers: Sequence[str], rows: Sequence[Sequence[str]], out: Callable[[str], None] = print
) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    out(
        " | ".join(
            h.ljust(w) if i == 0 else h.rjust(w)
            for i, (h, w) in enumerate(zip(headers, widths, strict=True))
        )
    )
    out("-+-".join("-" * w for w in widths))
    for r in rows:
        out(
            " | ".join(
                c.ljust(w) if i == 0 else c.rjust(w)
                for i, (c, w) in enumerate(zip(r, widths, strict=True))
            )
        )


#: The clock of :func:`timed`: wall time, or this thread's CPU time (``--cpu``:
#: time the thread spends descheduled on a busy machine is left out).
CLOCK: list[Callable[[], float]] = [time.perf_counter]


def timed(loop: Callable[[int, int], None], start: int, n: int) -> float:
    """Seconds taken by ``loop(start, n)``, with the garbage collector paused."""
    clock = CLOCK[0]
    gc.collect()
    gc.disable()
    try:
        t0 = clock()
        loop(start, n)
        return clock() - t0
    finally:
        gc.enable()


def best_us(fn: Callable[[], object], n: int, rounds: int) -> float:
    """Best µs per call over ``rounds`` rounds of ``n`` calls, after a warm-up."""
    for _ in range(max(20, n // 10)):
        fn()

    def loop(_start: int, count: int) -> None:
        for _ in range(count):
            fn()

    return min(timed(loop, 0, n) for _ in range(rounds)) / n * 1e6


@contextmanager
def traced_store(path: Path) -> Iterator[tuple[Store, list[str], list[bool]]]:
    """A store on a SQLite file whose pooled connection reports every statement SQLite runs.

    Yields the store, the trace (statements run while ``on[0]`` is true) and
    the switch. The first connection is opened before yielding, so its
    PRAGMAs are not part of any traced call.
    """
    store = Store.open(f"sqlite:///{path}")
    trace: list[str] = []
    on = [False]
    store.engine.dispose()

    @event.listens_for(store.engine, "connect")
    def _connect(dbapi_conn: Any, _rec: Any) -> None:
        dbapi_conn.set_trace_callback(lambda s: trace.append(s) if on[0] else None)

    with store.engine.connect():
        pass
    try:
        yield store, trace, on
    finally:
        store.close()
