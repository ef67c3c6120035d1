"""agentkeep's pytest plugin: a fresh, migrated store per test, for a host application's tests.

Described in docs/architecture.md#the-test-kit and the README's "Testing your
application".

Installed with agentkeep and registered through the ``pytest11`` entry point
(``agentkeep = "agentkeep.testing"``), so a host's tests just name the
fixtures. ``-p no:agentkeep`` switches it off. ``-p agentkeep.testing`` loads
it only where agentkeep is importable but not installed (no entry point):
pytest refuses to register the module a second time under another name::

    def test_launch(agentkeep_store, agentkeep_clock):
        now = agentkeep_clock.now_ms()
        agentkeep_store.runs.create(RunRecord.new("R-1", "T-1", created_at=now))
        agentkeep_clock.advance(1_000)
        ...

Fixtures (function scope):

* ``agentkeep_store``: a :class:`~agentkeep.store.Store` at migration head with
  no rows, of its own for this test, closed (and its database removed) after
  it. SQLite by default; Postgres when ``--agentkeep-url URL`` or the
  environment variable ``AGENTKEEP_TEST_URL`` names a Postgres database (the
  option wins).
* ``agentkeep_clock``: the :class:`~agentkeep.clock.SettableClock` the store
  runs on, at ``1_700_000_000_000`` ms; it moves only when the test sets or
  advances it.

Why a fresh store is cheap (about the cost of creating the tables directly,
not of replaying the migration history per test):

* SQLite: the real migrations (with their drift check) run once per test
  session into a template file; each test gets a byte copy of that file, a
  WAL database of its own in the session's temporary directory, deleted after
  the test.
* Postgres: each test gets a schema of its own (``schema=``; the host's
  tables in the same database are never touched), created by the migrations'
  own SQL (``agentkeep upgrade --sql --schema``: the revisions rendered once
  per session, run as one script) and dropped after the test. The first
  schema of the session is verified by the drift check against the models
  (:func:`agentkeep.migrations.check`). One schema name per test session
  (``agentkeep_test_<random>``), re-created for each test, so statements are
  compiled once per session; two sessions (xdist workers, CI jobs) sharing a
  database never meet.

Nothing here is imported from agentkeep until a fixture is used, so the
plugin costs nothing in a session that does not use it.
"""

from __future__ import annotations

import io
import itertools
import os
import shutil
import sqlite3
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import pytest

if TYPE_CHECKING:
    from agentkeep.clock import SettableClock
    from agentkeep.store import Store

__all__ = [
    "ENV_URL",
    "START_MS",
    "agentkeep_clock",
    "agentkeep_store",
    "pytest_addoption",
    "pytest_configure",
]

#: The environment variable naming a Postgres database for ``agentkeep_store``.
ENV_URL: Final = "AGENTKEEP_TEST_URL"
#: Where ``agentkeep_clock`` starts (epoch milliseconds).
START_MS: Final = 1_700_000_000_000
_OPTION: Final = "--agentkeep-url"
#: Postgres: how long dropping a test's schema waits for a lock a test left behind.
_DROP_WAIT_MS: Final = 10_000


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("agentkeep", "agentkeep test stores")
    group.addoption(
        _OPTION,
        dest="agentkeep_url",
        metavar="URL",
        default=None,
        help=f"Postgres database for the agentkeep_store fixture (a fresh schema per test); "
        f"default ${ENV_URL}, else a SQLite file per test",
    )


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("agentkeep_url", None) or os.environ.get(ENV_URL):
        _url(config)  # a URL that is not Postgres: a usage error at start-up, not per test


class _SqliteStores:
    """Stores copied from a template file migrated once per session."""

    def __init__(self, directory: Path) -> None:
        from agentkeep import migrations

        self._directory = directory
        self._template = directory / "template.db"
        migrations.upgrade(f"sqlite:///{self._template}")  # the real history, drift-checked
        raw = sqlite3.connect(self._template)
        try:  # every page in the main file: a byte copy of it is the whole database
            raw.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        finally:
            raw.close()
        self._numbers = itertools.count()

    def open(self, clock: SettableClock) -> tuple[Store, Any]:
        from agentkeep.db import create_private_file
        from agentkeep.store import Store

        path = self._directory / f"store-{next(self._numbers)}.db"
        create_private_file(path)  # copyfile keeps the mode of a file it overwrites
        shutil.copyfile(self._template, path)
        return Store.open(f"sqlite:///{path}", clock=clock), path

    def discard(self, store: Store, path: Any) -> None:
        store.close()
        for suffix in ("", "-wal", "-shm"):
            Path(f"{path}{suffix}").unlink(missing_ok=True)

    def close(self) -> None:
        pass


class _PostgresStores:
    """Stores in a fresh schema per test, made by the migrations' own SQL."""

    def __init__(self, url: str) -> None:
        from sqlalchemy import create_engine

        from agentkeep import migrations

        self._url = url
        self.schema = f"agentkeep_test_{uuid.uuid4().hex[:10]}"
        script = io.StringIO()
        migrations.upgrade_sql(url, output=script, schema=self.schema)
        self._script = script.getvalue()
        # A test that leaves a transaction open on agentkeep's tables would make the
        # schema's DROP wait for ever: give up after a while with the reason.
        self._admin = create_engine(
            url,
            isolation_level="AUTOCOMMIT",
            connect_args={"options": f"-c lock_timeout={_DROP_WAIT_MS}"},
        )
        self._verified = False

    def _run(self, sql: str) -> None:
        with self._admin.connect() as conn:
            conn.connection.driver_connection.execute(sql)  # type: ignore[union-attr]

    def open(self, clock: SettableClock) -> tuple[Store, Any]:
        from agentkeep import migrations
        from agentkeep.store import Store

        # The drop is a no-op unless an earlier test's drop failed.
        self._run(f'DROP SCHEMA IF EXISTS "{self.schema}" CASCADE;\n{self._script}')
        if not self._verified:
            problems = migrations.check(self._url, schema=self.schema)
            if problems:
                self._drop()
                raise RuntimeError(
                    "agentkeep.testing: the migrations' SQL does not build the models' schema: "
                    + "; ".join(problems)
                )
            self._verified = True
        return Store.open(self._url, schema=self.schema, clock=clock), None

    def discard(self, store: Store, _handle: Any) -> None:
        store.close()
        try:
            self._drop()
        except Exception as exc:
            raise RuntimeError(
                f"agentkeep.testing: could not drop the test's schema {self.schema} "
                f"({exc}); did the test leave a connection of agentkeep_store.engine open?"
            ) from exc

    def _drop(self) -> None:
        self._run(f'DROP SCHEMA IF EXISTS "{self.schema}" CASCADE')

    def close(self) -> None:
        try:
            self._drop()
        finally:
            self._admin.dispose()


def _url(config: pytest.Config) -> str | None:
    url = config.getoption("agentkeep_url") or os.environ.get(ENV_URL) or None
    if url is None:
        return None
    from sqlalchemy.engine import make_url

    try:
        backend = make_url(url).get_backend_name()
    except Exception as exc:  # noqa: BLE001 - any parse failure is a usage error
        raise pytest.UsageError(f"{_OPTION} / ${ENV_URL}: not a database URL: {exc}") from exc
    if backend != "postgresql":
        raise pytest.UsageError(
            f"{_OPTION} / ${ENV_URL} takes a Postgres URL (agentkeep_store uses SQLite without it)"
        )
    return str(url)


@pytest.fixture(scope="session")
def _agentkeep_stores(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[_SqliteStores | _PostgresStores]:
    """How this session makes its stores (built at the first test that wants one)."""
    url = _url(request.config)
    stores: _SqliteStores | _PostgresStores
    if url is None:
        stores = _SqliteStores(tmp_path_factory.mktemp("agentkeep"))
    else:
        stores = _PostgresStores(url)
    try:
        yield stores
    finally:
        stores.close()


@pytest.fixture
def agentkeep_clock() -> SettableClock:
    """The :class:`~agentkeep.clock.SettableClock` of ``agentkeep_store``, at ``START_MS``."""
    from agentkeep.clock import SettableClock

    return SettableClock(START_MS)


@pytest.fixture
def agentkeep_store(
    _agentkeep_stores: _SqliteStores | _PostgresStores, agentkeep_clock: SettableClock
) -> Iterator[Store]:
    """A fresh store at migration head for this test, on ``agentkeep_clock`` (module docstring)."""
    store, handle = _agentkeep_stores.open(agentkeep_clock)
    try:
        yield store
    finally:
        _agentkeep_stores.discard(store, handle)
