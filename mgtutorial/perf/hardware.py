"""The links of a GPU cluster (chapters 08 and 09): published numbers of one GPU, its node and its
network ports, and the one bandwidth model of rings inside and across nodes
(:meth:`Hardware.ring_bw`).

Taught in notebooks/08b_tp_mesh_and_cost.ipynb and notebooks/09a_cost_model.ipynb (section 4); the
cost model (:mod:`mgtutorial.perf.costmodel`, which re-exports these names) and
:mod:`mgtutorial.perf.scaling` price communication with it. Units: bytes, seconds, bytes per
second, FLOP/s.
"""

from __future__ import annotations

from dataclasses import dataclass


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
    memory_bytes: float = 0.0
    """Bytes of GPU memory (HBM) per GPU."""
    nics_per_node: int = 1
    """Network ports per node, each at ``inter_bw``. A ring over k nodes crosses k node
    boundaries, leaving each node once through one port; NCCL runs one ring (channel) per port,
    so the ports carry a ring collective's inter-node traffic side by side."""

    def ring_bw(self, n_gpus: int, per_node: int | None = None) -> float:
        """Bus bandwidth (B/s per direction) of a ring over ``n_gpus``, ``per_node`` of them in
        each node (default: as many as fit, ``min(n_gpus, gpus_per_node)``).

        Inside one node: ``intra_bw``. Across nodes, each ring leaves every node once (k node
        boundaries crossed over k nodes), one ring per port, and the node's ports are shared by
        the ``gpus_per_node / per_node`` groups that communicate at the same time (e.g. the 8
        data-parallel groups of a TP = 8 layout): ``min(intra_bw,
        nics_per_node × inter_bw × per_node / gpus_per_node)``. The one model of the links for
        chapters 08 and 09: a whole DGX H100 node reaches 8 × 50 GB/s, a group with one GPU per
        node 50 GB/s, and with one port per node 1/8 of that.
        """
        if n_gpus <= self.gpus_per_node and per_node in (None, n_gpus):
            return self.intra_bw
        k = min(n_gpus, self.gpus_per_node) if per_node is None else per_node
        return min(self.intra_bw, self.nics_per_node * self.inter_bw * k / self.gpus_per_node)


H100 = Hardware(
    name="H100 SXM (DGX H100: 8 per node, NVLink 4, one 400 Gb/s NDR InfiniBand port per GPU)",
    peak_flops=989e12,
    intra_bw=450e9,
    inter_bw=50e9,
    gpus_per_node=8,
    latency=5e-6,
    nics_per_node=8,
    memory_bytes=80e9,
    sources=(
        "NVIDIA H100 Tensor Core GPU datasheet (https://www.nvidia.com/en-us/data-center/h100/): "
        "989 TFLOP/s dense BF16 (1979 with sparsity), NVLink 900 GB/s bidirectional = 450 GB/s "
        "each way, 80 GB HBM3; NVIDIA DGX H100 user guide: 8 ConnectX-7 ports per node, NDR "
        "InfiniBand 400 Gb/s = 50 GB/s per port each way; the 5 µs per ring step is an assumption."
    ),
)
