"""torchrun's output made readable: no paths, process ids or C++ stacks of this machine.

Used by notebooks/05a_torchrun_multinode.ipynb, 05b_elastic_restarts.ipynb and
05c_hangs_and_debugging.ipynb, whose cells show what the ranks and the agents of a ``torchrun``
job said (:func:`digest`) and the commands as one would type them (:func:`shell`). The agents' log
format is TorchElastic's (https://pytorch.org/docs/stable/elastic/run.html).
"""

from __future__ import annotations

import os
import re
from pathlib import Path


def clean(text: str) -> str:
    """``text`` without this machine's specifics: the repository's, the home folder's, the Python
    packages' and torchrun's temporary log folder's paths, process ids (``pid 123``,
    ``pid: 123``, ``process 123``) and torchrun's ``of binary: /…/python``."""
    root = Path(__file__).resolve().parents[2]
    for path, short_ in ((Path.cwd(), ""), (root, ""), (Path.home(), "~" + os.sep)):
        text = text.replace(str(path) + os.sep, short_)
    text = re.sub(r" of binary: \S+", "", text)
    text = re.sub(r"[^\s\"']*/site-packages/", "", text)  # torch/… as imported
    text = re.sub(r"/\S*/torchelastic_[^/\s]+/[^/\s]+/", "<agent's log dir>/", text)
    return re.sub(r"\b(pid:? |process )\d+", r"\1…", text)


def shell(cmd: list[str]) -> str:
    """A command list as one would type it (``torchrun`` instead of the environment's full path)."""
    return " ".join(["torchrun", *cmd[1:]] if cmd[0].endswith("torchrun") else cmd)


def short(message: str) -> str:
    """``message`` without gloo's source-file prefixes ``[/…/unbound_buffer.cc:78] ``."""
    return re.sub(r"\[[^\]]*\.cc:\d+\] ", "", message)


_AGENT_LINE = re.compile(r"\[?([WEI])\d{4} [\d:.]+ +\d* *\S+\] (.*)")


def digest(output: str) -> str:
    """What a torchrun output says, for a reader: the ranks' prints (``[rank N] …``), their one-line
    errors, and the agents' one-line messages as ``agent W: …`` (timestamps, pids and file names
    dropped); tracebacks, C++ stacks and the agents' INFO lines are counted, not shown."""
    keep, dropped, info = [], 0, 0
    for line in clean(output).splitlines():
        agent = _AGENT_LINE.match(line)
        if line.startswith("[rank ") or re.match(r"\[rank\d+\]: \w+Error", line):
            keep.append(short(line))
        elif agent and agent[1] == "I":  # INFO (LOGLEVEL=INFO): read with agent_times
            dropped, info = dropped + 1, info + 1
        elif agent and not agent[2][:1].isspace() and not agent[2].startswith("Traceback"):
            keep.append(f"agent {agent[1]}: {short(agent[2])}")
        elif line.strip():
            dropped += 1
    kinds = "tracebacks and C++ stacks" + (", agent INFO lines" if info else "")
    more = f"\n({dropped} more lines: {kinds})" if dropped else ""
    return "\n".join(keep) + more


_STAMP = re.compile(r"\[?([WEI])(\d{4} [\d:]+\.\d+) +\d+ +\S+\] (\S.*)")


def agent_times(output: str, year: int) -> list[tuple[float, str, str]]:
    """The agents' log lines of ``output`` as (unix time, level, message), in order. TorchElastic
    stamps them ``I1202 07:28:12.090000`` (month, day, local time; ``LOGLEVEL=INFO`` for the I
    lines): ``year`` completes the date. Comparable with the ranks' records' ``time``."""
    import datetime

    times = []
    for line in output.splitlines():
        if m := _STAMP.match(line):
            when = datetime.datetime.strptime(f"{year}{m[2]}", "%Y%m%d %H:%M:%S.%f")
            times.append((when.timestamp(), m[1], m[3]))
    return times
