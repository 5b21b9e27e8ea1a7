"""All five dimensions on one device mesh: a (pp, dp, ep, cp, tp) layout of a mixture-of-experts
transformer on a GPU cluster, which collectives run on which dimension and how often, memory per
GPU and the step time, from chapter 09's cost model (pure arithmetic, a *prediction*).

Taught in notebooks/10b_expert_parallel.ipynb (section 4, with :func:`explorer`). The mesh's order,
outermost first, is torchtitan's (``ParallelDims`` in ``torchtitan/distributed/parallel_dims.py``:
pp, dp, cp, tp, with ep over the data-parallel ranks); here ep is a dimension of its own, as in the
Ultra-Scale Playbook (https://huggingface.co/spaces/nanotron/ultrascale-playbook), whose dense
layers are data parallel over it. Times use :func:`mgtutorial.perf.costmodel.ring_time` and
:data:`mgtutorial.perf.costmodel.H100`; model states use
:func:`mgtutorial.sharding.memory.memory_per_rank` (FSDP, "mixed": 16 bytes per parameter);
activations :func:`mgtutorial.context_expert.attention_cost.layer_activation_bytes`; the bubble
:func:`mgtutorial.pipeline.bubble.bubble_formula`.

Units: bytes, seconds.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from mgtutorial.context_expert.attention_cost import layer_activation_bytes
from mgtutorial.perf.costmodel import H100, Hardware, ring_time
from mgtutorial.pipeline.bubble import bubble_formula
from mgtutorial.sharding.memory import memory_per_rank

DIMS = ("pp", "dp", "ep", "cp", "tp")
"""The mesh's dimensions, outermost first: consecutive ranks differ in tp first."""
BF16 = 2
"""Bytes per activation, gradient and communicated value (bf16, as ``predict_step``'s default)."""


@dataclass(frozen=True)
class MoEModel:
    """A mixture-of-experts transformer: every layer has attention and E experts (SwiGLU MLPs of
    inner width ``ffn``), each token going to ``top_k`` of them. Defaults: the shape of Mixtral
    8x7B (https://arxiv.org/abs/2401.04088, table 1: 47 B parameters, 13 B active; the 0.26 B of
    embeddings, the router and the norms are left out here), at a 32k-token context."""

    layers: int = 32
    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 8
    """Key/value heads (grouped-query attention: each serves heads / kv_heads query heads)."""
    ffn: int = 14336
    experts: int = 8
    top_k: int = 2
    seq: int = 32768

    @property
    def dense_params(self) -> float:
        """Attention per layer: q and o h² each, k and v h² · kv_heads / heads each (router and
        norms left out)."""
        return self.layers * self.hidden**2 * (2 + 2 * self.kv_heads / self.heads)

    @property
    def expert_params(self) -> float:
        """E experts of 3·h·ffn per layer (SwiGLU: gate, up and down matrices, as in Mixtral)."""
        return self.layers * self.experts * 3 * self.hidden * self.ffn

    @property
    def active_params(self) -> float:
        """Parameters one token uses: attention + top_k experts."""
        return self.dense_params + self.expert_params * self.top_k / self.experts


@dataclass(frozen=True)
class Layout:
    """Degrees of the five dimensions, the micro-batches of the pipeline and the sequences per
    step (the global batch)."""

    pp: int = 1
    dp: int = 1
    ep: int = 1
    cp: int = 1
    tp: int = 1
    micro_batches: int = 8
    batch: int = 64
    order: tuple[str, ...] = DIMS
    """The dimensions, outermost first: the last one's ranks are consecutive (inside a node)."""

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.ep * self.cp * self.tp


def check_layout(lay: Layout, model: MoEModel, gpus: int) -> None:
    """Refuse a layout the model or the cluster cannot take.

    Raises:
        ValueError: naming the value and the fix (product ≠ gpus; heads, experts, layers, the
            sequence or the batch not divisible by their dimension).
    """
    if sorted(lay.order) != sorted(DIMS):
        raise ValueError(f"order={lay.order}: list each of {DIMS} once.")
    if lay.world != gpus:
        raise ValueError(
            f"pp·dp·ep·cp·tp = {lay.world}, not the {gpus} GPUs: change a degree so that the "
            f"product is {gpus}."
        )
    needs = [
        ("kv_heads", model.kv_heads, "tp", lay.tp),
        ("experts", model.experts, "ep", lay.ep),
        ("layers", model.layers, "pp", lay.pp),
        ("seq", model.seq, "2·cp", 2 * lay.cp),
        ("batch", lay.batch, "dp·ep·micro_batches", lay.dp * lay.ep * lay.micro_batches),
    ]
    for name, value, dim, degree in needs:
        if value % degree:
            raise ValueError(f"{name}={value} is not divisible by {dim}={degree}: change {dim}.")


def stride(lay: Layout, dims: tuple[str, ...]) -> int:
    """Rank distance between neighbours of one group over ``dims`` (flattened): the product of
    the degrees of every dimension inside them in ``lay.order``."""
    inner = max(lay.order.index(d) for d in dims)
    return math.prod(getattr(lay, d) for d in lay.order[inner + 1 :])


def group_bw(lay: Layout, dims: tuple[str, ...], hw: Hardware = H100) -> float:
    """Bandwidth (B/s per GPU per direction) one group over ``dims`` gets: NVLink when the group
    lies in one node; each GPU's own InfiniBand port when every neighbour is in another node
    (stride ≥ GPUs per node); else :meth:`Hardware.ring_bw` of its span (a few hops leave the
    node, over the node's ports together)."""
    step, size = stride(lay, dims), math.prod(getattr(lay, d) for d in dims)
    if step * size <= hw.gpus_per_node:
        return hw.intra_bw
    return hw.inter_bw if step >= hw.gpus_per_node else hw.ring_bw(step * size)


def traffic(lay: Layout, model: MoEModel, hw: Hardware = H100) -> list[dict]:
    """One row per dimension: its collective, calls per step per GPU, bytes per call per GPU, the
    bandwidth its groups get (:func:`group_bw`) and the seconds per step.

    tp: Megatron's f/g, 4 all-reduces of the micro-batch's activations per layer (2 forward, 2
    backward); cp: per layer the k/v ring (an all-gather's bytes; k and v have ``kv_heads`` heads)
    forward, k/v and their gradients backward; ep: dispatch and combine, forward and backward (4
    all-to-alls per layer, each rank sending ``(ep−1)/ep`` of its ``top_k`` rows per token, timed as
    an all-gather of the same size); dp: FSDP (ZeRO-3, as :func:`memory` assumes) gathers the bf16
    weights in forward and in backward of every micro-batch and reduce-scatters the gradients once
    per step, the dense weights over dp·ep·cp (every rank holding the same dense shard), the experts
    over dp; pp: the activation and its gradient across each stage boundary per micro-batch.
    """
    m, layers = lay.micro_batches, model.layers // lay.pp
    tokens = lay.batch // (lay.dp * lay.ep * m) * model.seq // lay.cp  # per micro-batch and rank
    act = tokens * model.hidden * BF16
    rows = []

    def row(dim, dims, op, collective, calls, nbytes, n):
        if n == 1 or not calls:
            return  # a group of one rank sends nothing
        bw = group_bw(lay, dims, hw)
        t = calls * ring_time(op, nbytes, n, bw, hw.latency)
        rows.append(
            dict(dim=dim, collective=collective, calls=calls, bytes=nbytes, bw=bw, seconds=t)
        )

    row("tp", ("tp",), "all_reduce", "all-reduce", 4 * layers * m, act, lay.tp)
    # every rank's k and v blocks together: kv_heads / heads of the hidden size, split over tp
    kv = 2 * act * model.kv_heads // model.heads // lay.tp * lay.cp
    row("cp", ("cp",), "all_gather", "send/recv ring", 3 * layers * m, kv, lay.cp)
    a2a = act * model.top_k // lay.tp
    row("ep", ("ep",), "all_gather", "all-to-all", 4 * layers * m, a2a, lay.ep)
    dense = BF16 * model.dense_params / (lay.tp * lay.pp)
    experts = BF16 * model.expert_params / (lay.ep * lay.tp * lay.pp)
    shards = (("dp·ep·cp", ("dp", "ep", "cp"), "dense", dense), ("dp", ("dp",), "experts", experts))
    for dim, dims, what, nbytes in shards:
        n = math.prod(getattr(lay, d) for d in dims)
        row(dim, dims, "all_gather", f"all-gather ({what})", 2 * m, nbytes, n)
        row(dim, dims, "reduce_scatter", f"reduce-scatter ({what})", 1, nbytes, n)
    hop = act // lay.tp
    row("pp", ("pp",), "broadcast", "send/recv", 2 * m if lay.pp > 1 else 0, hop, 2)
    return rows


def step_time(lay: Layout, model: MoEModel, hw: Hardware = H100, efficiency: float = 0.5):
    """Predicted step: compute ``(6·Ψ_active + 6·L·s·h)·tokens / (GPUs · peak · efficiency)`` (the
    second term: causal attention's scores), stretched by the pipeline's bubble
    ``(pp−1)/(m+pp−1)``, plus what communication cannot hide: tp, ep and pp all of it (on the
    critical path), cp what exceeds attention's compute, dp what exceeds all of compute (FSDP
    prefetches, as :func:`mgtutorial.perf.scaling.predict_step` assumes).

    Returns {"compute", "bubble", dimension: exposed seconds, "step"}.
    """
    tokens = lay.batch * model.seq
    rate = lay.world * hw.peak_flops * efficiency
    attention = 6 * model.layers * model.seq * model.hidden * tokens / rate
    compute = 6 * model.active_params * tokens / rate + attention
    bubble = compute / (1 - bubble_formula(lay.pp, lay.micro_batches)) - compute
    comm = {d: 0.0 for d in ("tp", "cp", "ep", "dp", "pp")}
    for r in traffic(lay, model, hw):
        comm[r["dim"][:2]] += r["seconds"]
    exposed = dict(comm, cp=max(0.0, comm["cp"] - attention), dp=max(0.0, comm["dp"] - compute))
    return {
        "compute": compute,
        "bubble": bubble,
        **exposed,
        "step": compute + bubble + sum(exposed.values()),
    }


def memory(lay: Layout, model: MoEModel) -> dict:
    """Bytes per GPU: model states (FSDP over the ranks that hold the same shard, "mixed": bf16
    parameters and gradients, fp32 master weights and Adam: 16 bytes per parameter), and the
    activations of the layers of one stage for ``min(pp, micro_batches)`` micro-batches in flight
    (1F1B's first stage), with flash attention. The activations are a dense layer's (Korthikanti
    et al.'s count): an MoE layer keeps top_k copies of each token's MLP activations, which this
    leaves out. Returns {"states", "activations", "total"}."""
    dense = memory_per_rank(
        [(int(model.dense_params // (lay.tp * lay.pp)),)],
        lay.dp * lay.ep * lay.cp,
        "zero3",
        "mixed",
    )["total"]
    experts = memory_per_rank(
        [(int(model.expert_params // (lay.ep * lay.tp * lay.pp)),)], lay.dp, "zero3", "mixed"
    )["total"]
    b = lay.batch // (lay.dp * lay.ep * lay.micro_batches)
    per_layer = layer_activation_bytes(model.seq, b, model.hidden, model.heads, lay.tp, lay.cp)
    acts = model.layers // lay.pp * per_layer * min(lay.pp, lay.micro_batches)
    return {"states": dense + experts, "activations": acts, "total": dense + experts + acts}


def report(lay: Layout, model: MoEModel, hw: Hardware = H100) -> str:
    """The layout as text: the mesh, each dimension's traffic, memory and step time."""
    lines = ["mesh " + " × ".join(f"{d}={getattr(lay, d)}" for d in lay.order) + f" = {lay.world}"]
    for r in traffic(lay, model, hw):
        where = "NVLink" if r["bw"] == hw.intra_bw else "InfiniBand"
        lines.append(
            f"  {r['dim']:8} {r['collective']:21} {r['calls']:5} × "
            f"{r['bytes'] / 2**20:8.1f} MiB over {where:10} {r['seconds'] * 1e3:8.1f} ms"
        )
    mem, t = memory(lay, model), step_time(lay, model, hw)
    fits = "fits in" if mem["total"] <= hw.memory_bytes else "exceeds"
    lines.append(
        f"  memory per GPU: {mem['states'] / 1e9:.1f} GB states + "
        f"{mem['activations'] / 1e9:.1f} GB activations = {mem['total'] / 1e9:.1f} GB "
        f"({fits} {hw.memory_bytes / 1e9:.0f} GB)"
    )
    shown = ", ".join(f"{k} {v * 1e3:.0f}" for k, v in t.items() if k != "step" and v)
    lines.append(f"  step {t['step']:.2f} s (ms: {shown})")
    return "\n".join(lines)


def explorer(model: MoEModel = MoEModel(), gpus: int = 64, lay: Layout = Layout()):
    """Dropdowns for the five degrees, redrawing :func:`report` (or the refusal of
    :func:`check_layout`) whenever one changes. Returns the widget box."""
    import ipywidgets as widgets

    options = [2**i for i in range(int(math.log2(gpus)) + 1)]
    boxes = {
        d: widgets.Dropdown(
            options=options,
            value=getattr(lay, d),
            description=d,
            layout=widgets.Layout(width="130px"),
        )
        for d in DIMS
    }
    out = widgets.Output()

    def redraw(_=None):
        chosen = Layout(**dict(asdict(lay), **{d: b.value for d, b in boxes.items()}))
        out.clear_output()
        with out:
            try:
                check_layout(chosen, model, gpus)
                print(report(chosen, model))
            except ValueError as err:
                print("refused:", err)

    for b in boxes.values():
        b.observe(redraw, names="value")
    redraw()
    return widgets.VBox([widgets.HBox(list(boxes.values())), out])
