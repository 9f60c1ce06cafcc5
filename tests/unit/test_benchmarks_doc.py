"""docs/benchmarks.md stays the current table per scenario: the stories go to docs/bench-log/."""

from __future__ import annotations

from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "docs"
MAX_LINES = 300


def test_the_benchmarks_page_holds_current_tables_only() -> None:
    lines = len((DOCS / "benchmarks.md").read_text().splitlines())
    assert lines <= MAX_LINES, (
        f"docs/benchmarks.md has {lines} lines (at most {MAX_LINES}): move an experiment's "
        "story or superseded rows to a dated page of docs/bench-log/ and link it"
    )
