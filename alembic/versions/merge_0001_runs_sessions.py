"""Merge the runs and sessions branches into the single head.

Revision ID: merge_0001
Revises: runs_0006, sessions_0001
"""

from __future__ import annotations

revision = "merge_0001"
down_revision = ("runs_0006", "sessions_0001")
branch_labels = None
depends_on = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
