"""The input-state batch compare-and-swap against an in-memory model (spec runtime §2.23).

Each example is a random program over five input ids of a fresh runtime:
persist random rows, compare-and-swap random batches (subsets in random
order, expected values drawn so that matching, stale, missing and
half-swapped rows all occur, replacements sometimes equal to the expected
values), retry the previous batch verbatim (the idempotent retry after a lost
acknowledgement), and submit malformed batches (count mismatch, a repeated id,
id sets that differ). The model applies §2.23 literally. After every step
the outcome (or the typed error) must equal the model's, and every stored row
must equal the model's row byte for byte. Steps run through ``store.runtime``
or inside ``store.write()`` at random. Runs on SQLite and Postgres.
"""

from __future__ import annotations

import uuid
from typing import Any

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from agentkeep.runtime.domain import (
    InputStatePersistenceRecord,
    ReferenceDomain,
    StoredInputState,
)
from agentkeep.runtime.errors import InvalidInputStateBatchCas
from agentkeep.runtime.inputs import InputStateCasOutcome
from agentkeep.store import Store

from .support import input_bytes

N_IDS = 5
IDS = [str(uuid.UUID(int=0x1000 + n)) for n in range(N_IDS)]
D = ReferenceDomain()

#: A row value: (current_state, recovery_count); few values, so collisions are frequent.
values = st.tuples(st.sampled_from(["accepted", "consumed"]), st.integers(0, 2))


def _state(input_id: str, value: tuple[str, int]) -> StoredInputState:
    return StoredInputState(input_id=input_id, current_state=value[0], recovery_count=value[1])


def _model_cas(
    model: dict[str, tuple[str, int]],
    expected: list[tuple[str, tuple[str, int]]],
    replacement: dict[str, tuple[str, int]],
) -> InputStateCasOutcome:
    """§2.23 steps 2–8, literally."""
    if not expected:
        return InputStateCasOutcome.SWAPPED
    all_expected = all_replacements = True
    for input_id, value in expected:
        if input_id not in model:
            return InputStateCasOutcome.STALE
        all_expected = all_expected and model[input_id] == value
        all_replacements = all_replacements and model[input_id] == replacement[input_id]
    if all_replacements:
        return InputStateCasOutcome.SWAPPED
    if not all_expected:
        return InputStateCasOutcome.STALE
    model.update(replacement)
    return InputStateCasOutcome.SWAPPED


def _situation(
    model: dict[str, tuple[str, int]],
    expected: list[tuple[str, tuple[str, int]]],
    replacement: dict[str, tuple[str, int]],
) -> str:
    """A label of the batch's case, for ``--hypothesis-show-statistics``."""
    if not expected:
        return "empty"
    if any(i not in model for i, _ in expected):
        return "missing row"
    is_exp = [model[i] == v for i, v in expected]
    is_rep = [model[i] == replacement[i] for i, _ in expected]
    if all(is_rep):
        return "already swapped"
    if all(is_exp):
        return "swap"
    if any(r and not e for e, r in zip(is_exp, is_rep, strict=True)):
        return "half swapped"
    return "stale"


def _call_cas(
    store: Store,
    runtime_id: str,
    uow: bool,
    expected: list[StoredInputState],
    replacements: list[Any],
) -> InputStateCasOutcome:
    if uow:
        with store.write() as unit:
            return unit.runtime.compare_and_swap_input_states_atomically(
                runtime_id, expected, replacements
            )
    return store.runtime.compare_and_swap_input_states_atomically(
        runtime_id, expected, replacements
    )


def _check_rows(url: str, runtime_id: str, model: dict[str, tuple[str, int]]) -> None:
    stored = input_bytes(url, runtime_id)
    assert stored == {i: D.encode_input_state(_state(i, v)) for i, v in model.items()}


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_batch_cas_matches_the_model(store: Store, db_url: str, data: st.DataObject) -> None:
    runtime_id = f"runtime-model-{uuid.uuid4()}"
    model: dict[str, tuple[str, int]] = {}
    last: _Batch | None = None
    kinds = st.sampled_from(["persist", "cas", "cas", "cas", "retry", "half-apply", "invalid"])
    seed = data.draw(st.dictionaries(st.sampled_from(IDS), values, max_size=N_IDS), label="seed")
    _persist(store, runtime_id, False, seed)
    model.update(seed)
    for _ in range(data.draw(st.integers(1, 12), label="steps")):
        kind = data.draw(kinds, label="kind")
        uow = data.draw(st.booleans(), label="uow")
        if kind == "persist":
            rows = data.draw(st.dictionaries(st.sampled_from(IDS), values, max_size=N_IDS))
            _persist(store, runtime_id, uow, rows)
            model.update(rows)
        elif kind == "half-apply":  # some rows of the last batch already hold the replacement
            if last is None or len(last.expected) < 2:
                continue
            ids = [i for i, _ in last.expected]
            part = data.draw(st.lists(st.sampled_from(ids), min_size=1, max_size=len(ids) - 1))
            rows = {i: last.replacement[i] for i in part}
            _persist(store, runtime_id, uow, rows)
            model.update(rows)
            kind = "retry"  # then retry the last batch against its half-applied rows
        if kind in ("cas", "retry"):
            if kind == "cas":
                last = data.draw(_batch(model, uow), label="batch")
            if last is None:
                continue
            event(f"{kind}: {_situation(model, last.expected, last.replacement)}")
            want = _model_cas(model, last.expected, last.replacement)
            got = _call_cas(store, runtime_id, last.uow, last.states, last.records)
            assert got is want, (kind, last, got, want)
        elif kind == "invalid":
            _check_invalid(store, runtime_id, uow, data.draw(_invalid(), label="invalid"))
        _check_rows(db_url, runtime_id, model)


class _Batch:
    """One drawn compare-and-swap: model values and the arguments passed to the store."""

    def __init__(
        self,
        uow: bool,
        expected: list[tuple[str, tuple[str, int]]],
        replacement: dict[str, tuple[str, int]],
        order: list[str],
        wrap: list[bool],
    ) -> None:
        self.uow = uow
        self.expected = expected
        self.replacement = replacement
        self.states = [_state(i, v) for i, v in expected]
        self.records: list[Any] = [
            InputStatePersistenceRecord.from_machine_snapshot(_state(i, replacement[i]))
            if w
            else _state(i, replacement[i])
            for i, w in zip(order, wrap, strict=True)
        ]

    def __repr__(self) -> str:
        return f"_Batch(expected={self.expected}, replacement={self.replacement})"


@st.composite
def _batch(draw: Any, model: dict[str, tuple[str, int]], uow: bool) -> _Batch:
    """Mostly rows that exist, mostly expected = stored, sometimes replacement = expected."""
    present = [i for i in IDS if i in model]
    pool = present if present and draw(st.integers(0, 4)) else IDS
    ids = draw(st.permutations(pool))[: draw(st.integers(0, len(pool)))]
    expected = []
    for i in ids:
        if i in model and draw(st.integers(0, 3)):
            expected.append((i, model[i]))
        else:
            expected.append((i, draw(values)))
    replacement = {i: v if not draw(st.integers(0, 3)) else draw(values) for i, v in expected}
    order = draw(st.permutations(ids))
    wrap = [draw(st.booleans()) for _ in order]
    return _Batch(uow, expected, replacement, order, wrap)


@st.composite
def _invalid(draw: Any) -> tuple[str, list[StoredInputState], list[StoredInputState]]:
    ids = draw(st.permutations(IDS))[: draw(st.integers(1, N_IDS))]
    expected = [_state(i, draw(values)) for i in ids]
    replacements = [_state(i, draw(values)) for i in ids]
    stranger = _state(str(uuid.uuid4()), ("accepted", 0))
    how = draw(st.sampled_from(["count", "dup-expected", "dup-replacement", "id-mismatch"]))
    if how == "count":
        replacements = replacements[:-1]
    elif how == "dup-expected":
        expected, replacements = [*expected, expected[0]], [*replacements, stranger]
    elif how == "dup-replacement":
        expected, replacements = [*expected, stranger], [*replacements, replacements[0]]
    else:
        replacements[-1] = stranger
    return how, expected, replacements


def _check_invalid(
    store: Store,
    runtime_id: str,
    uow: bool,
    case: tuple[str, list[StoredInputState], list[StoredInputState]],
) -> None:
    how, expected, replacements = case
    event(f"invalid: {how}")
    try:
        _call_cas(store, runtime_id, uow, expected, replacements)
    except InvalidInputStateBatchCas:
        return
    raise AssertionError(f"a {how} batch was accepted")


def _persist(store: Store, runtime_id: str, uow: bool, rows: dict[str, tuple[str, int]]) -> None:
    states = [_state(i, v) for i, v in rows.items()]
    if uow:
        with store.write() as unit:
            unit.runtime.persist_input_states_atomically(runtime_id, states)
    else:
        store.runtime.persist_input_states_atomically(runtime_id, states)
