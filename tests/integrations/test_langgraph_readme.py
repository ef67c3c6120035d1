"""The README's LangGraph example runs as written (extracted from README.md and executed)."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

pytest.importorskip("langgraph.graph")

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_example() -> str:
    """The first ```python block of the README's "LangGraph checkpointer" section."""
    text = README.read_text(encoding="utf-8")
    section = text.split("\n## LangGraph checkpointer\n", 1)[1].split("\n## ", 1)[0]
    return section.split("```python\n", 1)[1].split("\n```", 1)[0]


def test_readme_example_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "example.py"
    script.write_text(readme_example(), encoding="utf-8")
    monkeypatch.chdir(tmp_path)  # the example's database file lands here
    runpy.run_path(str(script), run_name="__main__")
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("refused: session langgraph/support-ticket-42/ is owned by ")
    assert out[1:] == ["4 messages restored", "10 checkpoints; latest has 8 messages"]
    assert (tmp_path / "langgraph-demo.db").exists()
