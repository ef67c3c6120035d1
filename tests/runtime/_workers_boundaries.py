"""Process racers of the snapshot, outbox and boundary fences (spawned children import this).

:func:`race` runs ``n`` spawned processes (:mod:`tests.racing`), each with its own
:class:`~agentkeep.store.Store`; a body waits on the shared barrier before
each round, so the racers of a round start together. Bodies return plain
picklable outcomes per round. (The cross-operation races of spec §5.2 items
1–6 live in ``test_runtime_races.py`` / ``_workers_runtime.py``; this module
holds the races of one operation against itself.)
"""

from __future__ import annotations

from typing import Any

from agentkeep.store import Store
from tests import racing


def race(url: str, body: str, n: int, params: dict[str, Any]) -> list[Any]:
    """Run this module's ``body(store, i, barrier, params)`` in ``n`` spawned processes."""
    return racing.race_processes(racing.Racing(processes=n), url, globals()[body], params)


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
