"""Unregister finalization: one atomic commit, and a verdict when its acknowledgement is lost.

Described in docs/runtime.md#unregister-finalization; its async form is
never interrupted: when its caller is cancelled, it waits until the
transaction has finished (docs/async.md#cancellation). ``commit_unregister_finalization``
writes, in one transaction under the ``runtime:<id>`` write lock: the final
lifecycle record, the final input states, the retired-epoch tombstone, and —
when the stored ops snapshot belongs to the retired epoch — the deletion of
that ops row (an ops row of a *newer* epoch is kept). So it is never
observable that the lifecycle is final while the retired epoch's ops row
survives (I7), and a late ``persist_ops_lifecycle`` of that epoch is refused
forever (I6; both in docs/runtime.md#invariants).

**Uncertain commits** (docs/runtime.md#uncertain-commits,
docs/decisions.md#uncertain-commits-are-re-read). When COMMIT fails — or its
acknowledgement is lost — the store cannot know whether it landed. It re-reads
the four facts it wrote (lifecycle bytes, each input's bytes, ops bytes, the
tombstone) on another connection (the failed one is discarded) and decides:

* equal to the final state → success (also an idempotent retry whose
  "before" already was final);
* equal to the state read before the writes → ``WriteFailed(commit error)``:
  nothing was committed, an ordinary error;
* anything else, or the re-read fails →
  :class:`~agentkeep.runtime.errors.UnregisterFinalizationOutcomeUnknown`.
  Retry the (idempotent) finalization; never publish a compensating lifecycle
  rollback on it.

**Fault hooks** (docs/runtime.md#fault-hooks). A ``fault_hook`` is called at
the named :class:`FinalizationPoint` s. Raising at ``AFTER_LIFECYCLE_WRITE`` or
``AFTER_OPS_DELETE`` is a power cut (rolled back, ``WriteFailed`` with the
hook's message); raising at ``BEFORE_COMMIT`` is a COMMIT that failed and
rolled back; raising at ``AFTER_COMMIT`` is an acknowledgement lost after a
durable COMMIT; raising at ``BEFORE_REOBSERVE`` is a failed re-read (the hook
may also change the database there). :func:`synthetic_fault` builds the
original store's three one-shot faults. The hook is per call, never global
(docs/decisions.md#fault-hooks-not-globals).

What lives here: the repository part :class:`FinalizationOps`
(``uow.runtime.finalization``: its two steps, reachable only there),
:class:`FinalizationCalls` (the one-call operation, which drives the
transaction and the verdict), the fault hooks and the tombstone statement.
No compare-and-set here: the write lock serialises finalizations, the
tombstone insert is ``ON CONFLICT DO NOTHING`` (a retry finds it in place),
and the tombstone is itself the fence of every later ops write
(:func:`~agentkeep.runtime.lifecycle.is_epoch_retired`).

Finalization owns the end of its transaction, so it is a one-call operation
(``store.runtime.commit_unregister_finalization``), not part of a caller's
unit of work. Its async form (:mod:`agentkeep.aio`) lets a cancelled caller
return only after the transaction has finished.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Final

from sqlalchemy import bindparam as p

from agentkeep.arguments import check_methods
from agentkeep.db import LockNamespace, retry_transient, rollback_after
from agentkeep.errors import DatabaseError
from agentkeep.runtime.access import RuntimeAccess
from agentkeep.runtime.calls import RuntimeCallsBase
from agentkeep.runtime.domain import UnregisterFinalizationCommit
from agentkeep.runtime.errors import (
    ReadFailed,
    RuntimeStoreError,
    UnregisterFinalizationOutcomeUnknown,
    WriteFailed,
)
from agentkeep.runtime.inputs import input_state_bytes, upsert_input_states
from agentkeep.runtime.lifecycle import (
    delete_ops_row,
    is_epoch_retired,
    lifecycle_bytes,
    ops_bytes,
    upsert_lifecycle,
)
from agentkeep.runtime.models import RetiredOpsEpochRow
from agentkeep.statements import Statement, upsert

__all__ = [
    "FaultHook",
    "FinalizationCalls",
    "FinalizationObservation",
    "FinalizationOps",
    "FinalizationPoint",
    "synthetic_fault",
]


class FinalizationPoint(StrEnum):
    """Where a :data:`FaultHook` is called during unregister finalization."""

    AFTER_LIFECYCLE_WRITE = "after_lifecycle_write"
    AFTER_OPS_DELETE = "after_ops_delete"
    BEFORE_COMMIT = "before_commit"
    AFTER_COMMIT = "after_commit"
    BEFORE_REOBSERVE = "before_reobserve"


#: Called at each :class:`FinalizationPoint`; raising there injects that fault.
FaultHook = Callable[[FinalizationPoint], None]

_SYNTHETIC: Final = {
    1: (
        FinalizationPoint.AFTER_LIFECYCLE_WRITE,
        "synthetic power cut after unregister lifecycle write",
    ),
    2: (FinalizationPoint.AFTER_OPS_DELETE, "synthetic power cut after unregister ops deletion"),
    3: (FinalizationPoint.AFTER_COMMIT, "synthetic lost acknowledgement after unregister commit"),
}


class SyntheticFault(Exception):
    """Raised by a :func:`synthetic_fault` hook."""


def synthetic_fault(code: int) -> FaultHook:
    """The original store's one-shot faults: 1 power cut after the lifecycle write,
    2 after the ops deletion, 3 acknowledgement lost after a durable COMMIT.

    Raises:
        ValueError: ``code`` is not 1, 2 or 3.
    """
    if code not in _SYNTHETIC:
        raise ValueError(f"fault code {code!r} is not 1, 2 or 3")
    point, message = _SYNTHETIC[code]
    armed = [True]

    def hook(at: FinalizationPoint) -> None:
        if at is point and armed[0]:
            armed[0] = False
            raise SyntheticFault(message)

    return hook


@dataclass(frozen=True, slots=True)
class FinalizationObservation:
    """The four facts a finalization writes, as stored; equal iff byte-equal.

    Compared to classify an uncertain commit (docs/runtime.md#uncertain-commits).
    """

    lifecycle: bytes | None
    inputs: tuple[tuple[str, bytes | None], ...]
    ops: bytes | None
    retired_marker_present: bool


_RETIRED_TABLE: Final = RetiredOpsEpochRow.__tablename__
#: The retired-epoch tombstone (never deleted; a second finalization finds it in place).
_RETIRE: Final = Statement(
    lambda d: (
        upsert(d, RetiredOpsEpochRow)
        .values(runtime_id=p("rt"), epoch_id=p("epoch"))
        .on_conflict_do_nothing()
    ),
    name="runtime.retired_epoch.insert",
)


@check_methods
class FinalizationOps:
    """Repository part (``uow.runtime.finalization``): the statements of unregister finalization.

    The transaction is driven by :meth:`FinalizationCalls.commit_unregister_finalization`,
    the only caller of these two steps.
    """

    __slots__ = ("_access",)

    def __init__(self, access: RuntimeAccess) -> None:
        self._access = access

    def observe_unregister_finalization(
        self, runtime_id: str, input_ids: Sequence[str], retired_epoch: str
    ) -> FinalizationObservation:
        """Read the lifecycle, the given inputs, the ops row and the tombstone.

        The "before" and re-read observations of docs/runtime.md#uncertain-commits.

        Raises:
            ReadFailed: a SELECT failed.
        """
        access = self._access
        return FinalizationObservation(
            lifecycle_bytes(access, runtime_id),
            tuple((iid, input_state_bytes(access, runtime_id, iid)) for iid in input_ids),
            ops_bytes(access, runtime_id),
            is_epoch_retired(access, runtime_id, retired_epoch),
        )

    def write_unregister_finalization(
        self,
        runtime_id: str,
        lifecycle: bytes,
        inputs: Sequence[tuple[str, bytes]],
        retired_epoch: str,
        hook: FaultHook,
    ) -> tuple[FinalizationObservation, FinalizationObservation]:
        """Lock, observe, write everything; return (before, final).

        Steps 2–5 of docs/runtime.md#commit_unregister_finalization.

        The caller commits. Raises like :meth:`FinalizationCalls.commit_unregister_finalization`
        before its COMMIT.
        """
        access = self._access
        access.begin_write(LockNamespace.RUNTIME, runtime_id)
        ids = [iid for iid, _ in inputs]
        before = self.observe_unregister_finalization(runtime_id, ids, retired_epoch)
        final_ops: bytes | None = None
        if before.ops is not None:
            try:
                epoch = access.domain.ops_epoch_of(before.ops)
            except ReadFailed as exc:
                raise ReadFailed(
                    f"failed to decode ops epoch before unregister finalization: {exc.message}"
                ) from exc
            final_ops = None if epoch == retired_epoch else before.ops
        final = FinalizationObservation(lifecycle, tuple(inputs), final_ops, True)
        upsert_lifecycle(access, runtime_id, lifecycle)
        upsert_input_states(access, runtime_id, inputs)
        _fault(hook, FinalizationPoint.AFTER_LIFECYCLE_WRITE)
        access.dml(_RETIRE, {"rt": runtime_id, "epoch": retired_epoch}, _RETIRED_TABLE)
        if before.ops is not None and final_ops is None:
            delete_ops_row(access, runtime_id)
        _fault(hook, FinalizationPoint.AFTER_OPS_DELETE)
        return before, final


def _fault(hook: FaultHook, point: FinalizationPoint) -> None:
    """Call the hook; a raise there is a power cut: ``WriteFailed`` with its message."""
    try:
        hook(point)
    except RuntimeStoreError:
        raise
    except Exception as exc:
        raise WriteFailed(str(exc)) from exc


def _no_fault(_point: FinalizationPoint) -> None:
    return None


class FinalizationCalls(RuntimeCallsBase):
    """``store.runtime.commit_unregister_finalization``."""

    _repository = "runtime.finalization"

    def commit_unregister_finalization(
        self,
        runtime_id: str,
        finalization: UnregisterFinalizationCommit,
        *,
        fault_hook: FaultHook | None = None,
    ) -> None:
        """Commit an unregister finalization atomically; classify a lost acknowledgement.

        See docs/runtime.md#commit_unregister_finalization.

        Waits for the write lock up to the busy timeout (and retries the
        whole attempt on a transient error before COMMIT). Idempotent: a
        retry after a rollback or a durable commit converges.

        Args:
            runtime_id: the runtime.
            finalization: final lifecycle, final input states, epoch to retire.
            fault_hook: test hook called at each :class:`FinalizationPoint`.

        Raises:
            WriteFailed: an encode failed, a write failed (a trigger abort on
                the ops delete), a power-cut fault, or the COMMIT failed and
                the re-read shows nothing was committed.
            ReadFailed: the stored ops snapshot does not decode (nothing written).
            UnregisterFinalizationOutcomeUnknown: the COMMIT was not
                acknowledged and the re-read matches neither the final nor the
                previous state, or the re-read failed.
        """
        domain = self.domain
        lifecycle = domain.encode_lifecycle(finalization.lifecycle)
        inputs = tuple(
            (r.state.input_id, domain.encode_input_state(r.state))
            for r in finalization.input_states
        )
        epoch = finalization.retired_ops_epoch
        hook = fault_hook if fault_hook is not None else _no_fault
        store = self._store
        try:
            before, final, commit_error = retry_transient(
                lambda: self._attempt(runtime_id, lifecycle, inputs, epoch, hook),
                attempts=store.retry_attempts,
            )
        except RuntimeStoreError:
            raise
        except DatabaseError as exc:
            raise WriteFailed(str(exc)) from exc
        if commit_error is None:
            return
        ids = [iid for iid, _ in inputs]
        try:
            hook(FinalizationPoint.BEFORE_REOBSERVE)
            observed = self._read(
                lambda r: r.finalization.observe_unregister_finalization(runtime_id, ids, epoch),
                single_statement=False,  # several SELECTs: one snapshot
            )
        except Exception as exc:
            raise UnregisterFinalizationOutcomeUnknown(
                f"commit acknowledgement failed ({commit_error}); "
                f"durable outcome read failed: {exc}"
            ) from exc
        if observed == final:
            return
        if observed == before:
            raise WriteFailed(commit_error)
        raise UnregisterFinalizationOutcomeUnknown(
            f"commit acknowledgement failed ({commit_error}); reopened lifecycle/input/ops bytes "
            "match neither final nor pre-transaction authority"
        )

    def _attempt(
        self,
        runtime_id: str,
        lifecycle: bytes,
        inputs: Sequence[tuple[str, bytes]],
        epoch: str,
        hook: FaultHook,
    ) -> tuple[FinalizationObservation, FinalizationObservation, str | None]:
        """One transaction: (before, final, None) if acknowledged, else the commit error."""
        store = self._store
        with store.pooled_driver() as (driver, pooled):
            driver.begin(write=True)
            try:
                repo = store.repositories(driver, write=True).runtime.finalization
                before, final = repo.write_unregister_finalization(
                    runtime_id, lifecycle, inputs, epoch, hook
                )
            except BaseException as exc:
                rollback_after(exc, driver.rollback, pooled.invalidate)
                raise
            commit_error: str | None = None
            try:
                hook(FinalizationPoint.BEFORE_COMMIT)
            except Exception as exc:  # a COMMIT that failed and rolled back
                rollback_after(exc, driver.rollback, pooled.invalidate)
                commit_error = str(exc)
            if commit_error is None:
                try:
                    driver.commit()
                except DatabaseError as exc:
                    commit_error = str(exc)
                    if not store.memory:
                        pooled.invalidate()  # its state is unknown: never reuse it
                else:
                    try:
                        hook(FinalizationPoint.AFTER_COMMIT)
                    except Exception as exc:  # acknowledgement lost after a durable COMMIT
                        commit_error = str(exc)
            return before, final, commit_error
