"""Boundary commits (``atomic_apply`` and its terminal form) and boundary receipts.

A run boundary commits, in one transaction under the ``runtime:<id>`` write
lock: the session snapshot (if any), the machine lifecycle (terminal form
only), the compaction outbox rows of the snapshot's intents, the boundary
receipt and the input states. All of it or none of it (I1,
docs/runtime.md#invariants). The operations are described in
docs/runtime.md#boundary-commits.

What lives here: :func:`prepare_boundary` (every check that needs no
database, run before the unit opens in the one-call form), the repository
part :class:`BoundaryOps` (``uow.runtime.boundaries``: the commits and
:meth:`~BoundaryOps.load_boundary_receipt`), the supersession verdict and the
receipt statements. The rows are written through the shared steps of the
modules that own them (snapshot rows, lifecycle, outbox, inputs).

**The receipt is the idempotency fence**, and it lives here: a plain INSERT
on ``(runtime_id, run_id, sequence)`` (no ``ON CONFLICT``), so a second
boundary with the same receipt key fails with ``WriteFailed`` and leaves
nothing of itself. The outbox rows have their own insert-and-compare fence
(:func:`~agentkeep.runtime.outbox.insert_outbox_intents`); the snapshot,
lifecycle and input upserts are unconditional under the lock.

**The supersession verdict** (docs/runtime.md#the-supersession-verdict): when
the boundary save guard rejects the incoming snapshot against the stored head,

a. a stored *placeholder* (no history, at most one System message) is
   replaced anyway;
b. else, if the reverse guard accepts (the stored head is a valid successor
   of the incoming snapshot), the incoming one is stale:
   :class:`~agentkeep.runtime.errors.SessionSnapshotSuperseded`, and nothing
   of the boundary is written — not the receipt, the outbox rows nor the
   inputs (I2), so receipt and input order never split from the session;
c. else the guard's ``WriteFailed`` (also when nothing is stored).

Round trips (Postgres): the writes (snapshot, quarantine marker, lifecycle,
receipt, inputs) are deferred (:meth:`RuntimeAccess.pipelined`) and go out
together, in one round trip, then ``COMMIT``. On psycopg (sync or asyncio)
the stored head is read with ``BEGIN`` and the lock, in their round trip
(:meth:`Driver.prefetching`): three round trips for a boundary without
outbox intents. asyncpg, which does not pipeline, sends the writes as one
statement (:func:`~agentkeep.statements.merged_writes`) after ``BEGIN`` with
the lock and the read: four. SQLite runs the same code one statement at a
time.

Order of checks (so the first failing one decides): decode the snapshot
(``WriteFailed``) → validate its intents (``WriteFailed``) → session-store
key (:class:`~agentkeep.runtime.errors.SessionKeyMismatch`), all before any
database access → lock → finalized-intent replay (``WriteFailed``) →
supersession verdict → writes (outbox conflict, duplicate receipt, trigger
aborts: ``WriteFailed``, everything rolled back).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from sqlalchemy import bindparam as p
from sqlalchemy import insert, select

from agentkeep.arguments import check_methods
from agentkeep.db import LockNamespace
from agentkeep.errors import CommitOutcomeUnknown
from agentkeep.one_call import leaves_unknown, still_unknown
from agentkeep.runtime.access import RuntimeAccess
from agentkeep.runtime.calls import RuntimeCallsBase
from agentkeep.runtime.domain import (
    CompactionIntent,
    InputStatePersistenceRecord,
    MachineLifecycleCommit,
    RuntimeDomain,
    StoredInputState,
)
from agentkeep.runtime.errors import (
    GuardRejected,
    SessionKeyMismatch,
    SessionSnapshotSuperseded,
    WriteFailed,
)
from agentkeep.runtime.inputs import encode_input_states, upsert_input_states
from agentkeep.runtime.lifecycle import upsert_lifecycle
from agentkeep.runtime.models import BoundaryReceiptRow as Receipt
from agentkeep.runtime.outbox import insert_outbox_intents, reject_finalized_replays
from agentkeep.runtime.receipts import (
    RunBoundaryReceipt,
    decode_receipt,
    encode_receipt,
    encode_receipt_sequence,
)
from agentkeep.runtime.snapshot_rows import previous_session, snapshot_read, upsert_snapshot
from agentkeep.statements import Statement

__all__ = ["BoundaryCalls", "BoundaryOps", "PreparedBoundary", "prepare_boundary"]

_T: Final = Receipt.__tablename__
#: The idempotency fence: a plain INSERT, so a second receipt at the key fails.
_INSERT_RECEIPT: Final = Statement(
    insert(Receipt).values(
        runtime_id=p("rt"), run_id=p("run"), sequence=p("seq"), receipt_json=p("data")
    ),
    name="runtime.receipt.insert",
)
_GET_RECEIPT: Final = Statement(
    select(Receipt.receipt_json).where(
        Receipt.runtime_id == p("rt"), Receipt.run_id == p("run"), Receipt.sequence == p("seq")
    ),
    name="runtime.receipt.get",
)


@dataclass(frozen=True, slots=True)
class PreparedBoundary:
    """A boundary commit after every check that needs no database (see :func:`prepare_boundary`).

    Attributes:
        runtime_id: the runtime.
        snapshot: the encoded session as the caller gave it, or None.
        session: the decoded session, or None.
        intents: the session's validated compaction intents.
        receipt: the boundary receipt.
        receipt_json: its encoded bytes.
        input_states: the input states to upsert, encoded, in order.
        lifecycle: the encoded lifecycle record (terminal form), or None.
    """

    runtime_id: str
    snapshot: bytes | None
    session: Any
    intents: tuple[CompactionIntent, ...]
    receipt: RunBoundaryReceipt
    receipt_json: bytes
    input_states: tuple[tuple[str, bytes], ...]
    lifecycle: bytes | None


def prepare_boundary(
    domain: RuntimeDomain[Any],
    runtime_id: str,
    session_snapshot: bytes | None,
    receipt: RunBoundaryReceipt,
    input_updates: Sequence[InputStatePersistenceRecord | StoredInputState],
    session_store_key: str | None,
    machine_lifecycle: MachineLifecycleCommit | None = None,
) -> PreparedBoundary:
    """Run a boundary's checks that need no database, in the documented order.

    The order is that of docs/runtime.md#atomic_apply, step 1.

    Raises:
        WriteFailed: the snapshot does not decode, an intent is invalid, or
            a state does not encode.
        SessionKeyMismatch: a snapshot and a key are given and the
            snapshot's session id is not the key (a key alone is ignored).
        InvalidInput: an input id is not a canonical UUID.
    """
    session = None
    intents: tuple[CompactionIntent, ...] = ()
    if session_snapshot is not None:
        session = domain.decode_incoming_session(session_snapshot)
        intents = tuple(domain.validated_compaction_intents(session))
        if session_store_key is not None:
            actual = domain.session_id(session)
            if actual != session_store_key:
                raise SessionKeyMismatch(session_store_key, actual)
    return PreparedBoundary(
        runtime_id=runtime_id,
        snapshot=None if session_snapshot is None else bytes(session_snapshot),
        session=session,
        intents=intents,
        receipt=receipt,
        receipt_json=encode_receipt(receipt),
        input_states=encode_input_states(domain, input_updates),
        lifecycle=None if machine_lifecycle is None else domain.encode_lifecycle(machine_lifecycle),
    )


def _supersession_verdict(access: RuntimeAccess, runtime_id: str, incoming: Any) -> bool:
    """True to persist ``incoming``; raises when it is superseded or refused.

    See docs/runtime.md#the-supersession-verdict.
    """
    domain = access.domain
    _, previous = previous_session(access, runtime_id)
    try:
        domain.boundary_save_guard(incoming, previous)
        return True
    except GuardRejected as forward:
        if previous is None:
            raise
        if domain.is_placeholder(previous):
            return True  # the generated snapshot replaces the placeholder
        try:
            domain.boundary_save_guard(previous, incoming)
        except GuardRejected:
            raise forward from None  # neither succeeds the other: the forward error
        raise SessionSnapshotSuperseded(runtime_id) from None


@check_methods
class BoundaryOps:
    """Repository part (``uow.runtime.boundaries``): boundary commits and receipt reads."""

    __slots__ = ("_access",)

    def __init__(self, access: RuntimeAccess) -> None:
        self._access = access

    def atomic_apply(
        self,
        runtime_id: str,
        session_snapshot: bytes | None,
        receipt: RunBoundaryReceipt,
        input_updates: Sequence[InputStatePersistenceRecord | StoredInputState] = (),
        session_store_key: str | None = None,
    ) -> None:
        """Commit a run boundary atomically (see the module docstring).

        See docs/runtime.md#atomic_apply.

        Args:
            runtime_id: the runtime.
            session_snapshot: the session at the boundary, encoded, or None
                (then only the receipt and inputs are written; quarantine
                and outbox untouched).
            receipt: the boundary receipt (its key is the idempotency fence).
            input_updates: input states to upsert.
            session_store_key: the session id the snapshot must carry.

        Raises:
            SessionKeyMismatch: the snapshot belongs to another session.
            SessionSnapshotSuperseded: the stored head is a valid successor of
                the snapshot; nothing was written.
            WriteFailed: decode/intent/guard refusal, a finalized-intent
                replay, an outbox conflict, a duplicate receipt, a failed write.
            ReadFailed: the stored head or an outbox intent does not decode.
        """
        self.apply_boundary(
            prepare_boundary(
                self._access.domain,
                runtime_id,
                session_snapshot,
                receipt,
                input_updates,
                session_store_key,
            )
        )

    def atomic_apply_with_machine_lifecycle(
        self,
        runtime_id: str,
        session_snapshot: bytes,
        receipt: RunBoundaryReceipt,
        machine_lifecycle: MachineLifecycleCommit,
        input_updates: Sequence[InputStatePersistenceRecord | StoredInputState],
        session_store_key: str,
    ) -> None:
        """Commit a terminal boundary with the machine lifecycle, atomically.

        See docs/runtime.md#atomic_apply_with_machine_lifecycle.

        As :meth:`atomic_apply`, with the snapshot and key required and the
        lifecycle record written after the snapshot; any failure rolls back
        all five tables.

        Raises:
            SessionKeyMismatch, SessionSnapshotSuperseded, WriteFailed,
            ReadFailed: as :meth:`atomic_apply`.
        """
        self.apply_boundary(
            prepare_boundary(
                self._access.domain,
                runtime_id,
                session_snapshot,
                receipt,
                input_updates,
                session_store_key,
                machine_lifecycle,
            )
        )

    def apply_boundary(self, boundary: PreparedBoundary) -> None:
        """The database half of a boundary commit (after :func:`prepare_boundary`)."""
        access = self._access
        rt = boundary.runtime_id
        # psycopg: the stored head is read with BEGIN and the lock, in their round trip.
        reads = [snapshot_read(rt)] if boundary.session is not None else []
        with access.prefetching(reads):
            access.begin_write(LockNamespace.RUNTIME, rt)
            reject_finalized_replays(access, rt, boundary.intents)
            persist = boundary.session is not None and _supersession_verdict(
                access, rt, boundary.session
            )
        # psycopg: the writes go out together, in one round trip.
        with access.atomic(), access.pipelined():
            if persist:
                assert boundary.snapshot is not None
                upsert_snapshot(access, rt, boundary.snapshot)
            if boundary.lifecycle is not None:
                upsert_lifecycle(access, rt, boundary.lifecycle)
            insert_outbox_intents(access, rt, boundary.intents)
            access.write(
                _INSERT_RECEIPT,
                {
                    "rt": rt,
                    "run": boundary.receipt.run_id,
                    "seq": encode_receipt_sequence(boundary.receipt.sequence),
                    "data": boundary.receipt_json,
                },
                f"{_T}[{boundary.receipt.run_id}:{boundary.receipt.sequence}]",
            )
            upsert_input_states(access, rt, boundary.input_states)

    def load_boundary_receipt(
        self, runtime_id: str, run_id: str, sequence: int
    ) -> RunBoundaryReceipt | None:
        """The receipt at ``(runtime_id, run_id, sequence)``, or None.

        See docs/runtime.md#load_boundary_receipt.

        Raises:
            InvalidInput: ``sequence`` is not a u64.
            ReadFailed: the SELECT failed or the stored receipt does not decode.
        """
        key = f"{run_id}:{sequence}"
        data = self._access.one_bytes(
            _GET_RECEIPT,
            {"rt": runtime_id, "run": run_id, "seq": encode_receipt_sequence(sequence)},
            table=_T,
            key=key,
            column="receipt_json",
        )
        return None if data is None else decode_receipt(data)


class BoundaryCalls(RuntimeCallsBase):
    """One-call forms of the boundary operations (checks before the unit opens)."""

    _repository = "runtime.boundaries"

    def atomic_apply(
        self,
        runtime_id: str,
        session_snapshot: bytes | None,
        receipt: RunBoundaryReceipt,
        input_updates: Sequence[InputStatePersistenceRecord | StoredInputState] = (),
        session_store_key: str | None = None,
    ) -> None:
        """One-call form of :meth:`BoundaryOps.atomic_apply`.

        A lost COMMIT answer is resolved by reading the receipt back (see
        :meth:`_apply_resolved`).
        """
        prepared = prepare_boundary(
            self.domain, runtime_id, session_snapshot, receipt, input_updates, session_store_key
        )
        self._apply_resolved(prepared, "runtime.atomic_apply")

    def atomic_apply_with_machine_lifecycle(
        self,
        runtime_id: str,
        session_snapshot: bytes,
        receipt: RunBoundaryReceipt,
        machine_lifecycle: MachineLifecycleCommit,
        input_updates: Sequence[InputStatePersistenceRecord | StoredInputState],
        session_store_key: str,
    ) -> None:
        """One-call form of :meth:`BoundaryOps.atomic_apply_with_machine_lifecycle`."""
        prepared = prepare_boundary(
            self.domain,
            runtime_id,
            session_snapshot,
            receipt,
            input_updates,
            session_store_key,
            machine_lifecycle,
        )
        self._apply_resolved(prepared, "runtime.atomic_apply_with_machine_lifecycle")

    def _apply_resolved(self, prepared: PreparedBoundary, operation: str) -> None:
        """Apply a prepared boundary; settle a lost COMMIT answer by its receipt.

        The receipt is the boundary's idempotency fence: stored and equal to
        this boundary's receipt, the boundary was applied (done); absent, it
        was not (applied now, once more); another receipt under its key is a
        duplicate (``WriteFailed``, as for any boundary whose receipt key is taken).

        Raises:
            CommitOutcomeUnknown: the second attempt's COMMIT answer was lost too,
                or the receipt read or the second attempt failed on the database
                (``WriteFailed`` / ``ReadFailed`` over a ``StoreBusy``, a lost
                connection, the database unavailable): the first attempt's
                outcome is still unknown.
        """
        receipt = prepared.receipt
        try:
            self._write(lambda r: r.boundaries.apply_boundary(prepared))
            return
        except CommitOutcomeUnknown as unknown:
            first = unknown
        arguments: dict[str, object] = {"runtime_id": prepared.runtime_id, "receipt": receipt}
        try:
            stored = self.load_boundary_receipt(
                prepared.runtime_id, receipt.run_id, receipt.sequence
            )
            if stored is None:
                self._write(lambda r: r.boundaries.apply_boundary(prepared))
            elif stored != receipt:
                raise WriteFailed(
                    f"boundary receipt {receipt.run_id}#{receipt.sequence} is already stored "
                    "with other content"
                )
        except CommitOutcomeUnknown as again:
            raise CommitOutcomeUnknown(operation, arguments, again.detail) from first
        except Exception as failed:
            if not leaves_unknown(failed):
                raise
            raise still_unknown(first, failed, operation, arguments) from failed

    def load_boundary_receipt(
        self, runtime_id: str, run_id: str, sequence: int
    ) -> RunBoundaryReceipt | None:
        """One-call form of :meth:`BoundaryOps.load_boundary_receipt`."""
        encode_receipt_sequence(sequence)  # refuse a bad sequence before the unit
        return self._read(
            lambda r: r.boundaries.load_boundary_receipt(runtime_id, run_id, sequence)
        )
