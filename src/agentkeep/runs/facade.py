"""One-call forms of the run store's operations: ``store.runs.<operation>(...)``.

Each method runs the :class:`~agentkeep.runs.repository.RunRepository` method
of the same name in its own unit of work (write or read), retried as a whole
on a transient busy/serialisation error. The repository holds the only
implementation; see it for fences, outcomes and errors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from agentkeep.runs.domain import (
    Assignee,
    DegradationEntry,
    RunListFilter,
    RunRecord,
    RunStatus,
    StepEntry,
    VacateOutcome,
)

if TYPE_CHECKING:
    from agentkeep.store import Store

__all__ = ["RunCalls"]


class RunCalls:
    """``store.runs``: every run store operation, each in its own unit of work."""

    __slots__ = ("_store",)

    def __init__(self, store: Store) -> None:
        self._store = store

    def create(self, record: RunRecord) -> None:
        """See :meth:`RunRepository.create`."""
        self._store.call_write(lambda uow: uow.runs.create(record))

    def get(self, run_id: str) -> RunRecord:
        """See :meth:`RunRepository.get`."""
        return self._store.call_read(lambda uow: uow.runs.get(run_id))

    def list_by_task(self, task_id: str) -> list[RunRecord]:
        """See :meth:`RunRepository.list_by_task`."""
        return self._store.call_read(lambda uow: uow.runs.list_by_task(task_id))

    def list_running(self) -> list[RunRecord]:
        """See :meth:`RunRepository.list_running`."""
        return self._store.call_read(lambda uow: uow.runs.list_running())

    def list(self, flt: RunListFilter | None = None) -> list[RunRecord]:
        """See :meth:`RunRepository.list`."""
        return self._store.call_read(lambda uow: uow.runs.list(flt))

    def append_step_entry(self, run_id: str, entry: StepEntry) -> None:
        """See :meth:`RunRepository.append_step_entry`."""
        self._store.call_write(lambda uow: uow.runs.append_step_entry(run_id, entry))

    def append_degradation(self, run_id: str, entry: DegradationEntry) -> None:
        """See :meth:`RunRepository.append_degradation`."""
        self._store.call_write(lambda uow: uow.runs.append_degradation(run_id, entry))

    def update_status(self, run_id: str, status: RunStatus) -> None:
        """See :meth:`RunRepository.update_status`."""
        self._store.call_write(lambda uow: uow.runs.update_status(run_id, status))

    def try_transition(self, run_id: str, from_: RunStatus, to: RunStatus) -> bool:
        """See :meth:`RunRepository.try_transition`."""
        return self._store.call_write(lambda uow: uow.runs.try_transition(run_id, from_, to))

    def acquire_assignee(
        self, run_id: str, slot: str, op: str, desc: str
    ) -> tuple[int, Assignee | None]:
        """See :meth:`RunRepository.acquire_assignee`."""
        return self._store.call_write(lambda uow: uow.runs.acquire_assignee(run_id, slot, op, desc))

    def vacate_assignee(self, run_id: str, slot: str, expected_gen: int) -> VacateOutcome:
        """See :meth:`RunRepository.vacate_assignee`."""
        return self._store.call_write(
            lambda uow: uow.runs.vacate_assignee(run_id, slot, expected_gen)
        )

    def set_result(self, run_id: str, value: object) -> None:
        """See :meth:`RunRepository.set_result`."""
        self._store.call_write(lambda uow: uow.runs.set_result(run_id, value))

    def set_input_json(self, run_id: str, value: str) -> None:
        """See :meth:`RunRepository.set_input_json`."""
        self._store.call_write(lambda uow: uow.runs.set_input_json(run_id, value))

    def delete(self, run_id: str) -> None:
        """See :meth:`RunRepository.delete`."""
        self._store.call_write(lambda uow: uow.runs.delete(run_id))

    @property
    def name(self) -> str:
        """``"sqlite"`` or ``"postgres"`` (spec §3.2)."""
        return "postgres" if self._store.engine.dialect.name == "postgresql" else "sqlite"
