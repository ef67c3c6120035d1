"""The runtime store's typed errors (defined in :mod:`agentkeep.errors`).

Re-exported here for the runtime store's modules and its users; the classes
live, with every other public error, in :mod:`agentkeep.errors`. When each is
raised: docs/runtime.md#errors.
"""

from __future__ import annotations

from agentkeep.errors import (
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

__all__ = [
    "DecryptionFailed",
    "GuardRejected",
    "InvalidInputStateBatchCas",
    "OpsLifecycleEpochRetired",
    "ReadFailed",
    "RuntimeInternalError",
    "RuntimeNotFound",
    "RuntimeStoreError",
    "SessionKeyMismatch",
    "SessionSnapshotSuperseded",
    "TranscriptRevisionConflict",
    "UnregisterFinalizationOutcomeUnknown",
    "WriteFailed",
]
