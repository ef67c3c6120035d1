"""The fault campaign on each backend: nothing acknowledged is lost or doubled.

Four workers run the mixed workload of :mod:`tests.faults.worker` against one
database for ``AGENTKEEP_FAULT_SECONDS`` (default 25) once they are ready,
SIGKILLed at random moments and restarted; on Postgres random worker
backends are also terminated with ``pg_terminate_backend``. Then the
invariants of :mod:`tests.faults.checker` must hold over the final database
and every acknowledged result, and every exception a public call raised
must have been one of the store's typed errors (an untyped one, or an
agentkeep error the workload cannot cause, is printed with its traceback).

A longer soak: ``AGENTKEEP_FAULT_SECONDS=600 pytest tests/faults -k campaign -s``
(``AGENTKEEP_FAULT_WORKERS`` sets the worker count, default 4).
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentkeep import migrations
from tests.conftest import PG_ADMIN_URL, create_pg_database, drop_pg_database
from tests.faults.campaign import CampaignResult, run_campaign
from tests.faults.checker import check
from tests.faults.journal import ACK_KINDS

pytestmark = pytest.mark.slow

SECONDS = float(os.environ.get("AGENTKEEP_FAULT_SECONDS", "25"))
WORKERS = int(os.environ.get("AGENTKEEP_FAULT_WORKERS", "4"))


@pytest.fixture
def campaign_url(backend: str, tmp_path: Path) -> Iterator[str]:
    """A migrated, empty database of its own (Postgres: created and dropped here)."""
    if backend == "sqlite":
        url = f"sqlite:///{tmp_path / 'campaign.db'}"
        migrations.upgrade(url)
        yield url
        return
    url = create_pg_database("agentkeep_faults")
    try:
        migrations.upgrade(url)
        yield url
    finally:
        drop_pg_database(url)


def _figures(result: CampaignResult, elapsed: float, instances: int) -> list[tuple[str, str]]:
    kinds = Counter(e["k"] for e in result.entries)
    refusals = Counter(
        e["type"] for e in result.entries if e["k"] == "err" and e["op"] != "Store.open"
    )
    opens = Counter(
        e["type"] for e in result.entries if e["k"] == "err" and e["op"] == "Store.open"
    )
    figures = [
        ("fault window / whole test", f"{result.seconds:.0f} s / {elapsed:.0f} s"),
        ("worker incarnations", str(result.incarnations)),
        ("SIGKILLs", str(result.kills)),
        ("operations (calls returned or raised)", str(result.operations)),
        ("acknowledged results", str(sum(kinds[k] for k in _ACKS))),
        ("acks by kind", ", ".join(f"{k} {kinds[k]}" for k in _ACKS)),
        ("typed refusals", ", ".join(f"{t} {n}" for t, n in refusals.most_common())),
        ("Store.open failures (retried)", ", ".join(f"{t} {n}" for t, n in opens.most_common())),
        ("commit outcomes unknown (raised)", str(kinds["unknown"])),
        ("invariant instances checked", str(instances)),
    ]
    if result.backend == "postgres":
        figures.insert(
            3,
            (
                "backends terminated (mid-operation)",
                f"{result.terminated} ({result.terminated_mid_operation})",
            ),
        )
    return figures


_ACKS = sorted(ACK_KINDS)


def test_fault_campaign(backend: str, campaign_url: str, tmp_path: Path) -> None:
    started = time.monotonic()
    result = run_campaign(
        campaign_url,
        tmp_path / "journals",
        backend=backend,
        seconds=SECONDS,
        workers=WORKERS,
        pg_admin_url=PG_ADMIN_URL if backend == "postgres" else None,
    )
    report = check(campaign_url, result.entries)
    elapsed = time.monotonic() - started
    print()
    print(report.render(f"fault campaign: {backend}", _figures(result, elapsed, report.instances)))

    bad = [e for e in result.entries if e["k"] == "bad"]
    for e in bad[:5]:
        print(f"--- {e['what']} {e['type']} from {e['op']} (worker {e['w']}/{e['i']}):\n{e['tb']}")
    assert not bad, Counter((e["op"], e["what"], e["type"]) for e in bad)
    assert not result.crashed, f"workers exited with an error: {result.crashed}"
    assert not result.hung, f"workers did not stop: {result.hung}"
    assert not report.violations, "\n".join(report.violations[:20])
    # The campaign did what it is for (not a vacuous pass): faults happened
    # while every store acknowledged work.
    kinds = Counter(e["k"] for e in result.entries)
    assert result.kills > 0
    assert all(kinds[k] > 0 for k in ("run_create", "run_gen", "lease", "q_enq", "commit")), kinds
    assert kinds["boundary"] > 0 and kinds["ti_enq"] > 0, kinds
    if backend == "postgres":
        assert result.terminated > 0
