"""A write unit whose transaction the database already ended is refused, never acknowledged.

A statement that fails inside a unit, its error caught by the code in the
unit, leaves a Postgres transaction aborted: COMMIT then rolls it back while
psycopg and asyncpg report success. SQLite rolls the whole transaction back
by itself on some errors (here a trigger's ``RAISE(ROLLBACK, ...)``; in the
field a full disk or an I/O error), after which COMMIT has nothing to commit.
Before the fence (``Driver.check_not_aborted``) such a unit exited normally
and its writes, a lease claim acknowledged inside it included, were gone.
Now leaving it raises :class:`TransactionAborted`, nothing of it is stored,
and the store stays usable; a failure inside a savepoint still leaves the
rest of the unit to commit.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

from agentkeep import Store
from agentkeep.aio import AsyncStore
from agentkeep.errors import TransactionAborted
from agentkeep.sessions.domain import Acquired, LeaseOwnerIdentity
from agentkeep.unit_of_work import Repositories

OWNER = LeaseOwnerIdentity(owner_id="owner", incarnation_id="inc")
TTL = 60_000

#: SQLite: a host table whose insert of a negative value ends the whole transaction.
_HOST_TABLE = (
    "CREATE TABLE IF NOT EXISTS host_rows (x INTEGER)",
    "CREATE TRIGGER IF NOT EXISTS host_rows_end AFTER INSERT ON host_rows "
    "WHEN NEW.x < 0 BEGIN SELECT RAISE(ROLLBACK, 'negative'); END",
)
#: The statement that ends (SQLite) or aborts (Postgres) the unit's transaction.
_ENDS_TRANSACTION = {"sqlite": "INSERT INTO host_rows VALUES (-1)", "postgres": "SELECT 1/0"}
#: A failing statement whose transaction goes on (in a savepoint on Postgres).
_SURVIVED = {"sqlite": "SELECT * FROM no_such_table", "postgres": "SELECT 1/0"}


def _host_table(store: Store, backend: str) -> None:
    if backend == "sqlite":
        with store.write() as uow:
            for sql in _HOST_TABLE:
                uow.connection.execute(text(sql))


def _lease_stored(store: Store, session_id: str) -> bool:
    with store.read() as uow:
        return uow.leases.get_session_execution_lease(session_id) is not None


async def _claim_then_end_the_transaction(store: AsyncStore, session_id: str, backend: str) -> None:
    """An AsyncStore unit that claims a lease, then runs a statement ending its transaction
    (the error caught in the unit); leaving it must raise TransactionAborted."""
    with pytest.raises(TransactionAborted):
        async with store.write() as uow:
            claimed = await uow.leases.try_claim_session_execution_lease(session_id, OWNER, TTL)
            assert isinstance(claimed, Acquired)
            with pytest.raises(DBAPIError):
                await uow.session.execute(text(_ENDS_TRANSACTION[backend]))


def test_a_unit_whose_transaction_the_database_ended_raises_and_stores_nothing(
    store: Store, backend: str
) -> None:
    _host_table(store, backend)
    with pytest.raises(TransactionAborted, match="nothing of the unit was written"):
        with store.write() as uow:
            claimed = uow.leases.try_claim_session_execution_lease("s-ended", OWNER, TTL)
            assert isinstance(claimed, Acquired)  # acknowledged inside the unit
            with pytest.raises(DBAPIError):
                uow.connection.execute(text(_ENDS_TRANSACTION[backend]))
            # the code in the unit caught the error and leaves the block normally
    assert not _lease_stored(store, "s-ended")
    # The connection was rolled back: the next unit on the store works.
    with store.write() as uow:
        claimed = uow.leases.try_claim_session_execution_lease("s-ended", OWNER, TTL)
        assert isinstance(claimed, Acquired)
    assert _lease_stored(store, "s-ended")


def test_a_failure_the_transaction_survives_leaves_the_unit_to_commit(
    store: Store, backend: str
) -> None:
    """In a savepoint: Postgres rolls back to it, SQLite only the failed statement."""
    with store.write() as uow:
        claimed = uow.leases.try_claim_session_execution_lease("s-kept", OWNER, TTL)
        assert isinstance(claimed, Acquired)
        with pytest.raises(DBAPIError):
            with uow.connection.begin_nested():
                uow.connection.execute(text(_SURVIVED[backend]))
    assert _lease_stored(store, "s-kept")


def test_a_call_write_unit_whose_transaction_the_database_ended_raises(
    store: Store, backend: str
) -> None:
    """The lean unit of ``call_write`` (``Driver.commit``): the same fence."""
    _host_table(store, backend)

    def unit(repos: Repositories) -> None:
        claimed = repos.leases.try_claim_session_execution_lease("s-lean", OWNER, TTL)
        assert isinstance(claimed, Acquired)
        # What a statement failing outside any savepoint does to the unit's connection.
        with pytest.raises(Exception):  # noqa: B017,PT011 - the driver's own error type
            repos.driver.raw.execute(_ENDS_TRANSACTION[backend])

    with pytest.raises(TransactionAborted):
        store.call_write(unit)
    assert not _lease_stored(store, "s-lean")
    assert isinstance(
        store.leases.try_claim_session_execution_lease("s-lean", OWNER, TTL), Acquired
    )


def test_an_async_unit_whose_transaction_the_database_ended_raises(
    async_url: str, async_driver: str
) -> None:
    """AsyncStore on aiosqlite, asyncpg (no failed-transaction state: asked) and psycopg_async."""
    backend = "sqlite" if async_driver == "aiosqlite" else "postgres"

    async def scenario() -> tuple[bool, Any]:
        store = await AsyncStore.open(async_url)
        try:
            if backend == "sqlite":
                async with store.write() as uow:
                    for sql in _HOST_TABLE:
                        await uow.session.execute(text(sql))
            await _claim_then_end_the_transaction(store, "s-async", backend)
            async with store.read() as uow:
                stored = await uow.leases.get_session_execution_lease("s-async")
            # A failure the transaction survives (Postgres: in a savepoint; SQLite: a
            # statement-level error) leaves the unit to commit (asyncpg asks the server).
            async with store.write() as uow:
                await uow.leases.try_claim_session_execution_lease("s-async-kept", OWNER, TTL)
                with pytest.raises(DBAPIError):
                    async with uow.session.begin_nested():
                        await uow.session.execute(text(_SURVIVED[backend]))
            async with store.read() as uow:
                kept = await uow.leases.get_session_execution_lease("s-async-kept")
            return stored is None, kept
        finally:
            await store.close()

    nothing_stored, kept = asyncio.run(scenario())
    assert nothing_stored
    assert kept is not None


def test_asyncpg_tells_an_aborted_transaction_by_its_sqlstate_not_its_message(
    async_url: str, async_driver: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """asyncpg keeps no failed-transaction state, so the fence asks the server (``SELECT 1``).

    A server set to another language (``lc_messages``) answers in its own
    words; the refusal is still ``in_failed_sql_transaction`` (SQLSTATE
    25P02) and the unit must still be TransactionAborted, not a generic
    DatabaseError. Here the server's answer is translated on the way back.
    """
    if async_driver != "asyncpg":
        pytest.skip("asyncpg only: psycopg reads libpq's transaction state, SQLite its own")
    import asyncpg

    from agentkeep import db

    real = db._asyncpg_query

    async def translated(adapter: Any, sql: str) -> Any:
        try:
            return await real(adapter, sql)
        except Exception as exc:  # noqa: BLE001 - re-raised below, translated or as it came
            if getattr(exc, "sqlstate", None) != "25P02":
                raise
            try:
                raise asyncpg.exceptions.InFailedSQLTransactionError(
                    "aktuelle Transaktion wurde abgebrochen, Befehle werden bis zum Ende "
                    "der Transaktion ignoriert"
                ) from None
            except asyncpg.exceptions.InFailedSQLTransactionError as german:
                adapter._handle_exception(german)

    monkeypatch.setattr(db, "_asyncpg_query", translated)

    async def scenario() -> bool:
        store = await AsyncStore.open(async_url)
        try:
            await _claim_then_end_the_transaction(store, "s-translated", "postgres")
            async with store.read() as uow:
                return await uow.leases.get_session_execution_lease("s-translated") is None
        finally:
            await store.close()

    assert asyncio.run(scenario())
