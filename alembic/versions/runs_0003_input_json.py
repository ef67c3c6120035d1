"""runs: input_json (L2, the opaque launch-input snapshot).

Revision ID: runs_0003
Revises: runs_0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "runs_0003"
down_revision = "runs_0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("runs", sa.Column("input_json", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("input_json")
