"""New SQLite files are private: mode 0600 for the database and its -wal and -shm files.

agentkeep creates a missing database file with ``O_CREAT | O_EXCL`` and mode
0600 just before SQLite opens it (``agentkeep.db.create_private_file``), and
SQLite gives the ``-wal``/``-shm`` files the mode of their database file;
these tests check both empirically on every path that creates a file
(``Store.open``, ``AsyncStore.open`` in both modes, ``migrations.upgrade``,
``agentkeep upgrade``, a namespace file of ``schema=``), with the umask at the
usual 022 so that a file SQLite created by itself would be 0644. A file that
exists keeps its mode, its companions follow it, and in-memory or read-only
URLs create nothing. Two processes creating one file race on ``O_EXCL``:
exactly one creates it.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agentkeep import AsyncStore, migrations
from agentkeep.cli import main
from agentkeep.db import create_private_file, sqlite_creates_file, sqlite_schema_file
from agentkeep.store import Store
from tests.racing import SPAWN, run_processes, wait_ready

pytestmark = pytest.mark.skipif(os.name == "nt", reason="POSIX file modes")


@pytest.fixture(autouse=True)
def umask_022() -> Iterator[None]:
    """The common umask: a file created without agentkeep's care would be 0644."""
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def mode(path: Path | str) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def modes(db: Path) -> dict[str, int]:
    """The modes of ``db`` and of its -wal and -shm files (all three must exist)."""
    return {suffix or "db": mode(f"{db}{suffix}") for suffix in ("", "-wal", "-shm")}


PRIVATE = {"db": 0o600, "-wal": 0o600, "-shm": 0o600}


def write_something(store: Store) -> None:
    store.runtime.persist_auth_oauth_flow_snapshot(b"flow")
    assert store.runtime.load_auth_oauth_flow_snapshot() == b"flow"


def test_sqlite_itself_creates_0644_and_companions_follow_the_database(tmp_path: Path) -> None:
    """The premise: without agentkeep, umask 022 gives 0644; -wal/-shm copy the db's mode."""
    import sqlite3

    plain = tmp_path / "plain.db"
    conn = sqlite3.connect(plain)
    conn.close()
    assert mode(plain) == 0o644
    shared = tmp_path / "shared.db"
    shared.touch()
    shared.chmod(0o640)
    conn = sqlite3.connect(shared)
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("CREATE TABLE t (x)")
        conn.commit()
        assert modes(shared) == {"db": 0o640, "-wal": 0o640, "-shm": 0o640}
    finally:
        conn.close()


def test_store_open_creates_database_wal_and_shm_0600(tmp_path: Path) -> None:
    path = tmp_path / "new.db"
    with Store.open(f"sqlite:///{path}", migrate=True) as store:
        write_something(store)
        assert modes(path) == PRIVATE


def test_upgrade_then_open_keeps_0600(tmp_path: Path) -> None:
    path = tmp_path / "upgraded.db"
    migrations.upgrade(f"sqlite:///{path}")
    assert mode(path) == 0o600
    with Store.open(f"sqlite:///{path}") as store:
        write_something(store)
        assert modes(path) == PRIVATE


def test_cli_upgrade_creates_0600(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "cli.db"
    assert main(["upgrade", f"sqlite:///{path}"]) == 0
    capsys.readouterr()
    assert mode(path) == 0o600


@pytest.mark.parametrize("driver", ["sqlite+aiosqlite", "sqlite"], ids=["native", "thread"])
def test_async_store_open_creates_0600(tmp_path: Path, driver: str) -> None:
    path = tmp_path / "async.db"

    async def run() -> dict[str, int]:
        astore = await AsyncStore.open(f"{driver}:///{path}", migrate=True)
        try:
            await astore.runtime.persist_auth_oauth_flow_snapshot(b"flow")
            assert await astore.runtime.load_auth_oauth_flow_snapshot() == b"flow"
            return modes(path)
        finally:
            await astore.close()

    assert asyncio.run(run()) == PRIVATE


def test_namespace_file_is_created_0600(tmp_path: Path) -> None:
    path = tmp_path / "app.db"
    namespace = sqlite_schema_file(path, "agentkeep")
    with Store.open(f"sqlite:///{path}", migrate=True, schema="agentkeep") as store:
        write_something(store)
        assert modes(namespace) == PRIVATE
        assert mode(path) == 0o600


def test_an_existing_file_keeps_its_mode_and_its_companions_follow_it(tmp_path: Path) -> None:
    """A host's file is never chmod-ed; agentkeep's own namespace file next to it is 0600."""
    path = tmp_path / "host.db"
    path.touch()
    path.chmod(0o640)
    with Store.open(f"sqlite:///{path}", migrate=True) as store:
        write_something(store)
        assert modes(path) == {"db": 0o640, "-wal": 0o640, "-shm": 0o640}
    namespace = sqlite_schema_file(path, "ak")
    with Store.open(f"sqlite:///{path}", migrate=True, schema="ak") as store:
        write_something(store)
        assert mode(path) == 0o640
        assert modes(namespace) == PRIVATE


def test_an_existing_namespace_file_keeps_its_mode(tmp_path: Path) -> None:
    path = tmp_path / "app.db"
    namespace = sqlite_schema_file(path, "ak")
    namespace.touch()
    namespace.chmod(0o644)
    with Store.open(f"sqlite:///{path}", migrate=True, schema="ak") as store:
        write_something(store)
        assert modes(namespace) == {"db": 0o644, "-wal": 0o644, "-shm": 0o644}


@pytest.mark.parametrize(
    "url",
    [
        "sqlite://",
        "sqlite:///:memory:",
        "sqlite:///file::memory:?uri=true",
    ],
)
def test_in_memory_urls_create_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, url: str
) -> None:
    monkeypatch.chdir(tmp_path)
    with Store.open(url, migrate=True) as store:
        write_something(store)
    assert sorted(os.listdir(tmp_path)) == []


def test_uri_urls_create_0600_unless_read_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with Store.open("sqlite:///file:uri%20db.db?cache=private&uri=true", migrate=True) as store:
        write_something(store)
        assert modes(tmp_path / "uri db.db") == PRIVATE
    for query in ("mode=ro", "mode=rw"):
        with pytest.raises(Exception):  # noqa: B017 - SQLite refuses to open a missing file
            Store.open(f"sqlite:///file:missing.db?{query}&uri=true")
    assert sorted(os.listdir(tmp_path)) == ["uri db.db"]


def test_a_missing_directory_is_left_to_sqlite(tmp_path: Path) -> None:
    """Pre-creating fails silently; SQLite's own open reports the missing directory."""
    with pytest.raises(Exception):  # noqa: B017 - the error type is the open path's own
        Store.open(f"sqlite:///{tmp_path / 'no-such-dir' / 'x.db'}", migrate=True)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    ("database", "uri", "expected"),
    [
        ("/d/app.db", False, "/d/app.db"),
        ("rel.db", False, "rel.db"),
        (":memory:", False, None),
        ("", False, None),
        ("file:x.db", False, "file:x.db"),  # not a URI without uri=True: a plain name
        ("/d/app.db", True, "/d/app.db"),  # uri=True, no file: prefix: a plain name
        ("file:x.db", True, "x.db"),
        ("file:/d/a%20b.db?cache=shared", True, "/d/a b.db"),
        ("file:///d/x.db", True, "/d/x.db"),
        ("file://localhost/d/x.db", True, "/d/x.db"),
        ("file://elsewhere/d/x.db", True, None),
        ("file:x.db?mode=rwc", True, "x.db"),
        ("file:x.db?mode=ro", True, None),
        ("file:x.db?mode=rw", True, None),
        ("file:x.db?mode=memory", True, None),
        ("file:x.db?immutable=1", True, None),
        ("file:x.db?vfs=unix-dotfile", True, None),
        ("file::memory:", True, None),
        ("file:", True, None),
        ("file:x.db#frag", True, "x.db"),
        (b"/d/app.db", False, None),
    ],
)
def test_which_file_a_sqlite_connect_creates(
    database: Any, uri: bool, expected: str | None
) -> None:
    assert sqlite_creates_file(database, uri=uri) == expected


def test_create_private_file_never_touches_an_existing_file(tmp_path: Path) -> None:
    path = tmp_path / "f"
    assert create_private_file(path) is True
    assert mode(path) == 0o600
    path.write_bytes(b"data")
    path.chmod(0o644)
    assert create_private_file(path) is False
    assert (mode(path), path.read_bytes()) == (0o644, b"data")
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "target")  # dangling: O_EXCL does not follow it
    assert create_private_file(link) is False
    assert not (tmp_path / "target").exists()


def _create_racer(directory: str, rounds: int, barrier: Any) -> list[bool]:
    wait_ready(barrier)
    won = []
    for r in range(rounds):
        barrier.wait(60)
        won.append(create_private_file(Path(directory) / f"race-{r}.db"))
    return won


def _open_racer(url: str, i: int, barrier: Any) -> bytes | None:
    wait_ready(barrier)
    barrier.wait(60)
    with Store.open(url, migrate=True) as store:
        store.runtime.update_auth_oauth_flow_snapshot(lambda cur: (cur or b"") + b"%d," % i)
        return store.runtime.load_auth_oauth_flow_snapshot()


@pytest.mark.slow
def test_processes_racing_to_create_one_file(tmp_path: Path) -> None:
    """O_EXCL decides: each file is created by exactly one process; opening races succeed."""
    n, rounds = 3, 8
    barrier = SPAWN.Barrier(n)
    results = run_processes([(_create_racer, (str(tmp_path), rounds, barrier))] * n)
    for r in range(rounds):
        assert sum(won[r] for won in results) == 1, (r, results)
        assert mode(tmp_path / f"race-{r}.db") == 0o600
    url = f"sqlite:///{tmp_path / 'opened.db'}"
    barrier = SPAWN.Barrier(n)
    run_processes([(_open_racer, (url, i, barrier)) for i in range(n)])
    with Store.open(url) as store:
        final = store.runtime.load_auth_oauth_flow_snapshot()
    assert final is not None and sorted(final.split(b",")[:-1]) == [b"0", b"1", b"2"]
    assert mode(tmp_path / "opened.db") == 0o600


class _ScriptedCursor:
    """A cursor whose ``journal_mode=WAL`` switch fails ``locked`` times with a lock error
    (as when SQLite's busy handler does not wait: two connections switching at once)."""

    def __init__(self, locked: int, busy_ms: int, error: str = "database is locked") -> None:
        self.locked, self.busy_ms, self.error = locked, busy_ms, error
        self.mode, self.switches, self._row = "delete", 0, None

    def execute(self, sql: str) -> None:
        if sql == "PRAGMA busy_timeout":
            self._row = (self.busy_ms,)
        elif sql == "PRAGMA journal_mode":
            self._row = (self.mode,)
        elif sql == "PRAGMA journal_mode=WAL":
            self.switches += 1
            if self.switches <= self.locked:
                raise sqlite3.OperationalError(self.error)
            self.mode, self._row = "wal", ("wal",)
        else:  # pragma: no cover - nothing else is sent
            raise AssertionError(sql)

    def fetchone(self) -> Any:
        return self._row


def test_a_locked_switch_to_wal_is_tried_again_within_the_busy_timeout() -> None:
    """A switch refused with "database is locked" is retried until it goes through; past
    the busy timeout the lock error is raised; any other error at once."""
    from agentkeep.db import _switch_to_wal

    cur = _ScriptedCursor(locked=3, busy_ms=5_000)
    _switch_to_wal(cur, "", sqlite3.OperationalError)
    assert (cur.mode, cur.switches) == ("wal", 4)

    cur = _ScriptedCursor(locked=10**6, busy_ms=30)
    with pytest.raises(sqlite3.OperationalError, match="locked"):
        _switch_to_wal(cur, "", sqlite3.OperationalError)
    assert cur.switches > 1

    cur = _ScriptedCursor(locked=1, busy_ms=5_000, error="disk I/O error")
    with pytest.raises(sqlite3.OperationalError, match="disk I/O"):
        _switch_to_wal(cur, "", sqlite3.OperationalError)
    assert cur.switches == 1
