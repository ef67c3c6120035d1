"""A lost COMMIT answer whose settling attempt fails on the database stays unknown.

The idempotent one-call operations settle a ``CommitOutcomeUnknown`` by running
again (or reading back). When that second attempt fails on the database
(``StoreBusy``, ``ConnectionLost``, the database unavailable; in the runtime
store a ``WriteFailed`` / ``ReadFailed`` over one), it says nothing of what the
first attempt left, which may have committed: the caller gets
``CommitOutcomeUnknown`` naming the operation, caused by that failure, never
the failure alone (which would read as "nothing was written").

The fault: the first one-call write unit runs for real (it commits) and then
raises ``CommitOutcomeUnknown`` as a lost answer does; every unit after it
(write or read) fails with the error under test before touching the database.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from langgraph.checkpoint.base import empty_checkpoint

from agentkeep.clock import SettableClock
from agentkeep.errors import (
    CommitOutcomeUnknown,
    ConnectionLost,
    DatabaseUnavailable,
    PendingTurnInputSourceKeyConflict,
    SessionLeaseHeld,
    StoreBusy,
)
from agentkeep.integrations.langgraph import AgentkeepSaver
from agentkeep.sessions.domain import (
    Acquired,
    LeaseOwnerIdentity,
    NextTurnIngress,
    PendingTurnInputDraft,
)
from agentkeep.store import Store
from tests.test_connection_loss import OPS, T0, Op

IDEMPOTENT = [op for op in OPS if op.idempotent]
CONFIG = {"configurable": {"thread_id": "T-1", "checkpoint_ns": ""}}
OTHER = LeaseOwnerIdentity(owner_id="owner-other", incarnation_id="inc-other")

FAILURES: dict[str, Callable[[], Exception]] = {
    "busy": lambda: StoreBusy("injected: busy"),
    "connection lost": lambda: ConnectionLost("injected: connection lost before COMMIT"),
    "unavailable": lambda: DatabaseUnavailable("injected://", "injected: down"),
}


class SettleFault:
    """The first write unit commits, then its answer is 'lost'; every later unit fails."""

    def __init__(self, store: Store, monkeypatch: pytest.MonkeyPatch, failure: Exception) -> None:
        self.lost = 0
        self.refused = 0
        real_write, real_read = store._call_operation, store.call_read

        def write(fn: Any, **kw: Any) -> Any:
            if self.lost:
                self.refused += 1
                raise failure
            real_write(fn, **kw)
            self.lost += 1
            raise CommitOutcomeUnknown("transaction", {}, "injected: answer lost after COMMIT")

        def read(fn: Any, **kw: Any) -> Any:
            if self.lost:  # the read-back of a settling attempt
                self.refused += 1
                raise failure
            return real_read(fn, **kw)

        monkeypatch.setattr(store, "_call_operation", write)
        monkeypatch.setattr(store, "call_read", read)


def _root(exc: BaseException) -> BaseException:
    """``exc``, or the database error a runtime ``WriteFailed`` / ``ReadFailed`` carries."""
    return exc if exc.__cause__ is None or isinstance(exc, StoreBusy) else exc.__cause__


@pytest.mark.parametrize("failure", list(FAILURES), ids=list(FAILURES))
@pytest.mark.parametrize("op", IDEMPOTENT, ids=[op.name for op in IDEMPOTENT])
def test_a_failed_settling_attempt_leaves_the_outcome_unknown(
    db_url: str, op: Op, failure: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with Store.open(db_url, clock=SettableClock(T0)) as store:
        ctx = op.setup(store)
        assert op.state(db_url) == op.before
        injected = FAILURES[failure]()
        fault = SettleFault(store, monkeypatch, injected)
        with pytest.raises(CommitOutcomeUnknown) as caught:
            op.call(store, ctx)
        assert fault.lost == 1 and fault.refused >= 1
        unknown = caught.value
        assert unknown.operation == op.name.split("(")[0]
        assert _root(unknown.__cause__) is injected  # type: ignore[arg-type]
        assert "injected: answer lost after COMMIT" in unknown.detail
        assert "settle" in unknown.detail and str(injected) in unknown.detail
        assert op.state(db_url) == op.after  # the first attempt did commit


def test_an_answer_of_the_settling_attempt_is_raised_as_it_is(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A typed answer of the second run that settles the first (here: another input is
    stored under the source key, so the first run did not store this one) is not a
    database failure: it is raised unchanged (a result would be returned)."""
    conflict = PendingTurnInputSourceKeyConflict("S", "src-1", "input-other")
    calls = []

    def write(fn: Any, **kw: Any) -> Any:
        calls.append(fn)
        if len(calls) == 1:
            raise CommitOutcomeUnknown("transaction", {}, "injected: answer lost")
        raise conflict

    monkeypatch.setattr(store, "_call_operation", write)
    draft = PendingTurnInputDraft(
        session_id="S", source_key="src-1", ingress=NextTurnIngress(), input={"t": 1}
    )
    with pytest.raises(PendingTurnInputSourceKeyConflict) as caught:
        store.turn_inputs.enqueue_pending_turn_input(draft)
    assert caught.value is conflict and len(calls) == 2


def _claimed_by_another_after_the_first_run(
    url: str, store: Store, monkeypatch: pytest.MonkeyPatch, lease_session: str
) -> list[int]:
    """The first write unit commits, then another owner (another store) claims the lease
    of ``lease_session`` and the first unit's answer is 'lost'; later units run for real."""
    real = store._call_operation
    lost: list[int] = []

    def write(fn: Any, **kw: Any) -> Any:
        result = real(fn, **kw)
        if lost:
            return result
        lost.append(1)
        with Store.open(url, clock=SettableClock(T0)) as other:
            got = other.leases.try_claim_session_execution_lease(lease_session, OTHER, 60_000)
            assert isinstance(got, Acquired), got
        raise CommitOutcomeUnknown("transaction", {}, "injected: answer lost after COMMIT")

    monkeypatch.setattr(store, "_call_operation", write)
    return lost


def test_a_lease_refusal_of_a_put_run_again_settles_nothing(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint-node put committed, its answer was lost, and another owner claimed the
    session's lease before the put ran again: that run is refused (SessionLeaseHeld),
    which says nothing of the first, so the call raises CommitOutcomeUnknown over it."""
    with Store.open(db_url, clock=SettableClock(T0)) as store:
        lost = _claimed_by_another_after_the_first_run(db_url, store, monkeypatch, "S")
        with pytest.raises(CommitOutcomeUnknown) as caught:
            store.checkpoint_nodes.put_checkpoint_node("S", "n-1", b"body")
        assert lost == [1]
        assert caught.value.operation == "checkpoint_nodes.put_checkpoint_node"
        assert isinstance(caught.value.__cause__, SessionLeaseHeld)
        assert "SessionLeaseHeld" in caught.value.detail
        monkeypatch.undo()
        stored = store.checkpoint_nodes.get_checkpoint_node("S", "n-1")
        assert stored is not None and stored.body == b"body"  # the first run did commit


def test_a_lease_refusal_of_a_saver_put_run_again_settles_nothing(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same through AgentkeepSaver (its own settling of a lost answer)."""
    with Store.open(db_url, clock=SettableClock(T0)) as store:
        saver = AgentkeepSaver(store)
        lost = _claimed_by_another_after_the_first_run(
            db_url, store, monkeypatch, saver.session_id("T-1")
        )
        checkpoint = empty_checkpoint()
        checkpoint["id"] = "1f0-checkpoint"
        with pytest.raises(CommitOutcomeUnknown) as caught:
            saver.put(CONFIG, checkpoint, {"source": "input", "step": -1}, {})  # type: ignore[arg-type]
        assert lost == [1]
        assert isinstance(caught.value.__cause__, SessionLeaseHeld)
        monkeypatch.undo()
        stored = saver.get_tuple(CONFIG)  # type: ignore[arg-type]
        assert stored is not None and stored.checkpoint["id"] == "1f0-checkpoint"


@pytest.mark.parametrize("failure", list(FAILURES), ids=list(FAILURES))
def test_the_saver_reports_an_unsettled_put_as_unknown(
    db_url: str, failure: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """AgentkeepSaver settles a lost answer by putting again; when that put fails on the
    database the put raises CommitOutcomeUnknown (the checkpoint was stored)."""
    with Store.open(db_url, clock=SettableClock(T0)) as store:
        saver = AgentkeepSaver(store)
        injected = FAILURES[failure]()
        SettleFault(store, monkeypatch, injected)
        checkpoint = empty_checkpoint()
        checkpoint["id"] = "1f0-checkpoint"
        with pytest.raises(CommitOutcomeUnknown) as caught:
            saver.put(CONFIG, checkpoint, {"source": "input", "step": -1}, {})  # type: ignore[arg-type]
        assert caught.value.__cause__ is injected
        monkeypatch.undo()
        stored = saver.get_tuple(CONFIG)  # type: ignore[arg-type]
        assert stored is not None and stored.checkpoint["id"] == "1f0-checkpoint"
