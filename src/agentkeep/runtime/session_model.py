"""The reference session JSON model and its codec (docs/runtime.md#reference-session-format).

Holds the transcript types (messages, rewrite commits, the retained history,
compaction-projection intents), the revision and commit-fingerprint digests,
:class:`Session` with its strict decoder :func:`decode_session`, identifier
helpers, and the strict JSON helpers the other domain codecs share
(:func:`load_object`, :func:`validate_strict`, and :func:`canonical_bytes`,
which is :mod:`agentkeep.strict_json`'s). There is no database code here and
so no fence; the store's fenced writes are :mod:`agentkeep.runtime.repository`'s.

Choices where the original store was open
(docs/decisions.md#strict-decoding-and-malformed-histories):

* Decoding is strict: the JSON rules of :mod:`agentkeep.strict_json` (no
  duplicate keys, NaN, lone surrogates, nesting deeper than 128), unknown
  fields, wrong JSON types (``true`` for an integer) and unknown versions are
  refused; nothing is
  defaulted or upgraded on read. Session ``version`` must be 2 (missing:
  "missing session version"; 1: "generated session persistence version
  authority rejected").
* Session ids must be canonical lower-case hyphenated UUIDs. Session metadata
  keys other than ``transcript_history`` and ``compaction_intents`` are kept
  opaque and round-trip unchanged; ``compaction_intents`` is decoded strictly
  (a malformed list fails the session decode).
* A well-formed ``transcript_history`` holds at least one commit, and its
  ``revisions`` list each body once, under its own digest. A commit's bodies
  are looked up there, or are the live messages when the revision is the head.
* A malformed ``transcript_history`` (not a history object, missing or
  mistyped fields, no commits, a body recorded twice or under another digest)
  does NOT fail the session decode: the envelope (version, id, messages,
  metadata object, intents) is still decoded strictly, but the history value is
  kept verbatim in :attr:`Session.malformed_history` with the reason, and
  :attr:`Session.history` is None. Encoding gives the same value back, so the
  stored bytes round-trip. The placeholder check counts such a history as
  absent (docs/runtime.md#placeholder-sessions); every guard refuses it (see
  :mod:`agentkeep.runtime.guards`). An explicit ``null`` history is absent.
* :func:`decode_session` keeps its recent results in a bounded cache keyed by
  the exact snapshot bytes (:class:`DecodedSessionCache`): a boundary's
  incoming snapshot is the next boundary's stored head, so the store decodes
  each snapshot once (docs/runtime.md#decoded-snapshot-cache). A decoded
  :class:`Session` is frozen; its two parts that hold opaque JSON
  (``extra_metadata``, ``malformed_history.value``) are deep-copied on every
  cache hit, so no caller ever holds the cached value's mutable parts. A
  snapshot that repeats a cached one's bytes up to its last message and
  appends messages is decoded from its new part only, the cached messages
  reused (:meth:`DecodedSessionCache.continued_by`); when nothing else
  changed (the rest is the cached document's, byte for byte), only the
  appended messages are parsed and validated and the cached envelope and
  metadata are reused (:func:`_appended_messages`). The result and the
  errors are those of a full decode.
* A snapshot is parsed once: the object the strict parser returns is
  validated in pydantic's strict Python mode (JSON arrays turned into the
  tuples the models hold), not the bytes again; the history likewise, not
  re-encoded and re-parsed. A document that does not validate that way is
  validated from its bytes as before, so every error message is unchanged.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
import threading
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Final, Literal, TypeAlias, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    TypeAdapter,
    ValidationError,
    model_validator,
)

from agentkeep.bounds import I64_MAX, U63
from agentkeep.errors import InvalidInput
from agentkeep.strict_json import JSON_MAX_DEPTH, JsonError, canonical_bytes
from agentkeep.strict_json import loads as strict_loads

__all__ = [
    "COMPACTION_SELECTION",
    "MAX_U63",
    "RETIRED_SESSION_VERSIONS",
    "SESSION_VERSION",
    "STRICT",
    "CompactionIntent",
    "DecodeProblem",
    "MalformedHistory",
    "Message",
    "ProjectionId",
    "RevisionBody",
    "RewriteSelection",
    "Role",
    "Session",
    "TranscriptCommit",
    "TranscriptHistory",
    "ENCODE_TEXT",
    "canonical_bytes",
    "canonical_uuid",
    "check_version",
    "commit_fingerprint",
    "DecodedSessionCache",
    "decode_session",
    "load_object",
    "logical_runtime_id_for_session",
    "revision_of",
    "validate_strict",
]

SESSION_VERSION: Final = 2
RETIRED_SESSION_VERSIONS: Final = frozenset({1})
#: ``2**63-1`` (:data:`agentkeep.bounds.I64_MAX`): the top of every count and
#: index, which the stores keep in signed 64-bit columns.
MAX_U63: Final = I64_MAX
COMPACTION_SELECTION: Final = "compaction_message_range"

STRICT: Final = ConfigDict(frozen=True, extra="forbid", strict=True)
"""Model config of every wire type: frozen, no unknown fields, no coercion."""

_M = TypeVar("_M", bound=BaseModel)


class DecodeProblem(Exception):
    """A value did not decode or validate; the caller wraps it in a store error."""


# --------------------------------------------------------------------------
#: How :func:`canonical_bytes` writes a string (``ensure_ascii=False``: only
#: ``"``, ``\\`` and control characters are escaped), for the encoders that
#: write a fixed document shape directly (input states, receipts).
ENCODE_TEXT: Final = json.encoder.encode_basestring

# Strict JSON helpers (the rules are agentkeep.strict_json's; canonical_bytes
# is re-exported from there)


def load_object(data: bytes, what: str) -> dict[str, Any]:
    """Parse ``data`` as a strict UTF-8 JSON object (:func:`agentkeep.strict_json.loads`).

    Raises:
        DecodeProblem: not bytes; not UTF-8 JSON (``"<what> is not UTF-8 JSON:
            …"``); a key repeats (``"duplicate JSON key 'k'"``); NaN or
            infinity, a lone surrogate or nesting deeper than 128 levels
            (``"<what> is not strict JSON: …"``); or not an object.
    """
    if not isinstance(data, bytes | bytearray | memoryview):
        raise DecodeProblem(f"{what} must be bytes, got {type(data).__name__}")
    try:
        value = strict_loads(data)
    except JsonError as exc:
        if exc.kind in ("utf8", "syntax"):
            raise DecodeProblem(f"{what} is not UTF-8 JSON: {exc}") from exc
        if exc.kind == "duplicate_key":
            raise DecodeProblem(str(exc)) from exc
        raise DecodeProblem(f"{what} is not strict JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise DecodeProblem(f"{what} must be a JSON object, got {type(value).__name__}")
    return value


def validate_strict(model: type[_M], data: bytes, what: str) -> _M:
    """Validate JSON ``data`` as ``model`` in strict mode.

    Pydantic parses the bytes itself and does not apply the
    :mod:`agentkeep.strict_json` rules: callers run :func:`load_object` on the
    same bytes first (or pass canonical bytes they encoded).

    Raises:
        DecodeProblem: naming every failing field.
    """
    try:
        return model.model_validate_json(bytes(data), strict=True)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['msg']}"
            for err in exc.errors()
        )
        raise DecodeProblem(f"invalid {what}: {problems}") from exc


def check_version(obj: dict[str, Any], field: str, current: int, what: str) -> None:
    """Require ``obj[field]`` to be the integer ``current``.

    Raises:
        DecodeProblem: the field is missing (the message names it) or another value.
    """
    if field not in obj:
        raise DecodeProblem(f"{what} is missing mandatory {field}")
    got = obj[field]
    if type(got) is not int or got != current:
        raise DecodeProblem(f"unsupported {what} {field} {got!r}: expected {current}")


def revision_of(messages: Sequence[Message]) -> str:
    """Return ``rev(msgs) = "sha256:" + hex(sha256(canonical_json(msgs)))``.

    Args:
        messages: a message list (a transcript body or a span of one).
    """
    body = [m.model_dump(mode="json") for m in messages]
    return "sha256:" + hashlib.sha256(canonical_bytes(body)).hexdigest()


_CANONICAL_UUID: Final = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def canonical_uuid(text: str, kind: str) -> str:
    """Check that ``text`` is a canonical (lower-case, hyphenated) UUID and return it.

    Raises:
        InvalidInput: ``text`` is not in canonical UUID form.
    """
    # The canonical form is exactly 8-4-4-4-12 lower-case hex digits (what
    # ``str(uuid.UUID(text))`` gives back); anything else is parsed to say
    # whether it is no UUID or a non-canonical one.
    if type(text) is str and _CANONICAL_UUID.fullmatch(text):
        return text
    try:
        parsed = uuid.UUID(text)
    except (ValueError, AttributeError, TypeError) as exc:
        raise InvalidInput(kind, f"{text!r} is not a UUID") from exc
    if str(parsed) != text:
        raise InvalidInput(kind, f"{text!r} is not a canonical hyphenated lower-case UUID")
    return text


def logical_runtime_id_for_session(session_id: str) -> str:
    """Return the logical runtime id of a session: ``rt:session:{session_id}``.

    See docs/runtime.md#common-rules.
    """
    return f"rt:session:{canonical_uuid(session_id, 'session_id')}"


# --------------------------------------------------------------------------
# Transcript types

Role: TypeAlias = Literal["system", "user", "assistant", "notice"]


class Message(BaseModel):
    """One transcript message."""

    model_config = STRICT

    role: Role
    content: str

    # The guards compare transcripts message by message; pydantic's generic
    # __eq__ costs several times this. Same result: two fields, no extras.
    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        assert isinstance(other, Message)
        return self.role == other.role and self.content == other.content

    def __hash__(self) -> int:
        return hash((self.role, self.content))


class RewriteSelection(BaseModel):
    """The span a rewrite replaced: ``messages[start:end]`` of the parent body."""

    model_config = STRICT

    type: Literal["message_range", "compaction_message_range"]
    start: U63
    end: U63


class TranscriptCommit(BaseModel):
    """A transcript-rewrite commit: parent body → body with one span replaced."""

    model_config = STRICT

    parent_revision: str
    revision: str
    selection: RewriteSelection
    messages_before: U63
    messages_after: U63
    original_span_digest: str
    replacement_digest: str
    actor: str


class RevisionBody(BaseModel):
    """A recorded transcript body and its revision."""

    model_config = STRICT

    revision: str
    messages: tuple[Message, ...]


class TranscriptHistory(BaseModel):
    """The retained rewrite history: head revision, commits, recorded bodies."""

    model_config = STRICT

    head: str
    commits: tuple[TranscriptCommit, ...]
    revisions: tuple[RevisionBody, ...]


class MalformedHistory(BaseModel):
    """A ``transcript_history`` metadata value that did not decode, kept verbatim.

    Attributes:
        problem: why it did not decode.
        value: the JSON value as stored.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    problem: str
    value: JsonValue


class ProjectionId(BaseModel):
    """The identity of a compaction projection; with the runtime id, the outbox key."""

    model_config = STRICT

    session_id: str
    parent_revision: str
    revision: str
    commit_fingerprint: str


class CompactionIntent(BaseModel):
    """A compaction-projection intent carried in session metadata and the outbox.

    See docs/runtime.md#compaction-intents.
    """

    model_config = STRICT

    projection: ProjectionId
    summary_tokens: U63
    messages_before: U63
    messages_after: U63

    @classmethod
    def for_commit(
        cls, session_id: str, commit: TranscriptCommit, summary_tokens: int
    ) -> CompactionIntent:
        """Build the intent that projects ``commit`` of session ``session_id``."""
        return cls(
            projection=ProjectionId(
                session_id=session_id,
                parent_revision=commit.parent_revision,
                revision=commit.revision,
                commit_fingerprint=commit_fingerprint(commit),
            ),
            summary_tokens=summary_tokens,
            messages_before=commit.messages_before,
            messages_after=commit.messages_after,
        )


def commit_fingerprint(commit: TranscriptCommit) -> str:
    """Return the commit's fingerprint, without its revisions (docs/runtime.md#compaction-intents).

    ``"sha256:" + hex(sha256(canonical JSON of {selection, original_span_digest,
    replacement_digest, messages_before, messages_after, actor}))``.
    """
    body = commit.model_dump(
        mode="json",
        include={
            "selection",
            "original_span_digest",
            "replacement_digest",
            "messages_before",
            "messages_after",
            "actor",
        },
    )
    return "sha256:" + hashlib.sha256(canonical_bytes(body)).hexdigest()


# --------------------------------------------------------------------------
# Session


class Session(BaseModel):
    """A decoded reference session (docs/runtime.md#reference-session-format).

    Attributes:
        id: the session id (canonical UUID).
        messages: the live transcript.
        history: the retained rewrite history, if any (None when malformed).
        malformed_history: a ``transcript_history`` that did not decode, kept
            verbatim; set only when ``history`` is None.
        compaction_intents: intents in metadata order (validated only by the guard).
        extra_metadata: other metadata keys, kept opaque.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str
    messages: tuple[Message, ...] = ()
    history: TranscriptHistory | None = None
    malformed_history: MalformedHistory | None = None
    compaction_intents: tuple[CompactionIntent, ...] = ()
    extra_metadata: dict[str, JsonValue] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _one_history(self) -> Session:
        if self.history is not None and self.malformed_history is not None:
            raise ValueError("a session has either a history or a malformed history")
        return self

    @classmethod
    def new(cls, session_id: str | None = None) -> Session:
        """Return an empty session with ``session_id`` (a fresh UUID4 by default)."""
        sid = str(uuid.uuid4()) if session_id is None else canonical_uuid(session_id, "session_id")
        return cls(id=sid)

    @property
    def history_problem(self) -> str | None:
        """Why the stored ``transcript_history`` did not decode, or None."""
        return self.malformed_history.problem if self.malformed_history is not None else None

    @property
    def revision(self) -> str:
        """The head revision: the history's head, else the digest of the live messages."""
        return self.history.head if self.history is not None else revision_of(self.messages)

    @property
    def commits(self) -> tuple[TranscriptCommit, ...]:
        """The history's commits (empty without a well-formed history)."""
        return self.history.commits if self.history is not None else ()

    def body(self, revision: str) -> tuple[Message, ...] | None:
        """Return the recorded body of ``revision`` (the live messages at the head)."""
        if self.history is not None:
            if revision == self.history.head:
                return self.messages
            for entry in self.history.revisions:
                if entry.revision == revision:
                    return entry.messages
        return None

    def with_message(self, role: Role, content: str) -> Session:
        """Return the session with one message appended (head kept coherent)."""
        messages = (*self.messages, Message(role=role, content=content))
        history = self.history
        if history is not None:
            history = history.model_copy(update={"head": revision_of(messages)})
        return self.model_copy(update={"messages": messages, "history": history})

    def rewrite(
        self,
        start: int,
        end: int,
        replacement: Sequence[Message],
        *,
        actor: str,
        compaction: bool = False,
    ) -> tuple[Session, TranscriptCommit]:
        """Replace ``messages[start:end]`` by ``replacement`` and record the commit.

        Args:
            start: first replaced index.
            end: end of the replaced span (exclusive).
            replacement: the new messages.
            actor: who rewrote the transcript.
            compaction: record the selection as ``compaction_message_range``.

        Returns:
            The rewritten session and its commit.

        Raises:
            InvalidInput: the span is out of bounds, or the history is malformed
                (it would be lost).
        """
        if self.malformed_history is not None:
            raise InvalidInput(
                "transcript_history",
                f"cannot rewrite over a malformed history: {self.malformed_history.problem}",
            )
        if not 0 <= start <= end <= len(self.messages):
            raise InvalidInput("selection", f"span {start}..{end} outside 0..{len(self.messages)}")
        parent = self.messages
        new = (*parent[:start], *replacement, *parent[end:])
        commit = TranscriptCommit(
            parent_revision=revision_of(parent),
            revision=revision_of(new),
            selection=RewriteSelection(
                type=COMPACTION_SELECTION if compaction else "message_range", start=start, end=end
            ),
            messages_before=len(parent),
            messages_after=len(new),
            original_span_digest=revision_of(parent[start:end]),
            replacement_digest=revision_of(tuple(replacement)),
            actor=actor,
        )
        old = self.history
        revisions = list(old.revisions) if old is not None else []
        known = {r.revision for r in revisions}
        for rev, body in ((commit.parent_revision, parent), (commit.revision, new)):
            if rev not in known:
                revisions.append(RevisionBody(revision=rev, messages=body))
                known.add(rev)
        history = TranscriptHistory(
            head=commit.revision,
            commits=(*(old.commits if old is not None else ()), commit),
            revisions=tuple(revisions),
        )
        return self.model_copy(update={"messages": new, "history": history}), commit

    def with_compaction_intents(self, intents: Sequence[CompactionIntent]) -> Session:
        """Return the session with its metadata intents replaced (no validation)."""
        return self.model_copy(update={"compaction_intents": tuple(intents)})

    def to_json(self) -> dict[str, Any]:
        """Return the reference JSON object of the session."""
        metadata: dict[str, Any] = dict(self.extra_metadata)
        if self.history is not None:
            metadata["transcript_history"] = self.history.model_dump(mode="json")
        elif self.malformed_history is not None:
            metadata["transcript_history"] = self.malformed_history.value
        if self.compaction_intents:
            metadata["compaction_intents"] = [
                i.model_dump(mode="json") for i in self.compaction_intents
            ]
        return {
            "version": SESSION_VERSION,
            "id": self.id,
            "messages": [m.model_dump(mode="json") for m in self.messages],
            "metadata": metadata,
        }


# --------------------------------------------------------------------------
# Session codec


class _SessionMetadataWire(BaseModel):
    model_config = ConfigDict(frozen=True, extra="allow", strict=True)

    transcript_history: JsonValue = None
    compaction_intents: tuple[CompactionIntent, ...] = ()


class _SessionWire(BaseModel):
    model_config = STRICT

    version: int
    id: str
    messages: tuple[Message, ...]
    metadata: _SessionMetadataWire


# The strictly parsed object validated in pydantic's strict *Python* mode, so
# the document is not parsed a second time. Strict Python mode reads JSON
# arrays only as tuples where the models hold tuples, so those lists are
# turned into tuples first; everything else (text, integers, literals, nested
# objects, free JSON values) validates as it does from JSON in strict mode.
# Anything irregular returns None: the caller then validates the bytes as
# before, whose error names the problem, so errors are unchanged.

_ENVELOPE: Final = frozenset(_SessionWire.model_fields)


def _wire_from(obj: dict[str, Any]) -> _SessionWire | None:
    """The session envelope from its parsed object, or None to validate the bytes instead."""
    messages, metadata = obj.get("messages"), obj.get("metadata")
    if obj.keys() != _ENVELOPE or type(messages) is not list or type(metadata) is not dict:
        return None
    intents = metadata.get("compaction_intents")
    if type(intents) is list:
        metadata = {**metadata, "compaction_intents": tuple(intents)}
    fields = {**obj, "messages": tuple(messages), "metadata": metadata}
    try:
        return _SessionWire.model_validate(fields, strict=True)
    except ValidationError:
        return None


def _history_from(value: dict[str, Any]) -> TranscriptHistory | None:
    """A history from its parsed object, or None to validate its canonical bytes instead."""
    commits, revisions = value.get("commits"), value.get("revisions")
    if type(commits) is not list or type(revisions) is not list:
        return None
    bodies = []
    for body in revisions:
        if type(body) is not dict or type(body.get("messages")) is not list:
            return None
        bodies.append({**body, "messages": tuple(body["messages"])})
    fields = {**value, "commits": tuple(commits), "revisions": tuple(bodies)}
    try:
        return TranscriptHistory.model_validate(fields, strict=True)
    except ValidationError:
        return None


def _decode_history(value: JsonValue) -> TranscriptHistory:
    """Decode a ``transcript_history`` value strictly. Raises DecodeProblem."""
    if not isinstance(value, dict):
        raise DecodeProblem(f"transcript_history must be a JSON object, got {type(value).__name__}")
    history = _history_from(value)
    if history is None:  # the JSON validation names what is wrong
        try:
            data = canonical_bytes(value)
        except ValueError as exc:
            raise DecodeProblem(f"transcript_history is not a JSON value: {exc}") from exc
        history = validate_strict(TranscriptHistory, data, "transcript_history")
    if not history.commits:
        raise DecodeProblem("transcript_history has no commits")
    seen: set[str] = set()
    for entry in history.revisions:
        if entry.revision in seen:
            raise DecodeProblem(f"transcript_history records revision {entry.revision} twice")
        seen.add(entry.revision)
        if revision_of(entry.messages) != entry.revision:
            raise DecodeProblem(f"transcript_history body of {entry.revision} has another digest")
    return history


class DecodedSessionCache:
    """A bounded, thread-safe map from snapshot bytes to their decoded :class:`Session`.

    The key is the bytes themselves, so a changed snapshot — one byte
    differs — is never served another's session. A lookup first compares
    ``data`` with the most recently kept snapshot of the same length (an
    exact comparison of every byte, which costs less than hashing them: a
    stored head read back from the database is a new ``bytes`` object, equal
    to the snapshot kept when it was written); otherwise it is a dict lookup
    (their hash, then an exact comparison). Only successful decodes are kept;
    a snapshot that fails is decoded (and fails) again every time. At most
    ``max_entries`` sessions whose snapshots total at most ``max_total_bytes``
    are kept, least recently used out first; a snapshot longer than
    ``max_bytes`` is not kept.

    Each session id also names its most recently kept snapshot, when that
    snapshot has the layout a continuation can be decoded against (see
    :meth:`continued_by`).
    """

    def __init__(
        self, max_entries: int = 64, max_bytes: int = 4 << 20, max_total_bytes: int = 64 << 20
    ) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.max_total_bytes = max_total_bytes
        self._entries: OrderedDict[bytes, tuple[Session, int]] = OrderedDict()
        self._latest: dict[str, bytes] = {}
        # The most recently kept snapshot of each length (every one is a key of _entries).
        self._by_length: dict[int, bytes] = {}
        self._total = 0
        self._lock = threading.Lock()

    def get(self, data: bytes) -> Session | None:
        """The session cached for exactly ``data``, or None (the entry becomes the newest)."""
        with self._lock:
            same = self._by_length.get(len(data))
            key = same if same is not None and same == data else data
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            return entry[0]

    def put(self, data: bytes, session: Session) -> None:
        """Keep ``session`` as the decode of ``data`` (unless ``data`` is too long).

        ``session`` must be the decode of ``data``: :meth:`continued_by` relies
        on it. Where its messages end is searched for from the end of the
        cached snapshot ``data`` continues, if any (see :meth:`_end_of`).
        """
        if len(data) > self.max_bytes or self.max_entries <= 0:
            return
        end = self._end_of(data, session)
        with self._lock:
            if data not in self._entries:
                self._total += len(data)
            self._entries[data] = (session, end)
            self._entries.move_to_end(data)
            self._by_length[len(data)] = data
            if end > 0:
                self._latest[session.id] = data
            while len(self._entries) > self.max_entries or self._total > self.max_total_bytes:
                old, (gone, _) = self._entries.popitem(last=False)
                self._total -= len(old)
                if self._latest.get(gone.id) == old:
                    del self._latest[gone.id]
                if self._by_length.get(len(old)) == old:
                    del self._by_length[len(old)]

    def _end_of(self, data: bytes, session: Session) -> int:
        """:func:`_messages_end` of ``data``, searched from where the cached messages end.

        When ``data`` continues the most recently kept snapshot of its session
        (it repeats that snapshot's bytes up to the end of its last message,
        then ``,``), its messages cannot end before: the text
        ``],"metadata":`` occurs in the cached snapshot first where its
        messages end, it cannot start at the ``,`` nor overlap it (its only
        ``,`` is its second character, after a ``]``, and the cached last
        message ends with ``}``). So only the new part is searched.
        """
        with self._lock:
            base = self._latest.get(session.id)
            entry = None if base is None else self._entries.get(base)
        if base is not None and entry is not None:
            end = entry[1]
            if data[end : end + 1] == b"," and data[:end] == base[:end]:
                found = data.find(_MESSAGES_CLOSE, end + 1)
                return found if found > 0 and data[found - 1 : found] == b"}" else -1
        return _messages_end(data, session)

    def continued_by(self, data: bytes) -> tuple[Session, int, bytes] | None:
        """The cached session ``data`` may continue, where its messages end, and its bytes.

        The candidate is the most recently kept snapshot of the session id
        ``data`` starts with; it is returned (as ``(session, end, snapshot)``)
        only if ``data`` repeats its bytes up to ``end``, the end of its last
        message, and then goes on with ``,`` (more messages) or ``]`` (no
        more). Otherwise None.
        """
        if not data.startswith(_ID_OPEN) or data[_ID_END : _ID_END + len(_MESSAGES_OPEN)] != (
            _MESSAGES_OPEN
        ):
            return None
        sid = data[len(_ID_OPEN) : _ID_END].decode("ascii", "replace")
        with self._lock:
            base = self._latest.get(sid)
            if base is None:
                return None
            session, end = self._entries[base]
        if data[end : end + 1] not in (b",", b"]") or data[:end] != base[:end]:
            return None
        return session, end, base

    def clear(self) -> None:
        """Forget every entry."""
        with self._lock:
            self._entries.clear()
            self._latest.clear()
            self._by_length.clear()
            self._total = 0

    def __len__(self) -> int:
        return len(self._entries)


#: The cache :func:`decode_session` uses.
DECODED_SESSIONS: Final = DecodedSessionCache()


def _handed_out(session: Session) -> Session:
    """``session`` as a caller may hold it: its opaque JSON parts copied, the rest shared."""
    malformed = session.malformed_history
    if not session.extra_metadata and malformed is None:
        return session  # frozen all the way down: shared as is
    return session.model_copy(
        update={
            "extra_metadata": copy.deepcopy(session.extra_metadata),
            "malformed_history": None
            if malformed is None
            else malformed.model_copy(update={"value": copy.deepcopy(malformed.value)}),
        }
    )


def decode_session(data: bytes) -> Session:
    """Decode reference session bytes: a strict envelope, a tolerated malformed history.

    The result of ``bytes`` input is cached (:data:`DECODED_SESSIONS`): the
    same bytes decode once; a hit is equal to a fresh decode.

    Raises:
        DecodeProblem: the bytes, version, id, messages, metadata object or
            compaction intents do not decode.
    """
    if type(data) is not bytes:
        return _decode_session(data)
    session = DECODED_SESSIONS.get(data)
    if session is None:
        session = _decode_session(data)
        DECODED_SESSIONS.put(data, session)
    return _handed_out(session)


# A continuation: the snapshot that appends messages to a cached one.
#
# A boundary's snapshot is, most often, the previous boundary's with messages
# appended. When the previous snapshot is cached and starts, byte for byte,
# ``{"id":"<its id>","messages":[`` (the canonical layout: keys sorted, no
# whitespace), its messages end at the first ``],"metadata":`` after that: a
# message is an object of two strings, and ``"`` cannot occur inside a JSON
# string, so that text cannot occur before the array closes. A snapshot that
# repeats those bytes and goes on with ``,`` or ``]`` holds the cached
# messages, then its own. Those are decoded from the document with the
# cached messages (and the comma after them) cut out: ``{"id":"<id>",
# "messages":[`` + the rest. A JSON array with its first elements (complete
# values, each valid in the same place of the cached document) removed is
# valid under every rule of :mod:`agentkeep.strict_json` iff the whole is,
# provided an element still follows the cut comma (``[m, ]`` is not JSON); the envelope, metadata,
# history and intents are all in the rest; and a message validates on its own.
# So the decode equals the full one. If the shortened document does not
# decode, the full document is decoded instead, whose error names the problem.
# Most often nothing but the messages changed: the snapshot then also ends
# with the cached one's bytes from its messages' end, and only the appended
# messages are decoded (:func:`_appended_messages`).

_ID_OPEN: Final = b'{"id":"'
_ID_END: Final = len(_ID_OPEN) + 36  # a canonical UUID
_MESSAGES_OPEN: Final = b'","messages":['
_MESSAGES_CLOSE: Final = b'],"metadata":'


def _messages_end(data: bytes, session: Session) -> int:
    """Where ``session``'s last message ends in ``data`` (its decode), or -1 if not canonical."""
    if not session.messages:
        return -1
    opening = b"".join((_ID_OPEN, session.id.encode("ascii"), _MESSAGES_OPEN))
    if not data.startswith(opening):
        return -1
    end = data.find(_MESSAGES_CLOSE, len(opening))
    return end if end > 0 and data[end - 1 : end] == b"}" else -1


def _decode_continuation(data: bytes) -> Session | None:
    """Decode ``data`` as a continuation of a cached snapshot, or None if it is not one.

    Messages appended to the cached snapshot and nothing else changed: only
    the appended messages are decoded (:func:`_appended_messages`). Otherwise
    the document with the cached messages cut out is decoded.
    """
    found = DECODED_SESSIONS.continued_by(data)
    if found is None:
        return None
    base, end, cached = found
    more = data[end : end + 1] == b","
    if more:
        appended = _appended_messages(data, cached, end)
        if appended is not None:
            return base.model_copy(update={"messages": base.messages + appended})
    try:
        tail = _decode_document(data[: _ID_END + len(_MESSAGES_OPEN)] + data[end + more :])
    except DecodeProblem:
        return None  # the full decode names the problem
    if more and not tail.messages:
        return None  # "[m, ]": the comma has no element after it
    return tail.model_copy(update={"messages": base.messages + tail.messages})


#: The appended messages of :func:`_appended_messages`, validated as the envelope validates them.
_MESSAGES: Final = TypeAdapter(tuple[Message, ...])


def _appended_messages(data: bytes, cached: bytes, end: int) -> tuple[Message, ...] | None:
    """The messages ``data`` appends to ``cached`` if that is all it changes, else None.

    ``data`` repeats ``cached`` up to ``end`` (where its last message ends)
    and goes on with ``,`` (:meth:`DecodedSessionCache.continued_by`). If it
    also ends with the rest of ``cached`` (``],"metadata":…``), with at least
    one byte between, it is ``cached[:end] + "," + new + cached[end:]``: the
    envelope, metadata and version are the cached document's, byte for byte,
    and ``new`` sits in the messages array after the cached messages. When
    ``"[" + new + "]"`` is one JSON array valid under every rule of
    :mod:`agentkeep.strict_json` (the cuts are at ASCII characters, so UTF-8
    holds piecewise; an element there nests one level less than in the
    document, hence the depth limit one less), its elements are complete
    values that extend the messages array, so the document is valid too; if
    there is at least one and they validate as messages (strictly, on their
    own, as the envelope's messages do), it decodes to the cached session
    with them appended, which is returned. Anything else returns None and is
    decoded the other way, whose error names the problem.
    """
    rest = len(cached) - end
    if len(data) < len(cached) + 2 or not data.endswith(cached[end:]):
        return None
    try:
        items = strict_loads(
            b"[" + data[end + 1 : len(data) - rest] + b"]", max_depth=JSON_MAX_DEPTH - 1
        )
    except JsonError:
        return None
    if type(items) is not list or not items:
        return None
    try:
        return _MESSAGES.validate_python(tuple(items), strict=True)
    except ValidationError:
        return None


def _decode_session(data: bytes) -> Session:
    """Decode ``data``: as a continuation of a cached snapshot if it is one, else in full."""
    if type(data) is bytes:
        session = _decode_continuation(data)
        if session is not None:
            return session
    return _decode_document(data)


def _decode_document(data: bytes) -> Session:
    obj = load_object(data, "session")
    if "version" not in obj:
        raise DecodeProblem("missing session version (unversioned v0 session rows are not read)")
    version = obj["version"]
    if type(version) is int and version in RETIRED_SESSION_VERSIONS:
        raise DecodeProblem(
            f"generated session persistence version authority rejected version {version}"
        )
    if type(version) is not int or version != SESSION_VERSION:
        raise DecodeProblem(f"unsupported session version {version!r}: expected {SESSION_VERSION}")
    wire = _wire_from(obj)
    if wire is None:  # the JSON validation names what is wrong
        wire = validate_strict(_SessionWire, data, "session")
    try:
        canonical_uuid(wire.id, "session_id")
    except InvalidInput as exc:
        raise DecodeProblem(str(exc)) from exc
    meta = wire.metadata
    history: TranscriptHistory | None = None
    malformed: MalformedHistory | None = None
    if meta.transcript_history is not None:
        try:
            history = _decode_history(meta.transcript_history)
        except DecodeProblem as exc:
            malformed = MalformedHistory(problem=str(exc), value=meta.transcript_history)
    return Session(
        id=wire.id,
        messages=wire.messages,
        history=history,
        malformed_history=malformed,
        compaction_intents=meta.compaction_intents,
        extra_metadata=dict(meta.model_extra or {}),
    )
