"""Runtime records of the reference domain: input states, lifecycle, ops, finalization.

Input states (and the batch compare-and-swap's size limit; the batch's
preparation lives with its fence in :mod:`agentkeep.runtime.input_cas`),
machine lifecycle records, ops snapshots, the unregister-finalization value
and its capability token (docs/runtime.md#records). These are values and
codecs only: no database access, no fence.

Choices where the original store was open
(docs/decisions.md#closed-record-versions):

* Records decode strictly (see :mod:`agentkeep.runtime.session_model`): input
  states carry ``stored_input_state_version`` 1; lifecycle records
  ``record_version`` 3 (no v1/v2 decoders are shipped: those rows belong to the
  legacy migrator); ops snapshots ``ops_snapshot_version`` 1. Input ids must be
  canonical lower-case hyphenated UUIDs.
* Lifecycle records know the states ``idle``, ``stopped`` and ``retired``, the
  supervisor authority ``unbound_no_receipt`` and ``unregister_progress``
  ``null``; anything else is refused until specified.
* Ops snapshots are ``{"ops_snapshot_version": 1, "epoch_id": ..., "payload":
  <JSON value>}`` with a non-empty epoch id.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Final, Literal, TypeAlias

from pydantic import BaseModel, ConfigDict, Field, JsonValue

from agentkeep.bounds import U63
from agentkeep.errors import InvalidInput
from agentkeep.runtime.errors import WriteFailed
from agentkeep.runtime.session_model import (
    ENCODE_TEXT,
    STRICT,
    canonical_bytes,
    canonical_uuid,
)

__all__ = [
    "LIFECYCLE_RECORD_VERSION",
    "MAX_INPUT_STATE_BATCH_CAS",
    "OPS_SNAPSHOT_VERSION",
    "STORED_INPUT_STATE_VERSION",
    "DeleteOpsFinalizationAuthority",
    "InputStatePersistenceRecord",
    "MachineLifecycleCommit",
    "MachineLifecycleStoreRecord",
    "OpsSnapshot",
    "RuntimeBinding",
    "RuntimeState",
    "StoredInputState",
    "SupervisorAuthority",
    "UnregisterFinalizationCommit",
    "encode_input_state",
    "issue_delete_ops_finalization_authority",
]

STORED_INPUT_STATE_VERSION: Final = 1
LIFECYCLE_RECORD_VERSION: Final = 3
OPS_SNAPSHOT_VERSION: Final = 1
#: The most rows one input-state batch compare-and-swap may hold
#: (docs/runtime.md#compare_and_swap_input_states_atomically).
MAX_INPUT_STATE_BATCH_CAS: Final = 256


# --------------------------------------------------------------------------
# Input states (docs/runtime.md#records)


class StoredInputState(BaseModel):
    """The persisted lifecycle state of one input (``runtime_input_states.state_json``).

    Attributes:
        stored_input_state_version: always :data:`STORED_INPUT_STATE_VERSION`.
        input_id: the input (canonical UUID).
        current_state: the lifecycle state (``"accepted"``, ``"consumed"``, ...).
        recovery_count: how many times the input was recovered.
        terminal_outcome: the terminal outcome, once terminal.
        details: further machine data, kept opaque.
    """

    model_config = STRICT

    stored_input_state_version: Literal[1] = STORED_INPUT_STATE_VERSION
    input_id: str
    current_state: str = Field(min_length=1)
    recovery_count: U63 = 0
    terminal_outcome: JsonValue = None
    details: dict[str, JsonValue] = Field(default_factory=dict)

    @classmethod
    def new_accepted(cls, input_id: str | None = None) -> StoredInputState:
        """Return an accepted state with ``recovery_count = 0`` (a fresh UUID4 by default)."""
        iid = str(uuid.uuid4()) if input_id is None else canonical_uuid(input_id, "input_id")
        return cls(input_id=iid, current_state="accepted")

    def with_recovery_count(self, n: int) -> StoredInputState:
        """Return a copy with ``recovery_count = n``."""
        return type(self).model_validate({**self.model_dump(), "recovery_count": n})


class InputStatePersistenceRecord(BaseModel):
    """A machine-authorized input state, the only form the store writes.

    See docs/runtime.md#records.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    state: StoredInputState

    @classmethod
    def from_machine_snapshot(cls, state: StoredInputState) -> InputStatePersistenceRecord:
        """Authorize ``state`` for persistence after checking its input id.

        Raises:
            InvalidInput: the input id is not a canonical UUID.
        """
        canonical_uuid(state.input_id, "input_id")
        return cls(state=state)

    def into_stored(self) -> StoredInputState:
        """Return the wrapped state."""
        return self.state


def encode_input_state(state: StoredInputState) -> bytes:
    """Encode ``state`` canonically.

    Raises:
        WriteFailed: a value is not storable JSON.
    """
    plain = _plain_input_state(state)
    if plain is not None:
        return plain
    try:
        return canonical_bytes(state.model_dump(mode="json"))
    except ValueError as exc:
        raise WriteFailed(f"failed to encode input state {state.input_id}: {exc}") from exc


def _plain_input_state(state: StoredInputState) -> bytes | None:
    """The canonical bytes of a common state, written directly; None for any other state.

    Common: exactly a :class:`StoredInputState`, ASCII text, no ``details``,
    no outcome or a text one. Its canonical JSON (keys sorted, compact) is
    fixed but for the strings and the count, so it is written without the
    ``model_dump`` and the JSON walk; the bytes equal the general encoding
    (``tests/runtime/test_plain_encoders.py``). Any other state takes the
    general path, which also names what does not encode.
    """
    if type(state) is not StoredInputState:
        return None
    current, input_id, count = state.current_state, state.input_id, state.recovery_count
    outcome, details = state.terminal_outcome, state.details
    if (
        type(current) is not str
        or type(input_id) is not str
        or type(count) is not int
        or type(details) is not dict
        or details
        or state.stored_input_state_version != 1
        or not current.isascii()
        or not input_id.isascii()
    ):
        return None
    if outcome is None:
        written = "null"
    elif type(outcome) is str and outcome.isascii():
        written = ENCODE_TEXT(outcome)
    else:
        return None
    return (
        f'{{"current_state":{ENCODE_TEXT(current)},"details":{{}},'
        f'"input_id":{ENCODE_TEXT(input_id)},"recovery_count":{count},'
        f'"stored_input_state_version":1,"terminal_outcome":{written}}}'
    ).encode("ascii")


# --------------------------------------------------------------------------
# Machine lifecycle, ops snapshot, unregister finalization (docs/runtime.md#records)

RuntimeState: TypeAlias = Literal["idle", "stopped", "retired"]


class RuntimeBinding(BaseModel):
    """Binding facts of a runtime; every key is required, each may be null."""

    model_config = STRICT

    agent_runtime_id: str | None
    fence_token: U63 | None
    runtime_generation: U63 | None
    runtime_epoch_id: str | None

    @classmethod
    def unbound(cls) -> RuntimeBinding:
        """Return the default binding: every fact null."""
        return cls(
            agent_runtime_id=None, fence_token=None, runtime_generation=None, runtime_epoch_id=None
        )


class SupervisorAuthority(BaseModel):
    """Tagged supervisor authority; only ``unbound_no_receipt`` is specified."""

    model_config = STRICT

    kind: Literal["unbound_no_receipt"] = "unbound_no_receipt"


class MachineLifecycleCommit(BaseModel):
    """A lifecycle commit (= snapshot): runtime state, binding facts, supervisor authority."""

    model_config = STRICT

    runtime_state: RuntimeState
    binding: RuntimeBinding = Field(default_factory=RuntimeBinding.unbound)
    supervisor_authority: SupervisorAuthority = Field(default_factory=SupervisorAuthority)


class MachineLifecycleStoreRecord(BaseModel):
    """The versioned ``runtime_states`` record (v3)."""

    model_config = STRICT

    record_version: Literal[3]
    runtime_state: RuntimeState
    binding: RuntimeBinding
    supervisor_authority: SupervisorAuthority
    unregister_progress: None

    @classmethod
    def from_snapshot(cls, snapshot: MachineLifecycleCommit) -> MachineLifecycleStoreRecord:
        """Return the current-version record of ``snapshot``."""
        return cls(
            record_version=LIFECYCLE_RECORD_VERSION,
            runtime_state=snapshot.runtime_state,
            binding=snapshot.binding,
            supervisor_authority=snapshot.supervisor_authority,
            unregister_progress=None,
        )

    def to_snapshot(self) -> MachineLifecycleCommit:
        """Return the lifecycle snapshot the record holds."""
        return MachineLifecycleCommit(
            runtime_state=self.runtime_state,
            binding=self.binding,
            supervisor_authority=self.supervisor_authority,
        )


class OpsSnapshot(BaseModel):
    """A persisted async-operations lifecycle snapshot, owned by one epoch."""

    model_config = STRICT

    ops_snapshot_version: Literal[1] = OPS_SNAPSHOT_VERSION
    epoch_id: str = Field(min_length=1)
    payload: JsonValue = None


class DeleteOpsFinalizationAuthority:
    """Capability token of an unregister finalization; the store never inspects it.

    Only :func:`issue_delete_ops_finalization_authority` (for the lifecycle
    machine) constructs it.
    """

    __slots__ = ()

    def __init__(self, _key: object) -> None:
        if _key is not _AUTHORITY_KEY:
            raise TypeError("DeleteOpsFinalizationAuthority is issued by the lifecycle machine")

    def __repr__(self) -> str:
        return "DeleteOpsFinalizationAuthority()"


_AUTHORITY_KEY: Final = object()


def issue_delete_ops_finalization_authority() -> DeleteOpsFinalizationAuthority:
    """Issue the capability token (reserved to the lifecycle machine)."""
    return DeleteOpsFinalizationAuthority(_AUTHORITY_KEY)


@dataclass(frozen=True, slots=True)
class UnregisterFinalizationCommit:
    """What ``commit_unregister_finalization`` writes atomically.

    See docs/runtime.md#records and docs/runtime.md#commit_unregister_finalization.

    Attributes:
        lifecycle: the final lifecycle snapshot.
        input_states: the final input states (distinct input ids).
        retired_ops_epoch: the ops epoch to retire (its row is deleted if current).
        authority: the capability token.
    """

    lifecycle: MachineLifecycleCommit
    input_states: tuple[InputStatePersistenceRecord, ...]
    retired_ops_epoch: str
    authority: DeleteOpsFinalizationAuthority

    def __post_init__(self) -> None:
        if not isinstance(self.authority, DeleteOpsFinalizationAuthority):
            raise InvalidInput("authority", "a DeleteOpsFinalizationAuthority is required")
        if not self.retired_ops_epoch:
            raise InvalidInput("retired_ops_epoch", "must not be empty")
        ids = [r.state.input_id for r in self.input_states]
        if len(set(ids)) != len(ids):
            raise InvalidInput("input_states", "an input id repeats")
