"""Cases of the async surface suite: ``astore.runs`` and ``astore.leases`` (see surface.py)."""

from __future__ import annotations

from agentkeep.errors import (
    AssigneeDescRequired,
    AssigneeSlotRequired,
    InvalidInput,
    RunCorrupt,
    RunDuplicate,
    RunNotFound,
    SessionExecutionLeaseExpired,
)
from agentkeep.runs.domain import (
    DegradationEntry,
    Released,
    RunListFilter,
    RunRecord,
    RunStatus,
    Stale,
    StepEntry,
)
from agentkeep.sessions.domain import Acquired, Busy

from .support import SID, T0, TTL, A, B, is_sqlite
from .surface import Ctx, covers


def run(run_id: str, task_id: str = "T-1", created_at: int = 100) -> RunRecord:
    return RunRecord.new(run_id, task_id, created_at)


async def stored_run(c: Ctx, run_id: str) -> RunRecord:
    return await c.astore.runs.get(run_id)


# --------------------------------------------------------------------------
# runs


@covers("runs.create")
async def _create(c: Ctx) -> None:
    record = run("R-1")
    assert await c.op("runs.create")(record) is None
    assert await stored_run(c, "R-1") == record
    await c.refused(RunDuplicate, c.op("runs.create")(run("R-1", "T-2")))
    bad = run("R-2").model_copy(update={"input_json": "nul\x00"})
    await c.refused(InvalidInput, c.op("runs.create")(bad))


@covers("runs.get")
async def _get(c: Ctx) -> None:
    record = run("R-1")
    await c.astore.runs.create(record)
    assert await c.op("runs.get")("R-1") == record
    await c.refused(RunNotFound, c.op("runs.get")("R-missing"))
    c.seen.execute("UPDATE runs SET step_entries_json = '[1]' WHERE id = 'R-1'")
    await c.refused(RunCorrupt, c.op("runs.get")("R-1"))


@covers("runs.list_by_task")
async def _list_by_task(c: Ctx) -> None:
    for rid, task, at in (("R-2", "T-1", 200), ("R-1", "T-1", 100), ("R-3", "T-2", 50)):
        await c.astore.runs.create(run(rid, task, at))
    assert [r.id for r in await c.op("runs.list_by_task")("T-1")] == ["R-1", "R-2"]
    assert await c.op("runs.list_by_task")("T-none") == []


@covers("runs.list_running")
async def _list_running(c: Ctx) -> None:
    for rid in ("R-1", "R-2", "R-3"):
        await c.astore.runs.create(run(rid))
    assert await c.op("runs.list_running")() == []
    await c.astore.runs.update_status("R-3", RunStatus.RUNNING)
    await c.astore.runs.update_status("R-1", RunStatus.RUNNING)
    assert [r.id for r in await c.op("runs.list_running")()] == ["R-1", "R-3"]


@covers("runs.list")
async def _list(c: Ctx) -> None:
    for rid, task, at in (("R-1", "T-1", 100), ("R-2", "T-2", 300), ("R-3", "T-1", 200)):
        await c.astore.runs.create(run(rid, task, at))
    assert [r.id for r in await c.op("runs.list")()] == ["R-2", "R-3", "R-1"]
    flt = RunListFilter(task_id="T-1", limit=1)
    assert [r.id for r in await c.op("runs.list")(flt)] == ["R-3"]


@covers("runs.append_step_entry")
async def _append_step_entry(c: Ctx) -> None:
    await c.astore.runs.create(run("R-1"))
    first, second = StepEntry(step_id="ST-1", at=1), StepEntry(step_id="ST-2", at=2)
    assert await c.op("runs.append_step_entry")("R-1", first) is None
    await c.op("runs.append_step_entry")("R-1", second)
    assert (await stored_run(c, "R-1")).step_entries == (first, second)
    await c.refused(RunNotFound, c.op("runs.append_step_entry")("R-missing", first))
    c.seen.execute("UPDATE runs SET step_entries_json = '{' WHERE id = 'R-1'")
    await c.refused(RunCorrupt, c.op("runs.append_step_entry")("R-1", first))


@covers("runs.append_degradation")
async def _append_degradation(c: Ctx) -> None:
    await c.astore.runs.create(run("R-1"))
    entry = DegradationEntry(tool="t", error="boom", fallback="cached", at=5)
    assert await c.op("runs.append_degradation")("R-1", entry) is None
    assert (await stored_run(c, "R-1")).degradations == (entry,)
    await c.refused(RunNotFound, c.op("runs.append_degradation")("R-missing", entry))


@covers("runs.update_status")
async def _update_status(c: Ctx) -> None:
    await c.astore.runs.create(run("R-1"))
    assert await c.op("runs.update_status")("R-1", RunStatus.FAILED) is None
    assert (await stored_run(c, "R-1")).status == RunStatus.FAILED
    await c.refused(RunNotFound, c.op("runs.update_status")("R-missing", RunStatus.RUNNING))


@covers("runs.try_transition")
async def _try_transition(c: Ctx) -> None:
    await c.astore.runs.create(run("R-1"))
    move = c.op("runs.try_transition")
    assert await move("R-1", RunStatus.PENDING, RunStatus.RUNNING) is True
    assert (await stored_run(c, "R-1")).status == RunStatus.RUNNING
    # the compare-and-set refuses a stale expected status, and a missing run: False, no write
    assert await c.unchanged(move("R-1", RunStatus.PENDING, RunStatus.RUNNING)) is False
    assert await c.unchanged(move("R-missing", RunStatus.PENDING, RunStatus.RUNNING)) is False


@covers("runs.acquire_assignee")
async def _acquire_assignee(c: Ctx) -> None:
    await c.astore.runs.create(run("R-1"))
    take = c.op("runs.acquire_assignee")
    gen, previous = await take("R-1", "slot-a", "op-1", "first holder")
    assert previous is None
    gen2, displaced = await take("R-1", "slot-a", "op-2", "second holder")
    assert gen2 == gen + 1
    assert displaced is not None and displaced.op == "op-1" and displaced.gen == gen
    assert (await stored_run(c, "R-1")).current["slot-a"].op == "op-2"
    await c.refused(AssigneeSlotRequired, take("R-1", "", "op", "desc"))
    await c.refused(AssigneeDescRequired, take("R-1", "slot-a", "op", "  "))
    await c.refused(RunNotFound, take("R-missing", "slot-a", "op", "desc"))


@covers("runs.vacate_assignee")
async def _vacate_assignee(c: Ctx) -> None:
    await c.astore.runs.create(run("R-1"))
    gen, _ = await c.astore.runs.acquire_assignee("R-1", "slot-a", "op-1", "holder")
    vacate = c.op("runs.vacate_assignee")
    stale = await c.unchanged(vacate("R-1", "slot-a", gen + 7))
    assert isinstance(stale, Stale) and stale.current is not None and stale.current.gen == gen
    released = await vacate("R-1", "slot-a", gen)
    assert isinstance(released, Released) and released.released.op == "op-1"
    assert "slot-a" not in (await stored_run(c, "R-1")).current
    vacant = await c.unchanged(vacate("R-1", "slot-a", gen))
    assert isinstance(vacant, Stale) and vacant.current is None
    await c.refused(AssigneeSlotRequired, vacate("R-1", "", gen))
    await c.refused(InvalidInput, vacate("R-1", "slot-a", -1))
    await c.refused(RunNotFound, vacate("R-missing", "slot-a", gen))


@covers("runs.set_result")
async def _set_result(c: Ctx) -> None:
    await c.astore.runs.create(run("R-1"))
    assert await c.op("runs.set_result")("R-1", {"ok": [1, 2]}) is None
    assert (await stored_run(c, "R-1")).result_ref == {"ok": [1, 2]}
    await c.refused(InvalidInput, c.op("runs.set_result")("R-1", float("nan")))
    await c.refused(RunNotFound, c.op("runs.set_result")("R-missing", 1))


@covers("runs.set_input_json")
async def _set_input_json(c: Ctx) -> None:
    await c.astore.runs.create(run("R-1"))
    assert await c.op("runs.set_input_json")("R-1", "{not parsed") is None
    assert (await stored_run(c, "R-1")).input_json == "{not parsed"
    await c.refused(InvalidInput, c.op("runs.set_input_json")("R-1", "nul\x00"))
    await c.refused(RunNotFound, c.op("runs.set_input_json")("R-missing", "{}"))


@covers("runs.delete")
async def _delete(c: Ctx) -> None:
    await c.astore.runs.create(run("R-1"))
    assert await c.op("runs.delete")("R-1") is None
    assert await c.astore.runs.list() == []
    await c.refused(RunNotFound, c.op("runs.delete")("R-1"))
    await c.astore.runs.create(run("R-1"))  # its id may be created again


@covers("runs.name", modes=("call",))
async def _name(c: Ctx) -> None:
    assert c.astore.runs.name == ("sqlite" if is_sqlite(c.url) else "postgres")


# --------------------------------------------------------------------------
# leases


@covers("leases.try_claim_session_execution_lease")
async def _try_claim(c: Ctx) -> None:
    claim = c.op("leases.try_claim_session_execution_lease")
    got = await claim(SID, A, TTL)
    assert isinstance(got, Acquired) and got.lease.owner == A
    assert got.lease.expires_at_epoch_ms == T0 + TTL
    c.clock.advance(5)
    extended = await claim(SID, A, TTL)  # the holder extends its own lease
    assert isinstance(extended, Acquired)
    assert extended.lease.fencing_token == got.lease.fencing_token
    assert extended.lease.expires_at_epoch_ms == T0 + 5 + TTL
    busy = await c.unchanged(claim(SID, B, TTL))
    assert isinstance(busy, Busy) and busy.holder.owner == A
    await c.refused(InvalidInput, claim(" ", A, TTL))
    await c.refused(InvalidInput, claim(SID, A, -1))


@covers("leases.reclaim_session_execution_lease")
async def _reclaim(c: Ctx) -> None:
    got = await c.astore.leases.try_claim_session_execution_lease(SID, A, TTL)
    assert isinstance(got, Acquired)
    reclaim = c.op("leases.reclaim_session_execution_lease")
    # A is live (its lease has not expired): B is refused with Busy, nothing written
    busy = await c.unchanged(reclaim(SID, B, got.lease, TTL))
    assert isinstance(busy, Busy) and busy.holder.owner == A
    c.clock.advance(TTL + 1)
    taken = await reclaim(SID, B, got.lease, TTL)
    assert isinstance(taken, Acquired) and taken.lease.owner == B
    assert taken.lease.fencing_token == got.lease.fencing_token + 1
    await c.refused(InvalidInput, reclaim(SID, B, got.lease, -5))


@covers("leases.renew_session_execution_lease")
async def _renew(c: Ctx) -> None:
    got = await c.astore.leases.try_claim_session_execution_lease(SID, A, TTL)
    assert isinstance(got, Acquired)
    renew = c.op("leases.renew_session_execution_lease")
    c.clock.advance(100)
    renewed = await renew(got.lease, TTL)
    assert renewed.expires_at_epoch_ms == T0 + 100 + TTL
    assert renewed.fencing_token == got.lease.fencing_token
    await c.refused(InvalidInput, renew(got.lease, -1))
    c.clock.advance(TTL + 1)
    await c.refused(SessionExecutionLeaseExpired, renew(got.lease, TTL))


@covers("leases.release_session_execution_lease")
async def _release(c: Ctx) -> None:
    got = await c.astore.leases.try_claim_session_execution_lease(SID, A, TTL)
    assert isinstance(got, Acquired)
    c.clock.advance(TTL + 1)
    b = await c.astore.leases.reclaim_session_execution_lease(SID, B, got.lease, TTL)
    assert isinstance(b, Acquired)
    release = c.op("leases.release_session_execution_lease")
    assert await c.unchanged(release(got.lease)) is None  # a stale fence: a silent no-op
    assert await release(b.lease) is None
    assert await c.astore.leases.get_session_execution_lease(SID) is None
    await c.refused(InvalidInput, release(b.lease.model_copy(update={"session_id": ""})))


@covers("leases.ensure_session_execution_lease")
async def _ensure(c: Ctx) -> None:
    got = await c.astore.leases.try_claim_session_execution_lease(SID, A, TTL)
    assert isinstance(got, Acquired)
    ensure = c.op("leases.ensure_session_execution_lease")
    assert await ensure(got.lease) is None
    c.clock.advance(TTL + 1)
    error = await c.refused(SessionExecutionLeaseExpired, ensure(got.lease))
    assert error.session_id == SID


@covers("leases.get_session_execution_lease")
async def _get_lease(c: Ctx) -> None:
    get = c.op("leases.get_session_execution_lease")
    assert await get(SID) is None
    got = await c.astore.leases.try_claim_session_execution_lease(SID, A, TTL)
    assert isinstance(got, Acquired)
    assert await get(SID) == got.lease
    c.clock.advance(TTL + 1)
    assert await get(SID) == got.lease  # expired, still reported as stored
