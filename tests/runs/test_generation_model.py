"""The generation model of assignment slots (spec runs §5.3, §3.10, §3.11, §3.17), both backends.

A Hypothesis-driven sequence of acquire / vacate calls (correct, stale and
random ``expected_gen``; refused calls mixed in) runs against a real store
next to a small in-memory model, compared after every step. Then the
deterministic §5.3 cases: A2 at create, seeded holders, re-acquire and
overflow.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import text

from agentkeep.clock import SettableClock
from agentkeep.errors import (
    AssigneeDescRequired,
    AssigneeGenerationAhead,
    AssigneeSlotRequired,
    GenerationOverflow,
    RunNotFound,
)
from agentkeep.runs.domain import Assignee, Released, RunId, RunRecord, Stale
from agentkeep.store import Store

from .support import run_row

MAX_I64 = 2**63 - 1
SLOTS = ["phase-a-op", "phase-b-op", " ", "スロット"]
OPS = ["S-a", "S-b", "main-ai", ""]
BLANK_DESCS = ["", "   ", "\t\n", "\u3000", "\u00a0"]
MISSING = "R-never-created"


def raw_current_json(store: Store, run_id: str) -> str | None:
    with store.read() as uow:
        return uow.connection.execute(
            text("SELECT current_json FROM runs WHERE id = :id"), {"id": run_id}
        ).scalar_one()


# --------------------------------------------------------------------------
# The model and the operations


@dataclass
class Model:
    """What the store should hold: the slot map and G, plus history for stale picks."""

    current: dict[str, Assignee] = field(default_factory=dict)
    g: int = 0
    events: int = 0
    issued: list[int] = field(default_factory=list)  # every gen ever stamped on a holder


acquire_op = st.tuples(
    st.just("acquire"), st.integers(0, 3), st.sampled_from(OPS), st.integers(0, 9)
)
vacate_op = st.tuples(
    st.just("vacate"),
    st.integers(0, 3),
    st.sampled_from(["correct", "stale", "random"]),
    st.integers(0, 64),
)
blank_desc_op = st.tuples(st.just("blank_desc"), st.integers(0, 3), st.sampled_from(BLANK_DESCS))
empty_slot_op = st.tuples(st.just("empty_slot"), st.sampled_from(["acquire", "vacate"]))
missing_op = st.tuples(
    st.just("missing"), st.sampled_from(["acquire", "vacate"]), st.integers(0, 3)
)
_BY_KIND = {
    "acquire": acquire_op,
    "vacate": vacate_op,
    "blank_desc": blank_desc_op,
    "empty_slot": empty_slot_op,
    "missing": missing_op,
}
# Mostly real events; about one step in five is a refused call.
any_op = st.sampled_from(
    ["acquire"] * 4 + ["vacate"] * 4 + ["blank_desc", "empty_slot"] + ["missing"]
).flatmap(_BY_KIND.__getitem__)


def _expected_gen(model: Model, slot: str, how: str, n: int) -> int:
    held = model.current.get(slot)
    if how == "correct" and held is not None:
        return held.gen
    if how == "stale":
        older = [g for g in model.issued if held is None or g != held.gen]
        if older:
            return older[n % len(older)]
    return n % (model.g + 3)  # random, around the live range (may hit or miss)


def _step(
    store: Store, run_id: str, model: Model, n_slots: int, op: tuple, returned: list[int]
) -> None:
    """Apply ``op`` to the store and the model; assert the outcome the model predicts."""
    kind = op[0]
    clock = store.clock
    assert isinstance(clock, SettableClock)
    now_s = clock.advance(1000) // 1000  # a write in this step is visible in updated_at
    before = run_row(store, run_id)
    wrote = False

    if kind == "acquire":
        slot = SLOTS[op[1] % n_slots]
        desc = f"desc {op[3]} ü"
        new_gen, previous = store.runs.acquire_assignee(run_id, slot, op[2], desc)
        assert new_gen == model.g + 1
        assert previous == model.current.get(slot)
        model.g = new_gen
        model.events += 1
        model.current[slot] = Assignee(op=op[2], desc=desc, gen=new_gen)
        model.issued.append(new_gen)
        returned.append(new_gen)
        wrote = True
    elif kind == "vacate":
        # correct/stale aim at a held slot when there is one; random at any slot
        held_slots = sorted(model.current)
        if op[2] != "random" and held_slots:
            slot = held_slots[op[1] % len(held_slots)]
        else:
            slot = SLOTS[op[1] % n_slots]
        expected = _expected_gen(model, slot, op[2], op[3])
        held = model.current.get(slot)
        outcome = store.runs.vacate_assignee(run_id, slot, expected)
        if held is not None and held.gen == expected:
            assert outcome == Released(generation=model.g + 1, released=held)
            model.g += 1
            model.events += 1
            del model.current[slot]
            returned.append(outcome.generation)
            wrote = True
        else:
            assert outcome == Stale(current=held)
    elif kind == "blank_desc":
        with pytest.raises(AssigneeDescRequired):
            store.runs.acquire_assignee(run_id, SLOTS[op[1] % n_slots], "S-a", op[2])
    elif kind == "empty_slot":
        with pytest.raises(AssigneeSlotRequired):
            if op[1] == "acquire":
                store.runs.acquire_assignee(run_id, "", "S-a", "a real desc")
            else:
                store.runs.vacate_assignee(run_id, "", model.g)
    elif kind == "missing":
        with pytest.raises(RunNotFound):
            if op[1] == "acquire":
                store.runs.acquire_assignee(MISSING, SLOTS[0], "S-a", "a real desc")
            else:
                store.runs.vacate_assignee(MISSING, SLOTS[0], op[2])
        assert run_row(store, MISSING) is None
    else:  # pragma: no cover - the strategy has no other kinds
        raise AssertionError(op)

    after = run_row(store, run_id)
    if wrote:
        rec = store.runs.get(run_id)
        assert rec.updated_at == now_s
    else:
        # A Stale or a refused call changes nothing: the whole row, updated_at included.
        assert after == before
    _check_invariants(store, run_id, model, returned)


def _check_invariants(store: Store, run_id: str, model: Model, returned: list[int]) -> None:
    rec = store.runs.get(run_id)
    assert rec.next_generation == model.g == model.events  # G == number of successful events
    assert rec.current == model.current
    gens = [a.gen for a in rec.current.values()]
    assert all(g <= rec.next_generation for g in gens)
    assert len(set(gens)) == len(gens)
    assert all(a < b for a, b in zip(returned, returned[1:], strict=False))  # strictly increasing
    assert returned == list(range(1, len(returned) + 1))  # created at G=0: no gaps
    assert (raw_current_json(store, run_id) is None) == (not model.current)


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(n_slots=st.integers(1, 4), ops=st.lists(any_op, min_size=8, max_size=25))
def test_generation_model_matches_the_store(store: Store, n_slots: int, ops: list[tuple]) -> None:
    """Random acquire/vacate sequences over 1–4 slots agree with the model after every step."""
    run_id = RunId.mint()  # the store fixture is shared by all examples: a fresh run each
    clock = store.clock
    assert isinstance(clock, SettableClock)
    created = clock.now_ms() // 1000
    store.runs.create(RunRecord.new(run_id, "T-model", created))
    model = Model()
    returned: list[int] = []
    _check_invariants(store, run_id, model, returned)
    for op in ops:
        _step(store, run_id, model, n_slots, op, returned)
    rec = store.runs.get(run_id)
    assert (rec.created_at, rec.task_id) == (created, "T-model")


# --------------------------------------------------------------------------
# Deterministic cases


def _holder(gen: int, op: str = "S-seeded") -> Assignee:
    return Assignee(op=op, desc="seeded straight into the record", gen=gen)


@pytest.mark.parametrize("g", [0, 5])
def test_create_accepts_a_seeded_holder_at_the_counter(store: Store, g: int) -> None:
    """gen == G passes A2, and so does gen 0; the record round-trips."""
    rec = RunRecord.new(
        "R-1", "T-1", 100, next_generation=g, current={"phase-a-op": _holder(g), "z": _holder(0)}
    )
    store.runs.create(rec)
    got = store.runs.get("R-1")
    assert got.next_generation == g
    assert got.current == {"phase-a-op": _holder(g), "z": _holder(0)}


@pytest.mark.parametrize("g", [0, 5])
def test_create_refuses_a_seeded_holder_one_ahead(store: Store, g: int) -> None:
    """gen == G+1: AssigneeGenerationAhead naming the slot; no row is left behind."""
    rec = RunRecord.new(
        "R-1", "T-1", 100, next_generation=g, current={"phase-a-op": _holder(g + 1)}
    )
    with pytest.raises(AssigneeGenerationAhead) as err:
        store.runs.create(rec)
    assert (err.value.slot, err.value.gen, err.value.next_generation) == ("phase-a-op", g + 1, g)
    assert "current['phase-a-op'].gen" in str(err.value)
    assert run_row(store, "R-1") is None
    with pytest.raises(RunNotFound):
        store.runs.get("R-1")


def test_create_names_the_first_offender_in_sorted_order(store: Store) -> None:
    """Several offending slots: the first in code-point order is named, whatever the map order."""
    current = {"é": _holder(9), "b": _holder(8), "Z": _holder(7), "a": _holder(2)}
    rec = RunRecord.new("R-1", "T-1", 100, next_generation=2, current=current)
    with pytest.raises(AssigneeGenerationAhead) as err:
        store.runs.create(rec)
    assert (err.value.slot, err.value.gen, err.value.next_generation) == ("Z", 7, 2)
    assert run_row(store, "R-1") is None


def test_duplicate_id_with_a2_violation_raises_generation_ahead(store: Store) -> None:
    """A2 is checked before the duplicate check; the existing row is untouched."""
    store.runs.create(RunRecord.new("R-1", "T-1", 100))
    before = run_row(store, "R-1")
    bad = RunRecord.new("R-1", "T-2", 200, current={"phase-a-op": _holder(1)})
    with pytest.raises(AssigneeGenerationAhead) as err:
        store.runs.create(bad)
    assert err.value.slot == "phase-a-op"
    assert run_row(store, "R-1") == before


def test_seeded_holder_vacate_then_acquire(store: Store, clock: SettableClock) -> None:
    """Seeded {a: gen 3}, G 5: vacate(a, 3) → Released(6); the next acquire gets 7."""
    store.runs.create(
        RunRecord.new("R-1", "T-1", 100, next_generation=5, current={"a": _holder(3)})
    )
    clock.advance(1000)
    assert store.runs.vacate_assignee("R-1", "a", 3) == Released(generation=6, released=_holder(3))
    rec = store.runs.get("R-1")
    assert (rec.next_generation, rec.current) == (6, {})
    assert rec.updated_at == clock.now_ms() // 1000
    assert raw_current_json(store, "R-1") is None
    assert store.runs.acquire_assignee("R-1", "a", "S-next", "after the release") == (7, None)
    assert store.runs.get("R-1").current["a"] == Assignee(
        op="S-next", desc="after the release", gen=7
    )


def test_reacquire_by_same_op_then_vacate_with_older_gen_is_stale(
    store: Store, clock: SettableClock
) -> None:
    """Re-acquire by the same op mints a new gen; vacate with the older gen is Stale, no write."""
    store.runs.create(RunRecord.new("R-1", "T-1", 100))
    assert store.runs.acquire_assignee("R-1", "phase-a-op", "S-a1", "first hold") == (1, None)
    first = Assignee(op="S-a1", desc="first hold", gen=1)
    assert store.runs.acquire_assignee("R-1", "phase-a-op", "S-a1", "again") == (2, first)
    clock.advance(5000)
    before = run_row(store, "R-1")
    outcome = store.runs.vacate_assignee("R-1", "phase-a-op", 1)
    assert outcome == Stale(current=Assignee(op="S-a1", desc="again", gen=2))
    assert run_row(store, "R-1") == before


def test_generation_overflow_refuses_and_changes_nothing(
    store: Store, clock: SettableClock
) -> None:
    """G = 2**63-1: acquire (and a matching vacate) raise GenerationOverflow; row unchanged."""
    store.runs.create(
        RunRecord.new("R-max", "T-1", 100, next_generation=MAX_I64, current={"b": _holder(MAX_I64)})
    )
    clock.advance(5000)
    before = run_row(store, "R-max")
    with pytest.raises(GenerationOverflow):
        store.runs.acquire_assignee("R-max", "a", "S-a", "one too many")
    assert run_row(store, "R-max") == before
    with pytest.raises(GenerationOverflow):
        store.runs.vacate_assignee("R-max", "b", MAX_I64)
    assert run_row(store, "R-max") == before
    rec = store.runs.get("R-max")
    assert (rec.next_generation, rec.current) == (MAX_I64, {"b": _holder(MAX_I64)})


def test_last_representable_generation_is_handed_out(store: Store) -> None:
    """G = 2**63-2: one more acquire succeeds with gen 2**63-1 (the bound, not wrapped)."""
    store.runs.create(RunRecord.new("R-edge", "T-1", 100, next_generation=MAX_I64 - 1))
    assert store.runs.acquire_assignee("R-edge", "a", "S-a", "last one") == (MAX_I64, None)
    assert store.runs.get("R-edge").next_generation == MAX_I64
