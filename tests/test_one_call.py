"""The one-call forwarders (agentkeep.one_call): repository, unit kind and signature.

Every ``store.<store>.<op>`` declared with ``read``/``write`` must run the
repository method of the part its class names, in a write or read unit, and a
runtime read must skip the snapshot transaction (each is one SELECT).
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest

from agentkeep.one_call import OneCalls, read, write
from agentkeep.runs.repository import RunRepository
from agentkeep.runtime.snapshots import SnapshotOps
from agentkeep.store import Store


@pytest.fixture
def sqlite_store(tmp_path: Path) -> Any:
    store = Store.open(f"sqlite:///{tmp_path / 'x.db'}", migrate=True)
    yield store
    store.close()


def _record_units(store: Store, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, bool]]:
    seen: list[tuple[str, bool]] = []
    real_write, real_read = store._call_operation, store.call_read

    def call_write(fn: Any) -> Any:
        seen.append(("write", False))
        return real_write(fn)

    def call_read(fn: Any, *, single_statement: bool = False) -> Any:
        seen.append(("read", single_statement))
        return real_read(fn, single_statement=single_statement)

    monkeypatch.setattr(store, "_call_operation", call_write)  # the one-call forms' writes
    monkeypatch.setattr(store, "call_read", call_read)
    return seen


def test_runtime_reads_are_single_statement_and_writes_are_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = Store.open(f"sqlite:///{tmp_path / 'x.db'}", migrate=True)
    try:
        seen = _record_units(store, monkeypatch)
        assert store.runtime.load_session_snapshot("rt-1") is None
        store.runtime.clear_session_snapshot("rt-1")
        assert store.runtime.load_ops_lifecycle("rt-1") is None
        assert seen == [("read", True), ("write", False), ("read", True)]
    finally:
        store.close()


def test_run_reads_declare_their_unit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = Store.open(f"sqlite:///{tmp_path / 'x.db'}", migrate=True)
    try:
        seen = _record_units(store, monkeypatch)
        assert store.runs.list_running() == []
        assert store.leases.get_session_execution_lease("s-1") is None
        assert store.commits.load_session("s-1") is None
        assert seen == [("read", True), ("read", True), ("read", False)]
    finally:
        store.close()


def test_forwarders_carry_the_repository_signature_and_docstring(sqlite_store: Store) -> None:
    get = sqlite_store.runs.get
    assert list(inspect.signature(get).parameters) == ["run_id"]
    assert get.__doc__ == RunRepository.get.__doc__
    load = sqlite_store.runtime.load_session_snapshot
    assert list(inspect.signature(load).parameters) == ["runtime_id"]
    assert load.__doc__ == SnapshotOps.load_session_snapshot.__doc__
    # built once per facade instance, then an ordinary attribute
    assert sqlite_store.runs.get is get


def test_a_facade_without_a_repository_is_refused_when_declared() -> None:
    # Python < 3.12 wraps an error of __set_name__ in a RuntimeError.
    with pytest.raises((TypeError, RuntimeError)) as info:

        class Broken(OneCalls):
            get = read(RunRepository.get)

    error: BaseException | None = info.value
    messages = []
    while error is not None:
        messages.append(str(error))
        error = error.__cause__
    assert any("sets no _repository" in m for m in messages), messages


def test_each_forwarder_uses_the_path_of_the_class_that_declares_it(
    sqlite_store: Store,
) -> None:
    class Runs(OneCalls):
        _repository = "runs"
        transition = write(RunRepository.try_transition)

    class Snapshots(OneCalls):
        _repository = "runtime.snapshots"
        load = read(SnapshotOps.load_session_snapshot, single_statement=True)

    class Both(Runs, Snapshots):
        pass

    both = Both(sqlite_store)
    assert both.load("rt-1") is None
    from agentkeep.runs.domain import RunStatus

    assert both.transition("R-x", RunStatus.PENDING, RunStatus.RUNNING) is False


# --------------------------------------------------------------------------
# Single-statement reads run exactly one statement (no transaction around it)

#: Every one-call read declared ``single_statement``, with a call of it on a store
#: holding a run ``R-1`` and a leased, committed session ``S-1`` (see below).
_SINGLE_READS: dict[str, Any] = {
    "runs.get": lambda s, lease: s.runs.get("R-1"),
    "runs.list_by_task": lambda s, lease: s.runs.list_by_task("T-1"),
    "runs.list_running": lambda s, lease: s.runs.list_running(),
    "runs.list": lambda s, lease: s.runs.list(),
    "leases.get_session_execution_lease": lambda s, lease: s.leases.get_session_execution_lease(
        "S-1"
    ),
    "leases.ensure_session_execution_lease": lambda s, lease: (
        s.leases.ensure_session_execution_lease(lease)
    ),
    "queue.list_queued_work": lambda s, lease: s.queue.list_queued_work("S-1"),
    "queue.list_pending_queued_work": lambda s, lease: s.queue.list_pending_queued_work("S-1"),
    "turn_inputs.list_pending_turn_inputs": lambda s, lease: s.turn_inputs.list_pending_turn_inputs(
        "S-1"
    ),
    "turn_inputs.list_turn_inputs": lambda s, lease: s.turn_inputs.list_turn_inputs("S-1"),
    "commits.load_node": lambda s, lease: s.commits.load_node("S-1", "n-0"),
    "commits.get_head_revision": lambda s, lease: s.commits.get_head_revision("S-1"),
    "commits.load_session_meta": lambda s, lease: s.commits.load_session_meta("S-1"),
    "catalog.list_sessions": lambda s, lease: s.catalog.list_sessions(),
    "checkpoint_nodes.list_pending_writes": lambda s, lease: s.checkpoint_nodes.list_pending_writes(
        "S-1", "n-0"
    ),
    "runtime.load_input_states": lambda s, lease: s.runtime.load_input_states("rt-1"),
    "runtime.list_mob_host_bindings": lambda s, lease: s.runtime.list_mob_host_bindings(),
    "runtime.list_mob_host_revocations": lambda s, lease: s.runtime.list_mob_host_revocations(),
    "runtime.load_machine_lifecycle_record": lambda s, lease: (
        s.runtime.load_machine_lifecycle_record("rt-1")
    ),
    "runtime.load_machine_lifecycle": lambda s, lease: s.runtime.load_machine_lifecycle("rt-1"),
    "runtime.load_runtime_state": lambda s, lease: s.runtime.load_runtime_state("rt-1"),
    "runtime.load_ops_lifecycle": lambda s, lease: s.runtime.load_ops_lifecycle("rt-1"),
    "runtime.load_auth_oauth_flow_snapshot": lambda s, lease: (
        s.runtime.load_auth_oauth_flow_snapshot()
    ),
    "runtime.load_pending_compaction_projections": lambda s, lease: (
        s.runtime.load_pending_compaction_projections("rt-1")
    ),
    "runtime.load_session_snapshot": lambda s, lease: s.runtime.load_session_snapshot("rt-1"),
    "runtime.is_runtime_projection_quarantined": lambda s, lease: (
        s.runtime.is_runtime_projection_quarantined("rt-1")
    ),
}


def _declared_single_reads(store: Store) -> set[str]:
    from agentkeep.one_call import _Forwarder

    names = set()
    facades = (
        "runs",
        "leases",
        "queue",
        "turn_inputs",
        "commits",
        "maintenance",
        "catalog",
        "checkpoint_nodes",
    )
    for facade_name in facades:
        facade = getattr(store, facade_name)
        for klass in type(facade).__mro__:
            for name, value in vars(klass).items():
                if isinstance(value, _Forwarder) and value._kind == "read" and value._single:
                    names.add(f"{facade_name}.{name}")
    for klass in type(store.runtime).__mro__:
        for name, value in vars(klass).items():
            if isinstance(value, _Forwarder) and value._kind == "read" and value._single:
                names.add(f"runtime.{name}")
    return names


def test_every_single_statement_read_runs_one_statement(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read declared single_statement runs without a transaction around it, so it
    must run exactly one statement (several would each see a different snapshot)."""
    from agentkeep import RunRecord, db
    from agentkeep.sessions.domain import Acquired, LeaseOwnerIdentity
    from agentkeep.sessions.records import (
        AppendNodes,
        HydratedSessionCheckpoint,
        RuntimeCommit,
        SessionNodeRecord,
    )

    assert _declared_single_reads(store) == set(_SINGLE_READS)
    store.runs.create(RunRecord.new("R-1", "T-1", created_at=1_700_000_000))
    owner = LeaseOwnerIdentity(owner_id="w", incarnation_id="w-1")
    claimed = store.leases.try_claim_session_execution_lease("S-1", owner, 60_000)
    assert isinstance(claimed, Acquired)
    node = SessionNodeRecord(node_id="n-0", parent_node_id=None, timestamp=0, payload={})
    store.commits.commit_runtime_state(
        RuntimeCommit(
            session_id="S-1",
            expected_head_revision=0,
            session_execution_lease=claimed.lease,
            graph=AppendNodes(nodes=(node,), leaf_node_id="n-0"),
            checkpoint=HydratedSessionCheckpoint(turn_state={}),
        )
    )
    executed: list[str] = []
    real_execute = db.Driver.execute

    def execute(self: db.Driver, stmt: Any, params: Any) -> Any:
        executed.append(str(stmt))
        return real_execute(self, stmt, params)

    monkeypatch.setattr(db.Driver, "execute", execute)
    for name, call in _SINGLE_READS.items():
        executed.clear()
        call(store, claimed.lease)
        assert len(executed) == 1, (name, executed)
