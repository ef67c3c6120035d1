"""The OAuth flow singleton (spec runtime §1.7, §2.5–§2.7, §5.2 item 18).

Persist / load / update round trips; update always writes (a trigger that
aborts every UPDATE proves it); a raising callback propagates unchanged and
writes nothing (also a callback raising a store error: not retried, not
mapped); N threads and N spawned processes, each with its own Store,
incrementing a counter through update lose no increment. Every test runs on
SQLite and Postgres.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

import agentkeep
from agentkeep.errors import InvalidInput, ReadOnlyUnitOfWork, StoreBusy
from agentkeep.runtime.errors import WriteFailed
from agentkeep.store import Store

from .support import abort_trigger, increment, race_processes, raw_rows


def _rows(url: str) -> list[tuple[Any, ...]]:
    return raw_rows(url, "SELECT id, state_json FROM runtime_auth_oauth_flow_state")


def test_persist_load_and_update(store: Store, db_url: str) -> None:
    assert store.runtime.load_auth_oauth_flow_snapshot() is None
    seen: list[bytes | None] = []

    def first(current: bytes | None) -> bytes:
        seen.append(current)
        return b"flow-1"

    store.runtime.update_auth_oauth_flow_snapshot(first)
    assert seen == [None]
    assert store.runtime.load_auth_oauth_flow_snapshot() == b"flow-1"
    store.runtime.persist_auth_oauth_flow_snapshot(b"flow-2")
    assert store.runtime.load_auth_oauth_flow_snapshot() == b"flow-2"
    with store.write() as uow:
        uow.runtime.update_auth_oauth_flow_snapshot(lambda cur: (cur or b"") + b"+")
        assert uow.runtime.load_auth_oauth_flow_snapshot() == b"flow-2+"
        uow.runtime.persist_auth_oauth_flow_snapshot(b"flow-3")
    assert _rows(db_url) == [("auth_oauth_flow_state", b"flow-3")]


def test_update_always_writes_even_unchanged_bytes(backend: str, fresh_url: str) -> None:
    agentkeep.migrate(fresh_url)
    with Store.open(fresh_url) as store:
        store.runtime.persist_auth_oauth_flow_snapshot(b"same")
        with abort_trigger(fresh_url, backend, "runtime_auth_oauth_flow_state", "UPDATE"):
            with pytest.raises(WriteFailed, match="test trigger abort"):
                store.runtime.update_auth_oauth_flow_snapshot(lambda cur: b"same")
            with pytest.raises(WriteFailed, match="test trigger abort"):
                store.runtime.persist_auth_oauth_flow_snapshot(b"same")
        assert store.runtime.load_auth_oauth_flow_snapshot() == b"same"


class _Boom(Exception):
    pass


@pytest.mark.parametrize(
    "error",
    [_Boom("callback failed"), StoreBusy("callback says busy"), WriteFailed("callback refused")],
    ids=["plain", "store-busy", "write-failed"],
)
def test_raising_callback_propagates_unchanged_and_writes_nothing(
    store: Store, db_url: str, error: Exception
) -> None:
    store.runtime.persist_auth_oauth_flow_snapshot(b"before")
    calls: list[bytes | None] = []

    def update(current: bytes | None) -> bytes:
        calls.append(current)
        raise error

    with pytest.raises(type(error)) as raised:
        store.runtime.update_auth_oauth_flow_snapshot(update)
    assert raised.value is error
    assert calls == [b"before"]  # called once: a callback error is never retried
    with pytest.raises(type(error)) as raised, store.write() as uow:
        uow.runtime.update_auth_oauth_flow_snapshot(update)
    assert raised.value is error
    assert _rows(db_url) == [("auth_oauth_flow_state", b"before")]


def test_callback_returning_non_bytes_is_refused(store: Store, db_url: str) -> None:
    store.runtime.persist_auth_oauth_flow_snapshot(b"before")
    bad: Any = "text"
    with pytest.raises(InvalidInput):
        store.runtime.update_auth_oauth_flow_snapshot(lambda cur: bad)
    with pytest.raises(InvalidInput):
        store.runtime.persist_auth_oauth_flow_snapshot(bad)
    assert _rows(db_url) == [("auth_oauth_flow_state", b"before")]


def test_writes_need_a_write_unit(store: Store) -> None:
    with store.read() as uow:
        assert uow.runtime.load_auth_oauth_flow_snapshot() is None
        with pytest.raises(ReadOnlyUnitOfWork):
            uow.runtime.persist_auth_oauth_flow_snapshot(b"x")
        with pytest.raises(ReadOnlyUnitOfWork):
            uow.runtime.update_auth_oauth_flow_snapshot(increment)


def test_concurrent_thread_increments_lose_nothing(db_url: str) -> None:
    n_threads, k = 8, 10
    barrier = threading.Barrier(n_threads, timeout=60)
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            with Store.open(db_url) as own:
                barrier.wait()
                for _ in range(k):
                    own.runtime.update_auth_oauth_flow_snapshot(increment)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread
            barrier.abort()
            errors.append(exc)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "an updater thread hung"
    if errors:
        raise errors[0]
    with Store.open(db_url) as store:
        assert store.runtime.load_auth_oauth_flow_snapshot() == str(n_threads * k).encode()


@pytest.mark.slow
def test_concurrent_process_increments_lose_nothing(store: Store, db_url: str) -> None:
    race_processes(db_url, "body_oauth_increment", 4, {"k": 15})
    assert store.runtime.load_auth_oauth_flow_snapshot() == b"60"
