"""Process racers of the runtime store's cross-process races (spawned children import this).

:func:`race` runs ``n`` spawned processes (:mod:`tests.racing`), each with its own
:class:`~agentkeep.store.Store` (``store_kwargs`` passed to ``Store.open``);
a body waits on the shared barrier before each round, so the racers of a
round start together. Bodies return plain picklable outcomes per round:
``("ok", value)`` or ``("<ErrorClass>", "<message>")`` (see :func:`attempt`).
Racer ``i`` plays role ``i`` where a race has two different operations.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from agentkeep.runtime import (
    InputStatePersistenceRecord,
    MachineLifecycleCommit,
    OpsSnapshot,
    RuntimeState,
    RuntimeStoreError,
    StoredInputState,
    UnregisterFinalizationCommit,
    issue_delete_ops_finalization_authority,
)
from agentkeep.store import Store
from tests import racing

from .builders import receipt

Outcome = tuple[str, Any]


def race(
    url: str,
    body: str,
    n: int,
    params: dict[str, Any],
    store_kwargs: dict[str, Any] | None = None,
) -> list[Any]:
    """Run this module's ``body(store, i, barrier, params)`` in ``n`` spawned processes."""
    setup = racing.Racing(processes=n, store_kwargs=store_kwargs or {})
    return racing.race_processes(setup, url, globals()[body], params)


def attempt(call: Callable[..., object], *args: Any) -> Outcome:
    """``("ok", call(*args))`` when it returns, else ``(error class name, str(error))``."""
    try:
        return ("ok", call(*args))
    except RuntimeStoreError as exc:
        return (type(exc).__name__, str(exc))


def finalization(epoch: str, state: RuntimeState = "stopped") -> UnregisterFinalizationCommit:
    """Unregister finalization to ``state`` (unbound binding, no inputs) retiring ``epoch``."""
    return UnregisterFinalizationCommit(
        lifecycle=MachineLifecycleCommit(runtime_state=state),
        input_states=(),
        retired_ops_epoch=epoch,
        authority=issue_delete_ops_finalization_authority(),
    )


# --------------------------------------------------------------------------
# Bodies (one list entry per round)


def body_same_receipt(store: Store, i: int, barrier: Any, p: dict[str, Any]) -> list[Outcome]:
    """(1) ``atomic_apply`` with the round's shared receipt key and this racer's own inputs."""
    out = []
    for rnd in p["rounds"]:
        inputs = [StoredInputState.new_accepted(iid) for iid in rnd["inputs"][i]]
        rcpt = receipt(1, rnd["run_id"])
        barrier.wait()
        out.append(
            attempt(
                store.runtime.atomic_apply, rnd["rt"], rnd["snapshot"], rcpt, inputs, rnd["key"]
            )
        )
    return out


def body_divergent_commit(store: Store, i: int, barrier: Any, p: dict[str, Any]) -> list[Outcome]:
    """(2) ``commit_session_snapshot`` of this racer's one-turn successor of the head."""
    out = []
    for rt, successors in p["rounds"]:
        barrier.wait()
        out.append(attempt(store.runtime.commit_session_snapshot, rt, successors[i]))
    return out


def body_divergent_rewrite(store: Store, i: int, barrier: Any, p: dict[str, Any]) -> list[Outcome]:
    """Racer ``i`` rewrites the shared head with its own commit (both name the same parent)."""
    out = []
    for rt, rewrites in p["rounds"]:
        snapshot, commit = rewrites[i]
        barrier.wait()
        out.append(
            attempt(store.runtime.commit_session_transcript_rewrite_snapshot, rt, snapshot, commit)
        )
    return out


def body_finalize_vs_replay(store: Store, i: int, barrier: Any, p: dict[str, Any]) -> list[Outcome]:
    """(3) Racer 0 finalizes the projection; racer 1 re-applies S-with-I under a new receipt."""
    out = []
    for rnd in p["rounds"]:
        barrier.wait()
        if i == 0:
            out.append(
                attempt(
                    store.runtime.mark_compaction_projection_finalized, rnd["rt"], rnd["projection"]
                )
            )
        else:
            rcpt = receipt(2, rnd["run_id"])
            out.append(
                attempt(
                    store.runtime.atomic_apply, rnd["rt"], rnd["snapshot"], rcpt, (), rnd["key"]
                )
            )
    return out


def _racing_a_commit(
    store: Store, i: int, barrier: Any, p: dict[str, Any], op: Callable[[dict[str, Any]], Outcome]
) -> list[Outcome]:
    """Per round: racer 0 runs ``op(round)``; racer 1 commits the round's X'."""
    out = []
    for rnd in p["rounds"]:
        barrier.wait()
        if i == 0:
            out.append(op(rnd))
        else:
            out.append(attempt(store.runtime.commit_session_snapshot, rnd["rt"], rnd["x2"]))
    return out


def body_replace_vs_commit(store: Store, i: int, barrier: Any, p: dict[str, Any]) -> list[Outcome]:
    """(4) Racer 0: ``replace_session_snapshot_if_current(X -> Y)``; racer 1: commit X'."""
    replace = store.runtime.replace_session_snapshot_if_current
    return _racing_a_commit(
        store, i, barrier, p, lambda rnd: attempt(replace, rnd["rt"], rnd["x"], rnd["y"])
    )


def body_clear_vs_commit(store: Store, i: int, barrier: Any, p: dict[str, Any]) -> list[Outcome]:
    """(5) Racer 0: ``clear_session_snapshot_if_current(X)``; racer 1: commit X'."""
    clear = store.runtime.clear_session_snapshot_if_current
    return _racing_a_commit(store, i, barrier, p, lambda rnd: attempt(clear, rnd["rt"], rnd["x"]))


def body_finalize_vs_persist(
    store: Store, i: int, barrier: Any, p: dict[str, Any]
) -> list[Outcome]:
    """(6) Racer 0 finalizes, retiring E; racer 1 persists a late ops snapshot at E."""
    out = []
    for rt in p["runtimes"]:
        fin = finalization(p["epoch"])
        late = OpsSnapshot(epoch_id=p["epoch"], payload={"late": True})
        barrier.wait()
        if i == 0:
            out.append(attempt(store.runtime.commit_unregister_finalization, rt, fin))
        else:
            out.append(attempt(store.runtime.persist_ops_lifecycle, rt, late))
    return out


def body_blocked_writer(store: Store, i: int, barrier: Any, p: dict[str, Any]) -> list[Any]:
    """(9) With the write lock held elsewhere: a read, three writes (each timed), another read."""
    barrier.wait()
    rt = p["rt"]
    state = StoredInputState.new_accepted(p["input_id"])
    results: list[Any] = [attempt(store.runtime.load_session_snapshot, rt)]
    for call in (
        lambda: store.runtime.atomic_apply(
            rt, p["successor"], receipt(1, p["run_id"]), [state], p["key"]
        ),
        lambda: store.runtime.persist_input_state(
            rt, InputStatePersistenceRecord.from_machine_snapshot(state)
        ),
        lambda: store.runtime.commit_unregister_finalization(rt, finalization(p["epoch"])),
    ):
        start = time.monotonic()
        results.append((attempt(call), time.monotonic() - start))
    results.append(attempt(store.runtime.load_session_snapshot, rt))
    return results
