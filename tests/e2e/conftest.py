"""End-to-end fixtures: a private JupyterLab server on a temporary copy of notebooks/, Debian's
Chromium for Playwright, and the folder the screenshots go to.

The server runs from this environment (``sys.executable -m jupyter lab``) on a free loopback port
with a random token, as root only with ``--allow-root``; its config, data, runtime, IPython and
matplotlib folders are temporary, so nothing of the user's (or another test's) leaks in. Every
process it starts is recorded by PID and start time while it runs, so that the test can check,
after shutting it down, that none of them is left.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = Path(os.environ.get("MGTUTORIAL_CHROMIUM", "/usr/bin/chromium"))
ARTIFACTS = Path(os.environ.get("MGTUTORIAL_E2E_ARTIFACTS", ROOT / "test-artifacts" / "e2e"))
CHROMIUM_ARGS = [
    "--no-sandbox",  # root in a container has no user namespaces for the sandbox
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
# Lab settings a learner would click away; here they would only cover the screenshots.
LAB_SETTINGS = {
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false"}
}

os.environ.setdefault("PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD", "1")  # never Playwright's own browser
_artifacts_written: list[Path] = []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ProcessRecorder(threading.Thread):
    """Records every descendant of ``root`` (PID and start time, via psutil.Process) while it
    runs."""

    def __init__(self, root: psutil.Process, every_s: float = 0.1):
        super().__init__(daemon=True, name="e2e-process-recorder")
        self.root, self.every_s = root, every_s
        self.seen: dict[tuple[int, float], psutil.Process] = {}
        self.cmdlines: dict[tuple[int, float], str] = {}
        self._stop_event = threading.Event()

    def sample(self) -> None:
        try:
            children = self.root.children(recursive=True)
        except psutil.Error:
            return
        for p in children:
            try:
                key = (p.pid, p.create_time())
                self.seen.setdefault(key, p)
                # read again: exec() changes it; a zombie's is empty
                cmdline = " ".join(p.cmdline())
                if cmdline:
                    self.cmdlines[key] = cmdline
                else:
                    self.cmdlines.setdefault(key, "")
            except psutil.Error:
                pass

    def run(self) -> None:
        while not self._stop_event.is_set():
            self.sample()
            self._stop_event.wait(self.every_s)

    def stop(self) -> None:
        self.sample()
        self._stop_event.set()
        self.join(5)

    def alive(self, grace_s: float = 10.0) -> list[tuple[psutil.Process, str]]:
        """Recorded processes still running (zombies count as gone) after up to ``grace_s``
        seconds."""
        deadline = time.monotonic() + grace_s
        while True:
            left = []
            for key, p in self.seen.items():
                try:
                    # is_running checks the start time too: a reused pid is not it
                    if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                        left.append((p, self.cmdlines[key]))
                except psutil.Error:
                    pass
            if not left or time.monotonic() >= deadline:
                return left
            time.sleep(0.2)


class JupyterLab:
    """A JupyterLab server serving ``notebook_dir``; :meth:`shutdown` returns the processes left."""

    def __init__(self, base: Path, notebook_dir: Path):
        self.base, self.notebook_dir = base, notebook_dir
        self.port, self.token = free_port(), secrets.token_hex(24)
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = base / "jupyterlab.log"
        self.proc: subprocess.Popen | None = None
        self.recorder: ProcessRecorder | None = None
        self.left: list[tuple[psutil.Process, str]] | None = None

    def _environment(self) -> dict:
        dirs = {
            name: self.base / name.lower()
            for name in (
                "JUPYTER_CONFIG_DIR",
                "JUPYTER_DATA_DIR",
                "JUPYTER_RUNTIME_DIR",
                "IPYTHONDIR",
                "MPLCONFIGDIR",
            )
        }
        for d in dirs.values():
            d.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTER", "PYTEST_"))}
        env.update({k: str(v) for k, v in dirs.items()})
        # The python3 kernelspec lives in this environment (sys.prefix/share/jupyter), which Jupyter
        # always searches; its argv[0] "python" is replaced by the server's own interpreter.
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def _settings_dir(self) -> Path:
        settings = self.base / "lab-user-settings"
        for rel, values in LAB_SETTINGS.items():
            path = settings / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(values))
        return settings

    def start(self, timeout_s: float = 60) -> None:
        cmd = [
            sys.executable,
            "-m",
            "jupyter",
            "lab",
            "--no-browser",
            "--ServerApp.ip=127.0.0.1",
            f"--ServerApp.port={self.port}",
            "--ServerApp.port_retries=0",
            f"--ServerApp.root_dir={self.notebook_dir}",
            f"--IdentityProvider.token={self.token}",
            "--ServerApp.terminals_enabled=False",
            "--LabApp.expose_app_in_browser=True",
            f"--LabApp.user_settings_dir={self._settings_dir()}",
            f"--LabApp.workspaces_dir={self.base / 'lab-workspaces'}",
        ]
        if os.geteuid() == 0:
            cmd.append("--allow-root")
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                cmd,
                cwd=self.notebook_dir,
                env=self._environment(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.recorder = ProcessRecorder(psutil.Process(self.proc.pid))
        self.recorder.start()
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"JupyterLab exited with code {self.proc.returncode}:\n{self.log_tail()}"
                )
            try:
                self.api("GET", "/api/status", timeout=2)
                return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"JupyterLab did not answer within {timeout_s} s:\n{self.log_tail()}"
                )
            time.sleep(0.3)

    def api(self, method: str, path: str, timeout: float = 10):
        req = urllib.request.Request(
            self.url + path, method=method, headers={"Authorization": f"token {self.token}"}
        )
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            body = resp.read()
        return json.loads(body) if body else None

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return "(no log)"

    def shutdown(self) -> list[tuple[psutil.Process, str]]:
        """Shut the kernels down through the REST API, terminate the server, and return every
        process it started that is still running 10 s later (those are then killed)."""
        if self.left is not None or self.proc is None:
            return self.left or []
        try:
            for kernel in self.api("GET", "/api/kernels"):
                self.api("DELETE", f"/api/kernels/{kernel['id']}", timeout=30)
        except OSError as exc:
            print(f"could not shut the kernels down through the REST API: {exc}")
        self.recorder.sample()
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.recorder.stop()
        self.left = self.recorder.alive()
        for p, _ in self.left:
            try:
                p.kill()
            except psutil.Error:
                pass
        return self.left


@pytest.fixture
def chromium() -> dict:
    """Playwright's launch options for Debian's Chromium (never a browser Playwright downloads);
    the test is skipped, with this reason, where it is not installed."""
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(
            f"{CHROMIUM} is not installed (as root with apt-get, `make test` installs Debian's "
            "`chromium`; otherwise: apt-get install --no-install-recommends chromium)"
        )
    return {"executable_path": str(CHROMIUM), "headless": True, "args": CHROMIUM_ARGS}


@pytest.fixture
def artifacts() -> Path:
    """The folder for screenshots and logs, emptied of the last run's files."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    for old in ARTIFACTS.iterdir():
        if old.is_file():
            old.unlink()
    _artifacts_written.append(ARTIFACTS)
    return ARTIFACTS


@pytest.fixture
def lab(tmp_path, artifacts):
    """JupyterLab on a temporary copy of notebooks/ (the .ipynb files only, none of runs/) and
    scripts/."""
    notebook_dir = tmp_path / "notebooks"
    notebook_dir.mkdir()
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        shutil.copy2(nb, notebook_dir / nb.name)
    # the chapters read scripts/ beside notebooks/ (chapter 02 prints and runs
    # scripts/minimal_ddp.py)
    shutil.copytree(
        ROOT / "scripts", tmp_path / "scripts", ignore=shutil.ignore_patterns("__pycache__")
    )
    server = JupyterLab(tmp_path, notebook_dir)
    try:
        server.start()
        yield server
    finally:
        left = server.shutdown()  # a no-op when the test already shut it down
        shutil.copy2(server.log_path, artifacts / "jupyterlab.log")
        if left:
            print("killed processes JupyterLab left running:", [c for _, c in left])


def pytest_terminal_summary(terminalreporter):
    if _artifacts_written:
        terminalreporter.write_line(f"end-to-end screenshots and logs: {_artifacts_written[-1]}")
