"""``agentkeep migrate-legacy runtime`` on both backends (in-process, and once as a subprocess).

Exit codes: 0 nothing blocked; 1 a runtime is blocked (dry run) or an apply
was refused for blocked runtimes; 2 an error (missing database, lock held).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from agentkeep import cli

from . import _legacy_db as F
from ._legacy_db import LegacyDb

RT = F.RUNTIME_ID
AGENTKEEP = Path(sys.executable).parent / "agentkeep"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = cli.main(["migrate-legacy", "runtime", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_dry_run_apply_and_repeat_print_tables(
    legacy_db: LegacyDb, capsys: pytest.CaptureFixture[str]
) -> None:
    F.build_complete_v0_6_34(legacy_db)
    code, out, err = run(capsys, legacy_db.target)
    assert (code, err) == (0, "")
    assert out.splitlines() == [
        f"{'RUNTIME':<{len(RT)}}  DISPOSITION    DETAIL",
        f"{RT}  would_migrate",
        "dry run: 1 would migrate, 0 current, 0 blocked",
    ]
    assert legacy_db.lifecycle() == F.RUNTIME_STATE

    code, out, err = run(capsys, legacy_db.target, "--apply")
    assert (code, err) == (0, "")
    assert out.splitlines() == [
        f"{'RUNTIME':<{len(RT)}}  DISPOSITION  DETAIL",
        f"{RT}  migrated",
        "applied: 1 migrated, 0 current",
    ]

    code, out, _ = run(capsys, legacy_db.target, "--apply", "--json")
    assert code == 0
    assert json.loads(out) == {
        "applied": True,
        "items": [{"runtime_id": RT, "disposition": "current"}],
    }


def test_blocked_dry_run_exits_1_and_shows_the_detail(
    legacy_db: LegacyDb, capsys: pytest.CaptureFixture[str]
) -> None:
    F.build_complete_v0_6_34(legacy_db)
    F.insert_runtime(legacy_db, "rt:a", lifecycle=b'"running"', ops_record=None)
    code, out, err = run(capsys, legacy_db.target, "--json")
    assert (code, err) == (1, "")
    assert json.loads(out)["items"] == [
        {
            "runtime_id": "rt:a",
            "disposition": "blocked",
            "detail": 'not the exact v0.6.34 bare "idle" record',
        },
        {"runtime_id": RT, "disposition": "would_migrate"},
    ]
    code, out, err = run(capsys, legacy_db.target)
    assert (code, err) == (1, "")
    assert out.splitlines() == [
        f"{'RUNTIME':<{len(RT)}}  DISPOSITION    DETAIL",
        f'{"rt:a":<{len(RT)}}  blocked        not the exact v0.6.34 bare "idle" record',
        f"{RT}  would_migrate",
        "dry run: 1 would migrate, 0 current, 1 blocked",
    ]


def test_refused_apply_exits_1_with_the_report_and_writes_nothing(
    legacy_db: LegacyDb, capsys: pytest.CaptureFixture[str]
) -> None:
    F.build_complete_v0_6_34(legacy_db)
    F.insert_runtime(legacy_db, "rt:b", lifecycle=b'"running"', ops_record=None)
    before = legacy_db.snapshot()
    code, out, err = run(capsys, legacy_db.target, "--apply", "--json")
    assert code == 1
    report = json.loads(out)
    assert report["applied"] is False
    assert [i["disposition"] for i in report["items"]] == ["blocked", "would_migrate"]
    assert err == (
        "agentkeep migrate-legacy: Store read failed: "
        "legacy migration blocked for runtime(s): rt:b\n"
    )
    assert legacy_db.snapshot() == before


def test_errors_exit_2(
    legacy_db: LegacyDb, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    missing = tmp_path / "nope.sqlite3"
    code, out, err = run(capsys, str(missing))
    assert (code, out) == (2, "")
    assert err == (
        f"agentkeep migrate-legacy: Store read failed: runtime database does not exist: {missing}\n"
    )
    assert not missing.exists()
    code, _, err = run(capsys, "sqlite://")
    assert code == 2 and "in-memory" in err

    F.build_complete_v0_6_34(legacy_db)
    reader = legacy_db.hold(
        (["BEGIN"] if legacy_db.backend == "sqlite" else []) + ["SELECT * FROM runtime_states"]
    )
    try:
        code, out, err = run(capsys, legacy_db.target, "--apply")
    finally:
        reader.close()
    assert (code, out) == (2, "")
    assert err.startswith("agentkeep migrate-legacy: Store write failed: ")


def test_progress_lines_on_stderr(
    legacy_db: LegacyDb, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    F.create_schema(legacy_db)
    ids = F.insert_many_runtimes(legacy_db, 3)
    code, _, err = run(capsys, legacy_db.target)
    assert (code, err) == (0, "")  # below the threshold, no flag: quiet
    code, _, err = run(capsys, legacy_db.target, "--progress")
    assert code == 0
    assert err.splitlines() == [f"checked {n}/3 {rid}" for n, rid in enumerate(ids, 1)]
    monkeypatch.setattr(cli, "PROGRESS_THRESHOLD", 3)
    code, _, err = run(capsys, legacy_db.target, "--apply")
    assert code == 0
    assert err.splitlines() == [
        f"{verb} {n}/3 {rid}" for verb in ("checked", "migrated") for n, rid in enumerate(ids, 1)
    ]


def test_console_script(legacy_db: LegacyDb) -> None:
    F.build_complete_v0_6_34(legacy_db)
    done = subprocess.run(
        [str(AGENTKEEP), "migrate-legacy", "runtime", legacy_db.url, "--apply", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (done.returncode, done.stderr) == (0, "")
    assert json.loads(done.stdout)["items"] == [{"runtime_id": RT, "disposition": "migrated"}]
