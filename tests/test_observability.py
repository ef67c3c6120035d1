"""Logs, metrics and traces (agentkeep.observability), on both backends where a database is used.

* Metrics against an in-memory reader (opentelemetry-sdk ``InMemoryMetricReader``)
  and spans against an in-memory exporter: each public operation gets one
  span and one ``agentkeep.operation.duration`` point (sync one-call forms,
  facade methods that call other operations, and ``AsyncStore`` in both its
  native and thread modes: counted once); a refused ``try_transition``, a
  head-revision conflict and a stale lease each count in
  ``agentkeep.conflicts``; a lease taken over after expiry and one reclaimed
  from a dead holder count in ``agentkeep.lease.takeovers``; a retried
  transient error counts in ``agentkeep.retries``.
* Log records (caplog) for each category: retries and exhausted retries,
  takeovers and reclaims, refusals, commit outcomes unknown and resolved.
* ``configure(enabled=False)`` records nothing.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("opentelemetry.sdk")

from opentelemetry.sdk.metrics import MeterProvider  # noqa: E402
from opentelemetry.sdk.metrics.export import InMemoryMetricReader  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (  # noqa: E402
    InMemorySpanExporter,
)
from sqlalchemy.dialects import sqlite as sqlite_dialect  # noqa: E402

from agentkeep import db, observability  # noqa: E402
from agentkeep.aio import AsyncStore  # noqa: E402
from agentkeep.clock import SettableClock  # noqa: E402
from agentkeep.errors import (  # noqa: E402
    CommitOutcomeUnknown,
    HeadRevisionConflict,
    SessionExecutionLeaseExpired,
    StoreBusy,
)
from agentkeep.runs.domain import RunRecord, RunStatus  # noqa: E402
from agentkeep.sessions.domain import (  # noqa: E402
    Acquired,
    LeaseOwnerIdentity,
    QueuedWorkDraft,
    QueuedWorkPayload,
)
from agentkeep.sessions.liveness import capture_liveness  # noqa: E402
from agentkeep.sessions.records import (  # noqa: E402
    HydratedSessionCheckpoint,
    RuntimeCommit,
    UnchangedGraph,
)
from agentkeep.statements import CompileTarget  # noqa: E402
from agentkeep.store import Store  # noqa: E402
from tests.conftest import as_async_url  # noqa: E402

A = LeaseOwnerIdentity(owner_id="owner-A", incarnation_id="inc-A")
B = LeaseOwnerIdentity(owner_id="owner-B", incarnation_id="inc-B")


class Telemetry:
    """An SDK meter and tracer provider with in-memory readers, installed for one test."""

    def __init__(self) -> None:
        self.reader = InMemoryMetricReader()
        self.exporter = InMemorySpanExporter()
        self.tracer_provider = TracerProvider()
        self.tracer_provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        observability.configure(
            meter_provider=MeterProvider(metric_readers=[self.reader]),
            tracer_provider=self.tracer_provider,
        )

    def points(self, name: str) -> list[Any]:
        data = self.reader.get_metrics_data()
        out: list[Any] = []
        for resource in data.resource_metrics if data is not None else ():
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    if metric.name == name:
                        out.extend(metric.data.data_points)
        return out

    def counts(self, name: str, key: str) -> dict[str, int]:
        """Counter values by the attribute ``key``."""
        return {str(p.attributes[key]): int(p.value) for p in self.points(name)}

    def durations(self) -> dict[str, int]:
        """Histogram point counts by operation."""
        return {str(p.attributes["operation"]): int(p.count) for p in self.points(DURATION)}

    def spans(self) -> list[str]:
        return [s.name for s in self.exporter.get_finished_spans()]


DURATION = "agentkeep.operation.duration"


@pytest.fixture
def telemetry() -> Iterator[Telemetry]:
    t = Telemetry()
    yield t
    observability.configure()  # back to the global providers


# --------------------------------------------------------------------------
# Spans and durations: one per public operation


def test_each_one_call_operation_gets_one_span_and_duration(
    store: Store, telemetry: Telemetry
) -> None:
    store.runs.create(RunRecord.new("R-1", "T-1", 100))
    assert store.runs.try_transition("R-1", RunStatus.PENDING, RunStatus.RUNNING)
    store.runs.get("R-1")
    store.maintenance.gc_unreachable()  # a facade method calling gc_unreachable_strict
    assert telemetry.durations() == {
        "runs.create": 1,
        "runs.try_transition": 1,
        "runs.get": 1,
        "maintenance.gc_unreachable": 1,
    }
    assert telemetry.spans() == [
        "runs.create",
        "runs.try_transition",
        "runs.get",
        "maintenance.gc_unreachable",
    ]


def test_a_failed_operation_records_its_error_type(store: Store, telemetry: Telemetry) -> None:
    with pytest.raises(Exception):  # noqa: B017 - RunNotFound, checked by its attribute below
        store.runs.update_status("R-missing", RunStatus.DONE)
    (point,) = telemetry.points(DURATION)
    assert dict(point.attributes) == {
        "operation": "runs.update_status",
        "error.type": "RunNotFound",
    }
    (span,) = telemetry.exporter.get_finished_spans()
    assert not span.status.is_ok


def test_async_operations_are_counted_once(backend: str, db_url: str, telemetry: Telemetry) -> None:
    """Native async (aiosqlite / asyncpg) and the thread mode: one point, one span each."""
    native = as_async_url(db_url, "aiosqlite" if backend == "sqlite" else "asyncpg")

    async def main(url: str, run_id: str) -> None:
        astore = await AsyncStore.open(url)
        try:
            await astore.runs.create(RunRecord.new(run_id, "T-1", 1))
            assert not await astore.runs.try_transition(run_id, RunStatus.DONE, RunStatus.PENDING)
        finally:
            await astore.close()

    asyncio.run(main(native, "R-native"))
    asyncio.run(main(db_url, "R-thread"))
    assert telemetry.durations() == {"runs.create": 2, "runs.try_transition": 2}
    assert telemetry.spans().count("runs.create") == 2
    assert telemetry.counts("agentkeep.conflicts", "kind") == {"run_transition": 2}


def test_disabled_records_nothing(store: Store, telemetry: Telemetry) -> None:
    observability.configure(enabled=False)
    assert not observability.enabled()
    store.runs.create(RunRecord.new("R-1", "T-1", 100))
    assert not store.runs.try_transition("R-1", RunStatus.DONE, RunStatus.PENDING)
    assert telemetry.points(DURATION) == [] and telemetry.spans() == []


# --------------------------------------------------------------------------
# Conflicts


def test_refused_try_transition_counts_and_logs(
    store: Store, telemetry: Telemetry, caplog: pytest.LogCaptureFixture
) -> None:
    store.runs.create(RunRecord.new("R-1", "T-1", 100))
    with caplog.at_level(logging.DEBUG, logger="agentkeep.conflicts"):
        assert not store.runs.try_transition("R-1", RunStatus.RUNNING, RunStatus.DONE)
    assert telemetry.counts("agentkeep.conflicts", "kind") == {"run_transition": 1}
    (record,) = [r for r in caplog.records if r.name == "agentkeep.conflicts"]
    assert record.levelno == logging.DEBUG
    assert "run_transition refused: run R-1" in record.getMessage()


def _commit(store: Store, lease: Any, expected: int) -> None:
    store.commits.commit_runtime_state(
        RuntimeCommit(
            session_id="S",
            expected_head_revision=expected,
            session_execution_lease=lease,
            graph=UnchangedGraph(leaf_node_id=None),
            checkpoint=HydratedSessionCheckpoint(turn_state={}),
        )
    )


def test_head_conflict_and_stale_lease_are_counted_by_kind(
    store: Store, clock: SettableClock, telemetry: Telemetry, caplog: pytest.LogCaptureFixture
) -> None:
    got = store.leases.try_claim_session_execution_lease("S", A, 1_000)
    assert isinstance(got, Acquired)
    _commit(store, got.lease, 0)
    with caplog.at_level(logging.DEBUG, logger="agentkeep.conflicts"):
        with pytest.raises(HeadRevisionConflict):
            _commit(store, got.lease, 0)
        clock.advance(2_000)
        with pytest.raises(SessionExecutionLeaseExpired):
            _commit(store, got.lease, 1)
    assert telemetry.counts("agentkeep.conflicts", "kind") == {"head_revision": 1, "lease_fence": 1}
    messages = [r.getMessage() for r in caplog.records if r.name == "agentkeep.conflicts"]
    assert any(m.startswith("head_revision refused:") and "S" in m for m in messages)
    assert any(m.startswith("lease_fence refused:") and "S" in m for m in messages)


# --------------------------------------------------------------------------
# Lease takeovers


def test_takeover_after_expiry_and_reclaim_are_logged_and_counted(
    store: Store, clock: SettableClock, telemetry: Telemetry, caplog: pytest.LogCaptureFixture
) -> None:
    assert isinstance(store.leases.try_claim_session_execution_lease("S1", A, 1_000), Acquired)
    with caplog.at_level(logging.DEBUG, logger="agentkeep"):
        # the holder extending its own lease is no takeover, and logs nothing at INFO
        assert isinstance(store.leases.try_claim_session_execution_lease("S1", A, 1_000), Acquired)
        assert not [r for r in caplog.records if r.levelno >= logging.INFO]
        clock.advance(1_001)
        taken = store.leases.try_claim_session_execution_lease("S1", B, 1_000)
        assert isinstance(taken, Acquired)
    (record,) = [r for r in caplog.records if r.name == "agentkeep.leases"]
    assert record.levelno == logging.INFO
    assert record.getMessage() == (
        "session S1: lease taken over after expiry from owner-A by owner-B (fencing token 2)"
    )

    here = capture_liveness()
    dead = LeaseOwnerIdentity(owner_id="dead", incarnation_id="d1", liveness=here)
    alive = LeaseOwnerIdentity(owner_id="alive", incarnation_id="a1", liveness=here)
    held = store.leases.try_claim_session_execution_lease("S2", dead, 60_000)
    assert isinstance(held, Acquired)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="agentkeep.leases"):
        got = store.leases.reclaim_session_execution_lease(
            "S2", alive, held.lease, 60_000, probe=lambda pid, start: "gone"
        )
    assert isinstance(got, Acquired)
    (record,) = caplog.records
    assert "S2: lease reclaimed from a dead holder from dead by alive" in record.getMessage()
    assert telemetry.counts("agentkeep.lease.takeovers", "kind") == {"expired": 1, "reclaimed": 1}


# --------------------------------------------------------------------------
# Retries


def test_retries_are_logged_and_counted(
    telemetry: Telemetry, caplog: pytest.LogCaptureFixture
) -> None:
    calls = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise StoreBusy("database is locked")
        return "ok"

    with caplog.at_level(logging.DEBUG, logger="agentkeep.retry"):
        assert db.retry_transient(flaky, attempts=5, sleep=lambda s: None) == "ok"
        with pytest.raises(StoreBusy):
            db.retry_transient(
                lambda: (_ for _ in ()).throw(StoreBusy("busy")), attempts=2, sleep=lambda s: None
            )
    debug = [r for r in caplog.records if r.levelno == logging.DEBUG]
    warning = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(debug) == 3  # two retries of flaky, one of the failing call
    assert "attempt 1 of 5" in debug[0].getMessage()
    assert len(warning) == 1 and "failed after 2 of 2 attempts" in warning[0].getMessage()
    assert sum(telemetry.counts("agentkeep.retries", "operation").values()) == 3


def test_sqlite_a_held_write_lock_is_retried_then_refused(
    tmp_path: Path, telemetry: Telemetry, caplog: pytest.LogCaptureFixture
) -> None:
    """SQLite only: a one-call write meeting another writer's lock is retried (counted under
    its operation), then refused with StoreBusy and a WARNING naming the operation."""
    url = f"sqlite:///{tmp_path / 'busy.db'}"
    store = Store.open(url, migrate=True, busy_timeout_ms=300, retry_attempts=3)
    blocker = sqlite3.connect(tmp_path / "busy.db", isolation_level=None)
    try:
        blocker.execute("BEGIN IMMEDIATE")
        with caplog.at_level(logging.DEBUG, logger="agentkeep.retry"):
            with pytest.raises(StoreBusy):
                store.runs.create(RunRecord.new("R-1", "T-1", 1))
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
        store.close()
    retries = telemetry.counts("agentkeep.retries", "operation")
    assert set(retries) <= {"runs.create"}
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith("runs.create failed after")


# --------------------------------------------------------------------------
# Commit outcomes


def test_a_lost_commit_answer_is_logged_as_unknown(caplog: pytest.LogCaptureFixture) -> None:
    raw = sqlite3.connect(":memory:")
    raw.close()  # the connection is gone: whether COMMIT happened cannot be known
    driver = db.Driver(raw, CompileTarget.of(sqlite_dialect.dialect()), sqlite3.Error)
    with caplog.at_level(logging.WARNING, logger="agentkeep.commit"):
        failure = driver.commit_failure(sqlite3.OperationalError("disk I/O error"))
    assert isinstance(failure, CommitOutcomeUnknown)
    (record,) = caplog.records
    assert record.getMessage() == "commit outcome unknown for transaction: disk I/O error"


def test_an_unknown_outcome_resolved_by_replay_is_logged(
    store: Store, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real = store._call_operation  # the one-call forms' write units
    lost = []

    def lose_first_answer(fn: Any) -> Any:
        result = real(fn)
        if not lost:
            lost.append(1)
            raise CommitOutcomeUnknown("transaction", detail="connection lost during COMMIT")
        return result

    monkeypatch.setattr(store, "_call_operation", lose_first_answer)
    draft = QueuedWorkDraft(
        session_id="S", source_key="k-1", payloads=(QueuedWorkPayload(kind="k", body=1),)
    )
    with caplog.at_level(logging.INFO, logger="agentkeep.commit"):
        batch = store.queue.enqueue_queued_work(draft)
    assert batch.source_key == "k-1"
    (record,) = caplog.records
    assert record.getMessage() == "commit outcome of queue.enqueue_queued_work resolved: replayed"


def test_async_spans_are_children_of_the_callers_span(
    backend: str, db_url: str, telemetry: Telemetry
) -> None:
    """The caller's current span is the parent, in the native and the thread mode."""
    from opentelemetry.trace import get_tracer

    native = as_async_url(db_url, "aiosqlite" if backend == "sqlite" else "asyncpg")
    tracer = get_tracer("host", tracer_provider=telemetry.tracer_provider)

    async def main(url: str, run_id: str) -> None:
        astore = await AsyncStore.open(url)
        try:
            with tracer.start_as_current_span(f"request {run_id}"):
                await astore.runs.create(RunRecord.new(run_id, "T-1", 1))
        finally:
            await astore.close()

    asyncio.run(main(native, "R-native"))
    asyncio.run(main(db_url, "R-thread"))
    spans = {s.name: s for s in telemetry.exporter.get_finished_spans()}
    creates = [s for s in telemetry.exporter.get_finished_spans() if s.name == "runs.create"]
    assert len(creates) == 2
    parents = {spans["request R-native"].context.span_id, spans["request R-thread"].context.span_id}
    assert {s.parent.span_id for s in creates if s.parent is not None} == parents


def test_without_a_tracer_provider_only_metrics_are_recorded(store: Store) -> None:
    """The global tracer provider is the API's no-op default here: no span is started."""
    reader = InMemoryMetricReader()
    observability.configure(meter_provider=MeterProvider(metric_readers=[reader]))
    try:
        store.runs.create(RunRecord.new("R-1", "T-1", 100))
        assert not observability._state.instruments._tracing()  # type: ignore[union-attr]
        data = reader.get_metrics_data()
        names = [
            m.name for r in data.resource_metrics for sc in r.scope_metrics for m in sc.metrics
        ]
        assert names == [DURATION]
    finally:
        observability.configure()


def test_without_a_meter_or_tracer_nothing_is_measured_but_the_operation_is_named(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The API's no-op defaults: no clock read, no record; ``current_operation`` still set."""
    observability.configure()  # the global providers: no SDK is set globally in the tests
    instruments = observability._state.instruments
    assert instruments is not None
    assert not instruments._metering() and not instruments._tracing()
    recorded: list[float] = []
    monkeypatch.setattr(instruments.duration, "record", lambda v, *a, **k: recorded.append(v))
    store.runs.create(RunRecord.new("R-1", "T-1", 100))
    seen: list[str | None] = []
    now_ms = store.clock.now_ms

    def named_now() -> int:  # the write samples the clock inside the operation
        seen.append(observability.current_operation())
        return now_ms()

    monkeypatch.setattr(store.clock, "now_ms", named_now)
    assert store.runs.try_transition("R-1", RunStatus.PENDING, RunStatus.RUNNING)
    assert seen == ["runs.try_transition"]
    assert observability.current_operation() is None
    assert recorded == []
    # A real instrument behind the proxy (an SDK set later): recorded from then on.
    monkeypatch.setattr(instruments.duration, "_real_instrument", object())
    store.runs.create(RunRecord.new("R-2", "T-1", 100))
    assert len(recorded) == 1
