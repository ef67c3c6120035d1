"""Logs, metrics and traces of agentkeep (docs/operations.md#logging, #metrics-and-traces).

Logging: everything goes to ``logging.getLogger("agentkeep")`` and its
children. What is recorded, with the ids involved:

========================================  =======  ===============================
event                                     level    logger
========================================  =======  ===============================
a transient error retried (busy, lock     DEBUG    ``agentkeep.retry``
timeout, serialisation), with the pause
every attempt failed: the error is raised WARNING  ``agentkeep.retry``
a lease taken over after expiry, or       INFO     ``agentkeep.leases``
reclaimed from a dead holder
a compare-and-set or fence refusal        DEBUG    ``agentkeep.conflicts``
(head revision, stale lease, superseded
claim, refused run transition, ...)
a commit whose outcome is unknown         WARNING  ``agentkeep.commit``
(the COMMIT's answer was lost)
an unknown outcome resolved (replayed /   INFO     ``agentkeep.commit``
read back)
========================================  =======  ===============================

Nothing is logged at INFO or above for an operation that succeeds normally;
every record on a hot path is guarded with ``isEnabledFor``.

Metrics and traces (with ``opentelemetry-api`` installed: ``agentkeep[otel]``):
every public operation (``store.runs.get``, ``astore.leases.try_claim_...``,
...) runs in a span named for it (``runs.get``) and records

* ``agentkeep.operation.duration`` — histogram, seconds, attribute ``operation``
  (and ``error.type`` when it raised);
* ``agentkeep.conflicts`` — counter of fence and compare-and-set refusals,
  attribute ``kind`` (:data:`CONFLICT_KINDS`);
* ``agentkeep.retries`` — counter of retried attempts, attribute ``operation``;
* ``agentkeep.lease.takeovers`` — counter, attribute ``kind`` (``expired``:
  a lease taken after its expiry by another owner; ``reclaimed``: taken
  before expiry from a verifiably dead holder).

An operation is measured once: where it is public (the one-call layer, or
the async facade for ``AsyncStore``), and an operation called by another is
part of the outer one. The tracer and meter come from OpenTelemetry's global
providers unless :func:`configure` is given others. With the API but no
SDK behind it (no meter, no tracer) an operation only sets its name (no
clock read, no record). Without
``opentelemetry-api`` the operations are not wrapped at all (no cost);
``AGENTKEEP_OTEL=0`` in the environment, or ``configure(enabled=False)``,
turns the wrapped path off (one attribute check per call).
"""

from __future__ import annotations

import contextvars
import functools
import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Final, ParamSpec, TypeVar

__all__ = [
    "CONFLICT_KINDS",
    "INSTALLED",
    "commit_outcome_resolved",
    "commit_outcome_unknown",
    "configure",
    "current_operation",
    "enabled",
    "lease_takeover",
    "refused",
    "retries_exhausted",
    "retrying",
    "traced",
]

P = ParamSpec("P")
T = TypeVar("T")

logger: Final = logging.getLogger("agentkeep")
_retry_log: Final = logging.getLogger("agentkeep.retry")
_lease_log: Final = logging.getLogger("agentkeep.leases")
_conflict_log: Final = logging.getLogger("agentkeep.conflicts")
_commit_log: Final = logging.getLogger("agentkeep.commit")

#: The ``kind`` values of ``agentkeep.conflicts``.
CONFLICT_KINDS: Final = (
    "head_revision",  # HeadRevisionConflict: a session commit's expected head is stale
    "lease_fence",  # SessionExecutionLeaseExpired: a stale or expired lease generation
    "claim_superseded",  # Queued/TurnInput ClaimSuperseded: a stale claim
    "turn_commit",  # RuntimeTurnCommitConflict: a turn id replayed with another hash
    "run_transition",  # runs.try_transition refused (the status was not the expected one)
    "snapshot_superseded",  # SessionSnapshotSuperseded: a boundary commit lost its race
    "transcript_revision",  # TranscriptRevisionConflict: a rewrite's parent is stale
    "ops_epoch_retired",  # OpsLifecycleEpochRetired: a write for a retired epoch
    "concurrent_modification",  # ConcurrentModification: a fence missed under the lock
)


def _otel_importable() -> bool:
    try:
        import opentelemetry.metrics  # noqa: F401
        import opentelemetry.trace  # noqa: F401
    except ImportError:
        return False
    return True


#: True when ``opentelemetry-api`` is importable: public operations are wrapped.
INSTALLED: Final = _otel_importable()

#: The public operation running in this context (None outside one).
_current: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "agentkeep_operation", default=None
)


def current_operation() -> str | None:
    """The name of the public operation running in this context, or None."""
    return _current.get()


class _Instruments:
    """The tracer and the four instruments."""

    def __init__(self, tracer_provider: Any = None, meter_provider: Any = None) -> None:
        from opentelemetry import metrics, trace

        self.tracer = trace.get_tracer("agentkeep", tracer_provider=tracer_provider)
        self._trace = trace
        self._own_tracer = tracer_provider is not None
        self._noop_providers = (trace.ProxyTracerProvider, trace.NoOpTracerProvider)
        meter = (
            meter_provider.get_meter("agentkeep")
            if meter_provider is not None
            else metrics.get_meter("agentkeep")
        )
        self.duration = meter.create_histogram(
            "agentkeep.operation.duration", unit="s", description="Public operation duration"
        )
        self.conflicts = meter.create_counter(
            "agentkeep.conflicts", description="Fence and compare-and-set refusals by kind"
        )
        self.retries = meter.create_counter(
            "agentkeep.retries", description="Attempts retried after a transient error"
        )
        self.takeovers = meter.create_counter(
            "agentkeep.lease.takeovers", description="Session leases taken from another owner"
        )

    def run(self, operation: str, fn: Callable[..., T], args: Any, kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` as the public operation ``operation`` (the hot path).

        While neither a tracer nor a meter is behind OpenTelemetry's API (its
        no-op defaults), only the operation's name is set: there is nothing
        to record, and a clock read and a no-op record per call cost more
        than some operations' SQL.
        """
        token = _current.set(operation)
        if not self._metering() and not self._tracing():
            try:
                return fn(*args, **kwargs)
            finally:
                _current.reset(token)
        start = time.perf_counter()
        attributes = {"operation": operation}
        try:
            if self._tracing():
                with self.tracer.start_as_current_span(operation):
                    return fn(*args, **kwargs)
            return fn(*args, **kwargs)
        except BaseException as exc:
            attributes = {"operation": operation, "error.type": type(exc).__name__}
            raise
        finally:
            self.duration.record(time.perf_counter() - start, attributes)
            _current.reset(token)

    def _metering(self) -> bool:
        """False while the duration histogram is the API's proxy with no meter behind it.

        The API's global meter provider hands out proxy instruments until an
        application sets a real provider (the SDK's); a proxy's
        ``_real_instrument`` is set then, and every record counts from that
        call on. An instrument of a provider given to :func:`configure` (or
        set before it) is not a proxy: always recorded.
        """
        return getattr(self.duration, "_real_instrument", self) is not None

    def _tracing(self) -> bool:
        """False while the global tracer provider is OpenTelemetry's no-op default.

        A span from the no-op API costs several microseconds and records
        nothing; skipping it keeps an application that installed the API
        without an SDK at the cost of the metrics alone.
        """
        if self._own_tracer:
            return True
        # The API's global (None until an application sets one): reading it is
        # cheaper than get_tracer_provider(), which consults the environment.
        provider = getattr(self._trace, "_TRACER_PROVIDER", self)
        return provider is not None and not isinstance(provider, self._noop_providers)

    @contextmanager
    def operation(self, operation: str) -> Iterator[None]:
        token = _current.set(operation)
        if not self._metering() and not self._tracing():  # nothing to record (see run)
            try:
                yield
            finally:
                _current.reset(token)
            return
        start = time.perf_counter()
        attributes: dict[str, str] = {"operation": operation}
        try:
            if self._tracing():
                with self.tracer.start_as_current_span(operation):
                    yield
            else:
                yield
        except BaseException as exc:
            attributes["error.type"] = type(exc).__name__
            raise
        finally:
            self.duration.record(time.perf_counter() - start, attributes)
            _current.reset(token)


class _State:
    __slots__ = ("instruments",)

    def __init__(self) -> None:
        self.instruments: _Instruments | None = None


_state: Final = _State()


def configure(
    *, enabled: bool = True, tracer_provider: Any = None, meter_provider: Any = None
) -> None:
    """Turn metrics and traces on (the default when opentelemetry-api is installed) or off.

    Args:
        enabled: False turns the instrumented path off.
        tracer_provider: an OpenTelemetry ``TracerProvider``; default: the global one.
        meter_provider: an OpenTelemetry ``MeterProvider``; default: the global one.

    Raises:
        ImportError: ``enabled`` without opentelemetry-api installed.
    """
    if not enabled:
        _state.instruments = None
        return
    if not INSTALLED:
        raise ImportError("agentkeep metrics need opentelemetry-api: pip install agentkeep[otel]")
    _state.instruments = _Instruments(tracer_provider, meter_provider)


def enabled() -> bool:
    """True when operations record spans and metrics."""
    return _state.instruments is not None


if INSTALLED and os.environ.get("AGENTKEEP_OTEL", "1") != "0":
    configure()


def traced(operation: str, fn: Callable[P, T]) -> Callable[P, T]:
    """``fn`` recording a span and its duration as ``operation`` (``fn`` itself without OTel).

    A call made inside another public operation is part of it and records nothing.
    The unwrapped ``fn`` is the wrapper's ``__agentkeep_untraced__``.
    """
    if not INSTALLED:
        return fn
    state = _state

    def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
        instruments = state.instruments
        if instruments is None or _current.get() is not None:
            return fn(*args, **kwargs)
        return instruments.run(operation, fn, args, kwargs)

    functools.update_wrapper(wrapper, fn)
    wrapper.__agentkeep_untraced__ = fn  # type: ignore[attr-defined]
    wrapper.__agentkeep_operation__ = operation  # type: ignore[attr-defined]
    return wrapper


@contextmanager
def operation(name: str) -> Iterator[None]:
    """Measure ``name`` as one public operation (the async facade's hook); nested: nothing."""
    instruments = _state.instruments
    if instruments is None or _current.get() is not None:
        yield
        return
    with instruments.operation(name):
        yield


# --------------------------------------------------------------------------
# Events


def retrying(exc: BaseException, attempt: int, attempts: int, delay_s: float) -> None:
    """A transient error: attempt ``attempt`` of ``attempts`` failed, retried after ``delay_s``."""
    if _retry_log.isEnabledFor(logging.DEBUG):
        _retry_log.debug(
            "retrying %s after a transient error (attempt %d of %d, waiting %.1f ms): %s",
            _current.get() or "operation",
            attempt,
            attempts,
            delay_s * 1000,
            exc,
        )
    instruments = _state.instruments
    if instruments is not None:
        instruments.retries.add(1, {"operation": _current.get() or "unknown"})


def retries_exhausted(exc: BaseException, attempt: int, attempts: int, late: bool) -> None:
    """A transient error that is raised: no attempt or time was left."""
    if _retry_log.isEnabledFor(logging.WARNING):
        _retry_log.warning(
            "%s failed after %d of %d attempts%s: %s",
            _current.get() or "operation",
            attempt,
            attempts,
            " (its busy timeout passed)" if late else "",
            exc,
        )


def lease_takeover(
    kind: str, session_id: str, previous_owner: str | None, owner: str, fencing_token: int
) -> None:
    """A session lease passed from ``previous_owner`` to ``owner`` (``expired``/``reclaimed``)."""
    _lease_log.info(
        "session %s: lease %s from %s by %s (fencing token %d)",
        session_id,
        "taken over after expiry" if kind == "expired" else "reclaimed from a dead holder",
        previous_owner,
        owner,
        fencing_token,
    )
    instruments = _state.instruments
    if instruments is not None:
        instruments.takeovers.add(1, {"kind": kind})


def refused(kind: str, message: str, *args: object) -> None:
    """A fence or compare-and-set refusal of ``kind`` (:data:`CONFLICT_KINDS`)."""
    if _conflict_log.isEnabledFor(logging.DEBUG):
        _conflict_log.debug("%s refused: " + message, kind, *args)
    instruments = _state.instruments
    if instruments is not None:
        instruments.conflicts.add(1, {"kind": kind})


def commit_outcome_unknown(operation: str, detail: str) -> None:
    """A COMMIT whose answer was lost: the write may or may not have happened."""
    _commit_log.warning("commit outcome unknown for %s: %s", operation, detail)


def commit_outcome_resolved(operation: str, how: str) -> None:
    """An unknown commit outcome settled (``how``: ``"replayed"``, ``"read back"``)."""
    _commit_log.info("commit outcome of %s resolved: %s", operation, how)
