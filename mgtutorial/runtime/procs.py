"""Finding a job's processes: the ranks :func:`~mgtutorial.launch` started, torchrun agents and
their ranks, and the loopback interface that single-machine jobs talk over.

One place for what the launcher, the notebooks' last cells ("no rank is left running") and the test
suites' leftover checks all need. Built on psutil (https://psutil.readthedocs.io). Taught in
notebooks/00_setup.ipynb (the last cell of every chapter calls :func:`rank_processes`).
"""

from __future__ import annotations

import time

import psutil

# multiprocessing's helpers live as long as the process that started them; they are not ranks.
SERVICES = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")


def _cmdline(p: psutil.Process | None) -> str:
    return " ".join(p.cmdline()) if p is not None else ""


def _service(p: psutil.Process) -> bool:
    """multiprocessing's resource tracker or fork server itself (not a child forked from it)."""
    return any(s in _cmdline(p) for s in SERVICES) and not _forked(p)


def _forked(p: psutil.Process) -> bool:
    """A child forked by multiprocessing's fork server: it has the server's command line (a fork
    without exec), not a command line of its own."""
    own = _cmdline(p)
    return "multiprocessing.forkserver" in own and own == _cmdline(p.parent())


def _alive(p: psutil.Process) -> bool:
    return p.is_running() and p.status() != psutil.STATUS_ZOMBIE


def is_running(pid: int) -> bool:
    """True while the process ``pid`` exists and is not a zombie (ended, not yet waited for)."""
    try:
        return _alive(psutil.Process(pid))
    except psutil.Error:
        return False


def is_rank_cmdline(cmdline: list[str]) -> bool:
    """True for a command line that looks like a rank or a rank launcher: multiprocessing's
    spawned children (``spawn_main``), ``torchrun`` (or ``torch.distributed.run``) and anything
    with ``mgtutorial`` in its arguments (``argv[0]`` is ignored: the interpreter's own path may
    hold the repository's name). The resource tracker and the fork server are not ranks."""
    text = " ".join(cmdline)
    if any(s in text for s in SERVICES):
        return False
    if "spawn_main" in text or "torch.distributed.run" in text:
        return True
    if any(arg.rsplit("/", 1)[-1] == "torchrun" for arg in cmdline[:2]):
        return True
    return any("mgtutorial" in arg for arg in cmdline[1:])


def _descendants(root: psutil.Process | None, keep) -> list[psutil.Process]:
    """The live descendants ``p`` of ``root`` (default: this process) for which ``keep(p)``."""
    try:
        children = (root or psutil.Process()).children(recursive=True)
    except psutil.Error:
        return []
    found = []
    for p in children:
        try:
            if _alive(p) and keep(p):
                found.append(p)
        except psutil.Error:
            pass  # it ended while we looked
    return found


def rank_processes(root: psutil.Process | None = None) -> list[psutil.Process]:
    """The live rank processes that :func:`~mgtutorial.launch` started from ``root`` (default:
    this process), by either start method: spawned ones (``spawn_main`` in their command line) and
    those forked from the fork server (its children). Zombies, the resource tracker and the fork
    server itself are left out."""

    def keep(p: psutil.Process) -> bool:
        return not _service(p) and ("spawn_main" in _cmdline(p) or _forked(p))

    return _descendants(root, keep)


def rank_descendants(root: psutil.Process | None = None) -> list[psutil.Process]:
    """Every live descendant of ``root`` that looks like a rank or a launcher of ranks:
    :func:`rank_processes` plus torchrun agents, their ranks and ``python -m mgtutorial`` jobs."""

    def keep(p: psutil.Process) -> bool:
        return not _service(p) and (_forked(p) or is_rank_cmdline(p.cmdline()))

    return _descendants(root, keep)


def torchrun_processes() -> list[int]:
    """Pids of this process's descendants still running torchrun agents or ranks started with
    ``-m mgtutorial…`` (zombies excluded): what a chapter's last cell expects to be none."""
    return [p.pid for p in _descendants(None, lambda p: is_rank_cmdline(p.cmdline()))]


def non_service_children(root: psutil.Process | None = None) -> list[psutil.Process]:
    """Every live descendant except multiprocessing's resource tracker and fork server (which serve
    every launch of the session and end with it); a rank forked from the server counts."""

    return _descendants(root, lambda p: not _service(p))


def descendants_of(pids) -> list[psutil.Process]:
    """Every live process started (directly or not) by one of ``pids``: what ranks left behind."""
    found = []
    for pid in pids:
        try:
            found += _descendants(psutil.Process(pid), lambda p: True)
        except psutil.Error:
            pass  # that rank has already ended
    return found


def kill(processes: list[psutil.Process], timeout_s: float = 5.0) -> None:
    """SIGKILL each of ``processes`` still there, and wait up to ``timeout_s`` s for them to end."""
    for p in processes:
        try:
            p.kill()
        except psutil.Error:
            pass  # already ended
    psutil.wait_procs(processes, timeout=timeout_s)


def survivors(procs: list[psutil.Process], grace_s: float = 5.0) -> list[psutil.Process]:
    """Those of ``procs`` still running (not zombies) after waiting up to ``grace_s`` seconds."""
    deadline = time.monotonic() + grace_s
    while True:
        alive = []
        for p in procs:
            try:
                if _alive(p):
                    alive.append(p)
            except psutil.Error:
                pass
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.2)


def loopback_ifname() -> str:
    """Name of the network interface that holds 127.0.0.1 ("lo" on Linux, "lo0" on macOS)."""
    for name, addrs in psutil.net_if_addrs().items():
        if any(getattr(a, "address", None) == "127.0.0.1" for a in addrs):
            return name
    return "lo"
