"""Session snapshots: seed tests 7, 11–18, 35–37, 39, 40 (spec runtime §4, §2.8–§2.21).

Non-boundary commits (save guard, identical-bytes fast path), transcript
rewrites (revision conflict), the boundary commit's supersession and
placeholder verdicts, fail-closed reads of legacy rows, the quarantine marker,
compare-and-set replace/clear, and TEXT-degraded payloads. Plus the race each
fence guards (two spawned writers, exactly one wins) and bad caller input
(typed error, every row untouched). Every test runs on SQLite and Postgres
unless it is about a SQLite-only quirk.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

import agentkeep
from agentkeep.runtime import (
    Message,
    ReadFailed,
    ReferenceDomain,
    Session,
    SessionSnapshotSuperseded,
    TranscriptRevisionConflict,
    WriteFailed,
)
from agentkeep.store import Store

from ._workers_boundaries import race
from .builders import (
    accepted_input,
    encode,
    idle_lifecycle,
    input_record,
    receipt,
    reopen,
    runtime_state,
    session_blob,
    session_of,
    session_with_compaction_intent,
    table_counts,
    user_session,
    v0_session_blob,
    v1_session_blob,
)
from .support import NOTHING, RT, abort_trigger, raw_exec, raw_rows, raw_snapshot

# --------------------------------------------------------------------------
# Boundary round trip and non-boundary commits (#7, #11–#14)


def test_7_atomic_apply_round_trip(store: Store) -> None:
    s = Session.new()
    inp = accepted_input()
    r = receipt(5, conversation_digest="sha256:digest", message_count=42)
    store.runtime.atomic_apply(RT, encode(s), r, [input_record(inp)], None)
    assert store.runtime.load_session_snapshot(RT) == encode(s)
    assert store.runtime.load_input_states(RT) == [inp]
    assert store.runtime.load_boundary_receipt(RT, r.run_id, 5) == r


def test_11_commit_writes_only_the_snapshot(store: Store, db_url: str) -> None:
    s = user_session("hello")
    store.runtime.commit_session_snapshot(RT, encode(s))
    assert store.runtime.load_session_snapshot(RT) == encode(s)
    counts = table_counts(db_url)
    assert counts.pop("runtime_session_snapshots") == 1
    assert counts == dict.fromkeys(counts, 0)  # no receipt, input, outbox, lifecycle row


def test_12_identical_bytes_take_the_fast_path_without_update(backend: str, fresh_url: str) -> None:
    agentkeep.migrate(fresh_url)
    s, _ = user_session("before").rewrite(
        0, 1, [Message(role="user", content="after")], actor="unit-test"
    )
    with Store.open(fresh_url) as store:
        store.runtime.commit_session_snapshot(RT, encode(s))
        with abort_trigger(fresh_url, backend, "runtime_session_snapshots", "UPDATE"):
            raw_exec(
                fresh_url,
                "INSERT INTO runtime_projection_quarantine VALUES (:rt)",
                params={"rt": RT},
            )
            store.runtime.commit_session_snapshot(RT, encode(s))  # no UPDATE: the trigger sleeps
            assert store.runtime.load_session_snapshot(RT) == encode(s)
            # The fast path still writes: it clears the quarantine marker (I5).
            assert not store.runtime.is_runtime_projection_quarantined(RT)
            # Control: a real successor updates the row, so the trigger fires.
            with pytest.raises(WriteFailed, match="test trigger abort"):
                store.runtime.commit_session_snapshot(RT, encode(s.with_message("user", "x")))
            assert store.runtime.load_session_snapshot(RT) == encode(s)


def test_12b_fast_path_still_checks_head_coherence(store: Store, db_url: str) -> None:
    """Identical bytes of an incoherent snapshot (stored by hand) are still refused."""
    s, _ = user_session("a").rewrite(0, 1, [Message(role="user", content="b")], actor="t")
    obj = s.to_json()
    obj["messages"].append({"role": "user", "content": "head not updated"})
    incoherent = session_blob(obj)
    raw_snapshot(db_url, incoherent)
    raw_exec(db_url, "INSERT INTO runtime_projection_quarantine VALUES (:rt)", params={"rt": RT})
    before = runtime_state(db_url, RT)
    with pytest.raises(WriteFailed, match="coherence"):
        store.runtime.commit_session_snapshot(RT, incoherent)
    assert runtime_state(db_url, RT) == before  # quarantine not cleared


def test_13_commit_does_not_write_session_store_rows(store: Store, db_url: str) -> None:
    store.runtime.commit_session_snapshot(RT, encode(user_session("hello")))
    session_tables = ["session_head", "session_meta", "graph_nodes", "runtime_turn_commits"]
    assert table_counts(db_url, session_tables) == dict.fromkeys(session_tables, 0)
    assert store.runtime.load_session_snapshot(RT) is not None


def test_14_commit_refuses_a_stale_parent(store: Store, db_url: str) -> None:
    accepted = user_session("accepted runtime turn")
    store.runtime.commit_session_snapshot(RT, encode(accepted))
    stale = user_session("stale runtime turn", session_id=accepted.id)
    shorter = Session.new(accepted.id)
    before = runtime_state(db_url, RT)
    with pytest.raises(WriteFailed, match="continuity"):
        store.runtime.commit_session_snapshot(RT, encode(stale))
    # No supersession verdict outside boundaries: a stale (shorter) snapshot is WriteFailed.
    with pytest.raises(WriteFailed, match="monotonicity") as info:
        store.runtime.commit_session_snapshot(RT, encode(shorter))
    assert not isinstance(info.value, SessionSnapshotSuperseded)
    # Another session's snapshot cannot replace this runtime's head either.
    with pytest.raises(WriteFailed):
        store.runtime.commit_session_snapshot(RT, encode(user_session("accepted runtime turn")))
    assert runtime_state(db_url, RT) == before


# --------------------------------------------------------------------------
# Boundary verdicts (#15–#17)


def test_15_superseded_incoming_keeps_the_current_snapshot(store: Store, db_url: str) -> None:
    incoming = user_session("turn input")
    current = incoming.with_message("assistant", "peer response already applied")
    store.runtime.commit_session_snapshot(RT, encode(current))
    before = runtime_state(db_url, RT)
    r = receipt(11)
    with pytest.raises(SessionSnapshotSuperseded, match=f"runtime '{RT}' was superseded"):
        store.runtime.atomic_apply(RT, encode(incoming), r, [input_record()], incoming.id)
    assert store.runtime.load_session_snapshot(RT) == encode(current)
    assert store.runtime.load_boundary_receipt(RT, r.run_id, 11) is None
    assert store.runtime.load_input_states(RT) == []
    assert runtime_state(db_url, RT) == before


def test_16_first_generated_snapshot_replaces_the_placeholder(store: Store) -> None:
    placeholder = session_of(("system", "base system"))
    store.runtime.commit_session_snapshot(RT, encode(placeholder))
    grown = placeholder.with_message("user", "verbose first turn")
    incoming, _ = grown.rewrite(
        1, 2, [Message(role="assistant", content="summary")], actor="meerkat-core"
    )
    r = receipt(12)
    store.runtime.atomic_apply(RT, encode(incoming), r, (), incoming.id)
    assert store.runtime.load_session_snapshot(RT) == encode(incoming)
    assert store.runtime.load_boundary_receipt(RT, r.run_id, 12) == r


def test_17_compaction_before_the_retained_tail_is_accepted(store: Store) -> None:
    previous = session_of(
        ("system", "runtime system before context refresh"),
        ("user", "Turn 1 request"),
        ("assistant", "Turn 1 answer"),
    )
    store.runtime.commit_session_snapshot(RT, encode(previous))
    body = session_of(
        ("system", "runtime system after context refresh"),
        ("user", "Verbose context that will be compacted"),
        ("user", "Turn 1 request"),
        ("assistant", "Turn 1 answer"),
        ("assistant", "Turn 2 generated answer"),
        session_id=previous.id,
    )
    incoming, _ = body.rewrite(
        1,
        2,
        [Message(role="assistant", content="summary")],
        actor="meerkat-core",
        compaction=True,
    )
    r = receipt(13)
    store.runtime.atomic_apply(RT, encode(incoming), r, (), incoming.id)
    assert store.runtime.load_session_snapshot(RT) == encode(incoming)
    assert store.runtime.load_boundary_receipt(RT, r.run_id, 13) == r


# --------------------------------------------------------------------------
# Transcript rewrite (#18)


def test_18_rewrite_refuses_a_stale_parent(store: Store, db_url: str) -> None:
    original = session_of(("user", "hello"), ("assistant", "verbose answer"))
    store.runtime.commit_session_snapshot(RT, encode(original))
    first, first_commit = original.rewrite(
        1, 2, [Message(role="assistant", content="first compact answer")], actor="unit-test"
    )
    store.runtime.commit_session_transcript_rewrite_snapshot(RT, encode(first), first_commit)
    stale, stale_commit = original.rewrite(
        1, 2, [Message(role="assistant", content="stale compact answer")], actor="unit-test"
    )
    assert stale_commit.parent_revision == first_commit.parent_revision
    before = runtime_state(db_url, RT)
    with pytest.raises(TranscriptRevisionConflict) as info:
        store.runtime.commit_session_transcript_rewrite_snapshot(RT, encode(stale), stale_commit)
    assert (info.value.expected, info.value.actual) == (
        stale_commit.parent_revision,
        first_commit.revision,
    )
    stored = store.runtime_domain.decode_persisted_session(
        store.runtime.load_session_snapshot(RT) or b""
    )
    assert stored.revision == first_commit.revision
    assert runtime_state(db_url, RT) == before


def test_18b_rewrite_without_a_stored_session_is_refused(store: Store, db_url: str) -> None:
    original = session_of(("user", "hello"), ("assistant", "verbose answer"))
    first, commit = original.rewrite(
        1, 2, [Message(role="assistant", content="short")], actor="unit-test"
    )
    with pytest.raises(WriteFailed, match="no previously persisted session"):
        store.runtime.commit_session_transcript_rewrite_snapshot(RT, encode(first), commit)
    assert runtime_state(db_url, RT) == runtime_state(db_url, NOTHING)


# --------------------------------------------------------------------------
# Fail-closed decoding (#35–#37)


def test_35_unversioned_v0_row_does_not_decode() -> None:
    with pytest.raises(ReadFailed, match="version"):
        ReferenceDomain().decode_persisted_session(v0_session_blob())


def test_36_retired_v1_row_does_not_decode() -> None:
    with pytest.raises(
        ReadFailed, match="generated session persistence version authority rejected"
    ):
        ReferenceDomain().decode_persisted_session(v1_session_blob())


@pytest.mark.parametrize("blob", [v0_session_blob, v1_session_blob], ids=["v0", "v1"])
def test_37_legacy_stored_row_fails_every_writer_closed(
    store: Store, db_url: str, blob: Callable[[], bytes]
) -> None:
    data = blob()
    raw_snapshot(db_url, data)
    before = runtime_state(db_url, RT)
    s = user_session("hello")
    r = receipt(1)
    with pytest.raises(ReadFailed, match="version"):
        store.runtime.commit_session_snapshot(RT, encode(s))
    with pytest.raises(ReadFailed, match="version"):
        store.runtime.atomic_apply(RT, encode(s), r, [input_record()], s.id)
    _, commit = s.rewrite(0, 1, [Message(role="user", content="x")], actor="t")
    with pytest.raises(ReadFailed, match="version"):
        store.runtime.commit_session_transcript_rewrite_snapshot(
            RT, encode(s.rewrite(0, 1, [Message(role="user", content="x")], actor="t")[0]), commit
        )
    assert runtime_state(db_url, RT) == before
    assert store.runtime.load_session_snapshot(RT) == data  # raw reads stay possible
    # A compare-and-set on the exact bytes needs no decode of the stored row.
    assert store.runtime.replace_session_snapshot_if_current(RT, data, encode(s)) is True
    assert store.runtime.load_session_snapshot(RT) == encode(s)


# --------------------------------------------------------------------------
# Quarantine (#39) and compare-and-set (§2.19–§2.20)


def test_39_quarantine_survives_restart_and_clears_on_write(store: Store, db_url: str) -> None:
    assert store.runtime.is_runtime_projection_quarantined(RT) is False
    rejected = user_session("rejected runtime turn")
    store.runtime.commit_session_snapshot(RT, encode(rejected))
    assert store.runtime.clear_session_snapshot_if_current(RT, encode(rejected)) is True
    assert store.runtime.is_runtime_projection_quarantined(RT) is True
    assert store.runtime.load_session_snapshot(RT) is None
    store = reopen(store, db_url)
    try:
        assert store.runtime.is_runtime_projection_quarantined(RT) is True
        store.runtime.commit_session_snapshot(RT, encode(user_session("revived runtime turn")))
        assert store.runtime.is_runtime_projection_quarantined(RT) is False
        store = reopen(store, db_url)
        assert store.runtime.is_runtime_projection_quarantined(RT) is False
    finally:
        store.close()


def test_clear_if_current_false_paths_write_nothing(store: Store, db_url: str) -> None:
    s = user_session("a")
    assert store.runtime.clear_session_snapshot_if_current(RT, encode(s)) is False  # absent
    assert runtime_state(db_url, RT) == runtime_state(db_url, NOTHING)
    store.runtime.commit_session_snapshot(RT, encode(s))
    before = runtime_state(db_url, RT)
    assert store.runtime.clear_session_snapshot_if_current(RT, b"other bytes") is False
    assert runtime_state(db_url, RT) == before
    assert not store.runtime.is_runtime_projection_quarantined(RT)


def test_unconditional_clear_leaves_quarantine_and_outbox_alone(store: Store, db_url: str) -> None:
    s = user_session("a")
    store.runtime.commit_session_snapshot(RT, encode(s))
    store.runtime.clear_session_snapshot_if_current(RT, encode(s))
    store.runtime.commit_session_snapshot(RT, encode(s))  # clears quarantine
    raw_exec(db_url, "INSERT INTO runtime_projection_quarantine VALUES (:rt)", params={"rt": RT})
    store.runtime.clear_session_snapshot(RT)
    store.runtime.clear_session_snapshot(RT)  # a missing row is a no-op
    assert store.runtime.load_session_snapshot(RT) is None
    assert store.runtime.is_runtime_projection_quarantined(RT) is True


def test_replace_if_current_has_no_save_guard_but_is_a_cas(store: Store, db_url: str) -> None:
    s = user_session("one", "two", "three")
    store.runtime.commit_session_snapshot(RT, encode(s))
    raw_exec(db_url, "INSERT INTO runtime_projection_quarantine VALUES (:rt)", params={"rt": RT})
    shrunk = Session.new(s.id)  # a repair/shrink the save guard would refuse
    with pytest.raises(WriteFailed, match="monotonicity"):
        store.runtime.commit_session_snapshot(RT, encode(shrunk))
    assert store.runtime.replace_session_snapshot_if_current(RT, encode(s), encode(shrunk))
    assert store.runtime.load_session_snapshot(RT) == encode(shrunk)
    assert not store.runtime.is_runtime_projection_quarantined(RT)  # upsert clears it
    before = runtime_state(db_url, RT)
    # Stale expected bytes: False, and checked before the replacement's outbox authority.
    unauthorised, _ = session_with_compaction_intent()
    assert not store.runtime.replace_session_snapshot_if_current(
        RT, encode(s), encode(unauthorised)
    )
    assert not store.runtime.replace_session_snapshot_if_current(
        "runtime-absent", encode(s), encode(s)
    )
    assert runtime_state(db_url, RT) == before
    assert runtime_state(db_url, "runtime-absent") == runtime_state(db_url, NOTHING)


# --------------------------------------------------------------------------
# TEXT-degraded payloads (#40, SQLite only: Postgres bytea cannot hold TEXT)


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_40_text_json_columns_still_read(store: Store, db_url: str) -> None:
    s = user_session("hello")
    store.runtime.commit_session_snapshot(RT, encode(s))
    raw_exec(
        db_url,
        "UPDATE runtime_session_snapshots SET session_snapshot = CAST(session_snapshot AS TEXT)",
    )
    kind = "SELECT typeof(session_snapshot) FROM runtime_session_snapshots"
    assert raw_rows(db_url, kind) == [("text",)]
    assert store.runtime.load_session_snapshot(RT) == encode(s)
    # The SQL fast path misses a TEXT row; the slow path accepts the equal
    # session and rewrites the row as a BLOB.
    store.runtime.commit_session_snapshot(RT, encode(s))
    assert raw_rows(db_url, kind) == [("blob",)]
    raw_exec(
        db_url,
        "UPDATE runtime_session_snapshots SET session_snapshot = CAST(session_snapshot AS TEXT)",
    )
    # Compare-and-set compares in Python: the TEXT row matches its UTF-8 bytes.
    assert store.runtime.clear_session_snapshot_if_current(RT, encode(s)) is True
    assert store.runtime.load_session_snapshot(RT) is None


# --------------------------------------------------------------------------
# Bad caller bytes: WriteFailed before the database, nothing written


BAD_SNAPSHOTS = {
    "not-json": b"{not json",
    "not-utf8": b"\xff\xfe",
    "array": b"[]",
    "v0": v0_session_blob(),
    "v1": v1_session_blob(),
    "version-3": session_blob(
        {"version": 3, "id": Session.new().id, "messages": [], "metadata": {}}
    ),
    "version-string": session_blob(
        {"version": "2", "id": Session.new().id, "messages": [], "metadata": {}}
    ),
    "id-not-uuid": session_blob({"version": 2, "id": "abc", "messages": [], "metadata": {}}),
    "messages-not-list": session_blob(
        {"version": 2, "id": Session.new().id, "messages": "x", "metadata": {}}
    ),
    "bad-role": session_blob(
        {
            "version": 2,
            "id": Session.new().id,
            "messages": [{"role": "robot", "content": "x"}],
            "metadata": {},
        }
    ),
    "content-int": session_blob(
        {
            "version": 2,
            "id": Session.new().id,
            "messages": [{"role": "user", "content": 1}],
            "metadata": {},
        }
    ),
    "intents-not-list": session_blob(
        {
            "version": 2,
            "id": Session.new().id,
            "messages": [],
            "metadata": {"compaction_intents": {"a": 1}},
        }
    ),
    "intent-wrong-type": session_blob(
        {
            "version": 2,
            "id": Session.new().id,
            "messages": [],
            "metadata": {"compaction_intents": [{"x": 1}]},
        }
    ),
    "extra-field": session_blob(
        {"version": 2, "id": Session.new().id, "messages": [], "metadata": {}, "unexpected": True}
    ),
}


@pytest.mark.parametrize("bad", list(BAD_SNAPSHOTS), ids=list(BAD_SNAPSHOTS))
def test_undecodable_incoming_snapshot_is_refused_by_every_writer(
    store: Store, db_url: str, bad: str
) -> None:
    data = BAD_SNAPSHOTS[bad]
    s = user_session("kept")
    store.runtime.commit_session_snapshot(RT, encode(s))
    before = runtime_state(db_url, RT)
    r = receipt(3)
    _, commit = user_session("a").rewrite(0, 1, [], actor="t")
    calls: list[Callable[[], object]] = [
        lambda: store.runtime.commit_session_snapshot(RT, data),
        lambda: store.runtime.commit_session_transcript_rewrite_snapshot(RT, data, commit),
        lambda: store.runtime.replace_session_snapshot_if_current(RT, encode(s), data),
        lambda: store.runtime.atomic_apply(RT, data, r, [input_record()], None),
        lambda: store.runtime.atomic_apply_with_machine_lifecycle(
            RT, data, r, idle_lifecycle(), [input_record()], s.id
        ),
    ]
    for call in calls:
        with pytest.raises(WriteFailed, match="failed to decode incoming session snapshot"):
            call()
    with store.write() as uow:
        with pytest.raises(WriteFailed, match="failed to decode incoming"):
            uow.runtime.atomic_apply(RT, data, r, [input_record()], None)
        with pytest.raises(WriteFailed, match="failed to decode incoming"):
            uow.runtime.commit_session_snapshot(RT, data)
    assert runtime_state(db_url, RT) == before


# --------------------------------------------------------------------------
# Races: each fence, two or three real writers


def test_race_replace_if_current_one_wins(store: Store, db_url: str) -> None:
    """§5.2-4 (CAS half): racers replacing the same expected bytes; exactly one True."""
    rounds: list[dict[str, Any]] = []
    for n in range(3):
        head = user_session("head")
        rt = f"{RT}-cas-{n}"
        store.runtime.commit_session_snapshot(rt, encode(head))
        rounds.append(
            {
                "rt": rt,
                "expected": encode(head),
                "replacements": [
                    encode(user_session(f"r{i}", session_id=head.id)) for i in range(3)
                ],
            }
        )
    results = race(db_url, "body_replace_if_current", 3, {"rounds": rounds})
    for n, rnd in enumerate(rounds):
        outs = [results[i][n] for i in range(3)]
        assert sorted(outs) == [False, False, True], outs
        assert (
            store.runtime.load_session_snapshot(rnd["rt"]) == rnd["replacements"][outs.index(True)]
        )


def test_race_clear_if_current_one_wins(store: Store, db_url: str) -> None:
    """Racers clearing the same expected bytes: exactly one True; marker set once (I5)."""
    rounds: list[dict[str, Any]] = []
    for n in range(3):
        head = user_session("head")
        rt = f"{RT}-clear-{n}"
        store.runtime.commit_session_snapshot(rt, encode(head))
        rounds.append({"rt": rt, "expected": encode(head)})
    results = race(db_url, "body_clear_if_current", 3, {"rounds": rounds})
    for n, rnd in enumerate(rounds):
        outs = [results[i][n] for i in range(3)]
        assert sorted(outs) == [False, False, True], outs
        state = runtime_state(db_url, rnd["rt"])
        assert state["runtime_session_snapshots"] == []
        assert state["runtime_projection_quarantine"] == [(rnd["rt"],)]
