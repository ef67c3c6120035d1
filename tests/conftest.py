"""Backend-parametrised fixtures: every backend-dependent test runs on SQLite and Postgres.

* ``backend``: ``"sqlite"`` or ``"postgres"``.
* ``db_url``: a migrated, empty database of that backend for this test (SQLite:
  a WAL file in a temp dir; Postgres: one database per test session, created
  fresh and migrated once, whose agentkeep tables are emptied before each test).
* ``store``: ``Store.open(db_url)`` with a :class:`SettableClock`.
* ``fresh_url``: an *empty, unmigrated* database of that backend (SQLite: a
  file path that does not exist yet; Postgres: a new database per test).

Postgres comes from ``AGENTKEEP_TEST_POSTGRES_URL`` (default
``postgresql+psycopg://postgres@127.0.0.1:5432/postgres``). Without a reachable
server the Postgres cases skip with a loud reason, except under ``CI=true``
where they fail.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, make_url, text

from agentkeep import migrations as migrate
from agentkeep.base import load_all_models, table_applies
from agentkeep.clock import SettableClock
from agentkeep.store import Store

PG_ADMIN_URL = os.environ.get(
    "AGENTKEEP_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
BACKENDS = [b for b in os.environ.get("AGENTKEEP_TEST_BACKENDS", "sqlite,postgres").split(",") if b]

_pg_error: str | None = None
_pg_checked = False


def _pg_reachable() -> str | None:
    global _pg_checked, _pg_error
    if not _pg_checked:
        _pg_checked = True
        try:
            eng = create_engine(PG_ADMIN_URL, connect_args={"connect_timeout": 5})
            with eng.connect() as conn:
                conn.execute(text("SELECT 1"))
            eng.dispose()
        except Exception as exc:  # noqa: BLE001 - any failure means unreachable
            _pg_error = f"{type(exc).__name__}: {exc}"
    return _pg_error


def require_postgres() -> None:
    """Skip (or fail under CI=true) when the Postgres test server is unreachable."""
    err = _pg_reachable()
    if err is not None:
        msg = f"POSTGRES UNREACHABLE at {PG_ADMIN_URL}: {err}"
        if IN_CI:
            pytest.fail(msg + " (CI=true: Postgres tests must run)", pytrace=False)
        pytest.skip(msg)


def create_pg_database(prefix: str = "agentkeep_t") -> str:
    """Create a new empty Postgres database; return its URL."""
    require_postgres()
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    admin.dispose()
    return make_url(PG_ADMIN_URL).set(database=name).render_as_string(hide_password=False)


def drop_pg_database(url: str) -> None:
    name = make_url(url).database
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    if request.param == "postgres":
        require_postgres()
    return str(request.param)


@pytest.fixture(scope="session")
def _pg_session_url() -> Iterator[str]:
    url = create_pg_database("agentkeep_suite")
    migrate.upgrade(url)
    yield url
    drop_pg_database(url)


def _empty_tables(url: str) -> None:
    metadata = load_all_models()
    eng = create_engine(url)
    with eng.begin() as conn:
        for table in reversed(metadata.sorted_tables):
            if table_applies(table, "postgresql"):
                conn.execute(text(f'DELETE FROM "{table.name}"'))
    eng.dispose()


@pytest.fixture
def db_url(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    if backend == "sqlite":
        url = f"sqlite:///{tmp_path / 'agentkeep.db'}"
        migrate.upgrade(url)
        return url
    url: str = request.getfixturevalue("_pg_session_url")
    _empty_tables(url)
    return url


@pytest.fixture
def fresh_url(backend: str, tmp_path: Path) -> Iterator[str]:
    if backend == "sqlite":
        yield f"sqlite:///{tmp_path / 'fresh.db'}"
        return
    url = create_pg_database()
    yield url
    drop_pg_database(url)


@pytest.fixture
def pg_url(backend: str, db_url: str) -> str:
    """``db_url`` on the Postgres backend; skips the SQLite run (round trips are read on the wire).

    Modules that need another Postgres URL (a dedicated database, a
    reachability check of their own) define their own ``pg_url``.
    """
    if backend != "postgres":
        pytest.skip("Postgres only: round trips on the wire")
    return db_url


#: The asyncio drivers of each backend (AsyncStore's native mode).
ASYNC_DRIVERS_OF = {"sqlite": ("aiosqlite",), "postgres": ("asyncpg", "psycopg_async")}
ASYNC_DRIVERS = [d for b in BACKENDS for d in ASYNC_DRIVERS_OF.get(b, ())]


@pytest.fixture(params=ASYNC_DRIVERS)
def async_driver(request: pytest.FixtureRequest) -> str:
    """``"aiosqlite"``, ``"asyncpg"`` or ``"psycopg_async"``."""
    if request.param != "aiosqlite":
        require_postgres()
    return str(request.param)


def as_async_url(url: str, driver: str) -> str:
    """The URL of the same database on the asyncio ``driver``."""
    backend = "sqlite" if driver == "aiosqlite" else "postgresql"
    return make_url(url).set(drivername=f"{backend}+{driver}").render_as_string(hide_password=False)


def as_sync_url(url: str) -> str:
    """The URL of the same database on the synchronous driver (pysqlite, psycopg)."""
    u = make_url(url)
    drivername = "sqlite" if u.get_backend_name() == "sqlite" else "postgresql+psycopg"
    return u.set(drivername=drivername).render_as_string(hide_password=False)


@pytest.fixture
def async_url(async_driver: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    """A migrated, empty database on ``async_driver`` (like ``db_url``; raw SQL: as_sync_url)."""
    if async_driver == "aiosqlite":
        url = f"sqlite:///{tmp_path / 'agentkeep.db'}"
        migrate.upgrade(url)
    else:
        url = request.getfixturevalue("_pg_session_url")
        _empty_tables(url)
    return as_async_url(url, async_driver)


@pytest.fixture
def clock() -> SettableClock:
    return SettableClock(1_700_000_000_000)


@pytest.fixture
def store(db_url: str, clock: SettableClock) -> Iterator[Store]:
    s = Store.open(db_url, clock=clock)
    yield s
    s.close()
