"""The compaction-projection outbox: seed tests 1–6 and 21 (spec runtime §4, §2.0.8–§2.0.10, §2.13).

A boundary commit inserts the outbox rows of its snapshot's intents in the
same transaction; finalization drops the intent from the snapshot and
tombstones the row; no snapshot path can bring a finalized intent back, and
non-boundary writers can carry only intents already pending in the outbox.
Every test runs on SQLite and Postgres and asserts the rows after a refusal.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from agentkeep.runtime import (
    CompactionIntent,
    Message,
    ReadFailed,
    RuntimeNotFound,
    Session,
    SessionSnapshotSuperseded,
    WriteFailed,
)
from agentkeep.store import Store

from .builders import (
    encode,
    foreign_intent,
    idle_lifecycle,
    input_record,
    receipt,
    reopen,
    runtime_state,
    session_with_compaction_intent,
    snapshot_with_raw_intents,
    table_counts,
    unbacked_intent,
    with_summary_tokens,
)
from .support import RT, raw_exec


def _outbox(url: str, runtime_id: str = RT) -> list[tuple[object, ...]]:
    return runtime_state(url, runtime_id)["runtime_compaction_projection_outbox"]


def test_1_outbox_is_atomic_durable_and_finalize_is_idempotent(store: Store, db_url: str) -> None:
    s, i = session_with_compaction_intent()
    store.runtime.atomic_apply(RT, encode(s), receipt(41), (), s.id)
    assert store.runtime.load_session_snapshot(RT) == encode(s)
    store = reopen(store, db_url)
    try:
        assert store.runtime.load_pending_compaction_projections(RT) == [i]
        store.runtime.mark_compaction_projection_finalized(RT, i.projection)
        store.runtime.mark_compaction_projection_finalized(RT, i.projection)  # idempotent
        assert store.runtime.load_pending_compaction_projections(RT) == []
        store = reopen(store, db_url)
        stored = store.runtime_domain.decode_persisted_session(
            store.runtime.load_session_snapshot(RT) or b""
        )
        assert stored.compaction_intents == ()
        assert stored.messages == s.messages and stored.history == s.history
        assert store.runtime.load_pending_compaction_projections(RT) == []
        ((*_, state),) = _outbox(db_url)
        assert state == "finalized"  # a tombstone, never deleted
    finally:
        store.close()


def test_2_finalized_tombstone_rejects_every_snapshot_replay_path(
    store: Store, db_url: str
) -> None:
    s, i = session_with_compaction_intent()
    store.runtime.atomic_apply(RT, encode(s), receipt(80), (), s.id)
    store.runtime.mark_compaction_projection_finalized(RT, i.projection)
    cleaned = store.runtime.load_session_snapshot(RT)
    assert cleaned is not None and cleaned != encode(s)
    before = runtime_state(db_url, RT)
    replay = receipt(81)
    calls: list[Callable[[], object]] = [
        lambda: store.runtime.atomic_apply(RT, encode(s), replay, (), s.id),
        lambda: store.runtime.commit_session_snapshot(RT, encode(s)),
        lambda: store.runtime.commit_session_transcript_rewrite_snapshot(
            RT, encode(s), s.commits[-1]
        ),
        lambda: store.runtime.replace_session_snapshot_if_current(RT, cleaned, encode(s)),
    ]
    for call in calls:
        with pytest.raises(WriteFailed, match="finalized compaction intent"):
            call()
    assert store.runtime.load_boundary_receipt(RT, replay.run_id, 81) is None
    assert store.runtime.load_session_snapshot(RT) == cleaned
    assert store.runtime.load_pending_compaction_projections(RT) == []
    assert runtime_state(db_url, RT) == before


@pytest.mark.parametrize(
    "intents",
    ["duplicate-key", "foreign", "unbacked"],
)
def test_3_invalid_intents_roll_back_snapshot_and_outbox(
    store: Store, db_url: str, intents: str
) -> None:
    s, i = session_with_compaction_intent()
    raw = {
        "duplicate-key": [i, with_summary_tokens(i, i.summary_tokens + 1)],
        "foreign": [foreign_intent()],
        "unbacked": [unbacked_intent(s.id)],
    }[intents]
    with pytest.raises(WriteFailed, match="compaction intent"):
        store.runtime.atomic_apply(RT, snapshot_with_raw_intents(s, raw), receipt(42), (), s.id)
    with pytest.raises(WriteFailed, match="compaction intent"):
        store.runtime.atomic_apply_with_machine_lifecycle(
            RT, snapshot_with_raw_intents(s, raw), receipt(50), idle_lifecycle(), (), s.id
        )
    assert store.runtime.load_session_snapshot(RT) is None
    assert store.runtime.load_pending_compaction_projections(RT) == []
    assert table_counts(db_url) == dict.fromkeys(table_counts(db_url), 0)
    # The non-boundary writers refuse the same intents with the same error.
    clean = encode(Session.new(s.id))
    store.runtime.commit_session_snapshot(RT, clean)
    before = runtime_state(db_url, RT)
    with pytest.raises(WriteFailed, match="compaction intent"):
        store.runtime.commit_session_snapshot(RT, snapshot_with_raw_intents(s, raw))
    with pytest.raises(WriteFailed, match="compaction intent"):
        store.runtime.replace_session_snapshot_if_current(
            RT, clean, snapshot_with_raw_intents(s, raw)
        )
    assert runtime_state(db_url, RT) == before


def test_3b_valid_intent_next_to_an_invalid_one_is_not_outboxed(store: Store, db_url: str) -> None:
    """Validation covers the whole list: a good first intent is not written either."""
    s, i = session_with_compaction_intent()
    r = receipt(51)
    with pytest.raises(WriteFailed, match="not backed"):
        store.runtime.atomic_apply(
            RT, snapshot_with_raw_intents(s, [i, unbacked_intent(s.id)]), r, [input_record()]
        )
    assert runtime_state(db_url, RT) == runtime_state(db_url, "nothing-here")


def test_4_superseded_snapshot_does_not_advance_the_outbox(store: Store, db_url: str) -> None:
    s, i = session_with_compaction_intent()
    current = s.with_compaction_intents([]).with_message("user", "already advanced")
    store.runtime.commit_session_snapshot(RT, encode(current))
    r = receipt(43)
    with pytest.raises(SessionSnapshotSuperseded) as info:
        store.runtime.atomic_apply(RT, encode(s), r, [input_record()], s.id)
    assert info.value.runtime_id == RT
    assert store.runtime.load_session_snapshot(RT) == encode(current)
    assert store.runtime.load_pending_compaction_projections(RT) == []
    assert _outbox(db_url) == []
    assert store.runtime.load_boundary_receipt(RT, r.run_id, 43) is None
    assert store.runtime.load_input_states(RT) == []


def test_5_changed_intent_is_refused_without_advancing_snapshot(store: Store, db_url: str) -> None:
    s, i = session_with_compaction_intent()
    store.runtime.atomic_apply(RT, encode(s), receipt(70), (), s.id)
    before = runtime_state(db_url, RT)
    advanced = s.with_message("user", "later turn")
    changed = snapshot_with_raw_intents(advanced, [with_summary_tokens(i, i.summary_tokens + 1)])
    r = receipt(71)
    with pytest.raises(
        WriteFailed,
        match=f"conflicting compaction outbox intent for rewrite {i.projection.revision}",
    ):
        store.runtime.atomic_apply(RT, changed, r, [input_record()], s.id)
    assert store.runtime.load_session_snapshot(RT) == encode(s)
    assert store.runtime.load_pending_compaction_projections(RT) == [i]
    assert store.runtime.load_boundary_receipt(RT, r.run_id, 71) is None
    assert runtime_state(db_url, RT) == before


def test_5b_identical_intent_is_accepted_and_row_stays_pending(store: Store, db_url: str) -> None:
    """An identical pending row is accepted silently; its bytes and state never change (I3)."""
    s, i = session_with_compaction_intent()
    store.runtime.atomic_apply(RT, encode(s), receipt(72), (), s.id)
    outbox = _outbox(db_url)
    advanced = s.with_message("user", "later turn")
    store.runtime.atomic_apply(RT, encode(advanced), receipt(73), (), s.id)
    assert store.runtime.load_session_snapshot(RT) == encode(advanced)
    assert _outbox(db_url) == outbox
    assert store.runtime.load_pending_compaction_projections(RT) == [i]


def test_6_non_boundary_apis_cannot_bypass_the_outbox(store: Store, db_url: str) -> None:
    s, i = session_with_compaction_intent()
    rev = i.projection.revision
    with pytest.raises(WriteFailed, match=f"introduces compaction intent {rev} without atomic"):
        store.runtime.commit_session_snapshot(RT, encode(s))
    with pytest.raises(WriteFailed, match="without atomic outbox authority"):
        store.runtime.commit_session_transcript_rewrite_snapshot(RT, encode(s), s.commits[-1])
    assert runtime_state(db_url, RT) == runtime_state(db_url, "nothing-here")
    clean = Session.new(s.id)
    store.runtime.commit_session_snapshot(RT, encode(clean))
    with pytest.raises(WriteFailed, match="without atomic outbox authority"):
        store.runtime.replace_session_snapshot_if_current(RT, encode(clean), encode(s))
    assert store.runtime.load_session_snapshot(RT) == encode(clean)
    assert store.runtime.load_pending_compaction_projections(RT) == []
    assert _outbox(db_url) == []


def test_6b_non_boundary_writer_refuses_a_changed_pending_intent(store: Store, db_url: str) -> None:
    """A pending row with another intent at the key is a conflict, not authority."""
    s, i = session_with_compaction_intent()
    store.runtime.atomic_apply(RT, encode(s), receipt(1), (), s.id)
    changed = snapshot_with_raw_intents(
        s.with_message("user", "turn"), [with_summary_tokens(i, i.summary_tokens + 2)]
    )
    before = runtime_state(db_url, RT)
    with pytest.raises(WriteFailed, match="conflicts with compaction outbox rewrite"):
        store.runtime.commit_session_snapshot(RT, changed)
    with pytest.raises(WriteFailed, match="conflicts with compaction outbox rewrite"):
        store.runtime.replace_session_snapshot_if_current(RT, encode(s), changed)
    assert runtime_state(db_url, RT) == before
    # The identical pending intent is authority: a non-boundary append is accepted.
    store.runtime.commit_session_snapshot(RT, encode(s.with_message("user", "turn")))
    assert store.runtime.load_pending_compaction_projections(RT) == [i]


def test_21_terminal_boundary_tracks_and_tombstones_intents(store: Store, db_url: str) -> None:
    s, i = session_with_compaction_intent()
    store.runtime.atomic_apply_with_machine_lifecycle(
        RT, encode(s), receipt(0), idle_lifecycle(), (), s.id
    )
    assert store.runtime.load_pending_compaction_projections(RT) == [i]
    assert store.runtime.load_runtime_state(RT) == "idle"
    store.runtime.mark_compaction_projection_finalized(RT, i.projection)
    before = runtime_state(db_url, RT)
    r = receipt(1)
    with pytest.raises(WriteFailed, match="replays finalized compaction intent"):
        store.runtime.atomic_apply_with_machine_lifecycle(
            RT, encode(s), r, idle_lifecycle(), [input_record()], s.id
        )
    assert runtime_state(db_url, RT) == before
    assert store.runtime.load_boundary_receipt(RT, r.run_id, 1) is None


# --------------------------------------------------------------------------
# Finalization edge cases (§2.13, §5.2-21, §5.2-22)


def test_finalize_unknown_key_is_not_found_and_writes_nothing(store: Store, db_url: str) -> None:
    s, i = session_with_compaction_intent()
    store.runtime.commit_session_snapshot(RT, encode(s.with_compaction_intents([])))
    store.runtime.clear_session_snapshot_if_current(RT, encode(s.with_compaction_intents([])))
    before = runtime_state(db_url, RT)
    assert before["runtime_projection_quarantine"] == [(RT,)]
    with pytest.raises(RuntimeNotFound, match=f"compaction outbox rewrite {i.projection.revision}"):
        store.runtime.mark_compaction_projection_finalized(RT, i.projection)
    assert runtime_state(db_url, RT) == before  # quarantine not cleared either


def test_finalize_is_scoped_to_its_runtime(store: Store, db_url: str) -> None:
    """The outbox key includes the runtime: runtime B's finalize cannot ack A's row."""
    s, i = session_with_compaction_intent()
    store.runtime.atomic_apply(RT, encode(s), receipt(1), (), s.id)
    with pytest.raises(RuntimeNotFound):
        store.runtime.mark_compaction_projection_finalized("runtime-2", i.projection)
    assert store.runtime.load_pending_compaction_projections(RT) == [i]
    assert store.runtime.load_session_snapshot(RT) == encode(s)


def test_pending_list_is_ordered_by_key_and_skips_finalized(store: Store) -> None:
    """§2.12: pending rows of every session of the runtime, ordered by their key."""
    first, i1 = session_with_compaction_intent()
    second, j1 = session_with_compaction_intent()
    later = first.with_message("user", "t")
    s2, c2 = later.rewrite(
        0, 2, [Message(role="assistant", content="summary 2")], actor="t", compaction=True
    )
    i2 = CompactionIntent.for_commit(first.id, c2, 3)
    store.runtime.atomic_apply(RT, encode(first), receipt(1), (), first.id)
    store.runtime.atomic_apply(RT, encode(s2.with_compaction_intents([i1, i2])), receipt(2))
    store.runtime.clear_session_snapshot(RT)
    store.runtime.atomic_apply(RT, encode(second), receipt(3), (), second.id)
    key = lambda i: (  # noqa: E731
        i.projection.session_id,
        i.projection.parent_revision,
        i.projection.revision,
        i.projection.commit_fingerprint,
    )
    assert store.runtime.load_pending_compaction_projections(RT) == sorted([i1, i2, j1], key=key)
    store.runtime.mark_compaction_projection_finalized(RT, i1.projection)
    assert store.runtime.load_pending_compaction_projections(RT) == sorted([i2, j1], key=key)
    assert store.runtime.load_pending_compaction_projections("runtime-2") == []


def test_corrupt_outbox_row_fails_the_pending_list(store: Store, db_url: str) -> None:
    s, i = session_with_compaction_intent()
    store.runtime.atomic_apply(RT, encode(s), receipt(1), (), s.id)
    raw_exec(
        db_url,
        "UPDATE runtime_compaction_projection_outbox SET intent_json = :d",
        params={"d": b'{"projection": 1}'},
    )
    with pytest.raises(ReadFailed, match="compaction outbox intent"):
        store.runtime.load_pending_compaction_projections(RT)
    # Every writer that compares against the row fails closed too, writing nothing.
    before = runtime_state(db_url, RT)
    with pytest.raises(ReadFailed):
        store.runtime.atomic_apply(RT, encode(s), receipt(2), (), s.id)
    with pytest.raises(ReadFailed):
        store.runtime.commit_session_snapshot(RT, encode(s.with_message("user", "t")))
    assert runtime_state(db_url, RT) == before


def test_supports_outbox(store: Store) -> None:
    assert store.runtime.supports_compaction_projection_outbox() is True
