"""Queued work of sessions (spec sessions §2.6, §3.3, §4.1–4.7, §4.10), on SQLite and Postgres.

Every non-concurrent queued-work scenario of §5.2 is one test named after it
(Q-01..Q-23, Q-25; the race Q-24 is in ``test_queue_races.py``), plus the
completion checks C-13..C-15, invariants I-4, I-5, I-7 and I-10 for queued
work, refused input, corrupt stored rows, an injected fault mid-enqueue and
the claim scan's index. Where a decision of spec/README.md changes an expected
outcome (Q-01, C-14), the test docstring says so. "A commit completing a
claim" is :meth:`QueuedWorkRepository.complete_queued_work_claim` (the session
commit itself comes later). Time comes from the ``store`` fixture's
:class:`SettableClock`; "nothing written" is checked on the raw rows.
"""

from __future__ import annotations

import hashlib
import itertools
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from sqlalchemy import text

from agentkeep.clock import SettableClock
from agentkeep.errors import (
    DatabaseError,
    InvalidInput,
    QueuedWorkClaimSuperseded,
    QueuedWorkSourceKeyConflict,
    ReadOnlyUnitOfWork,
    SessionCorrupt,
    SessionExecutionLeaseExpired,
)
from agentkeep.sessions import codec
from agentkeep.sessions import queue as queue_mod
from agentkeep.sessions.domain import (
    MAX_I64,
    ClaimBoundary,
    DeliveryPolicy,
    LeaseFence,
    LeaseOwnerIdentity,
    MergeKey,
    QueuedWorkBatch,
    QueuedWorkClaim,
    QueuedWorkCompletion,
    QueuedWorkDraft,
    QueuedWorkItem,
    QueuedWorkPayload,
    SlotPolicy,
    claim_lease_token,
)
from agentkeep.sessions.ids import rust_debug
from agentkeep.store import Store
from tests.sessions.test_head_read import _sqlite_log
from tests.support import execute_sql, explain, query, raw_exec

from .support import LeaseTaker, enqueue

SID = "session-1"
OTHER = "session-2"
A = LeaseOwnerIdentity(owner_id="owner-a", incarnation_id="inc-a")
B = LeaseOwnerIdentity(owner_id="owner-b", incarnation_id="inc-b")
TTL = 10_000
IDLE = ClaimBoundary.IDLE
AT_CHECKPOINT = ClaimBoundary.ACTIVE_TURN_CHECKPOINT
JOIN = SlotPolicy.JOIN
EXCLUSIVE = SlotPolicy.EXCLUSIVE
EARLIEST = DeliveryPolicy.EARLIEST_SAFE_BOUNDARY
AFTER_COMMIT = DeliveryPolicy.AFTER_CURRENT_TURN_COMMIT
BATCH_ID = re.compile(r"^qwb:[0-9a-f]{64}$")


# --------------------------------------------------------------------------
# Helpers

take_lease = LeaseTaker(owner=A, sid=SID, ttl=TTL)


def turn(*bodies: Any, kind: str = "user_input") -> tuple[QueuedWorkPayload, ...]:
    """Turn-work payloads (any kind but ``session_command``)."""
    return tuple(QueuedWorkPayload(kind=kind, body=b) for b in (bodies or ({"n": 0},)))


def command(body: Any = None) -> tuple[QueuedWorkPayload, ...]:
    return (QueuedWorkPayload(kind="session_command", body=body or {"cmd": "compact"}),)


def draft(
    payloads: tuple[QueuedWorkPayload, ...] | None = None,
    *,
    sid: str = SID,
    key: str | None = None,
    delivery: DeliveryPolicy = EARLIEST,
    slot: SlotPolicy = EXCLUSIVE,
    merge: MergeKey | None = None,
    available_at: int = 0,
) -> QueuedWorkDraft:
    return QueuedWorkDraft(
        session_id=sid,
        source_key=key,
        delivery_policy=delivery,
        slot_policy=slot,
        merge_key=merge or MergeKey.never(),
        available_at_ms=available_at,
        payloads=payloads or turn(),
    )


def joined(group: str = "a", **kw: Any) -> QueuedWorkDraft:
    return draft(slot=JOIN, merge=MergeKey.of_group(group), **kw)


def claim_ready(
    store: Store,
    fence: LeaseFence,
    max_batches: int = 8,
    boundary: ClaimBoundary = IDLE,
    owner: LeaseOwnerIdentity | None = None,
    sid: str = SID,
) -> QueuedWorkClaim | None:
    return store.call_write(
        lambda r: r.queue.claim_ready_queued_work(
            sid, fence, owner or fence.owner, boundary, max_batches
        )
    )


def claim_leading(store: Store, fence: LeaseFence, sid: str = SID) -> QueuedWorkClaim | None:
    return store.call_write(
        lambda r: r.queue.claim_leading_ready_session_command(sid, fence, fence.owner)
    )


def claim_ids(
    store: Store, fence: LeaseFence, ids: list[str], boundary: ClaimBoundary = IDLE
) -> QueuedWorkClaim | None:
    return store.call_write(
        lambda r: r.queue.claim_ready_queued_work_by_batch_ids(
            SID, fence, fence.owner, boundary, ids
        )
    )


def abandon(store: Store, claim: QueuedWorkClaim | QueuedWorkCompletion) -> None:
    store.call_write(lambda r: r.queue.abandon_queued_work_claim(claim))


def complete(store: Store, fence: LeaseFence, completion: QueuedWorkCompletion) -> None:
    store.call_write(lambda r: r.queue.complete_queued_work_claim(fence, completion))


def cancel(store: Store, batch_id: str, sid: str = SID) -> QueuedWorkBatch | None:
    return store.call_write(lambda r: r.queue.cancel_queued_work_batch(sid, batch_id))


def listed(store: Store, sid: str = SID) -> list[QueuedWorkBatch]:
    return store.call_read(lambda r: r.queue.list_queued_work(sid))


def pending(store: Store, sid: str = SID) -> list[QueuedWorkBatch]:
    return store.call_read(lambda r: r.queue.list_pending_queued_work(sid))


def ids_of(batches: Any) -> list[str]:
    return [b.batch_id for b in batches]


def row(store: Store, batch_id: str) -> dict[str, Any]:
    rows = query(store, "SELECT * FROM queued_work_batches WHERE batch_id = :b", b=batch_id)
    assert len(rows) == 1, rows
    return rows[0]


def snapshot(store: Store) -> tuple[list[dict[str, Any]], ...]:
    """Every queued-work and lease row as stored."""
    return (
        query(store, "SELECT * FROM queued_work_batches ORDER BY enqueue_seq"),
        query(store, "SELECT * FROM queued_work_items ORDER BY batch_id, item_index"),
        query(store, "SELECT * FROM session_execution_leases ORDER BY session_id"),
    )


def owned_by(store: Store, claim: QueuedWorkClaim) -> set[str]:
    rows = query(
        store,
        "SELECT batch_id FROM queued_work_batches WHERE session_id = :s AND claim_id = :c "
        "AND claim_token = :t",
        s=claim.session_id,
        c=claim.claim_id,
        t=claim.lease_token,
    )
    return {r["batch_id"] for r in rows}


def expire_and_take_over(store: Store, clock: SettableClock, ttl: int = TTL) -> Any:
    """Let the current lease expire and have B acquire the next generation."""
    clock.advance(ttl + 1)
    return take_lease(store, B)


_PG_FAULT_FN = """
CREATE OR REPLACE FUNCTION agentkeep_test_queue_fault() RETURNS trigger AS $$
BEGIN
    RAISE EXCEPTION 'injected fault';
END $$ LANGUAGE plpgsql
"""
_PG_SKIP_FN = """
CREATE OR REPLACE FUNCTION agentkeep_test_queue_skip() RETURNS trigger AS $$
BEGIN
    RETURN NULL;
END $$ LANGUAGE plpgsql
"""


@pytest.fixture
def trigger(db_url: str, backend: str) -> Iterator[Any]:
    """``trigger(kind, table, when)`` installs a test trigger; all are dropped afterwards.

    ``kind="fault"``: AFTER INSERT, raises (SQLite ``RAISE(ABORT)``, Postgres
    plpgsql ``RAISE EXCEPTION``). ``kind="skip"``: BEFORE UPDATE, silently
    skips the row (SQLite ``RAISE(IGNORE)``, Postgres ``RETURN NULL``), so the
    fenced UPDATE of that row matches nothing — a lost race, made deterministic.
    """
    installed: list[tuple[str, str]] = []

    def install(kind: str, table: str, when: str) -> None:
        name = f"agentkeep_test_queue_{kind}_{len(installed)}"
        event = "AFTER INSERT" if kind == "fault" else "BEFORE UPDATE"
        if backend == "sqlite":
            action = "RAISE(ABORT, 'injected fault')" if kind == "fault" else "RAISE(IGNORE)"
            raw_exec(
                db_url,
                f"CREATE TRIGGER {name} {event} ON {table} WHEN {when} BEGIN SELECT {action}; END",
            )
        else:
            fn = "agentkeep_test_queue_fault" if kind == "fault" else "agentkeep_test_queue_skip"
            raw_exec(
                db_url,
                _PG_FAULT_FN if kind == "fault" else _PG_SKIP_FN,
                f"CREATE TRIGGER {name} {event} ON {table} FOR EACH ROW WHEN ({when}) "
                f"EXECUTE FUNCTION {fn}()",
            )
        installed.append((name, table))

    yield install
    for name, table in installed:
        raw_exec(
            db_url,
            f"DROP TRIGGER IF EXISTS {name}" + ("" if backend == "sqlite" else f" ON {table}"),
        )


# --------------------------------------------------------------------------
# Enqueue (§2.6.1, §4.10)


def test_enqueue_stores_the_batch_and_its_items(store: Store, clock: SettableClock) -> None:
    d = draft(turn({"text": "hi"}, [1, 2]), key="k-1", delivery=AFTER_COMMIT, available_at=5)
    batch = enqueue(store, d)

    assert BATCH_ID.match(batch.batch_id)
    assert (batch.session_id, batch.source_key) == (SID, "k-1")
    assert (batch.delivery_policy, batch.slot_policy) == (AFTER_COMMIT, EXCLUSIVE)
    assert batch.merge_key == MergeKey.never()
    assert (batch.available_at_ms, batch.enqueued_at_ms) == (5, clock.now_ms())
    assert (batch.claim_id, batch.claim_owner, batch.claim_token) == (None, None, None)
    assert (batch.claim_fencing_token, batch.claim_session_lease_generation) == (0, 0)
    assert [(i.item_index, i.item_id) for i in batch.items] == [
        (0, f"{batch.batch_id}:item:0"),
        (1, f"{batch.batch_id}:item:1"),
    ]
    assert [i.payload for i in batch.items] == list(d.payloads)
    assert listed(store) == [batch]
    items = query(store, "SELECT * FROM queued_work_items ORDER BY item_index")
    assert [r["payload_json"] for r in items] == [
        '{"body":{"text":"hi"},"kind":"user_input"}',
        '{"body":[1,2],"kind":"user_input"}',
    ]


def test_enqueue_batch_id_formula_hashes_session_key_now_nonce_and_random_bits(
    store: Store, clock: SettableClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decision 7: ``qwb:`` + sha256 of ``session:debug(key):now:nonce:random64``."""
    monkeypatch.setattr(queue_mod, "_NONCES", itertools.count(41))
    monkeypatch.setattr(queue_mod.secrets, "token_hex", lambda n: "0123456789abcdef")
    with_key = enqueue(store, draft(key='k"\n\\'))
    without = enqueue(store, draft())

    now = clock.now_ms()
    seed1 = f'{SID}:Some("k\\"\\n\\\\"):{now}:41:0123456789abcdef'
    seed2 = f"{SID}:None:{now}:42:0123456789abcdef"
    assert with_key.batch_id == "qwb:" + hashlib.sha256(seed1.encode()).hexdigest()
    assert without.batch_id == "qwb:" + hashlib.sha256(seed2.encode()).hexdigest()


def test_rust_debug_rendering_of_an_optional_source_key() -> None:
    debug = rust_debug
    assert debug(None) == "None"
    assert debug("plain") == 'Some("plain")'
    assert debug('a"b\\c') == 'Some("a\\"b\\\\c")'
    assert debug("\n\r\t\0") == 'Some("\\n\\r\\t\\0")'
    assert debug("\x01\x7f é") == 'Some("\\u{1}\\u{7f} é")'


def test_two_hosts_with_the_same_nonce_at_the_same_ms_mint_different_ids(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decision 7: the random bits alone keep ids apart when nonce, session and ms agree."""
    monkeypatch.setattr(queue_mod, "_NONCES", itertools.repeat(7))
    first, second = enqueue(store, draft()), enqueue(store, draft())
    assert first.batch_id != second.batch_id
    assert len(listed(store)) == 2


def test_q_01_source_key_resubmission_with_other_content_conflicts(store: Store) -> None:
    """Q-01, changed by spec/README.md: the seed returned the first batch unchanged.

    Our decision compares content like turn inputs do: a different payload
    (or policy, merge key, availability) under the same source key raises
    ``QueuedWorkSourceKeyConflict`` naming the stored batch; one row remains.
    """
    first = enqueue(store, draft(turn({"a": 1}), key="k"))
    before = snapshot(store)
    variants = [
        draft(turn({"a": 2}), key="k"),
        draft(turn({"a": 1}, {"a": 1}), key="k"),
        draft(turn({"a": 1}, kind="process_wake"), key="k"),
        draft(turn({"a": 1}), key="k", delivery=AFTER_COMMIT),
        draft(turn({"a": 1}), key="k", slot=JOIN),
        draft(turn({"a": 1}), key="k", merge=MergeKey.payload_default()),
        draft(turn({"a": 1}), key="k", available_at=1),
    ]
    for variant in variants:
        with pytest.raises(QueuedWorkSourceKeyConflict) as err:
            enqueue(store, variant)
        assert (err.value.session_id, err.value.source_key) == (SID, "k")
        assert err.value.existing_batch_id == first.batch_id
    assert snapshot(store) == before


def test_source_key_resubmission_with_equal_content_returns_the_stored_batch(
    store: Store, clock: SettableClock
) -> None:
    """Equal content compares parsed JSON (key order is irrelevant); the row is returned as is."""
    first = enqueue(store, draft(turn({"a": 1, "b": [1, {"x": None}]}), key="k"))
    fence = take_lease(store)
    claim = claim_ready(store, fence)
    assert claim is not None
    before = snapshot(store)

    clock.advance(5)
    again = enqueue(store, draft(turn({"b": [1, {"x": None}], "a": 1}), key="k"))
    assert again.batch_id == first.batch_id
    assert again.claim_id == claim.claim_id  # as it is now: claimed
    assert again == listed(store)[0]
    assert snapshot(store) == before


def test_the_same_source_key_in_another_session_is_a_new_batch(store: Store) -> None:
    first = enqueue(store, draft(key="k"))
    other = enqueue(store, draft(key="k", sid=OTHER, payloads=turn({"other": True})))
    assert other.batch_id != first.batch_id
    assert ids_of(listed(store)) == [first.batch_id]
    assert ids_of(listed(store, OTHER)) == [other.batch_id]


def test_i_10_one_batch_per_source_key_until_it_is_deleted(store: Store) -> None:
    """I-10: (session, source_key) maps to at most one batch until cancel/completion deletes it."""
    first = enqueue(store, draft(key="k"))
    assert enqueue(store, draft(key="k")).batch_id == first.batch_id
    assert len(query(store, "SELECT batch_id FROM queued_work_batches")) == 1

    assert cancel(store, first.batch_id) is not None
    second = enqueue(store, draft(turn({"new": 1}), key="k"))
    assert second.batch_id != first.batch_id
    assert second.enqueue_seq > first.enqueue_seq

    fence = take_lease(store)
    claim = claim_ready(store, fence)
    assert claim is not None and ids_of(claim.batches) == [second.batch_id]
    complete(store, fence, claim.completion())
    third = enqueue(store, draft(key="k"))
    assert third.batch_id not in (first.batch_id, second.batch_id)
    assert ids_of(listed(store)) == [third.batch_id]


def test_a_batch_without_payloads_is_refused(store: Store) -> None:
    before = snapshot(store)
    with pytest.raises(InvalidInput, match="payload"):
        enqueue(store, QueuedWorkDraft(session_id=SID, payloads=()))
    assert snapshot(store) == before


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param(lambda: QueuedWorkDraft(session_id="  ", payloads=turn()), id="blank-session"),
        pytest.param(
            lambda: QueuedWorkDraft(session_id=SID, source_key="", payloads=turn()), id="blank-key"
        ),
        pytest.param(
            lambda: QueuedWorkDraft(session_id=SID, payloads=turn(float("nan"))), id="nan-body"
        ),
        pytest.param(
            lambda: QueuedWorkDraft(session_id=SID, payloads=(QueuedWorkPayload(kind=" "),)),
            id="blank-kind",
        ),
        pytest.param(
            lambda: QueuedWorkDraft.model_construct(
                session_id=SID,
                source_key=None,
                delivery_policy="sometimes",
                slot_policy=EXCLUSIVE,
                merge_key=MergeKey.never(),
                available_at_ms=0,
                payloads=turn(),
            ),
            id="unknown-delivery",
        ),
        pytest.param(
            lambda: QueuedWorkDraft(
                session_id=SID, merge_key=MergeKey(kind="group"), payloads=turn()
            ),
            id="group-without-name",
        ),
        pytest.param(
            lambda: QueuedWorkDraft.model_construct(
                session_id=SID,
                source_key=None,
                delivery_policy=EARLIEST,
                slot_policy=EXCLUSIVE,
                merge_key=MergeKey.never(),
                available_at_ms=-1,
                payloads=turn(),
            ),
            id="negative-available-at",
        ),
        pytest.param(lambda: {"session_id": SID, "payloads": []}, id="not-a-draft"),
    ],
)
def test_bad_drafts_are_refused_and_nothing_is_written(store: Store, bad: Any) -> None:
    enqueue(store, draft(key="existing"))
    before = snapshot(store)
    with pytest.raises(InvalidInput):
        enqueue(store, bad())
    assert snapshot(store) == before


def test_writes_are_refused_in_a_read_unit(store: Store) -> None:
    batch = enqueue(store, draft())
    fence = take_lease(store)
    before = snapshot(store)
    with store.read() as uow:
        with pytest.raises(ReadOnlyUnitOfWork):
            uow.queue.enqueue_queued_work(draft())
        with pytest.raises(ReadOnlyUnitOfWork):
            uow.queue.claim_ready_queued_work(SID, fence, A, IDLE, 1)
        with pytest.raises(ReadOnlyUnitOfWork):
            uow.queue.cancel_queued_work_batch(SID, batch.batch_id)
        assert uow.queue.list_queued_work(SID) == [batch]
        assert uow.queue.list_pending_queued_work(SID) == [batch]
    assert snapshot(store) == before


def test_a_fault_mid_enqueue_leaves_no_batch_and_no_item(store: Store, trigger: Any) -> None:
    """A trigger raising at the second item's insert (after the batch row and item 0)."""
    enqueue(store, draft(key="before"))
    before = snapshot(store)
    trigger("fault", "queued_work_items", "NEW.item_index = 1")

    with pytest.raises(DatabaseError, match="injected fault"):
        enqueue(store, draft(turn(1, 2, 3), key="doomed"))
    assert snapshot(store) == before

    # Inside a larger unit that catches the error and goes on, the batch is still gone
    # (the enqueue's own savepoint), and the unit's other work commits.
    with store.write() as uow:
        with pytest.raises(DatabaseError, match="injected fault"):
            uow.queue.enqueue_queued_work(draft(turn(1, 2), key="doomed"))
        kept = uow.queue.enqueue_queued_work(draft(turn(1), key="kept"))
    assert ids_of(listed(store)) == [before[0][0]["batch_id"], kept.batch_id]
    assert query(store, "SELECT COUNT(*) AS n FROM queued_work_items")[0]["n"] == 2


# --------------------------------------------------------------------------
# Claims (§2.6.2–2.6.5)


def test_q_02_leading_session_command_is_claimed_alone(store: Store, clock: SettableClock) -> None:
    cmd = enqueue(store, draft(command()))
    second = enqueue(store, draft(command({"cmd": "other"})))
    fence = take_lease(store)

    claim = claim_leading(store, fence)
    assert claim is not None
    assert ids_of(claim.batches) == [cmd.batch_id]
    assert claim.claim_id == f"qwc:{cmd.enqueue_seq}:1"
    assert claim.fencing_token == 1
    assert claim.session_lease_generation == fence.fencing_token
    assert claim.owner == A
    assert claim.lease_token == claim_lease_token(SID, A, claim.claim_id, clock.now_ms())
    # The returned batches are the snapshots loaded before the claim UPDATE (§2.6.2).
    assert claim.batches[0].claim_token is None
    assert claim.batches[0].claim_fencing_token == 0

    stored = row(store, cmd.batch_id)
    assert stored["claim_id"] == claim.claim_id
    assert stored["claim_token"] == claim.lease_token
    assert (stored["claim_owner_id"], stored["claim_owner_incarnation_id"]) == ("owner-a", "inc-a")
    assert stored["claim_owner_liveness_json"] == '{"kind":"opaque"}'
    assert stored["claim_fencing_token"] == 1
    assert stored["claim_session_lease_generation"] == fence.fencing_token
    assert row(store, second.batch_id)["claim_token"] is None
    assert listed(store)[0].claim_owner == A


def test_q_03_leading_turn_work_is_not_a_session_command(store: Store) -> None:
    enqueue(store, draft())
    enqueue(store, draft(command()))
    fence = take_lease(store)
    before = snapshot(store)
    assert claim_leading(store, fence) is None
    assert snapshot(store) == before


def test_q_04_a_ready_session_command_at_the_head_blocks_turn_work(store: Store) -> None:
    enqueue(store, draft(command()))
    enqueue(store, draft())
    fence = take_lease(store)
    before = snapshot(store)
    assert claim_ready(store, fence, 8, IDLE) is None
    assert snapshot(store) == before


def test_q_05_a_future_batch_does_not_block_later_ready_work(
    store: Store, clock: SettableClock
) -> None:
    later = enqueue(store, draft(available_at=clock.now_ms() + 1000))
    ready = enqueue(store, draft())
    fence = take_lease(store)

    claim = claim_ready(store, fence)
    assert claim is not None and ids_of(claim.batches) == [ready.batch_id]

    clock.advance(999)
    assert claim_ready(store, fence) is None
    clock.advance(1)  # READY is inclusive: available_at_ms <= now
    claim2 = claim_ready(store, fence)
    assert claim2 is not None and ids_of(claim2.batches) == [later.batch_id]


def test_q_06_join_group_claims_up_to_max_batches(store: Store) -> None:
    batches = [enqueue(store, joined("a")) for _ in range(4)]
    fence = take_lease(store)

    claim = claim_ready(store, fence, max_batches=3)
    assert claim is not None
    assert ids_of(claim.batches) == ids_of(batches[:3])
    assert claim.claim_id == f"qwc:{batches[0].enqueue_seq}:1"
    assert owned_by(store, claim) == set(ids_of(batches[:3]))
    assert row(store, batches[3].batch_id)["claim_token"] is None


def test_q_07_join_batches_with_different_keys_are_claimed_apart(store: Store) -> None:
    first = enqueue(store, joined("a"))
    enqueue(store, joined("b"))
    fence = take_lease(store)
    claim = claim_ready(store, fence)
    assert claim is not None and ids_of(claim.batches) == [first.batch_id]


def test_join_grouping_needs_a_mergeable_key_and_equal_policies(store: Store) -> None:
    """§4.2: a Never key or an Exclusive head claims one; a policy change ends the group."""
    never = [enqueue(store, draft(slot=JOIN, merge=MergeKey.never())) for _ in range(2)]
    exclusive = enqueue(store, draft(slot=EXCLUSIVE, merge=MergeKey.of_group("a")))
    group = [enqueue(store, joined("a")) for _ in range(2)]
    other_policy = enqueue(store, joined("a", delivery=AFTER_COMMIT))
    command_after = enqueue(store, draft(command(), slot=JOIN, merge=MergeKey.of_group("a")))
    fence = take_lease(store)

    got = []
    for _ in range(6):
        claim = claim_ready(store, fence)
        if claim is None:
            break
        got.append(ids_of(claim.batches))
    assert got == [
        [never[0].batch_id],
        [never[1].batch_id],
        [exclusive.batch_id],
        ids_of(group),
        [other_policy.batch_id],
    ]  # then the session command at the head blocks turn work
    leading = claim_leading(store, fence)
    assert leading is not None and ids_of(leading.batches) == [command_after.batch_id]


def test_q_08_active_turn_checkpoint_needs_earliest_safe_boundary(store: Store) -> None:
    enqueue(store, draft(delivery=AFTER_COMMIT))
    fence = take_lease(store)
    before = snapshot(store)
    assert claim_ready(store, fence, boundary=AT_CHECKPOINT) is None
    assert snapshot(store) == before
    assert claim_ready(store, fence, boundary=IDLE) is not None

    safe = enqueue(store, draft(delivery=EARLIEST))
    claim = claim_ready(store, fence, boundary=AT_CHECKPOINT)
    assert claim is not None and ids_of(claim.batches) == [safe.batch_id]


def test_q_09_zero_max_batches_returns_none_without_a_lease_check(store: Store) -> None:
    enqueue(store, draft())
    fence = take_lease(store)
    stale = fence.model_copy(update={"fencing_token": fence.fencing_token + 5})
    nowhere = fence.model_copy(update={"session_id": "no-such-session"})
    before = snapshot(store)
    assert claim_ready(store, stale, max_batches=0) is None
    assert claim_ready(store, nowhere, max_batches=0, sid="no-such-session") is None
    with store.read() as uow:  # no database access at all, so not even a read-only refusal
        assert uow.queue.claim_ready_queued_work(SID, stale, A, IDLE, 0) is None
    assert snapshot(store) == before


def test_q_10_a_stale_fence_cannot_claim(store: Store, clock: SettableClock) -> None:
    batch = enqueue(store, draft(command()))
    enqueue(store, draft())
    old = take_lease(store)
    wrong_token = old.model_copy(update={"lease_token": "forged"})
    other_session = old.model_copy(update={"session_id": OTHER})
    wrong_incarnation = old.model_copy(
        update={"owner": LeaseOwnerIdentity(owner_id="owner-a", incarnation_id="inc-x")}
    )
    before = snapshot(store)
    for bad in (wrong_token, other_session, wrong_incarnation):
        with pytest.raises(SessionExecutionLeaseExpired):
            claim_ready(store, bad)
    clock.advance(TTL)  # expires_at == now: no longer live
    for call in (
        lambda: claim_ready(store, old),
        lambda: claim_leading(store, old),
        lambda: claim_ids(store, old, [batch.batch_id]),
    ):
        with pytest.raises(SessionExecutionLeaseExpired) as err:
            call()
        assert err.value.session_id == SID
    assert snapshot(store) == before

    expire_and_take_over(store, clock)
    with pytest.raises(SessionExecutionLeaseExpired):
        claim_ready(store, old)


def test_q_11_a_new_generation_reclaims_and_the_old_completion_fails(
    store: Store, clock: SettableClock
) -> None:
    """Q-11; "a commit completing X" is ``complete_queued_work_claim`` here."""
    x = enqueue(store, draft())
    gen1 = take_lease(store)
    old = claim_ready(store, gen1)
    assert old is not None and old.claim_id == f"qwc:{x.enqueue_seq}:1"

    gen2 = expire_and_take_over(store, clock)
    assert gen2.fencing_token == gen1.fencing_token + 1
    new = claim_ready(store, gen2)
    assert new is not None and ids_of(new.batches) == [x.batch_id]
    assert new.claim_id == f"qwc:{x.enqueue_seq}:2"
    assert new.lease_token != old.lease_token
    assert new.session_lease_generation == gen2.fencing_token
    assert new.batches[0].claim_id == old.claim_id  # as loaded before the UPDATE

    before = snapshot(store)
    with pytest.raises(SessionExecutionLeaseExpired):  # the gen-1 holder's own fence fails
        complete(store, gen1, old.completion())
    with pytest.raises(QueuedWorkClaimSuperseded) as err:  # even with a valid fence
        complete(store, gen2, old.completion())
    assert (err.value.session_id, err.value.claim_id) == (SID, old.claim_id)
    assert snapshot(store) == before

    complete(store, gen2, new.completion())
    assert listed(store) == []
    assert query(store, "SELECT * FROM queued_work_items") == []


def test_q_12_a_row_claimed_in_the_current_generation_is_skipped(store: Store) -> None:
    x = enqueue(store, draft())
    fence = take_lease(store)
    assert claim_ready(store, fence) is not None
    before = snapshot(store)
    assert claim_ready(store, fence) is None
    assert claim_ids(store, fence, [x.batch_id]) is None
    assert snapshot(store) == before

    y = enqueue(store, draft())
    claim = claim_ready(store, fence)
    assert claim is not None and ids_of(claim.batches) == [y.batch_id]


def test_q_13_a_corrupt_batch_in_the_scan_window_fails_the_claim(store: Store) -> None:
    """Q-13: mixed payload classes behind a healthy head → SessionCorrupt (spec: Backend)."""
    enqueue(store, draft())
    mixed = enqueue(store, draft((*command(), *turn())))
    fence = take_lease(store)
    before = snapshot(store)
    with pytest.raises(SessionCorrupt) as err:
        claim_ready(store, fence, max_batches=1)
    assert err.value.key == mixed.batch_id
    assert "mixed or empty payload classes" in str(err.value)
    with pytest.raises(SessionCorrupt):
        claim_leading(store, fence)
    assert snapshot(store) == before

    # An empty batch (items deleted behind the store's back) is corrupt too.
    assert cancel(store, mixed.batch_id) is not None
    empty = enqueue(store, draft())
    execute_sql(store, "DELETE FROM queued_work_items WHERE batch_id = :b", b=empty.batch_id)
    with pytest.raises(SessionCorrupt) as err:
        claim_ready(store, fence, max_batches=1)
    assert err.value.key == empty.batch_id
    # By ids it is only "not turn work": None, not an error.
    assert claim_ids(store, fence, [empty.batch_id]) is None


def test_a_corrupt_batch_beyond_the_scan_window_does_not_fail_the_claim(store: Store) -> None:
    """The window of ``claim_ready(max=1)`` is 33 rows (§4.5); row 34 is not read."""
    healthy = [enqueue(store, draft()) for _ in range(33)]
    enqueue(store, draft((*command(), *turn())))
    fence = take_lease(store)
    claim = claim_ready(store, fence, max_batches=1)
    assert claim is not None and ids_of(claim.batches) == [healthy[0].batch_id]
    with pytest.raises(SessionCorrupt):  # the window now reaches it
        claim_ready(store, fence, max_batches=1)


def test_q_14_by_ids_with_a_missing_future_or_current_claimed_head_is_none(
    store: Store, clock: SettableClock
) -> None:
    y = enqueue(store, joined("a"))
    future = enqueue(store, joined("a", available_at=clock.now_ms() + 10))
    taken = enqueue(store, joined("a"))
    fence = take_lease(store)
    assert claim_ids(store, fence, [taken.batch_id]) is not None
    before = snapshot(store)

    for first in ("qwb:missing", future.batch_id, taken.batch_id):
        assert claim_ids(store, fence, [first, y.batch_id]) is None
    assert claim_ids(store, fence, [y.batch_id, "qwb:missing"]) is None
    assert snapshot(store) == before
    assert row(store, y.batch_id)["claim_token"] is None


def test_q_15_by_ids_refuses_session_commands(store: Store) -> None:
    x = enqueue(store, joined("a"))
    cmd = enqueue(store, draft(command(), slot=JOIN, merge=MergeKey.of_group("a")))
    mixed = enqueue(store, draft((*turn(), *command()), slot=JOIN, merge=MergeKey.of_group("a")))
    fence = take_lease(store)
    before = snapshot(store)
    assert claim_ids(store, fence, [x.batch_id, cmd.batch_id]) is None
    assert claim_ids(store, fence, [cmd.batch_id]) is None
    assert claim_ids(store, fence, [x.batch_id, mixed.batch_id]) is None
    assert snapshot(store) == before


def test_q_16_duplicate_ids_roll_the_claim_back(store: Store) -> None:
    """[X, X] of a Join batch: the second UPDATE fails its fence; X is left as it was."""
    x = enqueue(store, joined("a"))
    exclusive = enqueue(store, draft())
    fence = take_lease(store)
    before = snapshot(store)
    assert claim_ids(store, fence, [x.batch_id, x.batch_id]) is None
    assert claim_ids(store, fence, [exclusive.batch_id, exclusive.batch_id]) is None
    assert snapshot(store) == before
    claim = claim_ids(store, fence, [x.batch_id])
    assert claim is not None and claim.claim_id == f"qwc:{x.enqueue_seq}:1"


def test_q_17_by_ids_claims_in_the_given_order(store: Store) -> None:
    x = enqueue(store, joined("a"))
    enqueue(store, joined("a"))  # in between: not named, not claimed
    y = enqueue(store, joined("a"))
    fence = take_lease(store)
    claim = claim_ids(store, fence, [y.batch_id, x.batch_id])
    assert claim is not None
    assert ids_of(claim.batches) == [y.batch_id, x.batch_id]
    assert claim.claim_id == f"qwc:{y.enqueue_seq}:1"
    assert owned_by(store, claim) == {x.batch_id, y.batch_id}


def test_by_ids_needs_one_admissible_group(store: Store) -> None:
    a1 = enqueue(store, joined("a"))
    b1 = enqueue(store, joined("b"))
    a2 = enqueue(store, joined("a", delivery=AFTER_COMMIT))
    e1 = enqueue(store, draft())
    e2 = enqueue(store, draft())
    fence = take_lease(store)
    before = snapshot(store)
    assert claim_ids(store, fence, [a1.batch_id, b1.batch_id]) is None  # other merge key
    assert claim_ids(store, fence, [a1.batch_id, a2.batch_id]) is None  # other policy
    assert claim_ids(store, fence, [e1.batch_id, e2.batch_id]) is None  # exclusive head
    assert claim_ids(store, fence, [a2.batch_id], AT_CHECKPOINT) is None  # boundary gate
    assert claim_ids(store, fence, []) is None
    assert snapshot(store) == before
    claim = claim_ids(store, fence, [e2.batch_id])  # not the queue head: by ids may skip
    assert claim is not None and ids_of(claim.batches) == [e2.batch_id]


def test_q_18_abandon_clears_the_claim_and_keeps_the_counter(store: Store) -> None:
    x = enqueue(store, draft())
    fence = take_lease(store)
    claim = claim_ready(store, fence)
    assert claim is not None
    abandon(store, claim)

    stored = row(store, x.batch_id)
    for column in ("claim_id", "claim_owner_id", "claim_owner_incarnation_id"):
        assert stored[column] is None
    assert (stored["claim_owner_liveness_json"], stored["claim_token"]) == (None, None)
    assert stored["claim_session_lease_generation"] == 0
    assert stored["claim_fencing_token"] == 1
    assert pending(store)[0].batch_id == x.batch_id

    again = claim_ready(store, fence)
    assert again is not None and again.claim_id == f"qwc:{x.enqueue_seq}:2"
    abandon(store, again.completion())  # a completion abandons too
    assert row(store, x.batch_id)["claim_token"] is None


def test_q_19_an_old_claimants_abandon_is_a_no_op(store: Store, clock: SettableClock) -> None:
    enqueue(store, draft())
    old = claim_ready(store, take_lease(store))
    assert old is not None
    new = claim_ready(store, expire_and_take_over(store, clock))
    assert new is not None
    before = snapshot(store)
    abandon(store, old)
    assert snapshot(store) == before
    assert owned_by(store, new) == set(ids_of(new.batches))


def test_q_20_cancel_returns_the_unclaimed_batch_and_deletes_its_items(store: Store) -> None:
    x = enqueue(store, draft(turn(1, 2, 3)))
    y = enqueue(store, draft())
    got = cancel(store, x.batch_id)
    assert got == x
    assert ids_of(listed(store)) == [y.batch_id]
    assert query(store, "SELECT * FROM queued_work_items WHERE batch_id = :b", b=x.batch_id) == []
    assert cancel(store, x.batch_id) is None


def test_q_21_a_live_claimed_batch_cannot_be_cancelled(store: Store) -> None:
    x = enqueue(store, draft())
    assert claim_ready(store, take_lease(store)) is not None
    before = snapshot(store)
    assert cancel(store, x.batch_id) is None
    assert snapshot(store) == before


@pytest.mark.parametrize("how", ["expired", "released", "taken-over"])
def test_q_22_a_stale_claimed_batch_can_be_cancelled(
    store: Store, clock: SettableClock, how: str
) -> None:
    x = enqueue(store, draft(turn("a", "b")))
    fence = take_lease(store)
    claim = claim_ready(store, fence)
    assert claim is not None
    if how == "expired":
        clock.advance(TTL)
    elif how == "released":
        store.leases.release_session_execution_lease(fence)
    else:
        expire_and_take_over(store, clock)
    got = cancel(store, x.batch_id)
    assert got is not None and got.claim_id == claim.claim_id
    assert [i.payload.body for i in got.items] == ["a", "b"]
    assert listed(store) == []
    assert query(store, "SELECT * FROM queued_work_items") == []


def test_cancel_is_scoped_to_the_session(store: Store) -> None:
    x = enqueue(store, draft())
    before = snapshot(store)
    assert cancel(store, x.batch_id, sid=OTHER) is None
    assert cancel(store, "qwb:unknown") is None
    assert snapshot(store) == before


def test_q_23_pending_lists_unclaimed_stale_and_future_batches(
    store: Store, clock: SettableClock
) -> None:
    u = enqueue(store, draft())
    live = enqueue(store, draft())
    stale = enqueue(store, draft())
    future = enqueue(store, draft(available_at=clock.now_ms() + 60_000))
    gen1 = take_lease(store)
    assert claim_ids(store, gen1, [stale.batch_id]) is not None
    store.leases.release_session_execution_lease(gen1)
    gen2 = take_lease(store, B)
    assert claim_ids(store, gen2, [live.batch_id]) is not None

    assert ids_of(pending(store)) == [u.batch_id, stale.batch_id, future.batch_id]
    everything = listed(store)
    assert ids_of(everything) == [u.batch_id, live.batch_id, stale.batch_id, future.batch_id]
    assert everything[1].claim_owner == B
    assert everything[2].claim_session_lease_generation == gen1.fencing_token
    assert pending(store, OTHER) == [] and listed(store, OTHER) == []

    clock.advance(TTL)  # gen2 expires: its claim is stale too
    assert len(pending(store)) == 4


def test_q_25_completion_deletes_only_rows_matching_claim_id_and_token(store: Store) -> None:
    """Q-25 ("a commit completing" = ``complete_queued_work_claim``)."""
    a, b = enqueue(store, joined("a", payloads=turn(1, 2))), enqueue(store, joined("a"))
    c, d = enqueue(store, draft()), enqueue(store, draft())
    fence = take_lease(store)
    q1 = claim_ready(store, fence)
    q2 = claim_ready(store, fence)
    assert q1 is not None and ids_of(q1.batches) == [a.batch_id, b.batch_id]
    assert q2 is not None and ids_of(q2.batches) == [c.batch_id]
    # A row carrying q1's claim id but another token is not q1's.
    assert claim_ready(store, fence) is not None
    execute_sql(
        store,
        "UPDATE queued_work_batches SET claim_id = :c WHERE batch_id = :b",
        c=q1.claim_id,
        b=d.batch_id,
    )

    complete(store, fence, q1.completion())
    assert ids_of(listed(store)) == [c.batch_id, d.batch_id]
    assert owned_by(store, q2) == {c.batch_id}
    items = query(store, "SELECT batch_id FROM queued_work_items")
    assert {r["batch_id"] for r in items} == {c.batch_id, d.batch_id}


# --------------------------------------------------------------------------
# Completion checks (§4.7, strict), C-13..C-15


def test_c_13_a_superseded_claim_cannot_complete(store: Store, clock: SettableClock) -> None:
    enqueue(store, joined("a"))
    enqueue(store, joined("a"))
    q = claim_ready(store, take_lease(store))
    assert q is not None and len(q.batches) == 2
    gen2 = expire_and_take_over(store, clock)
    q2 = claim_ready(store, gen2)
    assert q2 is not None
    before = snapshot(store)
    with pytest.raises(QueuedWorkClaimSuperseded):
        complete(store, gen2, q.completion())
    assert snapshot(store) == before
    assert owned_by(store, q2) == set(ids_of(q2.batches))


def test_c_14_completion_must_name_exactly_the_owned_rows(store: Store) -> None:
    """C-14, changed by spec/README.md (strict completion).

    The seed's count-only check let ``[A, C]`` pass for a claim owning
    ``{A, B}`` (2 = 2), deleting A and leaving B claimed. The strict check
    refuses it — and duplicates, missing and extra ids — and deletes nothing.
    """
    a, b = enqueue(store, joined("a")), enqueue(store, joined("a"))
    c = enqueue(store, draft())
    fence = take_lease(store)
    q = claim_ready(store, fence)
    assert q is not None and ids_of(q.batches) == [a.batch_id, b.batch_id]
    before = snapshot(store)

    def with_ids(*ids: str) -> QueuedWorkCompletion:
        return q.completion().model_copy(update={"batch_ids": ids})

    for bad in (
        with_ids(a.batch_id, c.batch_id),
        with_ids(a.batch_id, a.batch_id),
        with_ids(a.batch_id),
        with_ids(a.batch_id, b.batch_id, c.batch_id),
        with_ids(a.batch_id, b.batch_id, b.batch_id),
    ):
        with pytest.raises(QueuedWorkClaimSuperseded):
            complete(store, fence, bad)
        with pytest.raises(QueuedWorkClaimSuperseded), store.read() as uow:
            uow.queue.ensure_queued_work_completion(bad)
    assert snapshot(store) == before

    complete(store, fence, with_ids(b.batch_id, a.batch_id))  # order does not matter
    assert ids_of(listed(store)) == [c.batch_id]


def test_c_15_a_completion_for_another_session_is_superseded(store: Store) -> None:
    enqueue(store, draft())
    enqueue(store, draft(sid=OTHER))
    fence = take_lease(store)
    other_fence = take_lease(store, sid=OTHER)
    q_other = claim_ready(store, other_fence, sid=OTHER)
    assert q_other is not None
    before = snapshot(store)
    with pytest.raises(QueuedWorkClaimSuperseded) as err:
        complete(store, fence, q_other.completion())
    assert (err.value.session_id, err.value.claim_id) == (OTHER, q_other.claim_id)
    assert snapshot(store) == before


def test_module_level_completion_check_and_delete(store: Store) -> None:
    """The functions the session commit will call inside its own write unit."""
    x = enqueue(store, draft())
    q = claim_ready(store, take_lease(store))
    assert q is not None
    with store.write() as uow:
        queue_mod.ensure_queued_work_completion(uow.driver, q.completion())
        queue_mod.delete_completed_queued_work(uow.driver, q.completion())
        with pytest.raises(QueuedWorkClaimSuperseded):  # already gone
            queue_mod.ensure_queued_work_completion(uow.driver, q.completion())
    assert cancel(store, x.batch_id) is None
    assert listed(store) == []


def test_completion_with_a_stale_fence_is_refused(store: Store, clock: SettableClock) -> None:
    enqueue(store, draft())
    fence = take_lease(store)
    q = claim_ready(store, fence)
    assert q is not None
    clock.advance(TTL)
    before = snapshot(store)
    with pytest.raises(SessionExecutionLeaseExpired):
        complete(store, fence, q.completion())
    assert snapshot(store) == before
    # The next holder may complete a claim of an earlier generation it did not re-claim.
    complete(store, take_lease(store, B), q.completion())
    assert listed(store) == []


# --------------------------------------------------------------------------
# Invariants I-4, I-5, I-7


def test_i_4_a_claim_that_loses_a_row_writes_nothing(store: Store, trigger: Any) -> None:
    """I-4: the second row's fenced UPDATE matches nothing (a trigger skips it): no row claimed.

    Inside a unit of work, only the claim's own writes roll back (savepoint);
    the unit's earlier enqueue commits.
    """
    x, y = enqueue(store, joined("a")), enqueue(store, joined("a"))
    solo = enqueue(store, draft())
    fence = take_lease(store)
    trigger("skip", "queued_work_batches", f"OLD.batch_id IN ('{y.batch_id}', '{solo.batch_id}')")
    before = snapshot(store)

    assert claim_ready(store, fence) is None
    assert claim_ids(store, fence, [y.batch_id, x.batch_id]) is None
    assert claim_ids(store, fence, [solo.batch_id]) is None
    assert snapshot(store) == before

    with store.write() as uow:
        kept = uow.queue.enqueue_queued_work(draft(key="kept"))
        assert uow.queue.claim_ready_queued_work(SID, fence, A, IDLE, 8) is None
    assert ids_of(listed(store)) == [x.batch_id, y.batch_id, solo.batch_id, kept.batch_id]
    assert all(b.claim_token is None for b in listed(store))


def test_a_claim_of_many_batches_stamps_them_by_sixteen_all_or_none(
    store: Store, backend: str, trigger: Any
) -> None:
    """A claim of 20 batches by id stamps them in two UPDATEs (16 rows, then 4) and
    keeps the claim's order; when one row of the second UPDATE is lost (a trigger
    skips it), the claim is None and the first UPDATE's 16 stamps are taken back."""
    batches = [enqueue(store, joined("a")) for _ in range(20)]
    order = ids_of(reversed(batches))
    fence = take_lease(store)
    log = _sqlite_log(store) if backend == "sqlite" else []

    claim = claim_ids(store, fence, order)
    assert claim is not None and ids_of(claim.batches) == order
    if backend == "sqlite":
        stamps = [sql for sql in log if sql.startswith("UPDATE queued_work_batches")]
        assert len(stamps) == 2, stamps
    stamped = [row(store, batch_id) for batch_id in order]
    assert {r["claim_token"] for r in stamped} == {claim.lease_token}
    assert [r["claim_fencing_token"] for r in stamped] == [1] * 20
    abandon(store, claim)

    trigger("skip", "queued_work_batches", f"OLD.batch_id = '{order[18]}'")
    before = snapshot(store)
    assert claim_ids(store, fence, order) is None
    assert snapshot(store) == before


def test_i_5_the_row_counter_grows_by_one_per_claim_and_saturates(
    store: Store, clock: SettableClock
) -> None:
    x = enqueue(store, draft())
    fence = take_lease(store)
    for expected in (1, 2, 3):
        claim = claim_ready(store, fence)
        assert claim is not None and claim.fencing_token == expected
        assert row(store, x.batch_id)["claim_fencing_token"] == expected
        abandon(store, claim)
        assert row(store, x.batch_id)["claim_fencing_token"] == expected
    # A new generation re-claiming a stale claim also adds exactly one.
    assert claim_ready(store, fence) is not None
    claim = claim_ready(store, expire_and_take_over(store, clock))
    assert claim is not None and claim.fencing_token == 5

    execute_sql(
        store,
        "UPDATE queued_work_batches SET claim_fencing_token = :v, claim_token = NULL",
        v=MAX_I64 - 1,
    )
    fence = take_lease(store, B)
    for _ in range(2):  # MAX-1 → MAX, then stays at MAX
        claim = claim_ready(store, fence)
        assert claim is not None
        assert claim.claim_id == f"qwc:{x.enqueue_seq}:{MAX_I64}"
        assert row(store, x.batch_id)["claim_fencing_token"] == MAX_I64
        abandon(store, claim)


def test_i_7_a_superseded_claimant_cannot_touch_reclaimed_rows(
    store: Store, clock: SettableClock
) -> None:
    """I-7: abandon and completion of the old claim match no row once it is re-claimed."""
    enqueue(store, joined("a"))
    enqueue(store, joined("a"))
    old = claim_ready(store, take_lease(store))
    assert old is not None
    gen2 = expire_and_take_over(store, clock)
    new = claim_ready(store, gen2)
    assert new is not None
    before = snapshot(store)
    abandon(store, old)
    abandon(store, old.completion())
    with pytest.raises(QueuedWorkClaimSuperseded):
        complete(store, gen2, old.completion())
    assert snapshot(store) == before


def test_claims_never_touch_another_sessions_rows(store: Store) -> None:
    mine = enqueue(store, draft())
    theirs = enqueue(store, draft(sid=OTHER))
    fence = take_lease(store)
    claim = claim_ready(store, fence)
    assert claim is not None and ids_of(claim.batches) == [mine.batch_id]
    assert claim_ids(store, fence, [theirs.batch_id]) is None
    assert row(store, theirs.batch_id)["claim_token"] is None


def test_the_largest_max_batches_saturates_the_scan_limit(store: Store) -> None:
    group = [enqueue(store, joined("a")) for _ in range(3)]
    assert queue_mod.claim_scan_limit(MAX_I64) == MAX_I64
    assert queue_mod.claim_scan_limit(5) == 37
    claim = claim_ready(store, take_lease(store), max_batches=MAX_I64)
    assert claim is not None and ids_of(claim.batches) == ids_of(group)


# --------------------------------------------------------------------------
# Bad input and corrupt rows


def test_bad_claim_arguments_are_refused_before_anything_is_written(store: Store) -> None:
    x = enqueue(store, draft())
    fence = take_lease(store)
    before = snapshot(store)

    def q(fn: Any) -> Any:
        return store.call_write(lambda r: fn(r.queue))

    calls = [
        lambda r: r.claim_ready_queued_work(SID, fence, A, IDLE, -1),
        lambda r: r.claim_ready_queued_work(SID, fence, A, IDLE, MAX_I64 + 1),
        lambda r: r.claim_ready_queued_work(SID, fence, A, IDLE, True),
        lambda r: r.claim_ready_queued_work(SID, fence, A, IDLE, 1.0),
        lambda r: r.claim_ready_queued_work(SID, fence, A, IDLE, "3"),
        lambda r: r.claim_ready_queued_work(SID, fence, A, "idle", 1),
        lambda r: r.claim_ready_queued_work(" ", fence, A, IDLE, 1),
        lambda r: r.claim_ready_queued_work(SID, "fence", A, IDLE, 1),
        lambda r: r.claim_ready_queued_work(SID, fence, "owner-a", IDLE, 1),
        lambda r: r.claim_ready_queued_work(
            SID, fence, LeaseOwnerIdentity(owner_id="", incarnation_id="i"), IDLE, 1
        ),
        lambda r: r.claim_leading_ready_session_command("", fence, A),
        lambda r: r.claim_leading_ready_session_command(SID, None, A),
        lambda r: r.claim_ready_queued_work_by_batch_ids(SID, fence, A, IDLE, x.batch_id),
        lambda r: r.claim_ready_queued_work_by_batch_ids(SID, fence, A, IDLE, [x.batch_id, ""]),
        lambda r: r.claim_ready_queued_work_by_batch_ids(SID, fence, A, IDLE, [None]),
        lambda r: r.cancel_queued_work_batch(SID, " "),
        lambda r: r.cancel_queued_work_batch("", x.batch_id),
        lambda r: r.abandon_queued_work_claim("qwc:1:1"),
        lambda r: r.complete_queued_work_claim(fence, "qwc:1:1"),
        lambda r: r.complete_queued_work_claim(
            fence,
            QueuedWorkCompletion(session_id=SID, claim_id="qwc:1:1", lease_token="t", batch_ids=()),
        ),
        lambda r: r.list_queued_work(""),
        lambda r: r.list_pending_queued_work("\x00"),
    ]
    for call in calls:
        with pytest.raises(InvalidInput):
            q(call)
    assert snapshot(store) == before


@pytest.mark.parametrize(
    ("column", "value"),
    [
        ("delivery_policy", "sometimes"),
        ("slot_policy", "shared"),
        ("merge_key_json", "{not json"),
        ("merge_key_json", '{"team":"a"}'),
    ],
)
def test_unknown_stored_policies_fail_claims_and_lists_naming_the_row(
    store: Store, column: str, value: str
) -> None:
    enqueue(store, draft())
    bad = enqueue(store, draft())
    execute_sql(
        store,
        f"UPDATE queued_work_batches SET {column} = :v WHERE batch_id = :b",
        v=value,
        b=bad.batch_id,
    )
    fence = take_lease(store)
    before = snapshot(store)
    calls = [
        lambda: claim_ready(store, fence, max_batches=1),
        lambda: claim_leading(store, fence),
        lambda: claim_ids(store, fence, [bad.batch_id]),
        lambda: listed(store),
        lambda: pending(store),
        lambda: cancel(store, bad.batch_id),
    ]
    for call in calls:
        with pytest.raises(SessionCorrupt) as err:
            call()
        assert (err.value.table, err.value.key, err.value.column) == (
            "queued_work_batches",
            bad.batch_id,
            column,
        )
        assert bad.batch_id in str(err.value)
    assert snapshot(store) == before


@pytest.mark.parametrize("payload", ["{broken", '["no kind"]', '{"kind":7}', "NaN"])
def test_corrupt_payload_json_fails_claims_and_lists(store: Store, payload: str) -> None:
    bad = enqueue(store, draft(turn(1, 2)))
    execute_sql(
        store,
        "UPDATE queued_work_items SET payload_json = :p WHERE batch_id = :b AND item_index = 1",
        p=payload,
        b=bad.batch_id,
    )
    fence = take_lease(store)
    before = snapshot(store)
    for call in (lambda: claim_ready(store, fence), lambda: listed(store)):
        with pytest.raises(SessionCorrupt) as err:
            call()
        assert (err.value.table, err.value.key, err.value.column) == (
            "queued_work_items",
            f"{bad.batch_id}:1",
            "payload_json",
        )
    assert snapshot(store) == before


@contextmanager
def _one_corrupt_batch(tmp_path: Any, sql: str) -> Iterator[tuple[Store, QueuedWorkBatch]]:
    """A SQLite file store holding one enqueued batch, then ``sql`` run on it (``:b``: its id)."""
    store = Store.open(f"sqlite:///{tmp_path / 'q.db'}", migrate=True, clock=SettableClock(1000))
    try:
        bad = enqueue(store, draft())
        execute_sql(store, sql, b=bad.batch_id)
        yield store, bad
    finally:
        store.close()


@pytest.mark.parametrize("builder", ["checked", "validating"])
def test_a_corrupt_row_counter_is_refused_not_read_as_zero(
    tmp_path: Any, builder: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SQLite only: text in an INTEGER column (Postgres' BIGINT cannot hold it).

    ``validating``: batches built by validation, as they are where the running
    pydantic's build cannot be checked (checked_builder's fallback): still
    SessionCorrupt naming the column, never pydantic's ValidationError."""
    if builder == "validating":
        monkeypatch.setattr(codec, "checked_batch", QueuedWorkBatch)
    sql = "UPDATE queued_work_batches SET claim_fencing_token = 'many' WHERE batch_id = :b"
    with _one_corrupt_batch(tmp_path, sql) as (store, bad):
        fence = take_lease(store)
        for call in (lambda: claim_ready(store, fence), lambda: listed(store)):
            with pytest.raises(SessionCorrupt) as err:
                call()
            assert (err.value.key, err.value.column) == (bad.batch_id, "claim_fencing_token")


@pytest.mark.parametrize("builder", ["checked", "validating"])
def test_a_corrupt_item_index_is_refused_naming_the_items_table(
    tmp_path: Any, builder: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SQLite only: text in the items' INTEGER ``item_index``. SessionCorrupt naming the
    item and its column, whichever way records are built (never read as it is)."""
    if builder == "validating":
        monkeypatch.setattr(codec, "checked_item", QueuedWorkItem)
    sql = "UPDATE queued_work_items SET item_index = 'x' WHERE batch_id = :b"
    with _one_corrupt_batch(tmp_path, sql) as (store, bad):
        with pytest.raises(SessionCorrupt) as err:
            listed(store)
        assert (err.value.table, err.value.key, err.value.column) == (
            "queued_work_items",
            f"{bad.batch_id}:x",
            "item_index",
        )


# --------------------------------------------------------------------------
# Cost: the claim scan uses ix_queued_work_batches_session_seq


def test_the_claim_scan_uses_the_session_seq_index(store: Store) -> None:
    """EXPLAIN of the claim scan (analysed tables) names the index.

    5,000 batches, 100 of them in the scanned session, the rest spread over 97
    others: the window of 33 comes off the (session_id, enqueue_seq) index in
    order, neither from a scan of the whole queue nor a sort of the session.
    """
    with store.write() as uow:
        uow.connection.execute(
            text(
                "INSERT INTO queued_work_batches (batch_id, session_id, delivery_policy, "
                "slot_policy, merge_key_json, available_at_ms, enqueued_at_ms) "
                "VALUES (:b, :s, 'earliest_safe_boundary', 'exclusive', '\"never\"', 0, 0)"
            ),
            [{"b": f"qwb:{i}", "s": "s-7" if i % 50 == 0 else f"s-x{i % 97}"} for i in range(5000)],
        )
    with store.write() as uow:
        uow.connection.execute(text("ANALYZE"))
    params = {"sid": "s-7", "now": 1, "generation": 1, "limit": 33}
    with store.read() as uow:
        rows = explain(uow, queue_mod._SCAN, params)
    plan = "\n".join(str(r) for r in rows)
    assert "ix_queued_work_batches_session_seq" in plan, plan
