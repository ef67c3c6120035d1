"""runs: seq, an insertion counter that is never reused (port only).

Replaces the implicit ``rowid`` tie-break, which Postgres does not have and
VACUUM may renumber. Existing rows keep their rowid order (SQLite) or get
``created_at, id`` order (Postgres). Adds the indexes of the list queries.

* SQLite: ``seq INTEGER NULL`` (NOT NULL would need a table rebuild), the
  one-row ``runs_seq_counter`` holding the last seq handed out, and the trigger
  ``runs_seq_fill`` that numbers every row inserted without a seq, including
  rows an older writer inserts.
* Postgres: ``seq BIGINT`` defaulting to the sequence ``runs_seq_seq``.

Revision ID: runs_0006
Revises: runs_0005
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "runs_0006"
down_revision = "runs_0005"
branch_labels = None
depends_on = None

BIGINT = sa.BigInteger().with_variant(sa.Integer(), "sqlite")

_SQLITE_TRIGGER = """
CREATE TRIGGER runs_seq_fill AFTER INSERT ON runs
FOR EACH ROW WHEN NEW.seq IS NULL
BEGIN
    UPDATE runs_seq_counter SET last_seq = last_seq + 1 WHERE id = 1;
    UPDATE runs SET seq = (SELECT last_seq FROM runs_seq_counter WHERE id = 1)
     WHERE rowid = NEW.rowid;
END
"""


def upgrade() -> None:
    op.add_column("runs", sa.Column("seq", BIGINT, nullable=True))
    if op.get_bind().dialect.name == "postgresql":
        op.execute("CREATE SEQUENCE runs_seq_seq OWNED BY runs.seq")
        op.execute(
            "UPDATE runs SET seq = s.n FROM ("
            " SELECT id, row_number() OVER (ORDER BY created_at, id) AS n FROM runs"
            ") AS s WHERE runs.id = s.id"
        )
        op.execute(
            "SELECT setval('runs_seq_seq', COALESCE((SELECT MAX(seq) FROM runs), 0) + 1, false)"
        )
        op.execute("ALTER TABLE runs ALTER COLUMN seq SET DEFAULT nextval('runs_seq_seq')")
    else:
        op.execute("UPDATE runs SET seq = rowid")
        op.create_table(
            "runs_seq_counter",
            sa.Column("id", sa.Integer(), autoincrement=False, nullable=False),
            sa.Column("last_seq", BIGINT, nullable=False),
            sa.CheckConstraint("id = 1", name=op.f("ck_runs_seq_counter_single_row")),
            sa.PrimaryKeyConstraint("id", name="pk_runs_seq_counter"),
        )
        op.execute(
            "INSERT INTO runs_seq_counter (id, last_seq) "
            "SELECT 1, COALESCE(MAX(seq), 0) FROM runs"
        )
        op.execute(_SQLITE_TRIGGER)
    op.create_index("ux_runs_seq", "runs", ["seq"], unique=True)
    op.create_index("ix_runs_created_at_seq", "runs", ["created_at", "seq"])
    op.create_index("ix_runs_status_created_at_seq", "runs", ["status", "created_at", "seq"])


def downgrade() -> None:
    op.drop_index("ix_runs_status_created_at_seq", table_name="runs")
    op.drop_index("ix_runs_created_at_seq", table_name="runs")
    op.drop_index("ux_runs_seq", table_name="runs")
    if op.get_bind().dialect.name == "postgresql":
        op.drop_column("runs", "seq")  # drops the owned sequence with it
    else:
        op.execute("DROP TRIGGER runs_seq_fill")
        op.drop_table("runs_seq_counter")
        with op.batch_alter_table("runs") as batch:
            batch.drop_column("seq")
