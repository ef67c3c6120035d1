"""Every benchmark still runs: each script once, with the smallest sizes it takes.

A benchmark that compares the store with raw drivers keeps its own copy of
the statements' shapes or checks that the store still sends what it replays
(``bench_sessions``, ``bench_commits``, ``bench_runs``); a change in a
repository that the benchmark did not follow makes it stop with "benchmark
out of date" instead of measuring something else. Running each script here
catches that when the change is made, not when someone next measures. No
figure is asserted: speed is read off the benchmarks' output, not tested.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import BACKENDS, PG_ADMIN_URL, require_postgres

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"

#: (script, its smallest arguments).
SQLITE_RUNS = [
    ("bench_async.py", ["--tasks", "2", "--turns", "3", "--repeats", "1", "--backends", "sqlite"]),
    ("bench_observability.py", ["--n", "20", "--rounds", "1", "--cycles", "1"]),
    ("bench_pages.py", ["--seed", "5", "--n", "5"]),
    ("bench_runs.py", ["--n", "20", "--rounds", "1", "--warmup", "20"]),
    (
        "bench_runs_scale.py",
        ["--n", "20", "--rounds", "1", "--warmup", "5", "--sizes", "100", "1000"],
    ),
    ("bench_runtime.py", ["--n", "5", "--cas-n", "2", "--rounds", "1"]),
    ("bench_step_log.py", ["--sizes", "10,100", "--n", "5"]),
    (
        "bench_turns.py",
        ["--lengths", "10,50", "--window", "5", "--no-postgres", "--n", "5", "--rounds", "1"],
    ),
    ("bench_sessions.py", ["--n", "10", "--rounds", "1", "--scale", "100,1000"]),
    ("bench_commits.py", ["--n", "10", "--rounds", "1", "--scale", "100,1000"]),
    ("bench_langgraph.py", ["--steps", "5", "--rounds", "1", "--no-postgres"]),
    ("bench_langgraph.py", ["--replay", "--steps", "5", "--rounds", "1"]),
]


def _run(script: str, args: list[str]) -> str:
    done = subprocess.run(
        [sys.executable, script, *args],
        cwd=BENCHMARKS,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, f"{script} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    assert "out of date" not in done.stdout + done.stderr
    return done.stdout


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    ("script", "args"),
    SQLITE_RUNS,
    ids=[f"{s} --replay" if "--replay" in a else s for s, a in SQLITE_RUNS],
)
def test_the_benchmark_runs_on_sqlite(script: str, args: list[str]) -> None:
    out = _run(script, args)
    assert out.strip(), f"{script} printed nothing"
    if "--replay" in args:
        assert "SqliteSaver" in out and "put_writes" in out, out


@pytest.mark.timeout(900)
@pytest.mark.skipif("postgres" not in BACKENDS, reason="Postgres not among the test backends")
def test_the_round_trip_benchmark_runs_on_postgres() -> None:
    require_postgres()
    out = _run("bench_roundtrips.py", ["--driver", "psycopg", "--url", PG_ADMIN_URL])
    assert "runtime.atomic_apply" in out
