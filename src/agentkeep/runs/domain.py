"""Value types of the run store (docs/runs.md#values).

This module owns the public, immutable values that the run repository takes
and returns: the prefixed ids (:class:`RunId`, :class:`TaskId`,
:class:`StepId`, :class:`SessionId`, :class:`WorkerId`), :class:`RunStatus`,
the trace entries (:class:`StepEntry`, :class:`DegradationEntry`),
:class:`Assignee`, the vacate outcomes (:class:`Released`, :class:`Stale`),
:class:`RunListFilter`, :class:`RunRecord` and the :data:`UNSET` sentinel. It
also owns the two pure checks the store runs before touching the database:
:func:`validate_assignment_generations` (rule A2) and :func:`is_blank_desc`
(rule A9; both rules in docs/runs.md#the-assignment-model). There is no
database code here and so no fence: the fenced writes live in
:mod:`agentkeep.runs.repository`; the JSON encoding lives in
:mod:`agentkeep.runs.codec`.

Invariants kept here:

* An id instance always satisfies its prefix rule: exact, case-sensitive
  prefix followed by at least one character, no trimming, and no NUL
  character (so the same id works on SQLite and Postgres:
  docs/decisions.md#text-without-nul).
* Integer fields are real ``int`` values (``bool`` and ``float`` are refused)
  inside their Rust range (u32, u64, i64). Values the store writes into a
  ``BIGINT`` column (``Assignee.gen``, ``RunRecord.next_generation``,
  ``created_at``, ``updated_at``) are limited to ``0..2**63-1``. The bounds
  and the field types (``U32``, ``U64``, ``I64``, ``U63``, :func:`check_u63`)
  are :mod:`agentkeep.bounds`'s, re-exported here.
* ``binding_digest`` is ``sha256:`` followed by 64 lowercase hex digits.
* ``StepEntry.adapter_data`` and ``RunRecord.result_ref`` are JSON values:
  ``None``, ``bool``, ``int``, finite ``float``, ``str``, ``list``/``tuple``
  and ``dict`` with ``str`` keys, nested at most 128 deep (serde_json's read
  limit), with no lone UTF-16 surrogate in any string
  (:func:`agentkeep.strict_json.json_value_problem`).
* ``RunRecord.current`` iterates in sorted key order.

Construction errors: the pydantic models raise :class:`pydantic.ValidationError`
for bad field values, as pydantic models do (an id that fails its prefix rule
shows up inside it as the :class:`~agentkeep.errors.IdParseError` message).
The id classes themselves raise :class:`~agentkeep.errors.IdParseError` (or
:class:`~agentkeep.errors.InvalidInput` for a NUL). :class:`RunListFilter` is
an API boundary and raises :class:`~agentkeep.errors.InvalidInput` only.

Not checked here, by design: NUL characters in ``operator_sid``,
``input_json`` and slot names (the repository refuses them with
:func:`agentkeep.runs.codec.check_text` when they are written, so values read
back from a foreign writer still load), A9 on seeded holders (``create``
accepts any seeded desc: docs/runs.md#create), and slot-name emptiness in a
record.
"""

from __future__ import annotations

import enum
import secrets
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Final, Self, TypeAlias, final

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    GetCoreSchemaHandler,
    Strict,
    ValidationError,
    field_validator,
)
from pydantic_core import core_schema

from agentkeep.bounds import I64, I64_MAX, I64_MIN, U32, U32_MAX, U63, U64, U64_MAX, check_u63
from agentkeep.errors import AssigneeGenerationAhead, IdParseError, InvalidInput
from agentkeep.strict_json import JSON_MAX_DEPTH, json_value_problem

__all__ = [
    "check_u63",
    "I64_MAX",
    "I64_MIN",
    "JSON_MAX_DEPTH",
    "U32_MAX",
    "U64_MAX",
    "UNSET",
    "Assignee",
    "DegradationEntry",
    "PrefixedId",
    "Released",
    "RunId",
    "RunListFilter",
    "RunRecord",
    "RunStatus",
    "SessionId",
    "Stale",
    "StepEntry",
    "StepId",
    "TaskId",
    "Unset",
    "Usage",
    "VacateOutcome",
    "WHITE_SPACE",
    "WorkerId",
    "is_blank_desc",
    "json_value_problem",
    "validate_assignment_generations",
]

# --------------------------------------------------------------------------
# Ids


class PrefixedId(str):
    """Base class of the prefixed id types: a ``str`` that passed its parse rule.

    Instances compare, hash and print as the raw string (``RunId("R-1") ==
    "R-1"``). Subclasses set ``PREFIX`` and ``KIND``.

    Raises:
        IdParseError: the text does not start with the exact prefix followed by
            at least one character.
        InvalidInput: the value is not a string, or contains a NUL character.
    """

    __slots__ = ()

    PREFIX: ClassVar[str] = ""
    KIND: ClassVar[str] = ""

    def __new__(cls, value: str) -> Self:
        if type(value) is cls:
            return value
        if not isinstance(value, str):
            raise InvalidInput(f"{cls.KIND}_id", f"expected a string, got {type(value).__name__}")
        prefix = cls.PREFIX
        if len(value) <= len(prefix) or not value.startswith(prefix):
            raise IdParseError(cls.KIND, prefix, value)
        if "\x00" in value:
            raise InvalidInput(f"{cls.KIND}_id", "contains a NUL character")
        return super().__new__(cls, value)

    @classmethod
    def parse(cls, s: str) -> Self:
        """Parse ``s`` into this id type (the same as calling the class).

        Args:
            s: the raw id text; it is not trimmed.

        Returns:
            The validated id.

        Raises:
            IdParseError: wrong or missing prefix, or nothing after it.
            InvalidInput: ``s`` is not a string or contains a NUL character.
        """
        return cls(s)

    @classmethod
    def mint(cls) -> Self:
        """Mint a fresh id: the prefix followed by 16 lowercase hex digits.

        The 64 random bits come from :mod:`secrets`, so ids minted by
        different processes or hosts do not collide in practice.
        """
        return cls(cls.PREFIX + secrets.token_hex(8))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str.__repr__(self)})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self),))

    @classmethod
    def __get_pydantic_core_schema__(
        cls, source: Any, handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        return core_schema.no_info_after_validator_function(
            cls,
            core_schema.str_schema(strict=True),
            serialization=core_schema.plain_serializer_function_ser_schema(
                str, return_schema=core_schema.str_schema()
            ),
        )


class RunId(PrefixedId):
    """Id of a Run: ``R-`` followed by at least one character."""

    __slots__ = ()
    PREFIX = "R-"
    KIND = "run"


class TaskId(PrefixedId):
    """Id of a Task: ``T-`` followed by at least one character."""

    __slots__ = ()
    PREFIX = "T-"
    KIND = "task"


class StepId(PrefixedId):
    """Id of a Step: ``ST-`` followed by at least one character."""

    __slots__ = ()
    PREFIX = "ST-"
    KIND = "step"


class SessionId(PrefixedId):
    """Id of an operator session: ``S-`` followed by at least one character."""

    __slots__ = ()
    PREFIX = "S-"
    KIND = "session"


class WorkerId(PrefixedId):
    """Id of a worker: ``W-`` followed by at least one character."""

    __slots__ = ()
    PREFIX = "W-"
    KIND = "worker"


# --------------------------------------------------------------------------
# RunStatus


class RunStatus(enum.StrEnum):
    """Lifecycle status of a Run. The store enforces no transition rules."""

    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    INTERRUPTED = "interrupted"
    CANCELLED = "cancelled"


# --------------------------------------------------------------------------
# Shared field types

Text = Annotated[str, Strict()]
BindingDigest = Annotated[str, Strict(), Field(pattern=r"^sha256:[0-9a-f]{64}$")]

_FROZEN = ConfigDict(frozen=True, extra="forbid")


# --------------------------------------------------------------------------
# Trace entries


class Usage(BaseModel):
    """Normalised token usage of one worker attempt (all u64).

    On decode each key is optional: a missing split reads as 0 and a missing
    total as ``input_tokens + output_tokens``. Constructed directly, all three
    values are required.
    """

    model_config = _FROZEN

    input_tokens: U64
    output_tokens: U64
    total_tokens: U64


class StepEntry(BaseModel):
    """One write-once entry of a Run's step trace.

    Fields are declared in their canonical encoding order. ``step_ref`` and
    ``status`` are encoded as ``null`` when None; every other optional field
    is omitted when None.
    """

    model_config = _FROZEN

    step_id: StepId
    step_ref: Text | None = None
    status: Text | None = None
    binding_digest: BindingDigest | None = None
    at: U64
    attempt: U32 | None = None
    started_at_ms: I64 | None = None
    completed_at_ms: I64 | None = None
    duration_ms: U64 | None = None
    worker_kind: Text | None = None
    model: Text | None = None
    usage: Usage | None = None
    num_turns: U32 | None = None
    adapter_data: Any = None
    """Worker-specific JSON payload; None means absent (JSON null reads as None too)."""

    @field_validator("adapter_data")
    @classmethod
    def _adapter_data_is_json(cls, value: Any) -> Any:
        problem = json_value_problem(value)
        if problem is not None:
            raise ValueError(f"adapter_data is not a JSON value: {problem}")
        return value

    @classmethod
    def basic(
        cls,
        step_id: StepId | str,
        step_ref: str | None,
        status: str | None,
        binding_digest: str | None,
        at: int,
    ) -> StepEntry:
        """Build an entry with only the five pre-stats fields set.

        Args:
            step_id: the step (``ST-…``).
            step_ref: the Blueprint step ref, if known.
            status: a free-form label (``dispatched``, ``passed``, …).
            binding_digest: ``sha256:<64 lowercase hex>``, if known.
            at: Unix seconds.

        Returns:
            The entry; every stats field is None.

        Raises:
            pydantic.ValidationError: a value is out of range or malformed.
        """
        return cls(
            step_id=StepId(step_id),
            step_ref=step_ref,
            status=status,
            binding_digest=binding_digest,
            at=at,
        )


class DegradationEntry(BaseModel):
    """A worker fell back to a substitute instead of failing."""

    model_config = _FROZEN

    tool: Text
    error: Text
    fallback: Text
    note: Text | None = None
    step_ref: Text | None = None
    attempt: U32 | None = None
    at: U64


# --------------------------------------------------------------------------
# Assignments (docs/runs.md#the-assignment-model)


class Assignee(BaseModel):
    """The holder of one slot: ``{op, desc, gen}``.

    ``op`` is not validated (it may be empty). ``desc`` is stored verbatim.
    ``gen`` is the generation stamped at acquire time, ``0..2**63-1``.
    Equality compares all three fields.
    """

    model_config = _FROZEN

    op: Text
    desc: Text
    gen: U63


class Released(BaseModel):
    """A vacate that released the slot.

    Attributes:
        generation: the Run's counter G after this event.
        released: the holder that was removed, exactly as it was stored.
    """

    model_config = _FROZEN

    generation: U63
    released: Assignee


class Stale(BaseModel):
    """A vacate refused because the slot did not hold the expected generation.

    Nothing was written.

    Attributes:
        current: the slot's present holder, or None when it is Vacant.
    """

    model_config = _FROZEN

    current: Assignee | None = None


VacateOutcome: TypeAlias = Released | Stale
"""What ``vacate_assignee`` did: :class:`Released` or :class:`Stale`."""


# --------------------------------------------------------------------------
# UNSET


@final
class Unset:
    """The type of :data:`UNSET`: "no value" (SQL NULL), distinct from JSON null.

    There is exactly one instance. It is falsy and prints as ``UNSET``.
    """

    __slots__ = ()
    _instance: ClassVar[Unset | None] = None

    def __new__(cls) -> Unset:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "UNSET"

    def __bool__(self) -> bool:
        return False

    def __reduce__(self) -> str:
        return "UNSET"

    def __copy__(self) -> Unset:
        return self

    def __deepcopy__(self, memo: object) -> Unset:
        return self


UNSET: Final = Unset()
"""No result: ``result_ref_json`` is SQL NULL. JSON null is Python ``None``."""


# --------------------------------------------------------------------------
# RunListFilter


class RunListFilter(BaseModel):
    """Filter and page for ``list`` (docs/runs.md#list). The default matches everything.

    Args:
        task_id: only Runs of this task.
        status: only Runs in this status.
        limit: at most this many Runs (None: no cap), ``0..2**63-1``.
        offset: skip this many Runs after ordering (None: 0), ``0..2**63-1``.

    Raises:
        InvalidInput: a negative, oversized or non-integer limit/offset, a
            task id that fails its prefix rule, or an unknown status. (Never a
            pydantic ValidationError when built through the constructor.)
    """

    model_config = _FROZEN

    task_id: TaskId | None = None
    status: RunStatus | None = None
    limit: U63 | None = None
    offset: U63 | None = None

    def __init__(
        self,
        *,
        task_id: TaskId | str | None = None,
        status: RunStatus | str | None = None,
        limit: int | None = None,
        offset: int | None = None,
    ) -> None:
        if task_id is not None:
            task_id = TaskId(task_id)
        if status is not None and not isinstance(status, RunStatus):
            try:
                status = RunStatus(status)
            except ValueError:
                raise InvalidInput("status", f"unknown run status {status!r}") from None
        if limit is not None:
            check_u63(limit, "limit")
        if offset is not None:
            check_u63(offset, "offset")
        try:
            super().__init__(task_id=task_id, status=status, limit=limit, offset=offset)
        except ValidationError as exc:  # pragma: no cover - pre-checked above
            raise InvalidInput("filter", str(exc)) from exc


# --------------------------------------------------------------------------
# RunRecord


class RunRecord(BaseModel):
    """One Run row (its columns: docs/runs.md#the-runs-table).

    ``current`` is a plain ``dict`` kept in sorted key order; treat it as
    read-only (the model is frozen, its mapping is not deep-frozen, and so a
    record is not hashable).
    ``result_ref`` is a JSON value, or :data:`UNSET` when no result was set;
    JSON null (``None``) is a result. ``input_json`` is opaque text, stored
    verbatim (``""`` is distinct from None).

    Raises:
        pydantic.ValidationError: on construction, for any malformed field
            (bad id, integer out of ``0..2**63-1``, a ``result_ref`` that is
            not a JSON value, ...).
    """

    model_config = _FROZEN

    id: RunId
    task_id: TaskId
    status: RunStatus
    step_entries: tuple[StepEntry, ...] = ()
    degradations: tuple[DegradationEntry, ...] = ()
    operator_sid: Text | None = None
    current: dict[str, Assignee] = Field(default_factory=dict)
    next_generation: U63 = 0
    result_ref: Any = UNSET
    """A JSON value, or :data:`UNSET` (no result)."""
    input_json: Text | None = None
    created_at: U63
    updated_at: U63

    @field_validator("current")
    @classmethod
    def _sorted_current(cls, value: dict[str, Assignee]) -> dict[str, Assignee]:
        keys = list(value)
        if keys == sorted(keys):
            return value
        return dict(sorted(value.items()))

    @field_validator("result_ref")
    @classmethod
    def _result_ref_is_json(cls, value: Any) -> Any:
        if value is UNSET:
            return value
        problem = json_value_problem(value)
        if problem is not None:
            raise ValueError(f"result_ref is not a JSON value: {problem}")
        return value

    @classmethod
    def new(
        cls,
        id: RunId | str,
        task_id: TaskId | str,
        created_at: int,
        **kw: Any,
    ) -> RunRecord:
        """Build a fresh record: the row of a newly launched run.

        Status Pending, no entries, no holders, G = 0, result UNSET, no
        input snapshot, and ``updated_at = created_at``. Any field may be
        overridden by keyword.

        Args:
            id: the Run id.
            task_id: the owning Task id.
            created_at: Unix seconds.
            **kw: other fields to set (``status``, ``current``, ...).

        Returns:
            The record.

        Raises:
            pydantic.ValidationError: a field is malformed.
        """
        kw.setdefault("status", RunStatus.PENDING)
        kw.setdefault("updated_at", created_at)
        return cls(id=id, task_id=task_id, created_at=created_at, **kw)


# --------------------------------------------------------------------------
# Checks run before any write (docs/runs.md#create, docs/runs.md#acquire_assignee)


def validate_assignment_generations(current: Mapping[str, Assignee], next_generation: int) -> None:
    """Check rule A2: every seeded holder's ``gen`` is at most the Run's counter.

    Slots are visited in ascending key order and the first offender is
    reported. ``gen == next_generation`` and ``gen == 0`` pass. Nothing else
    (desc, slot names, distinct generations) is checked.

    Args:
        current: slot name to holder.
        next_generation: the Run's counter G.

    Raises:
        AssigneeGenerationAhead: naming the first offending slot in sorted
            order, its ``gen`` and ``next_generation``.
    """
    for slot in sorted(current):
        gen = current[slot].gen
        if gen > next_generation:
            raise AssigneeGenerationAhead(slot, gen, next_generation)


WHITE_SPACE: Final = (
    "\t\n\x0b\x0c\r \x85\xa0\u1680"
    "\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a"
    "\u2028\u2029\u202f\u205f\u3000"
)
"""The Unicode White_Space set, as Rust's ``str::trim`` uses it (for the blank-desc check)."""


def is_blank_desc(desc: str) -> bool:
    """Return True when ``desc`` is empty or only Unicode White_Space (rule A9).

    Unlike :meth:`str.strip`, U+001C..U+001F do not count as whitespace, for
    parity with Rust's ``trim``.

    Args:
        desc: the candidate description.

    Returns:
        True if the store must refuse it with ``AssigneeDescRequired``.
    """
    return not desc.strip(WHITE_SPACE)
