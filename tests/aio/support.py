"""Shared helpers of the native-async tests: stores, raw reads, lock holders, gates, racers.

Every test of this package runs ``asyncio.run(...)`` inside a plain test
function, on each asyncio driver (the ``async_driver`` / ``async_url``
fixtures of tests/conftest.py: aiosqlite, asyncpg, psycopg_async).

* :func:`open_astore`: ``AsyncStore.open`` on the async URL with a clock.
* :class:`Observer` (and the one-off :func:`rows` / :func:`scalar`): raw
  SQL on the *synchronous* driver of the same database, on a connection of
  its own outside every store: what is really stored, whether a connection
  was left inside a transaction, and the multi-table invariant of the turns
  :func:`runtime_commit` writes (:meth:`Observer.turns`).
* :func:`hold_write_lock`: another OS process holding an aggregate's write
  lock (SQLite: ``BEGIN IMMEDIATE``; Postgres: the aggregate's advisory
  lock), released on demand; :func:`pg_lock_waiters` counts who waits for
  an advisory lock.
* :class:`Gate` with :func:`gate_commit`, :func:`gate_execute` and
  :func:`gate_unit_commit`: park an operation inside a driver call (COMMIT,
  a statement) on an asyncio event, so that a cancellation arrives exactly
  there.
* :func:`until`: wait for a condition, bounded by :data:`WAIT_S`.
* Session store builders (:func:`node`, :func:`runtime_commit`,
  :func:`session_state`) and the racer of the two-process race
  (:func:`transition_racer`, module level so spawned children import it).

Timeouts only bound waits for things that must happen (:data:`WAIT_S`) or
negative checks ("has not finished yet", :data:`STILL_S`); no result depends
on how fast anything runs.
"""

from __future__ import annotations

import asyncio
import json
import select
import sqlite3
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Final

import pytest
from sqlalchemy import Connection, event, make_url, text

from agentkeep import db
from agentkeep.aio import AsyncStore
from agentkeep.clock import SettableClock
from agentkeep.runs.domain import RunRecord, RunStatus
from agentkeep.sessions.domain import (
    LeaseFence,
    LeaseOwnerIdentity,
    QueuedWorkDraft,
    QueuedWorkPayload,
)
from agentkeep.sessions.records import (
    AppendNodes,
    HydratedSessionCheckpoint,
    RuntimeCommit,
    SessionNodeRecord,
    TokenUsage,
    TurnCommitStamp,
    UsageDelta,
)
from tests.conftest import as_sync_url
from tests.racing import READY_TIMEOUT_S, wait_ready
from tests.support import plain_engine

#: Upper bound for anything that must happen; never reached when green.
WAIT_S: Final = 60.0
#: How long a negative check ("still running") looks; a pass proves nothing
#: about speed, a failure is a real early return.
STILL_S: Final = 0.2
T0: Final = 1_700_000_000_000

SID: Final = "sess-aio-1"
TTL: Final = 10_000
A: Final = LeaseOwnerIdentity(owner_id="worker-A", incarnation_id="boot-A1")
B: Final = LeaseOwnerIdentity(owner_id="worker-B", incarnation_id="boot-B1")


async def open_astore(url: str, clock: SettableClock | None = None, **kw: Any) -> AsyncStore:
    """``AsyncStore.open(url)``, native on an asyncio driver, with ``clock`` (or one at T0)."""
    astore = await AsyncStore.open(url, clock=clock or SettableClock(T0), **kw)
    assert astore.native == (make_url(url).get_driver_name() in db.ASYNC_DRIVERS)
    return astore


def new_run(run_id: str) -> RunRecord:
    """A fresh Pending run of task ``T-1``."""
    return RunRecord.new(run_id, "T-1", created_at=T0 // 1000)


# --------------------------------------------------------------------------
# What is stored (an observer outside the stores)


class Observer:
    """A connection of its own on the database's synchronous driver, outside every store.

    AUTOCOMMIT: each SELECT sees what is committed at that moment. Kept open
    for a test that looks many times (:meth:`close` it, or use it in a
    ``with``).
    """

    def __init__(self, url: str) -> None:
        self.url = url
        self._engine = plain_engine(as_sync_url(url))
        self._conn = self._engine.connect().execution_options(isolation_level="AUTOCOMMIT")

    def rows(self, sql: str, **params: Any) -> list[tuple[Any, ...]]:
        """The rows of one SELECT, as stored (``bytes`` for BLOB/bytea)."""
        got = self._conn.execute(text(sql), params).all()
        return [tuple(bytes(v) if isinstance(v, memoryview) else v for v in r) for r in got]

    def execute(self, *statements: str, **params: Any) -> None:
        """Run statements that return no rows, in one transaction of their own.

        ``params`` are bound in every statement (raw setup of corrupt rows).
        """
        with self._engine.begin() as conn:
            for sql in statements:
                conn.execute(text(sql), params)

    def scalar(self, sql: str, **params: Any) -> Any:
        """The single value of a one-row, one-column SELECT."""
        ((value,),) = self.rows(sql, **params)
        return value

    async def no_transaction_left_open(self) -> bool:
        """True once no other connection to the database sits in an open transaction.

        Polls :meth:`no_open_transaction_now` on the loop for up to
        :data:`WAIT_S`: a connection the store closed may still be listed by
        the server for a moment (its backend notices the closed socket
        asynchronously); one left open in the pool stays.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WAIT_S
        while not self.no_open_transaction_now():
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(0.01)
        return True

    def no_open_transaction_now(self) -> bool:
        """True when no other connection to the database sits in an open transaction now.

        Postgres: no other backend of the database is ``idle in transaction``
        (say, a pooled connection returned with a transaction its driver
        forgot). SQLite: a new connection takes the write lock at once
        (``BEGIN IMMEDIATE`` without waiting), so no connection holds a write
        transaction. Call it while no operation runs.
        """
        if is_sqlite(self.url):
            path = make_url(self.url).database
            assert path is not None
            conn = sqlite3.connect(path, timeout=0, isolation_level=None)
            try:
                conn.execute("BEGIN IMMEDIATE")
                conn.rollback()
                return True
            except sqlite3.OperationalError:
                return False
            finally:
                conn.close()
        idle = self.scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND pid <> pg_backend_pid() AND state LIKE 'idle in transaction%'"
        )
        return int(idle) == 0

    def turns(self) -> list[str]:
        """The turns committed so far, after checking that each is there completely.

        Every committed turn (a ``runtime_turn_commits`` row, see
        :func:`runtime_commit`) has its two nodes, its usage delta, its batch
        and the batch's item, and the head revision counts them; a
        half-written turn, or a part of one without its stamp, fails the
        check. Call it while no writer runs.

        Returns:
            The committed turn ids, sorted.
        """

        def column(sql: str) -> list[Any]:
            return sorted(r[0] for r in self.rows(sql, s=SID))

        head = column("SELECT head_revision FROM session_head WHERE session_id = :s")
        turns = column("SELECT turn_id FROM runtime_turn_commits WHERE session_id = :s")
        nodes = column("SELECT node_id FROM graph_nodes WHERE session_id = :s")
        usage = column("SELECT seq FROM usage_deltas WHERE session_id = :s")
        batches = column("SELECT source_key FROM queued_work_batches WHERE session_id = :s")
        items = sorted(r[0] for r in self.rows("SELECT item_id FROM queued_work_items"))
        expected_nodes = sorted([f"{t}-a" for t in turns] + [f"{t}-b" for t in turns])
        assert nodes == expected_nodes, (turns, nodes)
        assert batches == sorted(f"src-{t}" for t in turns), (turns, batches)
        assert len(usage) == len(items) == len(turns), (turns, usage, items)
        assert head == ([len(turns)] if turns else []), (turns, head)
        return turns

    def close(self) -> None:
        self._conn.close()
        self._engine.dispose()

    def __enter__(self) -> Observer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def rows(url: str, sql: str, **params: Any) -> list[tuple[Any, ...]]:
    """The rows of one SELECT on a connection of its own (a one-off :class:`Observer`)."""
    with Observer(url) as seen:
        return seen.rows(sql, **params)


def scalar(url: str, sql: str, **params: Any) -> Any:
    """The single value of a one-row, one-column SELECT (see :func:`rows`)."""
    ((value,),) = rows(url, sql, **params)
    return value


def run_status(url: str, run_id: str) -> str | None:
    """The stored status of ``run_id`` (its JSON column decoded), or None when there is no row."""
    got = rows(url, "SELECT status FROM runs WHERE id = :id", id=run_id)
    return None if not got else str(json.loads(got[0][0]))


def pending(url: str, run_id: str) -> bool:
    """True when ``run_id`` is stored and still Pending."""
    return run_status(url, run_id) == RunStatus.PENDING.value


#: The session store's tables a runtime commit writes (plus the lease table).
SESSION_TABLES: Final = (
    "session_head",
    "graph_nodes",
    "usage_deltas",
    "session_usage_totals",
    "runtime_turn_commits",
    "blobs",
    "queued_work_batches",
    "queued_work_items",
    "pending_turn_inputs",
    "session_execution_leases",
)


def session_state(url: str) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of every session-store table, sorted: "nothing changed" compares two of these."""
    return {
        table: sorted(rows(url, f"SELECT * FROM {table}"), key=repr) for table in SESSION_TABLES
    }


# --------------------------------------------------------------------------
# Waiting


async def until(predicate: Callable[[], bool], what: str) -> None:
    """Poll ``predicate`` on the loop until it holds; fail after :data:`WAIT_S`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_S
    while not predicate():
        assert loop.time() < deadline, f"timed out waiting until {what}"
        await asyncio.sleep(0.005)


async def still_running(task: asyncio.Future[Any]) -> bool:
    """True when ``task`` has not finished after :data:`STILL_S` (a negative check)."""
    done, _ = await asyncio.wait({task}, timeout=STILL_S)
    return not done


async def finished(task: asyncio.Future[Any]) -> None:
    """Wait for ``task`` to finish (whatever its outcome), failing after :data:`WAIT_S`."""
    done, _ = await asyncio.wait({task}, timeout=WAIT_S)
    assert task in done, "the task did not finish"


# --------------------------------------------------------------------------
# Another process holding a write lock

_SQLITE_HOLDER = """
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("BEGIN IMMEDIATE")
print("locked", flush=True)
sys.stdin.readline()
conn.rollback()
print("released", flush=True)
"""

_PG_HOLDER = """
import sys
import psycopg
conn = psycopg.connect(sys.argv[1])
conn.execute("SELECT pg_advisory_xact_lock(%s, %s)", (int(sys.argv[2]), int(sys.argv[3])))
print("locked", flush=True)
sys.stdin.readline()
conn.rollback()
print("released", flush=True)
"""


def _read_line(proc: subprocess.Popen[str], timeout_s: float) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    assert ready, "the lock-holding process did not answer"
    return proc.stdout.readline().strip()


@dataclass
class LockHolder:
    """Another OS process that holds an aggregate's write lock until :meth:`release`."""

    proc: subprocess.Popen[str]
    released: bool = field(default=False)

    def release(self) -> None:
        """Let the holder roll back (freeing the lock); returns once it has."""
        if self.released:
            return
        assert self.proc.stdin is not None
        self.proc.stdin.write("release\n")
        self.proc.stdin.flush()
        assert _read_line(self.proc, WAIT_S) == "released"
        self.released = True


@contextmanager
def hold_write_lock(url: str, namespace: int, key: str) -> Iterator[LockHolder]:
    """A separate OS process holds the write lock of aggregate ``(namespace, key)``.

    SQLite has one write lock per database: the process holds ``BEGIN
    IMMEDIATE`` on the file. Postgres: it holds
    ``pg_advisory_xact_lock(namespace, crc32(key))``, the lock every write of
    that aggregate takes first (:func:`agentkeep.db.lock_aggregate`). The
    block starts once the lock is held; the process is released (if the
    test did not) and reaped at the end.
    """
    u = make_url(url)
    if u.get_backend_name() == "sqlite":
        assert u.database is not None
        args = [sys.executable, "-c", _SQLITE_HOLDER, u.database]
    else:
        plain = u.set(drivername="postgresql").render_as_string(hide_password=False)
        key_hash = str(db._key_hash(key))
        args = [sys.executable, "-c", _PG_HOLDER, plain, str(namespace), key_hash]
    proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert _read_line(proc, READY_TIMEOUT_S) == "locked"
        holder = LockHolder(proc)
        yield holder
        holder.release()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(WAIT_S)


def pg_lock_waiters(url: str) -> int:
    """How many sessions of ``url``'s database wait for an advisory lock right now."""
    return int(
        scalar(
            url,
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
            " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
        )
    )


def is_sqlite(url: str) -> bool:
    return make_url(url).get_backend_name() == "sqlite"


# --------------------------------------------------------------------------
# Gates: park an operation inside a driver call


def _await_only(awaitable: Any) -> Any:
    from sqlalchemy.util.concurrency import await_only

    return await_only(awaitable)


@dataclass
class Gate:
    """An operation parked inside a driver call until :attr:`opened` is set.

    ``armed`` gates only the next call (then disarms); ``entered`` is set
    when an operation reaches the gate; ``passed`` counts the calls that went
    through it.
    """

    armed: bool = False
    entered: asyncio.Event = field(default_factory=asyncio.Event)
    opened: asyncio.Event = field(default_factory=asyncio.Event)
    passed: int = 0

    def wait_here(self) -> None:
        """Inside the greenlet bridge: mark entry, then wait (on the loop) for ``opened``."""
        self.armed = False
        self.entered.set()
        _await_only(self.opened.wait())
        self.passed += 1


class _CommitWaits:
    """A DBAPI connection proxy whose ``commit()`` waits at a gate first (once)."""

    def __init__(self, raw: Any, gate: Gate) -> None:
        self._raw = raw
        self._gate = gate
        self._waited = False

    def wait(self) -> None:
        if not self._waited:
            self._waited = True
            self._gate.wait_here()

    def commit(self) -> None:
        self.wait()
        self._raw.commit()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


def gate_commit(monkeypatch: pytest.MonkeyPatch) -> Gate:
    """Park the next one-call COMMIT (``Driver.commit``) at a gate, once it was marked.

    The real :meth:`~agentkeep.db.Driver.commit` runs: it marks the
    operation's :class:`~agentkeep.db.CommitWatch` ("COMMIT sent"), then calls
    the connection's ``commit()``, which waits at the gate before it sends
    the COMMIT. A cancellation arriving while it waits is one that arrived
    during COMMIT. Create it inside the running loop.
    """
    gate = Gate()
    original = db.Driver.commit

    def commit(self: db.Driver) -> None:
        if not gate.armed:
            original(self)
            return
        raw = self.raw
        self.raw = _CommitWaits(raw, gate)
        try:
            original(self)
        finally:
            self.raw = raw

    original_simple = db.Driver._simple

    def simple(self: db.Driver, sql: str) -> Any:
        # asyncpg lean units send their COMMIT themselves, not through commit()
        if sql == "COMMIT" and isinstance(self.raw, _CommitWaits):
            self.raw.wait()
        return original_simple(self, sql)

    monkeypatch.setattr(db.Driver, "commit", commit)
    monkeypatch.setattr(db.Driver, "_simple", simple)
    return gate


def gate_execute(monkeypatch: pytest.MonkeyPatch) -> Gate:
    """Park the next repository statement (``Driver.execute``) at a gate, before it is sent.

    Stands for a driver call that waits (a lock, a slow statement): a
    cancellation arriving there interrupts the call. Create it inside the
    running loop.
    """
    gate = Gate()
    original = db.Driver.execute

    def execute(self: db.Driver, stmt: Any, params: Any) -> Any:
        if gate.armed:
            gate.wait_here()
        return original(self, stmt, params)

    monkeypatch.setattr(db.Driver, "execute", execute)
    return gate


@contextmanager
def gate_unit_commit(astore: AsyncStore) -> Iterator[Gate]:
    """Park the next unit-of-work COMMIT (the engine's ``commit`` event) at a gate.

    The listener runs just before SQLAlchemy sends the unit's COMMIT
    (``async with astore.write()`` ending normally).
    """
    gate = Gate()
    engine = astore.engine.sync_engine

    def on_commit(conn: Connection) -> None:
        if gate.armed:
            gate.wait_here()

    event.listen(engine, "commit", on_commit)
    try:
        yield gate
    finally:
        event.remove(engine, "commit", on_commit)


# --------------------------------------------------------------------------
# Session store builders


def node(nid: str, parent: str | None = None) -> SessionNodeRecord:
    return SessionNodeRecord(node_id=nid, parent_node_id=parent, timestamp=7, payload={"n": nid})


def runtime_commit(
    fence: LeaseFence | None,
    turn: str,
    expected: int | None,
    parent: str | None = None,
    **kw: Any,
) -> RuntimeCommit:
    """A turn's commit that writes into every session table it can touch.

    Two graph nodes ``<turn>-a`` → ``<turn>-b`` (under ``parent``), a
    checkpoint blob, one usage delta, the turn stamp ``turn`` and one
    enqueued batch: the multi-table invariant of :meth:`Observer.turns`.
    ``kw`` sets further fields (claim completions, ...).
    """
    first = node(f"{turn}-a", parent)
    return RuntimeCommit(
        session_id=SID,
        expected_head_revision=expected,
        session_execution_lease=fence,
        graph=AppendNodes(
            nodes=(first, node(f"{turn}-b", first.node_id)), leaf_node_id=f"{turn}-b"
        ),
        checkpoint=HydratedSessionCheckpoint(turn_state={"turn": turn}),
        usage_deltas=(UsageDelta(source="s", model="m", usage=TokenUsage(input_tokens=1)),),
        turn_commit=TurnCommitStamp(session_id=SID, turn_id=turn, turn_commit_hash="h"),
        enqueued_queue_batches=(
            QueuedWorkDraft(
                session_id=SID,
                source_key=f"src-{turn}",
                payloads=(QueuedWorkPayload(kind="user_input", body=turn),),
            ),
        ),
        **kw,
    )


# --------------------------------------------------------------------------
# The two-process race


def transition_racer(url: str, run_id: str, tasks: int, barrier: Any) -> list[bool]:
    """One process of the two-process race: its own loop, AsyncStore and ``tasks`` racers.

    Opens the store, waits until the other process is ready too, then runs
    ``tasks`` concurrent ``try_transition(run_id, PENDING, RUNNING)`` calls
    on its loop. Returns their results.
    """

    async def race() -> list[bool]:
        astore = await AsyncStore.open(url)
        try:
            assert astore.native
            await astore.runs.get(run_id)  # connected: the race measures no start-up
            wait_ready(barrier)  # nothing else runs on this loop yet
            return list(
                await asyncio.gather(
                    *(
                        astore.runs.try_transition(run_id, RunStatus.PENDING, RunStatus.RUNNING)
                        for _ in range(tasks)
                    )
                )
            )
        finally:
            await astore.close()

    try:
        return asyncio.run(race())
    except BaseException:
        barrier.abort()
        raise
