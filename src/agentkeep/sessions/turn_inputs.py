"""Pending turn inputs of sessions: enqueue, fenced claims, completion, abandon, cancel, lists.

This module owns the ``pending_turn_inputs`` table: user or host inputs that
wait for a turn of their session, their lifecycle state and their claims
(docs/sessions.md#turn-inputs).

Lifecycle (docs/sessions.md#turn-input-lifecycle). An input is enqueued
``pending_active`` (``ActiveTurn`` ingress: deliver into that turn) or
``deferred_next_turn`` (``NextTurn`` ingress). The session's lease holder
claims inputs under its session-lease generation: an active-turn claim moves
them to ``accepted``, a next-turn claim only marks ownership (the state stays
``deferred_next_turn``). A claim ends by completion (``completed``, in the
session commit), by abandon (back to the claimable state), or by going *stale*
when the lease generation changes. Hosts cancel inputs that nobody holds live
(``cancelled``).
Fences:

* Claims, completion and recovery are fenced by the caller's lease
  (:func:`~agentkeep.sessions.leases.ensure_session_execution_lease`,
  FENCE_OK) and, per row, by CLAIMABLE (``claim_token IS NULL OR
  claim_session_lease_generation <> :generation``): claims never expire by
  time, only a new generation may re-claim a row.
* Completion and abandon are fenced by ``(session_id, claim_id, claim_token)``
  only, so a superseded claimant can never touch rows re-claimed by another
  (I-7, docs/sessions.md#invariants). Abandon needs no lease.
* Cancel and the pending list hold no fence; they evaluate CLAIM_LIVE (the
  claim's generation is the fencing token of a live lease at ``now``).

The predicates FENCE_OK, CLAIMABLE and CLAIM_LIVE are defined in
docs/sessions.md#named-predicates.

Statements are module-level :class:`~agentkeep.statements.Statement` constants
built from :mod:`agentkeep.sessions.models` (``turn_inputs.*``); rows are read
as :data:`~agentkeep.sessions.codec.INPUT_COLUMNS`. The fixed states a
statement writes or filters on are bound as ``:state_<value>`` (for example
``:state_cancelled``), never spelled into the SQL.

Every write operation checks its arguments (:class:`InvalidInput` before
anything is written), then takes the ``session:<id>`` write lock and samples
``now`` once *after* it (the original store sampled it before the lock; it
only matters for a lease that expires while a caller waits for the lock,
which then fails FENCE_OK instead of passing it:
docs/decisions.md#now-is-sampled-once-after-the-lock). Operations that write
several rows run inside :meth:`Driver.savepoint`, so an error, or a claim
that loses a race (``None``), leaves nothing of the operation behind even
inside a larger unit of work (a one-call claim of one input needs none: its
one UPDATE stamps the row or writes nothing, and an error rolls the unit back)
(docs/decisions.md#a-typed-error-means-nothing-was-written).

Choices where the original store was open (docs/decisions.md#session-store):

* Source-key idempotency compares the draft with the ingress *as first
  submitted* (``submitted_ingress_json``), not with ``ingress_json``, which an
  interrupted turn rewrites to ``NextTurn``: re-submitting the original draft
  after such a deferral returns the existing row (the original store raised a
  conflict; docs/decisions.md#submitted-ingress).
* Derived input ids hash 64 random bits besides the process-local nonce, so
  two hosts never mint the same id
  (docs/decisions.md#derived-ids-carry-random-bits):
  ``"ti:" + sha256(f"{session_id}:{rust_debug(source_key)}:{now}:{nonce}:{random64}")``.
* An explicit ``input_id`` that already exists, in any session, is
  :class:`~agentkeep.errors.TurnInputDuplicate` (the original store surfaced
  the unique violation as a backend error;
  docs/decisions.md#typed-duplicate-errors).
* Claims and cancels return the rows as stored after their write (claim
  columns included); the original store returned the pre-update rows with
  only the state changed (docs/decisions.md#claimed-rows-as-returned).
* Completion is strict (docs/decisions.md#strict-claim-completion): the
  completed ids must be exactly the rows the claim owns, without duplicates;
  an empty list is refused as invalid input (a claim always holds at least
  one input).
* Accepted inputs whose claim went stale are not stranded (the original
  store left them with no way out of ``accepted``):
  :meth:`TurnInputRepository.recover_stale_turn_input_claims` returns them to
  ``pending_active`` under the caller's live fence
  (docs/decisions.md#stranded-accepted-inputs-are-recoverable).

Outcomes and errors:

* claims return :class:`~agentkeep.sessions.domain.TurnInputClaim` or
  ``None`` (nothing claimable, ``max_inputs == 0``, or a lost race — nothing
  written);
* cancels return per-row outcomes (``Cancelled``, ``AlreadyCancelled``,
  ``AlreadyCompleted``, ``AlreadyClaimed``, ``NotFoundOutcome``);
* :class:`~agentkeep.errors.SessionExecutionLeaseExpired` — the fence is not
  the live lease; :class:`~agentkeep.errors.PendingTurnInputSourceKeyConflict`,
  :class:`~agentkeep.errors.TurnInputDuplicate`,
  :class:`~agentkeep.errors.TurnInputClaimSuperseded`,
  :class:`~agentkeep.errors.InvalidInput`,
  :class:`~agentkeep.errors.ReadOnlyUnitOfWork`;
* :class:`~agentkeep.errors.SessionCorrupt` — a stored ingress, state or
  input does not decode (named by table, input id and column); never read as
  absent.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import secrets
from collections.abc import Sequence
from typing import Any, Final

from sqlalchemy import and_, case, exists, or_, select, update
from sqlalchemy import bindparam as p

from agentkeep.clock import Clock
from agentkeep.db import Driver, atomic
from agentkeep.errors import (
    ConcurrentModification,
    InvalidInput,
    PendingTurnInputSourceKeyConflict,
    TurnInputClaimSuperseded,
    TurnInputDuplicate,
)
from agentkeep.sessions.codec import (
    CLEARED_CLAIM,
    INPUT_COLUMNS,
    encode_ingress,
    encode_liveness,
    input_from_row,
    next_claim_fencing,
)
from agentkeep.sessions.domain import (
    MAX_I64,
    ActiveTurnIngress,
    ActiveTurnMode,
    AlreadyCancelled,
    AlreadyClaimed,
    AlreadyCompleted,
    AnchorNotFound,
    Cancelled,
    CancelOutcome,
    CancelResult,
    CancelTarget,
    CheckpointKind,
    ClaimDiagnostics,
    InputIdTarget,
    LeaseFence,
    LeaseOwnerIdentity,
    NextTurnIngress,
    NextTurnMode,
    NotFoundOutcome,
    PendingTurnInput,
    PendingTurnInputDraft,
    SourceKeyTarget,
    SuffixOutcomes,
    TurnInputClaim,
    TurnInputClaimMode,
    TurnInputCompletion,
    TurnInputState,
    check_completion,
    check_fence,
    check_id,
    check_json,
    check_owner,
    checked_input_claim,
    claim_lease_token,
    saturating_add,
)
from agentkeep.sessions.ids import rust_debug
from agentkeep.sessions.leases import (
    begin_session_write,
    ensure_session_execution_lease,
    lease_read,
)
from agentkeep.sessions.models import PendingTurnInputRow, SessionLeaseRow
from agentkeep.statements import Statement, upsert
from agentkeep.strict_json import canonical_json

__all__ = [
    "CLAIM_SCAN",
    "SCAN_SLACK",
    "TurnInputRepository",
    "complete_turn_input_rows",
    "derive_pending_turn_input_id",
    "ensure_turn_input_completion",
    "rust_debug",
]

#: Extra rows a claim scan reads beyond ``max_inputs``: non-matching rows are
#: skipped, so a few more let one round trip find the matches
#: (docs/sessions.md#claim_active_turn_inputs).
SCAN_SLACK: Final = 32

_T = PendingTurnInputRow
_BY_SESSION = _T.session_id == p("sid")
_BY_INPUT = _T.input_id == p("iid")
# Abandon, ownership and completion: fenced by (session_id, claim_id, claim_token) only.
_CLAIM_FENCE = (_BY_SESSION, _T.claim_id == p("cid"), _T.claim_token == p("token"))
# CLAIM_LIVE of a pending_turn_inputs row, for observers without a fence
# (docs/sessions.md#named-predicates).
_CLAIM_LIVE = and_(
    _T.claim_token.is_not(None),
    exists().where(
        SessionLeaseRow.session_id == _T.session_id,
        SessionLeaseRow.lease_token.is_not(None),
        SessionLeaseRow.lease_expires_at_ms > p("now"),
        SessionLeaseRow.lease_fencing_token == _T.claim_session_lease_generation,
    ),
)
_CLAIMABLE = or_(_T.claim_token.is_(None), _T.claim_session_lease_generation != p("gen"))


def _state(state: TurnInputState) -> Any:
    """A fixed state value, bound for every call as ``:state_<value>``.

    Named, not anonymous: SQLAlchemy names an anonymous value in ``SET state =``
    after the column, which would collide with the callers' ``:state``.
    """
    return p(f"state_{state.value}", state.value, type_=_T.state.type)


_BY_SOURCE_KEY: Final = Statement(
    select(*INPUT_COLUMNS).where(_BY_SESSION, _T.source_key == p("key")),
    name="turn_inputs.by_source_key",
)
_BY_INPUT_ID: Final = Statement(
    select(*INPUT_COLUMNS).where(_BY_SESSION, _BY_INPUT), name="turn_inputs.by_input_id"
)
# ON CONFLICT (input_id): an explicit id that exists in any session writes
# nothing (also when another session's enqueue of that id commits meanwhile).
_INSERT: Final = Statement(
    lambda d: (
        upsert(d, _T)
        .values(
            input_id=p("iid"),
            session_id=p("sid"),
            source_key=p("key"),
            ingress_json=p("ingress"),
            submitted_ingress_json=p("ingress"),
            state=p("state"),
            input_json=p("input"),
            enqueued_at_ms=p("now"),
        )
        .on_conflict_do_nothing(index_elements=[_T.input_id])
        .returning(*INPUT_COLUMNS)
    ),
    name="turn_inputs.insert",
)
_LIST_PENDING: Final = Statement(
    select(*INPUT_COLUMNS)
    .where(
        _BY_SESSION,
        _T.state.in_(
            [_state(TurnInputState.PENDING_ACTIVE), _state(TurnInputState.DEFERRED_NEXT_TURN)]
        ),
        ~_CLAIM_LIVE,
    )
    .order_by(_T.enqueue_seq),
    name="turn_inputs.list_pending",
)
_LIST_ALL: Final = Statement(
    select(*INPUT_COLUMNS).where(_BY_SESSION).order_by(_T.enqueue_seq),
    name="turn_inputs.list_all",
)
_SUFFIX: Final = Statement(
    select(*INPUT_COLUMNS).where(_BY_SESSION, _T.enqueue_seq >= p("seq")).order_by(_T.enqueue_seq),
    name="turn_inputs.suffix",
)
_LEASE: Final = Statement(
    select(
        SessionLeaseRow.lease_token,
        SessionLeaseRow.lease_fencing_token,
        SessionLeaseRow.lease_expires_at_ms,
    ).where(SessionLeaseRow.session_id == p("sid")),
    name="turn_inputs.lease",
)
_CANCEL: Final = Statement(
    update(_T)
    .values(state=_state(TurnInputState.CANCELLED), **CLEARED_CLAIM)
    .where(_BY_SESSION, _BY_INPUT, _T.state == p("state"))
    .returning(*INPUT_COLUMNS),
    name="turn_inputs.cancel",
)
#: The claim scan (docs/sessions.md#claim_active_turn_inputs, step 3); served by
#: ix_pending_turn_inputs_session_state_seq.
CLAIM_SCAN: Final = Statement(
    select(*INPUT_COLUMNS)
    .where(_BY_SESSION, _T.state == p("state"), _CLAIMABLE)
    .order_by(_T.enqueue_seq)
    .limit(p("limit")),
    name="turn_inputs.claim_scan",
)
# STAMP_CLAIM with the per-row counter saturating at 2**63-1
# (docs/sessions.md#named-predicates, docs/sessions.md#conventions).
_STAMP_VALUES: Final = {
    "state": p("state_after"),
    "claim_id": p("cid"),
    "claim_owner_id": p("owner"),
    "claim_owner_incarnation_id": p("inc"),
    "claim_owner_liveness_json": p("liveness"),
    "claim_token": p("token"),
    "claim_fencing_token": next_claim_fencing(_T.claim_fencing_token),
    "claim_session_lease_generation": p("gen"),
}
_STAMP: Final = Statement(
    update(_T)
    .values(_STAMP_VALUES)
    .where(_BY_SESSION, _BY_INPUT, _CLAIMABLE)
    .returning(*INPUT_COLUMNS),
    name="turn_inputs.stamp_claim",
)
#: The most rows one :data:`_STAMP_MANY` statement stamps (a longer claim takes several).
_STAMP_ROWS: Final = 16


def _stamp_rows(_dialect: Any, *, count: int) -> Any:
    return (
        update(_T)
        .values(_STAMP_VALUES)
        .where(_BY_SESSION, _T.input_id.in_([p(f"iid{i}") for i in range(count)]), _CLAIMABLE)
        .returning(*INPUT_COLUMNS)
    )


#: ``_STAMP_MANY[n]``: :data:`_STAMP` of ``n`` rows (``:iid0`` … ``:iid<n-1>``) in one
#: statement; the rows come back in no particular order.
_STAMP_MANY: Final = {
    n: Statement(functools.partial(_stamp_rows, count=n), name=f"turn_inputs.stamp_claim_{n}")
    for n in range(2, _STAMP_ROWS + 1)
}
_ABANDON: Final = Statement(
    update(_T)
    .values(
        state=case((_T.state == _state(TurnInputState.ACCEPTED), p("restored")), else_=_T.state),
        **CLEARED_CLAIM,
    )
    .where(*_CLAIM_FENCE),
    name="turn_inputs.abandon",
)
_OWNED: Final = Statement(select(_T.input_id).where(*_CLAIM_FENCE), name="turn_inputs.owned")
_COMPLETE: Final = Statement(
    update(_T).values(state=_state(TurnInputState.COMPLETED), **CLEARED_CLAIM).where(*_CLAIM_FENCE),
    name="turn_inputs.complete",
)
_STALE_ACCEPTED: Final = Statement(
    select(*INPUT_COLUMNS)
    .where(
        _BY_SESSION,
        _T.state == _state(TurnInputState.ACCEPTED),
        _T.claim_session_lease_generation != p("gen"),
    )
    .order_by(_T.enqueue_seq),
    name="turn_inputs.stale_accepted",
)
_RECOVER: Final = Statement(
    update(_T)
    .values(state=_state(TurnInputState.PENDING_ACTIVE), **CLEARED_CLAIM)
    .where(
        _BY_SESSION,
        _BY_INPUT,
        _T.state == _state(TurnInputState.ACCEPTED),
        _T.claim_session_lease_generation == p("had"),
    )
    .returning(*INPUT_COLUMNS),
    name="turn_inputs.recover",
)


# Process-local nonce of derived ids: its own counter, not the auto-GC cadence
# (docs/decisions.md#derived-ids-carry-random-bits).
_NONCES = itertools.count()


def _random64() -> str:
    """64 random bits as 16 hex digits; tests replace this to pin ids.

    See docs/decisions.md#derived-ids-carry-random-bits.
    """
    return secrets.token_hex(8)


# --------------------------------------------------------------------------
# Derived ids (docs/sessions.md#enqueue_pending_turn_input, step 4)


def derive_pending_turn_input_id(
    session_id: str, source_key: str | None, now: int, nonce: int, random64: str
) -> str:
    """``"ti:" + sha256 hex of f"{session_id}:{rust_debug(source_key)}:{now}:{nonce}:{random64}"``.

    The original store's formula plus 64 random bits
    (docs/decisions.md#derived-ids-carry-random-bits).
    """
    seed = f"{session_id}:{rust_debug(source_key)}:{now}:{nonce}:{random64}"
    return "ti:" + hashlib.sha256(seed.encode("utf-8")).hexdigest()


# --------------------------------------------------------------------------
# Argument checks


def _check_fence(value: object, field: str) -> LeaseFence:
    return check_fence(value, field)


def _check_owner(value: object) -> LeaseOwnerIdentity:
    return check_owner(value)


def _check_ingress(value: object, field: str) -> ActiveTurnIngress | NextTurnIngress:
    if isinstance(value, ActiveTurnIngress):
        check_id(value.turn_id, f"{field}.turn_id")
        return value
    if isinstance(value, NextTurnIngress):
        return value
    raise InvalidInput(field, f"expected a turn-input ingress, got {type(value).__name__}")


def _check_draft(draft: object) -> PendingTurnInputDraft:
    if not isinstance(draft, PendingTurnInputDraft):
        raise InvalidInput("draft", f"expected a PendingTurnInputDraft, got {type(draft).__name__}")
    check_id(draft.session_id, "draft.session_id")
    if draft.input_id is not None:
        check_id(draft.input_id, "draft.input_id")
    if draft.source_key is not None:
        check_id(draft.source_key, "draft.source_key")
    _check_ingress(draft.ingress, "draft.ingress")
    check_json(draft.input, "draft.input")
    return draft


def _check_target(value: object, field: str) -> CancelTarget:
    if isinstance(value, InputIdTarget):
        check_id(value.input_id, f"{field}.input_id")
        return value
    if isinstance(value, SourceKeyTarget):
        check_id(value.source_key, f"{field}.source_key")
        return value
    raise InvalidInput(
        field, f"expected an InputIdTarget or SourceKeyTarget, got {type(value).__name__}"
    )


def _check_max(value: object) -> int:
    if type(value) is not int:
        raise InvalidInput("max_inputs", f"expected an integer, got {type(value).__name__}")
    if value < 0:
        raise InvalidInput("max_inputs", f"must be >= 0, got {value}")
    return value


def _check_completion(value: object) -> TurnInputCompletion:
    result: TurnInputCompletion = check_completion(value, TurnInputCompletion, "input_ids")
    return result


# --------------------------------------------------------------------------
# Completion (used by complete_turn_input_claim and by the session commit)


def owned_rows_read(completion: TurnInputCompletion) -> tuple[Statement, dict[str, Any]]:
    """The read :func:`ensure_turn_input_completion` makes (the input ids the claim owns),
    for :meth:`~agentkeep.db.Driver.prefetching`."""
    return _OWNED, {
        "sid": completion.session_id,
        "cid": completion.claim_id,
        "token": completion.lease_token,
    }


def ensure_turn_input_completion(db: Driver, completion: TurnInputCompletion) -> None:
    """Check that ``completion`` names exactly the inputs its claim owns (strict).

    See docs/sessions.md#complete_turn_input_claim and
    docs/decisions.md#strict-claim-completion.

    The owned rows are those with ``(session_id, claim_id, claim_token)`` of
    the completion. A pure read: call it inside the write unit, under the
    session lock, before any write of the operation that completes the claim.

    Args:
        db: the unit of work's driver connection.
        completion: the claim's completion.

    Raises:
        TurnInputClaimSuperseded: ``input_ids`` has duplicates, misses an
            owned row, or names a row the claim does not own (the claim was
            re-claimed, abandoned, recovered or already completed).
        InvalidInput: a malformed completion (blank ids, empty ``input_ids``).
    """
    _check_completion(completion)
    ids = list(completion.input_ids)
    rows = db.execute(*owned_rows_read(completion)).fetchall()
    owned = [r[0] for r in rows]
    if len(set(ids)) != len(ids) or len(owned) != len(ids) or set(owned) != set(ids):
        raise TurnInputClaimSuperseded(completion.session_id, completion.claim_id)


def complete_turn_input_rows(db: Driver, completion: TurnInputCompletion) -> None:
    """Mark the claim's inputs ``completed`` and clear their claim.

    The turn commit's completion of turn inputs
    (docs/sessions.md#order-of-checks-and-writes).

    Call after :func:`ensure_turn_input_completion` in the same locked unit.
    ``claim_fencing_token`` is kept.

    Raises:
        ConcurrentModification: the rows changed between the check and the
            write although the session lock is held (a bug signal).
    """
    params = {
        "sid": completion.session_id,
        "cid": completion.claim_id,
        "token": completion.lease_token,
    }
    if db.execute(_COMPLETE, params).rowcount != len(completion.input_ids):
        raise ConcurrentModification(
            f"session {completion.session_id}: turn-input claim {completion.claim_id} "
            "changed under the write lock"
        )


# --------------------------------------------------------------------------
# The repository


class _LostRace(Exception):
    """A claim UPDATE matched no row: roll this claim back and return None."""


class _Lease:
    """The lease row as CLAIM_LIVE needs it (token, generation, expiry)."""

    __slots__ = ("expires", "fencing", "token")

    def __init__(self, row: Sequence[Any] | None) -> None:
        self.token: str | None = None if row is None else row[0]
        self.fencing: int = 0 if row is None else row[1]
        self.expires: int = 0 if row is None else row[2]

    def claim_live(self, item: PendingTurnInput, now: int) -> bool:
        """CLAIM_LIVE of ``item`` at ``now``, evaluated in code.

        See docs/sessions.md#named-predicates.
        """
        return (
            item.claim_token is not None
            and self.token is not None
            and self.expires > now
            and self.fencing == item.claim_session_lease_generation
        )


def _diagnostics(item: PendingTurnInput) -> ClaimDiagnostics | None:
    """Who holds (or held) the claim; None if unclaimed and not accepted.

    The diagnostics of ``AlreadyClaimed`` (docs/sessions.md#cancel_pending_turn_inputs).
    """
    if item.claim_token is None and item.state is not TurnInputState.ACCEPTED:
        return None
    return ClaimDiagnostics.model_construct(
        state=item.state,
        claim_id=item.claim_id,
        claim_owner=item.claim_owner,
        claim_fencing_token=item.claim_fencing_token,
        claim_session_lease_generation=item.claim_session_lease_generation,
    )


class TurnInputRepository:
    """Pending turn inputs of sessions inside one unit of work (``uow.turn_inputs``)."""

    def __init__(
        self, driver: Driver, clock: Clock, *, writable: bool, nested: bool = True
    ) -> None:
        self._db = driver
        self._clock = clock
        self._writable = writable
        self._nested = nested  # see db.atomic: False in a one-call unit

    # ---------------------------------------------------------------- enqueue

    def enqueue_pending_turn_input(self, draft: PendingTurnInputDraft) -> PendingTurnInput:
        """Store a turn input, idempotently by ``(session_id, source_key)``.

        See docs/sessions.md#enqueue_pending_turn_input.

        * With a ``source_key`` already used in the session: if the draft's
          ingress equals the stored *submitted* ingress and its input equals
          the stored input as JSON values (key order irrelevant), the
          existing row is returned as it is now, whatever its state; nothing
          is written. Because the submitted ingress is compared (not
          ``ingress_json``, which an interrupted turn rewrites to
          ``NextTurn``), re-submitting the original draft after such a
          deferral returns the existing row; the original store raised a
          conflict here (docs/decisions.md#submitted-ingress).
        * Otherwise a new row: ``input_id`` is the draft's or derived as
          :func:`derive_pending_turn_input_id` (process nonce and 64 random
          bits); the state is ``pending_active`` for ``ActiveTurn`` ingress
          and ``deferred_next_turn`` for ``NextTurn``.

        The idempotency window ends when ``vacuum`` deletes the row.

        Args:
            draft: the session, optional ``input_id`` and ``source_key``, the
                ingress and the input (a JSON value).

        Returns:
            The stored input.

        Raises:
            PendingTurnInputSourceKeyConflict: the source key is used with a
                different ingress or input; nothing written.
            TurnInputDuplicate: the explicit ``input_id`` exists (in any
                session); nothing written.
            InvalidInput: blank ids, a bad ingress, an input that is not a
                JSON value.
            SessionCorrupt: the stored row under the source key does not decode.
            ReadOnlyUnitOfWork: inside ``store.read()``.
        """
        _check_draft(draft)
        sid = draft.session_id
        ingress_json = encode_ingress(draft.ingress)
        input_json = canonical_json(draft.input)
        now = begin_session_write(self._db, self._clock, self._writable, sid)
        nonce = next(_NONCES)
        if draft.source_key is not None:
            row = self._db.execute(_BY_SOURCE_KEY, {"sid": sid, "key": draft.source_key}).fetchone()
            if row is not None:
                existing = input_from_row(row)
                if (
                    encode_ingress(existing.submitted_ingress) == ingress_json
                    and canonical_json(existing.input) == input_json
                ):
                    return existing
                raise PendingTurnInputSourceKeyConflict(sid, draft.source_key, existing.input_id)
        input_id = draft.input_id or derive_pending_turn_input_id(
            sid, draft.source_key, now, nonce, _random64()
        )
        state = (
            TurnInputState.PENDING_ACTIVE
            if isinstance(draft.ingress, ActiveTurnIngress)
            else TurnInputState.DEFERRED_NEXT_TURN
        )
        params = {
            "iid": input_id,
            "sid": sid,
            "key": draft.source_key,
            "ingress": ingress_json,
            "state": state.value,
            "input": input_json,
            "now": now,
        }
        inserted = self._db.execute(_INSERT, params).fetchone()
        if inserted is None:
            raise TurnInputDuplicate(input_id)
        return input_from_row(inserted)

    # ---------------------------------------------------------------- reads

    def list_pending_turn_inputs(self, session_id: str) -> list[PendingTurnInput]:
        """Inputs waiting for a turn and not held by a live claim, by ``enqueue_seq``.

        See docs/sessions.md#list_pending_turn_inputs.

        Lists ``pending_active`` and ``deferred_next_turn`` rows that are
        unclaimed or stale-claimed (CLAIM_LIVE evaluated at the clock's
        ``now``). Hidden: ``accepted``, ``completed``, ``cancelled`` rows and
        rows with a live claim. Works in read units.

        Args:
            session_id: the session.

        Returns:
            The inputs in FIFO order.

        Raises:
            SessionCorrupt: a listed row does not decode.
            InvalidInput: blank session id.
        """
        check_id(session_id, "session_id")
        now = self._clock.now_ms()
        rows = self._db.execute(_LIST_PENDING, {"sid": session_id, "now": now}).fetchall()
        return [input_from_row(r) for r in rows]

    def list_turn_inputs(self, session_id: str) -> list[PendingTurnInput]:
        """Every input of the session, in any state, by ``enqueue_seq`` (an observer helper).

        Args:
            session_id: the session.

        Returns:
            All stored inputs of the session in FIFO order.

        Raises:
            SessionCorrupt: a row does not decode.
            InvalidInput: blank session id.
        """
        check_id(session_id, "session_id")
        rows = self._db.execute(_LIST_ALL, {"sid": session_id}).fetchall()
        return [input_from_row(r) for r in rows]

    # ---------------------------------------------------------------- cancel

    def _load_target(self, session_id: str, target: CancelTarget) -> PendingTurnInput | None:
        if isinstance(target, InputIdTarget):
            row = self._db.execute(
                _BY_INPUT_ID, {"sid": session_id, "iid": target.input_id}
            ).fetchone()
        else:
            row = self._db.execute(
                _BY_SOURCE_KEY, {"sid": session_id, "key": target.source_key}
            ).fetchone()
        return None if row is None else input_from_row(row)

    def _cancel_row(self, item: PendingTurnInput, lease: _Lease, now: int) -> CancelOutcome:
        """The row-cancel rule (docs/sessions.md#cancel_pending_turn_inputs)."""
        if item.state is TurnInputState.CANCELLED:
            return AlreadyCancelled(input=item)
        if item.state is TurnInputState.COMPLETED:
            return AlreadyCompleted(input=item)
        if item.state is TurnInputState.ACCEPTED or lease.claim_live(item, now):
            return AlreadyClaimed(claim=_diagnostics(item), input=item)
        params = {"sid": item.session_id, "iid": item.input_id, "state": item.state.value}
        row = self._db.execute(_CANCEL, params).fetchone()
        if row is None:
            raise ConcurrentModification(
                f"session {item.session_id}: turn input {item.input_id} changed under the lock"
            )
        return Cancelled(input=input_from_row(row))

    def _lease(self, session_id: str) -> _Lease:
        return _Lease(self._db.execute(_LEASE, {"sid": session_id}).fetchone())

    def cancel_pending_turn_inputs(
        self, session_id: str, targets: Sequence[CancelTarget]
    ) -> list[CancelResult]:
        """Cancel inputs by id or source key, one outcome per target, in order.

        See docs/sessions.md#cancel_pending_turn_inputs.

        Per target: no row → ``NotFoundOutcome``; ``cancelled`` →
        ``AlreadyCancelled``; ``completed`` → ``AlreadyCompleted``;
        ``accepted`` (whatever its claim) or a live claim → ``AlreadyClaimed``
        with diagnostics (who holds or held the claim); otherwise the row
        becomes ``cancelled`` with its claim cleared → ``Cancelled`` (the row
        as now stored). A target named twice sees ``AlreadyCancelled`` the
        second time. No fence is needed; CLAIM_LIVE is evaluated against the
        lease row at ``now``.

        Args:
            session_id: the session.
            targets: ``InputIdTarget`` / ``SourceKeyTarget`` values.

        Returns:
            ``CancelResult(target, outcome)`` per target.

        Raises:
            SessionCorrupt: a targeted row does not decode; no target is
                cancelled (the whole operation rolls back).
            InvalidInput: bad targets.
            ReadOnlyUnitOfWork: inside ``store.read()``.
        """
        check_id(session_id, "session_id")
        if isinstance(targets, str | bytes) or not isinstance(targets, Sequence):
            raise InvalidInput("targets", "expected a sequence of cancel targets")
        checked = [_check_target(t, f"targets[{i}]") for i, t in enumerate(targets)]
        now = begin_session_write(self._db, self._clock, self._writable, session_id)
        if not checked:
            return []
        lease = self._lease(session_id)
        results: list[CancelResult] = []
        with atomic(self._db, self._nested):
            for target in checked:
                item = self._load_target(session_id, target)
                outcome = NotFoundOutcome() if item is None else self._cancel_row(item, lease, now)
                results.append(CancelResult(target=target, outcome=outcome))
        return results

    def cancel_pending_turn_input_suffix(
        self, session_id: str, anchor: CancelTarget
    ) -> AnchorNotFound | SuffixOutcomes:
        """Cancel the anchor and every later input of the session.

        See docs/sessions.md#cancel_pending_turn_input_suffix.

        The anchor is found as in :meth:`cancel_pending_turn_inputs`; then the
        row-cancel rule applies to every row of the session with
        ``enqueue_seq >=`` the anchor's, in order, in any state and of both
        ingress kinds.

        Args:
            session_id: the session.
            anchor: the first input to cancel.

        Returns:
            ``AnchorNotFound(anchor)`` (nothing written), or
            ``SuffixOutcomes(anchor, outcomes)`` with one outcome per row.

        Raises:
            SessionCorrupt: a row of the suffix does not decode; nothing is
                cancelled.
            InvalidInput: blank session id or a bad anchor.
            ReadOnlyUnitOfWork: inside ``store.read()``.
        """
        check_id(session_id, "session_id")
        _check_target(anchor, "anchor")
        now = begin_session_write(self._db, self._clock, self._writable, session_id)
        head = self._load_target(session_id, anchor)
        if head is None:
            return AnchorNotFound(anchor=anchor)
        rows = self._db.execute(_SUFFIX, {"sid": session_id, "seq": head.enqueue_seq}).fetchall()
        items = [input_from_row(r) for r in rows]  # every decode before any write
        lease = self._lease(session_id)
        with atomic(self._db, self._nested):
            outcomes = tuple(self._cancel_row(item, lease, now) for item in items)
        return SuffixOutcomes(anchor=anchor, outcomes=outcomes)

    # ---------------------------------------------------------------- claims

    def claim_active_turn_inputs(
        self,
        session_id: str,
        fence: LeaseFence,
        owner: LeaseOwnerIdentity,
        turn_id: str,
        checkpoint: CheckpointKind,
        max_inputs: int,
    ) -> TurnInputClaim | None:
        """Claim ``pending_active`` inputs of ``turn_id`` admitted at ``checkpoint``.

        See docs/sessions.md#claim_active_turn_inputs.

        Scans the session's claimable ``pending_active`` rows in FIFO order
        (``max_inputs + 32`` rows at most) and selects, up to ``max_inputs``,
        those whose ingress is ``ActiveTurn`` for ``turn_id`` with a
        ``min_boundary`` that admits ``checkpoint``; other rows are skipped,
        not blocking. The selected rows become ``accepted`` under one claim:
        ``claim_id = "tic:<seq>:<n>"`` from the first selected row's
        ``enqueue_seq`` and its per-row counter + 1, token
        :func:`~agentkeep.sessions.domain.claim_lease_token`, generation
        ``fence.fencing_token``.

        ``max_inputs == 0`` returns ``None`` at once: no database access and
        no lease check.

        Args:
            session_id: the session.
            fence: the caller's live session lease.
            owner: the claim owner stamped on the rows.
            turn_id: the active turn.
            checkpoint: where the turn is.
            max_inputs: the most inputs to claim.

        Returns:
            The claim (its inputs as now stored), or ``None`` when nothing is
            claimable or the claim lost a race (nothing written).

        Raises:
            SessionExecutionLeaseExpired: ``fence`` is not the live lease.
            SessionCorrupt: a scanned row does not decode.
            InvalidInput: bad arguments (negative ``max_inputs`` included).
            ReadOnlyUnitOfWork: inside ``store.read()``.
        """
        check_id(turn_id, "turn_id")
        if not isinstance(checkpoint, CheckpointKind):
            raise InvalidInput(
                "checkpoint", f"expected a CheckpointKind, got {type(checkpoint).__name__}"
            )
        mode = ActiveTurnMode.model_construct(turn_id=turn_id, checkpoint=checkpoint)
        return self._claim(session_id, fence, owner, mode, max_inputs)

    def claim_next_turn_inputs(
        self, session_id: str, fence: LeaseFence, owner: LeaseOwnerIdentity, max_inputs: int
    ) -> TurnInputClaim | None:
        """Claim the first ``deferred_next_turn`` inputs, marking ownership only.

        See docs/sessions.md#claim_next_turn_inputs.

        Like :meth:`claim_active_turn_inputs`, but the rows keep the state
        ``deferred_next_turn``; while the claim is live they are hidden from
        :meth:`list_pending_turn_inputs` and cannot be cancelled.

        Args:
            session_id: the session.
            fence: the caller's live session lease.
            owner: the claim owner stamped on the rows.
            max_inputs: the most inputs to claim (0 → ``None`` without any check).

        Returns:
            The claim, or ``None`` (nothing claimable, or a lost race).

        Raises:
            SessionExecutionLeaseExpired: ``fence`` is not the live lease.
            SessionCorrupt: a scanned row does not decode.
            InvalidInput: bad arguments.
            ReadOnlyUnitOfWork: inside ``store.read()``.
        """
        return self._claim(session_id, fence, owner, NextTurnMode(), max_inputs)

    def _stamp_chunk(
        self, stamp: dict[str, Any], chunk: list[PendingTurnInput]
    ) -> list[PendingTurnInput]:
        """STAMP ``chunk``'s rows in one statement; the stamped rows in ``chunk``'s order.

        Raises:
            _LostRace: a row was not stamped (no longer claimable); the caller's
                savepoint takes back the rows that were.
            SessionCorrupt: a stamped row does not decode.
        """
        if len(chunk) == 1:
            rows = self._db.execute(_STAMP, {**stamp, "iid": chunk[0].input_id}).fetchall()
        else:
            params = dict(stamp)
            for i, item in enumerate(chunk):
                params[f"iid{i}"] = item.input_id
            rows = self._db.execute(_STAMP_MANY[len(chunk)], params).fetchall()
        if len(rows) != len(chunk):
            raise _LostRace
        by_id = {stamped.input_id: stamped for stamped in map(input_from_row, rows)}
        return [by_id[item.input_id] for item in chunk]

    def _claim(
        self,
        session_id: str,
        fence: LeaseFence,
        owner: LeaseOwnerIdentity,
        mode: TurnInputClaimMode,
        max_inputs: int,
    ) -> TurnInputClaim | None:
        check_id(session_id, "session_id")
        _check_fence(fence, "fence")
        _check_owner(owner)
        _check_max(max_inputs)
        if max_inputs == 0:
            return None
        gen = fence.fencing_token
        active = isinstance(mode, ActiveTurnMode)
        wanted = TurnInputState.PENDING_ACTIVE if active else TurnInputState.DEFERRED_NEXT_TURN
        scan = {
            "sid": session_id,
            "state": wanted.value,
            "gen": gen,
            "limit": saturating_add(min(max_inputs, MAX_I64 - SCAN_SLACK), SCAN_SLACK),
        }
        # psycopg: the lease read and the scan (which needs no ``now``) go out
        # with BEGIN and the lock, in one round trip.
        with self._db.prefetching([lease_read(session_id), (CLAIM_SCAN, scan)]):
            now = begin_session_write(self._db, self._clock, self._writable, session_id)
            ensure_session_execution_lease(self._db, session_id, fence, now)
            scanned = self._db.execute(CLAIM_SCAN, scan).fetchall()
        selected: list[PendingTurnInput] = []
        for row in scanned:
            item = input_from_row(row)
            if item.claim_token is not None and item.claim_session_lease_generation == gen:
                continue  # not CLAIMABLE (the scan already filtered it)
            if isinstance(mode, ActiveTurnMode):
                ingress = item.ingress
                if not (
                    isinstance(ingress, ActiveTurnIngress)
                    and ingress.turn_id == mode.turn_id
                    and ingress.admits_checkpoint(mode.checkpoint)
                ):
                    continue
            elif item.state is not TurnInputState.DEFERRED_NEXT_TURN:
                continue
            selected.append(item)
            if len(selected) >= max_inputs:
                break
        if not selected:
            return None
        head = selected[0]
        fencing = saturating_add(head.claim_fencing_token, 1)
        claim_id = f"tic:{head.enqueue_seq}:{fencing}"
        token = claim_lease_token(session_id, owner, claim_id, now)
        state_after = TurnInputState.ACCEPTED if active else TurnInputState.DEFERRED_NEXT_TURN
        stamp = {
            "sid": session_id,
            "state_after": state_after.value,
            "cid": claim_id,
            "owner": owner.owner_id,
            "inc": owner.incarnation_id,
            "liveness": encode_liveness(owner),
            "token": token,
            "gen": gen,
        }
        claimed: list[PendingTurnInput] = []
        if len(selected) == 1 and not self._nested:
            # A one-call unit's claim of one input: its one UPDATE stamps the row
            # or writes nothing, and any error rolls the whole unit back.
            row = self._db.execute(_STAMP, {**stamp, "iid": head.input_id}).fetchone()
            if row is None:
                return None
            claimed.append(input_from_row(row))
        else:
            # All or none: every chunk must stamp each of its rows, or the
            # savepoint takes back what the claim wrote.
            try:
                with self._db.savepoint():
                    for start in range(0, len(selected), _STAMP_ROWS):
                        claimed.extend(
                            self._stamp_chunk(stamp, selected[start : start + _STAMP_ROWS])
                        )
            except _LostRace:
                return None
        return checked_input_claim(
            session_id=session_id,
            claim_id=claim_id,
            owner=owner,
            lease_token=token,
            fencing_token=fencing,
            session_lease_generation=gen,
            mode=mode,
            inputs=tuple(claimed),
        )

    def abandon_turn_input_claim(self, claim: TurnInputClaim) -> None:
        """Give a claim's inputs back; always succeeds, no lease check.

        See docs/sessions.md#abandon_turn_input_claim.

        Rows still matching ``(session_id, claim_id, claim_token)`` get their
        claim cleared (``claim_fencing_token`` kept); ``accepted`` rows go back
        to ``pending_active`` (active-turn claim), next-turn rows stay
        ``deferred_next_turn``. A stale or superseded claim matches nothing:
        a silent no-op.

        Args:
            claim: the claim as returned by a claim operation.

        Raises:
            InvalidInput: not a TurnInputClaim, or blank ids.
            ReadOnlyUnitOfWork: inside ``store.read()``.
        """
        if not isinstance(claim, TurnInputClaim):
            raise InvalidInput("claim", f"expected a TurnInputClaim, got {type(claim).__name__}")
        check_id(claim.session_id, "claim.session_id")
        check_id(claim.claim_id, "claim.claim_id")
        check_id(claim.lease_token, "claim.lease_token")
        restored = (
            TurnInputState.PENDING_ACTIVE
            if isinstance(claim.mode, ActiveTurnMode)
            else TurnInputState.DEFERRED_NEXT_TURN
        )
        begin_session_write(self._db, self._clock, self._writable, claim.session_id)
        self._db.execute(
            _ABANDON,
            {
                "sid": claim.session_id,
                "cid": claim.claim_id,
                "token": claim.lease_token,
                "restored": restored.value,
            },
        )

    # ---------------------------------------------------------------- completion, recovery

    def ensure_turn_input_completion(self, completion: TurnInputCompletion) -> None:
        """See :func:`ensure_turn_input_completion` (a read; writes nothing).

        Raises:
            TurnInputClaimSuperseded: the ids are not exactly the claim's rows.
            InvalidInput: a malformed completion.
        """
        ensure_turn_input_completion(self._db, completion)

    def complete_turn_input_claim(self, fence: LeaseFence, completion: TurnInputCompletion) -> None:
        """Complete a claim's inputs under the caller's live lease.

        See docs/sessions.md#complete_turn_input_claim; a turn commit does the
        same check and write (docs/sessions.md#order-of-checks-and-writes).

        FENCE_OK with ``fence``; then the completion must be for the fence's
        session and name exactly the rows the claim owns
        (:func:`ensure_turn_input_completion`); then those rows become
        ``completed`` with their claim cleared (``claim_fencing_token`` kept),
        next-turn claimed rows included. This is the turn-input part of the
        session commit, usable on its own.

        Args:
            fence: the caller's live session lease.
            completion: the claim's completion (``claim.completion()``).

        Raises:
            SessionExecutionLeaseExpired: ``fence`` is not the live lease.
            TurnInputClaimSuperseded: the completion is for another session,
                or does not name exactly the claim's rows; nothing written.
            InvalidInput: bad fence or completion.
            ReadOnlyUnitOfWork: inside ``store.read()``.
        """
        _check_fence(fence, "fence")
        _check_completion(completion)
        sid = fence.session_id
        # psycopg: the lease read and the owned-rows read go out with BEGIN and
        # the lock, in one round trip; the UPDATE is the next.
        reads = [lease_read(sid)]
        if completion.session_id == sid:
            reads.append(owned_rows_read(completion))
        with self._db.prefetching(reads):
            now = begin_session_write(self._db, self._clock, self._writable, sid)
            ensure_session_execution_lease(self._db, sid, fence, now)
            if completion.session_id != sid:
                raise TurnInputClaimSuperseded(completion.session_id, completion.claim_id)
            ensure_turn_input_completion(self._db, completion)
            complete_turn_input_rows(self._db, completion)

    def recover_stale_turn_input_claims(
        self, session_id: str, fence: LeaseFence
    ) -> list[PendingTurnInput]:
        """Return ``accepted`` inputs whose claim went stale to ``pending_active``.

        See docs/sessions.md#recover_stale_turn_input_claims.

        Such rows are otherwise stranded: claims scan only ``pending_active``
        and ``deferred_next_turn``, lists hide them and cancel answers
        ``AlreadyClaimed``. Under the caller's live fence (FENCE_OK), every
        ``accepted`` row of the session whose claim generation is not the
        live one (``fence.fencing_token``) gets its claim cleared
        (``claim_fencing_token`` kept) and becomes ``pending_active`` again;
        each UPDATE is fenced by the generation the row had. Rows claimed by
        the live generation are untouched. The old claimant's completion and
        abandon then match nothing.

        Args:
            session_id: the session.
            fence: the caller's live session lease.

        Returns:
            The recovered inputs as now stored, by ``enqueue_seq``.

        Raises:
            SessionExecutionLeaseExpired: ``fence`` is not the live lease;
                nothing changed.
            SessionCorrupt: a stale accepted row does not decode; nothing changed.
            InvalidInput: bad arguments.
            ReadOnlyUnitOfWork: inside ``store.read()``.
        """
        check_id(session_id, "session_id")
        _check_fence(fence, "fence")
        now = begin_session_write(self._db, self._clock, self._writable, session_id)
        ensure_session_execution_lease(self._db, session_id, fence, now)
        rows = self._db.execute(
            _STALE_ACCEPTED, {"sid": session_id, "gen": fence.fencing_token}
        ).fetchall()
        stale = [input_from_row(r) for r in rows]
        recovered: list[PendingTurnInput] = []
        with atomic(self._db, self._nested):
            for item in stale:
                params = {
                    "sid": session_id,
                    "iid": item.input_id,
                    "had": item.claim_session_lease_generation,
                }
                row = self._db.execute(_RECOVER, params).fetchone()
                if row is None:
                    raise ConcurrentModification(
                        f"session {session_id}: turn input {item.input_id} changed under the lock"
                    )
                recovered.append(input_from_row(row))
        return recovered
