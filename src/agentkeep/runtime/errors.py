"""Typed errors of the runtime store (spec runtime §0.2).

This module owns :class:`RuntimeStoreError` and its variants. Each class keeps
the rendered text of its upstream variant (``Store write failed: {msg}``, ...)
so that ``str(error)`` contains the inner message verbatim, and carries the
ids the spec names as attributes.

:class:`GuardRejected` is the one error the domain layer adds: a save-guard
rejection (§3.1–§3.3). It is a :class:`WriteFailed`, because the store reports
every guard rejection as one; the store catches it specifically where a
rejection is a verdict rather than a failure (the supersession check of the
boundary writers, §2.10 step 6).
"""

from __future__ import annotations

from agentkeep.errors import AgentkeepError, InvalidInput
from agentkeep.errors import NotFound as _GenericNotFound

__all__ = [
    "GuardRejected",
    "Internal",
    "InvalidInputStateBatchCas",
    "NotFound",
    "OpsLifecycleEpochRetired",
    "ReadFailed",
    "RuntimeStoreError",
    "SessionKeyMismatch",
    "SessionSnapshotSuperseded",
    "TranscriptRevisionConflict",
    "UnregisterFinalizationOutcomeUnknown",
    "WriteFailed",
]


class RuntimeStoreError(AgentkeepError):
    """Base class of every error raised by the runtime store and its domain layer."""


class WriteFailed(RuntimeStoreError):
    """``Store write failed: {message}``; nothing of the operation was written.

    Raised for open/DDL/BEGIN/COMMIT/DML failures (constraint violations,
    trigger aborts), encode failures, a caller-supplied session that does not
    decode, save-guard rejections, compaction-outbox conflicts and the
    synthetic faults of unregister finalization.

    Attributes:
        message: the inner message.
    """

    def __init__(self, message: str) -> None:
        self.message = message
        super().__init__(f"Store write failed: {message}")


class ReadFailed(RuntimeStoreError):
    """``Store read failed: {message}``.

    Raised for SELECT failures and for persisted rows that do not decode
    (fail-closed: a legacy, unversioned or corrupt row is never read as
    absent), and by the legacy migrator when it refuses to run.

    Attributes:
        message: the inner message.
    """

    def __init__(self, message: str) -> None:
        self.message = message
        super().__init__(f"Store read failed: {message}")


class NotFound(_GenericNotFound, RuntimeStoreError):
    """``Not found: {kind} {key}``.

    Raised by ``mark_compaction_projection_finalized`` when the outbox has no
    row at the projection's key (``kind`` is ``"compaction outbox rewrite"``,
    ``key`` the rewrite's revision).

    Attributes:
        kind: what was looked for.
        key: the id that was not found.
    """

    def __init__(self, kind: str, key: str) -> None:
        self.kind = kind
        self.key = key
        AgentkeepError.__init__(self, f"Not found: {kind} {key}")


class SessionKeyMismatch(RuntimeStoreError):
    """The snapshot's session id is not the session store key the caller supplied.

    Raised by ``atomic_apply*`` before any database access.

    Attributes:
        expected: the supplied session store key.
        actual: the session id carried by the snapshot.
    """

    def __init__(self, expected: str, actual: str) -> None:
        self.expected = expected
        self.actual = actual
        super().__init__(f"Session store key mismatch: expected {expected}, actual {actual}")


class SessionSnapshotSuperseded(RuntimeStoreError):
    """The durable head is a valid successor of the incoming snapshot.

    Raised by ``atomic_apply*`` when the forward save guard rejects the
    incoming snapshot and the reverse guard accepts the stored one; the
    receipt, outbox intents and input states of the boundary are not written.

    Attributes:
        runtime_id: the runtime.
    """

    def __init__(self, runtime_id: str) -> None:
        self.runtime_id = runtime_id
        super().__init__(
            f"Session snapshot for runtime '{runtime_id}' was superseded by the durable head"
        )


class TranscriptRevisionConflict(RuntimeStoreError):
    """A transcript rewrite names a parent revision that is not the persisted one.

    Raised by the transcript-rewrite guard (§3.3 step 4) and so by
    ``commit_session_transcript_rewrite_snapshot``.

    Attributes:
        expected: the rewrite commit's parent revision.
        actual: the persisted session's revision.
    """

    def __init__(self, expected: str, actual: str) -> None:
        self.expected = expected
        self.actual = actual
        super().__init__(f"Transcript revision conflict: expected {expected}, actual {actual}")


class OpsLifecycleEpochRetired(RuntimeStoreError):
    """An ops-lifecycle snapshot belongs to an epoch retired by unregister finalization.

    Raised by ``persist_ops_lifecycle`` and ``initialize_ops_lifecycle_if_absent``.

    Attributes:
        runtime_id: the runtime.
        epoch_id: the retired epoch.
    """

    def __init__(self, runtime_id: str, epoch_id: str) -> None:
        self.runtime_id = runtime_id
        self.epoch_id = epoch_id
        super().__init__(f"Ops lifecycle epoch {epoch_id} for runtime {runtime_id} is retired")


class UnregisterFinalizationOutcomeUnknown(RuntimeStoreError):
    """The COMMIT of an unregister finalization was not acknowledged and the re-read is ambiguous.

    Callers must retry the (idempotent) finalization and must never publish a
    compensating lifecycle rollback on this error.

    Attributes:
        message: the inner message.
    """

    def __init__(self, message: str) -> None:
        self.message = message
        super().__init__(f"Unregister finalization outcome is unknown: {message}")


class Internal(RuntimeStoreError):
    """``Internal error: {message}``: a worker join failure or a migrator recovery failure.

    Attributes:
        message: the inner message.
    """

    def __init__(self, message: str) -> None:
        self.message = message
        super().__init__(f"Internal error: {message}")


class InvalidInputStateBatchCas(InvalidInput, RuntimeStoreError):
    """The input-state batch compare-and-swap has an invalid shape (§3.6).

    Raised before any database access when the expected and replacement
    lists differ in length, exceed ``MAX_INPUT_STATE_BATCH_CAS`` rows, repeat
    an input id, or name different input ids.

    Attributes:
        reason: what was wrong with the batch.
    """

    def __init__(self, reason: str) -> None:
        self.reason = reason
        self.field = "input_state_batch"
        AgentkeepError.__init__(self, f"Invalid input-state batch compare-and-swap: {reason}")


class GuardRejected(WriteFailed):
    """A save guard refused a session snapshot (§3.1–§3.3).

    Attributes:
        rule: ``"monotonicity"`` (the incoming transcript is shorter than the
            stored one), ``"continuity"`` (it does not continue the stored
            one), ``"coherence"`` (its history does not match its live
            transcript) or ``"rewrite"`` (a transcript rewrite is invalid).
        detail: what failed.
    """

    def __init__(self, rule: str, detail: str) -> None:
        self.rule = rule
        self.detail = detail
        super().__init__(f"transcript {rule} violation: {detail}")
