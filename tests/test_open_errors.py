"""Opening a database that cannot be opened raises a typed error, and changes nothing.

``Store.open``, ``AsyncStore.open``, ``migrations.upgrade`` (and the other
commands) and the ``agentkeep`` command turn what the driver or the file
system raises into agentkeep's errors, the driver's error chained as
``__cause__``:

* ``DatabaseUnavailable``: a SQLite path that is a directory, whose directory
  does not exist, that is read-only (a read-only file system, or ``?mode=ro``),
  a file that is not a database; a Postgres server refusing the connection;
* ``StoreBusy``: a lock held elsewhere outlasted the busy timeout while opening;
* ``DatabaseError``: a Postgres statement timeout while opening;
* ``InvalidInput``: a URL that cannot name a database (unparseable, NUL, a
  lone surrogate, not a string).

The CLI prints the typed message on one line and exits 2 (cli docstring).

The read-only file system: as a non-root user a directory and file without
write permission; as root (permissions do not bind root) a tmpfs mounted and
remounted read-only, skipped where mounting is not permitted.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sqlite3
import subprocess
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest
from sqlalchemy import create_engine, make_url
from sqlalchemy import exc as sa_exc

from agentkeep import AsyncStore, Store
from agentkeep import migrations as migrate
from agentkeep.cli import main
from agentkeep.errors import (
    AgentkeepError,
    DatabaseError,
    DatabaseMissing,
    DatabaseUnavailable,
    InvalidInput,
    StoreBusy,
)
from tests.conftest import as_async_url, create_pg_database, drop_pg_database, require_postgres

#: aiosqlite (0.22) leaves the worker thread of a connection that failed to
#: open running; it later reports to the closed event loop ("Event loop is
#: closed", bare ``aiosqlite.connect`` does it too). Not agentkeep's to fix.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")

# --------------------------------------------------------------------------
# helpers


def _open(url: str) -> None:
    Store.open(url).close()


def _open_migrate(url: str) -> None:
    Store.open(url, migrate=True).close()


def _open_async(url: str) -> None:
    async def run() -> None:
        await (await AsyncStore.open(url)).close()

    asyncio.run(run())


def _open_aiosqlite(url: str) -> None:
    _open_async(url.replace("sqlite:", "sqlite+aiosqlite:", 1))


#: Every way a database is opened: the stores (sync, async thread mode, async
#: native), and the migration commands.
OPENERS: dict[str, Callable[[str], object]] = {
    "Store.open": _open,
    "Store.open(migrate=True)": _open_migrate,
    "AsyncStore.open(thread mode)": _open_async,
    "AsyncStore.open(aiosqlite)": _open_aiosqlite,
    "migrations.upgrade": migrate.upgrade,
    "migrations.current": migrate.current,
    "migrations.check": migrate.check,
    "migrations.downgrade": lambda url: migrate.downgrade(url, "base"),
    "migrations.stamp": lambda url: migrate.stamp(url, "heads"),
}


def _unavailable(opener: Callable[[str], object], url: str) -> DatabaseUnavailable:
    """Open ``url`` with ``opener``; the typed error, with the driver's error chained."""
    with pytest.raises(DatabaseUnavailable) as caught:
        opener(url)
    error = caught.value
    assert error.__cause__ is not None
    assert not isinstance(error.__cause__, AgentkeepError)
    assert error.url.endswith(url.split(":", 1)[1])  # no password to mask in a SQLite URL
    assert "cannot open the database" in str(error)
    return error


def _tree(path: Path) -> list[tuple[str, bytes]]:
    """Every file under ``path`` with its bytes (what "nothing changed" compares)."""
    return sorted(
        (str(p.relative_to(path)), p.read_bytes() if p.is_file() else b"<dir>")
        for p in path.rglob("*")
    )


def _migrated_sqlite(path: Path, *, wal: bool) -> None:
    migrate.upgrade(f"sqlite:///{path}")
    if not wal:
        lite = sqlite3.connect(path)
        lite.execute("PRAGMA journal_mode=DELETE")
        lite.close()


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _assert_one_line_refusal(command: str, code: int, err: str, expected: str) -> None:
    assert code == 2, err
    assert err.startswith(f"agentkeep {command}: "), err
    assert err.count("\n") == 1, err
    assert "Traceback" not in err
    assert "sqlalchemy" not in err.lower() and "sqlite3." not in err, err
    assert expected in err, err


# --------------------------------------------------------------------------
# SQLite: what the path is


@pytest.mark.parametrize("opener", OPENERS, ids=list(OPENERS))
def test_sqlite_a_directory_at_the_database_path(tmp_path: Path, opener: str) -> None:
    target = tmp_path / "app.db"
    target.mkdir()
    error = _unavailable(OPENERS[opener], f"sqlite:///{target}")
    assert error.path == str(target)
    assert "is a directory" in error.reason
    assert target.is_dir() and not any(target.iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["app.db"]


@pytest.mark.parametrize("opener", OPENERS, ids=list(OPENERS))
def test_sqlite_a_missing_parent_directory(tmp_path: Path, opener: str) -> None:
    target = tmp_path / "missing" / "app.db"
    url = f"sqlite:///{target}"
    if opener in ("migrations.current", "migrations.check"):
        # The read-only commands report a missing file without opening it.
        assert OPENERS[opener](url) in ((), [migrate.NOT_MIGRATED])
    elif opener in ("migrations.downgrade", "migrations.stamp"):
        with pytest.raises(DatabaseMissing):
            OPENERS[opener](url)
    else:
        error = _unavailable(OPENERS[opener], url)
        assert f"the directory {target.parent} does not exist" in error.reason
    assert not target.parent.exists()


@pytest.mark.parametrize("opener", OPENERS, ids=list(OPENERS))
def test_sqlite_a_file_that_is_not_a_database(tmp_path: Path, opener: str) -> None:
    target = tmp_path / "app.db"
    target.write_bytes(b"not a database, just some text\n" * 200)
    before = _tree(tmp_path)
    error = _unavailable(OPENERS[opener], f"sqlite:///{target}")
    assert "is not a SQLite database" in error.reason
    assert _tree(tmp_path) == before


@pytest.mark.parametrize("opener", OPENERS, ids=list(OPENERS))
def test_sqlite_a_database_opened_read_only_by_its_url(tmp_path: Path, opener: str) -> None:
    """``?mode=ro``: SQLite opens the file read-only; opening (WAL, migrations) must write."""
    target = tmp_path / "app.db"
    _migrated_sqlite(target, wal=False)
    before = _tree(tmp_path)
    url = f"sqlite:///file:{target}?mode=ro&uri=true"
    if opener in ("migrations.current", "migrations.check", "migrations.stamp"):
        # They only read (stamping the revision the file already has writes nothing).
        assert OPENERS[opener](url) in (migrate.head_revisions(), [])
    else:
        with pytest.raises(DatabaseUnavailable) as caught:
            OPENERS[opener](url)
        assert "read-only" in caught.value.reason
        assert caught.value.path == str(target)
        assert isinstance(caught.value.__cause__, (sa_exc.DBAPIError, sqlite3.Error))
    assert _tree(tmp_path) == before


@contextmanager
def _read_only_directory(tmp_path: Path) -> Iterator[Path]:
    """A directory holding migrated databases (``wal.db``, ``journal.db``), then made read-only.

    Non-root: the directory and its files lose their write permission. Root
    (which permissions do not stop): a tmpfs, remounted read-only once the
    databases are in it; skipped if mounting is not permitted here.
    """
    if os.geteuid() != 0:
        directory = tmp_path / "ro"
        directory.mkdir()
        _migrated_sqlite(directory / "wal.db", wal=True)
        _migrated_sqlite(directory / "journal.db", wal=False)
        for p in directory.iterdir():
            p.chmod(0o444)
        directory.chmod(0o555)
        try:
            yield directory
        finally:
            directory.chmod(0o755)
        return
    mount, umount = shutil.which("mount"), shutil.which("umount")
    if mount is None or umount is None:
        pytest.skip("running as root without mount(8): no read-only file system to test on")
    directory = tmp_path / "ro"
    directory.mkdir()
    made = subprocess.run(
        [mount, "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(directory)],
        capture_output=True,
        text=True,
        check=False,
    )
    if made.returncode != 0:
        pytest.skip(f"running as root and mounting a tmpfs is not permitted: {made.stderr.strip()}")
    try:
        _migrated_sqlite(directory / "wal.db", wal=True)
        _migrated_sqlite(directory / "journal.db", wal=False)
        subprocess.run([mount, "-o", "remount,ro", str(directory)], check=True)
        yield directory
    finally:
        subprocess.run([umount, str(directory)], check=False)


@pytest.mark.parametrize("name", ["wal.db", "journal.db", "new.db"])
@pytest.mark.parametrize(
    "opener", ["Store.open", "AsyncStore.open(aiosqlite)", "migrations.upgrade"]
)
def test_sqlite_a_read_only_file_system(tmp_path: Path, name: str, opener: str) -> None:
    with _read_only_directory(tmp_path) as directory:
        before = _tree(directory)
        error = _unavailable(OPENERS[opener], f"sqlite:///{directory / name}")
        assert "cannot be written" in error.reason, error.reason
        assert _tree(directory) == before


# --------------------------------------------------------------------------
# URLs that cannot name a database


@pytest.mark.parametrize(
    "url",
    ["not a url", "sqlite:///app\x00.db", "sqlite:///app\udcff.db", 42, None, b"sqlite://"],
    ids=["unparseable", "nul", "surrogate", "int", "none", "bytes"],
)
@pytest.mark.parametrize(
    "opener",
    ["Store.open", "AsyncStore.open(thread mode)", "migrations.upgrade", "migrations.current"],
)
def test_a_url_that_names_no_database_is_invalid_input(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, url: Any, opener: str
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InvalidInput) as caught:
        OPENERS[opener](url)
    assert caught.value.field in ("url", "target")
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------
# Postgres


def _plain(url: str) -> str:
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


@contextmanager
def _version_table_locked(url: str) -> Iterator[None]:
    """Another connection holds ACCESS EXCLUSIVE on agentkeep's version table (a migration)."""
    with psycopg.connect(_plain(url)) as conn:
        conn.execute(f"LOCK TABLE {migrate.VERSION_TABLE} IN ACCESS EXCLUSIVE MODE")
        yield
        conn.rollback()


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A migrated Postgres database of its own."""
    url = create_pg_database("agentkeep_open")
    migrate.upgrade(url)
    yield url
    drop_pg_database(url)


def _postgres_openers(url: str) -> dict[str, Callable[[], object]]:
    async def native(driver: str) -> None:
        await (await AsyncStore.open(as_async_url(url, driver), busy_timeout_ms=300)).close()

    return {
        "Store.open": lambda: Store.open(url, busy_timeout_ms=300).close(),
        "AsyncStore.open(asyncpg)": lambda: asyncio.run(native("asyncpg")),
        "AsyncStore.open(psycopg_async)": lambda: asyncio.run(native("psycopg_async")),
    }


@pytest.mark.parametrize(
    "opener", ["Store.open", "AsyncStore.open(asyncpg)", "AsyncStore.open(psycopg_async)"]
)
def test_postgres_a_lock_held_while_opening_is_store_busy(pg_url: str, opener: str) -> None:
    with _version_table_locked(pg_url):
        with pytest.raises(StoreBusy) as caught:
            _postgres_openers(pg_url)[opener]()
    assert "lock timeout" in str(caught.value)
    assert make_url(pg_url).database in str(caught.value)
    assert isinstance(caught.value.__cause__, sa_exc.DBAPIError)
    assert migrate.current(pg_url) == migrate.head_revisions()


@pytest.mark.parametrize("opener", ["Store.open", "Store(engine)", "migrations.upgrade"])
def test_postgres_a_statement_timeout_while_opening_is_a_database_error(
    pg_url: str, opener: str
) -> None:
    """A host engine with ``statement_timeout`` meets a migration's lock: not a raw error."""
    engine = create_engine(pg_url, connect_args={"options": "-c statement_timeout=200"})
    call: dict[str, Callable[[], object]] = {
        "Store.open": lambda: Store.open(engine),
        "Store(engine)": lambda: Store(engine),
        "migrations.upgrade": lambda: migrate.upgrade(engine),
    }
    try:
        with _version_table_locked(pg_url):
            with pytest.raises(DatabaseError) as caught:
                call[opener]()
    finally:
        engine.dispose()
    assert not isinstance(caught.value, StoreBusy)
    assert "statement timeout" in str(caught.value)
    assert isinstance(caught.value.__cause__, sa_exc.DBAPIError)
    assert migrate.current(pg_url) == migrate.head_revisions()


@pytest.mark.parametrize(
    "url",
    [
        "postgresql+psycopg://postgres@127.0.0.1:1/postgres",
        "postgresql+asyncpg://postgres@127.0.0.1:1/postgres",
        "postgresql+psycopg_async://postgres@127.0.0.1:1/postgres",
        "postgresql+psycopg://postgres@127.0.0.1:5432/agentkeep_no_such_database",
        "postgresql+asyncpg://postgres@127.0.0.1:5432/agentkeep_no_such_database",
    ],
    ids=["refused", "refused-asyncpg", "refused-psycopg_async", "no-db", "no-db-asyncpg"],
)
def test_postgres_an_unreachable_database_is_unavailable(url: str) -> None:
    if "5432" in url:
        require_postgres()
    with pytest.raises(DatabaseUnavailable) as caught:
        if "+psycopg:" in url:
            Store.open(url)
        else:
            _open_async(url)
    assert caught.value.path is None
    assert caught.value.__cause__ is not None
    assert "\n" not in str(caught.value)


# --------------------------------------------------------------------------
# The command line


@pytest.mark.parametrize("command", ["upgrade", "current", "check", "downgrade base"])
def test_cli_prints_the_typed_message_and_exits_2(
    tmp_path: Path, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = tmp_path / "dir.db"
    directory.mkdir()
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"junk" * 1000)
    name = command.split()[0]
    code, _, err = run_cli(capsys, *command.split(), f"sqlite:///{directory}")
    _assert_one_line_refusal(name, code, err, f"{directory} is a directory")
    code, _, err = run_cli(capsys, *command.split(), f"sqlite:///{junk}")
    _assert_one_line_refusal(name, code, err, f"{junk} is not a SQLite database")
    if name == "upgrade":
        missing = tmp_path / "missing" / "x.db"
        code, _, err = run_cli(capsys, *command.split(), f"sqlite:///{missing}")
        _assert_one_line_refusal(name, code, err, f"the directory {missing.parent} does not")
        assert not missing.parent.exists()


def test_cli_on_a_read_only_file_system(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before: a journal-mode file on a read-only file system gave a traceback (exit 1)."""
    with _read_only_directory(tmp_path) as directory:
        for name in ("journal.db", "wal.db", "new.db"):
            code, _, err = run_cli(capsys, "upgrade", f"sqlite:///{directory / name}")
            _assert_one_line_refusal("upgrade", code, err, "cannot be written")


def test_cli_a_statement_timeout_while_upgrading(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The database's own ``statement_timeout`` (the command has no engine to configure)."""
    url = create_pg_database("agentkeep_open")
    try:
        migrate.upgrade(url)
        name = make_url(url).database
        with psycopg.connect(_plain(url), autocommit=True) as admin:
            admin.execute(f'ALTER DATABASE "{name}" SET statement_timeout = 300')
        with _version_table_locked(url):
            code, _, err = run_cli(capsys, "upgrade", url)
        _assert_one_line_refusal("upgrade", code, err, "statement timeout")
        assert name in err
    finally:
        drop_pg_database(url)


def test_cli_an_unknown_postgres_database(capsys: pytest.CaptureFixture[str]) -> None:
    require_postgres()
    name = f"agentkeep_missing_{uuid.uuid4().hex[:8]}"
    url = f"postgresql+psycopg://postgres:pw-{name}@127.0.0.1:5432/{name}"
    code, _, err = run_cli(capsys, "current", url)
    _assert_one_line_refusal("current", code, err, f'database "{name}" does not exist')
    assert f"pw-{name}" not in err
