"""Merge the sessions branch's lean-pages revision into the single head.

Revision ID: merge_0006
Revises: merge_0005, sessions_0005
"""

from __future__ import annotations

revision = "merge_0006"
down_revision = ("merge_0005", "sessions_0005")
branch_labels = None
depends_on = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
