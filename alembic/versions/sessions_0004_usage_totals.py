"""sessions: the ledger totals, kept by the commit (``session_usage_totals``).

One row per ``(session_id, source, model)`` holding the merged counters of the
session's usage ledger, so that ``load_session`` reads the totals instead of
re-summing every ``usage_deltas`` row. Existing sessions are backfilled with
the merge ``load_session`` computed until now: rows whose four total counters
are all 0 are left out (a reasoning-only row adds nothing), rows a load used
to skip as undecodable (a negative counter; on SQLite a non-integer value) are
left out too, and ``ordinal`` ranks each pair by its first remaining row. A
session whose merged counter would pass ``2**63-1`` (a load of it already
failed with ``SessionCorrupt``) fails the upgrade: SQLite's ``sum()`` raises
"integer overflow", Postgres "bigint out of range".

The plain SQL below names its tables in agentkeep's schema when the migration
runs in one (the version table's schema), as ``runs_0006`` does.

Revision ID: sessions_0004
Revises: sessions_0003
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "sessions_0004"
down_revision = "sessions_0003"
branch_labels = None
depends_on = None

BIGINT = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
COUNTERS = (
    "input_tokens",
    "output_tokens",
    "cache_read_input_tokens",
    "cache_write_input_tokens",
    "reasoning_output_tokens",
)


def _q(name: str) -> str:
    """``name`` in the schema this migration runs in (unqualified in the default one)."""
    schema = op.get_context().version_table_schema
    return f'"{schema}".{name}' if schema else name


def upgrade() -> None:
    op.create_table(
        "session_usage_totals",
        sa.Column("session_id", sa.Text(), nullable=False),
        sa.Column("source", sa.Text(), nullable=False),
        sa.Column("model", sa.Text(), nullable=False),
        sa.Column("ordinal", BIGINT, nullable=False),
        *(sa.Column(name, BIGINT, nullable=False) for name in COUNTERS),
        sa.PrimaryKeyConstraint("session_id", "source", "model", name="pk_session_usage_totals"),
    )
    sqlite = op.get_bind().dialect.name == "sqlite"
    valid = " AND ".join(
        (f"typeof({c}) = 'integer' AND {c} >= 0" if sqlite else f"{c} >= 0") for c in COUNTERS
    )
    nonzero = " OR ".join(f"{c} > 0" for c in COUNTERS[:4])
    columns = ", ".join(COUNTERS)
    sums = ", ".join(f"SUM({c})" for c in COUNTERS)
    op.execute(
        f"INSERT INTO {_q('session_usage_totals')} (session_id, source, model, ordinal, {columns}) "
        f"SELECT session_id, source, model, "
        f"ROW_NUMBER() OVER (PARTITION BY session_id ORDER BY MIN(seq)) - 1, {sums} "
        f"FROM {_q('usage_deltas')} WHERE ({valid}) AND ({nonzero}) "
        f"GROUP BY session_id, source, model"
    )


def downgrade() -> None:
    op.drop_table("session_usage_totals")
