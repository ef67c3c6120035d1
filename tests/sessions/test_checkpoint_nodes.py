"""Checkpoint nodes, pending writes and the session catalog, on SQLite and Postgres.

* put / get / list round trips (bytes as stored, latest = greatest id,
  ``before`` / ``limit``), a repeated put replaces, pending writes are stored
  once per (task, idx) and replaced for negative indexes, in
  ``(task_path, task_id, idx)`` order;
* refused input changes nothing; a missing blob is ``SessionCorrupt``;
* LEASE_GUARD: a live lease of another owner refuses an unfenced write
  (``SessionLeaseHeld``) and nothing is written (also when the caller of a
  ``store.write()`` unit or ``call_write`` catches it and commits); an
  expired lease does not;
  a valid fence writes and renews, a stale one is ``SessionExecutionLeaseExpired``;
* a fault injected between the blob insert and the node upsert leaves nothing;
* the catalog: sessions from any session table, paged, exact prefixes;
  ``delete_session`` empties every session table for that id only, and the
  blobs only it named are collected by the next GC;
* races with real writers: two writers of the same (task, idx), and an
  unfenced writer against an owner taking the lease, exactly one outcome.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from agentkeep import (
    InvalidInput,
    ReadOnlyUnitOfWork,
    SessionCorrupt,
    SessionExecutionLeaseExpired,
    SessionLeaseHeld,
)
from agentkeep.clock import SettableClock
from agentkeep.errors import DatabaseError
from agentkeep.sessions import checkpoint_nodes as cn_module
from agentkeep.sessions.catalog import MAX_PAGE, SESSION_TABLES
from agentkeep.sessions.checkpoint_nodes import PendingWrite
from agentkeep.sessions.domain import LeaseOwnerIdentity
from agentkeep.store import Store
from tests.racing import run_threads, wait_ready
from tests.sessions.support import acquire_lease
from tests.support import query

A = LeaseOwnerIdentity(owner_id="owner-A", incarnation_id="a1")
B = LeaseOwnerIdentity(owner_id="owner-B", incarnation_id="b1")
SID = "lg/t1/"


def _counts(store: Store, sid: str) -> dict[str, int]:
    return {
        t.__tablename__: query(
            store, f"SELECT COUNT(*) AS n FROM {t.__tablename__} WHERE session_id = :s", s=sid
        )[0]["n"]
        for t in SESSION_TABLES
    }


def _blob_count(store: Store) -> int:
    return int(query(store, "SELECT COUNT(*) AS n FROM blobs")[0]["n"])


def test_put_get_list_round_trip(store: Store) -> None:
    nodes = store.checkpoint_nodes
    body = bytes(range(256)) * 3  # not UTF-8: stored and read as bytes
    ref = nodes.put_checkpoint_node(SID, "c1", body, node_json='{"k": "v"}', run_id="r1")
    nodes.put_checkpoint_node(SID, "c3", b"three", parent_node_id="c1")
    nodes.put_checkpoint_node(SID, "c2", b"two", parent_node_id="c1")
    latest = nodes.get_checkpoint_node(SID)
    assert latest is not None and (latest.node_id, latest.body) == ("c3", b"three")
    first = nodes.get_checkpoint_node(SID, "c1")
    assert first is not None
    assert (first.body, first.node_json, first.run_id, first.parent_node_id) == (
        body,
        '{"k": "v"}',
        "r1",
        None,
    )
    assert query(store, "SELECT kind, compression FROM blobs WHERE hash = :h", h=ref) == [
        {"kind": "opaque", "compression": "none"}
    ]
    assert [n.node_id for n in nodes.list_checkpoint_nodes(SID)] == ["c3", "c2", "c1"]
    assert [n.node_id for n in nodes.list_checkpoint_nodes(SID, before="c3")] == ["c2", "c1"]
    assert [n.node_id for n in nodes.list_checkpoint_nodes(SID, limit=1)] == ["c3"]
    assert nodes.get_checkpoint_node(SID, "missing") is None
    assert nodes.get_checkpoint_node("other/") is None
    # A second put of the same id replaces it (the last put wins).
    nodes.put_checkpoint_node(SID, "c2", b"two again", parent_node_id="c1", run_id="r2")
    again = nodes.get_checkpoint_node(SID, "c2")
    assert again is not None and (again.body, again.run_id) == (b"two again", "r2")
    assert len(nodes.list_checkpoint_nodes(SID)) == 3


def test_pending_writes_once_per_task_and_index(store: Store) -> None:
    nodes = store.checkpoint_nodes
    put = nodes.put_pending_writes
    put(SID, "c1", "t2", [PendingWrite(0, "a", "json", b"1"), PendingWrite(1, "b", "json", b"2")])
    put(SID, "c1", "t2", [PendingWrite(0, "a", "json", b"changed")])  # ignored: stored once
    put(SID, "c1", "t1", [PendingWrite(-1, "__error__", "json", b"e1")], task_path="p")
    put(SID, "c1", "t1", [PendingWrite(-1, "__error__", "json", b"e2")], task_path="p")  # replaced
    put(SID, "c1", "t0", [], task_path="z")  # nothing to write
    got = [(w.task_path, w.task_id, w.idx, w.value) for w in nodes.list_pending_writes(SID, "c1")]
    assert got == [("", "t2", 0, b"1"), ("", "t2", 1, b"2"), ("p", "t1", -1, b"e2")]
    nodes.put_checkpoint_node(SID, "c1", b"body")
    node = nodes.get_checkpoint_node(SID, "c1")
    assert node is not None and [w.value for w in node.writes] == [b"1", b"2", b"e2"]
    assert [w.value for w in nodes.list_checkpoint_nodes(SID)[0].writes] == [b"1", b"2", b"e2"]


def test_pending_writes_outside_the_checks_common_case_are_stored_as_given(store: Store) -> None:
    """Non-ASCII channels and type tags, and bytes-like values that are not ``bytes``
    (the checks' slow path), interleaved with replaced negative indexes in one call."""
    nodes = store.checkpoint_nodes
    writes = [
        PendingWrite(0, "café", "json", bytearray(b"ba")),
        PendingWrite(-2, "__interrupt__", "tÿpe", b"i1"),
        PendingWrite(1, "b", "json", memoryview(b"mv")),
        PendingWrite(-2, "__interrupt__", "json", b"i2"),  # the same key again: replaced
    ]
    nodes.put_pending_writes(SID, "c1", "t", writes)
    got = [(w.idx, w.channel, w.value_type, w.value) for w in nodes.list_pending_writes(SID, "c1")]
    assert got == [
        (-2, "__interrupt__", "json", b"i2"),
        (0, "café", "json", b"ba"),
        (1, "b", "json", b"mv"),
    ]
    assert all(type(w.value) is bytes for w in nodes.list_pending_writes(SID, "c1"))


def test_many_pending_writes_of_one_call_keep_the_first_of_a_repeated_index(store: Store) -> None:
    """On Postgres the writes of one call go in multi-row inserts of up to 8 rows: a
    repeated index within one insert, or across two, keeps its first row, as one by one."""
    writes = [PendingWrite(i, f"c{i}", "json", b"%d" % i) for i in range(19)]
    writes.insert(3, PendingWrite(1, "again", "json", b"same insert"))
    writes.append(PendingWrite(2, "again", "json", b"a later insert"))
    writes.append(PendingWrite(-3, "__interrupt__", "json", b"i"))
    store.checkpoint_nodes.put_pending_writes(SID, "c1", "t", writes)
    got = [(w.idx, w.channel) for w in store.checkpoint_nodes.list_pending_writes(SID, "c1")]
    assert got == [(-3, "__interrupt__")] + [(i, f"c{i}") for i in range(19)]


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda s: s.checkpoint_nodes.put_checkpoint_node(" ", "c", b"x"), "session_id"),
        (lambda s: s.checkpoint_nodes.put_checkpoint_node(SID, "", b"x"), "node_id"),
        (lambda s: s.checkpoint_nodes.put_checkpoint_node(SID, "c", "text"), "body"),
        (
            lambda s: s.checkpoint_nodes.put_checkpoint_node(SID, "c", b"x", node_json=1),
            "node_json",
        ),
        (
            lambda s: s.checkpoint_nodes.put_pending_writes(SID, "c", "t", [("a", b"x")]),
            "writes[0]",
        ),
        (
            lambda s: s.checkpoint_nodes.put_pending_writes(
                SID, "c", "t", [PendingWrite(0, "a", "json", b"ok"), PendingWrite(1, "b", "j", "x")]
            ),
            "writes[1].value",
        ),
        (
            lambda s: s.checkpoint_nodes.put_pending_writes(
                SID,
                "c",
                "t",
                [PendingWrite(0, "a", "json", b"ok"), PendingWrite(1, "b\x00", "j", b"")],
            ),
            "writes[1].channel",
        ),
        (
            lambda s: s.checkpoint_nodes.put_pending_writes(
                SID, "c", "t", [PendingWrite(0, "\ud800", "json", b"ok")]
            ),
            "writes[0].channel",
        ),
        (
            lambda s: s.checkpoint_nodes.put_pending_writes(
                SID,
                "c",
                "t",
                [PendingWrite(-1, "a", 7, b"ok")],  # type: ignore[arg-type]
            ),
            "writes[0].value_type",
        ),
        (lambda s: s.catalog.list_sessions(limit=0), "limit"),
        (lambda s: s.catalog.list_sessions(limit=MAX_PAGE + 1), "limit"),
        (lambda s: s.catalog.list_sessions(prefix=3), "prefix"),
        (lambda s: s.catalog.delete_session(""), "session_id"),
        (lambda s: s.checkpoint_nodes.delete_nodes_for_runs("r1"), "run_ids"),
        (lambda s: s.checkpoint_nodes.copy_checkpoint_nodes(SID, SID), "target_session_id"),
    ],
)
def test_refused_input_changes_nothing(store: Store, call: Any, field: str) -> None:
    store.checkpoint_nodes.put_checkpoint_node(SID, "c0", b"kept")
    before = (_counts(store, SID), _blob_count(store))
    with pytest.raises(InvalidInput) as err:
        call(store)
    assert err.value.field == field
    assert (_counts(store, SID), _blob_count(store)) == before


def test_writes_in_a_read_unit_are_refused(store: Store) -> None:
    with store.read() as uow:
        with pytest.raises(ReadOnlyUnitOfWork):
            uow.checkpoint_nodes.put_checkpoint_node(SID, "c", b"x")
        with pytest.raises(ReadOnlyUnitOfWork):
            uow.catalog.delete_session(SID)
        with pytest.raises(ReadOnlyUnitOfWork):
            uow.checkpoint_nodes.delete_nodes_for_runs(["r"])


def test_a_missing_blob_is_corrupt(store: Store) -> None:
    ref = store.checkpoint_nodes.put_checkpoint_node(SID, "c1", b"body")
    with store.write() as uow:
        uow.connection.exec_driver_sql(f"DELETE FROM blobs WHERE hash = '{ref}'")
    with pytest.raises(SessionCorrupt):
        store.checkpoint_nodes.get_checkpoint_node(SID, "c1")
    with pytest.raises(SessionCorrupt):
        store.checkpoint_nodes.list_checkpoint_nodes(SID)


def test_lease_guard(store: Store, clock: SettableClock) -> None:
    nodes = store.checkpoint_nodes
    lease = acquire_lease(store, SID, A, 10_000)
    before = (_counts(store, SID), _blob_count(store))
    with pytest.raises(SessionLeaseHeld) as held:
        nodes.put_checkpoint_node(SID, "c1", b"x")
    assert (held.value.session_id, held.value.owner_id) == (SID, "owner-A")
    with pytest.raises(SessionLeaseHeld):
        nodes.put_pending_writes(SID, "c1", "t", [PendingWrite(0, "a", "json", b"1")])
    # Another namespace guarded by the same lease session is refused too.
    with pytest.raises(SessionLeaseHeld):
        nodes.put_checkpoint_node("lg/t1/sub", "c1", b"x", lease_session_id=SID)
    assert (_counts(store, SID), _blob_count(store)) == before
    # The owner writes with its fence; past half the TTL the write renews the lease.
    clock.advance(6_000)
    nodes.put_checkpoint_node(SID, "c1", b"x", fence=lease, renew_ms=10_000)
    row = query(store, "SELECT lease_expires_at_ms FROM session_execution_leases")[0]
    assert row["lease_expires_at_ms"] == clock.now_ms() + 10_000
    # Expired: no longer blocks others, and the old fence is refused once taken over.
    clock.advance(10_001)
    nodes.put_checkpoint_node(SID, "c2", b"y")
    acquire_lease(store, SID, B, 10_000)
    with pytest.raises(SessionExecutionLeaseExpired):
        nodes.put_checkpoint_node(SID, "c3", b"z", fence=lease)
    assert nodes.get_checkpoint_node(SID, "c3") is None


def test_a_refused_write_caught_in_a_unit_leaves_nothing(store: Store) -> None:
    """A unit whose caller catches the refusal and commits still holds nothing of the put.

    (A one-call put on psycopg sends its writes with the lock and lease read,
    before the guard's verdict, and relies on its unit rolling back; a
    ``store.write()`` unit or ``call_write`` may commit after a caught error,
    so there the writes go out only after the guard passed.)
    """
    acquire_lease(store, SID, A, 10_000)
    before = (_counts(store, SID), _blob_count(store))
    with store.write() as uow:
        with pytest.raises(SessionLeaseHeld):
            uow.checkpoint_nodes.put_checkpoint_node(SID, "c1", b"x")
        with pytest.raises(SessionLeaseHeld):
            uow.checkpoint_nodes.put_pending_writes(
                SID, "c1", "t", [PendingWrite(0, "a", "j", b"1")]
            )
        uow.checkpoint_nodes.put_checkpoint_node("lg/other/", "c1", b"kept")

    def caught(r: Any) -> None:
        with pytest.raises(SessionLeaseHeld):
            r.checkpoint_nodes.put_checkpoint_node(SID, "c2", b"y")
        with pytest.raises(SessionLeaseHeld):
            r.checkpoint_nodes.put_pending_writes(SID, "c2", "t", [PendingWrite(-1, "a", "j", b"")])

    store.call_write(caught)
    assert (_counts(store, SID), _blob_count(store) - 1) == before
    assert store.checkpoint_nodes.get_checkpoint_node("lg/other/", "c1") is not None


def test_a_fault_between_blob_and_node_leaves_nothing(
    store: Store, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    broken = cn_module.Statement(
        cn_module.select(cn_module.GraphNodeRow.node_id).where(
            cn_module.GraphNodeRow.node_id == cn_module.p("no_such_param_bound")
        ),
        name="test.broken_put_node",
    )
    # Postgres: one statement (the blob a CTE of the node upsert); SQLite: the
    # guarded node upsert, then the blob insert, which fails here.
    second = "_PUT_NODE_AND_BLOB" if backend == "postgres" else "_PUT_BLOB"
    monkeypatch.setattr(cn_module, second, broken)
    with pytest.raises((DatabaseError, KeyError)):
        store.checkpoint_nodes.put_checkpoint_node(SID, "c1", b"never")
    assert _blob_count(store) == 0
    assert _counts(store, SID)["graph_nodes"] == 0


def test_catalog_lists_sessions_of_every_table_in_pages(store: Store) -> None:
    store.checkpoint_nodes.put_checkpoint_node("lg/a/", "c", b"x")
    store.checkpoint_nodes.put_pending_writes("lg/b/", "c", "t", [PendingWrite(0, "a", "j", b"")])
    acquire_lease(store, "lg/c/", A, 1_000)
    acquire_lease(store, "LG/d/", A, 1_000)  # another case: not under "lg/"
    acquire_lease(store, "lg%/e", A, 1_000)  # LIKE wildcards are plain characters
    everything = store.catalog.list_sessions()
    assert everything.session_ids == sorted(["lg/a/", "lg/b/", "lg/c/", "LG/d/", "lg%/e"])
    assert everything.next_after is None
    assert store.catalog.list_sessions(prefix="lg/").session_ids == ["lg/a/", "lg/b/", "lg/c/"]
    assert store.catalog.list_sessions(prefix="lg%").session_ids == ["lg%/e"]
    page = store.catalog.list_sessions(prefix="lg/", limit=2)
    assert page.session_ids == ["lg/a/", "lg/b/"] and page.next_after == "lg/b/"
    rest = store.catalog.list_sessions(prefix="lg/", after=page.next_after, limit=2)
    assert rest.session_ids == ["lg/c/"] and rest.next_after is None


def test_delete_session_empties_every_table_and_gc_collects(store: Store) -> None:
    from agentkeep.sessions.records import SessionMeta

    nodes = store.checkpoint_nodes
    nodes.put_checkpoint_node(SID, "c1", b"only mine")
    nodes.put_checkpoint_node(SID, "c2", b"shared", parent_node_id="c1")
    nodes.put_pending_writes(SID, "c2", "t", [PendingWrite(0, "a", "j", b"v")])
    nodes.put_checkpoint_node("keep/", "c1", b"shared")
    acquire_lease(store, SID, A, 1_000)
    store.commits.save_session_meta(
        SessionMeta(session_id=SID, session_name="n", created_at="2026-01-01T00:00:00Z", model="m")
    )
    assert all(
        n > 0
        for t, n in _counts(store, SID).items()
        if t
        in {"graph_nodes", "session_pending_writes", "session_execution_leases", "session_meta"}
    )
    kept = _counts(store, "keep/")
    deleted = store.catalog.delete_session(SID)
    assert deleted == 5  # two nodes, one write, the lease, the metadata
    assert set(_counts(store, SID).values()) == {0}
    assert _counts(store, "keep/") == kept
    assert store.catalog.list_sessions().session_ids == ["keep/"]
    report = store.maintenance.gc_unreachable_strict()
    assert (report.deleted_blob_count, report.retained_blob_count) == (1, 1)
    keep = nodes.get_checkpoint_node("keep/", "c1")
    assert keep is not None and keep.body == b"shared"
    assert store.catalog.delete_session(SID) == 0


def test_every_session_keyed_table_of_the_session_store_is_deleted() -> None:
    """SESSION_TABLES names every table of agentkeep.sessions.models keyed by session_id
    (computed from the models, so a table added later cannot be missed)."""
    from agentkeep.sessions import models

    keyed = {
        cls.__tablename__
        for cls in vars(models).values()
        if isinstance(cls, type)
        and cls.__module__ == models.__name__
        and hasattr(cls, "__table__")
        and "session_id" in cls.__table__.c
    }
    assert keyed == {t.__tablename__ for t in SESSION_TABLES}


def test_a_deleted_session_leaves_no_ledger_totals_behind(store: Store) -> None:
    """A session with turn commits (head, nodes, usage deltas, ledger totals) deleted and
    started again under the same id: its new ledger holds only its new usage."""
    from agentkeep.sessions.records import (
        AppendNodes,
        HeadScope,
        HydratedSessionCheckpoint,
        RuntimeCommit,
        SessionNodeRecord,
        TokenUsage,
        UsageDelta,
    )

    def turn(fence: Any, tokens: int) -> RuntimeCommit:
        node = SessionNodeRecord(node_id="n0", parent_node_id=None, timestamp=1, payload={})
        usage = UsageDelta(source="s", model="m", usage=TokenUsage(input_tokens=tokens))
        return RuntimeCommit(
            session_id=SID,
            expected_head_revision=0,
            session_execution_lease=fence,
            release_session_execution_lease=fence,
            graph=AppendNodes(nodes=(node,), leaf_node_id="n0"),
            checkpoint=HydratedSessionCheckpoint(turn_state={}),
            usage_deltas=(usage,),
        )

    store.commits.commit_runtime_state(turn(acquire_lease(store, SID, A, 60_000), 7))
    assert _counts(store, SID)["session_usage_totals"] == 1
    store.catalog.delete_session(SID)
    assert set(_counts(store, SID).values()) == {0}
    store.commits.commit_runtime_state(turn(acquire_lease(store, SID, A, 60_000), 5))
    read = store.commits.load_session(SID, HeadScope())
    assert read is not None
    assert [(e.source, e.model, e.usage.input_tokens) for e in read.token_ledger] == [("s", "m", 5)]


def _full_session(store: Store) -> None:
    """SID with rows in the pending-write, node, lease and metadata tables."""
    from agentkeep.sessions.records import SessionMeta

    nodes = store.checkpoint_nodes
    nodes.put_checkpoint_node(SID, "c1", b"one")
    nodes.put_pending_writes(SID, "c1", "t", [PendingWrite(0, "a", "j", b"v")])
    acquire_lease(store, SID, A, 1_000)
    store.commits.save_session_meta(
        SessionMeta(session_id=SID, session_name="n", created_at="2026-01-01T00:00:00Z", model="m")
    )


def test_a_fault_in_a_late_delete_leaves_the_session_whole(
    store: Store, db_url: str, backend: str
) -> None:
    """The DELETEs are one transaction (one statement on Postgres): a trigger aborting
    the lease-row DELETE (the last of them on SQLite) fails the call, and every other
    table keeps its rows."""
    from tests.runtime.support import abort_trigger

    _full_session(store)
    before = _counts(store, SID)
    assert before["session_execution_leases"] == 1 and before["graph_nodes"] == 1
    with abort_trigger(db_url, backend, "session_execution_leases", "DELETE"):
        with pytest.raises(DatabaseError):
            store.catalog.delete_session(SID)
    assert _counts(store, SID) == before
    assert store.catalog.delete_session(SID) == 4  # a node, a write, the lease, the metadata


def test_delete_session_takes_three_round_trips_on_psycopg(store: Store, pg_url: str) -> None:
    """BEGIN + the session lock, the eleven DELETEs as one statement of CTEs, COMMIT."""
    from tests.sessions.test_round_trips import Trace

    _full_session(store)
    trace = Trace(store.engine, store)
    with trace.round_trips() as trips:
        assert store.catalog.delete_session(SID) == 4
    assert len(trips) == 3, trips
    assert set(_counts(store, SID).values()) == {0}


def test_prune_copy_and_delete_for_runs(store: Store) -> None:
    nodes = store.checkpoint_nodes
    for i, run in enumerate(["r1", "r1", "r2"]):
        nodes.put_checkpoint_node(SID, f"c{i}", f"b{i}".encode(), run_id=run)
        nodes.put_pending_writes(SID, f"c{i}", "t", [PendingWrite(0, "a", "j", b"w")])
    assert nodes.copy_checkpoint_nodes(SID, "copy/") == 3
    assert [(n.node_id, n.body, len(n.writes)) for n in nodes.list_checkpoint_nodes("copy/")] == [
        ("c2", b"b2", 1),
        ("c1", b"b1", 1),
        ("c0", b"b0", 1),
    ]
    assert nodes.delete_nodes_for_runs(["r1"]) == 4  # both sessions
    assert [n.node_id for n in nodes.list_checkpoint_nodes(SID)] == ["c2"]
    assert nodes.list_pending_writes(SID, "c0") == []
    nodes.put_checkpoint_node(SID, "c3", b"b3")
    assert nodes.prune_checkpoint_nodes(SID, keep_latest=True) == 1
    assert [n.node_id for n in nodes.list_checkpoint_nodes(SID)] == ["c3"]
    assert nodes.prune_checkpoint_nodes(SID, keep_latest=False) == 1
    assert nodes.list_checkpoint_nodes(SID) == []


# --------------------------------------------------------------------------
# Races with real writers (own Store each, started together)


def _racer(url: str, barrier: threading.Barrier, fn: Any) -> Any:
    with Store.open(url) as store:
        wait_ready(barrier)
        try:
            return fn(store)
        except (SessionLeaseHeld, SessionExecutionLeaseExpired) as exc:
            return type(exc).__name__


def test_race_two_writers_of_one_task_index(db_url: str) -> None:
    barrier = threading.Barrier(2)

    def writer(value: bytes) -> Any:
        return lambda s: s.checkpoint_nodes.put_pending_writes(
            SID, "c1", "t", [PendingWrite(0, "a", "json", value)]
        )

    run_threads(
        [(_racer, (db_url, barrier, writer(b"one"))), (_racer, (db_url, barrier, writer(b"two")))]
    )
    with Store.open(db_url) as store:
        stored = store.checkpoint_nodes.list_pending_writes(SID, "c1")
    assert len(stored) == 1 and stored[0].value in (b"one", b"two")


def test_race_owner_against_unfenced_writer(db_url: str) -> None:
    """Each round: either the write lands before the lease, or it is refused; never both."""
    for round_ in range(5):
        barrier = threading.Barrier(2)
        sid = f"race/{round_}/"

        def own(s: Store, sid: str = sid) -> Any:
            # The claim and a read of the node in one unit: what the claim saw.
            with s.write() as uow:
                uow.leases.try_claim_session_execution_lease(sid, A, 60_000)
                return uow.checkpoint_nodes.get_checkpoint_node(sid, "c1")

        def write(s: Store, sid: str = sid) -> Any:
            return s.checkpoint_nodes.put_checkpoint_node(sid, "c1", b"x")

        seen, wrote = run_threads(
            [(_racer, (db_url, barrier, own)), (_racer, (db_url, barrier, write))]
        )
        with Store.open(db_url) as store:
            node = store.checkpoint_nodes.get_checkpoint_node(sid, "c1")
        assert node == seen  # nothing landed after the claim
        if wrote == "SessionLeaseHeld":
            assert node is None
        else:
            assert node is not None and node.body == b"x"
