"""The student edition of the course: the notebooks with every solution taken out.

The committed notebooks are the instructor edition: each exercise's solution sits between a line
holding ``BEGIN SOLUTION`` and one holding ``END SOLUTION`` (``# BEGIN SOLUTION`` in code,
``<!-- BEGIN SOLUTION -->`` in Markdown). The student edition

* removes every such block, markers included (in code, a ``# your code here`` line stays at the
  block's indentation);
* turns each ``# STARTER: <code>`` line into ``<code>`` (the starter, which the instructor edition
  keeps as a comment after the solution);
* clears the outputs of every cell from the ``## Exercises`` heading on, and of any other cell that
  held a solution;
* drops the ``# NBVAL_CHECK_OUTPUT`` lines of those cells (they are for the instructor edition's
  tests).

The same rules apply to ``.py`` files under ``notebooks/exercises/``. Run ``make student`` (or
``python -m mgtutorial.workshop.edition --src notebooks --out student``). Taught in: WORKSHOP.md.
"""

from __future__ import annotations

import argparse
import re
import shutil
import time
from pathlib import Path

import nbformat

BEGIN, END = "BEGIN SOLUTION", "END SOLUTION"
_STARTER = re.compile(r"^(\s*)# STARTER:(?: (.*))?$")
EXERCISES_HEADING = "## Exercises"
MARKER = ".mgtutorial-student-edition"
NBVAL_MARK = "# NBVAL_CHECK_OUTPUT"


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
                raise ValueError(
                    f"{where}: line {n} opens a solution inside the one opened on line {inside}"
                )
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
        cell.source, blocks = strip_solutions(
            cell.source, code=cell.cell_type == "code", where=f"{where} cell {i}"
        )
        if cell.cell_type == "code" and (blocks or (start is not None and i > start)):
            cell.outputs, cell.execution_count = [], None
            cell.source = "\n".join(
                line for line in cell.source.splitlines() if line.strip() != NBVAL_MARK
            )
    return nb


def make_student(src: str | Path = "notebooks", out: str | Path = "student") -> list[Path]:
    """Write the student edition of every notebook in ``src`` (and of ``src/exercises/``) to
    ``out``.

    ``out`` is a folder of its own: new, or one this function wrote before (it holds the file
    :data:`MARKER`). Every file is built in memory first, so a malformed solution leaves ``out``
    as it was. A previous edition is not deleted: it is moved to ``<out>-previous-<time>``
    (``-2``, ``-3`` ... appended when that name is taken), so work the learners did in it is
    kept. Returns the files written.

    Raises:
        ValueError: ``src`` holds no notebook; ``out`` is ``src``, contains it or the current
            folder, or exists without being an earlier student edition (a file, or a folder of
            something else); a solution block is malformed (names the file and cell).
        OSError: a file cannot be read or written.
    """
    src, out = Path(src).resolve(), Path(out).resolve()
    if not sorted(src.glob("*.ipynb")):
        raise ValueError(
            f"no notebook in {src}: pass --src the folder of the instructor edition (notebooks)"
        )
    if (
        out == src
        or out in src.parents
        or out in Path.cwd().resolve().parents
        or out == Path.cwd().resolve()
    ):
        raise ValueError(
            f"the student edition must go to a folder of its own, not {out} "
            f"(it holds {'the notebooks' if out in (src, *src.parents) else 'the current folder'})"
        )
    if out.exists() and not (out / MARKER).is_file():
        raise ValueError(
            f"{out} exists and is not a student edition written here (no {MARKER}): "
            "choose a new folder, or move that one away first"
        )
    edition = _edition(src)
    if out.exists():
        kept = _free_name(out.with_name(f"{out.name}-previous-{time.strftime('%Y%m%d-%H%M%S')}"))
        out.rename(kept)
        print(f"the previous edition, with any work done in it, was moved to {kept.name}/")
    out.mkdir(parents=True)
    (out / MARKER).write_text("written by python -m mgtutorial.workshop.edition; safe to replace\n")
    written = []
    for rel, content in edition.items():
        target = out / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, Path):
            shutil.copy2(content, target)
        else:
            target.write_text(content)
        written.append(target)
    return written


def _edition(src: Path) -> dict[Path, str | Path]:
    """Every file of the student edition, built in memory: relative path -> text (or the file to
    copy).

    Building it all before writing anything means a malformed solution block is refused while the
    previous edition is still in place.
    """
    edition: dict[Path, str | Path] = {}
    for path in sorted(src.glob("*.ipynb")):
        nb = student_notebook(nbformat.read(path, as_version=4), where=path.name)
        edition[Path(path.name)] = nbformat.writes(nb)
    for path in sorted((src / "exercises").rglob("*")) if (src / "exercises").is_dir() else []:
        if path.is_file() and "__pycache__" not in path.parts:
            rel = path.relative_to(src)
            code = path.suffix == ".py"
            edition[rel] = strip_solutions(path.read_text(), where=str(rel))[0] if code else path
    return edition


def _free_name(path: Path) -> Path:
    """``path``, or ``path-2``, ``path-3`` ... : the first that does not exist yet."""
    n, free = 1, path
    while free.exists():
        n += 1
        free = path.with_name(f"{path.name}-{n}")
    return free


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mgtutorial.workshop.edition",
        description="Write the student edition of the notebooks.",
    )
    parser.add_argument(
        "--src", default="notebooks", help="the instructor edition (default: notebooks)"
    )
    parser.add_argument(
        "--out",
        default="student",
        help="where to write it (default: student; an earlier edition there is moved aside, "
        "not deleted)",
    )
    args = parser.parse_args(argv)
    try:
        written = make_student(args.src, args.out)
    except (ValueError, OSError) as exc:
        parser.exit(1, f"error: {exc}\n")
    what = "solutions removed, exercise outputs cleared"
    print(f"student edition: {len(written)} files in {args.out}/ ({what})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
