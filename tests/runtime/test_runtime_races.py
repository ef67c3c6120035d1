"""Cross-process races of the runtime store (spec runtime §5.2 items 1–6 and 9, §6.3).

Each race runs two ``spawn``-ed processes, each with its own Store, lined up
on a barrier for every round (one runtime per round); the parent sets the
rounds up, then checks that exactly one racer won where one must, that the
loser wrote nothing, and the invariant the fence guards. Item 9 holds the
write lock on a separate connection (SQLite ``BEGIN IMMEDIATE`` with an
uncommitted write; Postgres the runtime's advisory lock) while a spawned
writer with a 200 ms busy timeout and no retry meets it. Every test runs on
SQLite and Postgres.
"""

from __future__ import annotations

import sqlite3
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Final

import psycopg
from sqlalchemy import make_url

from agentkeep.db import LockNamespace, _key_hash
from agentkeep.runtime import MachineLifecycleCommit, Message, OpsSnapshot, RuntimeState
from agentkeep.store import Store

from ._workers_runtime import finalization, race
from .builders import (
    completed,
    encode,
    receipt,
    runtime_state,
    session_with_compaction_intent,
    user_session,
)

ROUNDS: Final = 4
EPOCH: Final = "epoch-e"
OK: Final = "ok"


def _rts(tag: str) -> list[str]:
    return [f"runtime-{tag}-{n}" for n in range(ROUNDS)]


def _by_round(results: list[list[Any]]) -> list[tuple[Any, ...]]:
    """Per round, the two racers' outcomes."""
    return list(zip(*results, strict=True))


# --------------------------------------------------------------------------
# (1) Double boundary, same receipt key


def test_same_receipt_key_exactly_one_boundary_wins(db_url: str) -> None:
    rounds: list[Any] = []
    for n, rt in enumerate(_rts("receipt")):
        # Even rounds carry no snapshot, odd ones the same snapshot bytes in both racers:
        # only the receipt key can separate them.
        head = user_session("hello") if n % 2 else None
        rounds.append(
            {
                "rt": rt,
                "run_id": str(uuid.uuid4()),
                "snapshot": encode(head) if head else None,
                "key": head.id if head else None,
                "inputs": [[str(uuid.uuid4()), str(uuid.uuid4())] for _ in range(2)],
            }
        )
    results = race(db_url, "body_same_receipt", 2, {"rounds": rounds})
    with Store.open(db_url) as store:
        for rnd, outcomes in zip(rounds, _by_round(results), strict=True):
            winners = [i for i, (kind, _) in enumerate(outcomes) if kind == OK]
            assert len(winners) == 1, outcomes
            (w,) = winners
            kind, message = outcomes[1 - w]
            assert kind == "WriteFailed", outcomes
            assert "runtime_boundary_receipts" in message
            stored = {s.input_id for s in store.runtime.load_input_states(rnd["rt"])}
            assert stored == set(rnd["inputs"][w])  # the winner's, none of the loser's
            assert store.runtime.load_boundary_receipt(rnd["rt"], rnd["run_id"], 1) == receipt(
                1, rnd["run_id"]
            )
            assert store.runtime.load_session_snapshot(rnd["rt"]) == rnd["snapshot"]
            assert len(runtime_state(db_url, rnd["rt"])["runtime_boundary_receipts"]) == 1


# --------------------------------------------------------------------------
# (2) Divergent snapshot writers


def test_divergent_snapshot_writers_one_wins(db_url: str) -> None:
    rounds: list[Any] = []
    with Store.open(db_url) as store:
        for rt in _rts("divergent"):
            head = user_session("shared head")
            store.runtime.commit_session_snapshot(rt, encode(head))
            successors = [encode(head.with_message("user", f"turn of racer {i}")) for i in (0, 1)]
            rounds.append((rt, successors))
    results = race(db_url, "body_divergent_commit", 2, {"rounds": rounds})
    with Store.open(db_url) as store:
        for (rt, successors), outcomes in zip(rounds, _by_round(results), strict=True):
            winners = [i for i, (kind, _) in enumerate(outcomes) if kind == OK]
            assert len(winners) == 1, outcomes
            (w,) = winners
            assert outcomes[1 - w][0] in ("WriteFailed", "GuardRejected"), outcomes
            assert outcomes[1 - w][1].startswith("Store write failed:")
            assert store.runtime.load_session_snapshot(rt) == successors[w]


def test_racing_transcript_rewrites_of_one_parent_one_wins(db_url: str) -> None:
    """The rewrite fence: two rewrites naming the same parent revision -> one wins, the other
    gets TranscriptRevisionConflict and the head is the winner's."""
    rounds: list[Any] = []
    with Store.open(db_url) as store:
        for rt in _rts("rewrite"):
            head = user_session("hello").with_message("assistant", "verbose answer")
            store.runtime.commit_session_snapshot(rt, encode(head))
            rewrites = []
            for i in (0, 1):
                rewritten, commit = head.rewrite(
                    1, 2, [Message(role="assistant", content=f"compact {i}")], actor=f"racer-{i}"
                )
                rewrites.append((encode(rewritten), commit))
            rounds.append((rt, rewrites))
    results = race(db_url, "body_divergent_rewrite", 2, {"rounds": rounds})
    with Store.open(db_url) as store:
        for (rt, rewrites), outcomes in zip(rounds, _by_round(results), strict=True):
            winners = [i for i, (kind, _) in enumerate(outcomes) if kind == OK]
            assert len(winners) == 1, outcomes
            (w,) = winners
            assert outcomes[1 - w][0] == "TranscriptRevisionConflict", outcomes
            assert store.runtime.load_session_snapshot(rt) == rewrites[w][0]


# --------------------------------------------------------------------------
# (3) Finalize racing a replay


def test_finalize_racing_replay_never_keeps_a_finalized_intent(db_url: str) -> None:
    rounds: list[Any] = []
    with Store.open(db_url) as store:
        for rt in _rts("finalize"):
            s, intent = session_with_compaction_intent()
            store.runtime.atomic_apply(rt, encode(s), receipt(1), (), s.id)
            assert store.runtime.load_pending_compaction_projections(rt) == [intent]
            rounds.append(
                {
                    "rt": rt,
                    "projection": intent.projection,
                    "snapshot": encode(s),
                    "key": s.id,
                    "run_id": str(uuid.uuid4()),
                    "clean": encode(completed(s)),
                }
            )
    results = race(db_url, "body_finalize_vs_replay", 2, {"rounds": rounds})
    with Store.open(db_url) as store:
        for rnd, (finalize, replay) in zip(rounds, _by_round(results), strict=True):
            rt = rnd["rt"]
            assert finalize == (OK, None), finalize
            if replay[0] == OK:  # the replay committed first; finalize then cleaned up
                assert store.runtime.load_boundary_receipt(rt, rnd["run_id"], 2) is not None
            else:  # finalize first: the replay is refused and wrote nothing
                assert replay[0] == "WriteFailed", replay
                assert "replays finalized compaction intent" in replay[1]
                assert store.runtime.load_boundary_receipt(rt, rnd["run_id"], 2) is None
            # Either order: the row is finalized and the intent is gone from the snapshot.
            assert store.runtime.load_pending_compaction_projections(rt) == []
            assert store.runtime.load_session_snapshot(rt) == rnd["clean"]
            outbox = runtime_state(db_url, rt)["runtime_compaction_projection_outbox"]
            assert [row[-1] for row in outbox] == ["finalized"]


# --------------------------------------------------------------------------
# (4) Replace-if-current racing a commit


def test_replace_if_current_racing_a_commit(db_url: str) -> None:
    rounds: list[Any] = []
    with Store.open(db_url) as store:
        for rt in _rts("replace"):
            x = user_session("head")
            store.runtime.commit_session_snapshot(rt, encode(x))
            rounds.append(
                {
                    "rt": rt,
                    "x": encode(x),
                    "y": encode(x.with_message("user", "repaired by replace")),
                    "x2": encode(x.with_message("user", "appended by commit")),
                }
            )
    results = race(db_url, "body_replace_vs_commit", 2, {"rounds": rounds})
    with Store.open(db_url) as store:
        for rnd, (replace, commit) in zip(rounds, _by_round(results), strict=True):
            head = store.runtime.load_session_snapshot(rnd["rt"])
            if replace == (OK, True):  # replace first: the commit's guard ran against Y
                assert commit[0] in ("WriteFailed", "GuardRejected"), commit
                assert head == rnd["y"]
            else:  # the commit first: the replace saw X' and changed nothing
                assert replace == (OK, False), replace
                assert commit == (OK, None), commit
                assert head == rnd["x2"]


# --------------------------------------------------------------------------
# (5) Clear-if-current racing a commit


def test_clear_if_current_racing_a_commit_keeps_quarantine_coherent(db_url: str) -> None:
    rounds: list[Any] = []
    with Store.open(db_url) as store:
        for rt in _rts("clear"):
            x = user_session("rejected turn")
            store.runtime.commit_session_snapshot(rt, encode(x))
            rounds.append(
                {"rt": rt, "x": encode(x), "x2": encode(x.with_message("user", "next turn"))}
            )
    results = race(db_url, "body_clear_vs_commit", 2, {"rounds": rounds})
    with Store.open(db_url) as store:
        for rnd, (clear, commit) in zip(rounds, _by_round(results), strict=True):
            # clear first: the commit is a first save and lifts the quarantine;
            # commit first: the clear sees X' and returns False. Either way:
            assert clear in ((OK, True), (OK, False)), clear
            assert commit == (OK, None), commit
            assert store.runtime.load_session_snapshot(rnd["rt"]) == rnd["x2"]
            assert store.runtime.is_runtime_projection_quarantined(rnd["rt"]) is False


# --------------------------------------------------------------------------
# (6) Finalization racing a late ops persist


def test_finalization_racing_late_ops_persist_leaves_no_retired_ops_row(db_url: str) -> None:
    runtimes = _rts("ops")
    with Store.open(db_url) as store:
        for rt in runtimes:
            store.runtime.commit_machine_lifecycle(rt, MachineLifecycleCommit(runtime_state="idle"))
            store.runtime.persist_ops_lifecycle(rt, OpsSnapshot(epoch_id=EPOCH))
    results = race(db_url, "body_finalize_vs_persist", 2, {"runtimes": runtimes, "epoch": EPOCH})
    final: RuntimeState = "stopped"
    with Store.open(db_url) as store:
        for rt, (fin, persist) in zip(runtimes, _by_round(results), strict=True):
            assert fin == (OK, None), fin
            # persist first (then deleted by the finalization), or refused after it.
            assert persist[0] in (OK, "OpsLifecycleEpochRetired"), persist
            assert store.runtime.load_ops_lifecycle(rt) is None
            assert store.runtime.load_runtime_state(rt) == final
            assert runtime_state(db_url, rt)["runtime_retired_ops_epochs"] == [(EPOCH,)]
        # The fence outlives the race: no late writer can bring epoch E back.
        rt = runtimes[0]
        store.runtime.commit_unregister_finalization(rt, finalization(EPOCH))
        assert store.runtime.load_ops_lifecycle(rt) is None


# --------------------------------------------------------------------------
# (9) Lock timeouts


@contextmanager
def _held_write_lock(backend: str, url: str, runtime_id: str) -> Iterator[None]:
    """Hold the runtime's write lock (with an uncommitted snapshot change) on another connection."""
    dirty = b'{"uncommitted": true}'
    if backend == "sqlite":
        path = make_url(url).database
        assert path is not None
        lite = sqlite3.connect(path, isolation_level=None)
        try:
            lite.execute("BEGIN IMMEDIATE")
            lite.execute(
                "UPDATE runtime_session_snapshots SET session_snapshot = ? WHERE runtime_id = ?",
                (dirty, runtime_id),
            )
            yield
            lite.rollback()
        finally:
            lite.close()
        return
    plain = make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(plain) as pg:
        pg.execute(
            "SELECT pg_advisory_xact_lock(%s, %s)", (LockNamespace.RUNTIME, _key_hash(runtime_id))
        )
        pg.execute(
            "UPDATE runtime_session_snapshots SET session_snapshot = %s WHERE runtime_id = %s",
            (dirty, runtime_id),
        )
        yield
        pg.rollback()


def test_writer_blocked_past_busy_timeout_fails_cleanly_while_reads_proceed(
    backend: str, db_url: str
) -> None:
    rt = "runtime-locked"
    head = user_session("committed head")
    with Store.open(db_url) as store:
        store.runtime.commit_session_snapshot(rt, encode(head))
        store.runtime.persist_ops_lifecycle(rt, OpsSnapshot(epoch_id=EPOCH))
    before = runtime_state(db_url, rt)
    params: dict[str, Any] = {
        "rt": rt,
        "key": head.id,
        "successor": encode(head.with_message("user", "blocked turn")),
        "run_id": str(uuid.uuid4()),
        "input_id": str(uuid.uuid4()),
        "epoch": EPOCH,
    }
    with _held_write_lock(backend, db_url, rt):
        (results,) = race(
            db_url,
            "body_blocked_writer",
            1,
            params,
            store_kwargs={"busy_timeout_ms": 200, "retry_attempts": 1},
        )
    first_read, *writes, last_read = results
    assert first_read == (OK, encode(head))  # the committed bytes, never the blocker's
    assert last_read == (OK, encode(head))
    for (kind, message), elapsed in writes:
        assert kind == "WriteFailed", (kind, message)
        assert "database is locked" in message or "lock timeout" in message
        assert 0.15 <= elapsed < 10.0  # it waited the 200 ms timeout, not the 30 s default
    assert runtime_state(db_url, rt) == before  # nothing partial
    with Store.open(db_url) as store:  # the lock released, the same writes go through
        store.runtime.atomic_apply(
            rt, params["successor"], receipt(1, params["run_id"]), (), params["key"]
        )
        store.runtime.commit_unregister_finalization(rt, finalization(EPOCH))
        assert store.runtime.load_session_snapshot(rt) == params["successor"]
        assert store.runtime.load_ops_lifecycle(rt) is None
