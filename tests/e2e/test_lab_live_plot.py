"""Chapter 02 in a real JupyterLab in a real browser: what a learner sees, not only what the kernel
does.

Headless Debian Chromium, driven by Playwright for Python, opens ``02_ddp.ipynb`` in a private
JupyterLab (see conftest.py), runs every cell and checks that the live plot rendered as an image
(not "Loading widget..." or an error), that it was redrawn several times while the ranks trained,
that the final figure replaced it and shows a curve per rank, that no cell failed, and that no
process JupyterLab started outlives it. Screenshots go to test-artifacts/e2e/.

nbval runs the notebooks' kernels (``make test``); this test is the only one that runs the widget
front end. It never calls nbval, and its notebook copy lives outside the folders pytest collects.
"""

from __future__ import annotations

import base64
import json
import re
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(420)]

NOTEBOOK = "02_ddp.ipynb"
TRAIN_CELL_MARK = "watch(run)"  # the cell that trains and shows the live plot
RUN_DIR = re.compile(r"^ddp-\d{8}-\d{6}-[0-9a-f]{4}$")  # launch(..., name="ddp")
MIN_DISTINCT_IMAGES = 3
NOTEBOOK_DEADLINE_S = 330  # to run all cells, counted from "run all" (the test has 420 s in all)
STDERR = "application/vnd.jupyter.stderr"

# Counts the live plot's redraws: every data: image that appears inside the widget's output area
# (added, or its src replaced) is hashed; distinct hashes are distinct pictures.
COUNT_LIVE_IMAGES = """
(() => {
  const state = {hashes: new Set(), events: 0};
  window.__e2eLivePlot = state;
  const hash = (s) => {
    let h = 0x811c9dc5;
    for (let i = 0; i < s.length; i++) { h ^= s.charCodeAt(i); h = Math.imul(h, 0x01000193); }
    return (h >>> 0).toString(16) + ':' + s.length;
  };
  const see = (img) => {
    const src = img.getAttribute('src') || '';
    if (!src.startsWith('data:image/') || !img.closest('.widget-output')) return;
    state.events += 1;
    state.hashes.add(hash(src));
  };
  const scan = (node) => {
    if (node.nodeType !== 1) return;
    if (node.tagName === 'IMG') see(node);
    node.querySelectorAll('img').forEach(see);
  };
  new MutationObserver((records) => {
    for (const r of records) {
      if (r.type === 'attributes') scan(r.target); else r.addedNodes.forEach(scan);
    }
  }).observe(document,
             {subtree: true, childList: true, attributes: true, attributeFilter: ['src']});
})();
"""

LIVE_COUNT = (
    "() => ({distinct: window.__e2eLivePlot.hashes.size, events: window.__e2eLivePlot.events})"
)

# The open notebook's state as a learner sees it: prompts, errors, and the training cell's output.
NOTEBOOK_STATE = """
(mark) => {
  const panel = window.jupyterapp.shell.currentWidget;
  const nb = panel.content;
  const code = nb.widgets.filter((w) => w.model.type === 'code');
  const prompts = code.map(
    (w) => (w.node.querySelector('.jp-InputPrompt')?.textContent || '').trim());
  const train = code.find((w) => w.model.sharedModel.getSource().includes(mark));
  if (train) train.node.setAttribute('data-e2e', 'train');
  code.forEach((w, i) => w.node.toggleAttribute('data-e2e-running', prompts[i].includes('*')));
  const texts = (sel, root) =>
    [...(root || nb.node).querySelectorAll(sel)].map((e) => e.textContent);
  const out = train ? train.node.querySelector('.jp-Cell-outputArea') : null;
  return {
    prompts,
    kernel: panel.sessionContext?.session?.kernel?.status || null,
    tracebacks: texts('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]')
      .filter((t) => t.includes('Traceback')),
    // an error's 'Type: message' line, not the word in code
    errorTexts: texts('.jp-RenderedText').filter((t) => t.split(String.fromCharCode(10))
      .some((l) => /^[A-Za-z_.]*(Error|Exception): /.test(l))),
    widgetTrouble: texts('.jp-OutputArea-output').filter(
      (t) => t.includes('Loading widget') || t.includes('Error displaying widget')),
    train: out && {
      liveImgs: [...out.querySelectorAll('.widget-output img')]
        .map((i) => i.getAttribute('src') || ''),
      imgs: [...out.querySelectorAll('img')].map((i) => i.getAttribute('src') || ''),
      widgets: out.querySelectorAll('.jupyter-widgets').length,
      text: out.textContent,
    },
  };
}
"""


def _numbered(prompt: str) -> bool:
    return re.fullmatch(r"\[\d+\]:?", prompt) is not None


def _shot(
    page, folder: Path, name: str, where: str = "[data-e2e=train]", block: str = "center"
) -> None:
    """Screenshot of the page with the element ``where`` (a CSS selector) scrolled into view.

    Lab lays out cells outside the view lazily (CSS content-visibility), so the first scroll lands
    on estimated heights: scroll, let the layout settle, scroll again."""
    for _ in range(2):
        page.evaluate(
            "([sel, block]) => document.querySelector(sel)?.scrollIntoView({block})", [where, block]
        )
        page.wait_for_timeout(400)
    page.screenshot(path=str(folder / name))


def _open_notebook(page, lab) -> None:
    page.goto(f"{lab.url}/lab/tree/{NOTEBOOK}?token={lab.token}", wait_until="domcontentloaded")
    # The splash screen is added by the app's scripts: wait for the app, its layout, then the
    # splash.
    page.wait_for_function("() => !!window.jupyterapp", timeout=60_000)
    page.evaluate("() => window.jupyterapp.restored.then(() => true)")
    page.wait_for_selector("#jupyterlab-splash", state="detached", timeout=60_000)
    deadline = time.monotonic() + 60
    while True:  # until the notebook is current and its kernel answers
        dialog = page.locator(".jp-Dialog:has-text('Select Kernel') .jp-mod-accept")
        if dialog.count():  # accept the proposed kernel (python3)
            dialog.first.click()
        status = page.evaluate(
            "() => { const w = window.jupyterapp.shell.currentWidget;"
            " return w && w.sessionContext"
            " ? (w.sessionContext.session?.kernel?.status || 'none') : null; }"
        )
        if status == "idle":
            return
        if time.monotonic() > deadline:
            dialogs = page.locator(".jp-Dialog").all_inner_texts()
            raise AssertionError(
                f"{NOTEBOOK} did not get an idle kernel in 60 s (status {status}, "
                f"dialogs {dialogs}):\n{lab.log_tail()}"
            )
        time.sleep(0.25)


def _run_all_and_wait(page, folder: Path, n_code: int) -> dict:
    """Clears the outputs, runs all cells and waits until every code cell has a number (twice in a
    row, a second apart); takes the screenshots of the live plot on the way."""
    page.evaluate("() => window.jupyterapp.commands.execute('notebook:clear-all-cell-outputs')")
    # Not awaited: the command's promise settles only when every cell has run.
    page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")
    start = time.monotonic()
    deadline = start + NOTEBOOK_DEADLINE_S
    shots, done_since, stalled_since, first_live_s = set(), None, None, None
    early_texts: list[str] = []  # the training cell's output before a live image showed, if ever
    finished: dict[
        int, float
    ] = {}  # code cell index -> seconds after "run all" when first seen numbered
    while True:
        state = page.evaluate(NOTEBOOK_STATE, TRAIN_CELL_MARK)
        live = page.evaluate(LIVE_COUNT)
        live_now = bool(state["train"] and state["train"]["liveImgs"])  # the widget shows an image
        if state["train"] and not shots and state["train"]["text"].strip():
            early_texts[:] = [*early_texts[-2:], state["train"]["text"].strip()[:200]]
        for i, p in enumerate(state["prompts"]):
            if _numbered(p):
                finished.setdefault(i, time.monotonic() - start)
        if live_now and "first" not in shots:
            shots.add("first")
            first_live_s = time.monotonic() - start
            _shot(page, folder, "01-live-plot-first-image.png")
        if live_now and live["distinct"] >= 4 and "later" not in shots:
            _shot(page, folder, "02-live-plot-after-updates.png")
            shots.add("later")
        prompts = state["prompts"]
        assert len(prompts) == n_code, (
            f"{len(prompts)} code cells on the page, {n_code} in the file"
        )
        running = any("*" in p for p in prompts)
        if not running and all(_numbered(p) for p in prompts):
            done_since = done_since or time.monotonic()
            if time.monotonic() - done_since >= 1.0:  # seen done twice in a row, a second apart
                state.update(
                    live=live,
                    shots=shots,
                    finished=finished,
                    first_live_s=first_live_s,
                    early_texts=early_texts,
                )
                return state
        else:
            done_since = None
        # "Run all" stops at the first error: then some cells stay unnumbered with nothing running.
        if not running and state["tracebacks"] and any(_numbered(p) for p in prompts):
            stalled_since = stalled_since or time.monotonic()
            if time.monotonic() - stalled_since > 5:
                _shot(
                    page,
                    folder,
                    "99-error.png",
                    f".jp-OutputArea-output[data-mime-type='{STDERR}']",
                )
                raise AssertionError(
                    f"a cell failed; prompts {prompts}:\n" + "\n".join(state["tracebacks"])
                )
        if time.monotonic() > deadline:
            _shot(page, folder, "99-timeout.png", "[data-e2e-running]")
            raise AssertionError(
                f"the notebook did not finish in {NOTEBOOK_DEADLINE_S} s; prompts {prompts}, "
                f"kernel {state['kernel']}"
            )
        time.sleep(0.5)


def _training_run(notebook_dir: Path) -> Path:
    runs = sorted(
        (d for d in (notebook_dir / "runs").iterdir() if RUN_DIR.match(d.name)),
        key=lambda d: d.stat().st_mtime,
    )
    assert runs, f"no runs/ddp-<time>-<id> directory in {notebook_dir / 'runs'}"
    return runs[-1]


def test_chapter_02_live_plot_in_jupyterlab(chromium, lab, artifacts):
    sync_api = pytest.importorskip(
        "playwright.sync_api",
        reason="Playwright for Python is not installed "
        "(pip install -e '.[e2e]'; `make test` does it)",
    )
    nb_file = lab.notebook_dir / NOTEBOOK
    n_code = sum(c["cell_type"] == "code" for c in json.loads(nb_file.read_text())["cells"])
    started = time.monotonic()
    console = []
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(**chromium)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1000})
            page.on("console", lambda m: console.append(f"{m.type}: {m.text}"))
            page.on("pageerror", lambda e: console.append(f"pageerror: {e}"))
            page.add_init_script(COUNT_LIVE_IMAGES)
            _open_notebook(page, lab)
            opened = time.monotonic()
            state = _run_all_and_wait(page, artifacts, n_code)
            ran = time.monotonic()
            _shot(page, artifacts, "03-final-figure.png")
            _shot(page, artifacts, "04-notebook-end.png", ".jp-Notebook .jp-Cell:last-child", "end")
        finally:
            (artifacts / "browser-console.log").write_text("\n".join(console))
            browser.close()
    left = lab.shutdown()  # kernels through the REST API, then the server

    live, train = state["live"], state["train"]
    done = state["finished"]
    durations = {
        i: t - max([done[j] for j in done if done[j] < t] or [0.0]) for i, t in done.items()
    }
    slowest = ", ".join(
        f"cell {i + 1}: {d:.0f} s" for i, d in sorted(durations.items(), key=lambda x: -x[1])[:3]
    )
    print(
        f"\nJupyterLab open in {opened - started:.0f} s; notebook ran in {ran - opened:.0f} s "
        f"(slowest code cells: {slowest}); "
        f"first live image after {state['first_live_s'] or 0:.0f} s"
    )
    print(f"live plot: {live['distinct']} distinct images in {live['events']} image updates")
    print(
        f"JupyterLab started {len(lab.recorder.seen)} processes; left after shutdown: {len(left)}"
    )
    print(f"screenshots: {artifacts}")

    assert not left, (
        "processes JupyterLab started were still running after shutdown (now killed):\n"
        + "\n".join(f"  pid {p.pid}: {cmd[:200]}" for p, cmd in left)
    )
    # The kernel is this environment's python (cell "torchrun" finds torchrun next to it).
    kernels = [c for c in lab.recorder.cmdlines.values() if "ipykernel_launcher" in c]
    assert kernels, f"no kernel process was seen among {list(lab.recorder.cmdlines.values())}"
    assert all(Path(c.split()[0]).parent == Path(sys.executable).parent for c in kernels), kernels

    assert not state["tracebacks"], "\n".join(state["tracebacks"])
    assert not state["errorTexts"], "\n".join(state["errorTexts"])
    assert not state["widgetTrouble"], state["widgetTrouble"]

    # The live plot rendered as an image inside the widget, and was redrawn while the ranks trained.
    assert train is not None, f"no code cell contains {TRAIN_CELL_MARK!r}"
    assert "first" in state["shots"], (
        f"the live widget was never seen showing an image; the cell showed: {state['early_texts']}"
    )
    assert live["distinct"] >= MIN_DISTINCT_IMAGES, (
        f"the live plot showed {live['distinct']} distinct image(s), "
        f"expected at least {MIN_DISTINCT_IMAGES}"
    )

    # The final figure replaced the widget in place: one plain PNG, no widget left, no duplicate.
    assert train["widgets"] == 0 and not train["liveImgs"], (
        "the live widget is still shown after the run"
    )
    assert len(train["imgs"]) == 1, (
        f"{len(train['imgs'])} images in the training cell's output, expected 1"
    )
    run_dir = _training_run(lab.notebook_dir)
    nprocs = json.loads((run_dir / "config.json").read_text())["nprocs"]
    assert nprocs >= 2 and f"ranks alive 0/{nprocs}" in train["text"], train["text"][-500:]

    # ... and it is the run's loss.png, drawn from the logs of every rank: a curve per rank.
    png = (run_dir / "loss.png").read_bytes()
    assert train["imgs"][0] == "data:image/png;base64," + base64.b64encode(png).decode(), (
        f"the final image in the notebook is not {run_dir / 'loss.png'}"
    )
    for rank in range(nprocs):
        lines = (run_dir / f"rank{rank}.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines if line.strip()]
        ranks = {r["rank"] for r in records if r.get("kind") == "train"}
        assert ranks == {rank}, f"{run_dir.name}/rank{rank}.jsonl: train records of ranks {ranks}"
