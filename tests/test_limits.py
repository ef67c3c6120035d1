"""Size limits (:class:`agentkeep.Limits`): each refused with the rows untouched, at-limit accepted.

Two stores are opened on the same database, one whose limit is exactly the
size of the value and one a unit below, so each limit is tested at its edge:
the first writes, the second raises :class:`~agentkeep.PayloadTooLarge`
(an ``InvalidInput`` naming the column, the size and the limit) and leaves
every table as it was. On both backends; the async store takes the same
``limits``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from agentkeep import (
    DEFAULT_LIMITS,
    AsyncStore,
    InvalidInput,
    Limits,
    PayloadTooLarge,
    RunRecord,
    SettableClock,
    Store,
)
from agentkeep.limits import MIB
from agentkeep.sessions.domain import LeaseOwnerIdentity, QueuedWorkDraft, QueuedWorkPayload
from agentkeep.sessions.records import (
    HydratedSessionCheckpoint,
    RuntimeCommit,
    SessionMeta,
    UnchangedGraph,
)
from tests.runtime.builders import encode, user_session
from tests.support import query

T0 = 1_700_000_000_000
A = LeaseOwnerIdentity(owner_id="owner-A", incarnation_id="inc-A")
TABLES = (
    "runs",
    "session_meta",
    "queued_work_batches",
    "queued_work_items",
    "runtime_session_snapshots",
    "blobs",
    "session_head",
)


def state(store: Store) -> dict[str, list[str]]:
    """Every row of the tables these tests write, as sorted reprs."""
    return {t: sorted(repr(r) for r in query(store, f"SELECT * FROM {t}")) for t in TABLES}


@pytest.fixture
def open_with(db_url: str) -> Iterator[Callable[..., Store]]:
    """``open_with(max_payload_bytes=10)``: a store on the test's database with those limits."""
    stores: list[Store] = []

    def make(**limits: int | None) -> Store:
        store = Store.open(db_url, clock=SettableClock(T0), limits=Limits(**limits))
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()


def refused(
    store: Store, call: Callable[[], Any], column: str, size: int, limit: int, unit: str
) -> None:
    before = state(store)
    with pytest.raises(PayloadTooLarge) as info:
        call()
    err = info.value
    assert isinstance(err, InvalidInput)
    assert (err.field, err.size, err.limit, err.unit) == (column, size, limit, unit)
    assert str(limit) in str(err) and column in str(err)
    assert state(store) == before


def test_defaults_and_validation() -> None:
    assert DEFAULT_LIMITS == Limits()
    assert (Limits().max_id_length, Limits().max_payload_bytes) == (255, 8 * MIB)
    assert (Limits().max_snapshot_bytes, Limits().max_blob_bytes) == (64 * MIB, 64 * MIB)
    for bad in (0, -1, 1.5, "10", True):
        with pytest.raises(InvalidInput):
            Limits(max_payload_bytes=bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match="limits"):
        Store.open("sqlite://", limits={"max_id_length": 3})  # type: ignore[arg-type]
    with Store.open("sqlite://") as store:
        assert store.limits is DEFAULT_LIMITS


def test_id_length(open_with: Callable[..., Store]) -> None:
    run_id = "R-" + "x" * 30  # 32 characters
    small, exact = open_with(max_id_length=31), open_with(max_id_length=32)
    record = RunRecord.new(run_id, "T-1", created_at=1)
    refused(small, lambda: small.runs.create(record), "id", 32, 31, "characters")
    exact.runs.create(record)
    assert exact.runs.get(run_id).id == run_id
    assert small.runs.get(run_id).id == run_id  # reads are not limited: a lowered limit
    # still reads what was written under a larger one
    meta = SessionMeta(session_id="s" * 40, session_name="n", created_at="c", model="m")
    refused(
        small, lambda: small.commits.save_session_meta(meta), "session_id", 40, 31, "characters"
    )


def test_payload_bytes(open_with: Callable[..., Store]) -> None:
    value = '"' + "é" * 20 + '"'  # 42 UTF-8 bytes, 22 characters
    small, exact = open_with(max_payload_bytes=41), open_with(max_payload_bytes=42)
    exact.runs.create(RunRecord.new("R-1", "T-1", created_at=1))
    refused(small, lambda: small.runs.set_input_json("R-1", value), "input_json", 42, 41, "bytes")
    exact.runs.set_input_json("R-1", value)
    assert query(exact, "SELECT input_json FROM runs")[0]["input_json"] == value
    # a queued payload: its stored JSON text is what is measured
    draft = QueuedWorkDraft(
        session_id="sess-1", payloads=(QueuedWorkPayload(kind="user_input", body="y" * 200),)
    )
    refused(small, lambda: small.queue.enqueue_queued_work(draft), "payload_json", 231, 41, "bytes")
    assert open_with(max_payload_bytes=231).queue.enqueue_queued_work(draft).items


def test_snapshot_bytes(open_with: Callable[..., Store]) -> None:
    snapshot = encode(user_session("hello " * 50))
    size = len(snapshot)
    small, exact = open_with(max_snapshot_bytes=size - 1), open_with(max_snapshot_bytes=size)
    refused(
        small,
        lambda: small.runtime.commit_session_snapshot("rt-1", snapshot),
        "session_snapshot",
        size,
        size - 1,
        "bytes",
    )
    exact.runtime.commit_session_snapshot("rt-1", snapshot)
    assert exact.runtime.load_session_snapshot("rt-1") == snapshot


def test_blob_bytes(open_with: Callable[..., Store]) -> None:
    """A checkpoint's blobs: the largest, as stored (compressed or not), is measured."""
    checkpoint = HydratedSessionCheckpoint(
        turn_state={"turn": 1}, execution_state={"log": [f"step {i}" for i in range(400)]}
    )

    def commit_on(store: Store, sid: str) -> None:
        got = store.leases.try_claim_session_execution_lease(sid, A, 60_000)
        store.commits.commit_runtime_state(
            RuntimeCommit(
                session_id=sid,
                expected_head_revision=0,
                session_execution_lease=got.lease,  # type: ignore[union-attr]
                graph=UnchangedGraph(leaf_node_id=None),
                checkpoint=checkpoint,
            )
        )

    with Store.open("sqlite://", clock=SettableClock(T0)) as scratch:
        commit_on(scratch, "sess-scratch")
        size = max(len(r["content"]) for r in query(scratch, "SELECT content FROM blobs"))
    small, exact = open_with(max_blob_bytes=size - 1), open_with(max_blob_bytes=size)
    refused(small, lambda: commit_on(small, "sess-1"), "content", size, size - 1, "bytes")
    assert small.commits.load_session("sess-1") is None
    commit_on(exact, "sess-1")
    loaded = exact.commits.load_session("sess-1")
    assert loaded is not None and loaded.checkpoint.execution_state == checkpoint.execution_state


def test_a_limit_of_none_is_off(open_with: Callable[..., Store]) -> None:
    store = open_with(max_id_length=None, max_payload_bytes=None)
    store.runs.create(RunRecord.new("R-" + "x" * 1000, "T-1", created_at=1))
    assert len(query(store, "SELECT id FROM runs")[0]["id"]) == 1002


def test_the_async_store_takes_the_same_limits(async_url: str) -> None:
    async def scenario() -> None:
        astore = await AsyncStore.open(async_url, limits=Limits(max_payload_bytes=10))
        try:
            await astore.runs.create(RunRecord.new("R-1", "T-1", created_at=1))
            with pytest.raises(PayloadTooLarge) as info:
                await astore.runs.set_input_json("R-1", '"' + "z" * 10 + '"')
            assert (info.value.field, info.value.size) == ("input_json", 12)
            assert (await astore.runs.get("R-1")).input_json is None
        finally:
            await astore.close()

    asyncio.run(scenario())


def test_text_bounds_pass_only_text_that_cannot_be_over(open_with: Callable[..., Store]) -> None:
    limits = Limits(max_id_length=7, max_payload_bytes=41, max_blob_bytes=None)
    assert limits.text_bounds() == {
        "id": 7,
        "payload": 10,
        "snapshot": 16 * MIB,
        "blob": float("inf"),
    }
    # text past the bound is measured: 11 characters (38 bytes) pass, 12 (42 bytes) are refused
    store = open_with(max_payload_bytes=40)
    store.runs.create(RunRecord.new("R-1", "T-1", created_at=1))
    store.runs.set_input_json("R-1", '"' + "\U0001f600" * 9 + '"')  # 38 bytes, 11 characters
    refused(
        store,
        lambda: store.runs.set_input_json("R-1", '"' + "\U0001f600" * 10 + '"'),
        "input_json",
        42,
        40,
        "bytes",
    )
