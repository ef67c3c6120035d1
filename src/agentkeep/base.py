"""The declarative base shared by every store's models.

One :class:`Base` and one ``MetaData`` with a naming convention, so every
constraint and index has a stable name in migrations on both dialects.
Alembic's ``env.py`` and the drift check compare the migrated database with
``Base.metadata`` after :func:`load_all_models` has imported every store's
``models`` module.

A table that exists on one dialect only (for example a SQLite counter that a
Postgres sequence replaces) carries ``info={"dialects": {...}}``; the drift
check skips it on the other dialects (:func:`table_applies`). See
docs/architecture.md#migrations.
"""

from __future__ import annotations

from typing import Final

from sqlalchemy import BigInteger, Integer, MetaData, Table
from sqlalchemy.orm import DeclarativeBase

__all__ = ["BIGINT", "Base", "load_all_models", "table_applies"]

NAMING_CONVENTION: Final = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_N_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

#: Epoch times, generations, fencing tokens, sequences: BIGINT on Postgres,
#: INTEGER on SQLite (the same 64-bit storage, and the declared type the
#: original SQLite stores used, so adopted files compare equal).
BIGINT: Final = BigInteger().with_variant(Integer(), "sqlite")


class Base(DeclarativeBase):
    """Declarative base of every agentkeep table."""

    metadata = MetaData(naming_convention=NAMING_CONVENTION)


def load_all_models() -> MetaData:
    """Import every store's models so ``Base.metadata`` is complete; return it."""
    from agentkeep.runs import models as _runs  # noqa: F401
    from agentkeep.runtime import models as _runtime  # noqa: F401
    from agentkeep.sessions import models as _sessions  # noqa: F401

    return Base.metadata


def table_applies(table: Table, dialect_name: str) -> bool:
    """True if ``table`` exists on ``dialect_name`` (see the module docstring)."""
    dialects = table.info.get("dialects")
    return dialects is None or dialect_name in dialects
