"""The runtime store: snapshots, boundary receipts, input-state CAS, outbox, lifecycle, ops epochs.

Described in docs/runtime.md#the-runtime-store. Reach it as
``store.runtime.<op>(...)`` (one call, one unit of work),
``uow.runtime.<op>(...)`` inside ``store.write()``, or
``await astore.runtime.<op>(...)`` (:mod:`agentkeep.aio`).

Where things live: tables in :mod:`.models` (Alembic branch ``runtime``),
domain rules behind :class:`RuntimeDomain` in :mod:`.domain` (the reference
session model, guards and codecs in :mod:`.session_model`, :mod:`.guards`,
:mod:`.records`), one module per concern for the operations (map in
:mod:`.repository`; the input-state batch compare-and-swap whole in
:mod:`.input_cas`), typed errors in :mod:`.errors`. The legacy v0.6.34
migrator lives in :mod:`agentkeep.legacy`; its entry point
``migrate_v0_6_34_completed_idle`` is re-exported here.
"""

from __future__ import annotations

from agentkeep.runtime.domain import (
    MAX_INPUT_STATE_BATCH_CAS,
    CompactionIntent,
    DeleteOpsFinalizationAuthority,
    InputStatePersistenceRecord,
    MachineLifecycleCommit,
    Message,
    OpsSnapshot,
    ProjectionId,
    ReferenceDomain,
    RuntimeBinding,
    RuntimeDomain,
    RuntimeState,
    Session,
    StoredInputState,
    SupervisorAuthority,
    TranscriptCommit,
    UnregisterFinalizationCommit,
    issue_delete_ops_finalization_authority,
    logical_runtime_id_for_session,
)
from agentkeep.runtime.errors import (
    DecryptionFailed,
    GuardRejected,
    InvalidInputStateBatchCas,
    OpsLifecycleEpochRetired,
    ReadFailed,
    RuntimeInternalError,
    RuntimeNotFound,
    RuntimeStoreError,
    SessionKeyMismatch,
    SessionSnapshotSuperseded,
    TranscriptRevisionConflict,
    UnregisterFinalizationOutcomeUnknown,
    WriteFailed,
)
from agentkeep.runtime.finalization import (
    FaultHook,
    FinalizationObservation,
    FinalizationPoint,
    synthetic_fault,
)
from agentkeep.runtime.input_cas import InputStateCasOutcome
from agentkeep.runtime.receipts import (
    RunBoundaryReceipt,
    decode_receipt_sequence,
    encode_receipt_sequence,
)

__all__ = [
    "MAX_INPUT_STATE_BATCH_CAS",
    "CompactionIntent",
    "DeleteOpsFinalizationAuthority",
    "FaultHook",
    "FinalizationObservation",
    "FinalizationPoint",
    "DecryptionFailed",
    "GuardRejected",
    "InputStateCasOutcome",
    "InputStatePersistenceRecord",
    "RuntimeInternalError",
    "InvalidInputStateBatchCas",
    "MachineLifecycleCommit",
    "Message",
    "RuntimeNotFound",
    "OpsLifecycleEpochRetired",
    "OpsSnapshot",
    "ProjectionId",
    "ReadFailed",
    "ReferenceDomain",
    "RunBoundaryReceipt",
    "RuntimeBinding",
    "RuntimeDomain",
    "RuntimeState",
    "RuntimeStoreError",
    "Session",
    "SessionKeyMismatch",
    "SessionSnapshotSuperseded",
    "StoredInputState",
    "SupervisorAuthority",
    "TranscriptCommit",
    "TranscriptRevisionConflict",
    "UnregisterFinalizationCommit",
    "UnregisterFinalizationOutcomeUnknown",
    "WriteFailed",
    "decode_receipt_sequence",
    "encode_receipt_sequence",
    "issue_delete_ops_finalization_authority",
    "logical_runtime_id_for_session",
    "synthetic_fault",
]

# The legacy migrator's entry point, where users of the runtime store look for it
# (imported last: agentkeep.legacy imports this package's modules).
from agentkeep.legacy import migrate_v0_6_34_completed_idle  # noqa: E402

__all__ += ["migrate_v0_6_34_completed_idle"]
