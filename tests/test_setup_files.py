"""The setup files agree with each other."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def _pip_section(text: str) -> list[str]:
    lines, inside = [], False
    for line in text.splitlines():
        if re.match(r"\s*- pip:\s*$", line):
            inside = True
        elif inside and re.match(r"\s{6,}- ", line):
            lines.append(line.split("- ", 1)[1].strip())
        elif inside and line.strip():
            inside = False
    return lines


def test_environment_yml_matches_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    wanted = project["dependencies"] + extras["test"] + extras["e2e"] + extras["book"]
    listed = [
        p for p in _pip_section((ROOT / "environment.yml").read_text()) if not p.startswith("-e")
    ]
    assert sorted(listed) == sorted(wanted)


def test_readme_starts_with_the_two_commands_and_ci_runs_the_test_one():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```(?:\w+)?\n(.*?)```", readme, re.S)
    assert blocks and blocks[0].split("\n")[:2] == ["make lab", "make test"]
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_the_licence_pyproject_names_is_there():
    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["license"] == "MIT"
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("MIT License") and "Copyright (c) 2026 The mgtutorial authors" in text


def test_earlier_student_editions_are_ignored_and_their_runs_cleaned():
    ignored = subprocess.run(
        ["git", "check-ignore", "-q", "student-previous-20260101-120000/00_setup.ipynb"], cwd=ROOT
    )
    assert ignored.returncode == 0
    dry = subprocess.run(
        ["make", "-n", "clean-runs"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    assert "student-previous-*/runs" in dry


def test_the_readme_says_what_a_newcomer_needs_first():
    readme = (ROOT / "README.md").read_text()
    head = readme[: readme.index("## The main job")]
    for needed in (
        "Python ≥ 3.10",
        "`make`",
        "6 GB",
        "apt-get",
        "`make test` took",
        "make test-notebook",
    ):
        assert needed in head, needed
    assert "GLOSSARY.md" in head


GLOSSARY_TERMS = (
    "rank",
    "local rank",
    "world size",
    "backend",
    "process group",
    "all-reduce",
    "bucket",
    "micro-batch",
    "stage",
    "bubble",
    "shard",
    "mesh",
    "placement",
)


def test_the_glossary_links_each_term_to_a_chapter_that_exists():
    rows = [
        line for line in (ROOT / "GLOSSARY.md").read_text().splitlines() if line.startswith("| **")
    ]
    terms = {t: row for row in rows for t in re.findall(r"\*\*([^*]+)\*\*", row)}
    assert set(GLOSSARY_TERMS) <= set(terms)
    for term, row in terms.items():
        links = re.findall(r"\]\((notebooks/[^)]+\.ipynb)\)", row)
        assert links, f"{term}: no chapter linked"
        for link in links:
            assert (ROOT / link).exists(), f"{term}: {link} does not exist"


def test_the_book_has_the_glossary_with_links_to_its_pages(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("book_build", ROOT / "book" / "build.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    chapters = build.stage(tmp_path / "src", "instructor", ROOT / "notebooks", tmp_path / "x")
    page = (tmp_path / "src" / "glossary.md").read_text()
    assert "](notebooks/" not in page and "](02_ddp.ipynb)" in page
    assert "\nworkshop\nglossary\n" in (tmp_path / "src" / "index.md").read_text()
    assert "02_ddp" in chapters


def test_test_fast_is_about_two_minutes_in_readme_and_make_help():
    # measured: 2 min 13 s from a fresh start on 2 cores
    assert (
        "`make test-fast` is the inner loop, about two minutes:" in (ROOT / "README.md").read_text()
    )
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^test-fast: .*## the inner loop, about two minutes:", makefile, re.M)


def test_a_notebook_number_that_names_none_lists_the_chapters(tmp_path):
    (tmp_path / ".installed").touch()  # a stamp newer than pyproject.toml: make installs nothing
    out = subprocess.run(
        ["make", "--no-print-directory", "test-notebook", "NB=99", f"VENV={tmp_path}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    chapters = sorted(p.name.split("_")[0] for p in (ROOT / "notebooks").glob("*.ipynb"))
    assert out.returncode == 2 and "NB=99 names no notebooks/<NB>_*.ipynb" in out.stdout
    assert f"the chapters are {' '.join(chapters)} " in out.stdout, out.stdout
