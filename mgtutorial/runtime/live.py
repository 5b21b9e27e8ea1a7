"""Watching ranks train: a live plot in Jupyter, a progress bar in a terminal, static figures.

Taught in notebooks/01_single_device.ipynb and notebooks/02_ddp.ipynb.
Built on ipywidgets (https://ipywidgets.readthedocs.io, ``Output``), matplotlib and tqdm.

Everything is drawn from the ranks' log files (:mod:`mgtutorial.runtime.runlog`), never from the
ranks themselves: a spawned process cannot draw into a notebook cell.
"""

from __future__ import annotations

import io
import os
import time
from collections import defaultdict
from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from mgtutorial.runtime import runlog


def loss_figure(records: list[dict], title: str | None = None) -> Figure:
    """Per-rank training loss (thin lines) and the global mean over ranks (thick) against step.

    Test accuracy, where logged, goes on a second axis on the right. ``records`` are runlog records;
    those with ``kind == "train"`` are drawn.
    """
    fig = Figure(figsize=(7, 3.6), layout="constrained")
    ax = fig.add_subplot()
    by_rank: dict[int, list[dict]] = defaultdict(list)
    evals = []
    for rec in records:
        if rec.get("kind") == "train":
            by_rank[rec["rank"]].append(rec)
        elif rec.get("kind") == "eval" and rec.get("rank") == 0:
            evals.append(rec)
    few = max((len(v) for v in by_rank.values()), default=0) < 20  # early frames: show the points
    for r in sorted(by_rank):
        recs = by_rank[r]
        ax.plot(
            [x["step"] for x in recs],
            [x["loss"] for x in recs],
            lw=1,
            alpha=0.7,
            label=f"rank {r}",
            marker="." if few else None,
        )
    if by_rank:
        recs = by_rank[min(by_rank)]
        ax.plot(
            [x["step"] for x in recs],
            [x["global_loss"] for x in recs],
            lw=2.5,
            color="black",
            label="global mean",
            marker="o" if few else None,
        )
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    last_step = max((x["step"] for v in by_rank.values() for x in v), default=0)
    ax.set_xlim(0, max(5, last_step) + 0.5)
    ax.grid(alpha=0.3)
    if evals:
        ax2 = ax.twinx()
        ax2.plot(
            [e["step"] for e in evals],
            [100 * e["test_acc"] for e in evals],
            "o--",
            color="tab:green",
            label="test accuracy",
        )
        ax2.set_ylabel("test accuracy (%)", color="tab:green")
        ax2.set_ylim(0, 100)
    handles = [h for a in fig.axes for h in a.get_legend_handles_labels()[0]]
    if handles:  # beside the plot, never over the curves
        fig.legend(handles=handles, loc="outside right upper", fontsize="small")
    ax.set_title(title or "training loss")
    return fig


def figure_png(fig: Figure) -> bytes:
    """PNG bytes of a matplotlib figure (no GUI backend involved)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    return buf.getvalue()


def save_loss_png(
    run_dir: str | os.PathLike, records: list[dict], title: str | None = None
) -> bytes | None:
    """Write :func:`loss_figure` of ``records`` to ``<run_dir>/loss.png`` and return the PNG bytes;
    None (and no file) when there is no ``train`` record to draw."""
    if not runlog.of_kind(records, "train"):
        return None
    png = figure_png(loss_figure(records, title or Path(run_dir).name))
    (Path(run_dir) / "loss.png").write_bytes(png)
    return png


def progress(records: list[dict], started: float | None = None) -> dict:
    """Summary of the records so far: ``step`` (max over ranks), ``total_steps`` (from the ``plan``
    record; None before it), ``fraction`` (step / total_steps, or None), ``epoch``, ``global_loss``
    (latest), ``samples_per_s`` (all ranks together, between each rank's first and last record),
    ``test_acc``."""
    first: dict[int, dict] = {}
    last: dict[int, dict] = {}
    out = {
        "step": 0,
        "total_steps": None,
        "fraction": None,
        "epoch": 0,
        "global_loss": None,
        "samples_per_s": None,
        "test_acc": None,
    }
    for rec in records:
        if rec.get("kind") == "plan":
            out["total_steps"] = rec["steps"]
        if rec.get("kind") == "train":
            first.setdefault(rec["rank"], rec)
            last[rec["rank"]] = rec
            out["step"] = max(out["step"], rec["step"])
            out["epoch"] = max(out["epoch"], rec["epoch"])
            out["global_loss"] = rec["global_loss"]
        elif rec.get("kind") == "eval":
            out["test_acc"] = rec["test_acc"]
    rate = 0.0
    for r, rec in last.items():
        dt = rec["time"] - first[r]["time"]
        if dt > 0:
            rate += (rec["samples"] - first[r]["samples"]) / dt
    out["samples_per_s"] = rate or None
    if out["total_steps"]:
        out["fraction"] = out["step"] / out["total_steps"]
    return out


def _status(run, prog: dict) -> str:
    parts = [
        f"ranks alive {run.alive()}/{run.nprocs}",
        f"step {prog['step']}",
        f"epoch {prog['epoch'] + 1}",
    ]
    if prog["samples_per_s"]:
        parts.append(f"{prog['samples_per_s']:.0f} samples/s")
    if prog["global_loss"] is not None:
        parts.append(f"global loss {prog['global_loss']:.4f}")
    if prog["test_acc"] is not None:
        parts.append(f"test accuracy {prog['test_acc']:.1%}")
    return " · ".join(parts)


def in_notebook() -> bool:
    """True inside a Jupyter kernel (where widgets can be shown)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


class LivePlot:
    """Live per-rank loss plot of a :class:`~mgtutorial.runtime.run.Run` inside the notebook cell.

    :meth:`follow` blocks the cell while the ranks work, redrawing about every ``interval`` seconds
    in an ipywidgets ``Output`` with a status line (ranks alive, step, samples/s); at the end the
    widget is replaced by the final figure (a plain PNG output, saved with the notebook) and the
    figure is also written to ``<run dir>/loss.png``. ``redraws`` counts the live redraws.
    """

    def __init__(self, run, interval: float = 1.0, title: str | None = None):
        self.run, self.interval, self.title = run, interval, title or run.run_dir.name
        self.reader = runlog.RunReader(run.run_dir)
        self.redraws = 0

    def follow(self):
        """Show the plot until the run ends; returns the RunResult or raises WorkerFailed."""
        import ipywidgets as widgets
        from IPython.display import Image, display

        status, out = widgets.HTML("starting ranks…"), widgets.Output()
        box = widgets.VBox([status, out])
        handle = display(box, display_id=True)  # replaced in place by the final figure below
        last, done, error, final = 0.0, False, None, None
        try:
            while not done:
                try:
                    done = self.run.poll() is not None
                except Exception as exc:  # WorkerFailed: draw what was logged, then re-raise
                    done, error = True, exc
                self.reader.read_new()
                if self.reader.records and (done or time.monotonic() - last >= self.interval):
                    png = figure_png(loss_figure(self.reader.records, self.title))
                    interrupted = False
                    with out:  # an Output shows and swallows any exception raised inside it
                        try:
                            out.clear_output(wait=True)
                            display(Image(png))
                        except KeyboardInterrupt:
                            interrupted = True
                    if interrupted:
                        raise KeyboardInterrupt
                    status.value = _status(self.run, progress(self.reader.records))
                    self.redraws += 1
                    last, final = time.monotonic(), png if done else None  # all records drawn
                if not done:
                    time.sleep(0.1)
        except KeyboardInterrupt:
            self.run.stop()
            raise
        finally:
            for widget in (status, out, box):
                widget.close()
            if self.reader.records:
                if final is not None and runlog.of_kind(self.reader.records, "train"):
                    png = final  # drawn after the end: saved as it is, not drawn again
                    (self.run.run_dir / "loss.png").write_bytes(png)
                else:
                    png = save_loss_png(self.run.run_dir, self.reader.records, self.title)
                handle.update(Image(png))  # the saved notebook keeps a plain PNG, not a dead widget
                print(_status(self.run, progress(self.reader.records)))
            else:
                handle.update({"text/plain": "(no training records were logged)"}, raw=True)
        if error is not None:
            raise error
        return self.run.poll()


def follow_terminal(run, png: bool = True):
    """Outside Jupyter: a tqdm bar of steps with the global loss until the run ends; then write
    ``<run dir>/loss.png``. The bar appears once the ranks have logged their plan or a step (a run
    that logs no step, such as ``hello``, shows none), and the line after it starts afresh.
    Returns the RunResult or raises WorkerFailed."""
    from tqdm.auto import tqdm

    reader = runlog.RunReader(run.run_dir)
    bar = None
    try:
        while True:
            try:
                result = run.poll()
            finally:
                reader.read_new()
                prog = progress(reader.records)
                if bar is None and (prog["total_steps"] or prog["step"]):
                    bar = tqdm(
                        desc=run.run_dir.name,
                        unit="step",
                        total=prog["total_steps"],
                        initial=prog["step"],  # the steps before it count for no rate
                    )
                if bar is not None:
                    if prog["total_steps"] and bar.total != prog["total_steps"]:
                        bar.total = prog["total_steps"]  # the fraction done and the time left
                    bar.update(prog["step"] - bar.n)
                    if prog["global_loss"] is not None:
                        bar.set_postfix(loss=f"{prog['global_loss']:.4f}", ranks=run.alive())
            if result is not None:
                return result
            time.sleep(0.25)
    except KeyboardInterrupt:
        run.stop()
        raise
    finally:
        if bar is not None:
            bar.close()  # ends the bar's line: what is printed next starts a line of its own
        if png:
            save_loss_png(run.run_dir, reader.records)


def watch(run=None, interval: float = 1.0, title: str | None = None):
    """Follow ``run`` until it ends: :class:`LivePlot` in Jupyter, :func:`follow_terminal`
    elsewhere. ``run=None``: the latest run launched from this process
    (:func:`mgtutorial.runtime.run.last_run`), e.g. after ``launch(...)`` whose result was not kept.

    Returns the RunResult. Raises WorkerFailed (a rank failed), KeyboardInterrupt (the ranks
    were stopped) or LookupError (``run=None`` and nothing was launched yet).
    """
    if run is None:
        from mgtutorial.runtime.run import last_run

        run = last_run()
    if in_notebook():
        return LivePlot(run, interval, title).follow()
    return follow_terminal(run)
