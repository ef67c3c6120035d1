"""Ids and inputs (spec runs.md §5.6) and bad input to every public run-store method.

A refused call raises a typed :class:`~agentkeep.errors.AgentkeepError`
(``IdParseError``, ``InvalidInput``, ``AssigneeSlotRequired``, ...), never a
bare ``ValueError``/``AttributeError``/driver error, and changes nothing: every
row (compared in full, raw ``updated_at`` included) and every ``get()`` result
is identical afterwards, even though the clock moved. pydantic's
``ValidationError`` is expected only where a domain model itself is built with
an out-of-range value (:func:`test_domain_models_refuse_out_of_range_values`).

Store tests run on both backends; the id-parsing tests need no database.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pydantic
import pytest

from agentkeep.clock import SettableClock
from agentkeep.errors import (
    AgentkeepError,
    AssigneeDescRequired,
    AssigneeGenerationAhead,
    AssigneeSlotRequired,
    GenerationOverflow,
    IdParseError,
    InvalidInput,
    RunDuplicate,
)
from agentkeep.runs.domain import (
    UNSET,
    Assignee,
    DegradationEntry,
    RunId,
    RunListFilter,
    RunRecord,
    RunStatus,
    Stale,
    StepEntry,
    StepId,
    TaskId,
)
from agentkeep.store import Store

from .support import SLOT_A, mk, run_rows

MAX = 2**63 - 1


# ---------------------------------------------------------------------- §5.6 ids


@pytest.mark.parametrize(
    ("cls", "bad"),
    [
        (RunId, "T-1"),
        (RunId, "RK-1"),
        (RunId, "r-1"),
        (RunId, "R-"),
        (RunId, ""),
        (RunId, "nope"),
        (RunId, " R-1"),
        (TaskId, "R-1"),
        (TaskId, "t-1"),
        (TaskId, "T-"),
        (TaskId, ""),
        (TaskId, "nope"),
        (StepId, "S-1"),
        (StepId, "T-1"),
        (StepId, "st-abc"),
        (StepId, "ST-"),
        (StepId, ""),
        (StepId, "nope"),
    ],
)
def test_id_parse_rejects(cls: type[RunId] | type[TaskId] | type[StepId], bad: str) -> None:
    with pytest.raises(IdParseError) as err:
        cls.parse(bad)
    assert err.value.got == bad
    assert err.value.expected == cls.PREFIX
    assert isinstance(err.value, InvalidInput)


@pytest.mark.parametrize(
    ("cls", "good"),
    [
        (RunId, "R-x"),
        (RunId, "R- "),
        (RunId, "R-ünï"),
        (RunId, "R-nope"),
        (TaskId, "T-x"),
        (TaskId, "T- "),
        (TaskId, "T-ünï"),
        (StepId, "ST-x"),
        (StepId, "ST- "),
        (StepId, "ST-ünï"),
    ],
)
def test_id_parse_accepts(cls: type[RunId] | type[TaskId] | type[StepId], good: str) -> None:
    parsed = cls.parse(good)
    assert parsed == good
    assert str(parsed) == good


def test_id_parse_error_text() -> None:
    with pytest.raises(IdParseError) as err:
        TaskId.parse("R-xyz")
    assert str(err.value) == "invalid task id `R-xyz`: expected `T-` prefix"
    with pytest.raises(IdParseError) as err:
        RunId.parse("nope")
    assert str(err.value) == "invalid run id `nope`: expected `R-` prefix"


@pytest.mark.parametrize("bad", ["R-\x00", "R-a\x00b"])
def test_id_with_nul_is_refused(bad: str) -> None:
    with pytest.raises(InvalidInput):
        RunId.parse(bad)


@pytest.mark.parametrize(
    ("run_id", "task_id"), [("R- ", "T- "), ("R-ünï", "T-ünï"), ("R-x", "T-☃")]
)
def test_unusual_but_valid_ids_round_trip(store: Store, run_id: str, task_id: str) -> None:
    store.runs.create(mk(run_id, task_id))
    got = store.runs.get(run_id)
    assert (got.id, got.task_id) == (run_id, task_id)
    assert [r.id for r in store.runs.list_by_task(task_id)] == [run_id]
    store.runs.delete(run_id)
    assert store.runs.list() == []


# ---------------------------------------------------------------------- §5.6 slots, op, desc


@pytest.mark.parametrize("slot", [" ", "ünï-slot", "☃", "\u3000", "a b"])
def test_unusual_slot_names_are_accepted_and_round_trip(store: Store, slot: str) -> None:
    store.runs.create(mk("R-1"))
    assert store.runs.acquire_assignee("R-1", slot, "", "held") == (1, None)
    got = store.runs.get("R-1")
    assert got.current == {slot: Assignee(op="", desc="held", gen=1)}
    assert store.runs.vacate_assignee("R-1", slot, 1).generation == 2  # type: ignore[union-attr]
    assert store.runs.get("R-1").current == {}


@pytest.mark.parametrize("desc", ["\x1c", "  spaced  ", "\x1f\x1e", "a", "ünï"])
def test_desc_is_stored_untrimmed(store: Store, desc: str) -> None:
    store.runs.create(mk("R-1"))
    store.runs.acquire_assignee("R-1", SLOT_A, "S-1", desc)
    assert store.runs.get("R-1").current[SLOT_A].desc == desc


@pytest.mark.parametrize(
    "desc", ["", " ", "\t\n", "\u3000", "\u00a0", "\u2028", "\u0085", " \u200a\r\x0b\x0c"]
)
def test_blank_desc_is_refused_even_for_a_missing_run(store: Store, desc: str) -> None:
    store.runs.create(mk("R-1"))
    before = run_rows(store)
    with pytest.raises(AssigneeDescRequired):
        store.runs.acquire_assignee("R-1", SLOT_A, "S-1", desc)
    with pytest.raises(AssigneeDescRequired):
        store.runs.acquire_assignee("R-nope", SLOT_A, "S-1", desc)
    assert run_rows(store) == before


# ---------------------------------------------------------------------- §5.6 integer bounds


def test_generation_at_max_refuses_to_advance(store: Store, clock: SettableClock) -> None:
    holder = Assignee(op="S-1", desc="held", gen=MAX)
    store.runs.create(mk("R-1", current={SLOT_A: holder}, next_generation=MAX))
    got = store.runs.get("R-1")
    assert got.next_generation == MAX
    before = run_rows(store)
    clock.advance(60_000)
    with pytest.raises(GenerationOverflow):
        store.runs.acquire_assignee("R-1", "other", "S-2", "one more")
    with pytest.raises(GenerationOverflow):
        store.runs.vacate_assignee("R-1", SLOT_A, MAX)
    # A stale vacate writes nothing, so it is still answered.
    assert store.runs.vacate_assignee("R-1", SLOT_A, 1) == Stale(current=holder)
    assert run_rows(store) == before
    assert store.runs.get("R-1") == got


def test_integers_at_the_bound_round_trip(store: Store) -> None:
    store.runs.create(mk("R-1", created_at=MAX, updated_at=MAX, next_generation=MAX))
    got = store.runs.get("R-1")
    assert (got.created_at, got.updated_at, got.next_generation) == (MAX, MAX, MAX)


def test_domain_models_refuse_out_of_range_values() -> None:
    """Building a domain model with a bad value raises pydantic's ValidationError."""
    with pytest.raises(pydantic.ValidationError):
        Assignee(op="S-1", desc="d", gen=2**63)
    with pytest.raises(pydantic.ValidationError):
        Assignee(op="S-1", desc="d", gen=-1)
    with pytest.raises(pydantic.ValidationError):
        mk("R-1", next_generation=2**63)
    with pytest.raises(pydantic.ValidationError):
        mk("R-1", created_at=-1)
    with pytest.raises(pydantic.ValidationError):
        mk("R-1", updated_at=2**63)
    with pytest.raises(pydantic.ValidationError):
        mk("R-1", result_ref=float("nan"))
    with pytest.raises(pydantic.ValidationError):
        mk("R-1", result_ref={1, 2})
    with pytest.raises(pydantic.ValidationError):
        mk("nope")
    with pytest.raises(pydantic.ValidationError):
        mk("R-1", task_id="R-1")
    with pytest.raises(pydantic.ValidationError):
        StepEntry.basic("ST-1", None, None, None, -1)
    with pytest.raises(pydantic.ValidationError):
        DegradationEntry(tool="t", error="e", fallback="f", attempt=2**32, at=1)


@pytest.mark.parametrize(
    "kw",
    [
        {"limit": -1},
        {"offset": -1},
        {"limit": 2**63},
        {"offset": 2**63},
        {"limit": True},
        {"offset": 1.0},
        {"limit": "3"},
        {"status": "paused"},
        {"task_id": "R-1"},
        {"task_id": ""},
    ],
)
def test_run_list_filter_refuses_bad_values(kw: dict[str, Any]) -> None:
    with pytest.raises(InvalidInput):
        RunListFilter(**kw)


def test_run_list_filter_accepts_the_bounds(store: Store) -> None:
    store.runs.create(mk("R-1"))
    assert [r.id for r in store.runs.list(RunListFilter(limit=MAX, offset=0))] == ["R-1"]
    assert store.runs.list(RunListFilter(offset=MAX)) == []
    assert store.runs.list(RunListFilter(limit=MAX, offset=MAX)) == []


# ---------------------------------------------------------------------- bad input changes nothing


def unchecked(**overrides: Any) -> RunRecord:
    """A RunRecord built with ``model_construct`` (no validation), as a careless caller might."""
    fields: dict[str, Any] = {
        "id": RunId("R-3"),
        "task_id": TaskId("T-3"),
        "status": RunStatus.PENDING,
        "step_entries": (),
        "degradations": (),
        "operator_sid": None,
        "current": {},
        "next_generation": 0,
        "result_ref": UNSET,
        "input_json": None,
        "created_at": 1,
        "updated_at": 1,
    }
    fields.update(overrides)
    return RunRecord.model_construct(**fields)


Call = Callable[[Store], object]
STEP = StepEntry.basic("ST-9", "z", "dispatched", None, 9)
DEGR = DegradationEntry(tool="t", error="e", fallback="f", at=9)
BAD_IDS: list[Any] = ["nope", "T-1", "", "R-", "R-1\x00", None, 7]


def _id_error(bad: Any) -> type[AgentkeepError]:
    return IdParseError if isinstance(bad, str) and "\x00" not in bad else InvalidInput


def _cases() -> list[Any]:
    cases: list[Any] = []

    def case(label: str, call: Call, exc: type[BaseException]) -> None:
        cases.append(pytest.param(call, exc, id=label))

    for bad in BAD_IDS:
        e = _id_error(bad)
        case(f"get-{bad!r}", lambda s, b=bad: s.runs.get(b), e)
        case(f"append_step-{bad!r}", lambda s, b=bad: s.runs.append_step_entry(b, STEP), e)
        case(f"append_degr-{bad!r}", lambda s, b=bad: s.runs.append_degradation(b, DEGR), e)
        case(f"update_status-{bad!r}", lambda s, b=bad: s.runs.update_status(b, "done"), e)
        case(
            f"try_transition-{bad!r}",
            lambda s, b=bad: s.runs.try_transition(b, RunStatus.PENDING, RunStatus.DONE),
            e,
        )
        case(f"acquire-{bad!r}", lambda s, b=bad: s.runs.acquire_assignee(b, SLOT_A, "o", "d"), e)
        case(f"vacate-{bad!r}", lambda s, b=bad: s.runs.vacate_assignee(b, SLOT_A, 1), e)
        case(f"set_result-{bad!r}", lambda s, b=bad: s.runs.set_result(b, {"x": 2}), e)
        case(f"set_input-{bad!r}", lambda s, b=bad: s.runs.set_input_json(b, "new"), e)
        case(f"delete-{bad!r}", lambda s, b=bad: s.runs.delete(b), e)
    for bad in ["R-1", "", "nope", "T-\x00", None]:
        e = _id_error(bad)
        case(f"list_by_task-{bad!r}", lambda s, b=bad: s.runs.list_by_task(b), e)

    # list
    for kw in ({"limit": -1}, {"offset": -1}, {"limit": 2**63}, {"offset": 2**63}):
        case(f"list-{kw}", lambda s, k=kw: s.runs.list(RunListFilter(**k)), InvalidInput)
    case("list-not-a-filter", lambda s: s.runs.list({"limit": 1}), InvalidInput)  # type: ignore[arg-type]

    # appends
    case(
        "append_step-not-an-entry",
        lambda s: s.runs.append_step_entry("R-1", {"step_id": "ST-1", "at": 1}),
        InvalidInput,
    )
    case("append_step-degradation", lambda s: s.runs.append_step_entry("R-1", DEGR), InvalidInput)
    case("append_degr-step", lambda s: s.runs.append_degradation("R-1", STEP), InvalidInput)
    case("append_degr-none", lambda s: s.runs.append_degradation("R-1", None), InvalidInput)

    # status
    case("update_status-bogus", lambda s: s.runs.update_status("R-1", "bogus"), InvalidInput)
    case("update_status-none", lambda s: s.runs.update_status("R-1", None), InvalidInput)
    case(
        "try_transition-bogus-from",
        lambda s: s.runs.try_transition("R-1", "bogus", RunStatus.DONE),
        InvalidInput,
    )
    case(
        "try_transition-bogus-to",
        lambda s: s.runs.try_transition("R-1", RunStatus.PENDING, "Done"),
        InvalidInput,
    )

    # acquire
    acq = "acquire"
    case(
        f"{acq}-empty-slot",
        lambda s: s.runs.acquire_assignee("R-1", "", "o", "d"),
        AssigneeSlotRequired,
    )
    case(
        f"{acq}-none-slot",
        lambda s: s.runs.acquire_assignee("R-1", None, "o", "d"),
        AssigneeSlotRequired,
    )
    for desc in ("", "   ", "\t\n", "\u3000", "\u00a0", None):
        case(
            f"{acq}-desc-{desc!r}",
            lambda s, d=desc: s.runs.acquire_assignee("R-1", SLOT_A, "o", d),
            AssigneeDescRequired,
        )
    case(
        f"{acq}-none-op", lambda s: s.runs.acquire_assignee("R-1", SLOT_A, None, "d"), InvalidInput
    )
    case(
        f"{acq}-nul-slot",
        lambda s: s.runs.acquire_assignee("R-1", "a\x00b", "o", "d"),
        InvalidInput,
    )
    case(
        f"{acq}-surrogate-desc",
        lambda s: s.runs.acquire_assignee("R-1", SLOT_A, "o", "d\ud800"),
        InvalidInput,
    )
    case(
        f"{acq}-surrogate-slot",
        lambda s: s.runs.acquire_assignee("R-1", "\udfff", "o", "d"),
        InvalidInput,
    )
    case(
        f"{acq}-missing-run-empty-slot",
        lambda s: s.runs.acquire_assignee("R-nope", "", "o", "d"),
        AssigneeSlotRequired,
    )

    # vacate
    case("vacate-empty-slot", lambda s: s.runs.vacate_assignee("R-1", "", 1), AssigneeSlotRequired)
    case(
        "vacate-missing-run-empty-slot",
        lambda s: s.runs.vacate_assignee("R-nope", "", 1),
        AssigneeSlotRequired,
    )
    for gen in (-1, 2**64, True, 1.0, "1", None):
        case(
            f"vacate-gen-{gen!r}",
            lambda s, g=gen: s.runs.vacate_assignee("R-1", SLOT_A, g),
            InvalidInput,
        )

    # set_result
    for label, value in [
        ("set", {1, 2}),
        ("nan", float("nan")),
        ("inf", float("inf")),
        ("nested-nan", {"a": [1, float("-inf")]}),
        ("int-key", {1: "a"}),
        ("object", object()),
        ("bytes", b"x"),
        ("unset", UNSET),
        ("surrogate", "\ud800"),
        ("too-deep", _deep(200)),
    ]:
        case(f"set_result-{label}", lambda s, v=value: s.runs.set_result("R-1", v), InvalidInput)

    # set_input_json
    for label, value in [
        ("none", None),
        ("int", 5),
        ("bytes", b"{}"),
        ("dict", {}),
        ("nul", "a\x00b"),
        ("surrogate", "\udc00"),
    ]:
        case(f"set_input-{label}", lambda s, v=value: s.runs.set_input_json("R-1", v), InvalidInput)

    # create
    case("create-none", lambda s: s.runs.create(None), InvalidInput)  # type: ignore[arg-type]
    case("create-dict", lambda s: s.runs.create({"id": "R-3"}), InvalidInput)  # type: ignore[arg-type]
    for label, overrides in [
        ("nul-operator_sid", {"operator_sid": "S-\x00"}),
        ("nul-input_json", {"input_json": "{\x00}"}),
        ("negative-created_at", {"created_at": -1}),
        ("big-updated_at", {"updated_at": 2**63}),
        ("big-next_generation", {"next_generation": 2**63}),
        ("bool-created_at", {"created_at": True}),
        ("nan-result", {"result_ref": float("nan")}),
        ("bad-id", {"id": "nope"}),
        ("empty-id", {"id": ""}),
        ("bad-task_id", {"task_id": "R-3"}),
        ("nul-id", {"id": "R-\x00"}),
        ("bogus-status", {"status": "bogus"}),
    ]:
        case(
            f"create-unchecked-{label}",
            lambda s, o=overrides: s.runs.create(unchecked(**o)),
            InvalidInput,
        )
    case("create-duplicate", lambda s: s.runs.create(mk("R-1", "T-9", 999)), RunDuplicate)
    case(
        "create-duplicate-with-gen-ahead",
        lambda s: s.runs.create(
            mk("R-1", current={"z": Assignee(op="o", desc="d", gen=5)}, next_generation=4)
        ),
        AssigneeGenerationAhead,
    )
    return cases


def _deep(depth: int) -> Any:
    value: Any = 0
    for _ in range(depth):
        value = [value]
    return value


@pytest.fixture
def populated(store: Store) -> Store:
    """R-1 with a step, a degradation, a holder (G 1), a result and an input; and R-2."""
    store.runs.create(
        mk(
            "R-1",
            operator_sid="S-op",
            step_entries=(StepEntry.basic("ST-1", "a", "dispatched", None, 101),),
            degradations=(DegradationEntry(tool="t0", error="e", fallback="f", at=102),),
            current={SLOT_A: Assignee(op="S-1", desc="held", gen=1)},
            next_generation=1,
            result_ref={"x": 1},
            input_json='{"in":1}',
        )
    )
    store.runs.create(mk("R-2", "T-2", 200))
    return store


@pytest.mark.parametrize(("call", "exc"), _cases())
def test_bad_input_is_refused_with_a_typed_error_and_changes_nothing(
    populated: Store, clock: SettableClock, call: Call, exc: type[BaseException]
) -> None:
    store = populated
    rows_before = run_rows(store)
    records_before = [store.runs.get("R-1"), store.runs.get("R-2")]
    clock.advance(3_600_000)
    with pytest.raises(AgentkeepError) as err:
        call(store)
    assert isinstance(err.value, exc), f"{type(err.value).__name__}: {err.value}"
    assert not isinstance(err.value, pydantic.ValidationError)
    assert run_rows(store) == rows_before
    assert [store.runs.get("R-1"), store.runs.get("R-2")] == records_before
