"""Parent-side checks of the runtime demo scenario (:mod:`agentkeep.demo.runtime`).

Given what the workers report and what the database holds afterwards, check
and print the invariants: I1 and I2 for boundary commits, the receipt-key
fence, I6 and I7 for unregister finalization (docs/runtime.md#invariants).
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Final

from agentkeep.demo.report import Report
from agentkeep.demo.runtime_shared import COUNT_RECEIPTS as _COUNT_RECEIPTS
from agentkeep.demo.runtime_shared import EPOCH as _EPOCH
from agentkeep.demo.runtime_shared import OK as _OK
from agentkeep.demo.runtime_shared import RETIRED as _RETIRED
from agentkeep.demo.runtime_shared import SUPERSEDED as _SUPERSEDED
from agentkeep.demo.runtime_shared import WRITE_FAILED as _WRITE_FAILED
from agentkeep.demo.runtime_shared import digest as _digest
from agentkeep.demo.runtime_shared import observe as _observe
from agentkeep.demo.runtime_shared import split as _split
from agentkeep.runtime import FinalizationPoint
from agentkeep.store import Store

__all__ = ["check_boundaries", "check_finalizations"]

# --------------------------------------------------------------------------
# Parent: checks


def check_boundaries(
    report: Report,
    store: Store,
    rt: str,
    chain: list[bytes],
    workers: int,
    applies: list[dict[str, Any]],
) -> None:
    races = [a for a in applies if a["phase"] == "race"]
    stales = [a for a in applies if a["phase"] == "stale"]
    same_key = [a for a in applies if a["phase"] == "same-key"]
    rounds = len(races) // workers
    outcomes = Counter(f"{a['phase']}:{a['outcome']}" for a in applies)
    report.figure("boundary commits attempted", str(len(applies)))
    report.figure("outcomes", ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items())))
    report.figure(
        "head snapshot size", f"{len(chain[0]) / 1024:.1f} → {len(chain[-1]) / 1024:.1f} KiB"
    )

    report.check(
        "successive snapshots: each commits or is superseded; the longest always commits",
        all(a["outcome"] in (_OK, _SUPERSEDED) for a in races)
        and all(a["outcome"] == _OK for a in races if a["worker"] == workers - 1),
    )
    heads = {r: _digest(chain[(r + 1) * workers]) for r in range(rounds)}
    final = store.runtime.load_session_snapshot(rt)
    report.check(
        "after each race the head is the longest successor",
        all(a["head_before"] == heads[a["round"]] for a in stales) and final == chain[-1],
    )
    report.check(
        "a stale snapshot after the head advanced is SessionSnapshotSuperseded",
        len(stales) == rounds and all(a["outcome"] == _SUPERSEDED for a in stales),
        f"{sum(a['outcome'] == _SUPERSEDED for a in stales)}/{rounds}",
    )
    winners = Counter(a["round"] for a in same_key if a["outcome"] == _OK)
    report.check(
        "same receipt key: exactly one winner per round, the others WriteFailed",
        all(winners[r] == 1 for r in range(rounds))
        and all(a["outcome"] in (_OK, _WRITE_FAILED) for a in same_key),
        ", ".join(str(winners[r]) for r in range(rounds)),
    )

    stored = {s.input_id: s for s in store.runtime.load_input_states(rt)}
    receipts = {
        a["key"]: store.runtime.load_boundary_receipt(rt, a["key"][0], a["key"][1]) for a in applies
    }
    with store.read() as uow:
        receipt_rows = uow.connection.execute(_COUNT_RECEIPTS, {"rt": rt}).scalar()
    committed = [a for a in applies if a["outcome"] == _OK]

    def holds(a: dict[str, Any]) -> bool:
        receipt = receipts[a["key"]]
        details = {"phase": a["phase"], "round": a["round"], "worker": a["worker"]}
        return (
            receipt is not None
            and receipt.contributing_input_ids == a["inputs"]
            and all(i in stored and stored[i].details == details for i in a["inputs"])
        )

    def left_trace(a: dict[str, Any]) -> bool:
        receipt = receipts[a["key"]]
        mine = receipt is not None and receipt.contributing_input_ids == a["inputs"]
        return mine or any(i in stored for i in a["inputs"])

    report.check(
        "I1 boundary atomicity: every receipt's inputs are stored, and no other input",
        all(holds(a) for a in committed)
        and receipt_rows == len(committed) + 1  # + the parent's first boundary
        and len(stored) == 2 * len(committed),
        f"{receipt_rows} receipts, {len(stored)} inputs",
    )
    refused = [a for a in applies if a["outcome"] != _OK]
    report.check(
        "I1 a superseded or refused boundary left no receipt and no inputs",
        not any(left_trace(a) for a in refused),
        f"{len(refused)} refused",
    )
    superseded = [a for a in applies if a["outcome"] == _SUPERSEDED]
    report.check(
        "I2 superseded means nothing written (receipt, inputs; the stale one: head)",
        bool(superseded)
        and all(receipts[a["key"]] is None for a in superseded)
        and not any(left_trace(a) for a in superseded)
        and all(a["head_unchanged"] for a in stales),
        f"{len(superseded)} superseded",
    )


_FINAL: Final = {
    "state": "retired",
    "ops_epoch": None,
    "inputs": ["abandoned", "abandoned"],
    "retired_marker": True,
}
_BEFORE: Final = {
    "state": "idle",
    "ops_epoch": _EPOCH,
    "inputs": ["accepted", "accepted"],
    "retired_marker": False,
}


def check_finalizations(
    report: Report, store: Store, cases: list[dict[str, Any]], results: dict[int, dict[str, Any]]
) -> None:
    for i, case in enumerate(cases):
        fin = results[0]["finalizations"][i]
        name, message = fin["first"]
        if case["fault"] == 3:
            report.check(
                "lost acknowledgement (synthetic_fault(3)): Ok after classification, state final",
                name == _OK
                and FinalizationPoint.AFTER_COMMIT in fin["points"]
                and FinalizationPoint.BEFORE_REOBSERVE in fin["points"]
                and fin["after_first"] == _FINAL,
                name,
            )
        else:
            report.check(
                "power cut (synthetic_fault(1)): WriteFailed and nothing of it written",
                name == _WRITE_FAILED
                and "synthetic power cut" in message
                and fin["after_first"] == _BEFORE,
                f"{name}: {message}" if message else name,
            )
        report.check(
            f"fault {case['fault']}: the retries converge (Ok, then Ok again) on the final state",
            [o for o, _ in fin["retries"]] == [_OK, _OK]
            and fin["after_retries"] == _FINAL
            and _observe(store, case["rt"]) == _FINAL,
        )
    every = [r for ev in results.values() for r in ev["finalizations"]]
    late = [r for r in every if r["role"] == "late-writer"]
    report.figure(
        "late ops writes accepted before retirement",
        ", ".join(str(r["accepted"]) for r in late),
    )
    report.check(
        "I6 a retired epoch refuses persist_ops_lifecycle and initialize_ops_lifecycle_if_absent",
        all(r["persist_after"] == _RETIRED and r["initialize_after"] == _RETIRED for r in every)
        and all(r["after_done"] == 0 for r in late)
        and all(r["after"] == _FINAL for r in every),
        f"{2 * len(every)} refused writes",
    )
    observations = sum(r["observations"] for r in every if r["role"] != "finalizer")
    splits = sum(r["splits"] for r in every if r["role"] != "finalizer")
    report.figure("reads of lifecycle+ops during finalization", str(observations))
    report.check(
        "I7 no split unregister: never a final lifecycle next to the retired epoch's ops row",
        splits == 0 and not any(_split(r["after"]) for r in every),
        f"{splits} of {observations} observations split",
    )
