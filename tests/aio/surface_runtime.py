"""Cases of the async surface suite: ``astore.runtime`` (see surface.py).

Snapshots and quarantine, the compaction-projection outbox, boundary commits
and receipts, input states, machine and ops lifecycles, unregister
finalization, mob-host bindings and the OAuth flow state.
"""

from __future__ import annotations

import uuid

from agentkeep.errors import InvalidInput
from agentkeep.runtime import (
    InputStatePersistenceRecord,
    MachineLifecycleCommit,
    Message,
    OpsSnapshot,
    StoredInputState,
    UnregisterFinalizationCommit,
    issue_delete_ops_finalization_authority,
)
from agentkeep.runtime.errors import (
    InvalidInputStateBatchCas,
    OpsLifecycleEpochRetired,
    ReadFailed,
    WriteFailed,
)
from agentkeep.runtime.input_cas import InputStateCasOutcome
from tests.runtime.builders import (
    encode,
    idle_lifecycle,
    input_record,
    receipt,
    session_with_compaction_intent,
    user_session,
)
from tests.runtime.support import RT

from .surface import Ctx, covers

EPOCH = "epoch-e"


def record(state: StoredInputState) -> InputStatePersistenceRecord:
    return InputStatePersistenceRecord.from_machine_snapshot(state)


# --------------------------------------------------------------------------
# Snapshots and quarantine


@covers("runtime.commit_session_snapshot")
async def _commit_session_snapshot(c: Ctx) -> None:
    commit = c.op("runtime.commit_session_snapshot")
    head = user_session("hello")
    assert await commit(RT, encode(head)) is None
    assert await c.astore.runtime.load_session_snapshot(RT) == encode(head)
    longer = head.with_message("user", "a")
    await commit(RT, encode(longer))  # an extension of the stored session
    other = head.with_message("user", "b")
    await c.refused(WriteFailed, commit(RT, encode(other)))  # diverged from the stored one
    await c.refused(WriteFailed, commit(RT, b"{not json"))
    assert await c.astore.runtime.load_session_snapshot(RT) == encode(longer)


@covers("runtime.commit_session_transcript_rewrite_snapshot")
async def _commit_transcript_rewrite(c: Ctx) -> None:
    session = user_session("x")
    rewritten, transcript = session.rewrite(
        0, 1, [Message(role="assistant", content="summary")], actor="async-surface"
    )
    data = encode(rewritten)
    commit = c.op("runtime.commit_session_transcript_rewrite_snapshot")
    await c.refused(WriteFailed, commit(RT, data, transcript))  # no session stored yet
    await c.astore.runtime.commit_session_snapshot(RT, encode(session))
    assert await commit(RT, data, transcript) is None
    assert await c.astore.runtime.load_session_snapshot(RT) == data


@covers("runtime.load_session_snapshot")
async def _load_session_snapshot(c: Ctx) -> None:
    load = c.op("runtime.load_session_snapshot")
    assert await load(RT) is None
    data = encode(user_session("hello"))
    await c.astore.runtime.commit_session_snapshot(RT, data)
    assert await load(RT) == data
    assert await load("runtime-other") is None


@covers("runtime.clear_session_snapshot")
async def _clear_session_snapshot(c: Ctx) -> None:
    await c.astore.runtime.commit_session_snapshot(RT, encode(user_session("hello")))
    assert await c.op("runtime.clear_session_snapshot")(RT) is None
    assert await c.astore.runtime.load_session_snapshot(RT) is None


@covers("runtime.replace_session_snapshot_if_current")
async def _replace_if_current(c: Ctx) -> None:
    head = user_session("hello")
    a, b = head.with_message("user", "a"), head.with_message("user", "b")
    await c.astore.runtime.commit_session_snapshot(RT, encode(a))
    replace = c.op("runtime.replace_session_snapshot_if_current")
    assert await c.unchanged(replace(RT, encode(b), encode(head))) is False  # b is not current
    assert await replace(RT, encode(a), encode(b)) is True
    assert await c.astore.runtime.load_session_snapshot(RT) == encode(b)


@covers("runtime.clear_session_snapshot_if_current")
async def _clear_if_current(c: Ctx) -> None:
    head = user_session("hello")
    await c.astore.runtime.commit_session_snapshot(RT, encode(head))
    clear = c.op("runtime.clear_session_snapshot_if_current")
    assert await c.unchanged(clear(RT, encode(user_session("other")))) is False
    assert await clear(RT, encode(head)) is True
    assert await c.astore.runtime.load_session_snapshot(RT) is None
    assert await c.astore.runtime.is_runtime_projection_quarantined(RT) is True


@covers("runtime.is_runtime_projection_quarantined")
async def _is_quarantined(c: Ctx) -> None:
    quarantined = c.op("runtime.is_runtime_projection_quarantined")
    head = user_session("hello")
    await c.astore.runtime.commit_session_snapshot(RT, encode(head))
    assert await quarantined(RT) is False
    # a clear-if-current sets the durable quarantine marker; a replace clears it
    assert await c.astore.runtime.clear_session_snapshot_if_current(RT, encode(head))
    assert await quarantined(RT) is True
    assert await quarantined("runtime-other") is False


# --------------------------------------------------------------------------
# Outbox


@covers("runtime.load_pending_compaction_projections")
async def _load_pending_projections(c: Ctx) -> None:
    load = c.op("runtime.load_pending_compaction_projections")
    assert await load(RT) == []
    s, intent = session_with_compaction_intent()
    await c.astore.runtime.atomic_apply(RT, encode(s), receipt(1), (), s.id)
    assert await load(RT) == [intent]


@covers("runtime.mark_compaction_projection_finalized")
async def _mark_finalized(c: Ctx) -> None:
    s, intent = session_with_compaction_intent()
    await c.astore.runtime.atomic_apply(RT, encode(s), receipt(1), (), s.id)
    mark = c.op("runtime.mark_compaction_projection_finalized")
    assert await mark(RT, intent.projection) is None
    assert await c.astore.runtime.load_pending_compaction_projections(RT) == []
    await mark(RT, intent.projection)  # idempotent
    assert await c.astore.runtime.load_pending_compaction_projections(RT) == []


@covers("runtime.supports_compaction_projection_outbox", modes=("call",))
async def _supports_outbox(c: Ctx) -> None:
    assert await c.op("runtime.supports_compaction_projection_outbox")() is True


# --------------------------------------------------------------------------
# Boundaries


@covers("runtime.atomic_apply")
async def _atomic_apply(c: Ctx) -> None:
    apply = c.op("runtime.atomic_apply")
    state = StoredInputState.new_accepted()
    first = receipt(1)
    assert await apply(RT, None, first, [state]) is None
    assert await c.astore.runtime.load_boundary_receipt(RT, first.run_id, 1) == first
    assert await c.astore.runtime.load_input_states(RT) == [state]
    # the same receipt key again: refused, nothing written
    await c.refused(WriteFailed, apply(RT, None, first, [StoredInputState.new_accepted()]))
    s = user_session("hello")
    await apply(RT, encode(s), receipt(2), (), s.id)
    assert await c.astore.runtime.load_session_snapshot(RT) == encode(s)


@covers("runtime.atomic_apply_with_machine_lifecycle")
async def _atomic_apply_with_lifecycle(c: Ctx) -> None:
    apply = c.op("runtime.atomic_apply_with_machine_lifecycle")
    s = user_session("hello")
    r = receipt(1)
    state = StoredInputState.new_accepted()
    assert await apply(RT, encode(s), r, idle_lifecycle(), [record(state)], s.id) is None
    assert await c.astore.runtime.load_runtime_state(RT) == "idle"
    assert await c.astore.runtime.load_boundary_receipt(RT, r.run_id, 1) == r
    assert await c.astore.runtime.load_input_states(RT) == [state]
    diverged = user_session("other")
    await c.refused(
        WriteFailed,
        apply(RT, encode(diverged), receipt(2), idle_lifecycle(), [input_record()], diverged.id),
    )


@covers("runtime.load_boundary_receipt")
async def _load_boundary_receipt(c: Ctx) -> None:
    load = c.op("runtime.load_boundary_receipt")
    r = receipt(3)
    assert await load(RT, r.run_id, 3) is None
    await c.astore.runtime.atomic_apply(RT, None, r, ())
    assert await load(RT, r.run_id, 3) == r
    assert await load(RT, r.run_id, 4) is None


# --------------------------------------------------------------------------
# Input states


@covers("runtime.load_input_states")
async def _load_input_states(c: Ctx) -> None:
    load = c.op("runtime.load_input_states")
    assert await load(RT) == []
    states = sorted((StoredInputState.new_accepted() for _ in range(3)), key=lambda s: s.input_id)
    await c.astore.runtime.persist_input_states_atomically(RT, [record(s) for s in states])
    assert await load(RT) == states  # ordered by input id
    assert await load("runtime-other") == []
    raw_input(c, str(uuid.uuid4()), b"not json")
    await c.refused(ReadFailed, load(RT))


def raw_input(c: Ctx, input_id: str, data: bytes) -> None:
    """Store ``data`` as the input state ``input_id`` of RT, bypassing the store."""
    c.seen.execute(
        "INSERT INTO runtime_input_states (runtime_id, input_id, state_json)"
        " VALUES (:rt, :iid, :data)",
        rt=RT,
        iid=input_id,
        data=data,
    )


@covers("runtime.load_input_state")
async def _load_input_state(c: Ctx) -> None:
    load = c.op("runtime.load_input_state")
    state = StoredInputState.new_accepted()
    assert await load(RT, state.input_id) is None
    await c.astore.runtime.persist_input_state(RT, record(state))
    assert await load(RT, state.input_id) == state
    await c.refused(InvalidInput, load(RT, "not-a-uuid"))
    corrupt = str(uuid.uuid4())
    raw_input(c, corrupt, b"[]")
    await c.refused(ReadFailed, load(RT, corrupt))


@covers("runtime.persist_input_state")
async def _persist_input_state(c: Ctx) -> None:
    persist = c.op("runtime.persist_input_state")
    state = StoredInputState.new_accepted()
    assert await persist(RT, record(state)) is None
    await persist(RT, record(state.with_recovery_count(2)))  # an upsert
    assert await c.astore.runtime.load_input_states(RT) == [state.with_recovery_count(2)]
    bad = StoredInputState(input_id="not-a-uuid", current_state="accepted")
    await c.refused(InvalidInput, persist(RT, bad))


@covers("runtime.persist_input_states_atomically")
async def _persist_input_states_atomically(c: Ctx) -> None:
    persist = c.op("runtime.persist_input_states_atomically")
    states = [StoredInputState.new_accepted() for _ in range(2)]
    assert await persist(RT, [record(s) for s in states]) is None
    assert {s.input_id for s in await c.astore.runtime.load_input_states(RT)} == {
        s.input_id for s in states
    }
    bad = StoredInputState(input_id="not-a-uuid", current_state="accepted")
    # one bad row refuses the batch: the good row's new value is not written either
    await c.refused(InvalidInput, persist(RT, [record(states[0].with_recovery_count(9)), bad]))


@covers("runtime.compare_and_swap_input_states_atomically")
async def _compare_and_swap(c: Ctx) -> None:
    cas = c.op("runtime.compare_and_swap_input_states_atomically")
    states = [StoredInputState.new_accepted() for _ in range(2)]
    await c.astore.runtime.persist_input_states_atomically(RT, [record(s) for s in states])
    bumped = [record(s.with_recovery_count(1)) for s in states]
    assert await cas(RT, states, bumped) == InputStateCasOutcome.SWAPPED
    stale = await c.unchanged(cas(RT, states, [record(s.with_recovery_count(2)) for s in states]))
    assert stale == InputStateCasOutcome.STALE
    loaded = {s.input_id: s.recovery_count for s in await c.astore.runtime.load_input_states(RT)}
    assert loaded == {s.input_id: 1 for s in states}
    await c.refused(InvalidInputStateBatchCas, cas(RT, states, bumped[:1]))  # count mismatch


# --------------------------------------------------------------------------
# Lifecycles and finalization


@covers("runtime.commit_machine_lifecycle")
async def _commit_machine_lifecycle(c: Ctx) -> None:
    commit = c.op("runtime.commit_machine_lifecycle")
    state = StoredInputState.new_accepted()
    stopped = MachineLifecycleCommit(runtime_state="stopped")
    assert await commit(RT, stopped, [record(state)]) is None
    assert await c.astore.runtime.load_runtime_state(RT) == "stopped"
    assert await c.astore.runtime.load_input_states(RT) == [state]
    await c.refused(InvalidInput, commit(RT, "not a commit"))


@covers("runtime.load_machine_lifecycle_record")
async def _load_machine_lifecycle_record(c: Ctx) -> None:
    load = c.op("runtime.load_machine_lifecycle_record")
    assert await load(RT) is None
    await c.astore.runtime.commit_machine_lifecycle(RT, idle_lifecycle())
    data = await load(RT)
    assert isinstance(data, bytes)
    assert c.astore.store.runtime_domain.decode_lifecycle(data).runtime_state == "idle"


@covers("runtime.load_machine_lifecycle")
async def _load_machine_lifecycle(c: Ctx) -> None:
    load = c.op("runtime.load_machine_lifecycle")
    assert await load(RT) is None
    await c.astore.runtime.commit_machine_lifecycle(RT, idle_lifecycle())
    got = await load(RT)
    assert got is not None and got.runtime_state == "idle"


@covers("runtime.load_runtime_state")
async def _load_runtime_state(c: Ctx) -> None:
    load = c.op("runtime.load_runtime_state")
    assert await load(RT) is None
    await c.astore.runtime.commit_machine_lifecycle(
        RT, MachineLifecycleCommit(runtime_state="stopped")
    )
    assert await load(RT) == "stopped"


async def _finalize(c: Ctx, state: StoredInputState) -> None:
    await c.astore.runtime.commit_unregister_finalization(
        RT,
        UnregisterFinalizationCommit(
            lifecycle=MachineLifecycleCommit(runtime_state="idle"),
            input_states=(record(state),),
            retired_ops_epoch=EPOCH,
            authority=issue_delete_ops_finalization_authority(),
        ),
    )


@covers("runtime.persist_ops_lifecycle")
async def _persist_ops_lifecycle(c: Ctx) -> None:
    persist = c.op("runtime.persist_ops_lifecycle")
    assert await persist(RT, OpsSnapshot(epoch_id=EPOCH)) is None
    assert await c.astore.runtime.load_ops_lifecycle(RT) == OpsSnapshot(epoch_id=EPOCH)
    await _finalize(c, StoredInputState.new_accepted())
    error = await c.refused(OpsLifecycleEpochRetired, persist(RT, OpsSnapshot(epoch_id=EPOCH)))
    assert EPOCH in str(error)
    await c.refused(InvalidInput, persist(RT, "not a snapshot"))


@covers("runtime.initialize_ops_lifecycle_if_absent")
async def _initialize_ops_if_absent(c: Ctx) -> None:
    init = c.op("runtime.initialize_ops_lifecycle_if_absent")
    assert await init(RT, OpsSnapshot(epoch_id=EPOCH)) == OpsSnapshot(epoch_id=EPOCH)
    # present: the stored snapshot is returned, the candidate is not written
    assert await c.unchanged(init(RT, OpsSnapshot(epoch_id="epoch-2"))) == OpsSnapshot(
        epoch_id=EPOCH
    )
    await _finalize(c, StoredInputState.new_accepted())
    await c.refused(OpsLifecycleEpochRetired, init(RT, OpsSnapshot(epoch_id=EPOCH)))


@covers("runtime.load_ops_lifecycle")
async def _load_ops_lifecycle(c: Ctx) -> None:
    load = c.op("runtime.load_ops_lifecycle")
    assert await load(RT) is None
    await c.astore.runtime.persist_ops_lifecycle(RT, OpsSnapshot(epoch_id=EPOCH))
    assert await load(RT) == OpsSnapshot(epoch_id=EPOCH)


@covers("runtime.delete_ops_lifecycle")
async def _delete_ops_lifecycle(c: Ctx) -> None:
    await c.astore.runtime.persist_ops_lifecycle(RT, OpsSnapshot(epoch_id=EPOCH))
    assert await c.op("runtime.delete_ops_lifecycle")(RT) is None
    assert await c.astore.runtime.load_ops_lifecycle(RT) is None
    await c.op("runtime.delete_ops_lifecycle")(RT)  # absent: nothing to delete


@covers("runtime.commit_unregister_finalization", modes=("call",))
async def _commit_unregister_finalization(c: Ctx) -> None:
    await c.astore.runtime.persist_ops_lifecycle(RT, OpsSnapshot(epoch_id=EPOCH))
    state = StoredInputState.new_accepted()
    await _finalize(c, state)
    assert await c.astore.runtime.load_ops_lifecycle(RT) is None
    assert await c.astore.runtime.load_runtime_state(RT) == "idle"
    assert await c.astore.runtime.load_input_states(RT) == [state]
    finalize = c.op("runtime.commit_unregister_finalization")
    await c.refused((InvalidInput, WriteFailed), finalize(RT, "not a finalization"))


# --------------------------------------------------------------------------
# Mob hosts


@covers("runtime.put_mob_host_binding_if_absent")
async def _put_mob_if_absent(c: Ctx) -> None:
    put = c.op("runtime.put_mob_host_binding_if_absent")
    assert await put("mob-a", b"r1") is True
    assert await c.unchanged(put("mob-a", b"r2")) is False
    assert await c.astore.runtime.load_mob_host_binding("mob-a") == b"r1"
    await c.refused(InvalidInput, put(7, b"r1"))  # not a str
    await c.refused(InvalidInput, put("mob-b", "not bytes"))


@covers("runtime.compare_and_put_mob_host_binding")
async def _compare_and_put_mob(c: Ctx) -> None:
    await c.astore.runtime.put_mob_host_binding_if_absent("mob-a", b"r1")
    cas = c.op("runtime.compare_and_put_mob_host_binding")
    assert await c.unchanged(cas("mob-a", b"stale", b"r2")) is False
    assert await cas("mob-a", b"r1", b"r2") is True
    assert await c.astore.runtime.load_mob_host_binding("mob-a") == b"r2"
    await c.refused(InvalidInput, cas("mob-a", "not bytes", b"r3"))


@covers("runtime.delete_mob_host_binding")
async def _delete_mob(c: Ctx) -> None:
    await c.astore.runtime.put_mob_host_binding_if_absent("mob-a", b"r1")
    delete = c.op("runtime.delete_mob_host_binding")
    assert await c.unchanged(delete("mob-a", b"stale")) is False
    assert await delete("mob-a", b"r1") is True
    assert await c.astore.runtime.load_mob_host_binding("mob-a") is None


@covers("runtime.revoke_mob_host_binding")
async def _revoke_mob(c: Ctx) -> None:
    await c.astore.runtime.put_mob_host_binding_if_absent("mob-a", b"r1")
    revoke = c.op("runtime.revoke_mob_host_binding")
    assert await c.unchanged(revoke("mob-a", b"stale", b"receipt")) is False
    assert await revoke("mob-a", b"r1", b"receipt") is True
    assert await c.astore.runtime.load_mob_host_binding("mob-a") is None
    assert await c.astore.runtime.load_mob_host_revocation("mob-a") == b"receipt"


@covers("runtime.load_mob_host_binding")
async def _load_mob(c: Ctx) -> None:
    load = c.op("runtime.load_mob_host_binding")
    assert await load("mob-a") is None
    await c.astore.runtime.put_mob_host_binding_if_absent("mob-a", b"r1")
    assert await load("mob-a") == b"r1"
    await c.refused(InvalidInput, load(7))


@covers("runtime.list_mob_host_bindings")
async def _list_mobs(c: Ctx) -> None:
    listed = c.op("runtime.list_mob_host_bindings")
    assert await listed() == []
    await c.astore.runtime.put_mob_host_binding_if_absent("mob-b", b"r2")
    await c.astore.runtime.put_mob_host_binding_if_absent("mob-a", b"r1")
    assert await listed() == [("mob-a", b"r1"), ("mob-b", b"r2")]


@covers("runtime.load_mob_host_revocation")
async def _load_revocation(c: Ctx) -> None:
    load = c.op("runtime.load_mob_host_revocation")
    assert await load("mob-a") is None
    await c.astore.runtime.put_mob_host_binding_if_absent("mob-a", b"r1")
    await c.astore.runtime.revoke_mob_host_binding("mob-a", b"r1", b"receipt")
    assert await load("mob-a") == b"receipt"
    await c.refused(InvalidInput, load(7))


@covers("runtime.list_mob_host_revocations")
async def _list_revocations(c: Ctx) -> None:
    listed = c.op("runtime.list_mob_host_revocations")
    assert await listed() == []
    for mob in ("mob-b", "mob-a"):
        await c.astore.runtime.put_mob_host_binding_if_absent(mob, b"r")
        await c.astore.runtime.revoke_mob_host_binding(mob, b"r", mob.encode())
    assert await listed() == [("mob-a", b"mob-a"), ("mob-b", b"mob-b")]


# --------------------------------------------------------------------------
# OAuth flow state


@covers("runtime.load_auth_oauth_flow_snapshot")
async def _load_oauth(c: Ctx) -> None:
    load = c.op("runtime.load_auth_oauth_flow_snapshot")
    assert await load() is None
    await c.astore.runtime.persist_auth_oauth_flow_snapshot(b"flow-1")
    assert await load() == b"flow-1"


@covers("runtime.persist_auth_oauth_flow_snapshot")
async def _persist_oauth(c: Ctx) -> None:
    persist = c.op("runtime.persist_auth_oauth_flow_snapshot")
    assert await persist(b"flow-1") is None
    await persist(b"flow-2")
    assert await c.astore.runtime.load_auth_oauth_flow_snapshot() == b"flow-2"
    await c.refused(InvalidInput, persist("text"))


class Refuse(Exception):
    """Raised by an OAuth update callback."""


@covers("runtime.update_auth_oauth_flow_snapshot")
async def _update_oauth(c: Ctx) -> None:
    update = c.op("runtime.update_auth_oauth_flow_snapshot")
    seen: list[bytes | None] = []

    def bump(current: bytes | None) -> bytes:
        seen.append(current)
        return b"1" if current is None else str(int(current) + 1).encode()

    assert await update(bump) is None
    await update(bump)
    assert seen[-2:] == [None, b"1"]
    assert await c.astore.runtime.load_auth_oauth_flow_snapshot() == b"2"

    def refuse(current: bytes | None) -> bytes:
        raise Refuse

    await c.refused(Refuse, update(refuse))  # the callback's own error, unchanged
    await c.refused(InvalidInput, update(lambda current: "text"))


@covers("runtime.reencrypt_auth_oauth_flow_snapshot")
async def _reencrypt_oauth(c: Ctx) -> None:
    reencrypt = c.op("runtime.reencrypt_auth_oauth_flow_snapshot")
    assert await c.unchanged(reencrypt()) is False  # no payload stored
    await c.astore.runtime.persist_auth_oauth_flow_snapshot(b"flow-1")
    assert await reencrypt() is True  # no codec: rewritten as it is
    assert await c.astore.runtime.load_auth_oauth_flow_snapshot() == b"flow-1"


@covers("runtime.auth_authority_key", modes=("call",))
async def _auth_authority_key(c: Ctx) -> None:
    key = await c.op("runtime.auth_authority_key")()
    assert key == c.astore.store.runtime.auth_authority_key()  # no database access
    assert isinstance(key, str) and key.startswith(("sqlite:", "postgresql://"))
