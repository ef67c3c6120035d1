"""sessions: execution leases, queued work (batches and items) and pending turn inputs.

The coordination half of the session store, keyed by ``session_id`` so one
database holds many sessions. Literal definitions only: history never imports
the live models.

Revision ID: sessions_0001
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "sessions_0001"
down_revision = None
branch_labels = ("sessions",)
depends_on = None

BIGINT = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
ZERO = sa.text("0")


def _claim_columns() -> list[sa.Column]:
    return [
        sa.Column("claim_id", sa.Text(), nullable=True),
        sa.Column("claim_owner_id", sa.Text(), nullable=True),
        sa.Column("claim_owner_incarnation_id", sa.Text(), nullable=True),
        sa.Column("claim_owner_liveness_json", sa.Text(), nullable=True),
        sa.Column("claim_token", sa.Text(), nullable=True),
        sa.Column("claim_fencing_token", BIGINT, nullable=False, server_default=ZERO),
        sa.Column("claim_session_lease_generation", BIGINT, nullable=False, server_default=ZERO),
    ]


def upgrade() -> None:
    op.create_table(
        "session_execution_leases",
        sa.Column("session_id", sa.Text(), nullable=False),
        sa.Column("lease_owner_id", sa.Text(), nullable=True),
        sa.Column("lease_owner_incarnation_id", sa.Text(), nullable=True),
        sa.Column("lease_owner_liveness_json", sa.Text(), nullable=True),
        sa.Column("lease_token", sa.Text(), nullable=True),
        sa.Column("lease_fencing_token", BIGINT, nullable=False, server_default=ZERO),
        sa.Column("lease_claimed_at_ms", BIGINT, nullable=False, server_default=ZERO),
        sa.Column("lease_expires_at_ms", BIGINT, nullable=False, server_default=ZERO),
        sa.PrimaryKeyConstraint("session_id", name="pk_session_execution_leases"),
    )
    op.create_table(
        "queued_work_batches",
        sa.Column("enqueue_seq", BIGINT, autoincrement=True, nullable=False),
        sa.Column("batch_id", sa.Text(), nullable=False),
        sa.Column("session_id", sa.Text(), nullable=False),
        sa.Column("source_key", sa.Text(), nullable=True),
        sa.Column("delivery_policy", sa.Text(), nullable=False),
        sa.Column("slot_policy", sa.Text(), nullable=False),
        sa.Column("merge_key_json", sa.Text(), nullable=False),
        sa.Column("available_at_ms", BIGINT, nullable=False),
        sa.Column("enqueued_at_ms", BIGINT, nullable=False),
        *_claim_columns(),
        sa.PrimaryKeyConstraint("enqueue_seq", name="pk_queued_work_batches"),
        sa.UniqueConstraint("batch_id", name="uq_queued_work_batches_batch_id"),
        sa.UniqueConstraint(
            "session_id", "source_key", name="uq_queued_work_batches_session_id_source_key"
        ),
        sqlite_autoincrement=True,
    )
    op.create_index(
        "ix_queued_work_batches_session_seq", "queued_work_batches", ["session_id", "enqueue_seq"]
    )
    op.create_index(
        "ix_queued_work_batches_session_claim",
        "queued_work_batches",
        ["session_id", "claim_id", "claim_token"],
    )
    op.create_table(
        "queued_work_items",
        sa.Column("batch_id", sa.Text(), nullable=False),
        sa.Column("item_index", BIGINT, autoincrement=False, nullable=False),
        sa.Column("item_id", sa.Text(), nullable=False),
        sa.Column("payload_json", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(
            ["batch_id"],
            ["queued_work_batches.batch_id"],
            name="fk_queued_work_items_batch_id_queued_work_batches",
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("batch_id", "item_index", name="pk_queued_work_items"),
    )
    op.create_table(
        "pending_turn_inputs",
        sa.Column("enqueue_seq", BIGINT, autoincrement=True, nullable=False),
        sa.Column("input_id", sa.Text(), nullable=False),
        sa.Column("session_id", sa.Text(), nullable=False),
        sa.Column("source_key", sa.Text(), nullable=True),
        sa.Column("ingress_json", sa.Text(), nullable=False),
        sa.Column("submitted_ingress_json", sa.Text(), nullable=False),
        sa.Column("state", sa.Text(), nullable=False),
        sa.Column("input_json", sa.Text(), nullable=False),
        sa.Column("enqueued_at_ms", BIGINT, nullable=False),
        *_claim_columns(),
        sa.CheckConstraint(
            "state IN ('pending_active', 'deferred_next_turn', 'accepted', 'cancelled', "
            "'completed')",
            name=op.f("ck_pending_turn_inputs_state"),
        ),
        sa.PrimaryKeyConstraint("enqueue_seq", name="pk_pending_turn_inputs"),
        sa.UniqueConstraint("input_id", name="uq_pending_turn_inputs_input_id"),
        sa.UniqueConstraint(
            "session_id", "source_key", name="uq_pending_turn_inputs_session_id_source_key"
        ),
        sqlite_autoincrement=True,
    )
    op.create_index(
        "ix_pending_turn_inputs_session_state_seq",
        "pending_turn_inputs",
        ["session_id", "state", "enqueue_seq"],
    )
    op.create_index(
        "ix_pending_turn_inputs_session_seq", "pending_turn_inputs", ["session_id", "enqueue_seq"]
    )
    op.create_index(
        "ix_pending_turn_inputs_session_claim",
        "pending_turn_inputs",
        ["session_id", "claim_id", "claim_token"],
    )


def downgrade() -> None:
    op.drop_table("pending_turn_inputs")
    op.drop_table("queued_work_items")
    op.drop_table("queued_work_batches")
    op.drop_table("session_execution_leases")
