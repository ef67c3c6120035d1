"""A pooled connection the server closed while it sat idle: the retry path, not "maybe applied".

There is no pre-ping at checkout; a one-call unit whose first round trip
fails on such a connection gets ``ConnectionLost`` (nothing was applied) and
runs again on a fresh connection. Two one-call paths on Postgres send their
own ``COMMIT`` in that first round trip: the run store's one-statement
``try_transition`` (autocommit) and an unfenced checkpoint-node or
pending-write put on psycopg (``COMMIT`` pipelined with the writes). A
connection lost in such a round trip can only be ``CommitOutcomeUnknown``,
so before sending one the unit asks ``Driver.closed_while_idle()`` and, on a
connection the server closed, takes its ordinary path instead.

Each case fills the pool, terminates every idle backend from an admin
connection, then calls the operation: it succeeds, applied once. The control
case patches ``closed_while_idle`` to answer False and sees
``CommitOutcomeUnknown``, so the scenario does reach the paths it guards.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

from agentkeep import Store
from agentkeep import migrations as migrate
from agentkeep.aio import AsyncStore
from agentkeep.clock import SettableClock
from agentkeep.db import Driver
from agentkeep.errors import CommitOutcomeUnknown
from agentkeep.runs import RunRecord, RunStatus
from agentkeep.sessions.checkpoint_nodes import PendingWrite
from tests.conftest import BACKENDS, as_async_url, create_pg_database, drop_pg_database

pytestmark = pytest.mark.skipif("postgres" not in BACKENDS, reason="Postgres only")


@pytest.fixture(scope="module")
def pg_url() -> Iterator[str]:
    url = create_pg_database("agentkeep_idle")
    migrate.upgrade(url)
    yield url
    drop_pg_database(url)


def _terminate_others(url: str) -> None:
    """Terminate every backend of the test database but the admin's own, and wait until gone."""
    with psycopg.connect(url.replace("+psycopg", ""), autocommit=True) as admin:
        admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        deadline = time.monotonic() + 30
        while admin.execute(
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
        ).fetchone() != (0,):
            assert time.monotonic() < deadline, "backends still alive after 30 s"
            time.sleep(0.01)


def _kill_pool(store: Store, url: str, n: int = 3) -> None:
    """``n`` fresh pooled connections, and the one parked on the store if any, all idle,
    terminated by the server. (Idle connections an earlier case left in the pool are
    dropped first: the pool may have noticed a dead one and replaced it.)"""
    store.engine.pool.dispose()
    conns = [store.engine.raw_connection() for _ in range(n)]
    for c in conns:
        c.close()
    _terminate_others(url)


def _sync_cases(store: Store, tag: str) -> list[tuple[str, Callable[[], Any], Callable[[], bool]]]:
    run_id, sid = f"R-{tag}", f"s-{tag}"
    store.runs.create(RunRecord.new(run_id, "T-1", 100))
    store.runs.update_status(run_id, RunStatus.RUNNING)
    return [
        (
            "try_transition",
            lambda: store.runs.try_transition(run_id, RunStatus.RUNNING, RunStatus.DONE),
            lambda: store.runs.get(run_id).status == RunStatus.DONE,  # type: ignore[union-attr]
        ),
        (
            "put_checkpoint_node",
            lambda: store.checkpoint_nodes.put_checkpoint_node(sid, "n1", b"x"),
            lambda: store.checkpoint_nodes.get_checkpoint_node(sid, "n1") is not None,
        ),
        (
            "put_pending_writes",
            lambda: store.checkpoint_nodes.put_pending_writes(
                sid, "n1", "t", [PendingWrite(0, "a", "json", b"1")]
            ),
            lambda: len(store.checkpoint_nodes.list_pending_writes(sid, "n1")) == 1,
        ),
    ]


def test_one_call_writes_retry_on_a_connection_closed_while_idle(pg_url: str) -> None:
    with Store.open(pg_url, clock=SettableClock(1_000_000_000)) as store:
        for name, call, applied in _sync_cases(store, "retry"):
            _kill_pool(store, pg_url)
            call()  # no CommitOutcomeUnknown: the unit ran again on a fresh connection
            assert applied(), name


def test_control_without_the_check_the_same_writes_are_maybe_applied(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(Driver, "closed_while_idle", lambda self: False)
    with Store.open(pg_url, clock=SettableClock(1_000_000_000)) as store:
        for name, call, _ in _sync_cases(store, "control"):
            _kill_pool(store, pg_url)
            with pytest.raises(CommitOutcomeUnknown):
                call()
            del name


@pytest.mark.parametrize("driver", ["asyncpg", "psycopg_async"])
def test_async_try_transition_retries_on_a_connection_closed_while_idle(
    pg_url: str, driver: str
) -> None:
    async def main() -> None:
        astore = await AsyncStore.open(
            as_async_url(pg_url, driver), clock=SettableClock(1_000_000_000)
        )
        try:
            run_id = f"R-async-{driver}"
            await astore.runs.create(RunRecord.new(run_id, "T-1", 100))
            await astore.runs.update_status(run_id, RunStatus.RUNNING)
            await asyncio.to_thread(_terminate_others, pg_url)
            await asyncio.sleep(0.05)  # the event loop sees the closed sockets
            assert await astore.runs.try_transition(run_id, RunStatus.RUNNING, RunStatus.DONE)
            got = await astore.runs.get(run_id)
            assert got is not None and got.status == RunStatus.DONE
        finally:
            await astore.close()

    asyncio.run(main())
