"""Value types of the session store's coordination half: leases, queued work, turn inputs.

This module owns the immutable values that the lease, queue and turn-input
repositories take and return, with their wire encodings (the strings and JSON
shapes stored in the tables), and the pure rules that decide without the
database: owner identity (:func:`same_incarnation`), the selection functions
of queued-work claims (docs/sessions.md#selection-rules), the turn-input
ingress rules (docs/sessions.md#turn-inputs) and the derivation of a claim's
token (docs/sessions.md#named-predicates). There is no database code here and
so no fence: the fenced reads and writes are in :mod:`agentkeep.sessions.leases`,
:mod:`agentkeep.sessions.queue` and :mod:`agentkeep.sessions.turn_inputs`.

Conventions:

* Times are epoch milliseconds; counters are integers in ``0..2**63-1`` and
  saturate there instead of wrapping (docs/sessions.md#conventions). The
  bound and its checks are :mod:`agentkeep.bounds`'s (:data:`MAX_I64`,
  :func:`check_ms` and :func:`saturating_add` re-bind them).
* Ids are non-blank strings without NUL (:func:`check_id`).
* JSON payloads the store only round-trips (queued-work payload bodies, turn
  inputs) must be JSON values; they are stored as canonical JSON text
  (:mod:`agentkeep.strict_json`).
"""

from __future__ import annotations

import enum
import hashlib
from typing import Annotated, Any, Final, Literal, TypeAlias

from pydantic import BaseModel, ConfigDict, Field, Strict

from agentkeep.bounds import I64_MAX, U32, U63, saturating_add
from agentkeep.bounds import check_u63 as check_ms
from agentkeep.checked_records import checked_builder
from agentkeep.errors import InvalidInput
from agentkeep.strict_json import json_value_problem
from agentkeep.text import text_problem

__all__ = [
    "MAX_I64",
    "AcquireOutcome",
    "Acquired",
    "ActiveTurnIngress",
    "ActiveTurnMode",
    "AlreadyCancelled",
    "AlreadyClaimed",
    "AlreadyCompleted",
    "AnchorNotFound",
    "Busy",
    "CancelOutcome",
    "CancelResult",
    "CancelTarget",
    "Cancelled",
    "CheckpointKind",
    "ClaimBoundary",
    "ClaimDiagnostics",
    "DeliveryPolicy",
    "InputIdTarget",
    "LeaseFence",
    "LeaseOwnerIdentity",
    "LocalProcess",
    "MergeKey",
    "MinBoundary",
    "NextTurnIngress",
    "NextTurnMode",
    "NotFoundOutcome",
    "Opaque",
    "OwnerLiveness",
    "PendingTurnInput",
    "PendingTurnInputDraft",
    "QueuedWorkBatch",
    "QueuedWorkClaim",
    "QueuedWorkClass",
    "QueuedWorkCompletion",
    "QueuedWorkDraft",
    "QueuedWorkItem",
    "QueuedWorkPayload",
    "SessionExecutionLease",
    "SlotPolicy",
    "SourceKeyTarget",
    "SuffixCancelResult",
    "SuffixOutcomes",
    "TurnInputClaim",
    "TurnInputClaimMode",
    "TurnInputCompletion",
    "TurnInputIngress",
    "TurnInputState",
    "check_completion",
    "check_fence",
    "check_id",
    "check_json",
    "check_ms",
    "check_owner",
    "claim_lease_token",
    "same_incarnation",
    "saturating_add",
    "select_leading_session_command",
    "select_turn_work_claim_prefix",
]

#: ``2**63-1``, the top of every counter (:data:`agentkeep.bounds.I64_MAX`).
MAX_I64: Final = I64_MAX
_FROZEN = ConfigDict(frozen=True, extra="forbid")

Ms = U63
Text = Annotated[str, Strict()]


def check_id(value: object, field: str) -> str:
    """Validate an id argument: a non-blank ``str`` that keeps the text rule
    (:mod:`agentkeep.text`: no NUL, no lone surrogate).

    Checked before anything is sent, so a bad id is refused alike on every
    backend and driver, whatever a unit would otherwise send first.

    Raises:
        InvalidInput: otherwise; nothing is written.
    """
    if not isinstance(value, str):
        raise InvalidInput(field, f"expected a string, got {type(value).__name__}")
    if not value.strip():
        raise InvalidInput(field, "must not be blank")
    if "\x00" in value or not value.isascii():  # ASCII without NUL: nothing to look for
        problem = text_problem(value)
        if problem is not None:
            raise InvalidInput(field, problem)
    return value


def check_json(value: object, field: str) -> object:
    """Validate a JSON value argument (see :func:`agentkeep.strict_json.json_value_problem`).

    Raises:
        InvalidInput: ``value`` is not a storable JSON value; nothing is written.
    """
    problem = json_value_problem(value)
    if problem is not None:
        raise InvalidInput(field, problem)
    return value


# --------------------------------------------------------------------------
# Lease owners (docs/sessions.md#lease-owners)


class Opaque(BaseModel):
    """Liveness that cannot be checked: such a holder is never taken over before expiry."""

    model_config = _FROZEN
    kind: Literal["opaque"] = "opaque"


class LocalProcess(BaseModel):
    """A process on a known host and boot, identified by pid and start time (procfs)."""

    model_config = _FROZEN
    kind: Literal["local_process"] = "local_process"
    host_id: Text
    boot_id: Text
    pid: U32
    process_start: Text


OwnerLiveness: TypeAlias = Annotated[Opaque | LocalProcess, Field(discriminator="kind")]


class LeaseOwnerIdentity(BaseModel):
    """Who holds (or claims) a lease: a stable owner id and a per-process incarnation."""

    model_config = _FROZEN
    owner_id: Text
    incarnation_id: Text
    liveness: OwnerLiveness = Field(default_factory=Opaque)


def same_incarnation(a: LeaseOwnerIdentity, b: LeaseOwnerIdentity) -> bool:
    """True when ``a`` and ``b`` are the same owner and incarnation (liveness ignored)."""
    return a.owner_id == b.owner_id and a.incarnation_id == b.incarnation_id


class LeaseFence(BaseModel):
    """What a fenced operation presents: the session, owner, lease token and generation.

    Every :class:`SessionExecutionLease` is also a fence.
    """

    model_config = _FROZEN
    session_id: Text
    owner: LeaseOwnerIdentity
    lease_token: Text
    fencing_token: Ms


class SessionExecutionLease(LeaseFence):
    """A session execution lease as acquired, extended or renewed."""

    claimed_at_epoch_ms: Ms
    expires_at_epoch_ms: Ms


class Acquired(BaseModel):
    """The caller holds the lease."""

    model_config = _FROZEN
    lease: SessionExecutionLease


class Busy(BaseModel):
    """Another owner holds a live lease; nothing was written."""

    model_config = _FROZEN
    holder: SessionExecutionLease


AcquireOutcome: TypeAlias = Acquired | Busy


# --------------------------------------------------------------------------
# Queued work (docs/sessions.md#queued-work)


class DeliveryPolicy(enum.StrEnum):
    """When a batch may be delivered into a turn."""

    EARLIEST_SAFE_BOUNDARY = "earliest_safe_boundary"
    AFTER_CURRENT_TURN_COMMIT = "after_current_turn_commit"


class SlotPolicy(enum.StrEnum):
    """Whether a batch may share a claim with the batches after it."""

    EXCLUSIVE = "exclusive"
    JOIN = "join"


class MergeKey(BaseModel):
    """Which Join batches may be claimed together.

    Wire form (``merge_key_json``): ``"never"``, ``"payload_default"`` or
    ``{"group":"<name>"}``. Equality is structural.
    """

    model_config = _FROZEN
    kind: Literal["never", "payload_default", "group"]
    group: Text | None = None

    @classmethod
    def never(cls) -> MergeKey:
        return cls(kind="never")

    @classmethod
    def payload_default(cls) -> MergeKey:
        return cls(kind="payload_default")

    @classmethod
    def of_group(cls, name: str) -> MergeKey:
        return cls(kind="group", group=name)

    def wire(self) -> object:
        """The JSON value stored in ``merge_key_json``."""
        return {"group": self.group} if self.kind == "group" else self.kind


class QueuedWorkClass(enum.StrEnum):
    """The class of a batch, from its payloads: ``session_command`` kind or turn work."""

    SESSION_COMMAND = "session_command"
    TURN_WORK = "turn_work"


class ClaimBoundary(enum.StrEnum):
    """Where the claimant is: idle (any policy), or at an active turn's checkpoint."""

    IDLE = "idle"
    ACTIVE_TURN_CHECKPOINT = "active_turn_checkpoint"


class QueuedWorkPayload(BaseModel):
    """One item of a batch: a kind (``session_command`` or a turn-work kind) and a JSON body.

    Wire form (``payload_json``): ``{"kind":"<kind>","body":<json>}``.
    """

    model_config = _FROZEN
    kind: Text
    body: Any = None

    def work_class(self) -> QueuedWorkClass:
        """``SESSION_COMMAND`` for kind ``session_command``, else ``TURN_WORK``."""
        if self.kind == "session_command":
            return QueuedWorkClass.SESSION_COMMAND
        return QueuedWorkClass.TURN_WORK


class QueuedWorkItem(BaseModel):
    """A stored payload item of a batch."""

    model_config = _FROZEN
    item_index: Ms
    item_id: Text
    payload: QueuedWorkPayload


class QueuedWorkDraft(BaseModel):
    """What to enqueue: one batch of payloads for a session."""

    model_config = _FROZEN
    session_id: Text
    source_key: Text | None = None
    delivery_policy: DeliveryPolicy = DeliveryPolicy.EARLIEST_SAFE_BOUNDARY
    slot_policy: SlotPolicy = SlotPolicy.EXCLUSIVE
    merge_key: MergeKey = Field(default_factory=MergeKey.never)
    available_at_ms: Ms = 0
    payloads: tuple[QueuedWorkPayload, ...]


class QueuedWorkBatch(BaseModel):
    """A stored batch with its items and claim columns."""

    model_config = _FROZEN
    enqueue_seq: Ms
    batch_id: Text
    session_id: Text
    source_key: Text | None
    delivery_policy: DeliveryPolicy
    slot_policy: SlotPolicy
    merge_key: MergeKey
    available_at_ms: Ms
    enqueued_at_ms: Ms
    claim_id: Text | None
    claim_owner: LeaseOwnerIdentity | None
    claim_token: Text | None
    claim_fencing_token: Ms
    claim_session_lease_generation: Ms
    items: tuple[QueuedWorkItem, ...]

    def work_class(self) -> QueuedWorkClass | None:
        """The one class all items share, or None for mixed or empty (corrupt) batches."""
        classes = {item.payload.work_class() for item in self.items}
        return classes.pop() if len(classes) == 1 else None


class _ClaimFields(BaseModel):
    """What every claim carries: its id and token, the owner, the row counter and generation."""

    model_config = _FROZEN
    session_id: Text
    claim_id: Text
    owner: LeaseOwnerIdentity
    lease_token: Text
    fencing_token: Ms
    session_lease_generation: Ms


class _CompletionFields(BaseModel):
    """What every completion names: the claim (id and token) of one session."""

    model_config = _FROZEN
    session_id: Text
    claim_id: Text
    lease_token: Text


class QueuedWorkClaim(_ClaimFields):
    """A claim on one or more batches, valid while its session-lease generation is live."""

    batches: tuple[QueuedWorkBatch, ...]

    def completion(self) -> QueuedWorkCompletion:
        """The completion a session commit presents to finish this claim."""
        return QueuedWorkCompletion(
            session_id=self.session_id,
            claim_id=self.claim_id,
            lease_token=self.lease_token,
            batch_ids=tuple(b.batch_id for b in self.batches),
        )


class QueuedWorkCompletion(_CompletionFields):
    """Finish a queued-work claim: must name exactly the batches the claim owns."""

    batch_ids: tuple[Text, ...]


def select_leading_session_command(candidates: list[QueuedWorkBatch]) -> int:
    """1 if the first claimable ready batch is a session command, else 0.

    Session commands are claimed one at a time, so each goes through its own
    fenced commit before the next (docs/sessions.md#selection-rules).
    """
    if candidates and candidates[0].work_class() is QueuedWorkClass.SESSION_COMMAND:
        return 1
    return 0


def select_turn_work_claim_prefix(
    candidates: list[QueuedWorkBatch], boundary: ClaimBoundary, max_batches: int
) -> int:
    """How many leading candidates form one admissible turn-work claim.

    The head must be turn work (a ready session command at the head blocks
    turn work); at an active-turn checkpoint the head must be deliverable at
    the earliest safe boundary; a Join head with a mergeable key (not
    ``never``) extends over the following Join batches with the same delivery
    policy and merge key, up to ``max_batches``
    (docs/sessions.md#selection-rules).
    """
    if max_batches <= 0 or not candidates:
        return 0
    head = candidates[0]
    if head.work_class() is not QueuedWorkClass.TURN_WORK:
        return 0
    if (
        boundary is ClaimBoundary.ACTIVE_TURN_CHECKPOINT
        and head.delivery_policy is not DeliveryPolicy.EARLIEST_SAFE_BOUNDARY
    ):
        return 0
    if head.slot_policy is not SlotPolicy.JOIN or head.merge_key.kind == "never":
        return 1
    selected = 1
    for c in candidates[1:]:
        if selected >= max_batches:
            break
        if (
            c.work_class() is not QueuedWorkClass.TURN_WORK
            or c.slot_policy is not SlotPolicy.JOIN
            or c.delivery_policy is not head.delivery_policy
            or c.merge_key != head.merge_key
        ):
            break
        selected += 1
    return selected


def claim_lease_token(session_id: str, owner: LeaseOwnerIdentity, claim_id: str, now: int) -> str:
    """The claim token: sha256 hex of ``session:owner:incarnation:claim_id:now``.

    See docs/sessions.md#named-predicates.
    """
    seed = f"{session_id}:{owner.owner_id}:{owner.incarnation_id}:{claim_id}:{now}"
    return hashlib.sha256(seed.encode("utf-8")).hexdigest()


# --------------------------------------------------------------------------
# Turn inputs (docs/sessions.md#turn-inputs)


class TurnInputState(enum.StrEnum):
    """Lifecycle state of a pending turn input (the strings stored in ``state``)."""

    PENDING_ACTIVE = "pending_active"
    DEFERRED_NEXT_TURN = "deferred_next_turn"
    ACCEPTED = "accepted"
    CANCELLED = "cancelled"
    COMPLETED = "completed"


class MinBoundary(enum.StrEnum):
    """The earliest checkpoint of the active turn at which an input may be delivered."""

    AFTER_WORK = "after_work"
    BEFORE_COMPLETION = "before_completion"


class CheckpointKind(enum.StrEnum):
    """The checkpoint a claimant of active-turn inputs is at."""

    AFTER_WORK = "after_work"
    BEFORE_COMPLETION = "before_completion"


class ActiveTurnIngress(BaseModel):
    """Deliver into the named active turn, at or after ``min_boundary``."""

    model_config = _FROZEN
    scope: Literal["active_turn"] = "active_turn"
    turn_id: Text
    min_boundary: MinBoundary = MinBoundary.AFTER_WORK

    def admits_checkpoint(self, checkpoint: CheckpointKind) -> bool:
        """``after_work`` admits every checkpoint; ``before_completion`` only that one."""
        return (
            self.min_boundary is MinBoundary.AFTER_WORK
            or checkpoint is CheckpointKind.BEFORE_COMPLETION
        )


class NextTurnIngress(BaseModel):
    """Deliver at the start of the next turn."""

    model_config = _FROZEN
    scope: Literal["next_turn"] = "next_turn"

    def admits_checkpoint(self, checkpoint: CheckpointKind) -> bool:
        return False


TurnInputIngress: TypeAlias = Annotated[
    ActiveTurnIngress | NextTurnIngress, Field(discriminator="scope")
]


class PendingTurnInputDraft(BaseModel):
    """A turn input to enqueue. ``input`` is an opaque JSON value."""

    model_config = _FROZEN
    session_id: Text
    input_id: Text | None = None
    source_key: Text | None = None
    ingress: TurnInputIngress
    input: Any


class PendingTurnInput(BaseModel):
    """A stored turn input with its lifecycle state and claim columns.

    ``submitted_ingress`` is the ingress as first submitted; ``ingress`` may
    later be rewritten (an interrupted turn defers its inputs to the next turn).
    Source-key idempotency compares against the submitted one.
    """

    model_config = _FROZEN
    enqueue_seq: Ms
    input_id: Text
    session_id: Text
    source_key: Text | None
    ingress: TurnInputIngress
    submitted_ingress: TurnInputIngress
    state: TurnInputState
    input: Any
    enqueued_at_ms: Ms
    claim_id: Text | None
    claim_owner: LeaseOwnerIdentity | None
    claim_token: Text | None
    claim_fencing_token: Ms
    claim_session_lease_generation: Ms


class ActiveTurnMode(BaseModel):
    """Claim ``pending_active`` inputs of ``turn_id`` admitted at ``checkpoint`` (→ accepted)."""

    model_config = _FROZEN
    kind: Literal["active_turn"] = "active_turn"
    turn_id: Text
    checkpoint: CheckpointKind


class NextTurnMode(BaseModel):
    """Claim ``deferred_next_turn`` inputs (ownership only; the state is unchanged)."""

    model_config = _FROZEN
    kind: Literal["next_turn"] = "next_turn"


TurnInputClaimMode: TypeAlias = Annotated[
    ActiveTurnMode | NextTurnMode, Field(discriminator="kind")
]


class TurnInputClaim(_ClaimFields):
    """A claim on turn inputs, valid while its session-lease generation is live."""

    mode: TurnInputClaimMode
    inputs: tuple[PendingTurnInput, ...]

    def completion(self) -> TurnInputCompletion:
        """The completion a session commit presents to finish this claim."""
        return TurnInputCompletion(
            session_id=self.session_id,
            claim_id=self.claim_id,
            lease_token=self.lease_token,
            input_ids=tuple(i.input_id for i in self.inputs),
        )


class TurnInputCompletion(_CompletionFields):
    """Finish a turn-input claim: must name exactly the inputs the claim owns."""

    input_ids: tuple[Text, ...]


class InputIdTarget(BaseModel):
    """Address a turn input by its id."""

    model_config = _FROZEN
    input_id: Text


class SourceKeyTarget(BaseModel):
    """Address a turn input by its source key."""

    model_config = _FROZEN
    source_key: Text


CancelTarget: TypeAlias = InputIdTarget | SourceKeyTarget


class ClaimDiagnostics(BaseModel):
    """Who holds (or held) the claim that blocks a cancel.

    See docs/sessions.md#cancel_pending_turn_inputs.
    """

    model_config = _FROZEN
    state: TurnInputState
    claim_id: Text | None
    claim_owner: LeaseOwnerIdentity | None
    claim_fencing_token: Ms
    claim_session_lease_generation: Ms


class Cancelled(BaseModel):
    model_config = _FROZEN
    input: PendingTurnInput


class AlreadyCancelled(BaseModel):
    model_config = _FROZEN
    input: PendingTurnInput


class AlreadyCompleted(BaseModel):
    model_config = _FROZEN
    input: PendingTurnInput


class AlreadyClaimed(BaseModel):
    model_config = _FROZEN
    claim: ClaimDiagnostics | None
    input: PendingTurnInput


class NotFoundOutcome(BaseModel):
    """No input matched the target."""

    model_config = _FROZEN


CancelOutcome: TypeAlias = (
    Cancelled | AlreadyCancelled | AlreadyCompleted | AlreadyClaimed | NotFoundOutcome
)


class CancelResult(BaseModel):
    model_config = _FROZEN
    target: CancelTarget
    outcome: CancelOutcome


class AnchorNotFound(BaseModel):
    model_config = _FROZEN
    anchor: CancelTarget


class SuffixOutcomes(BaseModel):
    model_config = _FROZEN
    anchor: CancelTarget
    outcomes: tuple[CancelOutcome, ...]


SuffixCancelResult: TypeAlias = AnchorNotFound | SuffixOutcomes


# --------------------------------------------------------------------------
# Argument checks shared by the session repositories (bad input → InvalidInput,
# raised before anything is written)


def check_owner(value: object) -> LeaseOwnerIdentity:
    """A :class:`LeaseOwnerIdentity` with non-blank owner and incarnation ids."""
    if not isinstance(value, LeaseOwnerIdentity):
        raise InvalidInput("owner", f"expected a LeaseOwnerIdentity, got {type(value).__name__}")
    check_id(value.owner_id, "owner.owner_id")
    check_id(value.incarnation_id, "owner.incarnation_id")
    return value


def check_fence(value: object, field: str = "fence") -> LeaseFence:
    """A :class:`LeaseFence` (or lease) naming a non-blank session."""
    if not isinstance(value, LeaseFence):
        raise InvalidInput(field, f"expected a LeaseFence, got {type(value).__name__}")
    check_id(value.session_id, f"{field}.session_id")
    return value


def check_completion(
    value: object, cls: type[QueuedWorkCompletion] | type[TurnInputCompletion], ids_field: str
) -> Any:
    """A completion of type ``cls`` with non-blank ids and at least one row id in ``ids_field``."""
    if not isinstance(value, cls):
        raise InvalidInput("completion", f"expected a {cls.__name__}, got {type(value).__name__}")
    check_id(value.session_id, "completion.session_id")
    check_id(value.claim_id, "completion.claim_id")
    check_id(value.lease_token, "completion.lease_token")
    ids = getattr(value, ids_field)
    if not isinstance(ids, tuple | list) or not ids:
        raise InvalidInput(f"completion.{ids_field}", "a completion names at least one row")
    for i, row_id in enumerate(ids):
        check_id(row_id, f"completion.{ids_field}[{i}]")
    return value


# Builders of the records the store makes from values it checked itself (a
# decoded row, a lease it just wrote), each verified against validation once.
_SAMPLE_OWNER = LeaseOwnerIdentity(owner_id="o", incarnation_id="i")
_SAMPLE_PAYLOAD = QueuedWorkPayload(kind="k", body={"b": [1]})
_SAMPLE_ITEM = QueuedWorkItem(item_index=0, item_id="i", payload=_SAMPLE_PAYLOAD)
_SAMPLE_BATCH = QueuedWorkBatch(
    enqueue_seq=1,
    batch_id="b",
    session_id="s",
    source_key=None,
    delivery_policy=DeliveryPolicy.EARLIEST_SAFE_BOUNDARY,
    slot_policy=SlotPolicy.JOIN,
    merge_key=MergeKey(kind="never"),
    available_at_ms=1,
    enqueued_at_ms=1,
    claim_id="c",
    claim_owner=_SAMPLE_OWNER,
    claim_token="t",
    claim_fencing_token=1,
    claim_session_lease_generation=1,
    items=(_SAMPLE_ITEM,),
)
_SAMPLE_INPUT = PendingTurnInput(
    enqueue_seq=1,
    input_id="i",
    session_id="s",
    source_key="k",
    ingress=NextTurnIngress(),
    submitted_ingress=NextTurnIngress(),
    state=TurnInputState.DEFERRED_NEXT_TURN,
    input={"x": [1]},
    enqueued_at_ms=1,
    claim_id=None,
    claim_owner=None,
    claim_token=None,
    claim_fencing_token=0,
    claim_session_lease_generation=0,
)
_CLAIM = {
    "session_id": "s",
    "claim_id": "c",
    "owner": _SAMPLE_OWNER,
    "lease_token": "t",
    "fencing_token": 1,
    "session_lease_generation": 1,
}
checked_owner: Final = checked_builder(LeaseOwnerIdentity, dict(_SAMPLE_OWNER))
checked_lease: Final = checked_builder(
    SessionExecutionLease,
    {
        "session_id": "s",
        "owner": _SAMPLE_OWNER,
        "lease_token": "t",
        "fencing_token": 1,
        "claimed_at_epoch_ms": 1,
        "expires_at_epoch_ms": 2,
    },
)
checked_payload: Final = checked_builder(QueuedWorkPayload, dict(_SAMPLE_PAYLOAD))
checked_item: Final = checked_builder(QueuedWorkItem, dict(_SAMPLE_ITEM))
checked_batch: Final = checked_builder(QueuedWorkBatch, dict(_SAMPLE_BATCH))
checked_input: Final = checked_builder(PendingTurnInput, dict(_SAMPLE_INPUT))
checked_queue_claim: Final = checked_builder(
    QueuedWorkClaim, {**_CLAIM, "batches": (_SAMPLE_BATCH,)}
)
checked_input_claim: Final = checked_builder(
    TurnInputClaim, {**_CLAIM, "mode": NextTurnMode(), "inputs": (_SAMPLE_INPUT,)}
)
