"""Session-wide pieces for tests and notebooks alike: no rank process outlives the test session,
and every notebook run by nbval is a slow test that one worker runs whole.

Ranks are grandchildren when nbval runs a notebook (pytest → kernel → ranks), and they would be
re-parented away from pytest if the kernel died first. So the rank-like descendants of this
process are recorded after every test item, and at the end of the session every one recorded
must have exited within a grace period; otherwise the session fails and the survivors are listed
(and then killed, so that they do not outlive the report either).

Under pytest-xdist (``make test`` runs ``-n``) each worker is a session of its own whose exit
status the controller does not read: a worker hands its survivors to the controller
(``config.workeroutput``), and the controller's session fails and lists them.

nbval executes a notebook's cells in order in one kernel, so a notebook's cells must stay on one
worker, in order: under ``-n`` (xdist's ``--dist load``) each notebook is one unit of work and every
other test a unit of its own (:class:`NotebookScheduling`), notebooks first (the longest units).
"""

from __future__ import annotations

import os

import psutil
import pytest

from mgtutorial.runtime.procs import rank_descendants, survivors

# A deprecated torch.distributed call (a FutureWarning, which torch attributes to its
# c10d_logger wrapper) fails the tests: here and in every process they start, ranks and notebook
# kernels included, which read this variable when their interpreter starts (pyproject.toml's
# filterwarnings does the same in this process).
DEPRECATED_C10D = "error::FutureWarning:torch.distributed.c10d_logger"
if DEPRECATED_C10D not in os.environ.get("PYTHONWARNINGS", ""):
    os.environ["PYTHONWARNINGS"] = ",".join(
        w for w in (os.environ.get("PYTHONWARNINGS"), DEPRECATED_C10D) if w
    )

GRACE_S = 5.0
LEFTOVERS = "mgtutorial_leftover_ranks"  # the key in an xdist worker's output
_seen: dict[int, psutil.Process] = {}
_from_workers: list[str] = []


def _remember() -> None:
    for p in rank_descendants():
        _seen.setdefault(p.pid, p)  # psutil.Process checks the create time: a reused pid is not it


def pytest_configure(config):
    stop_kernels_by_request_under_coverage()
    start_kernels_again_once()


def start_kernels_again_once() -> bool:
    """A notebook's kernel that dies while starting is started once more, with a warning.

    jupyter_client picks a kernel's five ports by binding and releasing them, and the kernel binds
    them again a moment later: when several workers start kernels at once (``make test`` runs
    three), another process can take a port in between and the new kernel exits before its first
    reply ("Kernel died before replying to kernel_info"), failing every cell of a notebook that
    never ran. A second start picks new ports. A kernel that dies twice still fails the notebook;
    nothing inside a notebook is retried. Returns whether nbval's kernel start was wrapped.
    """
    try:
        import nbval.kernel
    except ImportError:
        return False
    first_start = nbval.kernel.start_new_kernel

    def start_new_kernel(*args, **kwargs):
        try:
            return first_start(*args, **kwargs)
        except RuntimeError as exc:
            if "died before replying" not in str(exc):
                raise
            import warnings

            warnings.warn(f"a notebook kernel died while starting ({exc}); starting it again")
            return first_start(*args, **kwargs)

    nbval.kernel.start_new_kernel = start_new_kernel
    return True


def stop_kernels_by_request_under_coverage() -> bool:
    """Under ``make coverage``, nbval's kernels are asked to shut down instead of being killed.

    nbval ends a notebook's kernel with ``shutdown_kernel(now=True)``, a kill: the kernel's own
    coverage measurer never saves, and the lines that only notebook cells run (exercise checkers,
    the live plot, figures) would count as missed. A shutdown request lets the kernel exit normally
    (its measurer saves at exit); jupyter_client still kills it after its grace period if it does
    not. Outside coverage nothing changes. Returns whether nbval's ``stop`` was replaced.
    """
    try:
        import coverage
        from nbval.kernel import RunningKernel
    except ImportError:
        return False
    if coverage.Coverage.current() is None:
        return False

    def stop(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=False)
        del self.km

    RunningKernel.stop = stop
    return True


def _is_notebook_cell(item) -> bool:
    return str(item.path).endswith(".ipynb")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _is_notebook_cell(item):
            item.add_marker(pytest.mark.slow)


@pytest.hookimpl(optionalhook=True)  # an xdist hook: unknown without it
def pytest_xdist_make_scheduler(config, log):
    if config.getoption("dist") != "load":
        return None  # another --dist asked for: xdist's own
    from xdist.scheduler import LoadScopeScheduling

    class NotebookScheduling(LoadScopeScheduling):
        """xdist's scope scheduling with a notebook (all its cells) or a single test as the unit:
        units with more items go first (xdist's ``--loadscope-reorder``), so the notebooks do."""

        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return path if path.endswith(".ipynb") else nodeid

    return NotebookScheduling(config, log)


def pytest_runtest_teardown(item, nextitem):
    _remember()


def _kill_survivors() -> list[str]:
    _remember()
    lines = []
    for p in survivors(list(_seen.values()), GRACE_S):
        try:
            lines.append(f"  pid {p.pid}: {' '.join(p.cmdline())[:200]}")
            p.kill()
        except psutil.Error:
            pass
    return lines


@pytest.hookimpl(optionalhook=True)  # an xdist hook: unknown without it
def pytest_testnodedown(node, error):
    """In the xdist controller: keep what a finished worker found left running."""
    _from_workers.extend(getattr(node, "workeroutput", {}).get(LEFTOVERS, []))


def pytest_sessionfinish(session, exitstatus):
    lines = _kill_survivors()
    worker_output = getattr(session.config, "workeroutput", None)
    if worker_output is not None:  # an xdist worker: the controller reports them
        worker_output[LEFTOVERS] = lines
        return
    lines += _from_workers
    if not lines:
        return
    print(
        f"\nERROR: {len(lines)} rank process(es) still running {GRACE_S:.0f} s after the tests "
        "that started them (now killed):\n" + "\n".join(lines)
    )
    session.exitstatus = 1
