"""Domain rules of the runtime store, behind the :class:`RuntimeDomain` protocol.

The store depends only on :class:`RuntimeDomain`; :class:`ReferenceDomain` is
the shipped implementation. Payloads are ``bytes`` of canonical JSON
(:func:`agentkeep.strict_json.canonical_json`, UTF-8), so encoding a decoded
canonical payload gives back the same bytes. The protocol and the reference
rules are described in docs/runtime.md#the-runtime-domain. The rules live in
three modules, and every public name of theirs listed in ``__all__`` below is
re-exported here:

* :mod:`agentkeep.runtime.session_model`: the reference session JSON model
  with its transcript revisions (docs/runtime.md#reference-session-format),
  commit fingerprints and compaction intents
  (docs/runtime.md#compaction-intents), the session codec, identifier helpers
  (docs/runtime.md#common-rules).
* :mod:`agentkeep.runtime.guards`: the boundary save guard (rules R1–R4), head
  coherence and the transcript-rewrite guard (docs/runtime.md#save-guards),
  the placeholder check (docs/runtime.md#placeholder-sessions) and intent
  validation (docs/runtime.md#compaction-intents).
* :mod:`agentkeep.runtime.records`: input states, machine lifecycle records,
  ops snapshots, the unregister-finalization value and its authority token
  (docs/runtime.md#records). The input-state batch compare-and-swap is not a
  domain rule: it lives whole in :mod:`agentkeep.runtime.input_cas`.

Errors. Decoding a caller-supplied value raises
:class:`~agentkeep.runtime.errors.WriteFailed`; decoding a persisted value
raises :class:`~agentkeep.runtime.errors.ReadFailed`; guard rejections raise
:class:`~agentkeep.runtime.errors.GuardRejected` (a ``WriteFailed``) or
:class:`~agentkeep.runtime.errors.TranscriptRevisionConflict`.

Choices where the original store was open (each detailed in the module it
concerns; docs/decisions.md#runtime-store):

* Decoding is strict everywhere (duplicate keys, unknown fields, wrong JSON
  types, unknown versions refused; nothing defaulted or upgraded), except that
  a malformed ``transcript_history`` is kept verbatim on the session instead
  of failing its decode (session_model;
  docs/decisions.md#strict-decoding-and-malformed-histories).
* A malformed history counts as absent for the placeholder check and is
  refused by every guard (guards).
* The boundary guard generalises R3 to rewrite chains with appends, and names
  "monotonicity" for a shorter incoming transcript, else "continuity"
  (guards; docs/decisions.md#boundary-guard-rules).
* Lifecycle records and ops snapshots have exactly one current version and
  closed value sets (records; docs/decisions.md#closed-record-versions).
"""

from __future__ import annotations

from typing import Protocol, TypeVar

from agentkeep.errors import InvalidInput
from agentkeep.runtime import guards
from agentkeep.runtime.errors import ReadFailed, WriteFailed
from agentkeep.runtime.records import (
    LIFECYCLE_RECORD_VERSION,
    MAX_INPUT_STATE_BATCH_CAS,
    OPS_SNAPSHOT_VERSION,
    STORED_INPUT_STATE_VERSION,
    DeleteOpsFinalizationAuthority,
    InputStatePersistenceRecord,
    MachineLifecycleCommit,
    MachineLifecycleStoreRecord,
    OpsSnapshot,
    RuntimeBinding,
    RuntimeState,
    StoredInputState,
    SupervisorAuthority,
    UnregisterFinalizationCommit,
    encode_input_state,
    issue_delete_ops_finalization_authority,
)
from agentkeep.runtime.session_model import (
    MAX_U63,
    SESSION_VERSION,
    CompactionIntent,
    DecodeProblem,
    MalformedHistory,
    Message,
    ProjectionId,
    RevisionBody,
    RewriteSelection,
    Session,
    TranscriptCommit,
    TranscriptHistory,
    canonical_bytes,
    canonical_uuid,
    check_version,
    commit_fingerprint,
    decode_session,
    load_object,
    logical_runtime_id_for_session,
    revision_of,
    validate_strict,
)

__all__ = [
    "LIFECYCLE_RECORD_VERSION",
    "MAX_INPUT_STATE_BATCH_CAS",
    "MAX_U63",
    "OPS_SNAPSHOT_VERSION",
    "SESSION_VERSION",
    "STORED_INPUT_STATE_VERSION",
    "CompactionIntent",
    "DeleteOpsFinalizationAuthority",
    "InputStatePersistenceRecord",
    "MachineLifecycleCommit",
    "MachineLifecycleStoreRecord",
    "MalformedHistory",
    "Message",
    "OpsSnapshot",
    "ProjectionId",
    "ReferenceDomain",
    "RevisionBody",
    "RewriteSelection",
    "RuntimeBinding",
    "RuntimeDomain",
    "RuntimeState",
    "Session",
    "StoredInputState",
    "SupervisorAuthority",
    "TranscriptCommit",
    "TranscriptHistory",
    "UnregisterFinalizationCommit",
    "canonical_uuid",
    "commit_fingerprint",
    "issue_delete_ops_finalization_authority",
    "logical_runtime_id_for_session",
    "revision_of",
]


SessionT = TypeVar("SessionT")


class RuntimeDomain(Protocol[SessionT]):
    """The domain operations the runtime store calls (docs/runtime.md#the-runtime-domain).

    The store passes bytes in and gets typed values, verdicts or bytes back;
    its transactions and fences depend on nothing else.
    """

    def decode_incoming_session(self, data: bytes) -> SessionT:
        """Decode a caller-supplied snapshot. Raises WriteFailed."""
        ...

    def decode_persisted_session(self, data: bytes) -> SessionT:
        """Decode a stored snapshot, fail-closed. Raises ReadFailed."""
        ...

    def encode_session(self, session: SessionT) -> bytes:
        """Encode canonically. Raises WriteFailed."""
        ...

    def session_id(self, session: SessionT) -> str:
        """Return the session's id."""
        ...

    def boundary_save_guard(self, incoming: SessionT, previous: SessionT | None) -> None:
        """Accept ``incoming`` as the successor of ``previous`` or raise GuardRejected."""
        ...

    def head_coherence_guard(self, incoming: SessionT) -> None:
        """Check the live transcript matches the history head or raise GuardRejected."""
        ...

    def rewrite_save_guard(
        self, incoming: SessionT, previous: SessionT | None, commit: TranscriptCommit
    ) -> None:
        """Raise TranscriptRevisionConflict or GuardRejected unless the rewrite is valid."""
        ...

    def is_placeholder(self, session: SessionT) -> bool:
        """True for a session without history and at most one System message.

        A malformed (undecodable) history counts as absent
        (docs/runtime.md#placeholder-sessions).
        """
        ...

    def validated_compaction_intents(self, session: SessionT) -> tuple[CompactionIntent, ...]:
        """Return the session's intents after validation. Raises WriteFailed."""
        ...

    def complete_compaction_intent(self, session: SessionT, projection: ProjectionId) -> SessionT:
        """Remove the intent of ``projection`` (no-op if absent)."""
        ...

    def encode_compaction_intent(self, intent: CompactionIntent) -> bytes:
        """Encode an intent canonically for the outbox."""
        ...

    def decode_compaction_intent(self, data: bytes) -> CompactionIntent:
        """Decode a stored outbox intent. Raises ReadFailed."""
        ...

    def encode_input_state(self, state: StoredInputState) -> bytes:
        """Encode canonically. Raises WriteFailed."""
        ...

    def decode_input_state(self, data: bytes) -> StoredInputState:
        """Decode a stored input state. Raises ReadFailed."""
        ...

    def encode_lifecycle(self, snapshot: MachineLifecycleCommit) -> bytes:
        """Encode the current lifecycle record of ``snapshot``."""
        ...

    def decode_lifecycle(self, data: bytes) -> MachineLifecycleCommit:
        """Decode a stored lifecycle record strictly. Raises ReadFailed."""
        ...

    def encode_ops(self, snapshot: OpsSnapshot) -> bytes:
        """Encode an ops snapshot canonically. Raises WriteFailed."""
        ...

    def decode_ops(self, data: bytes) -> OpsSnapshot:
        """Decode a stored ops snapshot strictly. Raises ReadFailed."""
        ...

    def ops_epoch_of(self, data: bytes) -> str:
        """Return the epoch id of stored ops bytes. Raises ReadFailed."""
        ...


class ReferenceDomain:
    """The shipped :class:`RuntimeDomain` for :class:`Session`.

    Its rules are those of docs/runtime.md#the-runtime-domain.
    """

    # -- session codec -----------------------------------------------------

    def decode_incoming_session(self, data: bytes) -> Session:
        """Decode a caller-supplied snapshot (a malformed history is kept, not refused).

        Raises:
            WriteFailed: the bytes are not a current reference session.
        """
        try:
            return decode_session(data)
        except DecodeProblem as exc:
            raise WriteFailed(f"failed to decode incoming session snapshot: {exc}") from exc

    def decode_persisted_session(self, data: bytes) -> Session:
        """Decode a stored snapshot; never defaults or upgrades.

        Raises:
            ReadFailed: the row is not a current reference session.
        """
        try:
            return decode_session(data)
        except DecodeProblem as exc:
            raise ReadFailed(f"failed to decode persisted session snapshot: {exc}") from exc

    def encode_session(self, session: Session) -> bytes:
        """Encode canonically (a malformed history verbatim).

        Raises:
            WriteFailed: opaque metadata is not a JSON value.
        """
        try:
            return canonical_bytes(session.to_json())
        except ValueError as exc:
            raise WriteFailed(f"failed to encode session {session.id}: {exc}") from exc

    def session_id(self, session: Session) -> str:
        """Return the session's id."""
        return session.id

    # -- guards (see agentkeep.runtime.guards) -------------------------------

    def boundary_save_guard(self, incoming: Session, previous: Session | None) -> None:
        """Accept ``incoming`` iff coherent and one of R1–R4 holds (docs/runtime.md#save-guards).

        Raises:
            GuardRejected: with rule ``monotonicity`` if ``incoming`` is
                shorter than ``previous``, else ``continuity``.
        """
        guards.boundary_save_guard(incoming, previous)

    def head_coherence_guard(self, incoming: Session) -> None:
        """Check a well-formed history has ``head == rev(messages)`` (docs/runtime.md#save-guards).

        Raises:
            GuardRejected: rule ``coherence``.
        """
        guards.head_coherence_guard(incoming)

    def rewrite_save_guard(
        self, incoming: Session, previous: Session | None, commit: TranscriptCommit
    ) -> None:
        """Check a transcript rewrite against the persisted session, in order.

        The rewrite guard of docs/runtime.md#save-guards.

        Raises:
            TranscriptRevisionConflict: ``commit``'s parent is not the persisted revision.
            GuardRejected: any other rejection (rule ``rewrite``).
        """
        guards.rewrite_save_guard(incoming, previous, commit)

    def is_placeholder(self, session: Session) -> bool:
        """True iff no (well-formed) history and at most one System message."""
        return guards.is_placeholder(session)

    # -- compaction intents ------------------------------------------------

    def validated_compaction_intents(self, session: Session) -> tuple[CompactionIntent, ...]:
        """Validate the session's intents and return them in order.

        The checks of docs/runtime.md#compaction-intents.

        Raises:
            WriteFailed: an intent is foreign, unbacked, has wrong counts, or a key repeats.
        """
        return guards.validated_compaction_intents(session)

    def complete_compaction_intent(self, session: Session, projection: ProjectionId) -> Session:
        """Remove the intent of ``projection``; a no-op if absent.

        See docs/runtime.md#compaction-intents.
        """
        kept = tuple(i for i in session.compaction_intents if i.projection != projection)
        if len(kept) == len(session.compaction_intents):
            return session
        return session.with_compaction_intents(kept)

    def encode_compaction_intent(self, intent: CompactionIntent) -> bytes:
        """Encode an intent canonically."""
        return canonical_bytes(intent.model_dump(mode="json"))

    def decode_compaction_intent(self, data: bytes) -> CompactionIntent:
        """Decode a stored intent strictly.

        Raises:
            ReadFailed: the bytes are not an intent.
        """
        try:
            load_object(data, "compaction intent")
            return validate_strict(CompactionIntent, data, "compaction intent")
        except DecodeProblem as exc:
            raise ReadFailed(f"failed to decode compaction outbox intent: {exc}") from exc

    # -- input states ------------------------------------------------------

    def encode_input_state(self, state: StoredInputState) -> bytes:
        """Encode canonically.

        Raises:
            WriteFailed: a value is not storable JSON.
        """
        return encode_input_state(state)

    def decode_input_state(self, data: bytes) -> StoredInputState:
        """Decode a stored input state; the message names a missing version field.

        Raises:
            ReadFailed: the row is not a current input state.
        """
        try:
            obj = load_object(data, "input state")
            check_version(
                obj, "stored_input_state_version", STORED_INPUT_STATE_VERSION, "input state"
            )
            state = validate_strict(StoredInputState, data, "input state")
            canonical_uuid(state.input_id, "input_id")
            return state
        except (DecodeProblem, InvalidInput) as exc:
            raise ReadFailed(f"failed to decode persisted input state: {exc}") from exc

    # -- lifecycle and ops -------------------------------------------------

    def encode_lifecycle(self, snapshot: MachineLifecycleCommit) -> bytes:
        """Encode the v3 record of ``snapshot``."""
        record = MachineLifecycleStoreRecord.from_snapshot(snapshot)
        return canonical_bytes(record.model_dump(mode="json"))

    def decode_lifecycle(self, data: bytes) -> MachineLifecycleCommit:
        """Decode a v3 record strictly (legacy bare strings and unversioned objects refused).

        Raises:
            ReadFailed: the row is not a current lifecycle record.
        """
        try:
            obj = load_object(data, "machine lifecycle record")
            check_version(
                obj, "record_version", LIFECYCLE_RECORD_VERSION, "machine lifecycle record"
            )
            record = validate_strict(MachineLifecycleStoreRecord, data, "machine lifecycle record")
        except DecodeProblem as exc:
            raise ReadFailed(f"failed to decode machine lifecycle record: {exc}") from exc
        return record.to_snapshot()

    def encode_ops(self, snapshot: OpsSnapshot) -> bytes:
        """Encode canonically.

        Raises:
            WriteFailed: the payload is not storable JSON.
        """
        try:
            return canonical_bytes(snapshot.model_dump(mode="json"))
        except ValueError as exc:
            raise WriteFailed(f"failed to encode ops snapshot {snapshot.epoch_id}: {exc}") from exc

    def decode_ops(self, data: bytes) -> OpsSnapshot:
        """Decode strictly.

        Raises:
            ReadFailed: the row is not a current ops snapshot.
        """
        try:
            obj = load_object(data, "ops snapshot")
            check_version(obj, "ops_snapshot_version", OPS_SNAPSHOT_VERSION, "ops snapshot")
            return validate_strict(OpsSnapshot, data, "ops snapshot")
        except DecodeProblem as exc:
            raise ReadFailed(f"failed to decode ops lifecycle snapshot: {exc}") from exc

    def ops_epoch_of(self, data: bytes) -> str:
        """Return the epoch id of stored ops bytes (strict decode).

        Raises:
            ReadFailed: the row is not a current ops snapshot.
        """
        return self.decode_ops(data).epoch_id
