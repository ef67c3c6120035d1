"""The table of the async surface suite (tests/aio/test_surface.py): cases, their context, checks.

Every public operation of :class:`~agentkeep.aio.AsyncStore` has one entry in
:data:`CASES`, keyed ``"<facade>.<operation>"`` (``"runs.try_transition"``,
``"store.call_write"``, ``"unit.connection"``, ...). An entry is an async
function of a :class:`Ctx` that sets up what it needs, runs the operation
through :meth:`Ctx.op` and checks its outcomes: the returned value, each
refusal outcome (a False, a ``Stale``, a None, ...) with the stored rows
unchanged (:meth:`Ctx.unchanged`), and the typed errors with the rows
unchanged (:meth:`Ctx.refused`).

Each case runs in every mode it lists (:data:`MODES`):

* ``"call"``: the one-call coroutine (``await astore.runs.try_transition(...)``);
* ``"unit"``: the same operation inside an async unit of work (``async with
  astore.write() as uow: await uow.runs.try_transition(...)``; reads in
  ``astore.read()``), one unit per call, so the repository method of the
  same name runs through :class:`~agentkeep.aio.AsyncRepository`.

A case written once is therefore checked on both paths. Setup calls use the
one-call facade directly (``c.astore``), never :meth:`Ctx.op`.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Final

import pytest
from sqlalchemy import make_url

from agentkeep.aio import AsyncStore
from agentkeep.base import load_all_models, table_applies
from agentkeep.clock import SettableClock
from agentkeep.runs.facade import RunCalls
from agentkeep.runtime.facade import RuntimeCalls
from agentkeep.sessions.facade import (
    CatalogCalls,
    CheckpointNodeCalls,
    LeaseCalls,
    MaintenanceCalls,
    QueueCalls,
    SessionCalls,
    TurnInputCalls,
)

from .support import Observer

MODES: Final = ("call", "unit")

#: The synchronous facade class of each async facade (whose forwarders say read or write).
SYNC_FACADES: Final[dict[str, type]] = {
    "runs": RunCalls,
    "leases": LeaseCalls,
    "queue": QueueCalls,
    "turn_inputs": TurnInputCalls,
    "commits": SessionCalls,
    "maintenance": MaintenanceCalls,
    "catalog": CatalogCalls,
    "checkpoint_nodes": CheckpointNodeCalls,
    "runtime": RuntimeCalls,
}

_READ_PREFIXES: Final = ("get", "load", "list", "is_", "ensure", "supports")


def reads(group: str, name: str) -> bool:
    """True when ``group.name`` is a read (its unit-mode call runs in ``astore.read()``).

    The synchronous forwarder's kind when it has one (``read(...)`` / ``write(...)``
    in the facade class), else the name (``load_*``, ``list_*``, ...).
    """
    facade = SYNC_FACADES.get(group)
    if facade is not None:
        kind = getattr(inspect.getattr_static(facade, name, None), "_kind", None)
        if kind is not None:
            return bool(kind == "read")
    return name.startswith(_READ_PREFIXES)


Case = Callable[["Ctx"], Awaitable[None]]


@dataclass(frozen=True)
class Entry:
    """One row of the table: the case and the modes it runs in."""

    case: Case
    modes: tuple[str, ...]


#: ``"<facade>.<operation>"`` -> its case (filled by :func:`covers`).
CASES: dict[str, Entry] = {}


def covers(operation: str, *, modes: tuple[str, ...] = MODES) -> Callable[[Case], Case]:
    """Register the decorated async function as the case of ``operation``."""

    def register(case: Case) -> Case:
        assert operation not in CASES, f"two cases for {operation}"
        CASES[operation] = Entry(case, modes)
        return case

    return register


@dataclass
class Ctx:
    """What a case gets: the store, its clock and URL, the mode, and the checks."""

    astore: AsyncStore
    url: str
    clock: SettableClock
    mode: str
    seen: Observer
    notes: list[str] = field(default_factory=list)

    def op(self, operation: str) -> Callable[..., Awaitable[Any]]:
        """The operation under test (``"runs.try_transition"``) in this context's mode."""
        group, name = operation.split(".")
        if self.mode == "call":
            fn: Callable[..., Awaitable[Any]] = getattr(getattr(self.astore, group), name)
            return fn
        astore = self.astore
        read = reads(group, name)

        async def in_unit(*args: Any, **kwargs: Any) -> Any:
            async with astore.read() if read else astore.write() as uow:
                assert uow.writable is not read
                return await getattr(getattr(uow, group), name)(*args, **kwargs)

        return in_unit

    def stored(self) -> dict[str, list[tuple[Any, ...]]]:
        """Every row of every agentkeep table, as committed (sorted: compare two of these)."""
        dialect = "sqlite" if is_sqlite_url(self.url) else "postgresql"
        out: dict[str, list[tuple[Any, ...]]] = {}
        for table in load_all_models().sorted_tables:
            if table_applies(table, dialect):
                rows = self.seen.rows(f'SELECT * FROM "{table.name}"')
                out[table.name] = sorted(rows, key=repr)
        return out

    async def unchanged(self, call: Awaitable[Any]) -> Any:
        """Await ``call`` (a refusal outcome); check that no stored row changed; return it."""
        before = self.stored()
        result = await call
        assert self.stored() == before, f"{result!r} changed stored rows"
        return result

    async def refused(
        self, error: type[BaseException] | tuple[type[BaseException], ...], call: Awaitable[Any]
    ) -> Any:
        """Await ``call``; check it raises ``error`` and that no stored row changed."""
        before = self.stored()
        with pytest.raises(error) as info:
            await call
        assert self.stored() == before, f"{info.value!r} left stored rows changed"
        return info.value


def is_sqlite_url(url: str) -> bool:
    return make_url(url).get_backend_name() == "sqlite"


def wipe(seen: Observer) -> None:
    """Delete every agentkeep row, in one transaction (no store transaction may be open)."""
    dialect = "sqlite" if is_sqlite_url(seen.url) else "postgresql"
    seen.execute(
        *(
            f'DELETE FROM "{table.name}"'
            for table in reversed(load_all_models().sorted_tables)
            if table_applies(table, dialect)
        )
    )
