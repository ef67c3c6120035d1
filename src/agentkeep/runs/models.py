"""Tables of the run store: ``runs`` (and, on SQLite, its ``seq`` counter).

The column names and declared types are the original SQLite store's, so an
un-versioned file written by it can be adopted (docs/runs.md#the-runs-table,
docs/runs.md#adopting-legacy-files). The revisions that build these tables are
``alembic/versions/runs_000*.py``; this module is the same schema, and the
drift check keeps the two equal.

Invariants:

* ``status`` holds the JSON text of a :class:`~agentkeep.runs.domain.RunStatus`
  with its quotes (``"running"``); fences and filters compare it byte for byte.
* ``current_json`` is SQL NULL when no slot is held, never ``{}``.
* ``seq`` is an insertion counter that is never reused: on SQLite the trigger
  ``runs_seq_fill`` assigns it from ``runs_seq_counter`` to every row inserted
  without one (including rows written by the original store); on Postgres the
  sequence ``runs_seq_seq`` is its default. The column stays nullable because
  SQLite cannot add a NOT NULL column without rebuilding a shared table.
"""

from __future__ import annotations

from sqlalchemy import CheckConstraint, Index, Integer, Sequence, Text, text
from sqlalchemy.orm import Mapped, mapped_column

from agentkeep.base import BIGINT, Base

__all__ = ["Run", "RunsSeqCounter", "RUNS_SEQ"]

RUNS_SEQ = Sequence("runs_seq_seq")


class Run(Base):
    """One run: status, step and degradation logs, assignment slots."""

    __tablename__ = "runs"

    id: Mapped[str] = mapped_column(Text, primary_key=True)
    task_id: Mapped[str] = mapped_column(Text, nullable=False)
    status: Mapped[str] = mapped_column(Text, nullable=False)
    step_entries_json: Mapped[str] = mapped_column(Text, nullable=False)
    degradations_json: Mapped[str] = mapped_column(Text, nullable=False, server_default="[]")
    operator_sid: Mapped[str | None] = mapped_column(Text)
    current_json: Mapped[str | None] = mapped_column(Text)
    next_generation: Mapped[int] = mapped_column(BIGINT, nullable=False, server_default=text("0"))
    result_ref_json: Mapped[str | None] = mapped_column(Text)
    input_json: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[int] = mapped_column(BIGINT, nullable=False)
    updated_at: Mapped[int] = mapped_column(BIGINT, nullable=False)
    seq: Mapped[int | None] = mapped_column(BIGINT, RUNS_SEQ, nullable=True)

    __table_args__ = (
        # The original store's index, kept by name and shape for adoption.
        Index("ix_runs_task_id", "task_id", "created_at"),
        Index("ux_runs_seq", "seq", unique=True),
        # list(): ORDER BY created_at DESC, seq DESC.
        Index("ix_runs_created_at_seq", "created_at", "seq"),
        # list(status=...) and list_running().
        Index("ix_runs_status_created_at_seq", "status", "created_at", "seq"),
    )


class RunsSeqCounter(Base):
    """SQLite only: the last ``runs.seq`` handed out, so a seq is never reused."""

    __tablename__ = "runs_seq_counter"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    last_seq: Mapped[int] = mapped_column(BIGINT, nullable=False)

    __table_args__ = (
        CheckConstraint("id = 1", name="single_row"),
        {"info": {"dialects": {"sqlite"}}},
    )
