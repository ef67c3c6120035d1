"""sessions: head, graph, usage ledger, turn commits, attachments, blobs, artifact refs, meta.

The commit half of the session store, keyed by ``session_id`` (blobs and
artifact refs are global, content-addressed). Literal definitions only.

Revision ID: sessions_0002
Revises: sessions_0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "sessions_0002"
down_revision = "sessions_0001"
branch_labels = None
depends_on = None

BIGINT = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
ZERO = sa.text("0")


def upgrade() -> None:
    op.create_table(
        "session_head",
        sa.Column("session_id", sa.Text(), nullable=False),
        sa.Column("schema_version", BIGINT, nullable=False),
        sa.Column("head_revision", BIGINT, nullable=False, server_default=ZERO),
        sa.Column("leaf_node_id", sa.Text(), nullable=True),
        sa.Column("checkpoint_ref", sa.Text(), nullable=False),
        sa.Column("config_json", sa.Text(), nullable=False),
        sa.Column("agent_frames_json", sa.Text(), nullable=False),
        sa.Column("current_agent_frame_id", sa.Text(), nullable=True),
        sa.Column("graph_node_count", BIGINT, nullable=False, server_default=ZERO),
        sa.PrimaryKeyConstraint("session_id", name="pk_session_head"),
    )
    op.create_table(
        "graph_nodes",
        sa.Column("seq", BIGINT, autoincrement=True, nullable=False),
        sa.Column("session_id", sa.Text(), nullable=False),
        sa.Column("node_id", sa.Text(), nullable=False),
        sa.Column("parent_node_id", sa.Text(), nullable=True),
        sa.Column("node_json", sa.Text(), nullable=False),
        sa.Column("tombstoned", BIGINT, nullable=False, server_default=ZERO),
        sa.PrimaryKeyConstraint("seq", name="pk_graph_nodes"),
        sa.UniqueConstraint("session_id", "node_id", name="uq_graph_nodes_session_id_node_id"),
        sqlite_autoincrement=True,
    )
    op.create_index(
        "ix_graph_nodes_session_tombstoned_seq", "graph_nodes", ["session_id", "tombstoned", "seq"]
    )
    op.create_table(
        "usage_deltas",
        sa.Column("seq", BIGINT, autoincrement=True, nullable=False),
        sa.Column("session_id", sa.Text(), nullable=False),
        sa.Column("source", sa.Text(), nullable=False),
        sa.Column("model", sa.Text(), nullable=False),
        sa.Column("input_tokens", BIGINT, nullable=False),
        sa.Column("output_tokens", BIGINT, nullable=False),
        sa.Column("cache_read_input_tokens", BIGINT, nullable=False),
        sa.Column("cache_write_input_tokens", BIGINT, nullable=False),
        sa.Column("reasoning_output_tokens", BIGINT, nullable=False),
        sa.PrimaryKeyConstraint("seq", name="pk_usage_deltas"),
        sqlite_autoincrement=True,
    )
    op.create_index("ix_usage_deltas_session_seq", "usage_deltas", ["session_id", "seq"])
    op.create_table(
        "runtime_turn_commits",
        sa.Column("session_id", sa.Text(), nullable=False),
        sa.Column("turn_id", sa.Text(), nullable=False),
        sa.Column("turn_commit_hash", sa.Text(), nullable=False),
        sa.Column("result_json", sa.Text(), nullable=False),
        sa.Column("checkpoint_ref", sa.Text(), nullable=False),
        sa.Column("committed_at_ms", BIGINT, nullable=False),
        sa.PrimaryKeyConstraint("session_id", "turn_id", name="pk_runtime_turn_commits"),
    )
    op.create_table(
        "attachment_manifest",
        sa.Column("session_id", sa.Text(), nullable=False),
        sa.Column("attachment_id", sa.Text(), nullable=False),
        sa.Column("canonical_uri", sa.Text(), nullable=False),
        sa.Column("intent_at_ms", BIGINT, nullable=False),
        sa.Column("committed_at_ms", BIGINT, nullable=True),
        sa.Column("owner_kind", sa.Text(), nullable=True),
        sa.Column("owner_id", sa.Text(), nullable=True),
        sa.CheckConstraint(
            "(owner_kind IS NULL AND owner_id IS NULL) OR "
            "(owner_kind IN ('turn', 'process') AND owner_id IS NOT NULL)",
            name=op.f("ck_attachment_manifest_owner"),
        ),
        sa.PrimaryKeyConstraint("session_id", "attachment_id", name="pk_attachment_manifest"),
    )
    op.create_table(
        "blobs",
        sa.Column("hash", sa.Text(), nullable=False),
        sa.Column("kind", sa.Text(), nullable=False),
        sa.Column("compression", sa.Text(), nullable=False),
        sa.Column("content", sa.LargeBinary(), nullable=False),
        sa.CheckConstraint(
            "compression IN ('none', 'zlib')", name=op.f("ck_blobs_compression")
        ),
        sa.PrimaryKeyConstraint("hash", name="pk_blobs"),
    )
    op.create_table(
        "artifact_refs",
        sa.Column("namespace", sa.Text(), nullable=False),
        sa.Column("artifact_ref", sa.Text(), nullable=False),
        sa.Column("blob_ref", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("namespace", "artifact_ref", name="pk_artifact_refs"),
    )
    op.create_table(
        "session_meta",
        sa.Column("session_id", sa.Text(), nullable=False),
        sa.Column("session_name", sa.Text(), nullable=False),
        sa.Column("created_at", sa.Text(), nullable=False),
        sa.Column("model", sa.Text(), nullable=False),
        sa.Column("cwd", sa.Text(), nullable=True),
        sa.Column("relation_json", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("session_id", name="pk_session_meta"),
    )


def downgrade() -> None:
    for table in (
        "session_meta",
        "artifact_refs",
        "blobs",
        "attachment_manifest",
        "runtime_turn_commits",
        "usage_deltas",
        "graph_nodes",
        "session_head",
    ):
        op.drop_table(table)
