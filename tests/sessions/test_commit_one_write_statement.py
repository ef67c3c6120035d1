"""The turn commit's writes as one statement on Postgres (``commits._put_turn``).

On Postgres a commit that appends at most ``_NODES_PER_INSERT`` nodes sends
its folded ledger write, its node insert and its head upsert (with the
checkpoint blobs) as one statement of data-modifying CTEs; a longer append,
a full replacement or an unfolded ledger keeps the separate statements.
SQLite runs the separate statements always. These tests hold on both
backends:

* every shape (no node, one, the most one insert carries, one more; no
  usage, a zero delta, a folded ledger of four pairs, an unfolded one of
  five deltas; a replacement) commits and reads back exactly what was
  committed;
* the statement's two checks, in step order: a node id that exists is
  ``NodeAlreadyExists`` even when the head fence misses too, and a head
  fence that misses (the revision read under the lock is made stale here,
  as a writer bypassing the lock would) is ``ConcurrentModification``;
  either way nothing of the commit is left.
"""

from __future__ import annotations

from typing import Any

import pytest

from agentkeep.errors import ConcurrentModification, NodeAlreadyExists
from agentkeep.sessions import commits
from agentkeep.sessions.domain import LeaseOwnerIdentity
from agentkeep.sessions.records import (
    AppendNodes,
    HydratedSessionCheckpoint,
    ReplaceFullGraph,
    RuntimeCommit,
    SessionGraph,
    SessionNodeRecord,
    TokenUsage,
    UnchangedGraph,
    UsageDelta,
)
from agentkeep.store import Store

from .support import acquire_lease
from .test_commits import snapshot

SID = "sess-one-write"
OWNER = LeaseOwnerIdentity(owner_id="owner-ow", incarnation_id="inc-ow")
TTL = 600_000
MOST = commits._NODES_PER_INSERT


def _nodes(start: int, n: int, parent: str | None) -> tuple[SessionNodeRecord, ...]:
    out = []
    for i in range(start, start + n):
        out.append(
            SessionNodeRecord(node_id=f"n{i}", parent_node_id=parent, payload={"i": i}, timestamp=i)
        )
        parent = f"n{i}"
    return tuple(out)


def _deltas(kind: str) -> tuple[UsageDelta, ...]:
    if kind == "none":
        return ()
    if kind == "zero":
        return (UsageDelta(source="s", model="zero", usage=TokenUsage()),)
    if kind == "four_pairs":
        return tuple(
            UsageDelta(source="s", model=f"m{j}", usage=TokenUsage(input_tokens=j + 1))
            for j in range(4)
        )
    assert kind == "five_deltas"  # past _USAGE_PER_FOLD: the unfolded statements
    return tuple(
        UsageDelta(source="s", model="m0", usage=TokenUsage(output_tokens=1)) for _ in range(5)
    )


SHAPES = [
    (nodes, usage)
    for nodes in (0, 1, MOST, MOST + 1)
    for usage in ("none", "zero", "four_pairs", "five_deltas")
]


def test_every_turn_shape_commits_and_reads_back(store: Store) -> None:
    fence = acquire_lease(store, SID, OWNER, TTL)
    path: list[str] = []
    totals: dict[tuple[str, str], list[int]] = {}
    next_id = 0
    for revision, (n, usage) in enumerate(SHAPES):
        added = _nodes(next_id, n, path[-1] if path else None)
        next_id += n
        deltas = _deltas(usage)
        result = store.commits.commit_runtime_state(
            RuntimeCommit(
                session_id=SID,
                expected_head_revision=revision,
                session_execution_lease=fence,
                graph=AppendNodes(nodes=added, leaf_node_id=added[-1].node_id)
                if added
                else UnchangedGraph(leaf_node_id=path[-1] if path else None),
                checkpoint=HydratedSessionCheckpoint(turn_state={"rev": revision}),
                usage_deltas=deltas,
            )
        )
        assert result.head_revision == revision + 1, (n, usage)
        path.extend(node.node_id for node in added)
        for d in deltas:
            if d.usage.total():
                total = totals.setdefault((d.source, d.model), [0, 0])
                total[0] += d.usage.input_tokens
                total[1] += d.usage.output_tokens
        loaded = store.commits.load_session(SID)
        assert loaded is not None
        assert loaded.head_revision == revision + 1
        assert [node.node_id for node in loaded.graph.nodes] == path, (n, usage)
        assert loaded.checkpoint.turn_state == {"rev": revision}
        assert {
            (e.source, e.model): [e.usage.input_tokens, e.usage.output_tokens]
            for e in loaded.token_ledger
        } == totals, (n, usage)

    # A full replacement (never one statement) after all of them.
    graph = SessionGraph(nodes=_nodes(1000, 3, None), leaf_node_id="n1002")
    store.commits.commit_runtime_state(
        RuntimeCommit(
            session_id=SID,
            expected_head_revision=len(SHAPES),
            session_execution_lease=fence,
            graph=ReplaceFullGraph(graph=graph),
            usage_deltas=_deltas("four_pairs"),
        )
    )
    loaded = store.commits.load_session(SID)
    assert loaded is not None and loaded.head_revision == len(SHAPES) + 1
    assert [node.node_id for node in loaded.graph.nodes] == ["n1000", "n1001", "n1002"]


@pytest.fixture
def stale_revision(monkeypatch: pytest.MonkeyPatch) -> None:
    """The head revision read under the lock comes back one lower than stored.

    What a writer that moved the head without the lock would leave: the
    revision fence of the head write then matches no row.
    """
    real = commits._check_revision

    def stale(session_id: str, value: object) -> int:
        return real(session_id, value) - 1

    monkeypatch.setattr(commits, "_check_revision", stale)


def _seed(store: Store) -> Any:
    fence = acquire_lease(store, SID, OWNER, TTL)
    store.commits.commit_runtime_state(
        RuntimeCommit(
            session_id=SID,
            session_execution_lease=fence,
            graph=AppendNodes(nodes=_nodes(0, 2, None), leaf_node_id="n1"),
            usage_deltas=_deltas("four_pairs"),
        )
    )
    return fence


def _blind(fence: Any, nodes: tuple[SessionNodeRecord, ...]) -> RuntimeCommit:
    return RuntimeCommit(
        session_id=SID,
        session_execution_lease=fence,
        graph=AppendNodes(nodes=nodes, leaf_node_id=nodes[-1].node_id),
        checkpoint=HydratedSessionCheckpoint(turn_state={"blind": True}),
        usage_deltas=_deltas("four_pairs"),
    )


@pytest.mark.parametrize("n", [1, MOST + 1], ids=["one-statement", "separate-statements"])
def test_a_head_fence_that_misses_is_concurrent_modification_and_writes_nothing(
    store: Store, stale_revision: None, n: int
) -> None:
    with pytest.MonkeyPatch.context() as mp:  # the seed commit reads the real revision
        mp.setattr(commits, "_check_revision", lambda sid, value: int(value))  # type: ignore[arg-type]
        fence = _seed(store)
    before = snapshot(store)
    with pytest.raises(ConcurrentModification, match="head changed under the write lock"):
        store.commits.commit_runtime_state(_blind(fence, _nodes(10, n, "n1")))
    assert snapshot(store) == before


@pytest.mark.parametrize("n", [1, MOST + 1], ids=["one-statement", "separate-statements"])
def test_a_node_that_exists_comes_before_a_head_fence_that_misses(
    store: Store, stale_revision: None, n: int
) -> None:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(commits, "_check_revision", lambda sid, value: int(value))  # type: ignore[arg-type]
        fence = _seed(store)
    before = snapshot(store)
    nodes = (*_nodes(10, n - 1, "n1"), SessionNodeRecord(node_id="n0"))
    with pytest.raises(NodeAlreadyExists) as err:
        store.commits.commit_runtime_state(_blind(fence, nodes))
    assert err.value.node_id == "n0"
    assert snapshot(store) == before
