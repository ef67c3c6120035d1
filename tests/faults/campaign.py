"""The campaign driver: workers against one database, SIGKILLed and restarted at random moments.

:func:`run_campaign` seeds the database (:func:`seed`), keeps ``workers``
worker processes (:mod:`tests.faults.worker`) running against it and, for
``seconds`` once the first ones are ready, SIGKILLs a worker that has been
working for a random 0.05-2 s and starts a new incarnation in its slot. On
Postgres a terminator thread also calls ``pg_terminate_backend`` on a random
backend of the workers (by their ``application_name``) every 0.05-0.4 s,
preferring one that is running a statement or inside a transaction. Then the
workers are told to stop (a stop file), and the journals are read.

Workers are started through the ``forkserver`` start method with the worker
module preloaded, so a restarted incarnation is working within a fraction of
a second instead of paying the interpreter and import start-up of ``spawn``;
each is still a fresh child that shares no connection with the driver.
"""

from __future__ import annotations

import multiprocessing
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from sqlalchemy import create_engine, make_url, text

from agentkeep.runs.domain import RunRecord
from agentkeep.runtime import ReferenceDomain, Session
from agentkeep.store import Store
from tests.faults.journal import read_journals
from tests.faults.worker import (
    RUNTIMES,
    SEED_MESSAGES,
    SHARED_RUNS,
    TASK_ID,
    run_worker,
    runtime_session_id,
)

__all__ = ["APP_NAME", "CampaignResult", "run_campaign", "seed", "worker_url"]

#: The ``application_name`` of the workers' Postgres connections (the terminator's targets).
APP_NAME: Final = "agentkeep-faults-worker"
#: How long the first workers may take to be ready (start-up on a loaded machine).
READY_TIMEOUT_S: Final = 300.0
#: How long the workers may take to stop once told to (they finish one action).
STOP_TIMEOUT_S: Final = 120.0
#: What the forkserver imports once for all its children (the drivers load lazily).
_PRELOAD: Final = {
    "sqlite": ["tests.faults.worker"],
    "postgres": ["tests.faults.worker", "psycopg", "sqlalchemy.dialects.postgresql.psycopg"],
}
KILL_AFTER_S: Final = (0.05, 2.0)
TERMINATE_EVERY_S: Final = (0.05, 0.4)


@dataclass
class CampaignResult:
    """What a campaign did: its figures, and the journals' entries for the checker.

    Attributes:
        backend: ``"sqlite"`` or ``"postgres"``.
        seconds: the fault window (after the first workers were ready).
        incarnations: worker processes started.
        kills: workers SIGKILLed during the window.
        terminated: Postgres backends terminated; ``terminated_mid_operation``
            of them were running a statement or inside a transaction.
        crashed: ``(slot, incarnation, exitcode)`` of workers that exited on
            their own with an error (never expected).
        hung: workers that did not stop within :data:`STOP_TIMEOUT_S`.
        entries: every journal line.
    """

    backend: str
    seconds: float
    incarnations: int = 0
    kills: int = 0
    terminated: int = 0
    terminated_mid_operation: int = 0
    crashed: list[tuple[int, int, int | None]] = field(default_factory=list)
    hung: list[tuple[int, int]] = field(default_factory=list)
    entries: list[dict[str, Any]] = field(default_factory=list)

    def count(self, kind: str) -> int:
        return sum(1 for e in self.entries if e["k"] == kind)

    @property
    def operations(self) -> int:
        """Public calls that returned or raised (reads included)."""
        return sum(1 for e in self.entries if e["k"] in ("ok", "err", "unknown", "bad"))


def worker_url(url: str) -> str:
    """``url`` with the workers' ``application_name`` on Postgres."""
    u = make_url(url)
    if u.get_backend_name() != "postgresql":
        return url
    return u.update_query_dict({"application_name": APP_NAME}).render_as_string(hide_password=False)


def seed(url: str) -> None:
    """The rows the workload expects: the shared runs and each runtime's seeded snapshot."""
    domain = ReferenceDomain()
    with Store.open(url) as store:
        for rid in SHARED_RUNS:
            store.runs.create(RunRecord.new(rid, TASK_ID, created_at=1_700_000_000))
        for rt in RUNTIMES:
            session = Session.new(runtime_session_id(rt))
            for message in SEED_MESSAGES:
                session = session.with_message("user", message)
            store.runtime.commit_session_snapshot(rt, domain.encode_session(session))


class _Terminator(threading.Thread):
    """Terminates random worker backends of one Postgres database until stopped."""

    def __init__(self, admin_url: str, database: str, rng: random.Random) -> None:
        super().__init__(daemon=True)
        self.admin_url = admin_url
        self.database = database
        self.rng = rng
        self.stop = threading.Event()
        self.terminated = 0
        self.mid_operation = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        engine = create_engine(self.admin_url, isolation_level="AUTOCOMMIT")
        try:
            with engine.connect() as conn:
                while not self.stop.wait(self.rng.uniform(*TERMINATE_EVERY_S)):
                    rows = conn.execute(
                        text(
                            "SELECT pid, state FROM pg_stat_activity "
                            "WHERE datname = :db AND application_name = :app"
                        ),
                        {"db": self.database, "app": APP_NAME},
                    ).all()
                    busy = [r for r in rows if r.state in ("active", "idle in transaction")]
                    pool = busy or rows
                    if not pool:
                        continue
                    victim = self.rng.choice(pool)
                    if conn.execute(
                        text("SELECT pg_terminate_backend(:pid)"), {"pid": victim.pid}
                    ).scalar():
                        self.terminated += 1
                        self.mid_operation += victim in busy
        except BaseException as exc:  # noqa: BLE001 - reported by the driver
            self.error = exc
        finally:
            engine.dispose()


def run_campaign(
    url: str,
    directory: Path,
    *,
    backend: str,
    seconds: float,
    workers: int = 4,
    rng_seed: int | None = None,
    pg_admin_url: str | None = None,
) -> CampaignResult:
    """Run the campaign against the migrated, empty database at ``url``.

    Args:
        url: the database (SQLite file or Postgres database).
        directory: where the journals, ready files and the stop file go.
        backend: ``"sqlite"`` or ``"postgres"``.
        seconds: the fault window, counted from when the first workers are ready.
        workers: the worker slots (K).
        rng_seed: the driver's random seed (kill moments, victims, worker seeds).
        pg_admin_url: Postgres: the admin URL for ``pg_terminate_backend``
            (None: no backend is terminated).
    """
    rng = random.Random(rng_seed)
    directory.mkdir(parents=True, exist_ok=True)
    stop_file = str(directory / "stop")
    seed(url)
    wurl = worker_url(url)
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD[backend])
    result = CampaignResult(backend=backend, seconds=seconds)
    procs: dict[int, tuple[int, Any]] = {}
    incarnation = [0] * workers
    kill_at: dict[int, float] = {}

    def start(slot: int) -> None:
        incarnation[slot] += 1
        p = ctx.Process(
            target=run_worker,
            args=(wurl, str(directory), slot, incarnation[slot], rng.getrandbits(32), stop_file),
            daemon=True,
        )
        p.start()
        procs[slot] = (incarnation[slot], p)
        kill_at.pop(slot, None)
        result.incarnations += 1

    def ready(slot: int) -> bool:
        return (directory / f"ready-{slot}-{procs[slot][0]}").exists()

    for slot in range(workers):
        start(slot)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not all(ready(s) for s in range(workers)):
        assert time.monotonic() < deadline, "the first workers did not become ready"
        for slot, (_, p) in procs.items():
            assert p.is_alive() or ready(slot), f"worker {slot} died at start: {p.exitcode}"
        time.sleep(0.05)

    terminator = None
    if pg_admin_url is not None:
        terminator = _Terminator(pg_admin_url, str(make_url(url).database), rng)
        terminator.start()
    end = time.monotonic() + seconds
    try:
        while (now := time.monotonic()) < end:
            for slot in range(workers):
                inc, p = procs[slot]
                if not p.is_alive():  # exited on its own: never expected
                    p.join()
                    result.crashed.append((slot, inc, p.exitcode))
                    start(slot)
                elif slot not in kill_at:
                    if ready(slot):
                        kill_at[slot] = now + rng.uniform(*KILL_AFTER_S)
                elif now >= kill_at[slot]:
                    p.kill()  # SIGKILL, wherever it is
                    p.join()  # reaped: its pid is gone, so its lease is reclaimable
                    result.kills += 1
                    start(slot)
            time.sleep(0.01)
    finally:
        if terminator is not None:
            terminator.stop.set()
            terminator.join(60)
            result.terminated = terminator.terminated
            result.terminated_mid_operation = terminator.mid_operation
        Path(stop_file).touch()
        stop_by = time.monotonic() + STOP_TIMEOUT_S
        for slot, (inc, p) in procs.items():
            p.join(max(0.0, stop_by - time.monotonic()))
            if p.is_alive():
                result.hung.append((slot, inc))
                p.kill()
                p.join()
            elif p.exitcode != 0:
                result.crashed.append((slot, inc, p.exitcode))
    if terminator is not None and terminator.error is not None:
        raise AssertionError("the terminator failed") from terminator.error
    result.entries = read_journals(directory)
    return result
