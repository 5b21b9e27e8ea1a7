"""The course book (``make book``, book/build.py) built from the committed notebooks and read in a
real browser: Debian's Chromium, driven by Playwright, opens every page of both editions from
``file://``.

Every page loads with no console error and no request outside the site (no CDN: MathJax, fonts
and scripts are the site's own); every link inside the site and every anchor resolves; each
chapter shows as many loaded figures as its notebook (that edition's) has image outputs, each
widget as the line naming its controls (never a blank box), and a copy button per code cell; the
left navigation is in course order with previous/next links along it; math renders; the search
finds ``reshard_after_forward`` in chapter 07; the student book holds no solution that the
instructor book shows. Screenshots of two pages go to test-artifacts/e2e/book/.

Both books are built once per module with ``--strict`` (a Sphinx warning fails the build). Without
the ``[book]`` extra (``make book`` and ``make test`` install it) or Chromium, the tests are
skipped with the reason; the check of the built files for outside references needs no browser.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote, urlsplit

import nbformat
import pytest

from mgtutorial.workshop.edition import BEGIN, END, student_notebook

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
SCREENSHOTS = Path(os.environ.get("MGTUTORIAL_E2E_ARTIFACTS", ROOT / "test-artifacts" / "e2e"))
COURSE_ORDER = (
    *("00", "01", "02", "03a", "03b", "03c", "04a", "04b", "04z", "05a", "05b", "05c"),
    *("06a", "06b", "07a", "07b", "08a", "08b", "09a", "09b", "10a", "10b"),
)
SEARCH_TERM, SEARCH_HIT = "checkpoint_wrapper", "07a_zero_memory.html"
BOOK_PACKAGES = (
    "sphinx",
    "myst-nb",
    "sphinx-book-theme",
    "sphinx-copybutton",
    "sphinx-mathjax-offline",
)
OUTSIDE = re.compile(
    r"""<(?:script|link|img|iframe|source)\b[^>]*?\b(?:src|href)=["'](?:https?:)?//"""
)
CSS_OUTSIDE = re.compile(r"""(?:url\(|@import)\s*["']?(?:https?:)?//""")
_spec = importlib.util.spec_from_file_location("book_build", ROOT / "book" / "build.py")
build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build)

_read: dict[Path, dict] = {}  # site -> its pages, read once for both tests
# What a page shows: its anchors and links, figures (loaded or not), widget lines, blank outputs,
# navigation, copy buttons, table of contents, text, and its math once MathJax has typeset it.
PAGE_STATE = """
async (widgetLine) => {
  const all = (sel) => [...document.querySelectorAll(sel)];
  const outputs = all('.cell_output');
  const maths = all('.math');
  if (maths.length && window.MathJax?.startup?.promise) await window.MathJax.startup.promise;
  const typeset = (m) => m.querySelector('mjx-container svg') && !m.querySelector('mjx-merror');
  return {
    ids: all('[id]').map((e) => e.id).concat(all('a[name]').map((a) => a.name)),
    links: all('a[href]').map((a) => a.href),
    images: all('.cell_output img').map((i) => i.complete && i.naturalWidth > 0),
    widgets: all('.cell_output .output').filter((o) => o.innerText.trim().startsWith(widgetLine))
      .length,
    blank_outputs: outputs.filter((o) => !o.innerText.trim() && !o.querySelector('img')).length,
    nav: all('.bd-docs-nav a').map((a) => a.getAttribute('href')),
    prev: document.querySelector('a.left-prev')?.getAttribute('href') ?? null,
    next: document.querySelector('a.right-next')?.getAttribute('href') ?? null,
    copy_buttons: all('div.cell_input').filter((c) => c.querySelector('button.copybtn')).length,
    code_cells: all('div.cell_input').length,
    output_buttons: all('.cell_output button.copybtn').length,
    toc: all('#pst-page-toc-nav a').length,
    math: {count: maths.length, rendered: maths.filter(typeset).length},
    text: (document.querySelector('main') || document.body).innerText,
  };
}
"""


@pytest.fixture(scope="module")
def books(tmp_path_factory) -> dict[str, Path]:
    """Both editions, built with book/build.py --strict; edition -> the folder of index.html."""
    for name in BOOK_PACKAGES:
        try:
            importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            pytest.skip(f"{name} is missing: the [book] extra (make test and make book install it)")
    out = tmp_path_factory.mktemp("book")
    sites = {}
    for edition in build.EDITIONS:
        cmd = [sys.executable, str(ROOT / "book" / "build.py"), "--strict"]
        cmd += ["--edition", edition, "--out", str(out / edition)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stdout}\n{done.stderr}"
        print(done.stdout.strip())
        sites[edition] = out / edition / "html"
    return sites


def edition_notebooks(edition: str) -> dict[str, nbformat.NotebookNode]:
    """page name -> the notebook of that edition (the student one as make student writes it)."""
    nbs = {p.stem: nbformat.read(p, as_version=4) for p in sorted(NOTEBOOKS.glob("*.ipynb"))}
    if edition == "student":
        nbs = {name: student_notebook(nb, where=name) for name, nb in nbs.items()}
    return nbs


def outputs_with(nb, prefix: str) -> int:
    return sum(
        any(mime.startswith(prefix) for mime in output.get("data", {}))
        for cell in nb.cells
        for output in cell.get("outputs", [])
    )


def read_site(chromium: dict, site: Path, shots: dict | None = None) -> dict[str, dict]:
    """Open every page of ``site`` in Chromium; page file name -> what it showed and requested.

    ``shots``: page -> (screenshot file in test-artifacts/e2e/book/, the element to scroll to, or
    None for the top of the page)."""
    if site in _read and not shots:
        return _read[site]
    sync_api = pytest.importorskip("playwright.sync_api", reason="Playwright is missing (.[e2e])")
    root = site.as_uri() + "/"
    pages = _read[site] = {}
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(**chromium)
        try:
            context = browser.new_context(viewport={"width": 1280, "height": 900})
            for path in sorted(site.glob("*.html")):
                page = context.new_page()
                seen = {"console": [], "requests": [], "failed": []}
                page.on("console", lambda m, s=seen: s["console"].append((m.type, m.text)))
                page.on("pageerror", lambda e, s=seen: s["console"].append(("error", str(e))))
                page.on("request", lambda r, s=seen: s["requests"].append(r.url))
                page.on("requestfailed", lambda r, s=seen: s["failed"].append(r.url))
                page.goto(path.as_uri(), wait_until="load")
                state = page.evaluate(PAGE_STATE, build.WIDGET_LINE)
                if shots and path.name in shots:
                    screenshot(page, *shots[path.name])
                pages[path.name] = {**state, **seen, "root": root}
                page.close()
            if SEARCH_TERM:
                pages["search"] = search(context, site)
        finally:
            browser.close()
    return pages


def screenshot(page, name: str, selector: str | None) -> None:
    SCREENSHOTS.joinpath("book").mkdir(parents=True, exist_ok=True)
    if selector:
        page.locator(selector).first.scroll_into_view_if_needed()
    page.screenshot(path=SCREENSHOTS / "book" / name)


def search(context, site: Path) -> list[str]:
    """The pages the book's search lists for :data:`SEARCH_TERM`."""
    page = context.new_page()
    page.goto(f"{(site / 'search.html').as_uri()}?q={SEARCH_TERM}", wait_until="load")
    page.wait_for_selector("#search-results .search-summary", timeout=20_000)
    hits = page.eval_on_selector_all("#search-results ul.search li a", "as => as.map(a => a.href)")
    page.close()
    return [Path(urlsplit(h).path).name for h in hits]


def check_pages(pages: dict[str, dict], site: Path, edition: str) -> None:
    """What every page of an edition must show; raises AssertionError listing every problem."""
    nbs = edition_notebooks(edition)
    chapters = [f"{name}.html" for name in nbs]
    problems = []
    ids = {name: set(p["ids"]) for name, p in pages.items() if name.endswith(".html")}
    for name, page in ((n, p) for n, p in pages.items() if n.endswith(".html")):
        root = page["root"]
        errors = [text for kind, text in page["console"] if kind == "error"]
        outside = [u for u in page["requests"] if not u.startswith((root, "data:", "blob:"))]
        problems += [f"{name}: console error {e!r}" for e in errors]
        problems += [f"{name}: request outside the site {u}" for u in outside]
        problems += [f"{name}: request failed {u}" for u in page["failed"]]
        for href in page["links"]:
            problems += link_problems(name, href, root, site, ids)
        if page["math"]["count"] != page["math"]["rendered"]:
            problems.append(f"{name}: math rendered {page['math']}")
        stem = name.removesuffix(".html")
        if stem in nbs:
            problems += chapter_problems(name, page, nbs[stem], chapters)
    index = pages["index.html"]
    problems += [] if index["math"]["count"] else ["index.html: no math (the intro has formulas)"]
    navigation = [href for href in index["nav"] if href in chapters]
    if navigation != chapters:
        problems.append(f"navigation {navigation} is not the chapters in course order {chapters}")
    assert not problems, f"the {edition} book:\n" + "\n".join(problems)


def link_problems(name: str, href: str, root: str, site: Path, ids: dict[str, set]) -> list[str]:
    url = urlsplit(href)
    if url.scheme in ("http", "https", "mailto"):
        return []  # a link out is allowed; it is not loaded
    if url.scheme != "file" or not href.startswith(root):
        return [f"{name}: link {href} leaves the site"]
    target = unquote(url.path)[len(urlsplit(root).path) :] or "index.html"
    if not (site / target).is_file():
        return [f"{name}: link to {target}, which the site does not have"]
    if url.fragment and target in ids and unquote(url.fragment) not in ids[target]:
        return [f"{name}: link to {target}#{url.fragment}, which has no such anchor"]
    return []


def chapter_problems(name: str, page: dict, nb, chapters: list[str]) -> list[str]:
    problems = []
    images, widgets = outputs_with(nb, "image/"), outputs_with(nb, build.WIDGET_VIEW)
    if len(page["images"]) != images or not all(page["images"]):
        problems.append(f"{name}: figures loaded {page['images']}, the notebook has {images}")
    if page["widgets"] != widgets or page["blank_outputs"]:
        problems.append(
            f"{name}: {page['widgets']} widget lines for {widgets} widgets, "
            f"{page['blank_outputs']} blank outputs"
        )
    if page["copy_buttons"] != page["code_cells"] or page["output_buttons"]:
        problems.append(
            f"{name}: copy buttons on {page['copy_buttons']} of {page['code_cells']} code cells "
            f"and on {page['output_buttons']} outputs"
        )
    if not page["toc"]:
        problems.append(f"{name}: no table of contents of its sections")
    i = chapters.index(name)
    before, after = chapters[i - 1] if i else "index.html", chapters[i + 1 : i + 2]
    if page["prev"] != before or (after and page["next"] != after[0]):
        problems.append(f"{name}: previous {page['prev']}, next {page['next']}")
    return problems


def test_books_load_nothing_from_another_host(books):
    """The built files (both editions) reference no outside script, style sheet, image or font."""
    found = []
    for site in books.values():
        for path in site.rglob("*"):
            pattern = {".html": OUTSIDE, ".css": CSS_OUTSIDE}.get(path.suffix)
            if pattern and pattern.search(path.read_text(errors="replace")):
                found.append(str(path.relative_to(site.parent)))
    assert not found, f"files that load from another host: {found}"
    index = (books["instructor"] / "index.html").read_text()
    assert all(f'href="{name}.html"' in index for name in edition_notebooks("instructor"))


def test_instructor_book_in_chromium(books, chromium):
    prefixes = tuple(name.split("_")[0] for name in edition_notebooks("instructor"))
    assert prefixes == COURSE_ORDER, f"the chapters are {prefixes}"
    for old in SCREENSHOTS.joinpath("book").glob("*.png"):
        old.unlink()
    calculator = f".cell_output:has-text('{build.WIDGET_LINE.strip()}')"  # its figure and controls
    shots = {
        "index.html": ("book-index.png", None),
        SEARCH_HIT: ("book-07a_zero_memory.png", calculator),
    }
    pages = read_site(chromium, books["instructor"], shots)
    check_pages(pages, books["instructor"], "instructor")
    assert SEARCH_HIT in pages["search"], f"the search for {SEARCH_TERM}: {pages['search']}"
    assert all((SCREENSHOTS / "book" / shot).stat().st_size > 10_000 for shot, _ in shots.values())


def solution_texts() -> dict[str, list[str]]:
    """page -> the lines of its solutions (code) and their paragraphs' first words (Markdown),
    but those that the student edition holds anyway (a starter, another chapter's lesson)."""
    texts = {}
    student = "\n".join(map(notebook_text, edition_notebooks("student").values()))
    for name, nb in edition_notebooks("instructor").items():
        found = []
        for cell in nb.cells:
            for block in re.findall(rf"{BEGIN}[^\n]*\n(.*?)\n[^\n]*{END}", cell.source, re.S):
                if cell.cell_type == "code":
                    lines = [line.strip() for line in block.splitlines()]
                else:
                    lines = [" ".join(plain(p).split()[:8]) for p in block.split("\n\n")]
                found += [t for t in lines if len(t) >= 12 and t not in student]
        texts[f"{name}.html"] = found
    return texts


def notebook_text(nb) -> str:
    """Every cell's source and every output's text, images left out."""
    texts = []
    for cell in nb.cells:
        texts.append(cell.source)
        for output in cell.get("outputs", []):
            texts += [output.get("text", ""), output.get("data", {}).get("text/plain", "")]
    return "\n".join(texts)


def plain(text: str) -> str:
    """Markdown as the page shows it, near enough: no emphasis, code marks or link targets."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return " ".join(re.sub(r"[*_`]", "", text).split())


def test_student_book_in_chromium(books, chromium):
    solutions = solution_texts()
    assert sum(map(len, solutions.values())) >= 20, "too few solution lines to check"
    teacher = read_site(chromium, books["instructor"])
    pages = read_site(chromium, books["student"])
    check_pages(pages, books["student"], "student")
    shown = {name: plain(p["text"]) for name, p in pages.items() if name.endswith(".html")}
    for path in books["student"].rglob("*.ipynb"):  # what the download button gives
        shown[str(path)] = plain(notebook_text(nbformat.read(path, as_version=4)))
    missing, leaked = [], []
    for name, texts in solutions.items():
        page_text = plain(teacher[name]["text"])
        missing += [f"{name}: {t}" for t in texts if plain(t) not in page_text]
        leaked += [f"{where}: {t}" for t in texts for where, s in shown.items() if plain(t) in s]
    assert not missing, "the instructor book does not show these solutions:\n" + "\n".join(missing)
    assert not leaked, "the student book shows solution text:\n" + "\n".join(leaked)
