"""Machine lifecycle records, ops-lifecycle snapshots and retired ops epochs.

Described in docs/runtime.md#machine-lifecycle and
docs/runtime.md#ops-lifecycle-and-retired-epochs; the record formats in
docs/runtime.md#records.

:class:`LifecycleOps` is the repository part ``uow.runtime.lifecycle``; the
row steps the boundary and finalization writers share are plain functions
(:func:`upsert_lifecycle`, :func:`ops_bytes`, :func:`delete_ops_row`,
:func:`is_epoch_retired`).

* ``runtime_states`` holds one machine lifecycle record per runtime, written
  as the domain's current versioned encoding
  (:meth:`RuntimeDomain.encode_lifecycle`). :meth:`LifecycleOps.load_machine_lifecycle_record`
  returns its raw bytes; :meth:`~LifecycleOps.load_machine_lifecycle` and
  :meth:`~LifecycleOps.load_runtime_state` decode it strictly, so a legacy bare
  string (``"idle"``) or an unversioned ``{runtime_state, binding}`` object is
  :class:`~agentkeep.runtime.errors.ReadFailed`, never read as a state.
* ``runtime_ops_lifecycle`` holds at most one ops snapshot per runtime, owned
  by its ``epoch_id``.
* ``runtime_retired_ops_epochs`` holds tombstones of epochs retired by
  unregister finalization. This module never writes or deletes them; it
  reads them as the fence of every ops write (:func:`is_epoch_retired`, read
  under the lock before the write): a snapshot of a retired epoch is refused
  with :class:`~agentkeep.runtime.errors.OpsLifecycleEpochRetired`,
  across restarts.

Every write takes the ``runtime:<id>`` write lock first, so the retired-epoch
check and the write after it see every committed writer of the runtime.
Values are encoded before the lock is taken (an encode failure is
:class:`~agentkeep.runtime.errors.WriteFailed` and touches nothing).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from sqlalchemy import bindparam as p
from sqlalchemy import delete, select

from agentkeep.arguments import check_methods
from agentkeep.db import LockNamespace
from agentkeep.one_call import read, write
from agentkeep.runtime.access import RuntimeAccess, upsert_replacing
from agentkeep.runtime.calls import RuntimeCallsBase
from agentkeep.runtime.domain import MachineLifecycleCommit, OpsSnapshot, RuntimeState
from agentkeep.runtime.errors import OpsLifecycleEpochRetired, ReadFailed
from agentkeep.runtime.inputs import InputStateRecord, encode_input_states, upsert_input_states
from agentkeep.runtime.models import OpsLifecycleRow, RetiredOpsEpochRow, RuntimeStateRow
from agentkeep.statements import Statement, upsert

__all__ = [
    "LifecycleCalls",
    "LifecycleOps",
    "delete_ops_row",
    "is_epoch_retired",
    "lifecycle_bytes",
    "ops_bytes",
    "upsert_lifecycle",
]

_LIFECYCLE_TABLE: Final = RuntimeStateRow.__tablename__
_OPS_TABLE: Final = OpsLifecycleRow.__tablename__
_RETIRED_TABLE: Final = RetiredOpsEpochRow.__tablename__

_OPS_OF = OpsLifecycleRow.runtime_id == p("rt")

_LOAD_LIFECYCLE: Final = Statement(
    select(RuntimeStateRow.runtime_state_json).where(RuntimeStateRow.runtime_id == p("rt")),
    name="runtime.lifecycle.get",
)
_UPSERT_LIFECYCLE: Final = Statement(
    lambda d: upsert_replacing(
        d,
        RuntimeStateRow,
        {"runtime_id": p("rt"), "runtime_state_json": p("data")},
        key=[RuntimeStateRow.runtime_id],
        replace=["runtime_state_json"],
    ),
    name="runtime.lifecycle.upsert",
)
_LOAD_OPS: Final = Statement(
    select(OpsLifecycleRow.state_json).where(_OPS_OF), name="runtime.ops.get"
)
_UPSERT_OPS: Final = Statement(
    lambda d: upsert_replacing(
        d,
        OpsLifecycleRow,
        {"runtime_id": p("rt"), "state_json": p("data")},
        key=[OpsLifecycleRow.runtime_id],
        replace=["state_json"],
    ),
    name="runtime.ops.upsert",
)
_INSERT_OPS_IF_ABSENT: Final = Statement(
    lambda d: (
        upsert(d, OpsLifecycleRow)
        .values(runtime_id=p("rt"), state_json=p("data"))
        .on_conflict_do_nothing(index_elements=[OpsLifecycleRow.runtime_id])
    ),
    name="runtime.ops.insert_if_absent",
)
_DELETE_OPS: Final = Statement(delete(OpsLifecycleRow).where(_OPS_OF), name="runtime.ops.delete")
_IS_RETIRED: Final = Statement(
    select(RetiredOpsEpochRow.epoch_id).where(
        RetiredOpsEpochRow.runtime_id == p("rt"), RetiredOpsEpochRow.epoch_id == p("epoch")
    ),
    name="runtime.retired_epoch.exists",
)


def lifecycle_bytes(access: RuntimeAccess, runtime_id: str) -> bytes | None:
    """The raw lifecycle record bytes of a runtime (TEXT as UTF-8), or None.

    Raises:
        ReadFailed: the SELECT failed, or the value is not bytes/text.
    """
    return access.one_bytes(
        _LOAD_LIFECYCLE,
        {"rt": runtime_id},
        table=_LIFECYCLE_TABLE,
        key=runtime_id,
        column="runtime_state_json",
    )


def upsert_lifecycle(access: RuntimeAccess, runtime_id: str, data: bytes) -> None:
    """Upsert encoded lifecycle record bytes (the caller holds the runtime lock).

    Raises:
        WriteFailed: the upsert failed.
    """
    access.write(
        _UPSERT_LIFECYCLE, {"rt": runtime_id, "data": data}, f"{_LIFECYCLE_TABLE}[{runtime_id}]"
    )


def ops_bytes(access: RuntimeAccess, runtime_id: str) -> bytes | None:
    """The raw ops snapshot bytes of a runtime, or None.

    Raises:
        ReadFailed: the SELECT failed, or the value is not bytes/text.
    """
    return access.one_bytes(
        _LOAD_OPS, {"rt": runtime_id}, table=_OPS_TABLE, key=runtime_id, column="state_json"
    )


def delete_ops_row(access: RuntimeAccess, runtime_id: str) -> None:
    """Delete the ops snapshot row (the caller holds the runtime lock).

    Raises:
        WriteFailed: the DELETE failed (a trigger abort).
    """
    access.dml(_DELETE_OPS, {"rt": runtime_id}, f"{_OPS_TABLE}[{runtime_id}]")


def is_epoch_retired(access: RuntimeAccess, runtime_id: str, epoch_id: str) -> bool:
    """True if ``(runtime_id, epoch_id)`` has a retired-epoch tombstone.

    Raises:
        ReadFailed: the SELECT failed.
    """
    row = access.select(
        _IS_RETIRED,
        {"rt": runtime_id, "epoch": epoch_id},
        f"{_RETIRED_TABLE}[{runtime_id}, {epoch_id}]",
    ).fetchone()
    return row is not None


@check_methods
class LifecycleOps:
    """Repository part (``uow.runtime.lifecycle``): machine lifecycle and ops snapshots."""

    __slots__ = ("_access",)

    def __init__(self, access: RuntimeAccess) -> None:
        self._access = access

    # -- machine lifecycle (docs/runtime.md#machine-lifecycle) ------------------

    def load_machine_lifecycle_record(self, runtime_id: str) -> bytes | None:
        """Load the raw lifecycle record bytes (no decode; a TEXT value as its UTF-8 bytes).

        Raises:
            ReadFailed: the SELECT failed, or the value is not bytes/text.
        """
        return lifecycle_bytes(self._access, runtime_id)

    def load_machine_lifecycle(self, runtime_id: str) -> MachineLifecycleCommit | None:
        """Load and strictly decode the lifecycle record (docs/runtime.md#load_machine_lifecycle).

        Returns:
            The lifecycle snapshot, or None if the runtime has no record.

        Raises:
            ReadFailed: the SELECT failed, or the record is not a current one
                (a legacy bare string, an unversioned object, a corrupt value).
        """
        data = lifecycle_bytes(self._access, runtime_id)
        return None if data is None else self._access.domain.decode_lifecycle(data)

    def load_runtime_state(self, runtime_id: str) -> RuntimeState | None:
        """Load the runtime state of the lifecycle record (strict decode).

        See docs/runtime.md#load_runtime_state.

        Returns:
            ``"idle"``, ``"stopped"``, ``"retired"`` (reference domain), or
            None if the runtime has no record.

        Raises:
            ReadFailed: as for :meth:`load_machine_lifecycle`.
        """
        lifecycle = self.load_machine_lifecycle(runtime_id)
        return None if lifecycle is None else lifecycle.runtime_state

    def commit_machine_lifecycle(
        self,
        runtime_id: str,
        commit: MachineLifecycleCommit,
        input_states: Sequence[InputStateRecord] = (),
    ) -> None:
        """Upsert the lifecycle record, then the input states, in one transaction.

        See docs/runtime.md#commit_machine_lifecycle.

        Unconditional: no fence, and the ops snapshot is not touched.

        Args:
            runtime_id: the logical runtime id.
            commit: the lifecycle snapshot to store (current record version).
            input_states: input states to upsert with it, in order.

        Raises:
            InvalidInput: an input id is not a canonical UUID (nothing written).
            WriteFailed: a value does not encode, or an upsert failed (nothing
                of the call stays written).
        """
        domain = self._access.domain
        self.apply_machine_lifecycle(
            runtime_id, domain.encode_lifecycle(commit), encode_input_states(domain, input_states)
        )

    def apply_machine_lifecycle(
        self, runtime_id: str, data: bytes, inputs: Sequence[tuple[str, bytes]]
    ) -> None:
        """:meth:`commit_machine_lifecycle` after the encodes."""
        access = self._access
        access.begin_write(LockNamespace.RUNTIME, runtime_id)
        with access.atomic(), access.pipelined():  # Postgres: the writes in one round trip
            upsert_lifecycle(access, runtime_id, data)
            upsert_input_states(access, runtime_id, inputs)

    # -- ops lifecycle (docs/runtime.md#ops-lifecycle-and-retired-epochs) ------

    def persist_ops_lifecycle(self, runtime_id: str, snapshot: OpsSnapshot) -> None:
        """Store the runtime's ops snapshot unless its epoch is retired.

        See docs/runtime.md#persist_ops_lifecycle.

        The row is overwritten whatever epoch it held: only retirement fences.

        Raises:
            WriteFailed: the snapshot does not encode, or the upsert failed.
            OpsLifecycleEpochRetired: ``snapshot.epoch_id`` was retired for
                this runtime (nothing written).
            ReadFailed: the retired-epoch check failed.
        """
        data = self._access.domain.encode_ops(snapshot)
        self.apply_persist_ops(runtime_id, snapshot.epoch_id, data)

    def apply_persist_ops(self, runtime_id: str, epoch_id: str, data: bytes) -> None:
        """:meth:`persist_ops_lifecycle` after the encode (``data`` is epoch ``epoch_id``'s)."""
        access = self._access
        access.begin_write(LockNamespace.RUNTIME, runtime_id)
        if is_epoch_retired(access, runtime_id, epoch_id):
            raise OpsLifecycleEpochRetired(runtime_id, epoch_id)
        access.dml(_UPSERT_OPS, {"rt": runtime_id, "data": data}, f"{_OPS_TABLE}[{runtime_id}]")

    def initialize_ops_lifecycle_if_absent(
        self, runtime_id: str, candidate: OpsSnapshot
    ) -> OpsSnapshot:
        """Store ``candidate`` if the runtime has no ops snapshot; return the canonical one.

        See docs/runtime.md#initialize_ops_lifecycle_if_absent.

        Steps, in order: encode the candidate; refuse it if its epoch is
        retired; insert it unless a row exists; read and decode the row now
        stored (the canonical snapshot); refuse if *its* epoch is retired.
        Concurrent initializers therefore all return the same snapshot, which
        may be another writer's.

        Returns:
            The canonical snapshot (``candidate`` if it was inserted).

        Raises:
            WriteFailed: the candidate does not encode, or the insert failed.
            OpsLifecycleEpochRetired: the candidate's epoch is retired, or the
                stored snapshot's epoch is (naming that epoch); nothing written.
            ReadFailed: a SELECT failed, or the stored snapshot does not decode.
        """
        data = self._access.domain.encode_ops(candidate)
        return self.apply_initialize_ops(runtime_id, candidate.epoch_id, data)

    def apply_initialize_ops(self, runtime_id: str, epoch_id: str, data: bytes) -> OpsSnapshot:
        """:meth:`initialize_ops_lifecycle_if_absent` after the encode."""
        access = self._access
        access.begin_write(LockNamespace.RUNTIME, runtime_id)
        if is_epoch_retired(access, runtime_id, epoch_id):
            raise OpsLifecycleEpochRetired(runtime_id, epoch_id)
        with access.atomic():
            access.dml(
                _INSERT_OPS_IF_ABSENT,
                {"rt": runtime_id, "data": data},
                f"{_OPS_TABLE}[{runtime_id}]",
            )
            stored = ops_bytes(access, runtime_id)
            if stored is None:
                raise ReadFailed(f"{_OPS_TABLE}[{runtime_id}] is absent after its insert")
            canonical = access.domain.decode_ops(stored)
            if is_epoch_retired(access, runtime_id, canonical.epoch_id):
                raise OpsLifecycleEpochRetired(runtime_id, canonical.epoch_id)
        return canonical

    def load_ops_lifecycle(self, runtime_id: str) -> OpsSnapshot | None:
        """Load and decode the runtime's ops snapshot (docs/runtime.md#load_ops_lifecycle).

        Raises:
            ReadFailed: the SELECT failed or the row does not decode.
        """
        data = ops_bytes(self._access, runtime_id)
        return None if data is None else self._access.domain.decode_ops(data)

    def delete_ops_lifecycle(self, runtime_id: str) -> None:
        """Delete the runtime's ops snapshot, if any. It does not retire its epoch.

        See docs/runtime.md#delete_ops_lifecycle.

        Raises:
            WriteFailed: the DELETE failed.
        """
        self._access.begin_write(LockNamespace.RUNTIME, runtime_id)
        delete_ops_row(self._access, runtime_id)


class LifecycleCalls(RuntimeCallsBase):
    """One-call part: each lifecycle and ops operation in its own unit of work."""

    _repository = "runtime.lifecycle"

    load_machine_lifecycle_record = read(LifecycleOps.load_machine_lifecycle_record)
    load_machine_lifecycle = read(LifecycleOps.load_machine_lifecycle)
    load_runtime_state = read(LifecycleOps.load_runtime_state)
    load_ops_lifecycle = read(LifecycleOps.load_ops_lifecycle)
    delete_ops_lifecycle = write(LifecycleOps.delete_ops_lifecycle)

    def commit_machine_lifecycle(
        self,
        runtime_id: str,
        commit: MachineLifecycleCommit,
        input_states: Sequence[InputStateRecord] = (),
    ) -> None:
        """One-call form of :meth:`LifecycleOps.commit_machine_lifecycle`."""
        data = self.domain.encode_lifecycle(commit)  # refused before the unit opens
        inputs = encode_input_states(self.domain, input_states)
        self._write(lambda repo: repo.lifecycle.apply_machine_lifecycle(runtime_id, data, inputs))

    def persist_ops_lifecycle(self, runtime_id: str, snapshot: OpsSnapshot) -> None:
        """One-call form of :meth:`LifecycleOps.persist_ops_lifecycle`."""
        data = self.domain.encode_ops(snapshot)  # refused before the unit opens
        self._write(
            lambda repo: repo.lifecycle.apply_persist_ops(runtime_id, snapshot.epoch_id, data)
        )

    def initialize_ops_lifecycle_if_absent(
        self, runtime_id: str, candidate: OpsSnapshot
    ) -> OpsSnapshot:
        """One-call form of :meth:`LifecycleOps.initialize_ops_lifecycle_if_absent`."""
        data = self.domain.encode_ops(candidate)  # refused before the unit opens
        return self._write(
            lambda repo: repo.lifecycle.apply_initialize_ops(runtime_id, candidate.epoch_id, data)
        )
