"""Unregister finalization: atomic commit, power cuts, uncertain commits (spec runtime §2.26).

Seed tests #26 (power cuts 1/2 roll back, a lost acknowledgement 3 is Ok,
retries converge, the retired epoch is fenced forever), #27 (an old-epoch
finalizer keeps a newer epoch's ops row), #28 (lifecycle, inputs and the ops
delete commit together), #29 (a ``BEFORE DELETE`` trigger on the ops table
rolls everything back), spec §5.2 items 7 (the re-observation matches neither
state, or fails: OutcomeUnknown) and 8 (a COMMIT that failed with nothing
durable: plain WriteFailed), idempotent retries, and invariants I6 (retired
epochs are permanent) and I7 (never a final lifecycle beside the retired
epoch's ops row). Every test runs on SQLite and Postgres.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

import agentkeep
from agentkeep.errors import InvalidInput
from agentkeep.runtime import (
    FaultHook,
    FinalizationPoint,
    InputStatePersistenceRecord,
    MachineLifecycleCommit,
    OpsSnapshot,
    RuntimeBinding,
    RuntimeState,
    StoredInputState,
    UnregisterFinalizationCommit,
    issue_delete_ops_finalization_authority,
    synthetic_fault,
)
from agentkeep.runtime.errors import (
    OpsLifecycleEpochRetired,
    ReadFailed,
    UnregisterFinalizationOutcomeUnknown,
    WriteFailed,
)
from agentkeep.store import Store

from .support import RT, abort_trigger, raw_exec, raw_rows

EPOCH = "epoch-e"
NEITHER = "match neither final nor pre-transaction authority"


def _finalization(
    state: RuntimeState = "idle",
    inputs: tuple[StoredInputState, ...] = (),
    epoch: str = EPOCH,
    binding: RuntimeBinding | None = None,
) -> UnregisterFinalizationCommit:
    lifecycle = MachineLifecycleCommit(
        runtime_state=state, binding=binding or RuntimeBinding.unbound()
    )
    return UnregisterFinalizationCommit(
        lifecycle=lifecycle,
        input_states=tuple(InputStatePersistenceRecord.from_machine_snapshot(s) for s in inputs),
        retired_ops_epoch=epoch,
        authority=issue_delete_ops_finalization_authority(),
    )


def _retired(url: str, runtime_id: str = RT) -> list[str]:
    rows = raw_rows(
        url,
        "SELECT epoch_id FROM runtime_retired_ops_epochs WHERE runtime_id = :rt ORDER BY epoch_id",
        {"rt": runtime_id},
    )
    return [str(r[0]) for r in rows]


def _facts(store: Store, url: str, runtime_id: str = RT) -> tuple[object, ...]:
    """Everything a finalization may touch, as stored."""
    return (
        store.runtime.load_machine_lifecycle_record(runtime_id),
        sorted((s.input_id, s.recovery_count) for s in store.runtime.load_input_states(runtime_id)),
        store.runtime.load_ops_lifecycle(runtime_id),
        _retired(url, runtime_id),
    )


def _assert_no_split(
    store: Store, runtime_id: str, final: MachineLifecycleCommit, epoch: str
) -> None:
    """I7: the final lifecycle never coexists with the retired epoch's ops row."""
    ops = store.runtime.load_ops_lifecycle(runtime_id)
    if store.runtime.load_machine_lifecycle(runtime_id) == final:
        assert ops is None or ops.epoch_id != epoch


def _hook(**actions: Callable[[], None]) -> FaultHook:
    """A hook running ``actions[point.name.lower()]`` at that point (each at most once)."""
    pending = dict(actions)

    def hook(point: FinalizationPoint) -> None:
        action = pending.pop(point.name.lower(), None)
        if action is not None:
            action()

    return hook


def _raise(message: str) -> Callable[[], None]:
    def action() -> None:
        raise RuntimeError(message)

    return action


# --------------------------------------------------------------------------
# Seed tests #26 – #29


@pytest.mark.parametrize("fault", [1, 2, 3])
def test_power_cuts_reopen_without_split_epoch_truth(db_url: str, fault: int) -> None:  # #26
    rt = f"runtime-fault-{fault}"
    binding = RuntimeBinding(
        agent_runtime_id=f"rt:session:fault-{fault}",
        fence_token=1,
        runtime_generation=1,
        runtime_epoch_id=f"epoch-{fault}",
    )
    idle = MachineLifecycleCommit(runtime_state="idle", binding=binding)
    ops = OpsSnapshot(epoch_id=EPOCH, payload={"fault": fault})
    fin = _finalization("stopped")
    with Store.open(db_url) as store:
        store.runtime.commit_machine_lifecycle(rt, idle)
        store.runtime.persist_ops_lifecycle(rt, ops)
        if fault == 3:
            store.runtime.commit_unregister_finalization(rt, fin, fault_hook=synthetic_fault(3))
        else:
            with pytest.raises(WriteFailed, match="synthetic") as err:
                store.runtime.commit_unregister_finalization(
                    rt, fin, fault_hook=synthetic_fault(fault)
                )
            assert type(err.value) is WriteFailed
    with Store.open(db_url) as store:
        if fault == 3:
            assert store.runtime.load_runtime_state(rt) == "stopped"
            assert store.runtime.load_ops_lifecycle(rt) is None
            assert _retired(db_url, rt) == [EPOCH]
        else:
            assert store.runtime.load_machine_lifecycle(rt) == idle
            assert store.runtime.load_ops_lifecycle(rt) == ops
            assert _retired(db_url, rt) == []
        _assert_no_split(store, rt, fin.lifecycle, EPOCH)
        store.runtime.commit_unregister_finalization(rt, fin)  # the retry converges
    with Store.open(db_url) as store:
        assert store.runtime.load_runtime_state(rt) == "stopped"
        assert store.runtime.load_ops_lifecycle(rt) is None
        with pytest.raises(OpsLifecycleEpochRetired) as retired:
            store.runtime.persist_ops_lifecycle(rt, OpsSnapshot(epoch_id=EPOCH))
        assert (retired.value.runtime_id, retired.value.epoch_id) == (rt, EPOCH)
        with pytest.raises(OpsLifecycleEpochRetired) as retired:
            store.runtime.initialize_ops_lifecycle_if_absent(rt, OpsSnapshot(epoch_id=EPOCH))
        assert retired.value.epoch_id == EPOCH
        assert store.runtime.load_ops_lifecycle(rt) is None


def test_delayed_old_epoch_finalizer_preserves_new_epoch(db_url: str) -> None:  # #27
    new = OpsSnapshot(epoch_id="epoch-new", payload={"n": 1})
    with Store.open(db_url) as store:
        store.runtime.persist_ops_lifecycle(RT, OpsSnapshot(epoch_id="epoch-old"))
        store.runtime.persist_ops_lifecycle(RT, new)
        store.runtime.commit_unregister_finalization(
            RT, _finalization("stopped", epoch="epoch-old"), fault_hook=synthetic_fault(3)
        )
    with Store.open(db_url) as store:
        assert store.runtime.load_ops_lifecycle(RT) == new
        assert _retired(db_url) == ["epoch-old"]
        with pytest.raises(OpsLifecycleEpochRetired):
            store.runtime.persist_ops_lifecycle(RT, OpsSnapshot(epoch_id="epoch-old"))
        assert store.runtime.load_ops_lifecycle(RT) == new
        store.runtime.persist_ops_lifecycle(RT, OpsSnapshot(epoch_id="epoch-new", payload=2))
        assert store.runtime.load_ops_lifecycle(RT) == OpsSnapshot(epoch_id="epoch-new", payload=2)


def test_commits_lifecycle_inputs_and_ops_delete_together(store: Store, db_url: str) -> None:  # #28
    store.runtime.persist_ops_lifecycle(RT, OpsSnapshot(epoch_id=EPOCH))
    store.runtime.persist_ops_lifecycle("runtime-b", OpsSnapshot(epoch_id=EPOCH))
    state = StoredInputState.new_accepted()
    fin = _finalization("idle", (state,))
    store.runtime.commit_unregister_finalization(RT, fin)
    lifecycle = store.runtime.load_machine_lifecycle(RT)
    assert lifecycle is not None
    assert lifecycle.runtime_state == "idle"
    assert lifecycle.binding == RuntimeBinding.unbound()
    assert store.runtime.load_input_states(RT) == [state]
    assert store.runtime.load_ops_lifecycle(RT) is None
    assert _retired(db_url) == [EPOCH]
    # Another runtime's ops row of the same epoch name is untouched.
    assert store.runtime.load_ops_lifecycle("runtime-b") == OpsSnapshot(epoch_id=EPOCH)
    assert _retired(db_url, "runtime-b") == []


def test_rolls_back_lifecycle_and_inputs_when_ops_delete_fails(
    backend: str, fresh_url: str
) -> None:  # #29
    agentkeep.migrate(fresh_url)
    with Store.open(fresh_url) as store:
        ops = OpsSnapshot(epoch_id=EPOCH, payload="keep")
        store.runtime.persist_ops_lifecycle(RT, ops)
        fin = _finalization("idle", (StoredInputState.new_accepted(),))
        with abort_trigger(fresh_url, backend, "runtime_ops_lifecycle", "DELETE"):
            with pytest.raises(WriteFailed, match="test trigger abort"):
                store.runtime.commit_unregister_finalization(RT, fin)
            assert store.runtime.load_machine_lifecycle_record(RT) is None
            assert store.runtime.load_input_states(RT) == []
            assert store.runtime.load_ops_lifecycle(RT) == ops
            assert _retired(fresh_url) == []
        store.runtime.commit_unregister_finalization(RT, fin)  # trigger gone: converges
        assert store.runtime.load_ops_lifecycle(RT) is None
        assert len(store.runtime.load_input_states(RT)) == 1


# --------------------------------------------------------------------------
# §5.2 items 7 and 8: uncertain commits


def _seed_idle_with_ops(store: Store) -> MachineLifecycleCommit:
    idle = MachineLifecycleCommit(runtime_state="idle")
    store.runtime.commit_machine_lifecycle(RT, idle)
    store.runtime.persist_ops_lifecycle(RT, OpsSnapshot(epoch_id=EPOCH))
    return idle


def test_commit_error_with_nothing_durable_is_write_failed(store: Store, db_url: str) -> None:
    _seed_idle_with_ops(store)
    before = _facts(store, db_url)
    fin = _finalization("stopped", (StoredInputState.new_accepted(),))
    hook = _hook(before_commit=_raise("connection reset during COMMIT"))
    with pytest.raises(WriteFailed) as err:
        store.runtime.commit_unregister_finalization(RT, fin, fault_hook=hook)
    assert type(err.value) is WriteFailed  # not OutcomeUnknown: the re-read shows "before"
    assert err.value.message == "connection reset during COMMIT"
    assert _facts(store, db_url) == before
    store.runtime.commit_unregister_finalization(RT, fin)
    assert store.runtime.load_runtime_state(RT) == "stopped"
    assert store.runtime.load_ops_lifecycle(RT) is None


@pytest.mark.parametrize("ack", ["before_commit", "after_commit"])
def test_reobservation_matching_neither_state_is_outcome_unknown(
    store: Store, db_url: str, ack: str
) -> None:
    _seed_idle_with_ops(store)
    fin = _finalization("stopped", (StoredInputState.new_accepted(),))
    intruder = MachineLifecycleCommit(runtime_state="retired")

    def change_lifecycle_elsewhere() -> None:
        with Store.open(db_url) as other:
            other.runtime.commit_machine_lifecycle(RT, intruder)

    hook = _hook(**{ack: _raise("lost ack"), "before_reobserve": change_lifecycle_elsewhere})
    with pytest.raises(UnregisterFinalizationOutcomeUnknown) as err:
        store.runtime.commit_unregister_finalization(RT, fin, fault_hook=hook)
    assert NEITHER in str(err.value)
    assert "commit acknowledgement failed (lost ack)" in str(err.value)
    assert store.runtime.load_machine_lifecycle(RT) == intruder
    durable = ack == "after_commit"
    assert (store.runtime.load_ops_lifecycle(RT) is None) is durable
    assert _retired(db_url) == ([EPOCH] if durable else [])
    assert len(store.runtime.load_input_states(RT)) == (1 if durable else 0)
    store.runtime.commit_unregister_finalization(RT, fin)  # the prescribed retry converges
    assert store.runtime.load_machine_lifecycle(RT) == fin.lifecycle
    assert store.runtime.load_ops_lifecycle(RT) is None


@pytest.mark.parametrize("ack", ["before_commit", "after_commit"])
def test_failed_reobservation_is_outcome_unknown(store: Store, db_url: str, ack: str) -> None:
    idle = _seed_idle_with_ops(store)
    fin = _finalization("stopped")
    hook = _hook(**{ack: _raise("lost ack"), "before_reobserve": _raise("disk unplugged")})
    with pytest.raises(UnregisterFinalizationOutcomeUnknown) as err:
        store.runtime.commit_unregister_finalization(RT, fin, fault_hook=hook)
    assert (
        "commit acknowledgement failed (lost ack); durable outcome read failed: disk unplugged"
        in str(err.value)
    )
    durable = ack == "after_commit"
    assert store.runtime.load_machine_lifecycle(RT) == (fin.lifecycle if durable else idle)
    assert (store.runtime.load_ops_lifecycle(RT) is None) is durable
    _assert_no_split(store, RT, fin.lifecycle, EPOCH)
    store.runtime.commit_unregister_finalization(RT, fin)
    assert store.runtime.load_machine_lifecycle(RT) == fin.lifecycle
    assert store.runtime.load_ops_lifecycle(RT) is None


def test_real_read_failure_on_reobservation_is_outcome_unknown(fresh_url: str) -> None:
    agentkeep.migrate(fresh_url)
    with Store.open(fresh_url) as store:
        idle = _seed_idle_with_ops(store)
        hide = "ALTER TABLE runtime_states RENAME TO runtime_states_hidden"
        hook = _hook(
            before_commit=_raise("commit timed out"),
            before_reobserve=lambda: raw_exec(fresh_url, hide),
        )
        fin = _finalization("stopped")
        try:
            with pytest.raises(UnregisterFinalizationOutcomeUnknown) as err:
                store.runtime.commit_unregister_finalization(RT, fin, fault_hook=hook)
        finally:
            raw_exec(fresh_url, "ALTER TABLE runtime_states_hidden RENAME TO runtime_states")
        assert "durable outcome read failed: Store read failed" in str(err.value)
        assert isinstance(err.value.__cause__, ReadFailed)
        assert store.runtime.load_machine_lifecycle(RT) == idle  # the COMMIT never happened
        assert store.runtime.load_ops_lifecycle(RT) == OpsSnapshot(epoch_id=EPOCH)


# --------------------------------------------------------------------------
# Idempotency


def test_idempotent_retries_converge(store: Store, db_url: str) -> None:
    _seed_idle_with_ops(store)
    state = StoredInputState.new_accepted()
    fin = _finalization("stopped", (state,))
    with pytest.raises(WriteFailed, match="synthetic power cut after unregister lifecycle write"):
        store.runtime.commit_unregister_finalization(RT, fin, fault_hook=synthetic_fault(1))
    store.runtime.commit_unregister_finalization(RT, fin)
    after = _facts(store, db_url)
    store.runtime.commit_unregister_finalization(RT, fin)  # again after a durable commit
    assert _facts(store, db_url) == after
    # A retry whose "before" already is final: a failed or unacknowledged COMMIT is Ok,
    # because the re-read equals the final state (checked before "equals before").
    store.runtime.commit_unregister_finalization(
        RT, fin, fault_hook=_hook(before_commit=_raise("commit failed"))
    )
    store.runtime.commit_unregister_finalization(RT, fin, fault_hook=synthetic_fault(3))
    assert _facts(store, db_url) == after
    assert after[0] == store.runtime_domain.encode_lifecycle(fin.lifecycle)
    assert store.runtime.load_input_states(RT) == [state]
    assert after[2:] == (None, [EPOCH])


def test_undecodable_ops_row_refuses_without_writes(store: Store, db_url: str) -> None:
    raw_exec(
        db_url,
        "INSERT INTO runtime_ops_lifecycle (runtime_id, state_json) VALUES (:rt, :data)",
        params={"rt": RT, "data": b'{"epoch_id": 7}'},
    )
    with pytest.raises(ReadFailed, match="failed to decode ops epoch before unregister"):
        store.runtime.commit_unregister_finalization(
            RT, _finalization("stopped", (StoredInputState.new_accepted(),))
        )
    assert store.runtime.load_machine_lifecycle_record(RT) is None
    assert store.runtime.load_input_states(RT) == []
    assert _retired(db_url) == []
    rows = raw_rows(db_url, "SELECT state_json FROM runtime_ops_lifecycle")
    assert [bytes(r[0]) if not isinstance(r[0], str) else r[0].encode() for r in rows] == [
        b'{"epoch_id": 7}'
    ]


def test_bad_finalization_values_are_refused(store: Store, db_url: str) -> None:
    _seed_idle_with_ops(store)
    before = _facts(store, db_url)
    state = StoredInputState.new_accepted()
    with pytest.raises(InvalidInput, match="retired_ops_epoch"):
        _finalization("stopped", epoch="")
    with pytest.raises(InvalidInput, match="input_states"):
        _finalization("stopped", (state, state))
    with pytest.raises(InvalidInput, match="authority"):
        UnregisterFinalizationCommit(
            lifecycle=MachineLifecycleCommit(runtime_state="stopped"),
            input_states=(),
            retired_ops_epoch=EPOCH,
            authority=object(),  # type: ignore[arg-type]
        )
    assert _facts(store, db_url) == before


# --------------------------------------------------------------------------
# I6 and I7


def test_retired_epochs_are_permanent(store: Store, db_url: str) -> None:  # I6
    _seed_idle_with_ops(store)
    store.runtime.commit_unregister_finalization(RT, _finalization("stopped"))
    # Nothing an API caller does afterwards removes the marker or revives the epoch.
    store.runtime.persist_ops_lifecycle(RT, OpsSnapshot(epoch_id="epoch-2"))
    store.runtime.delete_ops_lifecycle(RT)
    store.runtime.commit_machine_lifecycle(RT, MachineLifecycleCommit(runtime_state="idle"))
    store.runtime.commit_unregister_finalization(RT, _finalization("stopped", epoch="epoch-2"))
    store.runtime.commit_unregister_finalization(RT, _finalization("idle", epoch=EPOCH))
    assert _retired(db_url) == ["epoch-2", EPOCH]
    for epoch in (EPOCH, "epoch-2"):
        with pytest.raises(OpsLifecycleEpochRetired):
            store.runtime.persist_ops_lifecycle(RT, OpsSnapshot(epoch_id=epoch))
        with pytest.raises(OpsLifecycleEpochRetired):
            store.runtime.initialize_ops_lifecycle_if_absent(RT, OpsSnapshot(epoch_id=epoch))
        with pytest.raises(OpsLifecycleEpochRetired), store.write() as uow:
            uow.runtime.persist_ops_lifecycle(RT, OpsSnapshot(epoch_id=epoch))
    assert store.runtime.load_ops_lifecycle(RT) is None
    store.close()
    with Store.open(db_url) as reopened:
        with pytest.raises(OpsLifecycleEpochRetired):
            reopened.runtime.persist_ops_lifecycle(RT, OpsSnapshot(epoch_id=EPOCH))
    assert _retired(db_url) == ["epoch-2", EPOCH]


_OUTCOMES: dict[str, Callable[[], FaultHook | None]] = {
    "ok": lambda: None,
    "power-cut-1": lambda: synthetic_fault(1),
    "power-cut-2": lambda: synthetic_fault(2),
    "lost-ack-3": lambda: synthetic_fault(3),
    "commit-failed": lambda: _hook(before_commit=_raise("commit failed")),
    "lost-ack-unreadable": lambda: _hook(
        after_commit=_raise("lost ack"), before_reobserve=_raise("unreadable")
    ),
    "failed-unreadable": lambda: _hook(
        before_commit=_raise("commit failed"), before_reobserve=_raise("unreadable")
    ),
}


@pytest.mark.parametrize("outcome", sorted(_OUTCOMES))
def test_no_split_unregister_whatever_the_outcome(db_url: str, outcome: str) -> None:  # I7
    with Store.open(db_url) as store:
        _seed_idle_with_ops(store)
        fin = _finalization("stopped", (StoredInputState.new_accepted(),))
        try:
            store.runtime.commit_unregister_finalization(RT, fin, fault_hook=_OUTCOMES[outcome]())
        except (WriteFailed, UnregisterFinalizationOutcomeUnknown):
            pass
        _assert_no_split(store, RT, fin.lifecycle, EPOCH)
        lifecycle = store.runtime.load_machine_lifecycle(RT)
        ops = store.runtime.load_ops_lifecycle(RT)
        retired = _retired(db_url)
        # All four facts moved together: all final, or all as before.
        if lifecycle == fin.lifecycle:
            assert (ops, retired, len(store.runtime.load_input_states(RT))) == (None, [EPOCH], 1)
        else:
            assert lifecycle == MachineLifecycleCommit(runtime_state="idle")
            assert (ops, retired) == (OpsSnapshot(epoch_id=EPOCH), [])
            assert store.runtime.load_input_states(RT) == []
