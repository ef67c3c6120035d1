"""Unit tests of the run store's value types (spec runs §2, §5.6). No database."""

from __future__ import annotations

import copy
import pickle
import re

import pytest
from pydantic import BaseModel, ValidationError

from agentkeep.errors import AssigneeGenerationAhead, IdParseError, InvalidInput
from agentkeep.runs.domain import (
    I64_MAX,
    U32_MAX,
    U64_MAX,
    UNSET,
    WHITE_SPACE,
    Assignee,
    DegradationEntry,
    Released,
    RunId,
    RunListFilter,
    RunRecord,
    RunStatus,
    SessionId,
    Stale,
    StepEntry,
    StepId,
    TaskId,
    Unset,
    Usage,
    VacateOutcome,
    WorkerId,
    is_blank_desc,
    json_value_problem,
    validate_assignment_generations,
)

from .support import DIGEST, SLOT_A, SLOT_B

# --------------------------------------------------------------------------
# Ids (§2.1, §5.6)

ID_CASES = [
    (RunId, "R-", "run"),
    (TaskId, "T-", "task"),
    (StepId, "ST-", "step"),
    (SessionId, "S-", "session"),
    (WorkerId, "W-", "worker"),
]


@pytest.mark.parametrize("raw", ["R-x", "R- ", "R-ünï", "R-1", "R-nope", "R- x", "R-R-"])
def test_run_id_accepts(raw: str) -> None:
    rid = RunId.parse(raw)
    assert rid == raw
    assert str(rid) == raw
    assert type(str(rid)) is str
    assert isinstance(rid, RunId)


@pytest.mark.parametrize("raw", ["T-1", "RK-1", "RK-abc", "r-1", "R-", "", "nope", " R-1", "R"])
def test_run_id_rejects(raw: str) -> None:
    with pytest.raises(IdParseError) as info:
        RunId.parse(raw)
    assert info.value.id_kind == "run"
    assert info.value.expected == "R-"
    assert info.value.got == raw
    assert isinstance(info.value, InvalidInput)


@pytest.mark.parametrize(("cls", "prefix", "kind"), ID_CASES)
def test_each_id_kind_checks_its_prefix(cls: type[RunId], prefix: str, kind: str) -> None:
    assert cls(prefix + "x") == prefix + "x"
    for bad in [prefix, "", "nope", prefix.lower() + "x", "X" + prefix + "x"]:
        with pytest.raises(IdParseError) as info:
            cls(bad)
        assert info.value.id_kind == kind
        assert info.value.expected == prefix


def test_step_id_versus_session_and_task_prefixes() -> None:
    assert StepId("ST-abc") == "ST-abc"
    for bad in ["S-abc", "T-abc", "st-abc", "ST-"]:
        with pytest.raises(IdParseError):
            StepId(bad)
    # "ST-1" does not start with "S-" and "S-1" does not start with "ST-".
    with pytest.raises(IdParseError):
        SessionId("ST-1")
    with pytest.raises(IdParseError):
        TaskId("ST-1")


def test_id_error_text() -> None:
    with pytest.raises(IdParseError) as info:
        TaskId.parse("R-xyz")
    assert str(info.value) == "invalid task id `R-xyz`: expected `T-` prefix"
    with pytest.raises(IdParseError, match=r"^invalid step id `st-abc`: expected `ST-` prefix$"):
        StepId("st-abc")


def test_id_no_trimming() -> None:
    with pytest.raises(IdParseError):
        RunId(" R-1")
    assert RunId("R-1 ") == "R-1 "


def test_id_rejects_nul_and_non_strings() -> None:
    with pytest.raises(InvalidInput) as info:
        RunId("R-a\x00b")
    assert info.value.field == "run_id"
    assert not isinstance(info.value, IdParseError)
    with pytest.raises(InvalidInput):
        RunId(b"R-1")  # type: ignore[arg-type]
    with pytest.raises(InvalidInput):
        TaskId(1)  # type: ignore[arg-type]


def test_id_equality_hash_repr_pickle() -> None:
    rid = RunId("R-1")
    assert rid == "R-1"
    assert hash(rid) == hash("R-1")
    assert {rid: 1}[RunId("R-1")] == 1 and "R-1" in {rid}
    assert repr(rid) == "RunId('R-1')"
    back = pickle.loads(pickle.dumps(rid))
    assert back == rid and type(back) is RunId
    assert RunId(rid) is rid
    assert copy.deepcopy(rid) == rid


@pytest.mark.parametrize(("cls", "prefix", "kind"), ID_CASES)
def test_mint(cls: type[RunId], prefix: str, kind: str) -> None:
    minted = {cls.mint() for _ in range(200)}
    assert len(minted) == 200
    for m in minted:
        assert type(m) is cls
        assert re.fullmatch(re.escape(prefix) + "[0-9a-f]{16}", m)


class _Holder(BaseModel):
    run: RunId
    step: StepId | None = None


def test_ids_as_pydantic_fields() -> None:
    h = _Holder(run="R-1", step="ST-2")
    assert type(h.run) is RunId and type(h.step) is StepId
    dumped = h.model_dump()
    assert dumped == {"run": "R-1", "step": "ST-2"}
    assert type(dumped["run"]) is str
    assert h.model_dump_json() == '{"run":"R-1","step":"ST-2"}'
    assert _Holder.model_validate_json(h.model_dump_json()) == h
    with pytest.raises(ValidationError, match="invalid run id `X-1`"):
        _Holder(run="X-1")
    with pytest.raises(ValidationError):
        _Holder(run=b"R-1")
    with pytest.raises(ValidationError):
        _Holder.model_validate_json('{"run":"R-"}')
    schema = _Holder.model_json_schema()
    assert schema["properties"]["run"]["type"] == "string"


# --------------------------------------------------------------------------
# RunStatus (§2.2)


def test_run_status_values() -> None:
    assert [s.value for s in RunStatus] == [
        "pending",
        "running",
        "done",
        "failed",
        "interrupted",
        "cancelled",
    ]
    assert RunStatus("running") is RunStatus.RUNNING
    assert RunStatus.DONE == "done"  # type: ignore[comparison-overlap]
    with pytest.raises(ValueError):
        RunStatus("Pending")


# --------------------------------------------------------------------------
# Entries (§2.3, §2.4)


def test_step_entry_basic() -> None:
    e = StepEntry.basic("ST-1", "step-a", "dispatched", None, 101)
    assert e.step_id == "ST-1" and type(e.step_id) is StepId
    assert (e.step_ref, e.status, e.binding_digest, e.at) == ("step-a", "dispatched", None, 101)
    for name in (
        "attempt",
        "started_at_ms",
        "completed_at_ms",
        "duration_ms",
        "worker_kind",
        "model",
        "usage",
        "num_turns",
        "adapter_data",
    ):
        assert getattr(e, name) is None
    assert StepEntry.basic(StepId("ST-2"), None, None, DIGEST, 0).binding_digest == DIGEST
    with pytest.raises(IdParseError):
        StepEntry.basic("T-1", None, None, None, 1)


def test_step_entry_field_order() -> None:
    assert list(StepEntry.model_fields) == [
        "step_id",
        "step_ref",
        "status",
        "binding_digest",
        "at",
        "attempt",
        "started_at_ms",
        "completed_at_ms",
        "duration_ms",
        "worker_kind",
        "model",
        "usage",
        "num_turns",
        "adapter_data",
    ]
    assert list(DegradationEntry.model_fields) == [
        "tool",
        "error",
        "fallback",
        "note",
        "step_ref",
        "attempt",
        "at",
    ]
    assert list(Assignee.model_fields) == ["op", "desc", "gen"]


def test_step_entry_is_frozen_and_forbids_extra() -> None:
    e = StepEntry.basic("ST-1", None, None, None, 1)
    with pytest.raises(ValidationError):
        e.at = 2
    with pytest.raises(ValidationError):
        StepEntry(step_id="ST-1", at=1, bogus=1)
    assert hash(e) == hash(StepEntry.basic("ST-1", None, None, None, 1))


@pytest.mark.parametrize(
    ("field", "good", "bad"),
    [
        ("at", [0, U64_MAX], [-1, U64_MAX + 1, True, 1.0, "1", None]),
        ("attempt", [0, U32_MAX, None], [-1, U32_MAX + 1, False, 1.5]),
        ("duration_ms", [0, U64_MAX, None], [-1, U64_MAX + 1]),
        ("started_at_ms", [-(2**63), I64_MAX, -5, None], [-(2**63) - 1, 2**63, True]),
        ("completed_at_ms", [-(2**63), I64_MAX], [2**63]),
        ("num_turns", [0, U32_MAX], [U32_MAX + 1, -1]),
        (
            "binding_digest",
            [DIGEST, None],
            [
                "sha256:" + "A" * 64,
                "sha256:" + "0" * 63,
                "sha256:" + "0" * 65,
                "sha512:" + "0" * 64,
                "sha256:" + "0" * 64 + "\n",
                "",
            ],
        ),
        ("step_ref", ["", "é", None], [1, b"x"]),
        ("model", ["m", None], [1]),
    ],
)
def test_step_entry_ranges(field: str, good: list[object], bad: list[object]) -> None:
    base: dict[str, object] = {"step_id": "ST-1", "at": 1}
    for value in good:
        e = StepEntry.model_validate({**base, field: value})
        assert getattr(e, field) == value
    for value in bad:
        with pytest.raises(ValidationError):
            StepEntry.model_validate({**base, field: value})


def test_usage_ranges() -> None:
    u = Usage(input_tokens=0, output_tokens=U64_MAX, total_tokens=3)
    assert u.output_tokens == U64_MAX
    with pytest.raises(ValidationError):
        Usage(input_tokens=-1, output_tokens=0, total_tokens=0)
    with pytest.raises(ValidationError):
        Usage(input_tokens=True, output_tokens=0, total_tokens=0)
    with pytest.raises(ValidationError):
        Usage(input_tokens=0, output_tokens=0)  # type: ignore[call-arg]


def test_adapter_data_must_be_json() -> None:
    ok = StepEntry(step_id=StepId("ST-1"), at=1, adapter_data={"a": [1, 2.5, "é", None, True]})
    assert ok.adapter_data == {"a": [1, 2.5, "é", None, True]}
    for bad in [
        float("nan"),
        {"x": float("inf")},
        {1: "a"},
        {"s": {1, 2}},
        object(),
        b"bytes",
        "\ud800",
        {"\udfff": 1},
    ]:
        with pytest.raises(ValidationError):
            StepEntry(step_id=StepId("ST-1"), at=1, adapter_data=bad)


def test_json_value_problem() -> None:
    assert json_value_problem(None) is None
    assert json_value_problem({"a": (1, [2, {"b": "c"}])}) is None
    assert json_value_problem(RunStatus.DONE) is None  # a str subclass
    assert json_value_problem(float("nan")) is not None
    assert json_value_problem({None: 1}) is not None
    deep: object = 1
    for _ in range(128):
        deep = [deep]
    assert json_value_problem(deep) is None
    assert json_value_problem([deep]) is not None
    circular: list[object] = []
    circular.append(circular)
    assert json_value_problem(circular) is not None


def test_degradation_entry() -> None:
    d = DegradationEntry(
        tool="web_search",
        error="boom",
        fallback="cached-default",
        step_ref="worker",
        attempt=1,
        at=101,
    )
    assert d.note is None
    with pytest.raises(ValidationError):
        DegradationEntry(tool="t", error="e", at=1)  # type: ignore[call-arg]
    with pytest.raises(ValidationError):
        DegradationEntry(tool="t", error="e", fallback="f", attempt=2**32, at=1)
    with pytest.raises(ValidationError):
        DegradationEntry(tool=None, error="e", fallback="f", at=1)


# --------------------------------------------------------------------------
# Assignee and outcomes (§2.5, §2.7)


def test_assignee_value_equality_and_bounds() -> None:
    a = Assignee(op="S-a1", desc="first hold", gen=1)
    assert a == Assignee(op="S-a1", desc="first hold", gen=1)
    assert a != Assignee(op="S-a1", desc="first hold", gen=2)
    assert a != Assignee(op="S-a1", desc="other", gen=1)
    assert Assignee(op="", desc="", gen=0).op == ""
    assert Assignee(op="x", desc="d", gen=I64_MAX).gen == I64_MAX
    for bad in [-1, I64_MAX + 1, True, 1.0, "1"]:
        with pytest.raises(ValidationError):
            Assignee(op="x", desc="d", gen=bad)
    with pytest.raises(ValidationError):
        Assignee(op="x", gen=1)  # type: ignore[call-arg]
    with pytest.raises(ValidationError):
        a.gen = 5
    assert hash(a) == hash(Assignee(op="S-a1", desc="first hold", gen=1))


def test_vacate_outcomes() -> None:
    a = Assignee(op="S-a1", desc="first hold", gen=1)
    r = Released(generation=2, released=a)
    assert r == Released(generation=2, released=Assignee(op="S-a1", desc="first hold", gen=1))
    assert r != Released(generation=3, released=a)
    assert Stale(current=None) == Stale()
    assert Stale(current=a) != Stale(current=None)
    assert Stale(current=None) != Released(generation=0, released=a)  # type: ignore[comparison-overlap]
    outcome: VacateOutcome = r
    assert isinstance(outcome, Released | Stale)
    match outcome:
        case Released(generation=g, released=held):
            assert (g, held) == (2, a)
        case Stale():  # pragma: no cover
            raise AssertionError
    with pytest.raises(ValidationError):
        r.generation = 3


# --------------------------------------------------------------------------
# UNSET


def test_unset_sentinel() -> None:
    assert Unset() is UNSET
    assert repr(UNSET) == "UNSET"
    assert not UNSET
    assert UNSET is not None
    assert UNSET != None  # noqa: E711 - the point of the sentinel
    assert copy.copy(UNSET) is UNSET
    assert copy.deepcopy(UNSET) is UNSET
    assert pickle.loads(pickle.dumps(UNSET)) is UNSET


# --------------------------------------------------------------------------
# RunListFilter (§2.8)


def test_run_list_filter_defaults_and_values() -> None:
    f = RunListFilter()
    assert (f.task_id, f.status, f.limit, f.offset) == (None, None, None, None)
    f = RunListFilter(task_id="T-1", status="running", limit=0, offset=I64_MAX)
    assert type(f.task_id) is TaskId
    assert f.status is RunStatus.RUNNING
    assert (f.limit, f.offset) == (0, I64_MAX)
    assert RunListFilter(status=RunStatus.DONE).status is RunStatus.DONE
    assert RunListFilter(limit=5) == RunListFilter(limit=5)
    with pytest.raises(ValidationError):
        f.limit = 3


@pytest.mark.parametrize("field", ["limit", "offset"])
@pytest.mark.parametrize("bad", [-1, I64_MAX + 1, 2**64, True, 1.0, "1"])
def test_run_list_filter_rejects_bad_page_values(field: str, bad: object) -> None:
    with pytest.raises(InvalidInput) as info:
        RunListFilter(**{field: bad})  # type: ignore[arg-type]
    assert info.value.field == field
    assert not isinstance(info.value, ValidationError)


def test_run_list_filter_rejects_bad_task_and_status() -> None:
    with pytest.raises(IdParseError):
        RunListFilter(task_id="R-1")
    with pytest.raises(InvalidInput) as info:
        RunListFilter(status="Running")
    assert info.value.field == "status"


# --------------------------------------------------------------------------
# RunRecord (§2.9)


def test_run_record_new_mirrors_mk() -> None:
    r = RunRecord.new("R-1", "T-1", 100)
    assert type(r.id) is RunId and type(r.task_id) is TaskId
    assert r.status is RunStatus.PENDING
    assert r.step_entries == () and r.degradations == ()
    assert r.operator_sid is None
    assert r.current == {}
    assert r.next_generation == 0
    assert r.result_ref is UNSET
    assert r.input_json is None
    assert (r.created_at, r.updated_at) == (100, 100)
    r2 = RunRecord.new("R-1", "T-1", 100, updated_at=50, status=RunStatus.DONE)
    assert (r2.created_at, r2.updated_at, r2.status) == (100, 50, RunStatus.DONE)


def test_run_record_result_unset_versus_json_null() -> None:
    unset = RunRecord.new("R-1", "T-1", 1)
    null = RunRecord.new("R-1", "T-1", 1, result_ref=None)
    assert unset.result_ref is UNSET
    assert null.result_ref is None
    assert unset != null
    assert RunRecord.new("R-1", "T-1", 1, result_ref={"ok": True}).result_ref == {"ok": True}
    with pytest.raises(ValidationError):
        RunRecord.new("R-1", "T-1", 1, result_ref=float("nan"))
    with pytest.raises(ValidationError):
        RunRecord.new("R-1", "T-1", 1, result_ref={1: 2})


def test_run_record_input_json_empty_is_not_none() -> None:
    assert RunRecord.new("R-1", "T-1", 1, input_json="").input_json == ""


def test_run_record_current_is_sorted_and_copied() -> None:
    b = Assignee(op="S-b", desc="b", gen=2)
    a = Assignee(op="S-a", desc="a", gen=1)
    given = {SLOT_B: b, SLOT_A: a, "é": a, " ": a}
    r = RunRecord.new("R-1", "T-1", 1, current=given, next_generation=2)
    assert list(r.current) == sorted(given)
    assert r.current[SLOT_A] is a
    given.clear()
    assert len(r.current) == 4


@pytest.mark.parametrize("field", ["next_generation", "created_at", "updated_at"])
@pytest.mark.parametrize("bad", [-1, I64_MAX + 1, True, 1.5])
def test_run_record_integer_bounds(field: str, bad: object) -> None:
    fields: dict[str, object] = {"id": "R-1", "task_id": "T-1", "status": "pending"}
    fields.update(created_at=1, updated_at=1)
    fields[field] = bad
    with pytest.raises(ValidationError):
        RunRecord.model_validate(fields)


def test_run_record_accepts_extreme_integers() -> None:
    r = RunRecord.new("R-1", "T-1", I64_MAX, next_generation=I64_MAX, updated_at=0)
    assert (r.created_at, r.updated_at, r.next_generation) == (I64_MAX, 0, I64_MAX)


def test_run_record_rejects_bad_ids_and_fields() -> None:
    with pytest.raises(ValidationError, match="invalid run id"):
        RunRecord.new("X-1", "T-1", 1)
    with pytest.raises(ValidationError, match="invalid task id"):
        RunRecord.new("R-1", "R-1", 1)
    with pytest.raises(ValidationError):
        RunRecord.new("R-1", "T-1", 1, bogus=1)
    with pytest.raises(ValidationError):
        RunRecord.new("R-1", "T-1", 1, status="paused")


def test_run_record_is_frozen_and_takes_lists() -> None:
    e = StepEntry.basic("ST-1", "step-a", "dispatched", None, 101)
    r = RunRecord.new("R-1", "T-1", 1, step_entries=[e])
    assert r.step_entries == (e,)
    with pytest.raises(ValidationError):
        r.status = RunStatus.DONE


# --------------------------------------------------------------------------
# A2 (§2.11)


def test_validate_assignment_generations() -> None:
    validate_assignment_generations({}, 0)
    validate_assignment_generations({SLOT_A: Assignee(op="x", desc="d", gen=0)}, 0)
    validate_assignment_generations({SLOT_A: Assignee(op="x", desc="d", gen=5)}, 5)
    with pytest.raises(AssigneeGenerationAhead) as info:
        validate_assignment_generations({SLOT_A: Assignee(op="x", desc="d", gen=6)}, 5)
    assert (info.value.slot, info.value.gen, info.value.next_generation) == (SLOT_A, 6, 5)


def test_validate_assignment_generations_reports_first_sorted_offender() -> None:
    current = {
        "zz": Assignee(op="x", desc="d", gen=99),
        SLOT_B: Assignee(op="x", desc="d", gen=7),
        SLOT_A: Assignee(op="x", desc="d", gen=1),
    }
    with pytest.raises(AssigneeGenerationAhead) as info:
        validate_assignment_generations(current, 1)
    assert (info.value.slot, info.value.gen) == (SLOT_B, 7)
    assert str(info.value) == (
        "assignee generation is ahead of the run's counter: "
        "current['phase-b-op'].gen = 7 > next_generation = 1"
    )


def test_validate_assignment_generations_seed_fixture() -> None:
    seeded = {SLOT_A: Assignee(op="S-seeded", desc="seeded straight into the record", gen=99)}
    with pytest.raises(AssigneeGenerationAhead) as info:
        validate_assignment_generations(seeded, 0)
    assert (info.value.slot, info.value.gen, info.value.next_generation) == (SLOT_A, 99, 0)


# --------------------------------------------------------------------------
# A9 whitespace (§3.10, §5.6)


@pytest.mark.parametrize("desc", ["", " ", "   ", "\t\n", "\u3000", "\u00a0", "\u2028 \u0085"])
def test_blank_desc(desc: str) -> None:
    assert is_blank_desc(desc)


@pytest.mark.parametrize("desc", ["\x1c", "\x1d\x1e\x1f", "x", "  padded  ", "\u200b", "\ufeff"])
def test_non_blank_desc(desc: str) -> None:
    assert not is_blank_desc(desc)


def test_white_space_set_is_exactly_the_unicode_property() -> None:
    expected = (
        [chr(c) for c in range(0x09, 0x0E)]
        + [" ", "\x85", "\xa0", "\u1680"]
        + [chr(c) for c in range(0x2000, 0x200B)]
        + ["\u2028", "\u2029", "\u202f", "\u205f", "\u3000"]
    )
    assert sorted(WHITE_SPACE) == sorted(expected)
    assert len(WHITE_SPACE) == 25
    for ch in expected:
        assert is_blank_desc(ch * 3)
    # str.isspace would also count these as blank; Rust's trim does not.
    for ch in "\x1c\x1d\x1e\x1f":
        assert ch.isspace() and not is_blank_desc(ch)
