"""Tables of the runtime store: the original store's eleven tables, as mapped models.

The tables are described in docs/runtime.md#tables. The eleven tables keep the
original store's names, columns and composite keys, so a file written by the
original Rust store is adopted as it is (:mod:`agentkeep.runtime.adoption`).
Built by ``alembic/versions/runtime_0001_baseline.py``; the drift check keeps
the two equal.

* Payload columns are ``LargeBinary`` (``BLOB`` / ``bytea``): the store treats
  them as opaque bytes and compares them byte for byte. A ``TEXT`` value found
  in one (a SQLite file edited by hand) is read as its UTF-8 bytes.
* Every query is an exact lookup on, or a prefix scan of, a primary key
  (``runtime_id`` leads every runtime-scoped key), except the outbox's pending
  list, which has its own index (revision ``runtime_0002``; the original
  store had none, and finalized tombstones are never deleted:
  docs/decisions.md#outbox-pending-index).
* Text key columns that a list orders by (``input_id``, ``mob_id``, the outbox
  key) use the ``"C"`` collation on Postgres, so lists come back in byte order
  as on SQLite whatever the database's locale.
* The legacy migrator's audit table is not here: the migrator creates it on
  demand (docs/legacy-migration.md#the-audit-table), so a dry run creates
  nothing.

Invariants (kept by the repositories, never by these declarations alone):
outbox rows are never deleted and only move ``pending`` → ``finalized``;
retired-epoch rows are never deleted; a mob never has both a binding and a
revocation receipt (written through the API).
"""

from __future__ import annotations

from typing import Final

from sqlalchemy import CheckConstraint, Index, LargeBinary, Text
from sqlalchemy.orm import Mapped, mapped_column

from agentkeep.base import BIGINT, Base

__all__ = [
    "ORDERED_TEXT",
    "AuthOAuthFlowStateRow",
    "BoundaryReceiptRow",
    "CompactionProjectionOutboxRow",
    "InputStateRow",
    "MobHostBindingRow",
    "MobHostRevocationRow",
    "OpsLifecycleRow",
    "ProjectionQuarantineRow",
    "RetiredOpsEpochRow",
    "RuntimeStateRow",
    "SessionSnapshotRow",
    "RUNTIME_TABLES",
]

#: Text compared and ordered byte-wise on both dialects (``COLLATE "C"`` on Postgres).
ORDERED_TEXT: Final = Text().with_variant(Text(collation="C"), "postgresql")


class InputStateRow(Base):
    """Per-input lifecycle state (``StoredInputState`` JSON), upserted by input id."""

    __tablename__ = "runtime_input_states"

    runtime_id: Mapped[str] = mapped_column(Text, primary_key=True)
    input_id: Mapped[str] = mapped_column(ORDERED_TEXT, primary_key=True)
    state_json: Mapped[bytes] = mapped_column(LargeBinary, nullable=False)


class BoundaryReceiptRow(Base):
    """One receipt per committed run boundary; insert-only (the boundary's idempotency fence).

    ``sequence`` is the u64 receipt sequence stored as the i64 with the same
    bit pattern (docs/runtime.md#receipt-sequence-encoding).
    """

    __tablename__ = "runtime_boundary_receipts"

    runtime_id: Mapped[str] = mapped_column(Text, primary_key=True)
    run_id: Mapped[str] = mapped_column(Text, primary_key=True)
    sequence: Mapped[int] = mapped_column(BIGINT, primary_key=True, autoincrement=False)
    receipt_json: Mapped[bytes] = mapped_column(LargeBinary, nullable=False)


class SessionSnapshotRow(Base):
    """The authoritative serialized session (the head) of a runtime."""

    __tablename__ = "runtime_session_snapshots"

    runtime_id: Mapped[str] = mapped_column(Text, primary_key=True)
    session_snapshot: Mapped[bytes] = mapped_column(LargeBinary, nullable=False)


class RuntimeStateRow(Base):
    """The machine lifecycle store record of a runtime (opaque versioned bytes)."""

    __tablename__ = "runtime_states"

    runtime_id: Mapped[str] = mapped_column(Text, primary_key=True)
    runtime_state_json: Mapped[bytes] = mapped_column(LargeBinary, nullable=False)


class OpsLifecycleRow(Base):
    """At most one persisted ops-lifecycle snapshot per runtime, owned by its ``epoch_id``."""

    __tablename__ = "runtime_ops_lifecycle"

    runtime_id: Mapped[str] = mapped_column(Text, primary_key=True)
    state_json: Mapped[bytes] = mapped_column(LargeBinary, nullable=False)


class RetiredOpsEpochRow(Base):
    """Tombstone of an ops epoch retired by unregister finalization; never deleted."""

    __tablename__ = "runtime_retired_ops_epochs"

    runtime_id: Mapped[str] = mapped_column(Text, primary_key=True)
    epoch_id: Mapped[str] = mapped_column(Text, primary_key=True)


class AuthOAuthFlowStateRow(Base):
    """The global OAuth login-flow singleton (``id = 'auth_oauth_flow_state'``)."""

    __tablename__ = "runtime_auth_oauth_flow_state"

    id: Mapped[str] = mapped_column(Text, primary_key=True)
    state_json: Mapped[bytes] = mapped_column(LargeBinary, nullable=False)


class ProjectionQuarantineRow(Base):
    """Durable marker: the runtime's snapshot was cleared because it was rejected."""

    __tablename__ = "runtime_projection_quarantine"

    runtime_id: Mapped[str] = mapped_column(Text, primary_key=True)


class CompactionProjectionOutboxRow(Base):
    """Transactional outbox of compaction projections; a finalized row is a tombstone."""

    __tablename__ = "runtime_compaction_projection_outbox"
    __table_args__ = (
        CheckConstraint("state IN ('pending','finalized')", name="state"),
        # The pending list (WHERE runtime_id = ? AND state = 'pending' ORDER BY
        # the key) as a range scan, however many finalized tombstones pile up.
        Index(
            "ix_runtime_compaction_projection_outbox_pending",
            "runtime_id",
            "state",
            "session_id",
            "parent_revision",
            "revision",
            "commit_fingerprint",
        ),
    )

    runtime_id: Mapped[str] = mapped_column(Text, primary_key=True)
    session_id: Mapped[str] = mapped_column(ORDERED_TEXT, primary_key=True)
    parent_revision: Mapped[str] = mapped_column(ORDERED_TEXT, primary_key=True)
    revision: Mapped[str] = mapped_column(ORDERED_TEXT, primary_key=True)
    commit_fingerprint: Mapped[str] = mapped_column(ORDERED_TEXT, primary_key=True)
    intent_json: Mapped[bytes] = mapped_column(LargeBinary, nullable=False)
    state: Mapped[str] = mapped_column(Text, nullable=False)


class MobHostBindingRow(Base):
    """The active host-binding record of a mob (global); updated compare-on-bytes."""

    __tablename__ = "runtime_mob_host_bindings"

    mob_id: Mapped[str] = mapped_column(ORDERED_TEXT, primary_key=True)
    record_json: Mapped[bytes] = mapped_column(LargeBinary, nullable=False)


class MobHostRevocationRow(Base):
    """The receipt of a mob's last completed revoke (answers an exact retry)."""

    __tablename__ = "runtime_mob_host_revocations"

    mob_id: Mapped[str] = mapped_column(ORDERED_TEXT, primary_key=True)
    receipt_json: Mapped[bytes] = mapped_column(LargeBinary, nullable=False)


#: The runtime store's tables, in the order of the original store's DDL.
RUNTIME_TABLES: Final = (
    InputStateRow.__tablename__,
    BoundaryReceiptRow.__tablename__,
    SessionSnapshotRow.__tablename__,
    RuntimeStateRow.__tablename__,
    OpsLifecycleRow.__tablename__,
    RetiredOpsEpochRow.__tablename__,
    AuthOAuthFlowStateRow.__tablename__,
    ProjectionQuarantineRow.__tablename__,
    CompactionProjectionOutboxRow.__tablename__,
    MobHostBindingRow.__tablename__,
    MobHostRevocationRow.__tablename__,
)
