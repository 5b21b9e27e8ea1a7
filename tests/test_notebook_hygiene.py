"""Hygiene of the committed notebooks: executed top to bottom, with outputs, errors only where
intended, short cells, a Summary and Exercises, the final live-plot figure saved, no machine paths.

Each check is a function returning a list of problems; the tests run them on every notebook in
notebooks/ and, to show that they can fail, on a notebook built with each fault. The check that
no rank process survives the session lives in the repository's conftest.py (tests/test_procs.py).
"""

from __future__ import annotations

import base64
import re
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import psutil
import pytest

from mgtutorial.workshop.edition import exercises_start

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
CHAPTERS = (
    "00_setup",
    "01_single_device",
    "02_ddp",
    "03a_collectives",
    "03b_ddp_internals",
    "03c_ddp_pitfalls",
    "04a_pipeline_gpipe",
    "04b_pipeline_schedules",
    "04z_appendix_delays",
    "05a_torchrun_multinode",
    "05b_elastic_restarts",
    "05c_hangs_and_debugging",
    "06a_article_ddp",
    "06b_article_model_parallel",
    "07a_zero_memory",
    "07b_fsdp2",
    "08a_tensor_parallel",
    "08b_tp_mesh_and_cost",
    "09a_cost_model",
    "09b_measurement",
    "10a_context_parallel",
    "10b_expert_parallel",
)
WITH_LIVE_PLOT = ("01_single_device", "02_ddp")
MAX_LINES = 30
MAX_CELLS = 45  # the lesson, up to the "## Exercises" heading (STYLE.md 17: one sitting)
MAX_EXERCISE_CELLS = 20
MAX_WORDS = 2500  # of prose in the lesson, up to the "## Exercises" heading
_WORD = re.compile(r"[A-Za-z0-9][\w'’-]*")
CHECK_MARK = "# NBVAL_CHECK_OUTPUT"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def code_cells(nb):
    return [c for c in nb.cells if c.cell_type == "code"]


def tags(cell) -> list[str]:
    return list(cell.get("metadata", {}).get("tags", []))


def output_text(output) -> str:
    """Everything readable in one output: stream text, text/* data, error name, message and
    traceback."""
    if output.output_type == "stream":
        return output.text
    if output.output_type == "error":
        return "\n".join([output.ename, output.evalue, *output.traceback])
    return "\n".join(v for k, v in output.get("data", {}).items() if k.startswith("text/"))


# --- checks ------------------------------------------------------------------------------------


def check_kernel(nb) -> list[str]:
    name = nb.metadata.get("kernelspec", {}).get("name")
    return [] if name == "python3" else [f"kernelspec name is {name!r}, not 'python3'"]


def check_executed(nb) -> list[str]:
    """Every code cell ran, the outputs were kept, and every cell that watches a run shows it."""
    problems = []
    for i, cell in enumerate(code_cells(nb)):
        if cell.execution_count is None:
            problems.append(f"code cell {i} was not executed")
        if "watch(" in cell.source and not cell.outputs:
            problems.append(f"code cell {i} watches a training run but has no output")
    if code_cells(nb) and not any(cell.outputs for cell in code_cells(nb)):
        problems.append("no code cell has any output (committed without outputs?)")
    return problems


def check_execution_order(nb) -> list[str]:
    counts = [c.execution_count for c in code_cells(nb)]
    if counts != list(range(1, len(counts) + 1)):
        return [
            f"execution counts {counts} are not 1…{len(counts)} in order "
            "(run top to bottom in a fresh kernel)"
        ]
    return []


def check_errors(nb) -> list[str]:
    """No cell raises: a deliberate error is caught in its cell and its type and message printed.

    A raising cell makes JupyterLab's Run All reset the prompts of every queued cell to ``[ ]``
    while the kernel goes on running them, so the long cells after it look dead.
    """
    problems = []
    for i, cell in enumerate(code_cells(nb)):
        if any(o.output_type == "error" for o in cell.outputs):
            problems.append(
                f"code cell {i} has an error output: catch the error and print it instead"
            )
        if "raises-exception" in tags(cell):
            problems.append(
                f"code cell {i} is tagged 'raises-exception': catch the error in the cell"
            )
    return problems


def check_cell_count(nb) -> list[str]:
    """A lesson is one sitting: at most MAX_CELLS cells before its Exercises;
    the exercises (done in a workshop's lab time) at most MAX_EXERCISE_CELLS."""
    start = exercises_start(nb)
    lesson = len(nb.cells) if start is None else start
    problems = (
        [f"{lesson} lesson cells (at most {MAX_CELLS}): split the chapter"]
        if lesson > MAX_CELLS
        else []
    )
    if start is not None and (n := len(nb.cells) - start) > MAX_EXERCISE_CELLS:
        problems.append(f"{n} exercise cells (at most {MAX_EXERCISE_CELLS})")
    return problems


def prose_words(nb) -> int:
    """Words of the Markdown cells of the lesson (before the Exercises)."""
    start = exercises_start(nb)
    lesson = nb.cells if start is None else nb.cells[:start]
    return sum(len(_WORD.findall(c.source)) for c in lesson if c.cell_type == "markdown")


def check_prose_length(nb, limit: int = MAX_WORDS) -> list[str]:
    """A lesson is one sitting: at most MAX_WORDS words of prose before its Exercises."""
    n = prose_words(nb)
    return (
        [f"{n} words of prose in the lesson (at most {limit}): shorten or split"]
        if n > limit
        else []
    )


_EXERCISE = re.compile(r"^### Exercise (\d\d[a-c]?\.\d+) — .+ \(≈ \d+ min\)$", re.M)


def check_exercises(nb) -> list[str]:
    """Each exercise: a '### Exercise NN.k — title (≈ N min)' heading, a solution between markers,
    and one checker cell (marked for nbval) printing one '✓ NN.k …' line. A checker cell is one that
    calls a checker (``ex.chNN…``) or whose output holds a ✓ line: nbval compares its output, so
    the solution must still print that line."""
    start = exercises_start(nb)
    if start is None:
        return []
    problems, current, seen = [], None, {}
    for cell in nb.cells[start:]:
        if cell.cell_type == "markdown":
            for heading in re.findall(r"^### .*$", cell.source, re.M):
                if not (m := _EXERCISE.match(heading)):
                    problems.append(
                        f"heading {heading!r} is not '### Exercise NN.k — title (≈ N min)'"
                    )
                    continue
                current = m.group(1)
                seen[current] = {"solution": False, "checks": []}
            continue
        if current is None:
            continue
        seen[current]["solution"] |= "BEGIN SOLUTION" in cell.source
        lines = output_text_all(cell).splitlines()
        ticks = [line for line in lines if line.startswith("✓ ")]
        if "ex.ch" in cell.source or ticks:
            seen[current]["checks"].append(ticks)
            if CHECK_MARK not in cell.source:
                problems.append(f"the checker cell of {current} is not marked {CHECK_MARK}")
    for number, found in seen.items():
        if not found["solution"]:
            problems.append(f"exercise {number} has no '# BEGIN SOLUTION' block")
        if [len(t) for t in found["checks"]] != [1] * max(1, len(found["checks"])):
            problems.append(f"exercise {number} has no checker cell printing exactly one '✓' line")
        elif not all(t[0].startswith(f"✓ {number} ") for t in found["checks"]):
            problems.append(
                f"exercise {number}'s checker prints {found['checks']}, not '✓ {number} …'"
            )
    return problems


def check_leftover_ranks(nb) -> list[str]:
    """A notebook that starts ranks ends by showing that none is left (launch.rank_processes)."""
    code = [c.source for c in code_cells(nb)]
    starts = any("launch(" in s or "torchrun" in s for s in code)
    if starts and not any("rank_processes(" in s for s in code[-3:]):
        return ["starts ranks but none of its last three code cells checks rank_processes()"]
    return []


def check_cell_length(nb) -> list[str]:
    return [
        f"code cell {i} has {n} lines (at most {MAX_LINES})"
        for i, cell in enumerate(code_cells(nb))
        if (n := len(cell.source.splitlines())) > MAX_LINES
    ]


def output_text_all(cell) -> str:
    return "\n".join(output_text(o) for o in cell.get("outputs", []))


def check_summary_exercises(nb) -> list[str]:
    headings = [
        line.strip("# ").strip()
        for c in nb.cells
        if c.cell_type == "markdown"
        for line in c.source.splitlines()
        if line.startswith("#")
    ]
    return [f"no '## {h}' heading" for h in ("Summary", "Exercises") if h not in headings]


def check_live_plot_figure(nb) -> list[str]:
    """Each cell that calls watch() ends with a real PNG and no leftover live widget."""
    problems = []
    for i, cell in enumerate(code_cells(nb)):
        if "watch(" not in cell.source:
            continue
        pngs = [o.data["image/png"] for o in cell.outputs if "image/png" in o.get("data", {})]
        if not pngs or not base64.b64decode(pngs[-1]).startswith(PNG_MAGIC):
            problems.append(f"code cell {i} calls watch() but has no final PNG figure")
        if any(
            "application/vnd.jupyter.widget-view+json" in o.get("data", {}) for o in cell.outputs
        ):
            problems.append(
                f"code cell {i} still holds the live widget instead of the final figure"
            )
    return problems


_ABSOLUTE = re.compile(r"(?<![\w.])/(home|root|work|tmp|Users|private|var/folders)/\S*")


def check_no_machine_paths(nb) -> list[str]:
    """No output shows where the repository, the home directory or a temporary folder is on the
    executing machine (the notebook was executed elsewhere than where it is read)."""
    needles = {str(ROOT), str(Path.home())} - {"/"}
    problems = [
        f"code cell {i} output contains {needle!r}"
        for i, cell in enumerate(code_cells(nb))
        for o in cell.outputs
        for needle in needles
        if needle in output_text(o)
    ]
    return problems + [
        f"code cell {i} output shows the absolute path {m.group(0)!r}"
        for i, cell in enumerate(code_cells(nb))
        for o in cell.outputs
        if (m := _ABSOLUTE.search(output_text(o)))
    ]


_VOLATILE = re.compile(
    r"\d{8}-\d{6}|\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}|\bpid \d+"
    r"|(?<![\w.])/(home|root|work|tmp|Users)/"
)


def check_checked_cells_stable(nb) -> list[str]:
    """Cells whose output nbval compares show no run-directory stamps, dates, pids or absolute
    paths."""
    return [
        f"checked code cell {i} shows something that varies between runs: {m.group(0)!r}"
        for i, cell in enumerate(code_cells(nb))
        if CHECK_MARK in cell.source
        for o in cell.outputs
        if (m := _VOLATILE.search(output_text(o)))
    ]


def check_writefile_fresh(nb) -> list[str]:
    """A %%writefile cell's output reads "Writing …": the notebook was executed without a stale
    exercise file from an earlier run beside it (whose leftover the next run would overwrite)."""
    return [
        f"code cell {i} overwrote an existing file: remove notebooks/ex*.py and re-execute"
        for i, cell in enumerate(code_cells(nb))
        if cell.source.startswith("%%writefile")
        and any(output_text(o).startswith("Overwriting ") for o in cell.get("outputs", []))
    ]


CHECKS = [
    check_kernel,
    check_executed,
    check_execution_order,
    check_errors,
    check_cell_length,
    check_cell_count,
    check_exercises,
    check_leftover_ranks,
    check_summary_exercises,
    check_live_plot_figure,
    check_no_machine_paths,
    check_checked_cells_stable,
    check_writefile_fresh,
]


# --- tests on the committed notebooks ----------------------------------------------------------


def test_chapters_present():
    names = {p.stem for p in NOTEBOOKS}
    assert set(CHAPTERS) <= names, f"missing notebooks: {sorted(set(CHAPTERS) - names)}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_prose_length(path):
    nb = nbformat.read(path, as_version=4)
    problems = check_prose_length(nb)
    assert not problems, f"{path.name}: {problems[0]}"


def test_prose_length_check_can_fail():
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("word " * (MAX_WORDS + 1))]
    assert check_prose_length(nb) and not check_prose_length(nb, MAX_WORDS + 1)


@pytest.mark.parametrize("check", CHECKS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook(path, check):
    nb = nbformat.read(path, as_version=4)
    problems = check(nb)
    assert not problems, f"{path.name}:\n  " + "\n  ".join(problems)


@pytest.mark.parametrize("name", WITH_LIVE_PLOT)
def test_live_plot_figure_committed(name):
    nb = nbformat.read(ROOT / "notebooks" / f"{name}.ipynb", as_version=4)
    watching = [c for c in code_cells(nb) if "watch(" in c.source]
    assert watching, f"{name} has no cell that calls watch()"
    assert not check_live_plot_figure(nb)


# --- the checks can fail ------------------------------------------------------------------------


def _bad_notebook():
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python2"}
    png = base64.b64encode(PNG_MAGIC + b"rest").decode()
    widget = {"application/vnd.jupyter.widget-view+json": {"model_id": "x"}, "text/plain": "VBox()"}
    cells = [
        nbformat.v4.new_code_cell("result = watch(launch(worker, cfg, 2))", execution_count=2),
        nbformat.v4.new_code_cell(
            "result = watch(run)",
            execution_count=1,
            outputs=[nbformat.v4.new_output("display_data", data=widget)],
        ),
        nbformat.v4.new_code_cell(
            "1 / 0",
            execution_count=None,
            outputs=[
                nbformat.v4.new_output(
                    "error", ename="ZeroDivisionError", evalue="division by zero", traceback=[]
                )
            ],
        ),
        nbformat.v4.new_code_cell("\n".join(["x = 1"] * (MAX_LINES + 1)), execution_count=4),
        nbformat.v4.new_code_cell("pass", execution_count=5),
        nbformat.v4.new_code_cell(
            f"{CHECK_MARK}\nprint(run)",
            execution_count=6,
            outputs=[
                nbformat.v4.new_output(
                    "stream",
                    name="stdout",
                    text=f"{ROOT}/notebooks/runs/ddp-20260101-120000-ab12 pid 7\n",
                )
            ],
        ),
        nbformat.v4.new_code_cell(
            "print(tmp)",
            execution_count=8,
            outputs=[
                nbformat.v4.new_output("stream", name="stdout", text="saved in /tmp/x1y2/ckpt.pt\n")
            ],
        ),
        nbformat.v4.new_code_cell(
            "watch(run)",
            execution_count=7,
            outputs=[nbformat.v4.new_output("display_data", data={"image/png": png})],
        ),
        nbformat.v4.new_code_cell(
            "%%writefile ex09_old.py\nx = 1",
            execution_count=10,
            outputs=[
                nbformat.v4.new_output("stream", name="stdout", text="Overwriting ex09_old.py\n")
            ],
        ),
        nbformat.v4.new_markdown_cell("## Recap\nno Summary heading"),
    ]
    exercises = [
        nbformat.v4.new_markdown_cell("## Exercises\n\n### Exercise 9.1 without a time"),
        nbformat.v4.new_markdown_cell(
            "### Exercise 09.2 — no solution, unmarked checker (≈ 5 min)"
        ),
        nbformat.v4.new_code_cell(
            "ex.ch09.two()",
            execution_count=9,
            outputs=[nbformat.v4.new_output("stream", name="stdout", text="✓ 09.2 x\n✓ 09.2 y\n")],
        ),
    ]
    cells[4].metadata["tags"] = ["raises-exception"]
    cells += [nbformat.v4.new_markdown_cell("one more paragraph") for _ in range(MAX_CELLS)]
    nb.cells = cells + exercises
    return nb


@pytest.mark.parametrize("check", CHECKS, ids=lambda f: f.__name__)
def test_check_catches_fault(check):
    assert check(_bad_notebook()), f"{check.__name__} found nothing wrong in a faulty notebook"


def test_clean_notebook_passes():
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3"}
    png = base64.b64encode(PNG_MAGIC + b"rest").decode()
    nb.cells = [
        nbformat.v4.new_code_cell(
            "result = watch(run)",
            execution_count=1,
            outputs=[nbformat.v4.new_output("display_data", data={"image/png": png})],
        ),
        nbformat.v4.new_markdown_cell("## Summary\n\n## Exercises"),
    ]
    assert all(not check(nb) for check in CHECKS)


# --- the session-end leftover-process check in conftest.py ------------------------------------


LEAVES_A_RANK = """
import subprocess, sys


def test_leaves_a_rank_running():
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "mgtutorial-{tag}"])
"""


def _workers() -> list[list[str]]:
    """Serial, and under pytest-xdist where it is installed (each worker is a session of its
    own)."""
    try:
        import xdist  # noqa: F401
    except ImportError:
        return [[]]
    return [[], ["-n", "2"]]


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("args", _workers(), ids=lambda a: "xdist" if a else "serial")
def test_a_session_that_leaves_a_rank_fails_and_names_it(tmp_path, args):
    tag = f"leftover-{time.monotonic_ns()}"
    (tmp_path / "conftest.py").write_text((ROOT / "conftest.py").read_text())
    (tmp_path / "test_leaves.py").write_text(LEAVES_A_RANK.format(tag=tag))
    try:
        out = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args, "."],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=100,
        )
        assert out.returncode == 1, out.stdout + out.stderr
        assert "1 passed" in out.stdout and "1 rank process(es) still running" in out.stdout
        assert f"mgtutorial-{tag}" in out.stdout, out.stdout
        assert not [p for p in psutil.process_iter(["cmdline"]) if tag in str(p.info["cmdline"])]
    finally:
        for p in psutil.process_iter(["cmdline"]):
            if f"mgtutorial-{tag}" in (p.info["cmdline"] or []):
                p.kill()


# --- printed package source is the package's current source ------------------------------------

_HEADER = re.compile(r"^(\s*)(?:async def|def|class) (\w+)\b")


def printed_source_blocks(text: str) -> list[tuple[str, list[str]]]:
    """(name, lines) of each ``def``/``class`` block in a cell's output: the header and the lines
    after it that are indented by 4 more, blank, or close a signature (``) -> …:``)."""
    lines, blocks, i = text.splitlines(), [], 0
    while i < len(lines):
        m = _HEADER.match(lines[i])
        if not m:
            i += 1
            continue
        indent, block = len(m[1]), [lines[i]]
        i += 1
        while i < len(lines):
            line = lines[i]
            deeper = len(line) - len(line.lstrip()) >= indent + 4  # a body is 4 deeper
            if line.strip() and not deeper and not line.lstrip().startswith(")"):
                break
            block.append(line)
            i += 1
        blocks.append((m[2], block))
    return blocks


def _package_lines() -> dict[str, list[list[str]]]:
    """Each ``def``/``class`` name of the package mapped to the non-blank stripped lines of each of
    its definitions (header to last line, decorators left out), as ``inspect.getsource`` prints
    them."""
    import ast

    defined = {}
    for path in (ROOT / "mgtutorial").rglob("*.py"):
        text = path.read_text()
        lines = text.splitlines()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                body = lines[node.lineno - 1 : node.end_lineno]
                defined.setdefault(node.name, []).append([x.strip() for x in body if x.strip()])
    return defined


def check_printed_source(nb) -> list[str]:
    """Every ``def``/``class`` block a cell printed (with ``inspect.getsource``), for a name the
    package defines, is line for line one of that name's definitions: a changed, added or dropped
    line shows the notebook was not re-executed after the package changed. Blocks the cell elided
    (``…``, or a line that starts ``...``) need only each line they kept to be in the definition."""
    defined = _package_lines()
    problems = []
    for i, cell in enumerate(code_cells(nb)):
        if "getsource" not in cell.source:
            continue
        for name, block in printed_source_blocks(output_text_all(cell)):
            if name not in defined:
                continue  # torch's source, or a learner's
            lines = [line.strip() for line in block if line.strip()]
            elided = ["…" in line or line.startswith("...") for line in lines]
            if any(elided):
                kept = [line for line, cut in zip(lines, elided) if not cut]
                ok = any(set(kept) <= set(f) for f in defined[name])
            else:
                ok = lines in defined[name]
            if not ok:
                problems.append(
                    f"code cell {i} prints {name}, which is not the package's current source "
                    "(re-execute the notebook)"
                )
    return problems


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_printed_package_source_is_current(path):
    problems = check_printed_source(nbformat.read(path, as_version=4))
    assert not problems, f"{path.name}:\n  " + "\n  ".join(problems)


def test_printed_source_check_finds_a_stale_line():
    nb = nbformat.v4.new_notebook()
    stale = "def build_stage(cfg, stage, num_stages):\n    return whole_model_on_every_rank()\n"
    nb.cells = [
        nbformat.v4.new_code_cell(
            "print(inspect.getsource(schedules.build_stage))",
            outputs=[nbformat.v4.new_output("stream", name="stdout", text=stale)],
        )
    ]
    assert check_printed_source(nb)
    import inspect

    from mgtutorial.pipeline import simulated

    current = inspect.getsource(simulated.box_seconds)
    nb.cells[0].outputs[0].text = current
    assert not check_printed_source(nb)  # the package's own source passes
    nb.cells[0].outputs[0].text = current.replace("    return forward_s, 2 * forward_s\n", "")
    assert check_printed_source(nb)  # a line the print lacks is caught too
    assert printed_source_blocks("def f(\n    x,\n) -> int:\n    return x\nafter") == [
        ("f", ["def f(", "    x,", ") -> int:", "    return x"])
    ]


# --- notebooks named by file ----------------------------------------------------------------------

_NOTEBOOK_NAME = re.compile(r"\b\d{2}[a-z]?_[a-z0-9_]+\.ipynb\b")


def missing_notebooks(text: str, existing: set[str]) -> list[str]:
    """The notebook file names (``07b_fsdp2.ipynb``) that ``text`` names and ``existing`` lacks:
    a chapter renamed or split leaves its old name behind in prose, docstrings and commands."""
    return sorted(set(_NOTEBOOK_NAME.findall(text)) - existing)


def test_every_named_notebook_exists():
    existing = {p.name for p in NOTEBOOKS}
    sources = [
        *NOTEBOOKS,
        *ROOT.glob("*.md"),
        ROOT / "Makefile",
        *(ROOT / "book").rglob("*.*"),
        *(ROOT / "mgtutorial").rglob("*.py"),
        *(ROOT / "scripts").rglob("*.*"),
        *(ROOT / "benchmarks").rglob("*.py"),
    ]
    problems = [
        f"{src.relative_to(ROOT)} names {name}"
        for src in sources
        if src.is_file() and src.suffix not in (".png", ".pyc")
        for name in missing_notebooks(src.read_text(errors="replace"), existing)
    ]
    assert not problems, "no such notebook:\n  " + "\n  ".join(problems)


def test_named_notebook_check_finds_an_old_name():
    existing = {p.name for p in NOTEBOOKS}
    text = "saving it (chapter 07, `07_sharding.ipynb`); see [07b](07b_fsdp2.ipynb)"
    assert missing_notebooks(text, existing) == ["07_sharding.ipynb"]
