"""Machine lifecycle records (spec runtime §1.4, §2.24–§2.25, §3.7).

Seed tests #24 (commit persists the lifecycle and the inputs), #31 and #32
(legacy bare-string and unversioned rows are not lifecycle authority:
ReadFailed, never a state), plus the all-or-nothing of
``commit_machine_lifecycle`` and bad input. Every test runs on SQLite and
Postgres.
"""

from __future__ import annotations

import json

import pytest

import agentkeep
from agentkeep.errors import InvalidInput, ReadOnlyUnitOfWork
from agentkeep.runtime.domain import (
    InputStatePersistenceRecord,
    MachineLifecycleCommit,
    RuntimeBinding,
    StoredInputState,
    SupervisorAuthority,
)
from agentkeep.runtime.errors import ReadFailed, WriteFailed
from agentkeep.store import Store

from .builders import unversioned_lifecycle
from .support import RT, abort_trigger, accepted, raw_exec, raw_rows

SQLITE_BINDING = RuntimeBinding(
    agent_runtime_id="rt:session:sqlite",
    fence_token=11,
    runtime_generation=None,
    runtime_epoch_id="epoch-sqlite",
)


def _lifecycle_rows(url: str) -> list[tuple[object, ...]]:
    return raw_rows(url, "SELECT runtime_id, runtime_state_json FROM runtime_states")


def test_commit_machine_lifecycle_persists_both_parts(store: Store) -> None:  # #24
    commit = MachineLifecycleCommit(
        runtime_state="stopped",
        binding=SQLITE_BINDING,
        supervisor_authority=SupervisorAuthority(kind="unbound_no_receipt"),
    )
    (st,) = accepted(1)
    store.runtime.commit_machine_lifecycle(
        RT, commit, [InputStatePersistenceRecord.from_machine_snapshot(st)]
    )
    assert store.runtime.load_runtime_state(RT) == "stopped"
    lifecycle = store.runtime.load_machine_lifecycle(RT)
    assert lifecycle is not None
    assert lifecycle.runtime_state == "stopped"
    assert lifecycle.binding == SQLITE_BINDING
    assert lifecycle == commit
    assert store.runtime.load_input_states(RT) == [st]
    assert store.runtime.load_machine_lifecycle_record(RT) == store.runtime_domain.encode_lifecycle(
        commit
    )


def test_absent_lifecycle_loads_as_none(store: Store) -> None:
    assert store.runtime.load_machine_lifecycle_record(RT) is None
    assert store.runtime.load_machine_lifecycle(RT) is None
    assert store.runtime.load_runtime_state(RT) is None
    with store.read() as uow:
        assert uow.runtime.load_runtime_state(RT) is None


def test_commit_machine_lifecycle_overwrites_and_keeps_runtimes_apart(store: Store) -> None:
    store.runtime.commit_machine_lifecycle(RT, MachineLifecycleCommit(runtime_state="idle"))
    store.runtime.commit_machine_lifecycle(
        "runtime-b", MachineLifecycleCommit(runtime_state="idle")
    )
    with store.write() as uow:
        uow.runtime.commit_machine_lifecycle(
            RT, MachineLifecycleCommit(runtime_state="retired", binding=SQLITE_BINDING)
        )
    assert store.runtime.load_runtime_state(RT) == "retired"
    assert store.runtime.load_runtime_state("runtime-b") == "idle"
    assert store.runtime.load_input_states(RT) == []


def test_legacy_bare_string_row_is_not_lifecycle_authority(
    store: Store, db_url: str
) -> None:  # #31
    raw_exec(
        db_url,
        "INSERT INTO runtime_states (runtime_id, runtime_state_json) VALUES (:rt, :data)",
        params={"rt": RT, "data": b'"retired"'},
    )
    with pytest.raises(ReadFailed):
        store.runtime.load_runtime_state(RT)
    with pytest.raises(ReadFailed):
        store.runtime.load_machine_lifecycle(RT)
    assert store.runtime.load_machine_lifecycle_record(RT) == b'"retired"'  # raw, undecoded


def test_unversioned_lifecycle_object_is_not_lifecycle_authority(
    store: Store, db_url: str
) -> None:  # #32
    legacy = unversioned_lifecycle()
    raw_exec(
        db_url,
        "INSERT INTO runtime_states (runtime_id, runtime_state_json) VALUES (:rt, :data)",
        params={"rt": RT, "data": json.dumps(legacy).encode()},
    )
    with pytest.raises(ReadFailed, match="record_version"):
        store.runtime.load_runtime_state(RT)
    with pytest.raises(ReadFailed, match="record_version"):
        store.runtime.load_machine_lifecycle(RT)


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_sqlite_text_degraded_lifecycle_row_still_reads(store: Store, db_url: str) -> None:
    commit = MachineLifecycleCommit(runtime_state="idle", binding=SQLITE_BINDING)
    store.runtime.commit_machine_lifecycle(RT, commit)
    raw_exec(
        db_url, "UPDATE runtime_states SET runtime_state_json = CAST(runtime_state_json AS TEXT)"
    )
    assert isinstance(_lifecycle_rows(db_url)[0][1], str)
    assert store.runtime.load_machine_lifecycle(RT) == commit
    assert store.runtime.load_machine_lifecycle_record(RT) == store.runtime_domain.encode_lifecycle(
        commit
    )


def test_commit_machine_lifecycle_is_all_or_nothing(backend: str, fresh_url: str) -> None:
    """An input upsert that fails after the lifecycle upsert leaves neither (both forms)."""
    agentkeep.migrate(fresh_url)
    states = accepted(2)
    with Store.open(fresh_url) as store:
        with abort_trigger(
            fresh_url, backend, "runtime_input_states", "INSERT", when_input_id=states[1].input_id
        ):
            with pytest.raises(WriteFailed, match="test trigger abort"):
                store.runtime.commit_machine_lifecycle(
                    RT, MachineLifecycleCommit(runtime_state="stopped"), states
                )
            assert _lifecycle_rows(fresh_url) == []
            assert store.runtime.load_input_states(RT) == []
            with store.write() as uow:
                with pytest.raises(WriteFailed):
                    uow.runtime.commit_machine_lifecycle(
                        RT, MachineLifecycleCommit(runtime_state="stopped"), states
                    )
                uow.runtime.persist_input_state(RT, states[0])  # the unit goes on
        assert _lifecycle_rows(fresh_url) == []
        assert store.runtime.load_input_states(RT) == [states[0]]


def test_commit_machine_lifecycle_refuses_bad_input_ids(store: Store, db_url: str) -> None:
    bad = StoredInputState(input_id="input-1", current_state="accepted")
    with pytest.raises(InvalidInput):
        store.runtime.commit_machine_lifecycle(
            RT, MachineLifecycleCommit(runtime_state="idle"), [bad]
        )
    with pytest.raises(InvalidInput), store.write() as uow:
        uow.runtime.commit_machine_lifecycle(
            RT, MachineLifecycleCommit(runtime_state="idle"), [bad]
        )
    assert _lifecycle_rows(db_url) == []


def test_lifecycle_writes_need_a_write_unit(store: Store) -> None:
    with store.read() as uow, pytest.raises(ReadOnlyUnitOfWork):
        uow.runtime.commit_machine_lifecycle(RT, MachineLifecycleCommit(runtime_state="idle"))
