"""LEASE_GUARD folded into a checkpoint put's and a pending-write put's own write, both backends.

On SQLite the node upsert and the pending-write insert carry the guard
(``INSERT … SELECT … WHERE`` the lease passes); a write that wrote nothing
runs the unfolded guard, which raises or renews (docs/sessions.md#checkpoint-nodes).
On Postgres the same calls take the pipelined guard; every test holds on both.

* a refused put / pending-write put leaves every row as it was: the stored
  write of the same ``(task, idx)``, a negative index's value, the node of
  the same id, the blobs and the lease;
* a fenced write with no renewal due leaves the lease's expiry alone, one
  past the renewal point renews it (half the TTL), a fence of another
  session, a stale generation or a wrong token is refused;
* a repeat of only ``idx >= 0`` writes (the folded insert writes no row)
  and a call of more writes than one folded insert takes are stored once;
* races with real writers (own Store each, threads started together): an
  unfenced pending-write put against a lease claim, and an owner's fenced
  put / pending-write put against its lease's release and another owner's
  claim; each round either the write lands before the lease changes hands,
  or it is refused with the typed error and nothing of it is stored. The
  claimer reads the writes in its claim's unit: the final rows must be
  what it saw (a write that landed after the claim would not be).
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from agentkeep import SessionExecutionLeaseExpired, SessionLeaseHeld
from agentkeep.clock import SettableClock
from agentkeep.sessions.checkpoint_nodes import PendingWrite
from agentkeep.sessions.domain import Acquired, LeaseOwnerIdentity
from agentkeep.store import Store
from tests.racing import run_threads, wait_ready
from tests.sessions.support import acquire_lease
from tests.support import query

A = LeaseOwnerIdentity(owner_id="owner-A", incarnation_id="a1")
B = LeaseOwnerIdentity(owner_id="owner-B", incarnation_id="b1")
SID = "lg/folded/"


def _rows(store: Store) -> dict[str, Any]:
    """Every row a put could touch, as stored."""
    return {
        "nodes": query(
            store,
            "SELECT node_id, parent_node_id, node_json, blob_ref FROM graph_nodes "
            "ORDER BY session_id, node_id",
        ),
        "writes": query(
            store,
            "SELECT node_id, task_id, write_idx, channel, value FROM session_pending_writes "
            "ORDER BY session_id, node_id, task_id, write_idx",
        ),
        "blobs": query(store, "SELECT hash FROM blobs ORDER BY hash"),
        "leases": query(store, "SELECT * FROM session_execution_leases ORDER BY session_id"),
    }


def _expires(store: Store, sid: str = SID) -> int:
    rows = query(
        store,
        "SELECT lease_expires_at_ms FROM session_execution_leases WHERE session_id = :s",
        s=sid,
    )
    return int(rows[0]["lease_expires_at_ms"])


def test_a_refusal_leaves_every_row_as_it_was(store: Store) -> None:
    nodes = store.checkpoint_nodes
    nodes.put_checkpoint_node(SID, "c1", b"first", node_json='{"v": 1}')
    nodes.put_pending_writes(
        SID, "c1", "t", [PendingWrite(0, "a", "j", b"kept"), PendingWrite(-1, "e", "j", b"old")]
    )
    acquire_lease(store, SID, A, 60_000)
    before = _rows(store)
    with pytest.raises(SessionLeaseHeld):
        nodes.put_checkpoint_node(SID, "c1", b"second", node_json='{"v": 2}')
    with pytest.raises(SessionLeaseHeld):
        nodes.put_checkpoint_node(SID, "c2", b"new")
    with pytest.raises(SessionLeaseHeld):  # a new index and a replacement of a negative one
        nodes.put_pending_writes(
            SID, "c1", "t", [PendingWrite(1, "b", "j", b"x"), PendingWrite(-1, "e", "j", b"new")]
        )
    with pytest.raises(SessionLeaseHeld):  # only a repeat: refused all the same
        nodes.put_pending_writes(SID, "c1", "t", [PendingWrite(0, "a", "j", b"other")])
    assert _rows(store) == before


def test_fenced_writes_renew_only_when_due(store: Store, clock: SettableClock) -> None:
    nodes = store.checkpoint_nodes
    lease = acquire_lease(store, SID, A, 10_000)
    expires = _expires(store)
    clock.advance(4_000)  # 6_000 left of 10_000: no renewal due (at < 5_000)
    nodes.put_checkpoint_node(SID, "c1", b"x", fence=lease, renew_ms=10_000)
    nodes.put_pending_writes(
        SID, "c1", "t", [PendingWrite(0, "a", "j", b"1")], fence=lease, renew_ms=10_000
    )
    assert _expires(store) == expires
    clock.advance(1_001)  # 4_999 left: renewed by the next write
    nodes.put_pending_writes(
        SID, "c1", "t", [PendingWrite(1, "a", "j", b"2")], fence=lease, renew_ms=10_000
    )
    assert _expires(store) == clock.now_ms() + 10_000
    clock.advance(5_001)
    nodes.put_checkpoint_node(SID, "c2", b"y", fence=lease, renew_ms=10_000)
    assert _expires(store) == clock.now_ms() + 10_000
    # Without renew_ms: written while live, never renewed.
    expires = _expires(store)
    clock.advance(9_000)
    nodes.put_checkpoint_node(SID, "c3", b"z", fence=lease)
    assert _expires(store) == expires
    assert [w.idx for w in nodes.list_pending_writes(SID, "c1")] == [0, 1]
    assert [n.node_id for n in nodes.list_checkpoint_nodes(SID)] == ["c3", "c2", "c1"]


def test_fenced_writes_with_a_wrong_fence_are_refused(store: Store) -> None:
    nodes = store.checkpoint_nodes
    lease = acquire_lease(store, SID, A, 60_000)
    acquire_lease(store, "lg/other/", A, 60_000)
    before = _rows(store)
    wrong = [
        lease.model_copy(update={"session_id": "lg/other/"}),  # another session's lease
        lease.model_copy(update={"fencing_token": lease.fencing_token + 1}),
        lease.model_copy(update={"lease_token": "not-the-token"}),
        lease.model_copy(update={"owner": B}),
    ]
    for fence in wrong:
        with pytest.raises(SessionExecutionLeaseExpired):
            nodes.put_checkpoint_node(SID, "c1", b"x", fence=fence, renew_ms=60_000)
        with pytest.raises(SessionExecutionLeaseExpired):
            nodes.put_pending_writes(SID, "c1", "t", [PendingWrite(0, "a", "j", b"1")], fence=fence)
    assert _rows(store) == before


def test_repeats_and_many_writes_are_stored_once(store: Store) -> None:
    nodes = store.checkpoint_nodes
    many = [PendingWrite(i, f"ch{i}", "j", bytes([i])) for i in range(40)]
    many += [PendingWrite(-3, "err", "j", b"e1")]
    nodes.put_pending_writes(SID, "c1", "t", many)
    nodes.put_pending_writes(SID, "c1", "t", [PendingWrite(0, "x", "j", b"again")])  # a repeat
    nodes.put_pending_writes(  # a repeat and a replacement of the negative index
        SID, "c1", "t", [PendingWrite(1, "x", "j", b"again"), PendingWrite(-3, "err", "j", b"e2")]
    )
    stored = {w.idx: w.value for w in nodes.list_pending_writes(SID, "c1")}
    assert stored == {**{i: bytes([i]) for i in range(40)}, -3: b"e2"}


# --------------------------------------------------------------------------
# Races with real writers (own Store each, started together)


def _racer(url: str, barrier: threading.Barrier, fn: Any) -> Any:
    with Store.open(url) as store:
        wait_ready(barrier)
        try:
            return fn(store)
        except (SessionLeaseHeld, SessionExecutionLeaseExpired) as exc:
            return type(exc).__name__


@pytest.mark.parametrize("begin", [True, False], ids=["unit", "autocommit"])
def test_race_unfenced_pending_writes_against_a_claim(db_url: str, begin: bool) -> None:
    """Each round: the writes land before the lease is claimed, or are refused; never both.

    ``autocommit``: the one-call unit opens no transaction
    (``Store._call_operation(begin=False)``, the LangGraph saver's unfenced
    put_writes on SQLite): the guarded insert is one statement on its own.
    """
    outcomes = set()
    for round_ in range(6):
        barrier = threading.Barrier(2)
        sid = f"race-w/{round_}/"

        def own(s: Store, sid: str = sid) -> Any:
            # The claim and a read of the writes in one unit: what the claim saw.
            with s.write() as uow:
                claimed = uow.leases.try_claim_session_execution_lease(sid, A, 60_000)
                return claimed, uow.checkpoint_nodes.list_pending_writes(sid, "c1")

        def write(s: Store, sid: str = sid) -> Any:
            rows = [PendingWrite(0, "a", "j", b"x"), PendingWrite(-1, "e", "j", b"y")]
            return s._call_operation(
                lambda r: r.checkpoint_nodes.put_pending_writes(sid, "c1", "t", rows),
                begin=begin or s.engine.dialect.name == "postgresql",
            )

        (claimed, seen), wrote = run_threads(
            [(_racer, (db_url, barrier, own)), (_racer, (db_url, barrier, write))]
        )
        assert isinstance(claimed, Acquired)
        with Store.open(db_url) as store:
            stored = store.checkpoint_nodes.list_pending_writes(sid, "c1")
        assert stored == seen  # nothing landed after the claim
        if wrote == "SessionLeaseHeld":
            assert stored == []
        else:
            assert wrote is None and sorted(w.value for w in stored) == [b"x", b"y"]
        outcomes.add(wrote)
    assert outcomes <= {None, "SessionLeaseHeld"}


@pytest.mark.parametrize("kind", ["put", "writes"])
def test_race_fenced_write_against_release_and_claim(db_url: str, kind: str) -> None:
    """The owner writes with its fence while its lease is released and another owner claims it.

    Each round: the write lands (before the release), or it is refused with
    SessionExecutionLeaseExpired and nothing of it is stored; the lease ends
    as the other owner's either way.
    """
    for round_ in range(6):
        sid = f"race-f/{kind}/{round_}/"
        with Store.open(db_url) as store:
            lease = acquire_lease(store, sid, A, 60_000)
        barrier = threading.Barrier(2)

        def hand_over(s: Store, sid: str = sid, lease: Any = lease) -> Any:
            # Release, claim, and read what the owner wrote, in one unit.
            with s.write() as uow:
                uow.leases.release_session_execution_lease(lease)
                claimed = uow.leases.try_claim_session_execution_lease(sid, B, 60_000)
                nodes = uow.checkpoint_nodes
                return claimed, (
                    nodes.get_checkpoint_node(sid, "c1"),
                    nodes.list_pending_writes(sid, "c1"),
                )

        def write(s: Store, sid: str = sid, lease: Any = lease) -> Any:
            nodes = s.checkpoint_nodes
            if kind == "put":
                return nodes.put_checkpoint_node(sid, "c1", b"x", fence=lease, renew_ms=60_000)
            rows = [PendingWrite(0, "a", "j", b"x")]
            return nodes.put_pending_writes(sid, "c1", "t", rows, fence=lease, renew_ms=60_000)

        (claimed, seen), wrote = run_threads(
            [(_racer, (db_url, barrier, hand_over)), (_racer, (db_url, barrier, write))]
        )
        assert isinstance(claimed, Acquired) and claimed.lease.owner.owner_id == "owner-B"
        with Store.open(db_url) as store:
            node = store.checkpoint_nodes.get_checkpoint_node(sid, "c1")
            stored = store.checkpoint_nodes.list_pending_writes(sid, "c1")
            blobs = query(store, "SELECT COUNT(*) AS n FROM blobs")[0]["n"]
        assert (node, stored) == seen  # nothing landed after the hand-over
        if wrote == "SessionExecutionLeaseExpired":
            assert node is None and stored == []
            if kind == "put" and round_ == 0:
                assert blobs == 0
        elif kind == "put":
            assert node is not None and node.body == b"x"
        else:
            assert wrote is None and [w.value for w in stored] == [b"x"]


def test_autocommit_pending_writes(store: Store, backend: str, clock: SettableClock) -> None:
    """A one-call unit without a transaction (SQLite): one statement when the lease is free;
    a refusal, a repeat and a renewing fence take the guarded path in a transaction."""
    if backend == "postgres":
        pytest.skip("SQLite only: Postgres units always begin")

    def put(rows: list[PendingWrite], **kw: Any) -> None:
        store._call_operation(
            lambda r: r.checkpoint_nodes.put_pending_writes(SID, "c1", "t", rows, **kw),
            begin=False,
        )

    put([PendingWrite(0, "a", "j", b"1"), PendingWrite(-1, "e", "j", b"old")])
    put([PendingWrite(0, "a", "j", b"again")])  # a repeat: ignored (the guarded path)
    acquire_lease(store, SID, A, 60_000)
    before = _rows(store)
    with pytest.raises(SessionLeaseHeld):
        put([PendingWrite(1, "b", "j", b"2"), PendingWrite(-1, "e", "j", b"new")])
    assert _rows(store) == before
    stored = {w.idx: w.value for w in store.checkpoint_nodes.list_pending_writes(SID, "c1")}
    assert stored == {0: b"1", -1: b"old"}
    clock.advance(60_001)  # expired: no longer blocks
    put([PendingWrite(1, "b", "j", b"2")])
    assert [w.idx for w in store.checkpoint_nodes.list_pending_writes(SID, "c1")] == [-1, 0, 1]
    # A fenced one and a put open their transaction first: FENCE_OK at a now
    # sampled under the write lock (here it renews), node and blob together.
    lease = acquire_lease(store, SID, A, 10_000)
    clock.advance(6_000)
    put([PendingWrite(2, "c", "j", b"3")], fence=lease, renew_ms=10_000)
    assert _expires(store) == clock.now_ms() + 10_000
    store._call_operation(
        lambda r: r.checkpoint_nodes.put_checkpoint_node(SID, "c1", b"body", fence=lease),
        begin=False,
    )
    node = store.checkpoint_nodes.get_checkpoint_node(SID, "c1")
    assert node is not None and node.body == b"body" and len(node.writes) == 4
