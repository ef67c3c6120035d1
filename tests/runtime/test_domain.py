"""Unit tests of the runtime domain layer (spec runtime §0.2, §3, pure seed tests of §4)."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest

from agentkeep.errors import AgentkeepError, InvalidInput
from agentkeep.errors import NotFound as GenericNotFound
from agentkeep.runtime.domain import (
    CompactionIntent,
    Message,
    ProjectionId,
    ReferenceDomain,
    RuntimeDomain,
    Session,
    TranscriptCommit,
    commit_fingerprint,
    revision_of,
)
from agentkeep.runtime.errors import (
    GuardRejected,
    InvalidInputStateBatchCas,
    OpsLifecycleEpochRetired,
    ReadFailed,
    RuntimeInternalError,
    RuntimeNotFound,
    RuntimeStoreError,
    SessionKeyMismatch,
    SessionSnapshotSuperseded,
    TranscriptRevisionConflict,
    UnregisterFinalizationOutcomeUnknown,
    WriteFailed,
)

D: RuntimeDomain[Session] = ReferenceDomain()


def msg(role: Any, content: str) -> Message:
    return Message(role=role, content=content)


def session_with_compaction_intent() -> tuple[Session, CompactionIntent, TranscriptCommit]:
    """The seed fixture S, I (§4 shared fixtures)."""
    base = Session.new().with_message("user", "verbose context one")
    base = base.with_message("user", "verbose context two")
    s, commit = base.rewrite(
        0, 2, [msg("assistant", "summary")], actor="sqlite-outbox-test", compaction=True
    )
    intent = CompactionIntent.for_commit(s.id, commit, summary_tokens=5)
    return s.with_compaction_intents([intent]), intent, commit


def session_json(session: Session) -> dict[str, Any]:
    """The session as stored (its encoded JSON), parsed."""
    obj: dict[str, Any] = json.loads(D.encode_session(session))
    return obj


def to_bytes(obj: Any) -> bytes:
    return json.dumps(obj).encode()


# --------------------------------------------------------------------------
# Errors (§0.2)


def test_error_texts_and_ids() -> None:
    assert str(WriteFailed("boom")) == "Store write failed: boom"
    assert str(ReadFailed("bad")) == "Store read failed: bad"
    nf = RuntimeNotFound("compaction outbox rewrite", "sha256:x")
    assert str(nf) == "Not found: compaction outbox rewrite sha256:x"
    assert isinstance(nf, GenericNotFound) and nf.key == "sha256:x"
    e = SessionKeyMismatch("a", "b")
    assert (e.expected, e.actual) == ("a", "b")
    assert str(e) == "Session store key mismatch: expected a, actual b"
    assert "runtime 'rt-1' was superseded" in str(SessionSnapshotSuperseded("rt-1"))
    c = TranscriptRevisionConflict("p", "q")
    assert str(c) == "Transcript revision conflict: expected p, actual q"
    r = OpsLifecycleEpochRetired("rt", "ep")
    assert (r.runtime_id, r.epoch_id) == ("rt", "ep")
    assert str(r) == "Ops lifecycle epoch ep for runtime rt is retired"
    u = UnregisterFinalizationOutcomeUnknown("lost ack")
    assert str(u) == "Unregister finalization outcome is unknown: lost ack"
    assert str(RuntimeInternalError("join")) == "Internal error: join"
    b = InvalidInputStateBatchCas("why")
    assert str(b) == "Invalid input-state batch compare-and-swap: why"
    assert isinstance(b, InvalidInput) and b.reason == "why"
    g = GuardRejected("continuity", "detail")
    assert isinstance(g, WriteFailed) and "continuity" in str(g) and g.rule == "continuity"
    for err in (e, c, r, u, b, g, nf):
        assert isinstance(err, RuntimeStoreError) and isinstance(err, AgentkeepError)


# --------------------------------------------------------------------------
# Session codec (§0.3, §2.0.3, #35, #36)


def test_session_round_trip_is_canonical() -> None:
    s, _, _ = session_with_compaction_intent()
    s = s.model_copy(update={"extra_metadata": {"zeta": [1, {"b": None}], "alpha": "x"}})
    data = D.encode_session(s)
    back = D.decode_persisted_session(data)
    assert back == s
    assert D.encode_session(back) == data
    assert D.encode_session(D.decode_incoming_session(data)) == data
    assert D.session_id(back) == s.id
    obj = json.loads(data)
    assert obj["version"] == 2 and list(obj) == sorted(obj)


def v0_blob(**extra: Any) -> bytes:
    obj = {
        "id": str(uuid.uuid4()),
        "messages": [],
        "created_at": {"secs_since_epoch": 1, "nanos_since_epoch": 0},
        "updated_at": {"secs_since_epoch": 1, "nanos_since_epoch": 0},
        "metadata": {},
        **extra,
    }
    return to_bytes(obj)


def test_persisted_session_without_version_is_read_failed() -> None:
    with pytest.raises(ReadFailed, match="version"):
        D.decode_persisted_session(v0_blob())
    with pytest.raises(WriteFailed, match="version") as info:
        D.decode_incoming_session(v0_blob())
    assert not isinstance(info.value, ReadFailed)


def test_retired_session_version_is_rejected() -> None:
    with pytest.raises(
        ReadFailed, match="generated session persistence version authority rejected"
    ):
        D.decode_persisted_session(v0_blob(version=1))


@pytest.mark.parametrize(
    "mutate",
    [
        lambda o: o.update(version=3),
        lambda o: o.update(version="2"),
        lambda o: o.update(version=True),
        lambda o: o.update(extra_field=1),
        lambda o: o.update(id="not-a-uuid"),
        lambda o: o.update(id=o["id"].upper()),
        lambda o: o.update(messages=[{"role": "robot", "content": "x"}]),
        lambda o: o.update(messages=[{"role": "user", "content": 1}]),
        lambda o: o.update(messages=[{"role": "user"}]),
        lambda o: o.pop("metadata"),
        lambda o: o.update(metadata="garbage"),
        lambda o: o["metadata"].update(compaction_intents=[{"projection": {}}]),
        lambda o: o["metadata"].update(compaction_intents="garbage"),
    ],
)
def test_malformed_sessions_fail_closed(mutate: Any) -> None:
    # a bad envelope or intents list fails the decode; a bad transcript_history
    # does not (see test_domain_malformed_history)
    s, _, _ = session_with_compaction_intent()
    obj = session_json(s)
    mutate(obj)
    data = to_bytes(obj)
    with pytest.raises(ReadFailed):
        D.decode_persisted_session(data)
    with pytest.raises(WriteFailed):
        D.decode_incoming_session(data)


@pytest.mark.parametrize(
    "data",
    [b"", b"\xff\xfe", b"not json", b'"retired"', b"[]", b'{"version":2,"version":2}'],
)
def test_undecodable_session_bytes(data: bytes) -> None:
    with pytest.raises(ReadFailed):
        D.decode_persisted_session(data)


def test_session_builder_keeps_head_coherent() -> None:
    s, commit = Session.new().with_message("user", "a").rewrite(0, 1, [msg("user", "b")], actor="t")
    s = s.with_message("assistant", "c")
    assert s.history is not None and s.history.head == revision_of(s.messages)
    assert s.revision == s.history.head
    assert s.body(commit.parent_revision) == (msg("user", "a"),)
    with pytest.raises(InvalidInput):
        s.rewrite(1, 5, [], actor="t")


# --------------------------------------------------------------------------
# Boundary save guard (§3.1)


def test_r1_first_save_plain_and_adoption() -> None:
    D.boundary_save_guard(Session.new(), None)  # #7, #11
    D.boundary_save_guard(Session.new().with_message("user", "hello"), None)  # #39
    before = Session.new().with_message("user", "before")
    rewritten, _ = before.rewrite(0, 1, [msg("user", "after")], actor="unit-test")  # #12
    D.boundary_save_guard(rewritten, None)
    s, _, _ = session_with_compaction_intent()  # #1, #21
    D.boundary_save_guard(s, None)


def test_incoherent_history_is_rejected_even_on_first_save() -> None:
    s, _, _ = session_with_compaction_intent()
    obj = session_json(s)
    obj["messages"].append({"role": "user", "content": "unrecorded"})
    bad = D.decode_incoming_session(to_bytes(obj))
    with pytest.raises(GuardRejected, match="continuity"):
        D.boundary_save_guard(bad, None)
    with pytest.raises(GuardRejected) as info:
        D.head_coherence_guard(bad)
    assert info.value.rule == "coherence"


def test_tampered_commit_body_is_rejected() -> None:
    s, _, _ = session_with_compaction_intent()
    obj = session_json(s)
    obj["metadata"]["transcript_history"]["commits"][0]["replacement_digest"] = "sha256:0"
    bad = D.decode_incoming_session(to_bytes(obj))
    D.head_coherence_guard(bad)  # head still matches the live messages
    with pytest.raises(GuardRejected, match="replacement digest"):
        D.boundary_save_guard(bad, None)


def test_stale_divergence_is_rejected() -> None:  # #14
    accepted = Session.new().with_message("user", "accepted runtime turn")
    stale = Session.new(accepted.id).with_message("user", "stale runtime turn")
    with pytest.raises(GuardRejected, match="continuity") as info:
        D.boundary_save_guard(stale, accepted)
    assert isinstance(info.value, WriteFailed)


def test_shorter_incoming_is_monotonicity_and_reverse_accepts() -> None:  # #15, #22
    incoming = Session.new().with_message("user", "turn input")
    current = incoming.with_message("assistant", "peer response already applied")
    with pytest.raises(GuardRejected, match="monotonicity"):
        D.boundary_save_guard(incoming, current)
    D.boundary_save_guard(current, incoming)  # reverse: supersession verdict


def test_supersession_with_completed_intent() -> None:  # #4
    s, intent, _ = session_with_compaction_intent()
    current = D.complete_compaction_intent(s, intent.projection)
    current = current.with_message("user", "already advanced")
    with pytest.raises(GuardRejected, match="monotonicity"):
        D.boundary_save_guard(s, current)
    D.boundary_save_guard(current, s)


def test_metadata_is_not_compared() -> None:  # #5
    s, intent, _ = session_with_compaction_intent()
    changed = intent.model_copy(update={"summary_tokens": 6})
    advanced = s.with_message("user", "later turn").with_compaction_intents([changed])
    D.boundary_save_guard(advanced, s)


def test_identical_session_is_accepted() -> None:
    s, _, _ = session_with_compaction_intent()
    D.boundary_save_guard(s, s)
    D.head_coherence_guard(s)
    D.head_coherence_guard(Session.new().with_message("user", "x"))


def test_r4_compaction_before_retained_tail() -> None:  # #17
    previous = (
        Session.new()
        .with_message("system", "runtime system before context refresh")
        .with_message("user", "Turn 1 request")
        .with_message("assistant", "Turn 1 answer")
    )
    body = (
        Session.new(previous.id)
        .with_message("system", "runtime system after context refresh")
        .with_message("user", "Verbose context that will be compacted")
        .with_message("user", "Turn 1 request")
        .with_message("assistant", "Turn 1 answer")
        .with_message("assistant", "Turn 2 generated answer")
    )
    incoming, _ = body.rewrite(
        1, 2, [msg("user", "summary")], actor="meerkat-core", compaction=True
    )
    D.boundary_save_guard(incoming, previous)
    # the same rewrite as a plain edit is not a compaction: rejected
    edited, _ = body.rewrite(1, 2, [msg("user", "summary")], actor="meerkat-core")
    with pytest.raises(GuardRejected):
        D.boundary_save_guard(edited, previous)
    # a compaction that drops the retained tail is rejected
    lost = (
        Session.new(previous.id)
        .with_message("system", "s")
        .with_message("user", "Verbose")
        .with_message("user", "another request")
    )
    lost_incoming, _ = lost.rewrite(1, 2, [msg("user", "summary")], actor="a", compaction=True)
    with pytest.raises(GuardRejected, match="continuity"):
        D.boundary_save_guard(lost_incoming, previous)


def test_r4_placeholder_then_generated_compaction() -> None:  # #16
    placeholder = Session.new().with_message("system", "base system")
    assert D.is_placeholder(placeholder)
    body = Session.new(placeholder.id).with_message("system", "base system")
    body = body.with_message("user", "verbose first turn")
    incoming, _ = body.rewrite(
        1, 2, [msg("user", "summary")], actor="meerkat-core", compaction=True
    )
    D.boundary_save_guard(incoming, placeholder)


def test_r3_rewrite_chain_with_appends_before_and_after() -> None:
    previous = Session.new().with_message("user", "a").with_message("assistant", "b")
    s = previous.with_message("user", "c")
    s, _ = s.rewrite(1, 2, [msg("assistant", "B")], actor="t")
    s, _ = s.rewrite(0, 1, [msg("user", "A")], actor="t")
    s = s.with_message("assistant", "d")
    D.boundary_save_guard(s, previous)
    # later saves append with equal commits (R2)
    D.boundary_save_guard(s.with_message("user", "e"), s)


def test_history_cannot_be_erased_changed_or_seeded() -> None:
    previous, _ = (
        Session.new().with_message("user", "a").rewrite(0, 1, [msg("user", "b")], actor="t")
    )
    erased = Session.new(previous.id).with_message("user", "b").with_message("user", "c")
    with pytest.raises(GuardRejected, match="erases or changes"):
        D.boundary_save_guard(erased, previous)
    # seeding a history whose rewrite does not start from the previous transcript
    prev_plain = Session.new().with_message("user", "x")
    other, _ = (
        Session.new(prev_plain.id)
        .with_message("user", "y")
        .rewrite(0, 1, [msg("user", "z")], actor="t")
    )
    with pytest.raises(GuardRejected, match="continuity"):
        D.boundary_save_guard(other, prev_plain)


def test_other_session_id_cannot_replace_previous() -> None:
    previous = Session.new()
    incoming = Session.new().with_message("user", "x")
    with pytest.raises(GuardRejected, match="cannot replace"):
        D.boundary_save_guard(incoming, previous)


def test_is_placeholder() -> None:
    assert D.is_placeholder(Session.new())
    assert not D.is_placeholder(Session.new().with_message("user", "x"))
    two = Session.new().with_message("system", "a").with_message("system", "b")
    assert not D.is_placeholder(two)
    rewritten, _ = (
        Session.new().with_message("system", "a").rewrite(0, 1, [msg("system", "b")], actor="t")
    )
    assert not D.is_placeholder(rewritten)


# --------------------------------------------------------------------------
# Transcript-rewrite guard (§3.3, #18)


def rewrite_fixture() -> tuple[Session, Session, TranscriptCommit]:
    original = Session.new().with_message("user", "hello").with_message("assistant", "verbose")
    first, commit = original.rewrite(1, 2, [msg("assistant", "first compact answer")], actor="t")
    return original, first, commit


def test_rewrite_guard_accepts_rewrite_of_persisted_revision() -> None:
    original, first, commit = rewrite_fixture()
    D.rewrite_save_guard(first, original, commit)
    second, commit2 = first.rewrite(0, 1, [msg("user", "hi")], actor="t")
    D.rewrite_save_guard(second, first, commit2)


def test_rewrite_guard_conflict_on_stale_parent() -> None:
    original, first, first_commit = rewrite_fixture()
    stale, stale_commit = original.rewrite(1, 2, [msg("assistant", "stale")], actor="t")
    with pytest.raises(TranscriptRevisionConflict) as info:
        D.rewrite_save_guard(stale, first, stale_commit)
    assert info.value.expected == revision_of(original.messages)
    assert info.value.actual == first_commit.revision


def test_rewrite_guard_rejections() -> None:
    original, first, commit = rewrite_fixture()
    with pytest.raises(GuardRejected, match="no previously persisted session"):
        D.rewrite_save_guard(first, None, commit)
    with pytest.raises(GuardRejected, match="targets session"):
        D.rewrite_save_guard(first, Session.new(), commit)
    appended = first.with_message("user", "more")
    with pytest.raises(GuardRejected, match="not the commit's revision"):
        D.rewrite_save_guard(appended, original, commit)
    other_commit = commit.model_copy(update={"actor": "someone else"})
    with pytest.raises(GuardRejected, match="does not contain the commit"):
        D.rewrite_save_guard(first, original, other_commit)
    # previous had a commit the incoming history drops
    second, commit2 = first.rewrite(0, 1, [msg("user", "hi")], actor="t")
    assert second.history is not None
    dropped = second.model_copy(
        update={"history": second.history.model_copy(update={"commits": (commit2,)})}
    )
    with pytest.raises(GuardRejected, match="retain"):
        D.rewrite_save_guard(dropped, first, commit2)
    # an invalid commit in the incoming history comes first
    bad = session_json(first)
    bad["metadata"]["transcript_history"]["commits"][0]["original_span_digest"] = "sha256:0"
    with pytest.raises(GuardRejected, match="does not validate"):
        D.rewrite_save_guard(D.decode_incoming_session(to_bytes(bad)), original, commit)


# --------------------------------------------------------------------------
# Compaction intents (§3.4, §3.5, #1, #3, #5)


def test_validated_intents_accept_fixture_and_free_summary_tokens() -> None:
    s, intent, _ = session_with_compaction_intent()
    assert D.validated_compaction_intents(s) == (intent,)
    changed = intent.model_copy(update={"summary_tokens": 99})
    assert D.validated_compaction_intents(s.with_compaction_intents([changed])) == (changed,)
    assert D.validated_compaction_intents(Session.new()) == ()


def test_duplicate_intent_key_is_rejected() -> None:  # #3a
    s, intent, _ = session_with_compaction_intent()
    twin = intent.model_copy(update={"summary_tokens": 6})
    with pytest.raises(WriteFailed, match="duplicate"):
        D.validated_compaction_intents(s.with_compaction_intents([intent, twin]))
    with pytest.raises(WriteFailed, match="duplicate"):
        D.validated_compaction_intents(s.with_compaction_intents([intent, intent]))


def test_foreign_and_unbacked_intents_are_rejected() -> None:  # #3b
    s, _, _ = session_with_compaction_intent()
    _, foreign, _ = session_with_compaction_intent()
    with pytest.raises(WriteFailed, match="belongs to session"):
        D.validated_compaction_intents(s.with_compaction_intents([foreign]))
    unbacked = CompactionIntent(
        projection=ProjectionId(
            session_id=s.id,
            parent_revision="missing-parent",
            revision="missing-revision",
            commit_fingerprint="sha256:unbacked-persisted-fixture",
        ),
        summary_tokens=5,
        messages_before=2,
        messages_after=1,
    )
    with pytest.raises(WriteFailed, match="not backed"):
        D.validated_compaction_intents(s.with_compaction_intents([unbacked]))


def test_intent_counts_and_selection_type_are_checked() -> None:
    s, intent, _ = session_with_compaction_intent()
    wrong = intent.model_copy(update={"messages_after": 2})
    with pytest.raises(WriteFailed, match="message counts"):
        D.validated_compaction_intents(s.with_compaction_intents([wrong]))
    edited, commit = (
        Session.new().with_message("user", "a").rewrite(0, 1, [msg("user", "b")], actor="t")
    )
    plain = CompactionIntent.for_commit(edited.id, commit, 1)
    with pytest.raises(WriteFailed, match="not backed"):
        D.validated_compaction_intents(edited.with_compaction_intents([plain]))


def test_commit_fingerprint_excludes_revisions() -> None:
    _, _, commit = session_with_compaction_intent()
    moved = commit.model_copy(update={"parent_revision": "p", "revision": "r"})
    assert commit_fingerprint(moved) == commit_fingerprint(commit)
    assert commit_fingerprint(commit).startswith("sha256:")
    other = commit.model_copy(update={"actor": "someone"})
    assert commit_fingerprint(other) != commit_fingerprint(commit)


def test_complete_intent_is_idempotent() -> None:  # #1
    s, intent, _ = session_with_compaction_intent()
    done = D.complete_compaction_intent(s, intent.projection)
    assert done.compaction_intents == ()
    assert D.complete_compaction_intent(done, intent.projection) is done
    assert "compaction_intents" not in json.loads(D.encode_session(done))["metadata"]
    D.boundary_save_guard(done, s)


def test_intent_codec() -> None:
    _, intent, _ = session_with_compaction_intent()
    data = D.encode_compaction_intent(intent)
    assert D.decode_compaction_intent(data) == intent
    for bad in (b"{}", b"nope", data.replace(b"summary_tokens", b"tokens")):
        with pytest.raises(ReadFailed):
            D.decode_compaction_intent(bad)
