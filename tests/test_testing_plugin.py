"""The test kit ``agentkeep.testing``, seen from a host application's test suite.

Each case writes a host's test files into a pytester directory and runs
pytest on them, in-process or as a subprocess of this interpreter, with the
plugin loaded as a host gets it: by the ``pytest11`` entry point when the
installed agentkeep has it (``-p agentkeep`` names it), else by ``-p
agentkeep.testing`` (a checkout on ``PYTHONPATH``; pytest refuses the two
together, see :data:`PLUGIN`):

* ``agentkeep_store`` is a fresh, migrated store per test (nothing one test
  writes is seen by the next), on ``agentkeep_clock``; SQLite by default;
  Postgres with ``--agentkeep-url`` or ``AGENTKEEP_TEST_URL``, in a schema of
  its own per test, dropped after it, beside the host's own tables;
* the plugin's fixtures live beside a host's own ``store``/``clock`` fixtures
  (this repository's conftest names) without clashing;
* a URL that is not Postgres is a usage error;
* what a fresh store is made of equals the migrations: the SQLite template is
  migrated by them; the Postgres script is their own offline SQL, and a
  schema built by it reflects exactly like one built by ``agentkeep upgrade``.
"""

from __future__ import annotations

import io
import sqlite3
import tomllib
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, inspect, text

from agentkeep import migrations as migrate
from agentkeep.testing import ENV_URL
from tests.conftest import create_pg_database, drop_pg_database, require_postgres

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parent.parent
#: How a host's run loads the plugin: the entry point's name where the installed
#: agentkeep registers it (then it loads by itself, and registering the module a
#: second time under its module name would be refused by pytest), else the module.
PLUGIN = (
    ("-p", "agentkeep")
    if entry_points(group="pytest11", name="agentkeep")
    else ("-p", "agentkeep.testing")
)

HOST_TESTS = """
import pytest
from agentkeep.runs.domain import RunRecord, RunStatus
from agentkeep.sessions.domain import Acquired, LeaseOwnerIdentity
from agentkeep.sessions.liveness import capture_liveness


@pytest.mark.parametrize("i", range(3))
def test_each_test_gets_an_empty_store(agentkeep_store, agentkeep_clock, i):
    assert agentkeep_store.runs.list() == []
    agentkeep_store.runs.create(RunRecord.new("R-1", "T-1", created_at=agentkeep_clock.now_ms()))
    assert agentkeep_store.runs.try_transition("R-1", RunStatus.PENDING, RunStatus.RUNNING)


def test_the_clock_is_the_stores(agentkeep_store, agentkeep_clock):
    assert agentkeep_store.clock is agentkeep_clock
    assert agentkeep_clock.now_ms() == 1_700_000_000_000
    me = LeaseOwnerIdentity(owner_id="w", incarnation_id="b", liveness=capture_liveness())
    lease = agentkeep_store.leases.try_claim_session_execution_lease("s-1", me, ttl_ms=1_000)
    assert isinstance(lease, Acquired)
    assert lease.lease.expires_at_epoch_ms == 1_700_000_001_000
    agentkeep_clock.advance(5_000)
    other = LeaseOwnerIdentity(owner_id="w2", incarnation_id="b", liveness=capture_liveness())
    taken = agentkeep_store.leases.try_claim_session_execution_lease("s-1", other, ttl_ms=1_000)
    assert isinstance(taken, Acquired)  # the first lease expired on the settable clock


def test_where_the_store_lives(agentkeep_store, request):
    request.config.stash.setdefault("agentkeep_urls", []).append(agentkeep_store.engine.url)
    print("STORE", agentkeep_store.engine.url.get_backend_name(), agentkeep_store.schema)
"""


@pytest.fixture
def host(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    """A host project with the test file above (and no agentkeep URL in its environment)."""
    monkeypatch.delenv(ENV_URL, raising=False)
    pytester.makepyfile(test_host=HOST_TESTS)
    return pytester


def test_the_entry_point_registers_the_plugin() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["entry-points"]["pytest11"] == {"agentkeep": "agentkeep.testing"}


def test_sqlite_by_default_in_process(host: pytest.Pytester) -> None:
    result = host.runpytest(*PLUGIN, "-s")
    result.assert_outcomes(passed=5)
    result.stdout.fnmatch_lines(["*STORE sqlite None*"])


def test_sqlite_by_default_as_a_subprocess(host: pytest.Pytester) -> None:
    result = host.runpytest_subprocess(*PLUGIN, "-s")
    result.assert_outcomes(passed=5)
    result.stdout.fnmatch_lines(["*STORE sqlite None*"])


def test_a_hosts_own_fixtures_and_the_kits_live_side_by_side(host: pytest.Pytester) -> None:
    """This repository's conftest names its fixtures ``store`` and ``clock``; a host may too."""
    host.makeconftest(
        """
        import pytest

        @pytest.fixture
        def store():
            return "the host's store"

        @pytest.fixture
        def clock():
            return "the host's clock"
        """
    )
    host.makepyfile(
        test_both="""
        def test_both(store, clock, agentkeep_store, agentkeep_clock):
            assert (store, clock) == ("the host's store", "the host's clock")
            assert agentkeep_store.clock is agentkeep_clock
        """
    )
    host.runpytest(*PLUGIN, "test_both.py").assert_outcomes(passed=1)


def test_the_option_is_in_the_help(host: pytest.Pytester) -> None:
    result = host.runpytest(*PLUGIN, "--help")
    result.stdout.fnmatch_lines(["*agentkeep*", "*--agentkeep-url=URL*"])


def test_a_url_that_is_not_postgres_is_a_usage_error(host: pytest.Pytester) -> None:
    result = host.runpytest(*PLUGIN, "--agentkeep-url", "sqlite:///x.db")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*takes a Postgres URL*"])


def _schemas(url: str) -> set[str]:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return set(inspect(conn).get_schema_names())
    finally:
        engine.dispose()


@pytest.mark.parametrize("how", ["option", "environment"])
def test_postgres_with_the_option_or_the_environment(
    host: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """Each test in a fresh schema, dropped after; the host's own ``runs`` is untouched."""
    url = create_pg_database("agentkeep_kit")
    try:
        engine = create_engine(url)
        with engine.begin() as conn:
            conn.execute(text("CREATE TABLE runs (id TEXT PRIMARY KEY, owner TEXT)"))
            conn.execute(text("INSERT INTO runs VALUES ('R-1', 'host')"))
        engine.dispose()
        before = _schemas(url)
        if how == "option":
            args = ["--agentkeep-url", url]
        else:
            monkeypatch.setenv(ENV_URL, url)
            args = []
        result = host.runpytest_subprocess(*PLUGIN, "-s", *args)
        result.assert_outcomes(passed=5)
        result.stdout.fnmatch_lines(["*STORE postgresql agentkeep_test_*"])
        assert _schemas(url) == before  # every schema the kit made was dropped
        engine = create_engine(url)
        with engine.connect() as conn:
            assert conn.execute(text("SELECT * FROM runs")).fetchall() == [("R-1", "host")]
        engine.dispose()
    finally:
        drop_pg_database(url)


# ---------------------------------------------------------------- what a fresh store is


def test_sqlite_template_copies_are_migrated_databases(tmp_path: Path) -> None:
    """The template is made by the migrations; a byte copy is at head without drift."""
    from agentkeep.clock import SettableClock
    from agentkeep.testing import _SqliteStores

    stores = _SqliteStores(tmp_path)
    store, path = stores.open(SettableClock())
    try:
        url = f"sqlite:///{path}"
        assert migrate.current(url) == migrate.head_revisions()
        assert migrate.check(url) == []
        with sqlite3.connect(path) as a, sqlite3.connect(tmp_path / "template.db") as b:
            sql = "SELECT type, name, tbl_name, sql FROM sqlite_master ORDER BY name"
            assert a.execute(sql).fetchall() == b.execute(sql).fetchall()
            assert a.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    finally:
        stores.discard(store, path)
    assert not Path(path).exists()


def _reflect(url: str, schema: str) -> dict[str, Any]:
    """Everything reflection says about one schema: columns (with defaults), keys,
    indexes, checks, sequences (with their owner), in a comparable form."""
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            insp = inspect(conn)
            out: dict[str, Any] = {}
            for table in sorted(insp.get_table_names(schema=schema)):
                out[table] = {
                    "columns": [
                        (c["name"], str(c["type"]), c["nullable"], c.get("default"))
                        for c in insp.get_columns(table, schema=schema)
                    ],
                    "pk": insp.get_pk_constraint(table, schema=schema),
                    "fks": sorted(
                        (f["name"], tuple(f["constrained_columns"]), f["referred_table"])
                        for f in insp.get_foreign_keys(table, schema=schema)
                    ),
                    "indexes": sorted(
                        (i["name"], tuple(i["column_names"]), bool(i["unique"]))
                        for i in insp.get_indexes(table, schema=schema)
                    ),
                    "uniques": sorted(
                        (u["name"], tuple(u["column_names"]))
                        for u in insp.get_unique_constraints(table, schema=schema)
                    ),
                    "checks": sorted(
                        (c["name"], c["sqltext"])
                        for c in insp.get_check_constraints(table, schema=schema)
                    ),
                }
            out["sequences"] = conn.execute(
                text(
                    "SELECT s.relname, t.relname, a.attname FROM pg_class s "
                    "JOIN pg_namespace n ON n.oid = s.relnamespace "
                    "LEFT JOIN pg_depend d ON d.objid = s.oid AND d.deptype = 'a' "
                    "LEFT JOIN pg_class t ON t.oid = d.refobjid "
                    "LEFT JOIN pg_attribute a ON a.attrelid = t.oid AND a.attnum = d.refobjsubid "
                    "WHERE s.relkind = 'S' AND n.nspname = :s ORDER BY 1"
                ),
                {"s": schema},
            ).fetchall()
            out["versions"] = conn.execute(
                text(f'SELECT version_num FROM "{schema}".{migrate.VERSION_TABLE}')
            ).fetchall()
            return out
    finally:
        engine.dispose()


def test_postgres_the_kits_schema_equals_the_migrations(fresh_url: str, backend: str) -> None:
    """The per-test schema (the migrations' offline SQL) reflects exactly like a schema
    built by ``agentkeep upgrade`` (the online migrations), and passes the drift check."""
    if backend != "postgres":
        pytest.skip("Postgres only: the SQLite kit copies a file the migrations made")
    require_postgres()
    script = io.StringIO()
    migrate.upgrade_sql(fresh_url, output=script, schema="by_script")
    engine = create_engine(fresh_url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            conn.connection.driver_connection.execute(script.getvalue())  # type: ignore[union-attr]
    finally:
        engine.dispose()
    migrate.upgrade(fresh_url, schema="by_upgrade")
    kit, real = _reflect(fresh_url, "by_script"), _reflect(fresh_url, "by_upgrade")
    for name in kit:  # the column defaults name their own schema's sequence
        if isinstance(kit[name], dict):
            kit[name]["columns"] = [
                (n, t, null, d.replace("by_script.", "by_upgrade.") if isinstance(d, str) else d)
                for n, t, null, d in kit[name]["columns"]
            ]
    assert kit == real
    assert migrate.check(fresh_url, schema="by_script") == []


def test_the_plugin_can_be_switched_off(host: pytest.Pytester) -> None:
    """``-p no:agentkeep`` (the entry point's name) removes the fixtures: a host test naming
    one errors; the plugin adds nothing else (no autouse fixture, no hook)."""
    result = host.runpytest("-p", "no:agentkeep", "test_host.py")
    result.stdout.fnmatch_lines(["*fixture 'agentkeep_store' not found*"])
