"""What the runtime demo's workers and its checks share: outcome names, observation, the
queries its checks run beside the store's reads (built from the models).

See :mod:`agentkeep.demo.runtime` (the scenario) and
:mod:`agentkeep.demo.runtime_checks` (the invariants).
"""

from __future__ import annotations

import hashlib
from typing import Any, Final

from sqlalchemy import bindparam, func, select

from agentkeep.runtime.models import BoundaryReceiptRow, RetiredOpsEpochRow
from agentkeep.store import Store

__all__ = [
    "COUNT_RECEIPTS",
    "EPOCH",
    "OK",
    "RETIRED",
    "RETIRED_MARKER",
    "SUPERSEDED",
    "WRITE_FAILED",
    "digest",
    "observe",
    "split",
]

EPOCH: Final = "epoch-demo"
OK: Final = "ok"
SUPERSEDED: Final = "SessionSnapshotSuperseded"
WRITE_FAILED: Final = "WriteFailed"
RETIRED: Final = "OpsLifecycleEpochRetired"
#: The retired-epoch marker of a runtime (the checks read it beside the store's reads).
RETIRED_MARKER: Final = (
    select(func.count())
    .select_from(RetiredOpsEpochRow)
    .where(
        RetiredOpsEpochRow.runtime_id == bindparam("rt"),
        RetiredOpsEpochRow.epoch_id == bindparam("epoch"),
    )
)
#: How many boundary receipts a runtime has.
COUNT_RECEIPTS: Final = (
    select(func.count())
    .select_from(BoundaryReceiptRow)
    .where(BoundaryReceiptRow.runtime_id == bindparam("rt"))
)


def digest(data: bytes | None) -> str:
    return "" if data is None else hashlib.sha256(data).hexdigest()


def observe(store: Store, rt: str) -> dict[str, Any]:
    """Lifecycle state, ops epoch, input states and retired marker, in one read unit."""
    with store.read() as uow:
        # Lifecycle first: even without one snapshot for the unit, a final
        # lifecycle read here means the ops read below follows the commit.
        lifecycle = uow.runtime.load_machine_lifecycle(rt)
        ops = uow.runtime.load_ops_lifecycle(rt)
        inputs = uow.runtime.load_input_states(rt)
        marker = uow.connection.execute(RETIRED_MARKER, {"rt": rt, "epoch": EPOCH}).scalar()
    return {
        "state": None if lifecycle is None else lifecycle.runtime_state,
        "ops_epoch": None if ops is None else ops.epoch_id,
        "inputs": sorted(s.current_state for s in inputs),
        "retired_marker": bool(marker),
    }


def split(obs: dict[str, Any]) -> bool:
    """I7 violated: the lifecycle is final while the retired epoch's ops row exists."""
    return bool(obs["state"] == "retired" and obs["ops_epoch"] == EPOCH)
