"""Prose never outruns the cells: every figure a Markdown cell states was printed above it.

A *figure* is a number in a Markdown cell's prose that has a decimal point or three or more
significant digits (``4608``, ``0.5``, ``97.2%``, ``1,048,576``; not ``2`` ranks or ``100``
columns). Each figure must appear in the text output (stream, ``text/plain``, error) of a code
cell above it: the same value, or the value an output shows rounded to the precision the prose
prints (``16.78`` printed, ``16.8`` written). Thousands separators, a trailing ``%`` and a unit
after the number are ignored; ``97.2%`` also matches a printed ``0.972``.

Not figures: numbers inside a ``code span`` or a fenced block (code), the numbering of a heading
(``## 3. …``, ``### Exercise 02.4 …``) and references to an exercise, section or chapter
(``exercise 02.4``), a version after torch/PyTorch/Python, and every number of a sentence that
carries a Markdown link (a cited figure: the link is its source).

Comparisons: a sentence "A *more/larger/… than* B", with A and B figures carrying the same unit,
must agree with A and B (:func:`check_comparisons`). What stays unchecked: comparisons stated in
words ("about the same", "close to the ceiling"), between a figure and a value in another
sentence, or without a unit on both sides.

``PENDING`` lists, per notebook, the figures that fail today in notebooks under revision; a new
failing figure fails the test, a listed one that no longer fails is reported as a warning (remove
it from the list).
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))

# The figures that fail today in notebooks under revision, per notebook: remove each as it is
# fixed (a listed figure that no longer fails is reported as a warning), never add one.
PENDING: dict[str, set[str]] = {
    "06a_article_ddp.ipynb": {"1.1", "1.7"},
    "06b_article_model_parallel.ipynb": {"2.1", "2.2"},
}

_NUMBER = re.compile(
    r"(?<![\w.])[-−]?(?:\d{1,3}(?:[,\u202f]\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+−]?\d+)?(?!\w)(?!\.\d)"
)
_FENCE = re.compile(r"```.*?```", re.S)
_CODE = re.compile(r"`[^`\n]*`")
_COMMENT = re.compile(r"<!--.*?-->", re.S)
_HEADING_NUMBER = re.compile(r"^(#+\s*)(?:Exercise\s+)?\d+[a-z]?(?:\.\d+)*\.?", re.M)
_REFERENCE = re.compile(
    r"\b(?:[Ee]xercises?|[Ss]ections?|[Cc]hapters?|[Nn]otebooks?)\s+\d+[a-z]?(?:\.\d+)?"
    r"(?:(?:,\s*|\s+(?:and|or)\s+|–)\d+[a-z]?(?:\.\d+)?)*"
)
_VERSION = re.compile(r"\b(?:torch|PyTorch|Python|CUDA|NCCL)\s+\d+(?:\.\d+)+")
_LINK = re.compile(r"\]\([^)]+\)")
_SENTENCE_END = re.compile(r"(?<=[.!?:;])\s+(?=[A-Z*(`\[])|\n\s*\n|\n\s*[*-]\s|\n\d+\.\s")


def parse(token: str) -> float:
    return float(token.replace("−", "-").replace(",", "").replace("\u202f", ""))


def significant_digits(token: str) -> int:
    mantissa = re.split(r"[eE]", token.replace(",", "").replace("\u202f", ""))[0]
    digits = mantissa.lstrip("-−").replace(".", "")
    digits = digits.lstrip("0")
    if "." not in mantissa:
        digits = digits.rstrip("0")
    return len(digits)


def is_figure(token: str) -> bool:
    mantissa = re.split(r"[eE]", token)[0]
    return "." in mantissa or significant_digits(token) >= 3


def decimals(token: str) -> int | None:
    """Decimal places a plain figure shows; None for scientific notation (matched by digits)."""
    if re.search(r"[eE]", token):
        return None
    return len(token.split(".")[1]) if "." in token else 0


def printed_values(text: str) -> list[tuple[float, str]]:
    return [(parse(m.group(0)), m.group(0)) for m in _NUMBER.finditer(text)]


def _same_at_precision(value: float, token: str, printed: float) -> bool:
    if printed == value:
        return True
    places = decimals(token)
    if places is None:  # 3.7e-08 written as 3.7e-8: the same significant digits
        sig = max(1, significant_digits(token))
        if printed == 0:
            return value == 0
        return float(f"{printed:.{sig - 1}e}") == value
    return abs(round(printed, places) - value) < 0.5 * 10**-places * 1e-6 + 1e-12 * abs(value)


def appears(token: str, percent: bool, outputs: list[tuple[float, str]]) -> bool:
    value = parse(token)
    candidates = [value, value / 100] if percent else [value]
    if percent:  # 97.2% from 0.9722: compare at two more decimal places
        places = decimals(token)
        scaled = [(p * 100, t) for p, t in outputs]
        if places is not None and any(_same_at_precision(value, token, p) for p, _ in scaled):
            return True
    return any(_same_at_precision(c, token, p) for c in candidates for p, _ in outputs)


def prose(markdown: str) -> str:
    """The Markdown with code, comments, heading numbers, references and versions blanked."""
    text = _FENCE.sub(" ", markdown)
    text = _COMMENT.sub(" ", text)
    text = _CODE.sub(" ", text)
    text = _HEADING_NUMBER.sub(lambda m: m.group(1), text)
    text = _REFERENCE.sub(" ", text)
    return _VERSION.sub(" ", text)


def sentences(text: str) -> list[str]:
    return [s for s in _SENTENCE_END.split(text) if s and s.strip()]


def figures(markdown: str) -> list[tuple[str, bool, str]]:
    """(token, followed by %, sentence) for every figure outside a linked sentence."""
    found = []
    for sentence in sentences(prose(markdown)):
        if _LINK.search(sentence):
            continue
        for m in _NUMBER.finditer(sentence):
            token = m.group(0)
            if is_figure(token):
                after = sentence[m.end() : m.end() + 2]
                found.append((token, after.lstrip().startswith("%"), sentence))
    return found


def output_text(output) -> str:
    if output.output_type == "stream":
        return output.text
    if output.output_type == "error":
        return "\n".join([output.ename, output.evalue])
    return "\n".join(v for k, v in output.get("data", {}).items() if k.startswith("text/"))


def unprinted(nb) -> list[str]:
    """Every figure of a Markdown cell that no code cell above it printed, as 'cell i: token'."""
    printed: list[tuple[float, str]] = []
    problems = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            for o in cell.get("outputs", []):
                printed += printed_values(output_text(o))
        elif cell.cell_type == "markdown":
            for token, percent, _ in figures(cell.source):
                if not appears(token, percent, printed):
                    problems.append(f"{i}: {token}")
    return problems


_MORE = r"(?:more|larger|greater|higher|longer|slower|above|over)"
_LESS = r"(?:less|smaller|fewer|lower|shorter|faster|below|under)"
_COMPARISON = re.compile(
    rf"({_NUMBER.pattern})\s?([a-zA-Zµ%/]+)?[^.;]{{0,40}}?\b({_MORE}|{_LESS})\s+than\s+"
    rf"[^\d.;]{{0,30}}?({_NUMBER.pattern})\s?([a-zA-Zµ%/]+)?"
)


def check_comparisons(nb) -> list[str]:
    """Sentences 'A unit … more/less … than B unit' whose figures contradict the words."""
    problems = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "markdown":
            continue
        for sentence in sentences(prose(cell.source)):
            for m in _COMPARISON.finditer(sentence):
                a, unit_a, word, b, unit_b = m.groups()
                if not unit_a or unit_a != unit_b:
                    continue
                more = re.fullmatch(_MORE, word) is not None
                if (parse(a) > parse(b)) != more or parse(a) == parse(b):
                    problems.append(f"{i}: {m.group(0)!r}")
    return problems


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_figure_in_the_prose_is_printed_above_it(path):
    nb = nbformat.read(path, as_version=4)
    found, pending = unprinted(nb), PENDING.get(path.name, set())
    new = [f for f in found if f.partition(": ")[2] not in pending]
    assert not new, (
        f"{path.name}: figures in the prose that no cell above prints (print them, put code in "
        f"`code spans`, or link the source in the sentence), as 'cell: figure':\n  "
        + "\n  ".join(new)
    )
    if fixed := pending - {f.partition(": ")[2] for f in found}:
        warnings.warn(f"{path.name}: fixed, remove from PENDING: {sorted(fixed)}", stacklevel=1)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_sentences_that_compare_figures_agree_with_them(path):
    problems = check_comparisons(nbformat.read(path, as_version=4))
    assert not problems, f"{path.name}:\n  " + "\n  ".join(problems)


# --- the check can fail, and knows what is not a figure ---------------------------------------


def _notebook(*cells):
    nb = nbformat.v4.new_notebook()
    for kind, content in cells:
        if kind == "md":
            nb.cells.append(nbformat.v4.new_markdown_cell(content))
        else:
            out = nbformat.v4.new_output("stream", name="stdout", text=content)
            nb.cells.append(nbformat.v4.new_code_cell("", outputs=[out]))
    return nb


def test_a_figure_printed_below_or_nowhere_fails():
    nb = _notebook(("md", "The step takes 16.8 ms."), ("code", "step 16.78 ms\n"))
    assert unprinted(nb) == ["0: 16.8"]
    assert unprinted(_notebook(("md", "It holds 4608 values."))) == ["0: 4608"]


def test_a_figure_printed_above_passes_at_its_precision_and_in_its_forms():
    nb = _notebook(
        ("code", "step 16.78 ms · acc 0.9722 · 1,048,576 bytes · diff 3.7e-08 · −8.5\n"),
        ("md", "It takes 16.8 ms; accuracy 97.2%; 1048576 bytes; 3.7e-8 off; −8.5 ms."),
    )
    assert unprinted(nb) == []
    assert unprinted(_notebook(("code", "16.78\n"), ("md", "about 16.9 ms"))) == ["1: 16.9"]


def test_what_is_not_a_figure():
    nb = _notebook(
        (
            "md",
            "## 3. Buckets\n\n### Exercise 02.4 — x (≈ 10 min)\n\nSee exercise 03b.2 and "
            "section 1.2. Use `view(-1, 4608)` with 2 ranks, 100 columns and 25 MiB, on torch "
            "2.14.1. Goyal et al. report 4.0 ([2017](https://arxiv.org/abs/1706.02677)).\n"
            "```python\nx = 1.5\n```",
        )
    )
    assert unprinted(nb) == []


def test_a_comparison_that_contradicts_its_figures_fails():
    nb = _notebook(
        ("code", "3.8 ms 0.9 ms\n"),
        ("md", "The first takes 0.9 ms, more than the 3.8 ms of the second."),
    )
    assert check_comparisons(nb) == ["1: '0.9 ms, more than the 3.8 ms'"]
    nb.cells[1].source = "The first takes 3.8 ms, more than the 0.9 ms of the second."
    assert check_comparisons(nb) == []


def test_pending_names_only_notebooks_that_exist():
    assert set(PENDING) <= {p.name for p in NOTEBOOKS}
    assert all(PENDING.values()), "an empty PENDING entry: remove it"
