"""Fixtures shared by the session-store tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.support import raw_exec

_PG_FAULT_FN = (
    "CREATE OR REPLACE FUNCTION agentkeep_test_commit_fault() RETURNS trigger AS $$ "
    "BEGIN RAISE EXCEPTION 'injected fault'; END $$ LANGUAGE plpgsql"
)


@pytest.fixture
def fault_on(db_url: str, backend: str) -> Iterator[Callable[..., None]]:
    """``fault_on(table, event="INSERT")``: an AFTER ``event`` trigger on ``table`` that
    raises; dropped afterwards."""
    installed: list[tuple[str, str]] = []

    def install(table: str, event: str = "INSERT") -> None:
        name = f"agentkeep_test_commit_fault_{len(installed)}"
        if backend == "sqlite":
            raw_exec(
                db_url,
                f"CREATE TRIGGER {name} AFTER {event} ON {table} "
                "BEGIN SELECT RAISE(ABORT, 'injected fault'); END",
            )
        else:
            raw_exec(
                db_url,
                _PG_FAULT_FN,
                f"CREATE TRIGGER {name} AFTER {event} ON {table} FOR EACH ROW "
                "EXECUTE FUNCTION agentkeep_test_commit_fault()",
            )
        installed.append((name, table))

    yield install
    for name, table in installed:
        raw_exec(
            db_url,
            f"DROP TRIGGER IF EXISTS {name}" + ("" if backend == "sqlite" else f" ON {table}"),
        )
