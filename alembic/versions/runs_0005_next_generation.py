"""runs: next_generation (L3, parity with the original store's last schema).

Revision ID: runs_0005
Revises: runs_0004
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "runs_0005"
down_revision = "runs_0004"
branch_labels = None
depends_on = None

BIGINT = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.add_column(
        "runs",
        sa.Column("next_generation", BIGINT, nullable=False, server_default=sa.text("0")),
    )


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("next_generation")
