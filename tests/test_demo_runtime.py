"""The runtime demo scenario (``agentkeep demo``): racing boundaries and faulty finalizations.

The scenario spawns real worker processes against the backend's database and
must report every invariant held (I1, I2, the receipt-key fence, I6, I7 and
the fault outcomes). A second test feeds the boundary checks a boundary that
claims to be superseded but was written, and they must report the violation.
"""

from __future__ import annotations

import uuid

from agentkeep.demo import SCENARIOS
from agentkeep.demo import runtime as scenario
from agentkeep.demo.report import Report
from agentkeep.demo.runtime_checks import check_boundaries
from agentkeep.runtime import RunBoundaryReceipt
from agentkeep.store import Store

EXPECTED_CHECKS = (
    "successive snapshots: each commits or is superseded; the longest always commits",
    "after each race the head is the longest successor",
    "a stale snapshot after the head advanced is SessionSnapshotSuperseded",
    "same receipt key: exactly one winner per round, the others WriteFailed",
    "I1 boundary atomicity: every receipt's inputs are stored, and no other input",
    "I1 a superseded or refused boundary left no receipt and no inputs",
    "I2 superseded means nothing written (receipt, inputs; the stale one: head)",
    "lost acknowledgement (synthetic_fault(3)): Ok after classification, state final",
    "power cut (synthetic_fault(1)): WriteFailed and nothing of it written",
    "fault 3: the retries converge (Ok, then Ok again) on the final state",
    "fault 1: the retries converge (Ok, then Ok again) on the final state",
    "I6 a retired epoch refuses persist_ops_lifecycle and initialize_ops_lifecycle_if_absent",
    "I7 no split unregister: never a final lifecycle next to the retired epoch's ops row",
)


def test_runtime_scenario_is_registered() -> None:
    assert ("runtime", scenario.run) in SCENARIOS


def test_runtime_scenario_holds_every_invariant(db_url: str) -> None:
    report = scenario.run(db_url, workers=2, ops=40)
    rendered = report.render("runtime")
    failed = [(name, detail) for name, held, detail in report.checks if not held]
    assert not failed, rendered
    assert report.ok
    names = [name for name, _, _ in report.checks]
    assert names[0] == "every worker finished without error"
    assert set(EXPECTED_CHECKS) <= set(names), rendered
    assert "[FAIL]" not in rendered
    figures = dict(report.figures)
    assert figures["workers x rounds"] == "2 x 2"
    # Two rounds of two racers: a stale boundary per round is always superseded.
    assert "stale:SessionSnapshotSuperseded 2" in figures["outcomes"]
    assert "same-key:ok 2" in figures["outcomes"]
    assert "same-key:WriteFailed 2" in figures["outcomes"]


def test_boundary_checks_catch_a_superseded_boundary_that_wrote(db_url: str) -> None:
    """A boundary reported superseded whose receipt and inputs were stored fails I1 and I2."""
    rt = f"rt:demo-check:{uuid.uuid4().hex[:8]}"
    run_id = str(uuid.uuid4())
    chain = scenario._chain(2)
    with Store.open(db_url) as store:
        store.runtime.atomic_apply(
            rt, chain[0], RunBoundaryReceipt(run_id=run_id, boundary="RunStart", sequence=99)
        )
        liar = scenario._apply(store, rt, ("race", 0, 0), chain[1], (run_id, 1))
        longest = scenario._apply(store, rt, ("race", 0, 1), chain[2], (run_id, 2))
        stale = scenario._apply(store, rt, ("stale", 0, 0), chain[0], (run_id, 0))
        stale.update(head_before=scenario._digest(chain[2]), head_unchanged=True)
        winner = scenario._apply(store, rt, ("same-key", 0, 0), None, (run_id, 3))
        loser = scenario._apply(store, rt, ("same-key", 0, 1), None, (run_id, 3))
        assert [a["outcome"] for a in (liar, longest, stale, winner, loser)] == [
            "ok",
            "ok",
            "SessionSnapshotSuperseded",
            "ok",
            "WriteFailed",
        ]
        honest = Report()
        check_boundaries(honest, store, rt, chain, 2, [liar, longest, stale, winner, loser])
        assert honest.ok, honest.render("honest")

        liar["outcome"] = "SessionSnapshotSuperseded"  # but its receipt and inputs are stored
        report = Report()
        check_boundaries(report, store, rt, chain, 2, [liar, longest, stale, winner, loser])
    held = {name: ok for name, ok, _ in report.checks}
    assert not report.ok
    assert held["I1 a superseded or refused boundary left no receipt and no inputs"] is False
    assert (
        held["I2 superseded means nothing written (receipt, inputs; the stale one: head)"] is False
    )
    assert held["after each race the head is the longest successor"] is True
