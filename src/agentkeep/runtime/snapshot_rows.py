"""The snapshot row and its quarantine marker, as every snapshot writer touches them.

Described in docs/runtime.md#session-snapshots and
docs/runtime.md#quarantine. This module holds the statements on
``runtime_session_snapshots`` and ``runtime_projection_quarantine`` that the
snapshot writers (:mod:`~agentkeep.runtime.snapshots`), the boundary commits
(:mod:`~agentkeep.runtime.boundaries`) and outbox finalization
(:mod:`~agentkeep.runtime.outbox`) share, as plain functions of the unit's
:class:`~agentkeep.runtime.access.RuntimeAccess`. None of them takes a lock:
the calling operation holds the ``runtime:<id>`` write lock. No fence lives
here; the snapshot compare-and-set fences are in
:mod:`~agentkeep.runtime.snapshots`.

Invariant kept here (I5, docs/runtime.md#invariants): every unconditional
snapshot write goes through :func:`upsert_snapshot`, which deletes the
quarantine marker in the same transaction, because a written snapshot is
authoritative again.
"""

from __future__ import annotations

from typing import Any, Final

from sqlalchemy import bindparam as p
from sqlalchemy import delete, exists, select

from agentkeep.runtime.access import RuntimeAccess, as_bytes, stored_form, upsert_replacing
from agentkeep.runtime.models import ProjectionQuarantineRow, SessionSnapshotRow
from agentkeep.statements import Statement, upsert

__all__ = [
    "clear_quarantine",
    "delete_snapshot",
    "is_quarantined",
    "previous_session",
    "set_quarantine",
    "snapshot_bytes",
    "snapshot_read",
    "stored_session",
    "stored_snapshot",
    "upsert_snapshot",
]

_T: Final = SessionSnapshotRow.__tablename__
_Q: Final = ProjectionQuarantineRow.__tablename__

_SNAPSHOT_OF = SessionSnapshotRow.runtime_id == p("rt")
_QUARANTINE_OF = ProjectionQuarantineRow.runtime_id == p("rt")

_GET: Final = Statement(
    select(SessionSnapshotRow.session_snapshot).where(_SNAPSHOT_OF), name="runtime.snapshot.get"
)
_UPSERT: Final = Statement(
    lambda d: upsert_replacing(
        d,
        SessionSnapshotRow,
        {"runtime_id": p("rt"), "session_snapshot": p("data")},
        key=[SessionSnapshotRow.runtime_id],
        replace=["session_snapshot"],
    ),
    name="runtime.snapshot.upsert",
)
_DELETE: Final = Statement(
    delete(SessionSnapshotRow).where(_SNAPSHOT_OF), name="runtime.snapshot.delete"
)
_CLEAR_QUARANTINE: Final = Statement(
    delete(ProjectionQuarantineRow).where(_QUARANTINE_OF), name="runtime.quarantine.clear"
)
_SET_QUARANTINE: Final = Statement(
    lambda d: (
        upsert(d, ProjectionQuarantineRow)
        .values(runtime_id=p("rt"))
        .on_conflict_do_nothing(index_elements=[ProjectionQuarantineRow.runtime_id])
    ),
    name="runtime.quarantine.set",
)
_QUARANTINED: Final = Statement(
    select(exists().where(_QUARANTINE_OF)), name="runtime.quarantine.exists"
)


def snapshot_read(runtime_id: str) -> tuple[Statement, dict[str, Any]]:
    """The read of :func:`previous_session`, for :meth:`~agentkeep.db.Driver.prefetching`."""
    return _GET, {"rt": runtime_id}


def stored_snapshot(access: RuntimeAccess, runtime_id: str) -> Any:
    """The snapshot exactly as stored (bytes, or str for a TEXT-degraded row), or None.

    What a compare-and-set binds into its SQL fence (see
    :func:`~agentkeep.runtime.access.stored_form`).

    Raises:
        ReadFailed: the SELECT failed.
    """
    row = access.select(_GET, {"rt": runtime_id}, f"{_T}[{runtime_id}]").fetchone()
    return None if row is None else stored_form(row[0])


def snapshot_bytes(access: RuntimeAccess, runtime_id: str) -> bytes | None:
    """The stored snapshot bytes (TEXT read as UTF-8), or None.

    Raises:
        ReadFailed: the SELECT failed or the value is not bytes or text.
    """
    return access.one_bytes(
        _GET, {"rt": runtime_id}, table=_T, key=runtime_id, column="session_snapshot"
    )


def stored_session(access: RuntimeAccess, runtime_id: str, stored: Any) -> Any:
    """The session a stored value (as :func:`stored_snapshot` returns it) decodes to, or None.

    A TEXT-degraded row decodes from its UTF-8 bytes, as :func:`previous_session` reads it.

    Raises:
        ReadFailed: the value is neither bytes nor text, or does not decode
            (legacy, unversioned, corrupt): fail-closed, never read as absent.
    """
    if stored is None:
        return None
    data = as_bytes(stored, table=_T, key=runtime_id, column="session_snapshot")
    return access.domain.decode_persisted_session(data)


def previous_session(access: RuntimeAccess, runtime_id: str) -> tuple[bytes | None, Any]:
    """The stored snapshot's bytes and its decoded session (None, None when absent).

    Raises:
        ReadFailed: the row does not decode (legacy, unversioned, corrupt):
            fail-closed, never read as absent (docs/runtime.md#errors).
    """
    data = snapshot_bytes(access, runtime_id)
    if data is None:
        return None, None
    return data, access.domain.decode_persisted_session(data)


def upsert_snapshot(access: RuntimeAccess, runtime_id: str, data: bytes) -> None:
    """Write the snapshot and clear the quarantine marker (docs/runtime.md#quarantine).

    Raises:
        WriteFailed: a statement failed (a trigger abort on the snapshot row).
    """
    access.write(_UPSERT, {"rt": runtime_id, "data": data}, f"{_T}[{runtime_id}]")
    clear_quarantine(access, runtime_id)


def delete_snapshot(access: RuntimeAccess, runtime_id: str) -> None:
    """Delete the snapshot row, if any (quarantine untouched).

    Raises:
        WriteFailed: the DELETE failed.
    """
    access.dml(_DELETE, {"rt": runtime_id}, f"{_T}[{runtime_id}]")


def clear_quarantine(access: RuntimeAccess, runtime_id: str) -> None:
    """Delete the runtime's quarantine marker, if any.

    Raises:
        WriteFailed: the DELETE failed.
    """
    access.write(_CLEAR_QUARANTINE, {"rt": runtime_id}, f"{_Q}[{runtime_id}]")


def set_quarantine(access: RuntimeAccess, runtime_id: str) -> None:
    """Set the runtime's durable quarantine marker (idempotent).

    Raises:
        WriteFailed: the INSERT failed.
    """
    access.dml(_SET_QUARANTINE, {"rt": runtime_id}, f"{_Q}[{runtime_id}]")


def is_quarantined(access: RuntimeAccess, runtime_id: str) -> bool:
    """True while the runtime's quarantine marker is set.

    Raises:
        ReadFailed: the SELECT failed.
    """
    row = access.select(_QUARANTINED, {"rt": runtime_id}, _Q)
    return bool(row.fetchone()[0])
