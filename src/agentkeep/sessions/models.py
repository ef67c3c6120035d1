"""The session store's tables: leases, queued work and turn inputs, then the commit half.

The coordination half (``session_execution_leases``, ``queued_work_batches``,
``queued_work_items``, ``pending_turn_inputs``) is built by
``alembic/versions/sessions_0001_*.py``, the commit half (head, graph, usage,
turn commits, attachments, blobs, artifact refs, metadata) by
``sessions_0002_*.py``, the checkpoint additions (``graph_nodes.blob_ref``,
``graph_nodes.run_id``, ``session_pending_writes``) by ``sessions_0003_*.py``,
the ledger totals (``session_usage_totals``) by ``sessions_0004_*.py``, and
``sessions_0005_*.py`` took ``AUTOINCREMENT`` off ``graph_nodes`` and
``usage_deltas`` and made ``ix_graph_nodes_run_id`` partial (fewer pages per
write: docs/sessions.md#pages-per-write); the drift check keeps models and
migrations equal.
Every table but the content-addressed ``blobs`` and ``artifact_refs`` is keyed
by ``session_id``, so one database (and one Postgres server) holds many
sessions (docs/decisions.md#many-sessions-per-database). The columns are
described in docs/sessions.md#tables.

Invariants:

* ``session_execution_leases.lease_fencing_token`` never decreases; release
  keeps it (the next acquisition is fencing + 1).
* ``enqueue_seq`` of batches and turn inputs is never reused
  (``AUTOINCREMENT`` on SQLite, a sequence on Postgres): it is the FIFO order.
* ``seq`` of graph nodes and usage deltas is above every existing row's (the
  rowid on SQLite, a sequence on Postgres): the order within a session. On
  SQLite a value freed by deleting the newest rows may be handed out again.
* ``claim_fencing_token`` of a row only grows; clearing a claim keeps it.
* Deleting a batch deletes its items (``ON DELETE CASCADE``; SQLite enforces
  it because every connection sets ``foreign_keys=ON``).
"""

from __future__ import annotations

from sqlalchemy import CheckConstraint, ForeignKey, Index, LargeBinary, Text, UniqueConstraint, text
from sqlalchemy.orm import Mapped, mapped_column

from agentkeep.base import BIGINT, Base

__all__ = [
    "ArtifactRefRow",
    "AttachmentManifestRow",
    "BlobRow",
    "GraphNodeRow",
    "PendingTurnInputRow",
    "PendingWriteRow",
    "QueuedWorkBatchRow",
    "QueuedWorkItemRow",
    "RuntimeTurnCommitRow",
    "SessionHeadRow",
    "SessionLeaseRow",
    "SessionMetaRow",
    "UsageDeltaRow",
    "UsageTotalRow",
]

_ZERO = text("0")
_RUN_ID_SET = text("run_id IS NOT NULL")


class SessionLeaseRow(Base):
    """One execution lease per session; ``lease_fencing_token`` is the generation."""

    __tablename__ = "session_execution_leases"

    session_id: Mapped[str] = mapped_column(Text, primary_key=True)
    lease_owner_id: Mapped[str | None] = mapped_column(Text)
    lease_owner_incarnation_id: Mapped[str | None] = mapped_column(Text)
    lease_owner_liveness_json: Mapped[str | None] = mapped_column(Text)
    lease_token: Mapped[str | None] = mapped_column(Text)
    lease_fencing_token: Mapped[int] = mapped_column(BIGINT, nullable=False, server_default=_ZERO)
    lease_claimed_at_ms: Mapped[int] = mapped_column(BIGINT, nullable=False, server_default=_ZERO)
    lease_expires_at_ms: Mapped[int] = mapped_column(BIGINT, nullable=False, server_default=_ZERO)


class _ClaimColumns:
    """The claim columns of a claimable row, written by STAMP_CLAIM and CLEAR_CLAIM.

    ``claim_token`` NULL means unclaimed; ``claim_fencing_token`` only grows;
    ``claim_session_lease_generation`` is the lease generation the claim was
    taken under (docs/sessions.md#claim-columns,
    docs/sessions.md#named-predicates).
    """

    claim_id: Mapped[str | None] = mapped_column(Text)
    claim_owner_id: Mapped[str | None] = mapped_column(Text)
    claim_owner_incarnation_id: Mapped[str | None] = mapped_column(Text)
    claim_owner_liveness_json: Mapped[str | None] = mapped_column(Text)
    claim_token: Mapped[str | None] = mapped_column(Text)
    claim_fencing_token: Mapped[int] = mapped_column(BIGINT, nullable=False, server_default=_ZERO)
    claim_session_lease_generation: Mapped[int] = mapped_column(
        BIGINT, nullable=False, server_default=_ZERO
    )


class QueuedWorkBatchRow(_ClaimColumns, Base):
    """A durable batch of queued work, claimed under a session-lease generation."""

    __tablename__ = "queued_work_batches"

    enqueue_seq: Mapped[int] = mapped_column(BIGINT, primary_key=True, autoincrement=True)
    batch_id: Mapped[str] = mapped_column(Text, nullable=False, unique=True)
    session_id: Mapped[str] = mapped_column(Text, nullable=False)
    source_key: Mapped[str | None] = mapped_column(Text)
    delivery_policy: Mapped[str] = mapped_column(Text, nullable=False)
    slot_policy: Mapped[str] = mapped_column(Text, nullable=False)
    merge_key_json: Mapped[str] = mapped_column(Text, nullable=False)
    available_at_ms: Mapped[int] = mapped_column(BIGINT, nullable=False)
    enqueued_at_ms: Mapped[int] = mapped_column(BIGINT, nullable=False)

    __table_args__ = (
        UniqueConstraint("session_id", "source_key"),
        # Claim scans and lists: WHERE session_id = ? ... ORDER BY enqueue_seq LIMIT n.
        Index("ix_queued_work_batches_session_seq", "session_id", "enqueue_seq"),
        # Completion, abandon: WHERE session_id = ? AND claim_id = ? AND claim_token = ?.
        Index("ix_queued_work_batches_session_claim", "session_id", "claim_id", "claim_token"),
        {"sqlite_autoincrement": True},
    )


class QueuedWorkItemRow(Base):
    """One payload of a batch, in order."""

    __tablename__ = "queued_work_items"

    batch_id: Mapped[str] = mapped_column(
        Text, ForeignKey("queued_work_batches.batch_id", ondelete="CASCADE"), primary_key=True
    )
    item_index: Mapped[int] = mapped_column(BIGINT, primary_key=True, autoincrement=False)
    item_id: Mapped[str] = mapped_column(Text, nullable=False)
    payload_json: Mapped[str] = mapped_column(Text, nullable=False)


class PendingTurnInputRow(_ClaimColumns, Base):
    """A user or host input awaiting a turn, with its lifecycle state and claim."""

    __tablename__ = "pending_turn_inputs"

    enqueue_seq: Mapped[int] = mapped_column(BIGINT, primary_key=True, autoincrement=True)
    input_id: Mapped[str] = mapped_column(Text, nullable=False, unique=True)
    session_id: Mapped[str] = mapped_column(Text, nullable=False)
    source_key: Mapped[str | None] = mapped_column(Text)
    ingress_json: Mapped[str] = mapped_column(Text, nullable=False)
    submitted_ingress_json: Mapped[str] = mapped_column(Text, nullable=False)
    state: Mapped[str] = mapped_column(Text, nullable=False)
    input_json: Mapped[str] = mapped_column(Text, nullable=False)
    enqueued_at_ms: Mapped[int] = mapped_column(BIGINT, nullable=False)

    __table_args__ = (
        UniqueConstraint("session_id", "source_key"),
        CheckConstraint(
            "state IN ('pending_active', 'deferred_next_turn', 'accepted', 'cancelled', "
            "'completed')",
            name="state",
        ),
        # Claim scans and lists: WHERE session_id = ? AND state = ? ORDER BY enqueue_seq.
        Index("ix_pending_turn_inputs_session_state_seq", "session_id", "state", "enqueue_seq"),
        # Suffix cancel: WHERE session_id = ? AND enqueue_seq >= ? ORDER BY enqueue_seq.
        Index("ix_pending_turn_inputs_session_seq", "session_id", "enqueue_seq"),
        Index("ix_pending_turn_inputs_session_claim", "session_id", "claim_id", "claim_token"),
        {"sqlite_autoincrement": True},
    )


# --------------------------------------------------------------------------
# The commit half (docs/sessions.md#tables), keyed by session_id except the
# content-addressed blobs and artifact_refs.


class SessionHeadRow(Base):
    """One head per session: the revision advanced by compare-and-set on every commit."""

    __tablename__ = "session_head"

    session_id: Mapped[str] = mapped_column(Text, primary_key=True)
    schema_version: Mapped[int] = mapped_column(BIGINT, nullable=False)
    head_revision: Mapped[int] = mapped_column(BIGINT, nullable=False, server_default=_ZERO)
    leaf_node_id: Mapped[str | None] = mapped_column(Text)
    checkpoint_ref: Mapped[str] = mapped_column(Text, nullable=False)
    config_json: Mapped[str] = mapped_column(Text, nullable=False)
    agent_frames_json: Mapped[str] = mapped_column(Text, nullable=False)
    current_agent_frame_id: Mapped[str | None] = mapped_column(Text)
    graph_node_count: Mapped[int] = mapped_column(BIGINT, nullable=False, server_default=_ZERO)


class GraphNodeRow(Base):
    """A node of a session's conversation graph (soft-deleted by ``tombstoned``)."""

    __tablename__ = "graph_nodes"

    seq: Mapped[int] = mapped_column(BIGINT, primary_key=True, autoincrement=True)
    session_id: Mapped[str] = mapped_column(Text, nullable=False)
    node_id: Mapped[str] = mapped_column(Text, nullable=False)
    parent_node_id: Mapped[str | None] = mapped_column(Text)
    node_json: Mapped[str] = mapped_column(Text, nullable=False)
    tombstoned: Mapped[int] = mapped_column(BIGINT, nullable=False, server_default=_ZERO)
    #: The content-addressed blob holding the node's body as opaque bytes (a
    #: checkpoint node, sessions_0003); a GC root while the node row exists.
    blob_ref: Mapped[str | None] = mapped_column(Text)
    #: The run that wrote the node (checkpoint nodes; ``delete_nodes_for_runs``).
    run_id: Mapped[str | None] = mapped_column(Text)

    __table_args__ = (
        # Unique per session; also the lookup of the active-path walk.
        UniqueConstraint("session_id", "node_id"),
        # Full-graph loads and node counts: WHERE session_id = ? AND tombstoned = 0 ORDER BY seq.
        Index("ix_graph_nodes_session_tombstoned_seq", "session_id", "tombstoned", "seq"),
        # delete_nodes_for_runs: WHERE run_id IN (...), which implies the predicate.
        # Partial (sessions_0005): turn nodes carry no run_id and add no entry.
        Index(
            "ix_graph_nodes_run_id",
            "run_id",
            sqlite_where=_RUN_ID_SET,
            postgresql_where=_RUN_ID_SET,
        ),
    )


class _UsageCounters:
    """The five token counters of a usage row (``TokenUsage``'s fields), ``0..2**63-1``."""

    input_tokens: Mapped[int] = mapped_column(BIGINT, nullable=False)
    output_tokens: Mapped[int] = mapped_column(BIGINT, nullable=False)
    cache_read_input_tokens: Mapped[int] = mapped_column(BIGINT, nullable=False)
    cache_write_input_tokens: Mapped[int] = mapped_column(BIGINT, nullable=False)
    reasoning_output_tokens: Mapped[int] = mapped_column(BIGINT, nullable=False)


class UsageDeltaRow(Base, _UsageCounters):
    """Append-only token usage ledger of a session."""

    __tablename__ = "usage_deltas"

    seq: Mapped[int] = mapped_column(BIGINT, primary_key=True, autoincrement=True)
    session_id: Mapped[str] = mapped_column(Text, nullable=False)
    source: Mapped[str] = mapped_column(Text, nullable=False)
    model: Mapped[str] = mapped_column(Text, nullable=False)

    __table_args__ = (Index("ix_usage_deltas_session_seq", "session_id", "seq"),)


class UsageTotalRow(Base, _UsageCounters):
    """The merged ledger of a session: one row per ``(source, model)``, kept by the commit.

    Each commit adds its usage deltas (those with a non-zero total) to these
    counters under the session's write lock, so a load reads the totals
    instead of re-summing ``usage_deltas``. ``ordinal`` is the pair's rank of
    first appearance in the session (0, 1, ...): the ledger's order.
    """

    __tablename__ = "session_usage_totals"

    session_id: Mapped[str] = mapped_column(Text, primary_key=True)
    source: Mapped[str] = mapped_column(Text, primary_key=True)
    model: Mapped[str] = mapped_column(Text, primary_key=True)
    ordinal: Mapped[int] = mapped_column(BIGINT, nullable=False)


class RuntimeTurnCommitRow(Base):
    """Idempotency ledger: the result of the first commit of each (session, turn)."""

    __tablename__ = "runtime_turn_commits"

    session_id: Mapped[str] = mapped_column(Text, primary_key=True)
    turn_id: Mapped[str] = mapped_column(Text, primary_key=True)
    turn_commit_hash: Mapped[str] = mapped_column(Text, nullable=False)
    result_json: Mapped[str] = mapped_column(Text, nullable=False)
    checkpoint_ref: Mapped[str] = mapped_column(Text, nullable=False)
    committed_at_ms: Mapped[int] = mapped_column(BIGINT, nullable=False)


class AttachmentManifestRow(Base):
    """Attachment write-ahead manifest; ``committed_at_ms`` is set once, by the first commit."""

    __tablename__ = "attachment_manifest"

    session_id: Mapped[str] = mapped_column(Text, primary_key=True)
    attachment_id: Mapped[str] = mapped_column(Text, primary_key=True)
    canonical_uri: Mapped[str] = mapped_column(Text, nullable=False)
    intent_at_ms: Mapped[int] = mapped_column(BIGINT, nullable=False)
    committed_at_ms: Mapped[int | None] = mapped_column(BIGINT)
    owner_kind: Mapped[str | None] = mapped_column(Text)
    owner_id: Mapped[str | None] = mapped_column(Text)

    __table_args__ = (
        CheckConstraint(
            "(owner_kind IS NULL AND owner_id IS NULL) OR "
            "(owner_kind IN ('turn', 'process') AND owner_id IS NOT NULL)",
            name="owner",
        ),
    )


class BlobRow(Base):
    """Content-addressed blobs: ``hash`` is the sha256 of the uncompressed canonical bytes."""

    __tablename__ = "blobs"

    hash: Mapped[str] = mapped_column(Text, primary_key=True)
    kind: Mapped[str] = mapped_column(Text, nullable=False)
    compression: Mapped[str] = mapped_column(Text, nullable=False)
    content: Mapped[bytes] = mapped_column(LargeBinary, nullable=False)

    __table_args__ = (CheckConstraint("compression IN ('none', 'zlib')", name="compression"),)


class ArtifactRefRow(Base):
    """GC roots for blobs that no session head references."""

    __tablename__ = "artifact_refs"

    namespace: Mapped[str] = mapped_column(Text, primary_key=True)
    artifact_ref: Mapped[str] = mapped_column(Text, primary_key=True)
    blob_ref: Mapped[str] = mapped_column(Text, nullable=False)


class SessionMetaRow(Base):
    """Descriptive metadata of a session."""

    __tablename__ = "session_meta"

    session_id: Mapped[str] = mapped_column(Text, primary_key=True)
    session_name: Mapped[str] = mapped_column(Text, nullable=False)
    created_at: Mapped[str] = mapped_column(Text, nullable=False)
    model: Mapped[str] = mapped_column(Text, nullable=False)
    cwd: Mapped[str | None] = mapped_column(Text)
    relation_json: Mapped[str | None] = mapped_column(Text)


class PendingWriteRow(Base):
    """A pending write recorded against one graph node (checkpoint) of a session.

    Keyed by ``(session_id, node_id, task_id, write_idx)``: a write is stored
    once per task and index (sessions_0003; docs/sessions.md#pending-writes).
    ``value`` is the writer's serialized bytes, stored as they are.
    """

    __tablename__ = "session_pending_writes"

    session_id: Mapped[str] = mapped_column(Text, primary_key=True)
    node_id: Mapped[str] = mapped_column(Text, primary_key=True)
    task_id: Mapped[str] = mapped_column(Text, primary_key=True)
    write_idx: Mapped[int] = mapped_column(BIGINT, primary_key=True, autoincrement=False)
    channel: Mapped[str] = mapped_column(Text, nullable=False)
    value_type: Mapped[str] = mapped_column(Text, nullable=False)
    value: Mapped[bytes] = mapped_column(LargeBinary, nullable=False)
    task_path: Mapped[str] = mapped_column(Text, nullable=False, server_default=text("''"))
