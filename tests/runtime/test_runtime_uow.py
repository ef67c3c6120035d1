"""Runtime operations inside a caller's unit of work, and the async facade (smoke).

``with store.write() as uow: uow.runtime.<op>(...)`` runs several operations
in one transaction. A refused operation that is raised and caught leaves
nothing of itself (it ran in a SAVEPOINT) while the unit's other work
commits; an uncaught one rolls the whole unit back; nothing of the unit is
visible to another connection before it commits. A read unit refuses
writes. Every test runs on SQLite and Postgres.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

import agentkeep
from agentkeep.aio import AsyncStore
from agentkeep.errors import ReadOnlyUnitOfWork
from agentkeep.runtime import (
    ReadFailed,
    RuntimeNotFound,
    Session,
    SessionKeyMismatch,
    SessionSnapshotSuperseded,
    WriteFailed,
)
from agentkeep.store import Store
from agentkeep.unit_of_work import UnitOfWork

from .builders import (
    accepted_input,
    encode,
    idle_lifecycle,
    input_record,
    receipt,
    runtime_state,
    session_with_compaction_intent,
    snapshot_with_raw_intents,
    user_session,
    v0_session_blob,
    with_summary_tokens,
)
from .support import RT, abort_trigger, raw_exec

OTHER = "runtime-other"


def _refusals() -> dict[str, tuple[type[Exception], Callable[[UnitOfWork], object]]]:
    """Refused operations on RT after :func:`_seed` (error class, call in a unit)."""
    s, i = session_with_compaction_intent(session_id=_SID)
    advanced = s.with_message("user", "advanced")
    stale = s  # the stored head is `advanced`
    conflicting = snapshot_with_raw_intents(
        advanced.with_message("user", "next"), [with_summary_tokens(i, 77)]
    )
    return {
        "duplicate-receipt": (
            WriteFailed,
            lambda u: u.runtime.atomic_apply(
                RT,
                encode(advanced.with_message("user", "next")),
                _TAKEN,
                [input_record(_REFUSED_INPUT)],
                s.id,
            ),
        ),
        "duplicate-receipt-terminal": (
            WriteFailed,
            lambda u: u.runtime.atomic_apply_with_machine_lifecycle(
                RT,
                encode(advanced.with_message("user", "next")),
                _TAKEN,
                idle_lifecycle(),
                [input_record(_REFUSED_INPUT)],
                s.id,
            ),
        ),
        "outbox-conflict": (
            WriteFailed,
            lambda u: u.runtime.atomic_apply(
                RT, conflicting, receipt(50), [input_record(_REFUSED_INPUT)], s.id
            ),
        ),
        "superseded": (
            SessionSnapshotSuperseded,
            lambda u: u.runtime.atomic_apply(
                RT, encode(stale), receipt(51), [input_record(_REFUSED_INPUT)], s.id
            ),
        ),
        "key-mismatch": (
            SessionKeyMismatch,
            lambda u: u.runtime.atomic_apply(
                RT, encode(advanced), receipt(52), [input_record(_REFUSED_INPUT)], Session.new().id
            ),
        ),
        "guard": (
            WriteFailed,
            lambda u: u.runtime.commit_session_snapshot(RT, encode(user_session("x"))),
        ),
        "non-boundary-outbox": (
            WriteFailed,
            lambda u: u.runtime.commit_session_snapshot(RT, conflicting),
        ),
        "finalize-unknown": (
            RuntimeNotFound,
            lambda u: u.runtime.mark_compaction_projection_finalized(
                RT, with_summary_tokens(i, 1).projection.model_copy(update={"revision": "nope"})
            ),
        ),
    }


_SID = Session.new().id
_TAKEN = receipt(1)
_REFUSED_INPUT = accepted_input()


def _seed(store: Store) -> None:
    s, _ = session_with_compaction_intent(session_id=_SID)
    store.runtime.atomic_apply(RT, encode(s), _TAKEN, (), s.id)
    store.runtime.commit_session_snapshot(RT, encode(s.with_message("user", "advanced")))


REFUSALS = [
    "duplicate-receipt",
    "duplicate-receipt-terminal",
    "outbox-conflict",
    "superseded",
    "key-mismatch",
    "guard",
    "non-boundary-outbox",
    "finalize-unknown",
]


@pytest.mark.parametrize("refusal", REFUSALS)
def test_caught_refusal_leaves_nothing_and_the_unit_commits(
    store: Store, db_url: str, refusal: str
) -> None:
    _seed(store)
    before = runtime_state(db_url, RT)
    error, call = _refusals()[refusal]
    kept = accepted_input()
    r = receipt(60)
    with store.write() as uow:
        uow.runtime.persist_input_state(OTHER, kept)
        with pytest.raises(error):
            call(uow)
        # The unit goes on, on the same runtime too.
        uow.runtime.atomic_apply(RT, None, r, [input_record(kept)])
    after = runtime_state(db_url, RT)
    assert store.runtime.load_input_states(OTHER) == [kept]
    assert store.runtime.load_boundary_receipt(RT, r.run_id, 60) == r
    assert store.runtime.load_input_state(RT, _REFUSED_INPUT.input_id) is None
    changed = {t for t in after if after[t] != before[t]}
    assert changed == {"runtime_boundary_receipts", "runtime_input_states"}
    assert len(after["runtime_boundary_receipts"]) == len(before["runtime_boundary_receipts"]) + 1


@pytest.mark.parametrize("refusal", REFUSALS)
def test_uncaught_refusal_rolls_back_the_whole_unit(
    store: Store, db_url: str, refusal: str
) -> None:
    _seed(store)
    before = runtime_state(db_url, RT)
    error, call = _refusals()[refusal]
    with pytest.raises(error):
        with store.write() as uow:
            uow.runtime.persist_input_state(OTHER, accepted_input())
            uow.runtime.atomic_apply(RT, None, receipt(61), [input_record()])
            call(uow)
    assert runtime_state(db_url, RT) == before
    assert runtime_state(db_url, OTHER) == runtime_state(db_url, "nothing-stored")


def test_unit_is_invisible_until_commit_and_sees_its_own_writes(store: Store, db_url: str) -> None:
    s, i = session_with_compaction_intent()
    empty = runtime_state(db_url, "nothing-stored")
    with store.write() as uow:
        uow.runtime.atomic_apply(RT, encode(s), receipt(1), [input_record()], s.id)
        assert uow.runtime.load_pending_compaction_projections(RT) == [i]
        uow.runtime.mark_compaction_projection_finalized(RT, i.projection)
        assert uow.runtime.load_pending_compaction_projections(RT) == []
        # The finalized intent is a tombstone inside the unit already.
        with pytest.raises(WriteFailed, match="replays finalized"):
            uow.runtime.atomic_apply(RT, encode(s), receipt(2), (), s.id)
        assert runtime_state(db_url, RT) == empty  # another connection sees nothing yet
    state = runtime_state(db_url, RT)
    assert [row[-1] for row in state["runtime_compaction_projection_outbox"]] == ["finalized"]
    assert len(state["runtime_boundary_receipts"]) == 1
    assert len(state["runtime_input_states"]) == 1
    stored = store.runtime_domain.decode_persisted_session(state["runtime_session_snapshots"][0][0])
    assert stored.compaction_intents == ()


def test_read_unit_refuses_every_write_and_reads(store: Store, db_url: str) -> None:
    s, i = session_with_compaction_intent()
    store.runtime.atomic_apply(RT, encode(s), receipt(1), (), s.id)
    before = runtime_state(db_url, RT)
    writes: list[Callable[[UnitOfWork], object]] = [
        lambda u: u.runtime.atomic_apply(RT, None, receipt(2)),
        lambda u: u.runtime.atomic_apply_with_machine_lifecycle(
            RT, encode(s), receipt(2), idle_lifecycle(), (), s.id
        ),
        lambda u: u.runtime.commit_session_snapshot(RT, encode(s)),
        lambda u: u.runtime.commit_session_transcript_rewrite_snapshot(
            RT, encode(s), s.commits[-1]
        ),
        lambda u: u.runtime.replace_session_snapshot_if_current(RT, encode(s), encode(s)),
        lambda u: u.runtime.clear_session_snapshot_if_current(RT, encode(s)),
        lambda u: u.runtime.clear_session_snapshot(RT),
        lambda u: u.runtime.mark_compaction_projection_finalized(RT, i.projection),
    ]
    with store.read() as uow:
        for write in writes:
            with pytest.raises(ReadOnlyUnitOfWork):
                write(uow)
        assert uow.runtime.load_session_snapshot(RT) == encode(s)
        assert uow.runtime.load_pending_compaction_projections(RT) == [i]
        assert not uow.runtime.is_runtime_projection_quarantined(RT)
    assert runtime_state(db_url, RT) == before


def test_fail_closed_read_inside_a_unit_leaves_it_usable(store: Store, db_url: str) -> None:
    raw_exec(
        db_url,
        "INSERT INTO runtime_session_snapshots (runtime_id, session_snapshot) VALUES (:rt, :d)",
        params={"rt": RT, "d": v0_session_blob()},
    )
    kept = accepted_input()
    with store.write() as uow:
        with pytest.raises(ReadFailed, match="version"):
            uow.runtime.commit_session_snapshot(RT, encode(user_session("x")))
        uow.runtime.persist_input_state(RT, kept)
    assert store.runtime.load_input_states(RT) == [kept]


@pytest.mark.parametrize(
    ("table", "event", "op"),
    [
        ("runtime_session_snapshots", "DELETE", "clear"),
        ("runtime_session_snapshots", "DELETE", "clear_if_current"),
        ("runtime_projection_quarantine", "DELETE", "commit_fast_path"),
        ("runtime_session_snapshots", "UPDATE", "commit"),
        ("runtime_compaction_projection_outbox", "UPDATE", "finalize"),
    ],
)
def test_statement_fault_inside_a_unit_rolls_back_only_that_op(
    backend: str, fresh_url: str, table: str, event: str, op: str
) -> None:
    """A trigger abort in any snapshot/outbox write: the op leaves nothing, the unit goes on."""
    agentkeep.migrate(fresh_url)
    s, i = session_with_compaction_intent()
    with Store.open(fresh_url) as store:
        store.runtime.atomic_apply(RT, encode(s), receipt(1), (), s.id)
        raw_exec(
            fresh_url, "INSERT INTO runtime_projection_quarantine VALUES (:rt)", params={"rt": RT}
        )
        before = runtime_state(fresh_url, RT)
        calls: dict[str, Callable[[Any], object]] = {
            "clear": lambda api: api.clear_session_snapshot(RT),
            "clear_if_current": lambda api: api.clear_session_snapshot_if_current(RT, encode(s)),
            "commit_fast_path": lambda api: api.commit_session_snapshot(RT, encode(s)),
            "commit": lambda api: api.commit_session_snapshot(
                RT, encode(s.with_message("user", "t"))
            ),
            "finalize": lambda api: api.mark_compaction_projection_finalized(RT, i.projection),
        }
        kept = accepted_input()
        with abort_trigger(fresh_url, backend, table, event):
            with pytest.raises(WriteFailed, match="test trigger abort"):
                calls[op](store.runtime)
            assert runtime_state(fresh_url, RT) == before
            with store.write() as uow:
                with pytest.raises(WriteFailed, match="test trigger abort"):
                    calls[op](uow.runtime)
                uow.runtime.persist_input_state(OTHER, kept)
        assert runtime_state(fresh_url, RT) == before
        assert store.runtime.load_input_states(OTHER) == [kept]


# --------------------------------------------------------------------------
# The async facade (smoke: typed errors and nothing written, through worker threads)


def test_async_boundary_and_outbox_smoke(db_url: str) -> None:
    async def scenario() -> None:
        async with await AsyncStore.open(db_url) as astore:
            rt = astore.runtime
            s, i = session_with_compaction_intent()
            r = receipt(1)
            await rt.atomic_apply(RT, encode(s), r, [input_record()], s.id)
            assert await rt.load_pending_compaction_projections(RT) == [i]
            assert await rt.load_boundary_receipt(RT, r.run_id, 1) == r
            with pytest.raises(WriteFailed, match="runtime_boundary_receipts"):
                await rt.atomic_apply(RT, None, r, [input_record()])
            with pytest.raises(SessionKeyMismatch):
                await rt.atomic_apply(RT, encode(s), receipt(2), (), Session.new().id)
            await rt.mark_compaction_projection_finalized(RT, i.projection)
            await rt.mark_compaction_projection_finalized(RT, i.projection)
            assert await rt.load_pending_compaction_projections(RT) == []
            with pytest.raises(WriteFailed, match="replays finalized compaction intent"):
                await rt.atomic_apply_with_machine_lifecycle(
                    RT, encode(s), receipt(3), idle_lifecycle(), (), s.id
                )
            cleaned = await rt.load_session_snapshot(RT)
            with pytest.raises(SessionSnapshotSuperseded):
                await rt.atomic_apply(
                    RT, encode(user_session(session_id=s.id)), receipt(4), (), s.id
                )
            assert await rt.load_session_snapshot(RT) == cleaned
            assert len(await rt.load_input_states(RT)) == 1

    asyncio.run(scenario())
