"""Fixtures of the legacy-migrator tests: an empty legacy database per backend.

``legacy_db`` is a :class:`LegacyDb` on a SQLite file that exists but holds
no table yet, or on a fresh Postgres database (the ``fresh_url`` fixture,
dropped afterwards, so the audit table's triggers and function never reach
the shared test database).
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from ._legacy_db import LegacyDb


@pytest.fixture
def legacy_db(backend: str, fresh_url: str, tmp_path: Path) -> LegacyDb:
    if backend == "sqlite":
        path = tmp_path / "sessions.sqlite3"
        sqlite3.connect(path).close()  # an empty, existing database file
        return LegacyDb("sqlite", str(path), f"sqlite:///{path}")
    return LegacyDb("postgres", fresh_url, fresh_url)


@pytest.fixture
def sqlite_db(tmp_path: Path) -> LegacyDb:
    """A :class:`LegacyDb` on an empty SQLite file, for SQLite-only cases."""
    path = tmp_path / "sessions.sqlite3"
    sqlite3.connect(path).close()
    return LegacyDb("sqlite", str(path), f"sqlite:///{path}")
