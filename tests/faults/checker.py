"""The campaign's invariant checker: the final database against the journals' acks.

:func:`check` reads the whole database through the store (every row must
still decode: an accepted write never poisons a read) and with raw SELECTs,
and checks, per store, what the stores promise (docs/runs.md#the-assignment-model,
docs/sessions.md#invariants, docs/runtime.md#invariants) against every
acknowledged result (:mod:`tests.faults.journal`):

* **nothing acknowledged lost**: every acked run, step entry, enqueued batch
  and turn input, turn commit, receipt and input state is stored (a batch
  may instead have been completed, durably, by a turn commit whose node
  names it);
* **nothing doubled**: one acked creator per run, one winner per
  transition, a step entry stored once, one batch per source key, each
  batch and input completed by one turn at most, each turn recorded once
  and applied once (the usage ledger counts every turn once), a replay
  returning the first result;
* **gap-free heads**: per session the turn records carry revisions exactly
  1..head, and the graph is the chain of their nodes; per runtime the
  snapshot's messages past the seed are exactly those of stored receipts,
  each at the position its receipt names, with its input states;
* **monotonic fences**: run generations and session fencing tokens, over
  the acks of each run or session, are distinct (a token belongs to one
  incarnation) and never go back in real-time order: when one ack's call
  returned before another's began, the later one's value is higher (tokens:
  not lower); the stored counters are at least every acked value.

The real-time order uses each ack's ``t0``/``t1`` (:data:`time.monotonic`
around the call), so it is exact and needs no clock agreement beyond the
machine's one monotonic clock.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from agentkeep.demo.report import Report
from agentkeep.runs.domain import RunStatus
from agentkeep.runtime import ReferenceDomain
from agentkeep.runtime.receipts import decode_receipt, decode_receipt_sequence
from agentkeep.sessions.domain import TurnInputState
from agentkeep.sessions.records import FullGraphScope
from agentkeep.store import Store
from tests.faults.journal import ACK_KINDS
from tests.faults.worker import RUNTIMES, SEED_MESSAGES, SESSIONS, SHARED_RUNS, node_id
from tests.support import raw_rows

__all__ = ["CheckReport", "Invariant", "check", "realtime_order"]


@dataclass
class Invariant:
    """One invariant: how many instances were checked, and the violations found."""

    name: str
    checked: int = 0
    violations: list[str] = field(default_factory=list)

    def expect(self, held: bool, violation: str) -> None:
        self.checked += 1
        if not held:
            self.violations.append(violation)


@dataclass
class CheckReport:
    """Every invariant :func:`check` evaluated, by name, in order."""

    invariants: dict[str, Invariant] = field(default_factory=dict)

    def __call__(self, name: str) -> Invariant:
        return self.invariants.setdefault(name, Invariant(name))

    @property
    def violations(self) -> list[str]:
        return [f"{i.name}: {v}" for i in self.invariants.values() for v in i.violations]

    @property
    def instances(self) -> int:
        return sum(i.checked for i in self.invariants.values())

    def render(self, title: str, figures: Sequence[tuple[str, str]] = ()) -> str:
        report = Report()
        for name, value in figures:
            report.figure(name, value)
        for inv in self.invariants.values():
            shown = "; ".join(inv.violations[:3])
            report.check(f"{inv.name} [{inv.checked}]", not inv.violations, shown)
        return report.render(title)


def realtime_order(
    inv: Invariant, label: str, acks: Iterable[dict[str, Any]], key: str, *, strict: bool
) -> None:
    """Check that ``ack[key]`` never goes back in real-time order.

    For every ack ``y``, every ack ``x`` whose call returned before ``y``'s
    began (``x.t1 < y.t0``) must have a lower value (``strict``) or one not
    higher. One check per ack, O(n log n).
    """
    items = list(acks)
    by_end = sorted(items, key=lambda a: a["t1"])
    j = 0
    best: dict[str, Any] | None = None
    for y in sorted(items, key=lambda a: a["t0"]):
        while j < len(by_end) and by_end[j]["t1"] < y["t0"]:
            if best is None or by_end[j][key] > best[key]:
                best = by_end[j]
            j += 1
        ok = best is None or (best[key] < y[key] if strict else best[key] <= y[key])
        inv.expect(
            ok,
            f"{label}: {key} {y[key]} acked after {best and best[key]} had been acked "
            f"(worker {y['w']}/{y['i']} after {best and best['w']}/{best and best['i']})",
        )


def check(url: str, entries: Sequence[dict[str, Any]]) -> CheckReport:
    """Every invariant of the module docstring, on the database at ``url``."""
    acks: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for e in entries:
        if e["k"] in ACK_KINDS:
            acks[e["k"]].append(e)
    report = CheckReport()
    with Store.open(url) as store:
        _check_runs(report, store, acks)
        _check_leases(report, url, acks)
        _check_commits(report, store, url, acks)
        _check_work(report, store, acks)
        _check_runtime(report, store, url, acks)
    return report


def _check_runs(report: CheckReport, store: Store, acks: dict[str, list[dict[str, Any]]]) -> None:
    records = {str(r.id): r for r in store.runs.list()}  # every run must decode
    inv = report("run: every acked create is stored with its creator's marker")
    for a in acks["run_create"]:
        rec = records.get(a["rid"])
        inv.expect(
            rec is not None and rec.input_json == a["marker"],
            f"{a['rid']} acked to {a['marker']}: stored {rec and rec.input_json}",
        )
    inv = report("run: one acked creator per run id")
    for rid, n in Counter(a["rid"] for a in acks["run_create"]).items():
        inv.expect(n == 1, f"{rid} created {n} times")
    inv = report("run: one acked winner per transition")
    for (rid, to), n in Counter((a["rid"], a["to"]) for a in acks["run_trans"]).items():
        inv.expect(n == 1, f"{rid} -> {to} won {n} times")
    inv = report("run: the status agrees with the acked transitions")
    reached: dict[str, set[str]] = defaultdict(set)
    for a in acks["run_trans"]:
        reached[a["rid"]].add(a["to"])
    for rid, tos in reached.items():
        rec = records.get(rid)
        allowed = {RunStatus.DONE} if "done" in tos else {RunStatus.RUNNING, RunStatus.DONE}
        inv.expect(rec is not None and rec.status in allowed, f"{rid}: {rec and rec.status}")
    inv = report("run: every acked step entry is stored, no entry twice")
    stored_steps = Counter(
        (rid, str(e.step_id)) for rid, rec in records.items() for e in rec.step_entries
    )
    for a in acks["run_step"]:
        n = stored_steps[(a["rid"], a["step"])]
        inv.expect(n == 1, f"{a['rid']} {a['step']} stored {n} times")
    for (rid, step), n in stored_steps.items():
        inv.expect(n == 1, f"{rid} {step} stored {n} times")

    gens: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for a in acks["run_gen"]:
        gens[a["rid"]].append(a)
    distinct = report("run: acked generations are distinct and at most G")
    order = report("run: acked generations increase in real-time order")
    holders = report("run: holders carry distinct generations at most G")
    for rid in SHARED_RUNS:
        rec = records.get(rid)
        if rec is None:
            distinct.expect(False, f"{rid} is gone")
            continue
        mine = gens[rid]
        for g, n in Counter(a["gen"] for a in mine).items():
            distinct.expect(n == 1 and g <= rec.next_generation, f"{rid}: gen {g} acked {n}x")
        realtime_order(order, rid, mine, "gen", strict=True)
        held = [h.gen for h in rec.current.values()]
        holders.expect(
            len(set(held)) == len(held) and all(g <= rec.next_generation for g in held),
            f"{rid}: holders {held}, G {rec.next_generation}",
        )


def _check_leases(report: CheckReport, url: str, acks: dict[str, list[dict[str, Any]]]) -> None:
    stored = dict(
        raw_rows(url, "SELECT session_id, lease_fencing_token FROM session_execution_leases")
    )
    owners = report("lease: each acked fencing token belongs to one incarnation")
    order = report("lease: acked fencing tokens never decrease in real-time order")
    ceiling = report("lease: the stored generation is at least every acked token")
    by_session: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for a in acks["lease"]:
        by_session[a["sid"]].append(a)
    for sid, mine in by_session.items():
        holders: dict[int, set[str]] = defaultdict(set)
        for a in mine:
            holders[a["token"]].add(a["inc"])
        for token, incs in holders.items():
            owners.expect(len(incs) == 1, f"{sid}: token {token} acked to {sorted(incs)}")
        realtime_order(order, sid, mine, "token", strict=False)
        top = max(a["token"] for a in mine)
        ceiling.expect(stored.get(sid, 0) >= top, f"{sid}: stored {stored.get(sid)} < {top}")


def _check_commits(
    report: CheckReport, store: Store, url: str, acks: dict[str, list[dict[str, Any]]]
) -> None:
    records: dict[tuple[str, str], tuple[str, int]] = {}
    for sid, turn, digest, result in raw_rows(
        url, "SELECT session_id, turn_id, turn_commit_hash, result_json FROM runtime_turn_commits"
    ):
        records[(sid, turn)] = (digest, json.loads(result)["head_revision"])
    inv = report("commit: every acked turn is recorded with its hash and revision")
    for a in acks["commit"]:
        got = records.get((a["sid"], a["turn"]))
        inv.expect(got == (a["turn"], a["rev"]), f"{a['sid']}/{a['turn']}@{a['rev']}: {got}")
    distinct = report("commit: acked revisions are distinct per session")
    order = report("commit: acked revisions increase in real-time order")
    for sid in SESSIONS:
        mine = [a for a in acks["commit"] if a["sid"] == sid]
        for rev, n in Counter(a["rev"] for a in mine).items():
            distinct.expect(n == 1, f"{sid}: revision {rev} acked {n} times")
        realtime_order(order, sid, mine, "rev", strict=True)
    inv = report("commit: a replay returns the first commit's revision")
    first = {(a["sid"], a["turn"]): a["rev"] for a in acks["commit"]}
    for a in acks["replay"]:
        inv.expect(first.get((a["sid"], a["turn"])) == a["rev"], f"{a['sid']}/{a['turn']}")

    gap_free = report("head: the turn records' revisions are exactly 1..head")
    chain = report("head: the graph is the chain of the turns' nodes 1..head")
    ledger = report("head: the usage ledger counts every turn once")
    checkpoint = report("head: the checkpoint is the head turn's")
    # The ledger twice: the totals the commit keeps (what a load returns) and the
    # usage rows they were summed from (the audit trail); both count each turn once.
    audit = dict(
        raw_rows(url, "SELECT session_id, sum(input_tokens) FROM usage_deltas GROUP BY session_id")
    )
    for sid in SESSIONS:
        read = store.commits.load_session(sid, FullGraphScope())
        head = 0 if read is None else read.head_revision
        turn_at = {rev: turn for (s, turn), (_, rev) in records.items() if s == sid}
        revs = sorted(rev for (s, _), (_, rev) in records.items() if s == sid)
        gap_free.expect(revs == list(range(1, head + 1)), f"{sid}: head {head}, records {revs}")
        if read is None:
            continue
        nodes = read.graph.nodes
        expected = [
            (node_id(sid, r), node_id(sid, r - 1) if r > 1 else None, r, turn_at.get(r))
            for r in range(1, head + 1)
        ]
        actual = [(n.node_id, n.parent_node_id, n.payload["rev"], n.payload["turn"]) for n in nodes]
        chain.expect(actual == expected, f"{sid}: {len(nodes)} nodes for head {head}")
        tokens = sum(e.usage.input_tokens for e in read.token_ledger)
        ledger.expect(tokens == head, f"{sid}: {tokens} input tokens for head {head}")
        rows = int(audit.get(sid) or 0)
        ledger.expect(rows == head, f"{sid}: {rows} input tokens in usage rows for head {head}")
        state = read.checkpoint.turn_state if read.checkpoint is not None else None
        checkpoint.expect(
            state == {"rev": head, "turn": turn_at.get(head)}, f"{sid}: checkpoint {state}"
        )


def _check_work(report: CheckReport, store: Store, acks: dict[str, list[dict[str, Any]]]) -> None:
    queued = {sid: store.queue.list_queued_work(sid) for sid in SESSIONS}
    inputs = {sid: store.turn_inputs.list_turn_inputs(sid) for sid in SESSIONS}
    completed_batches: dict[str, list[tuple[str, int]]] = defaultdict(list)
    completed_inputs: dict[str, list[tuple[str, int]]] = defaultdict(list)
    keys: dict[tuple[str, str], set[str]] = defaultdict(set)  # (sid, source key) -> batch ids
    for sid in SESSIONS:
        read = store.commits.load_session(sid, FullGraphScope())
        for n in read.graph.nodes if read is not None else ():
            for bid, key in n.payload["batches"]:
                completed_batches[bid].append((sid, n.payload["rev"]))
                keys[(sid, key)].add(bid)
            for iid in n.payload["inputs"]:
                completed_inputs[iid].append((sid, n.payload["rev"]))
        for b in queued[sid]:
            keys[(sid, str(b.source_key))].add(b.batch_id)
    present = {b.batch_id for batches in queued.values() for b in batches}

    inv = report("queue: every acked batch is queued or completed by one turn")
    for a in acks["q_enq"]:
        where = (a["bid"] in present) + len(completed_batches.get(a["bid"], []))
        inv.expect(where == 1, f"{a['sid']}/{a['key']} {a['bid']}: found {where} times")
    inv = report("queue: a batch a turn completed is gone, and completed once")
    for bid, turns in completed_batches.items():
        inv.expect(len(turns) == 1 and bid not in present, f"{bid}: turns {turns}")
    inv = report("queue: one batch per source key")
    for (sid, key), bids in keys.items():
        inv.expect(len(bids) == 1, f"{sid}/{key}: batches {sorted(bids)}")

    rows = {i.input_id: i for items in inputs.values() for i in items}
    inv = report("input: every acked input is stored under its source key")
    for a in acks["ti_enq"]:
        row = rows.get(a["iid"])
        inv.expect(
            row is not None and row.session_id == a["sid"] and row.source_key == a["key"],
            f"{a['sid']}/{a['key']} {a['iid']}: {row and (row.session_id, row.source_key)}",
        )
    inv = report("input: one input per source key")
    for sid, items in inputs.items():
        for key, n in Counter(i.source_key for i in items).items():
            inv.expect(n == 1, f"{sid}/{key}: {n} inputs")
    inv = report("input: inputs a turn or a completion acked are completed, by one turn at most")
    done = [(iid, "completion") for a in acks["ti_done"] for iid in a["iids"]]
    done += [(iid, "turn") for iid in completed_inputs]
    for iid, how in done:
        row = rows.get(iid)
        inv.expect(
            row is not None
            and row.state is TurnInputState.COMPLETED
            and len(completed_inputs.get(iid, [])) <= 1,
            f"{iid} ({how}): {row and row.state}, turns {completed_inputs.get(iid)}",
        )


def _check_runtime(
    report: CheckReport, store: Store, url: str, acks: dict[str, list[dict[str, Any]]]
) -> None:
    domain = ReferenceDomain()
    receipts: dict[str, dict[tuple[str, int], Any]] = defaultdict(dict)
    for rt, run, seq, data in raw_rows(
        url, "SELECT runtime_id, run_id, sequence, receipt_json FROM runtime_boundary_receipts"
    ):
        receipts[rt][(run, decode_receipt_sequence(seq))] = decode_receipt(data)
    states = {rt: {s.input_id for s in store.runtime.load_input_states(rt)} for rt in RUNTIMES}

    inv = report("boundary: every acked receipt is stored as acked")
    for a in acks["boundary"]:
        got = receipts[a["rt"]].get((a["run"], a["seq"]))
        inv.expect(
            got is not None
            and got.conversation_digest == a["msg"]
            and got.message_count == a["count"]
            and got.contributing_input_ids == (a["iid"],),
            f"{a['rt']} {a['run']}#{a['seq']}: {got}",
        )
    inv = report("boundary: every acked input state is stored")
    for a in acks["boundary"]:
        inv.expect(a["iid"] in states[a["rt"]], f"{a['rt']} input {a['iid']}")
    inv = report("boundary: every stored receipt's input states are stored with it")
    for rt, mine in receipts.items():
        for (run, seq), r in mine.items():
            missing = [i for i in r.contributing_input_ids if i not in states.get(rt, set())]
            inv.expect(not missing, f"{rt} {run}#{seq}: inputs {missing} missing")

    seeded = report("snapshot: the seed is kept and no message is there twice")
    matched = report("snapshot: each message past the seed has one receipt naming its position")
    kept = report("snapshot: every acked boundary's message is in the snapshot")
    order = report("boundary: acked message counts increase in real-time order")
    for rt in RUNTIMES:
        data = store.runtime.load_session_snapshot(rt)
        messages = (
            [m.content for m in domain.decode_persisted_session(data).messages] if data else []
        )
        seeded.expect(
            tuple(messages[: len(SEED_MESSAGES)]) == SEED_MESSAGES
            and len(set(messages)) == len(messages),
            f"{rt}: {len(messages)} messages, {len(set(messages))} distinct",
        )
        named = [r for r in receipts[rt].values() if r.conversation_digest is not None]
        at = Counter((r.message_count, r.conversation_digest) for r in named)
        expected = Counter(
            (pos, m) for pos, m in enumerate(messages, 1) if pos > len(SEED_MESSAGES)
        )
        matched.expect(at == expected, f"{rt}: {len(named)} receipts, {len(messages)} messages")
        present = set(messages)
        mine = [a for a in acks["boundary"] if a["rt"] == rt and a["msg"] is not None]
        for a in mine:
            kept.expect(a["msg"] in present, f"{rt}: {a['msg']} lost")
        realtime_order(order, rt, mine, "count", strict=True)
