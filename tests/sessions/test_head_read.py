"""One-call resume reads are one statement outside a transaction (issue 14).

``store.commits.load_session(sid, HeadScope())`` reads the head, its manifest
blob and the ledger totals in one statement, and ``ActivePathScope(tail=N)``
adds the tail walked from the head's leaf to the same statement; a statement
is a snapshot by itself: no ``BEGIN`` / ``COMMIT`` on SQLite, one round trip
in autocommit mode on Postgres (psycopg, psycopg async). A checkpoint with component blobs needs
more statements from one snapshot: the read is then made again in a snapshot
unit. Checked here: the statements sent, the round trips on the wire, the
result equal to the snapshot read's, and readers racing a committer always
see a head, checkpoint and ledger of the same commit.
"""

from __future__ import annotations

import sqlite3
import threading
from typing import Any

import pytest

from agentkeep import Store
from agentkeep.sessions.domain import LeaseOwnerIdentity
from agentkeep.sessions.records import (
    ActivePathScope,
    HeadScope,
    HydratedSessionCheckpoint,
    PersistedSessionRead,
)
from tests.racing import run_threads

from .test_commits import SID, commit, hold, load, mk, node, usage
from .test_resume_reads import statements_of
from .test_round_trips import Trace, psycopg_async_calls

_OWNER = LeaseOwnerIdentity(owner_id="owner-hr", incarnation_id="inc-hr")


def _sqlite_log(store: Store) -> list[str]:
    """Every statement SQLite runs on the store's connections from now on (BEGIN, COMMIT too)."""
    log: list[str] = []
    make = store._driver

    def driver(raw: Any, **kwargs: Any) -> Any:
        made = make(raw, **kwargs)
        if isinstance(raw, sqlite3.Connection):
            raw.set_trace_callback(log.append)
        return made

    store._driver = driver  # type: ignore[method-assign]
    if store._parked:  # a parked connection and driver: traced too
        store._parked[0][1].raw.set_trace_callback(log.append)
    return log


def _turn(store: Store, fence: Any, turn: int, *, tool: bool) -> None:
    checkpoint = HydratedSessionCheckpoint(
        turn_state={"turn": turn}, tool_state={"turn": turn} if tool else None
    )
    commit(
        store,
        mk(
            fence,
            expected=turn,
            nodes=(node(f"n{turn}", None if turn == 0 else f"n{turn - 1}"),),
            # two totals, whose ordinals (src 0, other 1) are not their key order
            usage_deltas=(usage(input_tokens=1), usage("other", output_tokens=1)),
            checkpoint=checkpoint,
        ),
    )


SCOPES = {"head": HeadScope(), "tail": ActivePathScope(tail=2)}
ALONE = {"head": "sessions.get_head_and_totals", "tail": "sessions.get_head_totals_and_tail"}


@pytest.mark.parametrize("tool", [False, True], ids=["inline", "components"])
@pytest.mark.parametrize("kind", sorted(SCOPES))
def test_resume_read_is_one_statement_unless_the_checkpoint_has_components(
    store: Store, backend: str, tool: bool, kind: str
) -> None:
    scope = SCOPES[kind]
    fence = hold(store)
    assert store.commits.load_session(SID, scope) is None
    for turn in range(3):
        _turn(store, fence, turn, tool=tool)
    snapshot = load(store, scope=scope)  # the repository's read in a snapshot unit
    assert snapshot is not None
    assert [n.node_id for n in snapshot.graph.nodes] == ([] if kind == "head" else ["n1", "n2"])
    log = _sqlite_log(store) if backend == "sqlite" else []
    names = statements_of(store, lambda: store.commits.load_session(SID, scope))
    got = store.commits.load_session(SID, scope)
    assert got == snapshot
    assert got is not None and got.head_revision == 3
    assert got.checkpoint is not None and got.checkpoint.turn_state == {"turn": 2}
    assert got.checkpoint.tool_state == ({"turn": 2} if tool else None)
    assert [e.source for e in got.token_ledger] == ["src", "other"]
    assert got.token_ledger[0].usage.input_tokens == 3
    if kind == "tail" and backend == "sqlite":  # SQLite: the snapshot read (cheaper there)
        assert names == ["sessions.get_head_and_totals", "sessions.active_path_tail"] + (
            ["checkpoints.get_blob"] if tool else []
        )
        kinds = [sql.split()[0].upper() for sql in log]
        one = ["BEGIN", "SELECT", "WITH"] + (["SELECT"] if tool else []) + ["COMMIT"]
        assert kinds == one * 2, log  # the two reads above
        return
    if not tool:
        assert names == [ALONE[kind]]
    else:  # the lone statement, then the whole read in a snapshot
        assert names[0] == ALONE[kind] and names[1] == "sessions.get_head_and_totals"
        assert len(names) == (3 if kind == "head" else 4)
    if backend == "sqlite":
        kinds = [sql.split()[0].upper() for sql in log]
        if not tool:
            assert kinds == ["SELECT", "SELECT"], log
        else:
            assert kinds.count("BEGIN") == 2 and kinds.count("COMMIT") == 2, log
            assert kinds[0] == "SELECT", log  # the lone statement, outside a transaction


def _assert_consistent(read: PersistedSessionRead | None) -> None:
    """Head, checkpoint and ledger totals of one commit (turn ``t`` is revision ``t + 1``)."""
    if read is None:
        return
    turns = read.head_revision
    assert read.checkpoint is not None
    assert read.checkpoint.turn_state == {"turn": turns - 1}
    if read.checkpoint.tool_state_ref is not None:
        assert read.checkpoint.tool_state == {"turn": turns - 1}
    assert read.graph.leaf_node_id == f"n{turns - 1}"
    assert [e.source for e in read.token_ledger] == ["src", "other"]
    assert read.token_ledger[0].usage.input_tokens == turns
    expected = [f"n{t}" for t in range(max(0, turns - 2), turns)] if read.graph.nodes else []
    assert [n.node_id for n in read.graph.nodes] == expected


@pytest.mark.parametrize("tool", [False, True], ids=["inline", "components"])
@pytest.mark.parametrize("kind", sorted(SCOPES))
def test_resume_reads_racing_a_committer_see_one_commit(db_url: str, tool: bool, kind: str) -> None:
    scope = SCOPES[kind]
    turns = 30
    with Store.open(db_url) as writer:
        fence = hold(writer)
        done = threading.Event()

        def commit_all() -> int:
            try:
                for turn in range(turns):
                    _turn(writer, fence, turn, tool=tool)
            finally:
                done.set()
            return turns

        def read_all() -> int:
            seen = 0
            with Store.open(db_url) as reader:
                while not done.is_set() or seen == 0:
                    _assert_consistent(reader.commits.load_session(SID, scope))
                    seen += 1
                _assert_consistent(reader.commits.load_session(SID, scope))
            return seen

        results = run_threads([(commit_all, ()), (read_all, ()), (read_all, ())])
        assert results[0] == turns and all(n > 0 for n in results[1:])


def _head_round_trips(call: Any, trace: Trace) -> list[int]:
    """Round trips of a HeadScope and a tail read (inline checkpoint, then with components)."""
    out = call(lambda st: st.leases.try_claim_session_execution_lease(SID, _OWNER, 600_000))
    counts = []
    for turn, tool in enumerate((False, True)):
        rc = mk(
            out.lease,
            expected=turn,
            nodes=(node(f"n{turn}", None if turn == 0 else f"n{turn - 1}"),),
            checkpoint=HydratedSessionCheckpoint(
                turn_state={"turn": turn}, tool_state={"t": 1} if tool else None
            ),
        )
        call(lambda st, rc=rc: st.commits.commit_runtime_state(rc))
        for scope in (HeadScope(), ActivePathScope(tail=32)):
            with trace.round_trips() as trips:
                read = call(lambda st, scope=scope: st.commits.load_session(SID, scope))
            assert read.head_revision == turn + 1
            assert read.checkpoint.tool_state == ({"t": 1} if tool else None)
            counts.append(len(trips))
    return counts


def test_resume_reads_are_one_round_trip_on_psycopg(pg_url: str) -> None:
    with Store.open(pg_url) as store:
        trace = Trace(store.engine, store)
        head, tail, head_components, tail_components = _head_round_trips(
            lambda fn: fn(store), trace
        )
    assert head == tail == 1
    assert head_components > 1 and tail_components > 1  # the lone statement, then a snapshot


def test_resume_reads_are_one_round_trip_on_psycopg_async(pg_url: str) -> None:
    with psycopg_async_calls(pg_url) as (call, trace):
        head, tail, head_components, tail_components = _head_round_trips(call, trace)
    assert head == tail == 1
    assert head_components > 1 and tail_components > 1
