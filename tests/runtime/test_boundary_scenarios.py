"""Boundary scenarios beyond the seed (spec runtime §5.2 items 19–22, 24–26) and invariants.

* §5.2-19: the exact error precedence of ``atomic_apply*`` — decode beats
  intent validation beats the session-store key (all three before any
  database access: they answer at once while another connection holds the
  write lock), then finalized replay, then the supersession verdict, then
  outbox conflict, then the receipt fence.
* §5.2-20/21/22: boundary without a session, finalize without a snapshot,
  finalize of an unknown key.
* §5.2-24: the identical-bytes fast path still holds the snapshot to the outbox.
* §5.2-25: every operation on runtime A leaves runtime B's rows untouched.
* §5.2-26: the placeholder exception, differentially against the non-boundary writer.
* I1–I5 as a property: random sequences of snapshot, boundary, outbox and
  quarantine operations; after every step, a refused call changed no row and
  the outbox, snapshot and quarantine invariants hold. I11 on the database.

Every test runs on SQLite and Postgres.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import event as observe
from hypothesis import strategies as st
from sqlalchemy import create_engine

from agentkeep.errors import InvalidInput
from agentkeep.runtime import (
    CompactionIntent,
    Message,
    ReadFailed,
    RuntimeNotFound,
    RuntimeStoreError,
    Session,
    SessionKeyMismatch,
    SessionSnapshotSuperseded,
    StoredInputState,
    WriteFailed,
)
from agentkeep.runtime.receipts import MAX_U64
from agentkeep.store import Store
from tests.support import count_units

from .builders import (
    accepted_input,
    completed,
    encode,
    idle_lifecycle,
    input_record,
    malformed_history_blob,
    receipt,
    runtime_state,
    session_of,
    session_with_compaction_intent,
    snapshot_with_raw_intents,
    unbacked_intent,
    user_session,
    v0_session_blob,
    with_summary_tokens,
)
from .support import NOTHING, RT, raw_exec, raw_snapshot


def _empty(url: str) -> dict[str, list[tuple[Any, ...]]]:
    return runtime_state(url, NOTHING)


# --------------------------------------------------------------------------
# §5.2-19 Error precedence: the checks before any database access


@contextmanager
def _write_lock_held(url: str, runtime_id: str) -> Iterator[None]:
    """Hold ``runtime_id``'s write lock on another connection (SQLite: the database's).

    The holder takes the lock through a write that changes nothing
    (clearing an absent snapshot) and keeps its unit open until exit.
    """
    holder = Store.open(url)
    held, release = threading.Event(), threading.Event()
    failures: list[BaseException] = []

    def hold() -> None:
        try:
            with holder.write() as uow:
                uow.runtime.clear_session_snapshot(runtime_id)
                held.set()
                release.wait(60)
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            failures.append(exc)
            held.set()

    thread = threading.Thread(target=hold)
    thread.start()
    try:
        assert held.wait(60) and not failures, failures
        yield
    finally:
        release.set()
        thread.join(60)
        holder.close()
    assert not failures, failures


def test_pre_database_refusals_answer_while_the_write_lock_is_held(db_url: str) -> None:
    s = user_session("mine")
    other = Session.new()
    bad_intent = snapshot_with_raw_intents(s, [unbacked_intent(s.id)])
    impatient = Store.open(db_url, busy_timeout_ms=1000, retry_attempts=1)
    checkouts = count_units(impatient)
    rt = impatient.runtime
    try:
        with _write_lock_held(db_url, RT):
            # Decode error beats intent validation and the key mismatch.
            with pytest.raises(WriteFailed, match="failed to decode incoming session snapshot"):
                rt.atomic_apply(RT, b"{not json", receipt(1), [input_record()], other.id)
            with pytest.raises(WriteFailed, match="failed to decode incoming session snapshot"):
                rt.atomic_apply_with_machine_lifecycle(
                    RT, b"[]", receipt(1), idle_lifecycle(), [input_record()], other.id
                )
            # Intent validation beats the key mismatch.
            with pytest.raises(WriteFailed, match="not backed"):
                rt.atomic_apply(RT, bad_intent, receipt(1), [input_record()], other.id)
            # The key mismatch itself.
            with pytest.raises(SessionKeyMismatch):
                rt.atomic_apply(RT, encode(s), receipt(1), [input_record()], other.id)
            with pytest.raises(SessionKeyMismatch):
                rt.atomic_apply_with_machine_lifecycle(
                    RT, encode(s), receipt(1), idle_lifecycle(), [input_record()], other.id
                )
            assert checkouts[0] == 0  # never took a connection
            # Control: a call that does need the database waits, then fails busy.
            with pytest.raises(WriteFailed):
                rt.atomic_apply(RT, encode(s), receipt(1), [input_record()], s.id)
            assert checkouts[0] >= 1
    finally:
        impatient.close()
    assert runtime_state(db_url, RT) == _empty(db_url)


def test_bad_input_id_is_refused_before_the_database(db_url: str) -> None:
    """A boundary's input states are checked before the unit opens, like its snapshot.

    (runtime brief: pure work runs before ``_write``, so a refused call never
    waits for the write lock nor writes and rolls back.)
    """
    s = user_session("mine")
    bad = StoredInputState(input_id="not-a-uuid", current_state="accepted")
    impatient = Store.open(db_url, busy_timeout_ms=400, retry_attempts=1)
    checkouts = count_units(impatient)
    try:
        with _write_lock_held(db_url, RT):
            with pytest.raises(InvalidInput, match="input_id"):
                impatient.runtime.atomic_apply(RT, encode(s), receipt(1), [bad], s.id)
            with pytest.raises(InvalidInput, match="input_id"):
                impatient.runtime.atomic_apply_with_machine_lifecycle(
                    RT, encode(s), receipt(1), idle_lifecycle(), [bad], s.id
                )
            assert checkouts[0] == 0
    finally:
        impatient.close()
    assert runtime_state(db_url, RT) == _empty(db_url)


def test_key_mismatch_beats_finalized_replay(store: Store, db_url: str) -> None:
    s, i = session_with_compaction_intent()
    store.runtime.atomic_apply(RT, encode(s), receipt(1), (), s.id)
    store.runtime.mark_compaction_projection_finalized(RT, i.projection)
    before = runtime_state(db_url, RT)
    with pytest.raises(SessionKeyMismatch):
        store.runtime.atomic_apply(RT, encode(s), receipt(2), (), Session.new().id)
    assert runtime_state(db_url, RT) == before


# --------------------------------------------------------------------------
# §5.2-19 Error precedence: inside the transaction


def test_finalized_replay_beats_supersession(store: Store, db_url: str) -> None:
    s, i = session_with_compaction_intent()
    store.runtime.atomic_apply(RT, encode(s), receipt(1), (), s.id)
    store.runtime.mark_compaction_projection_finalized(RT, i.projection)
    store.runtime.commit_session_snapshot(RT, encode(completed(s).with_message("user", "more")))
    before = runtime_state(db_url, RT)
    # Without the finalized intent the same stale snapshot is superseded ...
    with pytest.raises(SessionSnapshotSuperseded):
        store.runtime.atomic_apply(RT, encode(completed(s)), receipt(2), (), s.id)
    # ... with it, the replay error wins, on both boundary forms.
    with pytest.raises(WriteFailed, match="replays finalized compaction intent") as info:
        store.runtime.atomic_apply(RT, encode(s), receipt(2), [input_record()], s.id)
    assert not isinstance(info.value, SessionSnapshotSuperseded)
    with pytest.raises(WriteFailed, match="replays finalized compaction intent"):
        store.runtime.atomic_apply_with_machine_lifecycle(
            RT, encode(s), receipt(3), idle_lifecycle(), [input_record()], s.id
        )
    assert runtime_state(db_url, RT) == before


def test_supersession_beats_outbox_conflict_and_receipt_conflict(store: Store, db_url: str) -> None:
    s, i = session_with_compaction_intent()
    taken = receipt(1)
    store.runtime.atomic_apply(RT, encode(s), taken, (), s.id)
    store.runtime.commit_session_snapshot(RT, encode(s.with_message("user", "advanced")))
    before = runtime_state(db_url, RT)
    conflicting = snapshot_with_raw_intents(s, [with_summary_tokens(i, 99)])
    for data in (conflicting, encode(s)):
        with pytest.raises(SessionSnapshotSuperseded):
            store.runtime.atomic_apply(RT, data, taken, [input_record()], s.id)
        with pytest.raises(SessionSnapshotSuperseded):
            store.runtime.atomic_apply_with_machine_lifecycle(
                RT, data, taken, idle_lifecycle(), [input_record()], s.id
            )
    assert runtime_state(db_url, RT) == before


def test_outbox_conflict_beats_receipt_conflict(store: Store, db_url: str) -> None:
    s, i = session_with_compaction_intent()
    taken = receipt(1)
    store.runtime.atomic_apply(RT, encode(s), taken, (), s.id)
    before = runtime_state(db_url, RT)
    advanced = snapshot_with_raw_intents(s.with_message("user", "t"), [with_summary_tokens(i, 9)])
    with pytest.raises(WriteFailed, match="conflicting compaction outbox intent"):
        store.runtime.atomic_apply(RT, advanced, taken, [input_record()], s.id)
    with pytest.raises(WriteFailed, match="runtime_boundary_receipts"):
        store.runtime.atomic_apply(
            RT, encode(s.with_message("user", "t")), taken, [input_record()], s.id
        )
    assert runtime_state(db_url, RT) == before


def test_placeholder_path_ignores_the_guard_failure(store: Store, db_url: str) -> None:
    placeholder = session_of(("system", "A"))
    store.runtime.commit_session_snapshot(RT, encode(placeholder))
    incoming = session_of(("system", "B"), ("user", "x"), session_id=placeholder.id)
    with pytest.raises(WriteFailed, match="continuity"):  # the guard does reject it
        store.runtime.commit_session_snapshot(RT, encode(incoming))
    r = receipt(1)
    store.runtime.atomic_apply(RT, encode(incoming), r, [input_record()], incoming.id)
    assert store.runtime.load_session_snapshot(RT) == encode(incoming)
    assert store.runtime.load_boundary_receipt(RT, r.run_id, 1) == r


@pytest.mark.parametrize("terminal", [False, True], ids=["atomic_apply", "terminal"])
def test_no_previous_row_guard_failure_is_write_failed_never_superseded(
    store: Store, db_url: str, terminal: bool
) -> None:
    s, _ = user_session("a").rewrite(0, 1, [Message(role="user", content="b")], actor="t")
    incoherent = s.with_message("user", "c").model_copy(update={"history": s.history})
    with pytest.raises(WriteFailed, match="coherence|incoherent") as info:
        if terminal:
            store.runtime.atomic_apply_with_machine_lifecycle(
                RT, encode(incoherent), receipt(1), idle_lifecycle(), [input_record()], s.id
            )
        else:
            store.runtime.atomic_apply(RT, encode(incoherent), receipt(1), [input_record()], s.id)
    assert not isinstance(info.value, SessionSnapshotSuperseded)
    assert runtime_state(db_url, RT) == _empty(db_url)


def test_divergent_incoming_is_the_forward_guard_error(store: Store, db_url: str) -> None:
    """Neither succeeds the other: the forward guard's WriteFailed, not Superseded."""
    head = user_session("a", "b")
    store.runtime.commit_session_snapshot(RT, encode(head))
    before = runtime_state(db_url, RT)
    divergent = user_session("a", "c", session_id=head.id)
    with pytest.raises(WriteFailed, match="continuity") as info:
        store.runtime.atomic_apply(RT, encode(divergent), receipt(1), [input_record()], head.id)
    assert not isinstance(info.value, SessionSnapshotSuperseded)
    assert runtime_state(db_url, RT) == before


# --------------------------------------------------------------------------
# §5.2-20 Boundary without a session; §5.2-21/22 finalize edge cases


def test_20_boundary_without_session_writes_receipt_and_inputs_only(
    store: Store, db_url: str
) -> None:
    s, _ = session_with_compaction_intent()
    store.runtime.atomic_apply(RT, encode(s), receipt(1), (), s.id)
    store.runtime.clear_session_snapshot_if_current(RT, encode(s))
    before = runtime_state(db_url, RT)
    assert before["runtime_projection_quarantine"] == [(RT,)]
    inp = accepted_input()
    r = receipt(2)
    store.runtime.atomic_apply(RT, None, r, [input_record(inp)], s.id)
    after = runtime_state(db_url, RT)
    assert store.runtime.load_boundary_receipt(RT, r.run_id, 2) == r
    assert store.runtime.load_input_states(RT) == [inp]
    changed = {t for t in after if after[t] != before[t]}
    assert changed == {"runtime_boundary_receipts", "runtime_input_states"}
    assert store.runtime.is_runtime_projection_quarantined(RT)  # untouched


def test_20b_boundary_without_session_leaves_the_snapshot_alone(store: Store, db_url: str) -> None:
    s = user_session("kept")
    store.runtime.commit_session_snapshot(RT, encode(s))
    store.runtime.atomic_apply(RT, None, receipt(1))
    assert store.runtime.load_session_snapshot(RT) == encode(s)
    assert runtime_state(db_url, RT)["runtime_compaction_projection_outbox"] == []


def test_21_finalize_without_a_snapshot_row_still_tombstones(store: Store, db_url: str) -> None:
    s, i = session_with_compaction_intent()
    store.runtime.atomic_apply(RT, encode(s), receipt(1), (), s.id)
    store.runtime.clear_session_snapshot_if_current(RT, encode(s))
    store.runtime.mark_compaction_projection_finalized(RT, i.projection)
    state = runtime_state(db_url, RT)
    assert state["runtime_session_snapshots"] == []  # not recreated
    assert [row[-1] for row in state["runtime_compaction_projection_outbox"]] == ["finalized"]
    assert state["runtime_projection_quarantine"] == [(RT,)]  # no snapshot write, no clear
    assert store.runtime.load_pending_compaction_projections(RT) == []
    # The tombstone refuses the replay after the restart of the runtime's session, too.
    with pytest.raises(WriteFailed, match="replays finalized compaction intent"):
        store.runtime.atomic_apply(RT, encode(s), receipt(2), (), s.id)


def test_22_finalize_unknown_key_is_not_found_and_writes_nothing(store: Store, db_url: str) -> None:
    s, i = session_with_compaction_intent()
    store.runtime.commit_session_snapshot(RT, encode(completed(s)))
    store.runtime.clear_session_snapshot_if_current(RT, encode(completed(s)))
    before = runtime_state(db_url, RT)
    with pytest.raises(RuntimeNotFound, match=f"compaction outbox rewrite {i.projection.revision}"):
        store.runtime.mark_compaction_projection_finalized(RT, i.projection)
    assert runtime_state(db_url, RT) == before  # quarantine not cleared either


def test_finalize_with_a_legacy_snapshot_fails_closed(store: Store, db_url: str) -> None:
    s, i = session_with_compaction_intent()
    store.runtime.atomic_apply(RT, encode(s), receipt(1), (), s.id)
    raw_exec(
        db_url,
        "UPDATE runtime_session_snapshots SET session_snapshot = :d",
        params={"d": v0_session_blob(s.id)},
    )
    before = runtime_state(db_url, RT)
    with pytest.raises(ReadFailed, match="version"):
        store.runtime.mark_compaction_projection_finalized(RT, i.projection)
    assert runtime_state(db_url, RT) == before  # still pending


# --------------------------------------------------------------------------
# §5.2-24 The identical-bytes fast path is still held to the outbox


def _set_outbox(url: str, sql: str, params: dict[str, Any] | None = None) -> None:
    raw_exec(url, f"UPDATE runtime_compaction_projection_outbox SET {sql}", params=params)


@pytest.mark.parametrize("tamper", ["changed", "finalized", "deleted"])
def test_24_fast_path_enforces_outbox_authority(store: Store, db_url: str, tamper: str) -> None:
    s, i = session_with_compaction_intent()
    store.runtime.atomic_apply(RT, encode(s), receipt(1), (), s.id)
    if tamper == "changed":
        changed = store.runtime_domain.encode_compaction_intent(with_summary_tokens(i, 6))
        _set_outbox(db_url, "intent_json = :d", {"d": changed})
        expected = f"conflicts with compaction outbox rewrite {i.projection.revision}"
    elif tamper == "finalized":
        _set_outbox(db_url, "state = 'finalized'")
        expected = "non-boundary snapshot replays finalized compaction intent"
    else:
        raw_exec(db_url, "DELETE FROM runtime_compaction_projection_outbox")
        expected = "without atomic outbox authority"
    raw_exec(db_url, "INSERT INTO runtime_projection_quarantine VALUES (:rt)", params={"rt": RT})
    before = runtime_state(db_url, RT)
    with pytest.raises(WriteFailed, match=expected):
        store.runtime.commit_session_snapshot(RT, encode(s))  # the identical bytes
    assert runtime_state(db_url, RT) == before  # quarantine not cleared either


# --------------------------------------------------------------------------
# §5.2-25 Cross-runtime isolation

SHARED_INPUT = accepted_input()


def _populate(store: Store, runtime_id: str, s: Session, i: CompactionIntent, run: str) -> None:
    store.runtime.atomic_apply_with_machine_lifecycle(
        runtime_id, encode(s), receipt(1, run), idle_lifecycle(), [input_record(SHARED_INPUT)], s.id
    )
    store.runtime.atomic_apply(runtime_id, None, receipt(2, run), [input_record(SHARED_INPUT)])


def test_25_every_operation_on_a_leaves_b_untouched(store: Store, db_url: str) -> None:
    a, b = "runtime-a", "runtime-b"
    s, i = session_with_compaction_intent()
    run = str(uuid.uuid4())
    _populate(store, b, s, i, run)
    store.runtime.clear_session_snapshot_if_current("runtime-q", encode(user_session("q")))
    b_before = runtime_state(db_url, b)
    rt = store.runtime
    more = s.with_message("user", "more")
    rewritten, commit = more.rewrite(1, 2, [Message(role="user", content="less")], actor="t")
    steps: list[Callable[[], object]] = [
        # Same session, same intent, same receipt keys, same input id: no conflict with B.
        lambda: _populate(store, a, s, i, run),
        lambda: rt.commit_session_snapshot(a, encode(more)),
        lambda: rt.commit_session_transcript_rewrite_snapshot(a, encode(rewritten), commit),
        lambda: rt.mark_compaction_projection_finalized(a, i.projection),
        lambda: rt.replace_session_snapshot_if_current(
            a, rt.load_session_snapshot(a) or b"", encode(completed(s))
        ),
        lambda: rt.clear_session_snapshot_if_current(a, encode(completed(s))),
        lambda: rt.atomic_apply(a, encode(completed(s)), receipt(3, run), (), s.id),
        lambda: rt.clear_session_snapshot(a),
        lambda: rt.atomic_apply(a, None, receipt(4, run), [input_record(SHARED_INPUT)]),
    ]
    for step in steps:
        step()
        assert runtime_state(db_url, b) == b_before, step
    assert rt.load_pending_compaction_projections(b) == [i]
    assert rt.load_pending_compaction_projections(a) == []
    assert rt.load_boundary_receipt(a, run, 4) is not None
    assert rt.load_boundary_receipt(b, run, 4) is None


# --------------------------------------------------------------------------
# §5.2-26 The placeholder exception, differentially


PLACEHOLDERS: dict[str, Callable[[str], bytes]] = {
    "system-only": lambda sid: encode(session_of(("system", "A"), session_id=sid)),
    "malformed-history": lambda sid: malformed_history_blob(
        session_of(("system", "A"), session_id=sid), {"head": 1}
    ),
    "malformed-history-empty": lambda sid: malformed_history_blob(Session.new(sid)),
}


@pytest.mark.parametrize("kind", list(PLACEHOLDERS))
def test_26_boundary_replaces_a_placeholder_the_plain_commit_cannot(
    store: Store, db_url: str, kind: str
) -> None:
    sid = Session.new().id
    raw_snapshot(db_url, PLACEHOLDERS[kind](sid))
    before = runtime_state(db_url, RT)
    incoming = session_of(("system", "B"), ("user", "x"), session_id=sid)
    with pytest.raises(WriteFailed, match="continuity"):
        store.runtime.commit_session_snapshot(RT, encode(incoming))
    assert runtime_state(db_url, RT) == before
    r = receipt(1)
    store.runtime.atomic_apply(RT, encode(incoming), r, [input_record()], sid)
    assert store.runtime.load_session_snapshot(RT) == encode(incoming)
    assert store.runtime.load_boundary_receipt(RT, r.run_id, 1) == r


def test_26b_empty_placeholder_discards_any_guard_error(store: Store, db_url: str) -> None:
    """An empty previous accepts every coherent append, so only an id change is refused.

    The boundary still replaces it (§2.10 6a discards the guard error, whatever it is).
    """
    empty = Session.new()
    store.runtime.commit_session_snapshot(RT, encode(empty))
    foreign = session_of(("system", "B"), ("user", "x"))
    with pytest.raises(WriteFailed, match="cannot replace session"):
        store.runtime.commit_session_snapshot(RT, encode(foreign))
    store.runtime.atomic_apply(RT, encode(foreign), receipt(1), (), foreign.id)
    assert store.runtime.load_session_snapshot(RT) == encode(foreign)


def test_26c_a_real_head_is_not_a_placeholder(store: Store, db_url: str) -> None:
    head = session_of(("system", "A"), ("user", "x"))
    store.runtime.commit_session_snapshot(RT, encode(head))
    before = runtime_state(db_url, RT)
    divergent = session_of(("system", "B"), ("user", "x"), ("user", "y"), session_id=head.id)
    with pytest.raises(WriteFailed, match="continuity") as info:
        store.runtime.atomic_apply(RT, encode(divergent), receipt(1), [input_record()], head.id)
    assert not isinstance(info.value, SessionSnapshotSuperseded)
    stale = session_of(("system", "A"), session_id=head.id)  # a placeholder, but incoming
    with pytest.raises(SessionSnapshotSuperseded):
        store.runtime.atomic_apply(RT, encode(stale), receipt(1), [input_record()], head.id)
    # A head with a malformed history and a user turn is no placeholder either.
    raw_exec(
        db_url,
        "UPDATE runtime_session_snapshots SET session_snapshot = :d",
        params={"d": malformed_history_blob(head)},
    )
    before = runtime_state(db_url, RT)
    with pytest.raises(WriteFailed, match="malformed") as info:
        store.runtime.atomic_apply(RT, encode(divergent), receipt(1), [input_record()], head.id)
    assert not isinstance(info.value, SessionSnapshotSuperseded)
    assert runtime_state(db_url, RT) == before


# --------------------------------------------------------------------------
# I11 on the database


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.sets(st.integers(min_value=0, max_value=MAX_U64), min_size=2, max_size=6))
def test_i11_distinct_sequences_never_collide(store: Store, seqs: set[int]) -> None:
    rt = f"{RT}-{uuid.uuid4()}"
    run = str(uuid.uuid4())
    for seq in seqs:
        store.runtime.atomic_apply(rt, None, receipt(seq, run))
    for seq in seqs:
        loaded = store.runtime.load_boundary_receipt(rt, run, seq)
        assert loaded is not None and loaded.sequence == seq


# --------------------------------------------------------------------------
# I1–I5 as a property over random operation sequences


class _World:
    """One session's snapshots, intents and receipts for a random run on one runtime."""

    def __init__(self) -> None:
        s1, i1 = session_with_compaction_intent()
        self.sid = s1.id
        self.run = str(uuid.uuid4())
        self.inputs = [accepted_input() for _ in range(2)]
        s1t = s1.with_message("user", "t1")
        s2, c2 = s1t.rewrite(
            0, 2, [Message(role="assistant", content="summary 2")], actor="t", compaction=True
        )
        i2 = CompactionIntent.for_commit(self.sid, c2, 7)
        s2 = s2.with_compaction_intents([i1, i2])
        self.intents = [i1, i2]
        base = user_session("verbose context one", "verbose context two", session_id=self.sid)
        self.snapshots = [
            encode(base),
            encode(s1),
            encode(s1t),
            encode(completed(s1t)),
            encode(s2),
            encode(s2.with_compaction_intents([i2])),
            encode(completed(s2)),
            encode(session_of(("system", "sys"), session_id=self.sid)),
            encode(user_session("divergent", session_id=self.sid)),
            snapshot_with_raw_intents(s1t, [with_summary_tokens(i1, 50)]),
        ]


OPS = st.one_of(
    st.tuples(st.just("apply"), st.integers(0, 9), st.integers(0, 3), st.integers(0, 1)),
    st.tuples(st.just("apply_none"), st.integers(0, 3), st.integers(0, 1)),
    st.tuples(st.just("terminal"), st.integers(0, 9), st.integers(0, 3), st.integers(0, 1)),
    st.tuples(st.just("commit"), st.integers(0, 9)),
    st.tuples(st.just("finalize"), st.integers(0, 1)),
    st.tuples(st.just("replace"), st.integers(0, 9), st.booleans()),
    st.tuples(st.just("clear_if_current"), st.booleans()),
    st.tuples(st.just("clear")),
)


def _run(store: Store, rt: str, w: _World, op: tuple[Any, ...]) -> bool | None:
    """Run one generated operation; the verdict of a compare-and-set, else None."""
    api = store.runtime
    kind = op[0]
    if kind == "apply":
        _, k, seq, j = op
        api.atomic_apply(
            rt, w.snapshots[k], receipt(seq, w.run), [input_record(w.inputs[j])], w.sid
        )
    elif kind == "apply_none":
        _, seq, j = op
        api.atomic_apply(rt, None, receipt(seq, w.run), [input_record(w.inputs[j])])
    elif kind == "terminal":
        _, k, seq, j = op
        api.atomic_apply_with_machine_lifecycle(
            rt,
            w.snapshots[k],
            receipt(seq, w.run),
            idle_lifecycle(),
            [input_record(w.inputs[j].with_recovery_count(1))],
            w.sid,
        )
    elif kind == "commit":
        api.commit_session_snapshot(rt, w.snapshots[op[1]])
    elif kind == "finalize":
        api.mark_compaction_projection_finalized(rt, w.intents[op[1]].projection)
    elif kind == "clear":
        api.clear_session_snapshot(rt)
    else:
        current = api.load_session_snapshot(rt) or b""
        if kind == "replace":
            return api.replace_session_snapshot_if_current(
                rt, current if op[2] else b"stale", w.snapshots[op[1]]
            )
        return api.clear_session_snapshot_if_current(rt, current if op[1] else b"stale")
    return None


def _check_invariants(
    store: Store,
    before: dict[str, list[tuple[Any, ...]]],
    after: dict[str, list[tuple[Any, ...]]],
) -> None:
    # I3: outbox rows are never deleted, their intent never changes, state only
    # moves pending -> finalized. Receipts are insert-only.
    old = {row[:4]: row[4:] for row in before["runtime_compaction_projection_outbox"]}
    new = {row[:4]: row[4:] for row in after["runtime_compaction_projection_outbox"]}
    for key, (intent_json, state) in old.items():
        assert key in new
        assert new[key][0] == intent_json
        assert state == "pending" or new[key][1] == "finalized"
    assert set(before["runtime_boundary_receipts"]) <= set(after["runtime_boundary_receipts"])
    # I4: every intent in the stored snapshot is an identical pending outbox row.
    snapshots = after["runtime_session_snapshots"]
    if snapshots:
        session = store.runtime_domain.decode_persisted_session(snapshots[0][0])
        for intent in session.compaction_intents:
            pid = intent.projection
            key = (pid.session_id, pid.parent_revision, pid.revision, pid.commit_fingerprint)
            assert key in new, intent
            stored_json, state = new[key]
            assert state == "pending", intent
            assert store.runtime_domain.decode_compaction_intent(stored_json) == intent
    # I5: a quarantined runtime has no snapshot row.
    if after["runtime_projection_quarantine"]:
        assert not snapshots


@settings(
    max_examples=80,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(st.lists(OPS, min_size=1, max_size=14))
def test_invariants_hold_over_random_operation_sequences(
    store: Store, db_url: str, ops: list[tuple[Any, ...]]
) -> None:
    rt = f"{RT}-{uuid.uuid4()}"
    w = _World()
    engine = create_engine(db_url)
    try:
        before = runtime_state(engine, rt)
        for op in ops:
            try:
                result = _run(store, rt, w, op)
            except RuntimeStoreError as exc:
                observe(f"{op[0]}: {type(exc).__name__}")
                # I1/I2: a refused or superseded call leaves no trace in any table.
                after = runtime_state(engine, rt)
                assert after == before, op
                continue
            observe(f"{op[0]}: {result}")
            after = runtime_state(engine, rt)
            if op[0] in ("apply", "terminal", "apply_none"):
                # I1: a committed boundary's receipt, inputs (and snapshot) are all there.
                seq = op[2] if op[0] != "apply_none" else op[1]
                assert store.runtime.load_boundary_receipt(rt, w.run, seq) is not None
                assert len(after["runtime_input_states"]) >= 1
                if op[0] != "apply_none":
                    assert after["runtime_session_snapshots"] == [(w.snapshots[op[1]],)]
                    assert after["runtime_projection_quarantine"] == []
                if op[0] == "terminal":
                    assert store.runtime.load_runtime_state(rt) == "idle"
            if result is False:
                assert after == before, op
            _check_invariants(store, before, after)
            before = after
    finally:
        engine.dispose()
