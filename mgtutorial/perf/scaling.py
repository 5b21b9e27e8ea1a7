"""What compute costs and how a step scales (chapter 09): FLOPs of the chapter's CNN, MFU, the
measured 2-rank scaling ratios, and the predicted step of a transformer on a GPU cluster.

Taught in notebooks/09_performance.ipynb, sections 3, 4 and 7. Pure arithmetic, like
:mod:`mgtutorial.perf.costmodel`, whose ring times and hardware
(:data:`~mgtutorial.perf.costmodel.H100`) the predictions use. Follows the MFU definition of the
PaLM paper (Chowdhery et al. 2022, appendix B) and the FLOP counts of
``torch.utils.flop_counter.FlopCounterMode`` (2 per multiply-add).

Units: FLOPs, seconds, bytes; bandwidths in bytes per second.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from mgtutorial.common.models import cnn_flatten_size, conv_out_size
from mgtutorial.perf.costmodel import H100, Hardware, ring_time

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


def mfu(params: float, tokens: float, seconds: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: ``6·Ψ·tokens / (seconds · peak)`` (Ψ = parameters).

    6Ψ per token = 2Ψ forward + 4Ψ backward; it leaves out attention's score FLOPs and any
    recomputation, which is why it is a *model* (not hardware) FLOP count.
    """
    return 6 * params * tokens / (seconds * peak_flops)


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
    if strategy not in STRATEGIES:
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
        gather = ring_time("all_gather", grad_bytes, n_gpus, bw, hw.latency)
        comm = 2 * gather + ring_time("reduce_scatter", grad_bytes, n_gpus, bw, hw.latency)
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
