"""Ops-lifecycle snapshots and the retired-epoch fence (spec runtime §1.5–§1.6, §2.27–§2.30).

Seed test #25 (concurrent initializers return one canonical snapshot; here
four spawned processes with distinct epochs, over several runtimes), spec
§5.2 item 17 (a stored snapshot of a retired epoch refuses a fresh candidate,
naming the stored epoch), the persist fence, delete without retirement, and
fail-closed loads. Retired epochs are inserted directly (unregister
finalization, which writes them, is tested elsewhere). Every test runs on
SQLite and Postgres.
"""

from __future__ import annotations

from typing import Any

import pytest

from agentkeep.errors import ReadOnlyUnitOfWork
from agentkeep.runtime.domain import OpsSnapshot
from agentkeep.runtime.errors import OpsLifecycleEpochRetired, ReadFailed, WriteFailed
from agentkeep.store import Store

from .support import RT, race_processes, raw_exec, raw_rows


def _retire(url: str, runtime_id: str, epoch_id: str) -> None:
    raw_exec(
        url,
        "INSERT INTO runtime_retired_ops_epochs (runtime_id, epoch_id) VALUES (:rt, :epoch)",
        params={"rt": runtime_id, "epoch": epoch_id},
    )


def _ops_rows(url: str) -> list[tuple[Any, ...]]:
    return raw_rows(url, "SELECT runtime_id, state_json FROM runtime_ops_lifecycle ORDER BY 1")


def test_persist_load_overwrite_delete(store: Store) -> None:
    assert store.runtime.load_ops_lifecycle(RT) is None
    old = OpsSnapshot(epoch_id="epoch-old", payload={"ops": [1, 2]})
    new = OpsSnapshot(epoch_id="epoch-new", payload={"ops": []})
    store.runtime.persist_ops_lifecycle(RT, old)
    assert store.runtime.load_ops_lifecycle(RT) == old
    store.runtime.persist_ops_lifecycle(RT, new)  # another epoch simply overwrites
    assert store.runtime.load_ops_lifecycle(RT) == new
    with store.write() as uow:
        uow.runtime.persist_ops_lifecycle(RT, old)  # and back: no epoch ordering
    assert store.runtime.load_ops_lifecycle(RT) == old
    store.runtime.delete_ops_lifecycle(RT)
    assert store.runtime.load_ops_lifecycle(RT) is None
    store.runtime.delete_ops_lifecycle(RT)  # absent: a no-op
    # Delete does not retire: the same epoch may be written again.
    store.runtime.persist_ops_lifecycle(RT, old)
    assert store.runtime.load_ops_lifecycle(RT) == old


def test_persist_of_a_retired_epoch_is_refused(store: Store, db_url: str) -> None:
    live = OpsSnapshot(epoch_id="epoch-live")
    store.runtime.persist_ops_lifecycle(RT, live)
    _retire(db_url, RT, "epoch-dead")
    before = _ops_rows(db_url)
    with pytest.raises(OpsLifecycleEpochRetired) as err:
        store.runtime.persist_ops_lifecycle(RT, OpsSnapshot(epoch_id="epoch-dead"))
    assert (err.value.runtime_id, err.value.epoch_id) == (RT, "epoch-dead")
    assert "Ops lifecycle epoch epoch-dead for runtime runtime-1 is retired" in str(err.value)
    with pytest.raises(OpsLifecycleEpochRetired), store.write() as uow:
        uow.runtime.persist_ops_lifecycle(RT, OpsSnapshot(epoch_id="epoch-dead"))
    assert _ops_rows(db_url) == before
    # Retirement is per runtime.
    store.runtime.persist_ops_lifecycle("runtime-b", OpsSnapshot(epoch_id="epoch-dead"))
    assert store.runtime.load_ops_lifecycle("runtime-b") == OpsSnapshot(epoch_id="epoch-dead")


def test_retirement_fences_across_reopen(db_url: str) -> None:
    with Store.open(db_url) as store:
        store.runtime.persist_ops_lifecycle(RT, OpsSnapshot(epoch_id="epoch-e"))
    _retire(db_url, RT, "epoch-e")
    with Store.open(db_url) as store:
        with pytest.raises(OpsLifecycleEpochRetired):
            store.runtime.persist_ops_lifecycle(RT, OpsSnapshot(epoch_id="epoch-e"))
        with pytest.raises(OpsLifecycleEpochRetired):
            store.runtime.initialize_ops_lifecycle_if_absent(RT, OpsSnapshot(epoch_id="epoch-e"))
        store.runtime.delete_ops_lifecycle(RT)
        with pytest.raises(OpsLifecycleEpochRetired):
            store.runtime.initialize_ops_lifecycle_if_absent(RT, OpsSnapshot(epoch_id="epoch-e"))
        assert store.runtime.load_ops_lifecycle(RT) is None


def test_initialize_inserts_when_absent_and_returns_the_existing_otherwise(store: Store) -> None:
    first = OpsSnapshot(epoch_id="epoch-1", payload={"n": 1})
    second = OpsSnapshot(epoch_id="epoch-2", payload={"n": 2})
    assert store.runtime.initialize_ops_lifecycle_if_absent(RT, first) == first
    assert store.runtime.initialize_ops_lifecycle_if_absent(RT, second) == first
    with store.write() as uow:
        assert uow.runtime.initialize_ops_lifecycle_if_absent(RT, second) == first
    assert store.runtime.load_ops_lifecycle(RT) == first


def test_initialize_with_a_retired_candidate_inserts_nothing(store: Store, db_url: str) -> None:
    _retire(db_url, RT, "epoch-dead")
    with pytest.raises(OpsLifecycleEpochRetired) as err:
        store.runtime.initialize_ops_lifecycle_if_absent(RT, OpsSnapshot(epoch_id="epoch-dead"))
    assert err.value.epoch_id == "epoch-dead"
    assert _ops_rows(db_url) == []


def test_initialize_over_a_retired_canonical_names_it_and_inserts_nothing(
    store: Store, db_url: str
) -> None:  # spec §5.2 item 17
    stored = OpsSnapshot(epoch_id="epoch-retired")
    store.runtime.persist_ops_lifecycle(RT, stored)
    _retire(db_url, RT, "epoch-retired")
    before = _ops_rows(db_url)
    with pytest.raises(OpsLifecycleEpochRetired) as err:
        store.runtime.initialize_ops_lifecycle_if_absent(RT, OpsSnapshot(epoch_id="epoch-fresh"))
    assert (err.value.runtime_id, err.value.epoch_id) == (RT, "epoch-retired")
    with store.write() as uow:
        with pytest.raises(OpsLifecycleEpochRetired, match="epoch-retired"):
            uow.runtime.initialize_ops_lifecycle_if_absent(RT, OpsSnapshot(epoch_id="epoch-fresh"))
        uow.runtime.persist_ops_lifecycle("runtime-b", stored)  # the unit goes on
    assert _ops_rows(db_url) == sorted([*before, ("runtime-b", before[0][1])])


def test_corrupt_ops_rows_fail_loudly(store: Store, db_url: str) -> None:
    raw_exec(
        db_url,
        "INSERT INTO runtime_ops_lifecycle (runtime_id, state_json) VALUES (:rt, :data)",
        params={"rt": RT, "data": b'{"epoch_id": "e"}'},  # no ops_snapshot_version
    )
    with pytest.raises(ReadFailed, match="ops_snapshot_version"):
        store.runtime.load_ops_lifecycle(RT)
    with pytest.raises(ReadFailed, match="ops_snapshot_version"):
        store.runtime.initialize_ops_lifecycle_if_absent(RT, OpsSnapshot(epoch_id="epoch-x"))
    assert _ops_rows(db_url) == [(RT, b'{"epoch_id": "e"}')]


def test_unencodable_snapshot_is_refused_before_the_database(store: Store, db_url: str) -> None:
    bad = OpsSnapshot.model_construct(epoch_id="epoch-bad", payload={"x": float("nan")})
    with pytest.raises(WriteFailed):
        store.runtime.persist_ops_lifecycle(RT, bad)
    with pytest.raises(WriteFailed):
        store.runtime.initialize_ops_lifecycle_if_absent(RT, bad)
    assert _ops_rows(db_url) == []


def test_ops_writes_need_a_write_unit(store: Store) -> None:
    with store.read() as uow:
        for op in (
            lambda: uow.runtime.persist_ops_lifecycle(RT, OpsSnapshot(epoch_id="e")),
            lambda: uow.runtime.initialize_ops_lifecycle_if_absent(RT, OpsSnapshot(epoch_id="e")),
            lambda: uow.runtime.delete_ops_lifecycle(RT),
        ):
            with pytest.raises(ReadOnlyUnitOfWork):
                op()


@pytest.mark.slow
def test_concurrent_initializers_converge_on_one_epoch(store: Store, db_url: str) -> None:  # #25
    runtimes = [f"runtime-init-{n}" for n in range(6)]
    results = race_processes(db_url, "body_ops_init", 4, {"runtimes": runtimes})
    for n, runtime_id in enumerate(runtimes):
        epochs = {racer[n] for racer in results}
        assert len(epochs) == 1, epochs
        (epoch,) = epochs
        assert epoch.startswith(f"epoch-{n}-racer-")
        stored = store.runtime.load_ops_lifecycle(runtime_id)
        assert stored is not None and stored.epoch_id == epoch
        racer = int(epoch.rsplit("-", 1)[1])
        assert stored.payload == {"racer": racer}
