"""Comparing a parallel run with its single-process reference, and counting collectives.

Every chapter proves a parallel result equal to one process (``torch.testing.assert_close`` in the
tests, the largest difference printed in the notebooks); this is the one place that computes it.
Collective counts come from ``torch.distributed.tensor.debug.CommDebugMode``
(https://pytorch.org/docs/stable/distributed.tensor.html#debugging), whose keys name the same
collective differently by the API that issued it (c10d's in-place ``allreduce_``, functional
collectives' ``all_reduce``, ``all_gather_into_tensor``…): :func:`collective_name` makes them one.
Taught in notebooks/07a_zero_memory.ipynb, 07b_fsdp2.ipynb, 08a_tensor_parallel.ipynb and
08b_tp_mesh_and_cost.ipynb.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

COLLECTIVE_NAMES = {
    "allreduce_": "all_reduce",
    "all_reduce": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "_allgather_base_": "all_gather",
    "allgather_": "all_gather",
    "all_gather": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "reduce_scatter": "reduce_scatter",
    "broadcast_": "broadcast",
    "broadcast": "broadcast",
    "all_to_all_single": "all_to_all",
    "alltoall_base_": "all_to_all",
}
"""An op's own name (c10d's or the functional collectives') -> the collective it performs."""


FLOAT32_TOLERANCE = {"cpu": 1e-5, "cuda": 1e-4}
"""Largest |parallel − one process| accepted after a few float32 steps, by the ranks' device type:
on CPU only the order of the additions differs from the reference; on GPUs (TF32 off) the kernels
round differently from the CPU reference too."""


def float32_tolerance(device_type: str) -> float:
    """:data:`FLOAT32_TOLERANCE` for ranks on ``device_type`` ("cpu" or "cuda"; KeyError
    otherwise). Taught in notebooks/02_ddp.ipynb (section 4)."""
    return FLOAT32_TOLERANCE[device_type]


def _full(t) -> torch.Tensor:
    """A plain CPU float tensor: a DTensor gathered in full first."""
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return t.detach().float().cpu()


def max_abs_diff(a, b) -> float:
    """Largest ``|a − b|`` over two tensors, two state dicts with the same keys (``b``'s keys are
    compared) or two sequences of tensors; DTensors are compared in full, on the CPU, as float32.

    Raises:
        KeyError: a key of ``b`` is missing from ``a``.
        ValueError: the shapes differ, or there is nothing to compare.
    """
    if isinstance(b, Mapping):
        pairs = [(a[k], b[k]) for k in b]
    elif isinstance(b, torch.Tensor):
        pairs = [(a, b)]
    else:
        pairs = list(zip(a, b, strict=True))
    if not pairs:
        raise ValueError("nothing to compare")
    worst = 0.0
    for x, y in pairs:
        x, y = _full(x), _full(y)
        if x.shape != y.shape:
            raise ValueError(f"shapes differ: {tuple(x.shape)} vs {tuple(y.shape)}")
        if x.numel():
            worst = max(worst, (x - y).abs().max().item())
    return worst


def collective_name(op) -> str:
    """The collective an op performs ("all_reduce", "all_gather", "reduce_scatter", …) from an
    ``OpOverload``/``OpOverloadPacket`` or its name; other names are returned as they are."""
    name = str(getattr(op, "_overloadpacket", op)).rsplit(".", 1)[-1]
    return COLLECTIVE_NAMES.get(name, name)


def collective_counts(mode) -> dict[str, int]:
    """``{collective: calls}`` from a finished ``CommDebugMode``, names made one (sorted)."""
    counts: dict[str, int] = {}
    for op, n in mode.get_comm_counts().items():
        name = collective_name(op)
        counts[name] = counts.get(name, 0) + n
    return dict(sorted(counts.items()))


def nbytes(t) -> int:
    """Bytes of a tensor, or of the first tensor of a (nested) list/tuple (a collective's buffer:
    c10d's ``allgather_`` takes a list of lists)."""
    while isinstance(t, (list, tuple)):
        t = t[0]
    return t.numel() * t.element_size()


def counting_mode():
    """A ``CommDebugMode`` (imported on first use) that also keeps each collective call's sizes:
    ``mode.sizes`` maps a collective's name to ``[[bytes in, bytes out], …]`` and
    ``mode.counts()`` gives :func:`collective_counts`. Use it as
    ``with counting_mode() as mode:``."""
    from torch.distributed.tensor.debug import CommDebugMode

    collectives = set(COLLECTIVE_NAMES.values())

    class CollectiveBytes(CommDebugMode):
        def __init__(self):
            super().__init__()
            self.sizes: dict[str, list[list[int]]] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            name = collective_name(func)
            if out is not NotImplemented and name == "all_to_all":
                # c10d's alltoall_base_(output, input, …) returns only its work
                self.sizes.setdefault(name, []).append([nbytes(args[1]), nbytes(args[0])])
            elif out is not NotImplemented and name in collectives:
                # c10d's ops return (tensors, work): the tensors are the call's own buffers
                got = args[0] if isinstance(out, tuple) else out
                self.sizes.setdefault(name, []).append([nbytes(args[0]), nbytes(got)])
            return out

        def counts(self) -> dict[str, int]:
            return collective_counts(self)

    return CollectiveBytes()


def c10d_counting_mode():
    """A dispatch mode (imported on first use) that counts every ``c10d`` op by name: the
    collectives and also the point-to-point ``c10d.send`` / ``c10d.recv_`` of model and pipeline
    parallelism, which ``CommDebugMode`` does not count. ``mode.counts`` maps an op's name to its
    count. Use it as ``with c10d_counting_mode() as mode:``; taught in
    notebooks/06b_article_model_parallel.ipynb (section 2.4); follows
    https://pytorch.org/docs/stable/notes/extending.html (``TorchDispatchMode``)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class C10dOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.counts: dict[str, int] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "c10d":
                name = str(func.overloadpacket)
                self.counts[name] = self.counts.get(name, 0) + 1
            return func(*args, **(kwargs or {}))

    return C10dOps()


def counted(fn, *args):
    """Run ``fn(*args)`` while counting; returns (its result, {collective: count}, sizes)."""
    with counting_mode() as mode:
        out = fn(*args)
    return out, mode.counts(), mode.sizes


def all_close(pairs: Iterable[tuple], rtol: float = 1e-5, atol: float = 1e-5) -> None:
    """``torch.testing.assert_close`` over (actual, expected) pairs, DTensors compared in full."""
    for actual, expected in pairs:
        torch.testing.assert_close(_full(actual), _full(expected), rtol=rtol, atol=atol)
