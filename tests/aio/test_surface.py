"""The whole async surface on every asyncio driver: each public operation's outcomes.

One test per public operation of :class:`~agentkeep.aio.AsyncStore` (the
table :data:`~tests.aio.surface.CASES`, cases in ``surface_*.py``), on each
asyncio driver (:func:`surface_url`, like ``async_url``: aiosqlite in the
SQLite run, asyncpg and psycopg_async with Postgres). A case checks the
operation's returned value, its refusal outcomes with the stored rows
unchanged, and its typed errors with the stored rows unchanged, once as a
one-call coroutine and once inside an async unit of work (``async with
astore.write()/read() as uow``).

:func:`test_every_public_async_operation_has_a_case` fails when an operation
is added to a facade, to ``AsyncStore`` or to a unit's repositories without a
case here. The races of the async surface (50 tasks racing
``try_transition``, a lease takeover refusing the zombie, the head
compare-and-set with concurrent committers) are in test_races.py; the host's
rows in ``uow.session`` committing and rolling back with agentkeep's, and
joins, in test_units.py; cancellation in test_cancellation.py.
"""

from __future__ import annotations

import asyncio
import inspect
from pathlib import Path

import pytest

from agentkeep import aio
from agentkeep import migrations as migrate
from agentkeep.aio import AsyncStore, AsyncUnitOfWork
from agentkeep.clock import SettableClock
from agentkeep.unit_of_work import Repositories
from tests.conftest import ASYNC_DRIVERS, as_async_url, require_postgres

from . import surface_runs, surface_runtime, surface_sessions, surface_store
from .support import T0, Observer, open_astore
from .surface import CASES, Ctx, Entry, wipe

CASE_MODULES = (surface_runs, surface_sessions, surface_runtime, surface_store)

#: The attributes of a unit's runtime repository that are not operations: its
#: shared access and its parts, whose methods ``uow.runtime.<operation>`` forwards to.
RUNTIME_PARTS = frozenset(
    {
        "access",
        "boundaries",
        "finalization",
        "inputs",
        "lifecycle",
        "mob_hosts",
        "oauth",
        "outbox",
        "snapshots",
    }
)


@pytest.fixture(scope="module", params=ASYNC_DRIVERS)
def surface_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    """One migrated database per asyncio driver for the whole module (like ``async_url``).

    Each case starts by emptying it (:func:`~tests.aio.surface.wipe`): a
    migration per case would cost more than all the cases of a driver.
    """
    driver = str(request.param)
    if driver == "aiosqlite":
        url = f"sqlite:///{tmp_path_factory.mktemp('surface') / 'agentkeep.db'}"
        migrate.upgrade(url)
    else:
        require_postgres()
        url = request.getfixturevalue("_pg_session_url")
    return as_async_url(url, driver)


async def _run_case(url: str, operation: str, entry: Entry) -> None:
    clock = SettableClock(T0)
    astore = await open_astore(url, clock)
    try:
        with Observer(url) as seen:
            for mode in entry.modes:
                wipe(seen)
                clock.set(T0)
                await entry.case(Ctx(astore, url, clock, mode, seen))
                assert astore.engine.pool.checkedout() == 0, (operation, mode)
    finally:
        await astore.close()


@pytest.mark.parametrize("operation", sorted(CASES))
def test_async_operation(operation: str, surface_url: str) -> None:
    asyncio.run(_run_case(surface_url, operation, CASES[operation]))


# --------------------------------------------------------------------------
# Completeness


def _public(cls: type) -> set[str]:
    return {n for n in dir(cls) if not n.startswith("_")}


def _facades(tmp_path: Path) -> dict[str, type]:
    """The one-call facades of an AsyncStore: attribute name -> class."""

    async def look() -> dict[str, type]:
        astore = await AsyncStore.open(f"sqlite:///{tmp_path / 'x.db'}", migrate=True)
        try:
            return {
                name: type(getattr(astore, name))
                for name in AsyncStore.__slots__
                if isinstance(getattr(astore, name, None), aio._AsyncCalls)
            }
        finally:
            await astore.close()

    return asyncio.run(look())


def _repository_classes() -> dict[str, type]:
    """The repositories of a unit of work: attribute name -> class."""
    out: dict[str, type] = {}
    for name, value in inspect.getmembers(Repositories):
        if isinstance(value, property) and not name.startswith("_"):
            annotation = inspect.signature(value.fget).return_annotation  # type: ignore[arg-type]
            if isinstance(annotation, str):
                module = inspect.getmodule(Repositories)
                annotation = getattr(module, annotation, None)
            if isinstance(annotation, type):
                out[name] = annotation
    return out


def test_every_public_async_operation_has_a_case(tmp_path: Path) -> None:
    """Every public operation has a case that runs in the modes it exists in.

    * each operation of each one-call facade (``astore.runs``, ...,
      ``astore.runtime``): a case running in the ``"call"`` mode;
    * each method of each unit repository (``uow.runs``, ...): a case running in
      the ``"unit"`` mode (the runtime repository's parts excepted: the
      operations of ``uow.runtime`` are theirs);
    * ``AsyncStore``'s own methods (``store.<name>``) and the unit's own
      attributes (``unit.<name>``).
    """
    facades = _facades(tmp_path)
    assert set(facades) == set(_repository_classes())
    missing: list[str] = []
    for group, cls in facades.items():
        for name in _public(cls):
            entry = CASES.get(f"{group}.{name}")
            if entry is None or "call" not in entry.modes:
                missing.append(f"{group}.{name} (one-call)")
    for group, cls in _repository_classes().items():
        for name in _public(cls):
            if group == "runtime" and name in RUNTIME_PARTS:
                continue
            entry = CASES.get(f"{group}.{name}")
            if entry is None or "unit" not in entry.modes:
                missing.append(f"{group}.{name} (unit)")
    for name in _public(AsyncStore) - set(facades) - {"store", "engine", "native"}:
        if f"store.{name}" not in CASES:
            missing.append(f"store.{name}")
    unit_attrs = {n for n in _public(AsyncUnitOfWork)} | {"writable"}
    for name in unit_attrs - set(_repository_classes()):
        if f"unit.{name}" not in CASES:
            missing.append(f"unit.{name}")
    assert missing == [], f"async operations without a case in tests/aio/surface_*.py: {missing}"
    # and no case names an operation that does not exist
    known = {f"{g}.{n}" for g, cls in facades.items() for n in _public(cls)}
    known |= {f"{g}.{n}" for g, cls in _repository_classes().items() for n in _public(cls)}
    known |= {f"store.{n}" for n in _public(AsyncStore)} | {f"unit.{n}" for n in unit_attrs}
    assert sorted(set(CASES) - known) == []
