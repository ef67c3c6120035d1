"""``agentkeep demo``: scenarios that race real worker processes against one database.

Each store contributes a scenario module with a ``run(url, workers, ops) -> Report``
function; :func:`run_all` runs them in order, prints every report and returns
whether every invariant held (docs/architecture.md#command-line).
"""

from __future__ import annotations

from agentkeep.demo.report import Report
from agentkeep.demo.runs import run as run_runs_scenario
from agentkeep.demo.runtime import run as run_runtime_scenario
from agentkeep.demo.sessions import run as run_sessions_scenario

__all__ = ["Report", "run_all"]

SCENARIOS = (
    ("runs", run_runs_scenario),
    ("sessions", run_sessions_scenario),
    ("runtime", run_runtime_scenario),
)


def run_all(url: str, *, workers: int, ops: int) -> bool:
    """Run every scenario against ``url``; print the reports; True if all invariants held."""
    ok = True
    for name, scenario in SCENARIOS:
        report = scenario(url, workers=workers, ops=ops)
        print(report.render(name))
        ok = ok and report.ok
    print("demo: all invariants held" if ok else "demo: INVARIANT VIOLATED")
    return ok
