"""ParseReport: what a log adapter did with a file — the format, the lines it used, and why it skipped the rest.

A report never hides a problem: every line that looked like it belonged to the format but could
not be used is counted under a reason, and :attr:`ParseReport.warnings` turns the counts into
sentences for the CLI.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class ParseReport:
    format: str
    path: str
    lines_total: int = 0
    lines_used: int = 0
    skipped: Counter = field(default_factory=Counter)
    """reason -> number of lines skipped for it (only lines that looked like the format)."""
    notes: list[str] = field(default_factory=list)
    """facts a reader of the table should know (derived columns, aggregates, missing timings)."""
    derived: dict[str, str] = field(default_factory=dict)
    """core column -> the stage-map rule that produced it, for every column that was filled."""
    steps: int = 0

    def skip(self, reason: str, count: int = 1) -> None:
        self.skipped[reason] += count

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    @property
    def lines_skipped(self) -> int:
        return sum(self.skipped.values())

    @property
    def warnings(self) -> list[str]:
        out = [f"skipped {n} line{'s' if n != 1 else ''}: {reason}" for reason, n in self.skipped.most_common()]
        return out + list(self.notes)

    def to_dict(self) -> dict:
        return {
            "format": self.format,
            "path": self.path,
            "lines_total": self.lines_total,
            "lines_used": self.lines_used,
            "lines_skipped": self.lines_skipped,
            "skipped": dict(self.skipped),
            "steps": self.steps,
            "derived": dict(self.derived),
            "notes": list(self.notes),
        }
