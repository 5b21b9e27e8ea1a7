"""The root conftest's kernel start: a notebook kernel that dies while starting is started once
more; a second death and any other error still fail."""

import importlib.util
from pathlib import Path

import nbval.kernel
import pytest

_spec = importlib.util.spec_from_file_location(
    "root_conftest", Path(__file__).resolve().parents[1] / "conftest.py"
)
conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(conftest)


def _starter(errors: list[str]):
    calls = []

    def start(*args, **kwargs):
        calls.append(args)
        if len(calls) <= len(errors):
            raise RuntimeError(errors[len(calls) - 1])
        return "km", "kc"

    return start, calls


def _wrapped(monkeypatch, errors):
    start, calls = _starter(errors)
    monkeypatch.setattr(nbval.kernel, "start_new_kernel", start)
    assert conftest.start_kernels_again_once()
    return nbval.kernel.start_new_kernel, calls


def test_a_kernel_that_died_while_starting_is_started_again(monkeypatch):
    start, calls = _wrapped(monkeypatch, ["Kernel died before replying to kernel_info"])
    with pytest.warns(UserWarning, match="starting it again"):
        assert start(60) == ("km", "kc")
    assert len(calls) == 2


def test_a_kernel_that_dies_twice_fails(monkeypatch):
    start, calls = _wrapped(monkeypatch, ["Kernel died before replying to kernel_info"] * 2)
    with pytest.warns(UserWarning), pytest.raises(RuntimeError, match="died before replying"):
        start(60)
    assert len(calls) == 2


def test_another_start_error_is_not_retried(monkeypatch):
    start, calls = _wrapped(monkeypatch, ["Kernel didn't respond to heartbeats in 60 seconds"])
    with pytest.raises(RuntimeError, match="heartbeats"):
        start(60)
    assert len(calls) == 1
