"""runs: degradations_json (L1, worker-degradation reporting).

Revision ID: runs_0002
Revises: runs_0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "runs_0002"
down_revision = "runs_0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "runs",
        sa.Column("degradations_json", sa.Text(), nullable=False, server_default="[]"),
    )


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("degradations_json")
