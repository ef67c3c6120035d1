"""runs: seq, an insertion counter that is never reused (port only).

Replaces the implicit ``rowid`` tie-break, which Postgres does not have and
VACUUM may renumber. Existing rows keep their rowid order (SQLite) or get
``created_at, id`` order (Postgres). Adds the indexes of the list queries.

* SQLite: ``seq INTEGER NULL`` (NOT NULL would need a table rebuild), the
  one-row ``runs_seq_counter`` holding the last seq handed out, and the trigger
  ``runs_seq_fill`` that numbers every row inserted without a seq, including
  rows an older writer inserts.
* Postgres: ``seq BIGINT`` defaulting to the sequence ``runs_seq_seq``.

The plain SQL below names its tables and the sequence in agentkeep's schema
when the migration runs in one (``agentkeep.migrate(..., schema=...)``: the
version table's schema); agentkeep also sets ``search_path`` to that schema
for the run. On SQLite a namespace is a file of its own, so names stay
unqualified (a trigger may not name another schema anyway).

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


def _q(name: str) -> str:
    """``name`` in the schema this migration runs in (unqualified in the default one)."""
    schema = op.get_context().version_table_schema
    return f'"{schema}".{name}' if schema else name


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
        runs, seq = _q("runs"), _q("runs_seq_seq")
        op.execute(f"CREATE SEQUENCE {seq} OWNED BY {runs}.seq")
        op.execute(
            f"UPDATE {runs} SET seq = s.n FROM ("
            f" SELECT id, row_number() OVER (ORDER BY created_at, id) AS n FROM {runs}"
            f") AS s WHERE {runs}.id = s.id"
        )
        op.execute(f"SELECT setval('{seq}', COALESCE((SELECT MAX(seq) FROM {runs}), 0) + 1, false)")
        op.execute(f"ALTER TABLE {runs} ALTER COLUMN seq SET DEFAULT nextval('{seq}')")
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
            "INSERT INTO runs_seq_counter (id, last_seq) SELECT 1, COALESCE(MAX(seq), 0) FROM runs"
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
