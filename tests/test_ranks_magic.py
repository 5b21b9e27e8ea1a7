"""``%%ranks`` (mgtutorial/runtime/ranks_*.py): cells on every rank of a live process group.

In an IPython shell in this process (``IPython.testing.globalipapp``, the shell IPython's own
tests use) and in real kernels (jupyter_client, as JupyterLab starts them): values, output and
variables per rank against what one process computes; each failure (an exception on one rank, a
skipped collective, an interrupt, a killed rank) as the notebook shows it; and no rank left
behind by a stopped pool, a shut-down kernel or a restarted one. Nothing here times anything.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
import torch

from mgtutorial.runtime import procs
from mgtutorial.runtime.ranks_magic import RanksFailed, RanksMagics, parse_ranks
from mgtutorial.runtime.ranks_output import CellOutcome, RankOutput
from mgtutorial.runtime.ranks_serve import format_error, run_source, to_cpu
from mgtutorial.runtime.run import WorkerFailed

pytestmark = pytest.mark.timeout(240)


# ---- without processes -------------------------------------------------------------------------


def test_a_cell_shows_its_last_expression_as_ipython_does():
    ns = {}
    assert run_source("a = 2\na * 3", "<c>", ns) == 6 and ns["a"] == 2
    assert run_source("a * 3;", "<c>", ns) is None  # a trailing ; hides the value
    assert run_source("b = a", "<c>", ns) is None and ns["b"] == 2
    assert run_source("", "<c>", ns) is None
    with pytest.raises(SyntaxError):
        run_source("a = (", "<c>", ns)


def test_a_traceback_starts_at_the_cell():
    def serving_frame():
        run_source("def f():\n    return 1 / 0\nf()", "<ranks cell 7>", {})

    try:
        serving_frame()
    except ZeroDivisionError as exc:
        text = format_error(exc, "<ranks cell 7>")
    frames = re.findall(r'File "([^"]+)"', text)
    assert frames == ["<ranks cell 7>", "<ranks cell 7>"], text
    assert text.rstrip().endswith("ZeroDivisionError: division by zero")


def test_pulled_values_are_on_the_cpu_in_the_same_containers():
    value = {"t": torch.ones(2, requires_grad=True) * 2, "pair": (torch.zeros(1), [3])}
    moved = to_cpu(value)
    assert list(moved) == ["t", "pair"] and isinstance(moved["pair"], tuple)
    assert not moved["t"].requires_grad and moved["t"].device.type == "cpu"
    torch.testing.assert_close(moved["t"], torch.full((2,), 2.0))
    assert moved["pair"][1] == [3]


def test_the_plain_text_and_html_forms():
    outcome = CellOutcome(
        {
            0: RankOutput(0, stdout="a <b>\n", value="tensor([1.])"),
            1: RankOutput(1, status="error", error="Traceback …\nValueError: x", error_type="E"),
        },
        note="The pool was restarted.",
    )
    assert repr(outcome) == (
        "── rank 0 ──\na <b>\nOut: tensor([1.])\n── rank 1 ──\nTraceback …\nValueError: x\n"
        "\nThe pool was restarted."
    )
    page = outcome._repr_html_()
    assert (
        len(re.findall(r"<th[ >]", page)) == 2 and page.count("<td") == 2 and "a &lt;b&gt;" in page
    )
    assert outcome.failed and outcome.summary() == "rank 1 raised E"
    assert CellOutcome({0: RankOutput(0)}).empty
    assert "(no output)" in repr(CellOutcome({0: RankOutput(0)}, note="n"))


def test_rank_lists():
    assert parse_ranks("all") is None and parse_ranks("0,2") == [0, 2] and parse_ranks("1") == [1]
    from IPython.core.error import UsageError

    for bad in ("-1", "x", "0,,1"):
        with pytest.raises(UsageError):
            parse_ranks(bad)


def test_import_mgtutorial_loads_no_torch_and_offers_the_extension():
    code = (
        "import sys, mgtutorial; assert 'torch' not in sys.modules; "
        "assert callable(mgtutorial.load_ipython_extension)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- the magics in an IPython shell ------------------------------------------------------------


@pytest.fixture
def ip(tmp_path, monkeypatch, no_leftovers):
    """The test IPython shell with the extension loaded, showing HTML as a notebook does (a
    terminal shows plain text only), in a folder of its own (runs/ goes there); its pool is
    stopped afterwards."""
    from IPython.testing import globalipapp

    monkeypatch.chdir(tmp_path)
    globalipapp.start_ipython()  # once per process; later calls return None
    shell = globalipapp.get_ipython()
    monkeypatch.setattr(shell.display_formatter, "active_types", ["text/plain", "text/html"])
    shell.run_line_magic("load_ext", "mgtutorial")
    try:
        yield shell
    finally:
        shell.run_line_magic("unload_ext", "mgtutorial")


def magics(shell) -> RanksMagics:
    return shell.magics_manager.registry["RanksMagics"]


def cell(shell, line: str, source: str):
    """Run ``%%ranks line`` + source as a notebook cell; return (the displayed outcome or None,
    what was printed, the exception it raised or None)."""
    from IPython.utils.capture import capture_output

    with capture_output() as captured:
        result = shell.run_cell(f"%%ranks {line}\n{source}", store_history=True)
    shown = [o for o in captured.outputs if "text/html" in o.data]
    outcome = shown[0] if shown else None
    return outcome, captured.stdout, result.error_in_exec


def test_cells_run_on_every_rank_and_keep_their_variables(ip):
    ip.run_line_magic("ranks", "start 2")
    shown, _, error = cell(
        ip,
        "",
        "t = torch.arange(3.0) + 10 * rank\nprint('before', t.tolist())\ndist.all_reduce(t)\nt",
    )
    assert error is None
    reference = torch.arange(3.0) + torch.arange(3.0) + 10  # what one process computes
    text = shown.data["text/plain"]
    assert text == (
        "── rank 0 ──\nbefore [0.0, 1.0, 2.0]\nOut: tensor([10., 12., 14.])\n"
        "── rank 1 ──\nbefore [10.0, 11.0, 12.0]\nOut: tensor([10., 12., 14.])"
    )
    assert len(re.findall(r"<th[ >]", shown.data["text/html"])) == 2
    pulled = ip.run_line_magic("ranks", "pull t")
    assert len(pulled) == 2
    for value in pulled:
        torch.testing.assert_close(value, reference)
    # variables live on; a cell can run on some ranks only; stderr comes back too
    shown, _, error = cell(
        ip, "1", "import sys\nprint(rank, world_size, t.sum().item(), file=sys.stderr)"
    )
    assert error is None and shown.data["text/plain"] == "── rank 1 ──\n1 2 36.0"
    assert "background" in shown.data["text/html"]  # stderr is shaded
    assert cell(ip, "", "u = 1")[0] is None  # no output on any rank: nothing shown
    with pytest.raises(NameError, match="has no variable 'nothing'"):
        ip.run_line_magic("ranks", "pull nothing")
    status = magics(ip).status()
    assert "2 ranks, backend gloo" in status and "3 cell(s) run" in status


def test_an_exception_on_one_rank_shows_its_traceback_and_the_others_outputs(ip):
    ip.run_line_magic("ranks", "start 2")
    pids = dict(magics(ip).pool.pids)
    source = "x = 41 + rank\nprint('rank', rank, 'got here')\n1 / (1 - rank)"
    shown, _, error = cell(ip, "", source)
    assert isinstance(error, RanksFailed) and "rank 1 raised ZeroDivisionError" in str(error)
    assert error._render_traceback_() == [f"RanksFailed: {error}"]
    text = shown.data["text/plain"]
    rank0, rank1 = text.split("── rank 1 ──")
    assert "rank 0 got here" in rank0 and "Out: 1.0" in rank0 and "Traceback" not in rank0
    assert "rank 1 got here" in rank1
    assert re.search(r'File "<ranks cell \d+>", line 3, in <module>\n    1 / \(1 - rank\)', rank1)
    assert rank1.strip().endswith("ZeroDivisionError: division by zero")
    from IPython.core.error import UsageError

    assert isinstance(cell(ip, "2", "x")[2], UsageError)  # the pool has ranks 0 and 1
    # the pool is the same, with its variables; --no-raise shows a failure and raises nothing
    shown, _, error = cell(ip, "--no-raise", "assert rank == 0, 'not rank 0'\nx")
    assert error is None and magics(ip).pool.pids == pids
    assert (
        "Out: 41" in shown.data["text/plain"]
        and "AssertionError: not rank 0" in shown.data["text/plain"]
    )


def test_a_skipped_collective_times_out_names_the_rank_and_restarts(ip):
    ip.run_line_magic("ranks", "start 2")
    before = dict(magics(ip).pool.pids)
    cell(ip, "", "x = rank")
    source = "t = torch.ones(1)\nif rank == 0:\n    dist.all_reduce(t)  # rank 1 skips it\nt"
    shown, _, error = cell(ip, "--timeout 2", source)
    assert isinstance(error, RanksFailed)
    assert str(error).startswith("rank 0 did not finish within 2 s")
    text = shown.data["text/plain"]
    rank0, rank1 = text.split("── rank 1 ──")
    assert "did not finish in time (limit 2 s); it is waiting in:" in rank0
    assert "line 3, in <module>\n    dist.all_reduce(t)  # rank 1 skips it" in rank0
    assert "in all_reduce" in rank0  # torch's own frame, where it waits
    assert "Out: tensor([1.])" in rank1
    assert text.endswith(
        "The pool was restarted (2 new ranks): every rank's variables from earlier cells are lost."
    )
    pool = magics(ip).pool
    assert pool.up and set(pool.pids.values()).isdisjoint(before.values())
    assert not procs.survivors([psutil.Process(p) for p in before.values() if psutil.pid_exists(p)])
    shown, _, error = cell(ip, "--no-raise", "x")  # the state was lost
    assert "NameError: name 'x' is not defined" in shown.data["text/plain"]


def test_interrupting_the_kernel_interrupts_the_ranks(ip, tmp_path):
    ip.run_line_magic("ranks", "start 2")
    pids = dict(magics(ip).pool.pids)
    main = threading.get_ident()
    marks = [tmp_path / f"sleeping{r}" for r in range(2)]

    def interrupt_once_both_sleep():
        deadline = time.monotonic() + 60
        while not all(m.exists() for m in marks) and time.monotonic() < deadline:
            time.sleep(0.05)
        signal.pthread_kill(main, signal.SIGINT)  # what Ctrl-C / the stop button do to a kernel

    source = (
        f"import time\nopen({str(tmp_path)!r} + f'/sleeping{{rank}}', 'w').close()\ntime.sleep(60)"
    )
    helper = threading.Thread(target=interrupt_once_both_sleep)
    helper.start()
    shown, _, error = cell(ip, "--timeout 90", source)
    helper.join()
    assert isinstance(error, KeyboardInterrupt)
    for part in shown.data["text/plain"].split("── rank ")[1:]:
        assert "time.sleep(60)" in part and part.strip().endswith("KeyboardInterrupt"), part
        assert "ranks_serve" not in part  # the rank's interrupt handler is not the learner's
    assert magics(ip).pool.pids == pids  # the ranks were interrupted, not replaced
    shown, _, error = cell(ip, "", "rank")
    assert error is None and "Out: 1" in shown.data["text/plain"]


def test_a_killed_rank_is_named_and_the_pool_restarted(ip):
    ip.run_line_magic("ranks", "start 2")
    first = dict(magics(ip).pool.pids)
    source = (
        "import os, signal\nt = torch.ones(1)\nif rank == 1:\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\ndist.all_reduce(t)"
    )
    shown, _, error = cell(ip, "--timeout 30", source)
    assert isinstance(error, RanksFailed) and "rank 1 died" in str(error)
    rank0, rank1 = shown.data["text/plain"].split("── rank 1 ──")
    assert "died: killed by signal SIGKILL" in rank1
    assert "Traceback" in rank0 and "site-packages" not in rank0  # its peer was gone
    assert "The pool was restarted (2 new ranks)" in shown.data["text/plain"]
    second = dict(magics(ip).pool.pids)
    assert set(second.values()).isdisjoint(first.values())
    # killed from outside between two cells: the next cell says so, on a new pool
    os.kill(second[0], signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # until the launcher has seen it end
        try:
            magics(ip).pool.run.poll()
        except WorkerFailed:
            break
        time.sleep(0.1)
    shown, _, error = cell(ip, "", "rank")
    assert error is None
    text = shown.data["text/plain"]
    assert text.startswith("── rank 0 ──\nOut: 0\n── rank 1 ──\nOut: 1")
    assert "Since the last cell, rank 0 died (killed by signal SIGKILL)." in text
    assert "The pool was restarted" in text


def test_stop_and_restart_leave_no_rank_behind(ip):
    ip.run_line_magic("ranks", "start 2")
    old = [psutil.Process(p) for p in magics(ip).pool.pids.values()]
    ip.run_line_magic("ranks", "restart")
    assert not procs.survivors(old, grace_s=10)
    new = [psutil.Process(p) for p in magics(ip).pool.pids.values()]
    ip.run_line_magic("ranks", "stop")
    assert not procs.survivors(new, grace_s=10)
    assert magics(ip).status().startswith("no pool is running")
    from IPython.core.error import UsageError

    for bad in ("start x", "pull", "launch"):
        with pytest.raises(UsageError):
            ip.run_line_magic("ranks", bad)


# ---- in real kernels, as JupyterLab starts them ------------------------------------------------


@pytest.fixture
def kernels(tmp_path):
    """Starts IPython kernels in ``tmp_path`` (jupyter_client, the python3 kernel of this
    environment); each is killed at the end if a test left it running."""
    from jupyter_client.manager import KernelManager

    started = []

    def start():
        km = KernelManager(kernel_name="python3")
        km.start_kernel(cwd=str(tmp_path))
        kc = km.client()
        kc.start_channels()
        kc.wait_for_ready(timeout=120)
        started.append((km, kc))
        return km, kc

    yield start
    for km, kc in started:
        kc.stop_channels()
        if km.is_alive():
            km.shutdown_kernel(now=True)


def collect(kc, msg_id: str, timeout: float = 200) -> tuple[dict, str, list[str]]:
    """The reply to request ``msg_id``, its text (streams, plain-text forms, error) and HTML."""
    text, pages = [], []
    deadline = time.monotonic() + timeout
    while True:
        msg = kc.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "status" and content["execution_state"] == "idle":
            break
        if kind == "stream":
            text.append(content["text"])
        elif kind in ("display_data", "execute_result"):
            text.append(content["data"].get("text/plain", "") + "\n")
            pages.append(content["data"].get("text/html", ""))
        elif kind == "error":
            text.append(f"{content['ename']}: {content['evalue']}\n")
    while (reply := kc.get_shell_msg(timeout=30))["parent_header"].get("msg_id") != msg_id:
        pass
    return reply["content"], "".join(text), pages


def execute(kc, code: str) -> tuple[dict, str, list[str]]:
    return collect(kc, kc.execute(code))


def tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def test_real_kernels_have_their_own_pools_and_leave_no_process(kernels, tmp_path):
    (km_a, a), (km_b, b) = kernels(), kernels()
    kernel_pid, rank_pids = {}, {}
    for name, kc in (("a", a), ("b", b)):
        reply, text, _ = execute(kc, "%load_ext mgtutorial\n%ranks start 2\nimport os\nos.getpid()")
        assert reply["status"] == "ok" and "2 ranks ready (backend gloo" in text, text
        kernel_pid[name] = int(text.strip().splitlines()[-1])
        reply, text, pages = execute(kc, "%%ranks\nimport os\nprint('pid', os.getpid())\nrank")
        assert reply["status"] == "ok", text
        assert "── rank 0 ──" in text and "Out: 0" in text and "── rank 1 ──" in text, text
        assert len(re.findall(r"<th[ >]", pages[0])) == 2
        rank_pids[name] = {int(p) for p in re.findall(r"pid (\d+)", text)}
    assert len(rank_pids["a"]) == len(rank_pids["b"]) == 2
    assert rank_pids["a"].isdisjoint(rank_pids["b"])  # a pool per kernel
    processes = {name: tree(pid) for name, pid in kernel_pid.items()}
    assert {p.pid for p in processes["b"]} >= rank_pids["b"]

    # the stop button: the kernel's process group gets SIGINT, the ranks stop their cell
    marks = [tmp_path / f"b-sleeping{r}" for r in range(2)]
    source = f"import time\nopen({str(tmp_path)!r} + f'/b-sleeping{{rank}}', 'w').close()\n"
    msg_id = b.execute(f"%%ranks --timeout 90\n{source}time.sleep(60)")
    deadline = time.monotonic() + 60
    while not all(m.exists() for m in marks) and time.monotonic() < deadline:
        time.sleep(0.05)
    km_b.interrupt_kernel()
    reply, text, _ = collect(b, msg_id)
    assert reply["status"] == "error" and reply["ename"] == "KeyboardInterrupt", text
    assert text.count("time.sleep(60)") == 2 and text.count("KeyboardInterrupt") >= 2, text
    reply, text, _ = execute(b, "%%ranks\nprint('pid', os.getpid())")
    assert {int(p) for p in re.findall(r"pid (\d+)", text)} == rank_pids["b"]  # the same ranks

    km_a.shutdown_kernel(now=False)  # JupyterLab's "Shut Down Kernel"
    assert not procs.survivors(processes["a"], grace_s=15)
    km_b.restart_kernel(now=True)  # the kernel killed at once, and a new one started
    assert not procs.survivors(processes["b"], grace_s=15)
    b.wait_for_ready(timeout=120)
    reply, text, _ = execute(b, "%load_ext mgtutorial\n%ranks status")
    assert text.startswith("no pool is running"), text  # the new kernel has no pool yet
