"""A scenario's outcome: named invariant checks and throughput figures."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Report"]


@dataclass
class Report:
    """Invariant checks (name, held?, detail) and figures (name, value) of one scenario."""

    checks: list[tuple[str, bool, str]] = field(default_factory=list)
    figures: list[tuple[str, str]] = field(default_factory=list)

    def check(self, name: str, held: bool, detail: str = "") -> None:
        self.checks.append((name, held, detail))

    def figure(self, name: str, value: str) -> None:
        self.figures.append((name, value))

    @property
    def ok(self) -> bool:
        return all(held for _, held, _ in self.checks)

    def render(self, title: str) -> str:
        lines = [f"== scenario: {title} =="]
        for name, value in self.figures:
            lines.append(f"  {name:<44} {value}")
        for name, held, detail in self.checks:
            mark = "ok  " if held else "FAIL"
            lines.append(f"  [{mark}] {name}" + (f" ({detail})" if detail else ""))
        return "\n".join(lines)
