"""A one-call read whose COMMIT loses the connection still returns what it read.

A read unit writes nothing, so the COMMIT that ends it only ends its
snapshot: a connection lost while that COMMIT is in flight leaves no outcome
to be unsure of. The read returns its result (not ``CommitOutcomeUnknown``,
nor the runtime store's ``ReadFailed``), and the dead connection is
discarded, so the store's next call works. Found by the fault campaign
(tests/faults): a terminated Postgres backend at a read's COMMIT.

The connection is lost for real: Postgres terminates the unit's backend
(``pg_terminate_backend`` from another connection, waited for) after the
read and before its COMMIT; on SQLite the unit's connection is closed there.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from sqlalchemy import create_engine, text

from agentkeep.runs.domain import RunRecord
from agentkeep.store import Store
from agentkeep.unit_of_work import Repositories
from tests.conftest import PG_ADMIN_URL


def _lose_connection(r: Repositories, backend: str) -> None:
    """Lose the unit's connection before its COMMIT (see the module docstring)."""
    raw: Any = r.driver.raw
    if backend == "sqlite":
        raw.close()
        return
    pid = raw.info.backend_pid
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            assert conn.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid}).scalar()
            deadline = time.monotonic() + 60
            while conn.execute(
                text("SELECT count(*) FROM pg_stat_activity WHERE pid = :pid"), {"pid": pid}
            ).scalar():
                assert time.monotonic() < deadline, "the terminated backend did not go away"
                time.sleep(0.01)
    finally:
        admin.dispose()


@pytest.mark.parametrize("single_statement", [False, True])
def test_read_returns_its_result_when_its_commit_loses_the_connection(
    store: Store, backend: str, single_statement: bool
) -> None:
    store.runs.create(RunRecord.new("R-1", "T-1", 100))
    calls = 0

    def read_then_lose(r: Repositories) -> RunRecord:
        nonlocal calls
        calls += 1
        record = r.runs.get("R-1")
        _lose_connection(r, backend)
        return record

    record = store.call_read(read_then_lose, single_statement=single_statement)
    assert (str(record.id), calls) == ("R-1", 1)  # its own result, read once
    assert str(store.runs.get("R-1").id) == "R-1"  # the dead connection was discarded
