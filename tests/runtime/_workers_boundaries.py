"""Process racers of the snapshot, outbox and boundary fences (spawned children import this).

:func:`race` runs ``n`` spawned processes, each with its own
:class:`~agentkeep.store.Store`; a body waits on the shared barrier before
each round, so the racers of a round start together. Bodies return plain
picklable outcomes per round. (The cross-operation races of spec §5.2 items
1–6 live in ``test_runtime_races.py`` / ``_workers_runtime.py``; this module
holds the races of one operation against itself.)
"""

from __future__ import annotations

import multiprocessing
from typing import Any, Final

from agentkeep.store import Store

BARRIER_TIMEOUT_S: Final = 60.0
JOIN_TIMEOUT_S: Final = 180.0

_BARRIER: Any = None


def _init(barrier: Any) -> None:
    global _BARRIER
    _BARRIER = barrier


def _entry(args: tuple[str, str, int, dict[str, Any]]) -> Any:
    body, url, i, params = args
    try:
        store = Store.open(url)
    except BaseException:
        _BARRIER.abort()
        raise
    try:
        return globals()[body](store, i, _BARRIER, params)
    except BaseException:
        _BARRIER.abort()  # never leave the other racers waiting
        raise
    finally:
        store.close()


def race(url: str, body: str, n: int, params: dict[str, Any]) -> list[Any]:
    """Run ``body(store, i, barrier, params)`` in ``n`` spawned processes; their results."""
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(n, timeout=BARRIER_TIMEOUT_S)
    pool = ctx.Pool(n, initializer=_init, initargs=(barrier,))
    try:
        tasks = [(body, url, i, params) for i in range(n)]
        return list(pool.map_async(_entry, tasks, chunksize=1).get(JOIN_TIMEOUT_S))
    finally:
        pool.terminate()
        pool.join()


def body_replace_if_current(store: Store, i: int, barrier: Any, p: dict[str, Any]) -> list[Any]:
    """Per round: ``replace_session_snapshot_if_current(rt, expected, this racer's one)``."""
    out: list[Any] = []
    for rnd in p["rounds"]:
        barrier.wait()
        out.append(
            store.runtime.replace_session_snapshot_if_current(
                rnd["rt"], rnd["expected"], rnd["replacements"][i]
            )
        )
    return out


def body_clear_if_current(store: Store, i: int, barrier: Any, p: dict[str, Any]) -> list[bool]:
    """Per round: ``clear_session_snapshot_if_current(rt, expected)`` (same bytes for all)."""
    out = []
    for rnd in p["rounds"]:
        barrier.wait()
        out.append(store.runtime.clear_session_snapshot_if_current(rnd["rt"], rnd["expected"]))
    return out
