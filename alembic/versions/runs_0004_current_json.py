"""runs: current_json (L3a, first half of the assignment axis).

Split from runs_0005 on purpose: the original store added the two columns by
separate auto-committed ALTERs, so a crash between them left this shape, which
must be a normal, stampable state.

Revision ID: runs_0004
Revises: runs_0003
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "runs_0004"
down_revision = "runs_0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("runs", sa.Column("current_json", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("current_json")
