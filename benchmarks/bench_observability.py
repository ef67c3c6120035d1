"""What metrics and traces cost a hot one-call operation (agentkeep.observability).

Usage::

    .venv/bin/python benchmarks/bench_observability.py [--n N] [--rounds R] [--url URL]

Four variants, each in its own interpreter (so "absent" really has no
OpenTelemetry to import), each on its own migrated SQLite file (or the given
Postgres URL) seeded with one run:

* absent: ``opentelemetry`` cannot be imported (an import hook hides it): the
  operations are not wrapped at all;
* disabled: OpenTelemetry installed, ``AGENTKEEP_OTEL=0``: wrapped, one check per call;
* no-op: OpenTelemetry API installed, no SDK configured (its no-op providers);
* sdk: opentelemetry-sdk ``TracerProvider`` (no exporter) and ``MeterProvider``
  with an ``InMemoryMetricReader``: spans and metrics really recorded.

Timed: ``store.runs.get`` (a one-statement read) and ``store.runs.try_transition``
(a write unit, flipping pending/running so every call wins). Each: warm-up,
then ``--rounds`` rounds of N calls with the GC paused; the best round is
reported, as µs per call and as the ratio to "absent" (1.00 = no cost).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

VARIANTS = ("absent", "disabled", "no-op", "sdk")


class _HideOpenTelemetry:
    """A meta path finder that makes ``import opentelemetry`` fail."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name == "opentelemetry" or name.startswith("opentelemetry."):
            raise ImportError(f"{name} hidden by the benchmark")
        return None


def _child(variant: str, url: str, n: int, rounds: int) -> dict[str, float]:
    if variant == "absent":
        sys.meta_path.insert(0, _HideOpenTelemetry())  # type: ignore[arg-type]
    from agentkeep import observability
    from agentkeep.runs.domain import RunRecord, RunStatus
    from agentkeep.store import Store

    if variant == "sdk":
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import InMemoryMetricReader
        from opentelemetry.sdk.trace import TracerProvider

        observability.configure(
            tracer_provider=TracerProvider(),
            meter_provider=MeterProvider(metric_readers=[InMemoryMetricReader()]),
        )
    expected = {"absent": False, "disabled": False, "no-op": True, "sdk": True}[variant]
    assert observability.enabled() is expected, (variant, observability.enabled())
    assert observability.INSTALLED is (variant != "absent")

    store = Store.open(url, migrate=True)
    run_id = f"R-bench-{variant}"
    store.runs.create(RunRecord.new(run_id, "T-bench", 1))
    state = [RunStatus.PENDING, RunStatus.RUNNING]

    def get() -> None:
        store.runs.get(run_id)

    def transition() -> None:
        assert store.runs.try_transition(run_id, state[0], state[1])
        state.reverse()

    out: dict[str, float] = {}
    try:
        for name, fn in (("runs.get", get), ("runs.try_transition", transition)):
            for _ in range(max(50, n // 10)):
                fn()
            best = float("inf")
            for _ in range(rounds):
                gc.disable()
                try:
                    start = time.perf_counter()
                    for _ in range(n):
                        fn()
                    best = min(best, time.perf_counter() - start)
                finally:
                    gc.enable()
            out[name] = best / n * 1e6
    finally:
        store.runs.delete(run_id)
        store.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=2000, help="calls per round (default 2000)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (default 5)")
    parser.add_argument("--cycles", type=int, default=3, help="interleaved cycles (default 3)")
    parser.add_argument("--url", help="a Postgres URL (default: a temp SQLite file per variant)")
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args.child, args.url, args.n, args.rounds)))
        return
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        # Variants interleaved, --cycles times; each keeps its best: a shared,
        # loaded machine drifts, and this spreads the drift over every variant.
        for cycle in range(args.cycles):
            for variant in VARIANTS:
                url = args.url or f"sqlite:///{Path(tmp) / f'{variant}-{cycle}.db'}"
                env = dict(os.environ)
                env.pop("AGENTKEEP_OTEL", None)
                if variant == "disabled":
                    env["AGENTKEEP_OTEL"] = "0"
                argv = [sys.executable, __file__, "--child", variant, "--url", url]
                argv += ["--n", str(args.n), "--rounds", str(args.rounds)]
                done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
                if done.returncode != 0:
                    sys.exit(f"{variant} failed:\n{done.stderr}")
                got = json.loads(done.stdout.strip().splitlines()[-1])
                best = results.setdefault(variant, got)
                for op, us in got.items():
                    best[op] = min(best[op], us)
    wrapper = _wrapper_cost(max(1_000, args.n * 100))  # 200,000 calls at the default --n
    ops = list(results["absent"])
    print(
        f"backend: {'postgres' if args.url else 'sqlite'}; n={args.n}, "
        f"best of {args.rounds} rounds x {args.cycles} cycles"
    )
    header = f"{'operation':<22}" + "".join(f"{v + ' µs':>13}" for v in VARIANTS)
    header += "".join(f"{v + '/absent':>17}" for v in VARIANTS[1:])
    print(header)
    for op in ops:
        base = results["absent"][op]
        line = f"{op:<22}" + "".join(f"{results[v][op]:>13.1f}" for v in VARIANTS)
        line += "".join(f"{results[v][op] / base:>17.2f}" for v in VARIANTS[1:])
        print(line)
    print()
    print("the wrapper alone, around a function that does nothing (ns per call):")
    for name, ns in wrapper.items():
        print(f"  {name:<28}{ns:>8.0f}")


def _wrapper_cost(n: int = 200_000) -> dict[str, float]:
    """ns per call of a traced no-op function: bare, disabled, no-op API, SDK."""
    from agentkeep import observability

    def nothing() -> None:
        return None

    traced = observability.traced("bench.nothing", nothing)

    def timed(fn: Any) -> float:
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(n):
                fn()
            best = min(best, time.perf_counter() - start)
        return best / n * 1e9

    out = {"bare function": timed(nothing)}
    observability.configure(enabled=False)
    out["traced, disabled"] = timed(traced)
    observability.configure()
    out["traced, no-op API"] = timed(traced)
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider

    observability.configure(
        tracer_provider=TracerProvider(),
        meter_provider=MeterProvider(metric_readers=[InMemoryMetricReader()]),
    )
    out["traced, SDK"] = timed(traced)
    observability.configure(enabled=False)
    return out


if __name__ == "__main__":
    main()
