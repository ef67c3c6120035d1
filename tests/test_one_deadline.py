"""One deadline: the busy timeout bounds a whole one-call operation, retries included.

A one-call operation blocked on a lock held by another connection raises
``StoreBusy`` (the runtime store: ``WriteFailed``) after about the busy
timeout, not after ``retry_attempts`` times it
(docs/architecture.md#one-call-operations). Checked with a busy timeout of
500 ms: the operation takes at least 0.8 x and at most 2.5 x that (a wait
never ends early; the upper bound is generous for a loaded machine):

* SQLite: the write lock held by a raw ``BEGIN IMMEDIATE``;
* Postgres: the run's advisory lock held by another connection, on an engine
  agentkeep creates (``lock_timeout`` = ``busy_timeout_ms``) and on a host's
  engine with its own ``lock_timeout`` (read when the store opens);
* the asyncio drivers (aiosqlite, asyncpg, psycopg_async).

And the attempts are bounded: an operation whose every attempt fails
transiently at once makes exactly ``retry_attempts`` attempts.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
from sqlalchemy import create_engine, make_url

from agentkeep import db
from agentkeep.aio import AsyncStore
from agentkeep.db import LockNamespace, _key_hash
from agentkeep.errors import StoreBusy
from agentkeep.runs.domain import RunRecord, RunStatus
from agentkeep.runtime.errors import WriteFailed
from agentkeep.store import Store
from tests.conftest import as_sync_url
from tests.runtime.builders import encode, user_session

BUSY_MS = 500
RT = "rt-deadline"


@contextmanager
def write_lock_held(url: str, run_id: str = "R-1") -> Iterator[None]:
    """Another connection holds the lock a write of run ``run_id`` (or of ``RT``) needs.

    SQLite: the database write lock (``BEGIN IMMEDIATE``). Postgres: the
    run's and the runtime's advisory locks.
    """
    u = make_url(as_sync_url(url))
    if u.get_backend_name() == "sqlite":
        assert u.database is not None
        lite = sqlite3.connect(u.database, isolation_level=None)
        lite.execute("BEGIN IMMEDIATE")
        try:
            yield
        finally:
            lite.rollback()
            lite.close()
        return
    with psycopg.connect(u.set(drivername="postgresql").render_as_string(False)) as conn:
        conn.execute("SELECT pg_advisory_xact_lock(%s, %s)", (LockNamespace.RUN, _key_hash(run_id)))
        conn.execute("SELECT pg_advisory_xact_lock(%s, %s)", (LockNamespace.RUNTIME, _key_hash(RT)))
        yield
        conn.rollback()


def _timed(call: Callable[[], Any], error: type[Exception]) -> float:
    started = time.monotonic()
    with pytest.raises(error):
        call()
    return time.monotonic() - started


def _assert_one_deadline(elapsed: float, attempts: int) -> None:
    busy = BUSY_MS / 1000
    assert elapsed > busy * 0.8, f"gave up after {elapsed:.3f} s, before the busy timeout"
    assert elapsed < busy * 2.5, (
        f"took {elapsed:.3f} s: not one busy timeout ({busy} s) but up to {attempts} of them"
    )


def _operations(store: Store) -> dict[str, tuple[Callable[[], Any], type[Exception]]]:
    snapshot = encode(user_session("deadline"))
    return {
        "runs.try_transition": (
            lambda: store.runs.try_transition("R-1", RunStatus.PENDING, RunStatus.RUNNING),
            StoreBusy,
        ),
        "runtime.commit_session_snapshot": (
            lambda: store.runtime.commit_session_snapshot(RT, snapshot),
            WriteFailed,
        ),
    }


@pytest.mark.parametrize("op", ["runs.try_transition", "runtime.commit_session_snapshot"])
def test_a_blocked_operation_gives_up_after_one_busy_timeout(db_url: str, op: str) -> None:
    with Store.open(db_url, busy_timeout_ms=BUSY_MS, retry_attempts=5) as store:
        store.runs.create(RunRecord.new("R-1", "T-1", created_at=1))
        call, error = _operations(store)[op]
        with write_lock_held(db_url):
            elapsed = _timed(call, error)
        _assert_one_deadline(elapsed, store.retry_attempts)
        call()  # the lock released, the operation goes through


def test_postgres_host_engine_lock_timeout_is_the_deadline(backend: str, db_url: str) -> None:
    """A host's engine: its own ``lock_timeout`` (read at adoption) bounds the whole call."""
    if backend != "postgres":
        pytest.skip("Postgres only: a host engine's lock_timeout")
    engine = create_engine(db_url, connect_args={"options": f"-c lock_timeout={BUSY_MS}"})
    try:
        with Store.open(engine, retry_attempts=5) as store:
            assert db.engine_settings(engine).busy_timeout_ms == BUSY_MS  # type: ignore[union-attr]
            store.runs.create(RunRecord.new("R-1", "T-1", created_at=1))
            call, error = _operations(store)["runs.try_transition"]
            with write_lock_held(db_url):
                elapsed = _timed(call, error)
            _assert_one_deadline(elapsed, store.retry_attempts)
    finally:
        engine.dispose()


def test_postgres_host_engine_without_lock_timeout_has_no_deadline(
    backend: str, db_url: str
) -> None:
    """``lock_timeout = 0`` (no limit): no deadline is invented; the attempts bound the call."""
    if backend != "postgres":
        pytest.skip("Postgres only: a host engine's lock_timeout")
    engine = create_engine(db_url, connect_args={"options": "-c lock_timeout=0"})
    try:
        with Store.open(engine) as store:
            assert db.engine_settings(engine).busy_timeout_ms is None  # type: ignore[union-attr]
            assert store._deadline() is None
    finally:
        engine.dispose()


def test_async_blocked_operation_gives_up_after_one_busy_timeout(async_url: str) -> None:
    with Store.open(as_sync_url(async_url)) as setup:
        setup.runs.create(RunRecord.new("R-1", "T-1", created_at=1))

    async def scenario() -> float:
        astore = await AsyncStore.open(async_url, busy_timeout_ms=BUSY_MS, retry_attempts=5)
        try:
            with write_lock_held(async_url):
                started = time.monotonic()
                with pytest.raises(StoreBusy):
                    await astore.runs.try_transition("R-1", RunStatus.PENDING, RunStatus.RUNNING)
                return time.monotonic() - started
        finally:
            await astore.close()

    _assert_one_deadline(asyncio.run(scenario()), 5)


def test_attempts_are_bounded_by_retry_attempts(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every attempt failing transiently at once: ``retry_attempts`` attempts, then StoreBusy."""
    attempts: list[int] = []
    original = db.Driver.begin

    def busy_begin(driver: db.Driver, *, write: bool) -> None:
        if write:
            attempts.append(1)
            raise StoreBusy("injected: busy")
        original(driver, write=write)

    with Store.open(db_url, retry_attempts=3) as store:
        store.runs.create(RunRecord.new("R-1", "T-1", created_at=1))
        monkeypatch.setattr(db.Driver, "begin", busy_begin)
        with pytest.raises(StoreBusy, match="injected"):
            store.runs.try_transition("R-1", RunStatus.PENDING, RunStatus.RUNNING)
        assert len(attempts) == 3
        monkeypatch.setattr(db.Driver, "begin", original)
        assert store.runs.get("R-1").status == RunStatus.PENDING
