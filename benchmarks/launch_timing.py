"""(a) of benchmarks/launch_and_scaling.py: the time from the call to the first logged step of 2
ranks, started four ways (``launch`` cold and warm, ``torch.multiprocessing.spawn``, ``torchrun``).

Each is the time from the call to the ``kind == "train", step == 1`` record of any rank in
``rank*.jsonl`` (read with :class:`mgtutorial.runtime.runlog.RunReader`; the record's own ``time``
stamp, so the polling period does not count). Measured by launch_and_scaling.py, which imports this
module; ``python benchmarks/launch_timing.py --cold-once TMP`` is how :func:`time_launch_cold`
times one launch in a fresh process (it prints the seconds).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch.multiprocessing as mp

from mgtutorial import ddp
from mgtutorial.runtime import runlog
from mgtutorial.runtime.launcher import free_port, launch

NPROCS = 2

POLL_S = 0.02

RUN_TIMEOUT_S = 180.0


def latency_config() -> ddp.DDPConfig:
    """The tiny run whose start-up we time: 5 steps on digits, no evaluation, gloo."""
    return ddp.DDPConfig(dataset="digits", max_steps=5, evaluate=False, backend="gloo")


def spawn_rank(local_rank: int, cfg_dict: dict, world_size: int, port: int, run_dir: str) -> None:
    """``torch.multiprocessing.spawn`` target: set the torchrun environment, run ``ddp.worker``."""
    os.environ.update(
        {
            "RANK": str(local_rank),
            "LOCAL_RANK": str(local_rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            runlog.RUN_DIR_ENV: run_dir,
            "GLOO_SOCKET_IFNAME": "lo",
            "OMP_NUM_THREADS": "1",
        }
    )
    for fd, stream in ((1, "out"), (2, "err")):  # like launch(): rank<r>.out|.err, not our table
        with open(Path(run_dir) / f"rank{local_rank}.{stream}", "ab") as f:
            os.dup2(f.fileno(), fd)
    ddp.worker(ddp.DDPConfig(**cfg_dict))


def wait_first_step(run_dir: Path, t0: float, alive, timeout: float = RUN_TIMEOUT_S) -> float:
    """Seconds from ``t0`` (unix s) to the first ``train`` record with step 1 in ``run_dir``.

    ``alive()`` says whether the job still runs; raises RuntimeError if it ended first or on
    timeout.
    """
    reader = runlog.RunReader(run_dir)
    deadline = time.monotonic() + timeout
    while True:
        for rec in reader.read_new():
            if rec.get("kind") == "train" and rec.get("step") == 1:
                return rec["time"] - t0
        if not alive():
            for rec in reader.read_new():  # written just before it ended
                if rec.get("kind") == "train" and rec.get("step") == 1:
                    return rec["time"] - t0
            raise RuntimeError(f"the job ended before logging step 1; see {run_dir}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no step 1 in {run_dir} after {timeout:.0f} s")
        time.sleep(POLL_S)


def time_launch(tmp: Path) -> float:
    """(a) via ``mgtutorial.launch``."""
    t0 = time.time()
    run = launch(
        ddp.worker, latency_config(), NPROCS, runs_dir=tmp, name="launch", threads_per_rank=1
    )
    try:
        try:
            dt = wait_first_step(run.run_dir, t0, lambda: run.alive() > 0)
        except RuntimeError:
            run.wait(timeout=10)  # a rank failed: raise its WorkerFailed (root cause) instead
            raise
        run.wait(timeout=RUN_TIMEOUT_S)
        return dt
    finally:
        if run.status == "running":
            run.stop()


def time_launch_cold(tmp: Path) -> float:
    """(a) via ``mgtutorial.launch`` as the first launch of a fresh Python process."""
    out = subprocess.run(
        [sys.executable, __file__, "--cold-once", str(tmp)],  # this file's main()
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    if out.returncode != 0:
        raise RuntimeError(f"the cold launch failed:\n{out.stderr[-3000:]}")
    return float(out.stdout.strip().splitlines()[-1])


def time_mp_spawn(tmp: Path) -> float:
    """(a) via ``torch.multiprocessing.spawn(join=False)`` of :func:`spawn_rank`."""
    run_dir = tmp / f"mp_spawn-{time.time_ns()}"
    run_dir.mkdir()
    cfg = dataclasses.asdict(latency_config())
    t0 = time.time()
    ctx = mp.spawn(
        spawn_rank,
        args=(cfg, NPROCS, free_port(), str(run_dir)),
        nprocs=NPROCS,
        join=False,
        daemon=True,  # ended if we exit
        start_method="spawn",
    )
    try:
        try:
            dt = wait_first_step(run_dir, t0, lambda: any(p.is_alive() for p in ctx.processes))
        except RuntimeError:
            ctx.join(timeout=10)  # a rank failed: raise its ProcessRaisedException instead
            raise
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while not ctx.join(timeout=1.0):  # raises ProcessRaisedException if a rank failed
            if time.monotonic() > deadline:
                raise RuntimeError(f"mp.spawn ranks still running after {RUN_TIMEOUT_S:.0f} s")
        return dt
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
        for p in ctx.processes:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join()


def time_torchrun(tmp: Path) -> float:
    """(a) via ``torchrun --standalone`` running ``python -m mgtutorial ddp`` (subprocess)."""
    torchrun = Path(sys.executable).with_name("torchrun")
    name = f"torchrun-{time.time_ns()}"
    cfg = latency_config()
    cmd = [
        str(torchrun),
        "--standalone",
        "--nproc-per-node",
        str(NPROCS),
        "-m",
        "mgtutorial",
        "ddp",
        "--dataset",
        cfg.dataset,
        "--max-steps",
        str(cfg.max_steps),
        "--epochs",
        "1",
        "--backend",
        cfg.backend,
        "--runs-dir",
        str(tmp),
        "--run-name",
        name,
    ]
    # The CLI has no switch for evaluate=False: torchrun's ranks also score the test set once after
    # step 5 and rank 0 draws loss.png. Neither happens before step 1, so the timing is comparable.
    envs = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    with open(tmp / f"{name}.log", "wb") as log:
        t0 = time.time()
        proc = subprocess.Popen(
            cmd, env=envs, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            try:
                dt = wait_first_step(tmp / name, t0, lambda: proc.poll() is None)
            except RuntimeError as exc:
                raise RuntimeError(f"{exc}\n{_tail(tmp / f'{name}.log')}") from None
            code = proc.wait(timeout=RUN_TIMEOUT_S)
            if code != 0:
                raise RuntimeError(f"torchrun exited with {code}\n{_tail(tmp / f'{name}.log')}")
            return dt
        finally:
            if proc.poll() is None:
                _kill_group(proc, signal.SIGTERM)
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    _kill_group(proc, signal.SIGKILL)
                    proc.wait()


def _tail(path: Path, n: int = 3000) -> str:
    """The end of a log file that is about to be deleted with the temporary folder."""
    return "the end of its output:\n" + path.read_text(errors="replace")[-n:]


def _kill_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # torchrun and its ranks (its own session)
    except ProcessLookupError:
        pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cold-once", metavar="TMP", required=True, help="runs folder")
    print(time_launch(Path(parser.parse_args().cold_once)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
