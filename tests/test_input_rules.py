"""The input rules of issue 13: one text rule on both backends, wrong types typed.

* Text (:mod:`agentkeep.text`): a NUL or a lone surrogate in any string bound
  to a statement is :class:`~agentkeep.errors.InvalidInput` on SQLite as on
  Postgres (Postgres cannot store NUL; SQLite could, and refuses it too), and
  the refused call leaves the rows as they were. A NUL *inside a JSON value*
  is escaped by the canonical encoder (``\\u0000``) and round-trips on both.
* Types (:mod:`agentkeep.arguments`): a value of the wrong Python type where a
  record, bytes or a sequence is expected is ``InvalidInput`` naming the
  parameter, before anything runs.
* The :class:`~agentkeep.AsyncStore` operations (native drivers: aiosqlite,
  asyncpg, psycopg_async) run the same checks.

The property suite over every operation is tests/test_error_types.py; this
file pins the rules on named fields with the rows checked.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pydantic
import pytest

from agentkeep import AsyncStore, InvalidInput, RunRecord, Store
from agentkeep.runtime import OpsSnapshot
from agentkeep.sessions.domain import (
    Acquired,
    LeaseOwnerIdentity,
    NextTurnIngress,
    PendingTurnInputDraft,
    QueuedWorkCompletion,
    QueuedWorkDraft,
    QueuedWorkPayload,
    TurnInputCompletion,
)
from agentkeep.sessions.records import SessionMeta
from agentkeep.text import check_text, text_problem
from tests.runtime.builders import encode, user_session
from tests.support import query

A = LeaseOwnerIdentity(owner_id="owner-A", incarnation_id="inc-A")
BAD_TEXT = ["a\x00b", "\x00", "x\ud800", "\udfff", "\ud83d\x00"]
#: What a refused value raises: InvalidInput from the store, or pydantic's
#: ValidationError when the record refuses it as it is constructed.
REFUSED = (InvalidInput, pydantic.ValidationError)


def rows(store: Store, table: str) -> list[dict[str, Any]]:
    return sorted(query(store, f"SELECT * FROM {table}"), key=repr)


def test_the_text_rule() -> None:
    assert text_problem("plain") is None
    assert text_problem("ok \U0001f600 é") is None
    for bad in BAD_TEXT:
        assert text_problem(bad) is not None
        with pytest.raises(InvalidInput) as info:
            check_text(bad, "field")
        assert info.value.field == "field"
    with pytest.raises(InvalidInput, match="expected a string"):
        check_text({}, "field")  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", BAD_TEXT)
def test_session_meta_text_is_refused_on_both_backends(store: Store, bad: str) -> None:
    """NUL used to be stored on SQLite and refused on Postgres: now refused on both."""
    meta = SessionMeta(session_id="sess-1", session_name="first", created_at="2024", model="m")
    store.commits.save_session_meta(meta)
    before = rows(store, "session_meta")
    for field in ("session_name", "model", "created_at", "cwd", "session_id"):
        # model_copy does not validate: the store itself must refuse it
        with pytest.raises(InvalidInput):
            store.commits.save_session_meta(meta.model_copy(update={field: bad}))
        assert rows(store, "session_meta") == before
    assert rows(store, "session_meta") == before
    assert store.commits.load_session_meta("sess-1") == meta


@pytest.mark.parametrize("bad", BAD_TEXT)
def test_runtime_ids_are_refused_on_both_backends(store: Store, bad: str) -> None:
    snapshot = encode(user_session("hello"))
    with pytest.raises(InvalidInput):
        store.runtime.commit_session_snapshot(f"rt-{bad}", snapshot)
    with pytest.raises(InvalidInput):
        store.runtime.persist_ops_lifecycle(bad, OpsSnapshot(epoch_id="e-1"))
    with pytest.raises(InvalidInput):
        store.runtime.load_session_snapshot(bad)
    assert rows(store, "runtime_session_snapshots") == []
    assert rows(store, "runtime_ops_lifecycle") == []


@pytest.mark.parametrize("bad", BAD_TEXT)
def test_ids_in_records_and_arguments_are_refused(store: Store, bad: str) -> None:
    """Run ids, queue and turn-input drafts, lease owners: refused, nothing written."""
    with pytest.raises(REFUSED):
        store.runs.create(RunRecord.new(f"R-{bad}", "T-1", created_at=1))
    with pytest.raises(InvalidInput):
        store.runs.get(f"R-{bad}")
    payload = (QueuedWorkPayload(kind="user_input", body=1),)
    with pytest.raises(REFUSED):
        store.queue.enqueue_queued_work(QueuedWorkDraft(session_id=bad, payloads=payload))
    with pytest.raises(REFUSED):
        store.queue.enqueue_queued_work(
            QueuedWorkDraft(session_id="sess-1", source_key=bad, payloads=payload)
        )
    with pytest.raises(REFUSED):
        store.turn_inputs.enqueue_pending_turn_input(
            PendingTurnInputDraft(session_id=bad, ingress=NextTurnIngress(), input={"n": 1})
        )
    with pytest.raises(REFUSED):
        owner = LeaseOwnerIdentity(owner_id=f"owner-{bad}", incarnation_id="inc")
        store.leases.try_claim_session_execution_lease("sess-1", owner, 1_000)
    with pytest.raises(InvalidInput):
        store.leases.try_claim_session_execution_lease(f"sess-{bad}", A, 1_000)
    for table in ("runs", "queued_work_batches", "pending_turn_inputs", "session_execution_leases"):
        assert rows(store, table) == [], table


@pytest.mark.parametrize("bad", BAD_TEXT)
def test_a_bad_id_in_a_completion_is_refused_before_the_lease_is_judged(
    store: Store, bad: str
) -> None:
    """A completion naming a row by a bad id is InvalidInput on every backend and driver,
    even when the fence is also stale: the ids are checked before anything is sent (a
    pipelining driver sends the ownership read with the lock, before the fence is judged)."""
    acquired = store.leases.try_claim_session_execution_lease("sess-1", A, 60_000)
    assert isinstance(acquired, Acquired)
    lease = acquired.lease
    store.leases.release_session_execution_lease(lease)  # the fence is stale from here
    before = {t: rows(store, t) for t in ("queued_work_batches", "pending_turn_inputs")}
    before["leases"] = rows(store, "session_execution_leases")
    queued = QueuedWorkCompletion(
        session_id="sess-1", claim_id="c", lease_token=lease.lease_token, batch_ids=("b", bad)
    )
    with pytest.raises(InvalidInput, match=r"completion\.batch_ids\[1\]"):
        store.queue.complete_queued_work_claim(lease, queued)
    inputs = TurnInputCompletion(
        session_id="sess-1", claim_id="c", lease_token=lease.lease_token, input_ids=(bad,)
    )
    with pytest.raises(InvalidInput, match=r"completion\.input_ids\[0\]"):
        store.turn_inputs.complete_turn_input_claim(lease, inputs)
    after = {t: rows(store, t) for t in ("queued_work_batches", "pending_turn_inputs")}
    after["leases"] = rows(store, "session_execution_leases")
    assert after == before


def test_nul_inside_json_values_round_trips_on_both_backends(store: Store) -> None:
    """The canonical JSON escapes NUL (``\\u0000``): stored as text, read back equal."""
    body = {"text": "a\x00b", "k\x00": ["\x00"]}
    batch = store.queue.enqueue_queued_work(
        QueuedWorkDraft(
            session_id="sess-1", payloads=(QueuedWorkPayload(kind="user_input", body=body),)
        )
    )
    (listed,) = store.queue.list_queued_work("sess-1")
    assert listed.batch_id == batch.batch_id
    assert listed.items[0].payload.body == body
    draft = PendingTurnInputDraft(session_id="sess-1", ingress=NextTurnIngress(), input=body)
    stored = store.turn_inputs.enqueue_pending_turn_input(draft)
    (pending,) = store.turn_inputs.list_pending_turn_inputs("sess-1")
    assert (pending.input_id, pending.input) == (stored.input_id, body)


def test_wrong_python_types_are_refused_by_name_before_anything_runs(store: Store) -> None:
    snapshot = encode(user_session("hello"))
    cases: list[tuple[Any, tuple[Any, ...], str]] = [
        (store.runtime.commit_session_snapshot, ("rt-1", {"a": 1}), "session_snapshot"),
        (store.runtime.commit_session_snapshot, ("rt-1", None), "session_snapshot"),
        (store.runtime.persist_ops_lifecycle, ("rt-1", {"epoch_id": "e"}), "snapshot"),
        (store.runtime.persist_input_states_atomically, ("rt-1", {}), "records"),
        (store.runtime.update_auth_oauth_flow_snapshot, ([1],), "update"),
        (store.commits.commit_runtime_state, ({"session_id": "s"},), "commit"),
        (store.queue.enqueue_queued_work, ([],), "draft"),
    ]
    for fn, args, field in cases:
        with pytest.raises(InvalidInput) as info:
            fn(*args)
        assert info.value.field == field, (fn, info.value)
    store.runtime.commit_session_snapshot("rt-1", snapshot)  # the right types still pass
    assert store.runtime.load_session_snapshot("rt-1") == snapshot
    assert len(rows(store, "runtime_session_snapshots")) == 1


def test_units_of_work_check_runtime_argument_types_too(store: Store) -> None:
    """``uow.runtime.<op>`` (the runtime repository's parts) runs the same argument check."""
    cases: list[tuple[str, tuple[Any, ...], str]] = [
        ("persist_ops_lifecycle", ("rt-1", {"epoch_id": "e"}), "snapshot"),
        ("commit_session_snapshot", ("rt-1", [1]), "session_snapshot"),
        ("update_auth_oauth_flow_snapshot", ([1],), "update"),
        ("persist_input_state", ("rt-1", None), "record"),
    ]
    for name, args, field in cases:
        with pytest.raises(InvalidInput) as info, store.write() as uow:
            getattr(uow.runtime, name)(*args)
        assert info.value.field == field, (name, info.value)
    assert rows(store, "runtime_ops_lifecycle") == []
    assert rows(store, "runtime_session_snapshots") == []


def test_the_async_store_runs_the_same_checks(async_url: str) -> None:
    async def scenario() -> None:
        astore = await AsyncStore.open(async_url)
        try:
            with pytest.raises(InvalidInput):
                await astore.runs.get("R-\ud800")
            with pytest.raises(InvalidInput):
                await astore.commits.save_session_meta(
                    SessionMeta(session_id="s", session_name="a\x00", created_at="x", model="m")
                )
            with pytest.raises(InvalidInput) as info:
                await astore.runtime.commit_session_snapshot("rt-1", {"a": 1})  # type: ignore[arg-type]
            assert info.value.field == "session_snapshot"
            assert await astore.commits.load_session_meta("s") is None
        finally:
            await astore.close()

    asyncio.run(scenario())
