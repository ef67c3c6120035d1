"""The ``agentkeep`` command line (``agentkeep.cli.main``), on both backends.

Driven in-process (``main(argv)`` with capsys) and, once per backend, through
the installed console script ``.venv/bin/agentkeep`` in a subprocess.

Exit codes (cli docstring): 0 success; 1 drift found (check) or an invariant
failed (demo); 2 the database was refused or could not be reached, with a
one-line message on stderr and no traceback.

SQLite-only cases are named ``test_sqlite_*`` and say so in their docstring.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, inspect, text

from agentkeep import migrations as migrate
from agentkeep.cli import main
from agentkeep.errors import LegacySchemaMismatch
from agentkeep.runs.adoption import detect_runs_revision
from agentkeep.runs.domain import RunRecord
from agentkeep.store import Store

HEAD = migrate.head_revisions()
HEAD_TEXT = ", ".join(HEAD)
ENV_URL = "AGENTKEEP_DATABASE_URL"
UNREACHABLE_PG = "postgresql+psycopg://postgres@127.0.0.1:1/postgres"


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """Run ``main(argv)`` in-process; return (exit code, stdout, stderr)."""
    capsys.readouterr()  # drop anything printed before
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def raw(url: str, sql: str) -> list[tuple[Any, ...]]:
    """Run one statement with a plain SQLAlchemy engine (committed); return its rows."""
    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            result = conn.execute(text(sql))
            return [tuple(r) for r in result] if result.returns_rows else []
    finally:
        engine.dispose()


def state(url: str) -> dict[str, Any]:
    """Tables, indexes of ``runs``, version rows and ``runs`` rows, read with plain SQLAlchemy."""
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            insp = inspect(conn)
            tables = sorted(insp.get_table_names())
            snap: dict[str, Any] = {"tables": tables}
            if "runs" in tables:
                snap["runs_indexes"] = sorted(i["name"] for i in insp.get_indexes("runs"))
                snap["runs_columns"] = [c["name"] for c in insp.get_columns("runs")]
                snap["runs_rows"] = [
                    tuple(r) for r in conn.execute(text("SELECT * FROM runs ORDER BY id"))
                ]
            if migrate.VERSION_TABLE in tables:
                snap["versions"] = sorted(
                    r[0] for r in conn.execute(text(f"SELECT * FROM {migrate.VERSION_TABLE}"))
                )
            return snap
    finally:
        engine.dispose()


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def sqlite_path(url: str) -> Path:
    return Path(url.removeprefix("sqlite:///"))


# ---------------------------------------------------------------- upgrade / current


def test_upgrade_empty_database_then_current_reports_head(
    fresh_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli(capsys, "current", fresh_url)
    assert (code, err) == (0, "")
    assert out.startswith("none (un-versioned or empty)")
    assert f"behind head {HEAD_TEXT}" in out

    code, out, err = run_cli(capsys, "upgrade", fresh_url)
    assert (code, err) == (0, "")
    assert out.strip() == f"at head: {HEAD_TEXT}"
    assert migrate.current(fresh_url) == HEAD
    assert "runs" in state(fresh_url)["tables"]

    code, out, err = run_cli(capsys, "current", fresh_url)
    assert (code, err) == (0, "")
    assert out.strip() == f"{HEAD_TEXT} (head)"

    # a second upgrade at head is a no-op with the same report
    before = state(fresh_url)
    code, out, _ = run_cli(capsys, "upgrade", fresh_url)
    assert (code, out.strip()) == (0, f"at head: {HEAD_TEXT}")
    assert state(fresh_url) == before


def test_console_script_upgrades_and_exits_zero(fresh_url: str) -> None:
    """The installed ``agentkeep`` script (entry point ``agentkeep.cli:main``) end to end."""
    script = Path(sys.executable).parent / "agentkeep"
    if not script.is_file():
        pytest.fail(f"console script not installed next to the interpreter: {script}")
    env = {k: v for k, v in os.environ.items() if k != ENV_URL}

    done = subprocess.run(
        [str(script), "upgrade", fresh_url],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )

    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"at head: {HEAD_TEXT}"
    assert "Traceback" not in done.stderr
    assert migrate.current(fresh_url) == HEAD


# ---------------------------------------------------------------- check


def test_check_reports_no_drift_then_a_dropped_index(
    fresh_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    migrate.upgrade(fresh_url)

    code, out, err = run_cli(capsys, "check", fresh_url)
    assert (code, err) == (0, "")
    assert "no drift" in out
    assert not [line for line in out.splitlines() if line.startswith("drift:")]

    raw(fresh_url, "DROP INDEX ix_runs_created_at_seq")
    code, out, err = run_cli(capsys, "check", fresh_url)

    assert code == 1
    assert err == ""
    drift = [line for line in out.splitlines() if line.startswith("drift:")]
    assert len(drift) == 1, out
    assert "ix_runs_created_at_seq" in drift[0]
    assert "no drift" not in out


def test_check_on_empty_database_reports_the_missing_revision(
    fresh_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run_cli(capsys, "check", fresh_url)
    assert code == 1
    assert any(
        line.startswith("drift:") and "is not head" in line and HEAD_TEXT in line
        for line in out.splitlines()
    ), out


# ---------------------------------------------------------------- refusals (exit 2)


def test_upgrade_refuses_unknown_revision_and_changes_nothing(
    fresh_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    migrate.upgrade(fresh_url)
    with Store.open(fresh_url) as store:
        store.runs.create(RunRecord.new("R-1", "T-1", 10))
    raw(fresh_url, f"UPDATE {migrate.VERSION_TABLE} SET version_num = 'zzzz_9999'")
    before = state(fresh_url)

    code, out, err = run_cli(capsys, "upgrade", fresh_url)

    assert code == 2
    assert out == ""
    assert err.startswith("agentkeep upgrade: ")
    assert "zzzz_9999" in err
    for head in HEAD:
        assert head in err
    assert "Traceback" not in err
    assert state(fresh_url) == before
    assert before["versions"] == ["zzzz_9999"]
    assert len(before["runs_rows"]) == 1


def test_sqlite_upgrade_refuses_legacy_file_of_unknown_shape(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """SQLite only: an un-versioned ``runs`` table of no known shape is refused, file untouched."""
    path = tmp_path / "legacy.db"
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE runs (id TEXT PRIMARY KEY, foo TEXT)")
    con.execute("INSERT INTO runs VALUES ('R-1', 'bar')")
    con.commit()
    con.close()
    # The differences the adopter names, computed on a copy (the original stays untouched).
    probe = tmp_path / "probe.db"
    shutil.copyfile(path, probe)
    engine = create_engine(f"sqlite:///{probe}")
    with engine.connect() as conn, pytest.raises(LegacySchemaMismatch) as info:
        detect_runs_revision(conn)
    engine.dispose()
    differences = info.value.differences
    assert any("foo" in d for d in differences)
    digest = sha256(path)
    siblings = sorted(p.name for p in tmp_path.iterdir())

    code, out, err = run_cli(capsys, "upgrade", f"sqlite:///{path}")

    assert code == 2
    assert out == ""
    assert err.startswith("agentkeep upgrade: ")
    for line in differences:
        assert line in err
    assert "Traceback" not in err
    assert sha256(path) == digest
    assert sorted(p.name for p in tmp_path.iterdir()) == siblings  # no -wal/-journal left
    con = sqlite3.connect(path)
    try:
        assert con.execute("SELECT * FROM runs").fetchall() == [("R-1", "bar")]
        assert con.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
    finally:
        con.close()


def test_sqlite_demo_refuses_in_memory_database(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """SQLite only: worker processes cannot share ``sqlite://``; exit 2 with a message."""
    code, out, err = run_cli(capsys, "demo", "sqlite://", "--workers", "2", "--ops", "5")
    assert code == 2
    message = out + err
    assert "agentkeep demo" in message
    assert "file or Postgres URL" in message
    assert "all invariants held" not in message
    assert "Traceback" not in message


@pytest.mark.parametrize("command", ["upgrade", "current", "check", "demo"])
def test_unreachable_postgres_exits_2_without_traceback(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli(capsys, command, UNREACHABLE_PG)
    assert code == 2
    assert "all invariants held" not in out
    assert err.startswith(f"agentkeep {command}: ")
    assert "127.0.0.1" in err
    assert "Traceback" not in err


# ---------------------------------------------------------------- demo


def test_demo_small_run_holds_every_invariant(
    fresh_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli(capsys, "demo", fresh_url, "--workers", "2", "--ops", "40")
    assert code == 0, out + err
    assert "demo: all invariants held" in out
    assert "[FAIL]" not in out
    assert "workers x rounds" in out and "2 x 40" in out
    assert migrate.current(fresh_url) == HEAD


# ---------------------------------------------------------------- default URL


def test_default_url_is_agentkeep_db_in_cwd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """SQLite only (the default URL is ``sqlite:///agentkeep.db``)."""
    monkeypatch.delenv(ENV_URL, raising=False)
    migrated = tmp_path / "migrated"
    migrated.mkdir()
    migrate.upgrade(f"sqlite:///{migrated / 'agentkeep.db'}")
    empty = tmp_path / "empty"
    empty.mkdir()

    monkeypatch.chdir(migrated)
    code, out, err = run_cli(capsys, "current")
    assert (code, err) == (0, "")
    assert out.strip() == f"{HEAD_TEXT} (head)"

    monkeypatch.chdir(empty)
    code, out, err = run_cli(capsys, "current")
    assert (code, err) == (0, "")
    assert out.startswith("none (un-versioned or empty)")

    code, out, _ = run_cli(capsys, "upgrade")
    assert (code, out.strip()) == (0, f"at head: {HEAD_TEXT}")
    assert migrate.current(f"sqlite:///{empty / 'agentkeep.db'}") == HEAD


def test_environment_url_is_used_when_no_argument(
    db_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.setenv(ENV_URL, db_url)

    code, out, err = run_cli(capsys, "current")
    assert (code, err) == (0, "")
    assert out.strip() == f"{HEAD_TEXT} (head)"
    assert not (cwd / "agentkeep.db").exists()

    # an explicit argument beats the environment
    other = f"sqlite:///{tmp_path / 'other.db'}"
    code, out, _ = run_cli(capsys, "current", other)
    assert code == 0
    assert out.startswith("none (un-versioned or empty)")
    assert not (cwd / "agentkeep.db").exists()
