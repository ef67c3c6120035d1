"""Merge the sessions branch's ledger totals into the single head.

Revision ID: merge_0005
Revises: merge_0004, sessions_0004
"""

from __future__ import annotations

revision = "merge_0005"
down_revision = ("merge_0004", "sessions_0004")
branch_labels = None
depends_on = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
