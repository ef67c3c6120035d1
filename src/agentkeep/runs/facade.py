"""One-call forms of the run store's operations: ``store.runs.<operation>(...)``.

Each operation runs the :class:`~agentkeep.runs.repository.RunRepository`
method of the same name in its own unit of work (write or read), retried as a
whole on a transient busy/serialisation error (:mod:`agentkeep.one_call`). The
repository holds the only implementation; see it, and
docs/runs.md#operations, for fences, outcomes and errors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from agentkeep.errors import RunDuplicate, RunNotFound
from agentkeep.one_call import OneCalls, read, write
from agentkeep.runs.domain import RunRecord
from agentkeep.runs.repository import RunRepository as _R

__all__ = ["RunCalls"]


def _resolve_create(runs: Any, again: Callable[[], None], record: RunRecord) -> None:
    """A lost COMMIT of ``create``: the run as stored says whether it was ours.

    Stored and equal to ``record``: it was applied (done). Absent: it was
    not; create it now. Another record under the id: ``RunDuplicate``.
    """
    try:
        stored = runs.get(record.id)
    except RunNotFound:
        again()
        return
    if stored != record:
        raise RunDuplicate(record.id)


class RunCalls(OneCalls):
    """``store.runs``: every run store operation, each in its own unit of work."""

    _repository = "runs"

    create = write(_R.create, resolve=_resolve_create)
    get = read(_R.get, single_statement=True)
    list_by_task = read(_R.list_by_task, single_statement=True)
    list_running = read(_R.list_running, single_statement=True)
    list = read(_R.list, single_statement=True)
    append_step_entry = write(_R.append_step_entry)
    append_degradation = write(_R.append_degradation)
    update_status = write(_R.update_status)
    try_transition = write(_R.try_transition)
    acquire_assignee = write(_R.acquire_assignee)
    vacate_assignee = write(_R.vacate_assignee)
    set_result = write(_R.set_result)
    set_input_json = write(_R.set_input_json)
    delete = write(_R.delete)

    @property
    def name(self) -> str:
        """``"sqlite"`` or ``"postgres"``: the backend this store runs on."""
        return "postgres" if self._store.engine.dialect.name == "postgresql" else "sqlite"
