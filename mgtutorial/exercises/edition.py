"""The student edition of the course: the notebooks with every solution taken out.

The committed notebooks are the instructor edition: each exercise's solution sits between a line
holding ``BEGIN SOLUTION`` and one holding ``END SOLUTION`` (``# BEGIN SOLUTION`` in code,
``<!-- BEGIN SOLUTION -->`` in Markdown). The student edition

* removes every such block, markers included (in code, a ``# your code here`` line stays at the
  block's indentation);
* turns each ``# STARTER: <code>`` line into ``<code>`` (the starter, which the instructor edition
  keeps as a comment after the solution);
* clears the outputs of every cell from the ``## Exercises`` heading on, and of any other cell that
  held a solution.

The same rules apply to ``.py`` files under ``notebooks/exercises/``. Run ``make student`` (or
``python -m mgtutorial.exercises.edition --src notebooks --out student``). Taught in: WORKSHOP.md.
"""

from __future__ import annotations

import argparse
import re
import shutil
from pathlib import Path

import nbformat

BEGIN, END = "BEGIN SOLUTION", "END SOLUTION"
_STARTER = re.compile(r"^(\s*)# STARTER:(?: (.*))?$")
EXERCISES_HEADING = "## Exercises"


def strip_solutions(source: str, *, code: bool = True, where: str = "source") -> tuple[str, int]:
    """Return ``(student source, number of solution blocks removed)``.

    Raises:
        ValueError: a block is opened twice, closed without being opened, or never closed
            (``where`` names the cell or file).
    """
    out, blocks, inside = [], 0, None
    for n, line in enumerate(source.splitlines(), 1):
        if BEGIN in line:
            if inside is not None:
                raise ValueError(f"{where}: line {n} opens a solution inside the one opened on line {inside}")
            inside, blocks = n, blocks + 1
            if code:
                out.append(line[: len(line) - len(line.lstrip())] + "# your code here")
        elif END in line:
            if inside is None:
                raise ValueError(f"{where}: line {n} closes a solution that was never opened")
            inside = None
        elif inside is None:
            m = _STARTER.match(line) if code else None
            out.append(m.group(1) + (m.group(2) or "") if m else line)
    if inside is not None:
        raise ValueError(f"{where}: the solution opened on line {inside} is never closed")
    return "\n".join(out) + ("\n" if source.endswith("\n") and out else ""), blocks


def exercises_start(nb) -> int | None:
    """Index of the first Markdown cell that starts with the ``## Exercises`` heading, or None."""
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "markdown" and cell.source.lstrip().startswith(EXERCISES_HEADING):
            return i
    return None


def student_notebook(nb, where: str = "notebook"):
    """A copy of ``nb`` as the student edition (see the module docstring); ``nb`` is unchanged."""
    nb = nbformat.reads(nbformat.writes(nb), as_version=4)
    start = exercises_start(nb)
    for i, cell in enumerate(nb.cells):
        cell.source, blocks = strip_solutions(cell.source, code=cell.cell_type == "code",
                                              where=f"{where} cell {i}")
        if cell.cell_type == "code" and (blocks or (start is not None and i > start)):
            cell.outputs, cell.execution_count = [], None
    return nb


def make_student(src: str | Path = "notebooks", out: str | Path = "student") -> list[Path]:
    """Write the student edition of every notebook in ``src`` (and of ``src/exercises/``) to ``out``.

    ``out`` is replaced if it exists; it must not be ``src`` itself. Returns the files written.

    Raises:
        ValueError: ``out`` is ``src``, or a solution block is malformed (names the file and cell).
    """
    src, out = Path(src).resolve(), Path(out).resolve()
    if src == out:
        raise ValueError(f"the student edition must go to a folder of its own, not {out}")
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    written = []
    for path in sorted(src.glob("*.ipynb")):
        nb = student_notebook(nbformat.read(path, as_version=4), where=path.name)
        nbformat.write(nb, out / path.name)
        written.append(out / path.name)
    for path in sorted((src / "exercises").rglob("*")) if (src / "exercises").is_dir() else []:
        if path.is_file() and "__pycache__" not in path.parts:
            target = out / path.relative_to(src)
            target.parent.mkdir(parents=True, exist_ok=True)
            if path.suffix == ".py":
                target.write_text(strip_solutions(path.read_text(), where=str(path.name))[0])
            else:
                shutil.copy2(path, target)
            written.append(target)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mgtutorial.exercises.edition",
                                     description="Write the student edition of the notebooks.")
    parser.add_argument("--src", default="notebooks", help="the instructor edition (default: notebooks)")
    parser.add_argument("--out", default="student", help="where to write it (default: student; replaced)")
    args = parser.parse_args(argv)
    written = make_student(args.src, args.out)
    print(f"student edition: {len(written)} files in {args.out}/ (solutions removed, exercise outputs cleared)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
