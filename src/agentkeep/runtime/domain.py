"""Domain rules of the runtime store (spec runtime §3), behind the :class:`RuntimeDomain` protocol.

This module owns everything the runtime store decides without the database:
the reference session JSON model with its transcript revisions (§3.0), the
save guards R1–R4 (§3.1), head coherence (§3.2), the transcript-rewrite guard
(§3.3), compaction-projection intents and commit fingerprints (§3.4–§3.5),
input-state batch-CAS preparation (§3.6), and the codecs of input states
(§3.10), machine lifecycle records (§3.7) and ops snapshots (§3.8), plus the
unregister-finalization value (§3.9) and identifier helpers (§3.11).

The store depends only on :class:`RuntimeDomain`; :class:`ReferenceDomain` is
the shipped implementation. Payloads are ``bytes`` of canonical JSON
(:func:`agentkeep.columns.canonical_json`, UTF-8), so encoding a decoded
canonical payload gives back the same bytes.

Errors. Decoding a caller-supplied value raises
:class:`~agentkeep.runtime.errors.WriteFailed`; decoding a persisted value
raises :class:`~agentkeep.runtime.errors.ReadFailed`; guard rejections raise
:class:`~agentkeep.runtime.errors.GuardRejected` (a ``WriteFailed``) or
:class:`~agentkeep.runtime.errors.TranscriptRevisionConflict`.

Choices where the spec is open:

* Decoding is strict everywhere: duplicate JSON keys, unknown fields, wrong
  JSON types (``true`` for an integer) and unknown versions are refused;
  nothing is defaulted or upgraded on read. Session ``version`` must be 2
  (missing: "missing session version"; 1: "generated session persistence
  version authority rejected"); input states carry
  ``stored_input_state_version`` 1; lifecycle records ``record_version`` 3
  (no v1/v2 decoders are shipped: those rows belong to the legacy migrator);
  ops snapshots ``ops_snapshot_version`` 1.
* Session ids and input ids must be canonical lower-case hyphenated UUIDs.
  Session metadata keys other than ``transcript_history`` and
  ``compaction_intents`` are kept opaque and round-trip unchanged.
* A ``transcript_history`` must hold at least one commit, and its
  ``revisions`` list each body once, under its own digest. A commit's bodies
  are looked up there, or are the live messages when the revision is the head.
  A malformed history fails the session decode (fail-closed), so
  :meth:`ReferenceDomain.is_placeholder` only ever sees a well-formed history.
* The boundary save guard refuses a previous row with another session id.
  R2 requires the commit lists to be equal (history can be neither erased,
  changed nor seeded). R3 is generalised: the new commits, in order, must
  form a chain where each parent body extends the body before it (starting
  from the previous messages) and the live messages extend the last
  revision body — so appends before and after a rewrite are accepted. R4 also
  requires the previous commits to be a prefix of the incoming ones and the
  live messages to extend the compaction's result body.
* Every guard rejection message names "monotonicity" when the incoming
  transcript is shorter than the previous one, else "continuity".
* Lifecycle records know the states ``idle``, ``stopped`` and ``retired``, the
  supervisor authority ``unbound_no_receipt`` and ``unregister_progress``
  ``null``; anything else is refused until specified.
* Ops snapshots are ``{"ops_snapshot_version": 1, "epoch_id": ..., "payload":
  <JSON value>}`` with a non-empty epoch id.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal, Protocol, TypeAlias, TypeVar

from pydantic import BaseModel, ConfigDict, Field, JsonValue, ValidationError

from agentkeep.columns import canonical_json
from agentkeep.errors import InvalidInput
from agentkeep.runtime.errors import (
    GuardRejected,
    InvalidInputStateBatchCas,
    ReadFailed,
    TranscriptRevisionConflict,
    WriteFailed,
)

__all__ = [
    "LIFECYCLE_RECORD_VERSION",
    "MAX_INPUT_STATE_BATCH_CAS",
    "MAX_U63",
    "OPS_SNAPSHOT_VERSION",
    "SESSION_VERSION",
    "STORED_INPUT_STATE_VERSION",
    "CompactionIntent",
    "DeleteOpsFinalizationAuthority",
    "InputStatePersistenceRecord",
    "MachineLifecycleCommit",
    "MachineLifecycleStoreRecord",
    "Message",
    "OpsSnapshot",
    "PreparedInputStateCas",
    "ProjectionId",
    "ReferenceDomain",
    "RevisionBody",
    "RewriteSelection",
    "RuntimeBinding",
    "RuntimeDomain",
    "RuntimeState",
    "Session",
    "StoredInputState",
    "SupervisorAuthority",
    "TranscriptCommit",
    "TranscriptHistory",
    "UnregisterFinalizationCommit",
    "canonical_uuid",
    "commit_fingerprint",
    "issue_delete_ops_finalization_authority",
    "logical_runtime_id_for_session",
    "prepare_input_state_batch_cas",
    "revision_of",
]

SESSION_VERSION: Final = 2
RETIRED_SESSION_VERSIONS: Final = frozenset({1})
STORED_INPUT_STATE_VERSION: Final = 1
LIFECYCLE_RECORD_VERSION: Final = 3
OPS_SNAPSHOT_VERSION: Final = 1
MAX_INPUT_STATE_BATCH_CAS: Final = 256
MAX_U63: Final = 2**63 - 1

COMPACTION_SELECTION: Final = "compaction_message_range"

_STRICT = ConfigDict(frozen=True, extra="forbid", strict=True)


class _Invalid(Exception):
    """A value did not decode or validate; the caller wraps it in a store error."""


# --------------------------------------------------------------------------
# JSON helpers


def _canonical_bytes(value: Any) -> bytes:
    return canonical_json(value).encode("utf-8")


def _reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _Invalid(f"duplicate JSON key {key!r}")
        out[key] = value
    return out


def _load_object(data: bytes, what: str) -> dict[str, Any]:
    if not isinstance(data, bytes | bytearray | memoryview):
        raise _Invalid(f"{what} must be bytes, got {type(data).__name__}")
    try:
        value = json.loads(bytes(data).decode("utf-8"), object_pairs_hook=_reject_duplicate_keys)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _Invalid(f"{what} is not UTF-8 JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise _Invalid(f"{what} must be a JSON object, got {type(value).__name__}")
    return value


def _validate(model: type[_M], data: bytes, what: str) -> _M:
    try:
        return model.model_validate_json(bytes(data), strict=True)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['msg']}"
            for err in exc.errors()
        )
        raise _Invalid(f"invalid {what}: {problems}") from exc


def _check_version(obj: dict[str, Any], field: str, current: int, what: str) -> None:
    if field not in obj:
        raise _Invalid(f"{what} is missing mandatory {field}")
    got = obj[field]
    if type(got) is not int or got != current:
        raise _Invalid(f"unsupported {what} {field} {got!r}: expected {current}")


def revision_of(messages: Sequence[Message]) -> str:
    """Return ``rev(msgs) = "sha256:" + hex(sha256(canonical_json(msgs)))`` (§3.0).

    Args:
        messages: a message list (a transcript body or a span of one).
    """
    body = [m.model_dump(mode="json") for m in messages]
    return "sha256:" + hashlib.sha256(_canonical_bytes(body)).hexdigest()


def canonical_uuid(text: str, kind: str) -> str:
    """Check that ``text`` is a canonical (lower-case, hyphenated) UUID and return it.

    Raises:
        InvalidInput: ``text`` is not in canonical UUID form.
    """
    try:
        parsed = uuid.UUID(text)
    except (ValueError, AttributeError, TypeError) as exc:
        raise InvalidInput(kind, f"{text!r} is not a UUID") from exc
    if str(parsed) != text:
        raise InvalidInput(kind, f"{text!r} is not a canonical hyphenated lower-case UUID")
    return text


def logical_runtime_id_for_session(session_id: str) -> str:
    """Return the logical runtime id of a session: ``rt:session:{session_id}`` (§3.11)."""
    return f"rt:session:{canonical_uuid(session_id, 'session_id')}"


# --------------------------------------------------------------------------
# Session model (§3.0)

Role: TypeAlias = Literal["system", "user", "assistant", "notice"]


class Message(BaseModel):
    """One transcript message."""

    model_config = _STRICT

    role: Role
    content: str


class RewriteSelection(BaseModel):
    """The span a rewrite replaced: ``messages[start:end]`` of the parent body."""

    model_config = _STRICT

    type: Literal["message_range", "compaction_message_range"]
    start: int = Field(ge=0, le=MAX_U63)
    end: int = Field(ge=0, le=MAX_U63)


class TranscriptCommit(BaseModel):
    """A transcript-rewrite commit: parent body → body with one span replaced."""

    model_config = _STRICT

    parent_revision: str
    revision: str
    selection: RewriteSelection
    messages_before: int = Field(ge=0, le=MAX_U63)
    messages_after: int = Field(ge=0, le=MAX_U63)
    original_span_digest: str
    replacement_digest: str
    actor: str


class RevisionBody(BaseModel):
    """A recorded transcript body and its revision."""

    model_config = _STRICT

    revision: str
    messages: tuple[Message, ...]


class TranscriptHistory(BaseModel):
    """The retained rewrite history: head revision, commits, recorded bodies."""

    model_config = _STRICT

    head: str
    commits: tuple[TranscriptCommit, ...]
    revisions: tuple[RevisionBody, ...]


class ProjectionId(BaseModel):
    """The identity of a compaction projection; with the runtime id, the outbox key."""

    model_config = _STRICT

    session_id: str
    parent_revision: str
    revision: str
    commit_fingerprint: str


class CompactionIntent(BaseModel):
    """A compaction-projection intent carried in session metadata and the outbox (§3.4)."""

    model_config = _STRICT

    projection: ProjectionId
    summary_tokens: int = Field(ge=0, le=MAX_U63)
    messages_before: int = Field(ge=0, le=MAX_U63)
    messages_after: int = Field(ge=0, le=MAX_U63)

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
    """Return the commit's fingerprint (§3.4), excluding its revisions.

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
    return "sha256:" + hashlib.sha256(_canonical_bytes(body)).hexdigest()


class _SessionMetadataWire(BaseModel):
    model_config = ConfigDict(frozen=True, extra="allow", strict=True)

    transcript_history: TranscriptHistory | None = None
    compaction_intents: tuple[CompactionIntent, ...] = ()


class _SessionWire(BaseModel):
    model_config = _STRICT

    version: int
    id: str
    messages: tuple[Message, ...]
    metadata: _SessionMetadataWire


class Session(BaseModel):
    """A decoded reference session (§3.0).

    Attributes:
        id: the session id (canonical UUID).
        messages: the live transcript.
        history: the retained rewrite history, if any.
        compaction_intents: intents in metadata order (validated only by the guard).
        extra_metadata: other metadata keys, kept opaque.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str
    messages: tuple[Message, ...] = ()
    history: TranscriptHistory | None = None
    compaction_intents: tuple[CompactionIntent, ...] = ()
    extra_metadata: dict[str, JsonValue] = Field(default_factory=dict)

    @classmethod
    def new(cls, session_id: str | None = None) -> Session:
        """Return an empty session with ``session_id`` (a fresh UUID4 by default)."""
        sid = str(uuid.uuid4()) if session_id is None else canonical_uuid(session_id, "session_id")
        return cls(id=sid)

    @property
    def revision(self) -> str:
        """The head revision: the history's head, else the digest of the live messages."""
        return self.history.head if self.history is not None else revision_of(self.messages)

    @property
    def commits(self) -> tuple[TranscriptCommit, ...]:
        """The history's commits (empty without history)."""
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
            InvalidInput: the span is out of bounds.
        """
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


def _decode_session(data: bytes) -> Session:
    obj = _load_object(data, "session")
    if "version" not in obj:
        raise _Invalid("missing session version (unversioned v0 session rows are not read)")
    version = obj["version"]
    if type(version) is int and version in RETIRED_SESSION_VERSIONS:
        raise _Invalid(
            f"generated session persistence version authority rejected version {version}"
        )
    if type(version) is not int or version != SESSION_VERSION:
        raise _Invalid(f"unsupported session version {version!r}: expected {SESSION_VERSION}")
    wire = _validate(_SessionWire, data, "session")
    try:
        canonical_uuid(wire.id, "session_id")
    except InvalidInput as exc:
        raise _Invalid(str(exc)) from exc
    meta = wire.metadata
    history = meta.transcript_history
    if history is not None:
        if not history.commits:
            raise _Invalid("transcript_history has no commits")
        seen: set[str] = set()
        for entry in history.revisions:
            if entry.revision in seen:
                raise _Invalid(f"transcript_history records revision {entry.revision} twice")
            seen.add(entry.revision)
            if revision_of(entry.messages) != entry.revision:
                raise _Invalid(f"transcript_history body of {entry.revision} has another digest")
    extra = dict(meta.model_extra or {})
    return Session(
        id=wire.id,
        messages=wire.messages,
        history=history,
        compaction_intents=meta.compaction_intents,
        extra_metadata=extra,
    )


# --------------------------------------------------------------------------
# Guards (§3.1–§3.3)


def _commit_problem(session: Session, commit: TranscriptCommit) -> str | None:
    """Say why ``commit``'s recorded bodies do not validate, or None."""
    parent = session.body(commit.parent_revision)
    child = session.body(commit.revision)
    if parent is None:
        return f"commit {commit.revision}: parent body {commit.parent_revision} is not recorded"
    if child is None:
        return f"commit {commit.revision}: its body is not recorded"
    if revision_of(parent) != commit.parent_revision or revision_of(child) != commit.revision:
        return f"commit {commit.revision}: a body does not match its revision"
    sel = commit.selection
    if not sel.start <= sel.end <= len(parent):
        return f"commit {commit.revision}: span {sel.start}..{sel.end} outside 0..{len(parent)}"
    if commit.messages_before != len(parent) or commit.messages_after != len(child):
        return f"commit {commit.revision}: message counts do not match its bodies"
    kept_tail = len(parent) - sel.end
    if len(child) < sel.start + kept_tail:
        return f"commit {commit.revision}: body is shorter than the kept prefix and suffix"
    if child[: sel.start] != parent[: sel.start]:
        return f"commit {commit.revision}: prefix before the span changed"
    if child[len(child) - kept_tail :] != parent[sel.end :]:
        return f"commit {commit.revision}: suffix after the span changed"
    if revision_of(parent[sel.start : sel.end]) != commit.original_span_digest:
        return f"commit {commit.revision}: original span digest does not match"
    replacement = child[sel.start : len(child) - kept_tail]
    if revision_of(replacement) != commit.replacement_digest:
        return f"commit {commit.revision}: replacement digest does not match"
    return None


def _coherence_problem(session: Session) -> str | None:
    if session.history is None:
        return None
    live = revision_of(session.messages)
    if session.history.head != live:
        return f"history head {session.history.head} is not the live revision {live}"
    for commit in session.history.commits:
        problem = _commit_problem(session, commit)
        if problem is not None:
            return problem
    return None


def _extends(longer: Sequence[Message], prefix: Sequence[Message]) -> bool:
    return len(longer) >= len(prefix) and tuple(longer[: len(prefix)]) == tuple(prefix)


def _r3_rewrite_chain(incoming: Session, previous: Session) -> bool:
    new = incoming.commits[len(previous.commits) :]
    if not new:
        return False
    body: Sequence[Message] = previous.messages
    for commit in new:
        parent = incoming.body(commit.parent_revision)
        if parent is None or not _extends(parent, body):
            return False
        child = incoming.body(commit.revision)
        if child is None:
            return False
        body = child
    return _extends(incoming.messages, body)


def _r4_compaction_before_tail(incoming: Session, previous: Session) -> bool:
    if not incoming.commits:
        return False
    last = incoming.commits[-1]
    if last in previous.commits or last.selection.type != COMPACTION_SELECTION:
        return False
    parent = incoming.body(last.parent_revision)
    child = incoming.body(last.revision)
    if parent is None or child is None or not _extends(incoming.messages, child):
        return False
    tail = previous.messages
    if tail and tail[0].role == "system":
        tail = tail[1:]
    end = last.selection.end
    return tuple(parent[end : end + len(tail)]) == tuple(tail)


def _guard_reject(incoming: Session, previous: Session | None, detail: str) -> GuardRejected:
    shorter = previous is not None and len(incoming.messages) < len(previous.messages)
    return GuardRejected("monotonicity" if shorter else "continuity", detail)


# --------------------------------------------------------------------------
# Input states (§3.10) and batch CAS (§3.6)


class StoredInputState(BaseModel):
    """The persisted lifecycle state of one input (``runtime_input_states.state_json``).

    Attributes:
        stored_input_state_version: always :data:`STORED_INPUT_STATE_VERSION`.
        input_id: the input (canonical UUID).
        current_state: the lifecycle state (``"accepted"``, ``"consumed"``, ...).
        recovery_count: how many times the input was recovered.
        terminal_outcome: the terminal outcome, once terminal.
        details: further machine data, kept opaque.
    """

    model_config = _STRICT

    stored_input_state_version: Literal[1] = STORED_INPUT_STATE_VERSION
    input_id: str
    current_state: str = Field(min_length=1)
    recovery_count: int = Field(default=0, ge=0, le=MAX_U63)
    terminal_outcome: JsonValue = None
    details: dict[str, JsonValue] = Field(default_factory=dict)

    @classmethod
    def new_accepted(cls, input_id: str | None = None) -> StoredInputState:
        """Return an accepted state with ``recovery_count = 0`` (a fresh UUID4 by default)."""
        iid = str(uuid.uuid4()) if input_id is None else canonical_uuid(input_id, "input_id")
        return cls(input_id=iid, current_state="accepted")

    def with_recovery_count(self, n: int) -> StoredInputState:
        """Return a copy with ``recovery_count = n``."""
        return type(self).model_validate({**self.model_dump(), "recovery_count": n})


class InputStatePersistenceRecord(BaseModel):
    """A machine-authorized input state, the only form the store writes (§3.10)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    state: StoredInputState

    @classmethod
    def from_machine_snapshot(cls, state: StoredInputState) -> InputStatePersistenceRecord:
        """Authorize ``state`` for persistence after checking its input id.

        Raises:
            InvalidInput: the input id is not a canonical UUID.
        """
        canonical_uuid(state.input_id, "input_id")
        return cls(state=state)

    def into_stored(self) -> StoredInputState:
        """Return the wrapped state."""
        return self.state


@dataclass(frozen=True, slots=True)
class PreparedInputStateCas:
    """One row of a prepared batch CAS: compare ``expected_json``, write ``replacement_json``."""

    input_id: str
    expected_json: bytes
    replacement_json: bytes


def _encode_input_state(state: StoredInputState) -> bytes:
    try:
        return _canonical_bytes(state.model_dump(mode="json"))
    except ValueError as exc:
        raise WriteFailed(f"failed to encode input state {state.input_id}: {exc}") from exc


def prepare_input_state_batch_cas(
    expected: Sequence[StoredInputState],
    replacements: Sequence[InputStatePersistenceRecord | StoredInputState],
) -> tuple[PreparedInputStateCas, ...]:
    """Validate a batch CAS and encode both sides, in the order of ``expected`` (§3.6).

    An empty result means "Swapped" without touching the database.

    Raises:
        InvalidInputStateBatchCas: the counts differ, exceed
            :data:`MAX_INPUT_STATE_BATCH_CAS`, an id repeats on either side, or
            the two id sets differ.
        WriteFailed: a state does not encode.
    """
    repl = [
        r.into_stored() if isinstance(r, InputStatePersistenceRecord) else r for r in replacements
    ]
    if len(expected) != len(repl):
        raise InvalidInputStateBatchCas(
            f"{len(expected)} expected rows but {len(repl)} replacements"
        )
    if len(expected) > MAX_INPUT_STATE_BATCH_CAS:
        raise InvalidInputStateBatchCas(
            f"{len(expected)} rows exceed the maximum of {MAX_INPUT_STATE_BATCH_CAS}"
        )
    by_expected: dict[str, StoredInputState] = {}
    for state in expected:
        if state.input_id in by_expected:
            raise InvalidInputStateBatchCas(f"input {state.input_id} repeats in expected")
        by_expected[state.input_id] = state
    by_replacement: dict[str, StoredInputState] = {}
    for state in repl:
        if state.input_id in by_replacement:
            raise InvalidInputStateBatchCas(f"input {state.input_id} repeats in replacements")
        by_replacement[state.input_id] = state
    for input_id in by_expected:
        if input_id not in by_replacement:
            raise InvalidInputStateBatchCas(f"expected input {input_id} has no replacement")
    for input_id in by_replacement:  # unreachable after the checks above; kept as a guard
        if input_id not in by_expected:
            raise InvalidInputStateBatchCas(f"replacement input {input_id} was not expected")
    return tuple(
        PreparedInputStateCas(
            input_id=state.input_id,
            expected_json=_encode_input_state(state),
            replacement_json=_encode_input_state(by_replacement[state.input_id]),
        )
        for state in expected
    )


# --------------------------------------------------------------------------
# Machine lifecycle (§3.7), ops snapshot (§3.8), unregister finalization (§3.9)

RuntimeState: TypeAlias = Literal["idle", "stopped", "retired"]


class RuntimeBinding(BaseModel):
    """Binding facts of a runtime; every key is required, each may be null."""

    model_config = _STRICT

    agent_runtime_id: str | None
    fence_token: int | None = Field(ge=0, le=MAX_U63)
    runtime_generation: int | None = Field(ge=0, le=MAX_U63)
    runtime_epoch_id: str | None

    @classmethod
    def unbound(cls) -> RuntimeBinding:
        """Return the default binding: every fact null."""
        return cls(
            agent_runtime_id=None, fence_token=None, runtime_generation=None, runtime_epoch_id=None
        )


class SupervisorAuthority(BaseModel):
    """Tagged supervisor authority; only ``unbound_no_receipt`` is specified."""

    model_config = _STRICT

    kind: Literal["unbound_no_receipt"] = "unbound_no_receipt"


class MachineLifecycleCommit(BaseModel):
    """A lifecycle commit (= snapshot): runtime state, binding facts, supervisor authority."""

    model_config = _STRICT

    runtime_state: RuntimeState
    binding: RuntimeBinding = Field(default_factory=RuntimeBinding.unbound)
    supervisor_authority: SupervisorAuthority = Field(default_factory=SupervisorAuthority)


class MachineLifecycleStoreRecord(BaseModel):
    """The versioned ``runtime_states`` record (v3)."""

    model_config = _STRICT

    record_version: Literal[3]
    runtime_state: RuntimeState
    binding: RuntimeBinding
    supervisor_authority: SupervisorAuthority
    unregister_progress: None

    @classmethod
    def from_snapshot(cls, snapshot: MachineLifecycleCommit) -> MachineLifecycleStoreRecord:
        """Return the current-version record of ``snapshot``."""
        return cls(
            record_version=LIFECYCLE_RECORD_VERSION,
            runtime_state=snapshot.runtime_state,
            binding=snapshot.binding,
            supervisor_authority=snapshot.supervisor_authority,
            unregister_progress=None,
        )

    def to_snapshot(self) -> MachineLifecycleCommit:
        """Return the lifecycle snapshot the record holds."""
        return MachineLifecycleCommit(
            runtime_state=self.runtime_state,
            binding=self.binding,
            supervisor_authority=self.supervisor_authority,
        )


class OpsSnapshot(BaseModel):
    """A persisted async-operations lifecycle snapshot, owned by one epoch."""

    model_config = _STRICT

    ops_snapshot_version: Literal[1] = OPS_SNAPSHOT_VERSION
    epoch_id: str = Field(min_length=1)
    payload: JsonValue = None


class DeleteOpsFinalizationAuthority:
    """Capability token of an unregister finalization; the store never inspects it.

    Only :func:`issue_delete_ops_finalization_authority` (for the lifecycle
    machine) constructs it.
    """

    __slots__ = ()

    def __init__(self, _key: object) -> None:
        if _key is not _AUTHORITY_KEY:
            raise TypeError("DeleteOpsFinalizationAuthority is issued by the lifecycle machine")

    def __repr__(self) -> str:
        return "DeleteOpsFinalizationAuthority()"


_AUTHORITY_KEY: Final = object()


def issue_delete_ops_finalization_authority() -> DeleteOpsFinalizationAuthority:
    """Issue the capability token (reserved to the lifecycle machine)."""
    return DeleteOpsFinalizationAuthority(_AUTHORITY_KEY)


@dataclass(frozen=True, slots=True)
class UnregisterFinalizationCommit:
    """What ``commit_unregister_finalization`` writes atomically (§3.9).

    Attributes:
        lifecycle: the final lifecycle snapshot.
        input_states: the final input states (distinct input ids).
        retired_ops_epoch: the ops epoch to retire (its row is deleted if current).
        authority: the capability token.
    """

    lifecycle: MachineLifecycleCommit
    input_states: tuple[InputStatePersistenceRecord, ...]
    retired_ops_epoch: str
    authority: DeleteOpsFinalizationAuthority

    def __post_init__(self) -> None:
        if not isinstance(self.authority, DeleteOpsFinalizationAuthority):
            raise InvalidInput("authority", "a DeleteOpsFinalizationAuthority is required")
        if not self.retired_ops_epoch:
            raise InvalidInput("retired_ops_epoch", "must not be empty")
        ids = [r.state.input_id for r in self.input_states]
        if len(set(ids)) != len(ids):
            raise InvalidInput("input_states", "an input id repeats")


# --------------------------------------------------------------------------
# Protocol and reference implementation

SessionT = TypeVar("SessionT")
_M = TypeVar("_M", bound=BaseModel)


class RuntimeDomain(Protocol[SessionT]):
    """The domain operations the runtime store calls (§3.0).

    The store passes bytes in and gets typed values, verdicts or bytes back;
    its transactions and fences depend on nothing else.
    """

    def decode_incoming_session(self, data: bytes) -> SessionT:
        """Decode a caller-supplied snapshot. Raises WriteFailed."""
        ...

    def decode_persisted_session(self, data: bytes) -> SessionT:
        """Decode a stored snapshot, fail-closed. Raises ReadFailed."""
        ...

    def encode_session(self, session: SessionT) -> bytes:
        """Encode canonically. Raises WriteFailed."""
        ...

    def session_id(self, session: SessionT) -> str:
        """Return the session's id."""
        ...

    def boundary_save_guard(self, incoming: SessionT, previous: SessionT | None) -> None:
        """Accept ``incoming`` as the successor of ``previous`` or raise GuardRejected."""
        ...

    def head_coherence_guard(self, incoming: SessionT) -> None:
        """Check the live transcript matches the history head or raise GuardRejected."""
        ...

    def rewrite_save_guard(
        self, incoming: SessionT, previous: SessionT | None, commit: TranscriptCommit
    ) -> None:
        """Raise TranscriptRevisionConflict or GuardRejected unless the rewrite is valid."""
        ...

    def is_placeholder(self, session: SessionT) -> bool:
        """True for a session without history and at most one System message."""
        ...

    def validated_compaction_intents(self, session: SessionT) -> tuple[CompactionIntent, ...]:
        """Return the session's intents after validation. Raises WriteFailed."""
        ...

    def complete_compaction_intent(self, session: SessionT, projection: ProjectionId) -> SessionT:
        """Remove the intent of ``projection`` (no-op if absent)."""
        ...

    def encode_compaction_intent(self, intent: CompactionIntent) -> bytes:
        """Encode an intent canonically for the outbox."""
        ...

    def decode_compaction_intent(self, data: bytes) -> CompactionIntent:
        """Decode a stored outbox intent. Raises ReadFailed."""
        ...

    def encode_input_state(self, state: StoredInputState) -> bytes:
        """Encode canonically. Raises WriteFailed."""
        ...

    def decode_input_state(self, data: bytes) -> StoredInputState:
        """Decode a stored input state. Raises ReadFailed."""
        ...

    def prepare_input_state_batch_cas(
        self,
        expected: Sequence[StoredInputState],
        replacements: Sequence[InputStatePersistenceRecord | StoredInputState],
    ) -> tuple[PreparedInputStateCas, ...]:
        """Validate and encode a batch CAS. Raises InvalidInputStateBatchCas."""
        ...

    def encode_lifecycle(self, snapshot: MachineLifecycleCommit) -> bytes:
        """Encode the current lifecycle record of ``snapshot``."""
        ...

    def decode_lifecycle(self, data: bytes) -> MachineLifecycleCommit:
        """Decode a stored lifecycle record strictly. Raises ReadFailed."""
        ...

    def encode_ops(self, snapshot: OpsSnapshot) -> bytes:
        """Encode an ops snapshot canonically. Raises WriteFailed."""
        ...

    def decode_ops(self, data: bytes) -> OpsSnapshot:
        """Decode a stored ops snapshot strictly. Raises ReadFailed."""
        ...

    def ops_epoch_of(self, data: bytes) -> str:
        """Return the epoch id of stored ops bytes. Raises ReadFailed."""
        ...


class ReferenceDomain:
    """The shipped :class:`RuntimeDomain` for :class:`Session` (rules §3.1–§3.11)."""

    # -- session codec -----------------------------------------------------

    def decode_incoming_session(self, data: bytes) -> Session:
        """Decode a caller-supplied snapshot.

        Raises:
            WriteFailed: the bytes are not a current reference session.
        """
        try:
            return _decode_session(data)
        except _Invalid as exc:
            raise WriteFailed(f"failed to decode incoming session snapshot: {exc}") from exc

    def decode_persisted_session(self, data: bytes) -> Session:
        """Decode a stored snapshot; never defaults or upgrades.

        Raises:
            ReadFailed: the row is not a current reference session.
        """
        try:
            return _decode_session(data)
        except _Invalid as exc:
            raise ReadFailed(f"failed to decode persisted session snapshot: {exc}") from exc

    def encode_session(self, session: Session) -> bytes:
        """Encode canonically.

        Raises:
            WriteFailed: opaque metadata is not a JSON value.
        """
        try:
            return _canonical_bytes(session.to_json())
        except ValueError as exc:
            raise WriteFailed(f"failed to encode session {session.id}: {exc}") from exc

    def session_id(self, session: Session) -> str:
        """Return the session's id."""
        return session.id

    # -- guards ------------------------------------------------------------

    def boundary_save_guard(self, incoming: Session, previous: Session | None) -> None:
        """Accept ``incoming`` iff coherent and one of R1–R4 holds (§3.1).

        Raises:
            GuardRejected: with rule ``monotonicity`` if ``incoming`` is
                shorter than ``previous``, else ``continuity``.
        """
        problem = _coherence_problem(incoming)
        if problem is not None:
            raise _guard_reject(incoming, previous, f"incoherent history: {problem}")
        if previous is None:
            return  # R1: plain first save, or adoption of a coherent history
        if previous.id != incoming.id:
            raise _guard_reject(
                incoming, previous, f"session {incoming.id} cannot replace session {previous.id}"
            )
        if _extends(incoming.messages, previous.messages) and incoming.commits == previous.commits:
            return  # R2: append
        if incoming.commits[: len(previous.commits)] != previous.commits:
            raise _guard_reject(
                incoming, previous, f"session {incoming.id} erases or changes rewrite history"
            )
        if _r3_rewrite_chain(incoming, previous):
            return
        if _r4_compaction_before_tail(incoming, previous):
            return
        raise _guard_reject(
            incoming,
            previous,
            f"session {incoming.id} ({len(incoming.messages)} messages) does not continue "
            f"the persisted transcript ({len(previous.messages)} messages)",
        )

    def head_coherence_guard(self, incoming: Session) -> None:
        """Check ``head == rev(messages)`` when a history exists (§3.2).

        Raises:
            GuardRejected: rule ``coherence``.
        """
        if incoming.history is not None:
            live = revision_of(incoming.messages)
            if incoming.history.head != live:
                raise GuardRejected(
                    "coherence",
                    f"history head {incoming.history.head} is not the live revision {live}",
                )

    def rewrite_save_guard(
        self, incoming: Session, previous: Session | None, commit: TranscriptCommit
    ) -> None:
        """Check a transcript rewrite against the persisted session (§3.3, in order).

        Raises:
            TranscriptRevisionConflict: ``commit``'s parent is not the persisted revision.
            GuardRejected: any other rejection (rule ``rewrite``).
        """
        for c in incoming.commits:
            problem = _commit_problem(incoming, c)
            if problem is not None:
                raise GuardRejected("rewrite", f"incoming history does not validate: {problem}")
        if previous is None:
            raise GuardRejected("rewrite", "rewrite target has no previously persisted session")
        if previous.id != incoming.id:
            raise GuardRejected(
                "rewrite", f"rewrite of session {incoming.id} targets session {previous.id}"
            )
        if previous.revision != commit.parent_revision:
            raise TranscriptRevisionConflict(commit.parent_revision, previous.revision)
        if revision_of(previous.messages) != commit.parent_revision:
            raise GuardRejected("rewrite", "persisted transcript does not match its revision")
        live = revision_of(incoming.messages)
        if not incoming.revision == live == commit.revision:
            raise GuardRejected(
                "rewrite", f"incoming revision {incoming.revision} is not the commit's revision"
            )
        if incoming.commits[: len(previous.commits)] != previous.commits:
            raise GuardRejected("rewrite", "incoming history does not retain persisted commits")
        if commit not in incoming.commits[len(previous.commits) :]:
            raise GuardRejected("rewrite", "incoming history does not contain the commit")
        problem = _commit_problem(incoming, commit)
        if problem is not None:
            raise GuardRejected("rewrite", problem)

    def is_placeholder(self, session: Session) -> bool:
        """True iff no history and the messages are empty or exactly one System message."""
        if session.history is not None:
            return False
        return not session.messages or (
            len(session.messages) == 1 and session.messages[0].role == "system"
        )

    # -- compaction intents ------------------------------------------------

    def validated_compaction_intents(self, session: Session) -> tuple[CompactionIntent, ...]:
        """Validate the session's intents (§3.4 (a)–(e)) and return them in order.

        Raises:
            WriteFailed: an intent is foreign, unbacked, has wrong counts, or a key repeats.
        """
        seen: set[ProjectionId] = set()
        for intent in session.compaction_intents:
            pid = intent.projection
            if pid.session_id != session.id:
                raise WriteFailed(
                    f"compaction intent {pid.revision} belongs to session {pid.session_id}, "
                    f"not {session.id}"
                )
            backing = [
                c
                for c in session.commits
                if c.selection.type == COMPACTION_SELECTION
                and c.parent_revision == pid.parent_revision
                and c.revision == pid.revision
                and commit_fingerprint(c) == pid.commit_fingerprint
            ]
            if not backing:
                raise WriteFailed(
                    f"compaction intent {pid.revision} is not backed by a compaction commit"
                )
            if not any(
                c.messages_before == intent.messages_before
                and c.messages_after == intent.messages_after
                for c in backing
            ):
                raise WriteFailed(
                    f"compaction intent {pid.revision} message counts do not match its commit"
                )
            if pid in seen:
                raise WriteFailed(f"duplicate compaction intent for rewrite {pid.revision}")
            seen.add(pid)
        return session.compaction_intents

    def complete_compaction_intent(self, session: Session, projection: ProjectionId) -> Session:
        """Remove the intent of ``projection``; a no-op if absent (§3.5)."""
        kept = tuple(i for i in session.compaction_intents if i.projection != projection)
        if len(kept) == len(session.compaction_intents):
            return session
        return session.with_compaction_intents(kept)

    def encode_compaction_intent(self, intent: CompactionIntent) -> bytes:
        """Encode an intent canonically."""
        return _canonical_bytes(intent.model_dump(mode="json"))

    def decode_compaction_intent(self, data: bytes) -> CompactionIntent:
        """Decode a stored intent strictly.

        Raises:
            ReadFailed: the bytes are not an intent.
        """
        try:
            _load_object(data, "compaction intent")
            return _validate(CompactionIntent, data, "compaction intent")
        except _Invalid as exc:
            raise ReadFailed(f"failed to decode compaction outbox intent: {exc}") from exc

    # -- input states ------------------------------------------------------

    def encode_input_state(self, state: StoredInputState) -> bytes:
        """Encode canonically.

        Raises:
            WriteFailed: a value is not storable JSON.
        """
        return _encode_input_state(state)

    def decode_input_state(self, data: bytes) -> StoredInputState:
        """Decode a stored input state; the message names a missing version field.

        Raises:
            ReadFailed: the row is not a current input state.
        """
        try:
            obj = _load_object(data, "input state")
            _check_version(
                obj, "stored_input_state_version", STORED_INPUT_STATE_VERSION, "input state"
            )
            state = _validate(StoredInputState, data, "input state")
            canonical_uuid(state.input_id, "input_id")
            return state
        except (_Invalid, InvalidInput) as exc:
            raise ReadFailed(f"failed to decode persisted input state: {exc}") from exc

    def prepare_input_state_batch_cas(
        self,
        expected: Sequence[StoredInputState],
        replacements: Sequence[InputStatePersistenceRecord | StoredInputState],
    ) -> tuple[PreparedInputStateCas, ...]:
        """See :func:`prepare_input_state_batch_cas`."""
        return prepare_input_state_batch_cas(expected, replacements)

    # -- lifecycle and ops -------------------------------------------------

    def encode_lifecycle(self, snapshot: MachineLifecycleCommit) -> bytes:
        """Encode the v3 record of ``snapshot``."""
        record = MachineLifecycleStoreRecord.from_snapshot(snapshot)
        return _canonical_bytes(record.model_dump(mode="json"))

    def decode_lifecycle(self, data: bytes) -> MachineLifecycleCommit:
        """Decode a v3 record strictly (legacy bare strings and unversioned objects refused).

        Raises:
            ReadFailed: the row is not a current lifecycle record.
        """
        try:
            obj = _load_object(data, "machine lifecycle record")
            _check_version(
                obj, "record_version", LIFECYCLE_RECORD_VERSION, "machine lifecycle record"
            )
            record = _validate(MachineLifecycleStoreRecord, data, "machine lifecycle record")
        except _Invalid as exc:
            raise ReadFailed(f"failed to decode machine lifecycle record: {exc}") from exc
        return record.to_snapshot()

    def encode_ops(self, snapshot: OpsSnapshot) -> bytes:
        """Encode canonically.

        Raises:
            WriteFailed: the payload is not storable JSON.
        """
        try:
            return _canonical_bytes(snapshot.model_dump(mode="json"))
        except ValueError as exc:
            raise WriteFailed(f"failed to encode ops snapshot {snapshot.epoch_id}: {exc}") from exc

    def decode_ops(self, data: bytes) -> OpsSnapshot:
        """Decode strictly.

        Raises:
            ReadFailed: the row is not a current ops snapshot.
        """
        try:
            obj = _load_object(data, "ops snapshot")
            _check_version(obj, "ops_snapshot_version", OPS_SNAPSHOT_VERSION, "ops snapshot")
            return _validate(OpsSnapshot, data, "ops snapshot")
        except _Invalid as exc:
            raise ReadFailed(f"failed to decode ops lifecycle snapshot: {exc}") from exc

    def ops_epoch_of(self, data: bytes) -> str:
        """Return the epoch id of stored ops bytes (strict decode).

        Raises:
            ReadFailed: the row is not a current ops snapshot.
        """
        return self.decode_ops(data).epoch_id
