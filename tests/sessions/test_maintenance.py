"""Session-store maintenance: tombstones, vacuum, blob GC (spec sessions §2.8, §4.12, §5).

Every test runs on both backends.

Scenarios M-01, M-02, M-07, M-08 and invariants I-12, I-13 are tests named
after them, plus: the GC roots of the spec/README.md decisions (every session
head, ``artifact_refs``, and the checkpoints named by stored turn commits), a
present-but-corrupt *component* blob (not a manifest: the GC goes on), the
sweep's bounded statement count and its never reading component contents,
vacuum per session vs all sessions, tombstones scoped to their session,
refused arguments and read units (nothing changed), and the one-call facade.

Heads, checkpoints, turn-commit records and graph nodes are written by real
commits (``uow.commits.commit_runtime_state`` under a lease); orphan blobs,
artifact refs and corruptions by ``checkpoints.put_blob`` and raw SQL.

Decision recorded by these tests (module docstring of
``agentkeep.sessions.maintenance``): ``gc_unreachable`` keeps the spec's
"log and return an all-zero report" contract; ``gc_unreachable_strict`` raises
:class:`SessionCorrupt`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import text

from agentkeep.db import Driver
from agentkeep.errors import InvalidInput, ReadOnlyUnitOfWork, SessionCorrupt
from agentkeep.sessions.checkpoints import (
    KIND_MANIFEST,
    KIND_TOOL_STATE,
    get_checkpoint,
    manifest_refs,
    put_blob,
    put_checkpoint,
    read_manifest,
)
from agentkeep.sessions.domain import (
    ActiveTurnIngress,
    CheckpointKind,
    InputIdTarget,
    LeaseOwnerIdentity,
    PendingTurnInput,
    PendingTurnInputDraft,
)
from agentkeep.sessions.facade import MaintenanceCalls
from agentkeep.sessions.maintenance import SWEEP_BATCH, MaintenanceRepository
from agentkeep.sessions.records import (
    ActivePathScope,
    AppendNodes,
    BlobProfile,
    CheckpointManifest,
    FullGraphScope,
    GcReport,
    HydratedSessionCheckpoint,
    RuntimeCommit,
    SessionNodeRecord,
    TurnCommitStamp,
    UnchangedGraph,
    VacuumReport,
)
from agentkeep.statements import Statement
from agentkeep.store import Store
from agentkeep.strict_json import canonical_json

from .support import acquire_lease, enqueue

SID = "sess-maint-1"
OTHER = "sess-maint-2"
OWNER = LeaseOwnerIdentity(owner_id="owner-m", incarnation_id="inc-m")
TTL = 60_000
PROFILE = BlobProfile.BALANCED


# --------------------------------------------------------------------------
# Helpers


def run_sql(store: Store, stmt: str, **params: Any) -> list[tuple[Any, ...]]:
    """Run raw SQL in its own write unit; return the rows (if any)."""
    with store.write() as uow:
        res = uow.connection.execute(text(stmt), params)
        return [tuple(r) for r in res] if res.returns_rows else []


def blobs(store: Store) -> dict[str, tuple[str, str, bytes]]:
    """Every stored blob, raw: ``hash -> (kind, compression, content)``."""
    rows = run_sql(store, "SELECT hash, kind, compression, content FROM blobs")
    return {h: (k, c, bytes(b)) for h, k, c, b in rows}


def nodes(store: Store) -> list[tuple[Any, ...]]:
    return run_sql(
        store,
        "SELECT session_id, node_id, parent_node_id, node_json, tombstoned "
        "FROM graph_nodes ORDER BY seq",
    )


def inputs(store: Store) -> list[tuple[Any, ...]]:
    return run_sql(
        store, "SELECT session_id, input_id, state FROM pending_turn_inputs ORDER BY enqueue_seq"
    )


def maint(store: Store, fn: Callable[[MaintenanceRepository], Any]) -> Any:
    return store.call_write(lambda r: fn(r.maintenance))


def commit(
    store: Store,
    sid: str,
    checkpoint: HydratedSessionCheckpoint | None = None,
    *,
    turn_id: str | None = None,
    graph: AppendNodes | None = None,
) -> tuple[str, CheckpointManifest]:
    """Commit ``checkpoint`` as the head of ``sid`` (a real commit); return (ref, manifest)."""
    fence = acquire_lease(store, sid, OWNER, TTL)
    stamp = (
        None
        if turn_id is None
        else TurnCommitStamp(session_id=sid, turn_id=turn_id, turn_commit_hash=f"h-{turn_id}")
    )
    rc = RuntimeCommit(
        session_id=sid,
        session_execution_lease=fence,
        checkpoint=checkpoint or HydratedSessionCheckpoint(),
        turn_commit=stamp,
        graph=graph or UnchangedGraph(),
    )
    with store.write() as uow:
        result = uow.commits.commit_runtime_state(rc)
    return result.checkpoint_ref, result.manifest


def checkpoint(tag: str, **extra: Any) -> HydratedSessionCheckpoint:
    """A checkpoint whose three components are new blobs (their content names ``tag``)."""
    return HydratedSessionCheckpoint(
        turn_state={"turn": tag},
        tool_state={"tools": tag, **extra},
        plugin_snapshot={"plugins": tag},
        plugin_snapshot_revision=1,
        execution_state={"exec": tag},
    )


def reachable(store: Store, ref: str) -> set[str]:
    """The manifest ``ref`` and its component refs."""
    with store.read() as uow:
        manifest = read_manifest(uow.driver, ref)
    assert manifest is not None
    return {ref, *manifest_refs(manifest)}


def put(store: Store, value: Any, kind: str = KIND_TOOL_STATE) -> str:
    with store.write() as uow:
        return put_blob(uow.driver, kind, value, PROFILE)


def add_nodes(store: Store, sid: str, *node_ids: str) -> None:
    """Append graph nodes (a chain, in order) with a commit; the leaf is the last one."""
    parent = None
    chain = []
    for nid in node_ids:
        chain.append(SessionNodeRecord(node_id=nid, parent_node_id=parent, payload={"n": nid}))
        parent = nid
    commit(store, sid, graph=AppendNodes(nodes=tuple(chain), leaf_node_id=parent))


def live_nodes(store: Store, sid: str) -> tuple[list[str], list[str]]:
    """Node ids a full-graph load and an active-path load (from the head leaf) return."""
    with store.read() as uow:
        full = uow.commits.load_session(sid, FullGraphScope())
        path = uow.commits.load_session(sid, ActivePathScope())
    assert full is not None and path is not None
    return [n.node_id for n in full.graph.nodes], [n.node_id for n in path.graph.nodes]


def load_node(store: Store, sid: str, node_id: str) -> SessionNodeRecord | None:
    with store.read() as uow:
        return uow.commits.load_node(sid, node_id)


def tombstoned(store: Store, sid: str) -> dict[str, int]:
    rows = run_sql(
        store, "SELECT node_id, tombstoned FROM graph_nodes WHERE session_id = :sid", sid=sid
    )
    return {n: int(t) for n, t in rows}


def enqueue_active(store: Store, sid: str, turn: str = "T") -> PendingTurnInput:
    """Enqueue an ActiveTurn(``turn``) input of ``sid``."""
    draft = PendingTurnInputDraft(
        session_id=sid,
        ingress=ActiveTurnIngress(turn_id=turn),
        input={"text": f"hi {turn}"},
    )
    return enqueue(store, draft)


def terminal_inputs(store: Store, sid: str, cancelled: int, completed: int, pending: int) -> None:
    """Give ``sid`` that many cancelled, completed and pending_active turn inputs."""
    cancel = [enqueue_active(store, sid, "C") for _ in range(cancelled)]
    done = [enqueue_active(store, sid, "D") for _ in range(completed)]
    for _ in range(pending):
        enqueue_active(store, sid, "P")
    if cancel:
        store.turn_inputs.cancel_pending_turn_inputs(
            sid, [InputIdTarget(input_id=i.input_id) for i in cancel]
        )
    if done:
        fence = acquire_lease(store, sid, OWNER, TTL)
        claim = store.turn_inputs.claim_active_turn_inputs(
            sid, fence, OWNER, "D", CheckpointKind.BEFORE_COMPLETION, len(done)
        )
        assert claim is not None and len(claim.inputs) == len(done)
        store.turn_inputs.complete_turn_input_claim(fence, claim.completion())


@pytest.fixture
def statements(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The SQL text the driver receives for every ``Driver.execute`` (in this process), in order.

    Each :class:`~agentkeep.statements.Statement` as compiled for the connection.
    """
    seen: list[str] = []
    original = Driver.execute

    def spy(self: Driver, stmt: Statement, params: Any) -> Any:
        seen.append(stmt.compiled(self.target).sql)
        return original(self, stmt, params)

    monkeypatch.setattr(Driver, "execute", spy)
    yield seen


# --------------------------------------------------------------------------
# Tombstones and vacuum


def test_m_01_tombstone_hides_node_and_vacuum_removes_it(store: Store) -> None:
    add_nodes(store, SID, "root", "n", "leaf")
    assert load_node(store, SID, "n") is not None
    maint(store, lambda m: m.tombstone_nodes(SID, ["n"]))
    assert load_node(store, SID, "n") is None
    assert live_nodes(store, SID)[0] == ["root", "leaf"]
    assert tombstoned(store, SID) == {"root": 0, "n": 1, "leaf": 0}
    report = maint(store, lambda m: m.vacuum(SID))
    assert report == VacuumReport(removed_node_count=1)
    assert [(r[1], r[4]) for r in nodes(store)] == [("root", 0), ("leaf", 0)]


def test_m_02_vacuum_removes_cancelled_and_completed_inputs(store: Store) -> None:
    terminal_inputs(store, SID, cancelled=2, completed=1, pending=3)
    before = inputs(store)
    assert (
        sorted(s for _, _, s in before)
        == ["cancelled"] * 2 + ["completed"] + ["pending_active"] * 3
    )
    report = maint(store, lambda m: m.vacuum(SID))
    assert report == VacuumReport(removed_pending_turn_input_tombstone_count=3)
    assert inputs(store) == [r for r in before if r[2] == "pending_active"]


def test_i_12_tombstoned_nodes_are_invisible_and_stay_until_vacuum(store: Store) -> None:
    """I-12: every read skips a tombstoned node; GC and another session's vacuum keep its row."""
    add_nodes(store, SID, "a", "b", "c")
    add_nodes(store, OTHER, "a", "b")
    maint(store, lambda m: m.tombstone_nodes(SID, ["b"]))
    maint(store, lambda m: m.tombstone_nodes(SID, ["b"]))  # idempotent
    assert load_node(store, SID, "b") is None
    assert load_node(store, OTHER, "b") is not None
    # The full graph skips b; the active path from the leaf c stops at b.
    assert live_nodes(store, SID) == (["a", "c"], ["c"])
    assert live_nodes(store, OTHER) == (["a", "b"], ["a", "b"])
    maint(store, lambda m: m.gc_unreachable_strict())
    assert maint(store, lambda m: m.vacuum(OTHER)) == VacuumReport()
    assert tombstoned(store, SID) == {"a": 0, "b": 1, "c": 0}
    assert maint(store, lambda m: m.vacuum(SID)).removed_node_count == 1
    assert tombstoned(store, SID) == {"a": 0, "c": 0}
    assert live_nodes(store, SID) == (["a", "c"], ["c"])
    assert tombstoned(store, OTHER) == {"a": 0, "b": 0}


def test_tombstone_is_scoped_to_its_session_and_ignores_unknown_ids(store: Store) -> None:
    add_nodes(store, SID, "n", "m")
    add_nodes(store, OTHER, "n", "m")
    maint(store, lambda m: m.tombstone_nodes(SID, ["n", "no-such-node", "n"]))
    assert tombstoned(store, SID) == {"n": 1, "m": 0}
    assert tombstoned(store, OTHER) == {"n": 0, "m": 0}


def test_tombstone_many_ids_in_batches(store: Store) -> None:
    ids = [f"n{i:04d}" for i in range(SWEEP_BATCH * 2 + 3)]
    add_nodes(store, SID, *ids)
    keep = ids[::7]
    maint(store, lambda m: m.tombstone_nodes(SID, [i for i in ids if i not in keep]))
    flags = tombstoned(store, SID)
    assert {n for n, t in flags.items() if t == 0} == set(keep)
    assert len(flags) == len(ids)


def test_tombstone_empty_list_returns_at_once(store: Store, statements: list[str]) -> None:
    add_nodes(store, SID, "n")
    statements.clear()
    assert maint(store, lambda m: m.tombstone_nodes(SID, [])) is None
    assert statements == []
    assert tombstoned(store, SID) == {"n": 0}


def test_vacuum_is_scoped_to_one_session(store: Store) -> None:
    for sid in (SID, OTHER):
        add_nodes(store, sid, "a", "b", "c")
        maint(store, lambda m, s=sid: m.tombstone_nodes(s, ["a", "c"]))
        terminal_inputs(store, sid, cancelled=1, completed=1, pending=1)
    other_nodes = tombstoned(store, OTHER)
    other_inputs = [r for r in inputs(store) if r[0] == OTHER]
    assert maint(store, lambda m: m.vacuum(SID)) == VacuumReport(
        removed_node_count=2, removed_pending_turn_input_tombstone_count=2
    )
    assert tombstoned(store, SID) == {"b": 0}
    assert [r[2] for r in inputs(store) if r[0] == SID] == ["pending_active"]
    assert tombstoned(store, OTHER) == other_nodes
    assert [r for r in inputs(store) if r[0] == OTHER] == other_inputs
    assert maint(store, lambda m: m.vacuum(SID)) == VacuumReport()


def test_vacuum_all_sessions(store: Store) -> None:
    for sid, tomb in ((SID, ["a"]), (OTHER, ["a", "b"])):
        add_nodes(store, sid, "a", "b", "c")
        maint(store, lambda m, s=sid, t=tomb: m.tombstone_nodes(s, t))
        terminal_inputs(store, sid, cancelled=1, completed=1, pending=2)
    assert maint(store, lambda m: m.vacuum_all_sessions()) == VacuumReport(
        removed_node_count=3, removed_pending_turn_input_tombstone_count=4
    )
    assert tombstoned(store, SID) == {"b": 0, "c": 0}
    assert tombstoned(store, OTHER) == {"c": 0}
    assert [r[2] for r in inputs(store)] == ["pending_active"] * 4
    assert maint(store, lambda m: m.vacuum_all_sessions()) == VacuumReport()


def test_vacuum_does_not_touch_blobs_heads_or_turn_commits(store: Store) -> None:
    ref, _ = commit(store, SID, checkpoint("v"), turn_id="t1")
    put(store, {"orphan": 1})
    before = (blobs(store), run_sql(store, "SELECT * FROM session_head"))
    maint(store, lambda m: m.vacuum(SID))
    maint(store, lambda m: m.vacuum_all_sessions())
    assert (blobs(store), run_sql(store, "SELECT * FROM session_head")) == before
    assert run_sql(store, "SELECT checkpoint_ref FROM runtime_turn_commits") == [(ref,)]


# --------------------------------------------------------------------------
# Bad input and read units


BAD_CALLS: list[tuple[str, Callable[[MaintenanceRepository], Any]]] = [
    ("blank-session-tombstone", lambda m: m.tombstone_nodes("  ", ["a"])),
    ("empty-session-tombstone", lambda m: m.tombstone_nodes("", [])),
    ("non-str-session-tombstone", lambda m: m.tombstone_nodes(7, ["a"])),
    ("non-str-id", lambda m: m.tombstone_nodes(SID, ["a", 1])),
    ("none-id", lambda m: m.tombstone_nodes(SID, [None])),
    ("blank-id", lambda m: m.tombstone_nodes(SID, ["a", " "])),
    ("bare-string-ids", lambda m: m.tombstone_nodes(SID, "a")),
    ("not-a-sequence", lambda m: m.tombstone_nodes(SID, 5)),
    ("blank-session-vacuum", lambda m: m.vacuum(" ")),
    ("non-str-session-vacuum", lambda m: m.vacuum(None)),
    ("nul-session-vacuum", lambda m: m.vacuum("s\x00")),
]


@pytest.mark.parametrize("call", [c for _, c in BAD_CALLS], ids=[n for n, _ in BAD_CALLS])
def test_bad_input_is_refused_and_changes_nothing(
    store: Store, call: Callable[[MaintenanceRepository], Any]
) -> None:
    add_nodes(store, SID, "a", "b")
    maint(store, lambda m: m.tombstone_nodes(SID, ["b"]))
    terminal_inputs(store, SID, cancelled=1, completed=0, pending=1)
    before = (nodes(store), inputs(store))
    with pytest.raises(InvalidInput):
        maint(store, call)
    assert (nodes(store), inputs(store)) == before


READ_REFUSED: list[tuple[str, Callable[[MaintenanceRepository], Any]]] = [
    ("tombstone", lambda m: m.tombstone_nodes(SID, ["a"])),
    ("tombstone-empty", lambda m: m.tombstone_nodes(SID, [])),
    ("vacuum", lambda m: m.vacuum(SID)),
    ("vacuum-all", lambda m: m.vacuum_all_sessions()),
    ("gc", lambda m: m.gc_unreachable()),
    ("gc-strict", lambda m: m.gc_unreachable_strict()),
]


@pytest.mark.parametrize("call", [c for _, c in READ_REFUSED], ids=[n for n, _ in READ_REFUSED])
def test_writes_are_refused_in_a_read_unit(
    store: Store, call: Callable[[MaintenanceRepository], Any]
) -> None:
    """Also ``tombstone_nodes`` with an empty list: misuse is reported whatever the ids."""
    add_nodes(store, SID, "a")
    maint(store, lambda m: m.tombstone_nodes(SID, ["a"]))
    put(store, {"orphan": True})
    before = (nodes(store), blobs(store))
    with store.read() as uow, pytest.raises(ReadOnlyUnitOfWork):
        call(uow.maintenance)
    with pytest.raises(ReadOnlyUnitOfWork):
        store.call_read(lambda r: call(r.maintenance))
    assert (nodes(store), blobs(store)) == before


# --------------------------------------------------------------------------
# Blob GC


def test_m_07_gc_keeps_head_manifest_and_component_deletes_orphan(store: Store) -> None:
    ref, manifest = commit(store, SID, HydratedSessionCheckpoint(tool_state={"t": 1}))
    assert manifest.tool_state_ref is not None
    orphan = put(store, {"o": 1})
    assert set(blobs(store)) == {ref, manifest.tool_state_ref, orphan}
    report = maint(store, lambda m: m.gc_unreachable())
    assert report == GcReport(root_count=1, retained_blob_count=2, deleted_blob_count=1)
    assert set(blobs(store)) == {ref, manifest.tool_state_ref}


def _corrupt_by_garbage(store: Store, ref: str) -> None:
    run_sql(store, "UPDATE blobs SET content = :c WHERE hash = :h", c=b"\x00not json", h=ref)


def _corrupt_by_other_hash(store: Store, ref: str) -> None:
    """Valid JSON of another manifest: the content no longer matches its hash."""
    other = canonical_json(CheckpointManifest(turn_state="x").model_dump(mode="json"))
    run_sql(
        store,
        "UPDATE blobs SET content = :c, compression = 'none' WHERE hash = :h",
        c=other.encode(),
        h=ref,
    )


def _head_names_component(store: Store, ref: str) -> None:
    """The head names a blob that is not a manifest (its tool-state component)."""
    with store.read() as uow:
        manifest = read_manifest(uow.driver, ref)
    assert manifest is not None and manifest.tool_state_ref is not None
    run_sql(store, "UPDATE session_head SET checkpoint_ref = :r", r=manifest.tool_state_ref)


def _head_names_future_schema(store: Store, ref: str) -> None:
    future = put(store, {**CheckpointManifest().model_dump(mode="json"), "schema_version": 99})
    run_sql(store, "UPDATE blobs SET kind = :k WHERE hash = :h", k=KIND_MANIFEST, h=future)
    run_sql(store, "UPDATE session_head SET checkpoint_ref = :r", r=future)


CORRUPTIONS = {
    "garbage-bytes": _corrupt_by_garbage,
    "hash-mismatch": _corrupt_by_other_hash,
    "not-a-manifest": _head_names_component,
    "future-schema": _head_names_future_schema,
}


@pytest.mark.parametrize("corrupt", list(CORRUPTIONS.values()), ids=list(CORRUPTIONS))
def test_m_08_corrupt_head_manifest_aborts_gc(
    store: Store, corrupt: Callable[[Store, str], None], caplog: pytest.LogCaptureFixture
) -> None:
    """M-08: nothing deleted, all-zero report (logged); the strict form raises SessionCorrupt."""
    ref, _ = commit(store, SID, checkpoint("m08"))
    put(store, {"orphan": 1})
    corrupt(store, ref)
    head_ref = run_sql(store, "SELECT checkpoint_ref FROM session_head")[0][0]
    before = blobs(store)
    with caplog.at_level(logging.ERROR, logger="agentkeep.sessions.maintenance"):
        assert maint(store, lambda m: m.gc_unreachable()) == GcReport()
    assert any("blob GC aborted" in r.getMessage() for r in caplog.records)
    assert blobs(store) == before
    with pytest.raises(SessionCorrupt) as err:
        maint(store, lambda m: m.gc_unreachable_strict())
    assert (err.value.table, err.value.key, err.value.column) == ("blobs", head_ref, "content")
    assert blobs(store) == before


def test_corrupt_component_blob_is_not_a_manifest_and_does_not_abort(store: Store) -> None:
    """A corrupt component is only marked, never decoded; a corrupt orphan is just deleted."""
    ref, manifest = commit(store, SID, checkpoint("comp"))
    tool = manifest.tool_state_ref
    assert tool is not None
    _corrupt_by_garbage(store, tool)
    orphan = put(store, {"orphan": "corrupt"})
    _corrupt_by_garbage(store, orphan)
    corrupt_tool = blobs(store)[tool]
    report = maint(store, lambda m: m.gc_unreachable_strict())
    assert report == GcReport(root_count=1, retained_blob_count=4, deleted_blob_count=1)
    assert set(blobs(store)) == reachable(store, ref)
    assert blobs(store)[tool] == corrupt_tool


def test_gc_roots_include_artifact_refs(store: Store) -> None:
    """An artifact naming a plain blob keeps it; one naming a checkpoint keeps its components."""
    plain = put(store, {"artifact": 1})
    with store.write() as uow:
        ck_ref, ck = put_checkpoint(uow.driver, checkpoint("art"), PROFILE)
    orphan = put(store, {"orphan": 2})
    run_sql(
        store,
        "INSERT INTO artifact_refs (namespace, artifact_ref, blob_ref) "
        "VALUES ('files', 'a1', :p), ('ckpt', 'c1', :c)",
        p=plain,
        c=ck_ref,
    )
    report = maint(store, lambda m: m.gc_unreachable_strict())
    kept = {plain, ck_ref, *manifest_refs(ck)}
    assert report == GcReport(root_count=2, retained_blob_count=len(kept), deleted_blob_count=1)
    assert set(blobs(store)) == kept
    assert orphan not in kept


def test_gc_roots_include_every_session_head(store: Store) -> None:
    ref_a, _ = commit(store, SID, checkpoint("a"))
    ref_b, _ = commit(store, OTHER, checkpoint("b"))
    old_a = reachable(store, ref_a)
    ref_a2, _ = commit(store, SID, checkpoint("a2"))  # SID's first checkpoint is now garbage
    report = maint(store, lambda m: m.gc_unreachable_strict())
    kept = reachable(store, ref_a2) | reachable(store, ref_b)
    assert report == GcReport(
        root_count=2, retained_blob_count=len(kept), deleted_blob_count=len(old_a)
    )
    assert set(blobs(store)) == kept


def test_gc_roots_include_turn_commit_checkpoints(store: Store) -> None:
    """A turn commit's checkpoint stays (a replay returns it) after the head moved on."""
    ref1, _ = commit(store, SID, checkpoint("t1"), turn_id="turn-1")
    ref2, _ = commit(store, SID, checkpoint("no-turn"))
    old2 = reachable(store, ref2)
    ref3, _ = commit(store, SID, checkpoint("head"))
    report = maint(store, lambda m: m.gc_unreachable_strict())
    kept = reachable(store, ref1) | reachable(store, ref3)
    assert report == GcReport(
        root_count=2, retained_blob_count=len(kept), deleted_blob_count=len(old2)
    )
    assert set(blobs(store)) == kept
    # A replay of turn-1 returns its checkpoint, and every blob of it is there.
    replayed, _ = commit(store, SID, checkpoint("ignored"), turn_id="turn-1")
    assert replayed == ref1
    with store.read() as uow:
        hydrated = get_checkpoint(uow.driver, ref1)
    assert hydrated is not None and hydrated.tool_state == {"tools": "t1"}
    assert hydrated.execution_state == {"exec": "t1"}


def test_gc_root_count_is_distinct(store: Store) -> None:
    """The same checkpoint as two heads, a turn commit and an artifact is one root."""
    ref, _ = commit(store, SID, checkpoint("same"), turn_id="t")
    assert commit(store, OTHER, checkpoint("same"))[0] == ref
    run_sql(
        store,
        "INSERT INTO artifact_refs (namespace, artifact_ref, blob_ref) VALUES ('n', 'a', :r)",
        r=ref,
    )
    report = maint(store, lambda m: m.gc_unreachable_strict())
    assert report == GcReport(root_count=1, retained_blob_count=4, deleted_blob_count=0)


def test_gc_skips_a_missing_root(store: Store) -> None:
    """A head whose manifest blob is gone is still a root; it retains nothing, GC goes on."""
    ref, manifest = commit(store, SID, checkpoint("gone"))
    run_sql(store, "DELETE FROM blobs WHERE hash = :h", h=ref)
    keep_ref, _ = commit(store, OTHER, checkpoint("kept"))
    report = maint(store, lambda m: m.gc_unreachable_strict())
    kept = reachable(store, keep_ref)
    assert report == GcReport(root_count=2, retained_blob_count=4, deleted_blob_count=3)
    assert set(blobs(store)) == kept
    assert not set(manifest_refs(manifest)) & set(blobs(store))


def test_gc_with_no_roots_deletes_everything(store: Store) -> None:
    for i in range(3):
        put(store, {"i": i})
    with store.write() as uow:
        put_checkpoint(uow.driver, checkpoint("unrooted"), PROFILE)
    report = maint(store, lambda m: m.gc_unreachable_strict())
    assert report == GcReport(root_count=0, retained_blob_count=0, deleted_blob_count=7)
    assert blobs(store) == {}
    assert maint(store, lambda m: m.gc_unreachable_strict()) == GcReport()


def test_gc_sweep_is_batched_and_never_reads_component_contents(
    store: Store, statements: list[str]
) -> None:
    """Pages of hashes, one DELETE per page; only the manifest's content is read."""
    ref, _ = commit(store, SID, checkpoint("batch"))
    n_orphans = SWEEP_BATCH * 3 + 5
    with store.write() as uow:
        for i in range(n_orphans):
            put_blob(uow.driver, KIND_TOOL_STATE, {"orphan": i}, PROFILE)
    kept = reachable(store, ref)
    statements.clear()
    report = maint(store, lambda m: m.gc_unreachable_strict())
    statements = list(statements)
    assert report == GcReport(root_count=1, retained_blob_count=4, deleted_blob_count=n_orphans)
    assert set(blobs(store)) == kept
    pages = -(-(n_orphans + 4) // SWEEP_BATCH)
    deletes = [s for s in statements if s.startswith("DELETE FROM blobs")]
    content_reads = [s for s in statements if "content" in s and s.startswith("SELECT")]
    assert len(deletes) == pages
    assert len(content_reads) == 1  # the head manifest, and nothing else
    assert len(statements) <= 2 * pages + 4


def test_i_13_reachable_blobs_are_never_collected(store: Store) -> None:
    """I-13 over a sequence of commits, artifact changes and GCs in three sessions.

    After every GC the stored blobs are exactly the blobs reachable from a
    session head, a turn commit or an artifact ref.
    """
    sessions = [SID, OTHER, "sess-maint-3"]
    artifacts: dict[str, str] = {}
    for step in range(12):
        sid = sessions[step % 3]
        shared = {"shared": step // 4}  # a component reused by later checkpoints
        ck = HydratedSessionCheckpoint(
            turn_state=step,
            tool_state=shared,
            execution_state={"step": step},
            plugin_snapshot={"p": step % 2},
        )
        commit(store, sid, ck, turn_id=f"turn-{step}" if step % 5 == 0 else None)
        if step % 3 == 1:
            artifacts[f"a{step}"] = put(store, {"artifact": step})
            run_sql(
                store,
                "INSERT INTO artifact_refs (namespace, artifact_ref, blob_ref) "
                "VALUES ('ns', :a, :b)",
                a=f"a{step}",
                b=artifacts[f"a{step}"],
            )
        if step % 4 == 3 and artifacts:
            gone = sorted(artifacts)[0]
            run_sql(store, "DELETE FROM artifact_refs WHERE artifact_ref = :a", a=gone)
            del artifacts[gone]
        put(store, {"garbage": step})
        report = maint(store, lambda m: m.gc_unreachable_strict())
        roots = [
            r
            for (r,) in run_sql(
                store,
                "SELECT checkpoint_ref FROM session_head "
                "UNION SELECT checkpoint_ref FROM runtime_turn_commits",
            )
        ]
        expected = set(artifacts.values()).union(*(reachable(store, r) for r in roots))
        assert set(blobs(store)) == expected
        assert report.retained_blob_count == len(expected)
        assert report.root_count == len(set(roots) | set(artifacts.values()))


def test_gc_failure_leaves_the_unit_of_work_usable(store: Store) -> None:
    """A GC that fails inside a larger unit rolls back only itself."""
    add_nodes(store, SID, "n")
    ref, _ = commit(store, SID, checkpoint("unit"))
    put(store, {"orphan": 3})
    _corrupt_by_garbage(store, ref)
    before = blobs(store)
    with store.write() as uow:
        uow.maintenance.tombstone_nodes(SID, ["n"])
        assert uow.maintenance.gc_unreachable() == GcReport()
        with pytest.raises(SessionCorrupt):
            uow.maintenance.gc_unreachable_strict()
        assert uow.maintenance.vacuum(SID).removed_node_count == 1
    assert blobs(store) == before
    assert tombstoned(store, SID) == {}


# --------------------------------------------------------------------------
# One-call facade


def test_facade_runs_each_call_in_its_own_unit(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    calls = MaintenanceCalls(store)
    add_nodes(store, SID, "a", "b")
    add_nodes(store, OTHER, "a")
    calls.tombstone_nodes(SID, ["a"])
    calls.tombstone_nodes(OTHER, ["a"])
    assert calls.vacuum(SID) == VacuumReport(removed_node_count=1)
    assert calls.vacuum_all_sessions() == VacuumReport(removed_node_count=1)
    ref, _ = commit(store, SID, checkpoint("facade"))
    put(store, {"orphan": 4})
    # Roots: SID's head (manifest + 3 components) and OTHER's head (an empty manifest).
    assert calls.gc_unreachable() == GcReport(
        root_count=2, retained_blob_count=5, deleted_blob_count=1
    )
    put(store, {"orphan": 5})
    _corrupt_by_garbage(store, ref)
    before = blobs(store)
    with caplog.at_level(logging.ERROR, logger="agentkeep.sessions.maintenance"):
        assert calls.gc_unreachable() == GcReport()
    assert any("blob GC aborted" in r.getMessage() for r in caplog.records)
    with pytest.raises(SessionCorrupt):
        calls.gc_unreachable_strict()
    assert blobs(store) == before
    with pytest.raises(InvalidInput):
        calls.vacuum("")
