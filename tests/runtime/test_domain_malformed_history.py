"""A malformed transcript history: kept verbatim, absent for placeholders, refused by guards.

Spec runtime §2.0.14 and §5.2-26: "a malformed (undecodable) history counts as absent".
"""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from agentkeep.errors import InvalidInput
from agentkeep.runtime.domain import MalformedHistory, Session, revision_of
from agentkeep.runtime.errors import GuardRejected, ReadFailed, WriteFailed
from agentkeep.strict_json import canonical_json

from .test_domain import D, msg, rewrite_fixture, session_json, session_with_compaction_intent


def canonical(obj: Any) -> bytes:
    return canonical_json(obj).encode("utf-8")


def with_history(session: Session, value: Any) -> bytes:
    """The canonical bytes of ``session`` with its transcript_history replaced by ``value``."""
    obj = session_json(session)
    obj["metadata"]["transcript_history"] = value
    return canonical(obj)


def malformed(session: Session, value: Any = "garbage") -> Session:
    s = D.decode_persisted_session(with_history(session, value))
    assert s.history is None and s.history_problem is not None
    return s


def _history(o: dict[str, Any]) -> dict[str, Any]:
    history: dict[str, Any] = o["metadata"]["transcript_history"]
    return history


# --------------------------------------------------------------------------
# Decode: the envelope is strict, the history is kept verbatim


@pytest.mark.parametrize(
    ("mutate", "problem"),
    [
        (lambda o: o["metadata"].update(transcript_history="garbage"), "must be a JSON object"),
        (lambda o: o["metadata"].update(transcript_history=[]), "must be a JSON object"),
        (lambda o: o["metadata"].update(transcript_history=7), "must be a JSON object"),
        (lambda o: o["metadata"].update(transcript_history={}), "head"),
        (lambda o: _history(o).pop("revisions"), "revisions"),
        (lambda o: _history(o).update(extra=1), "extra"),
        (lambda o: _history(o).update(commits=[]), "no commits"),
        (lambda o: _history(o)["revisions"][0].update(messages=[]), "another digest"),
        (lambda o: _history(o)["revisions"].append(_history(o)["revisions"][0]), "twice"),
        (lambda o: _history(o)["commits"][0]["selection"].update(start=-1), "start"),
        (lambda o: _history(o)["commits"][0].update(messages_before=True), "messages_before"),
    ],
)
def test_malformed_history_is_kept_verbatim(mutate: Any, problem: str) -> None:
    s, intent, _ = session_with_compaction_intent()
    obj = session_json(s)
    mutate(obj)
    data = canonical(obj)
    for decoded in (D.decode_persisted_session(data), D.decode_incoming_session(data)):
        assert decoded.history is None
        assert decoded.history_problem is not None and problem in decoded.history_problem
        assert decoded.malformed_history is not None
        assert decoded.malformed_history.value == obj["metadata"]["transcript_history"]
        assert decoded.messages == s.messages and decoded.compaction_intents == (intent,)
        assert decoded.revision == revision_of(s.messages) and decoded.commits == ()
        assert D.encode_session(decoded) == data
        assert D.decode_persisted_session(D.encode_session(decoded)) == decoded


def test_null_history_is_absent_not_malformed() -> None:
    s = D.decode_persisted_session(with_history(Session.new(), None))
    assert s.history is None and s.malformed_history is None and s.history_problem is None


@pytest.mark.parametrize(
    "mutate",
    [
        lambda o: o.update(version=3),
        lambda o: o.update(id="not-a-uuid"),
        lambda o: o.update(messages=[{"role": "robot", "content": "x"}]),
        lambda o: o["metadata"].update(compaction_intents=[{"projection": {}}]),
        lambda o: o.update(extra_field=1),
    ],
)
def test_envelope_stays_strict_beside_a_malformed_history(mutate: Any) -> None:
    s, _, _ = session_with_compaction_intent()
    obj = session_json(s)
    obj["metadata"]["transcript_history"] = "garbage"
    mutate(obj)
    with pytest.raises(ReadFailed):
        D.decode_persisted_session(canonical(obj))
    with pytest.raises(WriteFailed):
        D.decode_incoming_session(canonical(obj))


def test_session_model_with_a_malformed_history() -> None:
    s = malformed(Session.new().with_message("user", "a"))
    appended = s.with_message("assistant", "b")
    assert appended.malformed_history == s.malformed_history and appended.history is None
    assert D.encode_session(appended) == with_history(
        appended.model_copy(update={"malformed_history": None}), "garbage"
    )
    with pytest.raises(InvalidInput, match="malformed history"):
        s.rewrite(0, 1, [msg("user", "b")], actor="t")
    rewritten, _ = s.model_copy(update={"malformed_history": None}).rewrite(
        0, 1, [msg("user", "b")], actor="t"
    )
    with pytest.raises(ValidationError, match="either a history or a malformed history"):
        Session(
            id=s.id,
            history=rewritten.history,
            malformed_history=MalformedHistory(problem="p", value="garbage"),
        )


# --------------------------------------------------------------------------
# Placeholder (§2.0.14): a malformed history counts as absent


def test_placeholder_ignores_a_malformed_history() -> None:
    assert D.is_placeholder(malformed(Session.new()))
    system = Session.new().with_message("system", "A")
    assert D.is_placeholder(malformed(system))
    assert D.is_placeholder(malformed(system, {"head": "x"}))
    assert not D.is_placeholder(malformed(system.with_message("user", "x")))
    assert not D.is_placeholder(malformed(Session.new().with_message("user", "x")))


# --------------------------------------------------------------------------
# Guards refuse a malformed history


def test_boundary_guard_rejects_a_malformed_incoming_history() -> None:
    plain = Session.new().with_message("user", "a")
    bad = malformed(plain.with_message("assistant", "b"))
    D.boundary_save_guard(bad.model_copy(update={"malformed_history": None}), None)
    with pytest.raises(GuardRejected, match="incoherent history: transcript_history is malformed"):
        D.boundary_save_guard(bad, None)
    with pytest.raises(GuardRejected, match="must be a JSON object") as info:
        D.boundary_save_guard(bad, plain)
    assert info.value.rule == "continuity"
    longer = plain.with_message("assistant", "b").with_message("user", "c")
    with pytest.raises(GuardRejected, match="malformed") as info:
        D.boundary_save_guard(bad, longer)
    assert info.value.rule == "monotonicity"


def test_boundary_guard_cannot_establish_continuity_from_a_malformed_previous() -> None:
    placeholder = Session.new().with_message("system", "A")
    previous = malformed(placeholder)
    incoming = placeholder.with_message("user", "x")
    D.boundary_save_guard(incoming, placeholder)  # R2 from the same rows without the blob
    with pytest.raises(GuardRejected, match="cannot establish continuity") as info:
        D.boundary_save_guard(incoming, previous)
    assert info.value.rule == "continuity" and "must be a JSON object" in info.value.detail
    # the store's placeholder exception then decides (§2.10 step 6a)
    assert D.is_placeholder(previous)
    with pytest.raises(GuardRejected, match="cannot establish continuity") as info:
        D.boundary_save_guard(Session.new(previous.id), previous)
    assert info.value.rule == "monotonicity"
    with pytest.raises(GuardRejected, match="cannot replace"):
        D.boundary_save_guard(Session.new().with_message("user", "x"), previous)


def test_head_coherence_guard_rejects_a_malformed_history() -> None:
    s = Session.new().with_message("user", "a")
    D.head_coherence_guard(s)
    with pytest.raises(GuardRejected, match="no commits") as info:
        D.head_coherence_guard(
            malformed(s, {"head": revision_of(s.messages), "commits": [], "revisions": []})
        )
    assert info.value.rule == "coherence"


def test_rewrite_guard_rejects_malformed_histories() -> None:
    original, first, commit = rewrite_fixture()
    D.rewrite_save_guard(first, original, commit)
    with pytest.raises(GuardRejected, match="incoming transcript_history is malformed") as info:
        D.rewrite_save_guard(malformed(first), original, commit)
    assert info.value.rule == "rewrite"
    with pytest.raises(GuardRejected, match="persisted transcript_history is malformed") as info:
        D.rewrite_save_guard(first, malformed(original), commit)
    assert info.value.rule == "rewrite"


def test_intents_are_unbacked_under_a_malformed_history() -> None:
    s, intent, _ = session_with_compaction_intent()
    assert D.validated_compaction_intents(s) == (intent,)
    bad = malformed(s)
    assert bad.compaction_intents == (intent,)
    with pytest.raises(WriteFailed, match="not backed: transcript_history is malformed"):
        D.validated_compaction_intents(bad)
    assert D.validated_compaction_intents(bad.with_compaction_intents([])) == ()
