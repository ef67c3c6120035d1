"""A host application of the host-engine and joined-unit tests: its engine, models and rows.

The host builds its engine with plain :func:`sqlalchemy.create_engine` and
SQLAlchemy's defaults (``qmark`` parameters and the driver's own deferred
transactions on pysqlite; psycopg on Postgres), keeps its models in its own
declarative base and hands the engine to ``Store.open(engine)``. Everything
here lives at module level so that spawned racer processes can import it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Engine, Integer, Text, create_engine, delete, select
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column


class HostBase(DeclarativeBase):
    """The host application's own declarative base (not agentkeep's)."""


class HostNote(HostBase):
    """A host row written in the same transaction as agentkeep's writes."""

    __tablename__ = "host_notes"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    run_id: Mapped[str] = mapped_column(Text, nullable=False)
    note: Mapped[str] = mapped_column(Text, nullable=False)


class HostTag(HostBase):
    """A second host model (the host has more than one table)."""

    __tablename__ = "host_tags"

    name: Mapped[str] = mapped_column(Text, primary_key=True)


def host_engine(url: str, **kwargs: Any) -> Engine:
    """The host's engine for ``url``: SQLAlchemy's defaults, nothing agentkeep-specific."""
    return create_engine(url, **kwargs)


def create_host_tables(url: str) -> None:
    """Create the host's tables (empty) on ``url``."""
    engine = create_engine(url)
    try:
        HostBase.metadata.drop_all(engine)
        HostBase.metadata.create_all(engine)
    finally:
        engine.dispose()


def drop_host_tables(url: str) -> None:
    engine = create_engine(url)
    try:
        HostBase.metadata.drop_all(engine)
    finally:
        engine.dispose()


@contextmanager
def host_tables(url: str) -> Iterator[str]:
    """The host's tables exist on ``url`` for the block (the Postgres test database is shared)."""
    create_host_tables(url)
    try:
        yield url
    finally:
        drop_host_tables(url)


def notes(url: str) -> dict[int, tuple[str, str]]:
    """Every committed host note, read on a fresh engine: ``{id: (run_id, note)}``."""
    engine = create_engine(url)
    try:
        with Session(engine) as session:
            return {n.id: (n.run_id, n.note) for n in session.scalars(select(HostNote))}
    finally:
        engine.dispose()


def clear_notes(url: str) -> None:
    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(delete(HostNote))
    finally:
        engine.dispose()
