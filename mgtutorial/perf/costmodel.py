"""What communication costs (chapter 09): bandwidths, the α–β fit, ring time, DDP's buckets and
the step time they leave exposed, and the links of a GPU cluster.

Taught in notebooks/09a_cost_model.ipynb (sections 2 and 4) and notebooks/09b_measurement.ipynb
(section 1). Pure arithmetic (no process group, no timing), so the tests check every function on
hand-computed cases. Follows nccl-tests' definitions of algorithm and bus bandwidth
(https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md), the α–β (latency–bandwidth)
model of collectives and https://pytorch.org/docs/stable/notes/ddp.html (buckets, overlap). FLOPs,
MFU and the predicted step of a transformer on a cluster are in :mod:`mgtutorial.perf.scaling`.

:class:`Dtypes` is the one table of which dtype each kind of tensor has (parameters, the copy the
matmuls use, gradients as reduced, optimizer state, activations); chapters 07 (memory), 08 (what TP
moves) and 09 (the step on a cluster) all price bytes from it.

Units: bytes, seconds; bandwidths in bytes per second.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from mgtutorial.perf.hardware import H100, Hardware  # noqa: F401  (the links of a cluster)

Collective = Literal["all_reduce", "all_gather", "reduce_scatter", "broadcast"]
"""The collectives the chapter times and models (nccl-tests' names)."""
COLLECTIVES = get_args(Collective)

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
"""Bytes per element of the dtypes the course prices."""
TensorKind = Literal["params", "compute", "grads", "optimizer", "activations"]


@dataclass(frozen=True)
class Dtypes:
    """The dtype of each kind of tensor in one training recipe (names of :data:`DTYPE_BYTES`).

    One table for chapters 07–09: memory per rank (07), TP's activation traffic (08), DDP's and
    FSDP2's gradient and parameter traffic (09) are all priced with :meth:`nbytes`.
    """

    name: str
    params: str = "float32"
    """Parameters as held between steps (FSDP2's sharded parameters: the master copy)."""
    compute: str = "float32"
    """Parameters as the matmuls use them (FSDP2's ``param_dtype``, what its all-gather moves)."""
    grads: str = "float32"
    """Gradients as held and reduced (DDP's buckets, FSDP2's ``reduce_dtype``)."""
    optimizer: tuple[str, ...] = ("float32", "float32")
    """Adam(W)'s state per parameter: ``exp_avg``, ``exp_avg_sq`` (and an fp32 master copy when
    ``params`` is not fp32)."""
    activations: str = "float32"
    """Activations (what TP all-reduces, what backward keeps)."""

    def nbytes(self, kind: TensorKind) -> int:
        """Bytes per element (per parameter for "optimizer": all its states together)."""
        if kind == "optimizer":
            return sum(DTYPE_BYTES[d] for d in self.optimizer)
        return DTYPE_BYTES[getattr(self, kind)]

    @property
    def per_param(self) -> tuple[int, int, int]:
        """Bytes per parameter held between steps: (params, grads, optimizer state)."""
        return self.nbytes("params"), self.nbytes("grads"), self.nbytes("optimizer")


FP32 = Dtypes("fp32")
"""Everything float32: 4 + 4 + 8 bytes per parameter."""
BF16_FP32_REDUCE = Dtypes(
    "bf16 compute, fp32 parameters and gradients", compute="bfloat16", activations="bfloat16"
)
"""DDP under ``torch.autocast(dtype=bfloat16)`` (fp32 parameters, so fp32 gradients all-reduced)
and FSDP2 with ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`` (bf16
all-gather, fp32 reduce-scatter, fp32 shards at rest): 4 + 4 + 8 bytes per parameter held."""
ZERO_MIXED = Dtypes(
    "the ZeRO paper's mixed precision",
    params="bfloat16",
    compute="bfloat16",
    grads="bfloat16",
    optimizer=("float32", "float32", "float32"),
    activations="bfloat16",
)
"""The ZeRO paper's accounting (§3): 2 + 2 + 12 bytes per parameter (bf16/fp16 parameters and
gradients, an fp32 master copy and Adam's two states)."""


def bus_factor(op: Collective, n: int) -> float:
    """nccl-tests' bus-bandwidth factor: busbw = algbw × factor.

    all_reduce 2(n−1)/n; all_gather and reduce_scatter (n−1)/n; broadcast 1. The factor turns the
    algorithm bandwidth into the bandwidth each link must carry in an optimal (ring) algorithm, so
    busbw is comparable across collectives and world sizes and approaches the link's speed.

    Raises:
        ValueError: unknown ``op`` or ``n`` < 1.
    """
    if n < 1:
        raise ValueError(f"n={n}: a process group has at least 1 rank.")
    factors = {
        "all_reduce": 2 * (n - 1) / n,
        "all_gather": (n - 1) / n,
        "reduce_scatter": (n - 1) / n,
        "broadcast": 1.0,
    }
    if op not in factors:
        raise ValueError(f"op={op!r} is not one of {COLLECTIVES}.")
    return factors[op]


def algbw(nbytes: float, seconds: float) -> float:
    """Algorithm bandwidth in bytes/s: the tensor's size ÷ the collective's time.

    ``nbytes`` is nccl-tests' size: the all-reduced or broadcast buffer, all-gather's *output*,
    reduce-scatter's *input* (world size × each rank's result).
    """
    if seconds <= 0:
        raise ValueError(f"seconds={seconds}: a measured time must be positive.")
    return nbytes / seconds


def busbw(op: Collective, nbytes: float, seconds: float, n: int) -> float:
    """Bus bandwidth in bytes/s: :func:`algbw` × :func:`bus_factor`."""
    return algbw(nbytes, seconds) * bus_factor(op, n)


def fit_alpha_beta(nbytes: list[float], seconds: list[float]) -> tuple[float, float]:
    """Least-squares fit of ``t = α + β·S`` → (α in s, β in s/byte).

    Each point is weighted by 1/t, i.e. the fit minimises *relative* errors, so 4 KiB points
    (tens of µs) count as much as 64 MiB points (tens of ms), as on a log–log plot.

    Raises:
        ValueError: fewer than 2 points, different lengths, or all sizes equal.
    """
    if len(nbytes) != len(seconds) or len(nbytes) < 2:
        raise ValueError(
            f"need ≥ 2 (size, time) pairs of equal length, got {len(nbytes)} and {len(seconds)}."
        )
    w = [1.0 / t**2 for t in seconds]
    sw = sum(w)
    sx = sum(wi * x for wi, x in zip(w, nbytes))
    sy = sum(wi * y for wi, y in zip(w, seconds))
    sxx = sum(wi * x * x for wi, x in zip(w, nbytes))
    sxy = sum(wi * x * y for wi, x, y in zip(w, nbytes, seconds))
    det = sw * sxx - sx * sx
    if det == 0:
        raise ValueError("all sizes are equal: α and β cannot be told apart.")
    beta = (sw * sxy - sx * sy) / det
    return (sy - beta * sx) / sw, beta


def alpha_beta_time(nbytes: float, alpha: float, beta: float) -> float:
    """Predicted time of one collective of ``nbytes``: ``α + β·S`` (seconds)."""
    return alpha + beta * nbytes


def ring_time(op: Collective, nbytes: float, n: int, link_bw: float, latency: float) -> float:
    """Time of ``op`` on ``n`` ranks in a ring with per-step ``latency`` (s) and ``link_bw`` (B/s).

    A ring all-reduce is a reduce-scatter then an all-gather: 2(n−1) steps, each sending S/n bytes,
    so ``2(n−1)·latency + 2(n−1)/n · S / link_bw``; all-gather and reduce-scatter take n−1 steps;
    broadcast is taken as pipelined (factor 1, n−1 latencies). One rank: nothing to send, 0 s.
    """
    if n == 1:
        return 0.0
    steps = 2 * (n - 1) if op == "all_reduce" else n - 1
    return steps * latency + bus_factor(op, n) * nbytes / link_bw


def bucket_layout(
    grad_bytes: list[int], bucket_cap_bytes: int, first_bucket_bytes: int | None = None
) -> list[int]:
    """Bytes per DDP bucket, given the gradients' sizes in the order backward produces them.

    DDP's rule (its C++ reducer, after the first iteration rebuilds buckets in the order
    gradients became ready): add gradients to the current bucket until it holds at least its
    limit, then start the next. The first bucket's limit is ``first_bucket_bytes`` (1 MiB when
    ``bucket_cap_mb`` is left at its default; otherwise the cap), so the first all-reduce starts
    early. A gradient larger than the limit gets a bucket of its own.
    """
    limits_first = bucket_cap_bytes if first_bucket_bytes is None else first_bucket_bytes
    buckets, current = [], 0
    for b in grad_bytes:
        current += b
        if current >= (limits_first if not buckets else bucket_cap_bytes):
            buckets.append(current)
            current = 0
    if current:
        buckets.append(current)
    return buckets


def ddp_step_time(
    fwd_s: float,
    bwd_s: float,
    opt_s: float,
    bucket_bytes: list[int],
    alpha: float,
    beta: float,
    overlap: bool = True,
    extra_s: float = 0.0,
    ready: list[float] | None = None,
) -> dict:
    """Predicted time of one DDP step: compute plus the communication *not* hidden behind backward.

    Bucket i is ready when backward has produced its gradients: at ``bwd_s × ready[i]`` (the
    fraction of backward done by then; default: proportional to the gradient bytes so far). Buckets
    are all-reduced one after another, each taking ``α + β·bytes``, none before it is ready. With
    ``overlap=False`` all of them start after backward. ``extra_s``: other per-step costs (the
    loss all-reduce of the logging, data loading).

    Returns a dict (seconds): ``step``, ``compute`` (fwd + bwd + opt), ``comm`` (sum of the
    all-reduces), ``exposed`` (what lies after backward's end), ``hidden`` (comm − exposed).
    """
    total, done, end = sum(bucket_bytes), 0, 0.0
    for i, b in enumerate(bucket_bytes):
        done += b
        fraction = (ready[i] if ready else done / total) if overlap else 1.0
        end = max(bwd_s * fraction, end) + alpha_beta_time(b, alpha, beta)
    comm = sum(alpha_beta_time(b, alpha, beta) for b in bucket_bytes)
    exposed = max(0.0, end - bwd_s) if bucket_bytes else 0.0
    compute = fwd_s + bwd_s + opt_s
    return {
        "step": compute + exposed + extra_s,
        "compute": compute,
        "comm": comm,
        "exposed": exposed,
        "hidden": comm - exposed,
    }


def ddp_added_time(bucket_bytes: list[int], alpha: float, beta: float, own_s: float) -> dict:
    """What DDP adds to a step of ranks that already train in lockstep, where the all-reduces run
    on the cores that compute (gloo on a CPU): nothing is hidden, every bucket's α + β·bytes is
    paid, plus DDP's own work on the training thread.

    ``own_s``: DDP's own work per step (s), its autograd hooks and the copies of the gradients
    into the flat buckets and back, measured as a DDP model on a world of one minus the plain
    model (:func:`mgtutorial.perf.sweeps.ddp_own_worker`); ``alpha`` (s) and ``beta`` (s/byte)
    from :func:`fit_alpha_beta`, in wall or CPU time alike.

    Returns a dict (seconds): ``all_reduces`` (Σ α + β·bytes), ``own`` and ``added`` (their sum).
    Raises ValueError for a negative ``own_s``. Taught in notebooks/09b_measurement.ipynb (section
    1); https://pytorch.org/docs/stable/notes/ddp.html.
    """
    if own_s < 0:
        raise ValueError(f"own_s={own_s}: DDP's own work is a duration, ≥ 0 s.")
    comm = sum(alpha_beta_time(b, alpha, beta) for b in bucket_bytes)
    return {"all_reduces": comm, "own": own_s, "added": comm + own_s}


def added_verdict(predicted: float, measured: float, spread: float, rel: float = 0.15) -> str:
    """What one run can say about the cost DDP adds (any unit, the same for all three): measured
    = DDP − lockstep; ``spread`` = the difference between two identical lockstep runs, one
    pair's estimate of the noise. "✗ model below" or "✗ model above" when ``|predicted −
    measured|`` > ``spread`` + ``rel`` × predicted (a miss larger than the noise); otherwise
    "not resolved" when ``spread`` ≥ ``predicted`` (the noise could hide the whole term), else
    "✓". Taught in notebooks/09b_measurement.ipynb (section 1)."""
    if abs(predicted - measured) > spread + rel * predicted:
        return "✗ model " + ("below" if predicted < measured else "above")
    if spread >= predicted:
        return "not resolved (spread ≥ predicted)"
    return "✓"
