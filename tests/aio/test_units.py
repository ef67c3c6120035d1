"""Async units of work in the native mode: ``astore.write()``, ``astore.read()`` and ``join=``.

The host keeps its own ORM model on its own declarative base
(:class:`tests.host_app.HostNote`, its table created on the synchronous URL).

* ``uow.session`` (an AsyncSession in the unit's transaction): the host's rows
  commit with agentkeep's when the block exits normally and roll back with
  them when it raises.
* ``astore.write(join=...)`` with the host's AsyncSession or AsyncConnection
  on the AsyncEngine the store was opened on (``AsyncStore.open(engine)``):
  the unit never commits (nothing is visible before the host commits); the
  host's commit commits both, its rollback undoes both; a block that raises
  rolls back only its own work (a SAVEPOINT) and the host's transaction goes
  on; objects that cannot be joined give ``InvalidInput`` before the block
  runs and change nothing.
* ``astore.read()`` refuses writes with ``ReadOnlyUnitOfWork`` (nothing
  written) and reads one snapshot; a thread-mode store (synchronous URL)
  refuses ``write()`` / ``read()`` with ``InvalidInput``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from sqlalchemy import insert, select
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine
from sqlalchemy.orm import Session

from agentkeep.aio import AsyncStore
from agentkeep.clock import SettableClock
from agentkeep.errors import InvalidInput, ReadOnlyUnitOfWork, RunNotFound
from agentkeep.runs.domain import RunStatus
from tests.conftest import as_sync_url
from tests.host_app import HostNote, host_tables, notes

from .support import T0, is_sqlite, new_run, open_astore, run_status


class Boom(Exception):
    """Raised by a test inside a unit."""


@pytest.fixture
def host_url(async_url: str) -> Iterator[str]:
    """``async_url`` with the host's tables (created on the synchronous driver)."""
    with host_tables(as_sync_url(async_url)):
        yield async_url


def host_notes(url: str) -> dict[int, tuple[str, str]]:
    return notes(as_sync_url(url))


@asynccontextmanager
async def host_and_store(url: str) -> AsyncIterator[tuple[AsyncEngine, AsyncStore]]:
    """The host's own AsyncEngine (SQLAlchemy defaults) and agentkeep opened on it."""
    engine = create_async_engine(url)
    try:
        astore = await AsyncStore.open(engine, clock=SettableClock(T0))
        assert astore.native and astore.engine is engine
        yield engine, astore
        await astore.close()  # the host's engine is left alone
        assert not engine.sync_engine.pool.checkedout()
    finally:
        await engine.dispose()


# --------------------------------------------------------------------------
# uow.session


def test_host_rows_commit_with_the_unit(host_url: str) -> None:
    async def scenario() -> None:
        astore = await open_astore(host_url)
        try:
            async with astore.write() as uow:
                await uow.runs.create(new_run("R-1"))
                uow.session.add(HostNote(id=1, run_id="R-1", note="launched"))
                await uow.session.flush()
                seen = (await uow.session.execute(select(HostNote.note))).scalars().all()
                assert seen == ["launched"]
                assert (await uow.runs.get("R-1")).status == RunStatus.PENDING
        finally:
            await astore.close()

    asyncio.run(scenario())
    assert run_status(host_url, "R-1") == RunStatus.PENDING.value
    assert host_notes(host_url) == {1: ("R-1", "launched")}


def test_host_rows_roll_back_with_the_unit(host_url: str) -> None:
    async def scenario() -> None:
        astore = await open_astore(host_url)
        try:
            await astore.runs.create(new_run("R-1"))
            with pytest.raises(Boom):
                async with astore.write() as uow:
                    assert await uow.runs.try_transition(
                        "R-1", RunStatus.PENDING, RunStatus.RUNNING
                    )
                    await uow.runs.create(new_run("R-2"))
                    uow.session.add(HostNote(id=1, run_id="R-2", note="launched"))
                    await uow.session.flush()
                    raise Boom
            # the store goes on
            async with astore.write() as uow:
                uow.session.add(HostNote(id=2, run_id="R-1", note="after"))
        finally:
            await astore.close()

    asyncio.run(scenario())
    assert run_status(host_url, "R-1") == RunStatus.PENDING.value
    assert run_status(host_url, "R-2") is None
    assert host_notes(host_url) == {2: ("R-1", "after")}


# --------------------------------------------------------------------------
# join=


def test_join_async_session_commits_with_the_host(host_url: str) -> None:
    async def scenario() -> None:
        async with host_and_store(host_url) as (engine, astore):
            async with AsyncSession(engine) as session:
                session.add(HostNote(id=1, run_id="R-1", note="host first"))
                async with astore.write(join=session) as uow:
                    assert uow.session is session
                    await uow.runs.create(new_run("R-1"))
                    uow.session.add(HostNote(id=2, run_id="R-1", note="in the unit"))
                # the unit did not commit: nothing is visible to anyone else yet
                assert run_status(host_url, "R-1") is None
                assert host_notes(host_url) == {}
                session.add(HostNote(id=3, run_id="R-1", note="host after"))
                await session.commit()

    asyncio.run(scenario())
    assert run_status(host_url, "R-1") == RunStatus.PENDING.value
    assert set(host_notes(host_url)) == {1, 2, 3}


def test_join_async_session_host_rollback_undoes_both(host_url: str) -> None:
    async def scenario() -> None:
        async with host_and_store(host_url) as (engine, astore):
            async with AsyncSession(engine) as session:
                session.add(HostNote(id=1, run_id="R-1", note="host"))
                async with astore.write(join=session) as uow:
                    await uow.runs.create(new_run("R-1"))
                await session.rollback()
            # the store and the engine go on
            await astore.runs.create(new_run("R-2"))

    asyncio.run(scenario())
    assert run_status(host_url, "R-1") is None
    assert run_status(host_url, "R-2") == RunStatus.PENDING.value
    assert host_notes(host_url) == {}


def test_join_async_session_block_error_rolls_back_only_the_block(host_url: str) -> None:
    async def scenario() -> None:
        async with host_and_store(host_url) as (engine, astore):
            await astore.runs.create(new_run("R-0"))
            async with AsyncSession(engine) as session:
                session.add(HostNote(id=1, run_id="R-0", note="before"))
                with pytest.raises(Boom):
                    async with astore.write(join=session) as uow:
                        assert await uow.runs.try_transition(
                            "R-0", RunStatus.PENDING, RunStatus.RUNNING
                        )
                        await uow.runs.create(new_run("R-1"))
                        uow.session.add(HostNote(id=2, run_id="R-1", note="in the block"))
                        raise Boom
                # the host's transaction is usable: more host rows, another joined unit
                session.add(HostNote(id=3, run_id="R-0", note="after"))
                async with astore.write(join=session) as uow:
                    await uow.runs.create(new_run("R-2"))
                await session.commit()

    asyncio.run(scenario())
    assert run_status(host_url, "R-0") == RunStatus.PENDING.value  # the block's transition undone
    assert run_status(host_url, "R-1") is None
    assert run_status(host_url, "R-2") == RunStatus.PENDING.value
    assert set(host_notes(host_url)) == {1, 3}


def test_join_async_connection_commits_and_rolls_back_with_the_host(host_url: str) -> None:
    async def scenario() -> None:
        async with host_and_store(host_url) as (engine, astore):
            async with engine.connect() as conn:
                await conn.execute(insert(HostNote).values(id=1, run_id="R-1", note="committed"))
                async with astore.write(join=conn) as uow:
                    await uow.runs.create(new_run("R-1"))
                    uow.session.add(HostNote(id=2, run_id="R-1", note="via uow.session"))
                assert run_status(host_url, "R-1") is None
                await conn.commit()

                await conn.execute(insert(HostNote).values(id=3, run_id="R-2", note="undone"))
                async with astore.write(join=conn) as uow:
                    await uow.runs.create(new_run("R-2"))
                await conn.rollback()

                # an error inside the block: only the block is undone
                await conn.execute(insert(HostNote).values(id=4, run_id="R-1", note="kept"))
                with pytest.raises(Boom):
                    async with astore.write(join=conn) as uow:
                        await uow.runs.create(new_run("R-3"))
                        raise Boom
                await conn.execute(insert(HostNote).values(id=5, run_id="R-1", note="after"))
                await conn.commit()

    asyncio.run(scenario())
    assert run_status(host_url, "R-1") == RunStatus.PENDING.value
    assert run_status(host_url, "R-2") is None
    assert run_status(host_url, "R-3") is None
    assert set(host_notes(host_url)) == {1, 2, 4, 5}


def test_bad_join_objects_are_refused_and_change_nothing(host_url: str) -> None:
    async def scenario() -> None:
        other = create_async_engine(host_url)
        async with host_and_store(host_url) as (engine, astore):
            await astore.runs.create(new_run("R-1"))

            async def refused(join: Any) -> None:
                entered = False
                with pytest.raises(InvalidInput) as info:
                    async with astore.write(join=join) as uow:
                        entered = True
                        await uow.runs.try_transition("R-1", RunStatus.PENDING, RunStatus.RUNNING)
                assert info.value.field == "join", info.value
                assert not entered

            await refused("a session")
            await refused(Session(engine.sync_engine))  # synchronous: not for AsyncStore
            await refused(engine)
            unstarted = engine.connect()  # never awaited: no connection yet
            await refused(unstarted)
            async with AsyncSession(other) as foreign:  # another engine's transaction
                foreign.add(HostNote(id=9, run_id="R-1", note="foreign"))
                await refused(foreign)
                await foreign.rollback()
            async with engine.connect() as conn:
                auto = await conn.execution_options(isolation_level="AUTOCOMMIT")
                await refused(auto)
            if not is_sqlite(host_url):
                async with engine.connect() as conn:
                    snapshot = await conn.execution_options(isolation_level="REPEATABLE READ")
                    await snapshot.execute(select(HostNote.id))
                    await refused(snapshot)
            with pytest.raises(InvalidInput):
                async with astore.read(join=42):  # type: ignore[arg-type]
                    raise AssertionError("entered")
            # the store goes on
            assert await astore.runs.get("R-1")
        await other.dispose()

    asyncio.run(scenario())
    assert run_status(host_url, "R-1") == RunStatus.PENDING.value
    assert host_notes(host_url) == {}


# --------------------------------------------------------------------------
# read() and the thread mode


def test_read_unit_refuses_writes(async_url: str) -> None:
    async def scenario() -> None:
        astore = await open_astore(async_url)
        try:
            await astore.runs.create(new_run("R-1"))
            writes: list[Callable[[Any], Awaitable[Any]]] = [
                lambda uow: uow.runs.create(new_run("R-2")),
                lambda uow: uow.runs.try_transition("R-1", RunStatus.PENDING, RunStatus.RUNNING),
                lambda uow: uow.runs.delete("R-1"),
            ]
            for write in writes:
                with pytest.raises(ReadOnlyUnitOfWork):
                    async with astore.read() as uow:
                        assert not uow.writable
                        assert (await uow.runs.get("R-1")).status == RunStatus.PENDING
                        await write(uow)
            async with astore.read() as uow:
                with pytest.raises(RunNotFound):
                    await uow.runs.get("R-2")
        finally:
            await astore.close()

    asyncio.run(scenario())
    assert run_status(async_url, "R-1") == RunStatus.PENDING.value
    assert run_status(async_url, "R-2") is None


def test_thread_mode_store_refuses_units(async_url: str) -> None:
    async def scenario() -> None:
        astore = await open_astore(as_sync_url(async_url))
        try:
            assert not astore.native
            await astore.runs.create(new_run("R-1"))
            for unit in (astore.write, astore.read):
                with pytest.raises(InvalidInput) as info:
                    async with unit() as uow:
                        await uow.runs.try_transition("R-1", RunStatus.PENDING, RunStatus.RUNNING)
                assert info.value.field == "url"
            # its one-call operations work
            assert await astore.runs.try_transition("R-1", RunStatus.PENDING, RunStatus.RUNNING)
        finally:
            await astore.close()

    asyncio.run(scenario())
    assert run_status(async_url, "R-1") == RunStatus.RUNNING.value
