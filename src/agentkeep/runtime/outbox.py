"""The compaction-projection outbox: its fences, the pending list and finalization.

Described in docs/runtime.md#compaction-outbox.

A row is born ``pending`` in the transaction that commits the snapshot
carrying its intent (only a boundary commit inserts rows), moves to
``finalized`` when the projection is acknowledged, and is never deleted: a
finalized row is a tombstone that refuses every replay of its intent.

The three checks every snapshot writer runs (docs/runtime.md#outbox-checks)
live here, one function each, taking the unit's
:class:`~agentkeep.runtime.access.RuntimeAccess` (the caller holds the
``runtime:<id>`` write lock):

* :func:`insert_outbox_intents` (boundary writers): the outbox's fence.
  Each intent is inserted if absent (``INSERT ... ON CONFLICT DO NOTHING``),
  then the stored intent is compared *structurally*; a different intent at
  the same key → ``WriteFailed("conflicting compaction outbox intent for
  rewrite {revision}")``. The row's state is never changed.
* :func:`reject_finalized_replays` (boundary writers, before the
  supersession verdict): a finalized row at an intent's key →
  ``WriteFailed("atomic session snapshot replays finalized compaction intent
  {revision}")``.
* :func:`ensure_intents_already_outboxed` (non-boundary writers): every
  intent must already be an identical *pending* row; they never insert.

:class:`OutboxOps` is the repository part with the pending list and
finalization (``uow.runtime.outbox``).

Invariants (I3, I4 of docs/runtime.md#invariants): rows are never deleted;
``state`` only moves ``pending`` → ``finalized``; the ``intent_json`` of a key
never changes; once a row is finalized its intent is gone from the snapshot and
no path can put it back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

from sqlalchemy import bindparam as p
from sqlalchemy import select, update

from agentkeep.arguments import check_methods
from agentkeep.db import LockNamespace
from agentkeep.one_call import read, write
from agentkeep.runtime.access import RuntimeAccess, as_bytes
from agentkeep.runtime.calls import RuntimeCallsBase
from agentkeep.runtime.domain import CompactionIntent, ProjectionId
from agentkeep.runtime.errors import RuntimeNotFound, WriteFailed
from agentkeep.runtime.models import CompactionProjectionOutboxRow as Outbox
from agentkeep.runtime.snapshot_rows import previous_session, upsert_snapshot
from agentkeep.statements import Statement, upsert

__all__ = [
    "OutboxCalls",
    "OutboxOps",
    "ensure_intents_already_outboxed",
    "insert_outbox_intents",
    "reject_finalized_replays",
]

_T: Final = Outbox.__tablename__
_KEY = (
    Outbox.runtime_id == p("rt"),
    Outbox.session_id == p("sid"),
    Outbox.parent_revision == p("parent"),
    Outbox.revision == p("rev"),
    Outbox.commit_fingerprint == p("fp"),
)
_INSERT: Final = Statement(
    lambda d: (
        upsert(d, Outbox)
        .values(
            runtime_id=p("rt"),
            session_id=p("sid"),
            parent_revision=p("parent"),
            revision=p("rev"),
            commit_fingerprint=p("fp"),
            intent_json=p("intent"),
            state="pending",
        )
        .on_conflict_do_nothing()
    ),
    name="runtime.outbox.insert",
)
_GET: Final = Statement(
    select(Outbox.intent_json, Outbox.state).where(*_KEY), name="runtime.outbox.get"
)
_EXISTS: Final = Statement(select(Outbox.runtime_id).where(*_KEY), name="runtime.outbox.exists")
_FINALIZE: Final = Statement(
    update(Outbox).values(state="finalized").where(*_KEY), name="runtime.outbox.finalize"
)
_PENDING: Final = Statement(
    select(Outbox.revision, Outbox.intent_json)
    .where(Outbox.runtime_id == p("rt"), Outbox.state == "pending")
    .order_by(
        Outbox.session_id, Outbox.parent_revision, Outbox.revision, Outbox.commit_fingerprint
    ),
    name="runtime.outbox.pending",
)


def _key(runtime_id: str, pid: ProjectionId) -> dict[str, Any]:
    return {
        "rt": runtime_id,
        "sid": pid.session_id,
        "parent": pid.parent_revision,
        "rev": pid.revision,
        "fp": pid.commit_fingerprint,
    }


def _outbox_row(
    access: RuntimeAccess, runtime_id: str, pid: ProjectionId
) -> tuple[CompactionIntent, str] | None:
    row = access.select(_GET, _key(runtime_id, pid), f"{_T}[{pid.revision}]").fetchone()
    if row is None:
        return None
    data = as_bytes(row[0], table=_T, key=pid.revision, column="intent_json")
    return access.domain.decode_compaction_intent(data), str(row[1])


def insert_outbox_intents(
    access: RuntimeAccess, runtime_id: str, intents: Sequence[CompactionIntent]
) -> None:
    """Insert each intent if absent and compare the stored one (docs/runtime.md#outbox-checks).

    Raises:
        WriteFailed: a different intent is stored at the same key, or a
            statement failed.
        ReadFailed: the stored intent does not decode.
    """
    for intent in intents:
        pid = intent.projection
        params = _key(runtime_id, pid)
        params["intent"] = access.domain.encode_compaction_intent(intent)
        access.dml(_INSERT, params, f"{_T}[{pid.revision}]")
        stored = _outbox_row(access, runtime_id, pid)
        if stored is None:  # inserted or present a moment ago, under our lock
            raise WriteFailed(f"compaction outbox row for rewrite {pid.revision} vanished")
        if stored[0] != intent:
            raise WriteFailed(f"conflicting compaction outbox intent for rewrite {pid.revision}")


def reject_finalized_replays(
    access: RuntimeAccess, runtime_id: str, intents: Sequence[CompactionIntent]
) -> None:
    """Refuse a boundary snapshot that carries an acknowledged intent.

    See docs/runtime.md#outbox-checks.

    Raises:
        WriteFailed: an intent's outbox row is finalized.
        ReadFailed: the SELECT failed or the row does not decode.
    """
    for intent in intents:
        stored = _outbox_row(access, runtime_id, intent.projection)
        if stored is not None and stored[1] == "finalized":
            raise WriteFailed(
                "atomic session snapshot replays finalized compaction intent "
                f"{intent.projection.revision}"
            )


def ensure_intents_already_outboxed(access: RuntimeAccess, runtime_id: str, session: Any) -> None:
    """A non-boundary snapshot may carry only identical pending outbox intents.

    See docs/runtime.md#outbox-checks.

    Raises:
        WriteFailed: an intent is invalid (docs/runtime.md#compaction-intents),
            has no outbox row, its row is finalized, or the stored intent
            differs.
        ReadFailed: a stored intent does not decode.
    """
    for intent in access.domain.validated_compaction_intents(session):
        rev = intent.projection.revision
        stored = _outbox_row(access, runtime_id, intent.projection)
        if stored is None:
            raise WriteFailed(
                f"non-boundary snapshot introduces compaction intent {rev} "
                "without atomic outbox authority"
            )
        if stored[1] == "finalized":
            raise WriteFailed(f"non-boundary snapshot replays finalized compaction intent {rev}")
        if stored[0] != intent:
            raise WriteFailed(
                f"non-boundary snapshot conflicts with compaction outbox rewrite {rev}"
            )


@check_methods
class OutboxOps:
    """Repository part (``uow.runtime.outbox``): the pending list and finalization."""

    __slots__ = ("_access",)

    def __init__(self, access: RuntimeAccess) -> None:
        self._access = access

    def load_pending_compaction_projections(self, runtime_id: str) -> list[CompactionIntent]:
        """The runtime's pending intents, ordered by their key.

        See docs/runtime.md#load_pending_compaction_projections.

        Raises:
            ReadFailed: the SELECT failed or any row does not decode (the
                whole call fails; a corrupt row is never skipped).
        """
        access = self._access
        rows = access.select(_PENDING, {"rt": runtime_id}, _T).fetchall()
        return [
            access.domain.decode_compaction_intent(
                as_bytes(data, table=_T, key=str(rev), column="intent_json")
            )
            for rev, data in rows
        ]

    def mark_compaction_projection_finalized(
        self, runtime_id: str, projection: ProjectionId
    ) -> None:
        """Acknowledge a projection: drop its intent from the snapshot, tombstone its row.

        See docs/runtime.md#mark_compaction_projection_finalized.

        Takes the ``runtime:<id>`` write lock. If a snapshot row exists, the
        intent is removed from it (a no-op when already gone) and the
        re-encoded session is written without a save guard (a trusted edit;
        this also clears quarantine). The row's state becomes ``finalized``.
        Idempotent: a second call succeeds and changes nothing.

        Raises:
            RuntimeNotFound: no outbox row at the projection's key
                (``compaction outbox rewrite {revision}``).
            ReadFailed: the stored snapshot does not decode.
            WriteFailed: a statement failed.
        """
        access = self._access
        access.begin_write(LockNamespace.RUNTIME, runtime_id)
        key = _key(runtime_id, projection)
        if access.select(_EXISTS, key, f"{_T}[{projection.revision}]").fetchone() is None:
            raise RuntimeNotFound("compaction outbox rewrite", projection.revision)
        with access.atomic():
            _, session = previous_session(access, runtime_id)
            if session is not None:
                cleaned = access.domain.complete_compaction_intent(session, projection)
                upsert_snapshot(access, runtime_id, access.domain.encode_session(cleaned))
            access.dml(_FINALIZE, key, f"{_T}[{projection.revision}]")


class OutboxCalls(RuntimeCallsBase):
    """One-call forms of the outbox operations."""

    _repository = "runtime.outbox"

    load_pending_compaction_projections = read(OutboxOps.load_pending_compaction_projections)
    mark_compaction_projection_finalized = write(OutboxOps.mark_compaction_projection_finalized)

    def supports_compaction_projection_outbox(self) -> bool:
        """True: this store commits compaction intents and their outbox rows atomically.

        See docs/runtime.md#supports_compaction_projection_outbox.
        """
        return True
