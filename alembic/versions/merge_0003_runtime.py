"""Merge the runtime branch into the single head.

Revision ID: merge_0003
Revises: merge_0002, runtime_0002
"""

from __future__ import annotations

revision = "merge_0003"
down_revision = ("merge_0002", "runtime_0002")
branch_labels = None
depends_on = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
