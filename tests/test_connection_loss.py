"""Connection loss and lost COMMIT answers: every outcome is typed, nothing is doubled.

Postgres, with real ``pg_terminate_backend`` from a separate admin connection:

* (a) a one-call write whose backend is terminated while it waits for an
  aggregate's advisory lock retries on a new connection and succeeds, once;
  no raw driver error, nothing logged by the pool (``Exception during reset``);
* (b) at COMMIT (``agentkeep.db.Driver.commit`` wrapped): the backend is
  terminated just before COMMIT is sent (not applied, the client cannot
  know), or the COMMIT is applied and its answer "lost"
  (``CommitOutcomeUnknown`` raised after the real commit). A non-idempotent
  operation raises ``CommitOutcomeUnknown`` naming itself and its arguments;
  the idempotent ones (run creation, enqueues by source key, turn commits
  by stamp, boundary receipts) settle it and return, applied exactly once;
* (c) ``store.write()`` units: a connection lost before COMMIT raises
  ``ConnectionLost`` (a ``StoreBusy``), nothing written; lost at COMMIT,
  ``CommitOutcomeUnknown("unit of work")``;
* (d) random moments: mixed one-call operations while a thread terminates
  the store's backends after a random delay; every outcome is a success or
  a typed error (``CommitOutcomeUnknown`` only from a non-idempotent
  operation), and what is stored agrees with what was acknowledged.

(a) and (b) also on the asyncio drivers (asyncpg, psycopg_async).

SQLite: an injected failure at COMMIT. Refused before committing (an
authorizer denies the COMMIT statement: a real driver error, the
transaction still open) is a definite typed error, nothing written, the
transaction rolled back; failing after the commit (the transaction gone) is
``CommitOutcomeUnknown``, settled by the idempotent operations.

Timeouts only bound waits for things that must happen.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import psycopg
import pytest
from sqlalchemy import make_url

from agentkeep import db
from agentkeep.aio import AsyncStore
from agentkeep.clock import SettableClock
from agentkeep.db import LockNamespace, _key_hash
from agentkeep.errors import (
    AgentkeepError,
    CommitOutcomeUnknown,
    ConnectionLost,
    DatabaseError,
    StoreBusy,
)
from agentkeep.runs.domain import RunRecord, RunStatus, StepEntry
from agentkeep.runtime.errors import WriteFailed
from agentkeep.sessions.domain import (
    Acquired,
    LeaseOwnerIdentity,
    NextTurnIngress,
    PendingTurnInputDraft,
    QueuedWorkDraft,
    QueuedWorkPayload,
    SessionExecutionLease,
)
from agentkeep.sessions.records import (
    HydratedSessionCheckpoint,
    RuntimeCommit,
    TurnCommitStamp,
    UnchangedGraph,
)
from agentkeep.store import Store
from tests.conftest import BACKENDS, _empty_tables, as_sync_url, require_postgres
from tests.runtime.builders import input_record, receipt
from tests.support import raw_rows

WAIT_S = 30.0  # upper bound for things that must happen; never reached when green
T0 = 1_700_000_000
SID = "sess-loss"
RT = "rt-loss"
OWNER = LeaseOwnerIdentity(owner_id="owner-loss", incarnation_id="inc-1")
TTL = 3_600_000


# --------------------------------------------------------------------------
# Postgres: the database, the admin connection, a lock holder


@pytest.fixture
def pg_url(request: pytest.FixtureRequest) -> str:
    """The suite's migrated Postgres database, emptied (Postgres only)."""
    if "postgres" not in BACKENDS:
        pytest.skip("AGENTKEEP_TEST_BACKENDS excludes postgres")
    require_postgres()
    url: str = request.getfixturevalue("_pg_session_url")
    _empty_tables(url)
    return url


def _plain(url: str) -> str:
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


class Admin:
    """A separate autocommit connection that watches and terminates backends."""

    def __init__(self, url: str) -> None:
        self.conn = psycopg.connect(_plain(url), autocommit=True)
        self.terminated = 0
        self._lock = threading.Lock()

    def _rows(self, sql: str, *params: Any) -> list[tuple[Any, ...]]:
        with self._lock:
            return self.conn.execute(sql, params).fetchall()

    def lock_waiter(self) -> int:
        """The pid of the (one) backend waiting for an advisory lock in this database."""
        deadline = time.monotonic() + WAIT_S
        while True:
            rows = self._rows(
                "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND NOT granted AND "
                "database = (SELECT oid FROM pg_database WHERE datname = current_database())"
            )
            if rows:
                assert len(rows) == 1, rows
                return int(rows[0][0])
            assert time.monotonic() < deadline, "no backend started waiting for the lock"
            time.sleep(0.005)

    def terminate(self, pid: int) -> None:
        """Terminate backend ``pid`` and wait until it is gone."""
        assert self._rows("SELECT pg_terminate_backend(%s)", pid) == [(True,)]
        self.terminated += 1
        deadline = time.monotonic() + WAIT_S
        while self._rows("SELECT 1 FROM pg_stat_activity WHERE pid = %s", pid):
            assert time.monotonic() < deadline, f"backend {pid} outlived its termination"
            time.sleep(0.002)

    def terminate_application(self, name: str) -> int:
        """Terminate every backend of ``application_name`` (not waiting); how many."""
        rows = self._rows(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE application_name = %s AND pid <> pg_backend_pid()",
            name,
        )
        self.terminated += len(rows)
        return len(rows)

    def close(self) -> None:
        self.conn.close()


@pytest.fixture
def admin(pg_url: str) -> Iterator[Admin]:
    a = Admin(pg_url)
    yield a
    a.close()


@contextmanager
def holding(url: str, namespace: int, key: str) -> Iterator[Callable[[], None]]:
    """Hold aggregate ``key``'s advisory write lock on another connection; yield its release."""
    conn = psycopg.connect(_plain(url))
    try:
        conn.execute("SELECT pg_advisory_xact_lock(%s, %s)", (namespace, _key_hash(key)))
        yield conn.commit
    finally:
        conn.close()


@pytest.fixture
def pool_errors(caplog: pytest.LogCaptureFixture) -> Callable[[], list[str]]:
    """What the pool logged at WARNING or above (its "Exception during reset" tracebacks)."""
    caplog.set_level(logging.DEBUG, logger="sqlalchemy.pool")

    def errors() -> list[str]:
        return [
            r.getMessage()
            for r in caplog.records
            if r.name.startswith("sqlalchemy.pool") and r.levelno >= logging.WARNING
        ]

    return errors


def _backend_pid(raw: Any) -> int:
    cur = raw.cursor()
    try:
        cur.execute("SELECT pg_backend_pid()")
        return int(cur.fetchone()[0])
    finally:
        cur.close()


# --------------------------------------------------------------------------
# Faults at COMMIT


def _deny_commit(action: int, arg1: str | None, *_: Any) -> int:
    if action == sqlite3.SQLITE_TRANSACTION and arg1 == "COMMIT":
        return sqlite3.SQLITE_DENY
    return sqlite3.SQLITE_OK


def _deny_one_commit(raw: sqlite3.Connection) -> None:
    """Make the next COMMIT on ``raw`` fail (``not authorized``), then authorize again."""

    def authorize(action: int, arg1: str | None, *rest: Any) -> int:
        verdict = _deny_commit(action, arg1, *rest)
        if verdict == sqlite3.SQLITE_DENY:
            raw.set_authorizer(None)
        return verdict

    raw.set_authorizer(authorize)


class CommitFault:
    """Wraps :meth:`agentkeep.db.Driver.commit`; :meth:`arm` makes the next COMMIT fail.

    Kinds:

    * ``terminate`` (Postgres): the backend is terminated (and gone) just
      before COMMIT is sent: not applied, and the client cannot tell;
    * ``lost``: the COMMIT is applied, then its answer is lost
      (``CommitOutcomeUnknown`` raised after the real commit);
    * ``refused`` (SQLite): an authorizer denies the COMMIT statement: a real
      driver error with the transaction still open (definite: not applied);
    * ``gone`` (SQLite): the real commit, then the driver's failure is
      classified with the transaction gone (unknown: applied here).
    """

    #: kind -> (applied in reality, the client is told the outcome is unknown)
    EFFECT: dict[str, tuple[bool, bool]] = {
        "terminate": (False, True),
        "lost": (True, True),
        "refused": (False, False),
        "gone": (True, True),
    }

    def __init__(self, monkeypatch: pytest.MonkeyPatch, admin: Admin | None = None) -> None:
        self.armed: str | None = None
        self.fired = 0
        original = db.Driver.commit
        fault = self

        def commit(driver: db.Driver) -> None:
            kind, fault.armed = fault.armed, None
            if kind is None:
                original(driver)
                return
            fault.fired += 1
            if kind == "terminate":
                assert admin is not None
                admin.terminate(_backend_pid(driver.raw))
                original(driver)
            elif kind == "lost":
                original(driver)
                raise CommitOutcomeUnknown("transaction", detail="injected: the answer was lost")
            elif kind == "refused":
                driver.raw.set_authorizer(_deny_commit)
                try:
                    original(driver)
                finally:
                    driver.raw.set_authorizer(None)
            elif kind == "gone":
                original(driver)
                failure = sqlite3.OperationalError("disk I/O error (injected after the COMMIT)")
                raise driver.commit_failure(failure) from failure
            raise AssertionError(f"the injected {kind} COMMIT did not fail")

        monkeypatch.setattr(db.Driver, "commit", commit)

    def arm(self, kind: str) -> None:
        self.armed = kind


# --------------------------------------------------------------------------
# Operations, their setup and their effect as stored


def _lease(store: Store) -> SessionExecutionLease:
    got = store.leases.try_claim_session_execution_lease(SID, OWNER, TTL)
    assert isinstance(got, Acquired), got
    return got.lease


def _count(url: str, sql: str, **params: Any) -> int:
    return int(raw_rows(as_sync_url(url), sql, params)[0][0])


@dataclass
class Op:
    """A one-call operation under test.

    ``call(store_or_astore, ctx)`` runs it (a coroutine on an AsyncStore);
    ``state(url)`` is its effect as stored; ``before``/``after`` the state
    without and with the operation applied once.
    """

    name: str
    idempotent: bool
    call: Callable[[Any, dict[str, Any]], Any]
    state: Callable[[str], Any]
    before: Any
    after: Any
    setup: Callable[[Store], dict[str, Any]] = lambda _s: {}
    lock: tuple[int, str] = (LockNamespace.RUN, "R-1")
    arguments: tuple[str, ...] = ()


def _setup_run(store: Store) -> dict[str, Any]:
    store.runs.create(RunRecord.new("R-1", "T-1", created_at=T0))
    return {}


def _setup_lease(store: Store) -> dict[str, Any]:
    return {"lease": _lease(store)}


def _turn_commit(ctx: dict[str, Any]) -> RuntimeCommit:
    return RuntimeCommit(
        session_id=SID,
        expected_head_revision=None,
        session_execution_lease=ctx["lease"],
        graph=UnchangedGraph(leaf_node_id=None),
        checkpoint=HydratedSessionCheckpoint(turn_state={"turn": 1}),
        turn_commit=TurnCommitStamp(session_id=SID, turn_id="turn-1", turn_commit_hash="h1"),
    )


RECEIPT = receipt(1, str(uuid.uuid5(uuid.NAMESPACE_URL, "run-loss-1")))
RECORD = input_record()

OPS: list[Op] = [
    Op(
        "runs.try_transition",
        False,
        lambda s, _c: s.runs.try_transition("R-1", RunStatus.PENDING, RunStatus.RUNNING),
        lambda url: raw_rows(as_sync_url(url), "SELECT status FROM runs WHERE id = 'R-1'"),
        [('"pending"',)],
        [('"running"',)],
        setup=_setup_run,
        arguments=("run_id", "from_", "to"),
    ),
    Op(
        "runs.append_step_entry",
        False,
        lambda s, _c: s.runs.append_step_entry("R-1", StepEntry(step_id="ST-1", at=T0)),
        lambda url: raw_rows(as_sync_url(url), "SELECT step_entries_json FROM runs"),
        [("[]",)],
        [('[{"step_id":"ST-1","step_ref":null,"status":null,"at":1700000000}]',)],
        setup=_setup_run,
        arguments=("run_id", "entry"),
    ),
    Op(
        "queue.enqueue_queued_work",
        False,
        lambda s, _c: s.queue.enqueue_queued_work(
            QueuedWorkDraft(
                session_id=SID, payloads=(QueuedWorkPayload(kind="user_input", body=1),)
            )
        ),
        lambda url: _count(url, "SELECT count(*) FROM queued_work_batches"),
        0,
        1,
        lock=(LockNamespace.SESSION, SID),
        arguments=("draft",),
    ),
    Op(
        "runs.create",
        True,
        lambda s, _c: s.runs.create(RunRecord.new("R-1", "T-1", created_at=T0)),
        lambda url: _count(url, "SELECT count(*) FROM runs WHERE id = 'R-1'"),
        0,
        1,
    ),
    Op(
        "queue.enqueue_queued_work(source_key)",
        True,
        lambda s, _c: s.queue.enqueue_queued_work(
            QueuedWorkDraft(
                session_id=SID,
                source_key="src-1",
                payloads=(QueuedWorkPayload(kind="user_input", body=1),),
            )
        ),
        lambda url: _count(url, "SELECT count(*) FROM queued_work_batches"),
        0,
        1,
        lock=(LockNamespace.SESSION, SID),
    ),
    Op(
        "turn_inputs.enqueue_pending_turn_input(source_key)",
        True,
        lambda s, _c: s.turn_inputs.enqueue_pending_turn_input(
            PendingTurnInputDraft(
                session_id=SID, source_key="src-1", ingress=NextTurnIngress(), input={"t": 1}
            )
        ),
        lambda url: _count(url, "SELECT count(*) FROM pending_turn_inputs"),
        0,
        1,
        lock=(LockNamespace.SESSION, SID),
    ),
    Op(
        "commits.commit_runtime_state(turn stamp)",
        True,
        lambda s, c: s.commits.commit_runtime_state(_turn_commit(c)),
        lambda url: raw_rows(
            as_sync_url(url),
            "SELECT (SELECT count(*) FROM runtime_turn_commits), "
            "(SELECT max(head_revision) FROM session_head)",
        ),
        [(0, None)],
        [(1, 1)],
        setup=_setup_lease,
        lock=(LockNamespace.SESSION, SID),
    ),
    Op(
        "runtime.atomic_apply",
        True,
        lambda s, _c: s.runtime.atomic_apply(RT, None, RECEIPT, [RECORD]),
        lambda url: raw_rows(
            as_sync_url(url),
            "SELECT (SELECT count(*) FROM runtime_boundary_receipts), "
            "(SELECT count(*) FROM runtime_input_states)",
        ),
        [(0, 0)],
        [(1, 1)],
        lock=(LockNamespace.RUNTIME, RT),
    ),
]
OP_IDS = [op.name for op in OPS]


def _expect(op: Op, kind: str, outcome: Any, url: str) -> None:
    """``outcome`` (the return value or the exception) and the stored state agree with ``kind``."""
    applied, unknown = CommitFault.EFFECT[kind]
    if not unknown:  # a definite failure: typed, nothing written
        assert isinstance(outcome, DatabaseError | WriteFailed), outcome
        assert not isinstance(outcome, CommitOutcomeUnknown), outcome
        assert op.state(url) == op.before
        return
    if op.idempotent:  # settled by reading back: returned, applied exactly once
        assert not isinstance(outcome, BaseException), outcome
        assert op.state(url) == op.after
        return
    assert isinstance(outcome, CommitOutcomeUnknown), outcome
    assert outcome.operation == op.name
    assert set(op.arguments) <= set(outcome.arguments), outcome.arguments
    assert isinstance(outcome.__cause__, CommitOutcomeUnknown)
    assert outcome.detail, "the driver's message is carried"
    assert outcome.detail in str(outcome)
    assert op.state(url) == (op.after if applied else op.before)


def _run(call: Callable[[], Any]) -> Any:
    """The operation's return value, or the exception it raised."""
    try:
        return call()
    except Exception as exc:  # noqa: BLE001 - the outcome under test
        assert isinstance(exc, AgentkeepError), f"untyped {type(exc).__name__}: {exc}"
        return exc


# --------------------------------------------------------------------------
# (a) a backend terminated while the operation waits for a lock


@pytest.mark.parametrize("op", OPS, ids=OP_IDS)
def test_pg_terminated_while_waiting_for_the_lock_retries_once(
    pg_url: str, admin: Admin, op: Op, pool_errors: Callable[[], list[str]]
) -> None:
    with Store.open(pg_url, clock=SettableClock(T0)) as store:
        ctx = op.setup(store)
        before = op.state(pg_url)
        assert before == op.before
        outcome: list[Any] = []
        with holding(pg_url, *op.lock) as release:
            worker = threading.Thread(
                target=lambda: outcome.append(_run(lambda: op.call(store, ctx)))
            )
            worker.start()
            admin.terminate(admin.lock_waiter())
            # The retry waits for the lock again: it is still held, nothing written yet.
            admin.lock_waiter()
            assert op.state(pg_url) == op.before
            release()
            worker.join(WAIT_S)
        assert not worker.is_alive()
        assert not isinstance(outcome[0], BaseException), outcome[0]
        assert op.state(pg_url) == op.after
        assert admin.terminated == 1
    assert pool_errors() == []


def test_pg_terminated_again_and_again_gives_up_with_store_busy(
    pg_url: str, admin: Admin, pool_errors: Callable[[], list[str]]
) -> None:
    """Every attempt's backend terminated: ``ConnectionLost`` after ``retry_attempts``."""
    with Store.open(pg_url, retry_attempts=3) as store:
        store.runs.create(RunRecord.new("R-1", "T-1", created_at=T0))
        outcome: list[Any] = []
        with holding(pg_url, LockNamespace.RUN, "R-1"):
            worker = threading.Thread(
                target=lambda: outcome.append(
                    _run(
                        lambda: store.runs.try_transition("R-1", RunStatus.PENDING, RunStatus.DONE)
                    )
                )
            )
            worker.start()
            for _ in range(3):
                admin.terminate(admin.lock_waiter())
            worker.join(WAIT_S)
        assert isinstance(outcome[0], ConnectionLost), outcome[0]
        assert isinstance(outcome[0], StoreBusy)
        assert store.runs.get("R-1").status == RunStatus.PENDING
    assert pool_errors() == []


# --------------------------------------------------------------------------
# (b) at COMMIT


@pytest.mark.parametrize("kind", ["terminate", "lost"])
@pytest.mark.parametrize("op", OPS, ids=OP_IDS)
def test_pg_connection_lost_at_commit(
    pg_url: str,
    admin: Admin,
    op: Op,
    kind: str,
    monkeypatch: pytest.MonkeyPatch,
    pool_errors: Callable[[], list[str]],
) -> None:
    with Store.open(pg_url, clock=SettableClock(T0)) as store:
        ctx = op.setup(store)
        assert op.state(pg_url) == op.before
        fault = CommitFault(monkeypatch, admin)
        fault.arm(kind)
        outcome = _run(lambda: op.call(store, ctx))
        assert fault.fired == 1
        _expect(op, kind, outcome, pg_url)
        # The store goes on: the next operation runs on a fresh connection.
        assert store.runs.list_by_task("T-none") == []
    assert pool_errors() == []


# --------------------------------------------------------------------------
# (a) and (b) on the asyncio drivers


@pytest.fixture
def pg_async_url(async_driver: str, request: pytest.FixtureRequest) -> str:
    if async_driver == "aiosqlite":
        pytest.skip("Postgres only: backends to terminate")
    url: str = request.getfixturevalue("async_url")
    return url


ASYNC_OPS = [op for op in OPS if op.name in ("runs.try_transition", "runs.create")] + [
    op for op in OPS if op.name in ("queue.enqueue_queued_work(source_key)", "runtime.atomic_apply")
]


@pytest.mark.parametrize("op", ASYNC_OPS, ids=[op.name for op in ASYNC_OPS])
def test_async_terminated_while_waiting_for_the_lock_retries_once(
    pg_async_url: str, op: Op, pool_errors: Callable[[], list[str]]
) -> None:
    sync_url = as_sync_url(pg_async_url)
    admin = Admin(sync_url)

    async def scenario() -> Any:
        astore = await AsyncStore.open(pg_async_url, clock=SettableClock(T0))
        try:
            with Store.open(sync_url, clock=SettableClock(T0)) as setup_store:
                ctx = op.setup(setup_store)
            with holding(sync_url, *op.lock) as release:
                task = asyncio.ensure_future(op.call(astore, ctx))
                pid = await asyncio.to_thread(admin.lock_waiter)
                await asyncio.to_thread(admin.terminate, pid)
                await asyncio.to_thread(admin.lock_waiter)  # the retry waits again
                release()
                return await asyncio.wait_for(task, WAIT_S)
        finally:
            await astore.close()

    try:
        asyncio.run(scenario())
        assert op.state(sync_url) == op.after
        assert admin.terminated == 1
    finally:
        admin.close()
    assert pool_errors() == []


@pytest.mark.parametrize("kind", ["terminate", "lost"])
@pytest.mark.parametrize("op", ASYNC_OPS, ids=[op.name for op in ASYNC_OPS])
def test_async_connection_lost_at_commit(
    pg_async_url: str,
    op: Op,
    kind: str,
    monkeypatch: pytest.MonkeyPatch,
    pool_errors: Callable[[], list[str]],
) -> None:
    sync_url = as_sync_url(pg_async_url)
    admin = Admin(sync_url)
    fault = CommitFault(monkeypatch, admin)

    async def scenario() -> Any:
        with Store.open(sync_url, clock=SettableClock(T0)) as setup_store:
            ctx = op.setup(setup_store)
        astore = await AsyncStore.open(pg_async_url, clock=SettableClock(T0))
        try:
            fault.arm(kind)
            try:
                outcome = await op.call(astore, ctx)
            except Exception as exc:  # noqa: BLE001 - the outcome under test
                assert isinstance(exc, AgentkeepError), f"untyped {type(exc).__name__}: {exc}"
                outcome = exc
            assert await astore.runs.list_by_task("T-none") == []  # the store goes on
            return outcome
        finally:
            await astore.close()

    try:
        outcome = asyncio.run(scenario())
    finally:
        admin.close()
    assert fault.fired == 1
    _expect(op, kind, outcome, sync_url)
    assert pool_errors() == []


# --------------------------------------------------------------------------
# (c) units of work


def _own_pid(uow: Any) -> int:
    return int(uow.connection.exec_driver_sql("SELECT pg_backend_pid()").scalar_one())


def test_pg_unit_loses_its_connection_before_commit(
    pg_url: str, admin: Admin, pool_errors: Callable[[], list[str]]
) -> None:
    with Store.open(pg_url) as store:
        with pytest.raises(ConnectionLost) as caught:
            with store.write() as uow:
                uow.runs.create(RunRecord.new("R-1", "T-1", created_at=T0))
                admin.terminate(_own_pid(uow))
                uow.runs.create(RunRecord.new("R-2", "T-1", created_at=T0))
        assert isinstance(caught.value, StoreBusy)  # retryable: nothing was written
        assert caught.value.__cause__ is not None
        assert raw_rows(pg_url, "SELECT count(*) FROM runs") == [(0,)]
        # Running the unit again works (on a new connection).
        with store.write() as uow:
            uow.runs.create(RunRecord.new("R-1", "T-1", created_at=T0))
        assert raw_rows(pg_url, "SELECT id FROM runs") == [("R-1",)]
    assert pool_errors() == []


def test_pg_unit_loses_its_connection_at_commit(
    pg_url: str, admin: Admin, pool_errors: Callable[[], list[str]]
) -> None:
    with Store.open(pg_url) as store:
        with pytest.raises(CommitOutcomeUnknown) as caught:
            with store.write() as uow:
                uow.runs.create(RunRecord.new("R-1", "T-1", created_at=T0))
                admin.terminate(_own_pid(uow))  # gone before the block's COMMIT is sent
        assert caught.value.operation == "unit of work"
        assert caught.value.arguments == {}
        assert "read back" in str(caught.value)
        # Here the COMMIT never reached the server: read back, nothing was written.
        assert raw_rows(pg_url, "SELECT count(*) FROM runs") == [(0,)]
        assert store.runs.list_by_task("T-none") == []
    assert pool_errors() == []


def test_pg_unit_failing_rollback_never_replaces_the_error(
    pg_url: str, admin: Admin, pool_errors: Callable[[], list[str]]
) -> None:
    """The block raises on a connection that is gone: its error, the rollback's failure noted."""

    class Boom(Exception):
        pass

    with Store.open(pg_url) as store:
        with pytest.raises(Boom) as caught:
            with store.write() as uow:
                uow.runs.create(RunRecord.new("R-1", "T-1", created_at=T0))
                admin.terminate(_own_pid(uow))
                raise Boom("the application's own error")
        assert any("rolling back failed too" in note for note in caught.value.__notes__)
        assert raw_rows(pg_url, "SELECT count(*) FROM runs") == [(0,)]
        store.runs.create(RunRecord.new("R-2", "T-1", created_at=T0))  # a fresh connection
    assert pool_errors() == []


def test_pg_joined_unit_failing_savepoint_rollback_never_replaces_the_error(
    pg_url: str, admin: Admin
) -> None:
    """A joined unit's SAVEPOINT rollback on a dead host connection: the block's error stays."""
    from sqlalchemy.orm import Session

    class Boom(Exception):
        pass

    with Store.open(pg_url) as store, Session(store.engine) as host:
        with pytest.raises(Boom) as caught:
            with store.write(join=host) as uow:
                admin.terminate(_own_pid(uow))
                raise Boom("the application's own error")
        assert any("rolling back failed too" in note for note in caught.value.__notes__)


# --------------------------------------------------------------------------
# (d) random moments


VICTIM = "agentkeep_victim"
_MAX_OPS = 1_000


@dataclass
class Ledger:
    """What each operation of the random run was told, by kind of effect."""

    acked: set[str] = field(default_factory=set)
    unknown: set[str] = field(default_factory=set)
    failed: set[str] = field(default_factory=set)
    errors: list[str] = field(default_factory=list)

    def record(self, key: str, idempotent: bool, call: Callable[[], Any]) -> Any:
        try:
            result = call()
        except CommitOutcomeUnknown as exc:
            assert not idempotent, f"{key}: an idempotent operation raised {exc!r}"
            self.unknown.add(key)
            return None
        except AgentkeepError as exc:
            self.failed.add(key)
            self.errors.append(type(exc).__name__)
            return None
        except Exception as exc:  # noqa: BLE001 - reported as the failure it is
            raise AssertionError(f"{key}: untyped {type(exc).__name__}: {exc}") from exc
        self.acked.add(key)
        return result

    def agrees(self, stored: set[str], keys: set[str]) -> None:
        """Acknowledged ⊆ stored ⊆ acknowledged ∪ unknown, over ``keys``."""
        acked, unknown = self.acked & keys, self.unknown & keys
        assert acked <= stored, sorted(acked - stored)
        assert stored <= acked | unknown, sorted(stored - acked - unknown)
        assert not (stored & (self.failed & keys)), sorted(stored & self.failed)


def _run_uuid(key: str) -> str:
    return str(uuid.uuid5(uuid.NAMESPACE_URL, key))


def _operation(
    store: Store, lease: SessionExecutionLease, kind: str, i: int
) -> tuple[bool, Callable[[], Any]]:
    """Operation ``i`` of the random run: (idempotent, the call); its key is ``f"{kind}-{i}"``."""
    key = f"{kind}-{i}"
    if kind == "create":
        return True, lambda: store.runs.create(RunRecord.new(f"R-new-{i}", "T-1", created_at=T0))
    if kind == "step":
        entry = StepEntry(step_id=f"ST-{i}", at=T0)
        return False, lambda: store.runs.append_step_entry("R-steps", entry)
    if kind == "transition":
        return False, lambda: store.runs.try_transition(
            f"R-{i}", RunStatus.PENDING, RunStatus.RUNNING
        )
    if kind in ("enqueue", "enqueue-keyed"):
        draft = QueuedWorkDraft(
            session_id=SID,
            source_key=key if kind == "enqueue-keyed" else None,
            payloads=(QueuedWorkPayload(kind="user_input", body=key),),
        )
        return kind == "enqueue-keyed", lambda: store.queue.enqueue_queued_work(draft)
    if kind == "input":
        pending = PendingTurnInputDraft(
            session_id=SID, source_key=key, ingress=NextTurnIngress(), input=key
        )
        return True, lambda: store.turn_inputs.enqueue_pending_turn_input(pending)
    if kind == "turn":
        commit = RuntimeCommit(
            session_id=SID,
            expected_head_revision=None,
            session_execution_lease=lease,
            graph=UnchangedGraph(leaf_node_id=None),
            checkpoint=HydratedSessionCheckpoint(turn_state={"turn": key}),
            turn_commit=TurnCommitStamp(session_id=SID, turn_id=key, turn_commit_hash="h"),
        )
        return True, lambda: store.commits.commit_runtime_state(commit)
    assert kind == "apply"
    boundary = receipt(1, _run_uuid(key))
    record = input_record()
    return True, lambda: store.runtime.atomic_apply(RT, None, boundary, [record])


def _random_run(url: str, n: int, seed: int) -> tuple[Ledger, int]:
    rng = random.Random(seed)
    admin = Admin(url)
    ledger = Ledger()
    store = Store.open(
        url,
        clock=SettableClock(T0),
        busy_timeout_ms=10_000,
        connect_args={"application_name": VICTIM},
    )
    try:
        for i in range(n):
            store.runs.create(RunRecord.new(f"R-{i}", "T-1", created_at=T0))
        store.runs.create(RunRecord.new("R-steps", "T-1", created_at=T0))
        lease = _lease(store)
        kinds = [
            "create",
            "step",
            "transition",
            "enqueue",
            "enqueue-keyed",
            "input",
            "turn",
            "apply",
        ]
        for i in range(n):
            kind = rng.choice(kinds)
            key = f"{kind}-{i}"
            idempotent, call = _operation(store, lease, kind, i)
            killer = threading.Timer(rng.uniform(0, 0.02), admin.terminate_application, (VICTIM,))
            killer.start()
            try:
                result = ledger.record(key, idempotent, call)
            finally:
                killer.join()
            # A pending run's transition never loses: False would mean a doubled attempt.
            assert not (kind == "transition" and result is False), key
        return ledger, admin.terminated
    finally:
        store.close()
        admin.close()


def _stored_keys(url: str) -> set[str]:
    rows = raw_rows
    keys = {
        f"create-{r[0][len('R-new-') :]}"
        for r in rows(url, "SELECT id FROM runs WHERE id LIKE 'R-new-%'")
    }
    (steps,) = rows(url, "SELECT step_entries_json FROM runs WHERE id = 'R-steps'")
    keys |= {f"step-{e['step_id'][3:]}" for e in json.loads(steps[0])}
    keys |= {
        f"transition-{r[0][2:]}"
        for r in rows(
            url, "SELECT id FROM runs WHERE status = '\"running\"' AND id NOT LIKE 'R-new-%'"
        )
    }
    for (payload,) in rows(url, "SELECT payload_json FROM queued_work_items"):
        keys.add(json.loads(payload)["body"])
    keys |= {r[0] for r in rows(url, "SELECT source_key FROM pending_turn_inputs")}
    keys |= {r[0] for r in rows(url, "SELECT turn_id FROM runtime_turn_commits")}
    receipts = {r[0] for r in rows(url, "SELECT run_id FROM runtime_boundary_receipts")}
    keys |= {f"apply-{i}" for i in range(_MAX_OPS) if _run_uuid(f"apply-{i}") in receipts}
    return keys


def _check_random_run(url: str, ledger: Ledger) -> None:
    stored = _stored_keys(url)
    every = ledger.acked | ledger.unknown | ledger.failed
    ledger.agrees(stored, every)
    # Nothing doubled: one batch per key, one head revision per turn commit.
    rows = raw_rows(
        url, "SELECT payload_json, count(*) FROM queued_work_items GROUP BY payload_json"
    )
    assert all(count == 1 for _, count in rows), rows
    (turns,) = raw_rows(url, "SELECT count(*) FROM runtime_turn_commits")
    head = raw_rows(url, "SELECT head_revision FROM session_head")
    assert head == ([(turns[0],)] if turns[0] else [])


def test_pg_backends_terminated_at_random_moments(
    pg_url: str, pool_errors: Callable[[], list[str]]
) -> None:
    ledger, terminated = _random_run(pg_url, n=40, seed=13)
    assert terminated > 0
    _check_random_run(pg_url, ledger)
    assert ledger.acked, "no operation succeeded"
    assert pool_errors() == []


@pytest.mark.slow
def test_pg_backends_terminated_at_random_moments_long(
    pg_url: str, pool_errors: Callable[[], list[str]]
) -> None:
    ledger, terminated = _random_run(pg_url, n=300, seed=1313)
    assert terminated > 0
    _check_random_run(pg_url, ledger)
    assert pool_errors() == []


# --------------------------------------------------------------------------
# SQLite: a failure injected at COMMIT


@pytest.fixture
def sqlite_url(tmp_path: Any) -> str:
    if "sqlite" not in BACKENDS:
        pytest.skip("AGENTKEEP_TEST_BACKENDS excludes sqlite")
    from agentkeep import migrations

    url = f"sqlite:///{tmp_path / 'agentkeep.db'}"
    migrations.upgrade(url)
    return url


def _no_transaction_left(url: str) -> None:
    """Another connection can take the write lock at once: the failed unit was rolled back."""
    path = make_url(url).database
    assert path is not None
    lite = sqlite3.connect(path, isolation_level=None, timeout=0)
    try:
        lite.execute("BEGIN IMMEDIATE")
        lite.rollback()
    finally:
        lite.close()


@pytest.mark.parametrize("kind", ["refused", "gone"])
@pytest.mark.parametrize("op", OPS, ids=OP_IDS)
def test_sqlite_failure_at_commit(
    sqlite_url: str, op: Op, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with Store.open(sqlite_url, clock=SettableClock(T0)) as store:
        ctx = op.setup(store)
        assert op.state(sqlite_url) == op.before
        fault = CommitFault(monkeypatch)
        fault.arm(kind)
        outcome = _run(lambda: op.call(store, ctx))
        assert fault.fired == 1
        _expect(op, kind, outcome, sqlite_url)
        if kind == "refused":
            assert "not authorized" in str(outcome)
        _no_transaction_left(sqlite_url)
        assert store.runs.list_by_task("T-none") == []  # the store goes on


def test_sqlite_unit_refused_at_commit_is_definite(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A unit's COMMIT refused with the transaction still open: rolled back, a typed error."""
    with Store.open(sqlite_url) as store:
        with pytest.raises(DatabaseError) as caught:
            with store.write() as uow:
                uow.runs.create(RunRecord.new("R-1", "T-1", created_at=T0))
                _deny_one_commit(uow.driver.raw)
        assert not isinstance(caught.value, CommitOutcomeUnknown)
        assert "not authorized" in str(caught.value)
        _no_transaction_left(sqlite_url)
        assert raw_rows(sqlite_url, "SELECT count(*) FROM runs") == [(0,)]
        with store.write() as uow:  # the connection went back to the pool usable
            uow.runs.create(RunRecord.new("R-1", "T-1", created_at=T0))
        assert raw_rows(sqlite_url, "SELECT id FROM runs") == [("R-1",)]
