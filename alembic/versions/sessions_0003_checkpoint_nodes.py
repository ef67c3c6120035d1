"""sessions: checkpoint nodes (graph_nodes.blob_ref, graph_nodes.run_id) and pending writes.

A graph node may name a content-addressed blob holding its body as opaque
bytes (a GC root while the node exists) and the run that wrote it; pending
writes are recorded per (session, node, task, index). Literal definitions only.

Revision ID: sessions_0003
Revises: sessions_0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "sessions_0003"
down_revision = "sessions_0002"
branch_labels = None
depends_on = None

BIGINT = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.add_column("graph_nodes", sa.Column("blob_ref", sa.Text(), nullable=True))
    op.add_column("graph_nodes", sa.Column("run_id", sa.Text(), nullable=True))
    op.create_index("ix_graph_nodes_run_id", "graph_nodes", ["run_id"])
    op.create_table(
        "session_pending_writes",
        sa.Column("session_id", sa.Text(), nullable=False),
        sa.Column("node_id", sa.Text(), nullable=False),
        sa.Column("task_id", sa.Text(), nullable=False),
        sa.Column("write_idx", BIGINT, autoincrement=False, nullable=False),
        sa.Column("channel", sa.Text(), nullable=False),
        sa.Column("value_type", sa.Text(), nullable=False),
        sa.Column("value", sa.LargeBinary(), nullable=False),
        sa.Column("task_path", sa.Text(), nullable=False, server_default=sa.text("''")),
        sa.PrimaryKeyConstraint(
            "session_id", "node_id", "task_id", "write_idx", name="pk_session_pending_writes"
        ),
    )


def downgrade() -> None:
    op.drop_table("session_pending_writes")
    op.drop_index("ix_graph_nodes_run_id", table_name="graph_nodes")
    with op.batch_alter_table("graph_nodes") as batch:
        batch.drop_column("run_id")
        batch.drop_column("blob_ref")
