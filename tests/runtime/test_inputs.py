"""Input states and their batch compare-and-swap (spec runtime §2.14–§2.15, §2.22–§2.23).

Seed tests #8 (two adopters, here two spawned processes per round: exactly
one wins, every row holds the winner's value), #9 (a trigger abort on row 2
rolls every row back), #10 (256 rows, then the idempotent retry), #38 (an
unversioned stored row fails loudly); spec §5.2 item 16 (edge cases); bad
input (typed error, nothing changed). Every test runs on SQLite and Postgres.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest

import agentkeep
from agentkeep.errors import InvalidInput, ReadOnlyUnitOfWork
from agentkeep.runtime.domain import (
    MAX_INPUT_STATE_BATCH_CAS,
    InputStatePersistenceRecord,
    StoredInputState,
)
from agentkeep.runtime.errors import InvalidInputStateBatchCas, ReadFailed, WriteFailed
from agentkeep.runtime.inputs import InputStateCasOutcome
from agentkeep.store import Store
from tests.support import count_units

from .support import (
    RT,
    abort_trigger,
    accepted,
    input_bytes,
    race_processes,
    raw_exec,
    recovery_counts,
    replacement_records,
)

SWAPPED = InputStateCasOutcome.SWAPPED
STALE = InputStateCasOutcome.STALE


def _persisted(store: Store, n: int, runtime_id: str = RT) -> list[StoredInputState]:
    states = accepted(n)
    store.runtime.persist_input_states_atomically(runtime_id, states)
    return states


# --------------------------------------------------------------------------
# Persist and load


def test_persist_and_load_round_trip_ordered_by_input_id(store: Store) -> None:
    states = accepted(5)
    store.runtime.persist_input_state(RT, states[0])
    store.runtime.persist_input_states_atomically(
        RT, [InputStatePersistenceRecord.from_machine_snapshot(s) for s in states[1:]]
    )
    loaded = store.runtime.load_input_states(RT)
    assert [s.input_id for s in loaded] == sorted(s.input_id for s in states)
    assert {s.input_id: s for s in loaded} == {s.input_id: s for s in states}
    assert store.runtime.load_input_state(RT, states[2].input_id) == states[2]
    assert store.runtime.load_input_state(RT, str(uuid.uuid4())) is None
    assert store.runtime.load_input_states("runtime-other") == []


def test_persist_is_an_upsert_and_last_writer_wins(store: Store) -> None:
    (st,) = _persisted(store, 1)
    store.runtime.persist_input_state(RT, st.with_recovery_count(3))
    store.runtime.persist_input_states_atomically(
        RT, [st.with_recovery_count(4), st.with_recovery_count(5)]
    )
    assert recovery_counts(store, RT) == {st.input_id: 5}


def test_persist_empty_list_commits(store: Store) -> None:
    store.runtime.persist_input_states_atomically(RT, [])
    with store.write() as uow:
        uow.runtime.persist_input_states_atomically(RT, [])
    assert store.runtime.load_input_states(RT) == []


def test_same_input_id_in_two_runtimes_is_isolated(store: Store) -> None:
    (st,) = accepted(1)
    store.runtime.persist_input_state("runtime-a", st)
    store.runtime.persist_input_state("runtime-b", st.with_recovery_count(7))
    out = store.runtime.compare_and_swap_input_states_atomically(
        "runtime-a", [st], [st.with_recovery_count(1)]
    )
    assert out is SWAPPED
    assert recovery_counts(store, "runtime-a") == {st.input_id: 1}
    assert recovery_counts(store, "runtime-b") == {st.input_id: 7}


def test_persist_rolls_back_every_row_when_one_fails(backend: str, fresh_url: str) -> None:
    """A trigger abort on the third row leaves none of the batch written (both forms)."""
    agentkeep.migrate(fresh_url)
    states = accepted(3)
    with Store.open(fresh_url) as store:
        with abort_trigger(
            fresh_url,
            backend,
            "runtime_input_states",
            "INSERT",
            when_input_id=states[2].input_id,
        ):
            with pytest.raises(WriteFailed, match="test trigger abort"):
                store.runtime.persist_input_states_atomically(RT, states)
            assert store.runtime.load_input_states(RT) == []
            other = accepted(1)[0]
            with store.write() as uow:
                with pytest.raises(WriteFailed):
                    uow.runtime.persist_input_states_atomically(RT, states)
                uow.runtime.persist_input_state(RT, other)  # the unit goes on
            assert store.runtime.load_input_states(RT) == [other]


def test_non_uuid_input_ids_are_refused_before_the_database(store: Store, db_url: str) -> None:
    (good,) = _persisted(store, 1)
    before = input_bytes(db_url, RT)
    bad = StoredInputState(input_id="not-a-uuid", current_state="accepted")
    upper = StoredInputState(input_id=str(uuid.uuid4()).upper(), current_state="accepted")
    for state in (bad, upper):
        with pytest.raises(InvalidInput):
            store.runtime.persist_input_state(RT, state)
        with pytest.raises(InvalidInput):
            store.runtime.persist_input_states_atomically(RT, [good.with_recovery_count(9), state])
        with pytest.raises(InvalidInput):
            store.runtime.compare_and_swap_input_states_atomically(RT, [state], [state])
        with pytest.raises(InvalidInput), store.write() as uow:
            uow.runtime.persist_input_states_atomically(RT, [good.with_recovery_count(9), state])
        with pytest.raises(InvalidInput):
            store.runtime.load_input_state(RT, state.input_id)
    assert input_bytes(db_url, RT) == before


# --------------------------------------------------------------------------
# Fail-closed reads (#38)


def _raw_input(url: str, runtime_id: str, input_id: str, data: Any) -> None:
    raw_exec(
        url,
        "INSERT INTO runtime_input_states (runtime_id, input_id, state_json) "
        "VALUES (:rt, :iid, :data)",
        params={"rt": runtime_id, "iid": input_id, "data": data},
    )


def test_unversioned_input_row_fails_loudly(store: Store, db_url: str) -> None:  # #38
    (good,) = _persisted(store, 1)
    st = StoredInputState.new_accepted()
    obj = json.loads(store.runtime_domain.encode_input_state(st))
    del obj["stored_input_state_version"]
    _raw_input(db_url, RT, st.input_id, json.dumps(obj).encode())
    with pytest.raises(ReadFailed, match="stored_input_state_version"):
        store.runtime.load_input_state(RT, st.input_id)
    with pytest.raises(ReadFailed, match="stored_input_state_version"):
        store.runtime.load_input_states(RT)  # one bad row fails the call
    assert store.runtime.load_input_state(RT, good.input_id) == good


@pytest.mark.parametrize(
    "data",
    [b"not json", b"[]", b'{"stored_input_state_version": 1}'],
    ids=["not-json", "array", "incomplete"],
)
def test_corrupt_input_rows_fail_loudly(store: Store, db_url: str, data: bytes) -> None:
    iid = str(uuid.uuid4())
    _raw_input(db_url, RT, iid, data)
    with pytest.raises(ReadFailed):
        store.runtime.load_input_state(RT, iid)
    with pytest.raises(ReadFailed):
        store.runtime.load_input_states(RT)


def test_input_row_holding_another_inputs_payload_fails_loudly(store: Store, db_url: str) -> None:
    st = StoredInputState.new_accepted()
    key = str(uuid.uuid4())
    _raw_input(db_url, RT, key, store.runtime_domain.encode_input_state(st))
    with pytest.raises(ReadFailed, match=st.input_id):
        store.runtime.load_input_state(RT, key)


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_sqlite_integer_in_payload_column_fails_loudly(store: Store, db_url: str) -> None:
    (st,) = _persisted(store, 1)
    raw_exec(db_url, "UPDATE runtime_input_states SET state_json = 42")
    with pytest.raises(ReadFailed, match="state_json"):
        store.runtime.load_input_states(RT)
    with pytest.raises(ReadFailed, match="state_json"):
        store.runtime.compare_and_swap_input_states_atomically(
            RT, [st], [st.with_recovery_count(1)]
        )


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_sqlite_text_degraded_rows_read_and_swap(store: Store, db_url: str) -> None:
    states = _persisted(store, 2)
    raw_exec(db_url, "UPDATE runtime_input_states SET state_json = CAST(state_json AS TEXT)")
    assert all(isinstance(v, str) for v in input_bytes(db_url, RT).values())
    assert {s.input_id: s for s in store.runtime.load_input_states(RT)} == {
        s.input_id: s for s in states
    }
    out = store.runtime.compare_and_swap_input_states_atomically(
        RT, states, replacement_records(states, 1)
    )
    assert out is SWAPPED  # app-side comparison after normalisation
    assert set(recovery_counts(store, RT).values()) == {1}
    assert all(isinstance(v, bytes) for v in input_bytes(db_url, RT).values())


# --------------------------------------------------------------------------
# Batch CAS: seed tests #9, #10 and spec §5.2 item 16


def test_cas_swaps_when_every_row_is_expected(store: Store) -> None:
    states = _persisted(store, 4)
    out = store.runtime.compare_and_swap_input_states_atomically(
        RT, states, list(reversed(replacement_records(states, 2)))
    )
    assert out is SWAPPED
    assert set(recovery_counts(store, RT).values()) == {2}
    with store.write() as uow:
        out = uow.runtime.compare_and_swap_input_states_atomically(
            RT, [s.with_recovery_count(2) for s in states], replacement_records(states, 3)
        )
    assert out is SWAPPED
    assert set(recovery_counts(store, RT).values()) == {3}


def test_cas_write_fault_rolls_back_every_row(backend: str, fresh_url: str) -> None:  # #9
    agentkeep.migrate(fresh_url)
    with Store.open(fresh_url) as store:
        states = _persisted(store, 3)
        before = input_bytes(fresh_url, RT)
        with abort_trigger(
            fresh_url,
            backend,
            "runtime_input_states",
            "UPDATE",
            when_input_id=states[1].input_id,
        ):
            with pytest.raises(WriteFailed, match="test trigger abort"):
                store.runtime.compare_and_swap_input_states_atomically(
                    RT, states, replacement_records(states, 9)
                )
            assert recovery_counts(store, RT) == {s.input_id: 0 for s in states}
            # Inside a caller's unit: the failed batch leaves nothing, the unit goes on.
            extra = accepted(1)[0]
            with store.write() as uow:
                with pytest.raises(WriteFailed, match="test trigger abort"):
                    uow.runtime.compare_and_swap_input_states_atomically(
                        RT, states, replacement_records(states, 9)
                    )
                uow.runtime.persist_input_state(RT, extra)
        after = input_bytes(fresh_url, RT)
        assert {k: after[k] for k in before} == before
        assert set(after) == set(before) | {extra.input_id}


def test_cas_accepts_256_rows_and_the_retry_is_swapped(backend: str, fresh_url: str) -> None:  # #10
    agentkeep.migrate(fresh_url)
    with Store.open(fresh_url) as store:
        states = _persisted(store, MAX_INPUT_STATE_BATCH_CAS)
        repl = replacement_records(states, 7)
        assert store.runtime.compare_and_swap_input_states_atomically(RT, states, repl) is SWAPPED
        assert set(recovery_counts(store, RT).values()) == {7}
        # The retry after a lost acknowledgement: SWAPPED, and it writes nothing
        # (an UPDATE would hit the trigger).
        with abort_trigger(fresh_url, backend, "runtime_input_states", "UPDATE"):
            assert (
                store.runtime.compare_and_swap_input_states_atomically(RT, states, repl) is SWAPPED
            )
        assert len(recovery_counts(store, RT)) == MAX_INPUT_STATE_BATCH_CAS
        assert set(recovery_counts(store, RT).values()) == {7}


def test_cas_expected_equal_to_replacement_is_swapped_without_write(
    backend: str, fresh_url: str
) -> None:
    agentkeep.migrate(fresh_url)
    with Store.open(fresh_url) as store:
        states = _persisted(store, 3)
        with abort_trigger(fresh_url, backend, "runtime_input_states", "UPDATE"):
            out = store.runtime.compare_and_swap_input_states_atomically(RT, states, states)
            assert out is SWAPPED
            # A real swap under the same trigger fails: the test can tell a write.
            with pytest.raises(WriteFailed):
                store.runtime.compare_and_swap_input_states_atomically(
                    RT, states, replacement_records(states, 1)
                )


def test_empty_batch_is_swapped_without_touching_the_database(store: Store) -> None:
    checkouts = count_units(store)
    assert store.runtime.compare_and_swap_input_states_atomically(RT, [], []) is SWAPPED
    assert checkouts[0] == 0
    # The repository form takes no write lock either: it works in a read unit.
    with store.read() as uow:
        assert uow.runtime.compare_and_swap_input_states_atomically(RT, [], []) is SWAPPED
        one = accepted(1)
        with pytest.raises(ReadOnlyUnitOfWork):
            uow.runtime.compare_and_swap_input_states_atomically(
                RT, one, replacement_records(one, 1)
            )


def test_invalid_batch_is_refused_before_the_database(store: Store, db_url: str) -> None:
    states = _persisted(store, 3)
    before = input_bytes(db_url, RT)
    checkouts = count_units(store)
    too_many = accepted(MAX_INPUT_STATE_BATCH_CAS + 1)
    stranger = accepted(1)[0]
    cases = [
        (states, replacement_records(states[:2], 1)),  # count mismatch
        (states[:2], replacement_records(states, 1)),
        (too_many, replacement_records(too_many, 1)),  # 257 rows
        ([states[0], states[0]], replacement_records([states[0], states[1]], 1)),  # dup expected
        (states[:2], replacement_records([states[0], states[0]], 1)),  # dup replacement
        (states[:2], replacement_records([states[0], stranger], 1)),  # id sets differ
    ]
    for expected, repl in cases:
        with pytest.raises(InvalidInputStateBatchCas):
            store.runtime.compare_and_swap_input_states_atomically(RT, expected, repl)
    assert checkouts[0] == 0
    for expected, repl in cases:
        with pytest.raises(InvalidInputStateBatchCas), store.write() as uow:
            uow.runtime.compare_and_swap_input_states_atomically(RT, expected, repl)
    assert input_bytes(db_url, RT) == before


def test_missing_row_is_stale_even_when_the_others_match(store: Store, db_url: str) -> None:
    states = _persisted(store, 3)
    ghost = accepted(1)[0]
    before = input_bytes(db_url, RT)
    for expected in ([ghost, *states], [*states, ghost]):
        out = store.runtime.compare_and_swap_input_states_atomically(
            RT, expected, replacement_records(expected, 1)
        )
        assert out is STALE
    assert input_bytes(db_url, RT) == before


def test_stale_expected_changes_nothing(store: Store, db_url: str) -> None:
    states = _persisted(store, 3)
    before = input_bytes(db_url, RT)
    stale = [states[0], states[1].with_recovery_count(5), states[2]]
    out = store.runtime.compare_and_swap_input_states_atomically(
        RT, stale, replacement_records(states, 1)
    )
    assert out is STALE
    assert input_bytes(db_url, RT) == before


def test_mixed_partial_state_is_stale(store: Store, db_url: str) -> None:
    states = _persisted(store, 4)
    # Half of the rows already hold the replacement.
    store.runtime.persist_input_states_atomically(RT, replacement_records(states[:2], 1))
    before = input_bytes(db_url, RT)
    out = store.runtime.compare_and_swap_input_states_atomically(
        RT, states, replacement_records(states, 1)
    )
    assert out is STALE
    assert input_bytes(db_url, RT) == before


# --------------------------------------------------------------------------
# Seed test #8: two adopters in separate processes


@pytest.mark.slow
def test_two_process_adopters_exactly_one_wins(store: Store, db_url: str) -> None:  # #8
    rounds = []
    for n in range(6):
        runtime_id = f"runtime-race-{n}"
        rounds.append((runtime_id, _persisted(store, 8, runtime_id)))
    results = race_processes(db_url, "body_input_cas", 2, {"rounds": rounds})
    for n, (runtime_id, expected) in enumerate(rounds):
        outcomes = [results[0][n], results[1][n]]
        assert sorted(outcomes) == sorted([str(SWAPPED), str(STALE)]), outcomes
        winner_rc = outcomes.index(str(SWAPPED)) + 1
        assert recovery_counts(store, runtime_id) == {s.input_id: winner_rc for s in expected}
