"""runs: baseline, the first released shape (L0).

The eight columns of the original store's first release and its index
``ix_runs_task_id``. Column types are the original's: TEXT, and INTEGER on
SQLite / BIGINT on Postgres. Literal definitions only: history never imports
the live models.

Revision ID: runs_0001
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "runs_0001"
down_revision = None
branch_labels = ("runs",)
depends_on = None

BIGINT = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "runs",
        sa.Column("id", sa.Text(), nullable=False),
        sa.Column("task_id", sa.Text(), nullable=False),
        sa.Column("status", sa.Text(), nullable=False),
        sa.Column("step_entries_json", sa.Text(), nullable=False),
        sa.Column("operator_sid", sa.Text(), nullable=True),
        sa.Column("result_ref_json", sa.Text(), nullable=True),
        sa.Column("created_at", BIGINT, nullable=False),
        sa.Column("updated_at", BIGINT, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_runs"),
    )
    op.create_index("ix_runs_task_id", "runs", ["task_id", "created_at"])


def downgrade() -> None:
    op.drop_index("ix_runs_task_id", table_name="runs")
    op.drop_table("runs")
