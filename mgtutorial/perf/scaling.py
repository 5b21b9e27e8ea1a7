"""What compute costs and how a step scales (chapter 09): FLOPs of the chapter's CNN, MFU, the
measured 2-rank scaling ratios, and the predicted step of a transformer on a GPU cluster.

Taught in notebooks/09a_cost_model.ipynb (sections 3 and 4) and notebooks/09b_measurement.ipynb
(section 1). Pure arithmetic, like :mod:`mgtutorial.perf.costmodel`, whose ring times and hardware
(:data:`~mgtutorial.perf.costmodel.H100`) the predictions use. Follows the MFU definition of the
PaLM paper (Chowdhery et al. 2022, appendix B) and the FLOP counts of
``torch.utils.flop_counter.FlopCounterMode`` (2 per multiply-add).

Units: FLOPs, seconds, bytes; bandwidths in bytes per second.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Literal, get_args

from mgtutorial.common.models import cnn_flatten_size, conv_out_size
from mgtutorial.perf.costmodel import BF16_FP32_REDUCE, H100, Dtypes, Hardware, ring_time

Strategy = Literal["ddp", "fsdp2", "tp"]
"""What :func:`predict_step` predicts: data parallelism, fully sharded, tensor parallelism."""
STRATEGIES = get_args(Strategy)


def conv2d_flops(batch: int, c_in: int, c_out: int, kernel: int, h_out: int, w_out: int) -> int:
    """Forward FLOPs of a Conv2d (2 per multiply-add): ``2·B·C_out·H_out·W_out·C_in·k²``."""
    return 2 * batch * c_out * h_out * w_out * c_in * kernel * kernel


def linear_flops(batch: int, d_in: int, d_out: int) -> int:
    """Forward FLOPs of a Linear layer's matmul: ``2·B·d_in·d_out``."""
    return 2 * batch * d_in * d_out


def train_flops(forward_flops: float) -> float:
    """FLOPs of forward + backward by the rule of thumb: backward costs twice the forward (input
    and weight gradients)."""
    return 3 * forward_flops


def model_flops_per_token(params: float, layers: int = 0, hidden: int = 0, seq: int = 0) -> float:
    """The PaLM paper's model FLOPs per token (Chowdhery et al. 2022, appendix B):
    ``6·Ψ + 12·L·H·Q·T``: 6Ψ for the weight matmuls (2Ψ forward, 4Ψ backward) plus attention's
    scores and weighted sum (H·Q = ``hidden``, T = ``seq``), forward and backward. Recomputation
    is *not* counted: a recomputed forward is hardware FLOPs (HFU), not model FLOPs (MFU)."""
    return 6 * params + 12 * layers * hidden * seq


def mfu(
    params: float,
    tokens: float,
    seconds: float,
    peak_flops: float,
    attention_flops_per_token: float = 0.0,
) -> float:
    """Model FLOPs utilisation: ``(6·Ψ + attention) · tokens / (seconds · peak)`` (Ψ =
    parameters; ``attention_flops_per_token`` = 12·L·h·s for PaLM's definition, see
    :func:`model_flops_per_token`; 0 leaves attention out). ``peak_flops`` is the hardware's bound
    in PaLM's definition; against a measured reference rate (chapter 09a, one CPU thread: a
    median that the hardware's fastest calls beat) the result is a share of that rate, which
    can pass 100 %."""
    return (6 * params + attention_flops_per_token) * tokens / (seconds * peak_flops)


def article_cnn_flops(
    batch: int,
    in_shape: tuple[int, int, int] = (3, 32, 32),
    channels: int = 32,
    kernel: int = 5,
    hidden: int = 64,
    classes: int = 10,
) -> int:
    """Forward FLOPs of :class:`mgtutorial.common.models.ArticleCNN` for ``batch`` images (conv
    + 2 linears; ReLU, pooling and the loss are left out: a few FLOPs per element, not per
    weight)."""
    c, h, w = in_shape
    conv = conv2d_flops(
        batch, c, channels, kernel, conv_out_size(h, kernel), conv_out_size(w, kernel)
    )
    flat = cnn_flatten_size(in_shape, channels, kernel)
    return conv + linear_flops(batch, flat, hidden) + linear_flops(batch, hidden, classes)


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
    strategy: Strategy,
    model: Transformer,
    n_gpus: int,
    tokens_per_gpu: float,
    hw: Hardware = H100,
    link_bw: float | None = None,
    efficiency: float = 0.5,
    bytes_per_value: int | None = None,
    dtypes: Dtypes = BF16_FP32_REDUCE,
    tp_degree: int | None = None,
) -> dict:
    """Predicted step time of ``strategy`` ("ddp" | "fsdp2" | "tp") on ``n_gpus`` (a *prediction*).

    Compute: ``6·Ψ·tokens_per_gpu / (peak · efficiency)`` (``efficiency``: the fraction of peak the
    kernels reach). Communication: ring collectives (:func:`ring_time`) at ``link_bw`` if given,
    else :meth:`Hardware.ring_bw`; bytes per element from ``dtypes`` (default: bf16 compute, fp32
    gradients, as chapter 07's ``MixedPrecisionPolicy(reduce_dtype=float32)`` and DDP under
    autocast); ``bytes_per_value`` if given prices every tensor at that size instead. Overlap is
    taken as perfect, an optimistic bound (the last bucket or shard cannot hide):

    * ddp: one all-reduce of the gradients (Ψ · grads bytes), as if it could start when backward
      starts and hide behind all of it (⅔ of compute);
    * fsdp2: all-gather of the parameters (compute dtype) in forward and again in backward,
      reduce-scatter of the gradients (grads dtype), prefetched, so overlapped with all of compute;
    * tp: chapter 08b's 2-D layout: TP of degree ``tp_degree`` (default ``min(n_gpus,
      gpus_per_node)``, inside a node) × FSDP2 over the ``n_gpus / tp`` data-parallel ranks (one
      GPU per node each, so the node's ports are shared by ``tp`` groups). Per block 4 all-reduces
      of the TP group's activations (tokens × hidden, activations dtype) on the critical path;
      FSDP2's traffic on Ψ/tp parameters overlapped with compute.

    Returns a dict: ``compute``, ``comm``, ``exposed``, ``step`` (s), ``efficiency`` = compute/step
    (the scaling efficiency against one GPU doing the same per-GPU work without communication);
    for "tp" also ``tp`` and ``dp`` (the degrees).
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r} is not 'ddp', 'fsdp2' or 'tp'.")
    if n_gpus < 1:
        raise ValueError(f"n_gpus={n_gpus}: need at least 1.")

    def size(kind: str) -> int:
        return bytes_per_value or dtypes.nbytes(kind)

    def bw(n: int, per_node: int | None = None) -> float:
        return link_bw or hw.ring_bw(n, per_node)

    compute = 6 * model.params * tokens_per_gpu / (hw.peak_flops * efficiency)
    out: dict = {}
    if strategy == "ddp":
        comm = ring_time("all_reduce", size("grads") * model.params, n_gpus, bw(n_gpus), hw.latency)
        exposed = max(0.0, comm - compute * 2 / 3)
    elif strategy == "fsdp2":
        comm = fsdp_time(model.params, n_gpus, bw(n_gpus), hw.latency, size)
        exposed = max(0.0, comm - compute)
    else:
        tp = tp_degree or min(n_gpus, hw.gpus_per_node)
        if n_gpus % tp:
            raise ValueError(f"tp_degree={tp} does not divide n_gpus={n_gpus}.")
        dp = n_gpus // tp
        act_bytes = size("activations") * tokens_per_gpu * tp * model.hidden
        tp_comm = 4 * model.layers * ring_time("all_reduce", act_bytes, tp, bw(tp), hw.latency)
        dp_bw = bw(dp, per_node=max(1, hw.gpus_per_node // tp) if dp > 1 else None)
        dp_comm = fsdp_time(model.params / tp, dp, dp_bw, hw.latency, size)
        comm, exposed = tp_comm + dp_comm, tp_comm + max(0.0, dp_comm - compute)
        out = {"tp": tp, "dp": dp}
    step = compute + exposed
    return {
        "compute": compute,
        "comm": comm,
        "exposed": exposed,
        "step": step,
        "efficiency": compute / step,
        **out,
    }


def fsdp_time(params: float, n: int, link_bw: float, latency: float, size) -> float:
    """FSDP2's ring time per step over ``n`` ranks: two all-gathers of the parameters
    (``size("compute")`` bytes each) and a reduce-scatter of the gradients (``size("grads")``)."""
    gather = ring_time("all_gather", size("compute") * params, n, link_bw, latency)
    return 2 * gather + ring_time("reduce_scatter", size("grads") * params, n, link_bw, latency)


def crossover_tokens(
    strategy: Literal["ddp", "fsdp2"],
    n_gpus: int,
    link_bw: float,
    hw: Hardware = H100,
    efficiency: float = 0.5,
    dtypes: Dtypes = BF16_FP32_REDUCE,
) -> float:
    """Tokens per GPU below which ``strategy``'s communication can no longer hide behind compute
    (the bandwidth terms of :func:`predict_step`, latency left out). Closed forms, P = peak ×
    efficiency, B = ``link_bw``, g and c the bytes of a gradient and of a gathered parameter:

    * ddp: the all-reduce 2(n−1)/n·g·Ψ/B hides behind ⅔ of 6Ψ·T/P → T* = (n−1)/n · g·P / (2B);
    * fsdp2: 2 all-gathers + 1 reduce-scatter, (n−1)/n·(2c + g)·Ψ/B, behind all of it →
      T* = (n−1)/n · (2c + g)·P / (6B).

    Ψ cancels: whether a data-parallel step is communication-bound depends on the tokens each GPU
    processes, the link and the kernels' speed, not on the model's size.
    """
    p, f = hw.peak_flops * efficiency, (n_gpus - 1) / n_gpus
    g, c = dtypes.nbytes("grads"), dtypes.nbytes("compute")
    return {"ddp": f * g * p / (2 * link_bw), "fsdp2": f * (2 * c + g) * p / (6 * link_bw)}[
        strategy
    ]


def tp_comm_ratio(
    tp: int,
    hidden: int,
    link_bw: float,
    hw: Hardware = H100,
    efficiency: float = 0.5,
    dtypes: Dtypes = BF16_FP32_REDUCE,
) -> float:
    """TP's exposed communication / compute per block (bandwidth terms, Megatron's 4 all-reduces
    of the group's activations, 12h² parameters per block): ``(tp − 1)·a·P / (9·h·B)`` with a the
    bytes of an activation, P = peak × efficiency, B = ``link_bw``. The tokens cancel: TP's share
    grows with tp − 1 and shrinks only with the hidden size."""
    a = dtypes.nbytes("activations")
    return (tp - 1) * a * hw.peak_flops * efficiency / (9 * hidden * link_bw)


def lockstep_time(step_times: list[list[float]], stat=statistics.median) -> float:
    """What a synchronous step of N ranks costs when each rank alone takes ``step_times[r][i]``
    at step i: ``stat`` (median by default; ``min`` for the least disturbed step) over steps of
    the slowest rank's time. DDP's collectives make every rank wait for the slowest one at every
    step; ranks that train independently do not, so the mean of their medians underestimates a
    synchronous step wherever the ranks' speeds vary."""
    return stat(max(ts) for ts in zip(*step_times))


def scaling_ratios(values: dict[int, list[dict]]) -> list[dict]:
    """Per batch size: the 2-rank ceiling, DDP's 2-rank scaling, and how close DDP gets to the
    ceiling.

    ``values``: rank → :func:`mgtutorial.perf.sweeps.step_worker` results of one 2-rank job
    whose variants include, per batch size, the modes "alone", "independent" and "ddp" (variants
    with other DDP keywords are ignored). Throughputs are ``samples_per_s``:

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
