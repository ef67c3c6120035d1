"""Non-boundary session-snapshot writes and reads (docs/runtime.md#session-snapshots).

:class:`SnapshotOps` is the repository part ``uow.runtime.snapshots``. The
snapshot row is the runtime's authoritative session (its head). Every
writer here takes the ``runtime:<id>`` write lock first, holds the incoming
snapshot to outbox authority (it may carry only identical *pending* outbox
intents, :func:`~agentkeep.runtime.outbox.ensure_intents_already_outboxed`),
and writes through the one upsert that also clears quarantine
(:mod:`~agentkeep.runtime.snapshot_rows`).

Fences and outcomes:

* :meth:`SnapshotOps.commit_session_snapshot` — the boundary save guard
  against the stored head; a stale or divergent snapshot is
  ``WriteFailed`` (no placeholder exception, no supersession verdict here:
  those belong to boundary commits). Identical bytes take a fast path that
  does not rewrite the row (it only clears quarantine).
* :meth:`SnapshotOps.commit_session_transcript_rewrite_snapshot` — the rewrite
  guard: a rewrite whose parent is not the stored revision is
  :class:`~agentkeep.runtime.errors.TranscriptRevisionConflict`.
* :meth:`SnapshotOps.replace_session_snapshot_if_current` /
  :meth:`SnapshotOps.clear_session_snapshot_if_current` — compare-and-set on
  the stored bytes, compared in Python after the locked read (a TEXT-degraded
  row compares by its UTF-8 bytes): ``False`` when no row is stored or its
  bytes are not the expected ones, with nothing written. Otherwise the write
  is fenced in SQL on the value read (:func:`replace_snapshot_if_stored`:
  ``UPDATE ... SET session_snapshot = :data WHERE runtime_id = :rt AND
  session_snapshot = :stored``; :func:`delete_snapshot_if_stored`: ``DELETE
  ... WHERE`` the same), bound as read so a TEXT row matches too; a fence
  that matches no row although the lock is held is
  :class:`~agentkeep.errors.ConcurrentModification` (a writer bypassed the
  lock) and nothing of the call stays written. Replace clears the quarantine
  marker like every snapshot write; clear-if-current sets it.

A caller-supplied snapshot that does not decode is ``WriteFailed`` and is
refused before any database access (in the one-call form, before the unit
opens); a stored snapshot that does not decode is ``ReadFailed`` (fail-closed).
"""

from __future__ import annotations

from typing import Any, Final

from sqlalchemy import bindparam as p
from sqlalchemy import delete, update

from agentkeep.arguments import check_methods
from agentkeep.db import LockNamespace
from agentkeep.one_call import read, write
from agentkeep.runtime.access import RuntimeAccess, as_bytes
from agentkeep.runtime.calls import RuntimeCallsBase
from agentkeep.runtime.domain import TranscriptCommit
from agentkeep.runtime.models import SessionSnapshotRow
from agentkeep.runtime.outbox import ensure_intents_already_outboxed
from agentkeep.runtime.snapshot_rows import (
    clear_quarantine,
    delete_snapshot,
    is_quarantined,
    previous_session,
    set_quarantine,
    snapshot_bytes,
    snapshot_read,
    stored_session,
    stored_snapshot,
    upsert_snapshot,
)
from agentkeep.statements import Statement

__all__ = [
    "SnapshotCalls",
    "SnapshotOps",
    "delete_snapshot_if_stored",
    "replace_snapshot_if_stored",
]

_T: Final = SessionSnapshotRow.__tablename__

_STORED = (
    SessionSnapshotRow.runtime_id == p("rt"),
    SessionSnapshotRow.session_snapshot == p("stored"),
)
#: The fence of replace-if-current: only the row that still holds the value read.
_REPLACE_IF_STORED: Final = Statement(
    update(SessionSnapshotRow).values(session_snapshot=p("data")).where(*_STORED),
    name="runtime.snapshot.replace_if_stored",
)
#: The fence of clear-if-current.
_DELETE_IF_STORED: Final = Statement(
    delete(SessionSnapshotRow).where(*_STORED), name="runtime.snapshot.delete_if_stored"
)


def _current_if(access: RuntimeAccess, runtime_id: str, expected: bytes) -> Any:
    """The snapshot as stored if its bytes (TEXT as UTF-8) are ``expected``, else None."""
    stored = stored_snapshot(access, runtime_id)
    if stored is None:
        return None
    current = as_bytes(stored, table=_T, key=runtime_id, column="session_snapshot")
    return stored if current == bytes(expected) else None


def replace_snapshot_if_stored(
    access: RuntimeAccess, runtime_id: str, stored: Any, data: bytes
) -> None:
    """Write ``data`` over the snapshot iff it still holds ``stored``; clear quarantine.

    ``stored`` is the value as read under the lock. Takes no lock.

    Raises:
        ConcurrentModification: the row no longer holds ``stored`` (nothing written).
        WriteFailed: a statement failed (a trigger abort).
    """
    access.fenced(
        _REPLACE_IF_STORED,
        {"rt": runtime_id, "stored": stored, "data": data},
        f"{_T}[{runtime_id}]",
    )
    clear_quarantine(access, runtime_id)


def delete_snapshot_if_stored(access: RuntimeAccess, runtime_id: str, stored: Any) -> None:
    """Delete the snapshot iff it still holds ``stored`` (the value read under the lock).

    Raises:
        ConcurrentModification: the row no longer holds ``stored`` (nothing deleted).
        WriteFailed: the DELETE failed (a trigger abort).
    """
    access.fenced(_DELETE_IF_STORED, {"rt": runtime_id, "stored": stored}, f"{_T}[{runtime_id}]")


@check_methods
class SnapshotOps:
    """Repository part: snapshot commits, rewrites, compare-and-set replacement, clears."""

    __slots__ = ("_access",)

    def __init__(self, access: RuntimeAccess) -> None:
        self._access = access

    # -- commit ------------------------------------------------------------

    def commit_session_snapshot(self, runtime_id: str, session_snapshot: bytes) -> None:
        """Commit a non-boundary snapshot if it continues the stored head.

        See docs/runtime.md#commit_session_snapshot.

        Args:
            runtime_id: the runtime.
            session_snapshot: the encoded session.

        Raises:
            WriteFailed: the snapshot does not decode; an intent it carries is
                invalid, not an identical pending outbox row, or finalized; the
                save guard rejects it against the stored head; a write failed.
            ReadFailed: the stored head does not decode (legacy/unversioned).
        """
        incoming = self._access.domain.decode_incoming_session(session_snapshot)
        self.apply_session_snapshot(runtime_id, session_snapshot, incoming)

    def apply_session_snapshot(self, runtime_id: str, data: bytes, incoming: Any) -> None:
        """:meth:`commit_session_snapshot` after the decode (``incoming`` decodes ``data``)."""
        access = self._access
        # psycopg: the stored head is read with BEGIN and the lock, in their round trip.
        with access.prefetching([snapshot_read(runtime_id)]):
            access.begin_write(LockNamespace.RUNTIME, runtime_id)
            ensure_intents_already_outboxed(access, runtime_id, incoming)
            stored = stored_snapshot(access, runtime_id)
        if type(stored) is bytes and stored == data:
            # Identical bytes (a BLOB equal to them, as SQL compares: a TEXT row
            # never is): continuity is proven; only head coherence is left. No
            # UPDATE of the row (a BEFORE UPDATE trigger never fires).
            access.domain.head_coherence_guard(incoming)
            with access.atomic():
                clear_quarantine(access, runtime_id)
            return
        access.domain.boundary_save_guard(incoming, stored_session(access, runtime_id, stored))
        with access.atomic(), access.pipelined():  # Postgres: both writes in one round trip
            upsert_snapshot(access, runtime_id, data)

    def commit_session_transcript_rewrite_snapshot(
        self, runtime_id: str, session_snapshot: bytes, commit: TranscriptCommit
    ) -> None:
        """Commit a transcript rewrite of the stored head.

        See docs/runtime.md#commit_session_transcript_rewrite_snapshot.

        Args:
            runtime_id: the runtime.
            session_snapshot: the rewritten session, encoded.
            commit: the rewrite commit it carries.

        Raises:
            TranscriptRevisionConflict: ``commit.parent_revision`` is not the
                stored revision (the outbox check runs first, so a replayed
                finalized intent reports that instead).
            WriteFailed: the snapshot does not decode; an outbox check or the
                rewrite guard refuses it; a write failed.
            ReadFailed: the stored head does not decode.
        """
        incoming = self._access.domain.decode_incoming_session(session_snapshot)
        self.apply_transcript_rewrite(runtime_id, session_snapshot, incoming, commit)

    def apply_transcript_rewrite(
        self, runtime_id: str, data: bytes, incoming: Any, commit: TranscriptCommit
    ) -> None:
        """:meth:`commit_session_transcript_rewrite_snapshot` after the decode."""
        access = self._access
        # psycopg: the stored head is read with BEGIN and the lock, in their round trip.
        with access.prefetching([snapshot_read(runtime_id)]):
            access.begin_write(LockNamespace.RUNTIME, runtime_id)
            ensure_intents_already_outboxed(access, runtime_id, incoming)
            _, previous = previous_session(access, runtime_id)
        access.domain.rewrite_save_guard(incoming, previous, commit)
        with access.atomic(), access.pipelined():  # Postgres: both writes in one round trip
            upsert_snapshot(access, runtime_id, data)

    # -- reads and clears ----------------------------------------------------

    def load_session_snapshot(self, runtime_id: str) -> bytes | None:
        """The stored snapshot bytes, undecoded (a TEXT row as its UTF-8 bytes).

        See docs/runtime.md#load_session_snapshot.

        Raises:
            ReadFailed: the SELECT failed.
        """
        return snapshot_bytes(self._access, runtime_id)

    def is_runtime_projection_quarantined(self, runtime_id: str) -> bool:
        """Whether the runtime's snapshot was cleared as rejected and not written since.

        See docs/runtime.md#is_runtime_projection_quarantined.

        Returns:
            True while the durable quarantine marker is set; False for a
            fresh runtime or after any snapshot write.

        Raises:
            ReadFailed: the SELECT failed.
        """
        return is_quarantined(self._access, runtime_id)

    def clear_session_snapshot(self, runtime_id: str) -> None:
        """Delete the snapshot row unconditionally; quarantine and outbox untouched.

        See docs/runtime.md#clear_session_snapshot.

        Raises:
            WriteFailed: the DELETE failed.
        """
        access = self._access
        access.begin_write(LockNamespace.RUNTIME, runtime_id)
        with access.atomic():
            delete_snapshot(access, runtime_id)

    def replace_session_snapshot_if_current(
        self, runtime_id: str, expected_current: bytes, replacement: bytes
    ) -> bool:
        """Replace the snapshot if the stored bytes are ``expected_current``.

        See docs/runtime.md#replace_session_snapshot_if_current.

        No save guard runs (a shrink or repair is allowed); the replacement
        is held to outbox authority only.

        Returns:
            True if replaced; False if no row is stored or its bytes differ
            (checked first: a stale ``expected_current`` is False even when
            the replacement would be refused), with nothing written.

        Raises:
            WriteFailed: the replacement does not decode, or it carries an
                intent that is not an identical pending outbox row.
            ReadFailed: a stored intent does not decode.
            ConcurrentModification: the row changed between its locked read
                and the fenced UPDATE (a writer bypassed the lock).
        """
        incoming = self._access.domain.decode_incoming_session(replacement)
        return self.apply_replace_if_current(runtime_id, expected_current, replacement, incoming)

    def apply_replace_if_current(
        self, runtime_id: str, expected_current: bytes, data: bytes, incoming: Any
    ) -> bool:
        """:meth:`replace_session_snapshot_if_current` after the decode."""
        access = self._access
        access.begin_write(LockNamespace.RUNTIME, runtime_id)
        stored = _current_if(access, runtime_id, expected_current)
        if stored is None:
            return False
        ensure_intents_already_outboxed(access, runtime_id, incoming)
        with access.atomic():
            replace_snapshot_if_stored(access, runtime_id, stored, data)
        return True

    def clear_session_snapshot_if_current(self, runtime_id: str, expected_current: bytes) -> bool:
        """Delete the snapshot if its bytes are ``expected_current`` and quarantine it.

        See docs/runtime.md#clear_session_snapshot_if_current.

        Returns:
            True if deleted (the durable quarantine marker is set in the same
            transaction); False if absent or different, with nothing written.

        Raises:
            WriteFailed: a statement failed.
            ConcurrentModification: the row changed between its locked read
                and the fenced DELETE (a writer bypassed the lock).
        """
        access = self._access
        access.begin_write(LockNamespace.RUNTIME, runtime_id)
        stored = _current_if(access, runtime_id, expected_current)
        if stored is None:
            return False
        with access.atomic():
            delete_snapshot_if_stored(access, runtime_id, stored)
            set_quarantine(access, runtime_id)
        return True


class SnapshotCalls(RuntimeCallsBase):
    """One-call forms of the snapshot operations (decoding before the unit opens)."""

    _repository = "runtime.snapshots"

    load_session_snapshot = read(SnapshotOps.load_session_snapshot)
    is_runtime_projection_quarantined = read(SnapshotOps.is_runtime_projection_quarantined)
    clear_session_snapshot = write(SnapshotOps.clear_session_snapshot)
    clear_session_snapshot_if_current = write(SnapshotOps.clear_session_snapshot_if_current)

    def commit_session_snapshot(self, runtime_id: str, session_snapshot: bytes) -> None:
        """One-call form of :meth:`SnapshotOps.commit_session_snapshot`."""
        incoming = self.domain.decode_incoming_session(session_snapshot)
        self._write(
            lambda r: r.snapshots.apply_session_snapshot(runtime_id, session_snapshot, incoming)
        )

    def commit_session_transcript_rewrite_snapshot(
        self, runtime_id: str, session_snapshot: bytes, commit: TranscriptCommit
    ) -> None:
        """One-call form of :meth:`SnapshotOps.commit_session_transcript_rewrite_snapshot`."""
        incoming = self.domain.decode_incoming_session(session_snapshot)
        self._write(
            lambda r: r.snapshots.apply_transcript_rewrite(
                runtime_id, session_snapshot, incoming, commit
            )
        )

    def replace_session_snapshot_if_current(
        self, runtime_id: str, expected_current: bytes, replacement: bytes
    ) -> bool:
        """One-call form of :meth:`SnapshotOps.replace_session_snapshot_if_current`."""
        incoming = self.domain.decode_incoming_session(replacement)
        return self._write(
            lambda r: r.snapshots.apply_replace_if_current(
                runtime_id, expected_current, replacement, incoming
            )
        )
