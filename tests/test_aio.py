"""The async facade of the run and session stores (``AsyncStore.runs``, ``.leases``, ...).

The runtime store's async facade and the cancellation contract are tested in
tests/runtime/test_async.py; here: every one-call operation of the other
stores has its coroutine, and they reach the same repositories (thread mode:
``db_url`` is a synchronous URL). Every operation's outcomes on the asyncio
drivers: tests/aio/test_surface.py.
"""

from __future__ import annotations

import asyncio

import pytest

from agentkeep import RunRecord, RunStatus
from agentkeep.aio import (
    AsyncCatalogCalls,
    AsyncCheckpointNodeCalls,
    AsyncLeaseCalls,
    AsyncMaintenanceCalls,
    AsyncQueueCalls,
    AsyncRunCalls,
    AsyncSessionCalls,
    AsyncStore,
    AsyncTurnInputCalls,
)
from agentkeep.errors import RunNotFound
from agentkeep.runs.facade import RunCalls
from agentkeep.sessions.domain import Acquired, LeaseOwnerIdentity
from agentkeep.sessions.facade import (
    CatalogCalls,
    CheckpointNodeCalls,
    LeaseCalls,
    MaintenanceCalls,
    QueueCalls,
    SessionCalls,
    TurnInputCalls,
)


@pytest.mark.parametrize(
    ("sync", "wrapped"),
    [
        (RunCalls, AsyncRunCalls),
        (LeaseCalls, AsyncLeaseCalls),
        (QueueCalls, AsyncQueueCalls),
        (TurnInputCalls, AsyncTurnInputCalls),
        (SessionCalls, AsyncSessionCalls),
        (MaintenanceCalls, AsyncMaintenanceCalls),
        (CatalogCalls, AsyncCatalogCalls),
        (CheckpointNodeCalls, AsyncCheckpointNodeCalls),
    ],
)
def test_every_one_call_operation_has_its_coroutine(sync: type, wrapped: type) -> None:
    public = {n for n in dir(sync) if not n.startswith("_")}
    assert {n for n in dir(wrapped) if not n.startswith("_")} == public


def test_async_run_and_lease_operations(db_url: str) -> None:
    async def main() -> None:
        async with await AsyncStore.open(db_url) as astore:
            await astore.runs.create(RunRecord.new("R-async", "T-1", created_at=1_700_000_000))
            assert await astore.runs.try_transition("R-async", RunStatus.PENDING, RunStatus.RUNNING)
            assert not await astore.runs.try_transition(
                "R-async", RunStatus.PENDING, RunStatus.RUNNING
            )
            assert (await astore.runs.get("R-async")).status == RunStatus.RUNNING
            assert astore.runs.name in ("sqlite", "postgres")
            with pytest.raises(RunNotFound):
                await astore.runs.get("R-missing")
            me = LeaseOwnerIdentity(owner_id="w-1", incarnation_id="boot-1")
            outcome = await astore.leases.try_claim_session_execution_lease(
                "S-async", me, ttl_ms=30_000
            )
            assert isinstance(outcome, Acquired)
            lease = await astore.leases.get_session_execution_lease("S-async")
            assert lease is not None and lease.fencing_token == outcome.lease.fencing_token
            assert await astore.queue.list_queued_work("S-async") == []
            assert await astore.turn_inputs.list_turn_inputs("S-async") == []
            assert await astore.commits.load_session_meta("S-async") is None

    asyncio.run(main())
