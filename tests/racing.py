"""Racers of the concurrency tests: real writers started together, as threads or processes.

A *body* is a module-level function ``body(store, i, barrier, params)``:
racer ``i`` (0-based) runs it with a :class:`~agentkeep.store.Store` of its
own and waits on ``barrier`` before each round, so the racers of a round
start together; it returns a picklable result (typically one entry per
round). Bodies are passed as function objects and pickled by reference, so
they must live at module level where spawned children can import them.

* :class:`Racing`: how a test module races (racer counts, each racer's
  clock and ``Store.open`` options, timeouts).
* :func:`race_threads`: the racers as threads of this process.
* :class:`ProcessRacers`: ``spawn``-ed processes sharing one barrier,
  reusable across races (:meth:`Racing.pool_fixture` makes a module-scoped
  fixture of it); :func:`race_processes` for a one-off pool.
* :meth:`Racing.run`: a race of either kind, for tests parametrised on both.
* :func:`run_threads` / :func:`run_processes`: different callables side by
  side, for races whose racers coordinate through their own events or
  queues; each returns what every callable returned, in order. Such
  callables call :func:`wait_ready` on a shared barrier once they are set up.

Every timed wait of a race starts only once all racers are ready: a spawned
child first imports the package and the test module and opens its Store,
which takes seconds, and tens of seconds on a loaded machine. Each racer
waits for the others at a readiness point first (:func:`run_racer` does it
for bodies; :func:`wait_ready` for other callables), bounded by
:data:`READY_TIMEOUT_S`; the per-round barrier timeouts and the join timeouts
measure the race after that, and every join timeout allows the start-up on
top. Timeouts only detect hangs: no racer's result depends on how much it
got done in a given time.

A racer that fails aborts the barrier, so the others fail at once instead of
waiting out the timeout; the failure is re-raised (threads) or reported with
its traceback (processes) in the test.
"""

from __future__ import annotations

import multiprocessing
import threading
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import pytest
from sqlalchemy import Engine

from agentkeep.clock import SettableClock
from agentkeep.store import Store

#: The only start method the racers use: a child shares nothing with the parent.
SPAWN: Final = multiprocessing.get_context("spawn")
BARRIER_TIMEOUT_S: Final = 60.0
JOIN_TIMEOUT_S: Final = 180.0
#: How long racers may take to become ready (start-up, imports, ``Store.open``).
READY_TIMEOUT_S: Final = 300.0

Body = Callable[[Store, int, Any, dict[str, Any]], Any]
Call = tuple[Callable[..., Any], tuple[Any, ...]]


@dataclass(frozen=True)
class Racing:
    """How a test module's racers run.

    Attributes:
        processes: racers of a process race (the pool's size and barrier parties).
        threads: racers of a thread race.
        clock_ms: when set, each racer's Store gets its own ``SettableClock`` at this time.
        store_kwargs: further ``Store.open`` keyword arguments.
        host_engine: when set, a module-level ``url -> Engine`` function: each
            racer builds its own engine with it, as a host application would,
            opens its Store on that engine, and disposes the engine at the end.
        barrier_timeout_s: how long a racer waits at the barrier in a round,
            once every racer is ready.
        join_timeout_s: how long the test waits for the racers' results once
            they are ready (it waits up to ``ready_timeout_s`` more for that).
        ready_timeout_s: how long a racer waits for the others to be ready.
    """

    processes: int = 2
    threads: int = 2
    clock_ms: int | None = None
    store_kwargs: Mapping[str, Any] = field(default_factory=dict)
    host_engine: Callable[[str], Engine] | None = None
    barrier_timeout_s: float = BARRIER_TIMEOUT_S
    join_timeout_s: float = JOIN_TIMEOUT_S
    ready_timeout_s: float = READY_TIMEOUT_S

    def open_store(self, url: str) -> Store:
        """A racer's own Store on ``url`` (on an engine of its own if ``host_engine`` is set)."""
        target: str | Engine = url if self.host_engine is None else self.host_engine(url)
        if self.clock_ms is None:
            return Store.open(target, **self.store_kwargs)
        return Store.open(target, clock=SettableClock(self.clock_ms), **self.store_kwargs)

    def pool_fixture(self) -> Any:
        """A module-scoped ``proc_pool`` fixture: a :class:`ProcessRacers` of this setup.

        Assign it to a module attribute named ``proc_pool``; :meth:`run` uses it.
        """

        @pytest.fixture(scope="module", name="proc_pool")
        def proc_pool() -> Iterator[ProcessRacers]:
            with ProcessRacers(self) as pool:
                yield pool

        return proc_pool

    def run(
        self,
        request: pytest.FixtureRequest,
        kind: str,
        url: str,
        body: Body,
        params: dict[str, Any],
    ) -> list[Any]:
        """``body``'s results in racer order, as ``kind`` (``"threads"``/``"processes"``) racers."""
        if kind == "threads":
            return race_threads(self, url, body, params)
        pool: ProcessRacers = request.getfixturevalue("proc_pool")
        return pool.run(url, body, params)


def run_racer(
    setup: Racing, url: str, body: Body, i: int, barrier: Any, params: dict[str, Any]
) -> Any:
    """Racer ``i``: open its own Store, wait until every racer is ready, run ``body``.

    The readiness wait is one round of ``barrier`` bounded by
    ``setup.ready_timeout_s``; the body's own rounds then use the barrier's
    timeout. Any failure (also of opening the Store) aborts the barrier
    first, so the other racers never wait for this one. The Store is closed
    at the end.
    """
    try:
        with setup.open_store(url) as store:
            try:
                wait_ready(barrier, setup.ready_timeout_s)
                return body(store, i, barrier, params)
            finally:
                if setup.host_engine is not None:  # a Store never disposes a given engine
                    store.engine.dispose()
    except BaseException:
        barrier.abort()
        raise


def wait_ready(barrier: Any, timeout_s: float = READY_TIMEOUT_S) -> None:
    """Wait at ``barrier`` until every party is ready (started, imported, set up).

    Call it once per racer, after its set-up and before its first timed
    step, so that no deadline or timeout of the race starts while a sibling
    is still starting. A racer that fails before it gets here should
    ``barrier.abort()``, so the others stop waiting.

    Raises:
        threading.BrokenBarrierError: a party aborted, or not all were ready
            within ``timeout_s``.
    """
    barrier.wait(timeout_s)


# --------------------------------------------------------------------------
# Threads


def run_threads(calls: Sequence[Call], timeout_s: float = JOIN_TIMEOUT_S) -> list[Any]:
    """Run every ``fn(*args)`` of ``calls`` in a thread of its own; their results, in order.

    ``timeout_s`` bounds the run once the threads are ready; they may take up
    to :data:`READY_TIMEOUT_S` more to get there.

    Raises:
        AssertionError: a thread is still running after that.
        BaseException: the first error a call raised.
    """
    results: list[Any] = [None] * len(calls)
    errors: list[BaseException] = []

    def target(k: int) -> None:
        fn, args = calls[k]
        try:
            results[k] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=target, args=(k,), daemon=True) for k in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(READY_TIMEOUT_S + timeout_s)
    assert not any(t.is_alive() for t in threads), "a racer thread hung"
    if errors:
        raise errors[0]
    return results


def race_threads(setup: Racing, url: str, body: Body, params: dict[str, Any]) -> list[Any]:
    """``body`` in ``setup.threads`` threads, each with its own Store; results in racer order."""
    barrier = threading.Barrier(setup.threads, timeout=setup.barrier_timeout_s)
    return run_threads(
        [(run_racer, (setup, url, body, i, barrier, params)) for i in range(setup.threads)],
        setup.join_timeout_s,
    )


# --------------------------------------------------------------------------
# Processes

_BARRIER: Any = None  # in a pool process: the barrier of its ProcessRacers


def _init(barrier: Any) -> None:
    global _BARRIER
    _BARRIER = barrier


def _entry(task: tuple[Racing, str, Body, int, dict[str, Any]]) -> Any:
    setup, url, body, i, params = task
    return run_racer(setup, url, body, i, _BARRIER, params)


class ProcessRacers:
    """``setup.processes`` spawned processes sharing one barrier (a context manager).

    The pool outlives a race, so a module pays the children's start-up once.
    """

    def __init__(self, setup: Racing) -> None:
        self.setup = setup
        self._barrier = SPAWN.Barrier(setup.processes, timeout=setup.barrier_timeout_s)
        self._pool = SPAWN.Pool(setup.processes, initializer=_init, initargs=(self._barrier,))

    def run(self, url: str, body: Body, params: dict[str, Any]) -> list[Any]:
        """``body`` once in every process (racer ``i`` in one of them); results in racer order."""
        self._barrier.reset()  # a failed earlier race leaves it broken
        n = self.setup.processes
        tasks = [(self.setup, url, body, i, params) for i in range(n)]
        timeout_s = self.setup.ready_timeout_s + self.setup.join_timeout_s
        return list(self._pool.map_async(_entry, tasks, chunksize=1).get(timeout_s))

    def close(self) -> None:
        """Stop the processes (whatever they are doing) and wait for them."""
        self._pool.terminate()
        self._pool.join()

    def __enter__(self) -> ProcessRacers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def race_processes(setup: Racing, url: str, body: Body, params: dict[str, Any]) -> list[Any]:
    """``body`` in ``setup.processes`` freshly spawned processes; results in racer order."""
    with ProcessRacers(setup) as pool:
        return pool.run(url, body, params)


def _report(k: int, fn: Callable[..., Any], args: tuple[Any, ...], out: Any) -> None:
    try:
        out.put((k, True, fn(*args)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        out.put((k, False, traceback.format_exc()))


def run_processes(calls: Sequence[Call], timeout_s: float = JOIN_TIMEOUT_S) -> list[Any]:
    """Run every ``fn(*args)`` of ``calls`` in a spawned process of its own; results in order.

    ``fn`` and ``args`` must be picklable (``SPAWN`` events, queues and
    barriers are). ``timeout_s`` bounds each call once the children are
    ready; they may take up to :data:`READY_TIMEOUT_S` more to get there.
    Fails the test with the child's traceback when a call raised, and when a
    child does not exit cleanly.
    """
    out = SPAWN.Queue()
    procs = [
        SPAWN.Process(target=_report, args=(k, fn, args, out)) for k, (fn, args) in enumerate(calls)
    ]
    for p in procs:
        p.start()
    results: list[Any] = [None] * len(calls)
    try:
        for _ in procs:
            k, ok, value = out.get(timeout=READY_TIMEOUT_S + timeout_s)
            if not ok:
                pytest.fail(f"racer {k} failed:\n{value}")
            results[k] = value
    finally:
        for p in procs:
            p.join(timeout_s)
            if p.is_alive():
                p.kill()
                p.join()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return results
