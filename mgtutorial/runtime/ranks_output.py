"""What a ``%%ranks`` cell gives back, rank by rank, and how the notebook shows it: a column per
rank (HTML), or rank after rank in plain text (what nbval compares and a terminal prints).

Taught in notebooks/00_setup.ipynb and notebooks/03a_collectives.ipynb; built by
:class:`mgtutorial.runtime.ranks_pool.RankPool`, shown by :mod:`mgtutorial.runtime.ranks_magic`.
IPython's rich display protocol (``_repr_html_`` next to ``__repr__``,
https://ipython.readthedocs.io/en/stable/config/integrating.html) puts both forms in the output.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Literal

DEFAULT_TIMEOUT_S = 5.0  # a cell's time limit unless --timeout says otherwise
Status = Literal["ok", "error", "timeout", "died"]

# JupyterLab's own colours where they exist (its stderr background), a light fallback elsewhere.
_PRE = "margin:0 0 .4em 0;padding:.2em .4em;white-space:pre-wrap;overflow-wrap:break-word"
_STDERR = "background:var(--jp-rendermime-error-background,#fdd)"
_ERROR = _STDERR + ";border-left:3px solid var(--jp-error-color1,#d32f2f)"
_VALUE = "border-left:3px solid var(--jp-brand-color1,#1976d2)"
_CELL = "vertical-align:top;text-align:left;padding:.3em .5em"


@dataclass
class RankOutput:
    """One rank's part of a cell.

    Attributes: rank; status ("ok"; "error": the cell raised; "timeout": still running at the
    limit; "died": its process ended); stdout, stderr (what the cell printed); value (the last
    expression's text, or None); error (the traceback, where the rank waits, or how it died);
    error_type (the exception's name, for "error").
    """

    rank: int
    status: Status = "ok"
    stdout: str = ""
    stderr: str = ""
    value: str | None = None
    error: str = ""
    error_type: str = ""

    @property
    def empty(self) -> bool:
        return self.status == "ok" and not (self.stdout or self.stderr or self.value is not None)

    def blocks(self) -> list[tuple[str, str]]:
        """(kind, text) in the order shown: "stdout", "stderr", "value", "error"."""
        value = None if self.value is None else "Out:" + ("\n" if "\n" in self.value else " ")
        found = [
            ("stdout", self.stdout),
            ("stderr", self.stderr),
            ("value", None if value is None else value + self.value),
            ("error", self.error),
        ]
        return [(kind, text.rstrip("\n")) for kind, text in found if text]


@dataclass(repr=False)
class CellOutcome:
    """A cell's outputs, rank by rank, and what happened to the pool (``note``).

    ``interrupted``: the kernel was interrupted while the ranks ran the cell; ``timeout_s``: the
    cell's time limit. Displayed in a notebook as a column per rank; ``repr`` is the plain text.
    """

    ranks: dict[int, RankOutput]
    note: str = ""
    interrupted: bool = False
    timeout_s: float = DEFAULT_TIMEOUT_S

    @property
    def failed(self) -> bool:
        return any(out.status != "ok" for out in self.ranks.values())

    @property
    def empty(self) -> bool:
        """Nothing to show: every rank ran the cell without output, and the pool is as it was."""
        return not self.note and all(out.empty for out in self.ranks.values())

    def summary(self) -> str:
        """The failures in one line, e.g. "rank 1 raised ZeroDivisionError" ("" if none)."""
        words = {
            "error": lambda o: f"raised {o.error_type}",
            "timeout": lambda o: f"did not finish within {self.timeout_s:g} s",
            "died": lambda o: "died",
        }
        return "; ".join(
            f"rank {o.rank} {words[o.status](o)}" for o in self.ranks.values() if o.status != "ok"
        )

    def __repr__(self) -> str:
        """Rank after rank under a header line, then the note."""
        lines = []
        for rank, out in self.ranks.items():
            lines.append(f"── rank {rank} ──")
            lines += [text for _, text in out.blocks()] or ["(no output)"]
        if self.note:
            lines += ["", self.note]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        """A table with a column per rank: stdout, stderr (shaded), the value, the error."""
        styles = {"stdout": "", "stderr": _STDERR, "value": _VALUE, "error": _ERROR}
        head = "".join(f'<th style="{_CELL}">rank {r}</th>' for r in self.ranks)
        cells = []
        for out in self.ranks.values():
            blocks = "".join(
                f'<pre style="{_PRE};{styles[kind]}">{html.escape(text)}</pre>'
                for kind, text in out.blocks()
            )
            cells.append(f'<td style="{_CELL}">{blocks or "<i>(no output)</i>"}</td>')
        note = f"<p>{html.escape(self.note)}</p>" if self.note else ""
        return (
            '<table class="mgtutorial-ranks" style="table-layout:fixed;width:100%">'
            f"<thead><tr>{head}</tr></thead><tbody><tr>{''.join(cells)}</tr></tbody></table>" + note
        )
