"""The runtime's compare-and-set fences hold in SQL on their own, on both backends.

Every compare-and-set of the runtime store compares in Python under the
write lock, then writes with ``UPDATE`` / ``DELETE ... WHERE`` the value it
compared and checks the row count. Under the lock the fence always matches,
so these tests play the only writer that can make it miss — one that
bypasses the lock — and check that the fence, not the lock, stops the write:
:class:`~agentkeep.errors.ConcurrentModification` (raised as itself by
``uow.runtime`` and ``store.runtime``), and nothing of the operation written.

The fences: the input-state batch swap, snapshot replace / clear if current,
mob binding compare-and-put / delete / revoke. Each is driven four ways:

* the fence function called directly with a stale expected value;
* the operation, one call, with a hook that changes the row between the
  operation's locked read (and Python compare) and its write, through the
  unit's own connection (the unit rolls back: the row is as it was);
* the same inside a caller's ``store.write()`` unit (the changed row stays,
  nothing of the operation does: its savepoint undid the rest);
* on Postgres, a truly concurrent writer: another connection commits the
  change between the read and the write (the lock is advisory, the row
  itself is not locked by a read); the fenced write then sees it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import pytest
from sqlalchemy import bindparam as p
from sqlalchemy import update

from agentkeep.errors import ConcurrentModification
from agentkeep.runtime import input_cas, mob, snapshots
from agentkeep.runtime.access import RuntimeAccess
from agentkeep.runtime.domain import ReferenceDomain, StoredInputState
from agentkeep.runtime.models import InputStateRow, MobHostBindingRow, SessionSnapshotRow
from agentkeep.statements import Statement
from agentkeep.store import Store

from .builders import encode, user_session
from .support import RT, accepted, raw_exec, replacement_records

D: Final = ReferenceDomain()
MOB: Final = "mob-fenced"
R1, R2, RX = b"record-1", b"record-2", b"record-x"
S1, S2, SX = (encode(user_session(text)) for text in ("one", "two", "changed"))

# The lock-bypassing writer, on the unit's own connection (the only other
# writer SQLite admits while the unit holds the write lock is the unit itself).
_OVERWRITE_INPUT: Final = Statement(
    update(InputStateRow)
    .values(state_json=p("data"))
    .where(InputStateRow.runtime_id == p("rt"), InputStateRow.input_id == p("iid")),
    name="test.fences.overwrite_input",
)
_OVERWRITE_SNAPSHOT: Final = Statement(
    update(SessionSnapshotRow)
    .values(session_snapshot=p("data"))
    .where(SessionSnapshotRow.runtime_id == p("rt")),
    name="test.fences.overwrite_snapshot",
)
_OVERWRITE_BINDING: Final = Statement(
    update(MobHostBindingRow)
    .values(record_json=p("data"))
    .where(MobHostBindingRow.mob_id == p("id")),
    name="test.fences.overwrite_binding",
)


@dataclass(frozen=True)
class Fence:
    """One compare-and-set, with a stale call of its fence and a writer that races it."""

    name: str
    setup: Callable[[Store], Any]
    #: The operation, on ``store.runtime`` or ``uow.runtime``.
    op: Callable[[Any, Any], object]
    #: The module and function name the operation reads the compared value through.
    reader: tuple[Any, str]
    #: The racing change: a statement and its parameters, as raw SQL for another connection.
    change: tuple[Statement, Callable[[Any], dict[str, Any]]]
    change_sql: str
    #: The fence function with an expected value that is not stored.
    stale: Callable[[RuntimeAccess, Any], None]
    #: What the fence protects, read through ``store.runtime`` / ``uow.runtime``.
    state: Callable[[Any, Any], object]
    before: Callable[[Any], object]
    changed: Callable[[Any], object]


def _inputs_setup(store: Store) -> list[StoredInputState]:
    states = accepted(2)
    store.runtime.persist_input_states_atomically(RT, states)
    return states


def _counts(rt: Any, states: list[StoredInputState]) -> dict[str, int]:
    return {s.input_id: s.recovery_count for s in rt.load_input_states(RT)}


def _snapshot_setup(store: Store) -> None:
    store.runtime.commit_session_snapshot(RT, S1)


def _snapshot_state(rt: Any, _ctx: Any) -> object:
    return rt.load_session_snapshot(RT), rt.is_runtime_projection_quarantined(RT)


def _mob_setup(store: Store) -> None:
    assert store.runtime.put_mob_host_binding_if_absent(MOB, R1) is True


def _mob_state(rt: Any, _ctx: Any) -> object:
    return rt.load_mob_host_binding(MOB), rt.load_mob_host_revocation(MOB)


_SNAPSHOT_CHANGE: Final = (_OVERWRITE_SNAPSHOT, lambda _ctx: {"rt": RT, "data": SX})
_SNAPSHOT_SQL: Final = (
    "UPDATE runtime_session_snapshots SET session_snapshot = :data WHERE runtime_id = :rt"
)
_BINDING_CHANGE: Final = (_OVERWRITE_BINDING, lambda _ctx: {"id": MOB, "data": RX})
_BINDING_SQL: Final = "UPDATE runtime_mob_host_bindings SET record_json = :data WHERE mob_id = :id"

FENCES: Final = [
    Fence(
        name="input_state_batch_cas",
        setup=_inputs_setup,
        op=lambda rt, states: rt.compare_and_swap_input_states_atomically(
            RT, states, replacement_records(states, 1)
        ),
        reader=(input_cas, "stored_input_state"),
        change=(
            _OVERWRITE_INPUT,
            lambda states: {
                "rt": RT,
                "iid": states[0].input_id,
                "data": D.encode_input_state(states[0].with_recovery_count(5)),
            },
        ),
        change_sql=(
            "UPDATE runtime_input_states SET state_json = :data "
            "WHERE runtime_id = :rt AND input_id = :iid"
        ),
        stale=lambda access, states: input_cas.swap_input_states_if_current(
            access,
            RT,
            [
                (
                    states[0].input_id,
                    D.encode_input_state(states[0].with_recovery_count(9)),
                    D.encode_input_state(states[0].with_recovery_count(1)),
                )
            ],
        ),
        state=_counts,
        before=lambda states: {s.input_id: 0 for s in states},
        changed=lambda states: {states[0].input_id: 5, states[1].input_id: 0},
    ),
    Fence(
        name="replace_session_snapshot_if_current",
        setup=_snapshot_setup,
        op=lambda rt, _ctx: rt.replace_session_snapshot_if_current(RT, S1, S2),
        reader=(snapshots, "stored_snapshot"),
        change=_SNAPSHOT_CHANGE,
        change_sql=_SNAPSHOT_SQL,
        stale=lambda access, _ctx: snapshots.replace_snapshot_if_stored(access, RT, SX, S2),
        state=_snapshot_state,
        before=lambda _ctx: (S1, False),
        changed=lambda _ctx: (SX, False),
    ),
    Fence(
        name="clear_session_snapshot_if_current",
        setup=_snapshot_setup,
        op=lambda rt, _ctx: rt.clear_session_snapshot_if_current(RT, S1),
        reader=(snapshots, "stored_snapshot"),
        change=_SNAPSHOT_CHANGE,
        change_sql=_SNAPSHOT_SQL,
        stale=lambda access, _ctx: snapshots.delete_snapshot_if_stored(access, RT, SX),
        state=_snapshot_state,
        before=lambda _ctx: (S1, False),
        changed=lambda _ctx: (SX, False),
    ),
    Fence(
        name="compare_and_put_mob_host_binding",
        setup=_mob_setup,
        op=lambda rt, _ctx: rt.compare_and_put_mob_host_binding(MOB, R1, R2),
        reader=(mob, "stored_binding"),
        change=_BINDING_CHANGE,
        change_sql=_BINDING_SQL,
        stale=lambda access, _ctx: mob.replace_binding_if_stored(access, MOB, RX, R2),
        state=_mob_state,
        before=lambda _ctx: (R1, None),
        changed=lambda _ctx: (RX, None),
    ),
    Fence(
        name="delete_mob_host_binding",
        setup=_mob_setup,
        op=lambda rt, _ctx: rt.delete_mob_host_binding(MOB, R1),
        reader=(mob, "stored_binding"),
        change=_BINDING_CHANGE,
        change_sql=_BINDING_SQL,
        stale=lambda access, _ctx: mob.delete_binding_if_stored(access, MOB, RX),
        state=_mob_state,
        before=lambda _ctx: (R1, None),
        changed=lambda _ctx: (RX, None),
    ),
    Fence(
        name="revoke_mob_host_binding",
        setup=_mob_setup,
        op=lambda rt, _ctx: rt.revoke_mob_host_binding(MOB, R1, b"receipt"),
        reader=(mob, "stored_binding"),
        change=_BINDING_CHANGE,
        change_sql=_BINDING_SQL,
        stale=lambda access, _ctx: mob.delete_binding_if_stored(access, MOB, RX),
        state=_mob_state,
        before=lambda _ctx: (R1, None),
        changed=lambda _ctx: (RX, None),
    ),
]

fences = pytest.mark.parametrize("fence", FENCES, ids=[f.name for f in FENCES])


def _race_after_read(
    monkeypatch: pytest.MonkeyPatch, fence: Fence, write: Callable[[RuntimeAccess], None]
) -> None:
    """Make the operation's first locked read be followed at once by ``write``."""
    module, name = fence.reader
    read = getattr(module, name)
    fired = [False]

    def read_then_race(access: RuntimeAccess, *args: Any) -> Any:
        value = read(access, *args)
        if not fired[0]:
            fired[0] = True
            write(access)
        return value

    monkeypatch.setattr(module, name, read_then_race)


def _same_connection(fence: Fence, ctx: Any) -> Callable[[RuntimeAccess], None]:
    stmt, params = fence.change
    return lambda access: access.db.execute(stmt, params(ctx)).close()


@fences
def test_the_fence_refuses_a_stale_expected_value(store: Store, fence: Fence) -> None:
    ctx = fence.setup(store)
    with store.write() as uow:
        with pytest.raises(ConcurrentModification, match="changed under the write lock"):
            fence.stale(uow.runtime.access, ctx)
        assert fence.state(uow.runtime, ctx) == fence.before(ctx)
    assert fence.state(store.runtime, ctx) == fence.before(ctx)


@fences
def test_a_change_after_the_compare_is_refused_by_the_fence(
    store: Store, fence: Fence, monkeypatch: pytest.MonkeyPatch
) -> None:
    ctx = fence.setup(store)
    _race_after_read(monkeypatch, fence, _same_connection(fence, ctx))
    # The one-call form raises ConcurrentModification itself (not WriteFailed),
    # and its unit rolls back: the row is as it was, the operation wrote nothing.
    with pytest.raises(ConcurrentModification):
        fence.op(store.runtime, ctx)
    monkeypatch.undo()
    assert fence.state(store.runtime, ctx) == fence.before(ctx)


@fences
def test_inside_a_unit_the_raced_operation_leaves_nothing_behind(
    store: Store, fence: Fence, monkeypatch: pytest.MonkeyPatch
) -> None:
    ctx = fence.setup(store)
    _race_after_read(monkeypatch, fence, _same_connection(fence, ctx))
    with store.write() as uow:
        with pytest.raises(ConcurrentModification):
            fence.op(uow.runtime, ctx)
        # The racing write stays; nothing of the operation does (its savepoint).
        assert fence.state(uow.runtime, ctx) == fence.changed(ctx)
    monkeypatch.undo()
    assert fence.state(store.runtime, ctx) == fence.changed(ctx)


@fences
def test_a_committed_concurrent_writer_is_refused_by_the_fence(
    store: Store, db_url: str, backend: str, fence: Fence, monkeypatch: pytest.MonkeyPatch
) -> None:
    if backend != "postgres":
        pytest.skip("SQLite admits no second writer while the write lock is held")
    ctx = fence.setup(store)
    _, params = fence.change
    _race_after_read(
        monkeypatch, fence, lambda _access: raw_exec(db_url, fence.change_sql, params=params(ctx))
    )
    with pytest.raises(ConcurrentModification):
        fence.op(store.runtime, ctx)
    monkeypatch.undo()
    assert fence.state(store.runtime, ctx) == fence.changed(ctx)
