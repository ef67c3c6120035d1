"""Session commits and session reads: the atomic turn commit, loads, node reads, metadata.

This module owns the rows a turn records: the session head (``session_head``,
one per session, the head-revision compare-and-set target), the conversation
graph (``graph_nodes``), the usage ledger (``usage_deltas``), the turn-commit
idempotency ledger (``runtime_turn_commits``), the commit stamp of attachments
(``attachment_manifest.committed_at_ms``) and the session metadata
(``session_meta``). Checkpoint blobs are written through
:mod:`agentkeep.sessions.checkpoints`; queued work and turn inputs through
:mod:`agentkeep.sessions.queue` and :mod:`agentkeep.sessions.turn_inputs`.
The tables, the commit and the reads are described in
docs/sessions.md#turn-commits and docs/sessions.md#session-reads.

The commit (:meth:`SessionCommitRepository.commit_runtime_state`) runs its
steps in this order, which fixes the error precedence
(docs/sessions.md#order-of-checks-and-writes lists the same order; the
numbers below are the ones the code's comments use):

1. the ``session:<id>`` write lock, then the blob-GC lock **shared** (GC takes
   it exclusive, so a commit's fresh blobs are never swept before its head
   names them; both are no-ops on SQLite, whose ``BEGIN IMMEDIATE`` is
   database-wide); ``now`` is sampled once, after the locks (the original
   store sampled it before the lock:
   docs/decisions.md#now-is-sampled-once-after-the-lock);
2. (the original store's "bound session" check has nothing to check: there
   is one head per session, docs/decisions.md#many-sessions-per-database);
3. turn-commit idempotency: a stamp for another session is
   :class:`~agentkeep.errors.RuntimeTurnCommitConflict`; a recorded
   ``(session, turn)`` with the same hash is a **replay** — the stored result
   is returned, the fenced lease release (if any) runs, and nothing else is
   checked or written (no fence, no head CAS: a lost worker gets its result);
   a different hash is ``RuntimeTurnCommitConflict``;
4. a missing fence and 5. a fence that is not the live lease (FENCE_OK) are
   :class:`~agentkeep.errors.SessionExecutionLeaseExpired`;
6. head CAS: ``expected_head_revision`` (if given) must equal the stored
   revision (0 without a head), else
   :class:`~agentkeep.errors.HeadRevisionConflict`; ``None`` is a blind write;
7. completed queue claims: one for another session, or one that does not
   name **exactly** the rows its claim owns (strict; the original store
   compared counts: docs/decisions.md#strict-claim-completion), is
   :class:`~agentkeep.errors.QueuedWorkClaimSuperseded`;
8. the same for turn-input claims (:class:`~agentkeep.errors.TurnInputClaimSuperseded`);
9. the checkpoint's blobs and manifest; 10. the usage deltas, in order,
    then the session's ledger totals (``session_usage_totals``: read, summed
    here, changed pairs upserted; a total past ``2**63-1`` is
    :class:`~agentkeep.errors.UsageLedgerOverflow`, nothing written);
11. the graph delta (``Unchanged`` / ``Append`` / ``ReplaceFull``, scoped to
    the session; appended nodes in inserts of up to 16 rows); a node id that
    exists already in the session, or twice in the delta, is
    :class:`NodeAlreadyExists` naming the first such node in the delta's
    order (defined here; the original store surfaced the unique violation as
    a ``Backend`` error);
12. the live node count, kept incrementally (the head's count plus the
    appended nodes, or the replacement's size; ``tombstone_nodes`` decrements
    it), so a commit costs O(its delta), never O(graph) (the original store
    counted the table: docs/decisions.md#live-node-count-is-incremental);
13. the head, written as an upsert fenced by the
    revision read in step 6 (a miss is
    :class:`~agentkeep.errors.ConcurrentModification`, a bug signal: the lock
    is held);
14. the completed batches are deleted; 15. the completed turn inputs become
    ``completed``;
16. an interrupted turn ``T`` moves the session's ``pending_active`` inputs
    whose ingress is ``ActiveTurn(T)`` to ``deferred_next_turn`` with the
    ingress rewritten to ``{"scope":"next_turn"}`` and the claim cleared (the
    ``submitted_ingress_json`` is kept, so source-key idempotency still
    recognises the original draft); ``accepted`` inputs are not touched;
17. attachments of the session get ``committed_at_ms = COALESCE(…, now)``
    (the first commit wins; unknown ids are ignored);
18. the enqueued drafts: one for another session is
    :class:`~agentkeep.errors.SessionBindingMismatch` (after the writes above,
    which roll back with it);
19.–21. the result, the turn-commit record (``result_json`` = canonical JSON
    of the result, plus its ``checkpoint_ref`` — a GC root), and the fenced
    lease release (a mismatch is a silent no-op).

Atomicity. Every write of a commit runs inside :meth:`Driver.savepoint`: any
error (typed, or a database error such as a failing trigger) rolls back all of
the commit and nothing else. Called through the one-call facade
(``store.commits.commit_runtime_state``) the commit is its own unit. Inside a
caller's ``store.write()`` block, an error that propagates out of the block
rolls the whole unit back; a caller that *catches* a typed error from the
commit keeps the work it did earlier in the unit, and the commit left nothing.

Round trips. The fence reads of steps 3–6 and the ledger totals of step 10
are prefetched (:meth:`Driver.prefetching`): on psycopg they go out with the
write locks, in their round trip. The writes of steps 9–13, 17 and 19–21 are
deferred (:meth:`Driver.defer`) with their checks (a node id that exists, a
head fence that misses) and go out together at the end of the commit, or
before the next statement that reads; the checks then run in step order, so
the error precedence is the one above. On Postgres the writes of steps 10, 11
and 13 of a commit that appends at most 16 nodes (the folded ledger, the node
insert, the head with its checkpoint blobs) are one statement of
data-modifying CTEs (:func:`_put_turn`). This full commit on psycopg is
three round trips: locks and reads, writes, ``COMMIT`` (alone, so a lost
connection during it is still ``CommitOutcomeUnknown``). SQLite and asyncpg
run the same code one statement at a time: on asyncpg it is four round trips
(``BEGIN`` with the locks, the reads, the writes, ``COMMIT``).

The checking commit (Postgres, one-call units). A small fenced commit with an
``expected_head_revision`` (:class:`_CheckedTurn` says which) needs no read
before its writes: after the locks it is one statement
(:func:`_checked_turn`) that fails with ``division_by_zero`` unless every check
of steps 3–13 passes, with the writes as its data-modifying CTEs; on psycopg
``COMMIT`` goes with it (two round trips in all), on asyncpg it follows (three).
A refused check writes nothing: the unit rolls back and runs the full commit,
which judges the same rows and raises the typed error of the order above (or
commits: a new ledger pair, which the statement does not add).

Reads (:meth:`~SessionCommitRepository.load_session`,
:meth:`~SessionCommitRepository.load_node`,
:meth:`~SessionCommitRepository.get_head_revision`,
:meth:`~SessionCommitRepository.load_session_meta`) take no lock and work in
read and write units; ``load_session`` issues several SELECTs, which see one
snapshot in a ``store.read()`` unit
(docs/decisions.md#multi-statement-reads-use-one-snapshot).

Statements. Every statement of this module is a module-level
:class:`~agentkeep.statements.Statement` built from the mapped tables of
:mod:`agentkeep.sessions.models` (the head upsert and the metadata upsert per
dialect, through :func:`~agentkeep.statements.upsert`); the values a statement
fixes itself (``tombstoned = 0``, the ``pending_active`` and
``deferred_next_turn`` states) are bound on every call. Row decoders read the
columns in the order of the column tuples next to the statements.

Choices where the original store was open (docs/decisions.md#session-store):

* Multi-session: every statement is scoped by ``session_id``; ``ReplaceFull``
  deletes only the session's nodes; the node count and the ledger are the
  session's (docs/decisions.md#many-sessions-per-database).
* A duplicate node id is the typed :class:`NodeAlreadyExists` (a
  :class:`~agentkeep.errors.Duplicate` and a
  :class:`~agentkeep.errors.SessionStoreError`), not a backend error
  (docs/decisions.md#typed-duplicate-errors).
* A fenced release (``release_session_execution_lease``) naming another
  session is :class:`~agentkeep.errors.SessionBindingMismatch`, raised where
  the release would run (step 3c or 21): taking a second session's lock
  inside a commit could deadlock two commits on Postgres.
* The arguments are checked before anything is locked or written
  (:class:`~agentkeep.errors.InvalidInput`): ids non-blank, opaque values JSON,
  completions and drafts well-formed. A replay is checked the same way
  (docs/decisions.md#arguments-are-checked-before-the-lock).
* Corrupt stored data fails loudly
  (docs/decisions.md#corrupt-data-fails-loudly) with
  :class:`~agentkeep.errors.SessionCorrupt` naming table, key and column: the
  head row (schema version, config, frames), a stored turn-commit result, a
  checkpoint manifest, an ingress read by step 16, session metadata, a
  ledger total. The original store's silent skips are kept only for graph
  nodes, with a warning logged once per row; a SQL failure is never read as
  an empty graph. Stored nodes are decoded by the strict JSON parser and the
  structural checks validation would make, not by per-node pydantic
  validation (the commit validated them): see :func:`_stored_node`.
* The active path is one recursive CTE over the ``parent_node_id`` column,
  each step an index lookup on ``(session_id, node_id)`` (or, for the whole
  path on Postgres, a probe of a hash of the session's live nodes; the tail's
  step is a ``LATERAL`` lookup there: :func:`_path_walk`): its cost follows
  the path, not the graph. It stops at a missing or tombstoned ancestor; a
  cycle of parent ids (only corrupt data can make one) is ``SessionCorrupt``
  (docs/decisions.md#active-path-is-one-recursive-query).
* The ledger is kept by the commit in ``session_usage_totals`` (one row per
  ``(source, model)``, under the write lock), so a load reads it instead of
  re-summing ``usage_deltas``; a total that would pass ``2**63-1`` refuses
  the commit with :class:`~agentkeep.errors.UsageLedgerOverflow` (the newer
  upstream's checked addition, moved to the write), never a silently wrapped
  value (docs/decisions.md#resume-reads-do-not-grow-with-the-session).
* ``HeadScope`` reads no graph node and ``ActivePathScope(tail=N)`` at most
  ``N`` (:data:`ACTIVE_PATH_TAIL`): resume reads whose cost does not grow
  with the session.
* ``save_session_meta`` raises its errors (typed) instead of swallowing them,
  and ``load_session_meta`` returns None only for a missing row; the original
  store swallowed both (docs/decisions.md#session-metadata-errors-are-raised).
* Batch-id nonces are taken per draft at step 18 (the original store reserved
  a block before the transaction); ids also hash 64 random bits
  (docs/decisions.md#derived-ids-carry-random-bits).
* Argument checks reuse the queue's and turn inputs' own checkers for
  completions and drafts (their private ``_check_completion`` /
  ``_check_draft``), so a malformed one is refused before the lock.
* Auto-GC after commits is the one-call facade's job
  (:class:`~agentkeep.sessions.facade.SessionCalls`); a commit inside
  ``store.write()`` never triggers it.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, Final
from typing import cast as typed

from pydantic import TypeAdapter, ValidationError
from sqlalchemy import (
    Column,
    Text,
    and_,
    case,
    cast,
    delete,
    func,
    insert,
    literal,
    literal_column,
    null,
    or_,
    select,
    true,
    union_all,
    update,
)
from sqlalchemy import bindparam as p
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import aliased
from sqlalchemy.sql.elements import BindParameter

from agentkeep.base import BIGINT
from agentkeep.checked_records import (
    new_record,
    set_dict,
    set_extra,
    set_fields_set,
    set_private,
)
from agentkeep.clock import Clock
from agentkeep.db import Driver, PrefetchCheckFailed, atomic
from agentkeep.errors import (
    ConcurrentModification,
    HeadRevisionConflict,
    InvalidInput,
    NodeAlreadyExists,
    QueuedWorkClaimSuperseded,
    RuntimeTurnCommitConflict,
    SessionBindingMismatch,
    SessionCorrupt,
    SessionExecutionLeaseExpired,
    TurnInputClaimSuperseded,
    UsageLedgerOverflow,
)
from agentkeep.limits import ColumnKind, column_kind
from agentkeep.sessions.checkpoints import (
    BLOB_COLUMNS,
    decode_blob,
    hydrate,
    manifest_of,
    put_checkpoint,
)
from agentkeep.sessions.codec import encode_ingress, loads
from agentkeep.sessions.domain import (
    MAX_I64,
    ActiveTurnIngress,
    LeaseFence,
    NextTurnIngress,
    TurnInputIngress,
    check_id,
    check_json,
    same_incarnation,
)
from agentkeep.sessions.leases import (
    LEASE_COLUMNS,
    begin_session_write,
    check_fence_row,
    holder_fence,
    release_locked,
    release_update,
)
from agentkeep.sessions.models import (
    AttachmentManifestRow,
    BlobRow,
    GraphNodeRow,
    PendingTurnInputRow,
    RuntimeTurnCommitRow,
    SessionHeadRow,
    SessionLeaseRow,
    SessionMetaRow,
    UsageDeltaRow,
    UsageTotalRow,
)
from agentkeep.sessions.queue import (
    _check_completion as _check_queue_completion,
)
from agentkeep.sessions.queue import (
    _check_draft,
    delete_completed_queued_work,
    enqueue_queued_work_conn,
    ensure_queued_work_completion,
    next_enqueue_nonce,
)
from agentkeep.sessions.records import (
    HEAD_SCHEMA_VERSION,
    ActivePathScope,
    AppendNodes,
    BlobProfile,
    CheckpointManifest,
    FullGraphScope,
    HeadScope,
    HydratedSessionCheckpoint,
    LoadScope,
    PersistedSessionRead,
    ReplaceFullGraph,
    RuntimeCommit,
    RuntimeCommitResult,
    SessionGraph,
    SessionMeta,
    SessionNodeRecord,
    TokenUsage,
    UnchangedGraph,
    UsageDelta,
    UsageLedgerEntry,
    checked_builder,
)
from agentkeep.sessions.turn_inputs import (
    _check_completion as _check_turn_input_completion,
)
from agentkeep.sessions.turn_inputs import (
    complete_turn_input_rows,
    ensure_turn_input_completion,
)
from agentkeep.statements import Statement, upsert
from agentkeep.strict_json import canonical_json, canonical_json_checked, json_value_problem

__all__ = [
    "ACTIVE_PATH",
    "ACTIVE_PATH_TAIL",
    "NodeAlreadyExists",
    "SessionCommitRepository",
    "merge_token_ledger",
]

log = logging.getLogger("agentkeep.sessions")

# --------------------------------------------------------------------------
# Statements

_BY_SESSION_HEAD = SessionHeadRow.session_id == p("sid")

#: The head columns :meth:`SessionCommitRepository.load_session` decodes, in its order.
_HEAD_COLUMNS: Final = (
    SessionHeadRow.schema_version,
    SessionHeadRow.head_revision,
    SessionHeadRow.leaf_node_id,
    SessionHeadRow.checkpoint_ref,
    SessionHeadRow.config_json,
    SessionHeadRow.agent_frames_json,
    SessionHeadRow.current_agent_frame_id,
    SessionHeadRow.graph_node_count,
)
_GET_HEAD_REVISION: Final = Statement(
    select(SessionHeadRow.head_revision).where(_BY_SESSION_HEAD),
    name="sessions.get_head_revision",
)


def _head_insert(dialect: Dialect, count: Any) -> Any:
    """The insert of a head of the commit's values (``:sid``, ``:schema``, ``:next``,
    ``:leaf``, ``:ref``, ``:config``, ``:frames``, ``:frame_id``), ``count`` live nodes."""
    return upsert(dialect, SessionHeadRow).values(
        session_id=p("sid"),
        schema_version=p("schema"),
        head_revision=p("next"),
        leaf_node_id=p("leaf"),
        checkpoint_ref=p("ref"),
        config_json=p("config"),
        agent_frames_json=p("frames"),
        current_agent_frame_id=p("frame_id"),
        graph_node_count=count,
    )


def _head_upsert(dialect: Dialect, count: Any, grown: Any | None, *fence: Any) -> Any:
    """The head upsert of the commit's values (``:sid``, ``:schema``, ``:next``,
    ``:leaf``, ``:ref``, ``:config``, ``:frames``, ``:frame_id``): a new head is
    inserted with ``count`` as its node count; a stored one is replaced (its node
    count set to ``grown``, an expression of the stored row, or to ``count``
    when None) only where every ``fence`` term holds, else left as it is (the
    upsert then returns no row)."""
    insert = _head_insert(dialect, count)
    new = insert.excluded
    set_ = {
        SessionHeadRow.schema_version: new.schema_version,
        SessionHeadRow.head_revision: new.head_revision,
        SessionHeadRow.leaf_node_id: new.leaf_node_id,
        SessionHeadRow.checkpoint_ref: new.checkpoint_ref,
        SessionHeadRow.config_json: new.config_json,
        SessionHeadRow.agent_frames_json: new.agent_frames_json,
        SessionHeadRow.current_agent_frame_id: new.current_agent_frame_id,
        SessionHeadRow.graph_node_count: new.graph_node_count if grown is None else grown,
    }
    return insert.on_conflict_do_update(
        index_elements=[SessionHeadRow.session_id], set_=set_, where=and_(*fence)
    )


def _put_head(dialect: Dialect) -> Any:
    """Step 13: the head upsert, fenced by the revision read under the lock.

    A conflicting row whose ``head_revision`` is not ``:actual`` is left as it
    is and no row is returned.
    """
    return _head_upsert(
        dialect, p("count"), None, SessionHeadRow.head_revision == p("actual")
    ).returning(SessionHeadRow.head_revision)


_PUT_HEAD: Final = Statement(_put_head, name="sessions.put_head")
#: The most checkpoint blobs (the manifest and its three components) a commit writes.
_BLOBS_PER_HEAD: Final = 4


def _put_head_with_blobs(blobs: int) -> Any:
    """Steps 9 and 13 on Postgres: the checkpoint's ``blobs`` blobs and the head in one statement.

    ``WITH blobs_put AS (INSERT INTO blobs VALUES <rows> ON CONFLICT (hash)
    DO NOTHING) <the head upsert of _PUT_HEAD>``: a data-modifying CTE, so it
    applies whole or not at all, and its row count is the head upsert's (the
    revision fence of :class:`_HeadWritten` is unchanged). Blob row ``i`` binds
    ``:hash<i>``, ``:kind<i>``, ``:compression<i>`` and ``:content<i>``; a
    hash repeated among the rows, or already stored, inserts nothing (the
    blob is content-addressed).
    """

    def build(dialect: Dialect) -> Any:
        return _put_head(dialect).add_cte(_blobs_insert(dialect, blobs).cte("blobs_put"))

    return build


def _blobs_insert(dialect: Dialect, blobs: int) -> Any:
    """``blobs`` checkpoint blobs in one insert (row ``i``: ``:hash<i>``, ``:kind<i>``,
    ``:compression<i>``, ``:content<i>``); a hash already stored, or repeated,
    inserts nothing (``ON CONFLICT DO NOTHING``)."""
    rows: list[dict[str, Any]] = [
        {
            "hash": p(f"hash{i}"),
            "kind": p(f"kind{i}"),
            "compression": p(f"compression{i}"),
            "content": p(f"content{i}"),
        }
        for i in range(blobs)
    ]
    return (
        upsert(dialect, BlobRow).values(rows).on_conflict_do_nothing(index_elements=[BlobRow.hash])
    )


#: ``_PUT_HEAD_WITH_BLOBS[k]`` (Postgres only): ``k`` blobs and the head in one statement.
_PUT_HEAD_WITH_BLOBS: Final = {
    k: Statement(_put_head_with_blobs(k), name=f"sessions.put_head_with_{k}_blobs")
    for k in range(1, _BLOBS_PER_HEAD + 1)
}
_GET_TURN_COMMIT: Final = Statement(
    select(RuntimeTurnCommitRow.turn_commit_hash, RuntimeTurnCommitRow.result_json).where(
        RuntimeTurnCommitRow.session_id == p("sid"), RuntimeTurnCommitRow.turn_id == p("tid")
    ),
    name="sessions.get_turn_commit",
)
# A plain insert: a second record of the same (session, turn) is a unique violation.
_USAGE_FIELDS: Final = (
    "input_tokens",
    "output_tokens",
    "cache_read_input_tokens",
    "cache_write_input_tokens",
    "reasoning_output_tokens",
)
#: The bind names of the counters in ``_PUT_USAGE`` and ``_PUT_TOTAL``, in ``_USAGE_FIELDS`` order.
_TOTAL_PARAMS: Final = ("input", "output", "cache_read", "cache_write", "reasoning")
#: The counter columns bound to their parameters.
_COUNTER_BINDS: Final[dict[str, BindParameter[Any]]] = {
    f: p(b) for f, b in zip(_USAGE_FIELDS, _TOTAL_PARAMS, strict=True)
}
_PUT_TURN_COMMIT: Final = Statement(
    insert(RuntimeTurnCommitRow)
    .inline()
    .values(
        session_id=p("sid"),
        turn_id=p("tid"),
        turn_commit_hash=p("hash"),
        result_json=p("result"),
        checkpoint_ref=p("ref"),
        committed_at_ms=p("now"),
    ),
    name="sessions.put_turn_commit",
)
# inline(): no implicit RETURNING of the generated seq on Postgres.
_PUT_USAGE: Final = Statement(
    insert(UsageDeltaRow)
    .inline()
    .values(session_id=p("sid"), source=p("source"), model=p("model"), **_COUNTER_BINDS),
    name="sessions.put_usage",
)
#: The ledger-total columns :func:`_checked_totals` decodes: source, model,
#: ordinal, then the counters in the order of ``_USAGE_FIELDS``.
_TOTAL_COLUMNS: Final = (
    UsageTotalRow.source,
    UsageTotalRow.model,
    UsageTotalRow.ordinal,
    UsageTotalRow.input_tokens,
    UsageTotalRow.output_tokens,
    UsageTotalRow.cache_read_input_tokens,
    UsageTotalRow.cache_write_input_tokens,
    UsageTotalRow.reasoning_output_tokens,
)
_GET_TOTALS: Final = Statement(
    select(*_TOTAL_COLUMNS)
    .where(UsageTotalRow.session_id == p("sid"))
    .order_by(UsageTotalRow.ordinal),
    name="sessions.get_usage_totals",
)
#: Columns of :data:`_GET_HEAD_AND_TOTALS`: the row kind, the head, its blob, a total.
_HEAD_AT: Final = 1
_TOTAL_AT: Final = 1 + len(_HEAD_COLUMNS) + len(BLOB_COLUMNS)


def _head_and_totals(dialect: Dialect) -> Any:
    """The resume read's first statement: the head row (the head's columns, then
    its manifest blob's by an outer join, null when the blob is missing) and then
    the session's ledger totals by ordinal (as :data:`_GET_TOTALS`): one
    statement, so one snapshot.

    Each row starts with its kind: ``0`` the head (the total columns null),
    ``1`` a total (the head columns null); the head comes first. No head row:
    the session has none. The nulls take their column's type from the other
    branch (both dialects' ``UNION`` rules).
    """
    head_names = [f"h{i}" for i in range(len(_HEAD_COLUMNS) + len(BLOB_COLUMNS))]
    total_names = [f"t{i}" for i in range(len(_TOTAL_COLUMNS))]
    head: Any = (
        select(
            literal_column("0").label("kind"),
            *(c.label(n) for c, n in zip((*_HEAD_COLUMNS, *BLOB_COLUMNS), head_names, strict=True)),
            *(null().label(n) for n in total_names),
        )
        .select_from(SessionHeadRow)
        .outerjoin(BlobRow, BlobRow.hash == SessionHeadRow.checkpoint_ref)
        .where(_BY_SESSION_HEAD)
    )
    totals: Any = select(
        literal_column("1").label("kind"),
        *(null().label(n) for n in head_names),
        *(c.label(n) for c, n in zip(_TOTAL_COLUMNS, total_names, strict=True)),
    ).where(UsageTotalRow.session_id == p("sid"))
    ordinal = total_names[2]
    return head.union_all(totals).order_by(literal_column("kind"), literal_column(ordinal))


_GET_HEAD_AND_TOTALS: Final = Statement(_head_and_totals, name="sessions.get_head_and_totals")


#: Positions in the rows of :data:`_GET_FENCE_AND_HEAD`: the total columns, then the lease's.
_TOTALS_AT: Final = slice(3, 3 + len(_TOTAL_COLUMNS))
_LEASE_AT: Final = slice(3 + len(_TOTAL_COLUMNS), None)


def _fence_and_head(totals: bool) -> Any:
    """Steps 4–5, 6 and (``totals``) 10b's reads in one statement, under the lock.

    Rows by kind: ``0`` the head (``head_revision``, ``graph_node_count``) when
    the session has one; ``1`` each ledger total by ordinal
    (:data:`_TOTAL_COLUMNS`, at :data:`_TOTALS_AT`); ``2`` the lease row
    (:data:`~agentkeep.sessions.leases.LEASE_COLUMNS`, at :data:`_LEASE_AT`)
    when there is one. Every other column is null (its type from the other
    branches). One statement, so one snapshot, and one statement fewer per
    commit than the lease read followed by the head read.
    """

    def build(dialect: Dialect) -> Any:
        total_names = [f"t{i}" for i in range(len(_TOTAL_COLUMNS))]
        lease_names = [f"l{i}" for i in range(len(LEASE_COLUMNS))]

        def part(kind: int, head: Any, total: Any, lease: Any) -> list[Any]:
            return [literal_column(str(kind)).label("kind"), *head, *total, *lease]

        # Typed nulls: Postgres resolves a UNION's column types branch by branch,
        # and two untyped nulls would make a text column.
        def nulls(columns: Sequence[Any], names: Sequence[str]) -> list[Any]:
            return [cast(null(), c.type).label(n) for c, n in zip(columns, names, strict=True)]

        head_counters = (SessionHeadRow.head_revision, SessionHeadRow.graph_node_count)
        no_head = nulls(head_counters, ["h0", "h1"])
        no_totals = nulls(_TOTAL_COLUMNS, total_names)
        no_lease = nulls(LEASE_COLUMNS, lease_names)
        head: Any = select(
            *part(
                0,
                [
                    SessionHeadRow.head_revision.label("h0"),
                    SessionHeadRow.graph_node_count.label("h1"),
                ],
                no_totals,
                no_lease,
            )
        ).where(_BY_SESSION_HEAD)
        lease: Any = select(
            *part(
                2,
                no_head,
                no_totals,
                [c.label(n) for c, n in zip(LEASE_COLUMNS, lease_names, strict=True)],
            )
        ).where(SessionLeaseRow.session_id == p("sid"))
        parts = [head, lease]
        if totals:
            parts.insert(
                1,
                select(
                    *part(
                        1,
                        no_head,
                        [c.label(n) for c, n in zip(_TOTAL_COLUMNS, total_names, strict=True)],
                        no_lease,
                    )
                ).where(UsageTotalRow.session_id == p("sid")),
            )
        return union_all(*parts).order_by(literal_column("kind"), literal_column(total_names[2]))

    return build


#: ``_GET_FENCE_AND_HEAD[with_totals]``: the lease, the head and (True) the ledger totals.
_GET_FENCE_AND_HEAD: Final = {
    totals: Statement(
        _fence_and_head(totals),
        name="sessions.get_fence_head_and_totals" if totals else "sessions.get_fence_and_head",
    )
    for totals in (False, True)
}


def _put_total(dialect: Dialect) -> Any:
    """Step 10: one ``(session, source, model)`` total, inserted or replaced (under the lock)."""
    insert = upsert(dialect, UsageTotalRow).values(
        session_id=p("sid"),
        source=p("source"),
        model=p("model"),
        ordinal=p("ordinal"),
        **_COUNTER_BINDS,
    )
    new = insert.excluded
    return insert.on_conflict_do_update(
        index_elements=[UsageTotalRow.session_id, UsageTotalRow.source, UsageTotalRow.model],
        set_={name: new[name] for name in _USAGE_FIELDS},
    )


_PUT_TOTAL: Final = Statement(_put_total, name="sessions.put_usage_total")
#: The most usage deltas (and changed totals) one folded ledger statement carries.
_USAGE_PER_FOLD: Final = 4
#: The written text and binary columns of a delta row and of a blob row, with their
#: limit kinds: :func:`_check_sizes` measures them where the unfolded statements
#: were sent (the folded ones, sent later, are measured again by the driver).
_DELTA_SIZED: Final = tuple(
    (name, column_kind(typed(Column[object], UsageDeltaRow.__table__.c[name])))
    for name in ("source", "model")
)
_BLOB_SIZED: Final = (("content", column_kind(typed(Column[object], BlobRow.__table__.c.content))),)


def _check_sizes(
    db: Driver, rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, ColumnKind]]
) -> None:
    """The store's size limits on ``rows``' values of ``columns`` (``(name, kind)``).

    For a write folded into a later statement on Postgres (the usage rows into
    the totals' statement, the blobs into the head's): its values are measured
    at the step that wrote them before the fold, so the error precedence of the
    module docstring holds (an oversized blob is refused before step 10's
    overflow or step 11's duplicate node; an oversized delta before another
    delta's overflow), as on SQLite.

    Raises:
        PayloadTooLarge: a value is over its limit.
    """
    limits = db.limits
    for row in rows:
        for name, kind in columns:
            limits.check(name, kind, row[name])


def _put_usage_and_totals(deltas: int, totals: int) -> Any:
    """Step 10 on Postgres: ``deltas`` ledger rows and ``totals`` totals in one statement.

    ``WITH d AS (INSERT INTO usage_deltas VALUES <deltas rows>) INSERT INTO
    session_usage_totals VALUES <totals rows> ON CONFLICT DO UPDATE``: a
    data-modifying CTE, so the two writes are one statement (one parse, one
    pipeline entry) that applies whole or not at all. Delta row ``i`` binds
    ``:dsource<i>``, ``:dmodel<i>`` and the counters suffixed ``_d<i>``; total
    row ``j`` binds ``:tsource<j>``, ``:tmodel<j>``, ``:tordinal<j>`` and the
    counters suffixed ``_t<j>`` (all of ``:sid``). The delta rows are inserted
    in VALUES order (their ``seq`` too), as the per-delta inserts were.
    """

    def build(dialect: Dialect) -> Any:
        ledger = _deltas_insert(deltas).cte("ledger")
        put = upsert(dialect, UsageTotalRow).values(
            [
                {
                    "session_id": p("sid"),
                    "source": p(f"tsource{j}"),
                    "model": p(f"tmodel{j}"),
                    "ordinal": p(f"tordinal{j}"),
                    **_counter_binds(f"_t{j}"),
                }
                for j in range(totals)
            ]
        )
        new = put.excluded
        return put.on_conflict_do_update(
            index_elements=[UsageTotalRow.session_id, UsageTotalRow.source, UsageTotalRow.model],
            set_={name: new[name] for name in _USAGE_FIELDS},
        ).add_cte(ledger)

    return build


def _counter_binds(suffix: str) -> dict[str, Any]:
    """The counter columns bound to their parameters suffixed ``suffix`` (``:input_d0``...)."""
    return {f: p(f"{b}{suffix}") for f, b in zip(_USAGE_FIELDS, _TOTAL_PARAMS, strict=True)}


def _deltas_insert(deltas: int) -> Any:
    """``deltas`` usage rows in one insert, in order (row ``i``: ``:dsource<i>``,
    ``:dmodel<i>``, the counters suffixed ``_d<i>``; all of ``:sid``)."""
    return insert(UsageDeltaRow).values(
        [
            {
                "session_id": p("sid"),
                "source": p(f"dsource{i}"),
                "model": p(f"dmodel{i}"),
                **_counter_binds(f"_d{i}"),
            }
            for i in range(deltas)
        ]
    )


#: ``_PUT_USAGE_AND_TOTALS[m, n]`` (Postgres only): ``m`` deltas and ``n`` totals
#: (``1 <= m, n <= _USAGE_PER_FOLD``) in one statement.
_PUT_USAGE_AND_TOTALS: Final = {
    (m, n): Statement(_put_usage_and_totals(m, n), name=f"sessions.put_usage_{m}_totals_{n}")
    for m in range(1, _USAGE_PER_FOLD + 1)
    for n in range(1, _USAGE_PER_FOLD + 1)
}
#: The most nodes one insert statement carries; a longer delta takes several.
_NODES_PER_INSERT: Final = 16


def _put_nodes(rows: int) -> Any:
    """Step 11: ``rows`` nodes in one multi-row insert, returning the ids inserted.

    Row ``i`` binds ``:nid<i>``, ``:parent<i>`` and ``:json<i>`` (all of
    ``:sid``); rows are inserted in order (their ``seq`` too). A node id
    already in the session, or repeated in the statement, inserts nothing
    and returns no row (ON CONFLICT DO NOTHING).
    """

    def build(dialect: Dialect) -> Any:
        return (
            upsert(dialect, GraphNodeRow)
            .values(
                [
                    {
                        "session_id": p("sid"),
                        "node_id": p(f"nid{i}"),
                        "parent_node_id": p(f"parent{i}"),
                        "node_json": p(f"json{i}"),
                        "tombstoned": 0,
                    }
                    for i in range(rows)
                ]
            )
            .on_conflict_do_nothing(index_elements=[GraphNodeRow.session_id, GraphNodeRow.node_id])
            .returning(GraphNodeRow.node_id)
        )

    return build


#: ``_PUT_NODES[n]``: the insert of ``n`` nodes (``1 <= n <= _NODES_PER_INSERT``).
_PUT_NODES: Final = {
    n: Statement(_put_nodes(n), name=f"sessions.put_nodes_{n}")
    for n in range(1, _NODES_PER_INSERT + 1)
}


def _put_turn(nodes: int, ledger: tuple[int, int] | None, blobs: int) -> Any:
    """Steps 10, 11 and 13 on Postgres: the turn's writes in one statement.

    The folded ledger write of :func:`_put_usage_and_totals` (``ledger`` =
    ``(deltas, totals)``, or None for none), the insert of ``nodes`` nodes of
    :func:`_put_nodes` (0: none) and the head upsert of :func:`_put_head` with
    its ``blobs`` blobs (0: none), each a data-modifying CTE of one
    ``SELECT``, so the turn's writes are one statement (one round trip on
    asyncpg, one pipeline entry on psycopg) that applies whole or not at all.
    The CTEs write different tables and none reads another's rows, so
    running them on one snapshot changes nothing. The bind names are those
    of the three statements (they share ``:sid`` only).

    The one row returned: the ids the node insert inserted (an array, null
    for none) and the head's new revision (null when the revision fence
    missed); :class:`_TurnWritten` checks both, the nodes first.
    """

    def build(dialect: Dialect) -> Any:
        head = (_put_head_with_blobs(blobs)(dialect) if blobs else _put_head(dialect)).cte(
            "head_put"
        )
        columns: list[Any] = []
        ctes: list[Any] = []
        if ledger is not None:
            ctes.append(_put_usage_and_totals(*ledger)(dialect).cte("totals_put"))
        if nodes:
            put = _put_nodes(nodes)(dialect).cte("nodes_put")
            ctes.append(put)
            columns.append(select(func.array_agg(put.c.node_id)).scalar_subquery())
        else:
            columns.append(null())
        columns.append(select(head.c.head_revision).scalar_subquery())
        return select(*columns).add_cte(*ctes, head)

    return build


@functools.cache
def _turn_statement(nodes: int, ledger: tuple[int, int] | None, blobs: int) -> Statement:
    """The :func:`_put_turn` statement of one shape (Postgres), made at first use.

    ``1 <= nodes <= _NODES_PER_INSERT`` or 0, ``ledger`` a key of
    :data:`_PUT_USAGE_AND_TOTALS` or None, ``0 <= blobs <= _BLOBS_PER_HEAD``.
    """
    name = f"sessions.put_turn_{nodes}_nodes_{ledger or (0, 0)}_ledger_{blobs}_blobs"
    return Statement(_put_turn(nodes, ledger, blobs), name=name)


#: SQL constants of :func:`_checked_turn` (rendered, not bound).
_ONE: Final[Any] = literal_column("1")
_ZERO: Final[Any] = literal_column("0")
_MINUS_ONE: Final[Any] = literal_column("-1")
_MAX_I64: Final[Any] = literal_column(str(2**63 - 1))


def _checked_turn(
    nodes: int, deltas: int, pairs: int, blobs: int, stamp: bool, release: bool, new_head: bool
) -> Any:
    """A small fenced commit on Postgres as one *checking* statement (see ``_checked_commit``).

    One ``SELECT`` over the commit's writes, its data-modifying CTEs, that
    fails with ``division_by_zero`` (:data:`agentkeep.db.CHECK_FAILED_SQLSTATE`)
    unless every check of the commit passes: when it refuses, the statement
    fails and none of its writes is kept. Sent after the write locks, in its
    own statement, so in READ COMMITTED its snapshot sees every commit made
    before the locks were granted. Two checks are reads:

    * the lease row is the fence's (:func:`~agentkeep.sessions.leases.holder_fence`:
      owner, incarnation, token, generation) and expires after ``:now``
      (FENCE_OK), ``now`` sampled after the locks;
    * every ledger total of the session decodes (no negative value);

    the others are the row counts the writes return, each write going
    through a unique index (``ON CONFLICT``), so no check's cost depends on
    how large a table has grown or which plan the server caches for it:

    * the head upsert returns its row only when the stored head is at
      ``:actual`` (the commit's ``expected_head_revision``) with a node count
      from 0 to ``:max_count`` (it is then moved to ``:next``, ``:added``
      more live nodes); a missing head is inserted with a node count of -1,
      which the check refuses. With ``new_head`` (``expected_head_revision``
      0) the head is inserted (``:next``, ``:added`` nodes) and returns its
      row only when the session had none;
    * the ``pairs`` changed totals (``:tsource<j>``, ``:tmodel<j>``) are each
      increased by ``:<counter>_t<j>`` only when every counter has room for
      it (at most ``2**63-1`` minus what is added); a new pair is inserted
      with ordinal -1, which the check refuses. With ``new_head`` they are
      inserted with the ordinals 0, 1, ... (the order of the deltas), and the
      session must have no total yet;
    * the ``nodes`` node inserts (``:nid<i>``, ``:parent<i>``, ``:json<i>``)
      each return a row unless the id exists in the session;
    * (``stamp``) the turn-commit record (``:tid``, ``:stamp_hash``,
      ``:result``) returns a row unless the turn was recorded (a replay or a
      conflict).

    The other writes: the ``deltas`` usage rows (``:dsource<i>``,
    ``:dmodel<i>``, counters suffixed ``_d<i>``), the ``blobs`` checkpoint
    blobs (``ON CONFLICT DO NOTHING``) and (``release``) the fenced lease
    release of the same fence (:func:`~agentkeep.sessions.leases.release_update`;
    the lease check reads the row as it was before it, on the statement's
    snapshot). Every value but the node count and the totals is the commit's
    own, so the result is known before the statement runs. Whatever the check
    refuses (a new ledger pair, a replay, a head or fence that does not match,
    a node id that exists, a total that would overflow, a corrupt row) is
    judged by the full commit, which raises the typed error.
    """

    def build(dialect: Dialect) -> Any:
        sid: Any = p("sid")
        writes: list[Any] = []  # CTEs whose rows nobody counts
        # (CTE, the rows it must return, and whether a row counts only with n >= 0)
        counted: list[tuple[Any, int, bool]] = []

        if new_head:  # inserted, or (a head exists) refused
            moved = (
                _head_insert(dialect, p("added"))
                .on_conflict_do_nothing(index_elements=[SessionHeadRow.session_id])
                .returning(SessionHeadRow.graph_node_count.label("n"))
            )
        else:
            moved = _head_upsert(
                dialect,
                _MINUS_ONE,
                SessionHeadRow.graph_node_count + p("added"),
                SessionHeadRow.head_revision == p("actual"),
                SessionHeadRow.graph_node_count >= _ZERO,
                SessionHeadRow.graph_node_count <= p("max_count"),
            ).returning(SessionHeadRow.graph_node_count.label("n"))
        counted.append((moved.cte("head_put"), 1, True))
        if deltas:
            writes.append(_deltas_insert(deltas))
        if pairs:
            totals = upsert(dialect, UsageTotalRow).values(
                [
                    {
                        "session_id": sid,
                        "source": p(f"tsource{j}"),
                        "model": p(f"tmodel{j}"),
                        # A new session's totals take the ordinals 0, 1, ...; a later
                        # commit's new pair is inserted with -1, which the check refuses.
                        "ordinal": literal_column(str(j)) if new_head else _MINUS_ONE,
                        **_counter_binds(f"_t{j}"),
                    }
                    for j in range(pairs)
                ]
            )
        if pairs and new_head:
            put_totals = totals.on_conflict_do_nothing(
                index_elements=[UsageTotalRow.session_id, UsageTotalRow.source, UsageTotalRow.model]
            ).returning(UsageTotalRow.ordinal.label("n"))
            counted.append((put_totals.cte("totals_put"), pairs, True))
        elif pairs:
            added = totals.excluded
            stored = {f: getattr(UsageTotalRow, f) for f in _USAGE_FIELDS}
            grown = totals.on_conflict_do_update(
                index_elements=[
                    UsageTotalRow.session_id,
                    UsageTotalRow.source,
                    UsageTotalRow.model,
                ],
                set_={stored[f]: stored[f] + added[f] for f in _USAGE_FIELDS},
                # Room for what is added: total + added <= 2**63-1 (added >= 0).
                where=and_(*(stored[f] <= _MAX_I64 - added[f] for f in _USAGE_FIELDS)),
            ).returning(UsageTotalRow.ordinal.label("n"))
            counted.append((grown.cte("totals_put"), pairs, True))
        if nodes:
            counted.append((_put_nodes(nodes)(dialect).cte("nodes_put"), nodes, False))
        if blobs:
            writes.append(_blobs_insert(dialect, blobs))
        if release:
            writes.append(release_update())
        if stamp:
            record = (
                upsert(dialect, RuntimeTurnCommitRow)
                .values(
                    session_id=sid,
                    turn_id=p("tid"),
                    turn_commit_hash=p("stamp_hash"),
                    result_json=p("result"),
                    checkpoint_ref=p("ref"),
                    committed_at_ms=p("now"),
                )
                .on_conflict_do_nothing(
                    index_elements=[RuntimeTurnCommitRow.session_id, RuntimeTurnCommitRow.turn_id]
                )
                .returning(RuntimeTurnCommitRow.turn_id)
            )
            counted.append((record.cte("stamp_put"), 1, False))

        corrupt = or_(
            UsageTotalRow.ordinal < _ZERO,
            *(getattr(UsageTotalRow, name) < _ZERO for name in _USAGE_FIELDS),
        )
        checks: list[Any] = [
            select(_ONE)
            .where(*holder_fence(), SessionLeaseRow.lease_expires_at_ms > p("now"))
            .exists(),
            # A new session has no totals yet; a stored one none that does not decode.
            ~select(_ONE)
            .where(UsageTotalRow.session_id == sid, *(() if new_head else (corrupt,)))
            .exists(),
        ]
        for cte, rows, signed in counted:
            # A head or total inserted (n = -1) is not a row that counts.
            got = select(func.count()).select_from(cte)
            if signed:
                got = got.where(cte.c.n >= _ZERO)
            checks.append(got.scalar_subquery() == literal_column(str(int(rows))))
        check = select((_ONE / case((and_(*checks), _ONE), else_=_ZERO)).label("ok"))
        return check.add_cte(
            *(cte for cte, _, _ in counted), *(w.cte(f"w{i}") for i, w in enumerate(writes))
        )

    return build


@functools.cache
def _checked_turn_statement(
    nodes: int, deltas: int, pairs: int, blobs: int, stamp: bool, release: bool, new_head: bool
) -> Statement:
    """The :func:`_checked_turn` statement of one shape, made at first use."""
    name = (
        f"sessions.checked_turn_{nodes}n_{deltas}d_{pairs}p_{blobs}b"
        f"_{int(stamp)}s_{int(release)}r_{int(new_head)}h"
    )
    return Statement(
        _checked_turn(nodes, deltas, pairs, blobs, stamp, release, new_head), name=name
    )


_DELETE_NODES: Final = Statement(
    delete(GraphNodeRow).where(GraphNodeRow.session_id == p("sid")), name="sessions.delete_nodes"
)
#: The node columns the graph reads decode: seq, node id, node JSON.
_NODE_COLUMNS: Final = (GraphNodeRow.seq, GraphNodeRow.node_id, GraphNodeRow.node_json)
_LIVE_NODE_OF_SESSION = (GraphNodeRow.session_id == p("sid"), GraphNodeRow.tombstoned == 0)
_FULL_GRAPH: Final = Statement(
    select(*_NODE_COLUMNS).where(*_LIVE_NODE_OF_SESSION).order_by(GraphNodeRow.seq),
    name="sessions.full_graph",
)
_GET_NODE: Final = Statement(
    select(*_NODE_COLUMNS).where(
        GraphNodeRow.session_id == p("sid"),
        GraphNodeRow.node_id == p("nid"),
        GraphNodeRow.tombstoned == 0,
    ),
    name="sessions.get_node",
)


def _path_walk(dialect: Dialect, *, bounded: bool, leaf: Any = None) -> Any:
    """The recursive walk from ``:leaf`` up the parents; ``bounded``: at most ``:n`` rows.

    ``leaf``: the expression of the walk's first node id instead of ``:leaf``
    (the head's leaf, for :data:`_GET_HEAD_TOTALS_AND_TAIL`).

    The bounded walk (the tail) must cost ``:n`` lookups whatever the
    session's size, under any plan Postgres may keep for it. On Postgres its
    step is a ``LATERAL`` subquery with ``LIMIT 1``: the parent lookup runs
    once per walked row, so the plans left are a lookup per step (the unique
    ``(session_id, node_id)`` index) or a scan per step, and the planner
    takes the index once the table holds more than a few pages. With a plain
    join the planner may put the session's nodes on the outer side of the
    nested loop (a scan of the whole session at every step) whenever it
    expects few rows for the session: a never-analyzed table estimates one,
    and psycopg's prepared statement keeps the generic plan Postgres made
    then while the session grows (a 32-node tail planned on a 3-node session
    cost 54 ms at 3,000 nodes and 615 ms at 30,000; 0.3 ms with ``LATERAL``
    at both). Its live-node check is ``tombstoned + 0 = 0``, an expression no
    index serves, so the ``(session_id, tombstoned, seq)`` index matches the
    session column only and never looks better than the unique index.

    The whole-path walk keeps the plain join and ``tombstoned = 0``: its cost
    is the path's length anyway, and the plan Postgres keeps for it hashes
    the session's live nodes once (one index range scan) and probes the hash
    at every step, faster than a lookup per step (9,000 nodes: 55 against
    80 ms). SQLite has no ``LATERAL``; its planner runs the recursive step
    with the work queue outside and the unique index inside.

    A cycle of parent ids (corrupt data) would make the bounded walk go round
    it until ``:n`` rows (``2**63-1`` at most). Each row of it carries a
    *mark* (Brent's cycle detection): the node id at the last power-of-two
    depth below the row's, NULL on the first row. A row whose node id is its
    mark is not walked on: the walk ends there, having read the whole cycle,
    which the caller's ordering walk (:func:`_ordered_path`) reports as
    ``SessionCorrupt``. With the cycle entered after ``m`` rows and ``k``
    long, the mark sits on the cycle once the depth passes ``max(m, k)``
    rounded up to a power of two, so the walk ends within ``3 * (m + k)``
    rows. A path without a cycle never meets its mark (its ids are
    distinct), so its rows are unchanged; the cost is one more column per row.
    """
    nodes = aliased(GraphNodeRow, name="g")

    def live(table: Any) -> Any:
        return table.tombstoned + 0 == 0 if bounded else table.tombstoned == 0

    walked = (GraphNodeRow.seq, GraphNodeRow.node_id, GraphNodeRow.parent_node_id)
    # The bounded walk's depth, and its mark (Brent's cycle check): the node id
    # at the last power-of-two depth below the row's (NULL on the first row).
    depth = (
        (cast(literal(1, BIGINT), BIGINT).label("depth"), cast(null(), Text).label("mark"))
        if bounded
        else ()
    )
    path = (
        select(*walked, GraphNodeRow.node_json, *depth)
        .where(
            GraphNodeRow.session_id == p("sid"),
            GraphNodeRow.node_id == (p("leaf") if leaf is None else leaf),
            live(GraphNodeRow),
        )
        .cte("tail" if bounded else "path", recursive=True)
    )
    parent_of = and_(nodes.session_id == p("sid"), nodes.node_id == path.c.parent_node_id)
    columns = (nodes.seq, nodes.node_id, nodes.parent_node_id, nodes.node_json)
    next_depth: tuple[Any, ...] = ()
    if bounded:
        power_of_two = path.c.depth.op("&")(path.c.depth - 1) == 0
        next_depth = (
            cast(path.c.depth + 1, BIGINT),
            cast(case((power_of_two, path.c.node_id), else_=path.c.mark), Text),
        )
    if bounded and dialect.name == "postgresql":
        parent = (
            select(*columns).where(parent_of, live(nodes)).limit(literal_column("1")).lateral("g")
        )
        step = select(*parent.c, *next_depth).select_from(path.join(parent, true()))
    else:
        step = (
            select(*columns, *next_depth)
            .select_from(path.join(nodes, parent_of))
            .where(live(nodes))
        )
    if bounded:
        # A row whose node is its mark met that node before (a cycle): the walk
        # ends there, having read the whole cycle, so the caller's ordering walk
        # reports it. Without the mark a cycle would be walked ``:n`` times.
        path = path.union_all(
            step.where(
                path.c.depth < p("n", type_=BIGINT),
                path.c.node_id.is_distinct_from(path.c.mark),
            )
        )
    else:
        path = path.union(step)
    return select(path.c.seq, path.c.node_id, path.c.parent_node_id, path.c.node_json)


#: The active-path walk (docs/sessions.md#load_session): from ``:leaf`` up
#: through ``parent_node_id`` across live nodes of ``:sid``. Every step is a
#: lookup on the unique index ``(session_id, node_id)`` (SQLite) or a probe of
#: a hash of the session's live nodes (the plan Postgres keeps: see
#: :func:`_path_walk`); ``UNION`` (not ``UNION ALL``) ends a cycle. The rows
#: (seq, node id, parent id, node JSON) come unordered; the caller orders them
#: by following the parents.
ACTIVE_PATH: Final = Statement(
    lambda dialect: _path_walk(dialect, bounded=False), name="sessions.active_path"
)


#: The last ``:n`` (``>= 1``) nodes of the active path: the walk of
#: :data:`ACTIVE_PATH` with a depth counter that stops it after ``:n`` rows,
#: so it costs ``:n`` index lookups however long the path is (on Postgres each
#: a ``LATERAL`` subquery: see :func:`_path_walk`). ``UNION ALL``
#: (the depth makes every row distinct); a cycle shorter than ``:n`` repeats
#: node ids, which the caller's ordering walk reports as corrupt. The walk
#: ends once it met a node twice (its mark, :func:`_path_walk`): a cycle is
#: read once, not ``:n`` times.
ACTIVE_PATH_TAIL: Final = Statement(
    lambda dialect: _path_walk(dialect, bounded=True), name="sessions.active_path_tail"
)


def _head_totals_and_tail(dialect: Dialect) -> Any:
    """The one-call ``ActivePathScope(tail=N)`` read (head's leaf) in one statement.

    The rows of :data:`_GET_HEAD_AND_TOTALS` (kind ``0`` the head with its
    manifest blob, ``1`` the totals), and, of kind ``2``, the rows of
    :data:`ACTIVE_PATH_TAIL` walked from the head's leaf (its last four
    columns: seq, node id, parent id, node JSON; null elsewhere), in no
    order: the caller sorts the totals by ordinal. One
    statement: one snapshot, so no transaction is needed around it. The
    nulls of the node columns are typed (three branches: Postgres resolves an
    untyped null of the first two as text).
    """
    head_leaf = select(SessionHeadRow.leaf_node_id).where(_BY_SESSION_HEAD).scalar_subquery()
    walk = _path_walk(dialect, bounded=True, leaf=head_leaf).subquery("walk")
    node_names = ["n0", "n1", "n2", "n3"]
    node_nulls = [
        cast(null(), column.type).label(name)
        for column, name in zip(
            (
                GraphNodeRow.seq,
                GraphNodeRow.node_id,
                GraphNodeRow.parent_node_id,
                GraphNodeRow.node_json,
            ),
            node_names,
            strict=True,
        )
    ]
    first = _head_and_totals(dialect)
    head, totals = first.selects  # the head and the totals SELECTs
    other = len(first.selected_columns) - 1
    nodes: Any = select(
        literal_column("2").label("kind"),
        *(null().label(f"x{i}") for i in range(other)),
        *(walk.c[i].label(n) for i, n in enumerate(node_names)),
    )
    # No ORDER BY: sorting would copy the node rows (their JSON) through a temp
    # B-tree; the caller tells the rows apart by kind and orders the totals.
    return head.add_columns(*node_nulls).union_all(totals.add_columns(*node_nulls), nodes)


#: The one-call ``load_session(sid, ActivePathScope(tail=N))`` (the head's leaf) in
#: one statement: :func:`_head_totals_and_tail`. Parameters ``:sid`` and ``:n``.
_GET_HEAD_TOTALS_AND_TAIL: Final = Statement(
    _head_totals_and_tail, name="sessions.get_head_totals_and_tail"
)


def _ordinal_key(total: Sequence[Any]) -> tuple[int, Any]:
    """Sort key of a total row by its ordinal (a non-integer one last, as read)."""
    ordinal = total[2]
    return (0, ordinal) if type(ordinal) is int else (1, 0)


#: Columns of :data:`_GET_HEAD_TOTALS_AND_TAIL`'s node rows.
_NODE_AT: Final = _TOTAL_AT + len(_TOTAL_COLUMNS)
_PENDING_ACTIVE: Final = Statement(
    select(PendingTurnInputRow.input_id, PendingTurnInputRow.ingress_json)
    .where(
        PendingTurnInputRow.session_id == p("sid"),
        PendingTurnInputRow.state == "pending_active",
    )
    .order_by(PendingTurnInputRow.enqueue_seq),
    name="sessions.pending_active_inputs",
)
# Step 16: the input moves to the next turn with its claim cleared (the claim
# fencing token is kept: it only grows).
_DEFER: Final = Statement(
    update(PendingTurnInputRow)
    .values(
        state="deferred_next_turn",
        ingress_json=p("ingress"),
        claim_id=null(),
        claim_owner_id=null(),
        claim_owner_incarnation_id=null(),
        claim_owner_liveness_json=null(),
        claim_token=null(),
        claim_session_lease_generation=0,
    )
    .where(
        PendingTurnInputRow.session_id == p("sid"),
        PendingTurnInputRow.input_id == p("iid"),
        PendingTurnInputRow.state == "pending_active",
    ),
    name="sessions.defer_input",
)
_COMMIT_ATTACHMENT: Final = Statement(
    update(AttachmentManifestRow)
    .values(
        committed_at_ms=func.coalesce(AttachmentManifestRow.committed_at_ms, p("now", type_=BIGINT))
    )
    .where(
        AttachmentManifestRow.session_id == p("sid"),
        AttachmentManifestRow.attachment_id == p("aid"),
    ),
    name="sessions.commit_attachment",
)


def _put_meta(dialect: Dialect) -> Any:
    insert = upsert(dialect, SessionMetaRow).values(
        session_id=p("sid"),
        session_name=p("name"),
        created_at=p("created_at"),
        model=p("model"),
        cwd=p("cwd"),
        relation_json=p("relation"),
    )
    new = insert.excluded
    return insert.on_conflict_do_update(
        index_elements=[SessionMetaRow.session_id],
        set_={
            SessionMetaRow.session_name: new.session_name,
            SessionMetaRow.created_at: new.created_at,
            SessionMetaRow.model: new.model,
            SessionMetaRow.cwd: new.cwd,
            SessionMetaRow.relation_json: new.relation_json,
        },
    )


_PUT_META: Final = Statement(_put_meta, name="sessions.put_meta")
#: The metadata columns :meth:`SessionCommitRepository.load_session_meta` decodes.
_META_COLUMNS: Final = (
    SessionMetaRow.session_name,
    SessionMetaRow.created_at,
    SessionMetaRow.model,
    SessionMetaRow.cwd,
    SessionMetaRow.relation_json,
)
_GET_META: Final = Statement(
    select(*_META_COLUMNS).where(SessionMetaRow.session_id == p("sid")), name="sessions.get_meta"
)

_NEXT_TURN_INGRESS: Final = encode_ingress(NextTurnIngress())
_DEFAULT_SCOPE: Final = FullGraphScope()
_HEAD_SCOPE: Final = HeadScope()


class _NeedsSnapshot:
    """The type of :data:`NEEDS_SNAPSHOT`."""

    __slots__ = ()


#: What :meth:`SessionCommitRepository._load_head_alone` returns when the read needs
#: more than its one statement (component blobs): read again in a snapshot.
NEEDS_SNAPSHOT: Final = _NeedsSnapshot()


def _has_components(manifest: CheckpointManifest) -> bool:
    """True when hydrating ``manifest`` reads component blobs (more statements)."""
    return (
        manifest.tool_state_ref is not None
        or manifest.plugin_snapshot_ref is not None
        or manifest.execution_state_ref is not None
    )


_INGRESS: Final = TypeAdapter(TurnInputIngress)

# Rows already warned about (log once per row: docs/decisions.md#corrupt-data-fails-loudly),
# bounded.
_warned: set[tuple[str, str, str]] = set()
_WARN_CAP: Final = 10_000


def _warn_once(table: str, session_id: str, key: str, detail: str) -> None:
    marker = (table, session_id, key)
    if marker in _warned:
        return
    if len(_warned) < _WARN_CAP:
        _warned.add(marker)
    log.warning("skipping undecodable %s row %r of session %r: %s", table, key, session_id, detail)


# --------------------------------------------------------------------------
# Errors and pure helpers


def merge_token_ledger(
    deltas: Sequence[UsageLedgerEntry], *, session_id: str = ""
) -> tuple[UsageLedgerEntry, ...]:
    """Merge usage deltas into a ledger (docs/sessions.md#usage-ledger).

    Entries whose ``usage.total()`` is 0 are skipped (reasoning tokens are not
    in the total, so a reasoning-only entry is dropped); the others are summed
    per ``(source, model)``, in order of first appearance.

    Raises:
        SessionCorrupt: a merged counter exceeds ``2**63-1``.
    """
    sums: dict[tuple[str, str], list[int]] = {}
    overflow = _accumulate(sums, deltas)
    if overflow is not None:
        raise SessionCorrupt(
            "usage_deltas", session_id, overflow[2], "merged ledger counter exceeds 2**63-1"
        )
    return tuple(
        UsageLedgerEntry(
            source=source,
            model=model,
            usage=TokenUsage(**dict(zip(_USAGE_FIELDS, counters, strict=True))),
        )
        for (source, model), counters in sums.items()
    )


def _accumulate(
    sums: dict[tuple[str, str], list[int]], deltas: Sequence[UsageLedgerEntry | UsageDelta]
) -> tuple[str, str, str] | None:
    """Add ``deltas`` into ``sums`` per ``(source, model)``, as the ledger merges them.

    Entries whose ``usage.total()`` is 0 are skipped. Returns ``(source,
    model, counter)`` of the first counter that passes ``2**63-1`` (adding
    stops there), else None.
    """
    for entry in deltas:
        if entry.usage.total() == 0:
            continue
        counters = sums.setdefault((entry.source, entry.model), [0] * len(_USAGE_FIELDS))
        for i, name in enumerate(_USAGE_FIELDS):
            counters[i] += getattr(entry.usage, name)
            if counters[i] > MAX_I64:
                return entry.source, entry.model, name
    return None


def _json_text(value: Any, field: str) -> str:
    try:
        return canonical_json(value)
    except ValueError as exc:
        raise InvalidInput(field, str(exc)) from None


def _optional_id(value: object, field: str) -> str | None:
    return None if value is None else check_id(value, field)


def _node_text(stored: dict[str, Any], i: int) -> str:
    """The canonical JSON of node ``i`` of a delta (``stored``: its four fields).

    The payload is checked as a JSON value (:class:`InvalidInput` naming
    ``commit.graph.nodes[i].payload``), then the node is encoded. The common
    case walks the payload once: checked where it sits in the node (one
    level down), with ASCII ids and an ``int`` timestamp, nothing else in the
    node can fail ``canonical_json``'s walk, so the text is encoded without
    it. Any other case (a problem found, a non-ASCII id) takes the two
    steps one by one, which raise the error they always did.
    """
    field = f"commit.graph.nodes[{i}].payload"
    node_id, parent, payload = stored["node_id"], stored["parent_node_id"], stored["payload"]
    if (
        json_value_problem(payload, 1) is None
        and node_id.isascii()
        and (parent is None or parent.isascii())
        and type(stored["timestamp"]) is int
    ):
        try:
            return canonical_json_checked(stored)
        except ValueError:
            pass  # an integer past the digit limit: the two steps raise its error
    check_json(payload, field)
    return _json_text(stored, field)


class _Prepared:
    """A commit's arguments, checked and encoded before the lock is taken."""

    __slots__ = ("agent_frames_json", "config_json", "leaf", "nodes", "replace")

    def __init__(self, commit: RuntimeCommit) -> None:
        sid = commit.session_id
        check_id(sid, "commit.session_id")
        self.config_json = _json_text(commit.config, "commit.config")
        self.agent_frames_json = _json_text(list(commit.agent_frames), "commit.agent_frames")
        _optional_id(commit.current_agent_frame_id, "commit.current_agent_frame_id")
        for name in ("session_execution_lease", "release_session_execution_lease"):
            fence = getattr(commit, name)
            if fence is not None:
                if not isinstance(fence, LeaseFence):
                    raise InvalidInput(f"commit.{name}", "expected a LeaseFence")
                check_id(fence.session_id, f"commit.{name}.session_id")
        stamp = commit.turn_commit
        if stamp is not None:
            check_id(stamp.session_id, "commit.turn_commit.session_id")
            check_id(stamp.turn_id, "commit.turn_commit.turn_id")
            check_id(stamp.turn_commit_hash, "commit.turn_commit.turn_commit_hash")
        cp = commit.checkpoint
        for name in ("turn_state", "tool_state", "plugin_snapshot", "execution_state"):
            check_json(getattr(cp, name), f"commit.checkpoint.{name}")
        for name in ("tool_state_ref", "plugin_snapshot_ref", "execution_state_ref"):
            _optional_id(getattr(cp, name), f"commit.checkpoint.{name}")
        for i, delta in enumerate(commit.usage_deltas):
            check_id(delta.source, f"commit.usage_deltas[{i}].source")
            check_id(delta.model, f"commit.usage_deltas[{i}].model")
        for queue_completion in commit.completed_queue_claims:
            _check_queue_completion(queue_completion)
        for input_completion in commit.completed_turn_input_claims:
            _check_turn_input_completion(input_completion)
        for draft in commit.enqueued_queue_batches:
            _check_draft(draft)
        _optional_id(commit.interrupted_turn_input_turn_id, "commit.interrupted_turn_input_turn_id")
        for i, attachment_id in enumerate(commit.committed_attachment_ids):
            check_id(attachment_id, f"commit.committed_attachment_ids[{i}]")

        graph = commit.graph
        nodes: Sequence[SessionNodeRecord]
        if isinstance(graph, UnchangedGraph):
            nodes, self.leaf, self.replace = (), graph.leaf_node_id, False
        elif isinstance(graph, AppendNodes):
            nodes, self.leaf, self.replace = graph.nodes, graph.leaf_node_id, False
        elif isinstance(graph, ReplaceFullGraph):
            nodes, self.leaf, self.replace = graph.graph.nodes, graph.graph.leaf_node_id, True
        else:
            raise InvalidInput("commit.graph", f"unknown graph delta {type(graph).__name__}")
        _optional_id(self.leaf, "commit.graph.leaf_node_id")
        self.nodes: list[tuple[str, str | None, str]] = []
        for i, node in enumerate(nodes):
            node_id, parent, timestamp = node.node_id, node.parent_node_id, node.timestamp
            check_id(node_id, f"commit.graph.nodes[{i}].node_id")
            _optional_id(parent, f"commit.graph.nodes[{i}].parent_node_id")
            # The fields model_dump(mode="json") gives, without its serializer: a
            # checked payload encodes to the same canonical text.
            stored = {
                "node_id": node_id,
                "parent_node_id": parent,
                "timestamp": timestamp,
                "payload": node.payload,
            }
            self.nodes.append((node_id, parent, _node_text(stored, i)))


def _decode_node(
    session_id: str, seq: object, node_id: object, raw: object
) -> SessionNodeRecord | None:
    """A stored node, or None (logged once) when its JSON does not decode.

    See docs/sessions.md#load_session and docs/decisions.md#corrupt-data-fails-loudly.
    """
    try:
        if not isinstance(raw, str):
            raise TypeError(f"{type(raw).__name__} instead of text")
        return _stored_node(loads(raw), node_id)
    except (ValueError, TypeError) as exc:
        _warn_once("graph_nodes", session_id, f"{node_id} (seq {seq})", str(exc))
        return None


def _counters(usage: TokenUsage) -> tuple[int, ...]:
    return tuple(getattr(usage, name) for name in _USAGE_FIELDS)


def _checked_totals(
    session_id: str, rows: Sequence[Sequence[Any]]
) -> list[tuple[str, str, list[Any]]]:
    """The ledger totals of ``rows`` (:data:`_TOTAL_COLUMNS` each, by ordinal), as
    ``(source, model, [ordinal, *counters])``.

    Raises:
        SessionCorrupt: a stored total does not decode.
    """
    out = []
    for row in rows:
        source, model, *numbers = row
        key = f"{session_id}/{source}/{model}"
        for column, value in (("source", source), ("model", model)):
            if type(value) is not str:
                raise SessionCorrupt("session_usage_totals", key, column, repr(value))
        for column, value in zip(("ordinal", *_USAGE_FIELDS), numbers, strict=True):
            if type(value) is not int or not 0 <= value <= MAX_I64:
                raise SessionCorrupt("session_usage_totals", key, column, repr(value))
        out.append((source, model, numbers))
    return out


def _ledger(session_id: str, rows: Sequence[Sequence[Any]]) -> tuple[UsageLedgerEntry, ...]:
    """The session's ledger from its total rows read by ordinal (:func:`_checked_totals`).

    Raises:
        SessionCorrupt: a stored total does not decode.
    """
    return tuple(
        _LEDGER_ENTRY(
            source=source,
            model=model,
            usage=_TOKEN_USAGE(**dict(zip(_USAGE_FIELDS, numbers[1:], strict=True))),
        )
        for source, model, numbers in _checked_totals(session_id, rows)
    )


# Builders of read records from checked values (records.checked_builder).
_TOKEN_USAGE: Final = checked_builder(TokenUsage, dict.fromkeys(_USAGE_FIELDS, 1))
_LEDGER_ENTRY: Final = checked_builder(
    UsageLedgerEntry, {"source": "s", "model": "m", "usage": TokenUsage()}
)
_GRAPH: Final = checked_builder(SessionGraph, {"nodes": (), "leaf_node_id": "n"})
_RESULT: Final = checked_builder(
    RuntimeCommitResult,
    {
        "head_revision": 1,
        "checkpoint_ref": "r",
        "manifest": CheckpointManifest(schema_version=1, turn_state={"t": [1]}),
        "enqueued_queue_batches": (),
    },
)
_READ: Final = checked_builder(
    PersistedSessionRead,
    {
        "session_id": "s",
        "head_revision": 1,
        "config": {"k": [1]},
        "agent_frames": ({"f": 1},),
        "current_agent_frame_id": "f",
        "graph": SessionGraph(),
        "checkpoint_ref": "r",
        "checkpoint": HydratedSessionCheckpoint(turn_state={"t": 1}),
        "token_ledger": (),
    },
)


_NODE_FIELDS: Final = frozenset(SessionNodeRecord.model_fields)


def _stored_node(data: object, node_id: object) -> SessionNodeRecord:
    """A decoded ``node_json`` as a node, without pydantic validation of its payload.

    The row was validated and canonically encoded by the commit, and its
    payload is the JSON value the strict decoder returned, which is what
    validation would keep; so only the structure is checked, the checks
    ``SessionNodeRecord`` validation would make: an object of known fields,
    ``node_id`` the row's, ``parent_node_id`` text or null, ``timestamp`` an
    integer in ``0..2**63-1``.

    Raises:
        TypeError, ValueError: the structure is not a node's.
    """
    if type(data) is not dict:
        raise TypeError(f"node_json is {type(data).__name__}, not an object")
    if not data.keys() <= _NODE_FIELDS:
        raise ValueError(f"node_json has unknown fields {sorted(data.keys() - _NODE_FIELDS)}")
    stored_id = data.get("node_id")
    if type(stored_id) is not str or stored_id != node_id:
        raise ValueError(f"node_json names node {stored_id!r}")
    parent = data.get("parent_node_id")
    if parent is not None and type(parent) is not str:
        raise TypeError(f"parent_node_id is {type(parent).__name__}, not text")
    timestamp = data.get("timestamp", 0)
    if type(timestamp) is not int or not 0 <= timestamp <= MAX_I64:
        raise ValueError(f"timestamp {timestamp!r} is not an integer in 0..2**63-1")
    return _build_node(stored_id, parent, timestamp, data.get("payload"))


def _construct_node(
    node_id: str, parent: str | None, timestamp: int, payload: Any
) -> SessionNodeRecord:
    return SessionNodeRecord.model_construct(
        node_id=node_id, parent_node_id=parent, timestamp=timestamp, payload=payload
    )


def _fill_node(node_id: str, parent: str | None, timestamp: int, payload: Any) -> SessionNodeRecord:
    """What ``model_construct`` builds, without its per-field loop (a third of a load's time)."""
    node = new_record(SessionNodeRecord)
    set_dict(
        node,
        {"node_id": node_id, "parent_node_id": parent, "timestamp": timestamp, "payload": payload},
    )
    set_fields_set(node, set(_NODE_FIELDS))
    set_extra(node, None)
    set_private(node, None)
    return node


def _node_builder() -> Callable[[str, str | None, int, Any], SessionNodeRecord]:
    """:func:`_fill_node` if it builds what ``model_construct`` does (this pydantic), else that."""
    probe = ("n", "p", 1, {"k": [1]})
    fast, slow = _fill_node(*probe), _construct_node(*probe)
    same = (
        fast == slow
        and fast.__dict__ == slow.__dict__
        and fast.model_fields_set == slow.model_fields_set
        and fast.__pydantic_extra__ == slow.__pydantic_extra__
        and fast.__pydantic_private__ == slow.__pydantic_private__
        and fast.model_dump() == slow.model_dump()
    )
    return _fill_node if same else _construct_node


#: Builds a node from checked stored values.
_build_node: Final = _node_builder()


def _check_count(sid: str, value: object) -> int:
    if type(value) is not int or value < 0:
        raise SessionCorrupt("session_head", sid, "graph_node_count", repr(value))
    return value


def _check_revision(session_id: str, value: object) -> int:
    if type(value) is not int or not 0 <= value <= MAX_I64:
        raise SessionCorrupt("session_head", session_id, "head_revision", repr(value))
    return value


def _fence_reads(commit: RuntimeCommit) -> list[tuple[Statement, dict[str, Any]]]:
    """The reads of steps 3, 4–5, 6 and 10b, for :meth:`Driver.prefetching`.

    They go out with the write lock (one round trip on psycopg). None of the
    commit's writes before them touches what they read (step 10b's totals
    are read after the blob and usage-delta inserts, which do not change them).
    """
    sid = commit.session_id
    reads: list[tuple[Statement, dict[str, Any]]] = []
    stamp = commit.turn_commit
    if stamp is not None and stamp.session_id == sid:
        reads.append((_GET_TURN_COMMIT, {"sid": sid, "tid": stamp.turn_id}))
    fence = commit.session_execution_lease
    if fence is not None and fence.session_id == sid:
        reads.append((_head_read(commit), {"sid": sid}))
    return reads


def _head_read(commit: RuntimeCommit) -> Statement:
    """Steps 4–6's read: the lease row and the head's counters, with the ledger totals
    (step 10b) when the commit has usage deltas (one statement instead of three)."""
    return _GET_FENCE_AND_HEAD[bool(commit.usage_deltas)]


def _ordered_path(
    session_id: str, leaf: str, rows: Sequence[Sequence[Any]]
) -> list[SessionNodeRecord]:
    """The path (or tail) rows ``(seq, node id, parent id, node JSON)`` root-first,
    ordered by following the parents from ``leaf``; undecodable nodes skipped.

    Raises:
        SessionCorrupt: a parent-id cycle among the rows.
    """
    by_id = {r[1]: r for r in rows}
    walked = []
    seen: set[str] = set()
    current: str | None = leaf
    while current is not None and current in by_id:
        if current in seen:
            raise SessionCorrupt(
                "graph_nodes", f"{session_id}/{current}", "parent_node_id", "parent id cycle"
            )
        seen.add(current)
        walked.append(by_id[current])
        current = by_id[current][2]
    walked.reverse()
    return [
        node
        for seq, node_id, _, raw in walked
        if (node := _decode_node(session_id, seq, node_id, raw)) is not None
    ]


class _NodesInserted:
    """Step 11's check of a node insert: an id not returned is :class:`NodeAlreadyExists`.

    The ids are checked in the delta's order, so the error names the first
    node that inserted nothing (a repeated id: its second occurrence).
    """

    __slots__ = ("node_ids", "session_id")

    def __init__(self, session_id: str, node_ids: list[str]) -> None:
        self.session_id, self.node_ids = session_id, node_ids

    def __call__(self, result: Any) -> None:
        self.inserted([row[0] for row in result.fetchall()])

    def inserted(self, ids: Sequence[str]) -> None:
        """Raise :class:`NodeAlreadyExists` unless ``ids`` (the ids inserted) has every node."""
        inserted = Counter(ids)
        for node_id in self.node_ids:
            if inserted[node_id] == 0:
                raise NodeAlreadyExists(self.session_id, node_id)
            inserted[node_id] -= 1


def _head_moved(session_id: str) -> ConcurrentModification:
    """Step 13's fence missed: the head was not at the revision read under the lock."""
    return ConcurrentModification(f"session {session_id}: head changed under the write lock")


class _HeadWritten:
    """Step 13's check of the fenced head upsert: no row is :class:`ConcurrentModification`."""

    __slots__ = ("session_id",)

    def __init__(self, session_id: str) -> None:
        self.session_id = session_id

    def __call__(self, result: Any) -> None:
        if result.fetchone() is None:
            raise _head_moved(self.session_id)


class _TurnWritten:
    """The checks of :func:`_put_turn`'s row: the nodes', then the head's.

    The node check is :class:`_NodesInserted`'s (``nodes`` None: the
    statement inserted none); a null revision is the head fence's miss,
    :class:`~agentkeep.errors.ConcurrentModification`, as
    :class:`_HeadWritten` reports it.
    """

    __slots__ = ("nodes", "session_id")

    def __init__(self, session_id: str, nodes: _NodesInserted | None) -> None:
        self.session_id, self.nodes = session_id, nodes

    def __call__(self, result: Any) -> None:
        ids, revision = result.fetchone()
        if self.nodes is not None:
            self.nodes.inserted(ids or ())
        if revision is None:
            raise _head_moved(self.session_id)


def _same_fence(release: LeaseFence | None, fence: LeaseFence) -> bool:
    """True when ``release`` is None or binds what ``fence`` binds (:func:`holder_fence`)."""
    return release is None or (
        release.session_id == fence.session_id
        and same_incarnation(release.owner, fence.owner)
        and release.lease_token == fence.lease_token
        and release.fencing_token == fence.fencing_token
    )


class _CheckedTurn:
    """A commit that fits :func:`_checked_turn`: its statement, parameters and result.

    :meth:`of` builds it before the locks, from the commit alone, or returns
    None for a commit the statement does not cover; the caller adds ``now``
    after the locks.
    """

    __slots__ = ("params", "result", "session_id", "statement")

    def __init__(
        self, session_id: str, statement: Statement, params: dict[str, Any], result: Any
    ) -> None:
        self.session_id, self.statement, self.params = session_id, statement, params
        self.result: RuntimeCommitResult = result

    @classmethod
    def of(
        cls, db: Driver, commit: RuntimeCommit, prepared: _Prepared, profile: BlobProfile
    ) -> _CheckedTurn | None:
        """The checked form of ``commit``, or None where the full commit must run.

        Covered: a fenced commit with an ``expected_head_revision`` (0: the
        session's first, which inserts the head and the ledger totals),
        appending at most ``_NODES_PER_INSERT`` distinct
        nodes (or none), with at most ``_USAGE_PER_FOLD`` usage deltas, with
        or without a turn-commit stamp, and nothing else: no completed
        claims, no enqueued work, no interrupted turn, no attachments, and
        a lease release only of the commit's own fence. Its values must be
        within the store's limits (else the full commit raises, in its order
        of errors).
        """
        sid = commit.session_id
        fence = commit.session_execution_lease
        expected = commit.expected_head_revision
        stamp = commit.turn_commit
        nodes = prepared.nodes
        deltas = commit.usage_deltas
        if (
            fence is None
            or fence.session_id != sid
            or expected is None
            or not 0 <= expected < MAX_I64
            or prepared.replace
            or len(nodes) > _NODES_PER_INSERT
            or len(deltas) > _USAGE_PER_FOLD
            or (stamp is not None and stamp.session_id != sid)
            or commit.completed_queue_claims
            or commit.completed_turn_input_claims
            or commit.enqueued_queue_batches
            or commit.interrupted_turn_input_turn_id is not None
            or commit.committed_attachment_ids
            or not _same_fence(commit.release_session_execution_lease, fence)
            or len({node_id for node_id, _, _ in nodes}) != len(nodes)
        ):
            return None
        added: dict[tuple[str, str], list[int]] = {}
        for delta in deltas:
            if delta.usage.total():
                row = added.setdefault((delta.source, delta.model), [0] * len(_USAGE_FIELDS))
                for j, value in enumerate(_counters(delta.usage)):
                    row[j] += value
        if any(value > MAX_I64 for row in added.values() for value in row):
            return None
        owner = fence.owner
        params: dict[str, Any] = {
            "sid": sid,
            "owner": owner.owner_id,
            "inc": owner.incarnation_id,
            "token": fence.lease_token,
            "fencing": fence.fencing_token,
            "actual": expected,
            "next": expected + 1,
            "max_count": MAX_I64 - len(nodes),
            "added": len(nodes),
            "schema": HEAD_SCHEMA_VERSION,
            "leaf": prepared.leaf,
            "config": prepared.config_json,
            "frames": prepared.agent_frames_json,
            "frame_id": commit.current_agent_frame_id,
            "now": 0,  # sampled after the locks (_checked_commit)
        }
        blobs: list[dict[str, Any]] = []
        ref, manifest = put_checkpoint(db, commit.checkpoint, profile, into=blobs)
        if len(blobs) > _BLOBS_PER_HEAD:
            return None
        params["ref"] = ref
        for i, blob in enumerate(blobs):
            for key, value in blob.items():
                params[f"{key}{i}"] = value
        for i, delta in enumerate(deltas):
            params[f"dsource{i}"], params[f"dmodel{i}"] = delta.source, delta.model
            for name, value in zip(_TOTAL_PARAMS, _counters(delta.usage), strict=True):
                params[f"{name}_d{i}"] = value
        for j, ((source, model), counts) in enumerate(added.items()):
            params[f"tsource{j}"], params[f"tmodel{j}"] = source, model
            for name, value in zip(_TOTAL_PARAMS, counts, strict=True):
                params[f"{name}_t{j}"] = value
        for i, (node_id, parent, text) in enumerate(nodes):
            params[f"nid{i}"], params[f"parent{i}"], params[f"json{i}"] = node_id, parent, text
        result = _RESULT(
            head_revision=expected + 1,
            checkpoint_ref=ref,
            manifest=manifest,
            enqueued_queue_batches=(),
        )
        if stamp is not None:
            params["tid"], params["stamp_hash"] = stamp.turn_id, stamp.turn_commit_hash
            params["result"] = canonical_json(result.model_dump(mode="json"))
        statement = _checked_turn_statement(
            len(nodes),
            len(deltas),
            len(added),
            len(blobs),
            stamp is not None,
            commit.release_session_execution_lease is not None,
            expected == 0,
        )
        if not db.fits(statement, params):
            return None
        return cls(sid, statement, params, result)


# --------------------------------------------------------------------------
# The repository


class SessionCommitRepository:
    """Session commits and reads inside one unit of work (``uow.commits``)."""

    def __init__(
        self, driver: Driver, clock: Clock, *, writable: bool, nested: bool = True
    ) -> None:
        """Bind to a unit's driver.

        Args:
            nested: the unit may hold other work (``store.write()``): a commit
                then runs in a SAVEPOINT, so that its error leaves the rest of
                the unit. False in a one-call unit, whose transaction is the
                commit's alone.
        """
        self._db = driver
        self._clock = clock
        self._writable = writable
        self._nested = nested

    # ------------------------------------------------------------------ commit

    def commit_runtime_state(
        self, commit: RuntimeCommit, *, blob_profile: BlobProfile = BlobProfile.BALANCED
    ) -> RuntimeCommitResult:
        """Record a turn atomically: checkpoint, usage, graph, head, claims, inputs, work.

        See docs/sessions.md#commit_runtime_state.

        The steps, their order and the error precedence are in the module
        docstring. Every write runs in a savepoint: on any error nothing of
        the commit persists (and, inside a caller's ``store.write()``, the
        caller's earlier work survives if the caller catches the error).

        Args:
            commit: what the turn records.
            blob_profile: when checkpoint blobs are zlib-compressed.

        Returns:
            The new head revision, the checkpoint reference and manifest, and
            the enqueued batches — or, for a replay of a recorded
            ``(session, turn, hash)``, the result stored by the first commit.

        Raises:
            InvalidInput: a malformed argument (before anything is locked).
            RuntimeTurnCommitConflict: the stamp names another session, or the
                turn was committed with another hash.
            SessionExecutionLeaseExpired: no fence, or not the live lease.
            HeadRevisionConflict: the head is not at ``expected_head_revision``.
            QueuedWorkClaimSuperseded: a completed queue claim is for another
                session or does not own exactly its batch ids.
            TurnInputClaimSuperseded: the same for a turn-input claim.
            NodeAlreadyExists: an appended node id exists in the session (or
                repeats in the delta).
            QueuedWorkSourceKeyConflict: an enqueued draft reuses a source key
                with other content.
            SessionBindingMismatch: an enqueued draft (or the lease release)
                names another session.
            SessionCorrupt: a stored turn-commit result or ingress does not decode.
            ReadOnlyUnitOfWork: inside ``store.read()``.
        """
        if not isinstance(commit, RuntimeCommit):
            raise InvalidInput("commit", f"expected a RuntimeCommit, got {type(commit).__name__}")
        if not isinstance(blob_profile, BlobProfile):
            raise InvalidInput("blob_profile", f"expected a BlobProfile, got {blob_profile!r}")
        prepared = _Prepared(commit)
        sid = commit.session_id
        db = self._db
        if not self._nested and db.postgres and db.checks_one_call:
            checked = _CheckedTurn.of(db, commit, prepared, blob_profile)
            if checked is not None:
                try:
                    return self._checked_commit(checked)
                except PrefetchCheckFailed:
                    db.restart()  # a check refused: the full commit judges (below)
        # psycopg: the fence reads go out with the locks, in their round trip.
        with db.prefetching(_fence_reads(commit)):
            now = begin_session_write(db, self._clock, self._writable, sid, blobs=True)
            # A one-call unit: no SAVEPOINT, an error rolls its whole transaction back.
            with atomic(db, self._nested):
                return self._commit(commit, prepared, blob_profile, now)

    def _checked_commit(self, checked: _CheckedTurn) -> RuntimeCommitResult:
        """A small fenced commit as one checking statement after the locks (Postgres).

        The locks (step 1) as usual, ``now`` sampled after them, then
        :func:`_checked_turn`: psycopg sends it with ``COMMIT`` (two round
        trips in all), asyncpg before the unit's ``COMMIT`` (three).

        Raises:
            PrefetchCheckFailed: a check refused; nothing was written and the
                unit must restart (``commit_runtime_state`` then runs the
                full commit, which raises the typed error).
        """
        db = self._db
        now = begin_session_write(db, self._clock, self._writable, checked.session_id, blobs=True)
        checked.params["now"] = now
        db.execute_checking(checked.statement, checked.params)
        return checked.result

    def _commit(
        self, commit: RuntimeCommit, prepared: _Prepared, profile: BlobProfile, now: int
    ) -> RuntimeCommitResult:
        db = self._db
        sid = commit.session_id

        # 3. Turn-commit idempotency (replay).
        stamp = commit.turn_commit
        if stamp is not None:
            if stamp.session_id != sid:
                raise RuntimeTurnCommitConflict(stamp.session_id, stamp.turn_id)
            row = db.execute(_GET_TURN_COMMIT, {"sid": sid, "tid": stamp.turn_id}).fetchone()
            if row is not None:
                if row[0] != stamp.turn_commit_hash:
                    raise RuntimeTurnCommitConflict(sid, stamp.turn_id)
                try:
                    stored = RuntimeCommitResult.model_validate_json(row[1])
                except (ValueError, TypeError, ValidationError) as exc:
                    raise SessionCorrupt(
                        "runtime_turn_commits", f"{sid}/{stamp.turn_id}", "result_json", str(exc)
                    ) from None
                self._release(commit)
                db.flush()
                return stored

        # 4.–5. The lease fence, checked on the lease row read (under the lock) in one
        # statement with the head (step 6) and the ledger totals (step 10b).
        fence = commit.session_execution_lease
        if fence is None or fence.session_id != sid:
            raise SessionExecutionLeaseExpired(sid)
        rows = db.execute(_head_read(commit), {"sid": sid}).fetchall()
        lease = rows[-1][_LEASE_AT] if rows and rows[-1][0] == 2 else None
        check_fence_row(sid, fence, now, lease)

        # 6. Head CAS.
        row = rows[0][1:3] if rows and rows[0][0] == 0 else None
        totals: Sequence[Sequence[Any]] = [r[_TOTALS_AT] for r in rows if r[0] == 1]
        actual = 0 if row is None else _check_revision(sid, row[0])
        live_nodes = 0 if row is None else _check_count(sid, row[1])
        expected = commit.expected_head_revision
        if expected is not None and expected != actual:
            raise HeadRevisionConflict(sid, expected, actual)

        # 7.–8. Claim ownership (strict), before any write.
        for qc in commit.completed_queue_claims:
            if qc.session_id != sid:
                raise QueuedWorkClaimSuperseded(qc.session_id, qc.claim_id)
            ensure_queued_work_completion(db, qc)
        for tc in commit.completed_turn_input_claims:
            if tc.session_id != sid:
                raise TurnInputClaimSuperseded(tc.session_id, tc.claim_id)
            ensure_turn_input_completion(db, tc)

        # 9. Checkpoint blobs and manifest.
        # Postgres: the blobs go out in the head's statement (step 13), not one by one.
        blobs: list[dict[str, Any]] | None = [] if db.postgres else None
        checkpoint_ref, manifest = put_checkpoint(db, commit.checkpoint, profile, into=blobs)
        if blobs:  # their size limits here, before the errors of steps 10-11
            _check_sizes(db, blobs, _BLOB_SIZED)

        # Postgres, appending at most one insert's nodes: the writes of steps 10, 11
        # and 13 go out as one statement (_put_turn), built at step 13 from `writes`.
        nodes = prepared.nodes
        merge = db.postgres and not prepared.replace and len(nodes) <= _NODES_PER_INSERT
        writes: dict[str, Any] = {}
        ledger: tuple[int, int] | None = None

        # 10. Usage deltas, in order, and the ledger totals they change. The rows
        # (their size limits) come before the totals (a UsageLedgerOverflow).
        if deltas := commit.usage_deltas:
            fold = db.postgres and len(deltas) <= _USAGE_PER_FOLD
            if fold:
                _check_sizes(
                    db, [{"source": d.source, "model": d.model} for d in deltas], _DELTA_SIZED
                )
            else:
                self._put_deltas(commit)
            changed = self._changed_totals(commit, totals)
            if fold and changed:
                folded = self._fold_usage(commit, changed)
                if merge:
                    ledger, _ = folded
                    writes.update(folded[1])
                else:
                    db.defer(_PUT_USAGE_AND_TOTALS[folded[0]], folded[1])
                changed = {}
            elif fold:  # no total changes (every delta is zero): no folded shape
                self._put_deltas(commit)
            self._put_totals(commit, changed)

        # 11. Graph delta.
        if prepared.replace:
            db.defer(_DELETE_NODES, {"sid": sid})
        nodes_check: _NodesInserted | None = None
        if merge and nodes:
            for i, (node_id, parent, text) in enumerate(nodes):
                writes[f"nid{i}"], writes[f"parent{i}"], writes[f"json{i}"] = node_id, parent, text
            nodes_check = _NodesInserted(sid, [node_id for node_id, _, _ in nodes])
        for start in range(0, 0 if merge else len(nodes), _NODES_PER_INSERT):
            chunk = nodes[start : start + _NODES_PER_INSERT]
            params: dict[str, Any] = {"sid": sid}
            for i, (node_id, parent, text) in enumerate(chunk):
                params[f"nid{i}"], params[f"parent{i}"], params[f"json{i}"] = node_id, parent, text
            check = _NodesInserted(sid, [node_id for node_id, _, _ in chunk])
            db.defer(_PUT_NODES[len(chunk)], params, check)

        # 12. Live node count, kept incrementally so a commit costs O(its delta),
        # not O(graph): tombstone_nodes decrements it in the same transaction.
        count = (0 if prepared.replace else live_nodes) + len(prepared.nodes)

        # 13. Head write, fenced by the revision read in step 6.
        next_revision = actual + 1
        head = {
            "sid": sid,
            "schema": HEAD_SCHEMA_VERSION,
            "next": next_revision,
            "leaf": prepared.leaf,
            "ref": checkpoint_ref,
            "config": prepared.config_json,
            "frames": prepared.agent_frames_json,
            "frame_id": commit.current_agent_frame_id,
            "count": count,
            "actual": actual,
        }
        if blobs:
            for i, blob in enumerate(blobs):
                for key, value in blob.items():
                    head[f"{key}{i}"] = value
        if merge:
            writes.update(head)
            stmt = _turn_statement(len(nodes), ledger, len(blobs) if blobs else 0)
            db.defer(stmt, writes, _TurnWritten(sid, nodes_check))
        else:
            put_head = _PUT_HEAD_WITH_BLOBS[len(blobs)] if blobs else _PUT_HEAD
            db.defer(put_head, head, _HeadWritten(sid))

        # 14.–15. Complete the claims.
        for qc in commit.completed_queue_claims:
            delete_completed_queued_work(db, qc)
        for tc in commit.completed_turn_input_claims:
            complete_turn_input_rows(db, tc)

        # 16. Interrupted turn: its pending_active inputs move to the next turn.
        turn = commit.interrupted_turn_input_turn_id
        if turn is not None:
            for input_id, ingress_json in db.execute(_PENDING_ACTIVE, {"sid": sid}).fetchall():
                try:
                    ingress = _INGRESS.validate_json(ingress_json)
                except (ValueError, TypeError, ValidationError) as exc:
                    raise SessionCorrupt(
                        "pending_turn_inputs", str(input_id), "ingress_json", str(exc)
                    ) from None
                if not (isinstance(ingress, ActiveTurnIngress) and ingress.turn_id == turn):
                    continue
                params = {"sid": sid, "iid": input_id, "ingress": _NEXT_TURN_INGRESS}
                if db.execute(_DEFER, params).rowcount != 1:
                    raise ConcurrentModification(
                        f"session {sid}: turn input {input_id} changed under the write lock"
                    )

        # 17. Attachments: the first commit's time wins.
        for attachment_id in commit.committed_attachment_ids:
            db.defer(_COMMIT_ATTACHMENT, {"sid": sid, "aid": attachment_id, "now": now})

        # 18. Enqueue new work.
        batches = []
        for draft in commit.enqueued_queue_batches:
            if draft.session_id != sid:
                raise SessionBindingMismatch(sid, draft.session_id)
            batches.append(enqueue_queued_work_conn(db, draft, now, next_enqueue_nonce()))

        # 19.–20. The result and the turn-commit record.
        # Every field is the store's own checked value (a revision past 2**63-1 is
        # validated, and refused, by the record itself).
        build = _RESULT if next_revision <= MAX_I64 else RuntimeCommitResult
        result = build(
            head_revision=next_revision,
            checkpoint_ref=checkpoint_ref,
            manifest=manifest,
            enqueued_queue_batches=tuple(batches),
        )
        if stamp is not None:
            db.defer(
                _PUT_TURN_COMMIT,
                {
                    "sid": sid,
                    "tid": stamp.turn_id,
                    "hash": stamp.turn_commit_hash,
                    "result": canonical_json(result.model_dump(mode="json")),
                    "ref": checkpoint_ref,
                    "now": now,
                },
            )

        # 21. The fenced lease release.
        self._release(commit)
        # The deferred writes go out (one round trip on psycopg) and are checked here,
        # inside the commit's savepoint.
        db.flush()
        return result

    def _changed_totals(
        self, commit: RuntimeCommit, total_rows: Sequence[Sequence[Any]]
    ) -> dict[tuple[str, str], list[int]]:
        """Step 10b: the ledger totals the commit's usage changes, by ``(source, model)``.

        Each value is ``[ordinal, *counters]`` (the new totals).

        ``total_rows``: the session's totals by ordinal (:data:`_TOTAL_COLUMNS`),
        read under the lock with the head in step 6.

        The totals are read and rewritten under the session's write lock, so
        concurrent committers serialize and no delta is lost. The merge is
        :func:`merge_token_ledger`'s: a delta whose ``usage.total()`` is 0 adds
        nothing; a new ``(source, model)`` pair gets the next ordinal.

        Raises:
            UsageLedgerOverflow: a total counter would pass ``2**63-1`` (the
                unit rolls back: the commit writes nothing).
            SessionCorrupt: a stored total does not decode.
        """
        sid = commit.session_id
        sums = {
            (source, model): numbers for source, model, numbers in _checked_totals(sid, total_rows)
        }
        next_ordinal = max((numbers[0] for numbers in sums.values()), default=-1) + 1
        changed: dict[tuple[str, str], list[int]] = {}
        for delta in commit.usage_deltas:
            if delta.usage.total() == 0:
                continue
            key = (delta.source, delta.model)
            row = sums.get(key)
            if row is None:
                row = sums[key] = [next_ordinal, 0, 0, 0, 0, 0]
                next_ordinal += 1
            added = zip(_USAGE_FIELDS, _counters(delta.usage), strict=True)
            for j, (name, value) in enumerate(added):
                row[j + 1] += value
                if row[j + 1] > MAX_I64:
                    raise UsageLedgerOverflow(sid, delta.source, delta.model, name)
            changed[key] = row
        return changed

    def _put_deltas(self, commit: RuntimeCommit) -> None:
        """Step 10a: one ledger row per delta, in order."""
        db, sid = self._db, commit.session_id
        for delta in commit.usage_deltas:
            u = delta.usage
            db.defer(
                _PUT_USAGE,
                {
                    "sid": sid,
                    "source": delta.source,
                    "model": delta.model,
                    "input": u.input_tokens,
                    "output": u.output_tokens,
                    "cache_read": u.cache_read_input_tokens,
                    "cache_write": u.cache_write_input_tokens,
                    "reasoning": u.reasoning_output_tokens,
                },
            )

    @staticmethod
    def _fold_usage(
        commit: RuntimeCommit, changed: dict[tuple[str, str], list[int]]
    ) -> tuple[tuple[int, int], dict[str, Any]]:
        """Steps 10a and 10c in one statement (Postgres): its shape and parameters.

        The shape ``(deltas, changed totals)`` is a key of
        :data:`_PUT_USAGE_AND_TOTALS` (1 to ``_USAGE_PER_FOLD`` deltas, so 1
        to as many changed totals); the parameters are that statement's,
        whether it goes out alone or inside :func:`_put_turn`.
        """
        deltas = commit.usage_deltas
        params: dict[str, Any] = {"sid": commit.session_id}
        for i, delta in enumerate(deltas):
            params[f"dsource{i}"], params[f"dmodel{i}"] = delta.source, delta.model
            for name, value in zip(_TOTAL_PARAMS, _counters(delta.usage), strict=True):
                params[f"{name}_d{i}"] = value
        for j, ((source, model), (ordinal, *counts)) in enumerate(changed.items()):
            params[f"tsource{j}"], params[f"tmodel{j}"], params[f"tordinal{j}"] = (
                source,
                model,
                ordinal,
            )
            for name, value in zip(_TOTAL_PARAMS, counts, strict=True):
                params[f"{name}_t{j}"] = value
        return (len(deltas), len(changed)), params

    def _put_totals(self, commit: RuntimeCommit, changed: dict[tuple[str, str], list[int]]) -> None:
        """Step 10c: write the changed totals (inserted or replaced, under the lock)."""
        db, sid = self._db, commit.session_id
        for (source, model), (ordinal, *counts) in changed.items():
            db.defer(
                _PUT_TOTAL,
                {
                    "sid": sid,
                    "source": source,
                    "model": model,
                    "ordinal": ordinal,
                    **dict(zip(_TOTAL_PARAMS, counts, strict=True)),
                },
            )

    def _release(self, commit: RuntimeCommit) -> None:
        """The fenced lease release of steps 3c and 21 (a mismatch is a silent no-op)."""
        completion = commit.release_session_execution_lease
        if completion is None:
            return
        if completion.session_id != commit.session_id:
            raise SessionBindingMismatch(commit.session_id, completion.session_id)
        release_locked(self._db, completion)  # the commit holds the session's lock

    # ------------------------------------------------------------------ reads

    def get_head_revision(self, session_id: str) -> int:
        """The session's head revision, 0 when it has no head.

        Raises:
            InvalidInput: blank session id.
            SessionCorrupt: the stored revision is not an integer in ``0..2**63-1``.
        """
        check_id(session_id, "session_id")
        row = self._db.execute(_GET_HEAD_REVISION, {"sid": session_id}).fetchone()
        return 0 if row is None else _check_revision(session_id, row[0])

    def load_session(
        self, session_id: str, scope: LoadScope = _DEFAULT_SCOPE
    ) -> PersistedSessionRead | None:
        """The session's head, graph, checkpoint and token ledger.

        See docs/sessions.md#load_session.

        Args:
            session_id: the session.
            scope: :class:`FullGraphScope` (default: every live node by
                insertion order, leaf = the head's leaf) or
                :class:`ActivePathScope` (the path root-first to the given
                leaf, default the head's; empty when there is no leaf or the
                leaf is missing or tombstoned; the walk stops at the first
                missing or tombstoned ancestor; ``tail=N``: its last ``N``
                nodes, read by a walk of at most ``N`` steps, ``tail=0`` no
                node) or :class:`HeadScope` (no node: the head, checkpoint
                and ledger only). The graph's ``leaf_node_id`` is the
                effective leaf even if no such node exists.

        Returns:
            The session, or None if it has no head. A missing checkpoint
            manifest blob gives ``checkpoint=None`` (``checkpoint_ref`` is
            still reported); undecodable graph nodes are skipped (a warning
            is logged once per row). The token ledger is the totals the
            commits kept.

        Raises:
            InvalidInput: blank session id or an unknown scope.
            SessionCorrupt: the head row, the checkpoint manifest or a present
                component blob does not decode; a parent-id cycle on the path
                (within the tail read); a ledger total does not decode.
        """
        check_id(session_id, "session_id")
        if not isinstance(scope, FullGraphScope | ActivePathScope | HeadScope):
            raise InvalidInput("scope", f"expected a load scope, got {type(scope).__name__}")
        # The head, its manifest blob and the ledger totals: one statement.
        rows = self._db.execute(_GET_HEAD_AND_TOTALS, {"sid": session_id}).fetchall()
        if not rows or rows[0][0] != 0:
            return None
        totals = [r[_TOTAL_AT:] for r in rows[1:]]
        read = self._loaded(session_id, scope, rows[0][_HEAD_AT:_TOTAL_AT], totals)
        return typed(PersistedSessionRead, read)

    def _load_head_alone(self, session_id: str) -> PersistedSessionRead | _NeedsSnapshot | None:
        """``load_session(session_id, HeadScope())`` when its one statement is the whole read.

        The one-call ``store.commits.load_session(sid, HeadScope())`` runs
        this outside a snapshot transaction (one round trip on Postgres, no
        ``BEGIN`` / ``COMMIT`` on SQLite): a single statement is a consistent
        snapshot by itself. When the checkpoint has component blobs, which
        would take more statements that must see the same snapshot, nothing
        more is read and :data:`NEEDS_SNAPSHOT` is returned: the caller then
        runs :meth:`load_session` in a snapshot unit. Raises what
        :meth:`load_session` raises.
        """
        check_id(session_id, "session_id")
        rows = self._db.execute(_GET_HEAD_AND_TOTALS, {"sid": session_id}).fetchall()
        if not rows or rows[0][0] != 0:
            return None
        totals = [r[_TOTAL_AT:] for r in rows[1:]]
        return self._loaded(session_id, _HEAD_SCOPE, rows[0][_HEAD_AT:_TOTAL_AT], totals, True)

    def _load_tail_alone(
        self, session_id: str, tail: int
    ) -> PersistedSessionRead | _NeedsSnapshot | None:
        """``load_session(session_id, ActivePathScope(tail=tail))`` (the head's leaf,
        ``tail >= 1``) in one statement (:data:`_GET_HEAD_TOTALS_AND_TAIL`).

        As :meth:`_load_head_alone`: the one-call form runs it outside a
        snapshot transaction, and a checkpoint with component blobs returns
        :data:`NEEDS_SNAPSHOT` with nothing more read. Raises what
        :meth:`load_session` raises.
        """
        check_id(session_id, "session_id")
        rows = self._db.execute(_GET_HEAD_TOTALS_AND_TAIL, {"sid": session_id, "n": tail})
        head = None
        totals, path = [], []
        for r in rows.fetchall():
            kind = r[0]
            if kind == 2:
                path.append(r[_NODE_AT:])
            elif kind == 1:
                totals.append(r[_TOTAL_AT:_NODE_AT])
            else:
                head = r[_HEAD_AT:_TOTAL_AT]
        if head is None:
            return None
        if len(totals) > 1:  # by ordinal (an undecodable one is reported by _checked_totals)
            totals.sort(key=_ordinal_key)
        scope = ActivePathScope(tail=tail)
        return self._loaded(session_id, scope, head, totals, True, path)

    def _loaded(
        self,
        session_id: str,
        scope: LoadScope,
        row: Sequence[Any],
        totals: Sequence[Sequence[Any]],
        alone: bool = False,
        path: Sequence[Sequence[Any]] | None = None,
    ) -> PersistedSessionRead | _NeedsSnapshot:
        """:meth:`load_session` once the head row (with its manifest blob) and the
        ledger's total rows are read (``alone``: :data:`NEEDS_SNAPSHOT` instead of
        reading component blobs, see :meth:`_load_head_alone`)."""
        db = self._db
        version, revision, head_leaf, checkpoint_ref, config_json, frames_json, frame_id = row[:7]
        if version != HEAD_SCHEMA_VERSION:
            raise SessionCorrupt(
                "session_head",
                session_id,
                "schema_version",
                f"unsupported head schema version {version!r}",
            )
        revision = _check_revision(session_id, revision)
        config = self._decode_head_json(session_id, "config_json", config_json)
        frames = self._decode_head_json(session_id, "agent_frames_json", frames_json)
        if not isinstance(frames, list):
            raise SessionCorrupt("session_head", session_id, "agent_frames_json", "not a list")
        for column, value in (
            ("checkpoint_ref", checkpoint_ref),
            ("leaf_node_id", head_leaf),
            ("current_agent_frame_id", frame_id),
        ):
            if not isinstance(value, str) and not (value is None and column != "checkpoint_ref"):
                raise SessionCorrupt("session_head", session_id, column, repr(value))

        if isinstance(scope, HeadScope):
            leaf, nodes = head_leaf, []
        elif isinstance(scope, ActivePathScope):
            leaf = scope.leaf_node_id if scope.leaf_node_id is not None else head_leaf
            if path is None:
                nodes = self._active_path(session_id, leaf, scope.tail)
            else:  # walked by the one statement (_load_tail_alone)
                nodes = [] if leaf is None else _ordered_path(session_id, leaf, path)
        else:
            leaf = head_leaf
            nodes = [
                node
                for seq, node_id, raw in db.execute(_FULL_GRAPH, {"sid": session_id}).fetchall()
                if (node := _decode_node(session_id, seq, node_id, raw)) is not None
            ]
        manifest = manifest_of(checkpoint_ref, decode_blob(checkpoint_ref, row[8:]))
        if alone and manifest is not None and _has_components(manifest):
            return NEEDS_SNAPSHOT
        checkpoint = hydrate(db, manifest)
        # Every value is checked above (or decoded JSON, or a validated record's):
        # built without validation, unless an id is a str subclass the caller passed.
        plain = type(session_id) is str and (leaf is None or type(leaf) is str)
        read, graph = (_READ, _GRAPH) if plain else (PersistedSessionRead, SessionGraph)
        return read(
            session_id=session_id,
            head_revision=revision,
            config=config,
            agent_frames=tuple(frames),
            current_agent_frame_id=frame_id,
            graph=graph(nodes=tuple(nodes), leaf_node_id=leaf),
            checkpoint_ref=checkpoint_ref,
            checkpoint=checkpoint,
            token_ledger=_ledger(session_id, totals),
        )

    @staticmethod
    def _decode_head_json(session_id: str, column: str, raw: object) -> Any:
        if raw == "{}":  # the common config and frames: no decoder call
            return {}
        if raw == "[]":
            return []
        try:
            if not isinstance(raw, str):
                raise TypeError(f"{type(raw).__name__} instead of text")
            return loads(raw)
        except (ValueError, TypeError) as exc:
            raise SessionCorrupt("session_head", session_id, column, str(exc)) from None

    def _active_path(
        self, session_id: str, leaf: str | None, tail: int | None = None
    ) -> list[SessionNodeRecord]:
        """The live path root-first to ``leaf``, or its last ``tail`` nodes.

        One recursive query (:data:`ACTIVE_PATH`, or :data:`ACTIVE_PATH_TAIL`
        bounded by ``tail``), ordered here by following the parents.
        """
        if leaf is None or tail == 0:
            return []
        if tail is None:
            rows = self._db.execute(ACTIVE_PATH, {"sid": session_id, "leaf": leaf}).fetchall()
        else:
            params = {"sid": session_id, "leaf": leaf, "n": tail}
            rows = self._db.execute(ACTIVE_PATH_TAIL, params).fetchall()
        return _ordered_path(session_id, leaf, rows)

    def load_node(self, session_id: str, node_id: str) -> SessionNodeRecord | None:
        """One live node of the session (docs/sessions.md#load_node).

        Returns:
            The node, or None when it does not exist, is tombstoned, or its
            JSON does not decode (logged once).

        Raises:
            InvalidInput: blank ids.
        """
        check_id(session_id, "session_id")
        check_id(node_id, "node_id")
        row = self._db.execute(_GET_NODE, {"sid": session_id, "nid": node_id}).fetchone()
        if row is None:
            return None
        return _decode_node(session_id, row[0], row[1], row[2])

    # ------------------------------------------------------------------ metadata

    def save_session_meta(self, meta: SessionMeta) -> None:
        """Insert or replace the session's metadata (docs/sessions.md#save_session_meta).

        Unlike the original store, errors are raised, not swallowed
        (docs/decisions.md#session-metadata-errors-are-raised).

        Raises:
            InvalidInput: not a :class:`SessionMeta`, a blank session id, or a
                ``relation`` that is not a JSON value.
            ReadOnlyUnitOfWork: inside ``store.read()``.
        """
        if not isinstance(meta, SessionMeta):
            raise InvalidInput("meta", f"expected a SessionMeta, got {type(meta).__name__}")
        check_id(meta.session_id, "meta.session_id")
        relation = None if meta.relation is None else _json_text(meta.relation, "meta.relation")
        begin_session_write(self._db, self._clock, self._writable, meta.session_id)
        self._db.execute(
            _PUT_META,
            {
                "sid": meta.session_id,
                "name": meta.session_name,
                "created_at": meta.created_at,
                "model": meta.model,
                "cwd": meta.cwd,
                "relation": relation,
            },
        )

    def load_session_meta(self, session_id: str) -> SessionMeta | None:
        """The session's metadata, or None if none was saved.

        See docs/sessions.md#load_session_meta. Unlike the original store, a
        stored row that does not decode is an error, not None
        (docs/decisions.md#session-metadata-errors-are-raised).

        Raises:
            InvalidInput: blank session id.
            SessionCorrupt: a column does not decode.
        """
        check_id(session_id, "session_id")
        row = self._db.execute(_GET_META, {"sid": session_id}).fetchone()
        if row is None:
            return None
        name, created_at, model, cwd, relation_json = row
        relation = None
        if relation_json is not None:
            try:
                if not isinstance(relation_json, str):
                    raise TypeError(f"{type(relation_json).__name__} instead of text")
                relation = loads(relation_json)
            except (ValueError, TypeError) as exc:
                raise SessionCorrupt(
                    "session_meta", session_id, "relation_json", str(exc)
                ) from None
        try:
            return SessionMeta(
                session_id=session_id,
                session_name=name,
                created_at=created_at,
                model=model,
                cwd=cwd,
                relation=relation,
            )
        except ValidationError as exc:
            column = str(exc.errors()[0]["loc"][0]) if exc.errors() else "session_name"
            raise SessionCorrupt("session_meta", session_id, column, str(exc)) from None
