"""Build the course book: a static HTML site of every chapter, from the committed notebooks.

``make book`` runs ``python book/build.py``; ``make book EDITION=student`` adds
``--edition student``. The site goes to ``book/_build/<edition>/html/`` (open its ``index.html``
in a browser, or serve the folder with any static server): left navigation in course order, a
page per chapter with its outputs and figures as committed (nothing is executed), search,
previous/next links, copy buttons, math, and no request to another host.

The Sphinx sources are staged in ``book/_build/<edition>/src/``:

* ``index.md``: book/intro.md, whose ``<!-- README.md: ... -->`` lines are replaced by the
  paragraph or section of README.md they name (chapter names linked to their pages), followed by
  the left navigation: every notebook, in file order (which is course order), then the workshop
  guide;
* ``workshop.md``: WORKSHOP.md; ``glossary.md``: GLOSSARY.md, its links to
  ``notebooks/<chapter>.ipynb`` pointed at the chapters' pages;
* one ``.ipynb`` per chapter: the notebook as committed (instructor edition), or as
  :func:`mgtutorial.workshop.edition.make_student` writes it (student edition, the same files as
  ``make student``); in both, each widget is replaced by a line naming its controls, taken from
  the widget state saved in the notebook (a static page cannot run it; the figure it drives is
  saved beside it as an image).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
BOOK = ROOT / "book"
sys.path.insert(0, str(ROOT))  # the package of this checkout, for the student edition

from mgtutorial.workshop.edition import make_student  # noqa: E402

EDITIONS = ("instructor", "student")
MARKER = ".mgtutorial-book"  # in every output folder this script wrote (it may delete them)
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
README_PART = re.compile(r'^<!-- README\.md: (paragraph|section) "([^"]+)" -->$', re.M)
CHAPTER_NAME = re.compile(r"^\| `(\d\d[a-z]?_\w+)` \|", re.M)
NAVIGATION = "<!-- the chapters, in course order -->"
WIDGET_LINE = "Interactive in JupyterLab: "  # then the widget's controls


def readme_part(readme: str, kind: str, name: str) -> str:
    """The body of README's ``## name`` section, or its paragraph that starts with ``name``.

    Raises:
        ValueError: README.md has no such section or paragraph.
    """
    if kind == "section":
        match = re.search(rf"^## {re.escape(name)}\n(.*?)(?=^## |\Z)", readme, re.M | re.S)
        if match:
            return match.group(1).strip()
    else:
        for paragraph in readme.split("\n\n"):
            if paragraph.strip().startswith(name):
                return paragraph.strip()
    raise ValueError(f"README.md has no {kind} {name!r} (book/intro.md asks for it)")


def intro_page(readme: str, intro: str, chapters: list[str]) -> str:
    """book/intro.md with README's parts filled in and the navigation appended."""

    def fill(match: re.Match) -> str:
        text = readme_part(readme, match.group(1), match.group(2))
        text = CHAPTER_NAME.sub(
            lambda m: (
                f"| [`{m.group(1)}`]({m.group(1)}.ipynb) |"
                if m.group(1) in chapters
                else m.group(0)
            ),
            text,
        )
        return text.replace("](WORKSHOP.md)", "](workshop.md)").replace(
            "](GLOSSARY.md)", "](glossary.md)"
        )

    toc = "\n".join(
        [
            "```{toctree}\n:hidden:\n:caption: Chapters\n",
            *chapters,
            "```\n\n```{toctree}\n:hidden:\n:caption: Teaching\n\nworkshop\nglossary\n```\n",
        ]
    )
    return README_PART.sub(fill, intro).replace(NAVIGATION, toc)


def widget_labels(state: dict, model_id: str) -> list[str]:
    """The descriptions of the controls in the saved widget ``model_id`` and its children."""
    model = state.get(model_id, {}).get("state", {})
    labels = [model["description"]] if model.get("description") else []
    for child in model.get("children", []):
        labels += widget_labels(state, child.removeprefix("IPY_MODEL_"))
    return labels


def static_widgets(nb) -> None:
    """Replace each widget output by a line naming its controls; drop the saved widget state."""
    state = nb.metadata.pop("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            view = output.get("data", {}).get(WIDGET_VIEW)
            if view is None:
                continue
            labels = widget_labels(state, view.get("model_id", ""))
            text = WIDGET_LINE + " · ".join(labels) if labels else None
            output["data"] = {"text/plain": text or output["data"].get("text/plain", "")}


def chapter_notebooks(notebooks: Path, edition: str, scratch: Path) -> dict[str, object]:
    """name -> notebook of the edition (the student one written by ``make_student``)."""
    if edition == "student":
        if scratch.exists():
            shutil.rmtree(scratch)
        make_student(notebooks, scratch)
        notebooks = scratch
    return {
        path.stem: nbformat.read(path, as_version=4) for path in sorted(notebooks.glob("*.ipynb"))
    }


def stage(src: Path, edition: str, notebooks: Path, scratch: Path) -> list[str]:
    """Write the Sphinx sources of ``edition`` to ``src``; returns the chapters' names."""
    src.mkdir(parents=True)
    chapters = chapter_notebooks(notebooks, edition, scratch)
    if not chapters:
        raise ValueError(f"no notebook in {notebooks}")
    for name, nb in chapters.items():
        static_widgets(nb)
        nbformat.write(nb, src / f"{name}.ipynb")
    readme = (ROOT / "README.md").read_text()
    intro = (BOOK / "intro.md").read_text()
    (src / "index.md").write_text(intro_page(readme, intro, list(chapters)))
    shutil.copy2(ROOT / "WORKSHOP.md", src / "workshop.md")
    glossary = (ROOT / "GLOSSARY.md").read_text()
    (src / "glossary.md").write_text(glossary.replace("](notebooks/", "]("))
    return list(chapters)


def fresh(folder: Path) -> None:
    """Empty ``folder`` for a new build: new, or one this script wrote before (it holds MARKER)."""
    if folder.exists():
        if not (folder / MARKER).is_file():
            raise ValueError(
                f"{folder} exists and was not written by book/build.py: choose another"
            )
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    (folder / MARKER).write_text("written by book/build.py; safe to delete\n")


def build(edition: str = "instructor", out: Path | None = None, strict: bool = False) -> Path:
    """Build the ``edition`` book into ``out`` (default ``book/_build/<edition>``); returns the
    folder holding ``index.html``.

    Raises:
        ValueError: an unknown edition, an ``out`` this script did not write, no notebooks, a
            README part that book/intro.md names is missing, or a malformed solution block.
        subprocess.CalledProcessError: Sphinx failed (with ``strict``: also on any warning).
    """
    if edition not in EDITIONS:
        raise ValueError(f"edition must be one of {EDITIONS}, not {edition!r}")
    out = Path(out or BOOK / "_build" / edition).resolve()
    fresh(out)
    stage(out / "src", edition, ROOT / "notebooks", out / "student-notebooks")
    html = out / "html"
    cmd = [sys.executable, "-m", "sphinx", "-b", "html", "-q", "-c", str(BOOK)]
    cmd += ["-d", str(out / "doctrees"), "-t", edition]
    cmd += ["-W", "--keep-going"] if strict else []
    subprocess.run([*cmd, str(out / "src"), str(html)], check=True)
    return html


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python book/build.py", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--edition", choices=EDITIONS, default="instructor")
    parser.add_argument("--out", type=Path, help="default: book/_build/<edition>")
    parser.add_argument("--strict", action="store_true", help="fail on any Sphinx warning")
    args = parser.parse_args(argv)
    start = time.monotonic()
    try:
        html = build(args.edition, args.out, args.strict)
    except ValueError as exc:
        parser.exit(1, f"error: {exc}\n")
    except subprocess.CalledProcessError as exc:
        parser.exit(exc.returncode or 1, "error: Sphinx failed (its messages are above)\n")
    size = sum(f.stat().st_size for f in html.rglob("*") if f.is_file())
    print(
        f"the {args.edition} book: {html / 'index.html'} "
        f"({size / 2**20:.1f} MiB, built in {time.monotonic() - start:.0f} s)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
