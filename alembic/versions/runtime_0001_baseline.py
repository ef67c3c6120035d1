"""runtime: the eleven tables of the runtime store (spec runtime §1.14).

Exactly the seed's tables, names, columns and composite keys (payloads are
BLOB / bytea). Ordered text keys use the "C" collation on Postgres so lists
come back in byte order as on SQLite. The legacy migrator's audit table is
not part of the schema (§1.12). Literal definitions only.

Revision ID: runtime_0001
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "runtime_0001"
down_revision = None
branch_labels = ("runtime",)
depends_on = None

BIGINT = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
ORDERED = sa.Text().with_variant(sa.Text(collation="C"), "postgresql")
BLOB = sa.LargeBinary()


def upgrade() -> None:
    op.create_table(
        "runtime_input_states",
        sa.Column("runtime_id", sa.Text(), nullable=False),
        sa.Column("input_id", ORDERED, nullable=False),
        sa.Column("state_json", BLOB, nullable=False),
        sa.PrimaryKeyConstraint("runtime_id", "input_id", name="pk_runtime_input_states"),
    )
    op.create_table(
        "runtime_boundary_receipts",
        sa.Column("runtime_id", sa.Text(), nullable=False),
        sa.Column("run_id", sa.Text(), nullable=False),
        sa.Column("sequence", BIGINT, autoincrement=False, nullable=False),
        sa.Column("receipt_json", BLOB, nullable=False),
        sa.PrimaryKeyConstraint(
            "runtime_id", "run_id", "sequence", name="pk_runtime_boundary_receipts"
        ),
    )
    op.create_table(
        "runtime_session_snapshots",
        sa.Column("runtime_id", sa.Text(), nullable=False),
        sa.Column("session_snapshot", BLOB, nullable=False),
        sa.PrimaryKeyConstraint("runtime_id", name="pk_runtime_session_snapshots"),
    )
    op.create_table(
        "runtime_states",
        sa.Column("runtime_id", sa.Text(), nullable=False),
        sa.Column("runtime_state_json", BLOB, nullable=False),
        sa.PrimaryKeyConstraint("runtime_id", name="pk_runtime_states"),
    )
    op.create_table(
        "runtime_ops_lifecycle",
        sa.Column("runtime_id", sa.Text(), nullable=False),
        sa.Column("state_json", BLOB, nullable=False),
        sa.PrimaryKeyConstraint("runtime_id", name="pk_runtime_ops_lifecycle"),
    )
    op.create_table(
        "runtime_retired_ops_epochs",
        sa.Column("runtime_id", sa.Text(), nullable=False),
        sa.Column("epoch_id", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("runtime_id", "epoch_id", name="pk_runtime_retired_ops_epochs"),
    )
    op.create_table(
        "runtime_auth_oauth_flow_state",
        sa.Column("id", sa.Text(), nullable=False),
        sa.Column("state_json", BLOB, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_runtime_auth_oauth_flow_state"),
    )
    op.create_table(
        "runtime_projection_quarantine",
        sa.Column("runtime_id", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("runtime_id", name="pk_runtime_projection_quarantine"),
    )
    op.create_table(
        "runtime_compaction_projection_outbox",
        sa.Column("runtime_id", sa.Text(), nullable=False),
        sa.Column("session_id", ORDERED, nullable=False),
        sa.Column("parent_revision", ORDERED, nullable=False),
        sa.Column("revision", ORDERED, nullable=False),
        sa.Column("commit_fingerprint", ORDERED, nullable=False),
        sa.Column("intent_json", BLOB, nullable=False),
        sa.Column("state", sa.Text(), nullable=False),
        sa.CheckConstraint(
            "state IN ('pending','finalized')",
            name="ck_runtime_compaction_projection_outbox_state",
        ),
        sa.PrimaryKeyConstraint(
            "runtime_id",
            "session_id",
            "parent_revision",
            "revision",
            "commit_fingerprint",
            name="pk_runtime_compaction_projection_outbox",
        ),
    )
    op.create_table(
        "runtime_mob_host_bindings",
        sa.Column("mob_id", ORDERED, nullable=False),
        sa.Column("record_json", BLOB, nullable=False),
        sa.PrimaryKeyConstraint("mob_id", name="pk_runtime_mob_host_bindings"),
    )
    op.create_table(
        "runtime_mob_host_revocations",
        sa.Column("mob_id", ORDERED, nullable=False),
        sa.Column("receipt_json", BLOB, nullable=False),
        sa.PrimaryKeyConstraint("mob_id", name="pk_runtime_mob_host_revocations"),
    )


def downgrade() -> None:
    for table in (
        "runtime_mob_host_revocations",
        "runtime_mob_host_bindings",
        "runtime_compaction_projection_outbox",
        "runtime_projection_quarantine",
        "runtime_auth_oauth_flow_state",
        "runtime_retired_ops_epochs",
        "runtime_ops_lifecycle",
        "runtime_states",
        "runtime_session_snapshots",
        "runtime_boundary_receipts",
        "runtime_input_states",
    ):
        op.drop_table(table)
