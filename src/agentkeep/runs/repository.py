"""The run store's operations, one method per operation (docs/runs.md#operations).

:class:`RunRepository` is bound to one unit of work (``uow.runs``); the
one-call forms (``store.runs.<op>``) run a method in its own unit of work.

Fences and locks, the same for every write:

1. Arguments are checked first; a refused call touches nothing.
2. The aggregate write lock ``run:<id>`` is taken (:func:`agentkeep.db.lock_aggregate`:
   the write unit's ``BEGIN IMMEDIATE`` on SQLite, an advisory lock on Postgres)
   before the first read.
3. ``now`` is sampled once, after the lock, from the injected clock
   (``updated_at`` is whole Unix seconds).
4. The write is an ``UPDATE … WHERE id = :id AND <fence>``: the status for
   :meth:`try_transition`, the generation counter read under the lock for
   :meth:`acquire_assignee` / :meth:`vacate_assignee`, the stored text for the
   appends. Inside the lock a fence that matches nothing is a bug signal
   (:class:`~agentkeep.errors.ConcurrentModification`), never retried here.

One-statement writes (Postgres, one-call units only: docs/runs.md#common-rules).
:meth:`~RunRepository.try_transition`, :meth:`~RunRepository.acquire_assignee`,
:meth:`~RunRepository.vacate_assignee`, the appends, and the unconditional
writes (:meth:`~RunRepository.update_status`, :meth:`~RunRepository.set_result`,
:meth:`~RunRepository.set_input_json`, :meth:`~RunRepository.delete`:
:func:`_write_alone`) first try a form
without the separate lock round trip: their UPDATE takes ``run:<id>`` itself if it is free
(:func:`agentkeep.db.aggregate_try_lock_cte`) and runs as a transaction of its
own (:meth:`agentkeep.db.Driver.execute_alone`), fenced as in step 4 on the
row's latest version, plus ``updated_at <= now`` (``now`` was sampled before
the statement: a stamp never moves back). The values it was computed from (the
slot map and G, the array text) are read without the lock and are part of
its fence. When it writes nothing for any reason but a definite answer
(``try_transition``: the run absent or not in ``from_``; the unconditional
writes: the run absent, ``RunNotFound``), the steps above run.

Reads decode every column strictly; a corrupt value raises
:class:`~agentkeep.errors.RunCorrupt` naming the row and column, and one
undecodable row fails the whole list.

Statements are module-level constants (built once, executed with parameter
dicts), rows are read as tuples and turned into domain values directly: these
are the hot paths.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, TypeVar

from sqlalchemy import bindparam as p
from sqlalchemy import delete, exists, func, select, true, update

from agentkeep import observability
from agentkeep.bounds import I64_MAX, check_u64
from agentkeep.clock import Clock
from agentkeep.db import (
    Driver,
    LockNamespace,
    aggregate_lock_params,
    aggregate_try_lock_cte,
    lock_aggregate,
)
from agentkeep.errors import (
    AssigneeDescRequired,
    AssigneeSlotRequired,
    ConcurrentModification,
    GenerationOverflow,
    InvalidInput,
    ReadOnlyUnitOfWork,
    RunCorrupt,
    RunDuplicate,
    RunNotFound,
)
from agentkeep.runs import codec
from agentkeep.runs.codec import CodecError
from agentkeep.runs.domain import (
    UNSET,
    Assignee,
    DegradationEntry,
    PrefixedId,
    Released,
    RunId,
    RunListFilter,
    RunRecord,
    RunStatus,
    Stale,
    StepEntry,
    TaskId,
    VacateOutcome,
    is_blank_desc,
    validate_assignment_generations,
)
from agentkeep.runs.models import Run
from agentkeep.statements import Statement, upsert

__all__ = ["RunRepository"]

T = TypeVar("T")

_TABLE: Final = Run.__tablename__
_build_model: Final = codec.model_builder()  # codec.build_model, one call less per row

_FIELD_COLUMN: Final = {
    "status": "status",
    "step_entries": "step_entries_json",
    "degradations": "degradations_json",
    "current": "current_json",
    "result_ref": "result_ref_json",
}

# The columns of a whole record, in the order _row_to_record reads them.
_RECORD = (
    Run.id,
    Run.task_id,
    Run.status,
    Run.step_entries_json,
    Run.degradations_json,
    Run.operator_sid,
    Run.current_json,
    Run.next_generation,
    Run.result_ref_json,
    Run.input_json,
    Run.created_at,
    Run.updated_at,
)
_BY_ID = Run.id == p("id")

_INSERT: Final = Statement(
    lambda d: (
        upsert(d, Run)
        .values(
            id=p("id"),
            task_id=p("task_id"),
            status=p("status"),
            step_entries_json=p("steps"),
            degradations_json=p("degradations"),
            operator_sid=p("operator_sid"),
            current_json=p("current"),
            next_generation=p("gen"),
            result_ref_json=p("result"),
            input_json=p("input"),
            created_at=p("created_at"),
            updated_at=p("updated_at"),
        )
        .on_conflict_do_nothing(index_elements=[Run.id])
        .returning(Run.id)
    ),
    name="runs.insert",
)
_GET: Final = Statement(select(*_RECORD).where(_BY_ID), name="runs.get")
_LIST_BY_TASK: Final = Statement(
    select(*_RECORD)
    .where(Run.task_id == p("task_id"))
    .order_by(Run.created_at.asc(), Run.seq.asc()),
    name="runs.list_by_task",
)
_LIST_RUNNING: Final = Statement(
    select(*_RECORD).where(Run.status == p("status")).order_by(Run.seq.asc()),
    name="runs.list_running",
)
_GET_STEPS: Final = Statement(select(Run.step_entries_json).where(_BY_ID), name="runs.get_steps")
_GET_DEGRADATIONS: Final = Statement(
    select(Run.degradations_json).where(_BY_ID), name="runs.get_degradations"
)
_SET_STEPS: Final = Statement(
    update(Run)
    .values(step_entries_json=p("new"), updated_at=p("now"))
    .where(_BY_ID, Run.step_entries_json == p("old")),
    name="runs.set_steps",
)
_SET_DEGRADATIONS: Final = Statement(
    update(Run)
    .values(degradations_json=p("new"), updated_at=p("now"))
    .where(_BY_ID, Run.degradations_json == p("old")),
    name="runs.set_degradations",
)
_SET_STATUS: Final = Statement(
    update(Run).values(status=p("status"), updated_at=p("now")).where(_BY_ID),
    name="runs.set_status",
)
_TRANSITION: Final = Statement(
    update(Run).values(status=p("to"), updated_at=p("now")).where(_BY_ID, Run.status == p("from_")),
    name="runs.transition",
)


def _transition_alone() -> Statement:
    """``try_transition`` as one statement that takes the run's write lock itself (Postgres).

    The UPDATE writes only if the statement got the ``run:<id>`` advisory
    lock (:func:`agentkeep.db.aggregate_try_lock_cte`, which does not wait),
    so a unit holding the run's lock excludes it, as it excludes the locked
    path. Its fence is the locked path's (``status = :from_``) plus
    ``updated_at <= :now``: a stamp never moves back (the clock behind the
    stored stamp; or a row lock waited for while another writer stamped it).

    One row: ``moved`` (1: this call won) and ``held``: the stored
    ``updated_at`` if the statement's snapshot shows the row with status
    ``from_``, for when ``moved`` is 0. NULL there means the run is absent
    or in another status: the answer is False. Otherwise (the lock was held
    elsewhere, the stamp guard refused, or the row changed) the locked path
    decides.
    """
    lock = aggregate_try_lock_cte("run_lock")
    moved = (
        update(Run)
        .values(status=p("to"), updated_at=p("now"))
        .where(
            _BY_ID,
            Run.status == p("from_"),
            Run.updated_at <= p("now"),
            lock.c.locked.is_(true()),
        )
        .returning(Run.id)
        .cte("moved")
    )
    return Statement(
        select(
            select(func.count()).select_from(moved).scalar_subquery().label("moved"),
            select(Run.updated_at)
            .where(_BY_ID, Run.status == p("from_"))
            .scalar_subquery()
            .label("held"),
        ),
        name="runs.transition_alone",
    )


_TRANSITION_ALONE: Final = _transition_alone()
_GET_SLOTS: Final = Statement(
    select(Run.current_json, Run.next_generation).where(_BY_ID), name="runs.get_slots"
)
_SET_SLOTS: Final = Statement(
    update(Run)
    .values(current_json=p("current"), next_generation=p("new_gen"), updated_at=p("now"))
    .where(_BY_ID, Run.next_generation == p("old_gen")),
    name="runs.set_slots",
)


def _set_slots_alone() -> Statement:
    """``acquire_assignee``'s write as one statement that takes the run's lock itself (Postgres).

    For a one-call unit that read the slot map and G without the lock: the
    UPDATE writes only if the statement got the ``run:<id>`` advisory lock
    (:func:`agentkeep.db.aggregate_try_lock_cte`, which does not wait), and
    is fenced on everything the new map was computed from, re-checked on the
    row's latest version: G (``next_generation = :old_gen``) and the stored
    map text itself (a run deleted and created again under the same id with
    the same G differs there), plus ``updated_at <= :now`` (a stamp never
    moves back). Returns the run id when it wrote; no row: the locked path
    decides.
    """
    lock = aggregate_try_lock_cte("run_lock")
    return Statement(
        update(Run)
        .values(current_json=p("current"), next_generation=p("new_gen"), updated_at=p("now"))
        .where(
            _BY_ID,
            Run.next_generation == p("old_gen"),
            Run.current_json.is_not_distinct_from(p("old_current")),
            Run.updated_at <= p("now"),
            lock.c.locked.is_(true()),
        )
        .returning(Run.id),
        name="runs.set_slots_alone",
    )


_SET_SLOTS_ALONE: Final = _set_slots_alone()


def _set_array_alone(column: Any, name: str) -> Statement:
    """An append's write as one statement that takes the run's lock itself (Postgres).

    For a one-call unit that read the array without the lock: the UPDATE
    writes only if the statement got the ``run:<id>`` advisory lock
    (:func:`agentkeep.db.aggregate_try_lock_cte`, which does not wait), fenced
    as the locked path's (the stored array text is the text that was read
    and checked), plus ``updated_at <= :now`` (a stamp never moves back).
    Returns the run id when it wrote; no row: the locked path decides.
    """
    lock = aggregate_try_lock_cte("run_lock")
    return Statement(
        update(Run)
        .values({column: p("new"), Run.updated_at: p("now")})
        .where(_BY_ID, column == p("old"), Run.updated_at <= p("now"), lock.c.locked.is_(true()))
        .returning(Run.id),
        name=name,
    )


_SET_STEPS_ALONE: Final = _set_array_alone(Run.step_entries_json, "runs.set_steps_alone")
_SET_DEGRADATIONS_ALONE: Final = _set_array_alone(
    Run.degradations_json, "runs.set_degradations_alone"
)
_SET_RESULT: Final = Statement(
    update(Run).values(result_ref_json=p("v"), updated_at=p("now")).where(_BY_ID),
    name="runs.set_result",
)
_SET_INPUT: Final = Statement(
    update(Run).values(input_json=p("v"), updated_at=p("now")).where(_BY_ID),
    name="runs.set_input",
)
_DELETE: Final = Statement(delete(Run).where(_BY_ID), name="runs.delete")


def _write_alone(dml: Any, name: str, *, stamp: bool = True) -> Statement:
    """An unconditional one-row write as one statement that takes the run's lock itself (Postgres).

    For :meth:`RunRepository.update_status`, :meth:`~RunRepository.set_result`,
    :meth:`~RunRepository.set_input_json` and :meth:`~RunRepository.delete` in
    a one-call unit: ``dml`` (an UPDATE or DELETE of the run ``:id``) writes
    only if the statement got the ``run:<id>`` advisory lock
    (:func:`agentkeep.db.aggregate_try_lock_cte`, which does not wait), so a
    unit holding the run's lock excludes it, as it excludes the locked path;
    with ``stamp``, also only if ``updated_at <= :now`` (a stamp never moves
    back). Postgres re-checks that WHERE on the row's latest version.

    One row: ``moved`` (1: this call wrote) and ``present``: whether the
    statement's snapshot shows the run. ``moved`` 0 with ``present`` false
    is a definite ``RunNotFound`` (as of the statement's start); ``moved`` 0
    otherwise (the lock held elsewhere, the stamp guard, the row changed
    under it) hands over to the locked path.
    """
    lock = aggregate_try_lock_cte("run_lock")
    # The lock as a scalar subquery, not a joined table: a DELETE cannot join
    # one on every dialect the statements compile for (tests/test_statements.py).
    fence = [_BY_ID, select(lock.c.locked).scalar_subquery().is_(true())]
    if stamp:
        fence.append(Run.updated_at <= p("now"))
    moved = dml.where(*fence).returning(Run.id).cte("moved")
    return Statement(
        select(
            select(func.count()).select_from(moved).scalar_subquery().label("moved"),
            exists().where(_BY_ID).label("present"),
        ).add_cte(moved),  # declared, so the driver checks the written values' limits
        name=name,
    )


_SET_STATUS_ALONE: Final = _write_alone(
    update(Run).values(status=p("status"), updated_at=p("now")), "runs.set_status_alone"
)
_SET_RESULT_ALONE: Final = _write_alone(
    update(Run).values(result_ref_json=p("v"), updated_at=p("now")), "runs.set_result_alone"
)
_SET_INPUT_ALONE: Final = _write_alone(
    update(Run).values(input_json=p("v"), updated_at=p("now")), "runs.set_input_alone"
)
_DELETE_ALONE: Final = _write_alone(delete(Run), "runs.delete_alone", stamp=False)

_RUNNING: Final = codec.encode_status(RunStatus.RUNNING)


def _list(task: bool, status: bool) -> Statement:
    """The ``list`` query for one combination of filters.

    Filter clauses are added only when given (no ``(:p IS NULL OR …)``: Postgres
    cannot type an untyped NULL parameter). LIMIT and OFFSET are always bound;
    "no cap" binds 2**63-1, which both dialects accept (never a negative LIMIT).
    """
    query = select(*_RECORD)
    if task:
        query = query.where(Run.task_id == p("task_id"))
    if status:
        query = query.where(Run.status == p("status"))
    query = query.order_by(Run.created_at.desc(), Run.seq.desc()).limit(p("limit"))
    return Statement(query.offset(p("offset")), name=f"runs.list(task={task}, status={status})")


_LIST: Final = {
    (task, status): _list(task, status) for task in (False, True) for status in (False, True)
}


def _list_statement(task: bool, status: bool) -> Statement:
    """The ``list`` query for one combination of filters."""
    return _LIST[(task, status)]


class RunRepository:
    """Run store operations inside one unit of work.

    Args:
        driver: the unit of work's driver connection (in its transaction).
        clock: the time source; ``updated_at = clock.now_ms() // 1000``.
        writable: False inside ``store.read()``: write methods then raise
            :class:`~agentkeep.errors.ReadOnlyUnitOfWork`.
        nested: False in a one-call unit, which holds exactly one operation
            (``store.runs.<op>``): on Postgres :meth:`try_transition`, the
            slot operations and the appends then write with one statement of
            their own (see the module docstring).
    """

    def __init__(
        self, driver: Driver, clock: Clock, *, writable: bool, nested: bool = True
    ) -> None:
        self._db = driver
        self._clock = clock
        self._writable = writable
        # A one-call unit (not nested) holds this one operation and nothing else:
        # a single-statement operation may then run as a transaction of its own.
        self._alone = not nested and driver.postgres

    # ------------------------------------------------------------------ helpers

    def _begin_write(self, run_id: str) -> int:
        """Take the ``run:<id>`` lock; return ``now`` in Unix seconds, sampled after it."""
        self._check_writable()
        lock_aggregate(self._db, LockNamespace.RUN, run_id)
        return self._clock.now_ms() // 1000

    def _check_writable(self) -> None:
        if not self._writable:
            raise ReadOnlyUnitOfWork("run store writes need store.write(), not store.read()")

    def _wrote_alone(
        self,
        stmt: Statement,
        run_id: str,
        params: dict[str, Any],
    ) -> bool:
        """Run a :func:`_write_alone` statement in a one-call unit on Postgres (one round trip).

        Returns True when it wrote (committed with the statement); False,
        having written nothing, when the unit cannot run it alone or it wrote
        nothing for a reason the locked path decides (the lock held
        elsewhere, the stamp guard, the row changed under it).

        The written values are checked against their columns' size limits
        before anything is sent (the statement declares its UPDATE CTE:
        :func:`_write_alone`).

        Raises:
            PayloadTooLarge: a written value is over its limit.
            RunNotFound: the statement's snapshot shows no such run.
            CommitOutcomeUnknown: the connection was lost with it in flight.
        """
        self._check_writable()
        db = self._db
        params.update(aggregate_lock_params(db, LockNamespace.RUN, run_id))
        cur = db.execute_alone(stmt, params)
        if cur is None:
            return False
        moved, present = cur.fetchone()
        if moved == 1:
            return True
        if not present:
            raise RunNotFound(run_id)
        return False

    def _write_row(
        self,
        run_id: str,
        alone: Statement,
        locked: Statement,
        values: dict[str, Any],
        *,
        stamped: bool = True,
    ) -> None:
        """Write one run's row: alone in one round trip where it can, else under the lock.

        ``alone`` is the one-statement form (:meth:`_wrote_alone`), ``locked``
        the statement run after :meth:`_begin_write`; ``values`` their
        parameters besides ``id`` and (``stamped``) ``now``, the stamp:
        the clock's seconds for the statement alone, the locked path's
        ``now`` otherwise.

        Raises:
            RunNotFound: no such run.
            PayloadTooLarge, CommitOutcomeUnknown: as :meth:`_wrote_alone`.
        """
        if self._alone:
            params = {"id": run_id, **values}
            if stamped:
                params["now"] = self._clock.now_ms() // 1000
            if self._wrote_alone(alone, run_id, params):
                return
        now = self._begin_write(run_id)
        params = {"id": run_id, **values}
        if stamped:
            params["now"] = now
        if self._db.execute(locked, params).rowcount != 1:
            raise RunNotFound(run_id)

    def _decode(self, run_id: str, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except CodecError as exc:
            raise _corrupt(run_id, exc) from exc

    def _row_to_record(self, row: Sequence[Any]) -> RunRecord:
        raw_id = row[0]
        key = raw_id if isinstance(raw_id, str) else repr(raw_id)
        try:
            status = codec.decode_status(row[2])
            steps = codec.decode_step_entries(row[3])
            raw_degradations, raw_result = row[4], row[8]
            # The common values of these two columns without a call (a list
            # decodes every row): no degradation, no result.
            degradations = (
                () if raw_degradations == "[]" else codec.decode_degradations(raw_degradations)
            )
            current = codec.decode_current(row[6])
            result = UNSET if raw_result is None else codec.decode_result_ref(raw_result)
            run_id, task_id = codec.decode_run_ids(raw_id, row[1])
            # The plain columns' checks inlined (a list decodes every row); the
            # codec's functions name what is wrong when one fails.
            gen, created_at, updated_at = row[7], row[10], row[11]
            if not (
                type(gen) is int
                and type(created_at) is int
                and type(updated_at) is int
                and 0 <= gen <= I64_MAX
                and 0 <= created_at <= I64_MAX
                and 0 <= updated_at <= I64_MAX
            ):
                gen = codec.decode_u63(gen, "next_generation")
                created_at = codec.decode_u63(created_at, "created_at")
                updated_at = codec.decode_u63(updated_at, "updated_at")
            operator_sid, input_json = row[5], row[9]
            if not (
                (operator_sid is None or type(operator_sid) is str)
                and (input_json is None or type(input_json) is str)
            ):
                operator_sid = codec.decode_text_or_none(operator_sid, "operator_sid")
                input_json = codec.decode_text_or_none(input_json, "input_json")
        except CodecError as exc:
            column = _FIELD_COLUMN.get(exc.field, exc.field)
            raise RunCorrupt(_TABLE, key, column, exc.detail, field=exc.field) from exc
        return _build_model(  # type: ignore[no-any-return]
            RunRecord,
            {
                "id": run_id,
                "task_id": task_id,
                "status": status,
                "step_entries": steps,
                "degradations": degradations,
                "operator_sid": operator_sid,
                "current": current,
                "next_generation": gen,
                "result_ref": result,
                "input_json": input_json,
                "created_at": created_at,
                "updated_at": updated_at,
            },
        )

    # ------------------------------------------------------------------ create / read

    def create(self, record: RunRecord) -> None:
        """Insert a new run with the caller's values, verbatim (docs/runs.md#create).

        The A2 check comes first: a holder whose ``gen`` exceeds
        ``next_generation`` is refused before any database access, so a
        duplicate id carrying a bad generation raises
        :class:`~agentkeep.errors.AssigneeGenerationAhead`, not ``Duplicate``.
        ``created_at``/``updated_at`` are stored as given (no clock read).

        Raises:
            AssigneeGenerationAhead: a seeded holder is ahead of the counter.
            InvalidInput: a value the store cannot hold (NUL in text, integer
                above 2**63-1, a result that is not JSON).
            RunDuplicate: a run with this id exists; nothing was written.
        """
        if not isinstance(record, RunRecord):
            raise InvalidInput("record", f"expected a RunRecord, got {type(record).__name__}")
        validate_assignment_generations(record.current, record.next_generation)
        run_id = _rid(record.id)
        try:
            params = {
                "id": run_id,
                "task_id": record.task_id
                if type(record.task_id) is TaskId
                else TaskId(record.task_id),
                "status": _encode_status(record.status, "status"),
                "steps": codec.encode_step_entries(record.step_entries),
                "degradations": codec.encode_degradations(record.degradations),
                "operator_sid": _opt_text(record.operator_sid, "operator_sid"),
                "current": codec.encode_current(record.current),
                "gen": codec.check_u63(record.next_generation, "next_generation"),
                "result": _encode_result(record.result_ref),
                "input": _opt_text(record.input_json, "input_json"),
                "created_at": codec.check_u63(record.created_at, "created_at"),
                "updated_at": codec.check_u63(record.updated_at, "updated_at"),
            }
        except CodecError as exc:
            raise InvalidInput(exc.field, exc.detail) from exc
        for slot in record.current:
            codec.check_text(slot, "slot")
        self._begin_write(run_id)
        if self._db.execute(_INSERT, params).fetchone() is None:
            raise RunDuplicate(run_id)

    def get(self, run_id: str) -> RunRecord:
        """Return the run (docs/runs.md#get).

        Raises:
            RunNotFound: no such run.
            RunCorrupt: a stored column does not decode.
        """
        run_id = _rid(run_id)
        row = self._db.execute(_GET, {"id": run_id}).fetchone()
        if row is None:
            raise RunNotFound(run_id)
        return self._row_to_record(row)

    def list_by_task(self, task_id: str) -> list[RunRecord]:
        """Runs of one task, oldest ``created_at`` first, ties in insertion order.

        An unknown task gives ``[]`` (docs/runs.md#list_by_task).
        """
        task_id = task_id if type(task_id) is TaskId else TaskId(task_id)
        rows = self._db.execute(_LIST_BY_TASK, {"task_id": task_id}).fetchall()
        return [self._row_to_record(r) for r in rows]

    def list_running(self) -> list[RunRecord]:
        """Every run whose status is ``running``, in insertion order (docs/runs.md#list_running)."""
        rows = self._db.execute(_LIST_RUNNING, {"status": _RUNNING}).fetchall()
        return [self._row_to_record(r) for r in rows]

    def list(self, flt: RunListFilter | None = None) -> list[RunRecord]:
        """Runs matching ``flt``, newest ``created_at`` first, ties newest insertion first.

        ``limit=None`` means no cap, ``offset=None`` means 0 (docs/runs.md#list). Plain
        offset pagination: pages are not stable under concurrent inserts.
        """
        if flt is None:
            flt = RunListFilter()
        elif not isinstance(flt, RunListFilter):
            raise InvalidInput("filter", f"expected a RunListFilter, got {type(flt).__name__}")
        params: dict[str, Any] = {
            "limit": I64_MAX if flt.limit is None else flt.limit,
            "offset": flt.offset or 0,
        }
        if flt.task_id is not None:
            params["task_id"] = str(flt.task_id)
        if flt.status is not None:
            params["status"] = codec.encode_status(flt.status)
        stmt = _list_statement(flt.task_id is not None, flt.status is not None)
        rows = self._db.execute(stmt, params).fetchall()
        return [self._row_to_record(r) for r in rows]

    # ------------------------------------------------------------------ appends

    def append_step_entry(self, run_id: str, entry: StepEntry) -> None:
        """Append one step entry; earlier entries are kept as stored.

        See docs/runs.md#append_step_entry. In a one-call unit on Postgres:
        the array read and checked without the lock, then one statement that
        takes the lock if free and writes, fenced on the text read
        (:func:`_set_array_alone`); otherwise, or when that wrote nothing,
        the locked path.

        Raises:
            RunNotFound: no such run.
            RunCorrupt: the stored array does not decode; it is left unchanged.
        """
        run_id = _rid(run_id)
        if not isinstance(entry, StepEntry):
            raise InvalidInput("entry", "must be a StepEntry")
        self._append(
            run_id,
            codec.encode_step_entry(entry),
            _GET_STEPS,
            _SET_STEPS,
            _SET_STEPS_ALONE,
            codec.check_step_entries,
            "step_entries",
        )

    def append_degradation(self, run_id: str, entry: DegradationEntry) -> None:
        """Append one degradation entry; same rules as :meth:`append_step_entry`.

        See docs/runs.md#append_degradation.
        """
        run_id = _rid(run_id)
        if not isinstance(entry, DegradationEntry):
            raise InvalidInput("entry", "must be a DegradationEntry")
        self._append(
            run_id,
            codec.encode_degradation(entry),
            _GET_DEGRADATIONS,
            _SET_DEGRADATIONS,
            _SET_DEGRADATIONS_ALONE,
            codec.check_degradations,
            "degradations",
        )

    def _append(
        self,
        run_id: str,
        item_json: str,
        read: Statement,
        write: Statement,
        write_alone: Statement,
        check: Callable[[object], None],
        field: str,
    ) -> None:
        if self._alone:
            self._check_writable()
            cur = self._db.execute_alone(read, {"id": run_id}, writes=False)
            if cur is not None:
                # Read without the lock; one statement then takes it and writes,
                # fenced on the text read here (see _set_array_alone).
                old = self._checked_array(run_id, cur.fetchone(), check)
                params = {
                    "id": run_id,
                    "new": codec.append_json_array(old, item_json),
                    "old": old,
                    "now": self._clock.now_ms() // 1000,
                    **aggregate_lock_params(self._db, LockNamespace.RUN, run_id),
                }
                cur = self._db.execute_alone(write_alone, params)
                if cur is not None and cur.fetchone() is not None:
                    return
                # The lock was held elsewhere, the array changed, or the stamp
                # would move back: the locked path decides.
        now = self._begin_write(run_id)
        old = self._checked_array(run_id, self._db.execute(read, {"id": run_id}).fetchone(), check)
        new = codec.append_json_array(old, item_json)
        result = self._db.execute(write, {"id": run_id, "new": new, "now": now, "old": old})
        if result.rowcount != 1:
            raise ConcurrentModification(f"run {run_id}: {field} changed under the write lock")

    def _checked_array(self, run_id: str, row: Any, check: Callable[[object], None]) -> str:
        """The stored array text of ``row``, checked: RunNotFound, RunCorrupt (never extended)."""
        if row is None:
            raise RunNotFound(run_id)
        old = row[0]
        try:
            check(old)  # a corrupt array is refused, never extended
        except CodecError as exc:
            raise _corrupt(run_id, exc) from exc
        return old  # type: ignore[no-any-return]

    # ------------------------------------------------------------------ status

    def update_status(self, run_id: str, status: RunStatus) -> None:
        """Set the status unconditionally and bump ``updated_at`` (docs/runs.md#update_status).

        Also repairs a corrupt status column (the old value is not read).
        No fence but the run's write lock: the last writer wins. In a
        one-call unit on Postgres it is first one statement, committed on its
        own (one round trip, :func:`_write_alone`): its snapshot showing no
        run is ``RunNotFound``; a lost connection with it in flight is
        ``CommitOutcomeUnknown``; when it wrote nothing otherwise (the lock
        held elsewhere, a clock behind the stored stamp) the locked path
        decides.

        Raises:
            RunNotFound: no such run.
        """
        run_id = _rid(run_id)
        encoded = _encode_status(status, "status")
        self._write_row(run_id, _SET_STATUS_ALONE, _SET_STATUS, {"status": encoded})

    def try_transition(self, run_id: str, from_: RunStatus, to: RunStatus) -> bool:
        """Compare-and-set the status: ``from_`` → ``to`` (docs/runs.md#try_transition).

        The fence is ``status = <from_>`` on the row. Returns True when this
        call won (status flipped, ``updated_at`` bumped; ``from_ == to`` on a
        matching row also wins). Returns False, writing nothing, when the run
        is absent or its status is not ``from_``; never an error for those.
        Of concurrent callers with the same ``from_``, exactly one wins.

        In a one-call unit on Postgres it is first one statement, committed on
        its own (one round trip): the UPDATE takes the ``run:<id>`` lock
        itself if it is free and is fenced as below, plus ``updated_at <=
        now``, so that a stamp never moves back (see :func:`_transition_alone`).
        Its snapshot showing the run absent or not in ``from_`` means False.
        When it wrote nothing otherwise (the lock held elsewhere, the stamp
        guard, a concurrent change), the locked path decides.
        Elsewhere: the run's lock, ``now`` sampled after it, then
        ``UPDATE … WHERE id AND status = :from_``.
        """
        run_id = _rid(run_id)
        from_json = _encode_status(from_, "from_")
        to_json = _encode_status(to, "to")
        if self._alone:
            self._check_writable()
            params: dict[str, Any] = {
                "id": run_id,
                "from_": from_json,
                "to": to_json,
                "now": self._clock.now_ms() // 1000,
                **aggregate_lock_params(self._db, LockNamespace.RUN, run_id),
            }
            cur = self._db.execute_alone(_TRANSITION_ALONE, params)
            if cur is not None:
                moved, held = cur.fetchone()
                if moved == 1:
                    return True
                if held is None:
                    observability.refused(
                        "run_transition", "run %s: not %s (to %s)", run_id, from_, to
                    )
                    return False
                # The row was in from_ but the lock was held elsewhere, the stamp
                # would move back, or the row changed: the locked path decides.
        now = self._begin_write(run_id)
        params = {"id": run_id, "from_": from_json, "to": to_json, "now": now}
        if self._db.execute(_TRANSITION, params).rowcount == 1:
            return True
        observability.refused("run_transition", "run %s: not %s (to %s)", run_id, from_, to)
        return False

    # ------------------------------------------------------------------ assignment slots

    def acquire_assignee(
        self, run_id: str, slot: str, op: str, desc: str
    ) -> tuple[int, Assignee | None]:
        """Take ``slot`` for ``op``, displacing any holder (docs/runs.md#acquire_assignee).

        The run-wide counter G advances by one, unconditionally (the same op
        re-acquiring still advances it); the new holder carries the new G,
        and the displaced one is returned as stored (rules A4, A8 and Q3 of
        docs/runs.md#the-assignment-model).
        Fence: ``next_generation = <G read under the lock>``.

        Returns:
            ``(new_generation, previous)``: ``previous`` is the displaced holder
            exactly as stored, or None if the slot was vacant.

        Raises:
            AssigneeSlotRequired: ``slot == ""`` (checked first).
            AssigneeDescRequired: ``desc`` empty or Unicode White_Space only.
            RunNotFound: no such run.
            RunCorrupt: ``current_json`` does not decode; nothing is written
                and no generation is burned.
            GenerationOverflow: G is already 2**63-1.
        """
        run_id = _rid(run_id)
        if not isinstance(slot, str) or slot == "":
            raise AssigneeSlotRequired()
        if not isinstance(desc, str) or is_blank_desc(desc):
            raise AssigneeDescRequired()
        codec.check_text(slot, "slot")
        codec.check_text(op, "op")
        codec.check_text(desc, "desc")

        def take(
            current: dict[str, Assignee], gen: int
        ) -> tuple[tuple[int, Assignee | None], bool]:
            if gen >= I64_MAX:
                raise GenerationOverflow(run_id, gen)
            previous = current.get(slot)
            current[slot] = codec.build_model(Assignee, {"op": op, "desc": desc, "gen": gen + 1})
            return (gen + 1, previous), True

        return self._change_slots(run_id, take)

    def vacate_assignee(self, run_id: str, slot: str, expected_gen: int) -> VacateOutcome:
        """Release ``slot`` only if its holder still carries ``expected_gen``.

        See docs/runs.md#vacate_assignee.

        The comparison happens under the write lock, or (a one-call unit on
        Postgres: one round trip when Stale, two when released) against a
        map the write is fenced on, re-checked when it writes; either way a
        stale reader (a liveness sweep that read an older holder) can never
        remove a newer one.

        Returns:
            :class:`Released` with the new G and the removed holder; or
            :class:`Stale` with the present holder (None if vacant) — then
            nothing was written: no removal, no G bump, no ``updated_at`` change.

        Raises:
            AssigneeSlotRequired: ``slot == ""``.
            InvalidInput: ``expected_gen`` is not an integer in 0..2**64-1.
            RunNotFound: no such run.
            RunCorrupt: ``current_json`` does not decode.
            GenerationOverflow: G is already 2**63-1.
        """
        run_id = _rid(run_id)
        if not isinstance(slot, str) or slot == "":
            raise AssigneeSlotRequired()
        check_u64(expected_gen, "expected_gen")

        def release(current: dict[str, Assignee], gen: int) -> tuple[VacateOutcome, bool]:
            held = current.get(slot)
            if held is None or held.gen != expected_gen:
                return Stale(current=held), False
            if gen >= I64_MAX:
                raise GenerationOverflow(run_id, gen)
            del current[slot]
            return Released(generation=gen + 1, released=held), True

        return self._change_slots(run_id, release)

    def _change_slots(
        self,
        run_id: str,
        change: Callable[[dict[str, Assignee], int], tuple[T, bool]],
    ) -> T:
        """Read the slot map and G, let ``change`` edit the map, write it with G + 1.

        ``change(current, gen)`` edits ``current`` in place and returns its
        result and whether to write (False: nothing is written). It may raise
        (``GenerationOverflow``), writing nothing. In a one-call unit on
        Postgres the read and the write go without the separate lock round
        trip (:meth:`_change_slots_alone`); otherwise, or when that wrote
        nothing, under the lock: G read under it is the write's fence.
        """
        if self._alone:
            self._check_writable()
            done = self._change_slots_alone(run_id, change)
            if done is not None:
                return done[0]
        now = self._begin_write(run_id)
        current, gen = self._read_slots(run_id)
        result, write = change(current, gen)
        if write:
            self._write_slots(run_id, current, gen, gen + 1, now)
        return result

    def _change_slots_alone(
        self,
        run_id: str,
        change: Callable[[dict[str, Assignee], int], tuple[T, bool]],
    ) -> tuple[T] | None:
        """:meth:`_change_slots` in a one-call unit on Postgres: one or two round trips.

        The slot map and G are read without the lock (decoded strictly: a
        corrupt map or a missing run raises here, with nothing written); a
        result that writes nothing (``Stale``) is the answer, as of that read.
        Otherwise :data:`_SET_SLOTS_ALONE` takes the lock if it is free and
        writes, fenced on what was read. Returns ``(result,)``, or None,
        having written nothing, when the unit cannot run statements alone,
        the lock was held elsewhere, or the fence missed (another writer came
        between the read and the write, or the stamp would move back): the
        locked path then decides.
        """
        db = self._db
        cur = db.execute_alone(_GET_SLOTS, {"id": run_id}, writes=False)
        if cur is None:
            return None
        row = cur.fetchone()
        if row is None:
            raise RunNotFound(run_id)
        old_current = row[0]
        current, gen = self._decode(
            run_id,
            lambda: (
                codec.decode_current(old_current),
                codec.decode_u63(row[1], "next_generation"),
            ),
        )
        result, write = change(current, gen)
        if not write:
            return (result,)
        params: dict[str, Any] = {
            "id": run_id,
            "current": codec.encode_current(current),
            "new_gen": gen + 1,
            "old_gen": gen,
            "old_current": old_current,
            "now": self._clock.now_ms() // 1000,
            **aggregate_lock_params(db, LockNamespace.RUN, run_id),
        }
        cur = db.execute_alone(_SET_SLOTS_ALONE, params)
        if cur is None or cur.fetchone() is None:
            return None
        return (result,)

    def _read_slots(self, run_id: str) -> tuple[dict[str, Assignee], int]:
        row = self._db.execute(_GET_SLOTS, {"id": run_id}).fetchone()
        if row is None:
            raise RunNotFound(run_id)
        try:
            return codec.decode_current(row[0]), codec.decode_u63(row[1], "next_generation")
        except CodecError as exc:
            raise _corrupt(run_id, exc) from exc

    def _write_slots(
        self, run_id: str, current: Mapping[str, Assignee], old_gen: int, new_gen: int, now: int
    ) -> None:
        params = {
            "id": run_id,
            "current": codec.encode_current(current),
            "new_gen": new_gen,
            "old_gen": old_gen,
            "now": now,
        }
        if self._db.execute(_SET_SLOTS, params).rowcount != 1:
            raise ConcurrentModification(
                f"run {run_id}: next_generation moved from {old_gen} under the write lock"
            )

    # ------------------------------------------------------------------ payloads and delete

    def set_result(self, run_id: str, value: object) -> None:
        """Overwrite the result with a JSON value (JSON null stores the text ``null``).

        Last writer wins under the run's write lock; in a one-call unit on
        Postgres one round trip, as :meth:`update_status`.

        Raises:
            InvalidInput: ``value`` is not JSON-encodable (or is NaN/Infinity).
            RunNotFound: no such run.
        """
        run_id = _rid(run_id)
        encoded = _encode_result(value)
        if encoded is None:
            raise InvalidInput("result_ref", "UNSET cannot be stored; pass a JSON value")
        self._write_row(run_id, _SET_RESULT_ALONE, _SET_RESULT, {"v": encoded})

    def set_input_json(self, run_id: str, value: str) -> None:
        """Replace the opaque launch-input snapshot, verbatim (not parsed as JSON).

        Last writer wins under the run's write lock; in a one-call unit on
        Postgres one round trip, as :meth:`update_status`.

        Raises:
            InvalidInput: ``value`` is not a string or contains NUL.
            RunNotFound: no such run.
        """
        run_id = _rid(run_id)
        encoded = codec.check_text(value, "input_json")
        self._write_row(run_id, _SET_INPUT_ALONE, _SET_INPUT, {"v": encoded})

    def delete(self, run_id: str) -> None:
        """Delete the run; its id may be created again (with a new ``seq``).

        Under the run's write lock; of concurrent deletes exactly one
        succeeds, the others raise ``RunNotFound``. In a one-call unit on
        Postgres one round trip, as :meth:`update_status` (no stamp guard:
        nothing is stamped).

        Raises:
            RunNotFound: no such run.
        """
        run_id = _rid(run_id)
        self._write_row(run_id, _DELETE_ALONE, _DELETE, {}, stamped=False)


def _corrupt(run_id: str, exc: CodecError) -> RunCorrupt:
    """The RunCorrupt of run ``run_id`` for a column that did not decode (``exc``)."""
    column = _FIELD_COLUMN.get(exc.field, exc.field)
    return RunCorrupt(_TABLE, run_id, column, exc.detail, field=exc.field)


def _encode_status(value: object, field: str) -> str:
    """Encode a status argument; anything that is not a RunStatus value is InvalidInput."""
    if type(value) is RunStatus:  # the common case: no Enum lookup
        return codec.encode_status(value)
    try:
        return codec.encode_status(RunStatus(value))  # type: ignore[arg-type]
    except ValueError:
        raise InvalidInput(field, f"{value!r} is not a run status") from None


_RUN_PREFIX: Final = RunId.PREFIX
# RunId keeps PrefixedId's rule (checked once): _rid may then apply it inline.
_PLAIN_RUN_ID: Final = RunId.__new__ is PrefixedId.__new__
_str_new: Final = str.__new__


def _rid(run_id: str) -> str:
    """Validate a run id argument (``R-`` prefix, no NUL); raises IdParseError/InvalidInput.

    A plain ``str`` that passes the rule becomes a RunId without the class's
    constructor (its rule, inlined: every operation checks one id); anything
    else goes through ``RunId(run_id)``, which raises the typed error.
    """
    if type(run_id) is RunId:
        return run_id
    if (
        type(run_id) is str
        and _PLAIN_RUN_ID
        and len(run_id) > len(_RUN_PREFIX)
        and run_id.startswith(_RUN_PREFIX)
        and "\x00" not in run_id
    ):
        return _str_new(RunId, run_id)
    return RunId(run_id)


def _opt_text(value: str | None, field: str) -> str | None:
    return None if value is None else codec.check_text(value, field)


def _encode_result(value: object) -> str | None:
    try:
        return codec.encode_result_ref(value)
    except CodecError as exc:
        raise InvalidInput("result_ref", exc.detail) from exc
