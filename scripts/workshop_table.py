"""Regenerate WORKSHOP.md's table of exercises from the notebooks' exercise headings.

    .venv/bin/python scripts/workshop_table.py           # rewrite the block in WORKSHOP.md
    .venv/bin/python scripts/workshop_table.py --check   # exit 1 if the block is out of date

Every notebook ``notebooks/NN_name.ipynb`` is read in course order; each Markdown line
``### Exercise NN.k — title (≈ M min)`` is one exercise (the format tests/test_notebook_hygiene.py
enforces). The block between ``<!-- exercises:begin -->`` and ``<!-- exercises:end -->`` gets one
row per exercise and a total per chapter; a chapter without exercises is listed as such.

The two workshop tracks are a rule, not a choice per row: the **3-hour** track is the first
exercise of each chapter in :data:`THREE_HOUR`; the **full-day** track is the first
:data:`FULL_DAY_PER_CHAPTER` exercises of each chapter in :data:`FULL_DAY`. WORKSHOP.md states it.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- exercises:begin -->", "<!-- exercises:end -->"
THREE_HOUR = ("00", "01", "02", "03a", "06a")
FULL_DAY = ("00", "01", "02", "03a", "03b", "03c", "04a", "04b", "05a", "05b", "05c", "06a", "07a")
FULL_DAY_PER_CHAPTER = 2
_HEADING = re.compile(r"^### Exercise (\d\d[a-c]?)\.(\d+) — (.+) \(≈ (\d+) min\)$")
_NOTEBOOK = re.compile(r"^(\d\d[a-c]?)_\w+$")


@dataclass(frozen=True)
class Exercise:
    """One exercise heading: chapter id ("03a"), number k (1, 2, …), title, minutes."""

    chapter: str
    k: int
    title: str
    minutes: int

    @property
    def id(self) -> str:
        return f"{self.chapter}.{self.k}"

    @property
    def three_hour(self) -> bool:
        return self.chapter in THREE_HOUR and self.k == 1

    @property
    def full_day(self) -> bool:
        return self.chapter in FULL_DAY and self.k <= FULL_DAY_PER_CHAPTER


def read_notebook(path: Path) -> tuple[str, list[Exercise]]:
    """``(chapter title, exercises)`` of one notebook; the title is its first heading after "NN · ".

    Raises:
        ValueError: a line starting with "### Exercise" that is not ``### Exercise NN.k — title
            (≈ M min)``, or whose NN is not the notebook's chapter (the message names both).
    """
    chapter = _NOTEBOOK.match(path.stem).group(1)
    nb = nbformat.read(path, as_version=4)
    first = nb.cells[0].source.splitlines()[0] if nb.cells and nb.cells[0].source else path.stem
    title = first.lstrip("# ").split(" · ", 1)[-1]
    found = []
    for cell in nb.cells:
        if cell.cell_type != "markdown":
            continue
        for line in cell.source.splitlines():
            if not line.startswith("### Exercise"):
                continue
            m = _HEADING.match(line.strip())
            if not m or m.group(1) != chapter:
                raise ValueError(
                    f"{path.name}: {line!r} is not '### Exercise {chapter}.k — title (≈ M min)'"
                )
            found.append(Exercise(chapter, int(m.group(2)), m.group(3), int(m.group(4))))
    return title, found


def _minutes(exercises: list[Exercise]) -> str:
    n, minutes = len(exercises), sum(e.minutes for e in exercises)
    return f"{n} exercise{'s' * (n != 1)}, {minutes} min"


def table(notebooks: Path) -> str:
    """The Markdown between the markers (without them) for every ``NN_*.ipynb`` in ``notebooks``."""
    lines = [
        "<!-- written by scripts/workshop_table.py from the notebooks' headings: "
        "do not edit by hand -->",
        "",
        "| chapter | exercise | title | min | 3 h | day |",
        "|---|---|---|--:|:-:|:-:|",
    ]
    every = []
    for path in sorted(p for p in notebooks.glob("*.ipynb") if _NOTEBOOK.match(p.stem)):
        title, exercises = read_notebook(path)
        chapter = _NOTEBOOK.match(path.stem).group(1)
        tracks = [
            t for t, chapters in (("3 h", THREE_HOUR), ("day", FULL_DAY)) if chapter in chapters
        ]
        name = f"`{path.stem}` {title}" + (f" ({', '.join(tracks)})" if tracks else "")
        if not exercises:
            lines.append(f"| {name} | — | no exercises yet | | | |")
            continue
        for i, e in enumerate(exercises):
            lines.append(
                f"| {name if i == 0 else ''} | {e.id} | {e.title} | {e.minutes} | "
                f"{'✓' if e.three_hour else ''} | {'✓' if e.full_day else ''} |"
            )
        lines.append(
            f"| | | *chapter {chapter} total* | *{sum(e.minutes for e in exercises)}* | | |"
        )
        every += exercises
    lines += [
        "",
        f"All exercises: {_minutes(every)}. "
        f"3-hour track: {_minutes([e for e in every if e.three_hour])}. "
        f"Full-day track: {_minutes([e for e in every if e.full_day])}.",
    ]
    return "\n".join(lines)


def rewrite(text: str, block: str) -> str:
    """``text`` with what lies between :data:`BEGIN` and :data:`END` replaced by ``block``.

    Raises:
        ValueError: the markers are missing, repeated, or out of order.
    """
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise ValueError(f"WORKSHOP.md needs exactly one {BEGIN} … {END} block, in that order")
    head, rest = text.split(BEGIN)
    return f"{head}{BEGIN}\n{block}\n{END}{rest.split(END, 1)[1]}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--check",
        action="store_true",
        help="exit 1 (and change nothing) if the block is out of date",
    )
    p.add_argument("--notebooks", type=Path, default=ROOT / "notebooks")
    p.add_argument("--workshop", type=Path, default=ROOT / "WORKSHOP.md")
    args = p.parse_args(argv)
    text = args.workshop.read_text()
    new = rewrite(text, table(args.notebooks))
    if args.check:
        if new != text:
            print(
                f"{args.workshop.name}'s exercise table is out of date: "
                "run python scripts/workshop_table.py"
            )
            return 1
        return 0
    if new != text:
        args.workshop.write_text(new)
        print(f"rewrote the exercise table in {args.workshop}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
