"""Sphinx configuration of the course book (``make book``; sources staged by book/build.py).

The chapters are the committed notebooks, read by myst-nb as they are (never executed), in the
sphinx-book-theme. Everything a page loads is in the site itself, so it opens from ``file://`` or
any static server with no outside request: myst-nb's widget scripts (a CDN) are switched off
(build.py turns each widget into the text of its saved state), and MathJax 3 comes from the
``sphinx-mathjax-offline`` package, copied into ``_static/mathjax/`` with the SVG output, which
needs no web font. ``-t student`` builds the student edition's title.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # course_book.py, the book's extension

STUDENT = tags.has("student")  # noqa: F821 (Sphinx defines ``tags`` while it reads this file)

project = "mgtutorial"
author = "the mgtutorial authors"
copyright = "the mgtutorial authors, MIT licence"
html_title = "Multi-GPU training in PyTorch" + (" (student edition)" if STUDENT else "")

extensions = ["myst_nb", "sphinx_copybutton", "course_book"]
root_doc = "index"
exclude_patterns = ["_build", "**/.ipynb_checkpoints", "exercises", "*.py"]
suppress_warnings = ["mystnb.unknown_mime_type"]
smartquotes = False  # the prose as the notebook has it (JupyterLab keeps ' and ")

# The notebooks as committed: outputs and figures as saved, nothing run.
nb_execution_mode = "off"
nb_ipywidgets_js = {}  # the default loads require.js and the widget manager from a CDN
nb_merge_streams = True
# What JupyterLab renders in Markdown: $math$, and heading anchors as JupyterLab writes them
# ("## 4. The library version" is #4.-The-library-version), so the chapters' own links resolve.
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence", "deflist"]
myst_heading_anchors = 4
myst_heading_slug_func = "course_book.jupyterlab_slug"

# MathJax 3, served from the site (course_book.py copies it there).
mathjax_path = "mathjax/tex-svg.js"
mathjax3_config = {"svg": {"fontCache": "global"}, "options": {"enableMenu": False}}

html_theme = "sphinx_book_theme"
html_static_path = ["_static"]
html_css_files = ["book.css"]
html_last_updated_fmt = None
html_context = {"default_mode": "light"}  # the figures are drawn on white
html_copy_source = True  # the download button gives each chapter's .ipynb
html_theme_options = {
    "use_download_button": True,
    "use_fullscreen_button": False,
    "use_repository_button": False,
    "use_issues_button": False,
    "use_edit_page_button": False,
    "launch_buttons": {},
    "show_toc_level": 2,
    "home_page_in_toc": True,
    "navigation_with_keys": False,
    "show_prev_next": True,
    "search_bar_text": "Search the course…",
}
# Copy buttons on code cells and code blocks, never on outputs.
copybutton_selector = "div.cell_input pre, div.highlight-python pre, div.highlight-bash pre"
copybutton_exclude = ".linenos, .gp, .go"
