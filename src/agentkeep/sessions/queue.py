"""Durable queued work of sessions: enqueue, fenced claims, abandon, cancel, lists.

This module owns the rows of ``queued_work_batches`` and ``queued_work_items``
(docs/sessions.md#queued-work): a batch is a FIFO entry (``enqueue_seq``) of
one or more payload items, claimed as a whole under a session-lease
*generation* (its claim states: docs/sessions.md#batch-claim-states). The pure
rules — which candidates a claim selects (docs/sessions.md#selection-rules)
and how a claim's id and token derive from its first row
(docs/sessions.md#named-predicates) — live in :mod:`agentkeep.sessions.domain`;
the column encodings in :mod:`agentkeep.sessions.codec`.

Fences:

* Every write takes the ``session:<id>`` write lock first and samples ``now``
  once after it (:func:`~agentkeep.sessions.leases.begin_session_write`;
  the original store sampled it before the lock:
  docs/decisions.md#now-is-sampled-once-after-the-lock).
* Claims and completion run FENCE_OK
  (:func:`~agentkeep.sessions.leases.ensure_session_execution_lease`) before
  anything else; the claimant's generation is the fence's ``fencing_token``.
* A claim scan and every per-row claim UPDATE use the CLAIMABLE predicate
  (``claim_token IS NULL OR claim_session_lease_generation <> :generation``):
  claims never expire by time; they go stale only when the generation moves.
* Abandon and completion are fenced by ``(session_id, claim_id, claim_token)``
  only (I-7, docs/sessions.md#invariants): a superseded claimant can never
  touch re-claimed rows.
* Cancel and the pending list hold no fence; they use NOT CLAIM_LIVE (the
  claim's generation is not the fencing token of a live lease).

Statements are module-level :class:`~agentkeep.statements.Statement` constants
built from :mod:`agentkeep.sessions.models` (``queue.*``); batch reads select
:data:`~agentkeep.sessions.codec.BATCH_COLUMNS` then
:data:`~agentkeep.sessions.codec.ITEM_COLUMNS` (items LEFT JOINed, one
statement per read), in the positions the decoders read.

Outcomes:

* A claim returns a :class:`~agentkeep.sessions.domain.QueuedWorkClaim`, or
  ``None`` when nothing is selectable or when it lost a race: a claim is
  all-or-nothing (I-4) — if any per-row UPDATE matches no row, this claim's
  own writes are rolled back to a savepoint and ``None`` is returned; the rest
  of the unit of work is untouched.
* The batches in a returned claim are the snapshots **as loaded before the
  claim UPDATE** (docs/sessions.md#claiming-queued-work): their claim columns
  show the state the claim replaced. Re-read with
  :meth:`QueuedWorkRepository.list_queued_work` to see the stamped rows.
* Cancel returns the pre-delete snapshot, or ``None`` for "absent" and
  "live-claimed" alike.

Errors:

* :class:`~agentkeep.errors.InvalidInput` — a bad argument, before anything is
  written (blank ids, wrong types, an empty batch, counts outside
  ``0..2**63-1``).
* :class:`~agentkeep.errors.SessionExecutionLeaseExpired` — the fence is not
  the live lease (claims, completion).
* :class:`~agentkeep.errors.QueuedWorkSourceKeyConflict` — a resubmission under
  an existing ``source_key`` with different content (the original store
  returned the first batch unchanged;
  docs/decisions.md#queued-work-source-keys-compare-content).
* :class:`~agentkeep.errors.QueuedWorkClaimSuperseded` — a completion that does
  not name **exactly** the rows its claim owns: no duplicates, none missing,
  none extra (the original store compared counts only;
  docs/decisions.md#strict-claim-completion).
* :class:`~agentkeep.errors.SessionCorrupt` — a stored policy, merge key,
  payload or counter does not decode, or a batch in a claim's scan window has
  mixed or empty payload classes; it names the table, row and column. A
  corrupt batch is never skipped: it fails every claim whose window holds it
  and every list of its session (cancel it after repairing the row by hand).

Choices where the original store was open (docs/decisions.md#session-store):

* A blank ``source_key`` is refused like a blank id
  (docs/decisions.md#arguments-are-checked-before-the-lock).
* Batch ids hash 64 random bits besides the process-local nonce, so two hosts
  never mint the same id (docs/decisions.md#derived-ids-carry-random-bits):
  ``"qwb:" + sha256(f"{session_id}:{debug(source_key)}:{now}:{nonce}:{random64}")``.
* Enqueue writes the batch and its items inside a savepoint, so a failure
  leaves neither even when the caller catches the error and goes on in the
  same unit of work (docs/decisions.md#multi-row-writes-run-in-savepoints).
* In a by-ids claim every named row that is read is decoded at once, so a
  corrupt row named by the caller fails the claim even if a later id is
  missing (the original store would have returned ``None`` first;
  docs/decisions.md#by-ids-claims-decode-every-named-batch).
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import secrets
from collections.abc import Callable, Sequence
from typing import Any, Final

from sqlalchemy import bindparam as p
from sqlalchemy import delete, exists, insert, or_, select, update

from agentkeep.bounds import check_u63
from agentkeep.clock import Clock
from agentkeep.db import Driver, atomic
from agentkeep.errors import (
    ConcurrentModification,
    InvalidInput,
    QueuedWorkClaimSuperseded,
    QueuedWorkSourceKeyConflict,
    SessionCorrupt,
)
from agentkeep.sessions.codec import (
    BATCH_COLUMNS,
    CLEARED_CLAIM,
    ITEM_COLUMNS,
    batch_from_row,
    encode_liveness,
    encode_merge_key,
    encode_payload,
    next_claim_fencing,
)
from agentkeep.sessions.domain import (
    MAX_I64,
    ClaimBoundary,
    DeliveryPolicy,
    LeaseFence,
    LeaseOwnerIdentity,
    MergeKey,
    QueuedWorkBatch,
    QueuedWorkClaim,
    QueuedWorkClass,
    QueuedWorkCompletion,
    QueuedWorkDraft,
    QueuedWorkPayload,
    SlotPolicy,
    check_completion,
    check_fence,
    check_id,
    check_json,
    check_ms,
    check_owner,
    checked_queue_claim,
    claim_lease_token,
    saturating_add,
    select_leading_session_command,
    select_turn_work_claim_prefix,
)
from agentkeep.sessions.ids import rust_debug
from agentkeep.sessions.leases import (
    begin_session_write,
    ensure_session_execution_lease,
    lease_read,
)
from agentkeep.sessions.models import QueuedWorkBatchRow, QueuedWorkItemRow, SessionLeaseRow
from agentkeep.statements import Statement

__all__ = [
    "CLAIM_SCAN_SLACK",
    "QueuedWorkRepository",
    "claim_scan_limit",
    "delete_completed_queued_work",
    "enqueue_queued_work_conn",
    "ensure_queued_work_completion",
    "next_enqueue_nonce",
]

#: Extra rows a claim scan reads past ``max_batches`` (docs/sessions.md#claim_ready_queued_work).
CLAIM_SCAN_SLACK: Final = 32

_B = QueuedWorkBatchRow
_I = QueuedWorkItemRow
_N_BATCH_COLS: Final = len(BATCH_COLUMNS)
_BY_SESSION = _B.session_id == p("sid")
_BY_BATCH = _B.batch_id == p("bid")
_READY = _B.available_at_ms <= p("now")
# CLAIMABLE under the claimant's generation: unclaimed, or claimed under another one.
_CLAIMABLE = or_(_B.claim_token.is_(None), _B.claim_session_lease_generation != p("generation"))
# NOT CLAIM_LIVE(row, :now): unclaimed, or claimed under a generation that is
# not the fencing token of a live lease (docs/sessions.md#named-predicates).
_NOT_CLAIM_LIVE = or_(
    _B.claim_token.is_(None),
    ~exists().where(
        SessionLeaseRow.session_id == _B.session_id,
        SessionLeaseRow.lease_token.is_not(None),
        SessionLeaseRow.lease_expires_at_ms > p("now"),
        SessionLeaseRow.lease_fencing_token == _B.claim_session_lease_generation,
    ),
)
# Abandon and completion: fenced by (session_id, claim_id, claim_token) only.
_CLAIM_FENCE = (_BY_SESSION, _B.claim_id == p("cid"), _B.claim_token == p("token"))


def _with_items(*where: Any) -> Any:
    """Batches matching ``where`` joined to their items, in ``enqueue_seq, item_index`` order."""
    return (
        select(*BATCH_COLUMNS, *ITEM_COLUMNS)
        .outerjoin_from(_B, _I, _I.batch_id == _B.batch_id)
        .where(*where)
        .order_by(_B.enqueue_seq, _I.item_index)
    )


def _scan() -> Any:
    """The claim scan: CLAIMABLE and READY, the window, then its items.

    Step 3 of the claim pipeline (docs/sessions.md#claiming-queued-work).

    The window comes off ix_queued_work_batches_session_seq in ``enqueue_seq``
    order and stops at ``:limit``; the window's items are joined outside it.
    """
    window = (
        select(*BATCH_COLUMNS)
        .where(_BY_SESSION, _READY, _CLAIMABLE)
        .order_by(_B.enqueue_seq)
        .limit(p("limit"))
        .subquery("b")
    )
    return (
        select(*window.c, *ITEM_COLUMNS)
        .outerjoin_from(window, _I, _I.batch_id == window.c.batch_id)
        .order_by(window.c.enqueue_seq, _I.item_index)
    )


# Reads: one statement per batch set, items joined (no N+1).
_BY_SOURCE_KEY: Final = Statement(
    _with_items(_BY_SESSION, _B.source_key == p("key")), name="queue.by_source_key"
)
_LIST: Final = Statement(_with_items(_BY_SESSION), name="queue.list")
_LIST_PENDING: Final = Statement(
    _with_items(_BY_SESSION, _NOT_CLAIM_LIVE), name="queue.list_pending"
)
_CANCELLABLE: Final = Statement(
    _with_items(_BY_SESSION, _BY_BATCH, _NOT_CLAIM_LIVE), name="queue.cancellable"
)
_SCAN: Final = Statement(_scan(), name="queue.claim_scan")
_CLAIMABLE_BY_ID: Final = Statement(
    _with_items(_BY_SESSION, _BY_BATCH, _READY, _CLAIMABLE), name="queue.claimable_by_id"
)

# Writes.
_INSERT_BATCH: Final = Statement(
    insert(_B)
    .values(
        batch_id=p("bid"),
        session_id=p("sid"),
        source_key=p("key"),
        delivery_policy=p("delivery"),
        slot_policy=p("slot"),
        merge_key_json=p("merge_key"),
        available_at_ms=p("available_at"),
        enqueued_at_ms=p("now"),
    )
    .returning(*BATCH_COLUMNS),
    name="queue.insert_batch",
)
_INSERT_ITEM: Final = Statement(
    insert(_I).values(
        batch_id=p("bid"), item_index=p("idx"), item_id=p("item_id"), payload_json=p("payload")
    ),
    name="queue.insert_item",
)
# STAMP_CLAIM fenced by CLAIMABLE; the per-row counter saturates at 2**63-1
# (docs/sessions.md#named-predicates).
_STAMP_VALUES: Final = {
    "claim_id": p("cid"),
    "claim_owner_id": p("owner"),
    "claim_owner_incarnation_id": p("inc"),
    "claim_owner_liveness_json": p("liveness"),
    "claim_token": p("token"),
    "claim_fencing_token": next_claim_fencing(_B.claim_fencing_token),
    "claim_session_lease_generation": p("generation"),
}
_STAMP_CLAIM: Final = Statement(
    update(_B).values(_STAMP_VALUES).where(_BY_SESSION, _BY_BATCH, _CLAIMABLE),
    name="queue.stamp_claim",
)
#: The most rows one :data:`_STAMP_CLAIM_MANY` statement stamps (a longer claim takes several).
_STAMP_ROWS: Final = 16


def _stamp_rows(_dialect: Any, *, count: int) -> Any:
    batch_ids: list[Any] = [p(f"bid{i}") for i in range(count)]
    return (
        update(_B).values(_STAMP_VALUES).where(_BY_SESSION, _B.batch_id.in_(batch_ids), _CLAIMABLE)
    )


#: ``_STAMP_CLAIM_MANY[n]``: :data:`_STAMP_CLAIM` of ``n`` rows (``:bid0`` …
#: ``:bid<n-1>``) in one statement.
_STAMP_CLAIM_MANY: Final = {
    n: Statement(functools.partial(_stamp_rows, count=n), name=f"queue.stamp_claim_{n}")
    for n in range(2, _STAMP_ROWS + 1)
}
# CLEAR_CLAIM (docs/sessions.md#named-predicates): claim_fencing_token is kept.
_CLEAR_CLAIM: Final = Statement(
    update(_B).values(CLEARED_CLAIM).where(*_CLAIM_FENCE), name="queue.clear_claim"
)
_OWNED_BY_CLAIM: Final = Statement(
    select(_B.batch_id).where(*_CLAIM_FENCE), name="queue.owned_by_claim"
)
_DELETE_CLAIMED: Final = Statement(delete(_B).where(*_CLAIM_FENCE), name="queue.delete_claimed")
_DELETE_CANCELLABLE: Final = Statement(
    delete(_B).where(_BY_SESSION, _BY_BATCH, _NOT_CLAIM_LIVE), name="queue.delete_cancellable"
)

# Process-local nonce of derived batch ids: its own counter, not shared with the
# auto-GC cadence (docs/decisions.md#derived-ids-carry-random-bits).
_NONCES: Final = itertools.count()


class _LostRace(Exception):
    """A per-row claim UPDATE matched no row: roll this claim back, return None."""


# --------------------------------------------------------------------------
# Pure helpers


def claim_scan_limit(n: int) -> int:
    """The LIMIT of a claim scan for ``n`` wanted batches: ``n + 32``, saturating.

    See docs/sessions.md#claim_ready_queued_work.
    """
    return saturating_add(n, CLAIM_SCAN_SLACK)


def next_enqueue_nonce() -> int:
    """Take the next process-local nonce of derived batch ids (consumed even if unused)."""
    return next(_NONCES)


def _derive_batch_id(session_id: str, source_key: str | None, now: int, nonce: int) -> str:
    seed = f"{session_id}:{rust_debug(source_key)}:{now}:{nonce}:{secrets.token_hex(8)}"
    return "qwb:" + hashlib.sha256(seed.encode("utf-8")).hexdigest()


def _check_fence(value: object) -> LeaseFence:
    return check_fence(value)


def _check_owner(value: object) -> LeaseOwnerIdentity:
    return check_owner(value)


def _check_boundary(value: object) -> ClaimBoundary:
    if not isinstance(value, ClaimBoundary):
        raise InvalidInput("boundary", f"expected a ClaimBoundary, got {value!r}")
    return value


def _check_merge_key(key: object) -> MergeKey:
    if not isinstance(key, MergeKey):
        raise InvalidInput("merge_key", f"expected a MergeKey, got {type(key).__name__}")
    if key.kind == "group":
        if not isinstance(key.group, str):
            raise InvalidInput("merge_key", "a group merge key needs a group name")
    elif key.kind in ("never", "payload_default"):
        if key.group is not None:
            raise InvalidInput("merge_key", f"a {key.kind} merge key has no group name")
    else:
        raise InvalidInput("merge_key", f"unknown merge key kind {key.kind!r}")
    return key


def _check_draft(draft: object) -> QueuedWorkDraft:
    if not isinstance(draft, QueuedWorkDraft):
        raise InvalidInput("draft", f"expected a QueuedWorkDraft, got {type(draft).__name__}")
    check_id(draft.session_id, "draft.session_id")
    if draft.source_key is not None:
        check_id(draft.source_key, "draft.source_key")
    if not isinstance(draft.delivery_policy, DeliveryPolicy):
        raise InvalidInput("draft.delivery_policy", f"got {draft.delivery_policy!r}")
    if not isinstance(draft.slot_policy, SlotPolicy):
        raise InvalidInput("draft.slot_policy", f"got {draft.slot_policy!r}")
    _check_merge_key(draft.merge_key)
    check_ms(draft.available_at_ms, "draft.available_at_ms")
    payloads = draft.payloads
    if not isinstance(payloads, tuple | list) or not payloads:
        raise InvalidInput("draft.payloads", "a batch needs at least one payload")
    for i, payload in enumerate(payloads):
        if not isinstance(payload, QueuedWorkPayload):
            raise InvalidInput(f"draft.payloads[{i}]", f"got {type(payload).__name__}")
        check_id(payload.kind, f"draft.payloads[{i}].kind")
        check_json(payload.body, f"draft.payloads[{i}].body")
    return draft


def _check_completion(completion: object) -> QueuedWorkCompletion:
    result: QueuedWorkCompletion = check_completion(completion, QueuedWorkCompletion, "batch_ids")
    return result


def _check_counters(batch: QueuedWorkBatch) -> QueuedWorkBatch:
    """Refuse stored counters that are not integers in ``0..2**63-1`` (never read as 0)."""
    for column in (
        "enqueue_seq",
        "available_at_ms",
        "enqueued_at_ms",
        "claim_fencing_token",
        "claim_session_lease_generation",
    ):
        value = getattr(batch, column)
        if type(value) is not int or not 0 <= value <= MAX_I64:
            raise SessionCorrupt("queued_work_batches", batch.batch_id, column, repr(value))
    return batch


def _batches(rows: Sequence[Sequence[Any]]) -> list[QueuedWorkBatch]:
    """Decode joined (batch columns, item_index, item_id, payload_json) rows, grouped by batch.

    Rows come ordered by ``enqueue_seq, item_index``; a batch without items
    (LEFT JOIN) has NULL item columns.

    Raises:
        SessionCorrupt: a column does not decode.
    """
    out: list[QueuedWorkBatch] = []
    start = 0
    while start < len(rows):
        head = rows[start]
        end = start
        items = []
        while end < len(rows) and rows[end][1] == head[1]:
            item = rows[end][_N_BATCH_COLS:]
            if item[0] is not None:
                items.append(item)
            end += 1
        out.append(_check_counters(batch_from_row(head[:_N_BATCH_COLS], items)))
        start = end
    return out


def _content_matches(draft: QueuedWorkDraft, batch: QueuedWorkBatch) -> bool:
    """Same policies, merge key, availability and payloads (parsed JSON values compared)."""
    return (
        batch.delivery_policy == draft.delivery_policy
        and batch.slot_policy == draft.slot_policy
        and encode_merge_key(batch.merge_key) == encode_merge_key(draft.merge_key)
        and batch.available_at_ms == draft.available_at_ms
        and [encode_payload(item.payload) for item in batch.items]
        == [encode_payload(p) for p in draft.payloads]
    )


def _corrupt_class(batch: QueuedWorkBatch) -> SessionCorrupt:
    return SessionCorrupt(
        "queued_work_items",
        batch.batch_id,
        "payload_json",
        f"queued-work batch `{batch.batch_id}` has mixed or empty payload classes",
    )


# --------------------------------------------------------------------------
# Statement-level operations, shared with the session commit


def enqueue_queued_work_conn(
    db: Driver, draft: QueuedWorkDraft, now: int, nonce: int, *, nested: bool = True
) -> QueuedWorkBatch:
    """Store ``draft``, or return the batch already stored under its source key.

    See docs/sessions.md#enqueue_queued_work.

    Call it inside the session's write lock with a checked draft (the session
    commit passes its own ``now`` and nonces). The batch row and its items are
    written together or not at all: inside a savepoint, unless ``nested`` is
    False (a one-call unit, which an error rolls back whole; see db.atomic).

    Args:
        db: the unit's driver, after the session write lock was taken.
        draft: the batch to enqueue.
        now: the operation's ``now`` (``enqueued_at_ms``).
        nonce: a value of :func:`next_enqueue_nonce`.

    Returns:
        The stored batch with its items: the new one, or for a known
        ``source_key`` with equal content the existing one as it is now (it
        may be claimed).

    Raises:
        QueuedWorkSourceKeyConflict: the source key is used with other content.
        SessionCorrupt: the existing batch under the source key does not decode.
    """
    sid = draft.session_id
    if draft.source_key is not None:
        existing = _batches(
            db.execute(_BY_SOURCE_KEY, {"sid": sid, "key": draft.source_key}).fetchall()
        )
        if existing:
            if not _content_matches(draft, existing[0]):
                raise QueuedWorkSourceKeyConflict(sid, draft.source_key, existing[0].batch_id)
            return existing[0]
    batch_id = _derive_batch_id(sid, draft.source_key, now, nonce)
    items = [
        (i, f"{batch_id}:item:{i}", encode_payload(payload))
        for i, payload in enumerate(draft.payloads)
    ]
    inserted: list[Any] = []

    def batch_inserted(result: Any) -> None:
        row = result.fetchone()
        if row is None:
            raise ConcurrentModification(f"queued work insert disappeared: {batch_id}")
        inserted.append(row)

    # The batch row and its items go out together (one pipelined round trip on
    # psycopg, Driver.defer); a refused insert fails the savepoint or the unit.
    with atomic(db, nested):
        db.defer(
            _INSERT_BATCH,
            {
                "bid": batch_id,
                "sid": sid,
                "key": draft.source_key,
                "delivery": draft.delivery_policy.value,
                "slot": draft.slot_policy.value,
                "merge_key": encode_merge_key(draft.merge_key),
                "available_at": draft.available_at_ms,
                "now": now,
            },
            batch_inserted,
        )
        for index, item_id, payload_json in items:
            db.defer(
                _INSERT_ITEM,
                {"bid": batch_id, "idx": index, "item_id": item_id, "payload": payload_json},
            )
        db.flush()
    return _check_counters(batch_from_row(inserted[0], items))


def ensure_queued_work_completion(db: Driver, completion: QueuedWorkCompletion) -> None:
    """Check that ``completion`` names exactly the rows its claim owns (strict).

    The owned rows are those with the completion's ``(session_id, claim_id,
    claim_token)``. Strict: ``batch_ids`` must have no duplicates and equal
    that set — none missing, none extra. The original store only compared
    counts (docs/decisions.md#strict-claim-completion). A pure read; call it
    inside the session write lock, before any write of the commit
    (docs/sessions.md#complete_queued_work_claim).

    Raises:
        QueuedWorkClaimSuperseded: the claim was re-claimed, abandoned or
            completed, or the ids are not exactly the owned rows.
        InvalidInput: not a completion, blank ids, no batch ids.
    """
    _check_completion(completion)
    rows = db.execute(*owned_rows_read(completion)).fetchall()
    owned = {r[0] for r in rows}
    ids = completion.batch_ids
    if len(set(ids)) != len(ids) or set(ids) != owned:
        raise QueuedWorkClaimSuperseded(completion.session_id, completion.claim_id)


def owned_rows_read(completion: QueuedWorkCompletion) -> tuple[Statement, dict[str, Any]]:
    """The read :func:`ensure_queued_work_completion` makes (the batch ids the claim owns),
    for :meth:`~agentkeep.db.Driver.prefetching`."""
    return _OWNED_BY_CLAIM, {
        "sid": completion.session_id,
        "cid": completion.claim_id,
        "token": completion.lease_token,
    }


def delete_completed_queued_work(db: Driver, completion: QueuedWorkCompletion) -> None:
    """Check ``completion`` strictly, then delete its rows (items cascade).

    The session commit calls this after its own FENCE_OK, inside the write
    lock. The DELETE is fenced by ``(session_id, claim_id, claim_token)``.

    Raises:
        QueuedWorkClaimSuperseded: see :func:`ensure_queued_work_completion`.
        ConcurrentModification: the rows changed under the lock (a bug signal).
    """
    ensure_queued_work_completion(db, completion)
    deleted = db.execute(
        _DELETE_CLAIMED,
        {
            "sid": completion.session_id,
            "cid": completion.claim_id,
            "token": completion.lease_token,
        },
    ).rowcount
    if deleted != len(completion.batch_ids):
        raise ConcurrentModification(
            f"session {completion.session_id}: claim {completion.claim_id} changed under the lock"
        )


# --------------------------------------------------------------------------
# The repository


class QueuedWorkRepository:
    """Queued-work operations inside one unit of work (``uow.queue``)."""

    def __init__(
        self, driver: Driver, clock: Clock, *, writable: bool, nested: bool = True
    ) -> None:
        self._db = driver
        self._clock = clock
        self._writable = writable
        self._nested = nested  # see db.atomic: False in a one-call unit

    # ------------------------------------------------------------------ enqueue

    def enqueue_queued_work(self, draft: QueuedWorkDraft) -> QueuedWorkBatch:
        """Append a batch to its session's queue, idempotently by ``source_key``.

        See docs/sessions.md#enqueue_queued_work.

        A new batch gets ``batch_id = "qwb:" + sha256 hex`` of
        ``f"{session_id}:{debug(source_key)}:{now}:{nonce}:{random64}"`` and
        items ``f"{batch_id}:item:{i}"``; it is unclaimed and claimable from
        ``draft.available_at_ms``. Resubmitting a draft under a stored
        ``source_key`` with equal content (delivery and slot policy, merge key,
        ``available_at_ms``, payloads compared as parsed JSON) returns the
        stored batch as it is now, claimed or not; nothing is written. The
        batch and its items are written together or not at all.

        Args:
            draft: the batch; at least one payload.

        Returns:
            The stored batch with its items.

        Raises:
            QueuedWorkSourceKeyConflict: the source key is stored with other
                content (the original store returned the first batch
                unchanged; docs/decisions.md#queued-work-source-keys-compare-content).
            InvalidInput: a bad draft (blank ids, no payloads, non-JSON body).
            ReadOnlyUnitOfWork: inside ``store.read()``.
        """
        _check_draft(draft)
        nonce = next_enqueue_nonce()
        now = begin_session_write(self._db, self._clock, self._writable, draft.session_id)
        return enqueue_queued_work_conn(self._db, draft, now, nonce, nested=self._nested)

    # ------------------------------------------------------------------ claims

    def claim_leading_ready_session_command(
        self, session_id: str, fence: LeaseFence, owner: LeaseOwnerIdentity
    ) -> QueuedWorkClaim | None:
        """Claim the first claimable ready batch if it is a session command.

        See docs/sessions.md#claim_leading_ready_session_command.

        Scans ``claim_scan_limit(1)`` claimable (unclaimed, or claimed under
        another generation) ready batches in ``enqueue_seq`` order; claims the
        first one alone when it is a session command, else returns ``None``
        and writes nothing.

        Args:
            session_id: the session.
            fence: the caller's live session lease (its generation pins the claim).
            owner: the claim owner stamped on the row.

        Returns:
            The claim (batches as loaded before the claim UPDATE), or ``None``.

        Raises:
            SessionExecutionLeaseExpired: ``fence`` is not the live lease.
            SessionCorrupt: a batch in the scan window does not decode or has
                mixed or empty payload classes.
            InvalidInput: bad arguments.
        """
        check_id(session_id, "session_id")
        _check_fence(fence)
        _check_owner(owner)
        return self._claim_scanned(
            session_id, fence, owner, claim_scan_limit(1), select_leading_session_command
        )

    def claim_ready_queued_work(
        self,
        session_id: str,
        fence: LeaseFence,
        owner: LeaseOwnerIdentity,
        boundary: ClaimBoundary,
        max_batches: int,
    ) -> QueuedWorkClaim | None:
        """Claim the leading admissible group of ready turn work.

        See docs/sessions.md#claim_ready_queued_work.

        Scans ``max_batches + 32`` claimable ready batches in ``enqueue_seq``
        order and claims the prefix chosen by
        :func:`~agentkeep.sessions.domain.select_turn_work_claim_prefix`: the
        head must be turn work (a ready session command at the head blocks),
        admitted at ``boundary``; a Join head with a mergeable key takes the
        following Join batches of the same policy and key, up to
        ``max_batches``. Future or current-generation-claimed rows are not in
        the scan, so they block nothing. ``max_batches == 0`` returns ``None``
        at once, without touching the database or checking the lease.

        Args:
            session_id: the session.
            fence: the caller's live session lease.
            owner: the claim owner stamped on the rows.
            boundary: where the claimant is (idle or at an active-turn checkpoint).
            max_batches: the most batches to claim, ``0..2**63-1``.

        Returns:
            The claim (batches as loaded before the claim UPDATE), or ``None``
            when nothing is admissible or a row was lost to a race (then
            nothing of this claim is written).

        Raises:
            SessionExecutionLeaseExpired: ``fence`` is not the live lease.
            SessionCorrupt: a batch in the scan window does not decode or has
                mixed or empty payload classes.
            InvalidInput: bad arguments (``max_batches`` negative, too large or
                not an ``int``).
        """
        check_id(session_id, "session_id")
        _check_fence(fence)
        _check_owner(owner)
        _check_boundary(boundary)
        check_u63(max_batches, "max_batches")
        if max_batches == 0:
            return None
        return self._claim_scanned(
            session_id,
            fence,
            owner,
            claim_scan_limit(max_batches),
            lambda candidates: select_turn_work_claim_prefix(candidates, boundary, max_batches),
        )

    def claim_ready_queued_work_by_batch_ids(
        self,
        session_id: str,
        fence: LeaseFence,
        owner: LeaseOwnerIdentity,
        boundary: ClaimBoundary,
        batch_ids: Sequence[str],
    ) -> QueuedWorkClaim | None:
        """Claim exactly the named batches, in the caller's order, as one group.

        See docs/sessions.md#claim_ready_queued_work_by_batch_ids.

        Every id must name a claimable ready batch of the session whose items
        are all turn work, and the ids in the given order must form exactly
        one admissible group (the first passes the boundary gate; several ids
        need a Join head with a mergeable key and the same policy and key on
        every other one). The claim id derives from the **first id given**.
        Duplicate ids yield ``None`` (the second UPDATE of a row fails its
        fence and the claim is rolled back). An empty list returns ``None``
        without a lease check.

        Args:
            session_id: the session.
            fence: the caller's live session lease.
            owner: the claim owner stamped on the rows.
            boundary: where the claimant is.
            batch_ids: the batches to claim, in the claim's order.

        Returns:
            The claim (batches as loaded before the claim UPDATE), or ``None``.

        Raises:
            SessionExecutionLeaseExpired: ``fence`` is not the live lease.
            SessionCorrupt: a named batch does not decode.
            InvalidInput: bad arguments (``batch_ids`` must be a list or tuple
                of non-blank strings).
        """
        check_id(session_id, "session_id")
        _check_fence(fence)
        _check_owner(owner)
        _check_boundary(boundary)
        if not isinstance(batch_ids, list | tuple):
            raise InvalidInput("batch_ids", f"expected a list of ids, got {type(batch_ids)}")
        for i, batch_id in enumerate(batch_ids):
            check_id(batch_id, f"batch_ids[{i}]")
        if not batch_ids:
            return None
        now = begin_session_write(self._db, self._clock, self._writable, session_id)
        ensure_session_execution_lease(self._db, session_id, fence, now)
        generation = fence.fencing_token
        candidates: list[QueuedWorkBatch] = []
        for batch_id in batch_ids:
            rows = self._db.execute(
                _CLAIMABLE_BY_ID,
                {"sid": session_id, "bid": batch_id, "now": now, "generation": generation},
            ).fetchall()
            if not rows:
                return None
            batch = _batches(rows)[0]
            if batch.work_class() is not QueuedWorkClass.TURN_WORK:
                return None
            candidates.append(batch)
        if select_turn_work_claim_prefix(candidates, boundary, len(candidates)) != len(candidates):
            return None
        return self._stamp(session_id, owner, now, generation, candidates)

    def _claim_scanned(
        self,
        session_id: str,
        fence: LeaseFence,
        owner: LeaseOwnerIdentity,
        limit: int,
        select: Callable[[list[QueuedWorkBatch]], int],
    ) -> QueuedWorkClaim | None:
        """FENCE_OK, scan the window, select a prefix, stamp it.

        The shared claim pipeline (docs/sessions.md#claiming-queued-work).
        """
        # psycopg: the lease read goes out with BEGIN and the lock (the scan needs
        # ``now``, sampled once the lock is held, so it cannot go with them).
        with self._db.prefetching([lease_read(session_id)]):
            now = begin_session_write(self._db, self._clock, self._writable, session_id)
            ensure_session_execution_lease(self._db, session_id, fence, now)
        generation = fence.fencing_token
        rows = self._db.execute(
            _SCAN, {"sid": session_id, "now": now, "generation": generation, "limit": limit}
        ).fetchall()
        candidates = _batches(rows)
        for batch in candidates:  # a corrupt batch anywhere in the window fails the claim
            if batch.work_class() is None:
                raise _corrupt_class(batch)
        n = select(candidates)
        if n == 0:
            return None
        return self._stamp(session_id, owner, now, generation, candidates[:n])

    def _stamp(
        self,
        session_id: str,
        owner: LeaseOwnerIdentity,
        now: int,
        generation: int,
        selected: list[QueuedWorkBatch],
    ) -> QueuedWorkClaim | None:
        """Derive the claim lease from the head and STAMP_CLAIM every row, all or none.

        The claim's id and token derive from the first selected row
        (docs/sessions.md#named-predicates).
        """
        head = selected[0]
        fencing = saturating_add(head.claim_fencing_token, 1)
        claim_id = f"qwc:{head.enqueue_seq}:{fencing}"
        token = claim_lease_token(session_id, owner, claim_id, now)
        params: dict[str, Any] = {
            "sid": session_id,
            "cid": claim_id,
            "owner": owner.owner_id,
            "inc": owner.incarnation_id,
            "liveness": encode_liveness(owner),
            "token": token,
            "generation": generation,
        }
        if len(selected) == 1:  # nothing written yet if the one UPDATE loses
            if self._db.execute(_STAMP_CLAIM, {**params, "bid": head.batch_id}).rowcount != 1:
                return None
        else:
            # All or none: every chunk must stamp each of its rows, or the
            # savepoint takes back what the claim wrote.
            try:
                with self._db.savepoint():
                    for start in range(0, len(selected), _STAMP_ROWS):
                        chunk = selected[start : start + _STAMP_ROWS]
                        if len(chunk) == 1:
                            stmt, ids = _STAMP_CLAIM, {"bid": chunk[0].batch_id}
                        else:
                            stmt = _STAMP_CLAIM_MANY[len(chunk)]
                            ids = {f"bid{i}": batch.batch_id for i, batch in enumerate(chunk)}
                        if self._db.execute(stmt, {**params, **ids}).rowcount != len(chunk):
                            raise _LostRace
            except _LostRace:
                return None
        return checked_queue_claim(
            session_id=session_id,
            claim_id=claim_id,
            owner=owner,
            lease_token=token,
            fencing_token=fencing,
            session_lease_generation=generation,
            batches=tuple(selected),
        )

    # ------------------------------------------------------------------ settle a claim

    def abandon_queued_work_claim(self, claim: QueuedWorkClaim | QueuedWorkCompletion) -> None:
        """Give a claim's rows back unclaimed; the per-row counter is kept.

        See docs/sessions.md#abandon_queued_work_claim.

        Fenced by ``(session_id, claim_id, claim_token)`` only; no lease check.
        A stale or superseded claim (its rows re-claimed, completed or
        cancelled) matches nothing and is a silent no-op. The next claim of a
        row gets a higher counter and a new claim id.

        Args:
            claim: the claim, or its completion.

        Raises:
            InvalidInput: not a claim or completion, or blank ids.
            ReadOnlyUnitOfWork: inside ``store.read()``.
        """
        if not isinstance(claim, QueuedWorkClaim | QueuedWorkCompletion):
            raise InvalidInput(
                "claim", f"expected a QueuedWorkClaim or completion, got {type(claim).__name__}"
            )
        check_id(claim.session_id, "claim.session_id")
        check_id(claim.claim_id, "claim.claim_id")
        check_id(claim.lease_token, "claim.lease_token")
        begin_session_write(self._db, self._clock, self._writable, claim.session_id)
        self._db.execute(
            _CLEAR_CLAIM,
            {"sid": claim.session_id, "cid": claim.claim_id, "token": claim.lease_token},
        )

    def ensure_queued_work_completion(self, completion: QueuedWorkCompletion) -> None:
        """Check that ``completion`` names exactly the rows its claim owns; writes nothing.

        See :func:`ensure_queued_work_completion` (strict: no duplicates, none
        missing, none extra).

        Raises:
            QueuedWorkClaimSuperseded: it does not.
            InvalidInput: not a completion, or blank ids.
        """
        ensure_queued_work_completion(self._db, completion)

    def complete_queued_work_claim(
        self, fence: LeaseFence, completion: QueuedWorkCompletion
    ) -> None:
        """Finish a claim: delete exactly its rows (items cascade), under the live lease.

        The standalone form of what a session commit does with a queued-work
        completion: FENCE_OK on ``fence``, then the strict ownership check,
        then ``DELETE`` fenced by ``(session_id, claim_id, claim_token)``. A
        claim taken under an earlier generation may be completed by the live
        holder as long as its rows were not re-claimed.

        Args:
            fence: the caller's live session lease.
            completion: from :meth:`QueuedWorkClaim.completion`.

        Raises:
            SessionExecutionLeaseExpired: ``fence`` is not the live lease.
            QueuedWorkClaimSuperseded: the completion is for another session,
                or does not name exactly the rows its claim owns (the
                original store passed a count-only check; this refuses it
                and deletes nothing: docs/decisions.md#strict-claim-completion).
            InvalidInput: bad arguments.
        """
        _check_fence(fence)
        _check_completion(completion)
        sid = fence.session_id
        # psycopg: the lease read and the owned-rows read go out with BEGIN and
        # the lock, in one round trip; the DELETE is the next.
        reads = [lease_read(sid)]
        if completion.session_id == sid:
            reads.append(owned_rows_read(completion))
        with self._db.prefetching(reads):
            now = begin_session_write(self._db, self._clock, self._writable, sid)
            ensure_session_execution_lease(self._db, sid, fence, now)
            if completion.session_id != sid:
                raise QueuedWorkClaimSuperseded(completion.session_id, completion.claim_id)
            delete_completed_queued_work(self._db, completion)

    # ------------------------------------------------------------------ cancel

    def cancel_queued_work_batch(self, session_id: str, batch_id: str) -> QueuedWorkBatch | None:
        """Delete a batch that is not live-claimed, and return it as it was.

        See docs/sessions.md#cancel_queued_work_batch.

        Host operation, no fence. A batch is cancellable when it is unclaimed
        or its claim is stale (the claim's generation is not the fencing token
        of a live lease: expired, released or taken over). Items cascade.

        Args:
            session_id: the session.
            batch_id: the batch.

        Returns:
            The pre-delete snapshot with its items, or ``None`` when the batch
            does not exist in the session or is live-claimed (indistinguishable).

        Raises:
            SessionCorrupt: the batch does not decode (nothing is deleted).
            InvalidInput: blank ids.
            ReadOnlyUnitOfWork: inside ``store.read()``.
        """
        check_id(session_id, "session_id")
        check_id(batch_id, "batch_id")
        now = begin_session_write(self._db, self._clock, self._writable, session_id)
        params = {"sid": session_id, "bid": batch_id, "now": now}
        rows = self._db.execute(_CANCELLABLE, params).fetchall()
        if not rows:
            return None
        batch = _batches(rows)[0]
        if self._db.execute(_DELETE_CANCELLABLE, params).rowcount != 1:
            raise ConcurrentModification(f"session {session_id}: batch {batch_id} changed")
        return batch

    # ------------------------------------------------------------------ reads

    def list_queued_work(self, session_id: str) -> list[QueuedWorkBatch]:
        """Every batch of the session with its items, in ``enqueue_seq`` order.

        See docs/sessions.md#list_queued_work.

        Claimed or not, ready or not. One statement (items joined), so one
        snapshot in any unit of work.

        Raises:
            SessionCorrupt: a batch does not decode (named in the error).
            InvalidInput: blank session id.
        """
        check_id(session_id, "session_id")
        return _batches(self._db.execute(_LIST, {"sid": session_id}).fetchall())

    def list_pending_queued_work(self, session_id: str) -> list[QueuedWorkBatch]:
        """Batches not live-claimed now, with items, in ``enqueue_seq`` order.

        See docs/sessions.md#list_pending_queued_work.

        Unclaimed and stale-claimed batches are listed; so are future-dated
        ones (no ``available_at_ms`` filter).

        Raises:
            SessionCorrupt: a listed batch does not decode.
            InvalidInput: blank session id.
        """
        check_id(session_id, "session_id")
        rows = self._db.execute(
            _LIST_PENDING, {"sid": session_id, "now": self._clock.now_ms()}
        ).fetchall()
        return _batches(rows)
