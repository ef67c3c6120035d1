"""Blob GC racing session commits (spec sessions §4.12, §6.2, I-13), both backends.

Commits hold the blob-GC lock shared from before they insert their blobs until
their head is committed; GC holds it exclusive (on SQLite the database write
lock of ``BEGIN IMMEDIATE`` does both). So a GC never runs between a commit's
blob insert and its head write, and a committed head never names a collected
blob.

* A GC loop in one process (or thread) while another commits checkpoints to
  two sessions, each commit with new component blobs, some with a turn-commit
  stamp, and one component that alternates between two values (so a commit
  re-inserts a blob a GC may just have collected: ``INSERT … ON CONFLICT DO
  NOTHING`` must not meet a blob being deleted). Afterwards every head and
  every turn-commit record hydrates with no component missing, and the GCs
  did collect garbage meanwhile (the race was real).
* A GC paused between its mark and its sweep: a commit started meanwhile
  cannot finish before the GC does (it waits for the lock), so the sweep
  cannot delete the commit's fresh blobs. Without the lock, on Postgres, the
  commit would finish inside the pause and the sweep would delete its blobs.

Every racer opens its own :class:`Store` from the URL (processes use the
``spawn`` context), then waits for the other (:func:`tests.racing.wait_ready`),
so the GC loop's run bound and the committer's waits count from a common
start, not from a sibling's start-up. Commits are real
(``commit_runtime_state`` under a lease); time is a :class:`SettableClock`;
every loop is bounded.

Checked by hand: with the GC's exclusive lock removed, the paused case fails
on Postgres every time (the commit does not wait) and the loop cases in most
runs (a head's or turn commit's checkpoint is collected).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from sqlalchemy import text

from agentkeep.clock import SettableClock
from agentkeep.sessions.checkpoints import get_checkpoint
from agentkeep.sessions.domain import Acquired, LeaseOwnerIdentity
from agentkeep.sessions.maintenance import MaintenanceRepository
from agentkeep.sessions.records import (
    HydratedSessionCheckpoint,
    RuntimeCommit,
    RuntimeCommitResult,
    TurnCommitStamp,
)
from agentkeep.store import Store
from tests.racing import SPAWN, run_processes, run_threads, wait_ready

T0 = 1_700_000_000_000
SESSIONS = ("gc-race-a", "gc-race-b")
OWNER = LeaseOwnerIdentity(owner_id="committer", incarnation_id="inc-1")
TTL = 3_600_000
N_COMMITS = 30
MAX_GC_RUNS = 5_000
JOIN_TIMEOUT_S = 120.0
WAIT_S = 30.0
GC_PAUSE_S = 0.002
_WAITING_FOR_ADVISORY = text(
    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
)


# --------------------------------------------------------------------------
# Racer bodies (module level so that spawned children can import them)


def _checkpoint(i: int) -> HydratedSessionCheckpoint:
    return HydratedSessionCheckpoint(
        turn_state={"i": i},
        tool_state={"tools": i, "pad": "x" * 64},
        plugin_snapshot={"plugins": i},
        plugin_snapshot_revision=i,
        execution_state={"phase": i % 2},  # recurs: re-inserted after it was collected
    )


def _commit(store: Store, sid: str, i: int) -> RuntimeCommitResult:
    got = store.leases.try_claim_session_execution_lease(sid, OWNER, TTL)
    assert isinstance(got, Acquired), got
    stamp = (
        TurnCommitStamp(session_id=sid, turn_id=f"turn-{i}", turn_commit_hash=f"h{i}")
        if i % 3 == 0
        else None
    )
    rc = RuntimeCommit(
        session_id=sid,
        session_execution_lease=got.lease,
        checkpoint=_checkpoint(i),
        turn_commit=stamp,
    )
    return store.call_write(lambda r: r.commits.commit_runtime_state(rc))


def committer(url: str, ev: dict[str, Any]) -> list[str]:
    """Commit N_COMMITS checkpoints while the GC loop runs; return their refs.

    Before each commit it waits until a GC run ended since the previous one
    (``ev["ran"]``), so GC runs and commits interleave all along; the GC loop
    keeps running meanwhile, so commits still overlap GC runs.
    """
    store = Store.open(url, clock=SettableClock(T0))
    refs = []
    try:
        wait_ready(ev["ready"])
        for i in range(N_COMMITS):
            assert ev["ran"].wait(WAIT_S), "the GC loop stopped running"
            ev["ran"].clear()
            refs.append(_commit(store, SESSIONS[i % 2], i).checkpoint_ref)
        return refs
    finally:
        ev["done"].set()
        store.close()


def gc_loop(url: str, ev: dict[str, Any]) -> tuple[int, int]:
    """Run the strict GC until the committer is done; return (runs, blobs deleted)."""
    store = Store.open(url, clock=SettableClock(T0))
    runs = deleted = 0
    try:
        wait_ready(ev["ready"])
        for _ in range(MAX_GC_RUNS):
            finished = ev["done"].is_set()  # the last run starts after the last commit
            report = store.call_write(lambda r: r.maintenance.gc_unreachable_strict())
            runs += 1
            deleted += report.deleted_blob_count
            ev["ran"].set()
            if finished:
                break
            # Pace the loop (it never waits for time to pass): a GC that takes the
            # SQLite write lock back at once would starve the committer.
            ev["done"].wait(GC_PAUSE_S)
        else:
            raise AssertionError("the GC loop hit its bound before the commits ended")
        return runs, deleted
    finally:
        ev["ran"].set()
        store.close()


def _run_body(name: str, url: str, ev: dict[str, Any]) -> Any:
    try:
        return globals()[name](url, ev)
    except BaseException:
        ev["ready"].abort()  # never leave the other racer waiting
        ev["ran"].set()
        ev["done"].set()
        raise


def run_race(kind: str, url: str) -> tuple[list[str], tuple[int, int]]:
    """Run ``gc_loop`` and ``committer`` side by side; return their results."""
    names = ("gc_loop", "committer")
    if kind == "processes":
        ev = {"ready": SPAWN.Barrier(2), "ran": SPAWN.Event(), "done": SPAWN.Event()}
        gc, commits = run_processes([(_run_body, (n, url, ev)) for n in names], JOIN_TIMEOUT_S)
    else:
        t_ev = {"ready": threading.Barrier(2), "ran": threading.Event(), "done": threading.Event()}
        gc, commits = run_threads([(_run_body, (n, url, t_ev)) for n in names], JOIN_TIMEOUT_S)
    return commits, gc


def assert_every_root_hydrates(store: Store) -> int:
    """Every head's and turn commit's checkpoint is present with all its components."""
    with store.read() as uow:
        refs = [
            r
            for (r,) in uow.connection.execute(
                text(
                    "SELECT checkpoint_ref FROM session_head "
                    "UNION SELECT checkpoint_ref FROM runtime_turn_commits"
                )
            )
        ]
        for ref in refs:
            ck = get_checkpoint(uow.driver, ref)
            assert ck is not None, f"checkpoint {ref} was collected"
            assert None not in (ck.tool_state, ck.plugin_snapshot, ck.execution_state), (
                f"a component of {ref} was collected"
            )
    return len(refs)


# --------------------------------------------------------------------------
# Tests


@pytest.mark.parametrize("kind", ["threads", "processes"])
def test_gc_loop_beside_commits_never_collects_a_committed_blob(
    store: Store, db_url: str, kind: str
) -> None:
    refs, (runs, deleted) = run_race(kind, db_url)
    assert len(refs) == N_COMMITS and runs > N_COMMITS
    # The GCs collected superseded checkpoints while the commits ran.
    assert deleted > 0
    n_turn_commits = len(range(0, N_COMMITS, 3))
    assert assert_every_root_hydrates(store) == len(SESSIONS) + n_turn_commits
    # Heads are the last commit of each session; replays of recorded turns hydrate.
    with store.read() as uow:
        heads = uow.connection.execute(text("SELECT checkpoint_ref FROM session_head")).all()
    assert {r for (r,) in heads} == {refs[-1], refs[-2]}
    for i in range(0, N_COMMITS, 3):
        replay = _commit(store, SESSIONS[i % 2], i)
        assert replay.checkpoint_ref == refs[i]
    # A final GC keeps exactly the roots' blobs: nothing reachable is missing, nothing extra.
    report = store.call_write(lambda r: r.maintenance.gc_unreachable_strict())
    assert report.root_count == len(SESSIONS) + n_turn_commits
    assert_every_root_hydrates(store)


def test_a_commit_cannot_finish_while_gc_is_between_mark_and_sweep(
    store: Store, db_url: str, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    sid = SESSIONS[0]
    _commit(store, sid, 1)  # an older head, soon garbage
    marked, go = threading.Event(), threading.Event()
    order: list[str] = []
    original = MaintenanceRepository._sweep

    def paused_sweep(
        self: MaintenanceRepository, marks: set[str], progress: Any = None
    ) -> tuple[int, int]:
        marked.set()
        assert go.wait(WAIT_S)
        result = original(self, marks, progress)
        order.append("sweep")
        return result

    monkeypatch.setattr(MaintenanceRepository, "_sweep", paused_sweep)
    gc_store = Store.open(db_url, clock=SettableClock(T0))
    commit_store = Store.open(db_url, clock=SettableClock(T0))
    results: dict[str, Any] = {}
    errors: list[BaseException] = []

    def run(name: str, fn: Any) -> None:
        try:
            results[name] = fn()
            order.append(name)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread
            errors.append(exc)
            go.set()

    gc = threading.Thread(
        target=run,
        args=("gc", lambda: gc_store.call_write(lambda r: r.maintenance.gc_unreachable_strict())),
    )
    committing = threading.Thread(
        target=run, args=("commit", lambda: _commit(commit_store, sid, 2))
    )
    try:
        gc.start()
        assert marked.wait(WAIT_S), "the GC never reached its sweep"
        committing.start()
        if backend == "postgres":
            # Bounded poll: the commit is queued behind the GC's exclusive lock.
            for _ in range(3_000):
                with store.read() as uow:
                    waiting = uow.connection.execute(_WAITING_FOR_ADVISORY).scalar_one()
                if waiting or not committing.is_alive():
                    break
                time.sleep(0.005)
            assert waiting, "the commit never waited for the GC lock"
        else:
            committing.join(0.3)  # SQLite: BEGIN IMMEDIATE waits for the GC's unit
        assert committing.is_alive(), "the commit finished while GC held its lock"
        go.set()
        gc.join(JOIN_TIMEOUT_S)
        committing.join(JOIN_TIMEOUT_S)
        assert not gc.is_alive() and not committing.is_alive()
        if errors:
            raise errors[0]
    finally:
        go.set()
        gc_store.close()
        commit_store.close()
    assert order.index("sweep") < order.index("commit")
    new_ref = results["commit"].checkpoint_ref
    assert_every_root_hydrates(store)
    with store.read() as uow:
        assert get_checkpoint(uow.driver, new_ref) is not None
    # The GC ran on the state before the commit: the older head's blobs were then still roots.
    assert results["gc"].deleted_blob_count == 0
