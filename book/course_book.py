"""The Sphinx extension of the course book (book/conf.py loads it): heading anchors as JupyterLab
writes them, and MathJax served from the site itself."""

from __future__ import annotations

import importlib.metadata
import shutil
from pathlib import Path

# MathJax 3's TeX-to-SVG bundle (SVG needs no web font) and the TeX extensions it loads on demand.
MATHJAX_PARTS = ("tex-svg.js", "input/tex/extensions")


def jupyterlab_slug(title: str) -> str:
    """The anchor JupyterLab gives a heading: its text with every space turned into ``-``
    (``## 4. The library version`` is ``#4.-The-library-version``), so that the chapters' own
    links to their sections resolve in the book as they do in JupyterLab."""
    return title.strip().replace(" ", "-")


def copy_mathjax(app, exc) -> None:
    """Copy MathJax (:data:`MATHJAX_PARTS`) from the ``sphinx-mathjax-offline`` package into
    ``_static/mathjax``."""
    if exc is not None or app.builder.format != "html":
        return
    dist = importlib.metadata.distribution("sphinx-mathjax-offline")
    source = Path(dist.locate_file("sphinx-mathjax-offline/static/mathjax"))
    target = Path(app.outdir) / "_static" / "mathjax"
    for part in MATHJAX_PARTS:
        src, dst = source / part, target / part
        if src.is_dir():
            shutil.copytree(src, dst, dirs_exist_ok=True)
        else:
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)


def setup(app):
    app.connect("build-finished", copy_mathjax)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
