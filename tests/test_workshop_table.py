"""WORKSHOP.md's exercise table is what scripts/workshop_table.py writes from the notebooks: a
notebook whose exercises changed without the table being regenerated fails here."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import workshop_table as wt  # noqa: E402


def test_workshop_md_table_is_up_to_date():
    text = (ROOT / "WORKSHOP.md").read_text()
    assert wt.rewrite(text, wt.table(ROOT / "notebooks")) == text, (
        "WORKSHOP.md's exercise table differs from the notebooks' headings: "
        "run .venv/bin/python scripts/workshop_table.py"
    )


def _notebook(folder: Path, stem: str, *headings: str) -> Path:
    cells = [
        nbformat.v4.new_markdown_cell(f"# {stem[:2]} · Chapter {stem}\n\nText."),
        nbformat.v4.new_markdown_cell("## Exercises"),
    ]
    for h in headings:
        cells += [
            nbformat.v4.new_markdown_cell(f"{h}\n\nThe task."),
            nbformat.v4.new_code_cell("pass"),
        ]
    path = folder / f"{stem}.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=cells), path)
    return path


@pytest.fixture
def course(tmp_path):
    nbs = tmp_path / "notebooks"
    nbs.mkdir()
    _notebook(
        nbs,
        "00_a",
        "### Exercise 00.1 — first (≈ 5 min)",
        "### Exercise 00.2 — second (≈ 10 min)",
        "### Exercise 00.3 — third (≈ 15 min)",
    )
    _notebook(nbs, "03a_b", "### Exercise 03a.1 — only one (≈ 7 min)")
    _notebook(nbs, "08_c")
    (nbs / "notes.ipynb").write_text("not a chapter")  # no NN_ prefix: ignored
    md = tmp_path / "WORKSHOP.md"
    md.write_text(f"# Title\n\nbefore\n\n{wt.BEGIN}\nold table\n{wt.END}\n\nafter\n")
    return nbs, md


def test_rows_per_exercise_totals_per_chapter_and_the_track_rule(course):
    nbs, _ = course
    lines = wt.table(nbs).splitlines()
    rows = [line for line in lines if line.startswith("| ")]
    assert rows[1:] == [  # after the header
        "| `00_a` Chapter 00_a (3 h, day) | 00.1 | first | 5 | ✓ | ✓ |",
        "|  | 00.2 | second | 10 |  | ✓ |",
        "|  | 00.3 | third | 15 |  |  |",
        "| | | *chapter 00 total* | *30* | | |",
        "| `03a_b` Chapter 03a_b (3 h, day) | 03a.1 | only one | 7 | ✓ | ✓ |",
        "| | | *chapter 03a total* | *7* | | |",
        "| `08_c` Chapter 08_c | — | no exercises yet | | | |",
    ]
    assert lines[-1] == (
        "All exercises: 4 exercises, 37 min. 3-hour track: 2 exercises, 12 min. "
        "Full-day track: 3 exercises, 22 min."
    )


def test_check_fails_after_a_notebook_changes_until_the_table_is_rewritten(course, capsys):
    nbs, md = course
    args = ["--notebooks", str(nbs), "--workshop", str(md)]
    assert wt.main(["--check", *args]) == 1  # "old table"
    assert wt.main(args) == 0 and wt.main(["--check", *args]) == 0
    text = md.read_text()
    assert text.startswith("# Title\n\nbefore\n\n") and text.endswith(f"{wt.END}\n\nafter\n")
    _notebook(nbs, "08_c", "### Exercise 08.1 — new (≈ 20 min)")
    assert wt.main(["--check", *args]) == 1
    assert "out of date: run python scripts/workshop_table.py" in capsys.readouterr().out
    assert md.read_text() == text  # --check changes nothing
    wt.main(args)
    assert "| `08_c` Chapter 08_c | 08.1 | new | 20 |  |  |" in md.read_text()


@pytest.mark.parametrize(
    "heading", ["### Exercise 00.1 — no time", "### Exercise 01.1 — wrong chapter (≈ 5 min)"]
)
def test_a_malformed_heading_is_refused_with_the_notebook_named(tmp_path, heading):
    _notebook(tmp_path, "00_a", heading)
    with pytest.raises(
        ValueError, match=r"00_a\.ipynb: .* is not '### Exercise 00\.k — title \(≈ M min\)'"
    ):
        wt.table(tmp_path)


def test_missing_markers_are_refused():
    with pytest.raises(ValueError, match="exactly one"):
        wt.rewrite(f"no block\n{wt.END}\n{wt.BEGIN}\n", "x")


def test_the_real_notebooks_all_parse(tmp_path):
    shutil.copytree(
        ROOT / "notebooks", tmp_path / "nb", ignore=shutil.ignore_patterns("runs", "*.py")
    )
    assert "| 00.1 | the sum of ranks | 5 | ✓ | ✓ |" in wt.table(tmp_path / "nb")
