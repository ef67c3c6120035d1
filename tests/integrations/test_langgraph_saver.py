"""AgentkeepSaver with a real StateGraph, on SQLite and Postgres.

* a run, a restart (a new Store) and a resumed run continue one chain, on a
  sync Store and on a native AsyncStore (``ainvoke``, ``aowning``);
* ``owning``: two concurrent ``graph.invoke`` calls on one thread, each with
  its own Store and saver and each under ``owning``: exactly one completes,
  the other gets ``SessionLeaseHeld``, and the thread's history is one chain;
  the same race on the stock ``SqliteSaver`` forks the thread; the same with
  ``ainvoke`` under ``aowning`` on two native AsyncStores;
* a writer that does not own the thread is refused while another owns it,
  and writes nothing;
* a crashed owner's lease is reclaimed after its TTL; the old owner's next
  put is ``SessionExecutionLeaseExpired`` and leaves nothing;
* values are stored as the serializer's bytes; a corrupt checkpoint body
  fails loudly on read;
* a lost COMMIT answer is settled by running the idempotent write again;
* sync calls on a native AsyncStore from its own loop are refused.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("langgraph.graph")

from langgraph.checkpoint.sqlite import SqliteSaver  # noqa: E402

from agentkeep import (  # noqa: E402
    AsyncStore,
    CommitOutcomeUnknown,
    SessionCorrupt,
    SessionExecutionLeaseExpired,
    SessionLeaseHeld,
    Store,
)
from agentkeep.clock import SettableClock  # noqa: E402
from agentkeep.integrations.langgraph import AgentkeepSaver  # noqa: E402
from tests.conftest import as_async_url  # noqa: E402
from tests.integrations.langgraph_support import (  # noqa: E402
    build_async_graph,
    build_graph,
    chain_shape,
    config,
)
from tests.racing import run_threads, wait_ready  # noqa: E402
from tests.support import query  # noqa: E402

TID = "thread-1"
RENDEZVOUS_S = 60.0


def test_run_restart_resume(db_url: str) -> None:
    with Store.open(db_url) as store:
        saver = AgentkeepSaver(store)
        with saver.owning(TID):
            build_graph(saver).invoke({"messages": [("user", "hi")]}, config(TID))
    with Store.open(db_url) as store:  # a restart: a new Store, a new saver
        saver = AgentkeepSaver(store)
        graph = build_graph(saver)
        assert len(graph.get_state(config(TID)).values["messages"]) == 4
        with saver.owning(TID):
            graph.invoke({"messages": [("user", "again")]}, config(TID))
        state = graph.get_state(config(TID))
        assert [m.content for m in state.values["messages"]][-4:] == [
            "again",
            "plan 5",
            "act",
            "review",
        ]
        assert chain_shape(saver, TID) == (1, 0)
        assert len(list(graph.get_state_history(config(TID)))) == 10
        # The lease was released: another saver may own the thread now.
        with AgentkeepSaver(store).owning(TID):
            pass
        # Bodies are the serializer's bytes in opaque blobs.
        rows = query(store, "SELECT kind, compression FROM blobs")
        assert rows and {(r["kind"], r["compression"]) for r in rows} == {("opaque", "none")}


def test_async_store_run_restart_resume(db_url: str, backend: str) -> None:
    url = as_async_url(db_url, "aiosqlite" if backend == "sqlite" else "asyncpg")

    async def main() -> tuple[int, tuple[int, int]]:
        astore = await AsyncStore.open(url)
        try:
            saver = AgentkeepSaver(astore)
            async with saver.aowning(TID):
                await build_graph(saver).ainvoke({"messages": [("user", "hi")]}, config(TID))
        finally:
            await astore.close()
        astore = await AsyncStore.open(url)
        try:
            saver = AgentkeepSaver(astore)
            graph = build_graph(saver)
            async with saver.aowning(TID):
                await graph.ainvoke({"messages": [("user", "again")]}, config(TID))
            state = await graph.aget_state(config(TID))
            shape = await asyncio.to_thread(chain_shape, saver, TID)  # sync API off the loop
            return len(state.values["messages"]), shape
        finally:
            await astore.close()

    assert asyncio.run(main()) == (8, (1, 0))


def _owned_invoke(url: str, barrier: threading.Barrier, tried: threading.Event) -> str:
    """One racer: its own Store and saver; invoke under ``owning``.

    The winner's ``act`` node waits until the loser has tried, so the two
    runs overlap whatever the scheduling.
    """
    with Store.open(url) as store:
        saver = AgentkeepSaver(store)
        graph = build_graph(saver, hook=lambda: tried.wait(RENDEZVOUS_S))
        wait_ready(barrier)
        try:
            with saver.owning(TID):
                graph.invoke({"messages": [("user", "go")]}, config(TID))
        except SessionLeaseHeld:
            tried.set()
            return "refused"
        return "completed"


def test_owning_race_one_run_completes_and_the_thread_does_not_fork(db_url: str) -> None:
    barrier, tried = threading.Barrier(2), threading.Event()
    results = run_threads([(_owned_invoke, (db_url, barrier, tried))] * 2)
    assert sorted(results) == ["completed", "refused"]
    with Store.open(db_url) as store:
        saver = AgentkeepSaver(store)
        assert chain_shape(saver, TID) == (1, 0)
        assert len(build_graph(saver).get_state(config(TID)).values["messages"]) == 4


def _stock_invoke(path: Path, barrier: threading.Barrier) -> str:
    conn = sqlite3.connect(path, check_same_thread=False)
    try:
        graph = build_graph(SqliteSaver(conn), hook=lambda: barrier.wait(RENDEZVOUS_S))
        graph.invoke({"messages": [("user", "go")]}, config(TID))
        return "completed"
    finally:
        conn.close()


def test_the_same_race_forks_a_thread_on_the_stock_sqlite_saver(tmp_path: Path) -> None:
    """The comparison of docs/langgraph.md: no fence, so both runs write and the thread forks."""
    path = tmp_path / "stock.db"
    with sqlite3.connect(path) as conn:
        SqliteSaver(conn).setup()
    barrier = threading.Barrier(2)
    assert run_threads([(_stock_invoke, (path, barrier))] * 2) == ["completed", "completed"]
    conn = sqlite3.connect(path, check_same_thread=False)
    try:
        roots, forks = chain_shape(SqliteSaver(conn), TID)
    finally:
        conn.close()
    assert roots + forks > 1, "both runs wrote: two roots or a checkpoint with two children"


def test_a_writer_that_does_not_own_the_thread_is_refused(db_url: str) -> None:
    with Store.open(db_url) as owner_store, Store.open(db_url) as other_store:
        owner, other = AgentkeepSaver(owner_store), AgentkeepSaver(other_store)
        with owner.owning(TID):
            build_graph(owner).invoke({"messages": [("user", "mine")]}, config(TID))
            before = [t.config for t in other.list(config(TID))]
            with pytest.raises(SessionLeaseHeld):
                build_graph(other).invoke({"messages": [("user", "theirs")]}, config(TID))
            with pytest.raises(SessionLeaseHeld):
                with other.owning(TID):
                    pass
            assert [t.config for t in other.list(config(TID))] == before
        # Released: the other saver writes again, continuing the same chain.
        build_graph(other).invoke({"messages": [("user", "theirs")]}, config(TID))
        assert chain_shape(other, TID) == (1, 0)


def test_a_crashed_owner_is_reclaimed_after_the_ttl(db_url: str) -> None:
    clock = SettableClock(1_700_000_000_000)
    with Store.open(db_url, clock=clock) as a_store, Store.open(db_url, clock=clock) as b_store:
        crashed = AgentkeepSaver(a_store, lease_ttl_ms=5_000)
        block = crashed.owning(TID)
        block.__enter__()  # the owner "crashes": the block never exits, nothing releases
        build_graph(crashed).invoke({"messages": [("user", "before the crash")]}, config(TID))
        heir = AgentkeepSaver(b_store, lease_ttl_ms=5_000)
        with pytest.raises(SessionLeaseHeld):
            with heir.owning(TID):
                pass
        clock.advance(5_001)
        with heir.owning(TID):
            build_graph(heir).invoke({"messages": [("user", "taken over")]}, config(TID))
            history = [t.config for t in heir.list(config(TID))]
            # The crashed owner's late write is fenced off and leaves nothing.
            with pytest.raises(SessionExecutionLeaseExpired):
                build_graph(crashed).invoke({"messages": [("user", "late")]}, config(TID))
            assert [t.config for t in heir.list(config(TID))] == history
        assert chain_shape(heir, TID) == (1, 0)
        # The crashed block ending late releases nothing (its lease is gone).
        block.__exit__(None, None, None)
        with heir.owning(TID):
            pass


def test_a_corrupt_checkpoint_body_fails_loudly(store: Store) -> None:
    saver = AgentkeepSaver(store)
    build_graph(saver).invoke({"messages": [("user", "hi")]}, config(TID))
    with store.write() as uow:
        uow.connection.exec_driver_sql(
            "UPDATE blobs SET content = "
            + ("x'00ff'" if store.engine.name == "sqlite" else "'\\x00ff'::bytea")
        )
    with pytest.raises(SessionCorrupt):
        saver.get_tuple(config(TID))
    assert isinstance(saver.get_next_version(None, None), str)


def test_sync_calls_on_a_native_async_store_from_the_loop_are_refused(
    db_url: str, backend: str
) -> None:
    url = as_async_url(db_url, "aiosqlite" if backend == "sqlite" else "asyncpg")

    async def main() -> Any:
        astore = await AsyncStore.open(url)
        try:
            saver = AgentkeepSaver(astore)
            with pytest.raises(asyncio.InvalidStateError):
                saver.get_tuple(config(TID))
            return await asyncio.to_thread(saver.get_tuple, config(TID))
        finally:
            await astore.close()

    assert asyncio.run(main()) is None


def test_a_lost_commit_answer_is_settled_by_running_the_write_again(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The COMMIT went through but its answer was lost: the saver runs the write once
    more (its writes are idempotent), so the graph run goes on with one chain.

    Puts and pending writes run as one-call operations (``store.checkpoint_nodes``,
    through ``Store._call_operation``), whose lost answer is settled there by
    running them again."""
    real = store._call_operation
    lost: list[Any] = []
    guard = threading.Lock()
    retrying = threading.local()  # the retry runs next, on the thread whose answer was lost

    def flaky(fn: Any, **kw: Any) -> Any:
        result = real(fn, **kw)
        if getattr(retrying, "now", False):
            retrying.now = False
            return result
        with guard:  # the saver writes from LangGraph's background threads too
            first = len(lost) < 2
            if first:
                lost.append(fn)
        if first:  # applied, answer lost; the retry of this write gets through
            retrying.now = True
            raise CommitOutcomeUnknown("transaction", {}, "connection lost during COMMIT")
        return result

    monkeypatch.setattr(store, "_call_operation", flaky)
    saver = AgentkeepSaver(store)
    build_graph(saver).invoke({"messages": [("user", "hi")]}, config(TID))
    assert len(lost) == 2
    assert chain_shape(saver, TID) == (1, 0)
    assert len(list(saver.list(config(TID)))) == 5
    tup = saver.get_tuple(config(TID))
    assert tup is not None and len(tup.checkpoint["channel_values"]["messages"]) == 4


def test_aowning_race_one_run_completes_and_the_thread_does_not_fork(
    db_url: str, backend: str
) -> None:
    """The owning race with ``ainvoke`` under ``aowning``: two tasks, each with its own
    native AsyncStore and saver; the winner's ``act`` node waits until the loser tried."""
    url = as_async_url(db_url, "aiosqlite" if backend == "sqlite" else "asyncpg")

    async def main() -> list[str]:
        tried = asyncio.Event()
        stores = [await AsyncStore.open(url) for _ in range(2)]
        ready = asyncio.Barrier(2)

        async def racer(astore: AsyncStore) -> str:
            saver = AgentkeepSaver(astore)

            async def act_hook() -> None:
                await asyncio.wait_for(tried.wait(), RENDEZVOUS_S)

            graph = build_async_graph(saver, act_hook)
            await ready.wait()
            try:
                async with saver.aowning(TID):
                    await graph.ainvoke({"messages": [("user", "go")]}, config(TID))
            except SessionLeaseHeld:
                tried.set()
                return "refused"
            return "completed"

        try:
            return list(await asyncio.gather(*(racer(s) for s in stores)))
        finally:
            for s in stores:
                await s.close()

    assert sorted(asyncio.run(main())) == ["completed", "refused"]
    with Store.open(db_url) as store:
        assert chain_shape(AgentkeepSaver(store), TID) == (1, 0)
