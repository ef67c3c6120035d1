"""runtime: index the compaction outbox's pending list.

``load_pending_compaction_projections`` reads ``WHERE runtime_id = ? AND
state = 'pending' ORDER BY session_id, parent_revision, revision,
commit_fingerprint``. Finalized rows are tombstones that are never deleted, so
without this index the list would scan every tombstone of the runtime and
slow down as the runtime ages; with it the list is a range scan in order.
(Not in the seed's DDL: an adopted file gets it from this revision.)

Revision ID: runtime_0002
Revises: runtime_0001
"""

from __future__ import annotations

from alembic import op

revision = "runtime_0002"
down_revision = "runtime_0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index(
        "ix_runtime_compaction_projection_outbox_pending",
        "runtime_compaction_projection_outbox",
        ["runtime_id", "state", "session_id", "parent_revision", "revision", "commit_fingerprint"],
    )


def downgrade() -> None:
    op.drop_index(
        "ix_runtime_compaction_projection_outbox_pending",
        table_name="runtime_compaction_projection_outbox",
    )
