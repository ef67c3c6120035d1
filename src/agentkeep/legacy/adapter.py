"""The domain seam of the v0.6.34 legacy migrator (docs/legacy-migration.md#the-adapter).

:class:`LegacyV0634Adapter` is every decision the migrator takes about the
*content* of a row; the migrator (:mod:`agentkeep.legacy.migrator`) owns the
connection, the order of the checks, the locks and the writes. This module
touches no database and holds no fence; the migrator's locks fence the writes.
:class:`ReferenceLegacyV0634Adapter` is the shipped implementation over a
:class:`~agentkeep.runtime.domain.RuntimeDomain` (the
:class:`~agentkeep.runtime.domain.ReferenceDomain` by default).

Every check either passes or raises :class:`LegacyBlocked` whose ``detail`` is
the exact text listed in docs/legacy-migration.md#companion-checks (where that
list shows "…", the underlying decoder message is inserted).

Reference conversions:

* Lifecycle: only the exact 6 bytes ``"idle"`` (a JSON string with its quotes,
  no whitespace, no newline) is legacy; it becomes the current record of
  ``MachineLifecycleCommit(runtime_state="idle", binding=unbound,
  supervisor_authority=unbound_no_receipt)``.
* Inputs: the strict legacy shape (unknown fields refused, at every level)
  with a terminal (state, outcome) pair — (consumed, consumed), (superseded,
  superseded{superseded_by}), (coalesced, coalesced{aggregate_id}),
  (abandoned, abandoned{reason}); outcomes are tagged by ``outcome_type`` —
  maps to a current :class:`~agentkeep.runtime.domain.StoredInputState`:
  ``current_state`` and ``terminal_outcome`` (normalised JSON) are the legacy
  ones, ``recovery_count`` is kept, and ``details`` holds ``history``,
  ``created_at``, ``updated_at`` (the legacy texts), ``durability``,
  ``idempotency_key``, ``last_run_id``, ``last_boundary_sequence``,
  ``attempt_count``, ``admission_sequence`` (null) and ``recovery_lane``
  (null). ``policy``, ``runtime_semantics``, ``reconstruction_source`` and
  ``persisted_input`` are dropped (absent). The "generated recovery
  authority" is :meth:`ReferenceLegacyV0634Adapter.recover_input_state`: the
  mapped state must be terminal with a matching outcome and pass
  :meth:`~agentkeep.runtime.domain.InputStatePersistenceRecord.from_machine_snapshot`;
  the encoded record must then decode as current.
* Ops: the strict legacy ops shape must be "zero" (no operation, operation
  spec, completion, wait, active count or cursor) and use the default capacity
  (``max_completed`` = :data:`DEFAULT_MAX_COMPLETED`, ``max_concurrent`` null).
* Receipts only need to decode (a private strict model of the original
  store's ``RunBoundaryReceipt``: ``boundary`` is ``run_start``/``run_checkpoint``/
  ``immediate`` or the variant names ``RunStart``/``RunCheckpoint``/
  ``Immediate``), fit i64 and match their row.
"""

from __future__ import annotations

from typing import Any, Final, Protocol

from agentkeep.bounds import I64_MAX
from agentkeep.legacy.shapes import (
    DecodeProblem,
    LegacyInput,
    LegacyOps,
    LegacyReceipt,
    decode_strict,
    variant_name,
)
from agentkeep.runtime.domain import (
    InputStatePersistenceRecord,
    MachineLifecycleCommit,
    ReferenceDomain,
    RuntimeBinding,
    RuntimeDomain,
    StoredInputState,
    SupervisorAuthority,
    logical_runtime_id_for_session,
)
from agentkeep.runtime.errors import RuntimeStoreError

__all__ = [
    "DEFAULT_MAX_COMPLETED",
    "LEGACY_IDLE_RECORD",
    "MAX_I64",
    "LegacyBlocked",
    "LegacyV0634Adapter",
    "ReferenceLegacyV0634Adapter",
]

#: The only legacy lifecycle record the migrator converts: the JSON string ``"idle"``.
LEGACY_IDLE_RECORD: Final = b'"idle"'
#: ``meerkat_core::ops_lifecycle::DEFAULT_MAX_COMPLETED``: the default ops capacity.
DEFAULT_MAX_COMPLETED: Final = 256
#: ``2**63-1`` (:data:`agentkeep.bounds.I64_MAX`): a receipt sequence must fit i64.
MAX_I64: Final = I64_MAX

#: Terminal input states; each pairs with the terminal outcome of the same ``outcome_type``.
_TERMINAL_STATES: Final = frozenset({"consumed", "superseded", "coalesced", "abandoned"})


class LegacyBlocked(Exception):
    """A row cannot be migrated safely; the runtime is reported Blocked.

    Attributes:
        detail: the exact detail text of the report item
            (docs/legacy-migration.md#companion-checks).
    """

    def __init__(self, detail: str) -> None:
        self.detail = detail
        super().__init__(detail)


class LegacyV0634Adapter(Protocol):
    """Content decisions of the v0.6.34 migrator (docs/legacy-migration.md#the-adapter).

    The ``check_*``, ``convert_input`` and ``validate_zero_ops`` methods raise
    :class:`LegacyBlocked` with the report's detail text; ``is_current_*``
    answer without raising.
    """

    def is_current_lifecycle(self, data: bytes) -> bool:
        """True if ``data`` decodes as a current lifecycle record (the runtime is Current)."""
        ...

    def check_legacy_lifecycle(self, data: bytes) -> None:
        """Pass only for the exact legacy completed-idle lifecycle bytes."""
        ...

    def migrated_lifecycle(self, runtime_id: str) -> bytes:
        """Return the current record of a completed, idle lifecycle for ``runtime_id``.

        A failure here is an internal error of the call, not a Blocked runtime.
        """
        ...

    def check_session_snapshot(self, runtime_id: str, data: bytes) -> None:
        """Pass if the runtime's snapshot decodes and belongs to ``runtime_id``."""
        ...

    def check_receipt(self, run_id: str, sequence: int, data: bytes) -> None:
        """Pass if a receipt decodes, its sequence fits i64 and its identity matches the row."""
        ...

    def is_current_input(self, data: bytes) -> bool:
        """True if ``data`` decodes as a current input state (a mixed-format companion)."""
        ...

    def convert_input(self, row_key: str, data: bytes) -> bytes:
        """Return the current-format record of a legacy terminal input row keyed ``row_key``."""
        ...

    def is_current_ops(self, data: bytes) -> bool:
        """True if ``data`` decodes as a current ops snapshot (mixed-format ops authority)."""
        ...

    def validate_zero_ops(self, data: bytes) -> None:
        """Pass if ``data`` is a legacy ops snapshot holding no authority, at default capacity."""
        ...


def _input_detail(row_key: str, text: str) -> str:
    return f"input {row_key}: {text}"


def _inner(exc: BaseException) -> str:
    """The inner message of a store error (without ``Store read failed: ``), else ``str(exc)``."""
    message = getattr(exc, "message", None)
    return message if isinstance(message, str) else str(exc)


# --------------------------------------------------------------------------
# Reference adapter


class ReferenceLegacyV0634Adapter:
    """The shipped :class:`LegacyV0634Adapter` (conversions in the module docstring).

    Args:
        domain: the codecs of the current records (default :class:`ReferenceDomain`).
    """

    def __init__(self, domain: RuntimeDomain[Any] | None = None) -> None:
        self.domain: RuntimeDomain[Any] = domain if domain is not None else ReferenceDomain()

    # -- lifecycle ---------------------------------------------------------

    def is_current_lifecycle(self, data: bytes) -> bool:
        """True if the domain decodes ``data`` as a current lifecycle record."""
        try:
            self.domain.decode_lifecycle(data)
        except RuntimeStoreError:
            return False
        return True

    def check_legacy_lifecycle(self, data: bytes) -> None:
        """Raise LegacyBlocked unless ``data`` is exactly ``b'"idle"'``."""
        if bytes(data) != LEGACY_IDLE_RECORD:
            raise LegacyBlocked('not the exact v0.6.34 bare "idle" record')

    def migrated_lifecycle(self, runtime_id: str) -> bytes:
        """Return the current record of a completed, idle, unbound lifecycle.

        The record does not depend on ``runtime_id``: a v0.6.34 completed-idle
        runtime has no binding facts and no supervisor receipt.
        """
        snapshot = MachineLifecycleCommit(
            runtime_state="idle",
            binding=RuntimeBinding.unbound(),
            supervisor_authority=SupervisorAuthority(),
        )
        return self.domain.encode_lifecycle(snapshot)

    # -- companions --------------------------------------------------------

    def check_session_snapshot(self, runtime_id: str, data: bytes) -> None:
        """Raise LegacyBlocked if the snapshot does not decode or another runtime owns it."""
        try:
            session = self.domain.decode_persisted_session(data)
        except RuntimeStoreError as exc:
            raise LegacyBlocked(_inner(exc)) from exc
        session_id = self.domain.session_id(session)
        owner = logical_runtime_id_for_session(session_id)
        if owner != runtime_id:
            raise LegacyBlocked(
                f"session {session_id} belongs to runtime {owner}, not {runtime_id}"
            )

    def check_receipt(self, run_id: str, sequence: int, data: bytes) -> None:
        """Raise LegacyBlocked if the receipt does not decode, overflows i64 or mismatches its row.

        The i64 check is a plain conversion of the payload sequence (a u64), not
        the bit reinterpretation of the ordinary store's key column.
        """
        try:
            receipt = decode_strict(LegacyReceipt, data)
        except DecodeProblem as exc:
            raise LegacyBlocked(f"invalid run boundary receipt: {exc}") from exc
        if receipt.sequence > MAX_I64:
            raise LegacyBlocked(f"receipt sequence {receipt.sequence} is out of range")
        if receipt.run_id != run_id or receipt.sequence != sequence:
            raise LegacyBlocked(
                f"receipt payload identity {receipt.run_id}:{receipt.sequence} "
                f"does not match row {run_id}:{sequence}"
            )

    def is_current_input(self, data: bytes) -> bool:
        """True if the domain decodes ``data`` as a current input state."""
        try:
            self.domain.decode_input_state(data)
        except RuntimeStoreError:
            return False
        return True

    def convert_input(self, row_key: str, data: bytes) -> bytes:
        """Map a legacy terminal input to the current record.

        The checks are those of docs/legacy-migration.md#companion-checks for
        an input row that follow the current-format test
        (:meth:`is_current_input`), in that order; the mapping is
        docs/legacy-migration.md#input-mapping.

        Raises:
            LegacyBlocked: the row is not the strict legacy shape, not terminal,
                keyed by another id, refused by the recovery authority, or the
                migrated record does not encode or re-decode.
        """
        try:
            legacy = decode_strict(LegacyInput, data)
        except DecodeProblem as exc:
            raise LegacyBlocked(
                _input_detail(row_key, f"not a v0.6.34 input-state row: {exc}")
            ) from exc
        outcome = legacy.terminal_outcome
        terminal = legacy.current_state in _TERMINAL_STATES
        if not terminal or outcome is None or outcome.outcome_type != legacy.current_state:
            raise LegacyBlocked(
                _input_detail(
                    row_key,
                    "only terminal phase/outcome pairs are safe to migrate "
                    f"(observed {variant_name(legacy.current_state)})",
                )
            )
        if legacy.input_id != row_key:
            raise LegacyBlocked(_input_detail(row_key, "payload id does not match row key"))
        mapped = StoredInputState(
            input_id=legacy.input_id,
            current_state=legacy.current_state,
            recovery_count=legacy.recovery_count,
            terminal_outcome=outcome.model_dump(mode="json"),
            details={
                "history": [
                    e.model_dump(mode="json", by_alias=True, exclude_none=True)
                    for e in legacy.history
                ],
                "created_at": legacy.created_at,
                "updated_at": legacy.updated_at,
                "durability": legacy.durability,
                "idempotency_key": legacy.idempotency_key,
                "last_run_id": legacy.last_run_id,
                "last_boundary_sequence": legacy.last_boundary_sequence,
                "attempt_count": legacy.attempt_count,
                "admission_sequence": None,
                "recovery_lane": None,
            },
        )
        try:
            record = self.recover_input_state(mapped)
        except (ValueError, RuntimeStoreError) as exc:
            raise LegacyBlocked(
                _input_detail(row_key, f"generated recovery rejected it: {_inner(exc)}")
            ) from exc
        try:
            encoded = self.domain.encode_input_state(record.into_stored())
        except (ValueError, RuntimeStoreError) as exc:
            raise LegacyBlocked(_input_detail(row_key, f"encode failed: {_inner(exc)}")) from exc
        try:
            self.domain.decode_input_state(encoded)
        except RuntimeStoreError as exc:
            raise LegacyBlocked(
                _input_detail(row_key, f"migrated record is invalid: {_inner(exc)}")
            ) from exc
        return encoded

    def recover_input_state(self, state: StoredInputState) -> InputStatePersistenceRecord:
        """The input-recovery authority: authorise a mapped terminal state for persistence.

        Raises:
            ValueError: the state is not terminal or its outcome does not match.
            InvalidInput: the input id is not canonical (a ValueError too).
        """
        outcome = state.terminal_outcome
        kind = outcome.get("outcome_type") if isinstance(outcome, dict) else None
        if state.current_state not in _TERMINAL_STATES or kind != state.current_state:
            raise ValueError(
                f"state {state.current_state} with outcome {kind} is not a recoverable terminal"
            )
        return InputStatePersistenceRecord.from_machine_snapshot(state)

    def is_current_ops(self, data: bytes) -> bool:
        """True if the domain decodes ``data`` as a current ops snapshot."""
        try:
            self.domain.decode_ops(data)
        except RuntimeStoreError:
            return False
        return True

    def validate_zero_ops(self, data: bytes) -> None:
        """Raise LegacyBlocked unless ``data`` is a zero legacy ops snapshot at default capacity."""
        try:
            ops = decode_strict(LegacyOps, data)
        except DecodeProblem as exc:
            raise LegacyBlocked(f"not a v0.6.34 ops snapshot: {exc}") from exc
        auth, cursors = ops.authority_state, ops.cursors
        zero = (
            not auth.operations
            and not ops.operation_specs
            and not auth.completed_order
            and not ops.completion_entries
            and auth.active_count == 0
            and auth.wait_request_id is None
            and not auth.wait_operation_ids
            and auth.next_completion_seq == 0
            and cursors.agent_applied_cursor == 0
            and cursors.runtime_observed_seq == 0
            and cursors.runtime_last_injected_seq == 0
        )
        if not zero:
            raise LegacyBlocked("ops snapshot contains live or completed operation authority")
        if auth.max_completed != DEFAULT_MAX_COMPLETED or auth.max_concurrent is not None:
            raise LegacyBlocked("ops snapshot contains nondefault capacity policy")
