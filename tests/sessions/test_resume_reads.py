"""Resume reads that do not grow with the session: HeadScope, ActivePathScope(tail=N), totals.

* ``HeadScope()``: the head revision, leaf, config, frames, checkpoint and
  ledger totals, and no graph node; no graph statement runs.
* ``ActivePathScope(tail=N)``: the last N nodes of the active path, root-first;
  longer than the path is the whole path, ``tail=0`` is no node; branch
  switches and rewinds (the head's leaf moved by ``UnchangedGraph``) and an
  explicit leaf; a tombstoned ancestor stops it; the query returns at most N
  rows whatever the path's length; a parent cycle within the tail is corrupt.
* Ledger totals kept by the commit equal the ledger re-summed from every
  ``usage_deltas`` row, after many commits and after concurrent committers
  (threads with their own stores).
* Stored nodes are decoded without pydantic validation: a valid row decodes to
  the committed node; every corruption validation used to catch still makes the
  row undecodable (skipped, a warning logged once), on every read.
"""

from __future__ import annotations

import logging
import random
import threading
from typing import Any

import pytest
from sqlalchemy import text

from agentkeep.clock import SettableClock
from agentkeep.db import Driver
from agentkeep.errors import InvalidInput, SessionCorrupt
from agentkeep.migrations import upgrade
from agentkeep.sessions import commits as K
from agentkeep.sessions.records import (
    ActivePathScope,
    AppendNodes,
    FullGraphScope,
    HeadScope,
    HydratedSessionCheckpoint,
    PersistedSessionRead,
    SessionGraph,
    SessionNodeRecord,
    UnchangedGraph,
    UsageLedgerEntry,
)
from agentkeep.statements import Statement
from agentkeep.store import Store
from tests.racing import run_threads, wait_ready
from tests.support import execute_sql, explain, query

from .test_commits import SID, commit, hold, load, loaded, mk, node, usage


def ids(read: PersistedSessionRead) -> list[str]:
    return [n.node_id for n in read.graph.nodes]


def chain(prefix: str, n: int, parent: str | None = None) -> tuple[SessionNodeRecord, ...]:
    out = []
    for i in range(n):
        out.append(node(f"{prefix}{i}", parent))
        parent = f"{prefix}{i}"
    return tuple(out)


def tail(store: Store, n: int, leaf: str | None = None) -> list[str]:
    """The tail's ids, read in a snapshot unit; the one-call read (one statement
    from the head's leaf) must be the same read."""
    scope = ActivePathScope(leaf_node_id=leaf, tail=n)
    read = loaded(store, scope=scope)
    assert store.commits.load_session(SID, scope) == read
    if leaf is None and n > 0:  # the one-statement read (the one-call form's on Postgres)
        alone = store.call_read(lambda r: r.commits._load_tail_alone(SID, n), single_statement=True)
        assert alone == read
    return ids(read)


def statements_of(store: Store, call: Any) -> list[str]:
    """The names of the repository statements one call runs."""
    seen: list[str] = []
    real = Driver.execute

    def spy(self: Driver, stmt: Statement, params: Any = None) -> Any:
        seen.append(stmt.name)
        return real(self, stmt, params)

    Driver.execute = spy  # type: ignore[method-assign]
    try:
        call()
    finally:
        Driver.execute = real  # type: ignore[method-assign]
    return seen


# --------------------------------------------------------------------------
# HeadScope


def test_head_scope_is_the_full_read_without_nodes(store: Store) -> None:
    assert load(store, scope=HeadScope()) is None
    fence = hold(store)
    commit(
        store,
        mk(
            fence,
            nodes=chain("p", 5),
            usage_deltas=(usage(input_tokens=3), usage("other", output_tokens=2)),
        ).model_copy(
            update={
                "config": {"k": [1, 2]},
                "agent_frames": ({"f": 1},),
                "current_agent_frame_id": "f1",
                "checkpoint": HydratedSessionCheckpoint(turn_state={"t": 1}, tool_state=[1]),
            }
        ),
    )
    full = loaded(store)
    head = loaded(store, scope=HeadScope())
    assert head.graph == SessionGraph(nodes=(), leaf_node_id="p4")
    assert head == full.model_copy(update={"graph": head.graph})
    assert head.checkpoint is not None and head.checkpoint.tool_state == [1]
    assert [e.source for e in head.token_ledger] == ["src", "other"]

    names = statements_of(store, lambda: load(store, scope=HeadScope()))
    assert not {"sessions.full_graph", "sessions.active_path", "sessions.active_path_tail"} & set(
        names
    )
    assert "sessions.get_usage" not in names  # the ledger is the kept totals


def test_an_unknown_scope_is_refused(store: Store) -> None:
    with pytest.raises(InvalidInput):
        store.call_read(lambda r: r.commits.load_session(SID, "head"))  # type: ignore[arg-type]


# --------------------------------------------------------------------------
# ActivePathScope(tail=N)


def test_tail_is_the_end_of_the_active_path(store: Store) -> None:
    fence = hold(store)
    commit(store, mk(fence, nodes=chain("p", 10)))
    commit(store, mk(fence, nodes=chain("b", 3, parent="p4"), leaf="p9"))  # a side branch
    whole = [f"p{i}" for i in range(10)]
    assert tail(store, 3) == ["p7", "p8", "p9"]
    assert tail(store, 1) == ["p9"]
    assert tail(store, 10) == whole
    assert tail(store, 11) == whole  # longer than the path: the whole path
    assert tail(store, 10_000) == whole
    assert tail(store, 0) == []  # no node, the rest of the read as usual
    zero = loaded(store, scope=ActivePathScope(tail=0))
    assert zero == loaded(store, scope=HeadScope())
    assert tail(store, 4, leaf="b2") == ["p3", "p4", "b0", "b1", "b2"][-4:]
    assert tail(store, 2, leaf="missing") == []
    # every tail is the end of the full path
    full = ids(loaded(store, scope=ActivePathScope()))
    assert all(tail(store, n) == full[-n:] for n in range(1, 12))


def test_tail_follows_branch_switches_and_rewinds(store: Store) -> None:
    fence = hold(store)
    commit(store, mk(fence, nodes=chain("p", 6)))
    commit(store, mk(fence, nodes=chain("b", 4, parent="p2"), leaf="p5"))
    commit(store, mk(fence, graph=UnchangedGraph(leaf_node_id="b3")))  # switch branch
    assert tail(store, 3) == ["b1", "b2", "b3"]
    assert tail(store, 6) == ["p1", "p2", "b0", "b1", "b2", "b3"]
    commit(store, mk(fence, graph=UnchangedGraph(leaf_node_id="p1")))  # rewind
    assert tail(store, 5) == ["p0", "p1"]
    assert loaded(store, scope=HeadScope()).graph.leaf_node_id == "p1"
    commit(store, mk(fence, graph=UnchangedGraph(leaf_node_id=None)))
    assert tail(store, 5) == []


def test_a_tombstoned_ancestor_ends_the_tail(store: Store) -> None:
    fence = hold(store)
    commit(store, mk(fence, nodes=chain("p", 8)))
    execute_sql(store, "UPDATE graph_nodes SET tombstoned = 1 WHERE node_id = 'p4'")
    assert tail(store, 6) == ["p5", "p6", "p7"]
    assert tail(store, 2) == ["p6", "p7"]


def test_the_tail_query_reads_at_most_n_rows(store: Store) -> None:
    fence = hold(store)
    commit(store, mk(fence, nodes=chain("p", 1000)))
    for n in (1, 7, 64):
        rows = store.call_read(
            lambda r, n=n: r.driver.execute(
                K.ACTIVE_PATH_TAIL, {"sid": SID, "leaf": "p999", "n": n}
            ).fetchall()
        )
        assert [row[1] for row in rows] == [f"p{999 - k}" for k in range(n)]


def test_a_parent_cycle_within_the_tail_is_corrupt(store: Store) -> None:
    fence = hold(store)
    commit(store, mk(fence, nodes=chain("p", 6)))
    execute_sql(store, "UPDATE graph_nodes SET parent_node_id = 'p5' WHERE node_id = 'p3'")
    assert tail(store, 2) == ["p4", "p5"]  # the cycle (p5 -> p4 -> p3 -> p5) is not read
    for n in (3, 4, 50):  # the tail reads the whole cycle: the walk meets a node twice
        with pytest.raises(SessionCorrupt) as info:
            load(store, scope=ActivePathScope(tail=n))
        assert (info.value.table, info.value.column) == ("graph_nodes", "parent_node_id")
        with pytest.raises(SessionCorrupt) as info:  # the one-call read
            store.commits.load_session(SID, ActivePathScope(tail=n))
        assert (info.value.table, info.value.column) == ("graph_nodes", "parent_node_id")
        with pytest.raises(SessionCorrupt) as info:  # the one-statement read
            store.call_read(lambda r, n=n: r.commits._load_tail_alone(SID, n))
        assert (info.value.table, info.value.column) == ("graph_nodes", "parent_node_id")


def test_a_negative_tail_is_refused() -> None:
    with pytest.raises(ValueError):
        ActivePathScope(tail=-1)


# --------------------------------------------------------------------------
# Ledger totals


def resummed(store: Store, sid: str = SID) -> tuple[UsageLedgerEntry, ...]:
    rows = query(store, "SELECT * FROM usage_deltas WHERE session_id = :s ORDER BY seq", s=sid)
    entries = [
        UsageLedgerEntry(
            source=r["source"],
            model=r["model"],
            usage={k: r[k] for k in K._USAGE_FIELDS},  # type: ignore[arg-type]
        )
        for r in rows
    ]
    return K.merge_token_ledger(entries)


def test_totals_equal_the_resummed_ledger_after_many_commits(store: Store) -> None:
    rng = random.Random(14)
    fence = hold(store)
    pairs = [("a", "m1"), ("a", "m2"), ("b", "m1")]
    for _ in range(60):
        deltas = []
        for _ in range(rng.randrange(0, 4)):
            source, model = rng.choice(pairs)
            counts = {k: rng.choice([0, 0, rng.randrange(1, 10**6)]) for k in K._USAGE_FIELDS}
            deltas.append(usage(source, model, **counts))
        commit(store, mk(fence, usage_deltas=tuple(deltas)))
        assert loaded(store, scope=HeadScope()).token_ledger == resummed(store)
    ledger = loaded(store).token_ledger
    assert ledger == resummed(store) and len(ledger) == 3
    # a reasoning-only delta is not in the ledger (its total is 0)
    commit(store, mk(fence, usage_deltas=(usage("r", "m", reasoning_output_tokens=5),)))
    assert loaded(store).token_ledger == ledger


def test_totals_are_per_session(store: Store) -> None:
    fence = hold(store)
    other = hold(store, sid="other-session")
    commit(store, mk(fence, usage_deltas=(usage(input_tokens=1),)))
    commit(store, mk(other, sid="other-session", usage_deltas=(usage(input_tokens=5),)))
    assert loaded(store).token_ledger == resummed(store)
    assert loaded(store, "other-session").token_ledger == resummed(store, "other-session")
    assert loaded(store).token_ledger[0].usage.input_tokens == 1


def test_totals_of_concurrent_committers_equal_the_resummed_ledger(
    store: Store, db_url: str, clock: SettableClock
) -> None:
    fence = hold(store)
    workers, commits_each = 3, 15
    barrier = threading.Barrier(workers, timeout=120)

    def committer(i: int) -> int:
        with Store.open(db_url, clock=clock) as own:
            wait_ready(barrier)
            done = 0
            for k in range(commits_each):
                deltas = (
                    usage("shared", "m", input_tokens=1, output_tokens=k),
                    usage(f"w{i}", "m", cache_read_input_tokens=i + 1),
                )
                commit(own, mk(fence, usage_deltas=deltas))
                done += 1
            return done

    done = run_threads([(committer, (i,)) for i in range(workers)], 300.0)
    assert done == [commits_each] * workers
    ledger = loaded(store).token_ledger
    assert ledger == resummed(store)
    shared = next(e for e in ledger if e.source == "shared")
    assert shared.usage.input_tokens == workers * commits_each
    assert loaded(store).head_revision == workers * commits_each


# --------------------------------------------------------------------------
# Stored nodes decoded without validation


def test_a_stored_node_decodes_to_the_committed_node(store: Store) -> None:
    fence = hold(store)
    payload = {"text": "héllo ✓", "n": [1, 2.5, None, True, {"deep": [[]]}], "big": 2**62}
    nodes = (
        SessionNodeRecord(node_id="a", payload=payload),
        SessionNodeRecord(node_id="b", parent_node_id="a", timestamp=2**63 - 1, payload=[1]),
        SessionNodeRecord(node_id="c", parent_node_id="b"),
    )
    commit(store, mk(fence, graph=AppendNodes(nodes=nodes, leaf_node_id="c")))
    for scope in (FullGraphScope(), ActivePathScope(), ActivePathScope(tail=3)):
        got = loaded(store, scope=scope).graph.nodes
        assert got == nodes
        assert [n.model_dump() for n in got] == [n.model_dump() for n in nodes]
    assert store.call_read(lambda r: r.commits.load_node(SID, "a")) == nodes[0]


@pytest.mark.parametrize(
    "stored",
    [
        "{not json",
        "[1]",
        '"b"',
        '{"node_id":"b","parent_node_id":"a","timestamp":-1}',
        '{"node_id":"b","parent_node_id":"a","timestamp":9223372036854775808}',
        '{"node_id":"b","parent_node_id":"a","timestamp":true}',
        '{"node_id":"b","parent_node_id":"a","timestamp":1.5}',
        '{"node_id":"b","parent_node_id":5}',
        '{"node_id":"b","parent_node_id":"a","extra":1}',
        '{"node_id":"zz","parent_node_id":"a"}',
        '{"parent_node_id":"a"}',
        '{"node_id":"b","parent_node_id":"a","payload":NaN}',
        '{"node_id":"b","node_id":"b","parent_node_id":"a"}',
    ],
)
def test_a_corrupt_stored_node_is_still_caught(
    store: Store, stored: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(K, "_warned", set())  # warned once per row: a fresh record for this row
    fence = hold(store)
    commit(store, mk(fence, nodes=(node("a"), node("b", "a"), node("c", "b"))))
    execute_sql(store, "UPDATE graph_nodes SET node_json = :j WHERE node_id = 'b'", j=stored)
    with caplog.at_level(logging.WARNING, logger="agentkeep.sessions"):
        assert ids(loaded(store)) == ["a", "c"]
        assert ids(loaded(store, scope=ActivePathScope())) == ["a", "c"]
        assert ids(loaded(store, scope=ActivePathScope(tail=2))) == ["c"]
        assert store.call_read(lambda r: r.commits.load_node(SID, "b")) is None
    assert [r for r in caplog.records if "graph_nodes" in r.getMessage()]


def test_every_tail_step_is_a_unique_index_lookup_before_any_analyze(
    fresh_url: str, backend: str, clock: SettableClock
) -> None:
    """A fresh database's bulk of nodes, never analyzed: each step stays an index lookup.

    (A table analyzed while a session was small can still mislead the
    Postgres planner until autovacuum analyzes it again; docs/sessions.md.)
    """
    upgrade(fresh_url)
    with Store.open(fresh_url, clock=clock) as store:
        fence = hold(store)
        commit(store, mk(fence, nodes=chain("p", 3)))
        if backend == "postgres":
            numbers = "generate_series(1, 20000) AS i"
        else:
            numbers = (
                "(WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 20000)"
                " SELECT i FROM n)"
            )
        execute_sql(
            store,
            "INSERT INTO graph_nodes (session_id, node_id, parent_node_id, node_json, tombstoned) "
            f"SELECT :s, 'f' || i, 'p0', '{{}}', 0 FROM {numbers}",
            s=SID,
        )
        unique = "uq_graph_nodes_session_id_node_id" if backend == "postgres" else "autoindex"
        params = {"sid": SID, "leaf": "p2", "n": 2}
        with store.read() as uow:
            rows = explain(uow, K.ACTIVE_PATH_TAIL, params)
        plan = "\n".join(" ".join(str(v) for v in r) for r in rows)
        assert unique in plan, plan
        assert "tombstoned_seq" not in plan and "Seq Scan" not in plan, plan
        assert tail(store, 2) == ["p1", "p2"]
        # The one-call tail read: the same walk, from the head's leaf, in one statement.
        with store.read() as uow:
            rows = explain(uow, K._GET_HEAD_TOTALS_AND_TAIL, {"sid": SID, "n": 2})
        plan = "\n".join(" ".join(str(v) for v in r) for r in rows)
        assert unique in plan, plan
        assert "tombstoned_seq" not in plan, plan
        assert "Seq Scan on graph_nodes" not in plan and "SCAN graph_nodes" not in plan, plan


def test_a_walk_planned_on_a_small_session_stays_flat(
    fresh_url: str, backend: str, clock: SettableClock
) -> None:
    """Postgres: the walks' prepared plans, made while the session was small, do not grow.

    psycopg prepares a statement on its 5th run and Postgres then keeps one
    generic plan for it until the table is analyzed (never, here). Planned on
    a 3-node never-analyzed session, the tail's plain join scanned the whole
    session at every step. Counted by the heap rows one load reads
    (``pg_stat_xact_user_tables``, this transaction's counters, not a
    timing) after 20,000 more nodes: the tail reads a few rows per walked
    node; the whole path at most the session's nodes once (its plan hashes
    them) plus a few per walked node, never the session per step.
    """
    if backend != "postgres":
        pytest.skip("SQLite keeps no generic plan: the plan shape test above covers it")
    upgrade(fresh_url)
    counted = (
        "SELECT seq_tup_read + coalesce(idx_tup_fetch, 0) AS n "
        "FROM pg_stat_xact_user_tables WHERE relname = 'graph_nodes'"
    )
    added = 20_000
    walks = (
        (ActivePathScope(tail=2), ["p1", "p2"], 0),
        (ActivePathScope(), ["p0", "p1", "p2"], added + 3),
    )
    with Store.open(fresh_url, clock=clock) as store:
        # One connection for every unit (none parked), so that the store.read() below
        # runs on the connection whose prepared plans the one-call loads made.
        store._park = False
        fence = hold(store)
        commit(store, mk(fence, nodes=chain("p", 3)))
        for _ in range(12):  # past psycopg's prepare threshold and Postgres's 5 custom plans
            for scope, walked, _ in walks:
                assert ids(loaded(store, scope=scope)) == walked
        execute_sql(
            store,
            "INSERT INTO graph_nodes (session_id, node_id, parent_node_id, node_json, tombstoned) "
            f"SELECT :s, 'f' || i, 'p0', '{{}}', 0 FROM generate_series(1, {added}) AS i",
            s=SID,
        )
        for scope, walked, once in walks:
            with store.read() as uow:
                before = uow.connection.execute(text(counted)).scalar_one()
                got = uow.commits.load_session(SID, scope)
                after = uow.connection.execute(text(counted)).scalar_one()
            assert got is not None and ids(got) == walked
            assert after - before <= once + 4 * len(walked), (scope, after - before)


def _graph_rows(store: Store) -> list[Any]:
    return query(
        store,
        "SELECT seq, node_id, parent_node_id, node_json, tombstoned FROM graph_nodes "
        "WHERE session_id = :s ORDER BY seq",
        s=SID,
    )


# The thread method: a walk that does not stop runs inside SQLite's (or libpq's)
# C code, where a SIGALRM handler never gets to run; 30 s bounds it (and the rows
# it piles up) where a fixed walk takes milliseconds.
@pytest.mark.timeout(30, method="thread")
@pytest.mark.parametrize("shape", ["rho", "loop", "self"])
def test_a_parent_cycle_fails_a_huge_tail_at_once(store: Store, shape: str) -> None:
    """A cycle with ``tail=2**63-1``: the walk stops once it met a node twice (its
    Brent mark), not after ``tail`` steps, on both backends and every read form;
    SessionCorrupt, nothing changed. (Without the mark the walk ran until the
    timeout, holding every row it had walked.)"""
    fence = hold(store)
    commit(store, mk(fence, nodes=chain("p", 40)))
    # rho: p39 -> ... -> p10 -> p9 -> ... -> p3 -> p9 (a cycle entered after 30 steps);
    # loop: the root's parent is the leaf (the whole path is the cycle);
    # self: p0 is its own parent, 40 steps up.
    target, parent = {"rho": ("p3", "p9"), "loop": ("p0", "p39"), "self": ("p0", "p0")}[shape]
    execute_sql(
        store,
        "UPDATE graph_nodes SET parent_node_id = :parent WHERE node_id = :target",
        parent=parent,
        target=target,
    )
    before = _graph_rows(store)
    huge = 2**63 - 1
    for scope in (ActivePathScope(tail=huge), ActivePathScope(leaf_node_id="p39", tail=huge)):
        with pytest.raises(SessionCorrupt) as info:  # a snapshot unit (the walk alone)
            load(store, scope=scope)
        assert (info.value.table, info.value.column) == ("graph_nodes", "parent_node_id")
        with pytest.raises(SessionCorrupt) as info:  # the one-call read
            store.commits.load_session(SID, scope)
        assert (info.value.table, info.value.column) == ("graph_nodes", "parent_node_id")
    with pytest.raises(SessionCorrupt) as info:  # the one-statement read (head's leaf)
        store.call_read(lambda r: r.commits._load_tail_alone(SID, huge))
    assert (info.value.table, info.value.column) == ("graph_nodes", "parent_node_id")
    # The walk itself: every node of the path and cycle, a node met twice at most
    # once, fewer than three times the distinct nodes' count of rows.
    rows = store.call_read(
        lambda r: r.driver.execute(
            K.ACTIVE_PATH_TAIL, {"sid": SID, "leaf": "p39", "n": huge}
        ).fetchall()
    )
    walked = [row[1] for row in rows]
    distinct = 40 if shape != "rho" else 40 - 3
    assert len(set(walked)) == distinct, walked
    assert len(walked) < 3 * distinct, walked
    assert _graph_rows(store) == before
