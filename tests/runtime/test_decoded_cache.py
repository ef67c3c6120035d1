"""The decoded-snapshot cache of ``decode_session`` (docs/runtime.md#decoded-snapshot-cache).

* A hit equals a fresh decode; a metadata-free session is shared as is.
* The opaque JSON parts (``extra_metadata``, a malformed history's value) are
  copied on every hit: a caller that mutates them changes nothing cached.
* The key is the exact bytes: a stored head changed behind the store's back
  (corrupt, or another valid session) is decoded from its own bytes, never
  served from the cache; a failing decode is not cached.
* The cache is bounded (least recently used out) and skips long snapshots.
* ``atomic_apply`` of a chain decodes each snapshot once.
* A snapshot is parsed once: validating the parsed object (pydantic strict
  Python mode) gives what validating the bytes gives, sessions and errors
  alike, over a corpus of valid, malformed-history and invalid documents.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from agentkeep.errors import ReadFailed, WriteFailed
from agentkeep.runtime import session_model as SM
from agentkeep.runtime.session_model import (
    DecodedSessionCache,
    DecodeProblem,
    Message,
    decode_session,
)
from agentkeep.store import Store
from tests.support import raw_exec

from .builders import (
    encode,
    malformed_history_blob,
    receipt,
    session_blob,
    session_with_compaction_intent,
    snapshot_with_raw_intents,
    user_session,
)

RT = "runtime-cache"


@pytest.fixture(autouse=True)
def _fresh_cache() -> Iterator[None]:
    SM.DECODED_SESSIONS.clear()
    yield
    SM.DECODED_SESSIONS.clear()


def test_a_hit_equals_a_fresh_decode_and_is_shared_when_frozen() -> None:
    data = encode(user_session("a", "b"))
    first = decode_session(data)
    again = decode_session(bytes(data))  # equal bytes, another object
    assert again is first
    assert again == SM._decode_session(data)
    assert len(SM.DECODED_SESSIONS) == 1


def test_opaque_metadata_is_copied_on_every_hit() -> None:
    obj = user_session("a").to_json()
    obj["metadata"]["note"] = {"tags": ["x"]}
    data = session_blob(obj)
    first = decode_session(data)
    first.extra_metadata["note"]["tags"].append("mutated")  # type: ignore[index, union-attr, call-overload]
    first.extra_metadata["added"] = 1
    again = decode_session(data)
    assert again.extra_metadata == {"note": {"tags": ["x"]}}
    assert again == SM._decode_session(data)

    malformed = malformed_history_blob(user_session("a"), history={"not": ["a history"]})
    one = decode_session(malformed)
    assert one.malformed_history is not None
    one.malformed_history.value["not"].append("mutated")  # type: ignore[index, union-attr, call-overload]
    two = decode_session(malformed)
    assert two.malformed_history is not None
    assert two.malformed_history.value == {"not": ["a history"]}


def test_a_failing_decode_is_not_cached() -> None:
    bad = b'{"version":2,"id":"nope","messages":[],"metadata":{}}'
    for _ in range(2):
        with pytest.raises(DecodeProblem):
            decode_session(bad)
    assert len(SM.DECODED_SESSIONS) == 0


def test_the_cache_is_bounded_least_recently_used_out() -> None:
    cache = DecodedSessionCache(max_entries=2, max_bytes=10_000)
    a, b, c = (user_session(x) for x in "abc")
    cache.put(b"a", a)
    cache.put(b"b", b)
    assert cache.get(b"a") is a  # a is now the newest
    cache.put(b"c", c)
    assert cache.get(b"b") is None and cache.get(b"a") is a and cache.get(b"c") is c
    cache.put(b"x" * 10_001, a)  # longer than max_bytes: not kept
    assert cache.get(b"x" * 10_001) is None and len(cache) == 2

    budget = DecodedSessionCache(max_entries=10, max_bytes=100, max_total_bytes=250)
    for key in (b"1" * 100, b"2" * 100, b"3" * 100):  # the third passes the total: 1 out
        budget.put(key, a)
    assert budget.get(b"1" * 100) is None and len(budget) == 2
    budget.put(b"2" * 100, b)  # replacing an entry does not count its bytes twice
    assert len(budget) == 2 and budget.get(b"3" * 100) is a and budget.get(b"2" * 100) is b


def test_a_changed_stored_head_is_never_served_from_the_cache(store: Store, db_url: str) -> None:
    base = user_session("one")
    sid = base.id
    first = encode(base)
    store.runtime.atomic_apply(RT, first, receipt(0))
    assert decode_session(first) is not None  # cached

    # the stored head replaced behind the store's back by undecodable bytes
    raw_exec(
        db_url,
        "UPDATE runtime_session_snapshots SET session_snapshot = :d WHERE runtime_id = :rt",
        params={"rt": RT, "d": b'{"version":2}'},
    )
    nxt = encode(base.with_message("assistant", "two"))
    with pytest.raises(ReadFailed):
        store.runtime.atomic_apply(RT, nxt, receipt(1))

    # ... and by another valid session that the incoming one does not continue
    other = encode(user_session("something else", session_id=sid))
    raw_exec(
        db_url,
        "UPDATE runtime_session_snapshots SET session_snapshot = :d WHERE runtime_id = :rt",
        params={"rt": RT, "d": other},
    )
    with pytest.raises(WriteFailed):
        store.runtime.atomic_apply(RT, nxt, receipt(2))
    assert store.runtime.load_session_snapshot(RT) == other
    # put back the head the incoming snapshot continues: accepted
    raw_exec(
        db_url,
        "UPDATE runtime_session_snapshots SET session_snapshot = :d WHERE runtime_id = :rt",
        params={"rt": RT, "d": first},
    )
    store.runtime.atomic_apply(RT, nxt, receipt(3))
    assert store.runtime.load_session_snapshot(RT) == nxt


def test_a_chain_of_boundaries_decodes_each_snapshot_once(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    decoded: list[bytes] = []
    real = SM._decode_session

    def counting(data: bytes) -> SM.Session:
        decoded.append(bytes(data))
        return real(data)

    monkeypatch.setattr(SM, "_decode_session", counting)
    session = user_session("start")
    chain = [encode(session)]
    for i in range(5):
        session = session.with_message("assistant", f"reply {i}")
        chain.append(encode(session))
    for i, data in enumerate(chain):
        store.runtime.atomic_apply(RT, data, receipt(i))
    assert decoded == chain  # the stored head of call i+1 is call i's snapshot: a hit


# --------------------------------------------------------------------------
# One parse per document: the parsed object is validated, not the bytes again


def _corpus() -> list[bytes]:
    compacted, intent = session_with_compaction_intent()
    rewritten, _ = user_session("a", "b", "c").rewrite(
        1, 2, [Message(role="notice", content="n")], actor="me"
    )
    with_meta = compacted.to_json()
    with_meta["metadata"]["opaque"] = {"x": [1, 2.5, None, True, "é"]}
    docs = [
        encode(user_session()),
        encode(user_session("a", "b")),
        encode(compacted),
        encode(rewritten),
        session_blob(with_meta),
        malformed_history_blob(user_session("a")),
        malformed_history_blob(rewritten, history={"head": "h", "commits": [], "revisions": []}),
        malformed_history_blob(rewritten, history={"head": 1, "commits": [{}], "revisions": []}),
        snapshot_with_raw_intents(compacted, [intent]),
    ]
    for bad in (
        {"version": 2, "id": compacted.id, "messages": [], "metadata": {}, "extra": 1},
        {"version": 2, "id": compacted.id, "messages": [{"role": "bot", "content": "x"}]},
        {"version": 2, "id": compacted.id, "messages": "no", "metadata": {}},
        {"version": 2, "id": 5, "messages": [], "metadata": {}},
        {"version": 2, "id": compacted.id, "messages": [], "metadata": []},
        {"version": 2, "id": compacted.id, "messages": [], "metadata": {"compaction_intents": 1}},
    ):
        docs.append(session_blob(bad))
    docs.append(snapshot_with_raw_intents(compacted, [{"projection": {}, "summary_tokens": True}]))
    return docs


def _outcome(data: bytes) -> object:
    try:
        return SM._decode_session(data)
    except DecodeProblem as exc:
        return ("DecodeProblem", str(exc))


def test_validating_the_parsed_object_equals_validating_the_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    docs = _corpus()
    fast = [_outcome(d) for d in docs]
    monkeypatch.setattr(SM, "_wire_from", lambda obj: None)
    monkeypatch.setattr(SM, "_history_from", lambda value: None)
    slow = [_outcome(d) for d in docs]
    assert fast == slow
    decoded = [o for o in fast if isinstance(o, SM.Session)]
    assert len(decoded) == 9 and any(s.history is not None for s in decoded)
    assert any(s.malformed_history is not None for s in decoded)
    assert any(s.compaction_intents for s in decoded)


# --------------------------------------------------------------------------
# A continuation of a cached snapshot is decoded from its new part only


def _continuations(base: bytes) -> list[bytes]:
    """Documents that repeat ``base`` up to its last message's end, valid and not."""
    end = base.index(b'],"metadata":')
    head, after = base[:end], base[end:]  # after: '],"metadata":{...},"version":2}'
    new = b'{"content":"next","role":"assistant"}'

    def meta(entry: bytes) -> bytes:  # ``after`` with one more metadata entry first
        comma = b"" if after.startswith(b'],"metadata":{}') else b","
        return after.replace(b'"metadata":{', b'"metadata":{' + entry + comma, 1)

    return [
        head + b"," + new + after,  # one more message
        head + b"," + new + b"," + new + after,  # two more
        head + after,  # the same messages
        head + meta(b'"note":[1,2.5,"\\u00e9"]'),
        head + b"," + new.replace(b"assistant", b"bot") + after,  # a bad role
        head + b"," + new.replace(b'"role"', b'"content":"x","role"') + after,  # dup key
        head + b"," + new + b',"messages":[]' + after,  # the envelope repeats a key
        head + b"," + new + after.replace(b'"version":2', b'"id":"x","version":2'),
        head + b"," + new.replace(b"next", b"\\ud800") + after,  # a lone surrogate
        head + b"," + new + meta(b'"n":NaN'),
        head + b"," + new + meta(b'"d":' + b"[" * 130 + b"]" * 130),
        head + b",]" + after[1:],  # a trailing comma
        head + b"," + after,  # an empty element
        head + b"," + new + after + b" x",  # trailing text
        head + b"," + new + after.replace(b'"version":2', b'"version":1'),
        head + b"," + new + b"\xff" + after,  # not UTF-8
        head + b" ," + new + after,  # whitespace first: decoded in full
    ]


def _decoded(data: bytes) -> object:
    try:
        return SM._decode_session(data)
    except DecodeProblem as exc:
        return ("DecodeProblem", str(exc))


def _full(data: bytes) -> object:
    try:
        return SM._decode_document(data)
    except DecodeProblem as exc:
        return ("DecodeProblem", str(exc))


@pytest.mark.parametrize(
    "base_session",
    [
        user_session("a", 'tricky ],"metadata":{ "quoted" \\ ]'),
        session_with_compaction_intent()[0],
        user_session("a", "b", "c").rewrite(
            1, 2, [Message(role="notice", content="n")], actor="me"
        )[0],
    ],
    ids=["plain", "compacted", "rewritten"],
)
def test_a_continuation_decodes_as_the_whole_document(base_session: SM.Session) -> None:
    base = encode(base_session)
    decode_session(base)  # cached: the base of every continuation below
    docs = _continuations(base)
    assert all(SM.DECODED_SESSIONS.continued_by(d) is not None for d in docs[:-1])
    assert SM.DECODED_SESSIONS.continued_by(docs[-1]) is None
    outcomes = [_decoded(d) for d in docs]
    assert outcomes == [_full(d) for d in docs]
    sessions = [o for o in outcomes if isinstance(o, SM.Session)]
    assert len(sessions) == 5
    assert sessions[0].messages[:-1] == base_session.messages
    assert sessions[0].messages[-1] == Message(role="assistant", content="next")


def test_a_continuation_needs_the_cached_bytes_and_canonical_layout() -> None:
    session = user_session("a", "b")
    base = encode(session)
    nxt = encode(session.with_message("user", "c"))
    assert SM.DECODED_SESSIONS.continued_by(nxt) is None  # nothing cached
    decode_session(base)
    assert SM.DECODED_SESSIONS.continued_by(nxt) is not None
    # another session's id, a changed message, an unsorted envelope: no base
    other = encode(user_session("a", "b").with_message("user", "c"))
    changed = nxt.replace(b'"b"', b'"B"')
    unsorted = session_blob({"messages": [], **session.with_message("user", "c").to_json()})
    for data in (other, changed, unsorted):
        assert SM.DECODED_SESSIONS.continued_by(data) is None
        assert decode_session(data) == SM._decode_document(data)
    # an evicted base is forgotten; a session without messages is never a base
    SM.DECODED_SESSIONS.clear()
    assert SM.DECODED_SESSIONS.continued_by(nxt) is None
    empty = encode(user_session())
    decode_session(empty)
    assert (
        SM.DECODED_SESSIONS.continued_by(
            encode(user_session("a", session_id=SM.decode_session(empty).id))
        )
        is None
    )


def test_an_evicted_base_is_not_used() -> None:
    cache = DecodedSessionCache(max_entries=1)
    first, second = user_session("a"), user_session("b")
    cache.put(encode(first), first)
    cache.put(encode(second), second)  # evicts the first
    assert cache.continued_by(encode(first.with_message("user", "x"))) is None
    assert cache.continued_by(encode(second.with_message("user", "x"))) is not None


# --------------------------------------------------------------------------
# Messages appended and nothing else changed: only the appended part is decoded


def _appended(base: bytes) -> list[bytes]:
    """Documents that are ``base`` with something put after its last message."""
    end = base.index(b'],"metadata":')
    head, after = base[:end], base[end:]
    new = b'{"content":"next","role":"assistant"}'
    return [
        head + b"," + new + after,  # one more message
        head + b"," + new + b"," + new.replace(b"next", b"\\u00e9\xc3\xa9") + after,  # two
        head + b", " + new + b" " + after,  # whitespace around it: valid, not canonical
        head + b"," + b"[" + new + b"]" + after,  # an array, not a message
        head + b"," + new + b',"x"' + after,  # a string, not a message
        head + b"," + new + b'],"metadata":{},"version":2,"x":[' + after,  # closes the array
        head + b"," + new.replace(b"next", b"\\udc00") + after,  # a lone surrogate
        head + b"," + new.replace(b'"next"', b"1e999") + after,  # a number too large
        head + b"," + new.replace(b'"next"', b"[" * 125 + b"]" * 125) + after,  # 128 deep
        head + b"," + new.replace(b'"next"', b"[" * 126 + b"]" * 126) + after,  # 129 deep
        head + b"," + new + b"\xc3" + after,  # not UTF-8
        head + b",," + new + after,  # an empty element
        head + b"," + after,  # nothing appended
        head + b", " + after,  # only whitespace appended
    ]


@pytest.mark.parametrize(
    "base_session",
    [user_session("a", "b"), session_with_compaction_intent()[0]],
    ids=["plain", "compacted"],
)
def test_appended_messages_decode_as_the_whole_document(
    base_session: SM.Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = encode(base_session)
    decode_session(base)
    docs = _appended(base)
    full = [_full(d) for d in docs]
    documents: list[bytes] = []
    real = SM._decode_document

    def counting(data: bytes) -> SM.Session:
        documents.append(data)
        return real(data)

    monkeypatch.setattr(SM, "_decode_document", counting)
    outcomes = []
    for data in docs:
        documents.clear()
        outcomes.append(_decoded(data))
        if data in docs[:3]:  # appended messages: nothing else is decoded
            assert documents == []
    assert outcomes == full
    sessions = [o for o in outcomes if isinstance(o, SM.Session)]
    assert len(sessions) == 3
    assert "content" in str(outcomes[8]) and "nested deeper" in str(outcomes[9])
    assert sessions[1].messages[-2:] == (
        Message(role="assistant", content="next"),
        Message(role="assistant", content="éé"),
    )


def test_a_cached_continuation_records_where_its_messages_end() -> None:
    """The entry of a snapshot kept after a continuation holds :func:`_messages_end`'s
    value, so the next continuation is cut at the right place."""
    session = user_session("a", 'x ],"metadata": ]')
    docs = [encode(session)]
    for i in range(3):
        session = session.with_message("assistant", f"r{i} ]")
        docs.append(encode(session))
    end = docs[-1].index(b'],"metadata":')
    new = b'{"content":"s","role":"user"}'
    spaced = docs[-1][:end] + b"," + new + b" " + docs[-1][end:]  # valid, but not a base
    for data in [*docs, spaced]:
        decoded = decode_session(data)
        assert decoded == SM._decode_document(data)
        _, end = SM.DECODED_SESSIONS._entries[data]
        assert end == SM._messages_end(data, decoded)
    assert SM.DECODED_SESSIONS._entries[spaced][1] == -1
    assert SM.DECODED_SESSIONS._entries[docs[-1]][1] > 0


def test_a_lookup_compares_every_byte_of_a_same_length_snapshot() -> None:
    """The same-length probe ends in an exact comparison; an evicted one is forgotten."""
    cache = DecodedSessionCache(max_entries=2)
    a, b = user_session("a"), user_session("b")
    first, second = encode(a), encode(b)
    assert len(first) == len(second)  # same length, other bytes
    cache.put(first, a)
    assert cache.get(bytes(bytearray(first))) is a  # an equal, new object: a hit
    assert cache.get(second) is None
    cache.put(second, b)  # now the probe's snapshot of that length
    assert cache.get(bytes(bytearray(first))) is a and cache.get(second) is b
    changed = first[:-3] + b"}}}"
    assert cache.get(changed) is None
    cache.put(encode(user_session("c", "d")), user_session("c", "d"))
    cache.put(encode(user_session("e", "f")), user_session("e", "f"))  # both evicted
    assert cache.get(first) is None and cache.get(second) is None
