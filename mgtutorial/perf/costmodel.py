"""The cost model of chapter 09: bandwidths, the α–β fit, DDP's buckets, step time, and a cluster.

Taught in notebooks/09_performance.ipynb. Pure arithmetic (no process group, no timing), so the
tests check every function on hand-computed cases. Follows nccl-tests' definitions of algorithm and
bus bandwidth (https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md), the α–β
(latency–bandwidth) model of collectives, https://pytorch.org/docs/stable/notes/ddp.html (buckets,
overlap) and the MFU definition of the PaLM paper (Chowdhery et al. 2022, appendix B).

Units: bytes, seconds, FLOPs; bandwidths in bytes per second.
"""

from __future__ import annotations

from dataclasses import dataclass

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")


def bus_factor(op: str, n: int) -> float:
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


def busbw(op: str, nbytes: float, seconds: float, n: int) -> float:
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


def ring_time(op: str, nbytes: float, n: int, link_bw: float, latency: float) -> float:
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


def conv2d_flops(batch: int, c_in: int, c_out: int, kernel: int, h_out: int, w_out: int) -> int:
    """Forward FLOPs of a Conv2d (2 per multiply-add): ``2·B·C_out·H_out·W_out·C_in·k²``."""
    return 2 * batch * c_out * h_out * w_out * c_in * kernel * kernel


def linear_flops(batch: int, d_in: int, d_out: int) -> int:
    """Forward FLOPs of a Linear layer's matmul: ``2·B·d_in·d_out``."""
    return 2 * batch * d_in * d_out


def train_flops(forward_flops: float) -> float:
    """FLOPs of forward + backward: backward costs twice the forward (input and weight gradients)."""
    return 3 * forward_flops


def mfu(params: float, tokens: float, seconds: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: ``6·Ψ·tokens / (seconds · peak)`` (Ψ = parameters).

    6Ψ per token = 2Ψ forward + 4Ψ backward; it leaves out attention's score FLOPs and any
    recomputation, which is why it is a *model* (not hardware) FLOP count.
    """
    return 6 * params * tokens / (seconds * peak_flops)


@dataclass(frozen=True)
class Hardware:
    """Published numbers of one GPU and its links (predictions only; see ``sources``)."""

    name: str
    peak_flops: float
    """Dense bf16 FLOP/s of one GPU."""
    intra_bw: float
    """Bytes/s per GPU per direction inside a node."""
    inter_bw: float
    """Bytes/s per GPU per direction between nodes."""
    gpus_per_node: int
    latency: float
    """Seconds per ring step (an assumption of the order nccl-tests show for small messages)."""
    sources: str
    nics_per_node: int = 1
    """Network ports per node, each at ``inter_bw``. NCCL runs one ring (channel) per port and
    each ring leaves a node once, so the ports share a ring collective's inter-node traffic."""

    def ring_bw(self, n_gpus: int) -> float:
        """Bus bandwidth (B/s per direction) of a ring over ``n_gpus``: ``intra_bw`` inside a node;
        beyond, ``min(intra_bw, nics_per_node × inter_bw)`` (the node's ports together)."""
        if n_gpus <= self.gpus_per_node:
            return self.intra_bw
        return min(self.intra_bw, self.nics_per_node * self.inter_bw)


H100 = Hardware(
    name="H100 SXM (DGX H100: 8 per node, NVLink 4, one 400 Gb/s NDR InfiniBand port per GPU)",
    peak_flops=989e12,
    intra_bw=450e9,
    inter_bw=50e9,
    gpus_per_node=8,
    latency=5e-6,
    nics_per_node=8,
    sources="NVIDIA H100 Tensor Core GPU datasheet (https://www.nvidia.com/en-us/data-center/h100/): "
    "989 TFLOP/s dense BF16 (1979 with sparsity), NVLink 900 GB/s bidirectional = 450 GB/s each "
    "way; NVIDIA DGX H100 user guide: 8 ConnectX-7 ports per node, NDR InfiniBand 400 Gb/s = "
    "50 GB/s per port each way; the 5 µs per ring step is an assumption.",
)


@dataclass(frozen=True)
class Transformer:
    """A GPT-style model: ``layers`` blocks of width ``hidden`` on sequences of ``seq`` tokens."""

    layers: int = 24
    hidden: int = 2048
    seq: int = 2048

    @property
    def params(self) -> float:
        """Ψ ≈ 12·L·h² (attention 4h², MLP 8h²; embeddings left out)."""
        return 12 * self.layers * self.hidden**2


def predict_step(
    strategy: str,
    model: Transformer,
    n_gpus: int,
    tokens_per_gpu: float,
    hw: Hardware = H100,
    link_bw: float | None = None,
    efficiency: float = 0.5,
    bytes_per_value: int = 2,
) -> dict:
    """Predicted step time of ``strategy`` ("ddp" | "fsdp2" | "tp") on ``n_gpus`` (a *prediction*).

    Compute: ``6·Ψ·tokens_per_gpu / (peak · efficiency)`` (``efficiency``: the fraction of peak the
    kernels reach). Communication (bf16, ring, :func:`ring_time`) at ``link_bw`` if given, else
    :meth:`Hardware.ring_bw` (NVLink inside a node; beyond, the node's InfiniBand ports together).
    Overlap is taken as perfect, an optimistic bound (the last bucket or shard cannot hide):

    * ddp: one all-reduce of the 2Ψ gradient bytes, as if it could start when backward starts and
      hide behind all of it (⅔ of compute);
    * fsdp2: all-gather of the parameters in forward and again in backward, reduce-scatter of the
      gradients: 3 × (n−1)/n × 2Ψ bytes, prefetched, so overlapped with all of compute;
    * tp: per block 4 all-reduces of the activations (tokens × hidden × 2 bytes: 2 in forward,
      2 in backward, Megatron's f/g) on the critical path, not overlapped.

    Returns a dict: ``compute``, ``comm``, ``exposed``, ``step`` (s), ``efficiency`` = compute/step
    (the scaling efficiency against one GPU doing the same per-GPU work without communication).
    """
    if strategy not in ("ddp", "fsdp2", "tp"):
        raise ValueError(f"strategy={strategy!r} is not 'ddp', 'fsdp2' or 'tp'.")
    if n_gpus < 1:
        raise ValueError(f"n_gpus={n_gpus}: need at least 1.")
    bw = link_bw or hw.ring_bw(n_gpus)
    compute = 6 * model.params * tokens_per_gpu / (hw.peak_flops * efficiency)
    grad_bytes = bytes_per_value * model.params
    if strategy == "ddp":
        comm = ring_time("all_reduce", grad_bytes, n_gpus, bw, hw.latency)
        exposed = max(0.0, comm - compute * 2 / 3)
    elif strategy == "fsdp2":
        comm = 2 * ring_time("all_gather", grad_bytes, n_gpus, bw, hw.latency) + ring_time(
            "reduce_scatter", grad_bytes, n_gpus, bw, hw.latency
        )
        exposed = max(0.0, comm - compute)
    else:
        act_bytes = bytes_per_value * tokens_per_gpu * n_gpus * model.hidden
        comm = 4 * model.layers * ring_time("all_reduce", act_bytes, n_gpus, bw, hw.latency)
        exposed = comm
    step = compute + exposed
    return {
        "compute": compute,
        "comm": comm,
        "exposed": exposed,
        "step": step,
        "efficiency": compute / step,
    }


def article_cnn_flops(
    batch: int,
    in_shape: tuple[int, int, int] = (3, 32, 32),
    channels: int = 32,
    kernel: int = 5,
    hidden: int = 64,
    classes: int = 10,
) -> int:
    """Forward FLOPs of :class:`mgtutorial.common.models.ArticleCNN` for ``batch`` images (conv + 2 linears;
    ReLU, pooling and the loss are left out: a few FLOPs per element, not per weight)."""
    from mgtutorial.common.models import cnn_flatten_size, conv_out_size

    c, h, w = in_shape
    conv = conv2d_flops(
        batch, c, channels, kernel, conv_out_size(h, kernel), conv_out_size(w, kernel)
    )
    flat = cnn_flatten_size(in_shape, channels, kernel)
    return conv + linear_flops(batch, flat, hidden) + linear_flops(batch, hidden, classes)


def scaling_ratios(values: dict[int, list[dict]]) -> list[dict]:
    """Per batch size: the 2-rank ceiling, DDP's 2-rank scaling, and how close DDP gets to the ceiling.

    ``values``: rank → :func:`mgtutorial.perf.timing.step_worker` results of one 2-rank job whose variants
    include, per batch size, the modes "alone", "independent" and "ddp" (variants with other DDP
    keywords are ignored). Throughputs are ``samples_per_s``:

    * ``ceiling_2v1`` = (independent rank 0 + rank 1) / alone: what the machine gives two ranks
      with no communication at all (2.0 if the two cores are truly independent);
    * ``scaling_2v1`` = (DDP rank 0 + rank 1) / alone;
    * ``fraction`` = scaling_2v1 / ceiling_2v1 (the chapter's aim: ≥ 0.9).
    """

    def pick(rank: int, mode: str) -> dict[int, float]:
        return {
            v["batch_size"]: v["samples_per_s"]
            for v in values[rank]
            if v.get("mode", "ddp") == mode
            and not v.keys() & {"bucket_cap_mb", "gradient_as_bucket_view", "static_graph", "idle"}
        }

    alone, ranks, rows = pick(0, "alone"), sorted(values), []
    for b, base in alone.items():
        ceiling = sum(pick(r, "independent")[b] for r in ranks) / base
        scaling = sum(pick(r, "ddp")[b] for r in ranks) / base
        rows.append(
            {
                "batch_size": b,
                "ceiling_2v1": ceiling,
                "scaling_2v1": scaling,
                "fraction": scaling / ceiling,
            }
        )
    return rows
