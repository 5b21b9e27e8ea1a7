"""``%%ranks`` in a real JupyterLab in a real browser: a cell runs on both ranks of a live process
group, and the notebook shows each rank's output in a column of its own.

Headless Debian Chromium, driven by Playwright for Python, opens a small notebook in a private
JupyterLab (see conftest.py) that loads the extension, runs a ``%%ranks`` cell with an
all-reduce and one with a barrier that rank 1 skips, and stops the pool. The test checks what a
learner sees: a table with a column per rank, each holding that rank's print; where the late rank
waits, and that the pool was restarted; no error; no process JupyterLab started outlives it.
Screenshots go to test-artifacts/e2e/ranks/.
"""

from __future__ import annotations

import json
import time

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

NOTEBOOK = "ranks_in_lab.ipynb"
CELLS = [
    "%load_ext mgtutorial",
    "%%ranks\nt = torch.tensor([float(rank)])\ndist.all_reduce(t)\n"
    'print(f"rank {rank} of {world_size} holds {t.item():g}")',
    "%%ranks --timeout 2 --no-raise\nif rank == 0:\n    dist.barrier()  # rank 1 skips it",
    "%ranks stop",
]
DEADLINE_S = 120  # from "run all" until every cell has run

STATE = """
() => {
  const panel = window.jupyterapp.shell.currentWidget;
  const nb = panel?.content;
  if (!nb?.widgets) return {prompts: [], kernel: null, tables: [], errors: []};
  const code = nb.widgets.filter((w) => w.model.type === 'code');
  const texts = (root, sel) => [...root.querySelectorAll(sel)].map((e) => e.textContent.trim());
  return {
    prompts: code.map((w) => (w.node.querySelector('.jp-InputPrompt')?.textContent || '').trim()),
    kernel: panel.sessionContext?.session?.kernel?.status || null,
    tables: [...nb.node.querySelectorAll('table.mgtutorial-ranks')].map(
      (table) => ({heads: texts(table, 'th'), columns: texts(table, 'td'),
                   note: table.nextElementSibling?.textContent || ''})),
    errors: texts(nb.node, '[data-mime-type="application/vnd.jupyter.stderr"]'),
  };
}
"""


def write_notebook(path) -> None:
    cells = [
        {"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [], "source": c}
        for c in CELLS
    ]
    kernel = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
    notebook = {"cells": cells, "metadata": {"kernelspec": kernel}, "nbformat": 4}
    path.write_text(json.dumps({**notebook, "nbformat_minor": 4}))


def open_notebook(page, lab) -> None:
    page.goto(f"{lab.url}/lab/tree/{NOTEBOOK}?token={lab.token}", wait_until="domcontentloaded")
    page.wait_for_function("() => !!window.jupyterapp", timeout=60_000)
    page.evaluate("() => window.jupyterapp.restored.then(() => true)")
    page.wait_for_selector("#jupyterlab-splash", state="detached", timeout=60_000)
    deadline = time.monotonic() + 60
    while page.evaluate(STATE)["kernel"] != "idle":
        dialog = page.locator(".jp-Dialog:has-text('Select Kernel') .jp-mod-accept")
        if dialog.count():
            dialog.first.click()
        assert time.monotonic() < deadline, f"no idle kernel in 60 s:\n{lab.log_tail()}"
        time.sleep(0.25)


def run_all(page) -> dict:
    page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")
    deadline = time.monotonic() + DEADLINE_S
    while True:
        state = page.evaluate(STATE)
        done = all(p.startswith("[") and p[1:-2].isdigit() for p in state["prompts"])
        if done and state["kernel"] == "idle":
            return state
        assert time.monotonic() < deadline, f"not done in {DEADLINE_S} s: {state}"
        time.sleep(0.5)


def test_a_ranks_cell_shows_both_ranks_in_jupyterlab(chromium, lab, artifacts):
    sync_api = pytest.importorskip(
        "playwright.sync_api",
        reason="Playwright for Python is not installed (pip install -e '.[e2e]')",
    )
    shots = artifacts / "ranks"  # beside the other test's files, which its fixture would empty
    shots.mkdir(exist_ok=True)
    write_notebook(lab.notebook_dir / NOTEBOOK)
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(**chromium)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 800})
            open_notebook(page, lab)
            state = run_all(page)
            page.locator("table.mgtutorial-ranks").last.scroll_into_view_if_needed()
            page.screenshot(path=str(shots / "ranks-columns.png"))
        finally:
            browser.close()
    left = lab.shutdown()

    assert not state["errors"], state["errors"]
    assert len(state["tables"]) == 2, state
    ok, late = state["tables"]
    assert ok["heads"] == late["heads"] == ["rank 0", "rank 1"], state
    assert ok["columns"] == ["rank 0 of 2 holds 1", "rank 1 of 2 holds 1"], state
    assert "it is waiting in:" in late["columns"][0] and "dist.barrier()" in late["columns"][0]
    assert late["columns"][1] == "(no output)" and "The pool was restarted" in late["note"]
    assert not left, "processes left after JupyterLab shut down:\n" + "\n".join(c for _, c in left)
