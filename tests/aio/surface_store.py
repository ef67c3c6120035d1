"""Cases of the async surface suite: ``AsyncStore``'s own methods and the unit's attributes.

``store.open``/``close``/``call_write``/``call_read``/``write``/``read`` and
``unit.session``/``connection``/``writable`` (see surface.py). Joins of a
host's AsyncSession or AsyncConnection, and the host's own ORM rows in
``uow.session``, are in test_units.py.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from sqlalchemy import make_url, text
from sqlalchemy.ext.asyncio import create_async_engine

from agentkeep.aio import AsyncStore
from agentkeep.errors import InvalidInput, ReadOnlyUnitOfWork, RunNotFound, SchemaBehind
from agentkeep.runs.domain import RunStatus
from tests.conftest import as_async_url, create_pg_database, drop_pg_database

from .support import is_sqlite, new_run, run_status
from .surface import Ctx, covers

CALL = ("call",)


class Boom(Exception):
    """Raised inside a unit by a case."""


@covers("store.open", modes=CALL)
async def _open(c: Ctx) -> None:
    await c.astore.runs.create(new_run("R-1"))
    other = await AsyncStore.open(c.url)
    try:
        assert other.native and other.engine is not c.astore.engine
        assert (await other.runs.get("R-1")).status == RunStatus.PENDING
    finally:
        await other.close()
    await c.refused(InvalidInput, AsyncStore.open(c.url, retry_attempts=-1))
    engine = create_async_engine(c.url)
    try:
        # engine options apply to an engine agentkeep creates, not to the host's
        await c.refused(InvalidInput, AsyncStore.open(engine, pool_size=1))
    finally:
        await engine.dispose()
    with fresh_database(c.url) as fresh:
        with pytest.raises(SchemaBehind):
            await AsyncStore.open(fresh)  # not migrated
        migrated = await AsyncStore.open(fresh, migrate=True)
        try:
            assert await migrated.runs.list() == []
        finally:
            await migrated.close()


@contextmanager
def fresh_database(url: str) -> Iterator[str]:
    """An empty, unmigrated database on ``url``'s driver (a new file or Postgres database)."""
    driver = make_url(url).get_driver_name()
    if is_sqlite(url):
        with tempfile.TemporaryDirectory() as tmp:
            yield f"sqlite+{driver}:///{tmp}/fresh.db"
        return
    plain = create_pg_database("agentkeep_fresh")
    try:
        yield as_async_url(plain, driver)
    finally:
        drop_pg_database(plain)


@covers("store.close", modes=CALL)
async def _close(c: Ctx) -> None:
    other = await AsyncStore.open(c.url)
    await other.runs.create(new_run("R-1"))
    assert other.engine.pool.checkedin() >= 1
    await other.close()
    assert other.engine.pool.checkedin() == 0  # its pooled connections were released
    assert c.seen.no_open_transaction_now()
    host = create_async_engine(c.url)
    try:
        adopted = await AsyncStore.open(host)
        await adopted.runs.get("R-1")
        await adopted.close()  # the host's engine is left as it is
        async with host.connect() as conn:
            assert (await conn.execute(text("SELECT count(*) FROM runs"))).scalar() == 1
    finally:
        await host.dispose()


@covers("store.call_write", modes=CALL)
async def _call_write(c: Ctx) -> None:
    def both(repos: Any) -> bool:
        repos.runs.create(new_run("R-1"))
        return bool(repos.runs.try_transition("R-1", RunStatus.PENDING, RunStatus.RUNNING))

    assert await c.astore.call_write(both) is True
    assert run_status(c.url, "R-1") == RunStatus.RUNNING.value

    def half(repos: Any) -> None:
        repos.runs.create(new_run("R-2"))
        repos.runs.get("R-missing")  # RunNotFound: the whole unit rolls back

    await c.refused(RunNotFound, c.astore.call_write(half))


@covers("store.call_read", modes=CALL)
async def _call_read(c: Ctx) -> None:
    await c.astore.runs.create(new_run("R-1"))
    assert await c.astore.call_read(lambda repos: repos.runs.get("R-1").status) == "pending"
    await c.refused(
        ReadOnlyUnitOfWork, c.astore.call_read(lambda repos: repos.runs.create(new_run("R-2")))
    )


@covers("store.write", modes=CALL)
async def _write(c: Ctx) -> None:
    await c.astore.runs.create(new_run("R-1"))
    async with c.astore.write() as uow:
        assert await uow.runs.try_transition("R-1", RunStatus.PENDING, RunStatus.RUNNING)
        await uow.runs.create(new_run("R-2"))
        assert run_status(c.url, "R-2") is None  # not committed yet
    assert run_status(c.url, "R-1") == RunStatus.RUNNING.value
    assert run_status(c.url, "R-2") == RunStatus.PENDING.value

    async def raising() -> None:
        async with c.astore.write() as uow:
            await uow.runs.update_status("R-1", RunStatus.FAILED)
            await uow.runs.create(new_run("R-3"))
            raise Boom

    await c.refused(Boom, raising())
    bad: Any = "not a session"
    await c.refused(InvalidInput, _enter(c.astore.write(join=bad)))


async def _enter(unit: Any) -> None:
    async with unit:
        raise AssertionError("entered")


@covers("store.read", modes=CALL)
async def _read(c: Ctx) -> None:
    await c.astore.runs.create(new_run("R-1"))
    async with c.astore.read() as uow:
        first = await uow.runs.get("R-1")
        await c.astore.runs.update_status("R-1", RunStatus.FAILED)  # committed meanwhile
        assert (await uow.runs.get("R-1")) == first  # one snapshot
    assert (await c.astore.runs.get("R-1")).status == RunStatus.FAILED

    async def writing() -> None:
        async with c.astore.read() as uow:
            await uow.runs.delete("R-1")

    await c.refused(ReadOnlyUnitOfWork, writing())


@covers("unit.session", modes=CALL)
async def _session(c: Ctx) -> None:
    query = text("SELECT count(*) FROM runs")
    async with c.astore.write() as uow:
        await uow.runs.create(new_run("R-1"))
        # the AsyncSession is in the unit's transaction: it sees the uncommitted run
        assert (await uow.session.execute(query)).scalar() == 1
        assert uow.session is uow.session

    async def raising() -> None:
        async with c.astore.write() as uow:
            await uow.session.execute(text("DELETE FROM runs"))
            assert (await uow.session.execute(query)).scalar() == 0
            raise Boom

    await c.refused(Boom, raising())
    assert run_status(c.url, "R-1") == RunStatus.PENDING.value


@covers("unit.connection", modes=CALL)
async def _connection(c: Ctx) -> None:
    query = text("SELECT count(*) FROM runs")
    async with c.astore.write() as uow:
        await uow.runs.create(new_run("R-1"))
        assert (await uow.connection.execute(query)).scalar() == 1

    async def raising() -> None:
        async with c.astore.write() as uow:
            await uow.connection.execute(text("DELETE FROM runs"))
            raise Boom

    await c.refused(Boom, raising())
    async with c.astore.read() as uow:
        assert (await uow.connection.execute(query)).scalar() == 1


@covers("unit.writable", modes=CALL)
async def _writable(c: Ctx) -> None:
    async with c.astore.write() as uow:
        assert uow.writable is True
    async with c.astore.read() as uow:
        assert uow.writable is False
