"""Every exercise both ways: the instructor edition's solutions pass their checkers, the student
edition's untouched starters fail them with a hint, and ``make student`` removes every solution.

The instructor edition (the committed notebooks) runs under nbval in ``make test``: every checker
cell is marked ``# NBVAL_CHECK_OUTPUT`` and its committed output holds its one ``✓ NN.k`` line
(tests/test_notebook_hygiene.py checks both), so nbval fails a solution that raises or no longer
prints its line. This file runs the student edition: each notebook's "## Exercises" section on its
own in a fresh kernel, in a temporary folder (``%%writefile`` starters land there); and it checks,
without running them, that the instructor's sections can run on their own too (they use no name
that only the lesson defines). A checker cell is a code cell whose committed output holds a ``✓``
line.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from mgtutorial.exercises import PASS, ExerciseError
from mgtutorial.exercises._common import answered, attempt
from mgtutorial.workshop import edition

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
WITH_EXERCISES = [
    p
    for p in NOTEBOOKS
    if (s := edition.exercises_start(nbformat.read(p, as_version=4))) is not None
    and any(
        c.cell_type == "markdown" and c.source.lstrip().startswith("### Exercise")
        for c in nbformat.read(p, as_version=4).cells[s:]
    )
]


def _text(cell) -> str:
    return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")


def pass_lines(cell) -> list[str]:
    return [line for line in _text(cell).splitlines() if line.startswith(PASS + " ")]


def section_code_cells(nb) -> list:
    """The code cells of ``nb``'s Exercises section, in order."""
    return [c for c in nb.cells[edition.exercises_start(nb) :] if c.cell_type == "code"]


def checker_cells(nb) -> list[int]:
    """Indices (among the Exercises section's code cells) of the cells whose committed output
    has a ✓ line."""
    return [i for i, c in enumerate(section_code_cells(nb)) if pass_lines(c)]


def exercise_headings(nb) -> list[str]:
    """The ``### Exercise`` heading lines of ``nb``'s Exercises section."""
    return [
        line
        for c in nb.cells[edition.exercises_start(nb) :]
        if c.cell_type == "markdown"
        for line in c.source.splitlines()
        if line.startswith("### Exercise")
    ]


def run_section(nb, tmp_path: Path):
    """Execute the code cells of ``nb``'s Exercises section in a fresh kernel in ``tmp_path``."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    section = nbformat.v4.new_notebook(metadata=nb.metadata)
    section.cells = section_code_cells(nb)
    NotebookClient(
        section,
        timeout=300,
        kernel_name="python3",
        allow_errors=True,
        resources={"metadata": {"path": str(tmp_path)}},
    ).execute()
    return section.cells


def errors(cell) -> list:
    return [o for o in cell.outputs if o.output_type == "error"]


def _ruff() -> list[str]:
    found = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if not found:
        pytest.skip("ruff is not installed (pip install -e '.[test]')")
    return [found]


def undefined_names(sections: dict[str, list[str]], folder: Path) -> str:
    """ruff's undefined-name report (F821) on each section (a list of code-cell sources) as a
    notebook of its own; empty when every name a section uses is defined or imported in it."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, sources in sections.items():
        nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources])
        nbformat.write(nb, folder / name)
        paths.append(str(folder / name))
    out = subprocess.run(
        [*_ruff(), "check", "--isolated", "--select", "F821", "--output-format", "concise", *paths],
        capture_output=True,
        text=True,
    )
    return "" if out.returncode == 0 else out.stdout + out.stderr


# --- both ways, per notebook --------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("path", WITH_EXERCISES, ids=lambda p: p.stem)
def test_untouched_starters_fail_with_their_hint(path, tmp_path):
    instructor = nbformat.read(path, as_version=4)
    committed, checkers = section_code_cells(instructor), checker_cells(instructor)
    assert checkers, f"{path.name}: no exercise cell prints a {PASS} line in the committed notebook"

    started = run_section(edition.student_notebook(instructor, path.name), tmp_path)
    for i, cell in enumerate(started):
        assert i in checkers or not errors(cell), (
            f"{path.name} exercise cell {i} (not a checker) fails in the student edition:\n"
            f"{errors(cell)[0].ename}: {errors(cell)[0].evalue}"
        )
    for i in checkers:
        cell, exercise = started[i], pass_lines(committed[i])[0][2:].split(":")[0]
        assert not pass_lines(cell), f"{path.name}: the untouched starter passes {exercise}"
        errs = errors(cell)
        assert errs and errs[0].ename in ("ExerciseError", "RankFailed"), (
            f"{path.name}: the starter of {exercise} fails with "
            + (f"{errs[0].ename}: {errs[0].evalue}" if errs else "nothing")
            + " instead of a hint"
        )
        hint = errs[0].evalue
        assert hint.startswith(exercise + ": ") and len(hint) > len(exercise) + 20, (
            f"{path.name}: {exercise}'s starter fails without a specific hint: {hint!r}"
        )


def test_every_exercises_section_runs_on_its_own(tmp_path):
    """A learner may restart the kernel and run only the Exercises: in both editions, no section
    uses a name that only the lesson above it defines (what nbval's top-to-bottom run cannot
    see)."""
    instructor = {p.name: nbformat.read(p, as_version=4) for p in WITH_EXERCISES}
    sections = {n: [c.source for c in section_code_cells(nb)] for n, nb in instructor.items()}
    for name, nb in instructor.items():
        student = edition.student_notebook(nb, name)
        sections[f"student-{name}"] = [c.source for c in section_code_cells(student)]
    report = undefined_names(sections, tmp_path)
    assert not report, f"exercise cells use names their section does not define:\n{report}"


def test_undefined_name_check_can_fail(tmp_path):
    sections = {"x.ipynb": ["%%writefile ex.py\nx = (", "import torch\ndisplay(torch)", "model"]}
    assert "Undefined name `model`" in undefined_names(sections, tmp_path)
    assert undefined_names({"y.ipynb": ["model = 1", "print(model)"]}, tmp_path / "y") == ""


@pytest.mark.parametrize("path", WITH_EXERCISES, ids=lambda p: p.stem)
def test_every_exercise_has_a_checker_cell(path):
    nb = nbformat.read(path, as_version=4)
    headings, checkers = exercise_headings(nb), checker_cells(nb)
    assert len(checkers) == len(headings), (
        f"{path.name}: {len(headings)} '### Exercise' headings but {len(checkers)} checker cells "
        f"(code cells whose committed output has a {PASS} line): each exercise needs its "
        f"checker, run in the committed notebook; headings: {headings}"
    )


def test_the_course_has_as_many_checkers_as_exercises():
    notebooks = [nbformat.read(p, as_version=4) for p in WITH_EXERCISES]
    headings = sum(len(exercise_headings(nb)) for nb in notebooks)
    assert headings >= 52, (
        f"only {headings} '### Exercise' headings in the course (52 when this was written)"
    )
    assert sum(len(checker_cells(nb)) for nb in notebooks) == headings


# --- the student edition ------------------------------------------------------------------------


def test_student_edition_has_no_solution(tmp_path):
    written = edition.make_student(ROOT / "notebooks", tmp_path / "student")
    assert {p.name for p in written if p.suffix == ".ipynb"} == {p.name for p in NOTEBOOKS}
    for path in NOTEBOOKS:
        instructor = nbformat.read(path, as_version=4)
        student = nbformat.read(tmp_path / "student" / path.name, as_version=4)
        nbformat.validate(student)
        assert len(student.cells) == len(instructor.cells)
        start = edition.exercises_start(instructor)
        for i, (a, b) in enumerate(zip(instructor.cells, student.cells)):
            assert edition.BEGIN not in b.source and edition.END not in b.source
            starters = [
                line.split("# STARTER:", 1)[1]
                for line in a.source.splitlines()
                if "# STARTER:" in line
            ]
            solutions = re.findall(r"BEGIN SOLUTION.*?\n(.*?)\n[^\n]*END SOLUTION", a.source, re.S)
            for block in solutions:
                # a line the starter has too (e.g. the step to extend) is not solution text
                for line in block.splitlines():
                    if len(line.strip()) >= 12 and not any(line.strip() in s for s in starters):
                        assert line.strip() not in b.source, (
                            f"{path.name} cell {i} keeps {line.strip()!r}"
                        )
            if b.cell_type == "code" and start is not None and i > start:
                assert not b.outputs and b.execution_count is None
                assert "NBVAL_CHECK_OUTPUT" not in b.source


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_student_edition_runs_its_first_cells(tmp_path):
    edition.make_student(ROOT / "notebooks", tmp_path / "student")
    nb = nbformat.read(tmp_path / "student" / "00_setup.ipynb", as_version=4)
    nb.cells = [c for c in nb.cells if c.cell_type == "code"][:3]
    NotebookClient(
        nb,
        timeout=120,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path / "student")}},
    ).execute()
    assert all(c.outputs for c in nb.cells[:1])


def test_make_student_never_deletes_what_it_did_not_write(tmp_path, monkeypatch):
    src = tmp_path / "project" / "notebooks"
    src.mkdir(parents=True)
    nbformat.write(
        nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# x")]), src / "00_x.ipynb"
    )
    monkeypatch.chdir(tmp_path / "project")
    # the notebooks, a folder holding them, the current one
    for out in (src, src.parent, tmp_path, Path(".")):
        with pytest.raises(ValueError, match="folder of its own"):
            edition.make_student(src, out)
    (tmp_path / "project" / "mine").mkdir()
    (tmp_path / "project" / "mine" / "notes.txt").write_text("a learner's notes")
    with pytest.raises(ValueError, match="is not a student edition written here"):
        edition.make_student(src, tmp_path / "project" / "mine")
    (tmp_path / "project" / "README.md").write_text("readme")
    with pytest.raises(ValueError, match="is not a student edition"):
        edition.make_student(src, tmp_path / "project" / "README.md")
    with pytest.raises(ValueError, match="no notebook in"):
        edition.make_student(tmp_path / "nowhere", tmp_path / "student")
    assert (tmp_path / "project" / "mine" / "notes.txt").read_text() == "a learner's notes"
    assert (tmp_path / "project" / "README.md").read_text() == "readme"
    assert sorted(p.name for p in src.iterdir()) == ["00_x.ipynb"]


def test_make_student_again_keeps_the_previous_edition(tmp_path):
    src = tmp_path / "notebooks"
    src.mkdir()
    nbformat.write(
        nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# x")]), src / "00_x.ipynb"
    )
    edition.make_student(src, tmp_path / "student")
    (tmp_path / "student" / "answer.py").write_text("a learner's answer")
    edition.make_student(src, tmp_path / "student")
    previous = [p for p in tmp_path.iterdir() if p.name.startswith("student-previous-")]
    assert len(previous) == 1 and (previous[0] / "answer.py").read_text() == "a learner's answer"
    assert (tmp_path / "student" / "00_x.ipynb").exists()
    assert not (tmp_path / "student" / "answer.py").exists()


def _one_notebook(src: Path, source: str = "# x") -> None:
    src.mkdir(exist_ok=True)
    nbformat.write(
        nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell(source)]), src / "00_x.ipynb"
    )


def _files(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): p.read_text() for p in sorted(folder.rglob("*")) if p.is_file()
    }


def test_make_student_refuses_a_malformed_solution_before_touching_the_edition(tmp_path):
    src = tmp_path / "notebooks"
    _one_notebook(src)
    (src / "exercises").mkdir()
    (src / "exercises" / "ex.py").write_text("x = 1\n")
    edition.make_student(src, tmp_path / "student")
    (tmp_path / "student" / "answer.py").write_text("a learner's answer")
    before = _files(tmp_path / "student")
    # the .py files come after every notebook
    (src / "exercises" / "ex.py").write_text("# END SOLUTION\n")
    with pytest.raises(
        ValueError, match=r"exercises/ex\.py: line 1 closes a solution that was never opened"
    ):
        edition.make_student(src, tmp_path / "student")
    (src / "exercises" / "ex.py").write_text("x = 1\n")
    _one_notebook(src, "# x\n<!-- BEGIN SOLUTION -->\nsecret")
    with pytest.raises(
        ValueError, match="00_x.ipynb cell 0: the solution opened on line 2 is never closed"
    ):
        edition.make_student(src, tmp_path / "student")
    assert _files(tmp_path / "student") == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notebooks", "student"]


def test_make_student_within_one_second_keeps_every_previous_edition(tmp_path, monkeypatch):
    src = tmp_path / "notebooks"
    _one_notebook(src)
    # every run in the same second
    monkeypatch.setattr(edition.time, "strftime", lambda fmt: "20260101-000000")
    for n in range(3):
        edition.make_student(src, tmp_path / "student")
        (tmp_path / "student" / "answer.py").write_text(f"answer {n}")
    kept = {
        p.name: (p / "answer.py").read_text() for p in tmp_path.iterdir() if "-previous-" in p.name
    }
    assert kept == {
        "student-previous-20260101-000000": "answer 0",
        "student-previous-20260101-000000-2": "answer 1",
    }
    assert (tmp_path / "student" / "answer.py").read_text() == "answer 2"


def test_make_student_cli_reports_an_os_error(tmp_path, capsys, monkeypatch):
    src = tmp_path / "notebooks"
    _one_notebook(src)
    edition.make_student(src, tmp_path / "student")
    monkeypatch.setattr(
        Path,
        "rename",
        lambda self, target: (_ for _ in ()).throw(PermissionError(13, "denied", str(self))),
    )
    with pytest.raises(SystemExit) as exit_:
        edition.main(["--src", str(src), "--out", str(tmp_path / "student")])
    assert exit_.value.code == 1 and capsys.readouterr().err.startswith("error: [Errno 13] denied")


# --- the transformation and the shared checker pieces --------------------------------------------

SOURCE = """def f(x):
    # BEGIN SOLUTION
    return x + 1
    # END SOLUTION
    # STARTER: return x
print(f(1))
"""


def test_strip_solutions_removes_the_block_and_uncomments_the_starter():
    student, blocks = edition.strip_solutions(SOURCE)
    assert blocks == 1
    assert student == "def f(x):\n    # your code here\n    return x\nprint(f(1))\n"
    namespace: dict = {}
    exec(SOURCE, namespace)  # the instructor edition runs its solution, the starter is a comment
    assert namespace["f"](1) == 2


def test_strip_solutions_in_markdown_keeps_no_placeholder():
    text = "Why?\n<!-- BEGIN SOLUTION -->\nBecause.\n<!-- END SOLUTION -->\nNext."
    assert edition.strip_solutions(text, code=False) == ("Why?\nNext.", 1)


@pytest.mark.parametrize(
    "bad, message",
    [
        ("# BEGIN SOLUTION\nx\n", "never closed"),
        ("x\n# END SOLUTION\n", "never opened"),
        ("# BEGIN SOLUTION\n# BEGIN SOLUTION\n# END SOLUTION\n", "inside"),
    ],
)
def test_strip_solutions_refuses_malformed_blocks(bad, message):
    with pytest.raises(ValueError, match=message):
        edition.strip_solutions(bad, where="nb cell 3")


def test_student_notebook_clears_exercise_outputs_only():
    out = [nbformat.v4.new_output("stream", name="stdout", text="shown\n")]
    nb = nbformat.v4.new_notebook(
        cells=[
            nbformat.v4.new_code_cell("print('lesson')", execution_count=1, outputs=out),
            nbformat.v4.new_markdown_cell("## Exercises\n\nsome"),
            nbformat.v4.new_code_cell("print('exercise')", execution_count=2, outputs=out),
        ]
    )
    student = edition.student_notebook(nb)
    assert student.cells[0].outputs and not student.cells[2].outputs
    assert nb.cells[2].outputs, "the instructor edition was changed"


def test_attempt_turns_learner_errors_into_hints():
    def starter():
        raise NotImplementedError

    def buggy():
        return 1 / 0

    with pytest.raises(ExerciseError, match="not written yet"):
        attempt("9.9 x", starter)
    with pytest.raises(ExerciseError, match="ZeroDivisionError"):
        attempt("9.9 x", buggy)
    with pytest.raises(ExerciseError, match="still `...`"):
        answered(..., "9.9 x")
    assert attempt("9.9 x", lambda: 3) == 3
