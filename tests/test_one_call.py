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
    real_write, real_read = store.call_write, store.call_read

    def call_write(fn: Any) -> Any:
        seen.append(("write", False))
        return real_write(fn)

    def call_read(fn: Any, *, single_statement: bool = False) -> Any:
        seen.append(("read", single_statement))
        return real_read(fn, single_statement=single_statement)

    monkeypatch.setattr(store, "call_write", call_write)
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
        assert seen == [("read", True), ("read", False)]
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
