"""LangGraph's checkpointer conformance suite reports FULL for AgentkeepSaver.

Runs ``langgraph-checkpoint-conformance`` (every capability: the base five and
the extended three the saver implements) against the saver on a sync
:class:`~agentkeep.Store` and on a native :class:`~agentkeep.AsyncStore`, on
each backend (SQLite: pysqlite / aiosqlite; Postgres: psycopg / asyncpg). The
report is printed (``-s`` shows it) and every capability must be detected and
pass.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

pytest.importorskip("langgraph.checkpoint.conformance")

from langgraph.checkpoint.conformance import checkpointer_test, validate  # noqa: E402
from langgraph.checkpoint.conformance.capabilities import ALL_CAPABILITIES  # noqa: E402

from agentkeep import AsyncStore, Store  # noqa: E402
from agentkeep.integrations.langgraph import AgentkeepSaver  # noqa: E402
from tests.conftest import as_async_url  # noqa: E402

ASYNC_DRIVER = {"sqlite": "aiosqlite", "postgres": "asyncpg"}


@pytest.mark.parametrize("mode", ["store", "async_store"])
def test_conformance_reports_full(db_url: str, backend: str, mode: str) -> None:
    stores: list[Store | AsyncStore] = []

    async def saver() -> AsyncIterator[AgentkeepSaver]:
        if mode == "store":
            store: Store | AsyncStore = Store.open(db_url)
        else:
            store = await AsyncStore.open(as_async_url(db_url, ASYNC_DRIVER[backend]))
        stores.append(store)
        yield AgentkeepSaver(store)

    registered = checkpointer_test(name=f"AgentkeepSaver[{backend}, {mode}]")(saver)

    async def run() -> object:
        try:
            return await validate(registered)
        finally:
            for s in stores:
                if isinstance(s, AsyncStore):
                    await s.close()
                else:
                    s.close()

    report = asyncio.run(run())
    report.print_report()  # type: ignore[attr-defined]
    results = report.results  # type: ignore[attr-defined]
    assert set(results) == {c.value for c in ALL_CAPABILITIES}
    for name, result in results.items():
        assert result.detected, f"{name} not detected"
        assert result.passed, f"{name}: {result.failures}"
    assert report.conformance_level() == "FULL"  # type: ignore[attr-defined]
