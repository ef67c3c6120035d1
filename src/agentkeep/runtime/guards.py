"""Save guards of the reference domain: boundary, head coherence, rewrite, placeholder, intents.

The boundary save guard (rules R1–R4), head coherence, the transcript-rewrite
guard (docs/runtime.md#save-guards), the placeholder check
(docs/runtime.md#placeholder-sessions) and compaction-intent validation
(docs/runtime.md#compaction-intents), for
:class:`~agentkeep.runtime.session_model.Session`.
:class:`~agentkeep.runtime.domain.ReferenceDomain` delegates to these
functions. They are pure (no database access); the locks and fences are the
store's.

Choices where the original store was open
(docs/decisions.md#boundary-guard-rules,
docs/decisions.md#strict-decoding-and-malformed-histories):

* The boundary save guard refuses a previous row with another session id.
  R2 requires the commit lists to be equal (history can be neither erased,
  changed nor seeded). R3 is generalised: the new commits, in order, must
  form a chain where each parent body extends the body before it (starting
  from the previous messages) and the live messages extend the last
  revision body — so appends before and after a rewrite are accepted. R4 also
  requires the previous commits to be a prefix of the incoming ones and the
  live messages to extend the compaction's result body.
* Every boundary-guard rejection names "monotonicity" when the incoming
  transcript is shorter than the previous one, else "continuity".
* A malformed history (:attr:`Session.malformed_history`) is absent for
  :func:`is_placeholder` (placeholder iff the messages are empty or exactly one
  System message), and refused everywhere else: as incoherent when incoming
  (boundary and head-coherence guards), as breaking continuity when previous
  (the store's placeholder exception then decides), by the rewrite guard on
  either side (rule ``rewrite``), and it backs no compaction intent.
"""

from __future__ import annotations

from collections.abc import Sequence

from agentkeep.runtime.errors import GuardRejected, TranscriptRevisionConflict, WriteFailed
from agentkeep.runtime.session_model import (
    COMPACTION_SELECTION,
    CompactionIntent,
    Message,
    ProjectionId,
    Session,
    TranscriptCommit,
    commit_fingerprint,
    revision_of,
)

__all__ = [
    "boundary_save_guard",
    "coherence_problem",
    "commit_problem",
    "head_coherence_guard",
    "is_placeholder",
    "rewrite_save_guard",
    "validated_compaction_intents",
]


def commit_problem(session: Session, commit: TranscriptCommit) -> str | None:
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


def _malformed(session: Session) -> str | None:
    problem = session.history_problem
    return None if problem is None else f"transcript_history is malformed: {problem}"


def coherence_problem(session: Session) -> str | None:
    """Say why the session's history is malformed or does not match its messages, or None."""
    malformed = _malformed(session)
    if malformed is not None:
        return malformed
    if session.history is None:
        return None
    live = revision_of(session.messages)
    if session.history.head != live:
        return f"history head {session.history.head} is not the live revision {live}"
    for commit in session.history.commits:
        problem = commit_problem(session, commit)
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


def boundary_save_guard(incoming: Session, previous: Session | None) -> None:
    """Accept ``incoming`` iff coherent and one of R1–R4 holds (docs/runtime.md#save-guards).

    Raises:
        GuardRejected: with rule ``monotonicity`` if ``incoming`` is shorter
            than ``previous``, else ``continuity``.
    """
    problem = coherence_problem(incoming)
    if problem is not None:
        raise _guard_reject(incoming, previous, f"incoherent history: {problem}")
    if previous is None:
        return  # R1: plain first save, or adoption of a coherent history
    if previous.id != incoming.id:
        raise _guard_reject(
            incoming, previous, f"session {incoming.id} cannot replace session {previous.id}"
        )
    malformed = _malformed(previous)
    if malformed is not None:
        raise _guard_reject(
            incoming,
            previous,
            f"persisted session {previous.id}: {malformed}; cannot establish continuity",
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


def head_coherence_guard(incoming: Session) -> None:
    """Check the history is well-formed and ``head == rev(messages)``.

    The head coherence guard of docs/runtime.md#save-guards.

    Raises:
        GuardRejected: rule ``coherence``.
    """
    malformed = _malformed(incoming)
    if malformed is not None:
        raise GuardRejected("coherence", malformed)
    if incoming.history is not None:
        live = revision_of(incoming.messages)
        if incoming.history.head != live:
            raise GuardRejected(
                "coherence",
                f"history head {incoming.history.head} is not the live revision {live}",
            )


def rewrite_save_guard(
    incoming: Session, previous: Session | None, commit: TranscriptCommit
) -> None:
    """Check a transcript rewrite against the persisted session, in order.

    The rewrite guard of docs/runtime.md#save-guards.

    Raises:
        TranscriptRevisionConflict: ``commit``'s parent is not the persisted revision.
        GuardRejected: any other rejection (rule ``rewrite``).
    """
    malformed = _malformed(incoming)
    if malformed is not None:
        raise GuardRejected("rewrite", f"incoming {malformed}")
    for c in incoming.commits:
        problem = commit_problem(incoming, c)
        if problem is not None:
            raise GuardRejected("rewrite", f"incoming history does not validate: {problem}")
    if previous is None:
        raise GuardRejected("rewrite", "rewrite target has no previously persisted session")
    if previous.id != incoming.id:
        raise GuardRejected(
            "rewrite", f"rewrite of session {incoming.id} targets session {previous.id}"
        )
    malformed = _malformed(previous)
    if malformed is not None:
        raise GuardRejected("rewrite", f"persisted {malformed}")
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
    problem = commit_problem(incoming, commit)
    if problem is not None:
        raise GuardRejected("rewrite", problem)


def is_placeholder(session: Session) -> bool:
    """True iff no history and the messages are empty or exactly one System message.

    A malformed history counts as absent (docs/runtime.md#placeholder-sessions).
    """
    if session.history is not None:
        return False
    return not session.messages or (
        len(session.messages) == 1 and session.messages[0].role == "system"
    )


def validated_compaction_intents(session: Session) -> tuple[CompactionIntent, ...]:
    """Validate the session's intents and return them in order.

    The checks of docs/runtime.md#compaction-intents.

    Raises:
        WriteFailed: an intent is foreign, unbacked (a malformed history backs
            nothing), has wrong counts, or a key repeats.
    """
    seen: set[ProjectionId] = set()
    for intent in session.compaction_intents:
        pid = intent.projection
        if pid.session_id != session.id:
            raise WriteFailed(
                f"compaction intent {pid.revision} belongs to session {pid.session_id}, "
                f"not {session.id}"
            )
        malformed = _malformed(session)
        if malformed is not None:
            raise WriteFailed(f"compaction intent {pid.revision} is not backed: {malformed}")
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
