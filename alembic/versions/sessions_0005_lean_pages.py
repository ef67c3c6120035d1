"""sessions: fewer pages per write (no AUTOINCREMENT on graph_nodes, usage_deltas; partial index).

Measured with ``benchmarks/bench_pages.py`` (WAL frames per operation, split by
owning b-tree), an agent turn commit wrote ~14 pages and an ``AgentkeepSaver``
put ~10, where LangGraph's ``SqliteSaver`` writes 4 per put. Two of those
pages were bookkeeping no reader needs:

* ``sqlite_sequence`` (SQLite only): ``AUTOINCREMENT`` on ``graph_nodes`` and
  ``usage_deltas`` makes every insert rewrite the table's row in
  ``sqlite_sequence``, one more page per commit. ``seq`` is only an order
  within a session (full-graph loads, the active-path walk, the inspection
  views, the ledger's first-appearance order), never a cursor kept outside
  the database; without ``AUTOINCREMENT`` a new row still gets
  ``max(seq) + 1``, above every row that exists, so the order of the rows of
  a session is unchanged. What changes: a ``seq`` freed by deleting the rows
  holding the highest ones (``delete_session`` of the newest session,
  ``delete_nodes_for_runs``) may be handed out again to a later row, which
  nothing depends on. SQLite cannot drop ``AUTOINCREMENT`` in place, so both
  tables are rebuilt (``batch_alter_table``: create, copy, drop, rename, then
  the indexes); on Postgres ``seq`` is a sequence and nothing changes.
* ``ix_graph_nodes_run_id`` becomes partial (``WHERE run_id IS NOT NULL``), on
  both dialects: only checkpoint nodes written under a run carry a
  ``run_id``; turn nodes (and saver nodes without one) no longer add an entry.
  Its only readers, ``delete_nodes_for_runs``' ``run_id IN (...)``, imply the
  predicate, so SQLite's planner and Postgres' (a strict operator) still use
  the index (checked with ``EXPLAIN QUERY PLAN``).

Cost of the rebuild on SQLite: one copy of every ``graph_nodes`` and
``usage_deltas`` row and a rebuild of their indexes, in the migration's
transaction: time in proportion to the two tables (node bodies included), the
file grows by their size until the old pages are reused, and the WAL holds
the copy until the next checkpoint. Writers wait on the migration lock
meanwhile. Measured: a 131 MB file of 300,000 nodes (~330-byte bodies) and
100,000 usage rows upgraded in 1.8 s (2 shared cores, loaded) and grew to
250 MB (the old pages on the free list). Postgres only swaps one index
(``DROP INDEX``/``CREATE INDEX``, holding the table's write lock for the
index build).

The revision follows ``merge_0005`` (the single head) instead of branching
from ``sessions_0004`` and merging: it is then the head itself, and
``downgrade merge_0005`` undoes it alone. It narrows decision 8 of the port
("insertion-order columns are never reused") for these two ``seq`` columns
only (docs/decisions.md#insertion-order-is-never-reused); ``enqueue_seq``,
which claim ids carry, keeps ``AUTOINCREMENT``.

Downgrade restores ``AUTOINCREMENT`` (SQLite rebuild; the new
``sqlite_sequence`` row starts at the table's largest ``seq``) and the full
index.

Revision ID: sessions_0005
Revises: merge_0005
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "sessions_0005"
down_revision = "merge_0005"
branch_labels = None
depends_on = None

BIGINT = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
ZERO = sa.text("0")
RUN_ID_SET = "run_id IS NOT NULL"
COUNTERS = (
    "input_tokens",
    "output_tokens",
    "cache_read_input_tokens",
    "cache_write_input_tokens",
    "reasoning_output_tokens",
)


def _graph_nodes(autoincrement: bool) -> sa.Table:
    """graph_nodes as sessions_0002 + sessions_0003 built it, with its indexes."""
    where = None if autoincrement else sa.text(RUN_ID_SET)
    return sa.Table(
        "graph_nodes",
        sa.MetaData(),
        sa.Column("seq", BIGINT, autoincrement=True, nullable=False),
        sa.Column("session_id", sa.Text(), nullable=False),
        sa.Column("node_id", sa.Text(), nullable=False),
        sa.Column("parent_node_id", sa.Text(), nullable=True),
        sa.Column("node_json", sa.Text(), nullable=False),
        sa.Column("tombstoned", BIGINT, nullable=False, server_default=ZERO),
        sa.Column("blob_ref", sa.Text(), nullable=True),
        sa.Column("run_id", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("seq", name="pk_graph_nodes"),
        sa.UniqueConstraint("session_id", "node_id", name="uq_graph_nodes_session_id_node_id"),
        sa.Index("ix_graph_nodes_session_tombstoned_seq", "session_id", "tombstoned", "seq"),
        sa.Index("ix_graph_nodes_run_id", "run_id", sqlite_where=where),
        sqlite_autoincrement=autoincrement,
    )


def _usage_deltas(autoincrement: bool) -> sa.Table:
    """usage_deltas as sessions_0002 built it, with its index."""
    return sa.Table(
        "usage_deltas",
        sa.MetaData(),
        sa.Column("seq", BIGINT, autoincrement=True, nullable=False),
        sa.Column("session_id", sa.Text(), nullable=False),
        sa.Column("source", sa.Text(), nullable=False),
        sa.Column("model", sa.Text(), nullable=False),
        *(sa.Column(name, BIGINT, nullable=False) for name in COUNTERS),
        sa.PrimaryKeyConstraint("seq", name="pk_usage_deltas"),
        sa.Index("ix_usage_deltas_session_seq", "session_id", "seq"),
        sqlite_autoincrement=autoincrement,
    )


def _rebuild(table: sa.Table) -> None:
    """Recreate ``table`` on SQLite from its literal definition, rows and seq kept."""
    with op.batch_alter_table(table.name, copy_from=table, recreate="always"):
        pass


def upgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        _rebuild(_graph_nodes(autoincrement=False))
        _rebuild(_usage_deltas(autoincrement=False))
        return
    op.drop_index("ix_graph_nodes_run_id", table_name="graph_nodes")
    op.create_index(
        "ix_graph_nodes_run_id", "graph_nodes", ["run_id"], postgresql_where=sa.text(RUN_ID_SET)
    )


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        _rebuild(_graph_nodes(autoincrement=True))
        _rebuild(_usage_deltas(autoincrement=True))
        return
    op.drop_index("ix_graph_nodes_run_id", table_name="graph_nodes")
    op.create_index("ix_graph_nodes_run_id", "graph_nodes", ["run_id"])
