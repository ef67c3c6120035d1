"""``sessions_0005``: graph_nodes and usage_deltas without AUTOINCREMENT, a partial run_id index.

The upgrade keeps every row and its ``seq``; afterwards a turn commit no
longer writes ``sqlite_sequence`` on SQLite, turn nodes (``run_id`` NULL) have
no entry in ``ix_graph_nodes_run_id``, the run deletes still search that
index, and a new row still sorts after every existing one. The downgrade lands
on exactly the schema of the revision before (AUTOINCREMENT and the full index
back), rows kept.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import text

from agentkeep import migrations as migrate
from agentkeep.sessions.domain import Acquired, LeaseOwnerIdentity
from agentkeep.sessions.records import (
    AppendNodes,
    FullGraphScope,
    RuntimeCommit,
    SessionNodeRecord,
    TokenUsage,
    UsageDelta,
)
from agentkeep.store import Store
from tests.support import plain_engine, raw_exec, raw_rows

BEFORE = "merge_0005"  # everything but sessions_0005
NODE = (
    "INSERT INTO graph_nodes (session_id, node_id, parent_node_id, node_json, run_id) "
    "VALUES (:sid, :nid, :parent, '{}', :run)"
)
USAGE = (
    "INSERT INTO usage_deltas (session_id, source, model, input_tokens, output_tokens, "
    "cache_read_input_tokens, cache_write_input_tokens, reasoning_output_tokens) "
    "VALUES (:sid, 'agent', 'm', :n, 0, 0, 0, 0)"
)
NODES = "SELECT seq, session_id, node_id, run_id FROM graph_nodes ORDER BY seq"
DELTAS = "SELECT seq, session_id, input_tokens FROM usage_deltas ORDER BY seq"


def shape(url: str, backend: str) -> list[tuple[Any, ...]]:
    """The two tables' columns, AUTOINCREMENT (SQLite) and indexes as the database reports them.

    On SQLite a rebuilt table's ``CREATE TABLE`` text differs in layout from
    one grown by ``ADD COLUMN``, so its columns come from ``table_info``.
    """
    if backend == "sqlite":
        out: list[tuple[Any, ...]] = []
        for table in ("graph_nodes", "usage_deltas"):
            out += raw_rows(
                url,
                f"SELECT name, type, \"notnull\", dflt_value, pk FROM pragma_table_info('{table}')",
            )
            ddl = raw_rows(
                url, f"SELECT sql FROM sqlite_master WHERE type = 'table' AND name = '{table}'"
            )
            out.append((table, "AUTOINCREMENT" in str(ddl[0][0])))
        return out + raw_rows(
            url,
            "SELECT name, sql FROM sqlite_master WHERE type = 'index' "
            "AND tbl_name IN ('graph_nodes', 'usage_deltas') ORDER BY name",
        )
    return raw_rows(
        url,
        "SELECT indexname, indexdef FROM pg_indexes "
        "WHERE tablename IN ('graph_nodes', 'usage_deltas') ORDER BY indexname",
    )


def run_index_is_searched(url: str, backend: str) -> bool:
    """Whether ``delete_nodes_for_runs``' ``run_id IN (...)`` searches the run_id index."""
    sql = "DELETE FROM graph_nodes WHERE run_id IN ('r1', 'r2', 'r1')"
    engine = plain_engine(url)
    try:
        with engine.begin() as conn:
            if backend == "sqlite":
                plan = " ".join(str(r[-1]) for r in conn.execute(text("EXPLAIN QUERY PLAN " + sql)))
            else:
                conn.execute(text("SET LOCAL enable_seqscan = off"))
                plan = " ".join(str(r[0]) for r in conn.execute(text("EXPLAIN " + sql)))
    finally:
        engine.dispose()
    return "ix_graph_nodes_run_id" in plan


def seed(url: str) -> None:
    rows = [("s1", "a", None, None), ("s2", "x", None, "r1"), ("s1", "b", "a", "r1")]
    rows += [("s1", "c", "b", None), ("s2", "y", "x", "r2")]
    for sid, nid, parent, run in rows:
        raw_exec(url, NODE, params={"sid": sid, "nid": nid, "parent": parent, "run": run})
    for sid, n in (("s1", 1), ("s2", 2), ("s1", 3)):
        raw_exec(url, USAGE, params={"sid": sid, "n": n})


def test_upgrade_keeps_rows_and_seq_then_downgrade_restores_the_shape(
    fresh_url: str, backend: str
) -> None:
    migrate.upgrade(fresh_url, BEFORE)
    seed(fresh_url)
    # The highest seq is freed before the upgrade: AUTOINCREMENT would skip it.
    raw_exec(fresh_url, "DELETE FROM graph_nodes WHERE node_id = 'y'")
    before_shape = shape(fresh_url, backend)
    nodes, deltas = raw_rows(fresh_url, NODES), raw_rows(fresh_url, DELTAS)
    assert len(nodes) == 4 and len(deltas) == 3

    migrate.upgrade(fresh_url)
    assert migrate.check(fresh_url) == []
    assert raw_rows(fresh_url, NODES) == nodes
    assert raw_rows(fresh_url, DELTAS) == deltas
    after_shape = shape(fresh_url, backend)
    assert after_shape != before_shape
    assert any(
        "WHERE" in str(row[-1]) and "run_id IS NOT NULL" in str(row[-1]) for row in after_shape
    )
    assert run_index_is_searched(fresh_url, backend)
    if backend == "sqlite":
        assert ("graph_nodes", False) in after_shape and ("usage_deltas", False) in after_shape
        assert ("graph_nodes", True) in before_shape and ("usage_deltas", True) in before_shape
        assert (
            raw_rows(
                fresh_url,
                "SELECT name FROM sqlite_sequence WHERE name IN ('graph_nodes', 'usage_deltas')",
            )
            == []
        )

    # A turn commit: its nodes sort after every existing row, its nodes carry no
    # run_id, and (SQLite) sqlite_sequence stays untouched.
    owner = LeaseOwnerIdentity(owner_id="o", incarnation_id="i")
    with Store.open(fresh_url) as store:
        got = store.leases.try_claim_session_execution_lease("s3", owner, 10**9)
        assert isinstance(got, Acquired)
        new = tuple(
            SessionNodeRecord(node_id=n, parent_node_id=p, timestamp=1, payload={"k": n})
            for n, p in (("t1", None), ("t2", "t1"))
        )
        store.commits.commit_runtime_state(
            RuntimeCommit(
                session_id="s3",
                session_execution_lease=got.lease,
                expected_head_revision=0,
                graph=AppendNodes(nodes=new, leaf_node_id="t2"),
                usage_deltas=(
                    UsageDelta(source="agent", model="m", usage=TokenUsage(input_tokens=5)),
                ),
            )
        )
        read = store.commits.load_session("s3", FullGraphScope())
        assert read is not None
        assert [n.node_id for n in read.graph.nodes] == ["t1", "t2"]
    top = max(seq for seq, *_ in nodes)
    added = raw_rows(fresh_url, NODES)[len(nodes) :]
    assert [(r[2], r[3]) for r in added] == [("t1", None), ("t2", None)]
    assert all(r[0] > top for r in added)
    assert raw_rows(fresh_url, DELTAS)[-1][0] > max(seq for seq, *_ in deltas)
    if backend == "sqlite":
        assert (
            raw_rows(fresh_url, "SELECT name FROM sqlite_sequence WHERE name = 'graph_nodes'") == []
        )
        # The partial index serves the run nodes (x and b)...
        assert raw_rows(
            fresh_url,
            "SELECT COUNT(*) FROM graph_nodes INDEXED BY ix_graph_nodes_run_id "
            "WHERE run_id IS NOT NULL",
        ) == [(2,)]

    added_nodes = raw_rows(fresh_url, NODES)
    added_deltas = raw_rows(fresh_url, DELTAS)
    assert migrate.downgrade(fresh_url, BEFORE) == (BEFORE,)
    assert shape(fresh_url, backend) == before_shape
    assert raw_rows(fresh_url, NODES) == added_nodes
    assert raw_rows(fresh_url, DELTAS) == added_deltas
    assert run_index_is_searched(fresh_url, backend)

    migrate.upgrade(fresh_url)
    assert shape(fresh_url, backend) == after_shape
    assert migrate.check(fresh_url) == []


def test_run_deletes_still_delete_only_their_runs(fresh_url: str) -> None:
    migrate.upgrade(fresh_url)
    seed(fresh_url)
    raw_exec(fresh_url, "DELETE FROM graph_nodes WHERE run_id IN ('r1', 'r1')")
    assert [r[2] for r in raw_rows(fresh_url, NODES)] == ["a", "c", "y"]
