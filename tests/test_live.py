"""The live view offline: progress arithmetic, the loss figure, the terminal follower, the record
schema."""

from __future__ import annotations

import pytest
import workers

from mgtutorial import launch
from mgtutorial.runtime import live, runlog


def _records(tmp_path, with_eval: bool):
    logs = [runlog.RunLog(tmp_path, rank=r) for r in (0, 1)]
    for log in logs:
        log.plan(steps=4)
    for step in (1, 2):
        for r, log in enumerate(logs):
            log.train(step=step, epoch=0, loss=1.0 + r, global_loss=1.5, samples=8 * step)
    if with_eval:
        logs[0].eval(step=2, epoch=0, test_acc=0.5, test_loss=0.9)
    for log in logs:
        log.close()
    return runlog.read_run(tmp_path)


def test_progress_arithmetic(tmp_path):
    recs = _records(tmp_path, with_eval=True)
    prog = live.progress(recs)
    assert (prog["step"], prog["total_steps"], prog["fraction"]) == (2, 4, 0.5)
    assert prog["global_loss"] == 1.5 and prog["test_acc"] == 0.5
    times = {
        r: [x["time"] for x in runlog.of_kind(recs, "train") if x["rank"] == r] for r in (0, 1)
    }
    expected = sum(8 / (t[1] - t[0]) for t in times.values() if t[1] > t[0])
    assert prog["samples_per_s"] == pytest.approx(expected or None)
    assert live.progress([])["total_steps"] is None and live.progress([])["fraction"] is None


@pytest.mark.parametrize("with_eval", [False, True])
def test_loss_figure_with_and_without_eval(tmp_path, with_eval):
    fig = live.loss_figure(_records(tmp_path, with_eval))
    assert len(fig.axes) == (2 if with_eval else 1)  # test accuracy gets its own axis
    lines = fig.axes[0].get_lines()
    assert [list(line.get_ydata()) for line in lines] == [[1.0, 1.0], [2.0, 2.0], [1.5, 1.5]]
    png = live.save_loss_png(tmp_path, runlog.read_run(tmp_path))
    assert png.startswith(b"\x89PNG") and (tmp_path / "loss.png").read_bytes() == png
    assert live.save_loss_png(tmp_path / "none", []) is None


def test_schema_writers_name_their_kind(tmp_path):
    with runlog.RunLog(tmp_path, rank=3) as log:
        kinds = [
            log.plan(steps=1)["kind"],
            log.train(step=1, epoch=0, loss=1, global_loss=1, samples=1)["kind"],
            log.eval(step=1, epoch=0, test_acc=1, test_loss=0)["kind"],
            log.checkpoint(step=1, epoch=1, batch=0, path="c.pt")["kind"],
            log.resume(step=1, epoch=1, batch=0, attempt=1)["kind"],
            log.event(event="forward", start=0, end=1, stage=0, microbatch=0, step=1)["kind"],
        ]
    assert kinds == ["plan", "train", "eval", "checkpoint", "resume", "event"]
    assert [r["kind"] for r in runlog.read_run(tmp_path)] == kinds
    assert runlog.rank_file(tmp_path, 3, "jsonl") == log.path
    mem = runlog.MemoryLog()
    mem.event(event="backward", start=0, end=1, stage=1, microbatch=2, step=1)
    assert [(r["kind"], r["stage"], r["rank"]) for r in mem.records] == [("event", 1, 0)]


@pytest.mark.timeout(120)
def test_terminal_follower_on_a_run(runs, capsys, no_leftovers):
    run = launch(workers.fixed_loss, workers.FixedLossConfig(steps=3), 2, runs_dir=runs)
    result = live.follow_terminal(run)
    assert sorted(result.values) == [0, 1]
    assert (run.run_dir / "loss.png").exists()
    err = capsys.readouterr().err
    assert "3/3" in err  # the bar knew the total from the plan record


class _FinishedRun:
    """What LivePlot reads of a Run whose ranks have all returned."""

    nprocs = 2

    def __init__(self, run_dir):
        self.run_dir = run_dir

    def poll(self):
        return "finished"

    def alive(self):
        return 0


def test_live_plot_saves_its_last_drawing_without_drawing_it_again(tmp_path, monkeypatch):
    import IPython.display

    recs = _records(tmp_path, with_eval=True)
    drawn, shown = [], []
    monkeypatch.setattr(live, "figure_png", lambda fig: drawn.append(fig) or b"png %d" % len(drawn))
    handle = type("Handle", (), {"update": lambda self, obj: shown.append(obj.data)})()
    monkeypatch.setattr(IPython.display, "display", lambda *objs, **kw: handle)  # as in a kernel
    assert live.LivePlot(_FinishedRun(tmp_path)).follow() == "finished"
    assert len(drawn) == 1 and (tmp_path / "loss.png").read_bytes() == b"png 1" == shown[-1]
    lines = drawn[0].axes[0].get_lines()  # the drawing holds every record
    assert [list(line.get_xdata()) for line in lines] == [[1, 2]] * 3 and len(recs) == 7


class _RunningRun(_FinishedRun):
    """A Run still going, that records being stopped."""

    stopped = False

    def poll(self):
        return None

    def stop(self):
        self.stopped = True


@pytest.mark.timeout(30)
def test_live_plot_interrupted_while_drawing_stops_the_run(tmp_path, monkeypatch):
    # an ipywidgets Output shows and swallows any exception raised inside it, in a kernel: an
    # interrupt that arrives while the figure is drawn must still end the cell and stop the ranks
    import IPython.display
    from ipywidgets.widgets import widget_output

    _records(tmp_path, with_eval=False)
    kernel = type("Kernel", (), {"showtraceback": lambda self, *a, **kw: None})()
    monkeypatch.setattr(widget_output, "get_ipython", lambda: kernel)
    monkeypatch.setattr(live, "figure_png", lambda fig: b"png")
    handle = type("Handle", (), {"update": lambda self, obj: None})()

    def display(*objs, **kw):
        if isinstance(objs[0], IPython.display.Image):
            raise KeyboardInterrupt  # inside `with out:`
        return handle

    monkeypatch.setattr(IPython.display, "display", display)
    run = _RunningRun(tmp_path)
    with pytest.raises(KeyboardInterrupt):
        live.LivePlot(run).follow()
    assert run.stopped
