"""Pending turn inputs (spec sessions §2.7, §3.1, §4.6, §4.8, §4.13, §4.15), both backends.

Every turn-input scenario of §5.2 that needs no concurrency is one test named
after it (T-23, the takeover race, is in ``test_turn_input_races.py``), plus:
the fenced recovery of stale ``accepted`` claims (spec/README.md decision), the
strict completion (C-16/C-17 style), invariants I-4, I-5, I-6, I-7 and I-10,
refused arguments, corrupt stored values, faults injected mid-claim by
triggers, and the claim scan's index.

Fences come from ``store.leases.try_claim_session_execution_lease``; a lease
expires by moving the ``clock`` fixture past it (no sleeping). "Nothing
changed" is checked on the raw ``pending_turn_inputs`` rows read with SQL
before and after.

Operations the session commit will own later are simulated with the SQL the
spec gives for them, and say so: the interrupted-turn deferral (§2.4 step 16,
T-05) and ``vacuum`` (§2.8.2, T-06).
"""

from __future__ import annotations

import hashlib
import itertools
import re
import sqlite3
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest
from sqlalchemy import create_engine, make_url, text

from agentkeep import migrations as migrate
from agentkeep.clock import SettableClock
from agentkeep.errors import (
    DatabaseError,
    InvalidInput,
    PendingTurnInputSourceKeyConflict,
    ReadOnlyUnitOfWork,
    SessionCorrupt,
    SessionExecutionLeaseExpired,
    TurnInputClaimSuperseded,
    TurnInputDuplicate,
)
from agentkeep.sessions import turn_inputs
from agentkeep.sessions.domain import (
    ActiveTurnIngress,
    ActiveTurnMode,
    AlreadyCancelled,
    AlreadyClaimed,
    AlreadyCompleted,
    AnchorNotFound,
    Cancelled,
    CancelResult,
    CheckpointKind,
    ClaimDiagnostics,
    InputIdTarget,
    LeaseFence,
    LeaseOwnerIdentity,
    MinBoundary,
    NextTurnIngress,
    NextTurnMode,
    NotFoundOutcome,
    PendingTurnInput,
    PendingTurnInputDraft,
    SessionExecutionLease,
    SourceKeyTarget,
    SuffixOutcomes,
    TurnInputClaim,
    TurnInputCompletion,
    TurnInputState,
)
from agentkeep.sessions.turn_inputs import (
    CLAIM_SCAN,
    TurnInputRepository,
    ensure_turn_input_completion,
    rust_debug,
)
from agentkeep.store import Store
from tests.sessions.test_head_read import _sqlite_log
from tests.support import execute_sql, explain, raw_exec

from .support import LeaseTaker, enqueue, turn_input_rows

T = TypeVar("T")

SID = "sess-ti-1"
OTHER = "sess-ti-2"
TTL = 10_000
MAX_I64 = 2**63 - 1
A = LeaseOwnerIdentity(owner_id="owner-A", incarnation_id="inc-A1")
B = LeaseOwnerIdentity(owner_id="owner-B", incarnation_id="inc-B1")
AFTER_WORK = CheckpointKind.AFTER_WORK
BEFORE_COMPLETION = CheckpointKind.BEFORE_COMPLETION
PENDING = TurnInputState.PENDING_ACTIVE
DEFERRED = TurnInputState.DEFERRED_NEXT_TURN
ACCEPTED = TurnInputState.ACCEPTED
CANCELLED = TurnInputState.CANCELLED
COMPLETED = TurnInputState.COMPLETED


# --------------------------------------------------------------------------
# Helpers

hold = LeaseTaker(owner=A, sid=SID, ttl=TTL)


def draft(
    turn: str | None = "T",
    *,
    boundary: MinBoundary = MinBoundary.AFTER_WORK,
    sid: str = SID,
    key: str | None = None,
    input_id: str | None = None,
    value: Any = None,
) -> PendingTurnInputDraft:
    """An ActiveTurn(``turn``) draft, or a NextTurn one when ``turn`` is None."""
    ingress: ActiveTurnIngress | NextTurnIngress = (
        NextTurnIngress()
        if turn is None
        else ActiveTurnIngress(turn_id=turn, min_boundary=boundary)
    )
    return PendingTurnInputDraft(
        session_id=sid,
        input_id=input_id,
        source_key=key,
        ingress=ingress,
        input={"text": f"hello {turn}"} if value is None else value,
    )


def write(store: Store, fn: Callable[[TurnInputRepository], T]) -> T:
    return store.call_write(lambda r: fn(r.turn_inputs))


def read(store: Store, fn: Callable[[TurnInputRepository], T]) -> T:
    return store.call_read(lambda r: fn(r.turn_inputs))


def take_over(
    store: Store, clock: SettableClock, owner: LeaseOwnerIdentity = B, sid: str = SID
) -> SessionExecutionLease:
    """Let the current lease expire, then acquire the next generation as ``owner``."""
    clock.advance(TTL + 1)
    return hold(store, owner, sid)


def claim_active(
    store: Store,
    fence: LeaseFence,
    turn: str = "T",
    checkpoint: CheckpointKind = AFTER_WORK,
    max_inputs: int = 10,
) -> TurnInputClaim | None:
    return write(
        store,
        lambda t: t.claim_active_turn_inputs(
            fence.session_id, fence, fence.owner, turn, checkpoint, max_inputs
        ),
    )


def claim_next(store: Store, fence: LeaseFence, max_inputs: int = 10) -> TurnInputClaim | None:
    return write(
        store,
        lambda t: t.claim_next_turn_inputs(fence.session_id, fence, fence.owner, max_inputs),
    )


def claimed(c: TurnInputClaim | None) -> TurnInputClaim:
    assert c is not None
    return c


def complete(store: Store, fence: LeaseFence, completion: TurnInputCompletion) -> None:
    write(store, lambda t: t.complete_turn_input_claim(fence, completion))


def cancel(store: Store, *targets: Any, sid: str = SID) -> list[CancelResult]:
    return write(store, lambda t: t.cancel_pending_turn_inputs(sid, list(targets)))


def by_id(x: PendingTurnInput | str) -> InputIdTarget:
    return InputIdTarget(input_id=x if isinstance(x, str) else x.input_id)


def all_inputs(store: Store, sid: str = SID) -> list[PendingTurnInput]:
    return read(store, lambda t: t.list_turn_inputs(sid))


def pending(store: Store, sid: str = SID) -> list[str]:
    return [i.input_id for i in read(store, lambda t: t.list_pending_turn_inputs(sid))]


def get(store: Store, input_id: str, sid: str = SID) -> PendingTurnInput:
    (found,) = [i for i in all_inputs(store, sid) if i.input_id == input_id]
    return found


def ids(items: Any) -> list[str]:
    return [i.input_id for i in items]


def claim_columns(store: Store, input_id: str) -> tuple[Any, ...]:
    (row,) = [r for r in turn_input_rows(store) if r["input_id"] == input_id]
    return (
        row["state"],
        row["claim_id"],
        row["claim_token"],
        row["claim_fencing_token"],
        row["claim_session_lease_generation"],
    )


def unclaimed(state: TurnInputState, fencing: int) -> tuple[Any, ...]:
    return (state.value, None, None, fencing, 0)


# --------------------------------------------------------------------------
# Enqueue (§2.7.1)


def test_t_01_initial_state_follows_the_ingress(store: Store, clock: SettableClock) -> None:
    """ActiveTurn(T) ingress → pending_active; NextTurn → deferred_next_turn."""
    active = enqueue(store, draft("T"))
    nxt = enqueue(store, draft(None))

    assert active.state is PENDING and nxt.state is DEFERRED
    assert active.ingress == ActiveTurnIngress(turn_id="T")
    assert active.submitted_ingress == active.ingress
    assert nxt.ingress == NextTurnIngress()
    assert active.enqueued_at_ms == clock.now_ms()
    assert (active.claim_token, active.claim_fencing_token, active.claim_owner) == (None, 0, None)
    assert active.enqueue_seq < nxt.enqueue_seq
    assert all_inputs(store) == [active, nxt]


def test_t_02_derived_id_matches_the_formula(
    store: Store, clock: SettableClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A derived id is ``ti:`` + 64 hex digits; recomputing the SHA-256 reproduces it.

    Decision 7 (spec/README.md) adds 64 random bits to the seed's
    ``"<sid>:None:<now>:<nonce>"``, so the formula checked here is
    ``"<sid>:<debug(source_key)>:<now>:<nonce>:<random64>"``; the test pins the
    nonce counter and the random part by monkeypatching them.
    """
    monkeypatch.setattr(turn_inputs, "_NONCES", itertools.count(41))
    monkeypatch.setattr(turn_inputs, "_random64", lambda: "00112233aabbccdd")
    now = clock.now_ms()

    plain = enqueue(store, draft())
    keyed = enqueue(store, draft(key='k"\\\n\t\u00e9'))

    assert re.fullmatch(r"ti:[0-9a-f]{64}", plain.input_id)
    seed = f"{SID}:None:{now}:41:00112233aabbccdd"
    assert plain.input_id == "ti:" + hashlib.sha256(seed.encode()).hexdigest()
    seed = f'{SID}:Some("k\\"\\\\\\n\\t\u00e9"):{now}:42:00112233aabbccdd'
    assert keyed.input_id == "ti:" + hashlib.sha256(seed.encode()).hexdigest()


def test_t_02_same_nonce_and_millisecond_differ_by_their_random_bits(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two hosts (same nonce, same ms, no source key) still mint different ids (decision 7)."""
    randoms = iter(["00000000000000aa", "00000000000000bb"])
    monkeypatch.setattr(turn_inputs, "_random64", lambda: next(randoms))
    monkeypatch.setattr(turn_inputs, "_NONCES", itertools.count(7))
    first = enqueue(store, draft())
    monkeypatch.setattr(turn_inputs, "_NONCES", itertools.count(7))
    second = enqueue(store, draft())

    assert first.input_id != second.input_id
    assert len(all_inputs(store)) == 2


def test_rust_debug_escapes_like_rust() -> None:
    """``Option<String>`` Debug: None, quotes/backslashes/controls escaped, \\u{hex} otherwise."""
    assert rust_debug(None) == "None"
    assert rust_debug("plain 'x' é") == "Some(\"plain 'x' é\")"
    assert rust_debug('a"b\\c') == 'Some("a\\"b\\\\c")'
    assert rust_debug("\n\r\t\0") == 'Some("\\n\\r\\t\\0")'
    assert rust_debug("\x01\x7f\u00a0e\u0301") == 'Some("\\u{1}\\u{7f}\\u{a0}e\\u{301}")'


def test_t_03_same_source_key_and_content_returns_the_row(store: Store) -> None:
    """Same key, same ingress, same input with keys in another order → the same row; one row."""
    first = enqueue(store, draft(key="k", value={"a": 1, "b": [1, {"x": None, "y": "z"}]}))
    again = enqueue(store, draft(key="k", value={"b": [1, {"y": "z", "x": None}], "a": 1}))

    assert again == first
    assert all_inputs(store) == [first]


def test_t_03_returns_the_existing_row_as_it_is_now(store: Store) -> None:
    """The matching resubmission returns the row in its current state (here: accepted)."""
    first = enqueue(store, draft(key="k"))
    c = claimed(claim_active(store, hold(store)))
    before = turn_input_rows(store)

    again = enqueue(store, draft(key="k"))

    assert again.input_id == first.input_id
    assert again.state is ACCEPTED and again.claim_id == c.claim_id
    assert turn_input_rows(store) == before


@pytest.mark.parametrize(
    "changed",
    [
        draft(key="k", value={"text": "other"}),
        draft(key="k", value={"text": "hello T", "extra": 1}),
        draft(key="k", value={"text": True}),
        draft("U", key="k"),
        draft("T", key="k", boundary=MinBoundary.BEFORE_COMPLETION),
        draft(None, key="k"),
    ],
    ids=["input", "extra-key", "type", "turn", "boundary", "scope"],
)
def test_t_04_same_source_key_with_other_content_conflicts(
    store: Store, changed: PendingTurnInputDraft
) -> None:
    """Same key, different input or ingress → PendingTurnInputSourceKeyConflict; nothing written."""
    first = enqueue(store, draft(key="k"))
    before = turn_input_rows(store)

    with pytest.raises(PendingTurnInputSourceKeyConflict) as info:
        enqueue(store, changed)

    assert (info.value.session_id, info.value.source_key) == (SID, "k")
    assert info.value.existing_input_id == first.input_id
    assert turn_input_rows(store) == before


def test_t_05_resubmitting_after_an_interrupted_turn_returns_the_row(store: Store) -> None:
    """Enqueue k with ActiveTurn(T); an interrupted commit for T defers it; re-enqueue the draft.

    Decision (spec §2.7.1 [PROPOSED], adopted): the ingress as first submitted
    is stored in ``submitted_ingress_json`` and idempotency compares against
    it, so the expected outcome changes from the seed's Conflict to "the
    existing row is returned" (deferred, with the rewritten ingress). A draft
    with the *rewritten* NextTurn ingress is now the one that conflicts.
    The commit does not exist yet: the deferral runs the SQL of §2.4 step 16.
    """
    original = draft("T", key="k")
    first = enqueue(store, original)
    execute_sql(
        store,
        "UPDATE pending_turn_inputs SET state = 'deferred_next_turn', "
        'ingress_json = \'{"scope":"next_turn"}\', claim_id = NULL, claim_owner_id = NULL, '
        "claim_owner_incarnation_id = NULL, claim_owner_liveness_json = NULL, "
        "claim_token = NULL, claim_session_lease_generation = 0 "
        "WHERE session_id = :sid AND input_id = :iid",
        sid=SID,
        iid=first.input_id,
    )
    before = turn_input_rows(store)

    again = enqueue(store, original)

    assert again.input_id == first.input_id
    assert again.state is DEFERRED
    assert again.ingress == NextTurnIngress()
    assert again.submitted_ingress == ActiveTurnIngress(turn_id="T")
    with pytest.raises(PendingTurnInputSourceKeyConflict):
        enqueue(store, draft(None, key="k"))
    assert turn_input_rows(store) == before


def test_t_06_after_vacuum_the_source_key_is_new_again(store: Store) -> None:
    """Enqueue k, complete it, vacuum, enqueue k again → a new row with a new id.

    ``vacuum`` is not implemented yet: the test runs its statement (delete the
    session's completed and cancelled inputs, §2.8.2).
    """
    first = enqueue(store, draft(key="k"))
    fence = hold(store)
    complete(store, fence, claimed(claim_active(store, fence)).completion())
    assert get(store, first.input_id).state is COMPLETED
    execute_sql(
        store,
        "DELETE FROM pending_turn_inputs WHERE session_id = :sid "
        "AND state IN ('completed', 'cancelled')",
        sid=SID,
    )

    again = enqueue(store, draft(key="k"))

    assert again.input_id != first.input_id
    assert again.state is PENDING
    assert again.enqueue_seq > first.enqueue_seq
    assert all_inputs(store) == [again]


@pytest.mark.parametrize("where", [SID, OTHER])
def test_t_07_an_existing_explicit_input_id_is_a_duplicate(store: Store, where: str) -> None:
    """An explicit input_id that exists (this or another session) → TurnInputDuplicate; no row.

    The seed surfaced the unique violation as a Backend error; we raise the
    typed TurnInputDuplicate and write nothing.
    """
    enqueue(store, draft(sid=where, input_id="in-1"))
    before = turn_input_rows(store)

    with pytest.raises(TurnInputDuplicate) as info:
        enqueue(store, draft("U", input_id="in-1", key="fresh-key", value={"x": 2}))

    assert info.value.input_id == "in-1"
    assert turn_input_rows(store) == before


def test_explicit_input_id_is_kept(store: Store) -> None:
    got = enqueue(store, draft(input_id="my-id"))
    assert got.input_id == "my-id"
    assert all_inputs(store) == [got]


# --------------------------------------------------------------------------
# Claims (§2.7.5)


def _three_inputs(store: Store) -> tuple[PendingTurnInput, ...]:
    p1 = enqueue(store, draft("T"))
    p2 = enqueue(store, draft("T", boundary=MinBoundary.BEFORE_COMPLETION))
    p3 = enqueue(store, draft("U"))
    return p1, p2, p3


def test_t_08_after_work_checkpoint_claims_only_after_work_inputs(
    store: Store, clock: SettableClock
) -> None:
    """T (after_work), T (before_completion), U → claim(T, after-work checkpoint) → the first."""
    p1, p2, p3 = _three_inputs(store)
    fence = hold(store)

    c = claimed(claim_active(store, fence, "T", AFTER_WORK, 10))

    assert ids(c.inputs) == [p1.input_id]
    assert c.claim_id == f"tic:{p1.enqueue_seq}:1"
    assert c.fencing_token == 1
    assert c.session_lease_generation == fence.fencing_token
    assert c.owner == A
    assert c.mode == ActiveTurnMode(turn_id="T", checkpoint=AFTER_WORK)
    token = hashlib.sha256(
        f"{SID}:{A.owner_id}:{A.incarnation_id}:{c.claim_id}:{clock.now_ms()}".encode()
    ).hexdigest()
    assert c.lease_token == token
    (got,) = c.inputs
    assert got.state is ACCEPTED and got.claim_token == token and got.claim_owner == A
    assert all_inputs(store) == [got, p2, p3]


def test_t_09_before_completion_checkpoint_claims_both_t_inputs(store: Store) -> None:
    """Same rows → claim(T, BEFORE_COMPLETION) → both T inputs, in FIFO order."""
    p1, p2, p3 = _three_inputs(store)

    c = claimed(claim_active(store, hold(store), "T", BEFORE_COMPLETION, 10))

    assert ids(c.inputs) == [p1.input_id, p2.input_id]
    assert c.claim_id == f"tic:{p1.enqueue_seq}:1"
    assert [i.state for i in c.inputs] == [ACCEPTED, ACCEPTED]
    assert get(store, p3.input_id) == p3


def test_claim_stops_at_max_inputs(store: Store) -> None:
    rows = [enqueue(store, draft("T")) for _ in range(5)]
    c = claimed(claim_active(store, hold(store), max_inputs=2))
    assert ids(c.inputs) == ids(rows[:2])
    assert pending(store) == ids(rows[2:])


def test_t_10_matches_beyond_the_scan_window_are_not_seen(store: Store) -> None:
    """40 pending_active inputs for U, then one for T → claim(T, max 1) → None (window 1+32).

    With max 9 the window is 41 rows, and the T input is claimed.
    """
    for _ in range(40):
        enqueue(store, draft("U"))
    target = enqueue(store, draft("T"))
    fence = hold(store)
    before = turn_input_rows(store)

    assert claim_active(store, fence, "T", AFTER_WORK, 1) is None
    assert turn_input_rows(store) == before
    assert ids(claimed(claim_active(store, fence, "T", AFTER_WORK, 9)).inputs) == [target.input_id]


def test_t_11_next_turn_claim_keeps_the_state_and_hides_the_rows(
    store: Store, clock: SettableClock
) -> None:
    """deferred_next_turn inputs → claim_next(max 2) → the first two; state unchanged;
    hidden from the pending list while the claim is live.
    """
    d1, d2, d3 = (enqueue(store, draft(None)) for _ in range(3))
    fence = hold(store)

    c = claimed(claim_next(store, fence, 2))

    assert ids(c.inputs) == [d1.input_id, d2.input_id]
    assert c.mode == NextTurnMode()
    assert [i.state for i in c.inputs] == [DEFERRED, DEFERRED]
    assert all(i.claim_id == c.claim_id for i in c.inputs)
    assert pending(store) == [d3.input_id]
    clock.advance(TTL)  # the lease expires: the claim is stale, the rows are listed again
    assert pending(store) == ids([d1, d2, d3])


def test_active_claim_ignores_next_turn_rows_and_vice_versa(store: Store) -> None:
    a = enqueue(store, draft("T"))
    d = enqueue(store, draft(None))
    fence = hold(store)
    assert ids(claimed(claim_next(store, fence)).inputs) == [d.input_id]
    assert ids(claimed(claim_active(store, fence)).inputs) == [a.input_id]


def test_claim_with_nothing_claimable_is_none(store: Store) -> None:
    enqueue(store, draft("U"))
    fence = hold(store)
    before = turn_input_rows(store)
    assert claim_active(store, fence, "T") is None
    assert claim_next(store, fence) is None
    assert turn_input_rows(store) == before


def test_t_12_max_inputs_zero_is_none_without_a_lease_check(store: Store) -> None:
    """max_inputs=0 → None: no lease check, no database access (works even in a read unit)."""
    enqueue(store, draft("T"))
    enqueue(store, draft(None))
    no_lease = LeaseFence(session_id=SID, owner=A, lease_token="nope", fencing_token=99)
    before = turn_input_rows(store)

    assert claim_active(store, no_lease, max_inputs=0) is None
    assert claim_next(store, no_lease, max_inputs=0) is None
    with store.read() as uow:  # a write would raise ReadOnlyUnitOfWork here
        assert (
            uow.turn_inputs.claim_active_turn_inputs(SID, no_lease, A, "T", AFTER_WORK, 0) is None
        )
        assert uow.turn_inputs.claim_next_turn_inputs(SID, no_lease, A, 0) is None
    assert turn_input_rows(store) == before


def test_claim_with_a_stale_fence_is_refused(store: Store, clock: SettableClock) -> None:
    enqueue(store, draft("T"))
    enqueue(store, draft(None))
    old = hold(store)
    clock.advance(TTL)  # expired, not taken over
    before = turn_input_rows(store)
    with pytest.raises(SessionExecutionLeaseExpired):
        claim_active(store, old)
    take_over(store, clock)
    with pytest.raises(SessionExecutionLeaseExpired):
        claim_next(store, old)
    other_session = LeaseFence(
        session_id=OTHER, owner=A, lease_token=old.lease_token, fencing_token=old.fencing_token
    )
    with pytest.raises(SessionExecutionLeaseExpired):
        write(store, lambda t: t.claim_next_turn_inputs(SID, other_session, A, 5))
    assert turn_input_rows(store) == before


def test_claim_counter_is_capped_at_the_bigint_maximum(store: Store) -> None:
    """claim_fencing_token + 1 saturates at 2**63-1 (§0.2), in SQL and in the claim id."""
    item = enqueue(store, draft(None))
    fence = hold(store)
    execute_sql(
        store,
        "UPDATE pending_turn_inputs SET claim_fencing_token = :v WHERE input_id = :iid",
        v=MAX_I64 - 1,
        iid=item.input_id,
    )
    first = claimed(claim_next(store, fence))
    assert first.fencing_token == MAX_I64
    assert first.inputs[0].claim_fencing_token == MAX_I64
    write(store, lambda t: t.abandon_turn_input_claim(first))

    again = claimed(claim_next(store, fence))

    assert again.claim_id == f"tic:{item.enqueue_seq}:{MAX_I64}"
    assert claim_columns(store, item.input_id)[3] == MAX_I64


# --------------------------------------------------------------------------
# Cancel (§2.7.3, §2.7.4)


def test_t_13_cancel_an_unclaimed_pending_input(store: Store) -> None:
    """Unclaimed pending_active → Cancelled, state cancelled."""
    item = enqueue(store, draft("T"))

    (result,) = cancel(store, by_id(item))

    assert result.target == by_id(item)
    assert isinstance(result.outcome, Cancelled)
    assert result.outcome.input.state is CANCELLED
    assert get(store, item.input_id) == result.outcome.input
    assert claim_columns(store, item.input_id) == unclaimed(CANCELLED, 0)
    assert pending(store) == []


def test_t_14_accepted_input_with_an_expired_claimant_is_already_claimed(
    store: Store, clock: SettableClock
) -> None:
    """accepted, the claimant's lease expired → AlreadyClaimed with diagnostics."""
    item = enqueue(store, draft("T"))
    fence = hold(store)
    c = claimed(claim_active(store, fence))
    clock.advance(TTL)
    before = turn_input_rows(store)

    (result,) = cancel(store, by_id(item))

    assert isinstance(result.outcome, AlreadyClaimed)
    assert result.outcome.claim == ClaimDiagnostics(
        state=ACCEPTED,
        claim_id=c.claim_id,
        claim_owner=A,
        claim_fencing_token=1,
        claim_session_lease_generation=fence.fencing_token,
    )
    assert result.outcome.input.state is ACCEPTED
    assert turn_input_rows(store) == before


def test_t_15_live_next_turn_claim_blocks_cancel_until_released(store: Store) -> None:
    """deferred with a live NextTurn claim → AlreadyClaimed; after release → Cancelled, cleared."""
    item = enqueue(store, draft(None))
    fence = hold(store)
    c = claimed(claim_next(store, fence))
    before = turn_input_rows(store)

    (blocked,) = cancel(store, by_id(item))
    assert isinstance(blocked.outcome, AlreadyClaimed)
    assert blocked.outcome.claim is not None
    assert blocked.outcome.claim.state is DEFERRED
    assert blocked.outcome.claim.claim_id == c.claim_id
    assert turn_input_rows(store) == before

    store.leases.release_session_execution_lease(fence)
    (result,) = cancel(store, by_id(item))

    assert isinstance(result.outcome, Cancelled)
    assert claim_columns(store, item.input_id) == unclaimed(CANCELLED, 1)


def test_t_16_cancel_outcomes_by_state_and_target(store: Store) -> None:
    """completed → AlreadyCompleted; cancelled → AlreadyCancelled; unknown → NotFound; SourceKey."""
    done = enqueue(store, draft("T"))
    fence = hold(store)
    complete(store, fence, claimed(claim_active(store, fence)).completion())
    gone = enqueue(store, draft("U"))
    cancel(store, by_id(gone))
    keyed = enqueue(store, draft("U", key="key-1"))

    results = cancel(
        store,
        by_id(done),
        by_id(gone),
        by_id("no-such-input"),
        SourceKeyTarget(source_key="key-1"),
        SourceKeyTarget(source_key="no-such-key"),
    )

    outcomes = [r.outcome for r in results]
    assert isinstance(outcomes[0], AlreadyCompleted) and outcomes[0].input.input_id == done.input_id
    assert isinstance(outcomes[1], AlreadyCancelled) and outcomes[1].input.input_id == gone.input_id
    assert outcomes[2] == NotFoundOutcome()
    assert isinstance(outcomes[3], Cancelled) and outcomes[3].input.input_id == keyed.input_id
    assert outcomes[4] == NotFoundOutcome()
    assert results[3].target == SourceKeyTarget(source_key="key-1")


def test_cancel_does_not_see_other_sessions(store: Store) -> None:
    theirs = enqueue(store, draft("T", sid=OTHER, key="k"))
    before = turn_input_rows(store)
    results = cancel(store, by_id(theirs), SourceKeyTarget(source_key="k"))
    assert [r.outcome for r in results] == [NotFoundOutcome(), NotFoundOutcome()]
    assert turn_input_rows(store) == before


def test_t_17_duplicate_targets_see_their_own_earlier_cancel(store: Store) -> None:
    """cancel [i1, bogus, i1] → [Cancelled, NotFound, AlreadyCancelled]."""
    i1 = enqueue(store, draft("T"))

    results = cancel(store, by_id(i1), by_id("bogus"), by_id(i1))

    kinds = [type(r.outcome) for r in results]
    assert kinds == [Cancelled, NotFoundOutcome, AlreadyCancelled]
    assert [r.target for r in results] == [by_id(i1), by_id("bogus"), by_id(i1)]


def test_t_18_suffix_cancel_covers_the_anchor_and_later_rows_of_the_session(
    store: Store,
) -> None:
    """Seq 1..5 in s (other sessions interleaved), anchor = the third → outcomes for seq ≥ 3."""
    mine: list[PendingTurnInput] = []
    theirs: list[PendingTurnInput] = []
    for n in range(5):
        theirs.append(enqueue(store, draft("T", sid=OTHER)))
        mine.append(enqueue(store, draft(f"T{n}" if n != 4 else None)))
    fence = hold(store)
    held = claimed(claim_active(store, fence, "T3"))  # the 4th row: accepted, live
    cancel(store, by_id(mine[4]))  # the 5th row: already cancelled
    before_other = [r for r in turn_input_rows(store) if r["session_id"] == OTHER]
    before_head = [get(store, i.input_id) for i in mine[:2]]

    result = write(store, lambda t: t.cancel_pending_turn_input_suffix(SID, by_id(mine[2])))

    assert isinstance(result, SuffixOutcomes)
    assert result.anchor == by_id(mine[2])
    kinds = [type(o) for o in result.outcomes]
    assert kinds == [Cancelled, AlreadyClaimed, AlreadyCancelled]
    assert [o.input.input_id for o in result.outcomes] == ids(mine[2:])  # type: ignore[union-attr]
    assert get(store, mine[2].input_id).state is CANCELLED
    assert get(store, mine[3].input_id).claim_id == held.claim_id
    assert [get(store, i.input_id) for i in mine[:2]] == before_head
    assert [r for r in turn_input_rows(store) if r["session_id"] == OTHER] == before_other


def test_suffix_anchor_by_source_key(store: Store) -> None:
    first = enqueue(store, draft("T"))
    anchor = enqueue(store, draft("T", key="anchor"))
    last = enqueue(store, draft(None))
    result = write(
        store,
        lambda t: t.cancel_pending_turn_input_suffix(SID, SourceKeyTarget(source_key="anchor")),
    )
    assert isinstance(result, SuffixOutcomes)
    assert [o.input.input_id for o in result.outcomes] == ids([anchor, last])  # type: ignore[union-attr]
    assert get(store, first.input_id).state is PENDING


@pytest.mark.parametrize(
    "anchor", [InputIdTarget(input_id="nope"), SourceKeyTarget(source_key="nope")]
)
def test_t_19_suffix_cancel_with_an_unknown_anchor(store: Store, anchor: Any) -> None:
    """Unknown anchor → AnchorNotFound; nothing written."""
    enqueue(store, draft("T"))
    before = turn_input_rows(store)
    result = write(store, lambda t: t.cancel_pending_turn_input_suffix(SID, anchor))
    assert result == AnchorNotFound(anchor=anchor)
    assert turn_input_rows(store) == before


# --------------------------------------------------------------------------
# Abandon (§2.7.6)


def test_t_20_abandon_an_active_claim(store: Store) -> None:
    """Active claim of two → abandon → pending_active, claim cleared, counter kept; re-claim :2."""
    i1, i2 = enqueue(store, draft("T")), enqueue(store, draft("T"))
    fence = hold(store)
    c = claimed(claim_active(store, fence))
    assert c.claim_id == f"tic:{i1.enqueue_seq}:1"

    write(store, lambda t: t.abandon_turn_input_claim(c))

    assert claim_columns(store, i1.input_id) == unclaimed(PENDING, 1)
    assert claim_columns(store, i2.input_id) == unclaimed(PENDING, 1)
    assert pending(store) == ids([i1, i2])
    again = claimed(claim_active(store, fence))
    assert again.claim_id == f"tic:{i1.enqueue_seq}:2"
    assert again.lease_token != c.lease_token or again.claim_id != c.claim_id
    assert [i.claim_fencing_token for i in again.inputs] == [2, 2]


def test_t_21_abandon_a_next_turn_claim(store: Store) -> None:
    """NextTurn claim → abandon → rows stay deferred_next_turn, claim cleared."""
    d1, d2 = enqueue(store, draft(None)), enqueue(store, draft(None))
    c = claimed(claim_next(store, hold(store)))

    write(store, lambda t: t.abandon_turn_input_claim(c))

    assert claim_columns(store, d1.input_id) == unclaimed(DEFERRED, 1)
    assert claim_columns(store, d2.input_id) == unclaimed(DEFERRED, 1)
    assert pending(store) == ids([d1, d2])


def test_abandon_twice_and_after_completion_is_a_no_op(store: Store) -> None:
    enqueue(store, draft("T"))
    fence = hold(store)
    c = claimed(claim_active(store, fence))
    write(store, lambda t: t.abandon_turn_input_claim(c))
    after_first = turn_input_rows(store)
    write(store, lambda t: t.abandon_turn_input_claim(c))
    assert turn_input_rows(store) == after_first

    c2 = claimed(claim_active(store, fence))
    complete(store, fence, c2.completion())
    done = turn_input_rows(store)
    write(store, lambda t: t.abandon_turn_input_claim(c2))
    assert turn_input_rows(store) == done


# --------------------------------------------------------------------------
# The orphan hazard and its recovery (§3.1; spec/README.md decision)


def test_t_22_stale_accepted_input_is_orphaned_until_recovered(
    store: Store, clock: SettableClock
) -> None:
    """accepted with a stale claim → the new generation cannot claim, list or cancel it.

    Decision (spec/README.md): a fenced recovery operation must exist. After the
    seed's documented hazard, ``recover_stale_turn_input_claims`` with the new
    generation's fence returns the row to pending_active (claim cleared,
    counter kept), and a re-claim by the new generation works (``tic:<seq>:2``).
    """
    item = enqueue(store, draft("T"))
    old = hold(store, A)
    c_old = claimed(claim_active(store, old))
    new = take_over(store, clock, B)

    assert claim_active(store, new) is None
    assert pending(store) == []
    (blocked,) = cancel(store, by_id(item))
    assert isinstance(blocked.outcome, AlreadyClaimed)

    recovered = write(store, lambda t: t.recover_stale_turn_input_claims(SID, new))

    assert ids(recovered) == [item.input_id]
    assert recovered[0].state is PENDING and recovered[0].claim_token is None
    assert claim_columns(store, item.input_id) == unclaimed(PENDING, 1)
    assert pending(store) == [item.input_id]
    c_new = claimed(claim_active(store, new))
    assert c_new.claim_id == f"tic:{item.enqueue_seq}:2"
    assert c_new.session_lease_generation == new.fencing_token
    # The old claimant can no longer touch the row.
    with pytest.raises(SessionExecutionLeaseExpired):
        complete(store, old, c_old.completion())
    write(store, lambda t: t.abandon_turn_input_claim(c_old))
    assert get(store, item.input_id).claim_id == c_new.claim_id


def test_recovery_moves_only_stale_accepted_rows(store: Store, clock: SettableClock) -> None:
    """Stale accepted rows of the session are recovered; live-generation, next-turn and
    other-session rows are untouched.
    """
    a1 = enqueue(store, draft("T"))
    d1 = enqueue(store, draft(None))
    x1 = enqueue(store, draft("T", sid=OTHER))
    old = hold(store, A)
    claimed(claim_active(store, old))
    claimed(claim_next(store, old))
    claimed(claim_active(store, hold(store, A, OTHER)))
    a2 = enqueue(store, draft("T"))
    new = take_over(store, clock, B)
    hold(store, B, OTHER)  # OTHER's lease also moved on; its accepted row is stale too
    live = claimed(claim_active(store, new))
    assert ids(live.inputs) == [a2.input_id]
    before = {r["input_id"]: r for r in turn_input_rows(store)}

    recovered = write(store, lambda t: t.recover_stale_turn_input_claims(SID, new))

    assert ids(recovered) == [a1.input_id]
    after = {r["input_id"]: r for r in turn_input_rows(store)}
    assert claim_columns(store, a1.input_id) == unclaimed(PENDING, 1)
    for untouched in (a2, d1, x1):
        assert after[untouched.input_id] == before[untouched.input_id]
    assert get(store, a2.input_id).claim_id == live.claim_id


def test_recovery_with_a_stale_fence_changes_nothing(store: Store, clock: SettableClock) -> None:
    """A fence that is not the live lease → SessionExecutionLeaseExpired; nothing changed."""
    enqueue(store, draft("T"))
    old = hold(store, A)
    claimed(claim_active(store, old))
    clock.advance(TTL)
    before = turn_input_rows(store)

    with pytest.raises(SessionExecutionLeaseExpired):  # expired, not taken over
        write(store, lambda t: t.recover_stale_turn_input_claims(SID, old))
    new = take_over(store, clock, B)
    with pytest.raises(SessionExecutionLeaseExpired):  # superseded
        write(store, lambda t: t.recover_stale_turn_input_claims(SID, old))
    with pytest.raises(SessionExecutionLeaseExpired):  # the fence names another session
        write(store, lambda t: t.recover_stale_turn_input_claims(OTHER, new))

    assert turn_input_rows(store) == before


def test_recovery_with_nothing_stale_is_empty(store: Store) -> None:
    enqueue(store, draft("T"))
    fence = hold(store)
    claimed(claim_active(store, fence))
    before = turn_input_rows(store)
    assert write(store, lambda t: t.recover_stale_turn_input_claims(SID, fence)) == []
    assert turn_input_rows(store) == before


# --------------------------------------------------------------------------
# Completion (strict; C-16, C-17)


def test_c_16_completing_an_active_claim(store: Store) -> None:
    """Claim of {i1, i2} (accepted) → complete → completed, claim cleared, counter unchanged."""
    i1, i2 = enqueue(store, draft("T")), enqueue(store, draft("T"))
    fence = hold(store)
    c = claimed(claim_active(store, fence))

    complete(store, fence, c.completion())

    assert claim_columns(store, i1.input_id) == unclaimed(COMPLETED, 1)
    assert claim_columns(store, i2.input_id) == unclaimed(COMPLETED, 1)
    assert pending(store) == []


def test_c_17_completing_a_next_turn_claim(store: Store) -> None:
    """A NextTurn claim on a deferred_next_turn input → complete → completed."""
    d = enqueue(store, draft(None))
    fence = hold(store)
    complete(store, fence, claimed(claim_next(store, fence)).completion())
    assert claim_columns(store, d.input_id) == unclaimed(COMPLETED, 1)


def _variant(c: TurnInputClaim, extra: str, which: str) -> TurnInputCompletion:
    i1, i2 = ids(c.inputs)
    input_ids = {
        "superset": (i1, i2, extra),
        "subset": (i1,),
        "duplicate": (i1, i1),
        "foreign": (i1, extra),
        "reordered-duplicate": (i2, i1, i1),
    }[which]
    return c.completion().model_copy(update={"input_ids": input_ids})


@pytest.mark.parametrize(
    "which", ["superset", "subset", "duplicate", "foreign", "reordered-duplicate"]
)
def test_completion_must_name_exactly_the_owned_rows(store: Store, which: str) -> None:
    """Strict completion (decision): a superset, subset, duplicate or foreign id list →
    TurnInputClaimSuperseded, nothing changed. ``duplicate`` and ``foreign`` have the
    owned count (2) and would pass the seed's count-only check (C-14's hazard).
    """
    enqueue(store, draft("T"))
    enqueue(store, draft("T"))
    extra = enqueue(store, draft("U"))
    fence = hold(store)
    c = claimed(claim_active(store, fence))
    before = turn_input_rows(store)

    with pytest.raises(TurnInputClaimSuperseded) as info:
        complete(store, fence, _variant(c, extra.input_id, which))

    assert (info.value.session_id, info.value.claim_id) == (SID, c.claim_id)
    assert turn_input_rows(store) == before
    complete(store, fence, c.completion())  # the exact list still completes
    assert [i.state for i in all_inputs(store)] == [COMPLETED, COMPLETED, PENDING]


def test_completion_with_a_wrong_token_or_twice_is_superseded(store: Store) -> None:
    enqueue(store, draft("T"))
    fence = hold(store)
    c = claimed(claim_active(store, fence))
    before = turn_input_rows(store)
    forged = c.completion().model_copy(update={"lease_token": "forged"})
    with pytest.raises(TurnInputClaimSuperseded):
        complete(store, fence, forged)
    assert turn_input_rows(store) == before
    complete(store, fence, c.completion())
    done = turn_input_rows(store)
    with pytest.raises(TurnInputClaimSuperseded):
        complete(store, fence, c.completion())
    assert turn_input_rows(store) == done


def test_completion_for_another_session_is_superseded(store: Store) -> None:
    """The completion's session must be the fence's (C-15 analogue)."""
    enqueue(store, draft("T", sid=OTHER))
    theirs = claimed(claim_active(store, hold(store, A, OTHER)))
    mine = hold(store, A, SID)
    before = turn_input_rows(store)
    with pytest.raises(TurnInputClaimSuperseded) as info:
        complete(store, mine, theirs.completion())
    assert info.value.session_id == OTHER
    assert turn_input_rows(store) == before


def test_completion_with_a_stale_fence_is_refused(store: Store, clock: SettableClock) -> None:
    enqueue(store, draft("T"))
    fence = hold(store)
    c = claimed(claim_active(store, fence))
    clock.advance(TTL)
    before = turn_input_rows(store)
    with pytest.raises(SessionExecutionLeaseExpired):
        complete(store, fence, c.completion())
    assert turn_input_rows(store) == before


def test_module_level_completion_check_is_a_read(store: Store) -> None:
    """``ensure_turn_input_completion(db, completion)`` runs in a read unit and writes nothing."""
    enqueue(store, draft("T"))
    enqueue(store, draft("T"))
    c = claimed(claim_active(store, hold(store)))
    before = turn_input_rows(store)
    with store.read() as uow:
        ensure_turn_input_completion(uow.driver, c.completion())
        uow.turn_inputs.ensure_turn_input_completion(c.completion())
        with pytest.raises(TurnInputClaimSuperseded):
            ensure_turn_input_completion(
                uow.driver, c.completion().model_copy(update={"input_ids": ids(c.inputs)[:1]})
            )
    assert turn_input_rows(store) == before


# --------------------------------------------------------------------------
# Invariants (§5.1)


def test_i_4_every_claimed_row_carries_the_claim(store: Store) -> None:
    """I-4: a returned claim's rows all carry its claim id and token; no other row does."""
    rows = [enqueue(store, draft("T")) for _ in range(4)]
    enqueue(store, draft("U"))
    c = claimed(claim_active(store, hold(store), max_inputs=3))
    stamped = [
        r["input_id"]
        for r in turn_input_rows(store)
        if (r["claim_id"], r["claim_token"]) == (c.claim_id, c.lease_token)
    ]
    assert stamped == ids(rows[:3]) == ids(c.inputs)
    assert [r["claim_token"] for r in turn_input_rows(store)][3:] == [None, None]


def test_i_5_claim_counter_grows_by_one_per_claim_and_never_decreases(
    store: Store, clock: SettableClock
) -> None:
    """I-5 across claim, abandon, re-claim, takeover re-claim, recovery and completion."""
    item = enqueue(store, draft(None))
    seen: list[int] = []

    def counter() -> int:
        value: int = claim_columns(store, item.input_id)[3]
        seen.append(value)
        return value

    fence = hold(store)
    assert counter() == 0
    c = claimed(claim_next(store, fence))
    assert counter() == 1
    write(store, lambda t: t.abandon_turn_input_claim(c))
    assert counter() == 1
    claimed(claim_next(store, fence))
    assert counter() == 2
    fence = take_over(store, clock)
    c = claimed(claim_next(store, fence))  # a stale claim is re-claimed by the new generation
    assert counter() == 3
    complete(store, fence, c.completion())
    assert counter() == 3
    assert seen == sorted(seen)


def test_i_6_only_another_generation_can_re_claim(store: Store, clock: SettableClock) -> None:
    """I-6: a live-claimed row is not claimable by its own generation, only by a later one."""
    d = enqueue(store, draft(None))
    fence = hold(store)
    first = claimed(claim_next(store, fence))
    before = turn_input_rows(store)
    assert claim_next(store, fence) is None
    assert hold(store).fencing_token == fence.fencing_token  # self-extension keeps the generation
    assert claim_next(store, fence) is None
    assert turn_input_rows(store) == before

    new = take_over(store, clock)
    second = claimed(claim_next(store, new))
    assert ids(second.inputs) == [d.input_id]
    assert second.session_lease_generation == new.fencing_token == fence.fencing_token + 1
    assert second.claim_id != first.claim_id


def test_i_7_a_superseded_claimant_cannot_touch_re_claimed_rows(
    store: Store, clock: SettableClock
) -> None:
    """I-7: after a re-claim, the old claim's abandon is a no-op and its completion fails —
    by its fence, and by ownership even when presented with the live fence.
    """
    enqueue(store, draft(None))
    enqueue(store, draft(None))
    old = hold(store, A)
    c_old = claimed(claim_next(store, old))
    new = take_over(store, clock, B)
    c_new = claimed(claim_next(store, new))
    assert ids(c_new.inputs) == ids(c_old.inputs)
    before = turn_input_rows(store)

    write(store, lambda t: t.abandon_turn_input_claim(c_old))
    with pytest.raises(SessionExecutionLeaseExpired):
        complete(store, old, c_old.completion())
    with pytest.raises(TurnInputClaimSuperseded):
        complete(store, new, c_old.completion())

    assert turn_input_rows(store) == before


def test_i_10_one_input_per_session_and_source_key(store: Store) -> None:
    """I-10: (session, source_key) maps to at most one input; other sessions have their own."""
    mine = enqueue(store, draft(key="k"))
    theirs = enqueue(store, draft(key="k", sid=OTHER))
    for _ in range(3):
        assert enqueue(store, draft(key="k")) == mine
        with pytest.raises(PendingTurnInputSourceKeyConflict):
            enqueue(store, draft("V", key="k"))
    keys = [(r["session_id"], r["source_key"]) for r in turn_input_rows(store)]
    assert sorted(keys) == sorted([(SID, "k"), (OTHER, "k")])
    assert mine.input_id != theirs.input_id


# --------------------------------------------------------------------------
# Lists


def test_list_pending_hides_live_claims_and_finished_rows(
    store: Store, clock: SettableClock
) -> None:
    """Unclaimed and stale-claimed pending rows are listed; live, accepted and finished are not."""
    live = enqueue(store, draft(None))
    stale = enqueue(store, draft(None))
    free = enqueue(store, draft("T"))
    gone = enqueue(store, draft("U"))
    accepted = enqueue(store, draft("W"))
    done = enqueue(store, draft("X"))
    old = hold(store, A)
    claimed(claim_next(store, old, 2))  # live and stale, under generation 1
    new = take_over(store, clock, B)
    assert ids(claimed(claim_next(store, new, 1)).inputs) == [live.input_id]
    cancel(store, by_id(gone))
    claimed(claim_active(store, new, "W"))
    complete(store, new, claimed(claim_active(store, new, "X")).completion())

    assert pending(store) == ids([stale, free])
    with store.read() as uow:  # reads work in read units
        everything = uow.turn_inputs.list_turn_inputs(SID)
    assert ids(everything) == ids([live, stale, free, gone, accepted, done])
    assert [i.state for i in everything] == [
        DEFERRED,
        DEFERRED,
        PENDING,
        CANCELLED,
        ACCEPTED,
        COMPLETED,
    ]
    assert pending(store, OTHER) == []


# --------------------------------------------------------------------------
# Refused arguments and read-only units


def _bad_calls() -> dict[str, Callable[[TurnInputRepository, LeaseFence, TurnInputClaim], Any]]:
    fine = draft("T")

    def d(**update: Any) -> Any:
        return fine.model_copy(update=update)

    return {
        "draft-type": lambda t, f, c: t.enqueue_pending_turn_input({"session_id": SID}),
        "blank-session": lambda t, f, c: t.enqueue_pending_turn_input(d(session_id="  ")),
        "blank-input-id": lambda t, f, c: t.enqueue_pending_turn_input(d(input_id="")),
        "nul-source-key": lambda t, f, c: t.enqueue_pending_turn_input(d(source_key="a\x00")),
        "blank-turn-id": lambda t, f, c: t.enqueue_pending_turn_input(
            d(ingress=ActiveTurnIngress(turn_id=" "))
        ),
        "ingress-type": lambda t, f, c: t.enqueue_pending_turn_input(d(ingress="next_turn")),
        "set-input": lambda t, f, c: t.enqueue_pending_turn_input(d(input={1, 2})),
        "nan-input": lambda t, f, c: t.enqueue_pending_turn_input(d(input=[float("nan")])),
        "int-key-input": lambda t, f, c: t.enqueue_pending_turn_input(d(input={1: "x"})),
        "negative-max": lambda t, f, c: t.claim_active_turn_inputs(SID, f, A, "T", AFTER_WORK, -1),
        "bool-max": lambda t, f, c: t.claim_next_turn_inputs(SID, f, A, True),
        "float-max": lambda t, f, c: t.claim_next_turn_inputs(SID, f, A, 1.0),
        "str-max": lambda t, f, c: t.claim_next_turn_inputs(SID, f, A, "3"),
        "claim-blank-turn": lambda t, f, c: t.claim_active_turn_inputs(
            SID, f, A, "", AFTER_WORK, 1
        ),
        "claim-str-checkpoint": lambda t, f, c: t.claim_active_turn_inputs(
            SID, f, A, "T", "after_work", 1
        ),
        "claim-fence-type": lambda t, f, c: t.claim_next_turn_inputs(SID, "fence", A, 1),
        "claim-owner-type": lambda t, f, c: t.claim_next_turn_inputs(SID, f, None, 1),
        "claim-blank-owner": lambda t, f, c: t.claim_next_turn_inputs(
            SID, f, A.model_copy(update={"owner_id": ""}), 1
        ),
        "claim-blank-session": lambda t, f, c: t.claim_next_turn_inputs("", f, A, 1),
        "cancel-str-targets": lambda t, f, c: t.cancel_pending_turn_inputs(SID, "input"),
        "cancel-none-target": lambda t, f, c: t.cancel_pending_turn_inputs(SID, [None]),
        "cancel-blank-target": lambda t, f, c: t.cancel_pending_turn_inputs(
            SID, [by_id(c.inputs[0]), InputIdTarget(input_id=" ")]
        ),
        "cancel-blank-session": lambda t, f, c: t.cancel_pending_turn_inputs("", []),
        "suffix-anchor-type": lambda t, f, c: t.cancel_pending_turn_input_suffix(SID, "x"),
        "abandon-type": lambda t, f, c: t.abandon_turn_input_claim(c.completion()),
        "complete-empty": lambda t, f, c: t.complete_turn_input_claim(
            f, c.completion().model_copy(update={"input_ids": ()})
        ),
        "complete-blank-id": lambda t, f, c: t.complete_turn_input_claim(
            f, c.completion().model_copy(update={"input_ids": (c.inputs[0].input_id, " ")})
        ),
        "complete-type": lambda t, f, c: t.complete_turn_input_claim(f, c),
        "recover-fence-type": lambda t, f, c: t.recover_stale_turn_input_claims(SID, None),
        "recover-blank-session": lambda t, f, c: t.recover_stale_turn_input_claims(" ", f),
    }


BAD_CALLS = _bad_calls()


@pytest.mark.parametrize("case", sorted(BAD_CALLS))
def test_bad_arguments_are_refused_and_change_nothing(store: Store, case: str) -> None:
    """Each refused call raises InvalidInput before writing; the rows stay as they were."""
    enqueue(store, draft("T"))
    enqueue(store, draft(None))
    fence = hold(store)
    c = claimed(claim_active(store, fence))
    before = turn_input_rows(store)

    with pytest.raises(InvalidInput):
        write(store, lambda t: BAD_CALLS[case](t, fence, c))

    assert turn_input_rows(store) == before


def test_list_with_a_blank_session_is_refused(store: Store) -> None:
    with pytest.raises(InvalidInput):
        read(store, lambda t: t.list_pending_turn_inputs(""))
    with pytest.raises(InvalidInput):
        read(store, lambda t: t.list_turn_inputs(" "))


def test_writes_are_refused_in_read_units(store: Store) -> None:
    item = enqueue(store, draft("T"))
    fence = hold(store)
    c = claimed(claim_active(store, fence))
    enqueue(store, draft("T"))
    before = turn_input_rows(store)
    calls: list[Callable[[TurnInputRepository], Any]] = [
        lambda t: t.enqueue_pending_turn_input(draft("T")),
        lambda t: t.claim_active_turn_inputs(SID, fence, A, "T", AFTER_WORK, 1),
        lambda t: t.claim_next_turn_inputs(SID, fence, A, 1),
        lambda t: t.cancel_pending_turn_inputs(SID, [by_id(item)]),
        lambda t: t.cancel_pending_turn_input_suffix(SID, by_id(item)),
        lambda t: t.abandon_turn_input_claim(c),
        lambda t: t.complete_turn_input_claim(fence, c.completion()),
        lambda t: t.recover_stale_turn_input_claims(SID, fence),
    ]
    for call in calls:
        with pytest.raises(ReadOnlyUnitOfWork), store.read() as uow:
            call(uow.turn_inputs)
    assert turn_input_rows(store) == before


# --------------------------------------------------------------------------
# Corrupt stored values


def _corrupt(store: Store, input_id: str, column: str, value: str) -> None:
    execute_sql(
        store,
        f"UPDATE pending_turn_inputs SET {column} = :v WHERE input_id = :iid",
        v=value,
        iid=input_id,
    )


def _expect_corrupt(exc: SessionCorrupt, input_id: str, column: str) -> None:
    assert (exc.table, exc.key, exc.column) == ("pending_turn_inputs", input_id, column)
    assert column in str(exc) and input_id in str(exc)


@pytest.mark.parametrize(
    ("column", "value"),
    [
        ("ingress_json", '{"scope":"sideways"}'),
        ("ingress_json", "not json"),
        ("input_json", "{broken"),
        ("input_json", "NaN"),
    ],
)
def test_corrupt_values_fail_loudly_and_change_nothing(
    store: Store, column: str, value: str
) -> None:
    """A corrupt ingress or input → SessionCorrupt naming the row and column, on list, claim
    and cancel; nothing of the failed operation is written.
    """
    good = enqueue(store, draft("T"))
    bad = enqueue(store, draft("T"))
    fence = hold(store)
    _corrupt(store, bad.input_id, column, value)
    before = turn_input_rows(store)

    attempts: list[Callable[[], Any]] = [
        lambda: pending(store),
        lambda: all_inputs(store),
        lambda: claim_active(store, fence, max_inputs=5),
        lambda: cancel(store, by_id(good), by_id(bad)),
        lambda: write(store, lambda t: t.cancel_pending_turn_input_suffix(SID, by_id(good))),
    ]
    for attempt in attempts:
        with pytest.raises(SessionCorrupt) as info:
            attempt()
        _expect_corrupt(info.value, bad.input_id, column)
        assert turn_input_rows(store) == before


def test_corrupt_next_turn_row_fails_the_next_turn_claim(store: Store) -> None:
    bad = enqueue(store, draft(None))
    enqueue(store, draft(None))
    fence = hold(store)
    _corrupt(store, bad.input_id, "input_json", "[1,")
    before = turn_input_rows(store)
    with pytest.raises(SessionCorrupt) as info:
        claim_next(store, fence)
    _expect_corrupt(info.value, bad.input_id, "input_json")
    assert turn_input_rows(store) == before


def test_corrupt_submitted_ingress_fails_the_idempotent_enqueue(store: Store) -> None:
    first = enqueue(store, draft(key="k"))
    _corrupt(store, first.input_id, "submitted_ingress_json", "{}")
    before = turn_input_rows(store)
    with pytest.raises(SessionCorrupt) as info:
        enqueue(store, draft(key="k"))
    _expect_corrupt(info.value, first.input_id, "submitted_ingress_json")
    assert turn_input_rows(store) == before


@pytest.fixture
def state_unchecked_store(backend: str, fresh_url: str, clock: SettableClock) -> Iterator[Store]:
    """A store on a private database whose ``state`` CHECK constraint is switched off.

    The constraint forbids unknown states; to show that one is still read
    loudly, Postgres drops it (in this test's own database) and SQLite writes
    under ``PRAGMA ignore_check_constraints``.
    """
    migrate.upgrade(fresh_url)
    if backend == "postgres":
        eng = create_engine(fresh_url)
        with eng.begin() as conn:
            conn.execute(
                text("ALTER TABLE pending_turn_inputs DROP CONSTRAINT ck_pending_turn_inputs_state")
            )
        eng.dispose()
    s = Store.open(fresh_url, clock=clock)
    yield s
    s.close()


def _force_state(url: str, backend: str, input_id: str, state: str) -> None:
    sql = "UPDATE pending_turn_inputs SET state = :s WHERE input_id = :iid"
    if backend == "sqlite":
        con = sqlite3.connect(str(make_url(url).database))
        try:
            con.execute("PRAGMA ignore_check_constraints = ON")
            con.execute(sql, {"s": state, "iid": input_id})
            con.commit()
        finally:
            con.close()
        return
    eng = create_engine(url)
    with eng.begin() as conn:
        conn.execute(text(sql), {"s": state, "iid": input_id})
    eng.dispose()


def test_corrupt_state_fails_loudly(
    state_unchecked_store: Store, backend: str, fresh_url: str
) -> None:
    """An unknown state string → SessionCorrupt naming the ``state`` column (list and cancel).

    The claim scan and the pending list select rows by state in SQL, so they
    never select such a row (it is neither pending nor claimable).
    """
    store = state_unchecked_store
    good = enqueue(store, draft("T"))
    bad = enqueue(store, draft("T"))
    _force_state(fresh_url, backend, bad.input_id, "paused")
    before = turn_input_rows(store)

    for attempt in (
        lambda: all_inputs(store),
        lambda: cancel(store, by_id(good), by_id(bad)),
        lambda: write(store, lambda t: t.cancel_pending_turn_input_suffix(SID, by_id(good))),
    ):
        with pytest.raises(SessionCorrupt) as info:
            attempt()
        _expect_corrupt(info.value, bad.input_id, "state")
    assert turn_input_rows(store) == before
    assert pending(store) == [good.input_id]  # the list's state filter never selects it


# --------------------------------------------------------------------------
# Faults injected mid-claim (I-4)

_PG_FAULT_FNS = {
    "raise": "CREATE OR REPLACE FUNCTION agentkeep_test_ti_fault() RETURNS trigger AS $$ "
    "BEGIN RAISE EXCEPTION 'injected fault'; END $$ LANGUAGE plpgsql",
    "skip": "CREATE OR REPLACE FUNCTION agentkeep_test_ti_skip() RETURNS trigger AS $$ "
    "BEGIN RETURN NULL; END $$ LANGUAGE plpgsql",
}
_PG_FN_NAMES = {"raise": "agentkeep_test_ti_fault", "skip": "agentkeep_test_ti_skip"}


@pytest.fixture
def claim_trigger(db_url: str, backend: str) -> Iterator[Callable[[str, str], None]]:
    """``install(kind, input_id)``: a BEFORE UPDATE trigger on that row's claim stamp.

    ``raise`` fails the statement (SQLite ``RAISE(ABORT)``, Postgres a plpgsql
    exception); ``skip`` silently skips the row (``RAISE(IGNORE)`` / ``RETURN
    NULL``), so the claim UPDATE matches 0 rows — a lost race. Dropped afterwards.
    """
    installed: list[str] = []

    def install(kind: str, input_id: str) -> None:
        name = f"agentkeep_test_ti_trigger_{len(installed)}"
        cond = f"OLD.input_id = '{input_id}' AND NEW.claim_token IS NOT NULL"
        if backend == "sqlite":
            action = "RAISE(ABORT, 'injected fault')" if kind == "raise" else "RAISE(IGNORE)"
            raw_exec(
                db_url,
                f"CREATE TRIGGER {name} BEFORE UPDATE ON pending_turn_inputs "
                f"WHEN {cond} BEGIN SELECT {action}; END",
            )
        else:
            raw_exec(
                db_url,
                _PG_FAULT_FNS[kind],
                f"CREATE TRIGGER {name} BEFORE UPDATE ON pending_turn_inputs FOR EACH ROW "
                f"WHEN ({cond}) EXECUTE FUNCTION {_PG_FN_NAMES[kind]}()",
            )
        installed.append(name)

    yield install
    for name in installed:
        if backend == "sqlite":
            raw_exec(db_url, f"DROP TRIGGER IF EXISTS {name}")
        else:
            raw_exec(db_url, f"DROP TRIGGER IF EXISTS {name} ON pending_turn_inputs")
    if backend == "postgres" and installed:
        raw_exec(db_url, *(f"DROP FUNCTION IF EXISTS {fn}()" for fn in _PG_FN_NAMES.values()))


def test_a_fault_on_the_second_row_leaves_no_claim(
    store: Store, claim_trigger: Callable[[str, str], None]
) -> None:
    """The second row's claim UPDATE raises → the claim fails and none of it remains."""
    rows = [enqueue(store, draft("T")) for _ in range(3)]
    fence = hold(store)
    claim_trigger("raise", rows[1].input_id)
    before = turn_input_rows(store)

    with pytest.raises(DatabaseError, match="injected fault"):
        claim_active(store, fence)

    assert turn_input_rows(store) == before


def test_a_failed_claim_inside_a_larger_unit_rolls_back_only_itself(
    store: Store, claim_trigger: Callable[[str, str], None]
) -> None:
    """Inside one unit: enqueue, a claim that fails mid-way (caught), then more work →
    the unit commits the enqueue; nothing of the claim remains (savepoint).
    """
    rows = [enqueue(store, draft("T")) for _ in range(2)]
    fence = hold(store)
    claim_trigger("raise", rows[1].input_id)

    with store.write() as uow:
        extra = uow.turn_inputs.enqueue_pending_turn_input(draft("U"))
        with pytest.raises(DatabaseError, match="injected fault"):
            uow.turn_inputs.claim_active_turn_inputs(SID, fence, A, "T", AFTER_WORK, 5)
        listed = uow.turn_inputs.list_pending_turn_inputs(SID)

    assert ids(listed) == ids([*rows, extra])
    assert [r["claim_token"] for r in turn_input_rows(store)] == [None, None, None]
    assert [r["claim_fencing_token"] for r in turn_input_rows(store)] == [0, 0, 0]


def test_a_lost_race_on_the_second_row_returns_none_and_rolls_back(
    store: Store, claim_trigger: Callable[[str, str], None]
) -> None:
    """The second row's UPDATE matches 0 rows → None; the first row's stamp is rolled back."""
    rows = [enqueue(store, draft(None)) for _ in range(3)]
    fence = hold(store)
    claim_trigger("skip", rows[1].input_id)
    before = turn_input_rows(store)

    assert claim_next(store, fence) is None
    assert claim_active(store, fence) is None  # nothing pending_active: no write attempted

    assert turn_input_rows(store) == before


def test_a_claim_of_many_inputs_stamps_them_by_sixteen_all_or_none(
    store: Store, backend: str, claim_trigger: Callable[[str, str], None]
) -> None:
    """A claim of 20 inputs stamps them in two UPDATEs (16 rows, then 4) and returns
    them in queue order; when one row of the second UPDATE is lost (a trigger skips
    it), the claim is None and the first UPDATE's 16 stamps are taken back."""
    rows = [enqueue(store, draft(None)) for _ in range(20)]
    fence = hold(store)
    log = _sqlite_log(store) if backend == "sqlite" else []

    claim = claim_next(store, fence, 20)
    assert claim is not None and ids(claim.inputs) == ids(rows)
    assert [item.claim_fencing_token for item in claim.inputs] == [1] * 20
    assert {item.claim_token for item in claim.inputs} == {claim.lease_token}
    if backend == "sqlite":
        stamps = [sql for sql in log if sql.startswith("UPDATE pending_turn_inputs")]
        assert len(stamps) == 2, stamps
    store.turn_inputs.abandon_turn_input_claim(claim)

    claim_trigger("skip", rows[18].input_id)
    before = turn_input_rows(store)
    assert claim_next(store, fence, 20) is None
    assert turn_input_rows(store) == before


@pytest.mark.parametrize("kind", ["skip", "raise"])
def test_a_one_call_claim_of_one_input_sends_no_savepoint_and_keeps_its_outcomes(
    store: Store, backend: str, claim_trigger: Callable[[str, str], None], kind: str
) -> None:
    """A one-call claim of one input is one UPDATE, no SAVEPOINT: a lost race (the row's
    UPDATE matches nothing) is None, a fault the typed error, and nothing is written
    either way; a claim of two inputs keeps its savepoint."""

    def one_call_next(store: Store, fence: LeaseFence, n: int) -> TurnInputClaim | None:
        return store.turn_inputs.claim_next_turn_inputs(fence.session_id, fence, fence.owner, n)

    row = enqueue(store, draft(None))
    fence = hold(store)
    log = _sqlite_log(store) if backend == "sqlite" else []
    claim = one_call_next(store, fence, 1)
    assert claim is not None and ids(claim.inputs) == [row.input_id]
    if backend == "sqlite":
        assert not [sql for sql in log if "SAVEPOINT" in sql], log
    store.turn_inputs.abandon_turn_input_claim(claim)
    claim_trigger(kind, row.input_id)
    before = turn_input_rows(store)
    if kind == "skip":
        assert one_call_next(store, fence, 1) is None
    else:
        with pytest.raises(DatabaseError, match="injected fault"):
            one_call_next(store, fence, 1)
    assert turn_input_rows(store) == before
    if backend == "sqlite":  # two inputs: the savepoint undoes the first stamp
        enqueue(store, draft(None))
        before = turn_input_rows(store)
        log.clear()
        if kind == "skip":
            assert one_call_next(store, fence, 2) is None
        else:
            with pytest.raises(DatabaseError, match="injected fault"):
                one_call_next(store, fence, 2)
        assert [sql for sql in log if sql.startswith("SAVEPOINT")], log
        assert turn_input_rows(store) == before


# --------------------------------------------------------------------------
# The claim scan's index


def test_the_claim_scan_uses_the_session_state_seq_index(store: Store, backend: str) -> None:
    """EXPLAIN of the claim scan names ix_pending_turn_inputs_session_state_seq.

    2000 rows over 20 sessions and four states. SQLite searches the index and
    needs no sort; Postgres (after ANALYZE) reads the ~25 matches with a bitmap
    scan of the same index and sorts them, its cheapest plan at this size.
    """
    states = ["pending_active", "deferred_next_turn", "accepted", "completed"]
    rows = [
        {
            "iid": f"idx-{s}-{n}",
            "sid": f"sess-{s}",
            "state": states[n % 4],
            "ingress": '{"scope":"next_turn"}',
        }
        for s in range(20)
        for n in range(100)
    ]
    with store.write() as uow:
        uow.connection.execute(
            text(
                "INSERT INTO pending_turn_inputs (input_id, session_id, ingress_json, "
                "submitted_ingress_json, state, input_json, enqueued_at_ms) "
                "VALUES (:iid, :sid, :ingress, :ingress, :state, 'null', 0)"
            ),
            rows,
        )
    params = {"sid": "sess-3", "state": "pending_active", "gen": 1, "limit": 42}
    with store.write() as uow:
        if backend == "sqlite":
            uow.connection.execute(text("ANALYZE"))
            detail = " ".join(str(r[-1]) for r in explain(uow, CLAIM_SCAN, params))
        else:
            uow.connection.execute(text("ANALYZE pending_turn_inputs"))
            detail = " ".join(str(r[0]) for r in explain(uow, CLAIM_SCAN, params))
    assert "ix_pending_turn_inputs_session_state_seq" in detail, detail
    if backend == "sqlite":  # the index also gives the order: no sort step
        assert "TEMP B-TREE" not in detail.upper()
