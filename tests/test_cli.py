"""The ``agentkeep`` command line (``agentkeep.cli.main``), on both backends.

Driven in-process (``main(argv)`` with capsys) and, per backend, as a
subprocess: the console script next to the interpreter
(``Path(sys.executable).parent / "agentkeep"``) and ``sys.executable -m
agentkeep`` walking through every command.

Exit codes (cli docstring): 0 success; 1 check found the database not
migrated, behind head or drifted, or an invariant failed (demo); 2 the database
was refused (ahead of this code, unknown legacy shape, a stamp its tables do
not match), could not be reached, or is a missing SQLite file that a command
must not create, with a one-line message on stderr and no traceback.

SQLite-only cases are named ``test_sqlite_*`` and say so in their docstring.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sqlite3
import subprocess
import sys
from importlib.metadata import version
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
from tests.support import raw_exec, raw_rows

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
    fresh_url: str, backend: str, capsys: pytest.CaptureFixture[str]
) -> None:
    if backend == "sqlite":  # the file does not exist yet: current refuses, creates nothing
        code, out, err = run_cli(capsys, "current", fresh_url)
        assert (code, out) == (2, "")
        assert err.startswith("agentkeep current: ")
        assert "does not exist" in err and "agentkeep upgrade" in err
        assert not sqlite_path(fresh_url).exists()
        raw_rows(fresh_url, "SELECT 1")  # now an empty database file
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
    assert out == "no drift: the database matches the models at head\n"

    raw_exec(fresh_url, "DROP INDEX ix_runs_created_at_seq")
    code, out, err = run_cli(capsys, "check", fresh_url)

    assert code == 1
    assert err == ""
    drift = [line for line in out.splitlines() if line.startswith("drift:")]
    assert len(drift) == 1, out
    assert "ix_runs_created_at_seq" in drift[0]
    assert "no drift" not in out


def test_check_on_empty_database_says_not_migrated_in_one_line(
    fresh_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    raw_rows(fresh_url, "SELECT 1")  # SQLite: an existing, empty file
    code, out, err = run_cli(capsys, "check", fresh_url)
    assert (code, err) == (1, "")
    assert out == f"{migrate.NOT_MIGRATED}\n"
    assert "not migrated" in out and "run `agentkeep upgrade`" in out
    assert migrate.current(fresh_url) == ()  # check wrote nothing


def test_check_behind_head_says_so_in_one_line(
    fresh_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    migrate.upgrade(fresh_url, "runs_0005")
    code, out, err = run_cli(capsys, "check", fresh_url)
    assert (code, err) == (1, "")
    assert out.splitlines() == [
        f"behind head: revision runs_0005 is not head {HEAD_TEXT}; run `agentkeep upgrade`"
    ]


# ---------------------------------------------------------------- refusals (exit 2)


def test_upgrade_refuses_unknown_revision_and_changes_nothing(
    fresh_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    migrate.upgrade(fresh_url)
    with Store.open(fresh_url) as store:
        store.runs.create(RunRecord.new("R-1", "T-1", 10))
    raw_exec(fresh_url, f"UPDATE {migrate.VERSION_TABLE} SET version_num = 'zzzz_9999'")
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
    assert (code, out) == (2, "")
    assert err.startswith("agentkeep current: sqlite:///agentkeep.db: ")
    assert not (empty / "agentkeep.db").exists()

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

    # an explicit argument (positional or --url) beats the environment
    other = f"sqlite:///{tmp_path / 'other.db'}"
    for argv in (["current", other], ["current", "--url", other]):
        code, out, err = run_cli(capsys, *argv)
        assert (code, out) == (2, "")  # the file does not exist, and is not created
        assert err.startswith(f"agentkeep current: {other}: ")
    assert not (tmp_path / "other.db").exists()
    assert not (cwd / "agentkeep.db").exists()


# ---------------------------------------------------------------- every command, as a subprocess

SCRIPT_NAMES = {
    "sessions_0005",
    "merge_0005",
    "merge_0004",
    "merge_0003",
    "merge_0002",
    "merge_0001",
    "runs_0001",
    "runs_0006",
    "sessions_0001",
    "runtime_0002",
}


def agentkeep(
    *argv: str, env_url: str | None = None, cwd: Path | None = None
) -> tuple[int, str, str]:
    """``sys.executable -m agentkeep ARGV`` with the package source first on PYTHONPATH."""
    from tests.migrations._alembic_cli import subprocess_env

    done = subprocess.run(
        [sys.executable, "-m", "agentkeep", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env=subprocess_env(**{ENV_URL: env_url}),
        cwd=cwd,
        check=False,
    )
    assert "Traceback" not in done.stderr, done.stderr
    return done.returncode, done.stdout, done.stderr


def test_every_command_as_a_subprocess(fresh_url: str, backend: str, tmp_path: Path) -> None:
    """upgrade --sql, upgrade, current, check, heads, history, downgrade, stamp, --version."""
    code, out, err = agentkeep("--version")
    assert (code, err) == (0, "")
    assert out == f"agentkeep {version('agentkeep')} (migration head {HEAD_TEXT})\n"

    # offline: SQL for the URL's dialect; nothing is opened or created
    code, out, err = agentkeep("upgrade", "--sql", fresh_url)
    assert (code, err) == (0, "")
    assert out.startswith("BEGIN IMMEDIATE;" if backend == "sqlite" else "BEGIN;")
    assert f"CREATE TABLE {migrate.VERSION_TABLE}" in out and "CREATE TABLE runs (" in out
    assert out.rstrip().endswith("COMMIT;")
    if backend == "postgres":
        assert "SELECT pg_advisory_xact_lock(" in out
    else:
        assert not sqlite_path(fresh_url).exists()
    assert state(fresh_url)["tables"] == []

    code, out, err = agentkeep("upgrade", "--url", fresh_url, "-r", "runs_0005")
    assert (code, err) == (0, "")
    assert out == "at: runs_0005\n"
    code, out, err = agentkeep("current", env_url=fresh_url)  # from AGENTKEEP_DATABASE_URL
    assert (code, err, out) == (0, "", f"runs_0005 (behind head {HEAD_TEXT})\n")

    code, out, err = agentkeep("upgrade", fresh_url)
    assert (code, err, out) == (0, "", f"at head: {HEAD_TEXT}\n")
    code, out, err = agentkeep("current", fresh_url)
    assert (code, err, out) == (0, "", f"{HEAD_TEXT} (head)\n")
    code, out, err = agentkeep("check", fresh_url)
    assert (code, err, out) == (0, "", "no drift: the database matches the models at head\n")

    code, out, err = agentkeep("heads")  # scripts only: no database needed
    assert (code, err) == (0, "")
    assert out == "sessions_0005 (runs, runtime, sessions) (head)\n"
    code, out, err = agentkeep("heads", "--indicate-current", fresh_url)
    assert (code, err) == (0, "")
    assert out == "sessions_0005 (runs, runtime, sessions) (head) (current)\n"
    code, out, err = agentkeep("history", fresh_url, "-i")
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert len(lines) == len(list(migrate.script_directory().walk_revisions()))
    assert lines[0].startswith("merge_0005 -> sessions_0005 (")
    assert lines[0].endswith("(current)")
    assert [line for line in lines if line.endswith("(current)")] == [lines[0]]
    assert "<base> -> runs_0001 (runs), runs: baseline" in out
    assert {name for name in SCRIPT_NAMES if name in out} == SCRIPT_NAMES

    code, out, err = agentkeep("downgrade", "runtime@base", fresh_url)
    assert (code, err) == (0, "")
    assert out == "at: merge_0002, sessions_0004\n"
    code, out, err = agentkeep("stamp", "heads", fresh_url)  # runtime tables are gone: refused
    assert (code, out) == (2, "")
    assert err.startswith("agentkeep stamp: refused to stamp heads: ")
    assert set(migrate.current(fresh_url)) == {"merge_0002", "sessions_0004"}

    code, out, err = agentkeep("downgrade", "base", fresh_url)
    assert (code, err, out) == (0, "", "at base: no agentkeep table is left\n")
    assert set(state(fresh_url)["tables"]) <= {migrate.VERSION_TABLE}

    code, out, err = agentkeep("check", fresh_url)
    assert (code, err, out) == (1, "", f"{migrate.NOT_MIGRATED}\n")


def test_help_states_the_url_rule_and_the_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (
        ["--help"],
        *([c, "--help"] for c in ("upgrade", "downgrade", "stamp", "current", "check")),
        *([c, "--help"] for c in ("history", "heads", "demo")),
        ["migrate-legacy", "runtime", "--help"],
    ):
        capsys.readouterr()
        with pytest.raises(SystemExit) as exited:
            main(argv)
        assert exited.value.code == 0
        text = " ".join(capsys.readouterr().out.split())
        assert "positional argument or --url" in text, argv
        assert f"${ENV_URL}" in text and "sqlite:///agentkeep.db" in text, argv
        assert "exit codes: 0 success 1 check: not migrated" in text, argv
        assert "2 refused or failed" in text, argv


# ---------------------------------------------------------------- read-only and refusals


@pytest.mark.parametrize(
    "argv",
    [
        ["current"],
        ["check"],
        ["heads", "--indicate-current"],
        ["history", "--indicate-current"],
        ["downgrade", "base"],
        ["stamp", "heads"],
    ],
)
def test_sqlite_missing_file_is_an_error_and_is_not_created(
    argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """SQLite only: commands that never create a database refuse a mistyped path, exit 2."""
    url = f"sqlite:///{tmp_path / 'typo.db'}"
    code, out, err = run_cli(capsys, *argv, url)
    assert (code, out) == (2, "")
    assert err == (
        f"agentkeep {argv[0]}: {url}: database file {tmp_path / 'typo.db'} does not exist "
        "(nothing was created; create and migrate it with `agentkeep upgrade`)\n"
    )
    assert list(tmp_path.iterdir()) == []


def test_current_and_check_on_a_database_ahead_of_this_code(
    db_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    raw_exec(db_url, f"UPDATE {migrate.VERSION_TABLE} SET version_num = 'zzzz_9999'")
    try:
        code, out, err = run_cli(capsys, "current", db_url)
        assert (code, err) == (2, "")
        assert out == f"ahead of this code: zzzz_9999 (this code's head: {HEAD_TEXT})\n"

        code, out, err = run_cli(capsys, "check", db_url)
        assert (code, out) == (2, "")
        assert err.startswith("agentkeep check: database revision zzzz_9999 is unknown")

        before = state(db_url)
        for argv in (["downgrade", "base"], ["stamp", "heads"], ["upgrade"]):
            code, out, err = run_cli(capsys, *argv, db_url)
            assert (code, out) == (2, ""), argv
            assert "zzzz_9999" in err and "nothing was changed" in err, argv
        assert state(db_url) == before
    finally:
        raw_exec(db_url, f"UPDATE {migrate.VERSION_TABLE} SET version_num = '{HEAD[0]}'")


def test_stamp_accepts_tables_that_match_and_refuses_ones_that_do_not(
    db_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    raw_exec(db_url, f"DELETE FROM {migrate.VERSION_TABLE}")  # head-shaped tables, no stamp
    try:
        before = state(db_url)
        # Stamped at runs_0005, upgrading would add seq again: refused, nothing changed.
        code, out, err = run_cli(capsys, "stamp", "runs_0005", db_url)
        assert (code, out) == (2, "")
        assert err.startswith("agentkeep stamp: refused to stamp runs_0005: ")
        assert state(db_url) == before

        code, out, err = run_cli(capsys, "stamp", "heads", db_url)
        assert (code, err, out) == (0, "", f"stamped: {HEAD_TEXT}\n")
        assert migrate.check(db_url) == []
    finally:
        if migrate.current(db_url) != HEAD:
            migrate.stamp(db_url, "heads")


def test_unknown_revision_arguments_exit_2(db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["upgrade", "-r", "nope"], ["downgrade", "nope"], ["stamp", "nope"]):
        code, out, err = run_cli(capsys, *argv, db_url)
        assert (code, out) == (2, ""), argv
        assert err.startswith(f"agentkeep {argv[0]}: ") and "'nope'" in err, argv
    code, out, err = run_cli(capsys, "upgrade", "--sql", "-r", "nope", db_url)
    assert (code, out) == (2, "")  # no partial script
    assert migrate.current(db_url) == HEAD


def test_errors_mask_the_password(capsys: pytest.CaptureFixture[str]) -> None:
    url = "postgresql+psycopg://agent:s3cr3t-pw@127.0.0.1:1/postgres"
    for command in ("upgrade", "current", "check", "downgrade base", "stamp heads"):
        code, out, err = run_cli(capsys, *command.split(), url)
        assert code == 2, command
        assert "s3cr3t-pw" not in out + err, command
        assert "postgresql+psycopg://agent:***@127.0.0.1:1/postgres" in err, command
        assert err.count("\n") == 1, err  # one line


def test_url_given_twice_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["current", "sqlite:///a.db", "--url", "sqlite:///b.db"])
    assert exited.value.code == 2
    assert "give the database URL once" in capsys.readouterr().err
