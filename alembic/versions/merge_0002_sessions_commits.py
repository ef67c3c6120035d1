"""Merge the session store's commit half into the single head.

Revision ID: merge_0002
Revises: merge_0001, sessions_0002
"""

from __future__ import annotations

revision = "merge_0002"
down_revision = ("merge_0001", "sessions_0002")
branch_labels = None
depends_on = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
